"""The scope every signal family computes in (:class:`Scope`: the store, the time range and its
windows, the columns the store has, the engine's ``config`` event, the warm-up set apart) and
the SQL helpers the families share."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import duckdb

from tokenmill.telemetry.recorded_config import RecordedConfig
from tokenmill.telemetry.schema import TABLES as STORE_TABLES

from .window import NoTraffic

NS = 1_000_000_000

# the tables signals read
TABLES = tuple(t for t in STORE_TABLES if t != "spans")


@dataclass(frozen=True)
class Scope:
    """Everything a family computes over: the store, the time range and its windows, the
    columns the store has, the engine's ``config`` event and the warm-up set apart."""

    con: duckdb.DuckDBPyConnection
    since: int
    until: int
    window_s: float
    # lower-case column names of each table the store has (an absent table: empty)
    columns: Mapping[str, frozenset[str]]
    config: RecordedConfig = field(default_factory=RecordedConfig)
    # the warm-up intervals [start_ns, end_ns) set apart from the per-window signals, and SQL
    # conditions: a request's arrival / a step's start outside them
    warmup: tuple[tuple[int, int], ...] = ()
    not_warm_req: str = "TRUE"
    not_warm_step: str = "TRUE"
    # prompts up to this many tokens are "short"; a TTFT up to fast_ttft_ms (twice the range's
    # median) is "fast"
    short_prompt_tokens: int = 0
    fast_ttft_ms: float = 0.0
    # SQL for the sequences an engine_steps row decoded (draft tokens are not sequences)
    decode_seqs_sql: str = "num_decode_tokens"
    # the live loop's reference windows before the range, merged into [start_ns, end_ns) spans
    reference_spans: tuple[tuple[int, int], ...] = ()

    @property
    def w_ns(self) -> int:
        return int(self.window_s * NS)

    @property
    def n_windows(self) -> int:
        return max(1, math.ceil((self.until - self.since) / self.w_ns))

    @property
    def params(self) -> dict:
        """The named parameters every windowed query takes (``$t0``, ``$w``, ``$since``,
        ``$until``)."""
        return {"t0": self.since, "w": self.w_ns, "since": self.since, "until": self.until}

    def has(self, table: str, *cols: str) -> bool:
        """Whether the store's ``table`` has every one of ``cols``."""
        have = self.columns.get(table, frozenset())
        return all(c.lower() in have for c in cols)

    def has_rows(self, table: str) -> bool:
        """Whether the store's ``table`` exists and holds a row (anywhere, not only in range)."""
        if not self.columns.get(table):
            return False
        (found,) = self.con.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()
        return bool(found)

    def by_window(self, sql: str, column: str, outside_warmup: str | None, **params) -> dict:
        """Run a windowed query (``win`` first, then one column per key; one ``WHERE <column>
        >= $since`` filter, where ``outside_warmup`` is added when given): ``{win: {key:
        value}}``."""
        if outside_warmup is not None:
            sql = set_apart(sql, column, outside_warmup)
        return rows(self.con, sql, {**self.params, **params})

    def over_range(self, sql: str, column: str, **params) -> dict:
        """The same query over the whole range as one window, warm-up included: ``{key:
        value}`` (empty when no row matched)."""
        whole = sql.replace(f"({column} - $t0) // $w", "0")
        return rows(self.con, whole, {**self.params, **params}).get(0, {})


_COLUMNS_SQL = """
SELECT table_name, list(lower(column_name)) FROM information_schema.columns
WHERE table_name IN ? GROUP BY table_name
"""


# the columns read once per connection inside :func:`columns_read_once` (the live loop's run)
_COLUMNS_SEEN: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "store_columns_seen", default=None
)


@contextlib.contextmanager
def columns_read_once() -> Iterator[None]:
    """Within the block, :func:`store_columns` reads each connection's catalog once: a run of
    the live loop asks about ten times (the families, the rules' optional columns), and the
    store's schema does not change under one run."""
    token = _COLUMNS_SEEN.set({})
    try:
        yield
    finally:
        _COLUMNS_SEEN.reset(token)


def store_columns(con) -> dict[str, frozenset[str]]:
    """Lower-case column names of each table signals read (an absent table: empty), in one
    catalog query (once per connection inside :func:`columns_read_once`)."""
    seen = _COLUMNS_SEEN.get()
    if seen is not None and id(con) in seen:
        return seen[id(con)][1]
    found = dict(con.execute(_COLUMNS_SQL, [list(TABLES)]).fetchall())
    cols = {t: frozenset(found.get(t) or ()) for t in TABLES}
    if seen is not None:
        seen[id(con)] = (con, cols)  # the connection held: its id is not reused in the block
    return cols


def store_has(con, table: str, *names: str) -> bool:
    """Whether the store's ``table`` has every one of the columns ``names``."""
    return set(names) <= store_columns(con).get(table, frozenset())


def span(con, cols: Mapping[str, frozenset[str]], since_ns, until_ns) -> tuple[int, int]:
    """The range ``[since, until)``: ``since_ns``/``until_ns``, or the first arrival or step
    start and just after the last request or step end (or waiting sample).

    Raises:
        NoTraffic: the store holds no requests and no engine steps.
    """
    parts = ["SELECT min(arrival_ns) t0, max(end_ns) t1 FROM requests"]
    if {"start_ns", "end_ns"} <= cols.get("engine_steps", frozenset()):
        parts.append("SELECT min(start_ns), max(end_ns) FROM engine_steps")
    if {"time_ns", "arrival_ns"} <= cols.get("waiting_samples", frozenset()):
        # a live store's queue: requests that arrived and still wait (a sample of them is the
        # latest row while a long step runs and nothing else ends)
        parts.append("SELECT min(arrival_ns), max(time_ns) FROM waiting_samples")
    lo, hi = con.execute(f"SELECT min(t0), max(t1) FROM ({' UNION ALL '.join(parts)})").fetchone()
    if lo is None:
        raise NoTraffic("the store holds no requests and no engine steps")
    return (since_ns if since_ns is not None else lo), (
        until_ns if until_ns is not None else hi + 1
    )


def rows(con, sql: str, params: dict) -> dict[int, dict]:
    """``{first column: {other columns}}`` of ``sql`` (only the ``params`` it names)."""
    cur = con.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})
    cols = [d[0] for d in cur.description]
    return {int(r[0]): dict(zip(cols[1:], r[1:], strict=True)) for r in cur.fetchall()}


def in_intervals(column: str, intervals) -> str:
    """SQL: ``column`` lies in one of ``intervals`` (``[start_ns, end_ns)``; FALSE for none)."""
    parts = [f"({column} >= {int(a)} AND {column} < {int(b)})" for a, b in intervals]
    return " OR ".join(parts) or "FALSE"


def set_apart(sql: str, column: str, cond: str) -> str:
    """``sql`` with ``cond`` added to its one ``WHERE <column> >= $since`` filter."""
    marker = f"WHERE {column} >= $since"
    if sql.count(marker) != 1:
        raise ValueError(f"warm-up filter: expected one {marker!r} in the query")
    return sql.replace(marker, f"WHERE {cond} AND {marker.removeprefix('WHERE ')}")


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (None and NaN left out; linear interpolation)."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    pos = (len(vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
