"""A plan held to the run that made it real (``tokenmill plan RECORDING --what-if X --check
RUN``).

Once a what-if has run for real, its store says how close the plan came, and why not: each
summary metric's error; the run's pace (its working steps' time over the step costs the plan
priced them at, :meth:`StepCostModel.pace`: x1.2 is a host that took 20% longer for the same
steps); and the what-if planned again with ``step_time`` at that pace. What the pace takes away
came from the host running slower or faster than the recorded one; what is left is the
replay's own error (its scheduling, batching, queueing, preemption and routing).
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from .predict import (
    PlanError,
    Prediction,
    Recording,
    errors_pct,
    predict,
    setup_for,
    summarize_rows,
)
from .whatif import STEP_TIME_RANGE, SloBounds, WhatIf, parse_whatif


def at_pace(whatif: WhatIf, pace: float) -> WhatIf:
    """``whatif`` on a host at ``pace`` (its own ``step_time``, if any, times it)."""
    parts = [
        p for p in whatif.text.split(",")
        if p.strip() and p.partition("=")[0].strip().replace("-", "_") != "step_time"
    ]  # fmt: skip
    step_time = float(whatif.changes.get("step_time", 1.0)) * pace
    return parse_whatif(",".join([*parts, f"step_time={step_time:.4g}"]))


def open_run(path: Path) -> duckdb.DuckDBPyConnection:
    """The run's store, open for :func:`check`.

    Raises:
        PlanError: it does not open as a store or dump (one line).
    """
    from tokenmill.telemetry.dump import DumpError, open_dump

    try:
        return open_dump(path, verify=False)
    except DumpError as exc:
        raise PlanError(f"--check: {exc}") from None


def check(
    rec: Recording,
    planned: Prediction,
    slo: SloBounds,
    con: duckdb.DuckDBPyConnection,
    run: str,
    *,
    cost_models: dict | None = None,
    fast_forward: bool = True,
) -> dict:
    """``planned`` (a prediction from ``rec``) against the real run in the open store ``con``
    (:func:`open_run`; ``run`` names it).

    Raises:
        PlanError: the run holds no requests, or its tables do not read (one line).
    """
    try:
        n, first_ns, last_ns = con.execute(
            "SELECT count(*), min(arrival_ns), max(arrival_ns) FROM requests"
        ).fetchone()
        if not n:
            raise PlanError(f"--check {run}: the store holds no requests")
        real = summarize_rows(con, slo)
        (pre,) = con.execute("SELECT coalesce(sum(preemptions), 0) FROM requests").fetchone()
        _, _, model, _ = setup_for(rec, planned.whatif, cost_models)
        pace = model.pace(con)
    except duckdb.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PlanError(f"--check {run}: cannot read the store ({first})") from None
    notes = []
    planned_rate = planned.setup["rate_per_s"]
    real_rate = (n - 1) / ((last_ns - first_ns) / 1e9) if n > 1 and last_ns > first_ns else None
    if planned_rate and real_rate and not 0.8 < real_rate / planned_rate < 1.25:
        notes.append(
            f"the run's requests arrived at {real_rate:.3g}/s and the plan's at "
            f"{planned_rate:.3g}/s: was the run fed the what-if's traffic?"
        )
    if n != planned.replay["requests"]:
        notes.append(
            f"the run measured {n:,} requests and the plan replayed "
            f"{planned.replay['requests']:,}: was the run fed the what-if's traffic?"
        )
    factor = pace["factor"]
    step_time = factor and factor * float(planned.whatif.changes.get("step_time", 1.0))
    if factor is None:
        notes.append("the run holds no working engine steps with a duration: its pace is unknown")
    elif not STEP_TIME_RANGE[0] <= step_time <= STEP_TIME_RANGE[1]:
        notes.append(
            f"the run's steps took x{factor:.3g} the priced time, past the "
            f"{STEP_TIME_RANGE[0]:g}-{STEP_TIME_RANGE[1]:g} a replay takes: not replayed at it"
        )
        factor = None
    out = {
        "run": run,
        "what_if": planned.whatif.label,
        "requests": {"measured": real["requests"], "planned": planned.replay["requests"]},
        "measured": real,
        "predicted": planned.summary,
        "errors_pct": errors_pct(planned.summary, real),
        "preemptions": {"predicted": planned.replay["preemptions"], "measured": int(pre)},
        "pace": pace["factor"],
        "pace_steps": pace["steps"],
        "at_pace": None,
        "notes": notes,
    }
    if factor is not None:
        again = predict(
            rec, at_pace(planned.whatif, factor), slo,
            cost_models=cost_models, fast_forward=fast_forward, with_band=False,
        )  # fmt: skip
        out["at_pace"] = {
            "what_if": again.whatif.label,
            "summary": again.summary,
            "errors_pct": errors_pct(again.summary, real),
            "preemptions": again.replay["preemptions"],
        }
    return out


__all__ = ["at_pace", "check", "open_run"]
