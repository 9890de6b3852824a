"""Results of ``tokenmill bench``: metrics, the per-phase table, the progress bar, the JSON.

Names follow vLLM's ``benchmark_serving`` so existing tooling reads the JSON. Over a group of
requests (the whole run, or the requests *sent* in one phase):

- ``completed`` / ``failed`` — requests that reached ``[DONE]`` / did not (HTTP errors, error
  events, timeouts, cancelled at the drain timeout); ``aborted`` — closed on purpose by the
  client (``--abort-fraction``), in neither count;
- ``duration`` (s) — from the group's start (the run's, or the phase's) to the later of its last
  completion and the phase's end; overload requests that finish during recovery stretch their
  phase's duration, as in vLLM;
- ``request_throughput`` (req/s) = completed / duration; ``output_throughput`` (tok/s) = output
  tokens of completed requests / duration; ``total_token_throughput`` = (input + output tokens)
  / duration; tokens come from each stream's usage frame;
- ``request_goodput`` (req/s) = completed requests meeting every SLO of ``--goodput`` /
  duration. SLOs (ms): ``ttft`` (TTFT ≤), ``itl`` (the request's own ITL p99 ≤, as the store's goodput),
  ``tpot`` (TPOT ≤), ``e2e`` (E2E ≤); None without ``--goodput``;
- ``mean_/median_/std_/p90_/p95_/p99_`` of ``ttft_ms``, ``tpot_ms`` (requests with ≥ 2 output
  tokens), ``itl_ms`` (every gap of every completed request, pooled) and ``e2el_ms``; None when
  the group has no value (percentiles: linear interpolation, numpy's default);
- ``client_lag_ms`` — mean, median, p99 and max of send − planned send (see :mod:`.client`).

TTFT, ITL, TPOT and E2E are defined in :mod:`.client`. The JSON adds the run's setup (loop,
rate, burstiness, concurrency, workload, seed), a ``phases`` list (one block per phase, the
same fields plus ``name``, ``start_s``, ``planned_duration_s``, ``rate_multiplier``,
``offered_request_rate`` or ``concurrency``) and ``requests`` (one record per request, what
:mod:`.record` needs).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from datetime import UTC, datetime

import numpy as np
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tokenmill.telemetry.latency import percentile

from .client import BenchRun, RequestResult

SLO_KEYS = {"ttft": "ttft", "itl": "itl", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}
_SLO_RE = re.compile(r"^\s*([a-z0-9]+)\s*:\s*([0-9]*\.?[0-9]+)\s*(ms)?\s*$")
LAG_WARN_MS = 50.0


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """``['ttft:500', 'itl:100 e2e:5000']`` (space or comma separated, ms) → SLOs.

    Raises:
        ValueError: one line naming the bad item.
    """
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        for part in re.split(r"[,\s]+", item.strip()):
            if not part:
                continue
            m = _SLO_RE.match(part.lower())
            if not m or m.group(1) not in SLO_KEYS:
                raise ValueError(
                    f"bad goodput SLO {part!r}: expected ttft:MS, itl:MS, tpot:MS or e2e:MS"
                )
            value = float(m.group(2))
            if value <= 0:
                raise ValueError(f"bad goodput SLO {part!r}: must be more than 0 ms")
            slos[SLO_KEYS[m.group(1)]] = value
    if not slos:
        raise ValueError("--goodput needs at least one SLO, e.g. ttft:500")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A completed request within every SLO (ms): the store's goodput test
    (``tokenmill.telemetry.goodput.GOOD_REQUEST_SQL``: TTFT, the request's own ITL p99, E2E),
    plus TPOT when ``--goodput`` names it."""
    if not r.ok:
        return False
    if "ttft" in slos and (r.ttft_ms is None or r.ttft_ms > slos["ttft"]):
        return False
    if "itl" in slos and r.itl_ms and percentile(r.itl_ms, 99) > slos["itl"]:
        return False
    if "tpot" in slos and r.tpot_ms is not None and r.tpot_ms > slos["tpot"]:
        return False
    return not ("e2e" in slos and (r.e2e_ms is None or r.e2e_ms > slos["e2e"]))


