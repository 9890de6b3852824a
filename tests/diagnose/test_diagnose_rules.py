"""Every rule on synthetic stores written through the real store writer: it fires on its
symptom with the expected evidence, and an all-healthy run gives zero findings."""

from __future__ import annotations

import json
import zlib

import duckdb
import pytest
from synth_store import Phase, write_store

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.rules import RULES, RULES_BY_ID
from tokenmill.diagnose.rules.periodic_itl_spikes import decode_stalls
from tokenmill.diagnose.signals import load as load_signals
from tokenmill.diagnose.signals.host_bursts import LIVE_RUN_EVENT

HEALTHY = Phase(duration_s=40)
# the default model with int4 weights (~0.75 byte a weight with its scales), 2 running decodes
INT4 = HEALTHY.but(quantization="int4", weight_bytes=100_000_000, running=2)
# 4 running decodes: 3 draft tokens each stay below the ridge (~7 FLOP/byte against 10)
SPEC = HEALTHY.but(running=4)
DP2 = HEALTHY.but(replicas=2)  # two data-parallel replicas, the router spreading evenly
TP2 = HEALTHY.but(tp_size=2, collective_share=0.1)  # two ranks, collectives 10% of decode
# disaggregated: each KV moves in ~5 ms after its prefill; each side's core busy a third of
# the time
PD = HEALTHY.but(kv_transfer_ms=5, pd_busy=(0.3, 0.4))

SCENARIOS: dict[str, list[Phase]] = {
    "ttft_queueing": [HEALTHY, HEALTHY.but(duration_s=30, queue_ms=2000)],
    "ttft_prefill_bound": [HEALTHY, HEALTHY.but(duration_s=30, prefill_tok_per_s=100)],
    "head_of_line_blocking": [
        HEALTHY,
        HEALTHY.but(duration_s=30, long_prompt_every=5, short_queue_ms=3000, kv_usage=0.5),
    ],
    "itl_prefill_interference": [
        HEALTHY,
        HEALTHY.but(duration_s=30, long_prompt_every=4, prefill_spike_ms=1500),
    ],
    "itl_frontend_overhead": [HEALTHY, HEALTHY.but(duration_s=30, stream_slowdown=3.0)],
    "kv_pressure_preemption": [
        HEALTHY,
        HEALTHY.but(duration_s=30, kv_usage=0.97, preempt_share=0.3, queue_ms=300),
    ],
    "overload": [
        HEALTHY,
        HEALTHY.but(duration_s=40, rate_per_s=6, queue_growth_ms_per_s=500, waiting_growth_per_s=1),
    ],
    "oom_low_average_memory": [
        HEALTHY,
        HEALTHY.but(duration_s=30, kv_usage=0.2, alloc_failures_per_step=0.05),
    ],
    "kv_block_leak": [HEALTHY, HEALTHY.but(duration_s=20, rate_per_s=0, idle_kv_usage=0.3)],
    "error_spike": [HEALTHY, HEALTHY.but(duration_s=30, rate_per_s=3, error_share=0.4)],
    # the engine core killed 10 s into a busy phase: the requests in flight cut at once
    "engine_crash": [HEALTHY, HEALTHY.but(duration_s=30, rate_per_s=3, crash_at_s=10)],
    # the engine core stopped (SIGSTOP) 30 s with requests running; arrivals wait, none ends
    "engine_stalled": [HEALTHY, HEALTHY.but(duration_s=30, frozen=True)],
    "prefix_cache_miss": [
        HEALTHY.but(prompt_tokens=(100, 200), prefix_cached_share=0.0, first_block_varies=True)
    ],
    "client_server_ttft_gap": [HEALTHY.but(client_ttft_factor=4.0)],
    "batching_ineffective": [
        HEALTHY.but(max_num_seqs=8),
        HEALTHY.but(duration_s=30, max_num_seqs=8, waiting=5, queue_ms=1500, kv_usage=0.2),
    ],
    "batch_too_large": [
        HEALTHY.but(running=8),
        HEALTHY.but(duration_s=40, running=32, step_ms=250, itl_ms=250),
    ],
    "midstream_stall": [
        HEALTHY,
        HEALTHY.but(duration_s=30, preempt_share=0.2, preempt_gap_ms=3000, kv_usage=0.5),
    ],
    "periodic_itl_spikes": [HEALTHY.but(duration_s=60, periodic_spike_s=5, periodic_spike_ms=500)],
    "gpu_throttling": [
        HEALTHY.but(gpu=True),
        HEALTHY.but(
            duration_s=30,
            gpu=True,
            sm_clock_mhz=1200,
            throttle_reasons=("hw_thermal_slowdown",),
            itl_ms=60,
        ),
    ],
    "host_bound_steps": [HEALTHY, HEALTHY.but(duration_s=30, host_share=0.5, step_ms=100)],
    # int4 weights (100 MB a step), ~1,500-token prompts: prefill chunks take ~90% of the forward
    "quantization_no_gain": [INT4.but(prompt_tokens=(1000, 2000), prefill_tok_per_s=500)],
    # the same batch and tokens, 2.5x slower while a neighbour uses 60% of the CPU
    "host_contention": [HEALTHY, HEALTHY.but(duration_s=30, step_ms=100, cpu_others_pct=60)],
    # n-gram drafts of 3 tokens, ~5% accepted, the steps verifying them 1.5x slower
    "spec_decode_ineffective": [
        SPEC,
        SPEC.but(duration_s=30, spec_k=3, spec_accept_rate=0.05, spec_step_slowdown=1.5),
    ],
    # 90% of the requests pinned to replica 0 (3 s more queue), replica 1 idle
    "replica_imbalance": [
        DP2,
        DP2.but(duration_s=30, hot_share=0.9, hot_queue_ms=3000, cool_running=0),
    ],
    # the ranks' collectives take 60% of every decode step (as on more ranks than cores)
    "tp_communication_bound": [TP2, TP2.but(duration_s=30, collective_share=0.6, step_ms=100)],
    # rank 1 of 2 takes 2.5x the compute of rank 0 every sample; rank 0 waits for it (60%)
    "rank_straggler": [
        TP2,
        TP2.but(duration_s=30, collective_share=0.6, straggler_rank=1, straggler_slowdown=2.5),
    ],
    # each KV transfer takes 400 ms against a TTFT of ~80 ms (a slow link)
    "kv_transfer_bound": [PD, PD.but(duration_s=30, kv_transfer_ms=400)],
    # long prompts, short answers: the prefill core busy 97% with 3 s of queue a request, the
    # decode core busy 10%
    "pd_ratio_imbalance": [
        PD,
        PD.but(duration_s=30, pd_busy=(0.97, 0.1), queue_ms=3000, waiting=4),
    ],
}

# the evidence each rule must carry, as (key, predicate)
EXPECTED = {
    "ttft_queueing": ("queue_share_of_ttft", lambda v: v > 0.9),
    "ttft_prefill_bound": ("prefill_share_of_ttft", lambda v: v > 0.8),
    "head_of_line_blocking": ("long_prompts", lambda v: v >= 1),
    "itl_prefill_interference": ("prefill_tokens_max_per_step", lambda v: v >= 1500),
    "itl_frontend_overhead": ("stream_vs_engine_tpot", lambda v: 2.5 < v < 3.5),
    "kv_pressure_preemption": ("kv_usage_max", lambda v: v >= 0.9),
    "overload": ("arrivals", lambda v: v > 0),
    "oom_low_average_memory": ("kv_usage_mean", lambda v: v < 0.4),
    "kv_block_leak": ("idle_kv_usage", lambda v: abs(v - 0.3) < 0.01),
    "error_spike": ("errors_by_type", lambda v: set(v) == {"nan_logits"}),
    "engine_crash": ("cut_requests", lambda v: v >= 1),
    "engine_stalled": ("silent_ms", lambda v: 25_000 < v < 31_000),
    "prefix_cache_miss": ("share", lambda v: v > 0.9),
    "client_server_ttft_gap": ("ratio", lambda v: 3.5 < v < 4.5),
    "batching_ineffective": ("max_num_seqs", lambda v: v == 8),
    "batch_too_large": ("batch", lambda v: v >= 30),
    "midstream_stall": ("stalled_and_preempted", lambda v: v >= 1),
    "periodic_itl_spikes": ("period_s", lambda v: 4.5 < v < 5.5),
    "host_contention": ("same_work_slowdown", lambda v: 2.0 < v < 3.0),
    "gpu_throttling": ("clock_event_reasons", lambda v: v == ["hw_thermal_slowdown"]),
    "host_bound_steps": ("host_share_of_step", lambda v: v >= 0.45),
    "quantization_no_gain": ("compute_bound_prefill_share", lambda v: v > 0.8),
    "spec_decode_ineffective": ("spec_gain_per_cost", lambda v: 0.6 < v < 0.9),
    "replica_imbalance": ("arrival_skew", lambda v: v >= 4),
    "tp_communication_bound": ("decode_collective_share", lambda v: 0.55 < v < 0.65),
    "rank_straggler": ("slowest_rank", lambda v: v == 1),
    "kv_transfer_bound": ("kv_transfer_share_of_ttft", lambda v: v > 3),
    "pd_ratio_imbalance": ("prefill_busy_share", lambda v: v > 0.9),
}


def test_every_rule_has_a_scenario_and_a_runbook():
    assert set(SCENARIOS) == set(RULES_BY_ID) == set(EXPECTED)
    from importlib import resources

    for rule in RULES:
        text = resources.files("tokenmill.runbooks").joinpath(f"{rule.id}.md").read_text()
        assert text.startswith(f"# {rule.id}")
        for heading in (
            "## Symptom",
            "## Confirm",
            "## Likely causes",
            "## Fix",
            "## After the fix",
        ):
            assert heading in text, (rule.id, heading)
        for param in rule.params.values():
            assert param.source, rule.id


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp("diag") / f"{name}.duckdb"
            phases = [HEALTHY.but(duration_s=70)] if name == "healthy" else SCENARIOS[name]
            write_store(path, phases, seed=zlib.crc32(name.encode()) % 1000)
            cache[name] = path
        return duckdb.connect(str(cache[name]), read_only=True)

    return get


def test_healthy_run_has_zero_findings(stores):
    con = stores("healthy")
    report = diagnose(con)
    assert report.findings == [], [f.rule_id for f in report.findings]
    assert report.summary["completed"] > 100 and report.rule_errors == {}
    con.close()


@pytest.mark.parametrize("rule_id", sorted(SCENARIOS))
def test_rule_fires_on_its_symptom(stores, rule_id):
    con = stores(rule_id)
    report = diagnose(con)
    fired = {f.rule_id: f for f in report.findings}
    assert rule_id in fired, f"{rule_id} silent; fired: {sorted(fired)}"
    f = fired[rule_id]
    key, ok = EXPECTED[rule_id]
    assert ok(f.evidence[key]), (key, f.evidence)
    assert f.window_start_ns is not None and f.window_end_ns > f.window_start_ns
    assert f.runbook == f"runbooks/{rule_id}.md" and f.causes and f.knob
    # no example traces: a leak and a pattern over time have none; a stalled engine's requests
    # are still in flight, without a trace in the store yet
    no_examples = (
        "kv_block_leak",
        "oom_low_average_memory",
        "periodic_itl_spikes",
        "engine_stalled",
    )
    if rule_id not in no_examples:
        assert 1 <= len(f.example_trace_ids) <= 5
        (n,) = con.execute(
            "SELECT count(*) FROM spans WHERE kind = 'SERVER' AND trace_id IN "
            f"({','.join(repr(t) for t in f.example_trace_ids)})"
        ).fetchone()
        assert n == len(f.example_trace_ids)  # real traces of the store
    assert report.rule_errors == {}
    con.close()


def test_client_gap_names_the_servers_own_holdback_when_the_store_shows_it(tmp_path, stores):
    """Issue 19 item 4: clients wait for text the server itself withheld (stop-string holdback,
    requests.text_holdback_ms); the finding must name that, not a proxy. Without a holdback
    the same gap still names the proxy first."""
    path = tmp_path / "holdback.duckdb"
    write_store(path, [HEALTHY.but(client_ttft_factor=1.0, text_holdback_ms=600)], seed=3)
    con = duckdb.connect(str(path), read_only=True)
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "client_server_ttft_gap"]
    con.close()
    assert f.evidence["server_holdback_share_of_gap"] > 0.95
    assert "withheld the stream's start for" in f.summary and "proxy" not in f.summary
    assert f.causes[0].startswith("the server withheld") and "stop string" in f.knob
    assert f.example_trace_ids
    con = stores("client_server_ttft_gap")  # a 4x gap after the server released the text
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "client_server_ttft_gap"]
    con.close()
    assert f.evidence["server_holdback_share_of_gap"] == 0
    assert f.causes[0].startswith("a proxy") and "proxy" in f.summary


