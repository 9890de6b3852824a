"""The device's peak memory bandwidth (GB/s) and compute (GFLOP/s): the two ceilings of the
roofline the console draws the engine's steps against.

Where each figure comes from, first match wins (the ``source`` strings the ``config`` event
carries):

* ``flag`` — ``--peak-bandwidth-gbps`` / ``--peak-gflops`` (each on its own).
* ``table:<name>`` — an NVIDIA GPU in :data:`GPU_PEAKS`, matched on
  ``torch.cuda.get_device_name``: the vendor datasheet's memory bandwidth and dense (no 2:4
  sparsity) tensor-core BF16/FP16 FLOP/s with FP32 accumulate, or the CUDA-core FP32 figure for
  a float32 model (torch's float32 matmuls do not use TF32 unless told to).
* ``probe`` — anything else (a CPU, an unlisted GPU): a short measurement at engine start
  (:func:`probe`: a ~256 MB tensor copy and a 1024³ GEMM in the model's dtype, about a second),
  cached per machine in ``$TOKENMILL_HOME/device_peaks.json`` (default ``~/.cache/tokenmill``)
  under the CPU model, core count, torch threads, torch version and dtype.

A probe measures what this process can reach (shared cores, turbo, other tenants), so on a busy
machine it reads low and steps may plot above it; a datasheet figure is an upper bound no kernel
reaches (70-90 % of the bandwidth is good).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: ``(pattern on torch.cuda.get_device_name, table name, memory GB/s, dense BF16/FP16 tensor
#: TFLOP/s, FP32 TFLOP/s)``, most specific first. Figures from NVIDIA's datasheets (dense:
#: half the "with sparsity" figure); GeForce and workstation parts from NVIDIA's architecture
#: whitepapers (FP16/BF16 tensor with FP32 accumulate); the A10G (AWS only) from AWS's G5 specs.
GPU_PEAKS: tuple[tuple[str, str, float, float, float], ...] = (
    (r"H200 NVL", "NVIDIA H200 NVL", 4800.0, 835.0, 60.0),
    (r"H200", "NVIDIA H200", 4800.0, 989.0, 67.0),
    (r"H100 NVL", "NVIDIA H100 NVL", 3900.0, 835.0, 60.0),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", 2000.0, 756.0, 51.0),
    (r"H100", "NVIDIA H100 SXM", 3350.0, 989.0, 67.0),
    (r"A100.*SXM.*80GB|A100.*80GB.*SXM", "NVIDIA A100 80GB SXM", 2039.0, 312.0, 19.5),
    (r"A100.*80GB", "NVIDIA A100 80GB PCIe", 1935.0, 312.0, 19.5),
    (r"A100", "NVIDIA A100 40GB", 1555.0, 312.0, 19.5),
    (r"L40S", "NVIDIA L40S", 864.0, 362.0, 91.6),
    (r"L40\b", "NVIDIA L40", 864.0, 181.0, 90.5),
    (r"\bL4\b", "NVIDIA L4", 300.0, 121.0, 30.3),
    (r"A10G", "NVIDIA A10G", 600.0, 70.0, 35.0),
    (r"\bA10\b", "NVIDIA A10", 600.0, 125.0, 31.2),
    (r"RTX 4090", "NVIDIA GeForce RTX 4090", 1008.0, 165.2, 82.6),
    (r"RTX 3090", "NVIDIA GeForce RTX 3090", 936.0, 71.0, 35.6),
    (r"\bT4\b", "NVIDIA T4", 320.0, 65.0, 8.1),
    (r"V100.*SXM", "NVIDIA V100 SXM2", 900.0, 125.0, 15.7),
    (r"V100", "NVIDIA V100 PCIe", 900.0, 112.0, 14.0),
)

PROBE_COPY_BYTES = 256 << 20  # the copy probe's tensor
PROBE_GEMM_N = 1024  # the GEMM probe's M = N = K
PROBE_BUDGET_S = 0.25  # each probe repeats for about this long and keeps its best run
CACHE_FILE = "device_peaks.json"


def gpu_table_peaks(device_name: str, dtype: str) -> tuple[str, float, float] | None:
    """``(table name, GB/s, GFLOP/s)`` of a listed GPU (:data:`GPU_PEAKS`), the FLOP/s for
    ``dtype`` (``float32``: the FP32 column, else the dense 16-bit tensor column); None when the
    name is not listed."""
    for pattern, name, gbps, tensor_tflops, fp32_tflops in GPU_PEAKS:
        if re.search(pattern, device_name):
            tflops = fp32_tflops if dtype == "float32" else tensor_tflops
            return name, gbps, tflops * 1000.0
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cache_path() -> Path:
    """``$TOKENMILL_HOME/device_peaks.json`` (default ``~/.cache/tokenmill``)."""
    home = os.environ.get("TOKENMILL_HOME") or Path.home() / ".cache" / "tokenmill"
    return Path(home).expanduser() / CACHE_FILE


def _best_of(fn, budget_s: float, max_runs: int = 20) -> float:
    """The shortest of repeated timed runs of ``fn`` (s), one warm-up first."""
    fn()
    best = float("inf")
    end = time.perf_counter() + budget_s
    for _ in range(max_runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > end:
            break
    return best


def probe(device: str = "cpu", dtype: str = "float32") -> tuple[float, float]:
    """Measure ``(GB/s, GFLOP/s)`` on ``device``: the best of repeated copies of a
    :data:`PROBE_COPY_BYTES` tensor (bytes read + bytes written per second, STREAM's Copy
    convention) and of :data:`PROBE_GEMM_N`³ GEMMs in ``dtype`` (``2·N³`` FLOP each; float32
    on a CPU without native bf16 GEMM, where the engine's large GEMMs run in float32). About
    ``2 × PROBE_BUDGET_S`` seconds."""
    import torch

    dev = torch.device(device)
    tdtype = getattr(torch, dtype)
    if dev.type == "cpu" and tdtype != torch.float32:
        from .quantization import cpu_has_bf16_gemm

        if not cpu_has_bf16_gemm():
            # the engine's large GEMMs run in float32 on such a CPU (HalfPrecisionLinear)
            tdtype = torch.float32

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    src = torch.ones(PROBE_COPY_BYTES // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        sync()

    copy_s = _best_of(copy, PROBE_BUDGET_S)
    n = PROBE_GEMM_N
    a = torch.randn(n, n, device=dev).to(tdtype)
    b = torch.randn(n, n, device=dev).to(tdtype)

    def gemm():
        torch.mm(a, b)
        sync()

    gemm_s = _best_of(gemm, PROBE_BUDGET_S)
    return 2 * PROBE_COPY_BYTES / copy_s / 1e9, 2 * n**3 / gemm_s / 1e9


def probe_int8(n: int = PROBE_GEMM_N) -> float:
    """The int8 GEMM peak of this process's int8 compute path (GOP/s: ``2·N³`` multiply-adds
    counted as two operations, as FLOP are): the best of repeated ``N``³ products of int8
    activations and a prepacked int8 weight through :func:`tokenmill.engine.int8_compute.int8_gemm`,
    the call a prefill's layers make. About :data:`PROBE_BUDGET_S` seconds."""
    import torch

    from .int8_compute import int8_gemm, pack_weight

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8)
    w = pack_weight(torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8))
    return 2 * n**3 / _best_of(lambda: int8_gemm(a, w), PROBE_BUDGET_S) / 1e9


