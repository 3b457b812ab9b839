"""Attention rollout (Abnar & Zuidema, 2020), its gradient-weighted variant (Chefer et al., 2021) and the
class-token heat maps they give.

Rollout follows each token's attention down through the blocks, with the residual connection counted
as half of each block's mixing::

    Â_b = rownorm((discard(fuse_heads(A_b)) + I) / 2)        rollout = Â_L · … · Â_2 · Â_1

so that ``rollout[b, i, j]`` is how much output token ``i`` draws on input token ``j``. Maps with exact
zeros (entmax, sparsemax) are taken as they are: a zero stays a zero through the fusion and the
discard, and only the identity keeps a row alive.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..adapter import ModelLayout, resolve_layout
from ..layers.attention import project_qkv
from .maps import _analysis_layout, _evaluating, _layout_layers, _layout_maps, _record_layout

__all__ = [
    "HEAD_FUSIONS",
    "attention_gradients",
    "attention_rollout",
    "fuse_heads",
    "gradient_rollout",
    "model_heatmap",
    "model_rollout",
    "rollout_heatmap",
    "upsample_heatmap",
]

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS: tuple[HeadFusion, ...] = ("mean", "max", "min")
Maps = Sequence[torch.Tensor] | Mapping[int, torch.Tensor]


def _block_list(maps: Maps, name: str) -> list[torch.Tensor]:
    """``maps`` as a list in block order (a mapping is read in the order of its sorted keys), checked:
    every entry a floating ``(B, H, N, N)`` tensor with the same ``B`` and ``N``."""
    if isinstance(maps, torch.Tensor):
        raise TypeError(f"{name} must be a list of per-block (B, H, N, N) tensors, got one tensor")
    items = [maps[k] for k in sorted(maps)] if isinstance(maps, Mapping) else list(maps)
    if not items:
        raise ValueError(f"{name} is empty: give one (B, H, N, N) map per block")
    first = None
    for i, m in enumerate(items):
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(m).__name__}")
        if m.dim() != 4 or m.shape[-1] != m.shape[-2]:
            raise ValueError(f"{name}[{i}] must be (B, H, N, N), got shape {tuple(m.shape)}")
        if m.shape[1] == 0:
            raise ValueError(f"{name}[{i}] has 0 heads (shape {tuple(m.shape)}): nothing to fuse")
        if not m.is_floating_point():
            raise TypeError(f"{name}[{i}] must be floating-point, got dtype {m.dtype}")
        if first is None:
            first = m
        elif (m.shape[0], m.shape[-1]) != (first.shape[0], first.shape[-1]):
            raise ValueError(
                f"{name}[{i}] has shape {tuple(m.shape)} but {name}[0] has {tuple(first.shape)}: every "
                "block needs the same batch B and token count N"
            )
    return items


def _check_probabilities(name: str, blocks: list[torch.Tensor]) -> None:
    """Every entry of every block non-negative and finite (attention weights; read back: analysis only)."""
    for i, m in enumerate(blocks):
        bad = ~torch.isfinite(m) | (m < 0)
        if bool(bad.any()):
            index = tuple(int(j) for j in bad.nonzero()[0])
            raise ValueError(
                f"{name}[{i}] must hold attention weights (finite, >= 0), got {m[index].item()!r} at index "
                f"{index}; pass the normalized maps, not scores"
            )


def fuse_heads(attn: torch.Tensor, head_fusion: HeadFusion = "mean") -> torch.Tensor:
    """``(B, H, N, N)`` -> ``(B, N, N)``: the mean, max or min over heads."""
    if head_fusion == "mean":
        return attn.mean(1)
    if head_fusion == "max":
        return attn.amax(1)
    if head_fusion == "min":
        return attn.amin(1)
    raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")


def _discard(fused: torch.Tensor, ratio: float, prefix: int) -> torch.Tensor:
    """Each row's ``floor(ratio · (N − prefix))`` smallest entries among the patch columns set to 0
    (ties: the lower column first); the prefix columns are never dropped."""
    patches = fused.shape[-1] - prefix
    k = int(ratio * patches)
    if k == 0:
        return fused
    cols = fused[..., prefix:]
    order = torch.sort(cols, dim=-1, stable=True).indices[..., :k]
    return torch.cat([fused[..., :prefix], cols.scatter(-1, order, 0.0)], dim=-1)


def _check_ratio(discard_ratio: float) -> float:
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, (int, float)):
        raise TypeError(f"discard_ratio must be a number in [0, 1], got {type(discard_ratio).__name__}")
    if not 0.0 <= float(discard_ratio) <= 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1], got {discard_ratio}")
    return float(discard_ratio)


def _check_prefix(num_prefix_tokens: int, n: int) -> int:
    if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int):
        raise TypeError(f"num_prefix_tokens must be an int, got {type(num_prefix_tokens).__name__}")
    if not 0 <= num_prefix_tokens <= n:
        raise ValueError(f"num_prefix_tokens must be in [0, N = {n}], got {num_prefix_tokens}")
    return num_prefix_tokens


def attention_rollout(
    maps: Maps,
    discard_ratio: float = 0.0,
    head_fusion: HeadFusion = "mean",
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Attention rollout of per-block attention probabilities (Abnar & Zuidema, 2020).

    For each block: the heads fused (``head_fusion``: mean, max or min over heads), then in each row
    the ``floor(discard_ratio · (N − num_prefix_tokens))`` smallest weights among the patch columns
    set to 0 (the prefix columns, class and register tokens, are never dropped; ties drop the lower
    column first), the identity added for the residual, ``(A + I) / 2``, and the rows renormalized to
    sum to 1. The blocks' matrices are multiplied with the first block rightmost.

    Args:
        maps: one ``(B, H, N, N)`` probability tensor per block in block order (``H >= 1``; entries
            finite and ``>= 0``, checked: a ``ValueError`` names the first bad one) (a list, or the dict
            :func:`vitattn.analysis.attention_maps` returns: read in key order; a transformers model's
            ``outputs.attentions`` works as it is). Blocks left out are skipped.
        discard_ratio: the fraction of each row's patch weights to drop, in ``[0, 1]``.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"``.
        num_prefix_tokens: the prefix tokens before the patches (columns never dropped).

    Returns:
        ``(B, N, N)``, float32 at least: row ``i`` is output token ``i``'s share of each input token;
        rows sum to 1.
    """
    blocks = _block_list(maps, "maps")
    _check_probabilities("maps", blocks)
    ratio = _check_ratio(discard_ratio)
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    n = blocks[0].shape[-1]
    prefix = _check_prefix(num_prefix_tokens, n)
    dtype = torch.promote_types(blocks[0].dtype, torch.float32)
    eye = torch.eye(n, dtype=dtype, device=blocks[0].device)
    result = None
    for attn in blocks:
        fused = _discard(fuse_heads(attn.to(dtype), head_fusion), ratio, prefix)
        mixed = (fused + eye) / 2
        mixed = mixed / mixed.sum(-1, keepdim=True)  # >= 1/2 on the diagonal: never a zero row
        result = mixed if result is None else mixed @ result
    assert result is not None
    return result


