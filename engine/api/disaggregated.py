"""Prefill/decode disaggregation behind one API (``tokenmill serve --disaggregation
'prefill=P,decode=D'``, issue 17): :class:`PDPool` holds P prefill engine workers and D decode
engine workers, each its own engine core process, optionally pinned to its share of its side's
cores (``--prefill-devices`` / ``--decode-devices``), all linked by one gloo group that
carries each request's KV (``engine/parallel/pd_link.py``: prefill cores ranks ``0 .. P-1``,
decode cores ``P .. P+D-1``).

Routing (:class:`PDRouter`): a request goes to the prefill worker with the fewest **queued
prefill tokens** (prompt tokens routed there that have not yet given their first token) and
is promised to the decode worker with the most **free KV blocks** (its latest stats, less the
blocks of requests promised to it and not yet adopted). Both are chosen when the request
arrives, so the prefill core knows where to send the KV the moment it has it.

A request is sent to its prefill core with ``hand_off``: it is prefilled there (the prefix
cache lives on that side) and ends after its first token, which streams to the client at
once. The prefill core sends the prompt's KV to the chosen decode core; the pool opens the
request's decode stream (``adopt``), and the decode core continues it from its first token
when the KV has arrived and it has room. Until then the request waits at the decode side's
desk holding no blocks there (back-pressure: ``kv_wait_ms`` on the request, ``num_kv_waiting``
on the decode core's steps); its prefill-side blocks are freed once its KV is sent (the full
ones stay in that side's prefix cache). The decode core keeps the received prompt blocks in
its own prefix cache, so a request it preempts recomputes only what they do not cover.

It is a :class:`~.replicas.ReplicaPool` of P + D workers (replica ``r`` = link rank ``r``,
named ``prefill-i`` / ``decode-j``), so ``/health``, ``/metrics`` and the step records'
``replica`` and ``role`` tags show each one. When any engine core dies, every core restarts on
a fresh link (:meth:`PDPool._relink`: one gloo group dies with any of its ranks): the requests
in flight fail with ``engine_died`` and the pool serves again once all are back.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import AsyncIterator

import msgspec

from ..async_engine import EngineDeadError
from ..config import EngineConfig
from ..errors import RequestRejected
from ..messages import RequestOutput
from ..parallel.pd_spec import PDSpec, split_host_port, worker_name
from .replicas import ReplicaPool, Router
from .worker import ENGINE_STALL_DEGRADED_S, EngineUnavailable, EngineWorker


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PDRouter(Router):
    """Picks a prefill and a decode worker for each request.

    ``outstanding[r]`` (shown in ``/health``) is, for a prefill worker, its queued prefill
    tokens; for a decode worker, the output tokens its requests may still produce.
    ``promised[r]`` counts the KV blocks of requests promised to decode worker ``r`` and not
    yet adopted there.

    Args:
        num_prefill, num_decode: the workers a side (replicas ``0 .. P-1`` and ``P ..
            P+D-1``).
        block_size: the engine's KV block size (tokens).
    """

    def __init__(self, num_prefill: int, num_decode: int, block_size: int):
        super().__init__(num_prefill + num_decode, block_size)
        self.num_prefill = num_prefill
        self.block_size = block_size
        self.promised = [0] * (num_prefill + num_decode)

    def blocks_for(self, prompt_tokens: int) -> int:
        return -(-prompt_tokens // self.block_size)

    def pick_prefill(self, ready: list[int]) -> int:
        """The ready prefill replica with the fewest queued prefill tokens (lowest on ties)."""
        return min(ready, key=lambda r: (self.outstanding[r], r))

    def pick_decode(self, ready: list[int], free_blocks: dict[int, int]) -> int:
        """The ready decode replica with the most free KV blocks less those promised (the
        fewest outstanding tokens, then the lowest index, on ties)."""
        return max(
            ready,
            key=lambda r: (free_blocks.get(r, 0) - self.promised[r], -self.outstanding[r], -r),
        )


class PDPool(ReplicaPool):
    """P prefill workers and D decode workers behind the worker's interface.

    Args:
        config: the engine configuration every core runs (each pinned to its cores, with as
            many torch threads as cores, when the spec places them; unpinned on a CPU with
            more than two cores in all, an even share of the machine's cores each).
        spec: the parsed ``--disaggregation`` flags.
        cpu_count: the host's cores (default ``os.cpu_count()``).
    """

    name = "disaggregated"

    def __init__(self, config: EngineConfig, spec: PDSpec, cpu_count: int | None = None):
        self.config = config
        self.spec = spec
        cpu_count = cpu_count or os.cpu_count() or 1
        remote = (
            split_host_port(config.remote_decode_listen) if config.remote_decode_listen else None
        )
        # the KV link's rendezvous: on this host, reachable from the decode hosts when remote
        self.master_addr = remote[0] if remote else "127.0.0.1"
        try:
            port = _free_port(self.master_addr)
        except OSError as exc:  # a host that does not resolve, or is not this machine's
            raise ValueError(
                f"--remote-decode-listen {config.remote_decode_listen}: cannot listen on "
                f"{self.master_addr} ({exc.strerror or exc})"
            ) from None
        places = [("prefill", c) for c in spec.worker_cpus("prefill")]
        places += [("decode", c) for c in spec.worker_cpus("decode")]
        self.workers = []
        for rank, (role, cpus) in enumerate(places):
            changes: dict = {}
            if cpus:
                changes["cpu_threads"] = len(cpus)
            elif (
                spec.world_size > 2
                and config.cpu_threads == 0
                and not config.device.startswith("cuda")  # cpu, or auto on a CPU host
                and not (remote and role == "decode")  # another host's cores
            ):
                changes["cpu_threads"] = max(1, cpu_count // spec.world_size)
            if role == "decode" and config.decode_kv_cache_memory is not None:
                changes["kv_cache_memory"] = config.decode_kv_cache_memory
            if role == "decode" and config.decode_num_gpu_blocks_override is not None:
                changes["num_gpu_blocks_override"] = config.decode_num_gpu_blocks_override
            if config.device.startswith("cuda"):
                base = int(config.device.partition(":")[2] or 0)
                changes["device"] = f"cuda:{base + rank}"
            cfg = dataclasses.replace(config, **changes) if changes else config
            pd = {
                "role": role,
                "port": port,
                "master_addr": self.master_addr,
                "cpus": list(cpus) if cpus else None,
                "rank": rank,
                "world_size": spec.world_size,
                "num_prefill": spec.prefill,
                # a GPU of its own per core (--device cuda): the KV crosses on NCCL
                "nccl": config.device.startswith("cuda"),
            }
            if remote is not None and role == "decode":
                pd["remote"] = f"{remote[0]}:{remote[1] + 2 * (rank - spec.prefill)}"
            name = worker_name(rank, spec.prefill)
            self.workers.append(EngineWorker(cfg, name=name, replica=rank, pd=pd))
        self.prefills = self.workers[: spec.prefill]
        self.decodes = self.workers[spec.prefill :]
        self.router = PDRouter(spec.prefill, spec.decode, config.block_size)
        self._where: dict[str, EngineWorker] = {}
        self.closing = False
        self.silent_after_s = ENGINE_STALL_DEGRADED_S  # EngineHandle (pools route by role)
        self._killed: set[str] = set()  # cores this pool killed (their crash is expected)
        for w in self.workers:
            w.add_event_listener(self._on_event_of(w))

    def _on_event_of(self, worker: EngineWorker):
        def on_event(kind: str, severity: str, message: str, **_) -> None:
            if kind == "engine_crash":
                self._relink(worker)

        return on_event

    def _relink(self, crashed: EngineWorker) -> None:
        """A core died: the KV link (one gloo group) died with it. Every core restarts on a
        fresh rendezvous port, so the others are killed too (their monitors restart them):
        every request in flight on any core ends with an error, none hangs on a link that is
        gone, and no core keeps blocks or hand-offs of it."""
        if crashed.name in self._killed:  # a core this pool killed: already relinking
            self._killed.discard(crashed.name)
            return
        port = _free_port(self.master_addr)
        for w in self.workers:
            # read when each core is spawned again; a core that is starting meanwhile (its
            # engine not yet the worker's) started on the old port: EngineWorker._spawn sees
            # the port moved once it is up and starts it again on this one
            w.pd["port"] = port
        for other in self.workers:
            engine = other.engine
            if other is crashed or engine is None or engine.process is None:
                continue
            if engine.process.is_alive():
                self._killed.add(other.name)
                engine.process.kill()

    async def start(self) -> dict:
        """Start every core at once: each joins the KV link while it loads."""
        import asyncio

        tasks = [asyncio.ensure_future(w.start()) for w in self.workers]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:  # one core cannot start: the link cannot form, stop waiting
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.stop()
            raise failed
        info = dict(self.info)
        info["pids"] = self.pids
        info["roles"] = [w.pd["role"] for w in self.workers]
        return info

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """Prefill on the chosen prefill core, decode on the chosen decode core; one output
        stream. The router's counts are taken here, so a burst spreads over the cores, and
        given back when the stream ends, is closed, or is closed without ever running.

        Raises:
            EngineUnavailable: some core is not ready (the link needs them all), or the
                server is shutting down.
            RequestRejected: prompt + max_tokens can never fit a decode core's KV pool.
        """
        if self.closing:
            raise EngineUnavailable("the server is shutting down; retry on another server")
        down = [w for w in self.workers if not w.ready]
        if down:
            states = ", ".join(f"{w.name} {w.state}" for w in down)
            raise EngineUnavailable(f"disaggregated serving needs every core ({states})")
        router = self.router
        stats = {w.replica: w.engine.stats or {} for w in self.decodes}
        pool = max(int(st.get("kv_blocks_total") or 0) for st in stats.values())
        n = len(prompt_token_ids)
        need = router.blocks_for(n + params.max_tokens)
        if pool and need > pool:  # refused before any prefill: the API's 400 names the field
            prompt_alone = router.blocks_for(n + 1) > pool
            what = f"the {n}-token prompt"
            if not prompt_alone:
                what = f"max_tokens={params.max_tokens} plus {what}"
            raise RequestRejected(
                f"{what} needs {need} KV blocks but a decode core's pool has {pool} "
                f"({pool * router.block_size} tokens); it could never run",
                blame="prompt" if prompt_alone else "max_tokens",
            )
        prefill = self.workers[router.pick_prefill([w.replica for w in self.prefills])]
        free = {r: int(st.get("kv_blocks_free") or 0) for r, st in stats.items()}
        decode = self.workers[router.pick_decode([w.replica for w in self.decodes], free)]
        held = _Held(router, prefill.replica, decode.replica, len(prompt_token_ids))
        inner = self._stream(request_id, prompt_token_ids, params, kwargs, prefill, decode, held)
        return _Reserved(inner, held)

    async def _stream(self, request_id, prompt_token_ids, params, kwargs, prefill, decode, held):
        router = self.router
        self._where[request_id] = prefill
        first = rest = None
        try:
            first = prefill.generate(
                request_id,
                prompt_token_ids,
                params,
                hand_off=True,
                decode_rank=decode.replica,
                **kwargs,
            )
            async for out in first:
                if out.new_token_ids:
                    held.prefilled()
                if out.finish_reason != "handoff":
                    yield out  # prefilling, or it ended at its first token (stop, error)
                    continue
                # the first token now; the rest comes from the decode side
                yield msgspec.structs.replace(out, finished=False, finish_reason=None)
                self._where[request_id] = decode
                router.routed[decode.replica] += 1
                held.decoding(max(0, params.max_tokens - len(out.new_token_ids)))
                try:
                    rest = decode.generate(
                        request_id, prompt_token_ids, params, adopt=True, **kwargs
                    )
                except EngineUnavailable as exc:  # it went down after the prefill began
                    raise EngineDeadError(f"decode core unavailable: {exc}") from None
            if rest is not None:
                async for out in rest:
                    held.adopted()
                    held.produced(len(out.new_token_ids))
                    yield out
        finally:
            held.release()
            self._where.pop(request_id, None)
            if first is not None:
                await first.aclose()
            if rest is not None:
                await rest.aclose()


class _Held:
    """One request's share of the router's counts: its queued prefill tokens on its prefill
    core until its first token, its promised KV blocks on its decode core until that core
    adopts it, then the output tokens it may still produce there. :meth:`release` gives back
    whatever is left (once)."""

    def __init__(self, router: PDRouter, prefill: int, decode: int, prompt_tokens: int):
        self.router, self.prefill, self.decode = router, prefill, decode
        self.queued, self.blocks, self.left = prompt_tokens, router.blocks_for(prompt_tokens), 0
        router.add(prefill, self.queued)
        router.promised[decode] += self.blocks
        router.routed[prefill] += 1

    def prefilled(self) -> None:
        self.router.add(self.prefill, -self.queued)
        self.queued = 0

    def decoding(self, left: int) -> None:
        self.router.add(self.decode, left - self.left)
        self.left = left

    def adopted(self) -> None:
        self.router.promised[self.decode] -= self.blocks
        self.blocks = 0

    def produced(self, tokens: int) -> None:
        took = min(self.left, tokens)
        self.router.add(self.decode, -took)
        self.left -= took

    def release(self) -> None:
        self.prefilled()
        self.adopted()
        self.decoding(0)


class _Reserved:
    """The pool's output stream: the request's counts were taken when it was routed; its own
    ``finally`` gives them back once it has run, and :meth:`aclose` when it never ran (an
    async generator closed before its first step skips its ``finally``: a client gone before
    the response started)."""

    def __init__(self, inner, held: _Held):
        self.inner, self.held, self.started = inner, held, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        self.started = True
        return await self.inner.__anext__()

    async def aclose(self) -> None:
        if not self.started:
            self.held.release()
        await self.inner.aclose()
