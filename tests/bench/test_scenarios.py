"""Symptom scenarios on the real engine (`make scenarios` runs them all live). Each starts a real
server, drives `tokenmill bench`, and the diagnoser must name the expected rule as its top finding
(healthy: nothing). CI diagnoses the fast ones' recorded real-engine runs (`make scenario-dumps`)
and runs one of them live."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from server_proc import wait_for_quiet_host

from tokenmill.bench.corpus import load_runs
from tokenmill.bench.scenario import (
    ScenarioError,
    list_scenarios,
    load,
    run,
    server_launch,
    verdict,
)

# the scenarios that take up to ~90 s each on a quiet 2-core VM (about 9 minutes together, so
# CI reads their recorded runs since 2026-12-04). `make scenarios` runs these
# and the slow ones: kv_pressure_preemption (~3 minutes), batch_too_large (~3 minutes: 64
# rows of 1,000-token contexts), midstream_stall (~130 s) and queueing_overload (~130 s; its
# traffic is the demo's tour, and tests/bench/test_demo.py checks that `overload` comes first there)
# and spec_decode_healthy (~60 s; speculation where it pays, nothing fires). Two more run
# there only, to keep CI under 45 minutes: ttft_queueing (~100 s, five 15 s load steps),
# error_spike (~45 s; tests/diagnose/test_diagnose_no_baseline.py runs its drill on the real engine
# and checks the rule fires), replica_imbalance / replica_balanced (~45 s each, two
# replicas; tests/engine/test_data_parallel.py runs the real replicas, test_diagnose_rules.py the rule)
# and tp_communication_bound / tp_dp_same_traffic / rank_straggler (~45-60 s each: three
# ranks, two replicas, three ranks with one held back). periodic_itl_spikes (~75 s) runs there
# only since 2026-12-02: with a neighbour on this VM (others 34 % of the CPU, steal 4 %) its
# hogs' spikes were lost in the noise in three runs in a row, host_contention the only
# finding; test_diagnose_rules.py keeps its rule covered. kv_transfer_bound / pd_healthy /
# pd_decode_starved (~40 s each: a prefill and a decode core, pinned) run there too;
# test_disaggregation.py runs the real disaggregated server, test_diagnose_rules.py the rules;
# pd_ratio_imbalance (~35 s, the same two cores) runs here. The symptoms the labelled corpus
# scores (tests/diagnose/test_diagnosis_corpus.py: real-engine runs of each family, diagnosed in
# seconds) run there only too, to keep CI under 40 minutes: healthy (~140 s), host_contention,
# head_of_line_blocking, prefix_cache_miss and itl_prefill_interference (~50-80 s each).
CORPUS_COVERED = [
    "healthy",
    "head_of_line_blocking",
    "host_contention",
    "itl_prefill_interference",
    "prefix_cache_miss",
]
FAST = [
    "batching_ineffective",
    "client_server_ttft_gap",
    "host_bound_steps",
    "itl_frontend_overhead",
    "kv_block_leak",
    "kv_pressure_long_answers",
    "oom_low_average_memory",
    "pd_decode_starved",
    "pd_ratio_imbalance",
    "quantization_decode_heavy",
    "quantization_no_gain",
    "replica_imbalance",
    "spec_decode_ineffective",
    "ttft_prefill_bound",
]
# FAST's real-engine runs, recorded (`make scenario-dumps`): CI diagnoses these in seconds and
# runs one scenario live
DUMPS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "scenario_dumps"
RECORDED = load_runs(DUMPS)
LIVE = "quantization_decode_heavy"


def test_scenario_files_are_well_formed():
    names = {s.name for s in list_scenarios()}
    assert set(FAST) <= names and set(CORPUS_COVERED) <= names
    # what is left to the corpus is a family's first expected rule there (healthy: a family
    # that expects nothing)
    from tokenmill.bench.corpus import FAMILIES

    scored = {f.expect[0] if f.expect else "healthy" for f in FAMILIES.values()}
    assert set(CORPUS_COVERED) <= scored, set(CORPUS_COVERED) - scored
    for sc in list_scenarios():
        assert sc.steps and all(step for step in sc.steps)
    with pytest.raises(ScenarioError, match="unknown scenario 'nope'"):
        load("nope")
    # every rule a scenario expects or rules out exists; only rule-free scenarios rule out
    from tokenmill.diagnose.rules import RULES_BY_ID

    for sc in list_scenarios():
        assert set(sc.expect) | set(sc.absent) <= set(RULES_BY_ID), sc.name
        assert not (sc.expect and sc.absent), sc.name
    assert load("quantization_decode_heavy").absent == ["quantization_no_gain"]


def test_host_load_drills_are_parsed_and_checked():
    from tokenmill.bench.scenario import _host_load

    hc = load("host_contention").host_load
    assert hc == [
        {"start_s": 20.0, "duration_s": 20.0, "procs": 4, "every_s": None, "busy_s": None}
    ]
    periodic = load("periodic_itl_spikes").host_load[0]
    assert (periodic["every_s"], periodic["busy_s"]) == (6.0, 1.5)
    assert load("healthy").host_load == []
    for bad, needle in (
        ({"duration_s": 0}, "duration_s > 0"),
        ({"duration_s": 5, "procs": 0}, "procs >= 1"),
        ({"duration_s": 5, "every_s": 2}, "0 < busy_s <= every_s"),
        ({"duration_s": 5, "every_s": 2, "busy_s": 3}, "0 < busy_s <= every_s"),
        ({"duration_s": 5, "cores": 2}, "unknown key(s) cores"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            _host_load(bad)
    with pytest.raises(KeyError):
        _host_load({"start_s": 1})


def test_scenario_list_is_one_line_per_scenario():
    """`make scenarios` runs the first column of each line: no wrapped continuation lines."""
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "scenario", "list"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "60"},
    )
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    assert names == sorted(s.name for s in list_scenarios())


def test_out_that_cannot_be_a_folder_is_one_line_exit_2(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out in (afile, afile / "sub"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenmill.engine.cli",
                "scenario",
                "run",
                "healthy",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert f"--out {out}: cannot make the folder" in lines[0]
    assert afile.read_text() == "keep me"


def test_unknown_scenario_is_one_line_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "scenario", "run", "nope"],
        capture_output=True,
        text=True,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "unknown scenario 'nope'" in lines[0]


def test_server_gets_absolute_paths_from_a_relative_out(tmp_path, monkeypatch):
    """Issue 19 item 11: the server runs with cwd=out, so a relative --out (the default,
    tokenmill-data/scenarios/NAME), --model or $TOKENMILL_HOME must be made absolute against
    the caller's working directory first; before, the server got out/out/traces.duckdb."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENMILL_HOME", "home")
    cmd, cwd, env = server_launch(load("healthy"), Path("runs/healthy"), 8123, "models/m")
    assert cwd == tmp_path / "runs" / "healthy"
    assert cmd[cmd.index("--trace-db") + 1] == str(tmp_path / "runs" / "healthy" / "traces.duckdb")
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "models" / "m")
    assert env["TOKENMILL_HOME"] == str(tmp_path / "home")
    assert cmd[cmd.index("--port") + 1] == "8123"


