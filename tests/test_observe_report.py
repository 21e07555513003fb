"""Plots and the run report from a real short run: non-empty PNGs (one run and several overlaid), the Markdown
and the self-contained HTML report written at the end of training and on demand, and the CLI verbs."""

import base64
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import pytest

from hopperlm.cli import main
from hopperlm.config import load_config
from hopperlm.observe.metrics import read_metrics
from hopperlm.observe.plot import plot_runs, run_labels
from hopperlm.observe.report import png_size, summarize
from hopperlm.train.loop import train

DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"
PLOTS = {"loss.png", "throughput.png", "lr.png", "grad_norm.png", "memory.png"}


@pytest.fixture(scope="module")
def short_run(shakespeare_bytes, tmp_path_factory):
    """30 steps of the debug model with evaluation every 10: what a user's first run looks like."""
    run = tmp_path_factory.mktemp("observe") / "run-a"
    lines = []
    overrides = ["--train.max_steps", "30", "--train.eval_every", "10", "--train.log_every", "5"]
    cfg = load_config(DEBUG, ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(run), *overrides])
    result = train(cfg, log=lines.append)
    return run, lines, result


def assert_real_png(path: Path, min_width=500):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    width, height = png_size(path)
    assert width >= min_width and height >= 300, (path, width, height)
    pixels = matplotlib.image.imread(path)[..., :3]
    drawn = (pixels < 0.95).any(axis=-1).mean()
    assert drawn > 0.01, f"{path} is almost blank ({drawn:.3%} drawn)"


def test_training_prints_plain_progress_and_writes_the_report(short_run):
    run, lines, result = short_run
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 6 and all(" ETA " in line and "(max_steps)" in line for line in step_lines)
    assert step_lines[-1].endswith("| 100% ETA 0s (max_steps)")
    assert any(line.startswith("observe: metrics.jsonl, tensorboard") for line in lines)
    assert "plain lines (stdout is not a terminal)" in next(
        line for line in lines if line.startswith("observe:")
    )
    assert lines[-1] == f"report: {run / 'report.md'} and {run / 'report.html'}"
    assert {p.name for p in (run / "plots").iterdir()} == PLOTS  # no gpu.png without NVML readings
    plan = json.loads((run / "plan.json").read_text())
    assert plan["plan"]["reasons"]["precision"].startswith("fp32") and plan["flops_per_token"] > 0
    assert json.loads((run / "result.json").read_text())["stopped_by"] == result.stopped_by == "max_steps"


def test_plot_one_run_writes_non_empty_pngs(short_run, tmp_path):
    run, _, _ = short_run
    written = plot_runs([run], tmp_path)
    assert {p.name for p in written} == PLOTS
    for path in written:
        assert_real_png(path)
    assert png_size(tmp_path / "loss.png")[0] > 2.2 * png_size(tmp_path / "loss.png")[1]  # three panels


def test_plot_several_runs_overlaid_with_the_cli(short_run, tmp_path, capsys):
    run_a, _, _ = short_run
    run_b = tmp_path / "b" / "run-a"  # the same name in another folder: labels must tell them apart
    run_b.mkdir(parents=True)
    slower = [  # a second run: half the speed, a little worse, stopped earlier
        {**r, "loss": r["loss"] + 0.1, "tokens_per_s": r["tokens_per_s"] / 2, "elapsed_s": 2 * r["elapsed_s"]}
        for r in read_metrics(run_a / "metrics.jsonl")[:4]
    ]
    (run_b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slower))
    labels = run_labels([run_a, run_b])
    assert len(set(labels)) == 2 and all(label.endswith("run-a") for label in labels)
    out = tmp_path / "compare"
    main(["plot", str(run_a), str(run_b), "--out", str(out)])
    assert capsys.readouterr().out.count("wrote ") == len(PLOTS)
    for name in PLOTS:
        assert_real_png(out / name)
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and "metrics.jsonl" in err
    assert len(err.strip().splitlines()) == 1


class Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.srcs += [v for k, v in attrs if k in ("src", "href")]


