"""What the failure drills' benchmarks share (``benchmarks/otlp_blackhole.py``,
``benchmarks/store_full_drill.py``): a closed-loop round of load, a server's own counters read
from its ``/metrics``, and a SIGTERM timed to the process's exit."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .client import BenchConfig
from .client import run as bench_run
from .phases import Phase
from .report import summarize
from .workload import LengthSpec, Workload


def closed_loop_round(
    url: str,
    *,
    concurrency: int,
    max_tokens: int,
    seed: int,
    seconds: float = float("inf"),
    requests: int | None = None,
) -> dict:
    """``concurrency`` streams in a closed loop, 64-token prompts and ``max_tokens`` output
    tokens, for ``seconds`` or ``requests`` in all: requests sent, output tokens/s, completed,
    failed."""
    cfg = BenchConfig(
        url=url,
        workload=Workload(
            prompt_tokens=LengthSpec("fixed", 64),
            output_tokens=LengthSpec("fixed", max_tokens),
            seed=seed,
        ),
        phases=[Phase("load", seconds)],
        concurrency=concurrency,
        num_requests=requests,
        seed=seed,
    )
    run = asyncio.run(bench_run(cfg))
    s = summarize(run)
    return {
        "sent": len(run.results),
        "output_tok_s": s["output_throughput"],
        "completed": s["completed"],
        "failed": s["failed"],
    }


def counter_by(url: str, name: str, by: str, **match: str) -> dict[str, float]:
    """The server's ``name`` samples whose labels hold ``match``, summed per value of label
    ``by`` (``counter_by(url, "tokenmill_telemetry_dropped_total", "reason", table="spans")``)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                key = s.labels.get(by, "?")
                out[key] = out.get(key, 0.0) + s.value
    return out


def sigterm_and_wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, float | None]:
    """SIGTERM, then the exit code and the seconds until the exit; a process that has not
    exited within ``timeout_s`` is killed: ``(None, None)``."""
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, None
    return code, round(time.monotonic() - t, 2)