def test_batch_rule_reads_the_steps_batch_and_never_a_constant_zero(tmp_path):
    """Issue 19 item 10a: with one-token requests ``num_running`` (counted after the step) is 0
    in every step, and batch_too_large fired "from a batch of 0.0 to 0.0" when throughput
    merely followed the traffic. The rule reads the batch the step ran (prefill chunks +
    decodes) and stays quiet on a signal that never varies."""
    path = tmp_path / "one_token.duckdb"
    write_store(path, [HEALTHY.but(running=8), HEALTHY.but(duration_s=40, running=4)], seed=5)
    con = duckdb.connect(str(path))
    con.execute("UPDATE engine_steps SET num_running = 0")  # as one-token requests record it
    assert con.execute("SELECT max(num_running) FROM engine_steps").fetchone() == (0,)
    report = diagnose(con)
    assert "batch_too_large" not in {f.rule_id for f in report.findings}
    # the batch itself constant (0 sequences counted in every step): quiet too
    con.execute("UPDATE engine_steps SET num_decode_tokens = 0, num_prefill_chunks = 0")
    con.execute("UPDATE engine_steps SET num_prefill_tokens = 1 WHERE num_prefill_tokens = 0")
    assert "batch_too_large" not in {f.rule_id for f in diagnose(con).findings}
    con.close()


def test_step_durations_all_zero_are_no_periodic_spikes(tmp_path):
    """The same kind as item 10a: with every step duration 0 (nothing measured), each step was
    "≥ 5x the median step" and periodic_itl_spikes fired "819 decode steps ... every 0.04 s"."""
    path = tmp_path / "zero_steps.duckdb"
    write_store(path, [HEALTHY], seed=2)
    con = duckdb.connect(str(path))
    con.execute("UPDATE engine_steps SET end_ns = start_ns, schedule_ms = 0, sample_ms = 0")
    fired = {f.rule_id for f in diagnose(con).findings}
    con.close()
    assert not fired & {"periodic_itl_spikes", "batch_too_large", "host_bound_steps"}, fired


def test_a_queue_filled_once_and_held_is_no_overload(tmp_path):
    """Issue 18: a closed-loop jump in clients fills the engine queue once, then each completion
    brings the next arrival and the queue holds level. Arrivals outran completions over the
    three windows at the jump, so overload fired first and hid ttft_queueing; overload now
    needs the queue to grow from each window to the next. The growing queue still fires."""
    held = HEALTHY.but(duration_s=40, rate_per_s=6, queue_growth_ms_per_s=500, waiting=6)
    path = tmp_path / "held.duckdb"
    write_store(path, [HEALTHY, held], seed=4)
    con = duckdb.connect(str(path), read_only=True)
    fired = {f.rule_id for f in diagnose(con).findings}
    con.close()
    assert "overload" not in fired and "ttft_queueing" in fired, fired
    path = tmp_path / "growing.duckdb"
    write_store(path, [HEALTHY, held.but(waiting=0, waiting_growth_per_s=1)], seed=4)
    con = duckdb.connect(str(path), read_only=True)
    assert "overload" in {f.rule_id for f in diagnose(con).findings}
    con.close()


def test_one_oversized_prompt_is_no_prefill_bound_trend(tmp_path):
    """CI of 2026-12-01: in oom_low_average_memory one 2,300-token prompt made its window's TTFT
    p99 (with a dozen requests, the slowest one) 13x the baseline, 81% prefill, and
    ttft_prefill_bound ranked first over the allocation failures the scenario is about. The
    rule now needs two such requests in the range; three long prompts still fire it."""

    def fired(duration_s: float) -> tuple[set[str], int]:
        path = tmp_path / f"long{duration_s}.duckdb"
        burst = HEALTHY.but(
            duration_s=duration_s, rate_per_s=1, long_prompt_every=1, long_prompt_tokens=2300
        )
        write_store(path, [HEALTHY, burst, HEALTHY], seed=5)
        con = duckdb.connect(str(path), read_only=True)
        out = {f.rule_id for f in diagnose(con).findings}
        slow = con.execute("SELECT count(*) FROM requests WHERE input_tokens = 2300").fetchone()[0]
        con.close()
        return out, slow

    one, n = fired(1)
    assert n == 1 and "ttft_prefill_bound" not in one, (n, one)
    some, n = fired(3)
    assert n >= 2 and "ttft_prefill_bound" in some, (n, some)


def test_slow_steps_back_to_back_are_no_periodic_spike(tmp_path):
    """Issue 18: a neighbour that slows every step 20x for 20 s makes a run of slow steps whose
    gaps are the steps themselves, as regular as a period. In the first CI run of the
    host_contention scenario periodic_itl_spikes came first on exactly that; a spike must now
    be a brief stall (at most half its period). Brief stalls every 5 s still fire."""
    path = tmp_path / "sustained.duckdb"
    write_store(path, [HEALTHY, HEALTHY.but(duration_s=20, step_ms=800), HEALTHY], seed=6)
    con = duckdb.connect(str(path), read_only=True)
    fired = {f.rule_id for f in diagnose(con).findings}
    con.close()
    assert "periodic_itl_spikes" not in fired, fired
    path = tmp_path / "brief.duckdb"
    write_store(
        path, [HEALTHY.but(duration_s=60, periodic_spike_s=5, periodic_spike_ms=800)], seed=6
    )
    con = duckdb.connect(str(path), read_only=True)
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "periodic_itl_spikes"]
    con.close()
    assert 4.5 < f.evidence["period_s"] < 5.5 and f.evidence["spike_ms_p50"] >= 800


def test_a_host_burst_on_a_prefill_step_is_no_prefill_interference(tmp_path):
    """Stop 24's CI: a job spinning the cores 1.5 s every 6 s met a step carrying a 46-token
    prefill; that step was 4x the baseline decode step and ITL peaked 8x the p50, so
    itl_prefill_interference outranked periodic_itl_spikes. The burst slows the decode steps
    around the prefill step as much, so the prefill did not make the spike: quiet now, and
    the periodic stall is named. A real long prefill (1,500 tokens next to 40 ms decodes, one
    prompt in three: the streams lose 17% of their decode time to them, over min_stall_share)
    still fires with the same bursts running."""
    # the burst outlasts the slowed prefill step, as in CI (a 1.5 s burst, a ~0.3 s step)
    bursts = dict(host_burst_every_s=8, host_burst_s=2.5, host_burst_slowdown=9)
    path = tmp_path / "burst.duckdb"
    # prompts long enough to count (min_prefill_tokens): only the neighbour test keeps it quiet
    write_store(path, [HEALTHY.but(duration_s=60, prompt_tokens=(256, 300), **bursts)], seed=4)
    con = duckdb.connect(str(path), read_only=True)
    sig = load_signals(con)
    # the symptom the old rule read: a step with prefill ≥ 4x, ITL ≥ 8x the baseline
    assert any(
        (w.get("mixed_step_ms_max") or 0) >= 4 * sig.baseline["decode_step_ms_p50"]
        and (w.get("itl_max") or 0) >= 8 * sig.baseline["itl_p50"]
        for w in sig.windows
    )
    report = diagnose(con)
    con.close()
    fired = [f.rule_id for f in report.findings]
    assert "itl_prefill_interference" not in fired and fired[0] == "periodic_itl_spikes", fired
    path = tmp_path / "burst_and_long_prompt.duckdb"
    write_store(
        path,
        [HEALTHY.but(duration_s=60, long_prompt_every=3, prefill_spike_ms=1500, **bursts)],
        seed=4,
    )
    con = duckdb.connect(str(path), read_only=True)
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "itl_prefill_interference"]
    con.close()
    assert f.evidence["mixed_step_ms_max"] >= 8 * f.evidence["neighbour_decode_step_ms"]


