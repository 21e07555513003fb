"""`export --format gguf` of models trained on hopperlm's own tokenizers: a byte-level BPE (`prepare --tokenizer
bpe`, `tokenizer train --kind bpe`) as llama.cpp's gpt2 vocabulary with the `gpt-2` pre-tokenizer, and the byte
tokenizer as a gpt2 vocabulary of the 256 byte symbols. Read back with the `gguf` package everywhere; run in
llama.cpp itself (../shared/tools/llama.cpp, or $HOPPERLM_LLAMA_CPP) where it is: `llama-tokenize` gives
hopperlm's ids on the shared text set (bench/llamacpp_texts.py) and `llama-simple`'s greedy continuation is
`hopperlm generate --temperature 0`'s up to a near-tie. Tokenizers llama.cpp cannot run as hopperlm does, and
damaged or missing tokenizer folders, are refused in one line with nothing written. The same runs'
`--format hf` exports tokenize and continue in transformers as hopperlm does."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llamacpp_texts import GREEDY_PROMPT, NEAR_TIE, text_set

from hopperlm.cli import main

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP = Path(os.environ.get("HOPPERLM_LLAMA_CPP") or REPO.parent / "shared" / "tools" / "llama.cpp")
QUIET = ("--log.report", "false", "--log.tensorboard", "false", "--train.eval_every", "0")


def llama_cpp_bin() -> Path:
    """llama.cpp's build/bin, or a skip saying why not (absent, or the binaries do not start here)."""
    bin_dir = LLAMA_CPP / "build" / "bin"
    if not (bin_dir / "llama-tokenize").is_file() or not (bin_dir / "llama-simple").is_file():
        pytest.skip(f"llama.cpp's binaries are not at {bin_dir} (../shared/tools/README.md)")
    try:
        started = subprocess.run([bin_dir / "llama-tokenize", "--help"], capture_output=True).returncode == 0
    except OSError:
        started = False
    if not started:
        pytest.skip(f"{bin_dir / 'llama-tokenize'} does not start on this machine")
    return bin_dir


def corpus(data_dir: Path, where: Path) -> Path:
    """Tiny Shakespeare and Tigrinya, so the BPE learns merges in both scripts."""
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:200_000]
    text += (data_dir / "hornmt" / "tir.txt").read_text()[:60_000]
    (where / "corpus.txt").write_text(text)
    return where / "corpus.txt"


def trained_run(
    data_dir: Path, where: Path, tokenizer: list[str], steps: int = 150, model: tuple[str, ...] = ()
) -> Path:
    """prepare (with `tokenizer`'s options) -> train the debug model (with `model`'s --model.* overrides) `steps`
    steps: a run as a user makes it."""
    where.mkdir(parents=True, exist_ok=True)
    main(["prepare", str(corpus(data_dir, where)), "--out", str(where / "data"), *tokenizer])
    main(["train", str(REPO / "configs" / "debug.yaml"), "--data.path", str(where / "data"),
          "--train.max_steps", str(steps), "--train.log_every", str(steps), "--checkpoint.every", str(steps),
          "--run.out_dir", str(where / "run"), *model, *QUIET])  # fmt: skip
    return where / "run"


# the architectures a model trained here exports as: the --model.* overrides, and llama.cpp's architecture
MODELS = {
    "standard": ((), "llama"),
    "qk_norm": (("--model.qk_norm", "true"), "qwen3"),
    "relu2": (("--model.mlp", "relu2", "--model.ffn_dim", "256"), "arcee"),
}


@pytest.fixture(scope="module")
def bpe_run(data_dir, tmp_path_factory) -> Path:
    return trained_run(
        data_dir, tmp_path_factory.mktemp("bpe"), ["--tokenizer", "bpe", "--vocab-size", "700"]
    )


@pytest.fixture(scope="module")
def byte_run(data_dir, tmp_path_factory) -> Path:
    return trained_run(data_dir, tmp_path_factory.mktemp("byte"), ["--tokenizer", "byte"])


def architecture_run(data_dir: Path, tmp_path_factory, model: str) -> Path:
    """bpe_run's recipe (the same BPE, from scratch) for a model of another architecture (MODELS)."""
    where = tmp_path_factory.mktemp(f"bpe-{model}")
    return trained_run(data_dir, where, ["--tokenizer", "bpe", "--vocab-size", "700"], model=MODELS[model][0])


