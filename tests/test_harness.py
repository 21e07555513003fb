"""`hopperlm eval --tasks` runs lm-evaluation-harness on hopperlm's own model code and scores what
`lm_eval --model hf` scores on the run's export: a LoRA fine-tune of the tiny TinyLlama, evaluated with its
adapters unmerged, against its merged Hugging Face export under transformers, on local tasks built from
../shared/data (multiple choice, rolling perplexity, lm-eval's own GSM8K task on the local file)."""

import json
from pathlib import Path

import pytest
from hf_tiny import finetune_config

from hopperlm.cli import main
from hopperlm.errors import ConfigError
from hopperlm.eval.harness import FIXED_SEEDS, metrics_of
from hopperlm.train.loop import train

lm_eval = pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731
TASKS = ["tir_news", "wikitext_paragraphs", "gsm8k_local"]


@pytest.fixture(scope="module")
def task_dir(data_dir, tmp_path_factory) -> Path:
    """The two task YAMLs hopperlm ships (configs/tasks, their data paths made absolute) and lm-eval's own
    GSM8K task pointed at the local train/test files."""
    out = tmp_path_factory.mktemp("tasks")
    for name in ("tir_news", "wikitext_paragraphs"):
        text = (REPO / "configs" / "tasks" / f"{name}.yaml").read_text()
        # (the rolling task reads Tiny Shakespeare's short speeches here: WikiText's long paragraphs through a
        # 32,000-piece vocabulary take a minute on both sides)
        text = text.replace("wikitext-2/wiki.test.tokens", "tinyshakespeare/input.txt")
        (out / f"{name}.yaml").write_text(text.replace("../shared/data", str(data_dir)))
    gsm8k = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    (out / "gsm8k_local.yaml").write_text(
        f"include: {gsm8k}\ntask: gsm8k_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        "dataset_kwargs:\n  data_files:\n"
        f"    train: {data_dir / 'gsm8k' / 'train.jsonl'}\n    test: {data_dir / 'gsm8k' / 'test.jsonl'}\n"
        # (answers of 32 tokens, not 256: transformers' generate on a CPU is the slow half of the test)
        "generation_kwargs:\n  until: ['Question:', '</s>', '<|im_end|>']\n  do_sample: false\n"
        "  temperature: 0.0\n  max_gen_toks: 32\n"
    )
    return out


