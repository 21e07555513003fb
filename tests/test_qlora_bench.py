"""bench/gpu/qlora.py's honesty on the CPU: the same next-token targets on both sides, the per-step spread, the
memory snapshot's summary (fed a made-up snapshot in torch's format), and a --smoke run of the compiled QLoRA
row and the experiments beside it (tests/test_gpu_campaign.py runs the campaign's own stages)."""

import json
from pathlib import Path

import pytest
import qlora  # bench/gpu is on pytest's pythonpath (pyproject.toml)
import qlora_rows
import torch

from hopperlm.observe.memory_snapshot import BEFORE, summarize_snapshot

REPO = Path(__file__).resolve().parents[1]


def test_hopperlm_and_transformers_learn_the_same_next_tokens():
    """hopperlm's y is x shifted left by one (the last position ignored): its loss on any logits equals
    transformers' causal-LM loss with labels=input_ids, which shifts inside."""
    from hopperlm.model.loss import IGNORE_INDEX, standard_cross_entropy

    tokens = qlora_rows.random_tokens(50, 9)
    batch = qlora_rows.next_token_batch(tokens)
    assert torch.equal(batch.x, tokens)
    assert torch.equal(batch.y[:, :-1], tokens[:, 1:]) and (batch.y[:, -1] == IGNORE_INDEX).all()
    assert torch.equal(tokens, qlora_rows.random_tokens(50, 9))  # one draw for every row

    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    logits = torch.randn(1, 9, 50)
    theirs = loss_utils.ForCausalLMLoss(logits, tokens, vocab_size=50)
    torch.testing.assert_close(standard_cross_entropy(logits, batch.y), theirs)


def test_spread_and_the_per_case_summary_use_the_medians():
    assert qlora.spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}

    def row(case, repeat, tokens, peak):
        return {
            "case": case,
            "repeat": repeat,
            "tokens_per_s": tokens,
            "peak_mem_gb": peak,
            "peak_timed_gb": peak,
        }

    rows = [
        row("hopperlm-qlora-compile", 1, 900.0, 7.0),
        row("hf-qlora", 1, 400.0, 6.0),
        row("hopperlm-qlora-compile", 2, 1000.0, 7.5),
        row("hf-qlora", 2, 600.0, 5.0),
        {"case": "hopperlm-qlora", "repeat": 1, "error": "timed out"},
    ]
    by = {s["case"]: s for s in qlora.summarize(rows)}
    compiled = by["hopperlm-qlora-compile"]
    assert compiled["tokens_per_s"] == 950.0 and compiled["peak_mem_gb"] == 7.5
    assert compiled["vs"] == "hf-qlora" and compiled["tokens_ratio"] == 950.0 / 500.0
    assert compiled["peak_ratio"] == 7.5 / 6.0
    assert by["hopperlm-qlora"] == {"case": "hopperlm-qlora", "repeats": 0}
    assert "no finished repeat" in "\n".join(qlora.table(rows[-1:], qlora.summarize(rows)))


def frames(*paths: str) -> list[dict]:
    return [{"filename": p.split(":")[0], "line": int(p.split(":")[1]), "name": "f"} for p in paths]


LORA = frames(
    "/env/site-packages/torch/_ops.py:1", "/work/main/hopperlm/model/lora.py:105", "/work/x/step.py:9"
)
BNB = frames("/env/site-packages/bitsandbytes/functional.py:7", "/env/site-packages/torch/_ops.py:1")


