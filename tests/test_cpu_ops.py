"""The CPU row-blocked paths as custom ops: schemas, fakes, gradients, torch.compile calling them."""

from __future__ import annotations

import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vitattn  # noqa: F401  (registers the timm models)
from vitattn.functional import GaussianBias
from vitattn.functional.cpu.entmax import entmax15_attention, flat_factors
from vitattn.functional.cpu.ops import entmax15_train_op, gaussian_softmax_train_op
from vitattn.functional.cpu.ops import inference_op as blocked_attention_op
from vitattn.functional.cpu.softmax import (
    gaussian_softmax_attention,
    gaussian_softmax_attention_train,
    prepare,
)

from .reference_formulas import naive_gaug_bias, plain_attention

OP = torch.ops.vitattn.blocked_attention_cpu.default
TRAIN_OP = torch.ops.vitattn.gaussian_attention_cpu_train.default
ENTMAX_TRAIN_OP = torch.ops.vitattn.entmax15_attention_cpu_train.default


def _case(
    seed: int, grid=(3, 4), prefix=1, initial=(3, 4), heads=2, broadcast=False, dtype=torch.float32, d=8
):
    g = torch.Generator().manual_seed(seed)
    b = 2
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
    got = blocked_attention_op(q, k, v, 0.35, bias, entmax=False)
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
    args = (q, k, v, bias.sigma, bias.alpha, 0.3, gh, gw, bias.num_prefix_tokens, ih, iw, False)
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


@pytest.mark.slow
def test_compiled_locat_inference_calls_the_op_and_matches_eager():
    torch.manual_seed(0)
    model = timm.create_model("locatvit_tiny", img_size=32, patch_size=8, depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got, graphs = _compiled_graphs(model, x)
        want = model(x)
    code = "\n".join(g.code for g in graphs)
    assert code.count("vitattn.blocked_attention_cpu") == 2  # one call per block
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _train_case(seed: int, prefix=1, grid=(3, 4), broadcast=False, heads=3, d=8):
    q, k, v, bias = _case(seed, grid, prefix, grid, heads, broadcast, torch.float64, d)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias.sigma, bias.alpha)]
    return leaves


# gradcheck perturbs every input element in turn: a small grid, 2 heads and head dim 4 keep it to ~400
# elements (B = 2, so a sigma broadcast over the batch is still a broadcast)
GRADCHECK_GRID = (2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("prefix, broadcast", [(1, False), (0, True), (3, False)])
def test_training_op_gradcheck(prefix, broadcast):
    """float64 gradients of the op pair, to q, k, v and (through the traced factors) sigma and alpha."""
    q, k, v, sigma, alpha = _train_case(1, prefix, GRADCHECK_GRID, broadcast, heads=2, d=4)

    def f(q, k, v, sigma, alpha):
        return gaussian_softmax_train_op(q, k, v, 0.4, GaussianBias(sigma, alpha, GRADCHECK_GRID, prefix))

    assert torch.autograd.gradcheck(f, (q, k, v, sigma, alpha))


def test_training_op_matches_the_autograd_function():
    q, k, v, sigma, alpha = _train_case(2)
    grad = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], dtype=q.dtype)  # B = 2, H = 3
    results = []
    for fn in (gaussian_softmax_train_op, gaussian_softmax_attention_train):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sigma, alpha)]
        out = fn(*leaves[:3], 0.4, GaussianBias(leaves[3], leaves[4], (3, 4), 1))
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in leaves)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_training_opcheck():
    """torch.library's checks of the training op with inputs that need gradients (its autograd
    registration included), on the operands prepare gives it."""
    q, k, v, sigma, alpha = _train_case(3)
    qq, kk, vv, ra_t, c_t = prepare(q, k, v, GaussianBias(sigma, alpha, (3, 4), 1), eager=False)
    args = (qq, kk, vv, ra_t, c_t, 0.4, 3, 4, 1)
    torch.library.opcheck(TRAIN_OP, args)


@pytest.mark.slow
def test_compiled_training_calls_the_training_op_and_matches_eager():
    torch.manual_seed(0)
    model = timm.create_model("locatvit_tiny", img_size=32, patch_size=8, depth=1).train()
    x = torch.randn(2, 3, 32, 32)
    out, graphs = _compiled_graphs(model, x)
    code = "\n".join(g.code for g in graphs)
    assert "vitattn.gaussian_attention_cpu_train" in code
    assert "vitattn.blocked_attention_cpu" not in code
    out.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    want_out = model(x)
    want_out.sum().backward()
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    assert got.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert "blocks.0.attn.gaug.log_var.weight" in got
    for name, g in got.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, atol=1e-5, rtol=1e-4, msg=name)