def test_report_renders_markdown_and_self_contained_html(short_run):
    run, _, result = short_run
    md = (run / "report.md").read_text()
    records = read_metrics(run / "metrics.jsonl")
    for heading in (
        "## Summary",
        "## Plots",
        "## Plan",
        "## Stability events",
        "## Checkpoints",
        "## Config",
    ):
        assert heading in md, heading
    assert f"| best val loss | {result.best_val_loss:.4f} (step " in md
    assert f"| steps | {records[-1]['step']:,} |" in md and "| MFU | n/a" in md
    assert "| precision | fp32" in md and "step_000030" in md and "None: no skipped update" in md
    for name in PLOTS:
        assert f"](plots/{name})" in md

    page = (run / "report.html").read_text()
    parser = Tags()
    parser.feed(page)
    assert {"html", "table", "img", "details"} <= set(parser.tags)
    assert "script" not in parser.tags and "link" not in parser.tags
    assert all(src.startswith("data:image/png;base64,") for src in parser.srcs)  # nothing outside the file
    assert len(parser.srcs) == len(PLOTS)
    first = base64.b64decode(parser.srcs[0].split(",", 1)[1])
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{result.best_val_loss:.4f}" in page and "finished: max_steps" in page


def test_report_cli_on_an_interrupted_run_with_events(short_run, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(short_run[0], run)
    (run / "result.json").unlink()  # as if it were still running, or killed
    (run / "events.jsonl").write_text(
        json.dumps(
            {"step": 17, "cause": "non-finite loss or gradient norm (loss nan)", "action": "update skipped"}
        )
        + "\n"
    )
    main(["report", str(run)])
    assert capsys.readouterr().out == f"wrote {run / 'report.md'} and {run / 'report.html'}\n"
    md = (run / "report.md").read_text()
    assert "running or interrupted (last log at step 30)" in md
    assert "| 17 | non-finite loss or gradient norm (loss nan) | update skipped |" in md
    assert re.search(r"<td>17</td><td>non-finite loss", (run / "report.html").read_text())
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path)])
    assert exit_.value.code == 2 and "has no config.yaml" in capsys.readouterr().err


def test_summary_before_the_first_log_and_with_mfu():
    assert summarize([], None) == [("metrics", "none yet (the run has not reached its first log step)")]
    records = [
        {
            "step": 10,
            "tokens": 10_000,
            "loss": 3.0,
            "tokens_per_s": 900.0,
            "mfu": 0.2,
            "peak_mem_gb": 1.0,
            "elapsed_s": 12.0,
        },
        {
            "step": 20,
            "tokens": 20_000,
            "loss": 2.5,
            "tokens_per_s": 1000.0,
            "mfu": 0.4,
            "peak_mem_gb": 1.5,
            "elapsed_s": 22.0,
        },
    ]
    plan = {"flops_per_token": 1e9, "hardware": {"peak_16bit_flops": 2.5e12}}
    rows = dict(summarize(records, plan))
    # mean over the run: 20,000 tokens / 22 s = 909 tok/s -> 909 * 1e9 / 2.5e12 = 36.4%
    assert rows["MFU"] == "36.4% mean over the run, 40.0% median"
    assert rows["tokens/s"] == "909 mean over the run, 1.00K median interval"
    assert rows["peak memory"] == "1.50 GB"


def test_gpu_readings_and_mfu_get_their_plots_and_summary(short_run, tmp_path):
    """What a GPU run records (MFU, NVML readings), laid on the real run's curve."""
    run = tmp_path / "gpu-run"
    run.mkdir()
    records = [
        {**r, "mfu": 0.4, "gpu_util": 97.0, "gpu_power_w": 650.0, "gpu_temp_c": 70.0 + i, "gpu_mem_gb": 74.0}
        for i, r in enumerate(read_metrics(short_run[0] / "metrics.jsonl"))
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = {p.name: p for p in plot_runs([run], run / "plots")}
    assert set(written) == PLOTS | {"gpu.png"}
    assert_real_png(written["gpu.png"])
    width, height = png_size(written["throughput.png"])
    assert width > 2.2 * height  # tokens/s and MFU side by side
    plan = {"flops_per_token": 1e6, "hardware": {"peak_16bit_flops": 1e12}}
    rows = dict(summarize(records, plan))
    assert rows["GPU"] == f"97% mean utilisation, 650 W mean, {69 + len(records):.0f} C max"
    assert rows["MFU"].endswith("40.0% median")
