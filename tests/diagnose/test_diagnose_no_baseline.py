"""Diagnosis without a healthy period (issue 18 item 5): a dump that starts in trouble has no
healthy windows to compare with; rules then stand on their absolute evidence or are reported as
not judged. Warm-up after a server start is set apart, and a finding's text follows its window
(who was refused and by which limit; no tokens is not "normal throughput").

Synthetic stores (tests/helpers/synth_store.py) for each case, then real-engine runs (one from
the diagnosis corpus, one served here) cut to start inside the trouble with
``write_dump(since_ns=...)``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from rich.console import Console
from server_proc import Server
from synth_store import T0, Phase, S, write_store

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.report import print_text, to_json, to_markdown
from tokenmill.diagnose.rules import RULES
from tokenmill.diagnose.rules._common import BASELINE_NEEDS
from tokenmill.diagnose.signals import WARMUP_MAX_S
from tokenmill.telemetry.dump import open_dump, write_dump

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "benchmarks" / "data" / "diagnosis_corpus"
HEALTHY = Phase(duration_s=40)
# KV pool nearly full all along: preemptions, a block allocation failing in 80% of the steps
PRESSURE = HEALTHY.but(kv_usage=0.99, preempt_share=0.3, queue_ms=300, alloc_failures_per_step=0.8)


def _report(path, phases, seed=4, window_s=10.0):
    write_store(path, phases, seed=seed)
    with duckdb.connect(str(path), read_only=True) as con:
        return diagnose(con, window_s=window_s)


def _text(report) -> str:
    console = Console(record=True, width=200)
    print_text(report, console)
    return console.export_text()


def test_every_rule_declares_what_it_stands_on_without_a_baseline():
    text = (ROOT / "runbooks" / "README.md").read_text()
    section = text.split("## Without a healthy baseline", 1)[1]
    for rule in RULES:
        assert rule.healthy_baseline in BASELINE_NEEDS, rule.id
        # the runbook index lists each rule under its declaration
        line = next(
            ln for ln in section.splitlines() if ln.startswith(f"- **{rule.healthy_baseline}")
        )
        assert f"`{rule.id}`" in line, (rule.id, rule.healthy_baseline)


def test_kv_pressure_from_the_first_window_fires_on_absolute_evidence(tmp_path):
    report = _report(tmp_path / "kv.duckdb", [PRESSURE])
    base = report.healthy_baseline
    assert base["available"] is False and base["healthy_windows"] == 0
    assert "preemptions in" in base["reason"] and "allocation failures in" in base["reason"]
    # ratio rules are not judged, and the report says which
    assert "ttft_prefill_bound" in base["not_judged"]
    assert not set(base["not_judged"]) & {f.rule_id for f in report.findings}
    fired = {f.rule_id: f for f in report.findings}
    assert "kv_pressure_preemption" in fired, sorted(fired)
    ev = fired["kv_pressure_preemption"].evidence
    assert ev["healthy_baseline"] is False
    assert ev["kv_usage_max"] >= 0.95 and ev["preemptions"] >= 1
    assert 0.6 <= ev["allocation_failure_step_share"] <= 1.0
    assert ev["allocation_failure_steps"] <= ev["steps"]
    assert "no healthy baseline" in fired["kv_pressure_preemption"].summary
    j = json.loads(to_json(report))
    assert j["healthy_baseline"]["available"] is False and j["schema_version"] == 1
    assert "No healthy baseline in this dump" in to_markdown(report)
    assert "No healthy baseline in this dump" in _text(report)


def test_kv_pressure_without_allocation_failures_is_not_guessed(tmp_path):
    """Without a baseline the rule needs its absolute markers, all of them: a full pool with
    preemptions but allocations that never fail is not enough."""
    report = _report(tmp_path / "kv.duckdb", [PRESSURE.but(alloc_failures_per_step=0.0)])
    assert report.healthy_baseline["available"] is False
    assert "kv_pressure_preemption" not in {f.rule_id for f in report.findings}


def test_with_a_healthy_period_the_baseline_is_used_as_before(tmp_path):
    report = _report(tmp_path / "kv.duckdb", [HEALTHY, PRESSURE.but(duration_s=30)])
    assert report.healthy_baseline["available"] is True
    assert report.healthy_baseline["not_judged"] == []
    f = next(f for f in report.findings if f.rule_id == "kv_pressure_preemption")
    assert f.evidence["baseline_ttft_p99_ms"] is not None
    assert "No healthy baseline" not in to_markdown(report)


def test_error_spike_from_the_first_window(tmp_path):
    report = _report(tmp_path / "err.duckdb", [HEALTHY.but(rate_per_s=3, error_share=0.4)])
    assert report.healthy_baseline["available"] is False
    assert "errors in ≥ 5% of requests in" in report.healthy_baseline["reason"]
    f = next(f for f in report.findings if f.rule_id == "error_spike")
    assert f.evidence["baseline_error_rate"] is None and f.evidence["healthy_baseline"] is False
    assert 0.2 <= f.evidence["error_rate"] <= 0.7
    assert "(no healthy baseline)" in f.summary and "nan_logits" in f.summary
    assert f.causes[0].startswith("numerical failures")


@pytest.mark.parametrize(
    ("code", "limit", "knob"),
    [
        ("rate_limit_exceeded", "the tenant rate limit (requests_per_minute)", "tenants file"),
        ("queue_full", "the admission queue (--max-queue-len)", "--max-queue-len"),
    ],
)
def test_a_window_of_refusals_names_the_limit_and_the_tenants(tmp_path, code, limit, knob):
    report = _report(
        tmp_path / "r.duckdb",
        [HEALTHY, HEALTHY.but(rate_per_s=3, error_share=0.5, error_type=code)],
    )
    f = next(f for f in report.findings if f.rule_id == "error_spike")
    n = f.evidence["errors_by_type"][code]
    assert f.evidence["refused_by_tenant"] == {code: {"acme": n}}
    assert f"refused by {limit}: {n} (tenant 'acme' {n})" in f.summary
    assert f.causes[0] == f"rejections by {limit}" and knob in f.knob


def test_a_window_without_tokens_is_not_called_normal_throughput(tmp_path):
    """Before: "while throughput stayed at 0 tok/s"; a window whose engine produced nothing."""
    report = _report(
        tmp_path / "z.duckdb", [HEALTHY, HEALTHY.but(duration_s=30, running=0, error_share=1.0)]
    )
    f = next(f for f in report.findings if f.rule_id == "error_spike")
    assert f.evidence["throughput_tok_s"] == 0.0 and f.severity == "critical"
    assert "produced no tokens" in f.summary and "stayed at" not in f.summary


def _add_event(path, time_ns: int, kind: str) -> None:
    with duckdb.connect(str(path)) as con:
        con.execute("INSERT INTO events VALUES (?, ?, 'info', 'test', NULL)", [time_ns, kind])


def test_warm_up_after_a_server_start_is_set_apart(tmp_path):
    """The first requests after a start meet a cold server (here: prefill at 1/40 of its
    speed for 3 s). With the server_start event they are set apart and nothing fires; without
    it (the same rows) the slow start reads as a TTFT symptom."""
    phases = [HEALTHY.but(duration_s=3, prefill_tok_per_s=50), HEALTHY.but(duration_s=60)]
    cold = _report(tmp_path / "cold.duckdb", phases, seed=9)
    assert cold.warmup["requests"] == 0
    assert "ttft_prefill_bound" in {f.rule_id for f in cold.findings}

    path = tmp_path / "warm.duckdb"
    write_store(path, phases, seed=9)
    _add_event(path, T0, "server_start")
    with duckdb.connect(str(path), read_only=True) as con:
        report = diagnose(con)
        first_done, n_before = con.execute(
            "SELECT min(end_ns), NULL FROM requests WHERE finish_reason = 'length'"
        ).fetchone()
        (n_before,) = con.execute(
            "SELECT count(*) FROM requests WHERE arrival_ns <= ?", [first_done]
        ).fetchone()
    assert report.findings == [], [f.rule_id for f in report.findings]
    assert report.warmup["requests"] == n_before >= 2
    ((lo, hi),) = report.warmup["intervals"]
    assert lo == T0 and hi == first_done + 1 and hi - lo < WARMUP_MAX_S * S
    assert report.summary["requests"] > n_before  # the key numbers still count them
    assert f"{n_before} requests" in to_markdown(report)


@pytest.mark.parametrize("burst_at_s", [60, 67])  # inside one 10 s window; across two
def test_an_error_burst_leaves_the_quiet_windows_far_from_it_healthy(tmp_path, burst_at_s):
    """A low-rate run (3 requests a 10 s window, too few to show an error rate under 5% on
    their own) with one 4 s burst of failing requests, inside one window or across a window
    boundary: each quiet window is judged on its neighbourhood (the windows around it pooled
    until 10 requests end), not on the whole run's rate (about 30% here), so the windows far
    from the burst stay healthy, the dump keeps its baseline, and the burst is error_spike's."""
    quiet = HEALTHY.but(rate_per_s=0.3)
    report = _report(
        tmp_path / "burst.duckdb",
        [
            quiet.but(duration_s=burst_at_s),
            HEALTHY.but(duration_s=4, rate_per_s=5.0, error_share=0.9),
            quiet.but(duration_s=130 - burst_at_s),
        ],
    )
    base = report.healthy_baseline
    assert base["available"] is True, base
    assert base["healthy_windows"] >= 4, base
    assert "error_spike" in {f.rule_id for f in report.findings}