def gradient_rollout(maps: Maps, grads: Maps) -> torch.Tensor:
    """Gradient-weighted rollout, the rule of Chefer, Gur & Wolf (ICCV 2021, eqs. 5–6).

    For each block ``Ā = mean over heads of (∇A ⊙ A)⁺`` (the attention weighted by the gradient of
    the explained output with respect to it, negative parts cut), then ``R ← R + Ā · R`` from
    ``R = I``, block by block; so ``R = (I + Ā_L) · … · (I + Ā_1)``, first block rightmost. Rows are
    not renormalized (as in the paper); heat maps are relative.

    Args:
        maps: per-block ``(B, H, N, N)`` probabilities, as in :func:`attention_rollout`.
        grads: the gradients of the explained output (e.g. the target logit) with respect to
            ``maps``, the same shapes (:func:`attention_gradients` gives both).

    Returns:
        ``(B, N, N)`` relevance of input token ``j`` for output token ``i``, float32 at least.
    """
    blocks = _block_list(maps, "maps")
    _check_probabilities("maps", blocks)
    grad_blocks = _block_list(grads, "grads")
    if len(grad_blocks) != len(blocks):
        raise ValueError(f"grads has {len(grad_blocks)} blocks but maps has {len(blocks)}")
    for i, (a, g) in enumerate(zip(blocks, grad_blocks, strict=True)):
        if a.shape != g.shape:
            raise ValueError(f"grads[{i}] has shape {tuple(g.shape)} but maps[{i}] has {tuple(a.shape)}")
    dtype = torch.promote_types(blocks[0].dtype, torch.float32)
    b, n = blocks[0].shape[0], blocks[0].shape[-1]
    result = torch.eye(n, dtype=dtype, device=blocks[0].device).expand(b, n, n)
    for a, g in zip(blocks, grad_blocks, strict=True):
        relevance = (a.to(dtype) * g.to(dtype)).clamp_min(0).mean(1)
        result = result + relevance @ result
    return result


