"""nn.Modules, drop-ins for timm's ViT attention: Attention, EntmaxAttention, LocAtAttention, PRR."""

from .attention import Attention, EntmaxAttention
from .convert import convert_attention, convertible_attention
from .locat import GaussianAugment, LocAtAttention
from .prr import PRR

__all__ = [
    "PRR",
    "Attention",
    "EntmaxAttention",
    "GaussianAugment",
    "LocAtAttention",
    "convert_attention",
    "convertible_attention",
]
