"""Test helper: tiny models. ``write_tiny_llama`` writes the ``config.json`` of a 1-layer Llama
for dummy weights (``load_format="dummy"``); ``perturbed_model`` builds a transformers
checkpoint of a tiny config with every parameter nudged off its init, so biases and norms must
load for logits to match; ``TINY_DECODER`` is the shape those checkpoints share."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# 2 layers, 4 query heads on 2 KV heads (GQA), head_dim 16
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def write_tiny_llama(folder: Path, **overrides) -> None:
    """``folder/config.json``: a 1-layer Llama, hidden 16, 2 query heads on 1 KV head,
    ``overrides`` (``vocab_size`` at least) on top."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        **overrides,
    }
    (folder / "config.json").write_text(json.dumps(config))


def perturbed_model(config):
    """transformers' float32 model of ``config`` (seed 0), every parameter moved by N(0, 0.05)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # perturb everything, biases and norms included, so each must load
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf
