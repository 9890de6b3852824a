"""Prefill with int8 compute against float32, per int8 path this CPU can run, one run.

Configurations (weights, ``--int8-compute``, oneDNN's ISA cap): float32; int8 and int4
weight-only (their large steps dequantize into a float32 GEMM, as before int8 compute); int8
and int4 with int8 compute on the CPU's own path (``on``: activations as two int8 terms but
in the MLP's gate/up projection, the default), int8 with ``fast`` (one term); and the same two with the path capped lower
(``ONEDNN_MAX_CPU_ISA``: AVX2 everywhere, AVX-512 VNNI as well on an AMX host), so one machine
measures more than one path. Each runs in a fresh process through the offline engine (``LLM``:
the server's scheduler, cache and model without HTTP), on the same prompts:

- **TTFT** of ~500-token prompts (``--prompt-tokens``, random token ids from a fixed seed, a
  new prompt each time: no prefix-cache hits), one request at a time, ``max_tokens=1``: the
  engine's own arrival-to-first-token time; the median over ``--prompts`` (8) after a warm-up.
- **single-stream ITL** p50 of 2 prompts with 48 output tokens each (the small-row paths,
  which int8 compute leaves alone).

Configurations run round-robin ``--rounds`` times (default 2); a figure is the median over
every round's requests, and each ratio is to float32 in the same run. The host's int8 path
(``engine/int8_compute.py``: ``gemm_isa``) and its CPU flags are printed with every figure.

Targets (TTFT, int8 compute / float32): ≤ 0.55 on AVX2, ≤ 0.40 on AVX-512 VNNI, ≤ 0.25 with
AMX; int4 with int8 compute never slower than float32. Results:
``benchmarks/results/int8_prefill.json``. Run it alone on the machine.

Run: ``.venv/bin/python benchmarks/int8_prefill.py``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"
TARGETS = {"avx2": 0.55, "avx2_vnni": 0.55, "avx512_vnni": 0.40, "amx": 0.25}
# the cap that forces each lower path (oneDNN's names)
CAPS = {"avx2": "AVX2", "avx512_vnni": "AVX512_CORE_VNNI"}


def configs(native: str | None) -> list[dict]:
    out = [
        {"name": "float32", "quantization": "none", "int8_compute": "off", "cap": None},
        {"name": "int8 weight-only", "quantization": "int8", "int8_compute": "off", "cap": None},
        {"name": "int4 weight-only", "quantization": "int4", "int8_compute": "off", "cap": None},
    ]
    paths = [native] if native else []
    order = ["avx2", "avx512_vnni", "amx"]
    if native in order:
        paths += [p for p in order[: order.index(native)] if p in CAPS]
    for path in paths:
        cap = None if path == native else CAPS[path]
        modes = [("int8", "on"), ("int4", "on")] + ([("int8", "fast")] if cap is None else [])
        for q, mode in modes:
            label = f"{q} compute{' fast' if mode == 'fast' else ''} ({path})"
            out.append(
                {"name": label, "quantization": q, "int8_compute": mode, "cap": cap,
                 "path_wanted": path}
            )  # fmt: skip
    return out


def one_config(cfg: dict, prompt_tokens: int, prompts: int, seed: int) -> dict:
    """Measure one configuration in this process (a child: its ONEDNN_MAX_CPU_ISA is set)."""
    import torch

    from tokenmill.engine.int8_compute import gemm_isa
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams

    llm = LLM(
        quantization=cfg["quantization"],
        int8_compute=cfg["int8_compute"],
        max_num_batched_tokens=max(2048, prompt_tokens),
    )
    vocab = llm.core.runner.model_config.vocab_size
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(prompt_tokens)]

    first = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt()], first)  # warm-up
    ttft = []
    for _ in range(prompts):
        (r,) = llm.generate([prompt()], first)
        ttft.append(r.ttft_s * 1e3)
    itl = []
    decode = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        (r,) = llm.generate([prompt()[:64]], decode)
        itl.extend(x * 1e3 for x in r.itl_s)
    return {
        **cfg,
        "int8_path_taken": llm.core.runner.int8_compute,
        "int8_isa": gemm_isa(),
        "ttft_ms": [round(x, 2) for x in ttft],
        "itl_ms_p50": round(statistics.median(itl), 3),
        "torch_threads": torch.get_num_threads(),
    }


def _child(cfg: dict, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if cfg["cap"]:
        env["ONEDNN_MAX_CPU_ISA"] = cfg["cap"]
    out = subprocess.run(
        # -P: the benchmarks folder stays off sys.path (its kernels.py would shadow a package
        # transformers looks for)
        [sys.executable, "-P", __file__, "--child", json.dumps(cfg),
         "--prompt-tokens", str(args.prompt_tokens), "--prompts", str(args.prompts),
         "--seed", str(args.seed)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{cfg['name']} failed:\n{out.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


def _flags() -> list[str]:
    from tokenmill.kernels.cpu import cpu_flags

    want = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8")
    have = cpu_flags() or set()
    return [f for f in want if f in have]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT / "int8_prefill.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one configuration, in this process
        res = one_config(json.loads(args.child), args.prompt_tokens, args.prompts, args.seed)
        print("RESULT " + json.dumps(res))
        return 0
    from tokenmill.engine.int8_compute import gemm_isa

    native = gemm_isa()
    from tokenmill.engine.device_peaks import cpu_name

    host = {"cpu": cpu_name(), "flags": _flags(), "int8_path": native}
    print(f"host: {host['cpu']}; flags {' '.join(host['flags'])}; int8 path {native}", flush=True)
    cfgs = configs(native)
    runs: dict[str, list[dict]] = {c["name"]: [] for c in cfgs}
    for r in range(args.rounds):
        for cfg in cfgs:
            t0 = time.perf_counter()
            res = _child(cfg, args)
            runs[cfg["name"]].append(res)
            print(
                f"round {r + 1} {cfg['name']:<26} TTFT p50 {statistics.median(res['ttft_ms']):8.1f} ms"
                f"  ITL p50 {res['itl_ms_p50']:6.2f} ms  path {res['int8_path_taken']}"
                f"  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    rows = {}
    for name, rs in runs.items():
        ttft = [x for res in rs for x in res["ttft_ms"]]
        rows[name] = {
            "quantization": rs[0]["quantization"],
            "int8_compute": rs[0]["int8_compute"],
            "onednn_cap": rs[0]["cap"],
            "int8_path_taken": rs[0]["int8_path_taken"],
            "ttft_p50_ms": round(statistics.median(ttft), 2),
            "ttft_p50_ms_by_round": [round(statistics.median(res["ttft_ms"]), 2) for res in rs],
            "itl_p50_ms": round(statistics.median(res["itl_ms_p50"] for res in rs), 3),
        }
    base = rows["float32"]["ttft_p50_ms"]
    checks = []
    for name, row in rows.items():
        row["ttft_vs_float32"] = round(row["ttft_p50_ms"] / base, 3)
        path = row["int8_path_taken"]
        if row["int8_compute"] != "off" and row["quantization"] == "int8" and path in TARGETS:
            checks.append(
                {"target": f"{name}: TTFT ≤ {TARGETS[path]}× float32", "path": path,
                 "value": row["ttft_vs_float32"], "pass": row["ttft_vs_float32"] <= TARGETS[path]}
            )  # fmt: skip
        if row["int8_compute"] == "on" and row["quantization"] == "int4":
            checks.append(
                {"target": f"{name}: TTFT ≤ float32", "path": path,
                 "value": row["ttft_vs_float32"], "pass": row["ttft_vs_float32"] <= 1.0}
            )  # fmt: skip
    result = {
        "benchmark": "int8_prefill",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": host,
        "python": platform.python_version(),
        "prompt_tokens": args.prompt_tokens,
        "prompts_per_round": args.prompts,
        "rounds": args.rounds,
        "configs": rows,
        "checks": checks,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nhost {host['cpu']} ({' '.join(host['flags'])}), int8 path {native}")
    for name, row in rows.items():
        print(
            f"{name:<26} TTFT p50 {row['ttft_p50_ms']:8.1f} ms  ×{row['ttft_vs_float32']:.3f} "
            f"float32   ITL p50 {row['itl_p50_ms']:6.2f} ms"
        )
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['target']}: {c['value']}")
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
