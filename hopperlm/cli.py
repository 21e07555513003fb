"""`hopperlm VERB ...`: one verb per job. User errors print one line and exit 2 (a traceback only with --debug)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hopperlm import __version__
from hopperlm.errors import ConfigError, HopperError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEMO_RECIPE = "shakespeare-char"


def log(line: str) -> None:
    print(line, flush=True)


def resolve_recipe(name_or_path: str) -> Path:
    """A YAML path, or the name of a recipe in configs/ (e.g. `shakespeare-char`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = CONFIGS_DIR / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(f"config {name_or_path} not found; pass a YAML file or one of: {', '.join(known)}")


# ---- verbs -------------------------------------------------------------------------------------------------
def cmd_prepare(args: argparse.Namespace) -> None:
    from hopperlm.data.prepare import prepare

    prepare(
        [p if p.startswith("hf:") else Path(p) for p in args.inputs],
        Path(args.out),
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        split=args.split,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        workers=args.workers,
        dedup=args.dedup,
        bad_utf8=args.bad_utf8,
        filter=args.filter,
    )


def cmd_tokenizer(args: argparse.Namespace) -> None:
    """`tokenizer train`: a new tokenizer from a corpus; `tokenizer extend`: BASE plus pieces for a new language."""
    import json

    from hopperlm.data import tokenizer_train as tt

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(
            f"--out {out} exists and is not empty; choose another directory or pass --overwrite"
        )
    texts = tt.corpus_texts(args.corpus, args.text_field)
    if args.action == "train":
        tok = tt.train_tokenizer(texts, args.kind, args.vocab_size)
        tok.save(out)
        log(
            f"trained {args.kind} tokenizer, {tok.vocab_size:,} pieces, eos id {tok.eos_id}: {out / 'tokenizer.json'}"
        )
        return
    base = tt.load_base(args.base)
    protect = "".join(Path(f).read_text(encoding="utf-8") for f in args.protect)
    ext = tt.extend_tokenizer(base, texts, args.add, protect=[protect])
    heldout = {
        Path(f).parent.name + "/" + Path(f).name: Path(f).read_text(encoding="utf-8") for f in args.heldout
    }
    rows = tt.compare(base, ext.tokenizer, heldout, protect)
    tt.save_extension(ext, out, rows)
    for line in tt.format_report(rows, len(ext.added), base.name):
        log(line)
    log(f"saved {out / 'tokenizer.json'} (+ extension.json: the added pieces and this report)")
    if args.json:
        print(json.dumps(rows, indent=1))


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> None:
    from hopperlm.config import load_config
    from hopperlm.train.loop import train

    cfg = load_config(resolve_recipe(args.config), overrides)
    resume = args.resume
    if resume == "auto":  # a (re)queued job: continue the run if it has checkpoints, else start it
        from hopperlm.train.checkpoint import list_checkpoints

        resume = bool(list_checkpoints(cfg.run.out_dir))
    result = train(cfg, resume=resume, log=log)
    if result.stopped_by.startswith("signal"):  # preempted: checkpointed; the scheduler may requeue us
        sys.exit(cfg.train.requeue_exit_code)


def cmd_launch(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the exact torchrun command for CONFIG, then become it (signals reach torchrun directly)."""
    import os
    import shlex

    from hopperlm.config import load_config
    from hopperlm.dist.launch import launch_command

    config = resolve_recipe(args.config)
    cfg = load_config(config, overrides)  # a bad config fails here, once, not on every rank
    command = launch_command(
        str(config),
        args.nproc_per_node,
        args.nnodes,
        args.rdzv_endpoint,
        args.rdzv_id or f"hopperlm-{Path(cfg.run.out_dir).name}",
        args.resume,
        overrides,
    )
    log(f"launch: {shlex.join(command)}")
    if args.nnodes > 1:
        log(f"launch: run this same command on each of the {args.nnodes} nodes")
    if not args.dry_run:
        sys.stdout.flush()
        os.execv(command[0], command)


def cmd_slurm(args: argparse.Namespace, overrides: list[str]) -> None:
    """Write an sbatch script that runs CONFIG on NODES x GPUS ranks and requeues itself before its time limit."""
    from hopperlm.config import load_config
    from hopperlm.dist.launch import sbatch_script

    config = resolve_recipe(args.config)
    cfg = load_config(config, overrides)
    run_dir = Path(cfg.run.out_dir).resolve()
    out = Path(args.out) if args.out else run_dir / "job.sbatch"
    script = sbatch_script(
        str(config),
        args.nodes,
        args.gpus_per_node,
        str(run_dir),
        overrides,
        time_limit=args.time,
        job_name=args.job_name,
        partition=args.partition,
        account=args.account,
        cpus_per_task=args.cpus_per_task,
        python=sys.executable,
    )
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the --output log there before the job starts
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(script)
    log(f"wrote {out} ({args.nodes} node(s) x {args.gpus_per_node} GPU(s)); submit with: sbatch {out}")


def cmd_finetune(args: argparse.Namespace, overrides: list[str]) -> None:
    """`train` for instruction data: the recipe must name sft.path (and usually model.init_from, lora)."""
    from hopperlm.config import load_config
    from hopperlm.train.loop import train

    cfg = load_config(resolve_recipe(args.config), overrides)
    if not cfg.sft.path:
        raise ConfigError(
            "finetune needs instruction data: set sft.path (Alpaca/ShareGPT/messages JSON); "
            "to train on prepared token shards use `hopperlm train`"
        )
    result = train(cfg, resume=args.resume, log=log)
    if result.stopped_by.startswith("signal"):
        sys.exit(cfg.train.requeue_exit_code)


def cmd_import(args: argparse.Namespace) -> None:
    from hopperlm.model.hf_convert import import_hf

    out = import_hf(Path(args.hf_dir), Path(args.out), overwrite=args.overwrite, log=log)
    log(f"imported {args.hf_dir} -> {out} (hopperlm model folder: weights, config.json, tokenizer/)")


def cmd_merge(args: argparse.Namespace) -> None:
    from hopperlm.model.hf_convert import export_hf, save_merged

    if args.format == "hf":
        out = export_hf(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite, log)
    else:
        out = save_merged(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite)
    log(f"merged the adapters of {args.run} into its base: {out} ({args.format} format)")


def cmd_eval(args: argparse.Namespace) -> None:
    import json

    from hopperlm.train.checkpoint import load_pretrained

    if not args.data and not args.gsm8k:
        raise ConfigError("nothing to evaluate: pass --data FILE_OR_DIR (held-out loss) and/or --gsm8k FILE")
    model, tokenizer = load_pretrained(args.model, device=args.device)
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
    from hopperlm.train.checkpoint import load_pretrained

    model, tokenizer = load_pretrained(args.run, device=args.device)
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
        from hopperlm.model.lora import export_peft

        out = export_peft(Path(args.run), Path(args.out), overwrite=args.overwrite)
        log(f"exported {out} (PEFT adapter: adapter_config.json + adapter_model.safetensors)")
    elif args.format == "hopperlm":
        from hopperlm.train.checkpoint import export_model

        out = export_model(Path(args.run), Path(args.out), overwrite=args.overwrite)
        log(f"exported {out} (hopperlm model folder: weights + config.json + tokenizer/)")
    else:
        from hopperlm.model.hf_convert import export_hf

        out = export_hf(Path(args.run), Path(args.out), args.dtype, args.max_shard_size, args.overwrite, log)
        log(f"exported {out} (Hugging Face folder: safetensors + config.json + tokenizer files)")


def cmd_diagnose(args: argparse.Namespace, overrides: list[str]) -> None:
    """Hardware report, the plan for a config with its reasons, and a short self-test of the device."""
    import dataclasses
    import json

    from hopperlm.hardware import detect, simulated

    hw = simulated(args.simulate) if args.simulate else detect()
    report: dict = {"hardware": hw.to_dict()}
    lines = ["== hardware" + (f" (simulated: {args.simulate})" if args.simulate else ""), *hw.summary()]
    if args.config:
        from hopperlm.config import load_config
        from hopperlm.data.prepare import read_manifest
        from hopperlm.errors import DataError
        from hopperlm.plan import make_plan
        from hopperlm.train.batch_finder import make_gpu_finder
        from hopperlm.train.loop import resolve_model_config

        cfg = load_config(resolve_recipe(args.config), overrides)
        model_cfg, vocab_note = cfg.model, ""
        try:
            model_cfg = resolve_model_config(cfg.model, read_manifest(Path(cfg.data.path))["vocab_size"])
        except DataError:
            if model_cfg.vocab_size is None:
                model_cfg = dataclasses.replace(model_cfg, vocab_size=32000)
                vocab_note = " (data not prepared: vocabulary taken as 32000)"
        finder = None
        if hw.device_type == "cuda" and not args.simulate and cfg.train.micro_batch is None:
            finder = make_gpu_finder(Path(cfg.run.out_dir), cfg.train.memory_target * hw.free_memory, log)
        from hopperlm.dist.runtime import World

        world = World(args.world_size, args.gpus_per_node or args.world_size)
        plan = make_plan(cfg, model_cfg, hw, finder if world.size == 1 else None, world)
        lines += [f"== plan for {args.config}{vocab_note}", *plan.lines()]
        report["plan"] = {**dataclasses.asdict(plan), "memory_bytes": plan.memory.total(plan.micro_batch)}
    if not args.simulate and not args.no_selftest:
        from hopperlm.selftest import format_selftest, run_selftest

        results = run_selftest(hw.device, hw.peak_16bit)
        lines += ["== self-test", *format_selftest(results)]
        report["selftest"] = results
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for line in lines:
            log(line)


def cmd_bench(args: argparse.Namespace) -> None:
    """Warm training steps of hopperlm beside eager PyTorch and HF transformers, one table, one JSON."""
    import dataclasses
    import json

    from hopperlm.hardware import detect_for
    from hopperlm.presets import PRESETS
    from hopperlm.provenance import provenance
    from hopperlm.speed.bench import DEFAULT_PRESETS, format_table, run_bench

    presets = args.presets.split(",") if args.presets else list(DEFAULT_PRESETS)
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ConfigError(
            f"unknown preset(s) {', '.join(unknown)} in --presets; choose from {', '.join(PRESETS)}"
        )
    if args.loss_steps and not args.data:
        raise ConfigError("--loss-steps needs --data DIR (a `hopperlm prepare` output) to train on real text")
    hw = detect_for(args.device)
    for line in hw.summary():
        log(line)
    rows = run_bench(
        presets,
        hw,
        quick=args.quick,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        steps=args.steps,
        windows=args.windows,
        warmup=args.warmup,
        hf=not args.no_hf,
        loss_steps=args.loss_steps,
        data_dir=Path(args.data) if args.data else None,
        variants=args.variant or [],
        log=log,
    )
    table = format_table(rows, hw)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            **provenance("hopperlm " + " ".join(sys.argv[1:])),
            "device": hw.name,
            "peak_16bit_tflops": hw.peak_16bit / 1e12 if hw.peak_16bit else None,
            "rows": [dataclasses.asdict(r) for r in rows],
            "table": table,
        }
        out.write_text(json.dumps(record, indent=1))
        log(f"results: {out}")
    log("")
    for line in table:
        log(line)


def cmd_plot(args: argparse.Namespace) -> None:
    from hopperlm.observe.plot import plot_runs

    out = Path(args.out) if args.out else Path(args.runs[0]) / "plots"
    for path in plot_runs([Path(r) for r in args.runs], out):
        log(f"wrote {path}")


def cmd_report(args: argparse.Namespace) -> None:
    from hopperlm.observe.report import write_report

    md, html = write_report(Path(args.run))
    log(f"wrote {md} and {html}")


def cmd_profile(args: argparse.Namespace, overrides: list[str]) -> None:
    from hopperlm.config import load_config
    from hopperlm.observe.profile import profile_config

    cfg = load_config(resolve_recipe(args.config), overrides)
    result = profile_config(cfg, args.steps, args.wait, args.warmup, args.out, args.memory_snapshot, log=log)
    kind = "GPU kernels, device time" if result.device == "cuda" else "CPU ops, self time"
    log(f"\n--- where the time goes ({kind}) ---")
    for line in result.table:
        log(line)
    log(f"time: {result.summary}")
    log(f"trace: {result.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    log(f"table: {result.out_dir / 'kernels.txt'}, {result.out_dir / 'profile.json'}")


def cmd_presets(args: argparse.Namespace) -> None:
    from hopperlm.model.transformer import count_params, flops_per_token
    from hopperlm.presets import PRESETS

    log(
        f"{'preset':<18}{'layers':>7}{'dim':>6}{'heads':>7}{'kv':>4}{'ffn':>7}{'vocab':>8}{'ctx':>6}"
        f"{'parameters':>16}{'GFLOP/token':>13}"
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
            f"{vocab!s:>8}{cfg.max_seq_len:>6}{params:>16}{gflops:>13}"
        )


def cmd_demo(args: argparse.Namespace, overrides: list[str]) -> None:
    """Tiny Shakespeare end to end: find the text, prepare it, train the demo recipe, print samples."""
    from hopperlm.config import load_config
    from hopperlm.data.demo_text import resolve_demo_text
    from hopperlm.data.prepare import prepare
    from hopperlm.train.checkpoint import load_pretrained
    from hopperlm.train.loop import train

    start = time.perf_counter()
    text = resolve_demo_text(args.data, log=log)
    run_dir = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"--out {run_dir} already exists and is not empty; choose a new directory")
    prepare([text], run_dir / "data", tokenizer="byte", val_fraction=0.1, split="tail")
    cfg = load_config(
        resolve_recipe(DEMO_RECIPE),
        ["--data.path", str(run_dir / "data"), "--run.out_dir", str(run_dir), *overrides],
    )
    result = train(cfg, log=log)
    model, tokenizer = load_pretrained(run_dir, device=cfg.train.device)
    log("\n--- samples ---")
    for i, sample in enumerate(model_samples(model, tokenizer, "\n", args.samples, 300, 0.8, 200, seed=0)):
        log(f"[sample {i + 1}]\n{sample.strip()}\n")
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    log(
        f"demo: val loss {val} nats/token after {result.step} steps; {time.perf_counter() - start:.0f} s in all; "
        f"run dir {run_dir}"
    )


# ---- parser ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser = argparse.ArgumentParser(prog="hopperlm", description=__doc__, parents=[common])
    parser.add_argument("--version", action="version", version=f"hopperlm {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser(
        "demo",
        parents=[common],
        help="train the shakespeare-char recipe and print samples",
        description="Extra --section.key value overrides apply to the demo recipe.",
    )
    p.add_argument("--data", help="a text file to train on instead of Tiny Shakespeare")
    p.add_argument("--out", help="run directory (default runs/demo-DATE-TIME)")
    p.add_argument("--samples", type=int, default=3, help="samples to print at the end")

    p = verbs.add_parser(
        "prepare",
        parents=[common],
        help="text/JSONL/Parquet -> token shards + manifest.json (resumable)",
        description="An interrupted prepare resumes when run again with the same inputs and options.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help=".txt, .jsonl, .jsonl.gz, .parquet files, folders of them, a datasets save_to_disk folder, hf:NAME",
    )
    p.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    p.add_argument(
        "--tokenizer", default="byte", help="byte | bpe | path to tokenizer.json / tokenizer.model"
    )
    p.add_argument("--vocab-size", type=int, help="vocabulary size when training a BPE tokenizer")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens held out for validation")
    p.add_argument(
        "--split",
        choices=["tail", "docs"],
        default="tail",
        help="tail: last tokens are validation; docs: whole documents by hash",
    )
    p.add_argument("--text-field", default="text", help="JSONL field holding the document text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="most tokens per shard file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    p.add_argument("--workers", type=int, help="tokenizer processes (default: one per core; 1 for byte)")
    p.add_argument("--dedup", action="store_true", help="drop exact duplicate documents (by sha256)")
    p.add_argument(
        "--bad-utf8",
        choices=["reject", "skip"],
        default="reject",
        help="invalid UTF-8: stop with file and byte offset (reject), or leave the line/record out and report it",
    )
    p.add_argument(
        "--filter",
        help="keep documents that pass: script:NAME:FRACTION (e.g. script:ethiopic:0.5) or module:function",
    )

    p = verbs.add_parser(
        "tokenizer", parents=[common], help="train a tokenizer, or extend one for a new language"
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = actions.add_parser("train", parents=[common], help="learn a BPE or Unigram tokenizer on a corpus")
    t.add_argument("corpus", nargs="+", help="text/JSONL/TSV/Parquet files or folders (as for prepare)")
    t.add_argument("--kind", choices=["bpe", "unigram"], default="bpe", help="byte-level BPE or Unigram")
    t.add_argument("--vocab-size", type=int, required=True)
    e = actions.add_parser(
        "extend",
        parents=[common],
        help="add pieces learned on a new language to BASE; old ids and protected text stay unchanged",
    )
    e.add_argument(
        "base", help="BPE tokenizer.json (or its folder), e.g. TinyLlama's (the Llama-2 vocabulary)"
    )
    e.add_argument("corpus", nargs="+", help="text of the new language (files or folders, as for prepare)")
    e.add_argument("--add", type=int, required=True, help="most pieces to add")
    e.add_argument(
        "--heldout", action="append", default=[], help="held-out sample to report fertility on (repeat)"
    )
    e.add_argument(
        "--protect", action="append", default=[], help="text whose tokenization must not change (repeat)"
    )
    e.add_argument("--json", action="store_true", help="also print the report as JSON")
    for q in (t, e):
        q.add_argument("--out", required=True, help="output directory for tokenizer.json")
        q.add_argument("--text-field", default="text", help="JSONL field / table column holding the text")
        q.add_argument("--overwrite", action="store_true")

    p = verbs.add_parser(
        "train",
        parents=[common],
        help="train from a YAML recipe",
        description="Extra --section.key value pairs override the recipe, e.g. --train.max_steps 100",
    )
    p.add_argument("config", help="YAML recipe, or a name from configs/ (e.g. shakespeare-char)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the run's latest checkpoint, or from PATH; `auto`: only if it has checkpoints",
    )

    p = verbs.add_parser(
        "launch",
        parents=[common],
        help="print and run the torchrun command that trains CONFIG on several GPUs / nodes",
        description="Extra --section.key value overrides go to `hopperlm train` on every rank.",
    )
    p.add_argument("config", help="YAML recipe, or a name from configs/")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node (usually its GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes; run the same command on each")
    p.add_argument(
        "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous every node reaches (several nodes)"
    )
    p.add_argument("--rdzv-id", help="job id shared by the nodes (default: hopperlm-RUN_DIR_NAME)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH", help="as for train")
    p.add_argument("--dry-run", action="store_true", help="print the command only")

    p = verbs.add_parser(
        "slurm",
        parents=[common],
        help="write an sbatch script (srun + torchrun) that checkpoints and requeues before its time limit",
        description="Extra --section.key value overrides go to `hopperlm train` on every rank.",
    )
    p.add_argument("config", help="YAML recipe, or a name from configs/")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--out", help="where to write the script (default RUN_DIR/job.sbatch)")
    p.add_argument("--time", default="24:00:00", help="time limit of one job (it requeues itself)")
    p.add_argument("--job-name", help="default hopperlm-CONFIG")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores per node for the training processes")

    p = verbs.add_parser(
        "finetune",
        parents=[common],
        help="instruction/chat fine-tuning (sft section; LoRA/QLoRA with the lora section)",
        description="Extra --section.key value pairs override the recipe, e.g. --lora.rank 8",
    )
    p.add_argument("config", help="YAML recipe with an sft section, or a name from configs/")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH")

    p = verbs.add_parser(
        "import", parents=[common], help="Hugging Face model folder -> hopperlm model folder"
    )
    p.add_argument(
        "hf_dir", help="folder with config.json + safetensors (Llama 2/3, TinyLlama, Mistral, Qwen2)"
    )
    p.add_argument("out", help="output folder")
    p.add_argument("--overwrite", action="store_true")

    for verb, text in (
        ("merge", "fold a LoRA run's adapters into its base: a plain model folder"),
        ("export", "a run / checkpoint -> Hugging Face folder (default), PEFT adapter (--peft) or hopperlm"),
    ):
        p = verbs.add_parser(verb, parents=[common], help=text)
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

    p = verbs.add_parser(
        "eval", parents=[common], help="held-out loss/perplexity, GSM8K exact match of generated answers"
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

    p = verbs.add_parser("generate", parents=[common], help="sample text from a trained run")
    p.add_argument("run", help="run dir (latest checkpoint), checkpoint dir, exported or Hugging Face folder")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user turn of the chat template")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")

    p = verbs.add_parser(
        "diagnose",
        parents=[common],
        help="hardware report, the plan for a config with reasons, and a device self-test",
        description="Extra --section.key value overrides apply to CONFIG.",
    )
    p.add_argument("config", nargs="?", help="YAML recipe or name from configs/ to plan for")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--simulate",
        metavar="GPU",
        help="plan for a GPU that is not here: "
        + ", ".join(["'H100 80GB'", "H200", "'A100 40GB'", "'RTX 4050 6GB'", "T4", "CPU"]),
    )
    p.add_argument("--no-selftest", action="store_true", help="skip the matmul/copy/attention/compile checks")
    p.add_argument("--world-size", type=int, default=1, help="plan for this many ranks (DDP/FSDP choice)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node for --world-size (default: all)")

    p = verbs.add_parser(
        "bench",
        parents=[common],
        help="tokens/s, MFU and memory of training steps beside eager PyTorch and HF transformers",
    )
    p.add_argument("--presets", help="comma-separated presets (default gpt2-124m,h100-350m,tinyllama-1.1b)")
    p.add_argument(
        "--quick", action="store_true", help="two blocks of each preset, short sequences (CPU smoke)"
    )
    p.add_argument("--micro-batch", type=int, help="sequences per step for every row (default per preset)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default per preset)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per timed window")
    p.add_argument("--windows", type=int, default=5, help="timed windows; the median counts")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers baselines")
    p.add_argument("--loss-steps", type=int, default=0, help="train hopperlm rows this many steps on --data")
    p.add_argument("--data", help="prepared data dir for --loss-steps")
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME:KEY=VALUE,...",
        help="an extra hopperlm row with train.* overrides, e.g. mb32:micro_batch=32 (repeatable)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="write the results as JSON here (e.g. bench/results/DATE-GPU.json)")

    verbs.add_parser("presets", parents=[common], help="list model presets with exact sizes")

    p = verbs.add_parser("plot", parents=[common], help="PNG plots of one run, or several overlaid")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", help="folder for the PNGs (default: FIRST_RUN_DIR/plots)")

    p = verbs.add_parser("report", parents=[common], help="write RUN_DIR/report.md and report.html")
    p.add_argument("run", metavar="RUN_DIR")

    p = verbs.add_parser(
        "profile",
        parents=[common],
        help="profile training steps: trace, top-kernels table, where the time goes",
        description="Runs the real training loop of CONFIG under torch.profiler in RUN_DIR/profile (no "
        "checkpoints). Extra --section.key value overrides apply to CONFIG.",
    )
    p.add_argument("config", help="YAML recipe, or a name from configs/")
    p.add_argument("--steps", type=int, default=5, help="steps recorded (default 5)")
    p.add_argument("--wait", type=int, default=1, help="steps run before the profiler starts (compilation)")
    p.add_argument("--warmup", type=int, default=2, help="steps profiled but discarded (profiler warm-up)")
    p.add_argument("--out", help="output folder (default RUN_DIR/profile)")
    p.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="record every CUDA allocation and write memory_snapshot.pickle (GPU only)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if extra and args.verb not in ("train", "finetune", "demo", "diagnose", "profile", "launch", "slurm"):
            raise ConfigError(f"unrecognised arguments: {' '.join(extra)}; see hopperlm {args.verb} --help")
        if args.verb == "train":
            cmd_train(args, extra)
        elif args.verb == "finetune":
            cmd_finetune(args, extra)
        elif args.verb == "demo":
            cmd_demo(args, extra)
        elif args.verb == "diagnose":
            cmd_diagnose(args, extra)
        elif args.verb == "profile":
            cmd_profile(args, extra)
        elif args.verb in ("launch", "slurm"):
            (cmd_launch if args.verb == "launch" else cmd_slurm)(args, extra)
        else:
            verbs = {
                "prepare": cmd_prepare,
                "generate": cmd_generate,
                "export": cmd_export,
                "import": cmd_import,
                "merge": cmd_merge,
                "eval": cmd_eval,
                "presets": cmd_presets,
                "bench": cmd_bench,
                "tokenizer": cmd_tokenizer,
                "plot": cmd_plot,
                "report": cmd_report,
            }
            verbs[args.verb](args)
    except HopperError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
