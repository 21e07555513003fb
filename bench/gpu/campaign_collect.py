"""What each stage of bench/gpu/campaign.sh left, read back: one collector per kind of stage (pytest, bench
rows, QLoRA rows, FSDP, CUDA graphs, the flash/AC finder, training runs, the profile, the race), each giving
(ok, the numbers worth a glance, the stage's own fields) for campaign.py's `finish`. Only the standard library.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
from pathlib import Path


# ---- reading what a stage left ---------------------------------------------------------------------------------
def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by a kill
            rows.append(json.loads(line))
    return rows


def short(reason: str | None) -> str | None:
    """A plan reason without its explanation: 'off (CPU: ...)' -> 'off'."""
    return reason.split(" (")[0] if reason else reason


def finite(values: list[float]) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def plan_of(run: Path) -> dict:
    plan = (read_json(run / "plan.json") or {}).get("plan", {})
    reasons = plan.get("reasons", {})
    return {
        "compile": reasons.get("compile"),
        "attention": reasons.get("attention"),
        "activation_checkpointing": reasons.get("activation_checkpointing"),
        "micro_batch": reasons.get("micro_batch"),
        "grad_accum": plan.get("grad_accum"),
    }


def training_run(run: Path, log: str) -> dict:
    """A `hopperlm train` run: what the plan said, the logged losses, and how it ended."""
    rows = metrics(run)
    losses = [r["loss"] for r in rows if "loss" in r]
    speeds = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]  # the first log holds compile
    mfus = [r["mfu"] for r in rows[1:] if r.get("mfu")]
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    refusal = [line for line in log.splitlines() if line.startswith("error: ")]
    return {
        "plan": plan_of(run),
        "losses": losses,
        "val_loss": vals[-1] if vals else None,
        "steps": rows[-1]["step"] if rows else 0,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "result": read_json(run / "result.json"),
        "refused": refusal[-1] if refusal else None,
        "traceback": "Traceback (most recent call last)" in log,
    }


def last_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^(error: |[A-Za-z_.]*(Error|Exception)\b)", line):
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


# ---- one collector per kind of stage: (ok, key numbers, fields) ------------------------------------------------
def collect_pytest(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    summary = [
        line for line in log.splitlines() if re.search(r"\b(passed|skipped|failed|error|deselected)\b", line)
    ]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors")}
    if summary:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary[-1]):
            counts["errors" if word.startswith("error") else word] = int(n)
    ok = rc == 0 and counts["failed"] == 0 and counts["errors"] == 0
    if not smoke:  # on a GPU nothing may skip for want of CUDA: something passed, or the GPU was not seen
        ok = ok and counts["passed"] > 0
    key = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no tests ran"
    return ok, key, {"tests": counts, "pytest_summary": summary[-1].strip(" =") if summary else None}


def collect_bench(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    record = read_json(raw / "bench.json")
    if record is None:
        return False, "no bench.json", {}
    rows = record["rows"]
    configs = [r["config"] for r in rows]
    want = record.get("rows_asked") or ["eager", "hopperlm", "hopperlm fp8", "hf"]
    if smoke:  # float8 and HF + compile are CUDA-only rows: a CPU smoke run cannot have them
        want = [w for w in want if w not in ("hopperlm fp8", "hf+compile")]
    missing = [w for w in want if not any(c == w or c.startswith(w + " (") for c in configs)]
    ours = [r for r in rows if r["config"].startswith("hopperlm")]
    broken = [f"{r['config']}: {r['error']}" for r in rows if r.get("error")]
    ok = rc == 0 and not missing and all(r.get("tokens_per_s") for r in ours)
    key = []
    plan_row = next((r for r in ours if r["config"] == "hopperlm" and r.get("tokens_per_s")), None)
    for r in ours:
        if r.get("tokens_per_s"):
            spread = ""
            if r.get("tokens_per_s_min") is not None and len(r.get("window_tokens_per_s") or []) > 1:
                spread = f" ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})"
            mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else ""
            vs = f", {r['ratios']['vs hf']:.2f}x HF" if "vs hf" in r.get("ratios", {}) else ""
            if plan_row is not None and r is not plan_row and r.get("seq_len") == plan_row.get("seq_len"):
                vs += f", {r['tokens_per_s'] / plan_row['tokens_per_s']:.2f}x hopperlm"
            loss = f", loss {r['final_loss']:.4f}" if r.get("final_loss") is not None else ""
            key.append(f"{r['config']} {r['tokens_per_s']:,.0f} tok/s{spread}{mfu}{vs}{loss}")
    if missing:
        key.append(f"missing rows: {', '.join(missing)}")
    fields = {
        "device": record.get("device"),
        "rows": rows,
        "table": record.get("table"),
        "row_errors": broken,
    }
    return ok, "; ".join(key), fields


def collect_qlora(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    """qlora.py's rows: every case asked for, each --repeats times (a row per repeat), none with an error and
    none not asked for; the key numbers from its per-case summary (median of the repeats, largest peak)."""
    record = read_json(raw / "qlora.json")
    if record is None:
        return False, "no qlora.json", {}
    rows = record["rows"]
    want = record.get("cases") or []
    repeats = record.get("repeats") or 1
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["case"], []).append(r)
    ok = rc == 0 and bool(want) and sorted(by) == sorted(want)
    ok = ok and all(len(by[c]) == repeats and not any("error" in r for r in by[c]) for c in want)
    summary = {s["case"]: s for s in record.get("summary") or []}
    key = []
    for case in want:
        errors = [r["error"][:80] for r in by.get(case, []) if "error" in r]
        line = summary.get(case, {})
        if case not in by or errors or "tokens_per_s" not in line:
            key.append(f"{case}: {errors[0] if errors else 'missing'}")
            continue
        peak = f", peak {line['peak_mem_gb']:.2f} GB" if line.get("peak_mem_gb") is not None else ""
        times = f" (x{line['repeats']})" if line["repeats"] > 1 else ""
        text = f"{case} {line['tokens_per_s']:,.0f} tok/s{times}{peak}"
        if "tokens_ratio" in line:
            text += f", {line['tokens_ratio']:.2f}x {line['vs']}"
            text += f" at {line['peak_ratio']:.2f}x its peak" if "peak_ratio" in line else ""
        key.append(text)
    compiled, plain = summary.get("hopperlm-qlora-compile", {}), summary.get("hopperlm-qlora", {})
    if compiled.get("tokens_per_s") and plain.get("tokens_per_s"):
        key.append(f"QLoRA compile {compiled['tokens_per_s'] / plain['tokens_per_s']:.2f}x uncompiled")
    extra = sorted(set(by) - set(want))
    if extra:
        key.append(f"not asked for: {', '.join(extra)}")
    snapshots = [r["memory_snapshot"] for r in rows if isinstance(r.get("memory_snapshot"), dict)]
    stand_ins = sorted({r["stand_in"] for r in rows if r.get("stand_in")})
    fields = {
        "rows": rows,
        "summary": record.get("summary"),
        "stand_ins": stand_ins,
        "device": record.get("device"),
    }
    if snapshots:
        fields["memory_snapshot"] = snapshots[0]
    return ok, "; ".join(key), fields


def collect_fsdp(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    record = read_json(raw / "fsdp.json")
    if record is None:
        return False, "no fsdp.json", {}
    rows = record["rows"]
    ok = (
        rc == 0
        and {r["config"] for r in rows} >= {"none", "ddp", "fsdp"}
        and not any(r["error"] for r in rows)
    )
    base = next((r["tokens_per_s"] for r in rows if r["config"] == "none" and r["tokens_per_s"]), None)
    key = []
    for r in rows:
        if r["error"]:
            key.append(f"{r['config']}: {r['error'][:80]}")
        elif r["tokens_per_s"]:
            ratio = f" ({r['tokens_per_s'] / base:.3f}x none)" if base and r["config"] != "none" else ""
            key.append(f"{r['config']} {r['tokens_per_s']:,.0f} tok/s{ratio}")
    return ok, "; ".join(key), {"rows": rows, "table": record.get("table"), "device": record.get("device")}


def collect_cudagraphs(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    """(b) CUDA graphs with gradient accumulation: trains with finite losses, or the plan refuses cleanly."""
    run = training_run(raw / "run", log)
    trained = rc == 0 and finite(run["losses"])
    refused = rc == 2 and run["refused"] is not None and not run["traceback"]
    outcome = "trained" if trained else ("refused cleanly" if refused else "failed")
    losses = run["losses"]
    key = f"{outcome}; accum {run['plan']['grad_accum']}; compile: {short(run['plan']['compile'])}"
    if losses:
        key += f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    if refused:
        key += f"; {run['refused']}"
    return trained or refused, key, {"outcome": outcome, **run}


def collect_flash_ac(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    """(d) a forced attention kernel + full activation checkpointing + the micro-batch finder."""
    run = training_run(raw / "run", log)
    checkpoint_error = "CheckpointError" in log
    ok = rc == 0 and finite(run["losses"]) and not checkpoint_error
    losses = run["losses"]
    key = f"attention: {short(run['plan']['attention'])}; micro_batch: {short(run['plan']['micro_batch'])}"
    key += f"; AC: {short(run['plan']['activation_checkpointing'])}"
    if losses:
        key += f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    if checkpoint_error:
        key += "; CheckpointError in the log"
    return ok, key, {"checkpoint_error": checkpoint_error, **run}


def collect_train(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    """A short run of a recipe end to end: it stops at max_steps with finite losses and a validation loss."""
    run = training_run(raw / "run", log)
    result = run["result"] or {}
    checkpoints = sorted(p.name for p in (raw / "run" / "checkpoints").glob("step_*") if p.is_dir())
    report = (raw / "run" / "report.md").is_file()
    ok = rc == 0 and result.get("stopped_by") == "max_steps" and finite(run["losses"])
    ok = ok and run["val_loss"] is not None and bool(checkpoints) and report
    losses = run["losses"]
    key = [f"{run['steps']} steps"]
    if not checkpoints:
        key.append("no checkpoint")
    if not report:
        key.append("no report.md")
    if losses:
        key.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if run["val_loss"] is not None:
        key.append(f"val {run['val_loss']:.3f}")
    if run["tokens_per_s"]:
        key.append(f"{run['tokens_per_s']:,.0f} tok/s")
    if run["mfu"]:
        key.append(f"MFU {100 * run['mfu']:.1f}%")
    key.append(f"micro_batch: {short(run['plan']['micro_batch'])}")
    return ok, "; ".join(key), {**run, "checkpoints": checkpoints, "report": report}


def collect_profile(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    """`hopperlm profile`: the top-kernels table and profile.json come back; the trace stays on the machine."""
    folder = raw / "profile"
    record = read_json(folder / "profile.json")
    trace = folder / "trace.pt.trace.json"
    ok = rc == 0 and record is not None and trace.is_file() and (folder / "kernels.txt").is_file()
    key = (record or {}).get("summary") or "no profile.json"
    fields = {
        "device": (record or {}).get("device"),
        "shares": (record or {}).get("shares"),
        "trace_bytes": trace.stat().st_size if trace.is_file() else None,
    }
    return ok, key, fields


def collect_race(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    """Call R (bench/gpu/race_r.py): every run finished with a loss, and the time to target with its interval."""
    record = read_json(raw / "race-r.json")
    if record is None:
        return False, "no race-r.json", {}
    rows = record.get("rows", [])
    intervals = record.get("time_to_target_intervals", {})
    ok = rc == 0 and bool(rows) and all(r["final_val_loss"] is not None for r in rows) and bool(intervals)
    key = [f"{len(rows)} runs at width {record.get('width')}"]
    for baseline, t in intervals.items():
        if t.get("failed"):
            key.append(f"hopperlm to {baseline}'s loss: none ({t['failed']})")
            continue
        key.append(f"hopperlm to {baseline}'s loss: {t['ratio_interpolated']}x its FLOPs, 90% interval "
                   f"{t['independent']['interval_interpolated']}")  # fmt: skip
    return ok, "; ".join(key), {"rows": len(rows), "time_to_target_intervals": intervals}


def collect_broken(stage: str, raw: Path, log: str, rc: int, smoke: bool) -> tuple[bool, str, dict]:
    return rc == 0, "broken on purpose (CAMPAIGN_BREAK)", {}


def collector(stage: str):
    for prefix, fn in (
        ("gpu-tests", collect_pytest),
        ("bench-", collect_bench),
        ("qlora", collect_qlora),
        ("lora", collect_qlora),
        ("fsdp-", collect_fsdp),
        ("cudagraphs-", collect_cudagraphs),
        ("flash-", collect_flash_ac),
        ("owt-", collect_train),
        ("profile-", collect_profile),
        ("race-", collect_race),
    ):
        if stage.startswith(prefix):
            return fn
    raise SystemExit(f"campaign.py: no collector for stage {stage!r}")
