"""Attention maps, locality reports, dense features / probes and attention transfer on transformers
vision models (tiny random models of every supported family, no network)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

import vitattn
import vitattn.hf
from vitattn.analysis import attention_maps, locality_report
from vitattn.probe import patch_features
from vitattn.transfer import AttentionCopy, AttentionDistill

from .hf_tiny import NAMES, hidden, images, prefix_tokens, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", NAMES)
def test_attention_maps_equal_eager_weights(family: str) -> None:
    """Maps of an unpatched (eager) model: transformers' own ``output_attentions`` weights; the model's
    attention implementation is restored after."""
    model = tiny_model(family)
    x = images()
    with torch.no_grad():
        ref = hidden(model, x, output_attentions=True).attentions
    maps = attention_maps(model, x)
    assert model.config._attn_implementation == "eager"
    assert list(maps) == [0, 1]
    for i, want in enumerate(ref):
        torch.testing.assert_close(maps[i], want, atol=1e-5, rtol=1e-5)
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    torch.testing.assert_close(attention_maps(sdpa, x, layers=[-1])[1], ref[1], atol=1e-5, rtol=1e-5)
    assert sdpa.config._attn_implementation == "sdpa"


def test_maps_of_patched_models_are_their_own() -> None:
    model = vitattn.patch(tiny_model("dinov2_reg"), "locat", normalizer="entmax15")
    x = images()
    maps = attention_maps(model, x)
    with torch.no_grad():
        ref = hidden(model, x, output_attentions=True).attentions
    for i, want in enumerate(ref):
        torch.testing.assert_close(maps[i], want)
        assert (maps[i] == 0).any()


@pytest.mark.parametrize("family", NAMES)
def test_locality_report(family: str) -> None:
    model = tiny_model(family)
    report = locality_report(model, images(3), progress=False)
    assert report.grid_size == (4, 4)
    assert report.num_prefix_tokens == prefix_tokens(family)
    assert report.layers == [0, 1] and len(report.mad[0]) == 4
    assert all(0.0 <= v <= 1.0 for row in report.mad + report.entropy for v in row)


def test_locality_report_other_size() -> None:
    report = locality_report(tiny_model("dinov2"), torch.randn(2, 3, 24, 40), progress=False)
    assert report.grid_size == (3, 5)


@pytest.mark.parametrize("family", NAMES)
def test_patch_features_from_hidden_states(family: str) -> None:
    """Features: transformers' ``hidden_states[i + 1]`` through the final norm, prefix tokens split off."""
    model = tiny_model(family)
    x = images()
    feats = patch_features(model, x, layers=(0, -1))
    with torch.no_grad():
        states = hidden(model, x, output_hidden_states=True).hidden_states
        norm = vitattn.hf.hf_layout(model).final_norm
        p = prefix_tokens(family)
        for i in (0, 1):
            tokens = norm(states[i + 1])
            want = tokens[:, p:].transpose(1, 2).reshape(2, 32, 4, 4)
            torch.testing.assert_close(feats[i].patches, want)
            if family == "siglip":
                assert feats[i].cls is None
            else:
                torch.testing.assert_close(feats[i].cls, tokens[:, 0])
    raw = patch_features(model, x, layers=(-1,), norm=False)
    torch.testing.assert_close(raw[1].patches, states[2][:, p:].transpose(1, 2).reshape(2, 32, 4, 4))


def test_dense_probe_runs() -> None:
    from vitattn.datasets.scenes import DigitScenes
    from vitattn.probe import dense_probe

    model = tiny_model("dinov2")
    train = DigitScenes("train", image_size=32, size=8)
    test = DigitScenes("test", image_size=32, size=4)
    result = dense_probe(model, train, test, layers=(-1,), method="knn", progress=False)
    assert 0.0 <= result.miou <= 1.0


