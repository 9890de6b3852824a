"""Predictions: a recording opened once, each what-if replayed and summed up with the same SQL
that measures a real run (``tokenmill.telemetry.readers.REQUEST_SUMMARY_SQL`` over a
``requests`` table of the replayed requests), and the error estimate printed with every
prediction.

The error estimate replays the recording against itself where the step-cost model saw no step:
the last quarter of the recorded requests (in arrival order; counted, not timed, so bursty
traffic still leaves a quarter of its requests to score) is held out. The model is fitted on
the steps that ran before the first of them arrived, the whole recording is replayed with it
(so the held-out requests start from the queue and batch the replay built up, as the real
ones did), and each summary metric over the held-out requests is set against what the
recording measured for them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np

from tokenmill.engine.config import EngineConfig
from tokenmill.telemetry.readers import LATENCY_KEYS, REQUEST_SUMMARY_SQL
from tokenmill.telemetry.recorded_config import RecordedConfig, read_recorded_config

from .simulate import Setup, SimResult, simulate
from .step_cost import StepCostError, StepCostModel, fit_step_cost
from .upstream import (
    UpstreamError,
    UpstreamLimits,
    check_upstream_profile,
    fit_upstream,
    is_upstream_store,
    read_limits,
)
from .whatif import CONFIG_FIELDS, SloBounds, WhatIf
from .workload import RecordingError, ReplayWorkload, read_workload

#: the summary metrics a prediction reports, in order (ms, then shares)
METRICS = (*LATENCY_KEYS, "goodput_share")
#: share of the recorded requests (the last to arrive) the error estimate holds out
HOLDOUT_SHARE = 0.25
#: the fewest held-out requests an error estimate is given for
HOLDOUT_MIN_REQUESTS = 10


class PlanError(ValueError):
    """Bad input or a store a plan cannot stand on (one line)."""


@dataclass
class Recording:
    """An opened recording: its knobs, traffic, step-cost model and pool size."""

    path: str
    con: duckdb.DuckDBPyConnection
    recorded: RecordedConfig
    config: EngineConfig
    workload: ReplayWorkload
    model: StepCostModel
    num_blocks: int
    #: the profile fitted with the recording (``plan/profile.py``): its path and its steps
    profile: str | None = None
    profile_steps: tuple = ()
    #: price steps as on a host where nothing else runs (no load generator, no neighbour);
    #: else the recording's other processes, the load generator's share grown with the rate
    dedicated_host: bool = False
    #: another engine's recording (a proxy's store): the limits its replay takes
    upstream: UpstreamLimits | None = None

    @property
    def device(self) -> str:
        return self.recorded.engine_device

    def fit_until(self, until_ns: int) -> StepCostModel:
        """The step costs fitted again on what the recording held before ``until_ns``.

        Raises:
            StepCostError, UpstreamError: too little before it.
        """
        if self.upstream is not None:
            return fit_upstream(
                self.con, self.upstream, until_ns=until_ns, extra=self.profile_steps
            )
        return fit_step_cost(
            self.con, self.recorded, shape=self.model.shape, until_ns=until_ns,
            extra=self.profile_steps,
        )  # fmt: skip


def _engine_config(recorded: RecordedConfig) -> EngineConfig:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    try:
        return EngineConfig(**{k: v for k, v in recorded.attributes.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise PlanError(f"the recorded engine config does not load here ({exc})") from None


def open_recording(
    path: str | Path, *, use_profile: bool = True, upstream_limits: dict | None = None
) -> Recording:
    """Open a store or dump and fit what a plan needs from it, with its profile where one lies
    beside it (:func:`~tokenmill.plan.profile.profile_path`); a proxy's store of another engine
    with that engine's limits (``upstream_limits`` as given, the rest read from the store:
    :mod:`.upstream`).

    Raises:
        PlanError: not a store, no requests, no engine steps, too few steps, a profile of
            another setup, a proxy's store without its upstream's limits (one line).
    """
    from tokenmill.telemetry.dump import DumpError, open_dump

    from .profile import profile_path

    try:
        con = open_dump(path, verify=False)
    except DumpError as exc:
        raise PlanError(str(exc)) from None
    prof = profile_path(path)
    if is_upstream_store(con):
        try:
            swept = (load_upstream_profile(prof, con),) if use_profile and prof.exists() else ()
            rec = upstream_recording(con, str(path), upstream_limits or {}, profile=swept)
        except PlanError:
            con.close()
            raise
        rec.profile = str(prof) if swept else None
        return rec
    if upstream_limits:
        con.close()
        raise PlanError(
            f"{path}: --upstream-limits is for a proxy's store of another engine; this one "
            "holds our engine's steps"
        )
    try:
        steps = ()
        if use_profile and prof.exists():
            (span,) = con.execute(
                "SELECT min(start_ns), max(start_ns) FROM engine_steps"
            ).fetchall()
            steps = (load_profile(prof, read_recorded_config(con), span),)
        rec = recording_from(con, str(path), profile_steps=steps)
    except PlanError:
        con.close()
        raise
    if steps:
        rec.profile = str(prof)
    return rec


def _read_profile(path: Path, check, tables: dict[str, str], what: str):
    """The profile at ``path``, once ``check(src)`` passed (it raises :class:`ProfileError` or
    :class:`UpstreamError`), its ``tables`` (name: the query that fills it) copied into memory.

    Raises:
        PlanError: not a store, the check failed, or the tables do not read (one line).
    """
    from tokenmill.telemetry.dump import DumpError, open_dump

    from .profile import ProfileError

    try:
        src = open_dump(path, verify=False)
    except DumpError as exc:
        raise PlanError(
            f"{exc} (the profile beside the recording: delete it or sweep again)"
        ) from None
    try:
        check(src)
        got = {name: src.sql(query).to_arrow_table() for name, query in tables.items()}
    except (ProfileError, UpstreamError) as exc:
        raise PlanError(str(exc)) from None
    except duckdb.Error as exc:
        raise PlanError(f"profile {path}: cannot read its {what} ({exc})") from None
    finally:
        src.close()
    out = duckdb.connect()
    for name, arrow in got.items():
        out.register("copied", arrow)
        out.execute(f"CREATE TABLE {name} AS SELECT * FROM copied")
        out.unregister("copied")
    return out


def load_profile(
    path: Path, recorded: RecordedConfig, own_span: tuple
) -> duckdb.DuckDBPyConnection:
    """A profile's engine steps, in memory, once its setup is the recording's and its steps
    are not the recording's own (``own_span``: the recording's first and last step start).

    Raises:
        PlanError: not a store, or a profile of another model, precision or device.
    """
    from .profile import ProfileError, check_profile

    def check(src: duckdb.DuckDBPyConnection) -> None:
        check_profile(recorded, read_recorded_config(src.cursor()), f"profile {path}")
        ((lo, hi),) = src.execute(
            "SELECT min(start_ns), max(start_ns) FROM engine_steps"
        ).fetchall()
        if lo is not None and own_span[0] is not None and lo <= own_span[1] and hi >= own_span[0]:
            raise ProfileError(
                f"profile {path}: its steps ran while the recording did (a copy of it?): a "
                "profile is a sweep made apart from the recording"
            )

    # the host's census beside the sweep's steps (the host-load term reads it)
    tables = {
        "engine_steps": "SELECT * FROM engine_steps",
        "device_samples": "SELECT * FROM device_samples WHERE kind = 'host'",
    }
    return _read_profile(path, check, tables, "steps")


def load_upstream_profile(path: Path, recording: duckdb.DuckDBPyConnection):
    """A sweep of another engine (its requests, in memory), once it is the recording's engine's
    and apart from the recording.

    Raises:
        PlanError: not a store, a sweep of another model, or a copy of the recording.
    """

    def check(src: duckdb.DuckDBPyConnection) -> None:
        check_upstream_profile(recording, src, f"profile {path}")

    return _read_profile(path, check, {"requests": "SELECT * FROM requests"}, "requests")


def recording_from(
    con: duckdb.DuckDBPyConnection, label: str, *, profile_steps: tuple = ()
) -> Recording:
    """What a plan needs from an open store (the console's, or :func:`open_recording`'s); the
    step costs fitted on its steps and ``profile_steps``' (stores of the same engine); a
    proxy's store of another engine as :func:`upstream_recording` reads it.

    Raises:
        PlanError: no requests, no engine steps, too few steps (one line naming ``label``).
    """
    if not profile_steps and is_upstream_store(con):
        return upstream_recording(con, label, {})
    try:
        recorded = read_recorded_config(con)
        model = fit_step_cost(con, recorded, extra=profile_steps)
        workload = read_workload(con)
        (blocks,) = con.execute(
            "SELECT max(kv_blocks_total) FROM engine_steps WHERE kv_blocks_total > 0"
        ).fetchone()
    except (StepCostError, RecordingError) as exc:
        raise PlanError(f"{label}: {exc}") from None
    except duckdb.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PlanError(f"{label}: cannot read the store ({first})") from None
    if not blocks:
        raise PlanError(f"{label}: the engine steps do not say the KV pool's size")
    return Recording(label, con, recorded, _engine_config(recorded), workload, model, int(blocks),
                     profile_steps=profile_steps)  # fmt: skip


def upstream_recording(
    con: duckdb.DuckDBPyConnection, label: str, given: dict, *, profile: tuple = ()
) -> Recording:
    """What a plan needs from a proxy's store of another engine: its traffic, its step costs
    fitted on the requests and on those of ``profile`` (a sweep of the same engine:
    :func:`~tokenmill.plan.upstream.fit_upstream`) and our scheduler set to its limits (slots,
    the prompt tokens of a step, its KV cache), chunked prefill on, no prefix cache.

    Raises:
        PlanError: no answered request, too few to fit, no slot count (one line naming ``label``).
    """
    try:
        limits = read_limits(con, given)
        model = fit_upstream(con, limits, extra=profile)
        workload = read_workload(con)
    except (UpstreamError, RecordingError) as exc:
        raise PlanError(f"{label}: {exc}") from None
    except duckdb.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PlanError(f"{label}: cannot read the store ({first})") from None
    knobs = {
        "max_num_seqs": limits.slots,
        "max_num_batched_tokens": limits.batch_tokens,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
    }
    recorded = RecordedConfig(recorded=False, attributes=knobs, **knobs)
    blocks = -(-limits.kv_tokens // recorded.block_size)
    return Recording(label, con, recorded, _engine_config(recorded), workload, model, blocks,
                     profile_steps=profile, upstream=limits)  # fmt: skip


def summarize_rows(
    con: duckdb.DuckDBPyConnection, slo: SloBounds, since_ns=None, until_ns=None
) -> dict:
    """The summary metrics of a ``requests`` table (a store's, or a replay's)."""
    lo, hi = con.execute("SELECT min(arrival_ns), max(arrival_ns) FROM requests").fetchone()
    cur = con.execute(
        REQUEST_SUMMARY_SQL,
        {
            "since": since_ns if since_ns is not None else lo,
            "until": until_ns if until_ns is not None else hi + 1,
            **slo.goodput.sql_params(),
        },
    )
    row = dict(zip([d[0] for d in cur.description], cur.fetchone(), strict=True))
    n = int(row["requests"] or 0)
    out = {k: (float(row[k]) if row.get(k) is not None else None) for k in METRICS[:-1]}
    out["goodput_share"] = (row["good"] or 0) / n if n else None
    out["requests"] = n
    out["completed"] = int(row["completed"] or 0)
    return out


def result_rows(workload: ReplayWorkload, result: SimResult) -> duckdb.DuckDBPyConnection:
    """A replay's requests as an in-memory ``requests`` table (the columns the summary reads)."""
    import pyarrow as pa

    arrival = np.round(workload.arrival_s * 1e9).astype(np.int64)
    done = ~np.isnan(result.e2e_ms)
    e2e = np.nan_to_num(result.e2e_ms, nan=0.0)
    table = pa.table(
        {
            "arrival_ns": arrival,
            "end_ns": arrival + np.round(e2e * 1e6).astype(np.int64),
            "input_tokens": workload.input_tokens,
            "output_tokens": result.output_tokens,
            **{k: pa.array(v, from_pandas=True) for k, v in result.latencies.items()},
            "finish_reason": pa.array(np.where(done, "length", None).tolist(), pa.string()),
            "error_type": pa.nulls(len(arrival), pa.string()),
        }
    )
    con = duckdb.connect()
    con.register("replayed", table)
    con.execute("CREATE TABLE requests AS SELECT * FROM replayed")
    con.unregister("replayed")
    return con


