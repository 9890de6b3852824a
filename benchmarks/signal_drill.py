"""The stop-signal drill (``bench/signal_drill.py``): every case on a real server with 8 streams
open, on one engine core; three of them on two data-parallel replicas, on three tensor-parallel
ranks and on a disaggregated 1+1 prefill/decode pair; streams completed / cut with an error /
cut silently, exit codes and leftover processes per case; then
SIGKILL to the engine core under load (``run_core_kill``): how fast the streams learned of it,
how fast the server served again, and whether the diagnoser named the cut requests.

    python benchmarks/signal_drill.py [--out benchmarks/results/signal_drill.json]

Alone on the machine: a few minutes (each case starts a server).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tokenmill.bench.signal_drill import CASES, STREAMS, run_case, run_core_kill
from tokenmill.engine.device_peaks import cpu_name

#: the server layouts every case runs on: extra ``tokenmill serve`` options
LAYOUTS = {
    "one core": (),
    "2 data-parallel replicas": ("--data-parallel-size", "2", "--cpu-threads", "1"),
    "3 tensor-parallel ranks": ("--tensor-parallel-size", "3"),
    "prefill/decode 1+1": ("--disaggregation", "prefill=1,decode=1"),
}
#: the cases run on the parallel layouts (all of them run on one core)
PARALLEL_CASES = ("term_group", "int_group", "kill_api")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/signal_drill.json")
    ap.add_argument("--layout", action="append", choices=list(LAYOUTS), help="default: all")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layout or list(LAYOUTS):
            cases = list(CASES) if layout == "one core" else PARALLEL_CASES
            for case in cases:
                r = run_case(case, Path(tmp) / layout.replace(" ", "_"), LAYOUTS[layout])
                row = {"layout": layout, **r.to_dict()}
                rows.append(row)
                print(
                    f"{layout:26s} {case:11s} completed {r.completed}/{STREAMS}, error "
                    f"{r.cut_with_error}, silent {r.cut_silently}, exit {r.exit_code}, "
                    f"leftover {len(r.leftover_processes)}, {r.seconds_to_exit} s",
                    flush=True,
                )
        kill = None
        if not args.layout or "one core" in args.layout:
            kill = run_core_kill(Path(tmp) / "core_kill").to_dict()
            print(
                f"SIGKILL to the engine core: cut with an error {kill['cut_with_error']}/{STREAMS}"
                f" (silent {kill['cut_silently']}), last error {kill['seconds_to_last_error']} s "
                f"after the kill, serving again after {kill['seconds_to_recovery']} s; first "
                f"finding {kill['first_finding']} naming {kill['named_in_finding']} of them",
                flush=True,
            )
    out = {
        "benchmark": "signal_drill",
        "date": time.strftime("%Y-%m-%d"),
        "host": f"{cpu_name()}, {os.cpu_count()} vCPUs",
        "streams": STREAMS,
        "cases": rows,
        "core_kill": kill,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
