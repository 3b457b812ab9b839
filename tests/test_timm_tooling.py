"""timm tooling on vitattn models: meta device, FX feature extraction, features_only, forward_intermediates,
torch.compile(fullgraph=True).

Every model name vitattn registers with timm is checked (built small), and so is a patched
``vit_tiny_patch16_224`` with each of the three attentions. The FX, features_only and
forward_intermediates checks follow the ones timm's own ``tests/test_models.py`` makes for its models
(``test_model_forward_fx``, ``test_model_backward_fx``, ``test_model_forward_features``,
``test_model_forward_intermediates``); the meta-device and compile checks are vitattn's.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from timm.models._features import FeatureGetterNet
from torchvision.models.feature_extraction import create_feature_extractor as tv_create_feature_extractor
from torchvision.models.feature_extraction import get_graph_node_names

import vitattn

SIZE = 32  # input side: a 4 x 4 patch grid at patch 8


def vitattn_model_names() -> list[str]:
    """Every timm model name whose entrypoint lives in vitattn."""
    names = timm.list_models()
    return [n for n in names if timm.models.model_entrypoint(n).__module__.startswith("vitattn.")]


def small_kwargs(name: str) -> dict:
    if "swin" in name:
        return dict(img_size=64, window_size=4, embed_dim=48, depths=(2, 2), num_heads=(3, 6))
    if "jumbo" in name:  # the base's J·D-wide shared MLP alone would hold 85 M parameters
        return dict(img_size=SIZE, patch_size=8, depth=2, embed_dim=48, num_heads=3, J=2)
    return dict(img_size=SIZE, patch_size=8, depth=2)


ATTENTIONS = ("softmax", "entmax15", "locat")
CASES = [f"registered:{n}" for n in vitattn_model_names()] + [f"patched:{a}" for a in ATTENTIONS]


def build(case: str, **kw) -> torch.nn.Module:
    kind, what = case.split(":")
    if kind == "registered":
        return timm.create_model(what, **{**small_kwargs(what), **kw})
    model = timm.create_model("vit_tiny_patch16_224", img_size=SIZE, patch_size=8, depth=2, **kw)
    return vitattn.patch(model, what, prr=what == "locat")


def image_size(model: torch.nn.Module) -> tuple[int, int]:
    return tuple(int(s) for s in model.patch_embed.img_size)


def block_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's blocks by qualified name: ``blocks.i`` of a ViT / Eva, ``layers.i`` (stages) of a Swin."""
    if hasattr(model, "blocks"):
        return {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    return {f"layers.{i}": stage for i, stage in enumerate(model.layers)}


def test_cases_cover_the_registered_models() -> None:
    assert {"locatvit_tiny", "locatvit_small", "locatvit_base"} <= set(vitattn_model_names())


# ---- meta device -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_meta_device_construction_and_forward(case: str) -> None:
    with torch.device("meta"):
        model = build(case).eval()
        x = torch.empty(2, 3, *image_size(model))
        out = model(x)
        feats = model.forward_features(x)
    assert all(p.is_meta for p in model.parameters())
    assert out.is_meta and out.shape == (2, model.num_classes)
    assert feats.is_meta and feats.shape[0] == 2 and feats.shape[-1] == model.num_features


@pytest.mark.parametrize("normalizer", ["entmax15", "sparsemax", 1.25])
def test_meta_device_with_sparse_normalizers(normalizer: object) -> None:
    """The entmax family reads values (threshold search) in eager mode: on meta, shapes only."""
    with torch.device("meta"):
        model = timm.create_model("locatvit_tiny", normalizer=normalizer).eval()
        out = model(torch.empty(1, 3, 224, 224))
    assert out.is_meta and out.shape == (1, 1000)


def test_meta_model_materializes_and_runs() -> None:
    """The usual meta flow: build on meta, ``to_empty`` on CPU, load real weights, run."""
    ref = timm.create_model("locatvit_tiny", **small_kwargs("locatvit_tiny")).eval()
    with torch.device("meta"):
        model = timm.create_model("locatvit_tiny", **small_kwargs("locatvit_tiny"))
    model = model.to_empty(device="cpu").eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 3, SIZE, SIZE)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


# ---- FX --------------------------------------------------------------------------------------------------
def _timm_tracer_kwargs() -> dict:
    return dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())


