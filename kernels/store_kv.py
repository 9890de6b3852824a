"""Write the new tokens' K and V into the paged KV cache through ``slot_mapping``.

One program per token copies all of its KV heads; a token whose slot is ``-1`` (padding) writes
nothing. Cache offsets are computed in int64 (a large cache passes 2**31 elements).
Reference: :func:`tokenmill.kernels.reference.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cache_strides, cast, check_device, next_pow2, round_bf16_by_hand
from .reference import store_kv as reference_store_kv

__all__ = ["reference_store_kv", "store_kv"]


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RTNE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    v_dst = block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    tl.store(k_cache_ptr + k_dst, cast(k, k_cache_ptr.dtype.element_ty, RTNE), mask=mask)
    tl.store(v_cache_ptr + v_dst, cast(v, v_cache_ptr.dtype.element_ty, RTNE), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K and V into the paged cache (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the
            cache's); strided views are fine as long as the last dim is contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, last dim
            contiguous; written in place.
        slot_mapping: ``[num_tokens]`` int64 flat slot ``block * block_size + offset`` per token;
            ``-1`` (padding) is skipped.

    Raises:
        ValueError: mismatched shapes, a non-int64 slot mapping, a cache whose last dim is not
            contiguous, or tensors the kernel cannot reach (see ``check_device``).
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [tokens, kv_heads, head_dim]; got {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"key heads/dim {tuple(key.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError("slot_mapping must be int64 [num_tokens]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    check_device(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *cache_strides(k_cache, v_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        RTNE=round_bf16_by_hand(k_cache.dtype) and key.dtype != k_cache.dtype,
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )
