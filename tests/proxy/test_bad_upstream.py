"""The observer never harms the observed: `tokenmill proxy` before an upstream that misbehaves on
purpose, at the byte level (a raw asyncio HTTP/1.1 server on 127.0.0.1 whose answer the request's
`model` field picks), and before clients that misbehave.

Each case checks what the client got (status, headers, bytes), the row the proxy stored and,
where it matters, what the upstream saw (how many times a request arrived, whether the proxy
hung up on it)."""

from __future__ import annotations

import asyncio
import gzip
import json
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_proxy import _free_port, _Serve

from tokenmill.proxy.app import ProxyState, build_proxy_app
from tokenmill.telemetry.store import TraceStore

HANG_GUARD_S = 20.0  # the longest any wait below may take before the test gives up
DRIP_S = 0.1  # the gap between a "drip" stream's events


def _event(i: int, **extra) -> bytes:
    ev = {
        "id": "chatcmpl-raw",
        "model": "raw",
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
        **extra,
    }
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nx-request-id: up-req-1\r\n\r\n"
)
ODD_USAGE = {
    "string": {"prompt_tokens": "5", "completion_tokens": "2", "total_tokens": "7"},
    "null": None,
    "negative": {"prompt_tokens": -5, "completion_tokens": -2, "total_tokens": -7},
    "huge": {"prompt_tokens": 2**70, "completion_tokens": 2**40, "total_tokens": 2**70},
    "float": {"prompt_tokens": 5.5, "completion_tokens": True, "total_tokens": 7},
    "list": ["5", 2],
    "missing": "-",
}
# the usage fields each case cannot record (counted as dropped, never an error)
ODD_USAGE_DROPS = {"string": 2, "null": 0, "negative": 2, "huge": 2, "float": 2, "list": 1,
                   "missing": 0}  # fmt: skip


