"""Property test: any interleaving of add / step / abort / preempt keeps the block pool sound,
with and without speculative decoding (drafts verified, some rejected and rolled back)."""

from __future__ import annotations

import contextlib
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import RequestRejected, Scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 12


def check_invariants(s: Scheduler) -> None:
    bm = s.bm
    owners = Counter()
    for r in s.requests.values():
        assert len(set(r.block_ids)) == len(r.block_ids), "a request owns a block twice"
        owners.update(r.block_ids)
        if r.status == RequestStatus.RUNNING:
            # exactly the blocks its computed tokens fill: no block that only a rejected
            # draft's slot reached stays in the table
            assert len(r.block_ids) == bm.blocks_needed(r.num_computed_tokens), r
        else:
            assert r.block_ids == [] and r.num_computed_tokens == 0
    for block in bm.blocks:
        assert block.ref_cnt == owners[block.block_id], f"ref count of {block}"
        if owners[block.block_id] > 1:
            assert block.block_hash is not None, "block shared without a prefix hit"
    free_ids = set(bm.free_queue.ids())
    assert free_ids == {b.block_id for b in bm.blocks if b.ref_cnt == 0}
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for h, block in bm.cached.items():
        assert block.block_hash == h and block.token_ids is not None


def _step(s: Scheduler, x: int, spec: int) -> None:
    """One engine step as EngineCore runs it, with ``x`` choosing the tokens: decodes carry
    ``spec`` drafts (capped as the engine caps them); the verifier accepts ``x`` mod (K + 1) of
    them, then one token of its own; a request ends at max_tokens, even inside an accepted run."""
    for r in s.running:
        room = min(spec, r.params.max_tokens - r.num_output_tokens - 1, 64 - r.num_tokens - 1)
        decoding = r.num_computed_tokens == r.num_tokens - 1
        r.spec_token_ids = [(x + i) % 97 for i in range(room)] if decoding and room > 0 else []
    out = s.schedule()
    for chunk in s.update_after_step(out):
        r = chunk.request
        accepted = x % (len(chunk.draft_token_ids) + 1)
        for token in [*chunk.draft_token_ids[:accepted], x % 97]:
            r.append_token(token, 0)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
                break
        else:
            if chunk.draft_token_ids:
                s.accept_drafts(r, accepted)


ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "abort", "preempt"]), st.integers(0, 10_000)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    chunked=st.booleans(),
    prefix=st.booleans(),
    budget=st.sampled_from([5, 16, 64]),
    admission=st.sampled_from(["strict", "skip_ahead"]),
    spec=st.sampled_from([0, 3]),
)
def test_random_interleavings_keep_pool_invariants(ops, chunked, prefix, budget, admission, spec):
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        kv_watermark=0.0,
        admission_policy=admission,
        max_admission_skips=3,
    )
    s = Scheduler(config, BlockManager(NUM_BLOCKS, BLOCK_SIZE, prefix), max_model_len=64)
    n = 0
    shared_prefix = [7] * 9  # prompts often share two full blocks, so prefix hits happen
    for op, x in ops:
        if op == "add":
            n += 1
            tail = [x % 50 + i for i in range(x % 13)]
            prompt = (shared_prefix if x % 2 else []) + tail or [1]
            with contextlib.suppress(RequestRejected):
                s.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=1 + x % 9)))
        elif op == "step":
            _step(s, x, spec)
        elif op == "abort" and s.requests:
            s.abort(sorted(s.requests)[x % len(s.requests)])
        elif op == "preempt" and s.running:
            s.preempt(s.running[x % len(s.running)].request_id)
        check_invariants(s)
    # drain: everything left finishes (no stall); then every block is free
    for _ in range(500):
        if not s.has_work():
            break
        _step(s, 3, spec)
        check_invariants(s)
    assert not s.has_work(), "the scheduler stalled with work left"  # liveness
    check_invariants(s)
    assert s.bm.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_cnt == 0 for b in s.bm.blocks)
