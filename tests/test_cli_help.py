"""`hopperlm VERB --help` is complete: every option and positional of every verb (and of `tokenizer train` /
`extend`) says what it does, every option with a default states it, `prepare` names every input format it reads (the formats docs/pretraining.md lists),
and the flags whose meaning depends on the format say so."""

import argparse
import re
from pathlib import Path

from hopperlm.cli import build_parser
from hopperlm.cli.common import has_stated_default
from hopperlm.data.sources import FILE_SUFFIXES

REPO = Path(__file__).resolve().parents[1]
NOT_ARGUMENTS = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("hopperlm",)):
    """(command words, parser) for the program, each verb and each verb's sub-verbs, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def verb(*words: str) -> argparse.ArgumentParser:
    return dict(parsers(build_parser()))[("hopperlm", *words)]


def test_every_option_and_positional_has_help():
    walked = list(parsers(build_parser()))
    assert {("hopperlm", "tokenizer", "train"), ("hopperlm", "tokenizer", "extend")} <= {p for p, _ in walked}
    missing = [
        f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in walked
        for action in parser._actions
        if not isinstance(action, NOT_ARGUMENTS) and not (action.help or "").strip()
    ]
    assert not missing, "arguments without help text:\n" + "\n".join(missing)


def test_every_option_with_a_default_states_it():
    """In its own words or as `(default: X)`; the issue's examples spelled out: prepare's --tokenizer,
    --val-fraction and --shard-tokens, generate --num-samples, demo --samples, and export's --max-shard-size with
    its unit."""
    unstated = []
    for path, parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, NOT_ARGUMENTS) or not has_stated_default(action):
                continue
            if "default" not in formatter._expand_help(action).lower():
                unstated.append(
                    f"{' '.join(path)} {'/'.join(action.option_strings)} (default {action.default!r})"
                )
    assert not unstated, "options whose help does not state their default:\n" + "\n".join(unstated)

    def help_of(words: tuple[str, ...], flag: str) -> str:
        text = " ".join(verb(*words).format_help().split())
        return text[text.index(f" {flag} ") :]

    assert "(default: byte" in help_of(("prepare",), "--tokenizer")
    assert "(default: 0.1)" in help_of(("prepare",), "--val-fraction")
    assert "(default: 100,000,000)" in help_of(("prepare",), "--shard-tokens")
    assert "default: 1)" in help_of(("generate",), "--num-samples")
    assert "(default: 3)" in help_of(("demo",), "--samples")
    assert re.search(
        r"in bytes with a unit: 500MB, 5GB.*\(default: 5GB\)", help_of(("export",), "--max-shard-size")
    )


def test_prepare_help_names_every_input_format_the_docs_list():
    help_text = " ".join(verb("prepare").format_help().split())  # (argparse wraps lines)
    docs = (REPO / "docs" / "pretraining.md").read_text()
    section = docs[docs.index("## Preparing data") :]
    section = section[: section.index("\n\n")]  # its first paragraph: what prepare reads
    for suffix in FILE_SUFFIXES:
        assert re.search(rf"{re.escape(suffix)}\b", help_text), f"prepare --help does not name {suffix}"
        assert f"`{suffix}`" in section, f"docs/pretraining.md's Preparing data does not list {suffix}"
    assert "save_to_disk" in help_text and "hf:NAME" in help_text


def test_flags_that_depend_on_the_format_say_how():
    def help_of(parser: argparse.ArgumentParser, dest: str) -> str:
        return next(a.help for a in parser._actions if a.dest == dest)

    for words in (("prepare",), ("tokenizer", "train"), ("tokenizer", "extend")):
        assert "TSV/CSV" in help_of(verb(*words), "text_field"), words
    assert "NAME.gguf" in help_of(verb("export"), "out")
    assert "ollama create -q q4_K_M" in help_of(verb("export"), "outtype")
