"""LocAt RoPE ViT: timm's ``Eva`` with GAug attention on rotary q, k and PRR, registered with timm.

The official release's ``LocAtRoPEViT`` (``locatvit_tiny_rope_mixed``, ``locatvit_base_rope_mixed``):
a RoPE-Mixed ViT (timm's ``Eva`` with ``attn_type="rope"``, per-depth learnable rotary frequencies,
no absolute position embedding, layer scale 1e-5, class-token pooling) whose attention gets GAug,
and PRR after ``forward_features``. State-dict keys are the official ones.
"""

from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.eva import Eva, checkpoint_filter_fn

from ..functional.normalize import Normalizer, resolve_normalizer
from ..layers.locat_rope import (
    LocAtRopeAttention,
    RopeAttention,
    convert_rope_attention,
    convertible_rope_attention,
)
from ._locat_common import PRRHeadMixin, convert_all_blocks, make_prr, reject_patch_drop
from .locatvit import _weight_source

__all__ = ["LocAtRoPEViT", "locatvit_base_rope_mixed", "locatvit_tiny_rope_mixed"]


class LocAtRoPEViT(PRRHeadMixin, Eva):
    """LocAt on timm's ``Eva`` (rotary ViTs): every ``Eva`` argument, plus

    Args:
        gaug: GAug attention in every block (:class:`~vitattn.layers.LocAtRopeAttention`).
        prr: parameter-free patch representation refinement after ``forward_features``, before the
            model's pooling and head.
        normalizer: the attention normalizer of every block.
        rope_mixed_mode: the official release's (older timm's) spelling of ``rope_type="mixed"``.

    ``forward_features`` returns ``(B, N, C)`` before PRR. ``dynamic_img_size=True`` works: each
    input's grid is set on the GAug layers and σ is rescaled by ``min(grid) / min(initial grid)``.
    """

    def __init__(
        self,
        *args: Any,
        gaug: bool = True,
        prr: bool = True,
        normalizer: Normalizer = "softmax",
        rope_mixed_mode: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if rope_mixed_mode is not None:
            kwargs.setdefault("rope_type", "mixed" if rope_mixed_mode else "cat")
        reject_patch_drop(gaug, kwargs)
        super().__init__(*args, **kwargs)
        self.use_gaug = bool(gaug)
        self.normalizer = resolve_normalizer(normalizer)
        if self.use_gaug or self.normalizer != "softmax":
            self._convert_blocks()
        self.prr = make_prr(self, prr, kwargs)

    def _convert_blocks(self) -> None:
        grid = tuple(int(g) for g in self.patch_embed.grid_size)
        cls = LocAtRopeAttention if self.use_gaug else RopeAttention
        extra = dict(grid_size=grid) if self.use_gaug else {}
        needs = "timm's AttentionRope or EvaAttention (use_post_norm blocks are not supported)"
        convert_all_blocks(
            self, convertible_rope_attention, convert_rope_attention, cls, needs, self.use_gaug,
            normalizer=self.normalizer, **extra,
        )  # fmt: skip



def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Pretrained cfg of the official release: timm's Eva defaults with ImageNet mean / std."""
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "paper_ids": "arXiv:2603.04892",
        "paper_name": "Locality-Attending Vision Transformer",
        "origin_url": "https://github.com/sinahmr/LocAtViT",
        **kwargs,
    }


# the official builders' arguments: a RoPE-Mixed ViT as timm's ``vit_*_patch16_rope_mixed_224``
_COMMON = dict(
    mlp_ratio=4,
    qkv_bias=True,
    attn_type="rope",
    init_values=1e-5,
    class_token=True,
    global_pool="token",
    use_abs_pos_emb=False,
    use_rot_pos_emb=True,
    rope_grid_indexing="xy",
    rope_temperature=10.0,
    rope_type="mixed",
)
_ARCHS = {
    "locatvit_tiny_rope_mixed": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, **_COMMON),
    "locatvit_base_rope_mixed": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, **_COMMON),
}
default_cfgs = generate_default_cfgs({name: _cfg() for name in _ARCHS})


def _create(variant: str, pretrained: bool, **kwargs: Any) -> LocAtRoPEViT:
    if "rope_mixed_mode" in kwargs:  # the official spelling overrides the default rope_type
        kwargs["rope_type"] = "mixed" if kwargs.pop("rope_mixed_mode") else "cat"
    kwargs = dict(_ARCHS[variant], **kwargs)
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    if pretrained and not _weight_source(variant, kwargs.get("pretrained_cfg"), overlay):
        raise ValueError(
            f"{variant} has no weights vitattn knows of; use pretrained=False, or give a local checkpoint "
            "with pretrained_cfg_overlay=dict(file='path/to/weights.safetensors')"
        )
    if overlay.get("file"):  # a local file is taken to have the head asked for (else timm would drop it)
        overlay.setdefault("num_classes", kwargs.get("num_classes", 1000))
    kwargs.pop("store_metrics", None)  # an official-release argument with no effect here
    return build_model_with_cfg(
        LocAtRoPEViT,
        variant,
        pretrained,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=kwargs.pop("out_indices", 3), feature_cls="getter"),
        **kwargs,
    )


@register_model
def locatvit_tiny_rope_mixed(pretrained: bool = False, **kwargs: Any) -> LocAtRoPEViT:
    """LocAt RoPE-Mixed ViT-Ti/16 (dim 192, depth 12, 3 heads) at 224 px with GAug and PRR."""
    return _create("locatvit_tiny_rope_mixed", pretrained, **kwargs)


@register_model
def locatvit_base_rope_mixed(pretrained: bool = False, **kwargs: Any) -> LocAtRoPEViT:
    """LocAt RoPE-Mixed ViT-B/16 (dim 768, depth 12, 12 heads) at 224 px with GAug and PRR."""
    return _create("locatvit_base_rope_mixed", pretrained, **kwargs)
