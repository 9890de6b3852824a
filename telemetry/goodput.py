"""Goodput's test of one request, written once: the SQL over a ``requests`` row and the bounds
it binds. Light to import (no DuckDB), so the planner's and the console's settings can hold the
bounds without loading the store."""

from __future__ import annotations

from dataclasses import dataclass

#: goodput's test of one request (docs/terms.md), over a ``requests`` row with ``ok`` (it
#: completed: :data:`COMPLETED_SQL`) and the SLO bounds bound as ``$ttft``, ``$itl`` and ``$e2e``
#: (ms): its TTFT, its own ITL p99 and its E2E within them. ``tokenmill bench`` applies the same
#: test client-side (``tokenmill.bench.report.meets_slos``).
GOOD_REQUEST_SQL = "ok AND ttft_ms <= $ttft AND coalesce(itl_p99_ms, 0) <= $itl AND e2e_ms <= $e2e"


@dataclass(frozen=True)
class GoodputSlo:
    """Goodput's per-request bounds (ms): a request is good when it completed and its TTFT, its
    own ITL p99 and its E2E are within them (:data:`GOOD_REQUEST_SQL`). The console, ``diagnose
    compare`` and ``tokenmill plan`` share these defaults."""

    ttft_ms: float = 2000.0
    itl_ms: float = 200.0
    e2e_ms: float = 60000.0

    def sql_params(self) -> dict[str, float]:
        """The bounds as :data:`GOOD_REQUEST_SQL` binds them (``$ttft``, ``$itl``, ``$e2e``)."""
        return {"ttft": float(self.ttft_ms), "itl": float(self.itl_ms), "e2e": float(self.e2e_ms)}


#: the bounds a reader takes when none are given
DEFAULT_GOODPUT = GoodputSlo()
