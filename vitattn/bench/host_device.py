"""Host time of vitattn's calls where they really run: on the GPU machine, next to the kernels benchmark.

The ``host`` suite (:mod:`vitattn.bench.host`) measures the Python of a call on the CPU with the kernels
stubbed out; a device run showed the real host time several times larger (ViT-B/16's size: 2.4 ms per
Gaussian fwd+bwd eager against 0.18 ms replayed from a CUDA graph, docs/kernels.md "Device run 6").
:func:`host_times` puts a number on it on the device itself, and :func:`host_profile` says where it
goes: what a launch-plan cache or fewer Python layers would have to remove.

- ``host_us``: ``calls`` calls issued back to back with no sync between them, CPU time per call. The
  device queues the launches, so this is what the CPU spends issuing one call (kernels shorter than
  that leave the GPU idle: the call is host-bound).
- ``call_us``: the same calls, the final sync included, per call: ``max(host, device)`` per call.
- ``profile``: a cProfile of a few calls (autograd's backward run on the calling thread, where the
  profiler sees it), the functions with the most own time, µs per call.

With ``dry`` (the CPU, ``TRITON_INTERPRET=1``) the kernels are stubbed out as in the ``host`` suite:
the plumbing runs in seconds, and the numbers are that suite's, not a device's.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import time
from collections.abc import Iterator
from typing import Any

import torch

from .host import stubbed_kernels
from .kernels import CASES, Impl, _prepare_eager, implementations, make_inputs

ROWS = ("softmax vitattn", "gaussian vitattn", "entmax15 vitattn")
MODES = ("fwd", "fwd+bwd")
PROFILED = ("gaussian vitattn", "fwd+bwd")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _impls(device: str) -> dict[str, Impl]:
    """The implementations of :data:`ROWS`, in that order."""
    found = {i.name: i for i in implementations(device)}
    return {name: found[name] for name in ROWS}


def _case(name: str) -> Any:
    """The kernels benchmark's case ``name``, or a ``ValueError`` naming the known ones."""
    if name not in CASES:
        raise ValueError(f"case_name must be one of {sorted(CASES)}, got {name!r}")
    return CASES[name]


def _launches(dry: bool) -> contextlib.AbstractContextManager[None]:
    """Real launches on the device; in a dry run, the ``host`` suite's stubbed kernels."""
    return stubbed_kernels() if dry else contextlib.nullcontext()


def host_times(case_name: str, *, dry: bool = False, calls: int = 50) -> list[dict[str, Any]]:
    """Per row of :data:`ROWS` and mode: ``host_us`` and ``call_us`` (module docstring) over ``calls``
    calls after one warm-up call (which tunes the tiles), on the case's shape (its dry shape on the CPU
    with ``dry``)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    case = _case(case_name)
    device = "cpu" if dry else "cuda"
    shape = case.dry_shape if dry else case.shape
    x = make_inputs(shape, device, torch.float32 if dry else torch.bfloat16)
    out = []
    for name, impl in _impls(device).items():
        for mode in MODES:
            fn = _prepare_eager(impl, x, mode)
            with _launches(dry):
                fn()
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                issued = time.perf_counter()
                _sync(device)
                done = time.perf_counter()
            out.append(
                {
                    "case": case_name,
                    "shape": list(shape),
                    "impl": name,
                    "mode": mode,
                    "calls": calls,
                    "host_us": round((issued - t0) / calls * 1e6, 1),
                    "call_us": round((done - t0) / calls * 1e6, 1),
                }
            )
    return out


@contextlib.contextmanager
def _backward_on_this_thread() -> Iterator[None]:
    """Autograd's backward on the calling thread (on CUDA it runs on a device thread the profiler of
    this one does not see)."""
    with torch.autograd.set_multithreading_enabled(False):
        yield


def host_profile(case_name: str, *, dry: bool = False, calls: int = 20, top: int = 25) -> dict[str, Any]:
    """A cProfile of ``calls`` calls of :data:`PROFILED` after one warm-up call: the ``top`` functions by
    own time (``own_us`` and ``cum_us`` per call, ``ncalls`` per call), and the profiled wall time per
    call (the profiler's overhead included)."""
    if calls < 1 or top < 1:
        raise ValueError(f"calls and top must be >= 1, got calls={calls}, top={top}")
    case = _case(case_name)
    device = "cpu" if dry else "cuda"
    shape = case.dry_shape if dry else case.shape
    x = make_inputs(shape, device, torch.float32 if dry else torch.bfloat16)
    name, mode = PROFILED
    fn = _prepare_eager(_impls(device)[name], x, mode)
    prof = cProfile.Profile()
    with _launches(dry), _backward_on_this_thread():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        wall = time.perf_counter() - t0
        _sync(device)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, ncalls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{file.rsplit('/', 2)[-1] if file != '~' else ''}:{line}({func})",
                "ncalls": round(ncalls / calls, 2),
                "own_us": round(own / calls * 1e6, 1),
                "cum_us": round(cum / calls * 1e6, 1),
            }
        )
    rows.sort(key=lambda r: -r["own_us"])
    return {
        "case": case_name,
        "shape": list(shape),
        "impl": name,
        "mode": mode,
        "calls": calls,
        "profiled_us_per_call": round(wall / calls * 1e6, 1),
        "functions": rows[:top],
    }


def host_lines(times: list[dict[str, Any]], profile: dict[str, Any] | None) -> list[str]:
    """Printable lines: one per :func:`host_times` row, then the profile's functions."""
    lines = [
        f"host {r['case']} {r['impl']:18s} {r['mode']:8s} host {r['host_us'] / 1e3:7.3f} ms/call, "
        f"with the device {r['call_us'] / 1e3:7.3f} ms/call ({r['calls']} calls)"
        for r in times
    ]
    if profile is not None:
        lines.append(
            f"host profile {profile['case']} {profile['impl']} {profile['mode']}: "
            f"{profile['profiled_us_per_call'] / 1e3:.3f} ms/call profiled; own / cumulative µs per call:"
        )
        lines += [
            f"  {f['own_us']:8.1f} {f['cum_us']:8.1f}  x{f['ncalls']:<6g} {f['function']}"
            for f in profile["functions"]
        ]
    return lines
