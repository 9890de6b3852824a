"""Prefill/decode disaggregation on this 2-core CPU (issue 17): what a burst of long prompts
does to the inter-token latency of streams already running, colocated and disaggregated, one
run.

Workload (both modes, the same wall-clock schedule): ``STREAMS`` greedy requests with short
prompts and ``STREAM_TOKENS`` output tokens start at t = 0; at t = ``BURST_AT_S`` a burst of
``BURST`` prompts of ``BURST_PROMPT`` tokens (``BURST_TOKENS`` output tokens each) arrives.

- **colocated**: one engine core on both cores (torch threads 2) with chunked prefill (the
  default 2048-token step budget): every step that carries a prefill chunk of the burst makes
  the running streams wait for it. Also with a ``SMALL_BUDGET`` of 256 tokens, the colocated
  operator's own remedy (smaller chunks: smaller spikes, more of them, later first tokens).
- **disaggregated**: a prefill engine core pinned to core 0 and a decode engine core pinned to
  core 1 (``os.sched_setaffinity``, one torch thread each), two processes in one gloo group.
  Every request is prefilled on the prefill core (``hand_off``), its KV sent whole
  (``send_handoff``) and decoded on the decode core (``adopt``).

Reported per mode: ITL p50 / p99 / max of the streams (every gap between two of their tokens,
the first gap included: in disaggregated mode it holds the transfer), the burst's TTFT p50,
the streams' and burst's wall time, and for disaggregated the transfers' ms and bytes. The
target (issue 17): disaggregated ITL p99 <= 1/3 of colocated.

This is the engine part only: the two cores are driven by this script, not yet by ``tokenmill
serve``. Results: ``benchmarks/results/disaggregation.json``. Run it alone:
``.venv/bin/python benchmarks/disaggregation.py``
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import random
import socket
import statistics
import threading
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"
STREAMS = 6
STREAM_TOKENS = 120
BURST = 3
BURST_PROMPT = 1500
BURST_TOKENS = 8
BURST_AT_S = 2.0
SMALL_BUDGET = 256


def _workload(vocab: int):
    """``[(request_id, prompt ids, max_tokens, at_s)]``: the streams, then the burst (random
    ids, distinct per prompt: no prefix hits)."""
    rng = random.Random(0)
    out = []
    for i in range(STREAMS):
        ids = [rng.randrange(100, vocab) for _ in range(24)]
        out.append((f"s{i}", ids, STREAM_TOKENS, 0.0))
    for i in range(BURST):
        ids = [rng.randrange(100, vocab) for _ in range(BURST_PROMPT)]
        out.append((f"b{i}", ids, BURST_TOKENS, BURST_AT_S))
    return out


def _params(max_tokens: int):
    from tokenmill.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _summary(token_ns: dict[str, list[int]], arrival_ns: dict[str, int]) -> dict:
    gaps = [
        (b - a) / 1e6
        for rid, ns in token_ns.items()
        if rid.startswith("s")
        for a, b in itertools.pairwise(ns)
    ]
    gaps.sort()
    ttft = [(ns[0] - arrival_ns[rid]) / 1e6 for rid, ns in token_ns.items() if rid.startswith("b")]
    return {
        "stream_gaps": len(gaps),
        "itl_p50_ms": statistics.median(gaps),
        "itl_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "itl_max_ms": gaps[-1],
        "burst_ttft_p50_ms": statistics.median(ttft),
    }


def colocated(budget: int | None = None) -> dict:
    """One engine core on both cores, chunked prefill (``budget``: the step's token budget,
    None = the default); the schedule driven from this loop."""
    from tokenmill.engine.llm import LLM

    llm = LLM(device="cpu", **({"max_num_batched_tokens": budget} if budget else {}))
    core = llm.core
    llm.generate(["warm up"], _params(4))
    work = _workload(core.runner.model_config.vocab_size)
    token_ns: dict[str, list[int]] = {rid: [] for rid, *_ in work}
    arrival: dict[str, int] = {}
    pending, done = list(work), set()
    t0 = time.perf_counter()
    while len(done) < len(work):
        now = time.perf_counter() - t0
        while pending and pending[0][3] <= now:
            rid, ids, n, _ = pending.pop(0)
            arrival[rid] = time.time_ns()
            core.add_request(rid, ids, _params(n), arrival_ns=arrival[rid])
        outs, _ = core.step()
        if not outs and not core.has_work():
            time.sleep(0.001)
        for out in outs:
            token_ns[out.request_id] += out.token_ns
            if out.finished:
                done.add(out.request_id)
    return {"wall_s": time.perf_counter() - t0, **_summary(token_ns, arrival)}


def _pin(cpu: int):
    import torch

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)


def _prefill_side(port: int, inbox, ready, cpu: int) -> None:
    """Rank 0: prefill every request it is sent and hand each to rank 1."""
    import torch.distributed as dist

    from tokenmill.engine.llm import LLM
    from tokenmill.engine.parallel.kv_transfer import send_end, send_handoff

    _pin(cpu)
    llm = LLM(device="cpu", cpu_threads=1)
    llm.generate(["warm up"], _params(4))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    core, ended = llm.core, False
    ready.put("prefill")
    while not ended or core.has_work():
        try:
            while True:
                item = inbox.get_nowait() if core.has_work() else inbox.get(timeout=0.05)
                if item is None:
                    ended = True
                    break
                rid, ids, n, arrival = item
                core.add_request(rid, ids, _params(n), arrival_ns=arrival, hand_off=True)
        except queue_mod.Empty:
            pass
        outs, _ = core.step()
        for out in outs:
            if out.finish_reason == "handoff":
                send_handoff(core.take_handoff(out.request_id), 1)
    send_end(1)
    dist.destroy_process_group()


def _decode_side(port: int, outbox, ready, cpu: int) -> None:
    """Rank 1: adopt every hand-off (a receiving thread) and decode it; report token times."""
    import torch.distributed as dist

    from tokenmill.engine.llm import LLM
    from tokenmill.engine.parallel.kv_transfer import recv_handoff

    _pin(cpu)
    llm = LLM(device="cpu", cpu_threads=1)
    llm.generate(["warm up"], _params(4))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    arrived: queue_mod.Queue = queue_mod.Queue()

    def receive():
        while (h := recv_handoff(0)) is not None:
            arrived.put(h)
        arrived.put(None)

    threading.Thread(target=receive, daemon=True).start()
    ready.put("decode")
    core = llm.core
    token_ns: dict[str, list[int]] = {}
    transfers, waiting, ended = [], [], False
    while not ended or waiting or core.has_work():
        try:
            while True:
                h = (
                    arrived.get_nowait()
                    if (core.has_work() or waiting)
                    else arrived.get(timeout=0.05)
                )
                if h is None:
                    ended = True
                    break
                waiting.append(h)
                token_ns[h.request_id] = [h.first_token_ns]
                transfers.append((h.transfer_ms, h.transfer_bytes))
        except queue_mod.Empty:
            pass
        waiting = [h for h in waiting if core.adopt(h) is None]
        outs, _ = core.step()
        for out in outs:
            token_ns[out.request_id] += out.token_ns
    outbox.put({"token_ns": token_ns, "transfers": transfers})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disaggregated() -> dict:
    """Prefill on core 0, decode on core 1, the schedule fed from this process."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_fetch import fetch_default_model

    vocab = load_model_config(fetch_default_model()).vocab_size
    ctx = mp.get_context("spawn")
    inbox, outbox, ready = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_prefill_side, args=(port, inbox, ready, 0)),
        ctx.Process(target=_decode_side, args=(port, outbox, ready, 1)),
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=600)
        work = _workload(vocab)
        arrival: dict[str, int] = {}
        t0 = time.perf_counter()
        for rid, ids, n, at in work:
            time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            arrival[rid] = time.time_ns()
            inbox.put((rid, ids, n, arrival[rid]))
        inbox.put(None)
        got = outbox.get(timeout=900)
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    ms = [t for t, _ in got["transfers"]]
    size = [b for _, b in got["transfers"]]
    return {
        "wall_s": wall,
        **_summary(got["token_ns"], arrival),
        "transfers": len(ms),
        "transfer_ms_p50": statistics.median(ms),
        "transfer_ms_max": max(ms),
        "transfer_mb_max": max(size) / 1e6,
    }


