"""bench/llamacpp_check.py's check of the quantized GGUF files: each one's held-out perplexity (llama.cpp's
`llama-perplexity`) within a tolerance of its f32 file's. It runs only where llama-perplexity is built: the
prebuilt llama.cpp in ../shared/tools has llama-tokenize, llama-simple and llama-quantize alone
(../shared/tools/README.md), and a run there says in one line that this check is skipped, names the last
results file that measured it, and records why; the other checks do not depend on it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

LAST_MEASURED = "bench/results/2026-11-27-llamacpp-check-cpu.json"  # the last run with llama-perplexity built


def not_checked(bin_dir: Path) -> str | None:
    """None where llama-perplexity is in bin_dir; else the one line saying the check is skipped, and why."""
    if (bin_dir / "llama-perplexity").is_file():
        return None
    return (
        f"quantized files' held-out perplexity not checked: llama-perplexity is not in {bin_dir} "
        f"(last measured: {LAST_MEASURED})"
    )


def heldout_texts(work: Path, data: Path) -> dict[str, Path]:
    """Language -> a held-out text file (40 KB), none of it trained on by any case."""
    heldout = {"English": work / "heldout-en.txt", "Tigrinya": work / "heldout-tir.txt"}
    heldout["English"].write_text((data / "tinyshakespeare" / "input.txt").read_text()[-40_000:])
    # not in training (HornMT is): a parallel corpus's Tigrinya side
    heldout["Tigrinya"].write_text(
        (data / "travis-tigrinya-parallel" / "TI_volunteers.txt").read_text()[:40_000]
    )
    return heldout


def llama_perplexity(bin_dir: Path, gguf: Path, text_file: Path, tries: int = 3) -> float:
    """llama-perplexity's final estimate. Run again when it exits 0 without one: llama.cpp logs from a worker
    thread, and now and then the process ends before the last lines are written (seen here once in ~30 runs,
    the 40th chunk and the estimate missing)."""
    for _ in range(tries):
        done = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c",
                               "128", "-b", "128", "--chunks", "40"], capture_output=True, text=True)  # fmt: skip
        m = re.search(r"Final estimate: PPL = ([\d.]+)", done.stdout + done.stderr)
        if m:
            return float(m.group(1))
        if done.returncode != 0:
            break
    raise RuntimeError(f"llama-perplexity gave no estimate:\n{(done.stdout + done.stderr)[-2000:]}")


def model_vocab_size(model: Path) -> int:
    from hopperlm.checkpoint.layout import read_model_config, resolve_model_dir

    return read_model_config(resolve_model_dir(model)).vocab_size


def measure(bin_dir: Path, rows: list[dict], ggufs: dict[str, Path], model: Path, heldout: tuple[str, Path],
            tolerances: dict[str, float]) -> None:  # fmt: skip
    """Add one case's perplexities to its rows (one per GGUF file, in ggufs' order), and to each quantized
    export's row its change against f32's and whether that is within the tolerance."""
    language, text_file = heldout
    ppl = {}
    for row, (how, path) in zip(rows, ggufs.items(), strict=True):
        ppl[how] = row["perplexity"] = llama_perplexity(bin_dir, path, text_file)
        row["heldout"] = language
    f32 = ppl["export --format gguf f32"]
    for q, tolerance in tolerances.items():
        row = rows[list(ggufs).index(f"export --format gguf {q}")]
        row[f"{q}_ppl_ratio"] = row["perplexity"] / f32
        row[f"{q}_vs_f32"] = row["perplexity"] / f32 - 1
        row[f"{q}_within_tolerance"] = abs(row["perplexity"] / f32 - 1) <= tolerance
        vocab = model_vocab_size(model)
        if not row[f"{q}_within_tolerance"] and f32 > vocab:  # said, not excused: the row still fails
            row[f"{q}_note"] = (
                f"f32's held-out perplexity ({f32:,.0f}) is above the vocabulary size ({vocab:,}): the model "
                "predicts this text worse than a uniform guess, so its perplexity is set by the log-"
                "probabilities of tokens it holds near-impossible, which rounding moves by percents while "
                "the distribution barely moves (see llamacpp_check.py's docstring: KL divergence)"
            )


def summary(rows: list[dict], tolerances: dict[str, float]) -> tuple[list[str], bool]:
    """The table's lines on the measured perplexities, and whether every quantized export is within its
    tolerance."""
    checked = [(r, q) for r in rows for q in tolerances if f"{q}_vs_f32" in r]
    lines = []
    for r, q in checked:
        lines.append(f"{r['case']}: {q} perplexity {100 * r[f'{q}_vs_f32']:+.2f}% vs f32 "
                     f"(tolerance {100 * tolerances[q]:g}%)")  # fmt: skip
        if f"{q}_note" in r:
            lines.append(f"  {r[f'{q}_note']}")
    return lines, all(r[f"{q}_within_tolerance"] for r, q in checked)
