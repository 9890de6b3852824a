#!/usr/bin/env bash
# GPU check of the Triton kernels (issue 3). On a CUDA machine, from the repository root:
#
#   scripts/gpu_check.sh OUTDIR
#
# 1. the kernel tests, compiled for real (TRITON_INTERPRET unset)   -> OUTDIR/kernel_tests.{log,xml}
# 2. the engine's greedy equality on the default model in bfloat16,
#    triton backend vs torch backend                                -> OUTDIR/greedy_bf16.{log,json}
# 3. benchmarks/kernels.py (kernel vs torch vs SDPA, % of H200 peaks) -> OUTDIR/kernels_bench.{log,json}
# 4. scripts/gpu_quant_check.py: int8/int4 layers and engine vs bf16 -> OUTDIR/quantization.{log,json}
# 5. scripts/gpu_graph_check.py: CUDA graphs vs eager, decode ITL     -> OUTDIR/cuda_graphs.{log,json}
# plus OUTDIR/env.txt (versions, nvidia-smi) and OUTDIR/summary.txt (one line per step, targets).
#
# Exit status: 0 when all five steps pass, 1 when one fails, 2 when there is no usable CUDA
# Python. Missed performance targets are reported in summary.txt, not in the exit status.
#
# Environment:
#   PYTHON          interpreter with CUDA torch + triton (default: .venv/bin/python, else python3)
#   TOKENMILL_HOME  where the default model is (or is fetched to); TOKENMILL_MODEL: a converted
#                   model folder to use instead for step 2
#   SWEEP=0         skip the benchmark's tile-configuration sweep
#   STEP_TIMEOUT    seconds allowed per step (default 1200)
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 64
fi
OUTDIR=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT" || exit 1
STEP_TIMEOUT=${STEP_TIMEOUT:-1200}
SUMMARY="$OUTDIR/summary.txt"
: >"$SUMMARY"

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        PYTHON=.venv/bin/python
    else
        PYTHON=python3
    fi
fi

# compiled kernels only: never the interpreter
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    echo "python: $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" - <<'EOF' 2>&1
import torch
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu:", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
try:
    import triton
    print("triton:", triton.__version__)
except ImportError as e:
    print("triton: missing", e)
EOF
    nvidia-smi 2>&1 || echo "nvidia-smi: unavailable"
} >"$OUTDIR/env.txt"

if ! "$PYTHON" -c "import torch, triton, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "FAIL setup: $PYTHON has no CUDA torch + triton (see env.txt)" | tee -a "$SUMMARY"
    exit 2
fi

# make `tokenmill.*` importable without installing: a namespace package of symlinks
if ! "$PYTHON" -c "import tokenmill.engine, tokenmill.kernels" 2>/dev/null; then
    SHIM=$(mktemp -d)
    trap 'rm -rf "$SHIM"' EXIT
    mkdir -p "$SHIM/tokenmill"
    ln -s "$ROOT/engine" "$SHIM/tokenmill/engine"
    ln -s "$ROOT/kernels" "$SHIM/tokenmill/kernels"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    echo "tokenmill: not installed, imported from $SHIM" >>"$OUTDIR/env.txt"
fi

FAILED=0
step() { # step NAME LOGFILE CMD... : run with a timeout, log, record PASS/FAIL
    local name=$1 log=$2
    shift 2
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then
        echo "PASS $name ($((SECONDS - start))s)" | tee -a "$SUMMARY"
    else
        FAILED=1
        echo "FAIL $name (exit $rc, $((SECONDS - start))s; see $(basename "$log"))" | tee -a "$SUMMARY"
    fi
}

# 1. kernel tests, compiled (conftest only turns the interpreter on when CUDA is absent)
step "kernel tests (compiled)" "$OUTDIR/kernel_tests.log" \
    "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rfEs \
    --junitxml="$OUTDIR/kernel_tests.xml" tests/test_kernels_*.py
tail -n 1 "$OUTDIR/kernel_tests.log" | sed 's/^/     /' >>"$SUMMARY"

# 2. engine greedy equality, bfloat16, triton vs torch backend
GREEDY_ARGS=(--device cuda --dtype bfloat16 --max-tokens 32 --out "$OUTDIR/greedy_bf16.json")
if [ -n "${TOKENMILL_MODEL:-}" ]; then
    GREEDY_ARGS+=(--model "$TOKENMILL_MODEL")
fi
step "greedy equality bf16 (triton vs torch)" "$OUTDIR/greedy_bf16.log" \
    "$PYTHON" scripts/greedy_check.py "${GREEDY_ARGS[@]}"
tail -n 1 "$OUTDIR/greedy_bf16.log" | sed 's/^/     /' >>"$SUMMARY"

# 3. benchmarks
BENCH_ARGS=(--out "$OUTDIR/kernels_bench.json")
if [ "${SWEEP:-1}" != "0" ]; then
    BENCH_ARGS+=(--sweep)
fi
step "benchmarks/kernels.py" "$OUTDIR/kernels_bench.log" \
    "$PYTHON" benchmarks/kernels.py "${BENCH_ARGS[@]}"
grep -E '^(targets|slower than torch|best )' "$OUTDIR/kernels_bench.log" | sed 's/^/     /' >>"$SUMMARY"

# 4. weight-only quantization on CUDA (issue 14): layers, engine agreement and speed
step "quantization (bf16 vs int8 vs int4)" "$OUTDIR/quantization.log" \
    "$PYTHON" scripts/gpu_quant_check.py --model "${TOKENMILL_MODEL:-$("$PYTHON" -m tokenmill.engine.cli model path)}" \
    --out "$OUTDIR/quantization.json"
grep -E '^(engine|greedy)' "$OUTDIR/quantization.log" | sed 's/^/     /' >>"$SUMMARY"

# 5. CUDA graphs for decode steps (issue 20): greedy equality with eager, ITL at batch 1/8/64
step "CUDA graphs (greedy vs eager, decode ITL)" "$OUTDIR/cuda_graphs.log" \
    "$PYTHON" scripts/gpu_graph_check.py --out "$OUTDIR/cuda_graphs.json" \
    ${TOKENMILL_MODEL:+--model "$TOKENMILL_MODEL"}
grep -E '^(batch|graphs)' "$OUTDIR/cuda_graphs.log" | sed 's/^/     /' >>"$SUMMARY"

echo "results in $OUTDIR"
cat "$SUMMARY"
exit $FAILED
