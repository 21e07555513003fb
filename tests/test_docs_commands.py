"""Every shell command shown in README.md and docs/*.md runs here, so the docs cannot rot.

The convention the docs follow:
- shell commands live only in ```bash fenced blocks (```sh, ```shell and ```console are refused);
- a block whose first line is `# needs: gpu`, `# needs: network`, `# needs: model` (a downloaded Hugging Face
  model) or `# needs: llama.cpp` (its binaries, or Ollama) is not run: the test lists it with its reason and counts it;
- the README's "two commands" blocks (a virtual environment, `bash scripts/setup.sh && python3 -m hopperlm demo`;
  `bash scripts/test.sh`) are not run either: the first installs packages (network) and trains for about 100 s,
  the second is this test suite, which must not call itself; CI runs both as they are written;
- the README's first-run block also runs from a bare clone (no ../shared, no $HOPPERLM_DATA_DIR, no network:
  the demo's offline text), as a user's first clone has it (test_first_run_works_in_a_bare_clone);
- a single line ending in `# needs: X` (e.g. `ollama create ...  # needs: ollama`) is not run; the rest of its
  block is;
- every other block runs with `bash -e -o pipefail`, the blocks of one file in file order, in one fresh
  workspace laid out like a checkout beside shared/: TMP/main with `configs` and `scripts` linked from the
  repository, and TMP/shared/data linked to the real data ($HOPPERLM_DATA_DIR, else ../shared/data), so
  `../shared/data/...` resolves as in the docs. `hopperlm` is this checkout's `python3 -m hopperlm`;
- the blocks run in a fresh virtual environment holding only what `bash scripts/setup.sh` installs: hopperlm's
  dependencies with the extras setup.sh names, and theirs (linked from this environment, which the dev extra
  filled). So a docs command that needs an extra setup.sh leaves out fails here as on a user's machine, with
  the package's ModuleNotFoundError (this is how `export --format gguf` once failed right after setup).
Commands that train are written in the docs with small step counts, so each runs in seconds on a CPU.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from shared_data import DATA_DIR

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS = {"gpu", "network", "model", "llama.cpp", "ollama"}
LINE_NEEDS = re.compile(r"\s#\s*needs:\s*(\S+)\s*$")  # at the end of one line: that line is not run
# blocks run by CI as they are written, never from here (see the module docstring)
TWO_COMMANDS = {
    "python3 -m venv .venv && . .venv/bin/activate\nbash scripts/setup.sh && python3 -m hopperlm demo": (
        "makes a virtual environment, installs packages (network) and trains for ~100 s"
    ),
    "bash scripts/test.sh": "is this test suite, which must not call itself",
}
SETUP_SH = REPO / "scripts" / "setup.sh"
FENCE = re.compile(r"^(`{3,})(.*)$")
BLOCK_TIMEOUT_S = 900  # only a hang reaches it: a busy machine runs a block slowly, not forever


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """Why this block is not run, or None when it runs."""
        first = self.text.strip().split("\n", 1)[0].strip()
        match = re.fullmatch(r"#\s*needs:\s*(\S+)", first)
        if match:
            return f"needs: {match.group(1)}"
        if self.path.name == "README.md" and self.text.strip() in TWO_COMMANDS:
            return f"one of the two commands: {TWO_COMMANDS[self.text.strip()]}"
        return None

    @property
    def script(self) -> str:
        """The text to run: a line that ends in `# needs: X` becomes a no-op saying so."""
        lines = []
        for line in self.text.split("\n"):
            match = LINE_NEEDS.search(line)
            lines.append(f": not run here, needs {match.group(1)}" if match else line)
        return "\n".join(lines)


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, in file order (fences start a line; ``` inside a line is text)."""
    blocks, open_fence, lang, start, body = [], None, "", 0, []
    for number, line in enumerate(path.read_text().split("\n"), 1):
        match = FENCE.match(line)
        if open_fence is None:
            if match:
                open_fence, lang, start, body = match.group(1), match.group(2).strip(), number, []
        elif match and match.group(1) == open_fence and not match.group(2).strip():
            blocks.append(Block(path, start, lang, "\n".join(body)))
            open_fence = None
        else:
            body.append(line)
    assert open_fence is None, f"{path.relative_to(REPO)}:{start}: a code fence is never closed"
    return blocks


def bash_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.lang == "bash"]


