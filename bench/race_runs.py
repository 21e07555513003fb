"""The runs of bench/race_3tpp.py: each a `hopperlm train` process in a cache folder named by its config's
digest (a finished run of the same config is read back, never retrained), with its CPU seconds from os.wait4."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml


class Missing(Exception):
    """A run not in the cache, where only cached runs may be read (--cached-only)."""


class Runner:
    """Trains run configs as `hopperlm train` processes, `jobs` side by side on one thread each, each in the
    cache folder named by its config's digest: a finished run of the same config is read back, never retrained."""

    def __init__(self, cache: Path, jobs: int, *, cached_only: bool = False) -> None:
        self.cache, self.jobs, self.cached_only = cache, jobs, cached_only

    def folder(self, cfg: dict) -> Path:
        digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
        return self.cache / "runs" / digest

    def run_all(self, cfgs: list[dict]) -> list[dict]:
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            return list(pool.map(self.run, cfgs))

    def run(self, cfg: dict) -> dict:
        out = self.folder(cfg)
        if not (out / "result.json").is_file() or not (out / "cpu.json").is_file():
            if self.cached_only:
                raise Missing(str(out))
            shutil.rmtree(out, ignore_errors=True)  # a run cut off mid-way starts again
            out.mkdir(parents=True)
            spec = out / "run.yaml"
            spec.write_text(yaml.safe_dump({**cfg, "run": {"out_dir": str(out / "run")}}, sort_keys=False))
            log = (out / "train.log").open("w")
            proc = subprocess.Popen([sys.executable, "-m", "hopperlm", "train", str(spec)], stdout=log,
                                    stderr=subprocess.STDOUT, cwd=out)  # fmt: skip
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            log.close()
            result = {"exit": proc.returncode, "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}
            (out / "cpu.json").write_text(json.dumps(result))
            if proc.returncode and not (out / "run" / "result.json").is_file():
                (out / "result.json").write_text(json.dumps({"failed": proc.returncode}))
            else:
                shutil.copy(out / "run" / "result.json", out / "result.json")
        return self.read(cfg, out)

    def read(self, cfg: dict, out: Path) -> dict:
        result = json.loads((out / "result.json").read_text())
        cpu = json.loads((out / "cpu.json").read_text())
        metrics = out / "run" / "metrics.jsonl"
        records = (
            [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if metrics.is_file()
            else []
        )
        loss = result.get("val_loss")
        return {
            "steps": result.get("step", 0),
            "tokens": result.get("tokens", 0),
            "seconds": cpu["cpu_s"],
            "final_val_loss": round(loss, 4) if loss is not None and math.isfinite(loss) else None,
            "curve": [[r["step"], round(r["val_loss"], 4)] for r in records if "val_loss" in r],
            "run": str(out.relative_to(self.cache)),
        }


def mean_loss(rows: list[dict]) -> float:
    """The mean final loss over seeds; a failed or non-finite seed makes it infinite."""
    losses = [r["final_val_loss"] for r in rows]
    return statistics.fmean(losses) if all(v is not None for v in losses) else math.inf


def fmt(v: float | None) -> str:
    return "failed" if v is None else f"{v:.4f}"
