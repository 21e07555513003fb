"""The pretraining recipe's levers (issue 60), each against a reference written here from its source:
NorMuon and Polar Express (nanochat/optim.py at 92d63d4), cautious weight decay, Muon's momentum warm-up and its
weight decay schedule, per-group learning rates (also under μP), a warm-up laid as a share of the budget, the
ReLU² MLP and the logit softcap; and the one-line refusals of settings that do not fit together."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from hopperlm.config import (
    ModelConfig,
    MuonConfig,
    OptimConfig,
    ParamGroupConfig,
    ScheduleConfig,
    TrainConfig,
    config_from_dict,
)
from hopperlm.errors import ConfigError
from hopperlm.model.loss import linear_cross_entropy, softcapped, standard_cross_entropy
from hopperlm.model.transformer import build_model, count_params
from hopperlm.schedule import budget_progress, counted_warmup_steps, lr_at, muon_momentum_at, muon_schedule_at
from hopperlm.train.muon import POLAR_EXPRESS, Muon, newton_schulz
from hopperlm.train.optim import build_optimizer, set_lr, set_muon_schedule

TOKENS = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))


def tiny(**model_keys):
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, vocab_size=256, max_seq_len=32, **model_keys)
    return build_model(cfg, seed=0)


def reference_polar_express(g: torch.Tensor, safety: float = 1.02) -> torch.Tensor:
    """nanochat's muon_step_fused orthogonalisation, one matrix (its tall branch: X^T X), in float64, with
    a safety factor: modded-nanogpt's 1.02 (hopperlm's default) or nanochat's 1.01 (its value at 92d63d4)."""
    x = g.double()
    x = x / (x.norm() * safety + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        if g.size(-2) > g.size(-1):
            gram = x.mT @ x
            x = a * x + x @ (b * gram + c * (gram @ gram))
        else:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (16, 16)])
def test_polar_express_is_the_papers_iteration_and_closer_to_orthogonal(shape):
    g = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))
    ours = newton_schulz(g, (0, 0, 0), 5, 1e-7, schedule=POLAR_EXPRESS).float()
    for i in range(3):  # ours runs in bf16 (as nanochat's): its rounding moves entries by up to ~0.05 here
        # (dividing by 1.01 instead of 1.02 moves them by 0.06-0.09: this tolerance tells the two apart)
        torch.testing.assert_close(ours[i], reference_polar_express(g[i]).float(), rtol=0, atol=0.06)
    keller = newton_schulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    # the polar factor's singular values are all one: Polar Express ends nearer to them than Keller's quintic
    worst = [torch.linalg.svdvals(x).sub(1).abs().max().item() for x in (ours, keller)]
    assert worst[0] < worst[1], worst


def test_polar_express_safety_is_nanochats_when_asked():
    """muon.ns_safety 1.01 (nanochat at 92d63d4) reaches the optimizer: its Muon orthogonalises bit for bit as
    newton_schulz with that safety (in fp32: the plan's precision on a CPU), which is not the default's, and is
    the float64 reference's at 1.01: to fp32's rounding, closer than bf16's."""
    cfg = config_from_dict({"optim": {"name": "muon"}, "muon": {"ns": "polar_express", "ns_safety": 1.01},
                            "train": {"max_steps": 1}})  # fmt: skip
    model = torch.nn.Linear(16, 24, bias=False)
    pair = build_optimizer(model, cfg.optim, False, "muon", muon=cfg.muon)
    muon = next(o for o in pair.optimizers if isinstance(o, Muon))
    g = torch.randn(1, 24, 16, generator=torch.Generator().manual_seed(2))
    ours = muon._orthogonalise(g, muon.param_groups[0])
    fp32 = {"dtype": torch.float32}
    assert torch.equal(
        ours, newton_schulz(g, (0, 0, 0), 5, 1e-7, schedule=POLAR_EXPRESS, safety=1.01, **fp32)
    )
    assert not torch.equal(ours, newton_schulz(g, (0, 0, 0), 5, 1e-7, schedule=POLAR_EXPRESS, **fp32))
    reference = reference_polar_express(g[0], 1.01).float()
    torch.testing.assert_close(ours[0], reference, rtol=0, atol=1e-4)
    bf16 = newton_schulz(g, (0, 0, 0), 5, 1e-7, schedule=POLAR_EXPRESS, safety=1.01)
    torch.testing.assert_close(bf16[0].float(), reference, rtol=0, atol=0.06)


