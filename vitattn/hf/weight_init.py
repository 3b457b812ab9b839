"""GAug heads through a transformers model's own weight init.

transformers starts the parameters a checkpoint lacks (``from_pretrained``: the model is built on the
meta device, loaded, then ``initialize_weights`` runs) module by module: children first, each module
through the ``_init_weights`` of the nearest transformers model above it (a sub-model such as
DINOv2's encoder uses its own). The model classes do not know the GAug heads :func:`vitattn.patch`
adds, so each transformers model above a patched attention module gets :class:`InitWeightsWithGaug`
as its ``_init_weights``: the class's own, then, for a :class:`~vitattn.layers.GaussianAugment`, the
module's own ``init_weights(start)``, which covers every parameter the module has. Tensors that
transformers marks as loaded (``_is_hf_initialized``) keep their values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain

import torch
from torch import nn

from ..layers import GaussianAugment
from ..layers.locat import GaugInit, check_gaug_init

__all__ = ["GAUG_START_ATTR", "InitWeightsWithGaug", "install_gaug_init", "start_gaug"]

#: Attribute of a GaussianAugment made by vitattn.patch on a transformers model: how it started
#: (``"paper"`` or ``"identity"``), so the model's weight init starts it the same way again.
GAUG_START_ATTR = "vitattn_start"
_LOADED = "_is_hf_initialized"  # transformers' mark on a tensor it loaded (or already initialised)


def start_gaug(gaug: GaussianAugment) -> None:
    """Start ``gaug`` as it was started when patched (``gaug.init_weights(start)``), except for the
    tensors transformers marked as loaded, which keep their values."""
    start: GaugInit = check_gaug_init(getattr(gaug, GAUG_START_ATTR, "paper"))
    tensors = dict(chain(gaug.named_parameters(), gaug.named_buffers()))
    loaded = {name: t.detach().clone() for name, t in tensors.items() if getattr(t, _LOADED, False)}
    if tensors and len(loaded) == len(tensors):
        return
    gaug.init_weights(start)
    if loaded:  # init_weights may use plain tensor ops, which transformers does not guard
        now = dict(chain(gaug.named_parameters(), gaug.named_buffers()))
        with torch.no_grad():
            for name, value in loaded.items():
                now[name].copy_(value)


class InitWeightsWithGaug:
    """A transformers model's ``_init_weights(module)`` that also starts GAug heads
    (:func:`start_gaug`); every other module goes to the model's own (a class, not a closure, so a
    patched model deep-copies and pickles)."""

    def __init__(self, owner: nn.Module, inner: Callable[[nn.Module], None] | None = None) -> None:
        self.owner = owner
        self.inner = inner  # an instance-level _init_weights the owner had before, if any

    def __call__(self, module: nn.Module) -> None:
        if self.inner is not None:
            self.inner(module)
        else:
            type(self.owner)._init_weights(self.owner, module)  # type: ignore[attr-defined]
        if isinstance(module, GaussianAugment):
            start_gaug(module)


def _is_pretrained_model(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def install_gaug_init(model: nn.Module, module_names: Iterable[str]) -> None:
    """Give every transformers model on the path from ``model`` to each of ``module_names`` (the
    attention modules holding GAug heads) an :class:`InitWeightsWithGaug` ``_init_weights``; idempotent."""
    seen: set[int] = set()
    for name in module_names:
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            owner = model.get_submodule(".".join(parts[:depth]))
            if id(owner) in seen or not _is_pretrained_model(owner):
                continue
            seen.add(id(owner))
            before = owner.__dict__.get("_init_weights")
            if not isinstance(before, InitWeightsWithGaug):
                owner.__dict__["_init_weights"] = InitWeightsWithGaug(owner, before)
