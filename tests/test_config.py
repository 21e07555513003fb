"""Config loading, strict overrides and the one-line errors users see."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hopperlm.config import SECTIONS, CheckpointConfig, Config, config_from_dict, load_config, parse_overrides
from hopperlm.config.moved_keys import MOVED as ALL_MOVED
from hopperlm.errors import ConfigError
from hopperlm.interop.init_from import resolve_init_from

REPO = Path(__file__).resolve().parents[1]


def test_recipes_in_configs_load(data_dir):
    # recipes that start from a downloaded checkpoint get TinyLlama's config.json (a real HF config) instead
    stand_in = ["--model.init_from", str(data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0")]
    for path in sorted((REPO / "configs").glob("*.yaml")):
        needs_base = "init_from:" in path.read_text()
        cfg = resolve_init_from(load_config(path, stand_in if needs_base else []))
        assert isinstance(cfg, Config)


def test_preset_with_overrides_from_yaml_and_cli(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: tinyllama-1.1b\n  dropout: 0.1\ntrain:\n  max_steps: 5\n")
    cfg = load_config(path, ["--model.n_layers", "2", "--optim.lr=1e-3", "--train.compile", "false"])
    assert (cfg.model.dim, cfg.model.n_kv_heads, cfg.model.n_layers) == (2048, 4, 2)
    assert cfg.model.dropout == 0.1 and cfg.model.preset == "tinyllama-1.1b"
    assert cfg.optim.lr == 1e-3 and cfg.train.compile is False
    assert parse_overrides(["--train.max_hours", "1.5"]) == {"train": {"max_hours": 1.5}}


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"train": {"max_steps": 1, "max_stpes": 2}},
            "unknown config key 'train.max_stpes'; did you mean --train.max_steps?",
        ),
        ({"trian": {}}, "unknown config key 'trian'; did you mean the section 'train'?"),
        ({"train": {"max_steps": "ten"}}, "train.max_steps='ten' must be an integer"),
        ({"train": {"max_steps": 1, "compile": "yes"}}, "train.compile='yes' must be true or false"),
        (
            {"model": {"dim": 1000, "n_heads": 12}, "train": {"max_steps": 1}},
            "model.n_heads=12 does not divide",
        ),
        (
            {"model": {"n_heads": 8, "n_kv_heads": 3, "dim": 64}, "train": {"max_steps": 1}},
            "n_kv_heads=3 must divide",
        ),
        ({"model": {"preset": "gpt5"}, "train": {"max_steps": 1}}, "unknown model preset 'gpt5'"),
        ({"train": {}}, "no stopping rule"),
        ({"train": {"max_steps": 1, "precision": "fp8"}}, "train.precision='fp8' is not one of"),
        (
            {"train": {"max_steps": 1, "seq_len": 64, "micro_batch": 4, "batch_tokens": 1000}},
            "not a multiple",
        ),
        (
            {"model": {"max_seq_len": 128}, "train": {"max_steps": 1, "seq_len": 256}},
            "exceeds model.max_seq_len",
        ),
        # the checkpoint section checks its own keys
        (
            {"train": {"max_steps": 1}, "checkpoint": {"keep_last": 0}},
            "checkpoint.keep_last=0 must be positive",
        ),
        ({"train": {"max_steps": 1}, "checkpoint": {"every": -1}}, "checkpoint.every=-1 must be >= 0"),
        (
            {"train": {"max_steps": 1}, "checkpoint": {"keep_every": -5}},
            "checkpoint.keep_every=-5 must be >= 0",
        ),
        (
            {"train": {"max_steps": 1}, "checkpoint": {"async_save": True, "format": "single"}},
            "checkpoint.async_save needs the sharded format",
        ),
        (
            {"train": {"max_steps": 1}, "checkpoint": {"format": "zip"}},
            "checkpoint.format='zip' is not one of",
        ),
        (
            {"train": {"max_steps": 1}, "checkpoint": {"disk_full_retry_s": 0}},
            "checkpoint.disk_full_retry_s must be positive",
        ),
        (
            {"train": {"max_steps": 1}, "checkpoint": {"on_disk_full": "pause"}},
            "checkpoint.on_disk_full='pause' is not one of",
        ),
        (
            {"train": {"max_steps": 1}, "checkpoint": {"keep_lats": 2}},
            "unknown config key 'checkpoint.keep_lats'; did you mean --checkpoint.keep_last?",
        ),
    ],
)
def test_config_errors_name_the_field(raw, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


# the keys moved into the checkpoint section (the optimizer's moves: tests/test_optim_sections.py)
MOVED = {k: v for k, v in ALL_MOVED.items() if v.startswith("checkpoint.")}
# a value for each moved key that its new key accepts (and that differs from the default)
MOVED_VALUES = {
    ("train", "ckpt_every"): 5,
    ("train", "keep_last"): 2,
    ("train", "keep_every"): 10,
    ("train", "on_disk_full"): "wait",
    ("train", "disk_full_retry_s"): 1.5,
    ("train", "disk_full_wait_s"): 10.0,
    ("parallel", "checkpoint"): "sharded",
    ("parallel", "async_checkpoint"): True,
}


def test_the_moved_table_names_every_checkpoint_key_once():
    assert set(MOVED) == set(MOVED_VALUES)
    news = list(MOVED.values())
    assert len(set(news)) == len(news)
    fields = {f.name for f in dataclasses.fields(CheckpointConfig)}
    for (section, key), new in MOVED.items():
        new_section, new_key = new.split(".")
        assert new_section == "checkpoint" and new_key in fields, new
        assert key not in {f.name for f in dataclasses.fields(SECTIONS[section])}, (
            f"{section}.{key} still a field"
        )


def moved_recipe(tmp_path, section=None, key=None, value=None) -> Path:
    raw = {"train": {"max_steps": 1}}
    if section is not None:
        raw.setdefault(section, {})[key] = value
    path = tmp_path / "moved.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def assert_names_the_new_key(error: ConfigError, section: str, key: str) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"'{section}.{key}'" in message and f"'{MOVED[(section, key)]}'" in message, message
    assert f"--{MOVED[(section, key)]} " in message, message


@pytest.mark.parametrize("section, key", list(MOVED), ids=[f"{s}.{k}" for s, k in MOVED])
def test_a_moved_key_in_yaml_is_refused_naming_the_new_key(tmp_path, section, key):
    path = moved_recipe(tmp_path, section, key, MOVED_VALUES[(section, key)])
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert_names_the_new_key(e.value, section, key)


@pytest.mark.parametrize("section, key", list(MOVED), ids=[f"{s}.{k}" for s, k in MOVED])
def test_a_moved_key_on_the_command_line_is_refused_naming_the_new_key(tmp_path, section, key):
    value = MOVED_VALUES[(section, key)]
    shown = str(value).lower() if isinstance(value, bool) else str(value)
    with pytest.raises(ConfigError) as e:
        load_config(moved_recipe(tmp_path), [f"--{section}.{key}", shown])
    assert_names_the_new_key(e.value, section, key)
    # the key it names takes the value
    new = MOVED[(section, key)]
    cfg = load_config(moved_recipe(tmp_path), [f"--{new}", shown])
    assert getattr(cfg.checkpoint, new.split(".")[1]) == value
    cfg = load_config(moved_recipe(tmp_path, "checkpoint", new.split(".")[1], value))
    assert getattr(cfg.checkpoint, new.split(".")[1]) == value


def test_moved_keys_name_their_new_keys_literally(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(moved_recipe(tmp_path), ["--train.ckpt_every", "5"])
    assert str(e.value).startswith("config key 'train.ckpt_every' is now 'checkpoint.every'")
    assert "or pass --checkpoint.every 5" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(moved_recipe(tmp_path, "parallel", "async_checkpoint", True))
    assert str(e.value).startswith("config key 'parallel.async_checkpoint' is now 'checkpoint.async_save'")
    assert "'async_save: true' under 'checkpoint:'" in str(e.value)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="overrides look like"):
        parse_overrides(["max_steps", "3"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.max_steps"])


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "hopperlm", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_errors_are_one_line_exit_2(tmp_path):
    cases = [
        ("train", "configs/debug.yaml", "--train.max_stpes", "3"),  # unknown key
        ("train", "configs/debug.yaml", "--model.n_heads", "5"),  # impossible shape
        ("train", "configs/debug.yaml", "--data.path", str(tmp_path / "nothing")),  # missing data
        ("train", str(tmp_path / "missing.yaml")),  # missing config
    ]
    for args in cases:
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "Traceback" not in result.stderr


def test_cli_refuses_a_moved_key_in_one_line_naming_the_new_one():
    result = run_cli("train", "configs/debug.yaml", "--train.ckpt_every", "5", "--print-config")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "checkpoint.every" in lines[0] and "train.ckpt_every" in lines[0]
    assert result.stdout == ""  # no config printed


def test_cli_debug_shows_traceback():
    result = run_cli("train", "configs/debug.yaml", "--train.max_stpes", "3", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_a_mistyped_key_and_recipe_get_the_flag_and_the_name_to_paste(capsys):
    """The paste-ready forms: a mistyped key offers the flag (`--train.max_steps`), a mistyped recipe name the
    nearest recipe, both in the one `error:` line the CLI prints."""
    from hopperlm.cli import main

    for argv, expected in (
        (["configs/debug.yaml", "--train.max_step", "5"], "did you mean --train.max_steps?"),
        (["debg"], "config debg not found; did you mean debug?"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["train", *argv, "--print-config"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (
            err
        )
