"""GSM8K: exact match of the final number a model generates against the reference answer's.

The reference is the number after '####' in the answer; the prediction is the last number in the generated
text (commas dropped, compared as numbers, so 18 == 18.0). Decoding is greedy. Prompts: a model whose
tokenizer has a chat template gets the question (after `shots` worked examples from the train file as earlier
turns) as a user turn; other models get 'Question: ...\nAnswer:' blocks. Generation stops at EOS, at the next
'Question:' or after max_new_tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from hopperlm.data.chat import ChatTemplate, chat_encoder, choose_template
from hopperlm.data.tokenizer import HFTokenizer, Tokenizer
from hopperlm.errors import DataError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
INSTRUCTION = "Solve the problem step by step, then give the final answer after '####'.\n\n"


def reference_answer(answer: str) -> str:
    if "####" not in answer:
        raise DataError("a GSM8K answer without '####'; is this the GSM8K JSONL (question/answer)?")
    return normalize(answer.split("####")[-1].strip())


def normalize(number: str) -> str:
    text = number.replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


def predicted_answer(text: str) -> str | None:
    """The last number of the generated text (after '####' when the model wrote one)."""
    tail = text.split("####")[-1] if "####" in text else text
    found = NUMBER.findall(tail) or NUMBER.findall(text)
    return normalize(found[-1]) if found else None


def read_problems(path: Path) -> list[dict]:
    try:
        rows = [
            json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()
        ]
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read GSM8K problems from {path} ({e})") from None
    if not rows or not {"question", "answer"} <= set(rows[0]):
        raise DataError(f"{path} is not GSM8K JSONL (records with question and answer)")
    return rows


@dataclass
class GSM8KResult:
    correct: int = 0
    total: int = 0
    samples: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    if not isinstance(tokenizer, HFTokenizer) or not tokenizer.config.get("chat_template"):
        return None
    bos = tokenizer.id_to_piece(tokenizer.bos_id) if tokenizer.bos_id is not None else None
    return choose_template("tokenizer", tokenizer.config, tokenizer.id_to_piece(tokenizer.eos_id), bos)


def build_prompt(question: str, shots: list[dict], template: ChatTemplate | None) -> tuple[str, bool]:
    """(prompt text, whether it holds its own special tokens) for one problem."""
    if template is not None:
        messages = []
        for ex in shots:
            messages += [
                {"role": "user", "content": INSTRUCTION + ex["question"]},
                {"role": "assistant", "content": ex["answer"]},
            ]
        messages.append({"role": "user", "content": INSTRUCTION + question})
        return template.render(messages, add_generation_prompt=True), True
    blocks = [f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\n" for ex in shots]
    return "".join(blocks) + f"Question: {question}\nAnswer:", False


def gsm8k_eval(
    model,
    tokenizer: Tokenizer,
    path: Path,
    limit: int | None = None,
    shots: int = 0,
    max_new_tokens: int = 256,
    log=None,
) -> GSM8KResult:
    from hopperlm.model.generate import generate

    problems = read_problems(path)[:limit]
    examples = []
    if shots:
        train = Path(path).with_name("train.jsonl")
        if not train.is_file():
            raise DataError(f"--shots {shots} takes worked examples from {train}, which does not exist")
        examples = read_problems(train)[:shots]
    template = chat_template(tokenizer)
    encoder = chat_encoder(tokenizer) if template is not None else tokenizer
    result = GSM8KResult()
    for i, problem in enumerate(problems):
        prompt, templated = build_prompt(problem["question"], examples, template)
        ids = (encoder if templated else tokenizer).encode(prompt)
        if not templated and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
        out = generate(model, ids, max_new_tokens, temperature=0.0, eos_id=tokenizer.eos_id)
        text = tokenizer.decode(out).split("\nQuestion:")[0]
        ref, pred = reference_answer(problem["answer"]), predicted_answer(text)
        result.total += 1
        result.correct += pred == ref
        if len(result.samples) < 5:
            result.samples.append(
                {"question": problem["question"], "reference": ref, "predicted": pred, "output": text}
            )
        if log is not None and (i + 1) % 50 == 0:
            log(f"gsm8k: {i + 1}/{len(problems)} done, accuracy so far {result.accuracy:.1%}")
    return result
