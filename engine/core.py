"""EngineCore: the loop body of the engine — schedule, forward, sample, detokenize, stop.

It runs in-process for the offline :class:`~tokenmill.engine.llm.LLM` and tests, and inside its
own process behind :class:`~tokenmill.engine.async_engine.AsyncEngine` for serving. Each
:meth:`EngineCore.step` returns the per-request deltas (:class:`~.messages.RequestOutput`, with
their wall-clock timestamps) and one :class:`~.messages.StepRecord`, which is everything
telemetry needs; the engine knows nothing of storage.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import zlib

import msgspec
import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .cpu_threads import ThreadGovernor, read_proc
from .detokenizer import IncrementalDetokenizer
from .messages import EngineStats, RequestEvent, RequestOutput, StepRecord
from .model_config import ModelConfig
from .model_fetch import resolve_model_dir
from .model_runner import ModelRunner
from .parallel.kv_transfer import KVHandoff, gather_kv, scatter_kv
from .request import Request, RequestStatus
from .roofline import ModelCost, StepCost, step_cost
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode import parse_speculative_config, propose_ngram, verify

log = logging.getLogger(__name__)
NO_COST = StepCost(0, 0, 0, 0)


class SpecCounts:
    """One step's speculative-decoding tallies (the step record's ``num_accepted_*``)."""

    def __init__(self, k: int):
        self.accepted = 0  # drafts the verifier accepted
        self.accepted_kept = 0  # tokens past the first one a request got this step
        self.per_pos = [0] * k


class EngineCore:
    """Model runner + block manager + scheduler + per-request detokenizers.

    Args:
        config: the engine config. ``config.model`` None means the default model.
        runner: a prepared :class:`ModelRunner` (tests pass a stub); built from config if None.
        tokenizer: for detokenizing; loaded from the model folder if None.
        server_pids: processes whose CPU time is the server's own, not a neighbour's, for the
            thread governor (``engine/cpu_threads.py``): the engine core process passes the API
            process that started it; in-process (``LLM``) there are none.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner | None = None,
        tokenizer=None,
        *,
        server_pids: tuple[int, ...] = (),
    ):
        config.validate()
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.runner = runner or ModelRunner(config, model_dir)
        if tokenizer is None:
            from .tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_dir)
        self.tokenizer = tokenizer
        mcfg = self.runner.model_config
        self.max_model_len = config.model_len(mcfg.max_position_embeddings)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_cache_scope,
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        eos = set(mcfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # disaggregation: requests prefilled here whose KV waits for take_handoff
        self.handoffs: dict[str, Request] = {}
        self._detokenize_s = 0.0  # this step's detokenization (StepRecord.detokenize_ms)
        self.spec = parse_speculative_config(config.speculative_config)
        self.started_ns = time.time_ns()
        self.pid = os.getpid()
        self.cost = model_cost(self.runner)
        self.model_info = model_info(self.runner)
        on_cpu = getattr(getattr(self.runner, "device", None), "type", "cpu") == "cpu"
        # the API process that feeds this engine is the server's own CPU use, not a neighbour's
        read = functools.partial(read_proc, tuple(server_pids))
        self.threads = ThreadGovernor(fixed=config.cpu_threads, read=read) if on_cpu else None
        if self.model_info:
            log.info(
                "weights %d bytes %s; KV cache %d bytes (%d per token) on %s",
                self.model_info["weight_bytes_total"],
                self.model_info["weight_bytes_by_dtype"],
                self.model_info["kv_cache_bytes"],
                self.model_info["kv_bytes_per_token"],
                self.model_info["engine_device"],
            )

    # ----- requests -----
    def close(self) -> None:
        """Release what outlives a step: the tensor-parallel worker ranks (idempotent)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: str = "",
        arrival_ns: int | None = None,
        hand_off: bool = False,
    ) -> Request:
        """Queue a request. ``hand_off``: this is a prefill engine core (disaggregation); the
        request ends here after its first token (finish reason ``handoff``) with its KV blocks
        held until :meth:`take_handoff` (a first token that stops it ends it as usual).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, bad sampling params,
                duplicate id.
            RequestRejected: it can never fit the context or the KV pool.
        """
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.runner.model_config.vocab_size
        bad = next(
            (t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None
        )
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            tenant=tenant,
            arrival_ns=arrival_ns,
        )
        request.hand_off = hand_off
        self.scheduler.add_request(request)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop
        )
        return request

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests now (blocks freed before this returns); their final outputs."""
        outs = []
        for rid in request_ids:
            self.drop_handoff(rid)  # prefilled for a decode core that will not take it
            request = self.scheduler.abort(rid)
            if request is not None:
                outs.append(self._output(request, []))
        return outs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----- disaggregation: prefill here, decode elsewhere -----
    def take_handoff(self, request_id: str) -> KVHandoff:
        """A request this core prefilled for another (``hand_off``): its prompt's K/V of every
        layer packed into one tensor (:func:`~.parallel.kv_transfer.gather_kv`); its blocks
        are freed (the full ones stay in this core's prefix cache).

        Raises:
            KeyError: no hand-off waits under that id.
        """
        request = self.handoffs.pop(request_id)
        blocks = request.block_ids[: self.block_manager.blocks_needed(request.num_prompt_tokens)]
        try:
            kv = gather_kv(self.runner.kv_caches, blocks)
        finally:
            self.block_manager.free(request)
        return KVHandoff(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            params=request.params,
            kv=kv,
            stats=msgspec.structs.replace(request.stats),  # whole: its counters continue there
            arrival_ns=request.arrival_ns,
            priority=request.priority,
            tenant=request.tenant,
        )

    def drop_handoff(self, request_id: str) -> bool:
        """Free a hand-off nobody will take (its decode side is gone); False if unknown."""
        request = self.handoffs.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)
        return request is not None

    def adopt(self, handoff: KVHandoff) -> Request | None:
        """Continue a request another core prefilled: allocate blocks for its prompt, write the
        transferred K/V into them and run it from its first token on, as if it had been
        prefilled here. None, changing nothing, when the free blocks or the batch do not
        suffice, or requests this core preempted still wait to resume (the hand-off waits at
        the desk: back-pressure). The prompt's full blocks enter this core's prefix
        cache, so a preempted request recomputes only what they do not cover.

        Raises:
            ValueError: duplicate id, or a KV tensor that does not fit this core's cache.
            RequestRejected: it can never fit the context or this core's KV pool.
        """
        if handoff.request_id in self.scheduler.requests:
            raise ValueError(f"request id {handoff.request_id!r} is already in the engine")
        request = Request(
            handoff.request_id,
            handoff.prompt_token_ids,
            handoff.params,
            priority=handoff.priority,
            tenant=handoff.tenant,
            arrival_ns=handoff.arrival_ns,
        )
        # the prefill side's counters and milestones, whole: this core adds its own to them
        # (preemptions, recomputed tokens, speculation, its peak of KV blocks), and its queue
        # and prefill times stay the prefill side's, not the adoption's
        request.stats = msgspec.structs.replace(
            handoff.stats,
            input_tokens=request.num_prompt_tokens,
            queued_ns=handoff.stats.queued_ns or request.stats.queued_ns,
        )
        self.scheduler.check_fits(request)
        if len(self.scheduler.running) >= self.config.max_num_seqs:
            return None
        if self.scheduler.waiting:
            # requests this core preempted go first: a new adoption would take the blocks
            # their recompute waits for, and a stream could stall behind every later hand-off
            return None
        bm = self.block_manager
        n = request.num_prompt_tokens
        if bm.num_free_blocks - bm.blocks_needed(n) < self.scheduler.watermark_blocks:
            return None
        if not bm.allocate_slots(request, n):
            return None
        try:
            scatter_kv(self.runner.kv_caches, request.block_ids, handoff.kv)
        except ValueError:
            bm.free(request)
            raise
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, handoff.params.skip_special_tokens,
            handoff.params.stop,
        )  # fmt: skip
        for token in handoff.output_token_ids:  # already streamed by the prefill side
            detok.add(token)
            request.append_token(token, handoff.stats.first_token_ns or time.time_ns())
        detok.take_delta(False)
        request.num_computed_tokens = n
        now = time.time_ns()
        attrs = {
            "bytes": handoff.transfer_bytes,
            "ms": handoff.transfer_ms,
            "waited_ms": (now - handoff.received_ns) / 1e6 if handoff.received_ns else None,
            "from": handoff.source,
            "to": handoff.dest,
        }
        request.events.append(RequestEvent("kv_transfer", self.scheduler.step_id, now, attrs))
        self.scheduler.adopt(request)
        self.detokenizers[request.request_id] = detok
        return request

    # ----- the step -----
    def step(self) -> tuple[list[RequestOutput], StepRecord | None]:
        """Run one iteration. Returns the deltas of requests that produced a token or finished,
        and the step record (None when there was nothing to do)."""
        if not self.scheduler.has_work():
            return [], None
        if self.threads is not None:
            self.threads.tick()
        start_ns = time.time_ns()
        t0 = time.perf_counter()
        self._detokenize_s = 0.0
        oldest = min(
            (r for r in self.scheduler.waiting if r.stats.scheduled_ns is None),
            key=lambda r: r.stats.queued_ns or start_ns,
            default=None,
        )
        if self.spec is not None:
            self._propose()
        sched = self.scheduler.schedule()
        # before the forward: a chunk's `samples` reads the request, which sampling extends
        cost = step_cost(self.cost, sched.chunks) if self.cost is not None else NO_COST
        t1 = time.perf_counter()
        num_sampled = sum(1 for c in sched.chunks if c.samples)
        logits = self.runner.execute(sched) if sched.chunks else None
        t2 = time.perf_counter()
        # a runner without the attribute (a test's stub) counts its preparation as forward
        prepare_ms = getattr(self.runner, "last_prepare_ms", 0.0) if sched.chunks else 0.0
        comm = getattr(self.runner, "last_collective", None) if sched.chunks else None
        spec = SpecCounts(self.spec.num_speculative_tokens if self.spec else 0)
        outputs = self._process(sched, logits, spec)
        t3 = time.perf_counter()
        bm = self.block_manager
        record = StepRecord(
            step_id=sched.step_id,
            engine_pid=self.pid,
            start_ns=start_ns,
            end_ns=time.time_ns(),
            schedule_ms=(t1 - t0) * 1e3,
            forward_ms=(t2 - t1) * 1e3 - prepare_ms,
            sample_ms=(t3 - t2 - self._detokenize_s) * 1e3,
            prepare_ms=prepare_ms,
            detokenize_ms=self._detokenize_s * 1e3,
            compiled=bool(sched.chunks and getattr(self.runner, "last_native", False)),
            compute_precision=getattr(self.runner, "last_precision", None)
            if sched.chunks
            else None,
            cpu_threads=self.cpu_threads,
            collective_ms=comm[0] / 1e6 if comm else None,
            collective_bytes=comm[1] if comm else None,
            rank_compute_ms=getattr(self.runner, "last_rank_compute", None)
            if sched.chunks
            else None,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_prefill_chunks=sched.num_prefill_chunks,
            num_sampled=num_sampled + spec.accepted_kept,
            num_preempted=len(sched.preempted),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            allocation_failures=sched.allocation_failures,
            num_finished=sum(1 for o in outputs if o.finished),
            weight_bytes=cost.weight_bytes,
            kv_read_bytes=cost.kv_read_bytes,
            kv_write_bytes=cost.kv_write_bytes,
            flops=cost.flops,
            num_drafts=sched.num_drafts,
            num_draft_tokens=sched.num_draft_tokens,
            num_accepted_tokens=spec.accepted,
            num_accepted_tokens_per_pos=spec.per_pos,
            req_ids=[c.request.request_id for c in sched.chunks],
            req_tokens=[c.num_new_tokens for c in sched.chunks],
            req_prefill=[c.is_prefill for c in sched.chunks],
            admit_stop=sched.admit_stop,
            oldest_wait_ms=(start_ns - (oldest.stats.queued_ns or start_ns)) / 1e6
            if oldest
            else None,
            oldest_wait_id=oldest.request_id if oldest else None,
            oldest_wait_prompt_tokens=len(oldest.prompt_token_ids) if oldest else None,
        )
        return outputs, record

    def _propose(self) -> None:
        """Draft tokens for every running decode (n-gram prompt lookup), capped so that the
        verified run cannot pass ``max_tokens`` or the context; none while more requests run
        than ``disable_by_batch_size``."""
        spec = self.spec
        cutoff = spec.disable_by_batch_size
        off = cutoff is not None and len(self.scheduler.running) > cutoff
        for request in self.scheduler.running:
            request.spec_token_ids = []
            if off or request.num_computed_tokens != request.num_tokens - 1:
                continue  # a prefill chunk, not a decode
            room = min(
                spec.num_speculative_tokens,
                request.params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if room > 0:
                request.spec_token_ids = propose_ngram(
                    request.all_token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max
                )

    def _process(self, sched: SchedulerOutput, logits, spec: SpecCounts) -> list[RequestOutput]:
        sampling = self.scheduler.update_after_step(sched)
        outputs: list[RequestOutput] = []
        if not sampling:
            return outputs
        # row offsets: a chunk verifying K drafts has 1 + K logit rows, the others one
        offsets, row = [], 0
        for c in sched.chunks:
            if c.samples:
                offsets.append((c, row))
            row += c.num_logit_rows
        live = {id(c) for c in sampling}  # a chunk whose request is still running
        plain = [(c, r) for c, r in offsets if not c.draft_token_ids and id(c) in live]
        picked: dict[int, tuple[list[int], int]] = {}  # id(chunk) -> (tokens, accepted drafts)
        if plain:
            reqs = [c.request for c, _ in plain]
            tokens, bad = sample(
                logits[[r for _, r in plain]],
                [q.params for q in reqs],
                [q.generator for q in reqs],
            )
            for (c, _), token, is_bad in zip(plain, tokens, bad):
                picked[id(c)] = ([], -1) if is_bad else ([token], 0)
        for c, r in offsets:
            if not c.draft_token_ids or id(c) not in live:
                continue
            k = len(c.draft_token_ids)
            if not bool(torch.isfinite(logits[r : r + k + 1]).all()):
                picked[id(c)] = ([], -1)
                continue
            q = c.request
            toks, accepted = verify(logits[r : r + k + 1], c.draft_token_ids, q.params, q.generator)
            picked[id(c)] = (toks, accepted)
            q.stats.spec_drafts += 1
            q.stats.spec_draft_tokens += k
            q.stats.spec_accepted_tokens += accepted
            spec.accepted += accepted
            for pos in range(accepted):
                spec.per_pos[pos] += 1
        now = time.time_ns()
        fault = self.config.fault_nan_fraction
        for c in sampling:
            request = c.request
            tokens, accepted = picked[id(c)]
            new_tokens: list[int] = []
            is_bad = accepted < 0
            if fault and not request.output_token_ids and _faulty(request.request_id, fault):
                is_bad = True  # fault injection: as if this request's logits were NaN
            if is_bad:
                request.error_type = "nan_logits"
                request.error_message = "the model produced NaN or infinite logits"
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._output(request, new_tokens))
                continue
            status = None
            for token in tokens:  # a stop inside an accepted run cuts it there
                request.append_token(token, now)
                new_tokens.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    break
            if status is not None:
                self.scheduler.finish(request, status)
            elif request.hand_off:
                # the decode side goes on from here: keep the prompt's blocks for the transfer
                self.scheduler.finish(request, RequestStatus.FINISHED_HANDED_OFF, free_blocks=False)
                self.handoffs[request.request_id] = request
            elif c.draft_token_ids:
                # the accepted drafts' K/V are valid; the rejected ones' slots are given back
                self.scheduler.accept_drafts(request, accepted)
            spec.accepted_kept += len(new_tokens) - 1 if new_tokens else 0
            outputs.append(self._output(request, new_tokens))
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        t = time.perf_counter()
        stop_str = self.detokenizers[request.request_id].add(token)
        self._detokenize_s += time.perf_counter() - t
        if not params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if stop_str is not None:
            request.stop_reason = stop_str
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        finished = request.status.finished
        detok = self.detokenizers.get(request.request_id)
        t = time.perf_counter()
        # a hand-off ends here but not for the client: text held back as a possible stop
        # string stays held (the decode side's detokenizer holds and releases it)
        flush = finished and request.status != RequestStatus.FINISHED_HANDED_OFF
        text = detok.take_delta(flush) if detok else ""
        self._detokenize_s += time.perf_counter() - t
        if finished:
            self.detokenizers.pop(request.request_id, None)
        events, request.events = request.events, []
        misses, request.cache_misses = request.cache_misses, None
        n = len(new_tokens)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_text=text,
            token_ns=request.token_ns[-n:] if n else [],
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error_type=request.error_type,
            error_message=request.error_message,
            stats=msgspec.structs.replace(request.stats),  # a copy: in-process readers keep it
            arrival_ns=request.arrival_ns,
            finished_ns=request.finished_ns,
            events=events,
            cache_misses=misses,
        )

    @property
    def cpu_threads(self) -> int | None:
        """The forward's CPU threads now (the governor's count); None off the CPU."""
        return self.threads.threads if self.threads is not None else None

    def idle_record(self) -> StepRecord:
        """A heartbeat step record for an idle engine: no tokens, zero durations, and the KV
        pool as it stands. The core process sends one every ``IDLE_POLL_MS`` while idle so the
        store shows whether KV use returns to its idle level (rule ``kv_block_leak``, case C05).
        Readers tell heartbeats from steps by ``num_prefill_tokens + num_decode_tokens = 0``."""
        bm = self.block_manager
        now = time.time_ns()
        return StepRecord(
            step_id=self.scheduler.step_id,
            engine_pid=self.pid,
            start_ns=now,
            end_ns=now,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            cpu_threads=self.cpu_threads,
        )

    def stats(self) -> EngineStats:
        """Queue depth and KV usage right now (for /health)."""
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            kv_usage=bm.usage(),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            cpu_threads=self.cpu_threads or 0,
        )


