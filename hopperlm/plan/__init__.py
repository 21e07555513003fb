"""The plan: the concrete choices for one run on one machine, each with a one-line reason, frozen once made.

  record.py   Plan (the immutable record) and its Reasons
  choices.py  one rule per device-level choice: precision, float8, loss kernel, optimizer, attention, compile,
              LoRA/QLoRA's base
  attention_probe.py  cuDNN or flash attention, timed on the layer's own shape on a real Hopper GPU
  strategy.py data parallelism: the world's shape (World), the strategy over its ranks and its reason, the
              collective limits (parallel/ carries them out)
  make.py     make_plan: the rules in order, then data parallelism, activation checkpointing, the micro-batch
              (measured on a GPU by a finder, else estimated) and CUDA graphs
`train` and `diagnose` both reach make_plan through train/data_and_plan.py's `plan_run`.
"""

from hopperlm.plan.make import Finder, make_plan
from hopperlm.plan.record import Plan, Reasons, Strategy
from hopperlm.plan.strategy import SHARDED, World

__all__ = ["SHARDED", "Finder", "Plan", "Reasons", "Strategy", "World", "make_plan"]
