"""``tokenmill explain``: one request's critical path from the store.

A store written through the real telemetry (``Telemetry.on_step``/``on_request``) with step
records and timelines set by hand, so every part's cause and length is known: a short request
queued behind a long prompt's chunks, a request preempted for another's allocation that then
stalls behind a third one's prefill, the prefix cache's reasons; the CLI's formats and its
one-line errors. Then (slow) the same questions on the real engine behind a real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenmill.diagnose.explain import explain, to_text
from tokenmill.diagnose.explain_cli import app
from tokenmill.engine.api.timeline import RequestTimeline
from tokenmill.engine.messages import CacheMiss, RequestEvent, StepRecord
from tokenmill.telemetry.dump import open_dump
from tokenmill.telemetry.hub import Telemetry

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def at(ms: float) -> int:
    return T0 + round(ms * MS)


def _step(tel, sid, start, end, entries, admit_stop=None):
    """One engine step: ``entries`` as (request id, tokens, prefill)."""
    tel.on_step(
        StepRecord(
            step_id=sid,
            start_ns=at(start),
            end_ns=at(end),
            num_prefill_tokens=sum(t for _, t, p in entries if p),
            num_decode_tokens=sum(t for _, t, p in entries if not p),
            req_ids=[e[0] for e in entries],
            req_tokens=[e[1] for e in entries],
            req_prefill=[e[2] for e in entries],
            admit_stop=admit_stop,
            output_send_ms=0.5,
            replica=0,
        )
    )


def _request(tel, rid, tenant, arrival, queued, scheduled, tokens, last_byte, end, n_in, **kw):
    tl = RequestTimeline(arrival_ns=at(arrival), method="POST", path="/v1/completions")
    tl.request_id, tl.tenant, tl.replica, tl.stream = rid, tenant, 0, True
    tl.gateway_end_ns, tl.tokenize_end_ns = at(arrival + 1), at(arrival + 2)
    tl.admission_end_ns = at(arrival + 3)
    tl.stats.queued_ns, tl.stats.scheduled_ns = at(queued), at(scheduled)
    tl.token_ns = [at(t) for t in tokens]
    tl.stats.first_token_ns, tl.finished_ns = tl.token_ns[0], tl.token_ns[-1]
    tl.stats.output_tokens, tl.stats.input_tokens, tl.finish_reason = len(tokens), n_in, "length"
    tl.first_byte_ns, tl.last_byte_ns = at(tokens[0] + 0.5), at(last_byte)
    tl.metering_start_ns, tl.metering_end_ns = at(last_byte), at(end)
    tl.http_status = 200
    tl.events = kw.get("events", [])
    tl.cache_misses = kw.get("cache_misses")
    tl.first_text_ns = kw.get("first_text_ns")
    tel.on_request(tl)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Times in ms. L (tenant big): a 968-token prompt in four chunks under a 256-token
    budget (steps 1-4). S (tenant small) reaches the API at 50 ms, while step 1 runs, is queued
    at 111 ms and waits steps 2-3 (budget: L's chunks), admitted in step 4 beside L's last chunk.
    Later A (tenant a) and V (tenant v) decode together; in step 11 A's next block preempts V;
    V resumes in step 13 (recomputing 40 tokens), and its step 15 carries B's 500-token
    prefill (a stall)."""
    path = tmp_path_factory.mktemp("explain") / "traces.duckdb"
    tel = Telemetry("m", trace_db=str(path), device_sample_interval_s=0)
    L, S, A, V, B = "cmpl-L", "cmpl-S", "cmpl-A", "cmpl-V", "cmpl-B"
    _step(tel, 1, 10, 110, [(L, 256, True)])
    _step(tel, 2, 112, 212, [(L, 256, True)], "budget")
    _step(tel, 3, 213, 313, [(L, 256, True)], "budget")
    _step(tel, 4, 314, 400, [(L, 200, True), (S, 20, True)])
    _step(tel, 5, 401, 420, [(L, 1, False), (S, 1, False)])
    _step(tel, 6, 421, 440, [(L, 1, False), (S, 1, False)])
    _request(tel, L, "big", 0, 5, 10.5, [395, 418, 438], 441, 442, 968)
    misses = [
        CacheMiss(reason="evicted", first_block=0, num_blocks=1, time_ns=at(-2000), by=L),
        CacheMiss(reason="partial_block", first_block=1),
    ]
    _request(
        tel, S, "small", 50, 111, 314.5, [398, 418, 438], 445, 447, 20,
        cache_misses=misses, first_text_ns=at(418),
    )  # fmt: skip
    _step(tel, 8, 802, 900, [(A, 50, True)])
    _step(tel, 9, 906, 999, [(A, 1, False), (V, 30, True)])
    _step(tel, 10, 1000, 1020, [(A, 1, False), (V, 1, False)])
    _step(tel, 11, 1021, 1040, [(A, 1, False)], "kv_blocks")
    _step(tel, 12, 1041, 1060, [(A, 1, False)], "kv_blocks")
    _step(tel, 13, 1061, 1100, [(A, 1, False), (V, 40, True)])
    _step(tel, 14, 1101, 1120, [(A, 1, False), (V, 1, False)])
    _step(tel, 15, 1121, 1300, [(A, 1, False), (V, 1, False), (B, 500, True)])
    _request(tel, A, "a", 800, 801, 802.5, [899, 997, 1018, 1038, 1058, 1098, 1118, 1298],
             1302, 1303, 50)  # fmt: skip
    events = [
        RequestEvent("chunk", 9, at(906.5), {"tokens": 30}),
        RequestEvent("preempted", 11, at(1021.2), {"recompute_tokens": 31, "by": A}),
        RequestEvent("resumed", 13, at(1061.2), {"cached_tokens": 0}),
        RequestEvent("chunk", 13, at(1061.3), {"tokens": 40}),
    ]
    _request(tel, V, "v", 900, 905, 906.5, [997, 1018, 1098, 1118, 1298], 1305, 1306, 30,
             events=events)  # fmt: skip
    _request(tel, B, "b", 1090, 1100.5, 1121.5, [1299], 1301, 1302, 500)
    tel.store.flush(60)
    tel.close()
    con = open_dump(path)
    yield path, con
    con.close()


def _parts(ex, **match):
    return [p for p in ex["parts"] if all(p.get(k) == v for k, v in match.items())]


def test_a_short_request_names_the_long_prompt_it_queued_behind(store):
    _, con = store
    ex = explain(con, "cmpl-S")
    assert abs(ex["parts_ms"] - ex["e2e_ms"]) < 1e-6 and ex["e2e_ms"] == pytest.approx(397)
    kinds = [(p["phase"], p["kind"], p.get("reason")) for p in ex["parts"]]
    assert kinds == [
        ("api", "gateway", None),
        ("api", "tokenize", None),
        ("api", "admission", None),
        ("queue", "queue", "running_step"),  # step 1 ran from 10 to 110 ms
        ("queue", "queue", "budget"),  # steps 2-3: L's chunks took the budget
        ("queue", "queue", "scheduling"),
        ("prefill", "prefill_chunk", None),
        ("decode", "decode", None),
        ("stream", "output_send", None),
        ("stream", "stream_write", None),
        ("stream", "metering", None),
    ]
    running, budget = _parts(ex, reason="running_step")[0], _parts(ex, reason="budget")[0]
    # from the admission's end to the core reading it after step 1
    assert running["ms"] == pytest.approx(58) and running["behind"][0]["request_id"] == "cmpl-L"
    assert budget["ms"] == pytest.approx(202) and budget["steps"] == 2
    assert budget["behind"][0] == {
        "request_id": "cmpl-L", "tokens": 512, "prefill": True, "tenant": "big"
    }  # fmt: skip
    (chunk,) = _parts(ex, kind="prefill_chunk")
    assert chunk["tokens"] == 20 and chunk["shared_with"][0]["request_id"] == "cmpl-L"
    (decode,) = _parts(ex, kind="decode")
    assert decode["batch"] == {"min": 2, "median": 2, "max": 2} and decode["steps"] == 2
    top = ex["waited_behind"][0]
    assert top["request_id"] == "cmpl-L" and top["tenant"] == "big"
    assert top["ms"] == pytest.approx(260) and top["reasons"] == ["running_step", "budget"]
    assert ex["text_holdback_ms"] == pytest.approx(20)
    text = to_text(ex)
    assert "Waited behind most: cmpl-L (tenant big) for 260.0 ms" in text
    assert "behind cmpl-L (tenant big): 512 prefill tokens in 2 steps" in text


def test_a_preempted_request_names_its_preemptor_and_a_stall(store):
    _, con = store
    ex = explain(con, "cmpl-V")
    assert abs(ex["parts_ms"] - ex["e2e_ms"]) < 1e-6
    (pre,) = _parts(ex, kind="preempted")
    # from the end of the step before the preemption to its resumption in step 13
    assert pre["by"] == "cmpl-A" and pre["by_tenant"] == "a" and pre["recompute_tokens"] == 31
    assert pre["ms"] == pytest.approx(1061.2 - 1020)
    (again,) = _parts(ex, kind="recompute")
    assert again["tokens"] == 40
    (stall,) = _parts(ex, kind="stall")
    assert stall["reason"] == "prefill_in_step" and stall["behind"][0]["request_id"] == "cmpl-B"
    assert stall["ms"] == pytest.approx(178)
    assert [w["request_id"] for w in ex["waited_behind"]] == ["cmpl-B", "cmpl-A"]
    assert "preempted for cmpl-A (tenant a)'s allocation" in to_text(ex)


def test_cache_misses_and_ids_by_client_or_trace(store):
    _, con = store
    ex = explain(con, "cmpl-S")
    cache = ex["cache"]
    assert (cache["prompt_blocks"], cache["cached_blocks"]) == (2, 0)
    assert [(m["reason"], m["first_block"], m["num_blocks"]) for m in cache["misses"]] == [
        ("evicted", 0, 1),
        ("partial_block", 1, 1),
    ]
    evicted = cache["misses"][0]
    assert evicted["by"] == "cmpl-L" and evicted["by_tenant"] == "big"
    assert evicted["time_ms"] == pytest.approx(-2050)
    assert (
        evicted["text"]
        == "block 0: evicted 2.0 s before it arrived by cmpl-L (tenant big)'s allocation"
    )
    trace = con.execute("SELECT trace_id FROM requests WHERE request_id = 'cmpl-S'").fetchone()[0]
    assert explain(con, trace)["request_id"] == "cmpl-S"


