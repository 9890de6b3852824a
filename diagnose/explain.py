"""One request's critical path, from the store (``tokenmill explain``, the console's waterfall).

:func:`explain` cuts the request's life, from its arrival at the gateway to the end of its
``request`` span (E2E), into parts that follow one another, so their milliseconds add up to
its E2E. Each part says what the request waited for, and behind whom:

- ``api``: ``gateway``, ``tokenize``, ``admission`` (the API stations' spans), ``to_engine``
  (the hop to the engine core; the core reads new requests between steps only, so the time a
  step was running is a ``queue`` part with reason ``running_step``).
- ``queue`` (reason): ``running_step`` (a step was running when it came: behind that step's
  requests), ``budget`` (the step's token budget went to running requests' chunks: a long
  prefill), ``kv_blocks`` (the KV pool had no room), ``max_num_seqs`` (the running batch was
  at the cap), ``scheduling`` (the step that admitted it, from the previous step's end); with
  the requests ahead of it in the queue and their tenants (``ahead``).
- ``prefill``: ``prefill_chunk`` (one per step: its tokens and the requests that shared the
  step), ``prefill_wait`` (a step that ran without it), ``preempted`` (its blocks taken back
  for another request's allocation, ``by``, until it was scheduled again).
- ``decode``: ``decode`` (runs of steps: batch size, tokens), ``stall`` (a step more than
  twice its decode steps' median: ``prefill_in_step``, another request's prefill chunk in the
  step, or ``slow_step``; ``not_scheduled``, a step that ran without it), ``preempted``,
  ``recompute`` (its prompt and outputs computed again after a preemption); with prefill/decode
  disaggregation ``handoff``, ``kv_transfer`` and ``decode_queue`` (the KV waiting for room on
  the decode side).
- ``stream``: ``output_send`` (the last step's end and the hop to the API process),
  ``stream_write`` (the rest of the answer written to the client: socket writes, a slow
  reader), ``metering``.

The attribution reads the step rows of the engine core that ran the request: each step's
requests (``engine_steps.req_ids``, ``req_tokens``, ``req_prefill``) and why admission stopped
(``admit_stop``), and the request's own events (``chunk``, ``preempted`` with ``by``,
``resumed``, ``kv_transfer``). A store written before those columns gives the parts by phase,
without their causes (a note says so).

The prefix cache's side: ``cache`` lists every prompt block the cache did not serve at
admission, with its reason (``requests.cache_misses``; ``engine/messages.py``:
``CACHE_MISS_REASONS``).

JSON contract (:data:`SCHEMA_VERSION` 1), written once here (``to_json``)::

    {"schema_version": 1, "request_id", "client_request_id", "trace_id", "tenant", "replica",
     "arrival_ns", "e2e_ms", "parts_ms" (their sum), "ttft_ms", "queue_ms" (engine queue, as
     the row), "text_holdback_ms", "finish_reason", "error_type", "input_tokens",
     "output_tokens", "cached_tokens", "preemptions",
     "phases": {"api": ms, "queue": ms, "prefill": ms, "decode": ms, "stream": ms},
     "parts": [{"phase", "kind", "start_ms" (from arrival), "ms", "share" (of E2E),
                "text" (one line), optional "reason", "steps", "step_ids" [first, last],
                "tokens", "behind" [{"request_id", "tenant", "tokens", "prefill"}],
                "behind_count", "ahead" {"count", "requests" [{"request_id", "tenant"}]},
                "shared_with" [same shape as behind], "by", "by_tenant", "batch" {"min",
                "median", "max"}, "step_ms", "core"}],
     "waited_behind": [{"request_id", "tenant", "ms", "reasons"}] (most first),
     "cache": {"block_size", "prompt_blocks", "cached_blocks",
               "misses": [{"reason", "first_block", "num_blocks", "text", optional "time_ns",
                           "time_ms" (from arrival), "by", "by_tenant", "tenant"}]} or null,
     "notes": [str]}
"""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from tokenmill.telemetry.schema import WORKING_STEP_SQL, columns

SCHEMA_VERSION = 1
PHASES = ("api", "queue", "prefill", "decode", "stream")
#: a decode step is a stall when its time is over this multiple of the request's median
#: decode step (and at least STALL_MIN_MS over it)
STALL_FACTOR = 2.0
STALL_MIN_MS = 1.0
#: requests named in a part's ``behind``/``ahead``/``shared_with`` lists
MAX_NAMED = 5

