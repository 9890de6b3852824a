"""Continuous-batching scheduler: one call of :meth:`Scheduler.schedule` plans one forward.

With chunked prefill (the default) running requests are served first — each gets the tokens it
is missing (one for a decode, the rest of the prompt for a prefill, capped by
``long_prefill_token_threshold`` and the step's token budget) — then waiting requests are admitted
with whatever budget is left, so prefill chunks and decodes share a step. With chunked prefill
off, whole prompts are prefilled in prefill-only steps and decodes wait those steps (the classic
behaviour operators compare against).

When a request needs a block and none is free, the lowest-ranked running request (lowest
priority, then latest arrival) is preempted by recompute: its blocks are freed, its progress is
reset and it goes back to the front of the waiting queue.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .errors import RequestRejected
from .request import Request, RequestEvent, RequestStatus

__all__ = ["RequestRejected", "ScheduledChunk", "Scheduler", "SchedulerOutput"]


@dataclass
class ScheduledChunk:
    """``num_new_tokens`` of ``request`` computed this step, starting at ``start``.

    A speculating decode's chunk is its last sampled token followed by ``draft_token_ids``
    (counted in ``num_new_tokens``): positions ``start .. start + K``, verified together."""

    request: Request
    start: int
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    is_prefill: bool = False
    """a prompt chunk (or its recompute after a preemption), not a decode"""

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens."""
        return (
            self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens
        )

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits this chunk needs: 0, 1, or 1 + K for a speculating decode."""
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    """The plan of one step and what scheduling it cost."""

    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_chunks: int = 0
    prefix_hit_tokens: int = 0
    allocation_failures: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    admit_stop: str | None = None
    """why admission stopped with requests still waiting (``messages.ADMIT_STOP_REASONS``)"""

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Queues, admission and preemption over a :class:`BlockManager`.

    Args:
        config: the engine config (budgets, policies, watermark).
        block_manager: the KV pool.
        max_model_len: context limit in tokens.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.watermark_blocks = int(config.kv_watermark * block_manager.num_blocks)
        if config.scheduling_policy == "priority":
            self._rank = lambda r: r.sort_key
        else:
            self._rank = lambda r: r.arrival_ns

    # ----- queue management -----
    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            RequestRejected: prompt + max_tokens exceeds the context or the whole KV pool.
            ValueError: duplicate request id.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def check_fits(self, request: Request) -> None:
        """Raises RequestRejected when prompt + max_tokens exceeds the context or the pool."""
        total = request.num_prompt_tokens + request.params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt of {request.num_prompt_tokens} tokens + max_tokens {request.params.max_tokens} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {self.bm.blocks_needed(total)} KV blocks but the pool "
                f"has {self.bm.num_blocks}; it could never run"
            )

    def adopt(self, request: Request) -> None:
        """Run a request prefilled elsewhere (disaggregation) whose blocks hold its prompt's
        K/V: it joins the running batch as a decode; its full blocks enter the prefix cache."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.bm.cache_full_blocks(request)
        self.running.append(request)

    def _enqueue(self, request: Request, front: bool) -> None:
        if self.config.scheduling_policy == "priority":
            keys = [r.sort_key for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, request.sort_key), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus, *, free_blocks: bool = True) -> None:
        """End a request: free its blocks at once and forget it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            self.bm.free(request)
        request.status = status
        request.finished_ns = time.time_ns()
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        """Abort a request; its blocks are free when this returns. None if unknown/finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.events.append(RequestEvent("aborted", self.step_id, time.time_ns()))
        leak = self.config.fault_leak_blocks_on_abort  # fault injection (case C05)
        self.finish(request, RequestStatus.FINISHED_ABORTED, free_blocks=not leak)
        return request

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request by recompute now (operators' drill, tests). False if it
        is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return False
        self._preempt(request, SchedulerOutput(step_id=self.step_id), by=None)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- scheduling -----
    def _preempt(self, victim: Request, out: SchedulerOutput, by: str | None) -> None:
        """Preempt ``victim`` by recompute; ``by`` is the request whose block allocation needed
        the blocks (the victim itself when it was the lowest ranked), None for a drill."""
        self.running.remove(victim)
        self.bm.free(victim)
        attrs = {"recompute_tokens": victim.num_computed_tokens}
        if by is not None:
            attrs["by"] = by
        victim.events.append(RequestEvent("preempted", out.step_id, time.time_ns(), attrs))
        victim.stats.recomputed_tokens += victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.stats.preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self._enqueue(victim, front=True)
        out.preempted.append(victim)

    def _add_chunk(
        self, out: SchedulerOutput, request: Request, n: int, drafts: list[int] = ()
    ) -> None:
        chunk = ScheduledChunk(request, request.num_computed_tokens, n, list(drafts))
        out.chunks.append(chunk)
        if drafts:  # a decode that verifies drafts: decode tokens, not a prefill chunk
            out.num_decode_tokens += n
            out.num_drafts += 1
            out.num_draft_tokens += len(drafts)
        elif n > 1 or chunk.start < request.num_prompt_tokens:
            chunk.is_prefill = True
            out.num_prefill_tokens += n
            out.num_prefill_chunks += 1
            request.events.append(
                RequestEvent(
                    "chunk", out.step_id, time.time_ns(), {"tokens": n, "start": chunk.start}
                )
            )
        else:
            out.num_decode_tokens += n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = request.num_tokens - request.num_computed_tokens
            # a decode may carry draft tokens (speculative decoding), as far as the budget goes
            drafts = request.spec_token_ids[: budget - 1] if n == 1 else []
            if threshold:
                n = min(n, threshold)
            n = min(n, budget)
            # no room for the drafts: a plain decode, before preempting anyone for them
            placed = bool(drafts) and self.bm.allocate_slots(request, n + len(drafts))
            if placed:
                n += len(drafts)
            else:
                drafts = []
            while not placed and not self.bm.allocate_slots(request, n):
                out.allocation_failures += 1
                victim = self.running[-1]  # lowest ranked, not yet scheduled this step
                self._preempt(victim, out, by=request.request_id)
                if victim is request:
                    break
            else:
                self._add_chunk(out, request, n, drafts)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        chunked = self.config.enable_chunked_prefill
        threshold = self.config.long_prefill_token_threshold
        skip_ahead = self.config.admission_policy == "skip_ahead"
        blocked: list[Request] = []  # earlier requests that did not fit (skip_ahead only)
        queue = list(self.waiting) if skip_ahead else None
        pos = 0
        stop = None  # why admission stopped (StepRecord.admit_stop), if any request is left
        while True:
            if budget <= 0:
                stop = "budget"
                break
            if len(self.running) >= self.config.max_num_seqs:
                stop = "max_num_seqs"
                break
            if skip_ahead:
                if pos >= len(queue):
                    stop = "kv_blocks" if blocked else None
                    break
                if any(b.times_skipped >= self.config.max_admission_skips for b in blocked):
                    stop = "kv_blocks"
                    break  # an earlier request has been passed often enough: wait for it
                request = queue[pos]
                pos += 1
            elif self.waiting:
                request = self.waiting[0]
            else:
                break
            cached = self.bm.find_cached_prefix(request)
            num_cached = len(cached) * self.bm.block_size
            n = request.num_tokens - num_cached
            if chunked:
                if threshold:
                    n = min(n, threshold)
                n = min(n, budget)
            elif n > budget and out.chunks:
                stop = "budget"
                break  # whole prompts only; the first one of a step may exceed the budget
            need = self.bm.blocks_needed(num_cached + n) - len(cached)
            revived = sum(1 for b in cached if b.ref_cnt == 0)
            fits = self.bm.num_free_blocks - need - revived >= self.watermark_blocks
            first = fits and request.status != RequestStatus.PREEMPTED
            # why each uncached prompt block missed, read before this allocation evicts any
            misses = self.bm.explain_misses(request, len(cached)) if first else None
            if not fits or not self.bm.allocate_slots(request, n, cached):
                out.allocation_failures += 1
                stop = "kv_blocks"
                # strict FCFS stops at the first request that does not fit; skip_ahead lets
                # later ones pass it, at most max_admission_skips times (no starvation)
                if skip_ahead and request.times_skipped < self.config.max_admission_skips:
                    blocked.append(request)
                    continue
                break
            for earlier in blocked:
                earlier.times_skipped += 1
            self.waiting.remove(request)
            now = time.time_ns()
            if request.status == RequestStatus.PREEMPTED:
                request.events.append(
                    RequestEvent("resumed", out.step_id, now, {"cached_tokens": num_cached})
                )
            else:
                request.stats.cached_tokens = num_cached
                request.cache_misses = misses
            if request.stats.scheduled_ns is None:
                request.stats.scheduled_ns = now
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            self.bm.prefix_queries += request.num_tokens
            self.bm.prefix_hits += num_cached
            out.prefix_hit_tokens += num_cached
            self.running.append(request)
            self._add_chunk(out, request, n)
            budget -= n
        out.admit_stop = stop
        return budget

    def schedule(self) -> SchedulerOutput:
        """Plan the next step."""
        self.step_id += 1
        out = SchedulerOutput(step_id=self.step_id)
        budget = self.config.max_num_batched_tokens
        # rank order: the tail is the first to be preempted (lowest priority, latest arrival)
        self.running.sort(key=self._rank)
        if not self.config.enable_chunked_prefill:
            self._schedule_waiting(out, budget)
            if not out.chunks:
                self._schedule_running(out, budget)  # else a prefill-only step
        else:
            budget = self._schedule_running(out, budget)
            if not out.preempted:
                self._schedule_waiting(out, budget)
            elif self.waiting:
                out.admit_stop = "kv_blocks"  # no admission in a step that preempted
        if not self.waiting:
            out.admit_stop = None
        return out

    def accept_drafts(self, request: Request, num_accepted: int) -> None:
        """After verification: the first ``num_accepted`` drafts of the request's last chunk
        (already appended to its tokens) count as computed; the blocks that only the rejected
        drafts' slots reached are freed, so the block table again holds exactly the blocks its
        computed tokens fill. Full blocks are registered in the prefix cache."""
        request.num_computed_tokens += num_accepted
        request.spec_token_ids = []
        self.bm.cache_full_blocks(request)
        self.bm.trim(request)

    def update_after_step(self, out: SchedulerOutput) -> list[ScheduledChunk]:
        """Advance computed-token counts; return the chunks that sampled a token.

        Full blocks are registered in the prefix cache here.
        """
        sampling = []
        for chunk in out.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            # drafts count once verified (EngineCore, after sampling)
            request.num_computed_tokens = (
                chunk.start + chunk.num_new_tokens - len(chunk.draft_token_ids)
            )
            self.bm.cache_full_blocks(request)
            if chunk.samples:
                sampling.append(chunk)
        return sampling
