"""An OTLP collector that never answers, against serving: output tokens/s, the API process's
memory over the load, and the time from SIGTERM to exit (issue 53, "a dead exporter").

Two real ``tokenmill serve`` processes (default model, CPU) start side by side: ``plain``
(no OTLP) and ``blackhole`` (``--otlp-endpoint`` at :class:`~tokenmill.bench.blackhole.BlackHole`,
a socket on 127.0.0.1 that accepts every connection and never writes a byte). The black-holed
server runs with ``OTEL_BSP_MAX_QUEUE_SIZE=256`` so its span queue fills within the run (the
default 2048 would take minutes here) and the SDK's default export timeout (10 s).

Rounds alternate plain, blackhole, plain, ... (``--rounds`` each, default 3): a closed loop of
``--concurrency`` (8) streaming chat requests, ``--requests`` (20) in all, 64-token prompts and
``--max-tokens`` (48) output tokens with ``ignore_eos`` (``tokenmill.bench.client``). Reported:
each server's output tokens/s per round and the median of the per-round ratios blackhole /
plain; the API process's RSS sampled every 0.5 s during each server's rounds (first, last,
max); the black-holed server's ``tokenmill_telemetry_dropped_total{table="spans"}`` by reason
and its ``/health`` ``telemetry.otlp``; then SIGTERM to each server (nothing in flight) and the
seconds until it exited, beside ``--shutdown-timeout`` (10 s here, for both; the black hole
would otherwise take the engine's stop plus a whole export timeout, 10 s) and the export
timeout. Targets: ratio >= 0.95, RSS flat (last - first within 5% of first), exit before the
shutdown timeout. Results: ``benchmarks/results/otlp_blackhole.json``.

Run it alone on the machine (others' engines change the ratio):
``flock /tmp/tokenmill-engine.lock .venv/bin/python benchmarks/otlp_blackhole.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from tokenmill.bench.blackhole import BlackHole
from tokenmill.bench.drill_load import (
    closed_loop_round,
    counter_by,
    sigterm_and_wait,
    throughput_ratios,
    write_result,
)
from tokenmill.bench.scenario import _free_port, start_server

OUT = Path(__file__).parent / "results"
QUEUE = 256  # OTEL_BSP_MAX_QUEUE_SIZE of the black-holed server
SHUTDOWN_TIMEOUT_S = 10.0  # --shutdown-timeout: at the export timeout, below stop + export


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler:
    """VmRSS of one process every ``interval_s`` while running."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.pid, self.interval_s, self.samples = pid, interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            v = rss_mib(self.pid)
            if v is not None:
                self.samples.append(round(v, 1))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="otlp-blackhole-"))
    hole = BlackHole()
    base = [sys.executable, "-m", "tokenmill.engine.cli", "serve"]
    base += ["--shutdown-timeout", f"{SHUTDOWN_TIMEOUT_S:g}s"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENMILL_"))}
    servers = {}
    for name, extra, more_env in (
        ("plain", [], {}),
        ("blackhole", ["--otlp-endpoint", hole.url], {"OTEL_BSP_MAX_QUEUE_SIZE": str(QUEUE)}),
    ):
        port = _free_port()
        folder = work / name
        folder.mkdir()
        url = f"http://127.0.0.1:{port}"
        print(f"starting {name} on {url}", flush=True)
        proc = start_server(
            [*base, "--port", str(port), *extra], folder, {**env, **more_env}, url, f"{name}.log"
        )
        servers[name] = {"proc": proc, "url": url, "folder": folder}
    out: dict = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_tokens": 64,
        "otel_bsp_max_queue_size": QUEUE,
        "export_timeout_s": 10.0,
        "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
    }
    load = {"concurrency": args.concurrency, "max_tokens": args.max_tokens}
    try:
        for s in servers.values():  # warm-up
            closed_loop_round(s["url"], **load, seed=99, requests=2)
            s["rounds"], s["rss"] = [], []
        for r in range(args.rounds):
            for name, s in servers.items():
                with RssSampler(s["proc"].pid) as rss:
                    res = closed_loop_round(s["url"], **load, seed=r, requests=args.requests)
                s["rounds"].append(res)
                s["rss"].extend(rss.samples)
                print(f"round {r} {name}: {res}", flush=True)
        drops = counter_by(
            servers["blackhole"]["url"],
            "tokenmill_telemetry_dropped_total",
            "reason",
            table="spans",
        )
        otlp_health = httpx.get(servers["blackhole"]["url"] + "/health", timeout=30).json()[
            "telemetry"
        ]["otlp"]
        for name, s in servers.items():
            code, secs = sigterm_and_wait(s["proc"], SHUTDOWN_TIMEOUT_S + 90)
            s["stop"] = {"exit_s": secs, "exit_code": code, "hung": code is None}
            print(f"{name}: SIGTERM → exit {s['stop']}", flush=True)
    finally:
        for s in servers.values():
            if s["proc"].poll() is None:
                s["proc"].kill()
        hole.close()
    for name, s in servers.items():
        log = (s["folder"] / f"{name}.log").read_text()
        out[name] = {
            "rounds": s["rounds"],
            "output_tok_s_median": statistics.median(x["output_tok_s"] for x in s["rounds"]),
            "failed": sum(x["failed"] for x in s["rounds"]),
            "rss_mib": {
                "first": s["rss"][0],
                "last": s["rss"][-1],
                "max": max(s["rss"]),
                "samples": len(s["rss"]),
            },
            "sigterm_to_exit_s": s["stop"]["exit_s"],
            "exit_code": s["stop"]["exit_code"],
            "hung": s["stop"]["hung"],
            "traceback_in_log": "Traceback" in log,
            "log_tail": [ln for ln in log.splitlines() if "OTLP export" in ln][-3:],
        }
    rss = out["blackhole"]["rss_mib"]
    out.update(throughput_ratios(servers["plain"]["rounds"], servers["blackhole"]["rounds"]))
    out["blackhole"]["rss_growth_pct"] = round(100 * (rss["last"] - rss["first"]) / rss["first"], 2)
    out["blackhole"]["spans_dropped"] = drops
    out["blackhole"]["health_otlp"] = otlp_health
    out["black_hole"] = {"connections": hole.connections, "bytes_in": hole.bytes_in}
    out["targets"] = {
        "ratio_ge_0.95": out["ratio_output_tok_s_median"] >= 0.95,
        "rss_flat_within_5pct": abs(out["blackhole"]["rss_growth_pct"]) <= 5,
        "exit_within_shutdown_timeout": (
            out["blackhole"]["sigterm_to_exit_s"] is not None
            and out["blackhole"]["sigterm_to_exit_s"] <= SHUTDOWN_TIMEOUT_S
        ),
        "no_failed_requests": out["blackhole"]["failed"] == 0 and out["plain"]["failed"] == 0,
    }
    write_result(out, OUT, "otlp_blackhole")
    print(
        f"blackhole: rss {rss['first']} → {rss['last']} MiB (max {rss['max']}), "
        f"SIGTERM → exit {out['blackhole']['sigterm_to_exit_s']} s "
        f"(plain {out['plain']['sigterm_to_exit_s']} s), dropped {drops}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
