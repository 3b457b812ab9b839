"""LocAtViT models, registered with timm (``timm.create_model("locatvit_tiny")`` after ``import vitattn``)."""

from . import hub
from .locatvit import HUB_WEIGHTS, LocAtViT, locatvit_base, locatvit_small, locatvit_tiny

hub.install()  # timm's ``hf-hub:`` loader also takes the official release's mixin-style config.json

__all__ = ["HUB_WEIGHTS", "LocAtViT", "hub", "locatvit_base", "locatvit_small", "locatvit_tiny"]
