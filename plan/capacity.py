"""How much traffic one instance can take: the recorded traffic replayed at rising arrival rates
(:func:`~tokenmill.plan.predict.predict`) until the SLO breaks.

* **capacity**: the highest arrival rate (requests/s) whose replay meets every bound of the
  SLO: doubled up from the recorded rate (or halved down from it) until the SLO's edge lies
  between two rates, then bisected to :data:`RESOLUTION`;
* **concurrent users**: what that rate means for a closed loop of users who send their next
  request when the last one ends (no think time): the requests in the engine at once at that
  rate (running and waiting, the replay's mean over time; Little's law's rate × time inside);
* **the knee**: the last rate before goodput (the share of requests meeting the per-request
  bounds) falls below :data:`~tokenmill.plan.recommend.KNEE_SHARE` of its best;
* **what binds first** at the first rate that misses: the KV cache (requests preempted, or the
  pool full), the queue (every ``max_num_seqs`` slot taken while requests wait) or compute
  (slots and KV to spare, but the steps take longer than the SLO allows);
* **a band**: the same search with every step priced that much cheaper and dearer than the
  fit says, by the fit's median error on held-out steps (a step-cost model off by its typical
  error, either way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .predict import Prediction, Recording, predict
from .recommend import knee
from .step_cost import StepCostModel
from .whatif import SloBounds, WhatIf

#: the points replayed past the first miss (for the goodput curve's fall) are this ratio apart
GRID_STEP = 2**0.25
#: the lowest and highest factor of the recorded rate tried
LOWEST, HIGHEST = 1 / 16, 64.0
#: bisection stops when the two rates are this close (ratio)
RESOLUTION = 1.02
#: a pool at least this full counts as the KV cache binding
KV_FULL = 0.95
#: running requests at this share of max_num_seqs count as every slot taken
SLOTS_FULL = 0.9


class NoRateMeets(ValueError):
    """Even the lowest rate tried misses the SLO (one line)."""


@dataclass
class Point:
    """One replayed rate."""

    factor: float
    rate_per_s: float
    prediction: Prediction

    @property
    def meets(self) -> bool:
        return not self.prediction.slo_misses

    def row(self) -> dict:
        s, r = self.prediction.summary, self.prediction.replay
        return {
            "factor": round(self.factor, 4),
            "rate_per_s": self.rate_per_s,
            "slo_met": self.meets,
            "goodput_share": s.get("goodput_share"),
            "goodput_per_s": (s.get("goodput_share") or 0.0) * self.rate_per_s,
            "ttft_p99_ms": s.get("ttft_p99_ms"),
            "itl_p99_ms": s.get("itl_p99_ms"),
            "tpot_p99_ms": s.get("tpot_p99_ms"),
            "waiting_mean": r["waiting_mean"],
            "running_mean": r["running_mean"],
            "kv_usage_max": r["kv_usage_max"],
            "preemptions": r["preemptions"],
        }


def p99_slo(ttft_ms: float, itl_ms: float) -> str:
    """The ``--slo`` text bounding TTFT p99 and ITL p99 (the console's capacity section: its
    sidebar's per-request bounds as p99s)."""
    return f"ttft_p99<{ttft_ms:g}ms,itl_p99<{itl_ms:g}ms"


def _whatif(factor: float) -> WhatIf:
    return WhatIf(f"rate={factor:g}", {"rate": factor})


def binding(p: Prediction) -> tuple[str, str]:
    """``(resource, why)`` for a replay that misses its SLO: ``kv``, ``queue`` or ``compute``."""
    r, slots = p.replay, p.setup["max_num_seqs"]
    if r["preemptions"] or (r["kv_usage_max"] or 0) >= KV_FULL:
        return "kv", (
            f"the KV pool reached {(r['kv_usage_max'] or 0):.0%} with {r['preemptions']} "
            "preemptions"
        )
    if (r["running_mean"] or 0) >= SLOTS_FULL * slots and (r["waiting_mean"] or 0) > 0:
        return "queue", (
            f"{r['running_mean']:.1f} of {slots} max_num_seqs slots taken on average, "
            f"{r['waiting_mean']:.1f} requests waiting for one"
        )
    return "compute", (
        f"{r['running_mean']:.1f} of {slots} slots taken and the KV pool at most "
        f"{(r['kv_usage_max'] or 0):.0%}: the steps themselves take longer than the SLO allows"
    )


def search(
    rec: Recording,
    slo: SloBounds,
    model: StepCostModel | None = None,
    cost_models: dict[str, StepCostModel] | None = None,
) -> tuple[list[Point], Point | None, Point | None]:
    """Every replayed point (ascending rate), the last that meets ``slo`` and the first that
    misses it (None where none misses up to :data:`HIGHEST`)."""
    base = rec.workload.rate_per_s or 0.0
    if model is not None:
        rec = dataclasses.replace(rec, model=model)
    points: dict[float, Point] = {}

    def at(factor: float) -> Point:
        if factor not in points:
            p = predict(rec, _whatif(factor), slo, cost_models=cost_models, with_band=False)
            points[factor] = Point(factor, base * factor, p)
        return points[factor]

    # bracket the SLO's edge by doubling up from the recorded rate (or halving down from it)
    last_ok = first_miss = None
    if at(1.0).meets:
        last_ok, f = points[1.0], 2.0
        while f <= HIGHEST and at(f).meets:
            last_ok, f = points[f], 2 * f
        first_miss = points.get(f)
    else:
        first_miss, f = points[1.0], 0.5
        while f >= LOWEST and not at(f).meets:
            first_miss, f = points[f], f / 2
        last_ok = points.get(f)
    if last_ok is not None and first_miss is not None:
        lo, hi = last_ok, first_miss
        while hi.factor / lo.factor > RESOLUTION:
            mid = at((lo.factor * hi.factor) ** 0.5)
            lo, hi = (mid, hi) if mid.meets else (lo, mid)
        last_ok, first_miss = lo, hi
    # a few points past the first miss, so that the goodput curve shows its fall
    if first_miss is not None:
        for k in (1, 2, 4):
            if first_miss.factor * GRID_STEP**k <= HIGHEST:
                at(first_miss.factor * GRID_STEP**k)
    return sorted(points.values(), key=lambda p: p.factor), last_ok, first_miss


def capacity(
    rec: Recording, slo: SloBounds, *, cost_models: dict[str, StepCostModel] | None = None
) -> dict:
    """The capacity under ``slo`` (see the module docstring) as a JSON-ready dict.

    Raises:
        ValueError: no SLO bounds.
        NoRateMeets: the lowest rate tried already misses the SLO.
    """
    if not slo.bounds:
        raise ValueError(
            "--capacity needs an --slo to meet, e.g. --slo 'ttft_p99<2s,itl_p99<200ms'"
        )
    points, ok, miss = search(rec, slo, cost_models=cost_models)
    if ok is None:
        v = miss.prediction.slo_misses if miss is not None else {}
        worst = ", ".join(
            f"{k} {val:.0f} ms (bound {b:g} ms)" for k, (val, b) in v.items() if val is not None
        )
        raise NoRateMeets(
            f"no rate meets the SLO {slo.text!r}: at {LOWEST:g}x the recorded rate "
            f"({points[0].rate_per_s:.3g} requests/s) the replay still misses it ({worst})"
        )
    err = (rec.model.holdout.get("all", {}).get("median_abs_err_pct") or 0.0) / 100
    band = []
    for factor in (1 + err, 1 - err):  # dearer steps: the lower end
        _, b_ok, _ = search(rec, slo, rec.model.scaled(max(factor, 0.05)), cost_models)
        band.append(b_ok.rate_per_s if b_ok is not None else None)
    rows = [p.row() for p in points]
    k = knee([r["rate_per_s"] for r in rows], [r["goodput_share"] or 0.0 for r in rows])
    out = {
        "slo": slo.text,
        "recorded_rate_per_s": rec.workload.rate_per_s,
        "capacity_rate_per_s": ok.rate_per_s,
        "capacity_factor": ok.factor,
        # None: no rate meets the SLO at that end
        "band_rate_per_s": band,
        "band_step_error_pct": err * 100,
        "concurrent_users": ok.prediction.replay["running_mean"]
        + ok.prediction.replay["waiting_mean"],
        "knee_rate_per_s": k,
        "unbounded": miss is None,
        "curve": rows,
        "notes": ok.prediction.notes,
    }
    if miss is not None:
        resource, why = binding(miss.prediction)
        out["first_miss"] = {
            "rate_per_s": miss.rate_per_s,
            "misses": {
                m: {"value": v, "bound": b} for m, (v, b) in miss.prediction.slo_misses.items()
            },
            "binds": resource,
            "why": why,
        }
    return out


def to_text(doc: dict) -> str:
    """The capacity as an operator reads it."""
    lines = [f"capacity under {doc['slo']} (recorded {doc['recorded_rate_per_s']:.3g} requests/s)"]
    lo, hi = (f"{v:.3g}" if v is not None else "none" for v in doc["band_rate_per_s"])
    band = f" (steps {doc['band_step_error_pct']:.0f}% dearer or cheaper: {lo}-{hi})"
    if doc["unbounded"]:
        lines.append(
            f"  meets the SLO up to {doc['capacity_rate_per_s']:.3g} requests/s, the highest "
            f"rate tried (x{doc['capacity_factor']:g}){band}"
        )
    else:
        lines.append(
            f"  highest rate that meets it: {doc['capacity_rate_per_s']:.3g} requests/s "
            f"(x{doc['capacity_factor']:.2f} the recorded rate){band}"
        )
    lines.append(
        f"  concurrent users (closed loop, no think time: requests in the engine at once): "
        f"{doc['concurrent_users']:.1f}"
    )
    if doc["knee_rate_per_s"] is not None:
        lines.append(f"  goodput knee: {doc['knee_rate_per_s']:.3g} requests/s")
    miss = doc.get("first_miss")
    if miss:
        what = ", ".join(
            f"{m} {v['value']:.0f} ms > {v['bound']:.0f}"
            if v["value"] is not None
            else f"{m} (none)"
            for m, v in miss["misses"].items()
        )
        lines.append(
            f"  binds first: {miss['binds']} at {miss['rate_per_s']:.3g} requests/s ({what}): "
            f"{miss['why']}"
        )
    lines.append(
        "  rate/s   SLO  goodput   TTFT p99    ITL p99   TPOT p99  waiting  running  KV max  preempt"
    )
    for r in doc["curve"]:
        lines.append(
            f"  {r['rate_per_s']:6.3g}  {'met ' if r['slo_met'] else 'miss'}  "
            f"{(r['goodput_share'] or 0):6.0%}  {_ms(r['ttft_p99_ms'])}  {_ms(r['itl_p99_ms'])}  "
            f"{_ms(r['tpot_p99_ms'])}  "
            f"{r['waiting_mean']:7.1f}  {r['running_mean']:7.1f}  "
            f"{(r['kv_usage_max'] or 0):6.0%}  {r['preemptions']:7d}"
        )
    lines.extend(f"  note: {n}" for n in doc["notes"])
    return "\n".join(lines) + "\n"


def _ms(v: float | None) -> str:
    return f"{v:7.0f} ms" if v is not None else "       - ms"
