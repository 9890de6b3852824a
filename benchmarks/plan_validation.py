"""``tokenmill plan``'s predictions against real runs on this machine, each run repeated.

1. Record: ``tokenmill serve`` (default model and knobs) under an open-loop load at a moderate
   mean rate (``--rate``; bursty arrivals, gamma gaps of shape 0.15, as production traffic
   comes in clumps; 64-512-token prompts, 32-128-token answers, a fixed seed). The bursts are
   what puts decode batches past the compiled step's dozen rows into the recording, the
   regime the higher rates live in; a recording that never ran it cannot price it (the plan
   says so).
2. Predict from that store, before any real run, twice: from the recording alone, and with a
   profile swept from a server of the same setup (``plan --profile``; ``--no-profile`` leaves
   it out): the recording replayed as it was (the sanity floor), 0.5x, 1.5x and 2x the rate,
   ``max_num_seqs=4``, 2 data-parallel replicas at 2x the rate, and a pool of 120 KV blocks
   (preemptions); ``--cases`` picks among them.
3. Run each what-if for real ``--repeats`` times (3): the same load generator with the same
   seed (the same prompts, the arrival gaps divided by the factor) against a fresh server
   started with the what-if's flags; each metric's median over the repeats is the measured
   figure.
4. Recommend: an SLO the recording missed (ITL p99 below 60% of what it measured), the plan's
   best knob setting for it, and that setting run for real.
5. Take each miss apart (``tokenmill plan --check``): each real run's pace (its steps' time
   over the recording's step-cost model's for the same steps: how much slower or faster the
   host ran than while recording), and each prediction again with ``step_time`` set to its
   runs' median pace. What is left is the replay's own error; what goes away came from the host's pace,
   which no recording can foresee.

Predicted and measured use the same summary SQL (``REQUEST_SUMMARY_SQL``). Targets: TTFT and
ITL p50 within 15%, p99 within 30%, goodput within 10 points, preemptions the same order of
magnitude; the as-recorded replay within 10% on TTFT and ITL p50. Results:
``benchmarks/results/plan_validation.json``; the table goes in RESULTS.md. Run it alone
(``make plan-validation``: the five what-ifs of the benchmark's table, 3 repeats, no
recommendation): it takes about 70 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from live_soak import _host  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "plan_validation.json"
LOAD = ["--prompt-tokens", "uniform:64:512", "--output-tokens", "uniform:32:128", "--seed", "7"]
#: what-if → the serve flags that make it real, the rate factor
CASES = {
    "rate=0.5": ([], 0.5),
    "rate=1.5": ([], 1.5),
    "rate=2": ([], 2.0),
    "max_num_seqs=4": (["--max-num-seqs", "4"], 1.0),
    "replicas=2,rate=2": (["--data-parallel-size", "2"], 2.0),
    # a pool a fifth the size: preemptions
    "kv_blocks=120": (["--num-gpu-blocks-override", "120"], 1.0),
}
TARGETS = {"p50": 15.0, "p99": 30.0, "goodput_points": 10.0, "sanity_p50": 10.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record(work: Path, name: str, flags: list[str], rate: float, n: int, burstiness: float) -> Path:
    """One real run into ``work/name/traces.duckdb``; returns the store."""
    from tokenmill.bench.scenario import _free_port, start_server, stop_server

    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    store = out / "traces.duckdb"
    store.unlink(missing_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port),
           "--trace-db", str(store), *flags]  # fmt: skip
    server = start_server(cmd, out, {**__import__("os").environ}, url)
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenmill.engine.cli",
                "bench",
                "--url",
                url,
                "--request-rate",
                f"{rate:g}",
                "--num-requests",
                str(n),
                *LOAD,
                "--burstiness",
                f"{burstiness:g}",
                "--out",
                str(out / "bench.json"),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"bench failed: {r.stderr.strip()[-400:]}")
    finally:
        stop_server(server)
    return store


def plan(store: Path, whatifs: list[str], extra: list[str] = ()) -> dict:
    args = [sys.executable, "-m", "tokenmill.engine.cli", "plan", str(store), "--format", "json"]
    for w in whatifs:
        args += ["--what-if", w]
    r = subprocess.run([*args, *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"plan failed: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout)


def measure(store: Path, slo_text: str | None = None) -> dict:
    from tokenmill.plan.predict import summarize_rows
    from tokenmill.plan.whatif import parse_slo
    from tokenmill.telemetry.dump import open_dump

    con = open_dump(store, verify=False)
    try:
        out = summarize_rows(con, parse_slo(slo_text))
        (pre,) = con.execute("SELECT coalesce(sum(preemptions), 0) FROM requests").fetchone()
        out["preemptions"] = int(pre)
    finally:
        con.close()
    return out


def verdict(pred: dict, real: dict, sanity: bool = False) -> dict:
    """Each metric's error and whether it is within its target."""
    from tokenmill.plan.predict import errors_pct

    errors = errors_pct(pred["summary"], real)
    rows = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "goodput_share"):
        e = errors.get(key)
        bound = (
            TARGETS["goodput_points"]
            if key == "goodput_share"
            else TARGETS["sanity_p50" if sanity else "p50"]
            if "p50" in key
            else TARGETS["p99"]
        )
        rows[key] = {
            "predicted": pred["summary"].get(key),
            "measured": real.get(key),
            "error": e,
            "within": e is not None and abs(e) <= bound,
        }
        span = (pred.get("band") or {}).get(key)
        if span and real.get(key) is not None:
            rows[key]["band"] = span
            rows[key]["in_band"] = span[0] <= real[key] <= span[1]
    p, m = pred["replay"]["preemptions"], real["preemptions"]
    mag = lambda x: math.floor(math.log10(x)) if x > 0 else -1  # noqa: E731
    rows["preemptions"] = {"predicted": p, "measured": m, "within": mag(p) == mag(m)}
    return rows