@pytest.mark.slow
def test_a_live_scenario_names_the_expected_rule(tmp_path, smollm2_dir, monkeypatch):
    """The whole path on the real engine, once: server, ``tokenmill bench``, the client's
    results recorded beside the server's, the diagnosis, result.json (the fastest of FAST,
    ~20 s). A relative --out from another working directory, as `tokenmill scenario run NAME`
    gives by default (tokenmill-data/scenarios/NAME): the server, run in that folder, must
    still find its store (issue 19 item 11)."""
    name = LIVE
    monkeypatch.chdir(tmp_path)
    wait_for_quiet_host()
    result = run(name, Path("tokenmill-data") / name, model=str(smollm2_dir), log=lambda m: None)
    contended = result["top"] == "host_contention" and "host_contention" not in result["expect"]
    if contended and not result["passed"]:
        # the rule was right: something outside the server took the CPU mid-run (two CI runs
        # of 2026-12-02 saw 23-32 % for seconds, the engine's steps 1.6-1.7x slower); the
        # scenarios assert their own symptom on an otherwise quiet host, so a contended run
        # is run once more
        wait_for_quiet_host()
        result = run(
            name, Path("tokenmill-data") / name, model=str(smollm2_dir), log=lambda m: None
        )
    assert (tmp_path / "tokenmill-data" / name / "result.json").is_file()
    # the run's own figures with the findings: a CI failure must say what the run looked like
    assert result["passed"], (
        result["top"],
        result["absent"],
        [f["rule"] for f in result["findings"]],
        result["findings"][:2],
        result["summary"],
    )
    # the client's own TTFT, recorded into the server's store beside its own
    con = duckdb.connect(str(tmp_path / "tokenmill-data" / name / "traces.duckdb"), read_only=True)
    try:
        (with_client_ttft,) = con.execute(
            "SELECT count(*) FROM requests WHERE client_ttft_ms > 0"
        ).fetchone()
    finally:
        con.close()
    assert with_client_ttft > 0


