"""The diagnoser's generalization on the factorial corpus (``bench/factorial.py``): the metrics
``benchmarks/diagnosis_generalization.py`` reports, as pure functions over per-run rows.

A row is one diagnosed run (:func:`row`): its id, shape, fault, magnitude, expected rules, the
findings' rules in rank order, the inconclusive items, and its **effect size**: how much worse
the fault made the run than the shape's healthy twin (:func:`effect`: the largest of the
run/twin ratios of the decode-only step time p50, TTFT p99 and ITL p99, each measured over the
fault's window, :func:`measure`). :func:`summarize` gives

- top-1 accuracy over the faulted runs, overall and per shape;
- the healthy twins with any finding (there should be none), by id;
- recall (an expected rule among the findings at all) and top-1 at each magnitude;
- a confusion matrix: fault → the first finding's rule, ``healthy`` (no finding, nothing
  inconclusive) or ``inconclusive-only`` (no finding, some rule could not judge);
- recall per effect-size bucket (:data:`EFFECT_BUCKETS`; ``unknown`` without a twin).

The blind set (``benchmarks/blind_set/``, situations written apart from the rules and recorded
with ``blind.py --record DIR``) is scored beside it: :func:`blind_row`, :func:`summarize_blind`.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from tokenmill.telemetry.schema import COMPLETED_SQL, DECODE_ONLY_STEP_SQL

from .factorial import MAGNITUDES

# (upper bound, name); a ratio falls in the first bucket whose bound it is below
EFFECT_BUCKETS = ((1.3, "<1.3"), (2.0, "1.3-2"), (4.0, "2-4"), (float("inf"), ">4"))
UNKNOWN = "unknown"
HEALTHY = "healthy"
INCONCLUSIVE_ONLY = "inconclusive-only"
METRICS = ("decode_step_p50_ms", "ttft_p99_ms", "itl_p99_ms")


def effect_bucket(ratio: float | None) -> str:
    """The bucket of an effect-size ratio (``unknown`` for None)."""
    if ratio is None:
        return UNKNOWN
    for bound, name in EFFECT_BUCKETS:
        if ratio < bound:
            return name
    return EFFECT_BUCKETS[-1][1]


def twin_id(label: dict) -> str | None:
    """The id of a faulted run's healthy twin (None for a twin itself)."""
    return None if label.get("fault") is None else f"f-{label['shape']}-healthy"


def match_twins(labels: list[dict]) -> dict[str, str | None]:
    """Each faulted run's twin among ``labels`` (same shape, no fault), or None when the corpus
    does not hold it."""
    twins = {lb["shape"]: lb["id"] for lb in labels if lb.get("fault") is None}
    return {lb["id"]: twins.get(lb["shape"]) for lb in labels if lb.get("fault") is not None}


def window_ns(label: dict, relative_to: dict | None = None) -> tuple[int, int] | None:
    """The fault's window of ``label`` in wall-clock ns, laid on ``relative_to``'s clock (its
    twin: the same seconds after its first bench step), or None without one."""
    win = label.get("fault_window_s")
    anchor = (relative_to or label).get("steps_started_ns")
    if not win or anchor is None:
        return None
    return anchor + int(win[0] * 1e9), anchor + int(win[1] * 1e9)


def measure(dump: Path, window: tuple[int, int] | None = None) -> dict[str, float | None]:
    """Decode-only step time p50, TTFT p99 and ITL p99 (ms) of a Parquet dump, over the steps
    started and the requests arrived in ``window`` (ns; None: the whole dump). TTFT and ITL are
    the completed requests' (ITL p99: the 99th percentile of the requests' own ITL p99, as the
    diagnoser takes it)."""
    lo, hi = window or (-(2**62), 2**62)
    con = duckdb.connect()
    try:
        (step,) = con.execute(
            f"SELECT quantile_cont((end_ns - start_ns) / 1e6, 0.5) "
            f"FROM read_parquet('{dump / 'engine_steps.parquet'}') "
            f"WHERE {DECODE_ONLY_STEP_SQL} AND start_ns >= ? AND start_ns < ?",
            [lo, hi],
        ).fetchone()
        ttft, itl = con.execute(
            f"SELECT quantile_cont(ttft_ms, 0.99), quantile_cont(itl_p99_ms, 0.99) "
            f"FROM read_parquet('{dump / 'requests.parquet'}') "
            f"WHERE {COMPLETED_SQL} AND arrival_ns >= ? AND arrival_ns < ?",
            [lo, hi],
        ).fetchone()
    finally:
        con.close()
    return {"decode_step_p50_ms": step, "ttft_p99_ms": ttft, "itl_p99_ms": itl}


