"""bench/race_matrix.py: the coordinate search every recipe is tuned by (its budget, its moves, the edge rule),
nanochat's rules as its own small runs compute them, the proxy's shapes, and the whole race in smoke mode."""

from __future__ import annotations

import json
import math

import pytest
import race_matrix as race  # bench/ is on pytest's pythonpath (pyproject.toml)
from race_3tpp import model_config
from race_matrix_recipes import NANOCHAT_NS_SAFETY, hopperlm, nanochat, nanochat_rules, relu2_width
from race_recipes import REF_BATCH


class Bowl:
    """A race whose runs' final loss is a quadratic bowl in the point's offsets, centred at `centre`."""

    def __init__(self, centre: dict) -> None:
        self.centre, self.trained = centre, []

    def train(self, name, role, recipe, width, *, seeds, point=None, share=1.0):
        point = point or {}
        self.trained.append(dict(point))
        keys = set(point) | set(self.centre)
        loss = 3.0 + sum((point.get(k, 0.0) - self.centre.get(k, 0.0)) ** 2 for k in keys)
        return [{"final_val_loss": loss, "seed": 0, "point": point}]

    def log(self, line):
        pass


def search(bowl, axes, start=None, moves=None):
    return race.Search(bowl, "r", 64, lambda p: p, moves or {a: (a,) for a in axes}, start or {})


def test_the_search_spends_its_budget_and_finds_the_bowls_bottom():
    bowl = Bowl({"lr": 3.0, "wd": -2.0, "warmup": 0.5})
    s = search(bowl, ("lr", "wd", "warmup"))
    best = s.run(16)
    assert s.tuning_runs >= 16 and len(bowl.trained) == s.tuning_runs  # no point trained twice
    # steps 4x, 2x, sqrt 2: within half a step of the centre on every axis
    assert abs(best.get("lr", 0) - 3.0) <= 0.5 and abs(best.get("wd", 0) + 2.0) <= 0.5, best


def test_a_best_on_the_edge_grows_the_grid_at_most_three_times():
    bowl = Bowl({"lr": 20.0})  # far beyond: every step up is better
    s = search(bowl, ("lr",))
    best = s.run(3, steps=(1.0,))
    assert s.tuning_runs == 3 + 3 and best == {"lr": 4.0}  # 3 runs reach +1; the edge rule adds +2, +3, +4


def test_a_best_inside_its_grid_grows_nothing():
    bowl = Bowl({"lr": 1.0})
    s = search(bowl, ("lr",))
    assert s.run(None, steps=(1.0,)) == {"lr": 1.0} and s.tuning_runs == 4  # 0, -1, +1, then +2


def test_a_baseline_tuned_on_fewer_runs_than_hopperlm_goes_on_to_its_count():
    """The edge rule gave hopperlm more runs than a baseline whose best sat inside its grid: the baseline's search
    goes on (nothing trained twice) until it has at least as many."""
    ours, theirs = Bowl({"lr": 20.0}), Bowl({"wd": 1.0})
    searches = {"hopperlm": search(ours, ("lr",)), "nanogpt": search(theirs, ("lr", "wd"))}
    bests = {name: s.run(3, steps=(1.0,)) for name, s in searches.items()}
    assert searches["hopperlm"].tuning_runs == 6 and searches["nanogpt"].tuning_runs == 3
    bests = race.as_many_runs_as_hopperlm(searches, bests, (1.0,), race.EDGE_GROWTH)
    assert searches["nanogpt"].tuning_runs >= 6 and len(theirs.trained) == searches["nanogpt"].tuning_runs
    assert bests["nanogpt"] == {"wd": 1.0} and bests["hopperlm"] == {"lr": 4.0}  # found on the runs it lacked


