"""Prefill/decode disaggregation (``engine/api/disaggregated.py``): families ``kv_transfer``
(each request's KV hand-off, by arrival) and ``pd`` (the two sides' engine cores, by step
start, from ``engine_steps.role``)."""

from __future__ import annotations

from tokenmill.telemetry.schema import WORKING_STEP_SQL

from .family import Family, Yield
from .requests import arrival_family
from .scope import Scope, set_apart

_TRANSFER_SELECT = """
    count(kv_transfer_ms) AS kv_transfers,
    quantile_cont(kv_transfer_ms, 0.5) AS kv_transfer_p50,
    quantile_cont(kv_transfer_ms / nullif(ttft_ms, 0), 0.5) FILTER (WHERE ok) AS kv_transfer_share_of_ttft,
    quantile_cont(kv_transfer_bytes, 0.5) AS kv_transfer_bytes_p50,
    quantile_cont(kv_wait_ms, 0.5) AS kv_wait_p50"""

_TRANSFER_KEYS = (
    "kv_transfers",
    "kv_transfer_p50",
    "kv_transfer_share_of_ttft",
    "kv_transfer_bytes_p50",
    "kv_wait_p50",
)


# per window of arrival: the requests whose KV moved from a prefill to a decode core, the
# median transfer (ms, and its share of TTFT), bytes and wait at the decode side for room
KV_TRANSFER = arrival_family(
    "kv_transfer",
    _TRANSFER_SELECT,
    _TRANSFER_KEYS,
    "ttft_ms",
    "kv_transfer_ms",
    "kv_transfer_bytes",
    "kv_wait_ms",
)

# per window and side, the time its engine cores spent in working steps, its queue, and the
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


def compute_pd(scope: Scope) -> Yield:
    """Per window, each side of a disaggregated server: ``pd_prefill_busy`` /
    ``pd_decode_busy`` (the share of the window its engine cores spent in working steps, 0..1,
    averaged over the side's cores), ``pd_prefill_waiting_mean`` (requests queued on the
    prefill side, mean over its step records), ``pd_prefill_tok_per_s`` (prompt tokens the side
    prefilled per second of its cores' working steps, all cores together),
    ``pd_decode_running_max``, ``pd_decode_kv_use_mean`` / ``_max`` (0..1),
    ``pd_decode_kv_waiting_mean`` (hand-offs held at the decode side for room) and
    ``pd_prefill_workers`` / ``pd_decode_workers``. Nothing for a colocated server."""
    has_waiting = scope.has("engine_steps", "num_kv_waiting")
    kv_waiting = "avg(num_kv_waiting)" if has_waiting else "NULL::DOUBLE"
    sql = set_apart(
        _PD_STEP_SQL.replace("__KV_WAITING__", kv_waiting), "start_ns", scope.not_warm_step
    )
    params = scope.params
    cur = scope.con.execute(sql, params)
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
    return Yield(out, {})


PD = Family(
    name="pd",
    needs={
        "engine_steps": (
            "start_ns",
            "end_ns",
            "role",
            "replica",
            "num_prefill_tokens",
            "num_decode_tokens",
            "num_waiting",
            "num_running",
            "kv_blocks_used",
            "kv_blocks_total",
        )
    },
    optional={"engine_steps": ("num_kv_waiting",)},
    window_keys=(
        "pd_prefill_workers",
        "pd_decode_workers",
        "pd_prefill_busy",
        "pd_decode_busy",
        "pd_prefill_waiting_mean",
        "pd_prefill_tok_per_s",
        "pd_decode_running_max",
        "pd_decode_kv_use_mean",
        "pd_decode_kv_use_max",
        "pd_decode_kv_waiting_mean",
    ),
    overall_keys=(),
    compute=compute_pd,
)
