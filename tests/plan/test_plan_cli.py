"""``tokenmill plan`` on a recording of the real engine behind a real server, and its one-line
refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from tokenmill.plan.cli import app, run

MODEL = "smollm2-135m-instruct"
PREFIX = list(range(2000, 2064))  # four KV blocks every "chat" request starts with


@pytest.fixture(scope="module")
def recording(tmp_path_factory, smollm2_dir):
    """One server with a 48-block pool and 6 running at most; 18 requests in three waves
    (two thirds start with the same 64 tokens), enough decode to preempt."""
    import asyncio

    import httpx
    from server_proc import Server

    tmp = tmp_path_factory.mktemp("plan_real")
    db = tmp / "traces.duckdb"
    server = Server(
        tmp, "--model", str(smollm2_dir), "--trace-db", str(db),
        "--num-gpu-blocks-override", "48", "--max-num-seqs", "6",
    )  # fmt: skip

    async def send(ac, i):
        own = list(range(5000 + 300 * i, 5000 + 300 * i + 40 + 7 * i))
        prompt = PREFIX + own if i % 3 else own
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24 + i, "ignore_eos": True}
        r = await ac.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    async def load():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ac:
            for wave in range(3):
                await asyncio.gather(*(send(ac, 6 * wave + k) for k in range(6)))
                await asyncio.sleep(0.3)

    try:
        asyncio.run(load())
        import time

        time.sleep(1.0)  # the last rows reach the store
    finally:
        server.stop()
    return db


def copy_store(src, dst) -> duckdb.DuckDBPyConnection:
    """A writable copy of the store ``src`` at ``dst``, open."""
    con = duckdb.connect(str(dst))
    con.execute(f"ATTACH '{src}' AS src (READ_ONLY)")
    for (name,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = 'src'"
    ).fetchall():
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM src.{name}")
    con.execute("DETACH src")
    return con


def test_the_recording_replayed_as_it_was(recording):
    doc = json.loads(run(recording, ["max_num_seqs=2"], None, False, 1.0, [], "json"))
    con = duckdb.connect(str(recording), read_only=True)
    rec_tokens, rec_hits, rec_preempt = con.execute(
        "SELECT sum(output_tokens), sum(cached_tokens), sum(preemptions) FROM requests"
    ).fetchone()
    (rec_steps,) = con.execute(
        "SELECT count(*) FROM engine_steps WHERE num_prefill_tokens + num_decode_tokens > 0"
    ).fetchone()
    con.close()
    same, fewer = doc["predictions"]
    assert same["what_if"] == "as recorded"
    assert same["summary"]["completed"] == 18 == doc["measured"]["completed"]
    assert same["replay"]["throughput_tok_s"] > 0
    # the scheduler makes the recording's decisions: the same tokens in about as many steps
    assert rec_steps * 0.65 <= same["replay"]["steps"] <= rec_steps * 1.35
    # the shared 64-token head is served from the cache in the replay too
    assert rec_hits > 0 and same["replay"]["prefix_hit_tokens"] > 0
    if rec_preempt:
        assert same["replay"]["preemptions"] > 0
    # two running at most: a longer queue, fewer running, TTFT up
    assert fewer["replay"]["running_mean"] <= 2.0
    assert fewer["replay"]["waiting_mean"] > same["replay"]["waiting_mean"]
    assert fewer["summary"]["ttft_p50_ms"] > same["summary"]["ttft_p50_ms"]
    assert sum(doc["step_cost"]["steps"].values()) > 0
    assert rec_tokens == sum(range(24, 24 + 18))


def test_the_error_estimate_gives_goodput_in_points_and_latencies_in_percent():
    """The error estimate's goodput error is a difference of shares (points), the latencies'
    a relative error (%)."""
    from tokenmill.plan.report import _err

    assert _err(-4.0, "goodput_share") == "-4 pts"
    assert _err(12.4, "ttft_p50_ms") == "+12%"
    assert _err(None, "goodput_share") == "–"


def test_text_report_names_the_columns_and_the_error_estimate(recording):
    text = run(recording, ["rate=2"], "ttft_p99<50ms", False, 1.0, [], "text")
    assert "as recorded" in text and "rate=2" in text
    flat = " ".join(text.split())  # the report wraps at the terminal's width
    assert "Error estimate" in text
    assert "SLO ttft_p99<50ms" in text and "missed" in text
    # goodput's per-request bounds: the SLO's TTFT, the defaults for ITL p99 and E2E
    assert "own TTFT ≤ 50.0 ms, ITL p99 ≤ 200 ms and E2E ≤ 60,000 ms" in flat


def test_a_slower_host_is_a_what_if(recording):
    doc = json.loads(run(recording, ["step_time=1.5"], None, False, 1.0, [], "json"))
    same, slower = doc["predictions"]
    assert any("x1.5 the time" in n for n in slower["notes"])
    # every step half as long again: each request's decodes too (its batches may differ)
    ratio = slower["summary"]["itl_p50_ms"] / same["summary"]["itl_p50_ms"]
    assert 1.3 < ratio < 1.8
    assert slower["summary"]["e2e_p50_ms"] > same["summary"]["e2e_p50_ms"]


def test_a_check_against_the_run_takes_the_hosts_pace_apart(recording, tmp_path):
    """The recording checked against itself: no pace to speak of, and the errors are the
    as-recorded replay's. Against a copy whose steps each took 1.4x as long: that pace, and the
    prediction again at it."""
    doc = json.loads(run(recording, [], None, False, 1.0, [], "json", check_run=recording))
    c = doc["check"]
    assert c["what_if"] == "as recorded" and c["run"] == str(recording)
    assert c["requests"] == {"measured": 18, "planned": 18}
    same = doc["predictions"][0]["summary"]
    assert c["errors_pct"]["ttft_p50_ms"] == pytest.approx(
        (same["ttft_p50_ms"] - c["measured"]["ttft_p50_ms"]) / c["measured"]["ttft_p50_ms"] * 100
    )
    assert 0.85 < c["pace"] < 1.15 and c["pace_steps"] > 40
    slow = tmp_path / "slow.duckdb"
    con = copy_store(recording, slow)
    con.execute(
        "UPDATE engine_steps SET end_ns = start_ns + CAST((end_ns - start_ns) * 1.4 AS BIGINT), "
        "forward_ms = forward_ms * 1.4"
    )
    con.close()
    doc = json.loads(run(recording, ["max_num_seqs=2"], None, False, 1.0, [], "json",
                         check_run=slow))  # fmt: skip
    c = doc["check"]
    assert c["what_if"] == "max_num_seqs=2"
    assert c["pace"] == pytest.approx(1.4 * (
        json.loads(run(recording, [], None, False, 1.0, [], "json", check_run=recording))
        ["check"]["pace"]), rel=0.03)  # fmt: skip
    again = c["at_pace"]
    assert again["what_if"] == f"max_num_seqs=2,step_time={c['pace']:.4g}"
    planned = doc["predictions"][1]["summary"]
    assert again["summary"]["itl_p50_ms"] > 1.25 * planned["itl_p50_ms"]
    text = run(recording, ["max_num_seqs=2"], None, False, 1.0, [], "text", check_run=slow)
    assert "Check of max_num_seqs=2" in text and f"at the run's pace (x{c['pace']:.2f})" in text
    assert c["notes"] == []
    # steps without a duration: no pace, said so, and the rest of the check stands
    con = duckdb.connect(str(slow))
    con.execute("UPDATE engine_steps SET end_ns = start_ns")
    con.close()
    c = json.loads(run(recording, [], None, False, 1.0, [], "json", check_run=slow))["check"]
    assert c["pace"] is None and c["at_pace"] is None
    assert c["notes"] == [
        "the run holds no working engine steps with a duration: its pace is unknown"
    ]
    assert c["errors_pct"]["ttft_p50_ms"] is not None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bad_input_is_one_line_and_exit_2(recording, tmp_path):
    stepless = tmp_path / "proxy_like.duckdb"
    con = copy_store(recording, stepless)
    con.execute("DELETE FROM engine_steps")
    con.close()
    requestless = tmp_path / "no_requests.duckdb"
    con = copy_store(recording, requestless)
    con.execute("DELETE FROM requests")
    con.close()
    # the recording's own steps offered as its profile
    own_copy = tmp_path / "own.duckdb"
    copy_store(recording, own_copy).close()
    copy_store(recording, tmp_path / "own.duckdb.profile.duckdb").close()
    cases = [
        ((str(stepless),), "holds neither engine steps nor an upstream's scraped running gauge"),
        ((str(stepless), "--upstream-limits", "slots=0"), "slots must be a whole number >= 1"),
        ((str(stepless), "--upstream-limits", "seats=4"), "'seats=4' is not one of slots=N"),
        ((str(recording), "--upstream-limits", "slots=4"), "is for a proxy's store"),
        ((str(recording), "--what-if", "max_batch=3"), "unknown knob 'max_batch'"),
        ((str(recording), "--slo", "ttft<2s"), "unknown metric 'ttft'"),
        ((str(recording), "--slo", "ttft_p99 under 2s"), "expected metric<duration"),
        ((str(recording), "--what-if", "rate=0"), "rate=0: a factor > 0"),
        ((str(recording), "--recommend"), "--recommend needs an --slo"),
        (
            (str(recording), "--what-if", "quantization=int8"),
            "with --quantization int8 as --cost-from",
        ),
        ((str(recording), "--what-if", "disaggregation=1:1"), "is not replayed"),
        ((str(tmp_path / "missing.duckdb"),), "missing.duckdb"),
        ((str(recording), "--what-if", "rate=1e-9"), "past the 4.61e+09 s a nanosecond clock"),
        ((str(recording), "--what-if", "rate=5e-324"), "a nanosecond clock holds"),
        ((str(recording), "--what-if", "hosts=10000000"), "GiB is available: plan fewer hosts"),
        ((str(recording), "--what-if", ""), "--what-if is empty"),
        ((str(recording), "--slo", " "), "--slo is empty"),
        ((str(recording), "--check", str(tmp_path / "gone.duckdb")), "gone.duckdb"),
        ((str(recording), "--check", str(requestless)), "the store holds no requests"),
        (
            (
                str(recording),
                "--what-if",
                "rate=2",
                "--what-if",
                "rate=3",
                "--check",
                str(recording),
            ),
            "give at most one --what-if",
        ),
        ((str(recording), "--what-if", "step_time=-1"), "step_time=-1: a factor from 0.01"),
        ((str(recording), "--capacity"), "--capacity needs an --slo"),
        ((str(recording), "--capacity", "--slo", "ttft_p99<1ms"), "(bound 1 ms)"),
        ((str(recording), "--slo", "ttft_p99<2s,ttft_p99<1s"), "ttft_p99 is bounded twice"),
        ((str(recording), "--admin-key", "k"), "--admin-key is for --profile's sweep"),
        (
            (
                str(recording),
                "--profile",
                "--url",
                "http://127.0.0.1:9",
                "--profile-seconds",
                "inf",
            ),
            "at most 3600",
        ),
        ((str(own_copy),), "its steps ran while the recording did"),
        (
            (str(stepless), "--profile", "--upstream-limits", "slots=4"),
            "--profile needs its --url (the engine, or the proxy in front of it)",
        ),
        ((str(recording), "--url", "http://127.0.0.1:9"), "add --profile"),
        (
            (str(recording), "--profile", "--url", "http://127.0.0.1:9"),
            "http://127.0.0.1:9 does not answer",
        ),
    ]
    # one through the installed command (a process of its own), the rest in this process
    r = _cli(*cases[0][0])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        line for line in r.stderr.strip().splitlines() if cases[0][1] in line
    ], r.stderr
    runner = CliRunner()
    for args, says in cases[1:]:
        r = runner.invoke(app, list(args))
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (args, r.output)


def test_the_error_estimate_holds_out_the_last_quarter_of_the_requests():
    """Counted, not timed: the kept recording's last quarter of its span holds 11 of its 81
    requests; the estimate scores the last 21 to arrive, with step costs fitted before them."""
    from pathlib import Path

    from tokenmill.plan.predict import error_estimate, open_recording
    from tokenmill.plan.whatif import parse_slo

    kept = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "plan_recording"
    rec = open_recording(kept)
    try:
        est = error_estimate(rec, parse_slo(None))
        n = len(rec.workload)
    finally:
        rec.con.close()
    assert n == 81
    assert est["requests"] == n - int(n * 0.75) == 21
    errors = est["errors_pct"]
    assert set(errors) >= {"ttft_p50_ms", "itl_p50_ms", "goodput_share"}
    assert all(abs(v) < 200 for v in errors.values() if v is not None)
    # the held-out steps' pace against the fit on the steps before them (the same host, a
    # few minutes on): near 1, and not exactly 1
    assert 0.7 < est["pace"] < 1.4 and est["pace"] != 1.0


def test_capacity_is_the_highest_rate_whose_replay_meets_the_slo(recording):
    from tokenmill.plan.capacity import GRID_STEP, RESOLUTION
    from tokenmill.plan.predict import open_recording, predict
    from tokenmill.plan.whatif import parse_slo, parse_whatif

    rec = open_recording(recording)
    try:
        at1 = predict(rec, parse_whatif(""), parse_slo(None)).summary
        # bounds the recorded rate meets with room: the capacity lies above it
        text = f"ttft_p99<{2 * at1['ttft_p99_ms']:.0f}ms,itl_p99<{2 * at1['itl_p99_ms']:.0f}ms"
        doc = json.loads(run(recording, [], text, False, 1.0, [], "json", capacity_it=True))
        cap = doc["capacity"]
        slo = parse_slo(text)
        # the search's claims, checked by replaying those rates again
        f = cap["capacity_factor"]
        assert f > 1.0 and not cap["unbounded"]
        assert not predict(rec, parse_whatif(f"rate={f}"), slo).slo_misses
        miss = cap["first_miss"]
        f_miss = miss["rate_per_s"] / rec.workload.rate_per_s
        assert f < f_miss <= f * RESOLUTION * 1.0001
        assert predict(rec, parse_whatif(f"rate={f_miss}"), slo).slo_misses
        assert miss["binds"] in ("kv", "queue", "compute")
        # the grid reaches past the first miss; the band (dearer steps first) holds the capacity
        assert max(r["rate_per_s"] for r in cap["curve"]) >= miss["rate_per_s"] * GRID_STEP * 0.99
        lo, hi = cap["band_rate_per_s"]
        assert lo <= cap["capacity_rate_per_s"] <= hi
        # a tighter TTFT bound can only lower it
        tight = f"ttft_p99<{1.2 * at1['ttft_p99_ms']:.0f}ms,itl_p99<{2 * at1['itl_p99_ms']:.0f}ms"
        doc2 = json.loads(run(recording, [], tight, False, 1.0, [], "json", capacity_it=True))
        assert doc2["capacity"]["capacity_rate_per_s"] <= cap["capacity_rate_per_s"]
    finally:
        rec.con.close()
    text_out = run(recording, [], text, False, 1.0, [], "text", capacity_it=True)
    assert "highest rate that meets it" in text_out and "binds first:" in text_out


def test_a_profile_swept_from_a_running_server_joins_the_fit(recording, smollm2_dir, tmp_path):
    from server_proc import Server

    from tokenmill.plan.predict import open_recording
    from tokenmill.plan.profile import profile_path

    rec_path = tmp_path / "rec.duckdb"
    copy_store(recording, rec_path).close()
    server = Server(
        tmp_path, "--model", str(smollm2_dir), "--trace-db", str(tmp_path / "live.duckdb"),
        "--num-gpu-blocks-override", "48", "--max-num-seqs", "6",
    )  # fmt: skip
    try:
        doc = json.loads(
            run(rec_path, [], None, False, 1.0, [], "json", profile_url=server.url, profile_s=60)
        )
    finally:
        server.stop()
    sweep = doc["profile_sweep"]
    assert Path(sweep["path"]) == profile_path(rec_path) and profile_path(rec_path).is_file()
    # batch sizes up to max_num_seqs (6) as far as 90% of the 48-block pool holds them at once
    # (691 tokens: four 160-token requests, one of 544), smallest prompts first
    levels = [(lv["prompt_tokens"], lv["batch"]) for lv in sweep["levels"]]
    assert levels == [(128, 1), (128, 2), (128, 4), (512, 1)], levels
    assert all(lv["failed"] == 0 for lv in sweep["levels"])
    from_profile = doc["step_cost"]["profile_steps"]
    assert from_profile > 20
    alone = open_recording(rec_path, use_profile=False)
    both = open_recording(rec_path)
    try:
        assert both.profile == str(profile_path(rec_path))
        # the profile's steps join the recording's (outliers are dropped from the pooled fit)
        assert both.model.profile_steps == from_profile
        recorded_kept = both.model.steps["all"] - both.model.profile_steps
        # (which of the recording's steps count as outliers moves with the sweep's own timing:
        # 141 to 149 of about 150 kept in repeated runs)
        assert recorded_kept == pytest.approx(alone.model.steps["all"], rel=0.10)
        assert both.model.residuals_by_batch and "1-1" in both.model.residuals_by_batch
    finally:
        alone.con.close()
        both.con.close()
    # a profile of another precision is refused, in one line
    con = duckdb.connect(str(profile_path(rec_path)))
    con.execute(
        'UPDATE events SET attributes = json_merge_patch(attributes, \'{"quantization": "int8"}\') '
        "WHERE kind = 'config'"
    )
    con.close()
    r = CliRunner().invoke(app, [str(rec_path)])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "the profile ran quantization 'int8'" in lines[0], r.output


def test_a_profile_swept_from_a_local_engine_of_the_recordings_setup(recording, tmp_path):
    """``--profile`` without ``--url``: an engine started here with the recording's settings
    (its 48-block pool, 6 slots, the test model) is swept, and its profile is of that setup."""
    from tokenmill.plan.predict import open_recording
    from tokenmill.plan.profile import profile_path

    rec_path = tmp_path / "rec.duckdb"
    copy_store(recording, rec_path).close()
    doc = json.loads(run(rec_path, [], None, False, 1.0, [], "json", profile_it=True, profile_s=20))
    sweep = doc["profile_sweep"]
    levels = [(lv["prompt_tokens"], lv["batch"]) for lv in sweep["levels"]]
    # the same levels as from a server started with those flags, as far as 20 s reach
    assert levels and levels == [(128, 1), (128, 2), (128, 4), (512, 1)][: len(levels)], levels
    assert all(lv["failed"] == 0 for lv in sweep["levels"])
    both = open_recording(rec_path)
    try:
        assert both.profile == str(profile_path(rec_path))
        assert both.model.profile_steps > 10
        # the local engine ran the recording's pool: the profile's steps say so
        ((blocks,),) = (
            both.profile_steps[0]
            .execute("SELECT max(kv_blocks_total) FROM engine_steps")
            .fetchall()
        )
        assert blocks == both.num_blocks == 48
    finally:
        both.con.close()
