"""`hopperlm export --format gguf`: the file read back with the `gguf` package (llama.cpp's own reader and writer)
holds the Llama architecture's keys, SentencePiece's vocabulary with its scores and types, and every tensor
under llama.cpp's name with the shape and values llama.cpp's converter writes (queries and keys permuted to
interleaved RoPE pairs exactly as convert_hf_to_gguf.py's LlamaModel.permute does); a ReLU² model as llama.cpp's
arcee, a QK-norm one as its qwen3 (attn_q_norm/attn_k_norm, no permutation: NEOX RoPE), byte for byte what
llama.cpp's own converter writes from the `export`ed folder where its source is unpacked. llama.cpp itself runs
the files in bench/llamacpp_check.py (where its binaries are built). k-quants go through llama.cpp's llama-quantize
(refused in one line, before anything is written, where there is none, except for Ollama: an f16 file that
`ollama create -q q4_K_M` quantizes), and `--modelfile`'s Ollama TEMPLATE is
rendered here with a reader of the Go-template actions it writes and compared with transformers' rendering of
the run's chat template."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from go_template import go_render

from hopperlm.cli import main

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def hub_llama(data_dir, tmp_path_factory) -> Path:
    """A tiny random Llama saved like a Hub folder with all of TinyLlama's tokenizer files."""
    from hf_tiny import tiny_hf_model

    out = tmp_path_factory.mktemp("gguf") / "hub"
    tiny_hf_model("tinyllama", vocab_size=32000, max_position_embeddings=512).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / name, out / name)
    return out


@pytest.fixture(scope="module")
def imported(hub_llama) -> Path:
    from hopperlm.interop.hf_convert import import_hf

    return import_hf(hub_llama, hub_llama.parent / "imported", log=lambda line: None)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it (the reference, not our code)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def field(reader, key):
    f = reader.fields[key]
    if len(f.data) == 1:
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]
    return [f.parts[i] for i in f.data]


def test_f32_gguf_holds_the_architecture_vocabulary_and_llama_cpp_tensors(hub_llama, imported, tmp_path):
    import sentencepiece
    import transformers

    from hopperlm.interop.gguf import export_gguf

    out = export_gguf(imported, tmp_path / "tiny.gguf", "f32", log=lambda line: None)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # nothing left beside it
    r = gguf.GGUFReader(out)
    assert field(r, "general.architecture") == "llama"
    assert field(r, "llama.block_count") == 2 and field(r, "llama.embedding_length") == 64
    assert field(r, "llama.attention.head_count") == 4 and field(r, "llama.attention.head_count_kv") == 2
    assert field(r, "llama.rope.dimension_count") == 16 and field(r, "llama.feed_forward_length") == 96
    assert field(r, "tokenizer.ggml.model") == "llama"
    sp = sentencepiece.SentencePieceProcessor(model_file=str(hub_llama / "tokenizer.model"))
    tokens = [bytes(t).decode() for t in field(r, "tokenizer.ggml.tokens")]
    assert tokens == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    scores = [float(s[0]) for s in field(r, "tokenizer.ggml.scores")]
    assert scores == pytest.approx([sp.get_score(i) for i in range(sp.vocab_size())])
    types = [int(t[0]) for t in field(r, "tokenizer.ggml.token_type")]
    assert types[0] == gguf.TokenType.UNKNOWN and types[1] == types[2] == gguf.TokenType.CONTROL
    assert types[3] == gguf.TokenType.BYTE and types[1000] == gguf.TokenType.NORMAL
    assert field(r, "tokenizer.ggml.bos_token_id") == 1 and field(r, "tokenizer.ggml.eos_token_id") == 2
    assert "<|assistant|>" in field(r, "tokenizer.chat_template")

    hf = transformers.AutoModelForCausalLM.from_pretrained(hub_llama).state_dict()
    tensors = {t.name: t for t in r.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight"
        for i in range(2)
        for n in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    assert set(tensors) == expected

    def data(name):  # the reader's shape is GGML's (reversed); the values in row-major order are torch's
        t = tensors[name]
        return np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))

    np.testing.assert_array_equal(data("token_embd.weight"), hf["model.embed_tokens.weight"].numpy())
    q, k = (
        hf["model.layers.1.self_attn.q_proj.weight"].numpy(),
        hf["model.layers.1.self_attn.k_proj.weight"].numpy(),
    )
    np.testing.assert_array_equal(data("blk.1.attn_q.weight"), llama_cpp_permute(q, 4))
    np.testing.assert_array_equal(data("blk.1.attn_k.weight"), llama_cpp_permute(k, 2))
    np.testing.assert_array_equal(
        data("blk.0.ffn_gate.weight"), hf["model.layers.0.mlp.gate_proj.weight"].numpy()
    )
    np.testing.assert_array_equal(data("output_norm.weight"), hf["model.norm.weight"].numpy())


