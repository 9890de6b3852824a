"""Family ``spec``: speculative decoding, what drafts gain and what they cost, by window of the
steps' start (``telemetry/schema.py``: ``SPEC_STEP_SQL``, ``spec_agg_sql``).

Decode-only steps that verified drafts against those that did not, compared within the same
batch class (decode sequences in the same power of two): ``spec_step_cost`` is the draft steps'
mean ``forward_ms`` over the plain steps' in their class, weighted by draft steps (NULL when no
class holds both kinds); ``spec_gain_per_cost`` is (1 + accepted tokens per draft) over that
cost: the output tokens a draft step yields per unit of a plain step's time, relative to a plain
step's one token (below 1, speculation slows decode). ``spec_intensity_p50`` is the median
FLOP/byte of the decode-only draft steps (the roofline; NULL without its columns).
"""

from __future__ import annotations

from tokenmill.telemetry.schema import (
    DECODE_ONLY_STEP_SQL,
    ROOFLINE_STEP_SQL,
    SPEC_STEP_SQL,
    STEP_DECODE_SEQS_SQL,
    STEP_INTENSITY_SQL,
    WORKING_STEP_SQL,
    spec_agg_sql,
)

from .family import Family, Yield
from .roofline import ROOFLINE_COLUMNS
from .scope import Scope
from .steps import WORKING_COLUMNS, by_start

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

_KEYS = (
    "spec_steps",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_accepted_per_draft",
    "spec_decode_steps",
    "plain_decode_steps",
    "spec_step_ms",
    "plain_decode_step_ms",
    "spec_batch_mean",
    "spec_intensity_p50",
    "spec_forward_share",
    "spec_step_cost",
    "spec_matched_steps",
    "spec_gain_per_cost",
)


def compute(scope: Scope) -> Yield:
    # the draft steps' intensity only with the roofline columns
    roofline = scope.has("engine_steps", *ROOFLINE_COLUMNS)
    sql = _SPEC_WINDOW_SQL.replace("$intensity", _SPEC_INTENSITY if roofline else "NULL")
    return by_start(scope, sql)


FAMILY = Family(
    name="spec",
    needs={
        "engine_steps": (
            "start_ns",
            *WORKING_COLUMNS,
            "forward_ms",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
        )
    },
    optional={"engine_steps": ROOFLINE_COLUMNS},
    window_keys=_KEYS,
    overall_keys=_KEYS,
    compute=compute,
)
