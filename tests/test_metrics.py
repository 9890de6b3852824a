"""ServingMetrics: the exposition is valid (promtool) and its numbers are the rows it was fed."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.telemetry.metrics import ServingMetrics

MODEL = "smollm2-135m"

COMPLETED = [
    # (requests row, itl_ms)
    (
        dict(
            tenant="acme",
            http_status=200,
            finish_reason="stop",
            error_type=None,
            ttft_ms=120.0,
            queue_ms=5.0,
            prefill_ms=100.0,
            decode_ms=80.0,
            tpot_ms=20.0,
            e2e_ms=210.0,
            input_tokens=40,
            output_tokens=5,
            cached_tokens=16,
        ),
        [18.0, 22.0, 20.0, 20.0],
    ),
    (
        dict(
            tenant="acme",
            http_status=200,
            finish_reason="length",
            error_type=None,
            ttft_ms=45.5,
            queue_ms=1.0,
            prefill_ms=40.0,
            decode_ms=None,
            tpot_ms=None,
            e2e_ms=50.0,
            input_tokens=12,
            output_tokens=1,
            cached_tokens=0,
        ),
        [],
    ),
    (
        dict(
            tenant="beta",
            http_status=200,
            finish_reason="stop",
            error_type=None,
            ttft_ms=300.25,
            queue_ms=150.0,
            prefill_ms=140.0,
            decode_ms=60.0,
            tpot_ms=30.0,
            e2e_ms=370.0,
            input_tokens=100,
            output_tokens=3,
            cached_tokens=64,
        ),
        [25.0, 35.0],
    ),
]
REJECTED = dict(
    tenant="beta", http_status=429, finish_reason=None, error_type="rate_limit_exceeded",
    ttft_ms=None, queue_ms=None, prefill_ms=None, decode_ms=None, tpot_ms=None, e2e_ms=2.0,
    input_tokens=None, output_tokens=None, cached_tokens=None,
)  # fmt: skip
ABORTED = dict(
    tenant="acme", http_status=200, finish_reason="abort", error_type=None,
    ttft_ms=None, queue_ms=None, prefill_ms=None, decode_ms=None, tpot_ms=None, e2e_ms=900.0,
    input_tokens=30, output_tokens=0, cached_tokens=8,
)  # fmt: skip
STEPS = [
    dict(num_prefill_tokens=40, num_decode_tokens=0, num_running=1, num_waiting=2,
         kv_blocks_total=100, kv_blocks_used=10, num_preempted=0),
    dict(num_prefill_tokens=0, num_decode_tokens=0, num_running=0, num_waiting=3,
         kv_blocks_total=100, kv_blocks_used=10, num_preempted=0),
    dict(num_prefill_tokens=100, num_decode_tokens=2, num_running=3, num_waiting=1,
         kv_blocks_total=100, kv_blocks_used=30, num_preempted=1),
    dict(num_prefill_tokens=0, num_decode_tokens=2, num_running=2, num_waiting=0,
         kv_blocks_total=100, kv_blocks_used=25, num_preempted=0),
]  # fmt: skip
GPU = dict(
    kind="gpu", device_index=0, power_w=312.5, energy_j=15000.0, gpu_util_pct=87.0,
    dram_bw_util_pct=None, mem_used_bytes=40 * 2**30, sm_clock_mhz=1980, mem_clock_mhz=2619,
    temperature_c=61.0,
)  # fmt: skip
HOST = dict(kind="host", device_index=None, cpu_pct=150.0, rss_bytes=2 * 2**30)


def _fed() -> tuple[ServingMetrics, dict[str, int]]:
    m = ServingMetrics(MODEL)
    drops = {"spans": 7, "requests": 0}
    m.set_drops_source(lambda: dict(drops))
    for row, itl in COMPLETED:
        m.observe_request(row, itl)
    m.observe_request(REJECTED, [])
    m.observe_request(ABORTED, [])
    for step in STEPS:
        m.observe_step(step)
    m.observe_device(GPU)
    m.observe_device(HOST)
    m.set_engine_state(restarts=1, in_flight=0)
    return m, drops


def _samples(body: bytes) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(samples, name: str, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}"
    return samples[key]


def _absent(samples, name: str) -> bool:
    return all(n != name for n, _ in samples)


def test_promtool_accepts_exposition():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool not found: install the Debian package `prometheus` "
            "(apt-get install --no-install-recommends prometheus; `make test` does it)"
        )
    m, _ = _fed()
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60
    )
    report = (proc.stdout + proc.stderr).decode().strip()
    assert proc.returncode == 0 and report == "", f"promtool check metrics:\n{report}"


def test_numbers_match_rows():
    m, drops = _fed()
    s = _samples(m.render()[0])

    ttft = [r["ttft_ms"] / 1000 for r, _ in COMPLETED]
    assert _get(s, "tokenmill_time_to_first_token_seconds_count") == 3
    assert math.isclose(_get(s, "tokenmill_time_to_first_token_seconds_sum"), sum(ttft))
    assert _get(s, "tokenmill_time_to_first_token_seconds_bucket", le="0.1") == 1  # 45.5 ms

    itl = [x / 1000 for _, lst in COMPLETED for x in lst]
    assert _get(s, "tokenmill_inter_token_latency_seconds_count") == 6
    assert math.isclose(_get(s, "tokenmill_inter_token_latency_seconds_sum"), sum(itl))
    # TPOT only for requests with >= 2 output tokens (the first and third).
    assert _get(s, "tokenmill_request_time_per_output_token_seconds_count") == 2
    # e2e: the requests that reached the engine (3 completed + aborted), not the 429.
    assert (
        _get(s, "tokenmill_e2e_request_latency_seconds_count") == 3
    )  # completed only: the aborted request is not a latency sample
    assert _get(s, "tokenmill_request_queue_time_seconds_count") == 3
    assert _get(s, "tokenmill_request_decode_time_seconds_count") == 2

    steps_with_tokens = [t for t in STEPS if t["num_prefill_tokens"] + t["num_decode_tokens"]]
    assert _get(s, "tokenmill_iteration_tokens_count") == len(steps_with_tokens) == 3
    assert _get(s, "tokenmill_iteration_tokens_sum") == 144
    assert _get(s, "tokenmill_num_preemptions_total") == 1
    assert _get(s, "tokenmill_num_requests_running") == 2  # the last step
    assert _get(s, "tokenmill_num_requests_waiting") == 0
    assert math.isclose(_get(s, "tokenmill_kv_cache_usage_perc"), 0.25)
    assert _get(s, "tokenmill_engine_restarts") == 1
    assert _get(s, "tokenmill_requests_in_flight") == 0

    assert _get(s, "tokenmill_request_errors_total", error_type="rate_limit_exceeded") == 1
    assert _get(s, "tokenmill_request_success_total", finished_reason="stop") == 2
    assert _get(s, "tokenmill_request_success_total", finished_reason="length") == 1
    assert not any(
        n == "tokenmill_request_success_total" and ("finished_reason", "abort") in lbl
        for n, lbl in s
    )
    assert _get(s, "tokenmill_requests_total", tenant="beta", status="429") == 1
    assert _get(s, "tokenmill_requests_total", tenant="acme", status="200") == 3

    # Prefix cache: prompt tokens of requests that reached the engine (aborted included).
    assert _get(s, "tokenmill_prefix_cache_queries_total") == 40 + 12 + 100 + 30
    assert _get(s, "tokenmill_prefix_cache_hits_total") == 16 + 0 + 64 + 8
    assert _get(s, "tokenmill_prompt_tokens_total", tenant="acme") == 40 + 12 + 30
    assert _get(s, "tokenmill_generation_tokens_total", tenant="beta") == 3
    assert _get(s, "tokenmill_cached_prompt_tokens_total", tenant="beta") == 64

    assert _get(s, "tokenmill_gpu_power_watts", gpu="0") == 312.5
    assert _get(s, "tokenmill_gpu_sm_clock_mhz", gpu="0") == 1980
    assert _get(s, "tokenmill_gpu_memory_used_bytes", gpu="0") == 40 * 2**30
    assert _absent(s, "tokenmill_gpu_dram_bandwidth_utilization_perc")  # None: not exported
    assert _get(s, "tokenmill_host_cpu_perc") == 150.0
    assert _get(s, "tokenmill_host_rss_bytes") == 2 * 2**30

    assert _get(s, "tokenmill_telemetry_dropped_total", table="spans") == 7
    drops["spans"] = 11
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_telemetry_dropped_total", table="spans") == 11


def test_unknown_device_value_removes_stale_series():
    m = ServingMetrics(MODEL)
    m.observe_device(GPU)
    m.observe_device(dict(GPU, power_w=None))
    s = _samples(m.render()[0])
    assert _absent(s, "tokenmill_gpu_power_watts")
    assert _get(s, "tokenmill_gpu_temperature_celsius", gpu="0") == 61.0
