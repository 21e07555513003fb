"""The start-up report: the plan, the model, the batch, the budget, and the preflight estimates that the
first log step then checks against what was measured."""

from __future__ import annotations

import math

import torch

from hopperlm.model.completep import describe as describe_depth
from hopperlm.model.mup import describe as describe_parametrization
from hopperlm.model.transformer import count_params
from hopperlm.observe.metrics import human_count, human_hours
from hopperlm.plan import Plan


def predicted_tokens_per_s(plan: Plan, flops_per_token: int) -> tuple[float, float]:
    """(tokens/s if every FLOP ran at the matmul rate measured here and now, that rate in FLOP/s): an upper
    bound from this machine rather than from a datasheet."""
    from hopperlm.selftest import matmul_check

    n = 4096 if plan.device.type == "cuda" else 512
    with torch.random.fork_rng(devices=[plan.device] if plan.device.type == "cuda" else []):
        # random inputs must not move the training RNG: a resumed run has to draw the same dropout masks
        rate = matmul_check(plan.device, plan.autocast_dtype or torch.float32, n=n)["tflops"] * 1e12
    return rate / flops_per_token, rate


def print_banner(
    log, *, run_dir, resume_from, step, hw, plan: Plan, model_cfg, tc, manifest, fpt, predicted, data=None
) -> None:
    counts = count_params(model_cfg)
    planned = []
    if tc.max_steps:
        planned.append(f"{tc.max_steps:,} steps = {human_count(tc.max_steps * plan.tokens_per_step)} tokens")
    if tc.max_tokens:
        steps = math.ceil(tc.max_tokens / plan.tokens_per_step)
        planned.append(f"{human_count(tc.max_tokens)} tokens = {steps:,} steps")
    if tc.max_hours:
        # (train/clock_budget.py: the final evaluation's time is reserved within it)
        planned.append(
            f"{human_hours(tc.max_hours)} wall clock, the final evaluation included (the LR decays by the end of "
            "training)"
        )
    peak = (
        f"{hw.peak_16bit / 1e12:.0f} TFLOP/s dense 16-bit peak" if hw.peak_16bit else "peak unknown: MFU n/a"
    )
    log(
        f"hopperlm | run {run_dir}" + (f" | resuming from {resume_from} (step {step})" if resume_from else "")
    )
    for line in plan.lines():
        log(line)
    log(
        f"model: {model_cfg.preset or 'custom'} | {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding) | {model_cfg.n_layers} layers, d={model_cfg.dim}, "
        f"{model_cfg.n_heads} heads ({model_cfg.kv_heads} kv) x {model_cfg.head_dim}, "
        f"ffn {model_cfg.hidden_dim}, vocab {model_cfg.vocab_size}, ctx {tc.seq_len}"
    )
    log(describe_parametrization(model_cfg))
    log(describe_depth(model_cfg))
    log(f"FLOPs/token: {fpt / 1e9:.3f} GFLOP (6N + 12*L*d*T) | {peak}")
    ranks = f" x {plan.world_size} ranks" if plan.world_size > 1 else ""
    log(
        f"batch: {plan.micro_batch} x {tc.seq_len} tokens x {plan.grad_accum} accumulation{ranks} = "
        f"{plan.tokens_per_step:,} tokens/step | data: {manifest['tokens']['train']:,} train / "
        f"{manifest['tokens']['val']:,} val tokens ({manifest['tokenizer']['kind']} tokenizer)"
    )
    tok_s, rate = predicted
    log(
        f"preflight: speed at most {human_count(tok_s)} tokens/s{' per rank' if ranks else ''} (matmul measured here at "
        f"{rate / 1e12:.2f} TFLOP/s) | memory {plan.memory.total(plan.micro_batch) / 1e9:.2f} GB estimated"
    )
    log(f"plan: {' or '.join(planned)}" + (f" | target val loss {tc.target_loss}" if tc.target_loss else ""))
    bought = budget_line(
        tc, params=counts["total"], tokens_per_s=tok_s * plan.world_size, speed="the matmul-bound upper bound"
    )
    if bought:
        log(bought + "; the first log step measures the real speed")
    if tc.forecast_from:
        log(proxy_forecast_line(tc, params=counts["total"], tokens_per_step=plan.tokens_per_step))
    if data is not None and data.mixture_forecast:  # `sweep --mixture`'s prediction of both losses
        from hopperlm.observe.mixture_law import banner_line

        tokens = tc.max_tokens or (tc.max_steps * plan.tokens_per_step if tc.max_steps else None)
        log(banner_line(data, params=counts["total"], tokens=tokens))
    warning = long_step_warning(plan, tc, tok_s)
    if warning:
        log(warning)


CHINCHILLA_TOKENS_PER_PARAM = 20  # compute-optimal tokens per parameter (Hoffmann et al. 2022)


