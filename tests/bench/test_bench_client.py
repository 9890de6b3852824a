"""Fast tests of ``tokenmill bench`` (no model): TTFT/ITL/TPOT clocking against a stub SSE
server, phases and arrivals, workloads, the report, recording into a store, CLI errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
from bench_stub import StubServer
from rich.console import Console

from tokenmill.bench.cli import BenchInputError, BenchOptions, run_bench
from tokenmill.bench.client import BenchConfig, BenchError, RequestResult, abort_plan, run
from tokenmill.bench.phases import Phase, arrival_times, gamma_gaps, parse_phases
from tokenmill.bench.record import RecordError, record_client_timings
from tokenmill.bench.report import group_metrics, meets_slos, parse_goodput, summarize
from tokenmill.bench.workload import (
    PromptMaker,
    Workload,
    WorkloadError,
    load_dataset,
    parse_length,
    parse_multi_turn,
    parse_shared_prefix,
)
from tokenmill.telemetry.schema import apply_schema

D_S, GAP_S, TOKENS = 0.3, 0.1, 5
TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


def _config(url: str, **kw) -> BenchConfig:
    kw.setdefault(
        "workload", Workload(prompt_tokens=parse_length("16"), output_tokens=parse_length("8"))
    )
    kw.setdefault("phases", [Phase("main", math.inf)])
    return BenchConfig(url=url, **kw)


def _run(cfg: BenchConfig):
    return asyncio.run(run(cfg))


# ----- clocking against the stub SSE server -----


@pytest.fixture(scope="module")
def stub():
    with StubServer(D_S, GAP_S, TOKENS) as s:
        yield s


@pytest.fixture
def fresh(stub):
    stub.delay_s, stub.gap_s, stub.tokens, stub.mode = D_S, GAP_S, TOKENS, "ok"
    stub.seen.clear()
    stub.cut_short.clear()
    return stub


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_ttft_is_the_first_token_chunk_not_the_role_frame(fresh, endpoint):
    """Role-only frame and keep-alive at once, an empty frame, content after D: TTFT = D."""
    run_ = _run(_config(fresh.url, endpoint=endpoint, concurrency=1, num_requests=3))
    assert run_.model == "stub-model"
    d_ms, gap_ms = D_S * 1000, GAP_S * 1000
    ttfts = []
    for r in run_.results:
        assert r.ok, r.error
        assert r.ttft_ms >= d_ms  # never clocked at the role/empty frame or the comment
        ttfts.append(r.ttft_ms)
        assert r.output_tokens == TOKENS and r.usage_reported
        # ITL from the token chunks' arrivals: TOKENS - 1 gaps of about GAP each
        assert len(r.itl_ms) == TOKENS - 1
        assert abs(statistics.mean(r.itl_ms) - gap_ms) < 50
        assert sum(r.itl_ms) == pytest.approx((r.chunk_s[-1] - r.chunk_s[0]) * 1000)
        assert r.ttft_ms == pytest.approx(r.chunk_s[0] * 1000)
        # TPOT = (E2E - TTFT) / (tokens - 1), on the recorded timings
        assert r.tpot_ms == (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1)
        assert r.e2e_ms >= r.ttft_ms + sum(r.itl_ms)
    # within a few tens of ms of D (the median of three, so one scheduling hiccup of a loaded
    # machine does not decide it)
    assert abs(statistics.median(ttfts) - d_ms) < 50, ttfts


def test_each_request_sends_traceparent_and_request_id(fresh):
    fresh.delay_s = fresh.gap_s = 0.0
    run_ = _run(_config(fresh.url, concurrency=2, num_requests=6))
    sent = [s for s in fresh.seen if not s["x-request-id"].endswith("-probe")]
    assert len(sent) == 6
    ids = {s["x-request-id"]: s for s in sent}
    assert len(ids) == 6
    for r in run_.results:
        seen = ids[r.request_id]
        m = TRACEPARENT_RE.match(seen["traceparent"])
        assert m and m.group(1) == r.trace_id
        assert r.request_id == f"bench-{run_.run_id}-{r.index}"
        body = seen["body"]
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 8
    assert len({TRACEPARENT_RE.match(s["traceparent"]).group(1) for s in sent}) == 6


def test_stream_errors_and_missing_done_are_failures(fresh):
    fresh.delay_s = fresh.gap_s = 0.0
    fresh.mode = "stream_error"
    r = _run(_config(fresh.url, concurrency=1, num_requests=2))
    assert [x.ok for x in r.results] == [False, False]
    assert r.results[0].error == "server error in stream: engine exploded"
    fresh.mode = "no_done"
    r = _run(_config(fresh.url, concurrency=1, num_requests=1))
    assert r.results[0].error == "the stream ended before [DONE]"
    assert r.results[0].ttft_ms is not None  # tokens came, but the request did not complete
    doc = summarize(r)
    assert doc["completed"] == 0 and doc["failed"] == 1
    assert doc["errors"] == {"the stream ended before [DONE]": 1}


def test_client_aborts_close_the_stream_mid_way(fresh):
    """--abort-fraction: the chosen requests close their stream after k token chunks; they
    count as aborted (not completed, not failed) and the server sees the connection go."""
    fresh.delay_s, fresh.gap_s, fresh.tokens = 0.0, 0.05, 6
    cfg = _config(fresh.url, concurrency=2, num_requests=8, abort_fraction=1.0, seed=3)
    r = _run(cfg)
    plans = [abort_plan(3, i, 1.0, 8) for i in range(8)]
    assert all(p is not None and 1 <= p <= 4 for p in plans)
    for res, k in zip(r.results, plans):
        assert res.aborted and not res.ok
        assert res.output_tokens == k  # stopped right after its k-th token chunk
        assert res.error == f"aborted by the client after {k} token chunk(s)"
    doc = summarize(r)
    assert (doc["completed"], doc["failed"], doc["aborted"]) == (0, 0, 8)
    assert doc["errors"] == {}
    deadline = time.monotonic() + 5
    while len(fresh.cut_short) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh.cut_short == {res.request_id for res in r.results}
    # a fraction: deterministic per (seed, index), near the asked share over many requests
    share = np.mean([abort_plan(s, i, 0.2, 64) is not None for s in range(10) for i in range(100)])
    assert 0.16 < share < 0.24
    assert abort_plan(1, 1, 0.0, 64) is None
    fresh.cut_short.clear()
    r = _run(_config(fresh.url, concurrency=2, num_requests=4))
    assert all(x.ok and not x.aborted for x in r.results) and not fresh.cut_short


def test_a_failing_probe_stops_the_run_before_the_clock(fresh):
    fresh.mode = "http500"
    with pytest.raises(
        BenchError, match=r"^the first request to .* failed: HTTP 500: stub failure$"
    ):
        _run(_config(fresh.url, concurrency=1, num_requests=1))
    assert len(fresh.seen) == 1


def test_open_loop_phases_against_the_stub(fresh):
    fresh.delay_s = fresh.gap_s = 0.0
    fresh.tokens = 2
    phases = [Phase("steady", 0.6), Phase("burst", 0.6, 3.0)]
    cfg = _config(fresh.url, request_rate=20.0, burstiness=1.0, phases=phases, seed=7)
    r = _run(cfg)
    planned = arrival_times(20.0, 1.0, phases, np.random.default_rng(7))
    assert [x.planned_s for x in r.results] == [p for p, _ in planned]
    assert [x.phase for x in r.results] == [k for _, k in planned]
    assert all(x.ok for x in r.results)
    assert all(x.lag_ms >= 0 for x in r.results)
    doc = summarize(r, parse_goodput(["ttft:5000"]))
    assert [p["name"] for p in doc["phases"]] == ["steady", "burst"]
    assert [p["offered_request_rate"] for p in doc["phases"]] == [20.0, 60.0]
    assert sum(p["num_prompts"] for p in doc["phases"]) == doc["num_prompts"] == len(planned)
    for p in doc["phases"]:
        assert p["completed"] == p["num_prompts"]
        assert p["duration"] >= 0.6
        assert p["good_requests"] == p["completed"]
        assert set(p["client_lag_ms"]) == {"mean", "median", "p99", "max"}
    assert doc["loop"] == "open" and doc["request_rate"] == 20.0
    json.dumps(doc)  # serializable


def test_closed_loop_phases_scale_the_workers(fresh):
    fresh.delay_s, fresh.gap_s, fresh.tokens = 0.05, 0.0, 1
    phases = [Phase("one", 0.5), Phase("three", 0.5, 3.0)]
    r = _run(_config(fresh.url, concurrency=1, phases=phases))
    by_phase = [[x for x in r.results if x.phase == k] for k in (0, 1)]
    assert by_phase[0] and by_phase[1]
    # one worker sends one at a time: its requests never overlap
    one = sorted(by_phase[0], key=lambda x: x.sent_s)
    assert all(a.done_s <= b.sent_s for a, b in itertools.pairwise(one))
    assert len(by_phase[1]) > len(by_phase[0])
    doc = summarize(r)
    assert [p["concurrency"] for p in doc["phases"]] == [1, 3]
    assert doc["loop"] == "closed" and doc["max_concurrency"] == 1


# ----- phases and arrivals -----


def test_parse_phases():
    assert parse_phases("warmup:20s,steady:60s,overload:30s@3x,recovery:40s") == [
        Phase("warmup", 20.0),
        Phase("steady", 60.0),
        Phase("overload", 30.0, 3.0),
        Phase("recovery", 40.0),
    ]
    assert parse_phases(" a:500ms , b:1.5m@0.5x,c:1h@2 ") == [
        Phase("a", 0.5),
        Phase("b", 90.0, 0.5),
        Phase("c", 3600.0, 2.0),
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("steady", "phase 'steady': expected name:duration"),
        ("steady:60x", "phase 'steady:60x': bad duration '60x'"),
        ("a:10s,b:5x", "phase 'b:5x': bad duration '5x'"),
        ("a:10s,,b:5s", "phase 2 is empty"),
        ("a:10s@zx", "phase 'a:10s@zx': bad rate multiplier 'zx'"),
        ("a:10s@0x", "phase 'a:10s@0x': bad rate multiplier '0x': must be more than 0"),
        ("a:0s", "phase 'a:0s': bad duration '0s': must be more than 0"),
        ("1a:5s", "bad name '1a'"),
        ("a:5s,a:6s", "phase name 'a' is used twice"),
        ("", "empty phases spec"),
    ],
)
def test_malformed_phases_name_the_bad_part(spec, message):
    with pytest.raises(ValueError) as exc:
        parse_phases(spec)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_phases_yaml(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(
        "phases:\n  - {name: steady, duration: 60s}\n  - {name: over, duration: 30, rate: 3x}\n"
    )
    assert parse_phases(str(f)) == [Phase("steady", 60.0), Phase("over", 30.0, 3.0)]
    f.write_text("- {name: steady}\n")
    with pytest.raises(ValueError, match="phase 'steady': missing duration"):
        parse_phases(str(f))
    f.write_text("- {name: s, duration: 1s, speed: 2}\n")
    with pytest.raises(ValueError, match="unknown key 'speed'"):
        parse_phases(str(f))
    f.write_text("phases: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_phases(str(f))
    with pytest.raises(ValueError, match="no such file"):
        parse_phases(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_gamma_gaps_have_mean_one_over_rate(burstiness):
    rate = 4.0
    gaps = gamma_gaps(rate, burstiness, 40_000, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # the squared coefficient of variation is 1/B: burstier below 1
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.08)


def test_arrival_times_follow_the_phase_rates():
    phases = [Phase("a", 100.0), Phase("b", 100.0, 3.0)]
    arr = arrival_times(5.0, 1.0, phases, np.random.default_rng(3))
    a = [t for t, k in arr if k == 0]
    b = [t for t, k in arr if k == 1]
    assert all(0 <= t < 100 for t in a) and all(100 <= t < 200 for t in b)
    assert len(a) == pytest.approx(500, rel=0.15)
    assert len(b) == pytest.approx(1500, rel=0.1)
    assert arr == sorted(arr)
    assert len(arrival_times(5.0, 1.0, [Phase("x", math.inf)], np.random.default_rng(0), 37)) == 37
    assert arrival_times(math.inf, 1.0, phases, np.random.default_rng(0), 3) == [(0.0, 0)] * 3


# ----- workloads -----


def test_length_specs():
    rng = np.random.default_rng(0)
    assert parse_length("128").sample(rng) == 128
    assert parse_length("fixed:7").sample(rng) == 7
    u = parse_length("uniform:10:20")
    assert {u.sample(rng) for _ in range(500)} == set(range(10, 21))
    assert parse_length("uniform:10-20") == u
    ln = parse_length("lognormal:200:0.5")
    xs = [ln.sample(rng) for _ in range(20_000)]
    assert statistics.mean(xs) == pytest.approx(200, rel=0.03) and min(xs) >= 1
    for bad in [
        "",
        "x",
        "uniform:5",
        "uniform:9:3",
        "fixed:0",
        "1.5",
        "lognormal:100:0",
        "gauss:3",
    ]:
        with pytest.raises(WorkloadError):
            parse_length(bad, "--prompt-tokens")


def test_prompts_are_words_of_the_asked_length():
    maker = PromptMaker()
    rng = np.random.default_rng(0)
    for n in (1, 17, 300):
        assert len(maker.text(n, rng).split()) == n


def test_prompt_lengths_with_the_model_tokenizer():
    from tokenmill.bench.workload import load_tokenizer
    from tokenmill.engine.model_fetch import default_model_dir

    path = default_model_dir() / "tokenizer.json"
    if not path.is_file():
        pytest.skip("the default model is not fetched")
    tok = load_tokenizer(path.parent)
    maker = PromptMaker(tok)
    rng = np.random.default_rng(0)
    for n in (1, 9, 128, 1000):
        text = maker.text(n, rng)
        assert len(tok.encode(text, add_special_tokens=False).ids) == n
    with pytest.raises(WorkloadError, match=r"no tokenizer\.json"):
        load_tokenizer(path.parent / "nowhere")


def test_shared_prefix_and_volatile_field():
    w = Workload(prompt_tokens=parse_length("8"), shared_prefix=parse_shared_prefix("40:3"))
    reqs = [w.make(i) for i in range(7)]
    systems = [r.messages[0]["content"] for r in reqs]
    assert systems[0] == systems[1] == systems[2] != systems[3]
    assert systems[3] == systems[5] != systems[6]
    assert len(systems[0].split()) == 40
    assert reqs[0].messages[1]["content"] != reqs[1].messages[1]["content"]
    assert reqs[0].prompt_tokens == 48
    v = Workload(
        prompt_tokens=parse_length("8"), shared_prefix=parse_shared_prefix("40:3:volatile")
    )
    a, b = v.make(0).messages[0]["content"], v.make(1).messages[0]["content"]
    assert a.startswith("Current time: ") and b.startswith("Current time: ")
    assert a != b and a.split("\n", 1)[1] == b.split("\n", 1)[1] == systems[0]
    with pytest.raises(WorkloadError, match="L:G"):
        parse_shared_prefix("40")


def test_multi_turn_chats_grow():
    w = Workload(
        prompt_tokens=parse_length("5"),
        output_tokens=parse_length("7"),
        multi_turn=parse_multi_turn("3:2"),
    )
    reqs = [w.make(i) for i in range(8)]
    assert [r.tag for r in reqs] == [
        "conv-0/turn-1", "conv-1/turn-1", "conv-0/turn-2", "conv-1/turn-2",
        "conv-0/turn-3", "conv-1/turn-3", "conv-2/turn-1", "conv-3/turn-1",
    ]  # fmt: skip
    t1, t2, t3 = reqs[0].messages, reqs[2].messages, reqs[4].messages
    assert [m["role"] for m in t3] == ["user", "assistant", "user", "assistant", "user"]
    assert t2[: len(t1)] == t1 and t3[: len(t2)] == t2
    assert len(t2[1]["content"].split()) == 7  # the synthetic answer is as long as the output
    assert reqs[4].prompt_tokens == 5 + 7 + 5 + 7 + 5


def test_workload_is_deterministic_per_index():
    a = Workload(prompt_tokens=parse_length("uniform:5:50"), seed=3)
    b = Workload(prompt_tokens=parse_length("uniform:5:50"), seed=3)
    assert [a.make(i).messages for i in (5, 0, 9)] == [b.make(i).messages for i in (5, 0, 9)]
    assert a.make(1).messages != Workload(seed=4, prompt_tokens=a.prompt_tokens).make(1).messages


def test_dataset_prompts_and_sharegpt(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        json.dumps({"prompt": "Why is the sky blue?", "max_tokens": 9})
        + "\n\n"
        + json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello!"},
                    {"from": "human", "value": "Name a color."},
                    {"from": "gpt", "value": "Blue."},
                ]
            }
        )
        + "\n"
    )
    entries = load_dataset(f)
    w = Workload(output_tokens=parse_length("4"), dataset=entries)
    r0, r1, r2 = w.make(0), w.make(1), w.make(2)
    assert r0.messages == [{"role": "user", "content": "Why is the sky blue?"}]
    assert r0.max_tokens == 9 and r0.tag == "line-1"
    assert [m["role"] for m in r1.messages] == ["system", "user", "assistant", "user"]
    assert r1.messages[-1]["content"] == "Name a color." and r1.max_tokens == 4
    assert r1.tag == "line-3" and r2.messages == r0.messages  # cycled
    assert r1.body("completions", "m")["prompt"] == "Be brief.\n\nHi\n\nHello!\n\nName a color."
    # nucleus sampling is sent only when asked for (the server's default is 1)
    assert "top_p" not in r1.body("chat", "m")
    assert r1.body("chat", "m", temperature=1.0, top_p=0.9)["top_p"] == 0.9


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"text": "x"}', "expected a 'prompt' or a ShareGPT 'conversations' list"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be a whole number"),
        ('{"conversations": [{"from": "gpt", "value": "x"}]}', "has no human turn"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown speaker 'alien'"),
    ],
)
def test_malformed_jsonl_line_names_the_line(tmp_path, line, reason):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "fine"}\n\n' + line + "\n" + '{"prompt": "fine"}\n')
    with pytest.raises(WorkloadError) as exc:
        load_dataset(f)
    msg = str(exc.value)
    assert msg.startswith(f"{f}:3: ") and reason in msg and "\n" not in msg


# ----- report -----


def _result(i, ttft, itl, e2e, tokens, ok=True, phase=0, lag=0.0):
    r = RequestResult(i, f"r{i}", "t", phase, planned_s=0.0, sent_s=lag / 1000, done_s=1.0)
    r.ok, r.ttft_ms, r.itl_ms, r.e2e_ms = ok, ttft, itl, e2e
    r.output_tokens, r.prompt_tokens = tokens, 10
    r.error = None if ok else "boom"
    return r


def test_group_metrics_and_goodput():
    rs = [
        _result(0, 100.0, [10.0, 30.0], 200.0, 3, lag=1.0),
        _result(1, 300.0, [20.0], 400.0, 2, lag=3.0),
        _result(2, None, [], None, 0, ok=False),
    ]
    m = group_metrics(rs, 2.0, parse_goodput(["ttft:200", "itl:25"]))
    assert m["completed"] == 2 and m["failed"] == 1 and m["num_prompts"] == 3
    assert m["request_throughput"] == 1.0
    assert m["output_throughput"] == 2.5 and m["total_token_throughput"] == 12.5
    assert m["mean_ttft_ms"] == 200.0 and m["median_ttft_ms"] == 200.0
    assert m["mean_itl_ms"] == 20.0  # pooled gaps
    assert m["mean_tpot_ms"] == pytest.approx(((200 - 100) / 2 + (400 - 300) / 1) / 2)
    assert m["mean_e2el_ms"] == 300.0 and m["p99_e2el_ms"] == pytest.approx(398.0)
    # request 0 has a 30 ms gap (> 25), request 1 a 300 ms TTFT (> 200): none is good
    assert m["good_requests"] == 0 and m["request_goodput"] == 0.0
    assert meets_slos(rs[0], {"ttft": 200, "itl": 30}) and not meets_slos(rs[2], {"ttft": 1e9})
    # ITL is judged on the request's own p99, as the store's goodput: one 100 ms hiccup in 200
    # gaps of 10 ms passes a 50 ms SLO (its largest gap would not)
    hiccup = _result(3, 100.0, [10.0] * 199 + [100.0], 2200.0, 201)
    assert meets_slos(hiccup, {"itl": 50}) and not meets_slos(hiccup, {"itl": 9})
    assert m["client_lag_ms"]["max"] == pytest.approx(3.0)
    assert m["errors"] == {"boom": 1}
    assert group_metrics([], 1.0, None)["mean_ttft_ms"] is None


def test_parse_goodput():
    assert parse_goodput(["ttft:500 itl:50", "e2e:2000ms,tpot:20"]) == {
        "ttft": 500.0,
        "itl": 50.0,
        "e2e": 2000.0,
        "tpot": 20.0,
    }
    assert parse_goodput(None) is None
    for bad in (["ttft"], ["latency:5"], ["ttft:-1"], ["ttft:0"]):
        with pytest.raises(ValueError, match="bad goodput SLO"):
            parse_goodput(bad)


# ----- recording into a store -----


def _store(path: Path, ids: list[str]) -> None:
    con = duckdb.connect(str(path))
    apply_schema(con)
    for n, cid in enumerate(ids):
        con.execute(
            "INSERT INTO requests (request_id, client_request_id, trace_id, arrival_ns, end_ns, "
            "ttft_ms) VALUES (?, ?, 't', 0, 1, 5.0)",
            [f"cmpl-{n}", cid],
        )
    con.close()


def test_record_client_ttft_into_a_closed_store(tmp_path):
    db = tmp_path / "traces.duckdb"
    _store(db, ["bench-x-0", "bench-x-1", "other"])
    rs = [_result(0, 12.5, [], 20.0, 1), _result(1, None, [], None, 0, ok=False)]
    rs[0].request_id, rs[1].request_id = "bench-x-0", "bench-x-1"
    extra = {"request_id": "bench-x-9", "ttft_ms": 3.0}  # a dict from a results JSON
    s = record_client_timings(db, [*rs, extra])
    assert (s.written, s.unmatched, s.skipped) == (1, 1, 1)
    con = duckdb.connect(str(db), read_only=True)
    rows = dict(con.execute("SELECT client_request_id, client_ttft_ms FROM requests").fetchall())
    con.close()
    assert rows == {"bench-x-0": 12.5, "bench-x-1": None, "other": None}


def test_record_refuses_what_is_not_a_store(tmp_path):
    with pytest.raises(RecordError, match="no such file"):
        record_client_timings(tmp_path / "nope.duckdb", [])
    (tmp_path / "x.txt").write_text("hello, this is not duckdb")
    with pytest.raises(RecordError, match="not a DuckDB file"):
        record_client_timings(tmp_path / "x.txt", [])
    duckdb.connect(str(tmp_path / "plain.duckdb")).close()
    with pytest.raises(RecordError, match="not a tokenmill trace store"):
        record_client_timings(tmp_path / "plain.duckdb", [])


def test_bench_out_then_record_from_results(fresh, tmp_path):
    fresh.delay_s = fresh.gap_s = 0.0
    out = tmp_path / "r.json"
    console = Console(file=open(os.devnull, "w"), width=200)  # noqa: SIM115
    opts = BenchOptions(
        url=fresh.url, concurrency=2, num_requests=4, prompt_tokens="8", output_tokens="3",
        out=out, progress=False, goodput=["ttft:1000"],
    )  # fmt: skip
    rc = run_bench(opts, extra=["e2e:5000"], console=console)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["completed"] == 4 and doc["goodput_slos_ms"] == {"ttft": 1000.0, "e2e": 5000.0}
    assert len(doc["phases"]) == 1 and len(doc["requests"]) == 4
    db = tmp_path / "store.duckdb"
    _store(db, [r["request_id"] for r in doc["requests"]])
    assert run_bench(BenchOptions(from_results=out, record_to=db), console=console) == 0
    con = duckdb.connect(str(db), read_only=True)
    got = dict(con.execute("SELECT client_request_id, client_ttft_ms FROM requests").fetchall())
    con.close()
    assert got == {r["request_id"]: r["ttft_ms"] for r in doc["requests"]}
    with pytest.raises(BenchInputError, match="needs --record-to"):
        run_bench(BenchOptions(from_results=out))


# ----- the command line -----


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "TOKENMILL_DEBUG": ""},
    )


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    return lines[0]


def test_cli_unreachable_and_unknown_urls_exit_2():
    from server_proc import free_port

    line = _one_error_line(_cli("--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1"))
    assert "cannot connect to http://127.0.0.1:" in line and "refused" in line
    line = _one_error_line(_cli("--url", "http://no-such-host.invalid:8000"))
    assert "cannot connect to http://no-such-host.invalid:8000" in line


def test_cli_bad_input_is_one_line(tmp_path):
    line = _one_error_line(_cli("--url", "http://127.0.0.1:1", "--phases", "steady:60s,over:3y@2x"))
    assert (
        line
        == "error: --phases: phase 'over:3y@2x': bad duration '3y': expected a number and a unit "
        "ms, s, m, h or d (500ms, 30s, 10m, 2h, 7d; a bare number is s)"
    )
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    line = _one_error_line(_cli("--url", "http://127.0.0.1:1", "--dataset", str(f)))
    assert f"{f}:2: not valid JSON" in line
    line = _one_error_line(
        _cli("--url", "http://127.0.0.1:1", "--request-rate", "2", "--concurrency", "2")
    )
    assert "not both" in line
    _one_error_line(_cli("--url", "http://127.0.0.1:1", "--goodput", "ttft:5", "oops"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"abort_fraction": 1.5}, "--abort-fraction must be between 0 and 1, got 1.5"),
        ({"abort_fraction": float("nan")}, "--abort-fraction must be between 0 and 1"),
        ({"timeout": float("nan")}, "--timeout must be a finite number"),
        ({"timeout": float("inf")}, "--timeout must be a finite number"),
        ({"drain_timeout": float("nan")}, "--drain-timeout must be a finite number"),
        ({"prompt_tokens": "-5"}, "cannot be negative"),
        ({"output_tokens": "lognormal:256:-1"}, "cannot be negative"),
        (
            {"request_rate": 1.0, "phases": "a:1s@99999999999x"},
            "plans about 1e+11 requests; at most 1,000,000",
        ),
        ({"concurrency": 4, "phases": "a:1s@1000000x"}, "asks for 4e+06 clients"),
        ({"request_rate": 1.0, "phases": "a:nans"}, "bad duration"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1]"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1]"),
    ],
)
def test_bad_numbers_are_refused_before_anything_is_sent(kwargs, message):
    with pytest.raises(BenchInputError, match=re.escape(message)):
        run_bench(BenchOptions(url="http://127.0.0.1:1", progress=False, **kwargs))


def test_bad_phase_and_dataset_files_name_the_file(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000)
    bad_utf8 = tmp_path / "latin.yaml"
    bad_utf8.write_bytes(b"\xff\xfe phases")
    nan = tmp_path / "nan.yaml"
    nan.write_text("- {name: a, duration: .nan}\n")
    for f, reason in (
        (deep, "nested too deeply"),
        (bad_utf8, "not UTF-8 text"),
        (nan, "must be a finite number more than 0"),
    ):
        with pytest.raises(BenchInputError, match=f"phases file {re.escape(str(f))}.*{reason}"):
            run_bench(
                BenchOptions(
                    url="http://127.0.0.1:1", progress=False, request_rate=1.0, phases=str(f)
                )
            )
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(BenchInputError, match=f"{re.escape(str(data))}:2: JSON nested too deeply"):
        run_bench(BenchOptions(url="http://127.0.0.1:1", progress=False, dataset=data))
    data.write_text('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}\n")
    with pytest.raises(BenchInputError, match=f"{re.escape(str(data))}:1: unreadable JSON value"):
        run_bench(BenchOptions(url="http://127.0.0.1:1", progress=False, dataset=data))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(BenchInputError, match="not a regular file"):
        run_bench(BenchOptions(url="http://127.0.0.1:1", progress=False, dataset=fifo))


def test_error_lines_print_the_input_as_typed():
    """Rich's emoji codes (":joy:") in a user's value are not turned into emoji."""
    line = _one_error_line(_cli("--url", "http://127.0.0.1:1", "--phases", "x:joy:1s"))
    assert "'x:joy:1s'" in line and "\U0001f602" not in line


def test_progress_without_a_terminal_prints_phase_elapsed_and_counts():
    """Issue 19 item 13: a run whose output is not a terminal (make demo's tour, a CI log) says
    where it is — phase, elapsed time, requests sent/done/failed/in flight — at each phase
    start and every 10 s, instead of nothing until the table."""
    import io

    from tokenmill.bench.report import BenchProgress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    bar = BenchProgress(console, parse_phases("healthy:25s,overload:25s@5x"), None, every_s=10)
    with bar:
        for k in range(301):  # 0..60 s in the client's 0.2 s ticks
            t = k / 5
            if k % 10 == 0:  # a request every 2 s, done 4 s later; every 5th fails
                bar.sent(_result(k, 0.1, [0.01], 1.0, 2))
            if k % 10 == 0 and k >= 20:
                bar.done(_result(k - 20, 0.1, [0.01], 1.0, 2, ok=(k // 10) % 5 != 0))
            bar.tick(t)
    lines = buf.getvalue().splitlines()
    phases = [re.match(r"\s+\[(\w+)\] ", line).group(1) for line in lines]
    assert phases == ["healthy"] * 3 + ["overload"] * 3 + ["draining"] * 2, lines
    assert lines[0] == "  [healthy] 0 s of 50 s · sent 1 · done 0 · failed 0 · in flight 1"
    assert lines[3].startswith("  [overload] 25 s of 50 s · sent 13 · done 9 · failed 2")
    assert lines[-1].endswith("sent 31 · done 23 · failed 6 · in flight 2")
