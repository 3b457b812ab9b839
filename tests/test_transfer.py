"""Attention transfer: AttentionCopy / AttentionDistill on tiny ViTs, and the recomputing loss.

Reference values come from outside vitattn.transfer: attention probabilities are read with
``vitattn.analysis.attention_maps`` (timm's own formula for timm layers, the captured weights for
vitattn layers) and the loss is restated from them; everything numeric runs in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vitattn.analysis import attention_maps
from vitattn.functional import GaussianBias, entmax15, fy_loss
from vitattn.models import LocAtViT
from vitattn.transfer import (
    AttentionCopy,
    AttentionDistill,
    ScoreInputs,
    attention_distill_loss,
    select_layers,
)

TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=3, num_heads=2, num_classes=5)


def vit(kind: str = "timm", seed: int = 0, **overrides) -> nn.Module:
    """A tiny ViT (1 class token + 4x4 patches = 17 tokens) in float64."""
    torch.manual_seed(seed)
    kw = dict(TINY, **overrides)
    if kind == "timm":
        return VisionTransformer(**kw).double()
    model = LocAtViT(**kw, prr=False).double()
    with torch.no_grad():  # GAug heads away from their init, so the bias matters
        for block in model.blocks:
            block.attn.gaug.log_alpha.bias.fill_(1.0)
    return model


def images(batch: int = 3, size: int = 8) -> torch.Tensor:
    return torch.randn(batch, 1, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def formula_loss(
    teacher: nn.Module, student: nn.Module, x: torch.Tensor, layers, weight: float
) -> torch.Tensor:
    """weight · Σ_layers mean over (b, h, i) of −Σ_j P_teacher · log P_student, from captured maps."""
    p_t = attention_maps(teacher, x, layers)
    p_s = attention_maps(student, x, layers)
    return weight * sum((-(p_t[i] * p_s[i].log()).sum(-1)).mean() for i in layers)


# ---- the loss ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "teacher_kind, student_kind", [("timm", "timm"), ("locat", "timm"), ("timm", "locat")]
)
def test_distill_loss_is_the_formula_on_captured_maps(teacher_kind: str, student_kind: str) -> None:
    teacher, student = vit(teacher_kind, seed=1), vit(student_kind, seed=2)
    x = images()
    wrapper = AttentionDistill(teacher, student, layers=[0, 2], weight=2.5).train()
    out = wrapper(x)
    expected = formula_loss(teacher, student, x, [0, 2], 2.5)
    torch.testing.assert_close(out.attn_loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.logits, student(x), rtol=1e-12, atol=1e-12)


def test_locat_student_scores_include_its_gaug_bias() -> None:
    """The documented choice: a LocAt student's scores are q kᵀ·scale + GAug bias, and GAug learns."""
    teacher, student = vit("timm", seed=1), vit("locat", seed=2)
    wrapper = AttentionDistill(teacher, student, weight=1.0).train()
    loss = wrapper(images()).attn_loss
    loss.backward()
    assert student.blocks[0].attn.gaug.log_alpha.weight.grad.abs().sum() > 0
    # without the bias the value would differ: the student's plain q kᵀ·scale rows
    with torch.no_grad():
        plain = vit("locat", seed=2)
        for block in plain.blocks:  # α = softplus(-inf) = 0: no bias
            block.attn.gaug.log_alpha.bias.fill_(-1e4)
        unbiased = AttentionDistill(teacher, plain, weight=1.0).train()(images()).attn_loss
    assert not torch.allclose(loss, unbiased)


def test_default_layers_and_weight() -> None:
    deep_t, deep_s = vit(depth=8, seed=1), vit(depth=8, seed=2)
    assert AttentionDistill(deep_t, deep_s).layers == (0, 1)
    assert AttentionDistill(deep_t, deep_s).weight == 3.0
    assert AttentionCopy(deep_t, deep_s).layers == tuple(range(8))
    assert AttentionDistill(vit(seed=1), vit(seed=2)).layers == (0, 1, 2)  # depth <= 6: all
    assert AttentionDistill(deep_t, deep_s, layers=-3).layers == (0, 1, 2, 3, 4)
    x = images()
    wrapper = AttentionDistill(deep_t, deep_s).train()
    torch.testing.assert_close(wrapper(x).attn_loss, formula_loss(deep_t, deep_s, x, [0, 1], 3.0))


