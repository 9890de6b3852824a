"""Data parallelism: N engine cores behind one API (``tokenmill serve --data-parallel-size N``).

:class:`ReplicaPool` holds N :class:`~.worker.EngineWorker` s (replica ``i`` is worker ``i``,
each a full copy of the model in its own process, restarted on its own when it dies) behind
the worker's interface, so admission and ``/health`` do not know how many there are.

Routing (:class:`Router`): a request goes to the ready replica with the fewest **outstanding
tokens**: for every request it holds, the prompt tokens until its first output plus the output
tokens it may still produce (``max_tokens`` minus those produced). A decode step's cost grows
with the tokens it holds and a prefill's with the prompt, so this tracks the work waiting in a
replica better than a request count (vLLM's and SGLang's routers balance on queue length or
load the same way). With ``--router-prefix-affinity`` a request whose first
:data:`AFFINITY_BLOCKS` KV blocks of prompt were last routed to replica ``r`` goes to ``r`` (its
prefix cache may hold them) while
``r`` holds at most :data:`AFFINITY_SLACK_TOKENS` outstanding tokens more than the least loaded
replica; past that, load wins. The slack is what lets affinity skew load: a flood of requests
sharing a prefix piles onto one replica up to that margin, the case ``replica_imbalance`` names.

A replica silent for :attr:`ReplicaPool.silent_after_s` (the point ``/health`` calls it
degraded: frozen, or in one very long step) leaves the rotation until it speaks again, while
another replica still speaks; when all are silent, all stay in it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator

from ..config import EngineConfig
from ..messages import RequestOutput
from .worker import ENGINE_STALL_DEGRADED_S, EngineUnavailable, EngineWorker

__all__ = ["AFFINITY_BLOCKS", "AFFINITY_SLACK_TOKENS", "ReplicaPool", "Router"]

#: outstanding tokens a prefix-affine replica may hold beyond the least loaded one before a
#: request sharing its prefix goes elsewhere: about 22 chat requests of 300 prompt + 64 output
#: tokens. SGLang's cache-aware router uses an absolute (32 requests) and a relative threshold
#: the same way; ours is in tokens, like the load it is compared with.
AFFINITY_SLACK_TOKENS = 8192
#: engine stats that add up over the replicas in ``/health``; the others are each replica's own
#: setting (``max_model_len``, ``block_size``) and come from replica 0
ADDITIVE_STATS = frozenset(
    {
        "num_running",
        "num_waiting",
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_blocks_free",
        "kv_blocks_cached",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "cpu_threads",
    }
)
#: KV blocks of prompt the affinity key covers: a chat template's fixed header (and a default
#: system prompt, ~25 tokens for SmolLM2) fills the first block of every chat prompt, so a
#: one-block key would pin all chat traffic to one replica
AFFINITY_BLOCKS = 4
#: prompt-prefix keys remembered for affinity (oldest forgotten first)
AFFINITY_KEYS = 4096


class Router:
    """Picks a replica for each request and keeps the outstanding-token count per replica.

    Args:
        size: number of replicas.
        block_size: the engine's KV block size (tokens); the affinity key is the first
            :data:`AFFINITY_BLOCKS` blocks of prompt.
        prefix_affinity: ``--router-prefix-affinity``.
    """

    def __init__(self, size: int, block_size: int, prefix_affinity: bool = False):
        self.outstanding = [0] * size
        self.key_tokens = block_size * AFFINITY_BLOCKS
        self.prefix_affinity = prefix_affinity
        self._last: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        self.routed = [0] * size
        self.affine = 0  # requests routed by affinity against the least-loaded choice

    def pick(self, ready: list[int], prompt_token_ids: list[int]) -> int:
        """The replica (one of ``ready``: distinct indices, not empty) for a prompt: the least
        outstanding tokens (lowest index on ties), or the prefix-affine one within
        :data:`AFFINITY_SLACK_TOKENS`."""
        counts = self.outstanding
        if len(ready) == len(counts):  # ready holds distinct indices: every replica
            least = self.least_in(0, len(counts))
        else:
            least = min(ready, key=lambda r: (counts[r], r))
        if not self.prefix_affinity or len(prompt_token_ids) < self.key_tokens:
            return least
        key = tuple(prompt_token_ids[: self.key_tokens])
        affine = self._last.get(key)
        pick = least
        if (
            affine is not None
            and affine in ready
            and self.outstanding[affine] <= self.outstanding[least] + AFFINITY_SLACK_TOKENS
        ):
            pick = affine
            self.affine += pick != least
        self._last[key] = pick
        self._last.move_to_end(key)
        while len(self._last) > AFFINITY_KEYS:
            self._last.popitem(last=False)
        return pick

    def least_in(self, first: int, stop: int) -> int:
        """The replica of ``first .. stop - 1`` with the fewest outstanding tokens (the lowest
        index on ties)."""
        counts = self.outstanding[first:stop]
        return first + counts.index(min(counts))

    def add(self, replica: int, tokens: int) -> None:
        """Count ``tokens`` (may be negative) against ``replica``."""
        self.outstanding[replica] += tokens


class ReplicaPool:
    """N engine workers behind :class:`~.worker.EngineWorker`'s interface.

    Args:
        config: the engine configuration each replica runs; on CUDA replica ``i`` takes the
            devices ``i * TP .. i * TP + TP - 1``, on CPU each gets ``--cpu-threads`` (or an
            even share of the cores when that is 0: two engines that each use every core slow
            each other many times over).
        cpu_count: the host's cores (for the CPU share).

    Raises:
        ValueError: the machine cannot hold ``--data-parallel-size`` replicas (one line naming
            the sizes and what there is).
    """

    name = "replicas"

    def __init__(self, config: EngineConfig, cpu_count: int | None = None):
        size = config.data_parallel_size
        self.config = config
        self.workers = [
            EngineWorker(replica_config(config, i, cpu_count), replica=i) for i in range(size)
        ]
        self.router = Router(size, config.block_size, config.router_prefix_affinity)
        self._where: dict[str, EngineWorker] = {}
        self.closing = False
        # seconds without a message after which a replica gets no new requests (the server
        # sets its --engine-stall-degraded here)
        self.silent_after_s = ENGINE_STALL_DEGRADED_S

    # -- the worker's interface ------------------------------------------------------------------
    @property
    def info(self) -> dict:
        """Replica 0's start info (every replica loads the same model)."""
        return self.workers[0].info

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    @property
    def ready(self) -> bool:
        """Every replica is serving (``/health``: ``ok``)."""
        return all(w.ready for w in self.workers)

    @property
    def can_serve(self) -> bool:
        """Some replica serves (``/health/ready``: the others restart on their own)."""
        return any(w.ready for w in self.workers)

    @property
    def state(self) -> str:
        """``ready`` (all), ``restarting`` (some serve: degraded), else ``down``."""
        if self.ready:
            return "ready"
        return "restarting" if any(w.ready for w in self.workers) else "down"

    @property
    def pids(self) -> list[int]:
        return [w.engine.pid for w in self.workers if w.engine is not None and w.engine.pid]

    def add_step_listener(self, fn) -> None:
        for w in self.workers:
            w.add_step_listener(fn)

    def add_abandoned_listener(self, fn) -> None:
        for w in self.workers:
            w.add_abandoned_listener(fn)

    def add_event_listener(self, fn) -> None:
        for w in self.workers:
            w.add_event_listener(fn)

    async def start(self) -> dict:
        """Start every replica (in turn: two loading at once would contend for memory and
        cores); raises what a replica's start raises, after stopping those already up."""
        try:
            for w in self.workers:
                await w.start()
        except BaseException:
            await self.stop()
            raise
        info = dict(self.info)
        info["pids"] = self.pids
        return info

    def stop_streams(self, reason: str) -> int:
        self.closing = True
        return sum(w.stop_streams(reason) for w in self.workers)

    async def stop(self) -> None:
        self.closing = True
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    def replica_of(self, request_id: str) -> EngineWorker | None:
        """The worker a request in flight was routed to (None once it ended)."""
        return self._where.get(request_id)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """Route one request (see :class:`Router`) and return its output stream.

        Raises:
            EngineUnavailable: no replica is ready, or the server is shutting down.
        """
        if self.closing:
            raise EngineUnavailable("the server is shutting down; retry on another server")
        ready = [w.replica for w in self.workers if w.ready]
        if not ready:
            states = ", ".join(f"{w.name} {w.state}" for w in self.workers)
            raise EngineUnavailable(f"no engine replica is ready ({states}); retry shortly")
        speaking = [r for r in ready if not self._silent(self.workers[r])]
        worker = self.workers[self.router.pick(speaking or ready, prompt_token_ids)]
        outputs = worker.generate(request_id, prompt_token_ids, params, **kwargs)
        cost = len(prompt_token_ids) + params.max_tokens
        self.router.add(worker.replica, cost)
        self.router.routed[worker.replica] += 1
        self._where[request_id] = worker
        return _Tracked(self, outputs, worker, request_id, len(prompt_token_ids), cost)

    def _silent(self, worker: EngineWorker) -> bool:
        age = worker.heartbeat_age_s
        return age is not None and age >= self.silent_after_s

    async def abort(self, request_id: str) -> None:
        worker = self._where.get(request_id)
        if worker is not None:
            await worker.abort(request_id)

    @property
    def heartbeat_age_s(self) -> float | None:
        """The longest silence among the ready replicas (None while none is up)."""
        ages = [w.heartbeat_age_s for w in self.workers]
        ages = [a for a in ages if a is not None]
        return max(ages) if ages else None

    def stall(self, degraded_s: float, unavailable_s: float) -> tuple[str, str] | None:
        """The worst replica's stall: ``unavailable`` only when every ready replica is silent
        that long (the others still serve), else ``degraded`` naming the silent ones."""
        stalls = [(w, w.stall(degraded_s, unavailable_s)) for w in self.workers if w.ready]
        silent = [(w, s) for w, s in stalls if s is not None]
        if not silent:
            return None
        every = len(silent) == len(stalls)
        severity = (
            "unavailable" if every and all(s[0] == "unavailable" for _, s in silent) else "degraded"
        )
        return severity, "; ".join(f"{w.name}: {s[1]}" for w, s in silent)

    def health(self) -> dict:
        """The pool as one worker (summed engine stats) plus each replica's own health and
        outstanding tokens under ``replicas``."""
        replicas = []
        total: dict = {}
        for w in self.workers:
            h = w.health()
            h["outstanding_tokens"] = self.router.outstanding[w.replica]
            h["routed"] = self.router.routed[w.replica]
            replicas.append(h)
            for key, value in h["stats"].items():
                if key in ADDITIVE_STATS and value is not None:
                    total[key] = (total.get(key) or 0) + value
                else:
                    total.setdefault(key, value)  # the same in every replica (block size ...)
        used, blocks = total.get("kv_blocks_used"), total.get("kv_blocks_total")
        if blocks:
            total["kv_usage"] = used / blocks
        return {
            "name": self.name,
            "state": self.state,
            "data_parallel_size": len(self.workers),
            "prefix_affinity": self.router.prefix_affinity,
            "affinity_routed": self.router.affine,
            "pid": None,
            "restarts": self.restarts,
            "stats": total,
            "replicas": replicas,
            "checked_at": time.time(),
        }


