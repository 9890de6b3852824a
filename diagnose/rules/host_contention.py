"""``host_contention``: the same work got slower while something outside the server used the
machine (the noisy neighbour).

The engine's steps are compared with themselves: a step is set against the quickest quarter of
the dump's steps that did the same work (same batch, tokens in the same power of two;
``same_work_slowdown`` in :mod:`..signals`), so a bigger batch or a longer prompt never reads as
contention. The host sampler says who else was busy: ``cpu_others_pct`` (CPU used outside the
server's process tree), ``steal_pct`` (a hypervisor giving the vCPU to another guest) and, on a
GPU, ``other_processes`` (processes on the same device that are not the server's).
"""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import (
    Evidence,
    Param,
    Rule,
    _confidence,
    _in_window,
    _when,
)


def _neighbour(sig: Signals, w: Window, p: dict) -> bool:
    if sig.device_kind == "gpu":
        return (w.get("other_processes_max") or 0) >= 1
    return (w.get("cpu_others_mean") or 0) >= p["others_cpu_pct"] or (
        w.get("steal_mean") or 0
    ) >= p["steal_pct"]


def detect(sig: Signals, p: dict) -> Evidence | None:
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
        who = f"processes outside the server used {w.get('cpu_others_mean') or 0:.0f}% of the CPU"
        if (w.get("steal_mean") or 0) >= 1:
            who += f" and the hypervisor stole {w.get('steal_mean'):.0f}%"
        if w.get("run_queue_mean") is not None:
            who += f" (run queue {w.get('run_queue_mean'):.1f})"
    return Evidence(
        f"engine steps took {slow:.1f}x as long as the same work (same batch and tokens) takes "
        f"at its quickest in {_when(w)} while {who}"
        + (
            f"; windows without a neighbour ran at {quiet_slowdown:.1f}x"
            if quiet_slowdown is not None
            else ""
        ),
        {
            "same_work_slowdown": slow,
            "quiet_same_work_slowdown": quiet_slowdown,
            "cpu_others_pct": w.get("cpu_others_mean"),
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


RULE = Rule(
    id="host_contention",
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
            "an engine that uses every core has no spare for it)",
        ),
        "steal_pct": Param(10.0, "CPU % the hypervisor gave to other guests"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=(
        "host_bound_steps",
        "ttft_prefill_bound",
        "ttft_queueing",
        "batch_too_large",
        "itl_frontend_overhead",
        "itl_prefill_interference",
        "midstream_stall",
    ),
    evidence_signals=("same_work_slowdown", "cpu_others_mean", "run_queue_mean"),
)
