"""Roofline per step: bytes and FLOPs of a stub step against hand arithmetic on the default
model's shapes (SmolLM2-135M), sliding windows, the real engine's step records, and the device
peaks (GPU table, flags, the cached CPU probe)."""

from __future__ import annotations

import json

import pytest

from tokenmill.engine import device_peaks
from tokenmill.engine.model_config import parse_model_config
from tokenmill.engine.roofline import Chunk, ModelCost, attended_keys, step_cost

# SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, intermediate 1536,
# vocab 49152, tied embeddings
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}

# Hand arithmetic, float32 (4 bytes a weight and a KV element):
# per layer: qkv 576 x (9 + 3 + 3) x 64 = 552,960; o 576 x 576 = 331,776;
#            gate_up 576 x 2 x 1536 = 1,769,472; down 1536 x 576 = 884,736 -> 3,538,944
LINEAR_PARAMS = 3_538_944 * 30  # 106,168,320
LM_HEAD_PARAMS = 576 * 49152  # 28,311,552
KV_PER_TOKEN = 46_080  # 2 x 3 x 64 x 4 x 30
# the stub step: a 10-token prompt from 0 that samples, a decode at position 20, and a 7-token
# prefill chunk from position 5 that does not reach its prompt's end
STEP = [Chunk(0, 10, True), Chunk(20, 1, True), Chunk(5, 7, False)]
TOKENS, SAMPLED = 18, 2
WEIGHT_BYTES = (106_168_320 + 28_311_552) * 4  # 537,919,488: every linear + the LM head
KV_WRITE = 18 * 46_080  # 829,440
KV_READ = (10 + 21 + 12) * 46_080  # contexts 0+10, 20+1, 5+7 -> 1,981,440
# keys attended per layer: 1+..+10 = 55; 21; 6+..+12 = 63 -> 139; x 30 layers = 4,170 pairs
ATTN_FLOPS = 4 * 9 * 64 * 4_170  # 9,607,680
FLOPS = 2 * 106_168_320 * 18 + 2 * 28_311_552 * 2 + ATTN_FLOPS  # 3,944,913,408


def smollm2_cost(**kw) -> ModelCost:
    return ModelCost.from_config(
        parse_model_config(SMOLLM2), weight_dtype_bytes=4, kv_dtype_bytes=4, **kw
    )


def test_stub_step_matches_the_hand_arithmetic():
    cost = smollm2_cost()
    assert cost.linear_params == LINEAR_PARAMS == 106_168_320
    assert cost.lm_head_params == LM_HEAD_PARAMS
    assert cost.kv_bytes_per_token == KV_PER_TOKEN
    got = step_cost(cost, STEP)
    assert got.weight_bytes == WEIGHT_BYTES == 537_919_488
    assert got.kv_read_bytes == KV_READ == 1_981_440
    assert got.kv_write_bytes == KV_WRITE == 829_440
    assert got.flops == FLOPS == 3_944_913_408


def test_no_sampling_row_skips_the_lm_head_and_no_tokens_cost_nothing():
    cost = smollm2_cost()
    prefill = step_cost(cost, [Chunk(0, 32, False)])
    assert prefill.weight_bytes == 106_168_320 * 4
    assert prefill.flops == 2 * 106_168_320 * 32 + 4 * 9 * 64 * (32 * 33 // 2) * 30
    assert step_cost(cost, []) == (0, 0, 0, 0)
    decode = step_cost(cost, [Chunk(99, 1, True)])  # one decode at context 100
    assert decode.kv_read_bytes == 100 * 46_080 and decode.kv_write_bytes == 46_080
    # batch-1 decode: ~2 FLOP per weight read over 4 bytes -> intensity about 0.5 FLOP/byte
    intensity = decode.flops / (decode.weight_bytes + decode.kv_read_bytes + decode.kv_write_bytes)
    assert 0.45 < intensity < 0.55


def test_stored_weight_bytes_replace_the_dtype_estimate():
    cost = smollm2_cost(linear_weight_bytes=1000, lm_head_weight_bytes=10)
    assert step_cost(cost, [Chunk(0, 1, True)]).weight_bytes == 1010
    assert step_cost(cost, [Chunk(0, 2, False)]).weight_bytes == 1000


def test_sliding_window_caps_keys_and_kv_reads():
    # window 4: positions 3..8 see min(n, 4) keys = 3 + 4 x 5 = 23
    assert attended_keys(2, 6, 4) == 23
    assert attended_keys(10, 3, 4) == 12
    assert attended_keys(0, 3, 4) == 6
    assert attended_keys(5, 7) == 63
    cfg = dict(SMOLLM2, architectures=["MistralForCausalLM"], sliding_window=4)
    cost = ModelCost.from_config(parse_model_config(cfg), kv_dtype_bytes=4)
    got = step_cost(cost, [Chunk(2, 6, True)])
    # keys read: positions max(0, 2 - 4 + 1) = 0 .. 7 -> 8 = min(2 + 6, 4 + 6 - 1) per layer
    assert got.kv_read_bytes == 8 * 46_080
    assert got.flops == 2 * 106_168_320 * 6 + 2 * 28_311_552 + 4 * 9 * 64 * 23 * 30


def test_engine_steps_carry_the_default_models_roofline(smollm2_dir):
    """The real engine: a float32 SmolLM2 step reads 537,919,488 weight bytes (its linear
    layers as loaded, hand-computed above), and its records add up per chunk."""
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling import SamplingParams

    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 26)
    info = llm.core.model_info
    assert info["weight_bytes_by_dtype"] == {"float32": info["weight_bytes_total"]}
    # the linear weights plus the 576 x 61 norm weights (the tied head counted once)
    assert info["weight_bytes_total"] == WEIGHT_BYTES + 576 * 61 * 4
    assert info["kv_bytes_per_token"] == KV_PER_TOKEN
    llm.generate([list(range(1, 12))], SamplingParams(max_tokens=3, ignore_eos=True))
    first, second = llm.step_records[0], llm.step_records[1]
    assert first.num_prefill_tokens == 11 and first.num_sampled == 1
    assert first.weight_bytes == WEIGHT_BYTES
    assert first.kv_write_bytes == 11 * KV_PER_TOKEN
    assert first.kv_read_bytes == 11 * KV_PER_TOKEN
    assert first.flops == 2 * LINEAR_PARAMS * 11 + 2 * LM_HEAD_PARAMS + 4 * 9 * 64 * 66 * 30
    assert second.num_decode_tokens == 1 and second.kv_read_bytes == 12 * KV_PER_TOKEN


