"""A model to analyse from its timm name: random init, optional vitattn attention, optional weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import timm
from torch import nn

from .. import models as _models  # noqa: F401  (registers locatvit_* with timm)
from ..patch import patch
from .checkpoint import load_checkpoint

__all__ = ["build_model"]


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
