"""Benchmark harness behind ``vitattn bench``: suites run side by side in one process and print ratios."""

from . import attention as _attention  # noqa: F401  (registers the "entmax" suite)
from . import host as _host  # noqa: F401  (registers the "host" suite)
from . import kernels as _kernels  # noqa: F401  (registers the "kernels" suite)
from . import launch as _launch  # noqa: F401  (registers the "launch" suite)
from . import models as _models  # noqa: F401  (registers the "models" suite)
from . import train as _train  # noqa: F401  (registers the "train" suite)
from . import transfer as _transfer  # noqa: F401  (registers the "transfer" suite)
from .harness import (
    Measurement,
    SuiteResult,
    compare,
    keep_heap,
    register_suite,
    run_suites,
    suites,
    timed_rounds,
)

__all__ = [
    "Measurement",
    "SuiteResult",
    "compare",
    "keep_heap",
    "register_suite",
    "run_suites",
    "suites",
    "timed_rounds",
]
