"""The step-cost fit recovers known coefficients from steps made with them, says how well it
predicts steps it never saw, and refuses stores it cannot stand on."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pytest

from tokenmill.plan.predict import host_load_factor
from tokenmill.plan.step_cost import MIN_STEPS, ModelShape, StepCostError, fit_step_cost
from tokenmill.telemetry.recorded_config import RecordedConfig

S = 1_000_000_000
SHAPE = ModelShape(
    linear_params=1000, lm_head_params=100, attn_flop_per_pair=4, layers=1, kv_bytes_per_token=1
)


def steps_store(
    n: int,
    prefill_share: float = 0.3,
    noise: float = 0.02,
    seed: int = 0,
    one_thread: int = 0,
    pace: float = 1.0,
    others=None,
    load_cost: float = 1.5,
    drift: float = 0.0,
):
    """``engine_steps`` rows made with known costs. Eager steps: a forward of 12 ms + 0.9 ms a
    decode + 0.05 ms a prompt token + 2 ms a prompt chunk + 30 ms per million KV tokens read;
    decode-only steps of at most 12 rows run compiled: 6 ms + 0.3 ms a decode + 10 ms per
    million KV tokens. Host part 1 ms + 0.1 ms a decode; 1 ms between back-to-back steps;
    every 25th step a 10x hiccup; with ``one_thread``, every such step of the others ran on
    one thread instead of two, its forward 1.6x as long. ``pace``: every step's time times it
    (a slower or faster host). ``others(second)``: the share of the CPUs other processes took
    in that second of the store (half of it the load generator), written as host samples;
    each step then takes ``1 + load_cost x`` that share times as long. ``drift``: each
    second's steps also run a random factor ``1 + drift x N(0, 1)`` slower (a host whose pace
    wanders for reasons of its own)."""
    rng = np.random.default_rng(seed)
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE engine_steps (start_ns BIGINT, end_ns BIGINT, forward_ms DOUBLE, "
        "num_decode_tokens INT, num_prefill_tokens INT, num_sampled INT, kv_read_bytes BIGINT, "
        "flops BIGINT, num_prefill_chunks INT, cpu_threads INT, num_running INT, "
        "num_waiting INT, compiled BOOLEAN, replica INT)"
    )
    t = 1_000_000_000
    rows = []
    for i in range(n):
        decode = int(rng.integers(1, 40))
        chunks = int(rng.integers(1, 4)) if rng.random() < prefill_share else 0
        prefill = int(rng.integers(16, 1500)) if chunks else 0
        kv = int(rng.integers(1_000, 200_000))
        sampled = decode + (1 if prefill else 0)
        flops = 2 * SHAPE.linear_params * (decode + prefill) + 2 * SHAPE.lm_head_params * sampled
        compiled = not prefill and decode <= 12
        if compiled:
            fwd = 6 + 0.3 * decode + 10 * kv / 1e6
        else:
            fwd = 12 + 0.9 * decode + 0.05 * prefill + 2 * chunks + 30 * kv / 1e6
        host = 1 + 0.1 * decode
        fwd *= 1 + noise * rng.standard_normal()
        if i % 25 == 7:
            fwd *= 10
        threads = 2
        if one_thread and i % one_thread == 3:
            threads, fwd = 1, fwd * 1.6
        fwd, host = fwd * pace, host * pace
        if others is not None:
            second = -(-t // S)  # the sample at or after the step's start
            slower = 1 + load_cost * others(second)
            slower *= 1 + drift * np.random.default_rng((seed, second)).standard_normal()
            fwd, host = fwd * slower, host * slower
        wall_ns = int((fwd + host) * 1e6)
        rows.append(
            (t, t + wall_ns, fwd, decode, prefill, sampled, kv, flops, chunks, threads, 5, 0,
             compiled, 0)
        )  # fmt: skip
        t += wall_ns + 1_000_000
    if rows:
        con.executemany("INSERT INTO engine_steps VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    if others is not None:
        con.execute(
            "CREATE TABLE device_samples (time_ns BIGINT, kind VARCHAR, cpu_others_pct DOUBLE, "
            "loadgen_cpu_pct DOUBLE)"
        )
        con.executemany(
            "INSERT INTO device_samples VALUES (?, 'host', ?, ?)",
            [(k * S, others(k) * 100, others(k) * 50) for k in range(1, t // S + 2)],
        )
    return con


def test_the_fit_recovers_each_paths_coefficients_and_the_gap():
    m = fit_step_cost(steps_store(900), RecordedConfig(), shape=SHAPE)
    eager, compiled = m.paths["eager"], m.paths["compiled"]
    f = eager.forward.coef  # step, decode, prefill, chunks, attention, KV
    assert f[0] == pytest.approx(12, rel=0.1)
    assert f[1] == pytest.approx(0.9, rel=0.05)
    assert f[2] == pytest.approx(0.05, rel=0.05)
    assert f[3] == pytest.approx(2, rel=0.3)
    assert f[5] == pytest.approx(30, rel=0.15)
    for i, true in ((1, 0.9), (2, 0.05)):
        assert eager.forward.low[i] <= true <= eager.forward.high[i]
    c = compiled.forward.coef
    assert c[0] == pytest.approx(6, rel=0.1)
    assert c[1] == pytest.approx(0.3, rel=0.1)
    assert c[5] == pytest.approx(10, rel=0.2)
    assert eager.host.coef[0] == pytest.approx(1, rel=0.1)
    assert eager.host.coef[1] == pytest.approx(0.1, rel=0.05)
    assert m.native_rows == 12
    assert m.path_of(True, 12) == "compiled"
    assert m.path_of(True, 13) == "eager"
    assert m.path_of(False, 4) == "eager"
    assert m.gap_ms == pytest.approx(1.0, abs=0.01)
    assert m.dropped >= 900 // 25 - 2  # the hiccups, not used for the fit
    assert m.holdout["all"]["median_abs_err_pct"] < 5
    assert m.threads == 2
    assert m.unsupported() == []


def test_a_recording_without_prefill_steps_says_so():
    m = fit_step_cost(steps_store(300, prefill_share=0.0), RecordedConfig(), shape=SHAPE)
    assert m.steps["with_prefill"] == 0
    assert m.unsupported() == [f"with prefill steps (0 recorded, {MIN_STEPS} needed)"]


def test_no_steps_or_too_few_is_one_line():
    with pytest.raises(StepCostError, match="holds no engine steps"):
        fit_step_cost(steps_store(0), RecordedConfig(), shape=SHAPE)
    with pytest.raises(StepCostError, match="holds 10 engine steps; fitting needs 40"):
        fit_step_cost(steps_store(10), RecordedConfig(), shape=SHAPE)


def test_fitting_stops_at_until_ns():
    con = steps_store(300)
    (mid,) = con.execute("SELECT quantile_disc(start_ns, 0.5) FROM engine_steps").fetchone()
    (before,) = con.execute(
        "SELECT count(*) FROM engine_steps WHERE start_ns < ?", [mid]
    ).fetchone()
    m = fit_step_cost(con, RecordedConfig(), shape=SHAPE, until_ns=mid)
    assert m.steps["all"] + m.dropped == before == 149


def test_steps_on_fewer_threads_price_a_replica_given_fewer():
    m = fit_step_cost(steps_store(900, one_thread=6), RecordedConfig(), shape=SHAPE)
    assert m.threads == 2
    assert m.thread_factors[1]["factor"] == pytest.approx(1.6, rel=0.05)
    assert m.thread_scale(1) == (
        pytest.approx(1.6, rel=0.05),
        "measured on 150 recorded steps at 1",
    )
    # the fit itself stands on the two-thread steps only
    assert m.paths["eager"].forward.coef[1] == pytest.approx(0.9, rel=0.05)
    plain = fit_step_cost(steps_store(300), RecordedConfig(), shape=SHAPE)
    assert plain.thread_scale(1) == (2.0, "assumed from the thread counts")


def test_pace_is_a_stores_step_time_over_the_models():
    m = fit_step_cost(steps_store(900, one_thread=6), RecordedConfig(), shape=SHAPE)
    own = m.pace(steps_store(300, seed=1, one_thread=6))
    assert own["factor"] == pytest.approx(1.0, abs=0.02)
    # every step (each on its path, its thread count) 25% longer; the 10x hiccups left out
    slower = steps_store(300, seed=2, one_thread=6, pace=1.25)
    got = m.pace(slower)
    assert got["factor"] == pytest.approx(1.25, rel=0.02)
    assert 300 - 300 // 25 - 1 <= got["steps"] < 300
    (mid,) = slower.execute("SELECT quantile_disc(start_ns, 0.5) FROM engine_steps").fetchone()
    assert m.pace(slower, since_ns=mid)["steps"] < 160
    assert m.pace(slower, since_ns=1 << 62) == {"factor": None, "steps": 0}


def test_a_scaled_model_prices_every_step_and_gap_times_the_factor():
    m = fit_step_cost(steps_store(900, one_thread=6), RecordedConfig(), shape=SHAPE)
    x = np.array([[1.0, 20, 300, 2, 0.5, 0.01], [1.0, 8, 0, 0, 0.1, 0.002]])
    s = m.scaled(1.5)
    for path in ("eager", "compiled"):
        for threads in (None, 1):
            np.testing.assert_allclose(
                s.step_ms(x, threads=threads, path=path),
                1.5 * m.step_ms(x, threads=threads, path=path),
            )
    assert s.gap_ms == pytest.approx(1.5 * m.gap_ms)
    assert s.thread_factors == m.thread_factors
    assert m.pace(steps_store(300, seed=3, pace=1.5))["factor"] == pytest.approx(1.5, rel=0.02)
    assert s.pace(steps_store(300, seed=3, pace=1.5))["factor"] == pytest.approx(1.0, rel=0.02)


def _swinging(k: int) -> float:
    """Others' share of the CPUs in second ``k``: 5-35%, a 20 s cycle."""
    return 0.05 + 0.3 * (0.5 + 0.5 * math.sin(2 * math.pi * k / 20))


