"""Scheduler: token budget, chunked prefill, preemption order, watermark, rejection, abort."""

from __future__ import annotations

import pytest

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import RequestRejected, Scheduler


def make(num_blocks=32, block_size=4, max_model_len=256, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, kv_watermark=cfg.pop("kv_watermark", 0.0), **cfg)
    bm = BlockManager(
        num_blocks, block_size, config.enable_prefix_caching, config.prefix_cache_scope
    )
    return Scheduler(config, bm, max_model_len)


def add(
    s: Scheduler, rid: str, n_prompt: int, max_tokens=8, priority=0, arrival=None, first=0
) -> Request:
    r = Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_ns=arrival,
    )
    s.add_request(r)
    return r


def run_step(s: Scheduler, token=1):
    """schedule + pretend forward: every sampling chunk appends ``token``."""
    out = s.schedule()
    for c in s.update_after_step(out):
        c.request.append_token(token, 0)
    return out


def plan(out):
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in out.chunks]


def test_chunked_prefill_shares_steps_with_decodes_under_the_budget():
    s = make(max_num_batched_tokens=10)
    add(s, "a", 3)
    add(s, "b", 14)
    out = run_step(s)
    assert plan(out) == [("a", 0, 3), ("b", 0, 7)]
    assert (out.num_prefill_tokens, out.num_decode_tokens, out.num_prefill_chunks) == (10, 0, 2)
    out = run_step(s)
    # a decodes (1 token) first, b gets the rest of the budget for its next chunk
    assert plan(out) == [("a", 3, 1), ("b", 7, 7)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (7, 1)
    assert s.requests["b"].num_output_tokens == 1  # b's last chunk sampled its first token


def test_long_prefill_threshold_caps_one_requests_chunk():
    s = make(max_num_batched_tokens=100, long_prefill_token_threshold=6)
    add(s, "a", 20)
    add(s, "b", 5)
    assert plan(run_step(s)) == [("a", 0, 6), ("b", 0, 5)]


def test_chunked_prefill_off_prefills_whole_prompts_in_prefill_only_steps():
    s = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    add(s, "a", 3)
    run_step(s)  # a prefilled
    add(s, "b", 20)  # longer than the budget: still prefilled whole, alone
    out = run_step(s)
    assert plan(out) == [("b", 0, 20)]  # a's decode waits this step
    out = run_step(s)
    assert plan(out) == [("a", 3, 1), ("b", 20, 1)]


def test_preemption_takes_latest_arrival_and_requeues_it_first():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    add(s, "old", 8, arrival=1)  # 2 blocks
    add(s, "new", 7, arrival=2)  # 2 blocks: pool full
    run_step(s)
    assert s.bm.num_free_blocks == 0
    # "old" needs a 3rd block to store its 9th token: "new" (latest arrival) is preempted
    out = run_step(s)
    assert [r.request_id for r in out.preempted] == ["new"]
    new = s.waiting[0]
    assert new.request_id == "new" and new.status == RequestStatus.PREEMPTED
    assert (
        new.num_computed_tokens == 0
        and new.stats.preemptions == 1
        and new.stats.recomputed_tokens == 7
    )
    assert [e.name for e in new.events][-1] == "preempted"
    assert plan(out) == [("old", 8, 1)]
    assert out.allocation_failures == 1


def test_priority_policy_preempts_lowest_priority_even_if_older():
    s = make(num_blocks=4, block_size=4, scheduling_policy="priority")
    add(s, "vip", 8, priority=0, arrival=2)
    add(s, "batch", 7, priority=5, arrival=1)
    out = run_step(s)
    assert plan(out) == [("vip", 0, 8), ("batch", 0, 7)]
    out = run_step(s)
    # vip needs a block; batch has lower priority (higher value) though it arrived first
    assert [r.request_id for r in out.preempted] == ["batch"]


def test_priority_policy_orders_the_waiting_queue():
    s = make(scheduling_policy="priority", max_num_seqs=1)
    add(s, "low", 3, priority=9, arrival=1)
    add(s, "high", 3, priority=1, arrival=2)
    assert plan(run_step(s)) == [("high", 0, 3)]


def test_watermark_keeps_blocks_free_for_running_requests():
    s = make(num_blocks=10, block_size=4, kv_watermark=0.3)  # keep 3 blocks free
    add(s, "a", 16)  # 4 blocks -> 6 free
    add(s, "b", 16)  # would leave 2 < 3
    out = run_step(s)
    assert plan(out) == [("a", 0, 16)]
    assert out.allocation_failures == 1
    assert s.waiting[0].request_id == "b"


def test_request_that_can_never_fit_is_rejected_at_once():
    s = make(num_blocks=4, block_size=4, max_model_len=1000)
    with pytest.raises(RequestRejected, match="needs 5 KV blocks but the pool has 4"):
        add(s, "huge", 12, max_tokens=8)
    with pytest.raises(RequestRejected, match="exceeds the model's context of 1000"):
        add(s, "long", 990, max_tokens=20)
    assert not s.has_work()


def test_abort_frees_blocks_in_the_same_step():
    s = make(num_blocks=8)
    add(s, "a", 10)
    run_step(s)
    assert s.bm.num_free_blocks == 5
    r = s.abort("a")
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert s.bm.num_free_blocks == 8 and not s.running
    assert s.abort("a") is None


def test_max_num_seqs_caps_running_requests():
    s = make(max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 2)
    out = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_prefix_hit_reduces_prefill_tokens():
    s = make(num_blocks=40, block_size=4)
    add(s, "a", 30)
    run_step(s)
    add(s, "b", 30)  # same 30 tokens: 7 full blocks (28 tokens) hit, never the last token
    out = run_step(s)
    (chunk,) = [c for c in out.chunks if c.request.request_id == "b"]
    assert (chunk.start, chunk.num_new_tokens) == (28, 2)
    assert out.prefix_hit_tokens == 28
    assert s.requests["b"].stats.cached_tokens == 28


@pytest.mark.parametrize("policy", ["strict", "skip_ahead"])
def test_admission_policy_and_head_of_line_blocking(policy):
    """Case C01: a big prompt that does not fit the free blocks. Strict FCFS holds every later
    request behind it; skip_ahead admits the small ones that fit, at most max_admission_skips
    times, after which admission waits for the big one again."""
    s = make(num_blocks=10, block_size=4, admission_policy=policy, max_admission_skips=2)
    add(s, "running", 8, max_tokens=8)  # 3 blocks once it has its first token
    run_step(s)
    add(s, "big", 32, max_tokens=4, first=100)  # needs 8 blocks, only 7 are free
    for i in range(3):
        add(s, f"small{i}", 3)
    out = run_step(s)
    admitted = {c.request.request_id for c in out.chunks} - {"running"}
    if policy == "strict":
        assert admitted == set() and out.allocation_failures == 1
    else:
        # two smalls pass the big one; the third would be a third skip, so admission waits
        assert admitted == {"small0", "small1"}
        assert s.requests["big"].times_skipped == 2
        assert [r.request_id for r in s.waiting] == ["big", "small2"]


def test_unknown_admission_policy_is_refused():
    with pytest.raises(ValueError, match="admission_policy"):
        EngineConfig(admission_policy="lifo").validate()


def test_a_step_says_why_admission_stopped():
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=10, max_num_seqs=3)
    add(s, "long", 20, arrival=1)
    add(s, "short", 3, arrival=2)
    out = run_step(s)  # long's first chunk takes the whole budget
    assert plan(out) == [("long", 0, 10)] and out.admit_stop == "budget"
    assert [c.is_prefill for c in out.chunks] == [True]
    run_step(s)  # long's last chunk; short still waits behind it
    out = run_step(s)  # long decodes (1 token): short is admitted, nothing left waiting
    assert plan(out) == [("long", 20, 1), ("short", 0, 3)] and out.admit_stop is None
    assert [c.is_prefill for c in out.chunks] == [False, True]
    # the cap: a third request fits the budget and the pool, not --max-num-seqs 2
    s = make(num_blocks=8, block_size=4, max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 2)
    assert run_step(s).admit_stop == "max_num_seqs"
    # the pool: 3 of 6 blocks left, a 16-token prompt needs 4
    s = make(num_blocks=6, block_size=4)
    add(s, "a", 12, max_tokens=4, arrival=1)
    add(s, "b", 16, max_tokens=4, arrival=2)
    assert run_step(s).admit_stop == "kv_blocks"


