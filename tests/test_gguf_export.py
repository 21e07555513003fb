"""`hopperlm export --format gguf`: the file read back with the `gguf` package (llama.cpp's own reader and writer)
holds the Llama architecture's keys, SentencePiece's vocabulary with its scores and types, and every tensor
under llama.cpp's name with the shape and values llama.cpp's converter writes (queries and keys permuted to
interleaved RoPE pairs exactly as convert_hf_to_gguf.py's LlamaModel.permute does). llama.cpp itself runs the
files in bench/llamacpp_check.py (where its binaries are built)."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.slow
def test_llama_cpp_tokenizes_and_continues_as_hopperlm(imported, tmp_path):
    """llama.cpp itself, where bench/llamacpp_check.py has built it: the prompt's ids equal SentencePiece's and
    hopperlm's, and llama-simple's greedy continuation equals `hopperlm generate --temperature 0`'s."""
    sys.path.insert(0, str(REPO / "bench"))
    from llamacpp_cases import hopperlm_greedy, hopperlm_ids, llama_greedy, llama_tokenize, sentencepiece_ids
    from llamacpp_check import BINARIES, cache_dir

    bin_dir = next(cache_dir().glob("llama_cpp_python-*/vendor/llama.cpp/build/bin"), None)
    if bin_dir is None or not all((bin_dir / b).is_file() for b in BINARIES):
        pytest.skip("llama.cpp is not built on this machine: python3 bench/llamacpp_check.py --build-only")
    from hopperlm.interop.gguf import export_gguf

    out = export_gguf(imported, tmp_path / "tiny.gguf", "f32", log=lambda line: None)
    prompt = "ROMEO: What light through yonder window breaks?"
    ids = llama_tokenize(bin_dir, out, prompt)
    assert ids == sentencepiece_ids(imported / "tokenizer", prompt) == hopperlm_ids(imported, prompt)
    assert llama_greedy(bin_dir, out, prompt, 12) == hopperlm_greedy(imported, prompt, 12)
