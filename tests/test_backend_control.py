"""Which backend runs a layer's attention: the layer argument, set_default_backend, VITATTN_BACKEND,
and explain() on the user's own arguments."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import vitattn
from vitattn.functional import GaussianBias, attention, available_backends, dispatch, explain
from vitattn.functional.dispatch import AttentionCall
from vitattn.functional.reference import ReferenceBackend
from vitattn.layers import Attention, EntmaxAttention, LocAtAttention


class RecordingBackend:
    """Runs like the reference backend and records every call; ``decline`` makes it refuse with a reason."""

    def __init__(self, name: str = "recorder", decline: str | None = None) -> None:
        self.name = name
        self.decline = decline
        self.calls: list[AttentionCall] = []

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        return self.decline

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls.append(call)
        return ReferenceBackend().run(call)

    def path(self, call: AttentionCall) -> str:
        return "recording"


@pytest.fixture
def registry():
    """Backends registered inside the test are removed after it; the default backend is restored."""
    saved = (
        dict(dispatch._REGISTRY),
        list(dispatch._AUTO_ORDER),
        dispatch._DEFAULT_BACKEND,
        dispatch._ENV_BACKEND,
        dict(dispatch._GROUPS),
    )
    try:
        yield
    finally:
        dispatch._REGISTRY.clear()
        dispatch._REGISTRY.update(saved[0])
        dispatch._AUTO_ORDER[:] = saved[1]
        dispatch._DEFAULT_BACKEND, dispatch._ENV_BACKEND = saved[2], saved[3]
        dispatch._GROUPS.clear()
        dispatch._GROUPS.update(saved[4])


@pytest.fixture
def recorder(registry):
    backend = RecordingBackend()
    dispatch.register_backend(backend)  # last in "auto" order: "auto" alone never picks it on CPU
    return backend


def _layers(backend: str) -> list[torch.nn.Module]:
    return [
        Attention(16, num_heads=2, backend=backend),
        EntmaxAttention(16, num_heads=2, backend=backend),
        LocAtAttention(16, num_heads=2, grid_size=(2, 2), num_prefix_tokens=1, backend=backend),
    ]


def test_layer_argument_routes_to_the_named_backend(recorder):
    x = torch.randn(2, 5, 16)
    for layer in _layers("recorder"):
        before = len(recorder.calls)
        with torch.no_grad():
            out = layer(x)
        assert out.shape == (2, 5, 16)
        assert len(recorder.calls) == before + 1, type(layer).__name__
        assert layer.backend == "recorder" and "backend='recorder'" in repr(layer)
    assert isinstance(recorder.calls[-1].bias, GaussianBias)  # the LocAt layer's call, bias and all
    for layer in _layers("auto"):  # without the argument "auto" picks another backend
        before = len(recorder.calls)
        layer(x)
        assert len(recorder.calls) == before
        assert "backend=" not in repr(layer)


def test_layer_result_is_the_same_whichever_backend(recorder):
    x = torch.randn(2, 5, 16)
    layer = Attention(16, num_heads=2)
    ref = layer(x)
    layer.backend = "recorder"
    torch.testing.assert_close(layer(x), ref)
    assert len(recorder.calls) == 1


def test_global_default_and_its_precedence(recorder):
    other = RecordingBackend("other")
    dispatch.register_backend(other)
    x = torch.randn(1, 5, 16)
    auto_layer, named_layer = Attention(16, num_heads=2), Attention(16, num_heads=2, backend="other")
    assert vitattn.get_default_backend() == "auto"
    vitattn.set_default_backend("recorder")
    assert vitattn.get_default_backend() == "recorder"
    auto_layer(x)
    named_layer(x)  # the layer's own argument beats the global default
    assert len(recorder.calls) == 1 and len(other.calls) == 1
    q = torch.randn(1, 2, 5, 8)
    attention(q, q, q)  # a functional call with backend="auto" follows the default as well
    assert len(recorder.calls) == 2
    attention(q, q, q, backend="torch")
    assert len(recorder.calls) == 2
    # set_default_backend beats VITATTN_BACKEND; None clears it, and then the env var applies
    dispatch._ENV_BACKEND = "other"
    auto_layer(x)
    assert len(recorder.calls) == 3 and len(other.calls) == 1
    vitattn.set_default_backend(None)
    assert vitattn.get_default_backend() == "other"
    auto_layer(x)
    assert len(other.calls) == 2
    vitattn.set_default_backend("auto")  # "auto" overrides the env var with the automatic choice
    auto_layer(x)
    assert len(recorder.calls) == 3 and len(other.calls) == 2


def test_a_default_backend_that_declines_raises_with_its_reason(registry):
    dispatch.register_backend(RecordingBackend("picky", decline="picky only takes float64"))
    vitattn.set_default_backend("picky")
    with pytest.raises(ValueError, match=r"backend='picky' \(the default backend.*picky only takes float64"):
        Attention(16, num_heads=2)(torch.randn(1, 5, 16))


def test_backend_names_are_validated(registry):
    names = available_backends()
    for make in (
        lambda: Attention(16, num_heads=2, backend="nope"),
        lambda: EntmaxAttention(16, num_heads=2, backend="nope"),
        lambda: LocAtAttention(16, num_heads=2, backend="nope"),
    ):
        with pytest.raises(
            ValueError,
            match=r"backend must be 'auto', one of \['triton', 'cpu_blocked', 'sdpa', 'reference'\] or a "
            r"group \['torch'\], got 'nope'",
        ):
            make()
    assert names == ["triton", "cpu_blocked", "sdpa", "reference"]
    with pytest.raises(
        ValueError, match=r"set_default_backend\(backend\) must be 'auto', one of .* got 'nope'"
    ):
        vitattn.set_default_backend("nope")
    dispatch._ENV_BACKEND = "nope"
    with pytest.raises(ValueError, match="the environment variable VITATTN_BACKEND must be 'auto', one of"):
        Attention(16, num_heads=2)(torch.randn(1, 5, 16))


@pytest.mark.slow
def test_env_var_is_read_at_import_and_routes_layers():
    code = textwrap.dedent(
        """
        import os, torch, vitattn
        from vitattn.functional import dispatch
        from vitattn.functional.reference import ReferenceBackend
        from vitattn.layers import Attention

        calls = []
        class Recorder(ReferenceBackend):
            name = "recorder"
            def run(self, call):
                calls.append(call)
                return super().run(call)

        dispatch.register_backend(Recorder())  # registered after import: the name is checked on use
        assert vitattn.get_default_backend() == "recorder"
        Attention(16, num_heads=2)(torch.randn(1, 5, 16))
        assert len(calls) == 1, calls
        Attention(16, num_heads=2, backend="torch")(torch.randn(1, 5, 16))
        assert len(calls) == 1, calls
        os.environ["VITATTN_BACKEND"] = "torch"  # read once, at import: later changes do nothing
        assert vitattn.get_default_backend() == "recorder"
        print("ok")
        """
    )
    env = {**os.environ, "VITATTN_BACKEND": "recorder", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_explain_takes_the_attention_arguments(registry):
    dispatch.register_backend(RecordingBackend("picky", decline="picky declines: head dim 8 is not 64"))
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    report = explain(q, k, v, mask=mask, normalizer="entmax15", scale=0.25)
    assert set(report) == set(available_backends())
    assert report["reference"] is None and report["picky"] == "picky declines: head dim 8 is not 64"
    assert isinstance(report["triton"], str)  # CPU and float64: the kernels decline, with a reason
    assert report["cpu_blocked"] == "a mask (the row-blocked paths take none)"
    assert report["sdpa"] == "normalizer 'entmax15' (SDPA computes softmax only)"
    assert report.chosen == "reference" and report.error is None
    assert report.path == "dense formula: (B, H, Nq, Nk) scores, normalizer, @ v"
    text = str(report)
    for piece in (
        "q: (2, 3, 5, 8) torch.float64 on cpu",
        "k: (2, 3, 5, 8) torch.float64",
        "v: (2, 3, 5, 4) torch.float64",
        "mask: (2, 1, 1, 5) torch.bool",
        "bias: None",
        "normalizer='entmax15'",
        "scale=0.25",
        f"triton: declines: {report['triton']}",
        "picky: declines: picky declines: head dim 8 is not 64",
        "reference: can run it",
        "runs on: reference: dense formula",
    ):
        assert piece in text, (piece, text)


def test_explain_names_the_default_and_a_backend_that_cannot_run(registry):
    dispatch.register_backend(RecordingBackend("picky", decline="picky only takes float64"))
    q = torch.randn(1, 2, 5, 8)
    vitattn.set_default_backend("picky")
    report = explain(q, q, q)
    assert report.resolved == "picky" and report.chosen is None
    assert "backend='auto' -> 'picky' (default backend)" in str(report)
    assert "runs on: none (backend='picky'" in str(report) and "picky only takes float64" in str(report)
    vitattn.set_default_backend(None)
    sigma, alpha = torch.ones(1, 2, 4, 2), torch.ones(1, 2, 4, 1)
    text = str(explain(q, q, q, bias=GaussianBias(sigma, alpha, (2, 2), 1), backend="torch"))
    assert "bias: GaussianBias(grid_size=(2, 2), num_prefix_tokens=1" in text
    assert "backend='torch' (the group of cpu_blocked, sdpa, reference)" in text
    assert "runs on: cpu_blocked: row-blocked Gaussian softmax, inference, eager" in text, text


def test_explain_checks_arguments_like_attention():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"k and v must share the key count Nk, got k \(1, 2, 5, 8\)"):
        explain(q, q, q[:, :, :3])
    with pytest.raises(ValueError, match="backend must be 'auto', one of"):
        explain(q, q, q, backend="nope")
    with pytest.raises(TypeError, match="needs q, k and v"):
        explain(q)
    call = AttentionCall(q, q, q, "softmax", 0.5, None, None, False, 0.0)
    assert explain(call) == dispatch.backend_reasons(call)  # a call made by hand works too
