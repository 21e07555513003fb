"""Data parallelism without launching processes: the plan's strategy on simulated clusters, how ranks split the
data, the torchrun lines and the SLURM script, and the sharded checkpoint format in one process (atomic,
checksummed, falls back when corrupt, resumes exactly, exports to one file, saves in the background)."""

import dataclasses
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hopperlm import cli
from hopperlm.checkpoint.layout import latest_valid_checkpoint, list_checkpoints
from hopperlm.config import config_from_dict, load_config
from hopperlm.data.loader import RandomWindows, TokenShards
from hopperlm.errors import ConfigError
from hopperlm.hardware import simulated
from hopperlm.interop.inference import load_for_inference
from hopperlm.observe.metrics import read_metrics
from hopperlm.parallel.launch import launch_command, sbatch_script
from hopperlm.parallel.runtime import read_env
from hopperlm.plan import World, make_plan
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731


def plan_for(gpu, world, preset="tinyllama-1.1b", train=None, parallel=None, optim=None, lora=None):
    raw = {
        "model": {"preset": preset},
        "train": {"max_steps": 1000, "seq_len": 2048, **(train or {})},
        "parallel": parallel or {},
        "optim": optim or {},
        "lora": lora or {},
    }
    cfg = config_from_dict(raw)
    return make_plan(cfg, cfg.model, simulated(gpu), world=world)


