"""The fused Triton kernels against their peers on one GPU, side by side in one process (bf16).

Usage: python benchmarks/bench_kernels.py [--out results.json] [--quick] [--device cpu]

For each shape (B, H, N, D) in (32, 12, 197, 64), (4, 12, 4096, 64), (1, 12, 16384, 64) and each mode
(forward, forward + backward) it times, interleaved in rounds (median of per-round means, CUDA events):

- softmax, no bias: SDPA with the flash backend | vitattn triton
- softmax + GAug Gaussian bias: the official path (a dense (B, H, N, N) float mask into SDPA) |
  FlexAttention with the bias as a score_mod | vitattn triton (bias computed in-kernel)
- entmax-1.5: the ``entmax`` package on materialized scores | ``adasplash`` (if installed) |
  vitattn triton, without and with the Gaussian bias

Reported per run: ms, TFLOP/s (nominal attention FLOPs, the same for every peer: 4 B H N^2 D forward,
3.5x that forward + backward), peak extra memory (MiB), and a note (skipped: why). Peers that would not
fit in free memory (estimated) are skipped with a note, and an OOM is caught and recorded.
``--device cpu`` is a smoke run of the plumbing (tiny shape, torch peers only).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vitattn.bench.harness import machine
from vitattn.functional import GaussianBias, attention

SHAPES = [(32, 12, 197, 64), (4, 12, 4096, 64), (1, 12, 16384, 64)]
QUICK_SHAPES = [(32, 12, 197, 64), (4, 12, 1025, 64)]
CPU_SHAPES = [(2, 2, 65, 16)]


@dataclass
class Row:
    shape: list[int]
    mode: str  # fwd | fwd+bwd
    impl: str
    normalizer: str
    bias: str
    ms: float | None = None
    tflops: float | None = None
    peak_mib: float | None = None
    note: str = ""


def grid_of(n: int) -> tuple[int, tuple[int, int]]:
    """(prefix tokens, grid) with prefix + gh * gw = n: a class token when n - 1 is a square."""
    for prefix in (1, 0):
        side = math.isqrt(n - prefix)
        if side * side == n - prefix:
            return prefix, (side, side)
    raise ValueError(f"no square grid for N={n}")


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sigma: torch.Tensor
    alpha: torch.Tensor
    prefix: int
    grid: tuple[int, int]

    def gaussian(self) -> GaussianBias:
        return GaussianBias(self.sigma, self.alpha, self.grid, num_prefix_tokens=self.prefix)

    def detached_bias(self) -> Inputs:
        sigma, alpha = self.sigma.detach(), self.alpha.detach()
        return Inputs(self.q, self.k, self.v, sigma, alpha, self.prefix, self.grid)

    def leaves(self, with_bias: bool) -> list[torch.Tensor]:
        return [self.q, self.k, self.v] + ([self.sigma, self.alpha] if with_bias else [])


def make_inputs(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype) -> Inputs:
    b, h, n, d = shape
    prefix, grid = grid_of(n)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3)
    )
    n_p = n - prefix
    sigma = (torch.rand(b, h, n_p, 2, device=device, generator=g) * 4 + 0.5).requires_grad_()
    alpha = (torch.rand(b, h, n_p, 1, device=device, generator=g) * 2).requires_grad_()
    return Inputs(q, k, v, sigma, alpha, prefix, grid)


# ---- peers: name -> (normalizer, bias, bytes per score element it materializes fwd / fwd+bwd, builder) ----


def _sdpa_flash(x: Inputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(x.q, x.k, x.v)

    return fn


def _gaug_dense(x: Inputs) -> Callable[[], torch.Tensor]:
    def fn():
        bias = x.gaussian().dense(x.q.dtype)  # what the official release computes each forward
        return F.scaled_dot_product_attention(x.q, x.k, x.v, attn_mask=bias)

    return fn


_FLEX: list[Callable] = []


def _flex_gaussian(x: Inputs) -> Callable[[], torch.Tensor]:
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    flex = _FLEX[0]
    gb = x.gaussian()
    prefix, gw, clamp = gb.num_prefix_tokens, gb.grid_size[1], gb.clamp

    def fn():
        den = gb.denominators()
        alpha = x.alpha[..., 0].float()

        def score_mod(score, b, h, q_idx, kv_idx):
            pq = torch.clamp(q_idx - prefix, min=0)
            pk = torch.clamp(kv_idx - prefix, min=0)
            dr = (pq // gw - pk // gw).to(torch.float32)
            dc = (pq % gw - pk % gw).to(torch.float32)
            a_r = torch.clamp(-0.5 * dr * dr, min=clamp) / den[b, h, pq, 0]
            a_c = torch.clamp(-0.5 * dc * dc, min=clamp) / den[b, h, pq, 1]
            inside = (q_idx >= prefix) & (kv_idx >= prefix)
            return score + torch.where(inside, alpha[b, h, pq] * torch.exp(a_r + a_c), 0.0)

        return flex(x.q, x.k, x.v, score_mod=score_mod)

    return fn


def _entmax_pkg(x: Inputs) -> Callable[[], torch.Tensor]:
    from entmax import entmax15

    def fn():
        scores = torch.matmul(x.q.float(), x.k.float().transpose(-1, -2)) * x.q.shape[-1] ** -0.5
        return torch.matmul(entmax15(scores, dim=-1).to(x.v.dtype), x.v)

    return fn


def _adasplash(x: Inputs) -> Callable[[], torch.Tensor]:
    from adasplash import adasplash

    return lambda: adasplash(x.q, x.k, x.v, alpha=1.5, niter=10, is_causal=False)


def _vitattn(normalizer: str, gaussian: bool, backend: str) -> Callable[[Inputs], Callable[[], torch.Tensor]]:
    def build(x: Inputs) -> Callable[[], torch.Tensor]:
        return lambda: attention(
            x.q, x.k, x.v, normalizer=normalizer, bias=x.gaussian() if gaussian else None, backend=backend
        )

    return build


def peers(device: str) -> list[tuple[str, str, str, tuple[float, float], Callable]]:
    """(impl, normalizer, bias, bytes per (B, H, N, N) element it holds fwd / fwd+bwd, builder)."""
    backend = "triton" if device == "cuda" else "auto"
    ours = "vitattn_triton" if device == "cuda" else "vitattn_auto"
    out = [
        ("sdpa_flash", "softmax", "none", (0, 0), _sdpa_flash),
        (ours, "softmax", "none", (0, 0), _vitattn("softmax", False, backend)),
        ("gaug_dense_sdpa", "softmax", "gaussian", (14, 28), _gaug_dense),
        ("flex_score_mod", "softmax", "gaussian", (0, 0), _flex_gaussian),
        (ours, "softmax", "gaussian", (0, 0), _vitattn("softmax", True, backend)),
        ("entmax_pkg", "entmax15", "none", (40, 60), _entmax_pkg),
        ("adasplash", "entmax15", "none", (0, 0), _adasplash),
        (ours, "entmax15", "none", (0, 0), _vitattn("entmax15", False, backend)),
        (ours, "entmax15", "gaussian", (0, 0), _vitattn("entmax15", True, backend)),
    ]
    if device != "cuda":
        out = [p for p in out if p[0] not in ("sdpa_flash", "flex_score_mod", "adasplash")]
    return out


def _missing(impl: str) -> str | None:
    module = {"entmax_pkg": "entmax", "adasplash": "adasplash"}.get(impl)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (any import failure means: skip this peer)
        return f"skipped: {module} not importable ({type(exc).__name__})"
    return None


class Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], reps: int) -> float:
        """Mean milliseconds per call over ``reps`` calls."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps


