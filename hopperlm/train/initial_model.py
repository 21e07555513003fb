"""The model a run trains.

Training (`build_train_model`), by the config:
  from scratch                 build_model, exactly as before (no init_from, no lora section)
  model.init_from              the checkpoint's weights streamed into the model; a larger vocabulary (an
                               extended tokenizer) gets new rows (train/resize.py) and, with
                               train.embed_warmup_steps, a phase that trains only those rows
  + lora.rank                  the base built straight into its frozen form, target matrices in the compute
                               dtype (bf16 on a GPU: half of fp32's memory) or in NF4 (lora.quantize nf4),
                               never materialised in fp32 on the device; then the adapters (model/lora.py)
Inference (`load_for_inference`) is hopperlm/interop/inference.py's, resuming (`load_checkpoint_weights`)
hopperlm/checkpoint/single.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from hopperlm.checkpoint.layout import TOKENIZER_DIR, resolve_model_dir
from hopperlm.config import Config, LoRAConfig, ModelConfig
from hopperlm.data.tokenizer import Tokenizer, load_tokenizer
from hopperlm.errors import CheckpointError, ConfigError, DataError
from hopperlm.interop import hf
from hopperlm.interop.tensors import load_weights
from hopperlm.model.completep import residual_init_std
from hopperlm.model.lora import apply_lora, target_module_names
from hopperlm.model.qlora import nf4_linear
from hopperlm.model.transformer import Transformer, build_empty, build_model
from hopperlm.train.resize import resize_for_tokenizer


# ---- tokenizers ----------------------------------------------------------------------------------------------
def base_tokenizer(source: str | Path) -> Tokenizer | None:
    """The tokenizer that came with a checkpoint (HF folder files, or a hopperlm tokenizer/), if any."""
    source = Path(source)
    folder = source if hf.is_hf_dir(source) else resolve_model_dir(source) / TOKENIZER_DIR
    try:
        return load_tokenizer(folder)
    except DataError:
        return None


def _pieces(tok: Tokenizer, n: int) -> list[str | None]:
    return [tok.id_to_piece(i) for i in range(n)]


def check_tokenizer_fits(source: str, base: Tokenizer | None, data_tok: Tokenizer, where: str) -> None:
    """DataError unless the data's tokenizer is the base's, or the base's with pieces appended (every old id
    the same piece): anything else would feed the model ids that mean other pieces."""
    if base is None or base.sha256 == data_tok.sha256:
        return
    n = min(base.vocab_size, data_tok.vocab_size)
    same = base.kind == data_tok.kind == "byte" or (
        data_tok.vocab_size >= base.vocab_size and _pieces(base, n) == _pieces(data_tok, n)
    )
    if not same:
        raise DataError(
            f"{where} uses tokenizer {data_tok.name} ({data_tok.vocab_size:,} pieces), which is not the one of "
            f"model.init_from={source} ({base.name}, {base.vocab_size:,}) nor an extension of it; prepare the data "
            f"with --tokenizer {source} (or a `hopperlm tokenizer extend` of it)"
        )


# ---- the training model --------------------------------------------------------------------------------------
class EmbedWarmup:
    """Continued pretraining with new tokens: for the first `steps` steps only the new rows of the embedding
    and LM head learn (every other parameter frozen, the old rows' gradients zeroed, weight decay off so
    nothing old moves at all), then every parameter. The phase is a function of the step, so a resumed run
    lands in the same one."""

    def __init__(self, model: Transformer, base_rows: int, steps: int) -> None:
        self.model, self.steps, self.phase = model, steps, None
        self.heads = [model.embed.weight] + ([] if model.cfg.tie_embeddings else [model.lm_head.weight])
        self.mask = torch.ones(model.cfg.vocab_size, 1, device=model.embed.weight.device)
        self.mask[:base_rows] = 0
        self.hooks: list = []

    def before_step(self, step: int, optimizer) -> None:
        warm = step < self.steps
        if warm == self.phase:
            return
        self.phase = warm
        heads = {id(p) for p in self.heads}
        for p in self.model.parameters():
            p.requires_grad_(not warm or id(p) in heads)
        for h in self.hooks:
            h.remove()
        self.hooks = [p.register_hook(lambda g: g * self.mask) for p in self.heads] if warm else []
        for group in optimizer.param_groups:
            group.setdefault("base_weight_decay", group.get("weight_decay", 0.0))  # kept in the checkpoint
            group["weight_decay"] = 0.0 if warm else group["base_weight_decay"]


def build_train_model(
    cfg: Config,
    model_cfg: ModelConfig,
    *,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    data_tokenizer: Callable[[], Tokenizer] | None,
    load: bool,
    log: Callable[[str], None],
    sharded: bool = False,
) -> tuple[nn.Module, EmbedWarmup | None]:
    """The model `train` steps, and the embedding warm-up hook when asked for. load=False skips reading
    model.init_from (a resumed full fine-tune, whose checkpoint holds every weight, or the micro-batch finder):
    the base is then randomly initialised, and `data_tokenizer` (the data's, checked against the base's) is
    not needed. `data_tokenizer=None` means there is no data tokenizer to check: random-token benchmarks
    (bench/gpu/qlora.py) load model.init_from as it is; its vocabulary must then be the model's (new rows need
    the data's tokenizer). `sharded`: FSDP2 will shard it (QLoRA's 4-bit data is then stored in the compute
    dtype)."""
    source, tc = cfg.model.init_from, cfg.train
    if not source and not cfg.lora.enabled:
        return build_model(model_cfg, device, seed=tc.seed), None  # pretraining from scratch
    base = None
    if source and load:
        base = base_tokenizer(source)
        if data_tokenizer is not None:
            check_tokenizer_fits(source, base, data_tokenizer(), "the training data")
    if cfg.lora.enabled:
        if source and hf.model_values(source)["vocab_size"] < model_cfg.vocab_size:
            raise ConfigError(
                f"the data's tokenizer has {model_cfg.vocab_size - hf.model_values(source)['vocab_size']:,} more "
                f"pieces than {source}, but LoRA keeps the embeddings frozen, so new tokens could not be learned; "
                "train the new rows first (continued pretraining without the lora section), then LoRA on that"
            )
        dtype = "nf4" if cfg.lora.quantize == "nf4" else (compute_dtype or torch.float32)
        storage = (compute_dtype or torch.float32) if sharded else torch.uint8  # FSDP2's param dtype
        model = build_lora_model(
            model_cfg, cfg.lora, device, source if load else None, dtype, compute_dtype, tc.seed, storage
        )
        if load:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            frozen = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
            log(
                f"lora: rank {cfg.lora.rank} on {cfg.lora.targets} of {model_cfg.n_layers} blocks, {trainable:,} "
                f"trainable parameters; base {'from ' + source if source else 'randomly initialised'}, frozen in {frozen}"
            )
        return model, None
    base_rows = hf.model_values(source)["vocab_size"]
    if not load:
        model = build_model(model_cfg, device, seed=tc.seed)
    else:
        model = build_empty(model_cfg, device)
        base_rows = load_weights(model, source)
        log(f"init_from: {source} ({sum(p.numel() for p in model.parameters()):,} parameters loaded)")
        if base_rows < model_cfg.vocab_size:
            if data_tokenizer is None:
                raise ConfigError(
                    f"model.vocab_size={model_cfg.vocab_size:,} is larger than {source}'s {base_rows:,}: the new "
                    "rows are initialised from the data's tokenizer, and none was given"
                )
            resize_for_tokenizer(model, base_rows, data_tokenizer(), base, log)
    warmup = None
    if tc.embed_warmup_steps:
        if base_rows >= model_cfg.vocab_size:
            log("embed warm-up: off (the vocabulary is the base's: no new rows to warm up)")
        else:
            warmup = EmbedWarmup(model, base_rows, tc.embed_warmup_steps)
            log(
                f"embed warm-up: steps 1-{tc.embed_warmup_steps} train only the "
                f"{model_cfg.vocab_size - base_rows:,} new rows"
            )
    return model, warmup


def build_lora_model(
    model_cfg: ModelConfig,
    lora_cfg: LoRAConfig,
    device: torch.device | str,
    source: str | None,
    base_dtype: torch.dtype | str,
    compute_dtype: torch.dtype | None,
    seed: int,
    nf4_storage: torch.dtype = torch.uint8,
) -> Transformer:
    """The frozen base with adapters. Target matrices go straight from the source (or a random init) into
    `base_dtype` ("nf4": bitsandbytes 4-bit, its packed data stored as `nf4_storage`) on the device, one at a
    time; the rest is fp32 as usual."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    targets = set(target_module_names(model_cfg, lora_cfg))
    for name, module in model.named_modules():
        if name not in targets:
            module.to_empty(device=device, recurse=False)
    model.init_buffers()
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def place(name: str, tensor: torch.Tensor) -> bool:
        module_name, _, kind = name.rpartition(".")
        if module_name not in targets:
            return False
        parts = pending.setdefault(module_name, {})
        parts[kind] = tensor
        meta = model.get_submodule(module_name)
        if "weight" in parts and (meta.bias is None or "bias" in parts):
            _set_frozen(
                model,
                module_name,
                parts.pop("weight"),
                parts.pop("bias", None),
                device,
                base_dtype,
                compute_dtype,
                nf4_storage,
            )
        return True

    if source:
        load_weights(model, source, quantize=place)
    else:
        torch.manual_seed(seed)
        model.init_weights()  # the materialised part; target matrices are still on the meta device
        residual = residual_init_std(model_cfg)
        for name in sorted(targets):
            meta = model.get_submodule(name)
            std = residual if name.endswith(("o_proj", "down_proj")) else model_cfg.init_std
            weight = torch.empty(meta.weight.shape, device=device).normal_(0.0, std)
            bias = torch.zeros(meta.bias.shape, device=device) if meta.bias is not None else None
            _set_frozen(model, name, weight, bias, device, base_dtype, compute_dtype, nf4_storage)
    leftover = [n for n in targets if model.get_submodule(n).weight.is_meta]
    if leftover:
        raise CheckpointError(f"{source} lacks weights for {leftover[:3]}")
    apply_lora(model, lora_cfg)
    return model


def _set_frozen(model, name, weight, bias, device, base_dtype, compute_dtype, nf4_storage) -> None:
    parent_name, _, attr = name.rpartition(".")
    if base_dtype == "nf4":
        layer = nf4_linear(weight, bias, device, compute_dtype or torch.bfloat16, nf4_storage)
    else:
        out_features, in_features = weight.shape
        layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight.to(device=device, dtype=base_dtype), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.to(device=device, dtype=torch.float32), requires_grad=False)
    setattr(model.get_submodule(parent_name), attr, layer)
