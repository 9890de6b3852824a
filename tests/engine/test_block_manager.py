"""Block pool: exact block ids, ref counts, free-list (LRU) order and prefix-cache hits."""

from __future__ import annotations

import time

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request
from tokenmill.engine.sampling import SamplingParams


def req(rid: str, tokens: list[int], tenant: str = "") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), tenant=tenant)


def admit(bm: BlockManager, r: Request) -> int:
    """Admit like the scheduler: take cached prefix blocks, allocate the rest, mark computed."""
    cached = bm.find_cached_prefix(r)
    n_cached = len(cached) * bm.block_size
    assert bm.allocate_slots(r, r.num_tokens - n_cached, cached)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return n_cached


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_cnt for b in bm.blocks]


def test_allocation_takes_blocks_in_free_order_and_free_returns_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(10)))  # 3 blocks
    assert bm.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]
    b = req("b", list(range(5)))
    assert bm.allocate_slots(b, 5)
    assert b.block_ids == [3, 4]
    assert bm.num_free_blocks == 3
    bm.free(a)
    # a's tail first: block 2 is reused before 1 before 0
    assert bm.free_queue.ids() == [5, 6, 7, 2, 1, 0]
    assert refs(bm) == [0, 0, 0, 1, 1, 0, 0, 0]


def test_append_grows_by_one_block_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    r = req("r", [1, 2, 3])
    assert bm.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    assert bm.allocate_slots(r, 1)  # 4th token still fits block 0
    assert r.block_ids == [0]
    r.num_computed_tokens = 4
    assert bm.allocate_slots(r, 1)  # 5th token needs block 1
    assert r.block_ids == [0, 1]


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(8)))
    assert bm.allocate_slots(a, 8)
    b = req("b", list(range(9)))
    assert not bm.allocate_slots(b, 9)
    assert b.block_ids == [] and bm.num_free_blocks == 1 and refs(bm) == [1, 1, 0]


def test_prefix_hit_shares_full_blocks_and_never_covers_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    system = list(range(100, 112))  # 3 full blocks
    a = req("a", [*system, 1, 2])
    assert admit(bm, a) == 0
    assert a.block_ids == [0, 1, 2, 3]
    assert bm.num_cached_blocks == 3  # the 4th block is partial: not cached
    b = req("b", [*system, 7])
    assert admit(bm, b) == 12
    assert b.block_ids == [0, 1, 2, 4]
    assert refs(bm)[:5] == [2, 2, 2, 1, 1]
    # a prompt that is exactly the cached blocks: the last block is recomputed for its logits
    c = req("c", list(system))
    assert admit(bm, c) == 8
    assert c.block_ids == [0, 1, 5]


def test_freed_cached_blocks_are_revived_then_evicted_lazily_in_lru_order():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])  # blocks 0,1 full (cached), block 2 partial
    admit(bm, a)
    bm.free(a)
    assert bm.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    assert bm.num_cached_blocks == 2  # still cached while free
    b = req("b", [1, 2, 3, 4, 9])
    assert admit(bm, b) == 4  # revived 0 and 1 from the free list
    assert b.block_ids == [0, 1, 3]
    assert bm.free_queue.ids() == [4, 5, 2]
    bm.free(b)
    # fill the pool with unrelated data: the oldest free blocks are evicted first
    c = req("c", [7, 7, 7, 7, 7, 7, 7, 7, 7, 7])
    assert bm.allocate_slots(c, 10)
    assert c.block_ids == [4, 5, 2, 3, 1]
    assert bm.num_cached_blocks == 1  # block 1 evicted, block 0 still cached
    assert bm.find_cached_prefix(req("d", [1, 2, 3, 4, 5])) == [bm.blocks[0]]


def test_tenants_do_not_share_prefix_blocks_unless_global():
    tokens = list(range(9))
    scoped = BlockManager(num_blocks=10, block_size=4, prefix_cache_scope="tenant")
    admit(scoped, req("a", tokens, tenant="acme"))
    assert admit(scoped, req("b", tokens, tenant="globex")) == 0
    assert admit(scoped, req("c", tokens, tenant="acme")) == 8
    shared = BlockManager(num_blocks=10, block_size=4, prefix_cache_scope="global")
    admit(shared, req("a", tokens, tenant="acme"))
    assert admit(shared, req("b", tokens, tenant="globex")) == 8


def test_hash_collision_is_caught_by_token_verification():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = req("a", [1, 2, 3])
    admit(bm, a)
    block = bm.blocks[a.block_ids[0]]
    block.token_ids = (9, 9)  # pretend the stored block holds other tokens under the same hash
    assert bm.find_cached_prefix(req("b", [1, 2, 3])) == []


def test_prefix_changing_in_first_block_misses_everything():
    bm = BlockManager(num_blocks=20, block_size=4)
    admit(bm, req("a", [0, 1, 2, 3, *range(10, 30)]))
    # same 20 trailing tokens, different first block: chained hashes all differ
    assert admit(bm, req("b", [5, 1, 2, 3, *range(10, 30)])) == 0


