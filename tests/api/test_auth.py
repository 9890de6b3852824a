"""Authentication on a real server: one key (``--api-key``, ``TOKENMILL_API_KEY``), the admin
key, a keyed ``/metrics``, and the refusal to serve a non-loopback address without a key; the
same server's JSON logs and access log, and its OTLP receiver (``--otlp-receiver``, admin key)
putting a gateway's span into the server's own trace."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest
from server_proc import Server

MODEL = "smollm2-135m-instruct"
KEY, ADMIN, METRICS = "sk-one-key", "sk-admin", "sk-scrape"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("TOKENMILL_")}
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_a_public_address_without_a_key_is_refused_in_one_line(tmp_path):
    """``--host 0.0.0.0`` with no key: one line naming the ways out, exit 2, before any model
    loads (the folder does not even exist)."""
    missing = str(tmp_path / "no-model")
    proc = _cli("serve", "--host", "0.0.0.0", "--model", missing)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--api-key" in lines[0] and "--allow-unauthenticated" in lines[0]
    assert "Traceback" not in proc.stderr
    # the other refusals of the key options are one line too (exit 1)
    for args, needle in (
        (("--api-key", "k", "--tenants", "t.toml"), "not both"),
        (("--admin-key", "a"), "goes with --api-key"),
        (("--api-key", " "), "is empty"),
        (("--open-metrics", "--metrics-key", "m"), "drop it or --metrics-key"),
    ):
        proc = _cli("serve", "--model", missing, *args)
        assert proc.returncode == 1 and needle in proc.stderr, proc.stderr
        assert len([x for x in proc.stderr.splitlines() if x.strip()]) == 1


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("keyed")
    os.environ["TOKENMILL_API_KEY"] = KEY  # the environment variable, as a container sets it
    try:
        server = Server(
            tmp, "--model", str(smollm2_dir), "--admin-key", ADMIN, "--metrics-key", METRICS,
            "--log-format", "json", "--access-log", "--otlp-receiver",
        )  # fmt: skip
    finally:
        del os.environ["TOKENMILL_API_KEY"]
    yield server
    server.stop()


def _get(server, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + path, headers=headers, timeout=60)


def _post(server, path: str, body: dict, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


@pytest.mark.slow
def test_one_key_guards_every_route_but_health(keyed):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        for key in (None, "sk-wrong", ADMIN):
            r = _post(keyed, path, body, key)
            assert r.status_code == 401, (path, key, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert _post(keyed, path, body, KEY).status_code == 200
    for path in ("/v1/models", "/openapi.json"):
        assert _get(keyed, path, None).status_code == 401
        assert _get(keyed, path, KEY).status_code == 200
    assert _get(keyed, "/v1/models", KEY).json()["data"][0]["id"] == MODEL
    # the admin endpoints take the admin key only: the tenant's key is 403
    assert _get(keyed, "/admin/dump", None).status_code == 401
    assert _get(keyed, "/admin/dump", KEY).status_code == 403
    assert _get(keyed, "/admin/dump", ADMIN).status_code == 200
    # /metrics names tenants: it takes the metrics key only
    for key in (None, KEY):
        assert _get(keyed, "/metrics", key).status_code == 401
    r = _get(keyed, "/metrics", METRICS)
    assert r.status_code == 200 and 'tenant="default"' in r.text
    # /health stays open for load balancers and orchestrators
    assert _get(keyed, "/health", None).json()["status"] == "ok"


@pytest.mark.slow
def test_json_logs_carry_request_and_trace_ids(keyed):
    """``--log-format json --access-log``: every log line of the server and its engine core
    parses as JSON; each completion request has an access line with its request id, trace id,
    tenant, path and status; the start says whether the C kernels are on, with no flag."""
    r = _post(keyed, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, KEY)
    assert r.status_code == 200
    rid = r.json()["id"]
    # uvicorn's own warning for bytes that are not HTTP (before: its own text format)
    host, port = keyed.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        sock.recv(1024)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the access line follows the response's recording
        text = Path(keyed.log.name).read_text()
        if f'"request_id": "{rid}"' in text:
            break
        time.sleep(0.2)
    lines = [line for line in text.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]  # every one parses
    assert {r["logger"].split(".")[0] for r in records} == {"tokenmill", "uvicorn"}
    (bad,) = [r for r in records if r["logger"] == "uvicorn.error"]
    assert bad["level"] == "warning" and "Invalid HTTP request" in bad["message"], bad
    assert "Invalid HTTP request" not in "".join(
        line for line in text.splitlines() if not line.startswith("{")
    )
    assert len({r["pid"] for r in records}) >= 2  # the API process and its engine core
    (mine,) = [r for r in records if r.get("request_id") == rid]
    assert mine["logger"] == "tokenmill.access" and mine["level"] == "info"
    assert (mine["path"], mine["status"], mine["tenant"]) == ("/v1/completions", 200, "default")
    assert len(mine["trace_id"]) == 32 and mine["duration_ms"] > 0
    assert "C kernels on" in text or "C kernels off (" in text


def _gateway_span(trace_id: str, span_id: str, start_ns: int, end_ns: int) -> dict:
    """An OTLP/JSON export of one span from a gateway in front of the server."""
    return {
        "resourceSpans": [{
            "resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": "edge-gateway"}}]},
            "scopeSpans": [{"scope": {"name": "gateway"}, "spans": [{
                "traceId": trace_id, "spanId": span_id, "name": "gateway.route",
                "kind": 2, "startTimeUnixNano": str(start_ns), "endTimeUnixNano": str(end_ns),
                "attributes": [{"key": "route", "value": {"stringValue": "/v1/completions"}}],
            }]}],
        }]
    }  # fmt: skip


@pytest.mark.slow
def test_the_otlp_receiver_puts_a_gateways_span_in_the_servers_trace(keyed, tmp_path):
    """A gateway calls the server with its ``traceparent`` and exports its own span to the
    server's ``/v1/traces``: the admin key only, and the dump then holds one trace with the
    gateway's span and the server's stations, the gateway's span their parent."""
    trace_id, gw_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    began = time.time_ns()
    r = httpx.post(
        keyed.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}", "traceparent": f"00-{trace_id}-{gw_span}-01"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    export = _gateway_span(trace_id, gw_span, began, time.time_ns())
    for key, status in ((None, 401), (KEY, 403)):
        assert _post(keyed, "/v1/traces", export, key).status_code == status
    assert _post(keyed, "/v1/traces", export, ADMIN).status_code == 200
    # garbage is a 400 and stores nothing
    assert _post(keyed, "/v1/traces", {"resourceSpans": "x"}, ADMIN).status_code == 400
    deadline = time.monotonic() + 30
    while True:
        dump = _get(keyed, "/admin/dump", ADMIN)
        assert dump.status_code == 200
        path = tmp_path / "dump.duckdb"
        path.write_bytes(dump.content)
        con = duckdb.connect(str(path), read_only=True)
        rows = con.execute(
            "SELECT name, parent_span_id FROM spans WHERE trace_id = ?", [trace_id]
        ).fetchall()
        requests = con.execute(
            "SELECT count(*) FROM requests WHERE trace_id = ?", [trace_id]
        ).fetchone()[0]
        con.close()
        names = {name for name, _ in rows}
        if ("gateway.route" in names and "decode" in names) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {"gateway.route", "gateway", "prefill", "decode"} <= names, rows
    # the server's root span hangs under the gateway's span; the request row is the server's
    # own, not a second one from the received span
    assert [name for name, parent in rows if parent == gw_span], rows
    assert requests == 1
