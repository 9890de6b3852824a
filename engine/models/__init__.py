"""Model registry keyed by ``config.json["architectures"][0]``, and the weight loader."""

from __future__ import annotations

from ..errors import ModelLoadError
from ..model_config import SUPPORTED_ARCHITECTURES
from .decoder import DecoderForCausalLM

# The four families share one decoder; their differences are switches in ModelConfig.
MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, DecoderForCausalLM
)


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The model class for a Hugging Face architecture name.

    Raises:
        ModelLoadError: the architecture is not in :data:`MODEL_REGISTRY`.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "DecoderForCausalLM", "get_model_class"]
