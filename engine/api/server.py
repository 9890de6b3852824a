"""``tokenmill serve``: build the stations, start the engine worker, run uvicorn."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from pathlib import Path

import uvicorn

from ..config import EngineConfig
from ..model_config import load_model_config
from ..model_fetch import resolve_model_dir
from ..serve_config import ServeConfig
from ..tokenizer import load_tokenizer
from .app import ServerState, build_app
from .errors import APIError
from .gateway import (
    Gateway,
    TenantsFileError,
    hash_key,
    is_loopback,
    load_tenants,
    single_key_tenants,
)
from .replicas import ReplicaPool, check_data_parallel
from .shutdown import DrainingServer
from .stations import AdmissionStation, MeteringStation, TokenizeStation
from .worker import EngineWorker

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


def fmt_bytes(n: float) -> str:
    """``n`` bytes as MiB (under 1 GiB) or GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def spec_line(config) -> str:
    """``"speculative decoding ngram K=4 (n-grams 2-4); "`` when ``--speculative-config`` is
    set, else ``""`` (the start line)."""
    from ..spec_config import parse_speculative_config

    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return ""
    cut = f", off above {spec.disable_by_batch_size} running" if spec.disable_by_batch_size else ""
    return (
        f"speculative decoding {spec.method} K={spec.num_speculative_tokens} "
        f"(n-grams {spec.prompt_lookup_min}-{spec.prompt_lookup_max}{cut}); "
    )


def engine_line(info: dict, kv_tokens: int) -> str:
    """The start line's engine part: ``engine pid 123, KV capacity 4096 tokens in 256 blocks``;
    with data parallelism every replica's pid and the capacity as each replica's; with
    disaggregation the prefill and the decode core's pids."""
    pids = info.get("pids") or [info["pid"]]
    blocks = f"{kv_tokens} tokens in {info['num_blocks']} blocks"
    if info.get("roles") and len(info["roles"]) == len(pids):  # --disaggregation
        cores = ", ".join(f"{role} core pid {pid}" for role, pid in zip(info["roles"], pids))
        return f"{cores}, KV capacity {blocks} each"
    if len(pids) == 1:
        return f"engine pid {pids[0]}, KV capacity {blocks}"
    return (
        f"{len(pids)} engine replicas, pids {', '.join(map(str, pids))}, KV capacity {blocks} each"
    )


def memory_line(model_info: dict) -> str:
    """The startup line's memory and roofline part: weight bytes by dtype, the KV pool, the
    device's peaks and their sources, whether the compiled decode step is on
    (``EngineReady.model_info``); empty without it."""
    if not model_info.get("weight_bytes_by_dtype"):
        return ""
    by_dtype = ", ".join(
        f"{dtype} {fmt_bytes(n)}" for dtype, n in model_info["weight_bytes_by_dtype"].items()
    )
    line = f"weights {fmt_bytes(model_info['weight_bytes_total'])} ({by_dtype})"
    if model_info.get("kv_cache_bytes"):
        line += f", KV cache {fmt_bytes(model_info['kv_cache_bytes'])}"
    gbps, gflops = model_info.get("device_peak_gbps"), model_info.get("device_peak_gflops")
    if gbps and gflops:
        sources = {
            model_info.get("device_peak_gbps_source"),
            model_info.get("device_peak_gflops_source"),
        }
        line += (
            f"; roofline peaks {gbps:,.0f} GB/s, {gflops:,.0f} GFLOP/s "
            f"({', '.join(sorted(s for s in sources if s))})"
        )
    compiled = model_info.get("compiled_decode")
    if compiled:
        line += f"; compiled decode step {compiled if compiled == 'on' else f'off ({compiled})'}"
    if model_info.get("int4_activations_used"):
        line += f"; int4 on {model_info['int4_activations_used']} activations"
    if model_info.get("int8_compute_path"):
        line += f"; int8 compute on {model_info['int8_compute_path']}"
    kernels = model_info.get("cpu_kernels")
    if kernels:
        line += f"; C kernels {kernels if kernels == 'on' else f'off ({kernels})'}"
    return line + "; "


