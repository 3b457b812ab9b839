"""Block-sparse entmax-1.5 in the Triton kernels, counted in Triton's interpreter: the output pass of the
forward and both backward kernels visit exactly the live tiles (the tiles with a non-zero weight), and
the results still equal ``backend="reference"`` (see ``tests/test_kernels.py`` for how the interpreter
flag is set). Tiles are 32 x 32 here (``configs.INTERPRET``), in the forward and the backward alike.

The visits are counted by wrapping the kernels' helpers: the forward's output pass is the only caller of
``entmax15._dot`` (``p V`` and ``g V``: two per visited tile when a gradient is needed), and each visited
tile of the list kernels' dK/dV and dQ calls ``backward_lists._score_tile`` once (with a Gaussian bias the
grid-aligned kernels' ``backward._dkdv_tile`` and ``backward._dq_tile``). The live tiles come from the
reference backend's weights (``return_weights=True``): a tile is live when one of its weights is > 0.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import types

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, attention
from vitattn.kernels import configs

triton = pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402  (imports triton)

interpreted = pytest.mark.triton_interpreter
TILE = configs.INTERPRET.block_m


def local_qkv(b: int, h: int, n: int, d: int, sharp: float, seed: int) -> list[torch.Tensor]:
    """q, k, v whose scores are local: q_i . k_j ~ sharp * sum_f cos(w_f (i - j)) (random frequencies w_f,
    plus noise), so entmax-1.5 keeps a band around the diagonal."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = torch.rand(d // 2, generator=g, dtype=torch.float64) * 0.5
    feats = torch.cat([torch.cos(pos * freq), torch.sin(pos * freq)], -1) * math.sqrt(sharp)
    q = feats + 0.3 * torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = feats + 0.3 * torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    return [q, k, v]


