"""Load model weights safely: safetensors files or weights-only torch state dicts, never pickles."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["check_fit", "load_checkpoint", "read_state_dict"]

_NESTED = ("state_dict", "model", "model_ema", "sd")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _first_line(err: BaseException, limit: int = 160) -> str:
    """The first line of an error message, terminal colour codes removed, at most ``limit`` characters."""
    lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as err:  # a corrupt, truncated or non-safetensors file
        raise ValueError(
            f"checkpoint {str(path)!r} is not a readable safetensors file ({_first_line(err)})"
        ) from err


def _read_torch(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # the weights-only unpickler met an object it refuses
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f" of {found.group(1)}" if found else ""
        raise ValueError(
            f"checkpoint {str(path)!r} holds a pickled object{what}, not a weights-only state dict: "
            "torch.load(weights_only=True) refuses it and vitattn does not unpickle code; save "
            "model.state_dict() with torch.save or safetensors and pass that"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError) as err:  # not a torch file, or a damaged one
        raise ValueError(
            f"checkpoint {str(path)!r} is neither a safetensors file nor a readable torch state dict "
            f"(torch.load: {_first_line(err)})"
        ) from err


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file, on CPU.

    ``.safetensors`` is read with safetensors; anything else with ``torch.load(weights_only=True)``,
    which refuses arbitrary pickled objects. A dict nesting the weights under ``state_dict``,
    ``model``, ``model_ema`` or ``sd`` is unwrapped, and keys under a ``sd.`` or ``module.`` prefix
    are taken with the prefix removed.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` (one line naming the file) for
    a folder, a corrupt file, a pickled model or a file without tensors.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is a folder; give the weights file")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    obj: Any = _read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path)
    while isinstance(obj, dict):
        key = next((k for k in _NESTED if isinstance(obj.get(k), dict)), None)
        if key is None:
            break
        obj = obj[key]
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"checkpoint {str(path)!r} holds no state dict (got {type(obj).__name__})")
    for prefix in ("sd.", "module."):
        if any(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix) :]: v for k, v in obj.items() if k.startswith(prefix)}
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"checkpoint {str(path)!r} holds no tensors")
    return tensors


def check_fit(
    model: nn.Module, state: dict[str, torch.Tensor], path: str | Path, strict: bool = True
) -> None:
    """Raise a one-line ``ValueError`` when ``state`` does not fit ``model``: the tensors of another
    shape (the first few), then, with ``strict``, the missing and unexpected keys (a few of each).
    Reads shapes only, so ``model`` may live on the meta device."""
    own = model.state_dict()
    where = f"checkpoint {str(path)!r} does not fit {type(model).__name__}"
    wrong = [k for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        shapes = ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in wrong[:3])
        raise ValueError(f"{where}: {len(wrong)} tensor(s) of another shape (checkpoint vs model): {shapes}")
    miss = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    if strict and (miss or extra):
        raise ValueError(
            f"{where}: {len(miss)} missing keys {miss[:5]}, {len(extra)} unexpected keys {extra[:5]} (check "
            "the model name and --model-arg)"
        )


def load_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> nn.Module:
    """Load :func:`read_state_dict` of ``path`` into ``model`` and return the model.

    Raises ``ValueError`` (one line) naming the tensors of another shape, or listing missing /
    unexpected keys (a few of each) when they do not match.
    """
    sd = read_state_dict(path)
    check_fit(model, sd, path, strict)
    model.load_state_dict(sd, strict=False)
    return model
