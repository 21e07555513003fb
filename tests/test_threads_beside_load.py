"""`sweep` and `generate` take torch's CPU threads by the rule `train` uses (plan/choices.py threads_beside_load):
on a machine whose load average says other processes use the cores, the cores they leave, said in one line; and
`sweep` says each run's step and loss while it trains (train/sweep_progress.py)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from hopperlm.cli.models import take_threads_beside_load
from hopperlm.config import TrainConfig
from hopperlm.hardware import detect_for
from hopperlm.plan.choices import choose_threads
from hopperlm.train import sweep, sweep_progress


@pytest.fixture
def busy_machine(monkeypatch):
    """Every core but one busy by the load average, and no OMP_NUM_THREADS: the rule's own choice."""
    cores = detect_for("cpu").cpu_cores
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (cores + 0.0, 0.0, 0.0))
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    return cores


def trains_threads() -> tuple[int, str]:
    """(the threads `train` takes on this machine now, its reason)."""
    hw, why = detect_for("cpu"), {}
    chosen = choose_threads(TrainConfig(max_steps=1), hw, why)
    return (chosen if chosen is not None else torch.get_num_threads()), why["threads"]


def sweep_threads(tmp_path, jobs: int) -> tuple[list[int], list[str]]:
    """The OMP_NUM_THREADS each sweep run would start with (no run starts: start() is stubbed), and the log."""
    lines, envs = [], []

    def start(self, cmd, env, warm=None):
        envs.append(env["OMP_NUM_THREADS"])
        return None  # as after a Ctrl-C: the run is not started

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep.SweepInterrupt, "start", start)
        runs = sweep.run_sweep(tmp_path / "r.yaml", [], lrs=[1e-3, 2e-3, 4e-3], seeds=[1], out_dir=tmp_path,
                               jobs=jobs, log=lines.append)  # fmt: skip
    assert [r.threads for r in runs] == [int(e) for e in envs]
    return [int(e) for e in envs], lines


def test_sweep_and_generate_take_the_threads_train_takes_on_a_busy_machine(busy_machine, tmp_path, capsys):
    count, why = trains_threads()
    assert count == 1 and ("load average is" in why or busy_machine == 1)
    threads, lines = sweep_threads(tmp_path, jobs=1)
    assert threads == [count] * 3
    assert (
        lines[0].startswith("sweep: threads per run: 1")
        and "the load average is" in lines[0]
        or busy_machine == 1
    )
    threads, _ = sweep_threads(tmp_path, jobs=2)  # the cores left, shared: still at least one each
    assert threads == [1] * 3

    before = torch.get_num_threads()
    try:
        take_threads_beside_load(torch.device("cpu"))
        assert torch.get_num_threads() == count
    finally:
        torch.set_num_threads(before)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("threads: 1") and ("before generate starts" in line or busy_machine == 1)


def test_a_quiet_machine_gives_each_of_the_sweeps_jobs_its_share(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert sweep_threads(tmp_path, jobs=2)[0] == [4] * 3
    assert sweep_threads(tmp_path, jobs=1)[0] == [8] * 3
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins, as in train
    threads, lines = sweep_threads(tmp_path, jobs=2)
    assert threads == [3] * 3 and "set by OMP_NUM_THREADS" in lines[0]


def test_sweep_says_each_runs_step_and_loss_while_it_trains(tmp_path, monkeypatch):
    """A stand-in run writes two log steps to metrics.jsonl a moment apart: both are said, each once."""
    monkeypatch.setattr(sweep_progress, "PROGRESS_EVERY_S", 0.1)
    writer = textwrap.dedent(f"""
        import json, time
        with open({str(tmp_path / "metrics.jsonl")!r}, "a") as f:
            for step, loss in ((5, 3.25), (10, 2.5)):
                f.write(json.dumps({{"step": step, "loss": loss}}) + "\\n"); f.flush(); time.sleep(0.6)
        print("done")
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", writer], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    said = []
    stdout, _ = sweep_progress.wait_reporting(proc, tmp_path, "lr 0.002 seed 1", said.append)
    assert stdout.strip() == "done"
    assert said == ["sweep: lr 0.002 seed 1: step 5, loss 3.2500 (training)",
                    "sweep: lr 0.002 seed 1: step 10, loss 2.5000 (training)"]  # fmt: skip
    record = {"step": 20, "loss": 2.0, "val_loss": 2.25}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + '\n{"step": 2')  # a line being written
    assert sweep_progress.latest_record(tmp_path) == record
    assert (
        sweep_progress.progress_line("x", record) == "sweep: x: step 20, loss 2.0000, val 2.2500 (training)"
    )
