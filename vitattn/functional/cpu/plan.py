"""The one block rule of the CPU row-blocked paths: a block holds at most ``BLOCK_ELEMENTS`` scores.

A path works on ``units`` independent ``(Nq, Nk)`` score matrices (heads of a batch). The softmax path
keeps every unit of a head's batch together and splits the query rows; the entmax-1.5 path groups whole
units while one fits and otherwise splits one unit's rows. :func:`plan_blocks` gives both, with
near-equal blocks (no small ragged last block).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BLOCK_ELEMENTS", "Block", "plan_blocks"]

# ~5 MiB of float32 scores per block: the size of a last-level cache share (docs/benchmarks.md)
BLOCK_ELEMENTS = 5 * 2**18


class Block(NamedTuple):
    """Units ``u0:u1`` and query rows ``r0:r1`` of one block."""

    u0: int
    u1: int
    r0: int
    r1: int

    @property
    def units(self) -> int:
        return self.u1 - self.u0

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


def _near_equal(total: int, most: int) -> list[tuple[int, int]]:
    """``[0, total)`` in the fewest near-equal pieces of at most ``most`` (>= 1) each."""
    pieces = -(-total // max(1, most))
    size = -(-total // max(1, pieces))
    return [(s, min(s + size, total)) for s in range(0, total, max(1, size))]


def plan_blocks(
    units: int, num_queries: int, num_keys: int, *, group_units: bool, limit: int | None = None
) -> list[Block]:
    """Blocks of at most ``limit`` (default :data:`BLOCK_ELEMENTS`) scores, at least one row each.

    ``group_units=False``: every block spans all ``units`` and the query rows are split.
    ``group_units=True``: whole units are grouped while one unit's ``Nq * Nk`` scores fit, else each
    unit's rows are split. Every (unit, row) pair lies in exactly one block; no block is empty.
    """
    limit = BLOCK_ELEMENTS if limit is None else int(limit)
    if limit < 1:
        raise ValueError(f"limit must be >= 1 scores per block, got {limit}")
    if min(units, num_queries) < 1:
        return []
    keys = max(num_keys, 1)
    if not group_units:
        return [Block(0, units, r0, r1) for r0, r1 in _near_equal(num_queries, limit // (units * keys))]
    per_unit = num_queries * keys
    if per_unit <= limit:
        return [Block(u0, u1, 0, num_queries) for u0, u1 in _near_equal(units, limit // per_unit)]
    rows = _near_equal(num_queries, limit // keys)
    return [Block(u, u + 1, r0, r1) for u in range(units) for r0, r1 in rows]
