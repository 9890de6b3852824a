"""Family ``same_work``: the same work, slower (host_contention).

Each working step against the quickest quarter of the steps that did the same work (same batch:
prefill chunks + decodes; tokens in the same power of two), over the whole range and the live
loop's reference windows (healthy windows from before the range: a 30 s range inside a
neighbour's run has no quick steps of its own to compare with); a step whose
class has fewer than 5 steps is set against the per-token cost of the largest class with no more
tokens (a conservative ratio: per-token cost falls as a step grows). A window's ``same_work_slowdown`` is the median of its steps'
ratios: 1.0 when the steps ran as fast as the dump's usual best for their work, 2.0 when the
same work took twice as long.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.telemetry.schema import WORKING_STEP_SQL

from .family import Family, Yield
from .scope import Scope, in_intervals
from .steps import WORKING_COLUMNS

# each working step and the quickest quarter of the steps that did its work: CTEs ``s`` (the
# range's working steps with their class and tokens), ``ref`` (each class's 25th percentile and
# median tokens) and ``r`` (each step's ratio: against its own class's reference; a step whose
# class has too few steps for one, against the per-token cost of the largest class with no more
# tokens, times its own tokens: a neighbour that grows the queue grows the batch to sizes the
# dump never ran otherwise, and per-token cost only falls as a step grows, so this ratio errs
# low)
SAME_WORK_CTE = f"""
WITH w AS (
    SELECT start_ns, (end_ns - start_ns) / 1e6 AS ms,
        num_prefill_chunks + __DECODE_SEQS__ AS batch,
        num_prefill_tokens + num_decode_tokens AS tok,
        CAST(floor(log2(greatest(num_prefill_tokens + num_decode_tokens, 1))) AS INTEGER) AS tok_class
    FROM engine_steps
    WHERE (start_ns >= $since AND start_ns < $until OR (__IN_REFERENCE__)) AND {WORKING_STEP_SQL}
), s AS (
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
_SAME_WORK_WINDOW_SQL = (
    SAME_WORK_CTE
    + """
SELECT (start_ns - $t0) // $w AS win,
    quantile_cont(ratio, 0.5) AS same_work_slowdown,
    count(*) AS same_work_steps
FROM r WHERE ratio IS NOT NULL
GROUP BY win
"""
)


def _fill(sql: str, decode_seqs_sql: str, reference_spans: Sequence[tuple[int, int]]) -> str:
    return sql.replace("__DECODE_SEQS__", decode_seqs_sql).replace(
        "__IN_REFERENCE__", in_intervals("start_ns", reference_spans)
    )


def step_ratios_sql(decode_seqs_sql: str, reference_spans: Sequence[tuple[int, int]] = ()) -> str:
    """Each working step's time over its work's quickest quarter, ``(start_ns, ratio)``, for
    the range given as the named parameters ``since`` and ``until``, the quarter taken over
    the range and ``reference_spans``."""
    sql = SAME_WORK_CTE + "SELECT start_ns, ratio FROM r WHERE ratio IS NOT NULL"
    return _fill(sql, decode_seqs_sql, reference_spans)


def compute(scope: Scope) -> Yield:
    sql = _fill(_SAME_WORK_WINDOW_SQL, scope.decode_seqs_sql, scope.reference_spans)
    return Yield(scope.by_window(sql, "start_ns", scope.not_warm_step), {})


FAMILY = Family(
    name="same_work",
    needs={"engine_steps": ("start_ns", "end_ns", *WORKING_COLUMNS, "num_prefill_chunks")},
    optional={"engine_steps": ("num_draft_tokens",)},
    window_keys=("same_work_slowdown", "same_work_steps"),
    overall_keys=(),
    compute=compute,
)
