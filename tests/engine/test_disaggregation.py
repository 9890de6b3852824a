"""Issue 17, prefill/decode disaggregation, its engine part: a request prefilled on one engine
core is handed with its KV blocks (``engine/parallel/kv_transfer.py``) to another, which
decodes it on as if it had prefilled it itself.

Greedy tokens of 16 concurrent mixed requests (half of them sharing a head of 2 or more blocks, so the
prefill side hits its prefix cache) equal colocated serving token for token, with a decode
pool small enough that it preempts and refuses hand-offs for a while; the packing round-trips
exactly; the transfer crosses two processes over gloo; nothing stays allocated on either side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import types

import pytest
import torch
from paged_driver import mixed_greedy_requests
from server_proc import free_port

from tokenmill.engine.llm import LLM
from tokenmill.engine.messages import RequestStats
from tokenmill.engine.parallel.kv_transfer import (
    KVHandoff,
    gather_kv,
    recv_handoff,
    recv_kv,
    scatter_kv,
    send_end,
    send_handoff,
    send_kv,
)
from tokenmill.engine.sampling_params import SamplingParams

HEAD = "You are a careful assistant who answers in plain words and short sentences. " * 3


def _requests():
    prompts, params = mixed_greedy_requests(16)
    # half share a head of a few KV blocks: the prefill side's prefix cache hits on them
    return [HEAD + p if i % 2 else p for i, p in enumerate(prompts)], params


def _disaggregated(prefill: LLM, decode: LLM, prompts, params):
    """Every request prefilled on ``prefill`` (``hand_off``), its KV moved to ``decode`` as
    soon as that has room, decoded there. Returns tokens per request, the number of hand-offs
    the decode side refused at first (no room), and the decode side's step records."""
    p, d = prefill.core, decode.core
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    arrivals = list(zip(ids, prompts, params))
    ready, refused, records, done = [], 0, [], set()
    while len(done) < len(ids):
        if arrivals:  # one arrival a step: later heads find earlier ones in the prefix cache
            rid, prompt, sp = arrivals.pop(0)
            p.add_request(rid, prefill.tokenizer.encode(prompt), sp, hand_off=True)
        outs, _ = p.step()
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            assert out.finish_reason == "handoff", out
            ready.append(p.take_handoff(out.request_id))
        waiting = []
        for h in ready:
            if d.adopt(h) is None:
                refused += 1
                waiting.append(h)  # back-pressure: it waits for the decode side's room
        ready = waiting
        outs, rec = d.step()
        if rec is not None:
            records.append(rec)
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                done.add(out.request_id)
    return [tokens[rid] for rid in ids], refused, records


@pytest.mark.slow
def test_greedy_tokens_equal_colocated_with_prefix_hits_and_decode_preemption(smollm2_dir):
    prompts, params = _requests()
    colocated = [r.token_ids for r in LLM(str(smollm2_dir)).generate(prompts, params)]
    prefill = LLM(str(smollm2_dir))
    # 40 blocks of 16 tokens: the 16 requests need about 90 at their longest, so the decode
    # side preempts (recompute from its own copy of the prompt blocks) and turns hand-offs away
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers x block x kv heads x head dim x float32
    decode = LLM(str(smollm2_dir), kv_cache_memory=40 * block_bytes)
    assert decode.core.block_manager.num_blocks == 40
    got, refused, records = _disaggregated(prefill, decode, prompts, params)
    assert got == colocated
    assert [len(t) for t in got] == [sp.max_tokens for sp in params]
    assert sum(r.num_preempted for r in records) >= 1 and refused >= 1
    # the prefill side hit its prefix cache on the shared head
    head_blocks = len(prefill.tokenizer.encode(HEAD)) // 16
    assert head_blocks >= 2
    assert prefill.core.block_manager.prefix_hits >= 7 * head_blocks * 16
    # nothing held: the hand-offs were all taken, every block is back in both pools
    assert not prefill.core.handoffs
    for llm in (prefill, decode):
        assert llm.core.block_manager.num_used_blocks == 0, llm.core.block_manager


def test_pack_and_unpack_round_trip_and_refuse_a_wrong_shape():
    torch.manual_seed(0)
    src = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(3)]
    dst = [(torch.zeros(9, 4, 2, 8), torch.zeros(9, 4, 2, 8)) for _ in range(3)]
    kv = gather_kv(src, [4, 1, 5])
    assert kv.shape == (3, 2, 3, 4, 2, 8)
    scatter_kv(dst, [0, 8, 2], kv)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[[0, 8, 2]], sk[[4, 1, 5]]) and torch.equal(
            dv[[0, 8, 2]], sv[[4, 1, 5]]
        )
        assert not dk[[1, 3, 4, 5, 6, 7]].any()  # no other block written
    with pytest.raises(ValueError, match=r"does not fit \(3, 2, 2, 4, 2, 8\)"):
        scatter_kv(dst, [0, 1], kv)
    with pytest.raises(ValueError, match="outside the pool of 6"):
        gather_kv(src, [6])


