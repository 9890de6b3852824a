"""The labelled diagnosis corpus: runs sampled from each symptom family's parameter space, on the
real engine, split once into a tuning part and an evaluation part.

A family is a symptom (the rule that should be the top finding) or ``healthy`` (nothing may
fire), with a parameter space: client counts or rates, prompt and output length ranges, when the
fault starts, its size, the window, the seed. :func:`sample` draws concrete runs from it
deterministically (``random.Random(f"{family}:{index}")``) and each run carries its split,
fixed by its index (even: ``tune``, odd: ``eval``), so no run ever changes sides and the
evaluation split is never read while thresholds are chosen. A run is a :class:`Scenario` built
in code (the same runner as ``tokenmill scenario run``), kept as a Parquet dump plus
``label.json`` (family, expected rules, split, the sampled parameters, fault start in wall-clock
ns).

``python -m tokenmill.bench.corpus --out DIR [--per-family N] [--family F ...] [--split S]
[--run ID ...]``
generates (resumable: a run whose ``label.json`` exists is skipped); ``make corpus`` runs it.
``benchmarks/diagnosis_accuracy.py`` scores the diagnoser on it.

The families were written from the symptom descriptions (seeds, shared cases), not from the
rules' thresholds; three of them (``hol_low_rate``, ``multi_turn_uncached``, ``healthy_loaded``)
are the kinds of miss an independent try found: plain symptoms at one request a window, and our
own load generator taken for a noisy neighbour.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb

from .scenario import Scenario, ScenarioError, run_scenario
from .scenario import _args as scenario_args

SPLITS = ("tune", "eval")


@dataclass
class CorpusRun:
    """One sampled run: its id, family, split, scenario and labels."""

    id: str
    family: str
    split: str
    expect: list[str]  # [] = healthy: nothing may fire
    scenario: Scenario
    params: dict
    fault_start_s: float | None  # seconds after the first bench step starts; None: no fault
    # more keys for its label.json (bench/factorial.py: shape, fault, magnitude, fault window)
    labels: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CorpusFamily:
    name: str
    expect: tuple[str, ...]
    # rng -> (scenario fields, sampled params, fault start s)
    draw: Callable[[random.Random], tuple[dict, dict, float | None]]
    description: str
    # diagnosis windows a run is judged in (drawn per run; the run itself does not depend on
    # it): a periodic symptom over windows a few of its periods long
    windows: tuple[str, ...] = ("5s", "10s")
    # (the recorded store, the run's params) -> why the recording contradicts the label, or
    # None: a run that fails it is not written to the corpus
    label_check: Callable[[duckdb.DuckDBPyConnection, dict], str | None] | None = None


def _u(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def _bench(**kw) -> list[str]:
    args = []
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


# ----- families -----


def _healthy(rng: random.Random):
    c = rng.choice([1, 2, 3])
    p = {
        "concurrency": c,
        "prompt": _u(rng, 24, 64),
        "output": _u(rng, 16, 40),
        "seed": _u(rng, 1, 999),
    }
    n = _u(rng, 14, 22) * c
    steps = [
        _bench(
            concurrency=c,
            num_requests=n,
            prompt_tokens=f"uniform:{p['prompt']}:{p['prompt'] * 2}",
            output_tokens=p["output"],
            seed=p["seed"],
        )
    ]
    return {"steps": steps}, {**p, "requests": n}, None


def _healthy_open(rng: random.Random):
    # open loop well under capacity: about one to three requests a window
    rate = round(rng.uniform(0.2, 0.8), 2)
    p = {"rate": rate, "prompt": _u(rng, 32, 96), "output": _u(rng, 8, 32), "seed": _u(rng, 1, 999)}
    steps = [
        _bench(
            request_rate=rate,
            num_requests=_u(rng, 12, 20),
            prompt_tokens=f"uniform:{p['prompt']}:{p['prompt'] * 2}",
            output_tokens=p["output"],
            seed=p["seed"],
        )
    ]
    return {"steps": steps}, p, None


def _healthy_loaded(rng: random.Random):
    # many streams from one client process: the load generator itself takes CPU on the cores
    c = rng.choice([6, 8, 10])
    p = {
        "concurrency": c,
        "prompt": _u(rng, 24, 48),
        "output": _u(rng, 48, 96),
        "seed": _u(rng, 1, 999),
    }
    steps = [
        _bench(
            concurrency=c,
            num_requests=c * 3,
            prompt_tokens=p["prompt"],
            output_tokens=p["output"],
            seed=p["seed"],
        )
    ]
    return {"steps": steps}, p, None


def _hol_low_rate(rng: random.Random):
    # short requests at one to three a window; one long prompt's chunks take the step budget
    # (running requests come first), so the short ones that arrive meanwhile wait in the queue
    start = round(rng.uniform(5, 9), 1)
    p = {
        "short_rate": round(rng.uniform(0.4, 1.0), 2),
        "short_prompt": _u(rng, 30, 70),
        "short_output": _u(rng, 6, 14),
        "long_prompt": _u(rng, 1200, 2200),
        "long_n": rng.choice([1, 2]),
        "budget": rng.choice([256, 512]),
        "long_at_s": start,
        "seed": _u(rng, 1, 999),
    }
    steps = [
        {
            "start_s": 0,
            "args": _bench(
                request_rate=p["short_rate"],
                num_requests=_u(rng, 20, 30),
                prompt_tokens=p["short_prompt"],
                output_tokens=p["short_output"],
                seed=p["seed"],
            ),
        },
        {
            "start_s": start,
            "args": _bench(
                concurrency=1,
                num_requests=p["long_n"],
                prompt_tokens=p["long_prompt"],
                output_tokens=4,
                seed=p["seed"] + 1,
            ),
        },
    ]
    server = ["--max-num-batched-tokens", str(p["budget"])]
    return {"steps": steps, "server": server}, p, start


def _hol_strict(rng: random.Random):
    # the classic case: strict FCFS admission stops at a long prompt that does not fit yet
    blocks = _u(rng, 200, 240)
    start = round(rng.uniform(4.0, 5.0), 1)
    p = {
        "blocks": blocks,
        "streams": 8,
        "stream_prompt": _u(rng, 260, 320),
        "short_at_s": start,
        "seed": _u(rng, 1, 999),
    }
    steps = [
        {
            "start_s": 0,
            "args": _bench(
                concurrency=8,
                num_requests=8,
                prompt_tokens=p["stream_prompt"],
                output_tokens=75,
                seed=p["seed"],
            ),
        },
        {
            "start_s": start,
            "args": [
                "--request-rate",
                "100",
                "--num-requests",
                "24",
                "--dataset",
                "{scenarios}/head_of_line_blocking.jsonl",
                "--seed",
                str(p["seed"] + 1),
            ],
        },
    ]
    server = ["--admission-policy", "strict", "--num-gpu-blocks-override", str(blocks)]
    return {"steps": steps, "server": server}, p, start


def _multi_turn_uncached(rng: random.Random):
    turns = _u(rng, 7, 10)
    c = rng.choice([1, 2])
    p = {
        "turns": turns,
        "chats": c,
        "prompt": _u(rng, 120, 220),
        "output": _u(rng, 32, 64),
        "seed": _u(rng, 1, 999),
    }
    steps = [
        _bench(
            concurrency=c,
            num_requests=turns * c,
            multi_turn=f"{turns}:{c}",
            prompt_tokens=p["prompt"],
            output_tokens=p["output"],
            seed=p["seed"],
        )
    ]
    return {"steps": steps, "server": ["--no-enable-prefix-caching"]}, p, 0.0


def _host_contention(rng: random.Random):
    start = _u(rng, 12, 20)
    dur = _u(rng, 12, 18)
    procs = rng.choice([3, 4])
    c = rng.choice([2, 3, 4])
    p = {"concurrency": c, "hog_at_s": start, "hog_s": dur, "procs": procs, "seed": _u(rng, 1, 999)}
    steps = [
        _bench(
            concurrency=c,
            phases=f"steady:{start + dur + 8}s",
            prompt_tokens="uniform:32:64",
            output_tokens=_u(rng, 24, 40),
            seed=p["seed"],
        )
    ]
    host = [{"start_s": start, "duration_s": dur, "procs": procs, "every_s": None, "busy_s": None}]
    return {"steps": steps, "host_load": host}, p, float(start)


def _periodic(rng: random.Random):
    every = rng.choice([4, 5, 6])
    busy = round(rng.uniform(0.8, 1.5), 1)
    c = rng.choice([1, 2])
    start = _u(rng, 3, 6)
    length = _u(rng, 36, 48)
    p = {"concurrency": c, "every_s": every, "busy_s": busy, "at_s": start, "seed": _u(rng, 1, 999)}
    steps = [
        _bench(
            concurrency=c,
            phases=f"steady:{length}s",
            prompt_tokens=_u(rng, 24, 48),
            output_tokens=_u(rng, 120, 220),
            seed=p["seed"],
        )
    ]
    host = [
        {
            "start_s": start,
            "duration_s": length - start,
            "procs": 2,
            "every_s": every,
            "busy_s": busy,
        }
    ]
    return {"steps": steps, "host_load": host}, p, float(start)


def _prefill_interference(rng: random.Random):
    start = round(rng.uniform(4, 8), 1)
    p = {
        "streams": rng.choice([3, 4]),
        "long_prompt": _u(rng, 1200, 1800),
        "at_s": start,
        "seed": _u(rng, 1, 999),
    }
    steps = [
        {
            "start_s": 0,
            "args": _bench(
                concurrency=p["streams"],
                num_requests=p["streams"],
                prompt_tokens=_u(rng, 60, 120),
                output_tokens=_u(rng, 180, 240),
                seed=p["seed"],
            ),
        },
        {
            "start_s": start,
            "args": _bench(
                concurrency=1,
                num_requests=1,
                prompt_tokens=p["long_prompt"],
                output_tokens=1,
                seed=p["seed"] + 1,
            ),
        },
    ]
    return {"steps": steps, "server": ["--no-enable-chunked-prefill"]}, p, start


def _queueing(rng: random.Random):
    # a KV pool that holds about six requests; clients step up until requests queue
    # (a first version stepped 3-4 clients up to 2-2.5x: TTFT only doubled, too mild to call)
    base = 4
    step_s = _u(rng, 12, 15)
    top = rng.choice([3.0, 3.5])
    p = {"blocks": _u(rng, 44, 52), "clients": base, "step_s": step_s, "top": top}
    p["seed"] = _u(rng, 1, 999)
    phases = ",".join(f"c{k}:{step_s}s@{m:g}x" for k, m in enumerate((1, 1.5, 2, 2.5, top)))
    steps = [
        _bench(
            concurrency=base,
            phases=phases,
            prompt_tokens=f"uniform:{_u(rng, 40, 56)}:64",
            output_tokens=f"uniform:6:{_u(rng, 12, 16)}",
            seed=p["seed"],
        )
    ]
    server = ["--num-gpu-blocks-override", str(p["blocks"]), "--kv-watermark", "0.3"]
    # the fault, requests queueing for the pool, begins at the 2x step: the pool admits 6-7 of
    # these requests at once, so the 1.5x step's 6 clients still fit and the 2x step's 8 do not (until
    # 2026-12-05 the label put it at the 1.5x step, where nothing waited). A pool at the top of
    # the range can hold all 8: queueing_label_check refuses such a run before it is written
    return {"steps": steps, "server": server}, p, 2.0 * step_s


def queueing_label_check(con: duckdb.DuckDBPyConnection, params: dict) -> str | None:
    """A queueing run's label puts the fault at the 2x step: the pool must hold the 1.5x step's
    clients at once and not the 2x step's, so nothing can wait before that step and requests
    must wait after it. The engine's largest running batch over the run is what the pool
    admitted at once."""
    (peak,) = con.execute("SELECT max(num_running) FROM engine_steps").fetchone()
    lo, hi = 1.5 * params["clients"], 2 * params["clients"]
    if peak is None:
        return "no engine step was recorded"
    if not lo <= peak < hi:
        return (
            f"the largest running batch was {peak}, outside [{lo:g}, {hi:g}): the pool "
            f"({params['blocks']} blocks) "
            + ("ran the 2x step's clients at once" if peak >= hi else "held fewer")
        )
    return None


def _kv_pressure(rng: random.Random):
    # far more running requests than the KV pool holds: preemption by recompute
    blocks = _u(rng, 36, 48)
    c = rng.choice([10, 12, 14])
    p = {"blocks": blocks, "clients": c, "prompt": _u(rng, 120, 180), "seed": _u(rng, 1, 999)}
    warm = _u(rng, 8, 12)
    steps = [
        _bench(
            concurrency=2,
            num_requests=warm,
            prompt_tokens=p["prompt"],
            output_tokens=_u(rng, 60, 100),
            seed=p["seed"],
        ),
        _bench(
            concurrency=c,
            num_requests=2 * c,
            prompt_tokens=p["prompt"],
            output_tokens=_u(rng, 100, 140),
            seed=p["seed"] + 1,
        ),
    ]
    return {"steps": steps, "server": ["--num-gpu-blocks-override", str(blocks)]}, p, None


def _volatile_prefix(rng: random.Random):
    # a shared system prompt whose first line (a timestamp) changes every request
    c = rng.choice([1, 2, 3])
    p = {"clients": c, "prefix": _u(rng, 300, 500), "seed": _u(rng, 1, 999)}
    n = _u(rng, 20, 30)
    steps = [
        _bench(
            concurrency=c,
            num_requests=n,
            shared_prefix=f"{p['prefix']}:{n}:volatile",
            prompt_tokens=_u(rng, 12, 24),
            output_tokens=_u(rng, 6, 12),
            seed=p["seed"],
        )
    ]
    return {"steps": steps}, p, 0.0


FAMILIES: dict[str, CorpusFamily] = {
    f.name: f
    for f in (
        CorpusFamily("healthy", (), _healthy, "closed loop, 1-3 clients, short chats"),
        CorpusFamily("healthy_open", (), _healthy_open, "open loop at 0.2-0.8 req/s"),
        CorpusFamily("healthy_loaded", (), _healthy_loaded, "6-10 streams from one client process"),
        CorpusFamily(
            "hol_low_rate",
            ("head_of_line_blocking",),
            _hol_low_rate,
            "short prompts at 0.4-1 req/s; a long prompt's chunks take the step budget",
        ),
        CorpusFamily(
            "hol_strict",
            ("head_of_line_blocking",),
            _hol_strict,
            "strict admission stops at a long prompt that does not fit",
        ),
        CorpusFamily(
            "multi_turn_uncached",
            # the cause first: the history computed again; TTFT prefill-bound is its symptom
            ("prefix_cache_miss", "ttft_prefill_bound"),
            _multi_turn_uncached,
            "growing chats with the prefix cache off",
        ),
        CorpusFamily(
            "ttft_queueing",
            ("ttft_queueing", "overload"),
            _queueing,
            "clients step up until requests queue for a small KV pool",
            label_check=queueing_label_check,
        ),
        CorpusFamily(
            "kv_pressure_preemption",
            # a pool too small shows as preemption when running requests outgrow it, or as a
            # queue when admission stops first: ttft_queueing with the KV pool as its first
            # cause. With ~150-token prompts in 36-48 blocks admission stops first (tune runs:
            # one preemption in a whole run), so the queue is what the family expects first;
            # preemption-heavy pressure is the kv_pressure_preemption scenario's
            ("ttft_queueing", "kv_pressure_preemption", "midstream_stall"),
            _kv_pressure,
            "more running requests than the KV pool holds",
        ),
        CorpusFamily(
            "prefix_cache_miss",
            ("prefix_cache_miss",),
            _volatile_prefix,
            "a shared system prompt whose first line changes every request",
        ),
        CorpusFamily(
            "host_contention",
            ("host_contention",),
            _host_contention,
            "CPU hogs outside the server mid-run",
        ),
        CorpusFamily(
            "periodic_itl_spikes",
            ("periodic_itl_spikes",),
            _periodic,
            "a job taking the cores about 1 s in every 4-6",
            ("15s", "20s"),
        ),
        CorpusFamily(
            "itl_prefill_interference",
            ("itl_prefill_interference",),
            _prefill_interference,
            "a whole long prefill stalls running decodes",
            ("10s", "30s", "60s"),
        ),
    )
}


def sample(per_family: int, families: list[str] | None = None) -> list[CorpusRun]:
    """``per_family`` runs of each family (all by default), deterministic per (family, index)."""
    names = families or list(FAMILIES)
    runs = []
    for name in names:
        fam = FAMILIES[name]
        for i in range(per_family):
            rng = random.Random(f"{name}:{i}")
            fields, params, fault = fam.draw(rng)
            window = random.Random(f"{name}:{i}:window").choice(fam.windows)
            params = {**params, "window": window}
            sc = Scenario(
                name=f"{name}-{i}",
                expect=list(fam.expect),
                steps=[
                    {"start_s": st["start_s"], "args": scenario_args(st["args"])}
                    if isinstance(st, dict)
                    else scenario_args(st)
                    for st in fields["steps"]
                ],
                server=fields.get("server", []),
                window=window,
                host_load=fields.get("host_load", []),
                case=f"corpus family {name}",
                description=fam.description,
            )
            runs.append(
                CorpusRun(f"{name}-{i}", name, SPLITS[i % 2], list(fam.expect), sc, params, fault)
            )
    return runs


MAX_ATTEMPTS = 3
# a process outside the server, the load generator and the run's own drills that used this
# much CPU (% of all CPUs, its mean over any 5 s) makes the run invalid: it is run again
FOREIGN_CPU_PCT = 10.0
_OWN = ("tokenmill.bench.cpu_hog", "tokenmill.bench.corpus", "tokenmill.bench.factorial")


def foreign_load(store: Path) -> list[str]:
    """Processes that are neither the server, the load generator nor the run's drills and took
    at least ``FOREIGN_CPU_PCT`` of the CPU over some 5 s of the run (the host samples'
    census): ``["pid 123 `cmd` 37%"]``; such a run measured someone else's load too."""
    con = duckdb.connect(str(store), read_only=True)
    try:
        rows = con.execute(
            "SELECT time_ns // 5000000000, busy_others FROM device_samples "
            "WHERE kind = 'host' AND busy_others IS NOT NULL"
        ).fetchall()
    finally:
        con.close()
    per: dict[tuple, dict[int, list[float]]] = {}
    counts: dict[int, int] = {}
    for win, text in rows:
        counts[win] = counts.get(win, 0) + 1
        for d in json.loads(text):
            if d["load_generator"] or any(o in d["command"] for o in _OWN):
                continue
            per.setdefault((d["pid"], d["command"]), {}).setdefault(win, []).append(d["cpu_pct"])
    out = []
    for (pid, cmd), wins in per.items():
        worst = max(sum(v) / counts[w] for w, v in wins.items())
        if worst >= FOREIGN_CPU_PCT:
            out.append(f"pid {pid} `{cmd[:60]}` {worst:.0f}%")
    return out


