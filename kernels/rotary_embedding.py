"""Rotary position embedding, neox style (the two halves of each head rotate together), in
place on q and k, from per-token cos/sin tables.

One program per token rotates all of its query and key heads:
``lo' = lo * cos_lo - hi * sin_lo`` and ``hi' = hi * cos_hi + lo * sin_hi`` in float32.
Reference: :func:`tokenmill.kernels.reference.rotary_embedding`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, check_device, next_pow2, round_bf16_by_hand
from .reference import rotary_embedding as reference_rotary_embedding

__all__ = ["reference_rotary_embedding", "rotary_embedding"]


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_heads, head_dim] rows of one token, head stride stride_h
    stride_h,
    cos_lo,  # [BLOCK_HALF] float32
    cos_hi,
    sin_lo,
    sin_hi,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    RTNE: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    lo_ptr = x_ptr + heads[:, None] * stride_h + cols[None, :]
    lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    new_lo = lo * cos_lo[None, :] - hi * sin_lo[None, :]
    new_hi = hi * cos_hi[None, :] + lo * sin_hi[None, :]
    tl.store(lo_ptr, cast(new_lo, x_ptr.dtype.element_ty, RTNE), mask=mask)
    tl.store(lo_ptr + HALF, cast(new_hi, x_ptr.dtype.element_ty, RTNE), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_ptr,  # [num_tokens, head_dim] float32
    sin_ptr,  # [num_tokens, head_dim] float32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    RTNE_Q: tl.constexpr,
    RTNE_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    cos_row = cos_ptr + tok * stride_ct + cols
    sin_row = sin_ptr + tok * stride_st + cols
    cos_lo = tl.load(cos_row, mask=cmask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_row + HALF, mask=cmask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_row, mask=cmask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + tok * stride_qt, stride_qh, cos_lo, cos_hi, sin_lo, sin_hi, num_q_heads,
        HALF, BLOCK_HQ, BLOCK_HALF, RTNE_Q,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + tok * stride_kt, stride_kh, cos_lo, cos_hi, sin_lo, sin_hi, num_kv_heads,
        HALF, BLOCK_HKV, BLOCK_HALF, RTNE_K,
    )  # fmt: skip


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply neox-style RoPE to ``q`` and ``k`` in place.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``; strided views (e.g. slices of a fused qkv
            projection) are fine as long as the last dim is contiguous.
        k: ``[num_tokens, num_kv_heads, head_dim]``, same rule.
        cos, sin: ``[num_tokens, head_dim]`` float32, each token's table (its position's angles,
            repeated over the two halves).

    Returns:
        ``(q, k)``, the same tensors, rotated.

    Raises:
        ValueError: an odd head_dim, shapes that disagree, a non-contiguous last dim on q/k,
            or tensors the kernel cannot reach.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, head_dim] alike"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for neox rotary")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"cos/sin must be [{num_tokens}, {head_dim}]; got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k are rotated in place: their head_dim must be contiguous")
    check_device(q, k, cos, sin)
    if num_tokens == 0:
        return q, k
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    half = head_dim // 2
    block_hq = next_pow2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        k.shape[1],
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        BLOCK_HQ=block_hq,
        BLOCK_HKV=next_pow2(k.shape[1]),
        RTNE_Q=round_bf16_by_hand(q.dtype),
        RTNE_K=round_bf16_by_hand(k.dtype),
        num_warps=max(1, min(8, block_hq * next_pow2(half) // 256)),
    )
    return q, k