def reference_muon_step(p, grad, state, *, lr, wd, momentum, beta2, cautious, schedule):
    """One Muon + NorMuon + (cautious) weight decay step of one matrix, as nanochat's muon_step_fused does it,
    with hopperlm's learning-rate rule (torch's "original": lr x sqrt(max(1, rows / cols))) and its weight decay
    (lr x weight decay, before the update, as torch's)."""
    buf = state.setdefault("buf", torch.zeros_like(p))
    buf.lerp_(grad, 1 - momentum)
    g = grad.lerp(buf, momentum)
    x = newton_schulz(g[None], (3.4445, -4.7750, 2.0315), 5, 1e-7, schedule=schedule)[0].float()
    if beta2 is not None:
        red = -1 if x.size(-2) >= x.size(-1) else -2
        v_mean = x.square().mean(dim=red, keepdim=True)
        second = state.setdefault("second", torch.zeros_like(v_mean))
        second.lerp_(v_mean, 1 - beta2)
        step_size = second.clamp_min(1e-10).rsqrt()
        v_norm = (v_mean.sum() * x.size(red)).sqrt()
        v_norm_new = ((v_mean * x.size(red)) * step_size.square()).sum().sqrt()
        x = x * step_size * (v_norm / v_norm_new)
    mask = (x * p >= 0).float() if cautious else torch.ones_like(p)
    rows, cols = p.shape
    return p - lr * wd * p * mask - lr * math.sqrt(max(1, rows / cols)) * x


@pytest.mark.parametrize(
    "normuon, cautious, polar", [(True, False, False), (False, True, False), (True, True, True)]
)
def test_muon_variants_equal_a_reference_written_from_nanochat(normuon, cautious, polar):
    model = tiny(mlp="relu2")
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    schedule = POLAR_EXPRESS if polar else None
    beta2 = 0.9 if normuon else None
    muon = Muon([{"params": matrices, "lr": 0.02, "weight_decay": 0.5}], momentum=0.9, adjust_lr_fn="original",
                ns_schedule=schedule, normuon_beta2=beta2, cautious=cautious)  # fmt: skip
    reference = {id(p): (p.detach().clone(), {}) for p in matrices}
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(TOKENS[:, :-1], TOKENS[:, 1:]).backward()
        expected = {}
        for p in matrices:
            # each step from our weights and state: bf16 Newton–Schulz would amplify an fp32 ulp of drift
            weights, state = reference[id(p)]
            weights.copy_(p.detach())
            expected[id(p)] = reference_muon_step(weights, p.grad, state, lr=0.02, wd=0.5, momentum=0.9, beta2=beta2,
                                                  cautious=cautious, schedule=schedule)  # fmt: skip
        muon.step()
        for p in matrices:
            change, ref = p.detach() - reference[id(p)][0], expected[id(p)] - reference[id(p)][0]
            torch.testing.assert_close(change, ref, rtol=0, atol=1e-4 * ref.abs().max().item())
            if normuon:
                second = muon.state[p]["normuon_second"]
                torch.testing.assert_close(second, reference[id(p)][1]["second"].float())
                reference[id(p)][1]["second"] = second.clone()
            reference[id(p)][1]["buf"] = muon.state[p]["momentum_buffer"].clone()


