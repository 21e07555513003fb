"""The CLI as a user runs it: demo end to end, presets, prepare, and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hopperlm", *args], capture_output=True, text=True, cwd=REPO, env=env
    )


@pytest.mark.slow
def test_demo_end_to_end_short(tmp_path, data_dir):
    """The demo recipe for 40 steps: finds the text via HOPPERLM_DATA_DIR, prepares, trains, samples. (Steps,
    not the recipe's clock: a loss reached in N seconds depends on how busy the machine is; test_train.py
    checks the max_hours stop.)"""
    env = {**os.environ, "HOPPERLM_DATA_DIR": str(data_dir), "HOPPERLM_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "demo"
    result = run_cli(
        "demo",
        "--out",
        str(out),
        "--samples",
        "2",
        "--train.max_hours",
        "null",
        "--train.max_steps",
        "40",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "tinyshakespeare/input.txt" in result.stdout.splitlines()[0]
    assert "--- samples ---" in result.stdout and "demo: val loss" in result.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 40 and records[-1]["val_loss"] < 3.5  # ln(256) = 5.55 at the start
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["tokens"] == {"train": 1003855, "val": 111540}
    report = (out / "report.md").read_text()  # the text it trained on, named and hashed, and its samples
    assert (
        "| text | Tiny Shakespeare |" in report and "86c4e6aa9db7c042" in report and "**sample 2**" in report
    )
    again = run_cli("demo", "--out", str(out), env=env)  # never trains over an existing run
    assert again.returncode == 2 and "already exists" in again.stderr
    assert (out / "metrics.jsonl").is_file()  # ...and leaves the existing run as it was
    failed = run_cli("demo", "--out", str(tmp_path / "bad"), "--train.no_such_key", "1", env=env)
    assert failed.returncode == 2 and "no_such_key" in failed.stderr
    assert not (tmp_path / "bad").exists()  # a failed demo leaves nothing behind (its prepared data included)


def test_presets_lists_exact_sizes():
    result = run_cli("presets")
    assert result.returncode == 0
    assert "373,867,520" in result.stdout and "1,100,048,384" in result.stdout
    debug = next(line for line in result.stdout.splitlines() if line.startswith("debug "))
    assert " 256 " in debug and "(vocab from data)" in debug  # the columns keep their gap


def test_prepare_cli_and_its_errors(tmp_path, data_dir):
    out = tmp_path / "wiki"
    ok = run_cli("prepare", str(data_dir / "wikitext-2" / "wiki.valid.tokens"), "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "uint16"
    again = run_cli("prepare", str(data_dir / "wikitext-2" / "wiki.valid.tokens"), "--out", str(out))
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "--overwrite" in again.stderr
    missing = run_cli("prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    bpe = run_cli(
        "prepare",
        str(data_dir / "tinyshakespeare" / "input.txt"),
        "--out",
        str(tmp_path / "b"),
        "--tokenizer",
        "bpe",
    )
    assert bpe.returncode == 2 and "--vocab-size is required" in bpe.stderr
    stray = run_cli("generate", str(tmp_path), "--bogus", "1")
    assert stray.returncode == 2 and "unrecognised arguments: --bogus 1" in stray.stderr


def test_diagnose_simulated_plan_and_json():
    text = run_cli("diagnose", "owt-350m-h100", "--simulate", "H100 80GB")
    assert text.returncode == 0, text.stderr
    assert "(simulated: H100 80GB)" in text.stdout and "precision: bf16 autocast" in text.stdout
    assert "micro_batch: " in text.stdout and "self-test" not in text.stdout  # nothing to measure
    js = run_cli("diagnose", "debug", "--json", "--no-selftest", "--train.micro_batch", "8")
    assert js.returncode == 0, js.stderr
    report = json.loads(js.stdout)
    assert report["plan"]["micro_batch"] == 8 and report["hardware"]["device_type"] in ("cpu", "cuda")
    bad = run_cli("diagnose", "debug", "--simulate", "TPU")
    assert bad.returncode == 2 and "no simulated GPU" in bad.stderr


@pytest.mark.slow
def test_diagnose_takes_the_vocabulary_from_prepared_data_or_a_mixture(shakespeare_bytes):
    plan_line = lambda r: next(line for line in r.stdout.splitlines() if line.startswith("== plan"))  # noqa: E731
    unprepared = run_cli("diagnose", "debug", "--no-selftest", "--data.path", "/nonexistent")
    assert unprepared.returncode == 0, unprepared.stderr
    assert "vocabulary taken as 32000" in plan_line(unprepared)
    for source in (
        ["--data.path", str(shakespeare_bytes)],
        ["--data.path", str(shakespeare_bytes), "--data.mixture", f"{{{shakespeare_bytes}: 1.0}}"],
    ):
        planned = run_cli("diagnose", "debug", "--no-selftest", *source)
        assert planned.returncode == 0, planned.stderr
        assert plan_line(planned) == "== plan for debug", plan_line(planned)  # 256 byte ids, from the data
    both = run_cli("diagnose", "debug", "--no-selftest", "--data.mixture", f"{{{shakespeare_bytes}: 1.0}}")
    assert both.returncode == 2 and "list every dataset in data.mixture" in both.stderr  # not swallowed


def test_a_folder_input_reads_wikitext_tokens_files(tmp_path, data_dir):
    from hopperlm.data.sources import find_sources

    folder = tmp_path / "wiki"
    folder.mkdir()
    (folder / "wiki.valid.tokens").write_bytes(
        (data_dir / "wikitext-2" / "wiki.valid.tokens").read_bytes()[:5000]
    )
    assert [(s.kind, Path(s.path).name) for s in find_sources([str(folder)])] == [
        ("text", "wiki.valid.tokens")
    ]


def test_other_libraries_log_lines_go_to_a_file(tmp_path, capfd):
    import logging

    from hopperlm.cli.third_party_logs import Redirect

    with Redirect(tmp_path / "logs" / "third-party.log") as redirect:
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torch.utils._pytree").warning(
            "register_constant() on Enum subclasses is deprecated"
        )
    captured = capfd.readouterr()
    assert "Failed to load" not in captured.err + captured.out and "_pytree" not in captured.err
    text = (tmp_path / "logs" / "third-party.log").read_text()
    assert "Failed to load _C_mxfp8.so" in text and "register_constant" in text
    assert (
        redirect.summary()
        == f"(2 message(s) from other libraries written to {tmp_path / 'logs' / 'third-party.log'})"
    )
    logging.getLogger("torchao").warning("after the verb")  # the loggers are as they were
    assert "after the verb" not in (tmp_path / "logs" / "third-party.log").read_text()


def test_help_points_to_the_config_keys_and_no_verb_line_is_cut(capsys):
    """`train --help` says where every config key is listed; each verb's line in `hopperlm --help` is a
    whole phrase (sweep's once ended on "with the best")."""
    from hopperlm.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "every key is listed in docs/config-reference.md, and --print-config prints them all" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "sweep tune optim.lr of a mup recipe on a narrow proxy (or, with --mixture, the replay ratio of continued "
        "pretraining); write the tuned recipe" in text
    )
    assert "device self-test (~30 s on a CPU)" in text


