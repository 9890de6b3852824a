"""The stop-signal drill's fast cases (``bench/signal_drill.py``; all six, with data-parallel and
tensor-parallel servers, in ``benchmarks/signal_drill.py``): a real server with 8 streams open,
stopped as systemd, a supervisor, a terminal and the OOM killer stop it. SIGTERM to the API alone
is ``test_sigterm_drains_open_streams_before_stopping``."""

from __future__ import annotations

import pytest

from tokenmill.bench.signal_drill import STREAMS, run_case

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", ["term_group", "int_group", "term_core"])
def test_a_stop_sent_to_the_group_or_a_core_drains_every_stream(tmp_path, smollm2_dir, case):
    """Before: SIGTERM to the process group (or to the core) killed the engine core at once and
    every stream ended after 2-3 tokens with ``engine core died``; SIGINT stopped at once."""
    r = run_case(case, tmp_path, ("--model", str(smollm2_dir)))
    assert (r.completed, r.cut_with_error, r.cut_silently) == (STREAMS, 0, 0), r
    assert r.exit_code == 0, r
    assert r.leftover_processes == [], r
    assert r.ready_status_while_stopping == 503, r
    assert r.new_request_status_while_stopping == 503 and r.new_request_retry_after, r
    log = (tmp_path / f"{case}.log").read_text()
    assert "draining 8 requests in flight" in log and "stopped: 0 requests cut" in log, log


def test_a_second_stop_signal_cuts_the_rest_with_an_error_event(tmp_path, smollm2_dir):
    r = run_case("term_twice", tmp_path, ("--model", str(smollm2_dir)))
    assert r.cut_silently == 0 and r.completed + r.cut_with_error == STREAMS, r
    assert r.cut_with_error > 0 and r.details == ["server_shutdown"], r
    log = (tmp_path / "term_twice.log").read_text()
    assert f"stopped: {r.cut_with_error} requests cut" in log, log
    assert r.exit_code == 0 and r.leftover_processes == [], r


def test_sigkill_to_the_api_leaves_no_process_and_no_silent_end(tmp_path, smollm2_dir):
    """The OOM killer takes the API process: every stream sees the cut (an incomplete chunked
    body), and the engine core notices its parent is gone and exits."""
    r = run_case("kill_api", tmp_path, ("--model", str(smollm2_dir)))
    assert (r.cut_with_error, r.cut_silently) == (STREAMS, 0), r
    assert r.exit_code == -9 and r.leftover_processes == [], r


def test_sigkill_of_the_engine_core_ends_every_stream_and_is_named_with_its_requests(
    tmp_path, smollm2_dir
):
    """The OOM killer takes the engine core mid-batch: every open stream gets an
    ``engine_died`` error event, the core restarts and serves again, and the diagnoser's first
    finding is ``engine_crash`` naming every cut request by the client's id. Before: the
    streams waited for the old core's shutdown, and the crash event said neither the signal nor
    the requests (no rule read it)."""
    from tokenmill.bench.signal_drill import run_core_kill

    r = run_core_kill(tmp_path, ("--model", str(smollm2_dir)))
    assert (r.cut_with_error, r.cut_silently) == (STREAMS, 0), r
    assert r.error_codes == ["engine_died"] and r.served_after, r
    assert r.first_finding == "engine_crash", r
    assert "SIGKILL" in r.finding_summary and r.named_in_finding == STREAMS, r
