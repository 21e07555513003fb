"""A recipe's YAML rewritten with what a sweep found, everything else as written: ruamel.yaml's round trip keeps
the comments, key order, quotes and indentation (`hopperlm sweep` writes RECIPE.tuned.yaml with it, `sweep
--mixture` sets data.mixture, and `sweep --widths` names its forecast). The overrides are load_config's
`--section.key value` arguments."""

from __future__ import annotations

from io import StringIO
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import ScalarNode
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.util import load_yaml_guess_indent


def override_items(overrides: list[str]) -> list[tuple[str, str, str]]:
    """(section, key, value as written) of each `--section.key value` or `--section.key=value` override, in
    order; the overrides are load_config's, already checked by it."""
    items, args = [], iter(overrides)
    for arg in args:
        name, eq, text = arg[2:].partition("=")
        if not eq:
            text = next(args)
        section, _, key = name.partition(".")
        items.append((section, key, text))
    return items


def tuned_recipe_text(text: str, *, lr: float, overrides: list[str], note: str) -> str:
    """The recipe's YAML with `overrides` set as the sweep's runs had them (a model.preset override replaces the
    model section, as load_config does) and optim.lr set to `lr` with `note` above it (optim.groups' LRs are
    multiples of it, so they move with it); comments, key order and everything else as written."""
    yaml, doc = round_trip(text)
    items = override_items(overrides)
    if any((section, key) == ("model", "preset") for section, key, _ in items):
        doc["model"] = CommentedMap()
    for section, key, written in items:
        set_value(doc, section, key, override_value(yaml, written))
    set_value(doc, "optim", "lr", lr, comment=note, indent=yaml.map_indent)
    return dump(yaml, doc)


def set_key(text: str, section: str, key: str, value: Any, *, comment: str | None = None) -> str:
    """The YAML text with `section.key` set to `value` (a new key goes last in its section, a new section last),
    `comment` above it; everything else as written."""
    yaml, doc = round_trip(text)
    set_value(doc, section, key, value, comment=comment, indent=yaml.map_indent)
    return dump(yaml, doc)


def round_trip(text: str) -> tuple[YAML, CommentedMap]:
    """(ruamel.yaml's round-trip YAML indenting as `text` does, `text` loaded by it): comments, key order and
    quotes kept."""
    yaml = YAML()  # typ "rt"
    yaml.preserve_quotes = True
    yaml.width = 4096  # a long value or flow list stays on its line
    yaml.representer.add_representer(type(None), represent_null)  # `key: null` as written, not `key:`
    doc = yaml.load(text) or CommentedMap()
    # the sections' keys' column; the lists' indent and dash offset as ruamel guesses them, where there are lists
    mapping = next((v.lc.col for v in doc.values() if isinstance(v, CommentedMap) and v), 2)
    _, sequence, dash = load_yaml_guess_indent(text)
    if dash is None:
        sequence, dash = mapping, 0
    yaml.indent(mapping=mapping, sequence=sequence, offset=dash)
    return yaml, doc


def represent_null(representer: RoundTripRepresenter, _: None) -> ScalarNode:
    return representer.represent_scalar("tag:yaml.org,2002:null", "null")


def override_value(yaml: YAML, text: str) -> Any:
    """An override's value as written (1e-3 stays 1e-3, for load_config to read as it reads the command line);
    the text itself where it is not YAML, as load_config takes it."""
    try:
        return yaml.load(text)
    except YAMLError:
        return text


def set_value(
    doc: CommentedMap, section: str, key: str, value: Any, *, comment: str | None = None, indent: int = 2
) -> None:
    """`section.key` set to `value` in the loaded YAML `doc`, `comment` (lines) above it at column `indent`."""
    if not isinstance(doc.get(section), CommentedMap):  # absent, or `section:` with nothing under it
        doc[section] = CommentedMap()
    doc[section][key] = value
    if comment:
        doc[section].yaml_set_comment_before_after_key(key, before=comment, indent=indent)


def dump(yaml: YAML, doc: CommentedMap) -> str:
    out = StringIO()
    yaml.dump(doc, out)
    return out.getvalue()