def serving_cores(config) -> int:
    """The engine cores whose batches hold a request until it ends: the replicas, or with
    ``--disaggregation`` the decode cores (admission lets ``--max-num-seqs`` run on each)."""
    spec = config.pd_spec()
    return spec.decode if spec is not None else config.data_parallel_size


def engine_workers(config) -> EngineWorker | ReplicaPool:
    """One engine worker, a :class:`ReplicaPool` of ``--data-parallel-size`` of them, or a
    prefill and decode workers (``PDPool``, ``--disaggregation``).

    Raises:
        ValueError: the machine cannot hold that many replicas (one line).
    """
    spec = config.pd_spec()
    if spec is not None:
        from .disaggregated import PDPool

        return PDPool(config, spec)
    if config.data_parallel_size == 1:
        return EngineWorker(config)
    cpus = os.cpu_count() or 1
    cuda = 0
    if config.device != "cpu":
        import torch  # only here: the API's own code has no other use for it

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_data_parallel(config, cpus, cuda)
    if config.device == "auto" and cuda:
        config.device = "cuda"
    return ReplicaPool(config, cpu_count=cpus)


class Unauthenticated(TenantsFileError):
    """A server that would answer anyone on a non-loopback address (one line)."""


def _tenants(tenants_file: str | None, api_key: str | None, admin_key: str | None):
    """The tenants from the tenants file or ``--api-key`` (None: open local mode)."""
    if tenants_file and api_key:
        raise TenantsFileError("give --api-key or --tenants, not both")
    if admin_key and not api_key:
        raise TenantsFileError(
            "--admin-key goes with --api-key (a tenants file has its own [admin] key)"
        )
    if tenants_file:
        return load_tenants(tenants_file)
    if api_key is not None:
        if not api_key.strip():
            raise TenantsFileError("--api-key (TOKENMILL_API_KEY) is empty")
        return single_key_tenants(api_key.strip(), admin_key)
    return None


def _auth_line(tenants_file: str | None, tenants, metrics_keyed: bool) -> str:
    """How the server authenticates, for its start line (never a key)."""
    if tenants_file:
        line = f"tenants from {tenants_file}"
    elif tenants is not None:
        line = "one API key" + (" and an admin key" if tenants.admin_key_sha256 else "")
    else:
        line = "open local mode, no API keys"
    if metrics_keyed:
        return line + ", keyed /metrics"
    return line + (", open /metrics" if tenants is not None else "")


