"""`tokenmill collect` as a live source beside `tokenmill serve`: keys on its receiver and on its
dump (`/admin/dump`, the server's route, read by `fetch_dump` and `diagnose --url`), its body
limit as configured, its SIGTERM drain (an export in hand is stored, a new one gets 503 with
Retry-After), and OTLP/JSON whose fields have the wrong type refused in one line with nothing
stored, while an export's bad span is left out whole (its station spans and request row too).

The collector runs as a process where its command line is under test; the JSON cases go
through the `collector` fixture (the app over a real DuckDB store)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import httpx
import pytest
from test_collect import _free_port

from tokenmill.telemetry.remote import FetchError, fetch_dump

FIXTURES = Path(__file__).parent / "fixtures" / "otlp"
VLLM_JSON = (FIXTURES / "vllm_request_span.json").read_bytes()
JSON = {"content-type": "application/json"}
API, ADMIN = "exporter-secret", "admin-secret"
REQ_ID = "chatcmpl-3f2a9c1e7b5d4e08a6c1d2e3f4a5b6c7"  # the fixture's vLLM request
HANG_GUARD_S = 30.0


def _start(db: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``tokenmill collect`` as a process in a group of its own, once /health answers."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "collect", "--trace-db", str(db),
         "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "tokenmill collect did not start"
        try:
            httpx.get(url + "/health", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_keys_guard_the_receiver_and_the_dump_that_diagnose_reads(tmp_path, capsys):
    """`--api-key` and `--admin-key`: an export takes either key (401 without), the dump only
    the admin key (403 for the exporter's); the dump holds what was received, and `diagnose
    --url` reads it as a server's; an export past `--otlp-max-body-bytes` is a 413."""
    from tokenmill.diagnose.cli import run as diagnose_run

    proc, url = _start(tmp_path / "c.duckdb", "--api-key", API, "--admin-key", ADMIN,
                       "--otlp-max-body-bytes", "6000")  # fmt: skip
    try:
        sent = [
            httpx.post(url + "/v1/traces", content=VLLM_JSON, headers={**JSON, **h}, timeout=10)
            for h in ({}, _bearer("wrong"), _bearer(API), _bearer(ADMIN))
        ]
        big = httpx.post(url + "/v1/traces", content=b" " * 2000 + VLLM_JSON,
                         headers={**JSON, **_bearer(API)}, timeout=10)  # fmt: skip
        with pytest.raises(FetchError, match="answered 403: admin only"):
            fetch_dump(url, tmp_path / "x.duckdb", api_key=API)
        with pytest.raises(FetchError, match="answered 401"):
            fetch_dump(url, tmp_path / "x.duckdb")
        fetch_dump(url + "/v1", tmp_path / "d.duckdb", api_key=ADMIN)
        assert diagnose_run(None, url=url, api_key=ADMIN, fmt="json") == 0
        report = json.loads(capsys.readouterr().out)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, stderr
    assert [r.status_code for r in sent] == [401, 401, 200, 200]
    assert big.status_code == 413 and "at most 6000" in big.json()["error"]["message"]
    con = duckdb.connect(str(tmp_path / "d.duckdb"), read_only=True)
    try:  # the export taken twice (once per key): each copy's four spans and request row
        names = con.execute("SELECT name, count(*) FROM spans GROUP BY name ORDER BY name")
        spans = names.fetchall()
        requests = con.execute("SELECT request_id, ttft_ms FROM requests").fetchall()
    finally:
        con.close()
    assert spans == [("decode", 2), ("llm_request", 2), ("prefill", 2), ("schedule", 2)]
    assert requests == [(REQ_ID, pytest.approx(800.0))] * 2  # vLLM's 0.8 s to first token
    assert report["findings"] == [] and "not_assessed" in report


def _trickle(url: str, body: bytes, release: threading.Event, out: list) -> None:
    """POST ``body`` in two halves, the second once ``release`` is set."""

    def parts():
        yield body[: len(body) // 2]
        release.wait(HANG_GUARD_S)
        yield body[len(body) // 2 :]

    try:
        r = httpx.post(url + "/v1/traces", content=parts(), headers=JSON, timeout=HANG_GUARD_S)
        out.append(r.status_code)
    except httpx.HTTPError as exc:
        out.append(repr(exc))


def test_sigterm_drains_an_export_in_hand_and_refuses_new_ones_with_retry_after(tmp_path):
    """A SIGTERM to the collector's group while an export is half sent: /health and
    /health/ready say `draining` (503), a new export gets 503 with Retry-After (the exporter
    sends it again later), the one in hand is answered 200 and stored; exit 0."""
    db = tmp_path / "c.duckdb"
    proc, url = _start(db)
    release, out = threading.Event(), []
    sender = threading.Thread(target=_trickle, args=(url, VLLM_JSON, release, out))
    try:
        sender.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while httpx.get(url + "/health", timeout=5).json()["open_exports"] != 1:
            assert time.monotonic() < deadline, "the export never arrived"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the collector did not drain"
            time.sleep(0.05)
        ready = httpx.get(url + "/health/ready", timeout=5)
        late = httpx.post(url + "/v1/traces", content=VLLM_JSON, headers=JSON, timeout=5)
        release.set()
        sender.join(HANG_GUARD_S)
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        release.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert late.status_code == 503 and late.headers["retry-after"] == "5"
    assert out == [200]
    assert proc.returncode == 0, stderr
    assert "SIGTERM: storing 1 exports in hand" in stderr
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT request_id FROM requests").fetchall() == [(REQ_ID,)]
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (4,)
    finally:
        con.close()


def _span(doc: dict) -> dict:
    return doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda s: s.update(startTimeUnixNano="soon"),
         "spans.startTimeUnixNano: invalid literal for int() with base 10: 'soon'"),
        (lambda s: s.update(name=7), "spans.name: expected string or bytes-like object"),
        (lambda s: s["attributes"].__setitem__(0, {"key": "k", "value": "text"}),
         "spans[0].attributes[0].value: expected an object, got str"),
        (lambda s: s.update(events="none"), "spans[0].events: expected an object, got str"),
        (lambda s: s.update(status=[2]), "spans[0].status: expected an object, got list"),
        (lambda s: s["attributes"].__setitem__(0, {"key": "k", "value": {"intValue": "x"}}),
         "attributes.value.intValue: invalid literal for int() with base 10: 'x'"),
    ],
    ids=["time-string", "name-int", "value-string", "events-string", "status-list", "int-text"],
)  # fmt: skip
def test_wrongly_typed_json_fields_are_a_400_in_one_line_and_nothing_is_stored(
    collector, change, reason
):
    client, store = collector
    doc = json.loads(VLLM_JSON)
    change(_span(doc))
    r = client.post("/v1/traces", content=json.dumps(doc), headers=JSON)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and reason in message, message
    assert message.startswith("not an OTLP trace export (") and "\n" not in message
    assert store.flush()
    assert store.query("SELECT (SELECT count(*) FROM spans), (SELECT count(*) FROM requests)") == [
        (0, 0)
    ]


def test_fields_of_unknown_names_are_ignored_as_otlp_json_asks(collector):
    """A newer exporter's fields the receiver does not know are ignored, not a 400."""
    client, store = collector
    doc = json.loads(VLLM_JSON)
    _span(doc)["someFutureField"] = {"x": 1}
    doc["resourceSpans"][0]["alsoNew"] = 3
    r = client.post("/v1/traces", content=json.dumps(doc), headers=JSON)
    assert r.status_code == 200, r.text
    assert store.flush()
    assert store.query("SELECT request_id FROM requests") == [(REQ_ID,)]


def test_a_rejected_span_leaves_none_of_its_rows_and_the_rest_is_stored_whole(collector):
    """Two vLLM request spans in one export, the second with a token count the store cannot
    hold: the first is stored whole (its span, its three stations, its request row), nothing
    of the second (no span of its trace, no request row), and partial_success counts it."""
    client, store = collector
    doc = json.loads(VLLM_JSON)
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    bad = json.loads(json.dumps(spans[0]))
    bad["traceId"], bad["spanId"] = "0123456789abcdef0123456789abcdef", "00f067aa0ba902b8"
    for a in bad["attributes"]:
        if a["key"] == "gen_ai.request.id":
            a["value"] = {"stringValue": "cmpl-bad"}
        if a["key"] == "gen_ai.usage.completion_tokens":
            a["value"] = {"intValue": str(2**40)}
    spans.append(bad)
    r = client.post("/v1/traces", content=json.dumps(doc), headers=JSON)
    assert r.status_code == 200
    assert r.json()["partialSuccess"]["rejectedSpans"] == "1"
    assert store.flush()
    good_trace = _span(json.loads(VLLM_JSON))["traceId"]
    rows = store.query("SELECT trace_id, name FROM spans ORDER BY name")
    assert rows == [(good_trace, n) for n in ("decode", "llm_request", "prefill", "schedule")]
    assert store.query("SELECT request_id FROM requests") == [(REQ_ID,)]


@pytest.mark.parametrize(
    ("keys", "dump_takes", "dump_refuses"),
    [
        ({"api_key": API}, API, "other"),
        ({"admin_key": ADMIN}, ADMIN, API),
        ({"api_key": API, "admin_key": ADMIN}, ADMIN, API),
    ],
)
def test_with_one_key_that_key_opens_the_dump_too(keys, dump_takes, dump_refuses):
    """The collector's keys as `_gateway` builds them: with `--api-key` alone (or
    `--admin-key` alone) that one key opens both routes; with both, the dump takes only the
    admin key and an export either."""
    from tokenmill.engine.api.errors import APIError
    from tokenmill.telemetry.collect import key_check
    from tokenmill.telemetry.collect_cli import CollectConfig, _gateway

    gateway = _gateway(CollectConfig(**keys))
    gateway.authenticate_admin(f"Bearer {dump_takes}", "127.0.0.1")
    with pytest.raises(APIError) as refused:
        gateway.authenticate_admin(f"Bearer {dump_refuses}", "127.0.0.1")
    assert refused.value.status in (401, 403)
    check = key_check(gateway)  # the receiver's: every configured key, nothing else
    for key in keys.values():
        assert check(_request(key)) is None
    assert check(_request("other")).status_code == 401
    assert check(_request(None)).status_code == 401


def _request(key: str | None):
    """A POST /v1/traces as the receiver's check sees it."""
    from starlette.requests import Request

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": "POST", "path": "/v1/traces", "headers": headers,
             "client": ("127.0.0.1", 5000)}  # fmt: skip
    return Request(scope)
