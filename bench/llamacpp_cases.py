"""The cases and checks of bench/llamacpp_check.py: every step runs the hopperlm CLI, the way a user would."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
TIGRINYA_PROMPT = "ሰላም ንኹልኩም ኣሕዋትን ኣሓትን"
# tests/hf_tiny.py's family -> the case: the model features that export as that architecture
FEATURE_FAMILIES = {"arcee": "relu2 (arcee)", "qwen3": "qk_norm (qwen3)"}


def sh(*cmd, cwd=None, env=None) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def hopperlm(*args) -> str:
    return sh(sys.executable, "-m", "hopperlm", *args, cwd=REPO)


# ---- the models -------------------------------------------------------------------------------------------
def hub_folder(work: Path, data: Path, family: str = "tinyllama") -> Path:
    """A tiny random model of `family` (tests/hf_tiny.py: a Llama by default; arcee: ReLU², qwen3: QK-norm; 2
    blocks, d=64) saved like a Hub folder with all of TinyLlama's tokenizer files."""
    # tests/hf_tiny.py by its path: the tests' helper, not a module of an installed package
    spec = importlib.util.spec_from_file_location("hf_tiny", REPO / "tests" / "hf_tiny.py")
    hf_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_tiny)
    tiny_hf_model = hf_tiny.tiny_hf_model

    out = work / ("hub" if family == "tinyllama" else f"hub-{family}")
    tiny_hf_model(family, vocab_size=32000, max_position_embeddings=512).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(data / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / name, out / name)
    return out


def train_args(init_from: Path, data_dir: Path, run: Path, steps: int, *extra) -> list:
    return ["train", REPO / "configs" / "debug.yaml", "--model.preset", "null", "--model.init_from", init_from,
            "--data.path", data_dir, "--train.seq_len", "64", "--train.micro_batch", "8",
            "--train.max_steps", steps, "--train.eval_every", "0", "--train.eval_windows", "4",
            "--train.log_every", steps, "--schedule.warmup_steps", "5", "--optim.lr", "3e-3",
            "--log.report", "false", "--log.tensorboard", "false", "--run.out_dir", run, *extra]  # fmt: skip


def make_cases(work: Path, data: Path) -> dict[str, tuple[Path, str]]:
    """name -> (the model to export, the prompt), made as the seed path makes them."""
    imported = work / "imported"
    hopperlm("import", hub_folder(work, data), imported)
    english = work / "shakespeare"  # prepared with the imported model's tokenizer.json, as the issue did
    hopperlm("prepare", data / "tinyshakespeare" / "input.txt", "--out", english,
             "--tokenizer", imported / "tokenizer" / "tokenizer.json")  # fmt: skip
    hopperlm(*train_args(imported, english, work / "cpt", 200))
    hopperlm(*train_args(imported, english, work / "lora", 200, "--lora.rank", "8", "--optim.lr", "1e-2"))
    extended = work / "tok-tir"
    tigrinya = data / "hornmt" / "tir.txt"
    hopperlm("tokenizer", "extend", imported / "tokenizer", tigrinya, "--add", "300", "--out", extended)
    tir_data = work / "tigrinya"
    hopperlm("prepare", tigrinya, "--out", tir_data, "--tokenizer", extended / "tokenizer.json")
    hopperlm(*train_args(imported, tir_data, work / "extended", 200))
    # hopperlm's own features, as the architectures that carry them: model.mlp relu2 (Arcee, llama.cpp's arcee)
    # and model.qk_norm (Qwen3, its qwen3), each imported from a Hub folder and trained on as cpt is
    for family in FEATURE_FAMILIES:
        hopperlm("import", hub_folder(work, data, family), work / f"{family}-imported")
        hopperlm(*train_args(work / f"{family}-imported", english, work / f"{family}-cpt", 200))
    english_prompt = "ROMEO: What light through yonder window breaks?"
    return {
        "import": (imported, english_prompt),
        "cpt": (work / "cpt", english_prompt),
        "lora": (work / "lora", english_prompt),
        "extended (English)": (work / "extended", english_prompt),
        "extended (Tigrinya)": (work / "extended", TIGRINYA_PROMPT),
        **{name: (work / f"{family}-cpt", english_prompt) for family, name in FEATURE_FAMILIES.items()},
    }


