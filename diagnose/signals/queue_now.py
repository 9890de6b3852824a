"""The queue as it stands: requests still waiting, read from the steps' ``oldest_wait_*``.

A store holds a request once it has ended, so a queue shows in ``requests`` only when its first
victims finish: a short request stuck 30 s behind a long prompt is seen 30 s late. Each engine
step records the longest-waiting request not yet scheduled, its wait so far and its prompt size
(``StepRecord.oldest_wait_ms``, ``oldest_wait_id``, ``oldest_wait_prompt_tokens``). Where that
request has no ``requests`` row yet it is still in flight, and its TTFT will be at least its
wait, all of it queue time. Rules read these waits where the ended requests cannot tell yet (a
live store); in a store whose requests have all ended there are none, and a store from before
the fields has none either.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scope import store_columns
from .window import Signals

_WAITING_SQL = """
SELECT oldest_wait_id, max(oldest_wait_ms), arg_max(start_ns, oldest_wait_ms),
       any_value(oldest_wait_prompt_tokens), max(num_waiting)
FROM engine_steps
WHERE start_ns >= ? AND start_ns < ? AND oldest_wait_id IS NOT NULL
  AND oldest_wait_id NOT IN (SELECT request_id FROM requests)
GROUP BY oldest_wait_id ORDER BY 3
"""


@dataclass(frozen=True)
class Waiting:
    """A request not ended yet that headed the queue at some step: the longest wait a step saw
    (it may have been scheduled since; its TTFT is at least that wait either way)."""

    request_id: str
    wait_ms: float
    at_ns: int  # the start of the step that saw that wait
    prompt_tokens: int | None
    num_waiting: int  # the most requests waiting at its steps

    @property
    def queued_ns(self) -> int:
        return self.at_ns - int(self.wait_ms * 1e6)


def _has(sig: Signals, *names: str) -> bool:
    return set(names) <= store_columns(sig.con).get("engine_steps", frozenset())


def waiting_now(sig: Signals) -> list[Waiting]:
    """The requests still in flight that waited at the head of the engine queue in the range,
    each with the longest wait a step saw, in the order of that step."""
    if not _has(sig, "oldest_wait_id", "oldest_wait_ms", "oldest_wait_prompt_tokens"):
        return []
    rows = sig.con.execute(_WAITING_SQL, [sig.since_ns, sig.until_ns]).fetchall()
    return [Waiting(r[0], r[1], r[2], r[3], r[4] or 0) for r in rows]
