"""Hugging Face interop: logit parity per family, bit-exact round trips, sharded streaming, clear refusals."""

import json

import pytest
import torch
from hf_tiny import FAMILIES, LLAMA3_ROPE, save_hf, tiny_hf_model

from hopperlm.config import ModelConfig, load_config
from hopperlm.diskspace import DiskError
from hopperlm.errors import CheckpointError, ConfigError
from hopperlm.interop import hf
from hopperlm.interop.hf_convert import export_hf, import_hf, write_shards
from hopperlm.interop.inference import load_for_inference
from hopperlm.interop.init_from import resolve_init_from
from hopperlm.interop.tensors import iter_model_tensors, load_weights
from hopperlm.model.transformer import build_empty, count_params

transformers = pytest.importorskip("transformers")
QUIET = lambda line: None  # noqa: E731


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_and_round_trip_is_bit_exact(family, tmp_path):
    theirs = tiny_hf_model(family)
    src = save_hf(theirs, tmp_path / "hf", max_shard_size="40KB")  # sharded: read shard by shard
    assert (src / "model.safetensors.index.json").is_file()
    ours = build_empty(ModelConfig(**hf.model_values(src)), "cpu").eval()
    load_weights(ours, src)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(x) - theirs(x).logits).abs().max().item()
    assert diff <= 1e-4, diff
    assert ours.cfg.qkv_bias == (family == "qwen2") and ours.cfg.tie_embeddings == (family == "qwen2")
    assert ours.cfg.qk_norm == (family == "qwen3") and (ours.cfg.mlp == "relu2") == (family == "arcee")
    assert (
        count_params(ours.cfg)["total"]
        == sum(p.numel() for p in ours.parameters())
        == theirs.num_parameters()
    )
    assert (ours.cfg.rope_scaling is not None) == (family == "llama3")

    imported = import_hf(src, tmp_path / "imported", log=QUIET)  # HF -> hopperlm folder, shards kept
    assert (imported / "model.safetensors.index.json").is_file()
    out = export_hf(imported, tmp_path / "exported", max_shard_size="30KB", log=QUIET)  # and back
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    a, b = theirs.state_dict(), again.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert again.config.model_type == theirs.config.model_type


def test_shards_never_exceed_the_limit(tmp_path):
    tensors = [(f"t{i}", torch.zeros(1000)) for i in range(10)]  # 4,000 bytes each
    files = write_shards(iter(tensors), tmp_path, max_shard_bytes=9000)
    assert len(files) == 5 and all((tmp_path / f).stat().st_size < 9000 + 1000 for f in files)
    assert [n for n, _ in iter_model_tensors_files(tmp_path)] == [n for n, _ in tensors]


def test_a_failed_export_leaves_the_old_folder_and_no_partial_one(tmp_path, monkeypatch):
    from hopperlm.interop import hf_convert

    src = save_hf(tiny_hf_model("tinyllama"), tmp_path / "hf")
    out = export_hf(import_hf(src, tmp_path / "imported", log=QUIET), tmp_path / "out", log=QUIET)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with pytest.raises(CheckpointError, match="exists and is not empty; pass --overwrite"):
        export_hf(tmp_path / "imported", out, log=QUIET)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_convert, "write_shards", disk_full)
    with pytest.raises(
        DiskError, match=r"could not write the exported model in .* \(no space left on device"
    ):
        export_hf(tmp_path / "imported", out, overwrite=True, log=QUIET)  # one line (issue 37)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "imported", "out"]


def iter_model_tensors_files(folder):
    from hopperlm.checkpoint.layout import weight_files
    from hopperlm.interop.tensors import iter_file_tensors

    return iter_file_tensors(weight_files(folder))


def test_mistral_window_caps_the_context(tmp_path):
    src = save_hf(tiny_hf_model("mistral", sliding_window=32), tmp_path / "m")
    values = hf.model_values(src)
    assert values["max_seq_len"] == 32 and values["sliding_window"] == 32
    with pytest.raises(ConfigError, match="no sliding-window attention"):
        ModelConfig(**{**values, "max_seq_len": 64})