def int8_peak(int8_path: str) -> tuple[float, bool]:
    """``(GOP/s, from_cache)`` of :func:`probe_int8` on this machine and path, cached beside
    the other probes (:func:`cache_path`, keyed by the path as well)."""
    key = _probe_key(cpu_name(), f"int8 {int8_path}")
    (gops,), cached = _cached(key, ("gops",), lambda: (probe_int8(),))
    return gops, cached


def _cached(key: str, fields: tuple[str, ...], measure) -> tuple[tuple[float, ...], bool]:
    """``(values, from_cache)``: the positive ``fields`` cached under ``key``
    (:func:`cache_path`), or ``measure()``'s, written there (an unwritable cache only costs the
    next start a probe)."""
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, dict) and all(hit.get(f, 0) > 0 for f in fields):
        return tuple(float(hit[f]) for f in fields), True
    values = measure()
    cache[key] = {**{f: round(v, 2) for f, v in zip(fields, values)}, "measured_at": time.time()}
    _write_cache(path, cache)
    return values, False


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("device peak cache %s not written: %s", path, exc)


def _probe_key(device_name: str, dtype: str) -> str:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{device_name} | cores {cores} | threads {torch.get_num_threads()} | "
        f"torch {torch.__version__} | {dtype}"
    )


def cached_probe(device: str, device_name: str, dtype: str) -> tuple[float, float, bool]:
    """``(GB/s, GFLOP/s, from_cache)``: the cached probe of this machine, or a new probe
    written to the cache (:func:`cache_path`; an unwritable cache only costs the next start a
    probe)."""
    (gbps, gflops), cached = _cached(
        _probe_key(device_name, dtype), ("gbps", "gflops"), lambda: probe(device, dtype)
    )
    return gbps, gflops, cached


