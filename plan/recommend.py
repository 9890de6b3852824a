"""What to change to meet an SLO at a target rate: the smallest number of replicas like the
recorded engine (``hosts``: each with the recorded machine to itself), and the best knob setting
of a small grid on one, each with its predicted margin (how far inside the tightest bound it
stays: ``1 - value / bound``)."""

from __future__ import annotations

from .predict import Prediction, Recording, predict
from .step_cost import StepCostModel
from .whatif import SloBounds, WhatIf

#: the knob grid searched at the recorded replica count
GRID = {
    "max_num_seqs": (4, 8, 16, 32, 64),
    "max_num_batched_tokens": (256, 512, 1024, 2048),
    "chunked_prefill": (True, False),
}
#: replica counts tried at most
MAX_REPLICAS = 64
#: goodput below this share of its best marks the knee of a goodput-vs-rate curve
KNEE_SHARE = 0.9


def knee(rates: list[float], goodput: list[float]) -> float | None:
    """The highest rate (ascending ``rates``) before goodput first falls below
    :data:`KNEE_SHARE` of its best; None when it never does or is never above 0."""
    best = max(goodput, default=0)
    if not best:
        return None
    last = None
    for rate, good in zip(rates, goodput, strict=True):
        if good < KNEE_SHARE * best:
            return last
        last = rate
    return None


def _whatif(rate: float, **changes) -> WhatIf:
    parts = [f"rate={rate:g}"] if rate != 1 else []
    for k, v in changes.items():
        parts.append(f"{k}={'on' if v is True else 'off' if v is False else v}")
    return WhatIf(",".join(parts), ({"rate": rate} if rate != 1 else {}) | changes)


def recommend(
    rec: Recording,
    slo: SloBounds,
    *,
    rate: float = 1.0,
    cost_models: dict[str, StepCostModel] | None = None,
) -> dict:
    """The smallest replica count meeting ``slo`` at ``rate`` times the recorded rate (None
    past :data:`MAX_REPLICAS`), the grid's settings that meet it at one replica best first,
    and the recording's own knobs' verdict at that rate."""

    def run(w: WhatIf) -> Prediction:
        return predict(rec, w, slo, cost_models=cost_models, with_band=False)

    base = run(_whatif(rate))
    replicas = None
    tried: dict[int, Prediction] = {1: base}
    n = 1
    while n <= MAX_REPLICAS:
        p = tried.get(n) or run(_whatif(rate, hosts=n))
        tried[n] = p
        if not p.slo_misses:
            break
        n *= 2
    if n <= MAX_REPLICAS and n > 1:  # the smallest between the last miss and the first hit
        lo, hi = n // 2, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = tried.get(mid) or run(_whatif(rate, hosts=mid))
            tried[mid] = p
            if p.slo_misses:
                lo = mid
            else:
                hi = mid
        n = hi
    if n <= MAX_REPLICAS:
        replicas = tried[n]
    meeting = []
    for seqs in GRID["max_num_seqs"]:
        for budget in GRID["max_num_batched_tokens"]:
            for chunked in GRID["chunked_prefill"]:
                w = _whatif(
                    rate, max_num_seqs=seqs, max_num_batched_tokens=budget, chunked_prefill=chunked
                )
                p = run(w)
                if not p.slo_misses:
                    meeting.append(p)
    meeting.sort(key=lambda p: -(p.slo_margin or 0.0))
    return {
        "rate_factor": rate,
        "as_recorded": base.to_dict(),
        "replicas": replicas.to_dict() | {"count": n} if replicas else None,
        "settings": [p.to_dict() for p in meeting[:5]],
        "settings_tried": len(GRID["max_num_seqs"])
        * len(GRID["max_num_batched_tokens"])
        * len(GRID["chunked_prefill"]),
    }
