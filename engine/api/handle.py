"""The API's one handle on the engine, whatever its shape behind it.

``tokenmill serve`` runs one engine core (:class:`~.worker.EngineWorker`), ``--data-parallel-size
N`` of them behind a router (:class:`~.replicas.ReplicaPool`), or prefill and decode pools
(:class:`~.disaggregated.PDPool`). The routes, the health checks, the drain and telemetry see
only :class:`EngineHandle`; each of the three implements all of it (``tests/api/test_engine_handle.py``
checks every member on each).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tokenmill.engine.messages import RequestOutput, StepRecord

    from .worker import EngineWorker


@runtime_checkable
class EngineHandle(Protocol):
    """What the API needs from the engine side."""

    name: str
    """``worker-0`` for one core, ``replicas``, ``disaggregated``"""
    closing: bool
    """the server is shutting down: new requests are refused, nothing restarts"""
    silent_after_s: float
    """a core silent this long (s) gets no new requests while others speak"""

    @property
    def workers(self) -> list[EngineWorker]:
        """Every engine core's supervisor (one for a single core)."""

    @property
    def info(self) -> dict:
        """The start information (model, weights, KV cache) of the first core."""

    @property
    def restarts(self) -> int:
        """Engine restarts so far, over every core."""

    @property
    def state(self) -> str:
        """``starting``, ``ready``, ``restarting``, ``down`` or ``failed``."""

    @property
    def ready(self) -> bool:
        """Every core serves (``/health``: ``ok``)."""

    @property
    def can_serve(self) -> bool:
        """Some core serves (``/health/ready``: 200)."""

    @property
    def pids(self) -> list[int]:
        """The engine cores' process ids (for the host sampler)."""

    @property
    def heartbeat_age_s(self) -> float | None:
        """The longest silence of a ready core, s (None while none is up)."""

    async def start(self) -> dict:
        """Start every core; the start information. Raises ``EngineDeadError``."""

    async def stop(self) -> None:
        """Shut every core down."""

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn`` with every step record (kept across restarts)."""

    def add_abandoned_listener(self, fn: Callable[[RequestOutput], None]) -> None:
        """Call ``fn`` with the final output of a request whose stream was left."""

    def add_event_listener(self, fn: Callable[[str, str, str], None]) -> None:
        """Call ``fn(kind, severity, message)`` on a crash, restart or crash loop."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """One request's output stream. Raises ``EngineUnavailable``."""

    def replica_of(self, request_id: str) -> EngineWorker | None:
        """The core a request in flight runs on."""

    async def abort(self, request_id: str) -> None:
        """Stop one request (its client left)."""

    def stop_streams(self, reason: str) -> int:
        """Refuse new requests and end every open stream; how many were ended."""

    def stall(self, degraded_s: float, unavailable_s: float) -> tuple[str, str] | None:
        """``(severity, reason)`` when a ready core has been silent ``degraded_s`` or more."""

    def health(self) -> dict:
        """``/health``'s engine part."""


__all__ = ["EngineHandle"]
