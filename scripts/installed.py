"""Exit 0 when this Python already has what `scripts/setup.sh [--dev]` would install, so setup can skip pip.

    python3 scripts/installed.py [--extras dev|gguf,eval,hf] [REQUIREMENT ...]

Checks, from pyproject.toml: every requirement of the project (and of the extras named, plus any
REQUIREMENT given, e.g. the mup pin setup.sh installs on its own) is installed at a version its specifier accepts, and hopperlm itself is installed editable
from this checkout with the console scripts the file declares. Anything missing, too old, installed from
elsewhere or unreadable exits 1 with one line saying what, and setup.sh runs pip as before. Why: pip's own
no-op pass over ~100 installed packages took 13 s of every `scripts/test.sh` (and of CI, which installs first).
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[1]


def missing(extras: list[str], extra: list[str]) -> str | None:
    """What is not installed as setup.sh would install it, or None."""
    import tomllib  # Python 3.11+; on 3.10 the ImportError below sends setup.sh to pip

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # hopperlm first, so that a fresh environment (no hopperlm, no packaging) says so in those words. The
    # installed record (pip writes direct_url.json), not the hopperlm.egg-info the build leaves in the
    # checkout, which a process started in the checkout sees first.
    installed = [d for d in metadata.distributions(name="hopperlm") if d.read_text("direct_url.json")]
    if not installed:
        return "hopperlm is not installed"
    dist = installed[0]
    url = json.loads(dist.read_text("direct_url.json"))
    where = Path(unquote(urlparse(url.get("url", "")).path)).resolve()
    if not url.get("dir_info", {}).get("editable") or where != ROOT:
        return f"hopperlm is not installed editable from {ROOT}"
    if dist.version != project["version"]:
        return f"hopperlm {dist.version} is installed, pyproject.toml says {project['version']}"
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    if scripts != project.get("scripts", {}):
        return "hopperlm's console scripts changed since it was installed"

    from packaging.requirements import Requirement

    wanted = list(project["dependencies"]) + extra
    for name in extras:
        wanted += project["optional-dependencies"][name]
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(version, prereleases=True):
            return f"{req.name} {version} does not satisfy {req}"
    return None


if __name__ == "__main__":
    try:
        args = sys.argv[1:]
        extras = args[args.index("--extras") + 1].split(",") if "--extras" in args else []
        if "--extras" in args:
            del args[args.index("--extras") : args.index("--extras") + 2]
        reason = missing(extras, args)
    except Exception as e:  # no hopperlm, no packaging, an unreadable file: pip decides
        reason = f"{type(e).__name__}: {e}"
    if reason:
        print(f"setup: installing ({reason})")
        sys.exit(1)
