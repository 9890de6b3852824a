"""Signals: SQL over the trace store, per time window and overall.

Batch size: ``batch_mean`` counts the sequences in each step's forward (prefill chunks plus
decodes); ``running_mean``/``running_max`` read ``num_running``, which the engine counts after
the step, so requests that finish in it are gone (one-token requests read 0 there).

Everything here is a number the rules compare, computed by DuckDB over the tables of
``telemetry/schema.sql``; nothing reads engine objects. Windows are ``window_s`` long, aligned
to the first row of the dump. Request signals are bucketed by arrival (latencies) or by end
(completions, errors); step and device signals by their own start/sample time.

Baselines are the dump's own healthiest windows: for each latency signal, the 25th percentile
of its per-window values over the healthy windows (below), or over every window with traffic
when fewer than ``BASELINE_MIN_HEALTHY`` are healthy. Rules compare a window to that baseline as
a ratio, so thresholds hold across machine speeds (a 2-core CPU and an H200 differ 100x in ms,
not in ratios).

A healthy baseline needs healthy windows: a dump cut to start inside an incident has none, and
then every ratio compares trouble with trouble. A busy window is *healthy* when it shows none of
the absolute trouble markers (a preemption, a block allocation failing in at least
``HEALTHY_MAX_FAILING_STEPS`` of its working steps, errors in at least
``HEALTHY_MAX_ERROR_RATE`` of the requests ending in it, queue time at least
``HEALTHY_MAX_QUEUE_SHARE`` of TTFT); the baseline is usable (``Signals.healthy_baseline``) when
at least ``MIN_HEALTHY_WINDOWS`` busy windows are healthy. Otherwise ``healthy_baseline_reason``
says why, and rules that need the baseline are not judged (``Rule.healthy_baseline``). One
healthy window is enough on purpose: the test only catches the dump that has no healthy period
at all. (Until 2026-12-03 the baseline was the 25th percentile of every busy window: a fault
that filled most of a dump lifted its own yardstick, and a queue that tripled TTFT read 2.6x.)

Warm-up is set apart (seed 000, benchmark hygiene: a test states its warm-up, steady state,
overload and recovery, and does not read its warm-up as a symptom): after each ``server_start``
or ``engine_restart`` event, the requests that arrive before the first ``WARMUP_COMPLETIONS``
of them complete (at most ``WARMUP_MAX_S`` after the first arrival) met cold caches, first
allocations and any kernel compilation. They, and the engine steps that start meanwhile, are
left out of the per-window signals (so of the baseline and of every symptom window); the
overall signals keep them. ``Signals.warmup`` counts them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import duckdb

from tokenmill.telemetry.schema import (
    COMPLETED_SQL,
    DECODE_ONLY_STEP_SQL,
    DEFAULT_BLOCK_SIZE,
    ROOFLINE_STEP_SQL,
    SPEC_STEP_SQL,
    STEP_BYTES_SQL,
    STEP_DECODE_SEQS_SQL,
    STEP_GBPS_SQL,
    STEP_GFLOPS_SQL,
    STEP_INTENSITY_SQL,
    WORKING_STEP_SQL,
    columns,
    spec_agg_sql,
)

NS = 1_000_000_000


class NoTraffic(Exception):
    """The store (or the chosen window) holds no requests."""


@dataclass
class Window:
    """One time window's signals. Latencies in ms, rates per second, ratios 0..1."""

    index: int
    start_ns: int
    end_ns: int
    values: dict[str, float | None] = field(default_factory=dict)

    def get(self, name: str, default=None):
        v = self.values.get(name)
        return default if v is None or (isinstance(v, float) and math.isnan(v)) else v


@dataclass
class Signals:
    """All signals of one dump (or one time range of it)."""

    start_ns: int
    end_ns: int
    window_s: float
    windows: list[Window]
    overall: dict[str, float | None]
    baseline: dict[str, float | None]
    config: dict
    errors_by_type: dict[str, int]
    errors_by_window: dict[int, dict[str, int]]
    device_kind: str | None  # 'gpu', 'host' or None
    con: duckdb.DuckDBPyConnection
    since_ns: int
    until_ns: int
    # whether the dump's healthiest windows are healthy enough to be a baseline, and why not
    healthy_baseline: bool = True
    healthy_baseline_reason: str = ""
    healthy_windows: int = 0
    # the healthy windows' [start_ns, end_ns): the reference a finding's requests are tested
    # against (diagnose/stats.py)
    healthy_ranges: list[tuple[int, int]] = field(default_factory=list)
    busy_windows: int = 0
    # warm-up set apart: {"requests": n, "intervals": [[start_ns, end_ns], ...]}
    warmup: dict = field(default_factory=lambda: {"requests": 0, "intervals": []})
    # SQL for the sequences an engine_steps row decoded (its decode tokens less draft tokens)
    decode_seqs_sql: str = "num_decode_tokens"

    def busy(self, min_arrivals: int = 1) -> list[Window]:
        """Windows with at least ``min_arrivals`` arrivals or completions."""
        return [
            w
            for w in self.windows
            if (w.get("arrivals", 0) or 0) >= min_arrivals
            or (w.get("completions", 0) or 0) >= min_arrivals
        ]

    def examples(self, where: str, params: list | None = None, limit: int = 5) -> list[str]:
        """Up to ``limit`` trace ids of requests matching ``where`` (SQL over ``requests``)."""
        rows = self.con.execute(
            f"SELECT trace_id FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? AND ({where}) "
            f"ORDER BY arrival_ns LIMIT {int(limit)}",
            [self.since_ns, self.until_ns, *(params or [])],
        ).fetchall()
        return [r[0] for r in rows]


