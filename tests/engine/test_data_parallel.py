"""Issue 16, data parallelism through the real server (``--data-parallel-size 2``, the default
model on CPU, one core a replica): 32 concurrent greedy requests give one engine's outputs and
spread over both replicas; the replica is on every request row, step row and request span, in
``/health`` and ``/metrics``; a SIGKILLed replica ends only its own streams (an error event),
the other's complete, it restarts and serves again, and nothing leaks; sizes the machine cannot
hold are one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import httpx
import pytest
from server_proc import Server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPTS = [f"Name one fact about the number {i}." for i in range(32)]


async def _greedy(url: str, max_tokens: int = 12) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as ac:

        async def one(prompt: str) -> str:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            r = await ac.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        return await asyncio.gather(*(one(p) for p in PROMPTS))


async def _streams(url: str, n: int, max_tokens: int) -> list[dict]:
    """n streamed completions at once; each: data events seen, the finish reason and the error
    event, if any."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as ac:

        async def one(i: int) -> dict:
            body = {
                "model": MODEL,
                "prompt": f"Story {i}: once upon a time",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            seen, error, finish = 0, None, None
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]
                        else:
                            seen += 1
                            finish = event["choices"][0].get("finish_reason") or finish
            return {"events": seen, "error": error, "finish": finish}

        return await asyncio.gather(*(one(i) for i in range(n)))


def _wait(server: Server, ok, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = server.health()
        if ok(h):
            return h
        time.sleep(0.25)
    raise AssertionError(f"health never reached the state: {h}")


@pytest.fixture(scope="module")
def one_engine_outputs(smollm2_dir, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("dp1"), "--model", str(smollm2_dir))
    try:
        return asyncio.run(_greedy(server.url))
    finally:
        server.stop()


def test_two_replicas_serve_one_engines_greedy_outputs_and_label_everything(
    smollm2_dir, tmp_path, one_engine_outputs
):
    server = Server(tmp_path, "--model", str(smollm2_dir), "--data-parallel-size", "2")
    try:
        health = server.health()
        replicas = health["engine"]["replicas"]
        assert [r["replica"] for r in replicas] == [0, 1]
        assert len({r["pid"] for r in replicas}) == 2
        assert [r["stats"]["cpu_threads"] for r in replicas] == [1, 1]
        outputs = asyncio.run(_greedy(server.url))
        assert outputs == one_engine_outputs
        health = _wait(server, lambda h: h["in_flight"] == 0)
        routed = [r["routed"] for r in health["engine"]["replicas"]]
        assert sum(routed) == 32 and min(routed) >= 8, routed
        assert [r["outstanding_tokens"] for r in health["engine"]["replicas"]] == [0, 0]
        metrics = httpx.get(server.url + "/metrics").text
        for replica in ("0", "1"):
            assert (
                f'tokenmill_replica_outstanding_tokens{{model_name="{MODEL}",replica="{replica}"}} 0.0'
                in metrics
            )
    finally:
        server.stop()
    con = duckdb.connect(str(tmp_path / "tokenmill-data" / "traces.duckdb"), read_only=True)
    by_replica = dict(con.execute("SELECT replica, count(*) FROM requests GROUP BY 1").fetchall())
    assert by_replica == {0: routed[0], 1: routed[1]}
    steps = dict(
        con.execute(
            "SELECT replica, count(DISTINCT engine_pid) FROM engine_steps "
            "WHERE num_decode_tokens > 0 GROUP BY 1"
        ).fetchall()
    )
    assert steps == {0: 1, 1: 1}
    spans = con.execute(
        "SELECT count(*), count(DISTINCT attributes->>'$.\"tokenmill.replica\"') FROM spans "
        "WHERE kind = 'SERVER'"
    ).fetchone()
    assert spans == (32, 2)


@pytest.mark.e2e
def test_a_killed_replica_ends_only_its_streams_restarts_and_leaks_nothing(smollm2_dir, tmp_path):
    server = Server(tmp_path, "--model", str(smollm2_dir), "--data-parallel-size", "2")
    try:
        victim = server.health()["engine"]["replicas"][1]["pid"]

        async def run():
            load = asyncio.ensure_future(_streams(server.url, 8, 160))
            await asyncio.to_thread(
                _wait,
                server,
                lambda h: all(r["stats"]["num_running"] for r in h["engine"]["replicas"]),
            )
            os.kill(victim, signal.SIGKILL)
            return await load

        results = asyncio.run(run())
        errors = [r for r in results if r["error"]]
        done = [r for r in results if not r["error"]]
        assert len(errors) == 4 and len(done) == 4, results
        assert all(r["error"]["code"] == "engine_died" for r in errors)
        assert all(r["finish"] == "length" and r["events"] > 1 for r in done), done
        health = _wait(server, lambda h: h["status"] == "ok")
        replicas = health["engine"]["replicas"]
        assert [r["restarts"] for r in replicas] == [0, 1]
        assert replicas[1]["pid"] != victim
        # the restarted replica serves the next requests
        again = asyncio.run(_streams(server.url, 4, 8))
        assert all(r["error"] is None and r["finish"] == "length" for r in again), again
        health = _wait(server, lambda h: h["in_flight"] == 0)
        replicas = health["engine"]["replicas"]
        assert [r["routed"] for r in replicas][1] >= 6
        assert [r["stats"]["kv_blocks_used"] for r in replicas] == [0, 0]
        assert [r["outstanding_tokens"] for r in replicas] == [0, 0]
        assert health["queue_depth"] == 0
    finally:
        server.stop()


@pytest.mark.e2e
def test_a_frozen_replica_leaves_the_rotation_and_returns_when_it_thaws(smollm2_dir, tmp_path):
    """A SIGSTOPped replica: once /health calls it silent (here after 2 s), every new request
    goes to the other one and completes; after SIGCONT it speaks, the server is ok again and
    it takes requests again."""
    server = Server(
        tmp_path, "--model", str(smollm2_dir), "--data-parallel-size", "2",
        "--engine-stall-degraded", "2",
    )  # fmt: skip
    frozen = server.health()["engine"]["replicas"][1]["pid"]
    try:
        os.kill(frozen, signal.SIGSTOP)
        health = _wait(server, lambda h: h["status"] == "degraded", timeout_s=60)
        assert f"pid {frozen}" in json.dumps(health), health  # the silent one is named
        before = [r["routed"] for r in health["engine"]["replicas"]]
        results = asyncio.run(_streams(server.url, 6, 8))
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        routed = [r["routed"] for r in server.health()["engine"]["replicas"]]
        assert routed[1] == before[1] and routed[0] == before[0] + 6, (before, routed)
    finally:
        os.kill(frozen, signal.SIGCONT)
    try:
        _wait(server, lambda h: h["status"] == "ok", timeout_s=60)
        asyncio.run(_streams(server.url, 6, 8))
        routed_after = [r["routed"] for r in server.health()["engine"]["replicas"]]
        assert routed_after[1] > routed[1], (routed, routed_after)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("size", "needle"),
    [
        ("0", "Invalid value for '--data-parallel-size'"),
        (
            str((os.cpu_count() or 1) + 1),
            f"needs {(os.cpu_count() or 1) + 1} CPU cores (one per rank); this machine has "
            f"{os.cpu_count() or 1}",
        ),
    ],
)
def test_sizes_the_machine_cannot_start_are_one_line(size, needle, tmp_path):
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "tokenmill.engine.cli", "serve"),
            *("--device", "cpu", "--data-parallel-size", size),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