def imported_family(family: str, where: Path, data_dir: Path, **overrides) -> tuple[Path, dict]:
    """A tiny random `family` model (tests/hf_tiny.py) saved like a Hub folder with TinyLlama's tokenizer files,
    and `hopperlm import`ed: (the imported folder, the Hugging Face state dict)."""
    from hf_tiny import save_hf, tiny_hf_model

    from hopperlm.interop.hf_convert import import_hf

    model = tiny_hf_model(family, vocab_size=32000, max_position_embeddings=512, **overrides)
    tokenizer = data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
    hub = save_hf(model, where / f"{family}-hub", tokenizer_from=tokenizer)
    return import_hf(hub, where / family, log=lambda line: None), model.state_dict()


@pytest.mark.parametrize("family", ["arcee", "qwen3"])
def test_relu2_is_llama_cpp_arcee_and_qk_norm_its_qwen3(family, data_dir, tmp_path):
    """A ReLU² model (Arcee) is llama.cpp's arcee architecture: no ffn_gate, queries and keys permuted to
    interleaved RoPE pairs as convert_hf_to_gguf.py's ArceeModel(LlamaModel) does. A QK-norm model (Qwen3) is
    its qwen3: attn_q_norm / attn_k_norm per head, queries and keys as stored (llama.cpp's qwen3 rotates halves,
    NEOX, and Qwen3Model does not permute). Every tensor name is one gguf-py lists for the architecture."""
    from hopperlm.interop.gguf import export_gguf

    source, hf = imported_family(family, tmp_path, data_dir)
    out = export_gguf(source, tmp_path / f"{family}.gguf", "f32", log=lambda line: None)
    r = gguf.GGUFReader(out)
    assert field(r, "general.architecture") == family and field(r, "tokenizer.ggml.model") == "llama"
    keys = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 16, "rope.dimension_count": 16}  # fmt: skip
    assert {key: field(r, f"{family}.{key}") for key in keys} == keys
    eps = field(r, f"{family}.attention.layer_norm_rms_epsilon")
    assert eps == pytest.approx(1e-6 if family == "qwen3" else 1e-5)

    tensors = {t.name: t for t in r.tensors}
    block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
    block += ["attn_q_norm", "attn_k_norm", "ffn_gate"] if family == "qwen3" else []
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    assert set(tensors) == expected | {f"blk.{i}.{n}.weight" for i in range(2) for n in block}
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family)
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch] for i in range(2)}
    assert {name.removesuffix(".weight") for name in tensors} <= known  # llama.cpp's names for `family`

    def data(name):  # the reader's shape is GGML's (reversed); the values in row-major order are torch's
        t = tensors[name]
        return np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))

    q = hf["model.layers.1.self_attn.q_proj.weight"].numpy()
    k = hf["model.layers.1.self_attn.k_proj.weight"].numpy()
    if family == "arcee":
        np.testing.assert_array_equal(data("blk.1.attn_q.weight"), llama_cpp_permute(q, 4))
        np.testing.assert_array_equal(data("blk.1.attn_k.weight"), llama_cpp_permute(k, 2))
    else:
        np.testing.assert_array_equal(data("blk.1.attn_q.weight"), q)
        np.testing.assert_array_equal(data("blk.1.attn_k.weight"), k)
        for n in ("q", "k"):
            ours = data(f"blk.1.attn_{n}_norm.weight")
            np.testing.assert_array_equal(ours, hf[f"model.layers.1.self_attn.{n}_norm.weight"].numpy())
            assert tensors[f"blk.1.attn_{n}_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    for n in ("up", "down"):
        np.testing.assert_array_equal(
            data(f"blk.0.ffn_{n}.weight"), hf[f"model.layers.0.mlp.{n}_proj.weight"]
        )


def test_transformers_gguf_loader_reads_the_qwen3_file_with_its_logits(data_dir, tmp_path):
    """Another program's reader: transformers' own GGUF loader (`from_pretrained(gguf_file=)`, which maps
    llama.cpp's qwen3 names and keys back) gives the logits of the Qwen3 model the file was exported from. (Its
    qwen3 mapping reads no head size and takes Qwen3's 128, so this model's heads are 128 wide.)"""
    import torch
    import transformers

    from hopperlm.interop.gguf import export_gguf

    shape = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
    source, hf = imported_family("qwen3", tmp_path, data_dir, **shape)
    export_gguf(source, tmp_path / "qwen3.gguf", "f32", log=lambda line: None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3-hub").eval()
    read = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="qwen3.gguf", dtype=torch.float32
    ).eval()
    x = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(read(x).logits, theirs(x).logits, rtol=1e-5, atol=1e-5)


def test_q8_0_and_f16_keep_norms_in_f32_and_stay_close(imported, tmp_path):
    from hopperlm.interop.gguf import export_gguf

    f32 = gguf.GGUFReader(export_gguf(imported, tmp_path / "f32.gguf", "f32", log=lambda line: None))
    for outtype, matrix_type, tolerance in (
        ("q8_0", gguf.GGMLQuantizationType.Q8_0, 0.01),
        ("f16", gguf.GGMLQuantizationType.F16, 1e-3),
    ):
        r = gguf.GGUFReader(
            export_gguf(imported, tmp_path / f"{outtype}.gguf", outtype, log=lambda line: None)
        )
        by = {t.name: t for t in r.tensors}
        assert by["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert by["blk.0.attn_q.weight"].tensor_type == matrix_type
        for t in f32.tensors:  # every tensor dequantizes to within the outtype's rounding
            ref = np.asarray(t.data, dtype=np.float32).ravel()
            got = gguf.dequantize(by[t.name].data, by[t.name].tensor_type).ravel()
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tolerance, (outtype, t.name)


@pytest.mark.slow
def test_a_lora_run_exports_merged_with_its_whole_tokenizer(hub_llama, data_dir, tmp_path):
    """A LoRA fine-tune of the Hub folder: the GGUF holds the merged weights (as `merge` writes them) and
    the SentencePiece vocabulary the run was trained with."""
    from hf_tiny import finetune_config

    from hopperlm.interop.gguf import export_gguf
    from hopperlm.interop.hf_convert import save_merged
    from hopperlm.train.loop import train

    extra = [
        "--lora.rank",
        "4",
        "--sft.max_examples",
        "16",
        "--train.max_steps",
        "2",
        "--train.log_every",
        "2",
    ]
    run = tmp_path / "lora"
    train(finetune_config(hub_llama, data_dir, run, *extra, "--train.eval_every", "0", "--optim.lr", "1e-2"),
          log=lambda line: None)  # fmt: skip
    merged = save_merged(run, tmp_path / "merged")
    a = gguf.GGUFReader(export_gguf(run, tmp_path / "lora.gguf", "f32", log=lambda line: None))
    b = gguf.GGUFReader(export_gguf(merged, tmp_path / "merged.gguf", "f32", log=lambda line: None))
    get = lambda r, n: np.asarray(next(t for t in r.tensors if t.name == n).data)  # noqa: E731
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        np.testing.assert_array_equal(get(a, name), get(b, name))
    assert len(a.fields["tokenizer.ggml.scores"].data) == 32000


def hopperlm(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hopperlm", *map(str, args)], capture_output=True, text=True, cwd=REPO
    )


@pytest.mark.slow
def test_bad_gguf_exports_are_one_line_each(imported, hub_llama, tmp_path, data_dir, capsys):
    from hf_tiny import save_hf, tiny_hf_model

    from hopperlm.interop.hf_convert import import_hf

    cases = []
    cases.append(
        (
            ["--outtype", "q4_k"],
            tmp_path / "a.gguf",
            imported,
            "--outtype 'q4_k' is not one GGUF export writes",
        )
    )
    (tmp_path / "exists.gguf").write_bytes(b"keep me")
    cases.append(([], tmp_path / "exists.gguf", imported, "exists; pass --overwrite"))
    cases.append(([], tmp_path / "folder", imported, "a GGUF export is one file; name it NAME.gguf"))
    qwen = import_hf(
        save_hf(tiny_hf_model("qwen2"), tmp_path / "qwen-hub"), tmp_path / "qwen", log=lambda line: None
    )
    cases.append(([], tmp_path / "q.gguf", qwen, "no attention biases (a Qwen2-family model)"))
    no_sp = tmp_path / "no-sp"
    shutil.copytree(imported, no_sp)
    (no_sp / "tokenizer" / "tokenizer.model").unlink()
    cases.append(([], tmp_path / "n.gguf", no_sp, "has no tokenizer.model (SentencePiece)"))
    for i, (extra, out, source, message) in enumerate(cases):
        args = ["export", str(source), str(out), "--format", "gguf", *extra]
        if i == 0:  # the command a user runs; the others in this process (a process each took 2 s)
            done = hopperlm(*args)
            code, stderr = done.returncode, done.stderr
        else:
            with pytest.raises(SystemExit) as exit_:
                main(args)
            code, stderr = exit_.value.code, capsys.readouterr().err
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], (message, stderr[-2000:])
        assert "Traceback" not in stderr
    assert (tmp_path / "exists.gguf").read_bytes() == b"keep me"  # nothing complete touched
    shutil.copy(hub_llama / "tokenizer.model", no_sp / "tokenizer")  # the fix the no_sp refusal names
    main(["export", str(no_sp), str(tmp_path / "n.gguf"), "--format", "gguf", "--outtype", "f32"])
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.slow
def test_llama_cpp_tokenizes_and_continues_as_hopperlm(imported, tmp_path):
    """llama.cpp itself, where bench/llamacpp_check.py has built it: the prompt's ids equal SentencePiece's and
    hopperlm's, and llama-simple's greedy continuation equals `hopperlm generate --temperature 0`'s."""
    from llamacpp_cases import hopperlm_greedy, hopperlm_ids, llama_greedy, llama_tokenize, sentencepiece_ids

    bin_dir = built_llama_cpp()
    if bin_dir is None:
        pytest.skip("llama.cpp is not built on this machine: python3 bench/llamacpp_check.py --build-only")
    from hopperlm.interop.gguf import export_gguf

    out = export_gguf(imported, tmp_path / "tiny.gguf", "f32", log=lambda line: None)
    prompt = "ROMEO: What light through yonder window breaks?"
    ids = llama_tokenize(bin_dir, out, prompt)
    assert ids == sentencepiece_ids(imported / "tokenizer", prompt) == hopperlm_ids(imported, prompt)
    assert llama_greedy(bin_dir, out, prompt, 12) == hopperlm_greedy(imported, prompt, 12)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tinyllama", "arcee", "qwen3"])
def test_llama_cpp_converter_writes_what_export_writes(family, data_dir, tmp_path):
    """Where bench/llamacpp_check.py has unpacked llama.cpp's source (the binaries need not be built): its own
    convert_hf_to_gguf.py, on the Hugging Face folder `export` writes of a Llama, a ReLU² (Arcee) and a QK-norm
    (Qwen3) model, writes every tensor `export --format gguf` writes, byte for byte (name, type, shape, values),
    and the same value for every key both write."""
    source = llama_cpp_source()
    if source is None:
        pytest.skip("llama.cpp's source is not unpacked here: python3 bench/llamacpp_check.py --build-only")
    from llamacpp_cases import convert_hf_to_gguf

    from hopperlm.interop.gguf import export_gguf
    from hopperlm.interop.hf_convert import export_hf

    model, _ = imported_family(family, tmp_path, data_dir)
    ours = gguf.GGUFReader(export_gguf(model, tmp_path / "ours.gguf", "f32", log=lambda line: None))
    hf = export_hf(model, tmp_path / "hf", dtype="fp32", log=lambda line: None)
    theirs = gguf.GGUFReader(convert_hf_to_gguf(source, hf, tmp_path / "converted.gguf"))
    a, b = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        assert (t.tensor_type, list(t.shape)) == (b[name].tensor_type, list(b[name].shape)), name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(b[name].data), err_msg=name)
    arch = field(theirs, "general.architecture")
    assert field(ours, "general.architecture") == arch
    # the architecture's keys and the vocabulary's pieces and ids (the scores and types differ on <unk>, <s>
    # and </s> alone: the converter takes tokenizer_config.json's word for them, export SentencePiece's)
    vocabulary = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens")
    keys = [
        k for k in theirs.fields if k.startswith(f"{arch}.") or k in vocabulary or k.endswith("_token_id")
    ]
    assert len(keys) > 10 and set(keys) <= set(ours.fields), sorted(set(keys) - set(ours.fields))
    for key in keys:
        mine, converted = field(ours, key), field(theirs, key)
        if isinstance(mine, list):  # the pieces
            assert [bytes(p) for p in mine] == [bytes(p) for p in converted], key
        else:
            assert mine == pytest.approx(converted) if isinstance(mine, float) else mine == converted, key


