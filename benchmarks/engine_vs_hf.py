"""Output tokens/s of tokenmill vs Hugging Face transformers ``generate`` on the same workload.

Workload (fixed seed): N requests (default 32), prompt lengths uniform in [32, 256] tokens,
output lengths uniform in [64, 128] tokens (forced with ``ignore_eos`` / ``min_new_tokens``),
greedy, float32, on this machine's CPU. Closed loop, all requests offered at once.

Three systems, measured one after another in one run (compare the ratios, not the absolutes):
- ``hf_one_at_a_time``: ``model.generate`` per request.
- ``hf_static_batch_8``: left-padded batches of 8; a batch runs until its longest output is done,
  so only the requested tokens count.
- ``tokenmill``: the offline engine (continuous batching, chunked prefill, paged KV cache).

Each system gets one short warm-up. Results go to ``benchmarks/results/engine_vs_hf.json``.
Targets (issue 4): tokenmill >= 4x one-at-a-time and >= 1.5x the static-batch figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch
import transformers

from tokenmill.engine.core import resolve_model_dir
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams

OUT = Path(__file__).parent / "results"


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 256))],
            rng.randint(64, 128),
        )
        for _ in range(n)
    ]


@torch.inference_mode()
def hf_one_at_a_time(model, work) -> float:
    start = time.perf_counter()
    for prompt, n in work:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] == len(prompt) + n
    return time.perf_counter() - start


@torch.inference_mode()
def hf_static_batches(model, work, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        n = max(m for _, m in group)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def run_tokenmill(llm: LLM, work) -> tuple[float, dict]:
    llm.step_records.clear()
    start = time.perf_counter()
    results = llm.generate(
        [p for p, _ in work], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in work]
    )
    wall = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == [n for _, n in work]
    ttft = sorted(r.ttft_s for r in results)
    steps = llm.step_records
    return wall, {
        "steps": len(steps),
        "max_running": max(s.num_running for s in steps),
        "median_ttft_s": ttft[len(ttft) // 2],
        "forward_share": sum(s.forward_ms for s in steps) / (wall * 1e3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--skip-one-at-a-time", action="store_true", help="for quick looks; the target needs it"
    )
    args = ap.parse_args()

    model_dir = resolve_model_dir(None)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    work = workload(args.num_requests, args.seed, hf.config.vocab_size)
    out_tokens = sum(n for _, n in work)

    warm = workload(2, 99, hf.config.vocab_size)
    warm = [(p[:32], 4) for p, _ in warm]
    hf_one_at_a_time(hf, warm)
    run_tokenmill(llm, warm)

    rows = {}
    if not args.skip_one_at_a_time:
        t = hf_one_at_a_time(hf, work)
        rows["hf_one_at_a_time"] = {"wall_s": t, "output_tokens_per_s": out_tokens / t}
    t = hf_static_batches(hf, work, args.batch)
    rows[f"hf_static_batch_{args.batch}"] = {"wall_s": t, "output_tokens_per_s": out_tokens / t}
    t, extra = run_tokenmill(llm, work)
    rows["tokenmill"] = {"wall_s": t, "output_tokens_per_s": out_tokens / t, **extra}

    ours = rows["tokenmill"]["output_tokens_per_s"]
    ratios = {
        f"tokenmill_over_{k}": ours / v["output_tokens_per_s"]
        for k, v in rows.items()
        if k != "tokenmill"
    }
    result = {
        "benchmark": "engine_vs_hf",
        "date": time.strftime("%Y-%m-%d"),
        "setup": {
            "model": "SmolLM2-135M-Instruct",
            "dtype": "float32",
            "device": "cpu",
            "cpu_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "num_requests": args.num_requests,
            "prompt_tokens": "uniform 32-256",
            "output_tokens": "uniform 64-128 (ignore_eos)",
            "sampling": "greedy",
            "load": "closed loop, all requests offered at once",
            "total_output_tokens": out_tokens,
        },
        "results": rows,
        "ratios": ratios,
        "targets": {
            "tokenmill_over_hf_one_at_a_time": 4.0,
            f"tokenmill_over_hf_static_batch_{args.batch}": 1.5,
        },
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "engine_vs_hf.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'system':<24}{'wall s':>10}{'out tok/s':>12}")
    for k, v in rows.items():
        print(f"{k:<24}{v['wall_s']:>10.1f}{v['output_tokens_per_s']:>12.1f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")


if __name__ == "__main__":
    main()
