"""The console in a real browser: a real server under a small load writes its trace store, then
``tokenmill dashboard`` serves it on 127.0.0.1 and headless Chromium (Debian's ``chromium``,
driven by playwright) opens Overview, a request's waterfall and the Engine page's roofline,
waits for the plotly charts, finds no Streamlit exception box and saves screenshots into the
test's tmp folder. A synthetic disaggregated store shows the prefill and decode pools and a
request's KV transfer the same way, and a synthetic store with live findings the Now page."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest
from server_proc import Server, free_port
from synth_store import Phase, write_store

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
MODEL = "smollm2-135m-instruct"


async def _load(url: str) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three rivers."}],
        "max_tokens": 16,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as ac:

        async def streamed() -> None:
            async with ac.stream(
                "POST", "/v1/chat/completions", json={**chat, "stream": True}
            ) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    pass

        async def plain() -> None:
            r = await ac.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text

        await asyncio.gather(streamed(), streamed(), plain(), plain())


@pytest.fixture(scope="module")
def real_store(tmp_path_factory, smollm2_dir) -> Path:
    tmp = tmp_path_factory.mktemp("dash-real")
    db = tmp / "traces.duckdb"
    server = Server(
        tmp, "--model", str(smollm2_dir), "--trace-db", str(db), "--device-sample-interval", "0.1"
    )
    try:
        asyncio.run(_load(server.url))
        deadline = time.monotonic() + 120
        while server.health()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        server.stop()
    return db


@pytest.fixture
def console(real_store, tmp_path):
    with _console(real_store, tmp_path) as url:
        yield url


def _start_console(store: Path, tmp_path: Path, log) -> tuple[subprocess.Popen, str]:
    """``tokenmill dashboard`` on ``store`` in a session of its own, on a free port, once its
    health check answers: the process and its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "dashboard", "--source", str(store),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
        try:
            if httpx.get(url + "/_stcore/health", timeout=2).text.strip() == "ok":
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the console did not come up"
        time.sleep(0.5)


@contextlib.contextmanager
def _console(store: Path, tmp_path: Path):
    """``tokenmill dashboard`` on ``store``, on a free port; yields its URL."""
    log = open(tmp_path / "dashboard.log", "w")  # noqa: SIM115
    proc = None
    try:
        proc, url = _start_console(store, tmp_path, log)
        yield url
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)  # the CLI and the streamlit process it started
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            # whatever of the group is left (a Streamlit that outlived its CLI: one per
            # clean-clone run was found still serving, orphaned, hours later)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _settle(page, shots: Path, name: str, min_charts: int = 1) -> None:
    """Wait for the page's plotly charts and for Streamlit to finish the run; screenshot it."""
    page.wait_for_selector(".js-plotly-plot", timeout=120_000)
    deadline = time.monotonic() + 60
    while page.locator('[data-testid="stStatusWidget"]').count() and time.monotonic() < deadline:
        time.sleep(0.3)  # "Running..." still shown
    page.wait_for_timeout(1000)
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0, f"exception on {name}"
    plots = page.locator(".js-plotly-plot")
    assert plots.count() >= min_charts, (
        f"{name}: {plots.count()} plotly charts, expected {min_charts}"
    )
    for i in range(plots.count()):  # the main area scrolls inside the page: shoot each chart
        plots.nth(i).scroll_into_view_if_needed()
        plots.nth(i).screenshot(path=str(shots / f"{name}-chart{i}.png"))


def test_console_pages_in_headless_chromium(console, real_store, tmp_path):
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run `make chromium`"
    from playwright.sync_api import sync_playwright

    with duckdb.connect(str(real_store), read_only=True) as con:
        trace_id, request_id = con.execute(
            "SELECT trace_id, request_id FROM requests WHERE finish_reason = 'length' "
            "ORDER BY e2e_ms DESC LIMIT 1 OFFSET 1"
        ).fetchone()
        (steps,) = con.execute("SELECT count(*) FROM engine_steps WHERE flops > 0").fetchone()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(console, wait_until="domcontentloaded")
            _settle(page, shots, "overview")
            tiles = page.locator('[data-testid="stMetric"]')
            assert tiles.filter(has_text="TTFT p99").count() == 1 and tiles.count() >= 10
            assert page.get_by_text("TTFT and ITL with concurrency").count() == 1

            # the Requests page, opened on one request (not the default slowest one)
            page.goto(f"{console}/requests?trace={trace_id}", wait_until="domcontentloaded")
            _settle(page, shots, "requests-waterfall")
            assert page.get_by_text(f"Request {request_id}").count() == 1
            plot = page.locator(".js-plotly-plot").first
            assert plot.locator("g.trace.bars").count() >= 1  # the stations' bars were drawn

            # the Engine page: the steps on the roofline under the device's peaks
            page.goto(f"{console}/engine", wait_until="domcontentloaded")
            _settle(page, shots, "engine", min_charts=2)
            roof = page.locator(".js-plotly-plot", has_text="Roofline")
            assert roof.count() == 1, "no roofline chart on the Engine page"
            assert roof.get_by_text("arithmetic intensity (FLOP/byte)").count() == 1
            assert roof.locator("path.point").count() >= steps  # one marker per step (+ ridge)
            for name in ("decode-only steps", "bandwidth ceiling", "compute ceiling", "ridge"):
                assert roof.locator("g.legend text", has_text=name).count() >= 1, name
        finally:
            browser.close()
    assert (shots / "overview.png").stat().st_size > 10_000
    assert (shots / "requests-waterfall.png").stat().st_size > 10_000


