"""Console pages on a 100,000-request store: how long each page takes to open.

The store is generated with DuckDB SQL (``range()``) in the real schema, like
``diagnose_scale.py``: nine spans per request (the decode span with its per-token ITL list,
prefill chunks and preemptions as span events), one engine step per 25 ms, one GPU sample per
100 ms (with an energy counter and a power-capped stretch), about 40 requests/s for ~42 min,
2 % errors, 1 % rejections, 5 % preempted requests, and a queueing stretch for the diagnoser.

Measured per page, over the whole store (the "All" window, the heaviest): ``data_s``, the
page's queries called directly (cold: a fresh connection), and ``render_s``, a cold
``AppTest`` run of the page (Streamlit's caches cleared first: queries, figures, the whole
script); ``rerun_s`` is a second run with the caches warm; ``browser_s`` (when Debian's
``chromium`` is there; ``--no-browser`` skips it) is the time from a click on the page in the
sidebar to its plotly charts drawn and its script run finished, in headless Chromium against
a real ``tokenmill dashboard --source STORE``; ``browser_first_load_s`` is a fresh tab opening
the console (mostly Streamlit's frontend booting). Target (issue 8): a page opens in ≤ 3 s.
Results: ``benchmarks/results/dashboard_pages.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import duckdb

from tokenmill.dashboard import data
from tokenmill.telemetry.schema import apply_schema

OUT = Path(__file__).parent / "results"
APP = Path(data.__file__).parent / "app.py"
T0 = 1_790_000_000 * 10**9
S = 10**9
TARGET_S = 3.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


def build(path: Path, n: int) -> dict:
    """Write an ``n``-request store at ``path``; returns rows per table."""
    con = duckdb.connect(str(path))
    apply_schema(con)
    rate = 40
    gap = S // rate
    duration_s = n // rate
    q_lo, q_hi = int(0.6 * n), int(0.7 * n)
    con.execute(
        "INSERT INTO events VALUES (?, 'config', 'info', 'engine flags at start', ?)",
        [T0, json.dumps({"max_num_seqs": 64, "max_num_batched_tokens": 2048})],
    )
    con.execute(
        f"""
        CREATE TEMP TABLE r AS
        SELECT *, a + 500000 AS queued, a + 500000 + q AS sched, a + 500000 + q + p AS first,
               a + 500000 + q + p + d AS last,
               CASE WHEN rej THEN a + 300000 ELSE a + 500000 + q + p + d + 1000000 END AS fin
        FROM (SELECT i, {T0} + i * {gap} AS a, 40 + (i * 7919) % 400 AS n_in,
                     20 + (i * 104729) % 80 AS n_out, i % 100 = 7 AS rej, i % 50 = 3 AS err,
                     i % 20 = 11 AS pre,
                     CASE WHEN i BETWEEN {q_lo} AND {q_hi} THEN 2000000000
                          ELSE 4000000 + (i * 31) % 6000000 END AS q,
                     (40 + (i * 7919) % 400) * 300000 AS p,
                     30000000 + (i * 13) % 20000000 AS itl,
                     (20 + (i * 104729) % 80 - 1) * (30000000 + (i * 13) % 20000000)
                         + CASE WHEN i % 20 = 11 THEN 800000000 ELSE 0 END AS d
              FROM range({n}) t(i))
        """
    )
    con.execute(
        """
        INSERT INTO requests BY NAME
        SELECT 'cmpl-' || i AS request_id, 'req-' || i AS client_request_id,
            printf('%032x', i) AS trace_id, 'tenant-' || (i % 5) AS tenant,
            'smollm2-135m-instruct' AS model, 'chat' AS endpoint, true AS stream,
            CASE WHEN rej THEN 429 ELSE 200 END AS http_status, a AS arrival_ns,
            CASE WHEN rej THEN NULL ELSE queued END AS queued_ns,
            CASE WHEN rej THEN NULL ELSE sched END AS scheduled_ns,
            CASE WHEN rej THEN NULL ELSE first END AS first_token_ns,
            CASE WHEN rej THEN NULL ELSE last END AS last_token_ns, fin AS end_ns,
            CASE WHEN rej THEN NULL ELSE (first - a) / 1e6 END AS ttft_ms,
            CASE WHEN rej THEN NULL ELSE q / 1e6 END AS queue_ms,
            CASE WHEN rej THEN NULL ELSE p / 1e6 END AS prefill_ms,
            CASE WHEN rej THEN NULL ELSE d / 1e6 END AS decode_ms,
            CASE WHEN rej THEN NULL ELSE d / 1e6 / (n_out - 1) END AS tpot_ms,
            CASE WHEN rej THEN NULL ELSE itl / 1e6 END AS itl_p50_ms,
            CASE WHEN rej THEN NULL WHEN pre THEN 800 + itl / 1e6 ELSE itl / 1e6 * 1.2 END AS itl_p99_ms,
            CASE WHEN rej THEN NULL WHEN pre THEN 800 + itl / 1e6 ELSE itl / 1e6 * 1.5 END AS itl_max_ms,
            (fin - a) / 1e6 AS e2e_ms, n_in AS input_tokens,
            CASE WHEN rej THEN 0 ELSE n_out END AS output_tokens,
            CASE WHEN rej THEN NULL ELSE n_in // 32 * 16 END AS cached_tokens,
            n_out AS max_tokens, CASE WHEN pre THEN 1 ELSE 0 END AS preemptions,
            CASE WHEN pre THEN n_in + 5 ELSE 0 END AS recomputed_tokens, 1 AS prefill_chunks,
            CASE WHEN rej THEN NULL WHEN err THEN 'error' ELSE 'length' END AS finish_reason,
            CASE WHEN rej THEN 'queue_full' WHEN err THEN 'nan_logits' END AS error_type,
            [1001, 1002, 1003, (hash(i) >> 2)::BIGINT] AS prompt_block_hashes
        FROM r
        """
    )
    stations = [
        ("gateway", "a", "a + 200000", "'{}'", "'[]'"),
        ("tokenize", "a + 200000", "a + 400000", "'{}'", "'[]'"),
        ("admission", "a + 400000", "queued", "'{}'", "'[]'"),
        ("schedule", "queued", "sched", "'{}'", "'[]'"),
        (
            "prefill",
            "sched",
            "first",
            "'{}'",
            '\'[{"name": "chunk", "time_ns": \' || (first - 1000000) || \', "attributes": '
            "{\"tokenmill.step_id\": ' || i || ', \"tokenmill.tokens\": ' || n_in || '}}]'",
        ),
        (
            "decode",
            "first",
            "last",
            "json_object('tokenmill.decode.itl_ms', list_transform(range(n_out - 1), "
            "lambda x: itl / 1e6 + CASE WHEN pre AND x = 5 THEN 800.0 ELSE 0.0 END))",
            'CASE WHEN pre THEN \'[{"name": "preempted", "time_ns": \' || (first + 6 * itl) '
            '|| \', "attributes": {"tokenmill.step_id": \' || i || \'}}, {"name": "resumed", '
            '"time_ns": \' || (first + 6 * itl + 400000000) || \', "attributes": '
            "{\"tokenmill.step_id\": ' || (i + 1) || '}}]' ELSE '[]' END",
        ),
        ("stream", "first + 300000", "fin - 100000", "'{}'", "'[]'"),
        ("metering", "fin - 100000", "fin", "'{}'", "'[]'"),
    ]
    parts = [
        "SELECT printf('%032x', i) AS trace_id, printf('%016x', i * 16) AS span_id, "
        "NULL AS parent_span_id, 'request' AS name, 'SERVER' AS kind, a AS start_ns, "
        "fin AS end_ns, fin - a AS duration_ns, CASE WHEN err OR rej THEN 'ERROR' ELSE 'UNSET' "
        "END AS status_code, '{}' AS attributes, '[]' AS events, 'cmpl-' || i AS request_id, "
        "'tenant-' || (i % 5) AS tenant FROM r"
    ]
    for j, (name, start, end, attrs, events) in enumerate(stations, 1):
        where = "" if name == "gateway" else " WHERE NOT rej"
        parts.append(
            f"SELECT printf('%032x', i), printf('%016x', i * 16 + {j}), printf('%016x', i * 16), "
            f"'{name}', 'INTERNAL', {start}, {end}, ({end}) - ({start}), 'UNSET', {attrs}, "
            f"{events}, 'cmpl-' || i, 'tenant-' || (i % 5) FROM r{where}"
        )
    con.execute("INSERT INTO spans BY NAME " + " UNION ALL ".join(parts))
    n_steps = duration_s * 40
    s_lo, s_hi = int(0.6 * n_steps), int(0.7 * n_steps)
    con.execute(
        f"""
        INSERT INTO engine_steps BY NAME
        SELECT i AS step_id, 4242 AS engine_pid, {T0} + i * 25000000 AS start_ns,
            {T0} + i * 25000000 + 22000000 AS end_ns, 0.5 AS schedule_ms, 21.0 AS forward_ms,
            0.5 AS sample_ms, 24 + i % 16 AS num_running,
            CASE WHEN i BETWEEN {s_lo} AND {s_hi} THEN 12 ELSE 0 END AS num_waiting,
            CASE WHEN i % 8 = 0 THEN 200 ELSE 0 END AS num_prefill_tokens,
            24 + i % 16 AS num_decode_tokens, CASE WHEN i % 8 = 0 THEN 1 ELSE 0 END AS num_prefill_chunks,
            24 + i % 16 AS num_sampled, CASE WHEN i % 400 = 0 THEN 1 ELSE 0 END AS num_preempted,
            1000 AS kv_blocks_total, 300 + i % 200 AS kv_blocks_used, 700 - i % 200 AS kv_blocks_free,
            50 AS kv_blocks_cached, CASE WHEN i % 8 = 0 THEN 96 ELSE 0 END AS prefix_hit_tokens,
            0 AS allocation_failures, 1 AS num_finished
        FROM range({n_steps}) t(i)
        """
    )
    n_samples = duration_s * 10
    d_lo, d_hi = int(0.3 * n_samples), int(0.35 * n_samples)
    con.execute(
        f"""
        INSERT INTO device_samples BY NAME
        SELECT {T0} + i * 100000000 AS time_ns, 'gpu' AS kind, 0 AS device_index,
            'NVIDIA H200' AS device_name, 450.0 + i % 50 AS power_w, i * 47.0 AS energy_j,
            88.0 AS gpu_util_pct, 40.0 AS mem_util_pct, 55.0 AS dram_bw_util_pct,
            (100::BIGINT << 30) AS mem_used_bytes, (141::BIGINT << 30) AS mem_total_bytes,
            CASE WHEN i BETWEEN {d_lo} AND {d_hi} THEN 1500 ELSE 1980 END AS sm_clock_mhz,
            2619 AS mem_clock_mhz, 60.0 + i % 20 AS temperature_c,
            CASE WHEN i BETWEEN {d_lo} AND {d_hi} THEN ['sw_power_cap']
                 ELSE []::VARCHAR[] END AS clock_event_reasons
        FROM range({n_samples}) t(i)
        """
    )
    counts = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("requests", "spans", "engine_steps", "device_samples", "events")
    }
    con.close()
    return counts


def page_queries(con, page: str) -> None:
    """The queries a page runs over the whole store (what ``views/<page>.py`` asks ``data``)."""
    since, until = data.time_range(con)
    b = data.pick_bucket_s(since, until)
    if page == "overview":
        data.overview(con, since, until, data.GoodputSlo())
        data.diagnosis(con, since, until, 10.0)
        data.latency_series(con, since, until, b)
    elif page == "requests":
        data.filter_options(con, since, until)
        table, _ = data.requests_table(con, since, until)
        data.request_detail(con, table["trace_id"].iloc[0])
    elif page == "engine":
        data.engine_summary(con, since, until)
        data.engine_steps(con, since, until)
        data.prefix_hit_series(con, since, until, b)
    elif page == "devices":
        data.device_series(con, since, until)
        data.energy_per_token(con, since, until, b)
    elif page == "errors":
        data.error_examples(con, since, until)
        data.errors_series(con, since, until, b)
        data.error_events(con, since, until)
    elif page == "diagnosis":
        data.diagnosis(con, since, until, 10.0)
        data.signal_windows(con, since, until, 10.0)


def _idle(tab) -> None:
    """Wait while Streamlit's "Running..." status shows."""
    while tab.locator('[data-testid="stStatusWidget"]').count():
        time.sleep(0.02)