def test_the_lr_axis_moves_every_lr_together():
    bowl = Bowl({"matrix": 1.0, "embedding": 3.0, "unembedding": 1.0})
    s = search(bowl, (), start={"embedding": 2.0}, moves={"lr": ("matrix", "embedding", "unembedding")})
    best = s.run(None, steps=(1.0,))
    assert best == {"matrix": 1.0, "embedding": 3.0, "unembedding": 1.0}
    assert all(p["embedding"] - p.get("matrix", 0.0) == 2.0 for p in bowl.trained[1:])


def test_a_failed_race_run_loses_the_decision_and_two_tie():
    below = {"independent": {"interval_interpolated": [0.7, 0.9]}}
    assert race.decide({"hopperlm to nanochat": below})["winner"] == "hopperlm"
    assert race.decide({"hopperlm to nanochat": below}, {"hopperlm"})["winner"] == "nanochat"
    assert race.decide({}, {"nanochat"})["winner"] == "hopperlm"
    assert race.decide({"hopperlm to nanochat": below}, {"hopperlm", "nanochat"})["winner"] == "tie"


def test_nanochats_rules_give_its_own_small_run_its_own_weight_decay():
    """runs/runcpu.sh at 92d63d4: depth 6, width 384 (aspect 64), a 32,768 vocabulary, 16,384-token batches;
    its weight decay lands near 0.24 (the issue's figure), not the 14.8 extrapolated from run length."""
    assert relu2_width(384) == 4 * 384  # nanochat's MLP width, so the scaling parameters are its own
    rules = nanochat_rules(384, 6, 32_768, batch=16_384)
    assert rules["muon_weight_decay"] == pytest.approx(0.235, abs=0.005)
    assert rules["matrix_lr"] == pytest.approx(0.02 * math.sqrt(16_384 / REF_BATCH))


def test_nanochats_recipe_carries_its_pinned_values():
    rules = nanochat_rules(64, 6, 1024)
    recipe = nanochat(rules, steps=331, dim=64, point={"weight_decay": -2.0, "embedding": 1.0})
    assert (
        recipe["muon"]["ns"] == "polar_express" and recipe["muon"]["ns_safety"] == NANOCHAT_NS_SAFETY == 1.01
    )
    assert recipe["muon"]["weight_decay"] == pytest.approx(rules["muon_weight_decay"] / 4)
    embed, head = recipe["optim"]["groups"]
    assert embed["lr"] * recipe["optim"]["lr"] == pytest.approx(2 * rules["embedding_lr"])
    assert (embed["betas"], embed["weight_decay"], head["betas"], head["weight_decay"]) == (
        [0.8, 0.995], 0.001, [0.8, 0.96], 0.01)  # fmt: skip


def test_the_proxy_is_mostly_matrices_and_trains_three_tokens_per_parameter():
    from hopperlm.model.transformer import parameter_shapes

    for width, params, share in ((64, 451_392, 0.70), (128, 1_541_760, 0.82)):
        model = {**race.shape(width), "tie_embeddings": False}
        assert race.params_of(model, race.VOCAB) == params
        shapes = parameter_shapes(model_config(model, race.VOCAB))
        blocks = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.") and len(s) == 2)
        assert blocks / params > share
        assert race.race_steps(race.shape(width), race.VOCAB) * 4096 >= 3 * params
    assert hopperlm(64)["model"]["parametrization"] == "mup"


@pytest.mark.slow
def test_the_race_runs_end_to_end_in_smoke_mode(tmp_path):
    out = tmp_path / "race.json"
    race.main(["--smoke", "--cache", str(tmp_path / "cache"), "--save", str(out)])
    result = json.loads(out.read_text())
    widths = {r["width"] for r in result["rows"]}
    assert widths == {64, 128} and all("tuning_runs" in r for r in result["rows"])
    assert result["tuned"]["128"]["hopperlm"]["tuning_runs"] == 0
    for width in ("64", "128"):
        for pair in ("hopperlm to nanogpt", "hopperlm to nanochat"):
            block = result["time_to_target_intervals"][width][pair]
            assert len(block["independent"]["interval_interpolated"]) == 2
    assert result["decision"]["winner"] in ("hopperlm", "nanochat", "tie")
