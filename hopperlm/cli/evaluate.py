"""`hopperlm eval MODEL`: lm-evaluation-harness tasks (--tasks), held-out loss, perplexity and bits per byte
(--data), GSM8K exact match of generated answers (--gsm8k), on a run, checkpoint, model folder or Hugging Face
folder, loaded once for all of them (cli/models.py registers the verb beside export and generate)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hopperlm.cli.common import DEVICE_HELP, add_verb, int_at_least, log
from hopperlm.errors import ConfigError


def cmd_eval(args: argparse.Namespace) -> None:
    """lm-evaluation-harness tasks (--tasks), held-out loss in the windows heldout.py describes (the
    windowing is printed per set), and GSM8K."""
    import json

    import torch

    from hopperlm.eval.harness import require_lm_eval
    from hopperlm.interop.inference import load_for_inference, trained_with

    if not args.data and not args.gsm8k and not args.tasks:
        raise ConfigError(
            "nothing to evaluate: pass --tasks T1,T2 (lm-evaluation-harness), --data FILE_OR_DIR (held-out "
            "loss) and/or --gsm8k FILE"
        )
    report: dict = {"model": args.model, "heldout": [], "gsm8k": None}
    if args.tasks:
        require_lm_eval()  # before loading a model: one line saying how to install it
    # loaded once for everything asked; a LoRA run stays unmerged when lm-eval scores it (as it trained)
    model, tokenizer = load_for_inference(args.model, device=args.device, merge=not args.tasks)
    if args.tasks:
        report["lm_eval"] = harness_tasks(args, model, tokenizer)
    if args.data:
        from hopperlm.eval.heldout import default_batch, default_context, heldout_loss

        run = trained_with(args.model)
        seq_len, why = default_context(model, run.seq_len if run else None, args.seq_len)
        batch = args.batch or (run.micro_batch if run else default_batch(model, seq_len))
        autocast = None  # a run on a GPU validated under autocast: so does its evaluation
        if run is not None and model.embed.weight.device.type == "cuda":
            autocast = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        log(
            f"context {seq_len} tokens ({why}); {batch} windows per forward"
            + (f", {str(autocast).removeprefix('torch.')} autocast as the run validated" if autocast else "")
        )
        report["context"] = {"seq_len": seq_len, "why": why, "batch": batch}
        results = []
        for path in args.data:
            r = heldout_loss(
                model,
                tokenizer,
                Path(path),
                seq_len,
                batch,
                args.max_tokens,
                windows=args.windows or (run.eval_windows if run else None),
                packing=bool(run and run.packing),
                autocast=autocast,
            )
            log(f"{path}: {r.windowing}")
            results.append((path, r))
            report["heldout"].append(r.to_dict())
        log(f"{'held-out set':<48}{'tokens':>10}{'loss':>9}{'ppl':>10}{'bits/byte':>11}")
        for path, r in results:
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
        from hopperlm.files import write_atomic

        write_atomic(args.json, json.dumps(report, indent=1, default=str) + "\n")  # whole or as before
        log(f"results: {args.json}")


def harness_tasks(args: argparse.Namespace, model, tokenizer) -> dict:
    """`--tasks` through lm-evaluation-harness (eval/harness.py): the table printed, lm-eval's results returned
    (metrics under lm-eval's names); a LoRA run is scored with its adapters unmerged."""
    import json
    import os

    import torch

    from hopperlm.eval.harness import metrics_of, run_tasks
    from hopperlm.interop.inference import tokenizer_path, trained_with

    if not args.debug:  # lm-eval's progress bars (its log lines go to the third-party log file)
        os.environ.setdefault("TQDM_DISABLE", "1")
    from lm_eval.utils import make_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    autocast = None  # a run trained on a GPU under autocast is scored under it too
    if trained_with(args.model) is not None and model.embed.weight.device.type == "cuda":
        autocast = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    results = run_tasks(
        model,
        tokenizer,
        tasks,
        tokenizer_folder=tokenizer_path(args.model),
        batch_size=args.batch or 8,
        autocast=autocast,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        include_path=args.include_path,
        log_samples=bool(args.log_samples),
    )
    log(make_table(results))
    if args.log_samples:
        from hopperlm.files import write_atomic

        samples = results.get("samples", {}).items()
        lines = (json.dumps({"task": task, **s}, default=str) + "\n" for task, ss in samples for s in ss)
        write_atomic(args.log_samples, "".join(lines))  # whole or as before
        log(f"samples: {args.log_samples}")
    return {
        "metrics": metrics_of(results),
        "results": results["results"],
        "n-samples": results.get("n-samples"),
    }


def add_parsers(verbs, common: argparse.ArgumentParser) -> None:
    p = add_verb(
        verbs,
        common,
        "eval",
        cmd_eval,
        "lm-evaluation-harness tasks, held-out loss/perplexity, GSM8K exact match of generated answers",
    )
    p.add_argument("model", help="run dir, checkpoint, model folder or Hugging Face folder")
    p.add_argument(
        "--tasks",
        help="lm-evaluation-harness tasks, comma-separated (e.g. hellaswag,arc_easy; local task YAMLs with "
        "--include-path); needs pip install 'hopperlm[eval]'",
    )
    p.add_argument(
        "--num-fewshot", type=int_at_least(0), help="--tasks: examples in each prompt (default: the task's)"
    )
    p.add_argument(
        "--include-path", help="--tasks: a folder of task YAMLs (e.g. dataset_path: json, local data_files)"
    )
    p.add_argument("--log-samples", help="--tasks: write every request and response here (JSONL)")
    p.add_argument(
        "--data", action="append", default=[], help="held-out text file/folder or prepared dir (repeat)"
    )
    p.add_argument("--gsm8k", help="GSM8K JSONL (question/answer), e.g. ../shared/data/gsm8k/test.jsonl")
    p.add_argument(
        "--limit", type=int_at_least(1), help="GSM8K and --tasks: only the first N problems (>= 1)"
    )
    p.add_argument(
        "--shots",
        type=int_at_least(0),
        default=0,
        help="GSM8K: worked examples from train.jsonl beside it (>= 0)",
    )
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=256, help="GSM8K answer length (>= 1)")
    p.add_argument(
        "--seq-len",
        type=int_at_least(1),
        help="held-out predictions per window (>= 1); default: the run's train.seq_len, else the model's "
        "context (max_position_embeddings) capped so one window's logits fit in memory",
    )
    p.add_argument(
        "--windows",
        type=int_at_least(1),
        help="prepared dirs: score this many evenly spaced validation windows (default: the run's "
        "train.eval_windows, so the loss equals its logged val_loss; else every window)",
    )
    p.add_argument(
        "--max-tokens", type=int_at_least(1), help="held-out: score at most this many tokens per set (>= 1)"
    )
    p.add_argument(
        "--batch",
        type=int_at_least(1),
        help="held-out windows (--tasks: requests) per forward pass (>= 1; default: the run's micro-batch, "
        "else up to 8; --tasks: 8)",
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--json", help="also write the results here")