def pace_table(results: dict) -> str:
    """Each case predicted again at its real run's pace: the errors and the metrics within."""
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    lines = [
        "| what-if | the real runs' pace (median; each) | "
        + " | ".join(k.removesuffix("_ms").replace("_", " ").upper() + " err" for k in keys)
        + " | goodput err | within targets (at the recording's pace) |",
        "|---" * (len(keys) + 4) + "|",
    ]
    for name, case in results.get("at_run_pace", {}).items():
        rows = case["rows"]
        cells = [f"{rows[k]['error']:+.0f}%" + ("" if rows[k]["within"] else " ✗") for k in keys]
        ok = sum(1 for r in rows.values() if r["within"])
        before = sum(1 for r in results["cases"][name].values() if r["within"])
        paces = ", ".join(f"{x:.2f}" for x in case.get("paces", []))
        lines.append(
            f"| {name} | x{case['pace']:.2f}" + (f" ({paces})" if len(case.get("paces", [])) > 1 else "")
            + " | " + " | ".join(cells)
            + f" | {rows['goodput_share']['error']:+.0f} pts | {ok} of {len(rows)} ({before}) |"
        )  # fmt: skip
    return "\n".join(lines)


def in_band(rows: dict) -> str:
    """How many latency metrics' measured value lay inside the prediction's band."""
    banded = [r["in_band"] for r in rows.values() if "in_band" in r]
    return f"{sum(banded)} of {len(banded)}" if banded else ""


def alone(results: dict, name: str) -> str:
    """How many targets the plan from the recording alone met for ``name``."""
    rows = results.get("from_the_recording_alone", {}).get(name)
    return "" if rows is None else f"{sum(r['within'] for r in rows.values())} of {len(rows)}"


