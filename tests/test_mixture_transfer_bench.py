"""bench/mixture_transfer.py, issue 69's pre-registered check of `sweep --mixture` at 4x the parameters, in its
smoke mode: every step of the plan at toy sizes."""

import json
import subprocess
import sys
from pathlib import Path

import mixture_transfer as mt  # bench/ is on pytest's pythonpath (pyproject.toml)
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
    assert "targets met:" in done.stdout and check["passes"] == all(check["targets_met"].values())
    assert record["plan_commit"] == mt.PLAN_COMMIT and record["amendments"] == mt.AMENDMENTS
    assert set(check["diagnostics"]) == {"rise_median_error", "rise_coverage", "base_line_error"}
    assert "beside the verdict: the rise alone" in done.stdout


def big_rows(table):
    """{ratio: [(Tigrinya loss, rise), ...]} -> the check's rows."""
    return [{"ratio": r, "target_loss": t, "replay_rise": rise, "replay_loss": None if t is None else 4.0 * (1 + rise)}
            for r, runs in table.items() for t, rise in runs]  # fmt: skip


def test_the_check_reads_failed_runs_ties_and_a_limit_nothing_meets_as_its_amendments_say():
    # (d): a run with no final loss is left out of its ratio's mean, not a crash
    rows = big_rows({0.05: [(6.0, 0.02), (None, None)], 0.1: [(6.1, 0.01), (6.1, 0.01)]})
    assert mt.means(rows, "target_loss") == {0.05: 6.0, 0.1: 6.1}
    assert mt.constrained_best(rows, 0.03) == 0.05 and mt.constrained_best(rows, 0.015) == 0.1
    assert mt.constrained_best(rows, 0.005) is None
    # (e): ties share their average rank
    assert mt.average_ranks([1.0, 1.0, 2.0]) == [0.5, 0.5, 2.0]
    assert mt.spearman([1, 1, 2], [2, 1, 3]) == pytest.approx(mt.spearman([1, 1, 2], [1, 2, 3]))
    # (a): the law beats a baseline only from within the limit
    law, over = (
        {"ratio": 0.05, "feasible": False, "target_loss": 6.0},
        {"ratio": 0.1, "feasible": False, "target_loss": 6.1},
    )
    assert mt.beats(law, over, 0.03) is False and mt.beats({**law, "feasible": True}, over, 0.03) is True
    assert mt.beats(law, {**law}, 0.03) == "same ratio" and mt.beats(None, over, 0.03) is None


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


class FakeForecast:
    """The law's predictions at the big size: `rises` per ratio (its losses follow the measured ones)."""

    def __init__(self, rises: dict[float, float], recommended, closest=None) -> None:
        self.rises, self.recommended, self.closest, self.target_params = rises, recommended, closest, 100

    def recommend(self, limit):
        self.predictions = [
            {"ratio": r, "target_loss": 6.0, "target_low": 5.9, "target_high": 6.1, "replay_loss": 4.0 * (1 + x),
             "replay_low": 3.9, "replay_high": 4.5, "replay_rise": x, "rise_low": x - 0.01, "rise_high": x + 0.01}
            for r, x in self.rises.items()
        ]  # fmt: skip

    def base_loss(self, params):
        return 4.0


def test_where_no_ratio_meets_the_limit_the_lowest_measured_rise_is_the_optimum_to_compare_with():
    spec = {**mt.PLAN, "grid": [0.05, 0.1, 0.25], "proxy_widths": [16]}
    big = big_rows({0.05: [(6.0, 0.08)], 0.1: [(6.05, 0.06)], 0.25: [(6.2, 0.05)]})  # every rise over 3%
    proxies = [{**r, "width": 16} for r in big]
    law = FakeForecast({0.05: 0.07, 0.1: 0.05, 0.25: 0.04}, None, {"ratio": 0.25, "replay_rise": 0.04})
    result = mt.check(spec, law, big, proxies, 4.0)
    assert result["measured_constrained_optimum"] is None and result["optimum_compared"] == 0.25
    assert result["law_ratio"] == 0.25 and result["ratio_steps_off"] == 0 and result["law"]["regret"] == 0.0
    assert not result["targets_met"]["rise_at_recommended"] and not result["passes"]  # 5% > 3.5%
    assert result["diagnostics"]["base_line_error"] == 0.0
