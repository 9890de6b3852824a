"""int8 compute (engine/int8_compute.py): the GEMM against float64 arithmetic on the same rounded
values and against the float layer it stands for, the path named from the CPU's flags and
oneDNN's cap, and the quantized layers taking it above their small-row paths only."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine import int8_compute as ic
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.quantization import (
    INT8_COMPUTE_GEMV_ROWS,
    INT8_GEMV_MAX_ROWS,
    QuantizedLinear,
    int8_compute_path,
    quantize_int8,
    quantize_model,
    resolve_int8_compute,
)

pytestmark = pytest.mark.skipif(ic.gemm_isa() is None, reason="no int8 path on this CPU")


def _gemm_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's int8 copy: int8 per output channel, ``[K, N]`` as the GEMM reads it."""
    q, scales = quantize_int8(w)
    return q.t().contiguous(), scales


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("m", [1, 17, 130])
def test_int8_linear_is_exact_integer_arithmetic(m, terms):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g)
    w = torch.randn(40, 96, generator=g) * 0.1
    bias = torch.randn(40, generator=g)
    q, scales = _gemm_weight(w)
    assert q.shape == (96, 40) and q.dtype == torch.int8 and q.is_contiguous()
    got = ic.int8_linear(x, q, scales, bias, terms)
    ref = ic.reference_int8_linear(x, q, scales, bias, terms)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)


def test_int8_linear_stays_close_to_the_float_layer_and_two_terms_closer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 576, generator=g)
    w = torch.randn(1536, 576, generator=g) * 0.05
    exact = torch.nn.functional.linear(x, w)
    q, scales = _gemm_weight(w)
    one = ((ic.int8_linear(x, q, scales, None, 1) - exact).norm() / exact.norm()).item()
    two = ((ic.int8_linear(x, q, scales, None, 2) - exact).norm() / exact.norm()).item()
    weight_only = ((x @ (q.float() * scales) - exact).norm() / exact.norm()).item()
    assert 1e-4 < two < one < 0.02, (one, two)  # rounded (not float32 itself), within 2 %
    # two terms leave the weight's rounding alone: within 1 % of the weight-only error
    assert abs(two - weight_only) < 0.01 * weight_only, (two, weight_only)


@pytest.mark.parametrize(
    ("flags", "cap", "path"),
    [
        ({"avx2"}, None, "avx2"),
        ({"avx2", "avx_vnni"}, None, "avx2_vnni"),
        ({"avx2", "avx512f", "avx512_vnni"}, None, "avx512_vnni"),
        ({"avx2", "avx512_vnni", "amx_tile", "amx_int8"}, None, "amx"),
        ({"avx2", "avx512_vnni", "amx_tile", "amx_int8"}, "AVX512_CORE_VNNI", "avx512_vnni"),
        ({"avx2", "avx512_vnni", "amx_tile", "amx_int8"}, "avx2", "avx2"),
        ({"avx2", "avx512_vnni"}, "AVX512_CORE_AMX", "avx512_vnni"),  # a cap never adds
        ({"avx2", "avx512_vnni"}, "AVX", None),
        ({"sse4_2"}, None, None),
    ],
)
def test_the_path_follows_the_flags_and_onednns_cap(flags, cap, path):
    assert ic.isa_of_flags(flags, cap) == path


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_layer_takes_int8_compute_above_its_small_row_paths(method):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.05
    bias = torch.randn(64, generator=g)
    on = QuantizedLinear(method, w, bias, int8_compute=2)
    off = QuantizedLinear(method, w, bias)
    assert on.int8_weight is not None and off.int8_weight is None
    big = torch.randn(INT8_GEMV_MAX_ROWS + 36, 128, generator=g)
    # above the GEMV rows: the int8 GEMM on the layer's own int8 copy
    torch.testing.assert_close(
        on(big), ic.int8_linear(big, on.int8_weight, on.int8_scales, on.bias, 2), rtol=0, atol=0
    )
    assert not torch.equal(on(big), off(big))
    rel = ((on(big) - off(big)).norm() / off(big).norm()).item()
    assert rel < 0.02, rel  # the int8 copy stands for the weight the layer computes with
    cut = INT8_COMPUTE_GEMV_ROWS[method]
    small = big[:cut]
    torch.testing.assert_close(on(small), off(small), rtol=0, atol=0)  # GEMV rows unchanged
    above = big[: cut + 1]
    torch.testing.assert_close(
        on(above),
        ic.int8_linear(above, on.int8_weight, on.int8_scales, on.bias, 2),
        rtol=0,
        atol=0,
    )


def test_the_model_names_its_path_and_on_without_one_is_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    quantize_model(model, "int8", int8_compute=1)
    assert int8_compute_path(model) == ic.gemm_isa()
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quantize_model(plain, "int8")
    assert int8_compute_path(plain) is None
    auto = 2 if ic.gemm_isa() in ic.AUTO_PATHS else 0  # no gain with AVX2's kernel
    assert resolve_int8_compute("auto", torch.device("cpu")) == auto
    assert resolve_int8_compute("on", torch.device("cpu")) == 2
    assert resolve_int8_compute("fast", torch.device("cpu")) == 1
    assert resolve_int8_compute("off", torch.device("cpu")) == 0
    assert resolve_int8_compute("auto", torch.device("meta")) == 0
    with pytest.raises(ModelLoadError, match="--int8-compute on needs a CPU"):
        resolve_int8_compute("on", torch.device("meta"))


def test_int8_compute_asked_for_without_quantization_is_one_line():
    from tokenmill.engine.config import EngineConfig

    with pytest.raises(ValueError, match="needs --quantization int8 or int4"):
        EngineConfig(int8_compute="on").validate()
    with pytest.raises(ValueError, match="int8_compute must be one of auto, on, fast, off"):
        EngineConfig(quantization="int8", int8_compute="bogus").validate()
    EngineConfig(quantization="int8", int8_compute="fast").validate()
    EngineConfig(int8_compute="auto").validate()  # the default: off without quantization


def test_on_writes_two_terms_only_where_one_rounding_loses_accuracy():
    """``on``: every layer but the MLP's gate/up projection (half the multiply-adds) takes two
    int8 terms; ``fast`` one everywhere."""

    def block() -> torch.nn.Module:
        m = torch.nn.Module()
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
            m.add_module(name, torch.nn.Linear(64, 64))
        outer = torch.nn.Module()
        outer.add_module("layer", m)
        return outer

    on, fast = block(), block()
    quantize_model(on, "int8", int8_compute=ic.TERMS["on"])
    quantize_model(fast, "int8", int8_compute=ic.TERMS["fast"])
    terms = {n.rpartition(".")[2]: m.int8_terms for n, m in on.named_modules() if n.count(".")}
    assert terms == {"qkv_proj": 2, "o_proj": 2, "gate_up_proj": 1, "down_proj": 2, "lm_head": 2}
    assert {m.int8_terms for n, m in fast.named_modules() if n.count(".")} == {1}
    assert ic.layer_terms("model.layers.3.self_attn.qkv_proj", 0) == 0


def test_the_start_line_names_the_int8_path_and_its_peak():
    from tokenmill.engine.api.start_line import memory_line

    info = {"weight_bytes_by_dtype": {"int8": 1 << 20}, "weight_bytes_total": 1 << 20,
            "int8_compute_path": "amx"}  # fmt: skip
    assert "; int8 compute on amx; " in memory_line(info)
    line = memory_line({**info, "device_peak_int8_gops": 2143.6})
    assert "; int8 compute on amx (peak 2,144 GOP/s); " in line
    assert "int8 compute" not in memory_line({**info, "int8_compute_path": None})
