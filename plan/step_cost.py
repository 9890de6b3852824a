"""A step's wall time as a function of what the step did, fitted on a store's ``engine_steps``.

One working step costs ``Σ coefficient × term`` milliseconds, with non-negative coefficients
(least squares under that constraint, :func:`scipy.optimize.nnls`), for two parts fitted apart:
the forward (``forward_ms``) and the host's share around it (scheduling, input preparation,
sampling, detokenization). The terms (:data:`TERMS`):

* ``step``: a fixed cost per step;
* ``decode_tokens``: decode rows (a decode verifying drafts counts each draft);
* ``prefill_tokens``: prompt tokens computed (chunks and recomputes after a preemption);
* ``prefill_chunks``: prompt chunks (each its own attention call);
* ``attn_gflop``: attention's FLOPs beyond the linear layers (``flops`` less ``2 × params ×
  tokens`` and the LM head's rows: :mod:`tokenmill.engine.roofline`'s arithmetic), the quadratic
  part of a long prefill;
* ``kv_read_mtok``: KV tokens attention read, all layers, in millions (what a big decode batch
  with long contexts pays).

Each forward path is fitted apart (:data:`PATHS`): on a CPU, decode-only steps of up to a dozen
rows run the engine's compiled decode step and everything else the eager module forward, whose
cost per decode row is several times higher; the replay puts each step on the path the engine
would (:meth:`StepCostModel.path_of`). A path the recording has too few steps of borrows the
other's fit, and the prediction says so.

Between two back-to-back steps the engine also spends a gap (its outputs sent, the next loop
turn): the recording's mean gap is added to every modelled step.

The fit drops steps further than 4 robust sigmas from a first fit (a warm-up compile, a host
hiccup) and is scored on a held-out fifth of the steps: the median and 90th-percentile absolute
error, by step kind (compiled decode-only, eager decode-only, with prefill). Each term's coefficient comes with a bootstrap
95% interval. A kind with fewer than :data:`MIN_STEPS` recorded steps is not supported: a
prediction that needs it says so.

On a CPU the forward's threads are recorded per step (``cpu_threads``). The fit uses the steps
at the recording's usual count; steps the thread governor ran on fewer cores (a neighbour took
some) price a replica given fewer threads (data-parallel replicas share the cores): the median
of their forward time over the fit's. Without such steps the forward is scaled by the ratio of
the counts, an assumption the prediction names.

**The host's load** is a term of its own. The census beside every store (``device_samples``:
``cpu_others_pct``, the CPU every process outside the server used, and ``loadgen_cpu_pct``, the
load generator's part of it) is read at each step, and the steps' time over the model's is
fitted as a line in the others' share (:meth:`StepCostModel.load_factor`). A load generator on
the engine's host takes CPU in proportion to the traffic it sends, so a plan for twice the
traffic prices its steps with the generator's share doubled; a plan for a dedicated host prices
them with no other process at all (``plan/predict.py``). The line is fitted over the host
samples (one point each, the mean of the steps it prices, weighted by their count), and priced
only where its bootstrap 95% interval over the samples stays above zero. Where the others'
share barely moved in the recording (its 10th to 90th percentile within
:data:`MIN_LOAD_SPREAD`), or the interval reaches zero, no slope is priced and the steps keep
the recording's pace; the plan says why.

A host's pace drifts: a shared machine runs the same steps some tens of percent slower or faster
from one hour to the next. :meth:`StepCostModel.pace` measures it on any store of the same
engine (another run, a later stretch of the recording): its steps' time over the model's time
for the same steps. :meth:`StepCostModel.scaled` prices a host at another pace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import duckdb
import numpy as np
from scipy.optimize import nnls

from tokenmill.telemetry.recorded_config import RecordedConfig

#: the model's terms, in the order of a feature row
TERMS = (
    "step",
    "decode_tokens",
    "prefill_tokens",
    "prefill_chunks",
    "attn_gflop",
    "kv_read_mtok",
)
#: the forward's paths, fitted apart: the compiled decode step (small decode-only batches on a
#: CPU) and the eager module forward (everything else)
PATHS = ("compiled", "eager")
#: steps of a kind (decode-only, with prefill) a store needs before its predictions lean on it
MIN_STEPS = 20
#: bootstrap resamples for the coefficients' intervals
BOOTSTRAP = 200
#: decode batch sizes the held-out residuals are reported by (inclusive ranges)
BATCH_BUCKETS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 1 << 20))
#: residuals beyond this many robust sigmas are dropped before the final fit
OUTLIER_SIGMAS = 4.0
#: the spread of the others' CPU share (10th to 90th percentile over the steps, 0..1 of all
#: CPUs) below which the host-load slope is not fitted
MIN_LOAD_SPREAD = 0.05
#: bootstrap resamples (of host samples) for the host-load slope's interval
LOAD_BOOTSTRAP = 200
#: a host sample prices the steps that started up to this long before it (ns): each sample's
#: CPU shares are measured since the sample before, a second apart
HOST_SAMPLE_REACH_NS = 2_000_000_000

_HOST_SQL = """
SELECT time_ns, cpu_others_pct, coalesce(loadgen_cpu_pct, 0.0)
FROM device_samples WHERE kind = 'host' AND cpu_others_pct IS NOT NULL ORDER BY time_ns
"""

_STEPS_SQL = """
SELECT start_ns, end_ns, forward_ms, num_decode_tokens, num_prefill_tokens, num_sampled,
    kv_read_bytes, flops, num_prefill_chunks, coalesce(cpu_threads, 0), num_running,
    num_waiting, coalesce(compiled, false)::INT, replica
