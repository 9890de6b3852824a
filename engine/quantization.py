"""Weight-only quantization of the decoder's linear layers (``--quantization int8|int4``).

Decode is bandwidth-bound: a batch-1 step reads every weight once, so storing weights in fewer
bytes shortens the step in proportion (seed 003 §4.4). Prefill is compute-bound and gains
nothing; there a quantized layer dequantizes its weight and runs the dense GEMM.

Kernels: on a CPU where ``kernels/cpu_gemv.c`` builds, its int8 and int4 GEMVs take decode
rows (float32 activations; both beat torch's packed kernels, which are GEMV-shaped too, at
every row count up to 64 on the model's shapes) and a dequantize + dense GEMM takes prefill.
Elsewhere, torch's own packed weight-only matmuls, not torchao's: torchao's weight-only configs
dispatch to the same aten ops on CPU (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
and on CUDA (``_weight_int4pack_mm``, tinygemm), and calling them directly keeps a dependency
(and its torch-version pin) out of the engine. ``benchmarks/quantization.py`` measures each path.

Schemes (activations stay in the model dtype; torch's small-batch CPU kernels round them to
bf16, the dtype they take):

* ``int8``: symmetric, ``w ≈ q · s``, ``q ∈ [-127, 127]``, ``s = max|w|/127`` over a group of
  :data:`INT8_GROUP_SIZE` weights along the input dim where the C kernels run it (CPU), over a
  whole output row where torch's packed kernel does (CUDA; CPU without the C build).
* ``int4``: asymmetric groups of :data:`INT4_GROUP_SIZE` along the input dim (the tinygemm
  convention): ``w ≈ (q - 8) · s + z``, ``q ∈ [0, 15]``, ``s = (max - min)/15``,
  ``z = min + 8 s``.

Every linear layer of every decoder block is quantized, and the LM head too (a separate
quantized copy when tied: the input embedding stays in the model dtype, since a lookup reads
one row per token and is not on the bandwidth path).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tokenmill.kernels import cpu as cpu_gemv
from tokenmill.kernels.cutover import FASTER_ROWS

from . import int8_compute as int8_compute_mod
from .config import QUANTIZATIONS
from .errors import ModelLoadError

__all__ = [
    "QUANTIZATIONS",
    "QuantizedLinear",
    "int4_cpu_gemv",
    "int8_compute_bytes",
    "int8_cpu_gemv",
    "quantize_model",
    "weight_bytes_by_dtype",
]
# Input-dim group of the int4 scheme: the smallest torch's packed int4 kernels take (32, 64,
# 128, 256), so the most scales and the least error; with it the default model's perplexity
# rises 6.7% over float32 (benchmarks/RESULTS.md). Other sizes were not measured.
INT4_GROUP_SIZE = 32
# Input-dim group of int8 on CPU with the C kernels (kernels/cpu_gemv.c: INT8_GROUP): one
# float32 scale per 32 weights, an eighth more bytes than the int8 codes (see QuantizedLinear).
INT8_GROUP_SIZE = cpu_gemv.INT8_GROUP
# Rows (tokens) at or below which a quantized layer (CPU; CUDA int8) runs the packed kernel;
# above it the layer dequantizes its weight and runs the dense GEMM. The packed kernels are
# GEMV-shaped. Measured on the 2-core AVX2 machine, one 576x3072 layer, quiet: int8 packed
# 2.0 ms vs dequantize 0.9 + GEMM 1.3 ms at 32 rows, 3.9 vs 0.9 + 2.1 at 64; int4 (whose
# unpacking costs 3.1 ms) packed 2.9 vs 3.1 + 1.7 at 64 rows, 6.7 vs 3.1 + 3.5 at 128, 11.6 vs
# 3.1 + 6.0 at 256.
PACKED_MAX_ROWS = {"int8": 32, "int4": 128}
# rows up to which int8 on CPU runs kernels/cpu_gemv.c's int8 GEMV (its whole range): it beat
# torch's packed kernel at every size and the dequantize + GEMM far below 64 rows. One pass of
# SmolLM2-135M's 121 int8 layers, 2 threads, best of 3 (2026-12-01): 8 rows 28.8 ms vs packed
# 44.6 vs dequantize 198.3; 20 rows 87.6 / 108.3 / 267.7; 32 rows 145.4 / 179.6 / 287.9;
# 64 rows 311.3 / 332.7 / 367.3. (Until then the cut-over was the float32 one, 12 rows: a
# 20-token prefill chunk took 150 ms in the packed kernel.)
INT8_GEMV_MAX_ROWS = cpu_gemv.MAX_ROWS
# rows up to which int4 on CPU runs kernels/cpu_gemv.c's int4 GEMV (its whole range); above, its
# dequantize + the dense GEMM. One pass of SmolLM2-135M's 121 int4 layers (84 MB as stored),
# 2 threads, best of 6 (2026-12-02, Xeon AVX-512): 1 row 6.4 ms, 8 rows 15.1, 32 rows 62.0, 64
# rows 121 (int8's 134 MB in the same session: 9.6, 20.1, 95.1, and 64 rows ~200).
INT4_GEMV_MAX_ROWS = cpu_gemv.MAX_ROWS
# with int8 compute on, the rows up to which each method keeps its GEMV; above, the int8 GEMM.
# SmolLM2-135M's MLP (1536x576, 576x1536) and LM head (49152x576) shapes, AMD EPYC with
# AVX-512 VNNI, 2 threads, medians of 40 (2026-12-06, a test run beside it), GEMV time over the
# int8 GEMM's: int8 weights 1.1-1.3 at 8 rows, 1.6-2.1 at 12, 2.3-2.9 at 32, 3.0-3.6 at 64;
# int4 weights (half the bytes to stream) 0.3-0.65 at 8 rows, 0.7-1.07 at 32, 0.9-1.3 at 64
INT8_COMPUTE_GEMV_ROWS = {"int8": FASTER_ROWS, "int4": 32}
# Rows up to which a bf16 layer on a CPU without bf16 GEMM multiplies in bf16; above it the
# emulated bf16 GEMM loses to upcasting the weight and running float32 (one 576x3072 layer on
# the 2-core AVX2 machine: 0.22 vs 0.36 ms at 1 row, 0.94 vs 0.75 at 4, 5.9 vs 1.4 at 32).
HALF_GEMV_MAX_ROWS = 2


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a scheme or combination this device cannot run, in one line.

    Raises:
        ModelLoadError: unknown ``quantization``; int4 on CUDA without bfloat16 activations
            or on a GPU older than sm80 (tinygemm needs Ampere); float16 activations on CPU.
    """
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return
    if device.type == "cpu" and dtype == torch.float16:
        raise ModelLoadError(
            f"--quantization {quantization} on CPU runs with float32 or bfloat16 activations, "
            "not float16; use --dtype float32 or bfloat16"
        )
    if device.type == "cuda" and quantization == "int4":
        if dtype != torch.bfloat16:
            raise ModelLoadError(
                "--quantization int4 on CUDA needs --dtype bfloat16 (the tinygemm kernel's "
                f"activation dtype), not {str(dtype).removeprefix('torch.')}"
            )
        major, _ = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ModelLoadError(
                "--quantization int4 on CUDA needs an sm80+ GPU (Ampere or newer); "
                f"{torch.cuda.get_device_name(device)} is sm{major}x"
            )


