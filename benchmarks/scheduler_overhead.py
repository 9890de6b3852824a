"""CPU cost of one engine step outside the forward, with 256 running decodes.

A stub stands in for the model, so only our own Python is timed:
- ``schedule_and_bookkeeping``: ``Scheduler.schedule()`` + ``update_after_step()`` (computed-token
  counts, prefix-cache registration) + appending each sampled token (the issue-4 target:
  median <= 2 ms);
- ``input_prep``: laying the step out for the model (positions, slot mapping, block tables);
- ``full_core_step``: ``EngineCore.step()`` with a stub runner, which adds sampling (argmax over a
  256-token vocabulary) and incremental detokenization with the real SmolLM2 tokenizer.

Results go to ``benchmarks/results/scheduler_overhead.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from tokenmill.engine.attention import SeqChunk, build_step_inputs
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCore, resolve_model_dir
from tokenmill.engine.request import Request
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.tokenizer import load_tokenizer

OUT = Path(__file__).parent / "results"
NUM_SEQS, PROMPT, STEPS, BLOCK = 256, 128, 200, 16
VOCAB = 256


class StubRunner:
    """Returns fixed logits; no model, no KV cache."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.model_config = SimpleNamespace(
            vocab_size=VOCAB, max_position_embeddings=8192, eos_token_ids=()
        )
        self._logits = torch.zeros(NUM_SEQS, VOCAB)
        self._logits[:, 42] = 1.0  # token 42 decodes to text, so the detokenizer works

    def execute(self, out):
        n = sum(1 for c in out.chunks if c.samples)
        return self._logits[:n]


def config() -> EngineConfig:
    return EngineConfig(
        max_num_seqs=NUM_SEQS, max_num_batched_tokens=NUM_SEQS * PROMPT, block_size=BLOCK
    )


def bench_scheduler() -> dict:
    cfg = config()
    s = Scheduler(cfg, BlockManager(NUM_SEQS * 40, BLOCK), max_model_len=8192)
    for i in range(NUM_SEQS):
        s.add_request(
            Request(
                f"r{i}",
                [(i * 7 + j) % 1000 for j in range(PROMPT)],
                SamplingParams(max_tokens=1000, ignore_eos=True),
            )
        )
    sched_ms, prep_ms = [], []
    for step in range(STEPS + 1):
        t0 = time.perf_counter()
        out = s.schedule()
        for chunk in s.update_after_step(out):
            chunk.request.append_token(42, 0)
        t1 = time.perf_counter()
        build_step_inputs(
            [SeqChunk(c.start, c.num_new_tokens, c.request.block_ids) for c in out.chunks], BLOCK
        )
        t2 = time.perf_counter()
        if step:  # step 0 is the prefill of all 256 prompts
            assert out.num_decode_tokens == NUM_SEQS
            sched_ms.append((t1 - t0) * 1e3)
            prep_ms.append((t2 - t1) * 1e3)
    return {"schedule_and_bookkeeping_ms": summary(sched_ms), "input_prep_ms": summary(prep_ms)}


def bench_core() -> dict:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    core = EngineCore(config(), runner=StubRunner(NUM_SEQS * 40), tokenizer=tokenizer)
    for i in range(NUM_SEQS):
        core.add_request(
            f"r{i}",
            [(i * 7 + j) % (VOCAB - 1) + 1 for j in range(PROMPT)],
            SamplingParams(max_tokens=1000, ignore_eos=True),
        )
    times = []
    for step in range(STEPS + 1):
        t0 = time.perf_counter()
        core.step()
        if step:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"full_core_step_ms": summary(times)}


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "median": statistics.median(xs),
        "p90": xs[int(0.9 * len(xs))],
        "max": xs[-1],
        "n": len(xs),
    }


def main() -> None:
    result = {
        "benchmark": "scheduler_overhead",
        "date": time.strftime("%Y-%m-%d"),
        "setup": {
            "running_decodes": NUM_SEQS,
            "prompt_tokens": PROMPT,
            "block_size": BLOCK,
            "steps": STEPS,
        },
        **bench_scheduler(),
        **bench_core(),
        "target": {"schedule_and_bookkeeping_ms_median_max": 2.0},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "scheduler_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    for key in ("schedule_and_bookkeeping_ms", "input_prep_ms", "full_core_step_ms"):
        r = result[key]
        print(f"{key:<30} median {r['median']:.3f}  p90 {r['p90']:.3f}  max {r['max']:.3f}")


if __name__ == "__main__":
    main()