def test_prefix_shorter_than_one_block_is_named_with_the_block_size(tmp_path):
    """Issue 19 item 10b: 50 completions sharing a 12-token prefix get 0 cached tokens; the
    report must say the shared prefix is below one 16-token block. A shared 12-token prefix
    with a healthy hit rate, or prompts sharing nothing, stay quiet."""
    short = Phase(
        duration_s=25,
        rate_per_s=2,
        prompt_tokens=(18, 40),
        prefix_cached_share=0.0,
        shared_head_tokens=12,
    )
    path = tmp_path / "short_prefix.duckdb"
    write_store(path, [short], seed=11)
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT count(*), sum(cached_tokens) FROM requests").fetchone()[1] == 0
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "prefix_cache_miss"]
    n = con.execute("SELECT count(*) FROM requests").fetchone()[0]
    con.close()
    assert f.evidence["block_size"] == 16 and f.evidence["shared_prefix_tokens_at_least"] == 12
    assert f.evidence["prompts_sharing_short_prefix"] == n >= 40
    assert "first 12+ tokens" in f.summary and "one full 16-token block" in f.summary
    assert f.causes[0].startswith("the shared prefix is shorter than one KV block")
    assert "--block-size 8" in f.knob and f.example_trace_ids
    for quiet in (short.but(prefix_cached_share=0.5), short.but(shared_head_tokens=1)):
        path = tmp_path / "quiet.duckdb"
        path.unlink(missing_ok=True)
        write_store(path, [quiet], seed=11)
        con = duckdb.connect(str(path), read_only=True)
        assert "prefix_cache_miss" not in {f.rule_id for f in diagnose(con).findings}
        con.close()


# the same symptom, below the rule's threshold: the rule must stay quiet
MILD: dict[str, list[Phase]] = {
    "ttft_queueing": [HEALTHY, HEALTHY.but(duration_s=30, queue_ms=100)],
    "ttft_prefill_bound": [HEALTHY, HEALTHY.but(duration_s=30, prefill_tok_per_s=1000)],
    "head_of_line_blocking": [HEALTHY, HEALTHY.but(duration_s=30, long_prompt_every=5)],
    "itl_prefill_interference": [
        HEALTHY,
        HEALTHY.but(duration_s=30, long_prompt_every=4, prefill_spike_ms=60),
    ],
    "itl_frontend_overhead": [HEALTHY, HEALTHY.but(duration_s=30, stream_slowdown=1.2)],
    "kv_pressure_preemption": [HEALTHY, HEALTHY.but(duration_s=30, kv_usage=0.97)],
    "overload": [HEALTHY, HEALTHY.but(duration_s=40, rate_per_s=3)],
    "oom_low_average_memory": [
        HEALTHY,
        HEALTHY.but(duration_s=30, kv_usage=0.95, alloc_failures_per_step=0.05),
    ],
    "kv_block_leak": [HEALTHY, HEALTHY.but(duration_s=20, rate_per_s=0)],
    "error_spike": [HEALTHY, HEALTHY.but(duration_s=30, error_share=0.01)],
    "prefix_cache_miss": [HEALTHY.but(prompt_tokens=(100, 200), prefix_cached_share=0.9)],
    "client_server_ttft_gap": [HEALTHY.but(client_ttft_factor=1.3)],
    "batching_ineffective": [
        HEALTHY.but(max_num_seqs=8),
        HEALTHY.but(duration_s=30, max_num_seqs=8, waiting=5, queue_ms=1500, kv_usage=0.9),
    ],
    "batch_too_large": [
        HEALTHY.but(running=8),
        HEALTHY.but(duration_s=40, running=32, step_ms=100),
    ],
    "midstream_stall": [HEALTHY, HEALTHY.but(duration_s=30, preempt_share=0.2, preempt_gap_ms=100)],
    "periodic_itl_spikes": [HEALTHY.but(duration_s=60, periodic_spike_s=5, periodic_spike_ms=100)],
    "gpu_throttling": [
        HEALTHY.but(gpu=True),
        HEALTHY.but(duration_s=30, gpu=True, sm_clock_mhz=1900, throttle_reasons=("sw_power_cap",)),
    ],
    "host_bound_steps": [HEALTHY, HEALTHY.but(duration_s=30, host_share=0.2, step_ms=100)],
    # int4, short prompts, long answers: decode-only steps (below the ridge) hold most of the time
    "quantization_no_gain": [INT4.but(output_tokens=(200, 400))],
    # the neighbour is there, but the same work is not slower; and slower without a neighbour
    "host_contention": [HEALTHY, HEALTHY.but(duration_s=30, cpu_others_pct=60)],
    # ~70% of the drafts accepted: 1.2x slower draft steps give 2.1 tokens each, so it pays
    "spec_decode_ineffective": [
        SPEC,
        SPEC.but(duration_s=30, spec_k=3, spec_accept_rate=0.7, spec_step_slowdown=1.2),
    ],
    # 60 / 40 between the replicas, both busy: uneven, not one idling
    "replica_imbalance": [DP2, DP2.but(duration_s=30, hot_share=0.6, hot_queue_ms=200)],
    "tp_communication_bound": [TP2, TP2.but(duration_s=30, collective_share=0.2)],
    # the ranks within 5% of each other (noise), and a 1.2x slower rank
    "rank_straggler": [TP2, TP2.but(duration_s=30, straggler_rank=1, straggler_slowdown=1.2)],
    # 15 ms transfers against ~80 ms of TTFT: under a fifth
    "kv_transfer_bound": [PD, PD.but(duration_s=30, kv_transfer_ms=15)],
    # both sides busy (85% and 70%): a loaded line, not a lopsided one; and a prefill side at
    # 97% whose requests do not wait for each other (TTFT ~ their own ~250 ms prefill)
    "pd_ratio_imbalance": [
        PD,
        PD.but(duration_s=30, pd_busy=(0.85, 0.7), queue_ms=3000, waiting=4),
        PD.but(duration_s=30, pd_busy=(0.97, 0.1), prompt_tokens=(400, 600)),
    ],
}


