"""Documents as transformers gives them: `prepare --doc-format` (TinyLlama's `<s> text` vs `text </s>`), the
format in the manifest, packing's document numbers on it, and instruction rows that start the way
`tokenizer(text)` starts them. Real tokenizers and text from ../shared/data, compared with transformers."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_tiny import finetune_config
from shared_data import DATA_DIR

import hopperlm.data.prepare_folder as prepare_folder
import hopperlm.data.sources as sources
from hopperlm.data.chat import choose_template
from hopperlm.data.loader import RandomWindows, TokenShards
from hopperlm.data.packing import batch_doc_ids, window_doc_ids
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.data.sft import Example, to_example, tokenize
from hopperlm.data.shards import MANIFEST, DocumentFormat, index_name
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.errors import DataError

TINYLLAMA_DIR = DATA_DIR / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
TINYLLAMA = TINYLLAMA_DIR / "tokenizer.json"
GPT2 = DATA_DIR / "tokenizers" / "gpt2" / "tokenizer.json"
ENG, TIR = DATA_DIR / "hornmt" / "eng.txt", DATA_DIR / "hornmt" / "tir.txt"
BOS, EOS = 1, 2
QUIET = lambda line: None  # noqa: E731


def eng_lines(path: Path, count: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The first `count` lines of HornMT English as JSONL documents (then `extra`)."""
    texts = [t for t in ENG.read_text(encoding="utf-8").splitlines() if t.strip()][:count] + list(extra)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return texts


def documents(out: Path) -> list[list[int]]:
    """Every document of a prepared dir (train then val), cut at the .idx document starts."""
    manifest = json.loads((out / MANIFEST).read_text())
    tokens, starts = [], []
    for split in ("train", "val"):
        for s in manifest["shards"][split]:
            idx = np.fromfile(out / index_name(s["file"]), dtype="<i8")
            starts += (idx + sum(len(t) for t in tokens)).tolist()
            tokens.append(np.fromfile(out / s["file"], dtype=np.dtype(manifest["dtype"])))
    flat = np.concatenate(tokens).tolist()
    return [flat[a:b] for a, b in zip(starts, [*starts[1:], len(flat)], strict=True)]


@pytest.fixture(scope="module")
def hf_tinyllama():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(TINYLLAMA_DIR)


def test_llama_documents_are_what_transformers_tokenizer_gives(tmp_path, monkeypatch, hf_tinyllama):
    """TinyLlama's pretraining format, `<s> text`: each document equals transformers' tokenizer(text), also
    a long document read in several units and encoded in many pieces (BOS once, before the first)."""
    texts = eng_lines(tmp_path / "eng.jsonl", 300)
    manifest = prepare(
        [tmp_path / "eng.jsonl"], tmp_path / "eng", PrepareOptions(tokenizer=str(TINYLLAMA)), progress=False
    )
    docs = documents(tmp_path / "eng")
    assert len(docs) == manifest["documents"] == 300
    assert docs[0] == hf_tinyllama(texts[0])["input_ids"] and docs[0][:2] != [BOS, BOS]
    assert all(doc == hf_tinyllama(t)["input_ids"] for doc, t in zip(docs, texts, strict=True))
    assert EOS not in sum(docs, [])  # BOS is the only separator, as in TinyLlama's pretraining data

    long = TIR.read_text(encoding="utf-8")[:60_000]  # ~15 pieces of 4,096 characters
    (tmp_path / "long.txt").write_text(long, encoding="utf-8")
    monkeypatch.setattr(sources, "UNIT_BYTES", 40_000)  # and 4 units of the one document
    prepare(
        [tmp_path / "long.txt"], tmp_path / "long", PrepareOptions(tokenizer=str(TINYLLAMA)), progress=False
    )
    (doc,) = documents(tmp_path / "long")
    assert doc == hf_tinyllama(long)["input_ids"] and doc.count(BOS) == 1