def generate(
    out: Path, runs: list[CorpusRun], *, model: str | None = None, log=print
) -> list[Path]:
    """Run each of ``runs`` on the real engine into ``out/<id>/`` (Parquet dump + label.json);
    runs whose label exists are skipped. Returns the run folders."""
    from tokenmill.telemetry.parquet_dump import export_parquet

    done = []
    for k, r in enumerate(runs):
        folder = out / r.id
        label = folder / "label.json"
        if label.exists():
            # a label's parts that do not depend on the run follow the family's definition
            meta = json.loads(label.read_text())
            meta.update(
                expect=r.expect,
                absent=r.scenario.absent,
                window=r.scenario.window,
                params=r.params,
                **r.labels,
            )
            label.write_text(json.dumps(meta, indent=2) + "\n")
            done.append(folder)
            continue
        work = out / ".work" / r.id
        log(f"[{k + 1}/{len(runs)}] {r.id} ({r.split}): {json.dumps(r.params)}")
        t = time.monotonic()
        result = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            shutil.rmtree(work, ignore_errors=True)
            try:
                result = run_scenario(r.scenario, work, model=model, log=lambda m: None)
            except ScenarioError as exc:
                log(f"  {r.id} failed: {exc}")
                result = None
                break
            strangers = foreign_load(work / "traces.duckdb")
            if not strangers:
                break
            log(f"  attempt {attempt}: other processes shared the host, run again: {strangers}")
            result = None
        if result is None:
            continue
        check = FAMILIES[r.family].label_check if r.family in FAMILIES else None
        if check is not None:
            con = duckdb.connect(str(work / "traces.duckdb"), read_only=True)
            try:
                wrong = check(con, r.params)
            finally:
                con.close()
            if wrong:
                log(f"  {r.id} not written: its recording contradicts its label: {wrong}")
                shutil.rmtree(work, ignore_errors=True)
                continue
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        con = duckdb.connect(str(work / "traces.duckdb"), read_only=True)
        try:
            export_parquet(con, folder / "dump")
        finally:
            con.close()
        steps_ns = result["steps_started_ns"]
        meta = {
            "id": r.id,
            "family": r.family,
            "split": r.split,
            "expect": r.expect,
            "absent": r.scenario.absent,
            "window": r.scenario.window,
            "params": r.params,
            "server": r.scenario.server,
            "fault_start_ns": None
            if r.fault_start_s is None
            else steps_ns + int(r.fault_start_s * 1e9),
            "steps_started_ns": steps_ns,
            "scenario_top": result["top"],
            "wall_s": round(time.monotonic() - t, 1),
            **r.labels,
        }
        label.write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(work, ignore_errors=True)
        log(f"  top: {result['top']} ({meta['wall_s']} s)")
        done.append(folder)
    return done


