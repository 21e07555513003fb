"""What `hopperlm prepare` makes of its inputs: the options that decide the shards' content.

These are exactly the options an interrupted prepare must find unchanged to resume (prepare.py fingerprints
them with the inputs), so they travel as one value. How the work is done (worker processes, the progress bar,
overwriting an existing folder) changes nothing in the result and stays a keyword of `prepare` itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hopperlm.data.encoding import DOC_FORMATS
from hopperlm.data.sources import BAD_UTF8
from hopperlm.errors import DataError

SPLIT_METHODS = ("tail", "docs")


@dataclass(frozen=True)
class PrepareOptions:
    """The shards' content. Checked when made: a bad value raises DataError naming the flag and the fix.

    tokenizer    "byte", "bpe" (trained on the inputs, `vocab_size` pieces), a tokenizer folder or a Hub name
    val_fraction share of tokens held out; split "tail" (the last fraction, nanoGPT's) or "docs" (by a hash of
                 each document's text)
    doc_format   "auto" / "tokenizer" (each document as the tokenizer's own `tokenizer(text)`: BOS first for
                 Llama tokenizers; EOS after it for tokenizers that add nothing) or "eos" (EOS after each)
    dedup        drop exact duplicate documents; filter: a document filter (see sources.py); bad_utf8
                 "reject" (stop) or "skip" (leave the line out)
    """

    tokenizer: str = "byte"
    vocab_size: int | None = None
    val_fraction: float = 0.1
    split: str = "tail"
    text_field: str = "text"
    shard_tokens: int = 100_000_000
    dedup: bool = False
    bad_utf8: str = "reject"
    filter: str | None = None
    doc_format: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", str(self.tokenizer))  # a Path to a tokenizer folder is fine
        if not 0 <= self.val_fraction <= 0.5:
            raise DataError(
                f"--val-fraction {self.val_fraction} is outside [0, 0.5]; 0.1 is the usual choice"
            )
        if self.split not in SPLIT_METHODS:
            raise DataError(
                f"--split {self.split!r} is unknown; use 'tail' (last fraction of tokens) or 'docs'"
            )
        if self.shard_tokens < 1:
            raise DataError(f"--shard-tokens {self.shard_tokens} must be a positive token count")
        if self.tokenizer == "bpe" and self.vocab_size is None:
            raise DataError("--vocab-size is required with --tokenizer bpe")
        if self.tokenizer != "bpe" and self.vocab_size is not None:
            raise DataError(
                f"--vocab-size only applies to --tokenizer bpe (this run uses {self.tokenizer}); drop it"
            )
        if self.bad_utf8 not in BAD_UTF8:
            raise DataError(
                f"--bad-utf8 {self.bad_utf8!r} is unknown; use 'reject' (stop) or 'skip' (leave the line out)"
            )
        if self.doc_format not in DOC_FORMATS:
            raise DataError(
                f"--doc-format {self.doc_format!r} is unknown; use auto (the tokenizer's own special tokens "
                "when it adds any, else EOS), tokenizer or eos"
            )

    def fingerprint(self, tokenizer_identity: str) -> dict:
        """The options as a resumed prepare compares them, the tokenizer named by its identity (a folder's
        content, not its path)."""
        return {**dataclasses.asdict(self), "tokenizer": tokenizer_identity}
