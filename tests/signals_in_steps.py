"""A signal sent to the training process from inside a chosen step, at a chosen micro-batch: where it lands is
then fixed, however loaded the machine (a test's own signal, sent from outside, lands wherever the run happens
to be: between steps the next one is dropped at its first micro-batch; in the last micro-batch the step
completes; a race CI lost once).

Used in-process (`monkeypatch.setattr` as `patch`) and by tests/faults/kill_runner.py in a training process."""

import os
import signal
from collections.abc import Callable

from hopperlm.train import loop


def signal_inside_step(
    when: int,
    sig: int = signal.SIGTERM,
    *,
    micro: int = -1,
    patch: Callable = setattr,
    sent: Callable[[], None] = lambda: None,
) -> None:
    """Send `sig` to this process while its `when`-th step trains (counted from 1), once micro-batch `micro`
    is drawn: -1, the step's last (the step completes and the run stops after it); k, an earlier one (the step
    is dropped at the next micro-batch boundary, k + 1). `sent()` runs right after."""
    real, calls = loop.train_step, [0]

    def train_step(parts, batch_of, **kw):
        calls[0] += 1
        if calls[0] != when:
            return real(parts, batch_of, **kw)
        at = kw["grad_accum"] - 1 if micro < 0 else micro

        def batch(i):
            drawn = batch_of(i)
            if i == at:
                os.kill(os.getpid(), sig)  # (this thread is the main one: the handler runs before we go on)
                sent()
            return drawn

        return real(parts, batch, **kw)

    patch(loop, "train_step", train_step)
