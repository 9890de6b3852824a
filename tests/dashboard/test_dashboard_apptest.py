"""The console's pages under Streamlit's AppTest, on synthetic stores written through the real
store writer: the numbers shown equal the store's own SQL, filters and the shared time window
change them as they should, and every page renders an empty store without an exception."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from datetime import timedelta
from pathlib import Path

import duckdb
import pytest
from server_proc import free_port
from streamlit.testing.v1 import AppTest
from synth_store import Phase, write_store

from tokenmill.dashboard import data
from tokenmill.dashboard.source import OVERLAP_S, SourceError, StoreHandle
from tokenmill.telemetry.dump import write_dump
from tokenmill.telemetry.schema import apply_schema

APP = Path(data.__file__).parent / "app.py"
PAGES = (
    "overview", "requests", "engine", "devices", "errors", "diagnosis", "now", "compare", "whatif"
)  # fmt: skip
OK = "finish_reason IN ('stop', 'length') AND error_type IS NULL"
HEALTHY = Phase(duration_s=40, gpu=True, error_share=0.1, preempt_share=0.2)


def _root_and_stations(rows) -> bool:
    """The waterfall's rows are the eight stations and one root, named as the GenAI conventions
    name it (``chat {model}`` / ``text_completion {model}``)."""
    (root,) = set(rows) - set(data.STATIONS)
    return set(data.STATIONS) <= set(rows) and root.startswith(("chat ", "text_completion "))


@pytest.fixture(scope="module")
def gpu_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dash") / "gpu.duckdb"
    queued = HEALTHY.but(
        duration_s=30, queue_ms=2000, throttle_reasons=("sw_power_cap",), sm_clock_mhz=1400
    )
    # a clean stretch first: the diagnoser judges ratio rules (ttft_queueing) only against a
    # healthy window, one without preemptions or errors
    write_store(path, [Phase(duration_s=10, gpu=True), HEALTHY.but(duration_s=30), queued], seed=5)
    return path


@pytest.fixture(scope="module")
def host_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dash") / "host.duckdb"
    write_store(path, [Phase(duration_s=15)], seed=6)
    return path


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dash") / "empty.duckdb"
    with duckdb.connect(str(path)) as con:
        apply_schema(con)
    return path


def sql(store: Path, query: str, params=None):
    with duckdb.connect(str(store), read_only=True) as con:
        return con.execute(query, params or []).fetchone()


def bounds(store: Path) -> tuple[int, int]:
    with duckdb.connect(str(store), read_only=True) as con:
        return data.time_range(con)


def open_page(monkeypatch, store: Path | str, page: str = "overview") -> AppTest:
    monkeypatch.setenv("TOKENMILL_DASHBOARD_SOURCE", str(store))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    if page != "overview":
        at.switch_page(f"views/{page}.py")
        at.run()
    assert not at.exception, at.exception
    return at


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, f"no tile {label!r}; tiles: {[m.label for m in at.metric]}"
    return found[0]


def num(text: str) -> float:
    return float(re.sub(r"[^0-9.\-]", "", text.split()[0]))


def assert_ms(text: str, expected: float) -> None:
    """A latency tile ("123.4 ms" or "12.35 s") shows ``expected`` ms to its last digit."""
    value, unit = text.split()
    got = float(value.replace(",", "")) * (1000 if unit == "s" else 1)
    assert unit in ("ms", "s") and got == pytest.approx(expected, abs=5 if unit == "s" else 0.05)


def charts(at: AppTest) -> list[dict]:
    """The plotly figures on the page, as their JSON specs."""
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def chart_with(at: AppTest, trace_name: str) -> dict:
    """The page's one plotly figure holding a trace named ``trace_name``."""
    found = [f for f in charts(at) if any(t.get("name") == trace_name for t in f["data"])]
    assert len(found) == 1, f"{len(found)} charts with a trace {trace_name!r}"
    return found[0]


def _values(v) -> list:
    """A plotly trace's x or y as a list (decoding plotly's typed-array encoding)."""
    if isinstance(v, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v)