def device_name_of(device: str) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device, the CPU model name otherwise."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def resolve_peaks(
    device: str,
    dtype: str,
    bandwidth_gbps: float | None = None,
    gflops: float | None = None,
    int8_path: str | None = None,
) -> dict:
    """The device's peaks and where each came from.

    Args:
        device: the engine's device (``cpu``, ``cuda:0``).
        dtype: the model's activation dtype name (``float32``, ``bfloat16``, ``float16``).
        bandwidth_gbps, gflops: operator overrides (``--peak-bandwidth-gbps``,
            ``--peak-gflops``); None looks the figure up or measures it.

    Returns:
        ``device_name``, ``device_peak_gbps`` (GB/s), ``device_peak_gflops`` (GFLOP/s),
        ``device_peak_gbps_source`` and ``device_peak_gflops_source`` (``flag``,
        ``table:<name>``, ``probe``; ``unavailable`` with a None figure when the probe failed);
        with ``int8_path`` (int8 compute on: ``engine/int8_compute.py``) also
        ``device_peak_int8_gops``, that path's int8 GEMM peak (:func:`int8_peak`), the compute
        ceiling of the steps that ran in int8.
    """
    if int8_path is not None:
        return {**resolve_peaks(device, dtype, bandwidth_gbps, gflops), **_int8_peak_of(int8_path)}
    name = device_name_of(device)
    out = {
        "device_name": name,
        "device_peak_gbps": bandwidth_gbps,
        "device_peak_gflops": gflops,
        "device_peak_gbps_source": "flag" if bandwidth_gbps is not None else None,
        "device_peak_gflops_source": "flag" if gflops is not None else None,
    }
    if bandwidth_gbps is not None and gflops is not None:
        return out
    found = gpu_table_peaks(name, dtype) if device.startswith("cuda") else None
    if found is not None:
        table, gbps, flops = found
        measured = (gbps, flops)
        source = f"table:{table}"
    else:
        try:
            gbps, flops, cached = cached_probe(device, name, dtype)
        except Exception as exc:  # a probe that fails leaves the ceilings unknown, never the start
            log.warning("device peak probe failed: %s", exc)
            measured, source = (None, None), "unavailable"
        else:
            measured, source = (round(gbps, 2), round(flops, 2)), "probe"
            log.info(
                "device peaks %s: %.1f GB/s, %.1f GFLOP/s (%s)",
                name,
                gbps,
                flops,
                "cached probe" if cached else "probed",
            )
    if bandwidth_gbps is None:
        out["device_peak_gbps"], out["device_peak_gbps_source"] = measured[0], source
    if gflops is None:
        out["device_peak_gflops"], out["device_peak_gflops_source"] = measured[1], source
    return out


def _int8_peak_of(int8_path: str) -> dict:
    try:
        gops, cached = int8_peak(int8_path)
    except Exception as exc:  # a failed probe leaves the int8 ceiling unknown, never the start
        log.warning("int8 peak probe failed: %s", exc)
        return {"device_peak_int8_gops": None}
    log.info("int8 peak (%s): %.1f GOP/s (%s)", int8_path, gops, "cached" if cached else "probed")
    return {"device_peak_int8_gops": round(gops, 2)}
