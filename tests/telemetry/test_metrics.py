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
    (dict(
        tenant="acme", http_status=200, finish_reason="stop", error_type=None,
        ttft_ms=120.0, queue_ms=5.0, prefill_ms=100.0, decode_ms=80.0, tpot_ms=20.0, e2e_ms=210.0,
        input_tokens=40, output_tokens=5, cached_tokens=16,
    ), [18.0, 22.0, 20.0, 20.0]),
    (dict(
        tenant="acme", http_status=200, finish_reason="length", error_type=None,
        ttft_ms=45.5, queue_ms=1.0, prefill_ms=40.0, decode_ms=None, tpot_ms=None, e2e_ms=50.0,
        input_tokens=12, output_tokens=1, cached_tokens=0,
    ), []),
    (dict(
        tenant="beta", http_status=200, finish_reason="stop", error_type=None,
        ttft_ms=300.25, queue_ms=150.0, prefill_ms=140.0, decode_ms=60.0, tpot_ms=30.0,
        e2e_ms=370.0, input_tokens=100, output_tokens=3, cached_tokens=64,
    ), [25.0, 35.0]),
]  # fmt: skip
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
    drops = {("spans", "queue_full"): 7, ("requests", "queue_full"): 0}
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
    m.set_weight_bytes({"int4": 53_084_160, "float32": 113_281_280})
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
    assert _get(s, "tokenmill_engine_restarts_total") == 1
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
    # clocks in the base unit: NVML's 1980 MHz and 2619 MHz as hertz
    assert _get(s, "tokenmill_gpu_sm_clock_hertz", gpu="0") == 1980e6
    assert _get(s, "tokenmill_gpu_memory_clock_hertz", gpu="0") == 2619e6
    assert _get(s, "tokenmill_gpu_memory_used_bytes", gpu="0") == 40 * 2**30
    assert _absent(s, "tokenmill_gpu_dram_bandwidth_utilization_ratio")  # None: not exported
    assert math.isclose(_get(s, "tokenmill_gpu_utilization_ratio", gpu="0"), 0.87)  # NVML's 87 %
    assert _get(s, "tokenmill_host_cpu_cores") == 1.5  # 150 % of one core
    # one scale per suffix: no exported _perc or _ratio series above 1
    assert all(v <= 1 for (n, _), v in s.items() if n.endswith(("_perc", "_ratio")))
    # request lengths: every request that reached the engine (3 completed + the aborted one)
    assert _get(s, "tokenmill_request_prompt_tokens_count") == 4
    assert _get(s, "tokenmill_request_prompt_tokens_sum") == 40 + 12 + 100 + 30
    assert _get(s, "tokenmill_host_rss_bytes") == 2 * 2**30

    drop = dict(table="spans", reason="queue_full")
    assert _get(s, "tokenmill_telemetry_dropped_total", **drop) == 7
    drops["spans", "queue_full"] = 11
    drops["spans", "disk_full"] = 3
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_telemetry_dropped_total", **drop) == 11
    assert _get(s, "tokenmill_telemetry_dropped_total", table="spans", reason="disk_full") == 3


def test_spec_decode_counters_from_step_records():
    """vLLM's spec_decode_* counters, fed from real StepRecords (the engine_steps row)."""
    from tokenmill.engine.messages import StepRecord, to_row

    m = ServingMetrics(MODEL)
    s = _samples(m.render()[0])
    # speculation off: the totals exist at zero, no position series yet
    assert _get(s, "tokenmill_spec_decode_num_drafts_total") == 0
    assert _get(s, "tokenmill_spec_decode_num_draft_tokens_total") == 0
    assert _get(s, "tokenmill_spec_decode_num_accepted_tokens_total") == 0
    assert _absent(s, "tokenmill_spec_decode_num_accepted_tokens_per_pos_total")
    base = dict(step_id=0, start_ns=1, end_ns=2, schedule_ms=0.1, forward_ms=1.0, sample_ms=0.1)
    steps = [
        # 2 requests verified 3 drafts each: 2 + 1 accepted at position 0, 1 at 1, 0 at 2
        StepRecord(**base, num_decode_tokens=8, num_sampled=2, num_drafts=2, num_draft_tokens=6,
                   num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0]),
        StepRecord(**base, num_decode_tokens=3),  # a decode step without drafts
        StepRecord(**base, num_decode_tokens=4, num_sampled=1, num_drafts=1, num_draft_tokens=3,
                   num_accepted_tokens=3, num_accepted_tokens_per_pos=[1, 1, 1]),
    ]  # fmt: skip
    for rec in steps:
        m.observe_step(to_row(rec))
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_spec_decode_num_drafts_total") == 3
    assert _get(s, "tokenmill_spec_decode_num_draft_tokens_total") == 9
    assert _get(s, "tokenmill_spec_decode_num_accepted_tokens_total") == 6
    per_pos = "tokenmill_spec_decode_num_accepted_tokens_per_pos_total"
    assert [_get(s, per_pos, position=str(i)) for i in range(3)] == [3, 2, 1]
    assert _absent(s, per_pos) is False and ("position", "3") not in {
        kv for n, lbl in s if n == per_pos for kv in lbl
    }


