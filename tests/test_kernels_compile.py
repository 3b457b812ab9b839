"""``torch.compile`` of the Triton backend: the fused forward and backward are ``torch.library`` custom
ops (``torch.ops.vitattn.attention_fwd`` / ``attention_bwd``, :mod:`vitattn.kernels.ops`) with fake
implementations and ``register_autograd``, so a layer traces into one graph with no graph break.

Two halves, because no GPU is here:

- on fake CUDA tensors (``FakeTensorMode``: a device and a dtype, no storage) dynamo traces an
  ``EntmaxAttention`` / ``LocAtAttention`` forward on ``cuda`` with ``backend="triton"``: one graph,
  zero breaks, the custom op a node of it. (The autograd engine needs a real CUDA context for a
  backward on CUDA tensors, so the backward half runs on CPU tensors:)
- in Triton's interpreter (``@pytest.mark.triton_interpreter``, CPU tensors, ``backend="triton"``)
  ``torch.compile(fullgraph=True)`` through AOT autograd gives a forward graph holding
  ``attention_fwd`` and a backward graph holding ``attention_bwd``, with eager's outputs and
  gradients; and ``torch.library.opcheck`` passes on both ops (schema, autograd registration, fake
  tensors, AOT dispatch with dynamic shapes).
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.functional import GaussianBias
from vitattn.layers import EntmaxAttention, LocAtAttention

pytest.importorskip("triton")
from vitattn.cache import CACHE_ENV  # noqa: E402
from vitattn.kernels import ops  # noqa: E402  (imports triton, registers the ops)

interpreted = pytest.mark.triton_interpreter
FWD, BWD = torch.ops.vitattn.attention_fwd.default, torch.ops.vitattn.attention_bwd.default
LAYERS = {
    "entmax": (EntmaxAttention, {}),
    "locat": (LocAtAttention, dict(grid_size=(4, 4), num_prefix_tokens=1)),
    "locat-entmax": (LocAtAttention, dict(grid_size=(4, 4), num_prefix_tokens=1, normalizer="entmax15")),
}


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_traces_into_one_graph_on_fake_cuda(name):
    cls, kw = LAYERS[name]
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = cls(64, num_heads=2, backend="triton", device="meta", dtype=torch.bfloat16, **kw)
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer.to_empty(device="cuda")
        x = torch.empty(2, 17, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        explanation = torch._dynamo.explain(layer)(x)
        out = torch.compile(layer, backend=counting, fullgraph=True)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert out.shape == (2, 17, 64) and out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert len(graphs) == 1 and _targets(graphs[0]).count(FWD) == 1


def test_fake_cuda_autocast_with_float32_qk_traces_too(monkeypatch):
    """timm's qk_norm under CUDA autocast: float32 q, k next to a bfloat16 v, one graph. (CUDA
    autocast switches itself off without a GPU, so its state is patched in.)"""
    from vitattn.functional import dispatch
    from vitattn.kernels import backend as kb

    def cuda_bf16(device_type):
        return torch.bfloat16 if device_type == "cuda" else None

    monkeypatch.setattr(dispatch, "autocast_dtype", cuda_bf16)
    monkeypatch.setattr(kb, "autocast_dtype", cuda_bf16)
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def attend(q, k, v):
        from vitattn.functional import attention

        return attention(q, k, v, normalizer="entmax15", backend="triton")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k = (torch.empty(2, 3, 17, 32, device="cuda", requires_grad=True) for _ in range(2))
        v = torch.empty(2, 3, 17, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = torch.compile(attend, backend=counting, fullgraph=True)(q, k, v)
    assert out.dtype == torch.bfloat16
    assert len(graphs) == 1 and FWD in _targets(graphs[0])


@interpreted
@pytest.mark.parametrize("name", list(LAYERS))
def test_compiled_forward_and_backward_match_eager_in_the_interpreter(name):
    cls, kw = LAYERS[name]
    torch._dynamo.reset()
    fw, bw = [], []

    def keep(store):
        def compiler(gm, example_inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keep(fw), bw_compiler=keep(bw))
    layer = cls(32, num_heads=2, backend="triton", **kw)
    x = torch.randn(2, 17, 32, requires_grad=True)
    want = layer(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    got = torch.compile(layer, backend=backend, fullgraph=True)(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    assert len(fw) == 1 and len(bw) == 1
    assert _targets(fw[0]).count(FWD) == 1 and _targets(bw[0]).count(BWD) == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def _op_inputs(normalizer: str):
    """Every operand at once: q, k, v ``(1, 2, 17, 16)``, a broadcast additive mask, a keep-mask, the
    Gaussian factors of a 4x4 grid with one prefix token, and for alpha-entmax one alpha per head."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=g).requires_grad_() for _ in range(3))
    sigma = torch.exp(torch.randn(1, 2, 16, 2, generator=g) * 0.5)
    gb = GaussianBias(sigma, torch.rand(1, 2, 16, 1, generator=g), (4, 4), 1)
    den = gb.denominators().float().expand(1, 2, 16, 2).clone().requires_grad_()
    alpha = gb.alpha[..., 0].clone().requires_grad_()
    add = torch.randn(1, 1, 17, 17, generator=g).requires_grad_()
    keep = torch.rand(1, 1, 17, 17, generator=g) < 0.8
    keep[..., 0] = True
    ent = None
    if normalizer == "entmax_alpha":
        ent = torch.tensor([1.3, 1.8])[None, :, None].expand(1, 2, 17).clone().requires_grad_()
    sparse = normalizer != "softmax"
    entmax = normalizer == "entmax15"
    return (q, k, v, add, keep, den, alpha, ent, 0.25, 1, 4, float(gb.clamp), entmax, False, sparse)


