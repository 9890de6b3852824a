"""AsyncEngine: the API process's handle on an engine core running in its own process.

``generate()`` is an async iterator of :class:`RequestOutput` deltas; leaving it early (a client
that disconnects) aborts the request in the engine, whose blocks are freed in that step. Step
records go to listeners (telemetry) once the step's outputs are written to their streams
(``stream_writes.py``); the engine never waits on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from .config import EngineConfig
from .core_process import run_engine_core
from .errors import RequestRejected, TokenmillError
from .messages import (
    OUTPUT_DECODER,
    AbortRequests,
    AddRequest,
    EngineError,
    EngineFatal,
    EngineOutputs,
    EngineReady,
    Heartbeat,
    RemoteStart,
    RequestFailed,
    RequestOutput,
    Shutdown,
    StatsQuery,
    StatsReply,
    StepRecord,
    encode,
    to_row,
)
from .parallel.pd_spec import core_addresses
from .sampling_params import SamplingParams
from .stream_writes import StreamWriteClock

log = logging.getLogger(__name__)

LIVENESS_CHECK_S = 5.0  # a waiting stream checks this often that the engine is still there
SEND_TIMEOUT_S = 5.0  # a message the engine cannot take in this long means it is gone or stuck


class EngineDeadError(TokenmillError):
    """The engine core process is gone (crashed or failed to start)."""


class StreamStopped(TokenmillError):
    """The server stopped this stream (it is shutting down, see :meth:`AsyncEngine.stop_streams`);
    the request is aborted in the engine and its final record goes to the abandoned listeners."""


def raise_for(error: EngineError) -> Exception:
    """The exception the API handles for an engine refusal: :class:`RequestRejected` for
    ``context_length_exceeded``, ``ValueError`` (bad prompt or sampling parameters) otherwise."""
    if error.error_type == "context_length_exceeded":
        return RequestRejected(error.message)
    return ValueError(error.message)


#: seconds of silence (no step, no heartbeat) after which a remote engine core counts as dead
REMOTE_SILENCE_S = 30.0
#: seconds a remote engine core's host (``tokenmill pd-worker``) has to connect and take its
#: start before the start fails (its model then loads within the start's own timeout)
REMOTE_CONNECT_S = 120.0


class RemoteCore:
    """Stands in for the engine core's process when the core runs on another host
    (``tokenmill pd-worker``): alive until it is killed, its host reports it exited
    (``EngineFatal``) or it stays silent :data:`REMOTE_SILENCE_S`; ``kill`` asks it to stop
    (``Shutdown``), and its host waits for the next :class:`RemoteStart`."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.exitcode: int | None = None
        self._killed = False

    @property
    def pid(self) -> int | None:
        return self.engine.info.get("pid")

    def is_alive(self) -> bool:
        if self._killed:
            return False
        age = self.engine.heartbeat_age_s
        return age is None or age < REMOTE_SILENCE_S

    def kill(self) -> None:
        if not self._killed:
            self._killed, self.exitcode = True, -9
            with contextlib.suppress(zmq.ZMQError):
                self.engine._push.send(encode(Shutdown()), flags=zmq.NOBLOCK)

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for on this host."""


class AsyncEngine:
    """Client of one engine-core process.

    Args:
        config: the engine config, sent to the process.
        pd: this core's part in ``--disaggregation`` (``core_process.run_engine_core``); with
            ``pd["remote"] = "HOST:PORT"`` the core runs on another host (``tokenmill
            pd-worker --connect HOST:PORT``): this engine binds its two ZeroMQ sockets on
            ``tcp://HOST:PORT`` (to the core) and ``tcp://HOST:PORT+1`` (from it) and sends
            :class:`RemoteStart` instead of spawning a process.
    """

    def __init__(self, config: EngineConfig, pd: dict | None = None):
        config.validate()
        self.config = config
        # this core's part in --disaggregation (core_process.run_engine_core), as it starts:
        # the pool may move the KV link (pd["port"]) for the next start meanwhile
        self.pd = dict(pd) if pd is not None else None
        self.remote = (pd or {}).get("remote")
        self._ctx = zmq.asyncio.Context()
        self._tmp = tempfile.TemporaryDirectory(prefix="tokenmill-ipc-")
        base = Path(self._tmp.name)
        if self.remote:
            self._in_addr, self._out_addr = core_addresses(self.remote)
        else:
            self._in_addr = f"ipc://{base / 'in'}"
            self._out_addr = f"ipc://{base / 'out'}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(self._in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._out_addr)
        self._queues: dict[str, asyncio.Queue] = {}
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._abandoned_listeners: list[Callable[[RequestOutput], None]] = []
        # events of outputs a left stream never read, until the engine's final record of it
        self._carried_events: dict[str, list] = {}
        # a step's record goes to the listeners once its outputs are written to the streams
        self._writes = StreamWriteClock(self._to_listeners)
        self._reader: asyncio.Task | None = None
        self._closing = False  # shutdown() began: the process exiting is no crash
        self.process: multiprocessing.Process | None = None
        self.info: dict = {}
        self.stats: dict = {}
        self.dead_reason: str | None = None
        # when it died: the requests it cut (ids) and the last step it reported
        self.cut_requests: list[str] = []
        self.last_step_id: int | None = None
        self.started_monotonic: float | None = None
        # time.monotonic() of the last message read from the engine (any kind): the engine
        # sends one per step and a Heartbeat at least every IDLE_POLL_MS while idle
        self.last_message_monotonic: float | None = None

    # ----- lifecycle -----
    async def start(self, timeout_s: float = 600.0) -> dict:
        """Spawn the engine process and wait until its model is loaded; returns its info.

        Raises:
            EngineDeadError: the process reported a fatal error, died, or did not get ready.
        """
        deadline = time.monotonic() + timeout_s
        if self.remote:
            self.process = RemoteCore(self)
            start = RemoteStart(config=self.config.to_dict(), pd=dict(self.pd))
            # queued until the core's host connects: it may come up after this server
            wait_s = min(timeout_s, REMOTE_CONNECT_S)
            if not await self._send(start, timeout_s=wait_s):
                raise EngineDeadError(
                    f"no engine core host connected to {self._in_addr} in {wait_s:.0f} s "
                    f"(tokenmill pd-worker --connect {self.remote})"
                )
        else:
            mp = multiprocessing.get_context("spawn")
            self.process = mp.Process(
                target=run_engine_core,
                args=(self.config, self._in_addr, self._out_addr, self.pd),
                name="tokenmill-engine-core",
                daemon=True,
            )
            self.process.start()
        while True:
            msg = await self._recv(0.5)
            if msg is not None:
                self.last_message_monotonic = time.monotonic()
            if isinstance(msg, EngineReady):
                self.info = to_row(msg)
                self.stats = self.info["stats"] = to_row(msg.stats)
                break
            if isinstance(msg, EngineFatal):
                self.dead_reason = msg.error.message
                raise EngineDeadError(f"engine core failed to start: {self.dead_reason}")
            if msg is None and not self.process.is_alive():
                self.dead_reason = f"exited with code {self.process.exitcode}"
                raise EngineDeadError(f"engine core process {self.dead_reason} before it was ready")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine core not ready after {timeout_s:.0f} s")
        self.started_monotonic = time.monotonic()
        self._reader = asyncio.get_running_loop().create_task(self._read_outputs())
        return self.info

    async def shutdown(self) -> None:
        """Stop the engine process and close the sockets (its exit is not reported as a death)."""
        self._closing = True
        if self.process is not None and self.process.is_alive():
            await self._send(Shutdown(), timeout_s=1.0)
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._writes.flush()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    def fail_if_dead(self) -> None:
        """A core process found dead before the output reader noticed: end every open stream
        now with why (:func:`exit_reason`), as the reader would a second later."""
        if self.process is None or self.process.is_alive() or self.dead_reason is not None:
            return
        if self._closing or isinstance(self.process, RemoteCore):
            return
        self._fail_all(exit_reason(self.process.exitcode))

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive() and self.dead_reason is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_monotonic if self.started_monotonic else 0.0

    @property
    def heartbeat_age_s(self) -> float | None:
        """Seconds since the last message from the engine core (None before the first).

        A live engine sends one message per step (its outputs and step record) and, while
        idle, a heartbeat at least every ``core_process.IDLE_POLL_MS`` (0.5 s); so the age
        stays under 0.5 s idle and under one step's duration busy. A frozen or hung engine
        process (``kill -STOP``, a stuck device call) lets it grow without bound while
        :attr:`alive` stays true.
        """
        last = self.last_message_monotonic
        return None if last is None else max(0.0, time.monotonic() - last)

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(record)`` for every step record (in the event loop; keep it cheap)."""
        self._listeners.append(fn)

    def add_abandoned_listener(self, fn: Callable[[RequestOutput], None]) -> None:
        """Call ``fn(output)`` with the final output of a request whose stream was left early
        (the engine's own abort record: tokens produced, the step it was aborted in)."""
        self._abandoned_listeners.append(fn)

    # ----- requests -----
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: str = "",
        arrival_ns: int | None = None,
        hand_off: bool = False,
        adopt: bool = False,
        decode_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. ``hand_off`` / ``adopt``: the
        prefill / decode half of a disaggregated request (:class:`AddRequest`), ``decode_rank``
        the decode core a hand-off goes to.

        Raises:
            RequestRejected: it can never fit the context or the KV pool.
            ValueError: bad prompt or sampling parameters.
            EngineDeadError: the engine process died.
            StreamStopped: :meth:`stop_streams` ended it (the request is aborted).
        """
        if not self.alive:
            raise EngineDeadError(
                f"engine core is not running ({self.dead_reason or 'not started'})"
            )
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        add = AddRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            priority=priority,
            tenant=tenant,
            arrival_ns=arrival_ns,
            hand_off=hand_off,
            adopt=adopt,
            decode_rank=decode_rank,
        )
        finished = False
        unwritten = None  # the output handed to the stream and not yet written by it
        try:
            if not await self._send(add):
                finished = True
                raise EngineDeadError(
                    f"engine core is not taking requests ({self.dead_reason or 'queue full'})"
                )
            while True:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
                # that lands as the item arrives, and a route cancelling a stream whose client
                # left would then wait for the whole answer
                try:
                    async with asyncio.timeout(LIVENESS_CHECK_S):
                        item = await queue.get()
                except TimeoutError:
                    if not self.alive or self._reader is None or self._reader.done():
                        finished = True
                        raise EngineDeadError(
                            f"engine core stopped answering ({self.dead_reason or 'output reader ended'})"
                        ) from None
                    continue
                if isinstance(item, Exception):
                    # a stopped stream still has its request in the engine: abort it below
                    finished = not isinstance(item, StreamStopped)
                    raise item
                finished = item.finished
                unwritten = item
                yield item
                # asked for the next one: the stream has written this one
                unwritten = None
                self._writes.written(item)
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if unwritten is not None:
                self._writes.dropped(unwritten)
            unread = [o for o in _drain(queue) if isinstance(o, RequestOutput)]
            for o in unread:
                self._writes.dropped(o)
            if not finished:
                # outputs the stream never read: a final one is the request's last record (it
                # finished as the stream was left); otherwise the engine aborts it and sends one.
                # Either way the record carries the unread outputs' events (a preemption in
                # them is counted in the record's num_preemptions)
                carried = [e for o in unread if not o.finished for e in o.events]
                final = next((o for o in unread if o.finished), None)
                if final is not None:
                    final.events = carried + final.events
                    self._abandoned(final)
                elif self.alive:
                    # outputs still in flight to it add their events here too (_dispatch)
                    self._carried_events[request_id] = carried
                    await self._send(AbortRequests([request_id]))

    def stop_streams(self, reason: str) -> int:
        """End every open :meth:`generate` stream now with :class:`StreamStopped` (``reason``
        as its message), after the outputs already queued for it. Each stopped request is then
        aborted in the engine, whose final record of it (tokens produced, the abort step) goes
        to the abandoned listeners. Returns the number of streams stopped."""
        for queue in self._queues.values():
            queue.put_nowait(StreamStopped(reason))
        return len(self._queues)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with ``finish_reason='abort'``."""
        if self.alive:
            await self._send(AbortRequests([request_id]))

    async def refresh_stats(self) -> None:
        """Ask the engine for fresh stats (answered asynchronously into :attr:`stats`)."""
        if self.alive:
            await self._send(StatsQuery())

    async def _send(self, msg, timeout_s: float = SEND_TIMEOUT_S) -> bool:
        """Send one message to the engine; False if it could not be sent within ``timeout_s``.

        A ZeroMQ PUSH socket blocks forever when its peer has gone (an engine process that
        reported a fatal error and is exiting), so each send is non-blocking and retried only
        while the process is alive.
        """
        deadline = time.monotonic() + timeout_s
        data = encode(msg)
        while True:
            try:
                await self._push.send(data, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                alive = self.process is not None and self.process.is_alive()
                if not alive or time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.005)
            except zmq.ZMQError:
                return False

    # ----- output dispatch -----
    async def _read_outputs(self) -> None:
        try:
            await self._read_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave streams waiting on a dead reader
            log.exception("engine output reader failed")
            self._fail_all(f"output reader failed: {type(exc).__name__}: {exc}")

    async def _recv(self, timeout_s: float):
        """The next message from the engine, or None after ``timeout_s`` (an asyncio timer, so
        a wait always ends even if the engine process vanished)."""
        # Wait on poll, never on recv: cancelling a pending zmq recv (as a timeout does) can
        # drop a message that arrived at that instant, and a lost output hangs its stream.
        try:
            async with asyncio.timeout(timeout_s):
                events = await self._pull.poll()
        except TimeoutError:
            return None
        if not events:
            return None
        try:
            data = await self._pull.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        return OUTPUT_DECODER.decode(data)

    async def _read_loop(self) -> None:
        while True:
            msg = await self._recv(1.0)
            self._writes.expire()
            if msg is not None:
                self.last_message_monotonic = time.monotonic()
            if msg is None:
                if self.process is not None and not self.process.is_alive():
                    if self._closing:  # asked to stop: no crash; streams still open end now
                        self.dead_reason = "shut down"
                        self.stop_streams("the engine was shut down")
                        return
                    if isinstance(self.process, RemoteCore) and self.process.exitcode is None:
                        why = f"remote engine core silent for {REMOTE_SILENCE_S:g} s"
                    else:
                        why = exit_reason(self.process.exitcode)
                    self._fail_all(why)
                    return
                continue
            if isinstance(msg, EngineOutputs):
                if msg.step is not None:
                    msg.step.output_send_ms = max(0.0, (time.time_ns() - msg.step.end_ns) / 1e6)
                delivered = self._dispatch(msg.outputs)
                if msg.step is not None:
                    self._update_stats(msg.step)
                    self._writes.received(msg.step, delivered)
            elif isinstance(msg, Heartbeat):
                self.stats = to_row(msg.stats)
                self._update_stats(msg.step)
                self._to_listeners(msg.step)
            elif isinstance(msg, RequestFailed):
                queue = self._queues.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(raise_for(msg.error))
            elif isinstance(msg, StatsReply):
                self.stats = to_row(msg.stats)
            elif isinstance(msg, EngineFatal):
                self._fail_all(msg.error.message)
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Queue each output on its stream; returns those queued."""
        delivered = []
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
                delivered.append(out)
            elif out.finished:
                carried = self._carried_events.pop(out.request_id, None)
                if carried:
                    out.events = carried + out.events
                self._abandoned(out)
            elif out.request_id in self._carried_events:
                self._carried_events[out.request_id].extend(out.events)
        return delivered

    def _abandoned(self, out: RequestOutput) -> None:
        """Hand the final output of a request whose stream was left to the listeners."""
        for fn in self._abandoned_listeners:
            try:
                fn(out)
            except Exception:
                log.exception("abandoned-output listener failed")

    def _update_stats(self, record: StepRecord) -> None:
        self.last_step_id = record.step_id
        self.stats.update(
            num_running=record.num_running,
            num_waiting=record.num_waiting,
            kv_blocks_used=record.kv_blocks_used,
            kv_blocks_free=record.kv_blocks_free,
            kv_blocks_cached=record.kv_blocks_cached,
            kv_usage=record.kv_blocks_used / max(record.kv_blocks_total, 1),
        )

    def _to_listeners(self, record: StepRecord) -> None:
        for fn in self._listeners:
            try:
                fn(record)
            except Exception:  # a listener must never stop the stream
                log.exception("step listener failed")

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        self.cut_requests = list(self._queues)
        self._writes.flush()
        self._carried_events.clear()
        log.error("engine core died: %s", reason)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"engine core died: {reason}"))


def exit_reason(code: int | None) -> str:
    """Why an engine core process ended, from its exit code: a signal by name (SIGKILL is what
    the kernel's OOM killer sends), else the code."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (the kernel's OOM killer sends it; see dmesg)" if -code == signal.SIGKILL else ""
        return f"engine core process killed by {name}{oom}"
    return f"engine core process exited with code {code}"


def _drain(queue: asyncio.Queue) -> list:
    """Everything waiting in ``queue`` now, without blocking."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
