"""The console's device queries (Devices page): GPU or host samples per time bucket and the
energy per output token. Conventions: ``data_store.py``."""

from __future__ import annotations

import pandas as pd

from .data_store import (
    GIB,
    NS,
    _df,
    _div,
    _q,
    _time,
    pick_bucket_s,
)

# clock-event reasons that mean the GPU is held back (not idle, not an app clock setting)
THROTTLE_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)


def device_kind(con, since_ns: int, until_ns: int) -> str | None:
    """'gpu' when the window has GPU samples, else 'host' when it has host samples, else None."""
    kinds = {
        k
        for (k,) in _q(
            con,
            "SELECT DISTINCT kind FROM device_samples WHERE time_ns >= $since AND time_ns < $until",
            since=since_ns,
            until=until_ns,
        ).fetchall()
    }
    return "gpu" if "gpu" in kinds else ("host" if "host" in kinds else None)


_GPU_SQL = """
SELECT (time_ns - $since) // $w AS b, device_index, any_value(device_name) AS device_name,
    min(time_ns) AS t_ns, avg(power_w) AS power_w, max(energy_j) AS energy_j,
    avg(gpu_util_pct) AS sm_util_pct, avg(mem_util_pct) AS mem_util_pct,
    avg(dram_bw_util_pct) AS dram_bw_util_pct, avg(mem_used_bytes) / $gib AS mem_used_gib,
    max(mem_total_bytes) / $gib AS mem_total_gib, avg(sm_clock_mhz) AS sm_clock_mhz,
    avg(mem_clock_mhz) AS mem_clock_mhz, max(temperature_c) AS temperature_c,
    bool_or(list_has_any(coalesce(clock_event_reasons, []::VARCHAR[]), $throttle)) AS throttled,
    list_sort(list_distinct(flatten(list(coalesce(clock_event_reasons, []::VARCHAR[]))))) AS reasons,
    avg(pcie_rx_bytes_s) AS pcie_rx_bytes_s, avg(pcie_tx_bytes_s) AS pcie_tx_bytes_s
FROM device_samples WHERE kind = 'gpu' AND time_ns >= $since AND time_ns < $until
GROUP BY b, device_index ORDER BY device_index, b
"""

_HOST_SQL = """
SELECT (time_ns - $since) // $w AS b, any_value(device_name) AS device_name, min(time_ns) AS t_ns,
    avg(cpu_pct) AS cpu_pct, avg(load_1m) AS load_1m, avg(rss_bytes) / $gib AS rss_gib,
    avg(mem_used_bytes) / $gib AS mem_used_gib, max(mem_total_bytes) / $gib AS mem_total_gib
FROM device_samples WHERE kind = 'host' AND time_ns >= $since AND time_ns < $until
GROUP BY b ORDER BY b
"""


def device_series(con, since_ns: int, until_ns: int, max_points: int = 1500) -> dict:
    """Device samples in the window, averaged into at most about ``max_points`` buckets.

    Returns ``{"kind": 'gpu' | 'host' | None, "bucket_s", "df"}``. GPU rows per device: power
    (W), SM and memory-controller util and DRAM bandwidth util (%), memory (GiB), SM/memory
    clocks (MHz), temperature (°C, max), ``throttled`` (a power/thermal reason seen) and the
    reasons. Host rows (no GPU): CPU % (all cores), load, process RSS and host memory (GiB).
    """
    kind = device_kind(con, since_ns, until_ns)
    bucket_s = pick_bucket_s(since_ns, until_ns, points=max_points)
    w = max(1, int(bucket_s * NS))
    if kind == "gpu":
        df = _df(
            con,
            _GPU_SQL,
            since=since_ns,
            until=until_ns,
            w=w,
            gib=GIB,
            throttle=list(THROTTLE_REASONS),
        )
        df["reasons"] = df["reasons"].map(lambda r: ", ".join(r) if r is not None else "")
    elif kind == "host":
        df = _df(con, _HOST_SQL, since=since_ns, until=until_ns, w=w, gib=GIB)
    else:
        df = pd.DataFrame({"t_ns": pd.Series(dtype="int64")})
    return {"kind": kind, "bucket_s": bucket_s, "df": _time(df)}


_ENERGY_SQL = """
WITH d AS (
    SELECT time_ns,
        CASE WHEN energy_j IS NOT NULL AND lag(energy_j) OVER w IS NOT NULL
                  AND energy_j >= lag(energy_j) OVER w
             THEN energy_j - lag(energy_j) OVER w
             ELSE power_w * (time_ns - lag(time_ns) OVER w) / 1e9 END AS de
    FROM device_samples WHERE kind = 'gpu' AND time_ns >= $since AND time_ns < $until
    WINDOW w AS (PARTITION BY device_index ORDER BY time_ns))
SELECT (time_ns - $since) // $w AS b, sum(de) AS energy_j FROM d GROUP BY b
"""


def energy_per_token(con, since_ns: int, until_ns: int, bucket_s: float) -> dict:
    """Energy per output token (J/token) per bucket and overall: the GPUs' energy over the
    bucket (the NVML energy counter's increase, or power × time between samples where the
    counter is missing) / output tokens sampled by the engine in it. Empty without GPU rows."""
    w = max(1, int(bucket_s * NS))
    e = _df(con, _ENERGY_SQL, since=since_ns, until=until_ns, w=w)
    t = _df(
        con,
        "SELECT (start_ns - $since) // $w AS b, sum(num_sampled) AS output_tokens "
        "FROM engine_steps WHERE start_ns >= $since AND start_ns < $until GROUP BY b",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df = e.merge(t, on="b", how="left").sort_values("b").reset_index(drop=True)
    df["j_per_token"] = df["energy_j"] / df["output_tokens"].where(df["output_tokens"] > 0)
    df["t_ns"] = since_ns + df["b"] * w
    energy = float(df["energy_j"].sum()) if not df.empty else None
    (tokens,) = _q(
        con,
        "SELECT sum(num_sampled) FROM engine_steps WHERE start_ns >= $since AND start_ns < $until",
        since=since_ns,
        until=until_ns,
    ).fetchone()
    return {
        "df": _time(df),
        "energy_j": energy,
        "output_tokens": tokens,
        "j_per_token": _div(energy, tokens) if energy is not None else None,
    }