@pytest.mark.slow
@pytest.mark.parametrize("family", ["arcee", "qwen3"])
@pytest.mark.parametrize("continued", [False, True], ids=["imported", "continued"])
def test_llama_cpp_runs_relu2_and_qk_norm_models_as_hopperlm(family, continued, data_dir, tmp_path):
    """Where llama.cpp is built: a ReLU² model (arcee) and a QK-norm one (qwen3), imported and, `continued`,
    trained on (continued pretraining, as bench/llamacpp_check.py's cpt cases), as `export --format gguf` writes
    them and as llama.cpp's own convert_hf_to_gguf.py converts their `export`ed Hugging Face folder: llama.cpp
    loads both files, tokenizes as SentencePiece does, and continues the prompt greedily as `hopperlm generate
    --temperature 0` does."""
    bin_dir = built_llama_cpp()
    if bin_dir is None:
        pytest.skip("llama.cpp is not built on this machine: python3 bench/llamacpp_check.py --build-only")
    from llamacpp_cases import (
        convert_hf_to_gguf,
        hopperlm_greedy,
        hopperlm_ids,
        llama_greedy,
        llama_tokenize,
        sentencepiece_ids,
    )

    from hopperlm.interop.gguf import export_gguf
    from hopperlm.interop.hf_convert import export_hf

    source, _ = imported_family(family, tmp_path, data_dir)
    if continued:
        source = continued_run(source, tmp_path, data_dir)
    hf = export_hf(source, tmp_path / "hf", dtype="fp32", log=lambda line: None)
    files = {
        "export --format gguf": export_gguf(source, tmp_path / "ours.gguf", "f32", log=lambda line: None),
        "convert_hf_to_gguf": convert_hf_to_gguf(bin_dir.parents[1], hf, tmp_path / "converted.gguf"),
    }
    prompt = "ROMEO: What light through yonder window breaks?"
    ours = hopperlm_greedy(source, prompt, 12)
    for how, path in files.items():
        assert field(gguf.GGUFReader(path), "general.architecture") == family, how
        ids = llama_tokenize(bin_dir, path, prompt)
        assert ids == sentencepiece_ids(source / "tokenizer", prompt) == hopperlm_ids(source, prompt), how
        assert llama_greedy(bin_dir, path, prompt, 12) == ours, how


