"""Jumbo and LocAt Jumbo: timm's VisionTransformer with J class tokens and a wide shared prefix MLP.

The official release's ``Jumbo`` (``jumbo_tiny`` / ``jumbo_base``; with ``locat=True``
``locatjumbo_tiny`` / ``locatjumbo_base``). Jumbo (Fuller et al., 2025) replaces the class token by J
prefix tokens of width D that attend like any token; after each block's attention they are joined
into one J·D vector that goes through ``norm3``, an MLP of width J·D·``jumbo_mlp_ratio`` shared by all
blocks and the layer scale ``ls3``, while the patches take the block's usual ``norm2`` / ``mlp`` /
``ls2``. The final norm is split the same way (``norm`` over J·D, ``norm_patches`` over D with LocAt)
and the head reads the J tokens flattened. LocAt adds GAug to every block's attention (the J tokens
are its prefix) and PRR over the whole ``forward_features`` output before the head. State-dict keys
are the official ones; the shared MLP is stored as ``jumbo_mlp.*`` and under every block.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import DropPath, LayerScale, Mlp, trunc_normal_
from timm.models import checkpoint_seq, generate_default_cfgs
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import Block, VisionTransformer, checkpoint_filter_fn
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._locat_common import VIT, LocAtModelMixin, register_variants, release_cfg

__all__ = ["Jumbo", "JumboBlock", "jumbo_base", "jumbo_tiny", "locatjumbo_base", "locatjumbo_tiny"]


class JumboBlock(Block):
    """timm's ViT ``Block`` whose first ``J`` tokens leave the block's MLP for Jumbo's wide one.

    ``x: (B, J + Np, D)``: attention over all tokens (``norm1``, ``attn``, ``ls1``), then the J prefix
    tokens joined to ``(B, J·D)`` get ``+ ls3(jumbo_mlp(norm3(·)))`` and the patches
    ``+ ls2(mlp(norm2(·)))``. ``jumbo_mlp`` is the model's shared module (a submodule of every block).
    Every other argument is ``Block``'s; ``norm3`` is a ``torch.nn.LayerNorm`` (eps 1e-5) and ``ls3``
    is always built, so ``init_values`` must be set.
    """

    def __init__(self, *, J: int, jumbo_mlp: nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        init_values = kwargs.get("init_values")
        if init_values is None:
            raise ValueError("JumboBlock needs init_values (its prefix layer scale ls3 is always built)")
        dd: dict[str, Any] = {"device": kwargs.get("device"), "dtype": kwargs.get("dtype")}
        width = J * int(kwargs["dim"])
        drop_path = float(kwargs.get("drop_path", 0.0))
        self.J = J
        self.norm3 = nn.LayerNorm(width, **dd)
        self.jumbo_mlp = jumbo_mlp
        self.ls3 = LayerScale(width, init_values=init_values, **dd)
        self.drop_path3 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """``x: (B, N, D)`` -> ``(B, N, D)``."""
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        prefix, patches = x[:, : self.J].flatten(1), x[:, self.J :]
        prefix = prefix + self.drop_path3(self.ls3(self.jumbo_mlp(self.norm3(prefix))))
        patches = patches + self.drop_path2(self.ls2(self.mlp(self.norm2(patches))))
        return torch.cat([prefix.unflatten(1, (self.J, -1)), patches], dim=1)


def _check_jumbo_args(J: int, kwargs: dict[str, Any]) -> None:
    if isinstance(J, bool) or not isinstance(J, int) or J < 1:
        raise ValueError(f"J (the number of Jumbo prefix tokens) must be an int >= 1, got {J!r}")
    refused = {
        "block_fn": "Jumbo builds its own JumboBlocks",
        "reg_tokens": "Jumbo's prefix is its J class tokens (no register tokens)",
    }
    for key, why in refused.items():
        if kwargs.get(key):
            raise ValueError(f"{key}={kwargs[key]!r} is not supported: {why}")
    if kwargs.get("class_token") is False:
        raise ValueError("class_token=False is not supported: Jumbo's J class tokens are its prefix")
    if kwargs.get("no_embed_class") is False:
        raise ValueError(
            "no_embed_class=False is not supported: Jumbo's position embedding covers the patches only"
        )
    if kwargs.get("global_pool", "token") != "token":
        raise ValueError(
            f"global_pool={kwargs['global_pool']!r} is not supported: the head reads the J class tokens "
            "flattened (global_pool='token')"
        )
    if kwargs.get("init_values", 1e-4) is None:
        raise ValueError("init_values must be set for Jumbo (its prefix layer scale ls3 is always built)")
    if kwargs.get("pos_embed", "learn") in ("", "none"):
        raise ValueError("pos_embed='none' is not supported: Jumbo has a learned position embedding")


def _check_shared_mlp(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Refuse a state dict whose copies of the shared MLP (``jumbo_mlp.*``, ``blocks.N.jumbo_mlp.*``)
    differ: the model holds one MLP, so one of them would silently win."""
    shared = f"{prefix}jumbo_mlp."
    for key, value in state_dict.items():
        if not key.startswith(f"{prefix}blocks.") or ".jumbo_mlp." not in key:
            continue
        twin = shared + key.split(".jumbo_mlp.", 1)[1]
        other = state_dict.get(twin)
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
            if value.is_meta or other.is_meta:
                continue
            if value.shape != other.shape or not torch.equal(value, other.to(value.device, value.dtype)):
                error_msgs.append(
                    f"{key} differs from {twin}: Jumbo's prefix MLP is shared by all blocks, so every copy "
                    "in the state dict must hold the same values"
                )