def test_overview_tiles_equal_the_store(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store)
    lo, hi = bounds(gpu_store)
    ttft50, ttft99, itl50, itl99 = sql(
        gpu_store,
        f"SELECT quantile_cont(ttft_ms, 0.5), quantile_cont(ttft_ms, 0.99), "
        f"quantile_cont(itl_p50_ms, 0.5), quantile_cont(itl_p99_ms, 0.99) FROM requests WHERE {OK}",
    )
    assert_ms(metric(at, "TTFT p99"), ttft99)
    assert_ms(metric(at, "TTFT p50"), ttft50)
    assert_ms(metric(at, "ITL p50"), itl50)
    assert_ms(metric(at, "ITL p99"), itl99)
    (tokens,) = sql(gpu_store, "SELECT sum(num_sampled) FROM engine_steps")
    assert num(metric(at, "Throughput")) == pytest.approx(tokens / ((hi - lo) / 1e9), abs=0.05)
    n, errors, good = sql(
        gpu_store,
        f"SELECT count(*), count(*) FILTER (WHERE error_type IS NOT NULL), count(*) FILTER "
        f"(WHERE {OK} AND ttft_ms <= 2000 AND itl_p99_ms <= 200 AND e2e_ms <= 60000) FROM requests",
    )
    assert 0 < errors < n and 0 < good < n  # the queued phase misses the TTFT SLO
    assert num(metric(at, "Requests")) == n
    assert num(metric(at, "Error rate")) == pytest.approx(100 * errors / n, abs=0.05)
    assert num(metric(at, "Goodput")) == pytest.approx(100 * good / n, abs=0.05)
    (kv,) = sql(gpu_store, "SELECT avg(kv_blocks_used / kv_blocks_total) FROM engine_steps")
    assert num(metric(at, "KV usage")) == pytest.approx(100 * kv, abs=0.05)
    # the queueing phase is diagnosed, and the time chart has TTFT, ITL and concurrency
    assert any("ttft_queueing" in w.value for w in [*at.warning, *at.error])
    (fig,) = charts(at)
    names = {t.get("name") for t in fig["data"]}
    assert {"TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "concurrency (running)"} <= names


def test_slo_and_time_window_are_shared_by_the_pages(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store)
    at.number_input(key="tm_slo_ttft").set_value(100000.0)
    at.selectbox(key="tm_window").set_value("Last 1 min")
    at.run()
    assert not at.exception
    _, hi = bounds(gpu_store)
    since = hi - 60 * 10**9
    n, good, ttft99 = sql(
        gpu_store,
        f"SELECT count(*), count(*) FILTER (WHERE {OK} AND itl_p99_ms <= 200 AND e2e_ms <= 60000), "
        f"quantile_cont(ttft_ms, 0.99) FILTER (WHERE {OK}) FROM requests "
        "WHERE arrival_ns >= ? AND arrival_ns < ?",
        [since, hi],
    )
    assert num(metric(at, "Requests")) == n
    assert_ms(metric(at, "TTFT p99"), ttft99)
    assert num(metric(at, "Goodput")) == pytest.approx(100 * good / n, abs=0.05)
    at.switch_page("views/requests.py")
    at.run()
    assert not at.exception
    assert at.session_state["tm_since_ns"] == since
    assert any(f"{n:,} requests match" in c.value for c in at.caption)


def test_requests_table_filters_and_waterfall(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store, "requests")
    (n,) = sql(gpu_store, "SELECT count(*) FROM requests")
    assert any(f"{n:,} requests match" in c.value for c in at.caption)
    # slowest first: the selected request is the one with the largest E2E
    trace_id, e2e, ttft, n_out = sql(
        gpu_store,
        "SELECT trace_id, e2e_ms, ttft_ms, output_tokens FROM requests "
        "ORDER BY e2e_ms DESC NULLS LAST, arrival_ns LIMIT 1",
    )
    assert at.selectbox(key="rq_pick_").value == trace_id
    assert_ms(metric(at, "E2E"), e2e)
    assert_ms(metric(at, "TTFT"), ttft)
    (fig,) = charts(at)
    names = [t.get("name") for t in fig["data"]]
    assert f"tokens ({n_out})" in names and "prefill chunk" in names
    assert "KV transfer" not in names  # colocated: no transfer row
    bars = next(t for t in fig["data"] if t.get("type") == "bar")
    assert _root_and_stations(bars["y"])

    # a preempted request shows its preemption on the waterfall
    (pre_id,) = sql(gpu_store, "SELECT trace_id FROM requests WHERE preemptions > 0 LIMIT 1")
    at.text_input(key="rq_search").set_value(pre_id[:12])
    at.run()
    assert not at.exception
    assert at.selectbox(key="rq_pick_").value == pre_id
    names = [t.get("name") for t in charts(at)[0]["data"]]
    assert "preempted" in names and "resumed" in names

    at.text_input(key="rq_search").set_value("")
    at.selectbox(key="rq_status").set_value("error")
    at.run()
    (errors,) = sql(gpu_store, "SELECT count(*) FROM requests WHERE error_type IS NOT NULL")
    assert any(f"{errors:,} requests match" in c.value for c in at.caption)
    assert set(at.dataframe[0].value["status"]) == {"error"}


def test_engine_tiles_equal_the_store(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store, "engine")
    steps, pre, step_ms = sql(
        gpu_store,
        "SELECT count(*), sum(num_preempted), avg((end_ns - start_ns) / 1e6) FROM engine_steps",
    )
    assert num(metric(at, "Steps")) == steps
    assert num(metric(at, "Preemptions")) == pre
    assert_ms(metric(at, "Step time mean"), step_ms)
    fig = chart_with(at, "prefill tokens")
    names = {t.get("name") for t in fig["data"]}
    assert {"prefill tokens", "decode tokens", "forward ms", "running", "waiting"} <= names
    assert {"KV used blocks", "KV free blocks", "preemptions", "prefix-cache hit rate"} <= names
    # no step verified drafts: the speculative-decoding panel says so instead of its charts
    assert any("Speculation is off in this store" in i.value for i in at.info)
    assert not [f for f in charts(at) if any(t.get("name") == "acceptance rate" for t in f["data"])]


@pytest.fixture(scope="module")
def parallel_store(tmp_path_factory) -> Path:
    """Two data-parallel replicas of two tensor-parallel ranks: collectives 60% of a decode
    step (15% of a prefill step), replica 1 running 2 requests to replica 0's 8."""
    path = tmp_path_factory.mktemp("dash") / "parallel.duckdb"
    phase = Phase(duration_s=20, replicas=2, tp_size=2, collective_share=0.6, cool_running=2)
    write_store(path, [phase], seed=8)
    return path


def test_parallelism_panel_shows_collectives_and_replicas_side_by_side(
    monkeypatch, parallel_store, gpu_store
):
    """The Engine page's parallelism panel: the collectives' share of decode and prefill steps
    equals the steps' own sums, and each replica's running requests are its steps' mean."""
    since, until = bounds(parallel_store)
    with duckdb.connect(str(parallel_store), read_only=True) as con:
        coll = data.collective_series(con, since, until, 5.0)
        reps = data.replica_series(con, since, until, 5.0)
    (decode_share,) = sql(
        parallel_store,
        "SELECT sum(collective_ms) / sum(forward_ms) FROM engine_steps "
        "WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0",
    )
    assert decode_share == pytest.approx(0.6, rel=1e-6)
    assert coll["decode_share"].round(6).unique().tolist() == [0.6]
    assert coll["prefill_share"].round(6).unique().tolist() == [0.15]
    running = reps.groupby("replica")["running"].mean().round(6).to_dict()
    assert running == {0: 8.0, 1: 2.0}
    at = open_page(monkeypatch, parallel_store, "engine")
    fig = chart_with(at, "collectives: decode steps")
    names = {t.get("name") for t in fig["data"]}
    assert {"replica 0 running", "replica 1 running", "replica 1 waiting"} <= names
    # one engine on one rank: the panel says so instead
    at = open_page(monkeypatch, gpu_store, "engine")
    assert any("no collectives and no replicas" in i.value for i in at.info)


# prefill/decode disaggregation: the prefill core busy 30% of the time with 3 requests
# waiting, the decode core 80% with 8 running and ~57% of its KV blocks used; each request's KV
# takes ~30 ms to move and then waits ~10 ms for room
PD = Phase(
    duration_s=20, pd_busy=(0.3, 0.8), waiting=3, kv_usage=0.6, kv_transfer_ms=30, kv_wait_ms=10
)


@pytest.fixture(scope="module")
def pd_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dash") / "pd.duckdb"
    write_store(path, [PD], seed=7)
    return path


def _busy_by_hand(store: Path, since: int, until: int, bucket_s: float) -> dict:
    """``{(role, bucket): busy share}`` from the raw step rows, as pd_pool_series defines it."""
    w = int(bucket_s * 1e9)
    with duckdb.connect(str(store), read_only=True) as con:
        rows = con.execute(
            "SELECT role, start_ns, end_ns, num_prefill_tokens + num_decode_tokens "
            "FROM engine_steps WHERE role IS NOT NULL AND start_ns >= ? AND start_ns < ?",
            [since, until],
        ).fetchall()
    busy: dict = {}
    for role, start, end, tokens in rows:
        b = (start - since) // w
        busy[(role, b)] = busy.get((role, b), 0) + (end - start if tokens else 0)
    return {k: min(1.0, v / min(w, until - (since + k[1] * w))) for k, v in busy.items()}


def test_pd_pools_equal_the_store(pd_store, gpu_store):
    """Each side's queue, busy share and KV use per bucket: the steps' own values, and the
    phase's design (prefill 30 % busy with 3 waiting and 5 % KV, decode 80 % and ~57 %)."""
    since, until = bounds(pd_store)
    with duckdb.connect(str(pd_store), read_only=True) as con:
        pools = data.pd_pool_series(con, since, until, 5.0)
        assert data.replica_series(con, since, until, 5.0).empty  # the sides are not replicas
    got = {(r.role, r.b): r.busy for r in pools.itertuples()}
    assert got == pytest.approx(_busy_by_hand(pd_store, since, until, 5.0), abs=1e-9)
    side = pools.groupby("role")[["waiting", "running", "busy", "kv_use"]].mean()
    assert side.loc["prefill", "busy"] == pytest.approx(0.3, abs=0.01)
    assert side.loc["decode", "busy"] == pytest.approx(0.8, abs=0.01)
    assert side.loc["prefill", "waiting"] == 3 and side.loc["decode", "waiting"] == 0
    assert side.loc["decode", "running"] == 8 and side.loc["prefill", "running"] == 1
    held = pools.groupby("role")["held"]
    assert held.max()["decode"] == 2 and held.min()["decode"] == 2  # num_kv_waiting
    assert pools.loc[pools["role"] == "prefill", "held"].isna().all()  # NULL on that side
    assert side.loc["prefill", "kv_use"] == pytest.approx(0.05)
    assert side.loc["decode", "kv_use"] == pytest.approx(0.57, abs=0.01)
    (kv_decode,) = sql(
        pd_store,
        "SELECT avg(kv_blocks_used / kv_blocks_total) FROM engine_steps WHERE role = 'decode' "
        "AND start_ns >= ? AND start_ns < ?",
        [since, since + 5 * 10**9],
    )
    first = pools[(pools["role"] == "decode") & (pools["b"] == 0)]
    assert first["kv_use"].iloc[0] == pytest.approx(kv_decode)
    with duckdb.connect(str(pd_store), read_only=True) as con:
        moved = data.pd_transfer_summary(con, since, until)
    n, p50, p99, w50, w99 = sql(
        pd_store,
        "SELECT count(kv_transfer_ms), quantile_cont(kv_transfer_ms, 0.5), "
        "quantile_cont(kv_transfer_ms, 0.99), quantile_cont(kv_wait_ms, 0.5), "
        "quantile_cont(kv_wait_ms, 0.99) FROM requests",
    )
    assert n > 20 and moved["transfers"] == n
    assert (moved["transfer_ms_p50"], moved["transfer_ms_p99"]) == pytest.approx((p50, p99))
    assert (moved["wait_ms_p50"], moved["wait_ms_p99"]) == pytest.approx((w50, w99))
    assert 27 < p50 < 33 and 8 < w50 < 12
    # colocated: no pools, no transfers
    lo, hi = bounds(gpu_store)
    with duckdb.connect(str(gpu_store), read_only=True) as con:
        assert data.pd_pool_series(con, lo, hi, 5.0).empty
        assert data.pd_transfer_summary(con, lo, hi)["transfers"] == 0


def test_engine_page_shows_the_prefill_and_decode_pools_side_by_side(
    monkeypatch, pd_store, gpu_store
):
    """The Engine page on a disaggregated store: the pools chart, prefill in the left column
    and decode in the right, each trace the window's series; the transfer tiles."""
    at = open_page(monkeypatch, pd_store, "engine")
    since, until = bounds(pd_store)
    bucket_s = data.pick_bucket_s(since, until)
    with duckdb.connect(str(pd_store), read_only=True) as con:
        pools = data.pd_pool_series(con, since, until, bucket_s)
    fig = chart_with(at, "decode busy")
    traces = {t["name"]: t for t in fig["data"]}
    for role, col in (("prefill", "x"), ("decode", "x2")):
        d = pools[pools["role"] == role]
        for row, (name, field) in enumerate(
            (("waiting", "waiting"), ("busy", "busy"), ("KV use", "kv_use"))
        ):
            t = traces[f"{role} {name}"]
            assert _values(t["y"]) == pytest.approx(d[field].tolist()), (role, name)
            axis = int(col[1:] or 1) + 2 * row  # rows of two columns: x, x2 / x3, x4 / x5, x6
            assert t.get("xaxis", "x") == ("x" if axis == 1 else f"x{axis}"), (role, name)
    assert "decode hand-offs held" in traces and "prefill hand-offs held" not in traces
    assert set(_values(traces["decode hand-offs held"]["y"])) == {2}
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles[:2] == [
        "prefill: requests waiting / running",
        "decode: requests waiting / running",
    ]
    (p50, w99) = sql(
        pd_store,
        "SELECT quantile_cont(kv_transfer_ms, 0.5), quantile_cont(kv_wait_ms, 0.99) FROM requests",
    )
    assert_ms(metric(at, "KV transfer p50"), p50)
    assert_ms(metric(at, "KV wait p99"), w99)
    assert any("Prefill and decode engine cores" in i.value for i in at.info)
    # colocated: a one-line note, no pools chart
    at = open_page(monkeypatch, gpu_store, "engine")
    assert any("Colocated in this window" in i.value for i in at.info)
    assert not [f for f in charts(at) if any(t.get("name") == "decode busy" for t in f["data"])]


def test_pd_pools_on_stores_from_before_the_fields(monkeypatch, tmp_path):
    """Without ``num_kv_waiting`` the pools lack only the held hand-offs; without ``role`` there
    are no pools, and the Engine page shows the colocated note."""
    path = tmp_path / "old.duckdb"
    write_store(path, [PD.but(duration_s=5)], seed=3)
    with duckdb.connect(str(path)) as con:
        since, until = data.time_range(con)
        con.execute("ALTER TABLE engine_steps DROP COLUMN num_kv_waiting")
        pools = data.pd_pool_series(con, since, until, 1.0)
        assert set(pools["role"]) == {"prefill", "decode"} and pools["held"].isna().all()
        con.execute("ALTER TABLE engine_steps DROP COLUMN role")
        assert data.pd_pool_series(con, since, until, 1.0).empty
    at = open_page(monkeypatch, path, "engine")
    assert any("Colocated in this window" in i.value for i in at.info)


def test_requests_waterfall_shows_the_kv_transfer_and_its_wait(monkeypatch, pd_store):
    """A request moved between the cores: its waterfall's kv_transfer row under prefill holds
    the transfer (from the first token, kv_transfer_ms long) and then the wait (kv_wait_ms)."""
    trace_id, ttft, moved, waited, n_bytes = sql(
        pd_store,
        "SELECT trace_id, ttft_ms, kv_transfer_ms, kv_wait_ms, kv_transfer_bytes FROM requests "
        "ORDER BY kv_wait_ms DESC LIMIT 1",
    )
    at = open_page(monkeypatch, pd_store, "requests")
    at.text_input(key="rq_search").set_value(trace_id[:12])
    at.run()
    assert not at.exception and at.selectbox(key="rq_pick_").value == trace_id
    (fig,) = charts(at)
    traces = {t.get("name"): t for t in fig["data"]}
    bar, wait = traces["KV transfer"], traces["KV wait (decode side full)"]
    assert _values(bar["base"]) == pytest.approx([ttft], abs=1e-5)
    assert _values(bar["x"]) == pytest.approx([moved], abs=1e-5)
    assert _values(wait["base"]) == pytest.approx([ttft + moved], abs=1e-5)
    assert _values(wait["x"]) == pytest.approx([waited], abs=1e-5)
    assert _root_and_stations(traces["stations"]["y"])
    rows = list(reversed(fig["layout"]["yaxis"]["categoryarray"]))
    assert rows[rows.index("prefill") + 1] == "kv_transfer"
    assert any(f"{n_bytes / 1e6:,.1f} MB moved in" in c.value for c in at.caption)


# speculative decoding: 3 draft tokens a request in 70% of the decode-only steps, 60% accepted
SPEC = Phase(duration_s=20, running=4, spec_k=3, spec_accept_rate=0.6, spec_step_slowdown=1.3)


@pytest.fixture(scope="module")
def spec_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dash") / "spec.duckdb"
    write_store(path, [SPEC], seed=9)
    return path


def test_spec_decode_data_equals_the_store(spec_store):
    """The speculative-decoding queries: totals, acceptance per bucket and by draft position,
    tokens per decode sequence with and without drafts, all equal to plain SQL on the steps."""
    since, until = bounds(spec_store)
    with duckdb.connect(str(spec_store), read_only=True) as con:
        s = data.spec_decode_summary(con, since, until)
        series = data.spec_decode_series(con, since, until, 5.0)
        by_pos = data.spec_acceptance_by_position(con, since, until)
        per_pos = con.execute(
            "SELECT num_drafts, num_accepted_tokens_per_pos FROM engine_steps "
            "WHERE num_draft_tokens > 0"
        ).fetchall()
    steps, drafts, draft_tokens, accepted = sql(
        spec_store,
        "SELECT count(*), sum(num_drafts), sum(num_draft_tokens), sum(num_accepted_tokens) "
        "FROM engine_steps WHERE num_draft_tokens > 0",
    )
    assert s["spec_steps"] == steps > 50 and s["spec_drafts"] == drafts
    assert s["spec_draft_tokens"] == draft_tokens == 3 * drafts
    assert s["spec_acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert 0.5 < s["spec_acceptance_rate"] < 0.7
    assert s["spec_accepted_per_draft"] == pytest.approx(accepted / drafts)
    # a decode sequence gets 1 + its accepted tokens in a step with drafts, 1 without
    assert s["tokens_per_seq_draft_steps"] == pytest.approx(1 + accepted / drafts)
    assert s["tokens_per_seq_plain_steps"] == 1.0
    assert s["forward_ms_draft_steps"] / s["forward_ms_plain_steps"] == pytest.approx(1.3, rel=0.1)
    assert series["spec_draft_tokens"].sum() == draft_tokens
    assert series["spec_accepted_tokens"].sum() == accepted and len(series) == 4
    want = [sum(p[i] for _, p in per_pos) for i in range(3)]
    assert by_pos["position"].tolist() == [0, 1, 2] and by_pos["accepted"].tolist() == want
    assert by_pos["rate"].tolist() == pytest.approx([w / drafts for w in want])
    assert sum(want) == accepted and want == sorted(want, reverse=True)


def test_spec_decode_on_a_store_from_before_the_fields(monkeypatch, tmp_path):
    """A store written before the speculative-decoding step fields: empty answers, and the
    Engine page shows the note."""
    path = tmp_path / "old.duckdb"
    write_store(path, [Phase(duration_s=10)], seed=8)
    with duckdb.connect(str(path)) as con:
        for col in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            con.execute(f"ALTER TABLE engine_steps DROP COLUMN {col}")
        con.execute("ALTER TABLE engine_steps DROP COLUMN num_accepted_tokens_per_pos")
        since, until = data.time_range(con)
        assert data.spec_decode_summary(con, since, until)["spec_steps"] is None
        assert data.spec_decode_series(con, since, until, 5.0).empty
        assert data.spec_acceptance_by_position(con, since, until).empty
    at = open_page(monkeypatch, path, "engine")
    assert any("Speculation is off in this store" in i.value for i in at.info)


def test_engine_page_spec_decode_panel(monkeypatch, spec_store):
    at = open_page(monkeypatch, spec_store, "engine")
    steps, rate = sql(
        spec_store,
        "SELECT count(*), sum(num_accepted_tokens) / sum(num_draft_tokens) FROM engine_steps "
        "WHERE num_draft_tokens > 0",
    )
    assert num(metric(at, "Steps with drafts")) == steps
    assert num(metric(at, "Acceptance rate")) == pytest.approx(rate * 100, abs=0.05)
    fig = chart_with(at, "acceptance rate")
    names = {t.get("name") for t in fig["data"]}
    assert {"steps with drafts", "steps without drafts", "accepted tokens per draft"} <= names
    (bars,) = chart_with(at, "accepted share")["data"]
    assert _values(bars["x"]) == [0, 1, 2]
    assert not any("Speculation is off" in i.value for i in at.info)


def test_devices_gpu_view(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store, "devices")
    (tmax,) = sql(gpu_store, "SELECT max(temperature_c) FROM device_samples")
    assert num(metric(at, "Temperature max")) == pytest.approx(tmax, abs=0.05)
    with duckdb.connect(str(gpu_store), read_only=True) as con:
        s = con.execute("SELECT time_ns, power_w FROM device_samples ORDER BY time_ns").df()
        (tokens,) = con.execute("SELECT sum(num_sampled) FROM engine_steps").fetchone()
    energy = (s["power_w"] * s["time_ns"].diff() / 1e9).sum()  # no energy counter: power x time
    assert num(metric(at, "Energy / output token")) == pytest.approx(energy / tokens, abs=5e-4)
    assert num(metric(at, "Throttled time")) > 0  # the second phase runs power-capped
    (fig,) = charts(at)
    names = {t.get("name") for t in fig["data"]}
    assert {"GPU 0 power", "J/token", "GPU 0 SM clock", "throttled (power/thermal)"} <= names
    assert not any("HOST" in w.value for w in at.warning)


def test_devices_host_view_is_labelled(monkeypatch, host_store):
    at = open_page(monkeypatch, host_store, "devices")
    assert any("HOST, not GPU" in w.value for w in at.warning)
    (rss,) = sql(host_store, "SELECT max(rss_bytes) / 2^30 FROM device_samples")
    assert num(metric(at, "Server RSS max")) == pytest.approx(rss, abs=0.005)
    (fig,) = charts(at)
    assert all(t["name"].lower().startswith(("host", "server")) for t in fig["data"])


def test_errors_page_counts_and_examples(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store, "errors")
    errors, etype = sql(
        gpu_store,
        "SELECT count(*), any_value(error_type) FROM requests WHERE error_type IS NOT NULL",
    )
    assert num(metric(at, "Errors")) == errors
    assert metric(at, "Most common") == etype
    table = at.dataframe[0].value
    (latest,) = sql(
        gpu_store,
        "SELECT trace_id FROM requests WHERE error_type IS NOT NULL ORDER BY end_ns DESC LIMIT 1",
    )
    assert table["example_trace_ids"].iloc[0].split()[0] == latest
    assert len(charts(at)) == 1


def test_diagnosis_page_shows_findings_evidence_and_runbook(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store, "diagnosis")
    labels = [e.label for e in at.expander]
    assert any("ttft_queueing" in x for x in labels), labels
    assert any(m.value.startswith("# ttft_queueing") for m in at.markdown)  # the runbook
    assert len(charts(at)) >= 1
    with duckdb.connect(str(gpu_store), read_only=True) as con:
        from tokenmill.diagnose.findings import diagnose

        report = diagnose(con, window_s=10.0)
    assert num(metric(at, "Findings")) == len(report.findings)


def test_diagnosis_page_links_example_traces_and_shows_units(monkeypatch, gpu_store):
    """Each example trace id of the first finding is a link to its waterfall on the Requests
    page (``?trace=<id>``); its evidence numbers carry units ("2,041 ms", not "2041.3456")."""
    at = open_page(monkeypatch, gpu_store, "diagnosis")
    with duckdb.connect(str(gpu_store), read_only=True) as con:
        from tokenmill.diagnose.findings import diagnose

        top = diagnose(con, window_s=10.0).findings[0]
    links = [(pl.proto.page, pl.proto.query_string) for pl in at.get("page_link")]
    assert top.example_trace_ids
    assert links[: len(top.example_trace_ids)] == [
        ("requests", f"trace={t}") for t in top.example_trace_ids
    ]
    evidence = next(m.value for m in at.markdown if m.value.startswith("**Evidence**"))
    assert re.search(r"_ms` = [\d,.]+ ms", evidence) and not re.search(r"\d\.\d{4}", evidence)


def test_diagnosis_page_shows_the_reports_hints(monkeypatch, tmp_path):
    """A float model whose decode reads mostly weights near the peak GB/s: the report's
    "weights dominate decode" note shows as a hint with its knob; no finding."""
    path = tmp_path / "hint.duckdb"
    write_store(path, [Phase(duration_s=40, peak_gbps=20.0)], seed=4)
    at = open_page(monkeypatch, path, "diagnosis")
    assert not at.exception
    hints = [i.value for i in at.info if i.value.startswith("Hint (quantization_no_gain)")]
    assert len(hints) == 1 and "weights dominate decode" in hints[0], [i.value for i in at.info]
    assert any("--quantization" in c.value for c in at.caption)
    assert num(metric(at, "Findings")) == 0


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_an_empty_store(monkeypatch, empty_store, page):
    at = open_page(monkeypatch, empty_store, page)
    assert not at.exception
    assert any("No data" in i.value for i in at.info)


def test_bad_source_is_one_message_not_an_exception(monkeypatch, tmp_path):
    bad = tmp_path / "not-a-dump.duckdb"
    bad.write_text("hello")
    at = open_page(monkeypatch, bad)
    assert any("not a DuckDB file" in e.value for e in at.sidebar.error)


class _AdminDump(http.server.BaseHTTPRequestHandler):
    """A stand-in for a server's ``GET /admin/dump``: serves the store ``server.dump`` to key
    ``k``, whole, or with ``?after_ns=`` what reached it from then on (``write_dump``'s
    incremental dump, as the real route answers); each query is kept in ``server.queries``."""

    def do_GET(self):
        if urllib.parse.urlsplit(self.path).path == "/health":  # the server's health, as set
            body = json.dumps(getattr(self.server, "health", {"status": "ok"})).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        self.server.queries.append(query)
        if self.headers.get("Authorization") != "Bearer k":
            body = json.dumps({"error": {"message": "admin key required"}}).encode()
            self.send_response(401)
        elif "after_ns" in query:
            out = Path(tempfile.mkdtemp()) / "delta.duckdb"
            con = duckdb.connect(str(self.server.dump), read_only=True)
            try:
                write_dump(con, out, ended_since_ns=int(query["after_ns"][0]))
            finally:
                con.close()
            body = out.read_bytes()
            self.send_response(200)
        else:
            body = Path(self.server.dump).read_bytes()
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def admin_server(host_store):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AdminDump)
    server.dump = host_store
    server.queries = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_live_source_fetches_only_what_is_new(admin_server, host_store, tmp_path):
    """The first fetch takes the whole store; a refresh asks for what reached it since the
    mirror's newest row (less the overlap) and merges it: the new rows arrive once, the rows
    fetched again replace themselves, nothing is lost or doubled."""
    host_store = tmp_path / "minute.duckdb"  # a minute of traffic: most of it is old
    write_store(host_store, [Phase(duration_s=60)], seed=7)
    served = tmp_path / "served.duckdb"
    shutil.copy(host_store, served)
    admin_server.dump = served
    url = f"http://127.0.0.1:{admin_server.server_port}"
    handle = StoreHandle(url, api_key="k", refresh_s=60, timeout_s=10)
    try:
        first = handle.snapshot()
        (n_host,) = sql(host_store, "SELECT count(*) FROM requests")
        (steps,) = sql(host_store, "SELECT count(*) FROM engine_steps")
        assert first.con.execute("SELECT count(*) FROM requests").fetchone()[0] == n_host
        assert "after_ns" not in admin_server.queries[-1]  # the first fetch is whole
        # the server has new rows: five requests and their steps ten minutes later
        with duckdb.connect(str(served)) as con:
            con.execute(
                "INSERT INTO requests SELECT * REPLACE (request_id || '-new' AS request_id, "
                "'f' || substr(trace_id, 2) AS trace_id, arrival_ns + 600e9::BIGINT AS arrival_ns, "
                "end_ns + 600e9::BIGINT AS end_ns) FROM requests ORDER BY end_ns DESC LIMIT 5"
            )
            con.execute(
                "INSERT INTO engine_steps SELECT * REPLACE (step_id + 1000000 AS step_id, "
                "start_ns + 600e9::BIGINT AS start_ns, end_ns + 600e9::BIGINT AS end_ns) "
                "FROM engine_steps ORDER BY end_ns DESC LIMIT 20"
            )
        assert handle.snapshot().key == first.key  # not before the refresh interval
        second = handle.snapshot(force=True)
        assert second.key != first.key
        asked = int(admin_server.queries[-1]["after_ns"][0])
        (newest,) = sql(  # the newest row the first fetch brought, in any table
            host_store,
            "SELECT greatest((SELECT max(end_ns) FROM requests), (SELECT max(end_ns) FROM spans), "
            "(SELECT max(end_ns) FROM engine_steps), (SELECT max(time_ns) FROM device_samples), "
            "(SELECT max(time_ns) FROM events))",
        )
        assert newest - asked == OVERLAP_S * 1e9, (asked, newest)
        full, delta = handle.fetched_rows
        assert delta < full / 2, handle.fetched_rows  # what is new, not the whole store
        got = second.con.execute(
            "SELECT count(*), count(DISTINCT request_id) FROM requests"
        ).fetchone()
        assert got == (n_host + 5, n_host + 5)
        assert second.con.execute("SELECT count(*) FROM engine_steps").fetchone()[0] == steps + 20
        # the older snapshot still reads (a page may be using it)
        assert first.con.execute("SELECT count(*) FROM requests").fetchone()[0] == n_host + 5
        admin_server.shutdown()  # the server goes away: the last dump stays, with the reason
        admin_server.server_close()
        third = handle.snapshot(force=True)
        assert third.key == second.key and "cannot connect" in third.error
    finally:
        handle.close()
    with pytest.raises(SourceError, match="cannot connect"):  # nothing fetched yet: an error
        StoreHandle(f"http://127.0.0.1:{free_port()}", "k").snapshot()


def test_live_source_wrong_key_is_one_message(admin_server):
    url = f"http://127.0.0.1:{admin_server.server_port}"
    with pytest.raises(SourceError, match="answered 401: admin key required"):
        StoreHandle(url, api_key="wrong").snapshot()


def test_console_on_a_live_server(monkeypatch, admin_server, host_store):
    monkeypatch.setenv("TOKENMILL_ADMIN_KEY", "k")
    at = open_page(monkeypatch, f"http://127.0.0.1:{admin_server.server_port}")
    assert any(c.value.startswith("Live:") for c in at.sidebar.caption)
    assert [h.value for h in at.header] == ["Now"]  # a live source opens on its findings
    at.switch_page("views/overview.py").run()
    (n,) = sql(host_store, "SELECT count(*) FROM requests")
    assert num(metric(at, "Requests")) == n


def test_console_on_a_live_server_says_when_its_telemetry_loses_rows(monkeypatch, admin_server):
    """What the store cannot show, the rows it is losing now: the live server's /health
    ``telemetry`` block, one warning in the sidebar (nothing when nothing is lost)."""
    monkeypatch.setenv("TOKENMILL_ADMIN_KEY", "k")
    url = f"http://127.0.0.1:{admin_server.server_port}"
    at = open_page(monkeypatch, url)
    assert not [w for w in at.sidebar.warning if "Telemetry" in w.value]
    admin_server.health = {
        "status": "degraded",
        "telemetry": {
            "store": {"problem": "disk_full"},
            "dropped_by_reason": {"disk_full": {"requests": 12, "spans": 30}, "bad_value": {}},
        },
    }
    at.button(key="tm_refresh").click().run()  # the next fetch reads /health again
    (warning,) = [w.value for w in at.sidebar.warning if "Telemetry" in w.value]
    assert "dropping rows now (disk_full)" in warning and "42 disk_full" in warning


def tm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("missing.duckdb", "missing.duckdb: no such file"),
        ("NOTADUMP", "not a DuckDB file"),
        ("http://", "bad --source URL"),
    ],
)
def test_dashboard_command_refuses_a_bad_source(tmp_path, source, message):
    if source == "NOTADUMP":
        source = str(tmp_path / "notes.txt")
        Path(source).write_text("not a dump")
    r = tm("dashboard", "--source", source)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr


def test_custom_time_range(monkeypatch, gpu_store):
    at = open_page(monkeypatch, gpu_store, "engine")
    at.selectbox(key="tm_window").set_value("Custom")
    at.run()
    lo, _ = bounds(gpu_store)
    a, _ = at.slider(key="tm_custom").value
    at.slider(key="tm_custom").set_value((a + timedelta(seconds=10), a + timedelta(seconds=20)))
    at.run()
    assert not at.exception
    since = lo // 10**9 * 10**9 + 10 * 10**9
    assert at.session_state["tm_since_ns"] == since
    (steps,) = sql(
        gpu_store,
        "SELECT count(*) FROM engine_steps WHERE start_ns >= ? AND start_ns < ?",
        [since, since + 10 * 10**9],
    )
    assert num(metric(at, "Steps")) == steps


def test_idle_heartbeats_count_for_kv_not_for_step_times(tmp_path):
    """An idle engine's heartbeat rows (no tokens) show KV use but are not steps."""
    store = tmp_path / "idle.duckdb"
    write_store(
        store, [Phase(duration_s=10), Phase(duration_s=10, rate_per_s=0, idle_kv_usage=0.3)]
    )
    working = "num_prefill_tokens + num_decode_tokens > 0"
    n_work, n_idle, step_ms = sql(
        store,
        f"SELECT count(*) FILTER (WHERE {working}), count(*) FILTER (WHERE NOT ({working})), "
        f"avg((end_ns - start_ns) / 1e6) FILTER (WHERE {working}) FROM engine_steps",
    )
    assert n_work > 0 and n_idle > 0
    since, until = bounds(store)
    with duckdb.connect(str(store), read_only=True) as con:
        summary = data.engine_summary(con, since, until + 1)
        per_step, bucket = data.engine_steps(con, since, until + 1)
        bucketed, _ = data.engine_steps(con, since, until + 1, max_points=10)
    assert summary["steps"] == n_work
    assert summary["step_ms_mean"] == pytest.approx(step_ms)
    assert bucket is None and len(per_step) == n_work + n_idle
    idle = per_step[(per_step["prefill_tokens"] + per_step["decode_tokens"]) == 0]
    assert len(idle) == n_idle and idle["step_ms"].isna().all()
    assert (idle["kv_used"] / idle["kv_total"]).round(2).eq(0.3).all()
    assert bucketed["steps"].sum() == n_work


