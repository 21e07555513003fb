"""The CPU recipes as a newcomer runs them: the exact commands of configs/lora-alpaca-cpu.yaml's header (the
data, the base, the fine-tune, generate), with fewer steps through overrides; the loss falls and the run
answers in its chat template. Every GPU recipe's header says what it needs."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import DATA_DIR

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "lora-alpaca-cpu.yaml"
SHORTER = {  # verb -> overrides appended to the header's command (later flags win)
    "train": ["--train.max_steps", "40", "--train.eval_every", "40", "--checkpoint.every", "40"],
    "finetune": ["--train.max_steps", "20", "--train.log_every", "5", "--train.eval_every", "20"],
    "generate": ["--max-new-tokens", "8"],
}


def header_commands(recipe: Path) -> list[list[str]]:
    """The `hopperlm ...` lines of a recipe's header comment, as argument lists."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("hopperlm "):
            lines.append(shlex.split(text)[1:])
    return lines


@pytest.mark.slow
def test_lora_recipe_header_runs_offline_on_a_cpu(tmp_path):
    # the layout the header assumes: configs/ in the working directory, the shared data at ../shared/data
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(DATA_DIR)
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(REPO / "configs")
    commands = header_commands(RECIPE)
    assert [c[0] for c in commands] == ["prepare", "train", "finetune", "generate"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outputs = []
    for args in commands:
        done = subprocess.run(
            [sys.executable, "-m", "hopperlm", *args, *SHORTER.get(args[0], [])],
            capture_output=True,
            text=True,
            cwd=work,
            env=env,
        )
        assert done.returncode == 0, (
            f"hopperlm {shlex.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
        outputs.append(done.stdout)
    losses = [
        json.loads(line)["loss"]
        for line in (work / "runs" / "lora-alpaca-cpu" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.2, losses
    assert "trainable" in outputs[2] and "lora" in outputs[2].lower()
    answer = outputs[3]
    assert (
        "<|user|>" in answer
        and "Give three tips for staying healthy." in answer
        and "<|assistant|>" in answer
    )


@pytest.mark.parametrize(
    "recipe", sorted(p.name for p in (REPO / "configs").glob("*.yaml") if "h100" in p.name or "gpu" in p.name)
)
def test_gpu_recipes_say_what_they_need(recipe):
    header = "\n".join(
        line for line in (REPO / "configs" / recipe).read_text().splitlines() if line.startswith("#")
    )
    assert "Needs:" in header, f"{recipe}: the header names no GPU, memory and data requirements"
    needs = header[header.index("Needs:") :].split("\n#\n")[0].lower()
    assert "gpu" in needs and "gb" in needs and "data" in needs, needs
