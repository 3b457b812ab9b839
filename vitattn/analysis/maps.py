"""Read the attention probabilities of a ViT's blocks, whatever path its attention runs.

vitattn layers call :func:`vitattn.functional.attention`, so :func:`capture_attention_weights` hands
over their probabilities (softmax, entmax, GAug bias, any backend). timm's own ``Attention`` runs
fused SDPA, which returns no weights: for it the probabilities are recomputed beside the forward from
the module's input with timm's own math, ``softmax(q·scale @ kᵀ + mask)`` after ``qkv``, ``q_norm`` and
``k_norm``. A transformers vision model computes its attention through vitattn for the length of the
capture (:func:`vitattn.hf.vitattn_implementation`: its own vitattn implementation, else ``"vitattn"``,
which for an unpatched model is softmax, the same math as transformers' eager and SDPA paths); its
vision tower runs with every patch as a token (:func:`vitattn.hf.run_backbone`). The model is read
through its layout (:func:`vitattn.adapter.layout_of`: the blocks, their attention modules, the
context in which maps can be read, the forward on images). Either way the model's forward is left
to run as it is and every hook is removed after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
from torch import nn

from ..adapter import ModelLayout, layout_of
from ..functional import capture_attention_weights, scores
from ..layers.attention import TimmStyleAttention, project_qkv, resolve_attn_mask
from ..models.blocks import block_indices

__all__ = [
    "attention_maps",
    "record_attention",
    "resolve_layers",
    "timm_attention_probs",
]

MapSink = Callable[[int, torch.Tensor], None]


def _analysis_layout(model: nn.Module) -> ModelLayout:
    """``model``'s layout for reading attention maps: a ViT attending over all its tokens (timm-style
    with ``blocks``, or a transformers vision model); a ``TypeError`` otherwise."""
    return layout_of(model, windowed=False)


def _layout_layers(layout: ModelLayout, layers: int | Iterable[int] | None) -> list[int]:
    """``layers`` as sorted block indices of ``layout`` (all by default)."""
    depth = len(layout.blocks)
    if layers is None:
        return list(range(depth))
    items = [layers] if isinstance(layers, int) else list(layers)
    return list(block_indices(items, depth))


def resolve_layers(model: nn.Module, layers: int | Iterable[int] | None = None) -> list[int]:
    """Sorted, de-duplicated block indices into ``model.blocks`` (or the encoder layers of a
    transformers model); negatives count from the end."""
    return _layout_layers(_analysis_layout(model), layers)


def _timm_attention_cls() -> type[nn.Module] | None:
    try:
        from timm.layers import Attention
    except ImportError:  # pragma: no cover - timm is a dependency
        return None
    return Attention


def _is_timm_attention(module: nn.Module) -> bool:
    cls = _timm_attention_cls()
    return cls is not None and isinstance(module, cls) and type(module).forward is cls.forward


def timm_attention_probs(
    attn: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
) -> torch.Tensor:
    """Probabilities ``(B, H, N, N)`` of timm's ``Attention`` on its input ``x: (B, N, C)``.

    timm's formula ``softmax(q kᵀ · scale + mask)`` with q, k from ``qkv``, ``q_norm``, ``k_norm``
    (:func:`~vitattn.layers.attention.project_qkv`), the scores from :func:`vitattn.functional.scores`
    (``attn_mask``: bool keep-mask or additive; ``is_causal`` takes precedence). Float32 at least.
    """
    q, k, _ = project_qkv(attn, x)
    mask = resolve_attn_mask(x.shape[1], attn_mask, is_causal, x.device)
    scale = float(cast(TimmStyleAttention, attn).scale)
    return scores(q, k, scale=scale, mask=mask).softmax(dim=-1)


def _call_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, bool]:
    x = args[0] if args else kwargs["x"]
    mask = args[1] if len(args) > 1 else kwargs.get("attn_mask")
    causal = args[2] if len(args) > 2 else kwargs.get("is_causal", False)
    return x, mask, bool(causal)


def record_attention(
    model: nn.Module, sink: MapSink, layers: int | Iterable[int] | None = None
) -> AbstractContextManager[list[int]]:
    """Within the block, every forward of a chosen block's ``attn`` calls ``sink(block_index, probs)``.

    ``probs`` is the detached ``(B, H, N, N)`` probability tensor of that forward. Yields the chosen
    block indices. The model runs unchanged (no_grad and eval are the caller's choice); all hooks
    are removed on exit, also after an error.

    Raises (during the forward) ``TypeError`` for a block whose ``attn`` neither is timm's
    ``Attention`` nor calls :func:`vitattn.functional.attention`, and ``RuntimeError`` for one that
    calls it more than once per forward.
    """
    return _record_layout(_analysis_layout(model), sink, layers)


@contextmanager
def _record_layout(
    layout: ModelLayout, sink: MapSink, layers: int | Iterable[int] | None = None
) -> Iterator[list[int]]:
    """:func:`record_attention` on a model's layout."""
    modules = list(zip(layout.attention_names, layout.attentions, strict=True))
    chosen = _layout_layers(layout, layers)
    state: dict[str, Any] = {"block": None, "probs": []}
    handles = []

    def on_probs(probs: torch.Tensor) -> None:
        if state["block"] is not None:
            state["probs"].append(probs)

    def make_hooks(i: int, attn: nn.Module) -> tuple[Callable[..., None], Callable[..., None]]:
        timm_attn = _is_timm_attention(attn)

        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state["block"], state["probs"] = i, []

        def post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            state["block"] = None
            probs: list[torch.Tensor] = state["probs"]
            if timm_attn:
                with torch.no_grad():
                    sink(i, timm_attention_probs(module, *_call_args(args, kwargs)))
            elif len(probs) == 1:
                sink(i, probs[0])
            elif not probs:
                raise TypeError(
                    f"{modules[i][0]} is {type(module).__name__}, which neither is timm's Attention nor "
                    "calls vitattn.functional.attention; its attention maps cannot be read "
                    "(vitattn.patch(model) converts timm-style attention to vitattn layers)"
                )
            else:
                raise RuntimeError(
                    f"{modules[i][0]} made {len(probs)} vitattn.functional.attention calls in one forward; "
                    "attention maps are defined for one call per block"
                )

        return pre_hook, post_hook

    try:
        for i in chosen:
            label, attn = modules[i]
            if attn is None:
                raise TypeError(f"{label.removesuffix('.attn')} has no `attn` module")
            pre_hook, post_hook = make_hooks(i, attn)
            handles.append(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(attn.register_forward_hook(post_hook, with_kwargs=True))
        with capture_attention_weights(on_probs), layout.reading_maps():
            yield chosen
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _evaluating(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Put ``model`` in eval mode inside the block, then restore every submodule's own mode."""
    modes = [(m, m.training) for m in model.modules()]
    if enabled:
        model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def attention_maps(
    model: nn.Module,
    x: torch.Tensor,
    layers: int | Iterable[int] | None = None,
    *,
    eval_mode: bool = True,
) -> dict[int, torch.Tensor]:
    """Attention probabilities of the chosen blocks for the input batch ``x`` (e.g. ``(B, 3, H, W)``).

    Args:
        model: a timm ``VisionTransformer`` (fused attention is fine), a vitattn model / patched ViT,
            or a transformers vision model (ViT, DeiT, DINOv2, ViT-MAE, CLIP, SigLIP; patched or not).
        x: the model's input (pixel values for a transformers model: its vision tower runs on them).
        layers: block indices into ``model.blocks`` (the encoder layers of a transformers model;
            negatives count from the end); None = all.
        eval_mode: run in eval mode (no dropout); every module's training flag is restored afterwards.

    Returns:
        ``{block index: (B, H, N, N) probabilities}`` in block order, detached, float32 at least,
        on the model's device; rows are queries, ``N`` counts prefix (class/register) tokens too.
        The forward runs under ``torch.no_grad()``; no hook is left behind.
    """
    return _layout_maps(_analysis_layout(model), x, layers, eval_mode=eval_mode)


def _layout_maps(
    layout: ModelLayout, x: torch.Tensor, layers: int | Iterable[int] | None = None, *, eval_mode: bool = True
) -> dict[int, torch.Tensor]:
    """:func:`attention_maps` of a model's layout."""
    maps: dict[int, torch.Tensor] = {}

    def sink(i: int, probs: torch.Tensor) -> None:
        if i in maps:
            raise RuntimeError(f"blocks[{i}].attn ran more than once in one forward of the model")
        maps[i] = probs

    recording = _record_layout(layout, sink, layers)
    with recording as chosen, torch.no_grad(), _evaluating(layout.model, eval_mode):
        layout.forward(x)
    missing = [i for i in chosen if i not in maps]
    if missing:
        raise RuntimeError(f"blocks {missing} did not run their attention in the model's forward")
    return {i: maps[i] for i in chosen}
