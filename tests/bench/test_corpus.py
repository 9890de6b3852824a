"""``bench/corpus.py``'s backfill of the steps' queue fields on dumps recorded before them."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

from tokenmill.bench.corpus import backfill_queue_age, main

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


def test_a_damaged_dump_is_one_line_and_exit_2(tmp_path, capsys):
    dump = tmp_path / "x" / "dump"
    dump.mkdir(parents=True)
    (dump / "engine_steps.parquet").write_text("garbage")
    assert main(["--out", str(tmp_path), "--backfill-queue-age"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {dump}: ") and len(err.splitlines()) == 1
