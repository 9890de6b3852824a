"""The wheel is what `pip install tokenmill` gets: every package folder in it, every data file
shipped, every third-party import declared, and (slow) the built wheel installed on its own —
not editable — generates with the C kernels on and starts a two-replica server."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUP = PYPROJECT["tool"]["setuptools"]
DIRS: dict[str, str] = SETUP["package-dir"]  # tokenmill.engine -> engine


def _package_folders() -> dict[str, Path]:
    """Every importable package under the mapped roots, ``{dotted name: folder}``: each folder
    holding Python files (with an ``__init__.py`` or as a namespace package)."""
    out = {}
    for name, root in DIRS.items():
        for folder in [REPO / root, *(p for p in (REPO / root).rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts or not any(folder.glob("*.py")):
                continue
            rel = folder.relative_to(REPO / root)
            out[".".join([name, *rel.parts])] = folder
    return out


def test_every_package_folder_is_listed_and_every_listed_one_exists():
    folders = _package_folders()
    listed = set(SETUP["packages"])
    assert set(folders) - listed == set(), "package folders missing from pyproject's list"
    assert listed - set(folders) == set(), "listed packages with no folder"


def test_every_data_file_is_shipped():
    """Each non-Python file inside a package folder matches its package's package-data."""
    data = SETUP["package-data"]
    missing = []
    for name, folder in _package_folders().items():
        for f in folder.iterdir():
            if f.is_dir() or f.suffix in (".py", ".pyc") or f.name.startswith("."):
                continue
            globs = data.get(name, [])
            if not any(fnmatch.fnmatch(f.name, g) for g in globs):
                missing.append(f"{name}: {f.name}")
        for sub in folder.iterdir():  # data folders (no Python in them), e.g. bench/scenarios
            if sub.is_dir() and sub.name != "__pycache__" and not any(sub.rglob("*.py")):
                for f in sub.rglob("*"):
                    rel = str(f.relative_to(folder))
                    if f.is_file() and not any(fnmatch.fnmatch(rel, g) for g in data.get(name, [])):
                        missing.append(f"{name}: {rel}")
    assert missing == [], missing


def _declared() -> set[str]:
    reqs = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"].get("optional-dependencies", {}).values():
        reqs += extra
    names = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in reqs}
    return {n.lower().replace("_", "-") for n in names}


def test_every_third_party_import_is_declared():
    """A module the package imports (outside tests) comes from a declared distribution, in the
    dependencies or an extra (gguf: the `convert` extra)."""
    from importlib import metadata

    by_module = metadata.packages_distributions()
    declared = _declared()
    undeclared = {}
    for root in DIRS.values():
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names}:
                    if top in sys.stdlib_module_names or top == "tokenmill":
                        continue
                    dists = {d.lower().replace("_", "-") for d in by_module.get(top, [top])}
                    if not dists & declared:
                        undeclared.setdefault(top, str(path.relative_to(REPO)))
    assert undeclared == {}, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_license_the_metadata_names_is_there():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]


@pytest.mark.slow
@pytest.mark.e2e
def test_the_built_wheel_installs_alone_and_runs(tmp_path, smollm2_dir):
    """`pip wheel .` lists every package and C source; installed (not editable) into a fresh
    venv that borrows only the third-party packages, it generates with the C kernels on and
    starts `serve --data-parallel-size 2` (the parallel package inside)."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(REPO)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    (wheel,) = wheels.glob("tokenmill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in SETUP["packages"]:  # namespace packages have no __init__.py
        assert any(n.rsplit("/", 1)[0] == package.replace(".", "/") for n in names), package
    for c in (REPO / "kernels").glob("*.c"):
        assert f"tokenmill/kernels/{c.name}" in names, c.name
    assert any(n.endswith("licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    # the third-party packages come from this environment's site-packages as a plain path
    # (a .pth line: the editable install's own .pth hooks there are not run)
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENMILL_", "PYTHONPATH"))}
    env["PYTHONSAFEPATH"] = "1"
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the kernels build from the wheel's C files
    py = str(venv / "bin" / "python")
    probe = subprocess.run(
        [py, "-c", "import tokenmill.kernels.cpu as c, tokenmill.engine.parallel as p;"
         "print(p.__file__); print(c.available(), c.unavailable_reason())"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    where, kernels = probe.stdout.strip().splitlines()[-2:]
    assert str(site) in where, where  # the wheel's copy, not the repository's
    assert kernels.startswith("True"), kernels
    gen = subprocess.run(
        [str(venv / "bin" / "tokenmill"), "generate", "--model", str(smollm2_dir),
         "--prompt", "The capital of France is", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert "output tokens in" in gen.stdout, gen.stdout
    from server_proc import free_port  # tests/helpers/ is on the path (conftest)

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "tokenmill"), "serve", "--model", str(smollm2_dir), "--port",
             str(port), "--data-parallel-size", "2", "--no-trace-db"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
        )  # fmt: skip
        try:
            import time

            import httpx

            deadline = time.monotonic() + 300
            health = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                    if health["status"] == "ok":
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.5)
            assert health is not None and health["status"] == "ok", log.read_text()
            assert len(health["engine"]["replicas"]) == 2
        finally:
            proc.terminate()
            proc.wait(60)
