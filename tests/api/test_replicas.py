"""Issue 16, data parallelism's router and replica plan (``engine/api/replicas.py``): the
request goes to the replica with the fewest outstanding tokens, prefix affinity holds only
within its slack, the count falls as outputs come and returns to zero however a stream ends,
and a size the machine cannot hold is one line naming what there is. The real engine's
replicas are ``test_data_parallel.py``'s."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tokenmill.engine.api.replicas import (
    AFFINITY_BLOCKS,
    AFFINITY_KEYS,
    AFFINITY_SLACK_TOKENS,
    ReplicaPool,
    Router,
    check_data_parallel,
    replica_config,
)
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.messages import RequestOutput, RequestStats
from tokenmill.engine.sampling_params import SamplingParams

BLOCK = 16


def test_least_outstanding_tokens_wins_and_ties_go_to_the_lowest_replica():
    router = Router(3, BLOCK)
    assert router.pick([0, 1, 2], [1] * 40) == 0
    router.add(0, 500)
    router.add(1, 200)
    assert router.pick([0, 1, 2], [1] * 40) == 2
    router.add(2, 300)
    assert router.pick([0, 1, 2], [1] * 40) == 1
    assert router.pick([0, 2], [1] * 40) == 2  # replica 1 not ready


def test_prefix_affinity_pins_within_the_slack_and_spills_past_it():
    router = Router(2, BLOCK, prefix_affinity=True)
    shared = [*range(BLOCK * AFFINITY_BLOCKS), 7, 8, 9]
    assert router.pick([0, 1], shared) == 0
    router.add(0, AFFINITY_SLACK_TOKENS)  # replica 0 busy, but within the slack
    assert router.pick([0, 1], shared) == 0
    assert router.affine == 1
    # another prefix goes by load
    assert router.pick([0, 1], list(range(100, 100 + BLOCK * AFFINITY_BLOCKS))) == 1
    router.add(0, 1)  # one token past the slack: load wins, and the key moves
    assert router.pick([0, 1], shared) == 1
    router.add(0, -AFFINITY_SLACK_TOKENS - 1)
    assert router.pick([0, 1], shared) == 1  # now remembered on replica 1
    # a prompt shorter than the key has none (one block of a chat template's header would pin
    # every chat prompt); without the flag nothing is pinned
    assert router.pick([0, 1], shared[: BLOCK * AFFINITY_BLOCKS - 1]) == 0
    plain = Router(2, BLOCK)
    plain.add(0, 1)
    assert plain.pick([0, 1], shared) == 1 and plain.pick([0, 1], shared) == 1


def test_affinity_keys_are_bounded():
    router = Router(2, 1, prefix_affinity=True)
    pad = [0] * (AFFINITY_BLOCKS - 1)
    for t in range(AFFINITY_KEYS + 10):
        router.pick([0, 1], [t, *pad])
    assert len(router._last) == AFFINITY_KEYS
    assert (0, *pad) not in router._last and (AFFINITY_KEYS + 9, *pad) in router._last


def _out(rid: str, tokens: int, finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        new_token_ids=[5] * tokens,
        new_text="",
        token_ns=[0] * tokens,
        finished=finished,
        finish_reason=None,
        stop_reason=None,
        error_type=None,
        error_message=None,
        stats=RequestStats(
            input_tokens=10,
            output_tokens=tokens,
            cached_tokens=0,
            preemptions=0,
            recomputed_tokens=0,
            queued_ns=0,
            scheduled_ns=None,
            first_token_ns=None,
        ),
        arrival_ns=0,
        finished_ns=None,
    )


class _Worker:
    """An engine worker's routing surface: ready, and a stream of scripted outputs."""

    def __init__(self, replica: int, script: list[RequestOutput]):
        self.replica, self.name, self.ready, self.state = (
            replica,
            f"worker-{replica}",
            True,
            "ready",
        )
        self.script = script
        self.heartbeat_age_s = 0.1  # seconds since its engine's last message

    def generate(self, request_id, prompt_token_ids, params, **kw):
        async def stream():
            for out in self.script:
                yield out

        return stream()


def test_outstanding_tokens_fall_as_outputs_come_and_return_to_zero():
    """10 prompt tokens + max_tokens 8 = 18 at routing; the first output (2 tokens) takes the
    prompt and its tokens off, the next 3 more; a stream left early gives back the rest."""
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.router, pool._where, pool.closing = Router(2, BLOCK), {}, False
    pool.silent_after_s = 10.0
    pool.workers = [_Worker(0, [_out("a", 2, False), _out("a", 3, False)]), _Worker(1, [])]
    params = SamplingParams(max_tokens=8)

    async def run():
        seen = []
        stream = pool.generate("a", [1] * 10, params)
        assert pool.router.outstanding == [18, 0] and pool.replica_of("a").replica == 0
        async for _ in stream:
            seen.append(list(pool.router.outstanding))
        return seen

    assert asyncio.run(run()) == [[6, 0], [3, 0]]
    assert pool.router.outstanding == [0, 0] and pool.replica_of("a") is None
    assert pool.router.pick([0, 1], [1] * 10) == 0  # both idle again: a tie, replica 0


def test_a_silent_replica_leaves_the_rotation_until_it_speaks_again():
    """A replica silent past ``silent_after_s`` (what /health calls degraded: frozen, or in one
    very long step) gets no new request though it holds the fewest outstanding tokens; when
    every replica is silent, load decides as before; once it speaks, it is back."""
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.router, pool._where, pool.closing = Router(2, BLOCK), {}, False
    pool.silent_after_s = 10.0
    pool.workers = [_Worker(0, []), _Worker(1, [])]
    params = SamplingParams(max_tokens=8)
    pool.router.add(1, 100)  # replica 1 is the busier one

    def route(rid: str) -> int:
        pool.generate(rid, [1] * 10, params)
        return pool.replica_of(rid).replica

    assert route("a") == 0  # both speak: the least loaded
    pool.workers[0].heartbeat_age_s = 12.0
    assert [route(r) for r in ("b", "c", "d")] == [1, 1, 1]
    pool.workers[1].heartbeat_age_s = 30.0  # all silent: the rotation is everyone again
    assert route("e") == 0
    pool.workers[0].heartbeat_age_s = 0.2
    assert route("f") == 0


def test_a_stream_closed_before_its_first_read_gives_its_tokens_back():
    """A client gone before the response started closes the stream unread: the request's
    tokens and its routing entry must go at once (an async generator's finally would not run)."""
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.router, pool._where, pool.closing = Router(2, BLOCK), {}, False
    pool.silent_after_s = 10.0
    pool.workers = [_Worker(0, [_out("a", 2, False)]), _Worker(1, [])]

    async def run():
        stream = pool.generate("a", [1] * 10, SamplingParams(max_tokens=8))
        assert pool.router.outstanding == [18, 0]
        await stream.aclose()
        await stream.aclose()  # twice is harmless

    asyncio.run(run())
    assert pool.router.outstanding == [0, 0] and pool.replica_of("a") is None


def test_a_size_the_machine_cannot_hold_is_one_line(monkeypatch):
    cpu = EngineConfig(device="cpu", data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^--data-parallel-size 2 x --tensor-parallel-size 2 "
                       r"needs 4 CPU cores \(one per rank\); this machine has 2$"):  # fmt: skip
        check_data_parallel(cpu, cpu_count=2, cuda_count=0)
    check_data_parallel(dataclasses.replace(cpu, tensor_parallel_size=1), 2, 0)
    gpu = EngineConfig(device="auto", data_parallel_size=3)
    with pytest.raises(ValueError, match="needs 3 CUDA devices from cuda:0; this machine has 2"):
        check_data_parallel(gpu, cpu_count=16, cuda_count=2)
    # two replicas from cuda:1 need cuda:1 and cuda:2
    with pytest.raises(ValueError, match="needs 2 CUDA devices from cuda:1; this machine has 2"):
        check_data_parallel(dataclasses.replace(gpu, device="cuda:1", data_parallel_size=2), 16, 2)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # replicas of multi-host ranks: refused
    with pytest.raises(ValueError, match="not supported: every replica would serve"):
        check_data_parallel(cpu, cpu_count=8, cuda_count=0)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        EngineConfig(data_parallel_size=0).validate()


def test_each_replica_gets_its_devices_or_its_share_of_the_cores():
    cpu = EngineConfig(device="cpu", data_parallel_size=2)
    assert [replica_config(cpu, i, 2).cpu_threads for i in range(2)] == [1, 1]
    fixed = dataclasses.replace(cpu, cpu_threads=2)  # --cpu-threads is the operator's call
    assert replica_config(fixed, 1, 2).cpu_threads == 2
    gpu = EngineConfig(device="cuda:1", data_parallel_size=2, tensor_parallel_size=2)
    assert [replica_config(gpu, i, 16).device for i in range(2)] == ["cuda:1", "cuda:3"]


