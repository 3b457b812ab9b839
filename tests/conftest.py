"""Shared test settings: deterministic seeds, a hypothesis profile sized for 2 CPU cores, and the
``triton_interpreter`` tests' child run (see :mod:`tests.helpers`)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

from .helpers import INTERPRETER_MARK, InterpreterRuns, run_in_interpreter_child, triton_interpreted

settings.register_profile(
    "vitattn",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vitattn"))

# Tests that build the default scenes (study, probe, analysis) cache them in a temporary folder of
# this session, removed at exit, not under ~/.cache/vitattn; set VITATTN_CACHE to keep one between
# sessions. Child processes (the interpreter run, CLI subprocesses) inherit the variable.
if not os.environ.get("VITATTN_CACHE"):
    _SESSION_CACHE = tempfile.TemporaryDirectory(prefix="vitattn-test-cache-")
    os.environ["VITATTN_CACHE"] = _SESSION_CACHE.name


# Under pytest-xdist (README's test command: `-n auto --dist loadfile`) the cores are shared out
# between the workers: each worker's torch, and the processes it starts, get cores // workers threads
# (an explicit OMP_NUM_THREADS wins), so that two workers do not spin-wait on four threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


_RUNS = pytest.StashKey[InterpreterRuns]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RUNS] = InterpreterRuns(config.rootpath)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests run in Triton's interpreter are slow: they belong to the slow tier (``-m "not slow"`` skips
    them; CI runs every tier)."""
    for item in items:
        if item.get_closest_marker(INTERPRETER_MARK) is not None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A ``triton_interpreter`` test runs here if triton is interpreted here, else in the child run."""
    if pyfuncitem.get_closest_marker(INTERPRETER_MARK) is None or triton_interpreted():
        return None
    run_in_interpreter_child(pyfuncitem.config.stash[_RUNS], pyfuncitem)
    return True


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny tensors: faster, and far faster on a shared 2-core
    machine (no spin-waits between threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