def test_gpu_table_matches_device_names():
    assert device_peaks.gpu_table_peaks("NVIDIA H200", "bfloat16") == (
        "NVIDIA H200",
        4800.0,
        989_000.0,
    )
    assert device_peaks.gpu_table_peaks("NVIDIA H100 80GB HBM3", "bfloat16")[0] == (
        "NVIDIA H100 SXM"
    )
    assert device_peaks.gpu_table_peaks("NVIDIA H100 PCIe", "float16")[:2] == (
        "NVIDIA H100 PCIe",
        2000.0,
    )
    assert device_peaks.gpu_table_peaks("NVIDIA A100-SXM4-80GB", "bfloat16")[1] == 2039.0
    assert device_peaks.gpu_table_peaks("NVIDIA A100-PCIE-40GB", "bfloat16")[1] == 1555.0
    assert device_peaks.gpu_table_peaks("NVIDIA L40S", "bfloat16")[0] == "NVIDIA L40S"
    assert device_peaks.gpu_table_peaks("NVIDIA L4", "bfloat16")[0] == "NVIDIA L4"
    assert device_peaks.gpu_table_peaks("Tesla T4", "float32") == ("NVIDIA T4", 320.0, 8100.0)
    assert device_peaks.gpu_table_peaks("NVIDIA GeForce RTX 4090", "bfloat16")[1] == 1008.0
    assert device_peaks.gpu_table_peaks("Some Future GPU", "bfloat16") is None


def test_flags_win_and_the_cpu_probe_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    both = device_peaks.resolve_peaks("cpu", "float32", 20.0, 300.0)
    assert both["device_peak_gbps"] == 20.0 and both["device_peak_gflops_source"] == "flag"
    assert not (tmp_path / "device_peaks.json").exists()  # no probe when both are given

    first = device_peaks.resolve_peaks("cpu", "float32", None, 300.0)
    assert first["device_peak_gbps_source"] == "probe" and first["device_peak_gbps"] > 0
    assert first["device_peak_gflops"] == 300.0 and first["device_peak_gflops_source"] == "flag"
    cache = json.loads((tmp_path / "device_peaks.json").read_text())
    (key,) = cache
    assert device_peaks.cpu_name() in key and "float32" in key

    def no_probe(*a, **k):
        raise AssertionError("probed again despite the cache")

    monkeypatch.setattr(device_peaks, "probe", no_probe)
    again = device_peaks.resolve_peaks("cpu", "float32")
    assert again["device_peak_gbps"] == pytest.approx(first["device_peak_gbps"], abs=0.01)
    assert again["device_peak_gflops"] > 0 and again["device_peak_gflops_source"] == "probe"


def test_int8_compute_probes_its_own_peak_once_per_path(tmp_path, monkeypatch):
    from tokenmill.engine.int8_compute import gemm_isa

    path = gemm_isa()
    if path is None:
        pytest.skip("no int8 path on this CPU")
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    plain = device_peaks.resolve_peaks("cpu", "float32", 20.0, 300.0)
    assert "device_peak_int8_gops" not in plain  # int8 compute off: no int8 ceiling
    calls = []
    real = device_peaks.probe_int8

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(device_peaks, "probe_int8", counted)
    first = device_peaks.resolve_peaks("cpu", "float32", 20.0, 300.0, int8_path=path)
    again = device_peaks.resolve_peaks("cpu", "float32", 20.0, 300.0, int8_path=path)
    assert len(calls) == 1  # the second start read the cache
    assert first["device_peak_int8_gops"] == again["device_peak_int8_gops"] > 0
    (key,) = json.loads((tmp_path / "device_peaks.json").read_text())
    assert f"int8 {path}" in key


def test_steps_say_what_their_linear_layers_multiplied_in(smollm2_dir):
    """int8 compute on: the prompt's step (above the GEMV cut-over) multiplied in int8, the
    one-row decode steps in float32; a float32 model's steps all float32."""
    from tokenmill.engine.int8_compute import gemm_isa
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.quantization import INT8_COMPUTE_GEMV_ROWS
    from tokenmill.engine.sampling import SamplingParams

    if gemm_isa() is None:
        pytest.skip("no int8 path on this CPU")
    prompt = list(range(1, INT8_COMPUTE_GEMV_ROWS["int8"] + 20))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm = LLM(str(smollm2_dir), quantization="int8", int8_compute="on", kv_cache_memory=1 << 26)
    llm.generate([prompt], params)
    precisions = [r.compute_precision for r in llm.step_records]
    assert precisions == ["int8", "float32", "float32"]
    plain = LLM(str(smollm2_dir), kv_cache_memory=1 << 26)
    plain.generate([prompt], params)
    assert {r.compute_precision for r in plain.step_records} == {"float32"}
