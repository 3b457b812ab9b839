"""The attention kinds, each stated once: what ``vitattn.patch(attention=...)``, the study's
``attentions`` and the CLI's ``--attention`` name.

A kind is a bias / window arrangement (``bias``: none, LocAt's Gaussian bias, a neighbourhood window)
and, for some, the normalizer it implies (``softmax`` and ``entmax15`` name both an unbiased layer and
its normalizer; ``adaptive`` is unbiased attention with one learnable alpha per head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ATTENTION_KINDS",
    "HF_PATCH_ATTENTIONS",
    "PATCH_ATTENTIONS",
    "STUDY_ATTENTIONS",
    "AttentionKind",
    "BiasKind",
    "implied_normalizer",
]

#: what a kind adds to the scores: nothing, LocAt's Gaussian bias, or a neighbourhood window
BiasKind = Literal["none", "locat", "window"]


@dataclass(frozen=True)
class AttentionKind:
    """One attention kind.

    Args:
        name: its name (``"softmax"``, ``"entmax15"``, ``"locat"``, ``"window"``, ``"adaptive"``).
        bias: what it adds to the scores (:data:`BiasKind`).
        normalizer: the normalizer it implies (None: the layer's own, or the call's).
        patch: whether ``vitattn.patch(attention=name)`` takes it (``"adaptive"`` is
            ``normalizer="adaptive"`` there).
        transformers: whether it applies to transformers models too (no neighbourhood window there).
    """

    name: str
    bias: BiasKind
    normalizer: str | None = None
    patch: bool = True
    transformers: bool = True


ATTENTION_KINDS: dict[str, AttentionKind] = {
    kind.name: kind
    for kind in (
        AttentionKind("softmax", "none", "softmax"),
        AttentionKind("entmax15", "none", "entmax15"),
        AttentionKind("locat", "locat"),
        AttentionKind("adaptive", "none", "adaptive", patch=False, transformers=False),
        AttentionKind("window", "window", transformers=False),
    )
}

#: the kinds a study compares (its ``attentions``)
STUDY_ATTENTIONS: tuple[str, ...] = tuple(ATTENTION_KINDS)
#: the ``attention=`` names of ``vitattn.patch``
PATCH_ATTENTIONS: tuple[str, ...] = tuple(name for name, kind in ATTENTION_KINDS.items() if kind.patch)
#: the ``attention=`` names of ``vitattn.patch`` on a transformers model
HF_PATCH_ATTENTIONS: tuple[str, ...] = tuple(
    name for name, kind in ATTENTION_KINDS.items() if kind.patch and kind.transformers
)


def implied_normalizer(attention: str | None) -> str | None:
    """The normalizer an attention kind implies (``"softmax"``, ``"entmax15"``, ``"adaptive"``), else
    None (``"locat"``, ``"window"``, ``None`` or an unknown name: the layer's own)."""
    kind = ATTENTION_KINDS.get(attention or "")
    return None if kind is None else kind.normalizer