def effect(run: dict | None, twin: dict | None) -> float | None:
    """The largest run/twin ratio over :data:`METRICS` both have (a twin's zero or missing value
    is skipped); None without a twin or any such metric."""
    if not run or not twin:
        return None
    ratios = [
        run[m] / twin[m] for m in METRICS if run.get(m) is not None and twin.get(m) not in (None, 0)
    ]
    return max(ratios) if ratios else None


# a fault's mechanism, seen in the run itself, without reading its diagnosis: a KV pool sized
# to press that held every request anyway (no request preempted, none waited a second for
# admission) carries more traffic, not KV pressure, and is scored apart
_KV_PRESSED_SQL = """
SELECT coalesce(sum(preemptions), 0) > 0 OR coalesce(max(queue_ms), 0) >= 1000
FROM read_parquet('{dump}/requests.parquet')
"""


def manifested(label: dict, dump: Path) -> bool:
    """Whether the run's fault took effect by its own mechanism (only ``kv_pressure`` can fail
    to: its pool is sized from estimates of the traffic; every other fault is there by
    construction)."""
    if label.get("fault") != "kv_pressure":
        return True
    con = duckdb.connect()
    try:
        return bool(con.execute(_KV_PRESSED_SQL.format(dump=dump)).fetchone()[0])
    finally:
        con.close()


def row(label: dict, result, effect_ratio: float | None = None, took_effect: bool = True) -> dict:
    """One diagnosed run (``result``: ``bench/accuracy.py``'s ``RunResult``) as a row;
    ``took_effect``: :func:`manifested`."""
    return {
        "id": label["id"],
        "shape": label["shape"],
        "fault": label.get("fault"),
        "magnitude": label.get("magnitude"),
        "expect": list(label["expect"]),
        "findings": [rule for rule, _ in result.findings],
        "inconclusive": list(result.inconclusive),
        "effect": effect_ratio,
        "manifested": took_effect,
    }


def first_column(r: dict) -> str:
    """A run's confusion-matrix column: its first finding's rule, else ``healthy`` or
    ``inconclusive-only``."""
    if r["findings"]:
        return r["findings"][0]
    return INCONCLUSIVE_ONLY if r["inconclusive"] else HEALTHY


def confusion(rows: list[dict]) -> dict[str, dict[str, int]]:
    """``{fault: {column: runs}}`` over the faulted rows (:func:`first_column`)."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["fault"] is None:
            continue
        cell = out.setdefault(r["fault"], {})
        col = first_column(r)
        cell[col] = cell.get(col, 0) + 1
    return {f: dict(sorted(c.items())) for f, c in sorted(out.items())}


def _hit(r: dict) -> bool:
    return bool(set(r["findings"]) & set(r["expect"]))


def _top1(r: dict) -> bool:
    return bool(r["findings"]) and r["findings"][0] in r["expect"]


def _rate(rows: list[dict], ok) -> dict:
    n = len(rows)
    k = sum(ok(r) for r in rows)
    return {"runs": n, "right": k, "share": k / n if n else None}


def summarize(rows: list[dict]) -> dict:
    """The metrics of the module docstring over ``rows`` (one split); faulted runs whose fault
    did not take effect (:func:`manifested`) are listed apart and left out of every rate."""
    unmanifested = [r["id"] for r in rows if not r.get("manifested", True)]
    rows = [r for r in rows if r.get("manifested", True)]
    faulted = [r for r in rows if r["fault"] is not None]
    twins = [r for r in rows if r["fault"] is None]
    shapes = sorted({r["shape"] for r in faulted})
    buckets = [name for _, name in EFFECT_BUCKETS] + [UNKNOWN]
    return {
        "runs": len(rows),
        "faulted_runs": len(faulted),
        "twins": len(twins),
        "fault_did_not_take_effect": unmanifested,
        "top1": _rate(faulted, _top1),
        "recall": _rate(faulted, _hit),
        "top1_by_shape": {s: _rate([r for r in faulted if r["shape"] == s], _top1) for s in shapes},
        "twins_with_findings": {r["id"]: r["findings"] for r in twins if r["findings"]},
        "by_magnitude": {
            m: {
                "recall": _rate([r for r in faulted if r["magnitude"] == m], _hit),
                "top1": _rate([r for r in faulted if r["magnitude"] == m], _top1),
            }
            for m in MAGNITUDES
        },
        "confusion": confusion(rows),
        "recall_by_effect": {
            b: _rate([r for r in faulted if effect_bucket(r["effect"]) == b], _hit) for b in buckets
        },
    }


def blind_row(label: dict, result) -> dict:
    """A blind-set run (``benchmarks/blind_set/``, recorded with ``blind.py --record``): no
    shape, magnitude or twin; its "fault" is the first rule it expects (None: healthy)."""
    return {
        "id": label["id"],
        "shape": "blind",
        "fault": label["expect"][0] if label["expect"] else None,
        "magnitude": None,
        "expect": list(label["expect"]),
        "findings": [rule for rule, _ in result.findings],
        "inconclusive": list(result.inconclusive),
        "effect": None,
    }


def summarize_blind(rows: list[dict]) -> dict:
    """The blind set's metrics: top-1 and recall over its faulted situations, the healthy ones
    with any finding, the confusion matrix by first expected rule, and each situation's line."""
    faulted = [r for r in rows if r["fault"] is not None]
    healthy = [r for r in rows if r["fault"] is None]
    return {
        "runs": len(rows),
        "faulted_runs": len(faulted),
        "healthy_runs": len(healthy),
        "top1": _rate(faulted, _top1),
        "recall": _rate(faulted, _hit),
        "healthy_with_findings": {r["id"]: r["findings"] for r in healthy if r["findings"]},
        "confusion": confusion(rows),
        "situations": {
            r["id"]: {
                "expect": r["expect"],
                "first": first_column(r),
                "right": _top1(r) if r["expect"] else not r["findings"],
            }
            for r in rows
        },
    }


