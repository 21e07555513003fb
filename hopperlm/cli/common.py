"""What every verb shares: the log line printer, where named recipes live, how a verb is registered, and the
checked numbers its flags take."""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from hopperlm.errors import ConfigError

if TYPE_CHECKING:
    from hopperlm.config import Config

# the recipes ship inside the package (a wheel or `pip install .` has them too); configs/ in the repository is a
# link to this folder
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "recipes"


def log(line: str) -> None:
    print(line, flush=True)


def run_config(name_or_path: str, overrides: list[str]):
    """The config a verb that runs or plans a run starts from: a recipe (a YAML path or a shipped recipe's
    name) with its --section.key overrides, and its model.init_from resolved (the checkpoint's shape filled
    in), once, here."""
    from hopperlm.config import load_config
    from hopperlm.interop.init_from import resolve_init_from

    return resolve_init_from(load_config(resolve_recipe(name_or_path), overrides))


def resolve_recipe(name_or_path: str) -> Path:
    """A YAML path, or the name of a recipe that ships with hopperlm (hopperlm/recipes/, linked as configs/ in the
    repository), e.g. `shakespeare-char`; works from any folder and from an installed wheel."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = CONFIGS_DIR / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(path.stem, known, n=1)
    nearest = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        f"config {name_or_path} not found; {nearest}pass a YAML file or one of: {', '.join(known)}"
    )


DEVICE_HELP = "auto (default: the GPU if torch sees one, else the CPU) | cpu | cuda | cuda:N"
RESUME_HELP = "continue from the run's latest checkpoint, or from PATH; `auto`: only if it has checkpoints"
PRINT_CONFIG_HELP = (
    "print the resolved config as YAML (defaults, overrides and model.init_from filled in), then exit"
)


def printed_config(args: argparse.Namespace, cfg: Config) -> bool:
    """--print-config: print `cfg` (a resolved Config) as YAML and return True, so the verb stops there."""
    if not getattr(args, "print_config", False):
        return False
    from hopperlm.config import config_yaml

    sys.stdout.write(config_yaml(cfg))
    sys.stdout.flush()
    return True


class StatesDefaults(argparse.HelpFormatter):
    """`--help` states each option's default, `(default: 3)` after its text, unless the text already says it in
    its own words; a flag (off unless given), a repeatable option (none unless given) and one without a default
    state none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if has_stated_default(action) and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


def has_stated_default(action: argparse.Action) -> bool:
    """An option whose default is a value worth stating (not None, off, an empty list or suppressed)."""
    default = action.default  # (by identity: 0 is a default to state, False is a flag's "off")
    unstated = default is None or default is False or default is argparse.SUPPRESS or default == []
    return bool(action.option_strings) and not unstated


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
    print_config: bool = False,
    description: str = "",
) -> argparse.ArgumentParser:
    """Register one verb that runs `func(args)`, or `func(args, overrides)` when `overrides` says what extra
    `--section.key value` pairs apply to; `config` is the help of a positional recipe, `resume` adds --resume,
    `print_config` adds --print-config (the verb calls `printed_config`)."""
    if overrides:
        listed = ", and --print-config prints them all with their values" if print_config else ""
        description = (
            f"{description} Extra --section.key value pairs override {overrides}; every key is listed in "
            f"docs/config-reference.md{listed}."
        ).strip()
    p = verbs.add_parser(
        name, parents=[common], help=help, description=description or None, formatter_class=StatesDefaults
    )
    p.error = one_line_error(name)  # argparse's usage + error lines -> one `error: ...` line, exit 2
    if config:
        p.add_argument("config", help=config)
    if resume:
        p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH", help=RESUME_HELP)
    if print_config:
        p.add_argument("--print-config", action="store_true", help=PRINT_CONFIG_HELP)
    p.set_defaults(func=func, takes_overrides=overrides is not None)
    return p


def one_line_error(verb: str) -> Callable[[str], NoReturn]:
    """A parser's error(): one line like every other user error, `error: --top-p 1.5: must be a number in
    (0, 1]; see hopperlm generate --help`, exit code 2; a mistyped choice (a verb, a --format) names the
    nearest one."""
    see = f"hopperlm {verb} --help".replace("  ", " ")

    def error(message: str) -> NoReturn:
        message = re.sub(r"^argument (\S+?)(?:/\S+)?: (?=.+?: must be )", r"\1 ", message)
        message = did_you_mean(message)
        joint = " See" if message.endswith("?") else "; see"
        print(f"error: {message}{joint} {see}", file=sys.stderr, flush=True)
        sys.exit(2)

    return error


INVALID_CHOICE = re.compile(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)$")


def did_you_mean(message: str) -> str:
    """argparse's `argument VERB: invalid choice: 'trian' (choose from ...)` as `'trian' is not a verb; did you
    mean 'train'?` (with every choice where none is close); other messages as they are."""
    match = INVALID_CHOICE.search(message)
    if match is None:
        return message
    typed, choices = match.group(1), [c.strip(" '") for c in match.group(2).split(",")]
    close = difflib.get_close_matches(typed, choices, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(choices)}"
    argument = message.split(":", 1)[0].removeprefix("argument ")
    if argument.isupper():  # a positional's metavar: VERB, a sub-verb
        return f"{typed!r} is not a verb; {hint}"
    return f"{argument} {typed!r}: {hint}"


def number(
    kind: type[int] | type[float],
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> Callable[[str], int | float]:
    """An argparse `type=` that parses an int or a finite float within [low, high] (`(low, ...` when
    low_open; None = unbounded), else names the value and the range: `1.5: must be a number in (0, 1]`."""
    what = "an integer" if kind is int else "a number"
    if low is not None and high is not None:
        need = f"{what} in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low is not None:
        need = f"{what} {'>' if low_open else '>='} {low:g}"
    else:
        need = f"{what} <= {high:g}" if high is not None else what

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        ok = value is not None and math.isfinite(value)
        ok = ok and (low is None or (value > low if low_open else value >= low))
        ok = ok and (high is None or value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"{text}: must be {need}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """`type=int_at_least(1)`: an integer >= low."""
    return number(int, low=low)


def float_at_least(low: float) -> Callable[[str], float]:
    """`type=float_at_least(0)`: a finite number >= low."""
    return number(float, low=low)


def float_above(low: float) -> Callable[[str], float]:
    """`type=float_above(0)`: a finite number > low."""
    return number(float, low=low, low_open=True)
