"""The vocabulary of a GGUF file (`export --format gguf`), built from a run's tokenizer/ folder before anything
is written, so that a tokenizer llama.cpp cannot run as hopperlm does is refused in one line with no file left.

Three kinds, each written as llama.cpp then tokenizes every text exactly as hopperlm does:
- SentencePiece (a tokenizer.model beside the tokenizer.json: imported Llama-family models): llama.cpp's `llama`
  model with SentencePiece's pieces, scores and token types (without the scores llama.cpp rebuilds the vocabulary
  and tokenizes differently).
- hopperlm's byte-level BPE (`prepare --tokenizer bpe`, `tokenizer train --kind bpe`: tokenizers' ByteLevel
  pre-tokenizer, which splits with GPT-2's regex): llama.cpp's `gpt2` model with the pieces, merges and the
  pre-tokenizer `gpt-2`, the one llama.cpp (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT2) splits with that same
  regex, `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`. Any other
  tokenizer.json (another pre-tokenizer, a normalizer, a Unigram model) is refused: llama.cpp would split or
  merge it otherwise.
- the byte tokenizer (ids 0..255 are the bytes, 256 EOS): the same `gpt2` model with the 256 byte symbols of
  GPT-2's byte-level alphabet in byte order and no merge that ever applies, so every text becomes its UTF-8
  bytes whatever the pre-tokenizer splits (llama.cpp's `llama` model cannot: it writes a space as '▁' first).
Special ids, add-BOS/EOS and the chat template follow what hopperlm encodes and generates with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hopperlm.data.tokenizer import (
    BPE_EOS,
    HF_FILE,
    SP_FILE,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    sentencepiece_style,
)
from hopperlm.errors import CheckpointError, ConfigError, DataError

# llama.cpp's name for the split hopperlm's byte-level BPE uses (convert_hf_to_gguf.py's get_vocab_base_pre
# gives it to GPT-2's tokenizer; llama-vocab.cpp maps it to LLAMA_VOCAB_PRE_TYPE_GPT2, GPT-2's regex)
GPT2_PRE = "gpt-2"
# tokenizers' ByteLevel pre-tokenizer as train_bpe builds it: GPT-2's regex, no space put before the text
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
RETRAIN = (
    "train a byte-level BPE with `hopperlm tokenizer train CORPUS --kind bpe` (or prepare --tokenizer bpe)"
)
# llama.cpp refuses a gpt2 vocabulary without merges and the gguf package writes no empty array: the byte
# vocabulary gets one merge of two strings no split ever holds as symbols (no merge makes them), never applied
NEVER_MERGED = "ĠĠĠ ĠĠĠ"


@dataclass
class GGUFVocab:
    """What a GGUF file says about its tokenizer (the `tokenizer.ggml.*` keys)."""

    model: str  # llama.cpp's tokenizer model: llama (SentencePiece) or gpt2 (byte-level BPE)
    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[bytes]
    types: list[int]  # gguf.TokenType per token
    scores: list[float] | None = None  # SentencePiece's only
    merges: list[str] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)  # bos / eos / unk / pad -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    def write(self, writer) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.merges:
            writer.add_token_merges(self.merges)
        adders = {
            "bos": writer.add_bos_token_id,
            "eos": writer.add_eos_token_id,
            "unk": writer.add_unk_token_id,
            "pad": writer.add_pad_token_id,
        }
        for key, token_id in self.special_ids.items():
            adders[key](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def require_gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "GGUF export needs the gguf package (llama.cpp's writer): pip install 'hopperlm[gguf]'"
        ) from None
    return gguf


def byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character that stands for each byte 0..255, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def read_vocab(tokenizer_dir: Path, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of a run's tokenizer/ folder, padded to the model's vocab_size; a DataError (one
    line, naming the tokenizer and the fix) for a folder that is missing, damaged or not expressible."""
    fix = "copy the tokenizer/ folder of the run (or of the data it was prepared with) back there"
    if not tokenizer_dir.is_dir():
        raise DataError(f"{tokenizer_dir} is missing: a GGUF file carries the run's tokenizer; {fix}")
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (DataError, OSError, ValueError) as e:
        why = str(e).split("; ")[0]  # the loader's own fix points at a tokenizer to load, not at this folder
        raise DataError(f"{tokenizer_dir} is damaged ({why}); {fix}") from e
    if isinstance(tokenizer, HFTokenizer) and SP_FILE in tokenizer._files:  # its own, checked on load
        vocab = sentencepiece_vocab(tokenizer_dir, vocab_size)
    elif isinstance(tokenizer, HFTokenizer) and sentencepiece_style(json.loads(tokenizer._raw)):
        raise DataError(
            f"{tokenizer_dir} has no tokenizer.model (SentencePiece) of its own: GGUF's llama vocabulary needs "
            "its scores, or llama.cpp tokenizes differently from hopperlm; copy the base model's tokenizer.model "
            "(the same pieces) into that folder and export again"
        )
    elif isinstance(tokenizer, ByteTokenizer):
        vocab = byte_vocab(tokenizer, vocab_size)
    elif isinstance(tokenizer, HFTokenizer):
        vocab = byte_level_bpe_vocab(tokenizer, tokenizer_dir, vocab_size)
    else:  # a bare SentencePiece .model: the pieces without tokenizer.json's added tokens and configs
        vocab = sentencepiece_vocab(tokenizer_dir, vocab_size)
    if isinstance(tokenizer, HFTokenizer) and isinstance(tokenizer.config.get("chat_template"), str):
        vocab.chat_template = tokenizer.config["chat_template"]
    return vocab


