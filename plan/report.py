"""``tokenmill plan``'s output: the JSON contract (``schema_version`` 1) and its text rendering."""

from __future__ import annotations

import io
import json

from rich import box
from rich.console import Console
from rich.table import Table

from tokenmill.diagnose.compare import LABELS as _LABELS

from .predict import METRICS

PLAN_SCHEMA_VERSION = 1

_REPLAY = (
    ("preemptions", "preemptions", "{:,}"),
    ("waiting_mean", "waiting, mean", "{:.1f}"),
    ("waiting_max", "waiting, max", "{:,}"),
    ("running_mean", "running, mean", "{:.1f}"),
    ("kv_usage_mean", "KV use, mean", "{:.0%}"),
    ("kv_usage_max", "KV use, max", "{:.0%}"),
    ("throughput_tok_s", "output tok/s", "{:.1f}"),
)


def to_json(doc: dict) -> str:
    return json.dumps({"schema_version": PLAN_SCHEMA_VERSION, **doc}, indent=2, default=float)


def _fmt(key: str, v) -> str:
    if v is None:
        return "–"
    if key == "goodput_share":
        return f"{v:.0%}"
    return f"{v:,.0f} ms" if v >= 100 else f"{v:,.1f} ms"


def _err(e, key: str = "") -> str:
    if e is None:
        return "–"
    return f"{e:+.0f} pts" if key == "goodput_share" else f"{e:+.0f}%"


def to_text(doc: dict, width: int = 120) -> str:
    """The plan as a terminal report."""
    console = Console(width=width, record=True, file=io.StringIO())
    rec = doc["recording"]
    console.print(
        f"[bold]Recording[/bold] {rec['path']}: {rec['requests']:,} requests at "
        f"{rec['rate_per_s']:.2f}/s; {rec['knobs']}"
    )
    m = doc["step_cost"]
    hold = m["holdout"]
    parts = [
        f"{k.replace('_', ' ')} {v['median_abs_err_pct']:.0f}% (p90 {v['p90_abs_err_pct']:.0f}%, "
        f"{v['steps']} steps)"
        for k, v in hold.items()
        if k != "all" and v["steps"]
    ]
    up = m.get("upstream") or {}
    if up:
        names = {"eager_decode": "decode stretches", "with_prefill": "TTFTs", "itl": "ITL p50s"}
        parts = [
            f"{names[k]} {v['median_abs_err_pct']:.0f}% (p90 {v['p90_abs_err_pct']:.0f}%, {v['steps']})"
            for k, v in hold.items()
            if k in names and v["steps"]
        ]
        coef = m["paths"]["eager"]["forward"]
        console.print(
            f"[bold]Step-cost model[/bold] of another engine, fitted on {up['requests']:,} "
            f"requests as the proxy saw them"
            + (f" and {up['swept']:,} of its profile's sweep" if up.get("swept") else "")
            + f" (decode batches up to {m['ranges']['max_decode_batch']}): a step {coef['step']['ms']:.2f} ms + "
            f"{coef['decode_tokens']['ms']:.2f} ms a decode row + "
            f"{coef['prefill_tokens']['ms']:.3f} ms a prompt token + "
            f"{coef['prefill_chunks']['ms']:.1f} ms a prompt chunk + "
            f"{coef['attn_gflop']['ms'] / 1e6:.4f} ms an attended pair; held-out requests' median "
            f"error {'; '.join(parts) or '–'}"
        )
        console.print(
            "  replayed through our scheduler with the upstream's limits: "
            + "; ".join(
                f"{k.replace('_', ' ')} {up[k]:,} ({up['sources'][k]})"
                for k in ("slots", "batch_tokens", "kv_tokens")
            )
        )
    else:
        console.print(
            f"[bold]Step-cost model[/bold]: held-out steps' median error {'; '.join(parts) or '–'}; "
            f"gap between steps {m['gap_ms']:.1f} ms"
        )
    if rec.get("profile") and not m.get("profile_steps") and not up.get("swept"):
        console.print(
            f"  [yellow]the profile {rec['profile']} adds no step[/yellow]: none of its steps ran "
            f"at the recording's {m['threads']} CPU threads (a busy host when it was swept); "
            "sweep again with nothing else beside the server"
        )
    if m.get("profile_steps"):
        console.print(
            f"  fitted on the recording's steps and {m['profile_steps']:,} of its profile "
            f"({rec.get('profile')}); decode batches measured up to "
            f"{m['ranges']['max_decode_batch']}"
        )
    by_batch = m.get("residuals_by_batch") or {}
    if by_batch:
        console.print(
            "  held-out decode steps by batch size (median error, + = the model runs high): "
            + ", ".join(
                f"{k}: {v['median_err_pct']:+.0f}% ({v['steps']})" for k, v in by_batch.items()
            )
        )
    load = m.get("host_load") or {}
    if "others_pct" in load:
        console.print(
            f"  host load: the others' CPU {load['others_pct']:.1f}% of the host as recorded "
            f"(the load generator {load['loadgen_pct']:.1f}%); "
            + (
                f"a step takes x{load['slope'] / load['intercept'] * 0.1 + 1:.3f} per 10 points "
                f"more (fitted on {load['steps']:,} steps); plans are for "
                + ("a dedicated host" if rec.get("host") == "dedicated" else "this host")
                if load.get("slope")
                else f"not priced: {load['why_none']}"
            )
        )
    prof = doc.get("profile_sweep")
    if prof:
        console.print(
            f"[bold]Profile[/bold]: {len(prof['levels'])} sweep levels in {prof['seconds']:.0f} s "
            f"(batches up to {max((lv['batch'] for lv in prof['levels']), default=0)}, prompts "
            f"{', '.join(str(p) for p in sorted({lv['prompt_tokens'] for lv in prof['levels']}))} "
            f"tokens)"
            + (
                f"; {len(prof['skipped'])} level{'s' * (len(prof['skipped']) != 1)} left out by "
                "the time budget"
                if prof["skipped"]
                else ""
            )
            + f" → {prof['path']}"
            + (" (replacing the one there)" if prof.get("replaced") else "")
        )
    for u in m["unsupported"]:
        console.print(f"  [yellow]too few {u}[/yellow]: predictions that lean on them are weak")
    est = doc["error_estimate"]
    if "errors_pct" in est:
        errs = ", ".join(
            f"{_LABELS[k]} {_err(v, k)}" for k, v in est["errors_pct"].items() if k in _LABELS
        )
        console.print(
            f"[bold]Error estimate[/bold] (the recording's last {est['requests']} requests, "
            f"with step costs fitted on the steps before they arrived): {errs}"
        )
        if est.get("pace") and abs(est["pace"] - 1) > 0.05:
            console.print(
                f"  its steps took x{est['pace']:.2f} the fitted time: the host's pace drifted "
                "while recording, and a drift like it moves every prediction (the what-if "
                "step_time prices one)"
            )
    else:
        console.print(f"[bold]Error estimate[/bold]: {est.get('note')}")
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("")
    table.add_column("recorded", justify="right")
    preds = doc["predictions"]
    for p in preds:
        table.add_column(p["what_if"], justify="right")
    for key in METRICS:
        table.add_row(
            _LABELS[key],
            _fmt(key, doc["measured"].get(key)),
            *(_fmt(key, p["summary"].get(key)) for p in preds),
        )
    for key, label, f in _REPLAY:
        table.add_row(label, "", *(f.format(p["replay"][key]) for p in preds))
    if doc.get("slo"):
        table.add_row(
            f"SLO {doc['slo']}",
            "",
            *("met" if p["slo_met"] else "[red]missed[/red]" for p in preds),
        )
    console.print(table)
    bounds = doc.get("goodput_bounds_ms")
    if bounds:
        console.print(
            "Goodput: the share of requests that completed with their own TTFT ≤ "
            f"{_fmt('', bounds['ttft'])}, ITL p99 ≤ {_fmt('', bounds['itl_p99'])} and E2E ≤ "
            f"{_fmt('', bounds['e2e'])} "
            + (
                "(each the SLO's bound on that metric, any percentile; a default where it "
                "sets none)"
                if doc.get("slo")
                else "(defaults; --slo sets them)"
            )
        )
    for p in preds:
        for note in p["notes"]:
            console.print(f"  {p['what_if']}: {note}")
    rec_doc = doc.get("recommendation")
    if rec_doc:
        console.print(
            f"[bold]Recommendation[/bold] for SLO {doc['slo']} at {rec_doc['rate_factor']:g}x the "
            "recorded rate:"
        )
        r = rec_doc["replicas"]
        if r:
            console.print(
                f"  hosts like the recorded one: {r['count']} (margin {r['slo_margin']:.0%} inside "
                "the tightest bound)"
            )
        else:
            console.print("  hosts like the recorded one: no count up to 64 meets it")
        if rec_doc["settings"]:
            best = rec_doc["settings"][0]
            console.print(
                f"  knobs at one replica: {best['what_if']} (margin {best['slo_margin']:.0%}; "
                f"{len(rec_doc['settings'])} of {rec_doc['settings_tried']} settings tried meet it)"
            )
        else:
            console.print(
                f"  knobs at one replica: none of {rec_doc['settings_tried']} settings meets it"
            )
    if doc.get("check"):
        _check(console, doc["check"])
    return console.export_text()


