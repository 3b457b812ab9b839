"""Suite ``launch``: the host cost of the kernel launches themselves, on the CPU, no GPU needed.

The ``host`` suite stubs every kernel out in the interpreter, so neither vitattn's tuned-launch path
(``ops._launch``: the tuning key, the candidate tiles, the remembered pick, the tile's flags) nor
Triton's own (``JITFunction.run``: binding and specializing 50-64 arguments, the cache key and its
lookup) is in it. This suite runs both, for the launches one fwd+bwd makes (recorded by
``ops.capture`` on the ``host`` suite's shape), through a stand-in driver (device 0, stream 0, an sm_90
target) and a stand-in compiled kernel whose launch does nothing: a real launch adds the C launcher and
the driver call.

Rows, per path (softmax, Gaussian, entmax-1.5), all the launches of one fwd+bwd together: ``triton``
(``kernel[grid](...)`` at the first candidate tile) and ``vitattn + triton`` (``ops._launch`` with the
tile remembered, as after tuning). Run it with ``TRITON_INTERPRET`` unset: ``vitattn bench launch``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..functional.gaussian import gaussian_clamp
from .harness import SuiteResult, register_suite, timed_rounds
from .host import DTYPE, GRID, REFERENCE, SHAPE, reference_call

PATHS = ("softmax", "gaussian", "entmax15")
ARCH = 90  # the stand-in driver's target: the tile lists and flags of sm_90
GRID_1D, GRID_2D = (1,), (1, 1)  # the stand-in launches run nothing: any grid will do


class _StandInDriver:
    """Enough of Triton's CUDA driver for ``JITFunction.run`` on a machine without a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class _StandInKernel:
    """A compiled kernel whose launch does nothing but count itself (``launched``, over all of them)."""

    function = None
    packed_metadata = None
    launched = 0

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        _StandInKernel.launched += 1


