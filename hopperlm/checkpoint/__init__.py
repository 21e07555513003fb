"""Training checkpoints, with one owner: the Checkpointer decides when a run saves, writes the format its
strategy calls for, keeps what the checkpoint section says, checks the room on disk and restores every part.

  checkpointer.py  the Checkpointer (built from the checkpoint section and the parts a checkpoint holds), the
                   loop's `step(step)`, `load`, `roll_back`; `find_resume`: which checkpoint a run starts from
  disk.py          each checkpoint's size, the room checked before the first step, checkpoint.on_disk_full
  single.py        the single-file format (one process, DDP's rank 0): write, prune, load
  sharded.py       the sharded format (torch.distributed.checkpoint, every rank its shards), save and load
  layout.py        the files of checkpoints and model folders: names, listing, checksums, reading configs
Model folders in and out of other tools (Hugging Face, PEFT, GGUF, export) are hopperlm/interop/'s.
"""
