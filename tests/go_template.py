"""A reader of the part of Go's text/template that `hopperlm export --modelfile` writes into Ollama's TEMPLATE,
for tests: they render the TEMPLATE as Ollama would and compare it with the Jinja chat template's text."""

import json
import re


def go_render(template: str, messages: list[dict]) -> str:
    """The part of Go's text/template (Ollama's TEMPLATE) that `--modelfile` writes, rendered over Ollama's
    .Messages: literal text, `{{ "string" }}`, `{{ .Content }}`, `range $i, $_ := .Messages`, the `$last`
    assignment Ollama's own templates use, if / else if / end on `eq .Role "r"`, `$last`, `not $last`. Any
    other action (whitespace trimming included) fails the test: what it cannot read, Ollama may read otherwise."""
    parts = re.split(r"({{.*?}})", template, flags=re.S)
    tokens = [("action", p[2:-2].strip()) if p.startswith("{{") else ("text", p) for p in parts if p]

    def block(i: int) -> tuple[list, int, str]:
        """Nodes up to the `end` or `else ...` that closes them: (nodes, index after it, closer)."""
        nodes = []
        while i < len(tokens):
            kind, value = tokens[i]
            i += 1
            if kind == "text":
                nodes.append(("text", value))
            elif value in ("end",) or value.startswith("else"):
                return nodes, i, value
            elif value.startswith("if "):
                nodes_i, i = conditional(value[3:], i)
                nodes.append(nodes_i)
            elif value == "range $i, $_ := .Messages":
                body, i, closer = block(i)
                assert closer == "end", closer
                nodes.append(("range", body))
            elif value == "$last := eq (len (slice $.Messages $i)) 1":
                nodes.append(("last",))
            elif value == ".Content":
                nodes.append(("content",))
            elif value.startswith('"'):
                nodes.append(("text", json.loads(value)))
            else:
                raise AssertionError(f"an action this renderer does not know: {{{{ {value} }}}}")
        return nodes, i, ""

    def conditional(condition: str, i: int) -> tuple[tuple, int]:
        body, i, closer = block(i)
        if closer.startswith("else if "):
            other, i = conditional(closer[len("else if ") :], i)
            return ("if", condition, body, [other]), i
        if closer == "else":
            other, i, closer = block(i)
        else:
            other = []
        assert closer == "end", closer
        return ("if", condition, body, other), i

    def holds(condition: str, env: dict) -> bool:
        if condition == "$last":
            return env["last"]
        if condition == "not $last":
            return not env["last"]
        role = re.fullmatch(r'eq \.Role "(\w+)"', condition)
        assert role, f"a condition this renderer does not know: {condition}"
        return env["message"]["role"] == role.group(1)

    def run(nodes: list, env: dict) -> str:
        out = []
        for node in nodes:
            if node[0] == "text":
                out.append(node[1])
            elif node[0] == "content":
                out.append(env["message"]["content"])
            elif node[0] == "last":
                env["last"] = env["i"] == len(messages) - 1
            elif node[0] == "range":
                for i, message in enumerate(messages):
                    out.append(run(node[1], {"i": i, "message": message}))
            else:
                out.append(run(node[2] if holds(node[1], env) else node[3], env))
        return "".join(out)

    nodes, end, closer = block(0)
    assert end == len(tokens) and closer == "", "an unbalanced end"
    return run(nodes, {})
