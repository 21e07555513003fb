"""Shared fixtures: real data from ../shared/data (or $HOPPERLM_DATA_DIR), prepared once per session."""

from collections import Counter
from pathlib import Path

import pytest
from shared_data import DATA_DIR


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with the most slow tests first. scripts/test.sh runs 2 workers with --dist loadfile: each file
    goes whole to the next free worker, in this order, so a long file handed out last runs alone while the other
    worker idles (once the kill -9 test's 130 s, at the end of CI); long files first, short ones last, even out
    the workers' ends."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's tests stay together, in their order


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "tinyshakespeare" / "input.txt").is_file():
        pytest.fail(f"test data not found at {DATA_DIR}; set HOPPERLM_DATA_DIR to the shared data folder")
    return DATA_DIR


@pytest.fixture(scope="session")
def shakespeare_bytes(data_dir, tmp_path_factory) -> Path:
    """Tiny Shakespeare, byte tokenizer, last 10% as validation (nanoGPT's split)."""
    from hopperlm.data.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("prepared") / "shakespeare-byte"
    prepare(
        [data_dir / "tinyshakespeare" / "input.txt"], out, PrepareOptions(tokenizer="byte"), progress=False
    )
    return out


@pytest.fixture(scope="session")
def tinyllama_hf(data_dir, tmp_path_factory) -> Path:
    """A tiny random Llama (2 blocks, d=64) with TinyLlama-1.1B-Chat's tokenizer (32,000 pieces, a chat
    template), saved like a Hub checkpoint: the stand-in for TinyLlama in offline tests."""
    from hf_tiny import save_hf, tiny_hf_model

    model = tiny_hf_model("tinyllama", vocab_size=32000, max_position_embeddings=512)
    out = tmp_path_factory.mktemp("hf") / "tinyllama-tiny"
    return save_hf(model, out, tokenizer_from=data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0")
