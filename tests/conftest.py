"""Shared fixtures: real data from ../shared/data (or $HOPPERLM_DATA_DIR), prepared once per session."""

from pathlib import Path

import pytest
from shared_data import DATA_DIR


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "tinyshakespeare" / "input.txt").is_file():
        pytest.fail(f"test data not found at {DATA_DIR}; set HOPPERLM_DATA_DIR to the shared data folder")
    return DATA_DIR


@pytest.fixture(scope="session")
def shakespeare_bytes(data_dir, tmp_path_factory) -> Path:
    """Tiny Shakespeare, byte tokenizer, last 10% as validation (nanoGPT's split)."""
    from hopperlm.data.prepare import prepare

    out = tmp_path_factory.mktemp("prepared") / "shakespeare-byte"
    prepare([data_dir / "tinyshakespeare" / "input.txt"], out, tokenizer="byte", progress=False)
    return out