@pytest.fixture(scope="module")
def bpe_qk_norm_run(data_dir, tmp_path_factory) -> Path:
    return architecture_run(data_dir, tmp_path_factory, "qk_norm")


@pytest.fixture(scope="module")
def bpe_relu2_run(data_dir, tmp_path_factory) -> Path:
    return architecture_run(data_dir, tmp_path_factory, "relu2")


def field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        items = [f.parts[i] for i in f.data]
        return [bytes(p).decode() for p in items] if f.types[-1] == gguf.GGUFValueType.STRING else items
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def export(run: Path, out: Path, *extra: str) -> Path:
    main(["export", str(run), str(out), "--format", "gguf", "--outtype", "f32", *extra])
    return out


def test_bpe_gguf_is_llama_cpp_gpt2_vocabulary_with_gpt2_pre_tokenizer(bpe_run, tmp_path):
    from hopperlm.data.tokenizer import load_tokenizer

    r = gguf.GGUFReader(export(bpe_run, tmp_path / "bpe.gguf"))
    tokenizer = load_tokenizer(bpe_run / "tokenizer")
    data = json.loads((bpe_run / "tokenizer" / "tokenizer.json").read_text())
    assert field(r, "tokenizer.ggml.model") == "gpt2"
    assert field(r, "tokenizer.ggml.pre") == "gpt-2"  # llama.cpp's GPT-2 regex, tokenizers' ByteLevel split
    tokens = field(r, "tokenizer.ggml.tokens")
    vocab_size = field(r, "llama.vocab_size")
    assert len(tokens) == vocab_size >= tokenizer.vocab_size == 700
    assert tokens[:700] == [tokenizer.id_to_piece(i) for i in range(700)]
    assert tokens[700:] == [f"[PAD{i}]" for i in range(700, vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    assert field(r, "tokenizer.ggml.merges") == merges and len(merges) > 300
    types = [int(t[0]) for t in field(r, "tokenizer.ggml.token_type")]
    eos = tokenizer.eos_id
    assert tokens[eos] == "<|endoftext|>" and types[eos] == gguf.TokenType.CONTROL
    assert {types[i] for i in range(700) if i != eos} == {gguf.TokenType.NORMAL}
    assert {types[i] for i in range(700, vocab_size)} <= {gguf.TokenType.UNUSED}
    assert field(r, "tokenizer.ggml.eos_token_id") == eos
    assert field(r, "tokenizer.ggml.bos_token_id") == eos  # none of its own: what precedes every document
    assert field(r, "tokenizer.ggml.add_bos_token") is False  # hopperlm adds nothing before a prompt
    assert tokenizer.encode_for_model("a b") == tokenizer.encode("a b")
    assert [p.name for p in tmp_path.iterdir()] == ["bpe.gguf"]


def test_byte_gguf_is_the_256_byte_symbols_in_byte_order(byte_run, tmp_path):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from hopperlm.interop.gguf_vocab import NEVER_MERGED, byte_level_alphabet

    gpt2 = bytes_to_unicode()  # the reference: GPT-2's own table
    assert byte_level_alphabet() == [gpt2[b] for b in range(256)]
    r = gguf.GGUFReader(export(byte_run, tmp_path / "byte.gguf"))
    tokens = field(r, "tokenizer.ggml.tokens")
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert tokens[:256] == [gpt2[b] for b in range(256)] and tokens[256] == "<|endoftext|>"
    # the one merge never applies: its halves are three symbols long and no merge builds them
    assert field(r, "tokenizer.ggml.merges") == [NEVER_MERGED]
    assert all(len(half) == 3 and half not in tokens for half in NEVER_MERGED.split(" "))
    assert field(r, "tokenizer.ggml.eos_token_id") == 256 == field(r, "tokenizer.ggml.bos_token_id")
    assert field(r, "tokenizer.ggml.add_bos_token") is False


def expect_refusal(args: list[str], message: str, out_dir: Path, capsys) -> str:
    """One `error:` line holding `message`, exit status 2, no traceback, and nothing in out_dir."""
    capsys.readouterr()  # what came before (a fixture's progress bars) is not the export's
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert message in lines[0] and "Traceback" not in err, lines[0]
    assert not out_dir.exists() or list(out_dir.iterdir()) == []
    return lines[0]


def with_tokenizer(model: Path, where: Path, change) -> Path:
    """A copy of the model folder whose tokenizer/ folder `change(folder)` has changed."""
    copy = where / f"model-{change.__name__}"
    shutil.copytree(model, copy)
    change(copy / "tokenizer")
    return copy


@pytest.fixture(scope="module")
def bpe_model(bpe_run, tmp_path_factory) -> Path:
    """The BPE run's model as `export --format hopperlm` writes it: a folder without checksums."""
    out = tmp_path_factory.mktemp("bpe-model") / "model"
    main(["export", str(bpe_run), str(out), "--format", "hopperlm"])
    return out


def test_a_run_with_a_damaged_or_missing_tokenizer_is_one_line_and_writes_nothing(bpe_run, tmp_path, capsys):
    """A checkpoint's tokenizer/ is covered by its checksums: one line naming the file, and the fix it names
    (copy the run's tokenizer/ back) works."""
    run = tmp_path / "run"
    shutil.copytree(bpe_run, run)
    checkpoint_tokenizer = next((run / "checkpoints").iterdir()) / "tokenizer"
    out_dir = tmp_path / "out"
    args = ["export", str(run), str(out_dir / "m.gguf"), "--format", "gguf"]
    (checkpoint_tokenizer / "tokenizer.json").write_text('{"model": ')
    expect_refusal(args, "tokenizer/tokenizer.json does not match its checksum", out_dir, capsys)
    shutil.rmtree(checkpoint_tokenizer)
    expect_refusal(args, "tokenizer/tokenizer.json is missing); nothing to export", out_dir, capsys)
    shutil.copytree(run / "tokenizer", checkpoint_tokenizer)
    main(args)
    assert [p.name for p in out_dir.iterdir()] == ["m.gguf"]


def test_damaged_missing_and_foreign_tokenizers_are_one_line_and_write_nothing(bpe_model, tmp_path, capsys):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import pre_tokenizers

    def missing(folder: Path) -> None:
        shutil.rmtree(folder)

    def damaged(folder: Path) -> None:
        (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')

    def emptied(folder: Path) -> None:
        (folder / "tokenizer.json").unlink()

    def prefix_space(folder: Path) -> None:  # GPT-2's split, but a space put before the text: not gpt-2's
        tok = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.save(str(folder / "tokenizer.json"))

    def digits_split(folder: Path) -> None:
        tok = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()])
        tok.save(str(folder / "tokenizer.json"))

    cases = {
        missing: "is missing: a GGUF file carries the run's tokenizer",
        damaged: "is damaged (",
        emptied: "has no tokenizer.json, tokenizer.model or hopperlm-byte.json",
        prefix_space: 'the pre-tokenizer {"type": "ByteLevel", "add_prefix_space": true',
        digits_split: 'the pre-tokenizer {"type": "Sequence"',
    }
    for change, message in cases.items():
        model = with_tokenizer(bpe_model, tmp_path, change)
        out_dir = tmp_path / f"out-{change.__name__}"
        args = ["export", str(model), str(out_dir / "m.gguf"), "--format", "gguf"]
        line = expect_refusal(args, message, out_dir, capsys)
        if change in (missing, damaged, emptied):  # the fix it names works
            assert "copy the tokenizer/ folder of the run (or of the data it was prepared with) back" in line
            shutil.rmtree(model / "tokenizer", ignore_errors=True)
            shutil.copytree(bpe_model / "tokenizer", model / "tokenizer")
            main(args)
    # the routes the foreign-tokenizer refusal names instead: both run
    model = tmp_path / "model-digits_split"
    main(["export", str(model), str(tmp_path / "as-hopperlm"), "--format", "hopperlm"])
    main(["export", str(model), str(tmp_path / "as-hf"), "--format", "hf"])
    assert (tmp_path / "as-hopperlm" / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "as-hf" / "tokenizer.json").is_file()


def test_a_unigram_tokenizer_is_refused_naming_the_bpe_to_train(bpe_model, data_dir, tmp_path, capsys):
    """`tokenizer train --kind unigram` makes a Unigram model llama.cpp has no tokenizer for; the refusal names
    `tokenizer train --kind bpe`, which the tests above export."""
    from hopperlm.data.tokenizer_train import train_tokenizer

    text = (data_dir / "hornmt" / "tir.txt").read_text()[:60_000].splitlines()
    unigram = train_tokenizer(text, "unigram", 600)

    def replaced(folder: Path) -> None:
        shutil.rmtree(folder)
        unigram.save(folder)

    model = with_tokenizer(bpe_model, tmp_path, replaced)
    out_dir = tmp_path / "out"
    line = expect_refusal(
        ["export", str(model), str(out_dir / "u.gguf"), "--format", "gguf"],
        "has a Unigram model",
        out_dir,
        capsys,
    )
    assert "hopperlm tokenizer train CORPUS --kind bpe" in line  # test_the_tokenizer_train_route_exports


@pytest.mark.slow
def test_the_tokenizer_train_route_exports(data_dir, tmp_path):
    """What the refusals suggest, as a user pastes it: `tokenizer train --kind bpe`, prepare with its
    tokenizer.json, train, and export --format gguf."""
    text = corpus(data_dir, tmp_path)
    main(
        [
            "tokenizer",
            "train",
            str(text),
            "--kind",
            "bpe",
            "--vocab-size",
            "500",
            "--out",
            str(tmp_path / "tok"),
        ]
    )
    run = trained_run(data_dir, tmp_path / "t", ["--tokenizer", str(tmp_path / "tok" / "tokenizer.json")], 2)
    r = gguf.GGUFReader(export(run, tmp_path / "t.gguf"))
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "gpt-2"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "model"), [("bpe", "standard"), ("byte", "standard"), ("bpe", "qk_norm"), ("bpe", "relu2")]
)
def test_llama_cpp_tokenizes_the_text_set_and_continues_as_hopperlm(kind, model, request, data_dir, tmp_path):
    """A model trained from scratch on hopperlm's BPE or byte tokenizer, as llama.cpp's llama, or (on the BPE) a
    QK-norm model as its qwen3 and a ReLU² one as its arcee: llama-tokenize gives hopperlm's ids on the text set,
    and llama-simple's greedy continuation is `hopperlm generate --temperature 0`'s up to a near-tie."""
    from llamacpp_cases import greedy_agrees, hopperlm_greedy, llama_greedy, llama_tokenize_text

    from hopperlm.data.tokenizer import load_tokenizer

    bin_dir = llama_cpp_bin()
    run = request.getfixturevalue(f"{kind}_run" if model == "standard" else f"{kind}_{model}_run")
    out = export(run, tmp_path / f"{kind}-{model}.gguf")
    assert field(gguf.GGUFReader(out), "general.architecture") == MODELS[model][1]
    tokenizer = load_tokenizer(run / "tokenizer")
    differ = {}
    for label, text in text_set(data_dir).items():
        theirs = llama_tokenize_text(bin_dir, out, text, tmp_path / "text.txt")
        if theirs != tokenizer.encode(text):
            differ[label] = (theirs, tokenizer.encode(text))
    assert differ == {}
    ours = hopperlm_greedy(run, GREEDY_PROMPT, 16)
    theirs = llama_greedy(bin_dir, out, GREEDY_PROMPT, 16)
    assert ours.strip(), "the toy model should continue with text, not just newlines"
    assert greedy_agrees(run, GREEDY_PROMPT, theirs, ours, NEAR_TIE), (theirs, ours)


