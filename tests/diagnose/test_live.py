"""The live diagnosis loop (``diagnose/live.py``, ``diagnose/live_service.py``): findings open
once and resolve once across an incident, nothing opens on health, the rows, the series and the
snapshot say the same; replayed over stores written through the real store writer."""

from __future__ import annotations

import json

import duckdb
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from synth_store import T0, Phase, S, write_store

from tokenmill.diagnose.live import LiveDiagnosis, LiveSettings
from tokenmill.diagnose.live_replay import replay
from tokenmill.diagnose.live_service import LiveMetrics, LiveService
from tokenmill.diagnose.signals import load as load_signals
from tokenmill.telemetry.store import TraceStore

HEALTHY = Phase(duration_s=90)
# 40 s in which every request waits 2 s in the queue (TTFT up, ITL flat), then health again
INCIDENT = [HEALTHY, HEALTHY.but(duration_s=40, queue_ms=2000), HEALTHY.but(duration_s=60)]
FAULT_START, FAULT_END = T0 + 90 * S, T0 + 130 * S


@pytest.fixture(scope="module")
def incident(tmp_path_factory):
    path = tmp_path_factory.mktemp("live") / "incident.duckdb"
    write_store(path, INCIDENT, seed=11)
    return path


@pytest.fixture(scope="module")
def ticks(incident):
    con = duckdb.connect(str(incident), read_only=True)
    out = [(r, loop) for loop, r in replay(con, LiveSettings())]
    con.close()
    return out


def test_one_incident_opens_one_finding_once_and_resolves_it_once(ticks):
    opened = [(r.now_ns, f.rule_id) for r, _ in ticks for f in r.opened]
    resolved = [(r.now_ns, f.rule_id) for r, _ in ticks for f in r.resolved]
    assert [rule for _, rule in opened] == ["ttft_queueing"], opened
    assert [rule for _, rule in resolved] == ["ttft_queueing"], resolved
    period = LiveSettings().period_s * S
    # open after the rule held in open_after consecutive periods of the fault
    delay = (opened[0][0] - FAULT_START) / period
    assert 1 <= delay <= 4, delay
    # resolved once the rule no longer held over the newest resolve_windows windows, within
    # three periods of the fault's end (its last window is still in the three-window range)
    after = (resolved[0][0] - FAULT_END) / period
    assert 0 < after <= 3, after


def test_judged_over_the_whole_range_the_finding_would_stay_open_longer(incident):
    """The same incident with the resolve judged over the whole three-window range (and two
    clean periods): the fault's last window keeps the finding open past three periods."""
    con = duckdb.connect(str(incident), read_only=True)
    whole = LiveSettings(resolve_windows=3, resolve_after=2)
    resolved = [r.now_ns for _, r in replay(con, whole) for f in r.resolved]
    con.close()
    assert len(resolved) == 1
    assert (resolved[0] - FAULT_END) / (whole.period_s * S) > 3


def test_nothing_opens_or_even_holds_during_the_healthy_lead(ticks):
    for r, _ in ticks:
        if r.until_ns <= FAULT_START:
            assert r.held == [] and not r.opened, (r.now_ns, r.held)


def test_the_reference_learns_only_healthy_windows_before_the_fault(ticks):
    _, loop = ticks[-1]
    starts = [w.start_ns for w in loop.reference]
    assert starts and all(s + 10 * S <= FAULT_START or s >= FAULT_END for s in starts), (
        "a window of the incident joined the baseline"
    )
    assert starts == sorted(set(starts))  # each window once, in order


def test_a_short_range_inside_the_incident_is_judged_against_the_health_before_it(incident):
    """Without the reference, a range made only of the incident's windows has no healthy
    window to compare with; with it the rule compares the queue with the health before."""
    con = duckdb.connect(str(incident), read_only=True)
    loop = LiveDiagnosis(LiveSettings())
    for loop_, _ in replay(con, LiveSettings(), end_ns=FAULT_START + 30 * S):
        loop = loop_
    assert loop.reference, "no healthy window learnt before the fault"
    assert "ttft_queueing" in loop.last.held
    con.close()