def convert_hf_to_gguf(source: Path, hf: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's own converter (its convert_hf_to_gguf.py, with its gguf-py) on a Hugging Face folder."""
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    sh(sys.executable, source / "convert_hf_to_gguf.py", hf, "--outtype", outtype, "--outfile", out, env=env)
    return out


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


def llama_tokenize_text(bin_dir: Path, gguf: Path, text: str, scratch: Path) -> list[int]:
    """llama-tokenize's ids for text exactly as given (from a file: leading/trailing whitespace, newlines and
    the empty string kept), with no BOS: what the tokenizer itself makes of it."""
    scratch.write_text(text, encoding="utf-8")
    out = sh(bin_dir / "llama-tokenize", "-m", gguf, "-f", scratch, "--ids", "--no-bos", "--log-disable")
    return [int(x) for x in re.findall(r"-?\d+", out.strip().splitlines()[-1])] if out.strip() else []


def continuation(out: str, prompt: str) -> str:
    """What a program printed after the prompt, less the one newline it ends its output with: exact text,
    whitespace included (a continuation of newlines must match newline for newline)."""
    out = out.removesuffix("\n")
    return out.split(prompt, 1)[1] if prompt in out else out


def llama_greedy(bin_dir: Path, gguf: Path, prompt: str, n: int) -> str:
    """llama-simple's continuation (greedy sampling)."""
    return continuation(sh(bin_dir / "llama-simple", "-m", gguf, "-n", n, prompt), prompt)


def hopperlm_greedy(model: Path, prompt: str, n: int) -> str:
    out = hopperlm("generate", model, "--prompt", prompt, "--max-new-tokens", n, "--temperature", "0",
                   "--top-k", "0", "--top-p", "1", "--repetition-penalty", "1")  # fmt: skip
    return continuation(out, prompt)


def hopperlm_ids(model: Path, prompt: str) -> list[int]:
    """The ids hopperlm feeds its model for `prompt` (what training and `generate` encode)."""
    from hopperlm.checkpoint.layout import TOKENIZER_DIR, resolve_model_dir
    from hopperlm.data.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_dir(model) / TOKENIZER_DIR).encode_for_model(prompt)


def greedy_agrees(model: Path, prompt: str, llama_text: str, hopperlm_text: str, near_tie: float) -> bool:
    """Do llama.cpp's and hopperlm's greedy continuations agree, up to the first near-tie? Equal text agrees;
    otherwise hopperlm's own greedy tokens are walked until their text leaves llama.cpp's, and the divergence
    counts only where hopperlm's top-2 logits there are `near_tie` or more apart (else either pick is greedy,
    and the two programs' rounding may choose differently)."""
    if llama_text == hopperlm_text:
        return True
    import torch

    from hopperlm.interop.inference import load_for_inference

    net, tokenizer = load_for_inference(model, "cpu")
    ids = tokenizer.encode_for_model(prompt)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(len(hopperlm_text) + 1):  # at most one token per character of the continuation
            logits = net(torch.tensor([ids + new]))[0, -1].float()  # (V,)
            top2 = torch.topk(logits, 2).values
            token = int(logits.argmax())
            if not llama_text.startswith(tokenizer.decode([*new, token])):  # this step diverges
                return float(top2[0] - top2[1]) < near_tie
            new.append(token)
    return False


def model_vocab_size(model: Path) -> int:
    from hopperlm.checkpoint.layout import read_model_config, resolve_model_dir

    return read_model_config(resolve_model_dir(model)).vocab_size


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