@pytest.mark.slow
def test_owt_350m_route_at_toy_size_prepare_train_export_and_ollama_files(data_dir, tmp_path):
    """owt-350m's tokenizer kind (a byte-level BPE trained by prepare, there at 32K) at toy size, as a user runs
    it: prepare --tokenizer bpe, train, then the Ollama route (`--outtype q4_k_m --modelfile`): with no
    llama-quantize on PATH an f16 GGUF Ollama quantizes and a Modelfile FROM it, stopping at <|endoftext|>."""
    cmd = [sys.executable, "-m", "hopperlm"]
    env = {**os.environ, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no llama-quantize on PATH

    def hopperlm(*args) -> str:
        done = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, cwd=REPO, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout + done.stderr

    # OpenWebText is many documents (--split docs needs them): the corpus's paragraphs as JSON lines
    documents = corpus(data_dir, tmp_path).read_text().split("\n\n")
    jsonl = tmp_path / "owt-toy.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents if d.strip()))
    hopperlm("prepare", jsonl, "--out", tmp_path / "owt-toy", "--tokenizer", "bpe", "--vocab-size", "1000",
             "--split", "docs")  # fmt: skip
    hopperlm("train", REPO / "configs" / "debug.yaml", "--data.path", tmp_path / "owt-toy", "--train.max_steps",
             "3", "--run.out_dir", tmp_path / "run", *QUIET)  # fmt: skip
    said = hopperlm("export", tmp_path / "run", tmp_path / "ollama" / "owt-toy.gguf", "--format", "gguf",
                    "--outtype", "q4_k_m", "--modelfile")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "ollama").iterdir()) == ["Modelfile", "owt-toy.gguf"]
    r = gguf.GGUFReader(tmp_path / "ollama" / "owt-toy.gguf")
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert len(field(r, "tokenizer.ggml.merges")) > 500
    modelfile = (tmp_path / "ollama" / "Modelfile").read_text()
    assert "FROM ./owt-toy.gguf" in modelfile or "FROM owt-toy.gguf" in modelfile, modelfile
    assert 'PARAMETER stop "<|endoftext|>"' in modelfile and "TEMPLATE" not in modelfile, modelfile
    assert "ollama create owt-toy -q q4_K_M" in said


