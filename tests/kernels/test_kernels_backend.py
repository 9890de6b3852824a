"""The ``triton`` attention backend: registry, store + attend against the ``torch`` backend,
and the real SmolLM2 model giving the same greedy tokens with either backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill.engine.attention import (
    SeqChunk,
    TorchAttentionBackend,
    build_step_inputs,
    get_attention_backend,
)
from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
from tokenmill.engine.kv_cache import allocate_kv_caches
from tokenmill.kernels import cpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_registry_names_and_auto():
    assert isinstance(get_attention_backend("triton", "cpu"), TritonAttentionBackend)
    assert isinstance(get_attention_backend("torch", "cuda"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", "cuda"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="choose from auto, torch, triton"):
        get_attention_backend("flash", "cpu")


@pytest.mark.parametrize("decode_only", [False, True])
def test_backend_stores_and_attends_like_torch(decode_only):
    """forward = store_kv + attention (split-K when every sequence decodes one token)."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    specs = [(20, 1), (15, 1), (40, 1)] if decode_only else [(20, 1), (12, 7), (0, 33)]
    tables = [[4, 0], [2, 3], [1, 5, 6]]
    k_cache = torch.randn(8, bs, hkv, d, device=DEVICE)
    v_cache = torch.randn(8, bs, hkv, d, device=DEVICE)
    step = build_step_inputs([SeqChunk(c, n, t) for (c, n), t in zip(specs, tables)], bs, DEVICE)
    n = sum(new for _, new in specs)
    q = torch.randn(n, hq, d, device=DEVICE)
    k = torch.randn(n, hkv, d, device=DEVICE)
    v = torch.randn(n, hkv, d, device=DEVICE)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, step.metadata, d**-0.5, None)
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, step.metadata, d**-0.5, None)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    code = (
        "import torch\n"
        "from tokenmill.kernels.rms_norm import rms_norm\n"
        "try:\n"
        "    rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "ERR Triton kernels need CUDA tensors" in res.stdout, res.stderr[-2000:]


def test_torch_path_imports_no_triton():
    """The CPU path (torch backend, the C kernels' ops or torch ops, the compiled decode step,
    a model, the offline engine) shares the kernels' plain-torch references and the C kernels'
    bindings without importing triton or any Triton kernel module."""
    code = (
        "import sys\n"
        "from tokenmill.engine.attention import get_attention_backend\n"
        "from tokenmill.engine.models.ops import get_ops\n"
        "import tokenmill.engine.models.loader, tokenmill.engine.llm\n"
        "assert get_attention_backend('auto', 'cpu').name == 'torch'\n"
        "from tokenmill.kernels import cpu\n"
        "assert get_ops('cpu').name == ('cpu' if cpu.available() else 'torch')\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', "
        "'tokenmill.kernels'))))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == (
        "['tokenmill.kernels', 'tokenmill.kernels.cpu', 'tokenmill.kernels.cpu_step', "
        "'tokenmill.kernels.cutover', 'tokenmill.kernels.reference']"
    )


def greedy(model, prompts: list[list[int]], max_new: int, chunk: int, block_size: int = 16):
    """Greedy decoding over the paged cache with chunked prefill: prompts advance ``chunk``
    tokens per step, so steps mix one sequence's last prefill chunk with another's decode.
    Returns the new token ids per prompt and the sampled rows' logits of every step."""
    cfg = model.config
    param = next(model.parameters())
    need = [-(-(len(p) + max_new) // block_size) for p in prompts]
    tables, at = [], 0
    for n in need:
        tables.append(list(range(at, at + n))[::-1])  # reversed: non-trivial block tables
        at += n
    caches = allocate_kv_caches(cfg, at, block_size, param.dtype, param.device)
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    step_logits = []
    with torch.no_grad():
        while any(len(o) < max_new for o in outs):
            active = [i for i in range(len(seqs)) if len(outs[i]) < max_new]
            chunks, tokens = [], []
            for i in active:
                n = min(chunk, len(seqs[i]) - done[i])
                chunks.append(SeqChunk(done[i], n, tables[i]))
                tokens += seqs[i][done[i] : done[i] + n]
            step = build_step_inputs(chunks, block_size, param.device)
            hidden = model(
                torch.tensor(tokens, device=param.device), step.positions, caches, step.metadata
            )
            logits = model.compute_logits(hidden[step.last_token_indices]).cpu()
            step_logits.append(logits)
            for j, i in enumerate(active):
                done[i] += chunks[j].num_new
                if done[i] == len(seqs[i]):
                    tok = int(logits[j].argmax())
                    seqs[i].append(tok)
                    outs[i].append(tok)
    return outs, step_logits


@pytest.mark.e2e  # a minute of the real model on the interpreted Triton backend: `make test-e2e`
@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_torch_backend(smollm2_dir):
    """The default model with ``attention_backend="triton"`` (Triton attention, norms, RoPE and
    SwiGLU; interpreted on a CPU) produces the torch backend's greedy tokens (on a CPU that one
    runs the C kernels: decode attention, GEMV, element-wise ops)."""
    from transformers import AutoTokenizer

    from tokenmill.engine.models.loader import load_model

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    results = {}
    for backend in ("torch", "triton"):
        model = load_model(smollm2_dir, device=DEVICE, dtype="float32", attention_backend=backend)
        assert model.backend.name == backend
        # the fused kernels are in use too (the torch backend on a CPU: the C kernels' ops)
        cpu_ops = backend == "torch" and DEVICE == "cpu" and cpu.available()
        assert model.model.norm.ops.name == ("cpu" if cpu_ops else backend)
        results[backend] = greedy(model, prompts, max_new=5, chunk=4)
    (ref_tokens, ref_logits), (tri_tokens, tri_logits) = results["torch"], results["triton"]
    assert tri_tokens == ref_tokens
    assert all(len(t) == 5 for t in ref_tokens)
    for a, b in zip(ref_logits, tri_logits):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)
    assert "Paris" in tok.decode(ref_tokens[0])  # the model is really answering


def test_benchmark_script_smoke(tmp_path):
    """benchmarks/kernels.py end to end at tiny shapes (its numbers mean nothing here): every
    kernel is measured against its torch reference and the JSON carries the targets."""
    import json
    from pathlib import Path

    out = tmp_path / "bench.json"
    script = Path(__file__).parents[2] / "benchmarks" / "kernels.py"
    res = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    for name in ("decode_attention (split-K)", "prefill_attention", "store_kv", "rms_norm",
                 "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):  # fmt: skip
        assert name in names
    assert set(report["targets"]) == {
        "decode_bw_ge_70pct",
        "prefill_flops_ge_40pct",
        "no_kernel_slower_than_torch",
    }
    for r in report["results"]:
        assert r["triton_ms"] > 0 and r["torch_ms"] > 0
    store = next(r for r in report["results"] if r["name"] == "store_kv")
    el = 4 if report["dtype"] == "float32" else 2  # float32 on a CPU, bfloat16 on CUDA
    assert store["bytes"] == 4 * 8 * 2 * 64 * el + 8 * 8  # K+V read and written; int64 slots
    prefill = next(r for r in report["results"] if r["name"] == "prefill_attention")
    assert prefill["flops"] == 4 * 4 * 64 * 48 * 49 / 2  # causal, 4 heads, d64, 48 tokens
    assert prefill["sdpa_ms"] > 0
    assert "decode_attention" in res.stdout  # the table
