"""RMSNorm, with an optional fused residual add that also returns the new residual.

One program per row. The sum of squares runs in float32; like the reference (Hugging Face's
definition) the normalised row is cast to the input dtype before the weight multiplies it, and
the residual sum is rounded to the input dtype before it is normalised.
Reference: :func:`tokenmill.kernels.reference.rms_norm` / ``fused_add_rms_norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, check_device, next_pow2, round_bf16_by_hand, row_warps
from .reference import fused_add_rms_norm as reference_fused_add_rms_norm
from .reference import rms_norm as reference_rms_norm

__all__ = [
    "fused_add_rms_norm",
    "reference_fused_add_rms_norm",
    "reference_rms_norm",
    "rms_norm",
]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (read only when HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden], dtype of weight * x
    residual_out_ptr,  # [num_rows, hidden], x's dtype (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RTNE_X: tl.constexpr,
    RTNE_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = cast(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, RTNE_X)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = cast(xf * inv_rms, x_ptr.dtype.element_ty, RTNE_X).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        cast(w * normed, out_ptr.dtype.element_ty, RTNE_OUT),
        mask=mask,
    )


def _launch(x, residual, weight, eps):
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(
            f"weight {tuple(weight.shape)} does not match the hidden size {x.shape[-1]}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    tensors = (x, weight) if residual is None else (x, residual, weight)
    check_device(*tensors)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    else:
        r2 = res_out = x2  # unused
    if x2.shape[0]:
        block = next_pow2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            res_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            RTNE_X=round_bf16_by_hand(x.dtype),
            RTNE_OUT=round_bf16_by_hand(out.dtype),
            num_warps=row_warps(block),
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dim.

    Args:
        x: ``[..., hidden]`` float32/bfloat16/float16; the last dim must be contiguous.
        weight: ``[hidden]``.
        eps: added to the mean square.

    Returns:
        A new ``[..., hidden]`` tensor in ``promote_types(weight.dtype, x.dtype)``.

    Raises:
        ValueError: a weight of the wrong size, or tensors the kernel cannot reach.
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; returns ``(rms_norm(new_residual), new_residual)``.

    Args:
        x, residual: ``[..., hidden]``, same shape and dtype.
        weight: ``[hidden]``.
        eps: added to the mean square.

    Returns:
        Two new tensors ``[..., hidden]``: the normalised rows and the summed residual (x's dtype).

    Raises:
        ValueError: mismatched shapes, or tensors the kernel cannot reach.
    """
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    return _launch(x, residual, weight, eps)
