"""The Gaussian locality bias of GAug (LocAt) attention, described once and computed separably.

For a query patch ``p`` and a key patch ``t`` on a ``(gh, gw)`` grid::

    E_m   = max(max(-(coord_p,m - coord_t,m)^2 / 2, clamp) / (r * sigma_p,m + eps), -40)   m in {row, column}
    S_pt  = alpha_p * exp(E_row + E_col)

where ``r = min(grid) / min(initial_grid)`` rescales the variances when the resolution changes, and
``eps`` and ``clamp`` depend only on the initial grid (see :func:`gaussian_eps` and
:func:`gaussian_clamp`). Rows and columns of prefix tokens (class / register tokens) get ``S = 0``.
:func:`gaussian_exponent` states ``E_m`` for every path of the library (the Triton kernels are
tested against it); the floor at -40 moves ``S`` by at most ``alpha * e^-40 ~ 4e-18 alpha`` where
it binds and keeps every exponential clear of denormals.

Because the exponent is a sum over the two axes, ``S_pt = alpha_p * R_p[row_t] * C_p[col_t]`` with
one factor per axis: no ``(N, N, 2)`` tensor is ever needed, and a fused kernel needs no ``N x N``
tensor at all. :class:`GaussianBias` describes the bias of one call (σ, α, grid, prefix tokens) and
gives its dense form and its separable factors; the block layouts a fast path writes live with that
path (``vitattn.functional.cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_count, check_floating, check_rank, grid_pair, shape_str
from .dtypes import compute_dtype
from .value_checks import check_at_least, check_finite

__all__ = [
    "EXPONENT_FLOOR",
    "LOG2E",
    "GaussianBias",
    "check_gaussian_values",
    "gaussian_clamp",
    "gaussian_eps",
    "gaussian_exponent",
]

_FP16_HALF_MAX = 32500.0  # half of float16's largest value (65000 / 2): the exponent's bound per axis
_CLAMP_FLOOR = -6550.0  # float16-safe floor of D_m at the smallest eps
EXPONENT_FLOOR = -40.0  # per-axis exponent floor (natural-log units), see gaussian_exponent
LOG2E = 1.4426950408889634  # exp(x) = 2 ** (x * log2(e))
_LN2 = 0.6931471805599453


def gaussian_eps(initial_grid_size: tuple[int, int]) -> float:
    """eps added to the variances: 0.1, doubled while ``(max(grid) - 1)^2 / 2 / eps^2 > 32500``."""
    eps = 0.1
    numerator = 0.5 * (max(initial_grid_size) - 1) ** 2
    while numerator / eps**2 > _FP16_HALF_MAX:
        eps *= 2.0
    return eps


def gaussian_clamp(initial_grid_size: tuple[int, int]) -> float:
    """Lower clamp of ``D_m``: ``max(-(max(initial grid) - 1)^2 / 2, -6550)``."""
    return max(-0.5 * (max(initial_grid_size) - 1) ** 2, _CLAMP_FLOOR)


def gaussian_exponent(offset: torch.Tensor, den: torch.Tensor, clamp: float) -> torch.Tensor:
    """The per-axis exponent of the Gaussian bias, ``max(max(-offset^2 / 2, clamp) / den, -40)``.

    ``offset`` is the grid offset along one axis (query coordinate minus key coordinate), ``den`` the
    effective denominator ``r * sigma + eps`` of that axis (broadcast against ``offset``), ``clamp``
    :func:`gaussian_clamp` of the initial grid. In natural-log units: the bias is
    ``alpha * exp(E_row + E_col)``. The one statement of the exponent; the separable factors compute
    it per axis in log2 units (the same value times ``log2(e)``), the Triton kernels are checked
    against it.
    """
    numerator = (-0.5 * offset * offset).clamp_min(clamp)
    return (numerator / den).clamp_min(EXPONENT_FLOOR)


def _axis_factors_t(
    table: torch.Tensor, den: torch.Tensor, grid_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F = [R; C]ᵀ: (..., gh + gw, Np), E)``: both axes' factors with the query index last and their
    exponent ``E`` in log2 units (:func:`gaussian_exponent` times ``log2(e)``), from the numerator table
    ``(gh + gw, Np)`` (:meth:`GaussianBias.numerator_table`, clamped and already times ``log2(e)``) and
    the denominators ``den: (..., 2, Np)``. ``F = exp2(E)`` (log2 units: exp2 is the cheaper CPU kernel,
    docs/benchmarks.md)."""
    gh, gw = grid_size
    if gh == gw:  # one broadcast division: (2, g, Np) / (..., 2, 1, Np)
        exponent = (table.unflatten(0, (2, gh)) / den.unsqueeze(-2)).flatten(-3, -2)
    else:
        exponent = torch.cat([table[:gh] / den[..., 0:1, :], table[gh:] / den[..., 1:2, :]], dim=-2)
    exponent = exponent.clamp_min_(EXPONENT_FLOOR * LOG2E)
    return torch.exp2(exponent), exponent


