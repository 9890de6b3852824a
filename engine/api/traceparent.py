"""The W3C Trace Context ``traceparent`` header, read and written in one place: the server
takes a caller's trace from it, the proxy continues or starts one and passes it upstream, and
the load generator starts one per request.

``version-trace_id-parent_id-flags``: 2, 32, 16 and 2 hex digits. A trace id or parent id of
all zeros is invalid, and so is version ``ff``; a later version may add fields after the four,
which are ignored. Hex digits are taken in either case and kept lowercase.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

_FORM = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<span_id>[0-9a-f]{16})"
    r"-(?P<flags>[0-9a-f]{2})(?P<rest>-.*)?"
)
SAMPLED = 0x01


@dataclass(frozen=True)
class TraceParent:
    """One valid ``traceparent``: the caller's trace, its span, and its flags."""

    trace_id: str
    """32 lowercase hex digits"""
    span_id: str
    """16 lowercase hex digits: the caller's span, the parent of ours"""
    flags: int = SAMPLED
    version: str = "00"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        """The header value (version 00)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """The ``traceparent`` in ``value``, or None when it is absent or not a valid one."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value:
        return None
    m = _FORM.fullmatch(value.strip().lower())
    if m is None or m["version"] == "ff" or (m["version"] == "00" and m["rest"]):
        return None
    if m["trace_id"] == "0" * 32 or m["span_id"] == "0" * 16:
        return None
    return TraceParent(m["trace_id"], m["span_id"], int(m["flags"], 16), m["version"])


def new_traceparent(trace_id: str | None = None) -> TraceParent:
    """A fresh span (sampled) in ``trace_id``, or in a new trace."""
    return TraceParent(trace_id or secrets.token_hex(16), secrets.token_hex(8))
