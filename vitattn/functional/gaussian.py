"""The Gaussian locality bias of GAug (LocAt) attention, described once and computed separably.

For a query patch ``p`` and a key patch ``t`` on a ``(gh, gw)`` grid::

    D_m   = max(-(coord_p,m - coord_t,m)^2 / 2, clamp)          m in {row, column}
    S_pt  = alpha_p * exp(sum_m D_m / (r * sigma_p,m + eps))

where ``r = min(grid) / min(initial_grid)`` rescales the variances when the resolution changes, and
``eps`` and ``clamp`` depend only on the initial grid (see :func:`gaussian_eps` and
:func:`gaussian_clamp`). Rows and columns of prefix tokens (class / register tokens) get ``S = 0``.

Because the exponent is a sum over the two axes, ``S_pt = alpha_p * R_p[row_t] * C_p[col_t]`` with
one factor per axis: no ``(N, N, 2)`` tensor is ever needed, and a fused kernel needs no ``N x N``
tensor at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_floating, check_rank, grid_pair, shape_str
from .dtypes import compute_dtype

__all__ = ["ColumnBlock", "GaussianBias", "gaussian_eps", "gaussian_clamp"]

_FP16_HALF_MAX = 32500.0  # half of float16's largest value (65000 / 2): the exponent's bound per axis
_CLAMP_FLOOR = -6550.0  # float16-safe floor of D_m at the smallest eps
_EXPONENT_FLOOR = -40.0  # per-axis exponent floor, see axis_factors
_LOG2E = 1.4426950408889634  # exp(x) = 2 ** (x * log2(e)); torch's exp2 is the faster CPU kernel
_NUMERATOR_CACHE_SIZE = 32  # grids x devices x dtypes whose numerator tables are kept
_NUMERATORS: dict[tuple, torch.Tensor] = {}


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


def _floored_exp2(exponent: torch.Tensor) -> torch.Tensor:
    """``exp2`` of per-axis exponents in log2 units, each floored at the equivalent of -40 first.

    The exponents are in log2 units (the numerator table holds ``D * log2(e)``), so exp is exp2,
    ~3x faster on the CPU. e^-40 ~ 4e-18: the floor moves the bias by at most ``alpha * 4e-18``
    where it was smaller still (invisible next to any score), while exp2 and the products stay
    clear of denormals, which are ~10x slower on CPUs. ``exponent`` is clamped in place.
    """
    return torch.exp2(exponent.clamp_min_(_EXPONENT_FLOOR * _LOG2E))


_LN2 = 0.6931471805599453


def _axis_factors_t(
    table: torch.Tensor, den: torch.Tensor, grid_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F = [R; C]ᵀ: (..., gh + gw, Np), E)``: both axes' factors with the query index last and
    their floored exponent ``E`` (log2 units), from the numerator table ``(gh + gw, Np)`` and the
    denominators ``den: (..., 2, Np)``. The one statement of the factor formula."""
    gh, gw = grid_size
    if gh == gw:  # one broadcast division: (2, g, Np) / (..., 2, 1, Np)
        exponent = (table.unflatten(0, (2, gh)) / den.unsqueeze(-2)).flatten(-3, -2)
    else:
        exponent = torch.cat([table[:gh] / den[..., 0:1, :], table[gh:] / den[..., 1:2, :]], dim=-2)
    return _floored_exp2(exponent), exponent


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