_REQ_WINDOW_SQL = f"""
SELECT (arrival_ns - $t0) // $w AS win,
    count(*) AS arrivals,
    count(*) FILTER (WHERE {COMPLETED_SQL}) AS completed_arrivals,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE ok) AS ttft_p50,
    quantile_cont(ttft_ms, 0.9) FILTER (WHERE ok) AS ttft_p90,
    quantile_cont(ttft_ms, 0.99) FILTER (WHERE ok) AS ttft_p99,
    quantile_cont(itl_p50_ms, 0.5) FILTER (WHERE ok) AS itl_p50,
    quantile_cont(itl_p99_ms, 0.99) FILTER (WHERE ok) AS itl_p99,
    max(itl_max_ms) FILTER (WHERE ok) AS itl_max,
    quantile_cont(tpot_ms, 0.5) FILTER (WHERE ok) AS tpot_p50,
    quantile_cont(tpot_ms, 0.99) FILTER (WHERE ok) AS tpot_p99,
    quantile_cont(queue_ms, 0.5) FILTER (WHERE ok) AS queue_p50,
    quantile_cont(queue_ms, 0.99) FILTER (WHERE ok) AS queue_p99,
    quantile_cont(prefill_ms, 0.5) FILTER (WHERE ok) AS prefill_p50,
    quantile_cont(prefill_ms, 0.99) FILTER (WHERE ok) AS prefill_p99,
    quantile_cont(e2e_ms, 0.5) FILTER (WHERE ok) AS e2e_p50,
    quantile_cont(e2e_ms, 0.99) FILTER (WHERE ok) AS e2e_p99,
    avg(queue_ms / nullif(ttft_ms, 0)) FILTER (WHERE ok) AS queue_share_of_ttft,
    avg(prefill_ms / nullif(ttft_ms, 0)) FILTER (WHERE ok) AS prefill_share_of_ttft,
    quantile_cont(input_tokens, 0.5) AS input_p50,
    quantile_cont(input_tokens, 0.99) AS input_p99,
    max(input_tokens) AS input_max,
    sum(coalesce(preemptions, 0)) AS preempted_requests_n,
    sum(coalesce(recomputed_tokens, 0)) AS recomputed_tokens,
    sum(cached_tokens)::DOUBLE / nullif(sum(input_tokens), 0) AS prefix_hit_rate,
    quantile_cont(client_ttft_ms, 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL) AS client_ttft_p50,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL) AS server_ttft_p50_with_client,
    quantile_cont(ttft_ms + coalesce(text_holdback_ms, 0), 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL) AS server_first_text_p50_with_client,
    quantile_cont(((end_ns - first_token_ns) / 1e6) / nullif(output_tokens - 1, 0) / nullif(tpot_ms, 0), 0.5)
        FILTER (WHERE ok AND output_tokens >= 8) AS stream_vs_engine_tpot,
    quantile_cont(ttft_ms, 0.99) FILTER (WHERE ok AND input_tokens <= $short) AS short_ttft_p99,
    count(*) FILTER (WHERE ok AND input_tokens <= $short) AS short_n,
    avg(queue_ms / nullif(ttft_ms, 0)) FILTER (WHERE ok AND input_tokens <= $short) AS short_queue_share,
    count(*) FILTER (WHERE ok AND input_tokens >= 4 * $short) AS long_n,
    count(*) FILTER (WHERE ok AND itl_max_ms >= 10 * itl_p50_ms AND ttft_ms <= $fast_ttft) AS stalled_n,
    count(*) FILTER (WHERE ok AND itl_max_ms >= 10 * itl_p50_ms AND ttft_ms <= $fast_ttft AND preemptions > 0) AS stalled_preempted_n,
    count(kv_transfer_ms) AS kv_transfers,
    quantile_cont(kv_transfer_ms, 0.5) AS kv_transfer_p50,
    quantile_cont(kv_transfer_ms / nullif(ttft_ms, 0), 0.5) FILTER (WHERE ok) AS kv_transfer_share_of_ttft,
    quantile_cont(kv_transfer_bytes, 0.5) AS kv_transfer_bytes_p50,
    quantile_cont(kv_wait_ms, 0.5) AS kv_wait_p50
FROM (SELECT *, {COMPLETED_SQL} AS ok FROM requests
      WHERE arrival_ns >= $since AND arrival_ns < $until)
GROUP BY win
"""

_END_WINDOW_SQL = f"""
SELECT (end_ns - $t0) // $w AS win,
    count(*) FILTER (WHERE {COMPLETED_SQL}) AS completions,
    count(*) FILTER (WHERE error_type IS NOT NULL) AS errors,
    count(*) AS ended,
    sum(output_tokens) FILTER (WHERE {COMPLETED_SQL}) AS completed_tokens
FROM requests WHERE end_ns >= $since AND end_ns < $until
GROUP BY win
"""

# Tensor parallelism (engine/parallel/): rank 0's time in collectives (StepRecord.collective_ms:
# the step's broadcast and the row-parallel layers' all-reduces) as a share of the forward, in
# decode-only and in prefill steps. Seed 003 §5.2 pitfall 5: two all-reduces a layer hide
# behind a prefill's compute and stand exposed in decode.
_TP_DECODE = "num_prefill_tokens = 0 AND num_decode_tokens > 0 AND collective_ms IS NOT NULL"
_TP_PREFILL = "num_prefill_tokens > 0 AND collective_ms IS NOT NULL"
_COLLECTIVE_WINDOW_SQL = f"""
SELECT (start_ns - $t0) // $w AS win,
    sum(collective_ms) FILTER (WHERE {_TP_DECODE})
        / nullif(sum(forward_ms) FILTER (WHERE {_TP_DECODE}), 0) AS decode_collective_share,
    avg(collective_ms) FILTER (WHERE {_TP_DECODE}) AS decode_collective_ms_mean,
    avg(forward_ms) FILTER (WHERE {_TP_DECODE}) AS decode_forward_ms_mean,
    avg(collective_bytes) FILTER (WHERE {_TP_DECODE}) AS decode_collective_bytes_mean,
    count(*) FILTER (WHERE {_TP_DECODE}) AS collective_decode_steps,
    sum(collective_ms) FILTER (WHERE {_TP_PREFILL})
        / nullif(sum(forward_ms) FILTER (WHERE {_TP_PREFILL}), 0) AS prefill_collective_share
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
GROUP BY win
"""

# Data parallelism (engine/api/replicas.py): per window and replica, the requests the router
# sent there (by arrival) and the replica's mean running requests over its step records (idle
# heartbeats included: a replica with nothing to do sends one every 0.5 s).
_REPLICA_REQ_SQL = f"""
SELECT (arrival_ns - $t0) // $w AS win, replica,
    count(*) AS arrivals,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE {COMPLETED_SQL}) AS ttft_p50,
    quantile_cont(queue_ms, 0.5) FILTER (WHERE {COMPLETED_SQL}) AS queue_p50
FROM requests
WHERE arrival_ns >= $since AND arrival_ns < $until AND replica IS NOT NULL
GROUP BY ALL
"""
_REPLICA_STEP_SQL = """
SELECT (start_ns - $t0) // $w AS win, replica, avg(num_running) AS running_mean
FROM engine_steps
WHERE start_ns >= $since AND start_ns < $until AND replica IS NOT NULL
GROUP BY ALL
"""

