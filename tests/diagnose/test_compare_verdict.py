"""``diagnose.compare.compare`` on hand-set figures: when a goodput drop is a regression.

The real-engine runs of ``test_compare.py`` cover the whole report; here one rule is pinned
with figures from a CI run of identical runs (TTFT p50 +33 %, p99 +57 %, goodput from 92 % to
48 % of the requests), which must not read as a regression, beside the same goodput drop with
the median TTFT moved beyond the threshold, which must. The host-speed check is pinned the same
way: the same config with its decode step 17 % slower is not comparable; with a flag changed,
the same figures are the change's evidence.
"""

from __future__ import annotations

from tokenmill.diagnose.compare import DEFAULT_REGRESSION_PCT, Run, compare


def run(
    label: str,
    *,
    ttft_p50: float,
    ttft_p99: float,
    goodput: float,
    errors: float = 0.0,
    steps: dict | None = None,
    config: dict | None = None,
):
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
    host = {"cpu_left_pct": 95.0, "decode_steps": steps or {}}
    return Run(label, 0, 10**10, 10.0, traffic, lat, tput, {}, host, config or {}, {}, {}, [])


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


# the failing CI pair (module docstring of diagnose.compare): same flags, same CPU left, the
# 12-sequence decode step 75.6 -> 88.3 ms, TTFT p50 +83 %
STEPS_BEFORE = {6: [2, 72.6], 12: [60, 75.6]}
STEPS_AFTER = {11: [2, 81.1], 12: [60, 88.3]}
CONFIG = {"max_num_seqs": 64, "versions": {"tokenmill": "0.3.0"}}


def _slow_host_pair(after_config: dict):
    before = run("b", ttft_p50=1234.0, ttft_p99=2400.0, goodput=0.28, steps=STEPS_BEFORE,
                 config=CONFIG)  # fmt: skip
    after = run("a", ttft_p50=2259.0, ttft_p99=2770.0, goodput=0.04, steps=STEPS_AFTER,
                config=after_config)  # fmt: skip
    return compare(before, after)


def test_same_config_with_slower_steps_is_not_comparable_not_a_regression():
    c = _slow_host_pair(CONFIG)
    assert c.verdict == "not_comparable" and c.regressions == []
    step = next(x for x in c.checks if x.key == "decode_step_ms")
    assert not step.ok and step.before == 75.6 and step.after == 88.3  # batch 12: most steps
    assert "batch 12" in step.label and round(step.change) == 17


def test_a_config_change_keeps_its_slower_steps_as_evidence():
    c = _slow_host_pair({**CONFIG, "max_num_seqs": 8})
    assert all(x.key != "decode_step_ms" for x in c.checks)
    assert c.verdict == "regression" and [s.key for s in c.regressions] == ["goodput_per_s"]


def test_too_few_common_steps_skip_the_host_speed_check():
    before = run("b", ttft_p50=1.0, ttft_p99=2.0, goodput=1.0, steps={12: [9, 70.0]},
                 config=CONFIG)  # fmt: skip
    after = run("a", ttft_p50=1.0, ttft_p99=2.0, goodput=1.0, steps={12: [60, 140.0]},
                config=CONFIG)  # fmt: skip
    c = compare(before, after)
    assert all(x.key != "decode_step_ms" for x in c.checks) and c.verdict == "no_regression"
