"""The run report: RUN_DIR/report.md and a self-contained RUN_DIR/report.html (plots embedded as base64 PNG).

Written when training ends and by `hopperlm report RUN_DIR` at any time (for a run still going, it shows where
the run stands). Everything comes from the run directory: config.yaml, plan.json (the plan and its reasons),
metrics.jsonl, events.jsonl (the stability guard), result.json (how the run ended) and checkpoints/.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hopperlm.checkpoint.layout import list_checkpoints, read_state
from hopperlm.errors import CheckpointError, DataError
from hopperlm.files import write_atomic
from hopperlm.observe.metrics import human_count, read_metrics
from hopperlm.observe.plot import plot_runs
from hopperlm.observe.progress import format_duration

DEMO_FILE = "demo.json"  # written by `hopperlm demo` beside the run's files: its text and its samples


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return read_metrics(path) if path.is_file() else []


def summarize(records: list[dict[str, Any]], plan: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The headline numbers as (label, value) rows. Mean speed is over the whole run (evaluation, checkpoints
    and compilation included); the median log interval is the steady state."""
    if not records:
        return [("metrics", "none yet (the run has not reached its first log step)")]
    last = records[-1]
    rows = [
        ("steps", f"{last['step']:,}"),
        ("tokens", f"{human_count(last['tokens'])} ({last['tokens']:,})"),
        ("training time", format_duration(last["elapsed_s"]) + f" ({last['elapsed_s']:.1f} s)"),
        ("final train loss", f"{last['loss']:.4f}"),
    ]
    vals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if vals:
        best_step, best = min(vals, key=lambda sv: sv[1])
        rows.append(("final val loss", f"{vals[-1][1]:.4f} (step {vals[-1][0]:,})"))
        rows.append(("best val loss", f"{best:.4f} (step {best_step:,})"))
    mean_tok_s = last["tokens"] / last["elapsed_s"] if last["elapsed_s"] > 0 else 0.0
    steady = statistics.median(r["tokens_per_s"] for r in records[1:] or records)
    rows.append(
        ("tokens/s", f"{human_count(mean_tok_s)} mean over the run, {human_count(steady)} median interval")
    )
    fpt = (plan or {}).get("flops_per_token")
    peak = ((plan or {}).get("hardware") or {}).get("peak_16bit_flops")
    mfus = [r["mfu"] for r in records[1:] or records if r.get("mfu") is not None]
    if fpt and peak and mfus:
        rows.append(
            (
                "MFU",
                f"{100 * mean_tok_s * fpt / peak:.1f}% mean over the run, {100 * statistics.median(mfus):.1f}% median",
            )
        )
    else:
        rows.append(("MFU", "n/a (CPU, or a GPU without a known peak)"))
    rows.append(("peak memory", f"{max(r['peak_mem_gb'] for r in records):.2f} GB"))
    gpu = [r for r in records if "gpu_util" in r]
    if gpu:
        util = statistics.mean(r["gpu_util"] for r in gpu)
        power = [r["gpu_power_w"] for r in gpu if "gpu_power_w" in r]
        temp = [r["gpu_temp_c"] for r in gpu if "gpu_temp_c" in r]
        text = f"{util:.0f}% mean utilisation"
        text += f", {statistics.mean(power):.0f} W mean" if power else ""
        text += f", {max(temp):.0f} C max" if temp else ""
        rows.append(("GPU", text))
    if last.get("skipped_steps"):
        rows.append(("skipped updates", f"{last['skipped_steps']} (non-finite loss or gradient)"))
    return rows


def val_at(row: dict[str, Any]) -> str:
    """A checkpoint's val loss, with the step it was measured at where that is an earlier one (a checkpoint
    between validations)."""
    step = row.get("val_step")
    earlier = step is not None and row["val_loss"] is not None and step != row["step"]
    return _fmt(row["val_loss"], ".4f") + (f" (step {step:,})" if earlier else "")


def checkpoint_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for ckpt in list_checkpoints(run_dir):
        try:
            state = read_state(ckpt)
        except CheckpointError:  # a damaged state.json must not stop the report
            state = {}
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        rows.append(
            {
                "name": ckpt.name,
                "step": state.get("step", ckpt.name),
                "tokens": state.get("tokens"),
                "val_loss": state.get("val_loss"),
                "val_step": state.get("val_step"),  # (older checkpoints have none)
                "size_mb": size / 1e6,
            }
        )
    return rows


