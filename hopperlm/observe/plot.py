"""`hopperlm plot RUN_DIR [RUN_DIR ...]`: PNGs from metrics.jsonl, several runs overlaid for comparison.

  loss.png        train (solid) and validation (dashed, dots) loss against steps, tokens and wall time; the
                  latest forecast of the final validation loss with its interval (a square at the budget's end);
                  every point inside the axes (a log scale when the first losses tower over the last)
  throughput.png  tokens/s and MFU against wall time
  lr.png          the learning-rate schedule
  grad_norm.png   gradient norm before clipping (log scale)
  memory.png      peak memory (and, on GPUs with NVML, device memory in use)
  gpu.png         GPU utilisation, power and temperature (only when the GPU monitor recorded them)
matplotlib draws off-screen (Agg), so this works on headless machines. A series of few points (a short run: six
log steps, two evaluations) has a marker on each, so a single point shows; an empty one draws nothing and is
not in the legend.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hopperlm.errors import DataError
from hopperlm.files import write_atomic
from hopperlm.observe.metrics import read_metrics

DPI = 110
MARGIN_IN = {"left": 0.85, "right": 0.2, "bottom": 0.6, "top": 0.5}
MARKERS_UP_TO = 50  # points in a series: up to this many, each is also drawn as a marker
LOG_RATIO = 3.0  # the highest loss this many times the lowest: a log y-axis, so the late curve stays readable


@dataclass
class Run:
    label: str
    records: list[dict[str, Any]]

    def series(self, x: str, y: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        """(xs, ys) over the records that have a finite, non-null y."""
        xs, ys = [], []
        for r in self.records:
            value = r.get(y)
            if isinstance(value, (int, float)) and math.isfinite(value) and r.get(x) is not None:
                xs.append(r[x])
                ys.append(value * scale)
        return xs, ys


def load_runs(run_dirs: list[Path]) -> list[Run]:
    runs = []
    for run_dir, label in zip(run_dirs, run_labels(run_dirs), strict=True):
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise DataError(
                f"{run_dir} has no metrics.jsonl; pass a run directory written by `hopperlm train`"
            )
        records = read_metrics(path)
        if not records:
            raise DataError(f"{path} is empty: the run has not reached its first log step yet")
        runs.append(Run(label, records))
    return runs


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, with as many parent folders as it takes to tell them apart."""
    parts = [Path(p).resolve().parts for p in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in run_dirs]


def time_axis(runs: list[Run]) -> tuple[str, float]:
    """(label, divisor) for wall time: seconds, minutes or hours, whichever reads best."""
    longest = max((r.get("elapsed_s") or 0.0) for run in runs for r in run.records)
    if longest < 300:
        return "wall time (s)", 1.0
    if longest < 3 * 3600:
        return "wall time (min)", 60.0
    return "wall time (h)", 3600.0


def loss_values(runs: list[Run]) -> list[float]:
    """Every loss the loss plot draws: train, validation, and the latest forecast with its interval."""
    values = []
    for run in runs:
        for key in ("loss", "val_loss"):
            values += run.series("step", key)[1]
        forecast = _latest_forecast(run)
        if forecast is not None:
            values += [forecast[k] for k in ("forecast", "forecast_low", "forecast_high")]
    return values


def loss_limits(runs: list[Run]) -> tuple[float, float, bool] | None:
    """(low, high, log): y-limits holding every loss the plot draws, never one cut off (a user reads a point
    outside the axes as a point that is not there). Where the first losses are LOG_RATIO times the last the
    axis is logarithmic, and the margin is a fraction of the span in log space."""
    values = loss_values(runs)
    if not values:
        return None
    low, high = min(values), max(values)
    if low > 0 and high >= LOG_RATIO * low:
        pad = (high / low) ** 0.05
        return low / pad, high * pad, True
    pad = 0.05 * max(high - low, 0.02 * abs(high), 1e-3)  # a single point or a flat line: a visible band
    return low - pad, high + pad, False


