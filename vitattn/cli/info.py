"""``vitattn info``: versions, devices and attention backends."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "info"
HELP = "versions, devices and attention backends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``vitattn info`` takes no options."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run(args: argparse.Namespace) -> int:
    """Print versions, devices and attention backends."""
    import torch

    from .. import __version__
    from ..functional import available_backends, backend_groups

    print(f"vitattn {__version__}")
    for dist in ("torch", "timm", "entmax", "einops", "triton", "safetensors"):
        print(f"  {dist:<12} {_version(dist)}")
    print(f"  python       {sys.version.split()[0]}")
    print(f"  cpu threads  {torch.get_num_threads()}")
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "not available"
    print(f"  cuda         {cuda}")
    print(f"  backends     {', '.join(available_backends())}")
    for group, members in backend_groups().items():
        print(f"  group        {group} = {', '.join(members)}")
    return 0
