"""docs/config-reference.md, generated from the config dataclasses' source: every key of every section with its
type, default and the docstring written under the field.

Regenerate with `python -m hopperlm.config.reference > docs/config-reference.md`;
tests/test_config_reference.py fails when the file is stale or a field has no docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from hopperlm.config.optim import ParamGroupConfig
from hopperlm.config.recipe import SECTIONS

COMMAND = "python -m hopperlm.config.reference > docs/config-reference.md"

HEADER = f"""\
# Config reference

<!-- Generated from the field docstrings in hopperlm/config/*.py; do not edit by hand.
     Regenerate: {COMMAND} -->

A recipe (YAML) has up to fourteen sections; every key below may also be set on the command line as
`--section.key value` (e.g. `--train.max_steps 100`). Unknown keys and wrong types are refused with the
field's name. `hopperlm train CONFIG --print-config` prints a recipe with every default filled in.
`null` means "not set": the description says what is chosen then (often by the plan, see
[speed-and-plan.md](speed-and-plan.md)). `model.preset` starts the model section from a preset
(`hopperlm presets`); `model.init_from` from a checkpoint, whose shape then wins over these defaults.
"""


@dataclass(frozen=True)
class Field:
    """One key of a section, as written in the dataclass's source."""

    section: str
    name: str
    type: str
    default: str
    doc: str | None


def _class_node(cls: type) -> tuple[ast.ClassDef, Path]:
    path = Path(inspect.getsourcefile(cls))
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, path
    raise LookupError(f"class {cls.__name__} not found in {path}")


def _type_text(node: ast.expr) -> str:
    """`Literal['a', 'b']` -> `a / b`; `int | None` -> `int or null`; `dict[str, float]` -> `{str: float}`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return f"{_type_text(node.left)} or {_type_text(node.right)}"
    if isinstance(node, ast.Constant) and node.value is None:
        return "null"
    if isinstance(node, ast.Subscript):
        base = ast.unparse(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Literal":
            return " / ".join(str(a.value) for a in args)
        if base == "dict":
            return "{" + ": ".join(_type_text(a) for a in args) + "}"
        if base == "list":
            return f"list of {_type_text(args[0])}"
    return ast.unparse(node)


def _default_text(node: ast.expr | None) -> str:
    """The default as it would be written in YAML: null, true, a bare word, the number as in the source."""
    if node is None:
        return "(required)"
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return value if value else '""'
    factory = next((k.value for k in getattr(node, "keywords", []) if k.arg == "default_factory"), None)
    if isinstance(factory, ast.Lambda):  # field(default_factory=lambda: [0.9, 0.95]): the value it makes
        return ast.unparse(factory.body)
    if isinstance(factory, ast.Name) and factory.id == "list":
        return "[]"
    return ast.unparse(node)


def section_fields(section: str, cls: type | None = None) -> list[Field]:
    """The fields of one config section (or of `cls`, a table's rows inside it), in source order, with the
    string literal under each (or None)."""
    cls = cls or SECTIONS[section]
    node, path = _class_node(cls)
    out = []
    body = node.body
    for i, stmt in enumerate(body):
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        doc = None
        nxt = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            doc = " ".join(inspect.cleandoc(nxt.value.value).split())
        out.append(
            Field(section, stmt.target.id, _type_text(stmt.annotation), _default_text(stmt.value), doc)
        )
    names = [f.name for f in out]
    expected = [f.name for f in dataclasses.fields(cls)]
    if names != expected:
        raise LookupError(
            f"{path}: {cls.__name__}'s annotated fields {names} differ from the dataclass's {expected}"
        )
    return out


# the tables inside a section: each row's keys get a table of their own under the section's
TABLES = {"optim": ("groups", ParamGroupConfig)}


def all_fields() -> list[Field]:
    rows = [f for section, (key, cls) in TABLES.items() for f in section_fields(f"{section}.{key}[]", cls)]
    return [f for section in SECTIONS for f in section_fields(section)] + rows


def missing_docstrings() -> list[str]:
    """`section.key` of every field without a docstring under it."""
    return [f"{f.section}.{f.name}" for f in all_fields() if not f.doc]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole of docs/config-reference.md."""
    lines = [HEADER]
    for section, cls in SECTIONS.items():
        summary = " ".join(inspect.cleandoc(cls.__doc__ or "").split()) if cls.__doc__ else ""
        lines += [f"## {section}", ""]
        if summary and not summary.startswith(f"{cls.__name__}("):  # a dataclass's generated doc says nothing
            lines += [summary, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in section_fields(section):
            cells = [f"`{section}.{f.name}`", _cell(f.type), f"`{_cell(f.default)}`", _cell(f.doc or "")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if section in TABLES:
            key, row = TABLES[section]
            lines += [f"Each row of `{section}.{key}`:", "", "| key | type | default | description |"]
            lines.append("|---|---|---|---|")
            for f in section_fields(section, row):
                cells = [f"`{f.name}`", _cell(f.type), f"`{_cell(f.default)}`", _cell(f.doc or "")]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