@pytest.mark.parametrize("rule_id", sorted(MILD))
def test_rule_stays_quiet_below_its_threshold(tmp_path, rule_id):
    path = tmp_path / "mild.duckdb"
    write_store(path, MILD[rule_id], seed=7)
    con = duckdb.connect(str(path), read_only=True)
    report = diagnose(con)
    con.close()
    assert rule_id not in {f.rule_id for f in report.findings}


def _report(tmp_path, name: str, phases: list[Phase], seed: int = 4):
    path = tmp_path / f"{name}.duckdb"
    write_store(path, phases, seed=seed)
    con = duckdb.connect(str(path), read_only=True)
    try:
        return diagnose(con)
    finally:
        con.close()


def test_quantization_no_gain_names_the_quantization_and_the_ridge(stores):
    """Issue 14 item 4: int4 weights, long prompts: the evidence carries the scheme, the
    dtype, the compute-bound prefill share, its median intensity against the ridge (peak
    GFLOP/s / peak GB/s from the config event) and the decode share; long prompts first, and
    the dequantizing kernels second when those steps run far under the peak GFLOP/s."""
    con = stores("quantization_no_gain")
    report = diagnose(con)
    con.close()
    (f,) = [f for f in report.findings if f.rule_id == "quantization_no_gain"]
    ev = f.evidence
    assert ev["quantization"] == "int4" and ev["dtype"] == "float32"
    assert ev["ridge_flop_per_byte"] == 10.0 and ev["peak_source"] == "probe"
    assert ev["prefill_intensity_p50"] > 100 * ev["ridge_flop_per_byte"]
    assert ev["decode_forward_share"] < 0.2 and ev["compute_bound_decode_share"] == 0
    assert ev["weight_bytes_by_dtype"] == {"int4": 100_000_000}
    assert ev["smallest_compute_bound_chunk"] >= 1000
    assert "weights are int4" in f.summary and "ridge of 10.0 FLOP/byte" in f.summary
    assert f.causes[0].startswith("prefill-heavy traffic")
    # ~170 GFLOP/s in those steps, under half the 400 GFLOP/s peak: unpacking ranks second
    assert ev["prefill_gflops_share_of_peak"] < 0.5
    assert f.causes[1].startswith("the device's kernels dequantize")
    assert "prefix caching" in f.knob and "do not cut FLOPs" in f.knob
    assert report.notes == []  # no hint on a quantized model


def test_quantization_no_gain_quiet_on_float_weights_and_without_peaks(tmp_path):
    """The same long-prompt traffic on float32 weights is not this rule (nothing was
    quantized); nor is a store whose config event has no device peaks (an older server)."""
    long = dict(prompt_tokens=(1000, 2000), prefill_tok_per_s=500)
    for phase in (HEALTHY.but(**long), INT4.but(peak_gbps=0, **long)):
        report = _report(tmp_path, f"quiet{phase.peak_gbps:g}", [phase])
        assert "quantization_no_gain" not in {f.rule_id for f in report.findings}


def test_quantization_no_gain_quiet_when_the_large_steps_compute_in_int8(tmp_path):
    """The same int4 long-prompt traffic from a server whose quantized layers run their large
    steps as int8 GEMMs (the config event's int8_compute path): the rule's premise, FLOPs at
    the float rate, does not hold, so it says nothing."""
    long = dict(prompt_tokens=(1000, 2000), prefill_tok_per_s=500)
    report = _report(tmp_path, "i8c", [INT4.but(int8_compute="avx512_vnni", **long)])
    assert "quantization_no_gain" not in {f.rule_id for f in report.findings}
    report = _report(tmp_path, "i8c-off", [INT4.but(**long)])
    assert "quantization_no_gain" in {f.rule_id for f in report.findings}


def test_quantization_no_gain_on_a_batch_that_makes_decode_compute_bound(tmp_path):
    """Cause 2: int4 decodes at a batch of 32 read 100 MB of weights (and ~220 MB of KV) for 32
    tokens, ~28 FLOP a byte, past twice the ridge; the finding leads with the batch. At a batch
    of 2 (~5 FLOP a byte) the same traffic stays quiet (MILD above)."""
    report = _report(tmp_path, "batch", [INT4.but(running=32)])
    (f,) = [f for f in report.findings if f.rule_id == "quantization_no_gain"]
    assert f.evidence["compute_bound_decode_share"] > 0.5
    assert f.evidence["decode_intensity_p50"] > 2 * f.evidence["ridge_flop_per_byte"]
    assert f.causes[0].startswith("a batch so large that decode itself is compute-bound")
    assert "decode-only steps" in f.summary and "batch of 32" in f.summary


def test_weights_dominate_decode_hint_on_a_float_model(tmp_path):
    """The companion hint: float32 weights, decode-only steps reading ~90% weights at ~78% of
    the peak bandwidth, below the ridge: a note (not a finding) in every output format, saying
    that --quantization int8/int4 would help; absent at 35% of the peak (the healthy default),
    and never on an already quantized model."""
    from rich.console import Console

    from tokenmill.diagnose.report import print_text, to_json, to_markdown

    report = _report(tmp_path, "hint", [HEALTHY.but(peak_gbps=20.0)])
    assert report.findings == [] and len(report.notes) == 1
    (n,) = report.notes
    assert n.rule_id == "quantization_no_gain" and n.runbook == "runbooks/quantization_no_gain.md"
    assert n.summary.startswith("weights dominate decode")
    assert "--quantization int8/int4" in n.summary and "--quantization int8" in n.knob
    assert 0.6 < n.evidence["decode_bandwidth_share"] < 0.9
    assert n.evidence["decode_weight_byte_share"] > 0.85
    assert n.evidence["decode_intensity_p50"] < n.evidence["ridge_flop_per_byte"] == 20.0
    js = __import__("json").loads(to_json(report))
    assert js["status"] == "healthy" and js["findings"] == []
    assert js["notes"][0]["rule"] == "quantization_no_gain"
    assert js["notes"][0]["summary"].startswith("weights dominate decode")
    md = to_markdown(report)
    assert "**No problems found.**" in md and "## Hints" in md
    assert "weights dominate decode" in md and "--quantization int8/int4" in md
    console = Console(record=True, width=200)
    print_text(report, console)
    text = console.export_text()
    assert "hint: quantization_no_gain" in text and "weights dominate decode" in text
    # the healthy default (35% of the peak) and a quantized model at 70%: no hint
    assert _report(tmp_path, "nohint", [HEALTHY]).notes == []
    assert _report(tmp_path, "q", [HEALTHY.but(peak_gbps=20.0, quantization="int8")]).notes == []


