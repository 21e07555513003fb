"""How the parts are stored and exchanged: checkpoint folders, Hugging Face and PEFT formats.

  layout.py      the files of run checkpoints and model folders: names, listing, checksums, reading configs
  atomic.py      folders that are complete or absent: fsync, staged folders, swap into place
  hf.py          Hugging Face config.json <-> ModelConfig
  init_from.py   resolve_init_from: a config's model section filled in from the checkpoint model.init_from names
  sharded.py     the sharded (torch.distributed.checkpoint) format, read whole in one process
  tensors.py     any checkpoint as a stream of tensors under hopperlm's names, and into a built model
  single.py      run checkpoints in the single-file format: save, load weights and training state, export
  hf_convert.py  import from and export to Hugging Face folders; merge LoRA adapters into a model folder
  hf_tokenizer.py  the tokenizer files of an exported folder, for every kind of tokenizer hopperlm writes
  peft.py        LoRA adapters to and from PEFT adapter folders
  inference.py   a model and its tokenizer from any checkpoint (generate, eval); where a tokenizer is
Nothing here imports plan, dist, train or anything above them; parallel/checkpoint.py is where the ranks of a
data-parallel run take turns writing and reading these files.
"""