def test_any_step_field_charts_the_store_values(monkeypatch, gpu_store):
    """Every numeric step-record field is offered on the Engine page, and the chart of one holds
    the store's own values (a field added to StepRecord needs no console edit)."""
    import msgspec

    from tokenmill.engine.messages import StepRecord

    info = msgspec.inspect.type_info(StepRecord).fields
    mi = msgspec.inspect

    def is_series(t) -> bool:  # not list[...] or str (or either | None)
        inner = t.types if isinstance(t, mi.UnionType) else (t,)
        return not any(isinstance(u, (mi.ListType, mi.StrType)) for u in inner)

    fields = [f.name for f in info if is_series(f.type)]
    # list-typed fields (num_accepted_tokens_per_pos, rank_compute_ms) and strings (role) are
    # no time series: left out of the list; a boolean one (compiled) charts as 0/1
    assert "num_accepted_tokens_per_pos" not in data.STEP_FIELDS and "role" not in data.STEP_FIELDS
    assert "compiled" in data.STEP_FIELDS
    assert set(data.STEP_FIELDS) == set(fields) - {"step_id", "engine_pid", "start_ns", "end_ns"}
    at = open_page(monkeypatch, gpu_store, "engine")
    assert list(at.selectbox(key="tm_step_field").options) == list(data.STEP_FIELDS)
    at.selectbox(key="tm_step_field").set_value("num_decode_tokens")
    at.run()
    assert not at.exception
    (trace,) = chart_with(at, "num_decode_tokens")["data"]
    y = _values(trace["y"])
    (total, n) = sql(
        gpu_store,
        "SELECT sum(num_decode_tokens), count(*) FROM engine_steps "
        "WHERE num_prefill_tokens + num_decode_tokens > 0",
    )
    assert trace["name"] == "num_decode_tokens"
    assert len(y) == n and sum(y) == total
    with (
        pytest.raises(ValueError, match="unknown step field"),
        duckdb.connect(str(gpu_store), read_only=True) as con,
    ):
        data.step_field_series(con, *bounds(gpu_store), "step_id; DROP TABLE requests")


