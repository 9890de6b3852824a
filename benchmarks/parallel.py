"""Tensor and data parallelism on this CPU: a step's compute against its collectives, and
throughput on one engine against two replicas, one run.

**Tensor parallelism** (issue 16). The default model (SmolLM2-135M: 9 query heads, 3 KV heads) on 1 and 3
gloo ranks (``--tensor-parallel-size``; 2 does not divide 9 heads), each in a fresh process
through the offline engine (``LLM``): 8 greedy requests at once, 48 output tokens each, and
the same 8 one at a time. Over the decode-only steps with every request running: the median
step time, ``forward_ms`` and ``collective_ms`` (rank 0's time sending the step and in the two
all-reduces a layer), and the collectives' share of the forward.

On a 2-core machine three ranks share two cores, so this cannot show a speed-up; what it shows
is what the split costs (the seed's pitfall 5: tensor parallelism all-reduces twice a layer,
hidden behind prefill, exposed in decode) and how the step records carry it.

**Data parallelism**: ``tokenmill serve`` with ``--data-parallel-size`` 1 and 2 (two replicas
of one core each), 32 concurrent greedy streamed requests of 48 tokens through the API;
output tok/s (tokens / wall time) and TTFT p50 / p99. The two sizes alternate ``DP_ROUNDS``
times in one run and each keeps its best round. Two replicas split the same two cores one
engine already uses with two threads, so this cannot show a speed-up either: it shows what a
second process costs or saves here.

Results: ``benchmarks/results/parallel.json``. Run it alone:
``.venv/bin/python benchmarks/parallel.py``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"
SIZES = (1, 3)
TOKENS = 48
DP_SIZES = (1, 2)
DP_ROUNDS = 2
DP_REQUESTS = 32


def one(tp: int, batch: int) -> dict:
    """Measure one tensor-parallel size at one batch in this process (a child process)."""
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams

    llm = LLM(tensor_parallel_size=tp, device="cpu", kv_cache_memory=256 * 2**20)
    try:
        prompts = [f"Tell me about the number {i} in two sentences." for i in range(batch)]
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        llm.step_records.clear()
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        steps = [
            r
            for r in llm.step_records
            if r.num_prefill_tokens == 0 and r.num_decode_tokens == batch and r.num_sampled
        ]
        forward = [r.forward_ms for r in steps]
        coll = [r.collective_ms or 0.0 for r in steps]
        step = [(r.end_ns - r.start_ns) / 1e6 for r in steps]
        return {
            "tensor_parallel_size": tp,
            "batch": batch,
            "decode_steps": len(steps),
            "step_ms_p50": round(statistics.median(step), 2),
            "forward_ms_p50": round(statistics.median(forward), 2),
            "collective_ms_p50": round(statistics.median(coll), 2),
            "collective_share_p50": round(
                statistics.median(c / f for c, f in zip(coll, forward)), 3
            ),
            "collective_bytes_per_step": steps[0].collective_bytes if steps else None,
            "output_tok_s": round(batch * TOKENS / wall, 2),
        }
    finally:
        llm.close()


def serve_dp(dp: int) -> dict:
    """32 concurrent streamed greedy requests through ``tokenmill serve --data-parallel-size
    dp`` (no trace store); output tok/s and TTFT percentiles (ms)."""
    import asyncio
    import os
    import signal
    import socket
    import tempfile

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port)),
                *("--data-parallel-size", str(dp), "--no-trace-db"),
            ],
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).json()["status"] == "ok":
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.5)

            async def one(ac, i: int) -> tuple[float, int]:
                body = {
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                    "max_tokens": TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                start, ttft, n = time.perf_counter(), None, 0
                async with ac.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            ttft = ttft or time.perf_counter() - start
                            n += 1
                return ttft or 0.0, n

            async def load():
                async with httpx.AsyncClient(base_url=url, timeout=600) as ac:
                    await one(ac, -1)  # warm-up
                    start = time.perf_counter()
                    res = await asyncio.gather(*(one(ac, i) for i in range(DP_REQUESTS)))
                    return time.perf_counter() - start, res

            wall, res = asyncio.run(load())
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    ttfts = sorted(t * 1e3 for t, _ in res)
    return {
        "data_parallel_size": dp,
        "requests": DP_REQUESTS,
        "output_tokens": sum(n for _, n in res),
        "output_tok_s": round(sum(n for _, n in res) / wall, 2),
        "ttft_p50_ms": round(statistics.median(ttfts), 1),
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "cpu_count": os.cpu_count(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="TP/BATCH: measure one setting here")
    args = parser.parse_args()
    if args.only:
        tp, batch = map(int, args.only.split("/"))
        print(json.dumps(one(tp, batch)))
        return 0
    rows = []
    for batch in (1, 8):
        for tp in SIZES:
            proc = subprocess.run(
                [sys.executable, __file__, "--only", f"{tp}/{batch}"],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"TP={tp} batch {batch}: step {row['step_ms_p50']:.1f} ms, forward "
                f"{row['forward_ms_p50']:.1f} ms, collectives {row['collective_ms_p50']:.1f} ms "
                f"({row['collective_share_p50']:.0%} of the forward), "
                f"{row['output_tok_s']:.1f} output tok/s",
                flush=True,
            )
    dp_rounds: dict[int, list[dict]] = {dp: [] for dp in DP_SIZES}
    for _ in range(DP_ROUNDS):
        for dp in DP_SIZES:
            row = serve_dp(dp)
            dp_rounds[dp].append(row)
            print(
                f"DP={dp}: {row['output_tok_s']:.1f} output tok/s, TTFT p50 "
                f"{row['ttft_p50_ms']:.0f} ms, p99 {row['ttft_p99_ms']:.0f} ms",
                flush=True,
            )
    dp_best = [max(dp_rounds[dp], key=lambda r: r["output_tok_s"]) for dp in DP_SIZES]
    OUT.mkdir(exist_ok=True)
    report = {
        "benchmark": "parallel",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "tokens": TOKENS,
        "rows": rows,
        "data_parallel": {"best": dp_best, "rounds": dp_rounds},
    }
    (OUT / "parallel.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {OUT / 'parallel.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
