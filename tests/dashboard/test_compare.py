"""``tokenmill diagnose --baseline BEFORE AFTER`` and the console's Compare page on real engine
runs: five short ``tokenmill serve`` + ``tokenmill bench`` runs of the default model (three
identical ones on default flags, one with ``--max-num-seqs 2``, one with 4× longer prompts in
an open loop), each run's trace store being its dump.

What must hold: the flag change is named with the TTFT rise and the throughput drop it caused;
different traffic reads as not comparable; identical runs raise no alarm (three pairs); bad
input is one line and exit 2; the Compare page renders two real dumps in Chromium with the
config difference shown and an AFTER trace id that opens its waterfall.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest
from server_proc import Server, free_port, wait_for_quiet_host

from tokenmill.dashboard import data
from tokenmill.diagnose.compare import DEFAULT_REGRESSION_PCT

# the five runs take about 2 minutes alone and 25 on a VM shared with other engines: the first
# test (which builds them) gets 40 minutes, not pytest-timeout's 900 s
# six server runs: a whole-product check, in `make test-e2e` (not `make test`)
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(2400)]

# closed loop, 12 in flight: with --max-num-seqs 2 ten of them queue for a turn (with 4, two
# thirds queued and TTFT p50 rose by less than the gate in one clean-clone run: p99 +87 %)
BENCH = ("--concurrency", "12", "--num-requests", "24", "--prompt-tokens", "60",
         "--output-tokens", "32", "--seed", "1")  # fmt: skip
# other traffic: 4x the prompt, an open loop at 4 requests/s
OTHER_TRAFFIC = ("--request-rate", "4", "--num-requests", "24", "--prompt-tokens", "240",
                 "--output-tokens", "32", "--seed", "2")  # fmt: skip
# run order: the regression right after its baseline, the identical runs spread over the session
RUNS = {
    "base1": ((), BENCH),
    "seqs4": (("--max-num-seqs", "2"), BENCH),
    "base2": ((), BENCH),
    "traffic": ((), OTHER_TRAFFIC),
    "base3": ((), BENCH),
}
IDENTICAL = [("base1", "base2"), ("base2", "base3"), ("base1", "base3")]
APP = Path(data.__file__).parent / "app.py"


def tm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """name → the trace store of a finished real run (server stopped, store closed)."""
    out = {}
    # a throwaway first run: the first server and client of a fresh clone pay one-off costs
    # (bytecode, page cache) that must not land in base1
    runs_in_order = {"warmup": ((), (*BENCH[:2], "--num-requests", "4", *BENCH[4:])), **RUNS}
    for name, (flags, bench) in runs_in_order.items():
        wait_for_quiet_host()
        folder = tmp_path_factory.mktemp(name)
        db = folder / "traces.duckdb"
        server = Server(folder, "--model", str(smollm2_dir), "--trace-db", str(db), *flags)
        try:
            r = tm("bench", "--url", server.url, *bench, "--no-progress")
            assert r.returncode == 0, r.stdout + r.stderr
        finally:
            server.stop()
        out[name] = db
    del out["warmup"]
    return out


def compare_json(runs, before: str, after: str, *extra: str) -> tuple[int, dict]:
    r = tm("diagnose", "--baseline", str(runs[before]), str(runs[after]), "--format", "json",
           *extra)  # fmt: skip
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


HOST_CHECKS = {"cpu_left_pct", "decode_step_ms"}


def quiet_host(rep: dict) -> None:
    """The runs must be comparable, and the one way they may not be is a host that changed
    between them: other processes loaded it differently (engineers sharing the 2-core
    machine), or the same decode step ran at another speed (a neighbouring VM; CI 2026-12-04:
    +17 % with equal CPU left). Then the verdict is ``not_comparable`` because of the host
    alone, and the test that needs a comparable pair skips, naming the figures."""
    if rep["comparable"]:
        return
    assert set(rep["not_comparable_because"]) <= HOST_CHECKS, rep["checks"]
    moved = [c for c in rep["checks"] if c["key"] in HOST_CHECKS and not c["ok"]]
    pytest.skip(
        "; ".join(f"{c['label']} {c['before']:.0f} -> {c['after']:.0f}" for c in moved)
        + " between the runs: not comparable, no verdict to check"
    )


def loaded_host(rep: dict, min_left_pct: float = 67.0) -> None:
    """Identical runs are evidence of "no alarm" only on a host that left the server most of
    its CPU in both: a neighbour taking a third of it during one run (CI 2026-12-02: 65 % left
    in base1, 94 % in seqs4) moves TTFT by more than the gate while the pair still reads as
    comparable. Skips, naming the figures."""
    host = next((c for c in rep["checks"] if c["key"] == "cpu_left_pct"), None)
    if host is None or host["before"] is None or host["after"] is None:
        return
    if min(host["before"], host["after"]) < min_left_pct:
        pytest.skip(
            f"host CPU left to the server {host['before']:.0f} % -> {host['after']:.0f} %: "
            f"a neighbour took over {100 - min_left_pct:.0f} % in a run, no verdict to check"
        )


def shift(report: dict, key: str) -> dict:
    return next(s for s in report["latency"] + report["throughput"] if s["key"] == key)


def test_max_num_seqs_2_is_named_with_the_ttft_rise_and_throughput_drop(runs):
    code, rep = compare_json(runs, "base1", "seqs4")
    assert code == 0  # no --fail-on-regression: the report alone never fails
    flags = [c for c in rep["config_diff"] if c["kind"] == "flag"]
    assert flags == [
        {"key": "max_num_seqs", "kind": "flag", "before": 64, "after": 2, "name": "--max-num-seqs"}
    ], rep["config_diff"]
    md = tm("diagnose", "--baseline", str(runs["base1"]), str(runs["seqs4"]), "--format",
            "markdown")  # fmt: skip
    assert "| --max-num-seqs | flag | 64 | 2 |" in md.stdout
    assert "TTFT p99 (gated)" in md.stdout
    # the figures only mean something when the report calls the runs comparable (in one CI
    # run a loaded host made the baseline's throughput lower than --max-num-seqs 4's)
    quiet_host(rep)
    ttft, tput = shift(rep, "ttft_p99_ms"), shift(rep, "throughput_tok_s")
    assert ttft["after"] > ttft["before"] and ttft["change_pct"] > 0, ttft
    assert shift(rep, "ttft_p50_ms")["change_pct"] > 0
    assert tput["after"] < tput["before"] and tput["change_pct"] < 0, tput
    # the queue is where the time went: the schedule station (waiting for a turn) grew
    assert (
        rep["stations"]["schedule"]["p99"]["after"] > rep["stations"]["schedule"]["p99"]["before"]
    )
    assert rep["verdict"] == "regression" and "ttft_p99_ms" in rep["regressions"], (ttft, tput)
    text = tm("diagnose", "--baseline", str(runs["base1"]), str(runs["seqs4"]))
    assert text.returncode == 0, text.stderr
    assert "REGRESSION" in text.stdout and "--max-num-seqs" in text.stdout


def test_fail_on_regression_exits_1_on_the_regression_0_on_identical_runs(runs):
    pct = f"{DEFAULT_REGRESSION_PCT:g}"
    for before, after in IDENTICAL:
        code, rep = compare_json(runs, before, after, "--fail-on-regression", pct)
        loaded_host(rep)
        assert code == 0, (before, after, rep["latency"], rep["throughput"])
        assert rep["regressions"] == []
    code, rep = compare_json(runs, "base1", "seqs4", "--fail-on-regression", pct)
    quiet_host(rep)
    assert code == 1, rep["verdict"]


@pytest.mark.parametrize(("before", "after"), IDENTICAL)
def test_identical_runs_raise_no_alarm(runs, before, after):
    code, rep = compare_json(runs, before, after)
    assert code == 0
    changes = {s["key"]: s["change_pct"] for s in rep["latency"] + rep["throughput"]}
    loaded_host(rep)
    assert rep["regressions"] == [], changes
    assert rep["config_diff"] == []
    quiet_host(rep)
    assert rep["verdict"] == "no_regression", (rep["checks"], changes)


def test_other_traffic_is_not_comparable_and_does_not_gate(runs):
    code, rep = compare_json(runs, "base1", "traffic", "--fail-on-regression", "10")
    assert code == 0  # documented: no gate on runs that are not comparable
    assert rep["verdict"] == "not_comparable" and not rep["comparable"]
    assert {"prompt_tokens_p50", "prompt_tokens_p99"} <= set(rep["not_comparable_because"])
    prompt = next(c for c in rep["checks"] if c["key"] == "prompt_tokens_p50")
    assert prompt["after"] > 2.5 * prompt["before"], prompt
    assert rep["regressions"] == []
    text = tm("diagnose", "--baseline", str(runs["base1"]), str(runs["traffic"]))
    assert "NOT COMPARABLE" in text.stdout and "prompt tokens p50" in text.stdout
    assert "not evidence" in text.stdout


def _one_line_exit_2(r: subprocess.CompletedProcess, needle: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    good = str(runs["base1"])
    missing = str(tmp_path / "missing.duckdb")
    _one_line_exit_2(tm("diagnose", "--baseline", missing, good), "--baseline")
    _one_line_exit_2(tm("diagnose", "--baseline", good, missing), "no such file")
    other = tmp_path / "other-version.duckdb"
    other.write_bytes(runs["base2"].read_bytes())
    with duckdb.connect(str(other)) as con:
        con.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    _one_line_exit_2(tm("diagnose", "--baseline", str(other), good), "schema version 3")
    _one_line_exit_2(tm("diagnose", "--baseline", good, str(other)), "schema version 3")
    _one_line_exit_2(tm("diagnose", "--baseline", good, good, good), "exactly one AFTER")
    _one_line_exit_2(tm("diagnose", "--fail-on-regression", "10", good), "needs --baseline")


def test_compare_page_under_apptest(monkeypatch, runs):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("TOKENMILL_DASHBOARD_SOURCE", str(runs["seqs4"]))
    monkeypatch.setenv("TOKENMILL_DASHBOARD_BASELINE", str(runs["base1"]))
    at = AppTest.from_file(str(APP), default_timeout=300)
    at.run()
    at.switch_page("views/compare.py")
    at.run()
    assert not at.exception, at.exception
    verdicts = [e.value for e in (*at.error, *at.warning, *at.success)]
    assert any(v.startswith(("REGRESSION", "NOT COMPARABLE")) for v in verdicts), verdicts
    config = at.table[0].value  # one row per differing setting, indexed by its name
    assert list(config.index) == ["--max-num-seqs"], config
    assert (config["BEFORE"].iloc[0], config["AFTER"].iloc[0]) == ("64", "2")
    assert len(at.get("plotly_chart")) >= 3  # stations, request latency, a BEFORE waterfall
    links = [pl.proto for pl in at.get("page_link")]
    with duckdb.connect(str(runs["seqs4"]), read_only=True) as con:
        slowest = [t for (t,) in con.execute(
            "SELECT trace_id FROM requests ORDER BY ttft_ms DESC LIMIT 3").fetchall()]  # fmt: skip
    assert [x.query_string for x in links if x.page == "requests"][-3:] == [
        f"trace={t}" for t in slowest
    ]


@pytest.fixture
def console(runs, tmp_path):
    port = free_port()
    log = open(tmp_path / "dashboard.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "dashboard", "--source", str(runs["seqs4"]),
         "--baseline", str(runs["base1"]), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
            try:
                if httpx.get(url + "/_stcore/health", timeout=2).text.strip() == "ok":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the console did not come up"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the CLI and the streamlit process it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        # whatever of the group is left (a Streamlit that outlived its CLI: one per clean-clone
        # run was found still serving, orphaned, hours later)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_compare_page_in_headless_chromium(console, runs, tmp_path):
    from playwright.sync_api import sync_playwright
    from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, _settle

    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run `make chromium`"
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{console}/compare", wait_until="domcontentloaded")
            _settle(page, shots, "compare", min_charts=2)
            assert page.get_by_text("Config difference").count() == 1
            table = page.locator('[data-testid="stTable"]').first
            assert table.get_by_text("--max-num-seqs").count() == 1
            verdict = page.locator('[data-testid="stAlert"]').first.inner_text()
            assert verdict.startswith(("REGRESSION", "NOT COMPARABLE")), verdict
            stations = page.locator(".js-plotly-plot", has_text="Station span times")
            assert stations.locator("g.legend text", has_text="BEFORE").count() == 1
            assert stations.locator("g.legend text", has_text="AFTER").count() == 1
            # an AFTER example trace opens its waterfall on the Requests page
            link = page.locator('a[data-testid="stPageLink-NavLink"][href*="trace="]:visible').last
            link.scroll_into_view_if_needed()
            href = link.get_attribute("href")
            trace_id = href.split("trace=")[1]
            link.click()
            page.wait_for_url(lambda u: "/requests?" in u and f"trace={trace_id}" in u,
                              timeout=60_000)  # fmt: skip
            _settle(page, shots, "compare-trace-waterfall")
            with duckdb.connect(str(runs["seqs4"]), read_only=True) as con:
                (request_id,) = con.execute(
                    "SELECT request_id FROM requests WHERE trace_id = ?", [trace_id]
                ).fetchone()
            assert page.get_by_text(f"Request {request_id}").count() == 1
        finally:
            browser.close()
