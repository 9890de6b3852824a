"""32 concurrent streams: int8 compute against float32 and weight-only quantization, and against
llama.cpp's own C++ server, one run, same client.

Servers, one after another, each alone on the machine: ``tokenmill serve`` in float32; int8 and
int4 weight-only (``--int8-compute off``); int8 and int4 with int8 compute on the CPU's own
path (``--int8-compute on``); then llama.cpp's ``llama-server`` on the default model's Q4_1
GGUF with 32 slots and 2 threads (built once from the pinned sdist, ``any_engine.py``;
``--no-repack`` on an AMX host, see any_engine.llama_host_args).

The client is ``tokenmill bench`` for every server: 32 requests in flight (closed loop), 64 in
all, chat prompts of 30-240 tokens (20-180 words of English), 64-128 output tokens with
``ignore_eos``, seed 0, so each server gets the same requests. A figure is the output tok/s
the bench reports (all output tokens over the wall time), with TTFT p50/p99 and ITL p50.

Targets: int8 compute ≥ 1.6× float32's output tok/s; the best configuration ≥ 3× llama.cpp's.
The host's int8 path and CPU flags are printed with every figure. Results:
``benchmarks/results/int8_streams.json``. Run it alone on the machine (about 8 minutes).

Run: ``.venv/bin/python benchmarks/int8_streams.py``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from any_engine import _bench, _free_port, _llama, llama_server
from int8_prefill import _flags

from tokenmill.bench.scenario import start_server, stop_server

OUT = Path(__file__).parent / "results"
LOAD = ["--concurrency", "32", "--num-requests", "64", "--prompt-tokens", "uniform:30:240",
        "--output-tokens", "uniform:64:128", "--seed", "0"]  # fmt: skip
CONFIGS = [
    ("float32", ["--quantization", "none"]),
    ("int8 weight-only", ["--quantization", "int8", "--int8-compute", "off"]),
    ("int8 compute", ["--quantization", "int8", "--int8-compute", "on"]),
    ("int4 weight-only", ["--quantization", "int4", "--int8-compute", "off"]),
    ("int4 compute", ["--quantization", "int4", "--int8-compute", "on"]),
]


def _tokenmill(args: list[str], work: Path, name: str):
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", "32", "--trace-db", str(work / f"{name}.duckdb"),
           *args]  # fmt: skip
    return start_server(
        cmd, work, dict(os.environ), f"http://127.0.0.1:{port}", f"{name}.log"
    ), port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT / "int8_streams.json"))
    ap.add_argument("--skip-llama", action="store_true", help="leave llama.cpp out")
    args = ap.parse_args()
    from tokenmill.engine.device_peaks import cpu_name
    from tokenmill.engine.int8_compute import gemm_isa

    host = {"cpu": cpu_name(), "flags": _flags(), "int8_path": gemm_isa()}
    print(f"host: {host['cpu']}; flags {' '.join(host['flags'])}; int8 path {host['int8_path']}")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="int8-streams-") as tmp:
        work = Path(tmp)
        servers = [(name, lambda a=a, n=name: _tokenmill(a, work, n.replace(" ", "_")))
                   for name, a in CONFIGS]  # fmt: skip
        if not args.skip_llama:
            binary = llama_server()
            servers.append(("llama.cpp Q4_1", lambda: _llama(binary, work, 32, 16384, "llama")))
        for name, start in servers:
            t0 = time.perf_counter()
            server, port = start()
            try:
                res = _bench(f"http://127.0.0.1:{port}", LOAD, work / "bench.json")
            finally:
                stop_server(server)
            rows[name] = res
            print(
                f"{name:<18} {res['output_throughput']:7.1f} output tok/s  TTFT p50 "
                f"{res['median_ttft_ms']:8.1f} ms p99 {res['p99_ttft_ms']:8.1f} ms  ITL p50 "
                f"{res['median_itl_ms']:6.2f} ms  {res['completed']} done {res['failed']} failed"
                f"  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    base = rows["float32"]["output_throughput"]
    for row in rows.values():
        row["vs_float32"] = round(row["output_throughput"] / base, 3)
    checks = [
        {"target": "int8 compute ≥ 1.6× float32", "value": rows["int8 compute"]["vs_float32"],
         "pass": rows["int8 compute"]["vs_float32"] >= 1.6},
    ]  # fmt: skip
    if "llama.cpp Q4_1" in rows:
        llama = rows["llama.cpp Q4_1"]["output_throughput"]
        best = max((n for n in rows if n != "llama.cpp Q4_1"),
                   key=lambda n: rows[n]["output_throughput"])  # fmt: skip
        ratio = round(rows[best]["output_throughput"] / llama, 3)
        checks.append(
            {"target": f"best ({best}) ≥ 3× llama.cpp", "value": ratio, "pass": ratio >= 3}
        )
    result = {
        "benchmark": "int8_streams",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": host,
        "load": " ".join(LOAD),
        "servers": rows,
        "checks": checks,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nhost {host['cpu']} ({' '.join(host['flags'])}), int8 path {host['int8_path']}")
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['target']}: {c['value']}")
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