def test_the_service_writes_rows_series_and_a_snapshot_that_agree(tmp_path):
    """The thread's body over a real TraceStore: the findings table, /metrics' series and the
    /v1/findings snapshot name the same finding."""
    path = tmp_path / "live.duckdb"
    write_store(path, INCIDENT, seed=11)
    store = TraceStore(path, flush_interval_s=0.05)  # the writer of a live server's store
    registry = CollectorRegistry()
    now = [FAULT_START - 50 * S]  # the health before the fault first: the reference
    service = LiveService(
        store, LiveSettings(), metrics=LiveMetrics(registry), clock=lambda: now[0]
    )
    results = []
    for _ in range(10):
        results.append(service.run_once())
        now[0] += 10 * S
    assert any(f.rule_id == "ttft_queueing" for r in results for f in r.opened)
    assert store.flush(60)
    (rule, status, evidence) = store.query(
        "SELECT rule, status, evidence FROM findings ORDER BY time_ns DESC LIMIT 1"
    )[0]
    assert (rule, status) == ("ttft_queueing", "open")
    assert json.loads(evidence)["queue_share_of_ttft"] > 0.5
    text = generate_latest(registry).decode()
    assert 'tokenmill_finding_active{rule="ttft_queueing",severity="' in text
    # one series at 1: the open finding's current severity (a finding regraded moved series)
    active = [x for x in text.splitlines() if x.startswith("tokenmill_finding_active{")]
    on = [x for x in active if x.endswith(" 1.0")]
    assert len(on) == 1 and 'rule="ttft_queueing"' in on[0], active
    sev = on[0].split('severity="')[1].split('"')[0]
    assert "tokenmill_diagnosis_run_seconds_count 10.0" in text
    snap = service.snapshot()
    assert [f["rule"] for f in snap["open"]] == ["ttft_queueing"]
    assert snap["open"][0]["severity"] == sev
    assert snap["open"][0]["opened_ns"] is not None and snap["runs"] == 10
    # each run left its interval for the rules that discount the loop's own moments
    runs = store.query(
        "SELECT time_ns, CAST(attributes->>'end_ns' AS BIGINT) FROM events "
        "WHERE kind = 'live_diagnosis_run' ORDER BY time_ns"
    )
    assert [t for t, _ in runs] == [r.now_ns for r in results]
    assert all(t <= e <= t + int(r.seconds * 1e9) for (t, e), r in zip(runs, results, strict=True))
    store.close()


def _finding(rule_id: str):
    from tokenmill.diagnose.findings import Finding

    return Finding(rule_id, rule_id, "warning", 0.8, "", {}, None, None, [], [], [], "", "")


def test_a_rule_opens_after_one_period_unless_its_claim_needs_more():
    """open_after 1 by default; periodic_itl_spikes (a period claimed from spikes) waits for
    its own live_open_after of 2; both resolve after resolve_after clean periods."""
    from tokenmill.diagnose.live import TickResult

    loop = LiveDiagnosis(LiveSettings())
    assert loop.settings.open_after_for("periodic_itl_spikes") == 2
    assert loop.settings.open_after_for("ttft_queueing") == 1
    held = [_finding("ttft_queueing"), _finding("periodic_itl_spikes")]
    first = TickResult(10 * S, 0, 0, held=[])
    loop._advance(held, 10 * S, first)
    assert [f.rule_id for f in first.opened] == ["ttft_queueing"]
    assert loop.active["periodic_itl_spikes"].status == "pending"
    second = TickResult(20 * S, 0, 0, held=[])
    loop._advance(held, 20 * S, second)
    assert [f.rule_id for f in second.opened] == ["periodic_itl_spikes"]
    m = loop.settings.resolve_after
    for t in range(3, 3 + m):
        r = TickResult(t * 10 * S, 0, 0, held=[])
        loop._advance([], t * 10 * S, r)
    assert loop.active == {} and {f.rule_id for f in loop.resolved} == {
        "ttft_queueing",
        "periodic_itl_spikes",
    }
    assert r.resolved and all(f.resolved_ns == (2 + m) * 10 * S for f in r.resolved)


