"""Call R: the matrix-proxy race (bench/race_matrix.py) at the next width, 256 (5.34M parameters untied, 90% in
block matrices, 3,915 steps of 4,096 tokens: 3 per parameter), on one GPU, in one stage of at most 9.5 minutes.

What runs: hopperlm's recipe and the best baseline at width 128 of the CPU race's results file, each at its
width-128 point (hopperlm carried by μP from width 64; nanochat's rules recomputed at 256 with its offsets kept;
nanoGPT's point as it is: no run is spent tuning at 256), 2 seeds each, and hopperlm at budget shares 0.5 and
0.7 on the same 2 seeds: 8 runs, all side by side on the one GPU (models this small leave it mostly idle),
eager (compiling each would cost more than it saves over ~4,000 steps). Then each time to target with its 90%
interval (race_intervals: with 2 seeds a coarse one, said as such).

The data: the Gutenberg books of gpu-carry-r/books.tar.xz (scripts/gpu_carry.sh --call-r packs every book of
../shared/data/gutenberg), unpacked and prepared there with a 1,024-piece BPE that `hopperlm tokenizer train`
learns on the first 30 books, as the CPU race's (its sha256 is compared with the CPU race's and the result says
whether they match); all books, so that 3,915 steps see each training token about once.

    python3 bench/gpu/race_r.py --books DIR --results RACE.json --out OUT.json      (on the GPU: campaign call R)
    python3 bench/gpu/race_r.py --smoke --out OUT.json                              (CPU, 3 books, width 64)
The JSON is rewritten after every run, so a stage cut off by its time limit keeps the runs that finished.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from harness import DATA, bench_command, hopperlm, prepare_data, save_result  # noqa: E402
from race_3tpp import flops_to_target  # noqa: E402
from race_intervals import intervals_of  # noqa: E402
from race_matrix import VOCAB, MatrixRace, recipe_maker  # noqa: E402
from race_runs import Runner, mean_loss  # noqa: E402

WIDTH = 256
SEEDS = (0, 1)
SHARES = (0.5, 0.7)
TOKENIZER_BOOKS = 30
CPU_RACE_TOKENIZER_SHA256 = (
    "b2ef25c6d70d260b10376f9994dd108cc2b5beea74632e0ae3fce3d2a7d347b2"  # its manifest's
)


def books_folder(books: Path, work: Path) -> Path:
    """`books` itself (a folder of .txt), or the folder a .tar.xz unpacks to under `work`."""
    if books.is_dir():
        return books
    out = work / "books"
    if not out.is_dir():
        with tarfile.open(books) as tar:
            tar.extractall(out, filter="data")
    return next((p.parent for p in sorted(out.rglob("*.txt"))), out)


def prepare(books: Path, work: Path, smoke: bool) -> tuple[Path, str]:
    """Shards of every book with the CPU race's kind of tokenizer (learned on the first books); its sha256."""
    files = sorted(books_folder(books, work).glob("pg*.txt"))[: 3 if smoke else None]
    if len(files) < (3 if smoke else TOKENIZER_BOOKS):
        sys.exit(
            f"race_r: {len(files)} books in {books}; need {TOKENIZER_BOOKS} (scripts/gpu_carry.sh --call-r)"
        )
    tokenizer = work / f"tokenizer-bpe{VOCAB}"
    if not (tokenizer / "tokenizer.json").is_file():
        hopperlm("tokenizer", "train", *map(str, files[:TOKENIZER_BOOKS]), "--vocab-size", str(VOCAB),
                 "--out", str(tokenizer))  # fmt: skip
    sha = hashlib.sha256((tokenizer / "tokenizer.json").read_bytes()).hexdigest()
    data = prepare_data(work / "shards", files, tokenizer=str(tokenizer / "tokenizer.json"),
                        split="tail" if smoke else "docs", val_fraction=0.1)  # fmt: skip
    return data, sha