def main() -> None:
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores: one for prefill, one for decode")
    rows = {
        "colocated": colocated(),
        f"colocated, budget {SMALL_BUDGET}": colocated(SMALL_BUDGET),
        "disaggregated": disaggregated(),
    }
    # the target is against the default; the small budget is the colocated operator's own
    # answer to the same problem (shorter chunks: smaller ITL spikes, longer TTFT)
    ratio = rows["disaggregated"]["itl_p99_ms"] / rows["colocated"]["itl_p99_ms"]
    ratio_small = (
        rows["disaggregated"]["itl_p99_ms"]
        / rows[f"colocated, budget {SMALL_BUDGET}"]["itl_p99_ms"]
    )
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "workload": {
            "streams": STREAMS,
            "stream_tokens": STREAM_TOKENS,
            "burst": BURST,
            "burst_prompt_tokens": BURST_PROMPT,
            "burst_tokens": BURST_TOKENS,
            "burst_at_s": BURST_AT_S,
        },
        **rows,
        "itl_p99_ratio": ratio,
        "itl_p99_ratio_vs_small_budget": ratio_small,
        "target_met": ratio <= 1 / 3,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "disaggregation.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| mode | ITL p50 ms | ITL p99 ms | ITL max ms | burst TTFT p50 ms | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['itl_max_ms']:.1f} "
            f"| {r['burst_ttft_p50_ms']:.0f} | {r['wall_s']:.1f} |"
        )
    d = rows["disaggregated"]
    print(
        f"ITL p99 disaggregated / colocated = {ratio:.3f} (target <= 0.333), "
        f"/ colocated with budget {SMALL_BUDGET} = {ratio_small:.3f}; "
        f"{d['transfers']} transfers, p50 {d['transfer_ms_p50']:.1f} ms, "
        f"max {d['transfer_ms_max']:.1f} ms, largest {d['transfer_mb_max']:.1f} MB"
    )


if __name__ == "__main__":
    main()