def _stats(prefix: str, values: list[float], out: dict) -> None:
    a = np.asarray(values, dtype=float)
    have = a.size > 0
    out[f"mean_{prefix}_ms"] = float(a.mean()) if have else None
    out[f"median_{prefix}_ms"] = float(np.median(a)) if have else None
    out[f"std_{prefix}_ms"] = float(a.std()) if have else None
    for q in (90, 95, 99):
        out[f"p{q}_{prefix}_ms"] = float(np.percentile(a, q)) if have else None


def lag_stats(results: list[RequestResult]) -> dict:
    a = np.asarray([r.lag_ms for r in results], dtype=float)
    if a.size == 0:
        return {"mean": None, "median": None, "p99": None, "max": None}
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def group_metrics(
    results: list[RequestResult], duration_s: float, slos: dict[str, float] | None
) -> dict:
    """The vLLM-named metrics of a group of requests over ``duration_s`` seconds."""
    ok = [r for r in results if r.ok]
    dur = duration_s if duration_s > 0 else float("nan")
    inp = sum(r.prompt_tokens for r in ok)
    outp = sum(r.output_tokens for r in ok)
    m: dict = {
        "duration": duration_s,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": sum(1 for r in results if not r.ok and not r.aborted),
        "aborted": sum(1 for r in results if r.aborted),
        "total_input_tokens": inp,
        "total_output_tokens": outp,
        "request_throughput": _num(len(ok) / dur),
        "output_throughput": _num(outp / dur),
        "total_token_throughput": _num((inp + outp) / dur),
        "request_goodput": None,
        "good_requests": None,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        m["good_requests"] = good
        m["request_goodput"] = _num(good / dur)
    _stats("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None], m)
    _stats("tpot", [r.tpot_ms for r in ok if r.tpot_ms is not None], m)
    _stats("itl", [x for r in ok for x in r.itl_ms], m)
    _stats("e2el", [r.e2e_ms for r in ok if r.e2e_ms is not None], m)
    m["client_lag_ms"] = lag_stats(results)
    errors = Counter(r.error for r in results if not r.ok and not r.aborted and r.error)
    m["errors"] = dict(errors.most_common(5))
    return m


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def summarize(run: BenchRun, slos: dict[str, float] | None = None) -> dict:
    """The JSON document of a run (see the module docstring)."""
    cfg = run.config
    results = run.results
    overall = group_metrics(results, run.duration_s, slos)
    phases = []
    start = 0.0
    for k, p in enumerate(cfg.phases):
        mine = [r for r in results if r.phase == k]
        end = start + p.duration_s
        last = max((r.done_s or 0.0 for r in mine), default=0.0)
        if math.isinf(end):
            end = max(last, run.send_end_s)
        block = {
            "name": p.name,
            "start_s": start,
            "planned_duration_s": None if math.isinf(p.duration_s) else p.duration_s,
            "rate_multiplier": p.multiplier,
        }
        if cfg.request_rate is not None:
            block["offered_request_rate"] = _num(cfg.request_rate * p.multiplier) or "inf"
        else:
            block["concurrency"] = max(1, round(cfg.concurrency * p.multiplier))
        block.update(group_metrics(mine, max(end, last) - start, slos))
        phases.append(block)
        start += p.duration_s
    w = cfg.workload
    doc = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "base_url": cfg.base_url,
        "endpoint": cfg.path,
        "model_id": run.model,
        "tokenizer_id": getattr(w, "tokenizer_id", None),
        "run_id": run.run_id,
        "started_at_ns": run.started_wall_ns,
        "loop": "open" if cfg.request_rate is not None else "closed",
        "request_rate": (
            None
            if cfg.request_rate is None
            else ("inf" if math.isinf(cfg.request_rate) else cfg.request_rate)
        ),
        "burstiness": cfg.burstiness if cfg.request_rate is not None else None,
        "max_concurrency": cfg.concurrency,
        "seed": cfg.seed,
        "abort_fraction": cfg.abort_fraction,
        "workload": workload_description(cfg),
        "goodput_slos_ms": slos,
        **overall,
        "phases": phases,
        "requests": [r.to_json() for r in results],
    }
    return doc


def workload_description(cfg) -> dict:
    w = cfg.workload
    d = {
        "prompt_tokens": str(w.prompt_tokens) if w.dataset is None else None,
        "output_tokens": str(w.output_tokens),
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
    }
    if w.shared_prefix:
        length, group, volatile = w.shared_prefix
        d["shared_prefix"] = {"tokens": length, "group_size": group, "volatile": volatile}
    if w.multi_turn:
        d["multi_turn"] = {"turns": w.multi_turn[0], "conversations": w.multi_turn[1]}
    if w.dataset is not None:
        d["dataset"] = getattr(w, "dataset_path", None)
        d["dataset_entries"] = len(w.dataset)
    return d


# ----- rendering -----


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _rate(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def render_table(doc: dict, console: Console) -> None:
    """The per-phase results table (one row per phase, then the whole run)."""
    open_loop = doc["loop"] == "open"
    title = f"tokenmill bench · {doc['model_id']} · {doc['loop']} loop · " + (
        f"{doc['request_rate']} req/s, burstiness {doc['burstiness']:g}"
        if open_loop
        else f"concurrency {doc['max_concurrency']}"
    )
    t = Table(
        title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1)
    )
    goodput = doc["goodput_slos_ms"] is not None
    cols = ["phase", "load", "sent", "ok", "req/s", "out\ntok/s", "TTFT\np50", "TTFT\np99"]
    cols += ["ITL\np50", "ITL\np99", "TPOT\nmean", "E2E\np50", "E2E\np99"]
    cols += ["goodput\nreq/s"] if goodput else []
    cols += ["lag\np99"]
    for c in cols:
        t.add_column(c, justify="left" if c == "phase" else "right", no_wrap=True)

    def row(name: str, load: str, m: dict, style: str | None = None):
        cells = [
            name,
            load,
            str(m["num_prompts"]),
            str(m["completed"]) if not m["failed"] else f"[red]{m['completed']}[/]",
            _rate(m["request_throughput"]),
            _rate(m["output_throughput"]),
            _ms(m["median_ttft_ms"]),
            _ms(m["p99_ttft_ms"]),
            _ms(m["median_itl_ms"]),
            _ms(m["p99_itl_ms"]),
            _ms(m["mean_tpot_ms"]),
            _ms(m["median_e2el_ms"]),
            _ms(m["p99_e2el_ms"]),
        ]
        if goodput:
            cells.append(_rate(m["request_goodput"]))
        cells.append(_ms(m["client_lag_ms"]["p99"]))
        t.add_row(*cells, style=style)

    for p in doc["phases"]:
        if open_loop:
            load = (
                f"{p['offered_request_rate']:.2f}/s"
                if p["offered_request_rate"] != "inf"
                else "inf"
            )
        else:
            load = f"c={p['concurrency']}"
        if p["rate_multiplier"] != 1:
            load += f" ({p['rate_multiplier']:g}x)"
        row(p["name"], load, p)
    if len(doc["phases"]) > 1:
        row("all", "", doc, style="bold")
    width = console.width
    if not console.is_terminal and width < 160:  # a file or pipe: no need to squeeze
        console.width = 160
    try:
        console.print(t)
    finally:
        console.width = width
    console.print(
        "times in ms; each phase counts the requests sent in it, req/s and tok/s until the last "
        "of them ended",
        style="dim",
        highlight=False,
    )
    for line in warnings(doc):
        console.print(f"[yellow]warning:[/] {line}", highlight=False)


def warnings(doc: dict) -> list[str]:
    out = []
    lag = doc["client_lag_ms"]["p99"]
    if doc["loop"] == "open" and lag is not None and lag > LAG_WARN_MS:
        out.append(
            f"the client fell behind its schedule (p99 lag {lag:.0f} ms): the offered load was "
            "lower than planned"
        )
    if doc["failed"]:
        top = next(iter(doc["errors"]), "")
        out.append(f"{doc['failed']} request(s) failed; most often: {top}")
    if doc.get("aborted"):
        out.append(f"{doc['aborted']} request(s) aborted mid-stream by the client on purpose")
    return out


class BenchProgress:
    """Progress during the run: time through the phases (or requests done, without phases),
    with the current phase and counts of sent / done / failed / in flight.

    On a terminal it is a rich progress bar. Elsewhere (a pipe, a log file, ``make demo``'s
    output captured) it prints one plain line when a phase starts and every ``every_s``
    seconds, so a long run is never silent.
    """

    def __init__(self, console: Console, phases, num_requests: int | None, every_s: float = 10.0):
        self.console = console
        self.phases = phases
        total_s = sum(p.duration_s for p in phases)
        self.by_time = math.isfinite(total_s)
        self.total = total_s if self.by_time else (num_requests or None)
        self.sent_n = self.done_n = self.failed_n = 0
        self.started = False
        self.plain = not console.is_terminal
        self.every_s = every_s
        self._printed: tuple[str, float] | None = None  # (phase, elapsed s) of the last line
        self.progress = Progress(
            TextColumn("[bold]{task.fields[phase]}"),
            BarColumn(),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task(
            "bench", total=self.total, phase=phases[0].name, counts=""
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.started and not self.plain:
            self.progress.stop()

    def _start(self) -> None:  # on the first event: the probe before the clock shows nothing
        if not self.started:
            self.started = True
            if not self.plain:
                self.progress.start()

    def _counts(self) -> str:
        inflight = self.sent_n - self.done_n
        return (
            f"sent {self.sent_n} · done {self.done_n - self.failed_n} · failed {self.failed_n}"
            f" · in flight {inflight}"
        )

    def sent(self, res: RequestResult) -> None:
        self._start()
        self.sent_n += 1
        self.progress.update(self.task, counts=self._counts())

    def done(self, res: RequestResult) -> None:
        self.done_n += 1
        self.failed_n += not res.ok and not res.aborted
        kw = {} if self.by_time else {"completed": self.done_n}
        self.progress.update(self.task, counts=self._counts(), **kw)

    def phase_at(self, elapsed_s: float) -> str:
        """The phase running ``elapsed_s`` seconds into the run (``draining`` after the last)."""
        if not self.by_time:
            return self.phases[0].name
        t = 0.0
        for p in self.phases:
            if elapsed_s < t + p.duration_s:
                return p.name
            t += p.duration_s
        return "draining"

    def line(self, elapsed_s: float) -> str:
        """The plain progress line at ``elapsed_s`` seconds: phase, elapsed time, counts."""
        name = self.phase_at(elapsed_s)
        if self.by_time:
            when = f"{elapsed_s:.0f} s of {self.total:.0f} s"
        else:
            when = f"{elapsed_s:.0f} s, {self.done_n} of {self.total or '?'} requests"
        return f"  [{name}] {when} · {self._counts()}"

    def tick(self, elapsed_s: float) -> None:
        self._start()
        name = self.phase_at(elapsed_s)
        if self.plain:
            last = self._printed
            if last is None or last[0] != name or elapsed_s - last[1] >= self.every_s:
                self._printed = (name, elapsed_s)
                self.console.print(self.line(elapsed_s), highlight=False, markup=False)
            return
        if not self.by_time:
            return
        self.progress.update(
            self.task, completed=min(elapsed_s, self.total), phase=name, counts=self._counts()
        )
