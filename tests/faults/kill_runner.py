"""Run `hopperlm` in a subprocess that SIGKILLs itself at a chosen point, as an external `kill -9` would.

python kill_runner.py step N  -- hopperlm args...   die while drawing the batch of step N (mid-step)
python kill_runner.py save N  -- hopperlm args...   die at the N-th checksum of a checkpoint being written
python kill_runner.py ctrl-c N -- hopperlm args...     Ctrl-C (SIGINT to itself) while step N trains, after
                                                    its last micro-batch is drawn: the run stops after step N,
                                                    and writing its checkpoint first sleeps a minute, as a big
                                                    model's would take (a second Ctrl-C then surely lands in
                                                    it); a line on stdout says when the sleep begins
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
elif mode == "ctrl-c":
    # The Ctrl-C is sent from inside step N, never between steps: one there (or in a save) would drop the next
    # step at its first micro-batch and stop at the step before, whose checkpoint may already be written (a
    # test's external signal raced exactly that in CI)
    real_train_step, real_sha = loop.train_step, checkpoint.file_sha256
    steps, pressed = [0], [False]

    def train_step(parts, batch_of, **kw):
        steps[0] += 1
        if steps[0] != when:
            return real_train_step(parts, batch_of, **kw)

        def batch(micro):
            drawn = batch_of(micro)
            if micro == kw["grad_accum"] - 1:  # the step's last: no micro-batch boundary left to stop at
                os.kill(os.getpid(), signal.SIGINT)
                pressed[0] = True
            return drawn

        return real_train_step(parts, batch, **kw)

    def sha(path):
        if pressed[0]:
            pressed[0] = False
            print("kill_runner: the stop's checkpoint sleeps a minute", flush=True)  # (the test's cue)
            time.sleep(60)  # a signal's handler runs during the sleep (and may end the process)
        return real_sha(path)

    loop.train_step, checkpoint.file_sha256 = train_step, sha

main(args)