def _misses(bm: BlockManager, r: Request) -> list[tuple]:
    """Admit ``r`` like the scheduler (misses read before its own allocation); the runs as
    (reason, first_block, num_blocks, by, tenant)."""
    cached = bm.find_cached_prefix(r)
    runs = bm.explain_misses(r, len(cached))
    admit(bm, r)
    return [(m.reason, m.first_block, m.num_blocks, m.by, m.tenant) for m in runs]


def test_every_uncached_prompt_block_has_its_reason():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(10)))  # blocks 0-1 full, block 2 holds 2 tokens
    assert _misses(bm, a) == [("never_seen", 0, 2, None, None), ("partial_block", 2, 1, None, None)]
    b = req("b", list(range(12)))  # same head: 0-1 hit; block 2 full but holds the last token
    assert _misses(bm, b) == [("last_token", 2, 1, None, None)]
    tiny = req("tiny", [7, 8])
    assert _misses(bm, tiny) == [("partial_block", 0, 1, None, None)]
    for r in (tiny, b, a):
        bm.free(r)
    # c takes the whole pool, so the blocks holding a's prefix are evicted: c's doing
    c = req("c", list(range(100, 124)))
    before = time.time_ns()
    _misses(bm, c)
    d = req("d", list(range(12)))
    runs = bm.explain_misses(d, len(bm.find_cached_prefix(d)))
    assert [(m.reason, m.first_block, m.num_blocks, m.by) for m in runs] == [
        ("evicted", 0, 2, "c"),
        ("last_token", 2, 1, None),
    ]
    assert before <= runs[0].time_ns <= time.time_ns()


def test_another_tenants_prefix_and_a_miss_behind_an_earlier_one():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(13)), tenant="acme")
    _misses(bm, a)  # 3 full blocks cached under acme's salt
    assert _misses(bm, req("o", list(range(13)), tenant="beta")) == [
        ("other_tenant", 0, 3, None, "acme"),
        ("partial_block", 3, 1, None, None),
    ]
    # acme's first block dropped from the cache (as a reset would): blocks 1-2 are still
    # cached, but the cache serves only a prefix
    head = bm.blocks[a.block_ids[0]]
    bm._evict(head)
    assert _misses(bm, req("x", list(range(13)), tenant="acme")) == [
        ("evicted", 0, 1, None, None),
        ("after_miss", 1, 2, None, None),
        ("partial_block", 3, 1, None, None),
    ]


def test_caching_off_explains_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert _misses(bm, req("a", list(range(10)))) == [("caching_off", 0, 3, None, None)]


def _replay(bm: BlockManager) -> list[tuple]:
    """Admissions, frees and evictions of shared heads (tenant scope): hits and block tables."""
    seen = []
    live = []
    for k in range(12):
        head = list(range(100, 100 + 4 * (1 + k % 3)))
        r = req(str(k), [*head, *range(1000 * k, 1000 * k + 5)], tenant="ab"[k % 2])
        seen.append((admit(bm, r), list(r.block_ids)))
        live.append(r)
        if len(live) > 1:
            bm.free(live.pop(0))
    return seen


def test_an_injected_hasher_decides_as_the_engines_own():
    """The planner's seam: a pool hashing its blocks with another hasher (and keeping no miss
    reasons) hits, evicts and places blocks exactly as the engine's SHA-256 pool."""
    calls = []

    def hasher(parent, token_ids, salt):
        calls.append(parent)
        return hash((0 if parent is None else parent, *token_ids, salt))

    engine = BlockManager(num_blocks=11, block_size=4)
    other = BlockManager(num_blocks=11, block_size=4, hasher=hasher, keep_miss_reasons=False)
    assert _replay(engine) == _replay(other)
    assert calls and calls.count(None) > 0  # a request's first block: no parent
    assert all(isinstance(h, bytes) and len(h) == 32 for h in engine.cached)
    assert all(isinstance(h, int) for h in other.cached)
    # without miss reasons: no memory of evictions or of prefix tenants, no explanations
    assert engine.evicted and engine.prefix_tenants
    assert not other.evicted and not other.prefix_tenants
    assert other.explain_misses(req("z", list(range(100, 113))), 0) == []


def test_a_lookup_hashes_only_as_far_as_it_hits():
    bm = BlockManager(num_blocks=20, block_size=4)
    admit(bm, req("a", list(range(9))))  # blocks 0-1 cached
    b = req("b", [*range(8), *range(50, 70)])
    assert len(bm.find_cached_prefix(b)) == 2
    assert len(b.block_hashes) == 3  # the two hits and the first miss, not all 6 full blocks
    assert bm.extend_hashes(b, 6) is b.block_hashes and len(b.block_hashes) == 6
