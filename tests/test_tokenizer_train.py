"""Tokenizers for a new language, on real Tigrinya: `tokenizer extend` keeps every old id and English
tokenization, and cuts Tigrinya fertility; `tokenizer train` makes working BPE and Unigram tokenizers."""

import contextlib
import io
import itertools
import json

import pytest
from shared_data import DATA_DIR

from hopperlm.cli import main
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.data.tokenizer_train import (
    corpus_texts,
    extend_tokenizer,
    fertility,
    load_base,
    train_tokenizer,
)
from hopperlm.errors import DataError

TINYLLAMA = DATA_DIR / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
TIR_CORPUS = [DATA_DIR / "travis-tigrinya-parallel" / "TI_volunteers.txt", DATA_DIR / "masakhanews" / "tir"]
HELDOUT_TIR, HELDOUT_ENG = DATA_DIR / "hornmt" / "tir.txt", DATA_DIR / "hornmt" / "eng.txt"
WIKI = DATA_DIR / "wikitext-2" / "wiki.valid.tokens"


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    out = tmp_path_factory.mktemp("ext") / "tir"
    args = ["tokenizer", "extend", str(TINYLLAMA), *map(str, TIR_CORPUS), "--add", "2500", "--out", str(out)]
    args += ["--heldout", str(HELDOUT_TIR), "--heldout", str(WIKI), "--protect", str(HELDOUT_ENG)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(args)
    return out, printed.getvalue()


def test_extension_keeps_old_ids_and_english(extended):
    extended, report = extended
    base_json = json.loads((TINYLLAMA / "tokenizer.json").read_text())
    ext_json = json.loads((extended / "tokenizer.json").read_text())
    base_vocab, ext_vocab = base_json["model"]["vocab"], ext_json["model"]["vocab"]
    assert all(ext_vocab[piece] == i for piece, i in base_vocab.items())  # every old id keeps its piece
    assert sorted(set(ext_vocab.values()) - set(base_vocab.values())) == list(range(32000, 32000 + 2500))
    assert ext_json["model"]["merges"][: len(base_json["model"]["merges"])] == base_json["model"]["merges"]
    assert {k: v for k, v in ext_json.items() if k != "model"} == {
        k: v for k, v in base_json.items() if k != "model"
    }

    base, ext = load_tokenizer(TINYLLAMA / "tokenizer.json"), load_tokenizer(extended)
    assert ext.vocab_size == 34500 and ext.eos_id == base.eos_id == 2 and ext.bos_id == 1
    for path in (HELDOUT_ENG, WIKI):
        lines = path.read_text(encoding="utf-8").splitlines()[:3000]
        assert base.encode_batch(lines) == ext.encode_batch(lines)  # English: the very same ids
    tir = HELDOUT_TIR.read_text(encoding="utf-8")
    before, after = fertility(base, tir), fertility(ext, tir)
    assert before["words"] == 43_511 and before["tokens"] == 534_971  # Llama-2's tokenizer: 12.30 tokens/word
    assert after["tokens_per_word"] < 3.0 < 12.0 < before["tokens_per_word"]
    assert ext.decode(ext.encode(tir[:2000])) == tir[:2000]  # lossless

    assert (
        "hornmt/tir.txt" in report
        and "2,030/2,030 lines differ, each holding new-script characters" in report
    )
    assert "wikitext-2/wiki.valid.tokens" in report and "unchanged" in report
    saved = json.loads((extended / "extension.json").read_text())
    assert saved["base_vocab_size"] == 32000 and len(saved["pieces"]) == 2500
    assert saved["report"][0]["extended"]["tokens_per_word"] == pytest.approx(after["tokens_per_word"])


def test_transformers_loads_the_extended_tokenizer(extended):
    extended, _ = extended
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(extended))
    ours = load_tokenizer(extended)
    lines = HELDOUT_TIR.read_text(encoding="utf-8").splitlines()[:100]
    assert [hf.encode(line, add_special_tokens=False) for line in lines] == ours.encode_batch(lines)
    assert len(hf) == 34500 and hf.eos_token_id == 2


