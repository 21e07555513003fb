"""The rows of bench/gpu/qlora.py (it times them and writes the table): the shared random base checkpoint, and
each row's training step, built the way each tool runs one: hopperlm's through `hopperlm train`'s own
`build_step`/`train_step` (its CPU stand-in for the QLoRA rows, and the compile experiments), transformers +
peft + bitsandbytes as their users set them up. The tokens and the next-token batch are the same for both."""

from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path

import torch

from hopperlm.model.loss import IGNORE_INDEX

# the llama2-7b preset (meta-llama/Llama-2-7b-hf's shape); --tiny: 2 narrow blocks of it (widths multiples of
# 64: bitsandbytes' CPU layout) and a small vocabulary
TINY = {"dim": 256, "n_layers": 2, "n_heads": 4, "ffn_dim": 704, "vocab_size": 2048}
CPU_STAND_IN = (
    "CPU stand-in: NF4 base on bitsandbytes' CPU backend; plan made for lora.quantize none with AdamW "
    "(the plan refuses QLoRA on a CPU)"
)
CPU_STAND_IN_HF = "CPU stand-in: NF4 base and paged 8-bit AdamW on bitsandbytes' CPU backend"
# one change each to hopperlm-qlora-compile (the module docstring says what each tests)
EXPERIMENTS = {
    "hopperlm-qlora-compile-eager-ac": "experiment: each block's body compiled, its checkpoint in eager",
    "hopperlm-qlora-compile-eager-loss": "experiment: blocks compiled, final norm + LM head + loss in eager",
    "hopperlm-qlora-compile-budget": "experiment: activation_memory_budget 0.5",
}
RANK, ALPHA = 16, 32


def make_base(folder: Path, tiny: bool, device: str) -> None:
    """A random bf16 checkpoint, initialised on the device (seconds for 7B on a GPU) and saved once."""
    import dataclasses

    import transformers

    from hopperlm.config.presets import get_preset
    from hopperlm.interop.hf import hf_config_dict

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


def next_token_batch(tokens: torch.Tensor):
    """hopperlm's batch for the input tokens (B, T): y[:, i] = tokens[:, i + 1], the next token, and the last
    position IGNORE_INDEX, so the loss covers the same T-1 targets as transformers' labels=input_ids (which
    shifts inside and has no target for the last position)."""
    from hopperlm.data.loader import Batch

    y = torch.full_like(tokens, IGNORE_INDEX)
    y[:, :-1] = tokens[:, 1:]
    return Batch(tokens, y)


def hopperlm_step(
    base: Path,
    *,
    quantize: str,
    seq: int,
    device: str,
    log,
    compile: bool | None = None,
    experiment: str = "",
):
    import dataclasses

    from hopperlm.config import config_from_dict
    from hopperlm.hardware import detect_for
    from hopperlm.interop.init_from import resolve_init_from
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
                },
                "schedule": {"warmup_steps": 0},
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
    traced = trace_only() if stand_in and plan.compile else contextlib.nullcontext()
    with traced, compile_experiment(experiment):
        parts, _ = build_step(model, plan, cfg.optim, log=log)

    def step(tokens):
        batch = next_token_batch(tokens)
        return train_step(parts, lambda micro: batch, grad_accum=1, lr=cfg.optim.lr).loss

    notes = [f"compile {'on' if plan.compile else 'off'}", f"fused loss {plan.fused_loss}", plan.optimizer]
    if experiment:
        notes.append(EXPERIMENTS[experiment])
    if stand_in:
        notes.append(CPU_STAND_IN + ("; compiled by dynamo's aot_eager backend" if plan.compile else ""))
    return step, notes


@contextlib.contextmanager
def compile_experiment(case: str):
    """While the step is built: hopperlm.speed's apply_compile replaced by the experiment's own compile (the
    eager-ac and eager-loss cases; any other case builds as training does); an error if apply_speedups no
    longer calls it, so that an experiment never silently measures the unchanged compile."""
    import hopperlm.speed as speed

    if case not in ("hopperlm-qlora-compile-eager-ac", "hopperlm-qlora-compile-eager-loss"):
        yield  # the budget case's compile is unchanged: experiment_config sets the budget for its steps
        return
    called = []

    def apply_compile(model, mode, scope):
        called.append(scope)
        mode = None if mode in (None, "default") else mode
        for block in model.layers:
            if case == "hopperlm-qlora-compile-eager-ac":
                # Block.forward runs in eager and calls block.recompute(block._forward, ...): the checkpoint
                # is torch's eager one, and what it recomputes is the compiled body
                block._forward = torch.compile(block._forward, mode=mode)
            else:
                block.compile(mode=mode)
        if case == "hopperlm-qlora-compile-eager-ac":
            model.output_loss = torch.compile(model.output_loss, mode=mode)

    real, speed.apply_compile = speed.apply_compile, apply_compile
    try:
        yield
    finally:
        speed.apply_compile = real
    if not called:
        raise RuntimeError(f"{case}: apply_speedups did not call hopperlm.speed.apply_compile; fix the hook")


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

    def step(tokens):  # the loss on tokens[:, 1:] from logits[:, :-1] (transformers shifts the labels)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    notes = ["gradient checkpointing", "sdpa", "PagedAdamW8bit" if quantize == "nf4" else "AdamW"]
    if quantize == "nf4" and device == "cpu":
        notes.append(CPU_STAND_IN_HF)
    return step, notes


def random_tokens(vocab: int, seq: int) -> torch.Tensor:
    """(1, seq) random token ids: one draw (seed 0), the same in every row."""
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def experiment_config(case: str):
    """The budget case's partitioner setting, for the row's steps (compile happens at the first one)."""
    if case != "hopperlm-qlora-compile-budget":
        yield
        return
    import torch._functorch.config

    with torch._functorch.config.patch(activation_memory_budget=0.5):
        yield
