"""Seeing a run: live progress and ETA, metric sinks (metrics.jsonl, TensorBoard, W&B, CSV), the GPU monitor,
plots, the profiler's top-kernels table and the run report.

The training loop talks to one object, `observer.RunObserver`; the CLI verbs `plot`, `profile` and `report` use
the modules directly. Optional packages (wandb, nvidia-ml-py) are imported only when they are used.
"""
