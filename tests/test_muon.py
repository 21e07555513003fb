"""hopperlm's batched Muon (train/muon.py): torch.optim.Muon's update on a μP model with several param groups,
a `found_inf` step that changes nothing, checkpoints that move between it and torch's Muon both ways, and the
train step skipping a bad Muon step on the device."""

import copy
import io
import subprocess
import sys

import pytest
import torch

from hopperlm.config import ModelConfig, MuonConfig, OptimConfig
from hopperlm.model.transformer import build_model
from hopperlm.train.muon import Muon
from hopperlm.train.optim import OptimizerPair, build_optimizer, set_lr
from hopperlm.train.step import honours_found_inf, skip_on_device

LR = 3e-3
TOKENS = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))


def tiny_model():
    # mup at twice its base width: matrices train at lr_scale 1/2 (spectral: one scale per shape); 2 layers and
    # GQA give buckets of 2 and 4 same-shape matrices
    cfg = ModelConfig(
        dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32, parametrization="mup",
        base_dim=64,
    )  # fmt: skip
    return build_model(cfg, seed=0)


def muon_groups(model, adjust: str) -> list[dict]:
    """The Muon groups build_optimizer makes, each split again by layer (the second layer at 1.5x the LR
    scale and another weight decay), so same-shape matrices sit in groups with different LRs."""
    cfg = OptimConfig(lr=LR, name="muon")
    built = build_optimizer(
        model, cfg, fused=False, name="muon", muon=MuonConfig(lr_adjust=adjust)
    ).optimizers[0]
    second = {id(p) for n, p in model.named_parameters() if n.startswith("layers.1.")}
    groups = []
    for g in built.param_groups:
        for later in (False, True):
            params = [p for p in g["params"] if (id(p) in second) == later]
            scale = g["lr_scale"] * (1.5 if later else 1.0)
            wd = g["weight_decay"] * (0.5 if later else 1.0)
            groups.append({**g, "params": params, "lr_scale": scale, "weight_decay": wd})
    return groups


