"""The cases and checks of bench/llamacpp_check.py: every step runs the hopperlm CLI, the way a user would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
TIGRINYA_PROMPT = "ሰላም ንኹልኩም ኣሕዋትን ኣሓትን"


def sh(*cmd, cwd=None, env=None) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def hopperlm(*args) -> str:
    return sh(sys.executable, "-m", "hopperlm", *args, cwd=REPO)


# ---- the models -------------------------------------------------------------------------------------------
def hub_folder(work: Path, data: Path) -> Path:
    """A tiny random Llama (2 blocks, d=64) saved like a Hub folder with all of TinyLlama's tokenizer files."""
    from hf_tiny import tiny_hf_model

    out = work / "hub"
    tiny_hf_model("tinyllama", vocab_size=32000, max_position_embeddings=512).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(data / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / name, out / name)
    return out


def train_args(init_from: Path, data_dir: Path, run: Path, steps: int, *extra) -> list:
    return ["train", REPO / "configs" / "debug.yaml", "--model.preset", "null", "--model.init_from", init_from,
            "--data.path", data_dir, "--train.seq_len", "64", "--train.micro_batch", "8",
            "--train.max_steps", steps, "--train.eval_every", "0", "--train.eval_windows", "4",
            "--train.log_every", steps, "--optim.warmup_steps", "5", "--optim.lr", "3e-3",
            "--log.report", "false", "--log.tensorboard", "false", "--run.out_dir", run, *extra]  # fmt: skip


def make_cases(work: Path, data: Path) -> dict[str, tuple[Path, str]]:
    """name -> (the model to export, the prompt), made as the seed path makes them."""
    imported = work / "imported"
    hopperlm("import", hub_folder(work, data), imported)
    english = work / "shakespeare"  # prepared with the imported model's tokenizer.json, as the issue did
    hopperlm("prepare", data / "tinyshakespeare" / "input.txt", "--out", english,
             "--tokenizer", imported / "tokenizer" / "tokenizer.json")  # fmt: skip
    hopperlm(*train_args(imported, english, work / "cpt", 60))
    hopperlm(*train_args(imported, english, work / "lora", 60, "--lora.rank", "8", "--optim.lr", "1e-2"))
    extended = work / "tok-tir"
    tigrinya = data / "hornmt" / "tir.txt"
    hopperlm("tokenizer", "extend", imported / "tokenizer", tigrinya, "--add", "300", "--out", extended)
    tir_data = work / "tigrinya"
    hopperlm("prepare", tigrinya, "--out", tir_data, "--tokenizer", extended / "tokenizer.json")
    hopperlm(*train_args(imported, tir_data, work / "extended", 60))
    english_prompt = "ROMEO: What light through yonder window breaks?"
    return {
        "import": (imported, english_prompt),
        "cpt": (work / "cpt", english_prompt),
        "lora": (work / "lora", english_prompt),
        "extended (English)": (work / "extended", english_prompt),
        "extended (Tigrinya)": (work / "extended", TIGRINYA_PROMPT),
    }


# ---- what each side says ------------------------------------------------------------------------------------
def sentencepiece_ids(tokenizer_dir: Path, prompt: str) -> list[int] | None:
    import sentencepiece

    model = tokenizer_dir / "tokenizer.model"
    if not model.is_file():
        return None
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    return [sp.bos_id(), *sp.encode(prompt)]


def llama_tokenize(bin_dir: Path, gguf: Path, prompt: str) -> list[int]:
    out = sh(bin_dir / "llama-tokenize", "-m", gguf, "-p", prompt, "--ids", "--log-disable")
    return [int(x) for x in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def llama_greedy(bin_dir: Path, gguf: Path, prompt: str, n: int) -> str:
    """llama-simple's continuation (greedy sampling), the prompt left off."""
    out = sh(bin_dir / "llama-simple", "-m", gguf, "-n", n, prompt)
    return out.split(prompt, 1)[-1] if prompt in out else out


def hopperlm_greedy(model: Path, prompt: str, n: int) -> str:
    out = hopperlm("generate", model, "--prompt", prompt, "--max-new-tokens", n, "--temperature", "0",
                   "--top-k", "0", "--top-p", "1", "--repetition-penalty", "1")  # fmt: skip
    text = out.rstrip("\n")
    return text.split(prompt, 1)[-1] if prompt in text else text


def llama_perplexity(bin_dir: Path, gguf: Path, text_file: Path) -> float:
    done = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c", "128",
                           "-b", "128", "--chunks", "40"], capture_output=True, text=True)  # fmt: skip
    m = re.search(r"Final estimate: PPL = ([\d.]+)", done.stdout + done.stderr)
    if not m:
        raise RuntimeError(f"llama-perplexity gave no estimate:\n{(done.stdout + done.stderr)[-2000:]}")
    return float(m.group(1))


