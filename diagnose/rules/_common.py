"""What every rule module shares: :class:`Param`, :class:`Evidence`, :class:`Rule` and the
small helpers detectors use (ratios, window times, severity, confidence, example filters).

Thresholds are ratios to the dump's own healthy baseline (its best windows) or shares within
one window, never absolute milliseconds: the same rule must hold on a 2-core CPU and on an H200.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..signals import Signals, Window
from ..stats import Support


@dataclass(frozen=True)
class Param:
    """A named threshold: its default and where the number comes from."""

    default: float
    source: str


@dataclass
class Evidence:
    """What a rule saw: a one-line statement, the numbers, the window, example traces."""

    summary: str
    numbers: dict
    window: tuple[int, int] | None
    example_where: str | None = None
    example_params: list = field(default_factory=list)
    severity: str = "warning"  # warning | critical
    confidence: float = 0.7
    # when the data singles out a cause: the rule's causes in this order and this knob instead
    causes: tuple[str, ...] | None = None
    knob: str | None = None
    # the test it passed (diagnose/stats.py): sample sizes, effect with its bootstrap interval,
    # persistence; an inconclusive support lists the finding apart, never as a finding
    support: Support | None = None


@dataclass
class Hint:
    """A suggestion, not a problem: something the dump shows could be faster with a knob
    (a note in the report; it never counts toward ``--fail-on`` or the report's status)."""

    summary: str
    numbers: dict
    knob: str


@dataclass(frozen=True)
class Alert:
    """How a rule reads as a Prometheus alerting rule over the ``tokenmill_`` metrics, for the
    rules ``/metrics`` can express (``tokenmill export prometheus-rules``,
    ``diagnose/alerts.py``).

    ``expr`` is PromQL with ``$name`` placeholders (:class:`string.Template`): the rule's own
    ``params`` (their defaults, so the alert and the diagnoser share one threshold), ``$by``
    (the labels every series is aggregated by; ``$by_le`` with ``le``), ``$window`` (the rate window) and the shared
    recorded series of :data:`tokenmill.diagnose.alerts.SERIES` (``$ttft_p99``,
    ``$ttft_p99_base``, ...); a rule with a ``min_windows`` param (a trend over that many
    consecutive windows) also gets ``$run`` (that many windows) and ``$run_offset`` (the offset
    of the run's first window). The expression's value (its first operand) is what ``value``
    names, shown as a ratio (``unit="x"``) or a percentage (``unit="%"``, from a 0..1 share).
    """

    name: str
    expr: str
    value: str
    unit: str = "x"  # x | %
    for_: str = "2m"
    severity: str = "warning"


@dataclass(frozen=True)
class Rule:
    """One diagnosis rule: its text, named thresholds, detector, the rules it explains and the
    signals the console shows for it. Its runbook is ``runbooks/<id>.md``."""

    id: str
    title: str
    symptom: str
    causes: tuple[str, ...]
    checks: tuple[str, ...]
    knob: str
    params: dict[str, Param]
    detect: Callable[[Signals, dict], Evidence | None]
    # more general rules this one explains when both fire (they are ranked after it)
    explains: tuple[str, ...] = ()
    # rules this one explains only when the other finding's evidence (its ``values`` dict)
    # passes the test, e.g. an error spike made of the queue's own refusals under overload
    explains_when: dict[str, Callable[[dict], bool]] = field(default_factory=dict)
    # per-window signals (``Window.values`` keys) the console charts as this rule's evidence
    evidence_signals: tuple[str, ...] = ()
    # the rule's companion note: when the rule does not fire, what the data says would help
    # instead (reads the same ``params``); None for rules without one
    hint: Callable[[Signals, dict], Hint | None] | None = None
    # the rule as a Prometheus alert over /metrics; None where the metrics cannot express it
    # (it reads per-request or per-step rows only the trace store has)
    alert: Alert | None = None
    # what the rule stands on when the dump has no healthy baseline (Signals.healthy_baseline):
    # "needs" (its thresholds are ratios to the healthiest windows: not judged without them),
    # "absolute" (never reads them: shares within a window, trends within the dump, absolute
    # markers) or "either" (ratios when there is a baseline, its absolute evidence when not);
    # None counts as "needs". runbooks/README.md lists each rule's.
    healthy_baseline: str | None = None
    # the test behind a finding when the detector states none (findings.request_support): the
    # requests column whose values in the finding's example requests are compared with those of
    # the dump's healthy windows (``test_effect``: the lower end of the 95% interval of the
    # ratio of medians it needs), or ``own_test``: why the rule's own thresholds are the test
    # (a count of spikes, a share of steps, a structural fact); neither: the example requests
    # are counted (two needed)
    test_metric: str | None = None
    test_effect: float = 1.5
    own_test: str | None = None
    # the signal families (``tokenmill.diagnose.signals.FAMILIES``) whose keys the rule reads:
    # per-window values, overall values, the baseline, the Signals attributes a family makes
    # (tests/diagnose/test_signal_families.py finds them in the source and holds the two equal)
    reads: tuple[str, ...] = ()
    # the columns the rule's own queries read (table -> columns; its example filter and
    # test_metric included) beyond those of the families it reads
    needs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the live loop's consecutive periods the rule must hold in before its finding opens, where
    # one period cannot show its claim (a period claimed from spikes needs more than one range
    # of them); None: the loop's own ``open_after`` (diagnose/live.py)
    live_open_after: int | None = None

    @property
    def runbook(self) -> str:
        return f"runbooks/{self.id}.md"


# ----- helpers -----


def _ratio(a, b) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%H:%M:%S")


def _when(w: Window) -> str:
    return f"{_clock(w.start_ns)}–{_clock(w.end_ns)} UTC"


def _ms(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _worst(sig: Signals, key: str, pred: Callable[[Window], bool] | None = None) -> Window | None:
    cands = [w for w in sig.busy() if w.get(key) is not None and (pred is None or pred(w))]
    return max(cands, key=lambda w: w.get(key), default=None)


def _varies(windows: list[Window], key: str) -> bool:
    """Whether ``key`` takes more than one value over ``windows`` (missing values ignored). A
    signal that is constant (typically 0 everywhere: nothing measured it) cannot support a
    finding about how it changed."""
    return len({w.get(key) for w in windows if w.get(key) is not None}) > 1


def _severity(ratio: float | None, threshold: float) -> str:
    return "critical" if ratio is not None and ratio >= 2 * threshold else "warning"


def _confidence(*margins: float | None) -> float:
    """0.5 at the thresholds, rising toward 0.95 as every margin (value/threshold) grows."""
    ms = [m for m in margins if m is not None]
    if not ms:
        return 0.5
    m = min(ms)
    return round(min(0.95, 0.5 + 0.45 * (1 - 1 / max(m, 1.0))), 2)


def _in_window(w: Window) -> tuple[str, list]:
    return "arrival_ns >= ? AND arrival_ns < ?", [w.start_ns, w.end_ns]


def _window_evidence(
    summary: str,
    numbers: dict,
    w: Window,
    and_where: str,
    ratio: float,
    threshold: float,
    *margins: float | None,
    example_params: tuple = (),
    **more,
) -> Evidence:
    """Evidence of ``ratio`` past its ``threshold`` in window ``w``: the window's requests (by
    arrival) that also match ``and_where`` as the examples (``example_params`` fill its ``?``),
    critical from twice the threshold, as confident as ``ratio / threshold`` and the other
    ``margins`` allow; ``more``: Evidence's other fields (``support``, ``causes``, ``knob``)."""
    where, params = _in_window(w)
    return Evidence(
        summary,
        numbers,
        (w.start_ns, w.end_ns),
        where + and_where,
        [*params, *example_params],
        _severity(ratio, threshold),
        _confidence(ratio / threshold, *margins),
        **more,
    )


# the source most thresholds name: a ratio to the dump's healthy windows
_BASE = "ratio to the dump's healthiest windows (its 25th-percentile window)"

# Rule.healthy_baseline values
NEEDS_BASELINE, ABSOLUTE, EITHER = "needs", "absolute", "either"
BASELINE_NEEDS = (NEEDS_BASELINE, ABSOLUTE, EITHER)


def baseline_need(rule: Rule) -> str:
    """A rule's :attr:`Rule.healthy_baseline`, ``"needs"`` when it declares none."""
    return rule.healthy_baseline or NEEDS_BASELINE