def start_proxy(
    upstream: str, db, *args: str, new_session: bool = False
) -> tuple[subprocess.Popen, str]:
    """`tokenmill proxy` as a process in front of ``upstream``, recording into ``db`` (no
    scrapes; ``args`` more options), once its /health answers: the process and its URL.
    ``new_session``: in a process group of its own, for a stop sent to the group."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "proxy", "--upstream", upstream,
         "--port", str(port), "--trace-db", str(db), "--scrape-interval", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
        try:
            httpx.get(url + "/health", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


class LoopServer:
    """A raw TCP server on asyncio streams, on its own thread and event loop: each connection
    goes to the subclass's ``_conn(reader, writer)``."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self._conn, "127.0.0.1", self.port)
            )
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(HANG_GUARD_S)

    def stop(self):
        async def down():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(HANG_GUARD_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        raise NotImplementedError


class RawUpstream(LoopServer):
    """An HTTP/1.1 server written on asyncio streams, on its own thread: it reads each request
    whole, notes its ``model`` in ``received``, and answers as that model says. ``hung_up``
    holds the models whose request the proxy closed while the upstream was still at work."""

    def __init__(self):
        self.received: list[str] = []
        self.paths: list[str] = []  # each request's path, as the upstream saw it
        self.hung_up: list[str] = []
        self.sent: dict[str, bytes] = {}  # model -> the body bytes it answered
        super().__init__()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                self.paths.append(lines[0].split(" ")[1] if " " in lines[0] else lines[0])
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                model = json.loads(body).get("model", "")
                self.received.append(model)
                keep = await self.answer(model, reader, writer)
                if not keep:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def _hang_up_seen(self, model: str, reader: asyncio.StreamReader) -> None:
        """Waits (at most the hang guard) for the proxy to close this connection."""
        try:
            got = await asyncio.wait_for(reader.read(1), HANG_GUARD_S)
        except (TimeoutError, ConnectionError):
            return
        if got == b"":
            self.hung_up.append(model)

    async def answer(self, model: str, reader, writer) -> bool:
        kind, _, arg = model.partition(":")
        if kind == "usage":  # a whole JSON answer with an odd `usage`
            doc = {"id": "chatcmpl-odd", "model": "raw", "choices": [
                {"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}  # fmt: skip
            if arg != "missing":
                doc["usage"] = ODD_USAGE[arg]
            body = json.dumps(doc).encode()
            self.sent[model] = body
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            return True
        if kind == "stream-usage":  # a stream whose last event has an odd `usage`
            last = _event(2, usage=ODD_USAGE[arg]) if arg != "missing" else _event(2)
            events = [_event(0), _event(1), last, b"data: [DONE]\n\n"]
            self.sent[model] = b"".join(events)
            writer.write(SSE_HEAD + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n")
            await writer.drain()
            return True
        if kind == "cut":  # a stream cut mid-answer, `arg` says how
            writer.write(SSE_HEAD)
            if arg != "headers-fin" and arg != "headers-stall":
                writer.write(_chunk(_event(0)) + _chunk(_event(1)))
            if arg == "mid-event":  # the cut falls inside an event
                writer.write(_chunk(b'data: {"id": "chatcmpl-raw", "cho'))
            await writer.drain()
            if arg in ("fin", "headers-fin", "mid-event"):
                return False  # FIN without the last chunk
            if arg == "rst":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return False
            await self._hang_up_seen(model, reader)  # stall: nothing more, ever
            return False
        if kind == "eof-no-done":  # a stream whose body ends (connection close) without [DONE]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n" + _event(0) + _event(1))  # fmt: skip
            await writer.drain()
            return False
        if kind == "read-then-close":  # the request read in full, then the connection closed
            return False
        if kind == "slow":  # an answer that takes the hang guard: the proxy should hang up first
            await self._hang_up_seen(model, reader)
            return False
        if kind == "limited":  # a refusal with the headers a client backs off by
            status = {"429": b"429 Too Many Requests", "503": b"503 Service Unavailable"}[arg]
            body = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
            self.sent[model] = body
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                         b"retry-after: 7\r\nx-ratelimit-limit-requests: 60\r\n"
                         b"x-ratelimit-remaining-requests: 0\r\nx-ratelimit-reset-requests: 7s\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            return True
        if kind == "gzip":  # a compressed answer (the upstream's choice, whatever was asked)
            doc = {"id": "chatcmpl-gz", "model": "raw", "choices": [
                {"index": 0, "message": {"content": "hi " * 50}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 50, "total_tokens": 54}}  # fmt: skip
            body = gzip.compress(json.dumps(doc).encode())
            self.sent[model] = body
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-encoding: gzip\r\nvary: accept-encoding\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            return True
        if kind == "drip":  # a whole stream of `arg` events, one every DRIP_S (a stop drill)
            writer.write(SSE_HEAD)
            for i in range(int(arg)):
                writer.write(_chunk(_event(i)))
                await writer.drain()
                await asyncio.sleep(DRIP_S)
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return True
        if kind == "ok":
            body = json.dumps({"id": "chatcmpl-ok", "model": "raw", "choices": [],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()  # fmt: skip
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            return True
        raise AssertionError(f"no behaviour {model!r}")


@pytest.fixture
def bad(tmp_path):
    up = RawUpstream()
    store = TraceStore(tmp_path / "proxy.duckdb", flush_interval_s=0.05)
    state = ProxyState(up.url, store.submit, first_byte_timeout_s=1.0, max_in_flight=2)
    px = _Serve(build_proxy_app(state))

    def rows(sql: str):
        assert store.flush()
        return store.query(sql)

    yield px.url, up, rows, store
    px.stop()
    up.stop()
    store.close()


def _post(url: str, model: str, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_GUARD_S, **kw)


def _metric(url: str, name: str, extra: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=HANG_GUARD_S).text
    for line in text.splitlines():
        if line.startswith(name + "{") and extra in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _until(cond, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("odd", list(ODD_USAGE))
def test_odd_usage_never_turns_the_upstreams_200_into_an_error(bad, odd, stream):
    """What the proxy cannot record is dropped and counted; the client gets the upstream's
    answer byte for byte, and the store keeps taking rows."""
    url, up, rows, store = bad
    model = ("stream-usage:" if stream else "usage:") + odd
    r = _post(url, model, stream=stream)
    assert r.status_code == 200, r.text
    assert r.content == up.sent[model]
    assert up.received == [model]
    dropped = _metric(url, "tokenmill_proxy_telemetry_dropped_total", 'reason="usage_not_a_count"')
    assert dropped == ODD_USAGE_DROPS[odd]
    assert _post(url, "ok").status_code == 200  # the next request is recorded as ever
    got = rows("SELECT http_status, input_tokens, error_type FROM requests ORDER BY arrival_ns")
    assert got == [(200, 0, None), (200, 3, None)]
    assert store.writer_alive


@pytest.mark.parametrize(
    "how", ["fin", "rst", "stall", "mid-event", "headers-fin", "headers-stall", "eof-no-done"]
)
def test_a_cut_upstream_stream_ends_in_an_error_event_the_client_sees(bad, how):
    """A stream cut mid-answer (FIN, RST, a stall past the read timeout, headers then nothing,
    a close-delimited body without [DONE]) is not a clean end: the relayed events, then an
    OpenAI-style error event naming the cut, and the row says so."""
    url, up, rows, _ = bad
    model = "eof-no-done" if how == "eof-no-done" else f"cut:{how}"
    r = _post(url, model, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [b for b in r.content.split(b"\n\n") if b.strip()]
    relayed = 0 if how.startswith("headers") else 2
    for i in range(relayed):
        assert events[i] == _event(i).rstrip(b"\n")
    err_lines = [e for e in events if e.startswith(b'data: {"error"')]
    assert len(err_lines) == 1, r.content
    err = json.loads(err_lines[0][len(b"data: ") :])["error"]
    assert err["code"] == "upstream_stream_cut" and up.url in err["message"]
    assert events[-1] == b"data: [DONE]"
    if how == "mid-event":  # the partial event is ended before the error, not merged into it
        assert events[-3] == b'data: {"id": "chatcmpl-raw", "cho'
    assert up.received == [model]
    got = rows("SELECT http_status, error_type, finish_reason, output_tokens FROM requests")
    assert got == [(200, "upstream_stream_cut", "error", relayed)]
    if how.endswith("stall"):
        assert up.hung_up == [model]  # the proxy let go of the stalled upstream


def test_a_request_the_upstream_may_have_read_is_never_sent_again(bad):
    """An upstream that reads the whole POST and closes the connection without an answer: a
    502 naming it, and the request arrived once (a second generation would be billed)."""
    url, up, rows, _ = bad
    for _ in range(5):
        r = _post(url, "read-then-close")
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "upstream_broken" and "not sent again" in err["message"]
    assert up.received == ["read-then-close"] * 5
    assert rows("SELECT count(*) FILTER (error_type = 'upstream_broken') FROM requests") == [(5,)]


def _cut_client(url: str, body: dict, up: RawUpstream) -> None:
    """Sends a request on a raw socket and hangs up, once the upstream has it, before any
    answer."""
    data = json.dumps(body).encode()
    port = int(url.rsplit(":", 1)[1])
    arrived = len(up.received)
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                  % (len(data), data))  # fmt: skip
        _until(lambda: len(up.received) > arrived, "the request never reached the upstream")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_hangs_up_frees_its_slot_and_cancels_the_upstream(bad, stream):
    """`--max-in-flight 2`: two clients hang up while the upstream is still at work. The proxy
    closes both upstream requests, the gauge goes back to 0 and the next request is served,
    not refused with 429."""
    _, up, _, store = bad
    state = ProxyState(up.url, store.submit, first_byte_timeout_s=3 * HANG_GUARD_S,
                       max_in_flight=2)  # fmt: skip
    px = _Serve(build_proxy_app(state))
    url = px.url

    def rows(sql: str):
        assert store.flush()
        return store.query(sql)

    body = {"model": "slow", "messages": [], "stream": stream}
    for _ in range(2):
        _cut_client(url, body, up)
    _until(lambda: len(up.hung_up) == 2, f"the upstream saw {up.hung_up} hung up")
    _until(lambda: _metric(url, "tokenmill_proxy_requests_in_flight") == 0, "in flight stuck")
    assert _post(url, "ok").status_code == 200
    got = rows("SELECT error_type, finish_reason FROM requests ORDER BY arrival_ns")
    px.stop()
    assert got == [("client_disconnected", "abort")] * 2 + [(None, None)]


@pytest.mark.parametrize("status", ["429", "503"])
def test_a_refusal_keeps_retry_after_and_rate_limit_headers(bad, status):
    url, up, rows, _ = bad
    r = _post(url, f"limited:{status}")
    assert r.status_code == int(status) and r.content == up.sent[f"limited:{status}"]
    assert r.headers["retry-after"] == "7"
    assert r.headers["x-ratelimit-limit-requests"] == "60"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"] == "7s"
    assert rows("SELECT http_status, error_type FROM requests") == [(int(status), "upstream_error")]


def test_a_gzip_answer_is_relayed_with_its_encoding_and_still_read(bad):
    """The body's bytes and its Content-Encoding go back as sent (the client decodes them);
    the proxy reads the usage from a decoded copy."""
    url, up, rows, _ = bad
    body = {"model": "gzip", "messages": [], "stream": False}
    with (
        httpx.Client(timeout=HANG_GUARD_S) as c,
        c.stream("POST", url + "/v1/chat/completions", json=body) as r,
    ):
        raw = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
        assert r.headers["vary"] == "accept-encoding"
    assert raw == up.sent["gzip"]
    assert json.loads(gzip.decompress(raw))["usage"]["completion_tokens"] == 50
    assert rows("SELECT input_tokens, output_tokens, error_type FROM requests") == [(4, 50, None)]


def test_a_deeply_nested_body_is_a_400_naming_the_problem(bad):
    url, up, rows, _ = bad
    body = b'{"model": "ok", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(url + "/v1/chat/completions", content=body, timeout=HANG_GUARD_S,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "body" and "nested too deeply" in err["message"]
    assert up.received == []
    assert rows("SELECT http_status, error_type FROM requests") == [(400, "invalid_request")]


def _vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _read_answer(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    s.settimeout(HANG_GUARD_S)
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        assert got, f"closed without an answer: {data!r}"
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length")))  # fmt: skip
    while len(rest) < length:
        got = s.recv(65536)
        assert got
        rest += got
    return int(head.split(b" ")[1]), rest[:length]


def test_an_oversize_body_is_a_413_read_no_further_than_the_limit(tmp_path):
    """`tokenmill proxy` as a process (the default `--max-body-bytes`, the server's): a 64 MiB
    chunked body (no length said up front) is refused with 413 naming the limit once the limit
    is passed, and the proxy's peak memory grows by far less than the body; a body whose
    declared length is over the limit is refused before it is read."""
    from tokenmill.engine.serve_config import ServeConfig

    limit = ServeConfig().max_body_bytes
    up = RawUpstream()
    db = tmp_path / "p.duckdb"
    p, url = start_proxy(up.url, db)
    port = int(url.rsplit(":", 1)[1])
    body_mib = 64
    try:
        assert _post(url, "ok").status_code == 200  # warm: the request path's code is loaded
        before = _vm_hwm_kib(p.pid)
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")  # fmt: skip
            piece = _chunk(b" " * (1 << 20))
            sent = 0
            for _ in range(body_mib):
                if select.select([s], [], [], 0)[0]:
                    break  # the proxy answered
                try:
                    s.sendall(piece)
                except OSError:
                    break
                sent += 1
            status, answer = _read_answer(s)
        grown_mib = (_vm_hwm_kib(p.pid) - before) / 1024
        assert status == 413, answer
        err = json.loads(answer)["error"]
        assert err["code"] == "body_too_large" and str(limit) in err["message"]
        assert sent < body_mib  # refused before the whole body was sent
        print(f"peak memory grew {grown_mib:.1f} MiB for a {body_mib} MiB body ({sent} sent)")
        assert grown_mib < body_mib / 4
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: %d\r\n\r\n{" % (128 << 20))  # fmt: skip
            status, answer = _read_answer(s)
        assert status == 413 and str(limit) in json.loads(answer)["error"]["message"]
        assert up.received == ["ok"]  # neither was forwarded
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=30)
        up.stop()
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        got = con.execute("SELECT http_status, error_type FROM requests ORDER BY arrival_ns")
        assert got.fetchall() == [(200, None), (413, "body_too_large"), (413, "body_too_large")]
    finally:
        con.close()
