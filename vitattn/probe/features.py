"""Patch features of a frozen backbone, per block: ``(B, C, gh, gw)`` plus the class token.

Four kinds of backbone:

1. a timm-style ViT with ``forward_intermediates`` (timm ``VisionTransformer``, vitattn's
   ``LocAtViT``, ViTs patched by :func:`vitattn.patch`): the block outputs it returns, through the
   final norm when ``norm=True``, split into prefix and patch tokens by timm;
2. a model with ``.blocks`` but no ``forward_intermediates``: forward hooks on the blocks, the token
   layout from :func:`vitattn.models.layout.model_grid_size` / ``model_num_prefix_tokens``,
   ``model.norm`` applied when ``norm=True`` and present;
3. a transformers vision model (ViT, DeiT, DINOv2 with or without registers, ViT-MAE, CLIP, SigLIP;
   see :mod:`vitattn.hf`): forward hooks on its encoder layers while its vision tower runs with every
   patch a token, the tower's final norm (``layernorm``, or ``post_layernorm`` for CLIP and SigLIP)
   applied when ``norm=True``, the prefix tokens (class, distillation, register tokens) split off;
   SigLIP has no class token;
4. any other callable ``(B, 3, H, W) -> (B, C, gh, gw)``: its output is the one "layer" (index 0,
   so ``layers`` must be ``(-1,)`` or ``(0,)``) and there is no class token.

PRR (LocAtViT's refinement after the final norm) is not part of any block output, so it is not applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..functional import grid_pair
from ..models.blocks import block_indices, is_transformers_model, module_items
from ..models.layout import model_grid_size, model_num_prefix_tokens, resolve_layout

__all__ = ["FeatureMaps", "backbone_depth", "check_image_size", "patch_features", "patch_size_of"]

Backbone = nn.Module | Callable[[torch.Tensor], torch.Tensor]


@dataclass
class FeatureMaps:
    """Features of one block: ``patches (B, C, gh, gw)``; ``cls (B, C)`` or None without a class token."""

    patches: torch.Tensor
    cls: torch.Tensor | None


def _blocks(backbone: Backbone) -> nn.Sequential | nn.ModuleList | None:
    blocks = getattr(backbone, "blocks", None)
    return blocks if isinstance(blocks, nn.Sequential | nn.ModuleList) else None


def backbone_depth(backbone: Backbone) -> int:
    """Number of blocks the ``layers`` index into (encoder layers of a transformers model; 1 for a
    plain feature callable)."""
    if is_transformers_model(backbone):
        from ..hf.layout import hf_layout

        return hf_layout(backbone).depth  # type: ignore[arg-type]
    blocks = _blocks(backbone)
    return len(blocks) if blocks is not None else 1


def patch_size_of(model: nn.Module) -> tuple[int, int] | None:
    """``(rows, columns)`` of a patch of a timm-style ViT (``patch_embed.patch_size``) or of a
    transformers vision model (its config's ``patch_size``); None for a model without patches."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        return hf_layout(model).patch_size
    size = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    return None if size is None else grid_pair("patch_embed.patch_size", tuple(size))


def check_image_size(model: nn.Module, size: int | Sequence[int], name: str = "image size") -> None:
    """Refuse an input size that is not a multiple of ``model``'s patch size.

    A convolutional patch embedding (timm's, transformers') silently drops the pixels past the last
    whole patch: 40 px with 16-px patches is a 2x2 grid that never sees 8 pixel rows and columns.
    Passes when the model has no patch embedding, or pads the input itself (timm's
    ``dynamic_img_pad``). ``name`` names the size in the ``ValueError`` (an option or a field).
    """
    patch_size = patch_size_of(model)
    if patch_size is None or getattr(getattr(model, "patch_embed", None), "dynamic_img_pad", False):
        return
    h, w = grid_pair(name, size)
    (ph, pw) = patch_size
    if h % ph == 0 and w % pw == 0:
        return
    shown = f"{h}" if h == w else f"{h}x{w}"
    patch = f"{ph}" if ph == pw else f"{ph}x{pw}"
    below = h - h % ph
    hint = f" (e.g. {below} or {below + ph})" if ph == pw and h == w and below > 0 else ""
    raise ValueError(
        f"{name} {shown} is not a multiple of the patch size {patch} of {type(model).__name__}: its "
        f"{h // ph}x{w // pw} patch grid would drop the last {h % ph} pixel row(s) and {w % pw} "
        f"column(s) of every image; give a multiple of {patch}{hint}"
    )


def _has_class_token(backbone: Backbone) -> bool:
    if getattr(backbone, "cls_token", None) is not None:
        return True
    return bool(getattr(backbone, "has_class_token", False))


def _from_intermediates(
    model: nn.Module,
    forward_intermediates: Callable[..., Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]],
    images: torch.Tensor,
    layers: tuple[int, ...],
    norm: bool,
) -> dict[int, FeatureMaps]:
    """Features from ``model``'s own ``forward_intermediates`` (the bound method, passed in)."""
    out = forward_intermediates(
        images,
        indices=list(layers),
        norm=norm,
        output_fmt="NCHW",
        intermediates_only=True,
        return_prefix_tokens=True,
        stop_early=True,
    )
    cls_ok = _has_class_token(model)
    maps: dict[int, FeatureMaps] = {}
    for layer, item in zip(layers, out, strict=True):
        if isinstance(item, tuple):
            patches, prefix = item
            cls = prefix[:, 0] if cls_ok and prefix.shape[1] > 0 else None
        else:
            patches, cls = item, None
        maps[layer] = FeatureMaps(patches, cls)
    return maps


