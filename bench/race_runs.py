"""The runs of bench/race_3tpp.py: each a `hopperlm train` process in a cache folder named by its config's
digest (a finished run of the same config is read back, never retrained), with its CPU seconds from os.wait4."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from harness import config_digest, done, train_process, val_losses


class Missing(Exception):
    """A run not in the cache, where only cached runs may be read (--cached-only)."""


class Runner:
    """Trains run configs as `hopperlm train` processes, `jobs` side by side on one thread each, each in the
    cache folder named by its config's digest: a finished run of the same config is read back, never retrained.
    Threads may share one Runner (searches side by side): at most `jobs` runs train at once among them all."""

    def __init__(self, cache: Path, jobs: int, *, cached_only: bool = False) -> None:
        self.cache, self.jobs, self.cached_only = cache, jobs, cached_only
        self.slots = threading.Semaphore(jobs)

    def folder(self, cfg: dict) -> Path:
        return self.cache / "runs" / config_digest(cfg)

    def run_all(self, cfgs: list[dict]) -> list[dict]:
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            return list(pool.map(self.run, cfgs))

    def run(self, cfg: dict) -> dict:
        out = self.folder(cfg)
        if not done(out, cfg):
            if self.cached_only:
                raise Missing(str(out))
            with self.slots:
                train_into(out, cfg)
        return self.read(out)

    def read(self, out: Path) -> dict:
        result = json.loads((out / "result.json").read_text())
        cpu = json.loads((out / "cpu.json").read_text())
        loss = result.get("val_loss")
        return {
            "steps": result.get("step", 0),
            "tokens": result.get("tokens", 0),
            "seconds": cpu["cpu_s"],
            "final_val_loss": round(loss, 4) if loss is not None and math.isfinite(loss) else None,
            "curve": [[r["step"], round(r["val_loss"], 4)] for r in val_losses(out / "run")],
            "run": str(out.relative_to(self.cache)),
        }


def train_into(out: Path, cfg: dict) -> None:
    """Train `cfg` in the run folder `out` (its run in out/run); out/result.json last, so a folder that has it
    is done: the run's own result, or {"failed": exit code} where the run died before writing one."""
    shutil.rmtree(out, ignore_errors=True)  # a run cut off mid-way starts again
    out.mkdir(parents=True)
    spec = out / "run.yaml"
    spec.write_text(yaml.safe_dump({**cfg, "run": {"out_dir": str(out / "run")}}, sort_keys=False))
    code, cpu_s = train_process(spec, cwd=out, log=out / "train.log")
    (out / "cpu.json").write_text(json.dumps({"exit": code, "cpu_s": cpu_s}))
    if code and not (out / "run" / "result.json").is_file():
        (out / "result.json").write_text(json.dumps({"failed": code}))
    else:
        shutil.copy(out / "run" / "result.json", out / "result.json")


def race_cache(cache: str, *, smoke: bool, resume: bool) -> Path:
    """A race's cache folder (smoke runs in its own subfolder), made; a race already there is refused without
    --resume, so that a new plan never reads an old one's runs by accident."""
    folder = Path(cache).resolve() / ("smoke" if smoke else "")
    if not resume and not smoke and (folder / "runs").is_dir():
        raise SystemExit(
            f"{folder}/runs holds an earlier race's runs: add --resume to go on with them, or pick --cache"
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def add_cache_arguments(p, default: str) -> None:
    """--cache, --jobs, --smoke and --resume, as every race takes them."""
    p.add_argument("--cache", default=default, help="prepared data and runs (reused)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    p.add_argument("--smoke", action="store_true", help="a few steps per run on 3 books: checks the script")
    p.add_argument(
        "--resume", action="store_true", help="go on: runs in the cache are read back, not retrained"
    )


def mean_loss(rows: list[dict]) -> float:
    """The mean final loss over seeds; a failed or non-finite seed makes it infinite."""
    losses = [r["final_val_loss"] for r in rows]
    return statistics.fmean(losses) if all(v is not None for v in losses) else math.inf


def fmt(v: float | None) -> str:
    return "failed" if v is None else f"{v:.4f}"
