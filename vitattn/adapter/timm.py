"""The layout of a timm-style model: timm's ``VisionTransformer`` and ``Eva`` (``patch_embed`` +
``blocks[i].attn``), ``SwinTransformer`` (``patch_embed`` + ``layers[s].blocks[j].attn``) and the
vitattn models built on them (:mod:`vitattn.models`).

Read by attribute names, as timm names them: ``patch_embed`` (its ``grid_size``, ``patch_size``,
``img_size``, ``dynamic_feat_size``), ``num_prefix_tokens``, ``cls_token``, ``norm``. The attention
modules are timm's ``Attention`` family or vitattn's layers (``qkv``, ``q_norm``, ``k_norm``,
``proj``, ``scale``, ``num_heads``); :meth:`TimmLayout.intercept` runs their forward with a rule in the
middle.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cached_property
from typing import Any, cast

import torch
from torch import nn

from ..functional import GaussianBias, grid_pair
from ..functional.normalize import AttentionNormalizer
from ..layers import Attention, convertible_attention
from ..layers.attention import TimmStyleAttention, project_qkv
from ..models._grid import feat_size
from ..models.blocks import module_items
from .protocol import AttentionRule

__all__ = ["TimmLayout", "layer_normalizer"]


def layer_normalizer(attn: nn.Module) -> AttentionNormalizer:
    """The row normalizer of a timm-style attention module: a vitattn layer's (an adaptive layer's is
    its current alphas as a ``(1, H, 1, 1)`` tensor); timm's own layers compute softmax."""
    if isinstance(attn, Attention):
        return attn.attention_normalizer()
    return "softmax"


def _stages(model: nn.Module) -> list[nn.Module] | None:
    """A Swin's stages (``layers[s]``, each with ``blocks``) when ``model`` has ``patch_embed`` and them."""
    layers = getattr(model, "layers", None)
    if not isinstance(getattr(model, "patch_embed", None), nn.Module) or not isinstance(layers, nn.Module):
        return None
    stages = module_items(layers)
    return stages if all(isinstance(getattr(s, "blocks", None), nn.Module) for s in stages) else None


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


