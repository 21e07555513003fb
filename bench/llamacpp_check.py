"""Do hopperlm's exports run the same in llama.cpp? Each case is exported twice: to a Hugging Face folder then
converted with llama.cpp's own `convert_hf_to_gguf.py` (f32), and with `hopperlm export --format gguf` (f32,
q8_0, and q4_k_m through llama.cpp's `llama-quantize`). For each GGUF: the prompt's ids from `llama-tokenize`
against SentencePiece's and hopperlm's; `llama-tokenize`'s ids on every string of the text set
(bench/llamacpp_texts.py) against hopperlm's tokenizer's (and SentencePiece's); the greedy continuation of
`llama-simple` (20 tokens) against `hopperlm generate --temperature 0`'s, a divergence counting only after a
near-tie (required of f32; shown for the quantized files); and, where `llama-perplexity` is built, the
quantized files' held-out perplexity against f32's: q8_0 within 1%, q4_k_m within 3% (TOLERANCES;
bench/llamacpp_perplexity.py). The prebuilt llama.cpp in ../shared/tools has no llama-perplexity: there the run
says in one line that this check is skipped and points to the last file that measured it
(bench/results/2026-11-27-llamacpp-check-cpu.json), records `perplexity_checked: false`, and the other checks
decide `all_agree`.

On the imported SentencePiece tokenizer, llama-tokenize gives the ids hopperlm's tokenizer (and prepare, and
SentencePiece) gives on the whole text set; hopperlm's encoding as served (generate, eval: transformers 5's
LlamaTokenizer) differs on text that starts with a space, where it adds no '▁' and SentencePiece and llama.cpp
do. A GGUF cannot express that rule, so it is recorded in each row (as_served_note), not required.

On these tiny models (dim 64, FFN 96) q4_k_m is not 4-bit: k-quants pack rows in blocks of 256 values, so
llama-quantize gives every matrix its fallback type (q4_K -> q5_0, q6_K -> q8_0; the export prints which), and
the file is mostly q5_0. The q4_k_m row checks that the k-quant path (f16 file, llama-quantize, the vocabulary
and metadata carried through) gives a file llama.cpp tokenizes and runs as it should; it does not measure
4-bit k-quant error, which needs a model with rows of 256 values or more.

One row misses the 3% on 2026-11-27 and is left failing, with a note in the result: `extended (English)`, the
Tigrinya-trained model on English, q4_k_m at -7.5% (q8_0: -0.2%). Its f32 perplexity, 445,055, is above its
32,320-token vocabulary: it predicts that text worse than a uniform guess, so perplexity is set by the log-
probabilities of tokens it holds near-impossible, which rounding moves by percents. The distribution itself
barely moves, as `llama-perplexity --kl-divergence` against the f32 file's logits shows: mean KL divergence
0.0030 (cpt's q4_k_m, within 3% at +0.28%: 0.0020), the same top token 92.8% of the time (cpt: 96.7%).

    python3 bench/llamacpp_check.py --save bench/results/DATE-llamacpp-check.json   # ~25 min the first time
    python3 bench/llamacpp_check.py --build-only                                    # just the binaries
    python3 bench/llamacpp_check.py --cases own --llama-cpp ../shared/tools/llama.cpp  # own tokenizers, ~3 min
    python3 bench/llamacpp_check.py --llama-cpp ../shared/tools/llama.cpp  # every case, no perplexity, ~25 min

llama.cpp is built once from the pinned llama-cpp-python source distribution (its vendor/llama.cpp, CPU only,
cmake; about 20 minutes on 2 cores) into a cache ($HOPPERLM_CACHE_DIR or ~/.cache/hopperlm, llama.cpp-VERSION/);
later runs reuse it. The cases, on a tiny random Llama (2 blocks, d=64) saved like a Hub folder with TinyLlama's
real tokenizer files:
  import     hopperlm import of the Hub folder
  cpt        continued pretraining from it (model.init_from) on Tiny Shakespeare prepared with its tokenizer
  lora       a LoRA run from it on the same data (merged on export)
  extended   continued pretraining on a `tokenizer extend`-ed vocabulary (Tigrinya pieces) and Tigrinya text
  relu2 (arcee), qk_norm (qwen3)
             as cpt, from a tiny random Arcee (model.mlp relu2) and Qwen3 (model.qk_norm) Hub folder: llama.cpp's
             arcee and qwen3 architectures, from its converter and from `export --format gguf`
  bpe-1000, bpe-4000, byte
             trained from scratch on hopperlm's own tokenizers (bench/llamacpp_own.py): the text set's ids and
             the greedy continuation, up to a near-tie
Needs the package index once (the source distribution) and ../shared/data. tests/test_gguf_export.py runs
llama.cpp's converter wherever the source is unpacked (the binaries need not be built) and the binaries where
they are built.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LLAMA_CPP_PYTHON = "0.3.36"  # its vendor/llama.cpp is the llama.cpp checked against
BINARIES = ("llama-tokenize", "llama-simple", "llama-perplexity", "llama-quantize")
DATA = Path(os.environ.get("HOPPERLM_DATA_DIR") or REPO.parent / "shared" / "data")
PROMPTS = (
    "ROMEO: What light through yonder window breaks?",
    "The quick brown fox jumps over the lazy dog.",
)
# held-out perplexity of each quantized export within this of f32's
TOLERANCES = {"q8_0": 0.01, "q4_k_m": 0.03}
# CPU only, AVX2 and no native tuning: a native build turns on the AMX kernels these Xeons advertise, and a VM
# that does not grant AMX kills llama-simple with SIGILL at the first q8_0 matrix product (seen here)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_BMI2=ON")  # fmt: skip


def cache_dir() -> Path:
    root = (
        os.environ.get("HOPPERLM_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hopperlm"
    )
    return Path(root) / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def built_bin_dir() -> Path | None:
    """The build/bin folder where every one of BINARIES is built already, else None; never builds (the tests
    that need llama.cpp skip without it)."""
    bin_dir = next(cache_dir().glob("llama_cpp_python-*/vendor/llama.cpp/build/bin"), None)
    return bin_dir if bin_dir is not None and all((bin_dir / b).is_file() for b in BINARIES) else None


def unpacked_source() -> Path | None:
    """The llama.cpp source tree where ensure_llamacpp has unpacked it (convert_hf_to_gguf.py and its gguf-py:
    the converter runs without the binaries), else None; never downloads."""
    source = cache_dir() / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    return source if (source / "convert_hf_to_gguf.py").is_file() else None


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(map(str, cmd))}\n{done.stderr[-3000:]}")
    return done


def ensure_llamacpp(log=print) -> Path:
    """The llama.cpp source tree, with BINARIES built in build/bin (once; cached)."""
    cache = cache_dir()
    source = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    bin_dir = source / "build" / "bin"
    stamp = source / "build" / "hopperlm-cmake-flags.txt"
    if (
        all((bin_dir / b).is_file() for b in BINARIES)
        and stamp.is_file()
        and stamp.read_text() == " ".join(CMAKE_FLAGS)
    ):
        return source
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        log(f"llama.cpp: downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s source distribution ...")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", cache])  # fmt: skip
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    log("llama.cpp: building " + ", ".join(BINARIES) + " (CPU; about 20 minutes on 2 cores, once) ...")
    t0 = time.monotonic()
    shutil.rmtree(source / "build", ignore_errors=True)
    run(["cmake", "-S", source, "-B", source / "build", "-G", "Ninja", *CMAKE_FLAGS])
    run(["cmake", "--build", source / "build", "--target", *BINARIES, "-j", str(os.cpu_count() or 2)])
    stamp.write_text(" ".join(CMAKE_FLAGS))
    log(f"llama.cpp: built in {time.monotonic() - t0:.0f} s: {bin_dir}")
    return source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--build-only", action="store_true", help="build (or find) the llama.cpp binaries and stop"
    )
    p.add_argument("--save", help="write the results as JSON here")
    p.add_argument("--work", default="/tmp/hopperlm-llamacpp-check", help="scratch folder (rewritten)")
    p.add_argument(
        "--cases",
        choices=("all", "own"),
        default="all",
        help="own: only the models trained on hopperlm's own tokenizers (bench/llamacpp_own.py: BPE at two "
        "vocabulary sizes and byte), which need llama-tokenize and llama-simple alone",
    )
    p.add_argument(
        "--llama-cpp",
        type=Path,
        help="a llama.cpp folder already built (build/bin and convert_hf_to_gguf.py, e.g. ../shared/tools/llama.cpp) "
        "instead of building one: llama-tokenize, llama-simple and llama-quantize in build/bin; the quantized files' "
        "held-out perplexity is checked only where llama-perplexity is there too (the prebuilt one has none)",
    )
    args = p.parse_args()
    source = args.llama_cpp.resolve() if args.llama_cpp else ensure_llamacpp()
    if args.build_only:
        print(f"llama.cpp binaries: {source / 'build' / 'bin'}")
        return
    from llamacpp_cases import check_all  # the cases and checks (bench/llamacpp_cases.py)
    from llamacpp_own import check_own  # hopperlm's own tokenizers (bench/llamacpp_own.py)

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    own = check_own(source, work, DATA)
    record = {"own_tokenizers": own, "table": own["table"], "all_agree": own["all_agree"]}
    if args.cases == "all":
        imported = check_all(source, work, DATA, PROMPTS, TOLERANCES)
        record = {**imported, **record, "table": imported["table"] + own["table"]}
        record["all_agree"] = imported["all_agree"] and own["all_agree"]
    record["llama_cpp"] = str(source)
    if args.save:
        from hopperlm.provenance import save_result

        save_result(record, args.save)
    print("\n".join(record["table"]))
    sys.exit(0 if record["all_agree"] else 1)


if __name__ == "__main__":
    main()
