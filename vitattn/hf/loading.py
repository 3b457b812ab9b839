"""Load transformers vision models for vitattn: patched models back from their files, and
``hf:<model id or folder>`` specs for the command line, offline only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..functional.normalize import Normalizer
from ..layers.locat import GaugInit
from .functions import register
from .layout import hf_layout
from .patching import RECORD_KEY, apply_record, patch_transformers, vitattn_names

__all__ = [
    "HF_PREFIX",
    "LoadedModel",
    "from_pretrained",
    "image_normalization",
    "load_gaug_weights",
    "load_model",
    "patching_class",
    "saved_model_class",
]

HF_PREFIX = "hf:"
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the hf extra is installed in the tests
        raise ImportError('loading transformers models needs the extra: pip install "vitattn[hf]"') from err
    return transformers


def _mapped_names(model_type: str) -> set[str]:
    """Every class name transformers' Auto mappings (``AutoModel``, ``AutoModelForImageClassification``,
    ...) list for ``model_type``."""
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            found = mapping.get(model_type)
            names.update([found] if isinstance(found, str) else found or ())
    return names


def saved_model_class(config: Any) -> type:
    """The transformers class a model with this config was saved as: the first of
    ``config.architectures`` that transformers' Auto mappings list for its ``model_type`` (or, as
    transformers' pipelines resolve it, a model class of that name for this config class); the class
    ``AutoModel`` picks when there is none (no ``architectures``, or custom code)."""
    transformers = _transformers()
    mapped = _mapped_names(str(getattr(config, "model_type", "")))
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            continue
        if arch in mapped or isinstance(config, getattr(cls, "config_class", ()) or ()):
            return cls
    return _concrete_class(transformers.AutoModel, config)


def _concrete_class(cls: Any, config: Any) -> type:
    """``cls`` itself, or for an Auto class (``AutoModel``, ...) the class it picks for ``config``
    (the architecture the config names among several, as transformers picks it)."""
    transformers = _transformers()
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return cls
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None or type(config) not in mapping:
        raise TypeError(
            f"model_class must be a transformers model class or an Auto class that maps "
            f"{type(config).__name__}, got {cls!r}"
        )
    found = mapping[type(config)]
    if not isinstance(found, (tuple, list)):
        return cast(type, found)
    by_name = {c.__name__: c for c in found}
    named = [by_name[a] for a in getattr(config, "architectures", None) or () if a in by_name]
    return cast(type, (named or list(found))[0])


_PATCHING_CLASSES: dict[type, type] = {}


def patching_class(cls: type) -> type:
    """``cls`` whose ``__init__`` then applies the ``config.vitattn`` record, so that
    ``from_pretrained`` builds the patched model before it loads the weights: the GAug tensors are
    then expected keys (loaded, or started by the model's weight init when the checkpoint lacks
    them; never reported as unexpected). The loaded model's class is set back to ``cls``."""
    sub = _PATCHING_CLASSES.get(cls)
    if sub is None:
        base: Any = cls

        def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, config, *args, **kwargs)
            record = getattr(self.config, RECORD_KEY, None)
            if record:
                apply_record(self, record)

        namespace = {"__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        sub = type(cls.__name__, (cls,), namespace)
        _PATCHING_CLASSES[cls] = sub
    return sub


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


def _gaug_tensors(model: nn.Module) -> dict[tuple[int, str], tuple[str, torch.Tensor]]:
    """``(layer index, name under gaug) -> (qualified name, tensor)`` of the model's GAug tensors."""
    layout = hf_layout(model)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    out: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for i, name in enumerate(layout.attention_names):
        for key, value in tensors.items():
            if key.startswith(f"{name}.gaug."):
                out[(i, key[len(name) + len(".gaug.") :])] = (key, value)
    return out


def _read_gaug(
    source: str, local_files_only: bool, slots: set[tuple[int, str]]
) -> dict[tuple[int, str], tuple[str, torch.Tensor]]:
    """The tensors of ``slots`` (layer index, name under gaug) in the safetensors of ``source``, with
    their key there."""
    from safetensors import safe_open

    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for path in _weight_files(source, local_files_only):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                slot = _gaug_slot(key)
                if slot in slots:
                    found[slot] = (key, f.get_tensor(key))
    return found


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def load_gaug_weights(model: nn.Module, source: str | Path, local_files_only: bool = True) -> nn.Module:
    """Read the GAug tensors of a saved model (a folder or a Hub id, its safetensors) into ``model``,
    which was patched with ``attention="locat"`` the same way (patch, then load). Matched by layer
    index, so the key names transformers writes in another version still fit. Raises ``ValueError``
    naming the GAug tensors the files lack."""
    layout = hf_layout(model)
    wanted = _gaug_tensors(model)
    if not wanted:
        return model
    found = _read_gaug(str(source), local_files_only, set(wanted))
    missing = sorted(set(wanted) - set(found))
    if missing:
        names = [f"{layout.attention_names[i]}.gaug.{tail}" for i, tail in missing]
        raise ValueError(
            f"{str(source)!r} holds no weights for {len(missing)} GAug tensors of the patched model, "
            f"e.g. {names[:3]}: was it saved from a model patched with attention='locat' on these layers?"
        )
    for slot, (_, value) in found.items():
        _copy_into(wanted[slot][1], value)
    return model


def _complete_gaug(model: nn.Module, source: str, local_files_only: bool, info: dict[str, Any]) -> None:
    """GAug heads with a tensor transformers did not find under its own name (a checkpoint written by
    another transformers version, whose module paths differ): every tensor of those heads read from
    the files by layer index, where they hold it; the loading info updated to match. What the files
    do not hold keeps the start the model's weight init gave it."""
    tensors = _gaug_tensors(model)
    missing = set(info.get("missing_keys") or ())
    layers = {i for (i, _), (key, _) in tensors.items() if key in missing}
    if not layers:
        return
    found = _read_gaug(source, local_files_only, {slot for slot in tensors if slot[0] in layers})
    for slot, (_, value) in found.items():
        _copy_into(tensors[slot][1], value)
    filled = {tensors[slot][0] for slot in found}
    read = {key for key, _ in found.values()}
    for field_name, drop in (("missing_keys", filled), ("unexpected_keys", read)):
        keys = info.get(field_name)
        if keys is not None:
            info[field_name] = type(keys)(k for k in keys if k not in drop)


_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "proxies",
    "revision",
    "subfolder",
    "token",
    "trust_remote_code",
)


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
) -> Any:
    """A transformers vision model with vitattn's patch rebuilt, weights included.

    The class is the one the folder was saved as (``config.architectures``, through transformers'
    Auto mappings: a ``ViTForImageClassification`` loads with its classifier), else ``model_class``
    when given. If the config holds a ``vitattn`` record (what :func:`vitattn.patch` did before
    ``save_pretrained``), the model is patched the same way as it is built, before transformers loads
    the weights: GAug tensors load as the model's own (none reported unexpected), and ones the
    checkpoint lacks start as the patch started them (the model's weight init). With ``attention``
    (``"softmax"``, ``"entmax15"``, ``"locat"``), the loaded model is then patched as
    :func:`vitattn.patch` would (``prr``, ``normalizer``, ``gaug_init`` as there). Other ``kwargs`` go
    to transformers' ``from_pretrained`` (``output_loading_info=True`` returns ``(model, info)`` as
    there); a vitattn ``attn_implementation`` name is registered first, and on a patched model it
    changes the normalizer only (:class:`~vitattn.hf.patching.ImplementationSetter`).

    Raises ``ValueError`` when ``attn_implementation`` is a name that would drop the recorded patch.
    """
    register()
    transformers = _transformers()
    source = str(source)
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, Path)):
        config = transformers.AutoConfig.from_pretrained(
            str(config or source), local_files_only=local_files_only, **hub
        )
    cls = saved_model_class(config) if model_class is None else _concrete_class(model_class, config)
    record = getattr(config, RECORD_KEY, None)
    requested = kwargs.get("attn_implementation")
    register(*vitattn_names(requested))  # on demand: vitattn_entmax_<alpha> needs no attention_name first
    wants_info = bool(kwargs.pop("output_loading_info", False))
    loader: Any = patching_class(cls) if record else cls
    model, info = loader.from_pretrained(
        source, local_files_only=local_files_only, output_loading_info=True, **kwargs
    )
    if record:
        model.__class__ = cls
        _complete_gaug(model, source, local_files_only, info)
    if record and requested is not None:  # the record's patch set "vitattn": the request now, kept or refused
        model.set_attn_implementation(requested)
    if attention is not None:
        patch_transformers(model, attention, prr=prr, normalizer=normalizer, gaug_init=gaug_init)
    return (model, info) if wants_info else model


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