# the roofline fields as the engine counts them for float32 SmolLM2-135M (tests/engine/test_roofline.py):
# weights (linear + LM head) read once, decodes at context 500, attention left out
_ROOFLINE_UPDATE = """
UPDATE engine_steps SET weight_bytes = 537919488,
    kv_read_bytes = (num_prefill_tokens + 500 * num_decode_tokens) * 46080::BIGINT,
    kv_write_bytes = (num_prefill_tokens + num_decode_tokens) * 46080::BIGINT,
    flops = 2 * 134479872::BIGINT * (num_prefill_tokens + num_decode_tokens)
WHERE num_prefill_tokens + num_decode_tokens > 0
"""


@pytest.fixture(scope="module")
def roofline_store(tmp_path_factory) -> Path:
    """A store whose steps carry roofline fields and whose latest config event has peaks."""
    path = tmp_path_factory.mktemp("dash") / "roofline.duckdb"
    write_store(path, [Phase(duration_s=20)], seed=7)
    peaks = {
        "device_name": "NVIDIA H200",
        "device_peak_gbps": 4800.0,
        "device_peak_gflops": 989000.0,
        "device_peak_gbps_source": "table:NVIDIA H200",
        "device_peak_gflops_source": "table:NVIDIA H200",
    }
    with duckdb.connect(str(path)) as con:
        con.execute(_ROOFLINE_UPDATE)
        (t,) = con.execute("SELECT max(time_ns) + 1 FROM events").fetchone()
        con.execute(
            "INSERT INTO events (time_ns, kind, severity, message, attributes) "
            "VALUES (?, 'config', 'info', 'engine flags at start', ?)",
            [t, json.dumps(peaks)],
        )
    return path