@pytest.mark.parametrize("case", CASES)
def test_fx_block_features_match_eager(case: str) -> None:
    """``timm.models.create_feature_extractor`` on the blocks and the final output, as timm's test."""
    model = build(case).eval()
    x = torch.randn(1, 3, *image_size(model))
    blocks = block_modules(model)
    nodes = list(blocks)
    expected: dict[str, torch.Tensor] = {}
    hooks = [
        block.register_forward_hook(lambda m, a, o, name=name: expected.__setitem__(name, o))
        for name, block in blocks.items()
    ]
    with torch.no_grad():
        logits = model(x)
    for h in hooks:
        h.remove()
    extractor = timm.models.create_feature_extractor(model, return_nodes=nodes)
    with torch.no_grad():
        got = extractor(x)
    assert list(got) == nodes
    for name in nodes:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5)

    # the last graph node (the logits), traced with timm's leaf registry like timm's test_model_forward_fx
    _, eval_nodes = get_graph_node_names(model, tracer_kwargs=_timm_tracer_kwargs())
    full = tv_create_feature_extractor(model, [eval_nodes[-1]], tracer_kwargs=_timm_tracer_kwargs())
    with torch.no_grad():
        torch.testing.assert_close(next(iter(full(x).values())), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["registered:locatvit_tiny", "patched:locat", "patched:entmax15"])
def test_plain_torchvision_fx_without_timm_registry(case: str) -> None:
    """vitattn's leaves are also ``torch.fx.wrap``-ed, so torchvision's tracer alone works."""
    model = build(case).eval()
    x = torch.randn(1, 3, *image_size(model))
    extractor = tv_create_feature_extractor(model, return_nodes={"blocks.1": "b1", "head": "logits"})
    with torch.no_grad():
        out = extractor(x)
        torch.testing.assert_close(out["logits"], model(x), atol=1e-5, rtol=1e-5)
    assert out["b1"].shape[-1] == model.embed_dim


@pytest.mark.parametrize("case", CASES)
def test_fx_backward_reaches_every_parameter(case: str) -> None:
    """timm's test_model_backward_fx: the traced train-mode graph gives every parameter a gradient."""
    model = build(case, num_classes=7).train()
    _, eval_nodes = get_graph_node_names(model, tracer_kwargs=_timm_tracer_kwargs())
    fx_model = tv_create_feature_extractor(
        model,
        train_return_nodes=[eval_nodes[-1]],
        eval_return_nodes=[eval_nodes[-1]],
        tracer_kwargs=_timm_tracer_kwargs(),
    )
    out = next(iter(fx_model(torch.randn(2, 3, *image_size(model))).values()))
    out.mean().backward()
    missing = [n for n, p in fx_model.named_parameters() if p.grad is None]
    assert out.shape == (2, 7) and not missing and torch.isfinite(out).all()


# ---- features_only / forward_intermediates ---------------------------------------------------------------
def _check_feature_maps(outputs, channels, reductions, size: tuple[int, int]) -> None:
    assert len(outputs) == len(channels)
    for c, r, o in zip(channels, reductions, outputs, strict=True):
        assert o.shape[0] == 1 and o.shape[1] == c  # NCHW
        assert o.shape[2] <= math.ceil(size[0] / r) + 1 and o.shape[3] <= math.ceil(size[1] / r) + 1
        assert torch.isfinite(o).all()


@pytest.mark.parametrize("case", CASES)
def test_features_only(case: str) -> None:
    kind, what = case.split(":")
    if kind == "registered":
        model = timm.create_model(what, features_only=True, out_indices=(0, 1), **small_kwargs(what)).eval()
        size = (small_kwargs(what)["img_size"],) * 2
    else:
        model = FeatureGetterNet(build(case), out_indices=(0, 1)).eval()
        size = image_size(model.model)
    with torch.no_grad():
        outputs = model(torch.randn(1, 3, *size))
    if str(getattr(model, "output_fmt", "NCHW")).endswith("NHWC"):  # a Swin's stages, as timm's own
        outputs = [o.permute(0, 3, 1, 2) for o in outputs]
    _check_feature_maps(outputs, model.feature_info.channels(), model.feature_info.reduction(), size)


@pytest.mark.parametrize("case", CASES)
def test_forward_intermediates(case: str) -> None:
    model = build(case).eval()
    info = timm.models.FeatureInfo(model.feature_info, len(model.feature_info))
    size = image_size(model)
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, output_fmt="NCHW")
        torch.testing.assert_close(final, model.forward_features(x))
        _, only = model.forward_intermediates(x, indices=[0], intermediates_only=False)
    _check_feature_maps(inter, info.channels(), info.reduction(), size)
    torch.testing.assert_close(only[0], inter[0])