FROM engine_steps
WHERE num_prefill_tokens + num_decode_tokens > 0 AND start_ns >= $since AND start_ns < $until
ORDER BY coalesce(replica, 0), start_ns
"""


def _gaps(a: np.ndarray, replica: list) -> np.ndarray:
    """The gaps (ms) between back-to-back steps of one store: the engine had work left after
    the step, on the same replica."""
    if len(a) < 2:
        return np.zeros(0)
    same = np.array([replica[i] == replica[i + 1] for i in range(len(a) - 1)], dtype=bool)
    busy = (a[:-1, 10] + a[:-1, 11] > 0) & same
    gaps = (a[1:, 0] - a[:-1, 1])[busy] / 1e6
    return gaps[(gaps >= 0) & (gaps < 1000)]


def _read_steps(con, since_ns: int | None, until_ns: int | None) -> tuple[np.ndarray, list]:
    """A store's working steps started in ``[since_ns, until_ns)``: the numeric columns of
    :data:`_STEPS_SQL` as an array, and each step's replica."""
    rows = con.execute(
        _STEPS_SQL,
        {
            "since": since_ns if since_ns is not None else -(1 << 62),
            "until": until_ns if until_ns is not None else 1 << 62,
        },
    ).fetchall()
    return np.array([r[:13] for r in rows], dtype=float).reshape(-1, 13), [r[13] for r in rows]


def _host_load(con, starts: np.ndarray) -> np.ndarray:
    """Per step start, the others' and the load generator's share of all CPUs (0..1) from the
    first host sample at or after it (its shares cover the second before it): ``[n, 2]``, NaN
    where no sample is near (a store without host samples)."""
    out = np.full((len(starts), 2), np.nan)
    try:
        rows = con.execute(_HOST_SQL).fetchall()
    except duckdb.Error:  # a store without the table or its census columns
        return out
    if not rows or not len(starts):
        return out
    h = np.array(rows, dtype=float)
    i = np.searchsorted(h[:, 0], starts, side="left")
    ok = i < len(h)
    ok[ok] &= h[i[ok], 0] - starts[ok] <= HOST_SAMPLE_REACH_NS
    out[ok] = h[i[ok], 1:] / 100.0
    return out


