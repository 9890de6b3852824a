"""The live soak: a 30-minute timeline on the real engine (or through ``tokenmill proxy`` in front
of llama.cpp's ``llama-server``) with healthy stretches of several traffic shapes and fault
episodes between them, while the live diagnosis runs and a real Prometheus and Alertmanager
page a webhook. Scored from the store's ``findings`` table and the webhook's notifications.

    python benchmarks/live_soak.py [--target serve|llama] [--scale 1.0] [--out DIR]
    python benchmarks/live_soak.py --score DIR      # score a finished run again

For each fault episode: the first finding opened from its start to 3 periods after its end,
its rule (right when it is one of the episode's expected rules), the delay in periods from
the fault's first act (:func:`mark_first_acts`: the episode's start, or the first long prompt
or the first request over the tenant's limit where those come later; the delay from the
episode's start is kept beside it), when each of its findings resolved after the fault's end, and when the
webhook got the first firing alert. A healthy stretch runs from 3 periods after the previous
fault's end (the time a finding has to resolve) to the next fault's start; every finding opened
in one is a false alarm. Writes ``benchmarks/results/live_soak[_llama].json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb
import httpx

from tokenmill.bench.alerting import AlertingUnavailable, AlertStack
from tokenmill.bench.signal_drill import engine_core_pid

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PERIOD_S = 10.0
RESOLVE_ALLOWANCE = 3  # periods after a fault's end in which its findings may resolve
TENANTS = ("t0", "t1", "t2", "t3")
BURST_TENANT, BURST_RPM = "burst", 20
ADMIN_KEY = "soak-admin"
CHAT = ["--prompt-tokens", "uniform:32:128", "--output-tokens", "uniform:16:64"]
# the server: a KV pool that holds the healthy shapes and an overload's 16 running requests
# (13 blocks each) but not twelve long answers beside them; whole prefills, so a long prompt
# stalls the decodes beside it
SERVE_ARGS = ["--max-num-seqs", "16", "--num-gpu-blocks-override", "240",
              "--no-enable-chunked-prefill"]  # fmt: skip


def key(tenant: str) -> str:
    return f"soak-key-{tenant}"


@dataclass
class Episode:
    kind: str  # healthy | overload | neighbour | kv_pressure | tenant_limit | long_prompts | frozen
    shape: str
    start_ns: int = 0
    end_ns: int = 0
    expect: tuple[str, ...] = ()
    #: when the fault first acted, where later than ``start_ns`` (0: at the start)
    fault_ns: int = 0
    #: when the last request that arrived during the episode ended (0: none arrived): a queue
    #: the fault built drains after it stops, and a queue finding holds until then
    drained_ns: int = 0

    @property
    def acts_ns(self) -> int:
        return self.fault_ns or self.start_ns


#: (shape, healthy seconds, fault, fault seconds): each block runs its shape's traffic through
#: the healthy stretch and the fault laid on it
TIMELINE = (
    ("steady", 150, "overload", 90),
    ("clumped", 100, "neighbour", 90),
    ("procs", 100, "kv_pressure", 90),
    ("tenants", 100, "tenant_limit", 90),
    ("steady", 100, "long_prompts", 90),
    ("clumped", 100, "frozen", 60),
    ("procs", 100, "overload", 90),
    ("tenants", 100, "neighbour", 90),
    ("steady", 120, None, 0),
)
#: the rules that are the episode's cause (the first) or its direct symptom
EXPECT = {
    "overload": ("overload", "ttft_queueing"),
    "neighbour": ("host_contention",),
    "kv_pressure": ("kv_pressure_preemption", "ttft_queueing", "midstream_stall"),
    "tenant_limit": ("error_spike",),
    "long_prompts": ("itl_prefill_interference", "head_of_line_blocking", "ttft_prefill_bound"),
    "frozen": ("engine_stalled",),
}
#: what only our engine can be made to do (not through a proxy in front of llama-server)
ENGINE_ONLY = ("kv_pressure", "long_prompts")
#: the open-loop healthy shapes' arrival rates, x this per target. Healthy traffic is what the
#: server sustains: llama-server (4 slots, 2 threads) served about 1.15 requests/s of the chat
#: mix to 3 closed-loop clients here, and at 0.8 requests/s clumped or 1.2 across four tenants
#: its queue grew through stretches meant to be healthy (TTFT p50 8 s)
HEALTHY_RATE = {"serve": 1.0, "llama": 0.5}
#: the CPU hog's spinning processes per target. Four beside llama-server made requests wait
#: 18-54 s, and the queue took 18-22 s to drain after the hog stopped: the resolve delay then
#: measured the drain (a queue finding holds while requests still wait), not the loop
HOG_PROCS = {"serve": 4, "llama": 2}


# ----- traffic -----
def _bench(url: str, out: Path, name: str, args: list[str], tenant: str) -> subprocess.Popen:
    log = open(out / f"{name}.log", "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "bench", "--url", url,
           "--api-key", key(tenant), "--no-progress", "--out", str(out / f"{name}.json"),
           "--timeout", "300", *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def shape_traffic(
    shape: str, url: str, out: Path, span_s: float, seed: int, rate: float = 1.0
) -> list:
    """The shape's load generators for ``span_s`` seconds, open-loop rates x ``rate``."""
    # clients finish what they sent (a load generator cutting its requests at once would be a
    # spike of client disconnects of its own making)
    phase = ["--phases", f"steady:{span_s:g}s", "--drain-timeout", "60", *CHAT]
    if shape == "steady":
        return [_bench(url, out, f"{seed}-steady", ["--concurrency", "3", *phase,
                                                     "--seed", str(seed)], "t0")]  # fmt: skip
    if shape == "clumped":
        args = ["--request-rate", f"{0.8 * rate:g}", "--burstiness", "0.3", *phase,
                "--seed", str(seed)]  # fmt: skip
        return [_bench(url, out, f"{seed}-clumped", args, "t1")]
    if shape == "procs":
        return [
            _bench(
                url,
                out,
                f"{seed}-procs{i}",
                ["--concurrency", "1", *phase, "--seed", str(seed + i)],
                t,
            )
            for i, t in enumerate(TENANTS[:3])
        ]
    if shape == "tenants":
        return [
            _bench(
                url,
                out,
                f"{seed}-tenant{i}",
                ["--request-rate", f"{0.3 * rate:g}", *phase, "--seed", str(seed + i)],
                t,
            )
            for i, t in enumerate(TENANTS)
        ]
    raise ValueError(shape)


