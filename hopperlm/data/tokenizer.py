"""One small interface over the three kinds of tokenizer hopperlm trains with.

- ``byte``: raw UTF-8 bytes (ids 0..255) plus an EOS id 256; needs no file, good for char-level demos.
- ``hf``: a Hugging Face ``tokenizer.json`` run by the Rust ``tokenizers`` library (what
  `tokenizer_train.train_bpe` makes).
- ``sentencepiece``: a ``*.model`` file (Llama-2 style).

Each tokenizer knows its own identity (kind, vocabulary, special ids and the sha256 of its file bytes), so a
prepared data directory and a training run can check that they were made with the very same tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hopperlm.errors import DataError
from hopperlm.files import sha256_hex

BYTE_IDENTITY = "hopperlm-byte-v1"
BYTE_MARKER = "hopperlm-byte.json"
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"
# Files beside a tokenizer.json that name its special tokens; copied on save so EOS resolves the same way.
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Every file beside a tokenizer.json that the tokenizer is made of: they travel with it through prepare, the run,
# checkpoints and exports. tokenizer.model is what llama.cpp's converter reads first (SentencePiece's scores).
COMPANION_FILES = (
    *HF_CONFIG_FILES,
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    SP_FILE,
)
TOKENIZER_FILES = (HF_FILE, *COMPANION_FILES)
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>")
BPE_EOS = "<|endoftext|>"


_SAID: set[str] = set()  # notes already printed by this process: each is said once, however often it loads


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


class Tokenizer:
    """Common interface. Subclasses set the attributes below in __init__."""

    kind: str
    name: str
    vocab_size: int  # ids the model must embed, special tokens included
    eos_id: int
    bos_id: int | None
    file: str | None  # the file name save() writes
    sha256: str
    encode_threads: int | None = None  # threads for encode_batch; None = all cores (prepare's workers set 1)

    def encode(self, text: str) -> list[int]:
        """Token ids of text, with no BOS/EOS added (prepare adds EOS between documents itself)."""
        raise NotImplementedError

    def encode_for_model(self, text: str) -> list[int]:
        """The ids a model is given for `text` as transformers' `tokenizer(text)` gives them: the special tokens
        the tokenizer's own conventions add (BOS first for Llama-2/TinyLlama, nothing for GPT-2 or Qwen2, nor
        for hopperlm's byte and trained tokenizers). `encode` never adds any."""
        return [*self.special_prefix_ids, *self.encode(text), *self.special_suffix_ids]

    @property
    def special_prefix_ids(self) -> list[int]:
        """The special ids encode_for_model puts before the text's own (e.g. [BOS]); [] when none."""
        return []

    @property
    def special_suffix_ids(self) -> list[int]:
        """The special ids encode_for_model puts after the text's own (e.g. a template's final EOS); []."""
        return []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def id_to_piece(self, i: int) -> str | None:
        """The vocabulary entry of id i as the tokenizer stores it (e.g. '▁the'); None when unknown."""
        return None

    def save(self, directory: Path) -> None:
        raise NotImplementedError

    def identity(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "sha256": self.sha256,
            "file": self.file,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is EOS. Lossless on any text, no file needed."""

    def __init__(self) -> None:
        self.kind = "byte"
        self.name = "byte"
        self.vocab_size = 257
        self.eos_id = 256
        self.bos_id = None
        self.file = BYTE_MARKER
        self.sha256 = sha256_hex(BYTE_IDENTITY.encode())

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_to_array(self, text: str) -> np.ndarray:
        """The fast path prepare uses: the bytes themselves as a uint8 array, no Python list in between."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        # EOS and any out-of-range id are dropped; a window cut mid-character decodes with U+FFFD.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        marker = {
            "format": BYTE_IDENTITY,
            "kind": "byte",
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
        }
        (directory / BYTE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _special_from_configs(configs: dict[str, bytes], key: str) -> tuple[str, str] | None:
    """(token text, config file name) for bos_token/eos_token from HF config files, if one names it."""
    for fname in HF_CONFIG_FILES:
        if fname not in configs:
            continue
        try:
            value = json.loads(configs[fname]).get(key)
        except (ValueError, AttributeError) as e:
            raise DataError(f"{fname} beside the tokenizer is not valid JSON ({e}); fix or remove it") from e
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value, fname
    return None


def sentencepiece_style(data: dict) -> bool:
    """Is this tokenizer.json (parsed) a SentencePiece BPE converted (Llama 2, TinyLlama, Mistral): byte
    fallback, and '▁' put before the text by a Prepend normalizer or a Metaspace pre-tokenizer?"""
    model = data.get("model") or {}
    front = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")])
    return (
        model.get("type", "BPE") == "BPE"
        and bool(model.get("byte_fallback"))
        and ('"Prepend"' in front or '"Metaspace"' in front)
    )


def _same_pieces(sp_raw: bytes, data: dict) -> bool:
    """Does the SentencePiece model sp_raw hold exactly the pieces of tokenizer.json `data`, id for id?"""
    import sentencepiece

    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        vocab = {entry[0]: i for i, entry in enumerate(vocab)}
    try:
        sp = sentencepiece.SentencePieceProcessor(model_proto=sp_raw)
    except Exception:  # not a SentencePiece model at all
        return False
    n = sp.get_piece_size()
    return (
        isinstance(vocab, dict)
        and n == len(vocab)
        and all(vocab.get(sp.id_to_piece(i)) == i for i in range(n))
    )


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json, kept as its raw bytes so save() reproduces the same sha256, with the files
    beside it that the tokenizer is made of (COMPANION_FILES, e.g. tokenizer.model), which save() writes too."""

    def __init__(self, raw: bytes, name: str, files: dict[str, bytes] | None = None, where: str = "") -> None:
        from tokenizers import Tokenizer as RustTokenizer

        where = where or name
        try:
            self._tok = RustTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception subclasses with its parse message
            raise DataError(f"{where} is not a valid tokenizer.json ({e}); point at a working one") from e
        self._raw = raw
        self._files = dict(files or {})
        self.kind = "hf"
        self.name = name
        self.file = HF_FILE
        self.sha256 = sha256_hex(raw)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._resolve("eos_token", EOS_CANDIDATES, where)
        if eos is None:
            raise DataError(
                f"{where} has no end-of-text token (none of {', '.join(EOS_CANDIDATES)} and no eos_token in "
                "tokenizer_config.json/special_tokens_map.json); add an eos_token to tokenizer_config.json"
            )
        self.eos_id = eos
        self.bos_id = self._resolve("bos_token", BOS_CANDIDATES, where)

    def _resolve(self, key: str, candidates: tuple[str, ...], where: str) -> int | None:
        named = _special_from_configs(self._files, key)
        if named is not None:
            token, fname = named
            tid = self._tok.token_to_id(token)
            if tid is None:
                raise DataError(
                    f"{fname} beside {where} names {key}={token!r}, which is not in the vocabulary"
                )
            return tid
        for token in candidates:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return tid
        return None

    @classmethod
    def from_file(cls, path: Path) -> HFTokenizer:
        path = Path(path)
        files = {f: (path.parent / f).read_bytes() for f in COMPANION_FILES if (path.parent / f).is_file()}
        name = path.parent.name if path.name == HF_FILE else path.stem
        tokenizer = cls(path.read_bytes(), name or path.stem, files, where=str(path))
        tokenizer._check_sentencepiece(str(path))
        return tokenizer

    def _check_sentencepiece(self, where: str) -> None:
        """Keep tokenizer.model only when it is this tokenizer.json's own (same pieces and ids: a stale one
        would make llama.cpp's converter, which reads it first, build another vocabulary); say once when a
        SentencePiece-converted tokenizer.json comes without its original."""
        data = json.loads(self._raw)
        if SP_FILE in self._files and _same_pieces(self._files[SP_FILE], data):
            return
        why = f"without its {SP_FILE}"
        if self._files.pop(SP_FILE, None) is not None:
            why = f"whose {SP_FILE} beside it has other pieces (left out: converters read it first)"
        elif not sentencepiece_style(data):
            return
        _say_once(
            f"tokenizer: {where} is a SentencePiece tokenizer.json {why}: hopperlm and transformers tokenize "
            "the same, but llama.cpp's convert_hf_to_gguf.py rebuilds the vocabulary without SentencePiece's "
            f"scores and tokenizes differently; put the base model's {SP_FILE} beside it (hopperlm keeps it "
            "from then on)"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_for_model(self, text: str) -> list[int]:
        return [*self.special_prefix_ids, *self.as_served().encode(text), *self.special_suffix_ids]

    def as_served(self) -> HFTokenizer:
        """This tokenizer as transformers 5 runs it when serving: the same, except that a SentencePiece-style
        tokenizer.json (a Prepend normalizer, as Llama 2 / TinyLlama / Mistral ship) gets LlamaTokenizer's
        Metaspace with prepend_scheme "first" unless tokenizer_config.json says `legacy: true`: '▁' only at the
        very start of the text, none after a special token written in it (so '</s>\n<|user|>' has no '▁'
        before the newline). Training on the other spelling would teach a context the model never sees."""
        if not hasattr(self, "_served"):
            data = json.loads(self._raw)
            self._served = self
            if '"Prepend"' in json.dumps(data.get("normalizer")) and self.config.get("legacy") is not True:
                data["normalizer"] = None
                data["pre_tokenizer"] = {
                    "type": "Metaspace",
                    "replacement": "\u2581",
                    "prepend_scheme": "first",
                    "split": False,
                }
                self._served = HFTokenizer(json.dumps(data).encode("utf-8"), self.name, self._files)
        return self._served

    @property
    def special_prefix_ids(self) -> list[int]:
        return self._special_ids()[0]

    @property
    def special_suffix_ids(self) -> list[int]:
        return self._special_ids()[1]

    def _special_ids(self) -> tuple[list[int], list[int]]:
        """(before, after) the text: what tokenizer.json's post-processor template adds (TinyLlama: BOS; none
        for GPT-2/Qwen2 or without a template). transformers 5 ignores tokenizer_config.json's add_bos_token
        and add_eos_token when a tokenizer.json exists (checked with 5.23), so they change nothing here."""
        if hasattr(self, "_specials"):
            return self._specials
        before, after = [], []
        if self._tok.post_processor is not None:  # probe the template with one ordinary character
            enc = self._tok.encode("a", add_special_tokens=True)
            own = [i for i, special in enumerate(enc.special_tokens_mask) if not special]
            first, last = (own[0], own[-1] + 1) if own else (len(enc.ids), len(enc.ids))
            before, after = enc.ids[:first], enc.ids[last:]
        self._specials = (before, after)
        return self._specials

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Parallel over all cores in Rust; the "fast" variant skips computing character offsets we never use.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def continuation(self) -> HFTokenizer | None:
        """This tokenizer minus the "▁" it puts before the start of every text (SentencePiece style: a Prepend
        normalizer, or a Metaspace pre-tokenizer with a prepend scheme), for encoding text that continues a
        document after a newline: the pieces then give exactly the ids of the whole document. None when the
        tokenizer adds nothing at the start (byte-level BPE), so any piece can be encoded as it is."""
        if hasattr(self, "_continuation"):
            return self._continuation
        data = json.loads(self._raw)
        changed = False

        def strip(component: dict | None, key: str) -> dict | None:
            nonlocal changed
            if component is None:
                return None
            if component.get("type") == "Sequence":
                parts = [strip(c, key) for c in component[key]]
                return {**component, key: [c for c in parts if c is not None]}
            if component.get("type") == "Prepend":
                changed = True
                return None
            if component.get("type") == "Metaspace" and component.get("prepend_scheme", "always") != "never":
                changed = True
                return {**component, "prepend_scheme": "never", "add_prefix_space": False}
            return component

        data["normalizer"] = strip(data.get("normalizer"), "normalizers")
        data["pre_tokenizer"] = strip(data.get("pre_tokenizer"), "pretokenizers")
        raw = json.dumps(data).encode("utf-8")
        self._continuation = HFTokenizer(raw, self.name, self._files) if changed else None
        return self._continuation

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of text (special tokens written in it are recognised) and each token's character span."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    @property
    def config(self) -> dict:
        """tokenizer_config.json beside the tokenizer.json, if any (chat template, special token names), with
        the chat template of chat_template.jinja/.json when it names none (transformers saves it there)."""
        raw = self._files.get("tokenizer_config.json")
        config = json.loads(raw) if raw else {}
        if "chat_template" not in config and "chat_template.jinja" in self._files:
            config["chat_template"] = self._files["chat_template.jinja"].decode("utf-8")
        elif "chat_template" not in config and "chat_template.json" in self._files:
            config["chat_template"] = json.loads(self._files["chat_template.json"]).get("chat_template")
        return config

    def with_config(self, config: dict) -> HFTokenizer:
        """The same tokenizer (same ids, same sha256) with another tokenizer_config.json, which then holds the
        one chat template (a chat_template.jinja/.json beside it would win in transformers: left out)."""
        files = {**self._files, "tokenizer_config.json": json.dumps(config, indent=2).encode("utf-8")}
        if "chat_template" in config:
            files = {k: v for k, v in files.items() if k not in ("chat_template.jinja", "chat_template.json")}
        return HFTokenizer(self._raw, self.name, files)

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / HF_FILE).write_bytes(self._raw)
        for fname, data in self._files.items():
            (directory / fname).write_bytes(data)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (Llama-2 style), kept as raw bytes for identity and save()."""

    def __init__(self, raw: bytes, name: str, where: str = "") -> None:
        import sentencepiece

        where = where or name
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with a terse parse message
            raise DataError(
                f"{where} is not a valid SentencePiece model ({e}); point at a working .model"
            ) from e
        self._raw = raw
        self.kind = "sentencepiece"
        self.name = name
        self.file = SP_FILE
        self.sha256 = sha256_hex(raw)
        self.vocab_size = self._sp.get_piece_size()
        eos, bos = self._sp.eos_id(), self._sp.bos_id()  # -1 means the model has none
        if eos < 0:
            raise DataError(
                f"{where} defines no EOS piece; use a SentencePiece model trained with eos_id >= 0"
            )
        self.eos_id = eos
        self.bos_id = bos if bos >= 0 else None

    @classmethod
    def from_file(cls, path: Path) -> SentencePieceTokenizer:
        path = Path(path)
        name = path.parent.name if path.name == SP_FILE else path.stem
        return cls(path.read_bytes(), name or path.stem, where=str(path))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    @property
    def special_prefix_ids(self) -> list[int]:
        """BOS first, as Llama-2 was trained and as sentencepiece's add_bos and the Hub's Llama-2 tokenizer.json
        encode. (transformers 5.23 given only a .model builds a tokenizer that adds none: not followed.)"""
        return [self.bos_id] if self.bos_id is not None else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        from hopperlm.hardware import cpu_cores  # here, not at the top: prepare's workers never import torch

        return self._sp.encode(texts, num_threads=self.encode_threads or cpu_cores())

    def decode(self, ids: list[int]) -> str:
        # sentencepiece raises on out-of-range ids; control pieces (BOS/EOS) already decode to nothing.
        return self._sp.decode([i for i in ids if 0 <= i < self.vocab_size])

    def id_to_piece(self, i: int) -> str | None:
        return self._sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SP_FILE).write_bytes(self._raw)


