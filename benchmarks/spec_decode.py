"""Speculative decoding (n-gram prompt lookup) against plain decoding, one run, the default
model on this CPU (issue 15).

Three workloads, greedy, each served one request at a time (single stream) and 32 at once:
- ``copy``: 5 prompts that ask to repeat or lightly edit a given passage or piece of code, so
  the answer copies long runs of the prompt: the case prompt lookup is for;
- ``random``: 5 prompts of random words asking for a continuation (the issue's control; a
  small model's greedy continuation repeats the words, so drafts are often accepted);
- ``open``: 5 open questions, whose answers copy little: what speculation costs when drafts
  mostly miss.

The engines are the offline ``LLM`` with the same flags but ``--speculative-config``
(``SPEC`` below, and at 32 concurrent also ``SPEC`` with ``disable_by_batch_size`` 8); each
is warmed up first. Targets: single-stream output tok/s with speculation >= 2x without on
``copy``, >= 0.9x on ``random``; the other ratios are reported next to them. Output tok/s counts every output token over the wall time of the
whole workload. Results go to ``benchmarks/results/spec_decode.json``; run it alone.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import encode_chat

OUT = Path(__file__).parent / "results"
SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
SPEC_CUT = SPEC[:-1] + ', "disable_by_batch_size": 8}'
MAX_TOKENS = 160
CONCURRENT = 32

CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
PASSAGE = (
    "The harbour wakes before the town does. At five the first trawlers come in under a grey "
    "sky, the gulls follow them, and the fish market opens its doors to the buyers from the "
    "restaurants inland. By seven the boxes are loaded, the floor is hosed down, and the only "
    "sound left is the water against the old stone quay."
)
COPY_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this Python function, renaming the parameter `values` to `xs`:\n\n{CODE}",
    f"Copy this paragraph, but write 'harbor' instead of 'harbour':\n\n{PASSAGE}",
    f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    f"Here is a shopping note: {PASSAGE} Now write the same note again, unchanged.",
]
WORDS = [
    "amber",
    "basin",
    "cedar",
    "dune",
    "ember",
    "fjord",
    "gravel",
    "hollow",
    "iris",
    "juniper",
    "kelp",
    "lantern",
    "meadow",
    "nectar",
    "orbit",
    "pebble",
    "quartz",
    "ridge",
    "saffron",
    "tundra",
    "umber",
    "violet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
    "anchor",
    "bramble",
    "cobalt",
    "delta",
]


OPEN_PROMPTS = [
    "Why do leaves change colour in autumn?",
    "Give three tips for a first job interview.",
    "How does a bicycle gear make pedalling easier?",
    "What should I pack for a weekend of hiking in the mountains?",
    "Explain what a database index is to a new programmer.",
]


def random_prompts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [
        "Continue this list with more words: " + " ".join(rng.choice(WORDS) for _ in range(40))
        for _ in range(n)
    ]


def run(llm: LLM, prompts: list[list[int]], concurrent: bool) -> dict:
    """Serve ``prompts`` one at a time or all at once; output tok/s and step counts."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm.step_records.clear()
    t = time.perf_counter()
    if concurrent:
        results = llm.generate(prompts, params)
    else:
        results = [llm.generate([p], params)[0] for p in prompts]
    wall = time.perf_counter() - t
    tokens = sum(len(r.token_ids) for r in results)
    steps = [r for r in llm.step_records if r.num_prefill_tokens + r.num_decode_tokens]
    drafted = sum(r.num_draft_tokens for r in steps)
    accepted = sum(r.num_accepted_tokens for r in steps)
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 2),
        "steps": len(steps),
        "mean_forward_ms": round(sum(r.forward_ms for r in steps) / max(len(steps), 1), 1),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "tokens": [r.token_ids for r in results],
    }


def _drop_tokens(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "tokens"}


def main() -> None:
    off = LLM(dtype="float32")
    on = LLM(dtype="float32", speculative_config=SPEC)
    cut = LLM(dtype="float32", speculative_config=SPEC_CUT)
    tok = off.tokenizer
    workloads = {
        "copy": [encode_chat(tok, p) for p in COPY_PROMPTS],
        "random": [encode_chat(tok, p) for p in random_prompts(5)],
        "open": [encode_chat(tok, p) for p in OPEN_PROMPTS],
    }
    for llm in (off, on, cut):  # warm-up
        llm.generate(workloads["copy"][:2], SamplingParams(temperature=0.0, max_tokens=16))
    rows = []
    for name, prompts in workloads.items():
        for mode in ("single stream", f"{CONCURRENT} concurrent"):
            concurrent = mode != "single stream"
            batch = (
                [prompts[i % len(prompts)] for i in range(CONCURRENT)] if concurrent else prompts
            )
            base = run(off, batch, concurrent)
            variants = {"spec": on}
            if concurrent:
                variants["spec_cut8"] = cut  # at batch 1 it is the same engine as spec
            row = {"workload": name, "mode": mode, "off": _drop_tokens(base)}
            for label, llm in variants.items():
                res = run(llm, batch, concurrent)
                row[label] = _drop_tokens(res)
                row[f"{label}_speedup"] = round(res["output_tok_s"] / base["output_tok_s"], 2)
                row[f"{label}_same_tokens"] = base["tokens"] == res["tokens"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    OUT.mkdir(exist_ok=True)
    path = OUT / "spec_decode.json"
    meta = {"spec_config": json.loads(SPEC), "spec_cut8_config": json.loads(SPEC_CUT)}
    meta.update(max_tokens=MAX_TOKENS, date=time.strftime("%Y-%m-%d"), rows=rows)
    path.write_text(json.dumps(meta, indent=2))
    print(
        "| workload | mode | off tok/s | spec tok/s | × | acceptance | steps off → spec | "
        "forward ms off → spec | cut at 8: tok/s, × | same tokens |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|---|---|")
    for r in rows:
        o, s = r["off"], r["spec"]
        acc = f"{s['acceptance_rate']:.0%}" if s["acceptance_rate"] is not None else "no drafts"
        c = r.get("spec_cut8")
        cut_cell = f"{c['output_tok_s']:.1f}, {r['spec_cut8_speedup']:.2f}" if c else "(= spec)"
        same = r["spec_same_tokens"] and r.get("spec_cut8_same_tokens", True)
        print(
            f"| {r['workload']} | {r['mode']} | {o['output_tok_s']:.1f} | {s['output_tok_s']:.1f} | "
            f"{r['spec_speedup']:.2f} | {acc} | {o['steps']} → {s['steps']} | "
            f"{o['mean_forward_ms']} → {s['mean_forward_ms']} | {cut_cell} | {same} |"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