class Fault:
    """Start and stop one fault episode."""

    def __init__(
        self, kind: str, url: str, out: Path, span_s: float, seed: int, server, hog_procs: int
    ):
        self.kind, self.procs, self.server, self.stopped_pid = kind, [], server, None
        phase = ["--phases", f"steady:{span_s:g}s"]
        if kind == "overload":
            args = ["--request-rate", "5", *phase, "--drain-timeout", "30", *CHAT]
            self.procs = [_bench(url, out, f"{seed}-overload", [*args, "--seed", str(seed)], "t3")]
        elif kind == "neighbour":
            cmd = [sys.executable, "-m", "tokenmill.bench.cpu_hog", "--procs", str(hog_procs),
                   "--duration", f"{span_s:g}"]  # fmt: skip
            self.procs = [subprocess.Popen(cmd, start_new_session=True)]
        elif kind == "kv_pressure":
            # long answers to the healthy traffic's prompts: prompts longer than those would
            # be a second fault (a burst of longer prompts is ttft_prefill_bound's own case)
            args = ["--concurrency", "12", *phase, "--drain-timeout", "30",
                    "--prompt-tokens", CHAT[1], "--output-tokens", "uniform:250:350",
                    "--ignore-eos", "--seed", str(seed)]  # fmt: skip
            self.procs = [_bench(url, out, f"{seed}-kv", args, "t2")]
        elif kind == "tenant_limit":
            args = ["--request-rate", "1", *phase, "--drain-timeout", "30", *CHAT]
            self.procs = [_bench(url, out, f"{seed}-burst", [*args, "--seed", str(seed)],
                                 BURST_TENANT)]  # fmt: skip
        elif kind == "long_prompts":
            n = max(1, int(span_s // 10))
            args = [
                "--request-rate",
                "0.1",
                "--burstiness",
                "100",
                "--num-requests",
                str(n),
                "--prompt-tokens",
                "700",
                "--output-tokens",
                "1",
                "--seed",
                str(seed),
            ]
            self.procs = [_bench(url, out, f"{seed}-long", args, "t3")]
        elif kind == "frozen":
            self.stopped_pid = server.frozen_pid()
            os.kill(self.stopped_pid, signal.SIGSTOP)
        else:
            raise ValueError(kind)

    def stop(self) -> None:
        if self.stopped_pid is not None:
            os.kill(self.stopped_pid, signal.SIGCONT)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


# ----- the server under test -----
class Serve:
    """``tokenmill serve`` with the live diagnosis, tenants (one rate-limited) and open
    metrics."""

    def __init__(self, out: Path, port: int):
        self.out, self.port = out, port
        self.url = f"http://127.0.0.1:{port}"
        self.db = out / "soak.duckdb"
        tenants = tenants_file(out)
        cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port),
               "--trace-db", str(self.db), "--tenants", str(tenants), "--open-metrics",
               "--diagnose-every", f"{PERIOD_S:g}s", *SERVE_ARGS]  # fmt: skip
        self.proc = _start(cmd, out / "server.log", self.url)

    def frozen_pid(self) -> int:
        pid = engine_core_pid(self.proc.pid)
        if pid is None:
            raise RuntimeError("no engine core process found")
        return pid

    def stop(self) -> None:
        _stop(self.proc)


