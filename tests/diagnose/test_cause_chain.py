"""Cause before consequence: which prefill was a preempted request's recompute, stalls that
come with the traffic's arrivals rather than a periodic job's, and the host's own record of a
job that comes and goes (bursts of outside CPU, our own client processes starting)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import duckdb

from tokenmill.diagnose.rules.periodic_itl_spikes import arrival_locked
from tokenmill.diagnose.signals import recompute_steps
from tokenmill.diagnose.signals.host_bursts import (
    burst_slowdown,
    host_bursts,
    loadgen_starts,
    near_any,
)

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


def _host_store(samples, steps=(), busy=()):
    """Host samples ``(t_s, others_pct, loadgen_pct)``, decode-only steps ``(start_s, ms,
    running)`` and census lists ``(t_s, pid, load_generator)``."""
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE device_samples (time_ns BIGINT, kind VARCHAR, cpu_others_pct DOUBLE, "
        "loadgen_cpu_pct DOUBLE, busy_others VARCHAR)"
    )
    for t, v, lg in samples:
        con.execute(
            "INSERT INTO device_samples VALUES (?, 'host', ?, ?, NULL)", [int(t * S), v, lg]
        )
    for t, pid, lg in busy:
        text = json.dumps([{"pid": pid, "command": "x", "cpu_pct": 30.0, "load_generator": lg}])
        con.execute("INSERT INTO device_samples VALUES (?, 'host', 0, 0, ?)", [int(t * S), text])
    con.execute(
        "CREATE TABLE engine_steps (start_ns BIGINT, end_ns BIGINT, num_prefill_tokens INTEGER, "
        "num_decode_tokens INTEGER, num_running INTEGER)"
    )
    for start, ms, running in steps:
        con.execute(
            "INSERT INTO engine_steps VALUES (?, ?, 0, ?, ?)",
            [int(start * S), int(start * S + ms * MS), running, running],
        )
    return con


def _host_sig(con, until_s=60):
    return SimpleNamespace(con=con, since_ns=0, until_ns=until_s * S, device_kind="host")


def test_bursts_of_outside_cpu_less_the_load_generator():
    # 10 Hz samples: a job at 70% for 0.5 s every 5 s, and the load generator's own 60% at 2 s
    samples = []
    for k in range(300):
        t = k / 10
        job = 70.0 if (t % 5) < 0.5 and t >= 5 else 1.0
        lg = 60.0 if 2.0 <= t < 2.6 else 0.0
        samples.append((t, job + lg, lg))
    bursts = host_bursts(_host_sig(_host_store(samples)), 20, 0.2, 0.3)
    assert [round(b.start_ns / S, 1) for b in bursts] == [5.0, 10.0, 15.0, 20.0, 25.0]
    assert all(0.35 <= b.seconds <= 0.45 and b.mean_pct == 70.0 for b in bursts)
    # a one-sample blip is no burst; nor is anything on a GPU store
    blip = _host_sig(_host_store([(1.0, 90.0, 0.0), (1.1, 0.0, 0.0)]))
    assert host_bursts(blip, 20, 0.2, 0.3) == []
    gpu = _host_sig(_host_store(samples))
    gpu.device_kind = "gpu"
    assert host_bursts(gpu, 20, 0.2, 0.3) == []


def test_the_steps_a_burst_overlaps_against_the_same_batch_outside():
    # 30 ms steps at batch 2 every 0.1 s, but three at 90 ms during the burst
    steps = [(t / 10, 30.0, 2) for t in range(0, 100) if not 50 <= t <= 53]
    steps += [(5.0 + k / 10, 90.0, 2) for k in range(3)]
    samples = [(k / 10, 80.0 if 5.0 <= k / 10 <= 5.3 else 0.0, 0.0) for k in range(100)]
    con = _host_store(samples, steps)
    sig = _host_sig(con)
    bursts = host_bursts(sig, 20, 0.2, 0.3)
    slow = burst_slowdown(sig, bursts, 5)
    assert len(bursts) == 1 and slow is not None
    assert slow.steps_inside == 3 and slow.ratio == 3.0 and slow.outside_ms == 30.0


def test_a_client_process_starting_is_named_by_the_census():
    con = _host_store(
        [], busy=[(1.0, 10, False), (3.0, 11, True), (4.0, 11, True), (9.0, 12, True)]
    )
    sig = _host_sig(con)
    starts = loadgen_starts(sig)
    assert [t / S for t in starts] == [3.0, 9.0]
    assert near_any(starts, int(2.5 * S), int(3.5 * S))
    assert not near_any(starts, int(4.0 * S), int(8.0 * S))
