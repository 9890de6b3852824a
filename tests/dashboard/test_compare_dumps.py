"""``tokenmill diagnose --baseline`` and the console's Compare page on two recorded real-engine
runs of the diagnosis corpus (Parquet dumps in ``benchmarks/data/diagnosis_corpus``): the
low-rate head-of-line family at ``--max-num-batched-tokens 512`` (BEFORE) and at 256 (AFTER),
each with its own sampled traffic.

This is the suite's check of the comparison; ``test_compare.py`` (``make test-e2e``) records
six fresh runs and checks the regression verdict itself on a pair with the same traffic.
What must hold here: the flag change is the one config difference; traffic that differs reads
as not comparable and does not gate; bad input is one line and exit 2; the Compare page
renders the pair.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
from test_compare import APP, _one_line_exit_2, tm

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "diagnosis_corpus"
BEFORE = CORPUS / "hol_low_rate-0" / "dump"
AFTER = CORPUS / "hol_low_rate-2" / "dump"


def _labels() -> tuple[dict, dict]:
    return tuple(json.loads((d.parent / "label.json").read_text()) for d in (BEFORE, AFTER))


def test_the_flag_change_is_named_and_other_traffic_does_not_gate():
    before, after = _labels()
    assert before["server"] == ["--max-num-batched-tokens", "512"], before["server"]
    assert after["server"] == ["--max-num-batched-tokens", "256"], after["server"]
    r = tm("diagnose", "--baseline", str(BEFORE), str(AFTER), "--format", "json",
           "--fail-on-regression", "10")  # fmt: skip
    assert r.returncode == 0, r.stderr  # documented: no gate on runs that are not comparable
    rep = json.loads(r.stdout)
    assert rep["config_diff"] == [
        {
            "key": "max_num_batched_tokens",
            "kind": "flag",
            "before": 512,
            "after": 256,
            "name": "--max-num-batched-tokens",
        }
    ]
    assert rep["verdict"] == "not_comparable" and not rep["comparable"]
    assert rep["regressions"] == []
    # the reasons are the traffic's: each one a check whose figures moved past its tolerance
    checks = {c["key"]: c for c in rep["checks"]}
    for key in rep["not_comparable_because"]:
        assert not checks[key]["ok"], checks[key]
    assert "requests" in rep["not_comparable_because"]
    n = {
        side: duckdb.sql(f"SELECT count(*) FROM '{d}/requests.parquet'").fetchall()[0][0]
        for side, d in (("before", BEFORE), ("after", AFTER))
    }
    assert (checks["requests"]["before"], checks["requests"]["after"]) == (
        n["before"],
        n["after"],
    )
    text = tm("diagnose", "--baseline", str(BEFORE), str(AFTER))
    assert text.returncode == 0, text.stderr
    assert "NOT COMPARABLE" in text.stdout and "--max-num-batched-tokens" in text.stdout
    md = tm("diagnose", "--baseline", str(BEFORE), str(AFTER), "--format", "markdown")
    assert "| --max-num-batched-tokens | flag | 512 | 256 |" in md.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    good = str(BEFORE)
    missing = str(tmp_path / "missing.duckdb")
    _one_line_exit_2(tm("diagnose", "--baseline", missing, good), "--baseline")
    _one_line_exit_2(tm("diagnose", "--baseline", good, missing), "no such file")
    # a dump of another schema version
    other = tmp_path / "other-version"
    shutil.copytree(AFTER, other)
    meta = other / "meta.parquet"
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT key, CASE WHEN key = 'schema_version' THEN '3' ELSE value END AS value "
            f"FROM '{meta}') TO '{tmp_path / 'meta.parquet'}' (FORMAT parquet)"
        )
    shutil.move(tmp_path / "meta.parquet", meta)
    _one_line_exit_2(tm("diagnose", "--baseline", str(other), good), "schema version 3")
    _one_line_exit_2(tm("diagnose", "--baseline", good, str(other)), "schema version 3")
    _one_line_exit_2(tm("diagnose", "--baseline", good, good, good), "exactly one AFTER")
    _one_line_exit_2(tm("diagnose", "--fail-on-regression", "10", good), "needs --baseline")


def test_compare_page_under_apptest(monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("TOKENMILL_DASHBOARD_SOURCE", str(AFTER))
    monkeypatch.setenv("TOKENMILL_DASHBOARD_BASELINE", str(BEFORE))
    at = AppTest.from_file(str(APP), default_timeout=300)
    at.run()
    at.switch_page("views/compare.py")
    at.run()
    assert not at.exception, at.exception
    verdicts = [e.value for e in (*at.error, *at.warning, *at.success)]
    assert any(v.startswith("NOT COMPARABLE") for v in verdicts), verdicts
    config = at.table[0].value  # one row per differing setting, indexed by its name
    assert list(config.index) == ["--max-num-batched-tokens"], config
    assert (config["BEFORE"].iloc[0], config["AFTER"].iloc[0]) == ("512", "256")
    assert len(at.get("plotly_chart")) >= 3  # stations, request latency, a BEFORE waterfall
    links = [pl.proto for pl in at.get("page_link")]
    slowest = [
        t
        for (t,) in duckdb.sql(
            f"SELECT trace_id FROM '{AFTER}/requests.parquet' ORDER BY ttft_ms DESC LIMIT 3"
        ).fetchall()
    ]
    assert [x.query_string for x in links if x.page == "requests"][-3:] == [
        f"trace={t}" for t in slowest
    ]
