"""The eager path of the Triton backend (:func:`vitattn.kernels.ops.attention_call`): outside
``torch.compile``, dispatch modes and tensor subclasses it runs the custom ops' bodies under a
``torch.autograd.Function`` (no custom-op dispatch: docs/kernels.md, "Host time per call"); its results
and gradients are the op's, bitwise, and everything else still goes through the op."""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402

interpreted = pytest.mark.triton_interpreter


def _inputs(normalizer: str, gaussian: bool, grad: bool) -> tuple[list[torch.Tensor], tuple]:
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 1, 2, 26, 16  # a class token and a 5 x 5 grid
    q, k, v = (torch.randn(b, h, n, d, generator=g).requires_grad_(grad) for _ in range(3))
    leaves = [q, k, v]
    den = alpha = None
    if gaussian:
        den = (torch.rand(b, h, n - 1, 2, generator=g) * 8 + 1).requires_grad_(grad)
        alpha = torch.rand(b, h, n - 1, generator=g).requires_grad_(grad)
        leaves += [den, alpha]
    entmax = normalizer == "entmax15"
    args = (q, k, v, None, None, den, alpha, None, 0.25, 1, 5, 8.0, entmax, False, entmax and grad, [])
    return leaves, args


@interpreted
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
@pytest.mark.parametrize("gaussian", [False, True], ids=["plain", "gaussian"])
def test_the_eager_path_equals_the_custom_op_bitwise(normalizer, gaussian):
    leaves, args = _inputs(normalizer, gaussian, grad=True)
    eager = ops.attention_call(*args)
    op = ops.attention_fwd(*args)
    assert eager[0].grad_fn is not None and "EagerAttention" in type(eager[0].grad_fn).__name__
    assert "attention_fwd" in type(op[0].grad_fn).__name__
    upstream = torch.randn(eager[0].shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(eager, op, strict=True):
        assert torch.equal(a, b)
    got = torch.autograd.grad(eager[0], leaves, upstream)
    want = torch.autograd.grad(op[0], leaves, upstream)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # no gradient recorded: the body alone, the same numbers
        assert torch.equal(ops.attention_call(*args)[0], eager[0])


def test_dispatch_modes_subclasses_and_compile_take_the_custom_op(monkeypatch):
    plain = torch.zeros(2)
    assert ops._plain_eager([plain, None, torch.nn.Parameter(torch.zeros(2))])
    with FakeTensorMode() as mode:
        fake = torch.zeros(2)
        assert not ops._plain_eager([fake])  # the mode is active (and a FakeTensor is a subclass)
    assert not ops._plain_eager([mode.from_tensor(plain)])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ops._plain_eager([plain])


def test_attention_call_takes_every_argument_of_the_op():
    _, args = _inputs("softmax", False, grad=False)
    with pytest.raises(TypeError, match="16 arguments, got 15"):
        ops.attention_call(*args[:-1])
