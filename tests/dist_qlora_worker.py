"""Run by tests/test_dist_finetune.py under torchrun (2 gloo ranks): QLoRA's frozen NF4 base (bitsandbytes' CPU
backend) under hopperlm's own `parallelize` (DDP and FSDP2) and `train_step`, against the same steps in one
process, unsharded. The plan refuses QLoRA on a CPU (bitsandbytes' CPU layer is not a training path), so the
plan here is a CPU plan with the strategy (and, in the bf16 case, the autocast dtype) set by hand.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_qlora_worker.py OUT_JSON

Cases, each 3 optimizer steps on the same global batch (AdamW, and torchao's 8-bit AdamW on FSDP2's shards):
  fp32   NF4 data stored as fp32, no mixed precision: DDP and FSDP2 must give one process's losses, gradient
         norms and adapters (exactly, up to the order of the gradient sums)
  bf16   NF4 data stored as bf16 = FSDP2's param_dtype (the rule that keeps MixedPrecisionPolicy from casting
         4-bit data), adapters computed in bf16: one process's losses within bf16's rounding
Rank 0 writes what it measured to OUT_JSON; the test asserts on it.
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from hopperlm.config import Config, LoRAConfig, ModelConfig, OptimConfig
from hopperlm.data.loader import Batch
from hopperlm.hardware import detect_for
from hopperlm.parallel.runtime import Runtime
from hopperlm.plan import World, make_plan
from hopperlm.train.initial_model import build_lora_model
from hopperlm.train.step import build_step, train_step

CFG = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256, max_seq_len=64)
LORA = LoRAConfig(rank=4, alpha=8, targets="all-linear", quantize="nf4")
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.0)
STEPS, ROWS, T = 3, 4, 32  # ROWS sequences per step, all ranks together


def model(compute: torch.dtype, storage: torch.dtype, lora: LoRAConfig):
    m = build_lora_model(CFG, lora, "cpu", None, "nf4", compute, 0, storage)
    torch.manual_seed(1)  # B nonzero: the adapters change the output from the first step
    for name, p in m.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    return m


def run(
    strategy: str,
    compute: torch.dtype,
    storage: torch.dtype,
    rt: Runtime,
    optim: OptimConfig = OPTIM,
    lora: LoRAConfig = LORA,
) -> dict:
    n = rt.world_size if strategy != "none" else 1
    plan = make_plan(Config(), CFG, detect_for("cpu")).replace(
        strategy=strategy,
        world_size=n,
        dp_shard=n if strategy == "fsdp" else 1,
        autocast_dtype=None if compute == torch.float32 else compute,
        micro_batch=ROWS // n,
        optimizer=optim.name,
    )
    m = model(compute, storage, lora)
    parts, _ = build_step(m, plan, optim, log=lambda line: None, rt=rt)
    rank = rt.rank if strategy != "none" else 0
    data = torch.randint(0, CFG.vocab_size, (STEPS, ROWS, T + 1), generator=torch.Generator().manual_seed(2))
    losses, norms = [], []
    for step in range(STEPS):
        rows = data[step, rank * (ROWS // n) : (rank + 1) * (ROWS // n)]
        batch = Batch(rows[:, :-1], rows[:, 1:])
        result = train_step(parts, lambda i, batch=batch: batch, grad_accum=1, lr=optim.lr)
        loss = result.loss.detach().clone()
        if n > 1:  # the step's loss is the mean over ranks (what the loop logs)
            dist.all_reduce(loss)
            loss /= n
        losses.append(loss.item())
        norms.append(result.grad_norm.item())
    adapters = {}
    for name, p in m.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            adapters[name] = full.float().flatten()[:8].tolist()
    ddp_bytes = None  # what DDP's buckets hold: the adapters' gradients only, nothing of the frozen base
    if strategy == "ddp":
        ddp_bytes = parts.parallel.module._get_ddp_logging_data().get("total_parameter_size_bytes")
    moments = set()  # the kinds of AdamW first moments (torchao's 8-bit ones are OptimState8bit)
    for state in parts.optimizer.state.values():
        if "exp_avg" in state:
            moment = state["exp_avg"]
            moments.add(type(moment.to_local() if hasattr(moment, "to_local") else moment).__name__)
    nf4 = [p for name, p in m.named_parameters() if "proj.base.weight" in name]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in nf4]
    return {
        "losses": losses,
        "norms": norms,
        "adapters": adapters,
        "nf4_dtypes": sorted({str(p.dtype) for p in local}),
        "nf4_sharded": all(hasattr(p, "to_local") for p in nf4),
        "nf4_frozen": not any(p.requires_grad for p in nf4),
        "ddp_bucket_bytes": ddp_bytes,
        "moments": sorted(moments),
        "trainable": sum(p.numel() for p in m.parameters() if p.requires_grad),
    }


def main() -> None:
    dist.init_process_group("gloo")
    rt = Runtime(rank=dist.get_rank(), world=World(size=dist.get_world_size()), log=lambda line: None)
    rt.active, rt.backend = True, "gloo"
    out = {}
    for case, compute, storage in (
        ("fp32", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
    ):
        for strategy in ("none", "ddp", "fsdp"):
            out[f"{case}-{strategy}"] = run(strategy, compute, storage, rt)
    # torchao's 8-bit AdamW (what FSDP2 runs in place of bitsandbytes' paged one) on the adapters' shards:
    # rank 64: each rank's shard of an adapter is large enough for 8-bit moments (torchao keeps < 4096 in fp32)
    eight_bit = dataclasses.replace(OPTIM, name="adamw8bit")
    wide = dataclasses.replace(LORA, rank=64, alpha=128)
    for strategy in ("none", "fsdp"):
        out[f"adamw8bit-{strategy}"] = run(strategy, torch.float32, torch.float32, rt, eight_bit, wide)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
