"""Tokenizers on real files: round trips, special ids, identity, save/load and error messages."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from shared_data import DATA_DIR

from hopperlm.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
)
from hopperlm.data.tokenizer_train import train_bpe
from hopperlm.errors import DataError

TOK_DIR = DATA_DIR / "tokenizers"
SHAKESPEARE = DATA_DIR / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def bpe(shakespeare):
    head = shakespeare[:200_000]
    return train_bpe((head[i : i + 10_000] for i in range(0, len(head), 10_000)), 512)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- byte --------------------------------------------------------------------------------------------------


def test_byte_round_trip_shakespeare(shakespeare):
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (257, 256, None)
    ids = tok.encode(shakespeare)
    assert len(ids) == SHAKESPEARE.stat().st_size
    assert tok.decode(ids) == shakespeare
    assert np.array_equal(tok.encode_to_array(shakespeare[:5000]), tok.encode(shakespeare[:5000]))


def test_byte_round_trip_tigrinya_multibyte():
    text = (DATA_DIR / "hornmt" / "tir.txt").read_text(encoding="utf-8")
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) > len(text)  # Ge'ez script is 3 bytes per character in UTF-8
    assert max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.encode_batch([text[:100], text[100:200]]) == [
        tok.encode(text[:100]),
        tok.encode(text[100:200]),
    ]
    # EOS and out-of-range ids are ignored; a character cut in half becomes U+FFFD instead of an exception.
    assert tok.decode(ids[:30] + [256] + ids[30:60]) == tok.decode(ids[:60])
    assert tok.decode(ids[:1]) == "\ufffd"


def test_byte_save_and_identity(tmp_path):
    tok = ByteTokenizer()
    ident = tok.identity()
    assert ident["sha256"] == hashlib.sha256(b"hopperlm-byte-v1").hexdigest()
    assert ident["kind"] == "byte" and ident["vocab_size"] == 257 and ident["eos_id"] == 256
    tok.save(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert isinstance(again, ByteTokenizer) and again.identity() == ident


# ---- trained BPE -------------------------------------------------------------------------------------------


def test_bpe_trains_and_round_trips(bpe, shakespeare):
    assert bpe.kind == "hf"
    assert 400 < bpe.vocab_size <= 512
    assert bpe.eos_id == bpe._tok.token_to_id("<|endoftext|>")
    held_out = shakespeare[500_000:520_000]
    ids = bpe.encode(held_out)
    assert len(ids) < 0.6 * len(held_out)  # merges learned: well under one token per character
    assert max(ids) < bpe.vocab_size
    assert bpe.decode(ids) == held_out
    assert bpe.decode(ids + [bpe.eos_id]) == held_out
    assert bpe.encode("\u1208\u12a3 emoji \U0001f600")  # bytes never seen in training still encode...
    assert bpe.decode(bpe.encode("\u1208\u12a3 emoji \U0001f600")) == "\u1208\u12a3 emoji \U0001f600"


def test_bpe_save_load_identical(bpe, shakespeare, tmp_path):
    bpe.save(tmp_path)
    again = load_tokenizer(tmp_path)
    sample = shakespeare[700_000:705_000]
    assert again.encode(sample) == bpe.encode(sample)
    assert again.identity()["sha256"] == bpe.identity()["sha256"] == sha256_of(tmp_path / "tokenizer.json")
    assert (again.vocab_size, again.eos_id) == (bpe.vocab_size, bpe.eos_id)


@pytest.mark.parametrize("vocab", [257, 1_000_001])
def test_bpe_vocab_out_of_range(vocab):
    with pytest.raises(DataError, match="vocab-size"):
        train_bpe(iter(["some text"]), vocab)


# ---- Hugging Face tokenizer.json ---------------------------------------------------------------------------


def test_hf_gpt2(shakespeare):
    tok = load_tokenizer(TOK_DIR / "gpt2" / "tokenizer.json")
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (50257, 50256, None)
    assert tok.encode("Hello world") == [15496, 995]
    text = shakespeare[:20_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([*ids[:50], 50256]) == tok.decode(ids[:50])
    assert tok.encode_batch([text[:1000], text[1000:3000]]) == [
        tok.encode(text[:1000]),
        tok.encode(text[1000:3000]),
    ]
    ident = tok.identity()
    assert ident["sha256"] == sha256_of(TOK_DIR / "gpt2" / "tokenizer.json")
    assert ident["name"] == "gpt2" and ident["file"] == "tokenizer.json"


def test_hf_tinyllama_eos_from_config(tmp_path):
    tok = load_tokenizer(TOK_DIR / "tinyllama-1.1b-chat-v1.0")  # a directory: tokenizer.json wins over .model
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (32000, 2, 1)
    assert tok.encode("Hello world") == [15043, 3186]  # no BOS added
    text = (DATA_DIR / "hornmt" / "eng.txt").read_text(encoding="utf-8")[:5000]
    assert tok.decode(tok.encode(text)) == text
    tok.save(tmp_path)
    whole = ["special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == whole  # every file of it, tokenizer.model too
    for name in whole:
        assert (tmp_path / name).read_bytes() == (TOK_DIR / "tinyllama-1.1b-chat-v1.0" / name).read_bytes()
    again = load_tokenizer(tmp_path)
    assert again.identity() | {"name": None} == tok.identity() | {"name": None}


def test_hf_eos_from_vocab_without_configs(tmp_path, capsys):
    shutil.copyfile(TOK_DIR / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.eos_id, tok.bos_id) == (2, 1)
    load_tokenizer(tmp_path).save(tmp_path / "saved")
    # a SentencePiece tokenizer.json without its tokenizer.model: said once, with what it means for llama.cpp
    note = capsys.readouterr().err.splitlines()
    assert len(note) == 1 and "without its tokenizer.model" in note[0] and "llama.cpp" in note[0]


def test_a_chat_template_file_is_the_tokenizers_own(tmp_path):
    """transformers saves a chat template as chat_template.jinja: it travels, and is the tokenizer's template; a
    new tokenizer_config.json template replaces it (transformers would prefer the file)."""
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copyfile(TOK_DIR / "tinyllama-1.1b-chat-v1.0" / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = load_tokenizer(tmp_path)
    assert tok.config["chat_template"] == "{{ messages[0]['content'] }}"
    tok.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    tok.with_config({"chat_template": "other"}).save(tmp_path / "other")
    assert not (tmp_path / "other" / "chat_template.jinja").exists()
    assert load_tokenizer(tmp_path / "other").config["chat_template"] == "other"


def test_a_stale_tokenizer_model_is_left_out(tmp_path, capsys):
    """A tokenizer.model whose pieces are not the tokenizer.json's would make llama.cpp's converter (which reads
    it first) build another vocabulary: it is not kept, and that is said once."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    src = TOK_DIR / "tinyllama-1.1b-chat-v1.0"
    shutil.copyfile(src / "tokenizer.json", tmp_path / "tokenizer.json")
    proto = pb.ModelProto.FromString((src / "tokenizer.model").read_bytes())
    proto.pieces[1000].piece = "\u2581stale"
    (tmp_path / "tokenizer.model").write_bytes(proto.SerializeToString())
    load_tokenizer(tmp_path).save(tmp_path / "saved")
    load_tokenizer(tmp_path / "tokenizer.json")
    assert not (tmp_path / "saved" / "tokenizer.model").exists()
    note = capsys.readouterr().err.splitlines()
    assert len(note) == 1 and "has other pieces (left out" in note[0]


