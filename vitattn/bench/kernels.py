"""Suite ``kernels``: the fused Triton kernels against their peers on one GPU, side by side (bf16).

Cases ``(B, H, N, D)``: ``vit_b`` (32, 12, 197, 64), ``n4096`` (4, 12, 4096, 64), ``n16384``
(1, 12, 16384, 64) on random inputs, and ``sparse`` (4, 12, 4096, 64) whose scores have local
structure (queries and keys are 2-D positional features of a 64 x 64 grid, :func:`local_qk`), so
entmax-1.5 has real block sparsity (reported as the share of 64 x 64 tiles with support); it times
vitattn and AdaSplash on those inputs and vitattn on random ones (``entmax15 vitattn random``).
Each case runs forward + backward (what the goals are about, first), then forward without grad.
Implementations, by family:

- ``softmax``: SDPA with the flash backend (``sdpa_flash``, the reference of every ratio), SDPA with
  cuDNN (where torch has it), vitattn;
- ``gaussian`` (softmax + the GAug bias): the official LocAt-style path (the dense ``(B, H, N, N)``
  bias materialized, then SDPA), FlexAttention with the bias as a ``score_mod``, vitattn;
- ``entmax15``: the ``entmax`` package on materialized scores, AdaSplash, vitattn; ``entmax15+gaussian``:
  vitattn.

vitattn runs through :func:`vitattn.functional.attention` with ``backend="triton"``. Timing uses
:func:`vitattn.bench.harness.compare` (interleaved rounds, medians) on callables that each run an
implementation ``reps`` times, so one sample lasts ~20 ms; the ms are per call. Per row ``extra``:
``tflops`` (nominal: ``4 B H N^2 D`` forward, 3.5x that forward + backward), ``peak_mib`` (CUDA peak
allocation beyond what was allocated before the call), and the row's gate, checked once per
implementation in the same run against ``backend="reference"`` on float32 copies of the same inputs
(forward output and every gradient the family has: q, k, v, and sigma, alpha with the Gaussian bias):
``rel_err`` / ``grad_err`` (max-abs difference relative to the reference's max-abs, the worst leaf for
the gradients), ``valid`` (1 when both are within :data:`TOLERANCE`), ``ranked`` (0 for a peer that
ran with fewer gradients than its family asks for, e.g. FlexAttention falling back to q, k, v only; such
a row is reported, never compared). Peers that would not fit (estimated) or cannot run here are listed in
``skipped`` with the reason. ``dry=True`` runs tiny shapes on the CPU (float32; the Triton kernels run
under ``TRITON_INTERPRET=1``, CUDA-only peers are skipped).
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..functional import GaussianBias, Normalizer, attention
from .harness import Measurement, SuiteResult, compare, machine, register_suite

Shape = tuple[int, int, int, int]
Fn = Callable[[], object]


@dataclass(frozen=True)
class Case:
    """One benchmark case: a shape, and whether the scores have local structure (block-sparse entmax)."""

    name: str
    shape: Shape
    dry_shape: Shape
    local: bool = False


# n4096 and n16384 hold the same number of tokens (B * N), so a peak memory linear in N is equal in both.
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("vit_b", (32, 12, 197, 64), (1, 2, 17, 16)),
        Case("n4096", (4, 12, 4096, 64), (4, 1, 16, 16)),
        Case("n16384", (1, 12, 16384, 64), (1, 1, 64, 16)),
        Case("sparse", (4, 12, 4096, 64), (1, 1, 64, 16), local=True),
    )
}
SUPPORT_TILE = 64  # tile side of the reported block sparsity
# The gate of a speed row (relative max-abs error against the reference backend in float32): bf16 inputs,
# as tests/test_kernels_gpu.py's bf16 tolerances; a dry run (float32) is held to float32's.
TOLERANCE = {"bf16": (2.5e-2, 5e-2), "fp32": (1e-4, 2e-4)}
MODES = ("fwd+bwd", "fwd")  # the goals are about forward + backward: measured first
TARGET_MS = 20.0  # milliseconds per timed sample


def reference_impl(device: str) -> str:
    """The implementation every ratio is relative to: SDPA flash on CUDA, SDPA (math) on the CPU."""
    return "softmax sdpa_flash" if device == "cuda" else "softmax sdpa"


def grid_of(n: int) -> tuple[int, tuple[int, int]]:
    """(prefix tokens, grid) with ``prefix + gh * gw == n``: a class token when ``n - 1`` is a square."""
    for prefix in (1, 0):
        side = math.isqrt(n - prefix)
        if side * side == n - prefix:
            return prefix, (side, side)
    raise ValueError(f"no square patch grid (with or without a class token) for N={n}")


@dataclass
class Inputs:
    """``q, k, v``: ``(B, H, N, D)``; ``sigma``: ``(B, H, Np, 2)``; ``alpha``: ``(B, H, Np, 1)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sigma: torch.Tensor
    alpha: torch.Tensor
    prefix: int
    grid: tuple[int, int]

    def gaussian(self) -> GaussianBias:
        return GaussianBias(self.sigma, self.alpha, self.grid, num_prefix_tokens=self.prefix)

    def leaves(self, with_bias: bool) -> list[torch.Tensor]:
        return [self.q, self.k, self.v] + ([self.sigma, self.alpha] if with_bias else [])