def test_pd_pools_and_kv_transfer_in_headless_chromium(tmp_path):
    """A synthetic prefill/decode store (tests/helpers/synth_store.py): the Engine page draws the pools
    chart (a column per side) and a request's waterfall its KV transfer and wait bars."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run `make chromium`"
    from playwright.sync_api import sync_playwright

    store = tmp_path / "pd.duckdb"
    phase = Phase(duration_s=10, pd_busy=(0.3, 0.8), waiting=3, kv_transfer_ms=30, kv_wait_ms=10)
    write_store(store, [phase], seed=7)
    with duckdb.connect(str(store), read_only=True) as con:
        (trace_id,) = con.execute(
            "SELECT trace_id FROM requests ORDER BY kv_wait_ms DESC LIMIT 1"
        ).fetchone()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with _console(store, tmp_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/engine", wait_until="domcontentloaded")
            _settle(page, shots, "engine-pd", min_charts=3)
            pools = page.locator(".js-plotly-plot", has_text="Prefill and decode pools")
            assert pools.count() == 1, "no pools chart on the Engine page"
            for title in ("prefill: busy", "decode: busy", "prefill: KV blocks", "decode: KV"):
                assert pools.get_by_text(title).count() == 1, title
            assert pools.locator("g.legend text", has_text="decode hand-offs held").count() == 1
            tiles = page.locator('[data-testid="stMetric"]')
            assert tiles.filter(has_text="KV transfer p50").count() == 1

            page.goto(f"{url}/requests?trace={trace_id}", wait_until="domcontentloaded")
            _settle(page, shots, "requests-pd-waterfall")
            plot = page.locator(".js-plotly-plot").first
            # the stations, the transfer and the wait: three bar traces, then the critical
            # path's, one per phase (`tokenmill explain`; legend "path: <phase>")
            paths = plot.locator("g.legend text", has_text="path: ").count()
            assert paths >= 1, "no critical-path row on the waterfall"
            assert plot.locator("g.trace.bars").count() == 3 + paths
            assert plot.locator("g.legend text", has_text="KV wait (decode side full)").count() == 1
        finally:
            browser.close()
    assert (shots / "engine-pd.png").stat().st_size > 10_000


def test_now_page_in_headless_chromium(findings_store, tmp_path):
    """The Now page on a store with one open and one resolved finding (tests/dashboard/
    conftest.py): the open finding's rule, title and summary, the resolved one in the list with
    how long it lasted, and the timeline drawn with a segment per finding, coloured by
    severity, above the latencies and the queue."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run `make chromium`"
    from playwright.sync_api import sync_playwright

    fs = findings_store
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with _console(fs.path, tmp_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/now", wait_until="domcontentloaded")
            _settle(page, shots, "now")
            main = page.locator('[data-testid="stMain"]')
            assert main.get_by_text("Open findings: 1").count() == 1
            assert main.get_by_text(f"{fs.open_rule} — TTFT is dominated by queueing").count() == 1
            assert main.get_by_text(fs.open_summary).count() == 1
            assert main.get_by_text("Not live:", exact=False).count() == 1
            table = main.locator('[data-testid="stTable"]')
            assert table.get_by_text(fs.resolved_rule).count() == 1
            assert table.get_by_text("30 s").count() == 1
            plot = page.locator(".js-plotly-plot", has_text="Findings (opened")
            assert plot.count() == 1, "no findings timeline on the Now page"
            for name in ("critical", "warning", "TTFT p99", "queue p99"):
                assert plot.locator("g.legend text", has_text=name).count() == 1, name
            # the findings row's two rules on its category axis, one segment each
            for rule in (fs.open_rule, fs.resolved_rule):
                assert plot.locator("g.ytick text", has_text=rule).count() == 1, rule
            assert plot.locator("g.trace.scatter").count() >= 2 + 2 + 2 + 3
        finally:
            browser.close()
    assert (shots / "now.png").stat().st_size > 10_000


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_stop_of_the_console_stops_its_streamlit_process_too(tmp_path, sig):
    """`tokenmill dashboard` stopped by SIGTERM to its own process only (systemd, a
    supervisor), or killed (SIGKILL: the OOM killer): the Streamlit server it started goes
    with it, never left orphaned (before, a SIGKILL left it serving)."""
    import duckdb

    from tokenmill.telemetry.schema import apply_schema

    store = tmp_path / "empty.duckdb"
    with duckdb.connect(str(store)) as con:
        apply_schema(con)
    log = open(tmp_path / "dashboard.log", "w")  # noqa: SIM115
    proc, base = _start_console(store, tmp_path, log)
    url = base + "/_stcore/health"
    try:
        proc.send_signal(getattr(signal, sig))  # the CLI alone, not its group
        proc.wait(30)
        gone = False
        for _ in range(40):
            try:
                httpx.get(url, timeout=1)
            except httpx.HTTPError:
                gone = True
                break
            time.sleep(0.25)
        assert gone, "the Streamlit server still answers after its CLI was stopped"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