class _Tracked:
    """A replica's output stream that counts the request's outstanding tokens down as outputs
    come and gives back the rest when it ends, is closed, or is closed without ever being
    read (a client gone before the response started: an async generator's ``finally`` would
    not run then, and the replica would look busier forever)."""

    def __init__(self, pool: ReplicaPool, outputs, worker, request_id: str, prompt: int, cost):
        self.pool, self.outputs, self.worker = pool, outputs, worker
        self.request_id, self.prompt, self.cost, self.left = request_id, prompt, cost, cost
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        try:
            out = await self.outputs.__anext__()
        except BaseException:
            await self.aclose()
            raise
        taken = (self.prompt if self.left == self.cost else 0) + len(out.new_token_ids)
        taken = min(taken, self.left)
        self.pool.router.add(self.worker.replica, -taken)
        self.left -= taken
        return out

    async def aclose(self) -> None:
        if self.done:
            return
        self.done = True
        self.pool.router.add(self.worker.replica, -self.left)
        self.left = 0
        self.pool._where.pop(self.request_id, None)
        with contextlib.suppress(Exception):
            await self.outputs.aclose()


def replica_config(config: EngineConfig, replica: int, cpu_count: int | None) -> EngineConfig:
    """Replica ``replica``'s configuration: its own CUDA devices, or its share of the cores."""
    changes: dict = {}
    tp = config.tensor_parallel_size
    if config.device.startswith("cuda"):
        base = int(config.device.partition(":")[2] or 0)
        changes["device"] = f"cuda:{base + replica * tp}"
    elif config.cpu_threads == 0 and cpu_count:
        changes["cpu_threads"] = max(1, cpu_count // (config.data_parallel_size * tp))
    return dataclasses.replace(config, **changes) if changes else config


def check_data_parallel(config: EngineConfig, cpu_count: int, cuda_count: int) -> None:
    """Raises ValueError (one line) when this machine cannot start ``--data-parallel-size``
    replicas of ``--tensor-parallel-size`` ranks: on CUDA one device per rank, on CPU one core
    per rank."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    need = dp * tp
    if dp > 1 and tp > 1 and os.environ.get("MASTER_ADDR"):
        raise ValueError(
            "--data-parallel-size with ranks on several hosts (MASTER_ADDR set) is not "
            "supported: every replica would serve the rendezvous on the same MASTER_PORT"
        )
    if config.device.startswith("cuda") or (config.device == "auto" and cuda_count):
        base = int(config.device.partition(":")[2] or 0)
        if base + need > cuda_count:
            raise ValueError(
                f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs {need} CUDA "
                f"devices from cuda:{base}; this machine has {cuda_count}"
            )
    elif need > cpu_count:
        raise ValueError(
            f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs {need} CPU cores "
            f"(one per rank); this machine has {cpu_count}"
        )