def rollout_heatmap(
    rollout: torch.Tensor,
    grid_size: int | Sequence[int] | None = None,
    num_prefix_tokens: int | None = 1,
    query: int | str = 0,
) -> torch.Tensor:
    """The patch columns of one output token's rollout row, on the patch grid: ``(B, gh, gw)``.

    Args:
        rollout: ``(B, N, N)`` from :func:`attention_rollout` / :func:`gradient_rollout`.
        grid_size: ``(gh, gw)`` (None: the square grid of ``N − num_prefix_tokens`` patches).
        num_prefix_tokens: prefix tokens before the patches (None: ``N − gh·gw``).
        query: the output token explained: a token index (0, the class token, by default),
            ``"prefix"`` for the mean of the prefix tokens' rows (a Jumbo model's J class tokens), or
            ``"all"`` for the mean of all rows (a model that average-pools its tokens).

    Returns:
        ``(B, gh, gw)``: how much that token draws on each patch (not renormalized).
    """
    if not isinstance(rollout, torch.Tensor) or rollout.dim() != 3 or rollout.shape[1] != rollout.shape[2]:
        shape = tuple(rollout.shape) if isinstance(rollout, torch.Tensor) else type(rollout).__name__
        raise ValueError(f"rollout must be (B, N, N), got {shape}")
    n = rollout.shape[-1]
    grid, prefix = resolve_layout(n, grid_size, num_prefix_tokens)
    if query == "prefix":
        if prefix == 0:
            raise ValueError("query='prefix' needs prefix tokens, but num_prefix_tokens is 0")
        row = rollout[:, :prefix].mean(1)
    elif query == "all":
        row = rollout.mean(1)
    elif isinstance(query, int) and not isinstance(query, bool) and -n <= query < n:
        row = rollout[:, query]
    else:
        raise ValueError(f"query must be a token index in [-{n}, {n}), 'prefix' or 'all', got {query!r}")
    return row[:, prefix:].reshape(rollout.shape[0], *grid)


# ---- from a model ---------------------------------------------------------------------------------------
def _output_of(logits: Any) -> torch.Tensor:
    out = logits.logits if hasattr(logits, "logits") else logits
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise TypeError(f"the model must return (B, num_classes) logits, got {type(out).__name__}")
    return out