def make_inputs(shape: Shape, device: str, dtype: torch.dtype, local: bool = False, seed: int = 0) -> Inputs:
    """Random inputs, or with ``local`` queries = keys = 2-D positional features (see :func:`local_qk`)."""
    b, h, n, d = shape
    prefix, grid = grid_of(n)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.float32, generator=g) for _ in range(3))
    if local:
        q = k = local_qk(shape, prefix, grid, device, g)
    n_p = n - prefix
    sigma = torch.rand(b, h, n_p, 2, device=device, generator=g) * 4 + 0.5
    alpha = torch.rand(b, h, n_p, 1, device=device, generator=g) * 2
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    return Inputs(q, k, v, sigma.requires_grad_(), alpha.requires_grad_(), prefix, grid)


def local_qk(
    shape: Shape,
    prefix: int,
    grid: tuple[int, int],
    device: str,
    g: torch.Generator,
    radius: float | None = None,
) -> torch.Tensor:
    """``(B, H, N, D)`` features whose scaled scores are ``A (cos w dr + cos w dc)`` for grid offsets
    ``(dr, dc)`` (monotone in each ``|d|`` since ``w = pi / max(grid)``), plus small noise.

    ``A`` puts the entmax-1.5 support of a query on a disc of about ``radius`` patches: for scores
    ``A (2 - w^2 |d|^2 / 2)`` the weights are ``(A w^2 / 4)^2 (R^2 - |d|^2)^2``, which sum to 1 at
    ``(A w^2 / 4)^2 = 3 / (pi R^6)``. The radius defaults to ``max(1.5, max(grid) / 16)`` (4 on 64 x 64).
    """
    b, h, n, d = shape
    radius = max(1.5, max(grid) / 16) if radius is None else radius
    if d < 4:
        raise ValueError(f"local features need head dim >= 4, got shape {shape}")
    w = math.pi / max(grid)
    amp = 4.0 / w**2 * math.sqrt(3.0 / (math.pi * radius**6))
    rows = torch.arange(grid[0], device=device).repeat_interleave(grid[1]).float()
    cols = torch.arange(grid[1], device=device).repeat(grid[0]).float()
    pos = torch.stack([torch.cos(w * rows), torch.sin(w * rows), torch.cos(w * cols), torch.sin(w * cols)], 1)
    feats = torch.randn(b, h, n, d, device=device, generator=g) * 0.02
    # scores = q k^T * d**-0.5 = A * (pos . pos'): each of q, k carries sqrt(A * sqrt(d))
    feats[:, :, prefix:, :4] = pos * math.sqrt(amp * math.sqrt(d))
    return feats


# ---- implementations: impl name -> (family, builder, bytes per (B, H, N, N) element fwd / fwd+bwd) ----


@dataclass(frozen=True)
class Impl:
    name: str
    family: str  # softmax | gaussian | entmax15 | entmax15+gaussian
    build: Callable[[Inputs], Callable[[], torch.Tensor]]
    score_bytes: tuple[int, int] = (0, 0)
    module: str | None = None  # a peer package that must be importable
    cuda_only: str | None = None  # why it needs CUDA, if it does
    no_cpu_backward: str | None = None
    graph: bool = False  # timed as one CUDA graph replay of the whole call (no host work per call)

    @property
    def bias_grads(self) -> bool:
        return self.family.endswith("gaussian")


def _sdpa(backend_name: str | None) -> Callable[[Inputs], Callable[[], torch.Tensor]]:
    def build(x: Inputs) -> Callable[[], torch.Tensor]:
        if backend_name is None:
            return lambda: F.scaled_dot_product_attention(x.q, x.k, x.v)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend_name)

        def fn() -> torch.Tensor:
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(x.q, x.k, x.v)

        return fn

    return build


def _dense_bias(x: Inputs) -> Callable[[], torch.Tensor]:
    """The official LocAt path: the ``(B, H, N, N)`` bias materialized each forward, then SDPA."""
    return lambda: F.scaled_dot_product_attention(x.q, x.k, x.v, attn_mask=x.gaussian().dense(x.q.dtype))


_FLEX: dict[str, Callable[..., Any]] = {}


