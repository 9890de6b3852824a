"""int8 compute for the quantized layers' large steps (prefill chunks, decode batches above the
GEMV cut-over): each activation row rounded to int8 with its own scale (dynamic, per token),
times an int8 weight with one scale per output channel, summed exactly in int32.

The product is oneDNN's int8 GEMM inside torch (``torch._int_mm``; on the AMX path torch's
prepacked int8 linear, :func:`pack_weight`): oneDNN picks its kernel from the CPU at start (AMX
tiles, AVX-512 VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw``), and ``ONEDNN_MAX_CPU_ISA`` caps it
(``AVX2``, ``AVX512_CORE_VNNI``, ``AVX512_CORE_AMX``), which is how a host runs its slower
paths for comparison. :func:`gemm_isa` names the path that runs. Rounding the activations and
scaling the sums back are one C pass each (``kernels/cpu_int8_compute.c``) where the CPU
kernels build; the torch expressions below are their reference and fallback.

Where one rounding loses too much, activations go in as two int8 terms (``--int8-compute
on``): the row rounded to int8, then what that rounding left rounded again, both multiplied in
one GEMM and summed. One term everywhere (``--int8-compute fast``) is the fewest multiply-adds,
but on SmolLM2-135M its perplexity rose 3.97 points of float32's above the int8 weight-only
model's (``benchmarks/quantization_accuracy.py``, 2026-12-06): a row's largest activations set
its scale and the rest lose their low bits. Two terms everywhere gave 23.92 against the
weight-only 23.97 (float32 23.83); splitting the row into 2 or 4 groups along K with a scale
each gave 24.45 and 24.22, and cost more than the second term. ``on`` writes two terms only
in the layers where one rounding hurts most (:data:`TWO_TERM_LAYERS`).

One GEMM of a prefill chunk on SmolLM2-135M's MLP shape (512 × 576 × 1536, AMD EPYC with
AVX-512 VNNI, 2 threads, medians of 30): oneDNN's int8 took 0.11-0.13 of float32's time on the
VNNI path and 0.48 with ``ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import functools
import os

import torch

from tokenmill.kernels import cpu as cpu_kernels

#: --int8-compute: auto (on where the CPU has AVX-512 VNNI or AMX), on (activations as two int8
#: terms in the layers of TWO_TERM_LAYERS, one elsewhere), fast (one term everywhere), off
INT8_COMPUTE_MODES = ("auto", "on", "fast", "off")
#: int8 terms an activation row is written as, per mode (``on``: at most; see TWO_TERM_LAYERS)
TERMS = {"on": 2, "fast": 1, "off": 0}
#: with ``on``, the layers whose activations go in as two int8 terms (by name): all but the
#: MLP's gate/up projection, which takes one. Perplexity of SmolLM2-135M by the layers given
#: two terms (AMX host, 2026-12-06; float32 23.83): int8 weights (weight-only 23.97): all
#: 23.92, none 24.85, down 24.79, down and O 24.52, QKV 24.31, QKV and down 24.13, QKV, down and
#: LM head 24.04, all but gate/up 24.15; int4 weights (weight-only 25.39): all 25.62, QKV, down
#: and LM head 25.87 (2.01 points over its twin: the gate's 2), all but gate/up 25.71. The
#: gate/up projection is half of a token's multiply-adds, so ``on`` costs 1.5 one-term GEMMs
#: where two terms everywhere cost 2.
TWO_TERM_LAYERS = ("qkv_proj", "o_proj", "down_proj", "lm_head")


def layer_terms(name: str, terms: int) -> int:
    """The int8 terms the layer called ``name`` (its module path) writes its activations in
    under a mode of ``terms`` (:data:`TERMS`): 2 only for :data:`TWO_TERM_LAYERS`."""
    if terms < 2:
        return terms
    return 2 if name.rpartition(".")[2] in TWO_TERM_LAYERS else 1


#: the paths ``auto`` turns int8 compute on for: with AVX2's kernel, two terms ran a 500-token
#: prefill no faster than float32 (0.98x, benchmarks/int8_prefill.py, 2026-12-06), with
#: AVX-512 VNNI in 0.69x of its time
AUTO_PATHS = ("avx512_vnni", "amx")

# oneDNN's ISA caps, lowest first, and the path each allows at most
_CAPS = {
    "SSE41": None,
    "AVX": None,
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2_vnni",
    "AVX2_VNNI_2": "avx2_vnni",
    "AVX512_CORE": "avx2",  # AVX-512 without VNNI: oneDNN's int8 runs its AVX2-class kernel
    "AVX512_CORE_VNNI": "avx512_vnni",
    "AVX512_CORE_BF16": "avx512_vnni",
    "AVX512_CORE_FP16": "avx512_vnni",
    "AVX10_1_512": "avx512_vnni",
    "AVX512_CORE_AMX": "amx",
    "AVX512_CORE_AMX_FP16": "amx",
    "AVX10_1_512_AMX": "amx",
    "AVX10_1_512_AMX_FP16": "amx",
    "DEFAULT": "amx",
    "ALL": "amx",
}
_ORDER = (None, "avx2", "avx2_vnni", "avx512_vnni", "amx")


def isa_of_flags(flags: set[str], cap: str | None = None) -> str | None:
    """The int8 path a CPU with these ``/proc/cpuinfo`` flags runs, under oneDNN's ISA cap
    (``ONEDNN_MAX_CPU_ISA``): ``amx``, ``avx512_vnni``, ``avx2_vnni``, ``avx2`` or None."""
    if "amx_int8" in flags and "amx_tile" in flags:
        have = "amx"
    elif "avx512_vnni" in flags:
        have = "avx512_vnni"
    elif "avx_vnni" in flags:
        have = "avx2_vnni"
    elif "avx2" in flags:
        have = "avx2"
    else:
        have = None
    if cap:
        allowed = _CAPS.get(cap.strip().upper(), "amx")
        if _ORDER.index(allowed) < _ORDER.index(have):
            return allowed
    return have


@functools.cache
def gemm_isa() -> str | None:
    """This process's int8 path on the CPU (see :func:`isa_of_flags`); None on a CPU without
    one, or off x86."""
    return isa_of_flags(cpu_kernels.cpu_flags() or set(), os.environ.get("ONEDNN_MAX_CPU_ISA"))


@functools.cache
def _prepack_op() -> bool:
    """Whether torch has oneDNN's prepacked int8 linear (``onednn::qlinear_prepack`` and
    ``qlinear_pointwise``, what torch's x86 int8 inductor path calls)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.onednn, op) for op in ("qlinear_prepack", "qlinear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def pack_weight(qweight_kn: torch.Tensor) -> torch.Tensor:
    """The ``[K, N]`` int8 weight as the GEMM will read it: on the AMX path, reordered once,
    now, into oneDNN's blocked layout (torch's prepacked int8 linear; ``_int_mm`` reorders a
    plain weight on every call: a 500-row GEMM on SmolLM2-135M's MLP shape took 2.7x as long
    as the prepacked one, 2 threads); else the plain tensor. Either goes to
    :func:`int8_linear`. Only AMX: on the same host with oneDNN capped to AVX-512 VNNI the
    prepacked product fell to a reference kernel (6.3 s against ``_int_mm``'s 1.5 ms), and
    capped to AVX2 it was 14 % slower than ``_int_mm``."""
    if gemm_isa() != "amx" or not _prepack_op():
        return qweight_kn
    return torch.ops.onednn.qlinear_prepack(qweight_kn.t().contiguous(), None)


