"""Measuring verbs: `diagnose` (hardware and plan), `bench`, `profile`, and `plot`/`report` of a run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hopperlm.cli.common import DEVICE_HELP, add_verb, log, printed_config, run_config
from hopperlm.errors import ConfigError

if TYPE_CHECKING:  # (the CLI imports torch only when a verb needs it)
    from hopperlm.config import ModelConfig, TrainConfig
    from hopperlm.hardware import Hardware
    from hopperlm.plan import Plan


def cmd_diagnose(args: argparse.Namespace, overrides: list[str]) -> None:
    """Hardware report, the plan for a config with its reasons, and a short self-test of the device."""
    import contextlib
    import dataclasses
    import json

    from hopperlm.hardware import detect, simulated

    if args.print_config:
        if not args.config:
            raise ConfigError(
                "--print-config needs a CONFIG to print; e.g. hopperlm diagnose debug --print-config"
            )
        printed_config(args, run_config(args.config, overrides))
        return
    hw = simulated(args.simulate) if args.simulate else detect()
    report: dict = {"hardware": hw.to_dict()}
    lines = ["== hardware" + (f" (simulated: {args.simulate})" if args.simulate else ""), *hw.summary()]
    if args.config:
        from hopperlm.checkpoint.disk import checkpoint_bytes, checkpoint_line, checkpoint_room
        from hopperlm.data.train_data import resolve_datasets
        from hopperlm.errors import DataError
        from hopperlm.model.completep import describe as describe_depth
        from hopperlm.model.mup import describe as describe_parametrization
        from hopperlm.plan import World
        from hopperlm.train.data_and_plan import plan_run, resolve_model_config

        cfg = run_config(args.config, overrides)
        model_cfg, vocab_note = cfg.model, ""
        vocab = None
        if cfg.data.path or cfg.data.mixture:
            with contextlib.suppress(DataError):  # not prepared yet: plan with a stand-in vocabulary
                vocab = resolve_datasets(cfg.data)[0].manifest["vocab_size"]  # data.path or data.mixture
        if vocab is not None:
            model_cfg = resolve_model_config(cfg.model, vocab)
        elif model_cfg.vocab_size is None:
            model_cfg = dataclasses.replace(model_cfg, vocab_size=32000)
            vocab_note = " (data not prepared: vocabulary taken as 32000)"
        world = World(args.world_size, args.gpus_per_node or args.world_size)
        # the plan `train` would make (train/data_and_plan.py); the GPU finder measures the run's own model
        plan = plan_run(
            cfg,
            model_cfg,
            hw,
            world=world,
            cache_dir=Path(cfg.run.out_dir),
            log=log,
            measure=not args.simulate and world.size == 1,
        )
        lines += [f"== plan for {args.config}{vocab_note}", *plan.lines()]
        # the parametrizations in effect, as the training banner prints them (model/mup.py, model/completep.py)
        lines += [describe_parametrization(model_cfg), describe_depth(model_cfg)]
        # the checkpoints' room in the run folder's filesystem: the training banner's line (DiskFull.preflight)
        room = checkpoint_room(
            cfg.checkpoint,
            cfg.train,
            checkpoint_bytes(model_cfg, plan.optimizer, cfg.lora),
            Path(cfg.run.out_dir),
            tokens_per_step=plan.tokens_per_step,
        )
        lines.append(checkpoint_line(room))
        lines += budget_lines(cfg.train, Path(cfg.run.out_dir), model_cfg, plan, hw)
        report["plan"] = {**dataclasses.asdict(plan), "memory_bytes": plan.memory.total(plan.micro_batch)}
        report["checkpoints"] = room
    if not args.simulate and not args.no_selftest:
        from hopperlm.selftest import format_selftest, run_selftest

        if not args.json:  # (the compile check alone takes ~25 s on a CPU: say so before it starts)
            log(
                "self-test: matmul, copy, attention kernels and a torch.compile check (~30 s on a CPU; "
                "--no-selftest skips it)"
            )
        results = run_selftest(hw.device, hw.peak_16bit)
        lines += ["== self-test", *format_selftest(results)]
        report["selftest"] = results
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for line in lines:
            log(line)


# the MFU hopperlm measured for h100-350m on an H200 (46.0-49.1%, bench/results/2026-11-22-h200): the speed
# diagnose assumes for a GPU it does not measure
ASSUMED_GPU_MFU = 0.45


def budget_lines(
    tc: TrainConfig, run_dir: Path, model_cfg: ModelConfig, plan: Plan, hw: Hardware
) -> list[str]:
    """For a wall-clock budget: the tokens it buys at the predicted speed (a GPU: the dense 16-bit peak at the
    MFU measured for h100-350m; a CPU: the matmul rate measured here, an upper bound) and per parameter, and
    where the run folder already has evaluations, the forecasts of its final validation loss."""
    from hopperlm.model.transformer import count_params, flops_per_token
    from hopperlm.train.banner import budget_line, predicted_tokens_per_s

    if not tc.max_hours:
        if not tc.forecast_from:
            return []
        return ["== budget", proxy_line(tc, model_cfg, plan, None), *run_forecast_lines(run_dir, tc)]
    fpt = flops_per_token(model_cfg, tc.seq_len)
    if hw.peak_16bit:
        tok_s = hw.peak_16bit * ASSUMED_GPU_MFU / fpt * plan.world_size
        speed = f"{ASSUMED_GPU_MFU:.0%} MFU, about what h100-350m measured on an H200"
    else:
        tok_s, speed = predicted_tokens_per_s(plan, fpt)[0], "the matmul-bound upper bound measured here"
    lines = [
        "== budget",
        budget_line(tc, params=count_params(model_cfg)["total"], tokens_per_s=tok_s, speed=speed),
    ]
    if tc.forecast_from:
        lines.append(proxy_line(tc, model_cfg, plan, tok_s))
    return lines + run_forecast_lines(run_dir, tc)


def run_forecast_lines(run_dir: Path, tc: TrainConfig) -> list[str]:
    """Where the run folder already has evaluations: the in-run law's forecast, and beside it, with
    train.forecast_from's proxy curves, the forecast by collapse (as the training banner prints them)."""
    from hopperlm.observe import collapse
    from hopperlm.observe.forecast import forecast_run

    if not (run_dir / "metrics.jsonl").is_file():
        return []
    target = tc.target_loss
    try:
        lines = [forecast_run(run_dir).line(target) + f" ({run_dir} so far)"]
    except ConfigError as e:  # too few evaluations yet: say so, the plan is still right
        return [f"forecast: none yet ({e})"]
    proxies = collapse.saved_curves(Path(tc.forecast_from)) if tc.forecast_from else []
    if not proxies:
        return lines
    try:
        run = collapse.curve_of_run(run_dir)
        why = collapse.check_proxies(run, proxies) or collapse.tokens_mismatch(run, proxies)
        if why is not None:
            return [*lines, f"forecast by collapse: none ({why}); the law's line above stands"]
        forecast = collapse.collapse_forecast(run, proxies, using=collapse.evaluated_share(run))
    except ConfigError as e:
        return [*lines, f"forecast by collapse: none yet ({e})"]
    return [*lines, forecast.line(target)]


