"""``ServerLifecycle``: the server's start (engine, tokenizer, start line), drain and stop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable

from .handle import EngineHandle
from .server_state import ServerState
from .start_line import auth_line, engine_line, memory_line, spec_line

log = logging.getLogger("tokenmill.serve")

#: At shutdown, how long (s) to wait for the stopped streams to end and for the engine's final
#: records of their requests.
SHUTDOWN_SETTLE_S = 3.0
#: what the exit needs besides the OTLP flush (uvicorn's stop before the lifespan ends, the
#: interpreter's exit after it: 1.2 s on the 2-core CPU host): the flush ends this long before
#: --shutdown-timeout runs out, counted from the lifespan's end
EXIT_RESERVE_S = 2.0


def runtime_versions() -> dict[str, str | None]:
    """The versions a run's numbers depend on, for the ``config`` event (a comparison of two
    dumps names a changed one): tokenmill, torch, triton, transformers (installed package
    metadata; None when a package is not installed) and Python."""
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("tokenmill", "torch", "triton", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


class ServerLifecycle:
    """What ``tokenmill serve`` does as it starts and stops, around uvicorn's serving.

    :meth:`lifespan` (the app's lifespan) starts the engine worker and waits for the API's
    tokenizer, starts telemetry, writes the ``config`` event and announces the start line; at
    its end it stops the engine and closes telemetry within ``--shutdown-timeout``.
    :meth:`drain` and :meth:`stop` are the :class:`~.shutdown.DrainingServer`'s first and
    final stop; :meth:`on_engine_event` stops serving on an engine crash loop.

    ``telemetry`` is the ``tokenmill.telemetry.Telemetry`` that ``server.py`` built (used only
    through its calls); ``server`` is set once the :class:`~.shutdown.DrainingServer` exists.
    """

    def __init__(
        self,
        *,
        config,
        opts,
        worker: EngineHandle,
        telemetry,
        state: ServerState,
        tokenizer_load: concurrent.futures.Future,
        tenants,
        announce: Callable[[str], object] = print,
    ):
        self.config = config
        self.opts = opts
        self.worker = worker
        self.telemetry = telemetry
        self.state = state
        self.tokenizer_load = tokenizer_load
        self.tenants = tenants
        self.announce = announce
        self.server = None  # the DrainingServer
        self.cut_at_stop = 0  # the open streams the stop ended (for the last log line)

    def on_engine_event(self, kind: str, severity: str, message: str, **_) -> None:
        """An engine core that keeps crashing: stop serving so the supervisor takes over."""
        server = self.server
        if kind == "engine_crash_loop" and server.fatal_error is None:
            server.fatal_error = message
            self.stop("engine crash loop")
            server.should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The app's lifespan: start, then serve, then stop what was started."""
        info = await self._start_engine()
        self._start_telemetry(info)
        self._announce_start(info)
        waiting = asyncio.create_task(self.state.sample_waiting())
        try:
            yield
        finally:
            await self._shut_down(waiting)

    async def _start_engine(self) -> dict:
        """Start the engine worker and take the API's tokenizer (loading in a thread since
        ``make_server``); a failure closes telemetry and is the server's ``startup_error``."""
        try:
            info = await self.worker.start()
            try:
                self.state.tokenize.tokenizer = await asyncio.wrap_future(self.tokenizer_load)
            except BaseException:
                await self.worker.stop()
                raise
        except BaseException as exc:
            self.telemetry.close()
            # the CLI prints this as its one error line; uvicorn would add a traceback
            self.server.startup_error = str(exc)
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
            raise
        return info

    def _start_telemetry(self, info: dict) -> None:
        """Telemetry's samplers, the ``config`` event, the weight-bytes and build-info series."""
        telemetry, worker = self.telemetry, self.worker
        telemetry.engine_pid = info["pid"]
        # read at each sample: a replica that restarts has a new pid
        telemetry.start(engine_pids=(lambda: worker.pids) if info.get("pids") else [info["pid"]])
        model_info = info.get("model_info") or {}
        telemetry.event(
            "config",
            "info",
            "engine flags at start",
            **self.config.to_dict(),
            **model_info,
            versions=runtime_versions(),
        )
        telemetry.metrics.set_weight_bytes(model_info.get("weight_bytes_by_dtype") or {})
        versions = runtime_versions()
        telemetry.metrics.set_build_info(
            versions.get("tokenmill"),
            versions.get("python"),
            versions.get("torch"),
            model_info.get("int8_compute_path"),
        )

    def _announce_start(self, info: dict) -> None:
        """The tokenize station's limits from the engine, and the start line."""
        telemetry, state, opts = self.telemetry, self.state, self.opts
        if telemetry.store_error:
            self.announce(
                f"warning: trace store unavailable ({telemetry.store_error}); serving without it"
            )
        state.tokenize.max_model_len = info["max_model_len"]
        state.tokenize.vocab_size = info["vocab_size"]
        kv_tokens = info["num_blocks"] * self.config.block_size
        model_info = info.get("model_info") or {}
        self.announce(
            f"tokenmill serving {state.model_name!r} at http://{opts.host}:{opts.port}/v1  "
            f"({engine_line(info, kv_tokens)}, "
            f"context {info['max_model_len']}; {memory_line(model_info)}"
            f"{spec_line(self.config)}"
            f"{auth_line(opts.tenants, self.tenants, state.gateway.metrics_keyed)}; "
            f"telemetry: /metrics, /health, trace store {telemetry.trace_db or 'off'})"
        )

    async def _shut_down(self, waiting: asyncio.Task) -> None:
        """The lifespan's end: stop the streams, wait for the engine's last records, stop the
        engine, flush telemetry in what ``--shutdown-timeout`` leaves."""
        state, telemetry = self.state, self.telemetry
        stopping = time.monotonic()
        waiting.cancel()
        self.stop("lifespan end")  # no-op after a signal began it
        deadline = time.monotonic() + SHUTDOWN_SETTLE_S
        while state.unrecorded and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the stopped streams end, the engine's records come
        await self.worker.stop()
        state.record_awaiting()
        # the OTLP flush (a collector that hangs) gets what --shutdown-timeout leaves
        left = self.opts.shutdown_timeout - (time.monotonic() - stopping) - EXIT_RESERVE_S
        telemetry.close(max(0.0, left))
        log.warning(
            "stopped: %d requests cut at the stop, engine cores down, trace store %s",
            self.cut_at_stop,
            "written" if telemetry.trace_db else "off",
        )

    def drain(self, cause: str) -> None:
        """A first stop signal: take no new requests, let those in flight finish (DrainingServer)."""
        state, timeout = self.state, self.opts.shutdown_timeout
        state.draining = True
        self.telemetry.event(
            "server_draining",
            "info",
            f"server draining ({cause}): {state.open_requests} requests in flight get up to "
            f"{timeout:g} s to finish; new requests get 503",
            cause=cause,
            open_requests=state.open_requests,
        )
        log.warning(
            "%s: draining %d requests in flight (up to %g s)", cause, state.open_requests, timeout
        )

    def stop(self, cause: str) -> None:
        """Begin the shutdown once: record it, end the open streams (``server_shutdown``)."""
        n = self.state.begin_shutdown()
        if n is not None:
            self.cut_at_stop = n
            self.telemetry.event(
                "server_shutdown",
                "info",
                f"server shutting down ({cause}); {n} open requests stopped",
                cause=cause,
                open_requests=n,
            )
