"""A trace store whose disk fills under load, against serving (issue 53, "a full disk"): failed
requests, output tokens/s beside a server with an ample disk in the same run, the rows dropped
against the rows that did not reach the store, and recovery once space is freed.

Two real ``tokenmill serve`` processes (default model, CPU) start side by side: ``ample`` (its
trace store on the ordinary disk) and ``full`` (its trace store on a 4 MiB tmpfs this script
mounts, with a filler file leaving ``--free-kib`` free, so the store's write-ahead log fills the
device within the first rounds). Rounds alternate ample, full, ample, ... (``--rounds`` each of
``--round-s`` seconds: by default 4 x 30 s, two minutes of load on each): a closed loop of
``--concurrency`` streaming chat requests, 64-token prompts and ``--max-tokens`` output tokens
with ``ignore_eos`` (``tokenmill.bench.client``). ``/health`` of the full server is read every
second meanwhile (when its store first said ``disk_full``).

Then the filler is deleted (space freed) and one more round goes to the full server: its
``/health`` must turn ``ok`` and the new requests' rows must reach the store. Both servers get
SIGTERM; the full server's store file is then opened and its ``requests`` rows counted.

Reported: failed requests (target 0), the median of the per-round output tokens/s ratios full /
ample (target within 5 %), ``tokenmill_telemetry_dropped_total{table="requests"}`` by reason
against the requests the server recorded (``tokenmill_requests_total``: the client's requests and
each run's ``GET /v1/models``) minus the ``requests`` rows stored (target equal), and the
recovery. Results:
``benchmarks/results/store_full_drill.json``.

Needs root (``mount -t tmpfs``). Run it alone on the machine (others' engines change the ratio):
``flock /tmp/tokenmill-engine.lock .venv/bin/python benchmarks/store_full_drill.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import httpx

from tokenmill.bench.drill_load import (
    closed_loop_round,
    counter_by,
    sigterm_and_wait,
    throughput_ratios,
    write_result,
)
from tokenmill.bench.scenario import _free_port, start_server

OUT = Path(__file__).parent / "results"
TMPFS_SIZE = "4m"
DROPPED = "tokenmill_telemetry_dropped_total"


def requests_recorded(url: str) -> float:
    """``tokenmill_requests_total`` summed: every request the server recorded a ``requests``
    row for (the client's chat requests and each run's ``GET /v1/models``)."""
    return sum(counter_by(url, "tokenmill_requests_total", "status").values())


def store_health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()["telemetry"]


class HealthWatch:
    """The full server's store ``problem`` every second: when it first said what."""

    def __init__(self, url: str):
        self.url, self.t0, self.first = url, time.monotonic(), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                problem = store_health(self.url)["store"]["problem"]
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                continue
            if problem is not None and problem not in self.first:
                self.first[problem] = round(time.monotonic() - self.t0, 1)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.first


