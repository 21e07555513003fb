"""bench/race_intervals.py: time-to-target ratios with a 90% interval from a bootstrap over seeds that re-chooses
each recipe's best LR; a claim "at most X" only where the interval's upper end is at most X."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import race_3tpp as race  # bench/ is on pytest's pythonpath (pyproject.toml)
import race_intervals as ri

REPO = Path(__file__).resolve().parents[1]
OLD_RACE = REPO / "bench" / "results" / "2026-11-28-time-to-target-3tpp-cpu.json"
SEEDS = (0, 1, 2, 3)


def rows(name, lr, losses, share=1.0, flops=100.0):
    return [{"recipe": name, "lr": lr, "seed": s, "final_val_loss": v, "budget_share": share, "flops": flops * share,
             "params": 10} for s, v in zip(SEEDS, losses, strict=True)]  # fmt: skip


def ratio_of(table):
    return race.flops_to_target(table, "hopperlm", "nanogpt")


def test_seeds_that_agree_give_a_point_interval_around_the_estimate():
    table = rows("nanogpt", 1e-3, (5.0,) * 4) + rows("hopperlm", 4e-3, (4.5,) * 4)
    table += rows("hopperlm", 4e-3, (5.1,) * 4, share=0.2) + rows("hopperlm", 4e-3, (4.8,) * 4, share=0.4)
    point = ratio_of(table)
    for paired in (True, False):
        boot = ri.seed_bootstrap(table, ratio_of, draws=50, paired=paired)
        assert boot["interval_reached"] == [point["ratio_reached"]] * 2 == [0.4, 0.4]
        assert boot["missed_share_reached"] == 0.0


def test_a_noisy_baseline_widens_the_interval_and_its_best_lr_is_chosen_again_in_each_draw():
    # nanogpt's two LRs tie on average; which is best, and so the target, moves with the seeds drawn
    table = rows("nanogpt", 1e-3, (4.8, 5.2, 4.8, 5.2)) + rows("nanogpt", 2e-3, (5.0, 5.0, 5.05, 4.95))
    table += rows("hopperlm", 4e-3, (4.5,) * 4)
    for share, loss in ((0.2, 5.15), (0.4, 4.98), (0.6, 4.85)):
        table += rows("hopperlm", 4e-3, (loss,) * 4, share=share)
    point = ratio_of(table)
    boot = ri.seed_bootstrap(table, ratio_of, draws=400)
    low, high = boot["interval_interpolated"]
    assert low <= point["ratio_interpolated"] <= high and high - low > 0.05
    targets = {
        ratio_of(ri.resampled(table, lambda r, p=p: p))["target_val_loss"] for p in ((0,) * 4, (1,) * 4)
    }
    assert targets == {4.8, 5.0}  # all seed 0: 1e-3's 4.8 is best; all seed 1: 2e-3's 5.0 is


def test_a_target_missed_in_many_draws_leaves_the_interval_open_and_no_claim():
    # seed 0 makes nanogpt's target 4.75, which hopperlm never reaches; without it the target is 5.0
    table = rows("nanogpt", 1e-3, (4.0, 5.0, 5.0, 5.0)) + rows("hopperlm", 4e-3, (4.9,) * 4)
    table += rows("hopperlm", 4e-3, (4.95,) * 4, share=0.5)
    assert ratio_of(table)["ratio_reached"] is None
    boot = ri.seed_bootstrap(table, ratio_of, draws=400)
    assert boot["interval_reached"][0] == 0.5  # the draws without seed 0 (about (3/4)^4 = 32% of them)
    assert boot["interval_reached"][1] is None and boot["missed_share_reached"] > 0.05
    assert ri.at_most(boot["interval_reached"]) is None
    assert ri.at_most([0.3, 0.49]) == 0.5 and ri.at_most([0.3, 0.51]) == 0.67


def test_the_old_race_is_restated_with_its_intervals(tmp_path):
    out = tmp_path / "intervals.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "race_intervals.py"), str(OLD_RACE), "--draws", "100", "--save", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())["time_to_target"]
    assert set(got) == {"nanogpt", "nanochat"}
    for block in got.values():
        for how in ("paired", "independent"):
            low, high = block[how]["interval_interpolated"]
            assert low <= block["ratio_interpolated"] <= (high if high is not None else float("inf"))
    # the committed intervals (2,000 draws) are this script's output on the same file
    saved = json.loads((REPO / "bench" / "results" / "2026-11-28-race-3tpp-intervals-cpu.json").read_text())
    assert (
        saved["results"].endswith(OLD_RACE.name)
        and saved["time_to_target"]["nanogpt"]["independent"]["draws"] == 2000
    )
    assert saved["time_to_target"]["nanogpt"]["ratio_interpolated"] == pytest.approx(0.28)


def test_exact_takes_every_resampling_of_four_seeds_once():
    table = rows("nanogpt", 1e-3, (4.8, 5.2, 4.9, 5.1)) + rows("hopperlm", 4e-3, (4.5, 4.6, 4.4, 4.5))
    table += rows("hopperlm", 4e-3, (5.2, 5.0, 5.1, 4.9), share=0.3)
    paired = ri.seed_bootstrap(table, ratio_of, paired=True, exact=True)
    independent = ri.seed_bootstrap(table, ratio_of, paired=False, exact=True)
    assert (paired["draws"], paired["exact"]) == (4**4, True) and (
        independent["draws"],
        independent["exact"],
    ) == (
        4**8,
        True,
    )
    assert independent == ri.seed_bootstrap(table, ratio_of, paired=False, exact=True, rng_seed=7)  # no draws
    drawn = ri.seed_bootstrap(table, ratio_of, paired=False, draws=300)
    assert drawn["exact"] is False and drawn["draws"] == 300
    many = [{**r, "seed": r["seed"] + 4 * k} for k in range(3) for r in table]  # 12 seeds: 12**24, drawn
    assert ri.seed_bootstrap(many, ratio_of, paired=False, draws=50, exact=True)["exact"] is False


def test_a_failed_baseline_run_gives_no_target_and_a_target_reached_at_once_is_an_upper_bound():
    table = rows("nanogpt", 1e-3, (5.0, None, 5.0, 5.0)) + rows("hopperlm", 4e-3, (4.5,) * 4)
    table += rows("hopperlm", 4e-3, (4.9,) * 4, share=0.3)
    failed = ratio_of(table)
    assert failed["ratio_reached"] is None and "seeds [1]" in failed["failed"]  # not "reached" by everything
    table = rows("nanogpt", 1e-3, (5.0,) * 4) + rows("hopperlm", 4e-3, (4.5,) * 4)
    table += rows("hopperlm", 4e-3, (4.9,) * 4, share=0.3)
    block = ratio_of(table)
    assert (
        block["reached_at_shortest"] and block["ratio_reached"] == 0.3
    )  # at most 0.3: nothing shorter was run
