"""vitattn: drop-in local and selective attention layers for Vision Transformers."""

from . import functional, kernels, models, transfer
from .functional import (
    GaussianBias,
    WindowMask,
    attention,
    entmax,
    entmax15,
    get_default_backend,
    prr,
    set_default_backend,
    sparsemax,
)
from .layers import PRR, Attention, EntmaxAttention, LocAtAttention, NeighborhoodAttention
from .patch import patch

__version__ = "0.1.0"

kernels.register()  # the "triton" backend; triton itself is imported on first use only

__all__ = ["GaussianBias", "__version__", "attention", "entmax", "entmax15", "functional", "prr", "sparsemax"]
__all__ += ["get_default_backend", "set_default_backend"]
__all__ += ["PRR", "Attention", "EntmaxAttention", "LocAtAttention", "models", "patch", "transfer"]
__all__ += ["NeighborhoodAttention", "WindowMask"]
