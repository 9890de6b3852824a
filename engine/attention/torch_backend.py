"""Plain-torch paged attention: the reference every Triton kernel is tested against.

Clear rather than fast: a decode batch (one new token per sequence) is gathered and attended
in one batched product; any sequence with a longer chunk is attended on its own. Scores and
softmax run in float32 whatever the cache dtype.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K and V into the paged cache.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` int64 flat slot per token; ``-1`` (padding) is skipped.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value[valid].to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Keys (or values) of one sequence: ``[length, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].reshape(-1, *cache.shape[2:])[:length]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention of ``q [B, Q, Hq, D]`` over ``k, v [B, L, Hkv, D]``.

    ``allowed [B, Q, L]`` is True where a query may see a key. Returns ``[B, Q, Hq, D]`` in
    q's dtype. One batched product per KV head, with that head's query group stacked as extra
    query rows, so K and V are read in place (no per-group copies).
    """
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device)
    bias = bias.masked_fill_(~allowed, float("-inf")).repeat_interleave(group, dim=1)  # [B, Q*G, L]
    out = torch.empty((b, nq, hq, d), dtype=torch.float32, device=q.device)
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        qh = q[:, :, heads].float().reshape(b, nq * group, d)  # rows ordered (query, group)
        scores = torch.baddbmm(bias, qh, k[:, :, h].float().transpose(1, 2), alpha=scale)
        out[:, :, heads] = torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h].float()).view(
            b, nq, group, d
        )
    return out.to(q.dtype)


def _visibility(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """``[..., Q, L]`` mask: causal, and within the sliding window when one is set."""
    allowed = key_pos[..., None, :] <= query_pos[..., :, None]
    if sliding_window is not None:
        allowed &= key_pos[..., None, :] > query_pos[..., :, None] - sliding_window
    return allowed


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its cached context + itself.

    The new tokens' K/V must already be in the cache (see :func:`store_kv`).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, laid out by ``metadata.query_start_loc``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        metadata: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: keys older than this many positions are invisible (None = full).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in query's dtype.
    """
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_host
    lens = metadata.seq_lens_host
    decode_rows = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    other_rows = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] != 1]
    device = query.device

    if decode_rows:
        idx = torch.tensor(decode_rows, device=device)
        seq_lens = metadata.seq_lens.to(device)[idx].long()  # [B]
        longest = max(lens[i] for i in decode_rows)
        block_size = k_cache.shape[1]
        nblk = (longest + block_size - 1) // block_size
        tables = metadata.block_tables.to(device)[idx, :nblk].long()  # [B, nblk]
        k = k_cache[tables].flatten(1, 2)[:, :longest]  # [B, L, Hkv, D]
        v = v_cache[tables].flatten(1, 2)[:, :longest]
        key_pos = torch.arange(longest, device=device)
        allowed = _visibility((seq_lens - 1)[:, None], key_pos, sliding_window)  # [B, 1, L]
        allowed &= (key_pos[None, :] < seq_lens[:, None])[:, None, :]
        q_rows = torch.tensor([starts[i] for i in decode_rows], device=device)
        out[q_rows] = _attend(query[q_rows][:, None], k, v, allowed, scale)[:, 0]

    for i in other_rows:
        s, e, length = starts[i], starts[i + 1], lens[i]
        k = _gather_context(k_cache, metadata.block_tables[i], length)
        v = _gather_context(v_cache, metadata.block_tables[i], length)
        query_pos = torch.arange(length - (e - s), length, device=device)
        allowed = _visibility(query_pos, torch.arange(length, device=device), sliding_window)
        out[s:e] = _attend(query[s:e][None], k[None], v[None], allowed[None], scale)[0]
    return out


class TorchAttentionBackend:
    """Attention backend ``torch``: the default on CPU and the reference for ``triton``."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V by slot mapping, then attend; shapes as in :func:`paged_attention`."""
        store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        return paged_attention(query, k_cache, v_cache, metadata, scale, sliding_window)
