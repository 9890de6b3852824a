"""The packages import each other only in the intended direction (DESIGN.md §1):
API → engine process → telemetry → store → diagnose / console, kernels below the engine.

Every module's imports are parsed (not executed), relative imports resolved, so an edge added
anywhere, even inside a function, fails here with the file and line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "telemetry", "diagnose", "dashboard", "bench", "proxy", "plan")

#: package → packages it must never import
FORBIDDEN = {
    "engine": {"telemetry", "diagnose", "dashboard", "bench", "proxy", "plan"},
    "kernels": {"engine", "telemetry", "diagnose", "dashboard", "bench", "proxy", "plan"},
    "telemetry": {"diagnose", "dashboard", "bench", "proxy", "plan"},
    "diagnose": {"engine", "dashboard", "bench", "proxy", "plan"},
    "dashboard": {"engine", "bench", "proxy"},
    # the proxy is an API front: the gateway and the store, never the engine's model
    "proxy": {"diagnose", "dashboard", "bench", "kernels", "plan"},
    # what-ifs: the engine's scheduler, pool and router over a recording; never the model run
    "plan": {"dashboard", "bench", "proxy", "kernels"},
}
#: the few edges that are the design, each with its reason
ALLOWED = {
    # the composition root: the API server builds the Telemetry it reports to
    ("engine/api/server.py", "telemetry"),
    # the composition roots start the live diagnosis over the store they write
    ("engine/api/server.py", "diagnose"),
    ("proxy/cli.py", "diagnose"),
    ("telemetry/collect_cli.py", "diagnose"),
    # the planner prices decode steps by the CPU kernels' row cut-over (a bare constant)
    ("plan/step_cost.py", "kernels"),
    # `plan --profile` without a URL starts a local `tokenmill serve` of the recording's setup
    # the way every benchmark starts one (bench/scenario.py's start_server)
    ("plan/profile.py", "bench"),
    # `plan --profile` of another engine reads each sweep answer as the proxy reads one
    # (proxy/observe.py's Exchange: one reader of OpenAI's event stream)
    ("plan/profile.py", "proxy"),
}


def _module_name(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ["tokenmill", *parts]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, "tokenmill.x.y")`` for every import of a tokenmill module in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("tokenmill")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("tokenmill"):
                out.append((node.lineno, target))
    return out


def edges() -> list[tuple[str, int, str, str]]:
    """``(file, line, from_package, to_package)`` for every cross-package import."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for line, target in imports_of(path):
                parts = target.split(".")
                if len(parts) > 1 and parts[1] != pkg:
                    out.append((rel, line, pkg, parts[1]))
    return out


def test_the_parser_sees_relative_and_nested_imports():
    found = {(f, to) for f, _, _, to in edges()}
    assert ("engine/api/server.py", "telemetry") in found  # an import inside a function
    assert any(f.startswith("telemetry/") and to == "engine" for f, to in found)


def test_no_package_imports_against_the_direction():
    bad = [
        f"{f}:{line}: {src} imports tokenmill.{dst}"
        for f, line, src, dst in edges()
        if dst in FORBIDDEN.get(src, ()) and (f, dst) not in ALLOWED
    ]
    assert not bad, "\n".join(bad)


def test_every_allowed_exception_is_still_used():
    found = {(f, to) for f, _, _, to in edges()}
    assert found >= ALLOWED, ALLOWED - found


@pytest.mark.parametrize(
    "module",
    [
        "tokenmill.diagnose",
        "tokenmill.diagnose.findings",
        "tokenmill.dashboard.data",
        "tokenmill.telemetry.schema",
        "tokenmill.telemetry.hub",
        "tokenmill.engine.messages",
        # the observer install (`pip install tokenmill`, no torch): the proxy, the OTLP
        # receiver, the planner over a recording
        "tokenmill.proxy.app",
        "tokenmill.proxy.cli",
        "tokenmill.telemetry.collect",
        # every module of the planner, and the engine modules its replay runs (the engine's
        # own scheduler, KV block pool and request)
        "tokenmill.plan.simulate",
        "tokenmill.plan.step_cost",
        "tokenmill.plan.whatif",
        "tokenmill.plan.workload",
        "tokenmill.plan.recommend",
        "tokenmill.plan.report",
        "tokenmill.plan.check",
        "tokenmill.plan.split",
        "tokenmill.plan.predict",
        "tokenmill.plan.cli",
        "tokenmill.engine.scheduler",
        "tokenmill.engine.block_manager",
        "tokenmill.engine.request",
        # every console page
        "tokenmill.dashboard.views.compare",
        "tokenmill.dashboard.views.devices",
        "tokenmill.dashboard.views.diagnosis",
        "tokenmill.dashboard.views.engine",
        "tokenmill.dashboard.views.errors",
        "tokenmill.dashboard.views.now",
        "tokenmill.dashboard.views.overview",
        "tokenmill.dashboard.views.requests",
        "tokenmill.dashboard.views.whatif",
        # the API process's modules: importing torch before the engine core was even started
        # held every server start up by about 1.5 s (transformers' tokenizer, loaded in a
        # thread beside the engine's start, still brings torch in later)
        "tokenmill.engine.api.server",
    ],
)
def test_readers_of_the_store_do_not_load_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
