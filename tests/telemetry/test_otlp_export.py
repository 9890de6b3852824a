"""The OTLP span export against a collector that fails: a black hole (accepts, never answers)
and a refused port, through the real ``Telemetry`` with the real OTLP/HTTP exporter as our code
configures it. The queue stays bounded, what did not reach the collector is counted by reason
(``/metrics``, ``/health``), and the exit's flush returns (a hang guard, not a speed test)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tokenmill.bench.blackhole import BlackHole
from tokenmill.telemetry.hub import Telemetry
from tokenmill.telemetry.otlp import OTLPConfigError

HANG_GUARD_S = 120  # far above any timeout configured here: only a hang reaches it


def _telemetry(endpoint: str) -> Telemetry:
    return Telemetry("m", trace_db=None, otlp_endpoint=endpoint, device_sample_interval_s=0)


def _spans(tel: Telemetry, n: int) -> None:
    for i in range(n):
        with tel.tracer.start_as_current_span(f"s{i}"):
            pass


def _returns(fn, *args) -> bool:
    """Whether ``fn(*args)`` returns within the hang guard."""
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    return not thread.is_alive()


def _dropped_line(tel: Telemetry, reason: str) -> float:
    text = tel.metrics.render()[0].decode()
    want = f'reason="{reason}"'
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("tokenmill_telemetry_dropped_total{")
        and want in ln
        and 'table="spans"' in ln
    ]
    assert len(lines) == 1, lines
    return float(lines[0].split()[-1])


def test_a_black_holed_collector_bounds_the_queue_counts_every_span_and_lets_the_exit_go(
    monkeypatch, caplog
):
    """A collector that never answers, a 64-span queue, a 30 s export timeout: of 640 spans
    the queue takes 64 and the other 576 are dropped as ``otlp_queue_full``; the exit's flush,
    given 0.5 s, returns and counts the 64 it could not deliver as ``otlp_shutdown``: every
    span is exported or counted, and /metrics and /health say so."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
    with BlackHole() as hole:
        tel = _telemetry(hole.url)
        export = tel.otlp_export
        assert (export.timeout_s, export.max_queue_size) == (30.0, 64)
        _spans(tel, 640)
        # nothing can come back from the black hole within its 30 s timeout: 64 wait
        assert export.pending == 64
        assert export.drops() == {"otlp_queue_full": 576}
        assert _returns(tel.close, 0.5), "the exit's flush hung on the black hole"
        assert hole.connections >= 1 and hole.bytes_in > 0  # the export was really sent
    assert export.exported == 0 and export.pending == 0
    assert export.drops() == {"otlp_queue_full": 576, "otlp_shutdown": 64}
    assert export.offered == 640 == sum(export.drops().values())
    said = [r.getMessage() for r in caplog.records if r.name == "tokenmill.telemetry.otlp"]
    assert sum("otlp_queue_full:" in m for m in said) == 1, said  # once per cause
    assert any("640 of 640 spans not delivered" in m for m in said), said  # then the totals
    assert _dropped_line(tel, "otlp_queue_full") == 576
    assert _dropped_line(tel, "otlp_shutdown") == 64
    health = tel.health()["otlp"]
    assert health["dropped"] == {"otlp_queue_full": 576, "otlp_shutdown": 64}
    assert health["max_queue_size"] == 64 and health["export_timeout_s"] == 30.0


def test_a_refused_collector_counts_failed_exports_and_serving_spans_still_flow(monkeypatch):
    """A port nobody listens on (connection refused): each export fails within its 1 s
    timeout and its spans are counted as ``otlp_export_failed``; later spans still queue."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: refused from now on
    tel = _telemetry(f"http://127.0.0.1:{port}")
    export = tel.otlp_export
    _spans(tel, 9)
    assert _returns(export.force_flush, HANG_GUARD_S * 1000)
    deadline = time.monotonic() + HANG_GUARD_S
    while export.drops().get("otlp_export_failed", 0) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert export.drops() == {"otlp_export_failed": 9} and export.exported == 0
    _spans(tel, 3)
    assert export.pending == 3  # the export goes on taking spans after failures
    assert _returns(tel.close, 5.0)
    assert sum(export.drops().values()) == 12 == export.offered


def test_a_bad_export_timeout_or_queue_size_is_one_line(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "soon")
    with pytest.raises(OTLPConfigError) as err:
        _telemetry("http://127.0.0.1:9")
    assert "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='soon'" in str(err.value)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "0")
    with pytest.raises(OTLPConfigError) as err:
        _telemetry("http://127.0.0.1:9")
    assert "OTEL_BSP_MAX_QUEUE_SIZE='0'" in str(err.value) and "\n" not in str(err.value)