def test_recorded_scenarios_cover_fast_and_match_their_definitions():
    recorded = {label["id"]: label for label, _ in RECORDED}
    assert set(recorded) == set(FAST), set(FAST) ^ set(recorded)
    for name, label in recorded.items():
        sc = load(name)
        # a scenario whose expectation changed since its recording must be recorded again
        assert (label["expect"], label.get("absent", [])) == (sc.expect, sc.absent), name
        assert label["window"] == sc.window, name


@pytest.mark.parametrize("name", FAST)
def test_fast_scenario_names_the_expected_rule(name):
    """The diagnoser on each FAST scenario's real-engine run (recorded by `make
    scenario-dumps`, benchmarks/data/scenario_dumps; `make scenarios` runs them live): the
    expected rule is the top finding, with its evidence."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.telemetry.dump import open_dump, parse_duration

    label, dump = {lb["id"]: (lb, d) for lb, d in RECORDED}[name]
    con = open_dump(dump, verify=False)
    try:
        report = diagnose(con, window_s=parse_duration(label["window"]))
    finally:
        con.close()
    found = [f.rule_id for f in report.findings]
    assert verdict(label["expect"], label.get("absent", []), found), (
        label["expect"],
        label.get("absent"),
        found,
        [f.evidence for f in report.findings[:2]],
        report.summary,
    )
    if label["expect"]:
        top = report.findings[0]
        assert top.evidence, top
    if name == "pd_decode_starved":
        # the decode side's shortage first; the streams it preempted stall as its consequence
        assert top.rule_id == "pd_ratio_imbalance", found
        assert top.evidence["bottleneck"] == "decode", top.evidence
    if name == "kv_pressure_long_answers":
        # the chain: the pool's preemptions, then the preempted requests' prefill computed again
        # beside the running decodes; those steps are the pool's, not prefill interference
        assert top.rule_id == "kv_pressure_preemption", found
        assert top.evidence["recompute_steps"] >= 1, top.evidence
        assert top.evidence["recompute_step_tokens"] >= 100, top.evidence
        assert top.evidence["recompute_stalled_streams"] >= 1, top.evidence
        assert "itl_prefill_interference" not in found, found
    if name == "itl_frontend_overhead":
        # the API's own measure of the drill: each step's outputs waited >= 500 ms in the
        # streams (engine_steps.stream_write_ms)
        assert top.evidence["stream_write_ms_mean"] >= 500, top.evidence
