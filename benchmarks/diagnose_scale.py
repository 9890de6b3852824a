"""``tokenmill diagnose`` on a big store: 1,000,000 requests (≈ 10 M rows of spans, steps and
device samples), generated, then diagnosed end to end in a fresh process.

The store is generated with DuckDB SQL (``range()``), not through the server, so that building
it takes a minute instead of hours; its shape follows the real schema and a real run's ratios:
nine spans per request, one engine step per 20 ms of a ~6 h run at ~46 requests/s, a device
sample every 100 ms, a healthy first half and a queueing second hour (so rules have work to do).

Measured: wall time of ``tokenmill diagnose STORE --format json`` (process start to exit) and
its peak RSS (``getrusage`` of the child). Targets (issue 7): ≤ 20 s and ≤ 4 GB.
Results: ``benchmarks/results/diagnose_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from tokenmill.telemetry.schema import apply_schema

OUT = Path(__file__).parent / "results"
T0 = 1_790_000_000 * 10**9
S = 10**9


def build(path: Path, n_requests: int) -> dict:
    con = duckdb.connect(str(path))
    apply_schema(con)
    rate = 46  # requests/s
    duration_s = n_requests // rate
    half = T0 + duration_s * S // 2
    con.execute(
        "INSERT INTO events VALUES (?, 'config', 'info', 'engine flags at start', ?)",
        [T0, json.dumps({"max_num_seqs": 64, "max_num_batched_tokens": 2048})],
    )
    # requests: arrival every 1/rate s; queueing grows in the last hour
    con.execute(
        f"""
        INSERT INTO requests BY NAME
        SELECT 'cmpl-' || i AS request_id, 'req-' || i AS client_request_id,
               printf('%032x', i) AS trace_id, 'tenant-' || (i % 7) AS tenant,
               'smollm2-135m-instruct' AS model, 'chat' AS endpoint, true AS stream, 200 AS http_status,
               a AS arrival_ns, a + 500000 AS queued_ns, a + 500000 + q AS scheduled_ns,
               a + 500000 + q + p AS first_token_ns, a + 500000 + q + p + d AS last_token_ns,
               a + 500000 + q + p + d + 1000000 AS end_ns,
               (500000 + q + p) / 1e6 AS ttft_ms, q / 1e6 AS queue_ms, p / 1e6 AS prefill_ms,
               d / 1e6 AS decode_ms, d / 1e6 / (n_out - 1) AS tpot_ms,
               d / 1e6 / (n_out - 1) AS itl_p50_ms, d / 1e6 / (n_out - 1) * 1.8 AS itl_p99_ms,
               d / 1e6 / (n_out - 1) * 2.5 AS itl_max_ms,
               (500000 + q + p + d + 1000000) / 1e6 AS e2e_ms,
               n_in AS input_tokens, n_out AS output_tokens, n_in // 2 AS cached_tokens,
               n_out AS max_tokens, 0 AS preemptions, 0 AS recomputed_tokens, 1 AS prefill_chunks,
               'length' AS finish_reason,
               [(hash(i % 50) >> 2)::BIGINT, 1001, 1002, 1003, 1004, 1005] AS prompt_block_hashes
        FROM (SELECT i, {T0} + i * ({S} // {rate}) AS a,
                     40 + (i * 7919) % 200 AS n_in, 30 + (i * 104729) % 60 AS n_out,
                     CASE WHEN {T0} + i * ({S} // {rate}) > {T0 + duration_s * S - 3600 * S}
                          THEN 2000000000 ELSE 5000000 END AS q,
                     (40 + (i * 7919) % 200) * 500000 AS p,
                     (30 + (i * 104729) % 60 - 1) * 40000000 AS d
              FROM range({n_requests}) t(i))
        """
    )
    names = ["request", "gateway", "tokenize", "admission", "schedule", "prefill", "decode",
             "stream", "metering"]  # fmt: skip
    con.execute(
        f"""
        INSERT INTO spans BY NAME
        SELECT r.trace_id, printf('%016x', r.k * 16 + s.j) AS span_id,
               CASE WHEN s.j = 0 THEN NULL ELSE printf('%016x', r.k * 16) END AS parent_span_id,
               s.name, CASE WHEN s.j = 0 THEN 'SERVER' ELSE 'INTERNAL' END AS kind,
               r.arrival_ns + s.j * 1000 AS start_ns, r.end_ns AS end_ns,
               r.end_ns - r.arrival_ns - s.j * 1000 AS duration_ns, 'UNSET' AS status_code,
               '{{"tokenmill.request_id": "' || r.request_id || '"}}' AS attributes, '[]' AS events,
               r.request_id, r.tenant, r.model
        FROM (SELECT *, row_number() OVER () AS k FROM requests) r,
             (SELECT unnest({names}) AS name, generate_subscripts({names}, 1) - 1 AS j) s
        """
    )
    n_steps = duration_s * 1000 // 20
    con.execute(
        f"""
        INSERT INTO engine_steps BY NAME
        SELECT i AS step_id, 4242 AS engine_pid, {T0} + i * 20000000 AS start_ns,
               {T0} + i * 20000000 + 18000000 AS end_ns, 0.4 AS schedule_ms, 17.0 AS forward_ms,
               0.6 AS sample_ms, 32 AS num_running,
               CASE WHEN {T0} + i * 20000000 > {half} THEN 3 ELSE 0 END AS num_waiting,
               CASE WHEN i % 10 = 0 THEN 120 ELSE 0 END AS num_prefill_tokens,
               32 AS num_decode_tokens, CASE WHEN i % 10 = 0 THEN 1 ELSE 0 END AS num_prefill_chunks,
               32 AS num_sampled, 0 AS num_preempted, 1000 AS kv_blocks_total,
               300 + i % 50 AS kv_blocks_used, 700 - i % 50 AS kv_blocks_free, 0 AS kv_blocks_cached,
               0 AS prefix_hit_tokens, 0 AS allocation_failures, 1 AS num_finished
        FROM range({n_steps}) t(i)
        """
    )
    n_samples = duration_s * 10
    con.execute(
        f"""
        INSERT INTO device_samples BY NAME
        SELECT {T0} + i * 100000000 AS time_ns, 'gpu' AS kind, 0 AS device_index,
               'NVIDIA H200' AS device_name, 520.0 AS power_w, 1980 AS sm_clock_mhz,
               2619 AS mem_clock_mhz, 88.0 AS gpu_util_pct, 55.0 AS dram_bw_util_pct,
               61.0 AS temperature_c, []::VARCHAR[] AS clock_event_reasons
        FROM range({n_samples}) t(i)
        """
    )
    counts = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("requests", "spans", "engine_steps", "device_samples")
    }
    con.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="keep the generated store at this path")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = args.keep or Path(d) / "big.duckdb"
        t = time.perf_counter()
        counts = build(path, args.requests)
        build_s = time.perf_counter() - t
        size = path.stat().st_size
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenmill.engine.cli",
                "diagnose",
                str(path),
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise SystemExit(f"diagnose failed ({proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rows": counts,
        "rows_total": sum(counts.values()),
        "store_bytes": size,
        "build_s": build_s,
        "diagnose_wall_s": wall,
        "diagnose_peak_rss_bytes": max(peak_kib, before) * 1024,
        "findings": [f["rule"] for f in report["findings"]],
        "targets": {"diagnose_wall_s": 20, "diagnose_peak_rss_bytes": 4 << 30},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "diagnose_scale.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
