"""`pip install tokenmill` alone is the observer: the built wheel installed into a fresh venv
from the package registries (no extras) has no torch, triton or transformers, and there
`tokenmill proxy` in front of a real `tokenmill serve` (this checkout's full install), then
`diagnose`, `plan` and the console on what it recorded, all work; `serve` names the extra."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest
from server_proc import Server, free_port  # tests/helpers/ is on the path (conftest)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def observer(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed as `pip install tokenmill` does: its bin folder."""
    tmp = tmp_path_factory.mktemp("observer")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "wheels"), str(REPO)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    (wheel,) = (tmp / "wheels").glob("tokenmill-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"tokenmill @ {wheel.as_uri()}"],
        check=True, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    return venv / "bin"


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENMILL_", "PYTHONPATH"))}
    env["TOKENMILL_HOME"] = str(tmp / "home")
    return env


def _wait(url: str, proc: subprocess.Popen, log: Path, path: str = "/health") -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not come up: {log.read_text()}"
        time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_the_observer_install_has_no_torch_triton_or_transformers(observer):
    for module in ("torch", "triton", "transformers", "safetensors"):
        r = subprocess.run(
            [str(observer / "python"), "-c", f"import {module}"], capture_output=True
        )
        assert r.returncode != 0, f"{module} is importable in the observer install"


def test_engine_commands_name_the_extra_in_one_line(observer, tmp_path):
    r = subprocess.run(
        [str(observer / "tokenmill"), "serve", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, env=_env(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "error: this needs torch, which comes with the engine extra: pip install 'tokenmill[engine]'"
    ]


def test_plan_runs_over_a_recording_in_the_observer_install(observer, tmp_path):
    r = subprocess.run(
        [str(observer / "tokenmill"), "plan", str(REPO / "benchmarks/data/plan_recording"),
         "--what-if", "rate=2x", "--format", "json"],
        capture_output=True, text=True, timeout=600, env=_env(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["recording"]["requests"] == 81


def test_proxy_diagnose_and_console_from_the_observer_in_front_of_a_real_server(
    observer, tmp_path, smollm2_dir
):
    server = Server(tmp_path, "--model", str(smollm2_dir), "--no-trace-db")
    store = tmp_path / "proxy.duckdb"
    port = free_port()
    log = tmp_path / "proxy.log"
    try:
        with open(log, "w") as out:
            # the OpenAI base URL, as clients write it
            proxy = subprocess.Popen(
                [str(observer / "tokenmill"), "proxy", "--upstream", f"{server.url}/v1",
                 "--port", str(port), "--trace-db", str(store), "--scrape-interval", "1s"],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(tmp_path),
                start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(url, proxy, log)
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            for i in range(6):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Name a colour ({i})."}],
                    "max_tokens": 8,
                    "stream": i % 2 == 0,
                }
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
            time.sleep(2.5)  # two scrapes of the upstream's gauges
        finally:
            _stop(proxy)
    finally:
        server.stop()
    with duckdb.connect(str(store), read_only=True) as con:
        # a client-side TTFT needs a stream: the three streamed requests have one
        n, with_ttft, roots = con.execute(
            "SELECT count(*), count(ttft_ms) FILTER (WHERE stream), "
            "(SELECT count(*) FROM spans WHERE kind = 'SERVER' AND name LIKE 'chat %') "
            "FROM requests"
        ).fetchone()
    assert (n, with_ttft, roots) == (6, 3, 6)

    diag = subprocess.run(
        [str(observer / "tokenmill"), "diagnose", str(store), "--format", "json"],
        capture_output=True, text=True, timeout=600, env=_env(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert diag.returncode == 0, diag.stderr
    summary = json.loads(diag.stdout)["summary"]
    assert summary["requests"] == summary["completed"] == 6 and summary["ttft_p50_ms"] > 0

    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run `make chromium`"
    from playwright.sync_api import sync_playwright

    cport = free_port()
    clog = tmp_path / "console.log"
    with open(clog, "w") as out:
        console = subprocess.Popen(
            [str(observer / "tokenmill"), "dashboard", "--source", str(store),
             "--host", "127.0.0.1", "--port", str(cport)],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(tmp_path),
            start_new_session=True,
        )  # fmt: skip
    curl = f"http://127.0.0.1:{cport}"
    try:
        _wait(curl, console, clog, "/_stcore/health")
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(curl, wait_until="domcontentloaded")
                page.wait_for_selector(".js-plotly-plot", timeout=120_000)
                tiles = page.locator('[data-testid="stMetric"]')
                assert tiles.filter(has_text="TTFT p99").count() == 1
                assert page.locator('[data-testid="stException"]').count() == 0
                page.screenshot(path=str(tmp_path / "observer-console.png"), full_page=True)
            finally:
                browser.close()
    finally:
        _stop(console)
