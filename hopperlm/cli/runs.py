"""Training verbs: `demo`, `train`, `finetune`, and `launch`/`slurm` for several GPUs or nodes (`sweep`: tune.py)."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hopperlm.cli.common import (
    add_verb,
    int_at_least,
    log,
    number,
    printed_config,
    resolve_recipe,
    run_config,
)
from hopperlm.cli.models import model_samples
from hopperlm.cli.tune import add_sweep_parser
from hopperlm.errors import ConfigError
from hopperlm.files import write_atomic

if TYPE_CHECKING:  # (the CLI imports torch only when a verb needs it)
    from hopperlm.checkpoint.checkpointer import Resume
    from hopperlm.config import Config

DEMO_RECIPE = "shakespeare-char"


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> None:

    cfg = run_config(args.config, overrides)
    if not printed_config(args, cfg):
        train_until_done(cfg, args.resume, command=["train", args.config, *overrides])


CTRL_C_EXIT = 130  # a shell's code for a process ended by SIGINT (128 + 2)


def train_until_done(cfg: Config, resume: Resume, *, command: list[str]) -> None:
    """`train` and `finetune`: `--resume` as checkpoint/checkpointer.py's `find_resume` reads it (`auto`:
    continue the run if it has checkpoints, else start it: a (re)queued job); a preemption signal exits with
    train.requeue_exit_code so the scheduler may requeue us, a Ctrl-C (saved too) with 130. `command`: the verb,
    recipe and overrides as the user typed them: with --resume, what the Ctrl-C line tells to run."""
    from hopperlm.train.loop import train

    again = shlex.join(["hopperlm", *map(str, command), "--resume"])
    result = train(cfg, resume=resume, log=log, resume_command=again)
    if result.stopped_by == "signal SIGINT":
        sys.exit(CTRL_C_EXIT)
    if result.stopped_by.startswith("signal"):  # preempted: checkpointed
        sys.exit(cfg.train.requeue_exit_code)


def cmd_launch(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the torchrun command for CONFIG and run it under a supervisor (parallel/supervise.py): a rank that
    stops answering ends the job within its collective limit, a failure is one line with the resume command,
    and --max-restarts restarts the group from the latest checkpoint."""
    import os
    import shlex
    import socket
    from contextlib import nullcontext

    from hopperlm.cli.third_party_logs import Redirect
    from hopperlm.folder_lock import HELD_FOR_CHILDREN_ENV, hold_folder
    from hopperlm.parallel.launch import launch_command
    from hopperlm.parallel.supervise import node_file, supervise

    config = resolve_recipe(args.config)
    # a bad config (model.init_from included) fails here, once, not on every rank
    cfg = run_config(args.config, overrides)
    command = launch_command(
        str(config),
        args.nproc_per_node,
        args.nnodes,
        args.rdzv_endpoint,
        args.rdzv_id or f"hopperlm-{Path(cfg.run.out_dir).name}",
        args.resume,
        overrides,
        verb="finetune" if cfg.sft.path else "train",
        max_restarts=args.max_restarts,
    )
    log(f"launch: {shlex.join(command)}")
    if args.nnodes > 1:
        log(f"launch: run this same command on each of the {args.nnodes} nodes")
    if args.dry_run:
        return
    sys.stdout.flush()
    run_dir = Path(cfg.run.out_dir).resolve()
    again = ["hopperlm", "launch", str(args.config), "--nproc-per-node", str(args.nproc_per_node)]
    if args.nnodes > 1:
        again += ["--nnodes", str(args.nnodes), "--rdzv-endpoint", str(args.rdzv_endpoint)]
    if args.max_restarts:
        again += ["--max-restarts", str(args.max_restarts)]
    # one launcher per node, all writing into one run folder (a shared filesystem): each names its own files
    node = f"{socket.gethostname()}-{os.getpid()}" if args.nnodes > 1 else None
    # one node: the launcher holds the run folder before its first write (launch.log), so a second launch into it
    # is refused before writing anything; its ranks write under that lock. Across nodes rank 0 takes it (which
    # node runs rank 0 is known only after the rendezvous).
    hold = nullcontext() if args.nnodes > 1 else hold_folder(run_dir, what="--run.out_dir", log=log)
    with hold:
        os.environ[HELD_FOR_CHILDREN_ENV] = str(os.getpid())
        code = supervise(
            command[3:],  # after `python -m torch.distributed.run`: torchrun's argv
            run_dir,
            resume_command=[*again, "--resume", *overrides],
            where_to_go_on=lambda: latest_checkpoint_clause(
                run_dir, [*again, "--resume", *overrides], [*again, *overrides]
            ),
            debug=args.debug,
            # torchrun's agent's log lines
            quiet=None if args.debug else Redirect(node_file(run_dir, "launch", ".log", node)),
            node=node,
        )
        os.environ.pop(HELD_FOR_CHILDREN_ENV, None)
    if code:
        sys.exit(code)


