"""bench/race_3tpp.py: the regime it claims (>= 3 tokens per parameter, equal parameters, a FLOPs clock), nanochat's
recipe as published, the ladder's rule, the time to target on FLOPs, and the whole race in smoke mode."""

import json
import math
import statistics

import pytest
import race_3tpp as race  # bench/ is on pytest's pythonpath (pyproject.toml)
import race_recipes as recipes
import yaml

from hopperlm.config import load_config


def test_every_recipe_trains_at_least_3_tokens_per_parameter_at_equal_parameters():
    steps = race.race_steps(race.PROXY)
    tokens = steps * recipes.BATCH_TOKENS
    chat = recipes.nanochat(dim=64, steps=steps)
    untied = {**race.PROXY, "tie_embeddings": False}
    for recipe in (recipes.NANOGPT, chat):
        assert tokens / race.params_of({**race.PROXY, **recipe["model"]}) >= 3.0
    # nanochat's ReLU² MLP is as large as hopperlm's SwiGLU: the models differ by the QK-norm gains alone
    qk_gains = 2 * 32 * race.PROXY["n_layers"]
    assert race.params_of({**race.PROXY, **chat["model"]}) == race.params_of(untied) + qk_gains
    assert race.params_of(untied) == 737_856 and steps == 541
    assert race.params_of({**race.CONFIRM, "tie_embeddings": False}) / race.params_of(untied) >= 2.5


def test_nanochat_is_its_published_recipe_under_its_own_rules():
    steps = 541
    r = recipes.nanochat(dim=64, steps=steps, mult=2.0)
    batch = math.sqrt(4096 / 2**19)
    width = (64 / 768) ** -0.5
    o, m, s = r["optim"], r["muon"], r["schedule"]
    assert o["lr"] == pytest.approx(0.02 * batch * 2) and m["lr_adjust"] == "original"
    embed, head = o["groups"]  # multiples of optim.lr
    assert embed["pattern"] == "embed.weight" and embed["lr"] * o["lr"] == pytest.approx(
        0.3 * width * batch * 2
    )
    assert head["pattern"] == "lm_head.weight" and head["lr"] * o["lr"] == pytest.approx(
        0.008 * width * batch * 2
    )
    assert recipes.REF_STEPS == 2520  # d12: 110.1M scaling parameters x 12 tokens / 2^19
    assert m["weight_decay"] == pytest.approx(0.28 * batch * recipes.REF_TOKENS / (steps * 4096))
    assert m["momentum_warmup_steps"] == round(400 / 2520 * steps)
    assert (m["momentum_start"], m["momentum"], m["momentum_final"]) == (0.85, 0.97, 0.90)
    # warm-down over 65% of the whole run to 5%, after 40 of the reference's steps of warm-up
    assert s["warmup_share"] + (1 - s["warmup_share"]) * (1 - s["decay_fraction"]) == pytest.approx(0.35)
    assert r["model"]["logit_softcap"] == 15.0 and r["model"]["mlp"] == "relu2" and r["model"]["qk_norm"]


@pytest.mark.parametrize("name", ["nanogpt", "nanochat"])
def test_each_recipe_is_a_valid_hopperlm_config(tmp_path, name):
    recipe = recipes.NANOGPT if name == "nanogpt" else recipes.nanochat(dim=64, steps=541)
    cfg = race.run_config(recipe, model=race.PROXY, data=tmp_path, steps=541, seed=0, eval_windows=96)
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump(cfg))
    loaded = load_config(spec)
    assert loaded.train.max_steps == 541 and loaded.train.batch_tokens == 4096


def rows(losses_by_lr: dict, name="r", seeds=(0, 1), flops=100.0, share=1.0):
    return [{"recipe": name, "lr": lr, "seed": s, "final_val_loss": v, "budget_share": share, "flops": flops * share,
             "params": 10} for lr, vals in losses_by_lr.items() for s, v in zip(seeds, vals, strict=True)]  # fmt: skip


def test_v1_keeps_a_rung_only_when_both_seeds_beat_the_best_by_more_than_its_spread():
    best = rows({1: (5.00, 5.02)})
    assert race.beats(rows({1: (4.97, 4.99)}), best, "v1") == (True, pytest.approx(0.02))
    assert not race.beats(rows({1: (4.97, 5.01)}), best, "v1")[0]  # seed 1 wins by 0.01 < the spread
    assert not race.beats(rows({1: (4.0, None)}), best, "v1")[0]  # a failed seed loses


