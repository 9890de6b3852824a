"""Helpers shared by the kernel wrappers: interpreter detection, device checks, dot precision."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton: read the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(*tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor can be handed to a Triton kernel: all on one CUDA
    device, or all on the CPU while the interpreter is on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"kernel inputs are on several devices: {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors (got {device}); on the CPU set TRITON_INTERPRET=1 "
        "before importing tokenmill.kernels"
    )


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: ``tf32x3`` for float32 inputs, ``tf32`` (the default) otherwise.

    ``tf32x3`` splits each float32 operand into a TF32 high part and a TF32 remainder and sums
    three tensor-core products, which recovers close to float32 accuracy (the float32 tests'
    1e-4) at tensor-core speed; it is not ``ieee`` (float32 FMAs, no tensor cores). For 16-bit
    inputs Triton ignores the setting: they go to the tensor cores in their own precision. The
    interpreter ignores it too (its dot is a plain numpy matmul).
    """
    return "tf32x3" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether to feed ``tl.dot`` float32 copies of its operands.

    Only under the interpreter with bfloat16: Triton 3.9's interpreted ``tl.dot`` returns
    garbage for bfloat16 operands (float16 and float32 are fine), so the kernels upcast there.
    Compiled kernels always run the native 16-bit dot.
    """
    return dtype == torch.bfloat16 and interpreting()


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return triton.next_power_of_2(max(int(n), 1))


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program element-wise kernel over ``block`` elements."""
    return max(1, min(16, block // 256))


def round_bf16_by_hand(dtype: torch.dtype) -> bool:
    """Whether kernels must round float32 → bfloat16 themselves (:func:`cast`'s ``RTNE``).

    Only under the interpreter: Triton 3.9's interpreted cast truncates to bfloat16, where
    compiled kernels (and torch) round to nearest even.
    """
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def cast(x, dtype: tl.constexpr, RTNE: tl.constexpr):
    """``x.to(dtype)``; with ``RTNE`` (interpreter, bfloat16 target) rounds float32 to nearest
    even by hand: add half an ulp of bfloat16 (plus the tie bit) to the bits, then truncate."""
    if RTNE:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        y = x.to(dtype)
    return y


def check_attention_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """The attention kernels' shared checks of ``query [tokens, heads, dim]`` against the caches
    ``[blocks, block_size, kv_heads, dim]``: shapes, GQA grouping, dtype, contiguous head dim.
    Returns ``(query, kv_block_size, num_kv_heads)``, query made contiguous along its last dim.

    Raises:
        ValueError: a shape, head count or dtype that does not fit, or a cache whose head dim
            is not contiguous.
    """
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "query must be [tokens, heads, dim] and the caches [blocks, bs, kv_heads, dim]"
        )
    _, num_heads, head_dim = query.shape
    _, kv_block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads/dim ({num_heads}, {head_dim}) do not fit the cache's "
            f"({num_kv_heads}, {cache_dim}): heads must be a multiple of kv heads"
        )
    if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from query dtype {query.dtype}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    return query, kv_block_size, num_kv_heads


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The block, slot and head strides of the K then the V cache, as the kernels take them
    (``stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh``)."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    table_ptr,  # [max_blocks] int32, this sequence's block table row
    offs_n,  # [BLOCK_N] key positions
    table_ok,  # [BLOCK_N] positions whose block-table entry may be read
    n_ok,  # [BLOCK_N] positions whose keys and values are loaded (others read as 0)
    offs_d,  # [BLOCK_D]
    d_ok,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    KV_BLOCK_SIZE: tl.constexpr,
):
    """One ``[BLOCK_N, BLOCK_D]`` tile of keys and one of values of ``kv_head``, gathered
    through the block table."""
    block = tl.load(table_ptr + offs_n // KV_BLOCK_SIZE, mask=table_ok, other=0).to(tl.int64)
    in_block = offs_n % KV_BLOCK_SIZE
    k_offs = block * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N] int64
    v_offs = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + k_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def scores(q, k, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """``q @ kᵀ`` in float32 (on float32 copies with ``DOT_F32``: see :func:`upcast_dot`)."""
    if DOT_F32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC)
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    return qk


@triton.jit
def online_softmax_step(acc, l_i, m_i, qk, v, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold one tile of base-2 logits ``qk [rows, BLOCK_N]`` and its values into the running
    numerator ``acc``, denominator ``l_i`` and max ``m_i`` (float32); returns all three."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc += tl.dot(p, v.to(tl.float32), input_precision=PREC)
    else:
        acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, l_i, m_new
