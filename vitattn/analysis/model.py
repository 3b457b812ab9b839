"""A model to analyse from its timm name (random init, optional vitattn attention, optional weights), and
the check that an input size fits a model's patches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import timm
from torch import nn

from .. import models as _models  # noqa: F401  (registers locatvit_* with timm)
from ..functional import grid_pair
from ..models.blocks import is_transformers_model
from ..patch import patch
from .checkpoint import load_checkpoint

__all__ = ["build_model", "check_image_size", "patch_size_of"]


def build_model(
    name: str,
    model_args: dict[str, Any] | None = None,
    attention: Literal["softmax", "entmax15", "locat", "window"] | None = None,
    checkpoint: str | Path | None = None,
) -> nn.Module:
    """A timm model (vitattn's ``locatvit_*`` included) with random init, optionally patched with
    vitattn attention (``attention``: softmax / entmax15 / locat / window) and loaded from ``checkpoint``,
    in eval mode.

    ``model_args`` go to ``timm.create_model``. Raises ``ValueError`` for a name timm does not know,
    or builder arguments it does not take.
    """
    try:
        model = timm.create_model(name, pretrained=False, **(model_args or {}))
    except RuntimeError as err:
        if "Unknown model" in str(err):
            raise ValueError(
                f"unknown model {name!r}: give a timm model name (see timm.list_models())"
            ) from err
        raise
    except TypeError as err:  # an argument the model's builder does not take
        raise ValueError(f"timm cannot build {name!r} with {model_args}: {err}") from err
    if attention is not None:
        patch(model, attention)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval()


def patch_size_of(model: nn.Module) -> tuple[int, int] | None:
    """``(rows, columns)`` of a patch of a timm-style ViT (``patch_embed.patch_size``) or of a
    transformers vision model (its config's ``patch_size``); None for a model without patches."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        return hf_layout(model).patch_size
    size = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    return None if size is None else grid_pair("patch_embed.patch_size", tuple(size))


def check_image_size(model: nn.Module, size: int | Sequence[int], name: str = "image size") -> None:
    """Refuse an input size that is not a multiple of ``model``'s patch size.

    A convolutional patch embedding (timm's, transformers') silently drops the pixels past the last
    whole patch: 40 px with 16-px patches is a 2x2 grid that never sees 8 pixel rows and columns.
    Passes when the model has no patch embedding, or pads the input itself (timm's
    ``dynamic_img_pad``). ``name`` names the size in the ``ValueError`` (an option or a field).
    """
    patch_size = patch_size_of(model)
    if patch_size is None or getattr(getattr(model, "patch_embed", None), "dynamic_img_pad", False):
        return
    h, w = grid_pair(name, size)
    (ph, pw) = patch_size
    if h % ph == 0 and w % pw == 0:
        return
    shown = f"{h}" if h == w else f"{h}x{w}"
    patch = f"{ph}" if ph == pw else f"{ph}x{pw}"
    lower = f"{h - h % ph}" if ph == pw and h == w else None
    hint = f"e.g. {lower} or {int(lower) + ph}" if lower and int(lower) > 0 else f"e.g. {ph}"
    raise ValueError(
        f"{name} {shown} is not a multiple of the patch size {patch} of {type(model).__name__}: its "
        f"{h // ph}x{w // pw} patch grid would drop the last {h % ph} pixel row(s) and {w % pw} "
        f"column(s) of every image; give a multiple of {patch} ({hint})"
    )
