"""``bench/corpus.py``'s backfill of the steps' queue fields and of the API's waiting samples
on dumps recorded before them, and a family's label against what its runs' engine recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest

from tokenmill.bench.corpus import (
    backfill_queue_age,
    backfill_waiting,
    main,
    queueing_label_check,
)

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "diagnosis_corpus"
# recorded by an engine that writes oldest_wait_* itself
RECORDED = CORPUS / "itl_prefill_interference-11" / "dump"
FIELDS = "oldest_wait_ms, oldest_wait_id, oldest_wait_prompt_tokens"


def _steps(dump: Path) -> list[tuple]:
    return duckdb.sql(
        f"SELECT step_id, {FIELDS} FROM read_parquet('{dump / 'engine_steps.parquet'}') "
        "ORDER BY step_id"
    ).fetchall()


@pytest.mark.skipif(not RECORDED.is_dir(), reason="no recorded corpus run")
def test_the_backfill_gives_what_the_engine_recorded(tmp_path):
    """A dump the engine recorded with the fields, stripped of them and backfilled from its
    requests' milestones, gets the engine's values back step for step."""
    dump = tmp_path / "run" / "dump"
    shutil.copytree(RECORDED, dump)
    want = _steps(dump)
    assert any(w[1] is not None for w in want), "some step had a request waiting"
    steps = dump / "engine_steps.parquet"
    duckdb.sql(
        f"COPY (SELECT * EXCLUDE ({FIELDS}) FROM read_parquet('{steps}')) "
        f"TO '{tmp_path / 'stripped.parquet'}' (FORMAT parquet)"
    )
    shutil.move(tmp_path / "stripped.parquet", steps)
    assert backfill_queue_age(dump) is True
    got = _steps(dump)
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[2:] == w[2:], (g, w)  # the same request and prompt size
        assert (g[1] is None) == (w[1] is None) and (g[1] is None or abs(g[1] - w[1]) < 0.01)
    assert backfill_queue_age(dump) is False  # once only


@pytest.mark.skipif(not (CORPUS / "hol_strict-2").is_dir(), reason="no corpus run")
def test_the_waiting_samples_backfill_samples_each_second_what_had_no_first_token(tmp_path):
    """The samples the API would have taken, one each second from the first arrival: request by
    request, one row at every sample time between its arrival and its first token (or its end
    without one), its wait that time less its arrival; once only."""
    from tokenmill.engine.api.app import WAITING_SAMPLE_S

    dump = tmp_path / "run" / "dump"
    shutil.copytree(CORPUS / "hol_strict-2" / "dump", dump)
    (dump / "waiting_samples.parquet").unlink(missing_ok=True)
    assert backfill_waiting(dump) is True
    reqs = duckdb.sql(
        f"SELECT request_id, arrival_ns, coalesce(first_token_ns, end_ns), input_tokens "
        f"FROM read_parquet('{dump / 'requests.parquet'}') WHERE input_tokens IS NOT NULL"
    ).fetchall()
    rows = duckdb.sql(
        f"SELECT time_ns, request_id, arrival_ns, wait_ms, prompt_tokens "
        f"FROM read_parquet('{dump / 'waiting_samples.parquet'}')"
    ).fetchall()
    step = int(WAITING_SAMPLE_S * 1e9)
    t0 = min(r[1] for r in reqs)
    last = max(r[2] for r in reqs)
    times = range(t0 + step, last, step)
    want = sorted(
        (t, rid, arr, tokens) for rid, arr, first, tokens in reqs for t in times if arr < t < first
    )
    assert sorted((t, rid, arr, n) for t, rid, arr, _, n in rows) == want
    assert len(want) > 100  # hol_strict: 20 short requests waited about 30 s each
    assert all(abs(w - (t - a) / 1e6) < 1e-6 for t, _, a, w, _ in rows)
    assert backfill_waiting(dump) is False


def test_a_damaged_dump_is_one_line_and_exit_2(tmp_path, capsys):
    dump = tmp_path / "x" / "dump"
    dump.mkdir(parents=True)
    (dump / "engine_steps.parquet").write_text("garbage")
    assert main(["--out", str(tmp_path), "--backfill-queue-age"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {dump}: ") and len(err.splitlines()) == 1


QUEUEING = sorted(CORPUS.glob("ttft_queueing-*/label.json"))


@pytest.mark.skipif(not QUEUEING, reason="no recorded ttft_queueing run")
def test_the_queueing_label_starts_where_the_clients_outnumber_what_the_pool_admits():
    """``ttft_queueing`` runs step 4 clients up by 1.5x, 2x, ... every ``step_s``. The label puts
    the fault at the 2x step, and every queueing run in the corpus passes the family's label
    check (the largest running batch holds the 1.5x step's clients and not the 2x step's)."""
    for path in QUEUEING:
        label = json.loads(path.read_text())
        p = label["params"]
        assert label["fault_start_ns"] == label["steps_started_ns"] + int(2 * p["step_s"] * 1e9)
        steps = path.parent / "dump" / "engine_steps.parquet"
        con = duckdb.connect()
        try:
            con.execute(f"CREATE VIEW engine_steps AS SELECT * FROM read_parquet('{steps}')")
            assert queueing_label_check(con, p) is None, path.parent.name
        finally:
            con.close()


def test_the_label_check_refuses_a_pool_that_runs_the_2x_steps_clients():
    """A pool that ran 8 of 4-client runs' requests at once (the 2x step's clients) or only 5
    (fewer than the 1.5x step's 6), or a run without steps, contradicts the label; 6 and 7
    agree with it."""
    p = {"clients": 4, "blocks": 52}
    for peak, ok in ((5, False), (6, True), (7, True), (8, False), ("NULL", False)):
        with duckdb.connect() as con:
            con.execute(f"CREATE TABLE engine_steps AS SELECT {peak}::INTEGER AS num_running")
            wrong = queueing_label_check(con, p)
        assert (wrong is None) is ok, (peak, wrong)
        if peak == 8:
            assert "largest running batch was 8" in wrong and "52 blocks" in wrong
        if peak == "NULL":
            assert wrong == "no engine step was recorded"


def test_a_run_id_the_sample_does_not_hold_is_one_line_and_exit_2(tmp_path, capsys):
    assert (
        main(["--out", str(tmp_path), "--family", "healthy", "--run", "healthy-9", "--list"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == "error: --run healthy-9: not among the sampled runs", err
    assert (
        main(
            [
                "--out",
                str(tmp_path),
                "--per-family",
                "10",
                "--family",
                "healthy",
                "--run",
                "healthy-9",
                "--list",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split()[0] == "healthy-9"
