"""bench/llamacpp_check.py's cases for models trained on hopperlm's own tokenizers: a byte-level BPE at two
vocabulary sizes (`prepare --tokenizer bpe`, as owt-350m prepares OpenWebText at 32K) and the byte tokenizer,
each prepared from Tiny Shakespeare + HornMT Tigrinya and trained from scratch (the debug model).

Each is exported with `export --format gguf` (f32 and q8_0) and checked in llama.cpp itself: `llama-tokenize`
gives hopperlm's ids on every string of the text set (bench/llamacpp_texts.py), and `llama-simple`'s greedy
continuation equals `hopperlm generate --temperature 0`'s (a divergence counts only after a near-tie: top-2
logits within NEAR_TIE; required of f32, shown for q8_0). llama.cpp's own convert_hf_to_gguf.py is run on the
`--format hf` folder too, and its refusal recorded: it recognises a byte-level BPE only by hashing a known
vocabulary's ids, so it converts none trained here (which is why export writes these GGUF files itself).
"""

from __future__ import annotations

from pathlib import Path

from llamacpp_cases import (
    REPO,
    convert_hf_to_gguf,
    greedy_agrees,
    hopperlm,
    hopperlm_greedy,
    llama_greedy,
    llama_tokenize_text,
)
from llamacpp_texts import GREEDY_PROMPT, NEAR_TIE, text_set

# case -> prepare's tokenizer options
OWN_CASES = {
    "bpe-1000": ["--tokenizer", "bpe", "--vocab-size", "1000"],
    "bpe-4000": ["--tokenizer", "bpe", "--vocab-size", "4000"],
    "byte": ["--tokenizer", "byte"],
}
STEPS = 300


def make_own_case(work: Path, data: Path, name: str) -> Path:
    """prepare -> train STEPS steps of the debug model: the run, as a user makes it."""
    corpus = work / "own-corpus.txt"
    if not corpus.is_file():
        text = (data / "tinyshakespeare" / "input.txt").read_text()[:400_000]
        corpus.write_text(text + (data / "hornmt" / "tir.txt").read_text()[:150_000])
    hopperlm("prepare", corpus, "--out", work / f"{name}-data", *OWN_CASES[name])
    hopperlm("train", REPO / "configs" / "debug.yaml", "--data.path", work / f"{name}-data",
             "--train.max_steps", STEPS, "--train.eval_every", "0", "--train.log_every", STEPS,
             "--log.report", "false", "--log.tensorboard", "false", "--run.out_dir", work / name)  # fmt: skip
    return work / name


def converter_says(source: Path, run: Path, work: Path, name: str) -> str:
    """What llama.cpp's converter does with the run's `--format hf` folder: 'converts', or its last error line."""
    hf = work / f"{name}-hf"
    hopperlm("export", run, hf, "--dtype", "fp32")
    try:
        convert_hf_to_gguf(source, hf, work / f"{name}-converted.gguf")
    except RuntimeError as e:
        return "refuses: " + [line for line in str(e).splitlines() if line.strip()][-1][:200]
    return "converts"


def check_own(source: Path, work: Path, data: Path, n: int = 20) -> dict:
    """Rows (one per case and GGUF file) and a table; source: the llama.cpp folder (build/bin, converter)."""
    from hopperlm.data.tokenizer import load_tokenizer

    bin_dir = source / "build" / "bin"
    texts = text_set(data)
    rows = []
    for name in OWN_CASES:
        run = make_own_case(work, data, name)
        tokenizer = load_tokenizer(run / "tokenizer")
        ours = hopperlm_greedy(run, GREEDY_PROMPT, n)
        converter = converter_says(source, run, work, name)
        for outtype in ("f32", "q8_0"):
            out = work / f"{name}-{outtype}.gguf"
            hopperlm("export", run, out, "--format", "gguf", "--outtype", outtype)
            differ = {
                label: ids
                for label, text in texts.items()
                if (ids := llama_tokenize_text(bin_dir, out, text, work / "text.txt"))
                != tokenizer.encode(text)
            }
            theirs = llama_greedy(bin_dir, out, GREEDY_PROMPT, n)
            rows.append({
                "case": name, "gguf": f"export --format gguf {outtype}", "vocab_size": tokenizer.vocab_size,
                "texts": len(texts), "texts_differing": sorted(differ), "ids_equal": not differ,
                "hopperlm_greedy": ours, "llama_cpp_greedy": theirs, "greedy_equal": theirs == ours,
                "greedy_agrees": greedy_agrees(run, GREEDY_PROMPT, theirs, ours, NEAR_TIE),
                "greedy_required": outtype == "f32", "convert_hf_to_gguf": converter,
            })  # fmt: skip
    table = [f"{'case':<10}{'gguf':<26}{'text set ids':>14}{'greedy':>10}  convert_hf_to_gguf"]
    for r in rows:
        ids = "all equal" if r["ids_equal"] else f"{len(r['texts_differing'])} differ"
        greedy = "equal" if r["greedy_equal"] else "near-tie" if r["greedy_agrees"] else "NO"
        table.append(f"{r['case']:<10}{r['gguf']:<26}{ids:>14}{greedy + ('' if r['greedy_required'] else '*'):>10}"
                     f"  {r['convert_hf_to_gguf'][:60]}")  # fmt: skip
    agree = all(r["ids_equal"] and (r["greedy_agrees"] or not r["greedy_required"]) for r in rows)
    table.append(f"{'every own-tokenizer case agrees' if agree else 'NOT every own-tokenizer case agrees'}: "
                 f"{len(texts)} texts, greedy {n} tokens (* q8_0: shown, not required)")  # fmt: skip
    return {"rows": rows, "table": table, "all_agree": agree, "tokens": n, "near_tie": NEAR_TIE}
