"""``diagnose.compare.compare`` on hand-set figures: when a goodput drop is a regression.

The real-engine runs of ``test_compare.py`` cover the whole report; here one rule is pinned
with figures from a CI run of identical runs (TTFT p50 +33 %, p99 +57 %, goodput from 92 % to
48 % of the requests), which must not read as a regression, beside the same goodput drop with
the median TTFT moved beyond the threshold, which must.
"""

from __future__ import annotations

from tokenmill.diagnose.compare import DEFAULT_REGRESSION_PCT, Run, compare


def run(label: str, *, ttft_p50: float, ttft_p99: float, goodput: float, errors: float = 0.0):
    lat = {
        "ttft_p50_ms": ttft_p50,
        "ttft_p99_ms": ttft_p99,
        "itl_p50_ms": 30.0,
        "itl_p99_ms": 43.0,
        "tpot_p50_ms": 31.0,
        "tpot_p99_ms": 40.0,
        "e2e_p50_ms": 2100.0,
        "e2e_p99_ms": 2900.0,
    }
    traffic = {
        "requests": 24,
        "prompt_tokens_p50": 60,
        "prompt_tokens_p99": 60,
        "output_tokens_p50": 32,
        "output_tokens_p99": 32,
        "arrival_rate_per_s": 4.0,
        "peak_in_flight": 12,
    }
    tput = {
        "throughput_tok_s": 120.0,
        "request_rate_per_s": 1.0,
        "goodput_per_s": goodput,
        "goodput_share": goodput,
        "error_rate": errors,
    }
    host = {"cpu_left_pct": 95.0}
    return Run(label, 0, 10**10, 10.0, traffic, lat, tput, {}, host, {}, {}, {}, [])


def test_goodput_drop_with_only_the_ttft_tail_moved_is_not_a_regression():
    before = run("b", ttft_p50=1171.0, ttft_p99=1800.0, goodput=0.92)
    after = run("a", ttft_p50=1562.0, ttft_p99=1800.0 * 1.57, goodput=0.40)
    c = compare(before, after, threshold_pct=DEFAULT_REGRESSION_PCT)
    goodput = next(s for s in c.throughput if s.key == "goodput_per_s")
    assert goodput.change_pct < -DEFAULT_REGRESSION_PCT and goodput.status == "worse"
    assert c.verdict == "no_regression", [(s.key, s.status) for s in c.regressions]


def test_goodput_drop_with_the_median_ttft_moved_is_a_regression():
    before = run("b", ttft_p50=1171.0, ttft_p99=1800.0, goodput=0.92)
    after = run("a", ttft_p50=1171.0 * 1.6, ttft_p99=1800.0 * 1.2, goodput=0.40)
    c = compare(before, after, threshold_pct=DEFAULT_REGRESSION_PCT)
    assert c.verdict == "regression"
    assert [s.key for s in c.regressions] == ["goodput_per_s"]


def test_goodput_drop_with_more_errors_is_a_regression():
    before = run("b", ttft_p50=1171.0, ttft_p99=1800.0, goodput=0.92)
    after = run("a", ttft_p50=1171.0, ttft_p99=1800.0, goodput=0.40, errors=0.2)
    assert [s.key for s in compare(before, after).regressions] == ["goodput_per_s"]
