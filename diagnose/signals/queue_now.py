"""The queue as it stands: requests still waiting for their first token, from two samples.

A store holds a request once it has ended, so a queue shows in ``requests`` only when its first
victims finish: a short request stuck 30 s behind a long prompt is seen 30 s late. Two records
show it while it stands:

- the API samples every request in flight without its first token each second
  (``waiting_samples``: its wait so far and its prompt size), whatever the engine is doing; a
  10 s prefill step hides nothing from it;
- each engine step records the longest-waiting request not yet scheduled
  (``StepRecord.oldest_wait_ms``, ``oldest_wait_id``, ``oldest_wait_prompt_tokens``), seen
  when the step ends.

Where such a request has no ``requests`` row yet it is still in flight, and its TTFT will be at
least its wait. Rules read these waits where the ended requests cannot tell yet (a live store);
in a store whose requests have all ended there are none, and a store from before the fields has
none either.

Behind a proxy, the streams that have made their first token and not ended are sampled too
(``stream_samples``): their latest output says the upstream still makes tokens while no request
ends (:func:`last_stream_token_ns`).
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

# the API's samples: per request its longest wait, when, its prompt size, and the most requests
# waiting in one sample while it did
_SAMPLED_SQL = """
WITH w AS (
    SELECT *, count(*) OVER (PARTITION BY time_ns) AS n FROM waiting_samples
    WHERE time_ns >= ? AND time_ns < ?)
SELECT request_id, max(wait_ms), arg_max(time_ns, wait_ms), any_value(prompt_tokens), max(n)
FROM w WHERE request_id NOT IN (SELECT request_id FROM requests)
GROUP BY request_id
"""


@dataclass(frozen=True)
class Waiting:
    """A request not ended yet, without its first token when last seen: the longest wait a
    sample or a step saw (it may have been scheduled since; its TTFT is at least that wait
    either way)."""

    request_id: str
    wait_ms: float
    at_ns: int  # when that wait was seen (the sample, or the start of the step)
    prompt_tokens: int | None
    num_waiting: int  # the most requests waiting at its steps

    @property
    def queued_ns(self) -> int:
        return self.at_ns - int(self.wait_ms * 1e6)


def _has(sig: Signals, *names: str) -> bool:
    return set(names) <= store_columns(sig.con).get("engine_steps", frozenset())


def waiting_now(sig: Signals) -> list[Waiting]:
    """The requests still in flight that waited for their first token in the range, each with
    the longest wait a sample or a step saw, in the order they were seen at that wait (read
    once per ``sig``; several rules ask)."""
    if "waiting_now" not in sig.memo:
        sig.memo["waiting_now"] = _waiting_now(sig)
    return list(sig.memo["waiting_now"])


def _waiting_now(sig: Signals) -> list[Waiting]:
    rows = []
    if "request_id" in store_columns(sig.con).get("waiting_samples", frozenset()):
        rows += sig.con.execute(_SAMPLED_SQL, [sig.since_ns, sig.until_ns]).fetchall()
    if _has(sig, "oldest_wait_id", "oldest_wait_ms", "oldest_wait_prompt_tokens"):
        rows += sig.con.execute(_WAITING_SQL, [sig.since_ns, sig.until_ns]).fetchall()
    longest: dict[str, Waiting] = {}
    for r in rows:
        x = Waiting(r[0], r[1], r[2], r[3], r[4] or 0)
        seen = longest.get(x.request_id)
        if seen is None or x.wait_ms > seen.wait_ms:
            longest[x.request_id] = x
    return sorted(longest.values(), key=lambda x: x.at_ns)


_STREAM_TOKEN_SQL = "SELECT max(last_token_ns) FROM stream_samples WHERE time_ns >= ?"


def last_stream_token_ns(sig: Signals, since_ns: int) -> int | None:
    """The latest output any stream still in flight had made, by the samples taken since
    ``since_ns`` (``stream_samples``, a proxy's); None without such a sample (or the table)."""
    if "last_token_ns" not in store_columns(sig.con).get("stream_samples", frozenset()):
        return None
    (t,) = sig.con.execute(_STREAM_TOKEN_SQL, [since_ns]).fetchone()
    return t


# the last step the store holds, and the latest time anything was recorded: host samples go on
# each tick whatever the engine does, as do the API's waiting samples
_LAST_STEP_SQL = """
SELECT end_ns, num_running - coalesce(num_finished, 0)
FROM engine_steps WHERE start_ns >= ? ORDER BY end_ns DESC LIMIT 1
"""
_PACE_SQL = """
SELECT median(ms) FROM (SELECT (end_ns - start_ns) / 1e6 AS ms FROM engine_steps
                        WHERE start_ns >= ? ORDER BY end_ns DESC LIMIT 5)
"""


@dataclass(frozen=True)
class OpenStep:
    """The engine's step in progress on a live store: nothing has ended since the last step
    did, though requests were running then or have waited since. An idle engine writes a
    heartbeat step every 0.5 s, so a silence with work to do is one step that has lasted at
    least that long; the requests decoding beside it have had no token since."""

    start_ns: int  # the last stored step's end
    now_ns: int  # the store's latest record (a host or waiting sample)
    running: int  # requests running after the last stored step
    pace_ms: float  # the median of the last five stored steps: the pace before it

    @property
    def lasted_ms(self) -> float:
        return (self.now_ns - self.start_ns) / 1e6


def open_step(sig: Signals) -> OpenStep | None:
    """The step in progress at the store's latest record, if requests were running when the
    last stored step ended (or waited for their first token since) and no step has ended nor
    token been made since; None where the steps run to the store's end (every finished dump, a
    range that ends before the store does, a store without samples). With several engines in
    one store (replicas, a fleet) the latest step of any of them counts: a long step of one
    is then not seen while another steps."""
    last = sig.con.execute(_LAST_STEP_SQL, [sig.since_ns]).fetchall()
    if not last or last[0][0] >= sig.until_ns:
        return None
    end_ns, running = last[0][0], max(0, last[0][1] or 0)
    if not running and not any(x.at_ns >= end_ns for x in waiting_now(sig)):
        return None  # nothing to run: an idle engine (its heartbeat may just be late)
    latest = [
        f"SELECT max(time_ns) FROM {t}"
        for t in ("device_samples", "waiting_samples")
        if "time_ns" in store_columns(sig.con).get(t, frozenset())
    ]
    if not latest:
        return None
    (now,) = sig.con.execute(
        f"SELECT max(t) FROM ({' UNION ALL '.join(latest)}) AS x(t)"
    ).fetchone()
    # a token made after the last stored step came from a step that ended (a request's row is
    # written after its last token has been streamed, so its end_ns may follow a step's end)
    (token,) = sig.con.execute(
        "SELECT max(coalesce(last_token_ns, first_token_ns)) FROM requests"
    ).fetchone()
    if now is None or now <= end_ns or (token is not None and token > end_ns):
        return None
    (pace,) = sig.con.execute(_PACE_SQL, [sig.since_ns]).fetchone()
    return OpenStep(end_ns, now, running, pace or 0.0)