def test_unsupported_checkpoints_are_refused_with_the_reason(tmp_path):
    base = tiny_hf_model("llama2").config.to_dict()
    cases = {
        "gpt2": ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "'yarn'"),
        "head": ({"head_dim": 8}, "head_dim=8"),
        "bias": ({"attention_bias": True}, "attention_bias"),
        "act": ({"hidden_act": "gelu"}, "SwiGLU"),
    }
    for name, (change, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(ConfigError, match=message):
            hf.model_values(folder)
    (tmp_path / "head" / "config.json").write_text(json.dumps(base))
    (tmp_path / "head" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        list(iter_model_tensors(tmp_path / "head"))


def test_init_from_takes_the_shape_and_refuses_conflicts(tinyllama_hf, tmp_path):
    (tmp_path / "c.yaml").write_text(
        f"model:\n  init_from: {tinyllama_hf}\n  max_seq_len: 256\ntrain:\n  seq_len: 128\n  max_steps: 1\n"
    )
    cfg = resolve_init_from(load_config(tmp_path / "c.yaml"))
    assert (cfg.model.dim, cfg.model.n_kv_heads, cfg.model.vocab_size, cfg.model.max_seq_len) == (
        64,
        2,
        32000,
        256,
    )
    with pytest.raises(
        ConfigError, match="model.dim=128 but .* has 64; the shape comes from model.init_from"
    ):
        resolve_init_from(load_config(tmp_path / "c.yaml", ["--model.dim", "128"]))
    with pytest.raises(ConfigError, match="exceeds"):
        resolve_init_from(load_config(tmp_path / "c.yaml", ["--model.max_seq_len", "4096"]))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_init_from(load_config(tmp_path / "c.yaml", ["--model.init_from", str(tmp_path / "nope")]))


def test_hf_folder_loads_directly_for_inference(tinyllama_hf):
    model, tokenizer = load_for_inference(
        tinyllama_hf, device="cpu"
    )  # generate/eval take HF folders as they are
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tinyllama_hf).eval()
    ids = torch.tensor([tokenizer.encode("Hello there, how are you?")])
    with torch.no_grad():
        assert (model(ids) - theirs(ids).logits).abs().max().item() <= 1e-4
    assert tokenizer.vocab_size == 32000 and tokenizer.eos_id == 2


@pytest.mark.parametrize("preset", ["tinyllama-1.1b", "llama2-7b", "llama3-8b"])
def test_preset_configs_round_trip_through_config_json(preset):
    from hopperlm.config.presets import get_preset

    ours = get_preset(preset)
    back = hf.model_values_from_hf(hf.hf_config_dict(ours, "bfloat16"), "x")
    same = [k for k in back if k not in ("n_kv_heads", "dropout", "init_std")]
    assert all(back[k] == getattr(ours, k) for k in same) and back["n_kv_heads"] == ours.kv_heads, back
    theirs = transformers.LlamaConfig(**hf.hf_config_dict(ours, "bfloat16"))
    with torch.device("meta"):
        n = transformers.AutoModelForCausalLM.from_config(theirs).num_parameters()
    assert count_params(ours)["total"] == n  # 6,738,415,616 for Llama-2-7B


# ---- hopperlm's own features exported: ReLU² as Arcee, QK-norm as Qwen3; what no format carries, refused ----
LLAMA3 = {k: float(v) for k, v in LLAMA3_ROPE.items() if k != "rope_type"}  # model.rope_scaling's llama3


def native_model(folder, seed: int = 0, **features):
    """A tiny hopperlm model with `features` (model.mlp, model.qk_norm, ...), every weight non-trivial (norms
    around one, QK-norm's included), written as a model folder without a tokenizer. (folder, model)."""
    from hopperlm.checkpoint.layout import write_model
    from hopperlm.model.transformer import build_model

    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256, max_seq_len=64)
    cfg = ModelConfig(**{**shape, **features})
    model = build_model(cfg, seed=seed).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    write_model(folder, model, cfg, None)
    return folder, model


