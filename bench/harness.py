"""What every benchmark that trains runs shares, in one place; a benchmark script keeps only its own plan and
table (torchtitan's scripts/loss_compare.py, nanochat's scaling script that skips a run it already has).

    launch        hopperlm(*args): a child `python -m hopperlm`, as a user runs it; train_process(spec): a
                  child `hopperlm train` with its CPU seconds; train_here(cfg): in a pool worker, one thread
    run config    run_config(model=, data=, optim=, train=, ...): the YAML a user would write
    data          prepare_data(out, sources, **options): token shards, once per folder
    finished run  done(run_dir, cfg) / mark_done / start_run: the one rule, by the config's digest;
                  start_or_resume: a long run cut off mid-way goes on from its checkpoint
    metrics       metrics(run_dir), val_losses(run_dir): through observe/metrics.py's read_metrics
    grid edge     at_grid_edge(grid, best): the one rule for "the optimum may lie beyond the grid"
    results       save_result(result, path) (provenance.py), bench_command(script, argv)

Scripts run as `python3 bench/x.py` find this module beside them; hopperlm itself is the installed one
(scripts/setup.sh installs it editable from this checkout).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hopperlm.observe.metrics import read_metrics
from hopperlm.provenance import save_result

__all__ = [
    "DATA",
    "REPO",
    "at_grid_edge",
    "bench_command",
    "config_digest",
    "done",
    "hopperlm",
    "mark_done",
    "metrics",
    "prepare_data",
    "run_config",
    "save_result",
    "start_run",
    "start_or_resume",
    "train_here",
    "train_process",
    "val_losses",
]

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HOPPERLM_DATA_DIR") or REPO.parent / "shared" / "data")
DIGEST_FILE = "bench-config.digest"  # written into a run's folder once the run has finished


# ---- launch ----------------------------------------------------------------------------------------------
def hopperlm(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """`python -m hopperlm ARGS` in a child process, as a user runs it; its stdout. A failure ends the benchmark
    with the child's last words: a benchmark of a broken run measures nothing."""
    done_ = subprocess.run(
        [sys.executable, "-m", "hopperlm", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    if done_.returncode:
        sys.exit(f"hopperlm {' '.join(args)} failed (exit {done_.returncode}):\n{done_.stderr[-3000:]}")
    return done_.stdout


def train_process(
    spec: Path, *overrides: str, cwd: Path, log: Path, env: dict | None = None
) -> tuple[int, float]:
    """`hopperlm train SPEC OVERRIDES` in a child process, its output in `log`: (exit code, CPU seconds). The CPU
    seconds come from os.wait4, so another process beside the run does not change them (wall time would)."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hopperlm", "train", str(spec), *overrides], stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd, env=env)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), round(usage.ru_utime + usage.ru_stime, 1)


def train_here(cfg: dict):
    """One run of `cfg` in this process on one thread, silent; its TrainResult. For pool workers: on a small CPU
    two one-thread runs side by side do more work than one two-thread run."""
    import torch

    torch.set_num_threads(1)
    from hopperlm.config import config_from_dict
    from hopperlm.train.loop import train

    return train(config_from_dict(cfg), log=lambda line: None)


# ---- run config ------------------------------------------------------------------------------------------
def run_config(*, model: dict, data: Path | str, optim: dict, train: dict, muon: dict | None = None,
               schedule: dict | None = None, checkpoint: dict | None = None, quiet: bool = False,
               out_dir: Path | str | None = None) -> dict:  # fmt: skip
    """The YAML a user would write: the sections in their usual order (muon and schedule where given).
    `quiet`: no report and no TensorBoard (runs a benchmark only reads back); no `checkpoint`: none saved."""
    cfg = {"model": model, "data": {"path": str(data)}, "optim": optim}
    cfg.update({name: section for name, section in (("muon", muon), ("schedule", schedule)) if section})
    cfg.update(train=train, checkpoint=checkpoint if checkpoint is not None else {"every": 0})
    if quiet:
        cfg["log"] = {"report": False, "tensorboard": False}
    if out_dir is not None:
        cfg["run"] = {"out_dir": str(out_dir)}
    return cfg


def schedule_section(shape: dict) -> dict:
    """A plan's schedule entry, written as the optim keys of its day ({schedule: wsd, decay_fraction: 0.2}; the
    plans are pre-registered, so they stay as written), as the schedule section: its `schedule` is `name`."""
    return {("name" if key == "schedule" else key): value for key, value in shape.items()}


# ---- data ------------------------------------------------------------------------------------------------
def prepare_data(out: Path, sources: list, **options: Any) -> Path:
    """`sources` as token shards in `out` with PrepareOptions(**options), as `hopperlm prepare` writes them;
    once per folder (a folder with a manifest is reused)."""
    if not (out / "manifest.json").is_file():
        from hopperlm.data.prepare import PrepareOptions, prepare

        prepare(
            [Path(s) for s in sources], out, PrepareOptions(**options), progress=False, log=lambda line: None
        )
    return out


# ---- the one rule for a finished run -------------------------------------------------------------------------
def config_digest(cfg: dict) -> str:
    """16 hex digits of the config's sha256; its `run` section (where the run goes) is not what the run is."""
    what = {k: v for k, v in cfg.items() if k != "run"}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def done(run_dir: Path, cfg: dict) -> bool:
    """Whether `run_dir` holds a finished run of `cfg`: a result.json that no signal cut short, in a folder named
    by the config's digest or marked with it (mark_done) when the run ended. Anything else trains again."""
    result = run_dir / "result.json"
    if not result.is_file() or str(json.loads(result.read_text()).get("stopped_by", "")).startswith("signal"):
        return False
    digest = config_digest(cfg)
    marked = run_dir / DIGEST_FILE
    return run_dir.name == digest or (marked.is_file() and marked.read_text().strip() == digest)


def mark_done(run_dir: Path, cfg: dict) -> None:
    """Record in `run_dir` that it holds the run of `cfg` (after the run: training never sees the file)."""
    (run_dir / DIGEST_FILE).write_text(config_digest(cfg) + "\n")


def start_run(run_dir: Path) -> None:
    """Clear a run's folder before it trains: a run cut off mid-way, or of another config, starts again."""
    shutil.rmtree(run_dir, ignore_errors=True)


def start_or_resume(run_dir: Path, cfg: dict) -> bool:
    """Before a run of `cfg` trains into `run_dir`: True where the folder holds a checkpoint of a run of the same
    config cut off mid-way (a marker beside the folder, written when it started, says which config), so it goes on
    from there (`--resume`; hopperlm resumes exactly); else the folder is cleared and marked for `cfg` (False)."""
    started = run_dir.with_name(run_dir.name + ".started")
    same = started.is_file() and started.read_text().strip() == config_digest(cfg)
    if same and any((run_dir / "checkpoints").glob("step_*")):
        return True
    start_run(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started.write_text(config_digest(cfg) + "\n")
    return False


# ---- metrics ---------------------------------------------------------------------------------------------
def metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records (none where it wrote none: a run that failed at start-up)."""
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def val_losses(run_dir: Path) -> list[dict]:
    """The records of the run's evaluations, in order."""
    return [r for r in metrics(run_dir) if "val_loss" in r]


# ---- grid edge -------------------------------------------------------------------------------------------
def at_grid_edge(grid, best: float) -> bool:
    """Whether `best` is the smallest or largest point of a grid of two or more: the optimum may lie beyond."""
    points = list(grid)
    return len(points) > 1 and best in (min(points), max(points))


# ---- results ---------------------------------------------------------------------------------------------
def bench_command(script: str, argv: list[str] | None) -> str:
    """How to run this benchmark again: `python3 bench/SCRIPT ARGS` (argv None: this process's arguments)."""
    return " ".join(["python3", f"bench/{script}", *(argv if argv is not None else sys.argv[1:])])
