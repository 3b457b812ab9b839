"""Hugging Face transformers vision models on vitattn (the optional ``hf`` extra).

- :func:`register`: vitattn's attention as transformers ``AttentionInterface`` functions
  (``vitattn_softmax``, ``vitattn_entmax15``, ``vitattn_sparsemax``, ``vitattn_entmax_<alpha>`` through
  :func:`attention_name`, and ``vitattn`` for patched models);
- :func:`vitattn.patch` takes transformers ViT, DeiT, DINOv2 (with and without registers), ViT-MAE,
  CLIP vision and SigLIP vision models (:func:`patch_transformers`);
- :func:`from_pretrained` loads a saved model as the class it was saved as
  (:func:`saved_model_class`), its vitattn patch rebuilt before the weights load
  (:func:`patching_class`); :func:`load_model` resolves ``hf:<model id or folder>`` offline for the
  command line;
- :func:`hf_layout` finds the vision tower, its layers and attention modules, the token layout: an
  :class:`HFLayout`, the transformers implementation of :class:`vitattn.adapter.ModelLayout`.

Importing this package registers the attention functions with transformers (importing it), so
``AutoModel.from_pretrained(path, attn_implementation="vitattn_entmax15")`` works right after
``import vitattn.hf``; ``import vitattn`` itself never imports transformers.
"""

from ..models.origin import is_transformers_model
from .functions import (
    ATTENTION_NAMES,
    PATCHED_NAME,
    HFAttentionSettings,
    attention_name,
    hf_attention,
    is_vitattn_implementation,
    normalizer_of_name,
    register,
)
from .implementation import set_implementation, vitattn_implementation
from .layout import FAMILIES, HFFamily, HFLayout, hf_layout, run_backbone
from .loading import (
    HF_PREFIX,
    LoadedModel,
    from_pretrained,
    image_normalization,
    load_gaug_weights,
    load_model,
    patching_class,
    saved_model_class,
)
from .patching import (
    RECORD_KEY,
    ImplementationSetter,
    apply_record,
    patch_transformers,
)

__all__ = [
    "ATTENTION_NAMES",
    "FAMILIES",
    "HF_PREFIX",
    "PATCHED_NAME",
    "RECORD_KEY",
    "HFAttentionSettings",
    "HFFamily",
    "HFLayout",
    "ImplementationSetter",
    "LoadedModel",
    "apply_record",
    "attention_name",
    "from_pretrained",
    "hf_attention",
    "hf_layout",
    "image_normalization",
    "is_transformers_model",
    "is_vitattn_implementation",
    "load_gaug_weights",
    "load_model",
    "normalizer_of_name",
    "patch_transformers",
    "patching_class",
    "register",
    "run_backbone",
    "saved_model_class",
    "set_implementation",
    "vitattn_implementation",
]

try:
    register()
except ImportError:  # without transformers the package still imports; register() then says what to install
    pass
