"""The test behind a finding: how many requests or steps stand behind it, its effect against a
reference with a bootstrap confidence interval, and whether it persisted.

A rule's detector says *where* it saw the symptom; :class:`Support` says how sure that is:

- ``n``: the requests (or steps) that show the symptom, and ``n_reference`` those it is compared
  with;
- ``effect``: the symptom sample's median over the reference's (a ratio, ``2.5`` = two and a half
  times the reference), or over an absolute bound where the evidence is absolute (a share of
  TTFT, an error rate); ``ci_low``/``ci_high``: a percentile bootstrap 95% interval of that ratio
  (both samples resampled with replacement, :data:`BOOTSTRAP_RESAMPLES` times, seeded, so a
  report is reproducible);
- ``persistence``: windows in which the symptom held, of the busy windows, or ``why_one`` when
  one window is enough (a single stall, a crash).

:func:`judge` turns it into a verdict: ``conclusive`` when at least ``min_n`` requests stand
behind the finding and the interval's lower end clears ``min_effect``; otherwise
``inconclusive`` with the reason (the report lists those apart and never counts them as
findings). :func:`calibrated` maps the interval's lower end and the sample size to the
confidence a finding reports; its constants were chosen on the tuning split of the corpus
(``bench/corpus.py``) and its reliability is reported on the evaluation split
(``benchmarks/diagnosis_accuracy.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CI_LEVEL = 0.95


@dataclass
class Support:
    """The statistics behind one finding (see the module docstring)."""

    n: int
    unit: str  # requests | steps | windows | samples
    reference: str  # what the effect is measured against, in words
    n_reference: int | None = None
    effect: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    persistence: str | None = None  # "3 of 8 busy windows"
    why_one: str | None = None  # why one window (or one event) suffices
    threshold: float | None = None  # the effect the rule needs (1.0 against a bound)
    verdict: str = "conclusive"  # conclusive | inconclusive
    reason: str | None = None  # why inconclusive

    def to_json(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def line(self) -> str:
        """One line an operator reads under the finding."""
        parts = [f"{self.n} {self.unit}"]
        if self.effect is not None:
            ci = (
                f" (95% CI {self.ci_low:.2f}–{self.ci_high:.2f})"
                if self.ci_low is not None and self.ci_high is not None
                else ""
            )
            parts.append(f"effect {self.effect:.2f}x{ci} vs {self.reference}")
        else:
            parts.append(f"vs {self.reference}")
        if self.n_reference is not None:
            parts[-1] += f" ({self.n_reference} {self.unit})"
        if self.persistence:
            parts.append(f"held in {self.persistence}")
        if self.why_one:
            parts.append(self.why_one)
        return "; ".join(parts)


MAX_RESAMPLED = 2000


def _thin(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return a if len(a) <= MAX_RESAMPLED else rng.choice(a, size=MAX_RESAMPLED, replace=False)


def _clean(values) -> np.ndarray:
    a = np.asarray([v for v in values if v is not None], dtype=float)
    return a[np.isfinite(a)]


def median_ratio_ci(
    symptom, reference, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """``(median(symptom) / median(reference), ci_low, ci_high)``: the percentile bootstrap
    interval of the ratio of medians, both samples resampled; ``(None, None, None)`` when a
    sample is empty or the reference's median is not positive."""
    s, r = _clean(symptom), _clean(reference)
    if not len(s) or not len(r) or np.median(r) <= 0:
        return None, None, None
    effect = float(np.median(s) / np.median(r))
    rng = np.random.default_rng(seed)
    # resample from at most MAX_RESAMPLED values of each (a seeded subsample): a store of a
    # million requests would otherwise resample a 2,000 x 1,000,000 array; the interval of a
    # median from thousands of values is already narrow
    s, r = _thin(s, rng), _thin(r, rng)
    sm = np.median(rng.choice(s, size=(resamples, len(s)), replace=True), axis=1)
    rm = np.median(rng.choice(r, size=(resamples, len(r)), replace=True), axis=1)
    ratios = sm / np.where(rm > 0, rm, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        return effect, None, None
    a = (1 - CI_LEVEL) / 2
    return effect, float(np.quantile(ratios, a)), float(np.quantile(ratios, 1 - a))


def median_over_bound_ci(
    symptom, bound: float, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """``median(symptom) / bound`` and its bootstrap interval (the symptom sample resampled):
    the effect of a sample against an absolute bound."""
    s = _clean(symptom)
    if not len(s) or bound <= 0:
        return None, None, None
    rng = np.random.default_rng(seed)
    s = _thin(s, rng)
    sm = np.median(rng.choice(s, size=(resamples, len(s)), replace=True), axis=1) / bound
    a = (1 - CI_LEVEL) / 2
    return (
        float(np.median(s) / bound),
        float(np.quantile(sm, a)),
        float(np.quantile(sm, 1 - a)),
    )


def compare(
    symptom,
    reference,
    *,
    unit: str,
    reference_name: str,
    min_effect: float,
    min_n: int = 2,
    persistence: str | None = None,
    why_one: str | None = None,
) -> Support:
    """A :class:`Support` for a symptom sample against a reference sample, judged: conclusive
    when ``len(symptom) >= min_n`` and the interval's lower end is at least ``min_effect``."""
    s, r = _clean(symptom), _clean(reference)
    effect, lo, hi = median_ratio_ci(s, r)
    sup = Support(
        n=len(s),
        unit=unit,
        reference=reference_name,
        n_reference=len(r),
        effect=effect,
        ci_low=lo,
        ci_high=hi,
        persistence=persistence,
        why_one=why_one,
    )
    return judge(sup, min_n=min_n, min_effect=min_effect)


def against_bound(
    symptom,
    bound: float,
    *,
    unit: str,
    reference_name: str,
    min_n: int = 2,
    persistence: str | None = None,
    why_one: str | None = None,
) -> Support:
    """A :class:`Support` for a symptom sample against an absolute bound (effect 1.0 = at the
    bound), judged: conclusive when ``len(symptom) >= min_n`` and the lower end is above 1."""
    s = _clean(symptom)
    effect, lo, hi = median_over_bound_ci(s, bound)
    sup = Support(
        n=len(s),
        unit=unit,
        reference=reference_name,
        effect=effect,
        ci_low=lo,
        ci_high=hi,
        persistence=persistence,
        why_one=why_one,
    )
    return judge(sup, min_n=min_n, min_effect=1.0)


def judge(sup: Support, *, min_n: int, min_effect: float) -> Support:
    """Set ``verdict`` and ``reason``: too few requests, or an interval that reaches below
    ``min_effect``, make the finding inconclusive."""
    sup.threshold = min_effect
    if sup.n < min_n:
        sup.verdict, sup.reason = "inconclusive", f"{sup.n} {sup.unit} behind it, {min_n} needed"
    elif sup.effect is not None and (sup.ci_low is None or sup.ci_low < min_effect):
        low = "n/a" if sup.ci_low is None else f"{sup.ci_low:.2f}"
        sup.verdict, sup.reason = (
            "inconclusive",
            f"the effect's 95% interval reaches {low}x, below the {min_effect:g}x the rule needs",
        )
    else:
        sup.verdict, sup.reason = "conclusive", None
    return sup


# calibration (chosen on the corpus's tuning split; see benchmarks/RESULTS.md for its
# reliability on the evaluation split): confidence rises with the interval's lower end over the
# rule's threshold and with the evidence's size
CAL_BASE = 0.55
CAL_MARGIN = 0.25
CAL_SIZE = 0.15


def calibrated(sup: Support, rule_confidence: float) -> float:
    """The confidence a conclusive finding reports: the rule's own (its margins) when no
    effect was measured; otherwise ``CAL_BASE`` plus up to ``CAL_MARGIN`` as the interval's
    lower end clears the threshold (saturating at 2x) and up to ``CAL_SIZE`` as the sample
    grows (saturating at 8 requests or steps), capped at 0.95 and never above the rule's own by
    more than 0.1."""
    if sup.verdict != "conclusive":
        return min(rule_confidence, 0.5)
    threshold = sup.threshold or 0.0
    if sup.ci_low is None or threshold <= 0:
        return rule_confidence
    margin = (
        min(1.0, max(0.0, math.log(sup.ci_low / threshold) / math.log(2)))
        if sup.ci_low > 0
        else 0.0
    )
    size = min(1.0, math.log1p(sup.n) / math.log1p(8))
    c = CAL_BASE + CAL_MARGIN * margin + CAL_SIZE * size
    return round(min(0.95, c, rule_confidence + 0.1 if rule_confidence else c), 2)
