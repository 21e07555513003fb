"""Where the time goes: each profiled op or GPU kernel classified as GEMM, attention, elementwise/norm,
communication, memory copy or other, and a top-kernels table with time shares.

On CUDA the table lists device activity (kernels, memcpy, memset) and the time the GPU sat idle within the
profiled steps. On CPU it lists aten ops by self time (time in the op itself, not in the ops it calls), and
"host" is the steps' time outside any op (Python, the data pipeline). `classify` is a pure function of the
name, tested on names taken from real traces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GEMM, ATTENTION, ELEMENTWISE, COMM, COPY, OTHER = (
    "GEMM",
    "attention",
    "elementwise/norm",
    "communication",
    "memory copy",
    "other",
)
IDLE, HOST = "idle", "host"  # GPU idle within the steps; CPU time outside any op
CATEGORIES = (GEMM, ATTENTION, ELEMENTWISE, COMM, COPY, OTHER, IDLE, HOST)

# Order matters: attention kernels are often built from cutlass/GEMM pieces (flash::FlashAttnFwdSm90 in a
# cutlass::device_kernel), and inductor's template kernels say what they fuse.
_COMM = re.compile(
    r"nccl|c10d::|gloo:|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|alltoall", re.I
)
_COPY = re.compile(
    r"^memcpy|^memset|cudaMemcpy|cudaMemset|^aten::(copy_|_to_copy|to|clone|contiguous|_pin_memory|pin_memory)$",
    re.I,
)
_ATTENTION = re.compile(
    r"flash|fmha|sdpa|scaled_dot_product|attention|_efficient_attention|cudnn.*(fprop|bprop)", re.I
)
_GEMM = re.compile(
    r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitkreduce|wgmma|"
    r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|_addmm_activation|_scaled_mm|_int_mm|"
    r"_weight_int8pack_mm|mkldnn_.*)$|^aten::_?fused_.*mm",
    re.I,
)
_OVERHEAD = re.compile(r"^autograd::|Backward\d*$|^[\w.]+#\w|^cuda[A-Z]|^cu[A-Z]\w+$")
_TRITON_TEMPLATE_ATTENTION = re.compile(r"triton_tem_.*(flex|attention|sdpa)", re.I)
# aten ops that only describe tensors or allocate: their (small) time is overhead, not arithmetic
_METADATA = {
    "view",
    "reshape",
    "_reshape_alias",
    "_unsafe_view",
    "transpose",
    "t",
    "permute",
    "expand",
    "expand_as",
    "slice",
    "select",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "split",
    "split_with_sizes",
    "chunk",
    "narrow",
    "unbind",
    "detach",
    "detach_",
    "alias",
    "empty",
    "empty_like",
    "empty_strided",
    "resize_",
    "set_",
    "lift_fresh",
    "result_type",
    "is_nonzero",
    "item",
    "_local_scalar_dense",
    "flatten",
    "view_as",
    "numpy_T",
    "broadcast_tensors",
    "is_same_size",
    "zeros",
    "ones",
    "new_empty",
    "new_empty_strided",
}
_ELEMENTWISE_KERNEL = re.compile(
    r"elementwise|vectorized|unrolled|reduce_kernel|reduction|softmax|norm|layer_?norm|rms|"
    r"multi_tensor_apply|adam|foreach|fill|index|gather|scatter|embedding|nll_loss|cross_entropy|"
    r"cat_|catarray|dropout|silu|gelu|relu|sigmoid|tanh|exp|rsqrt|mul|add|sum|mean|where|triton_",
    re.I,
)


def classify(name: str) -> str:
    """The category of one profiled op (aten::mm) or GPU kernel (sm90_xmma_gemm_..., ncclDevKernel_...)."""
    if name.startswith("ProfilerStep"):
        return HOST  # self time of the step marker: time outside any op
    if _COMM.search(name):
        return COMM
    if _COPY.search(name):
        return COPY
    if _OVERHEAD.search(name):
        return (
            OTHER  # autograd nodes, record_function labels, CUDA runtime calls: their self time is overhead
        )
    if _TRITON_TEMPLATE_ATTENTION.search(name) or _ATTENTION.search(name):
        return ATTENTION
    if _GEMM.search(name) or name.startswith("triton_tem_"):  # inductor templates: matmuls (and convolutions)
        return GEMM
    if name.startswith("aten::"):
        op = name[len("aten::") :]
        return OTHER if op in _METADATA else ELEMENTWISE
    if _ELEMENTWISE_KERNEL.search(name):
        return ELEMENTWISE
    return OTHER


@dataclass(frozen=True)
class KernelRow:
    name: str
    category: str
    time_us: float
    count: int


def category_shares(rows: list[KernelRow], total_us: float) -> dict[str, float]:
    """Share of total_us per category, largest first (rows that are not a category's own time excluded)."""
    shares: dict[str, float] = {}
    for row in rows:
        shares[row.category] = shares.get(row.category, 0.0) + row.time_us / total_us
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def summary_line(shares: dict[str, float]) -> str:
    """'GEMMs 71%, attention 12%, elementwise/norm 9%, idle 3%' (categories under 0.5% left out)."""
    names = {GEMM: "GEMMs"}
    parts = [f"{names.get(c, c)} {100 * s:.0f}%" for c, s in shares.items() if s >= 0.005]
    return ", ".join(parts) if parts else "nothing recorded"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time the device had at least one kernel running."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def format_table(rows: list[KernelRow], total_us: float, top: int = 20, width: int = 72) -> list[str]:
    """The top rows by time: share, total ms, calls, mean us, category, name."""
    lines = [f"{'share':>6} {'total ms':>9} {'calls':>6} {'mean us':>9}  {'category':<16} name"]
    for row in sorted(rows, key=lambda r: -r.time_us)[:top]:
        name = row.name if len(row.name) <= width else row.name[: width - 3] + "..."
        mean = row.time_us / max(row.count, 1)
        lines.append(
            f"{100 * row.time_us / total_us:5.1f}% {row.time_us / 1000:9.2f} {row.count:6d} {mean:9.1f}  "
            f"{row.category:<16} {name}"
        )
    return lines