def with_backward(fwd: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], object]:
    def fn():
        out = fwd()
        return torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)

    return fn


def bench_shape(shape, device, dtype, rounds: int, budget_ms: float) -> list[Row]:
    b, h, n, d = shape
    timer = Timer(device)
    x = make_inputs(shape, device, dtype)
    flops_fwd = 4.0 * b * h * n * n * d
    rows: list[Row] = []
    runnable: list[tuple[Row, Callable[[], object]]] = []
    elements = b * h * n * n
    for mode in ("fwd", "fwd+bwd"):
        for impl, normalizer, bias, bytes_per, build in peers(device):
            row = Row(list(shape), mode, impl, normalizer, bias)
            rows.append(row)
            note = _missing(impl)
            need = elements * bytes_per[mode == "fwd+bwd"]
            if note is None and timer.cuda and need > 0.8 * torch.cuda.mem_get_info()[0]:
                note = f"skipped: would need ~{need / 2**30:.0f} GiB (OOM)"
            if note:
                row.note = note
                continue
            try:
                fn = _prepare(build, x, mode, bias == "gaussian")
                try:
                    fn()  # compile / autotune
                except Exception:
                    if impl != "flex_score_mod" or mode == "fwd":
                        raise
                    fn = _prepare(build, x.detached_bias(), mode, False)
                    fn()
                    row.note = "gradients for q, k, v only (none for sigma, alpha)"
                fn()
                timer.sync()
                if timer.cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    fn()
                    timer.sync()
                    row.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
                row.ms = timer.time(fn, 1)  # a first estimate, sets the repetitions
                runnable.append((row, fn))
            except torch.cuda.OutOfMemoryError:
                row.note = "OOM"
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001  (a failing peer is reported, not fatal)
                first = str(exc).splitlines()[0][:160] if str(exc) else ""
                row.note = f"failed: {type(exc).__name__}: {first}"
    samples: dict[int, list[float]] = {id(r): [] for r, _ in runnable}
    for _ in range(rounds):  # interleaved: drift hits every peer alike
        for row, fn in runnable:
            reps = max(1, min(50, int(budget_ms / max(row.ms or 1.0, 1e-3))))
            samples[id(row)].append(timer.time(fn, reps))
    for row, _ in runnable:
        row.ms = statistics.median(samples[id(row)])
        row.tflops = flops_fwd * (1.0 if row.mode == "fwd" else 3.5) / (row.ms * 1e-3) / 1e12
    return rows