@pytest.mark.parametrize("rate", [0.3, 0.1])  # 3 requests a window; 1 in most windows
def test_errors_spread_thin_over_quiet_windows_leave_no_healthy_one(tmp_path, rate):
    """A low rate with 30% of the requests failing all along: each window's few requests may
    show no error (at 0.1/s a window whose one request failed has none completed), but every
    neighbourhood of 10 ended requests fails at about 30%, and no window is healthy."""
    report = _report(
        tmp_path / "thin.duckdb", [HEALTHY.but(duration_s=200, rate_per_s=rate, error_share=0.3)]
    )
    base = report.healthy_baseline
    assert base["available"] is False, base
    assert "errors in ≥ 5% of requests" in base["reason"], base


def test_a_neighbourhood_grows_until_ten_requests_end():
    """local_error_rates on hand-set windows: a quiet window takes the nearest windows on both
    sides until 10 requests end; a window where 10 end is judged on its own."""
    from tokenmill.diagnose.signals.baseline import local_error_rates
    from tokenmill.diagnose.signals.window import Window

    counts = [(2, 0), (2, 0), (2, 0), (12, 9), (2, 0), (2, 0), (2, 0), (2, 0), (2, 0), (2, 0)]
    windows = [Window(i, i, i + 1, {"ended": e, "errors": f}) for i, (e, f) in enumerate(counts)]
    local = local_error_rates(windows)
    assert 3 not in local  # 12 ended: its own rate
    assert local[2] == pytest.approx(9 / 16)  # radius 1: windows 1-3
    assert local[8] == pytest.approx(0.0)  # radius 2: windows 6-9 (8 ended), then 5-9 (10)
    assert local[0] == pytest.approx(9 / 18)  # radius 3: windows 0-3


