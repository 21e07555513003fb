"""How far one parameter travels through hopperlm's code: a static count of where following it stops.

    python scripts/walk_param.py hopperlm/train/loop.py:train:cfg [--list] [--json] [--root DIR]
    python scripts/walk_param.py --takers Config [--root DIR]   the functions with a parameter annotated Config

Nothing of the project is imported or run. Every .py file under the package folder (hopperlm/, or --root DIR)
is parsed with the standard library's `ast`; folders named tests/ or test/, test_*.py and conftest.py are
skipped, and a file that does not parse is skipped with a note on stderr. FUNCTION may be `Class.method`.

How it counts
-------------
Index. Functions and methods are known by (file, qualified name): `func`, `Class.method`. A function nested
in a function is not indexed: its body is walked as part of its parent's (so are lambdas and comprehensions).

Callee. A call is resolved to one indexed function when it is
  * `name(...)`: a function defined in the same file, or imported by `from PKG.x import name` (relative
    imports too, and names a package's __init__.py hands on; imports inside functions count);
  * `mod.name(...)`: `mod` bound by `import PKG.x as mod` or `from PKG import x`;
  * `self.m(...)` / `cls.m(...)` in a class: `m` of that class or of a project base class; `super().m(...)`:
    `m` of a base class;
  * `Class(...)` (and `cls(...)` in a class): `Class.__init__`, its own or inherited from a project base
    class (none: not followed); `Class.m(...)`: that method, unbound;
  * `obj.m(...)`: the method `m` when exactly one class in the project defines it. When several do, the
    call is skipped and counted as unresolved. A name that dict, list or set also has (`get`, `add`,
    `update`, ...) is taken for theirs here. Other calls (standard library, torch, ...) are not followed.

Tracking. The walk enters the start function with {PARAM} tracked and visits its statements in source order,
every branch of if/try/match and every loop body once. An expression *mentions* a tracked name when a name or
an attribute chain in it is tracked: `cfg`, `cfg.train`, `cfg["x"]`, `f(cfg)`, `[c for c in cfg.x]` all do.
A target assigned from an expression that mentions one becomes tracked: `x = ...`, `a, b = ...`, `x += ...`,
`x: T = ...`, `for x in ...`, `with ... as x`, `(x := ...)`, comprehension targets, `d[k] = ...` (tracks
`d`), and `self.x = ...`; the last also makes `self.x` tracked in every method of that class (or of a
subclass) that the walk enters afterwards.

Calls. The calls of a statement are taken in source position order. A call carries the parameter when one
of its positional or keyword arguments, or its receiver (`obj` in `obj.m(...)`, which becomes the method's
`self`), mentions a tracked name. Its callee is then entered depth-first with the parameters it receives
tracked: positional by index (after `self`/`cls` for a bound call), keywords by name, extras into *args and
**kwargs. A `self.m(...)` call also carries it when `m`'s body mentions a tracked `self.x`. A call that
maps to no parameter is not entered. Each function is entered at most once: a later call to a function
already entered is counted as a call, not as an entry. The walk ends after 1600 entries.

Result. The entries, in order, are the event list (a call to a function already entered is no event).
A STOP is a maximal run of consecutive entries in one file; a RETURN is a stop in a file that had an
earlier stop, so R = N - M. The summary line is `N stops in M files; R returns (P%)` with P = 100 * R / N;
--list adds one line per stop (index, file, the functions entered there, `return`); --json prints all of
it, the stops included, as one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

MAX_ENTRIES = 1600
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / "hopperlm"
Key = tuple[str, str]  # (dotted module, qualified name)
# `obj.get(...)`, `obj.add(...)`: taken for dict/list/set methods, never resolved by the one-definer rule
BUILTIN_METHODS = {n for t in (dict, list, set) for n in dir(t) if not n.startswith("_")}


@dataclass
class Module:
    rel: str  # shown path, relative to the package's parent: hopperlm/train/loop.py
    name: str  # dotted: hopperlm.train.loop
    tree: ast.Module
    is_pkg: bool
    funcs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)
    mods: dict[str, str] = field(default_factory=dict)  # local (dotted) name -> module


@dataclass
class Ctx:  # the function being walked
    mod: Module
    cls: Key | None
    self_name: str | None
    tracked: set[str]


def dotted(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return node.id if isinstance(node, ast.Name) else None


def decorated(fn: ast.AST, name: str) -> bool:
    return any(dotted(d) == name for d in getattr(fn, "decorator_list", []))


class Project:
    def __init__(self, root: Path):
        self.root, self.pkg, self.notes = root, root.name, []
        self.modules: dict[str, Module] = {}
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).parts
            skip = {"tests", "test"} & set(parts[:-1]) or path.name.startswith("test_")
            if skip or path.name == "conftest.py":
                continue
            rel = "/".join((self.pkg, *parts))
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except (SyntaxError, ValueError, UnicodeDecodeError, OSError) as e:
                self.notes.append(f"skipped {rel}: {type(e).__name__}: {e}")
                continue
            is_pkg = path.stem == "__init__"
            name = ".".join((self.pkg, *parts[:-1], *([] if is_pkg else [path.stem])))
            self.modules[name] = m = Module(rel, name, tree, is_pkg)
            self._index(m, tree.body, "")
        self.methods: dict[str, list[Key]] = defaultdict(list)  # method name -> its definitions
        for m in self.modules.values():
            self._imports(m)
            for qual in m.funcs:
                owner, _, meth = qual.rpartition(".")
                if owner in m.classes:
                    self.methods[meth].append((m.name, qual))

    def _index(self, m: Module, body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m.funcs[prefix + node.name] = node
            elif isinstance(node, ast.ClassDef):
                m.classes[prefix + node.name] = node
                self._index(m, node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.If, ast.Try)) and not prefix:  # TYPE_CHECKING, try/except ImportError
                for part in (node.body, node.orelse, getattr(node, "finalbody", [])):
                    self._index(m, part, prefix)

    def _imports(self, m: Module) -> None:
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in self.modules:
                        m.mods[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = m.name.split(".")[: None if m.is_pkg else -1]
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base != self.pkg and not base.startswith(self.pkg + "."):
                    continue
                for a in node.names:
                    if f"{base}.{a.name}" in self.modules:
                        m.mods[a.asname or a.name] = f"{base}.{a.name}"
                    else:
                        m.names[a.asname or a.name] = (base, a.name)

    def lookup(self, mod: str, name: str, depth: int = 0) -> tuple[str, Key] | None:
        """('func' | 'class', key) for `name` as seen in module `mod`, through re-exports."""
        m = self.modules.get(mod)
        if m is None or depth > 10:
            return None
        if name in m.funcs:
            return "func", (mod, name)
        if name in m.classes:
            return "class", (mod, name)
        return self.lookup(*m.names[name], depth + 1) if name in m.names else None

    def lineage(self, cls: Key, seen: set[Key] | None = None) -> list[Key]:
        """The class and its project base classes, depth first."""
        seen, m = seen if seen is not None else set(), self.modules[cls[0]]
        if cls in seen:
            return []
        seen.add(cls)
        out = [cls]
        for d in (dotted(b) or "" for b in m.classes[cls[1]].bases):
            head, _, last = d.rpartition(".")
            found = self.lookup(m.mods[head], last) if head in m.mods else self.lookup(m.name, d)
            out += self.lineage(found[1], seen) if found and found[0] == "class" else []
        return out

    def method(self, cls: Key, name: str, skip_own: bool = False) -> Key | None:
        for c in self.lineage(cls)[1 if skip_own else 0 :]:
            if f"{c[1]}.{name}" in self.modules[c[0]].funcs:
                return c[0], f"{c[1]}.{name}"
        return None


class Walk:
    def __init__(self, project: Project, max_entries: int = MAX_ENTRIES):
        self.p, self.max_entries = project, max_entries
        self.entries: list[Key] = []
        self.entered: set[Key] = set()
        self.class_attrs: dict[Key, set[str]] = defaultdict(set)
        self.calls = self.repeats = 0
        self.unresolved: list[str] = []

    def enter(self, key: Key, tracked: set[str]) -> None:
        if key in self.entered or len(self.entries) >= self.max_entries:
            self.repeats += key in self.entered
            return
        self.entered.add(key)
        self.entries.append(key)
        m = self.p.modules[key[0]]
        fn = m.funcs[key[1]]
        owner = key[1].rpartition(".")[0]
        cls = (m.name, owner) if owner in m.classes else None
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        self_name = args[0] if cls and args and not decorated(fn, "staticmethod") else None
        ctx = Ctx(m, cls, self_name, set(tracked))
        if cls and self_name:
            ctx.tracked |= {f"{self_name}.{a}" for c in self.p.lineage(cls) for a in self.class_attrs[c]}
        self.block(ctx, fn.body)

    def block(self, ctx: Ctx, body: list[ast.stmt]) -> None:
        for st in body:
            self.stmt(ctx, st)

    def stmt(self, ctx: Ctx, st: ast.stmt) -> None:
        heads, subs = [], []
        for _, value in ast.iter_fields(st):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case)):
                    subs.append(v)
                elif isinstance(v, ast.AST):
                    heads.append(v)
        self.calls_in(ctx, heads)
        if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in getattr(st, "targets", None) or [st.target]:
                self.bind(ctx, t, st.value)
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            self.bind(ctx, st.target, st.iter)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                self.bind(ctx, item.optional_vars, item.context_expr)
        for s in subs:
            if isinstance(s, ast.stmt):
                self.stmt(ctx, s)
            else:  # an except clause or a match case
                self.calls_in(ctx, [n for n in (getattr(s, "type", None), getattr(s, "guard", None)) if n])
                self.block(ctx, s.body)

    def mentions(self, ctx: Ctx, expr: ast.AST | None) -> bool:
        return expr is not None and any(
            isinstance(n, (ast.Name, ast.Attribute)) and dotted(n) in ctx.tracked for n in ast.walk(expr)
        )

    def bind(self, ctx: Ctx, target: ast.AST | None, value: ast.AST | None) -> None:
        if target is None or not self.mentions(ctx, value):
            return
        for t in ast.walk(target):
            if not isinstance(getattr(t, "ctx", None), ast.Store):
                continue
            d = dotted(t.value if isinstance(t, ast.Subscript) else t)
            if d:
                ctx.tracked.add(d)
            if isinstance(t, ast.Attribute) and ctx.cls and ctx.self_name == dotted(t.value) is not None:
                self.class_attrs[ctx.cls].add(t.attr)  # self.x = ...: tracked in the class's later methods

    def calls_in(self, ctx: Ctx, nodes: list[ast.AST]) -> None:
        found = []
        for node in nodes:
            for n in ast.walk(node):
                if isinstance(n, ast.NamedExpr):
                    self.bind(ctx, n.target, n.value)
                elif isinstance(n, ast.comprehension):
                    self.bind(ctx, n.target, n.iter)
                elif isinstance(n, ast.Call):
                    found.append(n)
        for call in sorted(found, key=lambda c: (c.lineno, c.col_offset)):
            if len(self.entries) < self.max_entries:
                self.call(ctx, call)

    def resolve(self, ctx: Ctx, func: ast.expr) -> tuple[Key, bool, ast.expr | None] | str | None:
        """(callee, bound: its first parameter takes the receiver, receiver), 'ambiguous', or None."""
        m, p, d = ctx.mod, self.p, dotted(getattr(func, "value", None))
        if isinstance(func, ast.Name) or d in m.mods:
            name = func.id if isinstance(func, ast.Name) else func.attr
            is_cls = isinstance(func, ast.Name) and name == "cls" and ctx.cls
            found = ("class", ctx.cls) if is_cls else p.lookup(m.mods.get(d, m.name), name)
            if found and found[0] == "func":
                return found[1], False, None
            init = p.method(found[1], "__init__") if found else None  # Class(...) runs Class.__init__
            return (init, True, None) if init else None
        if not isinstance(func, ast.Attribute):
            return None
        recv, name = func.value, func.attr
        if ctx.cls and ctx.self_name and d == ctx.self_name and (key := p.method(ctx.cls, name)):
            return key, not decorated(p.modules[key[0]].funcs[key[1]], "staticmethod"), recv
        if ctx.cls and isinstance(recv, ast.Call) and dotted(recv.func) == "super":
            key = p.method(ctx.cls, name, skip_own=True)
            return (key, True, ast.Name(id=ctx.self_name or "self")) if key else None
        found = p.lookup(m.name, d) if d and "." not in d else None
        if found and found[0] == "class":  # Class.method(...)
            key = p.method(found[1], name)
            return (key, decorated(p.modules[key[0]].funcs[key[1]], "classmethod"), None) if key else None
        owners = [] if name in BUILTIN_METHODS else p.methods.get(name, [])
        if len(owners) > 1:
            return "ambiguous"
        static = owners and decorated(p.modules[owners[0][0]].funcs[owners[0][1]], "staticmethod")
        return (owners[0], not static, recv) if owners else None

    def call(self, ctx: Ctx, node: ast.Call) -> None:
        func = node.func
        recv = func.value if isinstance(func, ast.Attribute) else None
        carries = any(self.mentions(ctx, a) for a in [*node.args, *(k.value for k in node.keywords), recv])
        self_call = ctx.self_name is not None and dotted(recv) == ctx.self_name
        if not carries and not (self_call and any("." in t for t in ctx.tracked)):
            return
        target = self.resolve(ctx, func)
        if target == "ambiguous":
            self.unresolved.append(f"{ctx.mod.rel}:{node.lineno} .{func.attr}")
            return
        if target is None:
            return
        key, bound, receiver = target
        fn = self.p.modules[key[0]].funcs[key[1]]
        a = fn.args
        positional = [x.arg for x in a.posonlyargs + a.args]
        first = positional.pop(0) if bound and positional else None
        named = set(positional) | {x.arg for x in a.kwonlyargs}
        got: set[str | None] = set()
        for i, arg in enumerate(node.args):
            if not self.mentions(ctx, arg):
                continue
            if isinstance(arg, ast.Starred):
                got |= {*positional[i:], a.vararg and a.vararg.arg}
            else:
                got.add(positional[i] if i < len(positional) else a.vararg and a.vararg.arg)
        for kw in node.keywords:
            if self.mentions(ctx, kw.value):
                if kw.arg in named:
                    got.add(kw.arg)
                else:
                    got |= {a.kwarg.arg} if a.kwarg else (named if kw.arg is None else set())
        if first and self.mentions(ctx, receiver):
            got.add(first)
        got.discard(None)
        if not got and self_call and first:  # carried only by a tracked self.x that the callee reads
            attrs = {f"{first}.{x}" for c in self.p.lineage((key[0], key[1].rpartition(".")[0]))
                     for x in self.class_attrs[c]}  # fmt: skip
            if not any(dotted(n) in attrs for n in ast.walk(fn) if isinstance(n, ast.Attribute)):
                return
        elif not got:
            return
        self.calls += 1
        self.enter(key, {g for g in got if g})


def walk(spec: str, root: Path = DEFAULT_ROOT, max_entries: int = MAX_ENTRIES) -> dict:
    """Walk FILE:FUNCTION:PARAM over the package at `root`; the result as a JSON-ready dict."""
    file, func, param = spec.rsplit(":", 2)
    project = Project(root)
    path = Path(file)
    if path.is_absolute() or path.exists():
        with contextlib.suppress(ValueError):  # a path outside the package: matched as given
            file = path.resolve().relative_to(root.resolve().parent).as_posix()
    wanted = {Path(file).as_posix(), f"{project.pkg}/{Path(file).as_posix()}"}  # or relative to the package
    start = next((m for m in project.modules.values() if m.rel in wanted), None)
    if start is None or func not in start.funcs:
        raise SystemExit(f"walk_param: no function {func!r} in {file} under {root}")
    w = Walk(project, max_entries)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * max_entries))  # the walk is depth-first
    w.enter((start.name, func), {param})
    stops: list[dict] = []
    for mod, qual in w.entries:
        rel = project.modules[mod].rel
        if stops and stops[-1]["file"] == rel:
            stops[-1]["functions"].append(qual)
        else:
            seen = any(s["file"] == rel for s in stops)
            stops.append({"index": len(stops) + 1, "file": rel, "functions": [qual], "return": seen})
    n, files, r = len(stops), len({s["file"] for s in stops}), sum(s["return"] for s in stops)
    return {
        "start": spec, "stops": n, "files": files, "returns": r,
        "return_pct": round(100 * r / n, 1) if n else 0.0,
        "entries": len(w.entries), "calls_followed": w.calls, "repeat_calls": w.repeats,
        "capped": len(w.entries) >= max_entries, "unresolved": len(w.unresolved),
        "unresolved_calls": w.unresolved, "notes": project.notes, "list": stops,
    }  # fmt: skip


def takers(root: Path, type_name: str) -> list[str]:
    """`file:function` for every function or method (nested ones too) with a parameter annotated `type_name`
    (or `type_name | None`), and every dataclass field annotated so (`file:Class.field`)."""
    found = []
    for path in sorted(Path(root).rglob("*.py")):
        if "tests" in path.parts or path.name.startswith("test_"):
            continue
        with contextlib.suppress(SyntaxError):
            tree = ast.parse(path.read_text())
            rel = path.relative_to(Path(root).parent).as_posix()
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                    if any(a.annotation is not None and _names(a.annotation, type_name) for a in params):
                        found.append(f"{rel}:{node.name}")
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.AnnAssign) and _names(item.annotation, type_name):
                            found.append(f"{rel}:{node.name}.{ast.unparse(item.target)}")
    return found


def _names(annotation: ast.expr, type_name: str) -> bool:
    """The annotation is `type_name` itself, or a union with it (`Config | None`), written bare or quoted."""
    text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
    return type_name in [part.strip() for part in str(text).split("|")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", nargs="?", help="FILE:FUNCTION:PARAM, e.g. hopperlm/train/loop.py:train:cfg")
    ap.add_argument("--takers", metavar="TYPE", help="list the functions with a parameter annotated TYPE")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the package folder (default: hopperlm/)")
    ap.add_argument("--list", action="store_true", help="one line per stop")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--max-entries", type=int, default=MAX_ENTRIES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.takers:
        names = takers(args.root, args.takers)
        print("\n".join(names))
        print(f"{len(names)} functions (and fields) take a {args.takers}")
        return 0
    if not args.spec:
        ap.error("give FILE:FUNCTION:PARAM, or --takers TYPE")
    result = walk(args.spec, args.root, args.max_entries)
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    r = result
    print(f"{r['stops']} stops in {r['files']} files; {r['returns']} returns ({r['return_pct']:.0f}%)")
    capped = ", capped" if r["capped"] else ""
    print(
        f"({r['entries']} functions entered{capped}; {r['repeat_calls']} calls to one already entered;",
        end=" ",
    )
    print(f"{r['unresolved']} unresolved: a method name that several classes define)")
    width = max((len(s["file"]) for s in r["list"]), default=0)
    for s in r["list"] if args.list else []:
        print(f"{s['index']:4d}  {s['file']:<{width}}  {', '.join(s['functions'])}{'  return' * s['return']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