QUEUE_TEXT = {
    "running_step": "a step was running when it arrived",
    "budget": "the step's token budget went to running requests' chunks",
    "kv_blocks": "the KV pool had no room",
    "max_num_seqs": "the running batch was at --max-num-seqs",
    "scheduling": "the step that admitted it",
    "unknown": "no step row says why",
}
MISS_TEXT = {
    "caching_off": "prefix caching is off",
    "partial_block": "shorter than one block",
    "last_token": "holds the prompt's last token (always computed)",
    "after_miss": "cached, but behind an earlier miss",
    "evicted": "evicted",
    "other_tenant": "cached under another tenant's salt",
    "never_seen": "never seen",
}
_MS = 1e-6


class ExplainError(Exception):
    """The request cannot be explained from this store (one-line reason)."""


@dataclass
class Step:
    """One working ``engine_steps`` row of the request's engine core."""

    step_id: int
    start: int
    end: int
    ids: list[str] | None
    tokens: list[int]
    prefill: list[bool]
    admit_stop: str | None
    output_send_ms: float | None

    def entry(self, rid: str) -> tuple[int, bool] | None:
        """``(tokens, prefill)`` of ``rid`` in this step, None when it had no tokens here."""
        if not self.ids or rid not in self.ids:
            return None
        i = self.ids.index(rid)
        return self.tokens[i], self.prefill[i]

    def others(self, rid: str) -> list[dict]:
        """The step's other requests, prefill chunks first, most tokens first."""
        rows = [
            {"request_id": r, "tokens": t, "prefill": bool(p)}
            for r, t, p in zip(self.ids or [], self.tokens, self.prefill)
            if r != rid
        ]
        return sorted(rows, key=lambda e: (not e["prefill"], -e["tokens"]))


@dataclass
class Piece:
    """A stretch of the time axis with one cause (merged into a part)."""

    phase: str
    kind: str
    start: int
    end: int
    reason: str | None = None
    steps: list[int] = field(default_factory=list)
    behind: list[dict] = field(default_factory=list)
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        # the running set (KV, the cap) changes member by member: one part while it holds
        top = self.behind[0]["request_id"] if self.behind else None
        if self.reason in ("kv_blocks", "max_num_seqs"):
            top = None
        return (self.phase, self.kind, self.reason, top, self.extra.get("by"))


def _one(con, sql: str, params: list) -> dict | None:
    cur = con.execute(sql, params)
    cols = [d[0] for d in cur.description]
    row = cur.fetchone()
    return dict(zip(cols, row, strict=True)) if row else None


def _find_request(con, request_id: str) -> tuple[dict, list[str]]:
    cur = con.execute(
        "SELECT * FROM requests WHERE request_id = $id OR client_request_id = $id "
        "OR trace_id = $id ORDER BY end_ns DESC",
        {"id": request_id},
    )
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
    if not rows:
        raise ExplainError(f"no request {request_id!r} in the store (request, client or trace id)")
    notes = []
    if len(rows) > 1:
        notes.append(f"{len(rows)} requests match {request_id!r}; this is the latest")
    return rows[0], notes


def _spans(con, trace_id: str) -> tuple[dict[str, tuple[int, int]], list[dict]]:
    """Station intervals and the request's engine events (name, time_ns, step_id, attrs)."""
    rows = con.execute(
        "SELECT name, start_ns, end_ns, events FROM spans WHERE trace_id = ?", [trace_id]
    ).fetchall()
    stations: dict[str, tuple[int, int]] = {}
    events = []
    for name, start, end, evs in rows:
        stations[name] = (int(start), int(end))
        for e in json.loads(evs or "[]"):
            attrs = {
                k.removeprefix("tokenmill."): v for k, v in (e.get("attributes") or {}).items()
            }
            events.append(
                {
                    "name": e.get("name"),
                    "time_ns": int(e.get("time_ns") or start),
                    "step_id": attrs.pop("step_id", None),
                    "attrs": attrs,
                }
            )
    events.sort(key=lambda e: e["time_ns"])
    return stations, events


def _source(src: str | None) -> tuple[str, dict]:
    """The condition keeping one source's rows in a fleet's union (its ``source`` column)."""
    return (" AND source = $src", {"src": src}) if src is not None else ("", {})


def _steps(con, lo: int, hi: int, replica, role, src: str | None) -> list[Step]:
    have = set(columns(con, "engine_steps"))
    names = ("req_ids", "req_tokens", "req_prefill", "admit_stop", "output_send_ms", "role")
    col = {c: (c if c in have else "NULL") for c in names}
    where, params = _source(src)
    rows = con.execute(
        f"SELECT step_id, start_ns, end_ns, {col['req_ids']}, {col['req_tokens']}, "
        f"{col['req_prefill']}, {col['admit_stop']}, {col['output_send_ms']} "
        f"FROM engine_steps WHERE end_ns >= $lo AND start_ns <= $hi AND {WORKING_STEP_SQL} "
        f"AND replica IS NOT DISTINCT FROM $replica AND {col['role']} IS NOT DISTINCT FROM "
        f"$role{where} ORDER BY end_ns, start_ns",
        {"lo": lo, "hi": hi, "replica": replica, "role": role, **params},
    ).fetchall()
    return [
        Step(int(r[0]), int(r[1]), int(r[2]), r[3], r[4] or [], r[5] or [], r[6], r[7])
        for r in rows
    ]


