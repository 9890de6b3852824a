"""Which prefill work was a recompute: each step's prefill tokens split into a prompt's first pass
and the recompute of a request preempted after its first token.

A request is prefilled again only after a preemption by recompute (its KV freed; ``scheduler.py``),
so a prefill chunk of a request whose first token came before the step began is a recompute
(``engine_steps.req_ids``/``req_tokens``/``req_prefill`` against ``requests.first_token_ns``). The
chain KV pressure → preemption → recompute prefill → ITL spikes is read from here:
``kv_pressure_preemption`` names the recompute steps and the streams they stalled, and
``itl_prefill_interference`` leaves those steps to it. A store without the per-step request
lists (another engine's, or one recorded before them) yields nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scope import store_columns
from .window import Signals

_RECOMPUTE_SQL = """
WITH s AS (SELECT start_ns, end_ns, unnest(req_ids) AS rid, unnest(req_tokens) AS tok,
                  unnest(req_prefill) AS pf
           FROM engine_steps
           WHERE start_ns >= ? AND start_ns < ? AND num_prefill_tokens > 0 AND req_ids IS NOT NULL),
p AS (SELECT s.*, coalesce(r.first_token_ns < s.start_ns, false) AS again
      FROM s LEFT JOIN requests r ON r.request_id = s.rid WHERE s.pf)
SELECT start_ns, any_value(end_ns), sum(tok) FILTER (WHERE again),
       coalesce(sum(tok) FILTER (WHERE NOT again), 0), list(rid) FILTER (WHERE again)
FROM p GROUP BY start_ns HAVING count(*) FILTER (WHERE again) > 0 ORDER BY start_ns
"""


@dataclass(frozen=True)
class RecomputeStep:
    """A step that recomputed preempted requests' tokens."""

    start_ns: int
    end_ns: int
    recomputed_tokens: int  # prefill tokens of requests that had had their first token
    fresh_tokens: int  # prefill tokens of prompts on their first pass
    request_ids: tuple[str, ...]  # the requests recomputed

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def mostly_recompute(self) -> bool:
        return self.recomputed_tokens >= self.fresh_tokens


def recompute_steps(sig: Signals) -> list[RecomputeStep]:
    """The range's steps with recompute prefill in them, by start (none where the store lacks
    the per-step request lists)."""
    cols = store_columns(sig.con)
    if not {"req_ids", "req_tokens", "req_prefill"} <= cols.get("engine_steps", frozenset()):
        return []
    if "first_token_ns" not in cols.get("requests", frozenset()):
        return []
    rows = sig.con.execute(_RECOMPUTE_SQL, [sig.since_ns, sig.until_ns]).fetchall()
    return [
        RecomputeStep(int(s), int(e), int(again), int(fresh), tuple(ids))
        for s, e, again, fresh, ids in rows
    ]
