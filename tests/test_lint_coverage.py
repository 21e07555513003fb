"""The linter sees every Python file we ship and test: ruff skips folders it takes for build output (`dist`,
`build`, `site-packages`, ...) without a word, which is how hopperlm/dist/ went unlinted for weeks."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("hopperlm", "tests", "bench")  # the folders scripts/test.sh lints


def ruff_files() -> set[Path]:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {Path(line.strip()).resolve() for line in out.splitlines() if line.strip().endswith(".py")}


def test_ruff_checks_every_python_file():
    pytest.importorskip("ruff", reason="ruff comes with the dev extra (scripts/test.sh installs it)")
    ours = {
        p.resolve()
        for folder in LINTED
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    missed = sorted(str(p.relative_to(ROOT)) for p in ours - ruff_files())
    assert not missed, f"ruff does not check {missed}: rename the folder or list it in [tool.ruff] include"


def test_no_package_named_like_build_output():
    """Linters and packagers take these names for output folders (STYLE.md)."""
    taken = {"dist", "build", "site", "site-packages", "node_modules"}
    named = [p for p in (ROOT / "hopperlm").rglob("*") if p.is_dir() and p.name in taken]
    assert not named, f"rename {named}: tools skip folders with these names"
