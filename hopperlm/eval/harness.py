"""Standard benchmarks through EleutherAI's lm-evaluation-harness (`lm-eval`, the optional `.[eval]` extra):
`HopperLM` implements lm-eval's model interface over a hopperlm model and tokenizer, so every lm-eval task runs
on a run, a checkpoint, an export or a Hugging Face folder, a LoRA run with its adapters unmerged, on CPU or GPU.

It scores what `lm_eval --model hf` scores on the same model (tests/test_harness.py compares the two on an
export): the same tokenization (the tokenizer's own BOS, as transformers adds it, and none added again when the
text already starts with it: lm-evaluation-harness #3333), contexts left-truncated to the model's context, the
continuation's log-probabilities summed in fp32, rolling windows cut as lm-eval cuts them, greedy generation
stopped at the task's stop strings or EOS. Requests are sorted longest first and scored in batches (padding
on the right changes nothing before it in a causal model); generation runs one prompt at a time with the KV
cache (no left padding, so its tokens are exactly the unbatched ones).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from hopperlm.data.tokenizer import Tokenizer
from hopperlm.errors import ConfigError, DataError, first_line
from hopperlm.model.generate import generate

INSTALL = "pip install 'hopperlm[eval]' (lm-evaluation-harness)"
# lm-eval's seeds (few-shot examples, sampling), fixed so that two evaluations draw the same prompts
FIXED_SEEDS = dict(random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def require_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(f"--tasks runs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return lm_eval


def _template_lm():
    from lm_eval.api.model import TemplateLM

    return TemplateLM


class Codec:
    """Text <-> ids as lm-eval's `hf` model does it. A tokenizer with a tokenizer.json is run by transformers'
    AutoTokenizer, exactly the object `lm_eval --model hf` uses (its special tokens and its handling of a
    leading space, which hopperlm's own reading of tokenizer.json does not always reproduce); hopperlm's byte
    tokenizer, which transformers has no class for, is run as it is."""

    def __init__(self, tokenizer: Tokenizer, folder: Path | None) -> None:
        self.hf = None
        if folder is not None and (Path(folder) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.ours = tokenizer
        eos = self.hf.eos_token_id if self.hf is not None else tokenizer.eos_id
        bos = self.hf.bos_token_id if self.hf is not None else tokenizer.bos_id
        self.eos, self.bos = eos, bos

    def encode(self, text: str, specials: bool) -> list[int]:
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=specials)
        return self.ours.encode_for_model(text) if specials else self.ours.encode(text)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=skip_special)
        drop = {self.eos, self.bos} if skip_special else set()
        return self.ours.decode([i for i in ids if i not in drop])


def build_adapter(
    model,
    tokenizer: Tokenizer,
    *,
    tokenizer_folder: Path | None = None,
    batch_size: int = 8,
    autocast: torch.dtype | None = None,
):
    """A `HopperLM` over the model, as an lm-eval TemplateLM (lm-eval is imported here, when a task runs)."""
    require_lm_eval()
    codec = Codec(tokenizer, tokenizer_folder)
    return _adapter_class()(model, codec, batch_size=batch_size, autocast=autocast)


@functools.cache
def _adapter_class() -> type:
    """HopperLM with lm-eval's TemplateLM as its base: what lm-eval's `simple_evaluate` takes as a model."""
    return type("HopperLM", (HopperLM, _template_lm()), {"__module__": __name__, "__doc__": HopperLM.__doc__})


class HopperLM:
    """lm-eval's model interface (TemplateLM's methods) over a hopperlm model and its tokenizer's Codec.
    `build_adapter` gives it lm-eval's TemplateLM as a base when a task runs, so that importing this module
    does not import lm-eval (an optional extra)."""

    backend = "causal"

    def __init__(
        self, model, codec: Codec, *, batch_size: int = 8, autocast: torch.dtype | None = None
    ) -> None:
        super().__init__()  # TemplateLM's, once build_adapter has made it a base
        self.model, self.codec = model.eval(), codec
        self.batch_size, self.autocast = batch_size, autocast
        self._device = model.embed.weight.device

    # ---- what lm-eval asks of a model -----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.codec.eos

    @property
    def prefix_token_id(self) -> int:
        """An empty context is this one token: BOS when the tokenizer has one, else EOS (as HFLM)."""
        return self.codec.bos if self.codec.bos is not None else self.codec.eos

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's own special tokens unless told otherwise, and none when the text already starts
        with the BOS text (a few-shot prompt that carries its own BOS is not given a second one)."""
        specials = True if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(
            self.codec.decode([self.prefix_token_id], skip_special=False)
        ):
            specials = False
        ids = self.codec.encode(string, specials)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)

    # ---- scoring -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows, conts = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ConfigError("lm-eval asked to score an empty continuation")
                rows.append((context + continuation)[-(self.max_length + 1) :][:-1])
                conts.append(continuation)
            width = max(len(r) for r in rows)
            batch = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for j, r in enumerate(rows):
                batch[j, : len(r)] = torch.tensor(r)
            with torch.autocast(self._device.type, self.autocast, enabled=self.autocast is not None):
                logits = self.model(batch.to(self._device))
            for j, i in enumerate(chunk):
                n, end = len(conts[j]), len(rows[j])
                # only the positions that predict the continuation, in fp32 (not the whole batch's logits)
                lp = F.log_softmax(logits[j, end - n : end].float(), dim=-1)
                want = torch.tensor(conts[j], device=lp.device)
                greedy = bool((lp.argmax(-1) == want).all())
                out[i] = (float(lp.gather(1, want[:, None]).sum()), greedy)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Every token of each text scored once, in windows of the model's context, as lm-eval cuts them."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task asks) continuation of each prompt, cut at the first stop
        string; one prompt at a time with the KV cache."""
        from lm_eval.models.utils import (
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        results = []
        eos_text = self.codec.decode([self.eot_token_id], skip_special=False)
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, 256)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise ConfigError(
                    f"the task asks for {max_new} new tokens, as many as the model's whole context "
                    f"({self.max_length}); lower its generation_kwargs max_gen_toks"
                )
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_new)

            def stop(new_ids: list[int], until=until) -> bool:
                text = self.tok_decode(new_ids)
                return any(term and term in text for term in until)

            with torch.autocast(self._device.type, self.autocast, enabled=self.autocast is not None):
                new = generate(
                    self.model,
                    prompt,
                    max_new,
                    temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                    eos_id=self.eot_token_id,
                    seed=0,
                    stop=stop,
                )
            text = self.tok_decode(new)
            results.append(postprocess_generated_text(text, until, None))
        return results


def run_tasks(
    model,
    tokenizer: Tokenizer,
    tasks: list[str],
    *,
    tokenizer_folder: Path | None = None,
    batch_size: int = 8,
    autocast: torch.dtype | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    include_path: str | None = None,
    log_samples: bool = False,
    manager=None,
) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` on the model (through a HopperLM): its results dict (lm-eval's
    metric names). What `hopperlm eval --tasks` and the eval section during training both call; `manager`:
    task_manager's answer for these tasks, when the caller has one."""
    lm_eval = require_lm_eval()
    manager = manager or task_manager(tasks, include_path)
    adapter = build_adapter(
        model, tokenizer, tokenizer_folder=tokenizer_folder, batch_size=batch_size, autocast=autocast
    )
    try:
        return lm_eval.simple_evaluate(
            model=adapter,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
            bootstrap_iters=0,
            **FIXED_SEEDS,
        )
    except ConnectionError as e:  # a task's dataset not cached and the Hub out of reach (datasets' own error)
        raise ConfigError(
            f"tasks {','.join(tasks)}: a task's dataset is not in the local cache and cannot be downloaded "
            f"({first_line(e)}); run once where the Hub is reachable (the cache: HF_DATASETS_CACHE), or use "
            "local tasks (--include-path DIR of task YAMLs)"
        ) from None
    except FileNotFoundError as e:  # a local task's data file (datasets: "Unable to find '...'")
        raise DataError(
            f"tasks {','.join(tasks)}: a task's data file is missing ({first_line(e)}); a task YAML's "
            "data_files are read from the folder `hopperlm eval` runs in: run it where they are, or fix the path "
            "in the task's YAML"
        ) from None


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's index of the tasks to run, after checking every task is in it: an unknown one is a one-line
    ConfigError. When `include_path` holds every task, only that folder is indexed: lm-eval's own index parses
    its ~14,000 task YAMLs (about 10 s on 2 cores), time a local-only evaluation would spend for nothing."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        # some are lm-eval's own (or unknown): the full index
        if not all(t in manager.all_tasks for t in tasks):
            manager = TaskManager(include_path=include_path)
    else:
        manager = TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = (
            f" or in {include_path}" if include_path else " (local tasks: --include-path DIR of task YAMLs)"
        )
        raise ConfigError(f"tasks {','.join(unknown)}: no such lm-eval task{where}")
    return manager


def metrics_of(results: dict) -> dict[str, float]:
    """{task/metric: value} of a results dict (lm-eval's names, filters dropped when `none`)."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if key == "alias" or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}({filt})"
            out[f"{task}/{name}"] = float(value)
    return out
