"""The CPU kernels for small decode steps, in C, and their torch bindings.

A decode step on a CPU at small batch is bound by two things torch does not do well there
(``benchmarks/RESULTS.md``, "A small step against its floor"):

- **matrix-vector products** (``cpu_gemv.c``): it reads every weight once, so it should run at
  the memory's read bandwidth; torch's GEMV (MKL) on one row read 10.7-13.6 GB/s on this
  project's 2-core VM against a 24.9-29.6 GB/s ``torch.sum`` probe. :func:`gemv` (float32) and
  :func:`gemv_int8` (weight-only int8) stream each row of ``W`` once for all rows of ``x`` with
  AVX2 FMA on the OpenMP threads torch uses; :func:`gemv_int4` (weight-only int4, groups of
  32) reads half int8's bytes and looks each weight up in its group's 16 dequantized values.
- **decode attention** (``cpu_attention.c``): :func:`decode_attention` stores one new token's
  K/V per sequence and attends it over the paged cache in one call, instead of the gathers,
  SDPA and copies around it (~15 aten calls a layer).
- **element-wise ops** (``cpu_ops.c``): RMSNorm, the residual add, RoPE and SwiGLU cost 4-10
  aten calls each in torch, ~3 µs of dispatch apiece here, more than their arithmetic.
  :class:`CpuOps` runs each as one C call, with :class:`tokenmill.engine.models.ops.TorchOps`'
  interface.

The C files are compiled together at first use with the system C compiler (``cc``, ``-O3
-mavx2 -mfma -fopenmp``) into ``~/.cache/tokenmill/kernels/`` (keyed by the sources' hash) and
loaded with :mod:`ctypes`: no torch headers, no build step at install. Where the CPU lacks
AVX2/FMA, there is no compiler, or the build fails, :func:`available` is False (the reason in
:func:`unavailable_reason`) and callers keep torch's ops. ``TOKENMILL_CPU_KERNELS=0`` turns them
off; ``TOKENMILL_INT8_ISA=avx2|avx512`` picks the int8 loop (:func:`int8_isa`) and
``TOKENMILL_GEMV_PREFETCH=BYTES`` the GEMVs' prefetch distance (:func:`prefetch_ahead`).

Imports torch only (no triton), like :mod:`.reference`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import reference
from .cutover import FASTER_ROWS

__all__ = [
    "FASTER_ROWS",
    "MAX_ROWS",
    "CpuOps",
    "available",
    "cpu_flags",
    "decode_attention",
    "dequantize_int4",
    "gemv",
    "gemv_int4",
    "gemv_int8",
    "int4_act",
    "int8_compute_dequant",
    "int8_compute_quantize",
    "int8_isa",
    "pack_int4",
    "prefetch_ahead",
    "quantize_act_int8",
    "reference_gemv",
    "reference_gemv_int4",
    "reference_gemv_int8",
    "unavailable_reason",
    "unpack_int4",
]

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_gemv.c",
        "cpu_ops.c",
        "cpu_attention.c",
        "cpu_decode_step.c",
        "cpu_int8_compute.c",
    )
]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
# GEMV_MAX_ROWS in cpu_gemv.c
MAX_ROWS = 64
# INT4_GROUP in cpu_gemv.c: weights along k sharing one int4 scale and zero; INT4_ROWS (NB
# there): output rows per block of the int4 layout; INT8_GROUP: weights along k sharing one
# int8 scale
INT4_GROUP = 32
INT8_GROUP = 32
INT4_ROWS = 16

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill" / "kernels"


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty off x86 Linux's format), None when
    the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def _cpu_ok() -> str | None:
    words = cpu_flags()
    if words is None:
        return "cannot read /proc/cpuinfo"
    missing = [f for f in ("avx2", "fma") if f not in words]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _build() -> ctypes.CDLL:
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if not out.is_file():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise OSError("no C compiler (cc/gcc) on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target and rename: two processes starting together never load a
        # half-written library
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
            part = Path(tmp.name)
        try:
            proc = subprocess.run(
                [cc, *FLAGS, *map(str, SOURCES), "-o", str(part), "-lm"],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise OSError(f"{cc} failed: {proc.stderr.strip().splitlines()[-1:]}")
            part.replace(out)
        finally:
            part.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(out))
    fn = lib.tokenmill_gemv_f32
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    for fn in (lib.tokenmill_gemv_i8, lib.tokenmill_gemv_i4):
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    nth = ctypes.c_int
    lib.tokenmill_rms_norm_mt.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, f32, nth]
    lib.tokenmill_fused_add_rms_norm_mt.argtypes = [ptr] * 5 + [i64, i64, f32, nth]
    lib.tokenmill_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
    lib.tokenmill_silu_and_mul_mt.argtypes = [ptr, ptr, i64, i64, nth]
    for fn in (lib.tokenmill_decode_attention, lib.tokenmill_decode_attention_bf16):
        fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64]
        fn.argtypes += [ptr, i64, i64, i64, i64, i64, f32, i64, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
    # the model table is a struct (kernels/cpu_step.py) passed by reference
    lib.tokenmill_decode_step_scratch.argtypes = [ptr, i64]
    lib.tokenmill_decode_step_scratch.restype = i64
    lib.tokenmill_decode_step.argtypes = [ptr] * 6 + [i64, ptr, i64, ptr, ctypes.c_int]
    lib.tokenmill_decode_step.restype = ctypes.c_int
    lib.tokenmill_dequant_i4.argtypes = [ptr] * 3 + [i64, i64, ctypes.c_int]
    lib.tokenmill_dequant_i4.restype = ctypes.c_int
    lib.tokenmill_gemv_prefetch.argtypes = [ctypes.c_int64]
    lib.tokenmill_gemv_prefetch.restype = ctypes.c_int64
    lib.tokenmill_gemv_i8_isa.argtypes = [ctypes.c_int]
    lib.tokenmill_gemv_i8_isa.restype = ctypes.c_int
    lib.tokenmill_gemv_i4_act.argtypes = [ctypes.c_int]
    lib.tokenmill_gemv_i4_act.restype = ctypes.c_int
    lib.tokenmill_i8c_quantize.argtypes = [ptr, i64, ptr, ptr, i64, i64, nth, nth]
    for name in ("i8c_dequant", "i8c_dequant_f32"):
        getattr(lib, f"tokenmill_{name}").argtypes = [ptr] * 5 + [i64, i64, nth, nth]
    for name in ("i8c_quantize", "i8c_dequant", "i8c_dequant_f32"):
        getattr(lib, f"tokenmill_{name}").restype = None
    for name in ("rms_norm_mt", "fused_add_rms_norm_mt", "rotary", "silu_and_mul_mt"):
        getattr(lib, f"tokenmill_{name}").restype = None
    if lib.tokenmill_gemv_max_rows() != MAX_ROWS:
        raise OSError("cpu_gemv.c and cpu.py disagree on the row limit")
    if (lib.tokenmill_gemv_int4_group(), lib.tokenmill_gemv_int4_rows()) != (INT4_GROUP, INT4_ROWS):
        raise OSError("cpu_gemv.c and cpu.py disagree on the int4 group")
    if lib.tokenmill_gemv_int8_group() != INT8_GROUP:
        raise OSError("cpu_gemv.c and cpu.py disagree on the int8 group")
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _reason, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
            _reason = "turned off (TOKENMILL_CPU_KERNELS=0)"
        else:
            _reason = _cpu_ok()
        if _reason is None:
            try:
                _lib = _build()
            except OSError as exc:
                _reason = f"build failed: {exc}"
        isa = os.environ.get("TOKENMILL_INT8_ISA")
        if _lib is not None and isa in INT8_ISAS:  # an A/B of the int8 loops (int8_isa)
            _lib.tokenmill_gemv_i8_isa(INT8_ISAS.index(isa))
        act = os.environ.get("TOKENMILL_INT4_ACT")
        if _lib is not None and act in INT4_ACTS:  # an A/B of int4's activations (int4_act)
            _lib.tokenmill_gemv_i4_act(INT4_ACTS.index(act))
        ahead = os.environ.get("TOKENMILL_GEMV_PREFETCH", "")
        if _lib is not None and ahead.isdigit():  # an A/B of the prefetch (prefetch_ahead)
            _lib.tokenmill_gemv_prefetch(int(ahead))
        if _reason is not None:
            log.info("CPU kernels not used: %s (torch's ops instead)", _reason)
    return _lib


def _loaded_or_raise() -> ctypes.CDLL:
    """The loaded kernels; RuntimeError naming why where they are not :func:`available`."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {_reason}")
    return lib


