"""GPU scripts that cannot rot: bench/gpu/campaign.sh --smoke runs every stage of both device calls on the CPU
at tiny sizes (CPU stand-ins where a kernel needs CUDA), so a script that would crash on the GPU machine crashes
here first (bench/gpu/qlora.py once passed data_tokenizer=None to build_train_model, which called it: both
hopperlm rows died before any GPU work, and nothing ran the script to notice)."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from shared_data import DATA_DIR

REPO = Path(__file__).resolve().parents[1]
CAMPAIGN = REPO / "bench" / "gpu" / "campaign.sh"
CALL1 = [
    "gpu-tests",
    "bench-h100-350m",
    "cudagraphs-accum",
    "flash-ac-finder",
    "owt-350m",
    "profile-h100-350m",
]
CALL2 = ["qlora", "gpu-tests-qlora", "fsdp-overhead", "bench-tinyllama-1.1b"]


def campaign(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "CAMPAIGN_BREAK"}
    env = {**base, "HOPPERLM_DATA_DIR": str(DATA_DIR), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(CAMPAIGN), *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
    )


def stage(out: Path, name: str) -> dict:
    path = out / f"{name}.json"
    assert path.is_file(), f"{name}: no {path.name}"
    record = json.loads(path.read_text())
    assert record["stage"] == name
    return record


@pytest.mark.slow
def test_smoke_campaign_runs_every_stage_of_both_calls(tmp_path):
    out = tmp_path / "smoke"
    done = campaign("--smoke", str(out))
    failed = [n for n in CALL1 + CALL2 if not json.loads((out / f"{n}.json").read_text()).get("ok")]
    assert done.returncode == 0 and not failed, (failed, done.stdout[-4000:], done.stderr[-2000:])
    for name in CALL1 + CALL2:
        record = stage(out, name)
        assert record["ok"] is True and record["smoke"] is True and record["seconds"] > 0, record

    # the summary table comes last, labelled as a smoke run
    tail = done.stdout[done.stdout.index("== GPU campaign") :]
    assert "SMOKE: CPU, tiny sizes" in tail and "stage" in tail and "key numbers" in tail
    assert all(name in tail for name in CALL1 + CALL2) and "10 of 10 stages ok" in tail
    assert (out / "summary.txt").read_text().strip() == tail.strip()
    assert json.loads((out / "machine.json").read_text())["smoke"] is True

    for name in ("bench-h100-350m", "bench-tinyllama-1.1b"):  # the hopperlm rows and the baselines
        rows = {r["config"]: r for r in stage(out, name)["rows"]}
        assert {"eager", "hopperlm", "hf"} <= set(rows), rows.keys()
        assert all(r["tokens_per_s"] > 0 and r["error"] is None for r in rows.values())
        assert json.loads((out / "raw" / name / "bench.json").read_text())["quick"] is True

    qlora = stage(out, "qlora")  # the four rows; QLoRA's on the CPU labelled as stand-ins
    rows = {r["case"]: r for r in qlora["rows"]}
    assert list(rows) == ["hopperlm-qlora", "hf-qlora", "hopperlm-lora", "hf-lora"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows["hopperlm-qlora"]["stand_in"].startswith("CPU stand-in")
    assert rows["hf-qlora"]["stand_in"].startswith("CPU stand-in") and "stand_in" not in rows["hopperlm-lora"]

    fsdp = {r["config"] for r in stage(out, "fsdp-overhead")["rows"]}
    assert fsdp == {"none", "ddp", "fsdp"}

    accum = stage(out, "cudagraphs-accum")  # (b): accumulation > 1, finite losses
    assert accum["outcome"] == "trained" and accum["plan"]["grad_accum"] == 4 and accum["losses"]
    flash = stage(out, "flash-ac-finder")  # (d): a forced kernel (math on a CPU), full AC, micro-batch unset
    assert flash["plan"]["attention"].startswith("SDPA math") and not flash["checkpoint_error"]
    assert flash["plan"]["activation_checkpointing"].startswith("full")
    owt = stage(out, "owt-350m")
    assert owt["steps"] == 4 and owt["val_loss"] is not None and owt["result"]["stopped_by"] == "max_steps"

    profile = stage(out, "profile-h100-350m")  # the trace, the table, and one line on --memory-snapshot
    folder = out / "raw" / "profile-h100-350m" / "profile"
    assert (folder / "trace.pt.trace.json").is_file() and (folder / "kernels.txt").is_file()
    assert json.loads((folder / "profile.json").read_text())["device"] == "cpu"
    assert profile["memory_snapshot"].startswith("memory snapshot: skipped (CPU run")

    tests = stage(out, "gpu-tests")["tests"]
    assert tests["failed"] == 0 and tests["skipped"] >= 1  # on the CPU every GPU test skips, with its reason


@pytest.mark.slow
def test_a_failing_stage_is_recorded_and_the_campaign_goes_on(tmp_path):
    out, bring = tmp_path / "broken", tmp_path / "bring"
    done = campaign(
        "--smoke",
        "--only",
        "gpu-tests,bench-h100-350m,cudagraphs-accum",
        "--bring",
        str(bring),
        str(out),
        env={"CAMPAIGN_BREAK": "gpu-tests=fail,bench-h100-350m=hang"},
    )
    assert done.returncode == 1, done.stdout[-3000:]
    failed = stage(out, "gpu-tests")
    assert failed["ok"] is False and failed["error"].startswith("exit code 3: error: broken on purpose")
    hung = stage(out, "bench-h100-350m")  # a time-out loses only the stage in flight
    assert hung["ok"] is False and hung["error"] == "timed out after 3 s" and hung["seconds"] < 20
    assert stage(out, "cudagraphs-accum")["ok"] is True  # the next stage still ran
    assert "1 of 3 stages ok; failed: gpu-tests, bench-h100-350m" in done.stdout

    # what the device tool brings back from $OUT: two files, the tar holding every stage's record
    assert sorted(p.name for p in bring.iterdir()) == [
        "campaign-callall-smoke.tar.gz",
        "summary-callall-smoke.txt",
    ]
    with tarfile.open(bring / "campaign-callall-smoke.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu-tests.json", "bench-h100-350m.json", "cudagraphs-accum.json", "summary.txt"} <= names
    assert not any(n.startswith("work/") for n in names)


def test_smoke_numbers_never_land_in_bench_results():
    done = campaign("--smoke", "--only", "gpu-tests", str(REPO / "bench" / "results" / "smoke"))
    assert done.returncode == 2 and "not measurements" in done.stderr
    assert not (REPO / "bench" / "results" / "smoke").exists()


def test_random_token_benchmarks_load_a_checkpoint_without_a_data_tokenizer(tinyllama_hf):
    """data_tokenizer=None: nothing to check the checkpoint's tokenizer against (bench/gpu/qlora.py's rows)."""
    import torch

    from hopperlm.checkpoint.init_from import resolve_init_from
    from hopperlm.config import config_from_dict
    from hopperlm.train.initial_model import build_train_model

    for lora in ({}, {"lora": {"rank": 4, "alpha": 8, "targets": "all-linear"}}):
        cfg = resolve_init_from(
            config_from_dict(
                {
                    "model": {"init_from": str(tinyllama_hf)},
                    "train": {"seq_len": 32, "micro_batch": 1, "max_steps": 1},
                    **lora,
                }
            )
        )
        model, _ = build_train_model(
            cfg,
            cfg.model,
            device=torch.device("cpu"),
            compute_dtype=None,
            data_tokenizer=None,
            load=True,
            log=print,
        )
        x = torch.randint(0, cfg.model.vocab_size, (1, 16))
        assert torch.isfinite(model(x, x))  # the loss
