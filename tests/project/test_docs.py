"""The docs match the tree.

``docs/structure.md`` is a map: it names every package folder (and sub-package) of the tree,
in at most 150 lines, and every path it names exists. What each module owns is its docstring:
every module has one. ``docs/request-path.md`` and ``docs/how-to-add.md`` name only paths that
exist, and every name in the request path's code column is defined in that row's files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tokenmill.diagnose.rules import RULES
from tokenmill.telemetry.schema import STATIONS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RULE_IDS = [r.id for r in RULES]
PLACEHOLDER = "<rule_id>"

# the packages, every folder of which the map names
PACKAGES = ("engine", "kernels", "telemetry", "diagnose", "dashboard", "bench", "proxy", "plan")
MAP_LINES = 150
CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
FILE_SUFFIXES = (".py", ".sql", ".md", ".yaml", ".jsonl", ".json", ".toml", ".sh")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _expand(path: str) -> list[str]:
    return [path.replace(PLACEHOLDER, rid) for rid in RULE_IDS] if PLACEHOLDER in path else [path]


def _folders() -> list[str]:
    """Every package folder and sub-package (a folder with an ``__init__.py``), as ``x/y/``."""
    out = []
    for pkg in PACKAGES:
        out += [_rel(p.parent) + "/" for p in sorted((ROOT / pkg).rglob("__init__.py"))]
    return out


def test_structure_is_a_map_of_every_folder():
    text = (DOCS / "structure.md").read_text()
    assert len(text.splitlines()) <= MAP_LINES, "docs/structure.md is a map: keep it short"
    named = set(CODE.findall(text))
    missing = [f for f in _folders() if f not in named]
    assert not missing, f"docs/structure.md does not name: {', '.join(missing)}"
    assert "engine/api/" in _folders() and "diagnose/rules/" in _folders()


def test_structure_names_only_paths_that_exist():
    for entry in _prose_paths("structure.md"):
        for path in _expand(entry):
            target = ROOT / path
            ok = target.is_dir() if path.endswith("/") else target.is_file()
            assert ok, f"structure.md names {path}, which does not exist"


def test_every_module_says_what_it_owns():
    """The map leaves each module's job to its docstring: every module has one."""
    missing = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()))
            if not doc or len(doc.split()) < 3:
                missing.append(_rel(path))
    assert not missing, f"modules without a docstring: {', '.join(missing)}"


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


@pytest.mark.parametrize("doc", ["request-path.md", "how-to-add.md", "structure.md"])
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
