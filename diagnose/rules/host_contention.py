"""``host_contention``: the same work got slower while something outside the server used the
machine (the noisy neighbour).

The engine's steps are compared with themselves: a step is set against the quickest quarter of
the dump's steps that did the same work (same batch, tokens in the same power of two;
``same_work_slowdown`` in :mod:`..signals`), so a bigger batch or a longer prompt never reads as
contention. Another engine behind ``tokenmill proxy`` has no steps in the store: its requests'
time per output token is compared instead, at the same number of streams decoding beside them
(the ``same_work`` family's request fallback), and the proxy's host samples count the
upstream's process as the server's own when it listens on the same host. The host sampler says who else was busy: ``cpu_others_pct`` (CPU used outside the
server's process tree), ``steal_pct`` (a hypervisor giving the vCPU to another guest) and, on a
GPU, ``other_processes`` (processes on the same device that are not the server's).
"""

from __future__ import annotations

import json
import statistics

from ..signals import (
    Signals,
    Window,
    has_open_streams,
    host_loadgen_sql,
    open_step,
    ran_from_requests,
    waiting_now,
    work_ratios_sql,
)
from ..stats import against_bound, compare
from ._common import (
    Evidence,
    Hint,
    Param,
    Rule,
    _confidence,
    _in_window,
    _ms,
    _when,
)

# the busiest processes outside the server in a time range, from the host samples' census
_BUSY_SQL = """
SELECT busy_others FROM device_samples
WHERE kind = 'host' AND time_ns >= ? AND time_ns < ? AND busy_others IS NOT NULL
"""


# CPU % used outside the server, less tokenmill's own load generator's, over a time range
_OTHERS_SQL = """
SELECT avg(greatest(cpu_others_pct - coalesce(loadgen_cpu_pct, 0), 0)), avg(steal_pct)
FROM device_samples WHERE kind = 'host' AND time_ns >= ? AND time_ns <= ?
"""


def others_cpu_pct(sig: Signals, start_ns: int, end_ns: int) -> float | None:
    """CPU % used outside the server (less the load generator's) over ``[start_ns, end_ns]``,
    the mean of the host samples; None without any."""
    return sig.con.execute(_OTHERS_SQL, [start_ns, end_ns]).fetchone()[0]


def _others(w: Window) -> float:
    """CPU % used outside the server, less tokenmill's own load generator's share."""
    return max(0.0, (w.get("cpu_others_mean") or 0) - (w.get("loadgen_cpu_mean") or 0))


def _from_requests(sig: Signals) -> bool:
    """Whether the same-work ratios came from requests (a store without steps)."""
    return ran_from_requests(sig.sources)


def _same_work(sig: Signals) -> str:
    """What was compared, in words."""
    if _from_requests(sig):
        return "the upstream's time per output token at the same number of streams"
    return "engine steps doing the same work (same batch and tokens)"


def _neighbour(sig: Signals, w: Window, p: dict) -> bool:
    if sig.device_kind == "gpu":
        return (w.get("other_processes_max") or 0) >= 1
    return _others(w) >= p["others_cpu_pct"] or (w.get("steal_mean") or 0) >= p["steal_pct"]


def busy_processes(sig: Signals, start_ns: int, end_ns: int, *, loadgen: bool = False) -> list:
    """The processes outside the server that used the CPU in ``[start_ns, end_ns)``, busiest
    first: ``{"pid", "command", "cpu_pct"}`` with ``cpu_pct`` the mean over the host samples
    of the range (0 where a sample did not list it); tokenmill's own load generator only with
    ``loadgen`` (then only it). Empty for a store without the census."""
    try:
        rows = sig.con.execute(_BUSY_SQL, [start_ns, end_ns]).fetchall()
    except Exception:  # a store written before the census: no such column
        return []
    seen: dict[tuple, list[float]] = {}
    for (text,) in rows:
        for d in json.loads(text or "[]"):
            if bool(d.get("load_generator")) != loadgen:
                continue
            seen.setdefault((d["pid"], d["command"]), []).append(float(d["cpu_pct"]))
    n = max(1, len(rows))
    out = [
        {"pid": pid, "command": cmd, "cpu_pct": round(sum(v) / n, 1)}
        for (pid, cmd), v in seen.items()
    ]
    return sorted(out, key=lambda d: -d["cpu_pct"])[:5]


