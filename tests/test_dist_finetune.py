"""Fine-tuning on several ranks for real: torchrun with 2 gloo processes on the CPU, LoRA on a tiny Llama with
TinyLlama-Chat's tokenizer, instruction rows from the Alpaca-GPT4 demo (packed, loss on replies only).

- DDP and FSDP2 train one process's loss curve (training and validation) for the same global batch, also with
  accumulation: every micro-batch's loss counts by its share of the step's learned tokens, so the gradient is
  the mean over the step's tokens however the step is split (rows hold different numbers of reply tokens).
- Checkpoints hold the adapters alone in both formats (single from DDP, sharded from FSDP2); either resumes on
  1 and on 2 ranks under either strategy with the next losses of the uninterrupted run.
- merge, export and export --peft of a 2-rank run (the sharded checkpoint included) equal the one-process run's.
- QLoRA's NF4 base under DDP and FSDP2 (bitsandbytes' CPU backend, tests/dist_qlora_worker.py).
Plans for several GPUs (DDP or FSDP2 for LoRA/QLoRA, refusals) are in tests/test_dist.py.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import finetune_config
from test_dist_torchrun import WORKER, assert_same_curve, copy_checkpoint, curve

from hopperlm.train.loop import train

pytestmark = pytest.mark.slow  # every test here starts torchrun: several Python processes

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731
STEPS = ["--train.max_steps", "4", "--train.log_every", "1", "--train.eval_every", "2"]
STEPS += ["--checkpoint.every", "2"]
LORA = ["--sft.max_examples", "200", "--optim.lr", "1e-2", "--schedule.warmup_steps", "2", "--lora.rank", "8"]
LORA += ["--lora.targets", "all-linear", "--train.eval_windows", "8", "--checkpoint.keep_last", "5", *STEPS]
# 8 rows per step: one micro-batch of 8 in one process; 4 per rank on 2; 2 x 2 accumulated per rank
ACCUM = ["--train.micro_batch", "2", "--train.batch_tokens", str(8 * 128)]


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    result = subprocess.run(
        [*command, str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def runs(tinyllama_hf, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist-finetune")
    train(finetune_config(tinyllama_hf, data_dir, root / "one", *LORA, "--train.micro_batch", "8"), log=QUIET)
    two = {
        "ddp": ["--train.micro_batch", "4", "--parallel.strategy", "ddp"],
        "fsdp": ["--train.micro_batch", "4", "--parallel.strategy", "fsdp"],
        "fsdp-accum": [*ACCUM, "--parallel.strategy", "fsdp"],
    }
    spec = {"runs": [{"args": worker_args(tinyllama_hf, data_dir, root / n, *a)} for n, a in two.items()]}
    torchrun(2, WORKER, json.dumps(spec))
    return root, tinyllama_hf, data_dir


def worker_args(base: Path, data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """The overrides of finetune_config (tests/hf_tiny.py), as tests/dist_worker.py applies them to debug.yaml."""
    return [
        "--model.preset", "null",
        "--model.init_from", str(base),
        "--sft.path", str(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json"),
        "--train.seq_len", "128",
        "--run.out_dir", str(run_dir),
        *LORA,
        *extra,
    ]  # fmt: skip


def test_lora_sft_on_two_ranks_trains_the_one_process_curve(runs):
    root, _, _ = runs
    reference = curve(root / "one")
    assert len(reference) == 4 and reference[4][1] is not None
    for name in ("ddp", "fsdp", "fsdp-accum"):
        assert_same_curve(curve(root / name), reference, range(1, 5))
    # adapters only, in both formats: no base weight is written
    single = root / "ddp" / "checkpoints" / "step_000002"
    sharded = root / "fsdp" / "checkpoints" / "step_000002"
    assert (single / "adapter.safetensors").is_file() and not (single / "model.safetensors").exists()
    from hopperlm.checkpoint.layout import load_sharded_adapters, read_lora_config

    assert read_lora_config(sharded).rank == 8 and len(list((sharded / "sharded").glob("*.distcp"))) == 2
    adapters = load_sharded_adapters(sharded)  # A and B of 7 targets x 2 blocks, nothing else
    assert len(adapters) == 2 * 7 * 2 and all(".lora_" in name for name in adapters)
    base_bytes = (runs[1] / "model.safetensors").stat().st_size
    assert sum(p.stat().st_size for p in (sharded / "sharded").iterdir()) < base_bytes / 10


def test_two_rank_checkpoints_resume_on_one_and_two_ranks(runs):
    root, base, data_dir = runs
    reference = curve(root / "one")
    for source in ("fsdp", "ddp"):  # one process from the sharded and the single-file checkpoint
        run = root / f"one-from-{source}"
        copy_checkpoint(root / source, 2, run)
        train(finetune_config(base, data_dir, run, *LORA, "--train.micro_batch", "8"), resume=True, log=QUIET)
        assert_same_curve(curve(run), reference, range(3, 5))
    two = {"ddp-from-fsdp": ("fsdp", "ddp"), "fsdp-from-ddp": ("ddp", "fsdp")}
    spec = {"runs": []}
    for name, (source, strategy) in two.items():
        copy_checkpoint(root / source, 2, root / name)
        args = worker_args(
            base, data_dir, root / name, "--train.micro_batch", "4", "--parallel.strategy", strategy
        )
        spec["runs"].append({"args": args, "resume": True})
    torchrun(2, WORKER, json.dumps(spec))
    for name in two:
        assert_same_curve(curve(root / name), reference, range(3, 5))


def test_a_checkpoint_with_other_adapters_is_refused_under_fsdp(runs):
    """FSDP2 loads a single-file LoRA checkpoint non-strictly (the base is not in it), so the adapters' names
    are checked first: a run with other targets must not start with half its adapters left at their init."""
    from hopperlm.errors import CheckpointError

    root, base, data_dir = runs
    run = root / "other-targets"
    copy_checkpoint(root / "ddp", 2, run)
    other = ["--lora.targets", "q,v", "--parallel.strategy", "fsdp", "--train.micro_batch", "8"]
    with pytest.raises(CheckpointError, match="does not match the model's adapters"):
        train(finetune_config(base, data_dir, run, *LORA, *other), resume=True, log=QUIET)


def test_merge_and_export_of_a_two_rank_run_equal_the_one_process_run(runs, tmp_path):
    from safetensors.torch import load_file

    from hopperlm.checkpoint.layout import read_adapters, read_lora_config
    from hopperlm.interop.export import export_model
    from hopperlm.interop.hf_convert import save_merged
    from hopperlm.interop.peft import export_peft, read_peft
    from hopperlm.interop.tensors import iter_model_tensors
    from hopperlm.model.lora import scale_of

    root, base, _ = runs
    last = "checkpoints/step_000004"
    one = read_adapters(root / "one" / last)
    for name in (
        "ddp",
        "fsdp",
    ):  # the same training, to rounding (Adam magnifies the rounding of tiny gradients)
        two = read_adapters(root / name / last)
        assert two.keys() == one.keys()
        for key, tensor in one.items():
            assert (two[key] - tensor).norm() <= 2e-3 * tensor.norm(), (name, key)
    base_tensors = dict(iter_model_tensors(base))
    scale = scale_of(read_lora_config(root / "fsdp" / last))
    merged = {"fsdp": tmp_path / "merged-fsdp", "ddp": tmp_path / "merged-ddp"}
    save_merged(root / "fsdp", merged["fsdp"])  # from the sharded checkpoint
    done = subprocess.run(  # `hopperlm merge` on the DDP run (single-file checkpoint), as a user runs it
        [sys.executable, "-m", "hopperlm", "merge", str(root / "ddp"), str(merged["ddp"])],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # W + scale * B @ A with the run's own adapters, every other tensor as it is
    for name, folder in merged.items():
        adapters = read_adapters(root / name / last)
        weights = load_file(str(next(folder.glob("*.safetensors"))))
        assert weights.keys() == base_tensors.keys()
        for key, tensor in weights.items():
            module = key.removesuffix(".weight")
            want = base_tensors[key]
            if f"{module}.lora_A.weight" in adapters:
                a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
                want = want.float() + (b.float() @ a.float()) * scale
            torch.testing.assert_close(tensor, want.to(tensor.dtype), rtol=1e-6, atol=1e-6)
    # `generate` reads the sharded LoRA checkpoint as its merged folder
    from hopperlm.interop.inference import load_for_inference

    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        direct, folded = (
            load_for_inference(p, device="cpu")[0](ids) for p in (root / "fsdp", merged["fsdp"])
        )
    torch.testing.assert_close(direct, folded, rtol=0, atol=0)
    # export (the adapters gathered from the shards into one file) and export --peft: the run's adapters exactly
    fsdp = read_adapters(root / "fsdp" / last)
    exported = load_file(str(export_model(root / "fsdp", tmp_path / "export-fsdp") / "adapter.safetensors"))
    lora_cfg, peft = read_peft(export_peft(root / "fsdp", tmp_path / "peft-fsdp"))
    assert lora_cfg.rank == 8 and exported.keys() == peft.keys() == fsdp.keys()
    assert all(torch.equal(exported[k], v) and torch.equal(peft[k], v) for k, v in fsdp.items())


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_qlora_nf4_base_under_ddp_and_fsdp2(tmp_path):
    out = tmp_path / "qlora.json"
    torchrun(2, Path(__file__).resolve().parent / "dist_qlora_worker.py", str(out))
    got = json.loads(out.read_text())
    one = got["fp32-none"]
    for strategy in ("ddp", "fsdp"):  # fp32 all through: the one-process steps, to rounding
        run = got[f"fp32-{strategy}"]
        assert run["losses"] == pytest.approx(one["losses"], rel=1e-6)
        assert run["norms"] == pytest.approx(one["norms"], rel=1e-5)
        for name, values in one["adapters"].items():
            assert run["adapters"][name] == pytest.approx(values, rel=1e-5, abs=1e-7), name
        assert run["nf4_frozen"]
    assert got["fp32-fsdp"]["nf4_sharded"] and not got["fp32-ddp"]["nf4_sharded"]
    ddp = got["fp32-ddp"]  # DDP's gradient buckets hold the adapters alone (4 bytes each), no frozen weight
    per_block = 4 * (2 * (128 + 128) + 2 * (64 + 128) + 3 * (256 + 128))  # rank 4: q,o; k,v; gate,up,down
    assert ddp["ddp_bucket_bytes"] == 4 * ddp["trainable"] == 4 * 2 * per_block
    # torchao's 8-bit AdamW, what the docs advise with FSDP2, steps the shards: 8-bit moments on them, one
    # process's losses; the adapters agree to the moments' rounding (torchao picks 8 bits per local tensor of
    # >= 4096 values, so k/v's 4096-value B is 8-bit whole and fp32 in two shards)
    eight_bit, alone = got["adamw8bit-fsdp"], got["adamw8bit-none"]
    assert "OptimState8bit" in eight_bit["moments"] and "OptimState8bit" in alone["moments"]
    assert eight_bit["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    for name, values in alone["adapters"].items():
        assert eight_bit["adapters"][name] == pytest.approx(values, abs=1e-3), name
    # bf16: the 4-bit data stored as bf16 (FSDP2's param dtype), sharded, gathered untouched; bf16 compute
    fsdp = got["bf16-fsdp"]
    assert fsdp["nf4_dtypes"] == ["torch.bfloat16"] and fsdp["nf4_sharded"]
    assert fsdp["losses"] == pytest.approx(got["bf16-none"]["losses"], rel=1e-3)
    assert fsdp["losses"][-1] < fsdp["losses"][0]  # the adapters learn through the gathered NF4 layers


def test_launch_and_slurm_run_finetune_for_instruction_recipes(tinyllama_hf, data_dir, tmp_path, capsys):
    from hopperlm import cli

    args = worker_args(tinyllama_hf, data_dir, tmp_path / "run")
    cli.main(["launch", str(REPO / "configs" / "debug.yaml"), "--nproc-per-node", "2", "--dry-run", *args])
    assert " -m hopperlm finetune " in capsys.readouterr().out
    cli.main(["slurm", str(REPO / "configs" / "debug.yaml"), "--nodes", "2", "--gpus-per-node", "4", *args])
    script = (tmp_path / "run" / "job.sbatch").read_text()
    # each node runs `hopperlm launch`, which picks finetune for this recipe (the dry run above)
    assert "-m hopperlm launch" in script and "--resume auto" in script
