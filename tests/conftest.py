"""Shared fixtures. The default model is fetched once (``make test`` does it before pytest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers such as paged_driver


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (fetched and converted on first use)."""
    from tokenmill.engine.model_fetch import fetch_default_model

    return fetch_default_model()
