"""tokenmill's traces in a real trace UI built on the GenAI semantic conventions: Arize Phoenix
(PyPI `arize-phoenix`, its own venv: `make phoenix`), started here on 127.0.0.1 with its own OTLP
endpoint. A real `tokenmill serve --trace-content` exports to it; Phoenix's REST API then shows,
for every trace, the model, the input and output messages and the token counts, and the eight
stations as children of the root span."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from server_proc import Server, free_port  # tests/helpers/ is on the path (conftest)

from tokenmill.telemetry.schema import STATIONS

PHOENIX = Path(
    os.environ.get("TOKENMILL_PHOENIX", Path.home() / ".cache/tokenmill/phoenix-venv/bin/phoenix")
)
CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    assert PHOENIX.exists(), f"Arize Phoenix is missing at {PHOENIX}: run `make phoenix`"
    tmp = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_WORKING_DIR": str(tmp),
    }
    log = open(tmp / "phoenix.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(PHOENIX), "serve"], stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp / "phoenix.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "Phoenix did not come up"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _spans(phoenix: str) -> list[dict]:
    r = httpx.get(phoenix + "/v1/projects/default/spans", params={"limit": 1000}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]


@pytest.fixture(scope="module")
def exported(phoenix, tmp_path_factory, smollm2_dir):
    """Four requests through a real server that exports to Phoenix: three chats (one streamed),
    one completion. Returns Phoenix's spans and what the clients sent and got."""
    tmp = tmp_path_factory.mktemp("phoenix-serve")
    os.environ["OTEL_METRICS_EXPORTER"] = "none"  # Phoenix takes traces only
    try:
        server = Server(
            tmp, "--model", str(smollm2_dir), "--trace-content", "--otlp-endpoint", phoenix,
            "--no-trace-db",
        )  # fmt: skip
    finally:
        del os.environ["OTEL_METRICS_EXPORTER"]
    sent = []
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i, word in enumerate(("red", "blue", "green")):
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": f"Is the sky {word}?"},
                ],
                "max_tokens": 6,
                "temperature": 0,
                "top_p": 0.9,
                "seed": 11,
                "stream": i == 0,
            }
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200
            sent.append(("chat", body))
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 5}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200
        sent.append(("text_completion", body))
    finally:
        server.stop()  # flushes the exporter on the way out
    deadline = time.monotonic() + 60
    while True:
        spans = _spans(phoenix)
        roots = [s for s in spans if s.get("parent_id") is None]
        if len(roots) >= 4 and len(spans) >= 4 * (1 + len(STATIONS)):
            break
        assert time.monotonic() < deadline, f"Phoenix has {len(spans)} spans"
        time.sleep(1)
    return {"spans": spans, "sent": sent, "model": model}


def _attr(span: dict, key: str):
    attrs = span.get("attributes") or {}
    if key in attrs:
        return attrs[key]
    node = attrs  # Phoenix may nest dotted names
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def test_each_trace_shows_model_input_output_and_token_counts(exported, tmp_path):
    spans, model = exported["spans"], exported["model"]
    roots = [s for s in spans if s.get("parent_id") is None]
    assert sorted(r["name"] for r in roots) == sorted(
        [f"chat {model}"] * 3 + [f"text_completion {model}"]
    )
    for root in roots:
        assert _attr(root, "llm.model_name") == model  # what Phoenix shows as the model
        assert root["span_kind"] == "LLM"
        prompt = _attr(root, "llm.token_count.prompt")
        completion = _attr(root, "llm.token_count.completion")
        assert prompt >= 5 and 1 <= completion <= 6
        assert _attr(root, "llm.token_count.total") == prompt + completion
        inputs = json.loads(_attr(root, "gen_ai.input.messages"))
        outputs = json.loads(_attr(root, "gen_ai.output.messages"))
        assert outputs[0]["role"] == "assistant" and outputs[0]["parts"][0]["content"]
        if root["name"].startswith("chat"):
            assert [m["role"] for m in inputs] == ["system", "user"]
            assert inputs[1]["parts"][0]["content"].startswith("Is the sky ")
            # Phoenix's own message view, derived from the GenAI attributes
            assert _attr(root, "llm.input_messages.1.message.role") == "user"
            assert _attr(root, "llm.input_messages.1.message.content").startswith("Is the sky ")
            params = json.loads(_attr(root, "llm.invocation_parameters"))
            assert params.get("top_p") == 0.9 and params.get("seed") == 11
        else:
            assert inputs[0]["parts"][0]["content"].endswith("The capital of France is")
        assert (
            _attr(root, "llm.output_messages.0.message.content")
            == (outputs[0]["parts"][0]["content"])
        )


def test_the_eight_stations_are_children_of_the_root(exported):
    spans = exported["spans"]
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        by_trace.setdefault(s["context"]["trace_id"], []).append(s)
    assert len(by_trace) == 4
    for members in by_trace.values():
        (root,) = [s for s in members if s.get("parent_id") is None]
        children = sorted(
            s["name"] for s in members if s.get("parent_id") == root["context"]["span_id"]
        )
        assert children == sorted(STATIONS)


def test_phoenix_ui_shows_the_trace_in_headless_chromium(exported, phoenix, tmp_path):
    """Phoenix's own trace page (headless Chromium): the root `chat {model}` with its eight
    stations in the tree, and the messages as sent and answered. TOKENMILL_PHOENIX_SHOT=PATH
    keeps the screenshot."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run `make chromium`"
    from playwright.sync_api import sync_playwright

    project = httpx.get(phoenix + "/v1/projects", timeout=10).json()["data"][0]["id"]
    root = next(
        s for s in exported["spans"] if s.get("parent_id") is None and s["name"].startswith("chat")
    )
    shot = Path(os.environ.get("TOKENMILL_PHOENIX_SHOT") or tmp_path / "phoenix-trace.png")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{phoenix}/projects/{project}/traces/{root['context']['trace_id']}")
            page.get_by_text("Is the sky").first.wait_for(timeout=60_000)
            text = page.inner_text("body")
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    assert root["name"] in text
    for station in STATIONS:
        assert station in text, station
    answer = json.loads(root["attributes"]["gen_ai.output.messages"])[0]["parts"][0]["content"]
    assert answer.strip()[:20] in text
