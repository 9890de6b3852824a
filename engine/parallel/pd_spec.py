"""``--disaggregation 'prefill=P,decode=D'`` and its core placement (issue 17), torch-free:
parsed and checked before any process starts, each refusal one line naming the flag."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*prefill\s*=\s*(\d+)\s*,\s*decode\s*=\s*(\d+)\s*$")
# workers a side may have in this version: one prefill and one decode engine core
MAX_PER_SIDE = 1


@dataclass(frozen=True)
class PDSpec:
    """Where prefill and decode run: ``prefill`` / ``decode`` engine cores, and the CPU cores
    each side is pinned to (``None``: not pinned, torch's own thread count)."""

    prefill: int
    decode: int
    prefill_cpus: tuple[int, ...] | None
    decode_cpus: tuple[int, ...] | None


def _cpus(flag: str, raw: str, cpu_count: int) -> tuple[int, ...] | None:
    """``"0"``, ``"0,1"`` or ``"0-3"`` → the core ids; empty → None."""
    if not raw.strip():
        return None
    out: list[int] = []
    for part in raw.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None:
            raise ValueError(f"{flag} takes core ids like 0,1 or 0-3, got {raw!r}")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(f"{flag}: the range {part.strip()!r} runs backwards")
        out.extend(range(lo, hi + 1))
    bad = [c for c in out if c >= cpu_count]
    if bad:
        raise ValueError(
            f"{flag} names core(s) {bad} but this machine has {cpu_count} (0-{cpu_count - 1})"
        )
    return tuple(dict.fromkeys(out))


def parse_disaggregation(
    spec: str, prefill_devices: str = "", decode_devices: str = "", *, cpu_count: int
) -> PDSpec | None:
    """The parsed flags, or None when ``spec`` is empty (colocated serving).

    Raises:
        ValueError: a malformed spec, zero workers on a side, more workers than this version
            runs, core lists that are malformed, overlap or name cores the machine lacks, or
            placement flags without ``--disaggregation`` (one line each).
    """
    if not spec.strip():
        if prefill_devices.strip() or decode_devices.strip():
            raise ValueError("--prefill-devices and --decode-devices need --disaggregation")
        return None
    m = _SPEC.match(spec)
    if m is None:
        raise ValueError(
            f"--disaggregation takes 'prefill=P,decode=D' (e.g. prefill=1,decode=1), got {spec!r}"
        )
    p, d = int(m[1]), int(m[2])
    for side, n in (("prefill", p), ("decode", d)):
        if n < 1:
            raise ValueError(f"--disaggregation needs at least one {side} worker, got {side}={n}")
        if n > MAX_PER_SIDE:
            raise ValueError(
                f"--disaggregation {side}={n}: this version runs {MAX_PER_SIDE} {side} worker"
            )
    pc = _cpus("--prefill-devices", prefill_devices, cpu_count)
    dc = _cpus("--decode-devices", decode_devices, cpu_count)
    if pc and dc and set(pc) & set(dc):
        raise ValueError(
            f"--prefill-devices and --decode-devices share core(s) {sorted(set(pc) & set(dc))}"
        )
    return PDSpec(p, d, pc, dc)
