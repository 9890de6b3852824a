"""Family ``completions``: requests by the window they ended in: completions, errors, requests
ended, the completed requests' output tokens, the error rate (errors / ended) and the completion
rate; and the errors by type (:func:`errors_by_window`, :func:`errors_by_type`)."""

from __future__ import annotations

from tokenmill.telemetry.schema import COMPLETED_SQL

from .family import Family, Yield
from .requests import COMPLETED_COLUMNS
from .scope import Scope

_END_WINDOW_SQL = f"""
SELECT (end_ns - $t0) // $w AS win,
    count(*) FILTER (WHERE {COMPLETED_SQL}) AS completions,
    count(*) FILTER (WHERE error_type IS NOT NULL) AS errors,
    count(*) AS ended,
    sum(output_tokens) FILTER (WHERE {COMPLETED_SQL}) AS completed_tokens
FROM requests WHERE end_ns >= $since AND end_ns < $until
GROUP BY win
"""

_KEYS = ("completions", "errors", "ended", "completed_tokens")


def _error_rate(v: dict) -> float | None:
    ended = v.get("ended") or 0
    return (v.get("errors") or 0) / ended if ended else None


def compute(scope: Scope) -> Yield:
    # the warm-up's requests (by arrival) are left out of the windows they end in
    windows = scope.by_window(_END_WINDOW_SQL, "end_ns", scope.not_warm_req)
    for i in range(scope.n_windows):
        v = windows.setdefault(i, {})
        v["error_rate"] = _error_rate(v)
        v["completion_rate"] = (v.get("completions") or 0) / scope.window_s
    overall = scope.over_range(_END_WINDOW_SQL, "end_ns")
    overall["error_rate"] = _error_rate(overall)
    return Yield(windows, overall)


FAMILY = Family(
    name="completions",
    needs={"requests": ("arrival_ns", "end_ns", *COMPLETED_COLUMNS, "output_tokens")},
    window_keys=(*_KEYS, "error_rate", "completion_rate"),
    overall_keys=(*_KEYS, "error_rate"),
    compute=compute,
)


def errors_by_window(scope: Scope) -> dict[int, dict[str, int]]:
    """Per window (by end, the warm-up's requests left out), the errors by ``error_type``."""
    if not scope.has("requests", "arrival_ns", "end_ns", "error_type"):
        return {}
    out: dict[int, dict[str, int]] = {}
    for win, etype, n in scope.con.execute(
        "SELECT (end_ns - $t0) // $w, error_type, count(*) FROM requests "
        f"WHERE {scope.not_warm_req} AND end_ns >= $since AND end_ns < $until "
        "AND error_type IS NOT NULL GROUP BY ALL",
        scope.params,
    ).fetchall():
        out.setdefault(int(win), {})[etype] = n
    return out


def errors_by_type(scope: Scope) -> dict[str, int]:
    """The errors of the requests that ended in the range by ``error_type``, most first."""
    if not scope.has("requests", "end_ns", "error_type"):
        return {}
    return dict(
        scope.con.execute(
            "SELECT error_type, count(*) FROM requests WHERE end_ns >= ? AND end_ns < ? "
            "AND error_type IS NOT NULL GROUP BY 1 ORDER BY 2 DESC",
            [scope.since, scope.until],
        ).fetchall()
    )