def check_all(source: Path, work: Path, data: Path, prompts, q8_tolerance: float, n: int = 20) -> dict:
    bin_dir = source / "build" / "bin"
    converter = source / "convert_hf_to_gguf.py"
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    heldout = work / "heldout.txt"
    text = (data / "tinyshakespeare" / "input.txt").read_text()
    heldout.write_text(text[-40_000:])
    rows = []
    for name, (model, prompt) in make_cases(work, data).items():
        slug = re.sub(r"\W+", "-", name).strip("-")
        hf = work / f"{slug}-hf"
        hopperlm("export", model, hf, "--dtype", "fp32")
        files = sorted(p.name for p in hf.iterdir())
        ggufs = {"convert_hf_to_gguf f32": work / f"{slug}-converted.gguf"}
        sh(
            sys.executable,
            converter,
            hf,
            "--outtype",
            "f32",
            "--outfile",
            ggufs["convert_hf_to_gguf f32"],
            env=env,
        )
        for outtype in ("f32", "q8_0"):
            ggufs[f"export --format gguf {outtype}"] = work / f"{slug}-{outtype}.gguf"
            hopperlm(
                "export",
                model,
                ggufs[f"export --format gguf {outtype}"],
                "--format",
                "gguf",
                "--outtype",
                outtype,
            )
        sp_ids = sentencepiece_ids(hf, prompt)
        ours = hopperlm_greedy(model, prompt, n)
        ppl = {}
        for how, path in ggufs.items():
            ids = llama_tokenize(bin_dir, path, prompt)
            greedy = llama_greedy(bin_dir, path, prompt, n)
            row = {
                "case": name,
                "gguf": how,
                "prompt": prompt,
                "hf_files": files,
                "sentencepiece_ids": sp_ids,
                "llama_cpp_ids": ids,
                "ids_equal": sp_ids is not None and ids == sp_ids,
                "hopperlm_greedy": ours,
                "llama_cpp_greedy": greedy,
                "greedy_equal": greedy.strip() == ours.strip(),
            }
            if "english" in name.lower() or name in ("import", "cpt", "lora"):
                ppl[how] = row["perplexity"] = llama_perplexity(bin_dir, path, heldout)
            rows.append(row)
        if ppl:
            f32, q8 = ppl["export --format gguf f32"], ppl["export --format gguf q8_0"]
            rows[-1]["q8_0_vs_f32"] = q8 / f32 - 1
            rows[-1]["q8_0_within_tolerance"] = abs(q8 / f32 - 1) <= q8_tolerance
    table = [f"{'case':<22}{'gguf':<28}{'ids':>5}{'greedy':>8}{'ppl':>10}"]
    for r in rows:
        ppl = f"{r['perplexity']:.2f}" if "perplexity" in r else ""
        table.append(f"{r['case']:<22}{r['gguf']:<28}{'yes' if r['ids_equal'] else 'NO':>5}"
                     f"{'yes' if r['greedy_equal'] else 'NO':>8}{ppl:>10}")  # fmt: skip
    q8 = [r for r in rows if "q8_0_vs_f32" in r]
    for r in q8:
        table.append(
            f"{r['case']}: q8_0 perplexity {100 * r['q8_0_vs_f32']:+.2f}% vs f32 (tolerance {100 * q8_tolerance:g}%)"
        )
    agree = all(r["ids_equal"] and r["greedy_equal"] for r in rows) and all(
        r["q8_0_within_tolerance"] for r in q8
    )
    table.append(
        f"{'every case agrees' if agree else 'NOT every case agrees'}: {len(rows)} GGUF files, llama.cpp {source.name}"
    )
    return {"rows": rows, "table": table, "all_agree": agree, "q8_tolerance": q8_tolerance, "tokens": n}