def live_tiles(probs: torch.Tensor) -> torch.Tensor:
    """``(B, H, query tiles, key tiles)`` bool: a tile holds a weight > 0."""
    b, h, n_q, n_k = probs.shape
    t_q, t_k = -(-n_q // TILE), -(-n_k // TILE)
    padded = torch.nn.functional.pad(probs > 0, (0, t_k * TILE - n_k, 0, t_q * TILE - n_q))
    return padded.view(b, h, t_q, TILE, t_k, TILE).any(5).any(3)


def _count(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    inner = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _visits(monkeypatch, q, k, v, **kw):
    """``(out, grads, forward output-pass tiles, backward tiles)`` of a triton call with gradients; the
    backward's as ``(list kernels' dK/dV + dQ, grid-aligned dK/dV, grid-aligned dQ)``."""
    ops.kernels()
    fwd = _count(monkeypatch, importlib.import_module("vitattn.kernels.entmax15"), "_dot")
    bwd = _count(monkeypatch, importlib.import_module("vitattn.kernels.backward_lists"), "_score_tile")
    grid_module = importlib.import_module("vitattn.kernels.backward")
    grid_kv, grid_q = (_count(monkeypatch, grid_module, name) for name in ("_dkdv_tile", "_dq_tile"))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, normalizer="entmax15", backend="triton", **kw)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    monkeypatch.undo()
    return out, grads, len(fwd) // 2, (len(bwd), len(grid_kv), len(grid_q))


def grid_tile_ids(n: int, prefix: int, grid: tuple[int, int], kernel: str = "fwd_entmax15") -> torch.Tensor:
    """Per key token, the grid-aligned key tile ``kernel`` visits it in (``_common``, "grid-aligned key
    tiles"): the prefix tokens' tiles of ``TILE`` tokens first, then the tiles of ``TILE // TILE_W`` whole
    grid rows of each chunk of ``TILE_W`` grid columns (chunk by chunk; dK/dV's programs: row by row)."""
    gh, gw = grid
    tile_w = configs.grid_tile_w(ops.grid_pad(gw), TILE, TILE, kernel)
    rows = TILE // tile_w
    n_pre, n_tiles = -(-prefix // TILE), -(-gh // rows)
    n_chunks = ops.grid_pad(gw) // tile_w
    patch = torch.arange(n - prefix)
    chunk, row_tile = patch % gw // tile_w, patch // gw // rows
    by_rows = kernel.startswith("bwd_dkdv")
    ids = n_pre + (row_tile * n_chunks + chunk if by_rows else chunk * n_tiles + row_tile)
    return torch.cat([torch.arange(prefix) // TILE, ids])


def grid_live_keys(probs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, tiles)``: ``(B, H, query tiles, keys)`` bool, the key lies in a grid tile (``ids`` per key)
    that holds a weight > 0 for the query tile, and ``(B, H, query tiles, grid tiles)``, those tiles."""
    b, h, n_q, n_k = probs.shape
    t_q = -(-n_q // TILE)
    rows = torch.nn.functional.pad(probs > 0, (0, 0, 0, t_q * TILE - n_q)).view(b, h, t_q, TILE, n_k).any(3)
    member = torch.nn.functional.one_hot(ids).double()  # (keys, grid tiles)
    per_tile = rows.double() @ member > 0
    return per_tile[..., ids], per_tile


def marked_tiles(keys: torch.Tensor, ids: torch.Tensor, prefix: int, grid_w: int) -> torch.Tensor:
    """``(B, H, query tiles, tiles)`` bool: the tiles (``ids`` per key) holding a key whose cell of the
    live map the forward marked, ``keys`` the keys of its live grid tiles. The map's key axis: the prefix
    tokens, then from the next cell of :func:`ops.live_grain` keys the grid padded to ``GWP`` columns."""
    grain = ops.live_grain()
    gwp = ops.grid_pad(grid_w)
    token = torch.arange(keys.shape[-1])
    patch = token - prefix
    first = -(-prefix // grain) * grain
    place = torch.where(patch < 0, token, first + patch // grid_w * gwp + patch % grid_w)
    cell = torch.nn.functional.one_hot(place // grain).double()  # (keys, cells)
    marked_cells = keys.double() @ cell > 0
    return marked_cells.double() @ cell.T @ torch.nn.functional.one_hot(ids).double() > 0


def _check(monkeypatch, q, k, v, layout: tuple[int, tuple[int, int]] | None = None, **kw) -> float:
    """Visited == live in every pass, values and gradients equal the reference; returns the live fraction.
    With a Gaussian bias on ``layout`` (prefix tokens, grid) the forward visits the live grid-aligned key
    tiles (:func:`grid_tile_ids`) and the backward's grid-aligned kernels the tiles of their own holding a
    key in a cell of the live map the forward marked (:func:`marked_tiles`), a superset of the live ones
    (here, with 32-key tiles of 16 or 32 grid columns and 16-key cells, the live ones)."""
    out, grads, fwd_tiles, (bwd_tiles, kv_tiles, q_tiles) = _visits(monkeypatch, q, k, v, **kw)
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, probs = attention(*ref_leaves, normalizer="entmax15", backend="reference", return_weights=True, **kw)
    want = torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))
    live = live_tiles(probs)
    if layout is None:
        assert fwd_tiles == int(live.sum()), (fwd_tiles, int(live.sum()))
        assert bwd_tiles == 2 * int(live.sum()), (bwd_tiles, int(live.sum()))  # dK/dV and dQ
        assert kv_tiles == q_tiles == 0
    else:
        prefix, grid = layout
        keys, per_tile = grid_live_keys(probs, grid_tile_ids(q.shape[2], prefix, grid))
        assert fwd_tiles == int(per_tile.sum()), (fwd_tiles, int(per_tile.sum()))
        assert bwd_tiles == 0
        for kernel, visited in (("bwd_dkdv_entmax15", kv_tiles), ("bwd_dq", q_tiles)):
            ids = grid_tile_ids(q.shape[2], prefix, grid, kernel)
            needed = grid_live_keys(probs, ids)[1]
            marked = marked_tiles(keys, ids, prefix, grid[1])
            assert not (needed & ~marked).any()
            assert visited == int(marked.sum()), (kernel, visited, int(marked.sum()), int(needed.sum()))
    torch.testing.assert_close(out.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=0)
    for a, w in zip(grads, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=4e-5 * w.abs().max().item(), rtol=0)
    return live.float().mean().item()


@interpreted
@pytest.mark.parametrize("seed", [0, 1])
def test_local_inputs_visit_the_live_tiles_only(monkeypatch, seed):
    q, k, v = local_qkv(1, 2, 130, 16, sharp=6.0, seed=seed)
    fraction = _check(monkeypatch, q, k, v)
    assert fraction < 0.6  # the inputs are local: most tiles are dead


@interpreted
def test_gaussian_bias_with_a_prefix_visits_the_live_tiles_only(monkeypatch):
    """With a Gaussian bias the forward visits grid-aligned key tiles (whole grid rows): the live ones of
    the prefix tiles' list and of each chunk's; the bias of a listed tile is computed from its index."""
    q, k, v = local_qkv(1, 2, 1 + 12 * 12, 16, sharp=2.0, seed=2)
    g = torch.Generator().manual_seed(3)
    sigma = torch.exp(torch.randn(1, 2, 144, 2, generator=g, dtype=torch.float64) * 0.3) * 0.5
    alpha = torch.full((1, 2, 144, 1), 8.0, dtype=torch.float64)
    fraction = _check(
        monkeypatch, q, k, v, layout=(1, (12, 12)), bias=GaussianBias(sigma, alpha, (12, 12), 1)
    )
    assert fraction < 0.9


@interpreted
def test_dense_inputs_visit_every_tile(monkeypatch):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 77, 16, generator=g, dtype=torch.float64) * 0.2 for _ in range(3))
    assert _check(monkeypatch, q, k, v) == 1.0


def test_tile_lists_pool_the_live_map():
    """The backward's lists: a tile is live when a cell it covers is; dK/dV's list is the transpose."""
    grain = ops.live_grain()
    live = torch.zeros(1, 1, 5, 3, dtype=torch.uint8)  # 5 x 3 cells
    live[0, 0, 0, 2] = live[0, 0, 3, 0] = live[0, 0, 4, 1] = 1
    order, count = ops.tile_lists(live, 2 * grain, grain, 5 * grain, 3 * grain, by_cols=False)
    assert count.tolist() == [[1, 1, 1]]  # query tiles of 2 cells: (0, 1), (2, 3), (4)
    assert order[0, :, 0].tolist() == [2, 0, 1]
    order, count = ops.tile_lists(live, 2 * grain, grain, 5 * grain, 3 * grain, by_cols=True)
    assert count.tolist() == [[1, 1, 1]] and order[0, :, 0].tolist() == [1, 2, 0]
    order, count = ops.tile_lists(live, grain, 2 * grain, 5 * grain, 3 * grain, by_cols=False)
    assert count.tolist() == [[1, 0, 0, 1, 1]] and order[0, 0, 0] == 1 and order[0, 3, 0] == 0


def test_tile_lists_of_tiles_finer_than_a_cell():
    """A tile side below the cell's (sm_90's 16-query dK/dV and 16-key dQ tiles) takes the cell it lies in:
    the list of the map upsampled to that tile, a superset of the live scores, never a subset."""
    grain = ops.live_grain()
    half = grain // 2
    live = torch.zeros(1, 1, 3, 2, dtype=torch.uint8)  # 3 x 2 cells, the keys end inside the second
    live[0, 0, 0, 1] = live[0, 0, 2, 0] = 1
    n_q, n_k = 3 * grain - half + 1, 2 * grain - half + 1  # 6 / 4 tiles of half a cell, the last ragged
    order, count = ops.tile_lists(live, grain, half, n_q, n_k, by_cols=False)  # dQ: 16-key tiles
    assert count.tolist() == [[2, 0, 2]]
    assert order[0, 0, :2].tolist() == [2, 3] and order[0, 2, :2].tolist() == [0, 1]
    order, count = ops.tile_lists(live, half, grain, n_q, n_k, by_cols=True)  # dK/dV: 16-query tiles
    assert count.tolist() == [[2, 2]]
    assert order[0, 0, :2].tolist() == [4, 5] and order[0, 1, :2].tolist() == [0, 1]
    order, count = ops.tile_lists(live, half, half, n_q, n_k, by_cols=False)
    assert order.shape == (1, 6, 4) and count.tolist() == [[2, 2, 0, 0, 2, 2]]


# the lists' two builders: the torch reference, and the kernel of one launch (kernels/tile_lists.py)
BUILDERS = [
    pytest.param("tile_lists", id="torch"),
    pytest.param("live_lists", id="kernel", marks=interpreted),
]


def test_list_tables_built_during_a_graph_capture_are_not_cached(monkeypatch):
    """Ops captured into a CUDA graph run only at its replays, so a table built then (its values not yet
    written) must not serve later calls: ``ops._kept`` caches it only outside a capture."""
    key = ("k",)
    monkeypatch.setattr(ops, "_capturing", lambda: True)
    cache: dict = {}
    table = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    assert ops._kept(cache, key, table) is table and cache == {key: table}  # never CUDA: kept
    cuda_table = types.SimpleNamespace(device=torch.device("cuda", 0))  # stands in for a CUDA tensor
    assert ops._kept(cache, ("c",), cuda_table) is cuda_table and ("c",) not in cache
    monkeypatch.setattr(ops, "_capturing", lambda: False)
    assert ops._kept(cache, ("c",), cuda_table) is cuda_table and cache[("c",)] is cuda_table


@pytest.mark.parametrize("builder", BUILDERS)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    block_rows=st.sampled_from([0.5, 1, 2, 4]),
    block_cols=st.sampled_from([0.5, 1, 2, 4]),
    cut_rows=st.integers(0, 15),
    cut_cols=st.integers(0, 15),
    by_cols=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tile_lists_match_the_cells_each_tile_overlaps(
    builder, rows, cols, block_rows, block_cols, cut_rows, cut_cols, by_cols, seed
):
    """Against a direct reading of the rule: a tile of tokens ``[t * block, min((t + 1) * block, n))`` is
    live when a cell of the map overlapping it is (any tile side: coarser than a cell, or finer); the
    torch reference (``ops.tile_lists``) and the list kernel (``ops.live_lists``, one launch) alike, on
    two heads whose maps differ."""
    grain = ops.live_grain()
    bm, bn = int(block_rows * grain), int(block_cols * grain)
    n_q, n_k = max(rows * grain - cut_rows, 1), max(cols * grain - cut_cols, 1)
    live = (torch.rand(2, 1, rows, cols, generator=torch.Generator().manual_seed(seed)) < 0.3).to(torch.uint8)
    order, count = getattr(ops, builder)(live, bm, bn, n_q, n_k, by_cols)

    def covers(t: int, block: int, n: int) -> range:
        return range(t * block // grain, (min((t + 1) * block, n) - 1) // grain + 1)

    q_tiles, k_tiles = -(-n_q // bm), -(-n_k // bn)
    for b in range(2):
        want = [
            [bool(live[b, 0][covers(i, bm, n_q)][:, covers(j, bn, n_k)].any()) for j in range(k_tiles)]
            for i in range(q_tiles)
        ]
        if by_cols:
            want = [list(col) for col in zip(*want, strict=True)]
        for prog, marked in enumerate(want):
            listed = [j for j, m in enumerate(marked) if m]
            assert count[b, prog].item() == len(listed)
            assert order[b, prog, : len(listed)].tolist() == listed
