"""The KV block pool: allocation, ref counts and prefix caching.

Design (after vLLM v1's block pool): a fixed set of blocks; free blocks sit in one queue that
doubles as LRU order (blocks freed earlier are reused first), and a free block may still hold a
cached prefix — it is evicted only when it is taken for new data (lazily). A full block's hash
chains its parent's hash, its token ids and a salt (the tenant under ``tenant`` scope), so equal
hashes mean equal prefixes; a hit is also verified against the block's stored token ids.

It also says why a prompt block missed (:meth:`BlockManager.explain_misses`, at a request's
first admission): it remembers, in bounded maps, which hashes were evicted (when, and by whose
allocation) and, under ``tenant`` scope, which tenant computed each salt-free prefix.

The planner (``plan.simulate``) replays recorded traffic through this same pool, over two
declared seams of the constructor: its own block hasher (``hasher``: Python's hash instead of
SHA-256, for millions of blocks) and no miss reasons (``keep_miss_reasons=False``).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

from .messages import CacheMiss
from .request import Request

#: Entries each of the miss-explaining maps keeps (evicted hashes; salt-free prefixes under
#: ``tenant`` scope), oldest dropped first: about 10 MB each when full.
MISS_MEMORY = 65536


class KVBlock:
    """One block of the pool.

    Attributes:
        block_id: index into the cache tensors.
        ref_cnt: requests using it (0 = free, possibly still cached).
        block_hash: chained hash when the block is full and registered in the prefix cache.
        token_ids: the tokens it holds when cached (hit verification).
    """

    __slots__ = ("block_hash", "block_id", "ref_cnt", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in LRU order with O(1) append, pop-oldest and removal from the middle."""

    def __init__(self, blocks: list[KVBlock]):
        self._queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def append(self, block: KVBlock) -> None:
        self._queue[block.block_id] = block

    def popleft(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def remove(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def ids(self) -> list[int]:
        """Block ids, oldest first (the order they will be reused in)."""
        return list(self._queue)


class BlockHasher(Protocol):
    """Hashes one full block of a request: ``hasher(parent, token_ids, salt)``, ``parent``
    the hash of the block before it (None for the request's first block), ``salt`` the
    tenant under ``tenant`` scope (else ""). Equal arguments must give equal hashes, so equal
    hashes mark equal prefixes (a hit is still verified against the block's token ids)."""

    def __call__(
        self, parent: Hashable | None, token_ids: Sequence[int], salt: str
    ) -> Hashable: ...


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str) -> bytes:
    """sha256 over (parent hash, the block's token ids, salt): equal hashes = equal prefixes.
    The engine's :class:`BlockHasher`."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    h.update(salt.encode())
    return h.digest()


class BlockManager:
    """Owns the pool and each request's block table (``request.block_ids``).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: register full blocks and reuse them across requests.
        prefix_cache_scope: ``tenant`` salts hashes with the tenant; ``global`` shares across tenants.
        hasher: hashes a full block for the prefix cache (:class:`BlockHasher`); the engine's is
            :func:`hash_block` (SHA-256 over the token ids). The planner's replay
            (``plan.simulate``) passes a cheaper one.
        keep_miss_reasons: remember evicted hashes and the tenant of each prefix, so that
            :meth:`explain_misses` can say why a block missed. False (the planner's replay,
            which reports no misses) keeps neither, and :meth:`explain_misses` returns [].

    The planner replays recorded traffic through this class, its own pool subclassing it:
    :meth:`extend_hashes`, :meth:`find_cached_prefix`, :meth:`cache_full_blocks` and
    :meth:`free` are the public methods it builds on or overrides; the ``_`` methods are not
    part of that seam.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        prefix_cache_scope: str = "tenant",
        *,
        hasher: BlockHasher = hash_block,
        keep_miss_reasons: bool = True,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_scope = prefix_cache_scope
        self.hasher = hasher
        self.keep_miss_reasons = keep_miss_reasons
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        # why a block missed: evicted hash -> (when, the request whose allocation took it), and
        # (tenant scope) salt-free prefix hash -> the tenant that registered it last
        self.evicted: OrderedDict[bytes, tuple[int, str | None]] = OrderedDict()
        self.prefix_tenants: OrderedDict[bytes, str] = OrderedDict()
        # cumulative prefix-cache counters (prompt tokens looked up / found)
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ----- accounting -----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- prefix cache -----
    def _salt(self, request: Request) -> str:
        return request.tenant if self.prefix_cache_scope == "tenant" else ""

    def extend_hashes(self, request: Request, num_full_blocks: int) -> list[Hashable]:
        """The chained hashes of the request's first ``num_full_blocks`` blocks (at least):
        ``request.block_hashes``, extended with :attr:`hasher` as far as needed."""
        bs, salt, hasher = self.block_size, self._salt(request), self.hasher
        tokens, hashes = request.all_token_ids, request.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hasher(hashes[-1] if i else None, tokens[i * bs : (i + 1) * bs], salt))
        return hashes

    def _content_hashes(self, request: Request, num_full_blocks: int) -> list[Hashable]:
        """The salt-free chained hashes of the request's first blocks (tenant scope only:
        under ``global`` they equal ``block_hashes``), extended as needed."""
        bs, tokens, out = self.block_size, request.all_token_ids, request.content_hashes
        while len(out) < num_full_blocks:
            i = len(out)
            out.append(self.hasher(out[-1] if i else None, tokens[i * bs : (i + 1) * bs], ""))
        return out

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Cached blocks holding the longest prefix of the request's tokens (hashed and
        verified hits up to the first miss; each block hashed only when the lookup gets to it).

        Never covers the last token: its logits are needed, so at least one token is computed.
        """
        if not self.enable_prefix_caching:
            return []
        bs, cached = self.block_size, self.cached
        tokens, hashes = request.all_token_ids, request.block_hashes
        hits: list[KVBlock] = []
        for i in range((request.num_tokens - 1) // bs):
            if i == len(hashes):
                self.extend_hashes(request, i + 1)
            block = cached.get(hashes[i])
            if block is None or block.token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        self.extend_hashes(request, num_full)
        bs = self.block_size
        salted = self.prefix_cache_scope == "tenant" and self.keep_miss_reasons
        for i in range(num_full):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            h = request.block_hashes[i]
            if h in self.cached:
                continue  # another block already holds this prefix; this one stays private
            block.block_hash = h
            block.token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = block
            self.evicted.pop(h, None)
            if salted:
                content = self._content_hashes(request, i + 1)[i]
                self.prefix_tenants[content] = request.tenant
                self.prefix_tenants.move_to_end(content)
                if len(self.prefix_tenants) > MISS_MEMORY:
                    self.prefix_tenants.popitem(last=False)

    def _evict(self, block: KVBlock, by: str | None = None) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.keep_miss_reasons:
                    self.evicted[block.block_hash] = (time.time_ns(), by)
                    if len(self.evicted) > MISS_MEMORY:
                        self.evicted.popitem(last=False)
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        for block in list(self.cached.values()):
            self._evict(block)

    def explain_misses(self, request: Request, num_hits: int) -> list[CacheMiss]:
        """Why each prompt block past the ``num_hits`` cached ones (from
        :meth:`find_cached_prefix`) is computed, as runs of consecutive blocks with one reason
        (``messages.CACHE_MISS_REASONS``): ``caching_off``; a full block ``after_miss`` (its
        prefix is cached, behind an earlier miss), ``evicted`` (when, by whose allocation),
        ``other_tenant`` (the same tokens registered under another tenant's salt) or
        ``never_seen``; then the block holding the last token: ``partial_block`` (shorter than
        one block) or ``last_token`` (a full block, never looked up). Call it before the
        request's own allocation, which may evict. [] without ``keep_miss_reasons``."""
        if not self.keep_miss_reasons:
            return []
        bs = self.block_size
        n = request.num_prompt_tokens
        num_blocks = self.blocks_needed(n)
        if not self.enable_prefix_caching:
            return [CacheMiss(reason="caching_off", first_block=0, num_blocks=num_blocks)]
        looked_up = (n - 1) // bs  # full blocks find_cached_prefix may serve
        self.extend_hashes(request, looked_up)
        salted = self.prefix_cache_scope == "tenant"
        content = self._content_hashes(request, looked_up) if salted else []
        misses: list[CacheMiss] = []
        for i in range(num_hits, looked_up):
            h = request.block_hashes[i]
            gone = self.evicted.get(h)
            other = self.prefix_tenants.get(content[i]) if salted else None
            if h in self.cached:
                miss = CacheMiss(reason="after_miss", first_block=i)
            elif gone is not None:
                miss = CacheMiss(reason="evicted", first_block=i, time_ns=gone[0], by=gone[1])
            elif other is not None and other != request.tenant:
                miss = CacheMiss(reason="other_tenant", first_block=i, tenant=other)
            else:
                miss = CacheMiss(reason="never_seen", first_block=i)
            _add_run(misses, miss)
        last = "partial_block" if n % bs else "last_token"
        _add_run(misses, CacheMiss(reason=last, first_block=num_blocks - 1))
        return misses

    # ----- allocation -----
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached: list[KVBlock] = ()
    ) -> bool:
        """Give the request enough blocks for ``num_new_tokens`` more computed tokens.

        ``cached`` (from :meth:`find_cached_prefix`, only for a request with no blocks yet) are
        taken first; the request's ``num_computed_tokens`` must then be set to their token count
        by the caller. Returns False, changing nothing, when the free blocks do not suffice.
        """
        block_ids = request.block_ids
        if cached:
            computed = request.num_computed_tokens + len(cached) * self.block_size
            need = self.blocks_needed(computed + num_new_tokens) - len(block_ids) - len(cached)
            revived = sum(1 for b in cached if b.ref_cnt == 0)
            if max(need, 0) + revived > len(self.free_queue):
                return False
            for block in cached:
                if block.ref_cnt == 0:
                    self.free_queue.remove(block)
                block.ref_cnt += 1
                block_ids.append(block.block_id)
        else:  # the common call (a running request's next tokens): no cached blocks to take
            need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(block_ids)
            if need > len(self.free_queue):
                return False
        for _ in range(need):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block, request.request_id)
            block.ref_cnt = 1
            block_ids.append(block.block_id)
        if len(block_ids) > request.stats.kv_blocks:
            request.stats.kv_blocks = len(block_ids)
        return True

    def trim(self, request: Request) -> None:
        """Free the request's blocks past those its computed tokens fill (the slots of rejected
        draft tokens), tail first. Those blocks were taken fresh for the drafts and never
        registered in the prefix cache."""
        keep = self.blocks_needed(request.num_computed_tokens)
        while len(request.block_ids) > keep:
            block = self.blocks[request.block_ids.pop()]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def free(self, request: Request) -> None:
        """Return the request's blocks. Tail blocks are freed first, so they are reused first
        and the shared head of a prefix stays cached longest."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
        request.block_ids = []


def _add_run(runs: list[CacheMiss], miss: CacheMiss) -> None:
    """Append one block's miss, extending the last run when it follows it with the same reason
    (and, for evictions, the same evicting request; for tenants, the same tenant)."""
    last = runs[-1] if runs else None
    if (
        last is not None
        and last.reason == miss.reason
        and last.first_block + last.num_blocks == miss.first_block
        and last.by == miss.by
        and last.tenant == miss.tenant
    ):
        last.num_blocks += 1
    else:
        runs.append(miss)