class LlamaProxy:
    """llama.cpp's ``llama-server`` (Q4_1 GGUF of the default model, 4 slots) behind ``tokenmill
    proxy`` with the live diagnosis and the same tenants (the proxy holds their limits); a
    frozen episode stops ``llama-server`` itself. The proxy's ``/metrics`` carry the finding
    series."""

    def __init__(self, out: Path, port: int):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from any_engine import llama_host_args, llama_server
        from vs_llamacpp import gguf_file

        self.out, self.port = out, port
        up_port = port + 1
        binary = llama_server()
        cmd = [str(binary), "-m", str(gguf_file()), "--host", "127.0.0.1", "--port", str(up_port),
               "-np", "4", "-c", "4096", "-t", "2", "-tb", "2", "--metrics",
               *llama_host_args()]  # fmt: skip
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
        self.upstream = _start(cmd, out / "llama.log", f"http://127.0.0.1:{up_port}", env=env)
        self.url = f"http://127.0.0.1:{port}"
        self.db = out / "soak.duckdb"
        cmd = [sys.executable, "-m", "tokenmill.engine.cli", "proxy", "--upstream",
               f"http://127.0.0.1:{up_port}/v1", "--port", str(port), "--trace-db", str(self.db),
               "--tenants", str(tenants_file(out)),
               "--diagnose-every", f"{PERIOD_S:g}s"]  # fmt: skip
        self.proc = _start(cmd, out / "proxy.log", self.url)

    def frozen_pid(self) -> int:
        return self.upstream.pid

    def stop(self) -> None:
        _stop(self.proc)
        _stop(self.upstream)


