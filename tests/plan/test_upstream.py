"""Another engine's step costs fitted on what a proxy saw in front of it (``plan/upstream.py``).

The engine here is our own replay with known step costs and limits: its requests, written as a
proxy's store writes them (client-side stamps only, a scraped running gauge, no engine step),
must give those costs back, and a plan from them must predict the engine at twice the rate.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pytest

from tokenmill.engine.config import EngineConfig
from tokenmill.plan.predict import (
    PlanError,
    predict,
    result_rows,
    summarize_rows,
    upstream_recording,
)
from tokenmill.plan.simulate import Setup, simulate
from tokenmill.plan.step_cost import TERMS, Fit, ModelShape, PathFit, StepCostModel
from tokenmill.plan.upstream import UpstreamError, fit_upstream, parse_limits, read_limits
from tokenmill.plan.whatif import parse_slo, parse_whatif
from tokenmill.plan.workload import ReplayWorkload
from tokenmill.telemetry.schema import apply_schema

#: the engine's costs (ms): a step, a decode row, a prompt token, a prompt chunk
TRUE = np.array([6.0, 2.0, 0.25, 3.0, 0.0, 0.0])
SLOTS, BATCH = 4, 2048
#: the rate factor over the recording where a queue for the four slots starts to form
EDGE = 2.2


def known_engine(coef: np.ndarray) -> StepCostModel:
    zero = np.zeros(len(TERMS))
    return StepCostModel(
        shape=ModelShape(0, 0, 0, 1, 1),
        paths={"eager": PathFit(Fit(coef, coef, coef), Fit(zero, zero, zero))},
        native_rows=None, gap_ms=0.0, threads=0, holdout={}, steps={},
        ranges={"max_decode_batch": 0},
    )  # fmt: skip


def traffic(n: int, rate: float, seed: int = 0) -> ReplayWorkload:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    out = rng.integers(32, 129, n)
    return ReplayWorkload(
        arrival_s=arrival - arrival[0], input_tokens=rng.integers(64, 513, n),
        output_tokens=out, max_tokens=out, tenants=[""] * n, block_hashes=[[] for _ in range(n)],
        pre_engine_s=0.0, post_engine_s=0.0, block_size=16, start_ns=10**18,
    )  # fmt: skip


def engine_setup() -> Setup:
    config = EngineConfig(max_num_seqs=SLOTS, max_num_batched_tokens=BATCH,
                          enable_chunked_prefill=True, enable_prefix_caching=False)  # fmt: skip
    return Setup(config, num_blocks=4096)


def proxy_store(w: ReplayWorkload, *, gauge: bool = True) -> duckdb.DuckDBPyConnection:
    """The known engine run on ``w``, its requests as a proxy writes them."""
    r = simulate(w, engine_setup(), known_engine(TRUE))
    lat = r.latencies
    con = duckdb.connect()
    apply_schema(con)
    arrival = w.start_ns + np.round(w.arrival_s * 1e9).astype(np.int64)
    first = arrival + np.round(lat["ttft_ms"] * 1e6).astype(np.int64)
    last = first + np.round(lat["decode_ms"] * 1e6).astype(np.int64)
    end = arrival + np.round(lat["e2e_ms"] * 1e6).astype(np.int64)
    rows = [
        (f"r{i}", f"t{i}", int(arrival[i]), int(first[i]), int(last[i]), int(end[i]),
         int(w.input_tokens[i]), int(r.output_tokens[i]), float(lat["ttft_ms"][i]),
         float(lat["tpot_ms"][i]), float(lat["e2e_ms"][i]), float(lat["itl_p50_ms"][i]))
        for i in range(len(w))
    ]  # fmt: skip
    con.executemany(
        "INSERT INTO requests (request_id, trace_id, arrival_ns, first_token_ns, last_token_ns, "
        "end_ns, input_tokens, output_tokens, ttft_ms, tpot_ms, e2e_ms, itl_p50_ms, "
        "finish_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'length')",
        rows,
    )
    if gauge:
        con.execute(
            "INSERT INTO engine_samples (time_ns, url, engine_kind, running) "
            "VALUES (?, 'http://127.0.0.1:9/metrics', 'llamacpp', ?)",
            [int(arrival[0]), SLOTS],
        )
    return con


@pytest.fixture(scope="module")
def recorded():
    w = traffic(300, 1.5)
    return w, proxy_store(w)


def test_the_fit_gives_the_engines_step_costs_back(recorded):
    _, con = recorded
    limits = read_limits(con, {})
    assert (limits.slots, limits.batch_tokens) == (SLOTS, BATCH)
    assert "running gauge" in limits.sources["slots"]
    model = fit_upstream(con, limits)
    coef = model.paths["eager"].forward.coef
    # a step, a decode row: within 5%; a prompt token within 10%; the chunk cost also takes
    # the wait for the step in progress when a request arrives, so it runs high
    assert coef[0] == pytest.approx(TRUE[0], rel=0.05)
    assert coef[1] == pytest.approx(TRUE[1], rel=0.05)
    assert coef[2] == pytest.approx(TRUE[2], rel=0.10)
    assert TRUE[3] <= coef[3] < TRUE[3] + 0.5 * (TRUE[0] + 2 * TRUE[1])
    low, high = model.paths["eager"].forward.low, model.paths["eager"].forward.high
    # bootstrap intervals around each cost (the fit's spread over the requests, not its bias)
    assert all(low[k] <= coef[k] <= high[k] and high[k] - low[k] < 0.2 * coef[k] for k in (0, 1, 2))
    # held out: every fifth request's decode stretch, TTFT and ITL p50
    assert model.holdout["eager_decode"]["steps"] >= 50
    assert model.holdout["eager_decode"]["median_abs_err_pct"] < 3
    assert model.holdout["with_prefill"]["median_abs_err_pct"] < 6
    assert model.holdout["itl"]["steps"] >= 50
    assert model.holdout["itl"]["median_abs_err_pct"] < 5
    assert model.ranges["max_decode_batch"] == SLOTS


def test_a_plan_at_twice_the_rate_predicts_the_engine_at_twice_the_rate(recorded):
    w, con = recorded
    rec = upstream_recording(con, "synthetic", {"slots": SLOTS, "kv_tokens": 4096 * 16})
    slo = parse_slo(None)
    planned = predict(rec, parse_whatif("rate=2"), slo).summary
    twice = w.scaled(2.0)
    real = result_rows(twice, simulate(twice, engine_setup(), known_engine(TRUE)))
    truth = summarize_rows(real, slo)
    for key in ("ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms", "e2e_p50_ms"):
        assert planned[key] == pytest.approx(truth[key], rel=0.10), key
    assert planned["ttft_p99_ms"] == pytest.approx(truth["ttft_p99_ms"], rel=0.30)
    # at twice the rate the queue for a slot grows: the plan must see it
    at1 = predict(rec, parse_whatif(""), slo).summary
    assert planned["ttft_p50_ms"] > at1["ttft_p50_ms"]


def test_a_store_without_steps_or_gauges_or_with_bad_limits_is_one_line():
    w = traffic(60, 1.0, seed=1)
    con = proxy_store(w, gauge=False)
    with pytest.raises(PlanError, match="neither engine steps nor an upstream's scraped"):
        upstream_recording(con, "bare", {})
    # the slot count given: the same store plans
    rec = upstream_recording(con, "bare", {"slots": SLOTS})
    assert rec.upstream.sources["slots"] == "given" and rec.config.max_num_seqs == SLOTS
    for text, says in [
        ("slots=0", "slots must be a whole number >= 1"),
        ("slots=four", "slots must be a whole number >= 1, not 'four'"),
        ("kv=9", "'kv=9' is not one of slots=N, batch_tokens=N, kv_tokens=N"),
        ("slots", "'slots' is not one of"),
        ("slots=4,slots=5", "slots is given twice"),
    ]:
        with pytest.raises(UpstreamError, match=says):
            parse_limits(text)
    assert parse_limits(" slots=8 , kv_tokens=16384,") == {"slots": 8, "kv_tokens": 16384}


def test_too_few_answered_requests_is_one_line():
    con = proxy_store(traffic(12, 1.0, seed=2))
    with pytest.raises(PlanError, match=r"holds 12 answered requests .* needs 40"):
        upstream_recording(con, "short", {})


def test_a_plan_near_the_engines_capacity_says_its_latencies_are_ranges(recorded):
    """Every step the fit's held-out error cheaper and dearer: far below the four slots' reach
    the percentiles barely move; where a queue for a slot forms or not, TTFT spans a range and
    the plan says so."""
    _, con = recorded
    rec = upstream_recording(con, "synthetic", {"slots": SLOTS, "kv_tokens": 4096 * 16})
    slo = parse_slo(None)
    calm = predict(rec, parse_whatif("rate=0.5"), slo)
    err = calm.band["step_error_pct"] / 100
    assert err == pytest.approx(rec.model.holdout["all"]["median_abs_err_pct"] / 100)
    for key in ("ttft_p50_ms", "itl_p50_ms"):
        low, high = calm.band[key]
        assert low <= calm.summary[key] <= high
        assert high - low < 3 * err * calm.summary[key], key
    assert not any("tipping point" in n for n in calm.notes)
    edge = predict(rec, parse_whatif(f"rate={EDGE}"), slo)
    low, high = edge.band["ttft_p50_ms"]
    assert high - low > 0.5 * edge.summary["ttft_p50_ms"]
    assert any(n.startswith("near a tipping point") and "TTFT P50" in n for n in edge.notes)
    # a search over many replays leaves the band out
    assert predict(rec, parse_whatif("rate=2"), slo, with_band=False).band is None


def sweep_workload(levels: list[tuple[int, int]], gap_s: float = 120.0) -> ReplayWorkload:
    """The profile sweep's traffic: each level's requests at once, the levels ``gap_s`` apart."""
    arrival, prompt = [], []
    for i, (ctx, b) in enumerate(levels):
        arrival += [i * gap_s] * b
        prompt += [ctx] * b
    n = len(arrival)
    out = np.full(n, 32)
    return ReplayWorkload(
        arrival_s=np.array(arrival, dtype=float), input_tokens=np.array(prompt),
        output_tokens=out, max_tokens=out, tenants=[""] * n, block_hashes=[[] for _ in range(n)],
        pre_engine_s=0.0, post_engine_s=0.0, block_size=16, start_ns=2 * 10**18,
    )  # fmt: skip


def test_a_sweep_of_the_engine_extends_the_fit_to_its_every_slot():
    """A quiet recording never fills the four slots; the sweep's batches (``plan --profile``
    of another engine) do, and fitted with it the costs come back."""
    from tokenmill.plan.profile import levels_for

    quiet = proxy_store(traffic(80, 0.15, seed=3))
    limits = read_limits(quiet, {"slots": SLOTS})
    alone = fit_upstream(quiet, limits)
    swept = proxy_store(sweep_workload(levels_for(1024, SLOTS, SLOTS * 1024)), gauge=False)
    both = fit_upstream(quiet, limits, extra=(swept,))
    assert alone.ranges["max_decode_batch"] < SLOTS == both.ranges["max_decode_batch"]
    assert both.upstream["swept"] == 2 * (1 + 2 + 4) and both.upstream["requests"] == 80
    # the held-out requests are the recording's alone
    assert both.holdout["all"]["steps"] == alone.holdout["all"]["steps"]
    assert both.steps["all"] > alone.steps["all"]
    # the costs come back: a batch sent at once is admitted over two steps (the first request
    # alone), so the rows its decode stretches share are spread less evenly than the fit takes
    # them, and a decode row runs up to 10% high
    coef = both.paths["eager"].forward.coef
    assert coef[0] == pytest.approx(TRUE[0], rel=0.05)
    assert coef[1] == pytest.approx(TRUE[1], rel=0.10)
    assert coef[2] == pytest.approx(TRUE[2], rel=0.05)


def test_a_sweep_through_http_is_timed_as_the_proxy_times_it(smollm2_dir, tmp_path):
    """``plan PROXY_STORE --profile --url`` against a real server (ours, as a black box,
    through :func:`~tokenmill.plan.profile.sweep_upstream`): each level's requests
    at once, each answer's stamps and tokens as a proxy records them; the sweep joins the plan
    of a recording of the same model and is refused beside one of another model."""
    from server_proc import Server

    from tokenmill.plan.cli import run
    from tokenmill.plan.predict import open_recording
    from tokenmill.plan.profile import profile_path

    rec_path = tmp_path / "rec.duckdb"
    rec = duckdb.connect(str(rec_path))
    src = proxy_store(traffic(300, 1.5))
    apply_schema(rec)
    for table in ("requests", "engine_samples"):
        copied = src.sql(f"SELECT * FROM {table}").to_arrow_table()  # noqa: F841
        rec.execute(f"INSERT INTO {table} SELECT * FROM copied")
    rec.execute("UPDATE requests SET model = 'smollm2-135m-instruct'")
    rec.close()
    server = Server(tmp_path, "--model", str(smollm2_dir), "--max-num-seqs", str(SLOTS),
                    "--trace-db", str(tmp_path / "live.duckdb"))  # fmt: skip
    limits = f"slots={SLOTS},kv_tokens={SLOTS * 1024}"
    again = tmp_path / "again.duckdb"
    shutil.copy(rec_path, again)
    try:
        doc = json.loads(
            run(rec_path, [], None, False, 1.0, [], "json", profile_url=server.url + "/v1/",
                profile_s=15, upstream_limits=limits)
        )  # fmt: skip
        # swept again with no time to spare: its first level still runs, on token ids of its
        # own (a fixed draw would find them all in the server's prefix cache)
        second = json.loads(
            run(again, [], None, False, 1.0, [], "json", profile_url=server.url,
                profile_s=1e-9, upstream_limits=limits)
        )["profile_sweep"]  # fmt: skip
    finally:
        server.stop()
    assert [(lv["prompt_tokens"], lv["batch"]) for lv in second["levels"]] == [(128, 1)]
    live = duckdb.connect(str(tmp_path / "live.duckdb"), read_only=True)
    ((served, cached),) = live.execute(
        "SELECT count(*), sum(cached_tokens) FROM requests WHERE input_tokens IN (128, 512)"
    ).fetchall()
    live.close()
    assert served == sum(lv["batch"] for lv in doc["profile_sweep"]["levels"]) + 1
    assert cached == 0
    sweep = doc["profile_sweep"]
    path = Path(sweep["path"])
    assert path == profile_path(rec_path) and doc["recording"]["profile"] == str(path)
    levels = [(lv["prompt_tokens"], lv["batch"]) for lv in sweep["levels"]]
    assert levels and levels == [(c, b) for c in (128, 512) for b in (1, 2, 4)][: len(levels)], (
        levels
    )
    assert all(lv["failed"] == 0 for lv in sweep["levels"])
    con = duckdb.connect(str(path), read_only=True)
    rows = con.execute(
        "SELECT input_tokens, output_tokens, arrival_ns, first_token_ns, last_token_ns, end_ns, "
        "itl_p50_ms, model, finish_reason FROM requests ORDER BY arrival_ns"
    ).fetchall()
    con.close()
    assert len(rows) == sum(b for _, b in levels)
    for prompt, out, arrival, first, last, end, itl, model, finish in rows:
        assert prompt in (128, 512) and out == 32 and finish == "length"
        assert arrival < first < last <= end and itl > 0
        assert model == "smollm2-135m-instruct"
    # each level's requests are in flight together, the next level sent once they all ended
    groups, k = [], 0
    for _, b in levels:
        groups.append(rows[k : k + b])
        k += b
    for now, after in itertools.pairwise(groups):
        assert max(r[2] for r in now) < min(r[3] for r in now)  # all sent before a first token
        assert max(r[5] for r in now) <= min(r[2] for r in after)
    both = open_recording(rec_path, upstream_limits={"slots": SLOTS})
    try:
        assert both.profile == str(path) and both.model.upstream["swept"] == len(rows)
        assert both.model.ranges["max_decode_batch"] >= max(b for _, b in levels)
    finally:
        both.con.close()
    rec = duckdb.connect(str(rec_path))
    rec.execute("UPDATE requests SET model = 'llama-3-8b'")
    rec.close()
    with pytest.raises(
        PlanError,
        match="answers came from model 'smollm2-135m-instruct', the recording's from 'llama-3-8b'",
    ):
        open_recording(rec_path, upstream_limits={"slots": SLOTS})