def test_shell_commands_are_in_bash_blocks_with_known_needs():
    problems = []
    for path in DOC_FILES:
        for block in fenced_blocks(path):
            if block.lang in ("sh", "shell", "console", "zsh", "shell-session"):
                problems.append(
                    f"{block.where}: ```{block.lang} block; write shell commands in ```bash blocks"
                )
            if block.lang == "bash":
                first = block.text.strip().split("\n", 1)[0].strip()
                match = re.fullmatch(r"#\s*needs:\s*(\S+)", first)
                if match and match.group(1) not in NEEDS:
                    problems.append(
                        f"{block.where}: '# needs: {match.group(1)}' is not one of {sorted(NEEDS)}"
                    )
                lines = block.text.split("\n")
                for k, line in enumerate(lines):
                    marked = LINE_NEEDS.search(line) if k or not match else None
                    if marked and marked.group(1) not in NEEDS:
                        problems.append(
                            f"{block.where}: '# needs: {marked.group(1)}' is not one of {sorted(NEEDS)}"
                        )
                    if marked and k and lines[k - 1].rstrip().endswith("\\"):
                        problems.append(
                            f"{block.where}: a '# needs:' line continues the line above (\\); the continued "
                            "command would run without it. Write the command on one line"
                        )
    assert not problems, "\n".join(problems)


def headings(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code blocks)."""
    anchors, fenced = set(), None
    for line in path.read_text().split("\n"):
        match = FENCE.match(line)
        if match:
            fenced = None if fenced == match.group(1) else (fenced or match.group(1))
            continue
        if fenced is None and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_resolve():
    problems = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                problems.append(f"{path.relative_to(REPO)}: link to {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in headings(linked):
                problems.append(f"{path.relative_to(REPO)}: link to {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_not_run_blocks_are_counted():
    """The blocks this suite does not run, with why; the README's two commands are among them."""
    skipped = [(b.where, b.not_run) for path in DOC_FILES for b in bash_blocks(path) if b.not_run]
    print(f"\n{len(skipped)} bash block(s) not run:")
    for where, why in skipped:
        print(f"  {where}: {why}")
    readme = [b.text.strip() for b in bash_blocks(REPO / "README.md")]
    assert all(command in readme for command in TWO_COMMANDS), (
        "the README's two commands moved; update TWO_COMMANDS"
    )
    runnable = [b for path in DOC_FILES for b in bash_blocks(path) if not b.not_run]
    assert runnable, "no runnable bash block found in the docs"


def setup_extras() -> list[str]:
    """The extras `bash scripts/setup.sh` installs (without --dev), read from the script itself."""
    match = re.search(r'^extras="([^"]*)"', SETUP_SH.read_text(), re.M)
    assert match, 'scripts/setup.sh has no extras="..." line; update setup_extras() to read it'
    return [e for e in match.group(1).split(",") if e]


def setup_distributions(extras: list[str]) -> dict[str, metadata.Distribution]:
    """What setup.sh's `pip install -e .[EXTRAS]` brings, as installed here: hopperlm's requirements with these
    extras (read from pyproject.toml, what pip reads: an installed hopperlm's metadata can be older) and theirs.
    A requirement not installed here is left out (this environment holds the dev extra, a superset)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    found: dict[str, metadata.Distribution] = {}
    asked: dict[str, set[str]] = {}
    todo = [(req.name, set(req.extras)) for req in map(Requirement, wanted)]
    while todo:
        name, wanted_extras = todo.pop()
        key = canonicalize_name(name)
        if key in asked and wanted_extras <= asked[key]:
            continue
        asked[key] = asked.get(key, set()) | wanted_extras
        try:
            dist = found.get(key) or metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[key] = dist
        environments = [{"extra": e} for e in sorted(asked[key])] or [{"extra": ""}]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate(env) for env in environments):
                todo.append((req.name, set(req.extras)))
    return found


def setup_environment(root: Path) -> Path:
    """A fresh virtual environment (no pip) whose site-packages links exactly setup.sh's distributions from this
    environment (hopperlm's requirements, not hopperlm: it comes from the checkout on PYTHONPATH, as setup.sh's
    editable install has it).
    Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    for dist in setup_distributions(setup_extras()).values():
        tops = set()
        for file in dist.files or []:
            top = file.parts[0] if file.parts else ".."
            if top in ("..", "__pycache__"):
                continue  # scripts outside site-packages
            tops.add(top)
        for top in tops:
            source, link = Path(dist.locate_file(top)), site / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def setup_python(tmp_path_factory) -> Path:
    return setup_environment(tmp_path_factory.mktemp("setup-venv") / "venv")


