"""`tokenmill proxy` before an upstream whose answers are odd but legal (or plainly broken) at
the byte level, found by trying to break it: the client gets the upstream's answer or an error
in OpenAI's shape, never an error the upstream did not send nor an event it did not send, and
the row says what the client got."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from test_bad_upstream import HANG_GUARD_S, LoopServer, _Serve

from tokenmill.proxy.app import ProxyState, build_proxy_app
from tokenmill.proxy.observe import MAX_READ_BYTES, Exchange
from tokenmill.telemetry.store import TraceStore


def _ev(content: str | None = None, **extra) -> bytes:
    delta = {"content": content} if content is not None else {}
    ev = {"id": "chatcmpl-b", "choices": [{"index": 0, "delta": delta, **extra}]}
    return json.dumps(ev).encode()


def _sse(sep: bytes) -> bytes:
    """A whole, valid stream whose lines end in ``sep``."""
    final = json.loads(_ev(finish_reason="stop"))
    final["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
    events = [_ev("a"), _ev("b"), json.dumps(final).encode(), b"[DONE]"]
    return b"".join(b"data: " + e + sep + sep for e in events)


def _head(status: bytes, ctype: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\n" + extra


ANSWERS = {
    # a lone CR ends a line in the event-stream format, as LF and CRLF do
    "cr": _head(b"200 OK", b"text/event-stream", b"connection: close\r\n\r\n") + _sse(b"\r"),
    "crlf": _head(b"200 OK", b"text/event-stream", b"connection: close\r\n\r\n") + _sse(b"\r\n"),
    # header values as bytes that are not Latin-1 once aiohttp decoded them (UTF-8, stray)
    "header-bytes": _head(
        b"200 OK",
        b"application/json",
        b"x-utf8: \xe6\x97\xa5\xe6\x9c\xac\r\nx-raw: \xff\xfe\r\nx-latin: caf\xc3\xa9\r\n"
        b"x-del: a\x7fb\r\n"
        b"content-length: 2\r\nconnection: close\r\n\r\n{}",
    ),
    "status-999": _head(
        b"999 Odd", b"application/json", b"content-length: 2\r\nconnection: close\r\n\r\n{}"
    ),
}


class _Upstream(LoopServer):
    """Answers each request with ``ANSWERS[model]``'s bytes, then closes."""

    async def _conn(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode("latin-1").split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            model = json.loads(await reader.readexactly(length))["model"]
            writer.write(ANSWERS[model])
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
def proxied(tmp_path):
    up = _Upstream()
    store = TraceStore(tmp_path / "proxy.duckdb", flush_interval_s=0.05)
    state = ProxyState(up.url, store.submit, first_byte_timeout_s=2.0)
    px = _Serve(build_proxy_app(state))

    def row(model_id: str):
        assert store.flush()
        rows = store.query(
            "SELECT http_status, error_type, output_tokens FROM requests WHERE trace_id = ?",
            [model_id],
        )
        assert len(rows) == 1, rows
        return rows[0]

    yield px.url, row
    px.stop()
    up.stop()
    store.close()


def _post(url: str, model: str, trace_id: str):
    body = {"model": model, "messages": [], "stream": True}
    headers = {"traceparent": f"00-{trace_id}-{'1' * 16}-01"}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=20)


@pytest.mark.parametrize("model", ["cr", "crlf"])
def test_a_whole_stream_in_any_line_ending_is_relayed_without_an_added_error(proxied, model):
    url, row = proxied
    trace_id = ("c" if model == "cr" else "d") * 32
    r = _post(url, model, trace_id)
    sent = ANSWERS[model].split(b"\r\n\r\n", 1)[1] if model == "crlf" else _sse(b"\r")
    assert r.status_code == 200
    assert r.content == sent  # nothing added: no upstream_stream_cut event
    assert row(trace_id) == (200, None, 2)


def test_header_values_that_are_not_latin1_text_go_back_as_their_bytes(proxied):
    url, row = proxied
    r = _post(url, "header-bytes", "e" * 32)
    assert r.status_code == 200, r.text  # not the proxy's own 500
    raw = dict(r.headers.raw)
    assert raw[b"x-utf8"] == b"\xe6\x97\xa5\xe6\x9c\xac"
    assert raw[b"x-raw"] == b"\xff\xfe"
    assert raw[b"x-latin"] == b"caf\xc3\xa9"  # not re-encoded as Latin-1's 0xe9
    assert b"x-del" not in raw  # a control byte no server may send: left out, not a dropped answer
    assert row("e" * 32)[:2] == (200, None)


def test_an_upstream_status_that_is_not_http_is_a_502_not_a_dropped_connection(proxied):
    url, row = proxied
    r = _post(url, "status-999", "f" * 32)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_broken"
    assert "999" in r.json()["error"]["message"]
    assert row("f" * 32)[:2] == (502, "upstream_broken")


@pytest.mark.parametrize(
    "pieces",
    [
        [b"data: " + _ev("a") + b"\r", b"\ndata: [DONE]\r", b"\n"],  # CRLF split in two
        [b"data: " + _ev("a") + b"\r\r", b"data: [DONE]\r\r"],  # lone CRs
        [b"da", b"ta: " + _ev("a")[:5], _ev("a")[5:] + b"\n", b"\ndata: [DO", b"NE]\n\n"],
    ],
)
def test_events_are_read_whatever_the_line_ends_and_the_piece_boundaries(pieces):
    ex = Exchange(time.time_ns(), "chat", "a" * 32, "b" * 16, "u")
    for p in pieces:
        ex.on_bytes(p)
    assert ex.saw_done
    assert len(ex.token_ns) == 1
    assert ex.error_type is None and not ex.dropped


def test_a_long_line_in_small_pieces_is_counted_once_and_the_next_event_read():
    """An 8 MiB line dripped 1 KiB at a time (it took ~9 s of the event loop when the
    unfinished line was copied and split again for every piece; ~0.01 s now, not timed here):
    dropped once, counted once, and the next event is still read."""
    ex = Exchange(time.time_ns(), "chat", "a" * 32, "b" * 16, "u")
    piece = b"y" * 1024
    ex.on_bytes(b'data: {"x": "')
    for _ in range((2 * MAX_READ_BYTES) // len(piece)):
        ex.on_bytes(piece)
    ex.on_bytes(b'"}\n\ndata: ' + _ev("a") + b"\n\ndata: [DONE]\n\n")
    assert ex.dropped == {"event_too_long": 1}
    assert len(ex.token_ns) == 1 and ex.saw_done


def test_a_stream_still_open_after_the_drain_ends_in_a_server_shutdown_event(tmp_path):
    import os
    import signal

    import duckdb
    from test_bad_upstream import RawUpstream, start_proxy

    up = RawUpstream()
    db = tmp_path / "p.duckdb"
    proc, url = start_proxy(up.url, db, "--shutdown-timeout", "1s", new_session=True)
    got: list = []
    try:

        def stream():
            body = {"model": "drip:200", "messages": [], "stream": True}  # 20 s of events
            lines = []
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                                  timeout=60) as r:  # fmt: skip
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            except httpx.HTTPError as exc:
                lines.append(f"cut: {exc}")
            got.append(lines)

        t = threading.Thread(target=stream)
        t.start()
        while not up.received:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
        t.join(HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        up.stop()
    assert proc.returncode == 0
    lines = got[0]
    assert lines[-1] == "data: [DONE]", lines[-2:]
    assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutdown"
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT error_type FROM requests").fetchall() == [("server_shutdown",)]