def test_a_store_without_roofline_columns_still_diagnoses(tmp_path):
    """A store written before the roofline step fields (same schema version, no columns):
    the diagnosis runs, this rule and its hint stay silent."""
    path = tmp_path / "old.duckdb"
    write_store(path, [INT4.but(prompt_tokens=(1000, 2000), prefill_tok_per_s=500)], seed=1)
    con = duckdb.connect(str(path))
    for col in ("weight_bytes", "kv_read_bytes", "kv_write_bytes", "flops"):
        con.execute(f"ALTER TABLE engine_steps DROP COLUMN {col}")
    report = diagnose(con)
    con.close()
    assert "quantization_no_gain" not in {f.rule_id for f in report.findings}
    assert report.notes == [] and report.rule_errors == {}


def test_spec_decode_ineffective_evidence_names_the_acceptance_and_the_step_times(stores):
    """Issue 15 item 5 (a): low acceptance, draft steps slower than they gain; the evidence
    carries the acceptance (overall and by position), both step times, the batch and the flag."""
    con = stores("spec_decode_ineffective")
    report = diagnose(con)
    con.close()
    (f,) = [f for f in report.findings if f.rule_id == "spec_decode_ineffective"]
    e = f.evidence
    assert e["spec_acceptance_rate"] < 0.1 and e["spec_accepted_per_draft"] < 0.3
    assert e["spec_step_ms"] / e["plain_decode_step_ms"] == pytest.approx(1.5, rel=0.1)
    assert e["spec_step_cost"] == pytest.approx(1.5, rel=0.1) and e["spec_batch_mean"] == 4
    assert len(e["acceptance_by_position"]) == 3 and e["compute_bound"] is False
    assert e["ridge_flop_per_byte"] == 10 and e["spec_intensity_p50"] < 10
    assert '"num_speculative_tokens": 3' in e["speculative_config"]
    assert "were accepted" in f.summary and "without" in f.summary
    assert "num_speculative_tokens" in f.knob and "prompt_lookup_min" in f.knob


def test_spec_decode_ineffective_on_compute_bound_verification(tmp_path):
    """(b): every decode step verifies drafts (nothing to time them against), and at 32 running
    requests x 5 tokens the draft steps sit above the ridge: named compute-bound, the batch cause
    first. The same drafts at 2 running requests stay below the ridge and quiet."""
    big = HEALTHY.but(running=32, spec_k=4, spec_accept_rate=0.5, spec_draft_share=1.0)
    report = _report(tmp_path, "spec_bound", [big])
    (f,) = [f for f in report.findings if f.rule_id == "spec_decode_ineffective"]
    assert f.evidence["compute_bound"] is True and f.evidence["spec_step_cost"] is None
    assert f.evidence["spec_intensity_p50"] >= f.evidence["ridge_flop_per_byte"] == 10
    assert "compute-bound" in f.summary and f.causes[0].startswith("the batch makes")
    small = _report(tmp_path, "spec_small", [big.but(running=2)], seed=5)
    assert "spec_decode_ineffective" not in {f.rule_id for f in small.findings}


def test_key_numbers_show_draft_acceptance_only_with_speculation(stores):
    from tokenmill.diagnose.report import to_markdown

    con = stores("spec_decode_ineffective")
    report = diagnose(con)
    con.close()
    rate = report.summary["spec_acceptance_rate"]
    assert rate is not None and 0 < rate < 0.2, rate
    assert f"- draft tokens accepted (speculative decoding): {rate:.0%}" in to_markdown(report)
    con = stores("healthy")
    report = diagnose(con)
    con.close()
    assert report.summary["spec_acceptance_rate"] is None
    assert "speculative decoding" not in to_markdown(report)


def test_a_burst_that_lets_some_steps_through_is_one_spike(tmp_path):
    """Stop 25's CI: periodic_itl_spikes found nothing in its own scenario (a job spinning the
    cores 1.5 s every 6 s). A shared CPU does not slow every step it overlaps: the scheduler
    lets one through at full speed now and then, and each such step split a burst into two
    "spikes" a fraction of the period apart, which broke the period's regularity. Slow steps
    up to two usual-speed steps apart now make one spike; the rule names the 6 s period."""
    bursts = dict(host_burst_every_s=6, host_burst_s=1.5, host_burst_slowdown=9)
    path = tmp_path / "leaky_bursts.duckdb"
    write_store(path, [HEALTHY.but(duration_s=60, **bursts)], seed=7)
    con = duckdb.connect(str(path))
    med = con.execute(
        "SELECT quantile_cont((end_ns - start_ns) / 1e6, 0.5) FROM engine_steps "
        "WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0"
    ).fetchone()[0]
    # every third slowed decode step runs at the usual speed
    con.execute(
        """
        UPDATE engine_steps SET end_ns = start_ns + CAST(? * 1e6 AS BIGINT)
        WHERE start_ns IN (
            SELECT start_ns FROM (
                SELECT start_ns, row_number() OVER (ORDER BY start_ns) AS k FROM engine_steps
                WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0
                  AND (end_ns - start_ns) / 1e6 >= 4 * ?)
            WHERE k % 3 = 0)
        """,
        [med, med],
    )
    leaked = con.execute(
        "SELECT count(*) FROM engine_steps WHERE (end_ns - start_ns) / 1e6 = ?", [med]
    ).fetchone()[0]
    assert leaked >= 5, leaked
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "periodic_itl_spikes"]
    con.close()
    assert 5.5 < f.evidence["period_s"] < 6.5 and f.evidence["spikes"] >= 7, f.evidence


def test_short_requests_beside_prefill_chunks_still_show_head_of_line_blocking(tmp_path):
    """Stop 25's CI: in the head_of_line_blocking scenario the short prompts, once let in, shared
    a few steps with a long prompt's prefill chunks, so the ITL p99 of the requests that arrived
    in that window jumped while decode as a whole kept its pace; the rule read ITL p99 as "decode
    slowed too", stayed quiet, and ttft_prefill_bound came first. It asks instead whether the
    short prompts' TTFT was mostly queue time."""
    hol = HEALTHY.but(
        duration_s=30,
        long_prompt_every=5,
        short_queue_ms=3000,
        kv_usage=0.5,
        prefill_spike_ms=1500,
    )
    path = tmp_path / "hol_with_chunks.duckdb"
    write_store(path, [HEALTHY, hol], seed=3)
    con = duckdb.connect(str(path), read_only=True)
    sig = load_signals(con)
    worst = max(sig.busy(), key=lambda w: w.get("short_ttft_p99") or 0)
    # the symptom that kept the old rule quiet: ITL p99 of that window over 2x its baseline
    assert worst.get("itl_p99") > 2 * sig.baseline["itl_p99"], worst.values
    report = diagnose(con)
    con.close()
    (f,) = [f for f in report.findings if f.rule_id == "head_of_line_blocking"]
    assert f.evidence["short_queue_share_of_ttft"] >= 0.5, f.evidence
    assert report.findings[0].rule_id == "head_of_line_blocking", report.findings


