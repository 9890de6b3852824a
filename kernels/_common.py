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