def _own_cores(con, rid: str, lo: int, hi: int, src: str | None) -> list[tuple]:
    """``(start_ns, replica, role)`` of the steps that computed tokens for ``rid``."""
    have = set(columns(con, "engine_steps"))
    if "req_ids" not in have:
        return []
    role = "role" if "role" in have else "NULL"
    where, params = _source(src)
    return con.execute(
        f"SELECT start_ns, replica, {role} FROM engine_steps WHERE end_ns >= $lo "
        f"AND start_ns <= $hi AND list_contains(req_ids, $rid){where} ORDER BY start_ns",
        {"lo": lo, "hi": hi, "rid": rid, **params},
    ).fetchall()


class _Axis:
    """A core's steps by end time, to find the step that closes a moment."""

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self.ends = [s.end for s in steps]

    def at(self, t: int) -> Step | None:
        """The first step ending at or after ``t`` (None past the last)."""
        i = bisect.bisect_left(self.ends, t)
        return self.steps[i] if i < len(self.steps) else None

    def before(self, t: int) -> Step | None:
        """The last step that ended at or before ``t``."""
        i = bisect.bisect_right(self.ends, t)
        return self.steps[i - 1] if i else None

    def prev_end(self, t: int) -> int | None:
        """The end of the last step that ended at or before ``t``."""
        s = self.before(t)
        return s.end if s is not None else None

    def cuts(self, a: int, b: int) -> list[int]:
        return sorted({s.end for s in self.steps if a < s.end < b})


def _split(a: int, b: int, cuts) -> list[tuple[int, int]]:
    bounds = [a, *sorted(c for c in set(cuts) if a < c < b), b]
    return [(x, y) for x, y in itertools.pairwise(bounds) if y > x]


@dataclass
class _Ctx:
    rid: str
    row: dict
    events: list[dict]
    preempted: list[tuple[int, int, dict]]  # (from, to, attrs)
    notes: list[str]


def _preempt_intervals(events: list[dict], stop: int) -> list[tuple[int, int, dict]]:
    out = []
    for i, e in enumerate(events):
        if e["name"] != "preempted":
            continue
        back = next((f for f in events[i + 1 :] if f["name"] == "resumed"), None)
        out.append((e["time_ns"], back["time_ns"] if back else stop, e["attrs"]))
    return out


def _in_preemption(ctx: _Ctx, x: int, y: int) -> dict | None:
    mid = (x + y) // 2
    for a, b, attrs in ctx.preempted:
        if a <= mid < b:
            return attrs
    return None


def _preempt_cuts(ctx: _Ctx) -> list[int]:
    return [t for a, b, _ in ctx.preempted for t in (a, b)]


def _api_pieces(ctx: _Ctx, a: int, b: int, axis: _Axis | None) -> list[Piece]:
    """``[a, b]``: the API's admission end to the engine core queueing the request. The core
    reads its inputs between steps, so the step that ended just before ``b`` was running when
    the request reached it: from that step's start (or ``a``) on, ``queue``/``running_step``;
    before it, ``to_engine`` (the hop, the API process's own delays)."""
    s = axis.before(b) if axis is not None else None
    if s is None or s.end <= a:
        return [Piece("api", "to_engine", a, b)]
    x = max(a, s.start)
    out = [Piece("api", "to_engine", a, x)] if x > a else []
    out.append(Piece("queue", "queue", x, b, "running_step", [s.step_id], s.others(ctx.rid)))
    return out


def _queue_pieces(ctx: _Ctx, a: int, b: int, axis: _Axis) -> list[Piece]:
    out = []
    for x, y in _split(a, b, axis.cuts(a, b)):
        s = axis.at(y)
        if s is None or s.ids is None:
            out.append(Piece("queue", "queue", x, y, "unknown"))
        elif s.entry(ctx.rid) is not None:
            out.append(Piece("queue", "queue", x, y, "scheduling", [s.step_id]))
        elif s.start < a:
            out.append(
                Piece("queue", "queue", x, y, "running_step", [s.step_id], s.others(ctx.rid))
            )
        else:
            reason = s.admit_stop or "unknown"
            out.append(Piece("queue", "queue", x, y, reason, [s.step_id], s.others(ctx.rid)))
    return out


