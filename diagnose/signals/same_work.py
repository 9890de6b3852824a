"""Family ``same_work``: the same work, slower (host_contention).

Each working step against the quickest quarter of the steps that did the same work (same batch:
prefill chunks + decodes; tokens in the same power of two) while the host was quiet (no
neighbour in its second of the host samples: :data:`QUIET_OTHERS_PCT`,
:data:`QUIET_STEAL_PCT`), over the whole range and the live loop's reference windows (healthy
windows from before the range: a 30 s range inside a neighbour's run has no quick steps of its
own to compare with). A step whose class has fewer than 5 quiet steps is set against the
per-token cost of the largest quiet class with no more tokens (a conservative ratio: per-token
cost falls as a step grows); a neighbour's backlog grows batches the quiet host never ran, and
those must not be their own reference. A window's ``same_work_slowdown`` is the median of its
steps' ratios: 1.0 when the steps ran as fast as the dump's usual best for their work, 2.0 when
the same work took twice as long.

A store without steps (another engine behind ``tokenmill proxy``) runs :data:`FROM_REQUESTS`
instead: the same comparison over the decoded requests, each one's time per output token
against the quickest quarter of the requests that decoded beside as many other streams. From
the client's side that is the upstream's step time at that batch; a neighbour that halves the
upstream's CPU doubles it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.telemetry.schema import COMPLETED_SQL, WORKING_STEP_SQL

from .family import Family, Yield
from .scope import Scope, in_intervals, store_columns
from .steps import WORKING_COLUMNS

# the work each step did: CTE ``w``, one row per working step of the range or the reference
# windows, with its time (``ms``), its batch (prefill chunks + decodes), its tokens and their
# power of two
_STEP_WORK = f"""
WITH w AS (
    SELECT start_ns, (end_ns - start_ns) / 1e6 AS ms,
        num_prefill_chunks + __DECODE_SEQS__ AS batch,
        num_prefill_tokens + num_decode_tokens AS tok,
        CAST(floor(log2(greatest(num_prefill_tokens + num_decode_tokens, 1))) AS INTEGER) AS tok_class
    FROM engine_steps
    WHERE (start_ns >= $since AND start_ns < $until OR (__IN_REFERENCE__)) AND {WORKING_STEP_SQL}
)"""

# the same for a store without steps (another engine behind ``tokenmill proxy``): one row per
# request that decoded to its end (a stream cut short ends at the cut, not at its last token),
# at its last token (``start_ns``, when its ratio is known), its time per output token (``ms``)
# and, as its batch and tokens, the streams decoding beside it: the mean over its decode of the
# requests whose decode overlapped it, itself included, rounded. Its time per token is the
# upstream's step time at that batch, seen from the client. With the proxy's samples of the
# streams still open (``stream_samples``, ``_OPEN_STREAMS``), one row per sample too: its time
# since its first output over its outputs so far, the streams open at that sample its batch (a
# neighbour that makes tokens 20x slower ends no stream for minutes).
_REQUEST_WORK = f"""
WITH d AS (
    SELECT request_id, first_token_ns AS a, last_token_ns AS b, tpot_ms AS ms
    FROM requests
    WHERE first_token_ns IS NOT NULL AND last_token_ns > first_token_ns AND tpot_ms > 0
      AND {COMPLETED_SQL}
      AND (last_token_ns >= $since AND last_token_ns < $until OR (__IN_REFERENCE_END__))
), w AS (
    SELECT any_value(d.b) AS start_ns, any_value(d.ms) AS ms, greatest(1, CAST(round(
        sum(least(d.b, o.last_token_ns) - greatest(d.a, o.first_token_ns))
        / any_value(d.b - d.a)) AS INTEGER)) AS batch, batch AS tok, 0 AS tok_class
    FROM d JOIN requests o ON o.first_token_ns < d.b AND o.last_token_ns > d.a
    GROUP BY d.request_id__OPEN_STREAMS__
)"""
_OPEN_STREAMS = """
    UNION ALL
    SELECT time_ns, (time_ns - first_token_ns) / 1e6 / output_tokens,
        CAST(count(*) OVER (PARTITION BY time_ns) AS INTEGER) AS n, n, 0
    FROM stream_samples
    WHERE output_tokens > 0
      AND (time_ns >= $since AND time_ns < $until OR (__IN_REFERENCE_SAMPLE__))"""

#: the host's quiet side: a second in which processes outside the server (less tokenmill's own
#: load generator) used less than this % of the CPU and the hypervisor stole less than
#: :data:`QUIET_STEAL_PCT` (``host_contention``'s default bars for a neighbour)
QUIET_OTHERS_PCT = 20.0
QUIET_STEAL_PCT = 10.0

# the seconds in which a neighbour was busy, from the host samples (CTE ``busy``), and each unit
# of ``w`` marked quiet or not by its second (CTE ``q``)
_BUSY = f"""
, busy AS (
    SELECT time_ns // 1000000000 AS sec,
        avg(greatest(cpu_others_pct - __LOADGEN__, 0)) >= {QUIET_OTHERS_PCT}
            OR avg(coalesce(steal_pct, 0)) >= {QUIET_STEAL_PCT} AS busy
    FROM device_samples
    WHERE kind = 'host' AND cpu_others_pct IS NOT NULL
      AND time_ns >= (SELECT min(start_ns) FROM w) AND time_ns < $until
    GROUP BY sec
)"""
_NO_BUSY = ", busy AS (SELECT NULL::BIGINT AS sec, FALSE AS busy WHERE FALSE)"

# each unit of work against the quickest quarter of the units that did the same work while the
# host was quiet, after ``w``: CTEs ``q`` (each unit, quiet or not), ``s`` (the range's units),
# ``ref`` (each class's 25th percentile and median tokens over its quiet units), ``ref_any``
# (the same over all its units) and ``r`` (each unit's ratio: against its own class's quiet
# reference; a unit whose class has too few quiet members for one, against the per-token cost
# of the largest quiet class with no more tokens, times its own tokens: a neighbour that grows
# the queue grows the batch to sizes the quiet host never ran, and per-token cost only falls as
# a batch grows, so this ratio errs low; with no such class either, against its class's units
# whenever they ran). Steps taken beside a neighbour are never the quick reference of the same
# work: a class that only the neighbour's backlog made would otherwise set its steps against
# themselves and read as no slower.
_COMPARE = """, q AS (
    SELECT w.*, NOT coalesce(b.busy, FALSE) AS quiet
    FROM w LEFT JOIN busy b ON w.start_ns // 1000000000 = b.sec
), s AS (
    SELECT * FROM q WHERE start_ns >= $since AND start_ns < $until
), pool AS (
    SELECT * FROM s UNION ALL SELECT * FROM q WHERE start_ns < $since
), ref AS (
    SELECT batch, tok_class, quantile_cont(ms, 0.25) AS ref_ms, median(tok) AS ref_tok
    FROM pool WHERE quiet GROUP BY batch, tok_class HAVING count(*) >= 5
), ref_any AS (
    SELECT batch, tok_class, quantile_cont(ms, 0.25) AS ref_ms
    FROM pool GROUP BY batch, tok_class HAVING count(*) >= 5
), r AS (
    SELECT s.start_ns, coalesce(
        s.ms / nullif(ref.ref_ms, 0),
        s.ms / nullif(s.tok * (SELECT arg_max(f.ref_ms / f.ref_tok, f.ref_tok) FROM ref f
                               WHERE f.ref_tok <= s.tok AND f.ref_tok > 0), 0),
        s.ms / nullif(a.ref_ms, 0)) AS ratio
    FROM s LEFT JOIN ref USING (batch, tok_class) LEFT JOIN ref_any a USING (batch, tok_class)
)
"""
_WINDOW_SQL = """
SELECT (start_ns - $t0) // $w AS win,
    quantile_cont(ratio, 0.5) AS same_work_slowdown,
    count(*) AS same_work_steps
