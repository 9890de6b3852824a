"""The element-wise operations of the decoder, behind one small interface so that CUDA runs
fused Triton kernels (``tokenmill.kernels``) and the CPU runs these plain-torch versions.

Every implementation takes and returns the same shapes and dtypes:

- ``rms_norm(x [T, H], weight [H], eps) -> [T, H]``
- ``fused_add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (normed [T, H], new_residual [T, H])``
  where ``new_residual = x + residual`` and ``normed = rms_norm(new_residual)``.
- ``rotary(q [T, Hq, D], k [T, Hkv, D], cos [T, D], sin [T, D]) -> (q, k)``, neox layout (the two
  halves of each head rotate together); implementations may work in place.
- ``silu_and_mul(x [T, 2I]) -> [T, I]``: ``silu(x[:, :I]) * x[:, I:]`` (SwiGLU's gate and up).

RMSNorm is Zhang & Sennrich (2019), computed in float32 and cast back, as Hugging Face does.
"""

from __future__ import annotations

import torch


class TorchOps:
    """Reference implementations (and the CPU path)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @classmethod
    def fused_add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new_residual = x + residual
        return cls.rms_norm(new_residual, weight, eps), new_residual

    @staticmethod
    def rotary(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def rot(x: torch.Tensor) -> torch.Tensor:
            c = cos[:, None].to(x.dtype)
            s = sin[:, None].to(x.dtype)
            half = x.shape[-1] // 2
            return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

        return rot(q), rot(k)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


def get_ops(device: torch.device | str, backend: str = "auto"):
    """Fused Triton ops on CUDA when ``tokenmill.kernels`` provides them, else :class:`TorchOps`.

    ``backend="torch"`` forces the reference ops; ``"triton"`` requires the kernels package.

    Raises:
        ValueError: ``backend="triton"`` and the kernels cannot be imported.
    """
    want_triton = backend == "triton" or (backend == "auto" and torch.device(device).type == "cuda")
    if not want_triton:
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
