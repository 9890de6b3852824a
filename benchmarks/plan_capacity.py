"""``tokenmill plan --capacity`` against a real sweep of arrival rates on this machine.

1. Record: ``tokenmill serve`` (default model and knobs) under Poisson arrivals at a low rate
   (``--rate``; 64-512-token prompts, 32-128-token answers, a fixed seed).
2. Plan from that store alone: ``plan --capacity --slo SLO``: the highest rate that meets the
   SLO, the goodput knee, what binds first and the fit's band.
3. Profile: a server of the same setup swept by ``plan --profile`` (decode batches up to
   ``max_num_seqs``), and the capacity planned again with the profile beside the recording.
4. Run for real, with the same load generator and seed (the same prompts, the arrival gaps
   divided by the factor), at rates one grid step apart around the capacity predicted with the
   profile (``--steps``; a step is ``--step`` times the rate before it), each against a fresh
   server.
5. The real capacity is the highest swept rate whose run meets the SLO (a swept rate that
   meets it above one that misses is reported, not smoothed over); the real knee is the goodput
   knee of the swept runs. Target: the predicted capacity within one rate step of the real one
   (both predictions are scored).

Nothing of the sweep goes into the prediction: the plan is made before the first swept run.
Results: ``benchmarks/results/plan_capacity.json``; the table goes in RESULTS.md. Run it alone
(``make plan-capacity``): about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_validation as pv  # noqa: E402
from live_soak import _host  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "plan_capacity.json"
#: TTFT and TPOT: on this CPU the ITL p99 of this mix is a whole prefill step (about 580 ms at
#: 0.3 requests/s, with 2048-token prefill chunks), at any rate with two requests in flight
SLO = "ttft_p99<2s,tpot_p99<200ms"


def profile(work: Path, store: Path) -> None:
    """``plan --profile`` against a server of the recording's setup (default knobs)."""
    from tokenmill.bench.scenario import _free_port, start_server, stop_server

    out = work / "profile"
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    db = out / "traces.duckdb"
    db.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port),
           "--trace-db", str(db)]  # fmt: skip
    server = start_server(cmd, out, dict(os.environ), url)
    try:
        pv.log("profiling a server of the recording's setup")
        pv.plan(store, [], ["--profile", "--url", url])
    finally:
        stop_server(server)


def real_capacity(rows: list[dict]) -> float | None:
    """The highest swept rate whose run met the SLO (None: none did)."""
    met = [r["rate_per_s"] for r in rows if r["slo_met"]]
    return max(met) if met else None


def main() -> None:
    from tokenmill.plan.recommend import knee
    from tokenmill.plan.whatif import parse_slo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/tokenmill-plan-capacity"))
    ap.add_argument("--rate", type=float, default=0.3, help="the recording's requests/s")
    ap.add_argument("--requests", type=int, default=50, help="requests per run")
    ap.add_argument("--slo", default=SLO)
    ap.add_argument("--step", type=float, default=2**0.25, help="one rate step (a ratio)")
    ap.add_argument("--steps", type=int, default=2, help="swept steps either side")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--reuse", action="store_true", help="keep what --work already holds")
    args = ap.parse_args()
    began = time.time()
    slo = parse_slo(args.slo)
    base = args.work / "record" / "traces.duckdb"
    if not (args.reuse and base.is_file()):
        pv.log(f"recording at {args.rate}/s, {args.requests} requests (Poisson)")
        base = pv.record(args.work, "record", [], args.rate, args.requests, 1.0)
    from tokenmill.plan.profile import profile_path

    prof = profile_path(base)
    if not args.reuse:
        prof.unlink(missing_ok=True)
    plain = None
    if not prof.exists():
        plain = pv.plan(base, [], ["--capacity", "--slo", args.slo])["capacity"]
        pv.log(f"without a profile: capacity {plain['capacity_rate_per_s']:.3f}/s")
        profile(args.work, base)
    doc = pv.plan(base, [], ["--capacity", "--slo", args.slo])
    cap = doc["capacity"]
    predicted = cap["capacity_rate_per_s"]
    pv.log(f"predicted capacity {predicted:.3f}/s (band {cap['band_rate_per_s']}), knee "
           f"{cap['knee_rate_per_s']}, binds {cap.get('first_miss', {}).get('binds')}")  # fmt: skip
    rows = []

    def run_at(k: int) -> None:
        rate = predicted * args.step**k
        name = f"sweep_{k:+d}"
        store = args.work / name / "traces.duckdb"
        if not (args.reuse and store.is_file()):
            pv.log(f"real run at {rate:.3f}/s")
            store = pv.record(args.work, name, [], rate, args.requests, 1.0)
        m = pv.measure(store, args.slo)
        rows.append({"rate_per_s": rate, "step": k, **m, "slo_met": not slo.misses(m),
                     "misses": sorted(slo.misses(m))})  # fmt: skip
        rows.sort(key=lambda r: r["step"])
        pv.log(f"  {rate:.3f}/s: TTFT p99 {m['ttft_p99_ms']:.0f} ms, ITL p99 "
               f"{m['itl_p99_ms']:.0f} ms, goodput {m['goodput_share']:.0%}, "
               f"{'met' if not slo.misses(m) else 'missed'}")  # fmt: skip

    for k in range(-args.steps, args.steps + 1):
        run_at(k)
    # the sweep brackets the real edge: one more step out where every run met it (or none)
    for _ in range(2):
        if all(r["slo_met"] for r in rows):
            run_at(rows[-1]["step"] + 1)
        elif not any(r["slo_met"] for r in rows):
            run_at(rows[0]["step"] - 1)
    real = real_capacity(rows)
    real_knee = knee([r["rate_per_s"] for r in rows], [r["goodput_share"] or 0 for r in rows])

    def off(rate: float | None) -> float | None:
        return math.log(rate / real) / math.log(args.step) if real and rate else None

    steps_off = off(predicted)
    result = {
        "date": dt.date.today().isoformat(),
        "host": _host(),
        "slo": args.slo,
        "load": " ".join(pv.LOAD) + " (Poisson)",
        "recorded_rate_per_s": args.rate,
        "requests_per_run": args.requests,
        "rate_step": args.step,
        "predicted": {
            k: cap[k]
            for k in (
                "capacity_rate_per_s",
                "band_rate_per_s",
                "knee_rate_per_s",
                "concurrent_users",
            )
        }
        | {"binds": cap.get("first_miss", {}).get("binds")},
        "predicted_curve": cap["curve"],
        "step_cost_steps": doc["step_cost"]["steps"],
        "profile_steps": doc["step_cost"]["profile_steps"],
        "residuals_by_batch": doc["step_cost"]["residuals_by_batch"],
        "without_profile": None
        if plain is None
        else {
            "capacity_rate_per_s": plain["capacity_rate_per_s"],
            "knee_rate_per_s": plain["knee_rate_per_s"],
            "steps_off": off(plain["capacity_rate_per_s"]),
        },
        "sweep": rows,
        "real_capacity_rate_per_s": real,
        "real_knee_rate_per_s": real_knee,
        "steps_off": steps_off,
        "within_one_step": steps_off is not None and abs(steps_off) <= 1.0 + 1e-9,
        "seconds": round(time.time() - began),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    pv.log(f"real capacity {real}, predicted {predicted:.3f}: {steps_off} steps off")


if __name__ == "__main__":
    main()
