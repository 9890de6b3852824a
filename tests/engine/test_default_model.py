"""The real default model: our engine's greedy output equals transformers' generate."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import encode_chat

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "The three primary colors are red,",
]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    llm = LLM(str(smollm2_dir), device="cpu", dtype="float32")
    return llm, llm.tokenizer


def test_greedy_matches_transformers_generate(engine, smollm2_dir):
    llm, tokenizer = engine
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # all five in one batch of different lengths: the paged batch must not mix sequences up
    ours = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for p, res in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[
                0, len(p) :
            ].tolist()
        assert res.token_ids == ref, tokenizer.decode(p)
    assert sum(len(r.token_ids) for r in ours) >= 5 * 16  # real continuations, not early EOS


def test_chat_answer_names_paris(engine):
    llm, tokenizer = engine
    ids = encode_chat(tokenizer, "What is the capital of France?")
    (res,) = llm.generate([ids], SamplingParams(max_tokens=32))
    assert "Paris" in res.text
    assert res.finish_reason == "stop"
    assert 0 < res.ttft_s <= res.e2e_s
    assert "<|im_end|>" not in res.text


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(engine):
    llm, tokenizer = engine
    ids = [tokenizer.encode("My favourite animal is")]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    a = llm.generate(ids, params)[0].token_ids
    b = llm.generate(ids, params)[0].token_ids
    greedy = llm.generate(ids, SamplingParams(max_tokens=24))[0].token_ids
    assert a == b
    assert a != greedy