@interpreted
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15", "entmax_alpha"])
def test_opcheck_forward_and_backward_ops(normalizer):
    args = _op_inputs(normalizer)
    torch.library.opcheck(ops.attention_fwd, args)
    out, stat, og, live = ops.attention_fwd(*args)
    assert live.numel() == (0 if normalizer != "entmax15" else live.numel()) and live.dtype == torch.uint8
    q, k, v, add, keep, den, alpha, ent, *scalars, _store_og = args
    plain = [t.detach() for t in (q, k, v, add)]
    saved = (og if normalizer != "softmax" else out).detach()
    ent = None if ent is None else ent.detach()
    bwd_args = (torch.randn_like(out).detach(), saved, stat.detach(), live, *plain, keep, den.detach(),
                alpha.detach(), ent, *scalars, True, True, ent is not None)  # fmt: skip
    torch.library.opcheck(ops.attention_bwd, bwd_args)


# ---- on a GPU (skipped here): the compiled layer, and a first call inside CUDA-graph capture ----------

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA GPU and the compiled kernels (TRITON_INTERPRET unset)",
)


@needs_gpu
@pytest.mark.parametrize("name", list(LAYERS))
def test_compiled_layer_on_cuda_matches_eager(name):
    cls, kw = LAYERS[name]
    torch._dynamo.reset()
    layer = cls(64, num_heads=2, backend="triton", device="cuda", dtype=torch.bfloat16, **kw)
    x = torch.randn(2, 17, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = layer(x)
    (want_dx,) = torch.autograd.grad(want.float().square().sum(), [x])
    got = torch.compile(layer, fullgraph=True)(x)
    (got_dx,) = torch.autograd.grad(got.float().square().sum(), [x])
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_dx, want_dx, atol=5e-2, rtol=5e-2)


@needs_gpu
def test_first_call_inside_cuda_graph_capture_uses_the_default_tile(tmp_path, monkeypatch):
    from vitattn.functional import attention

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(ops.TILES_ENV, raising=False)
    ops._TUNED.clear()
    ops._DISK.clear()
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ops.kernels()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = attention(q, k, v, normalizer="entmax15", backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert not ops._TUNED  # nothing benchmarked, nothing remembered
    want = attention(q.float(), k.float(), v.float(), normalizer="entmax15", backend="reference")
    torch.testing.assert_close(out.float(), want, atol=2.5e-2, rtol=0)
