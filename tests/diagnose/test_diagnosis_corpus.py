"""The diagnoser on the labelled corpus's evaluation split (benchmarks/data/diagnosis_corpus,
runs of the real engine made by ``make corpus``; never used to choose a threshold): the fixed
slice CI runs. The full report, with time to detect and the reliability table, is
``benchmarks/diagnosis_accuracy.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.accuracy import evaluate_run, score
from tokenmill.bench.corpus import FAMILIES, load_runs

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "diagnosis_corpus"
RUNS = load_runs(CORPUS, "eval")

pytestmark = pytest.mark.skipif(not RUNS, reason=f"no corpus under {CORPUS} (make corpus)")


@pytest.fixture(scope="module")
def results():
    return {label["id"]: evaluate_run(label, dump, time_to_detect=False) for label, dump in RUNS}


def test_the_evaluation_split_covers_every_family():
    assert {label["family"] for label, _ in RUNS} == set(FAMILIES)
    assert all(label["split"] == "eval" for label, _ in RUNS)


def test_top1_accuracy_and_no_findings_on_healthy_runs(results):
    """The figures of benchmarks/RESULTS.md (2026-12-03: top-1 19 of 21, no finding on the six
    healthy runs, every finding at 0.8 or more right, itl_prefill_interference's recall 3 of 5
    the lowest) as a floor: a change that loses a run fails here."""
    summary = score(list(results.values()))
    misses = {r.id: (r.expect, r.top) for r in results.values() if not r.correct}
    assert summary["top1_accuracy"] >= 19 / 21, misses
    assert summary["healthy_false_finding_rate"] == 0, misses
    assert summary["high_confidence_share_right"] >= 0.8, summary["reliability"]
    for rule, m in summary["per_rule"].items():
        if m["runs_expecting"]:
            assert m["recall"] >= 0.6, (rule, m, misses)


def test_the_kinds_of_miss_an_independent_try_found(results):
    by_family: dict[str, list] = {}
    for r in results.values():
        by_family.setdefault(r.family, []).append(r)
    # plain symptoms at one request a window
    for r in by_family["hol_low_rate"]:
        assert r.top == "head_of_line_blocking", (r.id, r.findings)
    for r in by_family["multi_turn_uncached"]:
        assert r.top in r.expect, (r.id, r.findings)
    # our own load generator is a validity note, never host_contention
    for r in by_family["healthy_loaded"]:
        assert "host_contention" not in {f for f, _ in r.findings}, (r.id, r.findings)
    # a periodic disturbance comes first, not prefill interference
    for r in by_family["periodic_itl_spikes"]:
        assert r.top == "periodic_itl_spikes", (r.id, r.findings)


def test_a_long_prefill_step_between_two_slow_decode_steps_is_no_host_stall():
    """A tune-split run (itl_prefill_interference-4: three streams decoding, then a 1,730-token
    prompt prefilled whole in one 16 s step). A slow decode step just before the prefill (the
    load generator starting its long-prompt client) and one just after it are neighbours among
    the decode-only steps, and used to join into one "stall" 17 s long that covered the prefill
    step, so the prefill was blamed on the host and nothing was found. Runs of slow decode
    steps now break where the time between them is more than their gap in steps allows."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.diagnose.rules.periodic_itl_spikes import decode_stalls
    from tokenmill.diagnose.signals import load
    from tokenmill.telemetry.dump import open_dump

    run = CORPUS / "itl_prefill_interference-4"
    if not run.is_dir():
        pytest.skip(f"no {run.name} in the corpus")
    con = open_dump(run / "dump", verify=False)
    try:
        (prefill_start, prefill_end) = con.execute(
            "SELECT start_ns, end_ns FROM engine_steps WHERE num_prefill_tokens > 1000"
        ).fetchone()
        sig = load(con, window_s=10.0)
        stalls = decode_stalls(sig)
        assert stalls, "the slow decode steps around the load generator's start are still seen"
        for start, _, _, end in stalls:
            assert end <= prefill_start or start >= prefill_end, (start, end)
        report = diagnose(con, window_s=10.0)
        assert report.findings and report.findings[0].rule_id == "itl_prefill_interference"
    finally:
        con.close()


def _live_store(run, cut_ns: int):
    """A corpus run's store as a live server's stood at ``cut_ns``, in memory."""
    from tokenmill.bench.accuracy import store_as_of
    from tokenmill.telemetry.dump import open_dump

    con = open_dump(run / "dump", verify=False)
    try:
        return store_as_of(con, cut_ns)
    finally:
        con.close()


