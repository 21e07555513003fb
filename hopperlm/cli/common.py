"""What every verb shares: the log line printer, where named recipes live, and how a verb is registered."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from hopperlm.errors import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def log(line: str) -> None:
    print(line, flush=True)


def resolve_recipe(name_or_path: str) -> Path:
    """A YAML path, or the name of a recipe in configs/ (e.g. `shakespeare-char`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = CONFIGS_DIR / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(f"config {name_or_path} not found; pass a YAML file or one of: {', '.join(known)}")


RESUME_HELP = "continue from the run's latest checkpoint, or from PATH; `auto`: only if it has checkpoints"


def add_verb(
    verbs,
    common: argparse.ArgumentParser,
    name: str,
    func: Callable,
    help: str,
    *,
    overrides: str | None = None,
    config: str | None = None,
    resume: bool = False,
    description: str = "",
) -> argparse.ArgumentParser:
    """Register one verb that runs `func(args)`, or `func(args, overrides)` when `overrides` says what extra
    `--section.key value` pairs apply to; `config` is the help of a positional recipe, `resume` adds --resume."""
    if overrides:
        description = f"{description} Extra --section.key value pairs override {overrides}.".strip()
    p = verbs.add_parser(name, parents=[common], help=help, description=description or None)
    if config:
        p.add_argument("config", help=config)
    if resume:
        p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH", help=RESUME_HELP)
    p.set_defaults(func=func, takes_overrides=overrides is not None)
    return p
