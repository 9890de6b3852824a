"""Prefill/decode disaggregation behind one API (``tokenmill serve --disaggregation
'prefill=1,decode=1'``, issue 17): :class:`PDPool` holds a prefill engine worker and a decode
engine worker, each its own engine core process pinned to its own cores
(``--prefill-devices`` / ``--decode-devices``), linked by a gloo group that carries each
request's KV (``engine/parallel/pd_link.py``).

A request is sent to the prefill core with ``hand_off``: it is prefilled there (the prefix
cache lives on that side) and ends after its first token, which streams to the client at
once. The prefill core sends the prompt's KV to the decode core; the pool opens the request's
decode stream (``adopt``), and the decode core continues it from its first token when the KV
has arrived and it has room (until then the request waits at the decode side's desk). The
decode core keeps the received prompt blocks in its own prefix cache, so a request it
preempts recomputes only what they do not cover.

It is a :class:`~.replicas.ReplicaPool` of two workers (replica 0 = prefill, 1 = decode), so
``/health``, ``/metrics`` and the step records' ``replica`` tag show each side. When either
side's engine core dies, both restart on a fresh link (:meth:`PDPool._relink`): the requests
in flight fail with ``engine_died`` and the pool serves again once both are back.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator

import msgspec

from ..async_engine import EngineDeadError
from ..config import EngineConfig
from ..messages import RequestOutput
from ..parallel.pd_spec import PDSpec
from .replicas import ReplicaPool, Router
from .worker import EngineUnavailable, EngineWorker

ROLES = ("prefill", "decode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PDPool(ReplicaPool):
    """A prefill worker and a decode worker behind the worker's interface.

    Args:
        config: the engine configuration both sides run (each pinned to its cores, with as
            many torch threads as cores, when the spec places them).
        spec: the parsed ``--disaggregation`` flags.
    """

    name = "disaggregated"

    def __init__(self, config: EngineConfig, spec: PDSpec):
        self.config = config
        self.spec = spec
        port = _free_port()
        self.workers = []
        for replica, (role, cpus) in enumerate(
            zip(ROLES, (spec.prefill_cpus, spec.decode_cpus), strict=True)
        ):
            cfg = dataclasses.replace(config, cpu_threads=len(cpus)) if cpus else config
            pd = {"role": role, "port": port, "cpus": list(cpus) if cpus else None}
            self.workers.append(EngineWorker(cfg, name=f"{role}-0", replica=replica, pd=pd))
        self.prefill, self.decode = self.workers
        self.router = Router(2, config.block_size)
        self._where: dict[str, EngineWorker] = {}
        self.closing = False
        self._killed: set[str] = set()  # partners this pool killed (their crash is expected)
        for w in self.workers:
            w.add_event_listener(self._on_event_of(w))

    def _on_event_of(self, worker: EngineWorker):
        def on_event(kind: str, severity: str, message: str) -> None:
            if kind == "engine_crash":
                self._relink(worker)

        return on_event

    def _relink(self, crashed: EngineWorker) -> None:
        """One side died: the KV link (one gloo group) died with it. Both sides restart on a
        fresh rendezvous port, so the partner is killed too (its monitor restarts it): every
        request in flight on either side ends with an error, none hangs on a link that is
        gone, and neither side keeps blocks or hand-offs of it."""
        if crashed.name in self._killed:  # the partner this pool killed: already relinking
            self._killed.discard(crashed.name)
            return
        port = _free_port()
        for w in self.workers:
            w.pd["port"] = port  # read when each side's engine core is spawned again
        partner = self.decode if crashed is self.prefill else self.prefill
        engine = partner.engine
        if engine is not None and engine.process is not None and engine.process.is_alive():
            self._killed.add(partner.name)
            engine.process.kill()

    async def start(self) -> dict:
        """Start both sides at once: each core joins the KV link while it loads."""
        import asyncio

        results = await asyncio.gather(*(w.start() for w in self.workers), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await self.stop()
            raise failed
        info = dict(self.info)
        info["pids"] = self.pids
        info["roles"] = list(ROLES)
        return info

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """Prefill on the prefill side, decode on the decode side; one output stream.

        Raises:
            EngineUnavailable: either side is not ready, or the server is shutting down.
        """
        if self.closing:
            raise EngineUnavailable("the server is shutting down; retry on another server")
        down = [w for w in self.workers if not w.ready]
        if down:
            states = ", ".join(f"{w.name} {w.state}" for w in down)
            raise EngineUnavailable(f"disaggregated serving needs both sides ({states})")
        self._where[request_id] = self.prefill
        return self._stream(request_id, prompt_token_ids, params, kwargs)

    async def _stream(self, request_id, prompt_token_ids, params, kwargs):
        first = self.prefill.generate(request_id, prompt_token_ids, params, hand_off=True, **kwargs)
        rest = None
        try:
            async for out in first:
                if out.finish_reason != "handoff":
                    yield out  # prefilling, or it ended at its first token (stop, error)
                    continue
                # the first token now; the rest comes from the decode side
                yield msgspec.structs.replace(out, finished=False, finish_reason=None)
                self._where[request_id] = self.decode
                try:
                    rest = self.decode.generate(
                        request_id, prompt_token_ids, params, adopt=True, **kwargs
                    )
                except EngineUnavailable as exc:  # it went down after the prefill began
                    raise EngineDeadError(f"decode core unavailable: {exc}") from None
            if rest is not None:
                async for out in rest:
                    yield out
        finally:
            self._where.pop(request_id, None)
            await first.aclose()
            if rest is not None:
                await rest.aclose()