def test_weight_bytes_gauge_by_dtype():
    m, _ = _fed()
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_model_weight_bytes", dtype="int4") == 53_084_160
    assert _get(s, "tokenmill_model_weight_bytes", dtype="float32") == 113_281_280
    m.set_weight_bytes({"float32": 537_954_048})  # a restart with another model: int4 gone
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_model_weight_bytes", dtype="float32") == 537_954_048
    assert (
        "tokenmill_model_weight_bytes",
        frozenset({"model_name": MODEL, "dtype": "int4"}.items()),
    ) not in s


def test_monotonic_values_are_counters_fed_their_increments():
    """Energy (J since the sampler started) and engine restarts only grow: counters, each
    increased by what it grew since the last sample (a repeated value adds nothing)."""
    m = ServingMetrics(MODEL)
    m.observe_device(GPU)  # 15000 J: the first sample sets the base
    m.observe_device(dict(GPU, energy_j=15250.0))
    m.observe_device(dict(GPU, energy_j=15250.0))
    m.set_engine_state(restarts=1)
    m.set_engine_state(restarts=3)
    m.set_engine_state(restarts=3)
    m.set_build_info("0.1.0", "3.11.7", "2.13.0", "avx512_vnni")
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_gpu_energy_joules_total", gpu="0") == 250.0
    assert _get(s, "tokenmill_engine_restarts_total") == 3
    build = {"version": "0.1.0", "python": "3.11.7", "torch": "2.13.0"}
    assert _get(s, "tokenmill_build_info", **build, int8_compute="avx512_vnni") == 1


def test_unknown_device_value_removes_stale_series():
    m = ServingMetrics(MODEL)
    m.observe_device(GPU)
    m.observe_device(dict(GPU, power_w=None))
    s = _samples(m.render()[0])
    assert _absent(s, "tokenmill_gpu_power_watts")
    assert _get(s, "tokenmill_gpu_temperature_celsius", gpu="0") == 61.0


# ----- bucket ladders: histogram quantiles agree with the store's quantiles ---------------------

#: (requests-row key, histogram) for the latency histograms.
LATENCY_HISTOGRAMS = (
    ("queue_ms", "tokenmill_request_queue_time_seconds"),
    ("prefill_ms", "tokenmill_request_prefill_time_seconds"),
    ("ttft_ms", "tokenmill_time_to_first_token_seconds"),
    ("decode_ms", "tokenmill_request_decode_time_seconds"),
    ("e2e_ms", "tokenmill_e2e_request_latency_seconds"),
    ("tpot_ms", "tokenmill_request_time_per_output_token_seconds"),
)
#: Stage times (ms) as (median, spread factor) of a log-uniform draw: an idle CPU server (queue
#: ~0.1 ms, as the issue measured), an idle GPU server (everything ~1000x faster than a CPU
#: except the queue) and an overloaded one (seconds of queue).
PROFILES = {
    "idle_cpu": dict(queue_ms=(0.1, 3), prefill_ms=(40, 2), decode_ms=(900, 2), tpot_ms=(30, 1.5)),
    "idle_gpu": dict(queue_ms=(0.05, 3), prefill_ms=(2, 2), decode_ms=(60, 2), tpot_ms=(2, 1.5)),
    "overloaded": dict(queue_ms=(4000, 3), prefill_ms=(300, 2), decode_ms=(5000, 2),
                       tpot_ms=(80, 2)),
}  # fmt: skip


def _profile_rows(profile: str, n: int = 200, seed: int = 0) -> list[tuple[dict, list[float]]]:
    """``requests`` rows as telemetry builds them (``spans.request_row``): stage times in ms,
    TTFT = gateway/tokenize (~0.3 ms) + queue + prefill, e2e = TTFT + decode + stream."""
    import random

    rng = random.Random(seed)

    def draw(key: str) -> float:
        median, spread = PROFILES[profile][key]
        return median * spread ** rng.uniform(-1, 1)

    rows = []
    for _ in range(n):
        queue, prefill, decode, tpot = (
            draw(k) for k in ("queue_ms", "prefill_ms", "decode_ms", "tpot_ms")
        )
        ttft = 0.3 + queue + prefill
        out = max(2, round(decode / tpot) + 1)
        rows.append(
            (
                dict(
                    tenant="acme", http_status=200, finish_reason="length", error_type=None,
                    ttft_ms=ttft, queue_ms=queue, prefill_ms=prefill, decode_ms=decode,
                    tpot_ms=decode / (out - 1), e2e_ms=ttft + decode + 0.2,
                    input_tokens=20, output_tokens=out, cached_tokens=0,
                ),
                [],
            )
        )  # fmt: skip
    return rows


