"""The engine worker: one engine-core process, watched and restarted when it dies.

Admission routes to a worker through :meth:`EngineWorker.generate`; with
``--data-parallel-size N`` a :class:`~.replicas.ReplicaPool` holds N workers behind the same
interface, worker ``i`` being replica ``i``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import time

from ..async_engine import AsyncEngine, EngineDeadError
from ..config import EngineConfig
from ..core_process import IDLE_POLL_MS
from ..serve_config import ServeConfig

log = logging.getLogger(__name__)

#: the wait before a restart doubles with each crash inside the window (the first restart is at
#: once), from this (s) up to RESTART_BACKOFF_MAX_S
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
#: a worker whose engine core crashed (or failed to start) this many times within
#: CRASH_WINDOW_S gives up: the server exits non-zero so its supervisor takes over
#: (``tokenmill serve --engine-restart-limit`` / ``--engine-restart-window``)
MAX_CRASHES = ServeConfig.engine_restart_limit
CRASH_WINDOW_S = ServeConfig.engine_restart_window

#: ``/health`` turns ``degraded`` (HTTP 200) when the engine core has sent nothing for this long
#: (s). A live engine sends a message every step and a heartbeat every 0.5 s when idle
#: (``core_process.IDLE_POLL_MS``), so this is 20 missed idle heartbeats. A busy engine is silent
#: for one step, and one step can legitimately be long: a full ``max_num_batched_tokens`` (2048)
#: prefill of the default model took 43 s on a 2-core CPU shared with other work (torch
#: attention). Such a step stalls every stream too, so calling it degraded is true;
#: ``tokenmill serve --engine-stall-degraded`` overrides.
ENGINE_STALL_DEGRADED_S = ServeConfig.engine_stall_degraded
#: ``/health`` answers 503 past this silence (s), so a load balancer sends requests elsewhere:
#: nothing is served meanwhile. About 3x the longest legitimate step seen (the 43 s prefill
#: above) so that one slow step, or Triton compiling its kernels on first use (tens of seconds),
#: does not take the server out of rotation; ``tokenmill serve --engine-stall-unavailable``
#: overrides.
ENGINE_STALL_UNAVAILABLE_S = ServeConfig.engine_stall_unavailable


class EngineUnavailable(Exception):
    """The worker is (re)starting; ``retry_after`` seconds is a fair wait."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineWorker:
    """Supervises one :class:`AsyncEngine`.

    States: ``starting`` → ``ready``; on a crash ``restarting`` → ``ready``; ``down`` while a
    restart fails (it keeps retrying, backing off); ``failed`` after ``max_crashes`` crashes or
    failed starts within ``crash_window_s`` (an ``engine_crash_loop`` event: the server exits).
    """

    def __init__(
        self,
        config: EngineConfig,
        name: str | None = None,
        replica: int = 0,
        pd: dict | None = None,
    ):
        self.config = config
        self.pd = pd  # its part in --disaggregation (AsyncEngine), None when colocated
        self.replica = replica
        self.name = name or f"worker-{replica}"
        self.engine: AsyncEngine | None = None
        self.state = "starting"
        self.restarts = 0
        self.last_error: str | None = None
        self.info: dict = {}
        self._monitor: asyncio.Task | None = None
        self._listeners = []
        self._abandoned_listeners = []
        self._event_listeners = []
        self._stopping = False
        self.closing = False  # the server is shutting down: no new requests, no restarts
        self.max_crashes = MAX_CRASHES
        self.crash_window_s = CRASH_WINDOW_S
        self._crashes: collections.deque[float] = collections.deque()  # monotonic times
        # EngineHandle: a single core has no other to route around when it is silent
        self.silent_after_s = ENGINE_STALL_DEGRADED_S

    # -- EngineHandle (engine/api/handle.py): one core is a pool of one ----------------------------
    @property
    def workers(self) -> list[EngineWorker]:
        return [self]

    @property
    def can_serve(self) -> bool:
        return self.ready

    @property
    def pids(self) -> list[int]:
        return [self.engine.pid] if self.engine is not None and self.engine.pid else []

    def add_step_listener(self, fn) -> None:
        self._listeners.append(fn)
        if self.engine is not None:
            self.engine.add_step_listener(fn)

    def add_abandoned_listener(self, fn) -> None:
        """See :meth:`AsyncEngine.add_abandoned_listener` (kept across restarts)."""
        self._abandoned_listeners.append(fn)
        if self.engine is not None:
            self.engine.add_abandoned_listener(fn)

    def add_event_listener(self, fn) -> None:
        """Call ``fn(kind, severity, message, **attributes)`` on engine crash and restart
        (an ``engine_crash`` carries ``exit_code``, ``signal``, ``last_step_id`` and
        ``cut_requests``, the ids of the requests it ended)."""
        self._event_listeners.append(fn)

    def _emit(self, kind: str, severity: str, message: str, **attrs) -> None:
        for fn in self._event_listeners:
            try:
                fn(kind, severity, message, **attrs)
            except Exception:
                log.exception("event listener failed")

    async def start(self) -> dict:
        """Start the engine process (raises EngineDeadError if it cannot start)."""
        await self._spawn()
        self._monitor = asyncio.get_running_loop().create_task(self._watch())
        return self.info

    def _stamp(self, record) -> None:
        record.replica = self.replica
        if self.pd is not None:
            record.role = self.pd["role"]

    async def _spawn(self) -> None:
        engine = AsyncEngine(self.config, pd=self.pd)
        engine.add_step_listener(self._stamp)  # first: every listener sees the replica
        for fn in self._listeners:
            engine.add_step_listener(fn)
        for fn in self._abandoned_listeners:
            engine.add_abandoned_listener(fn)
        try:
            self.info = await engine.start()
            if self.pd is not None and engine.pd["port"] != self.pd["port"]:
                # --disaggregation: another core died while this one started, and the pool
                # moved the KV link; this core would wait for partners on the old one
                raise EngineDeadError("the KV link moved while this core started")
        except BaseException:
            await engine.shutdown()
            raise
        self.engine = engine
        self.state = "ready"

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.25)
            if self.engine is not None and self.engine.alive:
                continue
            if self.engine is not None and not self.closing:
                self.engine.fail_if_dead()  # its streams end now, with the exit's cause
            reason = self.engine.dead_reason if self.engine else "not running"
            if self.closing:  # the shutdown's signal reached the engine too: no crash
                log.info("%s: engine core exited during shutdown (%s)", self.name, reason)
                return
            self.last_error = reason
            log.error("%s: engine core died (%s); restarting", self.name, reason)
            self._emit("engine_crash", "error", f"{self.name}: {reason}", **self._crash_facts())
            self.state = "restarting"
            old, self.engine = self.engine, None
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.shutdown()
            while not self._stopping:
                if self._crash_loop(reason):
                    return
                await asyncio.sleep(self._backoff_s())
                try:
                    await self._spawn()
                    self.restarts += 1
                    log.warning("%s: engine core restarted (restart %d)", self.name, self.restarts)
                    self._emit("engine_restart", "warning", f"{self.name}: restart {self.restarts}")
                    break
                except Exception as exc:
                    self.state = "down"
                    self.last_error = reason = str(exc)

    def _crash_facts(self) -> dict:
        """What the ``engine_crash`` event records of a core that died: its exit code and the
        signal that ended it (None for an exit), the last step it reported and the requests
        it cut."""
        engine = self.engine
        process = getattr(engine, "process", None)
        code = getattr(process, "exitcode", None)
        sig = None
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-code).name
        return {
            "replica": self.name,
            "pid": getattr(process, "pid", None),
            "exit_code": code,
            "signal": sig,
            "last_step_id": getattr(engine, "last_step_id", None),
            "cut_requests": list(getattr(engine, "cut_requests", []) or []),
        }

    def _crash_loop(self, reason: str) -> bool:
        """Count a crash (or a failed restart); True, with the worker ``failed`` and an
        ``engine_crash_loop`` event, when the window now holds ``max_crashes`` of them."""
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.crash_window_s:
            self._crashes.popleft()
        if len(self._crashes) < self.max_crashes:
            return False
        self.state = "failed"
        message = (
            f"{self.name}: the engine core crashed {len(self._crashes)} times in "
            f"{self.crash_window_s:g} s (last: {reason}); giving up"
        )
        log.error("%s", message)
        self._emit("engine_crash_loop", "error", message)
        return True

    def _backoff_s(self) -> float:
        """The wait before the next restart: none after the window's first crash, then
        RESTART_BACKOFF_S doubling up to RESTART_BACKOFF_MAX_S."""
        k = len(self._crashes)
        return 0.0 if k <= 1 else min(RESTART_BACKOFF_S * 2 ** (k - 2), RESTART_BACKOFF_MAX_S)

    def stop_streams(self, reason: str) -> int:
        """Refuse new requests from now on and end every open stream with ``StreamStopped``
        (``reason``), each request aborted in the engine (see :meth:`AsyncEngine.stop_streams`).
        Returns the number of streams stopped."""
        self.closing = True
        return self.engine.stop_streams(reason) if self.engine is not None else 0

    async def stop(self) -> None:
        """Stop watching and shut the engine process down."""
        self._stopping = True
        self.closing = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self.engine is not None:
            await self.engine.shutdown()

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.engine is not None and self.engine.alive

    def replica_of(self, request_id: str) -> EngineWorker:
        """The worker serving ``request_id``: this one (see :meth:`.ReplicaPool.replica_of`)."""
        return self

    def generate(self, *args, **kwargs):
        """The engine's output stream for one request.

        Raises:
            EngineUnavailable: the worker is restarting or down, or the server is shutting down.
        """
        if self.closing:
            raise EngineUnavailable("the server is shutting down; retry on another server")
        if not self.ready:
            raise EngineUnavailable(f"engine worker is {self.state}; retry shortly")
        return self.engine.generate(*args, **kwargs)

    async def abort(self, request_id: str) -> None:
        if self.ready:
            await self.engine.abort(request_id)

    @property
    def heartbeat_age_s(self) -> float | None:
        """Seconds since the running engine's last message (see
        :attr:`AsyncEngine.heartbeat_age_s`); None while no engine is up."""
        engine = self.engine
        if engine is None or self.state != "ready":
            return None
        return engine.heartbeat_age_s

    def stall(self, degraded_s: float, unavailable_s: float) -> tuple[str, str] | None:
        """``(severity, reason)`` when the ready engine has been silent for at least
        ``degraded_s`` seconds: severity ``unavailable`` from ``unavailable_s`` on, else
        ``degraded``; None when it is not silent that long (or not ready: that is reported by
        :attr:`state`). Defaults: :data:`ENGINE_STALL_DEGRADED_S`,
        :data:`ENGINE_STALL_UNAVAILABLE_S`."""
        age = self.heartbeat_age_s
        if age is None or age < degraded_s:
            return None
        severity = "unavailable" if age >= unavailable_s else "degraded"
        reason = (
            f"no message from the engine core (pid {self.engine.pid}) for {age:.1f} s: it is "
            f"frozen or in one very long step (it sends one per step and a heartbeat every "
            f"{IDLE_POLL_MS / 1000:g} s when idle); degraded past {degraded_s:g} s, "
            f"503 past {unavailable_s:g} s"
        )
        return severity, reason

    def health(self) -> dict:
        engine = self.engine
        age = self.heartbeat_age_s
        return {
            "name": self.name,
            "replica": self.replica,
            "role": self.pd["role"] if self.pd is not None else None,
            "state": self.state,
            "pid": engine.pid if engine else None,
            "uptime_s": round(engine.uptime_s, 1) if engine else 0.0,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "heartbeat_age_s": None if age is None else round(age, 3),
            "stats": dict(engine.stats) if engine else {},
            "checked_at": time.time(),
        }


__all__ = [
    "ENGINE_STALL_DEGRADED_S",
    "ENGINE_STALL_UNAVAILABLE_S",
    "EngineDeadError",
    "EngineUnavailable",
    "EngineWorker",
]