def check_all(
    source: Path, work: Path, data: Path, prompts, tolerances: dict[str, float], n: int = 20
) -> dict:
    """`tolerances`: quantized outtype -> the largest relative change of held-out perplexity against f32's."""
    bin_dir = source / "build" / "bin"
    heldout = {"English": work / "heldout-en.txt", "Tigrinya": work / "heldout-tir.txt"}
    heldout["English"].write_text((data / "tinyshakespeare" / "input.txt").read_text()[-40_000:])
    # not in training (HornMT is): a parallel corpus's Tigrinya side
    heldout["Tigrinya"].write_text(
        (data / "travis-tigrinya-parallel" / "TI_volunteers.txt").read_text()[:40_000]
    )
    rows = []
    for name, (model, prompt) in make_cases(work, data).items():
        slug = re.sub(r"\W+", "-", name).strip("-")
        hf = work / f"{slug}-hf"
        hopperlm("export", model, hf, "--dtype", "fp32")
        files = sorted(p.name for p in hf.iterdir())
        ggufs = {"convert_hf_to_gguf f32": convert_hf_to_gguf(source, hf, work / f"{slug}-converted.gguf")}
        said = {}  # what the export printed (a k-quant: llama.cpp's fallback types for narrow rows)
        for outtype in ("f32", *tolerances):
            ggufs[f"export --format gguf {outtype}"] = work / f"{slug}-{outtype}.gguf"
            said[outtype] = hopperlm("export", model, ggufs[f"export --format gguf {outtype}"], "--format", "gguf",
                                     "--outtype", outtype, "--llama-cpp", bin_dir)  # fmt: skip
        sp_ids = sentencepiece_ids(hf, prompt)
        our_ids = hopperlm_ids(model, prompt)
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
                "hopperlm_ids": our_ids,
                "llama_cpp_ids": ids,
                "ids_equal": sp_ids is not None and ids == sp_ids == our_ids,
                "hopperlm_greedy": ours,
                "llama_cpp_greedy": greedy,
                "greedy_equal": greedy == ours,
                # greedy text must be equal in f32; a quantized file is judged by its held-out perplexity
                "greedy_required": not any(how.endswith(f" {q}") for q in tolerances),
            }
            fallback = [
                line for line in said.get(how.rsplit(" ", 1)[-1], "").splitlines() if "fallback" in line
            ]
            if how.startswith("export") and fallback:
                row["export_said"] = fallback[0]
            language = "Tigrinya" if "Tigrinya" in name else "English"
            ppl[how] = row["perplexity"] = llama_perplexity(bin_dir, path, heldout[language])
            row["heldout"] = language
            rows.append(row)
        f32 = ppl["export --format gguf f32"]
        for q, tolerance in tolerances.items():
            row = next(r for r in rows if r["case"] == name and r["gguf"] == f"export --format gguf {q}")
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
    table = [f"{'case':<22}{'gguf':<30}{'ids':>5}{'greedy':>9}{'ppl':>12}{'vs f32':>9}"]
    for r in rows:
        greedy = ("yes" if r["greedy_equal"] else "NO") + ("" if r["greedy_required"] else "*")
        q = r["gguf"].rsplit(" ", 1)[-1]
        ratio = f"{r[f'{q}_ppl_ratio']:.4f}" if f"{q}_ppl_ratio" in r else ""
        table.append(f"{r['case']:<22}{r['gguf']:<30}{'yes' if r['ids_equal'] else 'NO':>5}"
                     f"{greedy:>9}{r['perplexity']:>12.2f}{ratio:>9}")  # fmt: skip
    checked = [(r, q) for r in rows for q in tolerances if f"{q}_vs_f32" in r]
    for r, q in checked:
        table.append(f"{r['case']}: {q} perplexity {100 * r[f'{q}_vs_f32']:+.2f}% vs f32 "
                     f"(tolerance {100 * tolerances[q]:g}%)")  # fmt: skip
        if f"{q}_note" in r:
            table.append(f"  {r[f'{q}_note']}")
    said = sorted({r["export_said"] for r in rows if "export_said" in r})
    table += [f"export said: {line}" for line in said]
    table.append("ids: llama-tokenize = SentencePiece = hopperlm; greedy: llama-simple's 20 tokens = hopperlm "
                 f"generate's (* {', '.join(tolerances)}: shown, not required; their check is the perplexity)")  # fmt: skip
    agree = all(r["ids_equal"] and (r["greedy_equal"] or not r["greedy_required"]) for r in rows)
    agree = agree and all(r[f"{q}_within_tolerance"] for r, q in checked)
    version = source.parents[1].name.split("-")[-1]
    table.append(f"{'every case agrees' if agree else 'NOT every case agrees'}: {len(rows)} GGUF files, "
                 f"llama.cpp from llama-cpp-python {version}")  # fmt: skip
    return {"rows": rows, "table": table, "all_agree": agree, "tolerances": tolerances,
            "q8_tolerance": tolerances.get("q8_0"), "tokens": n}  # fmt: skip
