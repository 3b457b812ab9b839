"""Row normalizers of the attention pipeline, each stated once: softmax, entmax-1.5, sparsemax (and any
registered with :func:`register_normalizer`), and alpha-entmax (a fixed alpha, or a tensor of them: one
per head, learnable).

A :class:`NormalizerSpec` says everything vitattn needs of a normalizer: its name, its alpha, the
function, the entropy of its Fenchel–Young loss, its transformers ``attn_implementation`` name and the
FX node name of its weights on the layers' explicit path. Every other module reads them from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ._checks import check_broadcastable, shape_str
from .entmax15 import entmax15
from .entmax_alpha import entmax, sparsemax
from .entropies import shannon_entropy, softmax_fy_loss, tsallis_entropy

__all__ = [
    "ALPHA_FX_NAME",
    "ALPHA_HF_PREFIX",
    "AttentionNormalizer",
    "Normalizer",
    "NormalizerName",
    "NormalizerSpec",
    "alpha_tensor",
    "normalize",
    "normalizer_names",
    "normalizer_spec",
    "normalizer_table",
    "register_normalizer",
    "resolve_normalizer",
    "softmax_zero_dead_rows",
    "unregister_normalizer",
]

NormalizerName = str  # a registered normalizer's name: "softmax", "entmax15", "sparsemax", ...
Normalizer = NormalizerName | float
# what attention() takes: a fixed normalizer, or alpha-entmax with a tensor of alphas (e.g. one per head)
AttentionNormalizer = Normalizer | torch.Tensor

#: alpha-entmax with a float alpha (or a tensor of them): its FX node name, and the prefix of its
#: transformers name (``vitattn_entmax_<alpha>``)
ALPHA_FX_NAME = "entmax"
ALPHA_HF_PREFIX = "vitattn_entmax_"
_HF_PREFIX = "vitattn_"
_RESERVED = ("adaptive",)  # the layers' learned alphas (vitattn.layers.AdaptiveAlpha)


@dataclass(frozen=True)
class NormalizerSpec:
    """One normalizer, everything vitattn reads of it.

    Args:
        name: what ``normalizer=`` takes (an identifier).
        alpha: its alpha-entmax alpha (softmax 1, entmax-1.5 1.5, sparsemax 2): what a layer's
            ``head_alphas()`` reports.
        function: ``(scores, dim, masked) -> probabilities`` along ``dim``, the shape and dtype of
            ``scores``; rows entirely ``-inf`` give zeros (``masked=False`` promises there are none).
        entropy: ``(p, dim) -> H(p)``, the entropy the normalizer regularizes with
            (``ŷ(z) = argmax ⟨z, p⟩ + H(p)``): :func:`~vitattn.functional.fy_loss` is stated by it.
        hf_name: its transformers ``attn_implementation`` name (default ``"vitattn_<name>"``).
        fx_name: the FX node name of its weights on the layers' explicit path (default ``name``):
            ``timm.utils.AttentionExtract(method="fx")`` finds them as ``*attn.<fx_name>``.
        alpha_alias: a float normalizer equal to ``alpha`` means this one (``1.5`` -> ``"entmax15"``).
        fy_loss: a closed form of the loss per row, ``(live scores, target, masked, dim) -> loss``, in
            place of ``⟨ŷ − y, z⟩ + H(ŷ) − H(y)`` (softmax's, :func:`~.entropies.softmax_fy_loss`).
    """

    name: str
    alpha: float
    function: Callable[[torch.Tensor, int, bool], torch.Tensor]
    entropy: Callable[[torch.Tensor, int], torch.Tensor]
    hf_name: str = ""
    fx_name: str = ""
    alpha_alias: bool = False
    fy_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None = field(
        default=None, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_name", self.hf_name or _HF_PREFIX + str(self.name))
        object.__setattr__(self, "fx_name", self.fx_name or str(self.name))


def softmax_zero_dead_rows(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that returns zeros (and zero gradients) for rows whose scores are all ``-inf``."""
    dead = torch.isneginf(scores).all(dim, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=dim)
    return probs.masked_fill(dead, 0.0)


def _softmax(scores: torch.Tensor, dim: int, masked: bool) -> torch.Tensor:
    return softmax_zero_dead_rows(scores, dim) if masked else torch.softmax(scores, dim=dim)


def _entmax15(scores: torch.Tensor, dim: int, masked: bool) -> torch.Tensor:
    return entmax15(scores, dim=dim)


def _sparsemax(scores: torch.Tensor, dim: int, masked: bool) -> torch.Tensor:
    return sparsemax(scores, dim=dim)


_BUILTIN = (
    NormalizerSpec("softmax", 1.0, _softmax, shannon_entropy, fy_loss=softmax_fy_loss),
    NormalizerSpec("entmax15", 1.5, _entmax15, tsallis_entropy(1.5), alpha_alias=True),
    NormalizerSpec("sparsemax", 2.0, _sparsemax, tsallis_entropy(2.0), alpha_alias=True),
)
_REGISTRY: dict[str, NormalizerSpec] = {spec.name: spec for spec in _BUILTIN}


def _check_spec(spec: NormalizerSpec) -> None:
    """``ValueError`` / ``TypeError`` naming the field of a spec that cannot join the registry."""
    if not isinstance(spec, NormalizerSpec):
        raise TypeError(f"spec must be a NormalizerSpec, got {type(spec).__name__}")
    if not isinstance(spec.name, str) or not spec.name.isidentifier() or spec.name in _RESERVED:
        raise ValueError(
            f"a normalizer's name must be an identifier other than {_RESERVED}, got {spec.name!r}"
        )
    if spec.name in _REGISTRY:
        raise ValueError(f"normalizer {spec.name!r} is registered already (unregister_normalizer it first)")
    if not callable(spec.function) or not callable(spec.entropy):
        raise TypeError(f"normalizer {spec.name!r}: function and entropy must be callables")
    if isinstance(spec.alpha, bool) or not isinstance(spec.alpha, (int, float)) or not spec.alpha >= 1.0:
        raise ValueError(f"normalizer {spec.name!r}: alpha must be a float >= 1, got {spec.alpha!r}")
    if spec.alpha_alias and (not 1.0 < spec.alpha < math.inf or _alias_of(float(spec.alpha)) is not None):
        raise ValueError(
            f"normalizer {spec.name!r}: alpha_alias needs a finite alpha > 1 that no other normalizer "
            f"claims, got alpha={spec.alpha!r}"
        )
    hf_name, taken_hf = spec.hf_name, {s.hf_name for s in _REGISTRY.values()}
    if not hf_name.startswith(_HF_PREFIX) or hf_name.startswith(ALPHA_HF_PREFIX) or hf_name in taken_hf:
        raise ValueError(
            f"normalizer {spec.name!r}: hf_name must start with {_HF_PREFIX!r}, not with {ALPHA_HF_PREFIX!r} "
            f"(alpha-entmax's), and be no other normalizer's; got {spec.hf_name!r}"
        )
    taken_fx = {s.fx_name for s in _REGISTRY.values()} | {ALPHA_FX_NAME}
    if not spec.fx_name.isidentifier() or spec.fx_name in taken_fx:
        raise ValueError(
            f"normalizer {spec.name!r}: fx_name must be an identifier that no other normalizer uses "
            f"(nor {ALPHA_FX_NAME!r}, alpha-entmax's), got {spec.fx_name!r}"
        )


def register_normalizer(spec: NormalizerSpec) -> NormalizerSpec:
    """Add a normalizer: ``normalizer=spec.name`` then works everywhere (``attention``, the layers,
    ``vitattn.patch``, transformers models through ``vitattn.hf.attention_name``, ``fy_loss``, the
    explicit path's FX node). Returns ``spec``; ``ValueError`` when a name is taken (see
    :class:`NormalizerSpec`)."""
    _check_spec(spec)
    _REGISTRY[spec.name] = spec
    return spec


def unregister_normalizer(name: str) -> None:
    """Remove a normalizer added by :func:`register_normalizer` (the built-in ones stay)."""
    if any(spec.name == name for spec in _BUILTIN):
        raise ValueError(f"{name!r} is a built-in normalizer; it cannot be unregistered")
    if name not in _REGISTRY:
        raise ValueError(f"no normalizer {name!r} is registered; registered: {normalizer_names()}")
    del _REGISTRY[name]


def normalizer_names() -> tuple[str, ...]:
    """The registered normalizers' names, built-in first: ``("softmax", "entmax15", "sparsemax", ...)``."""
    return tuple(_REGISTRY)


def _alias_of(alpha: float) -> str | None:
    """The registered normalizer a float ``alpha`` means (``1.5``: ``"entmax15"``), if any."""
    for spec in _REGISTRY.values():
        if spec.alpha_alias and spec.alpha == alpha:
            return spec.name
    return None


def resolve_normalizer(normalizer: Normalizer) -> Normalizer:
    """Canonical form: a registered name (``"softmax"``, ``"entmax15"``, ``"sparsemax"``, ...) or a float
    alpha that no registered normalizer claims (not 1.5 or 2).

    Raises ``ValueError`` for unknown names and for alpha <= 1 (alpha = 1 would be softmax: say so).
    """
    names = normalizer_names()
    if isinstance(normalizer, str):
        if normalizer in _REGISTRY:
            return normalizer
        raise ValueError(f"normalizer must be one of {names} or a float alpha > 1, got {normalizer!r}")
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise ValueError(
            f"normalizer must be one of {names} or a float alpha > 1, got {type(normalizer).__name__}"
        )
    alpha = float(normalizer)
    if not alpha > 1.0:
        raise ValueError(f"normalizer alpha must be > 1 (use normalizer='softmax' for alpha=1), got {alpha}")
    alias = _alias_of(alpha)
    return alpha if alias is None else alias


def normalizer_spec(normalizer: Normalizer) -> NormalizerSpec:
    """The :class:`NormalizerSpec` of a normalizer (resolved first): a registered one's, or for a float
    alpha, alpha-entmax's (named ``"<alpha>"``, FX node :data:`ALPHA_FX_NAME`, transformers name
    ``vitattn_entmax_<alpha>``, Tsallis' entropy)."""
    kind = resolve_normalizer(normalizer)
    if isinstance(kind, str):
        return _REGISTRY[kind]
    alpha = float(kind)

    def function(scores: torch.Tensor, dim: int, masked: bool) -> torch.Tensor:
        return entmax(scores, alpha=alpha, dim=dim)

    text = repr(alpha)
    entropy = tsallis_entropy(alpha)
    return NormalizerSpec(text, alpha, function, entropy, ALPHA_HF_PREFIX + text, ALPHA_FX_NAME)


class _Table(Mapping[str, str]):
    """A live, read-only ``{normalizer name: one field of its spec}`` over the registry."""

    def __init__(self, field_name: str) -> None:
        self._field = field_name

    def __getitem__(self, name: str) -> str:
        return str(getattr(_REGISTRY[name], self._field))

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


def normalizer_table(field_name: str) -> Mapping[str, str]:
    """``{name: spec.<field_name>}`` of every registered normalizer, kept up to date as normalizers are
    registered (e.g. ``normalizer_table("hf_name")["softmax"] == "vitattn_softmax"``)."""
    if field_name not in ("hf_name", "fx_name"):
        raise ValueError(f"field_name must be 'hf_name' or 'fx_name', got {field_name!r}")
    return _Table(field_name)


def alpha_tensor(alpha: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A tensor normalizer (alpha-entmax with a tensor of alphas) as a 4-D tensor for ``(B, H, Nq, Nk)``
    scores of ``shape``: ``()`` is one alpha, ``(H,)`` (or ``(1,)``) one per head, read as
    ``(1, H, 1, 1)``; a 4-D tensor must broadcast to ``(B, H, Nq, 1)`` (one alpha per batch entry, head
    or query row). Floating-point; its values (> 1) are checked by :func:`~vitattn.functional.entmax`.
    ``ValueError`` / ``TypeError`` naming ``normalizer`` and the shapes otherwise."""
    if not alpha.is_floating_point():
        raise TypeError(f"a tensor normalizer (alpha) must be floating-point, got dtype {alpha.dtype}")
    b, h, nq, _ = shape
    if alpha.dim() == 0:
        return alpha.view(1, 1, 1, 1)
    if alpha.dim() == 1:
        if alpha.shape[0] not in (1, h):
            raise ValueError(
                f"a 1-D tensor normalizer holds one alpha per head: shape ({h},) for H = {h}, "
                f"got {shape_str(alpha)}"
            )
        return alpha.view(1, -1, 1, 1)
    if alpha.dim() != 4:
        raise ValueError(
            f"a tensor normalizer (alpha) must be 0-D, 1-D (H,) or 4-D broadcastable to (B, H, Nq, 1), "
            f"got shape {shape_str(alpha)}"
        )
    check_broadcastable("normalizer (alpha)", alpha, (b, h, nq, 1), "(B, H, Nq, 1)")
    return alpha


def normalize(
    scores: torch.Tensor, normalizer: AttentionNormalizer, dim: int = -1, *, masked: bool = True
) -> torch.Tensor:
    """Apply ``normalizer`` along ``dim``; ``masked=False`` promises no row is entirely ``-inf``.

    A tensor ``normalizer`` is alpha-entmax with those alphas (broadcastable to ``scores`` with size 1
    along ``dim``; differentiable in them): :func:`~vitattn.functional.entmax`.
    """
    if isinstance(normalizer, torch.Tensor):
        return entmax(scores, alpha=normalizer, dim=dim)
    kind = resolve_normalizer(normalizer)
    if isinstance(kind, str):
        return _REGISTRY[kind].function(scores, dim, masked)
    return entmax(scores, alpha=float(kind), dim=dim)