def _pad(vocab: GGUFVocab, vocab_size: int) -> GGUFVocab:
    """Unused [PADi] tokens up to the model's embedding rows, as llama.cpp's converter pads."""
    gguf = require_gguf()
    if len(vocab.tokens) > vocab_size:
        raise CheckpointError(
            f"the tokenizer has {len(vocab.tokens)} tokens but the model's vocabulary {vocab_size}: export the "
            "run's own tokenizer (its tokenizer/ folder), not another"
        )
    for i in range(len(vocab.tokens), vocab_size):
        vocab.tokens.append(f"[PAD{i}]".encode())
        vocab.types.append(int(gguf.TokenType.UNUSED))
        if vocab.scores is not None:
            vocab.scores.append(-1000.0)
    return vocab


def byte_vocab(tokenizer: ByteTokenizer, vocab_size: int) -> GGUFVocab:
    """The byte tokenizer as llama.cpp's gpt2 model: byte b is the byte-level symbol of b (id b), EOS after."""
    gguf = require_gguf()
    tokens = [c.encode("utf-8") for c in byte_level_alphabet()] + [BPE_EOS.encode()]
    types = [int(gguf.TokenType.NORMAL)] * 256 + [int(gguf.TokenType.CONTROL)]
    assert len(tokens) == tokenizer.eos_id + 1
    # BOS: EOS, the token before every document but the first (prepare puts it between them); never added
    specials = {"bos": tokenizer.eos_id, "eos": tokenizer.eos_id}
    vocab = GGUFVocab("gpt2", GPT2_PRE, tokens, types, merges=[NEVER_MERGED], special_ids=specials)
    return _pad(vocab, vocab_size)


def _refuse_unless_gpt2_split(data: dict, where: str) -> None:
    """One DataError naming the pre-tokenizer (or model part) that llama.cpp's gpt-2 vocabulary would run
    differently from tokenizers."""
    model = data.get("model") or {}
    pre = data.get("pre_tokenizer") or {}
    problems = []
    if model.get("type", "BPE") != "BPE":
        problems.append(f"a {model.get('type')} model")
    if model.get("byte_fallback") or model.get("dropout") or model.get("ignore_merges"):
        problems.append("byte_fallback, dropout or ignore_merges in its BPE model")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        problems.append("a subword prefix or suffix in its BPE model")
    if data.get("normalizer"):
        problems.append(f"the normalizer {data['normalizer'].get('type')}")
    if any(pre.get(k, BYTE_LEVEL[k]) != v for k, v in BYTE_LEVEL.items()):
        problems.append(f"the pre-tokenizer {json.dumps(pre, ensure_ascii=False)[:160]}")
    if problems:
        raise DataError(
            f"{where} is not a byte-level BPE llama.cpp's `{GPT2_PRE}` pre-tokenizer runs as hopperlm does (it "
            f"has {'; '.join(problems)}; llama.cpp knows only its own fixed splits); {RETRAIN}, prepare and train "
            "with it, or keep this model as it is with --format hopperlm or --format hf"
        )


