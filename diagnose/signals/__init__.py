"""Signals: SQL over the trace store, per time window and overall, in families.

Everything here is a number the rules compare, computed by DuckDB over the tables of
``telemetry/schema.sql``; nothing reads engine objects. Windows are ``window_s`` long, aligned
to the first row of the dump. Request signals are bucketed by arrival (latencies) or by end
(completions, errors); step and device signals by their own start/sample time.

The signals come in families (:data:`FAMILIES`, one module each; :class:`~.family.Family`):
each declares the store columns it needs, the per-window and overall keys it yields and its SQL.
:func:`load` runs them all; a family whose columns the store lacks yields its keys as None
(``Signals.unavailable`` names it and the columns). Each rule declares the families it reads
(``Rule.reads``). Where the store has no rows for a family's own tables but does for its
``fallback``'s (another engine's store: its scraped metrics, ``samples.py``), the fallback runs
instead (``Signals.sources``). A proxy's request rows get their queue and prefill times from
the upstream's spans of the same trace (``upstream.py``) before anything is computed.

On top of the families: the healthy baseline (``baseline.py``: the dump's healthiest windows,
and whether they are healthy enough to compare with) and the warm-up after a (re)start, set
apart from the per-window signals (``warmup.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb

from tokenmill.telemetry.recorded_config import RecordedConfig, read_recorded_config
from tokenmill.telemetry.schema import COMPLETED_SQL

from . import (
    completions,
    devices,
    disaggregation,
    frontend,
    kv,
    parallel,
    prefix,
    requests,
    roofline,
    same_work,
    spec,
    step_split,
    steps,
)
from .baseline import (
    BASELINE_KEYS,
    BASELINE_MIN_HEALTHY,
    BASELINE_QUANTILE,
    HEALTHY_MAX_ERROR_RATE,
    HEALTHY_MAX_FAILING_STEPS,
    HEALTHY_MAX_QUEUE_SHARE,
    HEALTHY_MIN_ENDED,
    MIN_HEALTHY_WINDOWS,
    baseline_values,
    judge_baseline,
)
from .family import Family, Yield, unavailable
from .prefix import engine_block_size, prefix_block_stats, prefix_head_stats
from .queue_now import OpenStep, Waiting, last_stream_token_ns, open_step, waiting_now
from .recompute import RecomputeStep, recompute_steps
from .roofline import roofline_peaks
from .same_work import has_open_streams, host_loadgen_sql, ran_from_requests, work_ratios_sql
from .scope import NS, Scope, quantile, span, store_columns
from .upstream import fill_from_upstream_spans
from .warmup import (
    WARMUP_COMPLETIONS,
    WARMUP_EVENTS,
    WARMUP_MAX_S,
    outside,
    warmup_intervals,
)
from .window import NoTraffic, Signals, Window

#: every signal family, in the order :func:`load` runs them (their keys never overlap)
FAMILIES: tuple[Family, ...] = (
    requests.FAMILY,
    kv.KV_REQUESTS,
    prefix.FAMILY,
    frontend.CLIENT,
    frontend.STREAM,
    disaggregation.KV_TRANSFER,
    completions.FAMILY,
    steps.FAMILY,
    kv.KV,
    step_split.FAMILY,
    roofline.FAMILY,
    devices.FAMILY,
    same_work.FAMILY,
    spec.FAMILY,
    parallel.REPLICAS,
    parallel.COLLECTIVES,
    parallel.RANKS,
    disaggregation.PD,
)
FAMILIES_BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}

# the names importers used when this was one module
_quantile = quantile


def load(
    con: duckdb.DuckDBPyConnection,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    window_s: float = 10.0,
    short_prompt_tokens: int | None = None,
    reference: Sequence[Window] = (),
) -> Signals:
    """Compute every signal of the store behind ``con``.

    Args:
        con: an open trace store or dump (checked by the caller).
        since_ns, until_ns: the time range (wall-clock ns); default: all of it.
        window_s: window length (s).
        short_prompt_tokens: prompts up to this many tokens count as "short" (default: the
            dump's median prompt length).
        reference: healthy windows from before the range (the live loop's history,
            ``diagnose/live.py``): they join the range's own healthy windows in the baseline, so
            a short range inside an incident is still compared with health.

    Raises:
        NoTraffic: no requests in the range.
    """
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s} s")
    scope = make_scope(
        con,
        since_ns=since_ns,
        until_ns=until_ns,
        window_s=window_s,
        short_prompt_tokens=short_prompt_tokens,
        reference_spans=merged_spans(reference),
    )
    con = scope.con  # a proxy's store: the requests filled from the upstream's spans
    since, until, w_ns = scope.since, scope.until, scope.w_ns
    values: list[dict] = [{} for _ in range(scope.n_windows)]
    overall: dict = {}
    missing: dict[str, tuple[str, ...]] = {}
    sources: dict[str, str] = {}
    for fam in FAMILIES:
        lacks = fam.missing(scope)
        alt = _fallback(fam, scope, lacks)
        if alt is not None:
            sources[fam.name] = alt.name
            got = unavailable(fam, scope.n_windows)
            for i, v in (y := alt.compute(scope)).windows.items():
                got.windows.setdefault(i, {}).update(v)
            got.overall.update(y.overall)
        elif lacks:
            missing[fam.name] = lacks
            got = unavailable(fam, scope.n_windows)
        else:
            got = fam.compute(scope)
        for i, v in got.windows.items():
            values[i].update(v)
        overall.update(got.overall)
    windows = [
        Window(i, since + i * w_ns, min(since + (i + 1) * w_ns, until), values=v)
        for i, v in enumerate(values)
    ]
    busy = [w for w in windows if (w.get("completed_arrivals") or 0) > 0]
    usable, healthy, why_not = judge_baseline(busy, windows)
    if reference:
        busy, healthy = busy + list(reference), healthy + list(reference)
        usable, why_not = len(healthy) >= MIN_HEALTHY_WINDOWS, "" if healthy else why_not
    (n_warm,) = con.execute(
        f"SELECT count(*) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND NOT ({scope.not_warm_req})",
        [since, until],
    ).fetchone()
    return Signals(
        start_ns=since,
        end_ns=until,
        window_s=window_s,
        windows=windows,
        overall=overall,
        baseline=baseline_values(busy, healthy),
        config=scope.config,
        errors_by_type=completions.errors_by_type(scope),
        errors_by_window=completions.errors_by_window(scope),
        device_kind=devices.device_kind(scope),
        con=con,
        since_ns=since,
        until_ns=until,
        healthy_baseline=usable,
        healthy_baseline_reason=why_not,
        healthy_windows=len(healthy),
        healthy_ranges=[(w.start_ns, w.end_ns) for w in healthy],
        busy_windows=len(busy),
        warmup={"requests": int(n_warm), "intervals": [list(iv) for iv in scope.warmup]},
        decode_seqs_sql=scope.decode_seqs_sql,
        reference_spans=scope.reference_spans,
        unavailable=missing,
        sources=sources,
    )


def merged_spans(windows: Sequence[Window]) -> tuple[tuple[int, int], ...]:
    """The windows' ``[start_ns, end_ns)``, those that touch merged into one span."""
    out: list[list[int]] = []
    for a, b in sorted((w.start_ns, w.end_ns) for w in windows):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _waited_in(con: duckdb.DuckDBPyConnection, cols, since: int, until: int) -> bool:
    """Whether requests waited for a first token in the range (the API's samples): a live
    store whose engine has stopped holds no ended request, only those waiting."""
    if "time_ns" not in cols.get("waiting_samples", frozenset()):
        return False
    (n,) = con.execute(
        "SELECT count(*) FROM waiting_samples WHERE time_ns >= ? AND time_ns < ?", [since, until]
    ).fetchone()
    return n > 0


def _fallback(fam: Family, scope: Scope, lacks: tuple[str, ...]) -> Family | None:
    """The family to run instead of ``fam``: its fallback, where the store has no rows (or
    lacks columns) for ``fam``'s own tables and has them for the fallback's."""
    alt = fam.fallback
    if alt is None or alt.missing(scope):
        return None
    own_empty = bool(lacks) or not all(scope.has_rows(t) for t in fam.needs)
    if not own_empty or not all(scope.has_rows(t) for t in alt.needs):
        return None
    return alt


def make_scope(
    con: duckdb.DuckDBPyConnection,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    window_s: float = 10.0,
    short_prompt_tokens: int | None = None,
    reference_spans: tuple[tuple[int, int], ...] = (),
) -> Scope:
    """The :class:`Scope` :func:`load` runs the families in (the arguments as its).

    Raises:
        NoTraffic: no requests in the range.
    """
    con = fill_from_upstream_spans(con)  # a proxy's rows: queue/prefill from upstream spans
    cols = store_columns(con)
    since, until = span(con, cols, since_ns, until_ns)
    (n_req,) = con.execute(
        "SELECT count(*) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?", [since, until]
    ).fetchone()
    if n_req == 0 and not _waited_in(con, cols, since, until):
        raise NoTraffic("no requests arrived in the chosen time range")
    req = cols["requests"]
    if short_prompt_tokens is None:
        med = None
        if "input_tokens" in req:
            (med,) = con.execute(
                "SELECT quantile_disc(input_tokens, 0.5) FROM requests "
                "WHERE arrival_ns >= ? AND arrival_ns < ? AND input_tokens IS NOT NULL",
                [since, until],
            ).fetchone()
        short_prompt_tokens = int(med or 0)
    fast_ttft = None
    if {"ttft_ms", *requests.COMPLETED_COLUMNS} <= req:
        (fast_ttft,) = con.execute(
            "SELECT quantile_cont(ttft_ms, 0.5) FROM requests WHERE arrival_ns >= ? "
            f"AND arrival_ns < ? AND {COMPLETED_SQL}",
            [since, until],
        ).fetchone()
    # warm-up set apart from the per-window signals (requests by arrival, steps by start)
    warm = _warmup(con, cols, since, until)
    return Scope(
        con=con,
        since=since,
        until=until,
        window_s=window_s,
        columns=cols,
        warmup=tuple(warm),
        config=(
            read_recorded_config(con)
            if {"kind", "time_ns", "attributes"} <= cols["events"]
            else RecordedConfig()
        ),
        not_warm_req=outside("arrival_ns", warm),
        not_warm_step=outside("start_ns", warm),
        short_prompt_tokens=short_prompt_tokens,
        fast_ttft_ms=(fast_ttft or 0) * 2,
        # sequences a step decoded: draft tokens (speculative decoding) are not sequences
        decode_seqs_sql=steps.decode_seqs_sql(cols["engine_steps"]),
        reference_spans=reference_spans,
    )


def _warmup(con, cols, since: int, until: int) -> list[tuple[int, int]]:
    """The warm-up intervals of the range (none where the store lacks the start events or the
    requests' outcome columns)."""
    if not (
        {"kind", "time_ns"} <= cols["events"]
        and {"arrival_ns", "end_ns", *requests.COMPLETED_COLUMNS} <= cols["requests"]
    ):
        return []
    return warmup_intervals(con, since, until)


__all__ = [
    "BASELINE_KEYS",
    "BASELINE_MIN_HEALTHY",
    "BASELINE_QUANTILE",
    "COMPLETED_SQL",
    "FAMILIES",
    "FAMILIES_BY_NAME",
    "HEALTHY_MAX_ERROR_RATE",
    "HEALTHY_MAX_FAILING_STEPS",
    "HEALTHY_MAX_QUEUE_SHARE",
    "HEALTHY_MIN_ENDED",
    "MIN_HEALTHY_WINDOWS",
    "NS",
    "WARMUP_COMPLETIONS",
    "WARMUP_EVENTS",
    "WARMUP_MAX_S",
    "Family",
    "NoTraffic",
    "OpenStep",
    "RecomputeStep",
    "Scope",
    "Signals",
    "Waiting",
    "Window",
    "Yield",
    "engine_block_size",
    "has_open_streams",
    "host_loadgen_sql",
    "last_stream_token_ns",
    "load",
    "make_scope",
    "open_step",
    "prefix_block_stats",
    "prefix_head_stats",
    "ran_from_requests",
    "recompute_steps",
    "roofline_peaks",
    "waiting_now",
    "warmup_intervals",
    "work_ratios_sql",
]
