"""The diagnoser on a live server's own store (``benchmarks/data/live_checks/``: Parquet dumps of
real ``tokenmill serve`` runs, their waiting samples taken by the API itself, not backfilled).

``itl_late_prompt``: four streams of 300 tokens, chunked prefill off; 9 s later one 1630-token
prompt, whose whole prefill takes one 21 s step. The streams arrived a window before the step
began.

``llamacpp_overload_from_start``: ``tokenmill proxy``'s store (no engine steps; llama.cpp's
``/metrics`` and ``/slots`` scraped each second) of a 2-slot ``llama-server`` sent 16 clients in
a closed loop from its first second for 60 s (``benchmarks/any_engine.py --part llamacpp
--llamacpp-parts overload_from_start``): no calm window to compare with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.accuracy import store_as_of
from tokenmill.diagnose.findings import diagnose
from tokenmill.telemetry.dump import open_dump

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "live_checks"
LATE = RUN / "itl_late_prompt"
OVERLOADED = RUN / "llamacpp_overload_from_start"
OVERLOADED_EXPECT = ["ttft_queueing", "overload"]  # either one on top


def _long_prompt(con) -> tuple[str, int]:
    return con.execute(
        "SELECT request_id, arrival_ns FROM requests ORDER BY input_tokens DESC LIMIT 1"
    ).fetchall()[0]


_late = pytest.mark.skipif(not LATE.is_dir(), reason=f"no {LATE}")
_overloaded = pytest.mark.skipif(not OVERLOADED.is_dir(), reason=f"no {OVERLOADED}")


@_late
def test_a_long_prompt_a_window_after_the_streams_it_stalls_is_named():
    """The streams' ITL counts in the window the stretched step began in, though they arrived
    in the window before (a window's own ITL figures are of the requests that arrived in it)."""
    con = open_dump(LATE, verify=False)
    try:
        report = diagnose(con, window_s=10.0)
    finally:
        con.close()
    assert report.findings and report.findings[0].rule_id == "itl_prefill_interference"
    ev = report.findings[0].evidence
    assert ev["mixed_step_ms_max"] > 20_000 and ev["itl_max_ms"] >= ev["mixed_step_ms_max"], ev
    assert ev["prefill_tokens_max_per_step"] >= 1600, ev


@_late
def test_the_step_in_progress_is_named_from_the_apis_own_samples():
    """Cut 5 s after the long prompt arrived: the step has not ended, the store's clock is the
    host and waiting samples the server wrote; the finding names the waiting prompt."""
    con = open_dump(LATE, verify=False)
    try:
        rid, arrival = _long_prompt(con)
        ((sampled,),) = con.execute(
            "SELECT count(*) FROM waiting_samples WHERE request_id = ?", [rid]
        ).fetchall()
        assert sampled >= 15  # the API sampled it each second of its 21 s wait
        live = store_as_of(con, arrival + 5 * 10**9)
    finally:
        con.close()
    try:
        found = {f.rule_id: f for f in diagnose(live, window_s=10.0).findings}
    finally:
        live.close()
    assert "itl_prefill_interference" in found, sorted(found)
    ev = found["itl_prefill_interference"].evidence
    assert ev["prefill_request"] == rid and ev["prefill_prompt_tokens"] == 1630, ev
    assert ev["open_step_ms"] >= 3000 and ev["decoding_requests"] >= 3, ev


@_overloaded
def test_an_upstream_overloaded_from_its_first_second_is_named_without_a_calm_window():
    """Every window is busy: the queue is judged on absolute terms, from llama.cpp's own
    deferred-request gauge beside its running one, not against a healthy stretch."""
    con = open_dump(OVERLOADED, verify=False)
    try:
        report = diagnose(con, window_s=5.0)
    finally:
        con.close()
    assert report.findings, "no finding on a 2-slot server with 16 clients"
    top = report.findings[0]
    assert top.rule_id in OVERLOADED_EXPECT, [f.rule_id for f in report.findings]
    if top.rule_id == "ttft_queueing":  # the queue read off llama.cpp's own gauges
        ev = top.evidence
        assert ev["waiting_max"] >= 10 and ev["waiting_mean"] > ev["running_mean"], ev


def test_the_queue_as_it_forms_behind_the_proxy_is_read_off_the_engines_own_gauge():
    """Without steps of the engine (another engine behind the proxy) admission counts as closed
    when its waiting gauge averaged ``onset_waiting`` in the window; with steps, only the
    steps' own share counts."""
    from types import SimpleNamespace

    from tokenmill.diagnose.rules.ttft_queueing import RULE, _admission_closed
    from tokenmill.diagnose.signals import Window

    p = {k: v.default for k, v in RULE.params.items()}
    proxy = SimpleNamespace(overall={"steps": None})
    ours = SimpleNamespace(overall={"steps": 120})
    queued = Window(0, 0, 1, values={"waiting_mean": p["onset_waiting"] + 0.5})
    calm = Window(0, 0, 1, values={"waiting_mean": p["onset_waiting"] - 1.0})
    assert _admission_closed(proxy, queued, p)
    assert not _admission_closed(proxy, calm, p)
    # our engine's steps say admission stayed open: its gauge alone does not close it
    assert not _admission_closed(ours, queued, p)
    closed = Window(0, 0, 1, values={"waiting_decode_only_share": p["queue_steps"]})
    assert _admission_closed(ours, closed, p)