# ---- what a refused architecture suggests instead --------------------------------------------------------
def qwen2_import(where: Path, tokenizer_files: list[Path], vocab_size: int) -> Path:
    """A tiny Qwen2 (attention biases: no architecture GGUF export writes) imported with these tokenizer files."""
    from hf_tiny import tiny_hf_model

    from hopperlm.interop.hf_convert import import_hf

    hub = where / "hub"
    tiny_hf_model("qwen2", vocab_size=vocab_size, max_position_embeddings=128).save_pretrained(hub)
    for file in tokenizer_files:
        shutil.copy(file, hub / file.name)
    return import_hf(hub, where / "imported", log=lambda line: None)


def converter_or_skip() -> Path:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py is not at {LLAMA_CPP} (../shared/tools/README.md)")
    return LLAMA_CPP


@pytest.mark.slow
def test_a_refused_architecture_suggests_the_converter_only_where_it_converts(
    bpe_model, data_dir, tmp_path, capsys
):
    """With a SentencePiece tokenizer the refusal suggests `--format hf` + convert_hf_to_gguf.py, and that
    converts; with a tokenizer trained here it suggests --format hopperlm, which runs, and not the converter,
    which stops (its NotImplementedError: no hash for this vocabulary)."""
    from llamacpp_cases import convert_hf_to_gguf

    tinyllama = data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
    sp_files = [tinyllama / name for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")]
    routes = {
        "sentencepiece": (qwen2_import(tmp_path / "sp", sp_files, 32000), "convert_hf_to_gguf.py"),
        "bpe": (
            qwen2_import(tmp_path / "bpe", [bpe_model / "tokenizer" / "tokenizer.json"], 768),
            "--format hopperlm",
        ),
    }
    for name, (model, suggestion) in routes.items():
        out_dir = tmp_path / f"out-{name}"
        args = ["export", str(model), str(out_dir / "q.gguf"), "--format", "gguf"]
        line = expect_refusal(args, "no attention biases (a Qwen2-family model)", out_dir, capsys)
        assert suggestion in line and ("export it with --format hf" in line) == (name == "sentencepiece"), (
            line
        )
        main(["export", str(model), str(tmp_path / f"{name}-hf"), "--format", "hf"])
    main(["export", str(routes["bpe"][0]), str(tmp_path / "bpe-kept"), "--format", "hopperlm"])
    source = converter_or_skip()
    converted = convert_hf_to_gguf(source, tmp_path / "sentencepiece-hf", tmp_path / "sp.gguf")
    assert field(gguf.GGUFReader(converted), "general.architecture") == "qwen2"
    with pytest.raises(RuntimeError, match="BPE pre-tokenizer was not recognized"):
        convert_hf_to_gguf(source, tmp_path / "bpe-hf", tmp_path / "bpe.gguf")


# ---- the same models in transformers (the docs table's transformers column) -------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_the_hf_export_tokenizes_the_text_set_and_continues_as_hopperlm(kind, request, data_dir, tmp_path):
    """`export --format hf` of a run trained on hopperlm's BPE or byte tokenizer: AutoTokenizer gives hopperlm's
    ids on the text set, and AutoModelForCausalLM's greedy tokens are `hopperlm generate --temperature 0`'s."""
    import torch
    from llamacpp_cases import hopperlm_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hopperlm.data.tokenizer import load_tokenizer

    run = request.getfixturevalue(f"{kind}_run")
    main(["export", str(run), str(tmp_path / "hf")])
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_tokenizer(run / "tokenizer")
    texts = text_set(data_dir)
    assert {k: t for k, t in texts.items() if theirs(t)["input_ids"] != ours.encode_for_model(t)} == {}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    inputs = theirs(GREEDY_PROMPT, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=16, min_new_tokens=16)[0]
    text = theirs.decode(out[inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == hopperlm_greedy(run, GREEDY_PROMPT, 16)