def test_cautious_decay_leaves_the_weights_whose_step_points_away_from_zero():
    p = torch.nn.Parameter(torch.tensor([[1.0, -1.0, 2.0, -2.0]]))
    muon = Muon([p], lr=0.1, weight_decay=1.0, momentum=0.0, adjust_lr_fn="original", cautious=True)
    p.grad = torch.tensor([[1.0, 1.0, -1.0, -1.0]])  # the step is -grad: towards zero for the 1st and 4th
    update = newton_schulz(p.grad[None], (3.4445, -4.7750, 2.0315), 5, 1e-7)[0].float()
    muon.step()
    decayed = torch.tensor([[0.1, 0.0, 0.0, -0.2]])  # lr x weight decay x weight, where the mask holds
    torch.testing.assert_close(p.detach(), torch.tensor([[1.0, -1.0, 2.0, -2.0]]) - decayed - 0.1 * update)


def test_a_skipped_step_leaves_normuon_and_cautious_state_untouched():
    model = tiny()
    opt = build_optimizer(
        model, OptimConfig(name="muon"), False, "muon", MuonConfig(normuon=True, cautious_weight_decay=True)
    )
    model(TOKENS[:, :-1], TOKENS[:, 1:]).backward()
    opt.step()
    muon = opt.optimizers[0]
    before = copy.deepcopy({id(p): (p.detach().clone(), dict(muon.state[p])) for p in muon.state})
    for p in muon.state:
        p.grad = torch.full_like(p, float("nan"))
    muon.found_inf = torch.ones(())
    muon.step()
    for p in muon.state:
        weights, state = before[id(p)]
        assert torch.equal(p, weights)
        assert all(torch.equal(muon.state[p][k], v) for k, v in state.items())


def test_momentum_warms_up_then_follows_the_decay_as_nanochat():
    sc = ScheduleConfig(name="wsd", decay_fraction=0.5)
    mc = MuonConfig(momentum=0.97, momentum_start=0.85, momentum_warmup_steps=400, momentum_final=0.90)
    assert muon_momentum_at(0, 0.0, mc, sc) == pytest.approx(0.85)
    assert muon_momentum_at(200, 0.1, mc, sc) == pytest.approx(0.91)
    assert muon_momentum_at(400, 0.2, mc, sc) == pytest.approx(0.97)
    assert muon_momentum_at(1000, 0.5, mc, sc) == pytest.approx(0.97)  # the decay starts at half the budget
    assert muon_momentum_at(1500, 0.75, mc, sc) == pytest.approx(0.935)
    assert muon_momentum_at(2000, 1.0, mc, sc) == pytest.approx(0.90)
    assert muon_schedule_at(5, 0.0, MuonConfig(), sc) is None  # nothing moves: the optimizer as built
    model = tiny()
    opt = build_optimizer(model, OptimConfig(name="muon"), False, "muon", mc)
    assert {g["momentum"] for g in opt.optimizers[0].param_groups} == {0.85}  # step 0's, before any schedule
    set_muon_schedule(opt, muon_schedule_at(200, 0.1, mc, sc))
    assert [g["momentum"] for g in opt.optimizers[0].param_groups] == pytest.approx([0.91])


def test_cosine_weight_decay_falls_to_zero_and_multiplies_muons_decay():
    mc, sc = MuonConfig(weight_decay_schedule="cosine", weight_decay=0.28), ScheduleConfig()
    factors = [muon_schedule_at(0, p, mc, sc).decay_factor for p in (0.0, 0.5, 1.0)]
    assert factors == pytest.approx([1.0, 0.5, 0.0])
    model = tiny()
    opt = build_optimizer(model, OptimConfig(name="muon"), False, "muon", mc)
    muon, adamw = opt.optimizers
    assert {g["weight_decay"] for g in muon.param_groups} == {
        0.28
    }  # Muon's own; AdamW keeps optim.weight_decay
    assert {g["weight_decay"] for g in adamw.param_groups} == {0.1, 0.0}
    weights = [p.detach().clone() for g in muon.param_groups for p in g["params"]]
    set_muon_schedule(opt, muon_schedule_at(10, 1.0, mc, sc))  # at the end: no decay at all
    for g in muon.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    set_lr(opt, 1.0)
    muon.step()  # a zero gradient, a zero decay: nothing moves
    assert all(
        torch.equal(p, w)
        for p, w in zip((p for g in muon.param_groups for p in g["params"]), weights, strict=True)
    )


