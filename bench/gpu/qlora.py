"""QLoRA / LoRA on a Llama-2-7B-shaped model: hopperlm beside transformers + peft + bitsandbytes, side by side.

    python3 bench/gpu/qlora.py --out /tmp/out/qlora.json          # on a GPU: the QLoRA/LoRA targets
    python3 bench/gpu/qlora.py --smoke --out /tmp/qlora-smoke.json   # every row's code path, tiny, on a CPU

One random checkpoint (bf16 safetensors, written once with transformers' save_pretrained) is the base of every
row, loaded the way each tool loads a Hub checkpoint:
  hopperlm-qlora  model.init_from + lora.quantize nf4 (double quantisation, bf16 compute), paged 8-bit AdamW,
                  full activation checkpointing, the rest as the plan chooses
  hf-qlora        from_pretrained(BitsAndBytesConfig nf4, double quant, bf16 compute) +
                  prepare_model_for_kbit_training (gradient checkpointing) + get_peft_model, PagedAdamW8bit
  hopperlm-lora   the same adapters on a bf16 base, full activation checkpointing, compile per the plan
  hopperlm-qlora-compile  hopperlm-qlora with train.compile true (the plan leaves compile off for QLoRA:
                  is it traced, and is it faster?)
  hf-lora         from_pretrained(bf16) + gradient checkpointing + get_peft_model, torch AdamW (fused)
Adapters: rank 16, alpha 32, all seven projections, no dropout; seq 2048, micro-batch 1, random tokens.
Each row runs in its own process (clean peak memory and compile caches; --row-timeout each): warm-up steps,
then timed steps, synchronised; peak = torch.cuda.max_memory_allocated over loading and training. The JSON is
rewritten after every row, so a run cut short keeps the rows it finished. Targets: QLoRA peak <= 10 GB
(HF + bitsandbytes ~9 GB, unsloth ~7 GB: LLaMA-Factory's benchmarks); LoRA tokens/s >= 1.5x hf-lora.

--smoke (= --tiny --device cpu, a few tokens, one timed step): a test of this script, not a measurement (CI
runs it: tests/test_gpu_campaign.py). hopperlm's plan refuses QLoRA on a CPU, so there the hopperlm-qlora row
is a CPU stand-in: the plan is made for lora.quantize none with AdamW, the model is still built by
`build_train_model` with its NF4 base (bitsandbytes' CPU backend runs NF4 layers forward and backward), and the
row says so in `stand_in`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hopperlm.files import write_atomic  # noqa: E402

# the llama2-7b preset (meta-llama/Llama-2-7b-hf's shape); --tiny: 2 narrow blocks of it (widths multiples of
# 64: bitsandbytes' CPU layout) and a small vocabulary
TINY = {"dim": 256, "n_layers": 2, "n_heads": 4, "ffn_dim": 704, "vocab_size": 2048}
CPU_STAND_IN = (
    "CPU stand-in: NF4 base on bitsandbytes' CPU backend; plan made for lora.quantize none with AdamW "
    "(the plan refuses QLoRA on a CPU)"
)
CPU_STAND_IN_HF = "CPU stand-in: NF4 base and paged 8-bit AdamW on bitsandbytes' CPU backend"
CASES = ("hopperlm-qlora", "hf-qlora", "hopperlm-lora", "hf-lora", "hopperlm-qlora-compile")
RANK, ALPHA = 16, 32


def make_base(folder: Path, tiny: bool, device: str) -> None:
    """A random bf16 checkpoint, initialised on the device (seconds for 7B on a GPU) and saved once."""
    import dataclasses

    import transformers

    from hopperlm.checkpoint.hf import hf_config_dict
    from hopperlm.config.presets import get_preset

    if (folder / "config.json").is_file():
        return  # written whole by an earlier call on this machine (the rename below makes it all or nothing)
    shape = dataclasses.replace(get_preset("llama2-7b"), **(TINY if tiny else {}))
    config = transformers.LlamaConfig(
        **hf_config_dict(shape, "bfloat16", {"bos_token_id": 1, "eos_token_id": 2})
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")  # a call cut off while saving leaves no base behind
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    del model
    # give the 13.5 GB back: the rows run in child processes while this one waits, and a plan made beside a
    # cache held here saw less free memory (2026-11-27: call A's QLoRA row chose the fused loss, call D's not)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    partial.rename(folder)


def hopperlm_step(base: Path, quantize: str, seq: int, device: str, log, compile: bool | None = None):
    import dataclasses

    from hopperlm.checkpoint.init_from import resolve_init_from
    from hopperlm.config import config_from_dict
    from hopperlm.data.loader import Batch
    from hopperlm.hardware import detect_for
    from hopperlm.plan import make_plan
    from hopperlm.train.initial_model import build_train_model
    from hopperlm.train.step import build_step, train_step

    stand_in = quantize == "nf4" and device == "cpu"
    cfg = resolve_init_from(
        config_from_dict(
            {
                "model": {"init_from": str(base), "max_seq_len": seq},
                "lora": {"rank": RANK, "alpha": ALPHA, "targets": "all-linear", "quantize": quantize},
                "optim": {
                    "name": "paged_adamw8bit" if quantize == "nf4" and not stand_in else "adamw",
                    "lr": 1e-4,
                    "warmup_steps": 0,
                },
                "train": {
                    "seq_len": seq,
                    "micro_batch": 1,
                    "max_steps": 1000,
                    "device": device,
                    "activation_checkpointing": "full",
                    "compile": compile,  # None: as the plan chooses
                },
            }
        )
    )
    hw = detect_for(device)
    plan_cfg = cfg
    if stand_in:  # the plan's refusal of QLoRA on a CPU is bypassed here only; the model below is still NF4
        plan_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize="none"))
    plan = make_plan(plan_cfg, cfg.model, hw)
    plan.apply_runtime_settings(log)
    for line in plan.lines():
        log(f"  plan {line}")
    model, _ = build_train_model(
        cfg,
        cfg.model,
        device=hw.device,
        compute_dtype=plan.autocast_dtype,
        data_tokenizer=None,  # random tokens: no data tokenizer to check against the checkpoint's
        load=True,
        log=log,
    )
    # `hopperlm train`'s step: clip, finite check (and the compile, when the plan turns it on)
    with trace_only() if stand_in and plan.compile else contextlib.nullcontext():
        parts, _ = build_step(model, plan, cfg.optim, log=log)

    def step(x):
        batch = Batch(x, x)
        return train_step(parts, lambda micro: batch, grad_accum=1, lr=cfg.optim.lr).loss

    notes = [f"compile {'on' if plan.compile else 'off'}", f"fused loss {plan.fused_loss}", plan.optimizer]
    if stand_in:
        notes.append(CPU_STAND_IN + ("; compiled by dynamo's aot_eager backend" if plan.compile else ""))
    return step, notes


@contextlib.contextmanager
def trace_only():
    """torch.compile with dynamo's aot_eager backend while the step is built: the CPU stand-in of the compiled
    QLoRA row traces forward and backward through the NF4 and LoRA layers as on the GPU, without inductor's
    C++ build of every kernel (45 s cold on a 2-core machine; it tells nothing about the GPU's kernels)."""
    real = torch.compile
    torch.compile = functools.partial(real, backend="aot_eager")
    try:
        yield
    finally:
        torch.compile = real


def hf_step(base: Path, quantize: str, device: str):
    import peft
    import transformers

    kwargs = {"dtype": torch.bfloat16, "attn_implementation": "sdpa", "device_map": {"": device}}
    if quantize == "nf4":
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if quantize == "nf4":
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    if quantize == "nf4":
        import bitsandbytes as bnb

        opt = bnb.optim.PagedAdamW8bit(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device != "cpu")
    model.train()

    def step(x):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    notes = ["gradient checkpointing", "sdpa", "PagedAdamW8bit" if quantize == "nf4" else "AdamW"]
    if quantize == "nf4" and device == "cpu":
        notes.append(CPU_STAND_IN_HF)
    return step, notes


def run_case(case: str, base: Path, seq: int, device: str, warmup: int, steps: int) -> dict:
    """One row, in this process."""
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    cuda = device != "cpu"
    quantize = "nf4" if "qlora" in case else "none"
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if case.startswith("hopperlm"):
        compile = True if case.endswith("-compile") else None
        step, notes = hopperlm_step(base, quantize, seq, device, log, compile)
    else:
        step, notes = hf_step(base, quantize, device)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, seq), generator=g).to(device)
    losses = [step(x) for _ in range(warmup)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step(x))
    sync()
    seconds = (time.perf_counter() - t0) / steps
    row = {
        "case": case,
        "device": device,
        "tokens_per_s": seq / seconds,
        "step_ms": 1000 * seconds,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "load_s": load_s,
        "loss_first_last": [float(losses[0]), float(losses[-1])],
        "notes": notes,
    }
    stand_in = [n for n in notes if n.startswith("CPU stand-in")]
    if stand_in:
        row["stand_in"] = stand_in[0]
    return row