def _engine_pieces(ctx: _Ctx, phase: str, a: int, b: int, axis: _Axis, extra_cuts=()) -> list:
    """Prefill or decode: each stretch between step ends, with the request's part in it."""
    out = []
    for x, y in _split(a, b, [*axis.cuts(a, b), *_preempt_cuts(ctx), *extra_cuts]):
        by = _in_preemption(ctx, x, y)
        s = axis.at(y)
        if by is not None:
            p = Piece(phase, "preempted", x, y, extra={"by": by.get("by")})
            p.extra["recompute_tokens"] = by.get("recompute_tokens")
            if s is not None:
                p.steps = [s.step_id]
            out.append(p)
            continue
        if s is None or s.ids is None:
            out.append(Piece(phase, "unknown", x, y, "unknown"))
            continue
        mine = s.entry(ctx.rid)
        others = s.others(ctx.rid)
        if phase == "decode" and s.start <= a:
            # the rest of the step that sampled its first token (after the sampling)
            p = Piece(phase, "decode", x, y)
            p.extra.update(batches=[], others_prefill=[])
            out.append(p)
            continue
        if mine is None:
            kind = "prefill_wait" if phase == "prefill" else "stall"
            reason = "budget" if phase == "prefill" else "not_scheduled"
            out.append(Piece(phase, kind, x, y, reason, [s.step_id], others))
            continue
        tokens, prefill = mine
        if phase == "prefill":
            p = Piece(phase, "prefill_chunk", x, y, None, [s.step_id], tokens=tokens)
            p.extra["shared_with"] = others
        elif prefill:
            p = Piece(phase, "recompute", x, y, None, [s.step_id], tokens=tokens)
        else:
            p = Piece(phase, "decode", x, y, None, [s.step_id], tokens=tokens)
            p.extra["batches"] = [len(s.ids)]
            p.extra["others_prefill"] = [o for o in others if o["prefill"]]
        out.append(p)
    return out


def _mark_stalls(pieces: list[Piece]) -> None:
    """Decode steps over STALL_FACTOR x the request's median decode step become stalls."""
    decodes = [p for p in pieces if p.kind == "decode"]
    full = [p.end - p.start for p in decodes[1:]] or [p.end - p.start for p in decodes]
    if not full:
        return
    median = statistics.median(full)
    for p in decodes[1:]:
        d = p.end - p.start
        if d > STALL_FACTOR * median and (d - median) * _MS > STALL_MIN_MS:
            p.kind = "stall"
            heavy = p.extra["others_prefill"]
            p.reason = "prefill_in_step" if heavy else "slow_step"
            p.behind = heavy
            p.extra["median_step_ms"] = median * _MS


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Consecutive pieces of one cause become one part (prefill chunks stay one per step)."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (
            last is not None
            and p.kind != "prefill_chunk"
            and last.key() == p.key()
            and last.end == p.start
        ):
            last.end = p.end
            last.steps += [s for s in p.steps if s not in last.steps]
            last.tokens += p.tokens
            last.behind = _sum_behind(last.behind, p.behind)
            if "batches" in p.extra:
                last.extra["batches"] = last.extra.get("batches", []) + p.extra["batches"]
            continue
        out.append(p)
    return out


def _sum_behind(a: list[dict], b: list[dict]) -> list[dict]:
    acc: dict[str, dict] = {}
    for e in [*a, *b]:
        cur = acc.setdefault(e["request_id"], {**e, "tokens": 0})
        cur["tokens"] += e["tokens"]
        cur["prefill"] = cur["prefill"] or e["prefill"]
    return sorted(acc.values(), key=lambda e: (not e["prefill"], -e["tokens"]))


