"""`hopperlm export RUN OUT.gguf --format gguf`: a Llama-family model as one GGUF file, the format llama.cpp (and
Ollama, LM Studio) runs, written through the `gguf` package (the library llama.cpp's own converter writes with).

The file holds what llama.cpp's `convert_hf_to_gguf.py` writes for the Hugging Face folder `export` writes of the
model (hf.py's family: Llama and Mistral as llama, a ReLU² model as arcee, a QK-norm model as qwen3; a logit
softcap is refused in one line): the architecture's keys, the vocabulary (gguf_vocab.py: an imported model's
SentencePiece pieces with their scores, hopperlm's byte-level BPE as llama.cpp's gpt2 model with the gpt-2
pre-tokenizer, or the byte tokenizer; anything llama.cpp would tokenize otherwise is refused before a file is
written), the special token ids, the chat template, and the tensors under
llama.cpp's names, with the query and key projections permuted from Hugging Face's rotate-half layout to
llama.cpp's interleaved one where the architecture's RoPE is interleaved (llama, arcee; qwen3's is rotate-half).
A LoRA run is merged on the way (tensors.py).
Norms stay float32 in every outtype, as the converter keeps them; q8_0 falls back to f16 for a matrix whose rows
are not a multiple of 32 values. The k-quants (q4_k_m, q5_k_m, q6_k), which the `gguf` package cannot write, are
made from the f16 file by llama.cpp's llama-quantize (llama_quantize.py); without it, an export for Ollama
(`modelfile=True`) at q4_k_m writes the f16 file and leaves the quantizing to `ollama create -q q4_K_M`.
`modelfile=True` writes an Ollama Modelfile beside the file (ollama.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from hopperlm.checkpoint.layout import TOKENIZER_DIR, read_model_config, resolve_model_dir
from hopperlm.config import ModelConfig
from hopperlm.diskspace import check_room, disk_errors_as_one_line
from hopperlm.errors import CheckpointError, ConfigError
from hopperlm.files import write_atomic
from hopperlm.interop import llama_quantize
from hopperlm.interop.gguf_vocab import GGUFVocab, read_vocab, require_gguf
from hopperlm.interop.hf import hf_family
from hopperlm.interop.hf_convert import fold_output_multiplier
from hopperlm.interop.ollama import MODELFILE, modelfile_text
from hopperlm.interop.tensors import iter_model_tensors, to_hf_name
from hopperlm.model.transformer import count_params

WRITTEN = ("f32", "f16", "bf16", "q8_0")  # by the gguf package; the k-quants by llama-quantize from f16
OUTTYPES = (*WRITTEN, *llama_quantize.KQUANTS)
BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 int8 + an f16 scale
BYTES_PER_WEIGHT.update(llama_quantize.BYTES_PER_WEIGHT)
ALTERNATIVE = "export it with --format hf and convert that folder with llama.cpp's convert_hf_to_gguf.py"
# where the converter cannot help: it reads a SentencePiece tokenizer.model, but recognises a byte-level BPE only
# by the hash of a known vocabulary's ids, and no vocabulary trained here is one (its NotImplementedError)
KEEP_AS_IS = (
    "keep it with --format hopperlm (llama.cpp's convert_hf_to_gguf.py stops at a tokenizer trained here: "
    "it recognises only the byte-level BPEs it has hashed)"
)
# hf_family's family -> llama.cpp's architecture (convert_hf_to_gguf.py: LlamaModel, MistralForCausalLM as
# llama; ArceeModel(LlamaModel); Qwen3Model)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "arcee": "arcee", "qwen3": "qwen3"}
# the architectures whose RoPE rotates interleaved pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM: the converter
# permutes q/k from Hugging Face's rotate-half, LlamaModel.permute); qwen3's (NEOX) is rotate-half as stored
INTERLEAVED_ROPE = ("llama", "arcee")
# Hugging Face's tensor names (tensors.py's to_hf_name) -> llama.cpp's (its gguf-py tensor map: LLAMA's, ARCEE's
# without ffn_gate, QWEN3's with attn_q_norm / attn_k_norm)
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # qwen3 (model.qk_norm)
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def alternative_route(model_dir: Path) -> str:
    """What a refusal suggests instead: llama.cpp's converter for a SentencePiece tokenizer (it converts those,
    tests/test_gguf_vocab.py runs it), else the model kept as it is."""
    return ALTERNATIVE if (model_dir / TOKENIZER_DIR / "tokenizer.model").is_file() else KEEP_AS_IS


def check_exportable(cfg: ModelConfig, outtype: str, alternative: str = ALTERNATIVE) -> None:
    """One ConfigError naming the alternative for what this writer cannot express."""
    if outtype not in OUTTYPES:
        raise ConfigError(
            f"--outtype {outtype!r} is not one GGUF export writes; choose from {', '.join(OUTTYPES)}"
        )
    hf_family(cfg)  # a model no Llama-family format describes: one line naming its keys
    unsupported = [
        (cfg.qkv_bias, "attention biases (a Qwen2-family model)"),
        (bool(cfg.rope_scaling), f"RoPE scaling {cfg.rope_scaling}"),
    ]
    for present, what in unsupported:
        if present:
            raise ConfigError(
                f"GGUF export writes llama.cpp's {', '.join(sorted(set(ARCHITECTURES.values())))} "
                f"architectures here, with no {what}; {alternative}"
            )


def gguf_architecture(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for `cfg` (check_exportable has passed it): its Hugging Face family's (hf.py's
    hf_family) as convert_hf_to_gguf.py maps it."""
    family = hf_family(cfg)
    if family not in ARCHITECTURES:
        raise ConfigError(f"GGUF export writes no {family} model; {ALTERNATIVE}")
    return ARCHITECTURES[family]


