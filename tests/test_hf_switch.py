"""``set_attn_implementation`` on models patched by ``vitattn.patch``: a vitattn name changes the
normalizer only (GAug stays, a saved copy loads as the same model), another name is refused while
the patch would be lost; vitattn names registered on demand (tiny random models, no network)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import vitattn
import vitattn.hf
from vitattn.layers import GaussianAugment

from .hf_tiny import COMMON, TEXT, hidden, images, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hidden(model, x).last_hidden_state


def _locat(family: str, **kwargs) -> torch.nn.Module:
    """A LocAt-patched tiny model, its GAug amplitudes away from the fresh start."""
    model = vitattn.patch(tiny_model(family), "locat", **kwargs)
    with torch.no_grad():
        for a in vitattn.hf.hf_layout(model).attentions:
            if isinstance(getattr(a, "gaug", None), GaussianAugment):
                a.gaug.log_alpha.bias.fill_(0.4)
    return model


def _gaug_layers(model: torch.nn.Module) -> list[int]:
    attentions = vitattn.hf.hf_layout(model).attentions
    return [i for i, a in enumerate(attentions) if isinstance(getattr(a, "gaug", None), GaussianAugment)]


@pytest.mark.parametrize("family", ["dinov2", "vit", "siglip"])
def test_vitattn_name_changes_the_normalizer_only(family: str, tmp_path) -> None:
    """``set_attn_implementation("vitattn_entmax15")`` on a LocAt model: GAug-biased entmax-1.5, as
    ``vitattn.patch(..., "locat", normalizer="entmax15")`` gives; saved and loaded, the same model."""
    model = _locat(family)
    want = vitattn.patch(copy.deepcopy(model), "locat", normalizer="entmax15")
    x = images()
    model.set_attn_implementation("vitattn_entmax15")
    assert model.config._attn_implementation == "vitattn_entmax15"
    assert _gaug_layers(model) == [0, 1]
    torch.testing.assert_close(_out(model, x), _out(want, x), rtol=0, atol=0)
    assert model.config.vitattn == want.config.vitattn
    model.save_pretrained(tmp_path)
    loaded = vitattn.hf.from_pretrained(tmp_path)
    torch.testing.assert_close(_out(loaded, x), _out(model, x), rtol=0, atol=0)
    # back to softmax: the GAug heads are still there
    model.set_attn_implementation("vitattn_softmax")
    torch.testing.assert_close(_out(model, x), _out(_locat(family), x), rtol=0, atol=0)


def test_vitattn_name_reaches_layers_the_patch_left_out(tmp_path) -> None:
    """LocAt on the last layer only, then 1.3-entmax by name (registered on demand, no
    ``attention_name`` first): every layer computes 1.3-entmax, GAug stays on the last; a saved copy
    loads as the same model."""
    model = _locat("deit", blocks=[-1])
    x = images()
    model.set_attn_implementation("vitattn_entmax_1.3")
    plain = tiny_model("deit")
    plain.set_attn_implementation(vitattn.hf.attention_name(1.3))
    assert not torch.allclose(_out(model, x), _out(plain, x))  # GAug on layer 1 still acts
    want = vitattn.patch(copy.deepcopy(model), "softmax", blocks=[0], normalizer=1.3)
    want = vitattn.patch(want, "locat", blocks=[1], normalizer=1.3)
    want.set_attn_implementation("vitattn")
    torch.testing.assert_close(_out(model, x), _out(want, x), rtol=0, atol=0)
    assert {k: v["normalizer"] for k, v in model.config.vitattn["layers"].items()} == {"0": 1.3, "1": 1.3}
    model.save_pretrained(tmp_path)
    loaded = vitattn.hf.from_pretrained(tmp_path)
    assert _gaug_layers(loaded) == [1]
    torch.testing.assert_close(_out(loaded, x), _out(model, x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sdpa", "eager", {"": "eager"}])
def test_other_implementations_are_refused_while_gaug_is_there(name) -> None:
    model = _locat("dinov2_reg")
    x = images()
    before = _out(model, x)
    with pytest.raises(ValueError, match=r"GAug heads on layers \[0, 1\].*vitattn.patch\(model, 'softmax'\)"):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == "vitattn"
    torch.testing.assert_close(_out(model, x), before, rtol=0, atol=0)


def test_other_implementations_after_the_patch_is_plain_softmax(tmp_path) -> None:
    """An entmax patch is refused too; once the patch is plain softmax (``vitattn.patch(model,
    "softmax")`` removes GAug), transformers' own implementations are allowed, and a saved copy
    computes the same."""
    model = vitattn.patch(tiny_model("vit"), "entmax15", prr=True)
    with pytest.raises(ValueError, match=r"normalizer 'entmax15' on layers \[0, 1\]"):
        model.set_attn_implementation("sdpa")
    gaug = _locat("vit")
    vitattn.patch(gaug, "softmax", prr=True)
    vitattn.patch(model, "softmax")
    x = images()
    for m in (model, gaug):
        want = _out(m, x)
        m.set_attn_implementation("sdpa")
        assert m.config._attn_implementation == "sdpa"
        torch.testing.assert_close(_out(m, x), want, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(
        _out(vitattn.hf.from_pretrained(tmp_path), x), _out(model, x), rtol=1e-5, atol=1e-5
    )


def test_gaug_never_runs_under_another_implementation() -> None:
    """Set behind ``set_attn_implementation``'s back (the config itself), another implementation would
    skip GAug: the forward says so instead."""
    model = _locat("vit")
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match=r"GAug heads .* 'sdpa', which would skip them"):
        _out(model, images())


def test_from_pretrained_takes_the_implementation_as_a_normalizer(tmp_path) -> None:
    model = _locat("clip")
    model.save_pretrained(tmp_path)
    x = images()
    loaded = vitattn.hf.from_pretrained(tmp_path, attn_implementation="vitattn_entmax_1.6")
    want = vitattn.patch(copy.deepcopy(model), "locat", normalizer=1.6)
    torch.testing.assert_close(_out(loaded, x), _out(want, x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="GAug heads"):
        vitattn.hf.from_pretrained(tmp_path, attn_implementation="sdpa")
    # a plain model: the name is registered on demand, transformers sets it
    plain = tiny_model("clip")
    plain.save_pretrained(tmp_path / "plain")
    ent = vitattn.hf.from_pretrained(tmp_path / "plain", attn_implementation="vitattn_entmax_1.7")
    ref = copy.deepcopy(plain)
    ref.set_attn_implementation(vitattn.hf.attention_name(1.7))
    torch.testing.assert_close(_out(ent, x), _out(ref, x), rtol=0, atol=0)


def test_bad_vitattn_names_name_attention_name() -> None:
    model = _locat("vit")
    for name in ("vitattn_entmax_0.9", "vitattn_entmax_one", "vitattn_foo"):
        with pytest.raises(ValueError, match=r"vitattn\.hf\.attention_name\(alpha\)"):
            model.set_attn_implementation(name)
        with pytest.raises(ValueError, match=r"vitattn\.hf\.attention_name\(alpha\)"):
            vitattn.hf.set_implementation(tiny_model("vit"), name)
    assert model.config._attn_implementation == "vitattn"


def test_composite_model_text_tower_may_leave_vitattn() -> None:
    """CLIPModel with its vision tower patched: the text tower may take transformers' SDPA (a dict
    keyed by sub-config), the vision tower may not."""
    config = transformers.CLIPConfig(vision_config=dict(COMMON), text_config=dict(TEXT), projection_dim=16)
    torch.manual_seed(0)
    model = vitattn.patch(transformers.CLIPModel(config).eval(), "locat")
    model.set_attn_implementation({"text_config": "sdpa"})
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == "vitattn"
    with pytest.raises(ValueError, match="GAug heads"):
        model.set_attn_implementation({"vision_config": "eager"})
    with pytest.raises(ValueError, match="GAug heads"):
        model.set_attn_implementation("eager")
    assert model.config.vision_config._attn_implementation == "vitattn"
    with torch.no_grad():
        out = model.get_image_features(pixel_values=images())
    assert torch.isfinite(out if isinstance(out, torch.Tensor) else out.pooler_output).all()
