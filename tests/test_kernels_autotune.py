"""The tile picker of the Triton kernels (:func:`vitattn.kernels.ops.pick_tile`), without a GPU: the
tuning key buckets sequence lengths by powers of two and holds B·H; picks are cached in this process
and across processes (``autotune.json`` under ``VITATTN_CACHE``); inside CUDA-graph capture
(``torch.cuda.is_current_stream_capturing``, patched here) nothing is benchmarked and an unknown key
gets the default (first) tile. ``bench`` stands in for ``triton.testing.do_bench``.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton")
from vitattn.cache import CACHE_ENV  # noqa: E402
from vitattn.kernels import configs, ops  # noqa: E402  (imports triton)

TILES = configs.AUTOTUNE["fwd_softmax"]
CAPTURING = ops._capturing
META = dict(GAUSS=True, HAS_ADD=False, HAS_KEEP=False, F32_DOT=0, BLOCK_D=64, BLOCK_DV=64)


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """An empty autotune.json directory and empty in-process caches for every test."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(ops.TILES_ENV, raising=False)
    monkeypatch.setattr(ops, "_capturing", lambda: False)
    ops._TUNED.clear()
    ops._DISK.clear()
    ops._TUNING_LOG.clear()
    yield
    ops._TUNED.clear()
    ops._DISK.clear()
    ops._TUNING_LOG.clear()


class Bench:
    """Times each tile by a table (ms) and records what it was asked to time."""

    def __init__(self, fastest: int = 2) -> None:
        self.fastest = fastest
        self.timed: list[configs.TileConfig] = []

    def __call__(self, tile: configs.TileConfig) -> float:
        self.timed.append(tile)
        return 1.0 if tile == TILES[self.fastest] else 2.0


def _key(bh=24, n_q=197, n_k=197, **meta):
    return ops.tune_key("fwd_softmax", ops.torch.bfloat16, bh, n_q, n_k, {**META, **meta})


@pytest.mark.parametrize(("n", "bucket"), [(1, 16), (16, 16), (17, 32), (197, 256), (256, 256), (257, 512)])
def test_sequence_lengths_are_bucketed_by_powers_of_two(n, bucket):
    assert ops.seq_bucket(n) == bucket


def test_key_buckets_lengths_and_keeps_batch_heads_and_flags():
    assert _key(n_q=197, n_k=197) == _key(n_q=256, n_k=200)
    assert _key(n_q=197) != _key(n_q=257)
    assert _key(n_k=197) != _key(n_k=257)
    assert _key(bh=24) != _key(bh=48)  # B·H: the grid's second axis
    assert _key() != _key(HAS_KEEP=True) and _key() != _key(BLOCK_D=128)
    assert "bh=24|q=256|k=256" in _key() and "bfloat16" in _key()


def test_first_call_benchmarks_then_the_pick_is_reused():
    bench = Bench(fastest=2)
    assert ops.pick_tile(_key(), TILES, bench) == TILES[2]
    assert bench.timed == [*TILES, TILES[2]]  # every tile, then the ones near the best again
    again = Bench(fastest=0)
    assert ops.pick_tile(_key(n_q=256, n_k=256), TILES, again) == TILES[2]  # same bucket: no timing
    assert again.timed == []
    assert ops.pick_tile(_key(n_q=1024, n_k=1024), TILES, again) == TILES[0]  # new bucket: timed
    assert again.timed == [*TILES, TILES[0]]


def test_picks_are_cached_across_processes():
    ops.pick_tile(_key(), TILES, Bench(fastest=3))
    stored = json.loads(ops.autotune_cache_path().read_text())
    (scope,) = stored["entries"]
    assert stored["entries"][scope][_key()] == [TILES[3].block_m, TILES[3].block_n, TILES[3].num_warps,
                                                TILES[3].num_stages]  # fmt: skip
    ops._TUNED.clear()  # a new process: nothing in memory, the file on disk
    ops._DISK.clear()
    bench = Bench(fastest=0)
    assert ops.pick_tile(_key(), TILES, bench) == TILES[3]
    assert bench.timed == []


def test_a_stored_tile_no_longer_listed_is_tuned_again():
    ops.pick_tile(_key(), TILES, Bench(fastest=3))
    ops._TUNED.clear()
    ops._DISK.clear()
    bench = Bench(fastest=1)
    assert ops.pick_tile(_key(), TILES[:3], bench) == TILES[1]
    assert bench.timed == [*TILES[:3], TILES[1]]


