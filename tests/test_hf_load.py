"""``vitattn.hf.from_pretrained``: the class a folder was saved as, GAug tensors as the model's own keys
(transformers' load report, its weight init for what a checkpoint lacks); tiny random models of every
supported family (no network)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.testing_utils import CaptureLogger

import vitattn
import vitattn.hf
from vitattn.layers import GaussianAugment

from .hf_tiny import FAMILIES, NAMES, head_output, hidden, images, tiny_config, tiny_head_model, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _gaug_modules(model: torch.nn.Module) -> dict[str, GaussianAugment]:
    return {n: m for n, m in model.named_modules() if isinstance(m, GaussianAugment)}


def _not_fresh(model: torch.nn.Module) -> torch.nn.Module:
    """GAug tensors set away from any start, so that only a load can bring them back."""
    with torch.no_grad():
        for gaug in _gaug_modules(model).values():
            for p in gaug.parameters():
                p.copy_(0.3 * torch.randn_like(p) + 0.1)
    return model


def _assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert list(got_sd) == list(want_sd)
    for key, value in want_sd.items():
        torch.testing.assert_close(got_sd[key], value, rtol=0, atol=0, msg=key)


def _rewrite_weights(folder: Path, edit: Any) -> None:
    """``model.safetensors`` of a saved folder rewritten as ``edit(state dict)`` gives it."""
    path = folder / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


# ---- item: the class the folder was saved as -------------------------------------------------------
def test_image_classifier_loads_with_its_classifier(tmp_path) -> None:
    """A saved ViTForImageClassification patched with LocAt and entmax-1.5 loads as itself: the
    classifier's weights and the logits are the saved model's (not a bare ViTModel with a new pooler)."""
    model = _not_fresh(vitattn.patch(tiny_head_model("vit"), "locat", normalizer="entmax15"))
    x = images()
    want = head_output(model, x)
    model.save_pretrained(tmp_path)
    loaded = vitattn.hf.from_pretrained(tmp_path)
    assert type(loaded) is transformers.ViTForImageClassification
    torch.testing.assert_close(loaded.classifier.weight, model.classifier.weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded.classifier.bias, model.classifier.bias, rtol=0, atol=0)
    torch.testing.assert_close(head_output(loaded, x), want, rtol=0, atol=0)
    assert loaded.config.vitattn == model.config.vitattn
    assert loaded.config._attn_implementation == "vitattn"
    # the class can still be chosen: the tower alone, or an Auto class
    tower = vitattn.hf.from_pretrained(tmp_path, model_class=transformers.AutoModel)
    assert type(tower) is transformers.ViTModel
    torch.testing.assert_close(
        vitattn.hf.hf_layout(tower).attentions[1].gaug.log_alpha.bias,
        vitattn.hf.hf_layout(model).attentions[1].gaug.log_alpha.bias,
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("patched", [False, True], ids=["plain", "locat"])
@pytest.mark.parametrize("family", NAMES)
def test_every_family_loads_as_saved(family: str, patched: bool, tmp_path) -> None:
    """Each family's model with a head (CLIP's projection model is in no Auto mapping: found by name),
    patched or not: same class, every weight, the same output."""
    model = tiny_head_model(family)
    if patched:
        _not_fresh(vitattn.patch(model, "locat", normalizer="entmax15", prr=True))
    x = images()
    want = head_output(model, x)
    model.save_pretrained(tmp_path)
    loaded = vitattn.hf.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    _assert_same_weights(loaded, model)
    torch.testing.assert_close(head_output(loaded, x), want, rtol=0, atol=0)
    # the command line's loader too
    spec = vitattn.hf.load_model(f"hf:{tmp_path}")
    assert type(spec.model) is type(model)


def test_saved_model_class_without_architectures() -> None:
    config = tiny_config("dinov2")
    assert config.architectures is None
    assert vitattn.hf.saved_model_class(config) is transformers.Dinov2Model
    config.architectures = ["Dinov2ForImageClassification"]
    assert vitattn.hf.saved_model_class(config) is transformers.Dinov2ForImageClassification
    config.architectures = ["NoSuchModel"]
    assert vitattn.hf.saved_model_class(config) is transformers.Dinov2Model
    with pytest.raises(TypeError, match="model_class"):
        vitattn.hf.from_pretrained("unused", model_class=int, config=config)


# ---- item: transformers' load report -------------------------------------------------------------------
def test_load_report_has_no_gaug_keys_but_keeps_real_unexpected_ones(tmp_path) -> None:
    model = vitattn.patch(tiny_model("dinov2"), "locat")
    model.save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda sd: {**sd, "stray.weight": torch.zeros(2)})
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_warning()
    try:
        with CaptureLogger(logger) as captured:
            loaded, info = vitattn.hf.from_pretrained(tmp_path, output_loading_info=True)
    finally:
        transformers.utils.logging.set_verbosity(level)
    assert "stray.weight" in info["unexpected_keys"]
    assert not [k for k in (*info["unexpected_keys"], *info["missing_keys"]) if ".gaug." in k]
    assert "stray.weight" in captured.out  # the report (its layout differs between versions)
    assert ".gaug." not in captured.out
    assert len(_gaug_modules(loaded)) == 2


def test_gaug_keys_of_another_layout_are_read_by_layer(tmp_path) -> None:
    """A checkpoint whose GAug keys sit under other module paths (another transformers version's
    layout): read by layer index, and the loading info says so (neither missing nor unexpected)."""
    model = _not_fresh(vitattn.patch(tiny_model("dinov2"), "locat"))
    model.save_pretrained(tmp_path)

    def old_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.replace(".attention.gaug.", ".attention.attention.gaug."): v for k, v in sd.items()}

    _rewrite_weights(tmp_path, old_layout)
    loaded, info = vitattn.hf.from_pretrained(tmp_path, output_loading_info=True)
    _assert_same_weights(loaded, model)
    assert not [k for k in (*info["unexpected_keys"], *info["missing_keys"]) if ".gaug." in k]


# ---- item: GAug through the model's weight init ------------------------------------------------------
_INIT_FUNCTIONS = ("normal_", "trunc_normal_", "uniform_", "xavier_uniform_", "kaiming_uniform_")


@contextmanager
def seeded_init(seed: int = 0) -> Iterator[None]:
    """Every random torch init function draws from a fresh generator (seeded the same each call), so
    a tensor's start depends only on the function and its arguments: the init a module gets from its
    own code and from a model's weight init can be compared exactly (transformers' own init tests
    use the same idea). Patched where transformers' guarded init functions find them too."""
    try:  # transformers 5: its guarded init functions call these
        from transformers.initialization import TORCH_INIT_FUNCTIONS as table
    except ImportError:  # transformers 4.5x: what its no_init_weights() puts back into torch
        from transformers.modeling_utils import TORCH_INIT_FUNCTIONS as table
    saved_torch = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    saved_table = {name: table[name] for name in _INIT_FUNCTIONS if name in table}

    def seeded(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            torch.manual_seed(seed)
            return fn(*args, **kwargs)

        return call

    try:
        for name, fn in saved_torch.items():
            setattr(torch.nn.init, name, seeded(fn))
        for name, fn in saved_table.items():
            table[name] = seeded(fn)
        yield
    finally:
        for name, fn in saved_torch.items():
            setattr(torch.nn.init, name, fn)
        table.update(saved_table)


def _assert_started(model: torch.nn.Module, start: str) -> None:
    """Every GAug tensor is what the module's own ``init_weights(start)`` gives (under
    :func:`seeded_init`): finite, not left at garbage, whatever parameters the module has."""
    gaugs = _gaug_modules(model)
    assert gaugs
    for name, gaug in gaugs.items():
        want = copy.deepcopy(gaug)
        with seeded_init():
            want.init_weights(start)
        got_sd, want_sd = gaug.state_dict(), want.state_dict()
        assert list(got_sd) == list(want_sd)
        for key, value in want_sd.items():
            assert torch.isfinite(got_sd[key]).all(), f"{name}.{key}"
            torch.testing.assert_close(got_sd[key], value, rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.parametrize("start", ["paper", "identity"])
@pytest.mark.parametrize("family", NAMES)
def test_weight_init_of_a_meta_built_model_starts_gaug(family: str, start: str) -> None:
    """transformers' init of what a checkpoint lacks (``initialize_weights`` on a model built on the
    meta device, its tensors then allocated, uninitialised): GAug heads start as the patch started
    them, through the module's own ``init_weights``. The config's init std is 0.05, not GAug's 0.02,
    so the model's own init of a linear is told apart."""
    config = tiny_config(family, initializer_range=0.05)
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[family][1])(config)
    vitattn.patch(model, "locat", gaug_init=start)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for gaug in _gaug_modules(model).values():
            for t in gaug.parameters():
                t.fill_(float("nan"))  # what uninitialised memory may hold
    with seeded_init():
        model.initialize_weights()
    _assert_started(model, start)


@pytest.mark.parametrize("family", NAMES)
def test_from_pretrained_starts_the_gaug_tensors_a_checkpoint_lacks(family: str, tmp_path) -> None:
    """transformers' test_can_init_all_missing_weights, for the tensors patching adds: a saved LocAt
    model whose weights file lacks the GAug keys loads with them started by the model's weight init
    (reported missing, as transformers reports missing keys), everything else as saved."""
    model = _not_fresh(vitattn.patch(tiny_model(family, initializer_range=0.05), "locat"))
    model.save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda sd: {k: v for k, v in sd.items() if ".gaug." not in k})
    with seeded_init():
        loaded, info = vitattn.hf.from_pretrained(tmp_path, output_loading_info=True)
    _assert_started(loaded, "paper")
    gaug_keys = {k for k in model.state_dict() if ".gaug." in k}
    assert gaug_keys <= set(info["missing_keys"])
    want = {k: v for k, v in model.state_dict().items() if ".gaug." not in k}
    got = loaded.state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    x = images()
    with torch.no_grad():
        assert torch.isfinite(hidden(loaded, x).last_hidden_state).all()


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x marks modules, not tensors, as loaded (a whole loaded module is skipped)",
)
@pytest.mark.parametrize("plain_ops", [False, True], ids=["torch-init", "plain-ops"])
def test_weight_init_keeps_loaded_gaug_tensors(plain_ops: bool, monkeypatch) -> None:
    """A GAug tensor transformers marks as loaded keeps its value when the others start, also when the
    module's init writes with plain tensor ops (which transformers' guard of torch's init functions
    does not see)."""
    model = _not_fresh(vitattn.patch(tiny_model("siglip"), "locat"))
    gaug = next(iter(_gaug_modules(model).values()))
    kept = gaug.log_var.weight.detach().clone()
    gaug.log_var.weight._is_hf_initialized = True
    if plain_ops:

        def init_weights(start: str = "paper") -> None:
            with torch.no_grad():
                for p in gaug.parameters():
                    p.fill_(0.5)

        monkeypatch.setattr(gaug, "init_weights", init_weights)
    for module in model.modules():
        module._is_hf_initialized = module is not gaug and not isinstance(module, torch.nn.Linear)
    model.initialize_weights()
    torch.testing.assert_close(gaug.log_var.weight, kept, rtol=0, atol=0)
    fresh = torch.full_like(gaug.log_var.bias, 0.5 if plain_ops else 0.0)
    torch.testing.assert_close(gaug.log_var.bias, fresh, rtol=0, atol=0)
