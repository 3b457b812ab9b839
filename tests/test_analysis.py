"""Analysis: attention maps from timm / vitattn ViTs, locality metrics, reports, plots, `vitattn analyze`.

Maps are checked against probabilities computed by hand from each block's input (qkv linear, q_norm,
k_norm, scale, an independent GAug bias from ``reference_formulas.naive_gaug_bias``, the `entmax`
package's normalizer); metrics against the known values of DESIGN.md and a brute-force loop.
"""

from __future__ import annotations

import json
import math
import pickle

import entmax as entmax_pkg
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vitattn
from vitattn.analysis import (
    LocalityReport,
    attention_entropy,
    attention_maps,
    locality_report,
    mean_attention_distance,
    record_attention,
    timm_attention_probs,
)
from vitattn.cli import main
from vitattn.functional.capture import active_callbacks
from vitattn.models import LocAtViT

from .reference_formulas import naive_gaug_bias

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
TINY_ARGS = ["--model-arg", "img_size=32", "--model-arg", "patch_size=8", "--model-arg", "embed_dim=32"]
TINY_ARGS += ["--model-arg", "depth=2", "--model-arg", "num_heads=2", "--model-arg", "num_classes=5"]


# ---- helpers -----------------------------------------------------------------------------------------
def timm_vit(**kw) -> VisionTransformer:
    model = VisionTransformer(**{**TINY, **kw}).eval()
    assert all(b.attn.fused_attn for b in model.blocks)  # the SDPA path, which returns no weights
    return model


def spread_weights(model: nn.Module, std: float = 0.3) -> None:
    """Larger random qkv weights than the init, so that the maps are far from uniform."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.copy_(torch.randn(block.attn.qkv.weight.shape, generator=g) * std)


def block_inputs(model: VisionTransformer, x: torch.Tensor) -> list[torch.Tensor]:
    """The input of every block's ``attn``: the model's stem and blocks run one by one, no hooks."""
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    out = []
    for block in model.blocks:
        out.append(block.norm1(h))
        h = block(h)
    return out


def hand_qk(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, _ = x.shape
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias).reshape(b, n, 3, attn.num_heads, attn.head_dim)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    return attn.q_norm(q).double(), attn.k_norm(k).double()


def hand_gaug_bias(attn: nn.Module, q: torch.Tensor, grid: tuple[int, int], prefix: int) -> torch.Tensor:
    """GAug's σ and α from the definition, then the bias from the naive reference."""
    c = max(grid) ** 2
    q_sp = q[:, :, prefix:]
    lv, la = attn.gaug.log_var, attn.gaug.log_alpha
    sigma = c * torch.sigmoid(q_sp @ lv.weight.double().T + lv.bias.double() - math.log(c - 1))
    alpha = F.softplus(q_sp @ la.weight.double().T + la.bias.double())
    return naive_gaug_bias(sigma, alpha, grid, prefix, grid)


def hand_probs(attn: nn.Module, x: torch.Tensor, normalizer: str, bias: torch.Tensor | None = None):
    q, k = hand_qk(attn, x)
    scores = (q @ k.transpose(-1, -2)) * attn.head_dim**-0.5
    if bias is not None:
        scores = scores + bias
    return scores.softmax(-1) if normalizer == "softmax" else entmax_pkg.entmax15(scores, dim=-1)


def hook_counts(model: nn.Module) -> list[tuple[int, ...]]:
    return [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        + (len(m._forward_hooks_with_kwargs), len(m._forward_pre_hooks_with_kwargs))
        for m in model.modules()
    ]


