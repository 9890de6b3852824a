"""Where a small decode step's time goes, against the memory-bandwidth floor, in one run.

Issue 20. On the default model (SmolLM2-135M, float32, this CPU), one process:

- **floor**: a read-bandwidth probe (``torch.sum`` over a 256 MiB float32 tensor, best of 5,
  GB/s; taken at the start and again after the in-process variants) and the floor of a batch-1
  decode step = the weight bytes a decode step reads (``StepRecord.weight_bytes``: every linear
  layer and the LM head once) ÷ the best read bandwidth seen in the run: the probes and the
  GEMV passes below. A floor must not be slower than a pass the same run measured: on
  2026-12-01's VM the first probe read 12.2 GB/s while ``F.linear`` streamed the weights at
  18.3.
- **GEMV pass**: 1, 2, 4, 8, 16, 24 and 32 rows through all of the model's weight matrices in a row (weights
  streamed from memory, as a real step reads them), as ``F.linear`` (MKL), as ``W @ xᵀ`` (one
  row padded to two) and through ``kernels/cpu_gemv.c``; ms per pass and GB/s.
- **split at batch 1, 8, 32**: that many requests (short chat prompts, 48 greedy tokens,
  ``ignore_eos``) through ``EngineCore``; over the decode-only steps with all of them running,
  the median of each stored part (``schedule_ms``, ``prepare_ms``, ``forward_ms``,
  ``sample_ms``, ``detokenize_ms``) and of the step's wall time, each setting in its own
  process (:data:`VARIANTS`): **before** (torch ops, the code until 2026-12-01), **eager**
  (the C kernels of ``kernels/cpu.py`` called layer by layer, ``--enforce-eager``),
  **compiled** (the whole step in one C call, ``engine/models/native_step.py``).
- **through the server**: ``tokenmill serve`` (float32 with torch ops; float32 and
  ``--quantization int8``, each eager and compiled; ``--quantization int4`` compiled, on
  int8 activations where the CPU has VNNI and with ``TOKENMILL_INT4_ACT=float32``) in a
  subprocess and one streaming client, 3 chat requests one after another (96 tokens,
  ``ignore_eos``); ITL p50 from the SSE chunks' arrival times, and its ratio to the floor
  (targets: ≤ 2× in float32, ≤ 1.5× at the best CPU setting; int8's floor is a quarter of
  float32's, int4's 0.156 of it: half a byte a weight and a 4-byte word per 32).

Results: ``benchmarks/results/step_overhead.json``. Run it alone on the machine (two torch
processes on 2 cores slow each other 10–20×): ``.venv/bin/python benchmarks/step_overhead.py``
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import httpx
import torch
from torch.nn import functional as F

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCore, resolve_model_dir
from tokenmill.engine.models import linear as linear_mod
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import encode_chat
from tokenmill.kernels import cpu as cpu_gemv

OUT = Path(__file__).parent / "results"
PARTS = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "detokenize_ms")
# the API process's parts of a step, stored only through the server
API_PARTS = ("output_send_ms", "stream_write_ms")
BATCHES = (1, 8, 32)
# rows per GEMV pass: where the kernel stops beating F.linear sets cpu.FASTER_ROWS
GEMV_ROWS = (1, 2, 4, 8, 16, 24, 32)
# (TOKENMILL_CPU_KERNELS, PAD_ONE_ROW_OUT_FEATURES of engine/models/linear.py, enforce_eager),
# each run in its own process. The first run's "padded" (torch ops, one row padded to two in
# every layer) is in RESULTS.md; "eager" was that run's "after".
VARIANTS = {
    "before": ("0", 16384, True),  # until 2026-12-01: torch ops, one row padded in the LM head
    "eager": ("1", 0, True),  # the C kernels called layer by layer (--enforce-eager)
    "compiled": ("1", 0, False),  # the compiled decode step: a whole step in one C call
}
PROMPTS = [
    "Tell me a long story about a dragon.",
    "Explain how a bicycle works.",
    "Write a letter to a friend about the sea.",
    "Describe a city at night.",
]


def bandwidth_probe_gbps(mib: int = 256, repeats: int = 5) -> float:
    """Read bandwidth (GB/s): the best of ``repeats`` ``torch.sum`` calls over ``mib`` MiB."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gemv_pass(model: torch.nn.Module, repeats: int = 7) -> dict:
    """ms per pass of :data:`GEMV_ROWS` rows through every 2-D weight of the decoder layers and the LM
    head (weights streamed from memory, as in a step), median of ``repeats``: ``F.linear``,
    ``W @ xᵀ`` (one row padded to two) and the kernel (``kernels/cpu_gemv.c``)."""
    weights = [
        m.weight
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2
    ]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ways = {
        "F.linear": lambda w, x: F.linear(x, w),
        "W @ x^T": lambda w, x: (
            torch.mm(w, torch.cat((x, x)).t())[:, :1] if x.shape[0] == 1 else torch.mm(w, x.t())
        ),
    }
    if cpu_gemv.available():
        ways["cpu_gemv kernel"] = lambda w, x: cpu_gemv.gemv(x, w)
    out: dict = {"weight_bytes": nbytes}
    for rows in GEMV_ROWS:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        for name, fn in ways.items():
            with torch.inference_mode():
                times = [
                    _timed(lambda fn=fn, xs=xs: [fn(w, xs[w.shape[1]]) for w in weights])
                    for _ in range(repeats + 1)
                ]
            ms = statistics.median(times[1:]) * 1e3
            out.setdefault(name, {})[rows] = {"ms": ms, "gbps": nbytes / ms / 1e6}
    return out