def test_demo_with_no_data_reachable_says_how_to_give_it_and_its_report_names_the_fallback(
    tmp_path, monkeypatch, capsys
):
    """No --data, no $HOPPERLM_DATA_DIR, no shared data beside the checkout, no cache, no network: the demo
    trains on the offline fallback, says how to give it Tiny Shakespeare and that the losses do not compare,
    and its report names the text it trained on."""
    import urllib.error
    import urllib.request

    from hopperlm.cli import main
    from hopperlm.data import demo_text

    def no_network(url, timeout=None):
        raise urllib.error.URLError("no network in tests")

    monkeypatch.delenv("HOPPERLM_DATA_DIR", raising=False)
    monkeypatch.setenv("HOPPERLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_text, "CHECKOUT_DATA", None)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    out = tmp_path / "demo"
    main(["demo", "--out", str(out), "--samples", "1", "--train.max_hours", "null", "--train.max_steps", "5"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "not comparable to Tiny Shakespeare's" in first
    assert "--data PATH" in first and "$HOPPERLM_DATA_DIR" in first
    report = (out / "report.md").read_text()
    assert "| text | Python's language reference (pydoc_data.topics): the offline fallback" in report
    assert "pydoc-topics.txt" in report and "**sample 1**" in report


def test_every_message_prefix_is_lower_case_error_or_warning():
    """One prefix style everywhere: `error: ...` and `warning: ...`, never `Error:`, `ERROR:` or `Warning:`
    (a user greps for one form). Every string literal of the package and the scripts is read."""
    import ast
    import re

    repo = Path(__file__).resolve().parents[1]
    other_style = re.compile(r"^\s*(Error|ERROR|Warning|WARNING|Fatal|FATAL)\s*:")
    found = []
    for path in [
        *(repo / "hopperlm").rglob("*.py"),
        *(repo / "scripts").glob("*.py"),
        *(repo / "bench").rglob("*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            parts = node.values if isinstance(node, ast.JoinedStr) else [node]
            first = parts[0] if parts else None
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and other_style.match(first.value)
            ):
                found.append(f"{path.relative_to(repo)}:{node.lineno}: {first.value[:60]!r}")
    for path in [*(repo / "scripts").glob("*.sh"), *(repo / "bench").rglob("*.sh"), repo / ".ci" / "run"]:
        for number, line in enumerate(path.read_text().split("\n"), 1):
            if re.search(r"\becho\s+[\"']?(Error|ERROR|Warning|WARNING)\s*:", line):
                found.append(f"{path.relative_to(repo)}:{number}: {line.strip()[:60]!r}")
    assert not found, "write 'error: ...' / 'warning: ...':\n" + "\n".join(found)