def test_a_preemption_names_the_request_whose_allocation_needed_the_blocks():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    add(s, "old", 8, arrival=1)
    add(s, "new", 7, arrival=2)
    run_step(s)
    out = run_step(s)  # old's 9th token needs a block: new is preempted for it
    assert [r.request_id for r in out.preempted] == ["new"]
    assert s.waiting[0].events[-1].attrs == {"recompute_tokens": 7, "by": "old"}
    assert out.admit_stop == "kv_blocks"  # no admission in a step that preempted
    assert s.preempt("old") and s.waiting[0].events[-1].attrs == {"recompute_tokens": 9}


def test_cache_misses_are_read_at_the_first_admission_only():
    s = make(num_blocks=40, block_size=4)
    a = add(s, "a", 30)
    run_step(s)
    assert [(m.reason, m.first_block, m.num_blocks) for m in a.cache_misses] == [
        ("never_seen", 0, 7),
        ("partial_block", 7, 1),
    ]
    b = add(s, "b", 30)  # 7 blocks hit: only the block holding the last token is computed
    run_step(s)
    assert [(m.reason, m.first_block) for m in b.cache_misses] == [("partial_block", 7)]
    b.cache_misses = None
    s.preempt("b")
    run_step(s)  # resumed: a recompute, not an admission
    assert b.cache_misses is None