def proxy_line(tc: TrainConfig, model_cfg: ModelConfig, plan: Plan, tokens_per_s: float | None) -> str:
    from hopperlm.model.transformer import count_params
    from hopperlm.train.banner import proxy_forecast_line

    return proxy_forecast_line(tc, params=count_params(model_cfg)["total"],
                               tokens_per_step=plan.tokens_per_step, tokens_per_s=tokens_per_s)  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> None:
    """Warm training steps of hopperlm beside eager PyTorch and HF transformers, one table, one JSON."""
    import dataclasses
    import json

    from hopperlm.bench import DEFAULT_PRESETS, format_table, run_bench
    from hopperlm.bench_rows import ROW_NAMES
    from hopperlm.config.presets import PRESETS
    from hopperlm.files import write_atomic
    from hopperlm.hardware import detect_for
    from hopperlm.provenance import provenance

    presets = args.presets.split(",") if args.presets else list(DEFAULT_PRESETS)
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ConfigError(
            f"unknown preset(s) {', '.join(unknown)} in --presets; choose from {', '.join(PRESETS)}"
        )
    if args.loss_steps and not args.data:
        raise ConfigError("--loss-steps needs --data DIR (a `hopperlm prepare` output) to train on real text")
    only = args.rows.split(",") if args.rows else None
    variant_rows = [f"hopperlm {v.partition(':')[0]}" for v in args.variant or []]
    unknown = [r for r in only or [] if r not in ROW_NAMES and r not in variant_rows]
    if unknown:
        raise ConfigError(
            f"unknown row(s) {', '.join(unknown)} in --rows; choose from {', '.join(ROW_NAMES + tuple(variant_rows))}"
        )
    if args.windows < 1 or args.steps < 1:
        raise ConfigError(f"--windows {args.windows} --steps {args.steps}: both must be at least 1")
    hw = detect_for(args.device)
    for line in hw.summary():
        log(line)
    if args.windows < 5 and not args.quick:
        log(f"warning: --windows {args.windows}: a row is a claim only as the median of >= 5 windows")
    out = Path(args.out) if args.out else None
    command = "hopperlm " + " ".join(sys.argv[1:])

    def save(rows) -> None:  # after every row: a time-out or a kill loses only the row in flight
        record = {
            **provenance(command),
            "device": hw.name,
            "quick": args.quick,  # a smoke run at toy sizes: never a measurement
            "rows_asked": only,  # --rows (None: every row the device supports)
            "peak_16bit_tflops": hw.peak_16bit / 1e12 if hw.peak_16bit else None,
            "rows": [dataclasses.asdict(r) for r in rows],
            "table": format_table(rows, hw),
        }
        write_atomic(out, json.dumps(record, indent=1))

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
        hf_compile=not args.no_hf_compile,
        loss_steps=args.loss_steps,
        data_dir=Path(args.data) if args.data else None,
        variants=args.variant or [],
        only=only,
        on_row=save if out else None,
        log=log,
    )
    if out:
        save(rows)  # also when no row ran (an empty --rows selection for a preset)
        log(f"results: {out} (rewritten after every row)")
    log("")
    for line in format_table(rows, hw):
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
    from hopperlm.train.profile import profile_config

    cfg = run_config(args.config, overrides)
    result = profile_config(cfg, args.steps, args.wait, args.warmup, args.out, args.memory_snapshot, log=log)
    kind = "GPU kernels, device time" if result.device == "cuda" else "CPU ops, self time"
    log(f"\n--- where the time goes ({kind}) ---")
    for line in result.table:
        log(line)
    log(f"time: {result.summary}")
    log(f"trace: {result.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    log(f"table: {result.out_dir / 'kernels.txt'}, {result.out_dir / 'profile.json'}")


def add_parsers(verbs, common: argparse.ArgumentParser) -> None:
    p = add_verb(
        verbs,
        common,
        "diagnose",
        cmd_diagnose,
        "hardware report, the plan for a config with reasons, and a device self-test (~30 s on a CPU)",
        overrides="CONFIG",
        print_config=True,
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

    p = add_verb(
        verbs,
        common,
        "bench",
        cmd_bench,
        "tokens/s, MFU and memory of training steps beside eager PyTorch and HF transformers",
    )
    p.add_argument("--presets", help="comma-separated presets (default gpt2-124m,h100-350m,tinyllama-1.1b)")
    p.add_argument(
        "--quick", action="store_true", help="two blocks of each preset, short sequences (CPU smoke)"
    )
    p.add_argument("--micro-batch", type=int, help="sequences per step for every row (default per preset)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default per preset)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per timed window")
    p.add_argument(
        "--windows",
        type=int,
        default=5,
        help="timed windows (at least 5 for a claim); the median counts, the min and max are kept",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers baselines")
    p.add_argument(
        "--no-hf-compile",
        action="store_true",
        help="skip only the HF + torch.compile baseline (its compile takes minutes on a 1B model)",
    )
    p.add_argument("--loss-steps", type=int, default=0, help="train hopperlm rows this many steps on --data")
    p.add_argument("--data", help="prepared data dir for --loss-steps")
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME:KEY=VALUE,...",
        help="an extra hopperlm row with train.* overrides, optim.* overrides, grad_accum or documents, e.g. "
        "mb32:micro_batch=32 or cudnn:attention=cudnn (repeatable)",
    )
    p.add_argument(
        "--rows",
        help="comma-separated rows to run, of eager, hopperlm, 'hopperlm muon', 'hopperlm fp8', hf, hf+compile and the "
        "--variant names as 'hopperlm NAME' (default: all that the device supports)",
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--out", help="write the results as JSON here, after every row (e.g. bench/results/DATE-GPU.json)"
    )

    p = add_verb(
        verbs,
        common,
        "profile",
        cmd_profile,
        "profile training steps: trace, top-kernels table, where the time goes",
        description="Runs the real training loop of CONFIG under torch.profiler in RUN_DIR/profile "
        "(no checkpoints).",
        overrides="CONFIG",
        config="YAML recipe, or a name from configs/",
    )
    p.add_argument("--steps", type=int, default=5, help="steps recorded (default 5)")
    p.add_argument("--wait", type=int, default=1, help="steps run before the profiler starts (compilation)")
    p.add_argument("--warmup", type=int, default=2, help="steps profiled but discarded (profiler warm-up)")
    p.add_argument("--out", help="output folder (default RUN_DIR/profile)")
    p.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="record every CUDA allocation and write memory_snapshot.pickle (GPU only)",
    )

    p = add_verb(verbs, common, "plot", cmd_plot, "PNG plots of one run, or several overlaid")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", help="folder for the PNGs (default: FIRST_RUN_DIR/plots)")

    p = add_verb(verbs, common, "report", cmd_report, "write RUN_DIR/report.md and report.html")
    p.add_argument("run", metavar="RUN_DIR", help="run directory (holding metrics.jsonl and config.yaml)")