def test_the_docs_environment_holds_what_setup_installs(setup_python: Path):
    """The environment the docs' blocks run in imports hopperlm, torch and setup.sh's extras (gguf: `export
    --format gguf`; transformers: an export loaded with from_pretrained), and not what only the dev extra brings
    (pytest, torchao)."""
    assert {"gguf", "hf"} <= set(setup_extras()), (
        "scripts/setup.sh no longer installs gguf and transformers, which `export --format gguf` and the "
        "docs' transformers block need"
    )
    probe = (
        "import importlib.util as u, hopperlm, torch, gguf, lm_eval, transformers\n"
        "print(sorted(m for m in ('pytest', 'torchao') if u.find_spec(m)))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([setup_python, "-c", probe], env=env, capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"dev-only packages visible in the setup environment: {done.stdout}"


def workspace(tmp: Path, python: str = sys.executable) -> tuple[Path, dict[str, str]]:
    """TMP/main (configs and scripts linked from the repository) beside TMP/shared/data, and the environment in
    which `hopperlm` is this checkout's `python3 -m hopperlm` (under PYTHON; `python3` is PYTHON too)."""
    main = tmp / "main"
    main.mkdir()
    for name in ("configs", "scripts"):
        (main / name).symlink_to(REPO / name, target_is_directory=True)
    (tmp / "shared").mkdir()
    (tmp / "shared" / "data").symlink_to(DATA_DIR.resolve(), target_is_directory=True)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "hopperlm"
    launcher.write_text(f'#!/bin/sh\nexec "{python}" -m hopperlm "$@"\n')
    launcher.chmod(0o755)
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(python)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "HOPPERLM_DATA_DIR": str(tmp / "shared" / "data"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "MPLBACKEND": "Agg",
    }
    return main, env


@pytest.mark.slow
@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(REPO)) for p in DOC_FILES])
def test_doc_commands_run(path: Path, tmp_path: Path, setup_python: Path):
    blocks = [b for b in bash_blocks(path) if not b.not_run]
    if not blocks:
        pytest.skip(f"{path.relative_to(REPO)} has no bash block to run")
    if not DATA_DIR.is_dir():
        pytest.skip(f"the docs' commands read ../shared/data; {DATA_DIR} is missing (set HOPPERLM_DATA_DIR)")
    cwd, env = workspace(tmp_path, str(setup_python))
    for block in blocks:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.script],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        assert done.returncode == 0, (
            f"{block.where}: the bash block failed (exit {done.returncode}) in an environment holding what "
            "scripts/setup.sh installs; fix the docs, the code or setup.sh's extras, or mark a block (or one "
            f"line) that cannot run here with '# needs: {'|'.join(sorted(NEEDS))}'\n--- block\n{block.text}\n"
            f"--- stdout (tail)\n{done.stdout[-3000:]}\n--- stderr (tail)\n{done.stderr[-3000:]}"
        )


README_MAX_LINES = 200  # a README read top to bottom; the detail lives in docs/
# our own process (GPU leases and their calls, issue numbers) stays out of what users read: bench/gpu/README.md,
# written for maintainers, keeps it
PROCESS_WORDS = re.compile(r"\blease\b|\bcalls? [A-F]\b|\bissue #?\d+|GPU window|campaign\.sh call", re.I)


def test_the_readme_fits_200_lines_and_speaks_the_users_words():
    lines = (REPO / "README.md").read_text().split("\n")
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    found = [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}"
        for path in DOC_FILES
        for number, line in enumerate(path.read_text().split("\n"), 1)
        for match in [PROCESS_WORDS.search(line)]
        if match
    ]
    assert not found, "the project's own process words in user docs (keep them in bench/gpu/README.md):\n" + (
        "\n".join(found)
    )


def first_run_block() -> Block:
    """The README's first block that runs (after the two commands): the first run of a fresh clone."""
    block = next(b for b in bash_blocks(REPO / "README.md") if not b.not_run)
    assert "hopperlm demo" in block.text, (
        f"{block.where}: the README's first run no longer starts with the demo"
    )
    return block


def bare_clone(tmp: Path) -> Path:
    """TMP/clone holding what a clone holds for its first run (the package with its recipes, configs/ as the link
    the repository has, pyproject.toml), and no ../shared beside it."""
    clone = tmp / "clone"
    clone.mkdir()
    shutil.copytree(REPO / "hopperlm", clone / "hopperlm", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "configs").symlink_to(os.readlink(REPO / "configs"), target_is_directory=True)
    shutil.copy(REPO / "pyproject.toml", clone / "pyproject.toml")
    assert not (tmp / "shared").exists()
    return clone


@pytest.mark.slow
def test_first_run_works_in_a_bare_clone(tmp_path: Path, setup_python: Path):
    """The README's first-run block, as written, from a clone with nothing beside it: no ../shared/data, no
    $HOPPERLM_DATA_DIR, an empty cache, and no network (a proxy that refuses: the demo's download fails at once),
    so the demo trains on its offline text and the block's other commands on what the demo prepared."""
    clone = bare_clone(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hopperlm").write_text(f'#!/bin/sh\nexec "{setup_python}" -m hopperlm "$@"\n')
    (bin_dir / "hopperlm").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HOPPERLM_DATA_DIR"}
    refused = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(clone), MPLBACKEND="Agg",
               HOPPERLM_CACHE_DIR=str(tmp_path / "cache"), https_proxy=refused, HTTPS_PROXY=refused,
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))  # fmt: skip
    block = first_run_block()
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.script], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, (
        f"{block.where}: the first run failed in a bare clone (exit {done.returncode})\n--- stdout (tail)\n"
        f"{done.stdout[-3000:]}\n--- stderr (tail)\n{done.stderr[-3000:]}"
    )
    assert "training on Python's own language-reference text" in done.stdout  # the offline fallback, said
    assert "done: max_steps after 20 steps" in done.stdout and "ROMEO:" in done.stdout
