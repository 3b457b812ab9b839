"""Load transformers vision models for vitattn: patched models back from their files, and
``hf:<model id or folder>`` specs for the command line, offline only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..functional.normalize import Normalizer
from ..layers.locat import GaugInit
from .functions import register
from .layout import hf_layout
from .patching import RECORD_KEY, apply_record, patch_transformers

__all__ = [
    "HF_PREFIX",
    "LoadedModel",
    "from_pretrained",
    "image_normalization",
    "load_gaug_weights",
    "load_model",
]

HF_PREFIX = "hf:"
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _auto_model() -> Any:
    try:
        from transformers import AutoModel
    except ImportError as err:  # pragma: no cover - the hf extra is installed in the tests
        raise ImportError('loading transformers models needs the extra: pip install "vitattn[hf]"') from err
    return AutoModel


def _hub_file(source: str, filename: str, local_files_only: bool) -> Path | None:
    """``filename`` of a local folder or of a Hub repo (its cached copy when ``local_files_only``)."""
    folder = Path(source)
    if folder.is_dir():
        path = folder / filename
        return path if path.is_file() else None
    from transformers.utils import cached_file

    found = cached_file(
        source,
        filename,
        local_files_only=local_files_only,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    return Path(found) if found else None


def _weight_files(source: str, local_files_only: bool) -> list[Path]:
    """The safetensors files of a saved model (one file, or the shards of its index)."""
    single = _hub_file(source, "model.safetensors", local_files_only)
    if single is not None:
        return [single]
    index = _hub_file(source, "model.safetensors.index.json", local_files_only)
    if index is None:
        return []
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = [_hub_file(source, shard, local_files_only) for shard in shards]
    return [f for f in files if f is not None]


def _gaug_slot(key: str) -> tuple[int, str] | None:
    """``(layer index, name under gaug)`` of a checkpoint key ``...<i>...gaug.<name>``, else None.

    The layer index is the last number in the path before ``gaug``: transformers renames the other
    parts between versions (``layers.i.attention`` / ``encoder.layer.i.attention.attention``)."""
    head, sep, tail = key.rpartition(".gaug.")
    if not sep:
        return None
    numbers = [part for part in head.split(".") if part.isdigit()]
    return (int(numbers[-1]), tail) if numbers else None


def load_gaug_weights(model: nn.Module, source: str | Path, local_files_only: bool = True) -> nn.Module:
    """Read the GAug tensors of a saved model (a folder or a Hub id, its safetensors) into ``model``,
    which was patched with ``attention="locat"`` the same way (patch, then load). Matched by layer
    index, so the key names transformers writes in another version still fit. Raises ``ValueError``
    naming the GAug tensors the files lack."""
    from safetensors import safe_open

    layout = hf_layout(model)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    wanted: dict[tuple[int, str], torch.Tensor] = {}
    for i, name in enumerate(layout.attention_names):
        for key, value in params.items():
            if key.startswith(f"{name}.gaug."):
                wanted[(i, key[len(name) + len(".gaug.") :])] = value
    if not wanted:
        return model
    found: dict[tuple[int, str], torch.Tensor] = {}
    for path in _weight_files(str(source), local_files_only):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                slot = _gaug_slot(key)
                if slot in wanted:
                    found[slot] = f.get_tensor(key)
    missing = sorted(set(wanted) - set(found))
    if missing:
        names = [f"{layout.attention_names[i]}.gaug.{tail}" for i, tail in missing]
        raise ValueError(
            f"{str(source)!r} holds no weights for {len(missing)} GAug tensors of the patched model, "
            f"e.g. {names[:3]}: was it saved from a model patched with attention='locat' on these layers?"
        )
    with torch.no_grad():
        for slot, value in found.items():
            wanted[slot].copy_(value.to(wanted[slot].dtype))
    return model


def from_pretrained(
    source: str | Path,
    *,
    model_class: Any = None,
    attention: str | None = None,
    prr: bool = False,
    normalizer: Normalizer | None = None,
    gaug_init: GaugInit = "paper",
    local_files_only: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """A transformers vision model with vitattn's patch rebuilt, weights included.

    ``model_class.from_pretrained(source, **kwargs)`` (``AutoModel`` by default) loads the model; if
    its config holds a ``vitattn`` record (what :func:`vitattn.patch` did before ``save_pretrained``),
    the same patch is applied again and the GAug weights are read from its safetensors. With
    ``attention`` (``"softmax"``, ``"entmax15"``, ``"locat"``), the model is then patched as
    :func:`vitattn.patch` would (``prr``, ``normalizer``, ``gaug_init`` as there).
    """
    register()
    cls = model_class or _auto_model()
    model = cls.from_pretrained(str(source), local_files_only=local_files_only, **kwargs)
    record = getattr(model.config, RECORD_KEY, None)
    if record:
        apply_record(model, record)
        load_gaug_weights(model, str(source), local_files_only)
    if attention is not None:
        patch_transformers(model, attention, prr=prr, normalizer=normalizer, gaug_init=gaug_init)
    return model


def image_normalization(
    source: str | Path, local_files_only: bool = True
) -> tuple[tuple[float, ...], ...] | None:
    """``(mean, std)`` from the model's image processor config (``preprocessor_config.json``), or None
    when there is none (or it does not normalize)."""
    path = _hub_file(str(source), "preprocessor_config.json", local_files_only)
    if path is None:
        return None
    cfg = json.loads(path.read_text())
    if not cfg.get("do_normalize", True) or "image_mean" not in cfg or "image_std" not in cfg:
        return None
    mean, std = cfg["image_mean"], cfg["image_std"]
    mean = [mean] * 3 if isinstance(mean, (int, float)) else mean
    std = [std] * 3 if isinstance(std, (int, float)) else std
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


@dataclass
class LoadedModel:
    """A model from :func:`load_model`, with what the command line needs: the input normalization
    (``mean``, ``std``), channels and the image size it was built for, and where it came from."""

    model: nn.Module
    mean: tuple[float, ...]
    std: tuple[float, ...]
    in_chans: int
    image_size: tuple[int, int]
    source: dict[str, Any] = field(default_factory=dict)


def _missing_message(spec: str, source: str, err: Exception) -> str:
    folder = Path(source)
    if folder.exists():
        if not folder.is_dir():
            return f"{spec}: {source!r} is a file; give the folder that holds config.json and the weights"
        present = sorted(p.name for p in folder.iterdir())
        lacks = [f for f in ("config.json",) if f not in present]
        if not any(p.endswith((".safetensors", ".bin")) or p.endswith(".index.json") for p in present):
            lacks.append("model.safetensors")
        what = f"it lacks {', '.join(lacks)}" if lacks else f"transformers could not load it ({err})"
        return f"{spec}: the folder {source!r} is not a saved transformers model: {what}"
    if source.startswith((".", "/", "~")) or "\\" in source:
        return f"{spec}: there is no folder {source!r} (give the folder that save_pretrained wrote)"
    try:
        from huggingface_hub.constants import HF_HUB_CACHE as cache
    except ImportError:  # pragma: no cover
        cache = "the Hugging Face cache"
    return (
        f"{spec}: no folder {source!r} here and no copy of the model {source!r} in {cache}; vitattn loads "
        f"offline only: download it first (e.g. `hf download {source}`) or give a local folder "
        f"(transformers said: {err})"
    )


def load_model(spec: str) -> LoadedModel:
    """The model of ``hf:<model id or local folder>``, offline, with its normalization.

    A local folder (``save_pretrained`` output) or a model already in the Hugging Face cache; nothing
    is downloaded (``local_files_only``), so a missing model fails at once with a ``FileNotFoundError``
    naming what is missing. A vitattn patch recorded in the config is rebuilt
    (:func:`from_pretrained`). Mean and std come from ``preprocessor_config.json`` (ImageNet's when
    there is none; ``source["normalization"]`` says which).
    """
    if not spec.startswith(HF_PREFIX) or len(spec) == len(HF_PREFIX):
        raise ValueError(f"expected hf:<model id or folder>, got {spec!r}")
    source = spec[len(HF_PREFIX) :]
    try:
        model = from_pretrained(source, local_files_only=True)
    except OSError as err:
        raise FileNotFoundError(_missing_message(spec, source, err)) from err
    except ValueError as err:
        if Path(source).is_dir() or "Unrecognized" in str(err):
            raise FileNotFoundError(_missing_message(spec, source, err)) from err
        raise
    layout = hf_layout(model)
    norm = image_normalization(source)
    mean, std = norm if norm is not None else _IMAGENET
    info = dict(
        kind="hf",
        name=source,
        family=layout.family.name,
        normalization="preprocessor_config.json"
        if norm is not None
        else "ImageNet default (no image processor config)",
    )
    return LoadedModel(model.eval(), mean, std, layout.in_channels(), layout.image_size, info)
