"""Family ``roofline``: the working steps against the device's roofline, by window of their
start; and :func:`roofline_peaks`, the ceilings from the ``config`` event.

From ``engine_steps.weight_bytes/kv_*_bytes/flops`` and the ``config`` event's device peaks (the
derived values are ``telemetry/schema.py``'s ``STEP_*_SQL``): a step is compute-bound when its
intensity (FLOP per byte moved) is at or above the ridge point (peak GFLOP/s / peak GB/s).
Decode-only: no prefill tokens. Shares are of the window's forward time over the steps with
counts (``ROOFLINE_STEP_SQL``). The compute-bound prefill keys are NULL without peaks.
"""

from __future__ import annotations

from tokenmill.telemetry.recorded_config import RecordedConfig
from tokenmill.telemetry.schema import (
    ROOFLINE_STEP_SQL,
    STEP_BYTES_SQL,
    STEP_GBPS_SQL,
    STEP_GFLOPS_SQL,
    STEP_INTENSITY_SQL,
)

from .family import Family, Yield
from .scope import Scope
from .steps import WORKING_COLUMNS

# the step columns of the roofline's derived values (STEP_*_SQL, ROOFLINE_STEP_SQL)
ROOFLINE_COLUMNS = ("weight_bytes", "kv_read_bytes", "kv_write_bytes", "flops", "forward_ms")

_DECODE_ONLY = f"{ROOFLINE_STEP_SQL} AND num_prefill_tokens = 0"
_COMPUTE_BOUND_PREFILL = (
    f"{ROOFLINE_STEP_SQL} AND num_prefill_chunks > 0 AND {STEP_INTENSITY_SQL} >= $ridge"
)
_ROOFLINE_WINDOW_SQL = f"""
SELECT (start_ns - $t0) // $w AS win,
    sum(forward_ms) FILTER (WHERE {_COMPUTE_BOUND_PREFILL})
        / nullif(sum(forward_ms) FILTER (WHERE {ROOFLINE_STEP_SQL}), 0) AS compute_bound_prefill_share,
    count(*) FILTER (WHERE {_COMPUTE_BOUND_PREFILL}) AS compute_bound_prefill_steps,
    quantile_cont({STEP_INTENSITY_SQL}, 0.5) FILTER (WHERE {_COMPUTE_BOUND_PREFILL}) AS prefill_intensity_p50,
    quantile_cont({STEP_GFLOPS_SQL}, 0.5) FILTER (WHERE {_COMPUTE_BOUND_PREFILL}) AS prefill_gflops_p50,
    sum(forward_ms) FILTER (WHERE {_DECODE_ONLY})
        / nullif(sum(forward_ms) FILTER (WHERE {ROOFLINE_STEP_SQL}), 0) AS decode_forward_share,
    count(*) FILTER (WHERE {_DECODE_ONLY}) AS decode_steps,
    quantile_cont({STEP_INTENSITY_SQL}, 0.5) FILTER (WHERE {_DECODE_ONLY}) AS decode_intensity_p50,
    quantile_cont({STEP_GBPS_SQL}, 0.5) FILTER (WHERE {_DECODE_ONLY}) AS decode_gbps_p50,
    sum(weight_bytes) FILTER (WHERE {_DECODE_ONLY})
        / nullif(sum({STEP_BYTES_SQL}) FILTER (WHERE {_DECODE_ONLY}), 0) AS decode_weight_byte_share
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
GROUP BY win
"""

_KEYS = (
    "compute_bound_prefill_share",
    "compute_bound_prefill_steps",
    "prefill_intensity_p50",
    "prefill_gflops_p50",
    "decode_forward_share",
    "decode_steps",
    "decode_intensity_p50",
    "decode_gbps_p50",
    "decode_weight_byte_share",
)


def roofline_peaks(config: RecordedConfig) -> tuple[float, float, float] | None:
    """``(peak GB/s, peak GFLOP/s, ridge FLOP/byte)`` from the ``config`` event's device peaks
    (:meth:`RecordedConfig.roofline_peaks`); None when either is missing or not positive (a
    store from before the roofline, a failed probe)."""
    return config.roofline_peaks()


def compute(scope: Scope) -> Yield:
    peaks = roofline_peaks(scope.config)
    ridge = peaks[2] if peaks else None
    return Yield(
        scope.by_window(_ROOFLINE_WINDOW_SQL, "start_ns", scope.not_warm_step, ridge=ridge),
        scope.over_range(_ROOFLINE_WINDOW_SQL, "start_ns", ridge=ridge),
    )


FAMILY = Family(
    name="roofline",
    needs={"engine_steps": ("start_ns", *WORKING_COLUMNS, "num_prefill_chunks", *ROOFLINE_COLUMNS)},
    window_keys=_KEYS,
    overall_keys=_KEYS,
    compute=compute,
)