def _key_major_factors(
    table: torch.Tensor,
    den: torch.Tensor,
    alpha: torch.Tensor,
    grid_size: tuple[int, int],
    scale: float,
    slopes: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(scale alpha R)ᵀ: (..., gh, Np)``, ``Cᵀ: (..., gw, Np)`` and both factors ``F`` (see
    :func:`_axis_factors_t`), with ``alpha: (..., 1, Np)``. With ``slopes``, also ``F * E`` (``E``
    the floored exponent), so that ``dF / d den = -ln 2 * F * E / den``. Where the floor binds, the
    clamp's derivative is 0 but ``F * E`` is about ``-58 * 2^-58``: kept, as it is below rounding
    next to any unfloored term of the same sum."""
    factors, exponent = _axis_factors_t(table, den, grid_size)
    slope = factors * exponent if slopes else None
    r_t, c_t = factors.split(grid_size, dim=-2)
    return r_t * (alpha if scale == 1.0 else alpha * scale), c_t, factors, slope


class _KeyMajorFactors(torch.autograd.Function):
    """:func:`_key_major_factors` with a hand-written backward to ``den`` and ``alpha``: a few
    reductions over the factors instead of autograd's chain of full-size elementwise steps (split,
    mul, exp2, clamp, div, each with its own pass)."""

    @staticmethod
    def forward(
        ctx,
        table: torch.Tensor,
        den: torch.Tensor,
        alpha: torch.Tensor,
        grid_size: tuple[int, int],
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ra_t, c_t, factors, slope = _key_major_factors(table, den, alpha, grid_size, scale, slopes=True)
        ctx.save_for_backward(factors, slope, den, alpha)
        ctx.gh, ctx.scale = grid_size[0], scale
        return ra_t, c_t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_ra: torch.Tensor, d_c: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        factors, slope, den, alpha = ctx.saved_tensors
        gh, scale = ctx.gh, ctx.scale
        # ra = scale alpha R and c = C, with F = 2^E, E = table / den floored: dF / d den = -ln 2 F E / den
        d_r = d_ra * (alpha if scale == 1.0 else alpha * scale)  # the gradient reaching R
        d_den = torch.cat(
            [
                (d_r * slope[..., :gh, :]).sum(-2, keepdim=True),
                (d_c * slope[..., gh:, :]).sum(-2, keepdim=True),
            ],
            dim=-2,
        )
        d_den = d_den.mul_(-_LN2).div_(den)
        d_alpha = (d_ra * factors[..., :gh, :]).sum(-2, keepdim=True)  # d alpha = scale * sum_g d_ra R
        if scale != 1.0:
            d_alpha.mul_(scale)
        return None, d_den, d_alpha, None, None


@dataclass(frozen=True)
class GaussianBias:
    """Description of the GAug additive bias for one attention call.

    Args:
        sigma: ``(B, H, Np, 2)`` variances per spatial query, (row, column), after the layer's
            activation, as predicted for the initial grid: ``>= 0`` (a negative σ makes the
            exponent's denominator ``r·σ + eps`` vanish or change sign; NaN gives NaN rows). Checked by
            the ``reference`` backend and, with value checks on (``VITATTN_CHECK_VALUES=1``), by every
            call; not read back otherwise (a device sync).
        alpha: ``(B, H, Np, 1)`` amplitudes per spatial query, any finite real values: GAug's
            softplus gives α ≥ 0, its identity start's signed per-head gate may make them negative
            (every backend computes either sign).
        grid_size: current patch grid ``(gh, gw)`` with ``gh * gw == Np``.
        num_prefix_tokens: class / register tokens before the patches (their rows/columns get 0).
        initial_grid_size: the grid the model was built for; defaults to ``grid_size``. It fixes
            eps and the clamp, and the variances are scaled by ``min(grid) / min(initial_grid)``.
    """

    sigma: torch.Tensor
    alpha: torch.Tensor
    grid_size: tuple[int, int]
    num_prefix_tokens: int = 0
    initial_grid_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid_size", grid_pair("grid_size", self.grid_size))
        init = self.grid_size if self.initial_grid_size is None else self.initial_grid_size
        object.__setattr__(self, "initial_grid_size", grid_pair("initial_grid_size", init))
        prefix = check_count("num_prefix_tokens", self.num_prefix_tokens)
        object.__setattr__(self, "num_prefix_tokens", prefix)
        check_rank("sigma", self.sigma, 4, "(B, H, Np, 2)")
        check_rank("alpha", self.alpha, 4, "(B, H, Np, 1)")
        check_floating("sigma", self.sigma)
        check_floating("alpha", self.alpha)
        gh, gw = self.grid_size
        if self.sigma.shape[-1] != 2 or self.sigma.shape[-2] != gh * gw:
            raise ValueError(
                f"sigma must be (B, H, Np, 2) with Np = {gh}*{gw} = {gh * gw} for grid_size "
                f"{self.grid_size}, got shape {shape_str(self.sigma)}"
            )
        if self.alpha.shape[-1] != 1 or self.alpha.shape[:-1] != self.sigma.shape[:-1]:
            raise ValueError(
                f"alpha must be (B, H, Np, 1) matching sigma {shape_str(self.sigma)}, "
                f"got shape {shape_str(self.alpha)}"
            )

    # ---- scalars fixed by the grids -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """N = prefix tokens + patches."""
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    @property
    def eps(self) -> float:
        return gaussian_eps(self.initial_grid_size)  # type: ignore[arg-type]

    @property
    def clamp(self) -> float:
        return gaussian_clamp(self.initial_grid_size)  # type: ignore[arg-type]

    @property
    def resolution_scale(self) -> float:
        """``min(grid) / min(initial_grid)``: 1 at the resolution the model was built for."""
        return min(self.grid_size) / min(self.initial_grid_size)  # type: ignore[arg-type]

    @property
    def requires_grad(self) -> bool:
        """Whether σ or α requires a gradient."""
        return self.sigma.requires_grad or self.alpha.requires_grad

    # ---- tensors --------------------------------------------------------------------------------
    def work_dtype(self) -> torch.dtype:
        """The dtype the bias is computed in: :func:`~vitattn.functional.compute_dtype` of σ."""
        return compute_dtype(self.sigma)

    def denominators(self) -> torch.Tensor:
        """``(B, H, Np, 2)`` effective denominators ``r * sigma + eps`` in float32 (float64 stays)."""
        sigma = self.sigma.to(self.work_dtype())
        scale = self.resolution_scale
        if scale != 1.0:
            sigma = sigma * scale
        return sigma + self.eps

    def numerator_table(self, device: torch.device | None = None) -> torch.Tensor:
        """``(gh + gw, Np)``: each patch's clamped row numerators ``max(-d^2 / 2, clamp)`` against the
        ``gh`` grid rows, then its column numerators against the ``gw`` grid columns, times ``log2(e)``,
        with the patch index last (contiguous), in :meth:`work_dtype`. Constant for a grid; a path that
        calls it often may cache it (the CPU row-blocked paths do)."""
        device = self.sigma.device if device is None else device
        gh, gw = self.grid_size
        dtype = self.work_dtype()

        def numerators(n: int) -> torch.Tensor:  # (n, n): clamped -d^2 / 2 between axis positions, log2 units
            pos = torch.arange(n, device=device, dtype=dtype)
            return (-0.5 * (pos[:, None] - pos[None, :]) ** 2).clamp_min(self.clamp) * LOG2E

        # patch p = r * gw + c: rows [i, p] = D(i, r) (repeated over c), columns [j, p] = D(j, c)
        rows = numerators(gh)[:, :, None].expand(gh, gh, gw)
        cols = numerators(gw)[:, None, :].expand(gw, gh, gw)
        return torch.cat([rows.reshape(gh, gh * gw), cols.reshape(gw, gh * gw)], dim=0)

    def axis_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Separable factors ``R: (B, H, Np, gh)`` and ``C: (B, H, Np, gw)``.

        ``R[..., p, i] = exp(E_row(row_p - i))``, likewise for columns (:func:`gaussian_exponent`), so
        that ``S[p, t] = alpha_p * R[p, row_t] * C[p, col_t]``. Both are transposed views of one exp2
        over ``(B, H, gh + gw, Np)`` (the layout :meth:`key_major_factors` works in).
        """
        den = self.denominators().transpose(-1, -2)  # (B, H, 2, Np)
        factors = _axis_factors_t(self.numerator_table(), den, self.grid_size)[0]
        r_t, c_t = factors.split(self.grid_size, dim=-2)
        return r_t.transpose(-1, -2), c_t.transpose(-1, -2)

    def scaled_factors(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``alpha * R: (B, H, Np, gh)`` and ``C: (B, H, Np, gw)``, in ``dtype`` (default: the work
        dtype): transposed views of :meth:`key_major_factors`."""
        ra_t, c_t = self.key_major_factors(dtype)
        return ra_t.transpose(-1, -2), c_t.transpose(-1, -2)

    def key_major_factors(
        self,
        dtype: torch.dtype | None = None,
        scale: float = 1.0,
        *,
        table: torch.Tensor | None = None,
        hand_backward: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale * alpha * R)ᵀ: (B, H, gh, Np)`` and ``Cᵀ: (B, H, gw, Np)``: the factors with the
        query index last (the layout they are computed in), in ``dtype`` (default: the work dtype);
        ``scale`` multiplies alpha (the bias is scaled by it).

        ``table`` is :meth:`numerator_table` when the caller keeps one. With ``hand_backward`` (an eager
        fast path's choice; not under ``torch.compile``) the gradient to σ and α is a hand-written
        backward of a few reductions; otherwise autograd follows the plain elementwise steps.
        """
        table = self.numerator_table() if table is None else table  # (gh + gw, Np)
        den = self.denominators().transpose(-1, -2)  # (B, H, 2, Np)
        alpha = self.alpha.to(den.dtype).transpose(-1, -2)  # (B, H, 1, Np)
        needs_grad = torch.is_grad_enabled() and (den.requires_grad or alpha.requires_grad)
        if needs_grad and hand_backward:
            ra_t, c_t = _KeyMajorFactors.apply(table, den, alpha, self.grid_size, scale)
        else:
            ra_t, c_t, _, _ = _key_major_factors(table, den, alpha, self.grid_size, scale, slopes=False)
        if dtype is None or dtype == ra_t.dtype:
            return ra_t, c_t
        return ra_t.to(dtype), c_t.to(dtype)

    def patch_bias(self) -> torch.Tensor:
        """``(B, H, Np, Np)`` bias between patches only, in float32 (float64 stays)."""
        ra, c = self.scaled_factors()
        return (ra.unsqueeze(-1) * c.unsqueeze(-2)).flatten(-2)  # (B, H, Np, gh * gw)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(B, H, N, N)`` additive bias with zero rows and columns for the prefix tokens, in ``dtype``
        (default: the work dtype); differentiable in σ and α through plain elementwise steps."""
        s = self.patch_bias()
        p = self.num_prefix_tokens
        if p:
            s = torch.nn.functional.pad(s, (p, 0, p, 0))
        return s if dtype is None else s.to(dtype)


def check_gaussian_values(bias: GaussianBias) -> None:
    """The values of a Gaussian bias in range: σ ``>= 0`` and α finite (reads them back: the
    ``reference`` backend and value-check mode only); a ``ValueError`` naming the first bad entry."""
    check_at_least("bias.sigma", bias.sigma, 0.0, "a variance")
    check_finite("bias.alpha", bias.alpha)