def available() -> bool:
    """Whether the kernels run here (builds them on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False; None when it is True."""
    _load()
    return _reason


INT8_ISAS = ("avx2", "avx512")


def int8_isa(use: str | None = None) -> str:
    """The loop :func:`gemv_int8` and :func:`gemv_int4` (and the decode step's int8/int4
    layers) run: ``avx512`` where the CPU has AVX512F and AVX512BW, else ``avx2``. ``use`` sets it for this process (``avx2``
    or ``avx512``; None: the CPU's best), for A/B benchmarks and for tests of both loops; the
    AVX-512 loop widens 16 weights per instruction instead of 8 (``cpu_gemv.c``). Returns the
    loop in use afterwards: asking for ``avx512`` on a CPU without it gives ``avx2``.

    Raises:
        RuntimeError: the kernels are not :func:`available`.
        ValueError: ``use`` is not one of :data:`INT8_ISAS` or None.
    """
    lib = _loaded_or_raise()
    if use is not None and use not in INT8_ISAS:
        raise ValueError(f"use must be one of {INT8_ISAS} or None, got {use!r}")
    return INT8_ISAS[lib.tokenmill_gemv_i8_isa(-1 if use is None else INT8_ISAS.index(use))]


INT4_ACTS = ("float32", "int8")


