"""Sweep runs started warm: forked from a process that has already imported torch and hopperlm's training code.

A `hopperlm train` process spends about 3 s of CPU importing torch and torch._dynamo (every torch optimizer
imports it when created) before its first step. A sweep of short proxy runs on a CPU pays that for every run,
often more than the run's own training. A warm starter is one process (`python -m hopperlm.train.warm_start`)
that imports all that once, then forks a child per run: the child is the run, as `python -m hopperlm ARGV` would
be (its own pid for signals, its own session, its output in files, its exit code, Popen's sign for a signal),
started in milliseconds.

Only where it is the same as a fresh process: on a machine where torch sees no CUDA device (a process forked from
one that has touched CUDA cannot use it, and a GPU sweep's runs are long enough not to notice 3 s), for runs whose
environment is the starter's own (torch reads variables such as OMP_NUM_THREADS when it is imported), from a
starter that runs no thread of its own when it forks. Anywhere else the caller starts a fresh process;
HOPPERLM_WARM_START=0 turns warm starts off.

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
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# what a `train` imports before its first step; torch._dynamo is the optimizer's, the costliest after torch itself
PRELOAD = ("torch", "torch._dynamo", "hopperlm.cli", "hopperlm.train.loop")
READY_TIMEOUT_S = (
    300.0  # the starter's imports (seconds; minutes on a loaded machine before we call it broken)
)
REAP_EVERY_S = (
    0.05  # how often the starter looks for children that exited (a run's end is seen this late at most)
)
OFF = "HOPPERLM_WARM_START"


# ---- the starter process -----------------------------------------------------------------------------------
def exit_code(exc: SystemExit) -> int:
    """The exit status Python gives a SystemExit (a message goes to stderr, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_child(request: dict, channels: tuple[int, ...]) -> None:
    """In the forked child: become `python -m hopperlm ARGV` in its own session, output into the request's files;
    never returns (os._exit after Python's exit functions, as an interpreter's exit runs them)."""
    code = 1
    try:
        os.setsid()  # a session of its own, as Popen(start_new_session=True) gives a fresh run
        for fd in channels:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        from hopperlm.cli import main

        sys.argv = [str(Path(main.__code__.co_filename).parent.parent / "__main__.py"), *request["argv"]]
        try:
            main(request["argv"])
            code = 0
        except SystemExit as exc:
            code = exit_code(exc)
        except BaseException:  # an uncaught error: its traceback and status 1, as the interpreter would
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream: nothing more can be said
                stream.flush()
        os._exit(code)


def serve() -> None:
    """The starter: import PRELOAD, say ready, then fork a child per request line on stdin and report each pid
    and each exit (status, CPU seconds) on stdout, until stdin closes (its children then go on alone)."""
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()  # (anything an import printed must not reach a child's output)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing a library prints can reach the replies
    if threading.active_count() != 1:  # a fork copies only the forking thread: locks others held stay held
        reply.write(
            json.dumps({"ready": False, "why": f"{threading.active_count()} threads after its imports"})
            + "\n"
        )
        return
    reply.write(json.dumps({"ready": True}) + "\n")
    children: set[int] = set()
    pending, stdin = b"", 0
    while True:
        readable, _, _ = select.select([stdin], [], [], REAP_EVERY_S)
        reap(children, reply)
        if not readable:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                run_child(request, (stdin, reply.fileno()))
            children.add(pid)
            reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")


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
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.kill(self.pid, sig)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its output once it has exited (the files are then removed); TimeoutExpired as Popen's."""
        self.wait(timeout)
        out = [
            p.read_text(errors="replace") if p.exists() else "" for p in (self.stdout_path, self.stderr_path)
        ]
        for p in (self.stdout_path, self.stderr_path):
            p.unlink(missing_ok=True)
        return out[0], out[1]

    def finish(self, code: int, cpu_s: float | None) -> None:
        self.returncode, self.cpu_s = code, cpu_s
        self.ended.set()


class WarmStarter:
    """The caller's handle on a starter process (module doc): `start` forks a run from it."""

    def __init__(self, env: dict[str, str], proc: subprocess.Popen, folder: Path) -> None:
        self.env, self.proc, self.folder = dict(env), proc, folder
        self.lock = threading.Lock()
        self.next_id = 0
        self.started: dict[int, list] = {}  # request id -> [Event, pid]
        self.runs: dict[int, WarmProcess] = {}  # pid -> its run
        self.exits: dict[
            int, tuple[int, float]
        ] = {}  # pid -> (code, cpu_s): an exit read before its pid's reply
        self.broken = False
        self.reader = threading.Thread(target=self._read, name="warm-start-replies", daemon=True)
        self.reader.start()

    @classmethod
    def launch(cls, env: dict[str, str]) -> tuple[WarmStarter | None, str]:
        """A ready starter with `env`, or None and why not."""
        folder = Path(tempfile.mkdtemp(prefix="hopperlm-warm-"))
        errors = (folder / "starter.err").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "hopperlm.train.warm_start"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errors, env=env, start_new_session=True)  # fmt: skip
        errors.close()
        ready = read_line(proc.stdout, READY_TIMEOUT_S)
        if not (ready or {}).get("ready"):
            why = (ready or {}).get("why") or tail(folder / "starter.err") or "it did not say ready"
            proc.kill()
            proc.wait()
            shutil.rmtree(folder, ignore_errors=True)
            return None, why
        return cls(env, proc, folder), ""

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> WarmProcess | None:
        """`hopperlm ARGV` forked from the starter, or None where it cannot be (another environment, or the
        starter is gone): the caller then starts a fresh process."""
        if self.broken or dict(env) != self.env:
            return None
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            out, err = self.folder / f"{rid}.out", self.folder / f"{rid}.err"
            waiter = self.started[rid] = [threading.Event(), None]
            line = {
                "id": rid,
                "argv": argv,
                "cwd": cwd or os.getcwd(),
                "stdout": str(out),
                "stderr": str(err),
            }
            try:
                self.proc.stdin.write((json.dumps(line) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                self.broken = True
                return None
        if not waiter[0].wait(READY_TIMEOUT_S) or waiter[1] is None:
            self.broken = True
            return None
        run = WarmProcess(self, waiter[1], argv, out, err)
        with self.lock:
            self.runs[run.pid] = run
            if run.pid in self.exits:  # it ended before we got here
                run.finish(*self.exits.pop(run.pid))
        return run

    def _read(self) -> None:
        """The starter's replies: the pid of each request, then each exit; at its end, the runs it leaves are
        watched by pid (their exit code is then unknown: 1)."""
        for raw in self.proc.stdout:
            reply = json.loads(raw)
            with self.lock:
                if "id" in reply:
                    waiter = self.started.pop(reply["id"])
                    waiter[1] = reply["pid"]
                    waiter[0].set()
                elif reply["pid"] in self.runs:
                    self.runs.pop(reply["pid"]).finish(reply["code"], reply["cpu_s"])
                else:
                    self.exits[reply["pid"]] = (reply["code"], reply["cpu_s"])
        with self.lock:
            self.broken = True
            for waiter in self.started.values():
                waiter[0].set()
            orphans = list(self.runs.values())
        for run in orphans:  # reparented when the starter died: alive until kill(pid, 0) fails
            while alive(run.pid):
                time.sleep(0.2)
            run.finish(1, None)

    def close(self) -> None:
        """Close the starter's stdin (it exits; a run still going goes on alone) and remove its folder."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has its pid now: ours is gone
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


def tail(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


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
    if not hasattr(os, "fork"):
        return "this system has no fork()"
    import torch

    if torch.cuda.is_available():
        return "a CUDA device is present (a process forked from one that touched CUDA cannot use it)"
    return None


if __name__ == "__main__":
    serve()