def _check(console: Console, c: dict) -> None:
    """The plan against the real run: measured, predicted and its error, and again at the
    run's pace."""
    n = c["requests"]
    console.print(
        f"[bold]Check[/bold] of {c['what_if']} against {c['run']} ({n['measured']:,} requests "
        f"measured, {n['planned']:,} replayed)"
    )
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("", "measured", "predicted", "error"):
        table.add_column(col, justify="right" if col else "left")
    again = c["at_pace"]
    if again:
        table.add_column(f"at the run's pace (x{c['pace']:.2f})", justify="right")
        table.add_column("error", justify="right")
    for key in METRICS:
        real = c["measured"].get(key)
        predicted = c["predicted"].get(key)
        row = [
            _LABELS[key],
            _fmt(key, real),
            _fmt(key, predicted),
            _err(c["errors_pct"].get(key), key),
        ]
        if again:
            row += [_fmt(key, again["summary"].get(key)), _err(again["errors_pct"].get(key), key)]
        table.add_row(*row)
    pre = c["preemptions"]
    row = ["preemptions", f"{pre['measured']:,}", f"{pre['predicted']:,}", ""]
    if again:
        row += [f"{again['preemptions']:,}", ""]
    table.add_row(*row)
    console.print(table)
    for note in c["notes"]:
        console.print(f"  [yellow]{note}[/yellow]")
    if again:
        console.print(
            f"The run's steps took x{c['pace']:.2f} the time the plan priced them at "
            f"({c['pace_steps']:,} steps). What the pace takes away came from the host running "
            "slower or faster than the recorded one; what is left is the replay's own error."
        )
