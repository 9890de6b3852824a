"""The diagnoser on the factorial corpus (benchmarks/data/factorial_corpus, ``make factorial``) and
the blind set's recorded runs (benchmarks/data/blind_set, ``make blind-set``), real-engine dumps:
the figures of benchmarks/RESULTS.md as floors, so a change that loses a run, or names something
on healthy traffic, fails here. The full report with effect sizes and the confusion matrix is
``benchmarks/diagnosis_generalization.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.accuracy import evaluate_run
from tokenmill.bench.corpus import load_runs

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
FACTORIAL = [(lb, d) for lb, d in load_runs(DATA / "factorial_corpus") if "shape" in lb]
BLIND = load_runs(DATA / "blind_set")

pytestmark = pytest.mark.skipif(
    not FACTORIAL or not BLIND, reason="no factorial corpus or blind set recorded"
)


@pytest.fixture(scope="module")
def results():
    return {
        label["id"]: (label, evaluate_run(label, dump, time_to_detect=False))
        for label, dump in FACTORIAL + BLIND
    }


def _first(res) -> str | None:
    return res.findings[0][0] if res.findings else None


def test_no_finding_on_healthy_traffic_of_any_shape(results):
    """Every shape's healthy twin (clumped arrivals, many client processes, many tenants,
    speculative decoding, int8 weights among them) and the blind set's healthy situations but
    one (int8 chat traffic read as prefill-bound, found when the set was scored)."""
    named = {
        rid: [f for f, _ in res.findings]
        for rid, (label, res) in results.items()
        if not label["expect"] and res.findings
    }
    assert set(named) <= {"healthy_int8_steady"}, named


def test_the_tune_shapes_at_moderate_and_severe_magnitude(results):
    misses = {
        rid: (label["expect"], _first(res))
        for rid, (label, res) in results.items()
        if label.get("split") == "tune"
        and label.get("magnitude") in ("moderate", "severe")
        and _first(res) not in label["expect"]
    }
    assert not misses, misses


def test_causes_ranked_before_their_consequences(results):
    """A system prompt computed again is the root of the prefill stalls it causes; a neighbour
    that slows every step is the root of the backlog it leaves; a backlog that stops every
    completion is overload, its client timeouts the consequence."""
    for rid in ("f-long-prefix_miss-moderate", "f-int8-prefix_miss-severe"):
        _, res = results[rid]
        assert _first(res) == "prefix_cache_miss", (rid, res.findings)
    _, res = results["f-open-neighbour-moderate"]
    assert _first(res) == "host_contention", res.findings
    _, res = results["f-long-overload-severe"]
    assert _first(res) == "overload", res.findings


def test_the_blind_set_as_scored(results):
    """Scored once, after the last change (benchmarks/RESULTS.md): its faulted situations'
    first findings, as a floor."""
    blind = [(label, res) for label, res in results.values() if label.get("split") == "blind"]
    faulted = [(label, res) for label, res in blind if label["expect"]]
    right = [label["id"] for label, res in faulted if _first(res) in label["expect"]]
    assert len(right) >= 12, sorted(set(lb["id"] for lb, _ in faulted) - set(right))


def test_the_held_out_shapes_as_scored(results):
    """Clumped arrivals, many client processes, many tenants and speculative decoding, never
    tuned on, scored once (benchmarks/RESULTS.md: top-1 9 of 23, recall 13 of 23): a floor."""
    held = [(label, res) for label, res in results.values() if label.get("split") == "heldout"]
    faulted = [(label, res) for label, res in held if label["expect"]]
    top1 = sum(_first(res) in label["expect"] for label, res in faulted)
    named = sum(any(f in label["expect"] for f, _ in res.findings) for label, res in faulted)
    assert top1 >= 9 and named >= 13, (top1, named, len(faulted))
