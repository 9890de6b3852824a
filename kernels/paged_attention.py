"""Paged attention for a batch that mixes prefill chunks and decodes (one kernel).

Layout of the work: program ``(seq, q_block, kv_head)`` takes ``BLOCK_Q = BLOCK_M // GROUP``
consecutive new tokens of one sequence and *all* ``GROUP`` query heads that share ``kv_head``
(GQA), packed token-major into the ``BLOCK_M`` rows of one tile (a few rows idle when ``GROUP``
does not divide ``BLOCK_M``), so each K/V tile is loaded once per group. Keys and values are
gathered ``BLOCK_N`` at a time through the block table, up to the sequence's length. Softmax is
online (running max and sum, float32, base 2). Key tiles wholly below the causal diagonal skip
the causal mask; the diagonal tiles (and every tile, when a sliding window is set) apply it.

The grid is ``(num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads)`` from host-side sizes
(``seq_lens.shape`` and the ``max_query_len`` int), so launching needs no device-to-host sync;
programs past a sequence's chunk return at once.
``q_block`` runs from the last block down, so the longest (most keys) programs start first.

Reference: :func:`tokenmill.kernels.reference.paged_attention` (``reference_paged_attention``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    cache_strides,
    cast,
    check_attention_inputs,
    check_device,
    dot_precision,
    load_kv_tile,
    next_pow2,
    online_softmax_step,
    round_bf16_by_hand,
    scores,
    upcast_dot,
)
from .reference import paged_attention as reference_paged_attention

__all__ = ["paged_attention", "reference_paged_attention"]

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, BLOCK_D] float32 running numerator
    l_i,  # [BLOCK_M] float32 running denominator
    m_i,  # [BLOCK_M] float32 running max (base-2 logits)
    q,  # [BLOCK_M, BLOCK_D] query tile
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    table_ptr,  # [max_blocks] int32, this sequence's block table row
    start_n,
    kv_end,  # keys at positions >= kv_end are never read
    qpos,  # [BLOCK_M] int32 position of each row's token
    kv_head,
    scale_log2,
    sliding_window,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if MASKED:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        n_ok = offs_n < kv_end
    else:  # the caller guarantees start_n + BLOCK_N <= kv_end
        n_ok = offs_n >= 0
    k, v = load_kv_tile(
        k_cache_ptr, v_cache_ptr, table_ptr, offs_n, n_ok, n_ok, offs_d, d_ok, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, KV_BLOCK_SIZE,
    )  # fmt: skip
    qk = scores(q, k, PREC, DOT_F32) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        allowed = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > qpos[:, None] - sliding_window)
        qk = tl.where(allowed, qk, float("-inf"))
    return online_softmax_step(acc, l_i, m_i, qk, v, PREC, DOT_F32)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, context length after this step
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    scale_log2,  # softmax scale * log2(e)
    sliding_window,  # read only when USE_WINDOW
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    RTNE: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] token index within the chunk
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    qpos = context + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_offs = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(
        q_ptr + q_offs[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )

    first_q = context + q_block * BLOCK_Q
    kv_end = tl.minimum(first_q + BLOCK_Q, seq_len)  # one past the last key any row may see
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # a finite start for the running max: a row that has seen only masked keys keeps
    # exp2(m_old - m_new) == 1 instead of NaN
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    if USE_WINDOW:
        lo = tl.maximum(first_q - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        for start_n in range(lo, kv_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start_n, kv_end, qpos,
                kv_head, scale_log2, sliding_window, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, HEAD_DIM, BLOCK_D, BLOCK_N, KV_BLOCK_SIZE, True, True, PREC,
                DOT_F32,
            )  # fmt: skip
    else:
        # keys below the first row's position are visible to every row: no mask needed
        full_end = (first_q + 1) // BLOCK_N * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start_n, kv_end, qpos,
                kv_head, scale_log2, sliding_window, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, HEAD_DIM, BLOCK_D, BLOCK_N, KV_BLOCK_SIZE, False, False,
                PREC, DOT_F32,
            )  # fmt: skip
        for start_n in range(full_end, kv_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start_n, kv_end, qpos,
                kv_head, scale_log2, sliding_window, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, HEAD_DIM, BLOCK_D, BLOCK_N, KV_BLOCK_SIZE, True, False,
                PREC, DOT_F32,
            )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_offs = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_offs[:, None] + offs_d[None, :],
        cast(out, out_ptr.dtype.element_ty, RTNE),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def default_blocks(
    max_query_len: int, group: int, head_dim: int, on_cuda: bool, elem_size: int = 2
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a step.

    ``BLOCK_M`` rows hold ``BLOCK_M // group`` tokens × ``group`` heads: up to 128 rows for
    long chunks (64 for float32, whose tiles take twice the registers), fewer (down to
    ``tl.dot``'s minimum of 16) when the longest chunk is short.
    """
    cap = 128 if elem_size <= 2 else 64
    block_m = max(16, min(cap, next_pow2(max_query_len * group)), next_pow2(group))
    if not on_cuda:  # the interpreter: any sizes work, bigger tiles mean fewer Python steps
        return block_m, 32, 1, 1
    if elem_size > 2:  # float32 (tests, parity runs): 3xTF32 dots, smaller key tiles
        return block_m, 32, 8 if block_m >= 64 else 4, 2
    block_n = 64 if head_dim <= 128 else 32
    num_warps = 8 if block_m >= 128 else 4
    return block_m, block_n, num_warps, 3 if head_dim <= 128 else 2


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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its cached context + itself.

    The new tokens' K/V must already be in the cache (see :func:`~.store_kv.store_kv`).

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float32/bfloat16/float16; sequence i's new
            tokens are rows ``query_start_loc[i]:query_start_loc[i+1]``; the last dim must be
            contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype.
        query_start_loc: ``[num_seqs + 1]`` int32 row offsets into ``query`` (device).
        seq_lens: ``[num_seqs]`` int32 context length of each sequence after this step, cached +
            new tokens (device).
        block_tables: ``[num_seqs, max_blocks]`` int32 block ids (device; padding never read).
        max_query_len: the longest chunk (host int): with ``num_seqs`` it sizes the grid, so
            launching needs no device-to-host sync.
        max_seq_len: the longest context; not used by this kernel (the signature is shared with
            :func:`~.paged_decode_attention.paged_decode_attention` and the reference).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: keys older than this many positions are invisible (None = full).
        block_m, block_n, num_warps, num_stages: override the tile shape (benchmarks); both
            blocks must be powers of two >= 16, ``block_m`` also >= the GQA group.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in query's dtype.

    Raises:
        ValueError: shapes or dtypes that do not fit, ``num_heads`` not a multiple of
            ``num_kv_heads``, bad tile overrides, or tensors the kernel cannot reach.
    """
    query, kv_block_size, num_kv_heads = check_attention_inputs(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    del max_seq_len  # the shared signature; the grid needs only the longest chunk
    check_device(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    bm, bn, warps, stages = default_blocks(
        max_query_len, group, head_dim, query.device.type == "cuda", query.element_size()
    )
    bm = block_m or bm
    bn = block_n or bn
    if bm < max(16, group) or bm & (bm - 1):
        raise ValueError(f"block_m {bm} must be a power of two >= max(16, group={group})")
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n {bn} must be a power of two >= 16")
    block_q = bm // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2E,
        sliding_window if sliding_window is not None else 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_Q=block_q,
        BLOCK_M=bm,
        BLOCK_N=bn,
        KV_BLOCK_SIZE=kv_block_size,
        USE_WINDOW=sliding_window is not None,
        PREC=dot_precision(query.dtype),
        DOT_F32=upcast_dot(query.dtype),
        RTNE=round_bf16_by_hand(query.dtype),
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
    )
    return out