# Prefill/decode disaggregation (engine/api/disaggregated.py): per window and side
# (engine_steps.role), the time its engine cores spent in working steps, its queue, and the
# decode side's KV use and hand-offs held for room (num_kv_waiting). Idle heartbeats count for
# the queue and KV columns: a side with nothing to do sends one every 0.5 s.
_PD_STEP_SQL = f"""
SELECT (start_ns - $t0) // $w AS win, role,
    count(DISTINCT replica) AS workers,
    sum((end_ns - start_ns) / 1e6) FILTER (WHERE {WORKING_STEP_SQL}) AS busy_ms,
    sum(num_prefill_tokens) AS prefill_tokens,
    avg(num_waiting) AS waiting_mean,
    max(num_running) AS running_max,
    avg(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_use_mean,
    max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_use_max,
    __KV_WAITING__ AS kv_waiting_mean
FROM engine_steps
WHERE start_ns >= $since AND start_ns < $until AND role IN ('prefill', 'decode')
GROUP BY ALL
"""

# Idle heartbeats (not WORKING_STEP_SQL) count only for the KV and idle columns.
_STEP_WINDOW_SQL = f"""
SELECT (start_ns - $t0) // $w AS win,
    count(*) FILTER (WHERE {WORKING_STEP_SQL}) AS steps,
    quantile_cont((end_ns - start_ns) / 1e6, 0.5) FILTER (WHERE {WORKING_STEP_SQL}) AS step_ms_p50,
    quantile_cont((end_ns - start_ns) / 1e6, 0.99) FILTER (WHERE {WORKING_STEP_SQL}) AS step_ms_p99,
    avg((end_ns - start_ns) / 1e6) FILTER (WHERE {WORKING_STEP_SQL}) AS step_ms_mean,
    quantile_cont((end_ns - start_ns) / 1e6, 0.5) FILTER (WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0) AS decode_step_ms_p50,
    quantile_cont((end_ns - start_ns) / 1e6, 0.5) FILTER (WHERE num_prefill_tokens > 0 AND num_running > num_prefill_chunks) AS mixed_step_ms_p50,
    max((end_ns - start_ns) / 1e6) FILTER (WHERE num_prefill_tokens > 0 AND num_running > num_prefill_chunks) AS mixed_step_ms_max,
    max(num_prefill_tokens) AS prefill_tokens_max,
    sum(num_prefill_tokens)::DOUBLE / nullif(sum(num_prefill_tokens + num_decode_tokens), 0) AS prefill_token_share,
    avg(num_prefill_tokens + num_decode_tokens) FILTER (WHERE {WORKING_STEP_SQL}) AS tokens_per_step,
    sum(num_sampled) AS sampled_tokens,
    avg(num_running) FILTER (WHERE {WORKING_STEP_SQL}) AS running_mean,
    avg(num_prefill_chunks + __DECODE_SEQS__) FILTER (WHERE {WORKING_STEP_SQL}) AS batch_mean,
    max(num_running) AS running_max,
    avg(num_waiting) AS waiting_mean,
    max(num_waiting) AS waiting_max,
    avg(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_mean,
    max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_max,
    min(kv_blocks_free) AS kv_free_min,
    max(kv_blocks_total) AS kv_blocks_total,
    sum(allocation_failures) AS allocation_failures,
    count(*) FILTER (WHERE allocation_failures > 0 AND {WORKING_STEP_SQL}) AS allocation_failure_steps,
    avg(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) FILTER (WHERE allocation_failures > 0) AS kv_usage_at_failures,
    sum(num_preempted) AS preemptions,
    avg(schedule_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS schedule_ms_mean,
    avg(forward_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS forward_ms_mean,
    avg(sample_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS sample_ms_mean,
    avg(prepare_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS prepare_ms_mean,
    avg(detokenize_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS detokenize_ms_mean,
    avg(output_send_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS output_send_ms_mean,
    avg(stream_write_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS stream_write_ms_mean,
    avg((schedule_ms + coalesce(prepare_ms, 0) + sample_ms + coalesce(detokenize_ms, 0)) / nullif((end_ns - start_ns) / 1e6, 0)) FILTER (WHERE {WORKING_STEP_SQL}) AS host_share_of_step,
    max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) FILTER (WHERE num_running = 0 AND num_waiting = 0) AS idle_kv_usage_max,
    count(*) FILTER (WHERE num_running = 0 AND num_waiting = 0) AS idle_steps
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
GROUP BY win
"""

# Roofline of the working steps (engine_steps.weight_bytes/kv_*_bytes/flops, the config event's
# device peaks; the derived values are telemetry/schema.py's STEP_*_SQL): a step is
# compute-bound when its intensity (FLOP per byte moved) is at or above the ridge point
# ($ridge = peak GFLOP/s / peak GB/s). Decode-only: no prefill tokens. Shares are of the
# window's forward time over the steps with counts (ROOFLINE_STEP_SQL).
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

