"""The KV pool and what it did to requests: families ``kv`` and ``kv_requests``.

``kv`` (engine steps by start): the pool's use (mean, peak, fewest free blocks, its size),
block allocations that failed (count, working steps with one, the pool's use in them),
preemptions, and the pool's use with nothing running or waiting (idle heartbeats included: a
leak shows there). ``kv_requests`` (requests by arrival): requests preempted, prompt tokens
recomputed after a preemption, and the stalled requests (as ``requests``' ``stalled_n``) that
were preempted.
"""

from __future__ import annotations

from tokenmill.telemetry.schema import WORKING_STEP_SQL

from .requests import arrival_family
from .samples import KV_FROM_SAMPLES
from .steps import start_family

_KV_WINDOW_SQL = f"""
SELECT (start_ns - $t0) // $w AS win,
    avg(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_mean,
    max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_max,
    min(kv_blocks_free) AS kv_free_min,
    max(kv_blocks_total) AS kv_blocks_total,
    sum(allocation_failures) AS allocation_failures,
    count(*) FILTER (WHERE allocation_failures > 0 AND {WORKING_STEP_SQL}) AS allocation_failure_steps,
    avg(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) FILTER (WHERE allocation_failures > 0) AS kv_usage_at_failures,
    sum(num_preempted) AS preemptions,
    max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) FILTER (WHERE num_running = 0 AND num_waiting = 0) AS idle_kv_usage_max,
    count(*) FILTER (WHERE num_running = 0 AND num_waiting = 0) AS idle_steps
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
GROUP BY win
"""

_KV_KEYS = (
    "kv_usage_mean",
    "kv_usage_max",
    "kv_free_min",
    "kv_blocks_total",
    "allocation_failures",
    "allocation_failure_steps",
    "kv_usage_at_failures",
    "preemptions",
    "idle_kv_usage_max",
    "idle_steps",
)


KV = start_family(
    "kv",
    _KV_WINDOW_SQL,
    _KV_KEYS,
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_blocks_free",
    "allocation_failures",
    "num_preempted",
    "num_running",
    "num_waiting",
    fallback=KV_FROM_SAMPLES,
)

_REQUESTS_SELECT = """
    sum(coalesce(preemptions, 0)) AS preempted_requests_n,
    sum(coalesce(recomputed_tokens, 0)) AS recomputed_tokens,
    count(*) FILTER (WHERE ok AND itl_max_ms >= 10 * itl_p50_ms AND ttft_ms <= $fast_ttft AND preemptions > 0) AS stalled_preempted_n"""

_REQUESTS_KEYS = ("preempted_requests_n", "recomputed_tokens", "stalled_preempted_n")


KV_REQUESTS = arrival_family(
    "kv_requests",
    _REQUESTS_SELECT,
    _REQUESTS_KEYS,
    "preemptions",
    "recomputed_tokens",
    "itl_max_ms",
    "itl_p50_ms",
    "ttft_ms",
)
