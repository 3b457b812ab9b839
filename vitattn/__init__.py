"""vitattn: drop-in local and selective attention layers for Vision Transformers."""

from . import functional
from .functional import GaussianBias, attention, entmax, entmax15, prr, sparsemax

__version__ = "0.1.0"

__all__ = ["GaussianBias", "__version__", "attention", "entmax", "entmax15", "functional", "prr", "sparsemax"]
