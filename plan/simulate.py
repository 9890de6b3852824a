"""Replay a workload through the engine's own scheduler with modelled step times.

Each replica is the engine's real :class:`~tokenmill.engine.scheduler.Scheduler` over a real
:class:`~tokenmill.engine.block_manager.BlockManager` (prefix cache, watermark, preemption by
recompute, admission policy: whatever the knobs say); several replicas sit behind the data-
parallel server's own :class:`~tokenmill.engine.api.replicas.Router` (its outstanding-token
counts, and its rule: the least count, the lowest index on ties). No forward runs: a step
takes the time the step-cost model gives for what the scheduler put in it, and each request
stops at its recorded output length.

Time advances from event to event (an arrival, a step's end). Fast-forward: when the scheduler
plans a step of decodes only, with every running request in it and nothing preempted, the
steps after it are the same step again (one token more of context each) until a request
reaches its last token, the pool runs out of free blocks for the blocks the batch grows into,
or a request arrives at this replica. Those K steps are costed in one go (their times grow
linearly with the context) and applied at once: blocks allocated, tokens appended, full blocks
registered in the prefix cache. An arrival routed to a replica in the middle of such a run cuts
it at the step the arrival falls in, as the engine would admit it at the next step. Within a
run of K steps a request's K-1 inter-token latencies are booked as their mean (the run's step
times differ by the context's growth only); ``fast_forward=False`` plans every step through
the scheduler, which the tests hold the fast path to.

The router's outstanding-token counts are booked when a replica's step (or run of steps) ends;
an arrival routed while runs are in flight has each run's ended steps counted off first, so
the router decides as it would have step by step.

The replay goes through the engine's declared seams only: the block pool's constructor takes
the replay's block hasher and turns the miss reasons off, the replay's pool overrides public
methods of :class:`BlockManager` only, tokens are appended with
:meth:`Request.append_token`, and a request's replay bookkeeping (:class:`_ReplayState`) sits
in :attr:`Request.driver_state`.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from tokenmill.engine.api.replicas import Router
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.errors import RequestRejected
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.telemetry import latency

from .split import MAX_REPLICAS, Part, Seat, can_split, run_split, usable_cores
from .step_cost import StepCostModel
from .workload import ReplayWorkload

#: a replay splits its replicas over processes (one per usable core, at most) from this many
#: replicas and requests: below them, starting processes costs more than it saves
SPLIT_MIN_REPLICAS = 4
SPLIT_MIN_REQUESTS = 20_000


@dataclass
class Setup:
    """What the replay runs: the engine's knobs, each replica's KV blocks, the replica count,
    each replica's CPU threads (None: as recorded) and the context limit."""

    config: EngineConfig
    num_blocks: int
    replicas: int = 1
    threads: int | None = None
    max_model_len: int = 1 << 20


@dataclass
class SimResult:
    """Per request (workload order; NaN where it never got there) and overall.

    Times in seconds from the workload's first arrival; latencies in ms, as the store keeps
    them, with the recording's API time around the engine added (TTFT: before; E2E: both)."""

    latencies: dict[str, np.ndarray]
    """the ``requests`` latency columns a replay knows, by name (``telemetry/latency.py``)"""
    output_tokens: np.ndarray
    preemptions: np.ndarray
    rejected: np.ndarray
    steps: int = 0
    scheduler_calls: int = 0
    kv_usage_mean: float = 0.0
    """the replicas' KV pools' mean use over time"""
    kv_usage_max: float = 0.0
    """the fullest any replica's pool got"""
    waiting_mean: float = 0.0
    """requests waiting over all replicas, mean over time"""
    waiting_max: int = 0
    """the longest queue of any one replica"""
    running_mean: float = 0.0
    """requests running over all replicas, mean over time"""
    max_decode_batch: int = 0
    max_eager_decode_batch: int = 0
    steps_by_kind: dict = field(default_factory=dict)
    prefix_hit_tokens: int = 0
    makespan_s: float = 0.0
    wall_s: float = 0.0
    routed: list[int] = field(default_factory=list)
    processes: int = 1
    """the processes the replay ran in (:mod:`.split`)"""

    @property
    def ttft_ms(self) -> np.ndarray:
        return self.latencies["ttft_ms"]

    @property
    def itl_p50_ms(self) -> np.ndarray:
        return self.latencies["itl_p50_ms"]

    @property
    def itl_p99_ms(self) -> np.ndarray:
        return self.latencies["itl_p99_ms"]

    @property
    def tpot_ms(self) -> np.ndarray:
        return self.latencies["tpot_ms"]

    @property
    def e2e_ms(self) -> np.ndarray:
        return self.latencies["e2e_ms"]


