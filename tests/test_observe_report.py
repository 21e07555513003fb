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
from hopperlm.observe.plot import MARKERS_UP_TO, draw, load_runs, plot_runs, run_labels
from hopperlm.observe.report import checkpoint_rows, png_size, summarize, val_at
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
    # 30 steps at log_every 5 would be 6 lines: every step is logged instead (5's largest divisor <= 30 // 10)
    assert [line for line in lines if line.startswith("log: ")] == [
        "log: every 1 step (not 5): this run has 30 steps, 6 lines at every 5; at least 10 show its course"
    ]
    assert len(step_lines) == 30 and all(" ETA " in line and "(max_steps)" in line for line in step_lines)
    assert all(line.startswith(f"step {i}/30 | train loss ") for i, line in enumerate(step_lines, 1))
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


def test_a_checkpoints_val_loss_names_the_step_it_is_from_when_earlier(short_run):
    run = short_run[0]
    (row,) = checkpoint_rows(run)  # step 30, validated there (eval_every 10)
    assert (row["step"], row["val_step"]) == (30, 30) and val_at(row) == f"{row['val_loss']:.4f}"
    between = {"step": 8, "val_loss": 2.5, "val_step": 6}  # a checkpoint between validations
    assert val_at(between) == "2.5000 (step 6)"
    assert val_at({"step": 8, "val_loss": 2.5}) == "2.5000"  # a checkpoint written before val_step was saved
    assert val_at({"step": 8, "val_loss": None, "val_step": None}) == "-"


def test_report_renders_markdown_and_self_contained_html(short_run):
    run, lines, result = short_run
    md = (run / "report.md").read_text()
    # the plan's attention kernel in the console's words, in the hardware line and the choices alike
    console = next(line for line in lines if line.startswith("attention: ")).removeprefix("attention: ")
    plan = md[md.index("## Plan") : md.index("## Stability events")]
    assert f"| attention | {console} |" in plan and "attention: " + console.split(" (")[0] in plan, plan
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


def write_run(run: Path, train_points, val_points=(), **last) -> Path:
    """A metrics.jsonl of these (step, loss) and (step, val_loss) points; `last` goes into the last record."""
    run.mkdir(parents=True)
    vals = dict(val_points)
    records = [
        {
            "step": step,
            "tokens": 1024 * step,
            "loss": loss,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 5000.0,
            "mfu": None,
            "step_time_s": 0.2,
            "peak_mem_gb": 0.4,
            "elapsed_s": 0.2 * step,
            **({"val_loss": vals[step]} if step in vals else {}),
        }
        for step, loss in train_points
    ]
    records[-1].update(last)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def loss_axes(run: Path, tmp_path: Path):
    return draw(load_runs([run]), tmp_path / "plots").drawn["loss.png"].axes


def drawn_points(axes) -> list[float]:
    return [y for ax in axes for line in ax.get_lines() for y in line.get_ydata()]


def test_the_loss_plot_of_a_short_run_shows_every_point_with_a_marker(tmp_path):
    """The issue's demo: 6 training points and 2 evaluations, the first (step 50) at 3.66 above a 2.4 limit."""
    train_points = [(50, 3.66), (100, 2.31), (150, 2.2), (200, 2.12), (250, 2.06), (262, 2.01)]
    run = write_run(
        tmp_path / "demo",
        train_points,
        [(250, 2.61), (262, 2.58)],
        forecast=2.5,
        forecast_low=1.7,  # the forecast's interval is drawn too: inside the axes as well
        forecast_high=2.9,
        forecast_step=300,
    )
    axes = loss_axes(run, tmp_path)
    low, high = axes[0].get_ylim()
    points = drawn_points(axes)
    assert {3.66, 2.01, 2.61, 1.7, 2.9} <= set(points)
    assert low < min(points) and max(points) < high, (low, high)  # nothing cut off, in any panel (shared y)
    assert axes[0].get_yscale() == "linear"  # 3.66 / 1.7 < LOG_RATIO: nothing to compress
    lines = {line.get_label(): line for line in axes[0].get_lines()}
    for label in ("train", "val"):
        assert lines[label].get_marker() == "o" and lines[label].get_markersize() > 0, label
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == [
        "train",
        "val",
        "forecast made at step 262",
    ]


def test_a_towering_first_loss_gets_a_log_axis_and_a_lone_evaluation_a_marker(tmp_path):
    run = write_run(tmp_path / "bpe", [(1, 10.4), (5, 6.0), (10, 3.7), (15, 2.9), (20, 2.5)], [(20, 2.45)])
    axes = loss_axes(run, tmp_path)
    low, high = axes[0].get_ylim()
    assert axes[0].get_yscale() == "log" and "log scale" in axes[0].get_ylabel()
    assert low < 2.45 and high > 10.4  # the first loss is on the plot, not above it
    (val,) = [line for line in axes[0].get_lines() if line.get_label() == "val"]
    # a line through one point draws nothing: the marker is what shows it
    assert len(val.get_xdata()) == 1 and val.get_marker() == "o" and val.get_markersize() >= 3


def test_a_series_without_points_is_not_in_the_legend_and_every_short_series_has_markers(tmp_path):
    run = write_run(tmp_path / "no-eval", [(10, 3.0), (20, 2.8), (30, 2.7)])  # no val_loss, no NVML
    figures = draw(load_runs([run]), tmp_path / "plots")
    axes = figures.drawn["loss.png"].axes
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["train"]
    diverged = write_run(tmp_path / "nan", [(10, float("nan")), (20, float("nan"))], [(20, 4.1)])
    legend = loss_axes(diverged, tmp_path / "diverged")[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["val"]  # every train loss non-finite: no "train"
    memory = figures.drawn["memory.png"].axes[0]
    assert [t.get_text() for t in memory.get_legend().get_texts()] == ["peak"]  # no "device in use (NVML)"
    for name, fig in figures.drawn.items():
        for ax in fig.axes:
            for line in ax.get_lines():
                if len(line.get_xdata()) <= MARKERS_UP_TO:
                    assert line.get_marker() not in (None, "", " ", "None"), (name, line.get_label())
