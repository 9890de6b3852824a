"""``bench/drill_load.py``: a server's counters read from a real ``/metrics`` exposition, and a
SIGTERM timed to a real process's exit."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

from prometheus_client import CollectorRegistry, Counter, generate_latest

from tokenmill.bench.drill_load import counter_by, sigterm_and_wait


def test_counter_by_sums_the_matching_samples_per_label_value():
    reg = CollectorRegistry()
    c = Counter("tokenmill_telemetry_dropped", "rows dropped", ["table", "reason"], registry=reg)
    c.labels("spans", "disk_full").inc(3)
    c.labels("spans", "bad_value").inc(1)
    c.labels("requests", "disk_full").inc(5)
    body = generate_latest(reg)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        name = "tokenmill_telemetry_dropped_total"
        assert counter_by(url, name, "reason", table="spans") == {
            "disk_full": 3.0,
            "bad_value": 1.0,
        }
        assert counter_by(url, name, "table", reason="disk_full") == {"spans": 3.0, "requests": 5.0}
        assert counter_by(url, "tokenmill_absent_total", "reason") == {}
    finally:
        server.shutdown()


def test_sigterm_and_wait_gives_the_exit_code_or_kills_a_process_that_stays():
    quits = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code, seconds = sigterm_and_wait(quits, 30)
    assert code == -15 and seconds is not None
    stays = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stays.stdout.readline().strip() == "ready"
    assert sigterm_and_wait(stays, 0.5) == (None, None)
    assert stays.poll() == -9