def explain(con, request_id: str) -> dict:
    """The critical path of one request (``request_id``: the engine id, the client's
    ``x-request-id`` or the trace id) as the JSON-ready dict of the module's contract.

    Raises:
        ExplainError: no such request in the store.
    """
    row, notes = _find_request(con, request_id)
    rid = row["request_id"]
    stations, events = _spans(con, row["trace_id"])
    a0, end = int(row["arrival_ns"]), int(row["end_ns"])
    queued, scheduled = row.get("queued_ns"), row.get("scheduled_ns")
    first, last = row.get("first_token_ns"), row.get("last_token_ns")
    last_byte = stations.get("stream", (None, None))[1]
    aborted = next((e["time_ns"] for e in events if e["name"] == "aborted"), None)
    stop = aborted or last_byte or end
    ctx = _Ctx(rid, row, events, _preempt_intervals(events, last or stop), notes)

    # the engine core(s) that ran it: the first step with its tokens for the queue and the
    # prefill, the last one for the decode (a disaggregated request moves between the two)
    src = row.get("source")  # one dump of a fleet's union
    own = _own_cores(con, rid, a0, end, src)
    if own:
        early, late = own[0][1:], own[-1][1:]
    else:
        early = late = (row.get("replica"), None)
    steps_early = _steps(con, a0, end, *early, src)
    axis_early = _Axis(steps_early) if steps_early else _Axis([])
    axis_late = axis_early if late == early else _Axis(_steps(con, a0, end, *late, src))
    # a preemption happens while its step is scheduled: from the end of the step before it
    for i, (t_pre, t_back, attrs) in enumerate(ctx.preempted):
        axis = axis_late if first is not None and t_pre >= first else axis_early
        before = axis.prev_end(t_pre)
        if before is not None and before >= (scheduled or t_pre):
            ctx.preempted[i] = (before, t_back, attrs)
    if steps_early and all(s.ids is None for s in steps_early):
        notes.append(
            "this store's engine steps do not list their requests (written before "
            "engine_steps.req_ids): the parts are not split by cause"
        )
    elif queued is not None and not own:
        notes.append("no engine step computed tokens for this request")

    pieces: list[Piece] = []
    cur = a0

    def upto(t: int | None) -> tuple[int, int] | None:
        nonlocal cur
        if t is None:
            return None
        b = min(max(int(t), cur), end)
        span, cur = (cur, b), b
        return span if span[1] > span[0] else None

    for name in ("gateway", "tokenize", "admission"):
        if name in stations and (iv := upto(stations[name][1])):
            pieces.append(Piece("api", name, *iv))
    if queued is not None:
        if iv := upto(queued):
            pieces += _api_pieces(ctx, *iv, axis_early if steps_early else None)
        if iv := upto(scheduled if scheduled is not None else stop):
            pieces += _queue_pieces(ctx, *iv, axis_early)
        if scheduled is not None and (iv := upto(first if first is not None else stop)):
            pieces += _engine_pieces(ctx, "prefill", *iv, axis_early)
        if first is not None and (iv := upto(last)):
            moved = _kv_transfer(events)
            dec = _engine_pieces(ctx, "decode", *iv, axis_late, moved[:3] if moved else ())
            if moved:
                _mark_transfer(dec, moved)
            _mark_stalls(dec)
            pieces += dec
    last_step = axis_late.at(last) if last is not None and axis_late.steps else None
    if last_step is not None and last is not None:
        hop = last_step.end + round((last_step.output_send_ms or 0.0) * 1e6)
        if iv := upto(min(hop, last_byte or end)):
            pieces.append(Piece("stream", "output_send", *iv))
    if last_byte is not None and (iv := upto(last_byte)):
        pieces.append(Piece("stream", "stream_write", *iv))
    if iv := upto(end):
        pieces.append(Piece("stream", "metering", *iv))

    parts = _merge(pieces)
    names = _request_facts(con, parts, row)
    e2e_ms = (end - a0) * _MS
    out_parts = [_part_json(con, p, a0, e2e_ms, names, row) for p in parts]
    phases = {ph: 0.0 for ph in PHASES}
    for p in out_parts:
        phases[p["phase"]] += p["ms"]
    return {
        "schema_version": SCHEMA_VERSION,
        "request_id": rid,
        "client_request_id": row.get("client_request_id"),
        "trace_id": row["trace_id"],
        "tenant": row.get("tenant"),
        "replica": row.get("replica"),
        "arrival_ns": a0,
        "e2e_ms": e2e_ms,
        "parts_ms": sum(p["ms"] for p in out_parts),
        "ttft_ms": row.get("ttft_ms"),
        "queue_ms": row.get("queue_ms"),
        "text_holdback_ms": row.get("text_holdback_ms"),
        "finish_reason": row.get("finish_reason"),
        "error_type": row.get("error_type"),
        "input_tokens": row.get("input_tokens"),
        "output_tokens": row.get("output_tokens"),
        "cached_tokens": row.get("cached_tokens"),
        "preemptions": row.get("preemptions"),
        "phases": phases,
        "parts": out_parts,
        "waited_behind": _waited_behind(out_parts),
        "cache": _cache(con, row, names),
        "notes": notes,
    }


def _kv_transfer(events: list[dict]) -> tuple[int, int, int] | None:
    """(transfer start, transfer end, adoption) of a disaggregated request, else None."""
    ev = next((e for e in events if e["name"] == "kv_transfer"), None)
    if ev is None:
        return None
    adopt = ev["time_ns"]
    end = adopt - round(float(ev["attrs"].get("waited_ms") or 0.0) * 1e6)
    return end - round(float(ev["attrs"].get("ms") or 0.0) * 1e6), end, adopt


