"""``tokenmill bench``, ``tokenmill scenario list|run`` and ``tokenmill demo``.

:func:`run_bench` checks every option before anything is sent (a bad value is a
:class:`BenchInputError`, one line, exit 2), probes the server (unreachable: exit 2), runs the
load with a progress bar, prints the per-phase table, writes the JSON (``--out``) and, with
``--record-to``, writes the client TTFTs into a closed trace store or dump. ``--from-results
FILE --record-to STORE`` records a saved run instead (the usual order: bench a live server with
``--out``, stop it, then record).

``scenario`` runs :mod:`.scenario`, ``demo`` runs :mod:`.demo`. The root ``tokenmill`` command
finds :data:`bench_app`, :data:`scenario_app` and :data:`demo_app` here by name and imports this
module for help too: the load generator's own modules are imported when a command runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tokenmill.engine.settings import (
    DATA_DIR,
    config_options,
    from_options,
    setting,
)
from tokenmill.telemetry.cli import err, fail, out


class BenchInputError(Exception):
    """A bad option, or a run that cannot start (one line; the command exits 2)."""


MAX_PLANNED_REQUESTS = 1_000_000  # arrival times are planned up front: bound their memory
MAX_WORKERS = 10_000  # closed-loop clients at the largest phase multiplier

_SLO_ARG_RE = re.compile(r"^(ttft|itl|tpot|e2e|e2el):", re.I)


@dataclass
class BenchOptions:
    """Settings of ``tokenmill bench``: one field each, from which its options are generated
    (``engine/settings.py``); :func:`run_bench` takes the instance."""

    url: str | None = setting(None, "The server, e.g. http://127.0.0.1:8000.")
    model: str | None = setting(None, "Model name to send (default: the server's first).")
    api_key: str | None = setting(None, "Bearer key for the server.", envvar="TOKENMILL_API_KEY")
    endpoint: str = setting("chat", "chat | completions")
    request_rate: float | None = setting(
        None, "Open loop: requests/s (× each phase's multiplier; inf = all at once)."
    )
    burstiness: float = setting(1.0, "Gamma shape of the inter-arrival gaps (1 = Poisson).")
    concurrency: int | None = setting(
        None, "Closed loop: requests in flight (the default, with 1)."
    )
    num_requests: int | None = setting(
        None, "Requests to send (default 100; with --phases: no limit)."
    )
    phases: str | None = setting(
        None,
        "e.g. warmup:20s,steady:60s,overload:30s@3x,recovery:40s, or a YAML file.",
        metavar="SPEC|PATH",
    )
    prompt_tokens: str = setting("256", "Tokens: 256, uniform:64:512 or lognormal:256:0.5.")
    output_tokens: str = setting(
        "128", "Tokens: 128, uniform:16:256 or lognormal:128:0.5 (ignore_eos)."
    )
    shared_prefix: str | None = setting(
        None,
        "A system prompt of L tokens shared by G requests (volatile: a timestamp first).",
        metavar="L:G[:volatile]",
    )
    multi_turn: str | None = setting(
        None, "Chats growing over T turns, C at a time.", metavar="T[:C]"
    )
    dataset: Path | None = setting(  # noqa: RUF009 - a field, not a shared default
        None, 'JSONL of {"prompt": ...} or ShareGPT {"conversations": [...]}.'
    )
    tokenizer: str | None = setting(
        None, "Tokenizer folder or tokenizer.json for exact prompt lengths."
    )
    goodput: list[str] | None = setting(  # noqa: RUF009
        None, "SLOs in ms for goodput: --goodput ttft:500 itl:100 e2e:5000.", metavar="METRIC:MS"
    )
    seed: int = setting(0, "Seeds arrivals and prompts.")
    out: Path | None = setting(None, "Write the JSON here.", flags=("--out", "-o"))  # noqa: RUF009
    record_to: Path | None = setting(  # noqa: RUF009
        None, "A closed trace store or dump: write each request's client TTFT."
    )
    from_results: Path | None = setting(  # noqa: RUF009
        None, "Record a saved --out file (with --record-to), no run."
    )
    timeout: float = setting(600.0, "Seconds one request may take.")
    drain_timeout: float = setting(300.0, "Seconds in-flight requests get after the last phase.")
    ignore_eos: bool = setting(True)
    temperature: float = setting(0.0)
    top_p: float = setting(1.0, "Nucleus sampling share sent with each request (0..1].")
    abort_fraction: float = setting(
        0.0, "Share of requests the client aborts mid-stream (0..1; drills)."
    )
    progress: bool = setting(True)


def run_bench(
    opts: BenchOptions,
    *,
    extra: list[str] | None = None,
    console: Console | None = None,
    err_console: Console | None = None,
) -> int:
    """Run ``tokenmill bench`` as ``opts`` say (``extra``: the SLOs after ``--goodput``'s first,
    vLLM-style); returns the exit status. Raises BenchInputError (exit 2)."""
    import asyncio

    from .client import BenchConfig, BenchError, run
    from .report import BenchProgress, parse_goodput, render_table, summarize

    console = console or Console(emoji=False)
    err_console = err_console or Console(stderr=True, emoji=False)

    # vLLM-style "--goodput ttft:500 itl:50": the SLOs after the first arrive as arguments
    goodput = opts.goodput
    extra = list(extra or [])
    if extra:
        bad = [a for a in extra if not _SLO_ARG_RE.match(a)]
        if bad or not goodput:
            raise BenchInputError(f"unexpected argument {(bad or extra)[0]!r}")
        goodput = [*goodput, *extra]

    if opts.from_results is not None:
        return _record_saved(opts.from_results, opts.record_to, opts.url, console)

    concurrency, num_requests, phase_list = _check_load(opts)
    try:
        slos = parse_goodput(goodput)
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None
    workload = _workload(opts)
    out, record_to = opts.out, opts.record_to
    if out is not None:
        if out.is_dir():
            raise BenchInputError(f"--out {out} is a folder; give a file name")
        if not out.parent.is_dir():
            raise BenchInputError(f"--out: folder {out.parent} does not exist")
    if not 0.0 <= opts.abort_fraction <= 1.0:
        raise BenchInputError(
            f"--abort-fraction must be between 0 and 1, got {opts.abort_fraction:g}"
        )
    if record_to is not None and not record_to.is_file():
        raise BenchInputError(f"--record-to {record_to}: no such file")

    # the run: the options it shares with BenchConfig as given, the load and workload as
    # checked and built above
    built = ("workload", "phases", "concurrency", "num_requests")
    given = [f.name for f in dataclasses.fields(BenchConfig) if f.name not in built]
    cfg = BenchConfig(
        **{name: getattr(opts, name) for name in given},
        workload=workload,
        phases=phase_list,
        concurrency=concurrency,
        num_requests=num_requests,
    )
    try:
        if opts.progress:
            with BenchProgress(err_console, phase_list, num_requests) as bar:
                result = asyncio.run(run(cfg, progress=bar))
        else:
            result = asyncio.run(run(cfg))
    except BenchError as exc:
        raise BenchInputError(str(exc)) from None
    doc = summarize(result, slos)
    render_table(doc, console)
    if out is not None:
        out.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"wrote {out}", highlight=False, markup=False)
    if record_to is not None:
        _record_run(console, record_to, out, result.results)
    return 0


def _record_run(console: Console, record_to: Path, out: Path | None, results: list) -> None:
    """The run's client TTFTs into ``--record-to``; BenchInputError when it cannot be written
    (a store a server holds: how to record the saved ``--out`` once it stops)."""
    from .record import RecordError, record_client_timings

    try:
        s = record_client_timings(record_to, results)
    except RecordError as exc:
        msg = str(exc)
        if "locked" in msg and out is not None:
            msg = (
                f"{record_to}: locked by a running server; once it has stopped, run "
                f"tokenmill bench --from-results {out} --record-to {record_to}"
            )
        raise BenchInputError(f"--record-to: {msg}") from None
    _print_recorded(console, record_to, s)


def _check_load(opts: BenchOptions) -> tuple[int | None, int | None, list]:
    """The run's concurrency, request count and phases, each as ``opts`` give it or its default;
    BenchInputError for a bad value or a load too large to plan."""
    from .phases import Phase, parse_phases

    request_rate, concurrency, num_requests = opts.request_rate, opts.concurrency, opts.num_requests
    timeout, drain_timeout = opts.timeout, opts.drain_timeout
    if not opts.url:
        raise BenchInputError("give --url (the server), or --from-results with --record-to")
    if opts.endpoint not in ("chat", "completions"):
        raise BenchInputError(f"bad --endpoint {opts.endpoint!r}: chat or completions")
    if request_rate is not None and concurrency is not None:
        raise BenchInputError(
            "give --request-rate (open loop) or --concurrency (closed loop), not both"
        )
    if request_rate is None and concurrency is None:
        concurrency = 1
    if request_rate is not None and (math.isnan(request_rate) or request_rate <= 0):
        raise BenchInputError("--request-rate must be more than 0 (inf: all at once)")
    if not (opts.burstiness > 0 and math.isfinite(opts.burstiness)):
        raise BenchInputError("--burstiness must be more than 0 (1 = Poisson)")
    if concurrency is not None and concurrency < 1:
        raise BenchInputError("--concurrency must be at least 1")
    if num_requests is not None and num_requests < 1:
        raise BenchInputError("--num-requests must be at least 1")
    if not (math.isfinite(timeout) and timeout > 0):
        raise BenchInputError(
            f"--timeout must be a finite number of seconds more than 0, got {timeout:g}"
        )
    if not (math.isfinite(drain_timeout) and drain_timeout >= 0):
        raise BenchInputError(
            f"--drain-timeout must be a finite number of seconds, at least 0, got {drain_timeout:g}"
        )
    if not 0.0 <= opts.temperature <= 2.0:
        raise BenchInputError("--temperature must be in [0, 2]")
    if not 0.0 < opts.top_p <= 1.0:
        raise BenchInputError("--top-p must be in (0, 1]")

    if opts.phases is None:
        return (
            concurrency,
            100 if num_requests is None else num_requests,
            [Phase("main", math.inf, 1.0)],
        )
    try:
        phase_list = parse_phases(opts.phases)
    except ValueError as exc:
        raise BenchInputError(f"--phases: {exc}") from None
    if request_rate is not None and math.isinf(request_rate):
        raise BenchInputError("--phases needs a finite --request-rate (or --concurrency)")
    planned = (
        sum(request_rate * p.multiplier * p.duration_s for p in phase_list)
        if request_rate is not None
        else 0.0
    )
    if planned > MAX_PLANNED_REQUESTS and num_requests is None:
        raise BenchInputError(
            f"--phases at --request-rate {request_rate:g} plans about {planned:.3g} requests; "
            f"at most {MAX_PLANNED_REQUESTS:,} per run (lower the rate, the multipliers or "
            "the durations, or give --num-requests)"
        )
    workers = (concurrency or 0) * max(p.multiplier for p in phase_list)
    if workers > MAX_WORKERS:
        raise BenchInputError(
            f"--concurrency {concurrency} × phase multiplier {workers / concurrency:g} asks "
            f"for {workers:.3g} clients; at most {MAX_WORKERS:,}"
        )
    return concurrency, num_requests, phase_list


def _workload(opts: BenchOptions):
    """The requests' shape (``bench/workload.py``: ``Workload``) from ``opts``; BenchInputError
    naming the option or file that does not parse."""
    from .workload import (
        Workload,
        WorkloadError,
        load_dataset,
        load_tokenizer,
        parse_length,
        parse_multi_turn,
        parse_shared_prefix,
    )

    dataset, tokenizer = opts.dataset, opts.tokenizer
    try:
        tok = load_tokenizer(tokenizer) if tokenizer else None
        return Workload(
            prompt_tokens=parse_length(opts.prompt_tokens, "--prompt-tokens"),
            output_tokens=parse_length(opts.output_tokens, "--output-tokens"),
            shared_prefix=parse_shared_prefix(opts.shared_prefix) if opts.shared_prefix else None,
            multi_turn=parse_multi_turn(opts.multi_turn) if opts.multi_turn else None,
            dataset=load_dataset(dataset) if dataset is not None else None,
            seed=opts.seed,
            tokenizer=tok,
            tokenizer_id=tokenizer,
            dataset_path=str(dataset) if dataset is not None else None,
        )
    except WorkloadError as exc:
        raise BenchInputError(str(exc)) from None


def _print_recorded(console: Console, path: Path, s) -> None:
    console.print(
        f"recorded client TTFT for {s.written} request(s) in {path}"
        + (f" ({s.unmatched} not in the store)" if s.unmatched else ""),
        highlight=False,
        markup=False,
    )


def _record_saved(results: Path, record_to: Path | None, url: str | None, console) -> int:
    from .record import RecordError, record_client_timings

    if record_to is None:
        raise BenchInputError("--from-results needs --record-to STORE")
    if url:
        raise BenchInputError("--from-results records a saved run; it does not take --url")
    try:
        doc = json.loads(results.read_text())
        reqs = doc["requests"]
        if not isinstance(reqs, list):
            raise TypeError
    except FileNotFoundError:
        raise BenchInputError(f"--from-results {results}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise BenchInputError(
            f"--from-results {results}: not a tokenmill bench results file (no 'requests' list)"
        ) from None
    try:
        s = record_client_timings(record_to, [r for r in reqs if isinstance(r, dict)])
    except RecordError as exc:
        raise BenchInputError(f"--record-to: {exc}") from None
    _print_recorded(console, record_to, s)
    return 0


# ----- the commands -----

bench_app = typer.Typer(add_completion=False)


@bench_app.command(context_settings={"allow_interspersed_args": True})
@config_options(BenchOptions)
def bench(
    slos: Annotated[list[str] | None, typer.Argument(hidden=True, metavar="SLO")] = None,
    **options: Any,
) -> None:
    """Load-test a server (open or closed loop, in phases) and report TTFT, ITL, TPOT, E2E,
    throughput and goodput per phase."""
    opts = from_options(BenchOptions, options)
    try:
        code = run_bench(opts, extra=slos, console=out, err_console=err)
    except BenchInputError as exc:
        fail(str(exc))
    raise typer.Exit(code)


# ----- tokenmill scenario (bench/scenario.py) -----

scenario_app = typer.Typer(
    help="Symptom scenarios: a real server, a workload, the diagnosis.",
    no_args_is_help=True,
    add_completion=False,
)


@scenario_app.command("list")
def scenario_list() -> None:
    """List the scenarios and the rule each one must produce."""
    from .scenario import list_scenarios

    for sc in list_scenarios():
        expect = ", ".join(sc.expect) or "no findings"
        out.print(  # one line per scenario, never wrapped: `make scenarios` reads column 1
            f"{sc.name:28s} {sc.case:40s} expect: {expect}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


@scenario_app.command("run")
def scenario_run(
    name: Annotated[str, typer.Argument(help="Scenario name (see `tokenmill scenario list`).")],
    model: Annotated[str | None, typer.Option(help="Model folder (default model).")] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Folder for the store, logs and result.json.")
    ] = None,
) -> None:
    """Run one scenario; exit 0 when the expected rule is the top finding (or the absent rules
    stay silent), 1 when not."""
    from .scenario import ScenarioError, load, run

    try:
        load(name)
        folder = out_dir or Path(DATA_DIR) / "scenarios" / name
        result = run(name, folder, model=model, log=lambda m: err.print(m, highlight=False))
    except ScenarioError as exc:
        fail(str(exc))
    verdict = "PASS" if result["passed"] else "FAIL"
    expect = ", ".join(result["expect"]) or (
        "none of " + ", ".join(result["absent"]) if result.get("absent") else "no findings"
    )
    out.print(
        f"{verdict} {name}: top finding {result['top'] or 'none'} (expected {expect}); "
        f"{len(result['findings'])} finding(s); details in {folder / 'result.json'}",
        highlight=False,
        markup=False,
    )
    for f in result["findings"][:3]:
        out.print(
            f"  - {f['rule']} ({f['severity']}): {f['summary']}", highlight=False, markup=False
        )
    for n in result.get("notes") or []:
        out.print(f"  hint ({n['rule']}): {n['summary']}", highlight=False, markup=False)
    health = result.get("health_after") or {}
    if health.get("status") not in (None, "ok"):
        why = "; ".join(health.get("reasons") or [])
        out.print(f"  /health after the run: {health['status']} ({why})", markup=False)
    raise typer.Exit(0 if result["passed"] else 1)


# ----- tokenmill demo (bench/demo.py) -----

demo_app = typer.Typer(add_completion=False)


@demo_app.command()
def demo(
    port: Annotated[
        int, typer.Option(min=1, max=65535, help="Server port (next free if taken).")
    ] = 8000,
    console_port: Annotated[int, typer.Option(min=1, max=65535, help="Console port.")] = 8501,
    no_wait: Annotated[
        bool, typer.Option("--no-wait", help="Stop after the diagnosis instead of staying up.")
    ] = False,
) -> None:
    """Server + console + a short tour (healthy, then overload) + its diagnosis; Ctrl-C stops."""
    from tokenmill.engine.cli import require_engine

    require_engine()  # it starts our server: without the engine extra, one line says so
    from .demo import DemoError, run

    try:
        code = run(port=port, console_port=console_port, wait=not no_wait, say=out.print)
    except DemoError as exc:
        fail(str(exc))
    raise typer.Exit(code)
