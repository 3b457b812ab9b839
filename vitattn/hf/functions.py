"""vitattn's attention as transformers ``AttentionInterface`` functions.

transformers (>= 4.51) routes the self-attention of ViT, DeiT, DINOv2 (with and without registers),
ViT-MAE, CLIP and SigLIP through ``fn(module, query, key, value, attention_mask, *, scaling, dropout,
**kwargs) -> (out (B, N, H, D), weights or None)`` with q, k, v ``(B, H, N, D)``, chosen by
``attn_implementation=name``. The functions here call :func:`vitattn.functional.attention` (the
dispatcher picks the backend: Triton on CUDA, the CPU fast paths, SDPA or the reference):

- ``vitattn_softmax``, ``vitattn_entmax15``, ``vitattn_sparsemax``: that normalizer everywhere;
- ``vitattn_entmax_<alpha>`` (e.g. ``vitattn_entmax_1.25``): alpha-entmax, registered by
  :func:`attention_name` (``attention_name(1.25)``) before use;
- ``vitattn``: each attention module as :func:`vitattn.patch` set it up (its normalizer, GAug heads,
  backend); modules it did not touch compute softmax.

Masks: a boolean keep-mask is used as it is; an additive float mask is added, with the entries at
or below half the dtype's lowest value (transformers' "masked") made ``-inf``, so a query whose keys
are all masked gets zero weights and a zero output. With ``is_causal`` (kwarg or module attribute)
and no mask, a causal keep-mask. The weights come back when ``output_attentions`` is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..functional import GaussianBias, attention
from ..functional.normalize import (
    ALPHA_HF_PREFIX,
    Normalizer,
    normalizer_spec,
    normalizer_table,
    resolve_normalizer,
)

__all__ = [
    "ATTENTION_NAMES",
    "PATCHED_NAME",
    "HFAttentionSettings",
    "attention_name",
    "hf_attention",
    "is_vitattn_implementation",
    "normalizer_of_name",
    "register",
]

PATCHED_NAME = "vitattn"
#: ``{normalizer: attn_implementation name}`` of every registered normalizer (a live view of the
#: registry's ``hf_name``: ``"softmax"`` -> ``"vitattn_softmax"``, ...)
ATTENTION_NAMES: Mapping[str, str] = normalizer_table("hf_name")
_ALPHA_PREFIX = ALPHA_HF_PREFIX
SETTINGS_ATTR = "vitattn"  # HFAttentionSettings on an attention module patched by vitattn.patch
RULE_ATTR = "_vitattn_rule"  # a transfer rule on an attention module, while one runs


@dataclass
class HFAttentionSettings:
    """What :func:`vitattn.patch` sets on one transformers attention module (``module.vitattn``).

    ``normalizer`` and ``backend`` of its attention; with GAug (``module.gaug``), the token layout:
    ``num_prefix_tokens``, the current ``grid_size`` (set from each input) and the
    ``initial_grid_size`` that fixes GAug's constants.
    """

    normalizer: Normalizer = "softmax"
    backend: str = "auto"
    num_prefix_tokens: int = 0
    grid_size: tuple[int, int] | None = None
    initial_grid_size: tuple[int, int] | None = None


def attention_name(normalizer: Normalizer) -> str:
    """The registered ``attn_implementation`` name of a normalizer (registering it if needed).

    ``"softmax"`` -> ``"vitattn_softmax"``, ``"entmax15"`` -> ``"vitattn_entmax15"``, ``"sparsemax"`` ->
    ``"vitattn_sparsemax"``, a float alpha > 1 -> ``"vitattn_entmax_<alpha>"`` (``1.25`` ->
    ``"vitattn_entmax_1.25"``; alpha 1.5 and 2 give the entmax-1.5 and sparsemax names); a registered
    normalizer: its spec's ``hf_name``.
    """
    name = normalizer_spec(normalizer).hf_name
    register(name)
    return name


def normalizer_of_name(name: str) -> Normalizer | None:
    """The normalizer of a ``vitattn_*`` name (None for ``"vitattn"`` and for names not vitattn's).

    Raises ``ValueError`` for a ``vitattn_entmax_<alpha>`` whose alpha is not a number > 1.
    """
    for normalizer, known in ATTENTION_NAMES.items():
        if name == known:
            return normalizer
    if name.startswith(_ALPHA_PREFIX):
        text = name[len(_ALPHA_PREFIX) :]
        hint = (
            f"alpha-entmax's name is vitattn.hf.attention_name(alpha), e.g. attention_name(1.25) -> "
            f"'{_ALPHA_PREFIX}1.25' (alpha > 1)"
        )
        try:
            alpha = float(text)
        except ValueError:
            raise ValueError(f"{name!r}: {text!r} after {_ALPHA_PREFIX!r} is not a number; {hint}") from None
        try:
            return resolve_normalizer(alpha)
        except ValueError as err:
            raise ValueError(f"{name!r}: {err}; {hint}") from None
    return None


def is_vitattn_implementation(name: object) -> bool:
    """Whether ``name`` is one of vitattn's attention implementation names."""
    return isinstance(name, str) and (name == PATCHED_NAME or name.startswith("vitattn_"))


def _keep_or_additive(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' mask as :func:`attention` takes it: bool as is; float with "masked" entries at -inf."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.is_floating_point():
        raise TypeError(
            "attention_mask must be a boolean keep-mask or an additive float mask, "
            f"got dtype {attention_mask.dtype}"
        )
    floor = torch.finfo(attention_mask.dtype).min / 2
    return attention_mask.masked_fill(attention_mask <= floor, float("-inf"))


def _causal(
    module: nn.Module, kwargs: dict[str, Any], q: torch.Tensor, k: torch.Tensor
) -> torch.Tensor | None:
    """A causal keep-mask when the call is causal (as transformers' SDPA decides it), else None."""
    flag = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if flag is None else flag)
    nq, nk = q.shape[2], k.shape[2]
    if not causal or nq <= 1:
        return None
    return torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)


