"""``engine_stalled``: the engine (or a proxy's upstream) has made no progress for many seconds
while requests wait on it, and nothing else on the host explains it.

A live store shows it while it stands (``signals/queue_now.py``): either the engine's step in
progress has lasted ``stall_s`` or more and ``step_rise`` x its usual step, with requests
running or waiting, or (a proxy's store, which has no engine steps) requests have waited
``stall_s`` or more for their first token while no request made a token since; in both, the
host is not busy outside the server (a busy host is ``host_contention``). A process that
is alive but stopped (``SIGSTOP``, a debugger, a container freeze), hung in a system call or a
collective, or deadlocked looks like this; a dead one is ``engine_crash``, a busy host
``host_contention``.
"""

from __future__ import annotations

from ..signals import Signals, last_stream_token_ns, open_step, waiting_now
from ._common import Evidence, Param, Rule, _ms
from .host_contention import others_cpu_pct

_LAST_TOKEN_SQL = """
SELECT max(greatest(coalesce(last_token_ns, 0), coalesce(first_token_ns, 0))) FROM requests
WHERE end_ns >= ?
"""
# the proxy's start event names its upstream (proxy/cli.py)
_UPSTREAM_SQL = """
SELECT attributes->>'upstream' FROM events WHERE kind = 'proxy_start' ORDER BY time_ns DESC LIMIT 1
"""


def _upstream(sig: Signals) -> str | None:
    rows = sig.con.execute(_UPSTREAM_SQL).fetchall()
    return rows[0][0] if rows else None


def _stalled_step(sig: Signals, p: dict) -> Evidence | None:
    """Our engine: one step open for ``stall_s`` and ``step_rise`` x the usual, host calm."""
    step = open_step(sig)
    if step is None:
        return None
    usual = sig.baseline.get("step_ms_p50") or step.pace_ms or 0.0
    if step.lasted_ms < max(p["stall_s"] * 1000, p["step_rise"] * usual):
        return None
    others = others_cpu_pct(sig, step.start_ns, step.now_ns)
    if others is not None and others >= p["others_cpu_pct"]:
        return None  # the host is busy elsewhere: host_contention's to say
    waiting = [x for x in waiting_now(sig) if x.at_ns >= step.start_ns]
    return Evidence(
        f"the engine core has made no step for {_ms(step.lasted_ms)} "
        f"({step.lasted_ms / max(usual, 1e-9):.0f}x its usual {_ms(usual)}) with "
        f"{step.running} request(s) running and {len(waiting)} waiting for a first token, while "
        "the host is otherwise idle: the core is stopped, hung or deadlocked",
        {
            "silent_ms": step.lasted_ms,
            "usual_step_ms": usual,
            "running_requests": step.running,
            "waiting_requests": len(waiting),
            "cpu_others_pct": others,
        },
        (step.start_ns, step.now_ns),
        severity="critical",
        confidence=0.9,
    )


def _stalled_upstream(sig: Signals, p: dict) -> Evidence | None:
    """Any engine behind a proxy: requests waited ``stall_s`` for a first token and no
    request made a token in that time (neither one that ended nor an open stream)."""
    waiting = waiting_now(sig)
    if not waiting:
        return None
    latest = max(x.at_ns for x in waiting)
    longest = max(x.wait_ms for x in waiting if x.at_ns == latest)
    if longest < p["stall_s"] * 1000:
        return None
    since = latest - int(p["stall_s"] * 1e9)
    (token,) = sig.con.execute(_LAST_TOKEN_SQL, [since]).fetchone()
    if token is not None and token >= since:
        return None
    streaming = last_stream_token_ns(sig, since)  # an open stream made a token meanwhile
    if streaming is not None and streaming >= since:
        return None
    others = others_cpu_pct(sig, since, latest)
    if others is not None and others >= p["others_cpu_pct"]:
        return None  # the host is busy elsewhere: host_contention's to say
    stuck = [x for x in waiting if x.at_ns == latest]
    upstream = _upstream(sig)
    who = f"the upstream {upstream}" if upstream else "the engine"
    return Evidence(
        f"{who} has answered no token for {_ms(longest)}: {len(stuck)} request(s) wait for a "
        "first token and none made one since; it is stopped, hung or unreachable",
        {
            "silent_ms": longest,
            "longest_wait_ms": longest,
            "cpu_others_pct": others,
            "waiting_requests": len(stuck),
            "upstream": upstream,
            "waiting_request_ids": [x.request_id for x in stuck[:5]],
        },
        (latest - int(longest * 1e6), latest),
        severity="critical",
        confidence=0.85,
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    return _stalled_step(sig, p) or _stalled_upstream(sig, p)


RULE = Rule(
    id="engine_stalled",
    own_test="no progress at all for stall_s with work waiting is absolute, not a comparison",
    title="the engine has stopped making progress",
    symptom="streams stop mid-answer and new requests get no first token, yet nothing crashed "
    "and the host is idle",
    causes=(
        "the engine process is stopped (SIGSTOP, a debugger, a frozen container or cgroup)",
        "it is hung in a system call, a device call or a collective that never returns",
        "a deadlock in the engine or its front (a lock, a full pipe nobody reads)",
        "behind a proxy: the upstream is unreachable or stopped, with its connections open",
    ),
    checks=(
        "the process state: `ps -o pid,stat,wchan -p PID` (T: stopped; D: in the kernel)",
        "`py-spy dump --pid PID` (or gdb) for where its threads wait",
        "/health: `stalled` or `degraded` with the engine core silent",
    ),
    knob="resume or restart the engine process (SIGCONT, or a restart); --engine-stall-unavailable "
    "makes /health/ready fail sooner so a balancer routes around it",
    params={
        "stall_s": Param(10.0, "far beyond any step of this engine: a 2k-token prefill takes ~5 s"),
        "step_rise": Param(20.0, "twenty usual steps without one ending"),
        "others_cpu_pct": Param(
            20.0, "host_contention's bar for a busy neighbour: a busy host is its finding"
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("ttft_queueing", "midstream_stall", "error_spike"),
    evidence_signals=("ttft_p99", "step_ms_p99"),
    reads=("requests", "steps"),
    needs={
        "requests": ("request_id", "arrival_ns", "end_ns", "first_token_ns", "last_token_ns"),
        "events": ("kind", "time_ns", "attributes"),
        "engine_steps": (
            "num_finished",
            "oldest_wait_id",
            "oldest_wait_ms",
            "oldest_wait_prompt_tokens",
        ),
        "waiting_samples": ("prompt_tokens", "request_id", "time_ns", "wait_ms"),
        "stream_samples": ("last_token_ns", "time_ns"),
        "device_samples": ("cpu_others_pct", "loadgen_cpu_pct", "steal_pct"),
    },
)