def pair_from(results: dict | None) -> tuple[str, dict[str, dict]]:
    """(the best baseline at width 128, each recipe's width-128 point) from the CPU race's results; without a
    width-128 result (the smoke), nanochat at its start, as the pair's stand-in."""
    tuned = (results or {}).get("tuned", {}).get("128")
    if tuned is None:
        return "nanochat", {"hopperlm": {}, "nanochat": {}, "nanogpt": {}}
    finals = [
        r for r in results["rows"] if r["width"] == 128 and r["role"] == "race" and r["budget_share"] == 1
    ]
    losses = {name: mean_loss([r for r in finals if r["recipe"] == name]) for name in ("nanogpt", "nanochat")}
    return min(losses, key=losses.get), {name: t["point"] for name, t in tuned.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--books", type=Path, default=DATA / "gutenberg", help="a folder of books or its .tar.xz")
    p.add_argument("--results", type=Path, help="the CPU race's results file (bench/race_matrix.py --save)")
    p.add_argument("--work", type=Path, default=Path("/tmp/race-r"), help="data and runs")
    p.add_argument("--jobs", type=int, default=8, help="runs side by side")
    p.add_argument("--out", type=Path, required=True, help="the results JSON (rewritten after every run)")
    p.add_argument(
        "--smoke", action="store_true", help="CPU, 3 books, width 64, a few steps: checks the script"
    )
    args = p.parse_args(argv)
    if not args.smoke and (args.results is None or not args.results.is_file()):
        sys.exit("race_r: --results must name the CPU race's results file (bench/race_matrix.py --save)")
    results = json.loads(args.results.read_text()) if args.results else None
    if not args.smoke and "128" not in results.get("tuned", {}):
        sys.exit(f"race_r: {args.results} has no width-128 result yet: finish bench/race_matrix.py first")
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data, sha = prepare(args.books, args.work, args.smoke)
    baseline, points = pair_from(results)
    race = MatrixRace(Runner(args.work / "cache", args.jobs), data, smoke=args.smoke)
    width = 64 if args.smoke else WIDTH
    seeds = SEEDS[:1] if args.smoke else SEEDS
    jobs = [(name, 1.0) for name in ("hopperlm", baseline)] + [("hopperlm", s) for s in SHARES]
    record = {"command": bench_command("gpu/race_r.py", argv), "width": width, "baseline": baseline,
              "points": {n: points[n] for n in ("hopperlm", baseline)}, "tokenizer_sha256": sha,
              "tokenizer_matches_cpu_race": sha == CPU_RACE_TOKENIZER_SHA256, "rows": [],
              "cpu_race_plan_commit": (results or {}).get("plan_commit")}  # fmt: skip

    def one(job):
        name, share = job
        recipe = recipe_maker(name, width, race)(points[name])
        recipe = {**recipe, "train": {**recipe["train"], "compile": False}}
        return race.train(name, "race", recipe, width, seeds=seeds, share=share, point=points[name])

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for done in as_completed([pool.submit(one, job) for job in jobs]):
            record["rows"] += done.result()
            record["wall_s"] = round(time.perf_counter() - start, 1)
            save_result(record, args.out)
    block = {**flops_to_target(record["rows"], "hopperlm", baseline), "width": width}
    record["time_to_target"] = {baseline: block}
    if block.get("failed"):  # as the CPU race reads a failed run: no target, no ratio, no interval
        record["time_to_target_intervals"] = {baseline: {k: block[k] for k in ("failed", "ratio_reached", "ratio_interpolated")}}  # fmt: skip
    else:  # every resampling of the seeds (2 seeds: 4 paired, 16 independent), as the CPU race's intervals
        record["time_to_target_intervals"] = intervals_of(record, flops_to_target, draws=200, exact=True)
    record["wall_s"] = round(time.perf_counter() - start, 1)
    save_result(record, args.out)
    t = record["time_to_target_intervals"][baseline]
    if block.get("failed"):
        print(f"w={width}: no time to target: {block['failed']}; {record['wall_s']} s")
    else:
        print(f"w={width}: hopperlm reaches {baseline}'s loss in {t['ratio_interpolated']}x its FLOPs, 90% interval "
              f"{t['independent']['interval_interpolated']} over {len(seeds)} seeds (coarse); {record['wall_s']} s")  # fmt: skip
    return record


if __name__ == "__main__":
    main()