def test_distill_eval_runs_only_the_student() -> None:
    teacher, student = vit(seed=1), vit(seed=2)
    wrapper = AttentionDistill(teacher, student).eval()
    calls = []
    handle = teacher.register_forward_hook(lambda *a: calls.append(1))
    out = wrapper(images())
    handle.remove()
    assert out.attn_loss is None and not calls
    torch.testing.assert_close(out.logits, student(images()))
    logits, attn_loss = wrapper.train()(images())  # a NamedTuple
    assert attn_loss is not None and attn_loss.dim() == 0


# ---- copy --------------------------------------------------------------------------------------------
def _record_io(module: nn.Module, store: dict) -> torch.utils.hooks.RemovableHandle:
    def hook(mod, args, out):
        store["x"], store["y"] = args[0].detach(), out.detach()

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("teacher_kind", ["timm", "locat"])
def test_copy_uses_the_teacher_probabilities_and_not_the_student_qk(teacher_kind: str) -> None:
    teacher, student = vit(teacher_kind, seed=1), vit("timm", seed=2, qk_norm=True)
    x = images()
    wrapper = AttentionCopy(teacher, student, layers=[0, 2]).train()
    io = {i: {} for i in range(3)}
    handles = [_record_io(student.blocks[i].attn, io[i]) for i in range(3)]
    out = wrapper(x)
    for h in handles:
        h.remove()
    assert out.attn_loss is None
    p_t = attention_maps(teacher, x)
    b, n, c = io[0]["x"].shape
    for i in (0, 2):  # copied: proj(P_teacher · v_student)
        attn = student.blocks[i].attn
        v = attn.qkv(io[i]["x"]).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4)[2]
        expected = attn.proj((p_t[i] @ v).transpose(1, 2).reshape(b, n, c))
        torch.testing.assert_close(io[i]["y"], expected, rtol=1e-12, atol=1e-12)
    own = student.blocks[1].attn(io[1]["x"])  # not copied: the student's own attention
    torch.testing.assert_close(io[1]["y"], own, rtol=1e-12, atol=1e-12)

    F.cross_entropy(out.logits, torch.tensor([0, 1, 2])).backward()
    for i in (0, 2):
        attn = student.blocks[i].attn
        assert torch.count_nonzero(attn.qkv.weight.grad[: 2 * c]) == 0  # q, k rows: no gradient
        assert torch.count_nonzero(attn.qkv.bias.grad[: 2 * c]) == 0
        assert attn.q_norm.weight.grad is None and attn.k_norm.weight.grad is None
        assert attn.qkv.weight.grad[2 * c :].abs().sum() > 0  # v trains
    assert student.blocks[1].attn.qkv.weight.grad[:c].abs().sum() > 0


def test_copy_runs_the_teacher_at_inference() -> None:
    teacher, student = vit(seed=1), vit(seed=2)
    wrapper = AttentionCopy(teacher, student)
    x = images()
    train_logits = wrapper.train()(x).logits
    eval_out = wrapper.eval()(x)
    assert eval_out.attn_loss is None
    torch.testing.assert_close(eval_out.logits, train_logits)  # no dropout: same computation
    assert not torch.allclose(eval_out.logits, student(x))