def test_hf_config_eos_overrides_vocab_guess(tmp_path):
    shutil.copyfile(TOK_DIR / "gpt2" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "!"}}))
    assert load_tokenizer(tmp_path).eos_id == 0  # "!" is id 0 in GPT-2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-there|>"}))
    with pytest.raises(DataError, match="tokenizer_config.json.*not in the vocabulary"):
        load_tokenizer(tmp_path)


def test_hf_without_any_eos(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(tmp_path)


# ---- SentencePiece -----------------------------------------------------------------------------------------


def test_sentencepiece_llama2():
    path = TOK_DIR / "llama2" / "tokenizer.model"
    tok = load_tokenizer(path)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (32000, 2, 1)
    assert tok.encode("Hello world") == [15043, 3186]
    text = (DATA_DIR / "hornmt" / "eng.txt").read_text(encoding="utf-8")[:20_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([1, *ids[:40], 2, 99_999]) == tok.decode(ids[:40])
    lines = text.splitlines()[:20]
    assert tok.encode_batch(lines) == [tok.encode(line) for line in lines]
    assert tok.identity()["sha256"] == sha256_of(path)
    assert load_tokenizer(path.parent).identity() == tok.identity()


def test_sentencepiece_save_reload(tmp_path):
    tok = load_tokenizer(TOK_DIR / "llama2" / "tokenizer.model")
    tok.save(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (
        TOK_DIR / "llama2" / "tokenizer.model"
    ).read_bytes()
    assert load_tokenizer(tmp_path / "out").identity()["sha256"] == tok.identity()["sha256"]


# ---- load_tokenizer errors ---------------------------------------------------------------------------------


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "missing" / "tokenizer.json")
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="neither a .json nor a .model"):
        load_tokenizer(tmp_path / "notes.txt")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match="not a valid SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")