def _receiver(port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    try:
        kv = recv_kv(0)
        queue.put((kv.dtype, tuple(kv.shape), float(kv.double().sum())))
        h = recv_handoff(0)
        queue.put(
            (
                h.request_id,
                h.output_token_ids,
                h.params,
                h.stats,
                float(h.kv.sum()),
                h.transfer_ms is not None,
            )
        )
        queue.put(recv_handoff(0))  # the end
    finally:
        dist.destroy_process_group()


def test_a_hand_off_crosses_processes_over_gloo():
    """The bytes a prefill core sends (header, then the tensor) arrive whole in another process:
    dtype, shape and content (a bf16 cache, so the header's dtype code is exercised); then a
    whole hand-off (its fields, its RequestStats whole, and its KV) and the end marker."""
    import torch.distributed as dist

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, queue))
    proc.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        kv = torch.randn(3, 2, 5, 4, 2, 8).to(torch.bfloat16)
        sent, ms = send_kv(kv, 1)
        dtype, shape, total = queue.get(timeout=120)
        params = SamplingParams(temperature=0.5, max_tokens=7, seed=3, stop=("x",))
        stats = RequestStats(  # every counter nonzero: it crosses whole
            input_tokens=3, output_tokens=1, cached_tokens=2, preemptions=2,
            recomputed_tokens=19, spec_drafts=1, spec_draft_tokens=4, spec_accepted_tokens=3,
            queued_ns=10, scheduled_ns=20, first_token_ns=30, kv_blocks=5,
        )  # fmt: skip
        ones = torch.ones(2, 2, 1, 4, 1, 8)
        send_handoff(KVHandoff("r1", [5, 6, 7], [9], params, ones, stats=stats), 1)
        handed = queue.get(timeout=120)
        send_end(1)
        end = queue.get(timeout=120)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        proc.join(timeout=60)
    assert sent == kv.numel() * 2 and ms >= 0
    assert (dtype, shape) == (torch.bfloat16, tuple(kv.shape))
    assert total == pytest.approx(float(kv.double().sum()))
    assert handed == ("r1", [9], params, stats, 128.0, True) and end is None
    assert proc.exitcode == 0


# ----- through tokenmill serve ----------------------------------------------------------------


