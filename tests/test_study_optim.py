"""The trainer's optimizer, schedule and loss scaler come from timm; each checked against an
independent reference: the study's earlier hand-written formulas (written out here), timm's own
factory, and a hand-driven ``torch.amp.GradScaler``."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2, param_groups_weight_decay

from vitattn.study import make_config
from vitattn.study.amp import autocast, grad_scaler
from vitattn.study.model import build_model
from vitattn.study.optim import build_optimizer, param_groups
from vitattn.study.train import warmup_cosine


def old_warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The study's schedule before timm's: the lr factor of optimizer step ``step`` (from 0)."""
    total = max(total, 1)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup", [0, 1, 2, 5, 12])
@pytest.mark.parametrize("total", [1, 2, 7, 12, 40])
def test_warmup_cosine_gives_the_old_per_step_lrs(warmup: int, total: int) -> None:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "lr_scale": 0.25}, {"params": [params[2]]}]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    scheduler = warmup_cosine(optimizer, warmup, total)
    scales = [1.0, 0.25, 1.0]
    for step in range(total + 3):  # past the end too: 0
        scheduler.step_update(step + 1)  # the trainer's call before step `step`
        want = [3e-3 * s * old_warmup_cosine(step, warmup, total) for s in scales]
        got = [g["lr"] for g in optimizer.param_groups]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-18), (step, got, want)


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[list[int], float, float]]:
    return [
        ([id(p) for p in g["params"]], g.get("lr_scale", 1.0), g["weight_decay"])
        for g in optimizer.param_groups
    ]


def test_layer_decay_optimizer_is_timms() -> None:
    config = make_config("quick", depth=2, dim=32, heads=4, layer_decay=0.6, lr=2e-3, weight_decay=0.05)
    model = build_model(config, "locat")
    ours = build_optimizer(model, config)
    ref = create_optimizer_v2(model, opt="adamw", lr=2e-3, weight_decay=0.05, layer_decay=0.6)
    assert type(ours) is type(ref) is torch.optim.AdamW
    assert _groups(ours) == _groups(ref) and len(ours.param_groups) > 2
    assert {g["lr"] for g in ours.param_groups} == {2e-3}  # the scheduler multiplies lr_scale in


def test_no_layer_decay_keeps_the_study_rule() -> None:
    """Matrices decay, except names with pos_embed / token: on the study ViT the same split as timm's
    param_groups_weight_decay with model.no_weight_decay(); on Swin timm spares the relative
    position bias tables, the study decays them."""
    config = make_config("quick", depth=2, dim=32, heads=4, weight_decay=0.05)
    model = build_model(config, "locat")
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = build_optimizer(model, config).param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    params = model.named_parameters()
    want = [n for n, p in params if p.ndim > 1 and "pos_embed" not in n and "token" not in n]
    assert [names[id(p)] for p in decay["params"]] == want
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    timm_decay = {
        id(p)
        for g in param_groups_weight_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay())
        if g["weight_decay"]
        for p in g["params"]
    }
    assert timm_decay == {id(p) for p in decay["params"]}

    swin = timm.create_model(
        "swin_tiny_patch4_window7_224", embed_dim=8, depths=(1, 1), num_heads=(1, 1), num_classes=3
    )
    table = swin.layers[0].blocks[0].attn.relative_position_bias_table
    ours, _ = param_groups(swin, config)
    theirs = param_groups_weight_decay(swin, 0.05, no_weight_decay_list=swin.no_weight_decay())
    assert any(p is table for p in ours["params"])
    assert not any(p is table for g in theirs if g["weight_decay"] for p in g["params"])


def test_native_scaler_step_equals_a_hand_driven_grad_scaler() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    cpu = torch.device("cpu")
    scaler = grad_scaler(cpu, "fp16")
    ref = torch.amp.GradScaler("cpu")
    assert scaler is not None and scaler.state_dict() == ref.state_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for _ in range(3):
        with autocast(cpu, "fp16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            ref_loss = torch.nn.functional.cross_entropy(ref_model(x), y)
        opt.zero_grad()
        scaler(loss, opt)
        ref_opt.zero_grad()
        ref.scale(ref_loss).backward()
        ref.step(ref_opt)
        ref.update()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scaler.state_dict() == ref.state_dict()
