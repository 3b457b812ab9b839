"""Run a ViT's chosen attention layers through a transfer rule, for the length of one forward.

timm's ``Attention`` and vitattn's layers share their plumbing (``qkv``, ``q_norm``, ``k_norm``,
``norm``, ``gate``, ``proj``); only the middle differs: which scores, which probabilities. The
transfer wrappers replace that middle for the chosen blocks with a *rule*
``rule(block_index, attn, q, k, v) -> (B, H, N, Dv)`` (record the scores, copy the teacher's
probabilities, ...) by overriding each module's ``forward`` for the duration of a ``with`` block;
the module, its parameters and its state dict are untouched, and the override is removed on exit.

A transformers vision model (:mod:`vitattn.hf`) is intercepted one level lower: its attention modules
hand q, k, v to transformers' attention interface, so for the length of the block the model computes
through vitattn's ``"vitattn"`` implementation and each chosen module carries the rule, which that
implementation calls in place of the attention (q, k there are always computed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from ..functional import attention
from ..functional.normalize import Normalizer
from ..layers import Attention, convertible_attention
from ..layers.attention import TimmStyleAttention, project_qkv
from ..models.blocks import is_transformers_model, model_blocks
from .scores import ScoreInputs

__all__ = [
    "AttentionRule",
    "attention_dropout",
    "blocks_of",
    "layer_attention",
    "layer_heads",
    "layer_normalizer",
    "layer_scores",
    "model_forward",
    "override_attention",
    "plain_rule",
]

# rule(block index, attention module, q, k, v) -> per-head output (B, H, N, Dv); q, k may be None
AttentionRule = Callable[
    [int, nn.Module, "torch.Tensor | None", "torch.Tensor | None", torch.Tensor], torch.Tensor
]


def blocks_of(model: nn.Module, name: str) -> list[nn.Module]:
    """``model.blocks`` as a list (the encoder layers of a transformers vision model), or a
    ``TypeError`` naming the argument (see :func:`model_blocks`)."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        return hf_layout(model).layers
    return model_blocks(model, name)


def model_forward(model: nn.Module, x: torch.Tensor) -> Any:
    """``model(x)``; for a transformers model, its vision tower on ``x`` with every patch a token."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout, run_backbone

        return run_backbone(hf_layout(model), x)
    return model(x)


def layer_heads(model: nn.Module, index: int, name: str) -> int | None:
    """Attention heads of block ``index`` (None when its attention has no ``num_heads``)."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        return hf_layout(model).num_heads(index)
    heads = getattr(getattr(blocks_of(model, name)[index], "attn", None), "num_heads", None)
    return None if heads is None else int(heads)


def layer_attention(model: nn.Module, index: int, name: str) -> nn.Module:
    """``model.blocks[index].attn``, checked to be timm's ``Attention`` or a vitattn layer (for a
    transformers vision model: the attention module of encoder layer ``index``)."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        return hf_layout(model).attentions[index]
    attn = getattr(blocks_of(model, name)[index], "attn", None)
    if not isinstance(attn, nn.Module) or not convertible_attention(attn):
        raise TypeError(
            f"{name}.blocks[{index}].attn is {type(attn).__name__}; attention transfer supports timm's "
            "Attention and vitattn's Attention / EntmaxAttention / LocAtAttention"
        )
    return attn


def layer_normalizer(attn: nn.Module) -> Normalizer:
    """The row normalizer of an attention layer (timm's is softmax; a transformers module's is the one
    :func:`vitattn.patch` set, else softmax)."""
    if isinstance(attn, Attention):
        return attn.normalizer
    if is_transformers_model(attn):
        from ..hf.functions import SETTINGS_ATTR

        return getattr(getattr(attn, SETTINGS_ATTR, None), "normalizer", "softmax")
    return "softmax"


def _transformers_scale(attn: nn.Module) -> float:
    for name in ("scaling", "scale"):
        value = getattr(attn, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    from ..hf.layout import attention_head_dim

    return float(attention_head_dim(attn) ** -0.5)


def layer_scores(attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> ScoreInputs:
    """The layer's scores ``q kᵀ · scale + bias`` as :class:`ScoreInputs`; the bias is the layer's own
    (GAug's Gaussian bias for a LocAt layer or a LocAt-patched transformers module, none for timm's and
    plain layers)."""
    if is_transformers_model(attn):
        from ..hf.functions import gaug_bias

        return ScoreInputs(q, k, _transformers_scale(attn), gaug_bias(attn, q))
    bias = attn.attention_bias(q) if isinstance(attn, Attention) else None
    return ScoreInputs(q, k, float(cast(TimmStyleAttention, attn).scale), bias)


def attention_dropout(attn: nn.Module) -> float:
    """The layer's dropout probability on attention weights while training, else 0: ``attn_drop.p``,
    or a transformers module's ``attention_dropout`` / ``dropout_prob`` / ``dropout`` rate."""
    if not attn.training:
        return 0.0
    drop = getattr(attn, "attn_drop", None)
    if isinstance(drop, nn.Dropout):
        return float(drop.p)
    if is_transformers_model(attn):
        for name in ("attention_dropout", "dropout_prob", "dropout"):
            value = getattr(attn, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return 0.0


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
    overrides are instance attributes removed on exit (also after an error); hooks still fire. For a
    transformers model, see the module docstring (``need_qk`` has no effect there).
    """
    if is_transformers_model(model):
        with _override_transformers(model, indices, rule, name):
            yield
        return
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


@contextmanager
def _override_transformers(
    model: nn.Module, indices: Sequence[int], rule: AttentionRule, name: str
) -> Iterator[None]:
    """:func:`override_attention` for a transformers model: the rule rides on each chosen module."""
    from ..hf.functions import RULE_ATTR
    from ..hf.patching import vitattn_implementation

    chosen = [(i, layer_attention(model, i, name)) for i in indices]
    try:
        for i, attn in chosen:

            def hf_rule(
                module: nn.Module,
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                scaling: Any,
                _i: int = i,
            ) -> torch.Tensor:
                return rule(_i, module, q, k, v)

            attn.__dict__[RULE_ATTR] = hf_rule
        with vitattn_implementation(model):
            yield
    finally:
        for _, attn in chosen:
            attn.__dict__.pop(RULE_ATTR, None)