def load_runs(root: Path, split: str | None = None) -> list[tuple[dict, Path]]:
    """The corpus's runs under ``root``: ``(label, dump folder)``, sorted by id."""
    out = []
    for label in sorted(root.glob("*/label.json")):
        meta = json.loads(label.read_text())
        if split is None or meta["split"] == split:
            out.append((meta, label.parent / "dump"))
    return out


# The queue as it stood at each step (StepRecord.oldest_wait_*) from the requests' own
# milestones: queued before the step started, first scheduled (or ended unscheduled) after it.
# tests/engine/test_engine_batching.py holds the engine's fields equal to this on real steps.
_QUEUE_AGE_SQL = """
SELECT s.step_id, s.start_ns,
       arg_min(r.request_id, r.queued_ns) AS oldest_wait_id,
       arg_min(r.input_tokens, r.queued_ns) AS oldest_wait_prompt_tokens,
       (s.start_ns - min(r.queued_ns)) / 1e6 AS oldest_wait_ms
FROM engine_steps s JOIN requests r
  ON r.queued_ns <= s.start_ns AND coalesce(r.scheduled_ns, r.end_ns) > s.start_ns
GROUP BY s.step_id, s.start_ns
"""


def backfill_queue_age(dump: Path) -> bool:
    """Give a Parquet dump recorded before the step fields ``oldest_wait_ms``,
    ``oldest_wait_id`` and ``oldest_wait_prompt_tokens`` their values, computed from the
    requests' milestones as the engine computes them; False when it has them already."""
    steps = dump / "engine_steps.parquet"
    con = duckdb.connect()
    try:
        con.execute(f"CREATE VIEW engine_steps AS SELECT * FROM read_parquet('{steps}')")
        con.execute(
            f"CREATE VIEW requests AS SELECT * FROM read_parquet('{dump / 'requests.parquet'}')"
        )
        cols = {r[0] for r in con.execute("DESCRIBE engine_steps").fetchall()}
        if "oldest_wait_ms" in cols:
            return False
        tmp = steps.with_suffix(".tmp.parquet")
        con.execute(
            f"COPY (SELECT s.*, q.oldest_wait_ms, q.oldest_wait_id, "
            f"q.oldest_wait_prompt_tokens::INTEGER AS oldest_wait_prompt_tokens "
            f"FROM engine_steps s LEFT JOIN ({_QUEUE_AGE_SQL}) q "
            f"USING (step_id, start_ns) ORDER BY s.start_ns) TO '{tmp}' (FORMAT parquet)"
        )
    finally:
        con.close()
    tmp.replace(steps)
    return True