def effective_lrs(model, opt) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_embedding_and_head_train_at_their_own_lrs_on_the_same_schedule(name):
    model = tiny()
    opt = build_optimizer(
        model,
        OptimConfig(
            name=name,
            lr=0.01,
            groups=[ParamGroupConfig("embed.weight", lr=30.0), ParamGroupConfig("lm_head.weight", lr=0.4)],
        ),
        False,
        name,
    )
    set_lr(opt, 0.005)  # the schedule at half the peak: every group at half its own peak
    lrs = effective_lrs(model, opt)
    assert lrs["embed.weight"] == pytest.approx(0.15) and lrs["lm_head.weight"] == pytest.approx(0.002)
    rest = sorted({v for k, v in lrs.items() if k not in ("embed.weight", "lm_head.weight")})
    assert rest == pytest.approx([0.005])


def test_under_mup_each_group_keeps_its_own_rule():
    """The matrices' 1/m is μP's; the embedding and the head are vector-like (no width factor), so their own LRs
    hold at every width; μP's width-transfer and coordinate checks run bench/coord_check.py with them."""
    lrs = {}
    for dim in (64, 128):
        cfg = ModelConfig(dim=dim, n_layers=2, n_heads=dim // 32, vocab_size=256, max_seq_len=32, parametrization="mup",
                          base_dim=64)  # fmt: skip
        model = build_model(cfg, seed=0)
        opt = build_optimizer(
            model,
            OptimConfig(
                lr=0.01,
                groups=[
                    ParamGroupConfig("embed.weight", lr=30.0),
                    ParamGroupConfig("lm_head.weight", lr=0.4),
                ],
            ),
            False,
            "adamw",
        )
        set_lr(opt, 0.01)
        lrs[dim] = effective_lrs(model, opt)
    for dim in (64, 128):
        assert lrs[dim]["embed.weight"] == pytest.approx(0.3) and lrs[dim]["lm_head.weight"] == pytest.approx(
            0.004
        )
    assert lrs[64]["layers.0.attn.q_proj.weight"] == pytest.approx(0.01)
    assert lrs[128]["layers.0.attn.q_proj.weight"] == pytest.approx(0.005)


def test_original_muon_lr_takes_no_width_factor_under_mup():
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32, parametrization="mup",
                      base_dim=64)  # fmt: skip
    model = build_model(cfg, seed=0)
    opt = build_optimizer(
        model, OptimConfig(name="muon", lr=0.02), False, "muon", MuonConfig(lr_adjust="original")
    )
    set_lr(opt, 0.02)
    assert sorted({g["lr"] for g in opt.optimizers[0].param_groups}) == pytest.approx([0.02])
    assert {g["adjust_lr_fn"] for g in opt.optimizers[0].param_groups} == {"original"}


def test_a_warmup_share_is_laid_on_the_budget_like_the_decay():
    sc = ScheduleConfig(min_lr_ratio=0.0, name="wsd", decay_fraction=0.5, warmup_share=0.1, warmup_steps=999)
    assert counted_warmup_steps(sc) == 0  # warmup_steps is replaced
    tc = TrainConfig(max_hours=1.0)
    lr = [
        lr_at(0, budget_progress(0, 0, t, tc, 0), sc, 1.0)
        for t in (0.0, 180.0, 360.0, 1800.0, 2700.0, 3600.0)
    ]
    # warm-up over the first 6 minutes, stable until half of the remaining 54, then linear to zero
    assert lr == pytest.approx([0.0, 0.5, 1.0, 1.0, 1 - (2700 - 360 - 1620) / 1620, 0.0])
    steps = TrainConfig(max_steps=100)
    by_step = [
        lr_at(s, budget_progress(s, 0, 0.0, steps, counted_warmup_steps(sc)), sc, 1.0) for s in (0, 5, 10)
    ]
    assert by_step == pytest.approx([0.0, 0.5, 1.0])


