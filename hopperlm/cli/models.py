"""Model verbs: `import` from and `export` to Hugging Face, `merge` LoRA adapters, `eval`, `generate`, `presets`."""

from __future__ import annotations

import argparse
from pathlib import Path

from hopperlm.cli.common import add_verb, log
from hopperlm.errors import ConfigError


def cmd_import(args: argparse.Namespace) -> None:
    from hopperlm.checkpoint.hf_convert import import_hf

    out = import_hf(Path(args.hf_dir), Path(args.out), overwrite=args.overwrite, log=log)
    log(f"imported {args.hf_dir} -> {out} (hopperlm model folder: weights, config.json, tokenizer/)")


def cmd_merge(args: argparse.Namespace) -> None:
    from hopperlm.checkpoint.hf_convert import export_hf, save_merged

    if args.format == "hf":
        out = export_hf(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite, log)
    else:
        out = save_merged(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite)
    log(f"merged the adapters of {args.run} into its base: {out} ({args.format} format)")


def cmd_eval(args: argparse.Namespace) -> None:
    import json

    from hopperlm.checkpoint.inference import load_for_inference

    if not args.data and not args.gsm8k:
        raise ConfigError("nothing to evaluate: pass --data FILE_OR_DIR (held-out loss) and/or --gsm8k FILE")
    model, tokenizer = load_for_inference(args.model, device=args.device)
    report: dict = {"model": args.model, "heldout": [], "gsm8k": None}
    if args.data:
        from hopperlm.eval.heldout import heldout_loss

        log(f"{'held-out set':<48}{'tokens':>10}{'loss':>9}{'ppl':>10}{'bits/byte':>11}")
        for path in args.data:
            r = heldout_loss(model, tokenizer, Path(path), args.seq_len, args.batch, args.max_tokens)
            report["heldout"].append(r.to_dict())
            bpb = f"{r.bits_per_byte:.4f}" if r.bits_per_byte is not None else "n/a"
            log(f"{path[-47:]:<48}{r.tokens:>10,}{r.nats_per_token:>9.4f}{r.perplexity:>10.2f}{bpb:>11}")
    if args.gsm8k:
        from hopperlm.eval.gsm8k import gsm8k_eval

        g = gsm8k_eval(model, tokenizer, Path(args.gsm8k), args.limit, args.shots, args.max_new_tokens, log)
        report["gsm8k"] = {
            "accuracy": g.accuracy,
            "correct": g.correct,
            "total": g.total,
            "samples": g.samples,
        }
        log(f"gsm8k: {g.correct}/{g.total} exact match = {g.accuracy:.1%} (greedy, {args.shots}-shot)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log(f"results: {args.json}")


def cmd_generate(args: argparse.Namespace) -> None:
    from hopperlm.checkpoint.inference import load_for_inference

    model, tokenizer = load_for_inference(args.run, device=args.device)
    prompt, encoder = args.prompt, None
    if args.chat:  # the prompt as a user turn of the model's chat template, as fine-tuning rendered it
        from hopperlm.data.chat import chat_encoder
        from hopperlm.eval.gsm8k import chat_template

        template = chat_template(tokenizer)
        if template is None:
            raise ConfigError(f"--chat: the tokenizer of {args.run} has no chat template; drop --chat")
        prompt = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        encoder = chat_encoder(tokenizer)
    for i, text in enumerate(
        model_samples(
            model,
            tokenizer,
            prompt,
            args.num_samples,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.seed,
            encoder,
        )
    ):
        if args.num_samples > 1:
            log(f"--- sample {i + 1} ---")
        log(text)


def model_samples(model, tokenizer, prompt, n, max_new_tokens, temperature, top_k, seed, encoder=None):
    from hopperlm.model.generate import generate

    ids = (encoder or tokenizer).encode(prompt) or [tokenizer.eos_id]
    for i in range(n):
        out = generate(model, ids, max_new_tokens, temperature, top_k, tokenizer.eos_id, seed=seed + i)
        yield prompt + tokenizer.decode(out)


def cmd_export(args: argparse.Namespace) -> None:
    if args.peft:
        from hopperlm.checkpoint.peft import export_peft

        out = export_peft(Path(args.run), Path(args.out), overwrite=args.overwrite)
        log(f"exported {out} (PEFT adapter: adapter_config.json + adapter_model.safetensors)")
    elif args.format == "hopperlm":
        from hopperlm.checkpoint.single import export_model

        out = export_model(Path(args.run), Path(args.out), overwrite=args.overwrite)
        log(f"exported {out} (hopperlm model folder: weights + config.json + tokenizer/)")
    else:
        from hopperlm.checkpoint.hf_convert import export_hf

        out = export_hf(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite, log)
        log(f"exported {out} (Hugging Face folder: safetensors + config.json + tokenizer files)")


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
    p = add_verb(verbs, common, "import", cmd_import, "Hugging Face model folder -> hopperlm model folder")
    p.add_argument(
        "hf_dir", help="folder with config.json + safetensors (Llama 2/3, TinyLlama, Mistral, Qwen2)"
    )
    p.add_argument("out", help="output folder")
    p.add_argument("--overwrite", action="store_true")

    for verb, text in (
        ("merge", "fold a LoRA run's adapters into its base: a plain model folder"),
        ("export", "a run / checkpoint -> Hugging Face folder (default), PEFT adapter (--peft) or hopperlm"),
    ):
        p = add_verb(verbs, common, verb, cmd_export if verb == "export" else cmd_merge, text)
        p.add_argument("run", help="run dir (latest checkpoint), checkpoint dir or model folder")
        p.add_argument("out", help="output directory")
        formats = ["hf", "hopperlm"] if verb == "export" else ["hopperlm", "hf"]
        p.add_argument("--format", choices=formats, default=formats[0], help=f"default {formats[0]}")
        p.add_argument("--dtype", default="auto", help="auto (as stored) | fp32 | bf16 | fp16")
        p.add_argument(
            "--max-shard-size", default="5GB", help="split weights into files of at most this size"
        )
        p.add_argument("--overwrite", action="store_true")
        if verb == "export":
            p.add_argument("--peft", action="store_true", help="LoRA runs: the adapters in PEFT's format")

    p = add_verb(
        verbs, common, "eval", cmd_eval, "held-out loss/perplexity, GSM8K exact match of generated answers"
    )
    p.add_argument("model", help="run dir, checkpoint, model folder or Hugging Face folder")
    p.add_argument(
        "--data", action="append", default=[], help="held-out text file/folder or prepared dir (repeat)"
    )
    p.add_argument("--gsm8k", help="GSM8K JSONL (question/answer), e.g. ../shared/data/gsm8k/test.jsonl")
    p.add_argument("--limit", type=int, help="GSM8K: only the first N problems")
    p.add_argument("--shots", type=int, default=0, help="GSM8K: worked examples from train.jsonl beside it")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--seq-len", type=int, default=1024, help="held-out window (capped at the model's context)"
    )
    p.add_argument("--max-tokens", type=int, help="held-out: score at most this many tokens per set")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write the results here")

    p = add_verb(verbs, common, "generate", cmd_generate, "sample text from a trained run")
    p.add_argument("run", help="run dir (latest checkpoint), checkpoint dir, exported or Hugging Face folder")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user turn of the chat template")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")

    add_verb(verbs, common, "presets", cmd_presets, "list model presets with exact sizes")
