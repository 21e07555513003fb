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
costs a fraction of a second. The collectors, one per kind of stage, are in campaign_collect.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from campaign_collect import collect_broken, collector, last_error_line, read_json

TAR_LIMIT = 15 * 2**20  # under the device tool's 16 MiB per file
FILE_LIMIT = 8 * 2**20  # a file larger than this (a trace, a memory snapshot) stays out of the tar, listed
SMOKE_NOTE = "SMOKE: CPU, tiny sizes, CPU stand-ins where a kernel needs CUDA; these are not measurements"


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
