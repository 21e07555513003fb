"""The training loop with sequential sampling, packing and a Tigrinya + English mixture: exact resume from the
checkpointed data position, one validation loss per dataset."""

import json
import shutil

import pytest
from shared_data import DATA_DIR
from test_train import QUIET, debug_config

from hopperlm.checkpoint.layout import list_checkpoints, read_state
from hopperlm.data.prepare import prepare
from hopperlm.errors import ConfigError, DataError
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, src in (("tir", DATA_DIR / "hornmt" / "tir.txt"), ("eng", DATA_DIR / "hornmt" / "eng.txt")):
        lines = [line for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        prepare([root / f"{name}.jsonl"], root / name, progress=False)
        out[name] = root / name
    return out


def mixture_overrides(corpora, *extra):
    mixture = "{" + f"{corpora['tir']}: 0.7, {corpora['eng']}: 0.3" + "}"
    return [
        "--data.mixture", mixture, "--data.sampling", "sequential", "--data.packing", "true",
        "--train.max_steps", "8", "--checkpoint.every", "4", "--train.eval_every", "4", "--train.log_every", "1",
        "--train.eval_windows", "8", *extra,
    ]  # fmt: skip


def test_mixture_with_packing_resumes_exactly(corpora, tmp_path):
    overrides = mixture_overrides(corpora)
    full = tmp_path / "full"
    lines = []
    train(debug_config(corpora["tir"], full, *overrides), log=lines.append)
    assert any(
        line.startswith("data: sequential epochs read")
        and "; mixture tir 0.7 + eng 0.3; packing with" in line
        for line in lines
    )
    assert any(line.startswith("val by dataset: tir ") and "| eng " in line for line in lines)
    state = read_state(list_checkpoints(full)[0])
    assert state["data"]["position"] == 4 * 16 and sum(state["data"]["counts"]) == 64

    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000008")
    train(debug_config(corpora["tir"], cut, *overrides), resume=True, log=QUIET)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == rb["loss"] and ra.get("val_loss") == rb.get("val_loss")
    evals = [r for r in a if "val_loss" in r]
    assert len(evals) == 2
    for r in evals:
        per = r["val_losses"]
        assert set(per) == {"tir", "eng"}
        assert r["val_loss"] == pytest.approx(0.7 * per["tir"] + 0.3 * per["eng"])


def test_resume_needs_the_data_position(corpora, tmp_path):
    run = tmp_path / "run"
    base = ["--train.max_steps", "2", "--checkpoint.every", "2", "--train.eval_every", "0"]
    train(debug_config(corpora["eng"], run, *base), log=QUIET)  # random sampling: no position saved
    with pytest.raises(DataError, match="holds no data position"):
        train(
            debug_config(corpora["eng"], run, *base[:1], "4", *base[2:], "--data.sampling", "sequential"),
            resume=True,
            log=QUIET,
        )
    with pytest.raises(ConfigError, match="data.mixture weight"):
        train(
            debug_config(corpora["eng"], tmp_path / "x", "--data.mixture", f"{{{corpora['eng']}: 0}}"),
            log=QUIET,
        )


@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_a_zero_weight_dataset_is_evaluated_and_never_trained_on(corpora, tmp_path, sampling):
    """data.mixture {tir: 1, eng: 0}: English is a validation set only. Training is exactly the Tigrinya-only
    run's (the same loss at every step: not one English window drawn), and every evaluation has both losses,
    the run's val_loss Tigrinya's (English weighs 0 in it)."""
    common = ["--data.sampling", sampling, "--train.max_steps", "4", "--train.eval_every", "2",
              "--train.log_every", "1", "--train.eval_windows", "4"]  # fmt: skip
    alone, mixed = tmp_path / "alone", tmp_path / "mixed"
    train(debug_config(corpora["tir"], alone, *common), log=QUIET)
    lines = []
    zero = "{" + f"{corpora['tir']}: 1, {corpora['eng']}: 0" + "}"
    train(debug_config(corpora["tir"], mixed, *common, "--data.mixture", zero), log=lines.append)
    assert any("mixture tir 1 + eng 0 (validation only)" in line for line in lines), lines
    a, b = read_metrics(alone / "metrics.jsonl"), read_metrics(mixed / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(b) == 4
    evals = [r for r in b if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r, only in zip(evals, [r for r in a if "val_loss" in r], strict=True):
        assert set(r["val_losses"]) == {"tir", "eng"} and r["val_losses"]["eng"] > 0
        assert r["val_loss"] == r["val_losses"]["tir"] == only["val_loss"]
    if sampling == "sequential":  # the saved position counts Tigrinya's windows only
        assert read_state(list_checkpoints(mixed)[-1])["data"]["datasets"] == ["tir"]


def test_mixture_weights_below_zero_or_all_zero_are_one_line(corpora, tmp_path):
    for mixture, message in (
        (f"{{{corpora['tir']}: 1, {corpora['eng']}: -0.1}}", "weights must be numbers >= 0"),
        (f"{{{corpora['tir']}: 0, {corpora['eng']}: 0}}", "weights are all 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            debug_config(corpora["tir"], tmp_path / "x", "--data.mixture", mixture)