@dataclass
class Prediction:
    """One what-if's replay, summed up."""

    whatif: WhatIf
    summary: dict
    replay: dict
    setup: dict
    notes: list[str] = field(default_factory=list)
    #: each latency metric replayed with every step the fit's error cheaper and dearer
    #: (:func:`step_band`); None where the replay is too big to repeat
    band: dict | None = None
    slo_misses: dict = field(default_factory=dict)
    slo_margin: float | None = None

    def to_dict(self) -> dict:
        return {
            "what_if": self.whatif.label,
            "changes": self.whatif.changes,
            "setup": self.setup,
            "summary": self.summary,
            "replay": self.replay,
            "slo_met": not self.slo_misses,
            "slo_misses": {k: {"value": v, "bound": b} for k, (v, b) in self.slo_misses.items()},
            "slo_margin": self.slo_margin,
            "notes": self.notes,
            "band": self.band,
        }


#: what a replay holds per KV block of its replicas' pools and per request, in bytes (about
#: what the million-request, 64-replica replay of ``benchmarks/plan_scale.py`` took)
REPLAY_BYTES_PER_BLOCK = 300
REPLAY_BYTES_PER_REQUEST = 600


def available_memory() -> int | None:
    """This host's available memory in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(replicas: int, num_blocks: int, requests: int) -> None:
    """Refuse a replay that would not fit in the available memory, before building it."""
    need = replicas * num_blocks * REPLAY_BYTES_PER_BLOCK + requests * REPLAY_BYTES_PER_REQUEST
    have = available_memory()
    if have is not None and need > have:
        raise PlanError(
            f"this replay would hold about {need / 2**30:.1f} GiB ({replicas:,} replicas of "
            f"{num_blocks:,} KV blocks, {requests:,} requests); {have / 2**30:.1f} GiB is "
            "available: plan fewer hosts, replicas, KV blocks or requests"
        )


def host_load_factor(model: StepCostModel, traffic: float, dedicated: bool) -> tuple[float, str]:
    """The steps' time factor for the host's load at ``traffic`` times the recording's traffic
    per host, and the note that says which host the plan is for (empty: nothing to say). On
    the recording's host the load generator's share grows with the traffic and the other
    processes' stays; on a dedicated host nothing else runs."""
    h = model.host_load
    if "others_pct" not in h:
        return 1.0, ""
    others, loadgen = h["others_pct"] / 100, h["loadgen_pct"] / 100
    if dedicated:
        planned, host = 0.0, "a dedicated host (no other process)"
    else:
        planned = others - loadgen + loadgen * traffic
        if traffic == 1.0 or not loadgen:
            return 1.0, ""
        host = (
            f"the recording's host, its load generator at x{traffic:g} "
            f"({loadgen:.1%} of the CPUs -> {loadgen * traffic:.1%})"
        )
    if not h.get("slope"):
        return 1.0, f"host load not priced for {host}: {h['why_none']}"
    factor = model.load_factor(planned)
    return factor, (
        f"planned for {host}: the others' CPU {others:.1%} as recorded -> {planned:.1%}, "
        f"steps x{factor:.3f} (fitted on {h['steps']:,} steps whose others' CPU ran "
        f"{h['others_range_pct'][0]:.0f}-{h['others_range_pct'][1]:.0f}%)"
    )