def test_warm_up_is_capped_when_nothing_completes(tmp_path):
    """A server that never completes a request is not warming up for ever: WARMUP_MAX_S after
    the first arrival."""
    path = tmp_path / "s.duckdb"
    write_store(path, [HEALTHY.but(duration_s=60, error_share=1.0)], seed=2)
    _add_event(path, T0, "server_start")
    with duckdb.connect(str(path), read_only=True) as con:
        report = diagnose(con)
        (first,) = con.execute("SELECT min(arrival_ns) FROM requests").fetchone()
    ((lo, hi),) = report.warmup["intervals"]
    assert (lo, hi) == (T0, first + int(WARMUP_MAX_S * S))
    assert "error_spike" in {f.rule_id for f in report.findings}


# ----- the real engine: runs cut to start inside the trouble -----


def _bench(url: str, out: Path, *args: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "bench", "--url", url, *args,
         "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]


def _serve_and_bench(tmp_path, smollm2_dir, server_args, bench_args) -> Path:
    store = tmp_path / "traces.duckdb"
    server = Server(tmp_path, "--model", str(smollm2_dir), "--trace-db", str(store), *server_args)
    try:
        _bench(server.url, tmp_path / "bench.json", *bench_args)
    finally:
        server.stop()
    return store


def _cut(store: Path | duckdb.DuckDBPyConnection, out: Path, since_sql: str) -> int:
    """Write ``store`` (a path or an open connection) from ``since_sql``'s time on to ``out``."""
    con = duckdb.connect(str(store), read_only=True) if isinstance(store, Path) else store
    try:
        (since,) = con.execute(since_sql).fetchone()
        assert since is not None, since_sql
        write_dump(con, out, since_ns=since)
    finally:
        if isinstance(store, Path):
            con.close()
    return since


def _diagnose_cli(dump: Path, fmt: str, window: str = "5s") -> str:
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "diagnose", str(dump), "--window", window,
         "--format", fmt],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_real_kv_pressure_dump_cut_inside_the_trouble(tmp_path):
    """kv_pressure_preemption's scenario as the real engine recorded it (a corpus run: 10
    clients, 168-token prompts in a 36-block pool). The dump starts at the first preemption,
    so none of its windows is healthy."""
    run = CORPUS / "kv_pressure_preemption-0"
    if not run.is_dir():
        pytest.skip(f"no {run.name} under {CORPUS} (make corpus)")
    store = open_dump(run / "dump", verify=False)
    dump = tmp_path / "cut.duckdb"
    try:
        _cut(store, dump, "SELECT min(start_ns) FROM engine_steps WHERE num_preempted > 0")
    finally:
        store.close()
    report = json.loads(_diagnose_cli(dump, "json", "10s"))  # the run's window
    base = report["healthy_baseline"]
    assert base["available"] is False, base
    assert "ttft_prefill_bound" in base["not_judged"]
    assert report["warmup"]["requests"] == 0  # the start is not in the dump
    fired = {f["rule"]: f for f in report["findings"]}
    assert "kv_pressure_preemption" in fired, (base, sorted(fired))
    ev = fired["kv_pressure_preemption"]["evidence"]
    print("kv cut:", base["reason"], json.dumps(ev))
    assert ev["healthy_baseline"] is False
    assert ev["kv_usage_max"] >= 0.95 and ev["preemptions"] >= 1
    assert ev["allocation_failure_step_share"] >= 0.5
    with duckdb.connect(str(dump), read_only=True) as con:
        (kv_max,) = con.execute(
            "SELECT max(kv_blocks_used::DOUBLE / kv_blocks_total) FROM engine_steps"
        ).fetchone()
    assert ev["kv_usage_max"] <= kv_max + 1e-9
    text = _diagnose_cli(dump, "text", "10s")
    assert "No healthy baseline in this dump" in text and "not judged" in text


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a loaded 2-core VM ran it 14 min; quiet: 1 min
def test_real_error_spike_dump_cut_inside_the_trouble(tmp_path, smollm2_dir):
    """error_spike's scenario, short: the NaN drill on a third of the requests, a tenth of the
    clients closing their stream; the dump starts at the first failed request."""
    store = _serve_and_bench(
        tmp_path,
        smollm2_dir,
        ["--fault-nan-fraction", "0.3"],
        ["--concurrency", "4", "--num-requests", "24", "--prompt-tokens", "uniform:32:64",
         "--output-tokens", "16", "--abort-fraction", "0.1", "--seed", "3", "--timeout", "1200"],
    )  # fmt: skip
    dump = tmp_path / "cut.duckdb"
    _cut(store, dump, "SELECT min(arrival_ns) FROM requests WHERE error_type IS NOT NULL")
    report = json.loads(_diagnose_cli(dump, "json", "10s"))  # the scenario's window
    base = report["healthy_baseline"]
    assert base["available"] is False, base
    fired = {f["rule"]: f for f in report["findings"]}
    assert "error_spike" in fired, (base, sorted(fired))
    ev = fired["error_spike"]["evidence"]
    print("error cut:", base["reason"], json.dumps(ev))
    assert ev["healthy_baseline"] is False and ev["baseline_error_rate"] is None
    assert ev["error_rate"] >= 0.2 and ev["errors_by_type"].get("nan_logits", 0) >= 1
    assert ev["throughput_tok_s"] > 0
    assert re.search(r"\(no healthy baseline\) while the engine still produced \d+ tok/s",
                     fired["error_spike"]["summary"])  # fmt: skip
    assert "No healthy baseline in this dump" in _diagnose_cli(dump, "markdown", "10s")


