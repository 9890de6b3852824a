"""The findings alerts end to end, nothing mocked: the live diagnosis loop over a real
:class:`~tokenmill.telemetry.store.TraceStore` of an incident exports
``tokenmill_finding_active`` over HTTP; Debian's ``prometheus`` scrapes it every second with the
rules ``tokenmill export prometheus-rules`` writes, and sends its alerts to Debian's
``prometheus-alertmanager``, which posts them to a webhook receiver in this test.

The loop's clock is the store's: each tick advances it 10 s (the loop's real period), once a
second of wall time. The real period leaves Prometheus and Alertmanager 10 s or more between a
finding's open and its earliest resolve (``resolve_after`` clean periods); compressed tenfold
that is 1 s, under the pipeline's own delay, so the ticks hold (bounded) from the open until the
firing notification has arrived: the measured open → webhook delay is the pipeline's alone.

``make alertmanager`` installs both binaries (Debian's ``prometheus`` and
``prometheus-alertmanager``); without them the test is skipped, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from synth_store import T0, Phase, S, write_store

from tokenmill.diagnose.live import LiveSettings
from tokenmill.diagnose.live_service import LiveMetrics, LiveService
from tokenmill.telemetry.store import TraceStore

TOKENMILL = Path(sys.executable).with_name("tokenmill")
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager")

HEALTHY = Phase(duration_s=90)
# as tests/diagnose/test_live.py: 40 s in which every request waits 2 s in the queue
INCIDENT = [HEALTHY, HEALTHY.but(duration_s=40, queue_ms=2000), HEALTHY.but(duration_s=60)]
FAULT_START, FAULT_END = T0 + 90 * S, T0 + 130 * S
RULE, ALERT = "ttft_queueing", "TokenmillFindingTtftQueueing"

TICK_WALL_S = 1.0  # wall time between ticks
TICK_STORE_S = 10  # store time each tick advances (the loop's period)
WAIT_S = 60.0  # the bound of every wait

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or ALERTMANAGER is None,
    reason="needs Debian's `prometheus` and `prometheus-alertmanager` binaries "
    "(`make alertmanager` installs them)",
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def _wait(pred, what: str, timeout_s: float = WAIT_S, logs: list[Path] = ()):
    """``pred()`` until it answers something truthy, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}\n{tails}")