def _who_on_cpu(others: float, named: list, steal: float | None) -> str:
    """Who else used the CPU, in words: the share outside the server, the busiest processes
    (``busy_processes``), the hypervisor's steal where there was any."""
    who = f"processes outside the server used {others:.0f}% of the CPU"
    if named:
        who += (
            " ("
            + ", ".join(f"pid {d['pid']} `{d['command']}` {d['cpu_pct']:.0f}%" for d in named[:3])
            + ")"
        )
    if (steal or 0) >= 1:
        who += f" and the hypervisor stole {steal:.0f}%"
    return who


# the last host sample at or before a time in which nothing outside the server (less the load
# generator) was busy: the neighbour's quiet side
_CALM_SQL = """
SELECT max(time_ns) FROM device_samples
WHERE kind = 'host' AND time_ns >= ? AND time_ns <= ?
  AND greatest(cpu_others_pct - coalesce(loadgen_cpu_pct, 0), 0) < ?
  AND coalesce(steal_pct, 0) < ?
"""
# the median of the last five steps that ended by a time
_PACE_BY_SQL = """
SELECT median(ms) FROM (SELECT (end_ns - start_ns) / 1e6 AS ms FROM engine_steps
                        WHERE start_ns >= ? AND end_ns <= ? ORDER BY end_ns DESC LIMIT 5)
"""


def _pace_before_neighbour(sig: Signals, now_ns: int, p: dict) -> float | None:
    """The engine's pace before the neighbour got busy: the median of the last five steps that
    ended by the last host sample without it. Steps the neighbour already stretched are the
    symptom, not the engine's own pace (a hog that makes every step 3 s makes the steps just
    before the open one 3 s too). None without such a sample or such steps."""
    (calm,) = sig.con.execute(
        _CALM_SQL, [sig.since_ns, now_ns, p["others_cpu_pct"], p["steal_pct"]]
    ).fetchone()
    if calm is None:
        return None
    return sig.con.execute(_PACE_BY_SQL, [sig.since_ns, calm]).fetchone()[0]