def test_the_host_load_slope_is_fitted_on_the_census_beside_the_steps():
    m = fit_step_cost(steps_store(900, others=_swinging), RecordedConfig(), shape=SHAPE)
    h = m.host_load
    mean = h["others_pct"] / 100
    assert 0.12 < mean < 0.28 and h["loadgen_pct"] == pytest.approx(h["others_pct"] / 2)
    # each step took 1 + 1.5 x the others' share: the factor between two shares follows it
    for share in (0.0, 0.1, 0.5):
        assert m.load_factor(share) == pytest.approx((1 + 1.5 * share) / (1 + 1.5 * mean), rel=0.04)
    # a plan at twice the traffic on this host: the load generator's half of the share doubles
    factor, note = host_load_factor(m, 2.0, dedicated=False)
    planned = mean * 1.5
    assert factor == pytest.approx((1 + 1.5 * planned) / (1 + 1.5 * mean), rel=0.04)
    assert factor > 1.03 and "load generator at x2" in note
    # on a dedicated host nothing else runs: quicker than recorded
    factor, note = host_load_factor(m, 2.0, dedicated=True)
    assert factor == pytest.approx(1 / (1 + 1.5 * mean), rel=0.04)
    assert note.startswith("planned for a dedicated host")
    # the recorded traffic on the recording's host: nothing to change
    assert host_load_factor(m, 1.0, dedicated=False) == (1.0, "")


