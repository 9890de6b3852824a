"""The element-wise operations of the decoder, behind one small interface so that CUDA runs
fused Triton kernels (``tokenmill.kernels``) and the CPU runs these plain-torch versions.

Every implementation takes and returns the same shapes and dtypes:

- ``rms_norm(x [T, H], weight [H], eps) -> [T, H]``
- ``fused_add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (normed [T, H], new_residual [T, H])``
  where ``new_residual = x + residual`` and ``normed = rms_norm(new_residual)``.
- ``rotary(q [T, Hq, D], k [T, Hkv, D], cos [T, D], sin [T, D]) -> (q, k)``, neox layout (the two
  halves of each head rotate together); implementations may work in place.
- ``silu_and_mul(x [T, 2I]) -> [T, I]``: ``silu(x[:, :I]) * x[:, I:]`` (SwiGLU's gate and up).

The plain-torch versions are the kernels' references (:mod:`tokenmill.kernels.reference`, which
imports torch only, never triton): one definition for the CPU path and the kernels' tests.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu, reference


class TorchOps:
    """Reference implementations (and the CPU path)."""

    name = "torch"

    rms_norm = staticmethod(reference.rms_norm)
    fused_add_rms_norm = staticmethod(reference.fused_add_rms_norm)
    rotary = staticmethod(reference.rotary_embedding)
    silu_and_mul = staticmethod(reference.silu_and_mul)


def get_ops(device: torch.device | str, backend: str = "auto"):
    """Fused Triton ops on CUDA when ``tokenmill.kernels`` provides them; on a CPU the C
    kernels' :class:`tokenmill.kernels.cpu.CpuOps` where they build
    (:func:`tokenmill.kernels.cpu.available`); else :class:`TorchOps`.

    ``backend="torch"`` forces the reference ops; ``"triton"`` requires the kernels package.

    Raises:
        ValueError: ``backend="triton"`` and the kernels cannot be imported.
    """
    kind = torch.device(device).type
    want_triton = backend == "triton" or (backend == "auto" and kind == "cuda")
    if not want_triton:
        if backend == "auto" and kind == "cpu" and cpu.available():
            return cpu.CpuOps
        return TorchOps
    try:
        from tokenmill.kernels.ops import TritonOps  # type: ignore[import-not-found]
    except ImportError as exc:
        if backend == "triton":
            raise ValueError(
                f"triton ops requested but tokenmill.kernels is unavailable: {exc}"
            ) from None
        return TorchOps
    return TritonOps
