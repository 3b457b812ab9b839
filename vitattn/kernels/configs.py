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
    max_head_dim_masked: int | None = None  # the same with an additive / boolean mask tile to load
    max_head_dim_fp32: int | None = None  # the same with float32 (TF32) operands: twice the shared memory

    def head_dim_limit(self, masked: bool, fp32: bool = False) -> int:
        limit = self.max_head_dim_masked if masked and self.max_head_dim_masked else self.max_head_dim
        if fp32 and self.max_head_dim_fp32:
            limit = min(limit, self.max_head_dim_fp32)
        return limit

    def __str__(self) -> str:
        return f"M{self.block_m}xN{self.block_n} w{self.num_warps} s{self.num_stages}"


def _tiles(*rows: tuple[int, ...], **limits: int) -> tuple[TileConfig, ...]:
    return tuple(TileConfig(*row, **limits) for row in rows)


# arch (compute capability 80 or 90, see arch_of) -> kernel name -> autotune list, in the style of the
# Triton fused-attention tutorial: 64- and 128-row tiles, 4 warps unless a tile holds 128 x 128 scores,
# 3-4 stages on sm_90. ``python -m vitattn.kernels._build.aot --report`` compiles every entry for its arch
# and reports registers, spills and the loops' machine code (docs/kernels.md); every entry the
# autotuner can pick on sm_90 has no spills (tests/test_kernels_static.py).
AUTOTUNE_BY_ARCH: dict[int, dict[str, tuple[TileConfig, ...]]] = {
    90: {
        "fwd_softmax": _tiles((64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)),
        "fwd_entmax15": _tiles((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4)),
        "bwd_dkdv": _tiles((32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4)),
        "bwd_dq": _tiles((128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)),
    },
    80: {
        "fwd_softmax": _tiles((64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)),
        "fwd_entmax15": _tiles((64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2)),
        "bwd_dkdv": _tiles((32, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 32, 4, 2)),
        "bwd_dq": _tiles((128, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)),
    },
}
DEFAULT_ARCH = 90  # the arch of the lists when no CUDA device tells (fake tensors, no driver)


def arch_of(capability: int) -> int:
    """The config lists of a compute capability (``10 * major + minor``): sm_90's 9.0+, else sm_80's."""
    return 90 if capability >= 90 else 80


# Kernel name -> the default arch's autotune list.
AUTOTUNE: dict[str, tuple[TileConfig, ...]] = AUTOTUNE_BY_ARCH[DEFAULT_ARCH]


def autotune_list(
    kernel: str, block_d: int, masked: bool, fp32: bool = False, arch: int = DEFAULT_ARCH
) -> tuple[TileConfig, ...]:
    """The configs of ``kernel`` on ``arch`` usable at padded head dim ``block_d`` (with a mask tile if
    ``masked``, with float32 operands if ``fp32``)."""
    tiles = AUTOTUNE_BY_ARCH[arch_of(arch)][kernel]
    return tuple(c for c in tiles if block_d <= c.head_dim_limit(masked, fp32))


# The row-term kernel of the backward needs no tuning.
DELTA_ROWS = 64

# Under TRITON_INTERPRET=1 (CPU, numpy) small tiles keep the tests fast and every edge ragged.
INTERPRET = TileConfig(32, 32, 4, 1)
INTERPRET_DELTA_ROWS = 16
