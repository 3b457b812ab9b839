""":func:`layout_of`: the one place that tells a timm-style model from a transformers one."""

from __future__ import annotations

from torch import nn

from ..models.origin import is_transformers_model
from .protocol import ModelLayout
from .timm import TimmLayout

__all__ = ["layout_of"]


def layout_of(model: nn.Module, name: str = "model", *, windowed: bool = True) -> ModelLayout:
    """The :class:`~vitattn.adapter.ModelLayout` of ``model``.

    A module of a transformers class gets :func:`vitattn.hf.hf_layout` (imported only then, so
    ``import vitattn`` never imports transformers); any other module a :class:`TimmLayout`. ``name``
    is how errors call the model (``"teacher"``, ...). ``windowed=False`` refuses a model whose
    attention runs in local windows (a Swin), for the tools that need attention over all tokens.

    Raises ``TypeError`` naming ``name`` when ``model`` is not an ``nn.Module``, is a transformers model
    of no supported vision family, or is windowed where ``windowed=False``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{name} must be a timm VisionTransformer, Eva or Swin, a vitattn model or a transformers "
            f"vision model (an nn.Module), got {type(model).__name__}"
        )
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        return hf_layout(model)
    layout = TimmLayout(model, name)
    if not windowed and layout.windowed:
        raise TypeError(
            f"{name} ({type(model).__name__}) attends within local windows: its attention maps are per "
            "window, and this needs attention over all of an image's tokens (a ViT with a `blocks` "
            "sequence)"
        )
    return layout
