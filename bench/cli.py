"""The logic of ``tokenmill bench`` (the typer options live in ``engine/cli.py``).

:func:`run_bench` checks every option before anything is sent (a bad value is a
:class:`BenchInputError`, one line, exit 2), probes the server (unreachable: exit 2), runs the
load with a progress bar, prints the per-phase table, writes the JSON (``--out``) and, with
``--record-to``, writes the client TTFTs into a closed trace store or dump. ``--from-results
FILE --record-to STORE`` records a saved run instead (the usual order: bench a live server with
``--out``, stop it, then record).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

from rich.console import Console

from .phases import Phase, parse_phases


class BenchInputError(Exception):
    """A bad option, or a run that cannot start (one line; the command exits 2)."""


MAX_PLANNED_REQUESTS = 1_000_000  # arrival times are planned up front: bound their memory
MAX_WORKERS = 10_000  # closed-loop clients at the largest phase multiplier

_SLO_ARG_RE = re.compile(r"^(ttft|itl|tpot|e2e|e2el):", re.I)


def run_bench(
    *,
    url: str | None,
    model: str | None = None,
    api_key: str | None = None,
    endpoint: str = "chat",
    request_rate: float | None = None,
    burstiness: float = 1.0,
    concurrency: int | None = None,
    num_requests: int | None = None,
    phases: str | None = None,
    prompt_tokens: str = "256",
    output_tokens: str = "128",
    shared_prefix: str | None = None,
    multi_turn: str | None = None,
    dataset: Path | None = None,
    tokenizer: str | None = None,
    goodput: list[str] | None = None,
    extra: list[str] | None = None,
    seed: int = 0,
    out: Path | None = None,
    record_to: Path | None = None,
    from_results: Path | None = None,
    timeout: float = 600.0,
    drain_timeout: float = 300.0,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    abort_fraction: float = 0.0,
    progress: bool = True,
    console: Console | None = None,
    err_console: Console | None = None,
) -> int:
    """Run ``tokenmill bench``; returns the exit status. Raises BenchInputError (exit 2)."""
    from .client import BenchConfig, BenchError, run
    from .record import RecordError, record_client_timings
    from .report import BenchProgress, parse_goodput, render_table, summarize
    from .workload import (
        Workload,
        WorkloadError,
        load_dataset,
        load_tokenizer,
        parse_length,
        parse_multi_turn,
        parse_shared_prefix,
    )

    console = console or Console(emoji=False)
    err_console = err_console or Console(stderr=True, emoji=False)

    # vLLM-style "--goodput ttft:500 itl:50": the SLOs after the first arrive as arguments
    extra = list(extra or [])
    if extra:
        bad = [a for a in extra if not _SLO_ARG_RE.match(a)]
        if bad or not goodput:
            raise BenchInputError(f"unexpected argument {(bad or extra)[0]!r}")
        goodput = [*goodput, *extra]

    if from_results is not None:
        return _record_saved(from_results, record_to, url, console)

    if not url:
        raise BenchInputError("give --url (the server), or --from-results with --record-to")
    if endpoint not in ("chat", "completions"):
        raise BenchInputError(f"bad --endpoint {endpoint!r}: chat or completions")
    if request_rate is not None and concurrency is not None:
        raise BenchInputError(
            "give --request-rate (open loop) or --concurrency (closed loop), not both"
        )
    if request_rate is None and concurrency is None:
        concurrency = 1
    if request_rate is not None and (math.isnan(request_rate) or request_rate <= 0):
        raise BenchInputError("--request-rate must be more than 0 (inf: all at once)")
    if not (burstiness > 0 and math.isfinite(burstiness)):
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
    if not 0.0 <= temperature <= 2.0:
        raise BenchInputError("--temperature must be in [0, 2]")

    if phases is not None:
        try:
            phase_list = parse_phases(phases)
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
    else:
        if num_requests is None:
            num_requests = 100
        phase_list = [Phase("main", math.inf, 1.0)]

    try:
        slos = parse_goodput(goodput)
    except ValueError as exc:
        raise BenchInputError(str(exc)) from None
    try:
        tok = load_tokenizer(tokenizer) if tokenizer else None
        workload = Workload(
            prompt_tokens=parse_length(prompt_tokens, "--prompt-tokens"),
            output_tokens=parse_length(output_tokens, "--output-tokens"),
            shared_prefix=parse_shared_prefix(shared_prefix) if shared_prefix else None,
            multi_turn=parse_multi_turn(multi_turn) if multi_turn else None,
            dataset=load_dataset(dataset) if dataset is not None else None,
            seed=seed,
            tokenizer=tok,
            tokenizer_id=tokenizer,
            dataset_path=str(dataset) if dataset is not None else None,
        )
    except WorkloadError as exc:
        raise BenchInputError(str(exc)) from None
    if out is not None:
        if out.is_dir():
            raise BenchInputError(f"--out {out} is a folder; give a file name")
        if not out.parent.is_dir():
            raise BenchInputError(f"--out: folder {out.parent} does not exist")
    if not 0.0 <= abort_fraction <= 1.0:
        raise BenchInputError(f"--abort-fraction must be between 0 and 1, got {abort_fraction:g}")
    if record_to is not None and not record_to.is_file():
        raise BenchInputError(f"--record-to {record_to}: no such file")

    cfg = BenchConfig(
        url=url,
        workload=workload,
        phases=phase_list,
        model=model,
        api_key=api_key,
        endpoint=endpoint,
        request_rate=request_rate,
        burstiness=burstiness,
        concurrency=concurrency,
        num_requests=num_requests,
        seed=seed,
        timeout=timeout,
        drain_timeout=drain_timeout,
        ignore_eos=ignore_eos,
        temperature=temperature,
        abort_fraction=abort_fraction,
    )
    try:
        if progress:
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
        try:
            s = record_client_timings(record_to, result.results)
        except RecordError as exc:
            msg = str(exc)
            if "locked" in msg and out is not None:
                msg = (
                    f"{record_to}: locked by a running server; once it has stopped, run "
                    f"tokenmill bench --from-results {out} --record-to {record_to}"
                )
            raise BenchInputError(f"--record-to: {msg}") from None
        _print_recorded(console, record_to, s)
    return 0


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
