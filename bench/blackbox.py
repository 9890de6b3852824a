"""A scenario run through ``tokenmill proxy``, the engine treated as a black box: the same
diagnosis from what any engine gives (its OTLP spans and ``/metrics``) as from our own store?

One run of a scenario (``bench/scenario.py``) with a proxy in front of the server:

- ``tokenmill serve`` with the scenario's flags keeps its own trace store and exports its spans
  over OTLP/HTTP to the proxy (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), as any engine would to a
  collector; it knows nothing else of the proxy.
- ``tokenmill proxy --upstream SERVER --otlp-receiver --scrape-interval 1s`` takes the clients'
  requests, forwards them with a ``traceparent``, records what the clients saw, stores the
  spans it receives and scrapes the server's ``/metrics`` into ``engine_samples``.
- The scenario's ``tokenmill bench`` steps are sent to the proxy.

Then both stores are diagnosed with the scenario's window, and compared: the top finding of
each; per request (joined on the trace id) the TTFT the proxy measured against the server's
own (and, where they differ, the proxy's first token against the server's own record of when
it sent the first byte: its ``stream`` station's start); and how many of the proxy's requests
hold, in one trace, the proxy's stations and the server's engine stations.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import duckdb

from .scenario import (
    Scenario,
    ScenarioError,
    _free_port,
    _run_steps,
    server_launch,
    start_server,
    stop_server,
    verdict,
)

#: a TTFT at the proxy agrees with the server's own within this share, or this many ms
TTFT_AGREE_PCT = 5.0
TTFT_AGREE_MS = 20.0
ENGINE_STATIONS = ("schedule", "prefill", "decode")
PROXY_STATIONS = ("gateway", "stream")
PROXY_SERVICE = "tokenmill-proxy"


def diagnose_store(store: Path, window: str) -> dict:
    """One closed store's diagnosis in brief: top finding, findings, what was not assessed and
    where the queue/KV signals came from, the request count and TTFT."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.telemetry.dump import parse_duration

    con = duckdb.connect(str(store), read_only=True)
    try:
        report = diagnose(con, window_s=parse_duration(window))
    finally:
        con.close()
    return {
        "top": report.findings[0].rule_id if report.findings else None,
        "findings": [
            {
                "rule": f.rule_id,
                "severity": f.severity,
                "confidence": f.confidence,
                "summary": f.summary,
            }
            for f in report.findings
        ],
        "not_assessed": sorted(report.not_assessed),
        "signal_sources": report.signal_sources,
        "summary": {k: report.summary.get(k) for k in ("requests", "ttft_p50_ms", "ttft_p99_ms")},
    }


_TTFT_SQL = f"""
SELECT count(*) AS joined,
    count(*) FILTER (WHERE abs(p.ttft_ms - u.ttft_ms) <= greatest({TTFT_AGREE_MS},
                     {TTFT_AGREE_PCT / 100} * u.ttft_ms)) AS agree,
    median(p.ttft_ms - u.ttft_ms) AS diff_p50_ms,
    quantile_cont(abs(p.ttft_ms - u.ttft_ms), 0.99) AS abs_diff_p99_ms,
    max(abs(p.ttft_ms - u.ttft_ms) / nullif(u.ttft_ms, 0)) AS rel_diff_max
FROM requests p JOIN up.requests u USING (trace_id)
WHERE p.ttft_ms IS NOT NULL AND u.ttft_ms IS NOT NULL
"""

# where the two disagree: the server's TTFT ends at its engine's first token, the proxy's when
# that token arrived; the server's own `stream` station starts when it sent the first byte
_FIRST_BYTE_SQL = f"""
SELECT count(*) AS joined,
    count(*) FILTER (WHERE abs(p.first_token_ns - s.start_ns) / 1e6 <= greatest({TTFT_AGREE_MS},
                     {TTFT_AGREE_PCT / 100} * u.ttft_ms)) AS agree,
    median((p.first_token_ns - s.start_ns) / 1e6) AS after_sent_p50_ms,
    max((p.first_token_ns - s.start_ns) / 1e6) AS after_sent_max_ms,
    max((s.start_ns - u.first_token_ns) / 1e6) AS server_send_lag_max_ms
FROM requests p JOIN up.requests u USING (trace_id)
JOIN up.spans s ON s.trace_id = u.trace_id AND s.name = 'stream'
WHERE p.first_token_ns IS NOT NULL AND u.ttft_ms IS NOT NULL
"""