_COLLECTOR: list[Any] = []  # transformers 5's output collector (a context variable), found by register()


def _find_collector() -> None:
    """Look transformers' output collector up once (not in the attention call: under torch.compile an
    import there breaks the graph)."""
    if _COLLECTOR:
        return
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # transformers 4.5x
        _COLLECTOR.append(None)
    else:
        _COLLECTOR.append(_active_collector)


def _collecting_attentions(module: nn.Module) -> bool:
    """Whether transformers is collecting this call's attention weights right now.

    transformers 5 keeps the collection in a context variable; transformers 4.5x wraps the attention
    module's ``forward`` (an instance attribute) for the length of the call instead, and passes no
    flag down, so there an instance-level ``forward`` counts as a request (at worst, weights made
    for nothing)."""
    collector = _COLLECTOR[0] if _COLLECTOR else None
    if collector is None:
        return "forward" in module.__dict__
    try:
        return "attentions" in (collector.get() or {})
    except (LookupError, TypeError):
        return False


def _wants_weights(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    flag = kwargs.get("output_attentions")
    if flag is not None:
        return bool(flag)
    if bool(getattr(getattr(module, "config", None), "output_attentions", False)):
        return True
    return _collecting_attentions(module)


def _repeat_kv(
    module: nn.Module, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def gaug_bias(module: nn.Module, query: torch.Tensor) -> GaussianBias | None:
    """GAug's bias of a patched module from its unscaled ``query: (B, H, N, d)``; None without GAug.

    Raises ``ValueError`` when ``N`` is not the prefix tokens plus the current patch grid.
    """
    gaug = getattr(module, "gaug", None)
    settings: HFAttentionSettings | None = getattr(module, SETTINGS_ATTR, None)
    if gaug is None or settings is None:
        return None
    grid, initial = settings.grid_size, settings.initial_grid_size
    if grid is None or initial is None:
        raise RuntimeError(
            f"{type(module).__name__} has GAug heads but no patch grid: run the model on pixel_values "
            "(its embeddings set the grid), or patch it again with vitattn.patch"
        )
    p = settings.num_prefix_tokens
    n = query.shape[2]
    if n != p + grid[0] * grid[1]:
        raise ValueError(
            f"{type(module).__name__} got N = {n} tokens (query of shape {tuple(query.shape)}), but its "
            f"patch grid {grid} with {p} prefix tokens needs N = {p} + {grid[0]}*{grid[1]} = "
            f"{p + grid[0] * grid[1]} "
            "(GAug needs every patch as a token, in grid order)"
        )
    bias: GaussianBias = gaug(query[:, :, p:], grid, p, initial)
    return bias


def hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    normalizer: Normalizer | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention call on vitattn: ``(out (B, N, H, Dv), weights (B, H, N, N) or None)``.

    ``normalizer`` None reads the module's :class:`HFAttentionSettings` (softmax without them); GAug's
    bias comes from ``module.gaug`` when patched so. ``dropout`` applies to the weights (transformers
    passes 0 in eval). The weights, in ``query``'s dtype, when ``output_attentions`` is asked for.
    """
    settings: HFAttentionSettings | None = getattr(module, SETTINGS_ATTR, None)
    if normalizer is None:
        normalizer = settings.normalizer if settings is not None else "softmax"
    backend = settings.backend if settings is not None else "auto"
    key, value = _repeat_kv(module, key, value)
    mask = _keep_or_additive(attention_mask)
    if mask is None:
        mask = _causal(module, kwargs, query, key)
    rule: Callable[..., torch.Tensor] | None = module.__dict__.get(RULE_ATTR)
    if rule is not None:  # attention transfer: the rule computes this layer's output
        if mask is not None:
            raise ValueError(
                f"attention transfer got an attention mask at {type(module).__name__}; transfer is defined "
                "for unmasked self-attention over all tokens"
            )
        out = rule(module, query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    bias = gaug_bias(module, query)
    p = float(dropout)
    if _wants_weights(module, kwargs):
        out, weights = attention(
            query, key, value, normalizer=normalizer, scale=scaling, mask=mask, bias=bias, dropout_p=p,
            return_weights=True, backend=backend,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), weights.to(query.dtype)
    out = attention(
        query, key, value, normalizer=normalizer, scale=scaling, mask=mask, bias=bias, dropout_p=p,
        backend=backend,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _named(
    normalizer: Normalizer | None, name: str
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    def fn(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        # hf_attention's arguments up to ``dropout`` (an eighth positional one is a TypeError)
        return hf_attention(*args, normalizer=normalizer, **kwargs)  # type: ignore[misc]

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"transformers attention function {name!r}: :func:`hf_attention` with normalizer {normalizer!r}."
    )
    return fn


_REGISTERED: set[str] = set()


def register(*names: str) -> tuple[str, ...]:
    """Register vitattn's attention functions with transformers; return the names registered.

    No argument: ``vitattn``, ``vitattn_softmax``, ``vitattn_entmax15``, ``vitattn_sparsemax`` (and every
    other registered normalizer's name). Else
    the given names (``vitattn_entmax_<alpha>`` included). Each gets transformers' SDPA mask builder
    (boolean keep-masks, None when nothing is masked). Idempotent; imports transformers.

    Raises ``ImportError`` naming the extra when transformers is missing, ``ValueError`` for a name
    that is not vitattn's.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as err:  # pragma: no cover - the hf extra is installed in the tests
        raise ImportError(
            'vitattn.hf needs transformers >= 4.51 with AttentionInterface: pip install "vitattn[hf]"'
        ) from err
    _find_collector()
    chosen = names or (PATCHED_NAME, *ATTENTION_NAMES.values())
    for name in chosen:
        if name in _REGISTERED:
            continue
        if name == PATCHED_NAME:
            normalizer: Normalizer | None = None
        else:
            normalizer = normalizer_of_name(name)
            if normalizer is None:
                raise ValueError(
                    f"{name!r} is not a vitattn attention name: use {PATCHED_NAME!r}, "
                    f"{', '.join(repr(n) for n in ATTENTION_NAMES.values())} or "
                    f"vitattn.hf.attention_name(alpha) ({_ALPHA_PREFIX}<alpha>)"
                )
        AttentionInterface.register(name, _named(normalizer, name))
        _register_mask(name)
        _REGISTERED.add(name)
    return tuple(chosen)


def _register_mask(name: str) -> None:
    """transformers' SDPA mask for ``name`` (transformers versions with a mask interface)."""
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # pragma: no cover - older transformers build masks per model
        return
    AttentionMaskInterface.register(name, sdpa_mask)