def synthetic_snapshot() -> dict:
    """W (100 B) and X (70 B) allocated before the recording; A and D (LoRA), B, C (bitsandbytes) during it;
    the peak is right after C: 170 + 300 + 100 + 50 + 200 = 820 bytes. W and B are alive at the snapshot."""
    blocks = [
        {"address": 0x1000, "size": 100, "state": "active_allocated", "frames": []},
        {"address": 0x2000, "size": 50, "state": "active_allocated", "frames": BNB[1:]},
        {"address": 0x3000, "size": 999, "state": "inactive", "frames": []},  # cached, not allocated
    ]
    trace = [
        ("alloc", 0x4000, 300, LORA),
        ("alloc", 0x7000, 100, LORA),
        ("alloc", 0x2000, 50, BNB[1:]),
        ("alloc", 0x5000, 200, BNB),
        ("free_requested", 0x4000, 300, LORA),
        ("free_completed", 0x4000, 300, LORA),
        ("segment_alloc", 0x9000, 4096, []),
        ("free_requested", 0x7000, 100, LORA),
        ("free_requested", 0x5000, 200, BNB),
        ("free_requested", 0x6000, 70, []),  # X, allocated before the recording
        ("alloc", 0x4000, 10, LORA),  # an address used again
        ("free_requested", 0x4000, 10, LORA),
    ]
    events = [{"action": a, "addr": addr, "size": size, "frames": f} for a, addr, size, f in trace]
    return {"segments": [{"device": 0, "address": 0x1000, "blocks": blocks}], "device_traces": [events]}


def test_the_snapshot_summary_finds_what_is_alive_at_the_peak():
    s = summarize_snapshot(synthetic_snapshot())
    assert (s["peak_bytes"], s["start_bytes"], s["end_bytes"]) == (820, 170, 150)
    assert s["peak_event"] == 3  # the fourth alloc/free event
    top = s["top"]
    assert [(g["bytes"], g["count"], g["largest"]) for g in top] == [
        (400, 2, 300),
        (200, 1, 200),
        (170, 2, 100),
        (50, 1, 50),
    ]
    # torch's own frames are skipped: the first frame is the one a reader can act on
    assert top[0]["stack"] == ["hopperlm/model/lora.py:105 f", "work/x/step.py:9 f"]
    assert top[1]["stack"] == ["bitsandbytes/functional.py:7 f"]
    assert top[2]["stack"] == [BEFORE]
    assert top[3]["stack"] == ["torch/_ops.py:1 f"]  # only torch's frames: they are shown
    assert s["by_origin"] == {
        "hopperlm/model/lora.py": 400,
        "bitsandbytes/functional.py": 200,
        BEFORE: 170,
        "torch": 50,
    }
    assert summarize_snapshot(synthetic_snapshot(), top=2)["other_bytes"] == 220
    json.dumps(s)  # goes into the row as it is

    # a trace with only free_completed (older torch) gives the same peak
    snap = synthetic_snapshot()
    snap["device_traces"][0] = [
        {**e, "action": "free_completed"} if e["action"] == "free_requested" else e
        for e in snap["device_traces"][0]
        if e["action"] != "free_completed"
    ]
    assert summarize_snapshot(snap)["peak_bytes"] == 820


BUDGET = "hopperlm-qlora-compile-budget"


def test_the_experiments_change_what_they_say_and_fail_loudly_otherwise():
    import torch._functorch.config as functorch_config

    with qlora_rows.experiment_config(BUDGET):
        assert functorch_config.activation_memory_budget == 0.5
    assert functorch_config.activation_memory_budget == 1.0
    # a compile experiment whose hook was never called (the step built without hopperlm.speed.apply_compile)
    # is an error, never a silent measurement of the unchanged compile
    with (
        pytest.raises(RuntimeError, match="did not call"),
        qlora_rows.compile_experiment("hopperlm-qlora-compile-eager-ac"),
    ):
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recording_a_cuda_allocation_names_this_file():
    from hopperlm.observe.memory_snapshot import recording, take_snapshot

    with recording():
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB
        del x
        snap = take_snapshot()
    s = summarize_snapshot(snap)
    assert s["peak_bytes"] - s["start_bytes"] >= 64 << 20
    assert any("test_qlora_bench.py" in line for line in s["top"][0]["stack"]), s["top"][0]
