"""What the failure drills' benchmarks share (``benchmarks/otlp_blackhole.py``,
``benchmarks/store_full_drill.py``): a closed-loop round of load, a server's own counters read
from its ``/metrics``, a SIGTERM timed to the process's exit, the per-round throughput ratios of
the drilled server to the plain one, and the result file with its summary."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import subprocess
import time
from pathlib import Path

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


def throughput_ratios(base_rounds: list[dict], drilled_rounds: list[dict]) -> dict:
    """Each round's output tokens/s of the drilled server over the base server's (the rounds
    ran side by side): ``ratio_output_tok_s_median`` and the ``ratios``, to 4 places."""
    ratios = [
        d["output_tok_s"] / b["output_tok_s"]
        for b, d in zip(base_rounds, drilled_rounds, strict=True)
    ]
    return {
        "ratio_output_tok_s_median": round(statistics.median(ratios), 4),
        "ratios": [round(x, 4) for x in ratios],
    }


def write_result(out: dict, folder: Path, name: str) -> None:
    """``out`` as ``folder/<name>.json``; prints its median ratio and its targets."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("ratio_output_tok_s_median", "targets")}, indent=2))
