"""Load phases and arrival times.

A run is a list of phases, each with a name, a duration (s) and a rate multiplier applied to
the base load: the open-loop request rate (``--request-rate``, requests/s) or the closed-loop
concurrency (``--concurrency``, rounded, at least 1). Spec syntax::

    warmup:20s,steady:60s,overload:30s@3x,recovery:40s

Durations take ``ms``, ``s``, ``m`` or ``h``; the multiplier (``@3x``, ``@0.5x``, ``@2``) defaults
to 1x. A YAML file works too (``--phases phases.yaml``)::

    phases:                 # or the list at top level
      - {name: steady, duration: 60s}
      - {name: overload, duration: 30s, rate: 3x}   # rate | multiplier: 3x, 3 or "3"

Arrivals (open loop): inter-arrival gaps are gamma distributed with shape ``B`` (the
burstiness) and scale ``1 / (R * B)``, so the mean gap is ``1 / R`` s for every ``B``; ``B = 1`` is
a Poisson process, ``B < 1`` burstier, ``B > 1`` more regular. Within a phase of multiplier ``m``
the rate is ``R * m``; the clock restarts at each phase boundary, and an arrival belongs to the
phase in whose window ``[start, start + duration)`` it is planned.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.engine.durations import parse_duration

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_MULT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*x?\s*$")


@dataclass(frozen=True)
class Phase:
    """One phase: ``duration_s`` seconds at ``multiplier`` × the base load."""

    name: str
    duration_s: float
    multiplier: float = 1.0


def parse_multiplier(text) -> float:
    """``'3x'``, ``'0.5x'``, ``3`` → 3.0 (> 0). Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"bad rate multiplier {text!r}")
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _MULT_RE.match(str(text))
        if not m:
            raise ValueError(f"bad rate multiplier {text!r} (expected e.g. 3x or 0.5x)")
        value = float(m.group(1))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bad rate multiplier {text!r}: must be more than 0")
    return value


def _check_names(phases: list[Phase]) -> list[Phase]:
    if not phases:
        raise ValueError("no phases given")
    seen: set[str] = set()
    for p in phases:
        if p.name in seen:
            raise ValueError(f"phase name {p.name!r} is used twice")
        seen.add(p.name)
    return phases


def parse_phases(spec: str) -> list[Phase]:
    """Parse ``name:duration[@Nx],...`` or, when ``spec`` names a ``.yaml``/``.yml``/existing
    file, a YAML phases file.

    Raises:
        ValueError: one line naming the bad part.
    """
    if spec is None or not str(spec).strip():
        raise ValueError("empty phases spec")
    spec = str(spec).strip()
    path = Path(spec)
    if spec.lower().endswith((".yaml", ".yml")) or (":" not in spec and path.is_file()):
        return parse_phases_yaml(path)
    phases = []
    for i, part in enumerate(spec.split(","), 1):
        part = part.strip()
        if not part:
            raise ValueError(f"phase {i} is empty (stray comma?)")
        name, sep, rest = part.partition(":")
        name = name.strip()
        if not sep:
            raise ValueError(f"phase {part!r}: expected name:duration, e.g. steady:60s")
        if not _NAME_RE.match(name):
            raise ValueError(
                f"phase {part!r}: bad name {name!r} (letters, digits, _ and -, starting with a letter)"
            )
        dur_text, at, mult_text = rest.partition("@")
        try:
            duration = parse_duration(dur_text)
            multiplier = parse_multiplier(mult_text) if at else 1.0
        except ValueError as exc:
            raise ValueError(f"phase {part!r}: {exc}") from None
        phases.append(Phase(name, duration, multiplier))
    return _check_names(phases)


def parse_phases_yaml(path: Path) -> list[Phase]:
    """Read a YAML phases file (see the module docstring). Raises ValueError (one line)."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"phases file {path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"phases file {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"phases file {path}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"phases file {path}: nested too deeply to be a phases list") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"phases file {path}: not valid YAML{line}") from None
    items = doc.get("phases") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ValueError(f"phases file {path}: expected a list of phases (or a 'phases:' list)")
    phases = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise ValueError(f"phases file {path}: phase {i} is not a mapping")
        unknown = set(item) - {"name", "duration", "rate", "multiplier"}
        if unknown:
            raise ValueError(f"phases file {path}: phase {i}: unknown key {sorted(unknown)[0]!r}")
        name = str(item.get("name", ""))
        if not _NAME_RE.match(name):
            raise ValueError(f"phases file {path}: phase {i}: bad or missing name {name!r}")
        if "duration" not in item:
            raise ValueError(f"phases file {path}: phase {name!r}: missing duration")
        dur = item["duration"]
        mult = item.get("rate", item.get("multiplier", 1.0))
        try:
            duration = (
                float(dur)
                if isinstance(dur, int | float) and not isinstance(dur, bool)
                else parse_duration(dur)
            )
            if not math.isfinite(duration) or duration <= 0:
                raise ValueError(f"bad duration {dur!r}: must be a finite number more than 0")
            multiplier = parse_multiplier(mult)
        except ValueError as exc:
            raise ValueError(f"phases file {path}: phase {name!r}: {exc}") from None
        phases.append(Phase(name, duration, multiplier))
    try:
        return _check_names(phases)
    except ValueError as exc:
        raise ValueError(f"phases file {path}: {exc}") from None


def phase_bounds(phases: list[Phase]) -> list[tuple[float, float]]:
    """``[(start_s, end_s), ...]`` offsets of each phase from the run's start."""
    out, t = [], 0.0
    for p in phases:
        out.append((t, t + p.duration_s))
        t += p.duration_s
    return out


def gamma_gaps(rate: float, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` inter-arrival gaps (s): Gamma(shape=B, scale=1/(R·B)), mean ``1/rate``."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be more than 0")
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(
    rate: float,
    burstiness: float,
    phases: list[Phase],
    rng: np.random.Generator,
    max_requests: int | None = None,
) -> list[tuple[float, int]]:
    """Planned send times ``[(offset_s, phase_index), ...]`` of an open-loop phased run.

    Phase ``i`` runs at ``rate * phases[i].multiplier`` requests/s; gaps are :func:`gamma_gaps`.
    At most ``max_requests`` arrivals in all; a phase may last ``inf`` s (a run without
    ``--phases``), and then ``max_requests`` bounds it. ``rate = inf`` puts all
    ``max_requests`` arrivals at offset 0 (a burst), in the first phase.
    """
    if math.isinf(rate):
        if max_requests is None:
            raise ValueError("an infinite request rate needs a request count")
        return [(0.0, 0)] * max_requests
    out: list[tuple[float, int]] = []
    for idx, (p, (start, end)) in enumerate(zip(phases, phase_bounds(phases))):
        r = rate * p.multiplier
        t = start
        while max_requests is None or len(out) < max_requests:
            # draw in blocks: the expected count plus slack
            if math.isinf(end):
                if max_requests is None:
                    raise ValueError("an unbounded phase needs a request count")
                block = max_requests - len(out) + 1
            else:
                block = max(16, int(r * (end - t) * 1.2) + 16)
            block = min(block, 100_000)  # a long phase is drawn in several blocks
            if max_requests is not None:
                block = min(block, max_requests - len(out) + 1)
            stop = False
            for gap in gamma_gaps(r, burstiness, block, rng):
                t += float(gap)
                if t >= end or (max_requests is not None and len(out) >= max_requests):
                    stop = True
                    break
                out.append((t, idx))
            if stop:
                break
        if max_requests is not None and len(out) >= max_requests:
            break
    return out
