"""Kernel benchmarks (GPU): each Triton kernel against its torch reference, and the attention
kernels against ``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out
contiguously (SDPA cannot read a paged cache; the gather is not timed).

Reports achieved HBM bandwidth for the memory-bound kernels (decode attention, store_kv,
rms_norm, rotary, silu_and_mul) and TFLOP/s for prefill attention, as fractions of the GPU's
peaks (defaults: H200, about 4.8 TB/s and 790 dense bf16 TFLOP/s), and checks the targets:

- decode attention >= 70% of peak bandwidth at batch 64 x 4k context;
- prefill attention >= 40% of peak bf16 TFLOP/s at 8k tokens;
- no kernel slower than its torch reference.

Writes JSON (``--out``) and prints a short table. ``--sweep`` also times a few tile
configurations of the two attention kernels and records the best. ``--smoke`` runs tiny shapes
(on a CPU under ``TRITON_INTERPRET=1`` too) only to check that the script itself works: its
numbers mean nothing.

Usage: ``python benchmarks/kernels.py [--out benchmarks/out/kernels.json] [--sweep]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

# Attention shapes of a Llama-3-8B-like layer: 32 query heads on 8 KV heads, head_dim 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336


@dataclass
class Result:
    """One kernel measured at one shape."""

    name: str
    shape: str
    triton_ms: float
    torch_ms: float | None = None
    sdpa_ms: float | None = None
    bytes: int | None = None
    flops: float | None = None
    tb_per_s: float | None = None
    tflop_per_s: float | None = None
    frac_peak_bw: float | None = None
    frac_peak_flops: float | None = None
    speedup_vs_torch: float | None = None
    speedup_vs_sdpa: float | None = None
    target: str | None = None
    meets_target: bool | None = None
    config: dict = field(default_factory=dict)


def timer(device: torch.device, warmup: int, rep: int):
    """``time_ms(fn)``: median milliseconds per call. On CUDA Triton's ``do_bench`` (CUDA
    events, L2 flushed between calls); elsewhere wall-clock (smoke runs only)."""
    if device.type == "cuda":
        import triton.testing

        def time_ms(fn):
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

        return time_ms

    def time_ms(fn):
        fn()
        samples = []
        for _ in range(max(1, min(rep // 25, 3))):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return time_ms


def paged_setup(specs, device, dtype, seed=0):
    """Random paged K/V cache on shuffled blocks, queries for the new tokens and the metadata,
    for sequences ``specs = [(cached, new), ...]``."""
    from tokenmill.engine.attention import SeqChunk, build_step_inputs

    need = [-(-(c + n) // BLOCK_SIZE) for c, n in specs]
    ids = list(range(sum(need)))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (len(ids), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    step = build_step_inputs(
        [SeqChunk(c, n, t) for (c, n), t in zip(specs, tables)], BLOCK_SIZE, device
    )
    tokens = sum(n for _, n in specs)
    query = torch.randn((tokens, NUM_HEADS, HEAD_DIM), generator=gen, device=device, dtype=dtype)
    return query, k_cache, v_cache, step.metadata


def step_args(metadata):
    """The attention kernels' step arguments (tensors and sizes) out of the engine's metadata."""
    m = metadata
    return m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len, m.max_seq_len


def reference_attention(q, kc, vc, metadata, scale):
    """The torch reference as the ``torch`` backend runs it: its loop reads the host copies of
    the metadata (no device-to-host sync)."""
    from tokenmill.kernels.reference import paged_attention

    m = metadata
    return paged_attention(
        q,
        kc,
        vc,
        *step_args(m),
        scale,
        query_start_loc_host=m.query_start_loc_host,
        seq_lens_host=m.seq_lens_host,
    )


def dense_kv(cache, metadata, seq):
    """One sequence's keys (or values) gathered contiguous: ``[Hkv, L, D]``."""
    length = metadata.seq_lens_host[seq]
    nblk = -(-length // BLOCK_SIZE)
    table = metadata.block_tables[seq, :nblk].long()
    return cache[table].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:length].transpose(0, 1)


def sdpa(q, k, v, causal):
    """SDPA with GQA: native ``enable_gqa`` when this torch has it, else repeated KV heads."""
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except (TypeError, RuntimeError):
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def fill(r: Result, peaks, torch_ms=None, sdpa_ms=None) -> Result:
    r.torch_ms, r.sdpa_ms = torch_ms, sdpa_ms
    seconds = r.triton_ms / 1e3
    if r.bytes:
        r.tb_per_s = r.bytes / seconds / 1e12
        r.frac_peak_bw = r.bytes / seconds / peaks["bw"]
    if r.flops:
        r.tflop_per_s = r.flops / seconds / 1e12
        r.frac_peak_flops = r.flops / seconds / peaks["flops"]
    if torch_ms:
        r.speedup_vs_torch = torch_ms / r.triton_ms
    if sdpa_ms:
        r.speedup_vs_sdpa = sdpa_ms / r.triton_ms
    return r


