"""A real alerting path for a run: Debian's ``prometheus`` scraping the targets and loading
``tokenmill export prometheus-rules``, its alerts to ``prometheus-alertmanager``, and a webhook
receiver that records every notification with its arrival time.

``with AlertStack(tmp, targets=["127.0.0.1:8000"]) as stack: ... stack.alerts()`` (the live
soak, ``benchmarks/live_soak.py``); ``make alertmanager`` installs both packages.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml


class AlertingUnavailable(RuntimeError):
    """``prometheus`` or ``prometheus-alertmanager`` is not installed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.posts.append((time.time_ns(), json.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class AlertStack:
    """Prometheus, Alertmanager and a webhook receiver in ``folder``, scraping ``targets``
    every ``scrape_s`` and evaluating the exported rules as often."""

    def __init__(self, folder: Path, targets: list[str], *, scrape_s: float = 5.0):
        self.folder = Path(folder)
        self.targets = targets
        self.scrape_s = scrape_s
        self.procs: list[subprocess.Popen] = []
        self.prometheus = shutil.which("prometheus")
        self.alertmanager = shutil.which("prometheus-alertmanager")
        if not (self.prometheus and self.alertmanager):
            raise AlertingUnavailable(
                "prometheus and prometheus-alertmanager are needed (make alertmanager)"
            )

    def __enter__(self) -> AlertStack:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hook = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
        self.hook.lock, self.hook.posts = threading.Lock(), []
        threading.Thread(target=self.hook.serve_forever, daemon=True).start()
        try:
            am_port = self._start_alertmanager()
            self._start_prometheus(am_port)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        )

    def _start_alertmanager(self) -> int:
        port = _free_port()
        hook = f"http://127.0.0.1:{self.hook.server_port}/"
        cfg = {
            "route": {
                "receiver": "hook",
                "group_by": ["alertname", "instance"],
                "group_wait": "1s",
                "group_interval": "1s",
                "repeat_interval": "24h",
            },
            "receivers": [
                {"name": "hook", "webhook_configs": [{"url": hook, "send_resolved": True}]}
            ],
        }
        path = self.folder / "alertmanager.yml"
        path.write_text(yaml.safe_dump(cfg))
        self._start(
            "alertmanager",
            [
                self.alertmanager,
                f"--config.file={path}",
                f"--storage.path={self.folder / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
        )
        _wait_ok(f"http://127.0.0.1:{port}/-/ready")
        return port

    def _start_prometheus(self, am_port: int) -> None:
        rules = self.folder / "tokenmill-rules.yml"
        subprocess.run(
            [sys.executable, "-m", "tokenmill.engine.cli", "export", "prometheus-rules",
             "--out", str(rules)],
            check=True, capture_output=True,
        )  # fmt: skip
        every = f"{self.scrape_s:g}s"
        cfg = {
            "global": {"scrape_interval": every, "evaluation_interval": every},
            "rule_files": [str(rules)],
            "alerting": {
                "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
            },
            "scrape_configs": [
                {"job_name": "tokenmill", "static_configs": [{"targets": self.targets}]}
            ],
        }
        path = self.folder / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        self.prom_port = _free_port()
        self._start(
            "prometheus",
            [
                self.prometheus,
                f"--config.file={path}",
                f"--storage.tsdb.path={self.folder / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{self.prom_port}",
            ],
        )
        _wait_ok(f"http://127.0.0.1:{self.prom_port}/-/ready")

    def alerts(self, prefix: str = "TokenmillFinding") -> list[dict]:
        """Every notification of an alert named ``prefix...``: ``{"at_ns", "status", "rule",
        "alertname"}`` in arrival order."""
        with self.hook.lock:
            posts = list(self.hook.posts)
        return [
            {
                "at_ns": t,
                "status": a["status"],
                "rule": a["labels"].get("rule_id"),
                "alertname": a["labels"]["alertname"],
            }
            for t, body in posts
            for a in body.get("alerts", [])
            if a["labels"].get("alertname", "").startswith(prefix)
        ]

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if getattr(self, "hook", None) is not None:
            self.hook.shutdown()
            self.hook.server_close()


def _wait_ok(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in {timeout_s:g} s")
        time.sleep(0.3)
