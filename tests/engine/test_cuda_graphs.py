"""Issue 20 item 4: the CUDA-graph capture logic for decode steps (``engine/cuda_graphs.py``),
tested on the CPU with the device calls stubbed: this machine has no GPU, so nothing here
captures a real graph (``scripts/gpu_check.sh`` does, when a GPU is lent). The stub records
what would be captured and replays by running the forward again on the static buffers, so the
sizes, the padding to the next captured size, the static inputs and the eager fallbacks are
checked on the real model code and KV cache."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_quantization import make_checkpoint

from tokenmill.engine.attention import SeqChunk, build_step_inputs
from tokenmill.engine.cuda_graphs import capture_sizes, decode_graphs_for, padded_size
from tokenmill.engine.kv_cache import allocate_kv_caches
from tokenmill.engine.models.loader import load_model
from tokenmill.kernels import cpu

BLOCK = 4


class StubGraphApi:
    """``GraphApi`` without a device: capture records the graph's order, replay reruns."""

    def __init__(self, fail_at: int | None = None):
        self.captured = 0
        self.replays = 0
        self.fail_at = fail_at

    def new_graph(self):
        return {"id": self.captured}

    def pool(self):
        return None

    @contextlib.contextmanager
    def capture(self, graph, pool):
        self.captured += 1
        if self.fail_at == self.captured:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    def replay(self, graph, rerun):
        self.replays += 1
        rerun()

    def synchronize(self, device):
        pass


def test_capture_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(2000)[-1] == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    sizes = capture_sizes(20)
    assert sizes == [1, 2, 4, 8, 16, 20]
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


@pytest.fixture
def model(tmp_path):
    make_checkpoint("llama", tmp_path)
    return load_model(tmp_path, device="cpu", dtype="float32")


def _caches(model):
    return allocate_kv_caches(model.config, 32, BLOCK, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(not cpu.available(), reason="the graph stub replays through the C decode path")
@torch.inference_mode()
def test_padded_replay_equals_eager_and_writes_no_padding_kv(model):
    """3 sequences decode as the size-4 graph: the hidden states and the K/V written equal the
    eager forward's, and the padding row stored nothing."""
    eager_caches, graph_caches = _caches(model), _caches(model)
    api = StubGraphApi()
    graphs, reason = decode_graphs_for(model, graph_caches, [1, 2, 4, 8], BLOCK, 64, api)
    assert reason is None and api.captured == 4
    # capture ran with every slot -1: nothing written
    assert all(not c.any() for kv in graph_caches for c in kv)
    tables = [[5, 6, 7, 8], [1, 2, 3], [9, 10, 11, 12, 13]]
    prompts = [9, 6, 13]
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 128, (n + 4,), generator=g).tolist() for n in prompts]
    pre = build_step_inputs(
        [SeqChunk(0, n, t) for n, t in zip(prompts, tables, strict=True)], BLOCK
    )
    ids = torch.tensor([t for seq, n in zip(tokens, prompts, strict=True) for t in seq[:n]])
    for caches in (eager_caches, graph_caches):
        model(ids, pre.positions, caches, pre.metadata)
    for step in range(4):
        chunks = [SeqChunk(n + step, 1, t) for n, t in zip(prompts, tables, strict=True)]
        s = build_step_inputs(chunks, BLOCK)
        ids = torch.tensor([seq[n + step] for seq, n in zip(tokens, prompts, strict=True)])
        assert graphs.takes(3, s.metadata)
        want = model(ids, s.positions, eager_caches, s.metadata)
        got = graphs.run(ids, s.positions, s.metadata)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert api.replays == 4
    # the K/V written agree (batch 4 vs 3 sums in another order), and the blocks no sequence
    # owns, block 0 among them (the padding row's table), were never written
    used = sorted({b for t in tables for b in t})
    unused = [b for b in range(32) if b not in used]
    for (ke, ve), (kg, vg) in zip(eager_caches, graph_caches, strict=True):
        torch.testing.assert_close(kg, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg, ve, atol=1e-5, rtol=1e-5)
        assert not kg[unused].any() and not vg[unused].any()


@torch.inference_mode()
def test_steps_the_graphs_do_not_take_run_eagerly(model):
    graphs, _ = decode_graphs_for(model, _caches(model), [1, 2, 4], BLOCK, 16, StubGraphApi())
    nine = build_step_inputs([SeqChunk(3, 1, [i]) for i in range(9)], BLOCK).metadata
    prefill = build_step_inputs([SeqChunk(0, 3, [0])], BLOCK).metadata
    long_table = build_step_inputs([SeqChunk(20, 1, list(range(6)))], BLOCK).metadata
    assert not graphs.takes(9, nine)  # above the largest captured size
    assert not graphs.takes(3, prefill)  # a prefill chunk
    assert not graphs.takes(1, long_table)  # 6 blocks past the 4 of a 16-token max length
    with pytest.raises(ValueError, match="does not fit"):
        graphs.run(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), prefill)


def test_models_that_cannot_be_captured_say_why(model, tmp_path_factory):
    caches = _caches(model)
    graphs, reason = decode_graphs_for(model, caches, [1, 2, 4], BLOCK, 16)
    assert graphs is None and reason == "no CUDA graphs on cpu"
    graphs, reason = decode_graphs_for(model, caches, [1, 2, 4], BLOCK, 16, StubGraphApi(2))
    assert graphs is None and "capture at batch 2 failed" in reason
    path = tmp_path_factory.mktemp("dynamic")
    make_checkpoint("llama", path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    dyn = load_model(path, device="cpu", dtype="float32")
    graphs, reason = decode_graphs_for(dyn, _caches(dyn), [1], BLOCK, 16, StubGraphApi())
    assert graphs is None and "dynamic" in reason