# Speculative decoding (telemetry/schema.py: SPEC_STEP_SQL, spec_agg_sql): what drafts gain and
# what they cost. Decode-only steps that verified drafts against those that did not, compared
# within the same batch class (decode sequences in the same power of two): `spec_step_cost` is
# the draft steps' mean forward_ms over the plain steps' in their class, weighted by draft steps
# (NULL when no class holds both kinds); `spec_gain_per_cost` is (1 + accepted tokens per draft)
# over that cost: the output tokens a draft step yields per unit of a plain step's time, relative
# to a plain step's one token (below 1, speculation slows decode). `spec_intensity_p50` is the
# median FLOP/byte of the decode-only draft steps (the roofline; NULL without its columns).
_SPEC_WINDOW_SQL = f"""
WITH s AS (
    SELECT (start_ns - $t0) // $w AS win, *, {SPEC_STEP_SQL} AS spec,
        {DECODE_ONLY_STEP_SQL} AS decode_only, {STEP_DECODE_SEQS_SQL} AS batch,
        CAST(floor(log2(greatest({STEP_DECODE_SEQS_SQL}, 1))) AS INTEGER) AS batch_class,
        $intensity AS intensity
    FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
), cls AS (
    SELECT win, batch_class, count(*) FILTER (WHERE spec) AS n_spec,
        avg(forward_ms) FILTER (WHERE spec) AS spec_ms,
        avg(forward_ms) FILTER (WHERE NOT spec) AS plain_ms
    FROM s WHERE decode_only GROUP BY win, batch_class
), cost AS (
    SELECT win, sum(n_spec * spec_ms / plain_ms) / nullif(sum(n_spec), 0) AS spec_step_cost,
        sum(n_spec) AS spec_matched_steps
    FROM cls WHERE n_spec > 0 AND plain_ms > 0 GROUP BY win
), agg AS (
    SELECT win, {spec_agg_sql()},
        count(*) FILTER (WHERE decode_only AND spec) AS spec_decode_steps,
        count(*) FILTER (WHERE decode_only AND NOT spec) AS plain_decode_steps,
        avg(forward_ms) FILTER (WHERE decode_only AND spec) AS spec_step_ms,
        avg(forward_ms) FILTER (WHERE decode_only AND NOT spec) AS plain_decode_step_ms,
        avg(batch) FILTER (WHERE decode_only AND spec) AS spec_batch_mean,
        quantile_cont(intensity, 0.5) FILTER (WHERE decode_only AND spec) AS spec_intensity_p50,
        sum(forward_ms) FILTER (WHERE spec) / nullif(sum(forward_ms) FILTER (WHERE {WORKING_STEP_SQL}), 0)
            AS spec_forward_share
    FROM s GROUP BY win
)
SELECT win, agg.* EXCLUDE (win), cost.spec_step_cost, cost.spec_matched_steps,
    (1 + agg.spec_accepted_per_draft) / nullif(cost.spec_step_cost, 0) AS spec_gain_per_cost
FROM agg LEFT JOIN cost USING (win)
"""
# the intensity of a step counted on the roofline, NULL otherwise (or without its columns)
_SPEC_INTENSITY = f"CASE WHEN {ROOFLINE_STEP_SQL} THEN {STEP_INTENSITY_SQL} END"

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

# The same work, slower: each working step against the quickest quarter of the steps that did the
# same work (same batch: prefill chunks + decodes; tokens in the same power of two), over the
# whole range; classes with fewer than 5 steps are left out. A window's `same_work_slowdown` is
# the median of its steps' ratios: 1.0 when the steps ran as fast as the dump's usual best for
# their work, 2.0 when the same work took twice as long (host_contention).
_SAME_WORK_WINDOW_SQL = f"""
WITH s AS (
    SELECT start_ns, (end_ns - start_ns) / 1e6 AS ms,
        num_prefill_chunks + __DECODE_SEQS__ AS batch,
        CAST(floor(log2(greatest(num_prefill_tokens + num_decode_tokens, 1))) AS INTEGER) AS tok_class
    FROM engine_steps WHERE start_ns >= $since AND start_ns < $until AND {WORKING_STEP_SQL}
), ref AS (
    SELECT batch, tok_class, quantile_cont(ms, 0.25) AS ref_ms
    FROM s GROUP BY batch, tok_class HAVING count(*) >= 5
)
SELECT (start_ns - $t0) // $w AS win,
    quantile_cont(ms / ref_ms, 0.5) AS same_work_slowdown,
    count(*) AS same_work_steps
FROM s JOIN ref USING (batch, tok_class) WHERE ref_ms > 0
GROUP BY win
"""

# latency signals whose healthy level is the dump's best windows
BASELINE_KEYS = (
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "tpot_p50",
    "tpot_p99",
    "queue_p50",
    "queue_p99",
    "prefill_p50",
    "prefill_p99",
    "e2e_p50",
    "e2e_p99",
    "short_ttft_p99",
    "step_ms_p50",
    "step_ms_p99",
    "decode_step_ms_p50",
    "kv_usage_max",
    "error_rate",
    "sm_clock_mean",
    "throughput_tok_s",
)
BASELINE_QUANTILE = 0.25  # "the healthiest windows": the best quarter of windows with traffic
BASELINE_MIN_HEALTHY = 2  # healthy windows needed to take the baseline from them alone
# a healthy window's ceilings: error_spike's min_rate (5%) and ttft_queueing's queue_share (half)
HEALTHY_MAX_ERROR_RATE = 0.05
HEALTHY_MAX_QUEUE_SHARE = 0.5
# kv_pressure_preemption's absolute_failing_steps: allocations failing in most steps
HEALTHY_MAX_FAILING_STEPS = 0.5
MIN_HEALTHY_WINDOWS = 1
# a window with fewer requests ending than this cannot show an error rate under 5% on its own
# (one error in 10 is already 10%): it is judged on the whole range's error rate instead
HEALTHY_MIN_ENDED = 10
# warm-up after a (re)start: arrivals before the first completion, at most 30 s after the first
# arrival (one finished request has run the whole prefill + decode path once: every kernel
# compiled, the first blocks allocated; a server that never completes anything is not warming up)
WARMUP_EVENTS = ("server_start", "engine_restart")
WARMUP_COMPLETIONS = 1
WARMUP_MAX_S = 30.0


def warmup_intervals(con, since_ns: int, until_ns: int) -> list[tuple[int, int]]:
    """Arrival-time intervals ``[start_ns, end_ns)`` of warm-up within ``[since_ns, until_ns)``:
    from each ``server_start``/``engine_restart`` event (at or before ``until_ns``; one before
    ``since_ns`` counts when its warm-up reaches into the range) to the end of the
    ``WARMUP_COMPLETIONS``-th completed request that arrived after it, capped at
    ``WARMUP_MAX_S`` after its first arrival and at the next start event. Empty for a store
    without start events (a dump cut after the start, a synthetic store)."""
    starts = [
        t
        for (t,) in con.execute(
            "SELECT time_ns FROM events WHERE kind IN ? AND time_ns < ? ORDER BY time_ns",
            [list(WARMUP_EVENTS), until_ns],
        ).fetchall()
    ]
    out = []
    for i, start in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else until_ns
        (first,) = con.execute(
            "SELECT min(arrival_ns) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?",
            [start, nxt],
        ).fetchone()
        if first is None:
            continue
        done = con.execute(
            f"SELECT end_ns FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
            f"AND {COMPLETED_SQL} ORDER BY end_ns LIMIT 1 OFFSET {WARMUP_COMPLETIONS - 1}",
            [start, nxt],
        ).fetchone()
        end = min(first + int(WARMUP_MAX_S * NS), nxt)
        if done is not None:
            end = min(end, done[0] + 1)  # the K-th completion's own arrival is inside
        lo, hi = max(start, since_ns), min(end, until_ns)
        if hi > lo:
            out.append((lo, hi))
    return out


