"""The one duration grammar of every command, option, config file and route.

A duration is a number and a unit: ``500ms``, ``30s``, ``1.5m``, ``2h``, ``7d``; a bare number
is seconds (``30`` = ``30s``), so the options that always took seconds still take them. Where a
duration counts back (``--since``, ``?since=``), it counts from the store's latest row: the
last ``10m`` of what the store holds, live or closed.
"""

from __future__ import annotations

import math
import re

UNITS_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
#: the grammar in a few words, for error messages and help
GRAMMAR = "a number and a unit ms, s, m, h or d (500ms, 30s, 10m, 2h, 7d; a bare number is s)"


def parse_duration(text: str | float | int, *, allow_zero: bool = False) -> float:
    """``'30s'``, ``'500ms'``, ``'1.5m'``, ``'2h'``, ``'7d'``, ``30`` → seconds.

    Raises:
        ValueError: anything else, or 0 unless ``allow_zero`` (naming the value).
    """
    if isinstance(text, bool):
        raise ValueError(f"bad duration {text!r}: expected {GRAMMAR}")
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        m = _RE.match(text or "")
        if not m:
            raise ValueError(f"bad duration {text!r}: expected {GRAMMAR}")
        seconds = float(m.group(1)) * UNITS_S[m.group(2) or "s"]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"bad duration {text!r}: must be more than 0")
    return seconds


def duration_ns(text: str | float | int) -> int:
    """:func:`parse_duration` in whole nanoseconds (for ``--since``-style cuts)."""
    return round(parse_duration(text) * 1e9)


def duration_option(minimum: float = 0.0):
    """The ``parser`` of a command-line option (and its ``--config`` key and ``TOKENMILL_*``
    variable) that takes a duration: the command gets seconds (a float), at least ``minimum``.
    Raises ValueError, which the command line turns into a usage error naming the option."""

    def parse(value) -> float:
        try:
            seconds = parse_duration(value, allow_zero=True)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if seconds < minimum:
            raise ValueError(f"{value!r} is less than {minimum:g}s")
        return seconds

    return parse


__all__ = ["GRAMMAR", "UNITS_S", "duration_ns", "duration_option", "parse_duration"]