def _special_layout(tokenizer: HFTokenizer, where: str) -> tuple[bool, bool]:
    """(add_bos, add_eos) as hopperlm encodes a model's input (encode_for_model): llama.cpp can add one BOS
    before and one EOS after, nothing else."""
    before, after = tokenizer.special_prefix_ids, tokenizer.special_suffix_ids
    if before not in ([], [tokenizer.bos_id]) or after not in ([], [tokenizer.eos_id]):
        raise DataError(
            f"{where}'s post-processor adds {before} before and {after} after the text; llama.cpp adds at most "
            f"BOS before and EOS after; {RETRAIN}"
        )
    return bool(before), bool(after)


def byte_level_bpe_vocab(tokenizer: HFTokenizer, tokenizer_dir: Path, vocab_size: int) -> GGUFVocab:
    """A byte-level BPE tokenizer.json as llama.cpp's gpt2 model with the gpt-2 pre-tokenizer (module doc):
    pieces by id, merges in rank order, added tokens as CONTROL (special) or USER_DEFINED, as the converter."""
    gguf = require_gguf()
    where = str(tokenizer_dir / HF_FILE)
    data = json.loads(tokenizer._raw)
    _refuse_unless_gpt2_split(data, where)
    add_bos, add_eos = _special_layout(tokenizer, where)
    pieces: dict[int, str] = {i: piece for piece, i in data["model"]["vocab"].items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    pieces.update({i: t["content"] for i, t in added.items()})
    if sorted(pieces) != list(range(len(pieces))):
        raise DataError(
            f"{where}: its ids skip some numbers, so llama.cpp's token list cannot hold them; {RETRAIN}"
        )
    tokens, types = [], []
    for i in range(len(pieces)):
        tokens.append(pieces[i].encode("utf-8"))
        kind = gguf.TokenType.NORMAL
        if i in added:
            kind = gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
        types.append(int(kind))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    # no BOS of its own: EOS, the token before every document but the first (prepare puts it between them);
    # llama.cpp's gpt2 vocabulary would otherwise call id 11 BOS
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    specials = {"bos": bos, "eos": tokenizer.eos_id}
    vocab = GGUFVocab("gpt2", GPT2_PRE, tokens, types, merges=merges or [NEVER_MERGED], special_ids=specials)
    vocab.add_bos, vocab.add_eos = add_bos, add_eos
    return _pad(vocab, vocab_size)


def sentencepiece_vocab(tokenizer_dir: Path, vocab_size: int) -> GGUFVocab:
    """llama.cpp's llama model: tokenizer.model's pieces, scores and types, then tokenizer.json's added tokens
    past it, then padding (llama.cpp's converter does the same); special ids from tokenizer_config.json."""
    import sentencepiece

    gguf = require_gguf()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_dir / SP_FILE))
    types = gguf.TokenType
    tokens, scores, kinds = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        kind = types.NORMAL
        if sp.is_unknown(i):
            kind = types.UNKNOWN
        elif sp.is_control(i):
            kind = types.CONTROL
        elif sp.is_unused(i):
            kind = types.UNUSED
        elif sp.is_byte(i):
            kind = types.BYTE
        kinds.append(int(kind))
    tokenizer_json = tokenizer_dir / HF_FILE
    added = json.loads(tokenizer_json.read_text()).get("added_tokens", []) if tokenizer_json.is_file() else []
    for token in sorted(added, key=lambda t: t["id"]):
        if token["id"] < len(tokens):
            continue
        if token["id"] != len(tokens):
            raise CheckpointError(
                f"{tokenizer_json}: added token ids skip {len(tokens)}; cannot lay out the vocabulary"
            )
        tokens.append(token["content"].encode("utf-8"))
        scores.append(-1000.0)
        kinds.append(int(types.CONTROL if token.get("special") else types.USER_DEFINED))
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    vocab = GGUFVocab("llama", "default", tokens, kinds, scores=scores)
    ids = {piece: i for i, piece in enumerate(tokens)}
    for key in ("bos", "eos", "unk", "pad"):
        token = config.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token.encode("utf-8") in ids:
            vocab.special_ids[key] = ids[token.encode("utf-8")]
    vocab.add_bos = adds_bos(config)
    vocab.add_eos = bool(config.get("add_eos_token", False))
    return _pad(vocab, vocab_size)


def adds_bos(tokenizer_config: dict) -> bool:
    """A SentencePiece vocabulary's add_bos_token: llama.cpp and Ollama put BOS before every prompt when true."""
    return bool(tokenizer_config.get("add_bos_token", True))  # Llama's tokenizers add BOS
