"""Attention backends over the paged KV cache; all take the same :class:`AttentionMetadata`."""

from __future__ import annotations

from .metadata import AttentionMetadata, SeqChunk, StepInputs, build_step_inputs
from .torch_backend import TorchAttentionBackend

BACKENDS = {"torch": TorchAttentionBackend}


def get_attention_backend(name: str = "auto", device: str = "cpu") -> TorchAttentionBackend:
    """Return the backend called ``name`` (``auto`` picks the best one for ``device``).

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    return BACKENDS[name]()


__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "SeqChunk",
    "StepInputs",
    "TorchAttentionBackend",
    "build_step_inputs",
    "get_attention_backend",
]
