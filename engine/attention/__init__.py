"""Attention backends over the paged KV cache; all take the same :class:`AttentionMetadata`."""

from __future__ import annotations

from .metadata import AttentionMetadata, SeqChunk, StepInputs, build_step_inputs
from .torch_backend import TorchAttentionBackend


def _triton_backend():
    """The Triton backend, imported on first use so the CPU path never needs triton."""
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


# name -> factory returning a backend with ``forward(q, k, v, k_cache, v_cache, metadata,
# scale, sliding_window)``
BACKENDS = {"torch": TorchAttentionBackend, "triton": _triton_backend}


def get_attention_backend(name: str = "auto", device: str = "cpu"):
    """Return the backend called ``name``; ``auto`` is ``triton`` on CUDA (when the kernels
    package imports) and ``torch`` elsewhere.

    Raises:
        ValueError: ``name`` is not a known backend, or ``triton`` was asked for and the kernels
            cannot be imported.
    """
    if name == "auto":
        if str(device).startswith("cuda"):
            try:
                return _triton_backend()
            except ImportError:
                pass
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    try:
        return BACKENDS[name]()
    except ImportError as exc:
        raise ValueError(f"attention backend {name!r} is unavailable: {exc}") from None


__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "SeqChunk",
    "StepInputs",
    "TorchAttentionBackend",
    "build_step_inputs",
    "get_attention_backend",
]