# ---- the frozen teacher ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [AttentionCopy, AttentionDistill])
def test_teacher_is_frozen_hidden_and_unchanged_by_a_training_step(cls) -> None:
    teacher, student = vit(seed=1), vit(seed=2)
    before = copy.deepcopy(teacher.state_dict())
    wrapper = cls(teacher, student).train()
    assert wrapper.teacher is teacher and wrapper.student is student
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not teacher_ids & {id(p) for p in wrapper.parameters()}
    assert {id(p) for p in wrapper.parameters()} == {id(p) for p in student.parameters()}
    assert all(k.startswith("student.") for k in wrapper.state_dict())
    assert len(wrapper.state_dict()) == len(student.state_dict())

    student_before = copy.deepcopy(student.state_dict())
    opt = torch.optim.SGD(wrapper.parameters(), lr=1.0)
    out = wrapper(images())
    loss = F.cross_entropy(out.logits, torch.tensor([0, 1, 2]))
    if out.attn_loss is not None:
        loss = loss + out.attn_loss
    loss.backward()
    opt.step()
    assert not teacher.training
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert any(not torch.equal(v, student_before[k]) for k, v in student.state_dict().items())

    wrapper.float()  # .to() / .float() move the teacher along
    assert teacher.cls_token.dtype == torch.float32 and student.cls_token.dtype == torch.float32
    assert "forward" not in student.blocks[0].attn.__dict__  # overrides removed after the forward


