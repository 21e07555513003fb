"""Muon (Keller Jordan 2024) with torch.optim.Muon's update, batched: the matrices of one shape are stacked and
orthogonalised by one batched Newton–Schulz (modded-nanogpt's approach), and a non-finite step is dropped on the
device (`found_inf`, as torch's fused AdamW), so a Muon step neither idles the GPU nor waits on the host.

torch.optim.Muon (2.9+) runs Newton–Schulz one matrix at a time (no foreach): on an H100 that was ~2,100 tiny
GEMMs, 1,632 device-to-device copies and ~5,000 launches a step, with the GPU idle 36% of the time. Here a
parameter group's matrices of one (shape, dtype, device) form a bucket: its gradients and momenta are stacked
into (N, A, B) tensors, and each Newton–Schulz iteration is three batched GEMMs (`bmm`, `baddbmm`). The state
is torch's (`momentum_buffer` per parameter) and so are the param-group keys, so checkpoints move between the
two optimizers both ways (tests/test_muon.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import torch

# torch/optim/_muon.py's constants (Keller Jordan's Muon post), copied: that module is private
EPS = 1e-7
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# Polar Express (Amsel, Persson, Musco and Gower 2025, arXiv 2505.16932, Algorithm 1 with 5 iterations, safety
# factor 2e-2, cushion 2): one quintic per iteration, each fitted to the spectrum the previous one leaves, as
# modded-nanogpt and nanochat (nanochat/optim.py) use them; the input is divided by its Frobenius norm times a
# safety factor: 1.02 by default, modded-nanogpt's (nanochat at 92d63d4 divides by 1.01: muon.ns_safety)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02
# Newton–Schulz's precisions (the plan chooses: plan/choices.py's muon_ns_for)
NS_PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(
    g: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    schedule: tuple[tuple[float, float, float], ...] | None = None,
    safety: float = POLAR_EXPRESS_SAFETY,
    dtype: torch.dtype = torch.bfloat16,
):
    """torch.optim.Muon's quintic Newton–Schulz orthogonalisation, in `dtype` (torch's bf16 by default), of a
    batch of same-shape matrices (N, A, B): each matrix is normalised by its own Frobenius norm and a tall one is iterated transposed (the
    Gram matrix is then the smaller side's). `schedule`: one (a, b, c) per iteration instead of `coefficients`
    `steps` times (Polar Express, whose input is divided by `safety` x its norm, so that rounding cannot leave a
    singular value above 1)."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)  # (N, 1, 1): spectral norm at most 1 after dividing
    x = x / (norm.clamp(min=eps) if schedule is None else norm * safety + eps)
    for a, b, c in schedule or (coefficients,) * steps:
        gram = torch.bmm(x, x.mT)  # (N, A, A), A the smaller side
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        x = torch.baddbmm(x, poly, x, beta=a)  # a * x + poly @ x
    return x.mT if tall else x


def normuon_scale(update: torch.Tensor, second: torch.Tensor, beta2: float, skip: torch.Tensor | None):
    """NorMuon's per-neuron normalisation (Li et al. 2025, arXiv 2510.05491; nanochat/optim.py) of orthogonalised
    updates (N, A, B), in fp32: each row's (A >= B) or column's mean square goes into its running mean `second`
    ((N, A, 1) or (N, 1, B)); the update is divided by that mean's root, then scaled back to its Frobenius norm
    before. Returns (update, the new running mean); a skipped step keeps the running mean as it was."""
    u = update.float()
    mean_sq = u.square().mean(dim=-1 if u.size(-2) >= u.size(-1) else -2, keepdim=True)
    new = second.lerp(mean_sq, 1 - beta2)
    if skip is not None:
        new = torch.where(skip, second, new)
    scaled = u * new.clamp(min=1e-10).rsqrt()
    norm_before = u.norm(dim=(-2, -1), keepdim=True)
    return scaled * (norm_before / scaled.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-10)), new


