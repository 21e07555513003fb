"""The bookkeeping of bench/gpu/campaign.sh: what each stage's outputs say, one JSON per stage, the summary.

    python3 bench/gpu/campaign.py machine OUT [--smoke] [--call N]
    python3 bench/gpu/campaign.py finish STAGE OUT --rc RC --seconds S --limit L [--smoke]
    python3 bench/gpu/campaign.py skip STAGE OUT --reason TEXT [--smoke]
    python3 bench/gpu/campaign.py summary OUT [--bring DIR --call N]

`finish` reads what the stage left in OUT/raw/STAGE/ and its log OUT/logs/STAGE.log and writes OUT/STAGE.json:
{"stage", "ok", "seconds", "rc", "limit_s", "smoke", "key" (the numbers worth a glance), "error" when not ok,
and the stage's own fields (bench and QLoRA rows, the plan's words, losses)}. `summary` prints the table (stage,
ok, seconds, key numbers) and writes OUT/summary.txt and OUT/summary.json; with --bring it also leaves two files
in DIR (campaign-callN.tar.gz of OUT without work/, and summary-callN.txt): what the device tool brings back
from $OUT (8 files at most, 16 MiB each). Only the standard library here (`machine` imports torch): each call
costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TAR_LIMIT = 15 * 2**20  # under the device tool's 16 MiB per file
FILE_LIMIT = 8 * 2**20  # a file larger than this (a trace, a memory snapshot) stays out of the tar, listed
SMOKE_NOTE = "SMOKE: CPU, tiny sizes, CPU stand-ins where a kernel needs CUDA; these are not measurements"


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


# ---- the verbs --------------------------------------------------------------------------------------------
def write_stage(out: Path, record: dict) -> None:
    path = out / f"{record['stage']}.json"
    path.write_text(json.dumps(record, indent=1, default=str))


def cmd_finish(a: argparse.Namespace) -> None:
    out = Path(a.out)
    log_path = out / "logs" / f"{a.stage}.log"
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    broken = f"{a.stage}=" in a.broken
    fn = collect_broken if broken else collector(a.stage)
    try:
        ok, key, fields = fn(a.stage, out / "raw" / a.stage, log, a.rc, a.smoke)
    except Exception as e:  # a collector that trips on odd output must not lose the stage's record
        ok, key, fields = False, f"could not read the stage's outputs: {type(e).__name__}: {e}", {}
    timed_out = a.rc in (124, 137)
    record = {
        "stage": a.stage,
        "ok": ok and not timed_out,
        "seconds": round(a.seconds, 1),
        "rc": a.rc,
        "limit_s": a.limit,
        "smoke": a.smoke,
        "key": key,
        "log": f"logs/{a.stage}.log",
    }
    if timed_out:
        record["error"] = f"timed out after {a.limit} s"
    elif not record["ok"]:
        record["error"] = f"exit code {a.rc}: {last_error_line(log)}" if a.rc else "checks failed"
    write_stage(out, {**record, **fields})
    word = "ok" if record["ok"] else "FAILED"
    print(f"== stage {a.stage}: {word} in {a.seconds:.0f} s | {record.get('error') or key}", flush=True)


def cmd_skip(a: argparse.Namespace) -> None:
    record = {"stage": a.stage, "ok": False, "seconds": 0.0, "rc": None, "smoke": a.smoke, "key": "skipped"}
    write_stage(Path(a.out), {**record, "error": a.reason})
    print(f"== stage {a.stage}: SKIPPED | {a.reason}", flush=True)


def cmd_machine(a: argparse.Namespace) -> None:
    """What ran where: GPU, driver, torch and the carried packages, the commit (hopperlm/provenance.py: the
    stamp scripts/gpu_carry.sh --stamp wrote, where this tree matches it)."""
    import importlib.metadata
    import platform

    import torch

    out = Path(a.out)
    versions = {}
    for package in (
        "torch",
        "transformers",
        "torchao",
        "bitsandbytes",
        "peft",
        "accelerate",
        "triton",
        "liger-kernel",
    ):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    smi = None
    if gpu:
        query = "--query-gpu=name,memory.total,driver_version,clocks.max.sm"
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        smi = done.stdout.strip() or None
    from hopperlm.provenance import commit_of_this_tree

    stamp = commit_of_this_tree()  # gpu-carry/stamp.json where it matches this tree (git here may be stale)
    commit = (
        f"{stamp['commit']}{' + uncommitted changes' if stamp['dirty'] else ''} ({stamp['commit_source']})"
    )
    record = {
        "smoke": a.smoke,
        "call": a.call,
        "command": a.command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": gpu or "none (CPU)",
        "nvidia_smi": smi,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit,
        "commit_id": stamp["commit"],
        "dirty": stamp["dirty"],
        "versions": versions,
    }
    (out / "machine.json").write_text(json.dumps(record, indent=1))
    print(f"== machine: {record['gpu']}; torch {versions['torch']} (CUDA {torch.version.cuda}); {commit}")
    print(
        f"   {smi or ''} python {record['python']}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    )


def summary_lines(out: Path, stages: list[dict], machine: dict) -> list[str]:
    head = f"== GPU campaign, call {machine.get('call', '?')}: {machine.get('gpu', '?')}, "
    head += f"torch {machine.get('versions', {}).get('torch')}, commit {machine.get('commit')}, {machine.get('date')}"
    lines = [head, f"command: {machine.get('command')}"]
    if machine.get("smoke"):
        lines.append(SMOKE_NOTE)
    lines.append(f"{'stage':<22}{'ok':<5}{'seconds':>8}  key numbers")
    for s in stages:
        text = s.get("key", "")
        if not s["ok"]:
            text = s.get("error", "failed") + (f" | {text}" if text not in ("", "skipped") else "")
        lines.append(f"{s['stage']:<22}{'yes' if s['ok'] else 'NO':<5}{s.get('seconds', 0):>8.1f}  {text}")
    failed = [s["stage"] for s in stages if not s["ok"]]
    lines.append(
        f"{len(stages) - len(failed)} of {len(stages)} stages ok"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return lines


def pack(out: Path, tar_path: Path) -> list[str]:
    """Everything under OUT but work/ (prepared data), checkpoints/ and profiler traces (hundreds of MB: the
    top-kernels table is what comes back), big files listed instead of packed."""
    left_out = []
    files = sorted(
        p
        for p in out.rglob("*")
        if p.is_file()
        and p.relative_to(out).parts[0] != "work"
        and "checkpoints" not in p.relative_to(out).parts
        and not p.name.endswith(".trace.json")
    )
    keep = []
    for p in files:
        if p.stat().st_size > FILE_LIMIT:
            left_out.append(f"{p.relative_to(out)} ({p.stat().st_size / 2**20:.1f} MiB)")
        else:
            keep.append(p)
    for _ in range(2):
        with tarfile.open(tar_path, "w:gz") as tar:
            for p in keep:
                tar.add(p, arcname=str(p.relative_to(out)))
        if tar_path.stat().st_size <= TAR_LIMIT:
            break
        # still too large: keep the records (json, txt, logs' tails) and drop the traces
        dropped = [p for p in keep if "trace" in p.name or p.suffix in (".pickle", ".gz")]
        left_out += [
            f"{p.relative_to(out)} ({p.stat().st_size / 2**20:.1f} MiB, the tar was too large)"
            for p in dropped
        ]
        keep = [p for p in keep if p not in dropped]
    return left_out


def cmd_summary(a: argparse.Namespace) -> None:
    out = Path(a.out)
    order = a.stages.split(",") if a.stages else []
    stages = [read_json(out / f"{name}.json") for name in order]
    stages = [s for s in stages if s]
    machine = read_json(out / "machine.json") or {}
    lines = summary_lines(out, stages, machine)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(
        json.dumps({"machine": machine, "stages": stages}, indent=1, default=str)
    )
    if a.bring:
        bring = Path(a.bring)
        bring.mkdir(parents=True, exist_ok=True)
        name = f"call{a.call}" + ("-smoke" if machine.get("smoke") else "")
        left_out = pack(out, bring / f"campaign-{name}.tar.gz")
        extra = [f"not in the tar (too large): {', '.join(left_out)}"] if left_out else []
        (bring / f"summary-{name}.txt").write_text("\n".join(lines + extra) + "\n")
    if a.print:
        print("\n" + "\n".join(lines), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)
    f = verbs.add_parser("finish")
    f.add_argument("stage")
    f.add_argument("out")
    f.add_argument("--rc", type=int, required=True)
    f.add_argument("--seconds", type=float, required=True)
    f.add_argument("--limit", type=int, required=True)
    f.add_argument("--smoke", action="store_true")
    f.add_argument("--broken", default="", help="CAMPAIGN_BREAK's value")
    s = verbs.add_parser("skip")
    s.add_argument("stage")
    s.add_argument("out")
    s.add_argument("--reason", required=True)
    s.add_argument("--smoke", action="store_true")
    m = verbs.add_parser("machine")
    m.add_argument("out")
    m.add_argument("--smoke", action="store_true")
    m.add_argument("--call", default="all")
    m.add_argument("--command", default="")
    u = verbs.add_parser("summary")
    u.add_argument("out")
    u.add_argument("--stages", default="", help="the stages in campaign order, comma-separated")
    u.add_argument("--bring", default="")
    u.add_argument("--call", default="all")
    u.add_argument("--print", action="store_true")
    a = p.parse_args()
    {"finish": cmd_finish, "skip": cmd_skip, "machine": cmd_machine, "summary": cmd_summary}[a.verb](a)


if __name__ == "__main__":
    sys.exit(main())