def _mark_transfer(pieces: list[Piece], moved: tuple[int, int, int]) -> None:
    """Before the decode core adopted it: the hand-off, the transfer, the wait for room."""
    x0, x1, adopt = moved
    for p in pieces:
        if p.end <= adopt:
            p.kind = "handoff" if p.end <= x0 else "kv_transfer" if p.end <= x1 else "decode_queue"
            p.reason, p.behind, p.tokens, p.extra, p.steps = None, [], 0, {}, []


def _request_facts(con, parts: list[Piece], row: dict) -> dict[str, dict]:
    """Tenant and size of every request the parts name (one query)."""
    ids = {e["request_id"] for p in parts for e in p.behind}
    ids |= {e["request_id"] for p in parts for e in p.extra.get("shared_with", [])}
    ids |= {p.extra["by"] for p in parts if p.extra.get("by")}
    ids.discard(None)
    if not ids:
        return {}
    where, params = _source(row.get("source"))
    rows = con.execute(
        "SELECT request_id, tenant, input_tokens, output_tokens FROM requests "
        f"WHERE list_contains($ids, request_id){where}",
        {"ids": sorted(ids), **params},
    ).fetchall()
    return {r[0]: {"tenant": r[1], "input_tokens": r[2], "output_tokens": r[3]} for r in rows}


def _named(entries: list[dict], names: dict, by_size: bool = False) -> list[dict]:
    rows = [{**e, "tenant": (names.get(e["request_id"]) or {}).get("tenant")} for e in entries]
    if by_size:  # the running set: the requests holding most KV first

        def size(e):
            f = names.get(e["request_id"]) or {}
            return -((f.get("input_tokens") or 0) + (f.get("output_tokens") or 0))

        rows.sort(key=size)
    return rows[:MAX_NAMED]


def _who(e: dict | None) -> str:
    if not e:
        return "?"
    tenant = f" (tenant {e['tenant']})" if e.get("tenant") else ""
    return f"{e['request_id']}{tenant}"


def _ahead(con, row: dict, at_ns: int) -> dict:
    """Requests queued before this one on its replica and not yet admitted at ``at_ns``."""
    q = row.get("queued_ns")
    if q is None:
        return {"count": 0, "requests": []}
    where, params = _source(row.get("source"))
    rows = con.execute(
        "SELECT request_id, tenant FROM requests WHERE queued_ns < $q AND queued_ns IS NOT NULL "
        "AND (scheduled_ns IS NULL OR scheduled_ns > $t) AND end_ns > $t "
        f"AND replica IS NOT DISTINCT FROM $r AND request_id <> $id{where} ORDER BY queued_ns",
        {"q": q, "t": at_ns, "r": row.get("replica"), "id": row["request_id"], **params},
    ).fetchall()
    named = [{"request_id": r[0], "tenant": r[1]} for r in rows[:MAX_NAMED]]
    return {"count": len(rows), "requests": named}


def _part_json(con, p: Piece, a0: int, e2e_ms: float, names: dict, row: dict) -> dict:
    ms = (p.end - p.start) * _MS
    d: dict[str, Any] = {
        "phase": p.phase,
        "kind": p.kind,
        "start_ms": (p.start - a0) * _MS,
        "ms": ms,
        "share": ms / e2e_ms if e2e_ms > 0 else 0.0,
    }
    if p.reason is not None:
        d["reason"] = p.reason
    if p.steps:
        d["steps"] = len(p.steps)
        d["step_ids"] = [p.steps[0], p.steps[-1]]
    if p.tokens:
        d["tokens"] = p.tokens
    running_set = p.reason in ("kv_blocks", "max_num_seqs")
    if p.behind:
        d["behind"] = _named(p.behind, names, by_size=running_set)
        d["behind_count"] = len(p.behind)
    if "shared_with" in p.extra:
        d["shared_with"] = _named(p.extra["shared_with"], names)
        d["shared_count"] = len(p.extra["shared_with"])
    if p.kind == "preempted":
        d["by"] = p.extra.get("by")
        d["by_tenant"] = (names.get(p.extra.get("by")) or {}).get("tenant")
        d["recompute_tokens"] = p.extra.get("recompute_tokens")
    if p.kind == "decode":
        batches = p.extra.get("batches") or [0]
        d["batch"] = {
            "min": min(batches),
            "median": statistics.median(batches),
            "max": max(batches),
        }
        d["step_ms"] = ms / max(1, len(p.steps))
    if p.kind == "stall" and "median_step_ms" in p.extra:
        d["median_step_ms"] = p.extra["median_step_ms"]
    if p.phase == "queue" and p.reason in ("budget", "kv_blocks", "max_num_seqs"):
        d["ahead"] = _ahead(con, row, p.start)
    d["text"] = _part_text(d)
    return d