def _hooked_tokens(
    blocks: list[nn.Module], layers: tuple[int, ...], run: Callable[[], object]
) -> dict[int, torch.Tensor]:
    """The ``(B, N, C)`` outputs of ``blocks[i]`` for ``i`` in ``layers`` during ``run()``."""
    seen: dict[int, torch.Tensor] = {}

    def hook(i: int) -> Callable[..., None]:
        def fn(_mod: nn.Module, _inp: object, output: object) -> None:
            tokens = output[0] if isinstance(output, tuple | list) else output
            if not isinstance(tokens, torch.Tensor):
                raise TypeError(f"blocks[{i}] returned {type(tokens).__name__}; expected tokens (B, N, C)")
            seen[i] = tokens

        return fn

    handles = [blocks[i].register_forward_hook(hook(i)) for i in layers]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _split_tokens(
    tokens: torch.Tensor,
    index: int,
    final_norm: Callable[[torch.Tensor], torch.Tensor] | None,
    grid: tuple[int, int] | None,
    prefix: int | None,
    class_token: bool,
) -> FeatureMaps:
    """One block's ``(B, N, C)`` tokens -> :class:`FeatureMaps` (after ``final_norm`` when given)."""
    if tokens.ndim != 3:
        raise ValueError(f"blocks[{index}] returned shape {tuple(tokens.shape)}; expected tokens (B, N, C)")
    if final_norm is not None:
        tokens = final_norm(tokens)
    grid, prefix = resolve_layout(tokens.shape[1], grid, prefix)
    patches = tokens[:, prefix:].transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *grid)
    cls = tokens[:, 0] if prefix > 0 and class_token else None
    return FeatureMaps(patches.contiguous(), cls)


def _from_hooks(
    model: nn.Module, images: torch.Tensor, layers: tuple[int, ...], norm: bool
) -> dict[int, FeatureMaps]:
    blocks = _blocks(model)
    assert blocks is not None
    seen = _hooked_tokens(module_items(blocks), layers, lambda: model(images))
    final_norm = getattr(model, "norm", None) if norm else None
    grid, prefix = model_grid_size(model, images.shape[-2:]), model_num_prefix_tokens(model)
    return {
        i: _split_tokens(
            seen[i], i, final_norm if callable(final_norm) else None, grid, prefix, _has_class_token(model)
        )
        for i in layers
    }


def _from_transformers(
    model: nn.Module, images: torch.Tensor, layers: tuple[int, ...], norm: bool
) -> dict[int, FeatureMaps]:
    """Features of a transformers vision model: its encoder layers' outputs, its final norm."""
    from ..hf.layout import hf_layout, run_backbone

    layout = hf_layout(model)
    seen = _hooked_tokens(layout.layers, layers, lambda: run_backbone(layout, images))
    final_norm = layout.final_norm if norm else None
    grid, prefix = layout.grid(images.shape[-2:]), layout.num_prefix_tokens
    return {i: _split_tokens(seen[i], i, final_norm, grid, prefix, layout.has_class_token) for i in layers}


def patch_features(
    backbone: Backbone, images: torch.Tensor, layers: Sequence[int] = (-1,), *, norm: bool = True
) -> dict[int, FeatureMaps]:
    """Frozen patch features of ``images (B, 3, H, W)`` at the blocks ``layers``.

    Returns ``{block index (non-negative): FeatureMaps(patches (B, C, gh, gw), cls (B, C) | None)}``
    in increasing block order. ``layers`` are validated by :func:`vitattn.models.blocks.block_indices`
    (negative ones count from the end; errors name ``layers``). ``norm``: pass block outputs through
    the model's final norm (timm's ``forward_intermediates(norm=True)``), the usual choice for probes.
    Runs under ``torch.no_grad()`` in eval mode; the backbone's training flag is restored afterwards.
    See the module docstring for the kinds of backbone.
    """
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    idx = block_indices(layers, backbone_depth(backbone), "layers")
    module = backbone if isinstance(backbone, nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    try:
        with torch.no_grad():
            if module is not None and is_transformers_model(module):
                return _from_transformers(module, images, idx, norm)
            intermediates = getattr(module, "forward_intermediates", None)
            if module is not None and callable(intermediates):
                return _from_intermediates(module, intermediates, images, idx, norm)
            if module is not None and _blocks(module) is not None:
                return _from_hooks(module, images, idx, norm)
            out = backbone(images)
            if not isinstance(out, torch.Tensor) or out.ndim != 4 or out.shape[0] != images.shape[0]:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"a backbone without forward_intermediates or .blocks must map (B, 3, H, W) to "
                    f"(B, C, gh, gw) features; got {shape}"
                )
            return {idx[0]: FeatureMaps(out, None)}
    finally:
        if module is not None:
            module.train(was_training)
