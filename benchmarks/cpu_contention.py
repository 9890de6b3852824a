"""The engine next to a busy neighbour: decode and prefill speed with one spinning process
pinned to CPU 0, against the same engine on a quiet host (issue 19 item 12).

Each configuration runs in its own process (the offline ``LLM`` on the default model):
- ``--cpu-threads 2``: two intra-op threads whatever the host does (torch's default here, and
  the engine's behaviour before the thread governor);
- ``auto`` (``--cpu-threads 0``, the default): ``engine/cpu_threads.py`` re-reads the host
  every second and keeps one thread per core the neighbours leave free.

A run warms up for at least 4 s (so the governor has read the host), then times 4 requests of
32 greedy tokens (decode tok/s) and one 800-token prompt (prefill tok/s). The target: with the
neighbour, decode keeps at least 40% of its quiet speed. Results go to
``benchmarks/results/cpu_contention.json``; run it alone on the machine.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

from tokenmill.bench.cpu_hog import spin_on_cpu

OUT = Path(__file__).parent / "results"
CHILD = r"""
import json, sys, time
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams
llm = LLM(cpu_threads=int(sys.argv[1]))
greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
start = time.monotonic()
while time.monotonic() - start < 4.0:  # warm-up: the governor reads the host once a second
    llm.generate([[100 + i for i in range(40)]] * 2, SamplingParams(temperature=0, max_tokens=8))
t = time.perf_counter()
llm.generate([[100 + i + j for i in range(40)] for j in range(4)], greedy)
decode = 4 * 32 / (time.perf_counter() - t)
t = time.perf_counter()
llm.generate([[200 + (i * 7) % 3000 for i in range(800)]], SamplingParams(temperature=0, max_tokens=1))
prefill = 800 / (time.perf_counter() - t)
print(json.dumps({"decode_tok_s": decode, "prefill_tok_s": prefill,
                  "threads_at_end": llm.core.threads.threads}))
"""


def run_one(cpu_threads: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(cpu_threads)],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs at least 2 CPUs")
    rows = []
    for host in ("quiet", "neighbour"):
        for label, threads in (("--cpu-threads 2", 2), ("auto", 0)):
            hog = None
            if host == "neighbour":
                hog = mp.get_context("spawn").Process(
                    target=spin_on_cpu, args=(0, 600.0), daemon=True
                )
                hog.start()
                time.sleep(1.0)
            try:
                res = run_one(threads)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.join(5)
            rows.append({"host": host, "engine": label, **res})
            print(rows[-1], flush=True)
    quiet = {r["engine"]: r for r in rows if r["host"] == "quiet"}
    for r in rows:
        q = quiet[r["engine"]]
        r["decode_vs_quiet"] = r["decode_tok_s"] / q["decode_tok_s"]
        r["prefill_vs_quiet"] = r["prefill_tok_s"] / q["prefill_tok_s"]
    OUT.mkdir(exist_ok=True)
    path = OUT / "cpu_contention.json"
    path.write_text(json.dumps({"cpus": len(os.sched_getaffinity(0)), "rows": rows}, indent=2))
    print("| host | engine | decode tok/s | × quiet | prefill tok/s | × quiet | threads |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['host']} | {r['engine']} | {r['decode_tok_s']:.1f} | "
            f"{r['decode_vs_quiet']:.2f} | {r['prefill_tok_s']:.0f} | "
            f"{r['prefill_vs_quiet']:.2f} | {r['threads_at_end']} |"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
