"""The replay through the engine's own scheduler, with a step-cost model whose coefficients
the tests choose, so each latency can be worked out by hand."""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.plan.simulate import Setup, _ReplayBlockManager, simulate
from tokenmill.plan.step_cost import TERMS, Fit, ModelShape, PathFit, StepCostModel
from tokenmill.plan.workload import ReplayWorkload

SHAPE = ModelShape(
    linear_params=1000, lm_head_params=100, attn_flop_per_pair=4, layers=1, kv_bytes_per_token=1
)


def model(step=10.0, decode=1.0, prefill=0.1, attn=0.0, kv=0.0, gap=0.0) -> StepCostModel:
    coef = np.array([step, decode, prefill, 0.0, attn, kv])
    zero = np.zeros(len(TERMS))
    return StepCostModel(
        shape=SHAPE,
        paths={"eager": PathFit(Fit(coef, coef, coef), Fit(zero, zero, zero))},
        native_rows=None,
        gap_ms=gap,
        threads=0,
        holdout={},
        steps={"eager_decode": 100, "with_prefill": 100, "all": 200},
        ranges={"max_decode_batch": 64, "max_prefill_tokens": 2048},
    )


def workload(arrivals, prompts, outputs, hashes=None, pre=0.005, post=0.002) -> ReplayWorkload:
    n = len(arrivals)
    return ReplayWorkload(
        arrival_s=np.asarray(arrivals, dtype=float),
        input_tokens=np.asarray(prompts),
        output_tokens=np.asarray(outputs),
        max_tokens=np.asarray(outputs),
        tenants=[""] * n,
        block_hashes=hashes or [[] for _ in range(n)],
        pre_engine_s=pre,
        post_engine_s=post,
        block_size=16,
    )


def setup(**kw) -> Setup:
    blocks = kw.pop("num_blocks", 1000)
    replicas = kw.pop("replicas", 1)
    return Setup(EngineConfig(**kw), num_blocks=blocks, replicas=replicas)


@pytest.mark.parametrize("fast", [True, False])
def test_one_request_alone_costs_its_prefill_then_its_decodes(fast):
    # prefill step: 10 + 0.1 x 100 = 20 ms; each decode: 10 + 1 = 11 ms
    r = simulate(workload([0.0], [100], [10]), setup(), model(), fast_forward=fast)
    assert r.ttft_ms[0] == pytest.approx(5 + 20)
    assert r.itl_p50_ms[0] == pytest.approx(11)
    assert r.itl_p99_ms[0] == pytest.approx(11)
    assert r.tpot_ms[0] == pytest.approx(11)
    assert r.e2e_ms[0] == pytest.approx(5 + 20 + 9 * 11 + 2)
    assert r.output_tokens[0] == 10
    assert r.steps == 10
    assert r.scheduler_calls == (3 if fast else 11)  # prefill, one run of 9, the empty plan


def test_a_second_request_waits_behind_max_num_seqs():
    w = workload([0.0, 0.001], [100, 100], [10, 10])
    one = simulate(w, setup(max_num_seqs=1), model())
    two = simulate(w, setup(max_num_seqs=2), model())
    # with one slot the second request starts when the first has ended (20 + 99 ms)
    assert one.ttft_ms[1] == pytest.approx(5 + 20 + 99 + 20 - 1)
    # with two it is admitted into the first decode step: 10 + 1 decode + 100 x 0.1 = 21 ms
    assert two.ttft_ms[1] == pytest.approx(5 + 20 + 21 - 1)
    assert two.itl_p50_ms[0] == pytest.approx(12)  # two decodes a step


def test_a_pool_too_small_for_both_preempts_and_both_still_finish():
    # 10 blocks of 16 tokens: two 60-token prompts growing to 100 tokens need 14
    w = workload([0.0, 0.0], [60, 60], [40, 40])
    r = simulate(w, setup(num_blocks=10, kv_watermark=0.0), model())
    assert r.preemptions.sum() >= 1
    assert list(r.output_tokens) == [40, 40]
    assert not np.isnan(r.e2e_ms).any()


def test_a_shared_prefix_hits_the_cache_only_with_caching_on():
    shared = [[11, 12, 13, 14], [11, 12, 13, 14]]  # the same four leading blocks
    w = workload([0.0, 1.0], [80, 80], [4, 4], hashes=shared)
    on = simulate(w, setup(), model())
    off = simulate(w, setup(enable_prefix_caching=False), model())
    # the second prompt computes 16 tokens instead of 80 (64 served from the cache)
    assert on.ttft_ms[1] == pytest.approx(5 + 10 + 0.1 * 16)
    assert off.ttft_ms[1] == pytest.approx(5 + 10 + 0.1 * 80)


