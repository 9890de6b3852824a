"""Family ``same_work``: the same work, slower (host_contention).

Each working step against the quickest quarter of the steps that did the same work (same batch:
prefill chunks + decodes; tokens in the same power of two), over the whole range and the live
loop's reference windows (healthy windows from before the range: a 30 s range inside a
neighbour's run has no quick steps of its own to compare with); a step whose
class has fewer than 5 steps is set against the per-token cost of the largest class with no more
tokens (a conservative ratio: per-token cost falls as a step grows). A window's ``same_work_slowdown`` is the median of its steps'
ratios: 1.0 when the steps ran as fast as the dump's usual best for their work, 2.0 when the
same work took twice as long.

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

# each unit of work against the quickest quarter of the units that did the same work, after
# ``w``: CTEs ``s`` (the range's units), ``ref`` (each class's 25th percentile and median
# tokens) and ``r`` (each unit's ratio: against its own class's reference; a unit whose class
# has too few members for one, against the per-token cost of the largest class with no more
# tokens, times its own tokens: a neighbour that grows the queue grows the batch to sizes the
# dump never ran otherwise, and per-token cost only falls as a batch grows, so this ratio errs
# low)
_COMPARE = """, s AS (
    SELECT * FROM w WHERE start_ns >= $since AND start_ns < $until
), ref AS (
    SELECT batch, tok_class, quantile_cont(ms, 0.25) AS ref_ms, median(tok) AS ref_tok
    FROM (SELECT * FROM s UNION ALL SELECT * FROM w WHERE start_ns < $since)
    GROUP BY batch, tok_class HAVING count(*) >= 5
), r AS (
    SELECT s.start_ns, coalesce(
        s.ms / nullif(ref.ref_ms, 0),
        s.ms / nullif(s.tok * (SELECT arg_max(f.ref_ms / f.ref_tok, f.ref_tok) FROM ref f
                               WHERE f.ref_tok <= s.tok AND f.ref_tok > 0), 0)) AS ratio
    FROM s LEFT JOIN ref USING (batch, tok_class)
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
) -> str:
    work = _REQUEST_WORK if from_requests else _STEP_WORK
    return (
        (work + _COMPARE + sql)
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
) -> str:
    """Each unit of work's time over its work's quickest quarter, ``(start_ns, ratio)``, for
    the range given as the named parameters ``since`` and ``until``, the quarter taken over
    the range and ``reference_spans``: the working steps, or with ``from_requests`` each
    decoded request at its last token (a store without steps, ``FROM_REQUESTS``) and, with
    ``streams``, each sample of a stream still open."""
    return _fill(_RATIOS_SQL, decode_seqs_sql, reference_spans, from_requests, streams)


def has_open_streams(scope_or_con) -> bool:
    """Whether the store has the proxy's samples of open streams (``stream_samples``)."""
    con = getattr(scope_or_con, "con", scope_or_con)
    return {"time_ns", "first_token_ns", "output_tokens"} <= store_columns(con).get(
        "stream_samples", frozenset()
    )


def compute(scope: Scope) -> Yield:
    sql = _fill(_WINDOW_SQL, scope.decode_seqs_sql, scope.reference_spans)
    return Yield(scope.by_window(sql, "start_ns", scope.not_warm_step), {})


def compute_from_requests(scope: Scope) -> Yield:
    streams = has_open_streams(scope)
    sql = _fill(_WINDOW_SQL, "", scope.reference_spans, from_requests=True, streams=streams)
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
    optional={"stream_samples": ("time_ns", "first_token_ns", "output_tokens")},
    window_keys=("same_work_slowdown", "same_work_steps"),
    overall_keys=(),
    compute=compute_from_requests,
)


FAMILY = Family(
    name="same_work",
    needs={"engine_steps": ("start_ns", "end_ns", *WORKING_COLUMNS, "num_prefill_chunks")},
    optional={"engine_steps": ("num_draft_tokens",)},
    window_keys=("same_work_slowdown", "same_work_steps"),
    overall_keys=(),
    compute=compute,
    fallback=FROM_REQUESTS,
)