def requests_rows(path: Path) -> int:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute("SELECT count(*) FROM requests").fetchone()[0]
    finally:
        con.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--round-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--free-kib", type=int, default=1024, help="space the filler leaves")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="store-full-"))
    tiny = work / "tiny"
    tiny.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(tiny)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"error: cannot mount a tmpfs (needs root): {done.stderr.strip()}", file=sys.stderr)
        return 2
    filler = tiny / "filler"
    st = os.statvfs(tiny)
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - args.free_kib * 1024))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENMILL_"))}
    base = [sys.executable, "-m", "tokenmill.engine.cli", "serve"]
    servers: dict[str, dict] = {}
    out: dict = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "round_s": args.round_s,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_tokens": 64,
        "tmpfs": TMPFS_SIZE,
        "free_kib_at_start": args.free_kib,
    }
    try:
        for name, db in (("ample", work / "ample" / "traces.duckdb"), ("full", tiny / "t.duckdb")):
            port = _free_port()
            folder = work / name
            folder.mkdir(exist_ok=True)
            url = f"http://127.0.0.1:{port}"
            print(f"starting {name} on {url} (store {db})", flush=True)
            cmd = [*base, "--port", str(port), "--trace-db", str(db)]
            proc = start_server(cmd, folder, env, url, f"{name}.log")
            servers[name] = {"proc": proc, "url": url, "db": db, "rounds": [], "sent": 0}
        load = {"concurrency": args.concurrency, "max_tokens": args.max_tokens}
        for s in servers.values():  # warm-up
            w = closed_loop_round(s["url"], **load, seed=99, seconds=5)
            s["sent"] += w["sent"]
            s["warmup_failed"] = w["failed"]
        full = servers["full"]
        watch = HealthWatch(full["url"])
        for r in range(args.rounds):
            for name, s in servers.items():
                res = closed_loop_round(s["url"], **load, seed=r, seconds=args.round_s)
                s["rounds"].append(res)
                s["sent"] += res["sent"]
                print(f"round {r} {name}: {res}", flush=True)
        problems = watch.stop()
        during = store_health(full["url"])
        # space again: the filler goes, new requests' rows must arrive without a restart
        written_before = during["store"]["written_rows"].get("requests", 0)
        filler.unlink()
        rec = closed_loop_round(full["url"], **load, seed=7, seconds=10)
        full["sent"] += rec["sent"]
        time.sleep(3)  # the writer's next batch (a flush interval is 1 s)
        after = store_health(full["url"])
        drops = counter_by(full["url"], DROPPED, "reason", table="requests")
        recorded = requests_recorded(full["url"])
        drops_all = {
            t: counter_by(full["url"], DROPPED, "reason", table=t)
            for t in ("spans", "engine_steps", "device_samples")
        }
        for s in servers.values():
            s["exit_code"], _ = sigterm_and_wait(s["proc"], 120)
        stored = requests_rows(full["db"])
    finally:
        for s in servers.values():
            if s["proc"].poll() is None:
                s["proc"].kill()
                s["proc"].wait()
        subprocess.run(["umount", "-l", str(tiny)], check=False)
    for name, s in servers.items():
        out[name] = {
            "rounds": s["rounds"],
            "output_tok_s_median": statistics.median(x["output_tok_s"] for x in s["rounds"]),
            "failed": s["warmup_failed"] + sum(x["failed"] for x in s["rounds"]),
            "requests_sent": s["sent"],
            "exit_code": s["exit_code"],
        }
    missing = recorded - stored
    out.update(throughput_ratios(servers["ample"]["rounds"], servers["full"]["rounds"]))
    out["full"].update(
        {
            "failed": out["full"]["failed"] + rec["failed"],
            "store_problem_first_seen_s": problems,
            "health_while_full": {
                "status": during["status"],
                "problem": during["store"]["problem"],
                "store_error": during["store_error"],
            },
            "requests_recorded": recorded,
            "requests_rows_stored": stored,
            "requests_missing": missing,
            "requests_dropped_by_reason": drops,
            "requests_dropped": sum(drops.values()),
            "other_tables_dropped_by_reason": drops_all,
            "recovery": {
                "round": rec,
                "requests_rows_written_before_freeing": written_before,
                "requests_rows_written_after": after["store"]["written_rows"].get("requests", 0),
                "status_after": after["status"],
                "problem_after": after["store"]["problem"],
            },
        }
    )
    recovered = (
        out["full"]["recovery"]["requests_rows_written_after"] - written_before >= rec["completed"]
        and after["store"]["problem"] is None
    )
    out["targets"] = {
        "no_failed_requests": out["full"]["failed"] == 0 and out["ample"]["failed"] == 0,
        "ratio_within_5pct": out["ratio_output_tok_s_median"] >= 0.95,
        "disk_filled": "disk_full" in problems,
        "dropped_equals_missing": sum(drops.values()) == missing,
        "recovered_after_space_freed": recovered,
    }
    write_result(out, OUT, "store_full_drill")
    print(
        f"full: sent {servers['full']['sent']}, recorded {recorded}, stored {stored}, missing "
        f"{missing}, dropped "
        f"{drops}; disk full first seen at {problems}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
