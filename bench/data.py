"""Benchmark (not a test): is data ever the bottleneck?

1. Tokenization: `hopperlm prepare` (worker processes, shards written) against `datasets.Dataset.map(batched=True)`
   with the same tokenizer (a transformers fast tokenizer built from the same tokenizer.json) on the same text,
   measured side by side. The baseline is timed for the map alone (its load_dataset is free); ours end to end.
2. Loading: tokens/s that the training loader delivers from memory-mapped shards on ONE core (this process is
   pinned to a single CPU) for each sampling mode, against the ~250K tokens/s the h100-350m preset consumes
   on an H100 at about 60% MFU (its ceiling at 100% MFU is 421K: the 989 TFLOP/s H100 SXM datasheet peak over
   2.35 GFLOP/token, 6N + 12LdT from PaLM appendix B as in nanoGPT's estimate_mfu).

    python bench/data.py [--corpus-mb 24] [--tokenizer PATH] [--save bench/results/DATE-data.json]

Needs `datasets` and `transformers` for the baseline (bench only: pip install datasets transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from harness import DATA as DATA_DIR

from hopperlm.config import DataConfig
from hopperlm.data.batches import BatchLayout, train_batches
from hopperlm.data.loader import TokenShards
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.data.train_data import resolve_datasets
from hopperlm.hardware import cpu_cores
from hopperlm.provenance import provenance

H100_350M_TOKENS_PER_S = 250_000
TARGET_TOKENIZE_RATIO, TARGET_LOADER_RATIO = 2.0, 50.0


def corpus(folder: Path, megabytes: float) -> Path:
    """English Gutenberg books, as symlinks, up to about `megabytes`."""
    folder.mkdir(parents=True)
    total = 0
    for book in sorted((DATA_DIR / "gutenberg").glob("pg*.txt")):
        if total >= megabytes * 1e6:
            break
        (folder / book.name).symlink_to(book)
        total += book.stat().st_size
    return folder


def bench_ours(folder: Path, tokenizer: Path, out: Path) -> dict:
    start = time.perf_counter()
    manifest = prepare(
        [folder],
        out,
        PrepareOptions(tokenizer=str(tokenizer), val_fraction=0.0),
        workers=None,
        progress=False,
    )
    seconds = time.perf_counter() - start
    tokens = manifest["tokens"]["train"] - manifest["documents"]  # without the EOS ids prepare adds
    return {"seconds": round(seconds, 2), "tokens": tokens}


def bench_datasets(folder: Path, tokenizer: Path, cache: Path, num_proc: int | None) -> dict:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    files = sorted(str(p) for p in folder.iterdir())
    ds = datasets.load_dataset(
        "text", data_files=files, split="train", cache_dir=str(cache), keep_linebreaks=True
    )
    start = time.perf_counter()
    mapped = ds.map(
        lambda batch: tok(batch["text"], add_special_tokens=False),
        batched=True,
        num_proc=num_proc,
        remove_columns=["text"],
        load_from_cache_file=False,
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in mapped["input_ids"])
    return {"seconds": round(seconds, 2), "tokens": tokens, "num_proc": num_proc or 1}


def bench_loader(
    data: Path, sampling: str, packing: bool, mixture: bool, prefetch: int, seq_len: int, micro: int
) -> dict:
    cfg = DataConfig(
        path="" if mixture else str(data),
        sampling=sampling,
        packing=packing,
        mixture={str(data): 0.7, str(data) + "-copy": 0.3} if mixture else None,
        prefetch=prefetch,
    )
    datasets = resolve_datasets(cfg)
    shards = [TokenShards(d.path, "train") for d in datasets]
    batches = train_batches(
        cfg,
        datasets,
        shards,
        seq_len=seq_len,
        layout=BatchLayout(micro_batch=micro),
        seed=0,
        pin=False,
        prefetch=prefetch,
    )
    for step in range(20):  # warm the page cache and the thread
        batches.next(step, 0)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < 3.0:
        batches.next(20 + count, 0)
        count += 1
    seconds = time.perf_counter() - start
    batches.close()
    tokens_per_s = count * micro * seq_len / seconds
    return {
        "sampling": sampling,
        "packing": packing,
        "mixture": mixture,
        "prefetch": prefetch,
        "tokens_per_s": round(tokens_per_s),
        "x_h100_350m": round(tokens_per_s / H100_350M_TOKENS_PER_S, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=DATA_DIR / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json",
    )
    parser.add_argument("--seq-len", type=int, default=512, help="configs/owt-350m-h100.yaml: 512")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--save", help="write the results as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = corpus(tmp / "books", args.corpus_mb)
        mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
        print(
            f"corpus: {len(list(folder.iterdir()))} Gutenberg books, {mb:.1f} MB; tokenizer {args.tokenizer}"
        )
        ours = bench_ours(folder, args.tokenizer, tmp / "shards")
        base = bench_datasets(folder, args.tokenizer, tmp / "hf-cache", None)
        base_mp = bench_datasets(folder, args.tokenizer, tmp / "hf-cache-mp", cpu_cores())
        tokenize = {
            "corpus_mb": round(mb, 1),
            "ours": ours,
            "datasets_map": base,
            "datasets_map_num_proc": base_mp,
        }
        for r in (ours, base, base_mp):
            r["mb_per_s"] = round(mb / r["seconds"], 2)
            r["tokens_per_s"] = round(r["tokens"] / r["seconds"])
        tokenize["ratio_vs_map"] = round(base["seconds"] / ours["seconds"], 2)
        tokenize["ratio_vs_map_num_proc"] = round(base_mp["seconds"] / ours["seconds"], 2)

        shutil.copytree(tmp / "shards", str(tmp / "shards") + "-copy")  # a second dataset for the mixture
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # ONE core from here on
        import torch

        torch.set_num_threads(1)
        modes = [
            ("random", False, False, 0),
            ("random", True, False, 0),
            ("sequential", False, False, 0),
            ("sequential", True, False, 0),
            ("random", True, True, 0),
            ("sequential", True, False, 2),
        ]
        loader = [bench_loader(tmp / "shards", *m, args.seq_len, args.micro_batch) for m in modes]

    report = {
        **provenance(),
        "tokenize": tokenize,
        "loader": {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "cores": 1, "modes": loader},
        "h100_350m_tokens_per_s": H100_350M_TOKENS_PER_S,
    }
    print(f"\n{'tokenization':<44}{'seconds':>9}{'MB/s':>8}{'tokens/s':>12}{'ratio':>8}")
    rows = [
        ("hopperlm prepare (workers, shards written)", ours, 1.0),
        ("datasets map(batched=True)", base, ours["seconds"] / base["seconds"]),
        (
            f"datasets map(batched=True, num_proc={base_mp['num_proc']})",
            base_mp,
            ours["seconds"] / base_mp["seconds"],
        ),
    ]
    for name, r, ratio in rows:
        print(f"{name:<44}{r['seconds']:>9}{r['mb_per_s']:>8}{r['tokens_per_s']:>12,}{ratio:>8.2f}")
    met = tokenize["ratio_vs_map"] >= TARGET_TOKENIZE_RATIO
    print(
        f"target: >= {TARGET_TOKENIZE_RATIO}x map(batched=True): {tokenize['ratio_vs_map']}x ({'met' if met else 'MISSED'})"
    )
    print(
        f"\n{f'loader on one core (T={args.seq_len}, B={args.micro_batch})':<44}{'tokens/s':>14}{'x H100 350m':>13}"
    )
    for r in loader:
        name = f"{r['sampling']}{' +packing' if r['packing'] else ''}{' +mixture' if r['mixture'] else ''}"
        name += f" +prefetch {r['prefetch']}" if r["prefetch"] else ""
        print(f"{name:<44}{r['tokens_per_s']:>14,}{r['x_h100_350m']:>13}")
    worst = min(r["x_h100_350m"] for r in loader)
    print(
        f"target: >= {TARGET_LOADER_RATIO}x {H100_350M_TOKENS_PER_S:,} tokens/s: worst mode {worst}x ({'met' if worst >= TARGET_LOADER_RATIO else 'MISSED'})"
    )
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
