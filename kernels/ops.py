"""``TritonOps``: the decoder's element-wise ops as fused Triton kernels, with the same static
methods and signatures as the engine's plain-torch ``TorchOps`` (:mod:`tokenmill.engine.models.ops`
holds the shape contract and picks this bundle on CUDA). Imports no engine types."""

from __future__ import annotations

import torch

from .rms_norm import fused_add_rms_norm as _fused_add_rms_norm
from .rms_norm import rms_norm as _rms_norm
from .rotary_embedding import rotary_embedding as _rotary_embedding
from .silu_and_mul import silu_and_mul as _silu_and_mul


class TritonOps:
    """Fused kernels for RMSNorm (optionally with the residual add), RoPE and SiLU-and-mul."""

    name = "triton"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x [T, H]`` → ``[T, H]``; see :func:`tokenmill.kernels.rms_norm.rms_norm`."""
        return _rms_norm(x, weight, eps)

    @staticmethod
    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)`` in one kernel."""
        return _fused_add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def rotary(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox RoPE on ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place; returns ``(q, k)``."""
        return _rotary_embedding(q, k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """``x [T, 2I]`` → ``silu(x[:, :I]) * x[:, I:]`` ``[T, I]``."""
        return _silu_and_mul(x)
