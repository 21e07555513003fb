"""What every verb shares: the log line printer and where named recipes live."""

from __future__ import annotations

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