def test_auto_picks_ddp_when_a_replica_fits_and_fsdp_when_it_does_not():
    one = plan_for("H100 80GB", World(1, 1))
    assert one.strategy == "none" and one.world_size == 1 and "one process" in one.reasons["parallel"]

    tiny = plan_for("H100 80GB", World(8, 8), train={"batch_tokens": 2048 * 256})
    assert (tiny.strategy, tiny.dp_shard) == ("ddp", 1)
    assert tiny.reasons["parallel"].startswith("ddp over 8 ranks: weights + grads + adamw state (17.6 GB)")
    # the global batch of 256 sequences is split: 32 per rank, reached with micro-batches and accumulation
    assert tiny.micro_batch * tiny.grad_accum == 32 and tiny.tokens_per_step == 2048 * 256
    assert "x 8 ranks" in tiny.reasons["micro_batch"]
    assert tiny.compile_mode != "reduce-overhead"  # no CUDA graphs around collectives
    # the two collective limits, with their reasons (one process has no collectives: no line)
    assert "up to 600 s through start-up" in tiny.reasons["timeouts"] and "timeouts" not in one.reasons
    assert "10x the slowest step" in tiny.reasons["timeouts"]
    fixed = plan_for("H100 80GB", World(8, 8), parallel={"step_timeout_s": 90, "startup_timeout_s": 1200})
    assert "up to 1200 s" in fixed.reasons["timeouts"] and "per step 90 s" in fixed.reasons["timeouts"]

    big = plan_for("H100 80GB", World(64, 8), preset="llama3-8b", train={"batch_tokens": 2048 * 512})
    assert (big.strategy, big.dp_shard) == ("fsdp", 64)
    assert "fsdp over 64 ranks" in big.reasons["parallel"] and "exceed one GPU" in big.reasons["parallel"]
    n = 8_030_261_248
    assert big.memory.shards == 64 and (big.memory.weights, big.memory.optimizer) == (-(-4 * n // 64), n // 8)
    assert big.memory.gathered > 0 and "sharded over 64" in big.memory.describe(big.micro_batch)
    assert big.activation_checkpointing == "none"  # sharded, the activations fit without recomputing
    if big.fp8 == "tensorwise":  # torchao installed: FSDP gathers float8 weights
        assert big.fp8_all_gather and "all-gathers the weights in float8" in big.reasons["fp8"]
    # on one GPU the same model does not fit at all: the error says to shard it
    with pytest.raises(ConfigError, match="FSDP"):
        plan_for("H100 80GB", World(1, 1), preset="llama3-8b")


def test_explicit_strategies_and_their_errors():
    hsdp = plan_for("H100 80GB", World(16, 8), parallel={"strategy": "hsdp"})
    assert (hsdp.strategy, hsdp.dp_shard) == ("hsdp", 8) and "2 replica(s)" in hsdp.reasons["parallel"]
    fsdp = plan_for("H100 80GB", World(1, 1), parallel={"strategy": "fsdp"})  # one rank: e.g. to time FSDP
    assert (fsdp.strategy, fsdp.world_size) == ("fsdp", 1)
    with pytest.raises(ConfigError, match="cannot share equally"):
        plan_for("H100 80GB", World(8, 8), train={"batch_tokens": 2048 * 12})
    with pytest.raises(ConfigError, match="parallel.strategy=none with 8 ranks"):
        plan_for("H100 80GB", World(8, 8), parallel={"strategy": "none"})
    with pytest.raises(ConfigError, match="muon"):
        plan_for("H100 80GB", World(8, 8), parallel={"strategy": "fsdp"}, optim={"name": "muon"})
    with pytest.raises(ConfigError, match="shard_size=3 does not divide"):
        plan_for("H100 80GB", World(8, 8), parallel={"strategy": "hsdp", "shard_size": 3})
    with pytest.raises(ConfigError, match="sharded format"):
        config_from_dict({"train": {"max_steps": 1}, "checkpoint": {"async_save": True, "format": "single"}})


QLORA = {"rank": 16, "alpha": 32, "targets": "all-linear", "quantize": "nf4"}


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_lora_and_qlora_on_several_gpus_plan_ddp_or_fsdp_with_their_memory():
    # QLoRA of a 7B model: the NF4 base fits one H100, so DDP (adapters' gradients only are all-reduced)
    seven = dict(preset="llama2-7b", lora=QLORA, optim={"name": "paged_adamw8bit"}, train={"micro_batch": 1})
    ddp = plan_for("H100 80GB", World(2, 2), **seven)
    assert ddp.strategy == "ddp" and "NF4 base + adapters" in ddp.reasons["parallel"]
    assert "only the adapters' gradients (160 MB fp32) cross ranks" in ddp.reasons["parallel"]
    assert (
        ddp.memory.shards == 1 and ddp.memory.weights < 6e9
    )  # ~3.9 GB of NF4 + the fp32 embeddings and norms
    # on 6 GB GPUs it does not fit: FSDP2, and bitsandbytes' paged optimizer cannot step its shards
    with pytest.raises(
        ConfigError, match="optim.name=paged_adamw8bit cannot run on; use optim.name adamw8bit"
    ):
        plan_for("RTX 4050 6GB", World(8, 8), **seven)
    with pytest.raises(ConfigError, match="paged_adamw8bit .* DTensor"):
        plan_for("H100 80GB", World(2, 2), **seven, parallel={"strategy": "fsdp"})
    fsdp = plan_for("RTX 4050 6GB", World(8, 8), **{**seven, "optim": {"name": "adamw"}})
    assert (fsdp.strategy, fsdp.dp_shard) == ("fsdp", 8)
    assert (
        "exceed one GPU" in fsdp.reasons["parallel"] and "NF4 data stored as bf16" in fsdp.reasons["parallel"]
    )
    # per rank: an eighth of the base, adapters, their gradients and AdamW state, plus two gathered blocks
    alone = plan_for("H100 80GB", World(1, 1), **{**seven, "optim": {"name": "adamw"}}).memory
    mem = fsdp.memory
    assert (mem.weights, mem.grads, mem.optimizer) == tuple(
        -(-x // 8) for x in (alone.weights, alone.grads, alone.optimizer)
    )
    assert 0 < mem.gathered < alone.weights / 4
    assert mem.total(1) < 0.9 * simulated("RTX 4050 6GB").free_memory  # what made the plan pick FSDP
    # LoRA on a bf16 base
    lora = plan_for(
        "H100 80GB", World(4, 4), preset="llama3-8b", lora={"rank": 8}, parallel={"strategy": "fsdp"}
    )
    assert "base and adapters sharded, gathered in bf16" in lora.reasons["parallel"]
    assert "NF4" not in lora.reasons["parallel"]


def test_ranks_read_their_block_of_each_global_micro_batch(shakespeare_bytes):
    shards = TokenShards(shakespeare_bytes, "train")
    whole = RandomWindows(shards, 64, 8, seed=5).starts(step=3, micro_step=1)
    parts = [RandomWindows(shards, 64, 2, seed=5, rank=r, world_size=4).starts(3, 1) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_torchrun_environment_is_read():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"}
    assert read_env(env) == (5, 1, World(16, 4), True) and World(16, 4).nodes == 4
    assert read_env({}) == (0, 0, World(1, 1), False)


def test_launch_command_for_one_and_several_nodes():
    one = launch_command("configs/debug.yaml", 8, python="py", overrides=["--train.max_steps", "10"])
    assert one == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
        "-m", "hopperlm", "train", "configs/debug.yaml", "--train.max_steps", "10",
    ]  # fmt: skip
    many = launch_command("c.yaml", 8, nnodes=4, rdzv_endpoint="node01:29500", rdzv_id="run7", resume=True)
    assert many[3:8] == [
        "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node01:29500", "--rdzv-id=run7",
    ]  # fmt: skip
    assert many[-2:] == ["c.yaml", "--resume"]
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint"):
        launch_command("c.yaml", 8, nnodes=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        launch_command("c.yaml", 8, nnodes=2, rdzv_endpoint="node01")


def test_slurm_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    run_dir = tmp_path / "run"
    cli.main([
        "slurm", "debug", "--nodes", "4", "--gpus-per-node", "8", "--out", str(out), "--time", "04:00:00",
        "--partition", "gpu", "--max-restarts", "2", "--run.out_dir", str(run_dir), "--train.max_hours", "100",
    ])  # fmt: skip
    assert "sbatch" in capsys.readouterr().out and run_dir.is_dir()  # SLURM opens its log there
    script = out.read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=B:USR1@120",  # the warning, to this script, 2 minutes before the limit
        "#SBATCH --requeue",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}",
        "export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "trap on_warning USR1",
        '  scancel --signal=USR1 "$SLURM_JOB_ID"  # every process of the job step, not this shell',
        '  scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in script.splitlines(), line
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert srun.startswith("srun --kill-on-bad-exit=1 bash -c \"trap '' USR1 TERM; exec ")
    for part in (
        f"-m hopperlm launch {(REPO / 'configs' / 'debug.yaml').resolve()} --nnodes $SLURM_NNODES --nproc-per-node 8",
        "--rdzv-endpoint $head_node:29500 --rdzv-id $SLURM_JOB_ID --max-restarts 2 --resume auto",
        f"--resume auto --run.out_dir {run_dir} --train.max_hours 100",
    ):
        assert part in srun, part
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0  # valid bash
    # quoting survives a value with spaces and quotes
    odd = sbatch_script("c.yaml", 1, 1, "/r", ["--run.out_dir", 'my "run" dir'], script_path="/r/job.sbatch")
    assert "Submit with: sbatch /r/job.sbatch" in odd and "{" not in odd.splitlines()[1]
    assert subprocess.run(["bash", "-n"], input=odd, text=True).returncode == 0
    assert "'my \\\"run\\\" dir'" in odd


def debug(data, run_dir, *overrides):
    args = ["--data.path", str(data), "--run.out_dir", str(run_dir), "--train.log_every", "1"]
    args += ["--train.eval_windows", "16", "--checkpoint.format", "sharded", *overrides]
    return load_config(REPO / "configs" / "debug.yaml", args)


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def test_sharded_checkpoints_in_one_process(shakespeare_bytes, tmp_path, monkeypatch):
    steps = ["--train.max_steps", "6", "--checkpoint.every", "3", "--train.eval_every", "3"]
    full = tmp_path / "full"
    train(debug(shakespeare_bytes, full, *steps), log=QUIET)
    ckpts = list_checkpoints(full)
    assert [c.name for c in ckpts] == ["step_000003", "step_000006"]
    for c in ckpts:
        assert (c / "sharded" / ".metadata").is_file() and not (c / "model.safetensors").exists()
        assert "sharded/.metadata" in json.loads((c / "checksums.json").read_text())
    # exact resume from the sharded step 3
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpts[0], resumed / "checkpoints" / ckpts[0].name)
    train(debug(shakespeare_bytes, resumed, *steps), resume=True, log=QUIET)
    assert [losses(resumed)[s] for s in (4, 5, 6)] == [losses(full)[s] for s in (4, 5, 6)]
    # a corrupt shard is caught by its checksum: resume falls back to the checkpoint before it
    shard = next((resumed / "checkpoints" / "step_000006" / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    warnings = []
    assert latest_valid_checkpoint(resumed, warnings.append).name == "step_000003"
    assert "does not match its checksum" in warnings[0]
    # export gathers the shards into one model.safetensors (hopperlm's folder, or a Hugging Face one: the
    # default); generate reads all three
    out, out_hf = tmp_path / "exported", tmp_path / "exported-hf"
    cli.main(["export", str(full), str(out), "--format", "hopperlm"])
    cli.main(["export", str(full), str(out_hf)])
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "tokenizer"}
    assert {"model.safetensors", "config.json"} <= {p.name for p in out_hf.iterdir()}
    sharded_model, _ = load_for_inference(ckpts[1])
    for exported in (out, out_hf):
        exported_model, _ = load_for_inference(exported)
        for (name, a), b in zip(
            sharded_model.state_dict().items(), exported_model.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_failed_sharded_save_keeps_the_previous_checkpoint(shakespeare_bytes, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    save, calls = dcp.save, []

    def full_disk_on_second_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", full_disk_on_second_save)
    lines = []
    run = tmp_path / "run"
    steps = ["--train.max_steps", "6", "--checkpoint.every", "2", "--train.eval_every", "0"]
    # (stop, the default, is tested in tests/test_disk_full.py)
    steps += ["--checkpoint.on_disk_full", "continue"]
    result = train(debug(shakespeare_bytes, run, *steps), log=lines.append)
    assert result.step == 6  # training went on
    assert any(
        "could not write checkpoint step_000004 in" in x and "(no space left on device" in x for x in lines
    )
    assert [c.name for c in list_checkpoints(run)] == ["step_000002", "step_000006"]
    assert not list((run / "checkpoints").glob("*.tmp-*"))  # the partial copy is gone


def test_async_sharded_checkpoint_completes_and_resumes(shakespeare_bytes, tmp_path):
    steps = ["--train.max_steps", "4", "--checkpoint.every", "2", "--train.eval_every", "0"]
    run, lines = tmp_path / "async", []
    train(debug(shakespeare_bytes, run, *steps, "--checkpoint.async_save", "true"), log=lines.append)
    assert [c.name for c in list_checkpoints(run)] == ["step_000002", "step_000004"]
    assert sum("written in the background" in x for x in lines) == 2
    assert latest_valid_checkpoint(run, QUIET).name == "step_000004"  # checksums complete and correct
    resumed = tmp_path / "resumed"
    shutil.copytree(run / "checkpoints" / "step_000002", resumed / "checkpoints" / "step_000002")
    train(debug(shakespeare_bytes, resumed, *steps), resume=True, log=QUIET)
    assert [losses(resumed)[s] for s in (3, 4)] == [losses(run)[s] for s in (3, 4)]


def test_resume_auto_starts_then_continues(shakespeare_bytes, tmp_path):
    """What a requeued SLURM job runs: `train --resume auto` starts a new run, then continues it."""
    run = tmp_path / "run"
    args = [
        "train",
        str(REPO / "configs" / "debug.yaml"),
        "--resume",
        "auto",
        "--data.path",
        str(shakespeare_bytes),
    ]
    args += ["--run.out_dir", str(run), "--train.eval_every", "0", "--train.eval_windows", "8"]
    cli.main([*args, "--train.max_steps", "2"])
    cli.main([*args, "--train.max_steps", "4"])
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")][-1] == 4
    assert [c.name for c in list_checkpoints(run)] == ["step_000002", "step_000004"]


def test_float8_conversion_prepares_fsdp_float8_all_gather():
    pytest.importorskip("torchao")
    from hopperlm.config import ModelConfig
    from hopperlm.model.transformer import build_model
    from hopperlm.speed.float8 import apply_fp8

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=128)
    model = build_model(cfg)
    assert apply_fp8(model, "tensorwise", only_if_pays=False, fsdp_float8_all_gather=True) == 14
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert converted and all(m.config.enable_fsdp_float8_all_gather for m in converted)


def test_diagnose_plans_for_a_cluster(capsys):
    # the recipe's Muon cannot run on FSDP's shards: AdamW for an 8B model
    cli.main([
        "diagnose", "owt-350m-h100", "--model.preset", "llama3-8b", "--optim.name", "adamw",
        "--simulate", "H100 80GB", "--world-size", "64", "--gpus-per-node", "8",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "parallel: fsdp over 64 ranks" in out and "x 64 ranks" in out
    assert "config: --optim.name adamw: the recipe's muon section (lr_adjust) is not read" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_on_one_gpu_trains(shakespeare_bytes, tmp_path):
    """A group of one process (no torchrun) with FSDP2 and bf16 parameters on the GPU."""
    cfg = debug(shakespeare_bytes, tmp_path / "run", "--train.max_steps", "4", "--parallel.strategy", "fsdp")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    result = train(cfg, log=QUIET)
    assert result.step == 4 and (tmp_path / "run" / "checkpoints" / "step_000004" / "sharded").is_dir()