def _outside(column: str, intervals: list[tuple[int, int]]) -> str:
    """SQL: ``column`` lies in none of ``intervals`` (``TRUE`` when there are none)."""
    if not intervals:
        return "TRUE"
    inside = " OR ".join(f"({column} >= {int(a)} AND {column} < {int(b)})" for a, b in intervals)
    return f"NOT ({inside})"


def _set_apart(sql: str, column: str, cond: str) -> str:
    """``sql`` with ``cond`` added to its one ``WHERE <column> >= $since`` filter."""
    marker = f"WHERE {column} >= $since"
    if sql.count(marker) != 1:
        raise ValueError(f"warm-up filter: expected one {marker!r} in the query")
    return sql.replace(marker, f"WHERE {cond} AND {marker.removeprefix('WHERE ')}")


def _judge_baseline(
    busy: list[Window], range_error_rate: float | None
) -> tuple[bool, list[Window], str]:
    """Whether the healthiest windows can serve as a baseline: ``(usable, healthy windows,
    reason it is not)``. A healthy window is busy and shows no preemption, allocation failures
    in fewer than ``HEALTHY_MAX_FAILING_STEPS`` of its working steps, errors below
    ``HEALTHY_MAX_ERROR_RATE`` (a window with fewer than ``HEALTHY_MIN_ENDED`` requests ending:
    ``range_error_rate``, the whole range's, when higher) and queue time below
    ``HEALTHY_MAX_QUEUE_SHARE`` of TTFT; usable with at least ``MIN_HEALTHY_WINDOWS`` of them.
    Returns the healthy windows themselves as the second item."""

    def error_rate(w: Window) -> float:
        rate = w.get("error_rate") or 0
        if (w.get("ended") or 0) < HEALTHY_MIN_ENDED:
            rate = max(rate, range_error_rate or 0)
        return rate

    markers = {
        "preemptions": lambda w: (
            (w.get("preemptions") or 0) > 0 or (w.get("preempted_requests_n") or 0) > 0
        ),
        "allocation failures in most steps": lambda w: (
            (w.get("allocation_failure_steps") or 0)
            >= HEALTHY_MAX_FAILING_STEPS * max(w.get("steps") or 0, 1)
        ),
        f"errors in ≥ {HEALTHY_MAX_ERROR_RATE:.0%} of requests": lambda w: (
            error_rate(w) >= HEALTHY_MAX_ERROR_RATE
        ),
        f"queue time ≥ {HEALTHY_MAX_QUEUE_SHARE:.0%} of TTFT": lambda w: (
            (w.get("queue_share_of_ttft") or 0) >= HEALTHY_MAX_QUEUE_SHARE
        ),
    }
    healthy = [w for w in busy if not any(m(w) for m in markers.values())]
    need = MIN_HEALTHY_WINDOWS
    if len(healthy) >= need:
        return True, healthy, ""
    if not busy:
        return False, [], "no window has a completed request to compare with"
    seen = ", ".join(
        f"{name} in {n}" for name, m in markers.items() if (n := sum(1 for w in busy if m(w)))
    )
    return (
        False,
        healthy,
        f"{len(healthy)} of {len(busy)} busy windows healthy, {need} needed ({seen})",
    )


def _span(con, since_ns: int | None, until_ns: int | None) -> tuple[int, int]:
    lo, hi = con.execute(
        "SELECT min(t0), max(t1) FROM ("
        " SELECT min(arrival_ns) t0, max(end_ns) t1 FROM requests"
        " UNION ALL SELECT min(start_ns), max(end_ns) FROM engine_steps)"
    ).fetchone()
    if lo is None:
        raise NoTraffic("the store holds no requests and no engine steps")
    return (since_ns if since_ns is not None else lo), (
        until_ns if until_ns is not None else hi + 1
    )


def _replica_windows(
    con, params: dict, size: int, not_warm_req: str, not_warm_step: str
) -> dict[int, dict]:
    """Per window, the spread between data-parallel replicas (``size`` of them, ids ``0 ..
    size - 1``): ``replicas``; ``replica_hot`` (the one the most requests arrived at) with its
    ``replica_arrivals_max``, ``replica_ttft_p50_hot`` and ``replica_queue_p50_hot`` (ms);
    ``replica_cool`` (the fewest arrivals, 0 for a replica that got none) with
    ``replica_arrivals_min`` and ``replica_ttft_p50_cool``; ``replica_running_mean_min`` /
    ``_max`` (mean running requests over each replica's step records; a replica with no
    record in the window counts 0). Empty below two replicas or in a store without the
    ``replica`` columns."""
    if size < 2:
        return {}
    if "replica" not in {c.lower() for c in columns(con, "requests")}:
        return {}
    by_win: dict[int, dict[int, dict]] = {}
    cur = con.execute(_set_apart(_REPLICA_REQ_SQL, "arrival_ns", not_warm_req), params)
    names = [d[0] for d in cur.description]
    for row in cur.fetchall():
        r = dict(zip(names, row, strict=True))
        by_win.setdefault(int(r["win"]), {})[int(r["replica"])] = r
    running: dict[int, dict[int, float]] = {}
    steps_sql = _set_apart(_REPLICA_STEP_SQL, "start_ns", not_warm_step)
    for win, replica, mean in con.execute(steps_sql, params).fetchall():
        running.setdefault(int(win), {})[int(replica)] = float(mean or 0.0)
    out = {}
    for win in set(by_win) | set(running):
        reqs = by_win.get(win, {})
        arrivals = {r: (reqs.get(r) or {}).get("arrivals") or 0 for r in range(size)}
        hot = max(arrivals, key=lambda r: (arrivals[r], -r))
        cool = min((r for r in arrivals if r != hot), key=lambda r: (arrivals[r], r))
        run = [running.get(win, {}).get(r, 0.0) for r in range(size)]
        out[win] = {
            "replicas": size,
            "replica_hot": hot,
            "replica_arrivals_max": arrivals[hot],
            "replica_ttft_p50_hot": (reqs.get(hot) or {}).get("ttft_p50"),
            "replica_queue_p50_hot": (reqs.get(hot) or {}).get("queue_p50"),
            "replica_cool": cool,
            "replica_arrivals_min": arrivals[cool],
            "replica_ttft_p50_cool": (reqs.get(cool) or {}).get("ttft_p50"),
            "replica_running_mean_min": min(run),
            "replica_running_mean_max": max(run),
        }
    return out