def _linear_bytes(module) -> int:
    """Bytes one linear layer's forward reads as stored: its weight (a quantized layer: the
    packed weight and the scale table its kernel reads) and its bias."""
    if getattr(module, "qweight", None) is not None:
        names = ("packed_scales", "scales_and_zeros", "group_scales", "scales")
        scales = next(
            (getattr(module, n) for n in names if getattr(module, n, None) is not None), None
        )
        tensors = [module.qweight, scales]
    else:
        tensors = [module.weight]
    tensors.append(getattr(module, "bias", None))
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def model_cost(runner) -> ModelCost | None:
    """The roofline constants of the runner's model (:class:`~.roofline.ModelCost`): the bytes
    its decoder linear layers and LM head store, KV bytes per token from the cache's dtype.
    None for a runner without a model (a test stub): its steps then report zero bytes/FLOPs."""
    model = getattr(runner, "model", None)
    cfg = getattr(runner, "model_config", None)
    if model is None or not isinstance(cfg, ModelConfig):
        return None
    head = getattr(model, "lm_head", None)
    linear = sum(
        _linear_bytes(m)
        for m in model.modules()
        if m is not head and hasattr(m, "in_features") and hasattr(m, "out_features")
    )
    kv_token = runner.bytes_per_block // runner.block_size  # K and V, all layers
    kv_elem = kv_token // (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim)
    return ModelCost.from_config(
        cfg,
        kv_dtype_bytes=kv_elem,
        linear_weight_bytes=linear,
        lm_head_weight_bytes=_linear_bytes(head) if head is not None else None,
    )