def setup_for(
    rec: Recording, whatif: WhatIf, cost_models: dict[str, StepCostModel] | None = None
) -> tuple[Setup, ReplayWorkload, StepCostModel, list[str]]:
    """The replay a what-if asks for: setup, workload, step-cost model and the notes it needs.

    Raises:
        PlanError: a quantization without a recording made with it, or a replay bigger than
            this host's available memory.
    """
    ch = whatif.changes
    notes: list[str] = []
    config = dataclasses.replace(
        rec.config, **{CONFIG_FIELDS[k]: v for k, v in ch.items() if k in CONFIG_FIELDS}
    )
    model = rec.model
    want = ch.get("quantization")
    have = rec.recorded.quantization or "none"
    if want is not None and want != have:
        other = (cost_models or {}).get(want)
        if other is None:
            raise PlanError(
                f"what-if quantization={want}: the recording ran {have}; give a recording made "
                f"with --quantization {want} as --cost-from for its step costs"
            )
        model = other
        notes.append(f"step costs from the --cost-from recording made with {want}")
    if "step_time" in ch:
        model = model.scaled(float(ch["step_time"]))
        notes.append(f"every step takes x{ch['step_time']:g} the time the step costs give")
    else:
        factor, note = host_load_factor(
            model, float(ch.get("rate", 1.0)) / int(ch.get("hosts", 1)), rec.dedicated_host
        )
        if factor != 1.0:
            model = model.scaled(factor)
        if note:
            notes.append(note)
    replicas = int(ch.get("replicas", 1))
    hosts = int(ch.get("hosts", 1))
    threads = None
    if replicas > 1 and rec.device == "cpu" and model.threads:
        threads = max(1, model.threads // replicas)
        if threads != model.threads:
            factor, source = model.thread_scale(threads)
            notes.append(
                f"each of {replicas} replicas on a host gets {threads} of the {model.threads} CPU "
                f"threads the recording's forward used: its forward time x{factor:.2f} ({source})"
            )
    num_blocks = int(ch.get("kv_blocks", rec.num_blocks))
    _check_memory(replicas * hosts, num_blocks, int(ch.get("requests", len(rec.workload))))
    workload = rec.workload
    if "requests" in ch:
        workload = workload.repeated(int(ch["requests"]))
    if "rate" in ch:
        workload = workload.scaled(float(ch["rate"]))
    setup = Setup(
        config=config,
        num_blocks=num_blocks,
        replicas=replicas * hosts,
        threads=threads,
        max_model_len=rec.recorded.max_model_len or 1 << 20,
    )
    return setup, workload, model, notes


#: a replay of at most this many requests x replicas is repeated for its band
BAND_MAX_WORK = 50_000
#: a metric whose band spans more than this share of its value is named in the notes
BAND_WIDE = 0.5
#: the band's step error where the fit has no held-out score
BAND_DEFAULT_ERR = 0.05


def step_band(
    rec: Recording, workload: ReplayWorkload, setup: Setup, model: StepCostModel,
    slo: SloBounds, summary: dict, *, fast_forward: bool = True,
) -> dict:  # fmt: skip
    """The what-if replayed twice more, every step priced cheaper and dearer by the fit's median
    held-out error: each latency metric's ``[low, high]`` over the three replays, the error used
    (``step_error_pct``), and ``notes`` naming the metrics whose band spans more than
    :data:`BAND_WIDE` of their value. Near a tipping point (a queue that forms or not, a batch
    that crosses the compiled step's rows) a few percent of step time moves a percentile by
    tens of percent, and so does the host's pace from one hour to the next: such a prediction
    is a range, not a number."""
    held = rec.model.holdout.get("all", {}).get("median_abs_err_pct")
    err = held / 100 if held else BAND_DEFAULT_ERR
    runs = [summary]
    for factor in (1 - err, 1 + err):
        res = simulate(workload, setup, model.scaled(factor), fast_forward=fast_forward)
        con = result_rows(workload, res)
        runs.append(summarize_rows(con, slo))
        con.close()
    out: dict = {"step_error_pct": err * 100, "notes": []}
    wide = []
    for key in LATENCY_KEYS:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if not vals:
            continue
        out[key] = [min(vals), max(vals)]
        if summary.get(key) and (max(vals) - min(vals)) > BAND_WIDE * summary[key]:
            wide.append(f"{key.removesuffix('_ms').replace('_', ' ').upper()} "
                        f"{min(vals):,.0f}-{max(vals):,.0f} ms")  # fmt: skip
    if wide:
        out["notes"].append(
            f"near a tipping point: with every step {err:.0%} cheaper or dearer (the fit's "
            f"held-out error) {', '.join(wide)}; read these as ranges"
        )
    return out


def predict(
    rec: Recording,
    whatif: WhatIf,
    slo: SloBounds,
    *,
    cost_models: dict[str, StepCostModel] | None = None,
    fast_forward: bool = True,
    with_band: bool = True,
) -> Prediction:
    """Replay one what-if and sum it up, with its band (:func:`step_band`) where the replay is
    small and ``with_band`` (a search over many replays leaves it out)."""
    setup, workload, model, notes = setup_for(rec, whatif, cost_models)
    result = simulate(workload, setup, model, fast_forward=fast_forward)
    con = result_rows(workload, result)
    summary = summarize_rows(con, slo)
    con.close()
    spread = None
    if with_band and len(workload) * setup.replicas <= BAND_MAX_WORK:
        spread = step_band(rec, workload, setup, model, slo, summary, fast_forward=fast_forward)
        notes.extend(spread.pop("notes"))
    measured_batch = model.ranges["max_decode_batch"]
    if measured_batch and result.max_decode_batch > 1.5 * measured_batch:
        top = list(model.residuals_by_batch.items())[-1:]
        band = (
            f"; on held-out steps of {top[0][0]} rows, the largest measured, the model was "
            f"off by {top[0][1]['median_err_pct']:+.0f}% (median)"
            if top
            else ""
        )
        notes.append(
            f"decode batches reach {result.max_decode_batch}, x{result.max_decode_batch / measured_batch:.1f} "
            f"the {measured_batch} {'the recording and its profile' if rec.profile_steps else 'the recording'} "
            f"measured: the step costs there are extrapolated{band}"
            + ("" if rec.profile_steps else " (`--profile` measures them)")
        )
    eager = model.ranges.get("max_eager_decode_batch", 0)
    if model.native_rows and result.max_eager_decode_batch > max(1.5 * eager, model.native_rows):
        notes.append(
            f"decode-only batches of {model.native_rows + 1}-{result.max_eager_decode_batch} "
            "run the eager forward, which the recording "
            + (f"ran only up to {eager} rows" if eager else "never ran on decode-only steps")
            + ": their cost is extrapolated from its prefill steps"
        )
    for kind, n in model.thin_kinds().items():
        if result.steps_by_kind.get(kind):
            notes.append(
                f"{result.steps_by_kind[kind]:,} replayed {kind.replace('_', ' ')} steps lean "
                f"on {n} recorded ones (too few to fit)"
            )
    rejected = int(result.rejected.sum())
    if rejected:
        notes.append(f"{rejected} requests could never fit this pool or context and were refused")
    replay = {
        "requests": len(workload),
        "preemptions": int(result.preemptions.sum()),
        "rejected": rejected,
        "kv_usage_mean": result.kv_usage_mean,
        "kv_usage_max": result.kv_usage_max,
        "waiting_mean": result.waiting_mean,
        "waiting_max": result.waiting_max,
        "running_mean": result.running_mean,
        "max_decode_batch": result.max_decode_batch,
        "max_eager_decode_batch": result.max_eager_decode_batch,
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "steps": result.steps,
        "steps_by_kind": result.steps_by_kind,
        "scheduler_calls": result.scheduler_calls,
        "makespan_s": result.makespan_s,
        "wall_s": result.wall_s,
        "processes": result.processes,
        "routed": result.routed,
        "throughput_tok_s": float(result.output_tokens.sum()) / max(result.makespan_s, 1e-9),
    }
    return Prediction(
        whatif=whatif,
        summary=summary,
        replay=replay,
        setup={
            "replicas": setup.replicas,
            "hosts": int(whatif.changes.get("hosts", 1)),
            "threads_per_replica": setup.threads,
            "kv_blocks": setup.num_blocks,
            "max_num_seqs": setup.config.max_num_seqs,
            "max_num_batched_tokens": setup.config.max_num_batched_tokens,
            "chunked_prefill": setup.config.enable_chunked_prefill,
            "prefix_caching": setup.config.enable_prefix_caching,
            "rate_per_s": workload.rate_per_s,
        },
        notes=notes,
        band=spread,
        slo_misses=slo.misses(summary) if slo.bounds else {},
        slo_margin=slo.margin(summary),
    )


def measured(rec: Recording, slo: SloBounds) -> dict:
    """The recording's own summary (the same definitions)."""
    return summarize_rows(rec.con, slo)


def errors_pct(pred: dict, real: dict) -> dict:
    """Each summary metric's error of ``pred`` against ``real``: relative (%) for latencies,
    a difference in points for goodput; metrics either side lacks are left out."""
    errors = {}
    for k in METRICS:
        p, r = pred.get(k), real.get(k)
        if p is None or r is None:
            continue
        errors[k] = (p - r) * 100 if k == "goodput_share" else (p - r) / r * 100 if r else None
    return errors


def error_estimate(rec: Recording, slo: SloBounds) -> dict:
    """Each metric's error (%; goodput in points) over the last :data:`HOLDOUT_SHARE` of the
    recorded requests (in arrival order), predicted with a model fitted on the steps before
    the first of them arrived (see the module docstring); a note instead when fewer than
    :data:`HOLDOUT_MIN_REQUESTS` would be held out."""
    w = rec.workload
    first = int(len(w) * (1 - HOLDOUT_SHARE))  # the first held-out request
    if len(w) - first < HOLDOUT_MIN_REQUESTS:
        return {"note": f"no error estimate: only {len(w) - first} requests in the last quarter"}
    # halfway between the last fitted request's arrival and the first held-out one's
    rel_cut_s = (float(w.arrival_s[first - 1]) + float(w.arrival_s[first])) / 2
    cut = w.start_ns + int(rel_cut_s * 1e9)
    tail = int((w.arrival_s >= rel_cut_s).sum())  # requests that arrived together stay together
    try:
        model = rec.fit_until(cut)
    except (StepCostError, UpstreamError) as exc:
        return {"note": f"no error estimate: {exc}"}
    setup = Setup(rec.config, rec.num_blocks, max_model_len=rec.recorded.max_model_len or 1 << 20)
    result = simulate(w, setup, model)
    con = result_rows(w, result)
    pred = summarize_rows(con, slo, since_ns=cut - w.start_ns)
    con.close()
    real = summarize_rows(rec.con, slo, since_ns=cut)
    errors = errors_pct(pred, real)
    # the host's pace over the held-out stretch against the fit: how much of the error is the
    # machine running faster or slower than it did before
    pace = model.pace(rec.con, since_ns=cut)
    return {"requests": tail, "errors_pct": errors, "pace": pace["factor"]}
