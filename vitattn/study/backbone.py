"""Backbones of fine-tuning runs: a timm model (or the study's ViT) from its weights, then patched.

A run that starts from weights (``--model NAME`` with ``--pretrained``, or ``--checkpoint PATH``)
builds the backbone with softmax attention, loads the weights, and only then swaps the attention with
:func:`vitattn.patch` (:func:`vitattn.study.model.patch_backbone`: ``entmax15``, ``locat`` with its
``gaug_init`` start, ``prr``), so that the weights land in the layers they were trained in. A
checkpoint of an already patched model (its ``gaug.*`` heads included) loads as well: the patched
model is built first and the heads the checkpoint lacks keep the start ``gaug_init`` gave them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..analysis.checkpoint import read_state_dict

__all__ = [
    "CheckpointMismatch",
    "LoadReport",
    "classifier_keys",
    "create_timm_model",
    "fit_weights",
    "load_weights",
    "read_weights",
]


class CheckpointMismatch(ValueError):
    """A checkpoint whose keys or shapes do not fit the model (the message names the first ones)."""


@dataclass
class LoadReport:
    """What :func:`load_weights` did: keys left at their start (``kept``), a re-initialised head."""

    path: str
    kept: list[str] = field(default_factory=list)
    head_reinitialised: str | None = None

    def notes(self) -> list[str]:
        """Lines for the run's log."""
        out = []
        if self.head_reinitialised:
            out.append(self.head_reinitialised)
        if self.kept:
            out.append(
                f"{len(self.kept)} parameter(s) not in {self.path!r} keep their start "
                f"(the patched attention's new heads): {', '.join(self.kept[:4])}"
                + (" ..." if len(self.kept) > 4 else "")
            )
        return out


def create_timm_model(
    name: str,
    *,
    num_classes: int,
    img_size: int | None,
    in_chans: int,
    drop_path: float,
    pretrained: bool,
    model_args: dict[str, Any] | None = None,
) -> nn.Module:
    """``timm.create_model(name, ...)`` with the run's classes, image size, channels and drop path.

    ``pretrained=True`` uses timm's loader (the Hugging Face Hub cache, or a local file given with
    ``model_args={"pretrained_cfg_overlay": {"file": PATH}}``); timm re-initialises a head of
    another size. vitattn's ``locatvit_*`` names are registered with timm. Raises ``ValueError``
    for a name timm does not know.
    """
    import timm

    from .. import models as _models  # noqa: F401  (registers locatvit_* with timm)

    kwargs: dict[str, Any] = dict(num_classes=num_classes, in_chans=in_chans, drop_path_rate=drop_path)
    if img_size is not None:
        kwargs["img_size"] = img_size
    kwargs.update(model_args or {})
    if not timm.is_model(name):
        raise ValueError(f"unknown model {name!r}: give a timm model name (see timm.list_models())")
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except TypeError as err:  # a family without img_size / drop_path_rate
        raise ValueError(f"timm cannot build {name!r} with {sorted(kwargs)}: {err}") from err


def classifier_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the model's classifier (``model.get_classifier()``, e.g. ``head.weight``)."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return []
    ids = {id(p) for p in head.parameters()}
    return [k for k, p in model.named_parameters() if id(p) in ids]


def fit_weights(
    model: nn.Module, state: dict[str, torch.Tensor], new_keys: set[str], path: str | Path
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """What of ``state`` (the tensors of the checkpoint ``path``) :func:`load_weights` loads into
    ``model``, and its report; raises :class:`CheckpointMismatch` when the checkpoint does not fit.
    Reads shapes only: ``model`` may live on the meta device (the study checks its checkpoints so,
    before it writes anything)."""
    report = LoadReport(str(path))
    own = model.state_dict()
    head = set(classifier_keys(model))
    dropped = [k for k in head if k in state and state[k].shape != own[k].shape]
    if dropped:
        shapes = ", ".join(f"{k} {tuple(state[k].shape)} -> {tuple(own[k].shape)}" for k in sorted(dropped))
        report.head_reinitialised = (
            f"head re-initialised: the checkpoint's classifier has another size ({shapes})"
        )
        state = {k: v for k, v in state.items() if k not in head}
    wrong = [k for k, v in state.items() if k in own and v.shape != own[k].shape]
    if wrong:
        k = wrong[0]
        raise CheckpointMismatch(
            f"checkpoint {str(path)!r} does not fit {type(model).__name__}: {len(wrong)} tensor(s) of "
            f"another shape, first {k!r}: {tuple(state[k].shape)} in the checkpoint, "
            f"{tuple(own[k].shape)} in the model"
        )
    allowed = new_keys | (head if dropped else set())
    missing = [k for k in own if k not in state and k not in allowed]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointMismatch(
            f"checkpoint {str(path)!r} does not fit {type(model).__name__}: {len(missing)} missing key(s) "
            f"{missing[:5]}, {len(unexpected)} unexpected key(s) {unexpected[:5]} (check --model, "
            "--model-arg, --depth / --dim / --heads and --prr)"
        )
    report.kept = sorted(k for k in new_keys if k not in state)
    return state, report


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """:func:`vitattn.analysis.read_state_dict` of ``path``; an unreadable file is a
    :class:`CheckpointMismatch` (``FileNotFoundError`` when it does not exist)."""
    try:
        return read_state_dict(path)
    except ValueError as err:
        raise CheckpointMismatch(str(err)) from err


def load_weights(
    model: nn.Module, path: str | Path, new_keys: set[str], log: Callable[[str], object] | None = None
) -> LoadReport:
    """Load the weights in ``path`` (safetensors, or a weights-only torch state dict) into ``model``.

    ``new_keys``: parameters the checkpoint may lack (those a patch added). A classifier whose shape
    differs from the checkpoint's is left at its fresh init (a note says so). Raises
    :class:`CheckpointMismatch` naming the first missing and unexpected keys, or the first shape
    that differs, when the checkpoint does not fit otherwise (:func:`fit_weights`).
    """
    state, report = fit_weights(model, read_weights(path), new_keys, path)
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
    if log is not None:
        for line in report.notes():
            log(line)
    return report
