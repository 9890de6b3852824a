"""Authentication on a real server: one key (``--api-key``, ``TOKENMILL_API_KEY``), the admin
key, a keyed ``/metrics``, and the refusal to serve a non-loopback address without a key; the
same server's JSON logs and access log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
            "--log-format", "json", "--access-log",
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
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the access line follows the response's recording
        text = Path(keyed.log.name).read_text()
        if f'"request_id": "{rid}"' in text:
            break
        time.sleep(0.2)
    lines = [line for line in text.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]  # every one parses
    assert {r["logger"].split(".")[0] for r in records} == {"tokenmill"}
    assert len({r["pid"] for r in records}) >= 2  # the API process and its engine core
    (mine,) = [r for r in records if r.get("request_id") == rid]
    assert mine["logger"] == "tokenmill.access" and mine["level"] == "info"
    assert (mine["path"], mine["status"], mine["tenant"]) == ("/v1/completions", 200, "default")
    assert len(mine["trace_id"]) == 32 and mine["duration_ms"] > 0
    assert "C kernels on" in text or "C kernels off (" in text