FROM r WHERE ratio IS NOT NULL
GROUP BY win
"""
_RATIOS_SQL = "SELECT start_ns, ratio FROM r WHERE ratio IS NOT NULL"


def _fill(
    sql: str,
    decode_seqs_sql: str,
    reference_spans: Sequence[tuple[int, int]],
    from_requests: bool = False,
    streams: bool = False,
    host: str | None = None,
) -> str:
    work = _REQUEST_WORK if from_requests else _STEP_WORK
    busy = _NO_BUSY if host is None else _BUSY.replace("__LOADGEN__", host)
    return (
        (work + busy + _COMPARE + sql)
        .replace("__OPEN_STREAMS__", _OPEN_STREAMS if streams else "")
        .replace("__DECODE_SEQS__", decode_seqs_sql)
        .replace("__IN_REFERENCE__", in_intervals("start_ns", reference_spans))
        .replace("__IN_REFERENCE_END__", in_intervals("last_token_ns", reference_spans))
        .replace("__IN_REFERENCE_SAMPLE__", in_intervals("time_ns", reference_spans))
    )


def work_ratios_sql(
    decode_seqs_sql: str,
    reference_spans: Sequence[tuple[int, int]] = (),
    *,
    from_requests: bool = False,
    streams: bool = False,
    host: str | None = None,
) -> str:
    """Each unit of work's time over its work's quickest quarter, ``(start_ns, ratio)``, for
    the range given as the named parameters ``since`` and ``until``, the quarter taken over
    the range and ``reference_spans``: the working steps, or with ``from_requests`` each
    decoded request at its last token (a store without steps, ``FROM_REQUESTS``) and, with
    ``streams``, each sample of a stream still open. ``host``: the load generator's share
    of the host samples as SQL (:func:`host_loadgen_sql`), None without host samples (every
    unit quiet)."""
    return _fill(_RATIOS_SQL, decode_seqs_sql, reference_spans, from_requests, streams, host)


_HOST_COLUMNS = {"time_ns", "kind", "cpu_others_pct", "steal_pct"}


def host_loadgen_sql(scope_or_con) -> str | None:
    """What a host sample's ``loadgen_cpu_pct`` reads as in :func:`work_ratios_sql` (``0`` in a
    store from before the census), or None where the store has no host samples' columns."""
    con = getattr(scope_or_con, "con", scope_or_con)
    cols = store_columns(con).get("device_samples", frozenset())
    if not cols >= _HOST_COLUMNS:
        return None
    return "coalesce(loadgen_cpu_pct, 0)" if "loadgen_cpu_pct" in cols else "0"


