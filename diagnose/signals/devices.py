"""Family ``devices``: the device or host samples per window (``device_samples`` of the
store's kind: ``gpu`` where any GPU was sampled, else ``host``; :func:`device_kind`).

GPU: power, SM clock (mean, max), utilization, DRAM bandwidth, temperature, memory use, samples
with a throttle reason. Host: the server's CPU, the CPU used outside it (``cpu_others_pct``),
steal, run queue, processes on the GPU that are not the server's, and tokenmill's own load
generator's CPU (``loadgen_cpu_pct``, NULL in stores from before the process census).
"""

from __future__ import annotations

from .family import Family, Yield
from .scope import Scope

_DEVICE_WINDOW_SQL = """
SELECT (time_ns - $t0) // $w AS win,
    avg(power_w) AS power_w_mean,
    avg(sm_clock_mhz) AS sm_clock_mean,
    max(sm_clock_mhz) AS sm_clock_max,
    avg(gpu_util_pct) AS gpu_util_mean,
    avg(dram_bw_util_pct) AS dram_bw_mean,
    max(temperature_c) AS temperature_max,
    avg(mem_used_bytes::DOUBLE / nullif(mem_total_bytes, 0)) AS device_mem_usage_mean,
    count(*) FILTER (WHERE list_has_any(clock_event_reasons,
        ['sw_power_cap', 'hw_slowdown', 'sw_thermal_slowdown', 'hw_thermal_slowdown', 'hw_power_brake_slowdown'])) AS throttled_samples,
    count(*) AS device_samples_n,
    avg(cpu_pct) AS host_cpu_mean,
    avg(cpu_others_pct) AS cpu_others_mean,
    avg(steal_pct) AS steal_mean,
    avg(run_queue) AS run_queue_mean,
    max(other_processes) AS other_processes_max,
    avg(__LOADGEN__) AS loadgen_cpu_mean
FROM device_samples WHERE time_ns >= $since AND time_ns < $until AND kind = $kind
GROUP BY win
"""

_KEYS = (
    "power_w_mean",
    "sm_clock_mean",
    "sm_clock_max",
    "gpu_util_mean",
    "dram_bw_mean",
    "temperature_max",
    "device_mem_usage_mean",
    "throttled_samples",
    "device_samples_n",
    "host_cpu_mean",
    "cpu_others_mean",
    "steal_mean",
    "run_queue_mean",
    "other_processes_max",
    "loadgen_cpu_mean",
)


def device_kind(scope: Scope) -> str | None:
    """``'gpu'`` when the store has GPU samples, else ``'host'`` when it has host samples, else
    None."""
    if not scope.has("device_samples", "kind"):
        return None
    kinds = [k for (k,) in scope.con.execute("SELECT DISTINCT kind FROM device_samples").fetchall()]
    return "gpu" if "gpu" in kinds else ("host" if "host" in kinds else None)


def compute(scope: Scope) -> Yield:
    # stores written before the process census (telemetry/host_procs.py) lack its column
    loadgen = "loadgen_cpu_pct" if scope.has("device_samples", "loadgen_cpu_pct") else "NULL"
    sql = _DEVICE_WINDOW_SQL.replace("__LOADGEN__", loadgen)
    # device samples are not set apart for the warm-up: the machine was there all along
    windows = scope.by_window(sql, "time_ns", None, kind=device_kind(scope) or "none")
    return Yield(windows, {})


FAMILY = Family(
    name="devices",
    needs={
        "device_samples": (
            "time_ns",
            "kind",
            "power_w",
            "sm_clock_mhz",
            "gpu_util_pct",
            "dram_bw_util_pct",
            "temperature_c",
            "mem_used_bytes",
            "mem_total_bytes",
            "clock_event_reasons",
            "cpu_pct",
            "cpu_others_pct",
            "steal_pct",
            "run_queue",
            "other_processes",
        )
    },
    optional={"device_samples": ("loadgen_cpu_pct",)},
    window_keys=_KEYS,
    overall_keys=(),
    compute=compute,
)
