"""Where vitattn keeps files between runs (the scenes dataset, autotune picks)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir"]

CACHE_ENV = "VITATTN_CACHE"


def cache_dir() -> Path:
    """``$VITATTN_CACHE`` if set and non-empty, else ``$XDG_CACHE_HOME/vitattn``, else ``~/.cache/vitattn``.

    Not created here: writers create it when they first write.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vitattn"
