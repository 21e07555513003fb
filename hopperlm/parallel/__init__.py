"""Scale-out on torch.distributed: runtime.py (torchrun's environment, the process group, rank 0 speaks,
failures stop every rank), parallelize.py (DDP / FSDP2 / HSDP after the speed-ups), checkpoint.py (single-file
and sharded checkpoints, loadable at any world size), launch.py (the torchrun lines and SLURM scripts)."""