def run_rows(cases: list[str], args: argparse.Namespace) -> list[dict]:
    """Rows in a process of their own (one each on a GPU; --smoke: all in one, to pay the imports once), one
    JSON line per row; an error or a time-out becomes the `error` of each row it left unfinished."""
    cmd = [sys.executable, __file__, "--case", ",".join(cases), "--base", args.base, "--device", args.device]
    cmd += ["--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += ["--tiny"] if args.tiny else []
    limit = args.row_timeout * len(cases)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        stdout, error = done.stdout, None
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    except subprocess.TimeoutExpired as e:
        stdout, error = e.stdout or "", f"timed out after {limit:g} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"case"')]
    return rows + [{"case": case, "error": error or "no result"} for case in cases[len(rows) :]]


def table(rows: list[dict]) -> list[str]:
    by = {r["case"]: r for r in rows}
    lines = [f"{'case':<24}{'tokens/s':>10}{'step ms':>10}{'peak GB':>9}  ratio / notes"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<24}  error: {r['error']}")
            continue
        other = by.get(r["case"].replace("hopperlm", "hf").removesuffix("-compile"))
        ratio = ""
        if r["case"].startswith("hopperlm") and other and "tokens_per_s" in other:
            ratio = f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x tokens/s vs {other['case']}"
        peak = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "n/a"
        lines.append(
            f"{r['case']:<24}{r['tokens_per_s']:>10.0f}{r['step_ms']:>10.1f}{peak:>9}  {ratio} {', '.join(r['notes'])}"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 narrow blocks instead of the 7B shape")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a CPU test of this script: --tiny --device cpu, 32 tokens, 1 warm-up and 1 timed step",
    )
    p.add_argument("--row-timeout", type=float, default=600, help="seconds per row")
    p.add_argument("--base", default="/tmp/llama2-7b-random", help="where the random checkpoint is written")
    p.add_argument("--out", help="write the rows as JSON here (after every row)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one row in this process
    args = p.parse_args()
    if args.smoke:
        args.tiny, args.device, args.seq_len, args.warmup, args.steps = True, "cpu", 32, 1, 1
    base = Path(args.base + ("-tiny" if args.tiny else ""))
    if args.case:
        for case in args.case.split(","):  # a row that fails is reported, and the next one runs
            try:
                row = run_case(case, base, args.seq_len, args.device, args.warmup, args.steps)
            except Exception as e:
                print(f"{case}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                kind = (
                    type(e).__name__
                    if type(e).__module__ == "builtins"
                    else f"{type(e).__module__}.{type(e).__name__}"
                )
                row = {"case": case, "error": f"{kind}: {e}"[:300]}
            print(json.dumps(row), flush=True)
        return
    make_base(base, args.tiny, args.device)
    record = {
        "seq_len": args.seq_len,
        "tiny": args.tiny,
        "smoke": args.smoke,
        "device": args.device,
        "cases": args.cases.split(","),  # what was asked for: the campaign's collector checks exactly these
        "rows": [],
    }
    cases = record["cases"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"qlora.py: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    for group in [cases] if args.smoke else [[case] for case in cases]:
        for row in run_rows(group, args):
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
        if args.out:
            write_atomic(args.out, json.dumps(record, indent=1))
    print("\n" + ("SMOKE (CPU, tiny model): not a measurement\n" if args.device == "cpu" else ""))
    print("\n".join(table(record["rows"])))


if __name__ == "__main__":
    main()
