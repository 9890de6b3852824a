"""GPU check of weight-only quantization (issue 14), run by ``scripts/gpu_check.sh``.

On a CUDA device, in bfloat16:

1. Layer check: each scheme's :class:`QuantizedLinear` against its own dequantized weight (the
   packed kernel computes what the scheme stores) and against the float layer (the scheme's
   error), at 1, 64 and 512 rows, on the default model's layer shapes.
2. Engine check per scheme (``none``, ``int8``, ``int4``) on the default model's config: weight
   bytes by dtype, greedy tokens of four prompts compared with ``none`` (first divergence),
   single-stream decode tok/s and ITL p50, output tok/s of 64 concurrent requests, and the
   decode steps' achieved GB/s from the step records' roofline fields against the device peak.

The weights are ``--load-format dummy`` (N(0, 0.02), seeded) unless the model folder holds
safetensors: the device machine cannot fetch the default model, so speed is measured at the
real shapes and agreement says how far each scheme moves the logits of the same weights.

Usage: ``python scripts/gpu_quant_check.py --model FOLDER --out FILE.json``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from tokenmill.engine.device_peaks import resolve_peaks
from tokenmill.engine.llm import LLM
from tokenmill.engine.quantization import QuantizedLinear, weight_bytes_by_dtype
from tokenmill.engine.sampling_params import SamplingParams

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out)


def layer_check(device: str) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for method in ("int8", "int4"):
        for k, n in SHAPES:
            lin = torch.nn.Linear(k, n, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
            lin = lin.to(device=device, dtype=torch.bfloat16)
            q = QuantizedLinear.from_linear(method, lin)
            w = q.dequantize(torch.float32)
            for m in (1, 64, 512):
                x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
                out = q(x).float()
                ref = x.float() @ w.t()
                full = x.float() @ lin.weight.float().t()
                rows.append(
                    {
                        "method": method,
                        "shape": [k, n],
                        "rows": m,
                        "path": q.path,
                        "rel_err_vs_dequantized": ((out - ref).norm() / ref.norm()).item(),
                        "rel_err_vs_float": ((out - full).norm() / full.norm()).item(),
                    }
                )
    return rows


def decode_rate(r) -> float:
    span = (r.token_ns[-1] - r.token_ns[0]) / 1e9
    return (len(r.token_ns) - 1) / span if span > 0 else float("nan")


def engine_check(
    model: str, quant: str, load_format: str, vocab: int, device: str, n: int, tokens: int
) -> dict:
    llm = LLM(
        model,
        device=device,
        dtype="bfloat16",
        quantization=quant,
        load_format=load_format,
        gpu_memory_utilization=0.3,
        max_num_seqs=n,
    )
    weights = weight_bytes_by_dtype(llm.core.runner.model)
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(48)] for _ in range(4)]
    greedy_out = [r.token_ids for r in llm.generate(prompts, greedy)]
    # single stream (after the warm-up above)
    single = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rates, itls = [], []
    for p in prompts[:3]:
        (r,) = llm.generate([p], single)
        rates.append(decode_rate(r))
        itls.extend(r.itl_s)
    # 64 concurrent
    llm.step_records.clear()
    many = [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(n)]
    start = time.perf_counter()
    out = llm.generate(many, single)
    wall = time.perf_counter() - start
    decode_steps = [
        s for s in llm.step_records if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0
    ]
    gbps = [
        (s.weight_bytes + s.kv_read_bytes + s.kv_write_bytes) / (s.forward_ms * 1e6)
        for s in decode_steps
        if s.forward_ms > 0
    ]
    result = {
        "quantization": quant,
        "weight_bytes_by_dtype": weights,
        "weight_bytes_total": sum(weights.values()),
        "greedy_tokens": greedy_out,
        "single_stream_decode_tok_s": statistics.median(rates),
        "single_stream_itl_p50_ms": statistics.median(itls) * 1e3,
        "concurrent_output_tok_s": sum(len(r.token_ids) for r in out) / wall,
        "concurrent_requests": n,
        "decode_steps": len(decode_steps),
        "decode_achieved_gbps_p50": statistics.median(gbps) if gbps else None,
    }
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF folder (config + tokenizer)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrent", type=int, default=64, help="requests at once")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    args = parser.parse_args()
    model = Path(args.model)
    load_format = "auto" if any(model.glob("*.safetensors")) else "dummy"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    report: dict = {
        "device": args.device,
        "torch": torch.__version__,
        "load_format": load_format,
        "peaks": resolve_peaks(args.device, "bfloat16"),
    }
    print("peaks", report["peaks"], flush=True)
    report["layers"] = layer_check(args.device)
    for row in report["layers"]:
        print(
            f"layer {row['method']} {row['shape']} rows={row['rows']} path={row['path']} "
            f"err_vs_dequant={row['rel_err_vs_dequantized']:.4f} "
            f"err_vs_float={row['rel_err_vs_float']:.4f}",
            flush=True,
        )
    report["engine"] = []
    for quant in ("none", "int8", "int4"):
        res = engine_check(
            str(model), quant, load_format, vocab, args.device, args.concurrent, args.tokens
        )
        report["engine"].append(res)
        print(
            f"engine {quant}: weights {res['weight_bytes_total'] / 2**20:.1f} MiB, single "
            f"{res['single_stream_decode_tok_s']:.1f} tok/s (ITL p50 "
            f"{res['single_stream_itl_p50_ms']:.2f} ms), {args.concurrent} concurrent "
            f"{res['concurrent_output_tok_s']:.0f} tok/s, decode GB/s p50 "
            f"{res['decode_achieved_gbps_p50']}",
            flush=True,
        )
    base = report["engine"][0]["greedy_tokens"]
    for res in report["engine"][1:]:
        res["first_divergence_vs_none"] = [
            first_divergence(a, b) for a, b in zip(base, res["greedy_tokens"], strict=True)
        ]
        print(
            f"greedy {res['quantization']} vs none: first divergence "
            f"{res['first_divergence_vs_none']}"
        )
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
