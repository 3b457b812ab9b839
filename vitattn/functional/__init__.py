"""Pure tensor functions of the attention pipeline (no nn.Module, no parameters)."""

from ._checks import grid_pair
from .attention import Explanation, attention, explain, make_call
from .capture import capture_attention_weights
from .dispatch import (
    AttentionCall,
    SlowPathWarning,
    available_backends,
    backend_groups,
    get_default_backend,
    register_backend,
    set_default_backend,
)
from .dtypes import compute_dtype
from .entmax15 import entmax15
from .entmax_alpha import entmax, sparsemax
from .fy_loss import fy_loss
from .gaussian import GaussianBias, gaussian_clamp, gaussian_eps, gaussian_exponent
from .normalize import Normalizer, NormalizerSpec, normalize, register_normalizer, unregister_normalizer
from .prr import prr
from .scoring import apply_mask, scores
from .value_checks import set_value_checks, value_checks_enabled
from .window import WindowMask, window_starts

__all__ = [
    "AttentionCall",
    "Explanation",
    "GaussianBias",
    "Normalizer",
    "NormalizerSpec",
    "SlowPathWarning",
    "WindowMask",
    "apply_mask",
    "attention",
    "available_backends",
    "backend_groups",
    "capture_attention_weights",
    "compute_dtype",
    "entmax",
    "entmax15",
    "explain",
    "fy_loss",
    "gaussian_clamp",
    "gaussian_eps",
    "gaussian_exponent",
    "get_default_backend",
    "grid_pair",
    "make_call",
    "normalize",
    "prr",
    "register_backend",
    "register_normalizer",
    "scores",
    "set_default_backend",
    "set_value_checks",
    "sparsemax",
    "unregister_normalizer",
    "value_checks_enabled",
    "window_starts",
]
