"""Load model weights safely: safetensors files or weights-only torch state dicts, never pickles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["load_checkpoint", "read_state_dict"]

_NESTED = ("state_dict", "model", "model_ema", "sd")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file, on CPU.

    ``.safetensors`` is read with safetensors; anything else with ``torch.load(weights_only=True)``,
    which refuses arbitrary pickled objects. A dict nesting the weights under ``state_dict``,
    ``model``, ``model_ema`` or ``sd`` is unwrapped, and keys under a ``sd.`` or ``module.`` prefix
    are taken with the prefix removed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        obj: Any = load_file(str(path), device="cpu")
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # the weights-only unpickler raises plain pickle errors
            raise ValueError(
                f"{str(path)!r} is not a weights-only torch checkpoint (it was refused by "
                f"torch.load(weights_only=True): {err}); save a state dict or use safetensors"
            ) from err
    while isinstance(obj, dict):
        key = next((k for k in _NESTED if isinstance(obj.get(k), dict)), None)
        if key is None:
            break
        obj = obj[key]
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{str(path)!r} holds no state dict (got {type(obj).__name__})")
    for prefix in ("sd.", "module."):
        if any(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix) :]: v for k, v in obj.items() if k.startswith(prefix)}
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"{str(path)!r} holds no tensors")
    return tensors


def load_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> nn.Module:
    """Load :func:`read_state_dict` of ``path`` into ``model`` and return the model.

    Raises ``ValueError`` listing missing / unexpected keys (a few of each) when they do not match.
    """
    sd = read_state_dict(path)
    try:
        result = model.load_state_dict(sd, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"checkpoint {str(path)!r} does not fit {type(model).__name__}: {err}") from err
    if strict and (result.missing_keys or result.unexpected_keys):
        miss, extra = result.missing_keys, result.unexpected_keys
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit {type(model).__name__}: {len(miss)} missing keys "
            f"{miss[:5]}, {len(extra)} unexpected keys {extra[:5]} (check the model name and --model-arg)"
        )
    return model
