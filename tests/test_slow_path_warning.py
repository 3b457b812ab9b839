"""``SlowPathWarning``: ``backend="auto"`` warns, once per backend and reason, when it runs a CUDA call on
a path that builds ``(Nq, Nk)`` scores the call did not bring because the fused kernels declined it.
CUDA calls are fake tensors (``FakeTensorMode``) and the dense backends' runs are replaced by zeros: the
dispatcher's choice needs no device, and fakes have no values to threshold.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.functional import (
    GaussianBias,
    SlowPathWarning,
    WindowMask,
    attention,
    dispatch,
    explain,
    make_call,
)
from vitattn.functional.reference import ReferenceBackend
from vitattn.functional.sdpa import SdpaBackend


@pytest.fixture(autouse=True)
def fresh_and_dry(monkeypatch):
    """Nothing warned about yet; the dense backends return zeros instead of running."""
    monkeypatch.setattr(dispatch, "_WARNED", set())

    def dry_run(self, call):
        weights = call.q.new_zeros(*call.q.shape[:3], call.k.shape[2])
        return torch.zeros_like(call.q), weights if call.return_weights else None

    for cls in (ReferenceBackend, SdpaBackend):
        monkeypatch.setattr(cls, "run", dry_run)


def _cuda(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")


def _caught(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, SlowPathWarning)]


def test_a_declined_call_on_a_dense_path_warns_once_per_reason():
    """Head dim 160 (the kernels serve up to 128): entmax-1.5 goes to the dense formula, with a warning
    naming it, the reason and the shapes, located at the caller; the same reason again does not warn; a
    Gaussian bias on SDPA (its dense bias) warns once more, for that backend."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = _cuda(1, 2, 50, 160)
        sigma, alpha = torch.ones(1, 2, 49, 2, device="cuda"), torch.ones(1, 2, 49, 1, device="cuda")
        bias = GaussianBias(sigma, alpha, (7, 7), 1)
        first = _caught(lambda: attention(q, q, q, normalizer="entmax15"))
        again = _caught(lambda: attention(q, q, q, normalizer="entmax15"))
        sdpa = _caught(lambda: attention(q, q, q, bias=bias))
    assert len(first) == 1 and again == [] and len(sdpa) == 1
    text = str(first[0].message)
    assert "'reference'" in text and "'triton' declined it" in text and "head dim D=160" in text
    assert "(Nq, Nk) = (50, 50)" in text
    assert first[0].filename == __file__  # the caller of attention(), not vitattn
    assert "'sdpa'" in str(sdpa[0].message) and "dense additive mask" in str(sdpa[0].message)


def test_no_warning_where_nothing_dense_is_built_or_it_was_asked_for():
    """SDPA without a bias or window (its flash kernel), weights asked for, a backend named by the user,
    ``explain()``, a call the kernels take, a call being compiled, and CPU calls: no warning."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        big = _cuda(1, 2, 50, 160)
        small = _cuda(1, 2, 50, 64)
        caught = _caught(lambda: attention(big, big, big))
        caught += _caught(lambda: attention(big, big, big, normalizer="entmax15", return_weights=True))
        caught += _caught(lambda: attention(big, big, big, normalizer="entmax15", backend="reference"))
        caught += _caught(lambda: explain(big, big, big, normalizer="entmax15"))
        call = make_call(small, small, small, normalizer="entmax15")
        caught += _caught(
            lambda: dispatch.warn_dense_fallback(call, dispatch.select_backend(call, "auto"), "auto")
        )
        traced = dataclasses.replace(make_call(big, big, big, normalizer="entmax15"), compiling=True)
        caught += _caught(lambda: dispatch.warn_dense_fallback(traced, ReferenceBackend(), "auto"))
    cpu = torch.randn(1, 2, 50, 160)
    alphas = torch.full((2,), 1.3)  # on the CPU a tensor of alphas runs on the dense formula
    caught += _caught(lambda: attention(cpu, cpu, cpu, normalizer=alphas))
    assert caught == []
    # the same dense call, not compiled, does warn (the cases above differ in one thing each)
    with FakeTensorMode(allow_non_fake_inputs=True):
        big = _cuda(1, 2, 50, 160)
        assert len(_caught(lambda: attention(big, big, big, normalizer="entmax15"))) == 1


def test_what_each_dense_backend_says_it_builds():
    """``builds_scores``: the dense formula always; SDPA for a Gaussian bias (made dense) or a window (an
    ``(N, N)`` mask), not for a plain call or a mask the caller brought."""
    q = torch.randn(1, 2, 50, 16)
    bias = GaussianBias(torch.ones(1, 2, 49, 2), torch.ones(1, 2, 49, 1), (7, 7), 1)
    keep = torch.ones(50, 50, dtype=torch.bool)
    sdpa, ref = SdpaBackend(), ReferenceBackend()
    assert ref.builds_scores(make_call(q, q, q))
    assert sdpa.builds_scores(make_call(q, q, q, bias=bias))
    assert sdpa.builds_scores(make_call(q, q, q, mask=WindowMask((7, 7), (3, 3), num_prefix_tokens=1)))
    assert not sdpa.builds_scores(make_call(q, q, q)) and not sdpa.builds_scores(
        make_call(q, q, q, mask=keep)
    )
