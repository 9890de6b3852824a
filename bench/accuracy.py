"""Score the diagnoser on the labelled corpus (``bench/corpus.py``) as one scores a model.

For each run: the diagnosis of its dump (the run's own window length), its top finding, every
finding with its confidence, the inconclusive items, and the time to detect: the dump is
diagnosed again as a live store would have stood at each window's end (:func:`store_as_of`:
only what had ended or been sampled by then), and the first such time at which one of the run's
expected rules fires, less the fault's start, is the time to detect. In windows it counts
the window the fault began in as the first (a fault present before the first request arrived,
such as a prefix cache off for the whole run, begins with the dump's first window).

Metrics (:func:`score`), over one split:

- **top-1 accuracy** over faulted runs: the top finding is one of the run's expected rules;
- **per rule** precision (of the runs where the rule fired, the share that expected it),
  recall (of the runs whose family's first expected rule it is, the share where it fired) and
  top-1 (the share of those where it came first);
- **healthy false-finding rate**: healthy runs with at least one finding, and findings per run;
- **time to detect**: median and worst, seconds and windows;
- **reliability** (calibration): findings binned by the confidence they reported, and the
  share of each bin that was right (its rule expected by the run).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.live_replay import store_as_of
from tokenmill.diagnose.signals import NoTraffic
from tokenmill.telemetry.dump import open_dump, parse_duration

CONFIDENCE_BINS = (0.0, 0.6, 0.7, 0.8, 0.9, 1.01)


@dataclass
class RunResult:
    id: str
    family: str
    split: str
    expect: list[str]
    top: str | None
    findings: list[tuple[str, float]]  # (rule, confidence), ranked
    inconclusive: list[str]
    notes: list[str]
    detect_s: float | None = None
    detect_windows: int | None = None
    errors: dict = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not self.expect

    @property
    def correct(self) -> bool:
        return self.top is None if self.healthy else self.top in self.expect

    def to_json(self) -> dict:
        return dict(self.__dict__, correct=self.correct)


def evaluate_run(label: dict, dump: Path, *, time_to_detect: bool = True) -> RunResult:
    """Diagnose one corpus run (and, for a faulted run, find its time to detect)."""
    window_s = parse_duration(label.get("window", "5s"))
    con = open_dump(dump, verify=False)
    try:
        report = diagnose(con, window_s=window_s)
        res = RunResult(
            id=label["id"],
            family=label["family"],
            split=label["split"],
            expect=list(label["expect"]),
            top=report.findings[0].rule_id if report.findings else None,
            findings=[(f.rule_id, f.confidence) for f in report.findings],
            inconclusive=[f.rule_id for f in report.inconclusive],
            notes=[n.rule_id for n in report.notes],
            errors=report.rule_errors,
        )
        fault = label.get("fault_start_ns")
        if time_to_detect and res.expect and fault is not None and report.findings:
            w_ns = int(window_s * 1e9)
            k = 1
            while report.start_ns + k * w_ns < report.end_ns + w_ns:
                cut = min(report.start_ns + k * w_ns, report.end_ns)
                k += 1
                if cut <= fault:
                    continue
                live = store_as_of(con, cut)
                try:
                    part = diagnose(live, window_s=window_s)
                except NoTraffic:
                    continue
                finally:
                    live.close()
                if any(f.rule_id in res.expect for f in part.findings):
                    res.detect_s = (cut - fault) / 1e9
                    # counted from the window the fault began in; a fault there from the
                    # start (before the first request arrived) begins with the first window
                    res.detect_windows = math.ceil((cut - max(fault, report.start_ns)) / w_ns)
                    break
        return res
    finally:
        con.close()


def _share(a: int, b: int) -> float | None:
    return a / b if b else None


def score(results: list[RunResult]) -> dict:
    """The metrics of the module docstring over ``results`` (one split)."""
    faulted = [r for r in results if not r.healthy]
    healthy = [r for r in results if r.healthy]
    rules = sorted(
        {r.expect[0] for r in faulted} | {rule for r in results for rule, _ in r.findings}
    )
    per_rule = {}
    for rule in rules:
        fired = [r for r in results if rule in {x for x, _ in r.findings}]
        positives = [r for r in faulted if r.expect[0] == rule]
        per_rule[rule] = {
            "runs_expecting": len(positives),
            "fired": len(fired),
            "precision": _share(sum(rule in r.expect for r in fired), len(fired)),
            "recall": _share(
                sum(rule in {x for x, _ in r.findings} for r in positives), len(positives)
            ),
            "top1": _share(sum(r.top == rule for r in positives), len(positives)),
        }
    detect = [r.detect_s for r in faulted if r.detect_s is not None]
    detect_w = [r.detect_windows for r in faulted if r.detect_windows is not None]
    bins = []
    for lo, hi in itertools.pairwise(CONFIDENCE_BINS):
        inside = [rule in r.expect for r in results for rule, c in r.findings if lo <= c < hi]
        bins.append(
            {
                "confidence": f"{lo:.1f}–{min(hi, 1.0):.1f}",
                "findings": len(inside),
                "right": sum(inside),
                "share_right": _share(sum(inside), len(inside)),
            }
        )
    high = [rule in r.expect for r in results for rule, c in r.findings if c >= 0.8]
    families = sorted({r.family for r in results})
    return {
        "runs": len(results),
        "faulted_runs": len(faulted),
        "healthy_runs": len(healthy),
        "families": {
            f: {
                "runs": sum(r.family == f for r in results),
                "correct": sum(r.correct for r in results if r.family == f),
            }
            for f in families
        },
        "top1_accuracy": _share(sum(r.correct for r in faulted), len(faulted)),
        "healthy_false_finding_rate": _share(sum(bool(r.findings) for r in healthy), len(healthy)),
        "healthy_findings_per_run": _share(sum(len(r.findings) for r in healthy), len(healthy)),
        "per_rule": per_rule,
        "time_to_detect_s": {
            "median": statistics.median(detect) if detect else None,
            "max": max(detect) if detect else None,
            "detected": len(detect),
        },
        "time_to_detect_windows": {
            "median": statistics.median(detect_w) if detect_w else None,
            "max": max(detect_w) if detect_w else None,
        },
        "reliability": bins,
        "high_confidence_share_right": _share(sum(high), len(high)),
        "high_confidence_findings": len(high),
        "inconclusive_items": sum(len(r.inconclusive) for r in results),
    }


def markdown(summary: dict, split: str) -> str:
    """The tables RESULTS.md carries."""
    pct = lambda v: "–" if v is None else f"{v:.0%}"  # noqa: E731
    lines = [
        f"Split **{split}**: {summary['runs']} runs ({summary['faulted_runs']} faulted, "
        f"{summary['healthy_runs']} healthy). Top-1 accuracy {pct(summary['top1_accuracy'])}; "
        f"healthy runs with a finding {pct(summary['healthy_false_finding_rate'])}; time to "
        f"detect median {summary['time_to_detect_windows']['median']} window(s), worst "
        f"{summary['time_to_detect_windows']['max']}; inconclusive items "
        f"{summary['inconclusive_items']}.",
        "",
        "| rule | runs expecting | fired | precision | recall | top-1 |",
        "|---|---|---|---|---|---|",
    ]
    for rule, m in summary["per_rule"].items():
        lines.append(
            f"| {rule} | {m['runs_expecting']} | {m['fired']} | {pct(m['precision'])} | "
            f"{pct(m['recall'])} | {pct(m['top1'])} |"
        )
    lines += ["", "| confidence | findings | right | share right |", "|---|---|---|---|"]
    for b in summary["reliability"]:
        lines.append(
            f"| {b['confidence']} | {b['findings']} | {b['right']} | {pct(b['share_right'])} |"
        )
    lines += ["", "| family | runs | correct |", "|---|---|---|"]
    for f, m in summary["families"].items():
        lines.append(f"| {f} | {m['runs']} | {m['correct']} |")
    return "\n".join(lines) + "\n"


def run_meta(split: str, corpus, started: float) -> dict:
    """The head of a scoring's results JSON: date, split, corpus, machine and seconds since
    ``started`` (``time.monotonic()``)."""
    import platform
    import time
    from datetime import UTC, datetime

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "split": split,
        "corpus": str(corpus),
        "machine": platform.processor() or platform.machine(),
        "seconds": round(time.monotonic() - started, 1),
    }
