"""The Triton kernels on a real GPU (skipped without CUDA): bf16 / fp16 / fp32 at ViT sequence lengths (197,
785, 1025 = a class token + 14², 28², 32² patches, and whole tiles at 256) against the reference backend
in float64, every autotune config forced in turn, a run-twice bitwise comparison, plus dispatch, dead
rows and linear memory. ``benchmarks/gpu_check.sh`` runs this file, after ``benchmarks/warm_kernels.py``
compiled every launch of it (:func:`warm_calls`) on all CPU cores.

Most cases run with ``VITATTN_TRITON_TILES=first`` (one config per kernel); ``test_every_config`` forces
each config of the arch's autotune lists (``VITATTN_TRITON_TILES=<index>``), ``test_autotuned`` runs the
autotuner. Tolerances (max-abs error relative to the reference's max-abs, forward / gradients): float32
(IEEE dots) 1e-5 / 3e-5, float16 3e-3 / 6e-3, bfloat16 2.5e-2 / 5e-2.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import pytest
import torch

from vitattn.functional import GaussianBias, WindowMask, attention, explain
from vitattn.functional.dispatch import AttentionCall
from vitattn.kernels import configs

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRET, reason="runs the compiled kernels (TRITON_INTERPRET is set)"),
]
pytest.importorskip("triton")

DEV = "cuda"
TOL = {torch.float32: (1e-5, 3e-5), torch.float16: (3e-3, 6e-3), torch.bfloat16: (2.5e-2, 5e-2)}
GRIDS = {197: (14, 14), 256: (16, 16), 785: (28, 28), 1025: (32, 32)}
TILES_ENV = "VITATTN_TRITON_TILES"
# the longest autotune list of the device's arch (sm_90's where there is none; a shorter list runs its
# last config past its end)
_CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
_LISTS = configs.AUTOTUNE_BY_ARCH[configs.arch_of(10 * _CAPABILITY[0] + _CAPABILITY[1])]
MAX_CONFIGS = max(len(tiles) for tiles in _LISTS.values())


@pytest.fixture(autouse=True)
def _one_config(request, monkeypatch):
    from vitattn.kernels import ops

    if "autotuned" not in request.node.name and "every_config" not in request.node.name:
        monkeypatch.setenv(TILES_ENV, "first")
    yield
    ops._TUNED.clear()


def _leaves(normalizer, kind, n, d, dtype, b=2, h=3, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ours = {
        name: (torch.randn(b, h, n, d, device=DEV, generator=g, dtype=torch.float64) * 1.5).to(dtype)
        for name in "qkv"
    }
    mask = None
    prefix = n - GRIDS[n][0] * GRIDS[n][1]
    if kind.startswith("gaussian"):
        n_p = n - prefix
        ours["sigma"] = torch.exp(torch.randn(b, h, n_p, 2, device=DEV, generator=g) * 0.7) * 4
        ours["alpha"] = torch.rand(b, h, n_p, 1, device=DEV, generator=g) * 3
    if kind == "add":
        ours["add"] = (torch.randn(1, h, n, n, device=DEV, generator=g) * 2).to(dtype)
    if kind in ("keep", "gaussian_keep"):
        mask = torch.rand(b, 1, n, n, device=DEV, generator=g) < 0.7
        mask[..., 0] = True
    if kind == "key_padding":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=DEV)
        mask[0, ..., -17:] = False
    if kind.endswith("window"):  # a 5 x 5 neighbourhood (the list kernels)
        mask = WindowMask(GRIDS[n], 5, num_prefix_tokens=prefix)
    if normalizer == "alpha":  # alpha-entmax with one alpha per head (float32, gradients to it)
        ours["ent_alpha"] = (1.2 + torch.rand(h, device=DEV, generator=g, dtype=torch.float64) * 0.6).float()
    ours = {k: t.requires_grad_() for k, t in ours.items()}
    ref = {k: t.detach().double().requires_grad_() for k, t in ours.items()}
    return ours, ref, mask


def _kwargs(leaves, normalizer, n, mask):
    kw = dict(normalizer=leaves["ent_alpha"] if normalizer == "alpha" else normalizer, mask=mask)
    if "sigma" in leaves:
        prefix = n - GRIDS[n][0] * GRIDS[n][1]
        kw["bias"] = GaussianBias(leaves["sigma"], leaves["alpha"], GRIDS[n], num_prefix_tokens=prefix)
    if "add" in leaves:
        kw["mask"] = leaves["add"]
    return kw


def _run(normalizer, kind, n, d, dtype, backend="triton", seed=0):
    """``(leaves, ref_leaves, mask, out, grads)``: the kernels' forward and every gradient (the upstream
    gradient drawn from ``seed + 1``)."""
    ours, ref, mask = _leaves(normalizer, kind, n, d, dtype, seed=seed)
    out = attention(ours["q"], ours["k"], ours["v"], backend=backend, **_kwargs(ours, normalizer, n, mask))
    grad = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed + 1))
    grads = torch.autograd.grad(out, list(ours.values()), grad.to(dtype))
    return ours, ref, mask, out, grads, grad


def _check(normalizer, kind, n, d, dtype, backend="triton"):
    ours, ref, mask, out, got, grad = _run(normalizer, kind, n, d, dtype, backend)
    want = attention(ref["q"], ref["k"], ref["v"], backend="reference", **_kwargs(ref, normalizer, n, mask))
    fwd_tol, grad_tol = TOL[dtype]
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert out.dtype == dtype and err <= fwd_tol, f"out: {err:.2e}"
    exp = torch.autograd.grad(want, list(ref.values()), grad.double())
    for name, a, w in zip(ours, got, exp, strict=True):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        assert err <= grad_tol, f"d{name}: {err:.2e} > {grad_tol:.0e}"


CASES = [
    ("softmax", "none", 197, 64, torch.bfloat16),
    ("softmax", "gaussian", 197, 64, torch.bfloat16),
    ("softmax", "gaussian_keep", 785, 64, torch.bfloat16),
    ("softmax", "add", 197, 32, torch.bfloat16),
    ("softmax", "key_padding", 1025, 128, torch.bfloat16),
    ("softmax", "gaussian", 1025, 80, torch.float16),
    ("softmax", "keep", 197, 16, torch.float32),
    ("entmax15", "none", 197, 64, torch.bfloat16),
    ("entmax15", "gaussian", 197, 64, torch.bfloat16),
    ("entmax15", "gaussian_keep", 785, 32, torch.bfloat16),
    ("entmax15", "add", 197, 64, torch.float16),
    ("entmax15", "key_padding", 1025, 128, torch.bfloat16),
    ("entmax15", "gaussian", 785, 64, torch.float32),
    # alpha-entmax with a tensor of alphas, and neighbourhood windows (the list kernels)
    ("alpha", "none", 197, 64, torch.bfloat16),
    ("alpha", "gaussian", 197, 64, torch.bfloat16),
    ("alpha", "add", 256, 128, torch.float16),
    ("softmax", "window", 785, 64, torch.bfloat16),
    ("softmax", "gaussian_window", 197, 64, torch.bfloat16),
    ("entmax15", "gaussian_window", 785, 32, torch.bfloat16),
    ("alpha", "window", 197, 64, torch.bfloat16),
]
# every config of every kernel: ragged lengths with the Gaussian bias (D 64), whole tiles without (D 128);
# plain softmax at D 64 (the 128 x 64 4-warp forward tile serves it alone), entmax-1.5 without a bias (its
# live-tile list kernels), alpha-entmax, and a window with the Gaussian bias (the list kernels' tiles)
CONFIG_CASES = [
    *(
        (normalizer, kind, n, d)
        for normalizer in ("softmax", "entmax15")
        for kind, n, d in (("gaussian", 197, 64), ("none", 256, 128))
    ),
    ("softmax", "none", 197, 64),
    ("entmax15", "none", 197, 64),
    ("alpha", "gaussian", 197, 64),
    ("softmax", "gaussian_window", 197, 64),
]
DETERMINISM_CASES = [
    ("softmax", "gaussian", 197, 64),
    ("entmax15", "gaussian", 197, 64),
    ("entmax15", "add", 256, 64),
]


def _ids(v):
    return str(v).replace("torch.", "")


@pytest.mark.parametrize("normalizer, kind, n, d, dtype", CASES, ids=_ids)
def test_matches_reference(normalizer, kind, n, d, dtype):
    _check(normalizer, kind, n, d, dtype)


@pytest.mark.parametrize("index", range(MAX_CONFIGS))
@pytest.mark.parametrize("normalizer, kind, n, d", CONFIG_CASES, ids=_ids)
def test_every_config(normalizer, kind, n, d, index, monkeypatch):
    """Each kernel runs its ``index``-th usable config (the last one past the end of a shorter list)."""
    monkeypatch.setenv(TILES_ENV, str(index))
    _check(normalizer, kind, n, d, torch.bfloat16)


@pytest.mark.parametrize("normalizer, kind, n, d", DETERMINISM_CASES, ids=_ids)
def test_run_twice_is_bitwise_equal(normalizer, kind, n, d):
    """The same call twice gives bitwise the same forward output, and the same gradients where no atomic
    adds run (the broadcast additive mask's gradient is atomic: its q, k, v gradients still match)."""
    first = _run(normalizer, kind, n, d, torch.bfloat16)
    second = _run(normalizer, kind, n, d, torch.bfloat16)
    assert torch.equal(first[3], second[3])
    names = list(first[0])
    for name, a, b in zip(names, first[4], second[4], strict=True):
        if name != "add":
            assert torch.equal(a, b), name


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_autotuned(normalizer):
    _check(normalizer, "gaussian", 197, 64, torch.bfloat16, backend="auto")


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_cuda_graph_replay_after_an_autotuned_call_is_bitwise_eager(normalizer):
    """A Gaussian fwd+bwd captured in a CUDA graph replays to the eager call's results bitwise: a first
    call tunes every kernel, the capture then uses the same tiles (``ops.pick_tile`` benchmarks nothing
    inside a capture); the host work (dispatch, lists, the live map's zeroing) is recorded.

    The capture follows torch's rule for autograd in a graph: no autograd graph built before it may be
    alive (``step`` returns its output detached). A kept output would keep its leaves' gradient
    accumulators, made on the stream of that eager call, and the captured backward would then wait on
    that stream, which invalidates the capture whatever the kernels do."""
    _run(normalizer, "gaussian", 197, 64, torch.bfloat16, seed=3)  # tunes; its leaves and graph are dropped
    ours, _ref, mask = _leaves(normalizer, "gaussian", 197, 64, torch.bfloat16, seed=3)
    kw = _kwargs(ours, normalizer, 197, mask)
    grad = torch.randn(2, 3, 197, 64, device=DEV, generator=torch.Generator(device=DEV).manual_seed(4))
    grad = grad.to(torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        out = attention(ours["q"], ours["k"], ours["v"], backend="triton", **kw)
        return (out.detach(), *torch.autograd.grad(out, list(ours.values()), grad))

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(["out", *ours], static, eager, strict=True):
        assert torch.equal(a, b), name


def test_auto_picks_triton_on_cuda():
    q = torch.randn(2, 3, 197, 64, device=DEV, dtype=torch.bfloat16)
    sigma = torch.rand(2, 3, 196, 2, device=DEV) * 4 + 0.5
    bias = GaussianBias(sigma, torch.rand(2, 3, 196, 1, device=DEV), (14, 14), 1)
    call = AttentionCall(q, q, q, "softmax", 0.125, None, bias, False, 0.0)
    assert explain(call)["triton"] is None
    auto, named = attention(q, q, q, bias=bias), attention(q, q, q, bias=bias, backend="triton")
    torch.testing.assert_close(auto, named, atol=0, rtol=0)
    # a plain softmax this small goes to SDPA (faster here: the Triton path is host-bound)
    assert explain(q, q, q).chosen == "sdpa"
    with pytest.raises(ValueError, match="return_weights=True"):
        attention(q, q, q, backend="triton", return_weights=True)


def _dead_rows(normalizer):
    q, k, v = (
        torch.randn(1, 2, 197, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    keep = torch.ones(1, 2, 197, 197, dtype=torch.bool, device=DEV)
    keep[0, 1, 7] = False
    keep[0, 0, 150:] = False
    out = attention(q, k, v, normalizer=normalizer, mask=keep, backend="triton")
    return q, out, torch.autograd.grad(out.float().sum(), (q, k, v))


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_fully_masked_rows(normalizer):
    _q, out, grads = _dead_rows(normalizer)
    assert not out.isnan().any()
    assert (out[0, 1, 7] == 0).all() and (out[0, 0, 150:] == 0).all()
    assert all(torch.isfinite(t).all() for t in grads)
    assert (grads[0][0, 1, 7] == 0).all()


def _linear_memory(normalizer):
    n, h, d = 4097, 4, 64
    q, k, v = (
        torch.randn(1, h, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    sigma = torch.rand(1, h, n - 1, 2, device=DEV, requires_grad=True)
    alpha = torch.rand(1, h, n - 1, 1, device=DEV, requires_grad=True)
    bias = GaussianBias(sigma, alpha, (64, 64), num_prefix_tokens=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attention(q, k, v, normalizer=normalizer, bias=bias, backend="triton")
    out.float().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, h * n * n * 2


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_memory_is_linear_in_sequence_length(normalizer):
    extra, one_score_matrix = _linear_memory(normalizer)  # a single bf16 (1, H, N, N) tensor: 134 MB
    assert extra < one_score_matrix / 4, f"{extra / 2**20:.0f} MiB extra"


def warm_calls() -> list[tuple[str, dict[str, str], Callable[[], object]]]:
    """``(name, environment, call)`` of every kernel launch this file makes, without the reference or the
    comparisons: ``benchmarks/warm_kernels.py`` runs them under ``VITATTN_TRITON_COMPILE_ONLY=1`` (each
    compiles what it would launch) before the tests run."""
    first = {TILES_ENV: "first"}
    calls: list[tuple[str, dict[str, str], Callable[[], object]]] = []
    for case in CASES:
        calls.append((f"tests {_ids(case)}", first, functools.partial(_run, *case)))
    for normalizer, kind, n, d in CONFIG_CASES:
        for index in range(MAX_CONFIGS):
            env = {TILES_ENV: str(index)}
            call = functools.partial(_run, normalizer, kind, n, d, torch.bfloat16)
            calls.append((f"tests config {index} {normalizer} {kind} {n} {d}", env, call))
    for normalizer, kind, n, d in DETERMINISM_CASES:
        call = functools.partial(_run, normalizer, kind, n, d, torch.bfloat16)
        calls.append((f"tests twice {normalizer} {kind}", first, call))
    for normalizer in ("softmax", "entmax15"):
        calls.append(
            (
                f"tests autotuned {normalizer}",
                {TILES_ENV: ""},
                functools.partial(_run, normalizer, "gaussian", 197, 64, torch.bfloat16, "auto"),
            )
        )
        calls.append((f"tests dead rows {normalizer}", first, functools.partial(_dead_rows, normalizer)))
        calls.append((f"tests memory {normalizer}", first, functools.partial(_linear_memory, normalizer)))
    return calls
