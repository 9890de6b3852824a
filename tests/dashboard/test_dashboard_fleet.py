"""The console over a fleet (``tokenmill dashboard --source A --source B ...`` or a folder):
the sidebar picks one replica or all, "all" is the union with a ``source`` column, and the
Diagnosis page diagnoses each replica on its own and names the one a rule fired on. Synthetic
stores written through the real store writer, one Parquet dump among them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from streamlit.testing.v1 import AppTest
from synth_store import Phase, write_store

from tokenmill.dashboard import data
from tokenmill.dashboard.fleet_source import ALL, SEPARATOR, FleetHandle, check_fleet
from tokenmill.dashboard.source import SourceError

APP = Path(data.__file__).parent / "app.py"
HEALTHY = Phase(duration_s=40)
LEAK = [HEALTHY, HEALTHY.but(duration_s=20, rate_per_s=0, idle_kv_usage=0.3)]
DRAINED = [HEALTHY, HEALTHY.but(duration_s=20, rate_per_s=0)]


def tm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    """A folder of three dumps: ``east.duckdb`` and ``west.duckdb`` drain cleanly, ``north`` (a
    Parquet dump) keeps 30% of its KV cache with nothing running."""
    root = tmp_path_factory.mktemp("fleet")
    stores, dumps = root / "stores", root / "dumps"
    stores.mkdir()
    dumps.mkdir()
    for name, phases, seed in (("east", DRAINED, 1), ("north", LEAK, 2), ("west", DRAINED, 3)):
        write_store(stores / f"{name}.duckdb", phases, seed=seed)
        out = dumps / name if name == "north" else dumps / f"{name}.duckdb"
        fmt = "parquet" if name == "north" else "duckdb"
        r = tm("dump", "--db", str(stores / f"{name}.duckdb"), "-o", str(out), "--format", fmt)
        assert r.returncode == 0, r.stderr
    return dumps


def requests_in(store: Path) -> int:
    with duckdb.connect(str(store), read_only=True) as con:
        return con.execute("SELECT count(*) FROM requests").fetchone()[0]


def test_fleet_handle_unions_the_sources(fleet):
    handle = FleetHandle(check_fleet([str(fleet)]))
    try:
        assert [m.name for m in handle.members] == ["east", "north", "west"]
        per_source = dict(
            handle.snapshot(ALL)
            .cursor()
            .execute("SELECT source, count(*) FROM requests GROUP BY source")
            .fetchall()
        )
        stores = fleet.parent / "stores"
        assert per_source == {n: requests_in(stores / f"{n}.duckdb") for n in per_source}
        assert set(per_source) == {"east", "north", "west"}
        (n,) = handle.snapshot("north").cursor().execute("SELECT count(*) FROM requests").fetchone()
        assert n == per_source["north"]
    finally:
        handle.close()
    with pytest.raises(SourceError, match="given twice"):
        check_fleet([str(fleet / "east.duckdb"), str(fleet / "east.duckdb")])
    with pytest.raises(SourceError, match="give a server URL on its own"):
        check_fleet([str(fleet), "http://127.0.0.1:8000"])


def open_fleet(monkeypatch, spec: str, page: str = "overview", source: str | None = None):
    monkeypatch.setenv("TOKENMILL_DASHBOARD_SOURCE", spec)
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.run()
    if source is not None:
        at.sidebar.selectbox(key="tm_source").set_value(source)
        at.run()
    if page != "overview":
        at.switch_page(f"views/{page}.py")
        at.run()
    assert not at.exception, at.exception
    return at


def test_diagnosis_page_names_the_leaky_replica(monkeypatch, fleet):
    spec = check_fleet([str(fleet)])
    assert spec.count(SEPARATOR) == 2
    at = open_fleet(monkeypatch, spec, "diagnosis")
    picker = at.sidebar.selectbox(key="tm_source")
    assert picker.options == ["All 3 sources", "east", "north", "west"]
    labels = [e.label for e in at.expander]
    leaks = [x for x in labels if x.split(" ")[1] == "kv_block_leak"]
    assert len(leaks) == 1 and " on north — " in leaks[0], labels
    (table,) = (d.value for d in at.dataframe)
    assert list(table["source"]) == ["east", "north", "west"]
    fired = dict(zip(table["source"], table["rules fired"], strict=True))
    assert "kv_block_leak" in fired["north"]
    assert "kv_block_leak" not in fired["east"] + fired["west"]

    # one replica picked: its own findings, as for that dump alone (no source names)
    at = open_fleet(monkeypatch, spec, "diagnosis", source="east")
    labels = [e.label for e in at.expander]
    assert not any("kv_block_leak" in x for x in labels) and not any(" on " in x for x in labels)
    at = open_fleet(monkeypatch, spec, "diagnosis", source="north")
    assert any(x.split(" ")[1] == "kv_block_leak" for x in (e.label for e in at.expander))


@pytest.mark.parametrize("page", ("overview", "requests", "engine", "devices", "errors"))
def test_every_page_renders_the_union(monkeypatch, fleet, page):
    at = open_fleet(monkeypatch, check_fleet([str(fleet)]), page)
    assert not at.exception
    assert not at.sidebar.error


def test_bad_fleet_for_the_console_is_one_line(fleet, tmp_path):
    (tmp_path / "x.duckdb").write_text("not a database")
    r = tm("dashboard", "--source", str(fleet), "--source", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: ") and "x.duckdb" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