def tenants_file(out: Path) -> Path:
    """The tenants: four without limits, one held to ``BURST_RPM`` requests a minute, and the
    admin key."""
    tenants = out / "tenants.toml"
    lines = [f'[admin]\nkey_sha256 = "{_sha(ADMIN_KEY)}"\n']
    for t in TENANTS:
        lines.append(f'[tenants.{t}]\nkey_sha256 = "{_sha(key(t))}"\n')
    lines.append(
        f'[tenants.{BURST_TENANT}]\nkey_sha256 = "{_sha(key(BURST_TENANT))}"\n'
        f"requests_per_minute = {BURST_RPM}\n"
    )
    tenants.write_text("\n".join(lines))
    return tenants


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _start(cmd: list[str], log: Path, url: str, env: dict | None = None) -> subprocess.Popen:
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2:4]} exited: {log.read_text()[-400:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{url} did not start")
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----- the run -----
def run(target: str, out: Path, scale: float) -> list[Episode]:
    out.mkdir(parents=True, exist_ok=True)
    port = 18300
    server = Serve(out, port) if target == "serve" else LlamaProxy(out, port)
    episodes: list[Episode] = []
    try:
        try:
            stack = AlertStack(out / "alerting", [f"127.0.0.1:{port}"], scrape_s=5.0)
            stack.__enter__()
        except AlertingUnavailable as exc:
            print(f"no alerting: {exc}", flush=True)
            stack = None
        try:
            episodes = _timeline(server, target, out, scale)
            time.sleep(RESOLVE_ALLOWANCE * PERIOD_S + 5)
            alerts = stack.alerts() if stack is not None else []
        finally:
            if stack is not None:
                stack.__exit__(None, None, None)
    finally:
        server.stop()
    (out / "timeline.json").write_text(json.dumps([asdict(e) for e in episodes], indent=1))
    (out / "alerts.json").write_text(json.dumps(alerts, indent=1))
    return episodes


def _timeline(server, target: str, out: Path, scale: float) -> list[Episode]:
    episodes = []
    for seed, (shape, healthy_s, fault, fault_s) in enumerate(TIMELINE, start=1):
        if target != "serve" and fault in ENGINE_ONLY:
            fault, fault_s = None, 0
        healthy_s, fault_s = healthy_s * scale, fault_s * scale
        t0 = time.time_ns()
        print(f"{time.strftime('%H:%M:%S')} {shape}: healthy {healthy_s:.0f} s, then "
              f"{fault or 'nothing'} {fault_s:.0f} s", flush=True)  # fmt: skip
        traffic = shape_traffic(shape, server.url, out, healthy_s + fault_s, seed * 100,
                                HEALTHY_RATE[target])  # fmt: skip
        time.sleep(healthy_s)
        episodes.append(Episode("healthy", shape, t0, time.time_ns()))
        if fault is not None:
            ep = Episode(fault, shape, time.time_ns(), expect=EXPECT[fault])
            f = Fault(fault, server.url, out, fault_s, seed * 100 + 50, server, HOG_PROCS[target])
            time.sleep(fault_s)
            f.stop()
            ep.end_ns = time.time_ns()
            episodes.append(ep)
        for p in traffic:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
    return episodes


# ----- scoring -----
@dataclass
class EpisodeScore:
    kind: str
    shape: str
    expect: tuple[str, ...]
    first_rule: str | None = None
    right: bool = False
    delay_periods: float | None = None  # from the fault's first act
    delay_from_start_periods: float | None = None
    resolved_after_periods: list[float | None] = field(default_factory=list)
    #: seconds from the episode's end until the last request that arrived during it ended
    queue_drained_s: float | None = None
    rules_opened: list[str] = field(default_factory=list)
    alert_delay_s: float | None = None
    alert_rule: str | None = None


#: a fault's first act where the episode's start is not: the first long prompt (its load
#: generator waits one gap before it), the first request the tenant's limit refused (the
#: limiter lets its first BURST_RPM in) and the first preemption (the long answers fit in the
#: KV pool until they have grown: 20-25 s)
FIRST_ACT_SQL = {
    "kv_pressure": "SELECT min(start_ns) FROM engine_steps WHERE num_preempted > 0 "
    "AND start_ns BETWEEN ? AND ?",
    "long_prompts": "SELECT min(arrival_ns) FROM requests WHERE input_tokens >= 700 "
    "AND arrival_ns BETWEEN ? AND ?",
    "tenant_limit": f"SELECT min(arrival_ns) FROM requests WHERE tenant = '{BURST_TENANT}' "
    "AND http_status = 429 AND arrival_ns BETWEEN ? AND ?",
}


def mark_first_acts(db: Path, episodes: list[Episode]) -> None:
    """Set each episode's ``fault_ns`` from the store where its fault acts after its start, and
    its ``drained_ns``."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        for e in episodes:
            if e.kind in FIRST_ACT_SQL:
                ((t,),) = con.execute(FIRST_ACT_SQL[e.kind], [e.start_ns, e.end_ns]).fetchall()
                e.fault_ns = int(t) if t is not None else 0
            ((t,),) = con.execute(
                "SELECT max(end_ns) FROM requests WHERE arrival_ns BETWEEN ? AND ?",
                [e.start_ns, e.end_ns],
            ).fetchall()
            e.drained_ns = int(t) if t is not None else 0
    finally:
        con.close()


def findings_of(db: Path) -> list[dict]:
    """Each finding's latest state: rule, opened_ns, resolved_ns, severity; in the order they
    opened, those opened at one period in the loop's ranking (a finding no other explains
    first, then severity, then confidence, as of the period it opened)."""
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT finding_id, arg_max(rule, time_ns), max(opened_ns), max(resolved_ns), "
        "arg_max(severity, time_ns), "
        "arg_min(len(coalesce(explained_by, [])), time_ns) FILTER (WHERE status = 'open'), "
        "arg_min(confidence, time_ns) FILTER (WHERE status = 'open'), "
        "arg_min(severity, time_ns) FILTER (WHERE status = 'open') "
        "FROM findings GROUP BY finding_id ORDER BY 2"
    ).fetchall()
    con.close()
    keys = ("id", "rule", "opened_ns", "resolved_ns", "severity", "explained", "confidence",
            "open_severity")  # fmt: skip
    out = [dict(zip(keys, r)) for r in rows]
    rank = {"critical": 0, "warning": 1}
    return sorted(
        (f for f in out if f["opened_ns"]),
        key=lambda f: (
            f["opened_ns"],
            (f["explained"] or 0) > 0,
            rank.get(f["open_severity"], 2),
            -(f["confidence"] or 0),
        ),
    )


def score(episodes: list[Episode], findings: list[dict], alerts: list[dict]) -> dict:
    period_ns = int(PERIOD_S * 1e9)
    allowance = RESOLVE_ALLOWANCE * period_ns
    faults = [e for e in episodes if e.kind != "healthy"]
    scores, claimed = [], set()
    for e in faults:
        mine = [f for f in findings if e.start_ns <= f["opened_ns"] <= e.end_ns + allowance]
        claimed |= {f["id"] for f in mine}
        s = EpisodeScore(e.kind, e.shape, tuple(e.expect))
        s.rules_opened = [f["rule"] for f in mine]
        if e.drained_ns:
            s.queue_drained_s = round((e.drained_ns - e.end_ns) / 1e9, 1)
        if mine:
            first = mine[0]
            s.first_rule, s.right = first["rule"], first["rule"] in e.expect
            s.delay_periods = round((first["opened_ns"] - e.acts_ns) / period_ns, 2)
            s.delay_from_start_periods = round((first["opened_ns"] - e.start_ns) / period_ns, 2)
            s.resolved_after_periods = [
                round((f["resolved_ns"] - e.end_ns) / period_ns, 2) if f["resolved_ns"] else None
                for f in mine
            ]
        fired = [a for a in alerts if a["status"] == "firing" and a["at_ns"] >= e.start_ns
                 and a["at_ns"] <= e.end_ns + allowance]  # fmt: skip
        if fired:
            s.alert_delay_s = round((fired[0]["at_ns"] - e.acts_ns) / 1e9, 1)
            s.alert_rule = fired[0]["rule"]
        scores.append(s)
    healthy = []
    prev_end = None
    for e in episodes:
        if e.kind != "healthy":
            prev_end = e.end_ns
            continue
        start = e.start_ns if prev_end is None else max(e.start_ns, prev_end + allowance)
        healthy.append((start, e.end_ns, e.shape))
    false = [
        {**f, "shape": shape}
        for f in findings
        if f["id"] not in claimed
        for start, end, shape in healthy
        if start <= f["opened_ns"] < end
    ]
    delays = sorted(s.delay_periods for s in scores if s.delay_periods is not None)
    from_start = sorted(s.delay_from_start_periods for s in scores if s.delay_periods is not None)
    return {
        "episodes": [asdict(s) for s in scores],
        "episodes_n": len(scores),
        "kinds": sorted({s.kind for s in scores}),
        "right_first": sum(s.right for s in scores),
        "detected": sum(s.first_rule is not None for s in scores),
        "delay_median_periods": delays[len(delays) // 2] if delays else None,
        "delay_worst_periods": delays[-1] if delays else None,
        "delay_from_start_median_periods": from_start[len(from_start) // 2] if delays else None,
        "delay_from_start_worst_periods": from_start[-1] if delays else None,
        "healthy_stretches": len(healthy),
        "healthy_s": round(sum(end - start for start, end, _ in healthy) / 1e9),
        "false_findings": false,
        "alerts_fired": sum(a["status"] == "firing" for a in alerts),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("serve", "llama"), default="serve")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink every duration (smoke)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--score", type=Path, default=None, help="score a finished run's folder")
    a = ap.parse_args(argv)
    out = a.score or a.out or Path(f"/tmp/tokenmill-soak-{a.target}")
    if a.score is None:
        episodes = run(a.target, out, a.scale)
    else:
        episodes = [Episode(**{**e, "expect": tuple(e["expect"])})
                    for e in json.loads((out / "timeline.json").read_text())]  # fmt: skip
    alerts = json.loads((out / "alerts.json").read_text())
    mark_first_acts(out / "soak.duckdb", episodes)
    result = score(episodes, findings_of(out / "soak.duckdb"), alerts)
    result.update(target=a.target, scale=a.scale, period_s=PERIOD_S, host=_host())
    print(json.dumps({k: v for k, v in result.items() if k != "episodes"}, indent=1))
    for s in result["episodes"]:
        print(s)
    if a.scale == 1.0:
        name = "live_soak.json" if a.target == "serve" else "live_soak_llama.json"
        (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _host() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f" {f}" in flags]
    model = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines()
                  if ln.startswith("model name")), "?")  # fmt: skip
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa)}"


if __name__ == "__main__":
    sys.exit(main())