@pytest.mark.slow
def test_serve_disaggregated_equals_colocated_and_records_the_transfer(tmp_path, smollm2_dir):
    """``--disaggregation prefill=1,decode=1`` with each side pinned to one core: 16
    concurrent greedy requests (prefix hits on the shared head) answer exactly what the
    offline colocated engine answers; /health lists both sides; each request's trace holds
    its ``kv_transfer`` event with the bytes of its prompt's blocks; both pools end empty."""
    import asyncio
    import json

    import duckdb
    import httpx
    from server_proc import Server

    prompts, params = _requests()
    want = [r.text for r in LLM(str(smollm2_dir)).generate(prompts, params)]
    db = tmp_path / "traces.duckdb"
    server = Server(
        tmp_path,
        *("--disaggregation", "prefill=1,decode=1"),
        *("--prefill-devices", "0", "--decode-devices", "1"),
        *("--trace-db", str(db)),
    )
    try:
        health = server.health()
        assert [r["name"] for r in health["engine"]["replicas"]] == ["prefill-0", "decode-0"]

        got = asyncio.run(_greedy_texts(server.url, prompts, params))
        assert got == want
        for _ in range(60):
            h = server.health()
            if h["kv_blocks_used"] == 0:
                break
            time.sleep(0.5)
        assert h["kv_blocks_used"] == 0 and h["in_flight"] == 0, h
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT r.input_tokens, list(s.events) FROM requests r JOIN spans s USING (trace_id) "
        "GROUP BY r.request_id, r.input_tokens"
    ).fetchall()
    assert len(rows) == 16
    per_token = 2 * 30 * 3 * 64 * 4  # bytes of K and V of one token, all layers, float32
    for input_tokens, span_events in rows:
        moved = [
            e for events in span_events for e in json.loads(events) if e["name"] == "kv_transfer"
        ]
        assert len(moved) == 1, span_events
        blocks = -(-input_tokens // 16)
        assert moved[0]["attributes"]["tokenmill.bytes"] == blocks * 16 * per_token
    # the request rows carry the same bytes and the transfer's ms, /metrics their sum
    total, timed = con.execute(
        "SELECT sum(kv_transfer_bytes), count(kv_transfer_ms) FROM requests"
    ).fetchone()
    assert timed == 16
    # the decode side keeps the prefill side's times: no negative queue (the adoption's clock)
    assert con.execute(
        "SELECT min(queue_ms) >= 0, min(prefill_ms) > 0 FROM requests"
    ).fetchone() == (
        True,
        True,
    )
    line = next(
        ln for ln in metrics.splitlines() if ln.startswith("tokenmill_kv_transfer_bytes_total")
    )
    assert float(line.split()[-1]) == total
    count = next(
        ln for ln in metrics.splitlines() if ln.startswith("tokenmill_kv_transfer_seconds_count")
    )
    assert float(count.split()[-1]) == 16


# ----- the flags and the decode side's desk ---------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "prefill", "decode", "needle"),
    [
        ("prefill=1;decode=1", "", "", "takes 'prefill=P,decode=D'"),
        ("prefill=0,decode=1", "", "", "at least one prefill worker, got prefill=0"),
        ("prefill=1,decode=0", "", "", "at least one decode worker, got decode=0"),
        ("prefill=9,decode=1", "", "", "at most 8 prefill workers a side"),
        ("prefill=2,decode=1", "0", "1", "--prefill-devices names 1 core(s) for 2 prefill"),
        ("prefill=1,decode=1", "0-3", "", "names core(s) [2, 3] but this machine has 2"),
        ("prefill=1,decode=1", "0", "0", "share core(s) [0]"),
        ("prefill=1,decode=1", "a", "", "--prefill-devices takes core ids"),
        ("prefill=1,decode=1", "1-0", "", "runs backwards"),
        ("", "0", "", "need --disaggregation"),
    ],
)
def test_a_bad_disaggregation_flag_is_one_line_naming_it(spec, prefill, decode, needle):
    from tokenmill.engine.parallel.pd_spec import parse_disaggregation

    with pytest.raises(ValueError) as err:
        parse_disaggregation(spec, prefill, decode, cpu_count=2)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_sides_cores_are_shared_evenly_among_its_workers():
    from tokenmill.engine.parallel.pd_spec import PDSpec, parse_disaggregation, worker_name

    spec = parse_disaggregation("prefill=2,decode=1", "0-4", "5", cpu_count=8)
    assert spec.world_size == 3
    assert spec.worker_cpus("prefill") == [(0, 1, 2), (3, 4)]
    assert spec.worker_cpus("decode") == [(5,)]
    assert PDSpec(1, 3, None, None).worker_cpus("decode") == [None, None, None]
    assert [worker_name(r, 2) for r in range(4)] == [
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
    ]


