"""Instruction data: formats, the tokenizer's chat template as transformers renders it, loss only on replies,
packing without cross-example attention, a tiny fine-tune that learns, and QLoRA's clear refusal on a CPU."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_tiny import finetune_config

from hopperlm.data.chat import chat_encoder, choose_template
from hopperlm.data.sft import Rows, detect_format, read_records, to_example, tokenize
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.errors import DataError
from hopperlm.model.loss import IGNORE_INDEX
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731


@pytest.fixture(scope="module")
def chat_tok(data_dir):
    tok = load_tokenizer(data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json")
    return chat_encoder(tok), choose_template("auto", tok.config, "</s>", "<s>")


def test_every_format_becomes_a_conversation(data_dir, tmp_path):
    alpaca = read_records(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json")
    assert len(alpaca) == 999 and detect_format(alpaca[0][1], "") == "alpaca"
    code = read_records(data_dir / "code_alpaca_2k" / "code_alpaca_2k.json")
    with_input = next(r for _, r in code if r["input"])
    ex = to_example(with_input, "alpaca", None, "x")
    assert ex.messages[0]["content"] == with_input["instruction"] + "\n\n" + with_input["input"]
    chats = read_records(data_dir / "fastchat_dummy_conversation" / "dummy_conversation.json")
    ex = to_example(chats[0][1], detect_format(chats[0][1], ""), "Be brief.", "x")
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant", "user", "assistant"]
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
        + json.dumps({"prompt": "2+2=", "completion": "4"})
        + "\n"
    )
    (_, m), (_, c) = read_records(tmp_path / "m.jsonl")
    assert detect_format(m, "") == "messages" and detect_format(c, "") == "completion"
    with pytest.raises(DataError, match="no assistant reply"):
        to_example({"messages": [{"role": "user", "content": "hi"}]}, "messages", None, "f:3")
    with pytest.raises(DataError, match="cannot tell the format"):
        detect_format({"question": "?"}, "f:1")


def test_template_matches_transformers_and_only_replies_are_learned(chat_tok, data_dir):
    transformers = pytest.importorskip("transformers")
    tok, template = chat_tok
    hf_tok = transformers.AutoTokenizer.from_pretrained(data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0")
    record = read_records(data_dir / "fastchat_dummy_conversation" / "dummy_conversation.json")[0][1]
    ex = to_example(record, "sharegpt", "You are helpful.", "x")
    ids, labels = tokenize(ex, tok, template, train_on_prompt=False)
    assert ids.tolist() == hf_tok.apply_chat_template(ex.messages, tokenize=True, return_dict=False)
    learned = [tok.decode([t]) for t in ids[labels != IGNORE_INDEX]]
    replies = [m["content"] for m in ex.messages if m["role"] == "assistant"]
    text = tok._tok.decode(ids[labels != IGNORE_INDEX].tolist(), skip_special_tokens=False)
    assert text.replace(" ", "") == "".join(r + "</s>" for r in replies).replace(" ", "")
    assert learned and (labels == IGNORE_INDEX).sum() > len(ids) // 3  # the prompt is masked
    assert labels[-1] == IGNORE_INDEX  # the newline after the last EOS: inference stops at EOS
    # every turn ends with EOS in this template; only the replies' EOS are learned
    assert labels[np.flatnonzero(ids == 2)].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 2, IGNORE_INDEX, 2]


def test_packed_examples_never_see_each_other(chat_tok):
    from hopperlm.config import ModelConfig
    from hopperlm.model.transformer import build_model

    tok, template = chat_tok
    examples = [
        tokenize(to_example({"instruction": q, "output": a}, "alpaca", None, "x"), tok, template, False)
        for q, a in [("Name a fruit.", "Apple."), ("What is 2+2?", "Four."), ("Say hi.", "Hi!")]
    ]
    rows = Rows(examples, seq_len=96, packing=True, pad_id=tok.eos_id)
    plan = rows.plan([0, 1, 2])
    assert plan == [[0, 1, 2]]
    batch = rows.batch(plan)
    assert batch.doc_ids[0].unique().tolist() == [0, 1, 2, 3]  # 3 examples + padding
    model = build_model(
        ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=32000, max_seq_len=128), seed=0
    ).eval()
    with torch.no_grad():
        packed = model(batch.x, doc_ids=batch.doc_ids)[0]
        alone = model(torch.from_numpy(examples[1][0][:-1])[None])[0]  # example 1 by itself, from position 0
    start = len(examples[0][0]) - 1
    torch.testing.assert_close(packed[start : start + len(alone)], alone, rtol=1e-5, atol=1e-5)
    used = sum(len(ids) - 1 for ids, _ in examples)
    assert (batch.y[0, used:] == IGNORE_INDEX).all() and (batch.doc_ids[0, used:] == 3).all()  # padding


def sft_config(tinyllama_hf, data_dir, run_dir, *extra):
    args = [
        "--sft.max_examples",
        "300",
        "--optim.lr",
        "1e-2",
        "--schedule.warmup_steps",
        "3",
        "--train.eval_windows",
        "8",
    ]
    return finetune_config(tinyllama_hf, data_dir, run_dir, *args, *extra)


def test_tiny_sft_run_learns_replies(tinyllama_hf, data_dir, tmp_path):
    lines = []
    run = tmp_path / "run"
    args = ["--train.max_steps", "12", "--train.log_every", "4", "--train.eval_every", "0"]
    result = train(sft_config(tinyllama_hf, data_dir, run, *args), log=lines.append)
    records = read_metrics(run / "metrics.jsonl")
    assert records[0]["loss"] > 10.0  # about ln(32000) = 10.4 at the start
    assert records[-1]["val_loss"] < records[0]["loss"] - 1.0, records  # held-out replies got likelier
    summary = next(line for line in lines if line.startswith("sft:"))
    assert "template tokenizer's own" in summary
    in_loss = int(summary.split("% of tokens in the loss")[0].rsplit(" ", 1)[1])
    assert 30 < in_loss < 90  # the prompts (instruction, template markers) are masked, the replies are not
    assert any("instruction examples from" in line for line in lines)  # the plan's data line
    assert result.step == 12
    saved = json.loads((run / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["chat_template"].startswith("{% for message in messages %}")


def test_builtin_template_is_saved_for_inference(tinyllama_hf, data_dir, tmp_path):
    from hopperlm.data.chat import BUILTIN
    from hopperlm.data.sft import open_sft_data
    from hopperlm.interop.inference import sft_tokenizer_path

    cfg = sft_config(
        tinyllama_hf, data_dir, tmp_path / "r", "--sft.template", "alpaca", "--sft.max_examples", "20"
    )
    data = open_sft_data(
        cfg.sft, cfg.train, tmp_path / "r", QUIET, tokenizer_path=sft_tokenizer_path(cfg.sft, cfg.model)
    )
    saved = json.loads((tmp_path / "r" / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == BUILTIN["alpaca"] and data.datasets[0].manifest["vocab_size"] == 32000


def test_qlora_on_cpu_fails_fast_with_one_line(tinyllama_hf, data_dir, tmp_path):
    result = subprocess.run(
        [
            sys.executable, "-m", "hopperlm", "finetune", str(REPO / "configs" / "debug.yaml"),
            "--model.preset", "null", "--model.init_from", str(tinyllama_hf),
            "--sft.path", str(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json"),
            "--lora.rank", "8", "--lora.quantize", "nf4", "--train.device", "cpu",
            "--run.out_dir", str(tmp_path / "q"),
        ],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: lora.quantize=nf4 (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit training path); "
        "on this CPU use lora.quantize none (LoRA on the full-precision base)"
    ]
    assert not (tmp_path / "q" / "checkpoints").exists()


def test_finetune_resume_auto_starts_then_continues(tinyllama_hf, data_dir, tmp_path):
    from hopperlm.cli import main

    run = tmp_path / "auto"
    args = [
        "finetune", str(REPO / "configs" / "debug.yaml"),
        "--model.preset", "null", "--model.init_from", str(tinyllama_hf),
        "--sft.path", str(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json"), "--sft.max_examples", "40",
        "--train.seq_len", "128", "--train.micro_batch", "2", "--train.eval_windows", "2",
        "--train.log_every", "1", "--run.out_dir", str(run), "--resume", "auto",
    ]  # fmt: skip
    main([*args, "--train.max_steps", "2"])  # nothing to resume: starts (`auto` is not a path)
    main([*args, "--train.max_steps", "4"])  # a requeued job: continues from step 2
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4]


def test_examples_cut_short_above_a_fifth_are_a_warning_naming_the_fix(tinyllama_hf, data_dir, tmp_path):
    """At seq_len 32 most alpaca examples are cut: the log says so as a warning, with the longest example and
    train.seq_len, where 20% or fewer cut is the plan line's statistic only."""
    from hopperlm.data.sft import open_sft_data
    from hopperlm.interop.inference import sft_tokenizer_path

    for seq_len, warned in (("32", True), ("512", False)):
        cfg = sft_config(
            tinyllama_hf, data_dir, tmp_path / seq_len, "--sft.max_examples", "20", "--train.seq_len", seq_len
        )
        lines = []
        open_sft_data(
            cfg.sft,
            cfg.train,
            tmp_path / seq_len,
            lines.append,
            tokenizer_path=sft_tokenizer_path(cfg.sft, cfg.model),
        )
        warning = [x for x in lines if x.startswith("warning: ")]
        assert bool(warning) == warned, lines
        plan = [x for x in lines if x.startswith("sft: ")]  # the statistic in the warning's own words
        assert len(plan) == 1 and f" cut short at train.seq_len {seq_len}, " in plan[0], plan
        if warned:
            assert "of the examples were cut short at train.seq_len 32 (the longest, " in warning[0]
            assert "raise --train.seq_len" in warning[0] and len(warning) == 1
