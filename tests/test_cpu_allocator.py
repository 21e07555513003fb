"""The CPU allocator choice (hopperlm/cpu_allocator.py): glibc keeps freed blocks where it is safe, the
environment's choice wins, every other case says why in one line; the switch really keeps freed memory in the
heap; the benchmark's rows compare what they claim (the same validation loss, each row's plan line)."""

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from shared_data import DATA_DIR

from hopperlm import cpu_allocator
from hopperlm.config import Config
from hopperlm.config.presets import get_preset
from hopperlm.hardware import simulated
from hopperlm.plan import make_plan
from hopperlm.plan.choices import choose_cpu_allocator

REPO = Path(__file__).resolve().parents[1]
GLIBC = cpu_allocator.glibc() is not None
MB = 1 << 20


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*cpu_allocator.USER_SWITCHES, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env, named",
    [
        ({}, None),
        ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": "0"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, None),  # a tunable that is not malloc's
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "jemalloc (LD_PRELOAD)"),
        ({"LD_PRELOAD": "/opt/libfoo.so"}, None),
    ],
)
def test_the_environment_that_chose_the_allocator_is_named(env, named):
    assert cpu_allocator.allocator_set_by_user(env) == named


def test_the_choice_and_its_reason_in_each_case(clean_env):
    cpu, h100 = simulated("CPU"), simulated("H100 80GB")
    assert choose_cpu_allocator(h100, 1e9, 40e9) == (
        False,
        None,
    )  # torch's caching allocator owns CUDA memory
    if GLIBC:
        keep, why = choose_cpu_allocator(cpu, 1e9, 10e9)
        assert keep and why.startswith("glibc keeps freed blocks") and "MALLOC_TRIM_THRESHOLD_=131072" in why
    keep, why = choose_cpu_allocator(cpu, 4e9, 10e9)  # the heap it keeps (3x the estimate) would not fit
    assert (
        not keep
        and "12.0 GB (3x the 4.0 GB estimated)" in why
        and "10.0 GB memory budget" in why
        or not GLIBC
    )
    clean_env.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert choose_cpu_allocator(cpu, 1e9, 10e9) == (
        False,
        "as MALLOC_TRIM_THRESHOLD_ sets it (the environment's choice wins)",
    )
    clean_env.delenv("MALLOC_TRIM_THRESHOLD_")
    clean_env.setattr(cpu_allocator, "glibc", lambda: None)  # macOS, musl
    keep, why = choose_cpu_allocator(cpu, 1e9, 10e9)
    assert not keep and why.startswith("the platform's malloc") and "LD_PRELOAD" in why


def test_a_cpu_plan_carries_the_choice_and_a_cuda_plan_keeps_its_own_line(clean_env):
    cfg = Config()
    model_cfg = get_preset("debug")
    cpu = make_plan(cfg, model_cfg, simulated("CPU"))
    assert cpu.keep_freed_memory is GLIBC and "allocator" in cpu.reasons
    gpu = make_plan(cfg, model_cfg, simulated("H100 80GB"))
    assert not gpu.keep_freed_memory and gpu.reasons["allocator"].startswith("expandable segments")


FREED_STAYS = textwrap.dedent(
    """
    import ctypes, sys
    import torch
    from hopperlm import cpu_allocator

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    libc = cpu_allocator.glibc()
    libc.mallinfo2.restype = Mallinfo2
    if sys.argv[1] == "keep":
        assert cpu_allocator.keep_freed_memory()
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB
    mapped = libc.mallinfo2().hblkhd  # bytes in mmapped blocks
    del x
    print(mapped, libc.mallinfo2().fordblks)  # mmapped while live, free bytes kept in the heap after
    """
)


@pytest.mark.skipif(not GLIBC or not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="glibc >= 2.33")
def test_the_switch_keeps_a_freed_block_in_the_heap_where_glibc_would_unmap_it():
    def run(mode: str) -> tuple[int, int]:
        env = {k: v for k, v in os.environ.items() if k not in cpu_allocator.USER_SWITCHES}
        done = subprocess.run(
            [sys.executable, "-c", FREED_STAYS, mode], capture_output=True, text=True, env=env, check=True
        )
        mapped, kept = map(int, done.stdout.split())
        return mapped, kept

    mapped, kept = run("default")
    assert mapped >= 64 * MB and kept < 64 * MB  # glibc's default: a fresh mmap, given back when freed
    mapped, kept = run("keep")
    assert mapped < 64 * MB and kept >= 64 * MB  # from the heap, and still there for the next step


@pytest.mark.slow
def test_the_benchmark_compares_the_rows_it_names(tmp_path):
    """bench/cpu_allocator.py --smoke: each row's plan line checked by the script, the same validation loss."""
    out = tmp_path / "allocator.json"
    env = {**os.environ, "HOPPERLM_DATA_DIR": str(DATA_DIR)}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cpu_allocator.py"), "--smoke", "--save", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["provenance"]["commit"]
    rows = {(r["vocabulary"], r["row"]): r for r in result["rows"]}
    assert set(rows) == {("32K vocabulary", "glibc default"), ("32K vocabulary", "hopperlm")}
    ours, glibc = rows["32K vocabulary", "hopperlm"], rows["32K vocabulary", "glibc default"]
    assert ours["val_loss"] == glibc["val_loss"] and ours["windows"] == 1 and ours["steps"] == 4
    t = ours["tokens_per_s"]
    assert 0 < t["min"] <= t["median"] <= t["max"] and result["ratios"]["32K vocabulary"] > 0
    assert "same validation loss: True" in done.stdout