@dataclass(frozen=True, eq=False)  # holds tensor views: identity, not elementwise, equality
class ColumnBlock:
    """One keys-first block ``out: (..., N, rows)`` of the transposed bias (from
    :meth:`GaussianBias.column_block`): the views its writes need, made once."""

    out: torch.Tensor
    start: int  # first query row of the block
    stop: int
    zeros: tuple[torch.Tensor, ...]  # prefix keys, prefix queries: bias 0
    patches: torch.Tensor | None  # (..., gh, gw, patch queries of the block); None if there are none
    lo: int  # the patch queries' range among all Np patches
    hi: int
    num_patches: int

    @property
    def rows(self) -> int:
        """Query rows in the block."""
        return self.stop - self.start

    @property
    def all_rows(self) -> bool:
        """Whether the block holds every query row (``N`` of them)."""
        return self.start == 0 and self.stop == self.out.shape[-2]

    def write(self, factors_t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Write the block's bias from :meth:`GaussianBias.key_major_factors` ``(..., gh, Np)``,
        ``(..., gw, Np)`` (leading dims broadcast against ``out``'s); returns ``out``."""
        for view in self.zeros:
            view.zero_()
        if self.patches is not None:
            ra_t, c_t = factors_t
            if self.lo > 0 or self.hi < self.num_patches:
                ra_t, c_t = ra_t[..., self.lo : self.hi], c_t[..., self.lo : self.hi]
            torch.mul(ra_t.unsqueeze(-2), c_t.unsqueeze(-3), out=self.patches)
        return self.out


@dataclass(frozen=True)
class GaussianBias:
    """Description of the GAug additive bias for one attention call.

    Args:
        sigma: ``(B, H, Np, 2)`` variances per spatial query, (row, column), after the layer's
            activation, as predicted for the initial grid.
        alpha: ``(B, H, Np, 1)`` non-negative amplitudes per spatial query.
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
        if int(self.num_prefix_tokens) < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {self.num_prefix_tokens}")
        object.__setattr__(self, "num_prefix_tokens", int(self.num_prefix_tokens))
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

    # ---- tensors --------------------------------------------------------------------------------
    def _work_dtype(self) -> torch.dtype:
        return compute_dtype(self.sigma)

    def denominators(self) -> torch.Tensor:
        """``(B, H, Np, 2)`` effective denominators ``r * sigma + eps`` in float32 (float64 stays)."""
        sigma = self.sigma.to(self._work_dtype())
        scale = self.resolution_scale
        if scale != 1.0:
            sigma = sigma * scale
        return sigma + self.eps

    def axis_numerators(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clamped ``D`` per axis: ``(gh, gh)`` for rows and ``(gw, gw)`` for columns."""
        device = self.sigma.device if device is None else device
        out = []
        for n in self.grid_size:
            pos = torch.arange(n, device=device, dtype=self._work_dtype())
            d = -0.5 * (pos[:, None] - pos[None, :]) ** 2
            out.append(d.clamp_min(self.clamp))
        return out[0], out[1]

    def _patch_numerators(self) -> torch.Tensor:
        """``(gh + gw, Np)``, contiguous: each patch's row numerators, then its column numerators,
        times log2(e), with the patch index last.

        Constant for a grid, so cached (outside autograd and inference mode) except while compiling.
        """
        key = (self.grid_size, self.clamp, self.sigma.device, self._work_dtype())
        cached = None if torch.compiler.is_compiling() else _NUMERATORS.get(key)
        if cached is not None:
            return cached
        with torch.inference_mode(False), torch.no_grad():
            gh, gw = self.grid_size
            d_row, d_col = self.axis_numerators()
            rows = torch.arange(gh, device=d_row.device).repeat_interleave(gw)  # row index of each patch
            cols = torch.arange(gw, device=d_row.device).repeat(gh)  # column index of each patch
            table = (torch.cat([d_row[rows], d_col[cols]], dim=-1) * _LOG2E).t().contiguous()
        if not torch.compiler.is_compiling():
            if len(_NUMERATORS) >= _NUMERATOR_CACHE_SIZE:
                _NUMERATORS.pop(next(iter(_NUMERATORS)))
            _NUMERATORS[key] = table
        return table

    def axis_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Separable factors ``R: (B, H, Np, gh)`` and ``C: (B, H, Np, gw)``.

        ``R[..., p, i] = exp(D_row(row_p, i) / den_p,row)``, likewise for columns, so that
        ``S[p, t] = alpha_p * R[p, row_t] * C[p, col_t]``. Both are transposed views of one exp2
        over ``(B, H, gh + gw, Np)`` (the layout :meth:`key_major_factors` works in).
        """
        den = self.denominators().transpose(-1, -2)  # (B, H, 2, Np)
        factors = _axis_factors_t(self._patch_numerators(), den, self.grid_size)[0]
        r_t, c_t = factors.split(self.grid_size, dim=-2)
        return r_t.transpose(-1, -2), c_t.transpose(-1, -2)

    def scaled_factors(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``alpha * R: (B, H, Np, gh)`` and ``C: (B, H, Np, gw)``, in ``dtype`` (default: the work
        dtype): transposed views of :meth:`key_major_factors`."""
        ra_t, c_t = self.key_major_factors(dtype)
        return ra_t.transpose(-1, -2), c_t.transpose(-1, -2)

    def key_major_factors(
        self, dtype: torch.dtype | None = None, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale * alpha * R)ᵀ: (B, H, gh, Np)`` and ``Cᵀ: (B, H, gw, Np)``: the factors with the
        query index last (the layout :meth:`write_columns` reads and the factors are computed in),
        in ``dtype`` (default: the work dtype); ``scale`` multiplies alpha (the bias is scaled by it).

        With autograd, outside ``torch.compile``, the gradient to σ and α is a hand-written backward
        (:class:`_KeyMajorFactors`); otherwise autograd follows the elementwise steps.
        """
        table = self._patch_numerators()  # (gh + gw, Np)
        den = self.denominators().transpose(-1, -2)  # (B, H, 2, Np)
        alpha = self.alpha.to(den.dtype).transpose(-1, -2)  # (B, H, 1, Np)
        needs_grad = torch.is_grad_enabled() and (den.requires_grad or alpha.requires_grad)
        if needs_grad and not torch.compiler.is_compiling():
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

    def write_rows(
        self, out: torch.Tensor, start: int, factors: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Write rows ``start .. start + out.shape[-2]`` of the dense bias into ``out: (B, H, rows, N)``.

        ``factors`` are :meth:`scaled_factors` in ``out``'s dtype (computed when not given), so that
        a caller writing many row blocks computes them once. Not differentiable; returns ``out``.
        """
        p = self.num_prefix_tokens
        gh, gw = self.grid_size
        rows = out.shape[-2]
        stop = start + rows
        if not 0 <= start <= stop <= self.num_tokens or out.shape[-1] != self.num_tokens:
            raise ValueError(
                f"write_rows: rows {start}..{stop} of a (B, H, {self.num_tokens}, {self.num_tokens}) bias do "
                f"not fit out of shape {shape_str(out)}"
            )
        ra, c = self.scaled_factors(out.dtype) if factors is None else factors
        first = max(start, p)  # first patch row of the block
        if first < stop:
            patch_rows = out[..., first - start :, p:].unflatten(-1, (gh, gw))
            lo, hi = first - p, stop - p
            if torch.compiler.is_compiling():  # dynamo takes no non-contiguous out= (a graph break)
                patch_rows.copy_(ra[..., lo:hi, :, None] * c[..., lo:hi, None, :])
            else:
                torch.mul(ra[..., lo:hi, :, None], c[..., lo:hi, None, :], out=patch_rows)
        # zeros after the product, which touches fresh pages in order (a column first is slow)
        if first > start:
            out[..., : first - start, :].zero_()
        if p:
            out[..., first - start :, :p].zero_()
        return out

    def column_block(self, out: torch.Tensor, start: int) -> ColumnBlock:
        """Views of ``out: (..., N, rows)``, the transposed (keys-first) bias of query rows
        ``start .. start + out.shape[-1]``, for :meth:`ColumnBlock.write` (see :meth:`write_columns`).

        A caller that writes the same block many times (one head after another) makes the views once.
        """
        p = self.num_prefix_tokens
        gh, gw = self.grid_size
        rows = out.shape[-1]
        stop = start + rows
        if not 0 <= start <= stop <= self.num_tokens or out.dim() < 2 or out.shape[-2] != self.num_tokens:
            raise ValueError(
                f"write_columns: query rows {start}..{stop} of a (B, H, {self.num_tokens}, "
                f"{self.num_tokens}) bias, keys first, do not fit out of shape {shape_str(out)}"
            )
        first = max(start, p)  # first patch query of the block
        zeros = []
        if p:
            zeros.append(out[..., :p, :])  # prefix keys
        if first > start:
            zeros.append(out[..., p:, : first - start])  # prefix queries
        patches = out[..., p:, first - start :].unflatten(-2, (gh, gw)) if first < stop else None
        return ColumnBlock(out, start, stop, tuple(zeros), patches, first - p, stop - p, gh * gw)

    def write_columns(
        self, out: torch.Tensor, start: int, factors_t: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Write the transposed bias of query rows ``start .. start + out.shape[-1]`` into
        ``out: (B, H, N, rows)`` (keys first), so ``out[..., t, s] = S[start + s, t]``.

        ``factors_t`` are :meth:`key_major_factors`, ``(B, H, gh, Np)`` and ``(B, H, gw, Np)``, in
        ``out``'s dtype (any common scale, e.g. log2(e), is the caller's). The query index is then
        the contiguous one of all three tensors, so the outer product runs vectorized
        (:meth:`write_rows`' innermost run is only ``gw`` long). Leading dims other than ``(B, H)``
        work alike. Not differentiable.
        """
        return self.column_block(out, start).write(factors_t)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(B, H, N, N)`` additive bias with zero rows and columns for the prefix tokens."""
        p = self.num_prefix_tokens
        needs_grad = torch.is_grad_enabled() and (self.sigma.requires_grad or self.alpha.requires_grad)
        if needs_grad:
            s = self.patch_bias()
            if p:
                s = torch.nn.functional.pad(s, (p, 0, p, 0))
            return s if dtype is None else s.to(dtype)
        # No autograd: write the outer product straight into the result, no temporaries.
        factors = self.scaled_factors(dtype)
        b, h, n_p, _ = factors[0].shape
        n = self.num_tokens
        out = torch.empty(b, h, n, n, dtype=factors[0].dtype, device=factors[0].device)
        return self.write_rows(out, 0, factors)
