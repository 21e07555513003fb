"""Hugging Face interop, tokenizers: the tokenizer files of an exported folder, for every kind hopperlm writes.

`transformers.AutoTokenizer.from_pretrained` must load what `export` writes and encode, decode and render chat
exactly as hopperlm does; `import` must get hopperlm's own tokenizer back. Per kind:
  byte           tokenizer.json: a byte-level BPE without merges whose ids are the UTF-8 bytes (0..255) and
                 EOS 256 `<|endoftext|>`, so transformers encodes any text to hopperlm's ids; beside it the
                 marker hopperlm-byte.json, which `import` keeps as the byte tokenizer (same sha256 as data
                 prepared with `--tokenizer byte`)
  tokenizer.json trained BPE/Unigram, extended or Hugging Face tokenizers: the file as it is, with every file
                 that came with it (data/tokenizer.py's COMPANION_FILES: tokenizer.model, configs, chat template)
  tokenizer.model a SentencePiece model: kept, with its equivalent tokenizer.json (data/sp_convert.py) whose
                 template puts BOS first, as hopperlm encodes it for the model
tokenizer.model is what llama.cpp's converter reads first: without it, it rebuilds a Llama vocabulary without
SentencePiece's scores and tokenizes differently (data/tokenizer.py says so once when one is missing).
and always a tokenizer_config.json naming every special token hopperlm resolved (eos_token, bos_token), so a
chat template's variables are defined in transformers too, plus `tokenizer_class` where none is named
(PreTrainedTokenizerFast: the tokenizer.json as it is, never a model family's rebuilt pipeline).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hopperlm.data.tokenizer import (
    BPE_EOS,
    BYTE_MARKER,
    COMPANION_FILES,
    HF_FILE,
    SP_FILE,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)

CONFIG_FILE = "tokenizer_config.json"
FAST_CLASS = "PreTrainedTokenizerFast"


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what a ByteLevel pre-tokenizer maps bytes to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> bytes:
    """hopperlm's byte tokenizer as a tokenizer.json: ids 0..255 are the UTF-8 bytes, 256 is EOS."""
    chars = gpt2_byte_chars()
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 256,
                "content": BPE_EOS,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {chars[b]: b for b in range(256)},
            "merges": [],
        },
    }
    return json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8")


def with_bos_template(raw: bytes, tokenizer: Tokenizer) -> bytes:
    """A tokenizer.json whose post-processor puts BOS first, as hopperlm (and sentencepiece's add_bos) encode
    a SentencePiece model's text for the model: transformers 5 follows tokenizer.json's template, not
    tokenizer_config.json's add_bos_token."""
    if tokenizer.bos_id is None:
        return raw
    data = json.loads(raw)
    bos = tokenizer.id_to_piece(tokenizer.bos_id)
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [tokenizer.bos_id], "tokens": [bos]}},
    }
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


def special_token_config(tokenizer: Tokenizer) -> dict[str, str]:
    """eos_token / bos_token as tokenizer_config.json names them, for the ids hopperlm resolved."""
    if tokenizer.kind == "byte":
        return {"eos_token": BPE_EOS}
    out = {}
    for key, tid in (("eos_token", tokenizer.eos_id), ("bos_token", tokenizer.bos_id)):
        piece = tokenizer.id_to_piece(tid) if tid is not None else None
        if piece:
            out[key] = piece
    return out


def write_hf_tokenizer(tokenizer_dir: Path, out_dir: Path, model_max_length: int | None = None) -> list[str]:
    """The files transformers loads for the hopperlm tokenizer in `tokenizer_dir`, written into out_dir (see
    the module doc). Returns the names written. Nothing is written for a folder without a tokenizer."""
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    if not tokenizer_dir.is_dir():
        return []
    tokenizer = load_tokenizer(tokenizer_dir)
    written = []
    if tokenizer.kind == "byte":
        (out_dir / HF_FILE).write_bytes(byte_tokenizer_json())
        shutil.copy2(tokenizer_dir / BYTE_MARKER, out_dir / BYTE_MARKER)
        written += [HF_FILE, BYTE_MARKER]
        config: dict = {}
    elif isinstance(tokenizer, SentencePieceTokenizer):
        from hopperlm.data.sp_convert import sentencepiece_to_hf

        raw, configs = sentencepiece_to_hf(tokenizer._raw, str(tokenizer_dir / SP_FILE))
        (out_dir / HF_FILE).write_bytes(with_bos_template(raw, tokenizer))
        shutil.copy2(tokenizer_dir / SP_FILE, out_dir / SP_FILE)  # the original: llama.cpp reads its scores
        written += [HF_FILE, SP_FILE]
        for name, data in configs.items():
            (out_dir / name).write_bytes(data)
            written.append(name)
        config = {}
    else:
        assert isinstance(tokenizer, HFTokenizer)
        tokenizer.save(out_dir)  # tokenizer.json as it is, with every file it came with (tokenizer.model too)
        written += [HF_FILE, *(f for f in COMPANION_FILES if (out_dir / f).is_file())]
        config = tokenizer.config
    config = {**config, **{k: v for k, v in special_token_config(tokenizer).items() if not config.get(k)}}
    config.setdefault("tokenizer_class", FAST_CLASS)
    config.setdefault("clean_up_tokenization_spaces", False)
    if model_max_length is not None:
        config.setdefault("model_max_length", model_max_length)
    (out_dir / CONFIG_FILE).write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if CONFIG_FILE not in written:
        written.append(CONFIG_FILE)
    return written


def token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos_token_id / eos_token_id of the hopperlm tokenizer in tokenizer_dir (for config.json and
    generation_config.json of a model that has no Hugging Face base to take them from)."""
    if not Path(tokenizer_dir).is_dir():
        return {}
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = {"eos_token_id": tokenizer.eos_id}
    if tokenizer.bos_id is not None:
        ids["bos_token_id"] = tokenizer.bos_id
    return ids
