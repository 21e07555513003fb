"""Round trips that keep everything: `export` -> transformers (tokenizer, generate, chat template) -> `import` ->
`generate` / `eval`, for every kind of tokenizer hopperlm writes; LoRA runs through `merge --format hf` and
`export --peft`."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import finetune_config, save_hf, tiny_hf_model

from hopperlm.cli import main
from hopperlm.config import load_config
from hopperlm.data.chat import chat_encoder
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.data.tokenizer import COMPANION_FILES, load_tokenizer
from hopperlm.eval.gsm8k import chat_template
from hopperlm.train.loop import train

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731
GREEDY = ["--temperature", "0", "--max-new-tokens", "12"]
MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "Apple."},
    {"role": "user", "content": "Another one?"},
]


def cli(capsys, *args: str) -> str:
    """`hopperlm ARGS` in this process; what it printed."""
    capsys.readouterr()
    main([str(a) for a in args])
    return capsys.readouterr().out


def excerpt(source: Path, out: Path, chars: int) -> Path:
    out.write_text(source.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    return out


def hf_greedy(model, tok, prompt: str) -> str:
    """transformers' greedy continuation of prompt (12 new tokens at most), decoded as `generate` prints it."""
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]  # it generated something
    return tok.decode(out[0], skip_special_tokens=True)


def train_tiny(data: Path, run: Path) -> Path:
    """The debug recipe (2 blocks, d=64) for a few steps on a prepared dir."""
    overrides = ["--data.path", str(data), "--run.out_dir", str(run)]
    overrides += ["--train.max_steps", "8", "--train.micro_batch", "4", "--train.log_every", "4"]
    overrides += ["--train.eval_every", "0", "--train.eval_windows", "4"]
    train(load_config(REPO / "configs" / "debug.yaml", overrides), log=QUIET)
    return run


@pytest.fixture(scope="module", params=["byte", "bpe", "unigram", "extended", "hf"])
def kind(request, data_dir, shakespeare_bytes, tinyllama_hf, tmp_path_factory):
    """(model: a run or model folder, held-out data: its prepared dir or a text file, sample text) per kind."""
    tmp = tmp_path_factory.mktemp(request.param)
    english = excerpt(data_dir / "tinyshakespeare" / "input.txt", tmp / "english.txt", 60_000)
    if request.param == "byte":
        return train_tiny(shakespeare_bytes, tmp / "run"), shakespeare_bytes, english.read_text()[:400]
    if request.param == "hf":  # a Hugging Face model (TinyLlama's tokenizer) imported
        model = tmp / "imported"
        main(["import", str(tinyllama_hf), str(model)])
        sample = excerpt(data_dir / "hornmt" / "eng.txt", tmp / "eng.txt", 2000)
        return model, sample, sample.read_text()[:400]
    tokenizer = tmp / "tokenizer"
    if request.param == "extended":  # TinyLlama's tokenizer + Tigrinya pieces
        tigrinya = excerpt(data_dir / "hornmt" / "tir.txt", tmp / "tir.txt", 40_000)
        base = data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
        main(["tokenizer", "extend", str(base), str(tigrinya), "--add", "64", "--out", str(tokenizer)])
        corpus = [english, tigrinya]
        sample = english.read_text()[:200] + tigrinya.read_text()[:200]
    else:
        train_args = ["--kind", request.param, "--vocab-size", "400", "--out", str(tokenizer)]
        main(["tokenizer", "train", str(english), *train_args])
        corpus, sample = [english], english.read_text()[:400]
    data = tmp / "data"
    prepare(
        corpus, data, PrepareOptions(tokenizer=str(tokenizer / "tokenizer.json")), progress=False, log=QUIET
    )
    return train_tiny(data, tmp / "run"), data, sample


def assert_tokenizer_travels_whole(folder: Path, tokenizer_dir: Path) -> list[str]:
    """Every file of the tokenizer in tokenizer_dir (tokenizer.model: what llama.cpp's converter reads) is in
    folder, byte for byte; tokenizer_config.json is rewritten for transformers (hf_tokenizer.py). Their names."""
    names = [n for n in COMPANION_FILES if n != "tokenizer_config.json" and (tokenizer_dir / n).is_file()]
    assert all((folder / n).read_bytes() == (tokenizer_dir / n).read_bytes() for n in names), names
    return names