def test_the_manifest_records_the_format(tmp_path, shakespeare_bytes):
    eng_lines(tmp_path / "eng.jsonl", 50)

    def fmt(manifest: dict) -> dict:
        return {k: manifest["document_format"][k] for k in ("name", "prefix_ids", "suffix_ids", "requested")}

    llama = prepare(
        [tmp_path / "eng.jsonl"], tmp_path / "a", PrepareOptions(tokenizer=str(TINYLLAMA)), progress=False
    )
    assert fmt(llama) == {"name": "tokenizer", "prefix_ids": [BOS], "suffix_ids": [], "requested": "auto"}
    assert llama["document_format"]["marks_documents"] is True and llama["eos_marks_documents"] is False
    forced = prepare(
        [tmp_path / "eng.jsonl"],
        tmp_path / "b",
        PrepareOptions(tokenizer=str(TINYLLAMA), doc_format="eos"),
        progress=False,
    )
    assert fmt(forced) == {"name": "eos", "prefix_ids": [], "suffix_ids": [EOS], "requested": "eos"}
    assert documents(tmp_path / "b")[0][-1] == EOS and forced["eos_marks_documents"] is True
    # GPT-2 adds no special tokens: `tokenizer` falls back to EOS after each document (and says so)
    said = []
    gpt2 = prepare(
        [tmp_path / "eng.jsonl"],
        tmp_path / "c",
        PrepareOptions(tokenizer=str(GPT2), doc_format="tokenizer"),
        progress=False,
        log=said.append,
    )
    assert fmt(gpt2) == {"name": "eos", "prefix_ids": [], "suffix_ids": [50256], "requested": "tokenizer"}
    assert any("adds no special tokens" in line for line in said)
    with pytest.raises(DataError, match="--doc-format 'bos' is unknown"):
        prepare([tmp_path / "eng.jsonl"], tmp_path / "d", PrepareOptions(doc_format="bos"), progress=False)
    # a manifest written before the format was recorded reads as eos
    old = tmp_path / "old"
    shutil.copytree(shakespeare_bytes, old)
    manifest = json.loads((old / MANIFEST).read_text())
    assert manifest["document_format"]["name"] == "eos"
    del manifest["document_format"]
    (old / MANIFEST).write_text(json.dumps(manifest))
    shards = TokenShards(old, "train")
    assert shards.doc_format == DocumentFormat("eos", (), (256,)) and shards.boundary == (256, 1)


def test_packing_numbers_documents_at_bos_as_the_index_does(tmp_path):
    """With `<s> text` there is no EOS to split at: document numbers come from BOS (vectorised) or the .idx
    index, never from EOS, and equal the index's on real text across shards."""
    eng_lines(tmp_path / "eng.jsonl", 600)
    prepare(
        [tmp_path / "eng.jsonl"],
        tmp_path / "eng",
        PrepareOptions(tokenizer=str(TINYLLAMA), shard_tokens=7_000),
        progress=False,
    )
    shards = TokenShards(tmp_path / "eng", "train")
    assert len(shards._maps) > 2 and shards.boundary == (BOS, 0) and not shards.eos_marks_documents
    windows = RandomWindows(shards, 96, 32, seed=4, packing=True)
    batch = windows.get(2, 0)
    from_index = np.stack([window_doc_ids(shards, int(s), 96) for s in windows.starts(2, 0)])
    assert np.array_equal(batch.doc_ids.numpy(), from_index)
    at_bos = torch.zeros_like(batch.x, dtype=torch.bool)
    at_bos[:, 1:] = batch.x[:, 1:] == BOS
    changes = torch.zeros_like(at_bos)
    changes[:, 1:] = batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1]
    assert torch.equal(changes, at_bos) and int(changes.sum()) > 32

    # a literal "<s>" in a document is BOS too: then only the index knows where documents start
    eng_lines(tmp_path / "lit.jsonl", 300, extra=("The page printed <s> in the middle of a sentence.",) * 40)
    manifest = prepare(
        [tmp_path / "lit.jsonl"],
        tmp_path / "lit",
        PrepareOptions(tokenizer=str(TINYLLAMA), val_fraction=0),
        progress=False,
    )
    assert manifest["document_format"]["marks_documents"] is False
    literal = TokenShards(tmp_path / "lit", "train")
    assert literal.boundary is None
    starts = np.arange(len(literal) - 2000, len(literal) - 97, 60)  # the part holding the literal ones
    x = np.stack([literal.read(int(s), 96) for s in starts])
    from_index = np.stack([window_doc_ids(literal, int(s), 96) for s in starts])
    assert np.array_equal(batch_doc_ids([literal] * len(starts), starts, x), from_index)
    assert ((x[:, 1:] == BOS).sum(axis=1) > from_index[:, -1]).any()  # some BOS ids are text, not documents
    # rows from datasets of different formats (a mixture) also go by the index
    other = TokenShards(tmp_path / "eng", "val")
    other.boundary = (EOS, 1)  # as a dataset prepared with --doc-format eos reads
    pair, rows = [shards, other], np.array([0, 50])
    x = np.stack([s.read(int(r), 96) for s, r in zip(pair, rows, strict=True)])
    want = np.stack([window_doc_ids(s, int(r), 96) for s, r in zip(pair, rows, strict=True)])
    assert np.array_equal(batch_doc_ids(pair, rows, x), want) and want[:, -1].min() > 0