# ---- wrong pairs and arguments -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(depth=4), r"same depth: teacher has 3 blocks, student has 4"),
        (dict(num_heads=4), r"blocks\[0\]\.attn has 2 heads in the teacher and 4 in the student"),
        (dict(img_size=12), r"teacher has N = 17 .*student has N = 37"),
    ],
)
@pytest.mark.parametrize("cls", [AttentionCopy, AttentionDistill])
def test_wrong_pairs_fail_clearly(cls, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(vit(seed=1), vit(seed=2, **overrides))


def test_other_bad_inputs() -> None:
    model = vit()
    with pytest.raises(ValueError, match="two different models"):
        AttentionDistill(model, model)
    with pytest.raises(TypeError, match="teacher must be a timm VisionTransformer"):
        AttentionDistill(nn.Linear(2, 2), vit())
    with pytest.raises(ValueError, match="weight must be a finite number >= 0, got -1"):
        AttentionDistill(vit(seed=1), vit(seed=2), weight=-1)
    with pytest.raises(ValueError, match="chunk_elements must be a positive int, got 0"):
        AttentionDistill(vit(seed=1), vit(seed=2), chunk_elements=0)
    odd = vit(seed=2)
    odd.blocks[1].attn = nn.Identity()
    odd.blocks[1].attn.num_heads = 2
    with pytest.raises(TypeError, match=r"student\.blocks\[1\]\.attn is Identity"):
        AttentionCopy(vit(seed=1), odd, layers=[1])
    AttentionCopy(vit(seed=1), odd, layers=[0, 2])  # unsupported blocks outside `layers` are fine
    rotary = vit(seed=2)  # a rotary layer's q, k cannot be recomputed from its qkv alone
    from vitattn.layers import RopeAttention

    rotary.blocks[1].attn = RopeAttention(16, num_heads=2)
    with pytest.raises(TypeError, match=r"student\.blocks\[1\]\.attn is RopeAttention"):
        AttentionDistill(vit(seed=1), rotary, layers=[1])
    checkpointed = vit(seed=2)
    checkpointed.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        AttentionDistill(vit(seed=1), checkpointed).train()(images())


@pytest.mark.parametrize(
    "layers, expected",
    [
        (None, (0, 1)),
        (-1, (0, 1, 2)),
        (-3, (0,)),
        ([2, 0, 2], (0, 2)),
        ((i for i in [1]), (1,)),
        ([-1], (3,)),
    ],
)
def test_select_layers(layers, expected) -> None:
    assert select_layers(layers, 4, default=range(2)) == expected


@pytest.mark.parametrize(
    "layers, error, message",
    [
        (2, ValueError, r"an int must be negative.*pass \[2\] for block 2 alone"),
        (0, ValueError, "an int must be negative"),
        (-4, ValueError, "leaves no block of a model with 4 blocks"),
        ([], ValueError, "layers is empty"),
        ([4], ValueError, "layer index 4 is out of range for a model with 4 blocks"),
        ([1.0], TypeError, "block indices"),
        (True, TypeError, "iterable of block indices"),
        ("01", TypeError, "iterable of block indices"),
    ],
)
def test_select_layers_rejects(layers, error, message: str) -> None:
    with pytest.raises(error, match=message):
        select_layers(layers, 4, default=range(2))


# ---- the memory-saving loss == the naive one ----------------------------------------------------------
def _score_inputs(
    kind: str, seed: int, d: int, requires_grad: bool, b: int = 2, h: int = 3, grid: tuple[int, int] = (3, 4)
) -> ScoreInputs:
    g = torch.Generator().manual_seed(seed)
    prefix = 1
    n = prefix + grid[0] * grid[1]

    def rand(*shape, low=None):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        t = t.abs() + low if low is not None else t
        return t.requires_grad_(requires_grad)

    q, k = rand(b, h, n, d), rand(b, h, n, d)
    if kind == "gaug":
        bias = GaussianBias(
            rand(b, h, n - prefix, 2, low=0.3), rand(b, h, n - prefix, 1, low=0.0), grid, prefix
        )
    elif kind == "tensor":
        bias = rand(1, h, n, n)  # broadcast over the batch
    else:
        bias = None
    return ScoreInputs(q, k, 0.37, bias)


@pytest.mark.parametrize("student_bias", ["none", "gaug", "tensor"])
@pytest.mark.parametrize("chunk_elements", [1, 13 * 13 * 2, 1 << 22])
def test_recomputed_loss_matches_naive_value_and_gradients(student_bias: str, chunk_elements: int) -> None:
    student = _score_inputs(student_bias, 0, 5, requires_grad=True)
    teacher = _score_inputs("gaug", 1, 7, requires_grad=False)
    leaves = student.tensors()
    naive = attention_distill_loss(student, teacher, recompute=False)
    ours = attention_distill_loss(student, teacher, chunk_elements=chunk_elements)
    torch.testing.assert_close(ours, naive, rtol=1e-13, atol=1e-13)
    for a, b in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(naive, leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.slow  # ~1 min: gradcheck perturbs every one of ~900 inputs
def test_recomputed_loss_gradcheck() -> None:
    student = _score_inputs("gaug", 0, 4, requires_grad=True)
    teacher = _score_inputs("none", 1, 4, requires_grad=False)

    def loss(*tensors):
        return attention_distill_loss(student.with_tensors(tensors), teacher, chunk_elements=13 * 13)

    assert torch.autograd.gradcheck(loss, student.tensors())


def test_recomputing_wrapper_matches_the_naive_wrapper() -> None:
    teacher, student = vit("timm", seed=1), vit("locat", seed=2)
    x = images()
    results = []
    for recompute in (True, False):
        s = copy.deepcopy(student)
        out = AttentionDistill(teacher, s, weight=3.0, recompute=recompute, chunk_elements=17 * 17)(x)
        (out.attn_loss + out.logits.square().mean()).backward()
        results.append((out.attn_loss.detach(), {k: p.grad for k, p in s.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-13, atol=1e-13)
    assert grads_a.keys() == grads_b.keys()
    for key in grads_a:
        if grads_a[key] is None:
            assert grads_b[key] is None, key
        else:
            torch.testing.assert_close(grads_a[key], grads_b[key], rtol=1e-10, atol=1e-12, msg=key)


def test_loss_argument_errors_and_half_precision() -> None:
    a = _score_inputs("none", 0, 4, requires_grad=False)
    small = ScoreInputs(a.q[:, :2], a.k[:, :2], a.scale)
    with pytest.raises(ValueError, match=r"student has \(2, 2, 13, 13\).*teacher has \(2, 3, 13, 13\)"):
        attention_distill_loss(small, a)
    q = a.q.to(torch.bfloat16).requires_grad_()
    loss = attention_distill_loss(ScoreInputs(q, a.k.to(torch.bfloat16), a.scale), a)
    assert loss.dtype == torch.float64  # the teacher is float64 here; bf16 alone gives float32
    loss.backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()


# ---- loss="fy": the Fenchel–Young loss of the student's normalizer ------------------------------------
def entmax_vit(seed: int, normalizer: object = "entmax15") -> nn.Module:
    """A tiny vitattn ViT (no GAug, no PRR) whose attention normalizes with ``normalizer``, float64."""
    torch.manual_seed(seed)
    return LocAtViT(**TINY, gaug=False, prr=False, normalizer=normalizer).double()


def plain_scores(model: nn.Module, x: torch.Tensor, layers) -> dict[int, torch.Tensor]:
    """Each chosen block's scores q kᵀ · d^-0.5, from its attention's input (no bias, no q/k norm)."""
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        model.blocks[i].attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i in layers
    ]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    out = {}
    for i in layers:
        attn = model.blocks[i].attn
        b, n, c = inputs[i].shape
        q, k, _ = attn.qkv(inputs[i]).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        out[i] = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return out


@pytest.mark.parametrize("teacher_kind", ["timm", "entmax15"])
def test_fy_distill_is_the_fy_loss_of_the_students_normalizer(teacher_kind: str) -> None:
    teacher = vit("timm", seed=1) if teacher_kind == "timm" else entmax_vit(1)
    student = entmax_vit(2)
    x = images()
    wrapper = AttentionDistill(teacher, student, layers=[0, 2], weight=2.0, loss="fy").train()
    out = wrapper(x)
    p_t = attention_maps(teacher, x, [0, 2])  # the teacher's own probabilities: softmax or entmax
    s = plain_scores(student, x, [0, 2])
    expected = 2.0 * sum(fy_loss(s[i], p_t[i], "entmax15").mean() for i in (0, 2))
    torch.testing.assert_close(out.attn_loss, expected, rtol=1e-12, atol=1e-12)
    ce = AttentionDistill(teacher, student, layers=[0, 2], weight=2.0).train()(x).attn_loss
    assert not torch.allclose(out.attn_loss, ce)  # not the softmax proxy


def test_fy_distill_vanishes_when_the_student_attends_as_the_teacher() -> None:
    teacher = entmax_vit(1)
    student = copy.deepcopy(teacher)
    out = AttentionDistill(teacher, student, weight=1.0, loss="fy").train()(images())
    assert out.attn_loss.abs() < 1e-12
    out.attn_loss.backward()
    assert all(b.attn.qkv.weight.grad.abs().max() < 1e-12 for b in student.blocks)
    ce = AttentionDistill(entmax_vit(1), copy.deepcopy(teacher), weight=1.0).train()(images())
    assert ce.attn_loss > 0.1  # the cross-entropy of softmax(S) is not zero there


def test_fy_distill_of_softmax_layers_has_the_cross_entropy_gradient() -> None:
    teacher, student = vit("timm", seed=1), vit("locat", seed=2)
    x = images()
    results = {}
    for loss in ("ce", "fy"):
        s = copy.deepcopy(student)
        out = AttentionDistill(teacher, s, weight=3.0, loss=loss).train()(x)
        out.attn_loss.backward()
        results[loss] = out.attn_loss.detach(), {k: p.grad for k, p in s.named_parameters()}
    p_t = attention_maps(teacher, x)
    entropy = sum((-(p * p.log()).sum(-1)).mean() for p in p_t.values())
    torch.testing.assert_close(results["fy"][0], results["ce"][0] - 3.0 * entropy, rtol=1e-12, atol=1e-12)
    for key, grad in results["ce"][1].items():
        other = results["fy"][1][key]
        if grad is None:
            assert other is None, key
        else:
            torch.testing.assert_close(other, grad, rtol=1e-10, atol=1e-12, msg=key)


FY_NORMALIZERS = ["softmax", "entmax15", "sparsemax", 1.3]


@pytest.mark.parametrize("normalizer", FY_NORMALIZERS, ids=str)
@pytest.mark.parametrize("student_bias", ["none", "gaug"])
@pytest.mark.parametrize("chunk_elements", [1, 13 * 13 * 2, 1 << 22])
def test_recomputed_fy_loss_matches_naive_value_and_gradients(
    normalizer: object, student_bias: str, chunk_elements: int
) -> None:
    student = _score_inputs(student_bias, 0, 5, requires_grad=True)
    teacher = _score_inputs("gaug", 1, 7, requires_grad=False)
    leaves = student.tensors()
    kw = dict(loss="fy", normalizer=normalizer, target_normalizer="entmax15")
    naive = attention_distill_loss(student, teacher, recompute=False, **kw)
    ours = attention_distill_loss(student, teacher, chunk_elements=chunk_elements, **kw)
    torch.testing.assert_close(ours, naive, rtol=1e-13, atol=1e-13)
    rows = fy_loss(student.scores().detach(), entmax15(teacher.scores(), -1), normalizer)
    torch.testing.assert_close(ours, rows.mean(), rtol=1e-13, atol=1e-13)
    for a, b in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(naive, leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("normalizer", ["entmax15", 1.3])
def test_recomputed_fy_loss_gradcheck(normalizer: object) -> None:
    small = dict(b=2, h=2, grid=(2, 3))  # 7 tokens: gradcheck perturbs every input
    student = _score_inputs("gaug", 0, 3, requires_grad=True, **small)
    teacher = _score_inputs("none", 1, 4, requires_grad=False, **small)

    def loss(*tensors):
        return attention_distill_loss(
            student.with_tensors(tensors), teacher, loss="fy", normalizer=normalizer, chunk_elements=2 * 7 * 7
        )

    assert torch.autograd.gradcheck(loss, student.tensors(), fast_mode=True)  # a random projection


@pytest.mark.parametrize("loss", ["ce", "fy"])
def test_recomputed_losses_save_no_score_maps(loss: str) -> None:
    """What the loss keeps for backward: q, k and GAug's σ, α; never an N x N map (the naive one does)."""
    student = _score_inputs("gaug", 0, 5, requires_grad=True)
    teacher = _score_inputs("gaug", 1, 7, requires_grad=False)
    n = student.shape[-1]
    for recompute in (True, False):
        saved: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, saved: list[tuple[int, ...]] = saved) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attention_distill_loss(student, teacher, loss=loss, normalizer="entmax15", recompute=recompute)
        maps = [s for s in saved if len(s) >= 2 and s[-2:] == (n, n)]
        assert bool(maps) != recompute, (recompute, saved)


def test_fy_loss_name_is_checked() -> None:
    with pytest.raises(ValueError, match=r"loss must be one of \('ce', 'fy'\), got 'kl'"):
        AttentionDistill(vit(seed=1), vit(seed=2), loss="kl")
    a = _score_inputs("none", 0, 4, requires_grad=False)
    with pytest.raises(ValueError, match="loss must be one of"):
        attention_distill_loss(a, a, loss="mse")
    with pytest.raises(ValueError, match="normalizer must be one of"):
        attention_distill_loss(a, a, loss="fy", normalizer="relu")
    assert "loss='fy'" in repr(AttentionDistill(vit(seed=1), vit(seed=2), loss="fy"))


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` builds its graph."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


@pytest.mark.parametrize("student_kind", ["timm", "entmax15"])
@pytest.mark.parametrize("loss", ["ce", "fy"])
def test_distillation_keeps_only_the_teachers_q_k_beyond_the_students_own_graph(
    student_kind: str, loss: str
) -> None:
    """What a distillation step keeps for backward beyond the student's own training graph: the
    teacher's q, k of the distilled layers, nothing else (no map, no fused qkv buffer of the student)."""
    student = vit("timm", seed=2) if student_kind == "timm" else entmax_vit(2)
    x = images()
    alone = _saved_bytes(lambda: copy.deepcopy(student).train()(x))
    wrapper = AttentionDistill(vit("timm", seed=1), copy.deepcopy(student), layers=[0, 2], loss=loss).train()
    b, h, n, d = 3, 2, 17, 8
    teacher_qk = 2 * 2 * b * h * n * d * 8  # q and k of 2 layers, float64
    assert _saved_bytes(lambda: wrapper(x)) - alone == teacher_qk
