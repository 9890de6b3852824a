"""``tokenmill plan`` past this machine: 1,000,000 requests over 64 replicas from one host's
recording, and fast-forward against step-by-step on a small replay.

The recording is the plan validation's (``benchmarks/data/plan_recording/``: the default model
at 0.4 requests/s, kept as a Parquet dump). The big replay tiles it to 1,000,000 requests at 64x
its rate over 64 hosts like the recorded one (each replica about as loaded as the recording),
split over this host's cores (``plan/split.py``, the default for a replay this big)
``--repeats`` times (3; the median run is reported, with every run's wall time and whether
all gave the same results to the bit), then in this process alone, each with its wall time
and peak resident memory (``ru_maxrss``: the split's first, this process, and its other; a forked process's count includes the pages it
shares with this one; the one-process figure is this process's peak over both). The
small replay (the recording tiled to 2,000 requests at 2x its rate over 4 hosts) runs both ways
and sets their percentiles side by side. A third replay (100,000 requests, same shape) times
the engine's own ``Scheduler`` calls inside it: the share of a replay that is the real
scheduler deciding, which no change to the replay loop can take away.
Results: ``benchmarks/results/plan_scale.json``.
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


def scheduler_share(rec, requests: int, hosts: int) -> dict:
    """Replay ``requests`` with the engine scheduler's calls timed: its seconds per call."""
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.plan.predict import setup_for
    from tokenmill.plan.simulate import simulate
    from tokenmill.plan.whatif import parse_whatif

    spent = {"s": 0.0}
    names = ("add_request", "schedule", "update_after_step", "finish")
    originals = {name: getattr(Scheduler, name) for name in names}

    def timed(fn):
        def call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - began

        return call

    for name, fn in originals.items():
        setattr(Scheduler, name, timed(fn))
    try:
        what = parse_whatif(f"requests={requests},rate={hosts},hosts={hosts}")
        setup, w, model, _ = setup_for(rec, what)
        r = simulate(w, setup, model, processes=1)
    finally:
        for name, fn in originals.items():
            setattr(Scheduler, name, fn)
    return {
        "what_if": what.text,
        "wall_s": r.wall_s,
        "scheduler_s": spent["s"],
        "scheduler_calls": r.scheduler_calls,
        "scheduler_us_per_call": spent["s"] / r.scheduler_calls * 1e6,
        "scheduler_share": spent["s"] / r.wall_s,
    }


def main() -> None:
    from tokenmill.plan.predict import open_recording, setup_for
    from tokenmill.plan.simulate import simulate
    from tokenmill.plan.whatif import parse_whatif

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recording", type=Path, default=RECORDING)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the split replay (median)")
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
    runs = [("big_split", None)] * args.repeats + [("big_one_process", 1)]
    splits = []
    for key, processes in runs:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        began, cpu_began = time.perf_counter(), time.process_time()
        r = simulate(w, setup, model, processes=processes)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        doc[key] = {
            "what_if": big.text,
            "processes": r.processes,
            "requests": len(w),
            "replicas": setup.replicas,
            "wall_s": wall,
            "cpu_s": cpu,
            "children_cpu_s": children.ru_utime + children.ru_stime,
            "peak_rss_mib": peak / 1024,
            "children_peak_rss_mib": children.ru_maxrss / 1024,
            "rss_before_mib": before / 1024,
            "steps": r.steps,
            "scheduler_calls": r.scheduler_calls,
            "simulated_s": r.makespan_s,
            "completed": int((~np.isnan(r.e2e_ms)).sum()),
            **percentiles(r),
        }
        print(json.dumps(doc[key], indent=1), flush=True)
        if key == "big_split":
            splits.append(doc[key])
    # the split replay's median run, every run's wall time, and whether every run gave the same
    # results (steps, scheduler calls, percentiles) to the bit
    walls = [x["wall_s"] for x in splits]
    doc["big_split"] = sorted(splits, key=lambda x: x["wall_s"])[len(splits) // 2]
    doc["big_split"]["wall_s_runs"] = walls
    same = ("steps", "scheduler_calls", "simulated_s", *percentiles(r))
    doc["big_split"]["runs_same_results"] = all(x[k] == splits[0][k] for x in splits for k in same)
    one, split = doc["big_one_process"], doc["big_split"]
    doc["split_speedup"] = one["wall_s"] / split["wall_s"]
    doc["split_same_percentiles"] = all(one[k] == split[k] for k in percentiles(r))
    print(f"split: {doc['split_speedup']:.2f}x, same percentiles: {doc['split_same_percentiles']}")
    share = scheduler_share(rec, min(100_000, args.requests), args.hosts)
    # the engine scheduler's own time at the big replay's call count: its floor
    share["big_replay_floor_s"] = share["scheduler_us_per_call"] * r.scheduler_calls / 1e6
    doc["scheduler"] = share
    print(json.dumps(share, indent=1), flush=True)
    OUT.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