class _JumboViT(VisionTransformer):
    """The Jumbo architecture on timm's ``VisionTransformer`` (no LocAt: see :class:`Jumbo`)."""

    def __init__(
        self, *, J: int = 6, jumbo_mlp_ratio: float = 4.0, norm_patches: bool = False, **kwargs: Any
    ) -> None:
        _check_jumbo_args(J, kwargs)
        kwargs.setdefault("init_values", 1e-4)
        kwargs["no_embed_class"] = True
        dd: dict[str, Any] = {"device": kwargs.get("device"), "dtype": kwargs.get("dtype")}
        dim = int(kwargs.get("embed_dim", 768))
        width = J * dim
        shared = Mlp(
            width,
            int(width * jumbo_mlp_ratio),
            act_layer=nn.GELU,
            drop=kwargs.get("proj_drop_rate", 0.0),
            **dd,
        )
        kwargs["block_fn"] = partial(JumboBlock, J=J, jumbo_mlp=shared)
        super().__init__(**kwargs)
        self.J = J
        self.jumbo_mlp_ratio = float(jumbo_mlp_ratio)
        self.num_prefix_tokens = J
        if isinstance(getattr(self.patch_drop, "num_prefix_tokens", None), int):
            self.patch_drop.num_prefix_tokens = J
        self.cls_token = nn.Parameter(torch.zeros(1, J, dim, **dd))
        self.jumbo_mlp = shared
        # first among the submodules, so that the shared MLP's own name is ``jumbo_mlp`` (named_modules /
        # named_parameters keep the first path of a shared module; FX names its calls by it), not
        # ``blocks.0.jumbo_mlp``, whose calls from later blocks would then count as block 0's
        modules = self._modules
        rest = {k: v for k, v in modules.items() if k != "jumbo_mlp"}
        modules.clear()
        modules["jumbo_mlp"] = shared
        modules.update(rest)
        self.norm = nn.LayerNorm(width, **dd)  # the J class tokens' final norm, over J·D
        self.norm_patches = nn.LayerNorm(dim, **dd) if norm_patches else nn.Identity()
        self.head_hidden_size = width
        self.head = nn.Linear(width, self.num_classes, **dd) if self.num_classes > 0 else nn.Identity()
        if kwargs.get("weight_init") != "skip":
            self._init_jumbo()
        self.register_load_state_dict_pre_hook(_check_shared_mlp)

    def _init_jumbo(self) -> None:
        """The official init of the Jumbo parts: class tokens N(0, 0.02²) truncated, a zero head weight
        with bias ``−ln(num_classes)`` (uniform initial predictions; the official builder rounds this
        to -4.6, -6.9, -9.25 for its 100, 1000, 10450 classes)."""
        trunc_normal_(self.cls_token, std=0.02)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.constant_(self.head.bias, -math.log(self.num_classes))

    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        """timm's ViT init, then the Jumbo parts' official init (:meth:`_init_jumbo`)."""
        super().init_weights(mode, needs_reset)
        if isinstance(getattr(self, "J", None), int):  # not during VisionTransformer.__init__
            self._init_jumbo()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, J + Np, D)`` -> the same, the J class tokens normed together over J·D (``norm``), the
        patches by ``norm_patches``."""
        prefix = self.norm(x[:, : self.J].flatten(1)).unflatten(1, (self.J, -1))
        return torch.cat([prefix, self.norm_patches(x[:, self.J :])], dim=1)

    def forward_features(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """``x: (B, C, H, W)`` -> ``(B, J + Np, D)`` after the final norms (before PRR)."""
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        if attn_mask is not None or is_causal:
            for blk in self.blocks:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
        elif self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.final_norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``x: (B, J + Np, D)`` -> the J class tokens flattened ``(B, J·D)`` -> the head."""
        x = self.head_drop(x[:, : self.J].flatten(1))
        return x if pre_logits else self.head(x)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new ``Linear(J·D, num_classes)`` head (``Identity`` for 0); ``global_pool`` stays "token"."""
        if global_pool not in (None, "token", ""):
            raise ValueError(
                f"Jumbo's head reads its J class tokens: global_pool must stay 'token', got {global_pool!r}"
            )
        weight = self.patch_embed.proj.weight
        self.num_classes = num_classes
        self.head = (
            nn.Linear(self.head_hidden_size, num_classes, device=weight.device, dtype=weight.dtype)
            if num_classes > 0
            else nn.Identity()
        )
        self.head.train(self.training)

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's pruning; ``prune_norm`` drops both final norms."""
        kept = super().prune_intermediate_layers(indices, prune_norm, prune_head)
        if prune_norm:
            self.norm_patches = nn.Identity()
        return kept

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> Any:
        """timm's ``forward_intermediates`` (same arguments and outputs) with Jumbo's split final norm
        (``norm=True`` applies it to every intermediate; the J class tokens are the prefix tokens)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        b, _, height, width = x.shape
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        taken = []
        for i, blk in enumerate(blocks):
            if attn_mask is not None or is_causal:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
            elif self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
            if i in take_indices:
                taken.append(self.final_norm(x) if norm else x)
        prefix_tokens = [y[:, : self.J] for y in taken]
        spatial = [y[:, self.J :] for y in taken]
        if output_fmt == "NCHW":
            gh, gw = self.patch_embed.dynamic_feat_size((height, width))
            spatial = [y.reshape(b, gh, gw, -1).permute(0, 3, 1, 2).contiguous() for y in spatial]
        if output_dict:
            out: dict[str, Any] = {"image_intermediates": spatial}
            if return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix_tokens
            if not intermediates_only:
                out["image_features"] = self.final_norm(x)
            return out
        intermediates: list[Any] = (
            list(zip(spatial, prefix_tokens, strict=True)) if return_prefix_tokens else spatial
        )
        if intermediates_only:
            return intermediates
        return self.final_norm(x), intermediates


class Jumbo(LocAtModelMixin, _JumboViT):
    """Jumbo (``locat=False``) and LocAt Jumbo (``locat=True``): every timm ``VisionTransformer``
    argument, plus

    Args:
        J: the number of class tokens (the prefix; 6 in the official release).
        jumbo_mlp_ratio: the shared prefix MLP's hidden width over J·D (4 in the official release).
        locat: the official LocAt Jumbo: GAug in every block, a ``norm_patches`` LayerNorm for the
            patches and PRR before the head (``gaug`` / ``prr`` override the first and last).
        gaug: GAug attention in every block (default: ``locat``).
        prr: PRR over all tokens of ``forward_features`` before the head (default: ``locat``).
        normalizer: the attention normalizer of every block (``"softmax"``, ``"entmax15"``, ...).

    The builders set ``init_values=1e-4`` (the layer scales; ``ls3`` is always built, so ``None`` is
    refused) and ``no_embed_class=True`` (the position embedding covers the patches only). Refused:
    register tokens, no class token, pooling other than the class tokens, a custom ``block_fn``.
    Every block's attention is a vitattn layer (``Attention`` for the plain Jumbo, same keys as timm's).
    ``forward_features`` returns ``(B, J + Np, D)`` after the final norms, before PRR;
    ``model(x) == model.forward_head(model.forward_features(x))``. ``num_features`` is D (per
    token), ``head_hidden_size`` J·D.
    """

    family = VIT
    needs = "timm's Attention (check attn_layer)"

    def __init__(
        self,
        *,
        J: int = 6,
        jumbo_mlp_ratio: float = 4.0,
        locat: bool = False,
        gaug: bool | None = None,
        prr: bool | None = None,
        normalizer: Any = "softmax",
        **kwargs: Any,
    ) -> None:
        locat = bool(locat)
        super().__init__(
            gaug=locat if gaug is None else bool(gaug),
            prr=locat if prr is None else bool(prr),
            normalizer=normalizer,
            J=J,
            jumbo_mlp_ratio=jumbo_mlp_ratio,
            norm_patches=locat,
            **kwargs,
        )
        self.locat = locat
        if not self.use_gaug and self.normalizer == "softmax":
            self._convert_blocks()  # vitattn's own Attention in every block all the same (same keys)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``x: (B, J + Np, D)`` -> PRR over all tokens (if on; only the J class tokens' rows are
        computed, every token is a key) -> the J class tokens flattened -> the head."""
        if self.prr is not None:
            x = self.prr(x, rows=self.J)
        return super().forward_head(x, pre_logits=pre_logits)