# the API's waiting samples (engine/api/server_state.py: ServerState.waiting_rows) as the API would
# have taken them, one every WAITING_SAMPLE_S from the first arrival: each request past tokenize
# that had arrived and had no first token yet (nor had ended)
_WAITING_SQL = """
WITH r AS (SELECT * FROM requests WHERE input_tokens IS NOT NULL),
t AS (SELECT unnest(range((SELECT min(arrival_ns) FROM r) + $step,
                          (SELECT max(end_ns) FROM r), $step)) AS time_ns)
SELECT t.time_ns, r.request_id, r.arrival_ns, (t.time_ns - r.arrival_ns) / 1e6 AS wait_ms,
       r.input_tokens AS prompt_tokens, coalesce(r.scheduled_ns <= t.time_ns, false) AS scheduled,
       r.tenant, r.replica
FROM t JOIN r ON r.arrival_ns < t.time_ns AND coalesce(r.first_token_ns, r.end_ns) > t.time_ns
ORDER BY t.time_ns, r.arrival_ns
"""


def backfill_waiting(dump: Path) -> bool:
    """Give a Parquet dump recorded before the ``waiting_samples`` table its rows, computed from
    the requests' milestones as the API samples them; False when it has the table already."""
    out = dump / "waiting_samples.parquet"
    if out.exists():
        return False
    from tokenmill.engine.api.app import WAITING_SAMPLE_S

    tmp = out.with_suffix(".tmp.parquet")
    con = duckdb.connect()
    try:
        con.execute(
            f"CREATE VIEW requests AS SELECT * FROM read_parquet('{dump / 'requests.parquet'}')"
        )
        sql = _WAITING_SQL.replace("$step", str(int(WAITING_SAMPLE_S * 1e9)))
        con.execute(f"COPY ({sql}) TO '{tmp}' (FORMAT parquet)")
    finally:
        con.close()
    tmp.replace(out)
    return True


