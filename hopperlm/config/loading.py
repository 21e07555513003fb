"""YAML recipes and `--section.key value` overrides -> a checked Config: strict types, no unknown keys."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from hopperlm.config.model import awaiting_init_from
from hopperlm.config.moved_keys import is_moved, migrate_saved, refusal
from hopperlm.config.presets import get_preset
from hopperlm.config.recipe import SECTIONS, Config
from hopperlm.errors import ConfigError


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a mapping, e.g. {{data/a: 0.7, data/b: 0.3}}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type, where): _coerce(v, value_type, f"{where}.{k}") for k, v in value.items()}
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list, e.g. [0.9, 0.95]")
        (item_type,) = typing.get_args(tp)
        return [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):  # a row of a table (optim.groups)
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}={value!r} must be a mapping of keys, e.g. {{pattern: embed.weight, lr: 8}}"
            )
        hints, known = typing.get_type_hints(tp), [f.name for f in dataclasses.fields(tp)]
        for key in value:
            if key not in known:
                raise ConfigError(f"unknown key '{key}' in {where}; its keys: {', '.join(known)}")
        return tp(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in value.items()})
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)  # 1e6 in YAML is a float; accept it where it is a whole number
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string; users write it anyway
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a string")
        return str(value)
    raise TypeError(f"unsupported config annotation {tp!r} for {where}")


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    """`where`: the section with its dot ("train."), or "" for a section name. A close match is offered as
    the flag a user can paste (`--train.max_steps`), or the section's name."""
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        hint = f"did you mean --{where}{close[0]}?" if where else f"did you mean the section '{close[0]}'?"
    else:
        hint = f"known {'keys' if where else 'sections'}: {', '.join(known)}"
    return ConfigError(f"unknown config key '{where}{key}'; {hint}")


# keys that were renamed: configs saved by earlier versions (run folders, checkpoints) still load
RENAMED = {("parallel", "timeout_s"): "startup_timeout_s"}


def _build_section(name: str, values: dict[str, Any]) -> Any:
    cls = SECTIONS[name]
    values = {RENAMED.get((name, key), key): value for key, value in values.items()}
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    if name == "model" and values.get("preset") is not None and values.get("init_from") is not None:
        raise ConfigError(
            f"model.preset={values['preset']} and model.init_from={values['init_from']} are both set; the shape "
            "comes from init_from, drop model.preset"
        )
    if name == "model" and values.get("preset") is not None:
        values = {**dataclasses.asdict(get_preset(values["preset"])), **values}
    kwargs = {}
    for key, value in values.items():
        if is_moved(name, key):
            raise refusal(name, key, value, values)
        if key not in known:
            raise _unknown(key, known, f"{name}.")
        kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
    if name == "model" and kwargs.get("init_from") is not None:  # the shape comes from the checkpoint, later
        return awaiting_init_from(kwargs)
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (as read from YAML); a model.init_from still awaits
    resolve_init_from (interop/init_from.py)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections ({', '.join(SECTIONS)})")
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise _unknown(str(name), list(SECTIONS), "")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{name}' must be a mapping of keys, got {values!r}")
        sections[name] = _build_section(name, values)
    if "train" not in sections:
        sections["train"] = _build_section("train", {})  # raises "no stopping rule" with the fix
    return Config(**sections)


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--section.key value` or `--section.key=value` pairs -> nested dict; values are parsed as YAML scalars."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --train.max_steps 100")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE")
            key, text = arg[2:], args[i + 1]
            i += 2
        section, _, name = key.partition(".")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        out.setdefault(section, {})[name] = value
    return out


def merge(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    merged = {k: dict(v or {}) for k, v in base.items()}
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise _unknown(section, list(SECTIONS), "")
        if section == "model" and "preset" in values:
            # a new preset replaces the file's model section; other overrides still apply on top
            merged["model"] = {}
        merged.setdefault(section, {}).update(values)
    return merged


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass a YAML recipe such as configs/debug.yaml")
    not_text = f"{path} is not a text YAML file"
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{not_text} (byte {e.start} is not UTF-8); pass a YAML recipe") from None
    if "\x00" in text:
        raise ConfigError(f"{not_text} (it holds NUL bytes: binary data); pass a YAML recipe")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.reader.ReaderError as e:  # a control character no text file holds
        raise ConfigError(f"{not_text} ({e.reason} at character {e.position}); pass a YAML recipe") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" line {line + 1}" if line is not None else ""
        raise ConfigError(
            f"config file {path}{where} is not valid YAML: {getattr(e, 'problem', e)}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections ({', '.join(SECTIONS)})")
    return raw


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe, apply `--section.key value` overrides, validate everything. Reads no checkpoint: a
    model.init_from is filled in by interop/init_from.py's resolve_init_from, called before the run. A run
    folder's config.yaml saved by an earlier hopperlm has its moved keys moved (the run rewrites it when it
    starts); a recipe's are refused, naming their new place."""
    raw = read_yaml(path)
    if is_run_folder(Path(path).parent):
        raw, moved = migrate_saved(raw)
        if moved:
            print(f"config: {path} was saved by an earlier hopperlm; read with {', '.join(moved)}")
    check_file_keys(raw, path)
    given = parse_overrides(overrides or [])
    return config_from_dict(merge(without_muon_when_switched(raw, given), given))


def without_muon_when_switched(raw: dict[str, Any], given: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A Muon recipe switched to another optimizer on the command line (--optim.name adamw) and given no muon key
    there: the recipe's muon section is not read, and one line says so (set in one recipe, or on the command
    line beside another optimizer, a muon key is refused)."""
    name = given.get("optim", {}).get("name")
    if name is None or name == "muon" or "muon" in given or not raw.get("muon"):
        return raw
    print(f"config: --optim.name {name}: the recipe's muon section ({', '.join(raw['muon'])}) is not read")
    return {section: values for section, values in raw.items() if section != "muon"}


def is_run_folder(folder: Path) -> bool:
    """A folder a run wrote (train/run.py prepare_run_dir): its config.yaml is the run's saved config."""
    return (folder / "events.jsonl").is_file() or (folder / "checkpoints").is_dir()


def check_file_keys(raw: dict[str, Any], path: str | Path) -> None:
    """An unknown section or key in a YAML file, named as it is written there (the file, the section, the key),
    with the closest known one; moved keys are left to _build_section's refusal."""
    for name, values in raw.items():
        if name not in SECTIONS:
            close = difflib.get_close_matches(str(name), list(SECTIONS), n=1)
            hint = f"did you mean '{close[0]}:'?" if close else f"sections: {', '.join(SECTIONS)}"
            raise ConfigError(f"config file {path}: unknown section '{name}:'; {hint}")
        known = [f.name for f in dataclasses.fields(SECTIONS[name])]
        for key in values if isinstance(values, dict) else ():
            key = RENAMED.get((name, key), key)
            if key in known or is_moved(name, key):
                continue
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = (
                f"did you mean '{close[0]}:' (--{name}.{close[0]})?"
                if close
                else f"its keys: {', '.join(known)}"
            )
            raise ConfigError(f"config file {path}: unknown key '{key}:' under '{name}:'; {hint}")


def config_yaml(config: Config) -> str:
    """The whole config as YAML, every default included (what RUN_DIR/config.yaml and --print-config hold)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
