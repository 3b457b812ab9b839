"""The row-blocked Gaussian attention as a custom op: its schema and fake, and torch.compile calling it."""

from __future__ import annotations

import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vitattn  # noqa: F401  (registers the timm models)
from vitattn.functional import GaussianBias
from vitattn.functional.blocked import gaussian_softmax_attention
from vitattn.functional.blocked_ops import gaussian_attention_op

from .reference_formulas import naive_gaug_bias, plain_attention

OP = torch.ops.vitattn.gaussian_attention_cpu.default


def _case(seed: int, grid=(3, 4), prefix=1, initial=(3, 4), heads=2, broadcast=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    n = prefix + grid[0] * grid[1]
    qkv = torch.randn(b, n, 3, heads, d, generator=g, dtype=dtype).permute(2, 0, 3, 1, 4)  # as a layer gives
    q, k, v = qkv.unbind(0)
    sb, sh = (1, 1) if broadcast else (b, heads)
    sigma = torch.rand(sb, sh, grid[0] * grid[1], 2, generator=g, dtype=dtype) * 6 + 0.1
    alpha = torch.rand(sb, sh, grid[0] * grid[1], 1, generator=g, dtype=dtype) * 3
    return q, k, v, GaussianBias(sigma, alpha, grid, prefix, initial)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.tuples(st.integers(1, 5), st.integers(1, 5)),
    st.sampled_from([0, 1, 3]),
    st.booleans(),
    st.booleans(),
)
def test_op_is_the_blocked_function_and_the_plain_formula(seed, grid, prefix, broadcast, resized):
    initial = (grid[0] + 2, grid[1] + 1) if resized else grid
    q, k, v, bias = _case(seed, grid, prefix, initial, broadcast=broadcast, dtype=torch.float64)
    got = gaussian_attention_op(q, k, v, 0.35, bias)
    torch.testing.assert_close(got, gaussian_softmax_attention(q, k, v, 0.35, bias), atol=0, rtol=0)
    dense = naive_gaug_bias(bias.sigma, bias.alpha, grid, prefix, initial)
    ref, _ = plain_attention(q, k, v, "softmax", scale=0.35, bias=dense)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    assert got.transpose(1, 2).is_contiguous()  # (B, N, H, Dv) in memory, as the fake says


@pytest.mark.parametrize("broadcast", [False, True])
def test_opcheck(broadcast):
    """torch.library's own checks: schema, fake tensor (shape and strides), dispatch through AOT."""
    q, k, v, bias = _case(0, broadcast=broadcast)
    (gh, gw), (ih, iw) = bias.grid_size, bias.initial_grid_size
    args = (q, k, v, bias.sigma, bias.alpha, 0.3, gh, gw, bias.num_prefix_tokens, ih, iw)
    torch.library.opcheck(OP, args)


def _compiled_graphs(model, x):
    """(compiled output, the FX graphs dynamo handed to the backend), fullgraph, AOT-free backend."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    return out, graphs


def test_compiled_locat_inference_calls_the_op_and_matches_eager():
    torch.manual_seed(0)
    model = timm.create_model("locatvit_tiny", img_size=32, patch_size=8, depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got, graphs = _compiled_graphs(model, x)
        want = model(x)
    code = "\n".join(g.code for g in graphs)
    assert code.count("vitattn.gaussian_attention_cpu") == 2  # one call per block
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiled_training_does_not_call_the_op():
    """A call autograd records keeps the traceable (dense-bias) path: the op has no backward."""
    torch.manual_seed(0)
    model = timm.create_model("locatvit_tiny", img_size=32, patch_size=8, depth=1).train()
    x = torch.randn(2, 3, 32, 32)
    out, graphs = _compiled_graphs(model, x)
    assert "vitattn.gaussian_attention_cpu" not in "\n".join(g.code for g in graphs)
    out.sum().backward()
    assert model.blocks[0].attn.gaug.log_var.weight.grad is not None