def llama_cpp_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".", 3)  # model.layers.N.rest
    if parts[:2] != ["model", "layers"] or len(parts) != 4 or parts[3] not in _BLOCK:
        raise CheckpointError(f"tensor {hf_name!r} has no llama.cpp name; {ALTERNATIVE}")
    return f"blk.{parts[2]}.{_BLOCK[parts[3]]}"


def interleave_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query/key projection from rotate-half order (each head's first half of rotary pairs, then its
    second half: Hugging Face's and hopperlm's layout) to interleaved pairs (llama.cpp's, Meta's original)."""
    # (heads, 2, head_dim/2, dim) -> (heads, head_dim/2, 2, dim)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_data(gguf, w: torch.Tensor, outtype: str):
    """(array, raw GGML type or None) for the writer: norms in f32, matrices in the outtype."""
    data = w.detach().float().numpy()
    if data.ndim == 1 or outtype == "f32":
        return data.astype(np.float32), None
    if outtype == "f16" or (outtype == "q8_0" and data.shape[-1] % 32):
        return data.astype(np.float16), None
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    return gguf.quants.quantize(data, qtype), qtype


def model_dir_for_export(source: Path) -> Path:
    """resolve_model_dir's folder, where a run whose every checkpoint fails its checksums (a damaged or missing
    tokenizer/ folder among them) is one line naming each checkpoint's problem instead of a warning per
    checkpoint and then the error."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            model_dir = resolve_model_dir(source)
    except CheckpointError as e:
        found = re.findall(r"checkpoint (\S+) is corrupt \((.*)\); falling back", said.getvalue())
        if not found:
            raise
        problems = "; ".join(f"{Path(ckpt).name}: {why}" for ckpt, why in found)
        raise CheckpointError(
            f"every checkpoint in {source} is corrupt ({problems}); nothing to export: restore the files named "
            f"(a checkpoint's tokenizer/ is a copy of {Path(source) / TOKENIZER_DIR})"
        ) from e
    sys.stderr.write(said.getvalue())  # checkpoints skipped on the way to a good one: still said
    return model_dir


