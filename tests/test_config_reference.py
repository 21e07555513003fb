"""docs/config-reference.md is generated from the config dataclasses and never stale; every field has a
docstring; `--print-config` prints the resolved config as YAML and trains nothing."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from hopperlm.cli import main
from hopperlm.config import SECTIONS, load_config
from hopperlm.config.reference import COMMAND, all_fields, missing_docstrings, render

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "config-reference.md"


def test_every_field_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, (
        f"config fields without a docstring under them: {', '.join(missing)}; write one "
        f'("""What it does; null = what is chosen then."""), then run: {COMMAND}'
    )


def test_reference_is_current():
    assert REFERENCE.is_file(), f"docs/config-reference.md is missing; run: {COMMAND}"
    assert REFERENCE.read_text() == render(), f"docs/config-reference.md is stale; run: {COMMAND}"


def test_reference_covers_every_key_with_its_default():
    fields = {(f.section, f.name): f for f in all_fields()}
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            assert (section, field.name) in fields
            assert f"`{section}.{field.name}`" in render()
    assert fields[("schedule", "warmup_steps")].default == "100"
    assert fields[("optim", "betas")].default == "[0.9, 0.95]" and fields[("optim", "groups")].default == "[]"
    assert fields[("optim.groups[]", "pattern")].doc  # the table's rows have their own keys
    assert fields[("train", "max_steps")].default == "null"
    assert fields[("data", "sampling")].type == "random / sequential"
    assert fields[("train", "micro_batch")].type == "int or null"
    assert fields[("log", "tensorboard")].default == "true"


def print_config(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--print-config"])
        raise SystemExit(0)  # main returns normally when the verb returns
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_print_config_resolves_overrides_and_defaults(tmp_path, capsys):
    out = tmp_path / "run"
    printed = print_config(capsys, "train", "debug", "--train.max_steps", "7", "--run.out_dir", str(out))
    assert printed["train"]["max_steps"] == 7
    assert (
        printed["schedule"]["warmup_steps"]
        == load_config(REPO / "configs" / "debug.yaml").schedule.warmup_steps
    )
    assert set(printed) == set(SECTIONS)  # every section, defaults included
    assert printed["guard"]["policy"] == "skip"
    assert not out.exists()  # nothing trained, no run directory
    expected = load_config(
        REPO / "configs" / "debug.yaml", ["--train.max_steps", "7", "--run.out_dir", str(out)]
    )
    assert printed == expected.to_dict()


def test_print_config_on_diagnose_and_finetune(tmp_path, capsys):
    printed = print_config(capsys, "diagnose", "debug", "--model.dim", "128")
    assert printed["model"]["dim"] == 128
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"preset": "debug"},
                "train": {"max_steps": 3, "seq_len": 64},
                "sft": {"path": "x.jsonl"},
            }
        )
    )
    printed = print_config(capsys, "finetune", str(recipe), "--lora.rank", "4")
    assert printed["lora"]["rank"] == 4 and printed["sft"]["path"] == "x.jsonl"


def test_print_config_fills_in_model_init_from(tmp_path, capsys):
    from hf_tiny import save_hf, tiny_hf_model

    base = save_hf(tiny_hf_model("tinyllama"), tmp_path / "base")
    recipe = tmp_path / "cpt.yaml"
    recipe.write_text(
        yaml.safe_dump({"model": {"init_from": str(base)}, "train": {"max_steps": 3, "seq_len": 32}})
    )
    printed = print_config(capsys, "train", str(recipe))
    model = printed["model"]
    assert (model["dim"], model["n_layers"], model["n_kv_heads"], model["ffn_dim"]) == (64, 2, 2, 96)
    assert model["init_from"] == str(base)