def test_resumed_prepare_in_the_tokenizer_format_is_identical(tmp_path, monkeypatch):
    """Interrupted after its 2nd, then its 5th save: the result equals an uninterrupted prepare, BOS once
    before every document."""
    eng_lines(tmp_path / "eng.jsonl", 1500)
    (tmp_path / "tir.txt").write_text(TIR.read_text(encoding="utf-8")[:120_000], encoding="utf-8")
    inputs = [tmp_path / "eng.jsonl", tmp_path / "tir.txt"]
    monkeypatch.setattr(sources, "UNIT_BYTES", 30_000)
    options = PrepareOptions(tokenizer=str(TINYLLAMA), shard_tokens=40_000, split="docs", val_fraction=0.2)
    reference = prepare(inputs, tmp_path / "reference", options, progress=False)
    real_save, saves = prepare_folder.save_state, []

    def crashing_save(*args):
        real_save(*args)
        saves.append(1)
        if len(saves) in (2, 5):
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare_folder, "save_state", crashing_save)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            prepare(inputs, tmp_path / "out", options, progress=False)
    resumed = prepare(inputs, tmp_path / "out", options, progress=False)
    same = lambda m: {k: v for k, v in m.items() if k != "created"}  # noqa: E731
    assert same(resumed) == same(reference)
    files = lambda d: {p.name: p.read_bytes() for p in d.iterdir() if p.suffix in (".bin", ".idx")}  # noqa: E731
    assert files(tmp_path / "out") == files(tmp_path / "reference")
    docs = documents(tmp_path / "out")
    assert all(d[0] == BOS and d.count(BOS) == 1 for d in docs) and len(docs) == reference["documents"]


def test_byte_and_trained_tokenizers_keep_eos_after_each_document(tmp_path):
    texts = eng_lines(tmp_path / "eng.jsonl", 40)
    for tokenizer, extra in (("byte", {}), ("bpe", {"vocab_size": 400})):
        manifest = prepare(
            [tmp_path / "eng.jsonl"], tmp_path / tokenizer, PrepareOptions(tokenizer, **extra), progress=False
        )
        eos = manifest["eos_id"]
        assert manifest["document_format"]["name"] == "eos" and manifest["eos_marks_documents"] is True
        tok = load_tokenizer(tmp_path / tokenizer)
        assert documents(tmp_path / tokenizer) == [[*tok.encode(t), eos] for t in texts]