@functools.cache
def compiled_newton_schulz() -> Callable:
    """newton_schulz through torch.compile, made on first use (importing this module does not import dynamo).
    dynamic=False: one graph per bucket shape, recompiled by dynamo's shape guards; a model has a handful of
    matrix shapes (past dynamo's recompile limit, 8, the extra shapes run eagerly, with dynamo's warning)."""
    return torch.compile(newton_schulz, dynamic=False)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-shape learning rate: "original" (Keller Jordan's sqrt(max(1, A/B))) or
    "match_rms_adamw" (Moonlight's 0.2 sqrt(max(A, B)): AdamW's update RMS)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update (Nesterov momentum by lerp, bf16 Newton–Schulz, shape-adjusted LR, decoupled
    weight decay), computed a bucket of same-shape matrices at a time. `ns_precision` "fp32": Newton–Schulz in
    fp32 instead (what the plan gives a CPU run: plan/choices.py's muon_ns_for).

    `found_inf`: set it to a float tensor on the device (1: skip this step), as for torch's fused AdamW; a
    skipped step leaves every parameter and momentum bit for bit as it was, whatever the gradients hold, and
    nothing waits on the host. `compile_ns`: compile the batched Newton–Schulz on CUDA.

    Beyond torch's (each off by default, so the update is torch's unless asked; none is a param-group key, see
    __init__): `ns_schedule`, one Newton–Schulz polynomial per iteration (POLAR_EXPRESS); `normuon_beta2`,
    NorMuon's per-neuron normalisation (normuon_scale; its running mean is the state's `normuon_second`);
    `cautious`, weight decay only where the update has the weight's sign; `decay_factor`, what the weight decay
    is multiplied by this step (a schedule sets it, as the LR)."""

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        compile_ns: bool = True,
        ns_schedule: tuple[tuple[float, float, float], ...] | None = None,
        normuon_beta2: float | None = None,
        cautious: bool = False,
        ns_safety: float = POLAR_EXPRESS_SAFETY,
        ns_precision: str = "bf16",
    ) -> None:
        if isinstance(lr, torch.Tensor) or lr < 0.0:
            raise ValueError(f"Muon's learning rate must be a float >= 0, not {lr}")
        if momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Muon's momentum ({momentum}) and weight decay ({weight_decay}) must be >= 0")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon's adjust_lr_fn {adjust_lr_fn!r} is not one of {ADJUST_LR_FNS}")
        if len(ns_coefficients) != 3 or not 0 < ns_steps < 100:
            raise ValueError("Muon needs 3 Newton–Schulz coefficients and 1 to 99 steps")
        if ns_precision not in NS_PRECISIONS:
            raise ValueError(f"Muon's ns_precision {ns_precision!r} is not one of {tuple(NS_PRECISIONS)}")
        # exactly torch.optim.Muon's group keys: load_state_dict replaces a group by the saved one, so a key
        # of our own would vanish on loading torch's checkpoint (compile_ns is therefore not a group key)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        self.compile_ns = compile_ns
        self.ns_schedule = (
            None if ns_schedule is None else tuple(tuple(map(float, abc)) for abc in ns_schedule)
        )
        self.ns_safety = ns_safety
        self.ns_precision = ns_precision
        self.normuon_beta2 = normuon_beta2
        self.cautious = cautious
        self.decay_factor = 1.0
        self.found_inf: torch.Tensor | None = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, not one of shape {tuple(p.shape)}")

    def __getstate__(self) -> dict:  # (copy.deepcopy, pickle)
        extras = ("compile_ns", "ns_schedule", "ns_safety", "ns_precision", "normuon_beta2", "cautious",
                  "decay_factor")  # fmt: skip
        return {**super().__getstate__(), **{k: getattr(self, k) for k in extras}}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.found_inf = None  # a flag for one step, never carried over

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skips: dict[torch.device, torch.Tensor] = {}  # found_inf as a bool on each device, made once a step
        for group in self.param_groups:
            for params in self._buckets(group):
                device = params[0].device
                if self.found_inf is not None and device not in skips:
                    skips[device] = self.found_inf.to(device, non_blocking=True) > 0
                self._update(params, group, skips.get(device))
        return loss

    def _buckets(self, group: dict) -> list[list[torch.Tensor]]:
        """The group's parameters with a gradient, by (shape, dtype, device), in the group's order."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError("Muon takes dense real gradients only")
            buckets.setdefault((p.shape, p.dtype, p.grad.dtype, p.device), []).append(p)
        return list(buckets.values())

    def _update(self, params: list[torch.Tensor], group: dict, skip: torch.Tensor | None) -> None:
        """One bucket's step; `skip` (a bool on the device, or None): drop it."""
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        momentum = group["momentum"]
        grad = torch.stack([p.grad for p in params])  # (N, A, B)
        buf = torch.stack(bufs)  # (N, A, B)
        if skip is not None:
            # a skipped step's gradient is the momentum itself: the lerp below then leaves it as it was, bit
            # for bit, and a NaN or inf gradient never reaches it
            grad = torch.where(skip, buf, grad)
        buf.lerp_(grad, 1 - momentum)
        torch._foreach_copy_(bufs, buf.unbind(0))
        update = grad.lerp_(buf, momentum) if group["nesterov"] else buf
        ortho = self._orthogonalise(update, group)  # (N, A, B) bf16 (fp32 where ns_precision says)
        if self.normuon_beta2 is not None:
            ortho = self._normuon(params, ortho, skip)  # (N, A, B) fp32

        lr, decay = group["lr"], group["weight_decay"] * self.decay_factor
        keep: float | torch.Tensor = 1 - lr * decay
        step: float | torch.Tensor = -adjusted_lr(lr, group["adjust_lr_fn"], params[0].shape)
        if skip is not None:  # device scalars: a skipped step multiplies by 1 and adds 0
            keep = torch.where(skip, 1.0, keep)
            step = torch.where(skip, 0.0, step)
        # in the parameters' precision, as torch's add_(update, alpha=-lr): a bf16 product would round the step
        ortho = ortho.to(params[0].dtype)
        if self.cautious and decay:  # decay only where the step (-ortho) already pulls towards zero
            weights = torch.stack(params)  # (N, A, B), before the decay, as the mask reads them
            shrink = weights.mul_((ortho * weights >= 0).to(weights.dtype)).mul_(1 - keep)
            torch._foreach_sub_(params, shrink.unbind(0))
        else:
            torch._foreach_mul_(params, keep)  # decoupled weight decay, before the update (as torch)
        delta = ortho.mul_(step)
        torch._foreach_add_(params, delta.unbind(0))

    def _normuon(
        self, params: list[torch.Tensor], ortho: torch.Tensor, skip: torch.Tensor | None
    ) -> torch.Tensor:
        """The bucket's orthogonalised update after NorMuon (normuon_scale), its running means kept per
        parameter in the state (`normuon_second`)."""
        rows, cols = ortho.shape[-2:]
        shape = (rows, 1) if rows >= cols else (1, cols)
        seconds = []
        for p in params:
            state = self.state[p]
            if "normuon_second" not in state:
                state["normuon_second"] = torch.zeros(shape, device=p.device, dtype=torch.float32)
            seconds.append(state["normuon_second"])
        scaled, second = normuon_scale(ortho, torch.stack(seconds), self.normuon_beta2, skip)
        torch._foreach_copy_(seconds, second.unbind(0))
        return scaled

    def _orthogonalise(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        # compiled on CUDA only: fusing the norm and the scalings saves launches there; on a CPU there are no
        # launches to save, and inductor's C++ build would cost each process (and each test) tens of seconds
        compiled = self.compile_ns and update.device.type == "cuda"
        orthogonalise = compiled_newton_schulz() if compiled else newton_schulz
        coefficients = tuple(group["ns_coefficients"])
        # (getattr: one deep-copied before these keys existed ran bf16 with the default safety)
        safety = getattr(self, "ns_safety", POLAR_EXPRESS_SAFETY)
        dtype = NS_PRECISIONS[getattr(self, "ns_precision", "bf16")]
        return orthogonalise(
            update, coefficients, group["ns_steps"], group["eps"], self.ns_schedule, safety, dtype
        )
