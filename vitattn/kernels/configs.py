"""Block-size lists the kernels are autotuned over, per GPU arch (all power-of-two tiles, >= 16 in every dim).

Plain data, no triton import: :mod:`vitattn.kernels.ops` turns them into ``triton.Config`` objects and
:mod:`vitattn.kernels._build.aot` compiles every one of them for sm_80 and sm_90 ahead of time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    max_head_dim: int = 128  # used only for padded head dims up to this (larger ones spill)
    max_head_dim_masked: int | None = None  # the same with an additive / boolean mask tile (0: never)
    max_head_dim_fp32: int | None = None  # the same with float32 (TF32) operands: twice the shared memory
    max_head_dim_ragged: int | None = None  # the same with bound masks (ragged lengths or head dim; 0: never)
    max_head_dim_gauss: int | None = None  # the same with a Gaussian bias (its factor tiles; 0: never)
    max_head_dim_masked_ragged: int | None = None  # the same with a mask tile and bound masks both
    max_head_dim_alpha: int | None = None  # the same for LaunchTraits.alpha (alpha-entmax / window + bias)
    max_head_dim_window: int | None = None  # the same with a window and a bias or a mask (0: never)

    def head_dim_limit(self, traits: LaunchTraits | None = None) -> int:
        """The largest padded head dim this config serves (0: none) in a launch with ``traits``
        (:class:`LaunchTraits`; none: a plain launch)."""
        t = traits or LaunchTraits()
        limit = self.max_head_dim
        if t.masked and self.max_head_dim_masked is not None:
            limit = self.max_head_dim_masked
        if t.fp32 and self.max_head_dim_fp32:
            limit = min(limit, self.max_head_dim_fp32)
        if t.ragged and self.max_head_dim_ragged is not None:
            limit = min(limit, self.max_head_dim_ragged)
        if t.gauss and self.max_head_dim_gauss is not None:
            limit = min(limit, self.max_head_dim_gauss)
        if t.masked and t.ragged and self.max_head_dim_masked_ragged is not None:
            limit = min(limit, self.max_head_dim_masked_ragged)
        if t.alpha and self.max_head_dim_alpha is not None:
            limit = min(limit, self.max_head_dim_alpha)
        if t.window and self.max_head_dim_window is not None:
            limit = min(limit, self.max_head_dim_window)
        return limit

    def __str__(self) -> str:
        return f"M{self.block_m}xN{self.block_n} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class LaunchTraits:
    """What of a launch bounds the head dims a tile serves (:meth:`TileConfig.head_dim_limit`): a mask
    tile (``masked``), float32 operands (``fp32``), bound masks (``ragged``: ragged lengths or head dim),
    a Gaussian bias (``gauss``), alpha-entmax or a window with a bias or a mask (``alpha``), a window with
    a bias or a mask (``window``). Build one with :func:`launch_traits`."""

    masked: bool = False
    fp32: bool = False
    ragged: bool = False
    gauss: bool = False
    alpha: bool = False
    window: bool = False


def launch_traits(
    masked: bool = False,
    gauss: bool = False,
    alpha_entmax: bool = False,
    window: bool = False,
    fp32: bool = False,
    ragged: bool = False,
) -> LaunchTraits:
    """The :class:`LaunchTraits` of a launch with a mask tile (``masked``) and / or a Gaussian bias
    (``gauss``), of alpha-entmax (``alpha_entmax``), with a neighbourhood window (``window``). A bias or a
    mask holds registers of its own: with alpha-entmax (the alphas' gradient) or a window (its bounds)
    besides, the kernels take smaller tiles (``alpha``); with a window some tiles spill (``window``)."""
    biased = masked or gauss
    return LaunchTraits(masked, fp32, ragged, gauss, (alpha_entmax or window) and biased, window and biased)


# The AOT plan's variants (``_build.aot``): the normalizers and the bias kinds, one kind per launch.
NORMALIZERS = ("softmax", "entmax15", "entmax_alpha")
BIAS_KINDS = ("none", "gaussian", "additive", "bool")


def bias_traits(
    normalizer: str, bias: str, window: bool = False, fp32: bool = False, ragged: bool = False
) -> LaunchTraits:
    """:func:`launch_traits` of the AOT plan's variants: ``normalizer`` (one of :data:`NORMALIZERS`) with
    one ``bias`` kind (one of :data:`BIAS_KINDS`)."""
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer={normalizer!r}: expected one of {NORMALIZERS}")
    if bias not in BIAS_KINDS:
        raise ValueError(f"bias={bias!r}: expected one of {BIAS_KINDS}")
    masked = bias in ("additive", "bool")
    return launch_traits(masked, bias == "gaussian", normalizer == "entmax_alpha", window, fp32, ragged)


# arch (compute capability 80 or 90, see arch_of) -> kernel name -> autotune list, in the style of the
# Triton fused-attention tutorial: 64- and 128-row tiles, 4 warps per 64 query rows, 3-4 stages on sm_90
# (2-3 on sm_80), the larger tiles for head dims <= 64 only. ``python -m vitattn.kernels._build.aot
# --report`` compiles every entry for its arch at the largest head dim it serves and reports registers,
# spills and the loops' machine code (docs/kernels.md); no entry the autotuner can pick on sm_90 spills
# (tests/test_kernels_static.py). ``max_head_dim_fp32``: float32 (TF32) operands take twice the shared
# memory; the entries that would not fit at head dim 128 serve 64 (tests/test_kernels_static.py compiles
# the float32 ones).
_ENTMAX_FWD_90 = (
    TileConfig(128, 64, 8, 3, max_head_dim=64),
    TileConfig(64, 64, 4, 3, max_head_dim=64),
    TileConfig(128, 32, 8, 3),
    # with a window and a mask and bound masks it spilled at head dim 128 (16-300 B; since the mask tiles'
    # 32-bit clamps still alpha-entmax with an additive mask, 16 B): the 128-query tile serves there
    TileConfig(64, 32, 4, 3, max_head_dim_window=0),
)
_SOFTMAX_FWD_80 = (
    # with a mask tile at head dim 128 ptxas gave it 128 registers and a 1.3 KiB stack (2.9 KB of spills)
    TileConfig(128, 64, 8, 2, max_head_dim_fp32=64, max_head_dim_masked=64),
    # with a mask and bound masks it spilled in its loop (70-76 local loads per iteration at head dim 128)
    TileConfig(64, 64, 4, 2, max_head_dim_fp32=64, max_head_dim_masked_ragged=0),
    TileConfig(64, 32, 4, 3, max_head_dim_fp32=64),
    TileConfig(64, 32, 4, 2),
    # with bound masks at head dim 128 every larger tile spilled (outside its loop); this one did not
    TileConfig(32, 32, 4, 2),
)
# sm_80 has 255 registers a thread and no wgmma to hold the scores: at head dim 128 the larger tiles spilled
# inside their key loops (the full report: 1-85 local loads per iteration), so they serve head dim 64 there
# and a 32 x 32 tile, clear of spills in every variant, serves 128 (docs/kernels.md, "sm_80 spills").
# entmax-1.5: 128 x 32 spilled in its loop with a mask or with bound masks (a Gaussian bias), 64 x 32 with a
# Gaussian bias, a window and a bias, or a mask and bound masks.
_ENTMAX_FWD_80 = (
    TileConfig(128, 64, 8, 2, max_head_dim=64),
    TileConfig(64, 64, 4, 2, max_head_dim=64),
    TileConfig(128, 32, 8, 2, max_head_dim_fp32=64, max_head_dim_masked=64, max_head_dim_ragged=64),
    TileConfig(64, 32, 4, 2, max_head_dim_gauss=64, max_head_dim_window=64, max_head_dim_masked_ragged=64),
    TileConfig(32, 32, 4, 2),
)
# alpha-entmax (three powers per score): at head dim 128 both 32-key tiles spilled in their loops with any
# bias or with a window (which no launch trait tells apart from a plain call), at head dim 64 the 64-key
# tiles with a window and a Gaussian bias
_ALPHA_FWD_80 = (
    TileConfig(128, 64, 8, 2, max_head_dim=64, max_head_dim_alpha=0),
    TileConfig(64, 64, 4, 2, max_head_dim=64, max_head_dim_alpha=0),
    TileConfig(128, 32, 8, 2, max_head_dim=64),
    TileConfig(64, 32, 4, 2, max_head_dim=64),
    TileConfig(32, 32, 4, 2),
)
# dK/dV with bound masks: 32 x 64 spilled in its loop with a mask (head dim 64), the 64 x 32 tiles at head
# dim 128 with a mask, or a window and a bias
_BWD_DKDV_80 = (
    TileConfig(32, 64, 4, 2, max_head_dim=64, max_head_dim_masked_ragged=0),
    TileConfig(64, 32, 4, 2, max_head_dim_ragged=64),
    TileConfig(32, 32, 4, 2),
    TileConfig(64, 32, 4, 3, max_head_dim_fp32=64, max_head_dim_ragged=64),
)
# dQ: the 64-key tiles spilled in their loops with alpha-entmax or a window, and a bias (head dim 64); at head
# dim 128, 64 x 32 did there too and 128 x 32 with a mask (its gradient tile); with bound masks both 32-key
# tiles at head dim 128 (a mask, a Gaussian bias), and with a mask 128 x 32 and 64 x 32 at head dim 64
_BWD_DQ_80 = (
    TileConfig(64, 64, 4, 2, max_head_dim=64, max_head_dim_masked=0, max_head_dim_alpha=0),
    TileConfig(128, 64, 8, 2, max_head_dim=64, max_head_dim_masked=0, max_head_dim_alpha=0),
    TileConfig(64, 32, 4, 2, max_head_dim_alpha=64, max_head_dim_ragged=64, max_head_dim_masked_ragged=0),
    TileConfig(
        128,
        32,
        8,
        2,
        max_head_dim_fp32=64,
        max_head_dim_masked=64,
        max_head_dim_ragged=64,
        max_head_dim_masked_ragged=0,
    ),
    TileConfig(32, 32, 4, 2),
    # with bound masks at head dim 128 the 32-query tiles spilled (outside their loops): 16 queries did not
    TileConfig(16, 32, 4, 2),
)
AUTOTUNE_BY_ARCH: dict[int, dict[str, tuple[TileConfig, ...]]] = {
    90: {
        # every tile issues wgmma: 64 rows of the dots' M dimension (queries; keys in dK/dV) per warpgroup
        "fwd_softmax": (
            TileConfig(128, 64, 8, 3, max_head_dim_fp32=64, max_head_dim_ragged=64),
            TileConfig(64, 64, 4, 3, max_head_dim_fp32=64, max_head_dim_ragged=64),
            TileConfig(128, 64, 8, 4, max_head_dim_fp32=64, max_head_dim_ragged=64),
            TileConfig(64, 32, 4, 3),
            # the flash tutorial's pick at head dim 64; with the Gaussian column factors it spills
            TileConfig(128, 64, 4, 3, max_head_dim=64, max_head_dim_gauss=0),
        ),
        "fwd_entmax15": _ENTMAX_FWD_90,
        # alpha-entmax: the entmax-1.5 tiles (the same loops, three powers per score instead of one square)
        "fwd_entmax_alpha": _ENTMAX_FWD_90,
        # dK/dV: keys are the M dimension (k qᵀ tiles), so 64 keys per warpgroup; with 8 warps the two
        # warpgroups take 64 keys each (a 128-key block, as the tutorial's 32 x 128). With bound masks at
        # head dim 128 only the 16-query tile stays clear of spills.
        "bwd_dkdv": (
            TileConfig(32, 64, 4, 3, max_head_dim_ragged=64),
            TileConfig(64, 64, 4, 3, max_head_dim=64),
            TileConfig(64, 128, 8, 3, max_head_dim_fp32=64, max_head_dim_gauss=64, max_head_dim_ragged=64),
            TileConfig(32, 64, 4, 4, max_head_dim_ragged=64),
            TileConfig(16, 64, 4, 3),
        ),
        # the Gaussian gradients' per-query accumulators spill the 64-query tiles of 32 or more keys at
        # head dim 128 (the 128-query 32-key one, 8 warps, stays clear); a mask's gradient tile with bound
        # masks spills the 64-key tiles at any head dim, every tile but the 16-key one at head dim 128;
        # alpha-entmax with a Gaussian bias (its alphas' gradient besides) spills the 64-key tiles (92 B at
        # 64x64, 24 B at 128x64) and, with bound masks at head dim 128, the 128x32 one (44 B)
        "bwd_dq": (
            TileConfig(
                64,
                64,
                4,
                3,
                max_head_dim_fp32=64,
                max_head_dim_gauss=64,
                max_head_dim_alpha=0,
                max_head_dim_masked_ragged=0,
            ),
            TileConfig(64, 32, 4, 3, max_head_dim_gauss=64, max_head_dim_masked_ragged=64),
            TileConfig(
                128,
                64,
                8,
                3,
                max_head_dim_fp32=64,
                max_head_dim_gauss=64,
                max_head_dim_alpha=0,
                max_head_dim_masked_ragged=0,
            ),
            TileConfig(
                128, 32, 8, 3, max_head_dim_fp32=64, max_head_dim_masked_ragged=64, max_head_dim_alpha=64
            ),
            TileConfig(64, 16, 4, 3),
        ),
        # the list kernels (softmax_lists, backward_lists: windows, entmax-1.5's live tiles, alpha-entmax),
        # with the Gaussian bias per score: the tiles of the per-score kernels before the grid-aligned ones
        "fwd_softmax_lists": (
            TileConfig(128, 64, 8, 3, max_head_dim_fp32=64, max_head_dim_ragged=64),
            TileConfig(64, 64, 4, 3, max_head_dim_fp32=64, max_head_dim_ragged=64),
            TileConfig(128, 64, 8, 4, max_head_dim_fp32=64, max_head_dim_ragged=64),
            TileConfig(64, 32, 4, 3),
        ),
        # every tile on wgmma: 64 keys per warpgroup in dK/dV (4 warps per 64 keys; with 8 on a 64-key
        # block the M = 64 key rows would be split over two warpgroups along the queries, and Triton
        # recomputes p in the second dot's operand layout), 64 queries per warpgroup in dQ. The per-score
        # Gaussian bias and alpha-entmax's powers hold more registers than the grid-aligned kernels: at
        # head dim 128 only the 16-query dK/dV and 16-key dQ tiles stay clear of spills in every variant,
        # and bound masks spill the 64-query dK/dV tiles with a Gaussian bias (tiles finer than the live
        # map's cells take the cell they lie in: ops.tile_lists)
        "bwd_dkdv_lists": (
            TileConfig(32, 64, 4, 3, max_head_dim=64),
            TileConfig(64, 64, 4, 3, max_head_dim=64, max_head_dim_ragged=0, max_head_dim_window=0),
            TileConfig(64, 128, 8, 3, max_head_dim=64, max_head_dim_ragged=0),
            TileConfig(32, 64, 4, 4, max_head_dim=64),
            TileConfig(16, 64, 4, 3),
        ),
        # a mask's gradient tile (its 64-bit pointers, the atomics) spills the 64-key tiles at any head dim;
        # alpha-entmax with a bias or mask (its alphas' gradient besides) spills the 32-key ones above head
        # dim 64
        "bwd_dq_lists": (
            TileConfig(64, 64, 4, 3, 64, max_head_dim_masked=0, max_head_dim_ragged=0, max_head_dim_alpha=0),
            TileConfig(64, 32, 4, 3, max_head_dim_ragged=64, max_head_dim_alpha=64),
            TileConfig(128, 32, 8, 3, max_head_dim_fp32=64, max_head_dim_alpha=64),
            TileConfig(64, 16, 4, 3),
        ),
    },
    # sm_80: the list kernels share the grid-aligned kernels' tiles; alpha-entmax has its own forward tiles
    80: {
        "fwd_softmax": _SOFTMAX_FWD_80,
        "fwd_entmax15": _ENTMAX_FWD_80,
        "fwd_entmax_alpha": _ALPHA_FWD_80,
        "bwd_dkdv": _BWD_DKDV_80,
        "bwd_dq": _BWD_DQ_80,
        "fwd_softmax_lists": _SOFTMAX_FWD_80,
        "bwd_dkdv_lists": _BWD_DKDV_80,
        "bwd_dq_lists": _BWD_DQ_80,
    },
}
DEFAULT_ARCH = 90  # the arch of the lists when no CUDA device tells (fake tensors, no driver)


def arch_of(capability: int) -> int:
    """The config lists of a compute capability (``10 * major + minor``): sm_90's 9.0+, else sm_80's."""
    return 90 if capability >= 90 else 80


# Kernel name -> the default arch's autotune list.
AUTOTUNE: dict[str, tuple[TileConfig, ...]] = AUTOTUNE_BY_ARCH[DEFAULT_ARCH]


def ragged(n_q: int, n_k: int, even_d: bool) -> bool:
    """Whether a launch runs with bound masks for some tile: a length not a multiple of 128 (every block
    size divides 128) or a head dim below its padded size."""
    return n_q % 128 != 0 or n_k % 128 != 0 or not even_d


def autotune_list(
    kernel: str, block_d: int, traits: LaunchTraits | None = None, arch: int = DEFAULT_ARCH
) -> tuple[TileConfig, ...]:
    """The configs of ``kernel`` on ``arch`` usable at padded head dim ``block_d`` in a launch with
    ``traits`` (:class:`LaunchTraits`; none: a plain launch)."""
    tiles = AUTOTUNE_BY_ARCH[arch_of(arch)][kernel]
    return tuple(c for c in tiles if block_d <= c.head_dim_limit(traits))


# The widest chunk of grid columns a grid-aligned key tile covers (the Gaussian kernels: ``_common``,
# "grid-aligned key tiles"), per kernel, and per (kernel, BLOCK_M) where a tile differs. A narrower chunk
# holds fewer column factors per thread (dQ keeps ``BLOCK_M x TILE_W`` of them in registers, dK/dV loads
# ``TILE_W + NR`` factor rows per query tile) at the cost of more row factors (``NR = BLOCK_N / TILE_W``
# per query and tile); the widths are the ones with the fewest instructions per score in the static
# report (docs/kernels.md). The forward takes whole-tile chunks: one row factor per query row and tile.
# entmax-1.5's dK/dV (``bwd_dkdv_entmax15``: the same kernel over the live tiles' lists) takes the
# forward's width: 0.3-0.6 more instructions per score than 16 columns, where on local weights a key block
# of one grid row holds the live keys of a query tile that a 4-row, 16-column block spreads over up to
# four times the tiles (docs/kernels.md, "Block-sparse entmax-1.5").
GRID_TILE_W: dict[str, int] = {
    "fwd_softmax": 64,
    "fwd_entmax15": 64,
    "fwd_entmax_alpha": 64,
    "bwd_dkdv": 16,
    "bwd_dkdv_entmax15": 64,
    "bwd_dq": 32,
}
GRID_TILE_W_BY_ROWS: dict[tuple[str, int], int] = {("bwd_dkdv", 16): 32}


def grid_tile_w(gwp: int, block_m: int, block_n: int, kernel: str) -> int:
    """``TILE_W``, the grid columns of one grid-aligned key tile of ``kernel`` at a ``block_m x block_n``
    tile and padded grid width ``gwp``: the least of ``gwp``, ``block_n`` and the kernel's widest chunk
    (all powers of two, so it divides both)."""
    if kernel not in GRID_TILE_W:
        known = sorted(GRID_TILE_W)
        raise ValueError(f"kernel={kernel!r} has no grid-aligned key tiles; expected one of {known}")
    cap = GRID_TILE_W_BY_ROWS.get((kernel, block_m), GRID_TILE_W[kernel])
    return min(gwp, block_n, cap)


# The forwards of PARTIAL_ROW_SUMS keep each row's running sums as partial sums, one per column residue
# mod this many (``_common.row_partial_sums``: no shuffles per tile), per arch: on sm_90 they issue fewer
# instructions with them; on sm_80 the entmax passes and the 4-warp head-dim-128 softmax tiles issue more
# (ptxas gives those loops more registers), so they sum each tile's rows there (1). alpha-entmax sums each
# tile's rows on both (with partial sums its masked sm_90 builds issued more). docs/kernels.md.
ROW_PARTS_BY_ARCH: dict[int, int] = {80: 1, 90: 8}
PARTIAL_ROW_SUMS = ("fwd_softmax", "fwd_softmax_lists", "fwd_entmax15")

# The entmax-1.5 forward keeps the running sums of squares of its first and search passes per score slot
# (``entmax15._add_squares``: a multiply-add per score, where summing each tile first costs 1.5, for one
# more register per score of a thread); per arch, whether its Gaussian forwards with whole tiles do too.
# On sm_80 those spill (64-208 B at head dim 64); so do sm_90's Gaussian forwards with prefix keys or a
# partial tile (24 B at 64 x 64), which never do. docs/kernels.md.
ENTMAX_GAUSS_SQUARES_BY_ARCH: dict[int, bool] = {80: False, 90: True}

# The grid-aligned dQ with two grid rows per key tile: per arch, whether it takes them apart (two vectors
# of row factors, a multiply-add per score into each gradient accumulator; ``backward._dq_row_terms``):
# on sm_90 that saves a trip through shared memory per tile; on sm_80 it spills (868 B at 64 x 64, where
# the (BLOCK_M, 2) form spills 52 B). docs/kernels.md.
DQ_ROW_PAIR_BY_ARCH: dict[int, bool] = {80: False, 90: True}


# The row-term kernels of the backward (delta, the Gaussian row terms) need no tuning.
DELTA_ROWS = 64
ROW_TERMS_ROWS = 128
# entmax-1.5's tile-list kernel (kernels/tile_lists.py): its launch, which the static report compiles
LIST_WARPS, LIST_STAGES = 4, 1

# Under TRITON_INTERPRET=1 (CPU, numpy) small tiles keep the tests fast and every edge ragged.
INTERPRET = TileConfig(32, 32, 4, 1)

# The cells of the entmax-1.5 forward's live-tile map (what the backward's tile lists are built from): the
# smallest side of the forward's tiles (16 in the interpreter, whose tests use 16-row tiles too); a backward
# tile finer than a cell (sm_90's 16-query dK/dV and 16-key dQ tiles) takes the cell it lies in.
LIVE_GRAIN = 32
INTERPRET_LIVE_GRAIN = 16
INTERPRET_DELTA_ROWS = 16
