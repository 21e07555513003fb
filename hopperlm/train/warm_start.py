"""Sweep runs started warm: forked from a process that has already imported torch and hopperlm's training code.

A `hopperlm train` process spends about 3 s of CPU importing torch and torch._dynamo (every torch optimizer
imports it when created) before its first step. A sweep of short proxy runs on a CPU pays that for every run,
often more than the run's own training. A warm starter is one process (`python -m hopperlm.train.warm_start`)
that imports all that once, then forks a child per run: the child is the run, as `python -m hopperlm ARGV` would
be (its own pid for signals, its own session, its output in files, its exit code, Popen's sign for a signal),
started in milliseconds.

Only where it is the same as a fresh process: on Linux, on a machine where torch sees no CUDA device (a process
forked from one that has touched CUDA cannot use it, and a GPU sweep's runs are long enough not to notice 3 s),
for runs whose environment is the starter's own (torch reads variables such as OMP_NUM_THREADS when it is
imported), from a starter that runs no Python thread of its own when it forks. Anywhere else the caller starts
a fresh process; HOPPERLM_WARM_START=0 turns warm starts off.

    warm = starter_for(env, log)                       # None where it cannot (one line says why)
    proc = warm.start(["train", "recipe.yaml", ...], env) if warm else None    # None: start a fresh process
    stdout, stderr = proc.communicate(); proc.returncode
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

from hopperlm.errors import last_line

# what a `train` imports before its first step; torch._dynamo is the optimizer's, the costliest after torch itself
# (hopperlm.__main__ imported as a module is the CLI without running it)
PRELOAD = ("torch", "torch._dynamo", "hopperlm.__main__", "hopperlm.train.loop")
READY_TIMEOUT_S = 300.0  # the starter's imports: minutes on a loaded machine before we call it broken
FORK_TIMEOUT_S = 30.0  # a fork's reply comes in milliseconds; past this the starter is taken as gone
# how often the starter looks for children that exited, while it has any (a run's end is seen this late)
REAP_EVERY_S = 0.05
WATCH_EVERY_S = 0.2  # how often a run whose starter is gone is looked for
OFF = "HOPPERLM_WARM_START"


# ---- the starter process -----------------------------------------------------------------------------------
def become_run(request: dict, reply, preamble: bytes) -> None:
    """In the forked child: become `python -m hopperlm ARGV` in its own session, with its output in the
    request's files (beginning with what the starter's imports printed, as a fresh process prints it); never
    returns (run_and_exit)."""
    os.setsid()  # a session of its own, as Popen(start_new_session=True) gives a fresh run
    reply.close()
    redirect(os.devnull, 0, os.O_RDONLY)  # (over the starter's request pipe)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        redirect(path, fd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(2, preamble)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    sys.argv = ["hopperlm", *request["argv"]]  # runpy sets [0] to hopperlm/__main__.py, as `python -m` does
    # preloaded as a module: runpy runs it afresh, without its warning (the CLI it imports stays loaded)
    sys.modules.pop("hopperlm.__main__", None)
    run_and_exit(lambda: runpy.run_module("hopperlm", run_name="__main__", alter_sys=True))


def redirect(path: str, fd: int, flags: int) -> None:
    """File descriptor `fd` now reads or writes `path`."""
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def run_and_exit(run: Callable[[], None]) -> None:
    """`run`, then the exit a forked child makes (as multiprocessing's fork children do): its status as the
    interpreter would give it (SystemExit's code, a traceback and 1 for an error, death by SIGINT for an
    uncaught Ctrl-C), non-daemon threads joined, exit functions run, output flushed, then os._exit: a fresh
    interpreter's module teardown (about 0.9 s with torch loaded) has nothing left to write."""
    code, interrupted = 1, False
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
    try:
        threading._shutdown()  # (private, as multiprocessing calls it: joins the non-daemon threads)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream: nothing more can be said
                stream.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def serve(folder: Path | None = None) -> None:
    """The starter: import PRELOAD, say ready, then fork a child per request line on stdin and report each pid
    and each exit (status, CPU seconds) on stdout, signal a child on request, until stdin closes (its children
    then go on alone) and it removes `folder`, the caller's: closed, or ended without its own clean-up (a
    second Ctrl-C), the caller reads nothing there any more."""
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    redirect(os.devnull, 1, os.O_WRONLY)  # nothing a library prints can reach the replies
    preamble = import_output()
    # Python threads only: a fork copies just the forking thread, and a lock another one held stays held. (numpy's
    # OpenBLAS pool stops itself around a fork: pthread_atfork)
    if threading.active_count() != 1:
        reply.write(
            json.dumps({"ready": False, "why": f"{threading.active_count()} threads after its imports"})
            + "\n"
        )
        return
    reply.write(json.dumps({"ready": True}) + "\n")
    children: set[int] = set()
    pending, stdin = b"", 0
    while True:
        # (with no child to look for, it sleeps until the next request)
        readable, _, _ = select.select([stdin], [], [], REAP_EVERY_S if children else None)
        reap(children, reply)
        if not readable:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            if folder is not None:  # (a run still going writes on into its unlinked files)
                shutil.rmtree(folder, ignore_errors=True)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "signal" in request:  # only a child not yet reaped: its pid is still its own
                if request["pid"] in children:
                    os.kill(request["pid"], request["signal"])
                continue
            with warnings.catch_warnings():  # Python 3.12's note on OpenBLAS's threads (above)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                become_run(request, reply, preamble)
            children.add(pid)
            reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")


def import_output() -> bytes:
    """What the imports printed to stderr (the starter's stderr is a file the caller made, write-only here: read
    it again by its /proc name), for each child to begin with."""
    if not stat.S_ISREG(os.fstat(2).st_mode):
        return b""
    try:
        with open("/proc/self/fd/2", "rb") as f:
            return f.read()
    except OSError:
        return b""


def reap(children: set[int], reply) -> None:
    """Report every child that has exited: its pid, Popen's return code and its CPU seconds."""
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        cpu = round(usage.ru_utime + usage.ru_stime, 2)
        reply.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": cpu}) + "\n")


# ---- the caller's side ---------------------------------------------------------------------------------------
class WarmProcess:
    """A run forked by a WarmStarter, with the part of subprocess.Popen a sweep uses."""

    def __init__(self, starter: WarmStarter, pid: int, argv: list[str], stdout: Path, stderr: Path) -> None:
        self.starter, self.pid, self.args = starter, pid, argv
        self.stdout_path, self.stderr_path = stdout, stderr
        self.returncode: int | None = None
        self.cpu_s: float | None = None
        self.ended = threading.Event()

    def send_signal(self, sig: int) -> None:
        """Through the starter, which signals the pid only while it is still its unreaped child (a pid taken
        by another process after the run ended is never signalled); directly once the starter is gone."""
        if self.returncode is not None or self.pid <= 0:
            return
        if not self.starter.request({"signal": int(sig), "pid": self.pid}) and alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, as the starter reported it; where the starter is gone, the run is watched by pid and
        its status is then unknown (1)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.ended.wait(
            WATCH_EVERY_S if end is None else max(0.0, min(WATCH_EVERY_S, end - time.monotonic()))
        ):
            if self.starter.gone.is_set() and not alive(self.pid):
                self.finish(1, None)
            elif end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its output once it has exited (the files are then removed); TimeoutExpired as Popen's."""
        self.wait(timeout)
        paths = (self.stdout_path, self.stderr_path)
        out = [p.read_text(errors="replace") if p.exists() else "" for p in paths]
        for p in paths:
            p.unlink(missing_ok=True)
        return out[0], out[1]

    def finish(self, code: int, cpu_s: float | None) -> None:
        self.returncode, self.cpu_s = code, cpu_s
        self.ended.set()


class WarmStarter:
    """The caller's handle on a starter process (module doc): `start` forks a run from it."""

    def __init__(self, env: dict[str, str], proc: subprocess.Popen, folder: Path) -> None:
        self.env, self.proc, self.folder = dict(env), proc, folder
        self.lock = threading.Lock()  # the tables below and the request pipe
        self.next_id = 0
        self.started: dict[int, list] = {}  # request id -> [Event, pid]
        self.runs: dict[int, WarmProcess] = {}  # pid -> its run
        self.exits: dict[int, tuple[int, float]] = {}  # pid -> (code, cpu_s), read before its run was made
        self.gone = threading.Event()  # the starter's replies ended: it exited or was killed
        self.reader = threading.Thread(target=self._read, name="warm-start-replies", daemon=True)
        self.reader.start()

    @classmethod
    def launch(cls, env: dict[str, str]) -> tuple[WarmStarter | None, str]:
        """A ready starter with `env`, or None and why not."""
        folder = Path(tempfile.mkdtemp(prefix="hopperlm-warm-"))
        errors = (folder / "starter.err").open("w")
        # (the starter removes the folder at its end)
        argv = [sys.executable, "-m", "hopperlm.train.warm_start", str(folder)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, env=env,
                                start_new_session=True)  # fmt: skip
        errors.close()
        ready = read_line(proc.stdout, READY_TIMEOUT_S)
        if not (ready or {}).get("ready"):
            # (the starter removes the folder only once its requests end: our pipe to it is still open)
            printed = (folder / "starter.err").read_text(errors="replace")
            why = (ready or {}).get("why") or last_line(printed)[:300] or "it did not say ready"
            proc.kill()
            proc.wait()
            shutil.rmtree(folder, ignore_errors=True)
            return None, why
        return cls(env, proc, folder), ""

    def request(self, line: dict) -> bool:
        """Write one request line; False where the starter is gone (nothing was asked of it)."""
        with self.lock:
            if self.gone.is_set():
                return False
            try:
                self.proc.stdin.write((json.dumps(line) + "\n").encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):  # a broken or closed pipe
                return False
            return True

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> WarmProcess | None:
        """`hopperlm ARGV` forked from the starter, or None where nothing was started (another environment, or
        the starter is gone): the caller then starts a fresh process. A run asked for but never confirmed (the
        starter died between) is a failed run, not started again beside one that may be training."""
        if dict(env) != self.env:
            return None
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            waiter = self.started[rid] = [threading.Event(), None]
        out, err = self.folder / f"{rid}.out", self.folder / f"{rid}.err"
        line = {"id": rid, "argv": argv, "cwd": cwd or os.getcwd(), "stdout": str(out), "stderr": str(err)}
        if not self.request(line):
            with self.lock:
                self.started.pop(rid, None)
            return None
        waiter[0].wait(FORK_TIMEOUT_S)
        with self.lock:
            self.started.pop(rid, None)
            pid = waiter[1]
            run = WarmProcess(self, pid if pid is not None else -rid, argv, out, err)
            if pid is None:
                said = f"hopperlm {' '.join(argv[:2])}"
                err.write_text(f"warm start: the starter exited before it said whether `{said}` started; it is "
                               "counted as failed (run it again, or set HOPPERLM_WARM_START=0)\n")  # fmt: skip
                run.finish(1, None)
            else:
                self.runs[pid] = run
                if pid in self.exits:  # it ended before we got here
                    run.finish(*self.exits.pop(pid))
        return run

    def _read(self) -> None:
        """The starter's replies: the pid of each request, then each exit. At their end (the starter exited)
        every waiter is woken; runs still going are then watched by pid (WarmProcess.wait)."""
        try:
            for raw in self.proc.stdout:
                reply = json.loads(raw)
                with self.lock:
                    if "id" in reply:
                        waiter = self.started.get(reply["id"])
                        if waiter is not None:
                            waiter[1] = reply["pid"]
                            waiter[0].set()
                    elif reply["pid"] in self.runs:
                        self.runs.pop(reply["pid"]).finish(reply["code"], reply["cpu_s"])
                    else:
                        self.exits[reply["pid"]] = (reply["code"], reply["cpu_s"])
        except (OSError, ValueError, KeyError):  # a reply cut short: the starter is as good as gone
            pass
        finally:
            with self.lock:
                self.gone.set()
                for waiter in self.started.values():
                    waiter[0].set()

    def close(self) -> None:
        """Close the starter's stdin (it exits; a run still going goes on alone) and remove its folder."""
        with self.lock, contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def alive(pid: int) -> bool:
    """The process exists and has not exited: a zombie (exited, not yet reaped, e.g. by a parent that never
    reaps) counts as exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or someone else's process has its pid now
        return False
    return True


def read_line(stream, timeout: float) -> dict | None:
    """One JSON line from the pipe `stream` within `timeout` seconds, else None."""
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        return None
    line = stream.readline()
    try:
        return json.loads(line) if line else None
    except ValueError:
        return None


# ---- one starter per process ------------------------------------------------------------------------------------
_shared: dict[str, WarmStarter | None] = {}
_making = threading.Lock()  # a sweep's worker threads ask at once: one starter is made


def starter_for(env: dict[str, str], log: Callable[[str], None]) -> WarmStarter | None:
    """The process's starter for runs with `env` (made on first use, one line saying so), or None where runs
    must start fresh (one line saying why, once)."""
    key = json.dumps(sorted(env.items()))
    with _making:
        if key not in _shared:
            _shared[key] = make_starter(env, log)
        return _shared[key]


def make_starter(env: dict[str, str], log: Callable[[str], None]) -> WarmStarter | None:
    why = cold_reason()
    starter = None
    if why is None:
        t0 = time.monotonic()
        starter, why = WarmStarter.launch(env)
        if starter is not None:
            atexit.register(starter.close)
            log(f"warm starts: each run forks from one process that imported torch and the trainer once "
                f"({time.monotonic() - t0:.1f} s), not about 3 s of imports a run")  # fmt: skip
    if starter is None:
        log(f"warm starts: off, each run starts a fresh process: {why}")
    return starter


def cold_reason() -> str | None:
    """Why runs cannot be forked warm here, or None where they can."""
    if os.environ.get(OFF, "").strip() == "0":
        return f"{OFF}=0"
    if not sys.platform.startswith("linux"):
        return f"{sys.platform}: forking a process that imported torch is safe on Linux only"
    import torch

    if torch.cuda.is_available():
        return "a CUDA device is present (a process forked from one that touched CUDA cannot use it)"
    return None


if __name__ == "__main__":
    serve(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
