"""Checks of tensor *values* (σ ≥ 0, a target on the simplex, ...), off unless asked for.

Shapes, dtypes and Python numbers are always checked: that costs nothing. The values inside a tensor
are another matter: reading them back is a device sync on CUDA and a graph break under
``torch.compile``, so the hot paths never look at them. Each function documents its valid range at the
point of use; :func:`set_value_checks` (or ``VITATTN_CHECK_VALUES=1`` in the environment, read once at
import) turns on the checks below, which then raise a ``ValueError`` naming the argument and the first
offending value. The ``reference`` backend runs them always (it is the slow, exact path).
"""

from __future__ import annotations

import os

import torch

__all__ = ["ENV_VAR", "check_at_least", "check_finite", "set_value_checks", "value_checks_enabled"]

ENV_VAR = "VITATTN_CHECK_VALUES"
_ENABLED = os.environ.get(ENV_VAR, "").strip() not in ("", "0")


def set_value_checks(enabled: bool) -> None:
    """Turn the value checks on or off for the process (overrides ``VITATTN_CHECK_VALUES``)."""
    global _ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _ENABLED = enabled


def value_checks_enabled() -> bool:
    """Whether :func:`set_value_checks` / ``VITATTN_CHECK_VALUES`` asked for value checks."""
    return _ENABLED


def _first(t: torch.Tensor, bad: torch.Tensor) -> str:
    index = tuple(int(i) for i in bad.nonzero()[0])
    return f"{t[index].item()!r} at index {index}"


def check_finite(name: str, t: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` if ``t`` holds a NaN or an infinity (reads the values back)."""
    bad = ~torch.isfinite(t.detach())
    if bool(bad.any()):
        raise ValueError(f"{name} must be finite, got {_first(t, bad)}")


def check_at_least(name: str, t: torch.Tensor, low: float, what: str = "") -> None:
    """``ValueError`` naming ``name`` if an entry of ``t`` is NaN or below ``low`` (reads the values back);
    ``what`` says why, e.g. "a variance"."""
    values = t.detach()
    bad = torch.isnan(values) | (values < low)
    if bool(bad.any()):
        why = f" ({what})" if what else ""
        raise ValueError(f"{name} must be >= {low:g}{why}, got {_first(t, bad)}")
