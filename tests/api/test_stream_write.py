"""Issue 20 item 1, the API's part of a step: ``StepRecord.stream_write_ms``, from the API
process holding a step's outputs to the last of its streams having written one.

The clock's bookkeeping on a stepped clock (every figure exact), then through a real server:
every working step of a streamed run gets a value, and a known per-chunk cost in the stream
(the fault drill) shows up in it.
"""

from __future__ import annotations

import asyncio

import duckdb
import httpx
from server_proc import Server

from tokenmill.engine import stream_writes
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.messages import (
    AbortRequests,
    RequestEvent,
    RequestOutput,
    RequestStats,
    StepRecord,
)
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.stream_writes import StreamWriteClock


class _Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def monotonic_ns(self) -> int:
        return self.ns

    def advance_ms(self, ms: float) -> None:
        self.ns += round(ms * 1e6)


def _out(rid: str, *events: str, finished: bool = False, preemptions: int = 0) -> RequestOutput:
    return RequestOutput(
        request_id=rid, new_token_ids=[1], new_text="x", token_ns=[0], finished=finished,
        finish_reason="abort" if finished else None, stop_reason=None, error_type=None,
        error_message=None,
        stats=RequestStats(input_tokens=3, output_tokens=1, preemptions=preemptions,
                           queued_ns=0, scheduled_ns=0, first_token_ns=0),
        arrival_ns=0, finished_ns=None,
        events=[RequestEvent(name, step_id=i, time_ns=i) for i, name in enumerate(events)],
    )  # fmt: skip


def _record(step_id: int) -> StepRecord:
    return StepRecord(step_id=step_id, start_ns=0, end_ns=0)


def _clock(monkeypatch) -> tuple[_Clock, list[StepRecord], StreamWriteClock]:
    clock = _Clock()
    monkeypatch.setattr(stream_writes, "time", clock)
    emitted: list[StepRecord] = []
    return clock, emitted, StreamWriteClock(emitted.append, wait_s=10.0)


def test_a_step_is_handed_on_when_its_last_stream_wrote(monkeypatch):
    clock, emitted, writes = _clock(monkeypatch)
    a, b = _out("a"), _out("b")
    writes.received(_record(1), [a, b])
    clock.advance_ms(3)
    writes.written(a)
    assert emitted == []  # b not written yet
    clock.advance_ms(4)
    writes.written(b)
    assert [r.step_id for r in emitted] == [1]
    assert emitted[0].stream_write_ms == 7.0
    writes.written(b)  # a second report of the same output changes nothing
    assert len(emitted) == 1


def test_a_dropped_output_ends_the_wait_at_the_last_write(monkeypatch):
    clock, emitted, writes = _clock(monkeypatch)
    a, b = _out("a"), _out("b")
    writes.received(_record(1), [a, b])
    clock.advance_ms(2)
    writes.written(a)
    clock.advance_ms(50)
    writes.dropped(b)  # b's client left: the step ends with a's write, not with the drop
    assert emitted[0].stream_write_ms == 2.0


def test_nothing_to_write_is_zero_and_immediate(monkeypatch):
    _, emitted, writes = _clock(monkeypatch)
    writes.received(_record(1), [])
    assert emitted[0].stream_write_ms == 0.0


def test_steps_are_handed_on_in_the_order_their_streams_finish(monkeypatch):
    clock, emitted, writes = _clock(monkeypatch)
    a1, a2, b2 = _out("a"), _out("a"), _out("b")
    writes.received(_record(1), [a1])
    clock.advance_ms(1)
    writes.received(_record(2), [a2, b2])
    clock.advance_ms(1)
    writes.written(b2)
    writes.written(a1)
    clock.advance_ms(5)
    writes.written(a2)
    assert [(r.step_id, r.stream_write_ms) for r in emitted] == [(1, 2.0), (2, 6.0)]


def test_a_stream_that_stops_reading_does_not_hold_the_record(monkeypatch):
    clock, emitted, writes = _clock(monkeypatch)
    a, b = _out("a"), _out("b")
    writes.received(_record(1), [a, b])
    writes.written(a)
    clock.advance_ms(9_000)
    writes.expire()
    assert emitted == []
    clock.advance_ms(2_000)
    writes.expire()  # 11 s > wait_s: handed on, unmeasured (not 11 s of the API's time)
    assert [(r.step_id, r.stream_write_ms) for r in emitted] == [(1, None)]
    writes.written(b)  # the late write belongs to no step any more
    writes.received(_record(2), [_out("c")])
    writes.flush()  # the engine stopped: everything still waited on goes out
    assert [(r.step_id, r.stream_write_ms) for r in emitted] == [(1, None), (2, None)]
    assert writes._of_output == {} and writes._steps == {}


class _Alive:
    pid = 1

    def is_alive(self) -> bool:
        return True


def test_a_left_stream_hands_its_unread_events_to_the_final_record(smollm2_dir):
    """A client that leaves with outputs still queued for it: the engine's final (abort)
    record, handed to the abandoned listeners, carries the unread outputs' events, so a
    preemption it counts (``stats.preemptions``) is also an event in the trace (a CI run of
    test_telemetry_server lost one this way). The steps' records are handed on too: the
    unread outputs count as dropped, not as waited on. No engine process: the test plays
    the engine's side through ``_dispatch``."""

    async def main():
        engine = AsyncEngine(EngineConfig(model=str(smollm2_dir)))
        engine.process = _Alive()
        sent, finals, steps = [], [], []

        async def send(msg, timeout_s=5.0):
            sent.append(msg)
            return True

        engine._send = send
        engine.add_abandoned_listener(finals.append)
        engine.add_step_listener(steps.append)
        stream = engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=8))
        taken = asyncio.ensure_future(stream.__anext__())
        while "r" not in engine._queues:  # the stream sent its request and waits
            await asyncio.sleep(0)
        first = _out("r", "chunk")
        engine._writes.received(_record(1), engine._dispatch([first]))
        assert await taken is first
        unread = _out("r", "preempted", "resumed")
        engine._writes.received(_record(2), engine._dispatch([unread]))
        await stream.aclose()  # the client left: `unread` was never taken
        assert isinstance(sent[-1], AbortRequests) and sent[-1].request_ids == ["r"]
        # neither step waits on the stream any more: `first` was taken but never written
        # (the client left before asking for more), `unread` never taken
        assert [r.step_id for r in steps] == [1, 2]
        # an output already on its way when the client left: its events are carried too
        engine._dispatch([_out("r", "preempted")])
        engine._dispatch([_out("r", "aborted", finished=True, preemptions=2)])
        assert engine._carried_events == {}
        engine._ctx.destroy(linger=0)
        engine._tmp.cleanup()
        return finals

    (final,) = asyncio.run(main())
    assert [e.name for e in final.events] == ["preempted", "resumed", "preempted", "aborted"]
    assert final.stats.preemptions == 2


def test_served_steps_carry_the_stream_write_time(tmp_path, smollm2_dir):
    """A real server with the stream fault drill (each text chunk after the first waits
    40 ms in the route before it is written): every working step of the run has
    ``stream_write_ms``, and the decode steps of one stream past its first chunk carry at
    least the drill's 40 ms."""
    db = tmp_path / "traces.duckdb"
    server = Server(tmp_path, "--model", str(smollm2_dir), "--trace-db", str(db),
                    "--fault-stream-delay-ms", "40")  # fmt: skip
    try:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**body, "model": model},
            timeout=120,
        ) as r:  # fmt: skip
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if '"content"' in line]
        assert len(chunks) >= 12
    finally:
        server.stop()
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT num_prefill_tokens, num_decode_tokens, stream_write_ms FROM engine_steps "
        "WHERE num_prefill_tokens + num_decode_tokens > 0 ORDER BY step_id"
    ).fetchall()
    con.close()
    assert len(rows) >= 12
    assert all(w is not None for _, _, w in rows), rows
    decode = [w for p, d, w in rows if p == 0 and d > 0]
    # the first token is the prefill step's; the drill skips the first text chunk, so every
    # decode step but possibly the first waits on it. asyncio may end a 40 ms sleep up to its
    # clock's resolution early (a clean clone read 39.83 ms), hence the 1 ms of slack
    assert len(decode) >= 10 and all(w >= 39.0 for w in decode[1:]), decode