def _quantile(segs: list[tuple[float, int]], q: float) -> float:
    """``np.quantile`` (linear) of the samples ``segs`` holds as ``(value, count)`` runs."""
    segs = sorted(segs)
    n = sum(c for _, c in segs)
    pos = q * (n - 1)
    lo, frac = int(pos), pos - int(pos)

    def at(k: int) -> float:
        seen = 0
        for v, c in segs:
            seen += c
            if k < seen:
                return v
        return segs[-1][0]

    a = at(lo)
    return a if frac == 0 else a + (at(lo + 1) - a) * frac


@dataclass(slots=True)
class _ReplayState:
    """What the replay keeps per request (in :attr:`Request.driver_state`)."""

    index: int
    """its row in the workload"""
    shared: int
    """its first prompt blocks another prompt may hold too (:meth:`ReplayWorkload.shared_blocks`)"""
    registered: int = 0
    """its first blocks :meth:`_ReplayBlockManager.cache_full_blocks` is done with"""
    finished: bool = False
    """it reached its recorded output length (freed finished, not preempted)"""


def replay_block_hash(parent: int | None, token_ids: list[int], salt: str) -> int:
    """The replay's :class:`~tokenmill.engine.block_manager.BlockHasher`: Python's tuple hash
    over (parent hash, token ids, salt) instead of SHA-256 (equal prefixes still hash equal; a
    hit is still verified against the block's token ids; a replay hashes millions of blocks)."""
    return hash((0 if parent is None else parent, *token_ids, salt))