def _live(
    run,
    cut_ns: int,
    *,
    drop_queue_fields: bool = False,
    drop_samples: bool = False,
    drop_clock: bool = False,
):
    """The diagnosis of a corpus run's store as a live server's stood at ``cut_ns`` (only the
    requests that had ended by then), with its label's window: findings by rule, and the ids
    of the requests that had ended. ``drop_queue_fields``: without the steps' record of the
    queue and the API's waiting samples; ``drop_samples``: without the samples alone;
    ``drop_clock``: without the host and waiting samples past the last stored step (the clock
    a step in progress is timed by)."""
    import json

    from tokenmill.diagnose.findings import diagnose
    from tokenmill.telemetry.dump import parse_duration

    label = json.loads((run / "label.json").read_text())
    live = _live_store(run, cut_ns)
    try:
        if drop_queue_fields:
            for col in ("oldest_wait_ms", "oldest_wait_id", "oldest_wait_prompt_tokens"):
                live.execute(f"ALTER TABLE engine_steps DROP COLUMN {col}")
        if drop_queue_fields or drop_samples:
            live.execute("DELETE FROM waiting_samples")
        if drop_clock:
            (last,) = live.execute("SELECT max(end_ns) FROM engine_steps").fetchone()
            for table in ("device_samples", "waiting_samples"):
                live.execute(f"DELETE FROM {table} WHERE time_ns > {last}")
        report = diagnose(live, window_s=parse_duration(label["window"]))
        ended = {r for (r,) in live.execute("SELECT request_id FROM requests").fetchall()}
        return {f.rule_id: f for f in report.findings}, ended
    finally:
        live.close()


def _first_window(run, label) -> tuple[int, int]:
    """Where the full run's diagnosis starts its windows, and their length (ns): the grid the
    accuracy replay cuts on."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.telemetry.dump import open_dump, parse_duration

    w_ns = int(parse_duration(label["window"]) * 1e9)
    con = open_dump(run / "dump", verify=False)
    try:
        return diagnose(con, window_s=w_ns / 1e9).start_ns, w_ns
    finally:
        con.close()


def _run(run_id: str) -> tuple[Path, dict]:
    import json

    run = CORPUS / run_id
    if not run.is_dir():
        pytest.skip(f"no {run_id} in the corpus")
    return run, json.loads((run / "label.json").read_text())


def test_head_of_line_blocking_is_seen_while_its_victim_has_not_ended():
    """A tune run (hol_low_rate-0: short prompts at a low rate, a long prompt's chunks take the
    step budget) cut as a live store stood 15 s into the fault: the short request stuck behind
    the long prompt has not ended, so the ended requests alone show nothing; the steps' record
    of the queue (the longest-waiting request, its wait and prompt size) names it and the long
    prompt queued before it."""
    run, label = _run("hol_low_rate-0")
    cut = label["fault_start_ns"] + 15 * 10**9
    found, ended = _live(run, cut)
    assert "head_of_line_blocking" in found, sorted(found)
    f = found["head_of_line_blocking"]
    assert f.evidence["waiting_request"] not in ended, f.summary
    assert f.evidence["waiting_prompt_tokens"] * 4 <= f.evidence["input_tokens_max"], f.evidence
    assert f.evidence["longest_wait_ms"] >= 5 * f.evidence["unheld_ttft_p50_ms"], f.evidence
    without, _ = _live(run, cut, drop_queue_fields=True)
    assert "head_of_line_blocking" not in without, sorted(without)


def test_the_api_samples_show_the_queue_behind_a_step_that_hides_it():
    """A tune run (hol_strict-2: strict admission stops at 1030-token prompts that do not fit
    yet; 90-token requests queue behind them) cut 26 s into the fault, while one prefill step
    of the long prompts runs for 9 s: no step has ended to record the queue, and no short
    request has ended. The API's waiting samples (``waiting_samples``) show the short requests
    waiting behind the long prompts queued before them; without the samples nothing fires."""
    run, label = _run("hol_strict-2")
    cut = label["fault_start_ns"] + 26 * 10**9
    found, ended = _live(run, cut)
    assert "head_of_line_blocking" in found, sorted(found)
    f = found["head_of_line_blocking"]
    assert f.evidence["waiting_request"] not in ended, f.summary
    assert f.evidence["waiting_prompt_tokens"] == 90, f.evidence
    assert f.evidence["input_tokens_max"] == 1030, f.evidence
    assert f.evidence["longest_wait_ms"] >= 5 * f.evidence["unheld_ttft_p50_ms"], f.evidence
    without, _ = _live(run, cut, drop_samples=True)
    assert "head_of_line_blocking" not in without, sorted(without)


def test_a_long_prefill_step_is_named_while_it_runs():
    """A tune run (itl_prefill_interference-0: four streams decode, a 1564-token prompt arrives,
    chunked prefill off) cut 10 s into the fault, while its 14 s prefill step runs: no step has
    ended since it began and no stream has ended. The step in progress (the engine silent with
    requests to run while the host samples go on) stands 8x past the decode step, begun while
    the long prompt waited: named, with the streams it stalls. Without the host and waiting
    samples there is no clock past the last step, and nothing fires."""
    run, label = _run("itl_prefill_interference-0")
    cut = label["fault_start_ns"] + 10 * 10**9
    found, ended = _live(run, cut)
    assert "itl_prefill_interference" in found, sorted(found)
    ev = found["itl_prefill_interference"].evidence
    assert ev["prefill_prompt_tokens"] == 1564 and ev["prefill_request"] not in ended, ev
    assert 3 <= ev["decoding_requests"] <= 4, ev  # a lower bound: at least these decode
    assert ev["open_step_ms"] >= 8 * ev["decode_step_ms_p50"], ev
    without, _ = _live(run, cut, drop_clock=True)
    assert "itl_prefill_interference" not in without, sorted(without)


def test_a_step_a_cpu_hog_stretches_is_named_while_it_runs():
    """A tune run (host_contention-0: four CPU hogs start beside the server) cut 5.5 s into the
    hog: the step it stretched from ~0.1 s to 7.5 s has not ended, so no window has a slowed
    step to compare; the step in progress does, with no long prompt waiting and the hogs in the
    host samples' census, which the finding names."""
    run, label = _run("host_contention-0")
    cut = label["fault_start_ns"] + int(5.5 * 10**9)
    found, _ = _live(run, cut)
    assert "host_contention" in found, sorted(found)
    ev = found["host_contention"].evidence
    assert ev["open_step_ms"] >= 8 * ev["usual_step_ms"], ev
    assert ev["cpu_others_pct"] >= 20 and ev["busy_processes"], ev
    without, _ = _live(run, cut, drop_clock=True)
    assert "host_contention" not in without, sorted(without)


