"""lm-evaluation-harness tasks during training (the `eval` section): at log steps every `eval.every` steps
and at the end, rank 0 scores the model it is training on the tasks (eval/harness.py, as `hopperlm eval
--tasks` would) and the metrics join that step's record: metrics.jsonl (`tasks`), TensorBoard/W&B (`tasks/...`)
and the report.

The training run is not disturbed: the model goes back to train mode, and every random number generator
(Python, numpy, torch, CUDA) to its state before, since lm-eval seeds them all; a run with tasks trains the
same steps as one without. Under FSDP a rank holds only a shard of the weights, so rank 0 alone cannot run the
model: refused at start with one line. Under DDP the others wait at their next collective, with the start-up
limit (parallel/watchdog.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hopperlm.checkpoint.single import rng_state, set_rng_state
from hopperlm.config import EvalConfig
from hopperlm.errors import ConfigError

if TYPE_CHECKING:
    from hopperlm.parallel.runtime import Runtime


class EvalTasks:
    def __init__(
        self, ec: EvalConfig, run_dir: Path, rt: Runtime, strategy: str, log: Callable[[str], None]
    ) -> None:
        from hopperlm.eval.harness import task_manager

        self.tasks = [t.strip() for t in ec.tasks.split(",") if t.strip()]
        self.cfg, self.run_dir, self.rt, self.log = ec, Path(run_dir), rt, log
        if strategy in ("fsdp", "hsdp"):
            raise ConfigError(
                f"eval.tasks during training needs the whole model on rank 0, which {strategy} shards; "
                "evaluate the checkpoints with `hopperlm eval RUN --tasks ...` instead, or use ddp"
            )
        # lm-eval missing or a task unknown: one line now, not at the first evaluation hours later
        self.manager = task_manager(self.tasks, ec.include_path) if rt.is_main else None
        self.tokenizer = None

    def due(self, step: int, stopped_by: str | None) -> bool:
        every = self.cfg.every
        return bool(stopped_by) or (every > 0 and step % every == 0)

    def run(self, model: torch.nn.Module, step: int) -> dict[str, float] | None:
        """{task/metric: value} on rank 0 (None elsewhere)."""
        if not self.rt.is_main:
            return None
        from hopperlm.data.tokenizer import load_tokenizer
        from hopperlm.eval.harness import metrics_of, run_tasks

        folder = self.run_dir / "tokenizer"
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(folder)
        was_training = model.training
        saved = rng_state()  # (what a checkpoint saves of them)
        try:
            results = run_tasks(
                model,
                self.tokenizer,
                self.tasks,
                tokenizer_folder=folder,
                batch_size=self.cfg.batch,
                num_fewshot=self.cfg.num_fewshot,
                limit=self.cfg.limit,
                include_path=self.cfg.include_path,
                manager=self.manager,
            )
        finally:
            model.train(was_training)
            set_rng_state(*saved)
        metrics = metrics_of(results)
        self.log(f"tasks at step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics
