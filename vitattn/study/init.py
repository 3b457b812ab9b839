"""Initialisation of the study's ViT: timm's, or a mimetic start for its attention.

``timm`` keeps timm's ViT init (linears truncated normal std 0.02, position embedding std 0.02;
``pos_embed_std`` redraws the position embedding). ``mimetic`` ("Mimetic initialization of
self-attention layers", Trockman & Kolter, ICML 2023) starts every block's attention from products
that look like the ones trained attention layers have: per head ``W_qᵀ W_k ≈ 0.35 (Z + I)`` and
``W_vᵀ W_projᵀ ≈ 0.4 (Z − I)`` with ``Z`` a random ``(dim, dim)`` matrix of std ``1/√dim``, each
factor pair taken from the SVD of that product. So from the first step a query attends to tokens
like itself (and, with a position embedding of comparable size, to its own position), where timm's
init gives nearly uniform attention. The rest (MLP, norms, head, GAug heads) keeps timm's init.
Everything is drawn from torch's global RNG: seed it first.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["INIT_SCHEMES", "InitScheme", "init_study_vit", "mimetic_attention_init"]

InitScheme = Literal["timm", "mimetic"]
INIT_SCHEMES: tuple[InitScheme, ...] = ("timm", "mimetic")
TIMM_POS_EMBED_STD = 0.02
# W_qᵀ W_k ≈ α Z + β I: half the paper's 0.7, since at 0.7 entmax-1.5 starts almost one-hot on
# the scenes (docs/study.md: the main job's plateau); W_vᵀ W_oᵀ ≈ α Z − β I: the paper's 0.4
QK_ALPHA, QK_BETA = 0.35, 0.35
VO_ALPHA, VO_BETA = 0.4, 0.4


def _factor(product: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` of shapes ``(rank, n)`` with ``aᵀ b`` the best rank-``rank`` approximation of
    ``product (n, n)`` (its SVD, singular values split evenly)."""
    u, s, vh = torch.linalg.svd(product.double())
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).T, root[:, None] * vh[:rank]


def _random_plus(dim: int, alpha: float, beta: float, generator: torch.Generator | None) -> torch.Tensor:
    z = torch.randn(dim, dim, generator=generator, dtype=torch.float64) / dim**0.5
    return alpha * z + beta * torch.eye(dim, dtype=torch.float64)


@torch.no_grad()
def mimetic_attention_init(attn: nn.Module, generator: torch.Generator | None = None) -> None:
    """Mimetic start of one attention layer with a fused ``qkv`` linear ``(3 dim, dim)`` and a
    ``proj`` linear ``(dim, dim)`` (timm's ``Attention`` and vitattn's layers): per head h
    ``W_q,hᵀ W_k,h`` the rank-``head_dim`` part of ``QK_ALPHA Z_h + QK_BETA I``, and ``W_vᵀ W_projᵀ``
    of ``VO_ALPHA Z − VO_BETA I``. Biases are left as they are."""
    qkv, proj = attn.get_submodule("qkv"), attn.get_submodule("proj")
    if not isinstance(qkv, nn.Linear) or not isinstance(proj, nn.Linear):
        raise TypeError(
            f"mimetic init needs qkv and proj linears, got {type(qkv).__name__}, {type(proj).__name__}"
        )
    dim = qkv.in_features
    heads = getattr(attn, "num_heads", None)  # noqa: B009  (an int attribute, not a tensor or module)
    if not isinstance(heads, int):
        raise TypeError(f"mimetic init needs an attention with an int num_heads, got {type(attn).__name__}")
    if qkv.out_features != 3 * dim or dim % heads:
        raise ValueError(
            f"mimetic init needs qkv (3·dim, dim) with dim divisible by heads, got "
            f"{tuple(qkv.weight.shape)}, {heads} heads"
        )
    hd = dim // heads
    weight = qkv.weight
    for h in range(heads):
        wq, wk = _factor(_random_plus(dim, QK_ALPHA, QK_BETA, generator), hd)
        weight[h * hd : (h + 1) * hd] = wq.to(weight.dtype)
        weight[dim + h * hd : dim + (h + 1) * hd] = wk.to(weight.dtype)
    wv_t, wo_t = _factor(_random_plus(dim, VO_ALPHA, -VO_BETA, generator), dim)  # (W_vᵀ)ᵀ, W_oᵀ
    weight[2 * dim :] = wv_t.to(weight.dtype)
    proj.weight.copy_(wo_t.T.to(proj.weight.dtype))


@torch.no_grad()
def init_study_vit(model: nn.Module, scheme: str, pos_embed_std: float | None) -> None:
    """Apply ``scheme`` (``timm``: as built; ``mimetic``: :func:`mimetic_attention_init` in every
    block) and redraw the position embedding with ``pos_embed_std`` when it differs from timm's 0.02.
    A model on the meta device (no values) is left as it is."""
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"init must be one of {', '.join(INIT_SCHEMES)}, got {scheme!r}")
    if scheme == "mimetic" and not any(p.is_meta for p in model.parameters()):
        for block in model.get_submodule("blocks").children():
            mimetic_attention_init(block.get_submodule("attn"))
    pos = getattr(model, "pos_embed", None)
    if pos_embed_std is not None and pos_embed_std != TIMM_POS_EMBED_STD and isinstance(pos, torch.Tensor):
        pos.normal_(0.0, float(pos_embed_std))
