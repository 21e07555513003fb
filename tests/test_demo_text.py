"""Every branch of the demo-data resolution order, with the network replaced by fakes (never touched)."""

import hashlib
import io
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from shared_data import DATA_DIR

from hopperlm.data import demo_text
from hopperlm.data.demo_text import TINY_SHAKESPEARE_SHA256, TINY_SHAKESPEARE_URL, resolve_demo_text
from hopperlm.errors import DataError

SHAKESPEARE = DATA_DIR / "tinyshakespeare" / "input.txt"


class FakeNet:
    """Stands in for urllib.request.urlopen: serves fixed bytes or raises, and records the calls."""

    def __init__(self, body: bytes | None = None) -> None:
        self.body, self.calls = body, []

    def __call__(self, url, timeout=None):
        self.calls.append((url, timeout))
        if self.body is None:
            raise urllib.error.URLError("no network in tests")
        return io.BytesIO(self.body)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """No shared data dir, cache in tmp_path, network that fails unless a test says otherwise."""
    monkeypatch.delenv("HOPPERLM_DATA_DIR", raising=False)
    monkeypatch.setattr(demo_text, "CHECKOUT_DATA", None)  # (this checkout has ../shared/data beside it)
    monkeypatch.setenv("HOPPERLM_CACHE_DIR", str(tmp_path / "cache"))
    net = FakeNet()
    monkeypatch.setattr(urllib.request, "urlopen", net)
    return net


def cached_file(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "tinyshakespeare" / "input.txt"


def test_shared_copy_matches_the_published_checksum():
    assert hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest() == TINY_SHAKESPEARE_SHA256


def test_given_path_wins(env, tmp_path):
    logs = []
    assert resolve_demo_text(SHAKESPEARE, log=logs.append) == SHAKESPEARE
    assert len(logs) == 1 and "given" in logs[0]
    with pytest.raises(DataError, match="nope.txt does not exist"):
        resolve_demo_text(str(tmp_path / "nope.txt"), log=logs.append)
    assert env.calls == []


def test_shared_data_dir(env, monkeypatch):
    monkeypatch.setenv("HOPPERLM_DATA_DIR", str(DATA_DIR))
    logs = []
    assert resolve_demo_text(None, log=logs.append) == DATA_DIR / "tinyshakespeare" / "input.txt"
    assert len(logs) == 1 and "HOPPERLM_DATA_DIR" in logs[0]
    assert env.calls == []


def test_shared_data_dir_without_the_file_falls_through(env, monkeypatch, tmp_path):
    monkeypatch.setenv("HOPPERLM_DATA_DIR", str(tmp_path / "empty"))
    path = resolve_demo_text(None, log=lambda _: None)
    assert path.name == "pydoc-topics.txt"


def test_verified_cache_is_used(env, tmp_path):
    cached_file(tmp_path).parent.mkdir(parents=True)
    cached_file(tmp_path).write_bytes(SHAKESPEARE.read_bytes())
    logs = []
    assert resolve_demo_text(None, log=logs.append) == cached_file(tmp_path)
    assert len(logs) == 1 and "cache" in logs[0]
    assert env.calls == []


def test_download_verified_and_cached_atomically(env, tmp_path):
    env.body = SHAKESPEARE.read_bytes()
    cached_file(tmp_path).parent.mkdir(parents=True)
    cached_file(tmp_path).write_bytes(b"a damaged earlier copy")  # wrong checksum: replaced
    logs = []
    path = resolve_demo_text(None, log=logs.append)
    assert path == cached_file(tmp_path)
    assert path.read_bytes() == SHAKESPEARE.read_bytes()
    assert env.calls == [(TINY_SHAKESPEARE_URL, 10)]
    assert len(logs) == 1 and "downloaded" in logs[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["input.txt"]  # no temp file left
    # Second call: served from the cache, no network.
    assert resolve_demo_text(None, log=logs.append) == path and len(env.calls) == 1


def test_wrong_download_is_discarded(env, tmp_path):
    env.body = b"<html>captive portal</html>"
    logs = []
    path = resolve_demo_text(None, log=logs.append)
    assert not cached_file(tmp_path).exists()
    assert path == tmp_path / "cache" / "pydoc-topics.txt"
    assert len(logs) == 2 and "wrong sha256" in logs[0] and "pydoc_data.topics" in logs[1]


def test_offline_falls_back_to_pydoc_topics(env, tmp_path):
    from pydoc_data.topics import topics

    logs = []
    path = resolve_demo_text(None, log=logs.append)
    assert path == tmp_path / "cache" / "pydoc-topics.txt"
    text = path.read_text(encoding="utf-8")
    assert text == "\n\n".join(topics[k] for k in sorted(topics))
    assert len(text) > 100_000
    assert logs == [logs[0]] and "no network" in logs[0] and "pydoc_data.topics" in logs[0]
    assert len(env.calls) == 1


def test_xdg_cache_home_is_the_default_root(env, monkeypatch, tmp_path):
    monkeypatch.delenv("HOPPERLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_text.cache_dir() == tmp_path / "xdg" / "hopperlm"
    assert resolve_demo_text(None, log=lambda _: None) == tmp_path / "xdg" / "hopperlm" / "pydoc-topics.txt"


def test_the_shared_data_beside_a_checkout_comes_after_the_env_and_before_the_cache(
    env, monkeypatch, tmp_path
):
    monkeypatch.setattr(demo_text, "CHECKOUT_DATA", DATA_DIR)
    logs = []
    assert resolve_demo_text(None, log=logs.append) == SHAKESPEARE
    assert "beside this checkout" in logs[0] and env.calls == []
    monkeypatch.setenv("HOPPERLM_DATA_DIR", str(tmp_path / "elsewhere"))  # without the file: passed over
    assert resolve_demo_text(None, log=lambda _: None) == SHAKESPEARE


def test_the_fallback_line_says_how_to_give_the_text_and_that_losses_do_not_compare(env):
    logs = []
    path = resolve_demo_text(None, log=logs.append)
    assert "--data PATH" in logs[-1] and "$HOPPERLM_DATA_DIR" in logs[-1]
    assert "not comparable to Tiny Shakespeare's" in logs[-1]
    described = demo_text.describe_text(path)
    assert described["name"].startswith("Python's language reference") and len(described["sha256"]) == 64
    assert demo_text.describe_text(SHAKESPEARE)["name"] == "Tiny Shakespeare"
