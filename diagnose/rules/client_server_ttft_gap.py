"""``client_server_ttft_gap``: clients see a much later first token than the server."""

from __future__ import annotations

from ..signals import Signals
from ._common import Evidence, Param, Rule, _confidence, _ms, _ratio, _severity


def detect(sig: Signals, p: dict) -> Evidence | None:
    client, server = (
        sig.overall.get("client_ttft_p50"),
        sig.overall.get("server_ttft_p50_with_client"),
    )
    r = _ratio(client, server)
    if r is None or r < p["ratio"]:
        return None
    return Evidence(
        f"clients saw a TTFT p50 of {_ms(client)} where the server measured {_ms(server)} "
        f"({r:.1f}x): something between them (a proxy, a load balancer) buffers the stream",
        {"client_ttft_p50_ms": client, "server_ttft_p50_ms": server, "ratio": r},
        (sig.since_ns, sig.until_ns),
        "client_ttft_ms > ? * ttft_ms",
        [p["ratio"]],
        _severity(r, p["ratio"]),
        _confidence(r / p["ratio"]),
    )


RULE = Rule(
    id="client_server_ttft_gap",
    title="clients see a much later first token than the server",
    symptom="client TTFT far above server TTFT",
    causes=("a proxy or load balancer that buffers the stream", "client-side queueing"),
    checks=("client ITL near zero inside bursts (buffering)",),
    knob="turn off response buffering in the proxy (e.g. X-Accel-Buffering: no, proxy_buffering off)",
    params={"ratio": Param(2.0, "client TTFT p50 / server TTFT p50 (symptom case C08)")},
    detect=detect,
    evidence_signals=("client_ttft_p50", "server_ttft_p50_with_client"),
)
