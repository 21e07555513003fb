"""A Llama-style SentencePiece BPE model (`tokenizer.model`) as an equivalent Hugging Face `tokenizer.json`.

The vocabulary is the model's pieces in id order; the merges are rebuilt the way `transformers` converts
SentencePiece models (every split of a piece into two pieces of the vocabulary, ordered by the piece's score);
normalizer, decoder and byte fallback are Llama's. For the Llama-2 model this gives exactly the vocabulary and
the 61,249 merges of TinyLlama's published tokenizer.json. The result is checked against SentencePiece itself on
a sample text before it is used, so a model of another kind (Unigram, no dummy prefix) is refused, not
mis-converted.
"""

from __future__ import annotations

import json

from hopperlm.errors import DataError

SPACE_MARK = "\u2581"
CHECK_TEXT = (
    "Hello world! The quick brown fox, 1,234.5 km/h.\n  Indented   spaces\tand tabs.\n"
    "Caf\u00e9 na\u00efve \u2014 \u201cquoted\u201d \u00a0nbsp; \u4e2d\u6587; emoji \U0001f600; "
    "\u1230\u120b\u121d \u12a3\u1208\u1295\u1361\n\n"
)


def splits(piece: str, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of piece into two pieces of vocab, ordered as transformers orders them (by their ids): the
    merges that make piece. SentencePiece BPE joins any two neighbours whose concatenation is a piece, so a
    tokenizer.json agrees with it only when it holds all of them, ranked by the piece's score."""
    local = [
        (piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
    ]
    return sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))


def _merges(sp, vocab: dict[str, int]) -> list[str]:
    merges = []
    for piece, i in vocab.items():
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        score = sp.get_score(i)
        merges.extend((score, a, b) for a, b in splits(piece, vocab))
    merges.sort(key=lambda m: m[0], reverse=True)  # stable: ties keep the order above
    return [f"{a} {b}" for _, a, b in merges]


def sentencepiece_to_hf(raw: bytes, where: str) -> tuple[bytes, dict[str, bytes]]:
    """(tokenizer.json bytes, {special_tokens_map.json: bytes}) equivalent to the SentencePiece model raw."""
    import sentencepiece
    from tokenizers import Tokenizer as RustTokenizer

    sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    special = [i for i in range(len(vocab)) if sp.is_control(i) or sp.is_unknown(i)]
    unk = sp.id_to_piece(sp.unk_id())
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": sp.id_to_piece(i),
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in special
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": SPACE_MARK},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "vocab": vocab,
            "merges": _merges(sp, vocab),
        },
    }
    text = json.dumps(data, ensure_ascii=False)
    converted = RustTokenizer.from_str(text)
    lines = CHECK_TEXT.splitlines()
    if [converted.encode(line, add_special_tokens=False).ids for line in lines] != [
        sp.encode(line) for line in lines
    ]:
        raise DataError(
            f"{where} is not a Llama-style SentencePiece BPE model (the converted tokenizer.json would encode "
            "differently); pass a tokenizer.json instead"
        )
    tokens = {"unk_token": unk}
    if sp.bos_id() >= 0:
        tokens["bos_token"] = sp.id_to_piece(sp.bos_id())
    if sp.eos_id() >= 0:
        tokens["eos_token"] = sp.id_to_piece(sp.eos_id())
    return text.encode("utf-8"), {"special_tokens_map.json": json.dumps(tokens, indent=2).encode("utf-8")}


def extend_sentencepiece(raw: bytes, pieces: list[str], *, first_id: int, where: str) -> bytes:
    """The SentencePiece BPE model `raw` with `pieces` appended as ordinary pieces (ids from its size on, in
    this order), as Chinese-LLaMA-Alpaca extended LLaMA's: each scores below every piece before it (by 1, or by
    one float32 step where 1 is lost in rounding, e.g. below Llama's -1e9 whitespace runs), so SentencePiece,
    which joins the highest-scoring neighbours first, joins them after every old piece and in this order: the
    rank of their merges (splits()) in the extended tokenizer.json."""
    import numpy as np
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(raw)
    if model.trainer_spec.model_type != pb.TrainerSpec.BPE:
        raise DataError(f"{where} is not a SentencePiece BPE model; extend its tokenizer.json alone")
    if len(model.pieces) != first_id:  # tokens the tokenizer.json added after the model's pieces
        raise DataError(
            f"{where} has {len(model.pieces)} pieces but the new ones start at id {first_id} (added tokens in "
            "between); extend the tokenizer.json alone (move the tokenizer.model away)"
        )
    score = np.float32(min(p.score for p in model.pieces))
    lower = np.float32(-np.inf)
    for piece in pieces:
        score = min(np.float32(score - 1), np.nextafter(score, lower))
        model.pieces.add(piece=piece, score=float(score), type=pb.ModelProto.SentencePiece.NORMAL)
    return model.SerializeToString()