_TRACES_SQL = f"""
WITH per AS (
    SELECT trace_id,
        count(DISTINCT name) FILTER (WHERE service_name = '{PROXY_SERVICE}'
            AND name IN {PROXY_STATIONS}) AS proxy_stations,
        count(DISTINCT name) FILTER (WHERE service_name IS DISTINCT FROM '{PROXY_SERVICE}'
            AND name IN {ENGINE_STATIONS}) AS engine_stations
    FROM spans GROUP BY trace_id)
SELECT count(*) AS requests,
    count(*) FILTER (WHERE per.proxy_stations = {len(PROXY_STATIONS)}
                     AND per.engine_stations = {len(ENGINE_STATIONS)}) AS whole
FROM requests r LEFT JOIN per USING (trace_id)
WHERE r.finish_reason IN ('stop', 'length')
"""


def compare_stores(proxy_store: Path, server_store: Path) -> dict:
    """TTFT agreement per request and whole traces (module docstring)."""
    con = duckdb.connect(str(proxy_store), read_only=True)
    try:
        con.execute(f"ATTACH '{server_store}' AS up (READ_ONLY)")
        cur = con.execute(_TTFT_SQL)
        ttft = dict(zip([d[0] for d in cur.description], cur.fetchone(), strict=True))
        cur = con.execute(_FIRST_BYTE_SQL)
        first_byte = dict(zip([d[0] for d in cur.description], cur.fetchone(), strict=True))
        cur = con.execute(_TRACES_SQL)
        traces = dict(zip([d[0] for d in cur.description], cur.fetchone(), strict=True))
        (samples,) = con.execute("SELECT count(*) FROM engine_samples").fetchone()
    finally:
        con.close()
    ttft["agree_share"] = ttft["agree"] / ttft["joined"] if ttft["joined"] else None
    return {"ttft": ttft, "first_byte": first_byte, "traces": traces, "engine_samples": samples}


def run_through_proxy(sc: Scenario, out: Path, *, model: str | None = None, log=print) -> dict:
    """Run ``sc`` with ``tokenmill proxy`` in front of the server (module docstring) into
    ``out``; returns both diagnoses and the comparison (also ``out/blackbox.json``).

    Raises:
        ScenarioError: a server or the proxy did not start, or a bench step failed.
    """
    if sc.host_load or sc.proxy:
        raise ScenarioError(f"{sc.name}: host load and the buffering proxy are not supported here")
    out.mkdir(parents=True, exist_ok=True)
    port, proxy_port = _free_port(), _free_port()
    cmd, out, env = server_launch(sc, out, port, model)
    server_store, proxy_store = out / "traces.duckdb", out / "proxy.duckdb"
    for p in [*out.glob("traces.duckdb*"), *out.glob("proxy.duckdb*")]:
        p.unlink()
    env = {
        **env,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{proxy_port}/v1/traces",
        "OTEL_BSP_SCHEDULE_DELAY": "1000",  # ms: spans reach the proxy within a second
    }
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    url, proxy_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy_port}"
    proxy_cmd = [sys.executable, "-m", "tokenmill.engine.cli", "proxy", "--upstream", url,
                 "--port", str(proxy_port), "--trace-db", str(proxy_store), "--otlp-receiver",
                 "--scrape-interval", "1s"]  # fmt: skip
    log(f"[{sc.name}] proxy on :{proxy_port} in front of tokenmill serve {' '.join(sc.server)}")
    proxy = start_server(proxy_cmd, out, dict(os.environ), proxy_url, "proxy.log")
    try:
        server = start_server(cmd, out, env, url)
        try:
            _run_steps(sc, proxy_url, out, log)
        finally:
            stop_server(server)  # flushes its last spans to the proxy
    finally:
        time.sleep(2)
        stop_server(proxy)
    result = {
        "scenario": sc.name,
        "expect": sc.expect,
        "server": diagnose_store(server_store, sc.window),
        "proxy": diagnose_store(proxy_store, sc.window),
        **compare_stores(proxy_store, server_store),
    }
    result["same_top"] = result["server"]["top"] == result["proxy"]["top"]
    found = [f["rule"] for f in result["proxy"]["findings"]]
    result["proxy_passed"] = verdict(sc.expect, sc.absent, found)
    (out / "blackbox.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmill.bench.blackbox SCENARIO OUT``: one run, its JSON on stdout."""
    from .scenario import load

    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m tokenmill.bench.blackbox SCENARIO OUT", file=sys.stderr)
        return 2
    try:
        res = run_through_proxy(
            load(args[0]), Path(args[1]), log=lambda m: print(m, file=sys.stderr)
        )
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