@functools.cache
def _unit_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n), torch.zeros(n, dtype=torch.int64)


def int8_gemm(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``q [M, K]`` int8 times the int8 weight (:func:`pack_weight`'s, either form): the exact
    sums, int32 (plain weight, ``torch._int_mm``) or float32 (prepacked: oneDNN writes
    ``float(sum)``, the same value the int32 sum converts to)."""
    if weight.is_mkldnn:
        ones, zeros = _unit_scales(weight.shape[1])
        return torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, weight, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
    return torch._int_mm(q, weight)


def prefill_attention_dtype(path: str | None) -> torch.dtype:
    """The dtype a whole prompt's attention multiplies in beside int8 compute on ``path``:
    bfloat16 with AMX (its tiles multiply bf16 too; torch's flash kernel keeps the softmax and
    the sums in float32), float32 elsewhere. On SmolLM2-135M one layer of a 500-token prompt
    took 1.4-1.7 ms in bf16 against 3.9-4.1 in float32 (AMX host, 2 threads, medians of 20), a
    third of the prefill once the GEMMs ran in int8. ``TOKENMILL_PREFILL_ATTENTION=float32``
    keeps float32 (an A/B of the two)."""
    if path == "amx" and os.environ.get("TOKENMILL_PREFILL_ATTENTION", "") != "float32":
        return torch.bfloat16
    return torch.float32


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` activations → ``([M, K]`` int8, ``[M, 1]`` float32 scales``)``: each row
    rounded with its own symmetric scale (its largest magnitude maps to 127)."""
    x = x.to(torch.float32)
    scales = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.round(x * scales.reciprocal()).to(torch.int8), scales


def int8_linear(
    x: torch.Tensor,
    qweight_kn: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    terms: int = 2,
) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` in int8 with int32 sums, returned in float32, ``W`` as
    ``quantize_int8`` (:mod:`tokenmill.engine.quantization`) left it, per
    output channel, transposed to ``[K, N]`` (plain or :func:`pack_weight`'s). With
    ``terms=1`` each row of ``x`` is rounded to int8 once (:func:`quantize_rows`); with 2 (the
    default) what that rounding left is rounded again and multiplied too (``x ≈ s1·q1 +
    s2·q2``: twice the multiply-adds, activations good to about 1 part in 30,000 of their
    row's largest, so the weight's rounding is what is left)."""
    x = x.to(torch.float32)
    if cpu_kernels.available() and x.stride(-1) == 1:
        # the C passes (kernels/cpu_int8_compute.c): both terms in one call, stacked, so one
        # GEMM multiplies them; the same arithmetic as the torch expressions below
        q, row_scales = cpu_kernels.int8_compute_quantize(x, terms)
        acc = int8_gemm(q, qweight_kn)
        b = None if bias is None else bias.to(torch.float32)
        return cpu_kernels.int8_compute_dequant(
            acc, row_scales, scales.to(torch.float32), b, terms, inplace=True
        )
    q, row_scales = quantize_rows(x)
    out = int8_gemm(q, qweight_kn).to(torch.float32).mul_(row_scales)
    if terms > 1:
        rest = x - q.to(torch.float32) * row_scales
        q2, row_scales2 = quantize_rows(rest)
        out.add_(int8_gemm(q2, qweight_kn).to(torch.float32).mul_(row_scales2))
    out.mul_(scales)
    if bias is not None:
        out = out.add_(bias.to(torch.float32))
    return out


def reference_int8_linear(
    x: torch.Tensor,
    qweight_kn: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    terms: int = 2,
) -> torch.Tensor:
    """:func:`int8_linear` in plain float64 arithmetic on the same rounded values (the tests'
    reference: the int32 sums are exact, so the two agree to float32 rounding)."""
    x = x.to(torch.float32)
    q, row_scales = quantize_rows(x)
    w = qweight_kn.to(torch.float64)
    out = (q.to(torch.float64) @ w) * row_scales.to(torch.float64)
    if terms > 1:
        q2, row_scales2 = quantize_rows(x - q.to(torch.float32) * row_scales)
        out = out + (q2.to(torch.float64) @ w) * row_scales2.to(torch.float64)
    out = out * scales.to(torch.float64)
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(torch.float32)
