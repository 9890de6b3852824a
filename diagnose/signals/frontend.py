"""What the path after the engine adds, by arrival: families ``client`` (the client's TTFT
against the server's, where the load generator recorded it: ``requests.client_ttft_ms``) and
``stream`` (the stream's time per token against the engine's TPOT)."""

from __future__ import annotations

from .requests import arrival_family

_CLIENT_SELECT = """
    quantile_cont(client_ttft_ms, 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL) AS client_ttft_p50,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL) AS server_ttft_p50_with_client,
    quantile_cont(ttft_ms + coalesce(text_holdback_ms, 0), 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL) AS server_first_text_p50_with_client,
    quantile_cont(client_ttft_ms / ttft_ms, 0.5) FILTER (WHERE ok AND client_ttft_ms IS NOT NULL AND ttft_ms > 0) AS client_over_server_ttft_p50"""

_CLIENT_KEYS = (
    "client_ttft_p50",
    "server_ttft_p50_with_client",
    "server_first_text_p50_with_client",
    "client_over_server_ttft_p50",
)


# per window: the client's TTFT p50, the server's TTFT p50 of the same requests, when the
# server released their first text (TTFT + text_holdback_ms), and the median over those requests
# of each one's client TTFT / server TTFT (the pair read request by request: the two medians can
# come from different requests)
CLIENT = arrival_family(
    "client", _CLIENT_SELECT, _CLIENT_KEYS, "ttft_ms", "client_ttft_ms", "text_holdback_ms"
)

_STREAM_SELECT = """
    quantile_cont(((end_ns - first_token_ns) / 1e6) / nullif(output_tokens - 1, 0) / nullif(tpot_ms, 0), 0.5)
        FILTER (WHERE ok AND output_tokens >= 8) AS stream_vs_engine_tpot"""


# per window: the median over requests (8+ output tokens) of the stream's time per token after
# the first over the engine's TPOT (1.0 when the output path keeps up)
STREAM = arrival_family(
    "stream",
    _STREAM_SELECT,
    ("stream_vs_engine_tpot",),
    "end_ns",
    "first_token_ns",
    "output_tokens",
    "tpot_ms",
)
