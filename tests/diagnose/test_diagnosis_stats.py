"""The statistics behind a finding (diagnose/stats.py), the host's process census
(telemetry/host_procs.py) and what they change in a report: inconclusive items on thin
evidence, the load generator apart from a noisy neighbour."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import duckdb
import numpy as np
import pytest
from synth_store import Phase, write_store

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.stats import (
    Support,
    against_bound,
    calibrated,
    compare,
    median_ratio_ci,
)
from tokenmill.telemetry.host_procs import ProcessCensus, is_load_generator

HEALTHY_HOST = Phase(duration_s=40)


def test_bootstrap_interval_covers_the_true_ratio_and_narrows_with_n():
    rng = np.random.default_rng(1)
    widths = []
    for n in (5, 50, 500):
        sym = rng.lognormal(np.log(400), 0.3, n)  # median 400
        ref = rng.lognormal(np.log(100), 0.3, n)  # median 100: true ratio 4
        effect, lo, hi = median_ratio_ci(sym, ref, seed=n)
        assert lo < 4.0 < hi, (n, lo, hi)
        assert lo <= effect <= hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2], widths


def test_a_million_requests_are_thinned_before_resampling():
    """A store of a million requests must not resample a 2,000 x 1,000,000 array (12 GiB):
    each sample is thinned to MAX_RESAMPLED values first, and the interval still holds."""
    rng = np.random.default_rng(3)
    sym = rng.lognormal(np.log(300), 0.4, 1_000_000)
    ref = rng.lognormal(np.log(100), 0.4, 800_000)
    effect, lo, hi = median_ratio_ci(sym, ref)
    assert lo < 3.0 < hi and hi - lo < 0.2, (effect, lo, hi)


def test_verdicts():
    # two requests 20x their reference: conclusive, effect and interval stated
    sup = compare([8000, 9000], [400, 420, 390, 410], unit="requests", reference_name="ref",
                  min_effect=5)  # fmt: skip
    assert sup.verdict == "conclusive" and sup.effect == pytest.approx(8500 / 405)
    assert sup.ci_low >= 5 and "95% CI" in sup.line() and "2 requests" in sup.line()
    # one request is not enough
    one = compare([8000], [400, 420, 390], unit="requests", reference_name="ref", min_effect=5)
    assert one.verdict == "inconclusive" and "1 requests behind it, 2 needed" in one.reason
    # an interval reaching below the rule's threshold: inconclusive, saying so
    wide = compare([300, 9000], [400, 420, 390], unit="requests", reference_name="ref",
                   min_effect=5)  # fmt: skip
    assert wide.verdict == "inconclusive" and "below the 5x" in wide.reason
    # against an absolute bound
    share = against_bound([0.9, 0.8, 0.95], 0.5, unit="requests", reference_name="half of TTFT")
    assert share.verdict == "conclusive" and share.effect == pytest.approx(1.8)


def test_calibrated_confidence_rises_with_margin_and_size():
    def conf(sym, ref):
        return calibrated(
            compare(sym, ref, unit="requests", reference_name="r", min_effect=2), 0.95
        )

    ref = [100, 105, 98, 110, 102, 99]
    low = conf([230, 240], ref)
    high_margin = conf([900, 950], ref)
    high_size = conf([230, 240, 235, 238, 236, 233, 231, 239], ref)
    assert low < high_margin and low < high_size, (low, high_margin, high_size)
    assert high_margin <= 0.95
    thin = Support(n=1, unit="requests", reference="r", verdict="inconclusive")
    assert calibrated(thin, 0.9) <= 0.5


def test_load_generator_commands():
    assert is_load_generator(["/x/.venv/bin/tokenmill", "bench", "--url", "u"])
    assert is_load_generator(["python", "-m", "tokenmill.engine.cli", "bench", "--url", "u"])
    assert is_load_generator(["tokenmill", "scenario", "run", "healthy"])
    # the noisy-neighbour drill stands in for someone else's job
    assert not is_load_generator(["python", "-m", "tokenmill.bench.cpu_hog", "--procs", "2"])
    assert not is_load_generator(["tokenmill", "serve"])
    assert not is_load_generator(["stress", "--cpu", "2"])


def test_census_names_a_busy_process_outside_the_server():
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"]
    )
    try:
        census = ProcessCensus(refresh_s=0.0)
        census.read(set())
        time.sleep(1.0)
        loadgen, busy = census.read(set())
        rows = json.loads(busy)
        mine = [d for d in rows if d["pid"] == spin.pid]
        assert mine and mine[0]["cpu_pct"] > 10 and not mine[0]["load_generator"], rows
        assert loadgen is not None and loadgen < 5
        # the server's own pids are left out
        _, busy = census.read({spin.pid})
        time.sleep(0.5)
        _, busy = census.read({spin.pid})
        assert spin.pid not in {d["pid"] for d in json.loads(busy)}
    finally:
        spin.kill()
        spin.wait()


def test_census_counts_a_process_from_its_start():
    # a process born between two listings is busy right at its start (a client starting, a
    # short cron job): its CPU since birth counts in the first listing after it
    census = ProcessCensus(refresh_s=0.0)
    census.read(set())
    time.sleep(0.3)
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"]
    )
    try:
        time.sleep(1.0)
        _, busy = census.read(set())
        mine = [d for d in json.loads(busy) if d["pid"] == spin.pid]
        assert mine and mine[0]["cpu_pct"] > 10, busy
    finally:
        spin.kill()
        spin.wait()


def test_thin_evidence_is_inconclusive_not_a_finding(tmp_path):
    """One request in a dump of sixteen waited 5 s in the queue: the symptom is there, but one
    request cannot carry a finding; it is listed apart, and the report stays healthy."""
    few = Phase(duration_s=12, rate_per_s=0.5, prompt_tokens=(40, 60))
    stuck = few.but(duration_s=4, queue_ms=5000)
    path = tmp_path / "few.duckdb"
    write_store(path, [few, stuck, few], seed=5)
    con = duckdb.connect(str(path), read_only=True)
    try:
        slow = con.execute("SELECT count(*) FROM requests WHERE queue_ms > 1000").fetchone()[0]
        report = diagnose(con, window_s=5)
    finally:
        con.close()
    assert slow == 1
    assert report.findings == [] and report.to_json()["status"] == "healthy"
    inc = {f.rule_id: f for f in report.inconclusive}
    assert "ttft_queueing" in inc, report.inconclusive
    sup = inc["ttft_queueing"].support
    assert sup["verdict"] == "inconclusive" and sup["n"] == 1 and sup["effect"] > 10, sup
    assert "2 needed" in sup["reason"]
    assert report.to_json()["inconclusive"][0]["rule"] == "ttft_queueing"


def test_the_load_generator_is_a_validity_note_not_a_neighbour(tmp_path):
    """The same slowed steps and busy CPU as the host_contention symptom, once from a stranger
    and once from tokenmill's own load generator (the host samples' census says which)."""
    run = [HEALTHY_HOST, HEALTHY_HOST.but(duration_s=30, step_ms=100, cpu_others_pct=60)]
    stranger = tmp_path / "stranger.duckdb"
    ours = tmp_path / "ours.duckdb"
    for path, loadgen in ((stranger, False), (ours, True)):
        write_store(path, run, seed=2)
        con = duckdb.connect(str(path))
        busy = json.dumps(
            [{"pid": 4242, "command": "tokenmill bench --url http://127.0.0.1:8000"
              if loadgen else "stress --cpu 2", "cpu_pct": 55.0, "load_generator": loadgen}]
        )  # fmt: skip
        con.execute(
            "UPDATE device_samples SET busy_others = ?, loadgen_cpu_pct = ? "
            "WHERE cpu_others_pct >= 30",
            [busy, 55.0 if loadgen else 0.0],
        )
        con.close()
    con = duckdb.connect(str(stranger), read_only=True)
    report = diagnose(con)
    con.close()
    (f,) = [f for f in report.findings if f.rule_id == "host_contention"]
    assert f.evidence["busy_processes"][0]["command"] == "stress --cpu 2"
    assert "pid 4242 `stress --cpu 2`" in f.summary
    con = duckdb.connect(str(ours), read_only=True)
    report = diagnose(con)
    con.close()
    assert "host_contention" not in {f.rule_id for f in report.findings}
    (note,) = [n for n in report.notes if n.rule_id == "host_contention"]
    assert note.summary.startswith("benchmark validity: the load generator")
    assert note.evidence["load_generator_cpu_pct"] >= 50
    assert note.evidence["same_work_slowdown"] >= 1.5
    assert note.evidence["load_generator_processes"][0]["pid"] == 4242