def int4_act(use: str | None = None) -> str:
    """The activations :func:`gemv_int4` (and the decode step's int4 layers) multiply by:
    ``int8`` where the CPU has AVX-512 VNNI and VBMI (each row of x quantized per group of 32,
    ``max|x| / 127`` a group, and every group's product with the codes exact in int32:
    llama.cpp's Q4 x Q8 arithmetic, so a pass costs about what reading the weights costs),
    else ``float32``. ``use`` sets it for this process (``float32`` or ``int8``; None: the
    CPU's best), for A/B benchmarks and tests of both; ``TOKENMILL_INT4_ACT`` at load. Returns
    the mode in use afterwards: ``int8`` on a CPU without VNNI/VBMI gives ``float32``.

    Raises:
        RuntimeError: the kernels are not :func:`available`.
        ValueError: ``use`` is not one of :data:`INT4_ACTS` or None.
    """
    lib = _loaded_or_raise()
    if use is not None and use not in INT4_ACTS:
        raise ValueError(f"use must be one of {INT4_ACTS} or None, got {use!r}")
    return INT4_ACTS[lib.tokenmill_gemv_i4_act(-1 if use is None else INT4_ACTS.index(use))]


def quantize_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float32 → ``(xq [M, K] int8, dx [M, K/32] float32)``, as :func:`gemv_int4`
    quantizes its activations in ``int8`` mode: per group of 32, ``dx = max|x| / 127`` and
    ``xq = round-half-even(x * (127 / max|x|))`` in float32 (an all-zero group: 0 and 0)."""
    m, k = x.shape
    xg = x.float().reshape(m, k // INT4_GROUP, INT4_GROUP)
    amax = xg.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).to(torch.int8).reshape(m, k)
    return xq, amax / torch.tensor(127.0)


def int8_compute_quantize(x: torch.Tensor, terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 compute's activations in one pass (``cpu_int8_compute.c``): ``x [M, K]`` float32
    (rows may be strided) → ``(q [terms·M, K]`` int8, ``s [terms·M]`` float32``)``, rows
    ``0..M-1`` each row of ``x`` rounded with its own scale, rows ``M..2M-1`` (``terms=2``)
    what that rounding left, rounded again; bit-identical to
    :func:`tokenmill.engine.int8_compute.quantize_rows` applied term by term.

    Raises:
        RuntimeError: the kernels are not :func:`available`.
        ValueError: ``x`` is not a float32 CPU matrix with unit column stride, or ``terms`` is
            not 1 or 2.
    """
    lib = _loaded_or_raise()
    _require_f32(x=x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit column stride, got {tuple(x.shape)}")
    if terms not in (1, 2):
        raise ValueError(f"terms must be 1 or 2, got {terms}")
    m, k = x.shape
    q = torch.empty((terms * m, k), dtype=torch.int8)
    s = torch.empty(terms * m, dtype=torch.float32)
    lib.tokenmill_i8c_quantize(
        x.data_ptr(), x.stride(0), q.data_ptr(), s.data_ptr(), m, k, terms,
        torch.get_num_threads(),
    )  # fmt: skip
    return q, s


def int8_compute_dequant(
    acc: torch.Tensor,
    s: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    terms: int,
    inplace: bool = False,
) -> torch.Tensor:
    """The sums of :func:`int8_compute_quantize`'s rows times an int8 weight back to float32 in
    one pass: ``acc [terms·M, N]`` (int32, or float32 holding the same sums) →
    ``(Σ_t acc_t · s_t) · col_scales (+ bias)`` ``[M, N]``, bit-identical to the same torch
    expression; with ``inplace`` written over ``acc``'s first ``M`` rows (returned as a view).

    Raises:
        RuntimeError: the kernels are not :func:`available`.
        ValueError: shapes or dtypes that do not fit together.
    """
    lib = _loaded_or_raise()
    _require_f32(s=s, col_scales=col_scales, bias=bias)
    rows, n = acc.shape
    kinds = {torch.int32: lib.tokenmill_i8c_dequant, torch.float32: lib.tokenmill_i8c_dequant_f32}
    if acc.dtype not in kinds or terms not in (1, 2) or rows % terms or s.numel() != rows:
        raise ValueError(
            f"acc must be int32 or float32 [terms·M, N] with s [terms·M], got {acc.dtype} "
            f"{tuple(acc.shape)}, s {tuple(s.shape)}, terms {terms}"
        )
    if col_scales.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"col_scales and bias must have {n} values")
    acc, s, col_scales = acc.contiguous(), s.contiguous(), col_scales.contiguous()
    bias = bias.contiguous() if bias is not None else None
    m = rows // terms
    # in place, over the first M rows of acc: element j of a row is read before it is written,
    # and the output needs no fresh pages (an int32 acc is reinterpreted, same width)
    out = acc.view(torch.float32)[:m] if inplace else torch.empty((m, n), dtype=torch.float32)
    kinds[acc.dtype](
        acc.data_ptr(), s.data_ptr(), col_scales.data_ptr(), _ptr(bias), out.data_ptr(),
        m, n, terms, torch.get_num_threads(),
    )  # fmt: skip
    return out