def test_extended_tokenizer_model_gives_the_same_ids_as_its_tokenizer_json(extended, tmp_path):
    """The comparison users make: SentencePiece, transformers' SentencePiece backend (the slow tokenizer),
    LlamaTokenizer built from tokenizer.model alone, and the fast tokenizer on tokenizer.json give the same ids
    on held-out Tigrinya (every line and every word) and English; old pieces, ids and scores are untouched."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb

    transformers = pytest.importorskip("transformers")
    extended, _ = extended
    base = pb.ModelProto.FromString((TINYLLAMA / "tokenizer.model").read_bytes())
    ext = pb.ModelProto.FromString((extended / "tokenizer.model").read_bytes())
    assert list(ext.pieces)[:32000] == list(base.pieces) and ext.normalizer_spec == base.normalizer_spec
    vocab = json.loads((extended / "tokenizer.json").read_text())["model"]["vocab"]
    new = list(ext.pieces)[32000:]
    assert [vocab[p.piece] for p in new] == list(range(32000, 34500))
    assert all(p.type == pb.ModelProto.SentencePiece.NORMAL for p in new)
    scores = [
        min(p.score for p in base.pieces),
        *(p.score for p in new),
    ]  # below every old piece, in id order
    assert all(a > b for a, b in itertools.pairwise(scores))

    only_model = tmp_path / "model-only"
    only_model.mkdir()
    (only_model / "tokenizer.model").write_bytes((extended / "tokenizer.model").read_bytes())
    sp = sentencepiece.SentencePieceProcessor(model_file=str(extended / "tokenizer.model"))
    slow = transformers.SentencePieceBackend(vocab_file=str(extended / "tokenizer.model"), legacy=True)
    from_model = transformers.LlamaTokenizer.from_pretrained(only_model)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(extended / "tokenizer.json"))
    ours = load_tokenizer(extended)
    base_sp = sentencepiece.SentencePieceProcessor(model_file=str(TINYLLAMA / "tokenizer.model"))
    shakespeare = (DATA_DIR / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:40_000]
    for path_or_text in (HELDOUT_TIR, HELDOUT_ENG, shakespeare):
        text = path_or_text if isinstance(path_or_text, str) else path_or_text.read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if line.strip()]
        ids = sp.encode(lines)
        assert [slow.encode(line, add_special_tokens=False) for line in lines] == ids
        assert from_model(lines, add_special_tokens=False)["input_ids"] == ids
        assert fast(lines, add_special_tokens=False)["input_ids"] == ids
        assert ours.encode_batch(lines) == ids
        if path_or_text is HELDOUT_TIR:
            words = text.split()
            assert len(words) == 43_511 and ours.encode_batch(words) == sp.encode(words)
        else:
            assert base_sp.encode(lines) == ids  # English: the base's very ids


def test_llama2_sentencepiece_base_converts_exactly(tmp_path):
    """BASE may be Llama-2's tokenizer.model: converted, it is TinyLlama's tokenizer.json (same vocab, merges)."""
    base = load_base(str(DATA_DIR / "tokenizers" / "llama2" / "tokenizer.model"))
    ref = json.loads((TINYLLAMA / "tokenizer.json").read_text())
    ours = json.loads(base._raw)
    assert (
        ours["model"]["vocab"] == ref["model"]["vocab"] and ours["model"]["merges"] == ref["model"]["merges"]
    )
    sp = load_tokenizer(DATA_DIR / "tokenizers" / "llama2" / "tokenizer.model")
    text = (
        HELDOUT_TIR.read_text(encoding="utf-8")[:20000]
        + (DATA_DIR / "tinyshakespeare" / "input.txt").read_text()[:50000]
    )
    assert base.encode(text) == sp.encode(text) and (base.eos_id, base.bos_id) == (2, 1)
    # extended, it gets its tokenizer.model extended too, with the same ids
    volunteers = TIR_CORPUS[0].read_text(encoding="utf-8")[:100_000]
    ext = extend_tokenizer(base, [volunteers], 300).tokenizer
    ext.save(tmp_path)
    extended_sp = load_tokenizer(tmp_path / "tokenizer.model")
    lines = HELDOUT_TIR.read_text(encoding="utf-8").splitlines()
    assert extended_sp.vocab_size == 32300 and extended_sp.encode_batch(lines) == ext.encode_batch(lines)
    with pytest.raises(DataError, match="needs a BPE tokenizer.json"):
        extend_tokenizer(load_tokenizer("byte"), ["ሰላም"], 10)
    with pytest.raises(DataError, match="gpt2 is a byte-level BPE"):
        extend_tokenizer(load_base(str(DATA_DIR / "tokenizers" / "gpt2")), ["ሰላም"], 10)


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_train_bpe_and_unigram(kind, tmp_path):
    texts = list(corpus_texts([HELDOUT_TIR]))
    tok = train_tokenizer(texts, kind, 1000)
    assert tok.vocab_size <= 1000 and tok.eos_id is not None
    sample = HELDOUT_TIR.read_text(encoding="utf-8").splitlines()[7]
    assert tok.decode(tok.encode(sample)).strip() == sample.strip()
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).encode(sample) == tok.encode(sample)
    assert fertility(tok, sample)["tokens_per_word"] < 4