def test_two_replicas_split_the_load_by_outstanding_tokens():
    w = workload([0.0, 0.0, 0.0, 0.0], [100] * 4, [20] * 4)
    r = simulate(w, setup(replicas=2), model())
    assert r.routed == [2, 2]
    one = simulate(w, setup(), model())
    assert np.nanmean(r.ttft_ms) < np.nanmean(one.ttft_ms)


def test_fast_forward_gives_the_percentiles_of_step_by_step():
    rng = np.random.default_rng(3)
    n = 80
    arrivals = np.cumsum(rng.exponential(0.05, n))
    prompts = rng.integers(40, 400, n)
    outputs = rng.integers(10, 120, n)
    hashes = [[1, 2] if i % 3 == 0 else [] for i in range(n)]
    w = workload(arrivals, prompts, outputs, hashes=hashes)
    m = model(step=8.0, decode=0.6, prefill=0.05, attn=2.0, kv=40.0)
    # a pool so small that requests preempt each other, and three roomy replicas
    for s, fewer in ((setup(num_blocks=120), 0.95), (setup(replicas=3, num_blocks=400), 0.5)):
        fast = simulate(w, s, m, fast_forward=True)
        slow = simulate(w, s, m, fast_forward=False)
        assert fast.scheduler_calls < slow.scheduler_calls * fewer
        assert (fast.output_tokens == slow.output_tokens).all()
        # the same decisions: every request's TTFT and E2E to the nanosecond
        np.testing.assert_allclose(fast.ttft_ms, slow.ttft_ms, atol=1e-6)
        np.testing.assert_allclose(fast.e2e_ms, slow.e2e_ms, atol=1e-6)
        assert (fast.preemptions == slow.preemptions).all()
        assert fast.routed == slow.routed
        # a run's inter-token latencies booked as their mean: the percentiles barely move
        for got, want in ((fast.itl_p50_ms, slow.itl_p50_ms), (fast.itl_p99_ms, slow.itl_p99_ms)):
            for q in (50, 99):
                assert np.nanpercentile(got, q) == pytest.approx(
                    np.nanpercentile(want, q), rel=1e-3
                )


class _EngineBlocks(BlockManager):
    """The engine's own KV pool in the replay's place: SHA-256 hashes, every full block
    registered at every step, miss reasons kept."""

    def cache_full_blocks(self, request, with_outputs=False):
        super().cache_full_blocks(request)


class _NeverPrivate(_ReplayBlockManager):
    """The replay's pool, but a request's own blocks are never registered, not even when it is
    preempted: what the preemption registration is there for."""

    def cache_full_blocks(self, request, with_outputs=False):
        super().cache_full_blocks(request, with_outputs=False)


def test_the_replays_kv_pool_decides_as_the_engines(monkeypatch):
    import tokenmill.plan.simulate as simulation

    rng = np.random.default_rng(5)
    n = 60
    arrivals = np.cumsum(rng.exponential(0.03, n))
    prompts = rng.integers(40, 200, n)
    outputs = rng.integers(20, 90, n)
    hashes = [[1, 2, 3] if i % 2 else [1, 4] for i in range(n)]  # shared heads, then own blocks
    w = workload(arrivals, prompts, outputs, hashes=hashes)
    m = model(step=8.0, decode=0.6, prefill=0.05, attn=2.0, kv=40.0)
    s = setup(num_blocks=70)  # requests preempt each other and recompute
    results = {}
    for name, pool in (("replay", _ReplayBlockManager), ("engine", _EngineBlocks),
                       ("never_private", _NeverPrivate)):  # fmt: skip
        monkeypatch.setattr(simulation, "_ReplayBlockManager", pool)
        results[name] = simulate(w, s, m, fast_forward=False)
    replay, engine = results["replay"], results["engine"]
    assert engine.preemptions.sum() > 10
    for name in ("ttft_ms", "itl_p50_ms", "itl_p99_ms", "e2e_ms", "preemptions"):
        np.testing.assert_array_equal(getattr(replay, name), getattr(engine, name), err_msg=name)
    assert replay.prefix_hit_tokens == engine.prefix_hit_tokens
    # the recomputes hit their own blocks: without them fewer tokens come from the cache
    assert results["never_private"].prefix_hit_tokens < engine.prefix_hit_tokens


