"""`vitattn study` with any timm backbone: building it, starting from a checkpoint or timm's
pretrained weights, patching after loading (LocAt's identity start keeps the function), the errors
of a checkpoint that does not fit, layer-wise lr decay against the formula, drop path."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from vitattn.layers import EntmaxAttention, LocAtAttention
from vitattn.study import make_config
from vitattn.study.backbone import CheckpointMismatch, classifier_keys
from vitattn.study.config import STUDY_WINDOW, ConfigError
from vitattn.study.model import build_model
from vitattn.study.optim import param_groups

# a timm ViT small enough for tests: 32 px, 4-px patches (the 8x8 grid), 2 blocks of width 32
TIMM = "vit_tiny_patch16_224"
TIMM_ARGS = {"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2}


def timm_config(**kw):
    return make_config("quick", model=TIMM, model_args=dict(TIMM_ARGS), img_size=32, **kw)


def save(model: torch.nn.Module, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def study_vit_checkpoint(tmp_path: Path, **kw) -> Path:
    torch.manual_seed(1)
    return save(
        build_model(make_config("quick", attentions=["softmax"], **kw), "softmax"), tmp_path / "s.safetensors"
    )


def test_timm_backbone_is_patched_as_asked():
    x = torch.randn(2, 3, 32, 32)
    softmax = build_model(timm_config(), "softmax")
    assert type(softmax.blocks[0].attn).__module__.startswith("timm")  # the backbone's own attention
    assert softmax(x).shape == (2, 10) and tuple(softmax.patch_embed.grid_size) == (8, 8)
    assert isinstance(build_model(timm_config(), "entmax15").blocks[1].attn, EntmaxAttention)
    locat = build_model(timm_config(), "locat")
    assert isinstance(locat.blocks[0].attn, LocAtAttention) and locat(x).shape == (2, 10)
    prr = build_model(timm_config(prr=True), "softmax")
    assert type(prr.attn_pool).__name__ == "PRRPool"
    assert type(prr.blocks[0].attn).__module__.startswith("timm")
    cfg = timm_config()
    assert cfg.model_depth == 2 and cfg.first_layers == 1 and cfg.gaug_init == "paper"


def test_unknown_model_and_start_options_are_refused():
    with pytest.raises(ValueError, match="unknown model 'vit_nonexistent'"):
        make_config(model="vit_nonexistent")
    with pytest.raises(ValueError, match="--pretrained or --checkpoint, not both"):
        timm_config(pretrained=True, checkpoint="x.safetensors")
    with pytest.raises(ValueError, match="--pretrained needs --model"):
        make_config(pretrained=True)
    with pytest.raises(ValueError, match="layer_decay"):
        make_config(layer_decay=1.5)
    with pytest.raises(ValueError, match="gaug_init"):
        make_config(gaug_init="zeros")


def test_locat_identity_start_from_a_checkpoint_keeps_the_function(tmp_path):
    path = study_vit_checkpoint(tmp_path)
    config = make_config("quick", checkpoint=str(path))
    assert config.gaug_init == "identity" and config.from_weights
    softmax = build_model(config, "softmax").eval()
    locat = build_model(config, "locat").eval()
    paper = build_model(make_config("quick", checkpoint=str(path), gaug_init="paper"), "locat").eval()
    assert isinstance(locat.blocks[0].attn, LocAtAttention)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want, got, far = softmax(x), locat(x), paper(x)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # the identity start: α tiny
    assert (far - want).abs().max() > 10 * (got - want).abs().max()  # the paper's start moves it
    for key, value in softmax.state_dict().items():
        torch.testing.assert_close(locat.state_dict()[key], value, rtol=0, atol=0)


def test_a_patched_checkpoint_loads_its_gaug_heads_too(tmp_path):
    torch.manual_seed(3)
    finished = build_model(make_config("quick", checkpoint=str(study_vit_checkpoint(tmp_path))), "locat")
    with torch.no_grad():
        finished.blocks[0].attn.gaug.log_alpha.bias.fill_(0.123)
    path = save(finished, tmp_path / "locat.safetensors")
    again = build_model(make_config("quick", checkpoint=str(path)), "locat")
    assert again.blocks[0].attn.gaug.log_alpha.bias.item() == pytest.approx(0.123)


def test_head_of_another_size_is_reinitialised_with_a_note(tmp_path):
    torch.manual_seed(0)
    ten = build_model(timm_config(), "softmax")
    path = save(ten, tmp_path / "ten.safetensors")
    notes: list[str] = []
    same = build_model(timm_config(checkpoint=str(path)), "softmax", log=notes.append)
    assert same.head.weight.shape == (10, 32) and not notes  # same size: loaded as it is
    torch.testing.assert_close(same.head.weight, ten.head.weight)
    state = ten.state_dict()
    state["head.weight"], state["head.bias"] = torch.zeros(7, 32), torch.zeros(7)
    save_file(state, str(tmp_path / "seven.safetensors"))
    config = timm_config(checkpoint=str(tmp_path / "seven.safetensors"))
    model = build_model(config, "softmax", log=notes.append)
    assert len(notes) == 1 and "head re-initialised" in notes[0] and "(7, 32) -> (10, 32)" in notes[0]
    assert model.head.weight.abs().sum() > 0  # fresh, not the checkpoint's zeros
    torch.testing.assert_close(model.blocks[1].mlp.fc2.weight, ten.blocks[1].mlp.fc2.weight)
    assert classifier_keys(model) == ["head.weight", "head.bias"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda sd: sd.pop("blocks.1.norm1.weight"), r"1 missing key\(s\) \['blocks.1.norm1.weight'\]"),
        (lambda sd: sd.__setitem__("blocks.9.attn.qkv.weight", torch.zeros(1)), r"1 unexpected key\(s\)"),
        (lambda sd: sd.__setitem__("pos_embed", torch.zeros(1, 5, 32)), r"first 'pos_embed': \(1, 5, 32\)"),
    ],
)  # fmt: skip
def test_a_checkpoint_that_does_not_fit_names_the_first_keys(tmp_path, edit, message, capsys):
    torch.manual_seed(0)
    state = build_model(timm_config(), "softmax").state_dict()
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointMismatch, match=message):
        build_model(timm_config(checkpoint=str(tmp_path / "bad.safetensors")), "locat")
    from vitattn.cli import main

    args = ["study", "--model", TIMM, "--img-size", "32", "--epochs", "1", "--no-probe", "--no-progress"]
    args += [f"--model-arg={k}={v}" for k, v in TIMM_ARGS.items()]
    args += ["--checkpoint", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitattn study: checkpoint") and "bad.safetensors" in err


def test_checkpoint_formats_and_the_seed_placeholder(tmp_path):
    torch.manual_seed(0)
    model = build_model(timm_config(), "softmax")
    torch.save({"state_dict": model.state_dict()}, tmp_path / "w-s4.pt")  # weights-only torch file
    config = timm_config(checkpoint=str(tmp_path / "w-s{seed}.pt"))
    loaded = build_model(config, "softmax", seed=4)
    torch.testing.assert_close(
        loaded.state_dict()["blocks.0.attn.qkv.weight"], model.blocks[0].attn.qkv.weight
    )
    with pytest.raises(FileNotFoundError, match="w-s5.pt"):
        build_model(config, "softmax", seed=5)
    torch.save({"model": model.state_dict(), "extra": Path("x")}, tmp_path / "pickle.pt")  # not weights-only
    with pytest.raises(CheckpointMismatch, match="weights_only"):
        build_model(timm_config(checkpoint=str(tmp_path / "pickle.pt")), "softmax")


def test_pretrained_goes_through_timms_loader(tmp_path):
    """--pretrained from a local file (``pretrained_cfg_overlay``), as timm reads the Hub cache."""
    torch.manual_seed(0)
    source = timm.create_model(TIMM, num_classes=1000, **TIMM_ARGS, img_size=32)
    path = save(source, tmp_path / "pretrained.safetensors")
    args = dict(TIMM_ARGS, pretrained_cfg_overlay={"file": str(path)})
    config = make_config("quick", model=TIMM, model_args=args, img_size=32, pretrained=True)
    model = build_model(config, "locat")
    assert config.gaug_init == "identity" and model.head.weight.shape == (10, 32)  # a new head
    torch.testing.assert_close(model.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    assert isinstance(model.blocks[1].attn, LocAtAttention)


def test_layer_decay_groups_follow_the_formula():
    model = build_model(timm_config(layer_decay=0.5, lr=1e-3, weight_decay=0.05), "locat")
    groups = param_groups(model, timm_config(layer_decay=0.5, lr=1e-3, weight_decay=0.05))
    lr_of = {id(p): (1e-3 * g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}
    depth = 2  # timm's layer ids: embeddings 0, block i -> i + 1 (final norm: the last's), head depth + 1
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            layer = int(name.split(".")[1]) + 1
        elif name.startswith("norm."):
            layer = depth
        elif name.startswith("head."):
            layer = depth + 1
        else:
            layer = 0
        lr, wd = lr_of[id(p)]
        assert lr == pytest.approx(1e-3 * 0.5 ** (depth + 1 - layer)), name
        no_decay = p.ndim <= 1 or name in ("pos_embed", "cls_token")
        assert wd == (0.0 if no_decay else 0.05), name
    assert any(".gaug." in n for n, _ in model.named_parameters())  # LocAt's heads are grouped too
    plain = param_groups(model, timm_config())
    assert [len(g["params"]) for g in plain] == [
        sum(
            1 for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "token" not in n
        ),
        sum(
            1
            for n, p in model.named_parameters()
            if not (p.ndim > 1 and "pos_embed" not in n and "token" not in n)
        ),
    ]


def test_drop_path_reaches_the_blocks():
    study = build_model(make_config("quick", drop_path=0.2, depth=3), "softmax")
    assert isinstance(study.blocks[0].drop_path1, torch.nn.Identity)  # timm's rule: 0 for the first block
    assert study.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)
    timm_model = build_model(timm_config(drop_path=0.1), "entmax15")
    assert timm_model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)


@pytest.mark.parametrize("layer_decay", [None, 0.5])
def test_gaug_lr_scale_multiplies_only_the_gaug_heads(layer_decay):
    config = timm_config(layer_decay=layer_decay, lr=1e-3, weight_decay=0.05)
    model = build_model(config, "locat")
    base = {
        id(p): (1e-3 * g.get("lr_scale", 1.0), g["weight_decay"])
        for g in param_groups(model, config)
        for p in g["params"]
    }
    scaled_config = timm_config(layer_decay=layer_decay, lr=1e-3, weight_decay=0.05, gaug_lr_scale=100.0)
    scaled = param_groups(model, scaled_config)
    got = {id(p): (1e-3 * g["lr_scale"], g["weight_decay"]) for g in scaled for p in g["params"]}
    assert sorted(got) == sorted(base)  # every parameter once
    names = dict(model.named_parameters())
    assert any(".gaug." in n for n in names)
    for name, p in names.items():
        lr, wd = base[id(p)]
        assert got[id(p)] == (pytest.approx(lr * (100.0 if ".gaug." in name else 1.0)), wd), name
    with pytest.raises(ValueError, match="gaug_lr_scale"):
        timm_config(gaug_lr_scale=0.0)


def test_window_and_adaptive_from_a_checkpoint_keep_its_weights(tmp_path):
    """`--checkpoint` with `--attention window` / `adaptive`: the study ViT's weights load, then the
    attention is swapped (a 5x5 neighbourhood; one learnable alpha per head from 1.5)."""
    from vitattn.layers import NeighborhoodAttention
    from vitattn.layers.adaptive import AdaptiveAlpha
    from vitattn.study.model import STUDY_WINDOW

    path = study_vit_checkpoint(tmp_path)
    config = make_config("quick", checkpoint=str(path))
    softmax = build_model(config, "softmax").eval()
    window = build_model(config, "window").eval()
    adaptive = build_model(config, "adaptive").eval()
    assert all(isinstance(b.attn, NeighborhoodAttention) for b in window.blocks)
    assert window.blocks[0].attn.window == (STUDY_WINDOW, STUDY_WINDOW)
    alphas = [m for m in adaptive.modules() if isinstance(m, AdaptiveAlpha)]
    assert len(alphas) == len(adaptive.blocks)
    for alpha in alphas:
        torch.testing.assert_close(alpha().detach(), torch.full_like(alpha().detach(), 1.5))
    for model in (window, adaptive):
        own = model.state_dict()
        for key, value in softmax.state_dict().items():
            torch.testing.assert_close(own[key], value, rtol=0, atol=0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(window(x), softmax(x))  # the window changes what block 0 sees
        assert adaptive(x).shape == (2, 10)


def test_an_input_size_that_is_not_a_multiple_of_the_patch_is_refused():
    """40 px with 16-px patches would train on a 2x2 grid that never sees 8 pixel rows and columns (the
    conv patch embedding drops them): refused when the config is made, naming both sizes; timm's
    ``dynamic_img_pad`` pads instead, so it passes."""
    with pytest.raises(ConfigError, match=r"img_size 40 is not a multiple of the patch size 16") as info:
        make_config("quick", model=TIMM, model_args={"depth": 1}, img_size=40)
    assert info.value.render(lambda f: "--" + f.replace("_", "-")).startswith("--img-size 40 is not")
    with pytest.raises(ConfigError, match=r"img_size 36 is not a multiple of the patch size 8 .*32 or 40"):
        make_config("quick", model=TIMM, model_args=dict(TIMM_ARGS, patch_size=8), img_size=36)
    pads = dict(TIMM_ARGS, dynamic_img_pad=True, dynamic_img_size=True)
    padded = make_config("quick", model=TIMM, model_args=pads, img_size=34)
    assert build_model(padded, "softmax")(torch.randn(1, 3, 34, 34)).shape == (1, 10)
    make_config("quick", model=TIMM, model_args={"depth": 1}, img_size=48)  # a multiple: accepted


def test_a_timm_backbone_is_built_at_the_input_size():
    """Without --img-size the backbone takes the dataset's images (32 px scenes), not timm's default
    224 (which failed at the first batch)."""
    config = make_config("quick", model=TIMM, model_args=dict(TIMM_ARGS))
    model = build_model(config, "softmax")
    assert tuple(model.patch_embed.img_size) == (32, 32) and config.input_size == 32
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_window_attention_takes_its_window_and_dilation():
    study = build_model(make_config("quick", attentions=["window"], window=3, window_dilation=2), "window")
    timm_vit = build_model(timm_config(attentions=["window"], window=3), "window")
    default = build_model(make_config("quick", attentions=["window"]), "window")
    assert study.blocks[0].attn.window == (3, 3) and study.blocks[1].attn.dilation == (2, 2)
    assert timm_vit.blocks[0].attn.window == (3, 3) and timm_vit.blocks[0].attn.dilation == (1, 1)
    assert default.blocks[0].attn.window == (STUDY_WINDOW, STUDY_WINDOW)
    with pytest.raises(ConfigError, match="window and window_dilation are for the 'window' attention"):
        make_config("quick", window=3)  # the quick preset's attentions have no window


@pytest.mark.parametrize(
    ("grid", "window", "dilation"),
    [((4, 4), 5, 1), ((4, 4), 4, 1), ((4, 4), 3, 1), ((8, 8), 5, 1), ((4, 4), 5, 2), ((1, 6), 6, 1),
     ((1, 6), 5, 1), ((2, 3), 3, 1), ((3, 3), 7, 3)],
)  # fmt: skip
def test_window_covers_grid_matches_the_mask(grid, window, dilation):
    from vitattn.functional import WindowMask
    from vitattn.study.runner import window_covers_grid

    dense = WindowMask(grid, window, 0, dilation).patch_keep()
    assert window_covers_grid(grid, window, dilation) == bool(dense.all())


def test_check_inputs_reads_each_seeds_checkpoint_before_anything_is_written(tmp_path):
    """The study's checks before it writes: every remaining seed's checkpoint exists, is readable
    and fits the model of every attention (shapes only, models on the meta device)."""
    from vitattn.study.distributed import DistEnv
    from vitattn.study.runner import check_inputs, run_specs

    torch.manual_seed(0)
    path = save(build_model(timm_config(), "softmax"), tmp_path / "w-s0.safetensors")
    config = timm_config(checkpoint=str(tmp_path / "w-s{seed}.safetensors"), seeds=[0, 1])
    specs = run_specs(config)
    check_inputs(config, DistEnv(), [s for s in specs if s.seed == 0])  # seed 0's file fits
    with pytest.raises(FileNotFoundError, match="w-s1.safetensors"):
        check_inputs(config, DistEnv(), specs)
    state = load_file(str(path))
    state["blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "w-s1.safetensors"))
    with pytest.raises(CheckpointMismatch, match=r"w-s1.safetensors.*'blocks.0.attn.qkv.weight'"):
        check_inputs(config, DistEnv(), specs)