def _flex(x: Inputs) -> Callable[[], torch.Tensor]:
    """FlexAttention with the Gaussian bias as a ``score_mod`` (compiled on CUDA, eager on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    dev = x.q.device.type
    if dev not in _FLEX:
        compiled = torch.compile(flex_attention, dynamic=False) if dev == "cuda" else flex_attention
        _FLEX[dev] = cast(Callable[..., Any], compiled)
    flex = _FLEX[dev]
    gb = x.gaussian()
    prefix, gw, clamp = gb.num_prefix_tokens, gb.grid_size[1], gb.clamp

    def fn() -> torch.Tensor:
        # one captured tensor per index: FlexAttention's backward refuses a tensor that requires grad
        # indexed twice in a score_mod (the row and column denominators are two tensors, not one)
        den = gb.denominators()
        den_row, den_col = den[..., 0].contiguous(), den[..., 1].contiguous()
        alpha = x.alpha[..., 0].float()
        # without autograd, inputs that require grad are refused on the CPU: pass them detached
        q, k, v = (t if torch.is_grad_enabled() else t.detach() for t in (x.q, x.k, x.v))

        def score_mod(score, b, h, q_idx, kv_idx):
            pq = torch.clamp(q_idx - prefix, min=0)
            pk = torch.clamp(kv_idx - prefix, min=0)
            dr = (pq // gw - pk // gw).to(torch.float32)
            dc = (pq % gw - pk % gw).to(torch.float32)
            a_r = torch.clamp(-0.5 * dr * dr, min=clamp) / den_row[b, h, pq]
            a_c = torch.clamp(-0.5 * dc * dc, min=clamp) / den_col[b, h, pq]
            inside = (q_idx >= prefix) & (kv_idx >= prefix)
            return score + torch.where(inside, alpha[b, h, pq] * torch.exp(a_r + a_c), 0.0)

        return flex(q, k, v, score_mod=score_mod)

    return fn


def _entmax_pkg(x: Inputs) -> Callable[[], torch.Tensor]:
    from entmax import entmax15

    def fn() -> torch.Tensor:
        scores = torch.matmul(x.q.float(), x.k.float().transpose(-1, -2)) * x.q.shape[-1] ** -0.5
        return torch.matmul(entmax15(scores, dim=-1).to(x.v.dtype), x.v)

    return fn


def _adasplash(x: Inputs) -> Callable[[], torch.Tensor]:
    """AdaSplash's non-causal entmax-1.5 kernel; N not a power of two goes through its ``varlen``."""
    from adasplash import adasplash

    b, _, n, _ = x.q.shape
    varlen = None if n & (n - 1) == 0 else torch.full((b,), n, device=x.q.device, dtype=torch.int32)
    return lambda: adasplash(x.q, x.k, x.v, alpha=1.5, is_causal=False, niter=10, varlen=varlen)


def _vitattn(normalizer: Normalizer, gaussian: bool) -> Callable[[Inputs], Callable[[], torch.Tensor]]:
    def build(x: Inputs) -> Callable[[], torch.Tensor]:
        return lambda: attention(
            x.q, x.k, x.v, normalizer=normalizer, bias=x.gaussian() if gaussian else None, backend="triton"
        )

    return build


_GRAPHS = "CUDA graphs"
GRAPH_MAX_SCORES = 1 << 30  # the graph rows' largest case (n4096: 2^29.6 scores; n16384's 2^31.6 skips them)
_NEEDS_CUDA_FLEX = "compiled FlexAttention needs CUDA here (its CPU path has no backward)"


def implementations(device: str, local: bool = False) -> list[Impl]:
    """Every implementation of a case, the reference first, then the rows the goals compare (so that a
    run cut short by its time limit has measured them), then the others (for ``local``: the entmax ones
    and the reference only)."""
    impls = [
        Impl(reference_impl(device), "softmax", _sdpa("FLASH_ATTENTION" if device == "cuda" else None)),
        Impl("gaussian vitattn", "gaussian", _vitattn("softmax", True)),
        Impl("gaussian dense_sdpa", "gaussian", _dense_bias, (14, 28)),
        Impl("gaussian flex", "gaussian", _flex, no_cpu_backward=_NEEDS_CUDA_FLEX),
        Impl("entmax15 vitattn", "entmax15", _vitattn("entmax15", False)),
        Impl(
            "entmax15 adasplash",
            "entmax15",
            _adasplash,
            module="adasplash",
            cuda_only="AdaSplash allocates its block masks on CUDA",
        ),
        Impl("softmax sdpa_cudnn", "softmax", _sdpa("CUDNN_ATTENTION"), cuda_only="cuDNN is CUDA-only"),
        Impl("softmax vitattn", "softmax", _vitattn("softmax", False)),
        Impl("entmax15 entmax_pkg", "entmax15", _entmax_pkg, (40, 60), module="entmax"),
        Impl("entmax15+gaussian vitattn", "entmax15+gaussian", _vitattn("entmax15", True)),
        # the same calls replayed from a CUDA graph: the kernels' own time, without the host's
        Impl("gaussian vitattn graph", "gaussian", _vitattn("softmax", True), cuda_only=_GRAPHS, graph=True),
        Impl("softmax vitattn graph", "softmax", _vitattn("softmax", False), cuda_only=_GRAPHS, graph=True),
    ]
    if local:
        keep = {reference_impl(device), "entmax15 adasplash", "entmax15 vitattn"}
        impls = [i for i in impls if i.name in keep]
    return impls


