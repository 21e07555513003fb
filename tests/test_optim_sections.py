"""The optimizer config in three sections (optim with its groups table, muon, schedule): every old key refused in
one line naming its new place, a run saved under the old keys resuming bitwise, the groups table's refusals, and
the parameter groups exactly as before the move (tests/fixtures/run-0a191fd: what 0a191fd built)."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hopperlm.config import SECTIONS, MuonConfig, OptimConfig, config_from_dict, load_config
from hopperlm.config.moved_keys import BETAS, GROUP_PATTERNS, MOVED, migrate_saved
from hopperlm.errors import ConfigError
from hopperlm.model.transformer import build_model
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
OLD = REPO / "tests" / "fixtures" / "run-0a191fd"
# The kernels 0a191fd's run was recorded with: a CPU whose widest were AVX2. One with AVX-512 (as some CI machines
# have) sums in other orders, and its steps 8-12 differed in the 7th digit; the resume runs with the recording's
# kernels (ATen's, MKL's and oneDNN's), so a bitwise comparison means the same on every x86 machine
RECORDED_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}

# a value for each optim key that moved, as its old key took it (and unlike its default)
OPTIM_MOVED_VALUES = {
    "schedule": "wsd",
    "min_lr_ratio": 0.05,
    "warmup_steps": 7,
    "warmup_share": 0.2,
    "decay_fraction": 0.4,
    "resume_horizon": "keep",
    "muon_momentum": 0.9,
    "muon_momentum_warmup_steps": 8,
    "muon_momentum_start": 0.8,
    "muon_momentum_final": 0.9,
    "muon_lr_adjust": "spectral",
    "muon_weight_decay": 0.2,
    "cautious_weight_decay": True,
    "weight_decay_schedule": "cosine",
    "normuon": True,
    "normuon_beta2": 0.9,
    "muon_ns": "polar_express",
    "beta1": 0.8,
    "beta2": 0.99,
    "embed_lr": 0.024,
    "head_lr": 0.0015,
}
# keys that a moved key needs beside it to be accepted in its new place
NEEDS = {"muon_momentum_start": {"muon": {"momentum_warmup_steps": 4}},
         "normuon_beta2": {"muon": {"normuon": True}}}  # fmt: skip


def recipe(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_steps": 1}, **raw}))
    return path


def test_every_old_optim_key_is_listed_once():
    old = {k for (s, k) in MOVED if s == "optim"} | set(BETAS) | set(GROUP_PATTERNS)
    assert old == set(OPTIM_MOVED_VALUES)
    for (section, key), new in MOVED.items():
        new_section, new_key = new.split(".")
        assert new_key in {f.name for f in dataclasses.fields(SECTIONS[new_section])}, new
        assert key not in {f.name for f in dataclasses.fields(SECTIONS[section])}, (
            f"{section}.{key} still a field"
        )


@pytest.mark.parametrize("key", list(OPTIM_MOVED_VALUES))
def test_an_old_optim_key_is_refused_in_one_line_naming_its_new_place(tmp_path, key):
    value = OPTIM_MOVED_VALUES[key]
    for where in ("yaml", "cli"):
        with pytest.raises(ConfigError) as e:
            if where == "yaml":
                load_config(recipe(tmp_path, {"optim": {"lr": 0.003, key: value}}))
            else:
                shown = str(value).lower() if isinstance(value, bool) else str(value)
                load_config(recipe(tmp_path, {"optim": {"lr": 0.003}}), [f"--optim.{key}", shown])
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"config key 'optim.{key}' is now"), message
        new = MOVED.get(("optim", key)) or ("optim.betas" if key in BETAS else "optim.groups")
        assert f"'{new}'" in message, message
    # what it says to write is accepted, and means what the old key meant
    muon = MOVED.get(("optim", key), "").startswith("muon.")
    migrated, _ = migrate_saved({"optim": {"lr": 0.003, key: value, **({"name": "muon"} if muon else {})}})
    for section, extra in NEEDS.get(key, {}).items():
        migrated.setdefault(section, {}).update(extra)
    cfg = config_from_dict({**migrated, "train": {"max_steps": 1}})
    if ("optim", key) in MOVED:
        section, new_key = MOVED[("optim", key)].split(".")
        assert getattr(getattr(cfg, section), new_key) == value
    elif key in BETAS:
        assert cfg.optim.betas[BETAS[key]] == value
    else:
        (row,) = cfg.optim.groups
        assert row.pattern == GROUP_PATTERNS[key] and row.lr * 0.003 == pytest.approx(value)


def test_refusals_say_what_to_write_literally(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(recipe(tmp_path, {"optim": {"lr": 0.003, "embed_lr": 0.03}}))
    assert "write 'groups: [{pattern: embed.weight, lr: 10}]' under 'optim:'" in str(e.value), str(e.value)
    assert "or pass --optim.groups '[{pattern: embed.weight, lr: 10}]'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(recipe(tmp_path, {}), ["--optim.beta2", "0.99"])
    assert "'betas: [0.9, 0.99]' under 'optim:'" in str(e.value) and "--optim.betas [0.9,0.99]" in str(
        e.value
    )
    with pytest.raises(ConfigError) as e:
        load_config(recipe(tmp_path, {}), ["--optim.muon_ns", "polar_express"])
    assert str(e.value).startswith(
        "config key 'optim.muon_ns' is now 'muon.ns' (Muon's settings have their own"
    )
    assert "or pass --muon.ns polar_express" in str(e.value)
    # the suggested flag works as pasted
    cfg = load_config(recipe(tmp_path, {}), ["--optim.betas", "[0.9,0.99]", "--optim.groups", "[{pattern: embed.weight, lr: 10}]"])  # fmt: skip
    assert cfg.optim.betas == [0.9, 0.99] and cfg.optim.groups[0].lr == 10.0


def test_a_muon_key_without_muon_is_one_refusal(tmp_path):
    for key, value in (("momentum", 0.9), ("lr_adjust", "spectral"), ("ns", "polar_express")):
        path = recipe(tmp_path, {"muon": {key: value}})
        with pytest.raises(ConfigError) as e:
            load_config(path)
        message = str(e.value)
        assert "\n" not in message and message.startswith(
            f"muon.{key} is a setting of Muon's; set optim.name muon, or drop it (optim.name is adamw; on the "
            f"command line --muon.{key} "
        ), message
        flag = message.split("on the command line ")[1].split(" sets it back")[0].split()
        assert load_config(path, flag).muon.changed() == []  # the flag it names, pasted, is accepted
    assert (
        load_config(recipe(tmp_path, {"optim": {"name": "muon"}, "muon": {"momentum": 0.9}})).muon.momentum
        == 0.9
    )


def test_a_muon_recipe_switched_to_adamw_on_the_command_line_says_its_muon_section_is_not_read(
    tmp_path, capsys
):
    path = recipe(
        tmp_path, {"optim": {"name": "muon"}, "muon": {"lr_adjust": "spectral", "ns": "polar_express"}}
    )
    cfg = load_config(path, ["--optim.name", "adamw"])
    assert cfg.optim.name == "adamw" and cfg.muon == MuonConfig()
    assert (
        "config: --optim.name adamw: the recipe's muon section (lr_adjust, ns) is not read"
        in capsys.readouterr().out
    )
    with pytest.raises(ConfigError, match="is a setting of Muon.s"):  # a muon key given beside it: refused
        load_config(path, ["--optim.name", "adamw", "--muon.ns", "polar_express"])


def test_a_bad_key_in_a_yaml_file_names_the_file_and_the_key(tmp_path):
    path = recipe(tmp_path, {"schedule": {"warmup_stpes": 3}})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"config file {path}: unknown key 'warmup_stpes:' under 'schedule:'; did you mean 'warmup_steps:' "
        "(--schedule.warmup_steps)?"
    )
    path = recipe(tmp_path, {"schedul": {"warmup_steps": 3}})
    with pytest.raises(ConfigError, match=r"unknown section 'schedul:'; did you mean 'schedule:'\?"):
        load_config(path)


def tiny(**model):
    cfg = config_from_dict({"model": {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, **model},
                            "train": {"max_steps": 1, "seq_len": 32}})  # fmt: skip
    return build_model(cfg.model, torch.device("cpu"), seed=0)


def groups(opt):
    return [g for o in getattr(opt, "optimizers", (opt,)) for g in o.param_groups]


def test_the_groups_table_refuses_a_pattern_matching_nothing_and_a_parameter_claimed_twice():
    model = tiny(tie_embeddings=True)
    table = [{"pattern": "lm_head.weight", "lr": 0.5}]
    with pytest.raises(ConfigError, match="pattern 'lm_head.weight' matches no trainable parameter"):
        build_optimizer(
            model, config_from_dict({"optim": {"groups": table}, "train": {"max_steps": 1}}).optim, False
        )
    table = [{"pattern": "layers.*", "lr": 0.5}, {"pattern": "*.attn.*", "lr": 2}]
    with pytest.raises(
        ConfigError, match=r"layers\.0\.attn\.\S+ is matched by optim.groups patterns 'layers\.\*'"
    ):
        build_optimizer(tiny(), OptimConfig(groups=[config_row(r) for r in table]), False)
    with pytest.raises(ConfigError, match="sets betas on Muon's matrices"):
        build_optimizer(tiny(), OptimConfig(name="muon", groups=[config_row({"pattern": "layers.*", "betas": [0.8, 0.9]})]), False, "muon")  # fmt: skip
    with pytest.raises(ConfigError, match="pattern 'embed.weight' is listed twice"):
        OptimConfig(groups=[config_row({"pattern": "embed.weight"}), config_row({"pattern": "embed.weight"})])


def config_row(raw):
    return config_from_dict({"optim": {"groups": [raw]}, "train": {"max_steps": 1}}).optim.groups[0]


def test_a_group_takes_its_lr_multiple_betas_and_decay_on_top_of_mup():
    model = tiny(parametrization="mup", base_dim=16)
    rows = [{"pattern": "embed.weight", "lr": 8, "betas": [0.8, 0.95], "weight_decay": 0.01},
            {"pattern": "layers.*.mlp.*", "lr": 0.5, "weight_decay": 0.2}]  # fmt: skip
    opt = build_optimizer(
        model, OptimConfig(lr=1e-3, weight_decay=0.1, groups=[config_row(r) for r in rows]), False
    )
    by_name = {n: p for n, p in model.named_parameters()}
    of = {id(p): g for g in groups(opt) for p in g["params"]}
    embed = of[id(by_name["embed.weight"])]
    assert embed["lr_scale"] == 8 and embed["betas"] == (0.8, 0.95) and embed["weight_decay"] == 0.01
    up = of[id(by_name["layers.0.mlp.up_proj.weight"])]  # a matrix at width x2 under μP: 1/m, decay x m
    assert up["lr_scale"] == pytest.approx(0.5 * 0.5) and up["weight_decay"] == pytest.approx(0.2 * 2)
    q = of[id(by_name["layers.0.attn.q_proj.weight"])]  # no group: μP's alone, optim's betas
    assert q["lr_scale"] == pytest.approx(0.5) and q["betas"] == (0.9, 0.95)


def load_groups_script():
    spec = importlib.util.spec_from_file_location("make_groups", OLD / "make_groups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parameter_groups_are_as_0a191fd_built_them():
    """Ten recipes (AdamW and Muon; standard, μP, CompleteP; tied; embed_lr/head_lr, now groups rows): the same
    groups in the same order with the same factors (the order optimizer state is saved in)."""
    expected = json.loads((OLD / "groups.json").read_text())
    script = load_groups_script()
    got = {name: script.signature(*case) for name, case in script.CASES.items()}
    assert json.loads(json.dumps(got)) == expected


def test_a_saved_run_that_was_not_muons_drops_the_muon_keys_it_never_read():
    raw = {"optim": {"name": "adamw", "lr": 1e-3, "muon_lr_adjust": "spectral", "muon_momentum": 0.9,
                     "warmup_steps": 5}, "train": {"max_steps": 1}}  # fmt: skip
    out, said = migrate_saved(raw)
    cfg = config_from_dict(out)  # no refusal: an AdamW run never read them
    assert cfg.muon == MuonConfig() and cfg.schedule.warmup_steps == 5
    assert said == ["optim.warmup_steps -> schedule.warmup_steps", "Muon's keys dropped (not a Muon run)"]


def test_muon_section_defaults_are_the_old_keys_defaults():
    assert (
        MuonConfig().momentum == 0.95 and MuonConfig().ns == "keller" and OptimConfig().betas == [0.9, 0.95]
    )


@pytest.mark.slow
def test_a_run_saved_under_the_old_keys_resumes_bitwise(shakespeare_bytes, tmp_path):
    """0a191fd's run, cut after step 6, resumed by today's `hopperlm train RUN/config.yaml --resume`: its config
    read with the moved keys moved (one line says so), rewritten in the new form, and steps 7-12 exactly as the
    uninterrupted run of 0a191fd took them."""
    run = tmp_path / "cut"
    shutil.copytree(OLD / "cut", run)
    cmd = [sys.executable, "-m", "hopperlm", "train", str(run / "config.yaml"), "--resume",
           "--data.path", str(shakespeare_bytes), "--run.out_dir", str(run)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **RECORDED_KERNELS}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    said = out.stdout.splitlines()[0]
    assert "config.yaml was saved by an earlier hopperlm; read with " in said, said
    # its checkpoint has no Newton–Schulz precision: it trained bf16, as every Muon run then did, and keeps it
    assert "Newton–Schulz in bf16, as the checkpoint trained" in out.stdout
    assert "optim.schedule -> schedule.name" in said and "optim.muon_ns -> muon.ns" in said, said
    expected, got = read_metrics(OLD / "full-metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(expected, got, strict=True):
        assert (a["loss"], a["lr"], a["grad_norm"], a.get("val_loss")) == (
            b["loss"], b["lr"], b["grad_norm"], b.get("val_loss")
        ), (a, b)  # fmt: skip
    saved = yaml.safe_load((run / "config.yaml").read_text())  # moved once: the run wrote it anew
    assert "warmup_share" not in saved["optim"] and saved["schedule"]["warmup_share"] == 0.2
    assert saved["optim"]["groups"][0]["pattern"] == "embed.weight" and saved["muon"]["ns"] == "polar_express"


def test_train_in_process_matches_the_old_run_too(shakespeare_bytes, tmp_path):
    """The same through train() with the config as load_config reads a run folder, not the CLI (in a process of
    its own only to take the recording's kernels, which are chosen when torch starts)."""
    run = tmp_path / "cut"
    shutil.copytree(OLD / "cut", run)
    script = (
        "import sys; from hopperlm.config import load_config; from hopperlm.train.loop import train\n"
        "cfg = load_config(sys.argv[1] + '/config.yaml', ['--data.path', sys.argv[2], '--run.out_dir', sys.argv[1]])\n"
        "train(cfg, resume=True, log=lambda line: None)  # (train.threads 1, as the run was saved)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(run), str(shakespeare_bytes)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **RECORDED_KERNELS})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected, got = read_metrics(OLD / "full-metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [(r["loss"], r["lr"]) for r in expected] == [(r["loss"], r["lr"]) for r in got]
