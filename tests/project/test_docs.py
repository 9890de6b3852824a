"""The docs match the tree.

``docs/structure.md`` lists every module (one line each) and nothing that is gone: each ``##``
heading names a folder, and the first code span(s) of each ``- `path` — ...`` line under it are
paths relative to that folder. ``rules/<rule_id>.py`` stands for one module per rule of
``tokenmill.diagnose.rules.RULES`` (and ``<rule_id>.md`` for one runbook per rule); a ``*`` glob
may stand for data files and tests, never for a package module.

``docs/request-path.md`` and ``docs/how-to-add.md`` name only paths that exist, and every name in
the request path's code column is defined in that row's files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenmill.diagnose.rules import RULES
from tokenmill.telemetry.schema import STATIONS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RULE_IDS = [r.id for r in RULES]
PLACEHOLDER = "<rule_id>"

# folders whose every Python module must have its own line in structure.md
PACKAGES = ("engine", "kernels", "telemetry", "diagnose", "dashboard", "bench", "runbooks", "plan")
# besides them: the scripts, the benchmarks, the test helpers (not the tests themselves) and the
# contract files that are not Python
OTHER_FOLDERS = ("scripts", "benchmarks")
CONTRACT_FILES = ("telemetry/schema.sql",)
CONTRACT_GLOBS = ("bench/scenarios/*",)

HEADING = re.compile(r"^## (?P<folder>\S+/)(?: .*)?$")
ENTRY = re.compile(r"^- (?P<paths>`[^`]+`(?:, `[^`]+`)*) — \S")
CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
FILE_SUFFIXES = (".py", ".sql", ".md", ".yaml", ".jsonl", ".json", ".toml", ".sh")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _expand(path: str) -> list[str]:
    return [path.replace(PLACEHOLDER, rid) for rid in RULE_IDS] if PLACEHOLDER in path else [path]


def structure_entries() -> list[str]:
    """Every path structure.md lists, relative to the repository root, in order."""
    entries: list[str] = []
    folder = None
    for n, line in enumerate((DOCS / "structure.md").read_text().splitlines(), 1):
        if line.startswith("## "):
            m = HEADING.match(line)
            assert m, f"structure.md:{n}: a section heading must name a folder: {line!r}"
            folder = m["folder"]
            assert (ROOT / folder).is_dir(), f"structure.md:{n}: no folder {folder}"
        elif line.startswith("- "):
            m = ENTRY.match(line)
            assert m, f"structure.md:{n}: a line must read - `path` — what it owns: {line!r}"
            assert folder, f"structure.md:{n}: a module line before any folder heading"
            for code in CODE.findall(m["paths"]):
                entries.append(folder + code.split()[0])
    return entries


def test_structure_lists_only_paths_that_exist():
    entries = structure_entries()
    assert len(entries) == len(set(entries)), [e for e in set(entries) if entries.count(e) > 1]
    for entry in entries:
        if "*" in entry:
            assert list(ROOT.glob(entry)), f"structure.md: {entry} matches nothing"
            continue
        for path in _expand(entry):
            assert (ROOT / path).is_file(), f"structure.md lists {path}, which does not exist"


def _required() -> list[str]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += [p for folder in OTHER_FOLDERS for p in (ROOT / folder).iterdir() if p.is_file()]
    files += [p for p in (ROOT / "tests").rglob("*.py") if not p.name.startswith("test_")]
    files += [ROOT / f for f in CONTRACT_FILES]
    files += [p for g in CONTRACT_GLOBS for p in ROOT.glob(g) if p.is_file()]
    return sorted(_rel(p) for p in files if "__pycache__" not in p.parts)


def test_structure_lists_every_module():
    entries = structure_entries()
    exact = {path for e in entries if "*" not in e for path in _expand(e)}
    globbed = {_rel(p) for e in entries if "*" in e for p in ROOT.glob(e)}
    missing = [
        f
        for f in _required()
        if f not in exact and (f.endswith(".py") or f not in globbed)  # modules by name only
    ]
    assert not missing, f"docs/structure.md has no line for: {', '.join(missing)}"
    assert "engine/messages.py" in _required() and "diagnose/rules/_common.py" in exact


def _prose_paths(doc: str) -> list[str]:
    """Code spans of ``doc`` that name a file or folder of the repository."""
    text = FENCE.sub("", (DOCS / doc).read_text())
    out = []
    for code in CODE.findall(text):
        if " " in code or code.startswith("/") or "://" in code:
            continue  # a command, a route or a URL
        if "/" in code or code.endswith(FILE_SUFFIXES):
            out.append(code)
    return out


@pytest.mark.parametrize("doc", ["request-path.md", "how-to-add.md"])
def test_docs_name_only_paths_that_exist(doc):
    paths = _prose_paths(doc)
    assert paths, doc
    for entry in paths:
        for path in _expand(entry):
            target = ROOT / path
            ok = target.is_dir() if path.endswith("/") else target.is_file()
            assert ok, f"{doc} names {path}, which does not exist (paths are from the repo root)"


def _defined(name: str, sources: str) -> bool:
    return bool(
        re.search(
            rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b"
            rf"|^\s*{re.escape(name)}\s*(?::[^=\n]*)?=",
            sources,
            re.M,
        )
    )


def request_path_rows() -> list[list[str]]:
    rows = []
    for line in (DOCS / "request-path.md").read_text().splitlines():
        if re.match(r"^\| \d+ \|", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 5, f"request-path.md: hop | files | code | span: {line!r}"
            rows.append(cells)
    return rows


def test_request_path_code_is_defined_in_its_files():
    rows = request_path_rows()
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)), "hops numbered in order"
    for number, _hop, files_cell, code_cell, _span in rows:
        files = CODE.findall(files_cell)
        names = CODE.findall(code_cell)
        assert files and names, f"hop {number}: name its files and its code"
        gone = [f for f in files if not (ROOT / f).is_file()]
        assert not gone, f"hop {number}: no file {', '.join(gone)}"
        sources = "\n".join((ROOT / f).read_text() for f in files)
        for name in names:
            for part in name.split("."):
                assert _defined(part, sources), f"hop {number}: {name} is not defined in {files}"


def test_request_path_names_every_station_in_order():
    spans = " ".join(r[4] for r in request_path_rows())
    positions = [spans.find(f"`{s}`") for s in ("request", *STATIONS)]
    assert -1 not in positions, [s for s, p in zip(("request", *STATIONS), positions) if p < 0]
    assert positions[1:] == sorted(positions[1:]), "the stations in the order a request meets them"
