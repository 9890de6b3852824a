"""The stop-signal drill: a real ``tokenmill serve`` with streams open, stopped the ways operators
stop a server, and what each stop did to the streams and the processes.

One case starts a server in a session of its own (so "the process group" is the server's and
nothing else), opens :data:`STREAMS` streamed completions that cannot end early
(``ignore_eos``), waits until every one has its first token, then sends the case's signals:

- ``term_api`` — SIGTERM to the API process (an orchestrator's stop of the main pid);
- ``term_group`` — SIGTERM to the whole process group (systemd's ``KillMode=control-group``,
  ``kill -TERM -PGID``, a supervisor's group stop);
- ``int_group`` — SIGINT to the group (Ctrl-C in the terminal that runs the server);
- ``term_core`` — SIGTERM to the engine core process alone;
- ``term_twice`` — SIGTERM to the group, then another one :data:`SECOND_SIGNAL_AFTER_S` later
  ("stop now");
- ``kill_api`` — SIGKILL to the API process (the OOM killer, ``kill -9``).

Each stream ends one of three ways: ``completed`` (its finish reason and ``data: [DONE]``),
``error`` (an SSE error event, a non-200 answer, or a connection cut the client can see: an
incomplete chunked body), or ``silent`` (the body ended cleanly with neither: a truncated answer
that looks complete, the worst outcome). After the API process exits, the processes left in the
server's session are listed (engine cores and ranks must never outlive it).

While draining, a new request must get 503 with ``Retry-After`` and ``/health/ready`` 503:
the case records both as seen :data:`PROBE_AFTER_S` after the first signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

#: streams open when the first signal is sent
STREAMS = 8
#: tokens each stream asks for (ignore_eos): long enough to be open at the signal, short
#: enough that a drain completes them well inside the shutdown timeout
MAX_TOKENS = 96
#: seconds between the first and the second signal of ``term_twice``
SECOND_SIGNAL_AFTER_S = 1.0
#: seconds after the first signal at which readiness and a new request are probed
PROBE_AFTER_S = 0.3
#: seconds the API process's session is watched for leftovers after the API exits
LEFTOVER_GRACE_S = 5.0

#: case → the (target, signal) pairs it sends, in order
CASES: dict[str, tuple[tuple[str, str], ...]] = {
    "term_api": (("api", "SIGTERM"),),
    "term_group": (("group", "SIGTERM"),),
    "int_group": (("group", "SIGINT"),),
    "term_core": (("core", "SIGTERM"),),
    "term_twice": (("group", "SIGTERM"), ("group", "SIGTERM")),
    "kill_api": (("api", "SIGKILL"),),
}

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@dataclass
class StreamOutcome:
    """How one stream ended."""

    outcome: str = "silent"  # completed | error | silent
    tokens: int = 0
    detail: str = ""
    first_token: threading.Event = field(default_factory=threading.Event, repr=False)


@dataclass
class CaseResult:
    """One case's outcome: what the streams got, how the processes ended."""

    case: str
    signals: list[str]
    completed: int
    cut_with_error: int
    cut_silently: int
    exit_code: int | None
    leftover_processes: list[str]
    ready_status_while_stopping: int | None
    new_request_status_while_stopping: int | None
    new_request_retry_after: str | None
    seconds_to_exit: float | None
    details: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> list[tuple[int, str]]:
    """Processes of session ``sid`` (pid, command line), from ``/proc``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # the fields after the command name, which may hold spaces and parentheses
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(entry.name), cmd.strip()))
    return out


def _children(pid: int) -> list[int]:
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    kids: list[int] = []
    for t in threads:
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (t / "children").read_text().split()]
    return kids


def engine_core_pid(api_pid: int) -> int | None:
    """The engine core among the API process's children (multiprocessing's spawn runs it as
    ``python -c 'from multiprocessing.spawn import spawn_main …'``; its resource tracker is
    another child)."""
    for kid in _children(api_pid):
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            return kid
    return None


def _stream(
    url: str, model: str, out: StreamOutcome, index: int, request_id: str | None = None
) -> None:
    body = {
        "model": model,
        "prompt": f"{PROMPT} (story {index})",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    finished = done = False
    try:
        headers = {"x-request-id": request_id} if request_id else {}
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers=headers, timeout=180
        ) as r:
            if r.status_code != 200:
                out.outcome, out.detail = "error", f"HTTP {r.status_code}"
                out.first_token.set()
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out.outcome = "error"
                    out.detail = str(chunk["error"].get("code") or chunk["error"].get("type"))
                    continue
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        out.tokens += 1
                        out.first_token.set()
                    if choice.get("finish_reason"):
                        finished = True
    except httpx.HTTPError as exc:
        out.outcome, out.detail = "error", f"{type(exc).__name__}: {exc}"[:160]
    finally:
        out.first_token.set()
    if out.outcome != "error":
        out.outcome = "completed" if finished and done else "silent"


def _probe(url: str, model: str) -> tuple[int | None, int | None, str | None]:
    """/health/ready's status and a new request's status and Retry-After, while stopping."""
    ready = status = retry = None
    with contextlib.suppress(httpx.HTTPError):
        ready = httpx.get(url + "/health/ready", timeout=5).status_code
    try:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": model, "prompt": "hi", "max_tokens": 2},
            timeout=10,
        )
        status, retry = r.status_code, r.headers.get("retry-after")
    except httpx.HTTPError:
        pass
    return ready, status, retry


def run_case(
    case: str, workdir: Path, serve_args: tuple[str, ...] = (), shutdown_timeout: float = 60.0
) -> CaseResult:
    """Start a server, open the streams, send the case's signals, and report.

    ``serve_args``: extra ``tokenmill serve`` options (``--model DIR``, say)."""
    signals = CASES[case]
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"{case}.log"
    with open(log_path, "w") as log:
        cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port),
               "--trace-db", str(workdir / f"{case}.duckdb"), "--device-sample-interval", "0",
               "--shutdown-timeout", f"{shutdown_timeout:g}", *serve_args]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,  # its own process group and session: the "group" target
        )
    try:
        _wait_healthy(url, proc, log_path)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        outcomes = [StreamOutcome() for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=_stream, args=(url, model, o, i), daemon=True)
            for i, o in enumerate(outcomes)
        ]
        for t in threads:
            t.start()
        for o in outcomes:
            o.first_token.wait(300)
        core = engine_core_pid(proc.pid)
        t_signal = time.monotonic()
        probe: tuple[int | None, int | None, str | None] = (None, None, None)
        for i, (target, name) in enumerate(signals):
            if i:
                time.sleep(SECOND_SIGNAL_AFTER_S)
            sig = getattr(signal, name)
            if target == "group":
                os.killpg(proc.pid, sig)
            elif target == "core":
                if core is None:
                    raise RuntimeError("no engine core process found under the API process")
                os.kill(core, sig)
            else:
                os.kill(proc.pid, sig)
            if i == 0 and name != "SIGKILL":
                time.sleep(PROBE_AFTER_S)
                probe = _probe(url, model)
        for t in threads:
            t.join(240)
        try:
            code = proc.wait(shutdown_timeout + 60)
            seconds = time.monotonic() - t_signal
        except subprocess.TimeoutExpired:
            code, seconds = None, None
        leftovers = _leftovers(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for pid, _ in session_processes(proc.pid):  # never leave one behind ourselves
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return CaseResult(
        case=case,
        signals=[f"{name} to {target}" for target, name in signals],
        completed=sum(o.outcome == "completed" for o in outcomes),
        cut_with_error=sum(o.outcome == "error" for o in outcomes),
        cut_silently=sum(o.outcome == "silent" for o in outcomes),
        exit_code=code,
        leftover_processes=leftovers,
        ready_status_while_stopping=probe[0],
        new_request_status_while_stopping=probe[1],
        new_request_retry_after=probe[2],
        seconds_to_exit=None if seconds is None else round(seconds, 2),
        details=sorted({o.detail for o in outcomes if o.detail}),
    )


def _leftovers(sid: int) -> list[str]:
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while True:
        left = session_processes(sid)
        if not left or time.monotonic() > deadline:
            return [f"{pid} {cmd[:120]}" for pid, cmd in left]
        time.sleep(0.2)


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited at start: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).json()["status"] == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy within 300 s")


@dataclass
class CoreKillResult:
    """SIGKILL to the engine core under load (the kernel's OOM killer): how fast every open
    stream learned of it, how fast the server served again, and what the diagnoser said."""

    completed: int
    cut_with_error: int
    cut_silently: int
    seconds_to_last_error: float | None  # SIGKILL → the last cut stream's end
    seconds_to_recovery: float | None  # SIGKILL → /health ok and a request answered
    served_after: bool
    error_codes: list[str]
    first_finding: str | None
    finding_summary: str | None
    cut_request_ids: list[str]  # the streams' x-request-id
    named_in_finding: int  # how many of them the finding names

    def to_dict(self) -> dict:
        return asdict(self)


def run_core_kill(workdir: Path, serve_args: tuple[str, ...] = ()) -> CoreKillResult:
    """Start a server, open the streams, SIGKILL the engine core once every stream has its
    first token, time the streams' ends and the recovery, stop the server (SIGTERM), then
    diagnose its store."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    db = workdir / "core_kill.duckdb"
    log_path = workdir / "core_kill.log"
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--port", str(port),
           "--trace-db", str(db), "--device-sample-interval", "0", *serve_args]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True
        )
    ids = [f"drill-kill-{i}" for i in range(STREAMS)]
    try:
        _wait_healthy(url, proc, log_path)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        outcomes = [StreamOutcome() for _ in range(STREAMS)]
        ended = [0.0] * STREAMS

        def one(i: int) -> None:
            _stream(url, model, outcomes[i], i, request_id=ids[i])
            ended[i] = time.monotonic()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for o in outcomes:
            o.first_token.wait(300)
        core = engine_core_pid(proc.pid)
        if core is None:
            raise RuntimeError("no engine core process found under the API process")
        t_kill = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(120)
        recovery = None
        served = False
        deadline = t_kill + 120
        while time.monotonic() < deadline and not served:
            try:
                if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                    r = httpx.post(
                        url + "/v1/completions",
                        json={"model": model, "prompt": "Hello", "max_tokens": 4},
                        timeout=60,
                    )
                    served = r.status_code == 200
            except (httpx.HTTPError, ValueError):
                pass
            if served:
                recovery = time.monotonic() - t_kill
            else:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    diagnose = [sys.executable, "-m", "tokenmill.engine.cli", "diagnose", "--db", str(db),
                "--format", "json"]  # fmt: skip
    report = json.loads(
        subprocess.run(
            diagnose,
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        or "{}"
    )
    first = (report.get("findings") or [None])[0]
    text = json.dumps(first) if first else ""
    cut = [ids[i] for i, o in enumerate(outcomes) if o.outcome == "error"]
    errors_end = [ended[i] - t_kill for i, o in enumerate(outcomes) if o.outcome == "error"]
    return CoreKillResult(
        completed=sum(o.outcome == "completed" for o in outcomes),
        cut_with_error=len(cut),
        cut_silently=sum(o.outcome == "silent" for o in outcomes),
        seconds_to_last_error=round(max(errors_end), 2) if errors_end else None,
        seconds_to_recovery=None if recovery is None else round(recovery, 2),
        served_after=served,
        error_codes=sorted({o.detail for o in outcomes if o.detail}),
        first_finding=first.get("rule") if first else None,
        finding_summary=first.get("summary") if first else None,
        cut_request_ids=cut,
        named_in_finding=sum(i in text for i in cut),
    )
