"""What several subcommands share: option values (``--model-arg KEY=VALUE``, ``--layers``), checked
number types for argparse, and the one-line error report every subcommand exits with."""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "USAGE_ERRORS",
    "check_device",
    "check_output_file",
    "check_output_folder",
    "float_range",
    "hf_progress",
    "int_at_least",
    "one_line",
    "parse_layers",
    "parse_model_args",
    "report_error",
]

# what a subcommand reports as a usage, file or data error (one line, exit 2) instead of a traceback
USAGE_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError, ImportError)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(text: str) -> str:
    """``text`` on one line: terminal colour codes removed, every run of whitespace one space."""
    return " ".join(_ANSI.sub("", text).split())


def report_error(command: str, err: BaseException) -> int:
    """Print ``vitattn COMMAND: <the error on one line>`` to stderr (no second prefix when the message
    has its own); the exit status 2."""
    text = one_line(str(err)) or type(err).__name__
    prefix = f"vitattn {command}"
    print(text if text.startswith(prefix) else f"{prefix}: {text}", file=sys.stderr)
    return 2


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
        values = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as err:
        raise ValueError(f"--layers expects block indices like '0,3,-1', got {text!r}") from err
    if not values:
        raise ValueError(f"--layers expects block indices like '0,3,-1', got {text!r}")
    return values


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def float_range(low: float, high: float, *, high_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a float in ``[low, high]`` (``[low, high)`` with ``high_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
        inside = low <= value < high if high_open else low <= value <= high
        if not inside or math.isnan(value):
            raise argparse.ArgumentTypeError(
                f"must be in [{low:g}, {high:g}{')' if high_open else ']'}, got {text}"
            )
        return value

    return parse


def check_device(text: str | None, flag: str = "--device") -> None:
    """Refuse a device torch does not know, or a CUDA device on a machine without CUDA."""
    if text is None:
        return
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {text!r}: CUDA is not available here (torch.cuda.is_available() is False)")


def check_output_folder(path: str | Path | None, flag: str = "--out") -> None:
    """Refuse an output folder that is an existing file (checked before anything is written)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file, not a folder")


def check_output_file(path: str | Path | None, flag: str) -> None:
    """Refuse an output file that is an existing folder (checked before anything is written)."""
    if path is not None and Path(path).is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder, not a file")


@contextlib.contextmanager
def hf_progress(model: str, enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (loading weights) switched off while loading an ``hf:`` model
    under ``--no-progress``, and back on afterwards."""
    if enabled or not model.startswith("hf:"):
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the error comes from the load itself, with its hint
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