@pytest.fixture
def start_process(tmp_path):
    """Start a binary with its output in ``tmp_path/<name>.log``; every one started is
    terminated (then killed) when the test ends, whatever happened."""
    procs: list[subprocess.Popen] = []
    logs = []

    def start(name: str, *argv: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        fh = open(log, "w")  # noqa: SIM115
        logs.append(fh)
        proc = subprocess.Popen(
            list(argv), stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
        )
        procs.append(proc)
        return proc, log

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for fh in logs:
        fh.close()


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.posts.append((time.monotonic(), json.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    """An Alertmanager webhook receiver: every POST body with its arrival (monotonic s)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    server.lock = threading.Lock()
    server.posts = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def live(tmp_path):
    """The loop over a real TraceStore of the incident, its series served over HTTP; the
    store's clock starts 50 s before the fault (the health before it: the reference)."""
    path = tmp_path / "incident.duckdb"
    write_store(path, INCIDENT, seed=11)
    store = TraceStore(path, flush_interval_s=0.05)
    registry = CollectorRegistry()
    now = [FAULT_START - 50 * S]
    service = LiveService(
        store, LiveSettings(), metrics=LiveMetrics(registry), clock=lambda: now[0]
    )
    server, thread = start_http_server(0, "127.0.0.1", registry)
    yield service, now, server.server_port
    server.shutdown()
    server.server_close()
    thread.join(5)
    store.close()


def _alerts(posts, name_prefix: str = "TokenmillFinding"):
    """(arrival, status, alert) of every alert posted whose name starts with the prefix."""
    return [
        (t, a["status"], a)
        for t, body in posts
        for a in body["alerts"]
        if a["labels"]["alertname"].startswith(name_prefix)
    ]


def test_a_live_finding_pages_through_prometheus_and_alertmanager_and_resolves(
    tmp_path, start_process, webhook, live
):
    service, now, exporter_port = live
    hook_url = f"http://127.0.0.1:{webhook.server_port}/hook"

    # the rules, as a user writes them
    rules = tmp_path / "tokenmill-rules.yml"
    r = subprocess.run(
        [str(TOKENMILL), "export", "prometheus-rules", "--out", str(rules)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr

    am_port, prom_port = _free_port(), _free_port()
    am_cfg = tmp_path / "alertmanager.yml"
    am_cfg.write_text(
        yaml.safe_dump(
            {
                "route": {
                    "receiver": "hook",
                    "group_by": ["alertname", "instance", "severity"],
                    "group_wait": "1s",
                    "group_interval": "1s",
                    "repeat_interval": "4h",
                },
                "receivers": [
                    {"name": "hook", "webhook_configs": [{"url": hook_url, "send_resolved": True}]}
                ],
            }
        )
    )
    _, am_log = start_process(
        "alertmanager",
        ALERTMANAGER,
        f"--config.file={am_cfg}",
        f"--storage.path={tmp_path / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{am_port}",
        "--cluster.listen-address=",
    )
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(
        yaml.safe_dump(
            {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(rules)],
                "alerting": {
                    "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
                },
                "scrape_configs": [
                    {
                        "job_name": "tokenmill",
                        "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
                    }
                ],
            }
        )
    )
    _, prom_log = start_process(
        "prometheus",
        PROMETHEUS,
        f"--config.file={prom_cfg}",
        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
        f"--web.listen-address=127.0.0.1:{prom_port}",
    )
    logs = [am_log, prom_log]
    am, prom = f"http://127.0.0.1:{am_port}", f"http://127.0.0.1:{prom_port}"

    # everything up: both ready, the exporter scraped, the Alertmanager discovered
    _wait(lambda: _get(f"{am}/-/ready")[0] == 200, "Alertmanager ready", logs=logs)
    _wait(lambda: _get(f"{prom}/-/ready")[0] == 200, "Prometheus ready", logs=logs)

    def query(expr: str) -> list:
        status, body = _get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        return json.loads(body)["data"]["result"] if status == 200 else []

    _wait(lambda: query('up{job="tokenmill"} == 1'), "the exporter scraped", logs=logs)

    def discovered():
        status, body = _get(f"{prom}/api/v1/alertmanagers")
        return status == 200 and json.loads(body)["data"]["activeAlertmanagers"]

    _wait(discovered, "Prometheus to find the Alertmanager", logs=logs)
    _, body = _get(f"{prom}/api/v1/rules")
    groups = {g["name"]: g for g in json.loads(body)["data"]["groups"]}
    assert ALERT in {r["name"] for r in groups["tokenmill-findings"]["rules"]}

    def posted():
        with webhook.lock:
            return list(webhook.posts)

    # tick: 10 s of store time a second, through the fault and until the finding resolved
    opened_at = resolved_at = None
    opened, resolved, severity = [], [], None
    for _ in range(30):
        t_tick = time.monotonic()
        res = service.run_once()
        assert res is not None and res.error is None, res
        now[0] += TICK_STORE_S * S
        opened += [f.rule_id for f in res.opened]
        resolved += [f.rule_id for f in res.resolved]
        if any(f.rule_id == RULE for f in res.opened):
            opened_at = time.monotonic()
            severity = next(f.latest.severity for f in res.opened if f.rule_id == RULE)
            # hold the clock until the page is out (see the module docstring)
            _wait(
                lambda: any(s == "firing" for _, s, _ in _alerts(posted())),
                "the firing notification",
                logs=logs,
            )
        if any(f.rule_id == RULE for f in res.resolved):
            resolved_at = time.monotonic()
            break
        time.sleep(max(0.0, TICK_WALL_S - (time.monotonic() - t_tick)))
    assert opened == [RULE] and resolved == [RULE], (opened, resolved)

    _wait(
        lambda: any(s == "resolved" for _, s, _ in _alerts(posted())),
        "the resolved notification",
        logs=logs,
    )
    time.sleep(2.5)  # any late notification (another alert, a repeat) has time to arrive
    alerts = _alerts(posted())

    instance = f"127.0.0.1:{exporter_port}"
    firing = [(t, a) for t, s, a in alerts if s == "firing"]
    t_fire, first = firing[0]
    assert first["labels"] == {
        "alertname": ALERT,
        "rule": RULE,
        "rule_id": RULE,
        "severity": severity,
        "source": "live_diagnosis",
        "instance": instance,
        "job": "tokenmill",
    }, first["labels"]
    ann = first["annotations"]
    assert ann["runbook_url"] == f"runbooks/{RULE}.md"
    assert f"GET /v1/findings on {instance}" in ann["description"]
    assert ann["summary"].startswith("TTFT up")
    assert t_fire > opened_at, "paged before the loop opened the finding"

    # only this finding's alert, and each firing one resolved after the loop resolved it
    assert {a["labels"]["alertname"] for _, _, a in alerts} == {ALERT}
    resolved_posts = {a["fingerprint"]: t for t, s, a in alerts if s == "resolved"}
    for _, a in firing:
        assert a["fingerprint"] in resolved_posts, a["labels"]
        assert resolved_posts[a["fingerprint"]] > resolved_at, "resolved before the loop did"
    last_firing = max(t for t, _ in firing)
    assert last_firing < min(resolved_posts.values()), "fired again after it resolved"
    # and Prometheus holds no finding alert any more
    assert query('ALERTS{alertname=~"TokenmillFinding.*", alertstate="firing"}') == []

    fire_delay = t_fire - opened_at
    resolve_delay = min(resolved_posts.values()) - resolved_at
    print(
        f"\nopen -> webhook firing: {fire_delay:.2f} s; "
        f"resolve -> webhook resolved: {resolve_delay:.2f} s "
        f"(scrape and evaluation every 1 s, group_wait and group_interval 1 s)"
    )
    assert fire_delay < WAIT_S and resolve_delay < WAIT_S