_TRITON_HERE: dict[str, str | None] = {}


def _triton_declines(device: str) -> str | None:
    """Why ``backend="triton"`` refuses a tiny call on ``device`` (``None`` if it runs), asked once."""
    if device not in _TRITON_HERE:
        q = torch.zeros(1, 1, 16, 16, device=device)
        try:
            with torch.no_grad():
                attention(q, q, q, backend="triton")
            _TRITON_HERE[device] = None
        except ValueError as exc:
            _TRITON_HERE[device] = str(exc)
    return _TRITON_HERE[device]


def _unavailable(impl: Impl, device: str, mode: str, elements: int) -> str | None:
    """Why ``impl`` cannot run here (``None`` if it can)."""
    if impl.name.endswith(("vitattn", "vitattn random", "vitattn graph")):
        declined = _triton_declines(device)
        if declined is not None:
            return declined
    if impl.cuda_only and device != "cuda":
        return f"needs CUDA: {impl.cuda_only}"
    if impl.graph and elements > GRAPH_MAX_SCORES:
        return "CUDA-graph rows run up to 2^30 scores (B*H*N^2): above, the host's share of a call is small"
    if impl.no_cpu_backward and device != "cuda" and mode == "fwd+bwd":
        return f"needs CUDA: {impl.no_cpu_backward}"
    if impl.name.endswith("sdpa_cudnn") and not hasattr(torch.nn.attention.SDPBackend, "CUDNN_ATTENTION"):
        return f"torch {torch.__version__} has no cuDNN attention backend"
    if impl.module is not None:
        try:
            importlib.import_module(impl.module)
        except Exception as exc:  # noqa: BLE001  (any import failure means: skip this peer)
            return f"{impl.module} not importable ({type(exc).__name__}: {exc})"
    need = elements * impl.score_bytes[mode == "fwd+bwd"]
    if device == "cuda" and need > 0.8 * torch.cuda.mem_get_info()[0]:
        return f"would need ~{need / 2**30:.0f} GiB for its (B, H, N, N) tensors (OOM)"
    return None


# ---- measuring -----------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prepare(impl: Impl, x: Inputs, mode: str) -> Fn:
    fn = _prepare_eager(impl, x, mode)
    return _graphed(fn) if impl.graph else fn


