"""The diagnoser on the factorial corpus (benchmarks/data/factorial_corpus, ``make factorial``) and
the blind sets' recorded runs (benchmarks/data/blind_set and blind_set_2, ``make blind-set``),
real-engine dumps:
the figures of benchmarks/RESULTS.md as floors, so a change that loses a run, or names something
on healthy traffic, fails here. The full report with effect sizes and the confusion matrix is
``benchmarks/diagnosis_generalization.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.accuracy import evaluate_run
from tokenmill.bench.corpus import load_runs
from tokenmill.bench.generalization import manifested

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
FACTORIAL = [(lb, d) for lb, d in load_runs(DATA / "factorial_corpus") if "shape" in lb]
BLIND = load_runs(DATA / "blind_set")
BLIND_2 = load_runs(DATA / "blind_set_2")
# a KV pool sized to press that held every request: more traffic, not KV pressure
UNMANIFESTED = {label["id"] for label, dump in FACTORIAL if not manifested(label, dump)}
SECOND_BLIND = {label["id"] for label, _ in BLIND_2}

pytestmark = pytest.mark.skipif(
    not FACTORIAL or not BLIND or not BLIND_2, reason="no factorial corpus or blind set recorded"
)


@pytest.fixture(scope="module")
def results():
    return {
        label["id"]: (label, evaluate_run(label, dump, time_to_detect=False))
        for label, dump in FACTORIAL + BLIND + BLIND_2
    }


def _first(res) -> str | None:
    return res.findings[0][0] if res.findings else None


def test_no_finding_on_healthy_traffic_of_any_shape(results):
    """Every shape's healthy twin and every healthy blind situation. Before: three, each a prompt
    of several hundred tokens now and then stalling the streams beside it for under a second
    (1-6% of their decode time), read as prefill interference; now inconclusive at most."""
    named = {
        rid: [f for f, _ in res.findings]
        for rid, (label, res) in results.items()
        if not label["expect"] and res.findings
    }
    assert not named, named
    _, res = results["f-mixed-healthy"]
    assert res.inconclusive == ["itl_prefill_interference"], res.inconclusive


def test_the_tune_shapes_at_moderate_and_severe_magnitude(results):
    misses = {
        rid: (label["expect"], _first(res))
        for rid, (label, res) in results.items()
        if label.get("split") == "tune"
        and label.get("magnitude") in ("moderate", "severe")
        and rid not in UNMANIFESTED
        and _first(res) not in label["expect"]
    }
    assert not misses, misses
    # the pools that never pressed are the ones left out, no more
    assert {"f-procs-kv_pressure-moderate", "f-tenants-kv_pressure-severe"} <= UNMANIFESTED
    assert not any(
        "kv_pressure-severe" in r for r in UNMANIFESTED - {"f-tenants-kv_pressure-severe"}
    )


def test_a_periodic_job_on_every_tune_shape_and_never_on_aperiodic_runs(results):
    """The job read from the host's own samples (bursts of outside CPU on one period) where its
    stalls hide among a changing batch; and no stall of traffic, a starting client or a
    sustained neighbour read as one."""
    tune = [(label, res) for label, res in results.values() if label.get("split") == "tune"]
    periodic = [(label, res) for label, res in tune if label.get("fault") == "periodic"]
    assert len(periodic) == 8
    assert all(_first(res) == "periodic_itl_spikes" for _, res in periodic), [
        (label["id"], res.findings) for label, res in periodic
    ]
    wrongly = [
        label["id"]
        for label, res in tune
        if label.get("fault") != "periodic" and _first(res) == "periodic_itl_spikes"
    ]
    assert not wrongly, wrongly


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


def _top1(pairs) -> list[str]:
    return [label["id"] for label, res in pairs if _first(res) in label["expect"]]


def test_the_blind_sets(results):
    """The second set, scored once after the last change (benchmarks/RESULTS.md: 10 of 12), and
    the first, tuning material since it was scored (14 of 16): floors."""
    first = [
        (label, res)
        for rid, (label, res) in results.items()
        if label.get("split") == "blind" and rid not in SECOND_BLIND and label["expect"]
    ]
    second = [
        (label, res)
        for rid, (label, res) in results.items()
        if rid in SECOND_BLIND and label["expect"]
    ]
    assert len(_top1(first)) >= 14, sorted({lb["id"] for lb, _ in first} - set(_top1(first)))
    assert len(_top1(second)) >= 10, sorted({lb["id"] for lb, _ in second} - set(_top1(second)))


def test_the_held_out_shapes_as_scored(results):
    """Two data-parallel replicas, prefill/decode disaggregation and an open-loop mix of short
    chats and long prompts, never tuned on, scored once (benchmarks/RESULTS.md: top-1 14 of 17,
    recall 16 of 17; now 15, as one data-parallel replica's two long prompts in 47 s cost its
    streams 3% of their decode time, under min_stall_share: inconclusive): a floor."""
    held = [(label, res) for label, res in results.values() if label.get("split") == "heldout"]
    faulted = [
        (label, res) for label, res in held if label["expect"] and label["id"] not in UNMANIFESTED
    ]
    top1 = sum(_first(res) in label["expect"] for label, res in faulted)
    named = sum(any(f in label["expect"] for f, _ in res.findings) for label, res in faulted)
    assert len(faulted) == 17 and top1 >= 14 and named >= 15, (top1, named, len(faulted))
    _, res = results["f-dp-prefill_interference-mild"]
    assert res.inconclusive == ["itl_prefill_interference"], res.inconclusive