@pytest.mark.parametrize("fast", [True, False])
def test_a_copy_left_unregistered_is_registered_once_the_other_is_evicted(monkeypatch, fast):
    """Two requests admitted in one step both compute a shared head; only the first copy is
    registered. Once it is evicted (fillers cycle the pool) the engine registers the copy of
    the request still running, and a later request with the same head hits it."""
    import tokenmill.plan.simulate as simulation

    arrivals = [0.0, 0.001, 0.001] + [0.1 + 0.05 * k for k in range(20)] + [1.5]
    outputs = [300, 2, 200] + [2] * 20 + [2]
    hashes = [[], [1, 2], [1, 2]] + [[] for _ in range(20)] + [[1, 2]]
    w = workload(arrivals, [48] * len(arrivals), outputs, hashes=hashes)
    m = model(step=8.0, decode=0.6, prefill=0.05)
    results = {}
    for name, pool in (("replay", _ReplayBlockManager), ("engine", _EngineBlocks)):
        monkeypatch.setattr(simulation, "_ReplayBlockManager", pool)
        results[name] = simulate(w, setup(num_blocks=30), m, fast_forward=fast)
    replay, engine = results["replay"], results["engine"]
    assert engine.prefix_hit_tokens >= 32  # the last request's head, from the survivor
    assert replay.prefix_hit_tokens == engine.prefix_hit_tokens
    np.testing.assert_array_equal(replay.ttft_ms, engine.ttft_ms)
    np.testing.assert_array_equal(replay.e2e_ms, engine.e2e_ms)


def test_the_replays_pick_is_the_routers_rule():
    """The replay works its pick out itself (its counts are the router's less the steps ended
    in flight); with nothing in flight it picks what the server's router picks, ties and all."""
    from tokenmill.plan.simulate import Simulation

    rng = np.random.default_rng(2)
    sim = Simulation(workload([0.0], [40], [4]), setup(replicas=7), model())
    for _ in range(300):
        counts = rng.integers(0, 4, 7).tolist()  # ties on most draws
        sim.router.outstanding, sim._floor = counts, list(counts)
        assert sim._pick(0.0) == sim.router.pick(list(range(7)), [1] * 40)


def test_rate_and_tiling_change_the_arrivals_not_the_requests():
    w = workload([0.0, 1.0, 3.0], [50, 60, 70], [5, 6, 7], hashes=[[1], [1], [2]])
    fast = w.scaled(2.0)
    assert list(fast.arrival_s) == [0.0, 0.5, 1.5]
    big = w.repeated(7)
    assert len(big) == 7
    assert list(big.input_tokens) == [50, 60, 70, 50, 60, 70, 50]
    assert big.arrival_s[3] == pytest.approx(3.0 + 1.5)  # one mean gap after the last
    # a block two prompts share stays shared across tiles; a private one is new in each tile
    assert big.prompt(0)[:16] == big.prompt(3)[:16] == big.prompt(1)[:16]
    assert big.prompt(2)[:16] != big.prompt(5)[:16]


def _busy_fleet_workload(n: int = 300):
    rng = np.random.default_rng(11)
    arrivals = np.cumsum(rng.exponential(0.02, n))
    prompts = rng.integers(40, 400, n)
    outputs = rng.integers(10, 120, n)
    hashes = [[1, 2] if i % 3 == 0 else [] for i in range(n)]
    return workload(arrivals, prompts, outputs, hashes=hashes)


@pytest.mark.parametrize("fast", [True, False])
def test_steps_twice_as_long_at_half_the_rate_replay_the_same_twice_as_slow(fast):
    """A host at half the pace (every step x2) fed at half the rate is the same replay with
    every clock doubled: the same decisions, every latency x2 (exactly: doubling is exact in
    floating point)."""
    n = 200
    rng = np.random.default_rng(5)
    w = workload(
        np.cumsum(rng.exponential(0.01, n)), rng.integers(40, 400, n), rng.integers(10, 120, n),
        hashes=[[1, 2] if i % 3 == 0 else [] for i in range(n)], pre=0.0, post=0.0,
    )  # fmt: skip
    m = model(step=8.0, decode=0.6, prefill=0.05, attn=2.0, kv=40.0, gap=0.5)
    s = setup(num_blocks=60)  # a small pool: preemptions
    base = simulate(w, s, m, fast_forward=fast)
    slow = simulate(w.scaled(0.5), s, m.scaled(2.0), fast_forward=fast)
    assert base.preemptions.sum() > 0
    assert list(slow.preemptions) == list(base.preemptions)
    assert slow.steps == base.steps and slow.scheduler_calls == base.scheduler_calls
    for a, b in ((slow.ttft_ms, base.ttft_ms), (slow.itl_p99_ms, base.itl_p99_ms),
                 (slow.e2e_ms, base.e2e_ms)):  # fmt: skip
        np.testing.assert_allclose(a, 2 * b, rtol=1e-12)
    assert slow.makespan_s == pytest.approx(2 * base.makespan_s, rel=1e-12)
    # the pace alone (the same arrivals): every request waits longer
    alone = simulate(w, s, m.scaled(2.0), fast_forward=fast)
    assert np.nanmedian(alone.ttft_ms) > 2 * np.nanmedian(base.ttft_ms)