# ---- instruction data ----------------------------------------------------------------------------------------
def test_completions_are_tokenizer_text_then_eos(tmp_path, hf_tinyllama):
    transformers = pytest.importorskip("transformers")
    example = Example(prompt="Translate to French: good morning\n", completion="bonjour")
    text = example.prompt + example.completion
    ids, labels = tokenize(example, load_tokenizer(TINYLLAMA), None, train_on_prompt=False)
    assert ids.tolist() == [*hf_tinyllama(text)["input_ids"], EOS] and ids[1] != BOS
    assert labels[-1] == EOS and labels[0] == -100
    # a Llama vocabulary (BOS defined) whose tokenizer.json adds nothing: transformers adds no BOS, nor do we
    folder = tmp_path / "no-bos"
    folder.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((TINYLLAMA_DIR / name).read_bytes())
    spec = json.loads(TINYLLAMA.read_text(encoding="utf-8"))
    (folder / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": None}), encoding="utf-8")
    assert load_tokenizer(folder).bos_id == BOS
    no_bos = transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    ids, _ = tokenize(example, load_tokenizer(folder), None, train_on_prompt=False)
    assert ids.tolist() == [*no_bos, EOS] and ids[0] != BOS
    gpt2 = load_tokenizer(GPT2)
    ids, _ = tokenize(example, gpt2, None, train_on_prompt=False)
    assert ids.tolist() == [*gpt2.encode(text), gpt2.eos_id]


def test_instruction_rows_start_with_one_bos_or_as_the_chat_template_says(tinyllama_hf, data_dir, tmp_path):
    """Built-in templates (zephyr has no BOS of its own, alpaca renders one) start like tokenizer(text): one
    BOS; TinyLlama-Chat's own template is encoded exactly as apply_chat_template(tokenize=True) (no BOS). Each
    equals transformers' apply_chat_template with the template the run saves for inference."""
    transformers = pytest.importorskip("transformers")
    from hopperlm.data.sft import open_sft_data, read_records
    from hopperlm.interop.inference import sft_tokenizer_path

    own = transformers.AutoTokenizer.from_pretrained(TINYLLAMA_DIR)
    records = read_records(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json")[:6]
    for template in ("zephyr", "alpaca", "tokenizer"):
        run = tmp_path / template
        args = ["--sft.template", template, "--sft.max_examples", "6", "--sft.val_fraction", "0"]
        cfg = finetune_config(tinyllama_hf, data_dir, run, *args, "--train.seq_len", "512")
        data = open_sft_data(
            cfg.sft, cfg.train, run, QUIET, tokenizer_path=sft_tokenizer_path(cfg.sft, cfg.model)
        )
        saved = transformers.AutoTokenizer.from_pretrained(run / "tokenizer")
        for (ids, _), (where, record) in zip(data.train.examples, records, strict=True):
            messages = to_example(record, "alpaca", None, where).messages
            want = saved.apply_chat_template(messages, tokenize=True, return_dict=False)
            assert len(ids) > 10 and ids.tolist() == want[: len(ids)]  # (an example may be cut to a row)
            if template == "tokenizer":
                theirs = own.apply_chat_template(messages, tokenize=True, return_dict=False)
                assert ids.tolist() == theirs[: len(ids)] and ids[0] != BOS
            else:
                assert ids[0] == BOS and ids[1] != BOS, template


def test_builtin_template_gets_bos_only_for_tokenizers_that_add_it():
    zephyr = choose_template("zephyr", {}, "</s>", "<s>", prefix="<s>")
    assert zephyr.source.startswith("{{ bos_token }}")
    assert zephyr.render([{"role": "user", "content": "hi"}]).startswith("<s><|user|>")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert choose_template("alpaca", {}, "</s>", "<s>", prefix="<s>").render(chat).count("<s>") == 1
    assert not choose_template("chatml", {}, "<|endoftext|>", None).source.startswith("{{ bos_token }}")
