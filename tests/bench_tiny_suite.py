"""A tiny timing suite for the multi-process bench tests (imported by the child processes too)."""

from __future__ import annotations

import os

import torch

from vitattn.bench.harness import Goal, SuiteResult, compare, register_suite

# vitattn bench's child processes import this module by name, like `--import-module`
NAME = "_tiny"


@register_suite(NAME, "a tiny suite for tests: two small matmuls", multiprocess=True)
def tiny_suite(quick: bool = False) -> SuiteResult:
    a, b = torch.randn(32, 32), torch.randn(64, 64)
    rows = compare("small", {"ref": lambda: a @ a, "bigger": lambda: b @ b}, warmup=1, repeat=3)
    result = SuiteResult(NAME, f"tiny (pid {os.getpid()})", "ref", rows)
    result.goals.append(Goal("small", "bigger", "ref", 1e9))  # always met
    result.goals.append(Goal("small", "ref", "bigger", 1e9, at_least=True))  # never met
    return result
