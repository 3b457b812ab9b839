"""LocAt RoPE ViT: timm's ``Eva`` with GAug attention on rotary q, k and PRR, registered with timm.

The official release's ``LocAtRoPEViT`` (``locatvit_tiny_rope_mixed``, ``locatvit_base_rope_mixed``):
a RoPE-Mixed ViT (timm's ``Eva`` with ``attn_type="rope"``, per-depth learnable rotary frequencies,
no absolute position embedding, layer scale 1e-5, class-token pooling) whose attention gets GAug,
and PRR after ``forward_features``. State-dict keys are the official ones.
"""

from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import generate_default_cfgs
from timm.models.eva import Eva, checkpoint_filter_fn

from ._locat_common import EVA, PRRHeadMixin, register_variants, release_cfg

__all__ = ["LocAtRoPEViT", "locatvit_base_rope_mixed", "locatvit_tiny_rope_mixed"]


class LocAtRoPEViT(PRRHeadMixin, Eva):
    """LocAt on timm's ``Eva`` (rotary ViTs): every ``Eva`` argument, plus

    Args:
        gaug: GAug attention in every block (:class:`~vitattn.layers.LocAtRopeAttention`).
        prr: parameter-free patch representation refinement after ``forward_features``, before the
            model's pooling and head.
        normalizer: the attention normalizer of every block.
        rope_mixed_mode: the official release's (older timm's) spelling of ``rope_type="mixed"``
            (``True``) or ``"cat"`` (``False``); it overrides ``rope_type``.

    ``forward_features`` returns ``(B, N, C)`` before PRR. ``dynamic_img_size=True`` works: each
    input's grid is set on the GAug layers and σ is rescaled by ``min(grid) / min(initial grid)``.
    """

    family = EVA
    needs = "timm's AttentionRope or EvaAttention (use_post_norm blocks are not supported)"

    def __init__(self, *args: Any, rope_mixed_mode: bool | None = None, **kwargs: Any) -> None:
        if rope_mixed_mode is not None:
            kwargs["rope_type"] = "mixed" if rope_mixed_mode else "cat"
        super().__init__(*args, **kwargs)


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
default_cfgs = generate_default_cfgs(
    {name: release_cfg(mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD) for name in _ARCHS}
)


locatvit_tiny_rope_mixed, locatvit_base_rope_mixed = register_variants(
    __name__,
    LocAtRoPEViT,
    _ARCHS,
    {
        "locatvit_tiny_rope_mixed": "LocAt RoPE-Mixed ViT-Ti/16 (dim 192, depth 12, 3 heads) at 224 px with "
        "GAug and PRR.",
        "locatvit_base_rope_mixed": "LocAt RoPE-Mixed ViT-B/16 (dim 768, depth 12, 12 heads) at 224 px with "
        "GAug and PRR.",
    },
    filter_fn=checkpoint_filter_fn,
    feature_cfg=dict(out_indices=3, feature_cls="getter"),
)
