"""The distributed runtime: one process per GPU (or per CPU rank) started by torchrun, and what the loop needs
to know about the others.

`session(...)` reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), starts the process group (NCCL on GPUs, gloo on CPU) with `parallel.startup_timeout_s` as the
limit for any collective (the shorter step limit follows at the first log step: parallel/watchdog.py), pins
each rank to the GPU of its local rank, and tears the group down at the end. Without torchrun there is one
process and no group (unless a strategy is asked for explicitly: then a group of one), and every helper below
is a no-op, so a single-process run is exactly what it was.

No hung ranks: a rank that raises publishes its error in the rendezvous store before it exits. The other
ranks' collectives then fail (gloo at once, NCCL at the limit at the latest, or torchrun stops them), and
each of them reports that first error rather than its own "connection closed" and exits non-zero. Under
`hopperlm launch` the ranks print nothing of it: the launcher says it in one line (parallel/supervise.py).

Rank 0 logs and writes the run's files; `Runtime.log` drops the other ranks' lines. One writer per run folder:
rank 0 holds the folder's lock (folder_lock.py) for the session's life, taken before anything is written there
(the heartbeats are the first), and every rank stops with its one line when another process holds it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hopperlm.errors import CheckpointError, ConfigError, FolderBusy, HopperError, first_line
from hopperlm.folder_lock import hold_folder
from hopperlm.parallel.watchdog import Watchdog, restart_count, supervised
from hopperlm.plan import Plan, World
from hopperlm.plan.attention_probe import AttentionProbe, AttentionShape, AttentionTiming

if TYPE_CHECKING:
    from hopperlm.config import ParallelConfig

FIRST_ERROR_KEY = "hopperlm/first_error"
STRATEGIES_NEEDING_A_GROUP = ("ddp", "fsdp", "hsdp")


class PeerFailed(HopperError):
    """Another rank failed first; this rank stops too (the message names that rank and its error)."""


def unwritable_run_dir(run_dir: Path, error: OSError) -> CheckpointError:
    """The one line for a run folder that cannot be made or written (a read-only disk, a file in the way)."""
    return CheckpointError(
        f"run dir {run_dir} is not writable ({error.strerror}); choose another --run.out_dir"
    )


def read_env(environ: dict[str, str] | None = None) -> tuple[int, int, World, bool]:
    """(rank, local rank, world, launched by torchrun) from the environment torchrun sets."""
    env = os.environ if environ is None else environ
    launched = "WORLD_SIZE" in env and "RANK" in env
    if not launched:
        return 0, 0, World(), False
    try:
        size = int(env["WORLD_SIZE"])
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
    except ValueError as e:
        raise ConfigError(
            f"torchrun's environment is malformed ({e}); launch with `hopperlm launch`"
        ) from None
    return rank, local_rank, World(size, local_size), True


def device_type(preference: str, world: World) -> str:
    """'cuda' or 'cpu' for train.device; each rank then takes the GPU of its local rank."""
    if preference.startswith("cuda:") and world.size > 1:
        raise ConfigError(
            f"train.device={preference} with {world.size} ranks would put every rank on one GPU; "
            "use --train.device cuda (or auto): rank r takes cuda:LOCAL_RANK"
        )
    if preference == "cpu":
        return "cpu"
    return "cuda" if preference.startswith("cuda") or torch.cuda.is_available() else "cpu"


class Clock:
    """Seconds of training across resumes. With several ranks, every rank must use the same value (the LR
    schedule and train.max_hours depend on it), so it reads rank 0's clock as agreed at the last log step."""

    def __init__(self, before: float, shared: bool) -> None:
        self.before, self.shared, self.t0 = before, shared, time.perf_counter()
        self.agreed = before

    def local(self) -> float:
        return self.before + time.perf_counter() - self.t0

    def __call__(self) -> float:
        return self.agreed if self.shared else self.local()


