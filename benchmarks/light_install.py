"""What each role installs: `pip install tokenmill` (the observer) against
`pip install 'tokenmill[engine]'`, each into a fresh venv from the package registries, side by
side in one run: install time, size on disk, and which heavy modules import.

    python benchmarks/light_install.py [--out benchmarks/results/light_install.json]

The wheel is built from this checkout. The engine's torch is the version the Makefile pins
(`TORCH`, the CPU build where the machine has it on disk).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "transformers", "safetensors")
ROLES = {
    "observer": ("", []),
    "engine": ("[engine]", ["torch==2.13.0"]),
}


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def _install(role: str, wheel: Path, work: Path) -> dict:
    extras, first = ROLES[role]
    spec = f"tokenmill{extras}"
    venv = work / role
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    base = _size_mb(venv)
    t0 = time.perf_counter()
    target = f"{spec} @ {wheel.as_uri()}"
    subprocess.run([py, "-m", "pip", "install", "-q", *first, target], check=True, timeout=1800)
    seconds = time.perf_counter() - t0
    probe = f"import importlib.util as u; print(','.join(m for m in {HEAVY!r} if u.find_spec(m)))"
    present = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True)
    version = subprocess.run(
        [str(venv / "bin" / "tokenmill"), "--version"], capture_output=True, text=True
    )
    count = subprocess.run(
        [py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    )
    return {
        "role": role,
        "install": f"pip install '{spec}'" + (f" (after {' '.join(first)})" if first else ""),
        "install_s": round(seconds, 1),
        "size_mb": round(_size_mb(venv) - base, 1),
        "distributions": len(json.loads(count.stdout)),
        "heavy_modules_importable": [m for m in present.stdout.strip().split(",") if m],
        "tokenmill_version": version.stdout.strip(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "light_install.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenmill-install-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(work / "wheels"), str(REPO)],
            check=True,
        )  # fmt: skip
        (wheel,) = (work / "wheels").glob("tokenmill-*.whl")
        wheel_kb = round(wheel.stat().st_size / 1024, 1)
        rows = [_install(role, wheel, work) for role in ROLES]
    obs, eng = rows
    result = {
        "host": platform.node(),
        "python": platform.python_version(),
        "wheel_kb": wheel_kb,
        "roles": rows,
        "size_ratio_observer_to_engine": round(obs["size_mb"] / eng["size_mb"], 3),
        "time_ratio_observer_to_engine": round(obs["install_s"] / eng["install_s"], 3),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
