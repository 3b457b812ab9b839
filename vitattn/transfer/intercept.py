"""Run a ViT's chosen attention layers through a transfer rule, for the length of one forward.

timm's ``Attention`` and vitattn's layers share their plumbing (``qkv``, ``q_norm``, ``k_norm``,
``norm``, ``gate``, ``proj``); only the middle differs: which scores, which probabilities. The
transfer wrappers replace that middle for the chosen blocks with a *rule*
``rule(block_index, attn, q, k, v) -> (B, H, N, Dv)`` (record the scores, copy the teacher's
probabilities, ...) by overriding each module's ``forward`` for the duration of a ``with`` block;
the module, its parameters and its state dict are untouched, and the override is removed on exit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from ..functional import attention
from ..functional.normalize import AttentionNormalizer
from ..layers import Attention, convertible_attention
from ..layers.attention import TimmStyleAttention, project_qkv
from ..models.blocks import model_blocks
from .scores import ScoreInputs

__all__ = [
    "AttentionRule",
    "attention_dropout",
    "blocks_of",
    "layer_attention",
    "layer_normalizer",
    "layer_scores",
    "override_attention",
    "plain_rule",
]

# rule(block index, attention module, q, k, v) -> per-head output (B, H, N, Dv); q, k may be None
AttentionRule = Callable[
    [int, nn.Module, "torch.Tensor | None", "torch.Tensor | None", torch.Tensor], torch.Tensor
]


def blocks_of(model: nn.Module, name: str) -> list[nn.Module]:
    """``model.blocks`` as a list, or a ``TypeError`` naming the argument (see :func:`model_blocks`)."""
    return model_blocks(model, name)


def layer_attention(model: nn.Module, index: int, name: str) -> nn.Module:
    """``model.blocks[index].attn``, checked to be timm's ``Attention`` or a vitattn layer."""
    attn = getattr(blocks_of(model, name)[index], "attn", None)
    if not isinstance(attn, nn.Module) or not convertible_attention(attn):
        raise TypeError(
            f"{name}.blocks[{index}].attn is {type(attn).__name__}; attention transfer supports timm's "
            "Attention and vitattn's Attention / EntmaxAttention / LocAtAttention"
        )
    if getattr(attn, "window", None) is not None:
        raise TypeError(
            f"{name}.blocks[{index}].attn has a neighbourhood window ({type(attn).__name__}); attention "
            "transfer does not carry windows (its scores and rules are those of the full attention)"
        )
    return attn


def layer_normalizer(attn: nn.Module) -> AttentionNormalizer:
    """The row normalizer of an attention layer (timm's is softmax; an adaptive layer's is its current
    alphas as a ``(1, H, 1, 1)`` tensor)."""
    return attn.attention_normalizer() if isinstance(attn, Attention) else "softmax"


def layer_scores(attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> ScoreInputs:
    """The layer's scores ``q kᵀ · scale + bias`` as :class:`ScoreInputs`; the bias is the layer's own
    (GAug's Gaussian bias for a LocAt layer, none for timm's and plain vitattn layers)."""
    bias = attn.attention_bias(q) if isinstance(attn, Attention) else None
    return ScoreInputs(q, k, float(cast(TimmStyleAttention, attn).scale), bias)


def attention_dropout(attn: nn.Module) -> float:
    """The layer's dropout probability on attention weights: ``attn_drop.p`` while training, else 0."""
    drop = getattr(attn, "attn_drop", None)
    return float(drop.p) if attn.training and isinstance(drop, nn.Dropout) else 0.0


def plain_rule(attn: nn.Module, scores: ScoreInputs, v: torch.Tensor) -> torch.Tensor:
    """What the layer itself computes from its scores: ``normalize(scores) v`` (with its dropout)."""
    return attention(
        scores.q,
        scores.k,
        v,
        normalizer=layer_normalizer(attn),
        scale=scores.scale,
        bias=scores.bias,
        dropout_p=attention_dropout(attn),
    )


def _forward(
    index: int,
    attn: nn.Module,
    rule: AttentionRule,
    need_qk: bool,
    x: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """The attention module's forward with ``rule`` in the middle; ``x: (B, N, C)`` -> ``(B, N, C_out)``."""
    if attn_mask is not None or is_causal:
        raise ValueError(
            f"attention transfer got attn_mask / is_causal at blocks[{index}].attn; transfer is defined "
            "for unmasked self-attention over all tokens"
        )
    b, n, _ = x.shape
    gate_layer = getattr(attn, "gate", None)  # timm's gated attention (absent in old timm versions)
    gate = gate_layer(x).sigmoid() if gate_layer is not None else None
    q, k, v = project_qkv(attn, x, need_qk=need_qk)
    out = rule(index, attn, q, k, v)
    out = out.transpose(1, 2).reshape(b, n, -1)
    norm = getattr(attn, "norm", None)  # timm's scale_norm (absent in old timm versions)
    if norm is not None:
        out = norm(out)
    if gate is not None:
        out = out * gate
    plumbing = cast(TimmStyleAttention, attn)
    return plumbing.proj_drop(plumbing.proj(out))


@contextmanager
def override_attention(
    model: nn.Module,
    indices: Sequence[int],
    rule: AttentionRule,
    *,
    need_qk: bool = True,
    name: str = "model",
) -> Iterator[None]:
    """Within the block, ``model.blocks[i].attn`` for ``i`` in ``indices`` computes through ``rule``.

    ``need_qk=False`` skips the q and k thirds of ``qkv`` (the rule gets ``None`` for them). The
    overrides are instance attributes removed on exit (also after an error); hooks still fire.
    """
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for i in indices:
            attn = layer_attention(model, i, name)
            saved.append((attn, attn.__dict__.get("forward")))

            def forward(*args: Any, _i: int = i, _attn: nn.Module = attn, **kwargs: Any) -> torch.Tensor:
                return _forward(_i, _attn, rule, need_qk, *args, **kwargs)

            attn.forward = forward
        yield
    finally:
        for attn, previous in saved:
            if previous is None:
                attn.__dict__.pop("forward", None)
            else:
                attn.forward = previous
