"""``--disaggregation 'prefill=P,decode=D'`` and its core placement (issue 17), torch-free:
parsed and checked before any process starts, each refusal one line naming the flag. A side's
cores (``--prefill-devices`` / ``--decode-devices``) are shared evenly among its workers."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*prefill\s*=\s*([0-9]+)\s*,\s*decode\s*=\s*([0-9]+)\s*$")
#: engine cores a side may have: every core of both sides joins one gloo group and is its own
#: process with its own copy of the model, so the count is bounded by memory long before this
MAX_PER_SIDE = 8


@dataclass(frozen=True)
class PDSpec:
    """Where prefill and decode run: ``prefill`` / ``decode`` engine cores, and the CPU cores
    each side is pinned to (``None``: not pinned, torch's own thread count)."""

    prefill: int
    decode: int
    prefill_cpus: tuple[int, ...] | None
    decode_cpus: tuple[int, ...] | None

    @property
    def world_size(self) -> int:
        """Engine cores in the KV link's group: prefill ranks ``0 .. P-1``, decode ``P ..
        P+D-1``."""
        return self.prefill + self.decode

    def worker_cpus(self, side: str) -> list[tuple[int, ...] | None]:
        """Each of ``side``'s workers' cores: the side's list cut into as many even,
        consecutive shares as it has workers (a share of ``n // workers`` cores, the first
        ``n % workers`` one more); None for each when the side is not pinned."""
        n, cpus = (
            (self.prefill, self.prefill_cpus)
            if side == "prefill"
            else (self.decode, self.decode_cpus)
        )
        if not cpus:
            return [None] * n
        size, extra = divmod(len(cpus), n)
        out, at = [], 0
        for i in range(n):
            take = size + (i < extra)
            out.append(tuple(cpus[at : at + take]))
            at += take
        return out


def split_host_port(addr: str) -> tuple[str, int]:
    """``"HOST:PORT"`` → ``(HOST, PORT)``.

    Raises:
        ValueError: no host, or a port that is not a number in 1..65534 (one line).
    """
    host, _, port = addr.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"expected HOST:PORT with a port in 1..65534, got {addr!r}")
    return host, int(port)


def core_addresses(addr: str) -> tuple[str, str]:
    """A remote engine core's two ZeroMQ addresses from its ``HOST:PORT``: to the core
    (``tcp://HOST:PORT``) and from it (``tcp://HOST:PORT+1``).

    Raises:
        ValueError: not ``HOST:PORT``, or no room for ``PORT + 1`` (one line).
    """
    host, port = split_host_port(addr)
    if port >= 65535:
        raise ValueError(f"a core takes PORT and PORT + 1, got {addr!r}")
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


def worker_name(rank: int, num_prefill: int) -> str:
    """The name of the KV link's rank ``rank``: ``prefill-i`` for ranks ``0 .. P-1``,
    ``decode-j`` for rank ``P + j``."""
    return f"prefill-{rank}" if rank < num_prefill else f"decode-{rank - num_prefill}"


def _cpus(flag: str, raw: str, cpu_count: int) -> tuple[int, ...] | None:
    """``"0"``, ``"0,1"`` or ``"0-3"`` → the core ids; empty → None."""
    if not raw.strip():
        return None
    out: list[int] = []
    for part in raw.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", part)
        if m is None:
            raise ValueError(f"{flag} takes core ids like 0,1 or 0-3, got {raw!r}")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(f"{flag}: the range {part.strip()!r} runs backwards")
        if hi >= cpu_count:  # before building the range: 0-99999999999 is one line too
            bad = list(range(max(lo, cpu_count), min(hi, cpu_count + 3) + 1))
            more = ", ..." if hi > cpu_count + 3 else ""
            raise ValueError(
                f"{flag} names core(s) [{', '.join(map(str, bad))}{more}] but this machine "
                f"has {cpu_count} (0-{cpu_count - 1})"
            )
        out.extend(range(lo, hi + 1))
    return tuple(dict.fromkeys(out))


def parse_disaggregation(
    spec: str, prefill_devices: str = "", decode_devices: str = "", *, cpu_count: int
) -> PDSpec | None:
    """The parsed flags, or None when ``spec`` is empty (colocated serving).

    Raises:
        ValueError: a malformed spec, zero workers on a side, more than :data:`MAX_PER_SIDE`,
            core lists that are malformed, overlap, name cores the machine lacks or fewer
            cores than the side's workers, or placement flags without ``--disaggregation``
            (one line each).
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
                f"--disaggregation {side}={n}: at most {MAX_PER_SIDE} {side} workers a side"
            )
    pc = _cpus("--prefill-devices", prefill_devices, cpu_count)
    dc = _cpus("--decode-devices", decode_devices, cpu_count)
    if pc and dc and set(pc) & set(dc):
        raise ValueError(
            f"--prefill-devices and --decode-devices share core(s) {sorted(set(pc) & set(dc))}"
        )
    for flag, side, n, cpus in (
        ("--prefill-devices", "prefill", p, pc),
        ("--decode-devices", "decode", d, dc),
    ):
        if cpus and len(cpus) < n:
            raise ValueError(
                f"{flag} names {len(cpus)} core(s) for {n} {side} workers: each worker needs "
                "a core of its own"
            )
    return PDSpec(p, d, pc, dc)
