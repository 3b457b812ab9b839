"""LocAtViT models, registered with timm (``timm.create_model("locatvit_tiny")`` after ``import vitattn``)."""

from .locatvit import LocAtViT, locatvit_base, locatvit_small, locatvit_tiny

__all__ = ["LocAtViT", "locatvit_base", "locatvit_small", "locatvit_tiny"]
