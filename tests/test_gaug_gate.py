"""The identity start of GAug (``gaug_init="identity"``): a zero-initialised per-head gate on the
amplitude, ``α_h = gate_h · softplus(log_alpha(q))``.

At patch time the model computes what it did (the bias is exactly zero), the gate gets a non-zero
gradient, and one AdamW step moves it by about the learning rate (it is linear in its parameter), on
a timm ViT, an Eva, a Swin and a transformers model. The gate exists only where the identity start
asked for it (official checkpoints keep loading with ``strict=True`` into models built the paper's
way), every parameter is initialised by ``init_weights``, and a negative amplitude (the gate is
signed) is computed right by every backend, gradients included.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vitattn
from vitattn.functional import GaussianBias, attention
from vitattn.layers import GaussianAugment, LocAtAttention
from vitattn.models import LocAtViT

from .test_patch import IDENTITY_CASES, TINY, _scaled_up


def _gates(model: nn.Module) -> list[nn.Parameter]:
    return [m.gate for m in model.modules() if isinstance(m, GaussianAugment) and m.gate is not None]


def _size(family: str) -> int:
    return 64 if family == "swin" else 32


# ---- patch time: the same function, a gradient, an lr-sized first step -----------------------------------
@pytest.mark.parametrize("family", IDENTITY_CASES)
def test_identity_start_is_the_unpatched_model_and_its_gate_learns(family: str) -> None:
    model = _scaled_up(IDENTITY_CASES[family]())
    x = torch.randn(2, 3, _size(family), _size(family))
    with torch.no_grad():
        before = model(x)
    patched = vitattn.patch(copy.deepcopy(model), "locat", gaug_init="identity")
    gates = _gates(patched)
    assert gates and all(torch.equal(g, torch.zeros_like(g)) for g in gates)
    with torch.no_grad():
        # the bias is exactly zero: only the attention path's own rounding differs (measured <= 1.2e-7)
        torch.testing.assert_close(patched(x), before, atol=1e-6, rtol=0)
    patched.train()
    lr = 1e-3
    opt = torch.optim.AdamW(gates, lr=lr, weight_decay=0.0)
    target = torch.randn_like(before)
    loss = (patched(x) - target).square().mean()
    loss.backward()
    grads = torch.cat([g.grad for g in gates])
    assert torch.isfinite(grads).all() and grads.abs().max() > 1e-6
    opt.step()
    moved = torch.cat([g.detach() for g in gates])
    # Adam's first step is lr * sign(grad) wherever the gradient is non-zero: an lr-sized move
    live = grads != 0
    torch.testing.assert_close(moved[live].abs(), torch.full_like(moved[live], lr), rtol=1e-3, atol=0)
    assert torch.all(moved[~live] == 0)


def test_identity_start_on_a_transformers_model() -> None:
    from .hf_tiny import hidden, images, tiny_model

    model = tiny_model("dinov2")
    x = images()
    with torch.no_grad():
        before = hidden(model, x).last_hidden_state
    patched = vitattn.patch(copy.deepcopy(model), "locat", gaug_init="identity")
    gates = _gates(patched)
    assert len(gates) == 2 and all(g.shape == (4,) and not g.any() for g in gates)
    assert all(k.endswith(".gaug.gate") for k in patched.state_dict() if k.endswith("gate"))
    with torch.no_grad():
        torch.testing.assert_close(hidden(patched, x).last_hidden_state, before, atol=1e-6, rtol=0)
    patched.train()
    hidden(patched, x).last_hidden_state.square().sum().backward()  # every token: every layer counts
    for g in gates:
        assert g.grad is not None and torch.isfinite(g.grad).all() and g.grad.abs().max() > 1e-6
    opt = torch.optim.AdamW(gates, lr=1e-3, weight_decay=0.0)
    opt.step()
    assert all((g.abs() - 1e-3).abs().max() < 1e-6 for g in gates)


def test_identity_start_trains_away_from_identity() -> None:
    """A few AdamW steps at a fine-tuning learning rate: the gate leaves 0, then log_alpha gets a
    gradient too, and the loss goes down."""
    torch.manual_seed(0)
    model = vitattn.patch(_scaled_up(VisionTransformer(**TINY)), "locat", gaug_init="identity").train()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    first = model.blocks[0].attn.gaug
    assert first.gate.abs().max() > 2e-3  # steps of about lr each, not factors e^lr of a tiny start
    assert first.log_alpha.bias.grad.abs().item() > 0
    assert losses[-1] < losses[0]


# ---- the gate exists only where the identity start asked for it -------------------------------------------
def test_gate_only_with_the_identity_start() -> None:
    paper = GaussianAugment(16)
    assert paper.gate is None and set(paper.state_dict()) == {
        "log_var.weight", "log_var.bias", "log_alpha.weight", "log_alpha.bias"
    }  # fmt: skip
    gated = GaussianAugment(16, init="identity", num_heads=3)
    assert gated.gate.shape == (3,) and "gate" in gated.state_dict() and gated.start == "identity"
    with pytest.raises(ValueError, match="needs num_heads"):
        GaussianAugment(16, init="identity")
    with pytest.raises(ValueError, match="built without"):
        paper.init_weights("identity")
    model = LocAtViT(**TINY)  # the paper's way: the official layout, no gate key
    assert not any(k.endswith("gate") for k in model.state_dict())
    patched = vitattn.patch(VisionTransformer(**TINY), "locat")
    assert not _gates(patched)


@pytest.mark.parametrize("init", ["paper", "identity"])
def test_init_weights_initialises_every_parameter(init: str) -> None:
    """What a model's own weight init (transformers' ``_init_weights``, a meta-device load) relies on:
    after ``init_weights()`` no parameter keeps a stale value, the gate included."""
    gaug = GaussianAugment(16, init=init, num_heads=4) if init == "identity" else GaussianAugment(16)
    with torch.no_grad():
        for p in gaug.parameters():
            p.fill_(float("nan"))
    gaug.init_weights()  # the start it was built with
    for name, p in gaug.named_parameters():
        assert torch.isfinite(p).all(), name
    assert torch.all(gaug.log_var.bias == 0) and torch.all(gaug.log_alpha.bias == 0)
    assert 0 < gaug.log_alpha.weight.std() < 0.05
    if init == "identity":
        assert torch.all(gaug.gate == 0)
        gaug.init_weights("paper")  # the paper's start behind the same gate: gate 1
        assert torch.all(gaug.gate == 1)


def test_a_gated_checkpoint_loads_into_a_model_built_the_paper_way() -> None:
    """A model fine-tuned from the identity start, saved, and loaded strictly into a LocAtViT built the
    paper's way: the gate comes with the state dict and the outputs are the saved model's."""
    torch.manual_seed(0)
    tuned = vitattn.patch(_scaled_up(VisionTransformer(**TINY)), "locat", gaug_init="identity")
    with torch.no_grad():
        for g in _gates(tuned):
            g.copy_(torch.tensor([0.7, -0.4]))
    state = tuned.state_dict()
    fresh = LocAtViT(**TINY, prr=False).eval()
    assert not _gates(fresh)
    fresh.load_state_dict(state, strict=True)
    assert len(_gates(fresh)) == TINY["depth"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), tuned(x), atol=1e-6, rtol=0)
    official = LocAtViT(**TINY, prr=False)  # and a gate-less (official) state dict, strict, still loads
    official.load_state_dict(LocAtViT(**TINY, prr=False).state_dict(), strict=True)
    assert not _gates(official)


def test_identity_model_from_a_checkpoint_with_gaug_weights(tmp_path) -> None:
    """``gaug_init="identity"`` on a checkpoint that has GAug weights (an official one): the
    checkpoint's heads act as trained (gate 1), as the paper-built model computes."""
    from safetensors.torch import save_file

    kwargs = dict(img_size=32, patch_size=8, depth=2, num_classes=5, prr=False)
    source = _scaled_up(timm.create_model("locatvit_tiny", **kwargs))
    path = tmp_path / "locat.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    overlay = dict(file=str(path))
    model = timm.create_model(
        "locatvit_tiny", pretrained=True, pretrained_cfg_overlay=overlay, gaug_init="identity", **kwargs
    ).eval()
    assert [float(g.min()) for g in _gates(model)] == [1.0, 1.0]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), atol=1e-6, rtol=0)