def split(core: EngineCore, batch: int, tokens: int = 48) -> dict:
    """Medians of the stored parts over decode-only steps with ``batch`` requests running."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        msgs = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        core.add_request(f"b{batch}-{i}", encode_chat(core.tokenizer, msgs), params)
    records = []
    while core.has_work():
        _, rec = core.step()
        if rec and rec.num_prefill_tokens == 0 and rec.num_running == batch:
            records.append(rec)
    row = {"batch": batch, "steps": len(records)}
    for part in PARTS:
        row[part] = statistics.median(getattr(r, part) for r in records)
    row["step_ms"] = statistics.median((r.end_ns - r.start_ns) / 1e6 for r in records)
    row["weight_bytes"] = records[0].weight_bytes
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(args: list[str], env: dict, tmp: Path):
    """``tokenmill serve ARGS`` in a subprocess (cwd ``tmp``) until the block ends; yields
    its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port), *args],
        cwd=tmp,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / "server.log").read_text()[-2000:])
            try:
                if httpx.get(url + "/health", timeout=2).json()["status"] == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # a clean stop flushes the trace store
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def server_itl(args: list[str], env: dict, requests: int = 3, tokens: int = 96) -> dict:
    """Single-stream ITL through ``tokenmill serve ARGS``: one streaming client, ``requests``
    chat requests one after another; ITL = gaps between SSE chunks that carry text."""
    with tempfile.TemporaryDirectory() as tmp, serving(args, env, Path(tmp)) as url:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        gaps: list[float] = []
        for i in range(requests + 1):  # the first one warms up and is left out
            body = {
                "model": model,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            times = []
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        times.append(time.perf_counter())
            if i:
                gaps += [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    return {"requests": requests, "itl_p50_ms": statistics.median(gaps), "gaps": len(gaps)}


def server_split(args: list[str], tokens: int = 48) -> list[dict]:
    """The whole split through ``tokenmill serve ARGS``: for each batch in :data:`BATCHES`,
    ``tokenmill bench`` with that many streams at once (one request each, 32-token prompts,
    ``tokens`` output tokens, ``ignore_eos``); then, from the server's trace store, the median
    of each part over the decode-only steps with that many requests running: the engine's
    parts (:data:`PARTS`) and the API's, ``output_send_ms`` (the outputs' hop to the API
    process) and ``stream_write_ms`` (the API writing them to the streams)."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "traces.duckdb"
        with serving([*args, "--trace-db", str(db)], {}, Path(tmp)) as url:
            for batch in (1, *BATCHES):  # the first batch-1 run warms up
                subprocess.run(
                    [sys.executable, "-m", "tokenmill.engine.cli", "bench", "--url", url,
                     "--concurrency", str(batch), "--num-requests", str(batch),
                     "--prompt-tokens", "32", "--output-tokens", str(tokens), "--no-progress"],
                    check=True, capture_output=True, cwd=tmp,
                )  # fmt: skip
        con = duckdb.connect(str(db), read_only=True)
        names = (*PARTS, *API_PARTS, "step_ms")
        rows = []
        for batch in BATCHES:
            sql = (
                "SELECT count(*), "
                + ", ".join(f"median({p})" for p in PARTS + API_PARTS)
                + ", median((end_ns - start_ns) / 1e6) FROM engine_steps "
                "WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0 AND num_running = ?"
            )
            n, *values = con.execute(sql, [batch]).fetchone()
            rows.append({"batch": batch, "steps": n, **dict(zip(names, values, strict=True))})
        con.close()
    return rows


def one_variant(name: str) -> dict:
    """The split at every batch size for ``VARIANTS[name]`` (set in this process's environment
    by :func:`main`)."""
    _, pad, eager = VARIANTS[name]
    linear_mod.PAD_ONE_ROW_OUT_FEATURES = pad
    core = EngineCore(EngineConfig(model=str(resolve_model_dir(None)), enforce_eager=eager))
    split(core, 1, tokens=8)  # warm-up
    return {
        "ops": core.runner.model.model.norm.ops.name,
        "rows": [split(core, b) for b in BATCHES],
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print(json.dumps(one_variant(sys.argv[2])))
        return 0
    torch.set_num_threads(2)
    probe = bandwidth_probe_gbps()
    core = EngineCore(EngineConfig(model=str(resolve_model_dir(None))))
    result: dict = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bandwidth_probe_gbps": probe,
        "gemv_pass": gemv_pass(core.runner.model),
        "split": {},
    }
    weight_bytes = split(core, 1, tokens=4)["weight_bytes"]
    del core
    for name, (kernels, _, _) in VARIANTS.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--variant", name],
            env={**os.environ, "TOKENMILL_CPU_KERNELS": kernels},
            capture_output=True,
            text=True,
            check=True,
        )
        result["split"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["bandwidth_probe_end_gbps"] = probe_end = bandwidth_probe_gbps()
    best_pass = max(
        r["gbps"]
        for by_rows in result["gemv_pass"].values()
        if isinstance(by_rows, dict)
        for r in by_rows.values()
    )
    result["read_gbps"] = read_gbps = max(probe, probe_end, best_pass)
    result["floor_ms"] = weight_bytes / read_gbps / 1e9 * 1e3
    result["cpu_kernels"] = cpu_gemv.unavailable_reason() or "used"
    # int8's floor: the same step's weights in int8, one byte a weight plus a float32 scale per
    # 32 (the C kernels' groups); int4's: half a byte a weight plus its (scale, zero) word per
    # 32 (a fifth of its bytes)
    result["floor_ms_int8"] = result["floor_ms"] * (1 + 4 / 32) / 4
    result["floor_ms_int4"] = result["floor_ms"] * (0.5 + 4 / 32) / 4
    result["server"] = {}
    for name, args, env, floor in (
        ("float32, torch ops (before)", [], {"TOKENMILL_CPU_KERNELS": "0"}, result["floor_ms"]),
        ("float32, --enforce-eager", ["--enforce-eager"], {}, result["floor_ms"]),
        ("float32", [], {}, result["floor_ms"]),
        (
            "int8, --enforce-eager",
            ["--quantization", "int8", "--enforce-eager"],
            {},
            result["floor_ms_int8"],
        ),
        ("int8", ["--quantization", "int8"], {}, result["floor_ms_int8"]),
        (
            "int4, float32 activations",
            ["--quantization", "int4"],
            {"TOKENMILL_INT4_ACT": "float32"},
            result["floor_ms_int4"],
        ),
        ("int4", ["--quantization", "int4"], {}, result["floor_ms_int4"]),
    ):
        r = server_itl(args, env)
        r["floor_ms"] = floor
        r["itl_vs_floor"] = r["itl_p50_ms"] / floor
        r["output_tok_s"] = 1e3 / r["itl_p50_ms"]
        result["server"][name] = r
    result["server_split"] = {
        name: server_split(args)
        for name, args in (("float32", []), ("int4", ["--quantization", "int4"]))
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "step_overhead.json").write_text(json.dumps(result, indent=2))
    print(
        f"probe {probe:.1f} GB/s (after the variants {probe_end:.1f}), best GEMV pass "
        f"{best_pass:.1f} GB/s; decode weights {weight_bytes / 1e6:.0f} MB; "
        f"floor {result['floor_ms']:.1f} ms at {read_gbps:.1f} GB/s"
    )
    for name, by_rows in result["gemv_pass"].items():
        if isinstance(by_rows, dict):
            print(
                f"GEMV pass {name:>16}: "
                + ", ".join(
                    f"{rows} row(s) {r['ms']:.1f} ms ({r['gbps']:.1f} GB/s)"
                    for rows, r in by_rows.items()
                )
            )
    print("variant batch " + " ".join(f"{p:>13}" for p in (*PARTS, "step_ms")))
    for name, v in result["split"].items():
        for r in v["rows"]:
            print(
                f"{name:>7} {r['batch']:>5} "
                + " ".join(f"{r[p]:13.2f}" for p in (*PARTS, "step_ms"))
            )
    cols = (*PARTS, *API_PARTS, "step_ms")
    print("through the server: variant batch steps " + " ".join(f"{p:>15}" for p in cols))
    for name, rows in result["server_split"].items():
        for r in rows:
            print(
                f"{name:>7} {r['batch']:>5} {r['steps']:>5} "
                + " ".join(f"{r[p]:15.2f}" if r[p] is not None else f"{'-':>15}" for p in cols)
            )
    for name, s in result["server"].items():
        print(
            f"server {name} single stream: ITL p50 {s['itl_p50_ms']:.1f} ms = "
            f"{s['itl_vs_floor']:.2f}x its {s['floor_ms']:.1f} ms floor, "
            f"{s['output_tok_s']:.1f} tok/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