def _buckets(samples, name: str) -> list[tuple[float, float]]:
    return [(float(dict(lbl)["le"]), v) for (n, lbl), v in samples.items() if n == name + "_bucket"]


def test_histogram_quantile_is_prometheus():
    from tokenmill.telemetry.metrics import histogram_quantile

    inf = float("inf")
    assert histogram_quantile(0.5, [(1.0, 0), (2.0, 4), (inf, 4)]) == 1.5
    assert histogram_quantile(0.5, [(0.3, 10), (inf, 10)]) == 0.15  # first bucket from 0
    assert histogram_quantile(0.99, [(1.0, 1), (2.0, 1), (inf, 10)]) == 2.0  # in +Inf
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0), (inf, 0)]))


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_histogram_quantiles_match_the_store_within_2x(profile):
    """p50 and p90 from the exported buckets (PromQL's histogram_quantile) are within 2x of the
    store's quantiles (``quantile_cont``, which :func:`latency.percentile` equals) on the same
    requests, for every latency histogram."""
    from tokenmill.telemetry.latency import percentile
    from tokenmill.telemetry.metrics import histogram_quantile

    m = ServingMetrics(MODEL)
    rows = _profile_rows(profile)
    for row, itl in rows:
        m.observe_request(row, itl)
    s = _samples(m.render()[0])
    for key, name in LATENCY_HISTOGRAMS:
        values = [r[key] / 1000 for r, _ in rows]
        for q in (0.5, 0.9):
            est = histogram_quantile(q, _buckets(s, name))
            true = percentile(values, q * 100)
            assert true / 2 <= est <= true * 2, f"{profile} {name} p{q * 100:.0f}: {est} vs {true}"


def test_vllm_ladder_alone_misreads_an_idle_queue():
    """The 'before': vLLM's request-latency ladder (first bound 0.3 s) reads an idle server's
    0.1 ms queue median as 150 ms; the exported ladder reads it within 2x."""
    from prometheus_client import CollectorRegistry, Histogram

    from tokenmill.telemetry.metrics import VLLM_REQUEST_LATENCY_BUCKETS_S, histogram_quantile

    h = Histogram("q", "q", buckets=VLLM_REQUEST_LATENCY_BUCKETS_S, registry=CollectorRegistry())
    for _ in range(10):
        h.observe(0.0001)
    old = [(s.labels["le"], s.value) for s in h.collect()[0].samples if s.name == "q_bucket"]
    assert histogram_quantile(0.5, old) == pytest.approx(0.15)
    m = ServingMetrics(MODEL)
    for _ in range(10):
        m.observe_request(dict(COMPLETED[0][0], queue_ms=0.1), [])
    new = _buckets(_samples(m.render()[0]), "tokenmill_request_queue_time_seconds")
    assert 0.00005 <= histogram_quantile(0.5, new) <= 0.0002


# ----- /metrics renders off the event loop and is current -----------------------------------------


def test_metrics_route_renders_in_a_thread_and_is_current():
    """The route sets the gauges on the loop, renders in a worker thread (not the loop's), and
    the body holds a counter incremented just before the scrape (no cache)."""
    import threading
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from tokenmill.engine.api.app import ServerState, build_app
    from tokenmill.engine.api.gateway import Gateway
    from tokenmill.engine.api.stations import AdmissionStation, MeteringStation

    m = ServingMetrics(MODEL)
    threads = []
    render = m.render

    def spy_render():
        threads.append(threading.current_thread())
        return render()

    m.render = spy_render
    worker = SimpleNamespace(
        health=lambda: {"stats": {"num_running": 1, "num_waiting": 2, "kv_usage": 0.5}},
        restarts=0,
        heartbeat_age_s=0.25,
    )
    telemetry = SimpleNamespace(metrics=m, dumps=SimpleNamespace(can_dump=False))
    state = ServerState(
        worker=worker,
        gateway=Gateway(None),
        tokenize=None,
        admission=AdmissionStation(4, 4),
        metering=MeteringStation(),
        model_name=MODEL,
        max_body_bytes=1 << 20,
        block_size=16,
        telemetry=telemetry,
    )
    with TestClient(build_app(state)) as client:
        loop_thread = client.portal.call(lambda: threading.current_thread())
        for n in (1, 2):
            m.observe_request(COMPLETED[0][0], [])
            s = _samples(client.get("/metrics").content)
            assert _get(s, "tokenmill_requests_total", tenant="acme", status="200") == n
            assert _get(s, "tokenmill_num_requests_waiting") == 2
            assert _get(s, "tokenmill_engine_heartbeat_age_seconds") == 0.25
        state.metrics_off_loop = False  # the old path, kept for the benchmark: same body
        s = _samples(client.get("/metrics").content)
        assert _get(s, "tokenmill_requests_total", tenant="acme", status="200") == 2
    assert len(threads) == 3
    assert threads[0] is not loop_thread and threads[1] is not loop_thread
    assert threads[2] is loop_thread