def test_ttft_queueing_ranks_first_the_cause_its_window_shows(tmp_path):
    """The running batch at max_num_seqs (8) while arrivals barely exceed completions: the cap
    comes first. The same queueing without a cap keeps the rule's order (load first)."""
    capped = _report(
        tmp_path / "cap.duckdb",
        [
            HEALTHY.but(max_num_seqs=8),
            HEALTHY.but(duration_s=30, queue_ms=2000, running=8, max_num_seqs=8),
        ],
    )
    f = next(f for f in capped.findings if f.rule_id == "ttft_queueing")
    assert f.evidence["max_num_seqs"] == 8 and f.evidence["running_max"] == 8
    assert f.evidence["arrivals"] < 1.2 * f.evidence["completions"]
    assert f.causes[0] == "max_num_seqs or the KV pool caps the running batch"
    plain = _report(tmp_path / "plain.duckdb", [HEALTHY, HEALTHY.but(duration_s=30, queue_ms=2000)])
    f = next(f for f in plain.findings if f.rule_id == "ttft_queueing")
    assert f.causes[0].startswith("offered load") and f.evidence["max_num_seqs"] == 64


def test_a_fleet_lacks_a_baseline_where_one_source_does(tmp_path):
    """Each source is judged on its own windows; the merged report names the source without."""
    from tokenmill.diagnose.fleet import merge

    ok = _report(tmp_path / "a.duckdb", [HEALTHY, PRESSURE.but(duration_s=30)])
    bad = _report(tmp_path / "b.duckdb", [PRESSURE])
    fleet = merge([("replica-a", "a.duckdb", ok), ("replica-b", "b.duckdb", bad)])
    assert fleet.healthy_baseline["available"] is False
    assert fleet.healthy_baseline["reason"].startswith("replica-b: 0 of ")
    assert "ttft_prefill_bound" in fleet.healthy_baseline["not_judged"]
    by_name = {s["name"]: s for s in fleet.to_json()["sources"]}
    assert by_name["replica-a"]["healthy_baseline"]["available"] is True
    assert by_name["replica-b"]["healthy_baseline"]["available"] is False
    assert "No healthy baseline in this dump: replica-b: " in to_markdown(fleet)


