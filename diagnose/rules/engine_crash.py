"""``engine_crash``: an engine core process died under traffic and cut its requests."""

from __future__ import annotations

import json

from ..signals import Signals
from ._common import Alert, Evidence, Param, Rule, _clock

#: how many of the cut requests the summary names (all of them are the finding's examples)
NAMED = 8

# the rule's causes, in RULE.causes order
_OOM, _NATIVE, _STOPPED, _ERROR = range(4)
_FIRST_CAUSE = {"SIGKILL": _OOM, "SIGSEGV": _NATIVE, "SIGABRT": _NATIVE, "SIGBUS": _NATIVE}


def _crashes(sig: Signals) -> list[tuple[int, dict]]:
    rows = sig.con.execute(
        "SELECT time_ns, attributes FROM events WHERE kind = 'engine_crash' "
        "AND time_ns >= ? AND time_ns < ? ORDER BY time_ns",
        [sig.start_ns, sig.end_ns],
    ).fetchall()
    out = []
    for t, attrs in rows:
        try:
            d = json.loads(attrs or "{}")
        except ValueError:
            d = {}
        out.append((t, d if isinstance(d, dict) else {}))
    return out


def _restarted_ns(sig: Signals, after_ns: int) -> int | None:
    (t,) = sig.con.execute(
        "SELECT min(time_ns) FROM events WHERE kind = 'engine_restart' AND time_ns >= ?",
        [after_ns],
    ).fetchone()
    return t


def _cut(sig: Signals, ids: list[str], at_ns: int, slack_ns: int) -> list[tuple[str, str]]:
    """The requests the crash ended: ``(request_id, the client's id or the request id)``, by
    the ids the crash event lists, else by ``engine_died`` errors ending around it."""
    if ids:
        where, params = "request_id IN ?", [ids]
    else:  # an event from before the ids were recorded
        where = "error_type = 'engine_died' AND end_ns BETWEEN ? AND ?"
        params = [at_ns - slack_ns, at_ns + slack_ns]
    return sig.con.execute(
        f"SELECT request_id, coalesce(client_request_id, request_id) FROM requests "
        f"WHERE {where} ORDER BY arrival_ns",
        params,
    ).fetchall()


def detect(sig: Signals, p: dict) -> Evidence | None:
    crashes = _crashes(sig)
    if len(crashes) < p["min_crashes"]:
        return None
    slack_ns = int(p["cut_slack_s"] * 1e9)
    cut: list[tuple[str, str]] = []
    parts = []
    for t, d in crashes:
        mine = _cut(sig, [str(i) for i in d.get("cut_requests") or []], t, slack_ns)
        cut += mine
        how = f"killed by {d['signal']}" if d.get("signal") else f"exited {d.get('exit_code')}"
        back = _restarted_ns(sig, t)
        restart = f", back in {(back - t) / 1e9:.1f} s" if back is not None else ", not restarted"
        where = f"{d['replica']} " if d.get("replica") else ""
        parts.append(f"{where}{how} at {_clock(t)} UTC cutting {len(mine)} requests{restart}")
    d = crashes[-1][1]
    ended_by = d.get("signal") or ""
    if ended_by in _FIRST_CAUSE:
        first = _FIRST_CAUSE[ended_by]
    else:
        first = _ERROR if d.get("exit_code") else _STOPPED
    causes = (RULE.causes[first], *(c for i, c in enumerate(RULE.causes) if i != first))
    names = [shown for _, shown in cut]
    named = ", ".join(names[:NAMED]) + (
        f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    )
    summary = (
        f"the engine core died {len(crashes)} time{'s' if len(crashes) > 1 else ''}: "
        + "; ".join(parts)
        + (f"; the requests cut: {named}" if names else "")
    )
    return Evidence(
        summary,
        {
            "crashes": len(crashes),
            "cut_requests": len(cut),
            "cut_request_ids": names,
            "signal": d.get("signal"),
            "exit_code": d.get("exit_code"),
            "last_step_id": d.get("last_step_id"),
        },
        (crashes[0][0] - slack_ns, crashes[-1][0] + slack_ns),
        "request_id IN ?" if cut else None,
        [[rid for rid, _ in cut]] if cut else [],
        "critical",
        0.95,
        causes=causes,
    )


RULE = Rule(
    id="engine_crash",
    own_test="an engine core's exit under traffic is recorded, not estimated (absolute)",
    title="the engine core died and cut its requests",
    symptom="open streams end with engine_died at once; the engine core restarts",
    causes=(
        "the kernel's OOM killer (SIGKILL): host memory ran out (the KV pool, the model and "
        "other processes together)",
        "a fault in native code (SIGSEGV, SIGABRT, SIGBUS): a kernel, a library, the hardware",
        "someone or something stopped the core (a supervisor, kill -9, a container limit)",
        "an error in the engine that ended its process (its log has the traceback)",
    ),
    checks=(
        "the crash event's signal and exit code; dmesg for 'Out of memory: Killed process'",
        "the core's RSS and the host's memory in device_samples before the crash",
        "the server log around the crash's time",
    ),
    knob="for an OOM kill a smaller KV pool (--kv-cache-memory on a CPU, "
    "--gpu-memory-utilization on a GPU) or a host with more memory; for a fault, the log and a "
    "bug report",
    params={
        "min_crashes": Param(1, "one engine core dying under traffic is an incident"),
        "cut_slack_s": Param(
            10.0, "seconds around a crash in which its cut requests end (older stores)"
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("error_spike",),
    evidence_signals=("error_rate",),
    alert=Alert(
        name="TokenmillEngineCrash",
        expr="sum by ($by) (increase(tokenmill_engine_restarts_total[$window])) >= $min_crashes",
        value="engine core restarts",
        unit="x",
        for_="0m",
        severity="critical",
    ),
    reads=("completions",),
    needs={
        "requests": ("request_id", "client_request_id", "error_type", "end_ns", "arrival_ns"),
    },
)