def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Pretrained cfg: timm's ViT defaults (the official ``_cfg()``: 224 px, crop 0.9, bicubic,
    mean = std = 0.5)."""
    return release_cfg(mean=IMAGENET_INCEPTION_MEAN, std=IMAGENET_INCEPTION_STD, **kwargs)


_TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, init_values=1e-4, no_embed_class=True)
_BASE = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, init_values=1e-4, no_embed_class=True)
_ARCHS = {
    "jumbo_tiny": _TINY,
    "jumbo_base": _BASE,
    "locatjumbo_tiny": dict(_TINY, locat=True),
    "locatjumbo_base": dict(_BASE, locat=True),
}
default_cfgs = generate_default_cfgs({name: _cfg() for name in _ARCHS})

_DOCS = {
    "jumbo_tiny": "Jumbo-Tiny: ViT-Ti/16 (dim 192, depth 12, 3 heads) with J = 6 class tokens and the shared "
    "wide prefix MLP, at 224 px.",
    "jumbo_base": "Jumbo-Base: ViT-B/16 (dim 768, depth 12, 12 heads) with J = 6 class tokens and the shared "
    "wide prefix MLP, at 224 px.",
    "locatjumbo_tiny": "LocAt Jumbo-Tiny: Jumbo-Tiny (dim 192, depth 12, 3 heads, J = 6) at 224 px with "
    "GAug and PRR.",
    "locatjumbo_base": "LocAt Jumbo-Base: Jumbo-Base (dim 768, depth 12, 12 heads, J = 6) at 224 px with "
    "GAug and PRR.",
}
_NO_WEIGHTS = "The official release publishes no weights for it: ``pretrained=True`` needs a local file."

jumbo_tiny, jumbo_base, locatjumbo_tiny, locatjumbo_base = register_variants(
    __name__,
    Jumbo,
    _ARCHS,
    {name: f"{doc}\n\n{_NO_WEIGHTS}" for name, doc in _DOCS.items()},
    filter_fn=checkpoint_filter_fn,
    feature_cfg=dict(out_indices=3, feature_cls="getter"),
)
