"""The diagnoser on the labelled corpus's evaluation split (benchmarks/data/diagnosis_corpus,
runs of the real engine made by ``make corpus``; never used to choose a threshold): the fixed
slice CI runs. The full report, with time to detect and the reliability table, is
``benchmarks/diagnosis_accuracy.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.accuracy import evaluate_run, score
from tokenmill.bench.corpus import FAMILIES, load_runs

CORPUS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "diagnosis_corpus"
RUNS = load_runs(CORPUS, "eval")

pytestmark = pytest.mark.skipif(not RUNS, reason=f"no corpus under {CORPUS} (make corpus)")


@pytest.fixture(scope="module")
def results():
    return {label["id"]: evaluate_run(label, dump, time_to_detect=False) for label, dump in RUNS}


def test_the_evaluation_split_covers_every_family():
    assert {label["family"] for label, _ in RUNS} == set(FAMILIES)
    assert all(label["split"] == "eval" for label, _ in RUNS)


def test_top1_accuracy_and_no_findings_on_healthy_runs(results):
    """The figures of benchmarks/RESULTS.md (2026-12-03: top-1 17 of 18, no finding on the six
    healthy runs, every finding at 0.8 or more right) as a floor: a change that loses a run
    fails here."""
    summary = score(list(results.values()))
    misses = {r.id: (r.expect, r.top) for r in results.values() if not r.correct}
    assert summary["top1_accuracy"] >= 17 / 18, misses
    assert summary["healthy_false_finding_rate"] == 0, misses
    assert summary["high_confidence_share_right"] >= 0.8, summary["reliability"]
    for rule, m in summary["per_rule"].items():
        if m["runs_expecting"]:
            assert m["recall"] >= 0.5, (rule, m, misses)


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
