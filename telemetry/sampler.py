"""Device sampler: one ``device_samples`` row per GPU per tick (NVML), or one host row per tick.

A daemon thread wakes every ``interval_s`` seconds (the server flag ``--device-sample-interval``,
default 0.1 s), reads the devices and hands each row to ``sink(row)``. A row is a dict whose keys
are exactly the columns of ``device_samples`` in ``telemetry/schema.sql`` (:data:`COLUMNS`);
a number that could not be read is ``None`` (NULL), never a guess. All rows of one tick share one
``time_ns`` (wall clock, ``time.time_ns()`` at the start of the tick).

GPU rows (``kind='gpu'``, through nvidia-ml-py's ``pynvml``), per column and NVML source:

==================== =========== ===============================================================
column               unit        source
==================== =========== ===============================================================
device_index         --          NVML index (all GPUs NVML sees; ``CUDA_VISIBLE_DEVICES`` is not
                                 applied)
device_name          --          ``nvmlDeviceGetName`` (read once at start)
power_w              W           ``nvmlDeviceGetPowerUsage`` (mW) / 1000
energy_j             J           ``nvmlDeviceGetTotalEnergyConsumption`` (mJ counter) minus the
                                 device's first successful reading, / 1000; so 0.0 on the first
                                 tick. ``None`` if the counter went backwards (driver reset).
gpu_util_pct         %           ``nvmlDeviceGetUtilizationRates().gpu``
mem_util_pct         %           ``nvmlDeviceGetUtilizationRates().memory`` (memory-controller
                                 busy time, not capacity)
dram_bw_util_pct     %           GPM ``NVML_GPM_METRIC_DRAM_BW_UTIL`` from ``nvmlGpmMetricsGet``
                                 over this tick's and the previous tick's ``nvmlGpmSampleGet``;
                                 only where ``nvmlGpmQueryDeviceSupport`` says the device has GPM
                                 (Hopper+). ``None`` on the first tick, where unsupported, and
                                 whenever a GPM call fails.
mem_used_bytes       bytes       ``nvmlDeviceGetMemoryInfo().used``
mem_total_bytes      bytes       ``nvmlDeviceGetMemoryInfo().total``
sm_clock_mhz         MHz         ``nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)``
mem_clock_mhz        MHz         ``nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM)``
temperature_c        deg C       ``nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)``
clock_event_reasons  names       bitmask of ``nvmlDeviceGetCurrentClocksEventReasons`` (falling
                                 back to ``nvmlDeviceGetCurrentClocksThrottleReasons``) decoded
                                 by :data:`CLOCK_EVENT_REASONS`; ``[]`` when no bit is set; bits
                                 not in the table appear as one ``unknown_0x...`` entry.
pcie_rx_bytes_s      bytes/s     ``nvmlDeviceGetPcieThroughput(h, NVML_PCIE_UTIL_RX_BYTES)``
                                 (KB/s) * 1024
pcie_tx_bytes_s      bytes/s     ``nvmlDeviceGetPcieThroughput(h, NVML_PCIE_UTIL_TX_BYTES)``
                                 (KB/s) * 1024
==================== =========== ===============================================================

NVML samples PCIe throughput internally over about 20 ms per call, so the two PCIe reads cost
about 40 ms per device per tick; a tick that runs past its interval starts the next one at once
(no catch-up burst).

Host rows (``kind='host'``) replace the GPU rows when ``pynvml`` cannot be imported, ``nvmlInit``
fails, or NVML sees 0 devices (:attr:`DeviceSampler.fallback_reason` says which):
``device_index`` None, ``device_name`` the hostname, ``cpu_pct`` (%, system-wide over all CPUs,
0..100) from ``psutil.cpu_percent(None)`` since the previous tick, ``rss_bytes`` (bytes) the summed RSS of this process, its children
(recursive; the engine core runs as a child) and the ``pids`` given, ``load_1m`` from
``os.getloadavg()[0]``, ``mem_used_bytes``/``mem_total_bytes`` (bytes) from
``psutil.virtual_memory()``; for the noisy-neighbour rule (``host_contention``):
``cpu_others_pct`` (%, 0..100 of all CPUs) the system-wide CPU use minus this server's process
tree's (this process, its children and the ``pids`` given; ``psutil.Process.cpu_percent`` summed
and divided by the CPU count), ``steal_pct`` (%) from ``psutil.cpu_times_percent(None).steal``
(Linux guests; ``None`` elsewhere) and ``run_queue`` the runnable tasks the kernel counts now
(``/proc/loadavg``'s 4th field; the sampler itself is one of them); ``loadgen_cpu_pct`` and
``busy_others`` say who the others are (``telemetry/host_procs.py``: tokenmill's own load
generator apart, the busiest processes by pid and command, refreshed once a second).

GPU rows carry ``other_processes``: the compute and graphics processes NVML lists on the device
whose pids are not this server's (``None`` where NVML cannot list them).

Errors: an NVML query that raises ``NVMLError`` gives ``None`` for its column(s) only. Any other
exception in a tick, and any exception raised by ``sink``, is caught: :attr:`last_error` holds it
as one line, each distinct message is logged once (warning), and sampling goes on. The sampler
never raises into the server: the constructor falls back to host mode instead of failing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from .host_procs import ProcessCensus

logger = logging.getLogger(__name__)

#: The columns of ``device_samples`` in table order (telemetry/schema.sql).
COLUMNS: tuple[str, ...] = (
    "time_ns",
    "kind",
    "device_index",
    "device_name",
    "power_w",
    "energy_j",
    "gpu_util_pct",
    "mem_util_pct",
    "dram_bw_util_pct",
    "mem_used_bytes",
    "mem_total_bytes",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "temperature_c",
    "clock_event_reasons",
    "pcie_rx_bytes_s",
    "pcie_tx_bytes_s",
    "cpu_pct",
    "rss_bytes",
    "load_1m",
    "cpu_others_pct",
    "steal_pct",
    "run_queue",
    "other_processes",
    "loadgen_cpu_pct",
    "busy_others",
)

#: Clock-event (throttle) reason bits: (pynvml constant suffix, bit value, name in the row).
#: The bit is read from ``nvmlClocksEventReason<suffix>`` (else ``nvmlClocksThrottleReason<suffix>``)
#: of the pynvml module in use; the literal is the value from NVML's headers.
CLOCK_EVENT_REASONS: tuple[tuple[str, int, str], ...] = (
    ("GpuIdle", 0x1, "gpu_idle"),
    ("ApplicationsClocksSetting", 0x2, "applications_clocks_setting"),
    ("SwPowerCap", 0x4, "sw_power_cap"),
    ("HwSlowdown", 0x8, "hw_slowdown"),
    ("SyncBoost", 0x10, "sync_boost"),
    ("SwThermalSlowdown", 0x20, "sw_thermal_slowdown"),
    ("HwThermalSlowdown", 0x40, "hw_thermal_slowdown"),
    ("HwPowerBrakeSlowdown", 0x80, "hw_power_brake_slowdown"),
    ("DisplayClockSetting", 0x100, "display_clocks_setting"),
)

_KB = 1024  # NVML's PCIe throughput unit is KB/s (1024 bytes)
_MAX_LOGGED = 64  # distinct error messages logged before going quiet
# seconds between listings of the server's process tree (DeviceSampler._tree)
TREE_REFRESH_S = 1.0


def _empty_row(time_ns: int, kind: str) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row["time_ns"] = time_ns
    row["kind"] = kind
    return row


def _run_queue() -> int | None:
    """Runnable tasks now (``/proc/loadavg``: ``running/total``); None off Linux."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\r", " ").replace("\n", " ")
    return text[:300]