def test_engine_roofline_plots_every_step_under_the_peaks(monkeypatch, roofline_store):
    """The Engine page's roofline: log-log, one point per step at the store's own intensity and
    GFLOP/s (telemetry.schema's SQL), prefill and decode steps apart, the two ceilings from the
    config event meeting at the ridge point (989,000 / 4,800 = 206 FLOP/byte)."""
    at = open_page(monkeypatch, roofline_store, "engine")
    fig = chart_with(at, "decode-only steps")
    assert fig["layout"]["xaxis"]["type"] == "log" and fig["layout"]["yaxis"]["type"] == "log"
    traces = {t["name"]: t for t in fig["data"]}
    for kind, where in (
        ("prefill-containing", "num_prefill_tokens > 0"),
        ("decode-only", "num_prefill_tokens = 0"),
    ):
        (n, gflops) = sql(
            roofline_store,
            f"SELECT count(*), sum(flops / forward_ms / 1e6) FROM engine_steps "
            f"WHERE flops > 0 AND {where}",
        )
        y = _values(traces[f"{kind} steps"]["y"])
        assert n > 0 and len(y) == n and sum(y) == pytest.approx(gflops)
    (x_max,) = sql(
        roofline_store,
        "SELECT max(flops::DOUBLE / (weight_bytes + kv_read_bytes + kv_write_bytes)) "
        "FROM engine_steps WHERE flops > 0",
    )
    assert max(_values(traces["prefill-containing steps"]["x"])) == pytest.approx(x_max)
    bandwidth = traces["bandwidth ceiling 4,800 GB/s"]
    bx, by = _values(bandwidth["x"]), _values(bandwidth["y"])
    assert by[0] == pytest.approx(4800 * bx[0]) and by[1] == pytest.approx(989_000)
    compute = traces["compute ceiling 989,000 GFLOP/s"]
    assert _values(compute["y"]) == [989_000, 989_000]
    ridge = traces["ridge point 206 FLOP/byte"]
    assert _values(ridge["x"]) == [pytest.approx(989_000 / 4800)]
    assert any("table:NVIDIA H200" in c.value for c in at.caption)


