"""Engine-level check: the same prompts, greedy, through the engine (``LLM``) once with the
``torch`` attention backend and torch ops, once with ``triton`` (Triton attention, norms, RoPE
and SwiGLU), and the output tokens compared.

Prompts run together with a small token budget per step, so steps mix prefill chunks with
decodes. In 16-bit dtypes the two backends round differently (the torch reference attends in
float32, the kernels multiply bfloat16 probabilities), so a sequence may legitimately part ways
where its top two logits are within rounding of each other. At the first differing token of a
prompt both models score the shared context once more; the divergence counts as a *near tie*
when, in the reference model, the two candidate tokens' logits differ by at most
``--tie-tolerance``. The check passes when every prompt matches exactly or parts at a near tie
(``--strict``: exact matches only).

Run: ``python scripts/greedy_check.py --device cuda --dtype bfloat16 --out r.json`` (step 2 of
``scripts/gpu_check.sh``). Exit status 0 = pass, 1 = fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "The three primary colors are red,",
    "A paged KV cache stores keys and values in",
]
CHATS = [
    "What is the capital of France?",
    "Give me three tips for writing clear error messages.",
]


def last_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """``[vocab]`` float32 next-token logits of ``model`` after ``token_ids`` (one prefill)."""
    from tokenmill.engine.attention import SeqChunk, build_step_inputs
    from tokenmill.engine.kv_cache import allocate_kv_caches

    param = next(model.parameters())
    nblk = -(-len(token_ids) // block_size)
    caches = allocate_kv_caches(model.config, nblk, block_size, param.dtype, param.device)
    step = build_step_inputs(
        [SeqChunk(0, len(token_ids), list(range(nblk)))], block_size, param.device
    )
    with torch.inference_mode():
        hidden = model(
            torch.tensor(token_ids, device=param.device), step.positions, caches, step.metadata
        )
        return model.compute_logits(hidden[step.last_token_indices])[0].cpu()


def build_engine(args, backend: str):
    """An offline engine (``LLM``) on the given attention backend."""
    from tokenmill.engine.llm import LLM

    engine_args = dict(
        device=args.device,
        dtype=args.dtype,
        attention_backend=backend,
        max_num_batched_tokens=args.step_tokens,
        enable_prefix_caching=False,
    )
    if args.model and not any(Path(args.model).glob("*.safetensors")):
        # a folder of config + tokenizer only (a device machine that cannot fetch the model):
        # the same seeded random weights in both engines
        engine_args["load_format"] = "dummy"
    if torch.device(args.device).type == "cuda":
        # two engines live side by side: a fixed cache (the profiled budget would count the
        # first engine's cache as the second one's peak use)
        engine_args["num_gpu_blocks_override"] = args.num_blocks
    return LLM(args.model, **engine_args)


def generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy output token ids per prompt, and the seconds it took."""
    from tokenmill.engine.sampling import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(o.token_ids) for o in outs], time.perf_counter() - start


def compare(args) -> dict:
    """Run both backends and compare; returns the JSON-able report."""
    from tokenmill.engine.tokenizer import encode_chat

    ref_llm = build_engine(args, "torch")
    tok = ref_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[: args.num_prompts]]
    prompts += [encode_chat(tok, c) for c in CHATS[: max(0, args.num_prompts - len(PROMPTS))]]
    ref_out, ref_s = generate(ref_llm, prompts, args.max_tokens)
    tri_llm = build_engine(args, "triton")
    tri_out, tri_s = generate(tri_llm, prompts, args.max_tokens)
    ref_model = ref_llm.core.runner.model
    tri_model = tri_llm.core.runner.model
    assert tri_model.backend.name == "triton" and ref_model.backend.name == "torch"

    rows, ok = [], True
    for p, a, b in zip(prompts, ref_out, tri_out):
        row = {
            "prompt": tok.decode(p)[-80:],
            "prompt_tokens": len(p),
            "torch_tokens": len(a),
            "triton_tokens": len(b),
            "exact": a == b,
            "torch_text": tok.decode(a),
            "triton_text": tok.decode(b),
        }
        if a != b:
            j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            row["first_divergence"] = j
            if j < min(len(a), len(b)):
                context = p + a[:j]
                ref_logits = last_logits(ref_model, context)
                tri_logits = last_logits(tri_model, context)
                gap = float(ref_logits[a[j]] - ref_logits[b[j]])
                row.update(
                    torch_choice=a[j],
                    triton_choice=b[j],
                    ref_logit_gap=gap,
                    triton_logit_gap=float(tri_logits[b[j]] - tri_logits[a[j]]),
                    max_abs_logit_diff=float((ref_logits - tri_logits).abs().max()),
                    near_tie=gap <= args.tie_tolerance,
                )
            else:  # one stopped (EOS) where the other went on: not a near tie by definition
                row["near_tie"] = False
            ok &= bool(row["near_tie"]) and not args.strict
        rows.append(row)
    return {
        "model": str(args.model or "default (SmolLM2-135M-Instruct)"),
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if torch.device(args.device).type == "cuda"
        else "cpu",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "step_tokens": args.step_tokens,
        "tie_tolerance": args.tie_tolerance,
        "strict": args.strict,
        "exact_matches": sum(r["exact"] for r in rows),
        "prompts": len(rows),
        "torch_s": ref_s,
        "triton_s": tri_s,
        "pass": ok,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS) + len(CHATS))
    parser.add_argument(
        "--step-tokens", type=int, default=48, help="max_num_batched_tokens (mixes steps)"
    )
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per engine (CUDA)")
    parser.add_argument("--tie-tolerance", type=float, default=0.25)
    parser.add_argument("--strict", action="store_true", help="exact token equality only")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    report = compare(args)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for r in report["rows"]:
        status = "exact" if r["exact"] else ("near-tie" if r.get("near_tie") else "DIFFERS")
        print(f"{status:9} {r['prompt']!r}: {r['triton_text'][:60]!r}")
    print(
        f"{report['exact_matches']}/{report['prompts']} exact, "
        f"{'PASS' if report['pass'] else 'FAIL'} ({args.dtype}, {args.device})"
    )
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
