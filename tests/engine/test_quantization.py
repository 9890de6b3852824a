"""Weight-only quantization (``--quantization int8|int4``, ``engine/quantization.py``).

Tiny random checkpoints of the four architectures load quantized and keep their logits near
float32's; each QuantizedLinear computes with the weight it dequantizes to, on its packed path
(up to ``PACKED_MAX_ROWS[method]`` rows) and its dequantize + GEMM path; the int4 CPU packing layout
the module learnt unpacks to the reference quantization; bad values and combinations fail in
one line.

Tolerances (``LOGIT_TOL``) are on the relative error of the logits, ``||Δ|| / ||ref||`` with
each row centred (softmax ignores a shift). Rounding a weight to a grid of step ``s`` leaves an
rms error of ``s / √12``: for these Gaussian-like weights about 0.9 % of the weight's spread at
int8 (``s = max|w| / 127``) and about 9 % at int4 (``s = (max - min) / 15`` per 32), and
bf16 rounds weights and activations to 8 bits of mantissa (0.2-0.4 %). Through two decoder
layers and the LM head the tiny models measured 0.6-1.0 % (bf16), 1.1-1.8 % (int8; 2.5 % on
mistral's four decode rows with bf16 activations) and 15-24 % (int4) on this prompt; the bounds
are about twice the largest. The floors (``LOGIT_FLOOR``)
catch a scheme that quietly did nothing (the float32 model again gives 0).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import transformers
from paged_driver import run_paged
from tiny_model import TINY_DECODER, perturbed_model, write_tiny_llama
from torch import nn

from tokenmill.engine import quantization
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.models.loader import load_model
from tokenmill.engine.quantization import (
    INT4_GROUP_SIZE,
    INT8_GROUP_SIZE,
    PACKED_MAX_ROWS,
    QuantizedLinear,
    _cpu_int4_block_n,
    quantize_int4,
    quantize_int8,
    weight_bytes_by_dtype,
)
from tokenmill.kernels import cpu as cpu_gemv

# every in_features (hidden 64, intermediate 96, heads x head_dim 64 or 128) divides by the int4
# group of 32; every out_features (vocab 128, qkv 128 or 256, gate_up 192) by CPU's row tile 16
TINY = dict(TINY_DECODER, vocab_size=128)
ARCHS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=6, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, attention_bias=True)),
}
# (activation dtype, quantization) -> relative logit error bounds (see the module docstring)
SCHEMES = {
    "bf16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "int8+bf16": ("bfloat16", "int8"),
}
LOGIT_TOL = {"bf16": 0.02, "int8": 0.035, "int4": 0.45, "int8+bf16": 0.05}
LOGIT_FLOOR = {"bf16": 1e-3, "int8": 3e-3, "int4": 5e-2, "int8+bf16": 3e-3}
PROMPT_LEN, DECODES = 40, 4  # a 40-row prefill (dequantize path), then 4 one-row decodes (packed)


def make_checkpoint(arch: str, path, **overrides) -> None:
    cls, extra = ARCHS[arch]
    perturbed_model(cls(**{**TINY, **overrides}, **extra)).save_pretrained(path)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    """``(arch, path, tokens, float32 logits, float32 weight bytes)`` of one architecture."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, TINY["vocab_size"], (PROMPT_LEN + DECODES,), generator=g).tolist()
    model = load_model(path, device="cpu", dtype="float32")
    (ref,) = run_paged(model, [seq], [PROMPT_LEN], chunk=10_000)
    return request.param, path, seq, ref, sum(weight_bytes_by_dtype(model).values())


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got - got.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_logits_stay_near_float32(tiny, scheme):
    arch, path, seq, ref, f32_bytes = tiny
    dtype, method = SCHEMES[scheme]
    model = load_model(path, device="cpu", dtype=dtype, quantization=method)
    layers = dict(model.named_modules())
    if method != "none":
        quantized = [n for n, m in layers.items() if isinstance(m, QuantizedLinear)]
        # qkv, o_proj, gate_up, down per layer, and the LM head (its own copy when tied)
        assert len(quantized) == 4 * TINY["num_hidden_layers"] + 1, quantized
        assert "lm_head" in quantized
        assert not [n for n, m in layers.items() if type(m) is nn.Linear]
        assert {layers[n].method for n in quantized} == {method}
        by_dtype = weight_bytes_by_dtype(model)
        assert by_dtype[method] > 0, by_dtype
        total = sum(by_dtype.values())
        # the quantized copies replace float weights; tied: the embedding stays, the head is new
        assert total < f32_bytes * (0.75 if dtype == "float32" else 0.5), (total, f32_bytes)
    (got,) = run_paged(model, [seq], [PROMPT_LEN], chunk=10_000)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    prefill, decode = slice(0, PROMPT_LEN), slice(PROMPT_LEN, None)
    for rows, name in ((prefill, "prefill"), (decode, "decode")):
        err = rel_error(got[rows], ref[rows])
        assert LOGIT_FLOOR[scheme] < err < LOGIT_TOL[scheme], f"{arch} {scheme} {name}: {err:.4f}"


