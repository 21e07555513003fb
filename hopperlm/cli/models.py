"""Model verbs: `import` from and `export` to Hugging Face, `merge` LoRA adapters, `generate`, `presets` (and
`eval`, registered here from cli/evaluate.py)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hopperlm.cli.common import (
    DEVICE_HELP,
    add_verb,
    float_above,
    float_at_least,
    int_at_least,
    log,
    number,
)
from hopperlm.cli.evaluate import add_parsers as add_eval
from hopperlm.errors import ConfigError
from hopperlm.folder_lock import hold_folder


def holding_out(verb: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """A verb that writes the folder (or file) OUT holds `OUT.lock` beside it for its life: OUT appears whole
    only at the end (files.staged_dir), so the lock cannot live inside it, and a second writer of the same
    OUT is refused in one line (folder_lock.py)."""

    @functools.wraps(verb)
    def held(args: argparse.Namespace) -> None:
        with hold_folder(Path(args.out), what="OUT", beside=True, log=log):
            verb(args)

    return held


@holding_out
def cmd_import(args: argparse.Namespace) -> None:
    from hopperlm.interop.hf_convert import import_hf

    out = import_hf(Path(args.hf_dir), Path(args.out), overwrite=args.overwrite, log=log)
    log(f"imported {args.hf_dir} -> {out} (hopperlm model folder: weights, config.json, tokenizer/)")


@holding_out
def cmd_merge(args: argparse.Namespace) -> None:
    from hopperlm.interop.hf_convert import export_hf, hf_files, save_merged

    if args.format == "hf":
        out = export_hf(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite, log)
        what = f"Hugging Face folder: {hf_files(out)}"
    else:
        out = save_merged(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite)
        what = "hopperlm model folder"
    log(f"merged the adapters of {args.run} into its base: {out} ({what})")


GENERATE_HELP = (
    "Continue --prompt as transformers' model.generate does: the prompt is encoded as tokenizer(prompt) "
    "encodes it (with the special tokens the tokenizer adds, e.g. BOS for Llama); the next token is chosen "
    "after the repetition penalty, temperature, top-k and top-p, in that order (temperature 0 = greedy); "
    "generation stops after an EOS id (generation_config.json's eos_token_id, one id or a list, else the "
    "tokenizer's EOS); the prompt and its continuation are printed decoded together with special tokens "
    "skipped, as tokenizer.decode(output_ids, skip_special_tokens=True) gives them. Flags left out take the "
    "model's generation_config.json (Hugging Face folders, their import and export, runs fine-tuned from "
    "them; transformers' defaults for what it leaves out: do_sample false = greedy), else hopperlm's."
)


def generation_settings(args: argparse.Namespace, source: Path) -> dict:
    """Sampling settings and EOS ids: each flag given wins, then the model's own defaults (interop/hf_convert.py
    sampling_defaults: the Hugging Face base's generation_config.json, else hopperlm's)."""
    from hopperlm.interop.hf_convert import sampling_defaults
    from hopperlm.model.generate import MAX_NEW_TOKENS, SAMPLING_DEFAULTS

    settings = sampling_defaults(source)
    settings["max_new_tokens"] = settings["max_new_tokens"] or MAX_NEW_TOKENS
    for key in (*SAMPLING_DEFAULTS, "max_new_tokens"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


def cmd_generate(args: argparse.Namespace) -> None:
    from hopperlm.checkpoint.layout import resolve_model_dir
    from hopperlm.interop.hf import is_hf_dir
    from hopperlm.interop.inference import load_for_inference

    source = Path(args.run) if is_hf_dir(Path(args.run)) else resolve_model_dir(args.run)
    settings = generation_settings(args, source)
    model, tokenizer = load_for_inference(source, device=args.device)
    take_threads_beside_load(next(model.parameters()).device)
    prompt, encoder = args.prompt, None
    if args.chat:  # the prompt as a user turn of the model's chat template, as fine-tuning rendered it
        from hopperlm.data.chat import chat_encoder
        from hopperlm.eval.gsm8k import chat_template

        template = chat_template(tokenizer)
        if template is None:
            raise ConfigError(f"--chat: the tokenizer of {args.run} has no chat template; drop --chat")
        prompt = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        encoder = chat_encoder(tokenizer)
    samples = model_samples(
        model,
        tokenizer,
        prompt,
        args.num_samples,
        settings["max_new_tokens"],
        settings["temperature"],
        settings["top_k"],
        args.seed,
        encoder,
        top_p=settings["top_p"],
        repetition_penalty=settings["repetition_penalty"],
        eos_ids=settings["eos_ids"],
    )
    for i, text in enumerate(samples):
        if args.num_samples > 1:
            log(f"--- sample {i + 1} ---")
        log(text)


def take_threads_beside_load(device) -> None:
    """On a CPU, torch's threads as `train` chooses them (plan/choices.py threads_beside_load: on a loaded
    machine 60 tokens took 5.9 s with every core, 2.7 s with one), said in one line on stderr: stdout is the
    text."""
    if device.type != "cpu":
        return
    import torch

    from hopperlm.plan.choices import threads_beside_load

    choice = threads_beside_load(os.cpu_count() or 1, what="generate")
    if choice.forced:
        torch.set_num_threads(choice.count)
    print(f"threads: {choice.why}", file=sys.stderr, flush=True)


def model_samples(
    model,
    tokenizer,
    prompt: str,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    encoder=None,
    *,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    eos_ids: list[int] | None = None,
):
    """n texts: the prompt (encoded with its special tokens, as transformers' tokenizer(prompt) does; `encoder`,
    e.g. a chat encoder, encodes it instead when given) and its continuation, decoded together with special
    tokens skipped; sample i draws with seed + i."""
    from hopperlm.model.generate import generate

    ids = encoder.encode(prompt) if encoder is not None else tokenizer.encode_for_model(prompt)
    ids = ids or [tokenizer.eos_id]
    for i in range(n):
        out = generate(
            model,
            ids,
            max_new_tokens,
            temperature,
            top_k,
            eos_ids or tokenizer.eos_id,
            seed=seed + i,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
        )
        yield tokenizer.decode(ids + out)


@holding_out
def cmd_export(args: argparse.Namespace) -> None:
    gguf_only = [
        flag for flag, given in (("--modelfile", args.modelfile), ("--llama-cpp", args.llama_cpp)) if given
    ]
    if gguf_only and (args.peft or args.format != "gguf"):
        raise ConfigError(f"{' and '.join(gguf_only)}: --format gguf only")
    if args.peft:
        from hopperlm.interop.peft import export_peft

        out = export_peft(Path(args.run), Path(args.out), overwrite=args.overwrite)
        files = sorted(p.name for p in out.iterdir())
        log(f"exported {out} (PEFT adapter: {', '.join(files)})")
    elif args.format == "gguf":
        from hopperlm.interop.gguf import export_gguf

        export_gguf(
            Path(args.run),
            Path(args.out),
            args.outtype,
            overwrite=args.overwrite,
            log=log,
            llama_cpp=args.llama_cpp,
            modelfile=args.modelfile,
        )  # (it says what it wrote: the outtype, or f16 for Ollama to quantize)
    elif args.format == "hopperlm":
        from hopperlm.interop.export import export_model

        out = export_model(Path(args.run), Path(args.out), overwrite=args.overwrite)
        log(f"exported {out} (hopperlm model folder: weights + config.json + tokenizer/)")
    else:
        from hopperlm.interop.hf_convert import export_hf, hf_files

        out = export_hf(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite, log)
        log(f"exported {out} (Hugging Face folder: {hf_files(out)})")


def cmd_presets(args: argparse.Namespace) -> None:
    from hopperlm.config.presets import PRESETS
    from hopperlm.model.transformer import count_params, flops_per_token

    log(
        f"{'preset':<18}{'layers':>7}{'dim':>6}{'heads':>7}{'kv':>4}{'ffn':>7}{'vocab':>8}{'ctx':>6}"
        f"  {'parameters':>18}{'GFLOP/token':>13}"
    )
    for name, cfg in PRESETS.items():
        vocab = cfg.vocab_size or "data"
        if cfg.vocab_size is None:
            params, gflops = "(vocab from data)", "-"
        else:
            params = f"{count_params(cfg)['total']:,}"
            gflops = f"{flops_per_token(cfg, cfg.max_seq_len) / 1e9:.3f}"
        log(
            f"{name:<18}{cfg.n_layers:>7}{cfg.dim:>6}{cfg.n_heads:>7}{cfg.kv_heads:>4}{cfg.hidden_dim:>7}"
            f"{vocab!s:>8}{cfg.max_seq_len:>6}  {params:>18}{gflops:>13}"
        )


def add_parsers(verbs, common: argparse.ArgumentParser) -> None:
    _add_import(verbs, common)
    _add_merge_and_export(verbs, common)
    add_eval(verbs, common)  # (cli/evaluate.py; between export and generate in --help)
    _add_generate(verbs, common)
    add_verb(verbs, common, "presets", cmd_presets, "list model presets with exact sizes")


def _add_import(verbs, common: argparse.ArgumentParser) -> None:
    p = add_verb(verbs, common, "import", cmd_import, "Hugging Face model folder -> hopperlm model folder")
    p.add_argument(
        "hf_dir",
        help="folder with config.json + safetensors (Llama 2/3, TinyLlama, Mistral, Qwen2, Qwen3, Arcee)",
    )
    p.add_argument("out", help="output folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty OUT (the new folder is written beside it and swapped in whole)",
    )


def _add_merge_and_export(verbs, common: argparse.ArgumentParser) -> None:
    """`merge` and `export` share their arguments; export adds its formats, --peft and --outtype."""
    for verb, text in (
        ("merge", "fold a LoRA run's adapters into its base: a plain model folder"),
        (
            "export",
            "a run / checkpoint -> Hugging Face folder (default), PEFT adapter (--peft), hopperlm or GGUF",
        ),
    ):
        p = add_verb(verbs, common, verb, cmd_export if verb == "export" else cmd_merge, text)
        p.add_argument("run", help="run dir (latest checkpoint), checkpoint dir or model folder")
        p.add_argument(
            "out",
            help="output folder"
            + ("; a GGUF export (--format gguf) is one file: NAME.gguf" if verb == "export" else ""),
        )
        formats = ["hf", "hopperlm", "gguf"] if verb == "export" else ["hopperlm", "hf"]
        p.add_argument("--format", choices=formats, default=formats[0], help=f"default {formats[0]}")
        p.add_argument("--dtype", default="auto", help="auto (as stored) | fp32 | bf16 | fp16")
        p.add_argument(
            "--max-shard-size",
            default="5GB",
            help="split weights into files of at most this size, in bytes with a unit: 500MB, 5GB, 1GiB "
            "(default: 5GB)",
        )
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="replace an existing OUT (written beside it and swapped in whole; GGUF: the file and its "
            "Modelfile)"
            if verb == "export"
            else "replace a non-empty OUT (written beside it and swapped in whole)",
        )
        if verb == "export":
            p.add_argument("--peft", action="store_true", help="LoRA runs: the adapters in PEFT's format")
            p.add_argument(
                "--outtype",
                default="f16",
                help="--format gguf: f16 (default) | bf16 | q8_0 | f32 (norms stay f32) | q4_k_m | q5_k_m | q6_k "
                "(k-quants: made by llama.cpp's llama-quantize from the f16 file; without it, q4_k_m with "
                "--modelfile writes the f16 file that `ollama create -q q4_K_M` quantizes); OUT is NAME.gguf",
            )
            p.add_argument(
                "--llama-cpp",
                metavar="DIR",
                help="--outtype q4_k_m|q5_k_m|q6_k: a llama.cpp checkout with build/bin/llama-quantize, or the "
                "folder holding llama-quantize (default: llama-quantize on PATH)",
            )
            p.add_argument(
                "--modelfile",
                action="store_true",
                help="--format gguf: also write an Ollama Modelfile beside OUT (FROM it, the run's chat template "
                "as TEMPLATE, stop tokens, hopperlm generate's sampling defaults)",
            )


def _add_generate(verbs, common: argparse.ArgumentParser) -> None:
    p = add_verb(
        verbs, common, "generate", cmd_generate, "sample text from a run or model", description=GENERATE_HELP
    )
    p.add_argument("run", help="run dir (latest checkpoint), checkpoint dir, exported or Hugging Face folder")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user turn of the chat template")
    model_default = "default: the model's generation_config.json, else"
    p.add_argument(
        "--max-new-tokens",
        type=int_at_least(1),
        help=f"at most this many new tokens (>= 1; {model_default} 200)",
    )
    p.add_argument("--temperature", type=float_at_least(0), help=f"0 = greedy (>= 0; {model_default} 0.8)")
    p.add_argument(
        "--top-k",
        type=int_at_least(0),
        help=f"sampling: keep the k most likely tokens, 0 = off (>= 0; {model_default} 200)",
    )
    p.add_argument(
        "--top-p",
        type=number(float, low=0, high=1, low_open=True),
        help=f"sampling: the most likely tokens whose probabilities reach p, 1 = off (in (0, 1]; {model_default} 1)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float_above(0),
        help=f"scores of ids already in the text: positive / p, negative * p; 1 = off (> 0; {model_default} 1)",
    )
    p.add_argument(
        "--num-samples", type=int_at_least(1), default=1, help="texts to sample (>= 1; default: 1)"
    )
    p.add_argument("--seed", type=int_at_least(0), default=0, help="sample i draws with seed + i (>= 0)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
