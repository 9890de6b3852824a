"""What the live diagnosis costs serving: output tokens/s of the same closed-loop traffic with
the loop on (``--diagnose-every 10s``) and off (``0``), servers alternating in one run
(on, off, on, off, ...), their ITL p99 and the decode steps that took 5x their median or more
(what a loop that takes the engine's cores at the wrong moment leaves), and the loop's own time
per period from its series.

    python benchmarks/live_cost.py [--rounds 2] [--seconds 60]

Writes ``benchmarks/results/live_cost.json``: each round's tokens/s, ITL p99 and long decode
steps, the ratios of the medians (on / off) and the loop's wall and CPU seconds per run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import httpx

from tokenmill.bench.scenario import _free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ["--concurrency", "4", "--prompt-tokens", "uniform:32:128", "--output-tokens", "64",
           "--ignore-eos", "--seed", "5"]  # fmt: skip


def _series(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# decode-only steps, and those 5x the median decode-only step or longer
_LONG_STEPS_SQL = """
WITH d AS (SELECT (end_ns - start_ns) / 1e6 AS ms FROM engine_steps
           WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0)
SELECT count(*) FILTER (WHERE ms >= 5 * (SELECT median(ms) FROM d)), count(*) FROM d
"""


def one_round(work: Path, every: str, seconds: float, i: int) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port),
           "--trace-db", str(work / f"r{i}.duckdb"), "--diagnose-every", every]  # fmt: skip
    server = start_server(cmd, work, {}, url, f"server-{i}.log")
    try:
        out = work / f"bench-{i}.json"
        subprocess.run(
            [sys.executable, "-m", "tokenmill.engine.cli", "bench", "--url", url, "--no-progress",
             "--phases", f"warm:10s,steady:{seconds:g}s", "--out", str(out), *TRAFFIC],
            check=True, capture_output=True,
        )  # fmt: skip
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop_server(server)
    res = json.loads(out.read_text())
    phase = next(p for p in res["phases"] if p.get("name", p.get("phase")) == "steady")
    with duckdb.connect(str(work / f"r{i}.duckdb"), read_only=True) as con:
        ((long_steps, steps),) = con.execute(_LONG_STEPS_SQL).fetchall()
    runs = _series(metrics, "tokenmill_diagnosis_run_seconds_count")
    return {
        "diagnose_every": every,
        "output_tok_s": phase["output_throughput"],
        "itl_p99_ms": phase.get("p99_itl_ms"),
        "decode_steps": steps,
        "decode_steps_5x_median": long_steps,
        "loop_runs": runs,
        "loop_wall_s_per_run": _series(metrics, "tokenmill_diagnosis_run_seconds_sum") / runs
        if runs
        else None,
        "loop_cpu_s_per_run": _series(metrics, "tokenmill_diagnosis_cpu_seconds_total") / runs
        if runs
        else None,
    }


def _ratio(rounds: list[dict], key: str) -> float | None:
    on = [r[key] for r in rounds if r["diagnose_every"] != "0" and r[key] is not None]
    off = [r[key] for r in rounds if r["diagnose_every"] == "0" and r[key] is not None]
    return round(statistics.median(on) / statistics.median(off), 4) if on and off else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    a = ap.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for every in ("10s", "0"):
                rounds.append(one_round(Path(tmp), every, a.seconds, len(rounds)))
                print(rounds[-1], flush=True)
    on = [r["output_tok_s"] for r in rounds if r["diagnose_every"] != "0"]
    off = [r["output_tok_s"] for r in rounds if r["diagnose_every"] == "0"]
    cpu = [r["loop_cpu_s_per_run"] for r in rounds if r["loop_cpu_s_per_run"] is not None]
    wall = [r["loop_wall_s_per_run"] for r in rounds if r["loop_wall_s_per_run"] is not None]
    out = {
        "rounds": rounds,
        "on_over_off": round(statistics.median(on) / statistics.median(off), 4),
        "itl_p99_on_over_off": _ratio(rounds, "itl_p99_ms"),
        "long_steps_on": sum(
            r["decode_steps_5x_median"] for r in rounds if r["diagnose_every"] != "0"
        ),
        "long_steps_off": sum(
            r["decode_steps_5x_median"] for r in rounds if r["diagnose_every"] == "0"
        ),
        "loop_cpu_s_per_run": round(statistics.median(cpu), 4) if cpu else None,
        "loop_wall_s_per_run": round(statistics.median(wall), 4) if wall else None,
        "period_s": 10.0,
    }
    (ROOT / "benchmarks/results/live_cost.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
