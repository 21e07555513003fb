"""Data parallelism for real: torchrun with 2 and 4 gloo processes on the CPU, the `debug` preset on Tiny
Shakespeare. DDP and FSDP2 train the same loss curve as one process with the same global batch; checkpoints
saved by 2 ranks (single-file from DDP, sharded from FSDP) resume on 1 and on 4 ranks (FSDP, HSDP, DDP) and
continue that curve; gradient accumulation (DDP's no_sync, HSDP's deferred all-reduce) keeps the curve too; a rank that raises makes every rank exit non-zero, well within the timeout.

Few launches on purpose (each starts 2-4 Python processes on a small machine): one worker process runs
several trainings in one process group (tests/dist_worker.py).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hopperlm.config import load_config
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

pytestmark = pytest.mark.slow  # every test here starts torchrun: several Python processes

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
STEPS = ["--train.max_steps", "6", "--train.log_every", "1", "--train.eval_every", "3"]
STEPS += ["--checkpoint.every", "3", "--train.eval_windows", "24", "--checkpoint.keep_last", "5"]
QUIET = lambda line: None  # noqa: E731


def torchrun(nproc: int, spec: dict, timeout: float = 150) -> subprocess.CompletedProcess:
    """`torchrun --standalone` (a free port of its own) running tests/dist_worker.py."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [str(WORKER), json.dumps(spec)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def curve(run_dir: Path) -> dict[int, tuple[float, float | None]]:
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in read_metrics(run_dir / "metrics.jsonl")}


def assert_same_curve(got: dict, want: dict, steps) -> None:
    for step in steps:
        (loss, val), (ref_loss, ref_val) = got[step], want[step]
        assert loss == pytest.approx(ref_loss, rel=1e-6), (step, loss, ref_loss)
        assert (val is None) == (ref_val is None)
        if val is not None:
            assert val == pytest.approx(ref_val, rel=1e-6), (step, val, ref_val)


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    name = f"step_{step:06d}"
    shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)


ACCUM = [
    "--train.batch_tokens",
    str(16 * 64),
]  # 16 sequences per step in micro-steps of 8, all ranks together


@pytest.fixture(scope="module")
def two_ranks(shakespeare_bytes, tmp_path_factory):
    """References in one process: micro-batch 16, and 8 x 2 accumulation steps. On 2 ranks: DDP and FSDP with
    8 each, DDP with 4 x 2 accumulation steps each (no_sync on the first), FSDP with full activation
    checkpointing."""
    root = tmp_path_factory.mktemp("dist")
    data = ["--data.path", str(shakespeare_bytes)]
    for name, args in (("one-process", []), ("one-process-accum", ["--train.micro_batch", "8", *ACCUM])):
        cfg = load_config(
            REPO / "configs/debug.yaml", [*data, *STEPS, *args, "--run.out_dir", str(root / name)]
        )
        train(cfg, log=QUIET)
    runs = {
        "ddp": [*data, *STEPS, "--train.micro_batch", "8", "--parallel.strategy", "ddp"],
        "fsdp": [*data, *STEPS, "--train.micro_batch", "8", "--parallel.strategy", "fsdp"],
        "ddp-accum": [*data, *STEPS, "--train.micro_batch", "4", *ACCUM, "--parallel.strategy", "ddp"],
        # activation checkpointing inside FSDP units: the recompute must see gathered weights
        "fsdp-ac": [*data, *STEPS, "--train.micro_batch", "8", "--parallel.strategy", "fsdp"]
        + ["--train.activation_checkpointing", "full"],
    }
    spec = {"runs": [{"args": [*args, "--run.out_dir", str(root / name)]} for name, args in runs.items()]}
    result = torchrun(2, spec)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, data, curve(root / "one-process")


