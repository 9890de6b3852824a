"""``client_server_ttft_gap``: clients see a much later first token than the server.

The gap between the client's TTFT and the server's has two parts the store tells apart: the
time the server itself withheld the first text after making the first token
(``requests.text_holdback_ms``: a tail that might become a stop string, an incomplete UTF-8
character), and everything after the server released it (proxy, network, client). When the
server's own holdback is most of the gap, the finding names it instead of a proxy.
"""

from __future__ import annotations

from ..signals import COMPLETED_SQL, Signals
from ..stats import against_bound
from ._common import Alert, Evidence, Param, Rule, _confidence, _ms, _severity

PROXY = "a proxy or load balancer that buffers the stream"
HOLDBACK = (
    "the server withheld the stream's start after making the first token (stop-string "
    "holdback: requests.text_holdback_ms)"
)
CLIENT = "client-side queueing"


# each request's client TTFT over its server TTFT, where the load generator recorded both
_RATIOS_SQL = f"""
SELECT client_ttft_ms / ttft_ms FROM requests
WHERE arrival_ns >= ? AND arrival_ns < ? AND {COMPLETED_SQL}
  AND client_ttft_ms IS NOT NULL AND ttft_ms > 0
"""


def _persistence(sig: Signals, p: dict) -> tuple[int, int]:
    """Windows whose requests' median client/server TTFT ratio reached ``ratio``, and the
    windows with client timings at all."""
    seen = [w.get("client_over_server_ttft_p50") for w in sig.windows]
    seen = [r for r in seen if r is not None]
    return sum(r >= p["ratio"] for r in seen), len(seen)


def detect(sig: Signals, p: dict) -> Evidence | None:
    client, server, first_text = (
        sig.overall.get("client_ttft_p50"),
        sig.overall.get("server_ttft_p50_with_client"),
        sig.overall.get("server_first_text_p50_with_client"),
    )
    r = sig.overall.get("client_over_server_ttft_p50")
    if r is None or r < p["ratio"] or client is None or server is None:
        return None
    ratios = [v for (v,) in sig.con.execute(_RATIOS_SQL, [sig.since_ns, sig.until_ns]).fetchall()]
    n_held, seen = _persistence(sig, p)
    support = against_bound(
        ratios,
        p["ratio"],
        unit="requests",
        reference_name="client TTFT / server TTFT, request by request, against the rule's ratio",
        persistence=f"{n_held} of {seen} windows with client timings",
    )
    if support.verdict == "conclusive" and (n_held < p["held_windows"] or 2 * n_held < seen):
        support.verdict = "inconclusive"
        support.reason = (
            f"the gap held in {n_held} of {seen} windows with client timings; it must hold in "
            f"{p['held_windows']:g} or more and in half of them: a load generator's first "
            "requests pay its own start (connections, a server still warming)"
        )
    gap = client - server
    held = max(0.0, first_text - server) if first_text is not None else 0.0
    share = held / gap if gap > 0 else 0.0
    numbers = {
        "client_ttft_p50_ms": client,
        "server_ttft_p50_ms": server,
        "ratio": r,
        "server_first_text_p50_ms": first_text,
        "server_holdback_share_of_gap": share,
    }
    ev = Evidence(
        f"clients saw a TTFT p50 of {_ms(client)} where the server measured {_ms(server)} "
        f"({r:.1f}x request by request): something between them (a proxy, a load balancer) "
        "buffers the stream",
        numbers,
        (sig.since_ns, sig.until_ns),
        "client_ttft_ms > ? * ttft_ms",
        [p["ratio"]],
        _severity(r, p["ratio"]),
        _confidence(r / p["ratio"]),
        support=support,
    )
    if share >= p["holdback_share"]:
        ev.summary = (
            f"clients saw a TTFT p50 of {_ms(client)} where the server made its first token at "
            f"{_ms(server)} ({r:.1f}x request by request), but the server itself released the "
            f"first text only at {_ms(first_text)}: it withheld the stream's start for {_ms(held)} "
            f"({share:.0%} of the gap), holding back text that might become a stop string"
        )
        ev.example_where, ev.example_params = "text_holdback_ms >= ?", [held]
        ev.causes = (HOLDBACK, PROXY, CLIENT)
        ev.knob = (
            "check the requests' stop strings (a stop string whose start keeps matching the "
            "output holds text back); requests.text_holdback_ms shows each request's holdback"
        )
    return ev


RULE = Rule(
    id="client_server_ttft_gap",
    own_test="client TTFT against server TTFT, request by request",
    title="clients see a much later first token than the server",
    symptom="client TTFT far above server TTFT",
    causes=(PROXY, HOLDBACK, CLIENT),
    checks=(
        "client ITL near zero inside bursts (buffering)",
        "requests.text_holdback_ms against the gap (the server's own holdback)",
    ),
    knob="turn off response buffering in the proxy (e.g. X-Accel-Buffering: no, proxy_buffering off)",
    params={
        "ratio": Param(
            2.0,
            "the median over requests of client TTFT / server TTFT (symptom case C08)",
        ),
        "held_windows": Param(
            2,
            "windows in which the gap held, and at least half of those with client timings "
            "(tune: at a load generator's start its clients' first requests saw 2-5x in one "
            "window of 6 healthy and low-rate runs; a proxy's gap holds in every window)",
        ),
        "holdback_share": Param(
            0.5,
            "share of the client-server gap the server itself withheld (first text after first "
            "token) above which the holdback, not a proxy, is named",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=(
        "client_over_server_ttft_p50",
        "client_ttft_p50",
        "server_ttft_p50_with_client",
        "server_first_text_p50_with_client",
    ),
    # only with a client-side TTFT histogram (tokenmill export --client-ttft-metric)
    alert=Alert(
        name="TokenmillClientServerTTFTGap",
        expr="$client_ttft_p50 / $ttft_p50 >= $ratio",
        value="client TTFT p50 / server TTFT p50",
    ),
    reads=("client",),
)