def export_gguf(
    source: Path,
    out: Path,
    outtype: str = "f16",
    overwrite: bool = False,
    log=print,
    *,
    llama_cpp: str | Path | None = None,
    modelfile: bool = False,
) -> Path:
    """A hopperlm run / checkpoint / model folder, or an imported Hugging Face one -> one GGUF file at `out`,
    written beside it under a temporary name and renamed into place (a failure leaves no partial file). A
    k-quant outtype: the f16 file (temporary, beside it) through llama-quantize, found in `llama_cpp` or on
    PATH; without one, with `modelfile`, the f16 file for Ollama to quantize (`ollama create -q`, one line says
    so and the Modelfile's line gives the command). `modelfile`: an Ollama Modelfile beside `out` too. Every
    check that can fail (llama-quantize found, the Modelfile's template expressible, no file in the way) runs
    before anything is written."""
    gguf = require_gguf()
    out = Path(out)
    if out.suffix != ".gguf":
        raise ConfigError(f"{out}: a GGUF export is one file; name it NAME.gguf")
    for path, wanted in ((out, True), (out.parent / MODELFILE, modelfile)):
        if wanted and path.exists() and not overwrite:
            raise CheckpointError(f"{path} exists; pass --overwrite or choose another name")
    quantizer, written, ollama_quantizes = None, outtype, None
    if outtype in llama_quantize.KQUANTS:
        quantizer = llama_quantize.find_llama_quantize(llama_cpp, outtype=outtype, modelfile=modelfile)
        if quantizer is None:  # no llama-quantize: Ollama makes the k-quant from the f16 file
            written, ollama_quantizes = "f16", llama_quantize.OLLAMA_QUANTIZES[outtype]
    model_dir = model_dir_for_export(source)
    cfg = read_model_config(model_dir)
    check_exportable(cfg, outtype, alternative_route(model_dir))
    vocab = read_vocab(model_dir / TOKENIZER_DIR, cfg.vocab_size)  # refused here, before any file
    if cfg.sliding_window:
        log(
            f"gguf: sliding_window {cfg.sliding_window} not written: llama.cpp's llama architecture attends to the whole context, as its own converter writes Mistral"
        )
    recipe = None
    if modelfile:
        recipe = modelfile_text(
            model_dir,
            cfg,
            out.name,
            source=Path(source),
            bos_added=vocab.add_bos,
            quantize=ollama_quantizes,
            log=log,
        )
    params = count_params(cfg)["total"]
    needed = int(params * BYTES_PER_WEIGHT[written]) + (8 << 20)
    if quantizer is not None:  # the f16 file and the k-quant, side by side until the f16 one goes
        needed += int(params * BYTES_PER_WEIGHT["f16"]) + (8 << 20)
    check_room(
        what=f"{out.name} ({written})",
        where=out.parent,
        needed=needed,
        fix="free space there or write it elsewhere",
    )
    if ollama_quantizes is not None:
        log(
            f"gguf {outtype}: no llama.cpp {llama_quantize.BINARY} on PATH, so {out} is written in f16 and Ollama "
            f"quantizes it to {ollama_quantizes} when it creates the model (the Modelfile's line below)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    f16 = out.with_name(f".{out.name}.f16-tmp-{os.getpid()}")
    try:
        with disk_errors_as_one_line(what=out.name, where=out.parent, needed=needed):
            if quantizer is None:
                write_gguf(gguf, tmp, model_dir, cfg, written, vocab)
            else:
                write_gguf(gguf, f16, model_dir, cfg, "f16", vocab)
                llama_quantize.quantize(quantizer, f16, tmp, outtype, log=log)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        f16.unlink(missing_ok=True)
    log(f"exported {out} (GGUF, {written}: llama-cli -m {out}, or an Ollama Modelfile FROM it)")
    if recipe is not None:
        path = write_atomic(out.parent / MODELFILE, recipe)
        create = ollama_create(out, path, ollama_quantizes)
        if ollama_quantizes is not None:
            log(f"modelfile: {path}; Ollama makes the {ollama_quantizes} model with: {create}")
        elif written in ("f16", "bf16", "f32"):  # what `ollama create -q` quantizes
            log(f"modelfile: {path}; {create} (add -q q4_K_M for Ollama to quantize the {written} file)")
        else:
            log(f"modelfile: {path}; {create}")
    return out


def ollama_create(out: Path, modelfile: Path, quantize: str | None) -> str:
    """The `ollama create` command for the Modelfile beside `out`, named after the GGUF (Ollama's names take
    letters, digits, '.', '-' and '_')."""
    name = re.sub(r"[^a-z0-9._-]+", "-", out.stem.lower()).strip(".-_") or "model"
    return shlex.join(
        ["ollama", "create", name, *(["-q", quantize] if quantize else []), "-f", str(modelfile)]
    )


def write_gguf(gguf, path: Path, model_dir: Path, cfg: ModelConfig, outtype: str, vocab: GGUFVocab) -> None:
    """The GGUF file itself, through the gguf package's writer (an outtype it writes: WRITTEN)."""
    head_dim = cfg.dim // cfg.n_heads
    arch = gguf_architecture(cfg)
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[outtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_key_length(head_dim)  # as the converter writes from config.json's head_dim
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.write(writer)
    for ours, w in iter_model_tensors(model_dir):
        name = to_hf_name(ours)
        w = fold_output_multiplier(ours, w, cfg)
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue  # llama.cpp uses token_embd for a missing output.weight
        if arch in INTERLEAVED_ROPE and name.endswith("q_proj.weight"):
            w = interleave_rope(w, cfg.n_heads)
        elif arch in INTERLEAVED_ROPE and name.endswith("k_proj.weight"):
            w = interleave_rope(w, cfg.kv_heads)
        data, raw = tensor_data(gguf, w, outtype)
        writer.add_tensor(llama_cpp_name(name), data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