def model_info(runner) -> dict:
    """Memory facts of the loaded model (``EngineReady.model_info``; the server's ``config``
    event, ``/health`` and ``tokenmill_model_weight_bytes``): ``weight_bytes_total`` and
    ``weight_bytes_by_dtype`` (bytes by storage dtype, int4 reported as ``int4``),
    ``kv_cache_bytes`` (the pool), ``kv_bytes_per_token`` (K and V over all layers),
    ``model_dtype``, ``engine_device``, ``compiled_decode`` (``"on"``, or why the compiled
    decode step is off: ``--enforce-eager``, an int4 layer, …) and ``int4_activations_used`` (what
    the CPU int4 GEMV multiplies by: ``int8``/``float32``; None without one), ``int8_compute_path``
    (the int8 GEMM path of the quantized layers' large steps, :mod:`.int8_compute`; None when
    off) with ``int8_compute_bytes`` (its weight copies, outside ``weight_bytes_total``) and
    ``cpu_kernels`` (on a CPU: ``"on"``, or why the C kernels are off; None elsewhere). Empty
    for a runner without a model.

    The KV pool is what is left for it: on CUDA the runner sizes it after a profiling forward,
    as ``total × gpu_memory_utilization`` minus the peak use, which includes the weights (so
    smaller weights under ``--quantization`` leave more KV blocks); on CPU it is
    ``--kv-cache-memory`` bytes, whatever the weights take."""
    model = getattr(runner, "model", None)
    if model is None or not hasattr(runner, "bytes_per_block"):
        return {}
    from .quantization import int8_compute_bytes, weight_bytes_by_dtype

    by_dtype = weight_bytes_by_dtype(model)
    return {
        "weight_bytes_total": sum(by_dtype.values()),
        "weight_bytes_by_dtype": by_dtype,
        "kv_cache_bytes": runner.num_blocks * runner.bytes_per_block,
        "kv_bytes_per_token": runner.bytes_per_block // runner.block_size,
        "model_dtype": str(runner.dtype).removeprefix("torch."),
        "engine_device": str(runner.device),
        "compiled_decode": getattr(runner, "native_off_reason", None) or "on",
        "int4_activations_used": getattr(runner, "int4_activations", None),
        "int8_compute_path": getattr(runner, "int8_compute", None),
        "int8_compute_bytes": int8_compute_bytes(model),
        "cpu_kernels": _cpu_kernels_state() if str(runner.device) == "cpu" else None,
    }


def _cpu_kernels_state() -> str:
    """``"on"``, or why the C kernels are off (``kernels/cpu.py``)."""
    from tokenmill.kernels import cpu

    return "on" if cpu.available() else (cpu.unavailable_reason() or "off")


def _faulty(request_id: str, fraction: float) -> bool:
    """Whether fault injection picks this request (a stable hash of its id below ``fraction``)."""
    return zlib.crc32(request_id.encode()) / 2**32 < fraction