def browser_open_times(path: Path, pages: tuple[str, ...]) -> dict[str, float]:
    """Seconds in headless Chromium against ``tokenmill dashboard --source PATH``:
    ``first_load``, a fresh tab opening the console (Streamlit's frontend boots, Overview runs
    cold); then, per page, a click in the sidebar to the page's charts drawn and its script
    run finished (as an operator moves between pages; each page's queries run cold except
    Overview's, which the first load ran)."""
    import signal
    import socket
    import subprocess
    import sys

    import httpx
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "dashboard", "--source", str(path),
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    times = {}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/_stcore/health", timeout=2).text.strip() == "ok":
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the console did not start")
            time.sleep(0.3)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            t = time.perf_counter()
            tab.goto(url)
            tab.wait_for_selector(".js-plotly-plot", timeout=120_000)
            _idle(tab)
            times["first_load"] = round(time.perf_counter() - t, 3)
            for page_name in (*pages[1:], pages[0]):  # end on Overview: it opens warm first
                title = page_name.capitalize()
                t = time.perf_counter()
                tab.locator('[data-testid="stSidebarNav"] a', has_text=title).click()
                tab.wait_for_selector(f'h2:has-text("{title}")', timeout=120_000)
                _idle(tab)
                tab.wait_for_selector(".js-plotly-plot", timeout=120_000)
                times[page_name] = round(time.perf_counter() - t, 3)
                if tab.locator('[data-testid="stException"]').count():
                    raise SystemExit(f"{page_name}: the page shows an exception")
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--keep", type=Path, help="keep the generated store at this path")
    ap.add_argument("--no-browser", action="store_true", help="skip the Chromium timings")
    args = ap.parse_args()
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    pages = ("overview", "requests", "engine", "devices", "errors", "diagnosis")
    with tempfile.TemporaryDirectory() as d:
        path = args.keep or Path(d) / "pages.duckdb"
        t = time.perf_counter()
        counts = build(path, args.requests)
        build_s = time.perf_counter() - t
        results = {}
        for page in pages:
            con = duckdb.connect(str(path), read_only=True)
            t = time.perf_counter()
            page_queries(con, page)
            data_s = time.perf_counter() - t
            con.close()
            os.environ["TOKENMILL_DASHBOARD_SOURCE"] = str(path)
            at = AppTest.from_file(str(APP), default_timeout=300)
            if page != "overview":
                at.run()  # land on the default page first, as a user would
                at.switch_page(f"views/{page}.py")
            st.cache_data.clear()
            t = time.perf_counter()
            at.run()
            render_s = time.perf_counter() - t
            if at.exception:
                raise SystemExit(f"{page}: {at.exception[0].message}")
            t = time.perf_counter()
            at.run()
            rerun_s = time.perf_counter() - t
            results[page] = {
                "data_s": round(data_s, 3),
                "render_s": round(render_s, 3),
                "rerun_s": round(rerun_s, 3),
                "ok": render_s <= TARGET_S,
            }
            print(f"{page:10s} data {data_s:6.2f} s  render {render_s:6.2f} s  "
                  f"rerun {rerun_s:6.2f} s  {'ok' if render_s <= TARGET_S else 'OVER'}")  # fmt: skip
        browser = {}
        if not args.no_browser and Path(CHROMIUM).exists():
            browser = browser_open_times(path, pages)
            for page in pages:
                results[page]["browser_s"] = browser[page]
                results[page]["ok"] = results[page]["ok"] and browser[page] <= TARGET_S
        size = path.stat().st_size
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "streamlit": st.__version__,
        "duckdb": duckdb.__version__,
        "rows": counts,
        "store_bytes": size,
        "build_s": round(build_s, 2),
        "window": "all (the whole store)",
        "pages": results,
        "browser_first_load_s": browser.get("first_load"),
        "target_s": TARGET_S,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "dashboard_pages.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'page':10s} {'data s':>8s} {'render s':>9s} {'rerun s':>8s} {'browser s':>10s}")
    for page, r in results.items():
        b = f"{r['browser_s']:10.2f}" if "browser_s" in r else f"{'-':>10s}"
        print(f"{page:10s} {r['data_s']:8.2f} {r['render_s']:9.2f} {r['rerun_s']:8.2f} {b}")
    if browser:
        print(f"first load of the console in a fresh tab (Overview): {browser['first_load']:.2f} s")


if __name__ == "__main__":
    main()
