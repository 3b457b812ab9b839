"""Pure tensor functions of the attention pipeline (no nn.Module, no parameters)."""

from .attention import attention
from .capture import capture_attention_weights
from .dispatch import available_backends, explain, register_backend
from .entmax15 import entmax15
from .entmax_alpha import entmax, sparsemax
from .gaussian import GaussianBias, gaussian_clamp, gaussian_eps
from .normalize import Normalizer, normalize
from .prr import prr

__all__ = [
    "GaussianBias",
    "Normalizer",
    "attention",
    "available_backends",
    "capture_attention_weights",
    "entmax",
    "entmax15",
    "explain",
    "gaussian_clamp",
    "gaussian_eps",
    "normalize",
    "prr",
    "register_backend",
    "sparsemax",
]