def _pd_windows(con, params: dict, not_warm_step: str) -> dict[int, dict]:
    """Per window, each side of a disaggregated server (``engine_steps.role``):
    ``pd_prefill_busy`` / ``pd_decode_busy`` (the share of the window its engine cores spent in
    working steps, 0..1, averaged over the side's cores), ``pd_prefill_waiting_mean`` (requests
    queued on the prefill side, mean over its step records), ``pd_prefill_tok_per_s`` (prompt
    tokens the side prefilled per second of its cores' working steps, all cores together), ``pd_decode_running_max``,
    ``pd_decode_kv_use_mean`` / ``_max`` (0..1), ``pd_decode_kv_waiting_mean`` (hand-offs held
    at the decode side for room) and ``pd_prefill_workers`` / ``pd_decode_workers``. Empty for a
    colocated server and in a store without the ``role`` column."""
    cols = {c.lower() for c in columns(con, "engine_steps")}
    if "role" not in cols:
        return {}
    kv_waiting = "avg(num_kv_waiting)" if "num_kv_waiting" in cols else "NULL::DOUBLE"
    sql = _set_apart(_PD_STEP_SQL.replace("__KV_WAITING__", kv_waiting), "start_ns", not_warm_step)
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    out: dict[int, dict] = {}
    for row in cur.fetchall():
        r = dict(zip(names, row, strict=True))
        win, side = int(r["win"]), r["role"]
        start = params["since"] + win * params["w"]
        span_ms = (min(start + params["w"], params["until"]) - start) / 1e6
        workers = max(int(r["workers"] or 1), 1)
        v = out.setdefault(win, {})
        v[f"pd_{side}_workers"] = workers
        busy_ms = r["busy_ms"] or 0.0
        # a step that runs past the window's end counts in the window it started in
        v[f"pd_{side}_busy"] = min(1.0, busy_ms / (span_ms * workers)) if span_ms > 0 else None
        if side == "prefill":
            v["pd_prefill_waiting_mean"] = r["waiting_mean"]
            tokens = r["prefill_tokens"] or 0
            v["pd_prefill_tok_per_s"] = tokens / busy_ms * 1e3 * workers if busy_ms else None
        else:
            v["pd_decode_running_max"] = r["running_max"]
            v["pd_decode_kv_use_mean"] = r["kv_use_mean"]
            v["pd_decode_kv_use_max"] = r["kv_use_max"]
            v["pd_decode_kv_waiting_mean"] = r["kv_waiting_mean"]
    return out


_RANK_TIMES_SQL = """
SELECT (start_ns - $t0) // $w AS win, rank_compute_ms
FROM engine_steps
WHERE start_ns >= $since AND start_ns < $until AND len(rank_compute_ms) > 1
"""


def _rank_windows(con, params: dict, not_warm_step: str) -> dict[int, dict]:
    """Per window, how the tensor-parallel ranks' forward times outside collectives
    (``engine_steps.rank_compute_ms``, one list every 16 steps) compare: ``rank_samples``;
    ``slowest_rank`` (the rank slowest most often) and ``slowest_rank_share`` (the share of
    samples it was slowest in); ``rank_spread_p50`` (median of slowest / fastest);
    ``slowest_rank_ms`` / ``fastest_rank_ms`` (means of the slowest and fastest rank's time per
    sample, ms). Empty in a store without the column."""
    if "rank_compute_ms" not in {c.lower() for c in columns(con, "engine_steps")}:
        return {}
    by_win: dict[int, list[list[float]]] = {}
    for win, times in con.execute(
        _set_apart(_RANK_TIMES_SQL, "start_ns", not_warm_step), params
    ).fetchall():
        by_win.setdefault(int(win), []).append([float(t) for t in times])
    out = {}
    for win, samples in by_win.items():
        slowest = [max(range(len(t)), key=t.__getitem__) for t in samples]
        rank = max(set(slowest), key=lambda r: (slowest.count(r), -r))
        spreads = [max(t) / min(t) for t in samples if min(t) > 0]
        out[win] = {
            "rank_samples": len(samples),
            "slowest_rank": rank,
            "slowest_rank_share": slowest.count(rank) / len(samples),
            "rank_spread_p50": _quantile(spreads, 0.5),
            "slowest_rank_ms": sum(max(t) for t in samples) / len(samples),
            "fastest_rank_ms": sum(min(t) for t in samples) / len(samples),
        }
    return out


def _rows(con, sql: str, params: dict) -> dict[int, dict]:
    cur = con.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})
    cols = [d[0] for d in cur.description]
    return {int(r[0]): dict(zip(cols[1:], r[1:], strict=True)) for r in cur.fetchall()}


