"""nn.Modules, drop-ins for timm's attention: Attention, EntmaxAttention, LocAtAttention, PRR, the
neighbourhood layer, and the rotary (Eva) and window (Swin) layers."""

from .adaptive import AdaptiveAlpha
from .attention import Attention, EntmaxAttention
from .convert import convert_attention, convertible_attention
from .explicit import attention_extract_names, use_explicit_attention
from .grid import GridAttention
from .locat import GaussianAugment, LocAtAttention
from .locat_rope import LocAtRopeAttention, RopeAttention, convert_rope_attention, convertible_rope_attention
from .locat_window import (
    LocAtWindowAttention,
    WindowAttention,
    convert_window_attention,
    convertible_window_attention,
)
from .neighborhood import NeighborhoodAttention
from .prr import PRR, PRRPool, PRRPoolNHWC

__all__ = [
    "PRR",
    "PRRPool",
    "PRRPoolNHWC",
    "AdaptiveAlpha",
    "Attention",
    "EntmaxAttention",
    "GaussianAugment",
    "GridAttention",
    "LocAtAttention",
    "LocAtRopeAttention",
    "LocAtWindowAttention",
    "NeighborhoodAttention",
    "RopeAttention",
    "WindowAttention",
    "attention_extract_names",
    "convert_attention",
    "convert_rope_attention",
    "convert_window_attention",
    "convertible_attention",
    "convertible_rope_attention",
    "convertible_window_attention",
    "use_explicit_attention",
]
