"""SIGKILL at random points, during steps and during checkpoint writes, then resume: the loss trajectory is
identical to an uninterrupted run and the latest checkpoint is never corrupt."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hopperlm.checkpoint.layout import latest_checkpoint, list_checkpoints, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("kill_runner.py")
STEPS = 24
ARGS = [
    "--train.max_steps",
    str(STEPS),
    "--checkpoint.every",
    "3",
    "--train.log_every",
    "1",
    "--train.eval_every",
    "6",
    "--model.dropout",
    "0.1",
    "--train.batch_tokens",
    "2048",
]


def hopperlm(run_dir, data, mode="none", when=0, resume=False):
    cmd = [
        sys.executable,
        str(RUNNER),
        mode,
        str(when),
        "--",
        "train",
        "configs/debug.yaml",
        "--data.path",
        str(data),
        "--run.out_dir",
        str(run_dir),
        *ARGS,
    ]
    if resume:
        cmd.append("--resume")
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


def losses(run_dir):
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in records]


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_exact(shakespeare_bytes, tmp_path):
    reference = tmp_path / "reference"
    assert hopperlm(reference, shakespeare_bytes).returncode == 0
    expected = losses(reference)
    assert [s for s, _, _ in expected] == list(range(1, STEPS + 1))

    rng = random.Random(7)
    # 6 kills mid-step at random steps, 5 kills in the middle of writing a checkpoint (random file of it)
    faults = [("step", s) for s in sorted(rng.sample(range(1, STEPS), 6))]
    faults += [("save", rng.randint(1, 6)) for _ in range(5)]
    rng.shuffle(faults)
    run, injected, survived = tmp_path / "killed", 0, 0
    for mode, when in faults:
        latest = latest_checkpoint(run)
        done = latest is not None and int(latest.name.split("_")[1]) >= STEPS
        if done:
            break
        if mode == "step" and latest is not None and when <= int(latest.name.split("_")[1]):
            when = int(latest.name.split("_")[1]) + 1  # a kill point the resumed run will reach
        result = hopperlm(run, shakespeare_bytes, mode, when, resume=latest is not None)
        injected += 1
        assert result.returncode == -9, (mode, when, result.stderr[-2000:])
        # whatever was killed, the newest complete checkpoint verifies
        for ckpt in list_checkpoints(run):
            assert verify_checkpoint(ckpt) is None, ckpt
        survived += 1
    final = hopperlm(run, shakespeare_bytes, resume=latest_checkpoint(run) is not None)
    assert final.returncode == 0, final.stderr[-2000:]
    print(f"SIGKILL faults injected: {injected} ({faults[:injected]}), survived: {survived}")
    assert injected >= 10 and survived == injected
    assert losses(run) == expected  # bitwise: same losses, same validation, every step