def cmd_slurm(args: argparse.Namespace, overrides: list[str]) -> None:
    """Write an sbatch script that runs CONFIG on NODES x GPUS ranks and requeues itself before its time limit."""
    from hopperlm.parallel.launch import sbatch_script

    config = resolve_recipe(args.config)
    cfg = run_config(args.config, overrides)
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
        script_path=str(out),
        max_restarts=args.max_restarts,
    )
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the --output log there before the job starts
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, script)
    log(f"wrote {out} ({args.nodes} node(s) x {args.gpus_per_node} GPU(s)); submit with: sbatch {out}")


def cmd_finetune(args: argparse.Namespace, overrides: list[str]) -> None:
    """`train` for instruction data: the recipe must name sft.path (and usually model.init_from, lora)."""

    cfg = run_config(args.config, overrides)
    if not cfg.sft.path:
        raise ConfigError(
            "finetune needs instruction data: set sft.path (Alpaca/ShareGPT/messages JSON); "
            "to train on prepared token shards use `hopperlm train`"
        )
    if not printed_config(args, cfg):
        train_until_done(cfg, args.resume, command=["finetune", args.config, *overrides])


def cmd_demo(args: argparse.Namespace, overrides: list[str]) -> None:
    """Tiny Shakespeare end to end: find the text, prepare it, train the demo recipe, print samples."""
    from hopperlm.checkpoint.layout import list_checkpoints
    from hopperlm.data.demo_text import describe_text, resolve_demo_text
    from hopperlm.data.prepare import PrepareOptions, prepare
    from hopperlm.files import write_atomic
    from hopperlm.interop.inference import load_for_inference
    from hopperlm.observe.report import DEMO_FILE, write_report
    from hopperlm.train.loop import train

    start = time.perf_counter()
    text = resolve_demo_text(args.data, log=log)
    run_dir = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"--out {run_dir} already exists and is not empty; choose a new directory")
    created = not run_dir.exists()
    try:
        prepare([text], run_dir / "data", PrepareOptions(tokenizer="byte", val_fraction=0.1, split="tail"))
        cfg = run_config(
            DEMO_RECIPE, ["--data.path", str(run_dir / "data"), "--run.out_dir", str(run_dir), *overrides]
        )
        result = train(cfg, log=log)
    except BaseException:
        # a demo that failed before its first checkpoint leaves nothing behind; one with checkpoints is kept
        if created and not list_checkpoints(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if result.stopped_by == "signal SIGINT":  # saved; the line said how to go on (train on its config.yaml)
        sys.exit(CTRL_C_EXIT)
    model, tokenizer = load_for_inference(run_dir, device=cfg.train.device)
    log("\n--- samples ---")
    samples = [s.strip() for s in model_samples(model, tokenizer, "\n", args.samples, 300, 0.8, 200, seed=0)]
    for i, sample in enumerate(samples):
        log(f"[sample {i + 1}]\n{sample}\n")
    # the report names the text it trained on (perhaps the offline fallback) and holds the samples
    write_atomic(run_dir / DEMO_FILE, json.dumps({"data": describe_text(text), "samples": samples}, indent=1))
    if cfg.log.report:
        write_report(run_dir)
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    if result.val_step not in (None, result.step):  # a signal stopped it between validations
        val += f" (at step {result.val_step})"
    log(
        f"demo: val loss {val} nats/token after {result.step} steps; {time.perf_counter() - start:.0f} s in all; "
        f"run dir {run_dir}"
    )


def cmd_forecast(args: argparse.Namespace) -> None:
    """Predict RUN's final validation loss (with an interval) from its records so far, or from the first
    --using of its budget; compare with --target (default: the run's train.target_loss)."""
    import json

    from hopperlm.observe.forecast import forecast_run, run_target

    forecast = forecast_by_collapse(args) if args.proxies else None
    if forecast is None:
        forecast = forecast_run(Path(args.run), using=args.using, siblings=args.siblings)
    target = args.target if args.target is not None else run_target(Path(args.run))
    log(forecast.line(target))
    if args.json:
        out = {**forecast.to_dict(), "target": target}
        write_atomic(args.json, json.dumps(out, indent=2) + "\n")  # whole or as before
        log(f"wrote {args.json}")


def forecast_by_collapse(args: argparse.Namespace):
    """`forecast --proxies SWEEP_DIR`: the run's first --using of its budget fitted to the proxies' collapsed
    curve (observe/collapse.py); None, said in one line, where the proxies trained another number of tokens per
    parameter (the in-run law forecasts then). Proxies of another schedule, parametrization or data, fewer than
    three widths, or a run that has not trained its --using share: ConfigError."""
    from hopperlm.observe import collapse

    run = collapse.curve_of_run(Path(args.run))
    proxies = collapse.read_proxies(Path(args.proxies))
    if (why := collapse.check_proxies(run, proxies)) is not None:
        raise ConfigError(f"forecast --proxies {args.proxies}: {why}; give the proxies of this run's recipe")
    trained = collapse.evaluated_share(run)
    using = args.using if args.using is not None else trained
    if trained < using - 1e-9:
        raise ConfigError(
            f"forecast --using {args.using:g}: {args.run} has validation losses up to {trained:.0%} of its budget "
            f"only; wait, or forecast from at most {trained:.2f}"
        )
    if (why := collapse.tokens_mismatch(run, proxies)) is not None:
        log(f"forecast: {why}: their curves do not shape this run's; the in-run law forecasts instead")
        return None
    return collapse.collapse_forecast(run, proxies, using=using)


def add_parsers(verbs, common: argparse.ArgumentParser) -> None:
    """The training verbs, in the order `hopperlm --help` lists them."""
    recipe = "YAML recipe, or a name from configs/ (e.g. shakespeare-char)"
    p = add_verb(
        verbs,
        common,
        "demo",
        cmd_demo,
        "train the shakespeare-char recipe and print samples",
        overrides="the demo recipe, e.g. --train.max_hours 0.01",
    )
    p.add_argument("--data", help="a text file to train on instead of Tiny Shakespeare")
    p.add_argument("--out", help="run directory (default runs/demo-DATE-TIME)")
    p.add_argument("--samples", type=int, default=3, help="samples to print at the end")

    add_verb(
        verbs,
        common,
        "train",
        cmd_train,
        "train from a YAML recipe",
        overrides="the recipe, e.g. --train.max_steps 100",
        config=recipe,
        resume=True,
        print_config=True,
    )

    add_sweep_parser(verbs, common, recipe)
    add_launch_parsers(verbs, common, recipe)
    add_verb(
        verbs,
        common,
        "finetune",
        cmd_finetune,
        "instruction/chat fine-tuning (sft section; LoRA/QLoRA with the lora section)",
        overrides="the recipe, e.g. --lora.rank 8",
        config="YAML recipe with an sft section, or a name from configs/",
        resume=True,
        print_config=True,
    )

    add_forecast_parser(verbs, common)


def add_launch_parsers(verbs, common: argparse.ArgumentParser, recipe: str) -> None:
    """`launch` (torchrun) and `slurm` (an sbatch script)."""
    p = add_verb(
        verbs,
        common,
        "launch",
        cmd_launch,
        "print and run the torchrun command that trains CONFIG on several GPUs / nodes",
        overrides="the recipe on every rank",
        config=recipe,
        resume=True,
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node (usually its GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes; run the same command on each")
    p.add_argument(
        "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous every node reaches (several nodes)"
    )
    p.add_argument("--rdzv-id", help="job id shared by the nodes (default: hopperlm-RUN_DIR_NAME)")
    p.add_argument(
        "--max-restarts",
        type=int_at_least(0),
        default=0,
        help="restart the group after a failure, up to N times; it resumes from the latest checkpoint",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command only")

    p = add_verb(
        verbs,
        common,
        "slurm",
        cmd_slurm,
        "write an sbatch script (srun + torchrun) that checkpoints and requeues before its time limit",
        overrides="the recipe on every rank",
        config=recipe,
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes the job runs on (sbatch --nodes)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        required=True,
        help="GPUs per node, one rank each (sbatch --gpus-per-node)",
    )
    p.add_argument("--out", help="where to write the script (default RUN_DIR/job.sbatch)")
    p.add_argument("--time", default="24:00:00", help="time limit of one job (it requeues itself)")
    p.add_argument("--job-name", help="default hopperlm-CONFIG")
    p.add_argument(
        "--partition", help="SLURM partition to submit to (sbatch --partition; default: the cluster's)"
    )
    p.add_argument("--account", help="account the job is charged to (sbatch --account; default: yours)")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores per node for the training processes")
    p.add_argument(
        "--max-restarts",
        type=int_at_least(0),
        default=0,
        help="restart the group in place after a failure, up to N times (then the job fails)",
    )


def add_forecast_parser(verbs, common: argparse.ArgumentParser) -> None:
    p = add_verb(
        verbs,
        common,
        "forecast",
        cmd_forecast,
        "predict a run's final validation loss, with an interval, from its losses so far and its LR schedule",
    )
    p.add_argument("run", metavar="RUN_DIR", help="run directory (holding metrics.jsonl and config.yaml)")
    p.add_argument(
        "--using",
        type=number(float, low=0.0, high=1.0, low_open=True),
        metavar="FRACTION",
        help="forecast from the records of the first FRACTION of the budget only (a backtest); default all",
    )
    p.add_argument("--json", metavar="FILE", help="also write the forecast as JSON here")
    p.add_argument(
        "--proxies",
        metavar="SWEEP_DIR",
        help="forecast by scaling collapse: the run's curve fitted to the shape of the proxies that `sweep --widths` "
        "trained into SWEEP_DIR (same schedule, parametrization, data and tokens per parameter)",
    )
    p.add_argument(
        "--siblings",
        action="store_true",
        help="take the annealing prior from the finished runs in RUN_DIR's folder (a sweep) instead of the default",
    )
    p.add_argument(
        "--target", type=number(float), help="val loss to compare with (default train.target_loss)"
    )


def latest_checkpoint_clause(run_dir: Path, resume_command: list[str], fresh_command: list[str]) -> str:
    """The end of `launch`'s failure line: the latest checkpoint and the command that goes on from it."""
    from hopperlm.checkpoint.layout import list_checkpoints

    found = list_checkpoints(run_dir)
    if not found:
        return f"no checkpoint was written yet; start again with: {shlex.join(fresh_command)}"
    return f"latest checkpoint {found[-1].name}; resume with: {shlex.join(resume_command)}"
