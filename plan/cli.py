"""``tokenmill plan STORE [--what-if K=V,...]... [--slo M<D,...] [--recommend] [--rate K]
[--cost-from STORE]... [--check RUN] [--format text|json]``: predictions from a recording
(:mod:`.predict`), and a prediction held to the run that made it real (:mod:`.check`).

Every run replays the recording as it was too (the sanity floor beside the what-ifs) and prints
the error estimate. Bad input (a store without engine steps, an unknown knob, an SLO that does
not parse, a rate of 0, ...) is one ``error:`` line and exit 2.

The root ``tokenmill`` command imports this module for help: the replay's modules load when
the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokenmill.telemetry.cli import fail

from .whatif import whatif_help

app = typer.Typer(add_completion=False)


def run(
    store: Path,
    whatifs: list[str],
    slo_text: str | None,
    recommend_it: bool,
    rate: float,
    cost_from: list[Path],
    fmt: str,
    step_by_step: bool = False,
    check_run: Path | None = None,
) -> str:
    """The plan rendered as ``fmt``.

    Raises:
        ValueError: bad input (one-line reason).
    """
    from .check import check, open_run
    from .predict import error_estimate, measured, open_recording, predict
    from .recommend import recommend
    from .report import to_json, to_text
    from .whatif import parse_slo, parse_whatif

    if fmt not in ("text", "json"):
        raise ValueError(f"--format must be text or json, not {fmt!r}")
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"--rate must be a factor > 0, not {rate}")
    if slo_text is not None and not any(part.strip() for part in slo_text.split(",")):
        raise ValueError("--slo is empty: give bounds such as 'ttft_p99<2s,itl_p50<100ms'")
    for text in whatifs:
        if not any(part.strip() for part in text.split(",")):
            raise ValueError("--what-if is empty: give knob=value changes such as rate=2")
    if check_run is not None and len(whatifs) > 1:
        raise ValueError(
            "--check holds one prediction to the run that made it real: give at most one "
            "--what-if (none: the recording as it was)"
        )
    slo = parse_slo(slo_text)
    if recommend_it and not slo.bounds:
        raise ValueError("--recommend needs an --slo to meet, e.g. --slo 'ttft_p99<2s'")
    parsed = [parse_whatif(""), *(parse_whatif(w) for w in whatifs)]
    cost_models = {}
    for path in cost_from:
        other = open_recording(path)
        cost_models[other.recorded.quantization or "none"] = other.model
        other.con.close()
    rec = open_recording(store)
    run_con = None
    try:
        # the run opens before the replays: a path that does not open fails first
        run_con = open_run(check_run) if check_run is not None else None
        preds = [
            predict(rec, w, slo, cost_models=cost_models, fast_forward=not step_by_step)
            for w in parsed
        ]
        doc = {
            "recording": {
                "path": str(store),
                "requests": len(rec.workload),
                "rate_per_s": rec.workload.rate_per_s or 0.0,
                "knobs": (
                    f"max_num_seqs {rec.config.max_num_seqs}, max_num_batched_tokens "
                    f"{rec.config.max_num_batched_tokens}, chunked prefill "
                    f"{'on' if rec.config.enable_chunked_prefill else 'off'}, prefix caching "
                    f"{'on' if rec.config.enable_prefix_caching else 'off'}, "
                    f"{rec.num_blocks:,} KV blocks"
                ),
            },
            "step_cost": rec.model.to_dict(),
            "error_estimate": error_estimate(rec, slo),
            "measured": measured(rec, slo),
            "slo": slo.text or None,
            # what a request must meet to count in goodput (the SLO's, else the defaults)
            "goodput_bounds_ms": {
                "ttft": slo.goodput.ttft_ms,
                "itl_p99": slo.goodput.itl_ms,
                "e2e": slo.goodput.e2e_ms,
            },
            "predictions": [p.to_dict() for p in preds],
        }
        if recommend_it:
            doc["recommendation"] = recommend(rec, slo, rate=rate, cost_models=cost_models)
        if run_con is not None:
            doc["check"] = check(
                rec, preds[-1], slo, run_con, str(check_run),
                cost_models=cost_models, fast_forward=not step_by_step,
            )  # fmt: skip
    finally:
        rec.con.close()
        if run_con is not None:
            run_con.close()
    return to_json(doc) + "\n" if fmt == "json" else to_text(doc)


@app.command()
def plan(
    store: Annotated[
        Path,
        typer.Argument(
            metavar="STORE", help="A recording: a trace dump, or a store file no server holds open."
        ),
    ],
    what_if: Annotated[
        list[str],
        typer.Option(
            "--what-if",
            help=whatif_help(),
        ),
    ] = [],  # noqa: B006 - typer reads the default
    slo: Annotated[
        str | None,
        typer.Option(
            help="metric<duration[,...]: ttft|itl|tpot|e2e _p50|_p99, e.g. 'ttft_p99<2s'."
        ),
    ] = None,
    recommend: Annotated[
        bool, typer.Option("--recommend", help="Search replicas and knobs that meet --slo.")
    ] = False,
    rate: Annotated[
        float, typer.Option(help="--recommend's target: the recorded rate times this factor.")
    ] = 1.0,
    cost_from: Annotated[
        list[Path],
        typer.Option(
            "--cost-from",
            help="A recording made with another --quantization, for its step costs (repeatable).",
        ),
    ] = [],  # noqa: B006
    check: Annotated[
        Path | None,
        typer.Option(
            "--check",
            metavar="RUN",
            help="A store of the --what-if run for real: the prediction's error, the run's "
            "pace and the prediction again at that pace.",
        ),
    ] = None,
    format: Annotated[str, typer.Option("--format", help="text | json")] = "text",
    step_by_step: Annotated[
        bool,
        typer.Option(
            "--step-by-step", help="Plan every step through the scheduler (no fast-forward)."
        ),
    ] = False,
) -> None:
    """Predict what-ifs from a recorded run: its arrivals replayed through the engine's own
    scheduler, KV pool and router, with step times from a model fitted on its steps."""
    try:
        text = run(store, what_if, slo, recommend, rate, cost_from, format, step_by_step, check)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(text, nl=False)
