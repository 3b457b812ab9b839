"""vitattn's transformers AttentionInterface functions against transformers' own eager attention and
the ``entmax`` package, on tiny random models of every supported family (no network)."""

from __future__ import annotations

import copy
import subprocess
import sys

import entmax as entmax_pkg
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from transformers import AttentionInterface
from transformers.models.vit.modeling_vit import eager_attention_forward

import vitattn.hf
from vitattn.hf import attention_name, hf_attention, normalizer_of_name

from .hf_tiny import NAMES, hidden, images, prefix_tokens, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _switched(model: torch.nn.Module, name: str) -> torch.nn.Module:
    other = copy.deepcopy(model)
    other.set_attn_implementation(name)
    return other


def _grads(model: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    (hidden(model, x).last_hidden_state * weight).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- registration ---------------------------------------------------------------------------------------
def test_register_names_and_alpha_factory() -> None:
    names = vitattn.hf.register()
    assert set(names) == {"vitattn", "vitattn_softmax", "vitattn_entmax15", "vitattn_sparsemax"}
    for name in names:
        assert name in AttentionInterface._global_mapping
    assert attention_name("softmax") == "vitattn_softmax"
    assert attention_name(1.5) == "vitattn_entmax15"
    assert attention_name(2.0) == "vitattn_sparsemax"
    assert attention_name(1.25) == "vitattn_entmax_1.25"
    assert "vitattn_entmax_1.25" in AttentionInterface._global_mapping
    assert normalizer_of_name("vitattn_entmax_1.25") == 1.25
    assert normalizer_of_name("sdpa") is None
    with pytest.raises(ValueError, match="alpha"):
        normalizer_of_name("vitattn_entmax_x")
    with pytest.raises(ValueError, match="not a vitattn attention name"):
        vitattn.hf.register("flash_attention_2")
    with pytest.raises(ValueError, match="alpha"):
        attention_name(0.5)


@pytest.mark.slow  # a subprocess
def test_import_vitattn_does_not_import_transformers() -> None:
    code = (
        "import sys, vitattn, vitattn.analysis, vitattn.probe, vitattn.transfer, vitattn.patch\n"
        "from timm.models.vision_transformer import VisionTransformer\n"
        "from vitattn.adapter import layout_of\n"
        "layout_of(VisionTransformer(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2)).grid()\n"
        "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if 'transformers' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- softmax: transformers' eager attention, outputs, weights and gradients --------------------------------
@pytest.mark.parametrize("family", NAMES)
def test_vitattn_softmax_equals_eager(family: str) -> None:
    eager = tiny_model(family)
    ours = _switched(eager, "vitattn_softmax")
    x = images()
    ref = hidden(eager, x, output_attentions=True)
    out = hidden(ours, x, output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
    assert len(out.attentions) == len(ref.attentions) == 2
    n = prefix_tokens(family) + 16
    for got, want in zip(out.attentions, ref.attentions, strict=True):
        assert got.shape == (2, 4, n, n)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(ref.last_hidden_state)
    g_ref, g_out = _grads(eager, x, weight), _grads(ours, x, weight)
    assert g_ref.keys() == g_out.keys() and len(g_ref) > 10
    for name in g_ref:
        torch.testing.assert_close(g_out[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_weights_only_when_asked() -> None:
    model = tiny_model("vit", attn="vitattn_softmax")
    assert hidden(model, images()).attentions is None
    assert len(hidden(model, images(), output_attentions=True).attentions) == 2


def test_attn_implementation_at_load(tmp_path) -> None:
    tiny_model("dinov2").save_pretrained(tmp_path)
    model = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="vitattn_entmax15")
    assert model.config._attn_implementation == "vitattn_entmax15"
    weights = model(pixel_values=images(), output_attentions=True).attentions
    assert all((w == 0).any() for w in weights)  # entmax-1.5: sparse


# ---- entmax-1.5 and alpha-entmax: the entmax package on the same scores ------------------------------------
def _entmax_reference(alpha: float):
    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scores = query @ key.transpose(-1, -2) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        if alpha == 1.5:
            probs = entmax_pkg.entmax15(scores, dim=-1)
        elif alpha == 2.0:
            probs = entmax_pkg.sparsemax(scores, dim=-1)
        else:
            probs = entmax_pkg.entmax_bisect(scores, alpha=alpha, dim=-1, n_iter=60)
        return (probs @ value).transpose(1, 2).contiguous(), probs

    return fn


@pytest.mark.parametrize("family", ["dinov2_reg", "clip", "siglip"])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
def test_vitattn_entmax_equals_entmax_package(family: str, alpha: float) -> None:
    ref_name = f"test_entmax_reference_{alpha}"
    AttentionInterface.register(ref_name, _entmax_reference(alpha))
    model = tiny_model(family, attn="eager")
    ref_model = _switched(model, ref_name)
    ours = _switched(model, attention_name(alpha))
    x = images()
    ref = hidden(ref_model, x, output_attentions=True)
    out = hidden(ours, x, output_attentions=True)
    tol = 1e-4 if alpha == 1.25 else 1e-5  # bisection in the package vs vitattn's exact threshold
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=tol, rtol=tol)
    for got, want in zip(out.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert sum(int((w == 0).sum()) for w in out.attentions) > 0


# ---- masks, causal calls, dropout --------------------------------------------------------------------------
class _Module(torch.nn.Module):
    is_causal = False


@st.composite
def _calls(draw):
    b, h, n, d = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 7)),
        draw(st.integers(1, 8)),
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    keep = torch.rand(b, 1, n, n, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    if kind == "bool":
        mask = keep
    elif kind == "additive":  # transformers' convention: 0 to keep, the dtype's lowest value to drop
        mask = torch.zeros(b, 1, n, n, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
        mask = mask + torch.where(keep, torch.rand(b, 1, n, n, generator=g, dtype=torch.float64), 0.0)
    else:
        mask = None
    return q, k, v, mask, kind, keep


@given(_calls(), st.sampled_from(["softmax", "entmax15"]))
def test_function_masks_against_eager(call, normalizer) -> None:
    """The function on drawn shapes and masks: eager attention (or entmax on the same masked scores) on
    every row with a key left; zero weights and outputs on rows with every key masked."""
    q, k, v, mask, kind, keep = call
    out, weights = hf_attention(
        _Module(), q, k, v, mask, scaling=0.7, normalizer=normalizer, output_attentions=True
    )
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], v.shape[-1])
    additive = None
    if kind == "bool":
        additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    elif kind == "additive":
        additive = mask.masked_fill(~keep, float("-inf"))
    scores = q @ k.transpose(-1, -2) * 0.7 + (0 if additive is None else additive)
    live = (scores > float("-inf")).any(-1)  # (B, H, N): rows with a key left
    safe = torch.where(live[..., None], scores, 0.0)
    probs = safe.softmax(-1) if normalizer == "softmax" else entmax_pkg.entmax15(safe, dim=-1)
    probs = torch.where(live[..., None], probs, 0.0)
    if normalizer == "softmax" and kind == "additive":
        ref_out, ref_w = eager_attention_forward(_Module(), q, k, v, mask, scaling=0.7)
        rows = live.transpose(1, 2)  # (B, N, H)
        # transformers' eager softmax runs in float32 whatever the inputs' dtype
        torch.testing.assert_close(out[rows], ref_out[rows], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(weights[live], ref_w[live], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, probs)
    torch.testing.assert_close(out, (probs @ v).transpose(1, 2))
    assert torch.isfinite(out).all()


def test_causal_and_padding_text_tower() -> None:
    """CLIP's text tower (causal, with padding) gives the eager outputs on its kept positions: the mask
    builder is registered with the vitattn names and ``is_causal`` is honoured."""
    config = transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=50
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    eager = transformers.CLIPTextModel(config).eval()
    ours = _switched(eager, "vitattn_softmax")
    ids = torch.randint(0, 50, (2, 7))
    pad = torch.ones(2, 7, dtype=torch.long)
    pad[1, 4:] = 0
    for mask in (None, pad):
        ref = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        keep = torch.ones(2, 7, dtype=torch.bool) if mask is None else mask.bool()
        torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)


def test_dropout_in_training_only() -> None:
    model = tiny_model("vit", attn="vitattn_softmax", attention_probs_dropout_prob=0.5)
    x = images()
    with torch.no_grad():
        eval_out = hidden(model, x).last_hidden_state
        model.train()
        train_a = hidden(model, x).last_hidden_state
        train_b = hidden(model, x).last_hidden_state
        model.eval()
        eval_again = hidden(model, x).last_hidden_state
    torch.testing.assert_close(eval_out, eval_again)
    assert not torch.allclose(train_a, eval_out) and not torch.allclose(train_a, train_b)