def test_engine_roofline_without_counts_says_so(monkeypatch, tmp_path):
    """A store whose steps carry no bytes/FLOPs (written before the roofline) shows a note in
    place of the roofline, and the rest of the page as before."""
    path = tmp_path / "old.duckdb"
    write_store(path, [Phase(duration_s=10)], seed=8)
    with duckdb.connect(str(path)) as con:
        con.execute("UPDATE engine_steps SET weight_bytes = NULL, flops = NULL")
    at = open_page(monkeypatch, path, "engine")
    assert any("No roofline" in i.value for i in at.info)
    assert chart_with(at, "prefill tokens")


def test_roofline_buckets_sum_their_steps(roofline_store):
    """Past max_points the roofline sums steps per time bucket and kind: the counts add up and
    each bucket's GFLOP/s is its FLOPs over its forward time."""
    from tokenmill.dashboard import charts as dash_charts

    since, until = bounds(roofline_store)
    with duckdb.connect(str(roofline_store), read_only=True) as con:
        per_step, none = data.roofline_steps(con, since, until + 1)
        buckets, bucket_s = data.roofline_steps(con, since, until + 1, max_points=10)
        peaks = data.device_peaks(con)
    assert none is None and bucket_s is not None
    assert buckets["steps"].sum() == len(per_step) and set(buckets["kind"]) <= {"prefill", "decode"}
    b = buckets.iloc[0]
    w = int(bucket_s * 1e9)
    (flops, ms) = sql(
        roofline_store,
        "SELECT sum(flops), sum(forward_ms) FROM engine_steps WHERE flops > 0 AND "
        "start_ns >= ? AND start_ns < ? AND (CASE WHEN num_prefill_tokens > 0 THEN 'prefill' "
        "ELSE 'decode' END) = ?",
        [int(b["t_ns"]), int(b["t_ns"]) + w, b["kind"]],
    )
    assert b["achieved_gflops"] == pytest.approx(flops / ms / 1e6)
    assert peaks["ridge"] == pytest.approx(989_000 / 4800)
    fig = dash_charts.roofline(buckets, peaks, per_step=False)
    assert {t.name for t in fig.data} >= {"decode-only steps", "ridge point 206 FLOP/byte"}