class TimmLayout:
    """:class:`~vitattn.adapter.ModelLayout` of a timm-style model (see the module docstring).

    ``name`` is how messages call the model (``"model"``, ``"teacher"``, ...). Made for any
    ``nn.Module``: what the model lacks reads as None (``grid``, ``patch_size``, ...) and its
    ``blocks`` as a ``TypeError`` naming ``name``.
    """

    def __init__(self, model: nn.Module, name: str = "model") -> None:
        self._model = model
        self.name = name

    @property
    def model(self) -> nn.Module:
        return self._model

    @cached_property
    def _block_list(self) -> tuple[list[nn.Module], list[str], bool]:
        """``(blocks, their names, windowed)``; no blocks: ``([], [], False)``."""
        blocks = getattr(self.model, "blocks", None)
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
            items = module_items(blocks)
            return items, [f"blocks[{i}]" for i in range(len(items))], False
        stages = _stages(self.model)
        if stages is None:
            return [], [], False
        found = [
            (f"layers[{s}].blocks[{j}]", block)
            for s, stage in enumerate(stages)
            for j, block in enumerate(module_items(stage.get_submodule("blocks")))
        ]
        return [block for _, block in found], [label for label, _ in found], True

    @property
    def depth(self) -> int:
        return len(self._block_list[0])

    @property
    def blocks(self) -> list[nn.Module]:
        if not self._block_list[0]:
            raise TypeError(
                f"{self.name} must be a timm VisionTransformer or a vitattn model (a ViT with a `blocks` "
                f"sequence, or a Swin with `layers[i].blocks`), got {type(self.model).__name__}"
            )
        return self._block_list[0]

    @property
    def block_names(self) -> list[str]:
        return self._block_list[1]

    @property
    def attentions(self) -> list[nn.Module | None]:
        """``block.attn`` of each block, read now (None where it is not a module)."""
        return [a if isinstance(a := getattr(b, "attn", None), nn.Module) else None for b in self.blocks]

    @property
    def attention_names(self) -> list[str]:
        return [f"{label}.attn" for label in self.block_names]

    @property
    def windowed(self) -> bool:
        return self._block_list[2]

    def _attention(self, index: int) -> nn.Module | None:
        attn = getattr(self.blocks[index], "attn", None)
        return attn if isinstance(attn, nn.Module) else None

    def num_heads(self, index: int) -> int | None:
        heads = getattr(self._attention(index), "num_heads", None)
        return None if heads is None else int(heads)

    def grid(self, image_size: Sequence[int] | None = None) -> tuple[int, int] | None:
        """From ``patch_embed.dynamic_feat_size`` when ``image_size`` is given (a ``dynamic_img_size``
        model gets the grid of each input), else ``patch_embed.grid_size``."""
        embed = getattr(self.model, "patch_embed", None)
        return None if embed is None else feat_size(embed, image_size)

    @property
    def num_prefix_tokens(self) -> int | None:
        """``model.num_prefix_tokens`` (class + register tokens)."""
        p = getattr(self.model, "num_prefix_tokens", None)
        return None if p is None else int(p)

    @property
    def num_class_tokens(self) -> int:
        registers = int(getattr(self.model, "num_reg_tokens", 0) or 0)
        return (self.num_prefix_tokens or 0) - registers

    @property
    def has_class_token(self) -> bool:
        if getattr(self.model, "cls_token", None) is not None:
            return True
        return bool(getattr(self.model, "has_class_token", False))

    @property
    def patch_size(self) -> tuple[int, int] | None:
        size = getattr(getattr(self.model, "patch_embed", None), "patch_size", None)
        return None if size is None else grid_pair("patch_embed.patch_size", tuple(size))

    @property
    def image_size(self) -> tuple[int, int] | None:
        size = getattr(getattr(self.model, "patch_embed", None), "img_size", None)
        return None if size is None else grid_pair("patch_embed.img_size", tuple(size))

    @property
    def final_norm(self) -> nn.Module | None:
        norm = getattr(self.model, "norm", None)
        return norm if isinstance(norm, nn.Module) else None

    def forward(self, images: torch.Tensor) -> Any:
        return self.model(images)

    def image_calls(self) -> AbstractContextManager[None]:
        return nullcontext()  # a timm model takes images and returns logits

    def reading_maps(self) -> AbstractContextManager[None]:
        return nullcontext()  # vitattn layers hand over their maps; timm's are recomputed beside them

    def normalizer(self, index: int) -> AttentionNormalizer:
        return layer_normalizer(self._module(index))

    def scale(self, index: int) -> float:
        return float(cast(TimmStyleAttention, self._module(index)).scale)

    def bias(self, index: int, q: torch.Tensor) -> torch.Tensor | GaussianBias | None:
        attn = self._module(index)
        return attn.attention_bias(q) if isinstance(attn, Attention) else None

    def dropout(self, index: int) -> float:
        attn = self._module(index)
        drop = getattr(attn, "attn_drop", None)
        return float(drop.p) if attn.training and isinstance(drop, nn.Dropout) else 0.0

    def _module(self, index: int) -> nn.Module:
        attn = self._attention(index)
        if attn is None:
            raise TypeError(f"{self.name}.{self.block_names[index]} has no `attn` module")
        return attn

    def _checked(self, index: int) -> nn.Module:
        """Block ``index``'s attention: timm's ``Attention`` or a vitattn layer, without a window."""
        attn = self._attention(index)
        where = f"{self.name}.{self.attention_names[index]}"
        if attn is None or not convertible_attention(attn):
            raise TypeError(
                f"{where} is {type(attn).__name__}; attention transfer supports timm's "
                "Attention and vitattn's Attention / EntmaxAttention / LocAtAttention"
            )
        if getattr(attn, "window", None) is not None:
            raise TypeError(
                f"{where} has a neighbourhood window ({type(attn).__name__}); attention transfer does "
                "not carry windows (its scores and rules are those of the full attention)"
            )
        return attn

    def check_intercept(self, index: int) -> None:
        self._checked(index)

    @contextmanager
    def intercept(
        self, indices: Sequence[int], rule: AttentionRule, *, need_qk: bool = True
    ) -> Iterator[None]:
        """The chosen modules' ``forward`` overridden by instance attributes (hooks still fire); the
        module, its parameters and state dict untouched."""
        saved: list[tuple[nn.Module, Any]] = []
        try:
            for i in indices:
                attn = self._checked(i)
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