def test_relu2_mlp_and_softcap_compute_what_they_say():
    model = tiny(mlp="relu2", ffn_dim=96, logit_softcap=3.0)
    mlp = model.layers[0].mlp
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(
        mlp(x), F.linear(F.relu(F.linear(x, mlp.up_proj.weight)) ** 2, mlp.down_proj.weight)
    )
    logits = model(TOKENS[:, :-1])
    assert logits.abs().max() < 3.0
    assert count_params(model.cfg)["total"] == sum(p.numel() for p in model.parameters())
    # at equal parameters a ReLU² MLP is 1.5x as wide as SwiGLU's (two matrices for three)
    swiglu = ModelConfig(dim=64, n_layers=2, n_heads=2, vocab_size=256, ffn_dim=192)
    relu2 = ModelConfig(dim=64, n_layers=2, n_heads=2, vocab_size=256, ffn_dim=288, mlp="relu2")
    assert count_params(swiglu) == count_params(relu2)
    assert ModelConfig(dim=64, mlp="relu2").hidden_dim == 256


def test_the_fused_loss_softcaps_as_the_standard_one():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(40, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    t = torch.randint(0, 50, (40,), generator=gen)
    fused = linear_cross_entropy(h, w, t, chunk_tokens=16, softcap=4.0)
    grads = torch.autograd.grad(fused, (h, w))
    standard = standard_cross_entropy(softcapped(h @ w.T, 4.0), t)
    torch.testing.assert_close(fused, standard)
    for got, want in zip(grads, torch.autograd.grad(standard, (h, w)), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"muon": {"normuon": True}}, "muon.normuon is a setting of Muon's"),
        ({"muon": {"cautious_weight_decay": True}}, "muon.cautious_weight_decay is a setting of Muon's"),
        ({"muon": {"momentum_warmup_steps": 10}}, "set optim.name muon"),
        ({"muon": {"momentum": 0.9}}, "muon.momentum is a setting of Muon's"),  # (accepted silently before)
        ({"muon": {"lr_adjust": "spectral"}}, "muon.lr_adjust is a setting of Muon's"),
        (
            {"optim": {"name": "muon"}, "muon": {"normuon_beta2": 0.9}},
            "read only by NorMuon; set muon.normuon true",
        ),
        ({"optim": {"name": "muon"}, "muon": {"momentum_start": 0.8}}, "set muon.momentum_warmup_steps"),
        ({"optim": {"name": "muon"}, "muon": {"ns_safety": 1.01}}, "read only by Polar Express; set muon.ns"),
        (
            {"optim": {"name": "muon"}, "muon": {"ns": "polar_express", "ns_safety": 0.9}},
            "must be in [1, 1.5]",
        ),
        ({"schedule": {"warmup_share": 1.5}}, "schedule.warmup_share=1.5 must be in (0, 1)"),
        ({"optim": {"groups": [{"pattern": "embed.weight", "lr": -1.0}]}}, "lr=-1.0 must be positive"),
        ({"optim": {"betas": [0.9]}}, "betas=[0.9] must be two numbers in [0, 1)"),
    ],
)
def test_settings_that_do_not_fit_are_refused_in_one_line(raw, words):
    with pytest.raises(ConfigError, match=".*") as err:
        config_from_dict({**raw, "train": {"max_steps": 1}})
    assert words in str(err.value) and "\n" not in str(err.value)