# ---- attention transfer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["vit", "dinov2_reg", "siglip"])
def test_copy_of_itself_is_itself(family: str) -> None:
    """A student copying the attention of its own twin computes what it computes alone."""
    student = tiny_model(family)
    copy_wrapper = AttentionCopy(copy.deepcopy(student), student)
    x = images()
    out = copy_wrapper(x)
    with torch.no_grad():
        want = hidden(student, x).pooler_output
    assert isinstance(out.logits, torch.Tensor)
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)


def test_copy_takes_the_teachers_maps() -> None:
    teacher, student = tiny_model("vit", seed=1), tiny_model("vit", seed=2)
    x = images()
    t_maps = attention_maps(teacher, x)
    seen: list[torch.Tensor] = []
    with vitattn.functional.capture_attention_weights(seen.append):
        AttentionCopy(teacher, student)(x)
    student_calls = seen[-2:]  # the teacher's two calls come first
    for got, want in zip(student_calls, t_maps.values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["deit", "clip"])
def test_distill_loss_against_own_entropy(family: str) -> None:
    """Distilling from a twin: the loss is the mean entropy of the student's own maps (cross-entropy of p
    with itself), from transformers' eager weights; the loss has gradients."""
    student = tiny_model(family).train()
    teacher = copy.deepcopy(student).eval()
    x = images()
    wrapper = AttentionDistill(teacher, student, layers=[0, 1], weight=1.0)
    out = wrapper(x)
    with torch.no_grad():
        weights = hidden(teacher, x, output_attentions=True).attentions
    entropy = sum((-(w * w.clamp_min(1e-30).log()).sum(-1)).mean() for w in weights)
    torch.testing.assert_close(out.attn_loss, entropy, atol=1e-4, rtol=1e-4)
    out.attn_loss.backward()
    attn = vitattn.hf.hf_layout(student).attentions[0]
    q_proj = getattr(attn, "q_proj", None) or attn.query  # transformers 5 / 4.5x
    assert q_proj.weight.grad is not None and q_proj.weight.grad.abs().sum() > 0


def test_transfer_between_timm_and_transformers() -> None:
    import timm

    teacher = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_heads=4, embed_dim=32
    )
    student = tiny_model("vit")
    out = AttentionDistill(teacher.eval(), student.train(), layers=[0])(images())
    assert out.attn_loss is not None and torch.isfinite(out.attn_loss)
    with pytest.raises(ValueError, match="same number of heads"):
        AttentionCopy(teacher, tiny_model("vit", num_attention_heads=2))


# ---- hf: specs ---------------------------------------------------------------------------------------------
def test_load_model_from_a_folder(tmp_path) -> None:
    model = vitattn.patch(tiny_model("dinov2"), "locat")
    model.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.2, 0.2], "do_normalize": True})
    )
    loaded = vitattn.hf.load_model(f"hf:{tmp_path}")
    assert loaded.mean == (0.5, 0.4, 0.3) and loaded.std == (0.2, 0.2, 0.2)
    assert loaded.image_size == (32, 32) and loaded.in_chans == 3
    assert loaded.source["family"] == "DINOv2"
    assert getattr(vitattn.hf.hf_layout(loaded.model).attentions[0], "gaug", None) is not None


def test_load_model_errors_name_what_is_missing(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no copy of the model 'nobody/no-such-model'"):
        vitattn.hf.load_model("hf:nobody/no-such-model")
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="lacks config.json, model.safetensors"):
        vitattn.hf.load_model(f"hf:{tmp_path}")
    with pytest.raises(ValueError, match="hf:<model id or folder>"):
        vitattn.hf.load_model("hf:")


def test_load_model_without_image_processor_uses_imagenet(tmp_path) -> None:
    transformers_model = tiny_model("siglip")
    transformers_model.save_pretrained(tmp_path)
    loaded = vitattn.hf.load_model(f"hf:{tmp_path}")
    assert loaded.mean == (0.485, 0.456, 0.406)
    assert "ImageNet" in loaded.source["normalization"]
    assert isinstance(loaded.model, transformers.SiglipVisionModel)