def _prefill_sender(port: int, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        for i in range(3):
            kv = torch.full((2, 2, 1 + i, 4, 1, 8), float(10 * rank + i))
            send_handoff(KVHandoff(f"p{rank}-{i}", [1] * (i + 1), [9], SamplingParams(), kv), 2)
        send_end(2)
    finally:
        dist.destroy_process_group()


def test_two_prefill_cores_send_to_one_decode_core_without_interleaving():
    """Two prefill ranks send three hand-offs each at once to one decode rank, which takes
    them from whichever sends first (``recv_handoff(None)``): all six arrive whole, each with
    its own KV and its sender's rank, and the receiver sees one end marker per sender."""
    import torch.distributed as dist

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_prefill_sender, args=(port, r)) for r in (0, 1)]
    for p in procs:
        p.start()
    got, ends = {}, 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=2, world_size=3)
        while ends < 2:
            h = recv_handoff(None)
            if h is None:
                ends += 1
                continue
            got[h.request_id] = (h.source_rank, tuple(h.kv.shape), float(h.kv.mean()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in procs:
            p.join(timeout=60)
    assert got == {
        f"p{r}-{i}": (r, (2, 2, 1 + i, 4, 1, 8), float(10 * r + i))
        for r in (0, 1)
        for i in range(3)
    }
    assert [p.exitcode for p in procs] == [0, 0]


def test_the_flags_parse_and_refuse_data_parallelism():
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.parallel.pd_spec import PDSpec, parse_disaggregation

    assert parse_disaggregation("", cpu_count=2) is None
    got = parse_disaggregation(" prefill = 1 , decode = 1 ", "0", "1", cpu_count=2)
    assert got == PDSpec(1, 1, (0,), (1,))
    with pytest.raises(ValueError, match="does not combine with --data-parallel-size"):
        EngineConfig(disaggregation="prefill=1,decode=1", data_parallel_size=2).validate()


def test_serve_refuses_a_bad_spec_at_startup_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--disaggregation", "prefill=1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "takes 'prefill=P,decode=D'" in lines[0], lines


def _handoff(rid: str) -> KVHandoff:
    return KVHandoff(rid, [1, 2], [3], SamplingParams(max_tokens=4), torch.zeros(1))


def test_the_desk_matches_either_order_drops_cancelled_and_orphans():
    from tokenmill.engine.parallel import pd_link

    now = [0.0]
    desk = pd_link.AdoptionDesk(clock=lambda: now[0])
    desk.expect("a")  # the API first
    desk.arrive(_handoff("b"))  # the hand-off first
    assert desk.ready() == []
    desk.arrive(_handoff("a"))
    desk.expect("b")
    assert [h.request_id for h in desk.ready()] == ["b", "a"]  # oldest arrival first
    desk.adopted("b")
    assert [h.request_id for h in desk.ready()] == ["a"] and desk.waiting == 1
    assert desk.cancel("c") is False  # aborted before its hand-off came
    desk.arrive(_handoff("c"))
    assert desk.waiting == 1  # dropped on arrival
    desk.arrive(_handoff("d"))  # its stream never opened
    now[0] = pd_link.ORPHAN_S + 1
    assert desk.expire() == ["d"] and desk.waiting == 1  # "a" is expected: it stays


async def _greedy_texts(url: str, prompts: list[str], params: list[SamplingParams]) -> list[str]:
    """The server's greedy completions of ``prompts`` (each its ``max_tokens``, ignoring EOS),
    all sent at once; each answer must be a 200."""
    import asyncio

    import httpx

    async def one(ac, prompt, sp):
        body = {
            "model": "smollm2-135m-instruct",
            "prompt": prompt,
            "max_tokens": sp.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = await ac.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=900) as ac:
        return await asyncio.gather(*(one(ac, p, sp) for p, sp in zip(prompts, params)))


async def _streams(url: str, n: int, tokens: int) -> list[dict]:
    """``n`` concurrent streaming completions of ``tokens`` tokens: each one's count of token
    events, its error object (or None) and its last finish reason."""
    import asyncio
    import json

    import httpx

    async def one(ac, i):
        body = {
            "model": "smollm2-135m-instruct",
            "prompt": f"Count slowly from {i}:",
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        }
        events, error, finish = 0, None, None
        async with ac.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]
                else:
                    events += 1
                    finish = obj["choices"][0]["finish_reason"] or finish
        return {"events": events, "error": error, "finish": finish}

    async with httpx.AsyncClient(timeout=600) as ac:
        return await asyncio.gather(*(one(ac, i) for i in range(n)))


def _wait(server, pred, limit_s: float = 300) -> dict:
    """Poll ``/health`` until ``pred`` holds; its last reading."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        h = server.health()
        if pred(h):
            return h
        time.sleep(0.3)
    raise AssertionError(f"never reached: {h}")


@pytest.mark.e2e  # a failure drill or tour: `make test-e2e`
@pytest.mark.slow
def test_a_killed_decode_core_fails_streams_cleanly_and_both_sides_come_back(tmp_path):
    """SIGKILL the decode core while 6 streams decode: every stream ends (an error event, or
    done), both sides restart on a fresh link, the next requests are answered in full, and
    no KV block, admission slot or hand-off is left on either side."""
    import asyncio
    import signal

    from server_proc import Server

    server = Server(tmp_path, "--disaggregation", "prefill=1,decode=1")

    def streams(n: int, tokens: int):
        return _streams(server.url, n, tokens)

    def wait(pred, limit_s=300):
        return _wait(server, pred, limit_s)

    try:
        victim = server.health()["engine"]["replicas"][1]["pid"]

        async def run():
            load = asyncio.ensure_future(streams(6, 200))
            await asyncio.to_thread(
                wait, lambda h: h["engine"]["replicas"][1]["stats"].get("num_running", 0) >= 2
            )
            os.kill(victim, signal.SIGKILL)
            return await load

        results = asyncio.run(run())
        assert all(r["error"] or r["finish"] == "length" for r in results), results
        assert any(r["error"] and r["error"]["code"] == "engine_died" for r in results), results
        health = wait(lambda h: h["status"] == "ok")
        replicas = health["engine"]["replicas"]
        assert [r["restarts"] for r in replicas] == [1, 1]  # both sides, on a fresh link
        assert replicas[1]["pid"] != victim
        again = asyncio.run(streams(3, 8))
        assert all(r["error"] is None and r["finish"] == "length" for r in again), again
        # the prefill core's stats come with its step records and idle heartbeats (0.5 s): the
        # step that hands requests off reports their blocks, freed just after it (CI read 3)
        health = wait(
            lambda h: (
                h["in_flight"] == 0
                and [r["stats"]["kv_blocks_used"] for r in h["engine"]["replicas"]] == [0, 0]
            ),
            limit_s=30,
        )
        assert health["engine"]["stats"]["num_running"] == 0
    finally:
        server.stop()


def test_a_decode_side_down_at_the_hand_off_ends_the_stream_as_engine_died():
    """The prefill core handed the request off, but the decode worker is not ready (it went
    down meanwhile): the stream yields the first token, then ends with EngineDeadError (the
    API's ``engine_died``), not an unhandled error; a first token that ends the request
    needs no decode side at all."""
    import asyncio

    import msgspec

    from tokenmill.engine.api.disaggregated import PDPool, PDRouter
    from tokenmill.engine.api.worker import EngineUnavailable
    from tokenmill.engine.async_engine import EngineDeadError
    from tokenmill.engine.messages import RequestOutput

    def out(reason):
        return RequestOutput(
            request_id="r", new_token_ids=[7], new_text="x", token_ns=[1], finished=True,
            finish_reason=reason, stop_reason=None, error_type=None, error_message=None,
            stats=RequestStats(input_tokens=3, output_tokens=1, queued_ns=0, scheduled_ns=0,
                               first_token_ns=1),
            arrival_ns=0, finished_ns=1,
        )  # fmt: skip

    class Side:
        def __init__(self, name, ready, outputs=(), replica=0):
            self.name, self.ready, self.state, self.outputs = name, ready, "ready", outputs
            self.replica, self.engine = replica, types.SimpleNamespace(stats={})

        def generate(self, *args, **kwargs):
            if not self.ready:
                raise EngineUnavailable(f"{self.name} is restarting")

            async def stream():
                for o in self.outputs:
                    yield o

            return stream()

    def pool(first_reason, decode_ready):
        p = PDPool.__new__(PDPool)
        p.prefill = Side("prefill-0", True, [out(first_reason)])
        p.decode = Side("decode-0", decode_ready, replica=1)
        p.prefills, p.decodes = [p.prefill], [p.decode]
        p.workers, p.router, p._where, p.closing = (
            [p.prefill, p.decode],
            PDRouter(1, 1, 16),
            {},
            False,
        )
        return p

    async def down_meanwhile(p):
        stream = p.generate("r", [1, 2, 3], SamplingParams())  # both ready when routed
        p.decode.ready = False  # the decode side goes down before the hand-off
        got = []
        with pytest.raises(EngineDeadError, match="decode core unavailable"):
            async for o in stream:
                got.append(o)
        return got

    p = pool("handoff", decode_ready=True)
    got = asyncio.run(down_meanwhile(p))
    assert [(o.new_token_ids, o.finished) for o in got] == [([7], False)]
    assert not p._where  # nothing left routed
    # and nothing left counted against either side
    assert p.router.outstanding == [0, 0] and p.router.promised == [0, 0]

    async def all_of(p):
        return [o async for o in p.generate("r", [1, 2, 3], SamplingParams())]

    short = pool("length", decode_ready=True)
    short.decode.generate = None  # never called: a request ended by its first token
    ended = asyncio.run(all_of(short))
    assert [(o.finished, o.finish_reason) for o in ended] == [(True, "length")]
    assert msgspec.structs.asdict(ended[0])["new_token_ids"] == [7]


@pytest.mark.e2e  # a failure drill or tour: `make test-e2e`
@pytest.mark.slow
def test_two_prefill_and_two_decode_cores_route_both_ways_and_equal_colocated(
    tmp_path, smollm2_dir
):
    """``--disaggregation prefill=2,decode=2`` (four engine cores, unpinned, a torch thread
    each) with 12-block decode pools (a request needs up to 9): 10 concurrent greedy requests
    answer exactly what the offline colocated engine answers, though the decode cores hold
    hand-offs back for lack of room (``num_kv_waiting``) and may preempt (whether one does
    depends on when the hand-offs land: a CI run of 2026-12-03 held three back and preempted
    none); the router spreads them over both prefill and both
    decode cores (every pair in the ``kv_transfer`` events' from/to); every pool ends empty
    and /health lists the four cores with their roles."""
    import asyncio
    import json

    import duckdb
    from server_proc import Server

    prompts, params = _requests()
    prompts, params = prompts[:10], params[:10]
    want = [r.text for r in LLM(str(smollm2_dir)).generate(prompts, params)]
    db = tmp_path / "traces.duckdb"
    server = Server(
        tmp_path,
        *("--disaggregation", "prefill=2,decode=2", "--decode-num-gpu-blocks-override", "12"),
        *("--trace-db", str(db)),
    )
    try:
        cores = server.health()["engine"]["replicas"]
        assert [(r["name"], r["role"]) for r in cores] == [
            ("prefill-0", "prefill"),
            ("prefill-1", "prefill"),
            ("decode-0", "decode"),
            ("decode-1", "decode"),
        ]
        assert [r["stats"]["kv_blocks_total"] for r in cores][2:] == [12, 12]

        assert asyncio.run(_greedy_texts(server.url, prompts, params)) == want
        for _ in range(60):
            h = server.health()
            if h["kv_blocks_used"] == 0 and h["in_flight"] == 0:
                break
            time.sleep(0.5)
        assert h["kv_blocks_used"] == 0 and h["in_flight"] == 0, h
        assert all(r["outstanding_tokens"] == 0 for r in h["engine"]["replicas"]), h
    finally:
        server.stop()
    con = duckdb.connect(str(db), read_only=True)
    pairs = set()
    rows = con.execute("SELECT events FROM spans WHERE events LIKE '%kv_transfer%'").fetchall()
    for (events,) in rows:
        for e in json.loads(events):
            if e["name"] == "kv_transfer":
                a = e["attributes"]
                pairs.add((a["tokenmill.from"], a["tokenmill.to"]))
    assert {p for p, _ in pairs} == {"prefill-0", "prefill-1"}
    assert {d for _, d in pairs} == {"decode-0", "decode-1"}
    (preempted,) = con.execute("SELECT sum(preemptions) FROM requests").fetchone()
    (waited,) = con.execute(
        "SELECT max(num_kv_waiting) FROM engine_steps WHERE role = 'decode'"
    ).fetchone()
    roles = dict(con.execute("SELECT role, count(*) FROM engine_steps GROUP BY role").fetchall())
    con.close()
    assert waited >= 1, (preempted, waited)
    assert roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0, roles


def _free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free on 127.0.0.1."""
    import socket

    for _ in range(50):
        p = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise AssertionError("no free port pair")


@pytest.mark.slow
@pytest.mark.e2e
def test_the_host_to_host_recipe_serves_and_recovers_from_a_killed_remote_core(
    tmp_path, smollm2_dir
):
    """docs/engine.md's host-to-host recipe as two processes on localhost, with only its flags:
    ``tokenmill serve --disaggregation prefill=1,decode=1 --remote-decode-listen H:P`` and
    ``tokenmill pd-worker --connect H:P --model DIR``. The decode core runs under the
    pd-worker, not the API; greedy answers equal the colocated engine's; SIGKILL that core
    mid-stream: the streams end (``engine_died``), the pd-worker reports it, every core
    restarts on a fresh link (the remote one again under the same pd-worker) and the next
    requests are answered in full."""
    import asyncio
    import signal
    import subprocess
    import sys

    from server_proc import Server

    port = _free_port_pair()
    log = open(tmp_path / "pd-worker.log", "w")  # noqa: SIM115
    worker = subprocess.Popen(
        [
            *(sys.executable, "-m", "tokenmill.engine.cli", "pd-worker"),
            *("--connect", f"127.0.0.1:{port}", "--model", str(smollm2_dir)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    prompts, params = _requests()
    prompts, params = prompts[:4], params[:4]
    want = [r.text for r in LLM(str(smollm2_dir)).generate(prompts, params)]
    server = None
    try:
        server = Server(
            tmp_path,
            *("--disaggregation", "prefill=1,decode=1"),
            *("--remote-decode-listen", f"127.0.0.1:{port}"),
        )
        decode = server.health()["engine"]["replicas"][1]
        assert decode["name"] == "decode-0" and decode["role"] == "decode"
        with open(f"/proc/{decode['pid']}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        assert parent == worker.pid  # the decode core is the pd-worker's child

        assert asyncio.run(_greedy_texts(server.url, prompts, params)) == want

        async def kill_mid_stream():
            load = asyncio.ensure_future(_streams(server.url, 4, 200))
            await asyncio.to_thread(
                _wait,
                server,
                lambda h: h["engine"]["replicas"][1]["stats"].get("num_running", 0) >= 2,
            )
            os.kill(decode["pid"], signal.SIGKILL)
            return await load

        results = asyncio.run(kill_mid_stream())
        assert any(r["error"] and r["error"]["code"] == "engine_died" for r in results), results
        health = _wait(server, lambda h: h["status"] == "ok")
        replicas = health["engine"]["replicas"]
        assert all(r["restarts"] >= 1 for r in replicas), replicas
        assert replicas[1]["pid"] != decode["pid"] and worker.poll() is None
        assert asyncio.run(_greedy_texts(server.url, prompts, params)) == want
    finally:
        if server is not None:
            server.stop()
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
    assert "exited with code -9" in (tmp_path / "pd-worker.log").read_text()


def _split_text(prefill: LLM, decode: LLM, prompt: str, sp: SamplingParams) -> tuple[str, str]:
    """One request prefilled on ``prefill`` and decoded on ``decode``: its streamed text
    (every delta of both sides, in order) and its finish reason."""
    p, d = prefill.core, decode.core
    p.add_request("r", prefill.tokenizer.encode(prompt), sp, hand_off=True)
    text, reason = "", None
    while reason is None:
        for out in p.step()[0]:
            text += out.new_text
            if out.finished:
                reason = out.finish_reason
    if reason != "handoff":
        return text, reason
    assert d.adopt(p.take_handoff("r")) is not None
    reason = None
    while reason is None:
        for out in d.step()[0]:
            text += out.new_text
            if out.finished:
                reason = out.finish_reason
    return text, reason


@pytest.mark.slow
def test_stop_strings_hold_across_the_hand_off(smollm2_dir):
    """A stop string that begins with the first token's text: the prefill side must not
    flush the text it holds back when it hands the request off (the decode side holds and
    releases it), so the client sees it once, or not at all when the stop string matches."""
    llm = LLM(str(smollm2_dir))
    prefill, decode = LLM(str(smollm2_dir)), LLM(str(smollm2_dir))
    prompt = "The capital of France is"
    plain = SamplingParams(max_tokens=8, temperature=0)
    full = llm.generate([prompt], [plain])[0]
    first = llm.tokenizer.decode(full.token_ids[:1])
    assert first and full.text.startswith(first)
    never = SamplingParams(max_tokens=8, temperature=0, stop=(first + "\u2603never",))
    assert _split_text(prefill, decode, prompt, never) == (full.text, "length")
    at_once = SamplingParams(max_tokens=8, temperature=0, stop=(full.text[: len(first) + 2],))
    want = llm.generate([prompt], [at_once])[0]
    assert want.text == "" and want.finish_reason == "stop"
    assert _split_text(prefill, decode, prompt, at_once) == ("", "stop")


def test_the_router_spreads_a_burst_and_refuses_what_no_decode_pool_holds():
    """``PDPool.generate`` takes the router's counts when it routes: two requests routed
    before either stream runs go to different prefill cores, and are promised to the decode
    core with the most free blocks less the blocks already promised; a stream closed before
    it ran gives its counts back; a request whose prompt + max_tokens exceeds every decode
    pool is refused before any prefill (RequestRejected, the API's 400)."""
    import asyncio

    from tokenmill.engine.api.disaggregated import PDPool, PDRouter
    from tokenmill.engine.errors import RequestRejected

    class Core:
        def __init__(self, name, replica, free=0, total=0):
            self.name, self.replica, self.ready, self.state = name, replica, True, "ready"
            self.engine = types.SimpleNamespace(
                stats={"kv_blocks_free": free, "kv_blocks_total": total}
            )

        def generate(self, *args, **kwargs):
            raise AssertionError("no stream in this test runs")

    p = PDPool.__new__(PDPool)
    p.prefills = [Core("prefill-0", 0), Core("prefill-1", 1)]
    p.decodes = [Core("decode-0", 2, free=10, total=12), Core("decode-1", 3, free=8, total=12)]
    p.workers = p.prefills + p.decodes
    p.router, p._where, p.closing = PDRouter(2, 2, 16), {}, False
    a = p.generate("a", [1] * 40, SamplingParams(max_tokens=8))  # 3 blocks of prompt
    b = p.generate("b", [1] * 40, SamplingParams(max_tokens=8))
    assert a.held.prefill != b.held.prefill  # the burst spreads over both prefill cores
    assert (a.held.decode, b.held.decode) == (2, 3)  # 10 free, then 10 - 3 = 7 < 8
    assert p.router.outstanding == [40, 40, 0, 0] and p.router.promised == [0, 0, 3, 3]
    asyncio.run(a.aclose())
    asyncio.run(b.aclose())  # closed before they ran (a client gone before the response)
    assert p.router.outstanding == [0, 0, 0, 0] and p.router.promised == [0, 0, 0, 0]
    with pytest.raises(RequestRejected, match="needs 13 KV blocks but a decode core's pool has 12"):
        p.generate("c", [1] * 200, SamplingParams(max_tokens=8))
    assert p.router.outstanding == [0, 0, 0, 0] and not p._where
    # what the client must cut: the prompt when it alone can never fit, else max_tokens
    for prompt, max_tokens, blame in ((200, 8, "prompt"), (40, 400, "max_tokens")):
        with pytest.raises(RequestRejected) as err:
            p.generate("d", [1] * prompt, SamplingParams(max_tokens=max_tokens))
        assert err.value.blame == blame, str(err.value)


@pytest.mark.slow
def test_a_request_no_decode_pool_holds_is_a_400_naming_the_field(tmp_path):
    """``--disaggregation prefill=1,decode=1`` with an 8-block (128-token) decode pool: a
    request that can never fit it is refused before any prefill with an OpenAI-style 400
    naming what to cut (``max_tokens``, ``messages`` or ``prompt``), streamed or not, and no
    traceback in the log; a request that fits is answered. Before: 500 ``internal_error``."""
    import httpx
    from server_proc import Server

    server = Server(
        tmp_path,
        *("--disaggregation", "prefill=1,decode=1", "--decode-num-gpu-blocks-override", "8"),
    )
    model = "smollm2-135m-instruct"
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    long_text = "one two three four five six seven eight nine ten " * 20  # > 128 tokens
    cases = [
        ("/v1/chat/completions", {**chat, "max_tokens": 200}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 200}, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": 200, "stream": True}, "max_tokens"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": long_text}]},
            "messages",
        ),
        ("/v1/completions", {"model": model, "prompt": [7] * 150, "max_tokens": 4}, "prompt"),
    ]
    try:
        for path, body, param in cases:
            if "max_completion_tokens" in body:
                body = {k: v for k, v in body.items() if k != "max_tokens"}
            r = httpx.post(server.url + path, json=body, timeout=120)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"], err["type"]) == (
                param,
                "context_length_exceeded",
                "invalid_request_error",
            ), err
            assert "decode core's pool has 8 (128 tokens)" in err["message"], err
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        assert server.health()["in_flight"] == 0
    finally:
        server.stop()
    log = (tmp_path / f"server-{server.port}.log").read_text()
    assert "Traceback" not in log and "internal_error" not in log, log[-3000:]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            {"disaggregation": "prefill=1,decode=2", "remote_decode_listen": "127.0.0.1:65533"},
            "2 decode core(s) take ports 65533..65536, past 65535",
        ),
        (
            {"disaggregation": "prefill=1,decode=1", "remote_decode_listen": "no-port"},
            "--remote-decode-listen: expected HOST:PORT",
        ),
        ({"remote_decode_listen": "127.0.0.1:29700"}, "need --disaggregation"),
        (
            {"disaggregation": "prefill=1,decode=1", "prefill_devices": "0-99999999999"},
            "names core(s) [",
        ),
        ({"disaggregation": "prefill=\uff11,decode=1"}, "takes 'prefill=P,decode=D'"),
    ],
)
def test_the_remote_and_placement_flags_are_refused_in_one_line(flags, needle):
    from tokenmill.engine.config import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig(**flags).validate()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_remote_listen_address_this_host_lacks_is_one_line():
    from tokenmill.engine.api.disaggregated import PDPool
    from tokenmill.engine.config import EngineConfig

    cfg = EngineConfig(
        disaggregation="prefill=1,decode=1", remote_decode_listen="10.255.255.1:29700"
    )
    with pytest.raises(
        ValueError, match=r"--remote-decode-listen 10.255.255.1:29700: cannot listen"
    ):
        PDPool(cfg, cfg.pd_spec())


def test_pd_worker_names_connect_when_it_is_malformed():
    from tokenmill.engine.parallel.pd_remote import addresses

    for bad in ("garbage", "127.0.0.1", ":0", "127.0.0.1:65535"):
        with pytest.raises(ValueError, match="--connect"):
            addresses(bad)
    assert addresses("10.0.0.1:29700") == ("tcp://10.0.0.1:29700", "tcp://10.0.0.1:29701")
