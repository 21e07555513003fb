"""QLoRA / LoRA on a Llama-2-7B-shaped model: hopperlm beside transformers + peft + bitsandbytes, side by side.

    python3 bench/gpu/qlora.py --out /tmp/out/qlora.json          # on a GPU: the QLoRA/LoRA targets
    python3 bench/gpu/qlora.py --smoke --out /tmp/qlora-smoke.json   # every row's code path, tiny, on a CPU

One random checkpoint (bf16 safetensors, written once with transformers' save_pretrained) is the base of every
row, loaded the way each tool loads a Hub checkpoint (each row's step is built in qlora_rows.py):
  hopperlm-qlora  model.init_from + lora.quantize nf4 (double quantisation, bf16 compute), paged 8-bit AdamW,
                  full activation checkpointing, the rest as the plan chooses (compile off for QLoRA)
  hf-qlora        from_pretrained(BitsAndBytesConfig nf4, double quant, bf16 compute) +
                  prepare_model_for_kbit_training (gradient checkpointing) + get_peft_model, PagedAdamW8bit
  hopperlm-lora   the same adapters on a bf16 base, full activation checkpointing, compile per the plan
  hf-lora         from_pretrained(bf16) + gradient checkpointing + get_peft_model, torch AdamW (fused)
  hopperlm-qlora-compile  hopperlm-qlora with train.compile true (per-block compile, the blocks' checkpoint
                  traced inside each compiled block, the final norm + LM head + loss compiled as one region)
Experiments on hopperlm-qlora-compile's extra memory (2026-11-27 H100: 11.27 GB peak against 6.82 GB
uncompiled), each changing one thing, set up here only (the training code is untouched):
  hopperlm-qlora-compile-eager-ac    each block's body (Block._forward) compiled, the full checkpoint around it
                  left in eager: is it the checkpoint traced into the compiled block (the partitioner's and
                  inductor's recompute in one backward graph)?
  hopperlm-qlora-compile-eager-loss  the blocks compiled, the final norm + LM head + loss left in eager: is it
                  the compiled loss region (fp32 logits of 2048 x 32000 and their gradient in one graph)?
  hopperlm-qlora-compile-budget      torch._functorch.config.activation_memory_budget 0.5: is it what the
                  min-cut partitioner keeps for the backward?
Adapters: rank 16, alpha 32, all seven projections, no dropout; seq 2048, micro-batch 1.

The loss, the same on both sides: `seq` random tokens t (one draw, seed 0, for every row) are the input, and the
loss is the mean cross-entropy of the seq-1 next tokens t[1:], each predicted from the tokens before it.
transformers gets input_ids=t, labels=t (it shifts inside: logits[:, :-1] against t[:, 1:]); hopperlm gets
Batch(x=t, y) with y = t shifted left by one, its last position IGNORE_INDEX (`next_token_batch`). At the first
step (same base, same tokens, zero LoRA B) both losses are the random base's, about log(vocab) or a little
above; `loss_first_last` is the first warm-up step's and the last timed step's.

Timing: each row runs in its own process (clean peak memory and compile caches; --row-timeout each), and each
case --repeats times (default 2; all of repeat 1, then all of repeat 2), every repeat a row of its own with a
`repeat` field. --same-process runs a case's repeats one after another in one process instead: the load and
the compile are paid once (30-60 s a row for the 7B shape on an H100) and the second repeat times the warm model
again (`same_process: true`); what lets call F hold three cases twice in its 220 s, at the price of repeats
that share one process's allocator and compiled code. In a row: loading, --warmup untimed steps (compile happens here), then --steps timed steps,
each timed alone between two synchronisations; the row gives the min/median/max step time and tokens/s
(tokens_per_s is the median). Peak memory: peak_mem_gb = torch.cuda.max_memory_allocated over loading and
training (as before), and its parts: peak_load_gb, peak_warmup_gb (each warm-up step) and peak_timed_gb (the
timed steps only: the steady state). The table's ratios against HF use, for each case, the median of its
repeats' medians and the largest of its repeats' peaks (`summary` in the JSON). The JSON is rewritten after
every row, so a run cut short keeps the rows it finished. Targets: QLoRA tokens/s >= 1.5x hf-qlora at a peak
<= 1.1x hf-qlora's; LoRA tokens/s >= 1.5x hf-lora.

--memory-snapshot CASE: the first repeat of CASE records the CUDA allocator's history (Python stacks) over its
warm-up steps and one more untimed step, and keeps a summary in the row (`memory_snapshot`: the peak, the ~25
largest groups of allocations alive at it by stack, the bytes by origin; hopperlm/observe/memory_snapshot.py);
the raw snapshot (hundreds of MB) is dropped unless --keep-snapshot PATH. Its timed steps run after the
recording stops. On a CPU the row says `"memory_snapshot": "CUDA only"`.

--smoke (= --tiny --device cpu, 32 tokens, 1 repeat, 1 warm-up and 2 timed steps; explicit flags win): a test of
this script, not a measurement (CI runs it: tests/test_gpu_campaign.py, tests/test_qlora_bench.py), all rows in
one process. hopperlm's plan refuses QLoRA on a CPU, so there the hopperlm QLoRA rows are CPU stand-ins: the
plan is made for lora.quantize none with AdamW, the model is still built by `build_train_model` with its NF4
base (bitsandbytes' CPU backend runs NF4 layers forward and backward), compiled rows trace with dynamo's
aot_eager backend, and the row says so in `stand_in`.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from qlora_rows import EXPERIMENTS, experiment_config, hf_step, hopperlm_step, make_base, random_tokens

from hopperlm.files import write_atomic

CASES = ("hopperlm-qlora", "hf-qlora", "hopperlm-lora", "hf-lora", "hopperlm-qlora-compile", *EXPERIMENTS)
SMOKE = {"seq_len": 32, "repeats": 1, "warmup": 1, "steps": 2}
FULL = {"seq_len": 2048, "repeats": 2, "warmup": 3, "steps": 10}


def spread(values: list[float]) -> dict[str, float]:
    """min, median and max of a row's per-step numbers."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# --same-process: the case loaded (and compiled) by this process's first repeat: (step, notes, load_s, peak)
