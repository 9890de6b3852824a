"""``replica_imbalance``: one data-parallel replica is swamped while another sits idle."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _ms, _when, _window_evidence


def _skew(w: Window) -> float:
    """Requests that arrived at the busiest replica per request at the least busy (a replica
    that got none counts as one)."""
    return (w.get("replica_arrivals_max") or 0) / max(w.get("replica_arrivals_min") or 0, 1)


def _ttft_ratio(w: Window) -> float | None:
    hot, cool = w.get("replica_ttft_p50_hot"), w.get("replica_ttft_p50_cool")
    return hot / cool if hot is not None and cool else None


def detect(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        if (w.get("replicas") or 0) < 2 or (w.get("replica_arrivals_max") or 0) < p["min_requests"]:
            return False
        ttft = _ttft_ratio(w)
        least, most = w.get("replica_running_mean_min") or 0, w.get("replica_running_mean_max") or 0
        # the least busy replica had room: it idled, or ran at most spare_share of what the
        # busiest ran while the busiest's TTFT was ttft_ratio x its own (a replica that
        # serves a few requests is not idle, yet the pinned flood still waits beside it)
        room = least <= p["idle_running"] or (
            least <= p["spare_share"] * most and ttft is not None and ttft >= p["ttft_ratio"]
        )
        return (
            _skew(w) >= p["arrival_skew"]
            and room
            and most >= p["busy_running"]
            and (ttft is None or ttft >= p["ttft_ratio"])
        )

    hits = [w for w in sig.busy() if hit(w)]
    if not hits:
        return None
    w = max(hits, key=_skew)
    skew, ttft = _skew(w), _ttft_ratio(w)
    hot, cool = w.get("replica_hot"), w.get("replica_cool")
    total = (w.get("arrivals") or 0) or (w.get("replica_arrivals_max") or 0)
    ttft_part = (
        f"its TTFT p50 {_ms(w.get('replica_ttft_p50_hot'))} against "
        f"{_ms(w.get('replica_ttft_p50_cool'))} on replica {cool}"
        if ttft is not None
        else f"its TTFT p50 {_ms(w.get('replica_ttft_p50_hot'))} (queue p50 "
        f"{_ms(w.get('replica_queue_p50_hot'))}), replica {cool} serving nothing"
    )
    affinity = sig.config.router_prefix_affinity
    causes = RULE.causes if affinity else (RULE.causes[1], RULE.causes[0], *RULE.causes[2:])
    return _window_evidence(
        f"replica {hot} took {w.get('replica_arrivals_max')} of the {total} requests that "
        f"arrived in {_when(w)} (replica {cool}: {w.get('replica_arrivals_min')}), {ttft_part}, "
        f"while the least busy replica ran {w.get('replica_running_mean_min'):.1f} requests on "
        f"average (the busiest {w.get('replica_running_mean_max'):.1f})",
        {
            "replicas": w.get("replicas"),
            "hot_replica": hot,
            "cool_replica": cool,
            "hot_arrivals": w.get("replica_arrivals_max"),
            "cool_arrivals": w.get("replica_arrivals_min"),
            "arrival_skew": skew,
            "hot_ttft_p50_ms": w.get("replica_ttft_p50_hot"),
            "cool_ttft_p50_ms": w.get("replica_ttft_p50_cool"),
            "hot_queue_p50_ms": w.get("replica_queue_p50_hot"),
            "least_running_mean": w.get("replica_running_mean_min"),
            "most_running_mean": w.get("replica_running_mean_max"),
            "router_prefix_affinity": affinity,
        },
        w,
        " AND replica = ?",
        skew,
        p["arrival_skew"],
        None if ttft is None else ttft / p["ttft_ratio"],
        example_params=(hot,),
        causes=causes,
    )


RULE = Rule(
    id="replica_imbalance",
    own_test="arrivals and TTFT of the busiest replica against the least busy",
    title="One replica swamped while another sits idle",
    symptom="one data-parallel replica's arrivals and TTFT far above another's, which idles",
    causes=(
        "prefix affinity pins a flood of requests sharing a prompt prefix to one replica",
        "the router's load signal lags (long outputs counted as short, a replica restarted)",
        "one replica is slower (fewer cores or a straggling device) and drains its queue late",
    ),
    checks=(
        "requests and TTFT per replica in the window (requests.replica)",
        "whether the hot replica's requests share a prompt prefix (prefix affinity on?)",
        "/health: each replica's outstanding_tokens, routed and restarts",
    ),
    knob="serve without --router-prefix-affinity, or add replicas so the hot prefix has room",
    params={
        "arrival_skew": Param(
            3.0, "requests at the busiest replica per request at the least busy (fair: 1)"
        ),
        "ttft_ratio": Param(
            3.0, "busiest replica's TTFT p50 over the least busy one's, when that one had any"
        ),
        "idle_running": Param(0.5, "mean running requests at or below which a replica idles"),
        "spare_share": Param(
            0.5,
            "or, with the TTFT ratio met, mean running requests at the least busy replica at "
            "most this share of the busiest's",
        ),
        "busy_running": Param(2.0, "mean running requests the busiest replica holds at least"),
        "min_requests": Param(6, "requests at the busiest replica in the window, at least"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("ttft_queueing", "ttft_prefill_bound", "head_of_line_blocking"),
    evidence_signals=(
        "replica_arrivals_max",
        "replica_arrivals_min",
        "replica_ttft_p50_hot",
        "replica_running_mean_min",
    ),
    reads=("requests", "completions", "replicas"),
)
