"""SwiGLU's activation: ``silu(x[..., :I]) * x[..., I:]`` for the fused gate/up projection.

Program ``(row, col_block)`` reads ``BLOCK`` gate and up columns. The SiLU runs in float32 and
is rounded to the input dtype before the product, as the reference's two torch ops do.
Reference: :func:`tokenmill.kernels.reference.silu_and_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, check_device, next_pow2, round_bf16_by_hand
from .reference import silu_and_mul as reference_silu_and_mul

__all__ = ["reference_silu_and_mul", "silu_and_mul"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * inter]: gate columns then up columns
    out_ptr,  # [num_rows, inter]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
    RTNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = cast(gate * tl.sigmoid(gate), out_ptr.dtype.element_ty, RTNE).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, cast(act * up, out_ptr.dtype.element_ty, RTNE), mask=mask
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = x.chunk(2, -1)``.

    Args:
        x: ``[..., 2 * I]`` float32/bfloat16/float16.

    Returns:
        A new ``[..., I]`` tensor in x's dtype.

    Raises:
        ValueError: an odd last dim, or a tensor the kernel cannot reach.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} must be even (gate and up halves)")
    check_device(x)
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            RTNE=round_bf16_by_hand(x.dtype),
            num_warps=max(1, block // 256),
        )
    return out.view(*x.shape[:-1], inter)