def _graphed(fn: Fn) -> Fn:
    """``fn`` captured once into a CUDA graph (after warm-up calls on a side stream, which also autotune
    every kernel outside the capture) and replayed: one call's GPU work without its host work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _prepare_eager(impl: Impl, x: Inputs, mode: str) -> Fn:
    fwd = impl.build(x)
    if mode == "fwd":

        def run_fwd() -> object:
            with torch.no_grad():
                return fwd()

        return run_fwd
    leaves = x.leaves(impl.bias_grads)
    grad = torch.randn_like(x.q)

    def run_fwd_bwd() -> object:
        return torch.autograd.grad(fwd(), leaves, grad, allow_unused=True)

    return run_fwd_bwd


def _peak_mib(fn: Fn, device: str) -> float | None:
    """CUDA peak allocation of one call beyond what was allocated before it (``None`` on the CPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _repeated(fn: Fn, reps: int) -> Fn:
    def run() -> None:
        for _ in range(reps):
            fn()

    return run


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def _family_leaves(family: str) -> int:
    """How many leaves the family differentiates: q, k, v (+ sigma, alpha with the Gaussian bias)."""
    return 5 if family.endswith("gaussian") else 3


def reference_outputs(family: str, x: Inputs, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward output and gradients of ``family`` on float32 copies of ``x`` by ``backend="reference"``
    (the dense formula), with the upstream gradient ``grad``."""
    normalizer: Normalizer = "entmax15" if family.startswith("entmax15") else "softmax"
    gaussian = family.endswith("gaussian")
    copies: dict[int, torch.Tensor] = {}  # one copy per tensor: q and k are one tensor in the local case
    leaves = [copies.setdefault(id(t), t.detach().float().requires_grad_()) for t in x.leaves(gaussian)]
    bias = None
    if family.endswith("gaussian"):
        bias = GaussianBias(leaves[3], leaves[4], x.grid, num_prefix_tokens=x.prefix)
    out = attention(*leaves[:3], normalizer=normalizer, bias=bias, backend="reference")
    grads = torch.autograd.grad(out, leaves, grad.float())
    return out.detach(), [g.detach() for g in grads]


def check_outputs(
    out: torch.Tensor,
    grads: Sequence[torch.Tensor | None],
    ref: tuple[torch.Tensor, list[torch.Tensor]],
    family: str,
    dtype: torch.dtype,
) -> dict[str, float]:
    """The gate of an implementation (see the module docstring): ``rel_err``, ``grad_err``, ``valid``,
    ``ranked``; ``grads`` are the implementation's gradients of the family's leaves (``None`` where it
    gave none, for the forward-only mode: an empty list)."""
    ref_out, ref_grads = ref
    fwd_tol, grad_tol = TOLERANCE["fp32" if dtype == torch.float32 else "bf16"]
    rel = _rel_err(out, ref_out)
    extra = {"rel_err": rel}
    ranked = 1.0
    ok = rel <= fwd_tol
    if grads:
        given = [(g, w) for g, w in zip(grads, ref_grads, strict=False) if g is not None]
        ranked = float(len(given) == _family_leaves(family))
        grad_err = max(_rel_err(g, w) for g, w in given) if given else float("inf")
        extra["grad_err"] = grad_err
        ok = ok and grad_err <= grad_tol
    extra.update(valid=float(ok), ranked=ranked)
    return extra


def _failure(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"failed: {type(exc).__name__}: {first}"


@dataclass
class CaseResult:
    """The measurements of one case (both modes), the skipped implementations and the block sparsity."""

    case: Case
    shape: Shape
    device: str
    dtype: torch.dtype
    dry: bool = False
    rows: list[Measurement] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sparsity: dict[str, float] = field(default_factory=dict)
    modes_done: list[str] = field(default_factory=list)
    deadline: float | None = None  # time.time() after which no further implementation is started
    # the gates (see _gate): references per (family, inputs), upstream gradients per inputs, per-impl results
    refs: dict[tuple[str, int], tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    gates: dict[str, dict[str, float]] = field(default_factory=dict)
    timed_as: dict[str, Impl] = field(default_factory=dict)

    def label(self, mode: str) -> str:
        b, h, n, d = self.shape
        return f"{self.case.name} B{b} H{h} N{n} D{d} {mode}"

    def suite_result(self) -> SuiteResult:
        """Rows of the modes whose reference ran, as a :class:`SuiteResult` (ratios to the reference)."""
        ref = reference_impl(self.device)
        cases = {r.case for r in self.rows if r.impl == ref}
        return SuiteResult(
            name="kernels",
            title=f"kernels {self.case.name}, {str(self.dtype).removeprefix('torch.')}, "
            f"ratio = ms / {ref} (lower is faster)",
            reference=ref,
            rows=[r for r in self.rows if r.case in cases],
            notes=list(self.notes),
        )

    def to_dict(self) -> dict[str, Any]:
        result = self.suite_result()
        out = result.to_dict()
        out.update(
            case=self.case.name,
            shape=list(self.shape),
            device=torch.cuda.get_device_name() if self.device == "cuda" else "cpu",
            dtype=str(self.dtype).removeprefix("torch."),
            modes_done=list(self.modes_done),
            complete=sorted(self.modes_done) == sorted(MODES),
            skipped=list(self.skipped),
            sparsity=dict(self.sparsity),
            unreferenced=[asdict(r) for r in self.rows if r.case not in {o.case for o in result.rows}],
        )
        return out


def block_support(x: Inputs, tile: int = SUPPORT_TILE) -> dict[str, float]:
    """Share of ``tile x tile`` (query, key) tiles with any nonzero entmax-1.5 weight, on batch 0,
    head 0 (torch path, float32); the tile shrinks to ``N // 4`` on tiny inputs."""
    tile = max(1, min(tile, x.q.shape[-2] // 4))
    q, k, v = (t[:1, :1].detach().float() for t in (x.q, x.k, x.v))
    _, weights = attention(q, k, v, normalizer="entmax15", return_weights=True, backend="reference")
    n = weights.shape[-1]
    tiles = math.ceil(n / tile)
    padded = F.pad(weights[0, 0] > 0, (0, tiles * tile - n, 0, tiles * tile - n))
    live = padded.reshape(tiles, tile, tiles, tile).any(3).any(1)
    support = (weights[0, 0] > 0).sum(-1).float()
    return {
        "tile": float(tile),
        "live_tile_fraction": live.float().mean().item(),
        "mean_support_keys": support.mean().item(),
    }


@dataclass
class _Prepared:
    fn: Fn
    reps: int
    extra: dict[str, float]


REF_SLICE = (slice(0, 1), slice(0, 2))  # batch 0, heads 0-1: the reference's (B, H, N, N) tensors stay small


def _sliced(x: Inputs) -> Inputs:
    """The inputs of batch 0, heads 0-1 (attention is independent per batch and head)."""
    b, h = REF_SLICE
    views: dict[int, torch.Tensor] = {}  # q and k stay one tensor where they are (the local case)
    q, k, v, sigma, alpha = (views.setdefault(id(t), t[b, h]) for t in (x.q, x.k, x.v, x.sigma, x.alpha))
    return Inputs(q, k, v, sigma, alpha, x.prefix, x.grid)


def _gate(impl: Impl, x: Inputs, mode: str, res: CaseResult) -> tuple[Impl, dict[str, float]]:
    """Run ``impl`` once with gradients (``mode`` fwd+bwd) or without, and check it against the reference
    backend on the slice :data:`REF_SLICE` (:func:`check_outputs`). A FlexAttention backward that fails
    with the Gaussian parameters' gradients is run with q, k, v gradients only (returned as the impl to
    time, a note added, ``ranked`` 0)."""
    key = (impl.family, id(x))
    if key not in res.refs:
        g = torch.Generator(device=x.q.device).manual_seed(1)
        grad = torch.randn(x.q.shape, device=x.q.device, generator=g, dtype=torch.float32)
        res.grads[id(x)] = grad.to(x.q.dtype)
        res.refs[key] = reference_outputs(impl.family, _sliced(x), grad[REF_SLICE])
    grad = res.grads[id(x)]
    b, h = REF_SLICE
    if mode == "fwd":
        with torch.no_grad():
            out = impl.build(x)()
        return impl, check_outputs(out[b, h], [], res.refs[key], impl.family, x.q.dtype)
    run = impl
    leaves = x.leaves(impl.bias_grads)
    try:
        out = impl.build(x)()
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    except Exception:
        if impl.name != "gaussian flex":
            raise
        run = Impl(impl.name, "softmax", impl.build)  # q, k, v gradients only
        leaves = x.leaves(False)
        out = impl.build(x)()
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
        res.notes.append(f"{impl.name} {mode}: q, k, v gradients only (none for sigma, alpha): not ranked")
    sliced = [None if t is None else t[b, h] for t in grads]
    return run, check_outputs(out[b, h], sliced, res.refs[key], impl.family, x.q.dtype)


def _prepare_timed(impl: Impl, inputs: Inputs, mode: str, res: CaseResult) -> _Prepared:
    """Build ``impl``'s callable, gate it (:func:`_gate`, once per implementation and inputs: its first
    mode, fwd+bwd), run it once more (compile / autotune), take its peak memory and pick the repetitions
    per timed sample."""
    gate_key = f"{impl.name}|{id(inputs)}"
    if gate_key not in res.gates:
        impl, res.gates[gate_key] = _gate(impl, inputs, mode, res)
        res.timed_as[gate_key] = impl
    impl = res.timed_as.get(gate_key, impl)
    extra = dict(res.gates[gate_key])
    fn = _prepare(impl, inputs, mode)
    if res.dry:  # the interpreter is slow: the one timed call is the only one
        return _Prepared(fn, 1, extra)
    fn()
    peak = _peak_mib(fn, res.device)
    if peak is not None:
        extra["peak_mib"] = peak
    _sync(res.device)
    t0 = time.perf_counter()
    fn()
    _sync(res.device)
    est_ms = (time.perf_counter() - t0) * 1e3
    return _Prepared(fn, max(1, min(200, round(TARGET_MS / max(est_ms, 1e-3)))), extra)


def _measure_mode(res: CaseResult, impls: list[tuple[Impl, Inputs]], mode: str, rounds: int) -> None:
    """Time every implementation of one mode, interleaved, and append the rows (ms per call)."""
    b, h, n, d = res.shape
    prepared: dict[str, _Prepared] = {}
    for impl, inputs in impls:
        reason = _unavailable(impl, res.device, mode, b * h * n * n)
        if reason is None and res.deadline is not None and time.time() > res.deadline:
            reason = "out of time: the run's time limit is near"
        if reason is not None:
            res.skipped.append({"mode": mode, "impl": impl.name, "reason": reason})
            continue
        try:
            prepared[impl.name] = _prepare_timed(impl, inputs, mode, res)
        except Exception as exc:  # noqa: BLE001  (a failing implementation is reported, not fatal)
            res.skipped.append({"mode": mode, "impl": impl.name, "reason": _failure(exc)})
            if res.device == "cuda":
                torch.cuda.empty_cache()
    label = res.label(mode)
    timed = {name: _repeated(p.fn, p.reps) for name, p in prepared.items()}
    flops = 4.0 * b * h * n * n * d * (1.0 if mode == "fwd" else 3.5)
    warmup = 0 if res.dry else 1
    try:
        measured = compare(label, timed, warmup=warmup, repeat=rounds)
    except Exception:  # noqa: BLE001  (one failing implementation: time the others one by one)
        measured = []
        for name, fn in timed.items():
            try:
                measured += compare(label, {name: fn}, warmup=warmup, repeat=rounds)
            except Exception as exc:  # noqa: BLE001
                res.skipped.append({"mode": mode, "impl": name, "reason": _failure(exc)})
    for m in measured:
        p = prepared[m.impl]
        ms = m.ms / p.reps
        extra = {**p.extra, "reps_per_sample": float(p.reps), "tflops": flops / (ms * 1e-3) / 1e12}
        res.rows.append(Measurement(m.case, m.impl, ms, m.ms_min / p.reps, m.repeats, extra))
    rows = [r for r in res.rows if r.case == label]
    if any("peak_mib" in r.extra for r in rows):
        peaks = [f"{r.impl} {r.extra['peak_mib']:.0f}" for r in rows if "peak_mib" in r.extra]
        res.notes.append(f"{label} peak MiB: " + ", ".join(peaks))
    res.notes.append(f"{label} TFLOP/s: " + ", ".join(f"{r.impl} {r.extra['tflops']:.3g}" for r in rows))
    res.modes_done.append(mode)


def warm_one(case_name: str, impl_name: str, mode: str, dry: bool = False) -> None:
    """Run ``impl_name`` of case ``case_name`` once in ``mode`` on the case's shape (the dry shape if
    ``dry``): under ``VITATTN_TRITON_COMPILE_ONLY=1`` this compiles every kernel and tile the benchmark
    will launch (``benchmarks/warm_kernels.py``)."""
    case = CASES[case_name]
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    x = make_inputs(case.dry_shape if dry else case.shape, device, dtype, local=case.local)
    impl = next(i for i in implementations(device, case.local) if i.name == impl_name)
    _prepare(impl, x, mode)()


# compiled on first use: FlexAttention (torch.compile), AdaSplash (its Triton JIT)
PEERS_TO_WARM = ("gaussian flex", "entmax15 adasplash")


def warm_peer(case_name: str, impl_name: str, mode: str, dry: bool = False) -> str | None:
    """Run peer ``impl_name`` of case ``case_name`` once in ``mode`` (FlexAttention's ``torch.compile``,
    AdaSplash's Triton JIT), so that the timed step finds them in the caches; returns why it cannot run
    here instead (``None`` when it ran)."""
    case = CASES[case_name]
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    shape = case.dry_shape if dry else case.shape
    impl = next((i for i in implementations(device, case.local) if i.name == impl_name), None)
    if impl is None:
        return f"{impl_name} is not benchmarked in case {case_name}"
    elements = shape[0] * shape[1] * shape[2] * shape[2]
    reason = _unavailable(impl, device, mode, elements)
    if reason is not None:
        return reason
    _prepare(impl, make_inputs(shape, device, dtype, local=case.local), mode)()
    return None


def peer_warm_specs() -> list[tuple[str, str, str]]:
    """``(case, impl, mode)`` of every peer launch that compiles on first use (:func:`warm_peer`)."""
    specs = []
    for name, case in CASES.items():
        for impl in implementations("cuda", case.local):
            if impl.name in PEERS_TO_WARM:
                specs += [(name, impl.name, mode) for mode in MODES]
    return specs


def warm_specs() -> list[tuple[str, str, str]]:
    """``(case, impl, mode)`` of every vitattn launch of the suite (what :func:`warm_one` takes)."""
    specs = []
    for name, case in CASES.items():
        for impl in implementations("cuda", case.local):
            if impl.name.endswith("vitattn"):
                specs += [(name, impl.name, mode) for mode in MODES]
    return specs


def run_case(
    case: Case,
    *,
    device: str,
    dtype: torch.dtype,
    dry: bool = False,
    rounds: int = 5,
    on_mode: Callable[[CaseResult], None] | None = None,
    deadline: float | None = None,
) -> CaseResult:
    """Measure every implementation of ``case`` in each of :data:`MODES`; ``on_mode`` is called after
    each mode (to save partial results); after ``deadline`` (a ``time.time()``) implementations not yet
    started are skipped, so a run with a time limit still times what it prepared."""
    shape = case.dry_shape if dry else case.shape
    res = CaseResult(case, shape, device, dtype, dry, deadline=deadline)
    x = make_inputs(shape, device, dtype, local=case.local)
    impls = [(impl, x) for impl in implementations(device, case.local)]
    if case.local:
        rand = make_inputs(shape, device, dtype)
        base = next(i for i, _ in impls if i.name == "entmax15 vitattn")
        impls.append((Impl("entmax15 vitattn random", base.family, base.build), rand))
        local, other = block_support(x), block_support(rand)
        res.sparsity = {**local, "random_live_tile_fraction": other["live_tile_fraction"]}
        res.notes.append(
            f"{case.name}: {local['live_tile_fraction']:.1%} of {local['tile']:.0f}x{local['tile']:.0f} "
            f"tiles have entmax support ({local['mean_support_keys']:.0f} keys per query); random inputs "
            f"(entmax15 vitattn random): {other['live_tile_fraction']:.1%}"
        )
    for mode in MODES:
        _measure_mode(res, impls, mode, rounds)
        if on_mode is not None:
            on_mode(res)
    return res


def run_cases(
    names: list[str],
    *,
    dry: bool = False,
    rounds: int | None = None,
    on_mode: Callable[[CaseResult], None] | None = None,
    deadline: float | None = None,
) -> list[CaseResult]:
    """Run the named cases (on CUDA in bf16; ``dry``: tiny shapes on the CPU in float32)."""
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown kernel benchmark case(s) {unknown}; known: {sorted(CASES)}")
    device = "cpu" if dry else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the kernels benchmark needs a CUDA GPU (dry=True runs tiny shapes on the CPU)")
    dtype = torch.float32 if dry else torch.bfloat16
    rounds = rounds or (1 if dry else 5)
    out = []
    for name in names:
        case = CASES[name]
        out.append(
            run_case(
                case, device=device, dtype=dtype, dry=dry, rounds=rounds, on_mode=on_mode, deadline=deadline
            )
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def payload(results: list[CaseResult], start: float, dry: bool) -> dict[str, Any]:
    """The JSON of a run: versions, the machine, and each case's :meth:`CaseResult.to_dict`."""
    return {
        "suite": "kernels",
        "dry_run": dry,
        "machine": machine(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flops": "nominal: 4 B H N^2 D forward, 3.5x for forward + backward",
        "seconds": round(time.time() - start, 1),
        "cases": [r.to_dict() for r in results],
        "tuning": tuning_log(),
    }


def tuning_log() -> dict[str, dict[str, Any]]:
    """The Triton kernels' tile picks in this process (``vitattn.kernels.ops.tuning_log``: per tuning key
    the tile, how it was got, and every candidate's times where it was timed here); empty when no
    kernel was launched (the module is not imported for that)."""
    ops = sys.modules.get("vitattn.kernels.ops")
    return ops.tuning_log() if ops is not None else {}


def tuning_lines(log: dict[str, dict[str, Any]]) -> list[str]:
    """One line per tile timed in this process: the key, the pick and each candidate's lower time (ms)."""
    lines = []
    for key, entry in log.items():
        if entry.get("source") != "timed":
            continue
        times = ", ".join(f"{tile} {min(ms):.3g}" for tile, ms in entry["ms"].items())
        lines.append(f"tuned {key}: {entry['tile']} ({times})")
    return lines


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001
        return None


def skip_notes(results: list[CaseResult]) -> list[str]:
    """One note per distinct reason: ``skipped (reason): impl [modes], ...``, in first-seen order."""
    by_reason: dict[str, dict[str, list[str]]] = {}
    for r in results:
        for s in r.skipped:
            modes = by_reason.setdefault(s["reason"], {}).setdefault(s["impl"], [])
            if s["mode"] not in modes:
                modes.append(s["mode"])
    return [
        f"skipped ({reason}): " + ", ".join(f"{impl} [{', '.join(modes)}]" for impl, modes in impls.items())
        for reason, impls in by_reason.items()
    ]


@register_suite("kernels", "Triton kernels vs SDPA flash/cuDNN, dense bias, Flex, AdaSplash (CUDA, bf16)")
def kernels_suite(quick: bool = False) -> SuiteResult:
    """Every case on CUDA (``quick``: ``vit_b`` and ``sparse``); without CUDA the dry-run shapes, CPU."""
    dry = not torch.cuda.is_available()
    results = run_cases(["vit_b", "sparse"] if quick else list(CASES), dry=dry, rounds=3 if quick else None)
    parts = [r.suite_result() for r in results]
    ref = reference_impl("cpu" if dry else "cuda")
    return SuiteResult(
        name="kernels",
        title=f"fused attention kernels and their peers, ratio = ms / {ref} (lower is faster)",
        reference=ref,
        rows=[row for p in parts for row in p.rows],
        notes=[note for p in parts for note in p.notes] + skip_notes(results),
    )
