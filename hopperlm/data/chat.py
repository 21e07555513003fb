"""Chat templates: conversations -> text, and which characters of that text are the assistant's replies.

A template is a Jinja string rendered like `transformers`' `apply_chat_template` (sandboxed environment,
trim_blocks, lstrip_blocks, `raise_exception`, the tokenizer's special tokens as variables), so training text
and inference text are the same string. The tokenizer's own template (tokenizer_config.json `chat_template`)
is used when it has one, exactly as transformers renders and encodes it (nothing added); otherwise a built-in
below, which is then written into the run's tokenizer_config.json so `transformers` and `hopperlm generate
--chat` render it the same way. A built-in starts the text the way the tokenizer's own `tokenizer(text)` starts
it (`{{ bos_token }}` first for Llama tokenizers: the base saw BOS before every document), unless it renders
that itself (alpaca, plain and llama2 do), so BOS is never doubled.

Reply spans come from rendering prefixes: the reply k is what render(messages[:k+1]) adds to
render(messages[:k], add_generation_prompt=True), up to and including its end-of-sequence token (nothing
after it: generation stops there). Templates whose prefixes are not prefixes of the whole are refused.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from hopperlm.data.tokenizer import HFTokenizer
from hopperlm.errors import ConfigError, DataError

# Each assistant turn ends with eos_token: generation stops at EOS, so the model must learn to emit it.
BUILTIN = {
    # TinyLlama-1.1B-Chat / Zephyr
    "zephyr": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
    # Llama-2-chat: [INST] user [/INST] reply </s>, system prompt inside the first [INST]
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}{% if message['role'] == 'user' %}"
        "{% set content = ('<<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content']) "
        "if loop.first and system else message['content'] %}"
        "{{ bos_token + '[INST] ' + content + ' [/INST]' }}"
        "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
    # ChatML; the reply's end is <|im_end|> and then EOS unless <|im_end|> is the EOS itself
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
        "{% if message['role'] == 'assistant' and eos_token != '<|im_end|>' %}{{ eos_token }}{% endif %}{{ '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Stanford Alpaca's prompt, one block per exchange
    "alpaca": (
        "{% if messages[0]['role'] == 'system' %}{% set preamble = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set preamble = 'Below is an instruction that describes a "
        "task. Write a response that appropriately completes the request.' %}{% endif %}{{ bos_token }}"
        "{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ (preamble + '\n\n' if loop.first else '') + '### Instruction:\n' + message['content'] + '\n\n' }}"
        "{% if loop.last and add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
        "{% else %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}{% endif %}{% endfor %}"
    ),
    # no markers: the prompt, a newline, the reply
    "plain": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token }}{% else %}{{ message['content'] + '\n' }}{% endif %}{% endfor %}"
    ),
}
DEFAULT_BUILTIN = "zephyr"


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} marker: rendered as its body (spans come from prefixes here)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ConfigError(
            f"the chat template does not parse ({e}); fix it or choose a built-in with sft.template"
        ) from None


class ChatTemplate:
    """A Jinja chat template with the tokenizer's special tokens bound."""

    def __init__(self, source: str, name: str, special: dict[str, str]) -> None:
        self.source, self.name, self.special = source, name, special
        self._template = _compile(source)
        self.eos = special.get("eos_token", "")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.TemplateError as e:
            raise DataError(f"chat template {self.name} refused a conversation: {e}") from None

    def reply_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the whole text, [(start, end) of every assistant reply, EOS included, in characters])."""
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[: k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"chat template {self.name} renders a conversation's prefix differently from the whole, so "
                    "replies cannot be located; choose a built-in with sft.template"
                )
            end = len(through)
            if self.eos:
                cut = through.rfind(self.eos, len(before))
                if cut >= 0:
                    end = cut + len(self.eos)  # nothing after EOS is learned: inference stops there
            spans.append((len(before), end))
        return text, spans


def chat_encoder(tokenizer: HFTokenizer) -> HFTokenizer:
    """The tokenizer that encodes rendered chat text the way `transformers` (5.x) does at inference
    (`HFTokenizer.as_served`: '▁' only at the very start, not after every special token); a tokenizer that is
    not a tokenizer.json is returned as it is."""
    return tokenizer.as_served() if isinstance(tokenizer, HFTokenizer) else tokenizer


def special_tokens(tokenizer_config: dict, eos: str, bos: str | None) -> dict[str, str]:
    """The *_token variables templates read, from tokenizer_config.json (strings or AddedToken dicts)."""
    out = {}
    for key, value in tokenizer_config.items():
        if key.endswith("_token"):
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    out.setdefault("eos_token", eos)
    out.setdefault("bos_token", bos or "")
    return out


def choose_template(
    name: str, tokenizer_config: dict, eos: str, bos: str | None, *, prefix: str = ""
) -> ChatTemplate:
    """sft.template -> the template: the tokenizer's own ('tokenizer', or 'auto' when it has one) or a
    built-in ('auto' without one: zephyr). `prefix`: the special tokens the tokenizer's `tokenizer(text)` puts
    first (e.g. "<s>"); a built-in that does not render them itself gets them in front."""
    own = tokenizer_config.get("chat_template")
    if isinstance(own, list):  # several named templates: the default one
        own = next((t["template"] for t in own if t.get("name") == "default"), None)
    special = special_tokens(tokenizer_config, eos, bos)
    if name == "tokenizer" or (name == "auto" and own):
        if not own:
            raise ConfigError(
                "sft.template=tokenizer but the tokenizer has no chat_template; choose a built-in"
            )
        return ChatTemplate(own, "tokenizer's own", special)
    name = DEFAULT_BUILTIN if name == "auto" else name
    if name not in BUILTIN:
        raise ConfigError(
            f"sft.template={name} is unknown; choose auto, tokenizer or one of {', '.join(BUILTIN)}"
        )
    template = ChatTemplate(BUILTIN[name], name, special)
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    if not prefix or template.render(probe).startswith(prefix):
        return template
    lead = "{{ bos_token }}" if prefix == special["bos_token"] else "{{ " + json.dumps(prefix) + " }}"
    return ChatTemplate(lead + BUILTIN[name], name, special)