def budget_line(tc, *, params: int, tokens_per_s: float, speed: str) -> str | None:
    """What a wall-clock budget buys at a speed: tokens, and tokens per parameter beside the compute-optimal
    ~20. None without train.max_hours or a speed."""
    if not tc.max_hours or tokens_per_s <= 0:
        return None
    tokens = tokens_per_s * tc.max_hours * 3600
    return (
        f"budget: {human_hours(tc.max_hours)} at {human_count(tokens_per_s)} tokens/s ({speed}) buys "
        f"{human_count(tokens)} tokens, {tokens / params:.1f} per parameter "
        f"(compute-optimal is about {CHINCHILLA_TOKENS_PER_PARAM})"
    )


def proxy_forecast_line(tc, *, params: int, tokens_per_step: int, tokens_per_s: float | None = None) -> str:
    """train.forecast_from's forecast, beside the tokens this run's budget buys (its steps or tokens; a
    wall-clock budget at `tokens_per_s`, where known)."""
    from hopperlm.errors import ConfigError
    from hopperlm.observe.width_forecast import load

    try:
        result = load(tc.forecast_from)
    except ConfigError as e:  # a lost forecast file costs the line, never the run (a resume reads it again)
        return f"forecast from proxies: none ({e})"
    tokens = tc.max_tokens or (tc.max_steps * tokens_per_step if tc.max_steps else None)
    if tokens is None and tc.max_hours and tokens_per_s:
        tokens = tc.max_hours * 3600 * tokens_per_s
    line = result.line(tokens)
    if result.target_params != params:
        line += f" (made for {result.target_params:,} parameters; this model has {params:,})"
    return line


LONG_STEP_CPU_S = (
    60.0  # a CPU step longer than this: the recipe is made for a GPU (or the batch is too large)
)
LONG_STEP_BUDGET_SHARE = 0.05  # one step taking more than 5% of a wall-clock budget


def long_step_warning(plan: Plan, tc, tokens_per_s_bound: float) -> str | None:
    """One line before a long wait: the predicted time of one optimizer step (a lower bound: the speed is the
    matmul-bound upper bound) when it is minutes on a CPU or a sizeable share of the wall-clock budget."""
    if tokens_per_s_bound <= 0:
        return None
    step_s = plan.tokens_per_step / plan.world_size / tokens_per_s_bound
    cpu = plan.device.type != "cuda"
    budget_s = tc.max_hours * 3600 if tc.max_hours else None
    if not (cpu and step_s >= LONG_STEP_CPU_S) and not (
        budget_s and step_s > LONG_STEP_BUDGET_SHARE * budget_s
    ):
        return None
    when = f"{step_s / 60:.1f} min" if step_s >= 120 else f"{step_s:.0f} s"
    share = f" ({step_s / budget_s:.0%} of the {human_hours(tc.max_hours)} budget)" if budget_s else ""
    fix = (
        "this recipe is made for a GPU: run it on one, or lower train.batch_tokens / use a smaller model here"
        if cpu
        else "lower train.batch_tokens, or raise train.max_hours"
    )
    return (
        f"warning: one optimizer step will take at least {when}{share}: {plan.tokens_per_step:,} tokens at "
        f"most {human_count(tokens_per_s_bound)} tokens/s here; {fix}"
    )


def print_preflight_check(
    log,
    record: dict,
    plan: Plan,
    *,
    micro_batch: int,
    predicted: float,
    tc=None,
    params: int = 0,
    warm: bool = True,
) -> None:
    """At the first log step after warm-up: the measured numbers beside the preflight estimate (at the
    micro-batch the run uses now: the plan's, or less after an out-of-memory error), and what a wall-clock
    budget buys at the measured speed (`tc`, `params`). `warm` False: the run ended within its first log
    interval, whose speed includes the compile, and the lines say so."""
    per_rank = record.get("tokens_per_s_per_rank", record["tokens_per_s"])  # the prediction is per device
    speed = f"speed {human_count(per_rank)} tokens/s{' per rank' if 'world_size' in record else ''} = "
    speed += f"{per_rank / predicted:.0%} "
    speed += "of the matmul-bound prediction"
    if not warm:
        speed += " (over the first steps: compile and warm-up included)"
    if plan.device.type == "cuda":
        memory = (
            f"memory {record['peak_mem_gb']:.2f} GB measured vs {plan.memory.total(micro_batch) / 1e9:.2f}"
        )
        memory += " GB estimated"
    else:
        memory = f"memory {record['peak_mem_gb']:.2f} GB process peak (the Python runtime included)"
        memory += f" vs {plan.memory.total(micro_batch) / 1e9:.2f} GB estimated for the model"
    log(f"preflight check: {speed} | {memory}")
    bought = tc is not None and budget_line(
        tc,
        params=params,
        tokens_per_s=record["tokens_per_s"],
        speed="measured after warm-up" if warm else "measured over the first steps, compile included",
    )
    if bought:
        log(bought)
