"""Decode speed of float32, bf16, int8 and int4 weights on the default model, one run.

Configurations (``--dtype`` activations, ``--quantization`` weights): float32/none,
bfloat16/none, float32/int8, bfloat16/int8, float32/int4, bfloat16/int4. Each runs in a fresh
process, one after another, through the offline engine (``LLM``: the server's scheduler, cache
and sampler without HTTP), on the same prompts:

- **single stream**: 4 chat prompts one at a time, 96 output tokens each (``ignore_eos``),
  greedy; decode tok/s = (tokens − 1) ÷ (last token time − first token time), the median over
  the prompts, and the ITL p50.
- **32 concurrent**: 32 requests offered at once, prompts uniform 32–256 random token ids,
  outputs uniform 64–128 tokens (the ``engine_vs_hf.py`` workload, seed 0); output tok/s =
  output tokens ÷ wall time.

The configurations run round-robin ``--rounds`` times (default 2) and each figure is the
configuration's best round: this VM's speed drifts by 20-40 % over minutes (2026-12-02: float32
at 32 concurrent 115 then 147 tok/s, int8 single stream 89 then 66, with nothing else running),
so one pass in order let a slow spell land on one configuration; every round is in the JSON.

Targets (issue 14): int8 single-stream ≥ 2.5× float32, int4 ≥ 3.5×; no configuration below
float32 at 32 concurrent. Results: ``benchmarks/results/quantization.json``; run it alone on
the machine (two torch processes on 2 cores slow each other 10–20×).

Run: ``.venv/bin/python benchmarks/quantization.py``
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"
CONFIGS = [
    ("float32", "none"),
    ("bfloat16", "none"),
    ("float32", "int8"),
    ("bfloat16", "int8"),
    ("float32", "int4"),
    ("bfloat16", "int4"),
]
CHATS = [
    "Explain in a few sentences how a paged KV cache works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for writing clear error messages, with one example each.",
    "What are the trade-offs between latency and throughput in a web service?",
]


def one_config(dtype: str, quantization: str, single_tokens: int, concurrent: int) -> dict:
    """Measure one configuration in this process (called in a child process)."""
    import torch

    from tokenmill.engine.llm import LLM
    from tokenmill.engine.quantization import weight_bytes_by_dtype
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.engine.tokenizer import encode_chat

    start = time.perf_counter()
    llm = LLM(dtype=dtype, quantization=quantization)
    load_s = time.perf_counter() - start
    weights = weight_bytes_by_dtype(llm.core.runner.model)
    prompts = [encode_chat(llm.tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=single_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    rates, itls = [], []
    for p in prompts:
        (r,) = llm.generate([p], params)
        span = (r.token_ns[-1] - r.token_ns[0]) / 1e9
        rates.append((len(r.token_ns) - 1) / span)
        itls.extend(r.itl_s)
    rng = random.Random(0)
    vocab = llm.core.runner.model_config.vocab_size
    work = [
        (
            [rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 256))],
            rng.randint(64, 128),
        )
        for _ in range(concurrent)
    ]
    plist = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], plist)
    wall = time.perf_counter() - start
    return {
        "dtype": dtype,
        "quantization": quantization,
        "load_s": round(load_s, 2),
        "weight_bytes_by_dtype": weights,
        "weight_bytes_total": sum(weights.values()),
        "single_stream_decode_tok_s": round(statistics.median(rates), 2),
        "single_stream_decode_tok_s_each": [round(x, 2) for x in rates],
        "single_stream_itl_p50_ms": round(statistics.median(itls) * 1e3, 2),
        "concurrent": concurrent,
        "concurrent_output_tokens": sum(len(r.token_ids) for r in outs),
        "concurrent_wall_s": round(wall, 2),
        "concurrent_output_tok_s": round(sum(len(r.token_ids) for r in outs) / wall, 2),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single-tokens", type=int, default=96)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--only", default=None, help="DTYPE/QUANT: run one config here")
    parser.add_argument("--rounds", type=int, default=2, help="round-robin passes over CONFIGS")
    parser.add_argument("--out", default=str(OUT / "quantization.json"))
    args = parser.parse_args()
    if args.only:
        dtype, quant = args.only.split("/")
        print(json.dumps(one_config(dtype, quant, args.single_tokens, args.concurrent)))
        return 0
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in CONFIGS}
    for round_no in range(1, args.rounds + 1):
        for dtype, quant in CONFIGS:
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--only",
                    f"{dtype}/{quant}",
                    "--single-tokens",
                    str(args.single_tokens),
                    "--concurrent",
                    str(args.concurrent),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[(dtype, quant)].append(row)
            print(
                f"round {round_no} {dtype:>8} {quant:>4}: weights "
                f"{row['weight_bytes_total'] / 2**20:6.1f} MiB, single "
                f"{row['single_stream_decode_tok_s']:6.2f} tok/s (ITL p50 "
                f"{row['single_stream_itl_p50_ms']:.1f} ms), {args.concurrent} concurrent "
                f"{row['concurrent_output_tok_s']:6.2f} tok/s",
                flush=True,
            )
    rows = []
    for each in runs.values():
        # each figure is the config's best round: the configs ran round-robin, so a slow spell
        # of the shared VM costs every config a round rather than one config its only run
        best_single = max(each, key=lambda r: r["single_stream_decode_tok_s"])
        best_conc = max(each, key=lambda r: r["concurrent_output_tok_s"])
        row = dict(best_single)
        for key in ("concurrent_output_tokens", "concurrent_wall_s", "concurrent_output_tok_s"):
            row[key] = best_conc[key]
        row["rounds"] = each
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["single_vs_float32"] = round(
            row["single_stream_decode_tok_s"] / base["single_stream_decode_tok_s"], 2
        )
        row["concurrent_vs_float32"] = round(
            row["concurrent_output_tok_s"] / base["concurrent_output_tok_s"], 2
        )
    best = {
        q: max((r for r in rows if r["quantization"] == q), key=lambda r: r["single_vs_float32"])
        for q in ("int8", "int4")
    }
    targets = {
        "int8_single_ge_2.5x": best["int8"]["single_vs_float32"] >= 2.5,
        "int4_single_ge_3.5x": best["int4"]["single_vs_float32"] >= 3.5,
        "none_below_float32_at_concurrent": all(r["concurrent_vs_float32"] >= 1.0 for r in rows),
    }
    print(f"{'config':>14} {'single x':>9} {'concurrent x':>13}")
    for row in rows:
        print(
            f"{row['dtype'] + '/' + row['quantization']:>14} {row['single_vs_float32']:>9.2f} "
            f"{row['concurrent_vs_float32']:>13.2f}"
        )
    print("targets:", json.dumps(targets))
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "single_tokens": args.single_tokens,
        "rounds": args.rounds,
        "rows": rows,
        "targets": targets,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