class _ReplayBlockManager(BlockManager):
    """The engine's KV block pool with changes a replay needs and nothing it measures observes,
    over the pool's declared seams: its block hasher is :func:`replay_block_hash`; cache-miss
    reasons and the memory of evicted hashes behind them (reporting only) are off
    (``keep_miss_reasons=False``); and a request's full blocks are registered from the first
    one not yet looked at, not from its first block each time (:meth:`cache_full_blocks`).

    A running request's prompt blocks from its first block of its own on
    (``_ReplayState.shared`` blocks come before it, :meth:`ReplayWorkload.shared_blocks`) are not
    registered: no other prompt holds their tokens, so only the request itself could hit them,
    after a preemption, and it registers them when it is preempted (:meth:`free`). A finished
    request's blocks are never looked up again."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        prefix_cache_scope: str = "tenant",
    ):
        super().__init__(
            num_blocks,
            block_size,
            enable_prefix_caching,
            prefix_cache_scope,
            hasher=replay_block_hash,
            keep_miss_reasons=False,
        )

    def cache_full_blocks(self, request: Request, with_outputs: bool = False) -> None:
        # the engine's own registration, from the first block not yet registered (it walks
        # every full block of the request each time). A block whose prefix another block
        # already holds stays unregistered, and is looked at again at the next call, as the
        # engine does: once that other block is evicted, this one is registered. Blocks only
        # this request holds (its output tokens' and its prompt's from its own first block
        # on) wait until it is freed unfinished (preempted: its recompute may hit them).
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        state: _ReplayState = request.driver_state
        num_full = min(request.num_computed_tokens // bs, len(request.block_ids))
        if not with_outputs:
            num_full = min(num_full, state.shared)
        done = state.registered
        if num_full <= done:
            return
        self.extend_hashes(request, num_full)
        blocks, cached = self.blocks, self.cached
        behind = None  # the first block left unregistered behind another holding its prefix
        for i in range(done, num_full):
            block = blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            h = request.block_hashes[i]
            if h in cached:
                if behind is None:
                    behind = i
                continue
            block.block_hash = h
            block.token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            cached[h] = block
        state.registered = num_full if behind is None else behind

    def free(self, request: Request) -> None:
        state: _ReplayState = request.driver_state
        if not state.finished:
            # preempted: all its full blocks, as run
            self.cache_full_blocks(request, with_outputs=True)
        super().free(request)
        state.registered = 0  # a preempted request registers its blocks anew


class _Replica:
    """One engine core: its scheduler, pool and the step (or run of steps) in flight."""

    def __init__(self, index: int, setup: Setup):
        cfg = setup.config
        self.index = index
        self.bm = _ReplayBlockManager(
            setup.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.prefix_cache_scope
        )
        self.sched = Scheduler(cfg, self.bm, setup.max_model_len)
        self.out: SchedulerOutput | None = None
        # the run in flight: its j-th step (1-based) ends at t0 + j*s + g*j*(j-1)/2
        self.t0 = self.s = self.g = 0.0
        self._a = self._aa = self._g2 = 0.0
        self.k = 0  # steps of the run in flight that will be applied
        self.batch = 0  # requests in each of its steps (read only while it is in _runs)
        self.kind = ""  # its step kind (StepCostModel.steps' kinds)
        self.version = 0
        # KV use, queue and batch integrated over time, and their peaks
        self.t = 0.0
        self.kv_area = self.wait_area = self.run_area = 0.0
        self.kv_max = 0.0
        self.wait_max = 0

    def end_of(self, j: int) -> float:
        """When step ``j`` (1-based) of the run in flight ends."""
        return self.t0 + j * self.s + self.g * (j * (j - 1) / 2)

    def start_run(self, t0: float, s: float, g: float, k: int) -> None:
        """A run of ``k`` steps from ``t0``: the first takes ``s``, each next ``g`` more."""
        self.t0, self.s, self.g, self.k = t0, s, g, k
        a = s - g / 2  # the terms of steps_done's root
        self._a, self._aa, self._g2 = a, a * a, 2 * g

    def steps_done(self, t: float) -> int:
        """Steps of the run in flight ended by ``t`` (the root of :meth:`end_of`)."""
        dt = t - self.t0
        if self.g > 1e-15:
            q = self._aa + self._g2 * dt  # a * a + 2 * g * dt
            if q < 0.0:
                q = 0.0
            x = (math.sqrt(q) - self._a) / self.g
        else:
            x = dt / self.s
        done = math.floor(x + 1e-9)
        return done if done > 0 else 0

    def touch(self, t: float) -> None:
        """Book the pool and queue as they stood since the last change, up to ``t``."""
        dt = t - self.t
        if dt > 0:
            kv = self.bm.num_used_blocks / self.bm.num_blocks
            waiting = len(self.sched.waiting)
            self.kv_area += kv * dt
            self.wait_area += waiting * dt
            self.run_area += len(self.sched.running) * dt
            self.kv_max = max(self.kv_max, kv)
            self.wait_max = max(self.wait_max, waiting)
        self.t = t


class Simulation:
    """One replay (see the module docstring). Use :func:`simulate`.

    With ``replicas`` and ``seat`` it replays only that block of the fleet's replicas, one
    process of a split replay (:mod:`.split`): every arrival is routed at the meeting, and only
    those routed to its replicas are admitted here."""

    def __init__(
        self,
        workload: ReplayWorkload,
        setup: Setup,
        model: StepCostModel,
        *,
        fast_forward: bool = True,
        replicas: range | None = None,
        seat: Seat | None = None,
    ):
        self.w, self.setup, self.model, self.fast = workload, setup, model, fast_forward
        self.owned = replicas if replicas is not None else range(setup.replicas)
        self.seat = seat
        shape = model.shape
        self._attn = shape.attn_flop_per_pair * shape.layers / 1e9  # GFLOP per attended pair
        # per path, the forward (scaled to this replica's threads) and host coefficients summed
        scale = model.thread_scale(setup.threads)[0]
        fallback = next(iter(model.paths.values()))
        self._coef = {
            path: tuple(
                (model.paths.get(path, fallback).forward.coef * scale
                 + model.paths.get(path, fallback).host.coef).tolist()
            )
            for path in ("compiled", "eager")
        }  # fmt: skip
        self._gap = model.gap_ms
        n = len(workload)
        nan = np.full(n, np.nan)
        # per request, as compact arrays of plain numbers (a replay touches them millions of
        # times; numpy's per-item access costs more); NaN: not yet
        self.first = array("d", [math.nan]) * n
        self.last = array("d", [math.nan]) * n
        self.finish = array("d", [math.nan]) * n
        self.itl50 = nan.copy()
        self.itl99 = nan.copy()
        self.produced = array("q", [0]) * n
        self.preempt = array("q", [0]) * n
        self._inputs = workload.input_tokens.tolist()
        self._outputs = workload.output_tokens.tolist()
        self.rejected = np.zeros(n, dtype=bool)
        self.segs: dict[int, list[tuple[float, int]]] = {}
        self.left: dict[int, int] = {}  # router's outstanding tokens per request
        self.replicas = [
            _Replica(i, setup) if i in self.owned else None for i in range(setup.replicas)
        ]
        self._mine = [rep for rep in self.replicas if rep is not None]  # this process's
        self.route = array("h", [-1]) * (n if seat is not None else 0)  # each arrival's replica
        self.router = Router(setup.replicas, setup.config.block_size)
        # the replicas with a run of several steps in flight: at an arrival the router's counts
        # are brought up to the steps each such run has ended by then, as step-by-step would
        # have booked them (a run's tokens are booked when it ends)
        self._runs: dict[int, _Replica] = {}
        # per replica, a count its outstanding tokens cannot fall below before its next step
        # (or run) ends: the booked count less every token of the run in flight. An arrival
        # works out the counts at its time only where this floor does not rule a replica out.
        self._floor = [0] * setup.replicas
        self.heap: list = []
        self._held: list = []  # heap entries set aside by _work_ahead
        self.seq = itertools.count()
        self.steps = self.calls = 0
        self.max_batch = 0
        self.max_eager = 0  # the largest decode-only batch run on the eager path
        self.kinds: dict[str, int] = {}  # steps replayed per kind (StepCostModel.steps' kinds)
        self._t = 0.0

    # ----- step cost -----
    def _row(self, out: SchedulerOutput) -> tuple:
        kv = pairs = 0
        for c in out.chunks:
            s, q = c.start, c.num_new_tokens
            kv += s + q
            pairs += q * s + q * (q + 1) // 2
        return (
            1.0,
            out.num_decode_tokens,
            out.num_prefill_tokens,
            out.num_prefill_chunks,
            pairs * self._attn,
            kv / 1e6,
        )

    def _path(self, out: SchedulerOutput) -> str:
        decode_only = not out.num_prefill_chunks and not out.num_drafts
        path = self.model.path_of(decode_only, out.num_decode_tokens)
        if decode_only and path == "eager":
            self.max_eager = max(self.max_eager, out.num_decode_tokens)
        return path

    def _ms(self, x: tuple, path: str) -> float:
        """:meth:`StepCostModel.step_ms` of one step, in plain floats (a replay costs millions)."""
        c = self._coef[path]
        return (
            self._gap
            + c[0] * x[0]
            + c[1] * x[1]
            + c[2] * x[2]
            + c[3] * x[3]
            + c[4] * x[4]
            + c[5] * x[5]
        )

    # ----- a replica's steps -----
    def _start(self, rep: _Replica, now: float) -> None:
        out = rep.sched.schedule()
        self.calls += 1
        self._runs.pop(rep.index, None)
        self._floor[rep.index] = self.router.outstanding[rep.index]
        if out.empty:
            rep.out = None
            return
        for victim in out.preempted:
            self.preempt[victim.driver_state.index] += 1
        x = self._row(out)
        path = self._path(out)
        k = 1
        step_s = self._ms(x, path) / 1e3
        if self.fast:
            k = self._run_length(rep, out)
        rep.kind = "with_prefill" if out.num_prefill_chunks else f"{path}_decode"
        grow = 0.0
        if k > 1:
            # each step of the run reads one more KV token per request (and attends to it)
            batch = len(out.chunks)
            c = self._coef[path]
            grow = (c[4] * batch * self._attn + c[5] * batch / 1e6) / 1e3
            self._runs[rep.index] = rep
            rep.batch = batch
            self._floor[rep.index] -= k * batch
        rep.out = out
        rep.start_run(now, step_s, grow, k)
        rep.version += 1
        heapq.heappush(self.heap, (rep.end_of(k), next(self.seq), rep.index, rep.version))

    def _run_length(self, rep: _Replica, out: SchedulerOutput) -> int:
        """Steps the planned decode-only step repeats for unchanged (1: not such a step)."""
        sched = rep.sched
        if (
            out.num_prefill_chunks
            or out.preempted
            or out.allocation_failures
            or out.num_drafts
            or len(out.chunks) != len(sched.running)
        ):
            return 1
        reqs = [c.request for c in out.chunks]
        outputs = self._outputs
        k = min(outputs[r.driver_state.index] - len(r.output_token_ids) for r in reqs)
        if k <= 1:
            return 1
        bm = rep.bm
        free = bm.num_free_blocks

        def need(steps: int) -> int:
            return sum(
                max(bm.blocks_needed(r.num_computed_tokens + steps) - len(r.block_ids), 0)
                for r in reqs
            )

        if need(k) > free:  # the largest run whose growth the free blocks hold
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if need(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        return k

    def _cut(self, rep: _Replica, t: float) -> None:
        """A request arrived at ``t`` while ``rep`` runs several steps: stop after the step
        that ``t`` falls in."""
        if rep.out is None or rep.k <= 1:
            return
        k = min(max(rep.steps_done(t), 1), rep.k)  # the first step ending at or after t
        while k > 1 and rep.end_of(k - 1) >= t:
            k -= 1
        while k < rep.k and rep.end_of(k) < t:
            k += 1
        if k < rep.k:
            rep.k = k
            rep.version += 1
            heapq.heappush(self.heap, (rep.end_of(k), next(self.seq), rep.index, rep.version))

    def _end(self, rep: _Replica) -> float:
        """Apply the step (or run of steps) that just ended; returns its end time."""
        out, k = rep.out, rep.k
        end = rep.end_of(k)
        sched, bm = rep.sched, rep.bm
        first_end = rep.end_of(1)
        sampling = sched.update_after_step(out)
        self.steps += k
        self.kinds[rep.kind] = self.kinds.get(rep.kind, 0) + k
        taken: dict[int, int] = {}
        first, last, produced, segs = self.first, self.last, self.produced, self.segs
        output_token = self.w.output_token
        for chunk in sampling:
            req = chunk.request
            i = req.driver_state.index
            tok = output_token(i)
            req.append_token(tok, None)  # the replay books its own times
            n = 1
            if first[i] != first[i]:  # NaN: its first token
                first[i] = first_end
                taken[i] = self._inputs[i]
            else:
                segs[i].append((first_end - last[i], 1))
            if k > 1:
                more = k - 1
                bm.allocate_slots(req, more)
                req.append_token(tok, None, more)
                req.num_computed_tokens += more
                segs[i].append(((end - first_end) / more, more))
                n += more
            last[i] = end
            produced[i] += n
            taken[i] = taken.get(i, 0) + n
        if k > 1:
            sched.step_id += k - 1
            self.max_batch = max(self.max_batch, len(sampling))
        elif out.num_prefill_chunks == 0:
            self.max_batch = max(self.max_batch, len(sampling))
        self._uncount(rep, taken)
        outputs = self._outputs
        for chunk in sampling:
            req = chunk.request
            state = req.driver_state
            i = state.index
            if len(req.output_token_ids) >= outputs[i] and not req.status.finished:
                state.finished = True
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                self.finish[i] = end
                self._count(rep, i, -self.left.get(i, 0))
                self._close(i)
        return end

    def _count(self, rep: _Replica, i: int, delta: int) -> None:
        left = self.left.get(i, 0)
        delta = max(delta, -left)
        self.left[i] = left + delta
        self.router.add(rep.index, delta)
        self._floor[rep.index] += delta

    def _uncount(self, rep: _Replica, taken: dict[int, int]) -> None:
        """:meth:`_count` of ``-n`` for each request ``i`` that made ``n`` tokens, booked on its
        replica at once (a step's requests all run on ``rep``)."""
        left = self.left
        total = 0
        for i, n in taken.items():
            had = left.get(i, 0)
            d = n if n < had else had
            left[i] = had - d
            total += d
        if total:
            self.router.add(rep.index, -total)
            self._floor[rep.index] -= total

    def _close(self, i: int) -> None:
        segs = self.segs.pop(i, [])
        self.left.pop(i, None)
        if segs:
            self.itl50[i] = _quantile(segs, 0.5) * 1e3
            self.itl99[i] = _quantile(segs, 0.99) * 1e3

    # ----- the replay -----
    def _arrive(self, i: int, t: float) -> None:
        w = self.w
        if self.seat is None:
            rep = self.replicas[self._pick(t)]
        else:
            least, mine = self._least(t)
            until = float(w.arrival_s[i + 1]) if i + 1 < len(w) else math.inf
            j = self.seat.pick(
                i, count=least, replica=mine, idle=lambda: self._work_ahead(until, mine)
            )
            for entry in self._held:  # the offered replica's step, set aside while waiting
                heapq.heappush(self.heap, entry)
            self._held.clear()
            self.route[i] = j
            rep = self.replicas[j]
            if rep is None:
                return  # another process's replica
        shared = w.shared_blocks(i)
        prompt = w.prompt(i, shared)
        max_tokens = int(w.max_tokens[i])
        rep.touch(t)
        req = Request(
            str(i),
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            tenant=w.tenants[i],
            arrival_ns=int(t * 1e9),
        )
        req.driver_state = _ReplayState(i, shared)
        try:
            rep.sched.add_request(req)
        except RequestRejected:
            self.rejected[i] = True
            return
        self.segs[i] = []
        cost = len(prompt) + max_tokens
        self.left[i] = 0
        self._count(rep, i, cost)
        self.router.routed[rep.index] += 1
        if rep.out is None:
            self._start(rep, t)
        else:
            self._cut(rep, t)

    def _least_of(self, t: float, first: int, stop: int) -> tuple[int, int]:
        """The least outstanding-token count among replicas ``first .. stop - 1`` at ``t``, and
        its replica (the lowest index on ties: the router's rule; a replay's router has no
        prefix affinity). A count is the booked one less the tokens of the steps that the
        replica's run in flight has ended by ``t`` (booked when the run ends), worked out only
        for replicas whose floor (see ``_floor``) is below the least count found so far."""
        booked, floor, runs = self.router.outstanding, self._floor, self._runs
        bound = min(booked[first:stop])  # the least count is at most this
        best, best_j = bound + 1, first
        for j in range(first, stop):
            if floor[j] < best:  # else its count cannot be below the best so far
                rep = runs.get(j)
                count = booked[j] - rep.steps_done(t) * rep.batch if rep else booked[j]
                if count < best:
                    best, best_j = count, j
        return best, best_j

    def _pick(self, t: float) -> int:
        """The router's pick at ``t`` among all replicas (see :meth:`_least_of`)."""
        return self._least_of(t, 0, len(self.replicas))[1]

    def _least(self, t: float) -> tuple[int, int]:
        """This process's offer at ``t``: the least count among its replicas and its replica."""
        return self._least_of(t, self.owned.start, self.owned.stop)

    def _work_ahead(self, until: float, hold: int) -> bool:
        """While a split replay waits for the others' offers: apply the next step ending by
        ``until`` (the next arrival) of a replica other than ``hold`` (the one this process
        offered). The arrival goes to ``hold`` or to another process, so those replicas' steps
        up to the next arrival are the same either way. False when there is none."""
        heap, reps = self.heap, self.replicas
        while heap and heap[0][0] <= until:
            t, _, r, version = entry = heapq.heappop(heap)
            rep = reps[r]
            if version != rep.version or rep.out is None:
                continue
            if r == hold:
                self._held.append(entry)
                continue
            rep.touch(t)
            self._t = max(self._t, t)
            self._start(rep, self._end(rep))
            return True
        return False

    def run(self) -> SimResult:
        began = time.perf_counter()
        self.run_events()
        return _result(self.w, [self.part()], None, time.perf_counter() - began)

    def run_events(self) -> None:
        """Every arrival and step, in time order."""
        arrivals = self.w.arrival_s
        n = len(arrivals)
        i = 0
        reps = self.replicas
        heap = self.heap
        while i < n or heap:
            t_arr = float(arrivals[i]) if i < n else math.inf
            if heap and heap[0][0] <= t_arr:
                t, _, r, version = heapq.heappop(heap)
                rep = reps[r]
                if version != rep.version or rep.out is None:
                    continue
                rep.touch(t)
                self._t = max(self._t, t)  # a split replay may have worked ahead
                end = self._end(rep)
                self._start(rep, end)
            else:
                self._t = max(self._t, t_arr)
                self._arrive(i, t_arr)
                i += 1
        for rep in self._mine:
            rep.touch(self._t)

    def part(self) -> Part:
        """This replay's per-request arrays and totals (one process's share when split)."""
        mine = self._mine
        as_np = lambda a, dtype: np.frombuffer(a, dtype=dtype).copy()  # noqa: E731
        return Part(
            replicas=self.owned,
            arrays={
                "first": as_np(self.first, np.float64),
                "last": as_np(self.last, np.float64),
                "finish": as_np(self.finish, np.float64),
                "itl50": self.itl50,
                "itl99": self.itl99,
                "produced": as_np(self.produced, np.int64),
                "preempt": as_np(self.preempt, np.int64),
                "rejected": self.rejected,
            },
            tally={
                "steps": self.steps,
                "calls": self.calls,
                "max_batch": self.max_batch,
                "max_eager": self.max_eager,
                "kinds": dict(self.kinds),
                # per replica, summed in replica order by _result
                "kv_area": {r.index: r.kv_area for r in mine},
                "wait_area": {r.index: r.wait_area for r in mine},
                "run_area": {r.index: r.run_area for r in mine},
                "kv_max": max((r.kv_max for r in mine), default=0.0),
                "wait_max": max((r.wait_max for r in mine), default=0),
                "prefix_hits": sum(r.bm.prefix_hits for r in mine),
                "t": self._t,
                "routed": list(self.router.routed),  # only this process's replicas counted
            },
        )


def _result(
    w: ReplayWorkload, parts: list[Part], route: np.ndarray | None, wall_s: float
) -> SimResult:
    """The replay's :class:`SimResult` from its processes' parts (each request's numbers from
    the process its replica was in; ``route``: the replica each arrival went to)."""
    arrays = dict(parts[0].arrays)
    for part in parts[1:]:
        theirs = (route >= part.replicas.start) & (route < part.replicas.stop)
        for name, values in part.arrays.items():
            arrays[name] = np.where(theirs, values, arrays[name])
    tallies = [p.tally for p in parts]
    total = lambda key: sum(t[key] for t in tallies)  # noqa: E731

    def area(key: str) -> float:
        per_replica = {j: a for t in tallies for j, a in t[key].items()}
        return sum(per_replica[j] for j in sorted(per_replica))

    most = lambda key: max(t[key] for t in tallies)  # noqa: E731
    kinds: dict[str, int] = {}
    for t in tallies:
        for kind, n in t["kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    arrival = w.arrival_s
    pre, post = w.pre_engine_s, w.post_engine_s
    first, last, finish = arrays["first"], arrays["last"], arrays["finish"]
    done = ~np.isnan(finish)
    n_out = arrays["produced"]
    times = latency.request_latencies(
        arrival=arrival,
        end=finish,
        output_tokens=np.where(done, n_out, 0),
        first_token=first,
        last_token=last,
        scale=latency.S,
        before=pre,
        after=post,
    )
    # the replay's ITL: quantiles of each request's steps (no per-token times kept)
    times.update(itl_p50_ms=arrays["itl50"], itl_p99_ms=arrays["itl99"])
    makespan = most("t")
    span = makespan or 1e-9
    replicas = sum(len(p.replicas) for p in parts)
    return SimResult(
        latencies={k: v for k, v in times.items() if v is not None},
        output_tokens=n_out,
        preemptions=arrays["preempt"],
        rejected=arrays["rejected"],
        steps=total("steps"),
        scheduler_calls=total("calls"),
        kv_usage_mean=area("kv_area") / span / replicas,
        kv_usage_max=most("kv_max"),
        waiting_mean=area("wait_area") / span,
        waiting_max=most("wait_max"),
        running_mean=area("run_area") / span,
        max_decode_batch=most("max_batch"),
        max_eager_decode_batch=most("max_eager"),
        steps_by_kind=kinds,
        prefix_hit_tokens=total("prefix_hits"),
        makespan_s=makespan,
        wall_s=wall_s,
        routed=[sum(col) for col in zip(*(t["routed"] for t in tallies), strict=True)],
        processes=len(parts),
    )


def simulate(
    workload: ReplayWorkload,
    setup: Setup,
    model: StepCostModel,
    *,
    fast_forward: bool = True,
    processes: int | None = None,
) -> SimResult:
    """Replay ``workload`` under ``setup`` with step times from ``model``.

    ``processes``: how many processes share the fleet's replicas (:mod:`.split`; the result is
    the same). None: one per usable core, at most two, for a replay of at least
    :data:`SPLIT_MIN_REPLICAS` replicas (at most :data:`~.split.MAX_REPLICAS`) and
    :data:`SPLIT_MIN_REQUESTS` requests when this process may fork (:func:`~.split.can_split`);
    else one."""
    if processes is None:
        big = SPLIT_MIN_REPLICAS <= setup.replicas <= MAX_REPLICAS
        big = big and len(workload) >= SPLIT_MIN_REQUESTS
        processes = min(usable_cores(), 2) if big and can_split() else 1
    processes = max(1, min(processes, setup.replicas))
    with _cyclic_gc_paused():
        if processes == 1:
            return Simulation(workload, setup, model, fast_forward=fast_forward).run()
        began = time.perf_counter()

        def make(replicas: range | None, seat: Seat | None) -> Simulation:
            return Simulation(
                workload, setup, model, fast_forward=fast_forward, replicas=replicas, seat=seat
            )

        parts, route = run_split(make, setup.replicas, processes)
        return _result(workload, parts, route, time.perf_counter() - began)


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Python's cycle collector off for the replay (reference counting still frees everything
    the replay drops). The replay makes next to no reference cycles (a few dozen objects in a
    100,000-request replay), but its millions of short-lived objects start collector passes
    that walk the workload's millions of long-lived ones, and in a split replay's forked
    processes those walks write to pages shared with the first: about a sixth of a big split
    replay's time. The switch is the process's: in the console, other sessions' threads run
    without the collector too while a replay runs (it is on again once the replays end)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
