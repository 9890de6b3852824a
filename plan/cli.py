"""``tokenmill plan STORE [--what-if K=V,...]... [--slo M<D,...] [--recommend] [--capacity]
[--rate K] [--cost-from STORE]... [--check RUN] [--profile [--url URL]] [--upstream-limits L]
[--format text|json]``: predictions from a recording (:mod:`.predict`; a proxy's store of another
engine: :mod:`.upstream`), a prediction held to the run that made it real (:mod:`.check`), the
highest rate that meets an SLO (:mod:`.capacity`), and step costs swept from a running server
or a local engine of the recording's setup, kept beside the recording (:mod:`.profile`).

Every run replays the recording as it was too (the sanity floor beside the what-ifs) and prints
the error estimate. Bad input (a store without engine steps, an unknown knob, an SLO that does
not parse, a rate of 0, ...) is one ``error:`` line and exit 2.

The root ``tokenmill`` command imports this module for help: the replay's modules load when
the command runs.
"""

from __future__ import annotations

import tempfile
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
    capacity_it: bool = False,
    profile_url: str | None = None,
    api_key: str | None = None,
    admin_key: str | None = None,
    profile_s: float | None = None,
    dedicated_host: bool = False,
    upstream_limits: str | None = None,
    profile_it: bool = False,
) -> str:
    """The plan rendered as ``fmt``.

    Raises:
        ValueError: bad input (one-line reason).
    """
    from .capacity import capacity
    from .capacity import to_text as capacity_text
    from .check import check, open_run
    from .predict import error_estimate, measured, open_recording, predict
    from .recommend import recommend
    from .report import to_json, to_text
    from .upstream import parse_limits
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
    if capacity_it and not slo.bounds:
        raise ValueError(
            "--capacity needs an --slo to meet, e.g. --slo 'ttft_p99<2s,itl_p99<200ms'"
        )
    parsed = [parse_whatif(""), *(parse_whatif(w) for w in whatifs)]
    sweep = None
    if profile_it or profile_url is not None:
        sweep = _profile(
            store, profile_url, api_key, admin_key, profile_s, parse_limits(upstream_limits)
        )
    cost_models = {}
    for path in cost_from:
        other = open_recording(path)
        cost_models[other.recorded.quantization or "none"] = other.model
        other.con.close()
    rec = open_recording(store, upstream_limits=parse_limits(upstream_limits))
    rec.dedicated_host = dedicated_host
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
                "profile": rec.profile,
                "host": "dedicated" if dedicated_host else "as recorded",
                "upstream": rec.upstream.to_dict() if rec.upstream else None,
            },
            "step_cost": rec.model.to_dict(),
            "profile_sweep": sweep,
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
        if capacity_it:
            doc["capacity"] = capacity(rec, slo, cost_models=cost_models)
        if run_con is not None:
            doc["check"] = check(
                rec, preds[-1], slo, run_con, str(check_run),
                cost_models=cost_models, fast_forward=not step_by_step,
            )  # fmt: skip
    finally:
        rec.con.close()
        if run_con is not None:
            run_con.close()
    if fmt == "json":
        return to_json(doc) + "\n"
    return to_text(doc) + (capacity_text(doc["capacity"]) if capacity_it else "")


def _profile(
    store: Path,
    url: str | None,
    api_key: str | None,
    admin_key: str | None,
    budget_s: float | None,
    upstream_limits: dict | None = None,
) -> dict:
    """Sweep the server at ``url`` (None: a local engine of the recording's setup) for the
    recording ``store`` and keep its profile beside it.

    Raises:
        ValueError: the recording does not open, the sweep or its fetch failed (one line).
    """
    from .predict import open_recording
    from .profile import BUDGET_S, make_profile, profile_path, serve_locally, sweep_upstream

    if budget_s is not None and not 0 < budget_s <= 3600:
        raise ValueError(
            f"--profile-seconds must be more than 0 and at most 3600, not {budget_s:g}"
        )
    replaced = profile_path(store).exists()
    rec = open_recording(store, use_profile=False, upstream_limits=upstream_limits)
    if rec.upstream is not None and url is None:
        rec.con.close()
        raise ValueError(
            f"{store} is a proxy's store of another engine: --profile needs its --url (the "
            "engine, or the proxy in front of it)"
        )
    try:
        if rec.upstream is not None:
            path, sweep = sweep_upstream(
                url, store, rec.upstream.slots, rec.upstream.kv_tokens, api_key=api_key,
                budget_s=budget_s or BUDGET_S,
            )  # fmt: skip
        elif url is not None:
            path, sweep = make_profile(
                url, store, rec.recorded, rec.num_blocks, api_key=api_key, admin_key=admin_key,
                budget_s=budget_s or BUDGET_S,
            )  # fmt: skip
        else:
            with (
                tempfile.TemporaryDirectory(prefix="tokenmill-profile-") as work,
                serve_locally(rec.config, Path(work)) as local,
            ):
                path, sweep = make_profile(
                    local, store, rec.recorded, rec.num_blocks, budget_s=budget_s or BUDGET_S
                )
    finally:
        rec.con.close()
    return {
        "path": str(path),
        "seconds": sweep.seconds,
        "levels": [vars(lv) for lv in sweep.levels],
        "skipped": [list(x) for x in sweep.skipped],
        "replaced": replaced,
    }


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
    capacity: Annotated[
        bool,
        typer.Option(
            "--capacity",
            help="The highest arrival rate that meets --slo, the goodput knee, what binds first.",
        ),
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
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Sweep the server at --url, or without --url a local engine started with the "
            "recording's settings (decode batches up to max_num_seqs, prefill chunks), and keep "
            "its steps beside the recording; every later plan fits on both. A proxy's store of "
            "another engine: sweep that engine (or its proxy) at --url.",
        ),
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(
            help="--profile's server (its base URL; for a proxy's store: the other engine or its proxy)."
        ),
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="--profile: the server's API key.")] = None,
    admin_key: Annotated[
        str | None, typer.Option(help="--profile: the server's admin key (for its dump).")
    ] = None,
    profile_seconds: Annotated[
        float | None,
        typer.Option(
            help="--profile's time budget (s, default 90; the level in progress runs to its end)."
        ),
    ] = None,
    dedicated_host: Annotated[
        bool,
        typer.Option(
            "--dedicated-host",
            help="Price steps as on a host where nothing else runs (default: the recording's "
            "other processes, its load generator's CPU grown with the planned traffic).",
        ),
    ] = False,
    upstream_limits: Annotated[
        str | None,
        typer.Option(
            "--upstream-limits",
            help="A proxy's store of another engine: its limits, e.g. 'slots=4,batch_tokens="
            "2048,kv_tokens=16384' (default: slots the highest running gauge scraped, "
            "llama.cpp's batch, a KV cache that never binds).",
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
        for given, name in ((url, "--url"), (admin_key, "--admin-key"), (api_key, "--api-key"),
                            (profile_seconds, "--profile-seconds")):  # fmt: skip
            if given is not None and not profile:
                raise ValueError(f"{name} is for --profile's sweep: add --profile")
        text = run(store, what_if, slo, recommend, rate, cost_from, format, step_by_step, check,
                   capacity, url, api_key, admin_key, profile_seconds,
                   dedicated_host, upstream_limits, profile)  # fmt: skip
    except ValueError as exc:
        fail(str(exc))
    typer.echo(text, nl=False)
