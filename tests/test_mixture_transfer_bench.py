"""bench/mixture_transfer.py, issue 69's pre-registered check of `sweep --mixture` at 4x the parameters, in its
smoke mode: every step of the plan at toy sizes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_mixture_transfer_benchmark_runs_in_smoke_mode(tmp_path):
    """bench/mixture_transfer.py --smoke: the plan's steps at toy sizes (tokenizer cut and extended, English bases,
    the sweep, the big runs, the check), its rows as the issue names them."""
    out = tmp_path / "mt.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "mixture_transfer.py"), "--smoke", "--work",
                           str(tmp_path / "w"), "--save", str(out)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    keys = {
        "width",
        "params",
        "ratio",
        "seed",
        "target_loss",
        "replay_loss",
        "replay_rise",
        "tokens",
        "epochs_of_target",
    }
    assert all(set(r) == keys for r in record["rows"])
    smoke = record["plan"]
    widths = sorted({r["width"] for r in record["rows"]})
    assert widths == [*smoke["proxy_widths"], smoke["big_width"]]
    assert len(record["rows"]) == len(widths) * len(smoke["grid"]) * len(smoke["seeds"])
    assert (
        len({r["tokens"] for r in record["rows"]}) == 1
    )  # every run the big run's tokens (its epochs of Tigrinya)
    check = record["check"]
    assert check["recommended"] in smoke["grid"] and set(check["baselines"]) == set(smoke["baselines"])
    assert set(check["targets_met"]) == {"ratio_within_one_step", "regret", "rise_at_recommended", "median_error",
                                         "coverage", "spearman"}  # fmt: skip
    assert "targets met:" in done.stdout


def test_a_long_run_cut_off_after_a_checkpoint_goes_on_and_any_other_starts_again(tmp_path):
    """harness.start_or_resume, which the mixture check's big base (an hour of two cores) trains under: the same
    config with a checkpoint resumes; another config, or no checkpoint, clears the folder and starts."""
    from harness import start_or_resume

    run, cfg = tmp_path / "bases" / "big", {"args": ["--train.max_steps", "100"]}
    assert start_or_resume(run, cfg) is False  # nothing there: started, and marked for cfg
    (run / "checkpoints" / "step_000050").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    assert start_or_resume(run, cfg) is True and (run / "metrics.jsonl").is_file()  # cut off: goes on
    assert start_or_resume(run, {"args": ["--train.max_steps", "200"]}) is False  # another config
    assert not run.exists() or not any(run.iterdir())  # ... its folder cleared
    assert start_or_resume(run, cfg) is False  # and the first config, marked over, starts again too