def test_a_neighbour_longer_than_the_range_is_judged_against_the_steps_before_it(tmp_path):
    """A range wholly inside a neighbour's run has no quick steps of its own: the same work is
    set against its quickest quarter over the range and the loop's reference windows, so the
    steps read 2x slower, not 1x; without the reference the range reads as its own usual."""
    path = tmp_path / "hog.duckdb"
    hog = HEALTHY.but(duration_s=60, step_ms=100, cpu_others_pct=60)
    write_store(path, [HEALTHY, hog, HEALTHY.but(duration_s=30)], seed=5)
    con = duckdb.connect(str(path), read_only=True)
    inside = FAULT_START + 50 * S  # the range [+20 s, +50 s) of the hog's 60 s
    loop = None
    for loop_, _ in replay(con, LiveSettings(), end_ns=inside):
        loop = loop_
    assert (
        loop is not None and loop.reference and all(w.end_ns <= FAULT_START for w in loop.reference)
    )
    since, until = loop.range_at(inside)
    assert since >= FAULT_START
    with_ref = load_signals(con, since_ns=since, until_ns=until, reference=tuple(loop.reference))
    alone = load_signals(con, since_ns=since, until_ns=until)
    slow = [w.get("same_work_slowdown") for w in with_ref.windows]
    assert all(s is not None and s > 1.6 for s in slow), slow
    assert all(w.get("same_work_slowdown") < 1.3 for w in alone.windows)
    assert "host_contention" in loop.last.held
    con.close()


def test_each_run_waits_for_the_window_it_judges_to_close_and_reach_the_store():
    """The thread runs just after a window closes (the store's flush interval and
    SETTLE_S past the grid), not at whatever moment it started: a run 0.2 s after a window
    closed waits for that window's rows, one 1.6 s after runs next just after the next one."""
    from tokenmill.diagnose.live_service import SETTLE_S

    class _Store:
        flush_interval_s = 1.0

        def submit(self, table, row):
            pass

    now = [T0 // (10 * S) * 10 * S + int(0.2 * S)]
    service = LiveService(_Store(), LiveSettings(), clock=lambda: now[0])
    settle = 1.0 + SETTLE_S
    assert service.wait_s() == pytest.approx(settle - 0.2)
    now[0] += int((settle - 0.2) * S)  # the run itself
    assert service.wait_s() == pytest.approx(10.0)
    now[0] += int(0.1 * S)
    assert service.wait_s() == pytest.approx(9.9)
    now[0] += int(12 * S)  # a run that outlasted its period: the next window's, not a backlog
    assert 0 < service.wait_s() <= 10.0


def test_no_window_judged_while_a_finding_was_open_joins_the_reference(tmp_path):
    """A neighbour's windows show no queue, error or preemption, so the baseline's markers
    call them healthy; resolved within a few periods, its finding leaves the range's oldest
    window inside the fault. The reference must not learn it, or the next neighbour would be
    compared with this one."""
    path = tmp_path / "hog.duckdb"
    hog = HEALTHY.but(duration_s=40, step_ms=100, itl_ms=100, cpu_others_pct=60)
    write_store(path, [HEALTHY, hog, HEALTHY.but(duration_s=90)], seed=5)
    con = duckdb.connect(str(path), read_only=True)
    ticks = list(replay(con, LiveSettings()))
    con.close()
    opened = [f.rule_id for _, r in ticks for f in r.opened]
    assert "host_contention" in opened, opened
    loop = ticks[-1][0]
    starts = [w.start_ns for w in loop.reference]
    assert any(s >= FAULT_START + 40 * S for s in starts), "nothing learnt after the fault"
    inside = [s for s in starts if s + 10 * S > FAULT_START and s < FAULT_START + 40 * S]
    assert not inside, [(s - FAULT_START) / S for s in inside]