def test_a_gated_transformers_model_saves_and_loads(tmp_path) -> None:
    from .hf_tiny import hidden, images, tiny_model

    model = vitattn.patch(tiny_model("vit"), "locat", gaug_init="identity")
    with torch.no_grad():
        for g in _gates(model):
            g.copy_(torch.tensor([0.5, -1.0, 0.25, 2.0]))
    assert model.config.vitattn["version"] == 2
    assert all(entry["gate"] for entry in model.config.vitattn["layers"].values())
    x = images()
    with torch.no_grad():
        want = hidden(model, x).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = vitattn.hf.from_pretrained(tmp_path)
    assert [g.tolist() for g in _gates(loaded)] == [[0.5, -1.0, 0.25, 2.0]] * 2
    with torch.no_grad():
        torch.testing.assert_close(hidden(loaded, x).last_hidden_state, want)
    with pytest.raises(ValueError, match="version 1 or 2"):
        vitattn.hf.patching.apply_record(tiny_model("vit"), {**model.config.vitattn, "version": 3})


# ---- a negative amplitude, on every backend ----------------------------------------------------------------
def _signed_case(dtype: torch.dtype, seed: int = 0, small: bool = False):
    g = torch.Generator().manual_seed(seed)
    b, h, grid, prefix, d = (1, 2, (2, 3), 1, 3) if small else (2, 3, (4, 5), 1, 8)
    n = prefix + grid[0] * grid[1]
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * 1.5 for _ in range(3))
    sigma = torch.exp(torch.randn(b, h, n - prefix, 2, generator=g, dtype=torch.float64) * 0.7)
    alpha = (torch.rand(b, h, n - prefix, 1, generator=g, dtype=torch.float64) * 2 - 1) * 4  # [-4, 4]
    alpha[:, 0] = -alpha[:, 0].abs()  # one head all negative
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, sigma, alpha)]
    return leaves, grid, prefix


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
@pytest.mark.parametrize("backend", ["cpu_blocked", "sdpa"])
@pytest.mark.parametrize("grads", [False, True], ids=["inference", "training"])
def test_negative_amplitude_matches_reference(normalizer: str, backend: str, grads: bool) -> None:
    """α < 0 (a signed gate) on the CPU row-blocked paths (inference and the autograd path) and SDPA:
    output and every gradient (q, k, v, σ, α) against the float64 reference."""
    if backend == "sdpa" and normalizer != "softmax":
        pytest.skip("SDPA computes softmax only")
    ours, grid, prefix = _signed_case(torch.float32)
    ref = [t.detach().double().requires_grad_() for t in ours]

    def run(t, name):
        bias = GaussianBias(t[3], t[4], grid, prefix)
        return attention(t[0], t[1], t[2], normalizer=normalizer, bias=bias, backend=name)

    with torch.set_grad_enabled(grads):
        out = run(ours, backend)
    expect = run(ref, "reference")
    torch.testing.assert_close(out.double(), expect, atol=2e-6, rtol=1e-5)
    if not grads:
        return
    w = torch.randn(expect.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, ours, w.float())
    want = torch.autograd.grad(expect, ref, w)
    for name, a, e in zip(["q", "k", "v", "sigma", "alpha"], got, want, strict=True):
        torch.testing.assert_close(a.double(), e, atol=2e-5, rtol=1e-4, msg=name)


def test_negative_amplitude_gradcheck() -> None:
    """The reference's Gaussian bias in float64 for α < 0: autograd against finite differences."""
    (q, k, v, sigma, alpha), grid, prefix = _signed_case(torch.float64, seed=3, small=True)

    def fn(q, k, v, sigma, alpha):
        bias = GaussianBias(sigma, alpha, grid, prefix)
        return attention(q, k, v, bias=bias, backend="reference")

    assert torch.autograd.gradcheck(fn, (q, k, v, sigma, alpha), eps=1e-6, atol=1e-5, fast_mode=True)


def test_signed_gate_in_a_layer_matches_the_unbiased_one_at_zero() -> None:
    """Gate exactly 0 in a layer: the same output as the layer without GAug, for both normalizers."""
    for normalizer in ("softmax", "entmax15"):
        layer = LocAtAttention(32, 2, grid_size=(4, 4), normalizer=normalizer, gaug_init="identity").eval()
        plain = vitattn.layers.Attention(32, 2, normalizer=normalizer).eval()
        plain.load_state_dict({k: v for k, v in layer.state_dict().items() if ".gaug." not in f".{k}"})
        x = torch.randn(2, 17, 32)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), plain(x), atol=1e-6, rtol=0)
