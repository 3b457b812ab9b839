"""``vitattn.patch`` on transformers vision models: softmax / entmax / LocAt, the identity start, PRR,
save and load; tiny random models of every supported family (no network)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers

import vitattn
import vitattn.hf
from vitattn.functional import prr as prr_fn
from vitattn.layers import GaussianAugment

from .hf_tiny import NAMES, PATCH, hidden, images, prefix_tokens, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _out(model: torch.nn.Module, x: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return hidden(model, x, **kwargs).last_hidden_state


@pytest.mark.parametrize("family", NAMES)
def test_softmax_patch_leaves_outputs_unchanged(family: str) -> None:
    model = tiny_model(family)
    x = images()
    before = _out(model, x)
    patched = vitattn.patch(copy.deepcopy(model), "softmax")
    assert patched.config._attn_implementation == "vitattn"
    torch.testing.assert_close(_out(patched, x), before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", NAMES)
def test_locat_patch_changes_output_identity_does_not(family: str) -> None:
    model = tiny_model(family)
    x = images()
    before = _out(model, x)
    paper = vitattn.patch(copy.deepcopy(model), "locat")
    identity = vitattn.patch(copy.deepcopy(model), "locat", gaug_init="identity")
    layout = vitattn.hf.hf_layout(paper)
    assert all(isinstance(a.gaug, GaussianAugment) for a in layout.attentions)
    keys = [k for k in paper.state_dict() if ".gaug." in k]
    assert len(keys) == 2 * 4 and all(
        k.endswith(("log_var.weight", "log_var.bias", "log_alpha.weight", "log_alpha.bias")) for k in keys
    )
    assert (_out(paper, x) - before).abs().max() > 1e-2
    torch.testing.assert_close(_out(identity, x), before, atol=1e-4, rtol=0)
    assert layout.attentions[0].vitattn.num_prefix_tokens == prefix_tokens(family)


def test_identity_start_trains() -> None:
    """The identity start trains: GAug's gate gets a finite non-zero gradient from the first step,
    Adam moves it from 0 (then the amplitude head gets a gradient too), and the loss goes down."""
    model = vitattn.patch(tiny_model("dinov2"), "locat", gaug_init="identity").train()
    x = images(4)
    target = torch.randn(4, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gaug = vitattn.hf.hf_layout(model).attentions[0].gaug
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = (hidden(model, x).pooler_output - target).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        assert gaug.gate.grad is not None and torch.isfinite(gaug.gate.grad).all()
        assert gaug.gate.grad.abs().max() > 0
        if step > 0:  # once the gate has left 0
            assert gaug.log_alpha.bias.grad.abs().item() > 0
        opt.step()
    assert gaug.gate.abs().min() > 1e-2  # about lr per step
    assert losses[-1] < losses[0]


def test_entmax_patch_and_normalizer() -> None:
    model = tiny_model("vit")
    x = images()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(vitattn.hf.attention_name(1.25))
    patched = vitattn.patch(copy.deepcopy(model), "softmax", normalizer=1.25)
    torch.testing.assert_close(_out(patched, x), _out(ref, x))
    ent = vitattn.patch(copy.deepcopy(model), "entmax15")
    ref.set_attn_implementation("vitattn_entmax15")
    torch.testing.assert_close(_out(ent, x), _out(ref, x))
    with pytest.raises(ValueError, match="contradicts"):
        vitattn.patch(copy.deepcopy(model), "entmax15", normalizer="softmax")


def test_selected_blocks_only() -> None:
    model = vitattn.patch(tiny_model("siglip"), "locat", blocks=[-1])
    layout = vitattn.hf.hf_layout(model)
    assert getattr(layout.attentions[0], "gaug", None) is None
    assert isinstance(layout.attentions[1].gaug, GaussianAugment)
    assert model.config.vitattn["layers"] == {"1": {"normalizer": "softmax", "gaug": True}}
    vitattn.patch(model, "softmax", blocks=1)  # GAug heads go
    assert getattr(layout.attentions[1], "gaug", None) is None


@pytest.mark.parametrize("family", ["dinov2", "vit", "siglip"])
def test_locat_follows_the_input_grid(family: str) -> None:
    """Another image size (interpolated position encodings): the grid of each input reaches GAug."""
    model = vitattn.patch(tiny_model(family), "locat")
    layout = vitattn.hf.hf_layout(model)
    wide = torch.randn(1, 3, 24, 40)
    kwargs = {} if family == "dinov2" else {"interpolate_pos_encoding": True}
    _out(model, wide, **kwargs)
    settings = layout.attentions[0].vitattn
    assert settings.grid_size == (24 // PATCH, 40 // PATCH)
    assert settings.initial_grid_size == (4, 4)
    _out(model, images())
    assert settings.grid_size == (4, 4)


def test_unsupported_models_are_named() -> None:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    with pytest.raises(
        TypeError, match=r"BertModel .*model_type 'bert'.*DINOv2 with registers.*SigLIP vision"
    ):
        vitattn.patch(transformers.BertModel(config), "locat")
    with pytest.raises(ValueError, match="gaug_init"):
        vitattn.patch(tiny_model("vit"), "locat", gaug_init="zero")


def test_vit_mae_with_masking_refuses_locat() -> None:
    model = tiny_model("vit_mae", mask_ratio=0.75)
    with pytest.raises(ValueError, match="mask_ratio"):
        vitattn.patch(model, "locat")
    vitattn.patch(model, "entmax15")  # no grid needed
    assert model(pixel_values=images()).last_hidden_state.shape[1] == 1 + 4


@pytest.mark.parametrize("family", ["vit", "clip", "siglip", "dinov2_reg"])
def test_prr_before_the_pooler(family: str) -> None:
    model = tiny_model(family)
    x = images()
    with torch.no_grad():
        plain = hidden(model, x)
    patched = vitattn.patch(copy.deepcopy(model), "softmax", prr=True)
    with torch.no_grad():
        out = hidden(patched, x)
    if family == "clip":  # PRR on the encoder's tokens; post_layernorm then pools the class token
        tokens = prr_fn(plain.last_hidden_state, 4)
        torch.testing.assert_close(out.last_hidden_state, tokens, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            out.pooler_output, vitattn.hf.hf_layout(model).final_norm(tokens[:, 0]), atol=1e-5, rtol=1e-5
        )
    else:  # PRR on the final norm's output: last_hidden_state and the pooler see it
        torch.testing.assert_close(
            out.last_hidden_state, prr_fn(plain.last_hidden_state, 4), atol=1e-5, rtol=1e-5
        )
    vitattn.patch(patched, "softmax", prr=True)  # once only
    with torch.no_grad():
        torch.testing.assert_close(hidden(patched, x).last_hidden_state, out.last_hidden_state)


@pytest.mark.parametrize("family", ["vit", "dinov2_reg", "clip", "vit_mae"])
def test_save_and_load_round_trip(family: str, tmp_path) -> None:
    model = vitattn.patch(tiny_model(family), "locat", normalizer="entmax15", prr=True)
    with torch.no_grad():
        for a in vitattn.hf.hf_layout(model).attentions:
            a.gaug.log_alpha.bias.fill_(0.3)  # not the fresh init: the load must bring these
    x = images()
    want = _out(model, x)
    model.save_pretrained(tmp_path)
    loaded = vitattn.hf.from_pretrained(tmp_path)
    torch.testing.assert_close(_out(loaded, x), want)
    assert loaded.config.vitattn == model.config.vitattn
    # load with transformers, patch, then load the GAug weights: the same model
    again = transformers.AutoModel.from_pretrained(tmp_path)
    vitattn.patch(again, "locat", normalizer="entmax15", prr=True)
    vitattn.hf.load_gaug_weights(again, tmp_path)
    torch.testing.assert_close(_out(again, x), want)
    with pytest.raises(ValueError, match="no weights for 8 GAug tensors"):
        plain = tiny_model(family)
        plain.save_pretrained(tmp_path / "plain")
        vitattn.hf.load_gaug_weights(vitattn.patch(plain, "locat", blocks=[0, 1]), tmp_path / "plain")


def test_from_pretrained_patches_a_plain_model(tmp_path) -> None:
    model = tiny_model("deit")
    model.save_pretrained(tmp_path)
    x = images()
    loaded = vitattn.hf.from_pretrained(tmp_path, attention="locat", gaug_init="identity")
    assert isinstance(vitattn.hf.hf_layout(loaded).attentions[0].gaug, GaussianAugment)
    torch.testing.assert_close(_out(loaded, x), _out(model, x), atol=1e-4, rtol=0)


@pytest.mark.slow  # dynamo tracing
@pytest.mark.parametrize("how", ["function", "locat"])
def test_compiles_without_graph_breaks(how: str) -> None:
    import torch._dynamo

    if how == "function":
        model = tiny_model("dinov2", attn="vitattn_entmax15")
    else:
        model = vitattn.patch(tiny_model("dinov2"), "locat")
    x = images()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(pixel_values=x)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch.testing.assert_close(
            torch.compile(model, backend="eager")(pixel_values=x).last_hidden_state, _out(model, x)
        )


def test_patched_models_copy_and_pickle() -> None:
    """A patched model deep-copies (the copy's grid hook sets the copy's grid) and pickles whole."""
    model = vitattn.patch(tiny_model("dinov2_reg"), "locat", prr=True)
    twin = copy.deepcopy(model)
    _out(twin, torch.randn(1, 3, 24, 40))
    assert vitattn.hf.hf_layout(twin).attentions[0].vitattn.grid_size == (3, 5)
    assert vitattn.hf.hf_layout(model).attentions[0].vitattn.grid_size == (4, 4)
    again = pickle.loads(pickle.dumps(model))  # e.g. handed to worker processes
    x = images()
    torch.testing.assert_close(_out(again, x), _out(model, x))


@pytest.mark.parametrize("family", ["vit", "dinov2_reg", "siglip"])
def test_calls_compose(family: str) -> None:
    """A later call changes only what it names: ``normalizer=`` alone keeps the GAug heads (the same
    modules) and equals one call naming both; ``attention="locat"`` keeps an earlier normalizer;
    only a named attention without GAug removes the heads."""
    model = vitattn.patch(tiny_model(family), "locat")
    layout = vitattn.hf.hf_layout(model)
    with torch.no_grad():
        for a in layout.attentions:
            a.gaug.log_alpha.bias.fill_(0.7)
    heads = [a.gaug for a in layout.attentions]
    at_once = vitattn.patch(copy.deepcopy(model), "locat", normalizer="entmax15")
    vitattn.patch(model, normalizer="entmax15")
    assert [a.gaug for a in layout.attentions] == heads
    assert [a.vitattn.normalizer for a in layout.attentions] == ["entmax15", "entmax15"]
    x = images()
    torch.testing.assert_close(_out(model, x), _out(at_once, x))
    vitattn.patch(model)  # nothing named: nothing changes
    assert [a.gaug for a in layout.attentions] == heads
    assert model.config.vitattn["layers"]["0"] == {"normalizer": "entmax15", "gaug": True}
    entmax = vitattn.patch(tiny_model(family), "entmax15")
    vitattn.patch(entmax, "locat")  # GAug added, the normalizer kept
    assert all(a.vitattn.normalizer == "entmax15" for a in vitattn.hf.hf_layout(entmax).attentions)
    vitattn.patch(model, "softmax", blocks=[0])
    assert getattr(layout.attentions[0], "gaug", None) is None and layout.attentions[1].gaug is heads[1]
    assert layout.attentions[0].vitattn.normalizer == "softmax"