def _prepare(build, x: Inputs, mode: str, bias_grads: bool) -> Callable[[], object]:
    fwd = build(x)
    return _no_grad(fwd) if mode == "fwd" else with_backward(fwd, x.leaves(bias_grads))


def _no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def wrapped():
        with torch.no_grad():
            return fn()

    return wrapped


def render(rows: list[Row]) -> str:
    lines = [f"{'shape':<22} {'mode':<8} {'normalizer/bias':<18} {'impl':<16} {'ms':>9} {'TFLOP/s':>8} "
             f"{'peak MiB':>9}  note"]
    for r in rows:
        ms = f"{r.ms:.3f}" if r.ms is not None else "-"
        tf = f"{r.tflops:.1f}" if r.tflops is not None else "-"
        mem = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
        shape = "x".join(map(str, r.shape))
        kind = f"{r.normalizer}/{r.bias}"
        lines.append(f"{shape:<22} {r.mode:<8} {kind:<18} {r.impl:<16} {ms:>9} {tf:>8} {mem:>9}  {r.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kernels_gpu.json")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: no CUDA device (use --device cpu for a smoke run)")
        return 1
    shapes = CPU_SHAPES if args.device == "cpu" else QUICK_SHAPES if args.quick else SHAPES
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rounds = args.rounds or (3 if args.quick or args.device == "cpu" else 5)
    rows: list[Row] = []
    start = time.time()
    for shape in shapes:
        rows += bench_shape(shape, args.device, dtype, rounds, budget_ms=25.0)
        print(render([r for r in rows if r.shape == list(shape)]), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save(args.out, rows, args.device, dtype, start)  # after every shape: a killed run keeps its results
    return 0


def save(out: str, rows: list[Row], device: str, dtype: torch.dtype, start: float) -> None:
    payload = {
        "suite": "kernels",
        "machine": machine(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "dtype": str(dtype).removeprefix("torch."),
        "flops": "nominal: 4 B H N^2 D forward, 3.5x for forward + backward",
        "seconds": round(time.time() - start, 1),
        "rows": [asdict(r) for r in rows],
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}", flush=True)


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    raise SystemExit(main())
