"""A disaggregated request's counters cross the prefill → decode hand-off whole: the
``RequestStats`` the prefill core counted (preemptions, recomputed tokens, cached tokens, KV
blocks, its milestones) travel in the ``KVHandoff`` as one struct, and the decode core's
request starts from it, adding its own preemptions and speculation to them.

The workload, on the real default model, is built so that the same request is preempted
while it prefills, before any token of either request is sampled: two prompts of 54 and 57
tokens, each prefilled 16 tokens a step (``long_prefill_token_threshold``) in a pool of 7 KV
blocks of 16 tokens. At their fourth chunk both need a fourth block, the pool has 7, so the
later one (``r1``) preempts itself with 48 tokens computed (``recomputed_tokens`` 48). The
earlier one (``r0``) stops after 2 tokens, so in the colocated run ``r1`` resumes only once it
has finished and is not preempted a second time by ``r0``'s decode (which a disaggregated
prefill core never runs: there the two runs would differ by construction). Speculation
(n-gram prompt lookup, greedy) is on everywhere; ``r1`` is asked to repeat a sentence of its
prompt, so its decode verifies and accepts drafts. Midway through ``r1``'s decode both runs
preempt it once more (the scheduler's drill, at the same output token): on the decode core,
that preemption must add to the one the prefill core counted.
"""

from __future__ import annotations

import msgspec
import pytest

from tokenmill.engine.core import EngineCore
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.tokenizer import encode_chat

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
CONFIG = dict(
    num_gpu_blocks_override=7,
    long_prefill_token_threshold=16,
    max_num_batched_tokens=32,
    speculative_config=SPEC,
)
PASSAGES = (
    "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn.",
    "A small red boat drifts past the old stone bridge while two herons watch from the reeds.",
)
MAX_TOKENS = (2, 30)
DRILL_AT = 6  # r1's output tokens when both runs preempt it on purpose (its decode side)
TIMES = dict(queued_ns=None, scheduled_ns=None, first_token_ns=None)


def _engine_like(base: LLM) -> EngineCore:
    """A fresh engine core with its own KV pool and scheduler, on ``base``'s loaded weights."""
    from tokenmill.engine.kv_cache import allocate_kv_caches

    runner = base.core.runner
    clone = object.__new__(type(runner))
    clone.__dict__.update(runner.__dict__)
    clone.kv_caches = allocate_kv_caches(
        runner.model_config, runner.num_blocks, runner.block_size, runner.dtype, runner.device
    )
    return EngineCore(base.config, runner=clone, tokenizer=base.tokenizer)


def _drill(core: EngineCore, tokens: dict[str, list[int]], drilled: set) -> None:
    """Preempt r1 once, the first time it runs with :data:`DRILL_AT` output tokens or more."""
    if "r1" not in drilled and len(tokens["r1"]) >= DRILL_AT and core.scheduler.preempt("r1"):
        drilled.add("r1")


def _colocated(core: EngineCore, prompts, params):
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    final, drilled = {}, set()
    for rid, prompt, sp in zip(tokens, prompts, params):
        core.add_request(rid, prompt, sp)
    while core.has_work():
        _drill(core, tokens, drilled)
        for out in core.step()[0]:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out.stats
    return tokens, final


def _disaggregated(prefill: EngineCore, decode: EngineCore, prompts, params):
    """Prefill on ``prefill`` (``hand_off``), each hand-off taken at once and adopted by
    ``decode`` when it has room. Returns the tokens, the final stats of each request on the
    decode core and what the prefill core reported at the hand-off."""
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    final, handed, drilled, ready = {}, {}, set(), []
    for rid, prompt, sp in zip(tokens, prompts, params):
        prefill.add_request(rid, prompt, sp, hand_off=True)
    while prefill.has_work() or ready or decode.has_work():
        for out in prefill.step()[0]:
            tokens[out.request_id] += out.new_token_ids
            assert out.finish_reason == "handoff", out
            handed[out.request_id] = out.stats
            ready.append(prefill.take_handoff(out.request_id))
        ready = [h for h in ready if decode.adopt(h) is None]
        _drill(decode, tokens, drilled)
        for out in decode.step()[0]:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out.stats
    return tokens, final, handed


def test_a_disaggregated_requests_counters_equal_colocated(smollm2_dir):
    base = LLM(str(smollm2_dir), **CONFIG)
    prompts = [
        encode_chat(base.tokenizer, f"Repeat this sentence exactly, once: {p}") for p in PASSAGES
    ]
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    assert [len(p) for p in prompts] == [54, 57]  # 4 blocks each: both do not fit in 7

    want_tokens, want = _colocated(base.core, prompts, params)
    got_tokens, got, handed = _disaggregated(
        _engine_like(base), _engine_like(base), prompts, params
    )
    assert got_tokens == want_tokens
    assert len(want_tokens["r1"]) > DRILL_AT + 4  # it decoded on well after the drill

    # the prefill core preempted r1 while prefilling (48 tokens computed) and reported it
    assert (handed["r1"].preemptions, handed["r1"].recomputed_tokens) == (1, 48)
    assert handed["r1"].spec_drafts == 0  # no decode there: the speculation is the decode core's
    # the decode core started from that report: the prefill side's milestones and first token
    # are the request's, its counters went on from the prefill side's
    for rid in got:
        before, after = handed[rid], got[rid]
        assert (after.queued_ns, after.scheduled_ns, after.first_token_ns) == (
            before.queued_ns,
            before.scheduled_ns,
            before.first_token_ns,
        )
        assert after.cached_tokens == before.cached_tokens
        assert after.preemptions >= before.preemptions
        assert after.recomputed_tokens >= before.recomputed_tokens
        assert after.kv_blocks >= before.kv_blocks
    # and the request ends with the colocated run's counters: one preemption while prefilling
    # on the prefill core, one (the drill) while decoding on the decode core, every draft
    r1 = got["r1"]
    assert (r1.preemptions, want["r1"].preemptions) == (2, 2)
    assert r1.recomputed_tokens == want["r1"].recomputed_tokens > 48
    assert (r1.spec_drafts, r1.spec_draft_tokens, r1.spec_accepted_tokens) == (
        want["r1"].spec_drafts,
        want["r1"].spec_draft_tokens,
        want["r1"].spec_accepted_tokens,
    )
    assert r1.spec_accepted_tokens > 0
    for rid in want:  # every counter, the wall-clock milestones aside
        assert msgspec.structs.replace(got[rid], **TIMES) == msgspec.structs.replace(
            want[rid], **TIMES
        ), rid