def test_healthy_runs_never_show_a_waiting_queue():
    """Every healthy tune run cut at 10 s, 20 s and 40 s: no request waited at the head of the
    queue long enough for either rule that reads the queue as it stands, and no step in
    progress was long enough for the rules that time it."""
    from tokenmill.diagnose.signals import NoTraffic

    runs = sorted(p.parent.name for p in CORPUS.glob("healthy*/label.json"))
    tune = [r for r in runs if int(r.rsplit("-", 1)[1]) % 2 == 0]
    assert tune
    for run_id in tune:
        run, label = _run(run_id)
        for after in (10, 20, 40):
            try:
                found, _ = _live(run, label["steps_started_ns"] + after * 10**9)
            except NoTraffic:
                continue
            live_rules = {
                "head_of_line_blocking",
                "ttft_queueing",
                "itl_prefill_interference",
                "host_contention",
            }
            assert not live_rules & set(found), (run_id, after)


def test_a_queue_is_named_while_it_forms():
    """A tune run (ttft_queueing-2: clients step up past what a small KV pool admits) cut a
    10 s window after its 2x step, where 8 clients first outnumber the 6-7 the pool admits. The
    ended requests' TTFT has not risen the rule's 2.5x yet; the queue as it forms has: requests
    waited through a quarter or more of the window's steps (``queue_steps``), and a request
    waited longer than the healthy windows' whole TTFT p50 before its prefill began."""
    from tokenmill.diagnose.rules.ttft_queueing import RULE, _risen
    from tokenmill.diagnose.signals import load
    from tokenmill.telemetry.dump import parse_duration

    run, label = _run("ttft_queueing-2")
    cut = label["fault_start_ns"] + 10 * 10**9
    found, _ = _live(run, cut)
    assert "ttft_queueing" in found, sorted(found)
    ev = found["ttft_queueing"].evidence
    assert ev["longest_wait_ms"] >= ev["baseline_ttft_p50_ms"], ev
    floor = RULE.params["queue_steps"].default
    assert ev["waiting_decode_only_share"] >= floor and ev["queued_requests"] >= 1, ev
    # the ended requests alone do not show it yet
    live = _live_store(run, cut)
    try:
        sig = load(live, window_s=parse_duration(label["window"]))
        assert _risen(sig, {k: v.default for k, v in RULE.params.items()}) is None
    finally:
        live.close()