def test_render_in_a_thread_while_observing_loses_nothing():
    """Renders on another thread while this one observes (what the server now does): every
    render parses, and the last one holds every observation."""
    import threading

    m = ServingMetrics(MODEL)
    m.set_drops_source(lambda: {("spans", "queue_full"): 1})
    bodies = []
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            bodies.append(m.render()[0])

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(300):
            m.observe_request(dict(COMPLETED[0][0], tenant=f"t{i % 50}"), [20.0])
    finally:
        stop.set()
        t.join()
    for body in bodies:
        _samples(body)  # parses
    s = _samples(m.render()[0])
    assert sum(v for (n, _), v in s.items() if n == "tokenmill_requests_total") == 300
    assert _get(s, "tokenmill_inter_token_latency_seconds_count") == 300
    assert len(bodies) >= 1


def test_a_late_step_record_does_not_roll_the_engine_gauges_back():
    """Step records reach the metrics once their outputs are written to the streams
    (engine/stream_writes.py): a slow stream can deliver step 7's after step 8's. The running,
    waiting and KV gauges keep step 8's values; the counters still count step 7."""
    m = ServingMetrics(MODEL)
    step = dict(num_prefill_tokens=0, num_decode_tokens=4, kv_blocks_total=100,
                num_preempted=0)  # fmt: skip
    m.observe_step({**step, "step_id": 8, "num_running": 1, "num_waiting": 0,
                    "kv_blocks_used": 10})  # fmt: skip
    m.observe_step({**step, "step_id": 7, "num_running": 4, "num_waiting": 3,
                    "kv_blocks_used": 40, "num_preempted": 1})  # fmt: skip
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_num_requests_running") == 1
    assert _get(s, "tokenmill_num_requests_waiting") == 0
    assert _get(s, "tokenmill_kv_cache_usage_perc") == 0.1
    assert _get(s, "tokenmill_num_preemptions_total") == 1
    # a restarted engine core counts its steps from 0 again: its first record counts
    m.observe_step({**step, "engine_pid": 4242, "step_id": 0, "num_running": 2,
                    "num_waiting": 5, "kv_blocks_used": 20})  # fmt: skip
    s = _samples(m.render()[0])
    assert _get(s, "tokenmill_num_requests_running") == 2
    assert _get(s, "tokenmill_num_requests_waiting") == 5


def test_the_metrics_doc_is_the_registry():
    """docs/metrics.md is generated from the registry: one row per defined metric, none
    missing or stale (regenerate with `python -m tokenmill.telemetry.metrics_doc`), and every
    vLLM counterpart it names is a metric we define."""
    from pathlib import Path

    from tokenmill.telemetry import metrics_doc

    page = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert page.read_text() == metrics_doc.render(), "regenerate docs/metrics.md"
    defined = {name for name, *_ in ServingMetrics(MODEL).defined}
    assert set(metrics_doc.VLLM_COUNTERPARTS) <= defined
    # every family the fed registry exports is on the page (a metric made outside the helpers
    # would be missing from it)
    exported = {fam.name for fam in text_string_to_metric_families(_fed()[0].render()[0].decode())}
    documented = {n.removesuffix("_total") for n in defined}
    ours = {n for n in exported if n.startswith("tokenmill_") and not n.endswith("_created")}
    assert ours <= documented, ours - documented


def test_no_created_series_and_the_process_collector():
    """Before: a ``*_created`` series beside every counter and histogram, and no ``process_*``
    series (the registry is our own, so prometheus-client's default collectors were not in it)."""
    body = _fed()[0].render()[0].decode()
    names = [line.split("{")[0].split(" ")[0] for line in body.splitlines() if line[:1] != "#"]
    assert not [n for n in names if n.endswith("_created")], "no _created series"
    samples = {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert samples["process_resident_memory_bytes"] > 10 * 2**20  # this Python process
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_open_fds"] >= 3