# decode-only steps, in SQL
DECODE_ONLY = "num_prefill_tokens = 0 AND num_decode_tokens > 0"


def _bursty_store(path):
    """A 60 s healthy store with a host job slowing steps 9x for 1.5 s every 6 s: its open
    connection, the decode-only filter and the median decode-only step (ms)."""
    bursts = dict(host_burst_every_s=6, host_burst_s=1.5, host_burst_slowdown=9)
    write_store(path, [HEALTHY.but(duration_s=60, **bursts)], seed=7)
    con = duckdb.connect(str(path))
    med = con.execute(
        "SELECT quantile_cont((end_ns - start_ns) / 1e6, 0.5) FROM engine_steps "
        f"WHERE {DECODE_ONLY}"
    ).fetchone()[0]
    return con, DECODE_ONLY, med


def test_extra_spikes_off_the_period_do_not_hide_it(tmp_path):
    """Stop 27's CI: in the periodic_itl_spikes scenario a one-thread step after a burst made
    an extra "spike" 2 s after a real one; counting gaps of one period, that split period cost
    two of nine gaps and the rule stayed quiet. Spikes are counted on the period's grid now:
    two extra spikes (in different periods) cost two of twelve spikes, and the 6 s period is
    still named."""
    con, decode, med = _bursty_store(tmp_path / "bursts_and_strays.duckdb")
    t0 = con.execute(f"SELECT min(start_ns) FROM engine_steps WHERE {decode}").fetchone()[0]
    before = diagnose(con).findings
    (f,) = [f for f in before if f.rule_id == "periodic_itl_spikes"]
    spikes = f.evidence["spikes"]
    for at_s in (14.2, 38.1):  # 2 s into the quiet part of two different periods
        con.execute(
            f"""UPDATE engine_steps SET end_ns = start_ns + CAST(? * 1e6 AS BIGINT)
                WHERE start_ns = (SELECT min(start_ns) FROM engine_steps
                                  WHERE {decode} AND start_ns >= ?)""",
            [8 * med, t0 + int(at_s * 1e9)],
        )
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "periodic_itl_spikes"]
    con.close()
    assert f.evidence["spikes"] == spikes + 2, (spikes, f.evidence)
    assert 5.5 < f.evidence["period_s"] < 6.5 and f.evidence["period_cv"] < 0.1, f.evidence


@pytest.mark.parametrize(
    ("error_type", "explained"),
    [("queue_full", True), ("upstream_timeout", True), ("nan_logits", False)],
)
def test_overload_explains_an_error_spike_of_its_own_refusals(tmp_path, error_type, explained):
    """CI of 2026-12-02: in the demo's overload phase error_spike (429s from the full queue)
    ranked first by one point of confidence over overload, the cause of those 429s. An error
    spike made mostly of queue-full refusals (or clients that gave up, the proxy among them:
    an overloaded llama.cpp server's requests timing out at the proxy) is now explained by
    overload and ranked after it; one of NaN logits is not."""
    over = HEALTHY.but(
        duration_s=40, rate_per_s=6, queue_growth_ms_per_s=500, waiting_growth_per_s=1,
        error_share=0.4, error_type=error_type,
    )  # fmt: skip
    path = tmp_path / "overload_errors.duckdb"
    write_store(path, [HEALTHY, over], seed=5)
    con = duckdb.connect(str(path), read_only=True)
    findings = {f.rule_id: f for f in diagnose(con).findings}
    con.close()
    assert {"overload", "error_spike"} <= set(findings), sorted(findings)
    spike = findings["error_spike"]
    assert set(spike.evidence["errors_by_type"]) == {error_type}
    # the queue those refusals came from explains them too, where it fired (ttft_queueing)
    assert ("overload" in spike.explained_by) is explained, spike.explained_by
    assert set(spike.explained_by) <= {"overload", "ttft_queueing"}, spike.explained_by
    if not explained:
        assert spike.explained_by == [], spike.explained_by
    else:
        order = list(findings)
        assert order.index("overload") < order.index("error_spike"), order


def test_pd_ratio_imbalance_names_the_side_the_line_is_short_of(tmp_path):
    """Issue 17 item 5: the prefill side queueing while decode idles reads as short of
    prefill; prefilled requests waiting for a full decode pool while prefill idles, as short
    of decode, with the wait in decode steps and the decode side's KV in the evidence."""
    prefill = _report(
        tmp_path, "short_of_prefill", SCENARIOS["pd_ratio_imbalance"], seed=3
    ).findings
    assert prefill[0].rule_id == "pd_ratio_imbalance", [f.rule_id for f in prefill]
    ev = prefill[0].evidence
    assert ev["bottleneck"] == "prefill" and ev["decode_busy_share"] < 0.2
    assert ev["prefill_wait_share_of_ttft"] > 0.9 and ev["queue_share_of_ttft"] > 0.9
    decode = _report(
        tmp_path,
        "short_of_decode",
        [PD, PD.but(duration_s=30, pd_busy=(0.1, 0.95), kv_usage=0.97, kv_wait_ms=600)],
        seed=3,
    ).findings
    (f,) = [f for f in decode if f.rule_id == "pd_ratio_imbalance"]
    ev = f.evidence
    assert ev["bottleneck"] == "decode" and ev["prefill_busy_share"] < 0.2
    assert ev["kv_wait_p50_ms"] / ev["itl_p50_ms"] > 10 and ev["decode_kv_use_max"] >= 0.9
    assert "short of decode" in f.summary and "decode workers" in f.knob


def test_a_stall_that_began_before_the_burst_is_still_on_its_grid(tmp_path):
    """A spike is timed by its first slow step. When slow steps run on into the job's burst
    from well before it (a prefill slowed by it, the tail of another stall), the spike starts
    off the grid though the burst inside it is on it; three such spikes of ten dropped the share
    on the grid below 80% and the rule stayed quiet. A spike is now on the grid when its grid
    point lies inside it."""
    from tokenmill.diagnose.rules.periodic_itl_spikes import decode_stalls

    con, decode, med = _bursty_store(tmp_path / "early_stalls.duckdb")
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "periodic_itl_spikes"]
    spikes = f.evidence["spikes"]
    starts = [s[0] for s in decode_stalls(load_signals(con))]
    assert len(starts) == spikes >= 9, (starts, spikes)
    # three spikes, each led by 2.2 s of slow steps: a third of the period, past the 0.2 allowed
    for s in starts[1:8:3]:
        con.execute(
            f"""UPDATE engine_steps SET end_ns = start_ns + CAST(? * 1e6 AS BIGINT)
                WHERE {decode} AND start_ns >= ? AND start_ns < ?""",
            [3 * med, s - int(2.2e9), s],
        )
    moved = [s[0] for s in decode_stalls(load_signals(con))]
    assert (
        len(moved) == spikes and sum(a < b - 2.0e9 for a, b in zip(moved, starts, strict=True)) == 3
    )
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "periodic_itl_spikes"]
    con.close()
    assert f.evidence["spikes"] == spikes, f.evidence
    assert 5.5 < f.evidence["period_s"] < 6.5 and f.evidence["period_cv"] < 0.1, f.evidence


