"""The console's queries, split by concern (``dashboard/data_*.py``) behind ``dashboard/data.py``:
every query a page asks ``ui.q`` for is there by name, each module says what it holds, and no
function of the console runs past 80 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tokenmill.dashboard import data

DASHBOARD = Path(data.__file__).parent
MAX_FUNCTION_LINES = 80


def test_every_query_a_page_asks_for_is_in_data():
    asked = set()
    for page in [*DASHBOARD.glob("views/*.py"), DASHBOARD / "ui.py"]:
        asked |= set(re.findall(r"\bq\(\s*\w+,\s*\"(\w+)\"", page.read_text()))
    assert asked, "no ui.q calls found"
    missing = sorted(n for n in asked if not callable(getattr(data, n, None)))
    assert not missing, missing
    assert set(data.__all__) <= set(dir(data))


def test_each_query_module_has_a_docstring():
    for path in sorted(DASHBOARD.glob("data*.py")):
        assert ast.get_docstring(ast.parse(path.read_text())), path.name


def test_no_console_function_is_longer_than_80_lines():
    long = []
    for path in sorted(DASHBOARD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(DASHBOARD)}:{node.lineno} {node.name} {lines}")
    assert not long, long
