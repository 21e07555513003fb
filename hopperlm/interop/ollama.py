"""An Ollama `Modelfile` beside an exported GGUF (`export --format gguf --modelfile`): FROM the file, a TEMPLATE
in Ollama's Go-template syntax that renders conversations as the run's chat template does, a `stop` for each
end-of-turn token, and the sampling defaults `hopperlm generate` uses for the run, so `ollama run` chats and
samples as hopperlm does.

The run's template is Jinja (the tokenizer's own or a built-in, data/chat.py) and Go templates are not Jinja,
so the TEMPLATE is not translated from its source: the Jinja template is rendered on probe conversations and
read as text around each message (`Turns`: a head once, then per role a prefix and a suffix around the content,
then the generation prompt), and the Go template is written from those strings. `Turns.render` renders
conversations as the Go template does, and `turns_of` checks it against Jinja on conversations with and
without a system message and with several turns; a template that is not text around each message (llama2's
system prompt inside the first [INST]) is refused in one line, before anything is written. A template that
renders a default system message when there is none (alpaca's preamble) becomes Ollama's SYSTEM, which Ollama
puts first when a conversation has none.

Ollama (as llama.cpp) adds BOS itself when the GGUF says to, so a BOS the template renders first is left out
of the head. A last assistant message is left open (no suffix), as in Ollama's own templates: Ollama
continues it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hopperlm.checkpoint.layout import TOKENIZER_DIR
from hopperlm.config import ModelConfig
from hopperlm.data.chat import ChatTemplate, choose_template
from hopperlm.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from hopperlm.errors import ConfigError, DataError
from hopperlm.interop.hf_convert import sampling_defaults

MODELFILE = "Modelfile"
ROLES = ("system", "user", "assistant")
# probe contents: no whitespace (a template may trim) and nothing a template would escape
_MARK = {"system": "SYSMARKq7", "user": "USRMARKq7", "assistant": "ASTMARKq7", "user2": "USRMARKz9"}


@dataclass(frozen=True)
class Turns:
    """A chat template as the text around each message: what Ollama's TEMPLATE says."""

    head: str
    """Once, before the first message (a BOS the tokenizer adds itself left out)."""
    prefix: dict[str, str]
    """Role -> the text before its content."""
    suffix: dict[str, str]
    """Role -> the text after its content (a last assistant message has none: it is continued)."""
    generation: str
    """After a last message that is not the assistant's: the start of the reply."""
    default_system: str | None = None
    """The system message the template renders when a conversation has none (Ollama's SYSTEM)."""

    def render(self, messages: list[dict]) -> str:
        """The conversation as the Go template below renders it (with the SYSTEM Ollama puts first)."""
        if self.default_system is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.default_system}, *messages]
        out = [self.head]
        for i, m in enumerate(messages):
            last = i == len(messages) - 1
            out.append(self.prefix[m["role"]] + m["content"])
            if not (last and m["role"] == "assistant"):
                out.append(self.suffix[m["role"]])
            if last and m["role"] != "assistant":
                out.append(self.generation)
        return "".join(out)

    def go_template(self) -> str:
        """Ollama's TEMPLATE: actions without whitespace trimming ({{- -}}) between the literals, so each
        literal is exactly the string Jinja rendered, newlines included."""

        def lit(text: str) -> str:  # a literal that could open an action or close the Modelfile's """ quoted
            return (
                json.dumps(text, ensure_ascii=False).join(("{{ ", " }}"))
                if "{{" in text or '"' in text
                else text
            )

        branches = []
        for keyword, role in zip(("if", "else if", "else if"), ROLES, strict=True):
            branch = f'{{{{ {keyword} eq .Role "{role}" }}}}{lit(self.prefix[role])}{{{{ .Content }}}}'
            if role == "assistant":
                branch += f"{{{{ if not $last }}}}{lit(self.suffix[role])}{{{{ end }}}}"
            else:
                branch += lit(self.suffix[role])
                if self.generation:
                    branch += f"{{{{ if $last }}}}{lit(self.generation)}{{{{ end }}}}"
            branches.append(branch)
        return (
            f"{lit(self.head)}{{{{ range $i, $_ := .Messages }}}}"
            "{{ $last := eq (len (slice $.Messages $i)) 1 }}" + "".join(branches) + "{{ end }}{{ end }}"
        )

    def stops(self, eos: list[str]) -> list[str]:
        """EOS, the text before it that ends an assistant turn (ChatML's <|im_end|>), and the markers that start
        another turn (a model that forgets to end its reply goes on with the next user turn)."""
        found = list(eos)
        end_of_turn = self.suffix["assistant"]
        for token in eos:
            end_of_turn = end_of_turn.split(token)[0] if token else end_of_turn
        found += [end_of_turn.strip(), self.prefix["user"].strip(), self.prefix["system"].strip()]
        return list(dict.fromkeys(t for t in found if t))