def _fit_host_load(
    wall: np.ndarray, pred: np.ndarray, load: np.ndarray, use: np.ndarray, recorded: int
) -> dict:
    """The host-load term (see the module docstring) from the steps ``use`` marks: the
    recording's mean others' and load-generator shares (its first ``recorded`` steps), and the
    line ``wall / model = intercept + slope * others`` where the shares spread enough."""
    others = load[:, 0]
    ok = use & np.isfinite(others) & (pred > 0)
    rec = ok.copy()
    rec[recorded:] = False
    out: dict = {"steps": int(ok.sum()), "slope": None}
    if not rec.any():
        out["why_none"] = "the recording has no host samples (no census of the others' CPU)"
        return out
    out["others_pct"] = float(others[rec].mean() * 100)
    out["loadgen_pct"] = float(load[rec, 1].mean() * 100)
    lo, hi = np.percentile(others[ok], [10, 90])
    out["others_range_pct"] = [float(lo * 100), float(hi * 100)]
    if ok.sum() < 2 * MIN_STEPS or hi - lo < MIN_LOAD_SPREAD:
        out["why_none"] = (
            f"the others' CPU ran {lo * 100:.0f}-{hi * 100:.0f}% of the host in the steps "
            "(10th-90th percentile), too narrow to measure what it costs a step"
        )
        return out
    ratio = wall[ok] / pred[ok]
    near = _within_sigmas(ratio - np.median(ratio), ratio)
    # one point per host sample (the steps it prices share its shares): the line and its
    # bootstrap interval over the samples, each weighted by its steps
    x, inverse = np.unique(others[ok][near], return_inverse=True)
    n = np.bincount(inverse).astype(float)
    y = np.bincount(inverse, weights=ratio[near]) / n
    slope, intercept = np.polyfit(x, y, 1, w=np.sqrt(n))
    if slope <= 0 or intercept <= 0:
        out["why_none"] = "the steps ran no slower where the others took more CPU"
        return out
    rng = np.random.default_rng(0)
    slopes = []
    for pick in rng.integers(0, len(x), (LOAD_BOOTSTRAP, len(x))):
        if np.ptp(x[pick]) > 0:
            slopes.append(np.polyfit(x[pick], y[pick], 1, w=np.sqrt(n[pick]))[0])
    low, high = np.percentile(slopes, [2.5, 97.5]) if slopes else (0.0, 0.0)
    out["slope_ci95"] = [float(low), float(high)]
    if low <= 0:
        out["why_none"] = (
            f"the steps' slowdown with the others' CPU is within noise (x{1 + slope / intercept * 0.1:.3f} "
            f"per 10 points, its 95% interval over {len(x)} host samples reaching zero)"
        )
        return out
    out["slope"], out["intercept"] = float(slope), float(intercept)
    return out


class StepCostError(ValueError):
    """The store cannot support a step-cost model (one line: what is missing)."""


@dataclass(frozen=True)
class ModelShape:
    """What turns a step's chunks into the model's terms: the model's parameter counts (for
    the attention FLOPs) and the KV bytes of one token (for the KV read)."""

    linear_params: int
    lm_head_params: int
    attn_flop_per_pair: int
    layers: int
    kv_bytes_per_token: int


def model_shape(cfg: RecordedConfig) -> ModelShape:
    """The shape of the recorded engine's model (its ``config`` event names the folder; the
    default model where it names none).

    Raises:
        StepCostError: the model's ``config.json`` cannot be read here.
    """
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.roofline import ModelCost

    folder = cfg.model
    if not folder:
        from tokenmill.engine.model_fetch import default_model_dir

        folder = str(default_model_dir())
    try:
        mc = load_model_config(folder)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StepCostError(
            f"the recorded model {folder} cannot be read here ({first}); the step-cost model "
            "needs its config.json"
        ) from None
    cost = ModelCost.from_config(mc)
    kv_token = int(cfg.kv_bytes_per_token or cost.kv_bytes_per_token)
    return ModelShape(
        linear_params=cost.linear_params,
        lm_head_params=cost.lm_head_params,
        attn_flop_per_pair=4 * cost.num_heads * cost.head_dim,
        layers=cost.num_layers,
        kv_bytes_per_token=kv_token,
    )


def features(
    shape: ModelShape, decode, prefill, sampled, kv_read_bytes, flops, chunks
) -> np.ndarray:
    """Feature rows ``[n, len(TERMS)]`` from per-step counts (arrays or scalars)."""
    decode = np.asarray(decode, dtype=float)
    prefill = np.asarray(prefill, dtype=float)
    linear = 2.0 * shape.linear_params * (decode + prefill)
    head = 2.0 * shape.lm_head_params * np.asarray(sampled, dtype=float)
    attn = np.maximum(np.asarray(flops, dtype=float) - linear - head, 0.0) / 1e9
    kv = np.asarray(kv_read_bytes, dtype=float) / shape.kv_bytes_per_token / 1e6
    chunks = np.asarray(chunks, dtype=float)
    cols = np.broadcast_arrays(np.ones_like(decode), decode, prefill, chunks, attn, kv)
    return np.stack(cols, axis=-1)


@dataclass
class Fit:
    """One part's coefficients (ms per unit of each term) and their bootstrap intervals."""

    coef: np.ndarray
    low: np.ndarray
    high: np.ndarray


@dataclass
class PathFit:
    """The fit of one forward path: its forward and host parts."""

    forward: Fit
    host: Fit

    def ms(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return (x @ self.forward.coef) * scale + x @ self.host.coef


@dataclass
class StepCostModel:
    """The fitted model: each forward path's fit, the gap between steps, how well it predicts
    held-out steps, and what the store supports.

    Attributes:
        shape: the model's shape (terms from chunks).
        paths: per forward path (:data:`PATHS`) that ran in the recording, its fit.
        native_rows: decode-only steps of at most this many rows ran the compiled step (None:
            the recording has no compiled steps: GPU, ``--enforce-eager``).
        gap_ms: the recorded mean gap between back-to-back steps.
        threads: the forward's CPU threads in the recording (median; 0 on a GPU).
        holdout: per step kind (:data:`KINDS` and ``all``): held-out steps, median and p90
            absolute error (%).
        steps: per kind, recorded steps the fit used.
        ranges: the largest decode batch and prefill tokens a recorded step had.
    """

    shape: ModelShape
    paths: dict[str, PathFit]
    native_rows: int | None
    gap_ms: float
    threads: int
    holdout: dict
    steps: dict
    ranges: dict
    dropped: int = 0
    thread_factors: dict = field(default_factory=dict)
    """per other thread count the recording ran steps at: ``factor`` (its forward time over the
    fit's, median) and ``steps``"""
    #: of the steps the fit used, those from a profile (``plan/profile.py``)
    profile_steps: int = 0
    residuals_by_batch: dict = field(default_factory=dict)
    """held-out decode-only steps by batch size (:data:`BATCH_BUCKETS`): ``steps`` and the
    median signed error (%, positive: the model runs high)"""
    host_load: dict = field(default_factory=dict)
    """the host-load term (:func:`_fit_host_load`): the recording's ``others_pct`` and
    ``loadgen_pct``, and ``slope``/``intercept`` (None with ``why_none`` where not fitted)"""
    upstream: dict = field(default_factory=dict)
    """another engine's costs fitted on a proxy's requests (:mod:`.upstream`): its limits and
    where each came from; empty for a model fitted on our engine's steps"""

    def load_factor(self, others: float) -> float:
        """A step's time with the others taking ``others`` of all CPUs (0..1) over its time
        at the recording's mean share: 1.0 where no slope was fitted."""
        h = self.host_load
        if not h.get("slope"):
            return 1.0
        at = h["intercept"] + h["slope"] * max(others, 0.0)
        return at / (h["intercept"] + h["slope"] * h["others_pct"] / 100)

    def path_of(self, decode_only: bool, rows: int) -> str:
        """The path the engine runs a step on: the compiled step for a decode-only step of at
        most :attr:`native_rows` rows where the recording had it, else eager."""
        if self.native_rows and decode_only and rows <= self.native_rows:
            return "compiled"
        return "eager"

    def step_ms(self, x: np.ndarray, threads: int | None = None, path: str = "eager") -> np.ndarray:
        """Modelled wall time (ms) of steps with feature rows ``x`` on ``path`` (the other
        path's fit where the recording had too few of its steps), gap included; the forward
        scaled by ``self.threads / threads`` when a replica has fewer threads."""
        fit = self.paths.get(path) or next(iter(self.paths.values()))
        return fit.ms(x, self.thread_scale(threads)[0]) + self.gap_ms

    def thread_scale(self, threads: int | None) -> tuple[float, str]:
        """The forward's time factor on ``threads`` CPU threads instead of the recording's, and
        where it comes from: measured on the recording's own steps at that count, else the
        ratio of the counts (assumed)."""
        if not threads or not self.threads or threads == self.threads:
            return 1.0, "as recorded"
        seen = self.thread_factors.get(threads)
        if seen:
            return seen["factor"], f"measured on {seen['steps']} recorded steps at {threads}"
        return self.threads / threads, "assumed from the thread counts"

    def thin_kinds(self) -> dict[str, int]:
        """Step kinds (``compiled_decode``, ``eager_decode``, ``with_prefill``) the recording
        has fewer than :data:`MIN_STEPS` of, with their count."""
        return {
            kind: n
            for kind, n in self.steps.items()
            if kind != "all" and n < MIN_STEPS and (kind != "compiled_decode" or self.native_rows)
        }

    def unsupported(self) -> list[str]:
        """:meth:`thin_kinds` as phrases."""
        return [
            f"{kind.replace('_', ' ')} steps ({n} recorded, {MIN_STEPS} needed)"
            for kind, n in self.thin_kinds().items()
        ]

    def modelled_ms(self, a: np.ndarray) -> np.ndarray:
        """Modelled wall time (ms, gap left out) of recorded steps (rows of
        :func:`_read_steps`), each on its path at its thread count."""
        x = features(self.shape, a[:, 3], a[:, 4], a[:, 5], a[:, 6], a[:, 7], a[:, 8])
        out = np.empty(len(a))
        paths = np.where(a[:, 12] > 0, "compiled", "eager")
        threads = a[:, 9].astype(int)
        for path in ("compiled", "eager"):
            for t in np.unique(threads[paths == path]):
                on = (paths == path) & (threads == t)
                out[on] = self.step_ms(x[on], threads=int(t) or None, path=path) - self.gap_ms
        return out

    def pace(self, con, *, since_ns: int | None = None, until_ns: int | None = None) -> dict:
        """How fast a store's host ran against this model: the store's working steps started in
        ``[since_ns, until_ns)``, their summed wall time over the model's for the same steps
        (each on its path and thread count; the gap between steps left out), so 1.2 is a host
        that took 20% longer. Steps beyond :data:`OUTLIER_SIGMAS` robust sigmas of the median
        ratio (a compile, a hiccup) are left out, and so are steps without a positive duration.
        ``{"factor": ..., "steps": ...}``; the factor is None when no step is left."""
        a, _ = _read_steps(con, since_ns, until_ns)
        if not len(a):
            return {"factor": None, "steps": 0}
        wall = (a[:, 1] - a[:, 0]) / 1e6
        a, wall = a[wall > 0], wall[wall > 0]  # a step without a duration says nothing
        if not len(a):
            return {"factor": None, "steps": 0}
        model = np.maximum(self.modelled_ms(a), 1e-6)
        ratio = wall / model
        keep = _within_sigmas(ratio - np.median(ratio), ratio)
        return {"factor": float(wall[keep].sum() / model[keep].sum()), "steps": int(keep.sum())}

    def scaled(self, factor: float) -> StepCostModel:
        """This model on a host that takes ``factor`` times as long for every engine step
        (forward, host share and the gap between steps; a thread count's factor is a ratio and
        stays; the API's time around the engine is the workload's, not the model's)."""

        def times(f: Fit) -> Fit:
            return Fit(f.coef * factor, f.low * factor, f.high * factor)

        # the fit's bookkeeping (holdout, steps, ranges, thread factors) is shared: read only
        return dataclasses.replace(
            self,
            paths={n: PathFit(times(p.forward), times(p.host)) for n, p in self.paths.items()},
            gap_ms=self.gap_ms * factor,
        )

    def to_dict(self) -> dict:
        def part(f: Fit) -> dict:
            return {
                t: {"ms": float(c), "ci95": [float(lo), float(hi)]}
                for t, c, lo, hi in zip(TERMS, f.coef, f.low, f.high, strict=True)
            }

        return {
            "terms": list(TERMS),
            "paths": {
                name: {"forward": part(f.forward), "host": part(f.host)}
                for name, f in self.paths.items()
            },
            "native_rows": self.native_rows,
            "gap_ms": self.gap_ms,
            "threads": self.threads,
            "thread_factors": self.thread_factors,
            "holdout": self.holdout,
            "residuals_by_batch": self.residuals_by_batch,
            "profile_steps": self.profile_steps,
            "host_load": self.host_load,
            "upstream": self.upstream,
            "steps": self.steps,
            "ranges": self.ranges,
            "outliers_dropped": self.dropped,
            "unsupported": self.unsupported(),
        }


def _fit(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> Fit:
    coef, _ = nnls(x, y)
    boots = []
    n = len(y)
    for _ in range(BOOTSTRAP):
        i = rng.integers(0, n, n)
        boots.append(nnls(x[i], y[i])[0])
    b = np.array(boots)
    return Fit(coef, np.percentile(b, 2.5, axis=0), np.percentile(b, 97.5, axis=0))


def _abs_err(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.abs(pred - y) / np.maximum(y, 1e-6) * 100.0


def _within_sigmas(deviations: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """Which ``deviations`` are within :data:`OUTLIER_SIGMAS` robust sigmas (1.4826 median
    absolute deviations of ``sample`` from its median)."""
    sigma = 1.4826 * np.median(np.abs(sample - np.median(sample))) or 1e-6
    return np.abs(deviations) <= OUTLIER_SIGMAS * sigma + 1e-9


def _inliers(x: np.ndarray, y: np.ndarray, use: np.ndarray) -> np.ndarray:
    """Steps within :data:`OUTLIER_SIGMAS` robust sigmas of a first fit over ``use``."""
    first, _ = nnls(x[use], y[use])
    resid = y - x @ first
    return _within_sigmas(resid, resid[use])


def fit_step_cost(
    con,
    cfg: RecordedConfig,
    *,
    seed: int = 0,
    shape: ModelShape | None = None,
    until_ns: int | None = None,
    extra: tuple = (),
) -> StepCostModel:
    """Fit the model on a store's working steps (those started before ``until_ns``), and every
    working step of the stores ``extra`` (a profile of the same engine: ``plan/profile.py``).

    Raises:
        StepCostError: no working steps, or too few to fit (one line).
    """
    a, replica = _read_steps(con, None, until_ns)
    recorded_steps = len(a)
    gaps = [_gaps(a, replica)]
    load = [_host_load(con, a[:, 0])]
    for other in extra:
        b, other_replica = _read_steps(other, None, None)
        gaps.append(_gaps(b, other_replica))
        load.append(_host_load(other, b[:, 0]))
        a, replica = np.vstack([a, b]), [*replica, *other_replica]
    if not len(a):
        raise StepCostError(
            "the store holds no engine steps: a what-if needs a recording of tokenmill's own "
            "engine (a proxied or collected store has no step records)"
        )
    if len(a) < 2 * MIN_STEPS:
        raise StepCostError(f"the store holds {len(a)} engine steps; fitting needs {2 * MIN_STEPS}")
    shape = shape or model_shape(cfg)
    start, end, fwd = a[:, 0], a[:, 1], a[:, 2]
    wall = (end - start) / 1e6
    host = np.maximum(wall - fwd, 0.0)
    x = features(shape, a[:, 3], a[:, 4], a[:, 5], a[:, 6], a[:, 7], a[:, 8])
    compiled = a[:, 12] > 0
    gaps = np.concatenate(gaps)
    gap_ms = float(np.mean(gaps)) if len(gaps) else 0.0
    threads = a[:, 9]
    positive = threads[threads > 0]
    main = int(np.bincount(positive.astype(int)).argmax()) if len(positive) else 0
    # steps the thread governor ran on fewer cores (a neighbour took some) are set apart: they
    # price a replica given fewer threads
    at_main = (threads == main) | (threads == 0)
    rng = np.random.default_rng(seed)
    held = np.zeros(len(a), dtype=bool)  # a fifth held out for the error; the rest to fit
    held[rng.permutation(len(a))[: max(len(a) // 5, 1)]] = True
    keep = np.zeros(len(a), dtype=bool)
    paths: dict[str, PathFit] = {}
    for name, on in zip(PATHS, (compiled & at_main, ~compiled & at_main), strict=True):
        use = on & ~held
        if use.sum() < MIN_STEPS:
            continue
        keep |= on & _inliers(x, wall, use)
        train = keep & on & ~held
        paths[name] = PathFit(_fit(x[train], fwd[train], rng), _fit(x[train], host[train], rng))
    if not paths:
        raise StepCostError(f"the store holds {len(a)} engine steps, too few of either kind")
    model = StepCostModel(
        shape=shape,
        paths=paths,
        native_rows=int(a[compiled, 3].max()) if compiled.any() else None,
        gap_ms=gap_ms,
        threads=main,
        holdout={},
        steps={},
        ranges={},
        dropped=int((~keep & at_main).sum()),
    )
    for t in sorted(set(positive.astype(int)) - {main}):
        on = threads == t
        if on.sum() < MIN_STEPS // 2:
            continue
        fallback = next(iter(paths.values()))
        pred_fwd = np.array(
            [
                x[i] @ paths.get("compiled" if compiled[i] else "eager", fallback).forward.coef
                for i in np.flatnonzero(on)
            ]
        )
        ratio = fwd[on] / np.maximum(pred_fwd, 1e-6)
        model.thread_factors[int(t)] = {"factor": float(np.median(ratio)), "steps": int(on.sum())}
    if model.native_rows and cfg.engine_device == "cpu":
        # the engine's own cut-over, which a quiet recording may not have reached
        from tokenmill.kernels.cutover import FASTER_ROWS as MAX_NATIVE_ROWS

        model.native_rows = max(model.native_rows, MAX_NATIVE_ROWS)
    decode_only = a[:, 4] == 0
    pred = model.modelled_ms(a)  # the held-out steps below all ran at the usual thread count
    kinds = {
        "compiled_decode": decode_only & compiled,
        "eager_decode": decode_only & ~compiled,
        "with_prefill": ~decode_only,
    }
    test = held & keep
    for kind, m in (*kinds.items(), ("all", np.ones(len(a), dtype=bool))):
        e = _abs_err(pred[test & m], wall[test & m])
        model.holdout[kind] = {
            "steps": len(e),
            "median_abs_err_pct": float(np.median(e)) if len(e) else None,
            "p90_abs_err_pct": float(np.percentile(e, 90)) if len(e) else None,
        }
    # the signed error by decode batch size: where the model runs high or low
    rows = a[:, 3]
    for lo, hi in BATCH_BUCKETS:
        m = test & decode_only & (rows >= lo) & (rows <= hi)
        if m.any():
            r = (pred[m] - wall[m]) / np.maximum(wall[m], 1e-6) * 100
            model.residuals_by_batch[f"{lo}-{hi}" if hi < 1 << 20 else f"{lo}+"] = {
                "steps": int(m.sum()),
                "median_err_pct": float(np.median(r)),
            }
    model.host_load = _fit_host_load(
        wall, np.maximum(pred, 1e-6), np.vstack(load), keep & at_main & ~held, recorded_steps
    )
    model.steps = {kind: int((keep & m).sum()) for kind, m in kinds.items()}
    model.steps["all"] = int(keep.sum())
    model.profile_steps = int(keep[recorded_steps:].sum())
    model.ranges = {
        "max_decode_batch": int(a[decode_only, 3].max()) if decode_only.any() else 0,
        "max_eager_decode_batch": int(a[decode_only & ~compiled, 3].max())
        if (decode_only & ~compiled).any()
        else 0,
        "max_prefill_tokens": int(a[:, 4].max()),
    }
    return model


__all__ = [
    "MIN_STEPS",
    "PATHS",
    "TERMS",
    "Fit",
    "ModelShape",
    "PathFit",
    "StepCostError",
    "StepCostModel",
    "features",
    "fit_step_cost",
    "model_shape",
]