def has_open_streams(scope_or_con) -> bool:
    """Whether the store has the proxy's samples of open streams (``stream_samples``)."""
    con = getattr(scope_or_con, "con", scope_or_con)
    return {"time_ns", "first_token_ns", "output_tokens"} <= store_columns(con).get(
        "stream_samples", frozenset()
    )


#: the host samples' columns the comparison reads when the store has them (which seconds were
#: quiet)
_HOST_OPTIONAL = ("time_ns", "kind", "cpu_others_pct", "steal_pct", "loadgen_cpu_pct")


def compute(scope: Scope) -> Yield:
    host = host_loadgen_sql(scope)
    sql = _fill(_WINDOW_SQL, scope.decode_seqs_sql, scope.reference_spans, host=host)
    return Yield(scope.by_window(sql, "start_ns", scope.not_warm_step), {})


def compute_from_requests(scope: Scope) -> Yield:
    streams = has_open_streams(scope)
    sql = _fill(
        _WINDOW_SQL,
        "",
        scope.reference_spans,
        from_requests=True,
        streams=streams,
        host=host_loadgen_sql(scope),
    )
    return Yield(scope.by_window(sql, "start_ns", scope.not_warm_step), {})


#: ``same_work`` for a store without steps: the decoded requests' time per output token at the
#: same number of streams decoding beside them (``_REQUEST_WORK``), and the open streams' where
#: the proxy sampled them; ``same_work_steps`` counts the requests and samples
FROM_REQUESTS = Family(
    name="same_work_from_requests",
    needs={
        "requests": (
            "request_id",
            "first_token_ns",
            "last_token_ns",
            "tpot_ms",
            "finish_reason",
            "error_type",
        )
    },
    optional={
        "stream_samples": ("time_ns", "first_token_ns", "output_tokens"),
        "device_samples": _HOST_OPTIONAL,
    },
    window_keys=("same_work_slowdown", "same_work_steps"),
    overall_keys=(),
    compute=compute_from_requests,
)


FAMILY = Family(
    name="same_work",
    needs={"engine_steps": ("start_ns", "end_ns", *WORKING_COLUMNS, "num_prefill_chunks")},
    optional={"engine_steps": ("num_draft_tokens",), "device_samples": _HOST_OPTIONAL},
    window_keys=("same_work_slowdown", "same_work_steps"),
    overall_keys=(),
    compute=compute,
    fallback=FROM_REQUESTS,
)


def ran_from_requests(sources) -> bool:
    """Whether a load's ``Signals.sources`` (a report's ``signal_sources``) says the same-work
    comparison ran over the requests (:data:`FROM_REQUESTS`), not the steps."""
    return sources.get(FAMILY.name) == FROM_REQUESTS.name