class _Gpu:
    """Per-device state: handle, name, energy baseline, GPM sample buffers."""

    __slots__ = ("energy_base_mj", "gpm_bufs", "gpm_prev_ok", "handle", "index", "name")

    def __init__(self, index: int, handle: Any, name: str | None) -> None:
        self.index = index
        self.handle = handle
        self.name = name
        self.energy_base_mj: int | None = None
        # [previous, current] nvmlGpmSample_t buffers, swapped every tick; None without GPM.
        self.gpm_bufs: list[Any] | None = None
        self.gpm_prev_ok = False  # gpm_bufs[0] holds a good sample from the previous tick


class DeviceSampler:
    """Samples the GPUs (or the host) every ``interval_s`` seconds into ``sink``.

    Args:
        sink: called as ``sink(row)`` once per device per tick, from the sampler thread (or from
            :meth:`sample_once`'s caller). Gets its own copy of the row. Exceptions are caught.
        interval_s: seconds between tick starts (> 0).
        nvml: the ``pynvml`` module to use (tests inject a fake); ``None`` imports ``pynvml``.
        pids: extra process ids whose RSS counts in host rows: an iterable of ints, or a callable
            returning one (read every tick, so a restarted engine's new pid is picked up).
        use_nvml: ``False`` skips NVML and samples the host even where a GPU is present.

    Raises:
        ValueError: ``interval_s`` is not a positive finite number.
    """

    def __init__(
        self,
        sink: Callable[[dict], Any],
        interval_s: float = 0.1,
        *,
        nvml: Any = None,
        pids: Iterable[int] | Callable[[], Iterable[int]] | None = None,
        use_nvml: bool = True,
    ) -> None:
        if not (
            isinstance(interval_s, int | float) and math.isfinite(interval_s) and interval_s > 0
        ):
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        self.sink = sink
        self.interval_s = float(interval_s)
        self._pids = pids
        #: The latest tick-level or sink error as one line; ``None`` until one happens.
        self.last_error: str | None = None
        #: Why the sampler is in host mode (one line); ``None`` in gpu mode.
        self.fallback_reason: str | None = None
        #: Ticks run so far, and exceptions caught (tick or sink).
        self.ticks = 0
        self.errors_total = 0
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # one tick at a time (GPM buffers, energy baselines)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._latest: list[dict] = []
        self._nvml: Any = None
        self._gpus: list[_Gpu] = []
        self._hostname = socket.gethostname()
        self._self_proc = psutil.Process()
        self._cpu_procs: dict[int, psutil.Process] = {}  # kept: cpu_percent counts per object
        # the process tree, re-listed at most every TREE_REFRESH_S (listing children reads
        # every /proc/*/stat: ~7 ms of CPU a tick at 10 Hz, beside a 2-core engine's decode)
        self._tree_cache: dict[int, psutil.Process] | None = None
        self._tree_at = 0.0
        self._census = ProcessCensus(TREE_REFRESH_S)
        if use_nvml:
            self._init_nvml(nvml)
        else:
            self.fallback_reason = "NVML disabled"
        if self._nvml is None:
            with contextlib.suppress(Exception):
                psutil.cpu_percent(None)  # the first call only sets the reference point
                psutil.cpu_times_percent(None)
                self._own_cpu_pct()

    # ----------------------------------------------------------------- public API

    @property
    def mode(self) -> str:
        """``'gpu'`` (NVML rows, one per device) or ``'host'`` (one host row per tick)."""
        return "gpu" if self._nvml is not None else "host"

    @property
    def latest(self) -> list[dict]:
        """The rows of the latest tick (copies); ``[]`` before the first tick."""
        return [dict(r) for r in self._latest]

    @property
    def running(self) -> bool:
        """Whether the sampler thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the daemon sampling thread (no-op if it already runs).

        Raises:
            RuntimeError: the sampler was stopped (it is single-use).
        """
        if self._closed:
            raise RuntimeError("DeviceSampler was stopped; create a new one")
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="tokenmill-device-sampler", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, join it (up to ``timeout_s``), free GPM buffers and shut NVML down.

        Idempotent; :attr:`latest` stays readable afterwards.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release_nvml()

    def sample_once(self) -> list[dict]:
        """Run one tick now in the caller's thread: read, update :attr:`latest`, call the sink.

        Returns the tick's rows ([] if the tick failed; see :attr:`last_error`).

        Raises:
            RuntimeError: the sampler was stopped.
        """
        if self._closed:
            raise RuntimeError("DeviceSampler was stopped; create a new one")
        return self._tick()

    # ----------------------------------------------------------------- the loop

    def _run(self) -> None:
        from .store import lower_thread_priority

        lower_thread_priority()
        next_t = time.monotonic()
        while not self._stop.is_set():
            self._tick()
            next_t += self.interval_s
            now = time.monotonic()
            if next_t < now:  # overran: start the next tick now, no catch-up burst
                next_t = now
            self._stop.wait(next_t - now)

    def _tick(self) -> list[dict]:
        with self._lock:
            if self._closed:
                return []
            self.ticks += 1
            try:
                rows = self._collect()
            except Exception as exc:
                self._record_error(exc, "tick")
                return []
            self._latest = rows
        for row in rows:
            try:
                self.sink(dict(row))
            except Exception as exc:
                self._record_error(exc, "sink")
        return [dict(r) for r in rows]

    def _record_error(self, exc: BaseException, where: str) -> None:
        line = f"{where}: {_one_line(exc)}"
        self.last_error = line
        self.errors_total += 1
        if line not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(line)
            logger.warning("device sampler %s (logged once)", line)

    def _collect(self) -> list[dict]:
        now_ns = time.time_ns()
        if self._nvml is None:
            return [self._host_row(now_ns)]
        return [self._gpu_row(now_ns, g) for g in self._gpus]

    # ----------------------------------------------------------------- NVML

    def _init_nvml(self, nvml: Any) -> None:
        """Import and initialise NVML and enumerate the devices; on failure stay in host mode."""
        if nvml is None:
            try:
                import pynvml as nvml
            except Exception as exc:
                self.fallback_reason = f"pynvml not importable ({_one_line(exc)})"
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self.fallback_reason = f"nvmlInit failed ({_one_line(exc)})"
            return
        try:
            count = int(nvml.nvmlDeviceGetCount())
            gpus = []
            for i in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append(_Gpu(i, handle, self._nvml_name(nvml, handle)))
        except Exception as exc:
            self.fallback_reason = f"NVML device enumeration failed ({_one_line(exc)})"
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return
        if not gpus:
            self.fallback_reason = "NVML sees 0 devices"
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return
        self._nvml = nvml
        self._gpus = gpus
        for g in gpus:
            self._init_gpm(g)

    @staticmethod
    def _nvml_name(nvml: Any, handle: Any) -> str | None:
        try:
            name = nvml.nvmlDeviceGetName(handle)
        except nvml.NVMLError:
            return None
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def _init_gpm(self, g: _Gpu) -> None:
        """Allocate two GPM sample buffers where ``nvmlGpmQueryDeviceSupport`` says yes."""
        nvml = self._nvml
        if not hasattr(nvml, "nvmlGpmQueryDeviceSupport"):
            return
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(g.handle)
            if not support.isSupportedDevice:
                return
            bufs = [nvml.nvmlGpmSampleAlloc()]
            try:
                bufs.append(nvml.nvmlGpmSampleAlloc())
            except Exception:
                with contextlib.suppress(Exception):
                    nvml.nvmlGpmSampleFree(bufs[0])
                raise
            g.gpm_bufs = bufs
        except Exception as exc:
            self._note_query_error(g, "gpm", exc)

    def _release_nvml(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        for g in self._gpus:
            for buf in g.gpm_bufs or ():
                with contextlib.suppress(Exception):
                    nvml.nvmlGpmSampleFree(buf)
            g.gpm_bufs = None
            g.gpm_prev_ok = False
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()

    def _note_query_error(self, g: _Gpu, what: str, exc: BaseException) -> None:
        key = f"gpu{g.index} {what}: {_one_line(exc)}"
        if key not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
            logger.debug("device sampler: NVML query failed, column(s) NULL: %s", key)

    def _query(self, g: _Gpu, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or ``None`` when it raises ``NVMLError`` (other exceptions propagate)."""
        try:
            return fn()
        except self._nvml.NVMLError as exc:
            self._note_query_error(g, what, exc)
            return None

    def _gpu_row(self, now_ns: int, g: _Gpu) -> dict:
        nvml, h = self._nvml, g.handle
        row = _empty_row(now_ns, "gpu")
        row["device_index"] = g.index
        row["device_name"] = g.name

        mw = self._query(g, "power", lambda: nvml.nvmlDeviceGetPowerUsage(h))
        row["power_w"] = None if mw is None else mw / 1000.0

        mj = self._query(g, "energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
        if mj is not None:
            if g.energy_base_mj is None:
                g.energy_base_mj = mj
            row["energy_j"] = (mj - g.energy_base_mj) / 1000.0 if mj >= g.energy_base_mj else None

        util = self._query(g, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            row["gpu_util_pct"] = float(util.gpu)
            row["mem_util_pct"] = float(util.memory)

        row["dram_bw_util_pct"] = self._gpm_dram_bw(g)

        mem = self._query(g, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            row["mem_used_bytes"] = int(mem.used)
            row["mem_total_bytes"] = int(mem.total)

        sm = self._query(g, "sm_clock", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        row["sm_clock_mhz"] = None if sm is None else int(sm)
        mc = self._query(
            g, "mem_clock", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)
        )
        row["mem_clock_mhz"] = None if mc is None else int(mc)

        temp = self._query(
            g, "temperature", lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
        )
        row["temperature_c"] = None if temp is None else float(temp)

        mask = self._clock_event_mask(g)
        row["clock_event_reasons"] = None if mask is None else self.decode_reasons(mask, nvml)

        rx = self._query(
            g, "pcie_rx", lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)
        )
        row["pcie_rx_bytes_s"] = None if rx is None else float(rx) * _KB
        tx = self._query(
            g, "pcie_tx", lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)
        )
        row["pcie_tx_bytes_s"] = None if tx is None else float(tx) * _KB
        row["other_processes"] = self._other_processes(g)
        return row

    def _other_processes(self, g: _Gpu) -> int | None:
        """Processes NVML lists on the device (compute and graphics) that are not this
        server's; None when NVML cannot list them."""
        nvml, h = self._nvml, g.handle
        pids: set[int] = set()
        listed = False
        for name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            fn = getattr(nvml, name, None)
            procs = None if fn is None else self._query(g, name, lambda fn=fn: fn(h))
            if procs is not None:
                listed = True
                pids.update(int(p.pid) for p in procs)
        if not listed:
            return None
        return len(pids - set(self._tree()))

    def _clock_event_mask(self, g: _Gpu) -> int | None:
        nvml, h = self._nvml, g.handle
        fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is not None:
            try:
                return int(fn(h))
            except nvml.NVMLError as exc:
                self._note_query_error(g, "clocks_event_reasons", exc)
        fn = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        if fn is None:
            return None
        mask = self._query(g, "clocks_throttle_reasons", lambda: fn(h))
        return None if mask is None else int(mask)

    @staticmethod
    def decode_reasons(mask: int, nvml: Any = None) -> list[str]:
        """Names of the bits set in a clock-event reasons bitmask (:data:`CLOCK_EVENT_REASONS`);
        ``[]`` for 0. Leftover unknown bits give one ``'unknown_0x...'`` entry."""
        names = []
        for suffix, default, name in CLOCK_EVENT_REASONS:
            bit = getattr(
                nvml,
                f"nvmlClocksEventReason{suffix}",
                getattr(nvml, f"nvmlClocksThrottleReason{suffix}", default),
            )
            if mask & bit:
                names.append(name)
                mask &= ~bit
        if mask:
            names.append(f"unknown_{mask:#x}")
        return names

    def _gpm_dram_bw(self, g: _Gpu) -> float | None:
        """DRAM bandwidth utilisation (%) between the previous and this tick's GPM samples."""
        if g.gpm_bufs is None:
            return None
        nvml = self._nvml
        prev, cur = g.gpm_bufs
        try:
            nvml.nvmlGpmSampleGet(g.handle, cur)
        except Exception as exc:
            self._note_query_error(g, "gpm_sample", exc)
            g.gpm_prev_ok = False
            return None
        value = None
        if g.gpm_prev_ok:
            try:
                mg = nvml.c_nvmlGpmMetricsGet_t()
                mg.version = nvml.NVML_GPM_METRICS_GET_VERSION
                mg.numMetrics = 1
                mg.sample1 = prev
                mg.sample2 = cur
                mg.metrics[0].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
                nvml.nvmlGpmMetricsGet(mg)
                metric = mg.metrics[0]
                if metric.nvmlReturn == nvml.NVML_SUCCESS and math.isfinite(metric.value):
                    value = float(metric.value)
                else:
                    self._note_query_error(
                        g, "gpm_metric", RuntimeError(f"nvmlReturn {metric.nvmlReturn}")
                    )
            except Exception as exc:
                self._note_query_error(g, "gpm_metrics_get", exc)
        g.gpm_bufs = [cur, prev]  # this tick's sample is the next tick's previous one
        g.gpm_prev_ok = True
        return value

    # ----------------------------------------------------------------- host

    def _pid_list(self) -> list[int]:
        pids = self._pids
        if pids is None:
            return []
        if callable(pids):
            pids = pids()
        return [int(p) for p in pids or () if p is not None]

    def _host_row(self, now_ns: int) -> dict:
        row = _empty_row(now_ns, "host")
        row["device_name"] = self._hostname
        row["cpu_pct"] = float(psutil.cpu_percent(None))
        tree = self._tree()  # walked once a tick, for the RSS and the CPU split
        row["rss_bytes"] = self._rss_bytes(tree)
        try:
            row["load_1m"] = float(os.getloadavg()[0])
        except (OSError, AttributeError):
            row["load_1m"] = None
        vm = psutil.virtual_memory()
        row["mem_used_bytes"] = int(vm.used)
        row["mem_total_bytes"] = int(vm.total)
        own = self._own_cpu_pct(tree)
        row["cpu_others_pct"] = None if own is None else max(0.0, row["cpu_pct"] - own)
        try:
            row["steal_pct"] = float(getattr(psutil.cpu_times_percent(None), "steal", None))
        except (TypeError, ValueError):
            row["steal_pct"] = None
        row["run_queue"] = _run_queue()
        with contextlib.suppress(OSError, psutil.Error):
            row["loadgen_cpu_pct"], row["busy_others"] = self._census.read(set(tree))
        return row

    def _tree(self) -> dict[int, psutil.Process]:
        """This process, its children (recursive) and the given pids, by pid; listed again at
        most every :data:`TREE_REFRESH_S` (a process that ends meanwhile is skipped by the
        readers, one that starts is counted from the next listing)."""
        now = time.monotonic()
        if self._tree_cache is not None and now - self._tree_at < TREE_REFRESH_S:
            return self._tree_cache
        self._tree_at = now
        self._tree_cache = self._list_tree()
        return self._tree_cache

    def _list_tree(self) -> dict[int, psutil.Process]:
        gone = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
        procs: dict[int, psutil.Process] = {self._self_proc.pid: self._self_proc}
        try:
            for child in self._self_proc.children(recursive=True):
                procs.setdefault(child.pid, child)
        except gone:
            pass
        for pid in self._pid_list():
            if pid not in procs:
                try:
                    procs[pid] = psutil.Process(pid)
                except gone:
                    continue
        return procs

    def _own_cpu_pct(self, tree: dict[int, psutil.Process] | None = None) -> float | None:
        """CPU % (0..100 of all CPUs) this server's process tree used since the previous call.
        Process objects are kept between calls: ``cpu_percent`` measures from the previous call
        on the same object (a new process reads 0 on its first tick)."""
        gone = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
        tree = self._tree() if tree is None else tree
        known = self._cpu_procs
        for pid in list(known):
            if pid not in tree:
                del known[pid]
        total, seen = 0.0, 0
        for pid, proc in tree.items():
            proc = known.setdefault(pid, proc)
            try:
                total += proc.cpu_percent(None)
                seen += 1
            except gone:
                known.pop(pid, None)
        if not seen:
            return None
        return total / (psutil.cpu_count() or 1)

    def _rss_bytes(self, tree: dict[int, psutil.Process]) -> int | None:
        """Summed RSS (bytes) of this process, its children and the given pids; vanished or
        inaccessible processes are skipped."""
        gone = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
        total, seen = 0, 0
        for proc in tree.values():
            try:
                total += proc.memory_info().rss
                seen += 1
            except gone:
                continue
        return total if seen else None
