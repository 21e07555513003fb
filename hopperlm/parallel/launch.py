"""The exact torchrun command for a run (`hopperlm launch`) and an sbatch script for SLURM (`hopperlm slurm`).

One node:      torchrun --standalone --nproc-per-node N -m hopperlm train CONFIG ... (`finetune` for sft.path)
Several nodes: the same command on every node, with c10d rendezvous at one host:port they all reach
               (torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID)
SLURM: one srun task per node runs torchrun with the first node of the allocation as the rendezvous host.
The job asks for the warning signal USR1 two minutes before its time limit (`--signal=B:USR1@120`, to the batch
shell), which forwards it to every process of the job step; each training rank checkpoints at its next log
step and exits, and the script requeues the job (`--requeue`), which resumes from that checkpoint
(`--resume auto`). torchrun's agent ignores USR1 and TERM there, so that each rank receives the signal once,
from SLURM: a second one would mean "exit now" (parallel/preemption.py).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from hopperlm import __version__
from hopperlm.errors import ConfigError

RDZV_PORT = 29500
WARNING_SECONDS = 120
# Signals torchrun's agent handles (and forwards) under SLURM: not TERM and USR1, which SLURM sends to every
# process of the step itself (torch >= 2.9 reads this variable).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def torchrun_args(
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "hopperlm",
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's own options (everything before the training module)."""
    if nproc_per_node < 1 or nnodes < 1:
        raise ConfigError(f"--nproc-per-node {nproc_per_node} and --nnodes {nnodes} must be at least 1")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts} must be 0 or more (0: a failure ends the job)")
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    if nnodes == 1 and rdzv_endpoint is None:
        return ["--standalone", f"--nproc-per-node={nproc_per_node}", *restarts]
    if rdzv_endpoint is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, a host every node reaches (e.g. the first "
            f"node, port {RDZV_PORT}); run the same command on each node"
        )
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint!r} must be HOST:PORT, e.g. node001:{RDZV_PORT}")
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        *restarts,
    ]


def train_args(config: str, resume: bool | str, overrides: list[str], verb: str = "train") -> list[str]:
    """`-m hopperlm train CONFIG [--resume [PATH|auto]] overrides...` (what every rank runs; `finetune` for
    a recipe with instruction data)."""
    args = ["-m", "hopperlm", verb, config]
    if resume is True:
        args.append("--resume")
    elif resume:
        args += ["--resume", str(resume)]
    return args + list(overrides)


def launch_command(
    config: str,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "hopperlm",
    resume: bool | str = False,
    overrides: list[str] | None = None,
    python: str | None = None,
    verb: str = "train",
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command `hopperlm launch` stands for (it runs torchrun's agent in its own process, with
    these same options: parallel/supervise.py); `python -m torch.distributed.run` is torchrun, without
    depending on which `torchrun` is first on PATH."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(nproc_per_node, nnodes, rdzv_endpoint, rdzv_id, max_restarts),
        *train_args(config, resume, overrides or [], verb),
    ]


