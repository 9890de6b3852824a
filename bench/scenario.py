"""Symptom scenarios: start a real server with given flags, drive a workload with
``tokenmill bench``, stop the server, diagnose its trace store, and check that the expected rule
is the top finding (``healthy``: no finding at all; a scenario with ``absent``: none of those).

Scenarios are data: one YAML file per scenario in ``bench/scenarios/``::

    name: ttft_queueing
    case: C-overload                 # the symptom case it reproduces (C01-C08: docs/diagnosis.md)
    expect: [ttft_queueing, overload]   # top finding must be one of these; [] = healthy
    absent: [quantization_no_gain]   # with expect []: only these rules must stay silent
    server: ["--max-num-seqs", "4"]     # extra `tokenmill serve` flags
    proxy: false                     # put the 16 KB buffering proxy between client and server
    window: 5s                       # diagnosis window
    idle_s: 0                        # keep the server idle this long after the steps
    steps:                           # `tokenmill bench` argument lists, run one after another
      - ["--request-rate", "1", "--phases", "steady:20s,overload:20s@4x", ...]
    # or concurrent steps, each started at its offset (s) from the first:
    #   - {start_s: 0, args: [...]}
    #   - {start_s: 5, args: [...]}
    # "{scenarios}" in an argument is this folder (for datasets shipped next to the YAML)
    host_load:                       # noisy-neighbour drills (bench/cpu_hog.py), from the first step
      - {start_s: 20, duration_s: 20, procs: 2}                        # a CPU hog mid-run
      - {start_s: 0, duration_s: 60, procs: 2, every_s: 4, busy_s: 0.5}  # a periodic job
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import duckdb
import httpx
import yaml

from .buffering_proxy import BufferingProxy


class ScenarioError(Exception):
    """Unknown scenario, bad scenario file, or a server that would not start (one line)."""


@dataclass
class Scenario:
    name: str
    expect: list[str]
    steps: list[list[str] | dict]
    # with no expect: the rules that must not fire (others may); empty = nothing may fire
    absent: list[str] = field(default_factory=list)
    server: list[str] = field(default_factory=list)
    proxy: bool = False
    window: str = "5s"
    idle_s: float = 0.0
    case: str = ""
    description: str = ""
    # CPU hogs outside the server: {start_s, duration_s, procs[, every_s, busy_s]}
    host_load: list[dict] = field(default_factory=list)


def _files() -> dict[str, Path]:
    root = resources.files(__package__).joinpath("scenarios")
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".yaml")}


def list_scenarios() -> list[Scenario]:
    return [load(name) for name in sorted(_files())]


def _args(items) -> list[str]:
    folder = str(resources.files(__package__).joinpath("scenarios"))
    return [str(a).replace("{scenarios}", folder) for a in items]


def load(name: str) -> Scenario:
    """The scenario called ``name``.

    Raises:
        ScenarioError: no such scenario, or its file is malformed.
    """
    files = _files()
    if name not in files:
        raise ScenarioError(f"unknown scenario {name!r}; known: {', '.join(sorted(files))}")
    try:
        data = yaml.safe_load(files[name].read_text())
        return Scenario(
            name=data["name"],
            expect=list(data.get("expect") or []),
            absent=list(data.get("absent") or []),
            steps=[
                {"start_s": float(s.get("start_s", 0)), "args": _args(s["args"])}
                if isinstance(s, dict)
                else _args(s)
                for s in data["steps"]
            ],
            server=list(map(str, data.get("server") or [])),
            proxy=bool(data.get("proxy", False)),
            window=str(data.get("window", "5s")),
            idle_s=float(data.get("idle_s", 0)),
            case=str(data.get("case", "")),
            description=str(data.get("description", "")).strip(),
            host_load=[_host_load(h) for h in data.get("host_load") or []],
        )
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise ScenarioError(f"scenario file {files[name]} is malformed: {exc}") from None


def _host_load(h: dict) -> dict:
    """One ``host_load`` entry, checked (KeyError/TypeError/ValueError name what is wrong)."""
    extra = set(h) - {"start_s", "duration_s", "procs", "every_s", "busy_s"}
    if extra:
        raise ValueError(f"host_load: unknown key(s) {', '.join(sorted(extra))}")
    out = {
        "start_s": float(h.get("start_s", 0)),
        "duration_s": float(h["duration_s"]),
        "procs": int(h.get("procs", 1)),
        "every_s": None if h.get("every_s") is None else float(h["every_s"]),
        "busy_s": None if h.get("busy_s") is None else float(h["busy_s"]),
    }
    if out["duration_s"] <= 0 or out["procs"] < 1 or out["start_s"] < 0:
        raise ValueError("host_load: duration_s > 0, procs >= 1 and start_s >= 0 are needed")
    if out["every_s"] is not None and not (out["busy_s"] and 0 < out["busy_s"] <= out["every_s"]):
        raise ValueError("host_load: a periodic load needs 0 < busy_s <= every_s")
    return out


class _HostLoad:
    """The scenario's CPU hogs (``python -m tokenmill.bench.cpu_hog``), each started at its
    ``start_s`` after :meth:`start` in its own session (not the server's process tree), all
    killed by :meth:`stop`."""

    def __init__(self, loads: list[dict], out: Path, log):
        self.loads, self.out, self.log = loads, out, log
        self.procs: list[subprocess.Popen] = []
        self.timers: list[threading.Timer] = []
        self.lock = threading.Lock()
        self.stopped = False

    def _launch(self, i: int, h: dict) -> None:
        cmd = [sys.executable, "-m", "tokenmill.bench.cpu_hog", "--procs", str(h["procs"])]
        cmd += ["--duration", f"{h['duration_s']:g}"]
        if h["every_s"] is not None:
            cmd += ["--every", f"{h['every_s']:g}", "--busy", f"{h['busy_s']:g}"]
        with self.lock:
            if self.stopped:
                return
            self.log(f"host load {i + 1}: {' '.join(cmd[3:])}")
            self.procs.append(subprocess.Popen(cmd, start_new_session=True))

    def start(self) -> None:
        for i, h in enumerate(self.loads):
            t = threading.Timer(h["start_s"], self._launch, (i, h))
            t.daemon = True
            self.timers.append(t)
            t.start()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
        for t in self.timers:
            t.cancel()
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> dict:
    """``/health`` after the traffic (status, reasons, KV use), or the reason it failed."""
    try:
        return httpx.get(url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"status": "unreachable", "reasons": [str(exc)]}


def _tm(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.engine.cli", *args], **kw)


class _ProxyThread:
    """The buffering proxy on its own event loop thread."""

    def __init__(self, port: int):
        self.proxy = BufferingProxy("127.0.0.1", port)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.proxy.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _run_steps(sc: Scenario, target: str, out: Path, log) -> list[Path]:
    """Run the bench steps: plain lists one after another, dict steps concurrently from their
    ``start_s`` offsets. Returns the result files."""
    results: list[Path] = []
    concurrent = [s for s in sc.steps if isinstance(s, dict)]
    sequential = [s for s in sc.steps if not isinstance(s, dict)]
    base = [sys.executable, "-m", "tokenmill.engine.cli", "bench", "--url", target]
    for i, args in enumerate(sequential):
        res = out / f"bench-{i}.json"
        log(f"[{sc.name}] step {i + 1}/{len(sequential)}: tokenmill bench {' '.join(args)}")
        r = subprocess.run(
            [*base, *args, "--out", str(res), "--no-progress"], capture_output=True, text=True
        )
        (out / f"bench-{i}.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise ScenarioError(f"bench step {i + 1} failed: {r.stderr.strip()[-300:]}")
        results.append(res)
    procs = []
    t0 = time.monotonic()
    for i, step in enumerate(sorted(concurrent, key=lambda s: s["start_s"])):
        time.sleep(max(0.0, t0 + step["start_s"] - time.monotonic()))
        res = out / f"bench-c{i}.json"
        log(f"[{sc.name}] at {step['start_s']:g} s: tokenmill bench {' '.join(step['args'])}")
        logf = open(out / f"bench-c{i}.log", "w")  # noqa: SIM115
        cmd = [*base, *step["args"], "--out", str(res), "--no-progress"]
        procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT), logf, res))
    for i, (p, logf, res) in enumerate(procs):
        rc = p.wait()
        logf.close()
        if rc != 0:
            raise ScenarioError(f"concurrent bench step {i + 1} failed (exit {rc})")
        results.append(res)
    return results


def server_launch(
    sc: Scenario, out: Path, port: int, model: str | None = None
) -> tuple[list[str], Path, dict[str, str]]:
    """The ``tokenmill serve`` command for a scenario, the folder it runs in (``out``) and its
    environment. The server runs with ``cwd=out``, so every path it is given is made absolute
    first, against this process's working directory: ``--trace-db``, ``--model`` and a relative
    ``$TOKENMILL_HOME`` (before, a relative ``--out`` gave the server ``out/out/traces.duckdb``
    and "database does not exist")."""
    out = Path(out).resolve()
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port)]
    cmd += ["--trace-db", str(out / "traces.duckdb")]
    if model:
        cmd += ["--model", str(Path(model).expanduser().resolve())]
    env = dict(os.environ)
    if env.get("TOKENMILL_HOME"):
        env["TOKENMILL_HOME"] = str(Path(env["TOKENMILL_HOME"]).expanduser().resolve())
    return [*cmd, *sc.server], out, env


def start_server(
    cmd: list[str], out: Path, env: dict[str, str], url: str, log_name: str = "server.log"
) -> subprocess.Popen:
    """Start ``cmd`` in ``out`` (its output in ``out/log_name``) and wait until ``url/health``
    says ``ok``.

    Raises:
        ScenarioError: it exited first (its last log line), or 600 s passed.
    """
    with open(out / log_name, "w") as server_log:
        server = subprocess.Popen(
            cmd, stdout=server_log, stderr=subprocess.STDOUT, cwd=out, env=env
        )
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            tail = (out / log_name).read_text()[-500:].strip().splitlines()
            who = log_name.removesuffix(".log")
            raise ScenarioError(f"{who} exited: {tail[-1] if tail else 'no output'}")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return server
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise ScenarioError(f"{url} did not become healthy in 600 s")
        time.sleep(0.5)


def stop_server(server: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ctrl-C, then a kill after ``timeout_s``."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def verdict(expect: list[str], absent: list[str], found: list[str]) -> bool:
    """Whether a scenario passed, from its findings' rule ids in rank order: the top one is
    expected (``expect``); none of ``absent`` fired; or, with neither, nothing fired."""
    if expect:
        return bool(found) and found[0] in expect
    if absent:
        return not set(found) & set(absent)
    return not found


def run(name: str, out: Path, *, model: str | None = None, log=print) -> dict:
    """Run one scenario into ``out`` (server log, bench JSON, the store, result.json).

    Returns the result dict: ``passed``, ``top`` (rule id or None), ``expect``, findings with
    their evidence, the report's hints (``notes``; they never decide ``passed``).

    Raises:
        ScenarioError: unknown scenario, or the server did not start.
    """
    return run_scenario(load(name), out, model=model, log=log)


def run_scenario(sc: Scenario, out: Path, *, model: str | None = None, log=print) -> dict:
    """Run a scenario given as data (``run`` loads one by name; ``bench/corpus.py`` samples
    them); the result dict also holds ``steps_started_ns``, when the first bench step started.

    Raises:
        ScenarioError: the server did not start, or a bench step failed.
    """
    name = sc.name
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScenarioError(f"--out {out}: cannot make the folder: {exc.strerror}") from None
    port = _free_port()
    cmd, out, env = server_launch(sc, out, port, model)
    store = out / "traces.duckdb"
    for p in out.glob("traces.duckdb*"):
        p.unlink()
    log(f"[{name}] starting the server: tokenmill serve {' '.join(sc.server)}")
    url = f"http://127.0.0.1:{port}"
    server = start_server(cmd, out, env, url)
    proxy = None
    try:
        target = url
        if sc.proxy:
            proxy = _ProxyThread(port)
            target = f"http://127.0.0.1:{proxy.proxy.port}"
        host_load = _HostLoad(sc.host_load, out, lambda m: log(f"[{name}] {m}"))
        steps_started_ns = time.time_ns()
        host_load.start()
        try:
            results = _run_steps(sc, target, out, log)
        finally:
            host_load.stop()
        if sc.idle_s:
            log(f"[{name}] idle for {sc.idle_s:g} s")
            time.sleep(sc.idle_s)
        health = _health(url)
    finally:
        if proxy is not None:
            proxy.stop()
        stop_server(server)
    for res in results:  # the client's own TTFT next to the server's
        _tm("bench", "--from-results", str(res), "--record-to", str(store), capture_output=True)
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.telemetry.dump import parse_duration

    con = duckdb.connect(str(store), read_only=True)
    try:
        report = diagnose(con, window_s=parse_duration(sc.window))
    finally:
        con.close()
    top = report.findings[0].rule_id if report.findings else None
    passed = verdict(sc.expect, sc.absent, [f.rule_id for f in report.findings])
    result = {
        "scenario": name,
        "case": sc.case,
        "expect": sc.expect,
        "absent": sc.absent,
        "top": top,
        "passed": passed,
        "findings": [
            {
                "rule": f.rule_id,
                "severity": f.severity,
                "confidence": f.confidence,
                "summary": f.summary,
                "evidence": f.evidence,
            }
            for f in report.findings
        ],
        "notes": [n.to_json() for n in report.notes],
        "summary": report.summary,
        "health_after": health,
        "steps_started_ns": steps_started_ns,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result
