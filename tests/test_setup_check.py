"""scripts/installed.py lets scripts/setup.sh skip pip only when everything it would install is there."""

import importlib.util
import subprocess
import sys

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # 3.10: the same parser, before it joined the standard library
    import tomli as tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_check():
    spec = importlib.util.spec_from_file_location("installed_check", REPO / "scripts" / "installed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_this_environment_is_complete_and_the_script_says_so():
    done = subprocess.run(
        [sys.executable, "scripts/installed.py", "--extras", "dev"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_a_missing_or_old_package_or_another_checkout_sends_setup_to_pip(monkeypatch, tmp_path):
    check = load_check()
    real = metadata.version

    def without_peft(name):
        if name == "peft":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(check.metadata, "version", without_peft)
    assert check.missing(["dev"], extra=[]) == "peft is not installed"
    assert check.missing([], extra=[]) is None  # peft is a dev requirement only
    # what setup.sh installs beside pyproject.toml (mup, without its dependencies) is checked too
    assert check.missing([], extra=["mup==9.9"]) == "mup 1.0.0 does not satisfy mup==9.9"

    monkeypatch.setattr(check.metadata, "version", lambda name: "0.0.1" if name == "numpy" else real(name))
    assert check.missing([], extra=[]) == "numpy 0.0.1 does not satisfy numpy>=1.26"

    def without_gguf(name):  # setup.sh without --dev installs the extras the docs use: gguf among them
        if name == "gguf":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(check.metadata, "version", without_gguf)
    assert check.missing(["gguf", "eval"], extra=[]) == "gguf is not installed"

    monkeypatch.setattr(check.metadata, "version", real)
    monkeypatch.setattr(check, "ROOT", tmp_path)  # a checkout hopperlm was not installed from
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    assert check.missing([], extra=[]) == f"hopperlm is not installed editable from {tmp_path}"


def test_setup_installs_the_extras_the_docs_commands_use():
    """`export --format gguf`, `eval --tasks` and an export loaded in transformers run in the docs' blocks: plain
    setup.sh installs their extras, and transformers comes from hopperlm's own extras (lm-eval 0.4.13 names it in
    its `hf` extra only, which hopperlm's eval extra does not ask for)."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'extras="gguf,eval,hf"' in setup
    docs = " ".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    assert "--format gguf" in docs and "--tasks" in docs and "AutoModelForCausalLM.from_pretrained(" in docs
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("hf", "eval"):
        assert any(r.startswith("transformers") for r in optional[extra]), extra
