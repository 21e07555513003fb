"""Every number a `generate`, `eval`, `launch` or `slurm` flag takes is checked before anything loads: one line naming the flag,
the value and the range, exit code 2. A config file that is not text gets one line naming it;
a mistyped verb or choice gets one line naming the one meant ("did you mean")."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BAD = [
    ("generate", "--max-new-tokens", "0", "must be an integer >= 1"),
    ("generate", "--max-new-tokens", "ten", "must be an integer >= 1"),
    ("generate", "--temperature", "-0.1", "must be a number >= 0"),
    ("generate", "--temperature", "nan", "must be a number >= 0"),
    ("generate", "--top-k", "-1", "must be an integer >= 0"),
    ("generate", "--top-p", "0", "must be a number in (0, 1]"),
    ("generate", "--top-p", "1.5", "must be a number in (0, 1]"),
    ("generate", "--repetition-penalty", "0", "must be a number > 0"),
    ("generate", "--num-samples", "0", "must be an integer >= 1"),
    ("generate", "--seed", "-3", "must be an integer >= 0"),
    ("eval", "--limit", "0", "must be an integer >= 1"),
    ("eval", "--shots", "-1", "must be an integer >= 0"),
    ("eval", "--max-new-tokens", "0", "must be an integer >= 1"),
    ("eval", "--seq-len", "0", "must be an integer >= 1"),
    ("eval", "--max-tokens", "0", "must be an integer >= 1"),
    ("eval", "--windows", "0", "must be an integer >= 1"),
    ("eval", "--batch", "2.5", "must be an integer >= 1"),
    ("eval", "--num-fewshot", "-1", "must be an integer >= 0"),
    ("launch", "--max-restarts", "-1", "must be an integer >= 0"),
    ("slurm", "--max-restarts", "-1", "must be an integer >= 0"),
]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hopperlm", *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize(("verb", "flag", "value", "need"), BAD, ids=[f"{b[1]}={b[2]}" for b in BAD])
def test_a_number_out_of_range_is_one_line_naming_the_flag(verb, flag, value, need, tmp_path):
    result = run_cli(verb, str(tmp_path / "no-model"), flag, value)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {flag} {value}: {need}"), lines[0]
    assert lines[0].endswith(f"see hopperlm {verb} --help")


def test_numbers_in_range_pass_the_parser():
    from hopperlm.cli import build_parser

    args = build_parser().parse_args(
        [
            "generate",
            "run",
            "--top-p",
            "1",
            "--top-k",
            "0",
            "--temperature",
            "0",
            "--repetition-penalty",
            "0.5",
        ]
    )
    assert (args.top_p, args.top_k, args.temperature, args.repetition_penalty) == (1.0, 0, 0.0, 0.5)
    assert args.max_new_tokens is None  # unset: the model's generation_config.json decides
    args = build_parser().parse_args(["eval", "m", "--shots", "0", "--limit", "1", "--batch", "3"])
    assert (args.shots, args.limit, args.batch) == (0, 1, 3)


@pytest.mark.parametrize(
    "content",
    [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"model:\n  dim: \xff\xfe64\n", b"model: {dim: 64}\x07\n"],
)
def test_a_config_that_is_not_text_is_one_line_naming_it(tmp_path, content):
    path = tmp_path / "x.yaml"
    path.write_bytes(content)
    result = run_cli("diagnose", str(path), "--no-selftest")
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path} is not a text YAML file"), result.stderr


TYPOS = [
    (["trian"], "error: 'trian' is not a verb; did you mean 'train'? See hopperlm --help"),
    (
        ["tokenizer", "extnd"],
        "error: 'extnd' is not a verb; did you mean 'extend'? See hopperlm tokenizer --help",
    ),
    (
        ["export", "r", "o", "--format", "ggfu"],
        "error: --format 'ggfu': did you mean 'gguf'? See hopperlm export --help",
    ),
]


@pytest.mark.parametrize(("argv", "line"), TYPOS, ids=[" ".join(t[0]) for t in TYPOS])
def test_a_mistyped_verb_or_choice_names_the_one_meant(argv, line, capsys):
    """In-process (the parser stops before anything loads): one line with the nearest choice, exit 2."""
    from hopperlm.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_a_verb_nothing_like_any_lists_them_all(capsys):
    from hopperlm.cli import main

    with pytest.raises(SystemExit):
        main(["zzzz"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: 'zzzz' is not a verb; choose from demo, train,") and "generate" in line