def test_export_transformers_import_keeps_the_tokenizer_and_the_text(kind, tmp_path, capsys):
    source, data, sample = kind
    ours = load_tokenizer(source / "tokenizer")  # a run's (beside its checkpoints) or a model folder's
    exported = tmp_path / "hf"
    message = cli(capsys, "export", source, exported)
    for name in sorted(p.name for p in exported.iterdir()):
        assert name in message, (name, message)  # the message names every file written
    assert (exported / "tokenizer.json").is_file() and (exported / "tokenizer_config.json").is_file()
    names = assert_tokenizer_travels_whole(exported, source / "tokenizer")
    llama_vocab = ours.id_to_piece(3) == "<0x00>"  # imported and extended: TinyLlama's, byte pieces from id 3
    assert ("tokenizer.model" in names) == llama_vocab  # came through prepare and the run (extended: grown)

    tok = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tok(sample)["input_ids"]
    assert ids == ours.encode_for_model(sample)
    assert tok.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert tok.eos_token_id == ours.eos_id
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).float().eval()
    prompt = sample[:40]
    theirs = hf_greedy(model, tok, prompt)
    assert cli(capsys, "generate", source, "--prompt", prompt, *GREEDY) == theirs + "\n"

    back = tmp_path / "imported"
    cli(capsys, "import", exported, back)
    # hopperlm's own tokenizer comes back (the byte marker, the very tokenizer.json), not a look-alike
    assert load_tokenizer(back / "tokenizer").sha256 == ours.sha256
    assert_tokenizer_travels_whole(back / "tokenizer", source / "tokenizer")
    assert cli(capsys, "generate", back, "--prompt", prompt, *GREEDY) == theirs + "\n"
    losses = []
    for i, model_dir in enumerate((source, back)):
        report = tmp_path / f"eval-{i}.json"
        cli(capsys, "eval", model_dir, "--data", data, "--seq-len", "64", "--windows", "6", "--json", report)
        losses.append(json.loads(report.read_text())["heldout"][0])
    assert abs(losses[0]["loss"] - losses[1]["loss"]) < 1e-5
    assert losses[0]["bits_per_byte"] is not None


@pytest.fixture(scope="module")
def bpe_base(data_dir, tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer is a trained byte-level BPE: tokenizer.json alone, no
    tokenizer_config.json naming its special tokens, no chat template."""
    tmp = tmp_path_factory.mktemp("bpe-base")
    english = excerpt(data_dir / "tinyshakespeare" / "input.txt", tmp / "english.txt", 60_000)
    main(
        [
            "tokenizer",
            "train",
            str(english),
            "--kind",
            "bpe",
            "--vocab-size",
            "512",
            "--out",
            str(tmp / "tok"),
        ]
    )
    eos = load_tokenizer(tmp / "tok").eos_id
    model = tiny_hf_model(
        "tinyllama", vocab_size=512, max_position_embeddings=256, bos_token_id=None, eos_token_id=eos
    )
    base = save_hf(model, tmp / "base")
    shutil.copy(tmp / "tok" / "tokenizer.json", base / "tokenizer.json")
    return base


def lora_run(base: Path, data_dir: Path, run: Path) -> Path:
    args = [
        "--lora.rank",
        "4",
        "--sft.max_examples",
        "24",
        "--train.max_steps",
        "3",
        "--train.log_every",
        "3",
    ]
    train(
        finetune_config(base, data_dir, run, *args, "--train.eval_every", "0", "--optim.lr", "1e-2"),
        log=QUIET,
    )
    return run


def assert_renders_as_hopperlm(folder: Path, run: Path) -> None:
    """transformers' apply_chat_template on `folder` gives the text and ids hopperlm gives for `run`."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(run / "tokenizer")
    template = chat_template(ours)
    for generation_prompt in (False, True):
        text = template.render(MESSAGES, add_generation_prompt=generation_prompt)
        assert (
            tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt) == text
        )
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == chat_encoder(ours).encode(template.render(MESSAGES, add_generation_prompt=True))


def test_merged_export_defines_the_variables_of_the_chat_template(bpe_base, data_dir, tmp_path, capsys):
    run = lora_run(
        bpe_base, data_dir, tmp_path / "run"
    )  # the built-in zephyr template, which reads eos_token
    merged = tmp_path / "merged"
    cli(capsys, "merge", run, merged, "--format", "hf")
    config = json.loads((merged / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "eos_token" in config["chat_template"]
    assert_renders_as_hopperlm(merged, run)


def test_lora_exports_keep_the_template_and_generate_what_hopperlm_generates(
    tinyllama_hf, data_dir, tmp_path, capsys
):
    peft = pytest.importorskip("peft")
    run = lora_run(tinyllama_hf, data_dir, tmp_path / "run")
    cli(capsys, "merge", run, tmp_path / "merged", "--format", "hf")
    assert_renders_as_hopperlm(tmp_path / "merged", run)
    assert (run / "tokenizer" / "tokenizer.model").is_file()  # TinyLlama's, through sft's saved tokenizer
    assert_tokenizer_travels_whole(tmp_path / "merged", run / "tokenizer")

    adapter = tmp_path / "adapter"
    message = cli(capsys, "export", run, adapter, "--peft")
    assert "adapter_config.json" in message and "tokenizer_config.json" in message
    assert_renders_as_hopperlm(adapter, run)  # the run's tokenizer travels with the adapter
    assert_tokenizer_travels_whole(adapter, run / "tokenizer")
    base = transformers.AutoModelForCausalLM.from_pretrained(tinyllama_hf).float().eval()
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    tok = transformers.AutoTokenizer.from_pretrained(adapter)
    prompt = "Give three tips for staying healthy."
    theirs = hf_greedy(model, tok, prompt)
    assert cli(capsys, "generate", run, "--prompt", prompt, *GREEDY) == theirs + "\n"
