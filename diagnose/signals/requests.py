"""Family ``requests``: what the requests that arrived in each window saw, by arrival.

TTFT/ITL/TPOT/E2E/queue/prefill percentiles of the completed requests, queue and prefill shares
of TTFT, prompt sizes, short prompts' TTFT (``short_*``: prompts up to the dump's median, or
``short_prompt_tokens``), long prompts (4x that), requests that stalled mid-stream (a gap of 10x
their own ITL p50 after a fast first token), arrivals and their rate. Also the SQL the other
request families share (:func:`by_arrival`).
"""

from __future__ import annotations

import functools
import re

from tokenmill.telemetry.schema import COMPLETED_SQL

from .family import Family, Yield
from .scope import Scope

# the columns of COMPLETED_SQL (a request completed: finished by stop/length, no error)
COMPLETED_COLUMNS = ("finish_reason", "error_type")


def arrival_family(name: str, select: str, keys: tuple[str, ...], *columns: str) -> Family:
    """A family of ``select``'s ``keys`` per window and over the range, over the requests by
    arrival (:func:`by_arrival`), reading ``arrival_ns``, ``columns`` and, when ``select`` asks
    whether a request completed (``ok``), the columns that tell."""
    completed = COMPLETED_COLUMNS if re.search(r"\bok\b", select) else ()
    return Family(
        name=name,
        needs={"requests": ("arrival_ns", *completed, *columns)},
        window_keys=keys,
        overall_keys=keys,
        compute=functools.partial(by_arrival, select=select),
    )


def arrival_sql(select: str) -> str:
    """A query per window over the requests that arrived in the range (``win`` by arrival, then
    ``select``'s columns; ``ok`` in ``select`` is "the request completed")."""
    ok = f", {COMPLETED_SQL} AS ok" if re.search(r"\bok\b", select) else ""
    return f"""
SELECT (arrival_ns - $t0) // $w AS win,
{select}
FROM (SELECT *{ok} FROM requests
      WHERE arrival_ns >= $since AND arrival_ns < $until)
GROUP BY win
"""


def by_arrival(scope: Scope, select: str) -> Yield:
    """``select`` per window (warm-up set apart) and over the whole range (warm-up kept), over
    the requests by arrival; ``$short`` and ``$fast_ttft`` are the scope's short-prompt and
    fast-TTFT cuts."""
    sql = arrival_sql(select)
    params = {"short": scope.short_prompt_tokens, "fast_ttft": scope.fast_ttft_ms}
    return Yield(
        windows=scope.by_window(sql, "arrival_ns", scope.not_warm_req, **params),
        overall=scope.over_range(sql, "arrival_ns", **params),
    )


_SELECT = f"""
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
    quantile_cont(ttft_ms, 0.99) FILTER (WHERE ok AND input_tokens <= $short) AS short_ttft_p99,
    count(*) FILTER (WHERE ok AND input_tokens <= $short) AS short_n,
    avg(queue_ms / nullif(ttft_ms, 0)) FILTER (WHERE ok AND input_tokens <= $short) AS short_queue_share,
    count(*) FILTER (WHERE ok AND input_tokens >= 4 * $short) AS long_n,
    count(*) FILTER (WHERE ok AND itl_max_ms >= 10 * itl_p50_ms AND ttft_ms <= $fast_ttft) AS stalled_n"""

_KEYS = (
    "arrivals",
    "completed_arrivals",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "itl_max",
    "tpot_p50",
    "tpot_p99",
    "queue_p50",
    "queue_p99",
    "prefill_p50",
    "prefill_p99",
    "e2e_p50",
    "e2e_p99",
    "queue_share_of_ttft",
    "prefill_share_of_ttft",
    "input_p50",
    "input_p99",
    "input_max",
    "short_ttft_p99",
    "short_n",
    "short_queue_share",
    "long_n",
    "stalled_n",
)


def compute(scope: Scope) -> Yield:
    y = by_arrival(scope, _SELECT)
    for i in range(scope.n_windows):
        v = y.windows.setdefault(i, {})
        v["arrival_rate"] = (v.get("arrivals") or 0) / scope.window_s
    y.overall["short_prompt_tokens"] = scope.short_prompt_tokens
    return y


FAMILY = Family(
    name="requests",
    needs={
        "requests": (
            "arrival_ns",
            *COMPLETED_COLUMNS,
            "ttft_ms",
            "itl_p50_ms",
            "itl_p99_ms",
            "itl_max_ms",
            "tpot_ms",
            "queue_ms",
            "prefill_ms",
            "e2e_ms",
            "input_tokens",
        )
    },
    window_keys=(*_KEYS, "arrival_rate"),
    overall_keys=(*_KEYS, "short_prompt_tokens"),
    compute=compute,
)