def prefetch_ahead(nbytes: int | None = None) -> int:
    """How far ahead of the row being read the GEMVs prefetch a row's weights (bytes; 0 =
    off, the hardware prefetcher alone). ``nbytes`` sets it for this process (A/B benchmarks;
    ``TOKENMILL_GEMV_PREFETCH`` at load); returns the distance in use. Default 2,048: the
    hardware prefetcher alone kept too few lines in flight while the core widened int8 and
    multiplied (``cpu_gemv.c``: PREFETCH_AHEAD).

    Raises:
        RuntimeError: the kernels are not :func:`available`.
        ValueError: a negative distance.
    """
    lib = _loaded_or_raise()
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"nbytes must be 0 or more, got {nbytes}")
    return int(lib.tokenmill_gemv_prefetch(-1 if nbytes is None else nbytes))


def _require_f32(**tensors: torch.Tensor | None) -> None:
    """Raises ValueError naming the first tensor given that is not float32 on the CPU."""
    for name, t in tensors.items():
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} must be float32 on the CPU, got {t.dtype} on {t.device}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _run_gemv(kernel, x: torch.Tensor, bias: torch.Tensor | None, n: int, *weight: torch.Tensor):
    """Run one of the C GEMVs, ``kernel(weight..., x, bias, y, N, K, M, threads)``, on
    contiguous copies of its inputs where they are not; returns ``y [M, N]`` float32."""
    m, k = x.shape
    weight = tuple(w.contiguous() for w in weight)
    x = x.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty((m, n), dtype=torch.float32)
    kernel(
        *(w.data_ptr() for w in weight),
        x.data_ptr(),
        _ptr(bias),
        y.data_ptr(),
        n,
        k,
        m,
        torch.get_num_threads(),
    )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` float32 (``1 <= M <= MAX_ROWS``), ``weight [N, K]`` float32, ``bias [N]``
    → ``x @ weight.T + bias`` ``[M, N]`` float32, all on the CPU, on ``torch.get_num_threads()``
    threads. Inputs are made contiguous if they are not.

    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: a dtype, device, row count or shape the kernel does not take.
    """
    lib = _loaded_or_raise()
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    _require_f32(x=x, weight=weight, bias=bias)
    return _run_gemv(lib.tokenmill_gemv_f32, x, bias, n, weight)


def gemv_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8: ``x [M, K]`` float32 (``1 <= M <= MAX_ROWS``), ``qweight [N, K]``
    int8, ``scales [N, K / INT8_GROUP]`` float32 (``w = q * s`` per group of :data:`INT8_GROUP`
    along K, :func:`tokenmill.engine.quantization.quantize_int8`), ``bias [N]`` float32 →
    ``[M, N]`` float32 = ``x @ w.T + bias``.

    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: a dtype, device, row count or shape the kernel does not take.
    """
    lib = _loaded_or_raise()
    m, k = x.shape
    n = qweight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv_int8 takes 1..{MAX_ROWS} rows, got {m}")
    if (
        k % INT8_GROUP
        or qweight.shape[1] != k
        or scales.shape != (n, k // INT8_GROUP)
        or (bias is not None and bias.shape != (n,))
    ):
        raise ValueError(
            f"shapes x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
            f"{tuple(scales.shape)} do not match (K a multiple of {INT8_GROUP}, scales "
            f"[N, K/{INT8_GROUP}])"
        )
    if qweight.dtype != torch.int8 or qweight.device.type != "cpu":
        raise ValueError(
            f"qweight must be int8 on the CPU, got {qweight.dtype} on {qweight.device}"
        )
    _require_f32(x=x, scales=scales, bias=bias)
    return _run_gemv(lib.tokenmill_gemv_i8, x, bias, n, qweight, scales)


def pack_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 layout :func:`gemv_int4` reads, from :func:`tokenmill.engine.quantization.
    quantize_int4`'s ``q [N, K]`` (integers in [0, 15]), ``scales`` and ``zeros`` ``[N, K/32]``
    float (``w = (q - 8) * s + z``). Output rows go in blocks of :data:`INT4_ROWS` (16).

    Returns:
        ``(qweight, group_scales)``: ``qweight [N/16, K/32, 16, 16]`` uint8, where
        ``qweight[b, g, p, i]`` holds ``q[16 b + i, 32 g + p]`` in its low nibble and ``q[16 b +
        i, 32 g + 16 + p]`` in its high one (``cpu_gemv.c`` says why); ``group_scales [N/16,
        K/32, 16]`` int32, one word per row and group: ``z8 = z - 8 s`` as bf16 bits in the high
        half, ``s`` as bf16 in the low. The layer computes with ``w = q * s + z8`` in those bf16
        values (bf16 keeps the table at 4 bytes a group, as torch's packed kernels do).

    Raises:
        ValueError: ``N`` not a multiple of 16, ``K`` not a multiple of 32, or shapes that do
            not match.
    """
    n, k = q.shape
    g = k // INT4_GROUP
    if n % INT4_ROWS or k % INT4_GROUP or scales.shape != (n, g) or zeros.shape != (n, g):
        raise ValueError(
            f"q {tuple(q.shape)} needs N divisible by {INT4_ROWS}, K by {INT4_GROUP}, and "
            f"scales/zeros of shape {(n, g)}; got {tuple(scales.shape)}, {tuple(zeros.shape)}"
        )
    # [N/16, 16 rows, G, 2 halves, 16 pairs] -> [N/16, G, 16 pairs, 16 rows, 2 halves]
    t = q.to(torch.int32).reshape(n // INT4_ROWS, INT4_ROWS, g, 2, 16).permute(0, 2, 4, 1, 3)
    qweight = (t[..., 0] | t[..., 1] << 4).to(torch.uint8).contiguous()
    s16 = scales.float().to(torch.bfloat16)
    z8 = (zeros.float() - 8.0 * s16.float()).to(torch.bfloat16)
    high = z8.view(torch.int16).to(torch.int32) << 16
    words = high | (s16.view(torch.int16).to(torch.int32) & 0xFFFF)
    return qweight, words.reshape(n // INT4_ROWS, INT4_ROWS, g).transpose(1, 2).contiguous()


def unpack_int4(
    qweight: torch.Tensor, group_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_int4` undone in torch: ``(q [N, K] int32, s [N, K/32] float32, z8 [N, K/32]
    float32)`` with ``w = q * s + z8`` per group."""
    blocks, g = qweight.shape[:2]
    t = qweight.to(torch.int32)  # [N/16, G, 16 pairs, 16 rows]
    halves = torch.stack([t & 15, t >> 4], dim=-1)  # [N/16, G, pairs, rows, 2]
    q = halves.permute(0, 3, 1, 4, 2).reshape(blocks * INT4_ROWS, g * INT4_GROUP)
    words = group_scales.to(torch.int32).transpose(1, 2).reshape(blocks * INT4_ROWS, g)
    s = (words << 16).view(torch.float32)
    z8 = (words & ~0xFFFF).view(torch.float32)
    return q, s, z8


def _check_int4(
    qweight: torch.Tensor, group_scales: torch.Tensor, k: int | None = None
) -> tuple[int, int]:
    """``(N, K)`` of an int4 layer in :func:`pack_int4`'s layout; ValueError naming what is off."""
    r = INT4_ROWS
    if (
        qweight.dtype != torch.uint8
        or qweight.dim() != 4
        or qweight.shape[2:] != (16, r)
        or qweight.device.type != "cpu"
    ):
        raise ValueError(
            f"qweight must be [N/{r}, K/{INT4_GROUP}, 16, {r}] uint8 on the CPU (pack_int4), "
            f"got {tuple(qweight.shape)} {qweight.dtype}"
        )
    blocks, g = qweight.shape[:2]
    n, kk = blocks * r, g * INT4_GROUP
    if k is not None and k != kk:
        raise ValueError(f"x has {k} columns, qweight {tuple(qweight.shape)} holds {kk}")
    if group_scales.dtype != torch.int32 or tuple(group_scales.shape) != (blocks, g, r):
        raise ValueError(
            f"group_scales must be {(blocks, g, r)} int32, got {tuple(group_scales.shape)} "
            f"{group_scales.dtype}"
        )
    return n, kk


