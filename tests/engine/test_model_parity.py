"""Our paged decoder against Hugging Face transformers on the same tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers
from paged_driver import run_paged
from tiny_model import TINY_DECODER, perturbed_model

from tokenmill.engine.models.loader import load_model

TINY = dict(TINY_DECODER, vocab_size=97)

CASES = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-rope-llama3": (
        transformers.LlamaConfig,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
            attention_bias=True,
        ),
    ),
    "llama-rope-linear": (
        transformers.LlamaConfig,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "mistral-sliding": (transformers.MistralConfig, dict(sliding_window=6, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, attention_bias=True)),
}

PROMPT_LENS = [3, 11, 17]
DECODE_STEPS = 8


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_checkpoint(request, tmp_path_factory):
    cls, extra = CASES[request.param]
    hf = perturbed_model(cls(**TINY, **extra))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    hf.eval()
    g = torch.Generator().manual_seed(1)
    seqs = [
        torch.randint(0, TINY["vocab_size"], (n + DECODE_STEPS,), generator=g).tolist()
        for n in PROMPT_LENS
    ]
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0].float() for s in seqs]
    return path, seqs, expected


@pytest.mark.parametrize("chunk", [10_000, 5], ids=["one-prefill", "chunks-of-5"])
def test_logits_match_transformers(tiny_checkpoint, chunk):
    path, seqs, expected = tiny_checkpoint
    model = load_model(path, device="cpu", dtype="float32")
    got = run_paged(model, seqs, PROMPT_LENS, chunk=chunk, block_size=4)
    for g, e, n in zip(got, expected, PROMPT_LENS):
        # prompt positions (prefill or chunked prefill), then 8 decode steps
        torch.testing.assert_close(g[:n], e[:n], atol=1e-4, rtol=0)
        torch.testing.assert_close(g[n:], e[n:], atol=1e-4, rtol=0)


def test_dynamic_rope_beyond_trained_context(tmp_path):
    """NTK-dynamic RoPE only changes anything past max_position_embeddings; prefill 40 > 16."""
    config = transformers.LlamaConfig(
        **{**TINY, "max_position_embeddings": 16},
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    seq = torch.randint(
        0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([seq])).logits[0]
    model = load_model(tmp_path, device="cpu", dtype="float32")
    (got,) = run_paged(model, [seq], [40], chunk=10_000)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads(tmp_path):
    """A checkpoint split into shards with a ``model.safetensors.index.json`` loads the same."""
    config = transformers.Qwen2Config(**TINY)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    seq = list(range(1, 12))
    with torch.no_grad():
        expected = hf(torch.tensor([seq])).logits[0]
    (got,) = run_paged(load_model(tmp_path, device="cpu"), [seq], [11], chunk=4)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
