"""k-quants (q4_k_m, q5_k_m, q6_k) through llama.cpp's own `llama-quantize`: the `gguf` package writes f32, f16,
bf16 and q8_0 but has no k-quant writer, so `export --format gguf` writes the f16 file and hands it to the
binary, the way llama.cpp's README makes a k-quant from its converter's output.

The binary is found before anything is written (one line naming how to get it otherwise). Without it, an export
for Ollama (`--modelfile`) at q4_k_m needs no C++ build: Ollama quantizes an f16 GGUF itself when the model is
created (`ollama create NAME -q q4_K_M`; its `-q` makes q4_K_M, q4_K_S and q8_0 from F16, BF16 or F32 files,
ollama/ollama server/create.go and fs/ggml/type.go ParseFileType), so the export writes the f16 file and the
Modelfile and says so in one line. An explicit `--llama-cpp DIR` without the binary stays an error: the user
asked for that route.

k-quants pack rows in blocks of 256 values; a tensor whose rows are not a multiple of 256 (every tensor of a
model with dim 64, as the tests' tiny Llamas) gets llama.cpp's fallback type instead (q4_K -> q5_0, q5_K ->
q5_1, q6_K -> q8_0), which llama-quantize prints tensor by tensor: `fallback_summary` turns those lines into
one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from hopperlm.errors import CheckpointError, ConfigError, last_line

BINARY = "llama-quantize"
KQUANTS = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}
"""--outtype -> llama-quantize's type name."""
OLLAMA_QUANTIZES = {"q4_k_m": "q4_K_M"}
"""--outtype -> `ollama create -q`'s name, for the k-quants Ollama makes itself from an f16 GGUF."""
BYTES_PER_WEIGHT = {"q4_k_m": 4.9 / 8, "q5_k_m": 5.7 / 8, "q6_k": 6.6 / 8}
"""Bits per weight llama.cpp reports for a Llama's mix (q4_k_m keeps some matrices in q6_K), rounded up."""
HOW_TO_GET = (
    "build llama.cpp (cmake --build build --target llama-quantize; or python3 bench/llamacpp_check.py "
    "--build-only, which prints where), then pass --llama-cpp DIR or put llama-quantize on PATH"
)
_FALLBACK = re.compile(r"required for type\s+(\S+)\).*?falling back to\s+(\S+)")
_NCOLS = re.compile(r"ncols\s+(\d+)\s+not divisible by\s+(\d+)")


def find_llama_quantize(
    llama_cpp: str | Path | None = None, *, outtype: str, modelfile: bool = False
) -> Path | None:
    """The llama-quantize binary: in `llama_cpp` (a llama.cpp checkout with build/bin/, or the folder holding
    the binary) when given, else on PATH. None when there is none on PATH but Ollama can make `outtype` from an
    f16 file for the `modelfile` being written (OLLAMA_QUANTIZES); otherwise a ConfigError in one line."""
    if llama_cpp is not None:
        root = Path(llama_cpp).expanduser()
        for candidate in (root / BINARY, root / "build" / "bin" / BINARY, root / "bin" / BINARY):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        raise ConfigError(
            f"--llama-cpp {llama_cpp}: no {BINARY} in it (looked in ., build/bin/, bin/); {HOW_TO_GET}"
        )
    found = shutil.which(BINARY)
    if found is not None:
        return Path(found)
    if modelfile and outtype in OLLAMA_QUANTIZES:
        return None
    if modelfile:  # an Ollama export of a k-quant Ollama's own quantizer does not make
        raise ConfigError(
            f"--outtype {outtype} needs llama.cpp's {BINARY}, not found on PATH (of the k-quants, `ollama create "
            f"-q` makes {', '.join(OLLAMA_QUANTIZES.values())} only); {HOW_TO_GET}; or export --outtype q4_k_m "
            "--modelfile and let Ollama quantize"
        )
    raise ConfigError(
        f"k-quant GGUF export needs llama.cpp's {BINARY}, not found on PATH; {HOW_TO_GET}; or, for Ollama "
        "without llama.cpp, add --modelfile (with --outtype q4_k_m): an f16 GGUF and its Modelfile, which "
        "`ollama create NAME -q q4_K_M -f Modelfile` quantizes"
    )


def quantize(binary: Path, source: Path, out: Path, outtype: str, log=print) -> None:
    """llama-quantize source -> out at the k-quant `outtype`; its fallbacks said in one line. A failure is a
    CheckpointError with the binary's last line of stderr, and no partial `out` left behind."""
    cmd = [str(binary), str(source), str(out), KQUANTS[outtype], str(os.cpu_count() or 1)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    except OSError as e:
        out.unlink(missing_ok=True)
        raise CheckpointError(f"{binary} did not start ({e}); {HOW_TO_GET}") from None
    if done.returncode != 0:
        out.unlink(missing_ok=True)
        last = last_line(done.stderr or done.stdout) or "no output"
        raise CheckpointError(f"{binary.name} {KQUANTS[outtype]} failed (exit {done.returncode}): {last}")
    summary = fallback_summary(done.stdout + done.stderr, outtype)
    if summary:
        log(summary)


def fallback_summary(output: str, outtype: str) -> str | None:
    """One line for llama-quantize's per-tensor fallback warnings (None when every tensor took its k-quant)."""
    moves = Counter(_FALLBACK.findall(output))
    if not moves:
        return None
    widths = sorted({int(m.group(1)) for m in _NCOLS.finditer(output)})
    how = ", ".join(f"{n} {a} -> {b}" for (a, b), n in sorted(moves.items()))
    rows = f"rows of {'/'.join(map(str, widths))} values" if widths else "rows"
    return (
        f"gguf {outtype}: {sum(moves.values())} tensors took llama.cpp's fallback type ({how}): their {rows} "
        "are not a multiple of the k-quant's 256-value block"
    )