def sweep_tiles(label, knobs, configs, attend, time_ms, result):
    """Time ``attend(**cfg)`` at each tile config (``knobs`` name the values of each tuple of
    ``configs``), skipping those that do not fit; each timing becomes ``result(ms, cfg)``.
    Returns the rows and the fastest of them (None when none ran)."""
    rows, best = [], None
    for values in configs:
        cfg = dict(zip(knobs, values, strict=True))
        try:
            ms = time_ms(lambda cfg=cfg: attend(**cfg))
        except Exception as exc:  # a config that does not fit (shared memory, registers)
            print(f"  sweep {label} {cfg}: {type(exc).__name__}", file=sys.stderr)
            continue
        rows.append(result(ms, cfg))
        if best is None or ms < best.triton_ms:
            best = rows[-1]
    return rows, best


def bench_decode(args, device, dtype, time_ms, peaks, sweep):
    from tokenmill.kernels.paged_attention import paged_attention
    from tokenmill.kernels.paged_decode_attention import paged_decode_attention

    batch, ctx = args.decode_batch, args.decode_context
    q, kc, vc, meta = paged_setup([(ctx - 1, 1)] * batch, device, dtype)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size()
    shape = f"batch {batch} x ctx {ctx}, {NUM_HEADS}/{NUM_KV_HEADS} heads, d{HEAD_DIM}"

    tri_ms = time_ms(lambda: paged_decode_attention(q, kc, vc, *step_args(meta), scale))
    torch_ms = time_ms(lambda: reference_attention(q, kc, vc, meta, scale))
    ks = torch.stack([dense_kv(kc, meta, i) for i in range(batch)])  # [B, Hkv, L, D]
    vs = torch.stack([dense_kv(vc, meta, i) for i in range(batch)])
    qs = q[:, :, None, :]  # [B, H, 1, D]
    sdpa_ms = time_ms(lambda: sdpa(qs, ks, vs, False))
    mixed_ms = time_ms(lambda: paged_attention(q, kc, vc, *step_args(meta), scale))
    results = [
        fill(
            Result(
                "decode_attention (split-K)",
                shape,
                tri_ms,
                bytes=io_bytes,
                target=">= 0.70 of peak HBM bandwidth",
            ),
            peaks,
            torch_ms,
            sdpa_ms,
        ),
        fill(
            Result("decode_attention (mixed kernel)", shape, mixed_ms, bytes=io_bytes),
            peaks,
            torch_ms,
            sdpa_ms,
        ),
    ]
    results[0].meets_target = (results[0].frac_peak_bw or 0) >= 0.70
    best = None
    if sweep:
        rows, best = sweep_tiles(
            "decode",
            ("partition_size", "block_n", "num_warps", "num_stages"),
            [
                (512, 64, 4, 3),
                (256, 64, 4, 3),
                (1024, 64, 4, 3),
                (512, 128, 4, 3),
                (512, 32, 4, 4),
                (512, 64, 8, 3),
            ],
            lambda **cfg: paged_decode_attention(q, kc, vc, *step_args(meta), scale, **cfg),
            time_ms,
            lambda ms, cfg: fill(
                Result("decode_attention sweep", shape, ms, bytes=io_bytes, config=cfg), peaks
            ),
        )
        results += rows
    return results, best


