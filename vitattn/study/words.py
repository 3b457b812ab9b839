"""Counted nouns for the study's messages and titles: ``1 run``, ``3 runs``."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 epoch"``, ``"5 epochs"``; ``nouns`` for an irregular plural (default ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
