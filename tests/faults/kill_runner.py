"""Run `hopperlm` in a subprocess that SIGKILLs itself at a chosen point, as an external `kill -9` would.

python kill_runner.py step N  -- hopperlm args...   die while drawing the batch of step N (mid-step)
python kill_runner.py save N  -- hopperlm args...   die at the N-th checksum of a checkpoint being written
python kill_runner.py stall-eval N -- hopperlm args...  the N-th validation first sleeps a minute, as a big
                                                    model's would (a second Ctrl-C then surely lands in it)
python kill_runner.py none 0  -- hopperlm args...   no fault
"""

import os
import signal
import sys
import time

from hopperlm.checkpoint import single as checkpoint  # writes the checksums of a checkpoint
from hopperlm.cli import main
from hopperlm.data.loader import RandomWindows
from hopperlm.train import loop

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
elif mode == "stall-eval":
    real_evaluate = loop.evaluate
    evaluations = [0]

    def evaluate(*a, **kw):
        evaluations[0] += 1
        if evaluations[0] == when:
            time.sleep(60)  # a signal's handler runs during the sleep (and may end the process)
        return real_evaluate(*a, **kw)

    loop.evaluate = evaluate

main(args)