def _slow_now(sig: Signals, p: dict) -> Evidence | None:
    """The symptom while the slowed step still runs (a live store, ``signals/queue_now.py``): a
    CPU hog can stretch one decode step from 0.1 s to 5 s, and a step is stored when it ends.
    The engine has been in one step ``open_step_rise`` x both its usual decode step and the
    steps just before the neighbour got busy (or just before it, without host samples of the
    neighbour's quiet side), no prompt of ``prefill_tokens`` or more was waiting when it began (a
    long prefill is a slow step of its own), and processes outside the server used the CPU
    meanwhile."""
    if sig.device_kind == "gpu":
        return None
    step = open_step(sig)
    base = sig.baseline.get("decode_step_ms_p50") or sig.overall.get("decode_step_ms_p50")
    if step is None or not base:
        return None
    pace = _pace_before_neighbour(sig, step.now_ns, p)
    usual = max(base, step.pace_ms if pace is None else pace)
    if step.lasted_ms < p["open_step_rise"] * usual:
        return None
    if any(
        (x.prompt_tokens or 0) >= p["prefill_tokens"] and x.queued_ns <= step.start_ns
        for x in waiting_now(sig)
        if x.at_ns >= step.start_ns
    ):
        return None
    others, steal = sig.con.execute(_OTHERS_SQL, [step.start_ns, step.now_ns]).fetchone()
    if (others or 0) < p["others_cpu_pct"] and (steal or 0) < p["steal_pct"]:
        return None
    r = step.lasted_ms / usual
    named = busy_processes(sig, step.start_ns, step.now_ns)
    who = _who_on_cpu(others, named, steal)
    return Evidence(
        f"the engine has been in one step for {_ms(step.lasted_ms)}, {r:.0f}x "
        + ("the steps before it" if pace is None else "its steps before the neighbour")
        + f" ({_ms(usual)}), with {step.running} request(s) running and no long prompt "
        f"waiting, while {who}; the step has not ended yet",
        {
            "open_step_ms": step.lasted_ms,
            "usual_step_ms": usual,
            "running_requests": step.running,
            "cpu_others_pct": others,
            "steal_pct": steal,
            "busy_processes": named,
        },
        (step.start_ns, step.now_ns),
        None,
        [],
        "critical" if r >= 2 * p["open_step_rise"] else "warning",
        _confidence(r / p["open_step_rise"]),
        support=against_bound(
            [r],
            p["open_step_rise"],
            unit="steps",
            reference_name="the open step over "
            + ("the steps before it" if pace is None else "the steps before the neighbour")
            + f", against {p['open_step_rise']:g} (open_step_rise)",
            min_n=1,
            why_one="one step stretched this far with the host busy elsewhere is the symptom",
        ),
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    return _slow_steps(sig, p) or _slow_now(sig, p) or _sustained(sig, p)


def _sustained(sig: Signals, p: dict) -> Evidence | None:
    """A moderate neighbour: the windows in which processes outside the server were busy,
    together ``sustained_s`` or longer, ran the same work ``moderate_slowdown`` x slower than
    the windows without one (each step over the quickest quarter of its work, the neighbour's
    windows' steps against the quiet windows', a bootstrap interval of the ratio of medians;
    an interval reaching below the bound, or an effect of only ``noticeable_slowdown``, lists
    it as inconclusive, with its numbers, never as healthy). Far from ``slowdown`` x the
    quickest steps, but a fifth or more off every token for as long as the neighbour runs."""
    if sig.device_kind == "gpu":
        return None
    ran = [x for x in sig.windows if x.get("same_work_slowdown") is not None]
    busy = [x for x in ran if _neighbour(sig, x, p)]
    quiet = [x for x in ran if not _neighbour(sig, x, p)]
    if not busy or not quiet or len(busy) * sig.window_s < p["sustained_s"]:
        return None
    ratios = sig.con.execute(
        work_ratios_sql(
            sig.decode_seqs_sql,
            sig.reference_spans,
            from_requests=_from_requests(sig),
            streams=_from_requests(sig) and has_open_streams(sig.con),
            host=host_loadgen_sql(sig.con),
        ),
        {"since": sig.since_ns, "until": sig.until_ns},
    ).fetchall()

    def inside(ws: list[Window]) -> list[float]:
        return [r for t, r in ratios if any(x.start_ns <= t < x.end_ns for x in ws)]

    during, without = inside(busy), inside(quiet)
    support = compare(
        during,
        without,
        unit="steps",
        reference_name="the same work's step time in the windows without a neighbour",
        min_effect=p["moderate_slowdown"],
        min_n=10,
        persistence=f"{len(busy)} windows ({len(busy) * sig.window_s:g} s) with a neighbour",
    )
    if support.effect is None or support.effect < p["noticeable_slowdown"]:
        return None
    start, end = busy[0].start_ns, busy[-1].end_ns
    others = statistics.mean(_others(x) for x in busy)
    named = busy_processes(sig, start, end)
    steal = statistics.mean(x.get("steal_mean") or 0 for x in busy)
    return Evidence(
        f"{_same_work(sig)} took {support.effect:.2f}x as long in the "
        f"{len(busy)} windows ({len(busy) * sig.window_s:g} s) in which "
        f"{_who_on_cpu(others, named, steal)}, against the windows without a neighbour",
        {
            "same_work_vs_quiet": support.effect,
            "same_work_vs_quiet_ci_low": support.ci_low,
            "neighbour_windows": len(busy),
            "quiet_windows": len(quiet),
            "cpu_others_pct": others,
            "busy_processes": named,
            "steal_pct": steal,
        },
        (start, end),
        "first_token_ns < ? AND last_token_ns > ?",
        [end, start],
        "warning",
        _confidence(support.effect / p["moderate_slowdown"]),
        support=support,
    )


def _slow_steps(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        return (w.get("same_work_slowdown") or 0) >= p["slowdown"] and _neighbour(sig, w, p)

    # every window in which steps ran, not only those with arrivals or completions: a hog that
    # slows steps 20x leaves windows where no request starts or ends
    ran = [x for x in sig.windows if x.get("same_work_slowdown") is not None]
    w = max((x for x in ran if hit(x)), key=lambda x: x.get("same_work_slowdown"), default=None)
    if w is None:
        return None
    quiet = [x for x in ran if not _neighbour(sig, x, p)]
    quiet_slowdown = min((x.get("same_work_slowdown") for x in quiet), default=None)
    slow = w.get("same_work_slowdown")
    if sig.device_kind == "gpu":
        who = f"{w.get('other_processes_max'):.0f} other process(es) on the GPU"
    else:
        who = _who_on_cpu(
            _others(w), busy_processes(sig, w.start_ns, w.end_ns), w.get("steal_mean")
        )
        if w.get("run_queue_mean") is not None:
            who += f" (run queue {w.get('run_queue_mean'):.1f})"
    return Evidence(
        f"{_same_work(sig)} took {slow:.1f}x as long as at its quickest in {_when(w)} "
        f"while {who}"
        + (
            f"; windows without a neighbour ran at {quiet_slowdown:.1f}x"
            if quiet_slowdown is not None
            else ""
        ),
        {
            "same_work_slowdown": slow,
            "quiet_same_work_slowdown": quiet_slowdown,
            "cpu_others_pct": _others(w),
            "load_generator_cpu_pct": w.get("loadgen_cpu_mean"),
            "busy_processes": busy_processes(sig, w.start_ns, w.end_ns)
            if sig.device_kind != "gpu"
            else None,
            "steal_pct": w.get("steal_mean"),
            "run_queue": w.get("run_queue_mean"),
            "host_cpu_pct": w.get("host_cpu_mean"),
            "other_processes_on_gpu": w.get("other_processes_max"),
            "step_ms_p50": w.get("step_ms_p50"),
            "baseline_step_ms_p50": sig.baseline.get("step_ms_p50"),
        },
        (w.start_ns, w.end_ns),
        *_in_window(w),
        "critical" if slow >= 2 * p["slowdown"] else "warning",
        _confidence(slow / p["slowdown"]),
    )


def validity_note(sig: Signals, p: dict) -> Hint | None:
    """Benchmark validity: tokenmill's own load generator shared the server's cores. Not a
    production finding (the client is not there in production), but it slowed the steps it
    measured, and the note says by how much: the same-work slowdown of the windows where the
    load generator used at least ``loadgen_cpu_pct`` of the CPU."""
    if sig.device_kind == "gpu":
        return None
    ran = [w for w in sig.windows if w.get("same_work_slowdown") is not None]
    busy = [w for w in ran if (w.get("loadgen_cpu_mean") or 0) >= p["loadgen_cpu_pct"]]
    if not busy:
        return None
    share = statistics.mean(w.get("loadgen_cpu_mean") for w in busy)
    slow = statistics.median(w.get("same_work_slowdown") for w in busy)
    quiet = [w for w in ran if (w.get("loadgen_cpu_mean") or 0) < p["loadgen_cpu_pct"] / 2]
    quiet_slow = statistics.median(w.get("same_work_slowdown") for w in quiet) if quiet else None
    named = busy_processes(sig, busy[0].start_ns, busy[-1].end_ns, loadgen=True)
    return Hint(
        f"benchmark validity: the load generator shares the server's cores: it used {share:.0f}% "
        f"of the CPU in {len(busy)} of {len(ran)} windows, where steps ran at {slow:.2f}x the "
        "same work at its quickest"
        + (f" ({quiet_slow:.2f}x without it)" if quiet_slow is not None else "")
        + "; timings from this run include the client's own CPU",
        {
            "load_generator_cpu_pct": share,
            "windows": len(busy),
            "same_work_slowdown": slow,
            "quiet_same_work_slowdown": quiet_slow,
            "load_generator_processes": named,
        },
        "run the load generator on another host, or pin it and the server to separate cores "
        "(taskset)",
    )


RULE = Rule(
    id="host_contention",
    own_test="the same work's step time against its quickest quarter, over the window's steps",
    title="a noisy neighbour: the same work runs slower while other processes use the machine",
    symptom="step time rises for the same batch and tokens while processes outside the server "
    "use the CPU (or the GPU)",
    causes=(
        "another process on the host competes for the CPU cores the engine's threads run on "
        "(a batch job, a build, another model server, a backup)",
        "a hypervisor steals the vCPUs (an oversubscribed VM host)",
        "another process shares the GPU (a second server, a notebook, a training job)",
    ),
    checks=(
        "cpu_others_pct and run_queue in the host samples during the slow window",
        "steal_pct on a VM",
        "`top`/`ps -eo pid,pcpu,comm --sort=-pcpu` on the host; `nvidia-smi` process list on a GPU",
    ),
    knob="move the neighbour off the host (or pin it: taskset/cgroup cpusets), "
    "give the server dedicated cores, or a dedicated GPU",
    params={
        "slowdown": Param(
            1.5,
            "median step time vs the dump's quickest quarter of steps doing the same work "
            "(the same ratio host_bound_steps uses for slow steps)",
        ),
        "others_cpu_pct": Param(
            20.0,
            "CPU used outside the server's process tree, % of all CPUs (one core of five busy: "
            "an engine that uses every core has no spare for it); the same_work family's quiet "
            "seconds are those under this default (signals/same_work.py: QUIET_OTHERS_PCT)",
        ),
        "steal_pct": Param(10.0, "CPU % the hypervisor gave to other guests"),
        "moderate_slowdown": Param(
            1.2,
            "a sustained neighbour: the same work's step time in its windows over the windows "
            "without one, the lower end of its 95% interval (tune split: one busy process "
            "beside three chats for 28 s read 1.30x, interval 1.27-1.32, with the step p50 up "
            "31%; healthy twins: no neighbour window at all)",
        ),
        "noticeable_slowdown": Param(
            1.1,
            "below moderate_slowdown but at least this: listed as inconclusive with its "
            "numbers, never a silent healthy",
        ),
        "sustained_s": Param(30.0, "how long the neighbour's windows must last together"),
        "open_step_rise": Param(
            8.0,
            "a step still running against the usual decode step and the steps before the "
            "neighbour got busy (before it, without a host sample of the quiet side): its work is not known yet, so far past slowdown (as itl_prefill_interference's "
            "itl_spike)",
        ),
        "prefill_tokens": Param(
            256,
            "a prompt this long waiting when the open step began may be its prefill: a slow "
            "step of its own, not the host's (itl_prefill_interference's min_prefill_tokens)",
        ),
        "loadgen_cpu_pct": Param(
            10.0,
            "CPU % (of all CPUs) tokenmill's own load generator used in a window before the "
            "report notes it as a threat to the benchmark's validity (a fifth of a core on two)",
        ),
    },
    hint=validity_note,
    detect=detect,
    healthy_baseline="absolute",
    explains=(
        # a neighbour that slows every step lowers the engine's capacity: the backlog it leaves
        # is overload's "capacity dropped"
        "overload",
        "host_bound_steps",
        "ttft_prefill_bound",
        "ttft_queueing",
        "batch_too_large",
        "itl_frontend_overhead",
        "itl_prefill_interference",
        "midstream_stall",
    ),
    evidence_signals=("same_work_slowdown", "cpu_others_mean", "run_queue_mean"),
    reads=("steps", "devices", "same_work"),
    needs={"device_samples": ("busy_others",)},
)
