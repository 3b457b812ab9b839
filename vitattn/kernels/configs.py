"""Block-size lists the kernels are autotuned over (all power-of-two tiles, >= 16 in every dim).

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


# Kernel name -> autotune list. Every entry fits sm_80's 163 KiB of shared memory at its largest head
# dim and compiles for sm_80 and sm_90 (checked by ``python -m vitattn.kernels._build.aot``, which
# prints registers and spills; some entmax tiles spill a little at head dim 128, see docs/kernels.md).
# With float32 operands (the TF32 path) the tiles take twice the shared memory: ``max_head_dim_fp32``
# marks the entries that exceed sm_80's or sm_90's limit at head dim 128 then
# (``python -m vitattn.kernels._build.aot --dtype fp32``).
AUTOTUNE: dict[str, tuple[TileConfig, ...]] = {
    "fwd_softmax": (
        TileConfig(128, 64, 8, 3, max_head_dim_masked=64, max_head_dim_fp32=64),
        TileConfig(128, 32, 8, 3),
        TileConfig(64, 64, 4, 3, max_head_dim_masked=64, max_head_dim_fp32=64),
        TileConfig(64, 32, 4, 2),
    ),
    "fwd_entmax15": (
        TileConfig(128, 32, 8, 2, max_head_dim_masked=64),
        TileConfig(64, 32, 8, 2),
        TileConfig(64, 64, 8, 3, max_head_dim_fp32=64),
        TileConfig(128, 64, 8, 3, max_head_dim=64),
    ),
    "bwd_dkdv": (
        TileConfig(32, 64, 8, 2),
        TileConfig(64, 32, 8, 2, max_head_dim_fp32=64),
        TileConfig(32, 64, 8, 3),
        TileConfig(32, 128, 8, 2, max_head_dim=64),
    ),
    "bwd_dq": (
        TileConfig(128, 32, 8, 2, max_head_dim_fp32=64),
        TileConfig(64, 32, 8, 2),
        TileConfig(128, 32, 8, 3, max_head_dim=64),
        TileConfig(64, 32, 4, 2, max_head_dim=64),
    ),
}


def autotune_list(kernel: str, block_d: int, masked: bool, fp32: bool = False) -> tuple[TileConfig, ...]:
    """The configs of ``kernel`` usable at padded head dim ``block_d`` (with a mask tile if ``masked``,
    with float32 operands if ``fp32``)."""
    return tuple(c for c in AUTOTUNE[kernel] if block_d <= c.head_dim_limit(masked, fp32))


# The row-term kernel of the backward needs no tuning.
DELTA_ROWS = 64

# Under TRITON_INTERPRET=1 (CPU, numpy) small tiles keep the tests fast and every edge ragged.
INTERPRET = TileConfig(32, 32, 4, 1)
INTERPRET_DELTA_ROWS = 16