def bench_prefill(args, device, dtype, time_ms, peaks, sweep):
    from tokenmill.kernels.paged_attention import paged_attention

    results, best = [], None
    scale = HEAD_DIM**-0.5
    for batch, length in [(1, args.prefill_tokens), (4, args.prefill_tokens // 4)]:
        q, kc, vc, meta = paged_setup([(0, length)] * batch, device, dtype)
        # causal: each query sees (position + 1) keys; 2 FLOPs per MAC, QK^T and PV
        flops = 4.0 * batch * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2
        shape = f"{batch} x {length} tokens, {NUM_HEADS}/{NUM_KV_HEADS} heads, d{HEAD_DIM}"
        tri_ms = time_ms(
            lambda q=q, kc=kc, vc=vc, meta=meta: paged_attention(q, kc, vc, *step_args(meta), scale)
        )
        torch_ms = time_ms(
            lambda q=q, kc=kc, vc=vc, meta=meta: reference_attention(q, kc, vc, meta, scale)
        )
        ks = torch.stack([dense_kv(kc, meta, i) for i in range(batch)])
        vs = torch.stack([dense_kv(vc, meta, i) for i in range(batch)])
        qs = q.view(batch, length, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        sdpa_ms = time_ms(lambda qs=qs, ks=ks, vs=vs: sdpa(qs, ks, vs, True))
        r = fill(Result("prefill_attention", shape, tri_ms, flops=flops), peaks, torch_ms, sdpa_ms)
        if batch == 1:
            r.target = ">= 0.40 of peak bf16 TFLOP/s"
            r.meets_target = (r.frac_peak_flops or 0) >= 0.40
        results.append(r)
        if sweep and batch == 1:
            rows, best = sweep_tiles(
                "prefill",
                ("block_m", "block_n", "num_warps", "num_stages"),
                [
                    (128, 64, 8, 3),
                    (128, 128, 8, 3),
                    (128, 64, 4, 3),
                    (64, 64, 4, 3),
                    (128, 32, 4, 4),
                    (128, 64, 8, 4),
                ],
                lambda q=q, kc=kc, vc=vc, meta=meta, **cfg: paged_attention(
                    q, kc, vc, *step_args(meta), scale, **cfg
                ),
                time_ms,
                lambda ms, cfg, shape=shape, flops=flops: fill(
                    Result("prefill_attention sweep", shape, ms, flops=flops, config=cfg), peaks
                ),
            )
            results += rows
    return results, best


def bench_elementwise(args, device, dtype, time_ms, peaks):
    from tokenmill.engine.attention import SeqChunk, build_step_inputs
    from tokenmill.kernels import rms_norm as rn
    from tokenmill.kernels import rotary_embedding as rope
    from tokenmill.kernels import silu_and_mul as sm
    from tokenmill.kernels import store_kv as skv

    results = []
    t = args.tokens
    el = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=dt)

    # store_kv: a prefill's worth of tokens into shuffled blocks
    nblk = -(-t // BLOCK_SIZE)
    ids = list(range(nblk))
    random.Random(0).shuffle(ids)
    slots = build_step_inputs([SeqChunk(0, t, ids)], BLOCK_SIZE, device).metadata.slot_mapping
    key, value = randn(t, NUM_KV_HEADS, HEAD_DIM), randn(t, NUM_KV_HEADS, HEAD_DIM)
    kc = torch.zeros((nblk, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    nbytes = 4 * key.numel() * el + slots.numel() * 8
    results.append(
        fill(
            Result(
                "store_kv",
                f"{t} tokens x {NUM_KV_HEADS} kv heads x d{HEAD_DIM}",
                time_ms(lambda: skv.store_kv(key, value, kc, vc, slots)),
                bytes=nbytes,
            ),
            peaks,
            time_ms(lambda: skv.reference_store_kv(key, value, kc, vc, slots)),
        )
    )

    x, res, w = randn(t, HIDDEN), randn(t, HIDDEN), randn(HIDDEN)
    results.append(
        fill(
            Result(
                "rms_norm",
                f"{t} x {HIDDEN}",
                time_ms(lambda: rn.rms_norm(x, w, 1e-5)),
                bytes=2 * x.numel() * el,
            ),
            peaks,
            time_ms(lambda: rn.reference_rms_norm(x, w, 1e-5)),
        )
    )
    results.append(
        fill(
            Result(
                "fused_add_rms_norm",
                f"{t} x {HIDDEN}",
                time_ms(lambda: rn.fused_add_rms_norm(x, res, w, 1e-5)),
                bytes=4 * x.numel() * el,
            ),
            peaks,
            time_ms(lambda: rn.reference_fused_add_rms_norm(x, res, w, 1e-5)),
        )
    )

    q, k = randn(t, NUM_HEADS, HEAD_DIM), randn(t, NUM_KV_HEADS, HEAD_DIM)
    angles = randn(t, HEAD_DIM // 2, dt=torch.float32) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    # ours rotates q and k in place on every call (a rotation: magnitudes stay put), the torch
    # reference allocates new tensors
    results.append(
        fill(
            Result(
                "rotary_embedding",
                f"{t} tokens, {NUM_HEADS}+{NUM_KV_HEADS} heads x d{HEAD_DIM}",
                time_ms(lambda: rope.rotary_embedding(q, k, cos, sin)),
                bytes=2 * (q.numel() + k.numel()) * el + 2 * cos.numel() * 4,
            ),
            peaks,
            time_ms(lambda: rope.reference_rotary_embedding(q, k, cos, sin)),
        )
    )

    gu = randn(t, 2 * INTERMEDIATE)
    results.append(
        fill(
            Result(
                "silu_and_mul",
                f"{t} x {INTERMEDIATE}",
                time_ms(lambda: sm.silu_and_mul(gu)),
                bytes=3 * t * INTERMEDIATE * el,
            ),
            peaks,
            time_ms(lambda: sm.reference_silu_and_mul(gu)),
        )
    )
    return results


def fmt(v, spec: str) -> str:
    """``format(v, spec)``, or a dash as wide as ``spec`` asks for when there is no value."""
    return format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)


def print_table(results: list[Result]) -> None:
    head = f"{'kernel':30} {'shape':46} {'triton ms':>10} {'torch ms':>10} {'sdpa ms':>9} {'TB/s':>6} {'%BW':>5} {'TFLOP/s':>8} {'%FLOP':>6} {'x torch':>8}"
    print(head)
    print("-" * len(head))
    for r in results:
        if r.config:
            continue
        print(
            f"{r.name:30} {r.shape[:46]:46} {fmt(r.triton_ms, '10.4f')} {fmt(r.torch_ms, '10.4f')} "
            f"{fmt(r.sdpa_ms, '9.4f')} {fmt(r.tb_per_s, '6.2f')} "
            f"{fmt(r.frac_peak_bw and 100 * r.frac_peak_bw, '5.1f')} {fmt(r.tflop_per_s, '8.1f')} "
            f"{fmt(r.frac_peak_flops and 100 * r.frac_peak_flops, '6.1f')} "
            f"{fmt(r.speedup_vs_torch, '8.2f')}"
        )


def main(argv: list[str] | None = None) -> int:
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE  # smaller under --smoke
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default="benchmarks/out/kernels.json", help="JSON results file (folder made)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--peak-bw-tbs", type=float, default=4.8, help="HBM peak, TB/s (H200)")
    parser.add_argument(
        "--peak-tflops", type=float, default=790.0, help="dense 16-bit peak, TFLOP/s (H200)"
    )
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument(
        "--tokens", type=int, default=8192, help="rows for the element-wise kernels"
    )
    parser.add_argument("--sweep", action="store_true", help="also time a few tile configs")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, any device: checks the script only"
    )
    args = parser.parse_args(argv)

    if args.smoke:
        args.decode_batch, args.decode_context, args.prefill_tokens, args.tokens = 2, 40, 48, 8
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 4, 2, 64, 64, 96
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py needs a CUDA GPU (use --smoke to check the script)",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        dtype = torch.float32  # the interpreter's bf16 is emulated; the smoke run checks plumbing
    peaks = {"bw": args.peak_bw_tbs * 1e12, "flops": args.peak_tflops * 1e12}
    time_ms = timer(device, warmup=25, rep=100)
    sweep = args.sweep and not args.smoke

    results: list[Result] = []
    with torch.inference_mode():
        decode, best_decode = bench_decode(args, device, dtype, time_ms, peaks, sweep)
        results += decode
        prefill, best_prefill = bench_prefill(args, device, dtype, time_ms, peaks, sweep)
        results += prefill
        results += bench_elementwise(args, device, dtype, time_ms, peaks)

    main_rows = [r for r in results if not r.config]
    slower = [
        r.name for r in main_rows if r.speedup_vs_torch is not None and r.speedup_vs_torch < 1
    ]
    targets = {
        "decode_bw_ge_70pct": main_rows[0].meets_target,
        "prefill_flops_ge_40pct": next(
            r.meets_target for r in main_rows if r.name == "prefill_attention"
        ),
        "no_kernel_slower_than_torch": not slower,
    }
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "smoke": args.smoke,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "peaks": {"hbm_tb_per_s": args.peak_bw_tbs, "dense_tflop_per_s": args.peak_tflops},
        "targets": targets,
        "slower_than_torch": slower,
        "best_sweep_config": {
            "decode": asdict(best_decode) if best_decode else None,
            "prefill": asdict(best_prefill) if best_prefill else None,
        },
        "results": [asdict(r) for r in results],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(results)
    print(f"targets: {json.dumps(targets)}")
    if slower:
        print(f"slower than torch: {', '.join(slower)}")
    for kind, best in (("decode", best_decode), ("prefill", best_prefill)):
        if best is not None:
            print(f"best {kind} config: {best.config} {best.triton_ms:.4f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