def test_a_census_that_barely_moves_prices_nothing_and_says_why():
    m = fit_step_cost(steps_store(600, others=lambda k: 0.1), RecordedConfig(), shape=SHAPE)
    assert m.host_load["slope"] is None
    assert "too narrow" in m.host_load["why_none"]
    factor, note = host_load_factor(m, 2.0, dedicated=False)
    assert factor == 1.0 and note.startswith("host load not priced")
    # the census swings, the steps do not follow it, the pace wanders on its own: whatever
    # line the samples give is within noise and nothing is priced
    m = fit_step_cost(
        steps_store(900, others=_swinging, load_cost=0.0, drift=0.05, seed=0), RecordedConfig(),
        shape=SHAPE,
    )  # fmt: skip
    assert m.host_load["slope"] is None and "within noise" in m.host_load["why_none"]
    assert m.host_load["slope_ci95"][0] <= 0 < m.host_load["slope_ci95"][1]
    assert host_load_factor(m, 2.0, dedicated=False)[0] == 1.0
    # a store without host samples (a proxy's upstream steps have none) says nothing
    plain = fit_step_cost(steps_store(300), RecordedConfig(), shape=SHAPE)
    assert "others_pct" not in plain.host_load
    assert host_load_factor(plain, 2.0, dedicated=True) == (1.0, "")
