"""One model adapter: what vitattn's tools need to know about a ViT, whichever library built it.

``layout_of(model)`` tells a transformers model from a timm-style one once and returns its
:class:`ModelLayout`: the blocks and the attention module of each, heads, patch grid and prefix
tokens, a forward on images, each layer's normalizer / scale / bias / dropout, the context in which
attention maps can be read and the one in which a rule replaces a layer's attention.
:func:`vitattn.patch`, :mod:`vitattn.analysis`, :mod:`vitattn.probe` and :mod:`vitattn.transfer` take
that layout and ask it, never the model's origin. Two implementations: :class:`TimmLayout` here,
:class:`vitattn.hf.HFLayout` for transformers vision models.
"""

from .choose import layout_of
from .protocol import AttentionRule, ModelLayout
from .timm import TimmLayout
from .tokens import resolve_layout

__all__ = [
    "AttentionRule",
    "ModelLayout",
    "TimmLayout",
    "layout_of",
    "resolve_layout",
]
