"""Continued pretraining: init_from + an extended tokenizer -> new rows from their base pieces, old-token
outputs unchanged, an embedding warm-up that moves only the new rows, and a clear error for a wrong tokenizer;
the tokenizer travels whole (tokenizer.model too) from an import or an extension to the export."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hopperlm.checkpoint.layout import checkpoint_dir
from hopperlm.cli import main
from hopperlm.config import load_config
from hopperlm.data import tokenizer_train as tt
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.errors import ConfigError, DataError
from hopperlm.interop.init_from import resolve_init_from
from hopperlm.interop.tensors import iter_model_tensors
from hopperlm.train.initial_model import build_train_model
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731


@pytest.fixture(scope="module")
def tigrinya(data_dir, tmp_path_factory):
    """TinyLlama's tokenizer + 200 Tigrinya pieces, and HornMT Tigrinya prepared with it."""
    root = tmp_path_factory.mktemp("tir")
    base = tt.load_base(str(data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"))
    text = (data_dir / "hornmt" / "tir.txt").read_text(encoding="utf-8")
    ext = tt.extend_tokenizer(base, [text[:200_000]], 200)
    tt.save_extension(ext, root / "tok", [])
    prepare(
        [data_dir / "hornmt" / "tir.txt"],
        root / "data",
        PrepareOptions(tokenizer=str(root / "tok")),
        progress=False,
    )
    return root / "tok", root / "data", ext


def cpt_config(tinyllama_hf, data, run_dir, *extra):
    cfg = load_config(
        REPO / "configs" / "debug.yaml",
        [
            "--model.preset", "null",
            "--model.init_from", str(tinyllama_hf),
            "--data.path", str(data),
            "--train.seq_len", "64",
            "--train.micro_batch", "4",
            "--train.eval_windows", "4",
            "--schedule.warmup_steps", "0",
            "--optim.lr", "1e-2",
            "--run.out_dir", str(run_dir),
            *extra,
        ],
    )  # fmt: skip
    return resolve_init_from(cfg)


def test_resized_model_keeps_old_outputs_and_starts_new_rows_from_their_pieces(
    tinyllama_hf, tigrinya, tmp_path
):
    transformers = pytest.importorskip("transformers")
    tok_dir, data, ext = tigrinya
    cfg = cpt_config(tinyllama_hf, data, tmp_path / "r", "--train.max_steps", "1")
    from hopperlm.data.tokenizer import load_tokenizer
    from hopperlm.train.data_and_plan import resolve_model_config

    model_cfg = resolve_model_config(cfg.model, 32200)
    assert model_cfg.vocab_size == 32256  # 32,200 rounded up to a multiple of 64
    lines = []
    model, warmup = build_train_model(
        cfg,
        model_cfg,
        device=torch.device("cpu"),
        compute_dtype=None,
        data_tokenizer=lambda: load_tokenizer(tok_dir),
        load=True,
        log=lines.append,
    )
    assert warmup is None and any("200 decomposed" in line and "56 from the mean" in line for line in lines)
    base = transformers.AutoModelForCausalLM.from_pretrained(tinyllama_hf).eval()
    old = torch.tensor([load_tokenizer(tinyllama_hf).encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        ours = model.eval()(old)
        assert (ours[..., :32000] - base(old).logits).abs().max().item() <= 1e-4  # old outputs unchanged
    # a new piece starts as the mean of the base pieces its text encodes to (here: UTF-8 byte pieces)
    piece = ext.added[-1]
    pieces = load_tokenizer(tinyllama_hf).continuation().encode(piece.replace("\u2581", " "))
    assert len(pieces) >= 2 and max(pieces) < 32000
    new_id = ext.base_size + len(ext.added) - 1
    assert ext.tokenizer.id_to_piece(new_id) == piece
    torch.testing.assert_close(model.embed.weight[new_id], model.embed.weight[pieces].mean(0))
    torch.testing.assert_close(model.lm_head.weight[new_id], model.lm_head.weight[pieces].mean(0))
    torch.testing.assert_close(model.embed.weight[32200:], model.embed.weight[:32000].mean(0).expand(56, -1))


def test_embed_warmup_moves_only_new_rows_then_everything(tinyllama_hf, tigrinya, tmp_path):
    _, data, _ = tigrinya
    run = tmp_path / "run"
    args = [
        "--train.max_steps",
        "3",
        "--checkpoint.every",
        "1",
        "--checkpoint.keep_last",
        "5",
        "--train.log_every",
        "1",
    ]
    lines = []
    train(cpt_config(tinyllama_hf, data, run, "--train.embed_warmup_steps", "2", *args), log=lines.append)
    assert any(line.startswith("embed warm-up: steps 1-2 train only the 256 new rows") for line in lines)
    base = dict(iter_model_tensors(tinyllama_hf))
    step1, after_warmup, after_all = (
        load_file(str(checkpoint_dir(run, s) / "model.safetensors")) for s in (1, 2, 3)
    )
    for name in ("embed.weight", "lm_head.weight"):
        assert torch.equal(after_warmup[name][:32000], base[name])  # old rows untouched (no decay either)
        assert not torch.equal(after_warmup[name][32000:], step1[name][32000:])  # the new rows learn
    blocks = [n for n in base if n.startswith("layers.")]
    assert all(torch.equal(after_warmup[n], base[n]) for n in blocks)  # frozen during the warm-up
    assert any(not torch.equal(after_all[n], base[n]) for n in blocks)  # then everything trains
    assert not torch.equal(after_all["embed.weight"][:32000], base["embed.weight"])
    # the extended tokenizer.model travels with the data, the run and its checkpoints
    tok = tigrinya[0]
    for folder in (data, run / "tokenizer", checkpoint_dir(run, 3) / "tokenizer"):
        assert (folder / "tokenizer.model").read_bytes() == (tok / "tokenizer.model").read_bytes()


def same_files(folder: Path, source: Path, names: tuple[str, ...]) -> bool:
    return all((folder / n).read_bytes() == (source / n).read_bytes() for n in names)


@pytest.mark.slow  # trains
def test_the_tokenizer_travels_whole_from_import_to_export(tinyllama_hf, data_dir, tmp_path, capsys):
    """The seed path: import a Hub folder, prepare with its tokenizer.json, continue pretraining, export: every
    file of TinyLlama's tokenizer (tokenizer.model: what llama.cpp's converter reads) reaches the export."""
    imported, data, run, exported = (tmp_path / n for n in ("imported", "data", "run", "hf"))
    main(["import", str(tinyllama_hf), str(imported)])
    options = PrepareOptions(tokenizer=str(imported / "tokenizer" / "tokenizer.json"))
    prepare([data_dir / "hornmt" / "eng.txt"], data, options, progress=False, log=QUIET)
    train(cpt_config(imported, data, run, "--train.max_steps", "1", "--checkpoint.every", "1"), log=QUIET)
    main(["export", str(run), str(exported)])
    whole = ("tokenizer.json", "tokenizer.model", "special_tokens_map.json")
    for folder in (imported / "tokenizer", data, run / "tokenizer", checkpoint_dir(run, 1) / "tokenizer"):
        assert same_files(folder, tinyllama_hf, (*whole, "tokenizer_config.json"))
    assert same_files(exported, tinyllama_hf, whole)  # tokenizer_config.json: rewritten, see hf_tokenizer.py
    assert "tokenizer.model" in capsys.readouterr().out  # the export's message names it


def test_wrong_tokenizer_and_lora_on_new_tokens_are_refused(
    tinyllama_hf, tigrinya, shakespeare_bytes, tmp_path
):
    cfg = cpt_config(tinyllama_hf, shakespeare_bytes, tmp_path / "x", "--train.max_steps", "1")
    with pytest.raises(DataError, match="not the one of model.init_from"):
        train(cfg, log=QUIET)
    cfg = cpt_config(tinyllama_hf, tigrinya[1], tmp_path / "y", "--train.max_steps", "1", "--lora.rank", "4")
    with pytest.raises(ConfigError, match="LoRA keeps the embeddings frozen"):
        train(cfg, log=QUIET)
