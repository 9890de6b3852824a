"""The plain-torch reference of every kernel: clear rather than fast, over tensors and ints.

Each kernel module re-exports its reference beside the kernel as ``reference_*`` and its test
compares the two. This module imports only torch (never triton), so the engine's CPU path runs
these same functions: the ``torch`` attention backend (:mod:`tokenmill.engine.attention.
torch_backend`) and the model's ``TorchOps`` (:mod:`tokenmill.engine.models.ops`).

Attention: a decode batch (one new token per sequence) is gathered and attended in one batched
product; any sequence with a longer chunk is attended on its own. Scores and softmax run in
float32 whatever the cache dtype. RMSNorm is Zhang & Sennrich (2019), computed in float32 and
cast back, as Hugging Face does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "attend_chunk",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
]


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
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    query_start_loc_host: Sequence[int] | None = None,
    seq_lens_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its cached context + itself.

    The reference of both attention kernels, with their signature. The new tokens' K/V must
    already be in the cache (see :func:`store_kv`).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``; sequence i's new tokens are rows
            ``query_start_loc[i]:query_start_loc[i+1]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        query_start_loc: ``[num_seqs + 1]`` int32 row offsets into ``query``.
        seq_lens: ``[num_seqs]`` int32 context length of each sequence after this step (cached +
            new tokens).
        block_tables: ``[num_seqs, max_blocks]`` int32 block ids (padding never read).
        max_query_len, max_seq_len: the largest chunk and context (the kernels size their grids
            with them; not needed here).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: keys older than this many positions are invisible (None = full).
        query_start_loc_host, seq_lens_host: the same numbers as Python ints; given, the
            per-sequence loop never reads them back from the device (no sync on CUDA).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in query's dtype.
    """
    del max_query_len, max_seq_len  # part of the kernels' signature only
    starts = query_start_loc.tolist() if query_start_loc_host is None else query_start_loc_host
    lens = seq_lens.tolist() if seq_lens_host is None else seq_lens_host
    num_seqs = len(lens)
    out = torch.empty_like(query)
    decode_rows = [i for i in range(num_seqs) if starts[i + 1] - starts[i] == 1]
    other_rows = [i for i in range(num_seqs) if starts[i + 1] - starts[i] != 1]
    device = query.device

    if decode_rows:
        idx = torch.tensor(decode_rows, device=device)
        seq_lens_dev = seq_lens.to(device)[idx].long()  # [B]
        longest = max(lens[i] for i in decode_rows)
        block_size = k_cache.shape[1]
        nblk = (longest + block_size - 1) // block_size
        tables = block_tables.to(device)[idx, :nblk].long()  # [B, nblk]
        k = k_cache[tables].flatten(1, 2)[:, :longest]  # [B, L, Hkv, D]
        v = v_cache[tables].flatten(1, 2)[:, :longest]
        key_pos = torch.arange(longest, device=device)
        allowed = _visibility((seq_lens_dev - 1)[:, None], key_pos, sliding_window)  # [B, 1, L]
        allowed &= (key_pos[None, :] < seq_lens_dev[:, None])[:, None, :]
        q_rows = torch.tensor([starts[i] for i in decode_rows], device=device)
        out[q_rows] = _attend(query[q_rows][:, None], k, v, allowed, scale)[:, 0]

    for i in other_rows:
        s, e = starts[i], starts[i + 1]
        out[s:e] = attend_chunk(
            query[s:e], k_cache, v_cache, block_tables[i], lens[i], scale, sliding_window
        )
    return out


def attend_chunk(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence's chunk of new tokens ``query [Q, Hq, D]`` (the last Q of its ``length``
    tokens, already in the cache) attending causally over its context; ``[Q, Hq, D]``."""
    device = query.device
    k = _gather_context(k_cache, block_table, length)
    v = _gather_context(v_cache, block_table, length)
    query_pos = torch.arange(length - query.shape[0], length, device=device)
    allowed = _visibility(query_pos, torch.arange(length, device=device), sliding_window)
    return _attend(query[None], k[None], v[None], allowed[None], scale)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, H]`` → ``weight * (x / rms(x))`` ``[T, H]``: float32 inside, cast to x's dtype
    before the weight multiplies it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; returns ``(rms_norm(new_residual), new_residual)``."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE (the two halves of each head rotate together) of ``q [T, Hq, D]`` and
    ``k [T, Hkv, D]`` with per-token ``cos, sin [T, D]``; returns new tensors ``(q, k)``."""

    def rot(x: torch.Tensor) -> torch.Tensor:
        c = cos[:, None].to(x.dtype)
        s = sin[:, None].to(x.dtype)
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    return rot(q), rot(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` → ``silu(x[:, :I]) * x[:, I:]`` ``[T, I]`` (SwiGLU's gate and up)."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]
