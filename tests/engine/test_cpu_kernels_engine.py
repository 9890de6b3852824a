"""Issue 20: the C-kernel path (``kernels/cpu.py``: GEMV, decode attention, element-wise ops)
and torch's ops run the same model. Logits stay within 1e-4 on the four architectures' tiny
checkpoints, with sequences of different lengths advancing together (steps mixing prefill
chunks and decodes, all-decode steps of 1-3 rows, a sliding window); the default model gives
identical greedy tokens for 16 concurrent requests of mixed lengths."""

from __future__ import annotations

import pytest
import torch
from paged_driver import mixed_greedy_requests, run_paged
from test_quantization import ARCHS, make_checkpoint

from tokenmill.engine.llm import LLM
from tokenmill.engine.models.loader import load_model
from tokenmill.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels do not build here")


def _torch_only(monkeypatch) -> None:
    """Every caller asks cpu.available() at call time: False sends it to torch's ops."""
    monkeypatch.setattr(cpu, "available", lambda: False)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_checkpoints_logits_match_torch_ops(arch, tmp_path, monkeypatch):
    make_checkpoint(arch, tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [10, 3, 17]
    seqs = [torch.randint(0, 128, (n + 6,), generator=g).tolist() for n in prompts]
    model = load_model(tmp_path, device="cpu", dtype="float32")
    assert model.model.norm.ops.name == "cpu"
    fast = run_paged(model, seqs, prompts, chunk=4)
    _torch_only(monkeypatch)
    model = load_model(tmp_path, device="cpu", dtype="float32")
    assert model.model.norm.ops.name == "torch"
    slow = run_paged(model, seqs, prompts, chunk=4)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_default_model_greedy_tokens_match_torch_ops(smollm2_dir, monkeypatch):
    """16 requests at once, prompts of 1-4 sentences and 8-40 output tokens: the batch
    shrinks from 16 rows through the GEMV's 4 to 1 as requests finish."""
    prompts, params = mixed_greedy_requests()
    fast = [r.token_ids for r in LLM(str(smollm2_dir)).generate(prompts, params)]
    _torch_only(monkeypatch)
    slow = [r.token_ids for r in LLM(str(smollm2_dir)).generate(prompts, params)]
    assert [len(t) for t in fast] == [p.max_tokens for p in params]
    assert fast == slow
