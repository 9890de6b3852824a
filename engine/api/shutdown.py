"""How a tokenmill server stops: one drain for every stop signal, however it arrives.

Torch-free and engine-free, so the observers (``tokenmill proxy``, ``tokenmill collect``) stop
the way ``tokenmill serve`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import uvicorn

from ..messages import DRAIN_REQUEST_SIGNAL


class DrainingServer(uvicorn.Server):
    """uvicorn's server with tokenmill's shutdown (``tokenmill serve``, ``proxy`` and ``collect``).

    The first SIGTERM or SIGINT (an orchestrator's stop, a rolling deploy, Ctrl-C, systemd's
    stop of the whole process group) drains: ``on_drain(signal_name)`` in the event loop
    (``/health/ready`` answers 503 and new requests 503 + Retry-After), then the requests in
    flight (``busy()``) get up to ``drain_s`` seconds to finish. An engine core asked to stop
    sends :data:`DRAIN_REQUEST_SIGNAL` instead of dying, which drains the same way but never
    counts as a second signal (a stop sent to the process group reaches the API and its cores
    at once). After the drain, at once for a second signal or ``drain_s`` 0, ``on_stop(name)``
    ends every open stream with a ``server_shutdown`` error and uvicorn stops as usual; a
    third SIGINT skips waiting for connections but never the cleanup (engine stop, store
    flush), which uvicorn alone would skip. A signal that stopped the server is not raised
    again afterwards, so the process exits 0 (:attr:`stop_signals` lists them).
    """

    def __init__(
        self, config: uvicorn.Config, on_stop=None, on_drain=None, busy=None, drain_s: float = 0.0
    ):
        super().__init__(config)
        self.on_stop = on_stop
        self.on_drain = on_drain
        self.busy = busy or (lambda: 0)
        self.drain_s = drain_s
        self.draining = False
        self.signals_received = 0  # SIGTERM/SIGINT to this process (drain requests not counted)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_signals: list[int] = []
        self.startup_error: str | None = None  # why the lifespan could not start the engine
        self.fatal_error: str | None = None  # why it stopped on its own (an engine crash loop)
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Python may run one signal's handler inside another's (between any two bytecodes), and
        # a stop sent to the process group brings a SIGTERM and a core's drain request at once:
        # the handler only queues the signal, and the event loop takes them one at a time
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._on_signal, sig, None)
        else:
            self._on_signal(sig, frame)

    def _on_signal(self, sig: int, frame) -> None:
        if sig == DRAIN_REQUEST_SIGNAL:  # an engine core was asked to stop: drain, once
            if not self.draining and not self.should_exit:
                self._drain_or_stop(signal.SIGTERM, frame)
            return
        # a drain request never counts as a signal: a stop sent to the process group reaches
        # the cores too, and Python runs a pending SIGUSR1 before a pending SIGTERM
        self.signals_received += 1
        if self.signals_received == 1 and self.draining:
            return
        self._drain_or_stop(sig, frame)

    def _drain_or_stop(self, sig: int, frame) -> None:
        drain = self.drain_s > 0 and self.on_drain is not None
        if drain and not self.draining and not self.should_exit and self.loop is not None:
            self.draining = True
            self._captured_signals.append(sig)
            self.loop.call_soon_threadsafe(self._begin_drain, sig)
            return
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.on_stop is not None and self.loop is not None:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = str(sig)
            self.loop.call_soon_threadsafe(self.on_stop, name)

    def _begin_drain(self, sig: int) -> None:
        self.on_drain(signal.Signals(sig).name)
        self._drain_task = asyncio.ensure_future(self._drain_then_stop(sig))

    async def _drain_then_stop(self, sig: int) -> None:
        """Wait for the requests in flight (at most ``drain_s``), then stop as a first signal
        would (unless another signal already did)."""
        deadline = time.monotonic() + self.drain_s
        while self.busy() and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if not self.should_exit:
            self._captured_signals.remove(sig)  # _drain_or_stop records it again
            self._drain_or_stop(sig, None)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # a second Ctrl-C: uvicorn skipped the lifespan shutdown
            await self.lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self):
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(DRAIN_REQUEST_SIGNAL, self.handle_exit) if main else None
        try:
            with super().capture_signals():
                try:
                    yield
                finally:  # handled: uvicorn would raise them again once serve() returns
                    self.stop_signals = list(self._captured_signals)
                    self._captured_signals.clear()
        finally:
            if main:
                signal.signal(DRAIN_REQUEST_SIGNAL, previous)


def serve_app(
    app,
    host: str,
    port: int,
    *,
    busy=None,
    on_drain=None,
    on_stop=None,
    drain_s: float = 0.0,
) -> DrainingServer:
    """Serve ``app`` until a stop signal, as :class:`DrainingServer` stops: the first SIGTERM
    or SIGINT calls ``on_drain(signal_name)`` and waits up to ``drain_s`` for ``busy()`` to
    reach 0, a second stops at once (``on_stop(signal_name)``: end what is still open); the
    signal is never raised again afterwards, so the caller's cleanup (a store's last rows)
    always runs. uvicorn's lines go through the caller's log handler (``engine/logs.py``:
    ``--log-level``, ``--log-format``). Returns the server (``stop_signals``)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        log_config=None,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, on_stop=on_stop, on_drain=on_drain, busy=busy, drain_s=drain_s)
    server.run()
    return server