def _random_linear(method: str, n: int, k: int, bias: bool = True) -> QuantizedLinear:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    return QuantizedLinear(method, w, b)


@pytest.fixture
def torch_kernels(monkeypatch):
    """int8 and int4 layers built for torch's packed CPU kernels, as on a CPU where the C
    kernels do not build (``int8_cpu_gemv``, ``int4_cpu_gemv`` False)."""
    monkeypatch.setattr(quantization, "int8_cpu_gemv", lambda: False)
    monkeypatch.setattr(quantization, "int4_cpu_gemv", lambda: False)


needs_kernels = pytest.mark.skipif(
    not cpu_gemv.available(), reason=f"CPU kernels: {cpu_gemv.unavailable_reason()}"
)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("n", [64, 96, 48])
@pytest.mark.parametrize("rows", [1, 5, "max", "max+1", 150])
def test_packed_and_dequantized_paths_agree(method, n, rows, torch_kernels):
    """Both paths compute with the weight ``dequantize()`` returns: the packed kernel (rows <=
    PACKED_MAX_ROWS[method] on CPU) rounds activations and scales to bf16, so it matches the float32 GEMM
    on that weight to bf16 precision; above the threshold the layer is that GEMM exactly.
    n=48 is not a multiple of int4's learnt 32-row block: that layer always runs packed.
    (torch's kernels, as without the C kernels: the C kernels' GEMV path is the next test's.)"""
    limit = PACKED_MAX_ROWS[method]
    rows = {"max": limit, "max+1": limit + 1}.get(rows, rows)
    layer = _random_linear(method, n, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    dense = nn.functional.linear(x, layer.dequantize(torch.float32), layer.bias)
    packed = layer._packed(x) + layer.bias
    got = layer(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    scale = dense.abs().max().item()
    assert (packed - dense).abs().max().item() <= 2e-2 * scale  # bf16 activations (8-bit)
    assert layer.gemv_scales is None
    if layer.path == "packed" or rows <= limit:
        torch.testing.assert_close(got, packed, atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    # int4's hybrid path needs whole blocks of torch's CPU layout: 32 rows on AVX2, 64 with
    # AVX-512 (the CI machines have either)
    block = _cpu_int4_block_n() if method == "int4" else None
    expected_path = "packed" if method == "int4" and (block is None or n % block) else "hybrid"
    assert layer.path == expected_path
    # leading dims pass through
    torch.testing.assert_close(layer(x.reshape(1, rows, 64))[0], got, atol=1e-6, rtol=0)


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("n", [48, 96])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 150])
def test_gemv_layer_computes_with_its_dequantized_weight(method, n, rows):
    """int8 and int4 on a CPU with the C kernels (path ``gemv``): up to 64 rows
    (INT8_GEMV_MAX_ROWS, INT4_GEMV_MAX_ROWS) the kernels' GEMV (int4: on the activations
    ``cpu.int4_act`` names, int8-rounded ones where the CPU has VNNI), above
    it a dequantize + the float32 GEMM; both on the weight ``dequantize()`` returns: int8 ``q *
    s`` with one float32 scale per 32 weights along K, int4 ``q * s + z8`` of ``quantize_int4``
    in the layout's bf16 scales."""
    g = torch.Generator().manual_seed(n + rows)
    w = torch.randn(n, 128, generator=g) * 0.05
    w[3, 32:64] += 2.0  # one group far from zero: int4's z8 matters
    b = torch.randn(n, generator=g) * 0.1
    layer = QuantizedLinear(method, w, b)
    assert layer.path == "gemv"
    if method == "int8":
        q, s = quantize_int8(w, INT8_GROUP_SIZE)
        assert s.shape == (n, 128 // INT8_GROUP_SIZE)
        ref_w = (q.float().reshape(n, -1, 32) * s[..., None]).reshape(n, 128)
        assert layer.gemv_scales.dtype == torch.float32
        torch.testing.assert_close(layer.gemv_scales, s, atol=0, rtol=0)
        # half a step of each group's own rounding grid; no bf16 rounding of the scales. The
        # offset group's large step does not reach the row's other groups
        bound = (s / 2).repeat_interleave(32, dim=1)
        assert ((ref_w - w).abs() <= bound + 1e-7).all()
        assert (ref_w - w)[3, :32].abs().max() < s[3, 1] / 8
    else:
        assert layer.qweight.shape == (n // 16, 4, 16, 16)
        q, s, z = quantize_int4(w, INT4_GROUP_SIZE)
        s16 = s.bfloat16().float()
        z8 = (z - 8 * s16).bfloat16().float()
        ref_w = (q.reshape(n, -1, 32) * s16[..., None] + z8[..., None]).reshape(n, 128)
        # within the rounding grid of w, plus bf16 rounding of s and z8 (2^-9 relative)
        bound = (s / 2 + (15 * s + z8.abs()) * 2**-8).repeat_interleave(32, dim=1)
        assert ((ref_w - w).abs() <= bound + 1e-6).all()
    torch.testing.assert_close(layer.dequantize(torch.float32), ref_w, atol=0, rtol=0)
    x = torch.randn(rows, 128, generator=g)
    got = layer(x)
    dense = nn.functional.linear(x.double(), ref_w.double(), b.double()).float()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    if method == "int4" and rows <= 64 and cpu_gemv.int4_act() == "int8":
        # the VNNI GEMV multiplies by x rounded to int8 per group of 32 (cpu.int4_act)
        dense = cpu_gemv.reference_gemv_int4(x, layer.qweight, layer.group_scales, b, act="int8")
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=2e-5)
    if rows <= 64:
        with pytest.raises(RuntimeError, match="no packed kernel"):
            layer._packed(x)


@needs_kernels
def test_int8_layer_off_the_group_keeps_one_scale_a_row():
    """An int8 layer whose in_features is not a multiple of 32 cannot take the C kernels'
    groups: it quantizes per row for torch's packed kernel, and still computes with the weight
    ``dequantize()`` returns."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 48, generator=g) * 0.05
    layer = QuantizedLinear("int8", w, None)
    assert layer.path == "hybrid" and layer.gemv_scales is None
    assert layer.scales.shape == (64,)
    x = torch.randn(3, 48, generator=g)
    dense = nn.functional.linear(x, layer.dequantize(torch.float32))
    assert (layer(x) - dense).abs().max().item() <= 2e-2 * dense.abs().max().item()


def test_quantize_int8_refuses_a_group_that_does_not_divide_k():
    with pytest.raises(ValueError, match="group size 32 does not divide in_features 48"):
        quantize_int8(torch.ones(4, 48), 32)


def test_int4_cpu_layout_unpacks_to_the_reference(torch_kernels):
    """``dequantize`` of the hybrid path reads torch's packed CPU bytes through the layout learnt
    at import (``_cpu_int4_block_n``); it must give ``(q - 8) * s + z`` of ``quantize_int4``.
    torch's CPU kernel packs 32 output rows a block on AVX2 machines and 64 with AVX-512: 192
    rows are whole blocks either way."""
    block = _cpu_int4_block_n()
    assert block in (32, 64), f"this torch packs int4 in another layout (block {block})"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(192, 128, generator=g) * 0.05
    w[5, :32] += 3.0  # one group with a large offset: its zero point matters
    q, s, z = quantize_int4(w, INT4_GROUP_SIZE)
    assert q.min() == 0 and q.max() == 15
    exact = ((q.reshape(192, -1, 32) - 8) * s[..., None] + z[..., None]).reshape(192, 128)
    assert (exact - w).abs().max() <= s.max() / 2 + 1e-6  # round-to-nearest on the grid
    # the layer keeps scales and zeros only in the kernel's bf16 table, and dequantizes from it
    s16, z16 = s.bfloat16().float(), z.bfloat16().float()
    ref = ((q.reshape(192, -1, 32) - 8) * s16[..., None] + z16[..., None]).reshape(192, 128)
    layer = QuantizedLinear("int4", w, None)
    assert layer.path == "hybrid" and layer.block_n == block
    torch.testing.assert_close(layer.dequantize(torch.float32), ref, atol=1e-6, rtol=0)
    # bf16 keeps 8 bits: each weight moves by at most (8 s + |z|) * 2^-9 (the offset group most)
    bound = ((8 * s + z.abs()) * 2**-8).repeat_interleave(32, dim=1)
    assert ((ref - exact).abs() <= bound).all()
    # the packed kernel computes with the same weight: identity rows read it back (bf16 table)
    eye = torch.eye(128, dtype=torch.bfloat16)
    torch.testing.assert_close(layer._packed(eye).t().float(), ref, atol=2e-2, rtol=1e-2)
    # and a layer that always runs packed (48 rows) dequantizes through the kernel the same way
    ref48 = ref[:48]  # row-wise scheme: the first 48 rows quantize alone to the same
    packed_only = QuantizedLinear("int4", w[:48], None)
    assert packed_only.path == "packed"
    torch.testing.assert_close(packed_only.dequantize(torch.float32), ref48, atol=2e-2, rtol=1e-2)


def test_int8_dequantize_is_per_channel_reference(torch_kernels):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4)) * 0.05
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    layer = QuantizedLinear("int8", w, None)
    # for torch's packed kernel both paths use its bf16-rounded scales (one weight for any
    # batch); the C kernels' path uses the float32 ones (the previous test)
    s_kernel = s.to(torch.bfloat16).float()
    assert not torch.equal(s_kernel, s)
    torch.testing.assert_close(layer.dequantize(torch.float32), q.float() * s_kernel[:, None])
    # half a step of rounding plus the scale's bf16 rounding (2^-9 relative) over |q| <= 127
    assert (layer.dequantize(torch.float32) - w).abs().max() <= s.max() * (0.5 + 127 / 512)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dummy_weights_load_quantized(tmp_path, method):
    make_checkpoint("qwen2", tmp_path)
    model = load_model(tmp_path, device="cpu", load_format="dummy", quantization=method)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert method in weight_bytes_by_dtype(model)
    (logits,) = run_paged(model, [list(range(1, 12))], [8], chunk=10_000)
    assert logits.shape == (11, TINY["vocab_size"]) and torch.isfinite(logits).all()


@pytest.mark.parametrize("layout", ["ours", "torch"])
def test_int4_refuses_shapes_its_kernels_cannot_take(tmp_path, monkeypatch, layout):
    """A vocabulary that is not a multiple of 16 (the row tile of both CPU layouts, the C
    kernels' and torch's) and an in_features that is not a multiple of the 32-group: one
    ModelLoadError line each, int8 still loads."""
    if layout == "torch":
        monkeypatch.setattr(quantization, "int4_cpu_gemv", lambda: False)
    make_checkpoint("llama", tmp_path / "vocab", vocab_size=97)
    with pytest.raises(ModelLoadError, match="out_features divisible by 16; a layer has 97"):
        load_model(tmp_path / "vocab", device="cpu", quantization="int4")
    load_model(tmp_path / "vocab", device="cpu", quantization="int8")
    make_checkpoint("llama", tmp_path / "hidden", hidden_size=48)
    with pytest.raises(ModelLoadError, match="in_features divisible by 32; a layer has 48"):
        load_model(tmp_path / "hidden", device="cpu", quantization="int4")


def test_config_validate_names_quantization():
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4"):
        EngineConfig(quantization="int3").validate()
    EngineConfig(quantization="int4").validate()


def test_float16_activations_with_int8_on_cpu_is_one_line(tmp_path):
    make_checkpoint("llama", tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path, device="cpu", dtype="float16", quantization="int8")
    assert "\n" not in str(info.value)
    assert "float16" in str(info.value) and "--dtype float32 or bfloat16" in str(info.value)
    with pytest.raises(ModelLoadError, match="unknown quantization 'fp8'"):
        load_model(tmp_path, device="cpu", quantization="fp8")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("•")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture
def tiny_cli_model(tmp_path, smollm2_dir):
    """A dummy-weight Llama folder with SmolLM2's tokenizer, for the CLI."""
    write_tiny_llama(tmp_path, vocab_size=49152, hidden_size=32, intermediate_size=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    return tmp_path


# what each command needs besides the model to get as far as loading it
COMMAND_ARGS = {
    "serve": lambda: ["--port", str(free_port()), "--no-trace-db"],
    "generate": lambda: ["--prompt", "x", "--max-tokens", "2"],
}


@pytest.mark.parametrize("command", list(COMMAND_ARGS))
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--quantization", "int3"], "quantization must be one of none, int8, int4"),
        # serve: caught in the engine core process at load, the lifespan's failure is the line
        (["--quantization", "int8", "--dtype", "float16", "--device", "cpu"], "not float16"),
    ],
    ids=["bad-value", "float16-int8-cpu"],
)
def test_quantization_errors_are_one_line(tiny_cli_model, command, args, needle):
    proc = cli(
        command,
        "--model",
        str(tiny_cli_model),
        "--load-format",
        "dummy",
        *COMMAND_ARGS[command](),
        *args,
    )
    assert needle in one_error_line(proc)


def test_int4_activations_is_checked_and_set_for_the_process(monkeypatch):
    """``--int4-activations``: a bad value is one line naming the knob; ``float32`` and
    ``int8`` set the process's CPU int4 GEMV (``cpu.int4_act``) for an int4 CPU model only;
    ``int8`` on a CPU without VNNI/VBMI is one line saying so."""
    import torch

    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.errors import ModelLoadError
    from tokenmill.engine.model_runner import set_int4_activations

    with pytest.raises(ValueError, match="int4_activations must be one of auto, int8, float32"):
        EngineConfig(int4_activations="int16").validate()
    cpu_dev = torch.device("cpu")
    assert set_int4_activations(EngineConfig(quantization="int8"), cpu_dev) is None
    if not cpu_gemv.available():
        pytest.skip(cpu_gemv.unavailable_reason())
    try:
        cfg = EngineConfig(quantization="int4", int4_activations="float32")
        assert set_int4_activations(cfg, cpu_dev) == "float32"
        x = torch.randn(1, 32)
        w = torch.randn(16, 32)
        layer = QuantizedLinear("int4", w, None)
        f32 = cpu_gemv.reference_gemv_int4(x, layer.qweight, layer.group_scales)
        assert torch.allclose(layer(x), f32, atol=1e-5, rtol=1e-5)  # float32 activations now
        monkeypatch.setattr(cpu_gemv, "int4_act", lambda use=None: "float32")
        cfg = EngineConfig(quantization="int4", int4_activations="int8")
        with pytest.raises(ModelLoadError, match="needs a CPU with AVX-512 VNNI and VBMI"):
            set_int4_activations(cfg, cpu_dev)
    finally:
        monkeypatch.undo()
        cpu_gemv.int4_act(None)