def turns_of(template: ChatTemplate, bos_added: str | None) -> Turns:
    """The template read as text around each message, checked against Jinja; `bos_added`: the BOS the
    tokenizer adds itself (the GGUF's add_bos_token), left out of the head."""
    u, a, u2, s = _MARK["user"], _MARK["assistant"], _MARK["user2"], _MARK["system"]

    def say(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    def render(messages: list[dict], generation: bool = False) -> str:
        try:
            return template.render(messages, add_generation_prompt=generation)
        except DataError as e:
            raise _inexpressible(template, f"it refuses a probe conversation ({e})") from None

    t_u, t_ua = render([say("user", u)]), render([say("user", u), say("assistant", a)])
    t_uau = render([say("user", u), say("assistant", a), say("user", u2)])
    t_uau_g = render([say("user", u), say("assistant", a), say("user", u2)], generation=True)
    t_sua = render([say("system", s), say("user", u), say("assistant", a)])
    try:
        suffix_u = _after(t_u, u)
        prefix_a = _strip_start(_between(t_ua, u, a), suffix_u)
        suffix_a = _after(t_ua, a)
        prefix_u = _strip_start(_between(t_uau, a, u2), suffix_a)
        generation = _strip_start(t_uau_g, t_uau)
        lead = _strip_end(_before(t_u, u), prefix_u)
        before_s = _before(t_sua, s)
        suffix_s = _strip_end(_between(t_sua, s, u), prefix_u)
    except ValueError as e:
        raise _inexpressible(template, str(e)) from None
    if before_s.startswith(lead):
        head, prefix_s, default = lead, before_s[len(lead) :], None
    elif lead.startswith(before_s) and lead.endswith(suffix_s) and len(lead) >= len(before_s) + len(suffix_s):
        head, prefix_s, default = before_s, "", lead[len(before_s) : len(lead) - len(suffix_s)]
    else:
        raise _inexpressible(template, "its system message is not text around the message")
    if bos_added and head.startswith(bos_added):
        head = head[len(bos_added) :]
    turns = Turns(
        head=head,
        prefix={"system": prefix_s, "user": prefix_u, "assistant": prefix_a},
        suffix={"system": suffix_s, "user": suffix_u, "assistant": suffix_a},
        generation=generation,
        default_system=default,
    )
    _check(turns, template, bos_added)
    return turns


def _check(turns: Turns, template: ChatTemplate, bos_added: str | None) -> None:
    """Turns.render against Jinja: equal for conversations ending in a user turn (with the generation prompt),
    and the Jinja text less the last assistant's suffix for those ending in a reply."""
    convs = [
        ["user", "assistant", "user"],
        ["system", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"],
        ["user", "assistant", "user", "assistant"],
        ["system", "user", "assistant"],
    ]
    for roles in convs:
        messages = [{"role": r, "content": f"{r} {i}: hello,\nworld"} for i, r in enumerate(roles)]
        ends_open = roles[-1] == "assistant"
        want = template.render(messages, add_generation_prompt=not ends_open)
        if bos_added and want.startswith(bos_added):
            want = want[len(bos_added) :]
        if ends_open:
            want = want.removesuffix(turns.suffix["assistant"])
        if turns.render(messages) != want:
            raise _inexpressible(template, f"a {'/'.join(roles)} conversation renders differently")


def _inexpressible(template: ChatTemplate, why: str) -> ConfigError:
    return ConfigError(
        f"--modelfile: the chat template ({template.name}) cannot be written as Ollama's TEMPLATE of text "
        f"around each message: {why}; export without --modelfile and write the TEMPLATE by hand"
    )


def _before(text: str, mark: str) -> str:
    if text.count(mark) != 1:
        raise ValueError(f"it renders a message {text.count(mark)} times")
    return text.split(mark)[0]


def _after(text: str, mark: str) -> str:
    _before(text, mark)
    return text.split(mark)[1]


def _between(text: str, first: str, second: str) -> str:
    after = _after(text, first)
    return _before(after, second)


def _strip_start(text: str, start: str) -> str:
    if not text.startswith(start):
        raise ValueError("a message's text depends on the message after it")
    return text[len(start) :]


def _strip_end(text: str, end: str) -> str:
    if not text.endswith(end):
        raise ValueError("the first user message is wrapped differently from the others")
    return text[: len(text) - len(end)]


def run_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template `hopperlm generate --chat` renders with (the run's tokenizer_config.json), or None."""
    if not isinstance(tokenizer, HFTokenizer) or not tokenizer.config.get("chat_template"):
        return None
    bos = tokenizer.id_to_piece(tokenizer.bos_id) if tokenizer.bos_id is not None else None
    return choose_template("tokenizer", tokenizer.config, tokenizer.id_to_piece(tokenizer.eos_id), bos)


def modelfile_text(
    model_dir: Path,
    cfg: ModelConfig,
    gguf_name: str,
    *,
    source: Path,
    bos_added: bool,
    quantize: str | None = None,
    log=print,
) -> str:
    """The Modelfile for `gguf_name` (a file beside it) from the model in `model_dir` (what the user named:
    `source`); raises before anything is written when its chat template cannot be said in Ollama's TEMPLATE.
    `quantize`: the type `ollama create -q` makes from the file (an f16 GGUF written for Ollama to quantize)."""
    tokenizer = load_tokenizer(model_dir / TOKENIZER_DIR)
    template = run_chat_template(tokenizer)
    settings = sampling_defaults(model_dir)
    eos_ids = settings["eos_ids"]
    eos = [tokenizer.id_to_piece(i) for i in (eos_ids or [tokenizer.eos_id])]
    bos = tokenizer.id_to_piece(tokenizer.bos_id) if bos_added and tokenizer.bos_id is not None else None
    lines = [
        f"# Ollama Modelfile written by `hopperlm export --modelfile` from {source}:",
        f"#   ollama create NAME{f' -q {quantize}' if quantize else ''} -f {MODELFILE} && ollama run NAME",
        f"FROM ./{gguf_name}",
    ]
    stops = [t for t in eos if t]
    if template is None:
        log(
            "modelfile: the run's tokenizer has no chat template (a pretraining run): no TEMPLATE, so Ollama "
            "passes the prompt as it is, as `hopperlm generate` does"
        )
    else:
        turns = turns_of(template, bos)
        lines.append(f"# TEMPLATE: the run's chat template ({template.name}) as text around each message")
        lines.append(f'TEMPLATE """{turns.go_template()}"""')
        if turns.default_system is not None:
            lines.append(f'SYSTEM """{turns.default_system}"""')
        stops = turns.stops(stops)
    lines.append("# sampling as `hopperlm generate` samples this run with no flags (temperature 0 = greedy)")
    lines += [
        f"PARAMETER temperature {settings['temperature']:g}",
        f"PARAMETER top_k {settings['top_k']}",  # 0 = off, in both
        f"PARAMETER top_p {settings['top_p']:g}",
        "PARAMETER min_p 0",
        f"PARAMETER repeat_penalty {settings['repetition_penalty']:g}",
        "PARAMETER repeat_last_n -1",  # the whole context, as transformers' penalty counts every earlier id
        f"PARAMETER num_ctx {cfg.max_seq_len}",  # the context the model was trained for
    ]
    if settings["max_new_tokens"] is not None:
        lines.append(f"PARAMETER num_predict {settings['max_new_tokens']}")
    lines += [f"PARAMETER stop {json.dumps(stop, ensure_ascii=False)}" for stop in stops]
    return "\n".join(lines) + "\n"