def test_a_client_gap_in_one_window_is_inconclusive(tmp_path):
    """A load generator's first requests pay its own start (new connections, a server still
    warming): in the healthy tune runs' first window each client's first request saw 2-5x the
    server's TTFT. A gap that held in one window is listed as inconclusive, not a finding; the
    same gap held over four windows is a finding."""
    for seconds, windows in ((8, 1), (40, 4)):
        path = tmp_path / f"gap_{seconds}s.duckdb"
        write_store(path, [HEALTHY.but(duration_s=seconds, client_ttft_factor=4.0)], seed=3)
        con = duckdb.connect(str(path), read_only=True)
        report = diagnose(con)
        con.close()
        found = [f for f in report.findings if f.rule_id == "client_server_ttft_gap"]
        held = [f for f in report.inconclusive if f.rule_id == "client_server_ttft_gap"]
        if windows == 1:
            assert not found and len(held) == 1, (report.findings, report.inconclusive)
            assert "1 of 1 windows" in held[0].support["reason"], held[0].support
        else:
            assert len(found) == 1 and not held, (report.findings, report.inconclusive)
            assert found[0].support["persistence"] == "4 of 4 windows with client timings"


@pytest.mark.parametrize(
    ("error_type", "fires"), [("nan_logits", True), ("client_disconnected", False)]
)
def test_the_engine_s_own_failures_need_no_spike(tmp_path, error_type, fires):
    """Blind set, nan_logits_fraction: 8% of requests failing with NaN logits from the first
    request had no window above the others, and nothing fired. The engine's own failures at 5%
    of the range are a finding whatever the baseline; clients that leave at the same share are
    not (a client may disconnect; an engine should not fail a request)."""
    steady = HEALTHY.but(duration_s=60, error_share=0.08, error_type=error_type)
    path = tmp_path / "steady_errors.duckdb"
    write_store(path, [steady], seed=6)
    con = duckdb.connect(str(path), read_only=True)
    findings = {f.rule_id: f for f in diagnose(con).findings}
    con.close()
    assert ("error_spike" in findings) is fires, sorted(findings)
    if fires:
        assert set(findings["error_spike"].evidence["errors_by_type"]) == {"nan_logits"}


def test_a_stall_while_the_host_is_busy_elsewhere_is_not_engine_stalled(tmp_path):
    """The same stopped engine with processes outside the server on the CPU meanwhile: a busy
    host is host_contention's finding, not a stopped or hung engine."""
    path = tmp_path / "busy.duckdb"
    write_store(path, [HEALTHY, HEALTHY.but(duration_s=30, frozen=True, cpu_others_pct=60)], seed=3)
    con = duckdb.connect(str(path), read_only=True)
    fired = {f.rule_id for f in diagnose(con).findings}
    con.close()
    assert "engine_stalled" not in fired, sorted(fired)


def _live_runs(con, starts_ns: list[int], run_s: float) -> None:
    con.execute("DELETE FROM events WHERE kind = ?", [LIVE_RUN_EVENT])
    for t in starts_ns:
        end = t + int(run_s * 1e9)
        con.execute(
            "INSERT INTO events (time_ns, kind, severity, attributes) VALUES (?, ?, 'info', ?)",
            [t, LIVE_RUN_EVENT, json.dumps({"end_ns": end})],
        )


def test_stalls_during_the_live_loops_own_runs_are_not_a_periodic_job(tmp_path):
    """Soak run 2: a healthy engine opened periodic_itl_spikes at the live loop's own period
    (its CPU slices stretched decode steps). Stalls that meet one of the loop's recorded runs
    (or begin within own_run_margin_s after one) are left out; the same runs half a period
    away leave the job's stalls, and the finding, as they were."""
    path = tmp_path / "own_runs.duckdb"
    write_store(path, [HEALTHY.but(duration_s=60, periodic_spike_s=5, periodic_spike_ms=500)])
    con = duckdb.connect(str(path))
    stalls = decode_stalls(load_signals(con))
    assert len(stalls) >= 8, stalls
    # runs of 0.3 s that ended half a second before each stall began
    _live_runs(con, [s - int(0.8e9) for s, *_ in stalls], 0.3)
    fired = [f.rule_id for f in diagnose(con).findings]
    assert "periodic_itl_spikes" not in fired, fired
    _live_runs(con, [s - int(2.5e9) for s, *_ in stalls], 0.3)
    (f,) = [f for f in diagnose(con).findings if f.rule_id == "periodic_itl_spikes"]
    con.close()
    assert f.evidence["stalls_during_own_runs"] == 0 and 4.5 < f.evidence["period_s"] < 5.5


@pytest.mark.parametrize(
    ("error_type", "fires"), [("rate_limit_exceeded", True), ("client_disconnected", False)]
)
def test_a_tenant_refused_by_its_own_limit_is_an_error_spike_whatever_the_others_make(
    tmp_path, error_type, fires
):
    """Live soak run 5: a tenant over its requests_per_minute was refused (429) in half of a
    window's requests while the other tenants' traffic made fewer tokens than the healthiest
    windows of the reference; error_spike waited until a window's tokens/s came back to 70%.
    A tenant's limit refuses at the gateway, so the tokens made say nothing about it; clients
    leaving while tokens/s halves is still no error spike of a normal engine."""
    path = tmp_path / "refused.duckdb"
    quiet = HEALTHY.but(
        duration_s=30, rate_per_s=0.9, running=3, error_share=0.45, error_type=error_type
    )
    write_store(path, [HEALTHY.but(duration_s=90), quiet], seed=8)
    con = duckdb.connect(str(path), read_only=True)
    report = diagnose(con)
    con.close()
    findings = {f.rule_id: f for f in report.findings}
    assert ("error_spike" in findings) is fires, sorted(findings)
    if fires:
        ev = findings["error_spike"].evidence
        assert ev["throughput_tok_s"] < 0.7 * ev["baseline_throughput_tok_s"], ev
        assert set(ev["errors_by_type"]) == {"rate_limit_exceeded"}
