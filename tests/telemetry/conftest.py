"""What the collector's tests share: the ``collector`` fixture (the collect app in a test
client over a real store)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tokenmill.telemetry.collect import make_app
from tokenmill.telemetry.store import TraceStore


@pytest.fixture
def collector(tmp_path):
    store = TraceStore(tmp_path / "c.duckdb", flush_interval_s=0.05)
    with TestClient(make_app(store)) as client:
        yield client, store
    store.close()