@pytest.mark.parametrize("processes", [2, 3])
def test_a_split_replay_decides_as_one_process(monkeypatch, processes):
    from tokenmill.plan.simulate import Simulation

    w = _busy_fleet_workload()
    m = model(step=8.0, decode=0.6, prefill=0.05, attn=2.0, kv=40.0)
    s = setup(replicas=5, num_blocks=60)  # small pools: requests preempt each other
    one = simulate(w, s, m, processes=1)
    ahead = multiprocessing.get_context("fork").Value("i", 0)  # steps applied while waiting
    work_ahead = Simulation._work_ahead

    def counted(self, until, hold):
        did = work_ahead(self, until, hold)
        if did:
            with ahead.get_lock():
                ahead.value += 1
        return did

    monkeypatch.setattr(Simulation, "_work_ahead", counted)
    split = simulate(w, s, m, processes=processes)
    assert (one.processes, split.processes) == (1, processes)
    assert one.preemptions.sum() > 0 and min(one.routed) > 0
    assert ahead.value > 0
    for name in ("ttft_ms", "itl_p50_ms", "itl_p99_ms", "tpot_ms", "e2e_ms", "output_tokens",
                 "preemptions", "rejected"):  # fmt: skip
        np.testing.assert_array_equal(getattr(split, name), getattr(one, name), err_msg=name)
    for name in ("routed", "steps", "scheduler_calls", "steps_by_kind", "max_decode_batch",
                 "max_eager_decode_batch", "kv_usage_max", "waiting_max", "prefix_hit_tokens",
                 "makespan_s", "kv_usage_mean", "waiting_mean", "running_mean"):  # fmt: skip
        assert getattr(split, name) == getattr(one, name), name


@pytest.mark.parametrize("broken_replica", [0, 1])
def test_a_failing_process_stops_a_split_replay_with_its_reason(monkeypatch, broken_replica):
    from tokenmill.plan.simulate import Simulation
    from tokenmill.plan.split import SplitError

    original = Simulation._end

    def broken(self, rep):
        if rep.index == broken_replica:
            raise RuntimeError(f"replica {broken_replica} broke")
        return original(self, rep)

    monkeypatch.setattr(Simulation, "_end", broken)
    # replica 0 is this process's, replica 1 the other's: either way the replay stops and says
    # why instead of waiting for the failed one
    with pytest.raises((SplitError, RuntimeError), match=f"replica {broken_replica} broke") as e:
        simulate(_busy_fleet_workload(60), setup(replicas=2), model(), processes=2)
    # the first line says what failed (a command line prints only that)
    assert (
        f"RuntimeError: replica {broken_replica} broke"
        in (f"{type(e.value).__name__}: {e.value}".splitlines()[0])
    )


def test_a_killed_process_stops_a_split_replay(monkeypatch):
    from tokenmill.plan.simulate import Simulation
    from tokenmill.plan.split import SplitError

    first = os.getpid()
    original = Simulation._end

    def killed(self, rep):
        if os.getpid() != first:
            os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no flag: only its exit
        return original(self, rep)

    monkeypatch.setattr(Simulation, "_end", killed)
    with pytest.raises(SplitError, match="ended without"):
        simulate(_busy_fleet_workload(60), setup(replicas=2), model(), processes=2)


def test_a_meeting_word_holds_its_replica_and_count():
    from tokenmill.plan.split import SplitError, blocks, pack, unpack

    for i, replica, count in (
        (0, 0, 0),
        (5, 63, -7),
        (4095, 4095, (1 << 39) - 1),
        (7, 1, -(1 << 39)),
    ):
        assert unpack(pack(i, replica, count)) == (replica, count)
    with pytest.raises(SplitError, match="does not fit"):
        pack(0, 0, 1 << 39)
    assert blocks(64, 2) == [range(0, 32), range(32, 64)]
    assert blocks(5, 2) == [range(0, 2), range(2, 5)]
    assert blocks(2, 4) == [range(0, 1), range(1, 2)]


def test_a_fleet_past_what_a_meeting_word_names_replays_in_one_process(monkeypatch):
    import tokenmill.plan.simulate as sim
    from tokenmill.plan.split import can_split, usable_cores

    monkeypatch.setattr(sim, "SPLIT_MIN_REQUESTS", 10)
    w, s = _busy_fleet_workload(60), setup(replicas=5)
    if can_split() and usable_cores() >= 2:
        assert simulate(w, s, model()).processes == 2
    # the split is only a way to run it: a fleet it cannot name runs in one process, not refused
    monkeypatch.setattr(sim, "MAX_REPLICAS", 4)
    assert simulate(w, s, model()).processes == 1
