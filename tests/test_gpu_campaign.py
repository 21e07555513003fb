"""GPU scripts that cannot rot: bench/gpu/campaign.sh --smoke runs every stage of the device calls on the CPU
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
    "E": ["bench-e-step", "bench-e-attention", "bench-owt-step", "bench-e-compile"],
    "F": ["qlora-fast-lean", "qlora-fixes"],
    "A": ["bench-h100-350m", "qlora", "owt-350m", "gpu-tests"],
    "B": ["lora", "gpu-tests-qlora", "flash-ac-finder", "cudagraphs-accum"],
    "C": ["bench-hf-compile", "profile-h100-350m", "bench-tinyllama-1.1b", "fsdp-overhead"],
    "D": ["qlora-compile", "bench-h100-350m-mb32"],
    "R": ["race-r"],
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
    for call, limit in (("E", 420), ("F", 220), ("A", 420), ("B", 220), ("C", 450), ("D", 220), ("R", 570)):
        done = campaign("--plan", "--call", call)
        assert done.returncode == 0, done.stderr
        listed = [line.split()[0] for line in done.stdout.splitlines()[1:-1]]
        assert listed == CALLS[call], done.stdout
        sums[call] = int(done.stdout.splitlines()[-1].split()[1])
        assert sums[call] <= limit, done.stdout
    assert "device call timeout_s 450" in campaign("--plan", "--call", "A").stdout
    bad = campaign("--plan", "--call", "1")
    assert bad.returncode == 2 and "--call takes E, F, A, B, C, D or R" in bad.stderr


# what the smoke run leaves out: stages whose code paths E and F run (bench rows of hopperlm alone, QLoRA's
# rows), so CI pays for each path once
COVERED = {"qlora": "F", "bench-hf-compile": "E", "bench-tinyllama-1.1b": "A", "qlora-compile": "F",
           "bench-h100-350m-mb32": "E"}  # fmt: skip


@pytest.mark.slow
def test_smoke_campaign_runs_every_stage_of_every_call(tmp_path):
    out = tmp_path / "smoke"  # the calls share OUT/work/ (prepared data, the tiny base checkpoint)
    for call, names in CALLS.items():
        names = [n for n in names if n not in COVERED]
        if not names:
            continue
        done = campaign("--smoke", "--call", call, "--only", ",".join(names), str(out))
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
    machine = json.loads((out / "machine.json").read_text())
    assert machine["smoke"] is True and machine["commit_id"] and "commit_source" not in machine

    # E: every row of the plan's step and its levers, 20 steps of real text first (losses side by side)
    step = {r["config"]: r for r in stage(out, "bench-e-step")["rows"]}
    assert list(step) == ["hopperlm", "hopperlm muon", "hopperlm fused", "hopperlm liger", "hopperlm mb32"]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 and r["final_loss"] > 0 for r in step.values())
    assert step["hopperlm fused"]["final_loss"] == pytest.approx(step["hopperlm"]["final_loss"], rel=1e-4)
    assert "kernels compiler" in step["hopperlm liger"]["notes"]  # Liger needs CUDA: the fallback, said
    assert "fused projections" in step["hopperlm fused"]["notes"]
    assert "separate projections" in step["hopperlm"]["notes"]  # auto: off until the GPU measures it
    attention = {r["config"]: r for r in stage(out, "bench-e-attention")["rows"]}
    assert "SDPA math" in " ".join(attention["hopperlm cudnn"]["notes"])  # the CPU's stand-in for a kernel
    assert any(n.startswith("4 documents a row") for n in attention["hopperlm docs"]["notes"])
    owt = {r["config"]: r for r in stage(out, "bench-owt-step")["rows"]}
    assert owt["hopperlm owt-muon"]["grad_accum"] == 2 and "muon" in owt["hopperlm owt-muon"]["notes"]
    levers = owt["hopperlm owt-levers"]  # the race's levers at equal parameters: the same FLOPs per token
    assert levers["error"] is None  # (QK-norm's gains add a few parameters: FLOPs per token within 0.1%)
    assert levers["flops_per_token"] == pytest.approx(owt["hopperlm owt-muon"]["flops_per_token"], rel=1e-3)
    assert list(stage(out, "bench-e-compile")["key"].split("; "))[1].startswith("hopperlm scope-model")

    # F: QLoRA's rows (CPU stand-ins), each case twice in one process, the snapshot is CUDA-only here
    fast = stage(out, "qlora-fast-lean")
    rows = [(r["case"], r["repeat"]) for r in fast["rows"]]
    assert rows == [(c, r) for c in ("hf-qlora", "hopperlm-qlora-compile", "hopperlm-qlora") for r in (1, 2)]
    assert all("error" not in r and r["steps"] == 2 and r["tokens_per_s"] > 0 for r in fast["rows"])
    assert [r["same_process"] for r in fast["rows"]] == [False, True] * 3
    assert fast["rows"][2]["memory_snapshot"] == "CUDA only"
    first = {r["loss_first_last"][0] for r in fast["rows"] if r["repeat"] == 1}
    assert max(first) - min(first) < 1e-3, first  # the same loss on the same tokens, HF's and ours
    assert all(r["stand_in"].startswith("CPU stand-in") for r in fast["rows"])
    fixes = stage(out, "qlora-fixes")["rows"]
    assert [r["case"] for r in fixes] == [
        "hopperlm-qlora-compile-eager-ac",
        "hopperlm-qlora-compile-eager-loss",
    ]
    for r in fast["rows"] + fixes:  # the spread of 2 timed steps, and no graph break in a compiled row
        t, ms = r["tokens_per_s_spread"], r["step_ms_spread"]
        assert t["min"] <= r["tokens_per_s"] == t["median"] <= t["max"]
        assert ms["min"] <= r["step_ms"] == ms["median"] <= ms["max"]
        if "-compile" in r["case"]:
            assert r["compile"]["graph_breaks"] == 0, r
    assert all(any(n.startswith("experiment: ") for n in r["notes"]) for r in fixes)

    rows = {
        r["config"]: r for r in stage(out, "bench-h100-350m")["rows"]
    }  # the hopperlm rows and the baselines
    assert set(rows) == {"eager", "hopperlm", "hf"}, rows.keys()  # float8 is CUDA-only
    assert all(r["tokens_per_s"] > 0 and r["error"] is None for r in rows.values())
    assert json.loads((out / "raw" / "bench-h100-350m" / "bench.json").read_text())["quick"] is True
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


def test_the_race_collector_says_a_failed_time_to_target_and_fails_the_stage(tmp_path):
    from campaign_collect import collect_race

    failed = {
        "failed": "nanochat has failed runs (seeds [1])",
        "ratio_reached": None,
        "ratio_interpolated": None,
    }
    rows = [{"final_val_loss": 3.9}, {"final_val_loss": None}]
    (tmp_path / "race-r.json").write_text(json.dumps({"width": 256, "rows": rows,
                                                      "time_to_target_intervals": {"nanochat": failed}}))  # fmt: skip
    ok, key, _ = collect_race("race-r", tmp_path, "", 0, False)
    assert not ok and "hopperlm to nanochat's loss: none (nanochat has failed runs (seeds [1]))" in key


def test_the_qlora_collector_accepts_exactly_the_cases_asked_for(tmp_path):
    from campaign_collect import collect_qlora
    from qlora import summarize

    def row(case, repeat=1):
        return {
            "case": case,
            "repeat": repeat,
            "tokens_per_s": 100.0,
            "peak_mem_gb": 5.0,
            "peak_timed_gb": 4.0,
        }

    def collect(asked, rows, repeats=1):
        record = {"cases": asked, "repeats": repeats, "rows": rows, "summary": summarize(rows)}
        (tmp_path / "qlora.json").write_text(json.dumps(record))
        return collect_qlora("qlora", tmp_path, "", 0, False)

    asked = ["hopperlm-qlora", "hf-qlora"]
    ok, key, _ = collect(asked, [row(c) for c in asked])
    assert ok and "hopperlm-qlora 100 tok/s, peak 5.00 GB, 1.00x hf-qlora at 1.00x its peak" in key
    assert not collect(asked, [row("hopperlm-qlora")])[0]  # one missing
    assert not collect(asked, [row(c) for c in [*asked, "hf-lora"]])[0]  # one not asked for
    assert not collect(
        asked, [row("hopperlm-qlora"), {"case": "hf-qlora", "repeat": 1, "error": "timed out"}]
    )[0]
    assert not collect([], [])[0]
    twice = [row(c, r) for c in asked for r in (1, 2)]
    ok, key, _ = collect(asked, twice, repeats=2)
    assert ok and "hopperlm-qlora 100 tok/s (x2)" in key
    assert not collect(asked, twice[:3], repeats=2)[0]  # a repeat missing


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

    from hopperlm.config import config_from_dict
    from hopperlm.interop.init_from import resolve_init_from
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