class Runtime:
    """This process's place in the run. A default Runtime() is the single process."""

    def __init__(
        self,
        rank: int = 0,
        local_rank: int = 0,
        world: World | None = None,
        log: Callable[[str], None] = print,
        launched: bool = False,
    ) -> None:
        self.rank, self.local_rank, self.launched = rank, local_rank, launched
        self.world = world or World()
        self._log = log
        self.active = False  # a process group is up
        self.backend: str | None = None
        self.clock = Clock(0.0, shared=False)
        self.watchdog: Watchdog | None = None  # several ranks: the collective limits and the heartbeat
        self._held: set[Path] = set()  # the run folders this session holds (hold_run_dir)

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, line: str) -> None:
        """Rank 0 speaks for the run; the other ranks stay quiet (their errors still reach stderr)."""
        if self.is_main:
            self._log(line)

    # ---- the process group -----------------------------------------------------------------------------
    def start(self, device: str, timeout_s: float) -> None:
        import torch.distributed as dist

        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("train.device asks for CUDA but torch sees no GPU; use --train.device cpu")
            if self.local_rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"rank {self.rank} has LOCAL_RANK {self.local_rank} but only {torch.cuda.device_count()} "
                    "GPU(s) are visible; --nproc-per-node must not exceed the GPUs of a node"
                )
            torch.cuda.set_device(self.local_rank)
            self.backend = "nccl"
            kwargs["device_id"] = torch.device("cuda", self.local_rank)
        else:
            self.backend = "gloo"
        if not self.launched:  # an explicit strategy without torchrun: a group of one process
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        else:
            # torchrun's store outlives a restarted group (--max-restarts): keys of the attempt before (gloo's
            # addresses, the first error) would be read as this one's, so each attempt gets its own prefix
            from torch.distributed.rendezvous import rendezvous

            store, rank, size = next(rendezvous("env://", timeout=kwargs["timeout"]))
            prefix = f"hopperlm/attempt-{restart_count()}"
            kwargs.update(store=dist.PrefixStore(prefix, store), rank=rank, world_size=size)
        dist.init_process_group(self.backend, **kwargs)
        self.active = True

    def close(self) -> None:
        """Wait for every rank (so none tears down while another still talks to it), then end the group."""
        if not self.active:
            return
        import torch.distributed as dist

        self.barrier()
        dist.destroy_process_group()
        self.active = False

    def fail(self, exc: BaseException) -> BaseException | None:
        """Publish this rank's error unless another rank's came first; return the error this rank should
        raise instead of its own (PeerFailed naming the first one), or None to raise its own."""
        mine = f"rank {self.rank}: {first_line(exc)}"
        first = mine
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            first = _get_default_store().compare_set(FIRST_ERROR_KEY, "", mine).decode()
        except Exception:  # the store is gone or the group never started: report our own
            pass
        if first == mine:
            self.record_for_launcher(exc)
            return None
        here = mine if len(mine) <= 160 else mine[:157] + "..."
        if not supervised():  # (under `hopperlm launch` the launcher says it, once)
            print(f"[rank {self.rank}] stopping: {first} (here: {here})", file=sys.stderr, flush=True)
        replacement = PeerFailed(f"{first}; rank {self.rank} stopped too")
        self.record_for_launcher(replacement)
        return replacement

    @staticmethod
    def record_for_launcher(exc: BaseException) -> None:
        """torchrun's (and `hopperlm launch`'s) failure summary shows the real error (not 'To enable traceback
        see ...'). The first record of a process stands: a later one (the CLI's, after the runtime's) is
        dropped."""
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path or not isinstance(exc, Exception) or os.path.isfile(path):
            return
        try:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(exc)
        except Exception:
            pass

    @contextmanager
    def hold_run_dir(self, run_dir: Path) -> Iterator[None]:
        """One writer per run folder: rank 0 holds its lock while the block runs and the other ranks take its
        word (one broadcast), so when another process holds it every rank raises the same FolderBusy line.
        Re-entrant for a folder this session already holds."""
        run_dir, key = Path(run_dir), Path(run_dir).resolve()
        if key in self._held:
            yield
            return
        with ExitStack() as held:
            refusal: HopperError | None = None
            if self.is_main:
                try:
                    held.enter_context(hold_folder(run_dir, what="--run.out_dir", log=self.log))
                except FolderBusy as e:
                    refusal = e
                except OSError as e:
                    refusal = unwritable_run_dir(run_dir, e)
            refusal = self.broadcast_object(refusal)
            if refusal is not None:
                raise refusal
            self._held.add(key)
            try:
                yield
            finally:
                self._held.discard(key)

    # ---- collectives (no-ops without a group) ---------------------------------------------------------
    @property
    def collective_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier(device_ids=[self.local_rank] if self.backend == "nccl" else None)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, and returned; ops: sum, max, min."""
        if self.active and self.world_size > 1:
            import torch.distributed as dist

            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op])
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not (self.active and self.world_size > 1):
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not (self.active and self.world_size > 1):
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # ---- what the loop asks ------------------------------------------------------------------------------
    def beat(self, step: int) -> None:
        """A step finished (the heartbeat the launcher watches carries it)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def measured(self, step_time_s: float) -> None:
        """A log step's mean step time: sets the collective limit for steps (parallel/watchdog.py)."""
        if self.watchdog is not None:
            self.watchdog.measured(step_time_s)

    @contextmanager
    def long_phase(self, name: str) -> Iterator[None]:
        """Evaluation, checkpoint saves, the run's end: collectives get the start-up limit meanwhile."""
        if self.watchdog is None:
            yield
            return
        with self.watchdog.long_phase(name):
            yield

    def start_clock(self, before: float) -> Clock:
        self.clock = Clock(before, shared=self.world_size > 1)
        return self.clock

    def agree(self, requested_signal: str | None, log_step: bool) -> str | None:
        """The stop signal every rank acts on. One process: the one it received. Several: only on log steps,
        where one all-reduce tells every rank whether any rank received a signal and sets the shared clock
        to rank 0's, so all ranks stop after the same step and see the same time (no host sync elsewhere)."""
        if self.world_size == 1:
            return requested_signal
        if not log_step:
            return None
        code = signal.Signals[requested_signal].value if requested_signal else 0
        elapsed = self.clock.local() if self.is_main else 0.0
        packed = torch.tensor([elapsed, float(code)], dtype=torch.float64, device=self.collective_device)
        elapsed, code = self.all_reduce(packed, "max").tolist()
        self.clock.agreed = elapsed
        return signal.Signals(int(code)).name if code else None

    def log_step_losses(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
        """(mean loss of every rank, finite everywhere) for each step since the last log: the global numbers,
        in one all-reduce, on log steps only."""
        losses = torch.stack([p[0] for p in pending])
        finite = torch.stack([p[1] for p in pending])
        if self.world_size == 1:
            return losses.tolist(), finite.tolist()
        n = len(pending)
        packed = self.all_reduce(torch.cat([losses.float(), (~finite).float()]))
        return (packed[:n] / self.world_size).tolist(), (packed[n:] == 0).tolist()

    def agreed_finder(self, finder):
        """The GPU micro-batch finder, measured on every rank; the smallest answer holds for all. The finder
        runs no collective itself (its trials are single-process, train/batch_finder.py `trial_plan`), so
        ranks that run out of memory at different sizes stay in step and meet here once."""
        if finder is None or self.world_size == 1:
            return finder

        def agreed(model_cfg, plan: Plan, cap: int) -> tuple[int, str]:
            micro, reason = finder(model_cfg, plan, cap)
            least = int(self.all_reduce(torch.tensor([micro], device=self.collective_device), "min").item())
            return least, f"{reason}; the smallest over {self.world_size} ranks"

        return agreed

    def agreed_attention_probe(self, probe: AttentionProbe | None) -> AttentionProbe | None:
        """The attention probe, timed on every rank; the case least kind to cuDNN over all ranks decides
        (AttentionTiming.worst_over_ranks), so every rank forces the same kernel. Every rank makes the same plan up
        to it and a probe that raises counts as a failed one, so all ranks meet in the all-reduce."""
        if probe is None or self.world_size == 1:
            return probe

        def agreed(shape: AttentionShape, device: torch.device) -> AttentionTiming:
            try:  # whatever happens on this rank, it must reach the all-reduce the others wait in
                timing = probe(shape, device)
            except Exception as e:
                timing = AttentionTiming(error=first_line(e))
            return timing.worst_over_ranks(
                lambda t: self.all_reduce(t.to(self.collective_device), "max").cpu()
            )

        return agreed

    def seed_per_rank(self, seed: int) -> None:
        """Different dropout masks on different ranks (after the model, initialised alike everywhere)."""
        if self.world_size > 1:
            torch.manual_seed(int(np.random.SeedSequence([seed, self.rank]).generate_state(1)[0]))


_current: Runtime | None = None


def current() -> Runtime:
    """The running session's Runtime, or the single process."""
    return _current or Runtime()


@contextmanager
def session(
    pc: ParallelConfig, *, device: str, run_dir: str | Path, log: Callable[[str], None] = print
) -> Iterator[Runtime]:
    """The process group for one run, holding its run folder (hold_run_dir) for the run's life (re-entrant: an
    inner session reuses the outer one, and holds its own run folder too). `pc`: the strategy and the two
    limits; `device`: train.device; `run_dir`: the folder it locks and writes heartbeats into."""
    global _current
    run_dir = Path(run_dir)
    if _current is not None:
        with _current.hold_run_dir(run_dir):
            yield _current
        return
    rank, local_rank, world, launched = read_env()
    rt = Runtime(rank, local_rank, world, log, launched)
    if world.size > 1 or pc.strategy in STRATEGIES_NEEDING_A_GROUP:
        rt.start(device_type(device, world), pc.startup_timeout_s)
    with ExitStack() as held:
        try:  # before the heartbeats: nothing is written into the run folder before its lock is held
            held.enter_context(rt.hold_run_dir(run_dir))
        except HopperError:  # every rank has rank 0's line: all stop alike, none reports another's failure
            rt.close()
            raise
        if rt.active and world.size > 1:
            rt.watchdog = Watchdog(rank, run_dir, pc.startup_timeout_s, pc.step_timeout_s, rt.log)
            rt.watchdog.start()
        _current = rt
        try:
            yield rt
            with rt.long_phase("closing"):
                rt.close()
            if rt.watchdog is not None:
                rt.watchdog.close("done")
        except BaseException as e:
            if rt.watchdog is not None:
                rt.watchdog.close("failed")
            replacement = rt.fail(e) if rt.active else None
            if replacement is not None:
                raise replacement from e
            raise
        finally:
            _current = None
