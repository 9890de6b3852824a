"""What full telemetry costs: output tokens/s of the same server with full telemetry, with
``--no-trace-db``, and with ``--no-tracing``, plus the trace store's ingest rate on its own.

Serving part: three real ``tokenmill serve`` processes (default model, float32, CPU) start side
by side, so each is idle while another is measured and all three pay the same background cost.
Rounds alternate A, B, C, A, B, C, ... (default 3 rounds each): a round is a closed loop of
``--concurrency`` (32) streaming chat requests at a time, ``--requests`` (64) in all, each forced
to ``--max-tokens`` (64) output tokens with ``ignore_eos``. Output tokens/s = completion tokens
(from the streamed ``usage``) / round wall time. One warm-up request per server first.

Ingest part: 9-span traces built from synthetic timelines by the real span code, their rows
queued into a fresh :class:`TraceStore` and flushed, with the process pinned to one core
(``sched_setaffinity``). Reported as spans/s for the store alone (rows pre-built) and for the
whole path (timeline → OTel spans → rows → DuckDB).

Targets (issue 6): full / tracing-off throughput ≥ 0.97 (the median over rounds of the
per-round ratio); store ingest ≥ 50,000 spans/s.
Results: ``benchmarks/results/telemetry_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

OUT = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
CONFIGS = {
    "full": [],  # trace store + spans + sampler + metrics (the default)
    "no_trace_db": ["--no-trace-db"],
    "tracing_off": ["--no-tracing"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, extra: list[str], workdir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    folder = workdir / name
    folder.mkdir()
    log = open(folder / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} server exited: {(folder / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).json()["status"] == "ok":
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} server did not become healthy")


async def one_round(url: str, n: int, concurrency: int, max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def request(ac: httpx.AsyncClient) -> None:
        nonlocal tokens
        async with sem, ac.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as ac:
        t0 = time.perf_counter()
        await asyncio.gather(*(request(ac) for _ in range(n)))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def ingest(n_traces: int) -> dict:
    """Store ingest rate on one core (spans/s)."""
    from tokenmill.engine.api.timeline import RequestTimeline
    from tokenmill.telemetry.spans import (
        StoreSpanProcessor,
        emit_trace,
        make_tracer_provider,
    )
    from tokenmill.telemetry.store import TraceStore

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    def timeline(i: int) -> RequestTimeline:
        t = 1_700_000_000_000_000_000 + i * 10_000_000
        tl = RequestTimeline(arrival_ns=t, method="POST", path="/v1/chat/completions")
        tl.endpoint, tl.request_id, tl.tenant, tl.model = "chat", f"cmpl-{i}", "alpha", MODEL
        tl.stream, tl.max_tokens, tl.stats.input_tokens = True, 64, 40
        tl.gateway_end_ns, tl.tokenize_end_ns, tl.admission_end_ns = t + 10, t + 20, t + 30
        tl.stats.queued_ns, tl.stats.scheduled_ns, tl.stats.first_token_ns = t + 40, t + 50, t + 60
        tl.token_ns = [t + 60 + k * 1000 for k in range(64)]
        tl.stats.output_tokens, tl.finish_reason, tl.http_status = 64, "length", 200
        tl.first_byte_ns, tl.last_byte_ns = t + 70, t + 70_000
        tl.metering_start_ns, tl.metering_end_ns = t + 70_010, t + 70_020
        return tl

    rows: list[dict] = []
    provider = make_tracer_provider({"service.name": "bench"})
    provider.add_span_processor(StoreSpanProcessor(lambda table, row: rows.append(row)))
    tracer = provider.get_tracer("bench")
    for i in range(n_traces):
        emit_trace(tracer, timeline(i))
    n_spans = len(rows)

    with tempfile.TemporaryDirectory() as d:
        store = TraceStore(Path(d) / "ingest.duckdb", max_queue_rows=n_spans + 10)
        t0 = time.perf_counter()
        for row in rows:
            store.submit("spans", row)
        assert store.flush(600)
        store_s = time.perf_counter() - t0
        assert store.query("SELECT count(*) FROM spans") == [(n_spans,)]
        store.close()

        store = TraceStore(Path(d) / "path.duckdb", max_queue_rows=n_spans + 10)
        provider = make_tracer_provider({"service.name": "bench"})
        provider.add_span_processor(StoreSpanProcessor(store.submit))
        tracer = provider.get_tracer("bench")
        t0 = time.perf_counter()
        for i in range(n_traces):
            emit_trace(tracer, timeline(i))
        assert store.flush(600)
        path_s = time.perf_counter() - t0
        store.close()
    return {
        "spans": n_spans,
        "store_only_spans_per_s": n_spans / store_s,
        "timeline_to_duckdb_spans_per_s": n_spans / path_s,
        "one_core": hasattr(os, "sched_setaffinity"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ingest-traces", type=int, default=20_000)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="tm-telemetry-bench-"))
    servers = {}
    try:
        for name, extra in CONFIGS.items():
            servers[name] = start_server(name, extra, workdir)
            asyncio.run(one_round(servers[name][1], 1, 1, 8))  # warm-up
        rounds: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for r in range(args.rounds):
            for name in CONFIGS:
                res = asyncio.run(
                    one_round(servers[name][1], args.requests, args.concurrency, args.max_tokens)
                )
                rounds[name].append(res)
                print(f"round {r + 1} {name:12s} {res['tokens_per_s']:7.1f} tok/s", flush=True)
        health = httpx.get(servers["full"][1] + "/health", timeout=10).json()["telemetry"]
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    tps = {n: statistics.median(x["tokens_per_s"] for x in v) for n, v in rounds.items()}
    # the three configs of one round run back to back, so their ratio cancels slow drifts of a
    # shared machine; the median over rounds drops the round a neighbour disturbed
    paired = {
        name: statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(rounds[name], rounds["tracing_off"], strict=True)
        )
        for name in ("full", "no_trace_db")
    }
    ingest_res = ingest(args.ingest_traces)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "workload": {
            "model": MODEL,
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "loop": "closed",
        },
        "rounds": rounds,
        "median_tokens_per_s": tps,
        "ratio_full_vs_tracing_off": paired["full"],
        "ratio_no_trace_db_vs_tracing_off": paired["no_trace_db"],
        "ratio_of_medians_full_vs_tracing_off": tps["full"] / tps["tracing_off"],
        "full_server_telemetry_health": {
            "dropped_total": health["dropped_total"],
            "written_rows": (health.get("store") or {}).get("written_rows"),
        },
        "ingest": ingest_res,
        "targets": {"ratio_full_vs_tracing_off": 0.97, "store_only_spans_per_s": 50_000},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "telemetry_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_tokens_per_s", "ingest")}, indent=2))
    print(
        f"full / tracing off = {result['ratio_full_vs_tracing_off']:.3f}; "
        f"no-trace-db / tracing off = {result['ratio_no_trace_db_vs_tracing_off']:.3f}"
    )


if __name__ == "__main__":
    main()