@contextlib.contextmanager
def stand_in_launches() -> Iterator[None]:
    """Inside the block Triton launches through :class:`_StandInDriver` and compiles nothing: the first
    launch of each specialization caches a :class:`_StandInKernel`. On exit the driver is Triton's
    again and vitattn's kernels forget what they cached (a later real launch compiles for real); the
    tile picks remembered inside are forgotten too. Needs ``TRITON_INTERPRET`` unset."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from ..kernels import ops

    if ops.interpret_requested():
        raise RuntimeError(
            "vitattn bench launch measures the compiled launch path: run it with TRITON_INTERPRET unset"
        )

    def stand_in_compile(self: Any, key: Any, signature: Any, device: int, *rest: Any) -> _StandInKernel:
        kernel = _StandInKernel()
        self.device_caches[device][0][key] = kernel
        return kernel

    saved_compile = JITFunction._do_compile
    tuned, log = dict(ops._TUNED), dict(ops._TUNING_LOG)
    # the active driver as it was, possibly none yet (Triton's reset would create one: no GPU, no driver)
    saved_driver = driver._active
    driver.set_active(_StandInDriver())
    JITFunction._do_compile = stand_in_compile
    try:
        yield
    finally:
        JITFunction._do_compile = saved_compile
        driver._active = saved_driver
        for fn in ops.kernels().values():
            fn.device_caches.clear()
        ops._TUNED.clear()
        ops._TUNED.update(tuned)
        ops._TUNING_LOG.clear()
        ops._TUNING_LOG.update(log)


def recorded_launches(path: str) -> list[Any]:
    """The launches (``ops.Captured``) of one fwd+bwd of ``path`` on the ``host`` suite's shape, in
    bf16 (the Gaussian one with a class token and the :data:`~vitattn.bench.host.GRID` grid)."""
    from ..kernels import ops

    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    b, h, n, d = SHAPE
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SHAPE, generator=gen).to(DTYPE) for _ in range(3))
    den = alpha = None
    num_prefix, grid_w, clamp = 0, 1, 0.0
    if path == "gaussian":
        n_p = GRID[0] * GRID[1]
        den = torch.full((1, h, n_p, 2), 2.0).expand(b, h, n_p, 2)
        alpha = torch.ones(1, h, n_p).expand(b, h, n_p)
        num_prefix, grid_w, clamp = n - n_p, GRID[1], gaussian_clamp(GRID)
    entmax = path == "entmax15"
    launch = ops.KernelLaunch(
        q, k, v, None, None, den, alpha, d**-0.5, num_prefix, grid_w, clamp, entmax, False
    )
    with ops.capture() as recorded, ops.assume_arch(ARCH):
        out, stat, og, live = ops._forward(launch, store_og=entmax)
        grad = torch.randn(out.shape, generator=gen).to(DTYPE)
        ops._backward(launch, grad, og if entmax else out, stat, live, False, den is not None, False)
    return list(recorded)


def _tuned(c: Any) -> bool:
    return c.shape != (0, 0, 0)  # the untuned helper kernels (row deltas, Gaussian factors) record none


def _first_tile(c: Any) -> Any:
    from ..kernels import configs, ops

    return ops.tile_candidates(c.name, c.meta, ARCH, configs.ragged(c.shape[1], c.shape[2], c.even_d))[0]


def triton_call(c: Any) -> Callable[[], None]:
    """One launch of ``c`` straight through Triton: ``kernel[grid](*args, **flags)`` at its first tile."""
    if not _tuned(c):
        return lambda: c.fn[GRID_1D](*c.args, **c.meta)
    tile = _first_tile(c)
    kw = dict(c.meta, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps)
    kw.update(num_stages=tile.num_stages, **c.tile_flags(tile.block_m, tile.block_n))
    args = c.args_at(tile.block_m, tile.block_n)
    return lambda: c.fn[GRID_2D](*args, **kw)


def vitattn_call(c: Any) -> Callable[[], None]:
    """One launch of ``c`` through vitattn's launch path (``ops._launch``, its first tile remembered as a
    tuned pick; the untuned kernels through ``ops._run_or_warm``)."""
    from ..kernels import ops

    if not _tuned(c):
        return lambda: ops._run_or_warm(c.fn, GRID_1D, c.args, c.args[:1], **c.meta)
    batch_heads, n_q, n_k = c.shape
    ops._TUNED[ops.tune_key(c.name, c.args[0].dtype, batch_heads, n_q, n_k, c.meta)] = _first_tile(c)

    def grid(block_m: int, block_n: int) -> tuple[int, int]:
        return GRID_2D

    def call() -> None:
        ops._launch(
            c.name, grid, c.args, c.meta, c.shape, c.even_d, grid_keys=c.grid_keys, tile_args=c.tile_args
        )

    return call


def _all(calls: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


@register_suite(
    "launch", "host time of the kernel launches (Triton's path and vitattn's), CPU", multiprocess=True
)
def launch_suite(quick: bool = False) -> SuiteResult:
    rows = []
    notes = []
    with stand_in_launches():
        for path in PATHS:
            launches = recorded_launches(path)
            case = f"launch {path} fwd+bwd {'x'.join(map(str, SHAPE))}"
            impls: dict[str, Callable[[], object]] = {
                REFERENCE: reference_call(),
                "triton": _all([triton_call(c) for c in launches]),
                "vitattn + triton": _all([vitattn_call(c) for c in launches]),
            }
            rows += timed_rounds(case, impls, rounds=5, min_run_time=0.2, quick=quick)
            notes.append(f"{case}: {len(launches)} launches ({', '.join(c.name for c in launches)})")
    return SuiteResult(
        name="launch",
        title="host time of one fwd+bwd's kernel launches, stand-in driver (CPU), ratio = ms / one SDPA call",
        reference=REFERENCE,
        rows=rows,
        notes=notes,
    )