def table(results: dict) -> str:
    """The predicted-vs-measured table for RESULTS.md."""
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    head = "| what-if | " + " | ".join(
        f"{k.removesuffix('_ms').replace('_', ' ').upper()} pred / real (err)" for k in keys
    )
    lines = [
        head + " | goodput pred / real | preemptions pred / real | within targets "
        "| from the recording alone | inside the band |",
        "|---" * (len(keys) + 6) + "|",
    ]
    for name, rows in results["cases"].items():
        cells = []
        for k in keys:
            r = rows[k]
            cells.append(
                f"{r['predicted']:,.0f} / {r['measured']:,.0f} ms ({r['error']:+.0f}%)"
                + ("" if r["within"] else " ✗")
            )
        g = rows["goodput_share"]
        p = rows["preemptions"]
        ok = sum(1 for r in rows.values() if r["within"])
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {g['predicted']:.0%} / {g['measured']:.0%} "
            f"({g['error']:+.0f} pts) | {p['predicted']} / {p['measured']} | {ok} of {len(rows)} "
            f"| {alone(results, name)} | {in_band(rows)} |"
        )
    return "\n".join(lines)


def median_metrics(runs: list[dict]) -> dict:
    """Each metric's median over the repeats of one real run (those that have it)."""
    out = {}
    for k in {k for r in runs for k in r}:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = statistics.median(vals)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/tokenmill-plan-validation"))
    ap.add_argument("--rate", type=float, default=1.0, help="the recording's requests/s")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3, help="real runs of each what-if")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="the what-ifs to run, separated by ';' (default: all)")  # fmt: skip
    ap.add_argument("--no-profile", action="store_true",
                    help="plan from the recording alone (no profile swept)")  # fmt: skip
    ap.add_argument("--skip-real", action="store_true", help="record and predict only")
    ap.add_argument("--no-recommend", action="store_true", help="leave out step 4")
    ap.add_argument("--table", action="store_true", help="print the last results' table")
    ap.add_argument("--out", type=Path, default=OUT, help="the results JSON")
    ap.add_argument("--burstiness", type=float, default=0.15, help="gamma shape of the gaps")
    ap.add_argument("--reuse", action="store_true", help="keep the recording and the real runs "
                    "already in --work; run only what is missing")  # fmt: skip
    args = ap.parse_args()
    if args.table:
        doc = json.loads(args.out.read_text())
        print(table(doc) + "\n\n" + pace_table(doc))
        return
    cases = {c: CASES[c] for c in args.cases.split(";") if c}
    began = time.time()
    base = args.work / "record" / "traces.duckdb"
    if not (args.reuse and base.is_file()):
        log(f"recording at {args.rate}/s, {args.requests} requests")
        base = record(args.work, "record", [], args.rate, args.requests, args.burstiness)
    # the plan from the recording alone, then (by default) with a profile swept from a server
    # of the same setup; both are made before any real run
    from tokenmill.plan.profile import profile_path

    prof = profile_path(base)
    if not args.reuse:
        prof.unlink(missing_ok=True)
    aside = prof.with_name(prof.name + ".aside")
    if prof.exists():  # kept from an earlier run (--reuse): set aside for the plain plan
        prof.rename(aside)
    try:
        plain = {p["what_if"]: p for p in plan(base, list(cases))["predictions"]}
    finally:
        if aside.exists():
            aside.rename(prof)
    if not args.no_profile and not profile_path(base).exists():
        from plan_capacity import profile

        profile(args.work, base)
    doc = plan(base, list(cases))
    preds = {p["what_if"]: p for p in doc["predictions"]}
    results = {
        "date": dt.date.today().isoformat(),
        "machine": "2 vCPU, no GPU",
        "host": _host(),
        "rate_per_s": args.rate,
        "requests": args.requests,
        "repeats": args.repeats,
        "load": " ".join(LOAD) + f" --burstiness {args.burstiness:g}",
        "step_cost": doc["step_cost"],
        "error_estimate": doc["error_estimate"],
        "recorded": doc["measured"],
        "cases": {},
        "runs": {},
        "from_the_recording_alone": {},
    }
    rec_real = measure(base)
    results["cases"]["as recorded"] = verdict(preds["as recorded"], rec_real, sanity=True)
    log("as recorded: " + json.dumps(results["cases"]["as recorded"]))
    stores: dict[str, list[Path]] = {"as recorded": [base]}
    if not args.skip_real:
        for whatif, (flags, factor) in cases.items():
            stores[whatif] = []
            for r in range(args.repeats):
                name = whatif.replace(",", "_").replace("=", "-") + f"-r{r + 1}"
                store = args.work / name / "traces.duckdb"
                if not (args.reuse and store.is_file()):
                    log(f"real run: {whatif}, repeat {r + 1} of {args.repeats}")
                    store = record(args.work, name, flags, args.rate * factor,
                                   args.requests, args.burstiness)  # fmt: skip
                stores[whatif].append(store)
            runs = [measure(s) for s in stores[whatif]]
            results["runs"][whatif] = runs
            real = median_metrics(runs)
            results["cases"][whatif] = verdict(preds[whatif], real)
            results["from_the_recording_alone"][whatif] = verdict(plain[whatif], real)
            log(f"{whatif}: " + json.dumps(results["cases"][whatif]))
        # step 5: each real run checked against the plan (``tokenmill plan --check``): its pace;
        # each case planned again at the median pace of its runs, against the median run
        results["at_run_pace"] = {}
        for whatif, runs in stores.items():
            paces = []
            for store in runs:
                c = plan(base, [whatif] if whatif in CASES else [], ["--check", str(store)])
                if c["check"]["at_pace"] is not None:
                    paces.append(c["check"]["pace"])
            if not paces:
                log(f"{whatif}: the runs hold no engine steps, no pace")
                continue
            pace = statistics.median(paces)
            knobs = "" if whatif == "as recorded" else whatif + ","
            again = plan(base, [f"{knobs}step_time={pace:.3f}"])["predictions"][-1]
            real = median_metrics([measure(s) for s in runs])
            rows = verdict(again, real, sanity=whatif == "as recorded")
            results["at_run_pace"][whatif] = {"pace": pace, "paces": paces, "rows": rows}
            log(f"{whatif} at its runs' median pace x{pace:.3f}: " + json.dumps(rows))
    if not args.skip_real and not args.no_recommend:
        # an SLO the recording missed, the plan's recommendation, and that setting for real
        bound = int(rec_real["itl_p99_ms"] * 0.6)
        slo = f"itl_p99<{bound}ms"
        rec = plan(base, [], ["--slo", slo, "--recommend"])["recommendation"]
        results["recommendation"] = {"slo": slo, "recorded_itl_p99_ms": rec_real["itl_p99_ms"]}
        if rec["settings"]:
            best = rec["settings"][0]
            flags = []
            ch = best["changes"]
            if "max_num_seqs" in ch:
                flags += ["--max-num-seqs", str(ch["max_num_seqs"])]
            if "max_num_batched_tokens" in ch:
                flags += ["--max-num-batched-tokens", str(ch["max_num_batched_tokens"])]
            if ch.get("chunked_prefill") is False:
                flags += ["--no-enable-chunked-prefill"]
            store = args.work / "recommended" / "traces.duckdb"
            if not (args.reuse and store.is_file() and (store.parent / "what_if").is_file()
                    and (store.parent / "what_if").read_text() == best["what_if"]):  # fmt: skip
                log(f"recommended {best['what_if']}; real run")
                store = record(
                    args.work, "recommended", flags, args.rate, args.requests, args.burstiness
                )
                (store.parent / "what_if").write_text(best["what_if"])
            real = measure(store, slo)
            results["recommendation"] |= {
                "what_if": best["what_if"],
                "predicted_itl_p99_ms": best["summary"]["itl_p99_ms"],
                "predicted_margin": best["slo_margin"],
                "measured_itl_p99_ms": real["itl_p99_ms"],
                "met": real["itl_p99_ms"] < bound,
            }
        else:
            results["recommendation"]["what_if"] = None
        log("recommendation: " + json.dumps(results["recommendation"]))
    results["seconds"] = round(time.time() - began)
    args.out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