def test_a_quiet_window_of_an_erroring_dump_is_not_healthy_by_luck(tmp_path):
    """Five requests a window, 40% failing: some windows end without an error by chance. Fewer
    than 10 requests cannot show a rate under 5%, so such a window takes the range's rate."""
    path = tmp_path / "e.duckdb"
    write_store(path, [HEALTHY.but(duration_s=120, rate_per_s=0.5, error_share=0.4)], seed=6)
    with duckdb.connect(str(path), read_only=True) as con:
        (clean,) = con.execute(
            "SELECT count(*) FROM (SELECT (end_ns - (SELECT min(arrival_ns) FROM requests)) "
            "// 10000000000 AS w, count(*) FILTER (WHERE error_type IS NOT NULL) AS e "
            "FROM requests GROUP BY w) WHERE e = 0"
        ).fetchone()
        report = diagnose(con)
    assert clean >= 1  # windows without an error exist
    assert report.healthy_baseline["available"] is False, report.healthy_baseline
    assert report.healthy_baseline["healthy_windows"] == 0
    # no window ends 5 errors (error_spike's min_errors): the whole range is judged instead
    f = next(f for f in report.findings if f.rule_id == "error_spike")
    assert "over the whole range" in f.summary and f.evidence["errors"] >= 5
    assert f.evidence["errors"] == sum(f.evidence["errors_by_type"].values())
    assert 0.2 <= f.evidence["error_rate"] <= 0.6