def scenario_runs(names: list[str]) -> list[CorpusRun]:
    """Named scenarios (``scenarios/*.toml``) as runs to record: each a run of its own family,
    split ``scenario``, so the diagnoser can be checked on its real-engine dump in seconds
    (``make scenario-dumps``; ``tests/bench/test_scenarios.py``)."""
    from .scenario import load

    return [CorpusRun(n, n, "scenario", list(load(n).expect), load(n), {}, None) for n in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tokenmill.bench.corpus", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--per-family", type=int, default=4)
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    ap.add_argument(
        "--scenario",
        action="append",
        help="record this named scenario instead of sampling families (repeatable)",
    )
    ap.add_argument("--split", choices=SPLITS)
    ap.add_argument(
        "--run",
        action="append",
        metavar="ID",
        help="only this sampled run, such as ttft_queueing-12 (repeatable)",
    )
    ap.add_argument("--model")
    ap.add_argument("--list", action="store_true", help="print the sampled runs and stop")
    ap.add_argument(
        "--backfill-queue-age",
        action="store_true",
        help="give the dumps under --out recorded before the step fields oldest_wait_* and "
        "the waiting_samples table their values from the requests' milestones, and stop",
    )
    a = ap.parse_args(argv)
    if a.backfill_queue_age:
        done = sampled = 0
        for d in sorted(a.out.glob("*/dump")):
            try:
                done += backfill_queue_age(d)
                sampled += backfill_waiting(d)
            except duckdb.Error as exc:  # a damaged dump: say which, leave it as it was
                print(f"error: {d}: {str(exc).splitlines()[0]}", file=sys.stderr)
                return 2
        print(
            f"{done} dumps given oldest_wait_* and {sampled} given waiting_samples from their "
            "requests' milestones"
        )
        return 0
    runs = scenario_runs(a.scenario) if a.scenario else sample(a.per_family, a.family)
    if a.split:
        runs = [r for r in runs if r.split == a.split]
    if a.run:
        unknown = sorted(set(a.run) - {r.id for r in runs})
        if unknown:
            print(f"error: --run {unknown[0]}: not among the sampled runs", file=sys.stderr)
            return 2
        runs = [r for r in runs if r.id in a.run]
    if a.list:
        for r in runs:
            print(r.id, r.split, json.dumps(r.params), asdict(r.scenario)["server"])
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    generate(a.out, runs, model=a.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
