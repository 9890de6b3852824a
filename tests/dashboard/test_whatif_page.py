"""The What if page on a recording of the real engine (the plan validation's, kept as a
Parquet dump): its numbers are ``tokenmill plan``'s for the same what-if and SLO, a knob set on
the page changes them as the plan says, and the knee is where goodput falls."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from tokenmill.dashboard import data
from tokenmill.plan.capacity import NoRateMeets, capacity, p99_slo
from tokenmill.plan.predict import open_recording, predict
from tokenmill.plan.recommend import knee
from tokenmill.plan.whatif import SloBounds, parse_slo, parse_whatif

APP = Path(data.__file__).parent / "app.py"
RECORDING = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "plan_recording"


def _page(monkeypatch) -> AppTest:
    monkeypatch.setenv("TOKENMILL_DASHBOARD_SOURCE", str(RECORDING))
    at = AppTest.from_file(str(APP), default_timeout=300)
    at.run()
    at.switch_page("views/whatif.py")
    at.run()
    assert not at.exception, at.exception
    return at


def _table(at: AppTest) -> pd.DataFrame:
    return at.dataframe[0].value


def test_the_page_shows_the_plans_numbers(monkeypatch):
    at = _page(monkeypatch)
    df = _table(at)
    assert len(df) == 6
    rec = open_recording(RECORDING)
    slo = SloBounds("", {}, data.GoodputSlo())
    for factor, row in zip((0.5, 1.0, 2.0), (0, 1, 3), strict=True):
        p = predict(rec, parse_whatif(f"rate={factor:g}" if factor != 1 else ""), slo)
        assert df["goodput_share"].iloc[row] == pytest.approx(p.summary["goodput_share"])
        assert df["ttft_p99_ms"].iloc[row] == pytest.approx(p.summary["ttft_p99_ms"])
    # traffic that grows is served no better
    assert df["ttft_p99_ms"].iloc[-1] > df["ttft_p99_ms"].iloc[0]
    seqs = at.number_input[0]
    seqs.set_value(2).run()
    assert not at.exception, at.exception
    fewer = _table(at)
    p = predict(rec, parse_whatif("max_num_seqs=2"), slo)
    assert fewer["ttft_p50_ms"].iloc[1] == pytest.approx(p.summary["ttft_p50_ms"])
    assert fewer["ttft_p50_ms"].iloc[1] > df["ttft_p50_ms"].iloc[1]
    at.number_input[0].set_value(int(rec.config.max_num_seqs))
    at.number_input[3].set_value(1.5).run()  # every step half as long again
    assert not at.exception, at.exception
    slower = _table(at)
    p = predict(rec, parse_whatif("step_time=1.5"), slo)
    assert slower["itl_p50_ms"].iloc[1] == pytest.approx(p.summary["itl_p50_ms"])
    assert slower["itl_p50_ms"].iloc[1] > 1.3 * df["itl_p50_ms"].iloc[1]
    rec.con.close()


def test_the_knee_is_the_last_rate_before_goodput_falls():
    assert knee([1, 2, 3, 4], [0.9, 0.88, 0.7, 0.1]) == 2
    assert knee([1, 2], [0.5, 0.5]) is None
    assert knee([1, 2], [0.0, 0.0]) is None


def test_the_capacity_section_is_the_plans_capacity_under_the_sidebars_slos(monkeypatch):
    at = _page(monkeypatch)
    # the default SLOs (TTFT 2 s, ITL p99 200 ms): this recording's whole prefills miss them at
    # any rate, and the page says so in the plan's words
    rec = open_recording(RECORDING)
    try:
        with pytest.raises(NoRateMeets) as exc:
            capacity(rec, parse_slo(p99_slo(2000.0, 200.0)))
        assert [w.value for w in at.warning] == [str(exc.value)]
        # bounds it can meet, set in the sidebar
        at.number_input(key="tm_slo_ttft").set_value(10000.0)
        at.number_input(key="tm_slo_itl").set_value(3000.0).run()
        assert not at.exception, at.exception
        cap = capacity(rec, parse_slo(p99_slo(10000.0, 3000.0)))
    finally:
        rec.con.close()
    shown = {m.label: m.value for m in at.metric}
    assert shown["requests/s within the SLO"] == f"{cap['capacity_rate_per_s']:.2f}"
    assert shown["concurrent users"] == f"{cap['concurrent_users']:.1f}"
    miss = cap.get("first_miss")
    assert shown["binds first"] == (miss["binds"] if miss else "none in range")
    assert not at.warning
