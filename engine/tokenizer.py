"""The model's tokenizer (Hugging Face, from the model folder) and chat encoding."""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved in ``model_dir`` (tokenizer.json + tokenizer_config.json).

    Raises:
        ModelLoadError: the folder has no usable tokenizer files.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a bad or missing tokenizer
        reason = " ".join(str(exc).split())[:240] or type(exc).__name__
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {reason}") from None


def encode_chat(tokenizer, messages: list[dict] | str) -> list[int]:
    """Token ids of a chat (a list of ``{"role", "content"}`` or one user message) through the
    model's own chat template, ending with the assistant prompt.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 errors from a broken template, bad message shapes
        reason = " ".join(str(exc).split())[:200]
        raise ValueError(f"the model's chat template failed on these messages: {reason}") from None
    return tokenizer.encode(text, add_special_tokens=False)