def quantize_int8(
    weight: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per output row or per group of ``group_size`` along K.

    Args:
        weight: ``[N, K]`` float.
        group_size: None for one scale per row (torch's packed int8 kernels); else a divisor
            of ``K`` (the CPU kernels' :data:`INT8_GROUP_SIZE`).

    Returns:
        ``(q, scales)``: ``q`` ``[N, K]`` int8 in [-127, 127]; ``scales`` ``[N]`` float32 (per
        row, ``weight ≈ q * scales[:, None]``) or ``[N, K // group_size]`` (``weight[n, k] ≈
        q[n, k] * scales[n, k // group_size]``).

    Raises:
        ValueError: ``group_size`` does not divide ``K``.
    """
    n, k = weight.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"int8 group size {g} does not divide in_features {k}")
    w = weight.float().reshape(n, k // g, g)
    scales = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q, (scales[:, 0] if group_size is None else scales)


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group_size`` along the input dim.

    Args:
        weight: ``[N, K]`` float, ``K % group_size == 0``.

    Returns:
        ``(q, scales, zeros)``: ``q`` ``[N, K]`` int32 in [0, 15]; ``scales`` and ``zeros``
        ``[N, K // group_size]`` float32, so that ``weight ≈ (q - 8) * s + z`` per group.
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, lo + 8.0 * scales


def int8_cpu_gemv() -> bool:
    """Whether int8 layers on this CPU run the C kernels' GEMV (``kernels/cpu_gemv.c``; they
    build here) with float32 scales, else torch's packed int8 kernel with bf16 scales."""
    return cpu_gemv.available()


def int4_cpu_gemv() -> bool:
    """Whether int4 layers on this CPU use the C kernels' layout and GEMV
    (``kernels/cpu_gemv.c``; they build here), else torch's packed int4 kernel."""
    return cpu_gemv.available()


@functools.cache
def _cpu_int4_block_n() -> int | None:
    """The output-row block of torch's packed CPU int4 layout, learnt by packing a probe.

    The layout (this torch): ``[N/B, K, B/2]`` bytes, byte ``j`` of row ``k`` in block ``b``
    holding ``q[b·B + j, k]`` in its low nibble and ``q[b·B + B/2 + j, k]`` in its high one.
    None when the probe matches no block size (a torch that changed the layout): layers then
    always run the packed kernel.
    """
    n, k = 128, 32
    probe = ((torch.arange(n * k).reshape(n, k) + torch.arange(n)[:, None] // 16) % 16).to(
        torch.int32
    )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for block in (16, 32, 64):
        if n % block == 0 and torch.equal(_unpack_cpu_int4(packed, n, k, block), probe):
            return block
    return None


def _unpack_cpu_int4(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """``[N, K/2]`` uint8 in torch's CPU int4 layout → ``[N, K]`` int32 in [0, 15]."""
    tiles = packed.reshape(n // block, k, block // 2).to(torch.int32)
    rows = torch.cat([tiles & 15, tiles >> 4], dim=-1)  # [N/B, K, B]
    return rows.permute(0, 2, 1).reshape(n, k)


class QuantizedLinear(nn.Module):
    """A weight-only quantized ``nn.Linear``: ``[..., K]`` → ``[..., N]`` in the input dtype.

    Built by :meth:`from_linear` from a loaded float layer; keeps ``shards`` (the stacked
    projections' rows) so the module reads like the layer it replaced.

    Args:
        method: ``int8`` or ``int4``.
        weight: ``[N, K]`` float weight to quantize.
        bias: ``[N]`` or None, kept in its dtype.
    """

    def __init__(
        self,
        method: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        int8_compute: int = 0,
    ):
        super().__init__()
        self.method = method
        self.out_features, self.in_features = weight.shape
        self.device = weight.device
        self.act_dtype = weight.dtype
        k = weight.shape[1]
        self.group_size = INT4_GROUP_SIZE
        # "packed": the packed kernel at every size; "hybrid": packed up to PACKED_MAX_ROWS
        # rows, dequantize + dense GEMM above; "gemv" (CPU with the C kernels): the kernels'
        # int8/int4 GEMV up to 64 rows, a dequantize + dense GEMM above;
        # "dequant": always dequantize (shapes or devices the packed kernels do not take).
        self.path = "dequant"
        self.block_n: int | None = None
        # int8 on CPU with the C kernels: float32 scales, one per INT8_GROUP_SIZE weights along
        # K, which kernels/cpu_gemv.c multiplies by (up to INT8_GEMV_MAX_ROWS rows, float32
        # activations). torch's packed kernel takes one bf16 scale per row (and rounds
        # activations to bf16); rounding a row's scale to bf16 moves the whole row by up to
        # 2^-9: the default model's perplexity rose from +0.37% to +0.72% over float32
        # (benchmarks/quantization_accuracy.py, 2026-12-02). One float32 scale per row kept
        # float32's first 16 greedy tokens on 3 of 5 prompts (the misses near-ties in float32's
        # own logits); groups of 32, as llama.cpp's Q8_0, on 4 (2026-12-02)
        self.gemv_scales: torch.Tensor | None = None
        if method == "int8":
            grouped = self.device.type == "cpu" and int8_cpu_gemv() and k % INT8_GROUP_SIZE == 0
            q, scales = quantize_int8(weight, INT8_GROUP_SIZE if grouped else None)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)
            if grouped:
                # the C GEMV up to INT8_GEMV_MAX_ROWS rows, with the float32 group scales;
                # above, the dequantize + dense GEMM on the same weight
                self.gemv_scales = self.scales
                self.path = "gemv"
            elif self.device.type == "cpu":
                self.register_buffer("packed_scales", scales.to(torch.bfloat16))
                self.path = "hybrid"
            elif _cuda_int8_packed_ok(self.device):
                # torch's CUDA int8 kernel is GEMV-shaped too: on the H200 at 64 rows the
                # engine ran 953 output tok/s with it against 1,285 in bf16
                self.register_buffer("packed_scales", scales.to(weight.dtype))
                self.path = "hybrid"
        elif method == "int4":
            if k % self.group_size:
                raise ModelLoadError(
                    f"--quantization int4 needs in_features divisible by {self.group_size}; "
                    f"a layer has {k}"
                )
            # every int4 layout tiles the output rows (CPU: 16, ours and torch's; CUDA
            # tinygemm: 8); torch's otherwise fail with a bare RuntimeError, e.g. on an LM head
            # over 32001 tokens
            tile = 16 if self.device.type == "cpu" else 8
            if weight.shape[0] % tile:
                raise ModelLoadError(
                    f"--quantization int4 on {self.device.type} needs out_features divisible "
                    f"by {tile}; a layer has {weight.shape[0]}"
                )
            q, scales, zeros = quantize_int4(weight, self.group_size)
            if self.device.type == "cpu" and int4_cpu_gemv():
                # kernels/cpu_gemv.c's layout: its GEMV up to INT4_GEMV_MAX_ROWS rows, its
                # dequantize + the dense GEMM above
                qweight, group_scales = cpu_gemv.pack_int4(q, scales, zeros)
                self.register_buffer("qweight", qweight)
                self.register_buffer("group_scales", group_scales)
                self.path = "gemv"
            else:
                self._torch_int4(q, scales, zeros)
        else:
            raise ModelLoadError(f"unknown quantization {method!r}")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        # int8 compute (engine/int8_compute.py) above the small-row paths: a second copy of the
        # weight, int8 with one scale per output channel, [K, N] as the GEMM reads it; from the
        # float weight (int8), or from the int4 weight this layer computes with elsewhere
        self.register_buffer("int8_weight", None)
        self.register_buffer("int8_scales", None)
        self.int8_terms = int(int8_compute)
        if int8_compute and self.device.type == "cpu":
            source = weight if method == "int8" else self.dequantize(torch.float32)
            q8, s8 = quantize_int8(source)  # one scale per output channel
            # [K, N], prepacked for oneDNN's GEMM where torch can (int8_compute.pack_weight)
            self.register_buffer("int8_weight", int8_compute_mod.pack_weight(q8.t().contiguous()))
            self.register_buffer("int8_scales", s8)

    def _torch_int4(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """int4 in torch's packed layouts: CPU without the C kernels, and CUDA (tinygemm)."""
        n, k = self.out_features, self.in_features
        # tinygemm's [K/G, N, 2] (scale, zero) table, in the kernel's activation dtype
        table = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
        if self.device.type == "cpu":
            self.register_buffer(
                "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            )
            self.register_buffer("scales_and_zeros", table.to(torch.bfloat16))
            self.block_n = _cpu_int4_block_n()
            if self.block_n is not None and n % self.block_n == 0:
                self.path = "hybrid"
            else:
                self.path = "packed"
        else:
            nibbles = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8)
            inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
            self.register_buffer(
                "qweight", torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)
            )
            self.register_buffer("scales_and_zeros", table.to(torch.bfloat16))
            self.path = "packed"

    @classmethod
    def from_linear(cls, method: str, linear: nn.Linear, int8_compute: int = 0) -> QuantizedLinear:
        """Quantize a loaded ``nn.Linear`` (its float weight is not kept)."""
        module = cls(method, linear.weight.detach(), linear.bias, int8_compute)
        if hasattr(linear, "shards"):
            module.shards = linear.shards
        return module

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``[N, K]`` weight this layer computes with, in ``dtype`` (default: activations')."""
        dtype = dtype or self.act_dtype
        n, k = self.out_features, self.in_features
        if self.method == "int8":
            # the scales the small-row kernel multiplies by (torch's packed kernel: rounded to
            # bf16; the C GEMV: float32): both paths compute with one weight, so a row's result
            # does not depend on the batch it ran in
            scales = getattr(self, "packed_scales", self.scales).to(torch.float32)
            if scales.dim() == 2:  # per group along K
                q = self.qweight.to(torch.float32).reshape(n, scales.shape[1], -1)
                return (q * scales[..., None]).reshape(n, k).to(dtype)
            return (self.qweight.to(torch.float32) * scales[:, None]).to(dtype)
        if self.path == "gemv":
            return cpu_gemv.dequantize_int4(self.qweight, self.group_scales).to(dtype)
        if self.path != "hybrid":
            eye = torch.eye(k, dtype=torch.bfloat16, device=self.qweight.device)
            return self._packed(eye).t().to(dtype)
        q = _unpack_cpu_int4(self.qweight, n, k, self.block_n).reshape(n, -1, self.group_size)
        table = self.scales_and_zeros.to(torch.float32)  # [K/G, N, 2], what the kernel uses
        scales, zeros = table[..., 0].t(), table[..., 1].t()  # [N, K/G]
        w = (q - 8).to(torch.float32) * scales[..., None] + zeros[..., None]
        return w.reshape(n, k).to(dtype)

    def _packed(self, x2d: torch.Tensor) -> torch.Tensor:
        """The packed kernel on ``[M, K]`` activations (cast to its dtype) → ``[M, N]``.

        Raises:
            RuntimeError: a layer on the C kernels' GEMV (``path == "gemv"``).
        """
        if self.path == "gemv":
            raise RuntimeError("a layer on the CPU kernels' GEMV has no packed kernel")
        if self.method == "int8":
            x = x2d.to(self.packed_scales.dtype)
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.packed_scales)
        x = x2d.to(torch.bfloat16)
        if self.qweight.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.qweight, self.group_size, self.scales_and_zeros
            )
        return torch.ops.aten._weight_int4pack_mm(
            x, self.qweight, self.group_size, self.scales_and_zeros
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        rows = x2d.shape[0]
        if self.int8_weight is not None and rows > INT8_COMPUTE_GEMV_ROWS[self.method]:
            out = int8_compute_mod.int8_linear(
                x2d, self.int8_weight, self.int8_scales, self.bias, self.int8_terms
            )
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.gemv_scales is not None and rows <= INT8_GEMV_MAX_ROWS:
            out = cpu_gemv.gemv_int8(x2d.float(), self.qweight, self.gemv_scales).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        elif self.path == "gemv" and rows <= INT4_GEMV_MAX_ROWS:
            out = cpu_gemv.gemv_int4(x2d.float(), self.qweight, self.group_scales).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        elif self.path == "packed" or (
            self.path == "hybrid" and rows <= PACKED_MAX_ROWS[self.method]
        ):
            out = self._packed(x2d).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = dense_linear(x2d, self.dequantize(_gemm_dtype(x)), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        int8 = f", int8_compute x{self.int8_terms}" if self.int8_weight is not None else ""
        return f"{self.in_features}, {self.out_features}, {self.method}, path={self.path}{int8}"


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a dense GEMM on ``x``'s device runs fast in: float32 on a CPU without native
    bf16/fp16 GEMM (oneDNN's check), else ``x``'s dtype."""
    if x.device.type == "cpu" and x.dtype != torch.float32 and not cpu_has_bf16_gemm():
        return torch.float32
    return x.dtype


@functools.cache
def cpu_has_bf16_gemm() -> bool:
    """oneDNN runs bf16 GEMMs natively here (AVX512-BF16/AMX class CPUs). Without it, torch's
    bf16 GEMM is emulated: on the 2-core AVX2 machine 7x slower than float32 at 256 rows."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias)`` computed in ``weight``'s dtype, returned in
    ``x``'s (the upcast path of half-precision layers on a CPU without bf16 GEMM)."""
    if weight.dtype == x.dtype:
        return nn.functional.linear(x, weight, bias)
    b = None if bias is None else bias.to(weight.dtype)
    return nn.functional.linear(x.to(weight.dtype), weight, b).to(x.dtype)


class HalfPrecisionLinear(nn.Module):
    """A bf16/fp16 ``nn.Linear`` for a CPU without native half-precision GEMM: up to
    :data:`HALF_GEMV_MAX_ROWS` rows it multiplies in the weight's dtype (half the bytes to read,
    which is what a decode step is bound by); above, it upcasts the weight and runs the float32
    GEMM (prefill is compute-bound and the emulated bf16 GEMM is several times slower).

    Shares the wrapped layer's weight (a tied LM head stays tied). ``[..., K]`` → ``[..., N]``.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if hasattr(linear, "shards"):
            self.shards = linear.shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] <= HALF_GEMV_MAX_ROWS:
            out = nn.functional.linear(x2d, self.weight, self.bias)
        else:
            out = dense_linear(x2d, self.weight.float(), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


@functools.cache
def _cuda_int8_packed_ok(device: torch.device) -> bool:
    """Whether this torch has a CUDA ``_weight_int8pack_mm`` (else int8 dequantizes)."""
    try:
        a = torch.ones(2, 64, dtype=torch.bfloat16, device=device)
        w = torch.ones(64, 64, dtype=torch.int8, device=device)
        s = torch.ones(64, dtype=torch.bfloat16, device=device)
        torch.ops.aten._weight_int8pack_mm(a, w, s)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def resolve_int8_compute(mode: str, device: torch.device) -> int:
    """``--int8-compute`` on this device as the int8 terms an activation row is written in
    (:data:`tokenmill.engine.int8_compute.TERMS`; 0: off): ``auto`` is ``on`` where the CPU's
    int8 path (:func:`tokenmill.engine.int8_compute.gemm_isa`) is one of
    :data:`~tokenmill.engine.int8_compute.AUTO_PATHS` (AVX-512 VNNI, AMX), else off.

    Raises:
        ModelLoadError: ``on`` or ``fast`` where there is no int8 path (not a CPU, or no AVX2).
    """
    if mode == "off":
        return 0
    path = int8_compute_mod.gemm_isa() if device.type == "cpu" else None
    if mode == "auto":
        return int8_compute_mod.TERMS["on"] if path in int8_compute_mod.AUTO_PATHS else 0
    have = path is not None
    if not have:
        raise ModelLoadError(
            f"--int8-compute {mode} needs a CPU with AVX2, AVX-512 VNNI or AMX (oneDNN's int8 "
            "GEMM); use auto or off"
        )
    return int8_compute_mod.TERMS[mode]


def int8_compute_path(model: nn.Module) -> str | None:
    """The int8 path the model's quantized layers run their large steps on (``amx``,
    ``avx512_vnni``, ``avx2_vnni``, ``avx2``), or None when they do not."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.int8_weight is not None:
            return int8_compute_mod.gemm_isa()
    return None


def quantize_model(model: nn.Module, method: str, int8_compute: int = 0) -> int:
    """Replace every ``nn.Linear`` under ``model`` (decoder blocks and LM head) with a
    :class:`QuantizedLinear` in place; a tied LM head gets its own quantized copy. With
    ``none``, a half-precision model on a CPU without native bf16 GEMM gets
    :class:`HalfPrecisionLinear` layers instead.

    Args:
        int8_compute: also give each layer its int8 GEMM path, with activations in up to this
            many int8 terms (:class:`QuantizedLinear`; 0: none; 2 only in the layers of
            :data:`tokenmill.engine.int8_compute.TWO_TERM_LAYERS`).

    Returns:
        The number of layers replaced.

    Raises:
        ModelLoadError: a layer shape the scheme cannot take.
    """
    if method == "none":
        return _wrap_half_precision(model)
    targets = [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        terms = int8_compute_mod.layer_terms(name, int8_compute)
        with torch.no_grad():
            setattr(parent, attr, QuantizedLinear.from_linear(method, module, terms))
    return len(targets)


def _wrap_half_precision(model: nn.Module) -> int:
    """On a CPU without native bf16/fp16 GEMM, wrap half-precision linears in
    :class:`HalfPrecisionLinear`; returns how many were wrapped (0 elsewhere)."""
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype == torch.float32 or cpu_has_bf16_gemm():
        return 0
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, HalfPrecisionLinear(module))
    return len(targets)


def int8_compute_bytes(model: nn.Module) -> int:
    """Bytes of the quantized layers' int8 compute copies (weights and scales), 0 without."""
    return sum(
        t.numel() * t.element_size()
        for n, t in model.named_buffers()
        if n.endswith(("int8_weight", "int8_scales"))
    )


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights (parameters and weight buffers, each tensor counted once)
    by storage dtype, e.g. ``{"int8": 103_000_000, "float32": 28_400_000}``; int4 weights are
    stored two per byte in ``uint8`` and reported as ``int4``, their (scale, zero) words as
    ``bfloat16``. The int8 compute copies (what a decode step never reads) are left out:
    :func:`int8_compute_bytes`."""
    seen: set[int] = set()
    totals: dict[str, int] = {}
    skip = ("inv_freq", "cos_sin_cache", "int8_weight", "int8_scales")
    tensors = [(n, t) for n, t in model.named_parameters()] + [
        (n, t) for n, t in model.named_buffers() if not n.endswith(skip)
    ]
    for name, t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        key = str(t.dtype).removeprefix("torch.")
        if name.endswith("qweight") and t.dtype in (torch.uint8, torch.int32):
            key = "int4"
        elif name.endswith("group_scales"):  # int4's (scale, zero) words: two bf16 each
            key = "bfloat16"
        totals[key] = totals.get(key, 0) + t.numel() * t.element_size()
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