LOADED: dict[str, tuple] = {}


def run_case(case: str, base: Path, args: argparse.Namespace, repeat: int = 1) -> dict:
    """One row, in this process; with --same-process a later repeat of the case times the model its first
    repeat loaded and warmed (no warm-up of its own)."""
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    device, seq = args.device, args.seq_len
    cuda = device != "cpu"
    compiled = "-compile" in case
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    gb = lambda: torch.cuda.max_memory_allocated() / 1e9 if cuda else None  # noqa: E731
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm = LOADED.get(case) if args.same_process else None  # --same-process: a later repeat reuses it
    if warm is not None:
        step, notes, load_s, peak_load = warm
    else:
        if compiled and "torch._dynamo" in sys.modules:  # --smoke: rows share a process, not compiled code
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        quantize = "nf4" if "qlora" in case else "none"
        if case.startswith("hopperlm"):
            step, notes = hopperlm_step(
                base,
                quantize=quantize,
                seq=seq,
                device=device,
                log=log,
                compile=True if compiled else None,  # None: as the plan chooses
                experiment=case if case in EXPERIMENTS else "",
            )
        else:
            step, notes = hf_step(base, quantize, device)
        load_s = time.perf_counter() - t0
        peak_load = gb()
        if args.same_process:
            LOADED.clear()  # one model in memory at a time
            LOADED[case] = (step, notes, load_s, peak_load)
    tokens = random_tokens(vocab, seq).to(device)
    losses, seconds, peaks = [], [], []

    def run(timed: bool) -> None:
        if cuda:  # per step: the row's peak is the largest of the steps' and loading's
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        losses.append(step(tokens))
        sync()
        if timed:
            seconds.append(time.perf_counter() - t)
        peaks.append(gb())

    extra = {}
    with experiment_config(case):
        if args.memory_snapshot == case and repeat == 1:
            extra["memory_snapshot"] = (
                snapshot_steps(lambda: run(False), args.warmup + 1, args.keep_snapshot)
                if cuda
                else "CUDA only"
            )
        while len(losses) < (0 if warm is not None else args.warmup):  # a reused model is warm already
            run(False)
        untimed = len(losses)
        for _ in range(args.steps):
            run(True)
    ms = [1000 * s for s in seconds]
    row = {
        "case": case,
        "repeat": repeat,
        "device": device,
        "tokens_per_s": seq / statistics.median(seconds),  # at the median step time
        "tokens_per_s_spread": {
            "min": seq / max(seconds),
            "median": seq / statistics.median(seconds),
            "max": seq / min(seconds),
        },
        "step_ms": statistics.median(ms),
        "step_ms_spread": spread(ms),
        "warmup": untimed,
        "steps": len(seconds),
        "same_process": warm
        is not None,  # timed after an earlier repeat in this process: load, compile shared
        "peak_mem_gb": max([peak_load, *peaks]) if cuda else None,
        "peak_load_gb": peak_load,
        "peak_warmup_gb": peaks[:untimed] if cuda else None,
        "peak_timed_gb": max(peaks[untimed:]) if cuda else None,
        "load_s": load_s,
        "loss_first_last": [float(losses[0]), float(losses[-1])],
        "notes": notes,
        **extra,
    }
    if compiled and "torch._dynamo" in sys.modules:  # a graph break or a recompile shows here
        counters = torch._dynamo.utils.counters
        row["compile"] = {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
    stand_in = [n for n in notes if n.startswith("CPU stand-in")]
    if stand_in:
        row["stand_in"] = stand_in[0]
    return row


def snapshot_steps(run_step, steps: int, keep: str | None) -> dict | str:
    """`steps` untimed steps under the allocator's history recording; the summary of what was alive at their
    peak (the raw snapshot pickled to `keep` when given)."""
    from hopperlm.observe.memory_snapshot import recording, summarize_snapshot, take_snapshot

    t0 = time.perf_counter()
    with recording():
        for _ in range(steps):
            run_step()
        try:
            snap = take_snapshot()
        except (AttributeError, RuntimeError) as e:
            return f"failed: {type(e).__name__}: {e}"[:300]
    if keep:
        with open(keep, "wb") as f:
            pickle.dump(snap, f)
    summary = summarize_snapshot(snap)
    summary.update(
        steps=steps, seconds=time.perf_counter() - t0, max_memory_allocated=torch.cuda.max_memory_allocated()
    )
    return summary


def run_rows(rows: list[tuple[str, int]], args: argparse.Namespace) -> list[dict]:
    """(case, repeat) rows in a process of their own (one each on a GPU; --smoke: all in one, to pay the
    imports once), one JSON line per row; an error or a time-out becomes the `error` of each row it left
    unfinished."""
    cmd = [sys.executable, __file__, "--case", ",".join(f"{c}@{r}" for c, r in rows), "--base", args.base]
    cmd += ["--device", args.device, "--seq-len", str(args.seq_len), "--warmup", str(args.warmup)]
    cmd += ["--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    cmd += ["--same-process"] if args.same_process else []
    if args.memory_snapshot:
        cmd += ["--memory-snapshot", args.memory_snapshot]
    if args.keep_snapshot:
        cmd += ["--keep-snapshot", args.keep_snapshot]
    limit = args.row_timeout * len(rows)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        stdout, error = done.stdout, None
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    except subprocess.TimeoutExpired as e:
        stdout, error = e.stdout or "", f"timed out after {limit:g} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    out = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"case"')]
    return out + [{"case": c, "repeat": r, "error": error or "no result"} for c, r in rows[len(out) :]]


def baseline(case: str) -> str:
    return "hf-qlora" if "qlora" in case else "hf-lora"


def summarize(rows: list[dict]) -> list[dict]:
    """One line per case: the median of its repeats' median tokens/s, the largest of their peaks, and both
    against the HF baseline's (measured in the same call)."""
    cases: dict[str, list[dict]] = {}
    for r in rows:
        cases.setdefault(r["case"], [])
        if "error" not in r:
            cases[r["case"]].append(r)
    out = {}
    for case, done in cases.items():
        out[case] = {"case": case, "repeats": len(done)}
        if done:
            out[case]["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in done)
            if done[0]["peak_mem_gb"] is not None:
                out[case]["peak_mem_gb"] = max(r["peak_mem_gb"] for r in done)
                out[case]["peak_timed_gb"] = max(r["peak_timed_gb"] for r in done)
    for case, line in out.items():
        other = out.get(baseline(case), {})
        if case.startswith("hopperlm") and "tokens_per_s" in line and "tokens_per_s" in other:
            line["vs"] = other["case"]
            line["tokens_ratio"] = line["tokens_per_s"] / other["tokens_per_s"]
            if "peak_mem_gb" in line and "peak_mem_gb" in other:
                line["peak_ratio"] = line["peak_mem_gb"] / other["peak_mem_gb"]
    return list(out.values())


def table(rows: list[dict], summary: list[dict]) -> list[str]:
    gb = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"{'case':<34}{'rep':>4}{'tokens/s median [min-max]':>27}{'step ms':>9}{'peak GB':>9}{'timed GB':>9}"
        f"  {'loss first -> last':<19} notes"
    ]
    for r in rows:
        head = f"{r['case']:<34}{r.get('repeat', 1):>4}"
        if "error" in r:
            lines.append(f"{head}  error: {r['error']}")
            continue
        t = r["tokens_per_s_spread"]
        first, last = r["loss_first_last"]
        lines.append(
            f"{head}{r['tokens_per_s']:>9.0f} [{t['min']:.0f}-{t['max']:.0f}]".ljust(34 + 4 + 27)
            + f"{r['step_ms']:>9.1f}{gb(r['peak_mem_gb']):>9}{gb(r['peak_timed_gb']):>9}"
            + f"  {first:>7.3f} -> {last:<7.3f} {', '.join(r['notes'])}"
        )
    lines += ["", "per case: median of the repeats' median tokens/s, the largest of their peaks; against HF"]
    for s in summary:
        if "tokens_per_s" not in s:
            lines.append(f"{s['case']:<34}  no finished repeat")
            continue
        ratio = ""
        if "vs" in s:
            ratio = f"{s['tokens_ratio']:.2f}x tokens/s vs {s['vs']}"
            ratio += f", {s['peak_ratio']:.2f}x its peak" if "peak_ratio" in s else ""
        peak = (
            f"peak {s['peak_mem_gb']:.2f} GB (timed {s['peak_timed_gb']:.2f})" if "peak_mem_gb" in s else ""
        )
        lines.append(
            f"{s['case']:<34}{s['repeats']:>4}{s['tokens_per_s']:>9.0f} tokens/s  {peak}  {ratio}".rstrip()
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES[:5]), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--seq-len", type=int, help=f"default {FULL['seq_len']}")
    p.add_argument(
        "--repeats", type=int, help=f"runs of each case, each in its own process (default {FULL['repeats']})"
    )
    p.add_argument("--warmup", type=int, help=f"untimed steps first (default {FULL['warmup']})")
    p.add_argument("--steps", type=int, help=f"timed steps (default {FULL['steps']})")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 narrow blocks instead of the 7B shape")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a CPU test of this script: --tiny --device cpu, 32 tokens, 1 repeat, 1 warm-up and 2 timed steps",
    )
    p.add_argument(
        "--memory-snapshot",
        metavar="CASE",
        help="record the allocator over CASE's first repeat's warm-up + 1 step",
    )
    p.add_argument("--keep-snapshot", metavar="PATH", help="pickle the raw snapshot there (large)")
    p.add_argument(
        "--same-process",
        action="store_true",
        help="a case's repeats in one process, one after another (load and compile paid once; the timings "
        "of each repeat, the peak of the first): what fits a short device call",
    )
    p.add_argument("--row-timeout", type=float, default=600, help="seconds per row")
    p.add_argument("--base", default="/tmp/llama2-7b-random", help="where the random checkpoint is written")
    p.add_argument("--out", help="write the rows as JSON here (after every row)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run CASE@REPEAT,... in this process
    args = p.parse_args()
    if args.smoke:
        args.tiny, args.device = True, "cpu"
    for name, value in (SMOKE if args.smoke else FULL).items():  # explicit flags win
        if getattr(args, name) is None:
            setattr(args, name, value)
    base = Path(args.base + ("-tiny" if args.tiny else ""))
    if args.case:
        for token in args.case.split(","):  # a row that fails is reported, and the next one runs
            case, _, repeat = token.partition("@")
            repeat = int(repeat or 1)
            try:
                row = run_case(case, base, args, repeat)
            except Exception as e:
                print(f"{case}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                kind = (
                    type(e).__name__
                    if type(e).__module__ == "builtins"
                    else f"{type(e).__module__}.{type(e).__name__}"
                )
                row = {"case": case, "repeat": repeat, "error": f"{kind}: {e}"[:300]}
            print(json.dumps(row), flush=True)
        return
    cases = args.cases.split(",")
    unknown = [c for c in [*cases, args.memory_snapshot or cases[0]] if c not in CASES]
    if unknown:
        raise SystemExit(f"qlora.py: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.memory_snapshot and args.memory_snapshot not in cases:
        raise SystemExit(f"qlora.py: --memory-snapshot {args.memory_snapshot} is not one of --cases")
    make_base(base, args.tiny, args.device)
    record = {
        "seq_len": args.seq_len,
        "tiny": args.tiny,
        "smoke": args.smoke,
        "device": args.device,
        "cases": cases,  # what was asked for: the campaign's collector checks exactly these
        "repeats": args.repeats,
        "same_process": args.same_process,
        "warmup": args.warmup,
        "steps": args.steps,
        "loss": "mean cross-entropy of tokens[1:] given the tokens before, the same seq random tokens in every row",
        "rows": [],
        "summary": [],
    }
    repeats = range(1, args.repeats + 1)
    if args.same_process:  # each case's repeats together, in a process of their own
        groups = [[(case, r) for r in repeats] for case in cases]
    else:  # repeat 1 of all, then repeat 2: a process per row
        groups = [[(case, r)] for r in repeats for case in cases]
    for group in [[row for g in groups for row in g]] if args.smoke else groups:
        for row in run_rows(group, args):
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
        record["summary"] = summarize(record["rows"])
        if args.out:
            write_atomic(args.out, json.dumps(record, indent=1))
    print("\n" + ("SMOKE (CPU, tiny model): not a measurement\n" if args.device == "cpu" else ""))
    print("\n".join(table(record["rows"], record["summary"])))


if __name__ == "__main__":
    main()