@pytest.mark.parametrize(
    "features, family",
    [
        ({"mlp": "relu2"}, "arcee"),
        ({"mlp": "relu2", "tie_embeddings": True, "rope_theta": 500000.0, "rope_scaling": LLAMA3}, "arcee"),
        ({"qk_norm": True}, "qwen3"),
        (
            {"qk_norm": True, "tie_embeddings": True, "n_kv_heads": 4, "rope_scaling": {"factor": 2.0}},
            "qwen3",
        ),
    ],
)
def test_relu2_exports_as_arcee_and_qk_norm_as_qwen3_with_hopperlm_logits(features, family, tmp_path):
    """`export` of a ReLU² model writes transformers' ArceeForCausalLM, of a QK-norm model Qwen3ForCausalLM;
    from_pretrained gives hopperlm's logits (fp32), and `import` of the folder gives back the same model."""
    source, ours = native_model(tmp_path / "model", **features)
    out = export_hf(source, tmp_path / "hf", log=QUIET)
    config = json.loads((out / "config.json").read_text())
    architecture = {"arcee": "ArceeForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert config["model_type"] == family and config["architectures"] == [architecture]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(theirs).__name__ == architecture
    assert theirs.num_parameters() == count_params(ours.cfg)["total"]
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=1e-5, atol=1e-5)

    back = import_hf(out, tmp_path / "imported", log=QUIET)
    again = build_empty(ModelConfig(**hf.model_values(back)), "cpu").eval()
    load_weights(again, back)
    assert (again.cfg.mlp, again.cfg.qk_norm) == (ours.cfg.mlp, ours.cfg.qk_norm)
    a, b = ours.state_dict(), again.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_exports_no_format_carries_are_refused_in_one_line_and_write_nothing(tmp_path, capsys):
    """A logit softcap (HF and GGUF), QK-norm with ReLU², and either with q/k/v biases: `hopperlm export` exits 2
    with one line naming the keys and --format hopperlm, and leaves no output folder or file behind."""
    from hopperlm.cli import main

    cases = [
        ({"logit_softcap": 15.0}, "model.logit_softcap=15.0: no Llama-family format carries a logit softcap"),
        (
            {"mlp": "relu2", "qk_norm": True},
            "model.qk_norm=true with model.mlp=relu2: no Llama-family format",
        ),
        ({"qk_norm": True, "qkv_bias": True}, "model.qkv_bias=true with model.qk_norm=true: Qwen3"),
        ({"mlp": "relu2", "qkv_bias": True}, "model.qkv_bias=true with model.mlp=relu2: Arcee"),
    ]
    for i, (features, message) in enumerate(cases):
        source, _ = native_model(tmp_path / f"model-{i}", **features)
        for out, fmt in (
            (tmp_path / f"hf-{i}", []),
            (tmp_path / f"gguf-{i}" / "m.gguf", ["--format", "gguf"]),
        ):
            with pytest.raises(SystemExit) as exit_:
                main(["export", str(source), str(out), *fmt])
            stderr = capsys.readouterr().err
            lines = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert exit_.value.code == 2 and len(lines) == 1, stderr[-2000:]
            assert message in lines[0] and "--format hopperlm" in lines[0], (fmt, lines[0])
            assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"model-{i}" for i in range(len(cases))]
    with pytest.raises(ConfigError, match="model.logit_softcap=15.0"):
        hf.llama_config(ModelConfig(vocab_size=64, logit_softcap=15.0))  # `bench`'s transformers baseline
    with pytest.raises(ConfigError, match="transformers' arcee family"):
        hf.llama_config(ModelConfig(vocab_size=64, mlp="relu2"))