def _confusion_md(conf: dict, head: str) -> list[str]:
    if not conf:
        return []
    cols = sorted({c for row_ in conf.values() for c in row_})
    lines = ["", f"| {head} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for f, row_ in conf.items():
        lines.append(f"| {f} | " + " | ".join(str(row_.get(c, "")) for c in cols) + " |")
    return lines


def markdown_blind(summary: dict) -> str:
    """The blind set's tables."""
    pct = lambda v: "–" if v is None else f"{v:.0%}"  # noqa: E731
    cell = lambda m: f"{m['right']}/{m['runs']} ({pct(m['share'])})"  # noqa: E731
    hw = summary["healthy_with_findings"]
    lines = [
        f"Blind set: {summary['runs']} situations ({summary['faulted_runs']} faulted, "
        f"{summary['healthy_runs']} healthy). Top-1 {cell(summary['top1'])}; recall "
        f"{cell(summary['recall'])}; healthy with a finding: {len(hw)}"
        + ("" if not hw else " (" + "; ".join(f"{k}: {', '.join(v)}" for k, v in hw.items()) + ")")
        + ".",
        "",
        "| situation | expected | first finding | right |",
        "|---|---|---|---|",
    ]
    for k, v in summary["situations"].items():
        exp = ", ".join(v["expect"]) or "healthy"
        lines.append(f"| {k} | {exp} | {v['first']} | {'yes' if v['right'] else 'no'} |")
    lines += _confusion_md(summary["confusion"], "expected")
    return "\n".join(lines) + "\n"


def markdown(summary: dict, split: str) -> str:
    """The summary's tables."""
    pct = lambda v: "–" if v is None else f"{v:.0%}"  # noqa: E731
    cell = lambda m: f"{m['right']}/{m['runs']} ({pct(m['share'])})"  # noqa: E731
    tw = summary["twins_with_findings"]
    lines = [
        f"Split **{split}**: {summary['runs']} runs ({summary['faulted_runs']} faulted, "
        f"{summary['twins']} healthy twins). Top-1 {cell(summary['top1'])}; recall "
        f"{cell(summary['recall'])}; healthy twins with a finding: {len(tw)}"
        + ("" if not tw else " (" + "; ".join(f"{k}: {', '.join(v)}" for k, v in tw.items()) + ")")
        + "."
        + (
            f" Left out, their fault did not take effect: {', '.join(gone)}."
            if (gone := summary.get("fault_did_not_take_effect"))
            else ""
        ),
        "",
        "| shape | top-1 |",
        "|---|---|",
    ]
    lines += [f"| {s} | {cell(m)} |" for s, m in summary["top1_by_shape"].items()]
    lines += ["", "| magnitude | recall | top-1 |", "|---|---|---|"]
    for m, v in summary["by_magnitude"].items():
        lines.append(f"| {m} | {cell(v['recall'])} | {cell(v['top1'])} |")
    lines += ["", "| effect vs twin | recall |", "|---|---|"]
    lines += [f"| {b} | {cell(v)} |" for b, v in summary["recall_by_effect"].items()]
    lines += _confusion_md(summary["confusion"], "fault")
    return "\n".join(lines) + "\n"