def _part_text(d: dict) -> str:
    kind, reason = d["kind"], d.get("reason")
    steps = f" in {d['steps']} steps" if d.get("steps", 0) > 1 else ""
    top = (d.get("behind") or [None])[0]
    if kind in ("gateway", "tokenize", "admission"):
        return f"API {kind} station"
    if kind == "to_engine":
        return "to the engine core (the request's hop to its queue)"
    if kind == "queue":
        text = f"queued: {QUEUE_TEXT.get(reason, reason)}"
        if top and reason in ("running_step", "budget"):
            what = "prefill" if top["prefill"] else "decode"
            text += f"; behind {_who(top)}: {top['tokens']} {what} tokens{steps}"
        elif top and reason in ("kv_blocks", "max_num_seqs"):
            text += (
                f"; {_running_set(d['behind_count'], d.get('steps', 0))}, the largest {_who(top)}"
            )
        else:
            text += steps
        ahead = d.get("ahead") or {}
        if ahead.get("count"):
            text += f"; {ahead['count']} ahead in the queue, first {_who(ahead['requests'][0])}"
        return text
    if kind == "prefill_chunk":
        shared = d.get("shared_with") or []
        with_ = f", shared with {d['shared_count']}: {_who(shared[0])}" if shared else " alone"
        return f"prefill chunk of {_n(d.get('tokens', 0), 'token')}{with_}"
    if kind == "prefill_wait":
        return f"prefill waited: a step without it; behind {_who(top)}{steps}"
    if kind == "preempted":
        by = d.get("by")
        whose = f"{by}{' (tenant ' + d['by_tenant'] + ')' if d.get('by_tenant') else ''}"
        cause = (
            f"for {whose}'s allocation"
            if by
            else "(no preemptor recorded: an operator's drill, or a store from before it was)"
        )
        out_for = f" for {d['steps']} steps" if d.get("steps", 0) > 1 else ""
        return f"preempted {cause}; out of the batch{out_for}"
    if kind == "recompute":
        return f"recomputed {_n(d.get('tokens', 0), 'token')} after its preemption{steps}"
    if kind == "decode":
        b = d["batch"]
        size = f"{b['min']}" if b["min"] == b["max"] else f"{b['min']}-{b['max']}"
        n = d.get("steps", 0)
        if not n:
            return "the rest of the step that sampled its first token"
        return f"decode: {_n(n, 'step')} at batch {size}, {d['step_ms']:.1f} ms a step"
    if kind == "stall":
        if reason == "prefill_in_step":
            return f"decode stall: the step carried {_who(top)}'s {top['tokens']}-token prefill"
        if reason == "not_scheduled":
            kind_of = "prefill" if top and top["prefill"] else "decode"
            what = f": {top['tokens']:,} {kind_of} tokens" if top else ""
            return (
                f"decode stall: {_n(d.get('steps', 1), 'step')} ran without it (the budget went "
                f"to requests ranked ahead); behind {_who(top)}{what}"
            )
        return f"decode stall: a slow step ({d.get('median_step_ms', 0):.1f} ms is its median)"
    return {
        "handoff": "hand-off: the prefill core sends its KV",
        "kv_transfer": "KV transfer from the prefill core to the decode core",
        "decode_queue": "the decode side's queue: its KV waited for room",
        "output_send": "the last step's end and the hop to the API process",
        "stream_write": "the answer written to the client (socket writes, a slow reader)",
        "metering": "metering",
        "unknown": f"{d['phase']}: the step rows do not say what ran",
    }.get(kind, kind)


def _running_set(count: int, steps: int) -> str:
    """The running batch a queued request waited on: over several steps its members change one
    by one, so ``count`` is every request that had a place in it, not those running at once."""
    if steps > 1:
        return f"{_n(count, 'request')} ran in it over those {steps} steps"
    return f"{count} running"