def test_no_benchmarking_inside_cuda_graph_capture(monkeypatch):
    monkeypatch.setattr(ops.torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(ops, "_capturing", CAPTURING)  # the real check, on the patched torch function
    bench = Bench(fastest=2)
    assert ops.pick_tile(_key(), TILES, bench) == TILES[0]  # the fixed default, precompiled by aot
    assert bench.timed == [] and not ops._TUNED and not ops.autotune_cache_path().exists()
    monkeypatch.setattr(ops.torch.cuda, "is_current_stream_capturing", lambda: False)
    assert ops.pick_tile(_key(), TILES, bench) == TILES[2]  # outside capture: tuned, remembered
    monkeypatch.setattr(ops.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ops.pick_tile(_key(), TILES, Bench(fastest=0)) == TILES[2]  # known: used inside capture too


def test_first_only_and_single_tiles_are_never_timed(monkeypatch):
    bench = Bench()
    assert ops.pick_tile(_key(), TILES[1:2], bench) == TILES[1]
    monkeypatch.setenv(ops.TILES_ENV, "first")
    assert ops.pick_tile(_key(), TILES, bench) == TILES[0]
    assert bench.timed == []


def test_tiles_that_do_not_fit_lose(monkeypatch):
    import triton

    def bench(tile):
        if tile == TILES[0]:
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        return 1.0 if tile == TILES[1] else 2.0

    assert ops.pick_tile(_key(), TILES, bench) == TILES[1]


def test_an_unreadable_cache_file_is_ignored():
    path = ops.autotune_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert ops.pick_tile(_key(), TILES, Bench(fastest=1)) == TILES[1]
    assert _key() in next(iter(json.loads(path.read_text())["entries"].values()))


@pytest.mark.parametrize(
    ("kernel", "block_d", "bias", "dropped"),
    [
        ("fwd_entmax15", 128, dict(HAS_KEEP=True), configs.TileConfig(64, 32, 4, 3)),
        ("fwd_entmax_alpha", 128, dict(HAS_ADD=True), configs.TileConfig(64, 32, 4, 3)),
        ("bwd_dkdv_lists", 64, dict(GAUSS=True), configs.TileConfig(64, 64, 4, 3)),
    ],
)
def test_a_window_with_a_bias_drops_the_tiles_that_spill_with_it(kernel, block_d, bias, dropped):
    """``max_head_dim_window``: the tiles whose sm_90 builds spilled with a window and a bias or a mask
    (the static report) are not offered then; without the window, or with a window and no bias, they are."""
    meta = dict(HAS_ADD=False, HAS_KEEP=False, GAUSS=False, F32_DOT=0, BLOCK_D=block_d, BLOCK_DV=block_d)
    meta.update(ENTMAX=2 if kernel == "fwd_entmax_alpha" else 1)

    def tiles(**flags):
        return [
            (t.block_m, t.block_n, t.num_warps, t.num_stages)
            for t in ops.tile_candidates(kernel, {**meta, **flags}, 90)
        ]

    key = (dropped.block_m, dropped.block_n, dropped.num_warps, dropped.num_stages)
    assert key not in tiles(WINDOW=True, **bias)
    assert tiles(WINDOW=True, **bias)  # another tile serves
    assert key in tiles(WINDOW=False, **bias)
    assert key in tiles(WINDOW=True)


@pytest.mark.parametrize("bias", ["none", "gaussian", "additive", "bool"])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("normalizer", ["entmax15", "entmax_alpha"])
def test_the_plan_and_the_dispatcher_agree_on_a_launch_traits(normalizer, bias, window):
    """``configs.bias_traits`` (what the AOT plan and the report's coverage test use) gives the tiles
    ``ops.tile_candidates`` derives from a launch's constexprs; a bias or a mask with a window is
    ``window``, with alpha-entmax or a window ``alpha``."""
    flags = dict(GAUSS=bias == "gaussian", HAS_ADD=bias == "additive", HAS_KEEP=bias == "bool", WINDOW=window)
    entmax = 2 if normalizer == "entmax_alpha" else 1
    meta = dict(F32_DOT=0, BLOCK_D=64, BLOCK_DV=64, ENTMAX=entmax, **flags)
    traits = configs.bias_traits(normalizer, bias, window)
    assert traits.window == (window and bias != "none")
    assert traits.alpha == ((normalizer == "entmax_alpha" or window) and bias != "none")
    # at head dim 64 the dQ list drops tiles for `alpha`, the dK/dV list for `window`
    for kernel in ("bwd_dq_lists", "bwd_dkdv_lists"):
        listed = configs.AUTOTUNE_BY_ARCH[90][kernel]
        from_launch = [t for t in listed if t in ops.tile_candidates(kernel, meta, 90)]
        assert from_launch == list(configs.autotune_list(kernel, 64, traits)), kernel


@pytest.mark.parametrize(
    "normalizer, bias, named", [("entmax", "none", "normalizer='entmax'"), ("softmax", "mask", "bias='mask'")]
)
def test_bias_traits_names_an_unknown_variant(normalizer, bias, named):
    """A misspelt normalizer or bias kind is an error naming the argument, not the traits of no bias."""
    with pytest.raises(ValueError, match=named):
        configs.bias_traits(normalizer, bias)


class Noisy:
    """Times each tile from a queue of times per tile (ms), one per call."""

    def __init__(self, times: dict[int, list[float]]) -> None:
        self.times = {TILES[i]: list(t) for i, t in times.items()}
        self.timed: list[configs.TileConfig] = []

    def __call__(self, tile: configs.TileConfig) -> float:
        self.timed.append(tile)
        return self.times[tile].pop(0)


def test_tiles_near_the_best_are_timed_again_and_keep_their_lower_time():
    # tile 1 ran into a slowdown on its first pass (1.2 ms against tile 0's 1.0): timed again, it wins
    times = {0: [1.0, 1.05], 1: [1.2, 0.9], 2: [1.31, 0.5], 3: [3.0], 4: [math.inf]}
    bench = Noisy(times)
    assert ops.pick_tile(_key(), TILES, bench) == TILES[1]
    # the second pass runs in reverse order, over tiles within RETIME_WITHIN (1.3) of the best first time
    assert bench.timed == [*TILES, TILES[1], TILES[0]]


def test_the_tuning_log_tells_how_each_key_got_its_tile(monkeypatch):
    ops.pick_tile(_key(), TILES, Noisy({0: [2.0], 1: [1.0, 1.1], 2: [4.0], 3: [5.0], 4: [6.0]}))
    ops.pick_tile(_key(), TILES, Bench(fastest=0))  # known in memory: the timed record stays
    ops._TUNED.clear()
    ops.pick_tile(_key(n_q=1024, n_k=1024), TILES, Bench(fastest=3))
    ops._TUNED.clear()
    ops._DISK.clear()
    ops._TUNING_LOG.clear()  # a new process: the pick from disk
    ops.pick_tile(_key(n_q=1024, n_k=1024), TILES, Bench(fastest=0))
    monkeypatch.setenv(ops.TILES_ENV, "2")
    ops.pick_tile(_key(bh=48), TILES, Bench())
    log = ops.tuning_log()
    assert log[_key(n_q=1024, n_k=1024)] == {"tile": ops.tile_name(TILES[3]), "source": "disk"}
    assert log[_key(bh=48)] == {"tile": ops.tile_name(TILES[2]), "source": "forced"}
    assert list(log) == [_key(n_q=1024, n_k=1024), _key(bh=48)]
    monkeypatch.delenv(ops.TILES_ENV)
    ops._TUNING_LOG.clear()
    ops._TUNED.clear()
    ops._DISK.clear()
    ops.autotune_cache_path().unlink()
    ops.pick_tile(_key(), TILES, Noisy({0: [2.0], 1: [1.0, 1.1], 2: [4.0], 3: [5.0], 4: [6.0]}))
    (entry,) = ops.tuning_log().values()
    assert entry["source"] == "timed" and entry["tile"] == ops.tile_name(TILES[1]) == "64x64 w4 s3"
    assert entry["ms"][ops.tile_name(TILES[1])] == [1.0, 1.1]
    assert entry["ms"][ops.tile_name(TILES[0])] == [2.0]  # beyond 1.3x the best: timed once


@given(a=st.integers(0, 10**7), b=st.integers(1, 4096))
def test_host_cdiv_and_next_pow2_equal_tritons(a, b):
    import triton

    assert ops.cdiv(a, b) == triton.cdiv(a, b)
    assert ops.next_pow2(a + 1) == triton.next_power_of_2(a + 1)  # n >= 1 (Triton's gives 0 for 0)
