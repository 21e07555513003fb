"""`hopperlm plot RUN_DIR [RUN_DIR ...]`: PNGs from metrics.jsonl, several runs overlaid for comparison.

  loss.png        train (solid) and validation (dashed, dots) loss against steps, tokens and wall time; the
                  latest forecast of the final validation loss with its interval (a square at the budget's end)
  throughput.png  tokens/s and MFU against wall time
  lr.png          the learning-rate schedule
  grad_norm.png   gradient norm before clipping (log scale)
  memory.png      peak memory (and, on GPUs with NVML, device memory in use)
  gpu.png         GPU utilisation, power and temperature (only when the GPU monitor recorded them)
matplotlib draws off-screen (Agg), so this works on headless machines.
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


def loss_limits(runs: list[Run]) -> tuple[float, float] | None:
    """y-limits that show the interesting part: the first records' very high losses are cut off."""
    values, tails = [], []
    for run in runs:
        for key in ("loss", "val_loss"):
            _, ys = run.series("step", key)
            values += ys
            tails += ys[max(1, len(ys) // 20) :] if len(ys) > 2 else ys
    if not values:
        return None
    low, high = min(values), max(tails or values)
    pad = 0.05 * max(high - low, 1e-3)
    return low - pad, high + pad


def plot_runs(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Write the PNGs for these runs into out_dir; returns their paths."""
    runs = load_runs([Path(p) for p in run_dirs])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = _Figures(runs, out_dir)
    _plot_loss(figures)
    _plot_throughput(figures)
    _plot_lr_and_grad_norm(figures)
    _plot_memory(figures)
    if any(run.series("elapsed_s", "gpu_util")[0] for run in runs):  # only when the monitor recorded it
        _plot_gpu(figures)
    return figures.written


class _Figures:
    """What every figure of one `plot_runs` call shares: the runs, one colour per run, the wall-time axis, and
    the folder the PNGs go to (with the paths written so far)."""

    def __init__(self, runs: list[Run], out_dir: Path) -> None:
        import matplotlib

        self.runs, self.out_dir = runs, out_dir
        colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        self.color = {run.label: colors[i % len(colors)] for i, run in enumerate(runs)}
        self.several = len(runs) > 1
        self.time_label, self.time_div = time_axis(runs)
        self.written: list[Path] = []

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


def _plot_loss(figures: _Figures) -> None:
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
            ax.plot(
                [v / div for v in xs], ys, color=color[run.label], lw=1.2, alpha=0.8, label=f"{prefix}train"
            )
            xs, ys = run.series(x, "val_loss")
            if xs:
                ax.plot(
                    [v / div for v in xs],
                    ys,
                    "--o",
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
    axes[0].set_ylabel("loss (nats/token)")
    limits = loss_limits(runs)
    if limits:
        axes[0].set_ylim(*limits)
    axes[0].legend(fontsize=8)
    fig.suptitle("train and validation loss")
    figures.save(fig, "loss.png", wspace=0.06)


def _plot_throughput(figures: _Figures) -> None:
    """throughput.png: tokens/s and MFU against wall time (each value holds over its log interval: a step
    plot)."""
    runs, color = figures.runs, figures.color
    any_mfu = any(run.series("elapsed_s", "mfu")[0] for run in runs)
    if any_mfu:
        fig, (ax_tok, ax_mfu) = figures.subplots(1, 2, figsize=(13, 4.2))
    else:
        fig, ax_tok = figures.subplots(figsize=(7.5, 4.2))
    for run in runs:
        ax_tok.plot(
            *figures.elapsed(run, "tokens_per_s"),
            color=color[run.label],
            lw=1.2,
            drawstyle="steps-pre",
            label=run.label,
        )
        if any_mfu:
            ax_mfu.plot(
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
        ax_tok.legend(fontsize=8)
    figures.save(fig, "throughput.png")


def _plot_lr_and_grad_norm(figures: _Figures) -> None:
    """lr.png and grad_norm.png: the learning rate and the gradient norm against steps."""
    for key, name, title, log_y in (
        ("lr", "lr.png", "learning rate (at each log step)", False),
        ("grad_norm", "grad_norm.png", "gradient norm before clipping (at each log step)", True),
    ):
        fig, ax = figures.subplots(figsize=(7.5, 4.2))
        for run in figures.runs:
            xs, ys = run.series("step", key)
            ax.plot(
                xs,
                ys,
                marker="." if len(xs) <= 60 else None,
                color=figures.color[run.label],
                lw=1.2,
                label=run.label,
            )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_xlim(left=0)
        if log_y:
            _log_scale(ax.yaxis)
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
        if figures.several:
            ax.legend(fontsize=8)
        figures.save(fig, name)


def _plot_memory(figures: _Figures) -> None:
    """memory.png: peak memory (and, on GPUs with NVML, device memory in use) against steps."""
    runs, color = figures.runs, figures.color
    fig, ax = figures.subplots(figsize=(7.5, 4.2))
    for run in runs:
        prefix = figures.prefix(run)
        ax.plot(*run.series("step", "peak_mem_gb"), color=color[run.label], lw=1.5, label=f"{prefix}peak")
        xs, ys = run.series("step", "gpu_mem_gb")
        if xs:
            ax.plot(xs, ys, "--", color=color[run.label], lw=1.2, label=f"{prefix}device in use (NVML)")
    ax.set_title("memory (GB): CUDA max allocated, or the CPU process's peak RSS")
    ax.set_xlabel("step")
    highest = max(
        max(run.series("step", k)[1], default=0.0) for run in runs for k in ("peak_mem_gb", "gpu_mem_gb")
    )
    ax.set_ylim(0, 1.15 * highest if highest > 0 else 1.0)  # a flat line must not sit on the frame
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figures.save(fig, "memory.png")


def _plot_gpu(figures: _Figures) -> None:
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
            ax.plot(*figures.elapsed(run, key), color=figures.color[run.label], lw=1.2, label=run.label)
        ax.set_title(title)
        ax.set_xlabel(figures.time_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)  # a percentage: 95-99% must not look like a cliff
    axes[1].set_ylim(bottom=0)
    if figures.several:
        axes[0].legend(fontsize=8)
    figures.save(fig, "gpu.png")


def _draw_forecast(ax, run: Run, color: str, prefix: str) -> None:
    """The latest forecast of the final validation loss: a square at the step the budget ends, its interval as
    the error bar (observe/forecast.py)."""
    last = next((r for r in reversed(run.records) if r.get("forecast") is not None), None)
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


def _eng(axis) -> None:
    from matplotlib.ticker import EngFormatter

    axis.set_major_formatter(EngFormatter(sep=""))


def _log_scale(axis) -> None:
    """Log scale with plain numbers (0.5, 1, 2) on major and minor ticks, not 6x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_minor_locator(LogLocator(base=10, subs=(1.5, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    axis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