@pytest.fixture(scope="module")
def lora_run(tinyllama_hf, data_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(a LoRA run, trained a few steps so its adapters are not zero; its merged Hugging Face export)."""
    root = tmp_path_factory.mktemp("lora-eval")
    run = root / "run"
    lora = ["--lora.rank", "4", "--lora.targets", "all-linear", "--sft.max_examples", "64"]
    steps = [
        "--train.max_steps",
        "4",
        "--train.log_every",
        "2",
        "--train.eval_every",
        "0",
        "--optim.lr",
        "1e-2",
    ]
    train(finetune_config(tinyllama_hf, data_dir, run, *lora, *steps), log=QUIET)
    main(["export", str(run), str(root / "export")])
    return run, root / "export"


@pytest.mark.slow
def test_eval_tasks_equal_lm_eval_hf_on_the_export(lora_run, task_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # local files only: no network, the datasets cache used
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, export = lora_run
    capsys.readouterr()
    common = ["--include-path", str(task_dir), "--limit", "4", "--num-fewshot", "1"]
    main(["eval", str(run), "--tasks", ",".join(TASKS), *common, "--json", str(tmp_path / "r.json"),
          "--log-samples", str(tmp_path / "s.jsonl")])  # fmt: skip
    printed = capsys.readouterr().out
    assert "|tir_news" in printed and "bits_per_byte" in printed  # lm-eval's table
    ours = json.loads((tmp_path / "r.json").read_text())["lm_eval"]["metrics"]

    from lm_eval.tasks import TaskManager

    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32",
        tasks=TASKS,
        limit=4,
        num_fewshot=1,
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=4,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
        **FIXED_SEEDS,  # the same few-shot examples as hopperlm's side drew
    )

    want = metrics_of(theirs)
    assert set(ours) == set(want)
    for name, value in want.items():
        assert ours[name] == pytest.approx(value, rel=1e-4), name
    assert ours["wikitext_paragraphs/bits_per_byte"] > 0 and "tir_news/acc" in ours
    # greedy generation: the very same text, sample by sample (before lm-eval's answer extraction)
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    samples = [s for s in map(json.loads, lines) if s["task"] == "gsm8k_local"]
    assert [s["resps"] for s in samples] == [s["resps"] for s in theirs["samples"]["gsm8k_local"]]
    assert len({s["doc_id"] for s in samples}) == 4 and all(s["resps"][0][0] for s in samples)


def test_without_lm_eval_or_with_an_unknown_task_one_line_says_what_to_do(lora_run, monkeypatch, capsys):
    run, _ = lora_run
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(run), "--tasks", "no_such_task", "--limit", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tasks no_such_task: no such lm-eval task" in err[0], err
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if not installed
    from hopperlm.eval.harness import require_lm_eval

    with pytest.raises(ConfigError, match=r"pip install 'hopperlm\[eval\]'"):
        require_lm_eval()


def test_local_tasks_index_their_folder_alone_and_a_dataset_out_of_reach_is_one_line(
    lora_run, task_dir, monkeypatch, capsys
):
    """Tasks all found in --include-path skip lm-eval's own index of ~14,000 YAMLs (about 10 s); a task's dataset
    that is neither cached nor downloadable (datasets raises ConnectionError offline) is a one-line error."""
    from hopperlm.eval.harness import task_manager

    local = task_manager(["tir_news", "gsm8k_local"], str(task_dir))
    assert set(local.all_tasks) == {"tir_news", "wikitext_paragraphs", "gsm8k_local"}

    def offline(**kwargs):
        raise ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    run, _ = lora_run
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(run), "--tasks", "tir_news", "--include-path", str(task_dir), "--limit", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the local cache and cannot be downloaded" in err[0], err
    assert "HF_DATASETS_CACHE" in err[0] and "lambada_openai" in err[0]


@pytest.mark.slow
def test_tasks_during_training(shakespeare_bytes, task_dir, tmp_path, capsys, monkeypatch):
    """eval.tasks at log steps: the metrics in metrics.jsonl (equal to `hopperlm eval` of the checkpoint of
    that step) and the report, and the run's losses those of a run without them (dropout on: the model goes
    back to train mode and every RNG to its state)."""
    from hopperlm.config import load_config
    from hopperlm.observe.metrics import read_metrics

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    common = ["--data.path", str(shakespeare_bytes), "--train.max_steps", "20", "--train.log_every", "5"]
    common += ["--train.eval_every", "10", "--checkpoint.every", "10", "--model.dropout", "0.1"]
    tasks = ["--eval.tasks", "tir_news", "--eval.include_path", str(task_dir), "--eval.limit", "8"]
    train(load_config(REPO / "configs" / "debug.yaml", [*common, "--run.out_dir", str(tmp_path / "plain")]))
    run = tmp_path / "tasks"
    train(load_config(REPO / "configs" / "debug.yaml", [*common, *tasks, "--eval.every", "10",
                                                        "--run.out_dir", str(run)]))  # fmt: skip
    records = read_metrics(run / "metrics.jsonl")
    with_tasks = [r for r in records if "tasks" in r]
    assert [r["step"] for r in with_tasks] == [10, 20]
    assert [r["loss"] for r in records] == [
        r["loss"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl")
    ]
    capsys.readouterr()
    main(["eval", str(run / "checkpoints" / "step_000010"), "--tasks", "tir_news", "--include-path",
          str(task_dir), "--limit", "8", "--json", str(tmp_path / "after.json")])  # fmt: skip
    after = json.loads((tmp_path / "after.json").read_text())["lm_eval"]["metrics"]
    assert with_tasks[0]["tasks"] == pytest.approx(after, rel=1e-6)
    assert "## Benchmarks (lm-evaluation-harness)" in (run / "report.md").read_text()


def test_an_unknown_task_stops_training_before_its_first_step(shakespeare_bytes, task_dir, tmp_path):
    from hopperlm.config import load_config

    args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(tmp_path / "run")]
    args += ["--eval.tasks", "tir_news,tir_nwes", "--eval.include_path", str(task_dir)]
    with pytest.raises(ConfigError, match=r"tasks tir_nwes: no such lm-eval task or in "):
        train(load_config(REPO / "configs" / "debug.yaml", args), log=QUIET)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained


def test_a_task_whose_data_file_is_missing_is_one_line_and_exit_2(shakespeare_bytes, tmp_path):
    """configs/tasks read ../shared/data; from a folder without it, `eval --tasks` says which file is missing in
    one line and exits 2 (datasets' FileNotFoundError was a 58-line traceback and exit 1)."""
    import subprocess
    import sys

    from hopperlm.config import load_config

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tir_news.yaml").write_text((REPO / "configs" / "tasks" / "tir_news.yaml").read_text())
    run = tmp_path / "run"
    args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(run), "--train.max_steps", "2"]
    train(load_config(REPO / "configs" / "debug.yaml", [*args, "--log.report", "false"]), log=QUIET)
    cwd = tmp_path / "elsewhere"  # ../shared/data does not resolve from here
    cwd.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopperlm",
            "eval",
            str(run),
            "--tasks",
            "tir_news",
            "--include-path",
            str(tasks),
        ],
        cwd=cwd,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: tasks tir_news: a task's data file is missing"), line
    assert "shared/data/masakhanews/tir/dev.tsv" in line and "task's YAML" in line
