"""What vitattn needs to know about a ViT, in one vocabulary whichever library built it.

:class:`ModelLayout` is that vocabulary; :func:`vitattn.adapter.layout_of` gives a model's. Two
classes implement it: :class:`vitattn.adapter.TimmLayout` (timm ``VisionTransformer``, ``Eva``,
``SwinTransformer`` and the vitattn models) and :class:`vitattn.hf.HFLayout` (transformers vision
models). Shapes: ``B`` images, ``N`` tokens (prefix tokens, then the patches row by row), ``H`` heads,
``d`` the head dim, a patch grid ``(gh, gw)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from ..functional import GaussianBias
from ..functional.normalize import AttentionNormalizer

__all__ = ["AttentionRule", "ModelLayout"]

#: ``rule(block index, attention module, q, k, v) -> (B, H, N, Dv)``, the per-head output that takes
#: the place of the module's attention (:meth:`ModelLayout.intercept`); ``q, k: (B, H, N, d)`` or None
AttentionRule = Callable[
    [int, nn.Module, "torch.Tensor | None", "torch.Tensor | None", torch.Tensor], torch.Tensor
]


class ModelLayout(Protocol):
    """Where the blocks, attention modules and tokens of one ViT are, and how its attention runs.

    Blocks are numbered from 0 in the order they run (a Swin's stage by stage); every ``index``
    below is such a number (non-negative, checked by the caller: :func:`vitattn.models.blocks.block_indices`).
    The attention modules are read from the model when asked, so a layout stays right after
    :func:`vitattn.patch` swaps them.
    """

    @property
    def model(self) -> nn.Module:
        """The model the layout was made for."""
        ...

    @property
    def depth(self) -> int:
        """Number of blocks (0 for a module with no block sequence)."""
        ...

    @property
    def blocks(self) -> Sequence[nn.Module]:
        """The blocks (transformers: the encoder layers), each mapping tokens ``(B, N, C)`` to tokens
        (a Swin's: ``(B, h, w, C)``); a ``TypeError`` naming the model when it has none."""
        ...

    @property
    def block_names(self) -> Sequence[str]:
        """How messages name each block (``blocks[3]``, ``layers[1].blocks[0]``, ``encoder.layer.3``)."""
        ...

    @property
    def attentions(self) -> Sequence[nn.Module | None]:
        """The attention module of each block (None where a block has none)."""
        ...

    @property
    def attention_names(self) -> Sequence[str]:
        """How messages name each attention module (``blocks[3].attn``; transformers: its qualified name)."""
        ...

    @property
    def windowed(self) -> bool:
        """Whether attention runs inside local windows (a Swin): its maps are per window, not over the
        image's ``N`` tokens, so the tools that read or replace whole maps refuse such a model."""
        ...

    def num_heads(self, index: int) -> int | None:
        """Heads of block ``index``'s attention (None when unknown)."""
        ...

    def grid(self, image_size: Sequence[int] | None = None) -> tuple[int, int] | None:
        """Patch grid ``(gh, gw)`` of an ``image_size = (H, W)`` input (None: the size the model was
        built for); None when the model has no patch embedding."""
        ...

    @property
    def num_prefix_tokens(self) -> int | None:
        """Tokens before the patches (class, distillation, register tokens); None when unknown."""
        ...

    @property
    def num_class_tokens(self) -> int:
        """Prefix tokens the model classifies from (the class token; Jumbo's J tokens); 0 when it
        pools the patches."""
        ...

    @property
    def has_class_token(self) -> bool:
        """Whether token 0 is a class token (what a probe reads as the image's global feature)."""
        ...

    @property
    def patch_size(self) -> tuple[int, int] | None:
        """``(rows, columns)`` of one patch in pixels; None for a model without patches."""
        ...

    @property
    def image_size(self) -> tuple[int, int] | None:
        """The input size ``(H, W)`` the model was built for (None when it has none)."""
        ...

    @property
    def final_norm(self) -> nn.Module | None:
        """The norm after the last block, over all tokens ``(B, N, C)`` (None when there is none)."""
        ...

    def forward(self, images: torch.Tensor) -> Any:
        """Run the model on ``images (B, C, H, W)`` with every patch a token in grid order (for a
        transformers model: its vision tower); the output is the model's own."""
        ...

    def image_calls(self) -> AbstractContextManager[None]:
        """Within the block, ``model(images)`` takes ``(B, C, H, W)`` images positionally and returns
        the prediction tensor (a transformers model's ``logits``, else ``image_embeds``, ...)."""
        ...

    def reading_maps(self) -> AbstractContextManager[None]:
        """Within the block, every attention module's probabilities can be read: a transformers model
        computes its attention through vitattn; a timm model runs as it is."""
        ...

    def normalizer(self, index: int) -> AttentionNormalizer:
        """The row normalizer of block ``index``'s attention (``"softmax"``, ``"entmax15"``, an alpha,
        or a learned ``(1, H, 1, 1)`` tensor of alphas)."""
        ...

    def scale(self, index: int) -> float:
        """The factor on block ``index``'s scores ``q kᵀ``."""
        ...

    def bias(self, index: int, q: torch.Tensor) -> torch.Tensor | GaussianBias | None:
        """Block ``index``'s additive score bias from its unscaled queries ``q: (B, H, N, d)``: GAug's
        Gaussian bias for a LocAt layer, None for a plain one."""
        ...

    def dropout(self, index: int) -> float:
        """Block ``index``'s dropout probability on attention weights while training, else 0."""
        ...

    def check_intercept(self, index: int) -> None:
        """Raise ``TypeError`` naming the module unless block ``index``'s attention can run a rule."""
        ...

    def intercept(
        self, indices: Sequence[int], rule: AttentionRule, *, need_qk: bool = True
    ) -> AbstractContextManager[None]:
        """Within the block, the attention of each block in ``indices`` computes ``rule(index, module,
        q, k, v)`` in place of its own ``normalize(q kᵀ · scale + bias) v``, the rest of the block as it
        is. ``need_qk=False`` may skip q and k (the rule then gets None for them). Removed on exit."""
        ...
