"""Compile every kernel ahead of time for a GPU target, without a GPU.

The CPU test suite runs the kernels under Triton's interpreter, which executes the Python body
and never lowers it; this check takes the other half: each kernel, in the configurations the
wrappers launch on CUDA (16-bit and float32, head_dim 64/128, GQA groups, sliding window on and
off, direct and split decode), goes through Triton's real compiler down to a cubin for
``--arch`` (default ``90``: H100/H200) with ``ptxas``. No launch, so no driver is needed.

Run: ``TRITON_INTERPRET=0 python -m tokenmill.kernels.compile_check [--arch 90]``; prints one
line per variant and exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _variants():
    """``(label, kernel, pointer dtypes, constexprs, options)`` for each variant to compile."""
    from . import paged_attention as pa
    from . import paged_decode_attention as pda
    from . import rms_norm, rotary_embedding, silu_and_mul, store_kv

    out = []
    for dt in ("bf16", "fp32"):
        for head_dim, group in ((64, 3), (128, 4), (128, 1)):
            for max_q in (2048, 3):
                for window in (False, True):
                    bm, bn, warps, stages = pa.default_blocks(
                        max_q, group, head_dim, True, 4 if dt == "fp32" else 2
                    )
                    out.append(
                        (
                            f"paged_attention {dt} d{head_dim} g{group} q{max_q} window={window}",
                            pa._paged_attention_kernel,
                            {"": dt},
                            dict(
                                GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_Q=bm // group,
                                BLOCK_M=bm, BLOCK_N=bn, KV_BLOCK_SIZE=16, USE_WINDOW=window,
                                PREC="tf32x3" if dt == "fp32" else "tf32", DOT_F32=False, RTNE=False,
                            ),
                            dict(num_warps=warps, num_stages=stages),
                        )
                    )  # fmt: skip
            for direct in (True, False):
                for window in (False, True):
                    out.append(
                        (
                            f"decode_split {dt} d{head_dim} g{group} direct={direct} window={window}",
                            pda._decode_split_kernel,
                            {"": dt, "part_out_ptr": "fp32", "part_m_ptr": "fp32", "part_l_ptr": "fp32"},
                            dict(
                                NUM_HEADS=8 * group, GROUP=group, BLOCK_G=max(16, group), HEAD_DIM=head_dim,
                                BLOCK_D=head_dim, BLOCK_N=64, PARTITION=512, KV_BLOCK_SIZE=16,
                                USE_WINDOW=window, DIRECT=direct,
                                PREC="tf32x3" if dt == "fp32" else "tf32", DOT_F32=False, RTNE=False,
                            ),
                            dict(num_warps=4, num_stages=3),
                        )
                    )  # fmt: skip
        out.append(
            (
                f"decode_reduce {dt}",
                pda._decode_reduce_kernel,
                {"": "fp32", "out_ptr": dt},
                dict(NUM_HEADS=32, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16, RTNE=False),
                dict(num_warps=4),
            )
        )
        out.append(
            (
                f"store_kv {dt}",
                store_kv._store_kv_kernel,
                {"": dt},
                dict(NUM_KV_HEADS=8, HEAD_DIM=128, KV_BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, RTNE=False),
                dict(num_warps=4),
            )
        )  # fmt: skip
        for residual in (False, True):
            out.append(
                (
                    f"rms_norm {dt} residual={residual}",
                    rms_norm._rms_norm_kernel,
                    {"": dt},
                    dict(BLOCK=4096, HAS_RESIDUAL=residual, RTNE_X=False, RTNE_OUT=False),
                    dict(num_warps=16),
                )
            )
        out.append(
            (
                f"rotary {dt}",
                rotary_embedding._rotary_kernel,
                {"": dt, "cos_ptr": "fp32", "sin_ptr": "fp32"},
                dict(HALF=64, BLOCK_HALF=64, BLOCK_HQ=32, BLOCK_HKV=8, RTNE_Q=False, RTNE_K=False),
                dict(num_warps=8),
            )
        )
        out.append(
            (
                f"silu_and_mul {dt}",
                silu_and_mul._silu_and_mul_kernel,
                {"": dt},
                dict(BLOCK=1024, RTNE=False),
                dict(num_warps=4),
            )
        )
    # the small tiles the kernel tests use (compiled for real by scripts/gpu_check.sh)
    for dt, bm, bn, group, window in (("fp32", 16, 16, 3, True), ("fp16", 32, 64, 3, False)):
        out.append(
            (
                f"paged_attention test-tiles {dt} m{bm} n{bn} g{group} window={window}",
                pa._paged_attention_kernel,
                {"": dt},
                dict(
                    GROUP=group, HEAD_DIM=64, BLOCK_D=64, BLOCK_Q=bm // group, BLOCK_M=bm,
                    BLOCK_N=bn, KV_BLOCK_SIZE=16, USE_WINDOW=window,
                    PREC="tf32x3" if dt == "fp32" else "tf32", DOT_F32=False, RTNE=False,
                ),
                dict(num_warps=4, num_stages=2),
            )
        )  # fmt: skip
    for dt, bn in (("fp32", 16), ("fp16", 32)):
        out.append(
            (
                f"decode_split test-tiles {dt} n{bn} partition 32",
                pda._decode_split_kernel,
                {"": dt, "part_out_ptr": "fp32", "part_m_ptr": "fp32", "part_l_ptr": "fp32"},
                dict(
                    NUM_HEADS=9, GROUP=3, BLOCK_G=16, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=bn,
                    PARTITION=32, KV_BLOCK_SIZE=16, USE_WINDOW=True, DIRECT=False,
                    PREC="tf32x3" if dt == "fp32" else "tf32", DOT_F32=False, RTNE=False,
                ),
                dict(num_warps=4, num_stages=3),
            )
        )  # fmt: skip
    return out


_INT_POINTERS = {
    "query_start_loc_ptr": "i32",
    "seq_lens_ptr": "i32",
    "block_tables_ptr": "i32",
    "slot_mapping_ptr": "i64",
}
_FLOAT_ARGS = {"scale_log2", "eps"}


def signature(kernel, pointer_dtypes: dict[str, str]) -> dict[str, str]:
    """Triton signature for ``kernel``: pointers typed by name (``""`` = the default data
    dtype), float scalars ``fp32``, other scalars ``i32``, constexprs ``constexpr``."""
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            dt = _INT_POINTERS.get(p.name) or pointer_dtypes.get(p.name) or pointer_dtypes[""]
            sig[p.name] = "*" + dt
        else:
            sig[p.name] = "fp32" if p.name in _FLOAT_ARGS else "i32"
    return sig


def divisibility(kernel) -> dict[tuple[int], list]:
    """Mark every pointer and integer argument divisible by 16, as the JIT does at launch for
    16-byte-aligned tensors and strides that are multiples of 16 (true at the shapes served:
    head_dim 64/128). Without it loads would not vectorise and the check would compile a kernel
    no launch ever runs."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(kernel.params)
        if not p.is_constexpr and p.name not in _FLOAT_ARGS
    }


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int] | None:
    """``(registers, spill bytes)`` that ptxas reports for ``ptx``, or None when Triton's bundled
    ptxas cannot be found."""
    import re
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except Exception:
        return None
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        res = subprocess.run(
            [ptxas, "-v", f"--gpu-name={target.group(1) if target else f'sm_{arch}'}", f.name,
             "-o", os.devnull],
            capture_output=True, text=True,
        )  # fmt: skip
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr)]
    if regs is None:
        return None
    return int(regs.group(1)), sum(spills)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    parser.add_argument("-k", default="", help="only variants whose label contains this")
    parser.add_argument(
        "--no-spills",
        action="store_true",
        help="fail a 16-bit variant whose registers spill to local memory (ptxas -v)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter never compiles", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for label, kernel, ptr_dtypes, constexprs, options in _variants():
        if args.k not in label:
            continue
        start = time.perf_counter()
        try:
            src = ASTSource(kernel, signature(kernel, ptr_dtypes), constexprs, divisibility(kernel))
            compiled = triton.compile(src, target=target, options=options)
            usage = ptxas_usage(compiled.asm["ptx"], args.arch)
            regs = f"{usage[0]} regs, {usage[1]} B spilled" if usage else "ptxas -v unavailable"
            spilled = usage is not None and usage[1] > 0 and "fp32" not in label
            status = "FAIL" if spilled and args.no_spills else "ok  "
            failures += status == "FAIL"
            print(f"{status}  {label}  ({time.perf_counter() - start:.1f}s, {regs})")
        except Exception as exc:  # report every failing variant, not just the first
            failures += 1
            first = str(exc).strip().splitlines()
            print(f"FAIL  {label}: {type(exc).__name__}: {first[0] if first else ''}")
            print(str(exc)[-2000:], file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
