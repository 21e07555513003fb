"""Data parallelism, as the plan chooses it: the world's shape, the strategy over its ranks (none, DDP, FSDP2,
HSDP) with its reason, what that does to a LoRA model, and the two collective limits the ranks will keep.
parallel/ applies the choice (parallelize.py) and keeps the limits (watchdog.py); the choice is made here, so
the plan does not depend on the package that carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from hopperlm.config import Config, LoRAConfig, ModelConfig
from hopperlm.config.run import STEP_LIMIT_FACTOR, STEP_LIMIT_FLOOR_S
from hopperlm.errors import ConfigError
from hopperlm.memory import estimate_memory
from hopperlm.model.lora import count_trainable
from hopperlm.plan.record import OptimizerName, Precision, Strategy

SHARDED = ("fsdp", "hsdp")


@dataclass(frozen=True)
class World:
    """The shape of a run, as the plan sees it: how many ranks, and how many of them share a node."""

    size: int = 1
    local_size: int = 1

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.local_size))


def lora_parallel_note(
    lc: LoRAConfig, model_cfg: ModelConfig, strategy: Strategy, precision: Precision
) -> str:
    """What DDP or FSDP2 does with a LoRA model, for the plan's parallel line ("" when not LoRA on ranks)."""
    if not lc.enabled or strategy == "none":
        return ""
    if strategy == "ddp":
        trainable = count_trainable(model_cfg, lc)
        return f"; LoRA: only the adapters' gradients ({4 * trainable / 1e6:,.0f} MB fp32) cross ranks"
    compute = "fp32" if precision == "fp32" else precision
    nf4_rule = ""
    if lc.quantize == "nf4":
        nf4_rule = f"the NF4 data stored as {compute} (FSDP2's parameter dtype: gathered without a cast), "
    return (
        f"; LoRA: {nf4_rule}base and adapters sharded, gathered in {compute} per block; fp32 adapter shards for "
        "the optimizer; checkpoints hold the adapters only"
    )


def choose_strategy(
    cfg: Config,
    model_cfg: ModelConfig,
    hw,
    world: World,
    *,
    precision: Precision,
    fused_loss: bool,
    optimizer: OptimizerName,
    budget: float,
) -> tuple[Strategy, int, str]:
    """(strategy, dp_shard, reason): the data parallelism over the world's ranks and the ranks one copy of the
    state is spread over. `budget` is the memory one device may fill."""
    want, n = cfg.parallel.strategy, world.size
    if want == "none" and n > 1:
        raise ConfigError(
            f"parallel.strategy=none with {n} ranks: each would train its own copy; use auto, ddp, fsdp or "
            "hsdp, or launch one process"
        )
    if want == "auto" and n == 1:
        return "none", 1, "none (one process; under torchrun auto picks DDP or FSDP)"
    muon = cfg.optim.name == "muon"
    if muon and want in SHARDED:
        raise ConfigError(
            "optim.name=muon orthogonalises whole matrices and cannot run on FSDP's shards; "
            "use parallel.strategy ddp or optim.name adamw"
        )
    if optimizer == "paged_adamw8bit" and want in SHARDED:
        raise ConfigError(
            "optim.name=paged_adamw8bit (bitsandbytes) steps plain tensors, not FSDP2's sharded DTensor "
            "parameters; use parallel.strategy ddp or optim.name adamw8bit (torchao's, which steps shards)"
        )
    where = "GPU" if hw.device_type == "cuda" else "process"
    if want == "auto":
        full = estimate_memory(
            model_cfg,
            cfg.train.seq_len,
            precision,
            checkpointing="full",
            fused_loss=fused_loss,
            optimizer=optimizer,
            lora=cfg.lora,
        )
        state = f"weights + grads + {optimizer} state ({full.static / 1e9:.1f} GB)"
        if cfg.lora.enabled:
            base = "NF4" if cfg.lora.quantize == "nf4" else "frozen"
            state = (
                f"the {base} base + adapters, their grads and {optimizer} state ({full.static / 1e9:.1f} GB)"
            )
        if full.largest_micro_batch(budget) >= 1:
            return (
                "ddp",
                1,
                (
                    f"ddp over {n} ranks: {state} and a sequence fit one {where} ({budget / 1e9:.1f} GB); "
                    "a replica per rank, gradients all-reduced once per step"
                ),
            )
        if muon or optimizer == "paged_adamw8bit":
            raise ConfigError(
                f"{state} exceed one {where} ({budget / 1e9:.1f} GB), so this run needs FSDP, which "
                f"optim.name={optimizer} cannot run on; use optim.name {'adamw8bit' if not muon else 'adamw'}"
            )
        return (
            "fsdp",
            n,
            (
                f"fsdp over {n} ranks: {state} exceed one {where} ({budget / 1e9:.1f} GB); sharded, "
                f"{full.static / n / 1e9:.1f} GB per rank"
            ),
        )
    if want == "fsdp":
        return "fsdp", n, f"fsdp over {n} rank(s) (set by parallel.strategy)"
    if want == "hsdp":
        shard = cfg.parallel.shard_size or world.local_size
        if n % shard:
            raise ConfigError(
                f"parallel.shard_size={shard} does not divide the {n} ranks; use a divisor of {n} "
                "(e.g. the GPUs of one node)"
            )
        return (
            "hsdp",
            shard,
            f"hsdp (set by parallel.strategy): sharded over {shard} rank(s), {n // shard} replica(s)",
        )
    return want, 1, f"{want} over {n} rank(s) (set by parallel.strategy)"


def describe_limits(startup_s: float, step_s: float | None) -> str:
    """The plan's line on the two limits."""
    steps = (
        f"{step_s:g} s (parallel.step_timeout_s)"
        if step_s is not None
        else f"max({STEP_LIMIT_FLOOR_S:.0f} s, {STEP_LIMIT_FACTOR:.0f}x the slowest step), set at the first log step"
    )
    return (
        f"a collective waits up to {startup_s:g} s through start-up, evaluation and checkpoints "
        f"(parallel.startup_timeout_s), then per step {steps}; a frozen rank is named and killed by "
        "`hopperlm launch` within that limit"
    )