def test_ddp_and_fsdp_on_two_ranks_match_one_process(two_ranks):
    root, _, reference = two_ranks
    assert_same_curve(curve(root / "ddp-accum"), curve(root / "one-process-accum"), range(1, 7))
    for name in ("ddp", "fsdp", "fsdp-ac"):
        assert_same_curve(curve(root / name), reference, range(1, 7))
        records = read_metrics(root / name / "metrics.jsonl")
        assert records[-1]["world_size"] == 2 and records[-1]["tokens"] == 6 * 16 * 64  # the global batch
        assert records[-1]["tokens_per_s_per_rank"] == pytest.approx(records[-1]["tokens_per_s"] / 2)
    single = root / "ddp" / "checkpoints" / "step_000003"
    sharded = root / "fsdp" / "checkpoints" / "step_000003"
    assert (single / "model.safetensors").is_file() and not (single / "sharded").exists()
    assert (
        len(list((sharded / "sharded").glob("*.distcp"))) == 2
        and not (sharded / "model.safetensors").exists()
    )
    state = json.loads((sharded / "state.json").read_text())
    assert (state["micro_batch"], state["world_size"]) == (16, 2)  # saved for all ranks together


def test_checkpoints_from_two_ranks_resume_on_one_and_four_and_hsdp_accumulates(two_ranks):
    root, data, reference = two_ranks
    # one process, from the sharded (FSDP) checkpoint and from the single-file (DDP) one
    for source in ("fsdp", "ddp"):
        run = root / f"one-from-{source}"
        copy_checkpoint(root / source, 3, run)
        cfg = load_config(REPO / "configs/debug.yaml", [*data, *STEPS, "--run.out_dir", str(run)])
        train(cfg, resume=True, log=QUIET)
        assert_same_curve(curve(run), reference, range(4, 7))
    # four ranks: FSDP and DDP from the sharded checkpoint, HSDP (2 x 2) from the single-file one; and a
    # fresh HSDP run with 2 x 2 accumulation steps per rank (the cross-replica all-reduce on the last only)
    hsdp = ["--parallel.strategy", "hsdp", "--parallel.shard_size", "2"]
    runs = {
        "fsdp4-from-fsdp": ("fsdp", ["--parallel.strategy", "fsdp"]),
        "ddp4-from-fsdp": ("fsdp", ["--parallel.strategy", "ddp"]),
        "hsdp4-from-ddp": ("ddp", hsdp),
        "hsdp4-accum": (None, [*hsdp, "--train.micro_batch", "2", *ACCUM]),
    }
    spec = {"runs": []}
    for name, (source, args) in runs.items():
        if source:
            copy_checkpoint(root / source, 3, root / name)
        run = {"args": [*data, *STEPS, *args, "--run.out_dir", str(root / name)], "resume": bool(source)}
        spec["runs"].append(run)
    result = torchrun(4, spec)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_curve(curve(root / "hsdp4-accum"), curve(root / "one-process-accum"), range(1, 7))
    for name in runs:
        if name != "hsdp4-accum":
            assert_same_curve(curve(root / name), reference, range(4, 7))
        assert read_metrics(root / name / "metrics.jsonl")[-1]["world_size"] == 4
    assert (root / "hsdp4-from-ddp" / "checkpoints" / "step_000006" / "sharded").is_dir()
    assert (root / "ddp4-from-fsdp" / "checkpoints" / "step_000006" / "model.safetensors").is_file()


def test_a_failing_rank_stops_every_rank(shakespeare_bytes, tmp_path):
    args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(tmp_path / "run")]
    # a collective limit far longer than the test may take (torchrun() gives up after 150 s): rank 0 must stop
    # because rank 1 failed, not because a limit ran out
    args += ["--train.max_steps", "50", "--parallel.startup_timeout_s", "600"]
    result = torchrun(2, {"runs": [{"args": args}], "fail": {"rank": 1, "step": 3}})  # (150 s at most)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "timed out" not in output.lower(), output[-3000:]
    # rank 1's own error, and rank 0 stopping because of it (not a bare "connection closed")
    assert "ValueError: injected failure on rank 1 at step 3" in output
    assert "[rank 0] stopping: rank 1: ValueError: injected failure on rank 1 at step 3" in output
    # torchrun's summary names rank 1 as the root cause, with its error (recorded for it by the runtime)
    root_cause = output[output.index("Root Cause") :]
    assert "rank      : 1" in root_cause and "injected failure on rank 1" in root_cause
