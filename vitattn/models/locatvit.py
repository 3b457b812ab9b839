"""LocAtViT: timm's VisionTransformer with GAug (LocAt) attention and PRR, registered with timm."""

from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import generate_default_cfgs
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from ._locat_common import VIT, PRRHeadMixin, register_variants, release_cfg

__all__ = ["HUB_WEIGHTS", "LocAtViT", "locatvit_base", "locatvit_small", "locatvit_tiny"]


class LocAtViT(PRRHeadMixin, VisionTransformer):
    """Locality-Attending ViT: every timm ``VisionTransformer`` argument, plus

    Args:
        gaug: Gaussian-augmented (LocAt) attention in every block (``blocks.N.attn.gaug.*`` params).
        prr: parameter-free patch representation refinement after ``forward_features`` (after the
            final norm), before the model's own pooling and head.
        normalizer: the attention normalizer of every block (``"softmax"``, ``"entmax15"``, ...;
            ``"adaptive"``: one learnable alpha per head, see :class:`vitattn.layers.AdaptiveAlpha`).

    ``forward_features`` returns ``(B, N, C)`` before PRR, as the official release does. The patch
    grid the model is built for fixes GAug's constants; with ``dynamic_img_size=True`` the grid of
    each input is computed from its size and σ is rescaled by ``min(grid) / min(initial grid)``.
    """

    family = VIT
    needs = "timm's Attention (check block_fn / attn_layer)"


def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Pretrained cfg of the official release: timm's ViT defaults (ImageNet-1k head, 224 px, crop 0.9,
    bicubic, mean = std = 0.5 per channel), which its ``default_cfgs`` use unchanged."""
    return release_cfg(mean=IMAGENET_INCEPTION_MEAN, std=IMAGENET_INCEPTION_STD, **kwargs)


_ARCHS = {
    "locatvit_tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "locatvit_small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "locatvit_base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}
# The official release's ImageNet-1k weights on the Hugging Face Hub (safetensors, official key names)
HUB_WEIGHTS = {
    "locatvit_tiny": "sinahmr/locatvit_tiny",
    "locatvit_base": "sinahmr/locatvit_base",
}
default_cfgs = generate_default_cfgs(
    {name: _cfg(hf_hub_id=HUB_WEIGHTS[name]) if name in HUB_WEIGHTS else _cfg() for name in _ARCHS}
)


def _weights_doc(name: str) -> str:
    """The second paragraph of a variant's docstring: where its weights come from."""
    if name in HUB_WEIGHTS:
        hub = HUB_WEIGHTS[name]
        return f"``pretrained=True`` loads the official ImageNet-1k weights from the Hub (``{hub}``)."
    return "The official release publishes no weights for it: ``pretrained=True`` needs a local file."


_DOCS = {
    "locatvit_tiny": "LocAtViT-Tiny: ViT-Ti/16 (dim 192, depth 12, 3 heads) at 224 px with GAug and PRR.",
    "locatvit_small": "LocAtViT-Small: ViT-S/16 (dim 384, depth 12, 6 heads) at 224 px with GAug and PRR.",
    "locatvit_base": "LocAtViT-Base: ViT-B/16 (dim 768, depth 12, 12 heads) at 224 px with GAug and PRR.",
}
locatvit_tiny, locatvit_small, locatvit_base = register_variants(
    __name__,
    LocAtViT,
    _ARCHS,
    {name: f"{doc}\n\n{_weights_doc(name)}" for name, doc in _DOCS.items()},
    filter_fn=checkpoint_filter_fn,
    feature_cfg=dict(out_indices=3, feature_cls="getter"),
    published=HUB_WEIGHTS,
)
