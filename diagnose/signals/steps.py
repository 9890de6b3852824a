"""Family ``steps``: the engine's working steps per window, by start.

Step time percentiles (all working steps, decode-only, mixed prefill + decode), prefill tokens
per step and their share of the tokens, tokens per step, sampled tokens and the throughput they
make, the batch and the queue. Batch size: ``batch_mean`` counts the sequences in each step's
forward (prefill chunks plus decodes, draft tokens not counted: :func:`decode_seqs_sql`);
``running_mean``/``running_max`` read ``num_running``, which the engine counts after the step,
so requests that finish in it are gone (one-token requests read 0 there). Idle heartbeats (not
``WORKING_STEP_SQL``) count only for ``running_max`` and the queue.
"""

from __future__ import annotations

import functools

from tokenmill.telemetry.schema import STEP_DECODE_SEQS_SQL, WORKING_STEP_SQL

from .family import Family, Yield
from .samples import STEPS_FROM_SAMPLES
from .scope import Scope

# the columns of WORKING_STEP_SQL (a step that ran tokens, not an idle heartbeat)
WORKING_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def decode_seqs_sql(scope_columns) -> str:
    """SQL for the sequences a step decoded: its decode tokens less the draft tokens
    (speculative decoding) where the store has ``num_draft_tokens``. ``scope_columns``: the
    store's ``engine_steps`` columns (lower case)."""
    return STEP_DECODE_SEQS_SQL if "num_draft_tokens" in scope_columns else "num_decode_tokens"


# waiting_decode_only_share: of all the window's steps (an idle heartbeat has nothing waiting),
# those that began with requests waiting and prefilled nothing: admission closed
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
    avg((num_waiting > 0 AND num_prefill_tokens = 0)::DOUBLE) AS waiting_decode_only_share
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
GROUP BY win
"""

_KEYS = (
    "steps",
    "step_ms_p50",
    "step_ms_p99",
    "step_ms_mean",
    "decode_step_ms_p50",
    "mixed_step_ms_p50",
    "mixed_step_ms_max",
    "prefill_tokens_max",
    "prefill_token_share",
    "tokens_per_step",
    "sampled_tokens",
    "running_mean",
    "batch_mean",
    "running_max",
    "waiting_mean",
    "waiting_max",
    "waiting_decode_only_share",
)


def by_start(scope: Scope, sql: str, **params) -> Yield:
    """``sql`` per window (warm-up set apart) and over the whole range (warm-up kept), over the
    engine steps by start (the step families' ``$t0``/``$w``/``$since``/``$until`` SQL)."""
    return Yield(
        scope.by_window(sql, "start_ns", scope.not_warm_step, **params),
        scope.over_range(sql, "start_ns", **params),
    )


def start_family(name: str, sql: str, keys: tuple[str, ...], *columns: str, **more) -> Family:
    """A family of ``sql``'s ``keys`` per window and over the range, over the engine steps by
    start (:func:`by_start`), reading ``start_ns``, the working-step columns and ``columns``;
    ``more``: the family's other fields (``fallback``, ``optional``)."""
    return Family(
        name=name,
        needs={"engine_steps": ("start_ns", *WORKING_COLUMNS, *columns)},
        window_keys=keys,
        overall_keys=keys,
        compute=functools.partial(by_start, sql=sql),
        **more,
    )


def compute(scope: Scope) -> Yield:
    out = by_start(scope, _STEP_WINDOW_SQL.replace("__DECODE_SEQS__", scope.decode_seqs_sql))
    for i in range(scope.n_windows):
        v = out.windows.setdefault(i, {})
        sampled = v.get("sampled_tokens")
        v["throughput_tok_s"] = (sampled / scope.window_s) if sampled else None
    return out


FAMILY = Family(
    name="steps",
    needs={
        "engine_steps": (
            "start_ns",
            "end_ns",
            *WORKING_COLUMNS,
            "num_prefill_chunks",
            "num_sampled",
            "num_running",
            "num_waiting",
        )
    },
    optional={"engine_steps": ("num_draft_tokens",)},
    window_keys=(*_KEYS, "throughput_tok_s"),
    overall_keys=_KEYS,
    compute=compute,
    fallback=STEPS_FROM_SAMPLES,
)
