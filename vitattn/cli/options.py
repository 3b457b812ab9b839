"""Option values shared by several subcommands: ``--model-arg KEY=VALUE`` and ``--layers``."""

from __future__ import annotations

import ast
from typing import Any

__all__ = ["parse_layers", "parse_model_args"]


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """``["img_size=32", "depth=2", "global_pool=avg"]`` -> kwargs (Python literals, else strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--model-arg expects KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def parse_layers(text: str | None) -> list[int] | None:
    """``"0,3,-1"`` or ``"0 3 -1"`` -> ``[0, 3, -1]``; None / ``"all"`` -> None."""
    if text is None or text.strip().lower() == "all":
        return None
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as err:
        raise ValueError(f"--layers expects block indices like '0,3,-1', got {text!r}") from err
