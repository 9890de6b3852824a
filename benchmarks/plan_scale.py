"""``tokenmill plan`` past this machine: 1,000,000 requests over 64 replicas from one host's
recording, and fast-forward against step-by-step on a small replay.

The recording is the plan validation's (``benchmarks/data/plan_recording/``: the default model
at 0.4 requests/s, kept as a Parquet dump). The big replay tiles it to 1,000,000 requests at 64x
its rate over 64 hosts like the recorded one (each replica about as loaded as the recording),
in this process: its wall time and the process's peak resident memory (``ru_maxrss``). The
small replay (the recording tiled to 2,000 requests at 2x its rate over 4 hosts) runs both ways
and sets their percentiles side by side. Results: ``benchmarks/results/plan_scale.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "benchmarks" / "data" / "plan_recording"
OUT = ROOT / "benchmarks" / "results" / "plan_scale.json"


def percentiles(r) -> dict:
    out = {}
    for name, arr in (("ttft", r.ttft_ms), ("itl_p50", r.itl_p50_ms), ("itl_p99", r.itl_p99_ms),
                      ("e2e", r.e2e_ms)):  # fmt: skip
        out[f"{name}_p50_ms"] = float(np.nanpercentile(arr, 50))
        out[f"{name}_p99_ms"] = float(np.nanpercentile(arr, 99))
    out["preemptions"] = int(r.preemptions.sum())
    return out


def main() -> None:
    from tokenmill.plan.predict import open_recording, setup_for
    from tokenmill.plan.simulate import simulate
    from tokenmill.plan.whatif import parse_whatif

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recording", type=Path, default=RECORDING)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--hosts", type=int, default=64)
    args = ap.parse_args()
    rec = open_recording(args.recording)
    doc: dict = {"date": dt.date.today().isoformat(), "machine": "2 vCPU, no GPU"}

    small = parse_whatif("requests=2000,rate=8,hosts=4")
    setup, w, model, _ = setup_for(rec, small)
    fast = simulate(w, setup, model, fast_forward=True)
    slow = simulate(w, setup, model, fast_forward=False)
    doc["fast_vs_step_by_step"] = {
        "what_if": small.text,
        "fast_forward": percentiles(fast) | {"wall_s": fast.wall_s, "calls": fast.scheduler_calls},
        "step_by_step": percentiles(slow) | {"wall_s": slow.wall_s, "calls": slow.scheduler_calls},
    }
    print(json.dumps(doc["fast_vs_step_by_step"], indent=1), flush=True)

    big = parse_whatif(f"requests={args.requests},rate={args.hosts},hosts={args.hosts}")
    setup, w, model, _ = setup_for(rec, big)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    r = simulate(w, setup, model)
    wall = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    doc["big"] = {
        "what_if": big.text,
        "requests": len(w),
        "replicas": setup.replicas,
        "wall_s": wall,
        "peak_rss_mib": peak / 1024,
        "rss_before_mib": before / 1024,
        "steps": r.steps,
        "scheduler_calls": r.scheduler_calls,
        "simulated_s": r.makespan_s,
        "completed": int((~np.isnan(r.e2e_ms)).sum()),
        **percentiles(r),
    }
    print(json.dumps(doc["big"], indent=1), flush=True)
    OUT.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