def gather(run_dir: Path) -> dict[str, Any]:
    """Everything the report shows, read from the run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise DataError(f"{run_dir} has no config.yaml; pass a run directory written by `hopperlm train`")
    records = _read_jsonl(run_dir / "metrics.jsonl")
    plan = _read_json(run_dir / "plan.json")
    result = _read_json(run_dir / "result.json")
    if result:
        status = f"finished: {result['stopped_by']} ({result.get('finished_at', '')})"
    elif records:
        status = f"running or interrupted (last log at step {records[-1]['step']:,})"
    else:
        status = "not started or interrupted before its first log step"
    return {
        "name": run_dir.resolve().name,
        "run_dir": str(run_dir),
        "status": status,
        "summary": summarize(records, plan),
        "tasks": [(r["step"], r["tasks"]) for r in records if r.get("tasks")],
        "plan": plan,
        "events": _read_jsonl(run_dir / "events.jsonl"),
        "checkpoints": checkpoint_rows(run_dir),
        "config": (run_dir / "config.yaml").read_text(),
        "demo": _read_json(run_dir / DEMO_FILE),  # `hopperlm demo`'s text and samples
        "has_metrics": bool(records),
        "written_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_report(run_dir: Path, plots: bool = True) -> tuple[Path, Path]:
    """Plots into RUN_DIR/plots/, then report.md and report.html. Returns their paths."""
    run_dir = Path(run_dir)
    info = gather(run_dir)
    pngs: list[Path] = []
    if plots and info["has_metrics"]:
        pngs = plot_runs([run_dir], run_dir / "plots")
    md, page = run_dir / "report.md", run_dir / "report.html"
    # whole or as before: a full disk never leaves a torn report in place of the last one
    write_atomic(md, render_markdown(info, [p.relative_to(run_dir) for p in pngs]))
    write_atomic(page, render_html(info, pngs))
    return md, page


# ---- rendering: one list of blocks, drawn as Markdown and as HTML ---------------------------------------------
def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def blocks(info: dict[str, Any], pngs: list[Path]) -> list[tuple]:
    """The report as (kind, ...) blocks: h2, kv, table, text, muted, plots, code."""
    out: list[tuple] = [("h2", "Summary"), ("kv", info["summary"])]
    demo = info.get("demo")
    if demo:  # what the demo trained on (it may be the offline fallback) and what the model then wrote
        data = demo["data"]
        out += [
            ("h2", "Data"),
            ("kv", [("text", data["name"]), ("file", data["path"]), ("sha256", data["sha256"])]),
        ]
        out += [("code", f"sample {i + 1}", text) for i, text in enumerate(demo.get("samples", []))]
    if info.get("tasks"):  # lm-evaluation-harness during training (the eval section)
        names = sorted({name for _, metrics in info["tasks"] for name in metrics})
        rows = [[step, *(_fmt(metrics.get(n), ".4f") for n in names)] for step, metrics in info["tasks"]]
        out += [("h2", "Benchmarks (lm-evaluation-harness)"), ("table", ["step", *names], rows)]
    if pngs:
        out += [("h2", "Plots"), ("plots", pngs)]
    out.append(("h2", "Plan"))
    plan = info["plan"]
    if plan:
        p = plan["plan"]
        reasons = set(p["reasons"].values())
        out += [
            (
                "text",
                [line for line in plan["hardware"]["summary"] if line.split(": ", 1)[-1] not in reasons],
            ),
            ("table", ["choice", "reason"], [[k, v] for k, v in p["reasons"].items()]),
            (
                "text",
                [
                    f"Batch: {p['micro_batch']} sequences x {p['grad_accum']} accumulation = "
                    f"{p['tokens_per_step']:,} tokens/step; {plan['model']['parameters']['total']:,} parameters; "
                    f"{plan['flops_per_token'] / 1e9:.3f} GFLOP/token."
                ],
            ),
        ]
    else:
        out.append(("muted", "No plan.json: the run predates it."))
    out.append(("h2", "Stability events"))
    if info["events"]:
        rows = [[x["step"], x["cause"], x["action"]] for x in info["events"]]
        out.append(("table", ["step", "cause", "action"], rows))
    else:
        out.append(("muted", "None: no skipped update, spike or rollback."))
    out.append(("h2", "Checkpoints"))
    if info["checkpoints"]:
        rows = [
            [
                c["name"],
                c["step"],
                _fmt(c["tokens"], ","),
                val_at(c),
                f"{c['size_mb']:.1f} MB",
            ]
            for c in info["checkpoints"]
        ]
        out.append(("table", ["checkpoint", "step", "tokens", "val loss", "size"], rows))
    else:
        out.append(("muted", "None on disk."))
    out += [("h2", "Config"), ("code", "config.yaml", info["config"])]
    return out


def render_markdown(info: dict[str, Any], pngs: list[Path]) -> str:
    """pngs are paths relative to the run directory (the Markdown sits beside them)."""
    cell = lambda v: str(v).replace("|", "\\|")
    table = lambda head, rows: [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows),
    ]
    out = [f"# Run report: {info['name']}", "", f"`{info['run_dir']}`: {info['status']}", ""]
    for kind, *args in blocks(info, pngs):
        if kind == "h2":
            out += [f"## {args[0]}", ""]
        elif kind == "kv":
            out += [*table(["", ""], [list(r) for r in args[0]]), ""]
        elif kind == "table":
            out += [*table(args[0], args[1]), ""]
        elif kind == "text":
            out += [*args[0], ""] if len(args[0]) == 1 else [*(f"- {line}" for line in args[0]), ""]
        elif kind == "muted":
            out += [args[0], ""]
        elif kind == "plots":
            out += [*(f"![{p.stem}]({p.as_posix()})" for p in args[0]), ""]
        elif kind == "code":
            language = "yaml" if args[0].endswith(".yaml") else "text"
            title = [f"**{args[0]}**", ""] if language == "text" else []
            out += [*title, f"```{language}", args[1].rstrip(), "```", ""]
    out += [f"_Written by hopperlm at {info['written_at']}._", ""]
    return "\n".join(out)


CSS = """
body { font: 15px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1d2330; margin: 0;
       background: #f5f6f8; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 30px 0 10px; border-bottom: 1px solid #d9dce3; padding-bottom: 4px; }
.status { color: #4a5263; margin-bottom: 18px; }
code, pre { font: 13px/1.4 ui-monospace, Menlo, Consolas, monospace; }
table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 2px rgba(0,0,0,.06); }
th, td { text-align: left; padding: 6px 12px; border-bottom: 1px solid #eceef2; vertical-align: top; }
th { background: #eef0f4; font-weight: 600; }
table.kv td:first-child { font-weight: 600; white-space: nowrap; color: #39404f; }
.plots { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
.plots figure { margin: 0; background: #fff; padding: 8px; box-shadow: 0 1px 2px rgba(0,0,0,.06); }
.plots figure.wide { grid-column: 1 / -1; }
.plots img { width: 100%; height: auto; display: block; }
pre { background: #fff; padding: 12px; overflow-x: auto; box-shadow: 0 1px 2px rgba(0,0,0,.06); }
.muted { color: #6b7385; }
footer { margin-top: 32px; color: #8a91a0; font-size: 13px; }
"""


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header (IHDR is always the first chunk)."""
    head = path.read_bytes()[:24]
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def render_html(info: dict[str, Any], pngs: list[Path]) -> str:
    """One file with no outside references: the plots are embedded as base64 PNG."""
    e = html.escape

    def table(head: list[str] | None, rows: list[list[Any]], cls: str = "") -> str:
        parts = [f'<table class="{cls}">' if cls else "<table>"]
        if head:
            parts.append("<tr>" + "".join(f"<th>{e(str(h))}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in row) + "</tr>" for row in rows]
        return "".join(parts) + "</table>"

    def figure(p: Path) -> str:
        data = base64.b64encode(p.read_bytes()).decode()
        width, height = png_size(p)
        wide = ' class="wide"' if width > 2.2 * height else ""  # several panels side by side: full width
        return f'<figure{wide}><img alt="{e(p.stem)}" src="data:image/png;base64,{data}"></figure>'

    body = [
        f"<h1>Run report: {e(info['name'])}</h1>",
        f'<div class="status"><code>{e(info["run_dir"])}</code>: {e(info["status"])}</div>',
    ]
    for kind, *args in blocks(info, pngs):
        if kind == "h2":
            body.append(f"<h2>{e(args[0])}</h2>")
        elif kind == "kv":
            body.append(table(None, [list(r) for r in args[0]], "kv"))
        elif kind == "table":
            body.append(table(args[0], args[1]))
        elif kind == "text":
            body.append("<p>" + "<br>".join(e(line) for line in args[0]) + "</p>")
        elif kind == "muted":
            body.append(f'<p class="muted">{e(args[0])}</p>')
        elif kind == "plots":
            body.append('<div class="plots">' + "".join(figure(p) for p in args[0]) + "</div>")
        elif kind == "code":
            body.append(f"<details><summary>{e(args[0])}</summary><pre>{e(args[1])}</pre></details>")
    body.append(f"<footer>Written by hopperlm at {e(info['written_at'])}.</footer>")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>hopperlm run report: {e(info['name'])}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )
