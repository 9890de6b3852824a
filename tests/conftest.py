"""Shared fixtures. The default model is fetched once (``make test`` does it before pytest)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run in Triton's CPU interpreter; the variable must be set
# before anything imports triton (kernels read it when they are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository's source folders (kernels/, engine/, ...) are installed as tokenmill.* and must
# never be importable under their own names: `python -m pytest` puts the working directory first
# on sys.path, where kernels/ hides the `kernels` package that transformers imports. Drop it here
# and keep it off in every subprocess a test starts (PYTHONSAFEPATH, Python 3.11+).
_REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO]
os.environ["PYTHONSAFEPATH"] = "1"

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # test helpers such as server_proc


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (fetched and converted on first use)."""
    from tokenmill.engine.model_fetch import fetch_default_model

    return fetch_default_model()
