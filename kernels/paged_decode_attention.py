"""Split-K (flash-decoding) paged attention for a batch of one-token queries.

A decode step has one query token per sequence, so the mixed kernel would run only
``num_seqs * num_kv_heads`` programs, each walking a whole (possibly long) context: too few to
fill the GPU. Here each sequence's context is cut into partitions of ``partition_size`` keys and
program ``(seq, kv_head, split)`` attends the ``GROUP`` query heads of ``kv_head`` (padded to a
16-row tile for ``tl.dot``) over one partition, writing a normalised partial output with its
running max and sum. The reduce kernel, program ``(seq, head)``, rescales the partials by
``exp2(m_s - max_s m_s) * l_s`` and sums them. With a single partition the first kernel writes
the output directly and no reduce runs.

Partials (float32): ``part_out [num_seqs, num_heads, num_splits, head_dim]``,
``part_m / part_l [num_seqs, num_heads, num_splits]``; a partition with no visible key (past
the sequence's end, or before its sliding window) stores ``l = 0`` and is ignored by the reduce.
``num_splits = cdiv(max_seq_len, partition_size)`` comes from the host-side ``max_seq_len``:
no sync.

Reference: :func:`tokenmill.kernels.reference.paged_attention` (``reference_paged_attention``;
every sequence a one-token chunk).
"""

from __future__ import annotations

import functools

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

__all__ = ["default_partition_size", "paged_decode_attention", "reference_paged_attention"]

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], one token per sequence
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32 (unused when DIRECT)
    part_m_ptr,  # [num_seqs, num_heads, num_splits] float32, base-2 running max
    part_l_ptr,  # [num_seqs, num_heads, num_splits] float32, running sum
    out_ptr,  # [num_tokens, num_heads, head_dim] (written only when DIRECT)
    scale_log2,  # softmax scale * log2(e)
    sliding_window,  # read only when USE_WINDOW
    num_splits,
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
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    RTNE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    qpos = seq_len - 1
    lo = split * PARTITION
    hi = tl.minimum(lo + PARTITION, seq_len)
    if USE_WINDOW:
        first_key = tl.maximum(qpos - sliding_window + 1, 0)
        lo = tl.maximum(lo, first_key // BLOCK_N * BLOCK_N)
    else:
        first_key = 0

    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # finite: see paged_attention
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < hi) & (offs_n >= first_key)
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table_ptr, offs_n, offs_n < hi, n_ok, offs_d, d_ok, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, KV_BLOCK_SIZE,
        )  # fmt: skip
        qk = scores(q, k, PREC, DOT_F32)
        qk = tl.where(n_ok[None, :], qk * scale_log2, float("-inf"))  # [BLOCK_G, BLOCK_N]
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, qk, v, PREC, DOT_F32)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if DIRECT:
        o_offs = token * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, cast(out, out_ptr.dtype.element_ty, RTNE), mask=out_mask)
    else:
        ml_offs = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_G]
        tl.store(part_m_ptr + ml_offs, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml_offs, l_i, mask=row_ok)
        tl.store(part_out_ptr + ml_offs[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_m_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_l_ptr,  # [num_seqs, num_heads, num_splits] float32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    RTNE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits
    s_ok = splits < num_splits
    l_s = tl.load(part_l_ptr + base + splits, mask=s_ok, other=0.0)
    used = l_s > 0.0
    m_s = tl.load(part_m_ptr + base + splits, mask=s_ok, other=-1.0e30)
    m_s = tl.where(used, m_s, -1.0e30)
    weight = tl.where(used, tl.exp2(m_s - tl.max(m_s, 0)) * l_s, 0.0)  # [BLOCK_S]
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=used[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        cast(out, out_ptr.dtype.element_ty, RTNE),
        mask=offs_d < HEAD_DIM,
    )


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_partition_size(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Keys per split: 512, halved (down to 64) while the grid would have fewer than about four
    programs per streaming multiprocessor; one partition covering the whole context on the CPU."""
    if device.type != "cuda":
        return max(16, next_pow2(max_seq_len))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    size = 512
    while size > 64 and num_seqs * num_kv_heads * triton.cdiv(max_seq_len, size) < 4 * sms:
        size //= 2
    return size


def paged_decode_attention(
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
    partition_size: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context, split over the context.

    The new tokens' K/V must already be in the cache. Same contract as
    :func:`~.paged_attention.paged_attention`, restricted to steps where every sequence has
    exactly one new token.

    Args:
        query: ``[num_seqs, num_heads, head_dim]`` float32/bfloat16/float16, last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype.
        query_start_loc, seq_lens, block_tables: as for
            :func:`~.paged_attention.paged_attention` (device tensors).
        max_query_len: must be 1.
        max_seq_len: the longest context (host int): it sets the number of splits, so
            launching needs no device-to-host sync.
        scale: softmax scale.
        sliding_window: keys older than this many positions are invisible (None = full).
        partition_size: keys per split, a multiple of ``block_n`` (default:
            :func:`default_partition_size`).
        block_n, num_warps, num_stages: tile overrides (benchmarks).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in query's dtype.

    Raises:
        ValueError: a step with a chunk longer than one token, shapes or dtypes that do not fit,
            a ``block_n`` that is not a power of two >= 16, a partition size that is not a
            positive multiple of it, or tensors the kernel cannot reach.
    """
    num_seqs = seq_lens.shape[0]
    if num_seqs and max_query_len != 1:
        raise ValueError(
            f"paged_decode_attention takes one token per sequence (max_query_len {max_query_len})"
        )
    query, kv_block_size, num_kv_heads = check_attention_inputs(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens != num_seqs:
        raise ValueError(f"{num_tokens} query rows for {num_seqs} one-token sequences")
    check_device(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    on_cuda = query.device.type == "cuda"
    group = num_heads // num_kv_heads
    bn = block_n or (64 if on_cuda else 32)
    if partition_size and not block_n:
        bn = min(bn, partition_size)
    part = partition_size or max(
        bn, default_partition_size(num_seqs, num_kv_heads, max_seq_len, query.device)
    )
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n {bn} must be a power of two >= 16")
    if part <= 0 or part % bn:
        raise ValueError(f"partition_size {part} must be a positive multiple of block_n {bn}")
    num_splits = triton.cdiv(max_seq_len, part)
    direct = num_splits == 1
    block_d = max(16, next_pow2(head_dim))
    if direct:
        part_out = part_m = part_l = out  # unused
    else:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_m = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        part_out,
        part_m,
        part_l,
        out,
        scale * LOG2E,
        sliding_window if sliding_window is not None else 0,
        num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=bn,
        PARTITION=part,
        KV_BLOCK_SIZE=kv_block_size,
        USE_WINDOW=sliding_window is not None,
        DIRECT=direct,
        PREC=dot_precision(query.dtype),
        DOT_F32=upcast_dot(query.dtype),
        RTNE=round_bf16_by_hand(query.dtype),
        num_warps=num_warps or 4,
        num_stages=num_stages or (3 if on_cuda else 1),
    )
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_m,
            part_l,
            query_start_loc,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_pow2(num_splits),
            RTNE=round_bf16_by_hand(query.dtype),
            num_warps=4 if on_cuda else 1,
        )
    return out