def make_server(
    config: EngineConfig, serve: ServeConfig | None = None, *, announce=print
) -> uvicorn.Server:
    """A configured uvicorn server whose startup launches the engine worker.

    ``serve`` (default: every :class:`ServeConfig` default) holds the server's settings, each
    field documented there: the address and keys (a tenants file, or one API key with an admin
    key; without a key only loopback is served unless ``allow_unauthenticated``), the trace
    store and its roll-outs (``telemetry/retention.py``), the stall thresholds of ``/health``,
    the restart limit (past it ``server.fatal_error`` says why and the CLI exits 1), the SIGTERM
    drain and the stream fault drill (case C03: a per-chunk delay after the first token).

    Raises:
        TenantsFileError, ModelLoadError: bad tenants file or model folder (before any start).
        Unauthenticated: a non-loopback ``host`` with no key and no ``allow_unauthenticated``.
    """
    from tokenmill.telemetry.store import default_trace_db

    opts = serve or ServeConfig()
    tenants = _tenants(opts.tenants, opts.api_key, opts.admin_key)
    if opts.open_metrics and opts.metrics_key:
        raise ValueError("--open-metrics opens /metrics to any caller: drop it or --metrics-key")
    trace_db = None if opts.no_trace_db or opts.no_tracing else (opts.trace_db or "default")
    retention = {
        "retention_s": opts.trace_retention,
        "max_bytes": opts.trace_max_bytes,
        "archive": opts.trace_archive,
    }
    if trace_db is not None:
        trace_db = default_trace_db(None if trace_db == "default" else trace_db)
    elif opts.otlp_receiver:
        raise ValueError("--otlp-receiver stores what it takes: it needs the trace store "
                         "(drop --no-trace-db / --no-tracing)")  # fmt: skip
    if tenants is None and not is_loopback(opts.host) and not opts.allow_unauthenticated:
        raise Unauthenticated(
            f"refusing to serve {opts.host} without API keys: give --api-key (or TOKENMILL_API_KEY) "
            "or --tenants, or --allow-unauthenticated to serve it open"
        )
    model_dir = resolve_model_dir(config.model)
    config.model = str(model_dir)
    load_model_config(model_dir)  # a missing folder or config.json says so before any start
    # the API's tokenizer (2-3 s, most of it importing transformers) loads while the engine
    # core starts instead of before it; the lifespan waits for both. A bad tokenizer still
    # fails the start with the loader's one line (the engine core loads the same files).
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
    tokenizer_load = pool.submit(load_tokenizer, model_dir)
    pool.shutdown(wait=False)
    if tenants is None and not is_loopback(opts.host):
        log.warning("serving %s with no API keys (--allow-unauthenticated)", opts.host)
    worker = engine_workers(config)
    name = opts.served_model_name or Path(model_dir).name
    # the composition root: the API sees telemetry only through on_request/on_step/health
    from tokenmill.telemetry.hub import Telemetry

    telemetry = Telemetry(
        name,
        trace_db=trace_db,
        tracing=not opts.no_tracing,
        otlp_endpoint=opts.otlp_endpoint,
        device_sample_interval_s=opts.device_sample_interval,
        trace_content=opts.trace_content,
        retention=retention,
    )
    # replicas, or both sides' engine cores: the state gauges then come per replica
    telemetry.metrics.data_parallel_size = len(worker.workers)
    worker.add_step_listener(telemetry.on_step)
    worker.add_abandoned_listener(telemetry.on_abandoned)
    worker.add_abandoned_listener(lambda out: state.on_engine_final(out))
    worker.add_event_listener(
        lambda kind, sev, msg, **attrs: telemetry.event(kind, sev, msg, **attrs)
    )
    for w in worker.workers:
        w.max_crashes, w.crash_window_s = opts.engine_restart_limit, opts.engine_restart_window

    def on_crash_loop(kind: str, severity: str, message: str, **_) -> None:
        """An engine core that keeps crashing: stop serving so the supervisor takes over."""
        if kind == "engine_crash_loop" and server.fatal_error is None:
            server.fatal_error = message
            stop("engine crash loop")
            server.should_exit = True

    worker.add_event_listener(on_crash_loop)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            info = await worker.start()
            try:
                state.tokenize.tokenizer = await asyncio.wrap_future(tokenizer_load)
            except BaseException:
                await worker.stop()
                raise
        except BaseException as exc:
            telemetry.close()
            # the CLI prints this as its one error line; uvicorn would add a traceback
            server.startup_error = str(exc)
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
            raise
        telemetry.engine_pid = info["pid"]
        # read at each sample: a replica that restarts has a new pid
        telemetry.start(engine_pids=(lambda: worker.pids) if info.get("pids") else [info["pid"]])
        model_info = info.get("model_info") or {}
        telemetry.event(
            "config",
            "info",
            "engine flags at start",
            **config.to_dict(),
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
        if telemetry.store_error:
            announce(
                f"warning: trace store unavailable ({telemetry.store_error}); serving without it"
            )
        state.tokenize.max_model_len = info["max_model_len"]
        state.tokenize.vocab_size = info["vocab_size"]
        kv_tokens = info["num_blocks"] * config.block_size
        announce(
            f"tokenmill serving {name!r} at http://{opts.host}:{opts.port}/v1  "
            f"({engine_line(info, kv_tokens)}, "
            f"context {info['max_model_len']}; {memory_line(model_info)}{spec_line(config)}"
            f"{_auth_line(opts.tenants, tenants, state.gateway.metrics_keyed)}; "
            f"telemetry: /metrics, /health, trace store {telemetry.trace_db or 'off'})"
        )
        waiting = asyncio.create_task(state.sample_waiting())
        try:
            yield
        finally:
            stopping = time.monotonic()
            waiting.cancel()
            stop("lifespan end")  # no-op after a signal began it
            deadline = time.monotonic() + SHUTDOWN_SETTLE_S
            while state.unrecorded and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # the stopped streams end, the engine's records come
            await worker.stop()
            state.record_awaiting()
            # the OTLP flush (a collector that hangs) gets what --shutdown-timeout leaves
            left = opts.shutdown_timeout - (time.monotonic() - stopping) - EXIT_RESERVE_S
            telemetry.close(max(0.0, left))
            log.warning(
                "stopped: %d requests cut at the stop, engine cores down, trace store %s",
                cut_at_stop[0],
                "written" if telemetry.trace_db else "off",
            )

    def drain(cause: str) -> None:
        """A first stop signal: take no new requests, let those in flight finish (DrainingServer)."""
        state.draining = True
        telemetry.event(
            "server_draining",
            "info",
            f"server draining ({cause}): {state.open_requests} requests in flight get up to "
            f"{opts.shutdown_timeout:g} s to finish; new requests get 503",
            cause=cause,
            open_requests=state.open_requests,
        )
        log.warning(
            "%s: draining %d requests in flight (up to %g s)",
            cause,
            state.open_requests,
            opts.shutdown_timeout,
        )

    cut_at_stop = [0]  # the open streams the stop ended (for the last log line)

    def stop(cause: str) -> None:
        """Begin the shutdown once: record it, end the open streams (``server_shutdown``)."""
        n = state.begin_shutdown()
        if n is not None:
            cut_at_stop[0] = n
            telemetry.event(
                "server_shutdown",
                "info",
                f"server shutting down ({cause}); {n} open requests stopped",
                cause=cause,
                open_requests=n,
            )

    state = ServerState(
        worker=worker,
        gateway=Gateway(
            tenants,
            metrics_key_sha256=hash_key(opts.metrics_key) if opts.metrics_key else None,
            open_metrics=opts.open_metrics,
        ),
        tokenize=TokenizeStation(None, config.max_model_len or 1 << 30, 1 << 31),
        admission=AdmissionStation(config.max_num_seqs * serving_cores(config), opts.max_queue_len),
        metering=MeteringStation(),
        model_name=name,
        max_body_bytes=opts.max_body_bytes,
        block_size=config.block_size,
        telemetry=telemetry,
        trace_content=opts.trace_content,
        fault_stream_delay_s=opts.fault_stream_delay_ms / 1000.0,
        access_log=opts.access_log,
    )
    state.engine_stall_degraded_s = opts.engine_stall_degraded
    state.engine_stall_unavailable_s = max(
        opts.engine_stall_unavailable, opts.engine_stall_degraded
    )
    worker.silent_after_s = state.engine_stall_degraded_s
    app = build_app(state)
    app.router.lifespan_context = lifespan
    if opts.otlp_receiver and telemetry.store is not None:
        from tokenmill.telemetry.collect import add_receiver

        def admin_only(request):
            client = request.client.host if request.client else None
            try:
                state.gateway.authenticate_admin(request.headers.get("authorization"), client)
            except APIError as exc:
                return exc.response(getattr(request.state, "request_id", None))
            return None

        # the server writes its own request rows; a received engine span adds none
        add_receiver(app, telemetry.store, request_rows=False, authenticate=admin_only)
    uv_config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level="warning",
        log_config=None,  # its lines go through the server's handler (engine/logs.py)
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(
        uv_config,
        on_stop=stop,
        on_drain=drain,
        busy=lambda: state.open_requests,
        drain_s=opts.shutdown_timeout,
    )
    return server
