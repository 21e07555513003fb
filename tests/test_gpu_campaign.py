"""GPU scripts that cannot rot: bench/gpu/campaign.sh --smoke runs every stage of both device calls on the CPU
at tiny sizes (CPU stand-ins where a kernel needs CUDA), so a script that would crash on the GPU machine crashes
here first (bench/gpu/qlora.py once passed data_tokenizer=None to build_train_model, which called it: both
hopperlm rows died before any GPU work, and nothing ran the script to notice)."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from shared_data import DATA_DIR

REPO = Path(__file__).resolve().parents[1]
CAMPAIGN = REPO / "bench" / "gpu" / "campaign.sh"
CALLS = {
    "A": ["bench-h100-350m", "qlora", "owt-350m", "gpu-tests"],
    "B": ["lora", "gpu-tests-qlora", "flash-ac-finder", "cudagraphs-accum"],
    "C": ["bench-hf-compile", "profile-h100-350m", "bench-tinyllama-1.1b", "fsdp-overhead"],
    "D": ["qlora-compile", "bench-h100-350m-mb32"],
}


def campaign(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "CAMPAIGN_BREAK"}
    env = {**base, "HOPPERLM_DATA_DIR": str(DATA_DIR), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(CAMPAIGN), *args], capture_output=True, text=True, env=env, timeout=900, cwd=REPO
    )


def stage(out: Path, name: str) -> dict:
    path = out / f"{name}.json"
    assert path.is_file(), f"{name}: no {path.name}"
    record = json.loads(path.read_text())
    assert record["stage"] == name
    return record


def test_the_plan_shows_each_call_fits_its_share_of_the_lease(tmp_path):
    sums = {}
    for call, limit in (("A", 420), ("B", 220), ("C", 450), ("D", 220)):
        done = campaign("--plan", "--call", call)
        assert done.returncode == 0, done.stderr
        listed = [line.split()[0] for line in done.stdout.splitlines()[1:-1]]
        assert listed == CALLS[call], done.stdout
        sums[call] = int(done.stdout.splitlines()[-1].split()[1])
        assert sums[call] <= limit, done.stdout
    assert "device call timeout_s 450" in campaign("--plan", "--call", "A").stdout
    bad = campaign("--plan", "--call", "1")
    assert bad.returncode == 2 and "--call takes A, B, C or D" in bad.stderr


@pytest.mark.slow
def test_smoke_campaign_runs_every_stage_of_every_call(tmp_path):
    out = tmp_path / "smoke"  # the three calls share OUT/work/ (prepared data, the tiny base checkpoint)
    for call, names in CALLS.items():
        done = campaign("--smoke", "--call", call, str(out))
        failed = [n for n in names if not json.loads((out / f"{n}.json").read_text()).get("ok")]
        assert done.returncode == 0 and not failed, (call, failed, done.stdout[-4000:], done.stderr[-2000:])
        for name in names:
            record = stage(out, name)
            assert record["ok"] is True and record["smoke"] is True and record["seconds"] > 0, record
        # the summary table comes last, labelled as a smoke run
        tail = done.stdout[done.stdout.index("== GPU campaign") :]
        assert f"call {call}" in tail and "SMOKE: CPU, tiny sizes" in tail and "key numbers" in tail
        assert all(name in tail for name in names) and f"{len(names)} of {len(names)} stages ok" in tail
        assert (out / "summary.txt").read_text().strip() == tail.strip()
    assert json.loads((out / "machine.json").read_text())["smoke"] is True

    for name in ("bench-h100-350m", "bench-tinyllama-1.1b"):  # the hopperlm rows and the baselines
        rows = {r["config"]: r for r in stage(out, name)["rows"]}
        assert set(rows) == {"eager", "hopperlm", "hf"}, rows.keys()  # float8 is CUDA-only
        assert all(r["tokens_per_s"] > 0 and r["error"] is None for r in rows.values())
        assert json.loads((out / "raw" / name / "bench.json").read_text())["quick"] is True
    assert [r["config"] for r in stage(out, "bench-hf-compile")["rows"]] == [
        "hopperlm"
    ]  # + HF compile on CUDA

    qlora = {r["case"]: r for r in stage(out, "qlora")["rows"]}  # QLoRA's rows on the CPU: stand-ins
    assert list(qlora) == ["hopperlm-qlora", "hf-qlora"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in qlora.values()), qlora
    assert all(r["stand_in"].startswith("CPU stand-in") for r in qlora.values())
    lora = {r["case"]: r for r in stage(out, "lora")["rows"]}
    assert list(lora) == ["hopperlm-lora", "hf-lora"] and not any("stand_in" in r for r in lora.values())

    fsdp = {r["config"] for r in stage(out, "fsdp-overhead")["rows"]}
    assert fsdp == {"none", "ddp", "fsdp"}

    accum = stage(out, "cudagraphs-accum")  # accumulation > 1, finite losses
    assert accum["outcome"] == "trained" and accum["plan"]["grad_accum"] == 4 and accum["losses"]
    flash = stage(out, "flash-ac-finder")  # a forced kernel (math on a CPU), full AC, micro-batch unset
    assert flash["plan"]["attention"].startswith("SDPA math") and not flash["checkpoint_error"]
    assert flash["plan"]["activation_checkpointing"].startswith("full")
    owt = stage(out, "owt-350m")  # steps, one evaluation, one checkpoint, the report
    assert owt["steps"] == 4 and owt["val_loss"] is not None and owt["result"]["stopped_by"] == "max_steps"
    assert owt["checkpoints"] == ["step_000004"] and owt["report"] is True

    folder = out / "raw" / "profile-h100-350m" / "profile"  # the table and the trace, which stays here
    assert (folder / "kernels.txt").is_file() and (folder / "trace.pt.trace.json").is_file()
    assert json.loads((folder / "profile.json").read_text())["device"] == "cpu"

    for name in ("gpu-tests", "gpu-tests-qlora"):  # on the CPU every GPU test skips, with its reason
        tests = stage(out, name)["tests"]
        assert tests["failed"] == 0 and tests["skipped"] >= 1


@pytest.mark.slow
def test_a_failing_stage_is_recorded_and_the_campaign_goes_on(tmp_path):
    out, bring = tmp_path / "broken", tmp_path / "bring"
    done = campaign(
        "--smoke",
        "--call",
        "B",
        "--only",
        "gpu-tests-qlora,flash-ac-finder,cudagraphs-accum",
        "--bring",
        str(bring),
        str(out),
        env={"CAMPAIGN_BREAK": "gpu-tests-qlora=fail,flash-ac-finder=hang"},
    )
    assert done.returncode == 1, done.stdout[-3000:]
    failed = stage(out, "gpu-tests-qlora")
    assert failed["ok"] is False and failed["error"].startswith("exit code 3: error: broken on purpose")
    hung = stage(out, "flash-ac-finder")  # a time-out loses only the stage in flight
    assert hung["ok"] is False and hung["error"] == "timed out after 3 s" and hung["seconds"] < 20
    assert stage(out, "cudagraphs-accum")["ok"] is True  # the next stage still ran
    assert "1 of 3 stages ok; failed: gpu-tests-qlora, flash-ac-finder" in done.stdout

    # what the device tool brings back from $OUT: two files, the tar holding every stage's record
    assert sorted(p.name for p in bring.iterdir()) == [
        "campaign-callB-smoke.tar.gz",
        "summary-callB-smoke.txt",
    ]
    with tarfile.open(bring / "campaign-callB-smoke.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu-tests-qlora.json", "flash-ac-finder.json", "cudagraphs-accum.json", "summary.txt"} <= names
    assert not any(n.startswith("work/") for n in names)


def test_the_qlora_collector_accepts_exactly_the_cases_asked_for(tmp_path):
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    from campaign import collect_qlora

    def row(case):
        return {"case": case, "tokens_per_s": 100.0, "peak_mem_gb": 5.0}

    def collect(asked, rows):
        (tmp_path / "qlora.json").write_text(json.dumps({"cases": asked, "rows": rows}))
        return collect_qlora("qlora", tmp_path, "", 0, False)

    asked = ["hopperlm-qlora", "hf-qlora"]
    ok, key, _ = collect(asked, [row(c) for c in asked])
    assert ok and "QLoRA 1.00x hf" in key
    assert not collect(asked, [row("hopperlm-qlora")])[0]  # one missing
    assert not collect(asked, [row(c) for c in [*asked, "hf-lora"]])[0]  # one not asked for
    assert not collect(asked, [row("hopperlm-qlora"), {"case": "hf-qlora", "error": "timed out"}])[0]
    assert not collect([], [])[0]


def test_the_carry_holds_every_data_folder_the_gpu_tests_read():
    """A GPU test reading a shared-data folder that scripts/gpu_carry.sh does not carry fails only on the GPU,
    in device minutes (HornMT, 2026-11-26): every shared-data folder named after DATA_DIR or data_dir in the
    files the gpu-tests stages run, and in conftest.py's fixtures, must be one the carry copies."""
    carry = (REPO / "scripts" / "gpu_carry.sh").read_text()
    body = carry[carry.index("test_data() {") :]
    body = body[: body.index("\n}\n")]
    carried = set(re.findall(r'"\$DATA/([^"/]+)', body))
    assert {"tinyshakespeare", "tokenizers"} <= carried, body
    files = [
        p for p in (REPO / "tests").glob("test_*.py") if re.search(r"@pytest\.mark\.gpu\b", p.read_text())
    ]
    files.append(REPO / "tests" / "conftest.py")
    assert any(p.name == "test_document_attention.py" for p in files)
    read = {
        (p.name, name)
        for p in files
        for name in re.findall(r'(?:DATA_DIR|data_dir)\s*/\s*"([^"/]+)', p.read_text())
    }
    assert read, "no data reads found: the pattern no longer matches how the tests name their data"
    missing = sorted(f"{file}: {name}" for file, name in read if name not in carried)
    assert not missing, f"scripts/gpu_carry.sh's test_data does not carry: {missing}"


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
