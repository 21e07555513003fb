"""Config loading, strict overrides and the one-line errors users see."""

import subprocess
import sys
from pathlib import Path

import pytest

from hopperlm.checkpoint.init_from import resolve_init_from
from hopperlm.config import Config, config_from_dict, load_config, parse_overrides
from hopperlm.errors import ConfigError

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
            "unknown config key 'train.max_stpes'; did you mean 'max_steps'",
        ),
        ({"trian": {}}, "unknown config key 'trian'; did you mean 'train'"),
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
    ],
)
def test_config_errors_name_the_field(raw, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


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


def test_cli_debug_shows_traceback():
    result = run_cli("train", "configs/debug.yaml", "--train.max_stpes", "3", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr
