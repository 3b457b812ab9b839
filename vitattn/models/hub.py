"""``timm.create_model("hf-hub:sinahmr/locatvit_tiny", pretrained=True)`` for both config styles.

timm's ``hf-hub:`` path reads the repo's ``config.json`` and takes the model to build from its
``architecture`` key (``timm.models._hub._parse_model_cfg``): a timm-style config
``{"architecture": ..., "num_classes": ..., "pretrained_cfg": {...}}`` works as soon as the
architecture is registered (``import vitattn``). The official ``LocAtViT`` class is also a
``huggingface_hub.PyTorchModelHubMixin``, whose ``save_pretrained`` / ``push_to_hub`` write a config
of plain constructor arguments (``{"patch_size": 16, "embed_dim": 192, ...}``) with no
``architecture``, on which timm fails with ``KeyError: 'architecture'``.

:func:`install` (explicit, never on import; or :func:`mixin_configs` around a block) wraps that
parser: a config with neither ``architecture`` nor
``pretrained_cfg`` that describes a LocAtViT (a ``sinahmr/locatvit_*`` repo, or constructor
arguments matching a registered variant) is rewritten into the timm form first. Any other config goes
to timm unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .locatvit import _ARCHS, HUB_WEIGHTS, _cfg

__all__ = ["install", "installed", "mixin_config_to_timm", "mixin_configs", "uninstall"]

# VisionTransformer's defaults for the arguments that tell the variants apart
_VIT_DEFAULTS = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
# official constructor arguments that vitattn's LocAtViT spells differently or does not take
_DROPPED = ("store_metrics",)  # the official class's training statistics; nothing to build


def _architecture(cfg: dict[str, Any], hub_id: str | None) -> str | None:
    repo = (hub_id or "").split("@")[0]
    for name, repo_id in HUB_WEIGHTS.items():
        if repo == repo_id:
            return name
    if repo and not repo.startswith("sinahmr/"):
        # another repo: only a config that spells out a registered variant's shape is taken
        if not all(k in cfg for k in _VIT_DEFAULTS):
            return None
    for name, arch in _ARCHS.items():
        if all(cfg.get(k, _VIT_DEFAULTS[k]) == v for k, v in arch.items()):
            return name
    return None


def mixin_config_to_timm(cfg: dict[str, Any], hub_id: str | None = None) -> dict[str, Any] | None:
    """A ``PyTorchModelHubMixin`` config of LocAtViT constructor arguments in timm's form, or ``None``
    when it does not describe a LocAtViT variant.

    The returned dict has ``architecture``, ``num_classes``, ``model_args`` (the constructor
    arguments, which timm passes on to the model) and ``pretrained_cfg`` (the release's ImageNet
    preprocessing, :func:`vitattn.models.locatvit._cfg`).
    """
    arch = _architecture(cfg, hub_id)
    if arch is None:
        return None
    model_args = {k: v for k, v in cfg.items() if k not in _DROPPED}
    if model_args.pop("no_pos_emb", False):
        model_args["pos_embed"] = "none"
    num_classes = int(model_args.get("num_classes", 1000))
    pretrained_cfg = _cfg(num_classes=num_classes)
    pretrained_cfg.update(architecture=arch, hf_hub_id=HUB_WEIGHTS.get(arch, hub_id))
    return {
        "architecture": arch,
        "num_classes": num_classes,
        "model_args": model_args,
        "pretrained_cfg": pretrained_cfg,
    }


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (timm's hub config parser) taking the mixin style too."""

    @functools.wraps(original)
    def parse(cfg: dict[str, Any], extra_fields: dict[str, Any]) -> Any:
        if isinstance(cfg, dict) and "pretrained_cfg" not in cfg and "architecture" not in cfg:
            converted = mixin_config_to_timm(cfg, extra_fields.get("hf_hub_id"))
            if converted is not None:
                cfg = converted
        return original(cfg, extra_fields)

    parse._vitattn_original = original  # type: ignore[attr-defined]
    return parse


def installed() -> bool:
    """Whether :func:`install` is in effect (timm's ``hf-hub:`` loader reads mixin-style configs)."""
    from timm.models import _hub

    return hasattr(_hub._parse_model_cfg, "_vitattn_original")


def install() -> None:
    """Let timm's ``hf-hub:`` loader read the official release's mixin-style ``config.json`` too.

    Explicit and process-wide (``import vitattn`` does not do it): wraps timm's hub config parser
    (``timm.models._hub._parse_model_cfg``, a private function of timm) so that a config describing a
    LocAtViT in constructor arguments is rewritten to timm's form first (:func:`mixin_config_to_timm`);
    every other config reaches timm unchanged. Idempotent; :func:`uninstall` undoes it, and
    :func:`mixin_configs` does both around a block.
    """
    from timm.models import _hub

    if not installed():
        _hub._parse_model_cfg = _wrap(_hub._parse_model_cfg)


def uninstall() -> None:
    """Undo :func:`install` (a no-op when it is not in effect)."""
    from timm.models import _hub

    if installed():
        _hub._parse_model_cfg = _hub._parse_model_cfg._vitattn_original  # type: ignore[attr-defined]


@contextlib.contextmanager
def mixin_configs() -> Iterator[None]:
    """Within the block, timm's ``hf-hub:`` loader reads mixin-style configs (:func:`install`); on
    exit the parser is as it was before."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