# ---- torch.compile ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_compile_fullgraph_no_graph_breaks(case: str) -> None:
    """Eval under no_grad: one graph, no breaks (dynamo only: backend "eager" keeps it fast)."""
    torch._dynamo.reset()
    model = build(case).eval()
    x = torch.randn(2, 3, *image_size(model))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
        assert explained.graph_count == 1
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compile_fullgraph_locat_entmax_aot_eager() -> None:
    """GAug-biased entmax-1.5 (a fixed number of Newton steps under compile), through AOT autograd."""
    torch._dynamo.reset()
    model = timm.create_model("locatvit_tiny", normalizer="entmax15", **small_kwargs("locatvit_tiny")).eval()
    x = torch.randn(1, 3, SIZE, SIZE)
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


# ---- TorchScript -----------------------------------------------------------------------------------------
@pytest.mark.skip(
    reason="TorchScript is not supported: it is deprecated in current PyTorch (torch.compile / torch.export "
    "replace it), and vitattn's attention path (dataclass bias descriptions, the backend dispatcher, "
    "autograd Functions) is not scriptable. See docs/layers.md."
)
def test_torchscript() -> None:  # pragma: no cover - documented as unsupported
    torch.jit.script(timm.create_model("locatvit_tiny", **small_kwargs("locatvit_tiny")))


# ---- timm's AttentionExtract on vitattn layers (fused attention off) -------------------------------------
EXTRACT_NAMES = ["*attn.softmax", "*attn.entmax*", "*attn.sparsemax"]  # docs/layers.md
# window and adaptive layers (and LocAt with both) branch on their window and learned alphas: FX must
# still trace them (their data-dependent parts are leaves)
COMPOSED = {
    "window": dict(attention="window", window=3),
    "adaptive": dict(normalizer="adaptive"),
    "locat-window-adaptive": dict(attention="locat", window=3, normalizer="adaptive"),
    "window-entmax": dict(attention="window", window=3, normalizer="entmax15"),
}
EXTRACT_CASES = [
    *CASES,
    "patched-entmax:1.25",
    "patched-entmax:sparsemax",
    *(f"composed:{name}" for name in COMPOSED),
]


def _build_extract_case(case: str) -> torch.nn.Module:
    """The case's model without PRR (whose attention is no block's)."""
    kind, what = case.split(":")
    if kind == "registered":
        return timm.create_model(what, **small_kwargs(what), prr=False)
    model = timm.create_model("vit_tiny_patch16_224", img_size=SIZE, patch_size=8, depth=2)
    if kind == "patched":
        return vitattn.patch(model, what)
    if kind == "composed":
        return vitattn.patch(model, **COMPOSED[what])  # type: ignore[arg-type]
    return vitattn.patch(model, "softmax", normalizer=float(what) if what[0].isdigit() else what)


@pytest.fixture
def unfused():
    """timm's fused attention switched off while the test builds its models (restored after)."""
    from timm.layers import config as timm_config

    before = timm_config._USE_FUSED_ATTN
    timm.layers.set_fused_attn(False)
    yield
    timm_config._USE_FUSED_ATTN = before


