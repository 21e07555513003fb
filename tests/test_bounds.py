"""The house's bounds (STYLE.md): functions a screen long, a loop you can read, and functions given the section they
read rather than the whole Config (the README's 200 lines: tests/test_docs_commands.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hopperlm"
LONGEST_FUNCTION = 100
LOOP_LINES = 350
WHOLE_CONFIG_TAKERS = 15


def functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path, node


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, node in functions()
        if node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert not long, long


def test_the_loop_reads_as_a_loop():
    lines = len((PACKAGE / "train" / "loop.py").read_text().splitlines())
    assert lines <= LOOP_LINES, f"train/loop.py has {lines} lines (bound {LOOP_LINES})"


def takes_whole_config(annotation: ast.expr | None) -> bool:
    return annotation is not None and ast.unparse(annotation).strip("'\"") in ("Config", "Config | None")


def whole_config_takers() -> list[str]:
    """Functions with a parameter annotated Config, and dataclass fields of type Config."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(takes_whole_config(a.annotation) for a in args):
                    out.append(f"{path.relative_to(ROOT)}:{node.name}")
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and takes_whole_config(stmt.annotation):
                        out.append(f"{path.relative_to(ROOT)}:{node.name}.{ast.unparse(stmt.target)}")
    return out


def test_functions_take_the_section_they_read():
    takers = whole_config_takers()
    assert len(takers) <= WHOLE_CONFIG_TAKERS, f"{len(takers)} take the whole Config: {takers}"