def brute_force(a: torch.Tensor, grid: tuple[int, int], prefix: int, patch=(1, 1)) -> tuple[float, float]:
    """Un-normalized MAD and entropy (nats) of one (N, N) map by loops over queries and keys."""
    gh, gw = grid
    mads, ents = [], []
    for i in range(gh * gw):
        row = [float(a[prefix + i, prefix + j]) for j in range(gh * gw)]
        mass = sum(row)
        if mass == 0:
            continue
        row = [p / mass for p in row]
        ri, ci = divmod(i, gw)
        mads.append(
            sum(
                p * math.hypot((ri - j // gw) * patch[0], (ci - j % gw) * patch[1]) for j, p in enumerate(row)
            )
        )
        ents.append(-sum(p * math.log(p) for p in row if p > 0))
    return (sum(mads) / len(mads), sum(ents) / len(ents)) if mads else (math.nan, math.nan)


def neighbour_map(gh: int, gw: int) -> torch.Tensor:
    """(Np, Np): each patch's attention spread evenly over its existing 4-neighbours."""
    a = torch.zeros(gh * gw, gh * gw, dtype=torch.float64)
    for r in range(gh):
        for c in range(gw):
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                if 0 <= r + dr < gh and 0 <= c + dc < gw:
                    a[r * gw + c, (r + dr) * gw + c + dc] = 1
    return a / a.sum(-1, keepdim=True)


def with_prefix(a: torch.Tensor, prefix: int, prefix_mass: float = 0.3) -> torch.Tensor:
    """Add ``prefix`` tokens: every row gives them ``prefix_mass`` (patch rows keep their shape)."""
    n = a.shape[-1] + prefix
    out = torch.full((n, n), 1.0 / n, dtype=a.dtype)
    out[prefix:, :prefix] = prefix_mass / prefix
    out[prefix:, prefix:] = a * (1 - prefix_mass)
    return out


# ---- metrics: known values ---------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", [0, 1, 4])
def test_known_values_8x8(prefix: int) -> None:
    """DESIGN.md: uniform 4.1365 / 0.4178 / entropy 1; 4-neighbours 1.0 / 0.1010 / 0.2970; self 0, 0."""
    uniform = torch.full((64, 64), 1 / 64, dtype=torch.float64)
    cases = [(uniform, 4.1365, 0.4178, 1.0), (neighbour_map(8, 8), 1.0, 0.1010, 0.2970)]
    cases.append((torch.eye(64, dtype=torch.float64), 0.0, 0.0, 0.0))
    for a, mad_patches, mad_norm, ent in cases:
        attn = (with_prefix(a, prefix) if prefix else a).float().expand(2, 3, -1, -1)
        got = mean_attention_distance(attn, 8, prefix, normalize=False)
        assert got.shape == (2, 3)
        assert torch.allclose(got, torch.tensor(mad_patches), atol=1e-4)
        assert torch.allclose(
            mean_attention_distance(attn, (8, 8), prefix), torch.tensor(mad_norm), atol=1e-4
        )
        assert torch.allclose(attention_entropy(attn, prefix), torch.tensor(ent), atol=1e-4)


@pytest.mark.parametrize("grid", [(3, 5), (6, 2), (1, 7)])
def test_known_values_non_square_grids(grid: tuple[int, int]) -> None:
    gh, gw = grid
    diag = math.hypot(gh - 1, gw - 1)
    nb = neighbour_map(gh, gw)[None, None]
    assert torch.allclose(
        mean_attention_distance(nb, grid, normalize=False), torch.tensor(1.0, dtype=torch.float64)
    )
    assert torch.allclose(mean_attention_distance(nb, grid), torch.tensor(1 / diag, dtype=torch.float64))
    n = gh * gw
    uniform = torch.full((1, 1, n, n), 1 / n)
    mad, ent = brute_force(uniform[0, 0], grid, 0)
    assert mean_attention_distance(uniform, grid, normalize=False).item() == pytest.approx(mad, abs=1e-5)
    assert attention_entropy(uniform).item() == pytest.approx(1.0, abs=1e-6)
    eye = torch.eye(n)[None, None]
    assert mean_attention_distance(eye, grid).item() == 0 and attention_entropy(eye).item() == 0


def test_pixels_with_patch_size() -> None:
    nb = neighbour_map(4, 6)
    mad_px, _ = brute_force(nb, (4, 6), 0, patch=(2, 3))
    got = mean_attention_distance(nb[None, None], (4, 6), normalize=False, patch_size=(2, 3))
    assert got.item() == pytest.approx(mad_px, abs=1e-9)
    square = mean_attention_distance(nb[None, None], (4, 6), normalize=False, patch_size=16)
    assert square.item() == pytest.approx(16.0)
    with pytest.raises(ValueError, match="normalize=False"):
        mean_attention_distance(nb[None, None], (4, 6), patch_size=16)


@settings(max_examples=30)
@given(
    gh=st.integers(1, 4),
    gw=st.integers(1, 5),
    prefix=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_metrics_match_brute_force(gh: int, gw: int, prefix: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = prefix + gh * gw
    logits = torch.randn(2, 2, n, n, generator=g, dtype=torch.float64) * 3
    attn = torch.where(torch.rand(2, 2, n, n, generator=g, dtype=torch.float64) < 0.3, -math.inf, logits)
    attn[..., 0] = logits[..., 0]  # no all-masked row
    attn = attn.softmax(-1)
    mad = mean_attention_distance(attn, (gh, gw), prefix, normalize=False)
    mad_n = mean_attention_distance(attn, (gh, gw), prefix)
    ent_n = attention_entropy(attn, prefix)
    diag, log_np = math.hypot(gh - 1, gw - 1), math.log(gh * gw)
    for b in range(2):
        for h in range(2):
            want_mad, want_ent = brute_force(attn[b, h], (gh, gw), prefix)
            assert mad[b, h].item() == pytest.approx(want_mad, abs=1e-9)
            assert mad_n[b, h].item() == pytest.approx(want_mad / diag if diag else 0.0, abs=1e-9)
            assert ent_n[b, h].item() == pytest.approx(want_ent / log_np if gh * gw > 1 else 0.0, abs=1e-9)
            assert 0 <= mad_n[b, h] <= 1 + 1e-12 and 0 <= ent_n[b, h] <= 1 + 1e-12


def test_rows_without_patch_mass_are_left_out() -> None:
    a = with_prefix(torch.eye(16, dtype=torch.float64), 1)
    a[1 + 3] = 0
    a[1 + 3, 0] = 1  # query patch 3 looks only at the class token: not part of the mean
    a[1 + 5] = 0
    a[1 + 5, 1:] = 1 / 16  # query patch 5 looks uniformly
    mad, ent = brute_force(a, (4, 4), 1)
    got = mean_attention_distance(a[None, None], 4, 1, normalize=False)
    assert got.item() == pytest.approx(mad) and mad > 0
    assert attention_entropy(a[None, None], 1, normalize=False).item() == pytest.approx(ent)
    only_cls = torch.zeros(1, 2, 17, 17)
    only_cls[..., 0] = 1
    assert mean_attention_distance(only_cls, 4, 1).isnan().all()
    assert attention_entropy(only_cls, 1).isnan().all()


def test_one_patch_grid_is_zero_not_nan() -> None:
    a = torch.tensor([[[[0.5, 0.5], [0.2, 0.8]]]])
    assert mean_attention_distance(a, 1, 1).item() == 0.0
    assert attention_entropy(a, 1).item() == 0.0


def test_metric_errors_name_shapes() -> None:
    attn = torch.full((2, 3, 50, 50), 1 / 50)
    with pytest.raises(ValueError, match=r"\(2, 3, 50, 50\).*\(7, 7\).*num_prefix_tokens=0"):
        mean_attention_distance(attn, 7)
    with pytest.raises(ValueError, match=r"\(2, 3, 50, 50\)"):
        mean_attention_distance(attn, (7, 7), num_prefix_tokens=2)
    with pytest.raises(ValueError, match=r"\(2, 3, 50, 50\)"):
        attention_entropy(attn, 1, grid_size=(7, 8))
    with pytest.raises(ValueError, match="no patch tokens"):
        attention_entropy(attn, 50)
    with pytest.raises(ValueError, match=r"\(\.\.\., N, N\)"):
        mean_attention_distance(torch.ones(50), 7)
    with pytest.raises(ValueError, match="grid_size"):
        mean_attention_distance(attn, (0, 7))


# ---- attention maps ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["cls", "cls+reg", "avgpool"])
def test_maps_of_timm_fused_attention(layout: str) -> None:
    kw = dict(qk_norm=True, qkv_bias=True)
    if layout == "cls+reg":
        kw.update(reg_tokens=2)
    if layout == "avgpool":
        kw.update(class_token=False, global_pool="avg")
    model = timm_vit(**kw)
    spread_weights(model)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        y0 = model(x)
        inputs = block_inputs(model, x)
    before = hook_counts(model)
    maps = attention_maps(model, x)
    assert list(maps) == [0, 1]
    n = model.num_prefix_tokens + 16
    for i, xin in enumerate(inputs):
        assert maps[i].shape == (3, 2, n, n) and not maps[i].requires_grad
        want = hand_probs(model.blocks[i].attn, xin, "softmax").float()
        torch.testing.assert_close(maps[i], want, atol=1e-6, rtol=1e-5)
    assert hook_counts(model) == before and all(not b.attn._forward_hooks for b in model.blocks)
    assert active_callbacks() == ()
    with torch.no_grad():
        assert torch.equal(model(x), y0)
        seen = {}
        with record_attention(model, lambda i, p: seen.setdefault(i, p), layers=[-1]):
            assert torch.equal(model(x), y0)  # timm's own path runs untouched
    assert list(seen) == [1] and torch.equal(seen[1], maps[1])
    assert hook_counts(model) == before


def test_timm_attention_probs_follow_masks() -> None:
    """With a bool or additive mask (or causal), the recomputed probs reproduce timm's SDPA output."""
    attn = timm_vit().blocks[0].attn
    x = torch.randn(2, 9, 32)
    keep = torch.rand(2, 1, 9, 9) > 0.3
    keep[..., 0] = True
    for kwargs in (dict(attn_mask=keep), dict(attn_mask=torch.randn(2, 2, 9, 9)), dict(is_causal=True)):
        probs = timm_attention_probs(attn, x, **kwargs)
        v = attn.qkv(x).reshape(2, 9, 3, 2, 16)[:, :, 2].transpose(1, 2)
        out = attn.proj((probs @ v).transpose(1, 2).reshape(2, 9, 32))
        torch.testing.assert_close(out, attn(x, **kwargs), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("how", ["patched", "built"])
def test_maps_of_entmax_attention(how: str) -> None:
    if how == "patched":
        model = vitattn.patch(timm_vit(qk_norm=True), "entmax15")
    else:
        model = LocAtViT(**TINY, gaug=False, prr=False, normalizer="entmax15").eval()
    assert (
        isinstance(model.blocks[0].attn, vitattn.EntmaxAttention)
        or model.blocks[0].attn.normalizer == "entmax15"
    )
    spread_weights(model, std=0.6)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        inputs = block_inputs(model, x)
    maps = attention_maps(model, x)
    for i, xin in enumerate(inputs):
        want = hand_probs(model.blocks[i].attn, xin, "entmax15").float()
        torch.testing.assert_close(maps[i], want, atol=1e-5, rtol=1e-4)
    assert (maps[1] == 0).float().mean() > 0.2  # genuinely sparse maps
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.blocks.modules())


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_maps_of_locat_attention(normalizer: str) -> None:
    model = LocAtViT(**TINY, normalizer=normalizer).eval()
    spread_weights(model, std=0.2)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # σ from small to large, α around 1-3: a bias that shows
        for block in model.blocks:
            block.attn.gaug.log_var.weight.copy_(torch.randn(2, 16, generator=g))
            block.attn.gaug.log_alpha.bias.fill_(1.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        y0 = model(x)
        inputs = block_inputs(model, x)
    before = hook_counts(model)
    maps = attention_maps(model, x, layers=[0, -1])
    for i, xin in enumerate(inputs):
        attn = model.blocks[i].attn
        q, _ = hand_qk(attn, xin)
        want = hand_probs(attn, xin, normalizer, hand_gaug_bias(attn, q, (4, 4), 1)).float()
        torch.testing.assert_close(maps[i], want, atol=1e-5, rtol=1e-4)
        plain = hand_probs(attn, xin, normalizer).float()
        assert (maps[i] - plain).abs().max() > 1e-2  # the GAug bias is really in the maps
    assert hook_counts(model) == before  # LocAtViT's own grid hook stays, ours are gone
    with torch.no_grad():
        torch.testing.assert_close(model(x), y0, atol=0, rtol=0)


def test_maps_keep_training_flags_and_grad_mode() -> None:
    model = timm_vit()
    model.train()
    model.blocks[0].eval()
    flags = [m.training for m in model.modules()]
    x = torch.randn(1, 3, 32, 32)
    maps = attention_maps(model, x)
    assert [m.training for m in model.modules()] == flags
    assert torch.is_grad_enabled()
    assert torch.equal(maps[0], attention_maps(model.eval(), x)[0])


class _OpaqueAttention(nn.Module):
    """Attention that calls neither timm's code nor vitattn.functional.attention."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 2

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return x


def test_map_errors_and_cleanup() -> None:
    model = timm_vit()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="out of range"):
        attention_maps(model, x, layers=[2])
    with pytest.raises(TypeError, match="block indices"):
        attention_maps(model, x, layers=["0"])
    model.blocks[1].attn = _OpaqueAttention()
    before = hook_counts(model)
    with pytest.raises(TypeError, match=r"blocks\[1\]\.attn is _OpaqueAttention"):
        attention_maps(model, x)
    assert hook_counts(model) == before and active_callbacks() == ()
    assert list(attention_maps(model, x, layers=0)) == [0]
    with pytest.raises(TypeError, match="blocks"):
        attention_maps(nn.Linear(2, 2), x)


# ---- reports -----------------------------------------------------------------------------------------
def test_report_averages_images_and_reads_layout() -> None:
    model = timm_vit(reg_tokens=1)
    spread_weights(model)
    x = torch.randn(6, 3, 32, 32)
    data = [(x[:4], torch.zeros(4)), (x[4:], torch.zeros(2))]
    report = locality_report(model, data, max_images=5, progress=False)
    maps = attention_maps(model, x[:5])
    assert report.layers == [0, 1] and report.num_images == 5
    assert report.grid_size == (4, 4) and report.num_prefix_tokens == 2
    for li, i in enumerate(report.layers):
        mad = mean_attention_distance(maps[i], 4, 2).mean(0)
        ent = attention_entropy(maps[i], 2).mean(0)
        assert report.mad[li] == pytest.approx(mad.tolist(), abs=1e-6)
        assert report.entropy[li] == pytest.approx(ent.tolist(), abs=1e-6)
    same = locality_report(model, x[:5], layers=[1], progress=False)  # a plain tensor batch
    assert same.layers == [1] and same.mad[0] == pytest.approx(report.mad[1], abs=1e-6)
    pair = locality_report(model, (x[:5], torch.zeros(5)), progress=False)
    assert pair.num_images == 5
    explicit = locality_report(model, x[:2], grid_size=(4, 4), num_prefix_tokens=2, progress=False)
    assert explicit.grid_size == (4, 4)
    with pytest.raises(ValueError, match=r"N = 18 tokens.*\(2, 8\)"):
        locality_report(model, x[:2], grid_size=(2, 8), num_prefix_tokens=1, progress=False)


def test_report_sparsity_counts_exact_zeros_per_head() -> None:
    model = LocAtViT(**TINY, gaug=False, prr=False, normalizer="entmax15").eval()
    spread_weights(model, std=0.6)
    x = torch.randn(3, 3, 32, 32)
    maps = attention_maps(model, x)
    report = locality_report(model, x, progress=False)
    for li, i in enumerate(report.layers):
        want = [(maps[i][:, h] == 0).double().mean().item() for h in range(maps[i].shape[1])]
        assert report.sparsity[li] == pytest.approx(want, abs=1e-12)
    assert report.mean_sparsity > 0.1
    dense = locality_report(timm_vit(), x, progress=False)
    assert dense.mean_sparsity == 0.0 and len(dense.sparsity) == 2
    back = LocalityReport.from_dict(report.to_dict())
    assert back.sparsity == report.sparsity
    old = {k: v for k, v in report.to_dict().items() if k != "sparsity"}  # a report from before sparsity
    legacy = LocalityReport.from_dict(old)
    assert legacy.sparsity == [] and math.isnan(legacy.mean_sparsity)


def test_report_dynamic_image_size_and_locatvit() -> None:
    model = timm_vit(dynamic_img_size=True)
    data = [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 48, 40)]
    report = locality_report(model, data, progress=False)
    assert report.grid_size is None and report.num_images == 4 and "mixed" in str(report)
    with pytest.raises(ValueError, match="several grid sizes"):
        report.mad_patches()
    loc = locality_report(LocAtViT(**TINY), torch.randn(3, 3, 32, 32), progress=False, name="loc")
    assert loc.grid_size == (4, 4) and loc.num_prefix_tokens == 1 and loc.model == "loc"


def test_report_dict_json_roundtrip_str_and_compare(tmp_path) -> None:
    model = timm_vit()
    spread_weights(model)
    report = locality_report(model, torch.randn(4, 3, 32, 32), progress=False, name="vit")
    report.mad[0][1] = math.nan  # a head that never looked at a patch
    d = report.to_dict()
    assert d["mad"][0][1] is None and json.loads(json.dumps(d)) == d
    back = LocalityReport.from_dict(d)
    assert back.to_dict() == d and math.isnan(back.mad[0][1])
    text = report.to_json(tmp_path / "r.json")
    assert (tmp_path / "r.json").read_text().strip() == text
    assert LocalityReport.from_json(tmp_path / "r.json").to_dict() == d
    assert LocalityReport.from_json(text).to_dict() == d
    table = str(report)
    assert "vit" in table and "4 images" in table and "grid 4x4" in table
    assert len([line for line in table.splitlines() if line.split()[:1] in (["0"], ["1"])]) == 2
    assert report.mad_patches()[1][0] == pytest.approx(report.mad[1][0] * math.hypot(3, 3))
    other = LocalityReport.from_dict({**d, "model": "other", "mad": [[0.1, 0.2], [0.3, 0.4]]})
    diff = report.compare(other)
    assert diff.names == ("vit", "other") and [r["layer"] for r in diff.rows] == [0, 1]
    assert diff.rows[1]["mad_b"] == pytest.approx(0.35)
    assert "Δ MAD" in str(diff) and f"{0.35 - report.layer_summary()[1]['mad_mean']:+9.4f}" in str(diff)
    assert json.loads(json.dumps(diff.to_dict()))["names"] == ["vit", "other"]
    with pytest.raises(ValueError, match="share no layer"):
        report.compare(LocalityReport.from_dict({**d, "layers": [5, 6]}))


# ---- plots -------------------------------------------------------------------------------------------
def test_plots_write_pngs(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from vitattn.analysis import plot_locality_plane, plot_mad_per_layer, plot_query_attention

    model = timm_vit()
    spread_weights(model)
    x = torch.randn(2, 3, 32, 32)
    a = locality_report(model, x, progress=False, name="a")
    b = locality_report(LocAtViT(**TINY), x, progress=False, name="b")
    plot_locality_plane(a, tmp_path / "plane.png")
    plot_locality_plane({"a": a, "b": b}, tmp_path / "plane2.png")
    plot_mad_per_layer([a, b], tmp_path / "layers.png")
    maps = attention_maps(model, x[:1], layers=[1])
    plot_query_attention(x[0], maps[1][0], (4, 4), 1, query=(1, 2), path=tmp_path / "maps.png")
    plot_query_attention(x[0], maps[1], 4, 1, query="cls", path=tmp_path / "maps_cls.png")
    for name in ("plane.png", "plane2.png", "layers.png", "maps.png", "maps_cls.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="outside the 4x4 grid"):
        plot_query_attention(x[0], maps[1][0], 4, 1, query=(4, 0))
    with pytest.raises(ValueError, match=r"\(H, 16, 16\).*got \(2, 17, 17\)"):
        plot_query_attention(x[0], maps[1][0], 4, 0)


# ---- the CLI -----------------------------------------------------------------------------------------
def test_cli_analyze_digits_end_to_end(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    out = tmp_path / "out"
    rc = main(
        ["analyze", "vit_tiny_patch16_224", *TINY_ARGS, "--max-images", "6", "--batch-size", "4"]
        + ["--out", str(out), "--no-progress"]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "Locality report: vit_tiny_patch16_224" in stdout and "6 images" in stdout and "MAD mean" in stdout
    report = LocalityReport.from_json(out / "report.json")
    assert report.num_images == 6 and report.layers == [0, 1] and report.grid_size == (4, 4)
    assert report.meta["model_args"]["img_size"] == 32 and "digits" in report.meta["data"]
    for name in ("locality_plane.png", "mad_per_layer.png", "attention_maps.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_cli_analyze_checkpoint_images_compare(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image
    from safetensors.torch import save_file

    model = LocAtViT(**TINY)
    spread_weights(model)
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": model.state_dict()}, tmp_path / "w.pt")
    folder = tmp_path / "imgs"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
        for j in range(2):
            pixels = (torch.rand(20, 24, 3) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(folder / cls / f"{j}.png")
    base = ["analyze", "locatvit_tiny", *TINY_ARGS, "--no-progress", "--layers", "1"]
    assert main([*base, "--checkpoint", str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "a")]) == 0
    first = LocalityReport.from_json(tmp_path / "a" / "report.json")
    assert first.layers == [1] and first.num_images == 64  # --max-images defaults to 64 digits
    args = [*base, "--checkpoint", str(tmp_path / "w.pt"), "--images", str(folder), "--query", "cls"]
    args += ["--compare", str(tmp_path / "a" / "report.json"), "--out", str(tmp_path / "b")]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "Δ MAD" in stdout
    second = LocalityReport.from_json(tmp_path / "b" / "report.json")
    assert second.num_images == 4 and second.meta["data"] == str(folder)
    # a weights-only load refuses arbitrary pickles; a wrong model and a missing folder are clean errors
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"blocks.0.attn.qkv.weight": _OpaqueAttention()}, f, protocol=2)
    assert main([*base, "--checkpoint", str(tmp_path / "evil.pt"), "--out", str(tmp_path / "c")]) == 2
    assert "weights_only" in capsys.readouterr().err
    vit = ["analyze", "vit_tiny_patch16_224", *TINY_ARGS, "--out", str(tmp_path / "c")]
    assert main([*vit, "--checkpoint", str(tmp_path / "w.pt")]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main([*base, "--images", str(tmp_path / "nope"), "--out", str(tmp_path / "c")]) == 2
    assert main(["analyze", "no_such_model_xyz", "--out", str(tmp_path / "c")]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