def continued_run(imported: Path, where: Path, data_dir: Path) -> Path:
    """`imported` trained on for 20 steps on Tiny Shakespeare's first 200 KB, prepared with its own tokenizer (as
    bench/llamacpp_cases.py's cpt cases, shorter): the run folder."""
    from llamacpp_cases import hopperlm, train_args

    text = where / "shakespeare.txt"
    text.write_text((data_dir / "tinyshakespeare" / "input.txt").read_text()[:200_000])
    data = where / "cpt-data"
    hopperlm("prepare", text, "--out", data, "--tokenizer", imported / "tokenizer" / "tokenizer.json")
    hopperlm(*train_args(imported, data, where / "cpt", 20))
    return where / "cpt"


# ---- k-quants through llama-quantize, and the Ollama Modelfile ------------------------------------------------
# llama.cpp prebuilt for the tests (../shared/tools/README.md): its build/bin, converter and gguf-py
SHARED_LLAMA_CPP = Path(
    os.environ.get("HOPPERLM_LLAMA_CPP") or REPO.parent / "shared" / "tools" / "llama.cpp"
)


def built_llama_cpp() -> Path | None:
    """bench/llamacpp_check.py's build folder (bin/) where it has built every binary, else the prebuilt
    SHARED_LLAMA_CPP's where it has the binaries these tests run; never builds."""
    from llamacpp_check import built_bin_dir

    shared = SHARED_LLAMA_CPP / "build" / "bin"
    needed = ("llama-tokenize", "llama-simple", "llama-quantize")
    return built_bin_dir() or (shared if all((shared / b).is_file() for b in needed) else None)


