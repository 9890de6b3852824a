"""CUDA graphs for decode steps on a real GPU (issue 20 item 4; step 5 of ``scripts/gpu_check.sh``).

On the default model in bfloat16, through the engine (``LLM``):

1. **greedy equality**: 16 prompts of mixed lengths, 32 greedy tokens each, run together with
   CUDA graphs (the default) and with ``--enforce-eager``; the outputs must be identical. (The
   graphs freeze the split-K decode kernel's ``max_seq_len`` at the model's maximum length, so
   their splits differ from eager's; a difference would show here first.)
2. **decode ITL at batch 1, 8, 64**: that many requests, 64 greedy tokens each
   (``ignore_eos``); the median wall time of the decode-only steps with all of them running,
   with and without graphs, and the ratio.
3. the capture time at startup.

Run: ``python scripts/gpu_graph_check.py --out r.json``. Exit status 0 when the outputs are
identical and graphs ran, 1 otherwise (speed is reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "bright",
    "stars",
    "watch",
]


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[: 3 + i % 11]) + f" {i}." * (1 + i % 4) for i in range(n)]


def decode_step_ms(llm: LLM, batch: int, tokens: int = 64) -> float:
    llm.step_records.clear()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts(batch), [params] * batch)
    steps = [
        (r.end_ns - r.start_ns) / 1e6
        for r in llm.step_records
        if r.num_prefill_tokens == 0 and r.num_running == batch and r.num_sampled
    ]
    return statistics.median(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    common = dict(device="cuda", dtype="bfloat16", max_num_seqs=64)
    t0 = time.perf_counter()
    graphs = LLM(args.model, **common)
    startup_graphs = time.perf_counter() - t0
    t0 = time.perf_counter()
    eager = LLM(args.model, **common, enforce_eager=True)
    startup_eager = time.perf_counter() - t0
    runner = graphs.core.runner
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "captured_sizes": runner.graphs.sizes if runner.graphs else None,
        "graphs_off_reason": runner.native_off_reason,
        "startup_s": {"graphs": startup_graphs, "eager": startup_eager},
    }
    params = SamplingParams(temperature=0, max_tokens=32)
    ps = prompts(16)
    got = [r.token_ids for r in graphs.generate(ps, [params] * 16)]
    ran_graphs = sum(1 for r in graphs.step_records if r.compiled)
    want = [r.token_ids for r in eager.generate(ps, [params] * 16)]
    same = sum(a == b for a, b in zip(got, want, strict=True))
    result["greedy"] = {"prompts": 16, "identical": same, "graph_steps": ran_graphs}
    result["decode_step_ms"] = {}
    for batch in (1, 8, 64):
        g, e = decode_step_ms(graphs, batch), decode_step_ms(eager, batch)
        result["decode_step_ms"][batch] = {"graphs": g, "eager": e, "speedup": e / g}
        print(f"batch {batch:>2}: decode step {g:.2f} ms with graphs, {e:.2f} eager ({e / g:.2f}x)")
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"graphs {result['captured_sizes']} (startup {startup_graphs:.1f} s vs "
        f"{startup_eager:.1f} s eager); greedy identical {same}/16, {ran_graphs} graph steps"
    )
    return 0 if same == 16 and ran_graphs else 1


if __name__ == "__main__":
    sys.exit(main())
