"""Where users compare with transformers: `tokenizer(text)` ids, greedy `model.generate` text, where it stops,
the generation_config.json defaults, the repetition penalty, and top-p's distribution."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import TINYLLAMA_TOKENIZER, tiny_hf_model

from hopperlm.data.tokenizer import ByteTokenizer, load_tokenizer
from hopperlm.interop.hf_convert import export_hf, import_hf
from hopperlm.model.generate import (
    SAMPLING_DEFAULTS,
    generate,
    generation_defaults,
    process_logits,
    sampling_generation_config,
)

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 12
# family -> (tokenizer folder under tokenizers/, its files, vocabulary, EOS id, prompt)
FAMILIES = {
    "tinyllama": ("tinyllama-1.1b-chat-v1.0", TINYLLAMA_TOKENIZER, 32000, 2, "The capital of France is"),
    "mistral": ("tinyllama-1.1b-chat-v1.0", TINYLLAMA_TOKENIZER, 32000, 2, "Once upon a time, there"),
    "qwen2": ("gpt2", ("tokenizer.json",), 50257, 50256, "Hello, my dog is cute and"),
}
TEXTS = [
    "Hello world",
    " two  spaces\nand a line",
    "héllo 世界 🙂",
    "x = 3.14; y=[1, 2]",
    "",
    "Hi</s>there <s> x",
]
# Where transformers rebuilds a tokenizer.json by model type, it no longer runs that tokenizer.json: a `mistral`
# folder gets it as it is (not LlamaTokenizer's '▁' only at the start), `qwen2` gets Qwen2's digit-by-digit
# split over GPT-2's vocabulary. hopperlm follows the tokenizer files, so those texts are left out there.
AS_SHIPPED_ONLY = {
    "mistral": {" two  spaces\nand a line", "Hi</s>there <s> x"},
    "qwen2": {"x = 3.14; y=[1, 2]"},
}


def run_cli(*args):
    """`python -m hopperlm ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "hopperlm", *map(str, args)], capture_output=True, text=True, cwd=REPO
    )


def generate_stdout(capsys, *args) -> str:
    """What `hopperlm generate ARGS` prints, run in this process (the same parser and verb as run_cli, without
    importing torch again for every call)."""
    from hopperlm.cli import main

    capsys.readouterr()
    main(["generate", *map(str, args), "--device", "cpu"])
    return capsys.readouterr().out


def hf_folder(family: str, out: Path, data_dir: Path) -> Path:
    """A tiny random model of `family` saved like a Hub checkpoint, with a real tokenizer beside it."""
    tokenizer, files, vocab, eos, _ = FAMILIES[family]
    model = tiny_hf_model(family, vocab_size=vocab, bos_token_id=1 if eos == 2 else eos, eos_token_id=eos)
    model.save_pretrained(out)
    for name in files:
        shutil.copy(data_dir / "tokenizers" / tokenizer / name, out / name)
    return out


@pytest.fixture(scope="module")
def folders(data_dir, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> {hf: the Hugging Face folder, import: its `hopperlm import`, export: that import's export}."""
    root = tmp_path_factory.mktemp("hf-generate")
    out = {}
    for family in FAMILIES:
        hf = hf_folder(family, root / family, data_dir)
        imported = import_hf(hf, root / f"{family}-import", log=lambda _: None)
        exported = export_hf(imported, root / f"{family}-export", log=lambda _: None)
        out[family] = {"hf": hf, "import": imported, "export": exported}
    return out


def transformers_generate(folder: Path, prompt: str, **kwargs) -> tuple[list[int], str]:
    """(new ids, decoded text) as a transformers user gets them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, **kwargs)[0]
    return out[inputs["input_ids"].shape[1] :].tolist(), tokenizer.decode(out, skip_special_tokens=True)


# ---- tokenizer(text) --------------------------------------------------------------------------------------
def transformers_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_encode_for_model_adds_what_transformers_adds(data_dir, tmp_path):
    """TinyLlama (BOS from tokenizer.json's template; transformers 5 ignores tokenizer_config.json's
    add_bos_token/add_eos_token beside a tokenizer.json, so the variants setting them keep it), GPT-2 (none)."""
    from transformers import AutoTokenizer

    tinyllama = data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
    variants = {"as shipped": tinyllama}
    for name, flags in {"no bos": {"add_bos_token": False}, "eos only": {"add_eos_token": True}}.items():
        folder = shutil.copytree(tinyllama, tmp_path / name)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
        variants[name] = folder
    gpt2 = shutil.copytree(data_dir / "tokenizers" / "gpt2", tmp_path / "gpt2")
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    variants["gpt2"] = gpt2
    for name, folder in variants.items():
        ours = load_tokenizer(folder)
        theirs = AutoTokenizer.from_pretrained(folder)
        for text in TEXTS:
            assert ours.encode_for_model(text) == theirs(text)["input_ids"], (name, text)
        prefix, suffix = ours.special_prefix_ids, ours.special_suffix_ids
        assert ours.encode_for_model("Hi") == [*prefix, *ours.encode("Hi"), *suffix]
    assert load_tokenizer(tinyllama).special_prefix_ids == [1]
    assert load_tokenizer(variants["no bos"]).special_prefix_ids == [1]
    assert load_tokenizer(variants["eos only"]).special_suffix_ids == []
    assert load_tokenizer(gpt2).special_prefix_ids == load_tokenizer(gpt2).special_suffix_ids == []


def test_encode_for_model_sentencepiece_and_byte(data_dir):
    """A Llama-2 .model: BOS first, as LlamaTokenizer (and sentencepiece's own add_bos) encodes. The byte
    tokenizer adds nothing."""
    import sentencepiece

    model = data_dir / "tokenizers" / "llama2" / "tokenizer.model"
    ours = load_tokenizer(model)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    for text in TEXTS:
        assert ours.encode_for_model(text) == sp.encode(text, add_bos=True), text
    assert ours.special_prefix_ids == [1] and ours.special_suffix_ids == []
    byte = ByteTokenizer()
    assert byte.encode_for_model("héllo") == list("héllo".encode()) and byte.special_prefix_ids == []


def test_encode_for_model_matches_the_tokenizer_transformers_picks(folders):
    """AutoTokenizer on each model folder (LlamaTokenizer for Llama, TokenizersBackend for Mistral,
    Qwen2Tokenizer for Qwen2 over GPT-2's tokenizer.json) gives the ids hopperlm feeds the model."""
    for family, f in folders.items():
        ours = load_tokenizer(f["hf"])
        for text in [*TEXTS, FAMILIES[family][4]]:
            if text in AS_SHIPPED_ONLY.get(family, ()):
                continue
            assert ours.encode_for_model(text) == transformers_ids(f["hf"], text), (family, text)


# ---- greedy generation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_text_equals_transformers_from_folder_import_and_export(folders, family, capsys):
    prompt = FAMILIES[family][4]
    _, expected = transformers_generate(
        folders[family]["hf"], prompt, do_sample=False, max_new_tokens=NEW_TOKENS
    )
    for source in ("hf", "import", "export"):
        out = generate_stdout(
            capsys,
            folders[family][source],
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            NEW_TOKENS,
        )
        assert out == expected + "\n", (source, out, expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_config_defaults_eos_list_and_repetition_penalty(folders, family, tmp_path):
    """No flags: generation_config.json decides (greedy as do_sample is unset, max_new_tokens, a repetition
    penalty, and a list of EOS ids holding a token greedy decoding reaches: generation stops right after it,
    as transformers stops)."""
    hf = shutil.copytree(folders[family]["hf"], tmp_path / family)
    prompt, eos = FAMILIES[family][4], FAMILIES[family][3]
    config = json.loads((hf / "generation_config.json").read_text())
    config.update(max_new_tokens=NEW_TOKENS, repetition_penalty=1.3)
    (hf / "generation_config.json").write_text(json.dumps(config))
    penalised, _ = transformers_generate(hf, prompt)
    assert len(penalised) == NEW_TOKENS
    config["eos_token_id"] = [eos, penalised[4]]  # stop at the 5th new token (or earlier, where it recurs)
    (hf / "generation_config.json").write_text(json.dumps(config))
    ids, expected = transformers_generate(hf, prompt)
    assert len(ids) <= 5 and ids[-1] == penalised[4]
    result = run_cli("generate", hf, "--prompt", prompt, "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_import_and_export_carry_generation_config(folders, tmp_path, capsys):
    """generation_config.json travels with `hopperlm import` and `hopperlm export`, so generate decides the same
    way from either (here: greedy for 5 tokens, where hopperlm's own defaults would sample 200)."""
    hf = shutil.copytree(folders["tinyllama"]["hf"], tmp_path / "hf")
    config = json.loads((hf / "generation_config.json").read_text())
    (hf / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 5}))
    imported = import_hf(hf, tmp_path / "import", log=lambda _: None)
    exported = export_hf(imported, tmp_path / "export", log=lambda _: None)
    prompt = FAMILIES["tinyllama"][4]
    _, expected = transformers_generate(hf, prompt)
    for source in (imported, exported):
        assert generate_stdout(capsys, source, "--prompt", prompt) == expected + "\n", source


def test_repetition_penalty_greedy_equals_transformers_token_for_token(folders):
    from transformers import AutoModelForCausalLM

    from hopperlm.interop.inference import load_for_inference

    folder = folders["qwen2"]["hf"]
    model, tokenizer = load_for_inference(folder, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer.encode_for_model(FAMILIES["qwen2"][4])
    for penalty in (0.7, 1.5):
        expected = theirs.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=24, repetition_penalty=penalty
        )[0, len(prompt) :].tolist()
        ours = generate(model, prompt, 24, temperature=0.0, repetition_penalty=penalty, eos_id=50256)
        assert ours == expected, penalty


# ---- sampling distributions -------------------------------------------------------------------------------
def test_top_p_and_the_processor_order_match_transformers():
    """The scores hopperlm samples from equal transformers' after the same processors in the same order
    (repetition penalty, temperature, top-k, top-p): the same tokens keep a non-zero probability and the
    renormalised probabilities agree within 1e-6."""
    from transformers.generation import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=gen) * 3
    seen_ids = torch.randint(0, 500, (4, 30), generator=gen)
    seen = torch.zeros(4, 500, dtype=torch.bool).scatter(1, seen_ids, True)
    cases = [
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.7, top_p=0.5),
        dict(temperature=1.0, top_p=0.001),  # keeps the single most likely token
        dict(temperature=1.3, top_k=40, top_p=0.8, repetition_penalty=1.2),
        dict(temperature=0.9, top_k=0, top_p=1.0, repetition_penalty=0.8),
    ]
    for case in cases:
        processors = LogitsProcessorList()
        if case.get("repetition_penalty", 1.0) != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
        if case["temperature"] != 1.0:
            processors.append(TemperatureLogitsWarper(case["temperature"]))
        if case.get("top_k"):
            processors.append(TopKLogitsWarper(case["top_k"]))
        if case["top_p"] < 1.0:
            processors.append(TopPLogitsWarper(case["top_p"]))
        expected = torch.softmax(processors(seen_ids, logits.clone()), dim=-1)
        ours = torch.softmax(process_logits(logits, seen=seen, **case), dim=-1)
        assert torch.equal(ours > 0, expected > 0), case
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)


def test_an_export_of_a_hopperlm_run_can_carry_hopperlm_sampling():
    """The generation_config.json fields export writes for a run trained by hopperlm (no Hugging Face base)
    make `generate` on the export sample exactly as on the run: hopperlm's defaults, read back unchanged."""
    read = generation_defaults({"eos_token_id": 256, **sampling_generation_config()})
    assert (read.temperature, read.top_k, read.top_p, read.repetition_penalty) == tuple(
        SAMPLING_DEFAULTS.values()
    )
    assert read.eos_ids == [256] and read.max_new_tokens is None
    greedy = generation_defaults({"eos_token_id": [2, 7], "temperature": 0.6})  # do_sample unset: greedy
    assert greedy.temperature == 0 and greedy.top_k == 50 and greedy.eos_ids == [2, 7]