def plot_runs(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Write the PNGs for these runs into out_dir; returns their paths."""
    runs = load_runs([Path(p) for p in run_dirs])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return draw(runs, out_dir).written


def draw(runs: list[Run], out_dir: Path) -> Figures:
    """Draw and write every figure of these runs; the Figures hold the matplotlib figures they wrote."""
    figures = Figures(runs, out_dir)
    _plot_loss(figures)
    _plot_throughput(figures)
    _plot_lr_and_grad_norm(figures)
    _plot_memory(figures)
    if any(run.series("elapsed_s", "gpu_util")[0] for run in runs):  # only when the monitor recorded it
        _plot_gpu(figures)
    return figures


class Figures:
    """What every figure of one `plot_runs` call shares: the runs, one colour per run, the wall-time axis, and
    the folder the PNGs go to (with the paths written so far, and each figure by its file name: tests read
    their axes)."""

    def __init__(self, runs: list[Run], out_dir: Path) -> None:
        import matplotlib

        self.runs, self.out_dir = runs, out_dir
        colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        self.color = {run.label: colors[i % len(colors)] for i, run in enumerate(runs)}
        self.several = len(runs) > 1
        self.time_label, self.time_div = time_axis(runs)
        self.written: list[Path] = []
        self.drawn: dict[str, Any] = {}

    def prefix(self, run: Run) -> str:
        """The run's label before a line's own label, when there are several runs to tell apart."""
        return f"{run.label} " if self.several else ""

    def elapsed(self, run: Run, y: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        xs, ys = run.series("elapsed_s", y, scale)
        return [x / self.time_div for x in xs], ys

    @staticmethod
    def subplots(*grid: int, **kwargs: Any) -> tuple[Any, Any]:
        """A figure and its axes, as pyplot.subplots makes them, on matplotlib's Figure alone: no pyplot, so no
        GUI backend chosen, no global figure list to close, nothing shared between threads."""
        from matplotlib.figure import Figure

        figsize = kwargs.pop("figsize")
        fig = Figure(figsize=figsize)
        return fig, fig.subplots(*grid, **kwargs)

    def save(self, fig: Any, name: str, wspace: float = 0.22) -> None:
        """Write the figure as NAME.png. wspace: the gap between side-by-side axes, a fraction of their width
        (less where they share the y axis and only the first shows its tick labels)."""
        # fixed margins in inches, room for our tick labels, axis labels and titles: tight_layout would measure
        # them by drawing every figure once more (a third of a report's time, and reports end every run)
        width, height = fig.get_size_inches()
        fig.subplots_adjust(
            left=MARGIN_IN["left"] / width,
            right=1 - MARGIN_IN["right"] / width,
            bottom=MARGIN_IN["bottom"] / height,
            top=1 - MARGIN_IN["top"] / height,
            wspace=wspace,
        )
        png = io.BytesIO()
        # zlib level 1: line plots on flat colours compress nearly as well, in a fraction of the time
        fig.savefig(png, format="png", dpi=DPI, pil_kwargs={"compress_level": 1})
        # whole or as before: a full disk never leaves a torn plot in place of the last one
        self.written.append(write_atomic(self.out_dir / name, png.getvalue()))
        self.drawn[name] = fig


def _plot_loss(figures: Figures) -> None:
    """loss.png: train and validation loss against steps, tokens and wall time."""
    runs, color = figures.runs, figures.color
    fig, axes = figures.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, (x, xlabel) in zip(
        axes, (("step", "step"), ("tokens", "tokens"), ("elapsed_s", figures.time_label)), strict=True
    ):
        for run in runs:
            div = figures.time_div if x == "elapsed_s" else 1.0
            xs, ys = run.series(x, "loss")
            prefix = figures.prefix(run)
            _line(
                ax,
                [v / div for v in xs],
                ys,
                color=color[run.label],
                lw=1.2,
                alpha=0.8,
                label=f"{prefix}train",
            )
            xs, ys = run.series(x, "val_loss")
            _line(
                ax,
                [v / div for v in xs],
                ys,
                ls="--",
                marker="o",  # evaluations are few and far between: always a dot each
                color=color[run.label],
                ms=4,
                lw=1.5,
                label=f"{prefix}val",
            )
            if x == "step":
                _draw_forecast(ax, run, color[run.label], prefix)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if x == "tokens":
            _eng(ax.xaxis)
    limits = loss_limits(runs)
    log_y = limits is not None and limits[2]
    if log_y:  # before the limits: a scale change re-limits the axis
        _log_scale(axes[0].yaxis, labelled=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
    if limits:
        axes[0].set_ylim(limits[0], limits[1])  # (the axes share y)
    axes[0].set_ylabel("loss (nats/token" + (", log scale)" if log_y else ")"))
    _legend(axes[0])
    fig.suptitle("train and validation loss")
    figures.save(fig, "loss.png", wspace=0.06)


def _plot_throughput(figures: Figures) -> None:
    """throughput.png: tokens/s and MFU against wall time (each value holds over its log interval: a step
    plot)."""
    runs, color = figures.runs, figures.color
    any_mfu = any(run.series("elapsed_s", "mfu")[0] for run in runs)
    if any_mfu:
        fig, (ax_tok, ax_mfu) = figures.subplots(1, 2, figsize=(13, 4.2))
    else:
        fig, ax_tok = figures.subplots(figsize=(7.5, 4.2))
    for run in runs:
        _line(
            ax_tok,
            *figures.elapsed(run, "tokens_per_s"),
            color=color[run.label],
            lw=1.2,
            drawstyle="steps-pre",
            label=run.label,
        )
        if any_mfu:
            _line(
                ax_mfu,
                *figures.elapsed(run, "mfu", 100.0),
                color=color[run.label],
                lw=1.2,
                drawstyle="steps-pre",
                label=run.label,
            )
    ax_tok.set_title(
        "training tokens/s per log interval" + ("" if any_mfu else " (MFU n/a: CPU or unknown GPU)")
    )
    _eng(ax_tok.yaxis)
    axes = [ax_tok]
    if any_mfu:
        ax_mfu.set_title("MFU (% of the GPU's dense bf16 peak)")
        axes.append(ax_mfu)
    for ax in axes:
        ax.set_xlabel(figures.time_label)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    if figures.several:
        _legend(ax_tok)
    figures.save(fig, "throughput.png")


def _plot_lr_and_grad_norm(figures: Figures) -> None:
    """lr.png and grad_norm.png: the learning rate and the gradient norm against steps."""
    for key, name, title, log_y in (
        ("lr", "lr.png", "learning rate (at each log step)", False),
        ("grad_norm", "grad_norm.png", "gradient norm before clipping (at each log step)", True),
    ):
        fig, ax = figures.subplots(figsize=(7.5, 4.2))
        for run in figures.runs:
            _line(ax, *run.series("step", key), color=figures.color[run.label], lw=1.2, label=run.label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_xlim(left=0)
        if log_y:
            _log_scale(ax.yaxis)
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
        if figures.several:
            _legend(ax)
        figures.save(fig, name)


def _plot_memory(figures: Figures) -> None:
    """memory.png: peak memory (and, on GPUs with NVML, device memory in use) against steps."""
    runs, color = figures.runs, figures.color
    fig, ax = figures.subplots(figsize=(7.5, 4.2))
    for run in runs:
        prefix = figures.prefix(run)
        _line(ax, *run.series("step", "peak_mem_gb"), color=color[run.label], lw=1.5, label=f"{prefix}peak")
        xs, ys = run.series("step", "gpu_mem_gb")
        _line(ax, xs, ys, ls="--", color=color[run.label], lw=1.2, label=f"{prefix}device in use (NVML)")
    ax.set_title("memory (GB): CUDA max allocated, or the CPU process's peak RSS")
    ax.set_xlabel("step")
    highest = max(
        max(run.series("step", k)[1], default=0.0) for run in runs for k in ("peak_mem_gb", "gpu_mem_gb")
    )
    ax.set_ylim(0, 1.15 * highest if highest > 0 else 1.0)  # a flat line must not sit on the frame
    ax.grid(alpha=0.3)
    _legend(ax)
    figures.save(fig, "memory.png")


def _plot_gpu(figures: Figures) -> None:
    """gpu.png: the GPU's utilisation, power and temperature against wall time, as the monitor recorded them."""
    fig, axes = figures.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(
        axes,
        (
            ("gpu_util", "GPU utilisation (%)"),
            ("gpu_power_w", "power (W)"),
            ("gpu_temp_c", "temperature (C)"),
        ),
        strict=True,
    ):
        for run in figures.runs:
            _line(ax, *figures.elapsed(run, key), color=figures.color[run.label], lw=1.2, label=run.label)
        ax.set_title(title)
        ax.set_xlabel(figures.time_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)  # a percentage: 95-99% must not look like a cliff
    axes[1].set_ylim(bottom=0)
    if figures.several:
        _legend(axes[0])
    figures.save(fig, "gpu.png")


def _draw_forecast(ax, run: Run, color: str, prefix: str) -> None:
    """The latest forecast of the final validation loss: a square at the step the budget ends, its interval as
    the error bar (observe/forecast.py)."""
    last = _latest_forecast(run)
    if last is None:
        return
    f, low, high = last["forecast"], last["forecast_low"], last["forecast_high"]
    ax.errorbar(
        [last["forecast_step"]],
        [f],
        yerr=[[f - low], [high - f]],
        fmt="s",
        color=color,
        ms=5,
        capsize=4,
        label=f"{prefix}forecast made at step {last['step']}",
    )


def _latest_forecast(run: Run) -> dict[str, Any] | None:
    return next((r for r in reversed(run.records) if r.get("forecast") is not None), None)


def _line(ax, xs: list[float], ys: list[float], **style: Any) -> None:
    """ax.plot for one series: with a marker on each point when there are MARKERS_UP_TO or fewer (a line through
    one point is invisible; six points read as six measurements, not as a smooth curve); a series with no
    point draws nothing, so the legend never names a line that is not there."""
    if not xs:
        return
    if len(xs) <= MARKERS_UP_TO:
        style.setdefault("marker", "o")
        style.setdefault("ms", 3.5)
    ax.plot(xs, ys, **style)


def _legend(ax) -> None:
    """A legend of the labelled lines drawn; none without any (matplotlib would warn and draw an empty box)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _eng(axis) -> None:
    from matplotlib.ticker import EngFormatter

    axis.set_major_formatter(EngFormatter(sep=""))


def _log_scale(axis, labelled: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    """Log scale with plain numbers (0.5, 1, 2) on the `labelled` ticks of each decade, not 6x10^-1; a loss spans
    less than a decade, so it labels more of them."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=labelled))
    minor = tuple(x for x in (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0) if x not in labelled)
    axis.set_minor_locator(LogLocator(base=10, subs=minor))
    axis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