def twin(groups: list[dict], model, twin_model, cls):
    """`cls` over `twin_model`'s parameters, grouped as `groups` are over `model`'s."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    params = list(twin_model.parameters())
    return cls([{**g, "params": [params[index[id(p)]] for p in g["params"]]} for g in groups])


def muon_step(model, optimizer) -> None:
    model.zero_grad(set_to_none=True)
    model(TOKENS[:, :-1], TOKENS[:, 1:]).backward()
    set_lr(optimizer, LR)
    optimizer.step()


def matrices(optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@torch.no_grad()
def sync(to, source) -> None:
    """`to`'s matrices and momenta set to `source`'s."""
    for q, p in zip(matrices(to), matrices(source), strict=True):
        q.copy_(p)
        to.state[q]["momentum_buffer"].copy_(source.state[p]["momentum_buffer"])


def assert_same_updates(ours, theirs, start: list[torch.Tensor]) -> None:
    """Each matrix's change since `start` matches to 1e-4 of the update: on a CPU the batched bf16 Newton–Schulz
    is torch's bit for bit and only the fp32 arithmetic around it rounds differently (a compiled one on CUDA
    differs by bf16 rounding, ~1e-2); a weight decay left out would be ~1e-2."""
    for p, q, p0 in zip(matrices(ours), matrices(theirs), start, strict=True):
        mine, ref = p - p0, q - p0
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4 * ref.abs().max().item())
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "spectral"])
def test_batched_update_equals_torch_muon(adjust):
    model = tiny_model()
    ref_model = copy.deepcopy(model)
    groups = muon_groups(model, adjust)
    ours = Muon(groups, adjust_lr_fn="original" if adjust == "spectral" else "match_rms_adamw")
    theirs = twin(ours.param_groups, model, ref_model, torch.optim.Muon)
    assert len({g["lr_scale"] for g in ours.param_groups}) >= 2
    for step in range(3):
        if step:  # each step from the same weights and momenta: bf16 Newton–Schulz amplifies an fp32 ulp
            sync(theirs, ours)
        start = [p.detach().clone() for p in matrices(ours)]
        muon_step(model, ours)
        muon_step(ref_model, theirs)
        assert_same_updates(ours, theirs, start)


def test_a_found_inf_step_changes_nothing_and_a_nan_gradient_does_not_poison_the_state():
    model = tiny_model()
    optimizer = Muon(muon_groups(model, "match_rms_adamw"), adjust_lr_fn="match_rms_adamw")
    muon_step(model, optimizer)  # the momentum buffers exist now
    params = {id(p): p.detach().clone() for p in matrices(optimizer)}
    bufs = {id(p): s["momentum_buffer"].clone() for p, s in optimizer.state.items()}
    for i, p in enumerate(matrices(optimizer)):
        p.grad = torch.full_like(p, float("nan") if i % 2 else float("inf"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    for p in matrices(optimizer):
        assert torch.equal(p, params[id(p)]), "a skipped step changed a weight"
        assert torch.equal(optimizer.state[p]["momentum_buffer"], bufs[id(p)]), (
            "a skipped step changed a momentum"
        )
    # the next good step is the step of an optimizer that never saw the skipped one
    optimizer.found_inf = torch.zeros(())
    reference_model = copy.deepcopy(model)
    reference = twin(optimizer.param_groups, model, reference_model, Muon)
    reference.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # not the same buffers
    muon_step(model, optimizer)
    muon_step(reference_model, reference)
    for p, q in zip(matrices(optimizer), matrices(reference), strict=True):
        assert torch.isfinite(p).all() and not torch.equal(p, params[id(p)])
        assert torch.equal(p, q)


@pytest.mark.parametrize("saved_by", ["torch", "hopperlm"])
def test_checkpoints_move_between_torch_muon_and_ours(saved_by):
    """A checkpoint written by one optimizer (2 steps), loaded into the other: its next step is the one the
    writer would have taken."""
    classes = {"torch": torch.optim.Muon, "hopperlm": Muon}
    loader_cls = classes["hopperlm" if saved_by == "torch" else "torch"]
    model = tiny_model()
    groups = muon_groups(model, "spectral")
    writer = twin(groups, model, model, classes[saved_by])
    for _ in range(2):
        muon_step(model, writer)
    blob = io.BytesIO()
    torch.save(writer.state_dict(), blob)
    loaded_model = copy.deepcopy(model)
    loader = twin(groups, model, loaded_model, loader_cls)
    blob.seek(0)
    loader.load_state_dict(torch.load(blob, weights_only=True))
    assert {k for s in loader.state.values() for k in s} == {"momentum_buffer"}
    assert [set(g) for g in loader.param_groups] == [set(g) for g in writer.param_groups]
    start = [p.detach().clone() for p in matrices(writer)]
    muon_step(model, writer)
    muon_step(loaded_model, loader)
    assert_same_updates(loader, writer, start)


def test_the_pair_with_fused_adamw_skips_on_the_device():
    model = tiny_model()
    fused = build_optimizer(model, OptimConfig(name="muon"), fused=True, name="muon")
    unfused = build_optimizer(model, OptimConfig(name="muon"), fused=False, name="muon")
    assert isinstance(fused, OptimizerPair) and isinstance(fused.optimizers[0], Muon)
    assert honours_found_inf(fused) and skip_on_device(fused, torch.device("cuda"))
    assert not skip_on_device(fused, torch.device("cpu"))  # a CPU reads the flag on the host for free
    assert not honours_found_inf(unfused)  # an unfused AdamW would apply the bad step to the rest
    assert not honours_found_inf(torch.optim.Muon(matrices(fused.optimizers[0])))
    flag = torch.ones(())
    fused.found_inf = flag
    assert all(opt.found_inf is flag for opt in fused.optimizers)


def test_importing_muon_leaves_dynamo_unloaded():
    """torch.compile of the Newton–Schulz is made on the first CUDA step, not at import (dynamo costs seconds
    to import, and a CPU run never needs it)."""
    code = "import sys, hopperlm.train.muon; assert 'torch._dynamo' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