def _load_byte_marker(path: Path) -> ByteTokenizer:
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); delete it and save the tokenizer again") from e
    if not isinstance(marker, dict) or marker.get("kind") != "byte":
        raise DataError(
            f"{path} is not a hopperlm byte-tokenizer marker; delete it and save the tokenizer again"
        )
    return ByteTokenizer()


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """'byte', a tokenizer.json, a SentencePiece *.model, or a directory holding one (or the byte marker)."""
    if isinstance(spec, str) and spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    expected = "pass 'byte', a tokenizer.json, a SentencePiece .model file, or a directory holding one"
    if path.is_dir():
        for fname in (BYTE_MARKER, HF_FILE, SP_FILE):  # an HF export of a byte model: the marker first
            if (path / fname).is_file():
                return load_tokenizer(path / fname)
        raise DataError(
            f"tokenizer directory {path} has no {HF_FILE}, {SP_FILE} or {BYTE_MARKER}; {expected}"
        )
    if not path.is_file():
        raise DataError(f"tokenizer {spec} not found; {expected}")
    if path.name == BYTE_MARKER:
        return _load_byte_marker(path)
    if path.suffix == ".json":
        return HFTokenizer.from_file(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer.from_file(path)
    raise DataError(f"tokenizer {path} is neither a .json nor a .model file; {expected}")
