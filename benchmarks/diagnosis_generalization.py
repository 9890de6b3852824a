"""The diagnoser on traffic it was not tuned on: the factorial corpus (shape × fault ×
magnitude, and a healthy twin of every shape).

    python benchmarks/diagnosis_generalization.py --corpus DIR [--split heldout|tune|all]
        [--blind DIR]

The corpus is made by ``make factorial`` (``python -m tokenmill.bench.factorial --out DIR``,
each run on the real engine, alone on the machine). Each run's dump is diagnosed as
``diagnosis_accuracy.py`` does (``bench/accuracy.py``'s ``evaluate_run``, in the run's own
window) and its effect size measured against its shape's twin over the fault's window; the
metrics are ``bench/generalization.py``'s. A corpus with only some runs is fine: a run whose
twin is missing has no effect size (``unknown``).

``--blind DIR``: the blind set (``benchmarks/blind_set/``, written apart from the rules,
recorded with ``blind.py --record DIR``: ``DIR/NAME/dump`` and ``label.json``) is diagnosed and
scored too (top-1, recall, healthy situations with findings, each situation's first finding);
``--corpus`` may then hold no factorial run.

Writes ``benchmarks/results/diagnosis_generalization.json`` and prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill.bench.accuracy import evaluate_run, run_meta
from tokenmill.bench.corpus import load_runs
from tokenmill.bench.generalization import (
    blind_row,
    effect,
    manifested,
    markdown,
    markdown_blind,
    match_twins,
    measure,
    row,
    summarize,
    summarize_blind,
    window_ns,
)

ROOT = Path(__file__).resolve().parent
DEFAULT_CORPUS = ROOT / "data" / "factorial_corpus"


def _line(r: dict, ratio: float | None = None) -> str:
    ok = not r["findings"] if not r["expect"] else r["findings"][:1] in [[e] for e in r["expect"]]
    eff = "" if ratio is None else f" effect {ratio:.2f}x"
    return (
        f"{'ok ' if ok else 'MISS'} {r['id']:44s} findings {r['findings']} "
        f"inconclusive {r['inconclusive']}{eff}"
    )


def score_corpus(runs: list[tuple[dict, Path]]) -> list[dict]:
    """Each factorial run diagnosed, with its effect size against its twin."""
    by_id = {label["id"]: (label, dump) for label, dump in runs}
    twins = match_twins([label for label, _ in runs])
    measured: dict[tuple[str, str], dict] = {}

    def metrics(run_id: str, window_of: str) -> dict:
        # a twin is measured over each faulted run's window, on its own clock
        key = (run_id, window_of)
        if key not in measured:
            label, dump = by_id[run_id]
            measured[key] = measure(dump, window_ns(by_id[window_of][0], relative_to=label))
        return measured[key]

    rows = []
    for label, dump in runs:
        res = evaluate_run(label, dump, time_to_detect=False)
        twin = twins.get(label["id"])
        ratio = None
        if twin is not None:
            ratio = effect(metrics(label["id"], label["id"]), metrics(twin, label["id"]))
        rows.append(row(label, res, ratio, manifested(label, dump)))
        print(_line(rows[-1], ratio), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--split", choices=("heldout", "tune", "all"), default="heldout")
    ap.add_argument(
        "--blind", type=Path, metavar="DIR", help="also score the blind set recorded in DIR"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    runs = []
    if a.corpus.is_dir():
        runs = [
            (label, dump)
            for label, dump in load_runs(a.corpus, None if a.split == "all" else a.split)
            if "shape" in label  # a factorial run
        ]
    blind_runs = load_runs(a.blind) if a.blind and a.blind.is_dir() else []
    if a.blind and not blind_runs:
        print(f"error: no recorded blind-set runs under {a.blind}", file=sys.stderr)
        return 2
    if not runs and not blind_runs:
        print(f"error: no factorial runs under {a.corpus} (make factorial)", file=sys.stderr)
        return 2
    t = time.monotonic()
    rows = score_corpus(runs)
    blind_rows = []
    for label, dump in blind_runs:
        blind_rows.append(blind_row(label, evaluate_run(label, dump, time_to_detect=False)))
        print(_line(blind_rows[-1]), flush=True)
    summary = summarize(rows) if rows else None
    blind = summarize_blind(blind_rows) if blind_rows else None
    out = a.out or ROOT / "results" / "diagnosis_generalization.json"
    out.write_text(
        json.dumps(
            {
                **run_meta(a.split, a.corpus, t),
                "summary": summary,
                "runs": rows,
                "blind": None
                if blind is None
                else {"dir": str(a.blind), "summary": blind, "runs": blind_rows},
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print()
    if summary:
        print(markdown(summary, a.split))
    if blind:
        print(markdown_blind(blind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