def test_v2_keeps_a_rung_that_wins_on_every_seed_by_more_than_a_paired_t_test_allows():
    seeds = (0, 1, 2, 3)
    best = rows({1: (5.36, 5.19, 5.30, 5.25)}, seeds=seeds)  # a noisy best: its own spread 0.17 stops nothing
    kept, margin = race.beats(rows({1: (5.09, 5.10, 5.12, 5.08)}, seeds=seeds), best)
    gains = [0.27, 0.09, 0.18, 0.17]
    assert kept and margin == pytest.approx(2.353 * statistics.stdev(gains) / 2)
    assert not race.beats(rows({1: (5.09, 5.20, 5.12, 5.08)}, seeds=seeds), best)[0]  # seed 1 loses
    # every seed wins, but by amounts whose spread the mean does not clear
    assert not race.beats(rows({1: (4.86, 5.18, 5.29, 5.24)}, seeds=seeds), best)[0]
    assert race.PLAN_V2["seeds"] == [0, 1, 2, 3] and race.PLAN_V2["grids"] == race.PLAN["grids"]


def test_flops_to_target_reads_finished_shorter_budgets():
    table = rows({1e-3: (5.0, 5.2), 2e-3: (4.9, 4.9)}, name="nanogpt")  # tuned: 2e-3, target 4.9
    table += rows({4e-3: (4.5, 4.5), 8e-3: (4.7, 4.7)}, name="hopperlm")
    table += rows({4e-3: (5.1, 5.1)}, name="hopperlm", share=0.2)
    table += rows({4e-3: (4.8, 4.8)}, name="hopperlm", share=0.4)
    got = race.flops_to_target(table, "hopperlm", "nanogpt")
    assert got["target_val_loss"] == 4.9 and got["hopperlm_lr"] == 4e-3 and got["ratio_reached"] == 0.4
    # log-linear between 20 (5.1) and 40 (4.8) FLOPs: the target 4.9 is two thirds of the way in loss
    assert got["ratio_interpolated"] == pytest.approx(20 * 2 ** (2 / 3) / 100, abs=1e-3)


def test_newton_schulz_flops_count_each_iteration_on_the_smaller_side():
    model = {**race.PROXY, "n_layers": 1}
    a = 64  # q, k, v, o: 64 x 64; gate, up (192 x 64) and down (64 x 192): A = 64, B = 192
    expected = 4 * 5 * (4 * a * a * a + 2 * a**3) + 3 * 5 * (4 * a * a * 192 + 2 * a**3)
    assert race.newton_schulz_flops(model) == expected


@pytest.mark.slow
def test_the_race_runs_end_to_end_in_smoke_mode(tmp_path):
    out, ladder = tmp_path / "race.json", tmp_path / "ladder.json"
    race.main(
        ["--smoke", "--cache", str(tmp_path / "cache"), "--save", str(out), "--ladder-save", str(ladder)]
    )
    result = json.loads(out.read_text())
    names = {r["recipe"] for r in result["rows"]}
    assert {"nanogpt", "nanochat", "hopperlm", "hopperlm (d=128)", "nanochat (d=128)"} <= names
    for key in ("recipe", "role", "lr", "seed", "budget_share", "steps", "tokens", "flops", "seconds", "params",
                "final_val_loss", "curve"):  # fmt: skip
        assert all(key in r for r in result["rows"]), key
    assert all(r["final_val_loss"] is not None and r["flops"] > 0 for r in result["rows"])
    assert set(result["time_to_target"]) == {"nanogpt", "nanochat"} and result["nanochat_left_out"]
    for t in result["time_to_target"].values():  # each baseline met at its own parameter count
        assert t["hopperlm_params"] <= t["baseline_params"] <= t["hopperlm_params"] + 256
    lad = json.loads(ladder.read_text())
    assert lad["rows"][0]["rung"] == "nanogpt (tuned)" and {
        "rung",
        "change",
        "seed",
        "final_val_loss",
        "kept",
    } <= set(lad["rows"][1])