def _n(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _waited_behind(parts: list[dict]) -> list[dict]:
    """The requests this one waited behind, with the ms of the parts each was first in."""
    acc: dict[str, dict] = {}
    for p in parts:
        if p["kind"] == "preempted" and p.get("by"):
            who = {"request_id": p["by"], "tenant": p.get("by_tenant")}
        elif p.get("behind") and p["kind"] in ("queue", "prefill_wait", "stall"):
            who = p["behind"][0]
        else:
            continue
        cur = acc.setdefault(
            who["request_id"],
            {
                "request_id": who["request_id"],
                "tenant": who.get("tenant"),
                "ms": 0.0,
                "reasons": [],
            },
        )
        cur["ms"] += p["ms"]
        reason = p.get("reason") or p["kind"]
        if reason not in cur["reasons"]:
            cur["reasons"].append(reason)
    return sorted(acc.values(), key=lambda e: -e["ms"])


def _block_size(con) -> int:
    from .signals import engine_block_size

    return engine_block_size(con)


def _cache(con, row: dict, names: dict) -> dict | None:
    raw = row.get("cache_misses")
    if raw is None:
        return None
    misses = json.loads(raw)
    bs = _block_size(con)
    a0 = int(row["arrival_ns"])
    by_ids = sorted({m["by"] for m in misses if m.get("by")} - set(names))
    if by_ids:
        for r in con.execute(
            "SELECT request_id, tenant FROM requests WHERE list_contains($ids, request_id)",
            {"ids": by_ids},
        ).fetchall():
            names[r[0]] = {"tenant": r[1]}
    out = []
    for m in misses:
        e = {
            "reason": m["reason"],
            "first_block": m["first_block"],
            "num_blocks": m.get("num_blocks", 1),
        }
        if m.get("time_ns") is not None:
            e["time_ns"] = m["time_ns"]
            e["time_ms"] = (m["time_ns"] - a0) * _MS
        if m.get("by"):
            e["by"] = m["by"]
            e["by_tenant"] = (names.get(m["by"]) or {}).get("tenant")
        if m.get("tenant") is not None:
            e["tenant"] = m["tenant"]
        e["text"] = _miss_text(e)
        out.append(e)
    prompt = row.get("input_tokens") or 0
    return {
        "block_size": bs,
        "prompt_blocks": -(-prompt // bs),
        "cached_blocks": (row.get("cached_tokens") or 0) // bs,
        "misses": out,
    }


def _miss_text(e: dict) -> str:
    first, n = e["first_block"], e["num_blocks"]
    blocks = f"block {first}" if n == 1 else f"blocks {first}-{first + n - 1}"
    text = f"{blocks}: {MISS_TEXT.get(e['reason'], e['reason'])}"
    if e["reason"] == "evicted":
        when = f" {-e['time_ms'] / 1e3:.1f} s before it arrived" if "time_ms" in e else ""
        by = f" by {_who({'request_id': e['by'], 'tenant': e.get('by_tenant')})}'s allocation"
        text += f"{when}{by if e.get('by') else ' (a cache reset)'}"
    if e["reason"] == "other_tenant":
        text += f" ({e.get('tenant') or 'the default tenant'})"
    return text


def to_json(ex: dict) -> str:
    """The explanation as JSON (the module's contract)."""
    return json.dumps(ex, indent=2, default=str)


def to_text(ex: dict) -> str:
    """The explanation as plain text: the headline, one line per part, the cache's misses."""
    lines = []
    who = f"{ex['request_id']}" + (f" (tenant {ex['tenant']})" if ex.get("tenant") else "")
    lines.append(
        f"Request {who}: E2E {ex['e2e_ms']:,.1f} ms = {len(ex['parts'])} parts adding up to "
        f"{ex['parts_ms']:,.1f} ms"
    )
    if ex.get("ttft_ms") is not None:
        lines.append(
            f"TTFT {ex['ttft_ms']:,.1f} ms; "
            + ", ".join(f"{ph} {ms:,.1f} ms" for ph, ms in ex["phases"].items() if ms > 0)
        )
    if ex["waited_behind"]:
        top = ex["waited_behind"][0]
        lines.append(
            f"Waited behind most: {_who(top)} for {top['ms']:,.1f} ms ({', '.join(top['reasons'])})"
        )
    lines.append("")
    lines.append(f"{'start ms':>10} {'ms':>10} {'share':>6}  {'phase':<8} part")
    for p in ex["parts"]:
        lines.append(
            f"{p['start_ms']:>10,.1f} {p['ms']:>10,.1f} {p['share']:>6.1%}  {p['phase']:<8} "
            f"{p['text']}"
        )
    if ex.get("text_holdback_ms"):
        lines.append(
            f"\nStream holdback: the first token's text was held back "
            f"{ex['text_holdback_ms']:,.1f} ms (a possible stop string or a partial character)."
        )
    cache = ex.get("cache")
    if cache:
        lines.append(
            f"\nPrefix cache: {cache['prompt_blocks']} prompt blocks of {cache['block_size']} "
            f"tokens, {cache['cached_blocks']} served from the cache; computed:"
        )
        lines += [f"  {m['text']}" for m in cache["misses"]]
    for note in ex.get("notes") or []:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