class _HealthWorker:
    """A replica as /health sees it: its state, stats and its own stall verdict."""

    def __init__(self, replica: int, ready: bool, stall):
        self.replica, self.name, self.ready = replica, f"worker-{replica}", ready
        self.state = "ready" if ready else "restarting"
        self.restarts, self.info, self._stall = 0, {}, stall
        self.heartbeat_age_s = 40.0 if stall else 0.1

    def stall(self, degraded_s, unavailable_s):
        return self._stall

    def health(self):
        # a restarting replica's stats are its last reported ones
        stats = {"num_running": 3, "num_waiting": 2, "kv_usage": 0.4}
        return {"name": self.name, "replica": self.replica, "state": self.state, "stats": stats}


def _app_state(pool, metrics=None):
    from types import SimpleNamespace

    from tokenmill.engine.api.app import ServerState
    from tokenmill.engine.api.gateway import Gateway
    from tokenmill.engine.api.stations import AdmissionStation, MeteringStation

    telemetry = SimpleNamespace(
        health=lambda: {"dropped_total": 0},
        dumps=SimpleNamespace(can_dump=False),
        metrics=metrics,
    )
    return ServerState(
        worker=pool,
        gateway=Gateway(None),
        tokenize=None,
        admission=AdmissionStation(4, 4),
        metering=MeteringStation(),
        model_name="m",
        max_body_bytes=1 << 20,
        block_size=BLOCK,
        telemetry=telemetry,
    )


def _pool(stalled=None) -> ReplicaPool:
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.name, pool.router, pool._where, pool.closing = "engine", Router(2, BLOCK), {}, False
    pool.workers = [_HealthWorker(0, False, None), _HealthWorker(1, True, stalled)]
    return pool


def test_a_restarting_replicas_gauges_read_zero_not_its_last_values():
    """Replica 0 restarts; its last stats said 3 running at 40 % KV. /metrics gives it 0
    running, 0 waiting and 0 KV use; replica 1 keeps its own values."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.engine.api.app import build_app
    from tokenmill.telemetry.metrics import ServingMetrics

    metrics = ServingMetrics("m")
    metrics.data_parallel_size = 2
    with TestClient(build_app(_app_state(_pool(), metrics))) as client:
        text = client.get("/metrics").text
    got = {
        (s.name, s.labels["replica"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if "replica" in s.labels
    }
    assert got[("tokenmill_replica_num_requests_running", "0")] == 0
    assert got[("tokenmill_replica_num_requests_waiting", "0")] == 0
    assert got[("tokenmill_replica_kv_cache_usage_perc", "0")] == 0
    assert got[("tokenmill_replica_num_requests_running", "1")] == 3
    assert got[("tokenmill_replica_kv_cache_usage_perc", "1")] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("stalled", "status", "http"),
    [(None, "degraded", 200), (("unavailable", "no heartbeat for 40 s"), "degraded", 503)],
)
def test_health_names_a_stalled_replica_while_another_restarts(stalled, status, http):
    """Replica 0 restarts; replica 1 is the only one serving. When replica 1 is silent too,
    nothing serves: /health says so (503, its reason) instead of a plain "degraded"."""
    from fastapi.testclient import TestClient

    from tokenmill.engine.api.app import build_app

    state = _app_state(_pool(stalled))
    with TestClient(build_app(state)) as client:
        r = client.get("/health")
    assert (r.status_code, r.json()["status"]) == (http, status)
    reasons = r.json()["reasons"]
    assert (stalled is None) == (not any("worker-1" in x for x in reasons)), reasons


def test_the_start_line_names_every_replica():
    from tokenmill.engine.api.server import engine_line

    one = {"pid": 11, "num_blocks": 256}
    assert engine_line(one, 4096) == "engine pid 11, KV capacity 4096 tokens in 256 blocks"
    two = {"pid": 11, "pids": [11, 12], "num_blocks": 256}
    assert engine_line(two, 4096) == (
        "2 engine replicas, pids 11, 12, KV capacity 4096 tokens in 256 blocks each"
    )
    pd = {**two, "roles": ["prefill", "decode"]}
    assert engine_line(pd, 4096) == (
        "prefill core pid 11, decode core pid 12, KV capacity 4096 tokens in 256 blocks each"
    )