def gemv_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int4: ``x [M, K]`` float32 (``1 <= M <= MAX_ROWS``), ``qweight [N/16, K/32,
    16, 16]`` uint8 and ``group_scales [N/16, K/32, 16]`` int32 (:func:`pack_int4`), ``bias
    [N]`` float32 →
    ``[M, N]`` float32 = ``x @ wᵀ + bias`` with ``w = q * s + z8`` per group of 32.

    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: a dtype, device, row count or shape the kernel does not take.
    """
    lib = _loaded_or_raise()
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv_int4 takes 1..{MAX_ROWS} rows, got {m}")
    n, _ = _check_int4(qweight, group_scales, k)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}, expected {(n,)}")
    _require_f32(x=x, bias=bias)
    return _run_gemv(lib.tokenmill_gemv_i4, x, bias, n, qweight, group_scales)


def dequantize_int4(qweight: torch.Tensor, group_scales: torch.Tensor) -> torch.Tensor:
    """The ``[N, K]`` float32 weight an int4 layer in :func:`pack_int4`'s layout computes with
    (``q * s + z8``), in one C pass (prefill's dense GEMM path).

    Raises:
        RuntimeError: the kernel is not :func:`available`.
        ValueError: a dtype or shape the kernel does not take.
    """
    lib = _loaded_or_raise()
    n, k = _check_int4(qweight, group_scales)
    qweight, group_scales = qweight.contiguous(), group_scales.contiguous()
    w = torch.empty((n, k), dtype=torch.float32)
    lib.tokenmill_dequant_i4(
        qweight.data_ptr(), group_scales.data_ptr(), w.data_ptr(), n, k, torch.get_num_threads()
    )
    return w


def reference_gemv_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str = "float32",
) -> torch.Tensor:
    """The torch reference of :func:`gemv_int4`, in float64 over :func:`unpack_int4`; ``act``
    ``int8``: with x quantized as :func:`quantize_act_int8` does (the codes times the int8
    activations, times ``s * dx``, plus ``z8`` times the float sum of x, per group)."""
    q, s, z8 = unpack_int4(qweight, group_scales)
    n = q.shape[0]
    b = bias.double() if bias is not None else None
    if act == "int8":
        m = x.shape[0]
        xq, dx = quantize_act_int8(x)
        qg = q.double().reshape(n, -1, INT4_GROUP)  # [N, G, 32]
        dots = torch.einsum("ngt,mgt->mng", qg, xq.double().reshape(m, -1, INT4_GROUP))
        xsum = x.double().reshape(m, -1, INT4_GROUP).sum(-1)  # [M, G]
        y = (dots * s.double()[None] * dx.double()[:, None, :]).sum(-1)
        y = y + (z8.double()[None] * xsum[:, None, :]).sum(-1)
        return (y + b if b is not None else y).float()
    w = q.double().reshape(n, -1, INT4_GROUP) * s.double()[..., None] + z8.double()[..., None]
    return torch.nn.functional.linear(x.double(), w.reshape(n, -1), b).float()


def reference_gemv_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of :func:`gemv_int8`, in float64."""
    n, k = qweight.shape
    w = (qweight.double().reshape(n, -1, INT8_GROUP) * scales.double()[..., None]).reshape(n, k)
    b = bias.double() if bias is not None else None
    return torch.nn.functional.linear(x.double(), w, b).float()


def reference_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference of :func:`gemv`: ``F.linear`` in float64, cast to float32."""
    b = bias.double() if bias is not None else None
    return torch.nn.functional.linear(x.double(), weight.double(), b).float()


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """One decode token per sequence: write ``key``/``value`` ``[B, Hkv, D]`` at
    ``slot_mapping [B]`` (int64, ``-1`` skipped) in the caches ``[num_blocks, block_size, Hkv,
    D]``, then attend ``query [B, Hq, D]`` over each sequence's ``seq_lens [B]`` (int32)
    tokens through ``block_tables [B, max_blocks]`` (int32), causal and within
    ``sliding_window``. The caches may be float32 or bfloat16 (then the new K/V are rounded to
    bf16 on the way in, and bf16 query/key/value are widened to float32 first; the math is
    float32 either way). Returns ``[B, Hq, D]`` float32, or None (nothing stored) when an
    input is not one the kernel takes (another dtype or device, caches not contiguous, heads
    not contiguous, index dtypes) so the caller runs its torch path. Same result as
    :func:`tokenmill.kernels.reference.paged_attention` on one-token chunks.

    Raises:
        RuntimeError: the kernels are not :func:`available`, or the kernel ran out of memory.
    """
    lib = _loaded_or_raise()
    b, hq, d = query.shape
    hkv = key.shape[1]
    bf16 = k_cache.dtype == v_cache.dtype == torch.bfloat16
    bf16 = bf16 and k_cache.device.type == v_cache.device.type == "cpu"
    if bf16 and query.dtype == key.dtype == value.dtype == torch.bfloat16:
        # the step's rows widened once (a few KB); the cache stays bf16
        query, key, value = query.float(), key.float(), value.float()
    ok = (
        (_f32(query, key, value, k_cache, v_cache) or (bf16 and _f32(query, key, value)))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == d for t in (query, key, value))
        and key.stride(0) == value.stride(0)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1
        and seq_lens.dtype == torch.int32
        and seq_lens.is_contiguous()
        and hq % hkv == 0
        and k_cache.shape[2:] == (hkv, d)
    )
    if not ok:
        return None
    out = torch.empty((b, hq, d), dtype=torch.float32)
    kernel = lib.tokenmill_decode_attention_bf16 if bf16 else lib.tokenmill_decode_attention
    rc = kernel(
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        b,
        hq,
        hkv,
        d,
        k_cache.shape[1],
        scale,
        sliding_window or 0,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError("decode attention kernel: out of memory for the scores")
    return out


def _f32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


class CpuOps:
    """The decoder's element-wise ops as single C calls on float32 CPU tensors, with
    :class:`tokenmill.engine.models.ops.TorchOps`' signatures; any other input (dtype, device,
    layout) goes to the torch reference (:mod:`.reference`). Use only when :func:`available`."""

    name = "cpu"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x [T, H]`` → ``[T, H]`` (rows may be strided)."""
        if not (_f32(x, weight) and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()):
            return reference.rms_norm(x, weight, eps)
        t, h = x.shape
        out = torch.empty((t, h), dtype=torch.float32)
        _lib.tokenmill_rms_norm_mt(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), h, t, h, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    @staticmethod
    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``, ``[T, H]`` each, in one pass."""
        if not (
            _f32(x, residual, weight)
            and x.dim() == 2
            and x.is_contiguous()
            and residual.is_contiguous()
            and residual.shape == x.shape
            and weight.is_contiguous()
        ):
            return reference.fused_add_rms_norm(x, residual, weight, eps)
        t, h = x.shape
        out = torch.empty((t, h), dtype=torch.float32)
        new_residual = torch.empty((t, h), dtype=torch.float32)
        _lib.tokenmill_fused_add_rms_norm_mt(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            new_residual.data_ptr(),
            t,
            h,
            eps,
            torch.get_num_threads(),
        )
        return out, new_residual

    @staticmethod
    def rotary(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox RoPE on ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` **in place** (rows may be
        strided, heads contiguous); ``cos, sin [T, D]``; returns ``(q, k)``."""
        ok = _f32(q, k, cos, sin) and cos.is_contiguous() and sin.is_contiguous()
        ok = ok and all(
            x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k)
        )
        if not ok:
            return reference.rotary_embedding(q, k, cos, sin)
        t, _, d = q.shape
        cp, sp = cos.data_ptr(), sin.data_ptr()
        _lib.tokenmill_rotary(q.data_ptr(), q.stride(0), t, q.shape[1], d, cp, sp)
        _lib.tokenmill_rotary(k.data_ptr(), k.stride(0), t, k.shape[1], d, cp, sp)
        return q, k

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """``x [T, 2I]`` → ``silu(x[:, :I]) * x[:, I:]`` ``[T, I]``."""
        if not (_f32(x) and x.dim() == 2 and x.is_contiguous()):
            return reference.silu_and_mul(x)
        t, n = x.shape[0], x.shape[1] // 2
        out = torch.empty((t, n), dtype=torch.float32)
        _lib.tokenmill_silu_and_mul_mt(x.data_ptr(), out.data_ptr(), t, n, torch.get_num_threads())
        return out
