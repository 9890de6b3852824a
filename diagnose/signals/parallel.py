"""Parallelism: families ``collectives`` and ``ranks`` (tensor parallelism,
``engine/parallel/``) and ``replicas`` (data parallelism, ``engine/api/replicas.py``).

``collectives``: rank 0's time in collectives (``collective_ms``: the step's broadcast and the
row-parallel layers' all-reduces) as a share of the forward, in decode-only and in prefill
steps (seed 003 §5.2 pitfall 5: two all-reduces a layer hide behind a prefill's compute and
stand exposed in decode). ``ranks``: the ranks' forward times outside collectives
(``rank_compute_ms``) against each other. ``replicas``: the requests the router sent to each
replica and its running requests, the busiest against the least busy.
"""

from __future__ import annotations

from tokenmill.telemetry.schema import COMPLETED_SQL

from .family import Family, Yield
from .requests import COMPLETED_COLUMNS
from .scope import Scope, quantile, set_apart

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


def compute_collectives(scope: Scope) -> Yield:
    return Yield(scope.by_window(_COLLECTIVE_WINDOW_SQL, "start_ns", scope.not_warm_step), {})


COLLECTIVES = Family(
    name="collectives",
    needs={
        "engine_steps": (
            "start_ns",
            "num_prefill_tokens",
            "num_decode_tokens",
            "forward_ms",
            "collective_ms",
            "collective_bytes",
        )
    },
    window_keys=(
        "decode_collective_share",
        "decode_collective_ms_mean",
        "decode_forward_ms_mean",
        "decode_collective_bytes_mean",
        "collective_decode_steps",
        "prefill_collective_share",
    ),
    overall_keys=(),
    compute=compute_collectives,
)

_RANK_TIMES_SQL = """
SELECT (start_ns - $t0) // $w AS win, rank_compute_ms
FROM engine_steps
WHERE start_ns >= $since AND start_ns < $until AND len(rank_compute_ms) > 1
"""


def compute_ranks(scope: Scope) -> Yield:
    """Per window, how the tensor-parallel ranks' forward times outside collectives
    (``engine_steps.rank_compute_ms``, one list every 16 steps) compare: ``rank_samples``;
    ``slowest_rank`` (the rank slowest most often) and ``slowest_rank_share`` (the share of
    samples it was slowest in); ``rank_spread_p50`` (median of slowest / fastest);
    ``slowest_rank_ms`` / ``fastest_rank_ms`` (means of the slowest and fastest rank's time per
    sample, ms)."""
    by_win: dict[int, list[list[float]]] = {}
    for win, times in scope.con.execute(
        set_apart(_RANK_TIMES_SQL, "start_ns", scope.not_warm_step), scope.params
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
            "rank_spread_p50": quantile(spreads, 0.5),
            "slowest_rank_ms": sum(max(t) for t in samples) / len(samples),
            "fastest_rank_ms": sum(min(t) for t in samples) / len(samples),
        }
    return Yield(out, {})


RANKS = Family(
    name="ranks",
    needs={"engine_steps": ("start_ns", "rank_compute_ms")},
    window_keys=(
        "rank_samples",
        "slowest_rank",
        "slowest_rank_share",
        "rank_spread_p50",
        "slowest_rank_ms",
        "fastest_rank_ms",
    ),
    overall_keys=(),
    compute=compute_ranks,
)

# per window and replica, the requests the router sent there (by arrival) and the replica's
# mean running requests over its step records (idle heartbeats included: a replica with nothing
# to do sends one every 0.5 s)
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


def compute_replicas(scope: Scope) -> Yield:
    """Per window, the spread between data-parallel replicas (``data_parallel_size`` of the
    ``config`` event, ids ``0 .. size - 1``): ``replicas``; ``replica_hot`` (the one the most
    requests arrived at) with its ``replica_arrivals_max``, ``replica_ttft_p50_hot`` and
    ``replica_queue_p50_hot`` (ms); ``replica_cool`` (the fewest arrivals, 0 for a replica that
    got none) with ``replica_arrivals_min`` and ``replica_ttft_p50_cool``;
    ``replica_running_mean_min`` / ``_max`` (mean running requests over each replica's step
    records; a replica with no record in the window counts 0). Nothing below two replicas."""
    size = scope.config.data_parallel_size
    if size < 2:
        return Yield()
    by_win: dict[int, dict[int, dict]] = {}
    cur = scope.con.execute(
        set_apart(_REPLICA_REQ_SQL, "arrival_ns", scope.not_warm_req), scope.params
    )
    names = [d[0] for d in cur.description]
    for row in cur.fetchall():
        r = dict(zip(names, row, strict=True))
        by_win.setdefault(int(r["win"]), {})[int(r["replica"])] = r
    running: dict[int, dict[int, float]] = {}
    steps_sql = set_apart(_REPLICA_STEP_SQL, "start_ns", scope.not_warm_step)
    for win, replica, mean in scope.con.execute(steps_sql, scope.params).fetchall():
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
    return Yield(out, {})


REPLICAS = Family(
    name="replicas",
    needs={
        "requests": ("arrival_ns", "replica", *COMPLETED_COLUMNS, "ttft_ms", "queue_ms"),
        "engine_steps": ("start_ns", "replica", "num_running"),
    },
    window_keys=(
        "replicas",
        "replica_hot",
        "replica_arrivals_max",
        "replica_ttft_p50_hot",
        "replica_queue_p50_hot",
        "replica_cool",
        "replica_arrivals_min",
        "replica_ttft_p50_cool",
        "replica_running_mean_min",
        "replica_running_mean_max",
    ),
    overall_keys=(),
    compute=compute_replicas,
)
