"""Published weights: the real timm / huggingface_hub loading path against an offline Hub cache built here.

Each test writes a snapshot in huggingface_hub's cache layout
(``models--sinahmr--locatvit_tiny/{refs/main, snapshots/<sha>/{config.json, model.safetensors}}``)
under ``tmp_path``, points ``HF_HUB_CACHE`` / ``HF_HOME`` there with ``HF_HUB_OFFLINE=1`` and lets
``timm.create_model`` find and load it. Nothing here touches the network; the live Hub was not tried.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
from safetensors.torch import save_file

import vitattn  # noqa: F401  (registers the models)
from vitattn.models import HUB_WEIGHTS, LocAtViT, hub
from vitattn.models.hub import mixin_config_to_timm

from .test_models import REF_FILES, load_reference

SMALL = dict(img_size=32, depth=2)  # overrides passed both when writing and when loading


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads these once, at import: set its constants too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def write_snapshot(cache: Path, repo_id: str, state_dict: dict[str, torch.Tensor], config: dict) -> Path:
    """A snapshot of ``repo_id`` in the cache layout; returns the safetensors file written."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40-hex revision
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text(json.dumps(config))
    file = snapshot / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(file))
    return file


def assert_loaded(model: torch.nn.Module, file: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(str(file))
    state = model.state_dict()
    assert set(state) == set(expected)  # strict: the file's (official) key names are the model's
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def trained_like_state(name: str, **kw) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model = timm.create_model(name, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # so that nothing equals a fresh init by chance
    return model.state_dict()


def timm_style_config(name: str) -> dict:
    return {
        "architecture": name,
        "num_classes": 1000,
        "model_args": SMALL,
        "pretrained_cfg": {
            "input_size": [3, 32, 32],
            "interpolation": "bicubic",
            "crop_pct": 0.9,
            "mean": [0.5, 0.5, 0.5],
            "std": [0.5, 0.5, 0.5],
            "num_classes": 1000,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
    }


# ---- pretrained cfgs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["locatvit_tiny", "locatvit_base"])
def test_pretrained_cfg_of_published_variants(name: str) -> None:
    cfg = timm.models.get_pretrained_cfg(name)
    assert cfg.hf_hub_id == f"sinahmr/{name}" and cfg.has_weights
    assert cfg.num_classes == 1000 and cfg.input_size == (3, 224, 224) and cfg.fixed_input_size
    assert cfg.mean == (0.5, 0.5, 0.5) and cfg.std == (0.5, 0.5, 0.5)
    assert cfg.crop_pct == 0.9 and cfg.interpolation == "bicubic"
    assert cfg.first_conv == "patch_embed.proj" and cfg.classifier == "head"
    assert name in timm.list_models(pretrained=True)
    model = timm.create_model(name, depth=1)
    assert model.patch_embed.patch_size == (16, 16) and model.num_classes == 1000


def test_variant_without_weights_fails_clearly() -> None:
    assert not timm.models.get_pretrained_cfg("locatvit_small").has_weights
    with pytest.raises(
        ValueError, match=r"locatvit_small has no published weights.*locatvit_base, locatvit_tiny"
    ):
        timm.create_model("locatvit_small", pretrained=True)


# ---- loading from the (offline) Hub cache ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(HUB_WEIGHTS))
def test_registered_name_loads_hub_weights(hub_cache: Path, name: str) -> None:
    file = write_snapshot(
        hub_cache, HUB_WEIGHTS[name], trained_like_state(name, **SMALL), timm_style_config(name)
    )
    model = timm.create_model(name, pretrained=True, **SMALL)
    assert isinstance(model, LocAtViT)
    assert_loaded(model, file)


def test_missing_snapshot_is_an_offline_error(hub_cache: Path) -> None:
    with pytest.raises(Exception, match="(?i)offline|cannot find|local"):
        timm.create_model("locatvit_tiny", pretrained=True, **SMALL)


def test_hf_hub_prefix_with_timm_style_config(hub_cache: Path) -> None:
    file = write_snapshot(
        hub_cache,
        "sinahmr/locatvit_tiny",
        trained_like_state("locatvit_tiny", **SMALL),
        timm_style_config("locatvit_tiny"),
    )
    model = timm.create_model("hf-hub:sinahmr/locatvit_tiny", pretrained=True)
    assert isinstance(model, LocAtViT) and len(model.blocks) == 2
    assert model.pretrained_cfg["hf_hub_id"] == "sinahmr/locatvit_tiny"
    assert_loaded(model, file)


def test_hf_hub_prefix_with_mixin_config(hub_cache: Path) -> None:
    """The official class's PyTorchModelHubMixin config: plain constructor kwargs, no ``architecture``."""
    config = dict(
        patch_size=16,
        embed_dim=192,
        depth=2,
        num_heads=3,
        img_size=32,
        gaug=True,
        prr=True,
        no_pos_emb=False,
        store_metrics=True,
    )
    file = write_snapshot(
        hub_cache, "sinahmr/locatvit_tiny", trained_like_state("locatvit_tiny", **SMALL), config
    )
    hub.uninstall()  # another test of this process may have installed it
    with pytest.raises(KeyError, match="architecture"):  # timm alone: the mixin style is not its own
        timm.create_model("hf-hub:sinahmr/locatvit_tiny", pretrained=True)
    with hub.mixin_configs():
        model = timm.create_model("hf-hub:sinahmr/locatvit_tiny", pretrained=True)
    assert not hub.installed()  # restored on exit
    assert isinstance(model, LocAtViT) and len(model.blocks) == 2 and model.prr is not None
    assert model.pretrained_cfg["architecture"] == "locatvit_tiny"
    assert model.pretrained_cfg["mean"] == (0.5, 0.5, 0.5) and model.pretrained_cfg["num_classes"] == 1000
    assert_loaded(model, file)


@pytest.mark.skipif(not REF_FILES, reason="reference files not found")
def test_hf_hub_official_state_dict_reproduces_official_logits(hub_cache: Path) -> None:
    """An official state dict with its builder arguments as a mixin config: the official outputs."""
    cfg, sd, t = load_reference(REF_FILES[0])
    write_snapshot(hub_cache, "sinahmr/locatvit_tiny", sd, cfg)
    hub.install()
    try:
        model = timm.create_model("hf-hub:sinahmr/locatvit_tiny", pretrained=True).eval()
    finally:
        hub.uninstall()
    with torch.no_grad():
        torch.testing.assert_close(model(t["x0"]), t["logits0"], atol=1e-4, rtol=0)


def test_mixin_config_conversion() -> None:
    out = mixin_config_to_timm(
        {"embed_dim": 768, "num_heads": 12, "no_pos_emb": True}, "sinahmr/locatvit_base"
    )
    assert out is not None and out["architecture"] == "locatvit_base"
    assert out["model_args"] == {"embed_dim": 768, "num_heads": 12, "pos_embed": "none"}
    by_shape = mixin_config_to_timm(dict(patch_size=16, embed_dim=384, depth=12, num_heads=6), "me/finetuned")
    assert by_shape is not None and by_shape["architecture"] == "locatvit_small"
    assert mixin_config_to_timm({"hidden_size": 10}, "someone/other") is None  # left to timm as it was
    assert mixin_config_to_timm({"embed_dim": 100}, "sinahmr/locatvit_other") is None


def test_install_is_explicit_idempotent_and_undone() -> None:
    from timm.models import _hub

    hub.uninstall()  # another test of this process may have installed it
    timm_own = _hub._parse_model_cfg
    assert not hub.installed()
    hub.install()
    hub.install()  # once only: uninstall restores timm's own parser in one step
    assert hub.installed() and _hub._parse_model_cfg is not timm_own
    hub.uninstall()
    assert _hub._parse_model_cfg is timm_own and not hub.installed()
    hub.uninstall()  # a no-op
    with hub.mixin_configs():
        hub.install()  # installed before the block's end: the block still restores the state it found
    assert _hub._parse_model_cfg is timm_own


def test_import_vitattn_leaves_timms_hub_parser_alone() -> None:
    code = (
        "import vitattn, timm.models._hub as h\nassert not hasattr(h._parse_model_cfg, '_vitattn_original')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