def llama_cpp_source() -> Path | None:
    """A llama.cpp folder holding convert_hf_to_gguf.py: bench/llamacpp_check.py's unpacked source, else
    SHARED_LLAMA_CPP."""
    from llamacpp_check import unpacked_source

    shared = SHARED_LLAMA_CPP if (SHARED_LLAMA_CPP / "convert_hf_to_gguf.py").is_file() else None
    return unpacked_source() or shared


def test_a_k_quant_without_llama_quantize_is_one_line_and_writes_nothing(
    imported, tmp_path, monkeypatch, capsys
):
    """No llama-quantize: a k-quant is refused in one line, before anything is written (the output folder made
    for it removed again, one that was there left as it was), naming how to get the binary and, for Ollama,
    the --modelfile route; so is --modelfile with a k-quant Ollama does not make, and a --llama-cpp DIR
    without the binary (the user chose that route)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.gguf").write_bytes(b"keep me")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))  # no llama-quantize anywhere on it
    (tmp_path / "no-llama").mkdir()
    cases = [
        (out_dir, ["--outtype", "q4_k_m"], ["not found on PATH", "--llama-cpp DIR", "add --modelfile"]),
        (tmp_path / "ollama", ["--outtype", "q4_k_m"], ["not found on PATH", "ollama create NAME -q q4_K_M"]),
        (out_dir, ["--outtype", "q5_k_m", "--modelfile"], ["`ollama create -q` makes q4_K_M only"]),
        (out_dir, ["--outtype", "q4_k_m", "--modelfile", "--llama-cpp", str(tmp_path / "no-llama")],
         ["no llama-quantize in it"]),
    ]  # fmt: skip
    for folder, extra, messages in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["export", str(imported), str(folder / "tiny.gguf"), "--format", "gguf", *extra])
        stderr = capsys.readouterr().err
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert exit_.value.code == 2 and len(lines) == 1, stderr[-2000:]
        assert all(m in lines[0] for m in messages) and "bench/llamacpp_check.py --build-only" in lines[0]
        assert "Traceback" not in stderr
        assert sorted(p.name for p in out_dir.iterdir()) == ["keep.gguf"]  # no GGUF, no Modelfile, no temp
        assert (out_dir / "keep.gguf").read_bytes() == b"keep me"
        assert not (tmp_path / "ollama").exists()  # the folder made for the export went with the refusal


def test_q4_k_m_for_ollama_without_llama_quantize_is_an_f16_file_ollama_quantizes(
    imported, tmp_path, monkeypatch, capsys
):
    """`--outtype q4_k_m --modelfile` without llama.cpp: the f16 GGUF and its Modelfile, one line saying this is
    the route taken, and the one command that makes Ollama quantize it (`ollama create NAME -q q4_K_M`)."""
    system_path = os.environ.get("PATH", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))  # no llama-quantize anywhere on it
    out = tmp_path / "ollama" / "tiny-q4_k_m.gguf"
    main(["export", str(imported), str(out), "--format", "gguf", "--outtype", "q4_k_m", "--modelfile"])
    stdout = capsys.readouterr().out
    route = [line for line in stdout.splitlines() if "no llama.cpp llama-quantize on PATH" in line]
    assert len(route) == 1 and "written in f16" in route[0] and "q4_K_M" in route[0], stdout
    assert f"ollama create tiny-q4_k_m -q q4_K_M -f {out.parent / 'Modelfile'}" in stdout
    assert f"exported {out} (GGUF, f16:" in stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["Modelfile", "tiny-q4_k_m.gguf"]
    r = gguf.GGUFReader(out)
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16  # what Ollama's -q takes
    assert {t.tensor_type for t in r.tensors} == {
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.F32,
    }
    text = (out.parent / "Modelfile").read_text()
    assert "#   ollama create NAME -q q4_K_M -f Modelfile" in text and "FROM ./tiny-q4_k_m.gguf\n" in text

    # with a llama-quantize on PATH (a stand-in that copies its input) the llama.cpp route stays: no -q
    fake = tmp_path / "bin" / "llama-quantize"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncp "$1" "$2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join((str(fake.parent), system_path)))  # found first
    main(["export", str(imported), str(out), "--format", "gguf", "--outtype", "q4_k_m", "--modelfile",
          "--overwrite"])  # fmt: skip
    stdout = capsys.readouterr().out
    assert "no llama.cpp llama-quantize" not in stdout and f"exported {out} (GGUF, q4_k_m:" in stdout
    assert f"ollama create tiny-q4_k_m -f {out.parent / 'Modelfile'}" in stdout
    assert "-q q4_K_M" not in (out.parent / "Modelfile").read_text()


def modelfile_fields(text: str) -> tuple[str | None, dict[str, list[str]]]:
    """(the TEMPLATE, {keyword: [values]}) of a Modelfile."""
    import re

    template = re.search(r'^TEMPLATE """(.*?)"""$', text, flags=re.S | re.M)
    rest = text if template is None else text.replace(template.group(0), "")
    fields: dict[str, list[str]] = {}
    for line in rest.splitlines():
        if line and not line.startswith("#"):
            keyword, value = line.split(" ", 1)
            fields.setdefault(keyword, []).append(value)
    return (template.group(1) if template else None), fields


def with_chat_template(imported: Path, where: Path, template: str | None) -> Path:
    """A copy of the imported model whose run saved `template` as its chat template (as `finetune` saves a
    built-in), or none (a pretraining run's tokenizer)."""
    import json

    shutil.copytree(imported, where)
    config_file = where / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return where


def test_the_modelfile_renders_conversations_as_the_run_chat_template(imported, tmp_path, capsys):
    """The Modelfile's TEMPLATE, rendered as Ollama renders it, gives transformers' apply_chat_template text of
    the run's own template (less the BOS Ollama adds itself: the GGUF says add_bos_token) for conversations
    ending in a user turn, and the open reply (no end of turn: Ollama continues it) for those ending in one."""
    import transformers

    from hopperlm.data.chat import BUILTIN

    sources = {
        "tokenizer's own (TinyLlama-Chat)": imported,
        "zephyr with BOS first": with_chat_template(imported, tmp_path / "zephyr", "{{ bos_token }}" + BUILTIN["zephyr"]),
        "chatml": with_chat_template(imported, tmp_path / "chatml", BUILTIN["chatml"]),
        "alpaca": with_chat_template(imported, tmp_path / "alpaca", BUILTIN["alpaca"]),
    }  # fmt: skip
    conversations = [
        [("system", "You are terse."), ("user", "Hi there"), ("assistant", "Hello.\nHow can I help?"),
         ("user", "Name a colour")],
        [("user", "Hi there"), ("assistant", "Hello."), ("user", "  spaces and\nlines  ")],
        [("system", "You are terse."), ("user", "Hi there"), ("assistant", "Hello.")],
        [("user", "One"), ("assistant", "Two")],
    ]  # fmt: skip
    for i, (name, source) in enumerate(sources.items()):
        out_dir = tmp_path / f"out-{i}"
        main(["export", str(source), str(out_dir / "tiny.gguf"), "--format", "gguf", "--modelfile"])
        assert sorted(p.name for p in out_dir.iterdir()) == ["Modelfile", "tiny.gguf"]
        template, fields = modelfile_fields((out_dir / "Modelfile").read_text())
        assert fields["FROM"] == ["./tiny.gguf"], name
        assert 'stop "</s>"' in fields["PARAMETER"], name  # EOS ends the reply
        assert field(gguf.GGUFReader(out_dir / "tiny.gguf"), "tokenizer.ggml.add_bos_token") is True
        tok = transformers.AutoTokenizer.from_pretrained(source / "tokenizer")
        for turns in conversations:
            messages = [{"role": r, "content": c} for r, c in turns]
            if turns[-1][0] == "assistant":  # the prompt, then the reply so far
                want = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
                want += messages[-1]["content"]
            else:
                want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if "SYSTEM" in fields and turns[0][0] != "system":  # Ollama puts the Modelfile's SYSTEM first
                messages = [{"role": "system", "content": fields["SYSTEM"][0].strip('"')}, *messages]
            assert go_render(template, messages) == want.removeprefix("<s>"), (name, turns)
    capsys.readouterr()
    text = (tmp_path / "out-0" / "Modelfile").read_text()  # the imported model: its generation_config.json
    assert "PARAMETER temperature 0\n" in text and 'PARAMETER stop "<|user|>"' in text
    chatml = (tmp_path / "out-2" / "Modelfile").read_text()
    assert 'PARAMETER stop "<|im_end|>"' in chatml  # ChatML's end of turn ends the reply too


def test_a_pretraining_run_gets_a_modelfile_without_template_and_llama2_is_refused(
    imported, tmp_path, capsys
):
    import json

    from hopperlm.data.chat import BUILTIN
    from hopperlm.model.generate import SAMPLING_DEFAULTS

    plain = with_chat_template(imported, tmp_path / "pretrained", None)
    config = json.loads((plain / "config.json").read_text())
    config.pop("hf")  # trained by hopperlm, no Hugging Face base: hopperlm generate's own sampling
    (plain / "config.json").write_text(json.dumps(config))
    main(["export", str(plain), str(tmp_path / "a" / "tiny.gguf"), "--format", "gguf", "--modelfile"])
    out = capsys.readouterr().out
    assert "no chat template (a pretraining run): no TEMPLATE" in out
    template, fields = modelfile_fields((tmp_path / "a" / "Modelfile").read_text())
    assert template is None and fields["FROM"] == ["./tiny.gguf"]
    assert f"temperature {SAMPLING_DEFAULTS['temperature']:g}" in fields["PARAMETER"]
    assert f"top_k {SAMPLING_DEFAULTS['top_k']}" in fields["PARAMETER"]
    assert 'stop "</s>"' in fields["PARAMETER"]

    llama2 = with_chat_template(imported, tmp_path / "llama2", BUILTIN["llama2"])
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(llama2), str(tmp_path / "b" / "tiny.gguf"), "--format", "gguf", "--modelfile"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 2 and len(lines) == 1 and "cannot be written as Ollama's TEMPLATE" in lines[0]
    assert list((tmp_path / "b").iterdir()) == []  # refused before the GGUF was written


def test_go_render_fails_a_template_that_renders_otherwise():
    """The check above can fail: a TEMPLATE one newline off, or with an action Ollama reads otherwise."""
    good = '{{ range $i, $_ := .Messages }}{{ if eq .Role "user" }}<|user|>\n{{ .Content }}{{ end }}{{ end }}'
    assert go_render(good, [{"role": "user", "content": "x"}]) == "<|user|>\nx"
    assert go_render(good.replace("|>\n", "|>"), [{"role": "user", "content": "x"}]) != "<|user|>\nx"
    with pytest.raises(AssertionError, match="does not know"):
        go_render(good.replace("{{ end }}{{ end }}", "{{- end }}{{ end }}"), [])


@pytest.mark.slow
def test_q4_k_m_export_runs_in_llama_cpp(imported, tmp_path):
    """Where bench/llamacpp_check.py has built llama.cpp: `--outtype q4_k_m --llama-cpp DIR` writes a k-quant
    GGUF (the tiny model's rows of 64 and 96 values take llama.cpp's fallback types, and the command says so)
    that llama.cpp tokenizes as SentencePiece does and runs."""
    bin_dir = built_llama_cpp()
    if bin_dir is None:
        pytest.skip("llama.cpp is not built on this machine: python3 bench/llamacpp_check.py --build-only")
    from llamacpp_cases import llama_greedy, llama_tokenize, sentencepiece_ids

    out = tmp_path / "tiny-q4_k_m.gguf"
    done = hopperlm(
        "export", imported, out, "--format", "gguf", "--outtype", "q4_k_m", "--llama-cpp", bin_dir
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "took llama.cpp's fallback type" in done.stdout and "q4_K -> q5_0" in done.stdout, done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-q4_k_m.gguf"]  # the f16 file is gone
    r = gguf.GGUFReader(out)
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q5_0  # q4_K's fallback for 64 columns
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    prompt = "ROMEO: What light through yonder window breaks?"
    assert llama_tokenize(bin_dir, out, prompt) == sentencepiece_ids(imported / "tokenizer", prompt)
    assert llama_greedy(bin_dir, out, prompt, 8)  # it runs and says something


def test_a_failing_llama_quantize_is_one_line_and_leaves_nothing(imported, tmp_path, capsys):
    """A llama-quantize that fails: its last line of stderr in one line, exit 2, no partial file left."""
    fake = tmp_path / "llama.cpp" / "build" / "bin" / "llama-quantize"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        '#!/bin/sh\necho "loading $1" >&2\necho partial > "$2"\necho "failed to quantize: bad magic" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(imported), str(out_dir / "t.gguf"), "--format", "gguf", "--outtype", "q6_k",
              "--llama-cpp", str(tmp_path / "llama.cpp")])  # fmt: skip
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 2 and len(lines) == 1, stderr[-2000:]
    assert "llama-quantize Q6_K failed (exit 1): failed to quantize: bad magic" in lines[0]
    assert list(out_dir.iterdir()) == []