def test_roofline_draws_int8_computes_own_ceiling(roofline_store, tmp_path):
    """A config event with int8 compute's probed peak: the int8 ridge is that peak over the
    bandwidth, and the chart draws the bandwidth roof on to it, then the int8 roof."""
    import shutil

    from tokenmill.dashboard import charts as dash_charts

    path = tmp_path / "int8.duckdb"
    shutil.copy(roofline_store, path)
    peaks = {"device_name": "Intel Xeon", "device_peak_gbps": 20.0, "device_peak_gflops": 300.0,
             "device_peak_int8_gops": 2000.0, "int8_compute_path": "amx"}  # fmt: skip
    with duckdb.connect(str(path)) as con:
        (t,) = con.execute("SELECT max(time_ns) + 1 FROM events").fetchall()[0]
        con.execute(
            "INSERT INTO events (time_ns, kind, severity, message, attributes) "
            "VALUES (?, 'config', 'info', 'engine flags at start', ?)",
            [t, json.dumps(peaks)],
        )
    since, until = bounds(path)
    with duckdb.connect(str(path), read_only=True) as con:
        steps, _ = data.roofline_steps(con, since, until + 1)
        got = data.device_peaks(con)
    assert got["ridge"] == pytest.approx(15.0) and got["int8_ridge"] == pytest.approx(100.0)
    fig = dash_charts.roofline(steps, got, per_step=True)
    (int8,) = [t for t in fig.data if t.name.startswith("int8 compute ceiling")]
    assert list(int8.x[:2]) == pytest.approx([15.0, 100.0])
    assert list(int8.y) == pytest.approx([300.0, 2000.0, 2000.0])
    plain = dash_charts.roofline(steps, {**got, "peak_int8_gops": None}, per_step=True)
    assert not [t for t in plain.data if t.name.startswith("int8")]


def test_a_store_of_another_engine_names_it_and_where_its_signals_came_from(monkeypatch, tmp_path):
    """A proxy's store of a vLLM server (client-side request rows, vLLM's scraped metrics, no
    step records): the sidebar names the engine, the Diagnosis page says its queue and KV
    signals came from the scraped metrics and lists what it could not assess."""
    import msgspec

    from tokenmill.telemetry.engine_metrics import read_exposition
    from tokenmill.telemetry.rows import RequestRow
    from tokenmill.telemetry.store import TraceStore

    fixture = Path(__file__).resolve().parents[1] / "telemetry/fixtures/metrics/vllm.prom"
    path = tmp_path / "proxy.duckdb"
    store = TraceStore(path, flush_interval_s=0.05)
    t0, s = 1_767_225_600_000_000_000, 1_000_000_000
    for i in range(30):
        a = t0 + i * s
        row = RequestRow(request_id=f"r{i}", trace_id=f"{i + 1:032x}", arrival_ns=a,
                         first_token_ns=a + s // 5, last_token_ns=a + s, end_ns=a + s,
                         input_tokens=40, output_tokens=16, ttft_ms=200.0, tpot_ms=50.0,
                         itl_p50_ms=50.0, itl_p99_ms=55.0, itl_max_ms=55.0, e2e_ms=1000.0,
                         finish_reason="length", http_status=200)  # fmt: skip
        assert store.submit("requests", msgspec.structs.asdict(row))
    for k in range(31):
        sample = read_exposition(fixture.read_text(), "http://vllm:8000/metrics", t0 + k * s)
        assert store.submit("engine_samples", msgspec.structs.asdict(sample))
    assert store.flush()
    store.close()
    at = open_page(monkeypatch, path, "diagnosis")
    assert any("Engine: **vllm**" in c.value for c in at.sidebar.caption), [
        c.value for c in at.sidebar.caption
    ]
    assert any("come from its scraped /metrics (kv, steps)" in c.value for c in at.caption)
    assert any("time per output token" in c.value for c in at.caption)
    assert any(e.label.startswith("Not assessed:") for e in at.expander)
