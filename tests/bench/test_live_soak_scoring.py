"""The live soak's scoring (``benchmarks/live_soak.py``): delays count from the fault's first act,
read from the store, and the delay from the episode's start is kept beside it."""

import importlib.util
import sys
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000_000


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("live_soak", ROOT / "benchmarks" / "live_soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["live_soak"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("live_soak", None)


def _store(path: Path, rows: list[tuple], steps: list[tuple] = ()) -> Path:
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE requests (arrival_ns BIGINT, input_tokens INT, tenant VARCHAR, "
        "http_status INT, end_ns BIGINT)"
    )
    con.executemany("INSERT INTO requests VALUES (?, ?, ?, ?, ?)", rows)
    con.execute("CREATE TABLE engine_steps (start_ns BIGINT, num_preempted INT)")
    con.executemany("INSERT INTO engine_steps VALUES (?, ?)", steps)
    con.close()
    return path


def test_delay_counts_from_the_first_long_prompt_and_the_first_refusal(soak, tmp_path):
    t0 = 1000 * S
    long_ep = soak.Episode("long_prompts", "steady", t0, t0 + 90 * S, ("ttft_prefill_bound",))
    tenant_ep = soak.Episode(
        "tenant_limit", "tenants", t0 + 200 * S, t0 + 290 * S, ("error_spike",)
    )
    frozen_ep = soak.Episode("frozen", "clumped", t0 + 400 * S, t0 + 460 * S, ("engine_stalled",))
    kv_ep = soak.Episode("kv_pressure", "procs", t0 + 600 * S, t0 + 690 * S, ("ttft_queueing",))
    db = _store(
        tmp_path / "soak.duckdb",
        [
            (t0 + 2 * S, 90, "t0", 200, t0 + 3 * S),  # chat before the first long prompt
            (t0 + 10 * S, 730, "t3", 200, t0 + 12 * S),  # the first long prompt, 10 s in
            (t0 + 18 * S, 730, "t3", 200, t0 + 20 * S),
            (t0 + 88 * S, 90, "t0", 200, t0 + 97 * S),  # queued behind the last long prompt
            (t0 + 205 * S, 80, soak.BURST_TENANT, 200, t0 + 206 * S),  # let in
            (t0 + 219 * S, 80, soak.BURST_TENANT, 429, t0 + 219 * S),  # first refusal, 19 s in
            (t0 + 219 * S, 80, "t1", 429, t0 + 219 * S),  # another tenant's is not the fault
            (t0 + 230 * S, 80, soak.BURST_TENANT, 429, t0 + 230 * S),
        ],
        steps=[
            (t0 + 300 * S, 1),  # a preemption before the episode is not its first act
            (t0 + 610 * S, 0),
            (t0 + 623 * S, 2),  # the pool full 23 s in: the first preemption
            (t0 + 640 * S, 1),
        ],
    )
    episodes = [long_ep, tenant_ep, frozen_ep, kv_ep]
    soak.mark_first_acts(db, episodes)
    assert long_ep.fault_ns == t0 + 10 * S
    assert tenant_ep.fault_ns == t0 + 219 * S
    assert frozen_ep.fault_ns == 0 and frozen_ep.acts_ns == frozen_ep.start_ns
    assert kv_ep.fault_ns == t0 + 623 * S
    findings = [
        {"id": "a", "rule": "ttft_prefill_bound", "opened_ns": t0 + 21 * S, "resolved_ns": None},
        {"id": "b", "rule": "error_spike", "opened_ns": t0 + 233 * S, "resolved_ns": None},
        {"id": "c", "rule": "engine_stalled", "opened_ns": t0 + 418 * S, "resolved_ns": None},
    ]
    r = soak.score(episodes, findings, [])
    by_kind = {e["kind"]: e for e in r["episodes"]}
    assert by_kind["long_prompts"]["delay_periods"] == 1.1
    assert by_kind["long_prompts"]["delay_from_start_periods"] == 2.1
    assert by_kind["tenant_limit"]["delay_periods"] == 1.4
    assert by_kind["tenant_limit"]["delay_from_start_periods"] == 3.3
    assert (
        by_kind["frozen"]["delay_periods"] == by_kind["frozen"]["delay_from_start_periods"] == 1.8
    )
    assert r["delay_worst_periods"] == 1.8 and r["delay_from_start_worst_periods"] == 3.3
    # the queue a fault built drains after it: the last request that arrived during it
    assert by_kind["long_prompts"]["queue_drained_s"] == 7.0
    assert by_kind["tenant_limit"]["queue_drained_s"] == -60.0
    assert by_kind["frozen"]["queue_drained_s"] is None  # no request arrived in it
