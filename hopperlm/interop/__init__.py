"""Model folders in and out of other tools: Hugging Face (config, weights, tokenizer), PEFT adapters, GGUF for
llama.cpp and Ollama, a checkpoint's model copied out, and models loaded for inference or as a starting point.

  hf.py          Hugging Face config.json <-> ModelConfig
  hf_convert.py  import from and export to Hugging Face folders; merge LoRA adapters into a model folder;
                 the sampling a model is generated with by default (its HF base's generation_config.json)
  hf_tokenizer.py  the tokenizer files of an exported folder, for every kind of tokenizer hopperlm writes
  peft.py        LoRA adapters to and from PEFT adapter folders
  gguf.py        GGUF files for llama.cpp / Ollama (f32/f16/bf16/q8_0 written here, k-quants by llama.cpp)
  llama_quantize.py  llama.cpp's llama-quantize found and run (q4_k_m, q5_k_m, q6_k from the f16 file)
  ollama.py      the Ollama Modelfile beside a GGUF: the run's chat template as TEMPLATE, stops, sampling
  export.py      a checkpoint's model part copied out as a model folder of its own
  tensors.py     any checkpoint as a stream of tensors under hopperlm's names, and into a built model
  init_from.py   resolve_init_from: a config's model section filled in from the checkpoint model.init_from names
  inference.py   a model and its tokenizer from any checkpoint (generate, eval); where a tokenizer is
Training checkpoints themselves (saving, resuming, keeping, room on disk) are hopperlm/checkpoint/'s.
"""