# ---- entmax-1.5 (inference op) ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
def test_entmax_op_is_the_blocked_function_and_the_package(with_bias):
    q, k, v, bias = _case(4, prefix=1, dtype=torch.float64)
    bias = bias if with_bias else None
    got = blocked_attention_op(q, k, v, 0.5, bias, entmax=True)
    torch.testing.assert_close(got, entmax15_attention(q, k, v, 0.5, bias), atol=0, rtol=0)
    dense = None if bias is None else naive_gaug_bias(bias.sigma, bias.alpha, (3, 4), 1, (3, 4))
    ref, _ = plain_attention(q, k, v, "entmax15", scale=0.5, bias=dense)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-8)


def test_entmax_op_keys_other_than_queries():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    ref, _ = plain_attention(q, k, v, "entmax15", scale=0.7)
    torch.testing.assert_close(
        blocked_attention_op(q, k, v, 0.7, None, entmax=True), ref, atol=1e-10, rtol=1e-8
    )


@pytest.mark.parametrize("with_bias", [False, True])
def test_entmax_opcheck(with_bias):
    q, k, v, bias = _case(6, heads=3)
    sigma, alpha = (bias.sigma, bias.alpha) if with_bias else (None, None)
    torch.library.opcheck(OP, (q, k, v, sigma, alpha, 0.3, 3, 4, 1, 3, 4, True))


@pytest.mark.slow
def test_compiled_locat_entmax_calls_the_inference_op_then_the_training_op():
    torch.manual_seed(0)
    model = timm.create_model("locatvit_tiny", img_size=32, patch_size=8, depth=2, normalizer="entmax15")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got, graphs = _compiled_graphs(model.eval(), x)
        want = model(x)
    assert "\n".join(g.code for g in graphs).count("vitattn.blocked_attention_cpu") == 2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    out, graphs = _compiled_graphs(model.train(), x)
    code = "\n".join(g.code for g in graphs)
    assert "vitattn.blocked_attention_cpu" not in code
    assert code.count("vitattn.entmax15_attention_cpu_train") == 2
    out.sum().backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    want_out = model(x)
    want_out.sum().backward()
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    assert "blocks.0.attn.gaug.log_alpha.weight" in got_grads
    for name, g in got_grads.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, atol=1e-5, rtol=1e-4, msg=name)


# ---- entmax-1.5 (training ops) -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("with_bias, prefix", [(False, 1), (True, 1), (True, 0)])
def test_entmax_training_op_gradcheck(with_bias, prefix):
    """float64 gradients of the entmax op pair, to q, k, v and (through the traced factors) σ and α."""
    q, k, v, sigma, alpha = _train_case(8, prefix, GRADCHECK_GRID, heads=2, d=4)

    def f(q, k, v, sigma, alpha):
        bias = GaussianBias(sigma, alpha, GRADCHECK_GRID, prefix) if with_bias else None
        return entmax15_train_op(q, k, v, 0.6, bias)

    assert torch.autograd.gradcheck(
        f, (q, k, v, sigma, alpha) if with_bias else (q, k, v, sigma.detach(), alpha.detach())
    )


@pytest.mark.parametrize("with_bias", [False, True])
def test_entmax_training_op_matches_the_eager_path_and_the_package(with_bias):
    q, k, v, sigma, alpha = _train_case(9)
    grad = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], dtype=q.dtype)
    results = []
    for fn in (entmax15_train_op, entmax15_attention):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sigma, alpha)]
        bias = GaussianBias(leaves[3], leaves[4], (3, 4), 1) if with_bias else None
        out = fn(*leaves[:3], 0.6, bias)
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in leaves[: 5 if with_bias else 3])))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    dense = naive_gaug_bias(sigma, alpha, (3, 4), 1, (3, 4)) if with_bias else None
    ref, _ = plain_attention(q, k, v, "entmax15", scale=0.6, bias=dense)
    torch.testing.assert_close(results[0][0], ref, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("with_bias", [False, True])
def test_entmax_training_opcheck(with_bias):
    q, k, v, sigma, alpha = _train_case(10)
    ra = c = None
    if with_bias:
        ra, c = flat_factors(GaussianBias(sigma, alpha, (3, 4), 1), 2, 3, q.dtype, eager=False)
    torch.library.opcheck(ENTMAX_TRAIN_OP, (q, k, v, ra, c, 0.6, 3, 4, 1))


def test_softmax_without_a_bias_is_refused():
    q, k, v, _ = _case(7)
    with pytest.raises(ValueError, match="softmax needs sigma and alpha"):
        blocked_attention_op(q, k, v, 0.3, None, entmax=False)