def _quantile(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    pos = (len(vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def load(
    con: duckdb.DuckDBPyConnection,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    window_s: float = 10.0,
    short_prompt_tokens: int | None = None,
) -> Signals:
    """Compute every signal of the store behind ``con``.

    Args:
        con: an open trace store or dump (checked by the caller).
        since_ns, until_ns: the time range (wall-clock ns); default: all of it.
        window_s: window length (s).
        short_prompt_tokens: prompts up to this many tokens count as "short" (default: the
            dump's median prompt length).

    Raises:
        NoTraffic: no requests in the range.
    """
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s} s")
    since, until = _span(con, since_ns, until_ns)
    (n_req,) = con.execute(
        "SELECT count(*) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?", [since, until]
    ).fetchone()
    if n_req == 0:
        raise NoTraffic("no requests arrived in the chosen time range")
    w_ns = int(window_s * NS)
    if short_prompt_tokens is None:
        (med,) = con.execute(
            "SELECT quantile_disc(input_tokens, 0.5) FROM requests "
            "WHERE arrival_ns >= ? AND arrival_ns < ? AND input_tokens IS NOT NULL",
            [since, until],
        ).fetchone()
        short_prompt_tokens = int(med or 0)
    (fast_ttft,) = con.execute(
        "SELECT quantile_cont(ttft_ms, 0.5) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND {COMPLETED_SQL}",
        [since, until],
    ).fetchone()
    params = {"t0": since, "w": w_ns, "since": since, "until": until}
    config = _engine_config(con)
    peaks = roofline_peaks(config)
    # a store written before the roofline step fields lacks their columns: no roofline signals
    step_cols = {c.lower() for c in columns(con, "engine_steps")}
    roofline = "flops" in step_cols
    # sequences a step decoded: draft tokens (speculative decoding) are not sequences
    seqs = STEP_DECODE_SEQS_SQL if "num_draft_tokens" in step_cols else "num_decode_tokens"

    def _seqs(sql: str) -> str:
        return sql.replace("__DECODE_SEQS__", seqs)

    roof_params = {**params, "ridge": peaks[2] if peaks else None}
    # warm-up set apart from the per-window signals (requests by arrival, steps by start)
    warm = warmup_intervals(con, since, until)
    not_warm_req, not_warm_step = _outside("arrival_ns", warm), _outside("start_ns", warm)
    (n_warm,) = con.execute(
        f"SELECT count(*) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND NOT ({not_warm_req})",
        [since, until],
    ).fetchone()
    req = _rows(
        con,
        _set_apart(_REQ_WINDOW_SQL, "arrival_ns", not_warm_req),
        {**params, "short": short_prompt_tokens, "fast_ttft": (fast_ttft or 0) * 2},
    )
    ends = _rows(con, _set_apart(_END_WINDOW_SQL, "end_ns", not_warm_req), params)
    steps = _rows(con, _set_apart(_seqs(_STEP_WINDOW_SQL), "start_ns", not_warm_step), params)
    roof = (
        _rows(con, _set_apart(_ROOFLINE_WINDOW_SQL, "start_ns", not_warm_step), roof_params)
        if roofline
        else {}
    )
    kinds = [k for (k,) in con.execute("SELECT DISTINCT kind FROM device_samples").fetchall()]
    device_kind = "gpu" if "gpu" in kinds else ("host" if "host" in kinds else None)
    # stores written before the process census (telemetry/host_procs.py) lack its column
    loadgen = "loadgen_cpu_pct" if "loadgen_cpu_pct" in columns(con, "device_samples") else "NULL"
    dev = _rows(
        con,
        _DEVICE_WINDOW_SQL.replace("__LOADGEN__", loadgen),
        {**params, "kind": device_kind or "none"},
    )
    same_work = _rows(
        con, _set_apart(_seqs(_SAME_WORK_WINDOW_SQL), "start_ns", not_warm_step), params
    )
    # a store written before the speculative-decoding step fields: no spec signals
    spec_sql = _spec_sql(con, roofline)
    spec = _rows(con, _set_apart(spec_sql, "start_ns", not_warm_step), params) if spec_sql else {}
    collectives = (
        _rows(con, _set_apart(_COLLECTIVE_WINDOW_SQL, "start_ns", not_warm_step), params)
        if "collective_ms" in step_cols
        else {}
    )
    ranks = _rank_windows(con, params, not_warm_step)
    pd = _pd_windows(con, params, not_warm_step)
    replicas = _replica_windows(
        con, params, int(config.get("data_parallel_size") or 1), not_warm_req, not_warm_step
    )
    errors_by_window: dict[int, dict[str, int]] = {}
    for win, etype, n in con.execute(
        "SELECT (end_ns - $t0) // $w, error_type, count(*) FROM requests "
        f"WHERE {not_warm_req} AND end_ns >= $since AND end_ns < $until "
        "AND error_type IS NOT NULL GROUP BY ALL",
        params,
    ).fetchall():
        errors_by_window.setdefault(int(win), {})[etype] = n
    n_windows = max(1, math.ceil((until - since) / w_ns))
    windows = []
    for i in range(n_windows):
        values: dict = {}
        for src in (req, ends, steps, roof, dev, same_work, spec, replicas, collectives, ranks, pd):
            values.update(src.get(i, {}))
        ended = values.get("ended") or 0
        values["error_rate"] = (values.get("errors") or 0) / ended if ended else None
        values["arrival_rate"] = (values.get("arrivals") or 0) / window_s
        values["completion_rate"] = (values.get("completions") or 0) / window_s
        sampled = values.get("sampled_tokens")
        values["throughput_tok_s"] = (sampled / window_s) if sampled else None
        windows.append(
            Window(i, since + i * w_ns, min(since + (i + 1) * w_ns, until), values=values)
        )
    busy = [w for w in windows if (w.get("completed_arrivals") or 0) > 0]
    overall = _rows(
        con,
        _REQ_WINDOW_SQL.replace("(arrival_ns - $t0) // $w", "0"),
        {**params, "short": short_prompt_tokens, "fast_ttft": (fast_ttft or 0) * 2},
    ).get(0, {})
    overall.update(
        _rows(con, _seqs(_STEP_WINDOW_SQL).replace("(start_ns - $t0) // $w", "0"), params).get(
            0, {}
        )
    )
    overall.update(
        _rows(con, _END_WINDOW_SQL.replace("(end_ns - $t0) // $w", "0"), params).get(0, {})
    )
    if roofline:
        overall.update(
            _rows(
                con, _ROOFLINE_WINDOW_SQL.replace("(start_ns - $t0) // $w", "0"), roof_params
            ).get(0, {})
        )
    if spec_sql:
        overall.update(
            _rows(con, spec_sql.replace("(start_ns - $t0) // $w", "0"), params).get(0, {})
        )
    overall["short_prompt_tokens"] = short_prompt_tokens
    ended = overall.get("ended") or 0
    overall["error_rate"] = (overall.get("errors") or 0) / ended if ended else None
    usable, healthy, why_not = _judge_baseline(busy, overall["error_rate"])
    # the baseline: the healthiest quarter of the healthy windows (of every busy window when
    # fewer than BASELINE_MIN_HEALTHY are healthy): a fault that fills most of a dump must not
    # lift its own yardstick
    ref = healthy if len(healthy) >= BASELINE_MIN_HEALTHY else busy
    baseline = {}
    for key in BASELINE_KEYS:
        vals = [w.get(key) for w in ref]
        if key in ("sm_clock_mean", "throughput_tok_s"):  # higher is healthier
            baseline[key] = _quantile(vals, 1 - BASELINE_QUANTILE)
        else:
            baseline[key] = _quantile(vals, BASELINE_QUANTILE)
    errors_by_type = dict(
        con.execute(
            "SELECT error_type, count(*) FROM requests WHERE end_ns >= ? AND end_ns < ? "
            "AND error_type IS NOT NULL GROUP BY 1 ORDER BY 2 DESC",
            [since, until],
        ).fetchall()
    )
    return Signals(
        start_ns=since,
        end_ns=until,
        window_s=window_s,
        windows=windows,
        overall=overall,
        baseline=baseline,
        config=config,
        errors_by_type=errors_by_type,
        errors_by_window=errors_by_window,
        device_kind=device_kind,
        con=con,
        since_ns=since,
        until_ns=until,
        healthy_baseline=usable,
        healthy_baseline_reason=why_not,
        healthy_windows=len(healthy),
        healthy_ranges=[(w.start_ns, w.end_ns) for w in healthy],
        busy_windows=len(busy),
        warmup={"requests": int(n_warm), "intervals": [list(iv) for iv in warm]},
        decode_seqs_sql=seqs,
    )


def _spec_sql(con, roofline: bool) -> str | None:
    """The speculative-decoding window query for this store (the draft steps' intensity only
    with the roofline columns); None without the speculative-decoding columns."""
    cols = {c.lower() for c in columns(con, "engine_steps")}
    if not {"num_drafts", "num_draft_tokens", "num_accepted_tokens"} <= cols:
        return None
    return _SPEC_WINDOW_SQL.replace("$intensity", _SPEC_INTENSITY if roofline else "NULL")


def roofline_peaks(config: dict) -> tuple[float, float, float] | None:
    """``(peak GB/s, peak GFLOP/s, ridge FLOP/byte)`` from the ``config`` event's
    ``device_peak_gbps``/``device_peak_gflops`` (the ridge: GFLOP/s ÷ GB/s); None when either
    is missing or not positive (a store from before the roofline, a failed probe)."""
    try:
        gbps = float(config.get("device_peak_gbps"))
        gflops = float(config.get("device_peak_gflops"))
    except (TypeError, ValueError):
        return None
    if not (gbps > 0 and gflops > 0):
        return None
    return gbps, gflops, gflops / gbps


def _engine_config(con) -> dict:
    """The engine flags recorded at server start (the last ``config`` event)."""
    row = con.execute(
        "SELECT attributes FROM events WHERE kind = 'config' ORDER BY time_ns DESC LIMIT 1"
    ).fetchone()
    if not row or not row[0]:
        return {}
    try:
        return json.loads(row[0])
    except ValueError:
        return {}


def prefix_block_stats(
    con, since_ns: int, until_ns: int, min_shared_blocks: int = 4, early_blocks: int = 4
) -> dict[str, float | int]:
    """How many prompts share a long run of blocks with other prompts but differ in one early
    block (a timestamp or id near the top of a system prompt).

    Uses ``requests.prompt_block_hashes`` (per-block content hashes of the prompt, not
    chained). For each early block position ``e < early_blocks``, prompts are grouped by their
    next ``min_shared_blocks`` blocks; a prompt counts when its group holds other prompts whose
    block ``e`` differs. Such prompts miss the prefix cache by construction: its keys chain from
    block 0, so one differing early block makes every later block a miss.

    Returns ``{"prompts", "shared_tail_differs_first", "share", "block", "block_size"}`` for
    the position where the pattern is strongest (``block_size``: tokens per hashed block).
    """
    k = int(min_shared_blocks)
    size = engine_block_size(con)
    best = {"prompts": 0, "shared_tail_differs_first": 0, "share": 0.0, "block": None}
    for e in range(int(early_blocks)):
        row = con.execute(
            f"""
            WITH r AS (
                SELECT prompt_block_hashes AS h FROM requests
                WHERE arrival_ns >= ? AND arrival_ns < ? AND len(prompt_block_hashes) > {e + k}),
            t AS (SELECT h[{e + 2}:{e + k + 1}] AS tail, count(DISTINCT h[{e + 1}]) AS firsts,
                         count(*) AS n
                  FROM r GROUP BY tail)
            SELECT coalesce(sum(n), 0), coalesce(sum(n) FILTER (WHERE firsts > 1), 0) FROM t
            """,
            [since_ns, until_ns],
        ).fetchone()
        prompts, differs = int(row[0]), int(row[1])
        share = differs / prompts if prompts else 0.0
        if share > best["share"]:
            best = {
                "prompts": prompts,
                "shared_tail_differs_first": differs,
                "share": share,
                "block": e,
            }
    return {**best, "block_size": size}


def prefix_head_stats(
    con, since_ns: int, until_ns: int, min_share: float = 0.5
) -> dict[str, int | float | None]:
    """Prompts that share a prefix shorter than one KV block with other prompts, and no full
    block: the prefix cache, which reuses whole blocks, can give them nothing.

    Uses ``requests.prompt_head_hashes`` (hashes of each prompt's first block_size/4, /2, 3/4
    tokens). For each head length, from the longest, prompts are grouped by that head's hash;
    a prompt counts when its group holds another prompt and its first full block (if it has
    one) is shared with no other prompt.

    Returns ``{"prompts", "sharing", "share", "head_tokens", "block_size"}`` for the longest
    head length (tokens) that at least ``min_share`` of the prompts share (``head_tokens``
    None and ``sharing`` 0 when none; ``prompts``: prompts with head hashes; tokens per block
    from the config event).
    """
    size = engine_block_size(con)
    step = max(1, size // 4)
    best = {"prompts": 0, "sharing": 0, "share": 0.0, "head_tokens": None, "block_size": size}
    for i in range(len(range(step, size, step)), 0, -1):
        prompts, sharing = con.execute(
            f"""
            WITH r AS (
                SELECT prompt_head_hashes[{i}] AS head,
                       CASE WHEN len(prompt_block_hashes) > 0 THEN prompt_block_hashes[1] END AS b0
                FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?
                    AND prompt_head_hashes IS NOT NULL),
            g AS (SELECT head IS NOT NULL AND count(*) OVER (PARTITION BY head) > 1 AS shares_head,
                         b0 IS NOT NULL AND count(*) OVER (PARTITION BY b0) > 1 AS shares_block
                  FROM r)
            SELECT count(*), count(*) FILTER (WHERE shares_head AND NOT shares_block) FROM g
            """,
            [since_ns, until_ns],
        ).fetchone()
        share = sharing / prompts if prompts else 0.0
        if prompts and share >= min_share:
            return {
                "prompts": prompts,
                "sharing": sharing,
                "share": share,
                "head_tokens": step * i,
                "block_size": size,
            }
        best["prompts"] = prompts
    return best


def engine_block_size(con) -> int:
    """Tokens per KV block (and per prompt hash block) from the latest ``config`` event;
    :data:`DEFAULT_BLOCK_SIZE` for a store without one."""
    row = con.execute(
        "SELECT TRY_CAST(attributes->>'block_size' AS INTEGER) FROM events "
        "WHERE kind = 'config' ORDER BY time_ns DESC LIMIT 1"
    ).fetchall()
    return int(row[0][0]) if row and row[0][0] else DEFAULT_BLOCK_SIZE