def test_a_queue_in_a_third_of_the_steps_is_named_by_the_second_window():
    """A tune run whose KV pool (49 blocks) nearly holds the 2x step's 8 clients
    (ttft_queueing-20, 5 s windows): after the step, a third of each window's steps begin with
    requests waiting and none admitted, and requests wait 1.5-2.6x the healthy TTFT p50. Cut
    where the accuracy replay cuts, at the end of the second window from the fault's, the queue
    is named (with queue_steps at 0.4 it was named two windows later)."""
    run, label = _run("ttft_queueing-20")
    start, w_ns = _first_window(run, label)
    fault = label["fault_start_ns"]
    cut = start + ((fault - start) // w_ns + 2) * w_ns
    found, _ = _live(run, cut)
    assert "ttft_queueing" in found, sorted(found)
    ev = found["ttft_queueing"].evidence
    assert 0.25 <= ev["waiting_decode_only_share"] < 0.4, ev
    assert ev["longest_wait_ms"] >= ev["baseline_ttft_p50_ms"], ev


def test_uncached_history_is_named_once_its_first_two_repeats_end():
    """A tune run of two uncached chats (multi_turn_uncached-0, 5 s windows), cut 15 s in: five
    requests have ended, two of them second turns that repeated their first turn's 12 blocks
    and had them computed again, 384 of 1,288 prompt tokens (0.298). The rule names it there
    (at a 0.3 share it waited two more windows)."""
    run, label = _run("multi_turn_uncached-0")
    start, w_ns = _first_window(run, label)
    found, ended = _live(run, start + 3 * w_ns)
    assert len(ended) == 5
    assert "prefix_cache_miss" in found, sorted(found)
    ev = found["prefix_cache_miss"].evidence
    assert ev["repeating_prompts"] == 2 and ev["enable_prefix_caching"] is False, ev
    assert 0.2 <= ev["recomputed_share_of_prompt_tokens"] < 0.3, ev


def test_a_hog_is_named_against_the_engine_pace_before_it():
    """A tune run (host_contention-2: three CPU hogs beside two streams) cut 5.4 s into the
    hog. Every step since the hog began takes ~3 s against ~50 ms before it, so the steps just
    before the open one are already the hog's; the open step is set against the steps that ended
    before the host samples first showed the neighbour, and named."""
    run, label = _run("host_contention-2")
    cut = label["fault_start_ns"] + int(5.4 * 10**9)
    found, _ = _live(run, cut)
    assert "host_contention" in found, sorted(found)
    ev = found["host_contention"].evidence
    assert ev["usual_step_ms"] < 100, ev  # the engine's own pace, not the hog's 3 s steps
    assert ev["open_step_ms"] >= 8 * ev["usual_step_ms"] and ev["busy_processes"], ev


def test_a_short_request_behind_a_long_prompt_is_named_before_it_waits_five_usual_ttfts():
    """A tune run (hol_strict-0: strict admission stops at 1030-token prompts; 90-token
    requests queue behind them) cut 15 s into the fault: the short requests have waited 4-5x
    the TTFT of ended requests nothing held back, short of the 5x the ended requests' rule asks
    (short_ttft_rise). Still waiting, behind a long prompt seen queued ahead of them, 3x is
    enough (live_wait_rise)."""
    run, label = _run("hol_strict-0")
    found, ended = _live(run, label["fault_start_ns"] + 15 * 10**9)
    assert "head_of_line_blocking" in found, sorted(found)
    ev = found["head_of_line_blocking"].evidence
    assert ev["waiting_request"] not in ended and ev["waiting_prompt_tokens"] == 90, ev
    assert ev["input_tokens_max"] == 1030, ev
    assert 3 <= ev["longest_wait_ms"] / ev["unheld_ttft_p50_ms"] < 5, ev


def test_a_client_gap_is_read_request_by_request():
    """A tune run (kv_pressure_preemption-2) cut as a live store 100 s in: every ended
    request's client TTFT is within 5% of its server TTFT but three, which waited 3-4.5 s on
    the client's side. Their client TTFTs sit at the middle of the client column and short
    server TTFTs at the middle of the server column, so the two medians read 2x; the rule read
    that ratio and named a proxy. It reads each request's own ratio now (about 1)."""
    from tokenmill.bench.accuracy import store_as_of
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.telemetry.dump import open_dump, parse_duration

    run, label = _run("kv_pressure_preemption-2")
    con = open_dump(run / "dump", verify=False)
    window_s = parse_duration(label["window"])
    start = diagnose(con, window_s=window_s).start_ns
    live = store_as_of(con, start + 20 * int(window_s * 1e9))
    con.close()
    try:
        client, server, per_request = live.execute(
            "SELECT quantile_cont(client_ttft_ms, 0.5), quantile_cont(ttft_ms, 0.5), "
            "quantile_cont(client_ttft_ms / ttft_ms, 0.5) FROM requests "
            "WHERE client_ttft_ms IS NOT NULL"
        ).fetchone()
        assert client >= 2 * server and per_request < 1.05, (client, server, per_request)
        report = diagnose(live, window_s=window_s)
    finally:
        live.close()
    rules = {f.rule_id for f in report.findings} | {f.rule_id for f in report.inconclusive}
    assert "client_server_ttft_gap" not in rules, rules
