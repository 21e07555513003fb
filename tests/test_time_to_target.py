"""bench/time_to_target.py: the recipes it races are the ones the issue names, the time to target is read
from the curves as documented, and the script runs end to end (smoke mode: seconds per run, real books)."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from hopperlm.config import load_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
try:
    import time_to_target as ttt
finally:
    sys.path.remove(str(REPO / "bench"))


def config_for(name: str, tmp_path: Path, steps: int = 1000) -> dict:
    return ttt.run_config(ttt.RECIPES[name], tmp_path / "data", tmp_path / name, seconds=200, steps=steps,
                          seed=3, threads=2, eval_windows=96)  # fmt: skip


def test_the_baselines_are_the_settings_the_issue_names(tmp_path):
    users = config_for("users-start", tmp_path)
    assert users["optim"] == {
        "lr": 6e-4, "schedule": "cosine", "beta2": 0.999, "weight_decay": 0.01, "warmup_steps": 64
    }  # fmt: skip
    assert users["train"]["micro_batch"] == 8 and users["train"]["batch_tokens"] == 8 * 16 * ttt.SEQ_LEN
    nano = config_for("nanogpt", tmp_path)
    assert (
        nano["optim"]["lr"] == 6e-4
        and nano["optim"]["beta2"] == 0.95
        and nano["optim"]["min_lr_ratio"] == 0.1
    )
    assert nano["optim"]["warmup_steps"] == round(1000 * 700 / 19_073) and nano["model"]["tie_embeddings"]
    # every recipe is the same model on the same wall-clock budget, and a valid hopperlm config
    for name in ttt.RECIPES:
        cfg = config_for(name, tmp_path)
        assert {k: cfg["model"][k] for k in ttt.MODEL} == ttt.MODEL
        assert cfg["train"]["max_hours"] == pytest.approx(200 / 3600) and cfg["train"]["seed"] == 3
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump(cfg))
        loaded = load_config(spec)
        assert loaded.train.batch_tokens % loaded.train.seq_len == 0


def test_hopperlms_recipe_is_nanogpt_with_the_kept_rungs():
    names = [rung for rung, _ in ttt.LADDER]
    assert set(ttt.KEPT) <= set(names) and list(ttt.KEPT) == [n for n in names if n in ttt.KEPT]
    hopper = ttt.RECIPES["hopperlm"]
    assert hopper["role"] == "hopperlm" and hopper["warmup"] == ttt.RECIPES["nanogpt"]["warmup"]
    changes, nanogpt = dict(ttt.LADDER), ttt.RECIPES["nanogpt"]
    expected = {section: dict(nanogpt[section]) for section in ("model", "optim", "train")}
    for rung in ttt.KEPT:
        for section, keys in changes[rung].items():
            expected[section].update(keys)
    assert {section: hopper[section] for section in expected} == expected


def row(recipe, role, wall, curve):
    return {"recipe": recipe, "role": role, "wall_s": wall, "final_val_loss": curve[-1][1], "curve": curve}


def test_time_to_target_is_the_first_hopperlm_point_at_the_best_baselines_loss():
    rows = [
        row("users-start", "baseline", 200.0, [[100, 6.0], [200, 5.5]]),
        row("nanogpt", "baseline", 198.0, [[100, 5.4], [198, 5.0]]),
        row("hopperlm", "hopperlm", 200.0, [[50, 5.2], [150, 4.99], [200, 4.5]]),
        row("hopperlm-short", "hopperlm", 120.0, [[60, 5.1], [120, 4.9]]),
    ]
    got = ttt.time_to_target(rows)
    assert got["best_baseline"] == "nanogpt" and got["target_val_loss"] == 5.0
    assert got["hopperlm_s"] == 120 and got["ratio"] == pytest.approx(120 / 198, abs=1e-3) and got["met"]
    rows[-1] = row("hopperlm-short", "hopperlm", 120.0, [[60, 5.1], [120, 5.01]])
    got = ttt.time_to_target(rows)
    assert got["hopperlm_s"] == 150 and not got["met"]
    rows[2] = row("hopperlm", "hopperlm", 200.0, [[200, 5.2]])
    assert ttt.time_to_target(rows)["hopperlm_s"] is None and not ttt.time_to_target(rows)["met"]


@pytest.mark.slow
def test_the_race_runs_end_to_end_in_smoke_mode(tmp_path):
    out = tmp_path / "race.json"
    result = ttt.main(["--smoke", "--cache", str(tmp_path / "cache"), "--save", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [r["recipe"] for r in result["rows"]] == ["users-start", "nanogpt", "hopperlm", "hopperlm-short"]
    for r in result["rows"]:
        assert r["role"] in ("baseline", "hopperlm") and r["wall_s"] > 0 and r["curve"]
        assert r["curve"][-1][1] == r["final_val_loss"] and all(s > 0 and v > 0 for s, v in r["curve"])
    assert set(result["time_to_target"]) >= {"best_baseline", "target_val_loss", "hopperlm_s", "ratio", "met"}
