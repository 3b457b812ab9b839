"""LocAt models, registered with timm (``timm.create_model("locatvit_tiny")`` after ``import vitattn``):
the ViT family, the RoPE ViT on timm's Eva (``locatvit_*_rope_mixed``), Swin (``locatswin_*``) and
Jumbo (``locatjumbo_*``, and the plain ``jumbo_*``)."""

from . import hub
from .jumbo import Jumbo, JumboBlock, jumbo_base, jumbo_tiny, locatjumbo_base, locatjumbo_tiny
from .locatrope import LocAtRoPEViT, locatvit_base_rope_mixed, locatvit_tiny_rope_mixed
from .locatswin import LocAtSwin, locatswin_base, locatswin_tiny
from .locatvit import HUB_WEIGHTS, LocAtViT, locatvit_base, locatvit_small, locatvit_tiny

__all__ = [
    "HUB_WEIGHTS",
    "Jumbo",
    "JumboBlock",
    "LocAtRoPEViT",
    "LocAtSwin",
    "LocAtViT",
    "hub",
    "jumbo_base",
    "jumbo_tiny",
    "locatjumbo_base",
    "locatjumbo_tiny",
    "locatswin_base",
    "locatswin_tiny",
    "locatvit_base",
    "locatvit_base_rope_mixed",
    "locatvit_small",
    "locatvit_tiny",
    "locatvit_tiny_rope_mixed",
]
