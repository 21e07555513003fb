"""Run by tests/test_dist_torchrun.py under torchrun: several trainings in one process group (one launch of the
processes instead of one per training), or one training in which a chosen rank raises.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_worker.py SPEC_JSON

SPEC: {"runs": [{"args": [--section.key value ...], "resume": false | true | PATH}, ...],
       "fail": {"rank": R, "step": S}   (optional: rank R raises when it reads the data of step S)}
Every run starts from configs/debug.yaml. With "fail", the training goes through the CLI (`hopperlm train`), so
what the test sees is what a user sees: one error line per rank and the exit codes.
"""

import json
import os
import sys
from pathlib import Path

from hopperlm.config import load_config
from hopperlm.interop.init_from import resolve_init_from
from hopperlm.parallel.runtime import session
from hopperlm.train.loop import train

DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "fail" in spec:
        from hopperlm import cli
        from hopperlm.data.batches import WindowBatches

        rank, bad_step = spec["fail"]["rank"], spec["fail"]["step"]
        read = WindowBatches.next

        def next_or_fail(self, step, micro):
            if int(os.environ["RANK"]) == rank and step == bad_step:
                raise ValueError(f"injected failure on rank {rank} at step {bad_step}")
            return read(self, step, micro)

        WindowBatches.next = next_or_fail
        (run,) = spec["runs"]
        cli.main(["train", str(DEBUG), *run["args"]])
        return
    configs = [resolve_init_from(load_config(DEBUG, run["args"])) for run in spec["runs"]]
    first = configs[0]
    # one process group for all the runs
    with session(first.parallel, device=first.train.device, run_dir=first.run.out_dir):
        for cfg, run in zip(configs, spec["runs"], strict=True):
            train(cfg, resume=run.get("resume", False), log=lambda line: None)


if __name__ == "__main__":
    main()
