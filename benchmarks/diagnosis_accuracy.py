"""The diagnoser's accuracy on the labelled corpus's evaluation split (never used for tuning).

    python benchmarks/diagnosis_accuracy.py [--corpus DIR] [--split eval|tune|all]

The corpus (``benchmarks/data/diagnosis_corpus/``, Parquet dumps with a ``label.json`` each) is
made by ``make corpus`` (``python -m tokenmill.bench.corpus --out DIR``: every family's runs on
the real engine, about a minute each, alone on the machine). Metrics and their definitions:
``bench/accuracy.py``. Writes ``benchmarks/results/diagnosis_accuracy_<split>.json`` and prints
the Markdown tables RESULTS.md carries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill.bench.accuracy import evaluate_run, markdown, run_meta, score
from tokenmill.bench.corpus import load_runs

ROOT = Path(__file__).resolve().parent
DEFAULT_CORPUS = ROOT / "data" / "diagnosis_corpus"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--split", choices=("eval", "tune", "all"), default="eval")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-ttd", action="store_true", help="skip the time-to-detect replays")
    a = ap.parse_args(argv)
    runs = load_runs(a.corpus, None if a.split == "all" else a.split)
    if not runs:
        print(f"error: no corpus runs under {a.corpus} (make corpus)", file=sys.stderr)
        return 2
    t = time.monotonic()
    results = []
    for label, dump in runs:
        r = evaluate_run(label, dump, time_to_detect=not a.no_ttd)
        mark = "ok " if r.correct else "MISS"
        print(
            f"{mark} {r.id:28s} expect {','.join(r.expect) or 'nothing':32s} top {r.top} "
            f"findings {[f for f, _ in r.findings]} inconclusive {r.inconclusive} "
            f"ttd {r.detect_windows}",
            flush=True,
        )
        results.append(r)
    summary = score(results)
    out = a.out or ROOT / "results" / f"diagnosis_accuracy_{a.split}.json"
    out.write_text(
        json.dumps(
            {
                **run_meta(a.split, a.corpus, t),
                "summary": summary,
                "runs": [r.to_json() for r in results],
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print()
    print(markdown(summary, a.split))
    return 0


if __name__ == "__main__":
    sys.exit(main())
