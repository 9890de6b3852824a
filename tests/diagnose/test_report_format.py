"""Evidence numbers with their units (``diagnose/report.py``: ``format_value``), as the text and
Markdown reports and the console's Diagnosis page show them."""

from __future__ import annotations

import re

import duckdb
import pytest
from synth_store import Phase, write_store

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.report import format_evidence, format_value, to_markdown


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("ttft_p50_first_ms", 5397.8848, "5,398 ms"),  # the example
        ("itl_p99_ms", 44.256, "44.3 ms"),
        ("step_ms_p50_at_peak", 3.14159, "3.14 ms"),
        ("spike_ms_max", 0.01234, "0.0123 ms"),
        ("period_s", 12.5, "12.5 s"),
        ("weight_bytes_total", 538060032, "513 MiB"),
        ("kv_bytes_per_token", 46080, "45.00 KiB"),
        ("kv_cache_bytes", 2 * 1024**3, "2.00 GiB"),
        ("weight_bytes_by_dtype", {"float32": 538060032}, "{float32: 513 MiB}"),
        ("cpu_others_pct", 64.5729, "64.6 %"),
        ("queue_share_of_ttft", 0.9134, "91.3 %"),
        ("prefix_hit_rate", 0.4, "40.0 %"),
        ("kv_usage_max", 0.95, "95.0 %"),
        ("arrival_rate_per_s", 2.5, "2.50 /s"),
        ("arrival_rate", 12.0, "12.0 /s"),
        ("throughput_tok_s", 71.94, "71.9 tok/s"),
        ("decode_gbps_p50", 12.34, "12.3 GB/s"),
        ("prefill_gflops_p50", 1234.5, "1,234 GFLOP/s"),
        ("sm_clock_mhz", 1400.0, "1,400 MHz"),
        ("power_w_mean", 300.4, "300 W"),
        ("ttft_rise", 3.14159, "3.14×"),
        ("waiting_max", 12.0, "12"),
        ("preemptions", 1234, "1,234"),
        ("dtype", "bfloat16", "bfloat16"),
        ("ttft_p99_ms", None, "n/a"),
        ("enable_chunked_prefill", True, "True"),
    ],
)
def test_format_value_reads_the_unit_from_the_key(key, value, shown):
    assert format_value(key, value) == shown


def test_reports_show_evidence_with_units(tmp_path):
    path = tmp_path / "queued.duckdb"
    healthy = Phase(duration_s=40)
    write_store(path, [healthy, healthy.but(duration_s=30, queue_ms=2000)], seed=3)
    with duckdb.connect(str(path), read_only=True) as con:
        report = diagnose(con)
    f = report.findings[0]
    md = to_markdown(report)
    assert "- Evidence: " + format_evidence(f.evidence, code=True) in md
    evidence_lines = [line for line in md.splitlines() if line.startswith("- Evidence:")]
    for line in evidence_lines:  # no raw float like 5397.8848 is left in any finding
        assert not re.search(r"\d\.\d{4}", line), line
    ms = [k for k, v in f.evidence.items() if k.endswith("_ms") and isinstance(v, float)]
    assert ms and all(f"`{k}` = {format_value(k, f.evidence[k])}" in md for k in ms)
    assert all(format_value(k, f.evidence[k]).endswith(" ms") for k in ms)
