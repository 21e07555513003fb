"""Run `hopperlm` in a subprocess that SIGKILLs itself at a chosen point, as an external `kill -9` would.

python kill_runner.py step N  -- hopperlm args...   die while drawing the batch of step N (mid-step)
python kill_runner.py save N  -- hopperlm args...   die at the N-th checksum of a checkpoint being written
python kill_runner.py ctrl-c N -- hopperlm args...     Ctrl-C (SIGINT to itself) while step N trains, after
                                                    its last micro-batch is drawn: the run stops after step N,
                                                    and writing its checkpoint first sleeps a minute, as a big
                                                    model's would take (a second Ctrl-C then surely lands in
                                                    it); a line on stdout says when the sleep begins
python kill_runner.py sigterm-mid-step N -- hopperlm args...  SIGTERM once micro-batch 1 of step N is drawn (the
                                                    step is then dropped at micro-batch 2)
python kill_runner.py none 0  -- hopperlm args...   no fault
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helper below
from signals_in_steps import signal_inside_step  # noqa: E402

from hopperlm.checkpoint import single as checkpoint  # writes the checksums of a checkpoint
from hopperlm.cli import main
from hopperlm.data.loader import RandomWindows

mode, when = sys.argv[1], int(sys.argv[2])
args = sys.argv[sys.argv.index("--") + 1 :]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if mode == "step":
    real_batch = RandomWindows.batch

    def batch(self, step, micro_step):
        if step == when:
            die()
        return real_batch(self, step, micro_step)

    RandomWindows.batch = batch
elif mode == "save":
    real_sha = checkpoint.file_sha256
    calls = [0]

    def sha(path):
        calls[0] += 1
        if calls[0] == when:
            die()
        return real_sha(path)

    checkpoint.file_sha256 = sha
elif mode == "ctrl-c":
    pressed = [False]
    signal_inside_step(when, signal.SIGINT, sent=lambda: pressed.__setitem__(0, True))
    real_sha = checkpoint.file_sha256

    def sha(path):
        if pressed[0]:
            pressed[0] = False
            print("kill_runner: the stop's checkpoint sleeps a minute", flush=True)  # (the test's cue)
            time.sleep(60)  # a signal's handler runs during the sleep (and may end the process)
        return real_sha(path)

    checkpoint.file_sha256 = sha
elif mode == "sigterm-mid-step":
    signal_inside_step(when, signal.SIGTERM, micro=1)

main(args)