def test_cli_json_text_and_one_line_errors(store, tmp_path):
    path, _ = store
    runner = CliRunner()
    r = runner.invoke(app, ["cmpl-S", "--db", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["schema_version"] == 1 and data["waited_behind"][0]["request_id"] == "cmpl-L"
    r = runner.invoke(app, ["cmpl-S", "--db", str(path)])
    assert r.exit_code == 0 and r.output.startswith("Request cmpl-S (tenant small): E2E 397.0 ms")
    bad = tmp_path / "bad.duckdb"
    bad.write_text("not a store")
    for args, says in [
        (["cmpl-nope", "--db", str(path)], "no request 'cmpl-nope' in the store"),
        (["cmpl-S", "--db", str(bad)], "bad.duckdb"),
        (["cmpl-S"], "--db PATH"),
        (["cmpl-S", "--db", str(path), "--format", "yaml"], "--format must be text or json"),
    ]:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], r.output


def test_the_console_waterfall_shows_the_critical_path(store, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from tokenmill.dashboard import data

    path, con = store
    (trace,) = con.execute("SELECT trace_id FROM requests WHERE request_id = 'cmpl-S'").fetchone()
    monkeypatch.setenv("TOKENMILL_DASHBOARD_SOURCE", str(path))
    at = AppTest.from_file(str(Path(data.__file__).parent / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("views/requests.py")
    at.run()
    at.text_input(key="rq_search").set_value(trace[:12])
    at.run()
    assert not at.exception, at.exception
    (fig,) = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
    path_bars = [t for t in fig["data"] if str(t.get("name", "")).startswith("path: ")]
    assert [t["name"] for t in path_bars] == [
        "path: api", "path: queue", "path: prefill", "path: decode", "path: stream"
    ]  # fmt: skip
    ex = explain(con, "cmpl-S")
    queue = path_bars[1]
    assert len(queue["customdata"]) == 3 and "behind cmpl-L (tenant big)" in queue["customdata"][1]
    assert fig["layout"]["yaxis"]["categoryarray"][0] == "critical path"
    (table,) = [d.value for d in at.dataframe if "part" in d.value.columns]
    assert list(table["part"]) == [p["text"] for p in ex["parts"]]
    assert table["ms"].sum() == pytest.approx(ex["e2e_ms"])
    captions = " ".join(c.value for c in at.caption)
    assert "Waited behind `cmpl-L` (tenant big) for 260.0 ms (running_step, budget)" in captions
    assert (
        "block 0: evicted 2.0 s before it arrived by cmpl-L (tenant big)'s allocation" in captions
    )


# ---- the real engine behind a real server ----
KEYS = {"alpha": "sk-alpha-1", "beta": "sk-beta-2"}
MODEL = "smollm2-135m-instruct"


def _ids(start: int, n: int) -> list[int]:
    return [start + i for i in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    """One server: a 16-token step budget, a 50-block (800-token) KV pool, the priority policy
    (tenant alpha 0, beta 9: beta's requests are preempted first).

    1. ``long`` (alpha, 700 prompt tokens: 44 chunks) and, 0.1 s later, ``short`` (alpha,
       40 tokens);
    2. ``other``: short's tokens under tenant beta;
    3. ``victim`` (beta, 305 tokens and 15 outputs: 20 blocks it never outgrows) and, 0.1 s
       later, ``preemptor`` (alpha, 600 tokens: 38 blocks), whose chunks come first; its
       prefill outgrows the 30 blocks the victim leaves, and its next block preempts it;
    4. ``again``: long's tokens once more (its blocks evicted by 3), and ``even`` (32 tokens:
       two full blocks)."""
    import asyncio

    import httpx
    from server_proc import Server

    from tokenmill.engine.api.gateway import hash_key

    tmp = tmp_path_factory.mktemp("explain_real")
    tenants = "".join(
        f'[tenants.{name}]\nkey_sha256 = "{hash_key(key)}"\npriority = {prio}\n'
        for (name, key), prio in zip(KEYS.items(), (0, 9))
    )
    (tmp / "tenants.toml").write_text(tenants)
    db = tmp / "traces.duckdb"
    server = Server(
        tmp, "--model", str(smollm2_dir), "--tenants", str(tmp / "tenants.toml"),
        "--max-num-batched-tokens", "16", "--num-gpu-blocks-override", "50",
        "--max-num-seqs", "4", "--scheduling-policy", "priority", "--trace-db", str(db),
    )  # fmt: skip

    async def send(ac, rid, tenant, prompt, max_tokens, delay=0.0):
        await asyncio.sleep(delay)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", "x-request-id": rid}
        r = await ac.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text

    async def load():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ac:
            await asyncio.gather(
                send(ac, "long", "alpha", _ids(1000, 700), 2),
                send(ac, "short", "alpha", _ids(3000, 40), 4, delay=0.1),
            )
            await send(ac, "other", "beta", _ids(3000, 40), 2)
            await asyncio.gather(
                send(ac, "victim", "beta", _ids(6000, 305), 15),
                send(ac, "preemptor", "alpha", _ids(5000, 600), 2, delay=0.1),
            )
            await send(ac, "again", "alpha", _ids(1000, 700), 2)
            await send(ac, "even", "alpha", _ids(8000, 32), 2)

    try:
        asyncio.run(load())
        import time

        time.sleep(1.0)  # the last rows reach the store
    finally:
        server.stop()
    con = open_dump(db)
    yield con
    con.close()


def _engine_id(con, client_id: str) -> str:
    return con.execute(
        "SELECT request_id FROM requests WHERE client_request_id = ?", [client_id]
    ).fetchone()[0]


@pytest.mark.slow
def test_real_engine_short_request_names_the_long_prompt(served):
    ex = explain(served, "short")
    print("\n" + to_text(ex))
    long_id = _engine_id(served, "long")
    assert ex["waited_behind"][0]["request_id"] == long_id
    assert ex["waited_behind"][0]["tenant"] == "alpha"
    queue = [p for p in ex["parts"] if p["phase"] == "queue" and p.get("behind")]
    assert queue and all(p["behind"][0]["request_id"] == long_id for p in queue)
    assert any(p["reason"] == "budget" for p in queue)
    assert abs(ex["parts_ms"] - ex["e2e_ms"]) <= 0.01 * ex["e2e_ms"]


@pytest.mark.slow
def test_real_engine_preempted_request_names_its_preemptor(served):
    victims = served.execute(
        "SELECT client_request_id FROM requests WHERE preemptions > 0 ORDER BY arrival_ns"
    ).fetchall()
    assert victims == [("victim",)], "the 50-block pool should have forced one preemption"
    ex = explain(served, "victim")
    print("\n" + to_text(ex))
    pre = [p for p in ex["parts"] if p["kind"] == "preempted"]
    assert len(pre) == 1 and pre[0]["by"] == _engine_id(served, "preemptor")
    assert pre[0]["by_tenant"] == "alpha" and ex["preemptions"] == 1
    assert abs(ex["parts_ms"] - ex["e2e_ms"]) <= 0.01 * ex["e2e_ms"]


@pytest.mark.slow
def test_real_engine_parts_add_up_and_cache_misses_say_why(served):
    rows = served.execute(
        "SELECT client_request_id, e2e_ms FROM requests ORDER BY arrival_ns"
    ).fetchall()
    assert [r[0] for r in rows] == [
        "long", "short", "other", "victim", "preemptor", "again", "even"
    ]  # fmt: skip
    for client_id, e2e in rows:
        ex = explain(served, client_id)
        print(f"{client_id}: E2E {e2e:.1f} ms, parts {ex['parts_ms']:.1f} ms")
        assert abs(ex["parts_ms"] - e2e) <= 0.01 * e2e, client_id
        assert all(p["ms"] >= 0 for p in ex["parts"])

    def misses(client_id):
        cache = explain(served, client_id)["cache"]
        return [(m["reason"], m["first_block"], m["num_blocks"]) for m in cache["misses"]]

    assert misses("long") == [("never_seen", 0, 43), ("partial_block", 43, 1)]
    assert misses("other")[0] == ("other_tenant", 0, 2)
    assert explain(served, "other")["cache"]["misses"][0]["tenant"] == "alpha"
    assert misses("even") == [("never_seen", 0, 1), ("last_token", 1, 1)]
    again = explain(served, "again")["cache"]["misses"]
    print("again: " + "; ".join(m["text"] for m in again))
    evicted = [m for m in again if m["reason"] == "evicted"]
    assert evicted and {m["by"] for m in evicted} <= {
        _engine_id(served, c) for c in ("victim", "preemptor", "other", "short")
    }
    assert again[-1]["reason"] == "partial_block"


def test_the_running_set_says_it_changed_over_the_steps():
    """A queue part over many steps names everyone who ran in the capped batch meanwhile, not
    as if they ran at once; one step's part says how many ran."""
    from tokenmill.diagnose.explain import _running_set

    assert _running_set(13, 259) == "13 requests ran in it over those 259 steps"
    assert _running_set(1, 4) == "1 request ran in it over those 4 steps"
    assert _running_set(3, 1) == "3 running"
