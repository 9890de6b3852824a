"""``client_server_ttft_gap``: clients see a much later first token than the server.

The gap between the client's TTFT and the server's has two parts the store tells apart: the
time the server itself withheld the first text after making the first token
(``requests.text_holdback_ms``: a tail that might become a stop string, an incomplete UTF-8
character), and everything after the server released it (proxy, network, client). When the
server's own holdback is most of the gap, the finding names it instead of a proxy.
"""

from __future__ import annotations

from ..signals import Signals
from ._common import Alert, Evidence, Param, Rule, _confidence, _ms, _ratio, _severity

PROXY = "a proxy or load balancer that buffers the stream"
HOLDBACK = (
    "the server withheld the stream's start after making the first token (stop-string "
    "holdback: requests.text_holdback_ms)"
)
CLIENT = "client-side queueing"


def detect(sig: Signals, p: dict) -> Evidence | None:
    client, server, first_text = (
        sig.overall.get("client_ttft_p50"),
        sig.overall.get("server_ttft_p50_with_client"),
        sig.overall.get("server_first_text_p50_with_client"),
    )
    r = _ratio(client, server)
    if r is None or r < p["ratio"]:
        return None
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
        f"({r:.1f}x): something between them (a proxy, a load balancer) buffers the stream",
        numbers,
        (sig.since_ns, sig.until_ns),
        "client_ttft_ms > ? * ttft_ms",
        [p["ratio"]],
        _severity(r, p["ratio"]),
        _confidence(r / p["ratio"]),
    )
    if share >= p["holdback_share"]:
        ev.summary = (
            f"clients saw a TTFT p50 of {_ms(client)} where the server made its first token at "
            f"{_ms(server)} ({r:.1f}x), but the server itself released the first text only at "
            f"{_ms(first_text)}: it withheld the stream's start for {_ms(held)} "
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
        "ratio": Param(2.0, "client TTFT p50 / server TTFT p50 (symptom case C08)"),
        "holdback_share": Param(
            0.5,
            "share of the client-server gap the server itself withheld (first text after first "
            "token) above which the holdback, not a proxy, is named",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=(
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