def sbatch_script(
    config: str,
    nodes: int,
    gpus_per_node: int,
    run_dir: str,
    overrides: list[str] | None = None,
    *,
    time_limit: str = "24:00:00",
    job_name: str | None = None,
    partition: str | None = None,
    script_path: str | None = None,
    account: str | None = None,
    cpus_per_task: int | None = None,
    python: str = "python3",
    port: int = RDZV_PORT,
    max_restarts: int = 0,
) -> str:
    """An sbatch script: `nodes` x `gpus_per_node` ranks, checkpoint + requeue at the time-limit warning."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be at least 1")
    options = _sbatch_options(
        job_name or f"hopperlm-{Path(config).stem}",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        time_limit=time_limit,
        run_dir=run_dir,
        cpus_per_task=cpus_per_task,
        partition=partition,
        account=account,
    )
    config_path = str(Path(config).resolve()) if Path(config).is_file() else config
    inner = _launch_on_each_node(
        config_path,
        gpus_per_node=gpus_per_node,
        python=python,
        port=port,
        max_restarts=max_restarts,
        overrides=overrides or [],
    )
    threads = max(1, (cpus_per_task or 8 * gpus_per_node) // gpus_per_node)
    lines = [
        "#!/bin/bash",
        f"# Written by `hopperlm slurm` (hopperlm {__version__}). Submit with: sbatch {script_path or 'THIS_FILE'}",
        f"# {nodes} node(s) x {gpus_per_node} GPU(s) = {nodes * gpus_per_node} ranks of `hopperlm launch {config}`"
        + (f", restarted up to {max_restarts} time(s) after a failure." if max_restarts else "."),
        f"# {WARNING_SECONDS} s before the time limit SLURM sends USR1 to this script, which forwards it to every",
        "# training rank: they checkpoint at their next log step and exit, and this script requeues the job,",
        "# which resumes from that checkpoint. The run dir must be on a filesystem every node sees.",
        *(f"#SBATCH {o}" for o in options),
        "",
        "set -uo pipefail",
        f"mkdir -p {shlex.quote(run_dir)}",
        "",
        *_environment(threads),
        "",
        *_run_and_requeue(inner),
        "",
    ]
    return "\n".join(lines)


def _sbatch_options(
    name: str,
    *,
    nodes: int,
    gpus_per_node: int,
    time_limit: str,
    run_dir: str,
    cpus_per_task: int | None,
    partition: str | None,
    account: str | None,
) -> list[str]:
    """The script's `#SBATCH` options: one task per node, the warning signal, requeue, one appended log."""
    options = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
        f"--gpus-per-node={gpus_per_node}",
        f"--time={time_limit}",
        f"--signal=B:USR1@{WARNING_SECONDS}",
        "--requeue",
        "--open-mode=append",  # a requeued job appends to the same log
        f"--output={run_dir}/slurm-%j.out",
    ]
    if cpus_per_task:
        options.append(f"--cpus-per-task={cpus_per_task}")
    if partition:
        options.append(f"--partition={partition}")
    if account:
        options.append(f"--account={account}")
    return options


def _launch_on_each_node(
    config_path: str, *, gpus_per_node: int, python: str, port: int, max_restarts: int, overrides: list[str]
) -> str:
    """The `hopperlm launch` command each node's srun task runs, quoted for the inner `bash -c "..."`."""
    # `hopperlm launch` on each node: torchrun's agent under the supervisor (a frozen rank ends or restarts the
    # job within its limit; a failure is one line in the log), restarting up to max_restarts times in place
    launch = [
        python,
        "-m",
        "hopperlm",
        "launch",
        config_path,
        "--nnodes",
        "$SLURM_NNODES",
        "--nproc-per-node",
        str(gpus_per_node),
        "--rdzv-endpoint",
        f"$head_node:{port}",
        "--rdzv-id",
        "$SLURM_JOB_ID",
        *(["--max-restarts", str(max_restarts)] if max_restarts else []),
        "--resume",
        "auto",
        *overrides,
    ]
    # quoted for the inner `bash -c "..."`; $VARIABLES are expanded by this script's shell
    inner = " ".join(a if "$" in a else shlex.quote(a) for a in launch)
    return inner.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")


def _environment(omp_threads: int) -> list[str]:
    """The script's environment: NCCL's logging and error handling, threads per rank, and the signals
    torchrun's agent handles."""
    return [
        "# NCCL: warnings only; a collective that times out aborts its process (no hung job).",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}",
        "# Site-specific: the network interface and InfiniBand adapters between nodes, e.g.",
        "# export NCCL_SOCKET_IFNAME=ib0",
        "# export NCCL_IB_HCA=mlx5",
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{omp_threads}}}",
        "export PYTHONUNBUFFERED=1",
        f"export TORCHELASTIC_SIGNALS_TO_HANDLE={AGENT_SIGNALS}",
    ]


def _run_and_requeue(inner: str) -> list[str]:
    """The script's body: srun starts `inner` on every node; at the time-limit warning every rank is signalled
    to checkpoint, and the job is requeued once srun has ended."""
    return [
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "requeue=0",
        "on_warning() {",
        '  echo "hopperlm: time limit in '
        + str(WARNING_SECONDS)
        + ' s: every rank checkpoints, then the job is requeued"',
        "  requeue=1",
        '  scancel --signal=USR1 "$SLURM_JOB_ID"  # every process of the job step, not this shell',
        "}",
        "trap on_warning USR1",
        "",
        "# the launcher (torchrun's agent) ignores USR1 and TERM: SLURM signals the ranks directly; they install their own handler",
        f"srun --kill-on-bad-exit=1 bash -c \"trap '' USR1 TERM; exec {inner}\" &",
        "srun_pid=$!",
        "while true; do",
        '  wait "$srun_pid"; rc=$?',
        '  kill -0 "$srun_pid" 2>/dev/null || break  # srun ended (a trapped signal only interrupts `wait`)',
        "done",
        'if [ "$requeue" = 1 ]; then',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
    ]