def _captured_maps(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every attention call's weights in one forward, in call order (the reference)."""
    seen: list[torch.Tensor] = []
    with torch.no_grad(), vitattn.functional.capture_attention_weights(seen.append):
        model(x)
    return seen


@pytest.mark.parametrize("case", EXTRACT_CASES)
def test_attention_extract_hook_and_fx(case: str, unfused) -> None:
    """With fused attention off, ``AttentionExtract`` returns every block's weights, by hook (its default
    ``*attn_drop`` names) and by FX (the documented node names)."""
    from timm.utils import AttentionExtract

    model = _build_extract_case(case).eval()
    assert all(getattr(m, "fused_attn", True) is False for m in model.modules() if hasattr(m, "attn_drop"))
    x = torch.randn(2, 3, *image_size(model))
    want = _captured_maps(model, x)
    by_hook = AttentionExtract(model, method="hook")(x)
    assert len(by_hook) == len(want) >= 2
    for got, ref in zip(by_hook.values(), want, strict=True):
        assert got.dim() == 4 and got.shape[-1] == got.shape[-2]
        torch.testing.assert_close(got, ref)
    by_fx = AttentionExtract(model, names=EXTRACT_NAMES, method="fx")(x)
    assert len(by_fx) == len(want)
    for got, ref in zip(by_fx.values(), want, strict=True):
        torch.testing.assert_close(got, ref)


def test_attention_extract_default_names(unfused) -> None:
    """Softmax layers (LocAt too) answer timm's default ``*attn.softmax``; entmax layers their own name."""
    from timm.utils import AttentionExtract

    locat = build("registered:locatvit_tiny").eval()
    assert list(AttentionExtract(locat).names) == ["blocks.0.attn.softmax", "blocks.1.attn.softmax"]
    entmax = build("patched:entmax15").eval()
    with pytest.raises(RuntimeError, match="No node names"):
        AttentionExtract(entmax)
    assert list(AttentionExtract(entmax, names=["*attn.entmax15"]).names) == [
        "blocks.0.attn.entmax15",
        "blocks.1.attn.entmax15",
    ]


@pytest.mark.parametrize(
    "case",
    ["registered:locatvit_tiny", "patched:entmax15", "composed:locat-window-adaptive", "composed:window"],
)
def test_explicit_path_equals_fused(case: str) -> None:
    """The explicit path computes what the fused one does: outputs and gradients (float64, eval)."""
    model = (_build_extract_case(case) if case.startswith("composed") else build(case)).double().eval()
    x = torch.randn(2, 3, *image_size(model), dtype=torch.float64)
    attns = [m for m in model.modules() if hasattr(m, "fused_attn") and hasattr(m, "normalizer")]
    assert attns and all(a.fused_attn for a in attns)  # timm's default: fused, the fast path

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused_out, fused_grads = run()
    for a in attns:
        a.fused_attn = False
    explicit_out, explicit_grads = run()
    torch.testing.assert_close(explicit_out, fused_out)
    assert len(explicit_grads) == len(fused_grads) > 10
    for g, f in zip(explicit_grads, fused_grads, strict=True):
        torch.testing.assert_close(g, f)


@pytest.mark.parametrize(
    "case", ["registered:locatvit_tiny", "composed:window", "composed:adaptive", "patched:entmax15"]
)
def test_fx_graph_node_names_of_composed_layers(case: str, unfused) -> None:
    """timm's ``get_graph_node_names`` traces window / adaptive / entmax / LocAt layers on the explicit
    path (it raised ``TraceError`` on window and adaptive layers): the weights are one node per block."""
    from timm.models import get_graph_node_names as timm_node_names

    model = _build_extract_case(case).eval()
    _, eval_nodes = timm_node_names(model)
    want = vitattn.layers.attention_extract_names(model)
    assert want and set(want) <= set(eval_nodes)


@pytest.mark.parametrize(
    "case",
    ["registered:locatvit_tiny", "registered:locatswin_tiny", "patched:entmax15", "composed:adaptive"]
    + ["composed:window-entmax", "plain"],
)
@pytest.mark.parametrize("method", ["fx", "hook"])
def test_attention_extract_names_helper(case: str, method: str) -> None:
    """``attention_extract_names`` refuses a model whose attention is fused (timm's default), naming
    the fix; after ``use_explicit_attention`` its names make ``AttentionExtract`` return every block's
    weights (equal to the ones a capture sees), whatever the normalizer."""
    from timm.utils import AttentionExtract

    from vitattn.layers import attention_extract_names, use_explicit_attention

    if case == "plain":  # timm's own layers
        model = timm.create_model("vit_tiny_patch16_224", img_size=SIZE, patch_size=8, depth=2)
    else:
        model = _build_extract_case(case)
    model.eval()
    flags = [m.fused_attn for m in model.modules() if hasattr(m, "attn_drop") and hasattr(m, "fused_attn")]
    if "swin" in case:  # timm's Swin counts fused attention as experimental: off by default
        assert not any(flags)
    else:
        assert all(flags)
        with pytest.raises(ValueError, match=r"fused .*use_explicit_attention\(model\)"):
            attention_extract_names(model, method)
    use_explicit_attention(model)
    names = attention_extract_names(model, method)
    x = torch.randn(2, 3, *image_size(model))
    got = AttentionExtract(model, names=names, method=method)(x)
    assert list(got) == names
    if case != "plain":  # timm's layers do not report to vitattn's capture
        want = _captured_maps(model, x)
        assert len(want) == len(names) >= 2
        for g, w in zip(got.values(), want, strict=True):
            torch.testing.assert_close(g, w)
    use_explicit_attention(model, False)
    assert all(m.fused_attn for m in model.modules() if hasattr(m, "attn_drop") and hasattr(m, "fused_attn"))
    with pytest.raises(ValueError, match="method must be 'fx' or 'hook'"):
        attention_extract_names(model, "graph")
    with pytest.raises(ValueError, match="no attention module"):
        attention_extract_names(torch.nn.Linear(2, 2))
