"""scripts/walk_param.py: how far one parameter travels, counted statically (stops, files, returns)."""

import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "walk_param.py"


def load_script():
    spec = importlib.util.spec_from_file_location("walk_param", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["walk_param"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def run_json(capsys, *argv: str) -> dict:
    assert load_script().main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_stops_files_and_returns(tmp_path, capsys):
    pkg = write_package(
        tmp_path / "fakepkg",
        {
            "__init__.py": "",
            "a.py": """
                from fakepkg.b import build
                from fakepkg import c


                def start(cfg, other):
                    model = build(cfg)
                    c.describe(cfg.sub)
                    unrelated(other)  # `other` is not the parameter: not followed
                    return model


                def unrelated(x):
                    return build(x)


                def helper(sub):
                    return sub
            """,
            "b.py": """
                def build(cfg):
                    size = cfg.size
                    return make(size)


                def make(n):
                    return n
            """,
            "c.py": """
                from .a import helper


                def describe(sub):
                    return helper(sub)
            """,
        },
    )
    out = run_json(capsys, "--root", str(pkg), "fakepkg/a.py:start:cfg")
    assert [(s["file"], s["functions"], s["return"]) for s in out["list"]] == [
        ("fakepkg/a.py", ["start"], False),
        ("fakepkg/b.py", ["build", "make"], False),
        ("fakepkg/c.py", ["describe"], False),
        ("fakepkg/a.py", ["helper"], True),
    ]
    assert (out["stops"], out["files"], out["returns"], out["return_pct"]) == (4, 3, 1, 25.0)
    assert out["entries"] == 5 and out["unresolved"] == 0 and out["notes"] == []

    assert load_script().main(["--root", str(pkg), str(pkg / "a.py") + ":start:cfg", "--list"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == "4 stops in 3 files; 1 returns (25%)"
    assert text[-1].split() == ["4", "fakepkg/a.py", "helper", "return"]


def test_methods_self_attributes_and_odd_syntax(tmp_path, capsys):
    pkg = write_package(
        tmp_path / "pkg2",
        {
            "__init__.py": "",
            "start.py": """
                import functools

                from pkg2.holder import Holder
                from pkg2 import tools


                @functools.lru_cache
                def run(cfg):
                    h = Holder(cfg)
                    h.go()  # the receiver carries it: Holder.go's self
                    items = [tools.twice(x) for x in cfg.items]
                    f = lambda y: tools.twice(y)

                    def inner(z):
                        return tools.twice(z)

                    cfg.thing.close()  # two classes define close: unresolved
                    match cfg.mode:
                        case "a" if items:
                            tools.other(cfg)
                    return f, inner
            """,
            "holder.py": """
                class Base:
                    def close(self):
                        pass


                class Holder(Base):
                    def __init__(self, cfg):
                        self.cfg = cfg
                        self.ready()  # no argument: carried by self.cfg, which ready reads

                    def ready(self):
                        return self.cfg

                    def go(self):
                        pass


                class Other:
                    def close(self):
                        pass
            """,
            "tools.py": """
                def twice(x):
                    return 2 * x


                def other(cfg):
                    return cfg
            """,
            "broken.py": "def oops(:\n",
            "tests/test_ignored.py": "def test(:\n",
        },
    )
    out = run_json(capsys, "--root", str(pkg), "pkg2/start.py:run:cfg")
    assert [(s["file"], s["functions"]) for s in out["list"]] == [
        ("pkg2/start.py", ["run"]),
        ("pkg2/holder.py", ["Holder.__init__", "Holder.ready", "Holder.go"]),
        ("pkg2/tools.py", ["twice", "other"]),
    ]
    assert (out["stops"], out["files"], out["returns"]) == (3, 3, 0)
    assert out["unresolved"] == 1 and out["unresolved_calls"][0].endswith(".close")
    assert len(out["notes"]) == 1 and "pkg2/broken.py" in out["notes"][0]


def test_the_walk_ends_after_1600_entries(tmp_path, capsys):
    chain = "\n".join(f"def f{i}(cfg):\n    return f{i + 1}(cfg)\n" for i in range(1700))
    pkg = write_package(tmp_path / "deep", {"chain.py": chain + "\ndef f1700(cfg):\n    return cfg\n"})
    out = run_json(capsys, "--root", str(pkg), "deep/chain.py:f0:cfg")
    assert (out["entries"], out["capped"], out["stops"], out["files"]) == (1600, True, 1, 1)
    assert out["list"][0]["functions"][-1] == "f1599"


def test_the_config_from_train():
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "hopperlm/train/loop.py:train:cfg", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert time.monotonic() - started < 20
    out = json.loads(done.stdout)
    assert out["stops"] > 20 and out["files"] > 5 and out["returns"] == out["stops"] - out["files"]
    assert out["list"][0] == {
        "index": 1,
        "file": "hopperlm/train/loop.py",
        "functions": ["train"],
        "return": False,
    }


def test_takers_lists_the_functions_and_fields_annotated_with_a_type(tmp_path, capsys):
    pkg = write_package(
        tmp_path / "fakepkg",
        {
            "__init__.py": "",
            "a.py": """
                from dataclasses import dataclass


                def whole(cfg: Config, n: int) -> None: ...


                def maybe(cfg: "Config | None" = None) -> None: ...


                def section(tc: TrainConfig) -> None: ...


                @dataclass
                class Run:
                    cfg: Config
                    name: str
            """,
        },
    )
    assert load_script().main(["--takers", "Config", "--root", str(pkg)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "fakepkg/a.py:whole",
        "fakepkg/a.py:maybe",
        "fakepkg/a.py:Run.cfg",
        "3 functions (and fields) take a Config",
    ]