def attention_gradients(
    model: nn.Module,
    x: torch.Tensor,
    target: int | torch.Tensor | None = None,
    layers: int | Iterable[int] | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Attention maps and their gradients for the output ``logits[b, target[b]]`` of each image.

    Args:
        model: a timm ViT or vitattn model whose blocks' ``attn`` is timm's ``Attention`` or a vitattn
            layer (the same as :func:`vitattn.analysis.attention_maps`).
        x: ``(B, C, H, W)`` images.
        target: the class explained: None (each image's top class), an int, or a ``(B,)`` tensor.
        layers: block indices (None: all).

    Returns:
        ``(maps, grads)``: ``{block: (B, H, N, N)}`` each. The gradient with respect to the
        probabilities ``A`` is exact for any normalizer: with ``O = A·V`` per head,
        ``∂y/∂A = (∂y/∂O)·Vᵀ``, read from the input of the layer's ``norm`` and its value projection.
        The model runs in eval mode (restored after) with gradients; its parameters get none.
    """
    return _layout_gradients(_analysis_layout(model), x, target, layers)


def _gradient_modules(layout: ModelLayout, chosen: list[int]) -> dict[int, tuple[nn.Module, nn.Module]]:
    """``(attention module, its norm)`` of each chosen block, which has ``qkv`` (else a ``TypeError``)."""
    modules = {}
    for i in chosen:
        attn = layout.attentions[i]
        norm = getattr(attn, "norm", None)
        if not isinstance(attn, nn.Module) or not isinstance(norm, nn.Module) or not hasattr(attn, "qkv"):
            raise TypeError(
                f"{layout.attention_names[i]} is {type(attn).__name__}: attention gradients need a ViT "
                "attention with `qkv` and `norm` (timm's Attention or a vitattn layer)"
            )
        modules[i] = (attn, norm)
    return modules


def _layout_gradients(
    layout: ModelLayout,
    x: torch.Tensor,
    target: int | torch.Tensor | None = None,
    layers: int | Iterable[int] | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """:func:`attention_gradients` of a model's layout."""
    maps: dict[int, torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    model = layout.model
    chosen = _layout_layers(layout, layers)
    modules = _gradient_modules(layout, chosen)
    handles = []
    for i, (attn, norm) in modules.items():
        handles.append(attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0])))
        handles.append(norm.register_forward_pre_hook(lambda m, a, i=i: outputs.__setitem__(i, a[0])))
    try:
        with (
            _record_layout(layout, lambda i, p: maps.__setitem__(i, p), chosen),
            _evaluating(model),
            torch.enable_grad(),
        ):
            logits = _output_of(model(x.detach().requires_grad_(True)))
    finally:
        for h in handles:
            h.remove()
    b = logits.shape[0]
    if target is None:
        index = logits.argmax(-1)
    else:
        index = torch.as_tensor(target, device=logits.device).long().expand(b)
    score = logits.gather(1, index[:, None]).sum()
    got = torch.autograd.grad(score, [outputs[i] for i in chosen])
    grads: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for i, d_out in zip(chosen, got, strict=True):
            _, _, v = project_qkv(modules[i][0], inputs[i].detach(), need_qk=False)  # (B, H, N, d)
            heads = v.shape[1]
            d_out = d_out.reshape(b, d_out.shape[1], heads, -1).transpose(1, 2)
            grads[i] = (d_out @ v.transpose(-1, -2)).to(maps[i].dtype)
    return {i: maps[i] for i in chosen}, grads


def model_rollout(
    model: nn.Module,
    x: torch.Tensor,
    *,
    discard_ratio: float = 0.0,
    head_fusion: HeadFusion = "mean",
    gradient: bool = False,
    target: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Rollout ``(B, N, N)`` of a model on ``x`` over all its blocks: plain (:func:`attention_rollout`
    of :func:`~vitattn.analysis.attention_maps`: a timm / vitattn ViT or a transformers vision model)
    or, with ``gradient=True``, :func:`gradient_rollout` for the class ``target`` (None: each image's
    top class; ``discard_ratio`` and ``head_fusion`` do not apply; timm / vitattn ViTs only)."""
    layout = _analysis_layout(model)
    prefix = layout.num_prefix_tokens or 0
    if gradient:
        maps, grads = _layout_gradients(layout, x, target)
        return gradient_rollout(maps, grads)
    return attention_rollout(_layout_maps(layout, x), discard_ratio, head_fusion, prefix)


def model_heatmap(model: nn.Module, x: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """:func:`rollout_heatmap` of the token(s) the model classifies from, with its own grid and prefix
    count: ``(B, gh, gw)``. The class token (token 0); the mean of the class tokens when there are
    several (Jumbo's J tokens: prefix tokens that are not registers); the mean of all tokens when
    there is no class token (average pooling)."""
    layout = _analysis_layout(model)
    grid, prefix = layout.grid(tuple(x.shape[-2:])), layout.num_prefix_tokens or 0
    classes = layout.num_class_tokens
    query: int | str = 0 if classes == 1 else ("prefix" if classes > 1 else "all")
    return rollout_heatmap(rollout, grid, prefix, query=query)


def upsample_heatmap(heatmap: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``(B, gh, gw)`` heat maps -> ``(B, H, W)`` at the image size (bilinear), each scaled to ``[0, 1]``
    by its maximum (an all-zero map stays zero)."""
    if not isinstance(heatmap, torch.Tensor) or heatmap.dim() != 3:
        raise ValueError(
            f"heatmap must be (B, gh, gw), got {getattr(heatmap, 'shape', type(heatmap).__name__)}"
        )
    h, w = (int(s) for s in size)
    up = F.interpolate(heatmap[:, None].float(), size=(h, w), mode="bilinear", align_corners=False)[:, 0]
    top = up.flatten(1).amax(1).clamp_min(1e-30)
    return (up / top[:, None, None]).clamp_min(0)
