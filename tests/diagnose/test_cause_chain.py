"""Cause before consequence: which prefill was a preempted request's recompute, and stalls that
come with the traffic's arrivals rather than a periodic job's."""

from __future__ import annotations

from types import SimpleNamespace

import duckdb

from tokenmill.diagnose.rules.periodic_itl_spikes import arrival_locked
from tokenmill.diagnose.signals import recompute_steps

MS = 1_000_000
S = 1_000_000_000


def _store() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE engine_steps (start_ns BIGINT, end_ns BIGINT, num_prefill_tokens INTEGER, "
        "req_ids VARCHAR[], req_tokens INTEGER[], req_prefill BOOLEAN[])"
    )
    con.execute(
        "CREATE TABLE requests (request_id VARCHAR, arrival_ns BIGINT, scheduled_ns BIGINT, "
        "first_token_ns BIGINT)"
    )
    return con


def _sig(con, since=0, until=10**15):
    return SimpleNamespace(con=con, since_ns=since, until_ns=until)


def test_a_prefill_after_the_first_token_is_a_recompute():
    con = _store()
    con.execute(
        "INSERT INTO requests VALUES ('a', 0, 10, 100), ('b', 150, 190, NULL), ('c', 0, 5, 20)"
    )
    con.execute(
        "INSERT INTO engine_steps VALUES "
        # a's first pass: before its first token, not a recompute
        "(50, 90, 40, ['a', 'c'], [40, 1], [true, false]), "
        # a again after its first token (preempted, resumed), b's first pass, c decoding
        "(200, 900, 80, ['a', 'b', 'c'], [50, 30, 1], [true, true, false]), "
        # nothing but first passes
        "(1000, 1100, 30, ['b'], [30], [true])"
    )
    steps = recompute_steps(_sig(con))
    assert [(r.start_ns, r.recomputed_tokens, r.fresh_tokens, r.request_ids) for r in steps] == [
        (200, 50, 30, ("a",))
    ]
    assert steps[0].mostly_recompute and steps[0].ms == 700 / 1e6


def test_a_store_without_the_step_request_lists_has_no_recompute():
    con = duckdb.connect()
    con.execute("CREATE TABLE engine_steps (start_ns BIGINT, end_ns BIGINT)")
    con.execute("CREATE TABLE requests (request_id VARCHAR, first_token_ns BIGINT)")
    assert recompute_steps(_sig(con)) == []


def _spikes(starts_s: list[float], ms: float = 400) -> list[tuple]:
    return [(int(t * S), ms, 2, int(t * S + ms * MS)) for t in starts_s]


def test_stalls_that_come_with_arrivals_are_locked_to_them():
    con = _store()
    # a clump of arrivals every 7 s, the stalls 0.2 s after each
    arrivals = [k * 7.0 + d for k in range(6) for d in (0.0, 0.05, 0.1)]
    con.executemany(
        "INSERT INTO requests VALUES (?, ?, NULL, NULL)",
        [(f"r{i}", int(t * S)) for i, t in enumerate(arrivals)],
    )
    locked, chance = arrival_locked(_sig(con), _spikes([k * 7.0 + 0.2 for k in range(6)]), 0.5)
    assert locked == 1.0
    assert chance < 0.3


def test_a_job_off_the_arrivals_meets_them_only_by_chance():
    con = _store()
    arrivals = [k * 7.0 for k in range(6)]
    con.executemany(
        "INSERT INTO requests VALUES (?, ?, NULL, NULL)",
        [(f"r{i}", int(t * S)) for i, t in enumerate(arrivals)],
    )
    # a job every 5 s: its stalls fall anywhere against arrivals every 7 s
    locked, chance = arrival_locked(_sig(con), _spikes([1.0 + k * 5.0 for k in range(8)]), 0.5)
    assert locked <= 0.25
    assert locked - chance < 0.3
