"""The text set every tokenizer export is checked on (tests/test_gguf_vocab.py, bench/llamacpp_check.py): not
only prose, but what tokenizers split differently when their pre-tokenizers differ even slightly: code with
tabs and runs of spaces, long digit runs, Ge'ez script, CJK, emoji (with modifiers and flags), leading and
trailing whitespace, several newlines in a row, non-breaking and wide spaces, SentencePiece's '▁' as a
character of its own, and the empty string."""

from __future__ import annotations

from pathlib import Path

GREEDY_PROMPT = "ROMEO:\nWhat light through yonder window breaks? It is the"  # mid-line: text follows
NEAR_TIE = 0.01  # a greedy divergence counts only where hopperlm's top-2 logits are further apart than this


def tigrinya_line(data_dir: Path) -> str:
    """The first line of HornMT's Tigrinya side (Ge'ez script, with its own punctuation '።' and '፣')."""
    with open(data_dir / "hornmt" / "tir.txt", encoding="utf-8") as f:
        return f.readline().rstrip("\n")


def text_set(data_dir: Path) -> dict[str, str]:
    """Label -> text."""
    return {
        "English prose": "The quick brown fox jumps over the lazy dog. It's what we'd've done, isn't it? DON'T!",
        "code": "def f(x):\n\treturn x  +  1\n\n\tif x:\n        pass   # four spaces\n\t\t}}  ;;\r\n",
        "digit runs": "1234567890123456789 and 3.14159265358979 and 0000000, 2026-11-28",
        "Tigrinya": tigrinya_line(data_dir) + " ፩፪፫",
        "CJK": "日本語のテキスト、中文文本。한국어 텍스트",
        "emoji": "emoji 😀👍🏽 🇪🇹 ❤️‍🔥 done",
        "outer whitespace": "   leading and trailing whitespace \t  ",
        "newlines": "several\n\n\n\nnewlines\n\n",
        "odd spaces": "a\u00a0b\u2003c \u2581 x\u200bz",
        "one space": " ",
        "empty": "",
    }
