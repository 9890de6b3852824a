"""Family ``step_split``: where a working step's time went, by window of its start.

The engine's parts of a step (``schedule_ms``, ``prepare_ms`` input preparation, ``forward_ms``,
``sample_ms``, ``detokenize_ms``), the API's after it (``output_send_ms``: the outputs' trip to
the API, ``stream_write_ms``: their writes to the streams), means per window, and the host's
share of the step (schedule + preparation + sampling + detokenization over the step's time).
"""

from __future__ import annotations

from tokenmill.telemetry.schema import WORKING_STEP_SQL

from .steps import start_family

_SPLIT_WINDOW_SQL = f"""
SELECT (start_ns - $t0) // $w AS win,
    avg(schedule_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS schedule_ms_mean,
    avg(forward_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS forward_ms_mean,
    avg(sample_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS sample_ms_mean,
    avg(prepare_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS prepare_ms_mean,
    avg(detokenize_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS detokenize_ms_mean,
    avg(output_send_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS output_send_ms_mean,
    avg(stream_write_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS stream_write_ms_mean,
    avg((schedule_ms + coalesce(prepare_ms, 0) + sample_ms + coalesce(detokenize_ms, 0)) / nullif((end_ns - start_ns) / 1e6, 0)) FILTER (WHERE {WORKING_STEP_SQL}) AS host_share_of_step
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
GROUP BY win
"""

_KEYS = (
    "schedule_ms_mean",
    "forward_ms_mean",
    "sample_ms_mean",
    "prepare_ms_mean",
    "detokenize_ms_mean",
    "output_send_ms_mean",
    "stream_write_ms_mean",
    "host_share_of_step",
)


FAMILY = start_family(
    "step_split",
    _SPLIT_WINDOW_SQL,
    _KEYS,
    "end_ns",
    "schedule_ms",
    "prepare_ms",
    "forward_ms",
    "sample_ms",
    "detokenize_ms",
    "output_send_ms",
    "stream_write_ms",
)
