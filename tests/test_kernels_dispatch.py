"""What the Triton backend does around its kernels, checked without a GPU: the device guard of every
launch, the one launch dtype (autocast, mixed q/k/v dtypes), the float32 / TF32 rule of
``backend="auto"``, and 64-bit pointer offsets.

CUDA tensors are ``FakeTensor`` objects (``torch._subclasses.fake_tensor``: a device and a dtype, no
storage), so ``TritonBackend.unsupported`` and the launch wrappers see ``cuda:1`` on a CPU-only
machine. The ``triton_interpreter`` tests run the kernels in Triton's interpreter (see
``tests/test_kernels.py`` for how the flag is set), and the offset test compiles the kernels for sm_80
in a subprocess without the interpreter (as ``python -m vitattn.kernels._build.aot`` does).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.functional import attention
from vitattn.functional.dispatch import AttentionCall
from vitattn.kernels import backend as kb
from vitattn.kernels import configs, env
from vitattn.kernels.backend import TritonBackend
from vitattn.kernels.env import DOT_IEEE, DOT_NATIVE, DOT_TF32, FLOAT32_REASON

pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402  (imports triton)

interpreted = pytest.mark.triton_interpreter
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _fake(*shape, device="cuda:1", dtype=BF16) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(*shape, device=device, dtype=dtype)


def _call(q, k=None, v=None, **kw) -> AttentionCall:
    base = dict(normalizer="softmax", scale=0.5, mask=None, bias=None, return_weights=False, dropout_p=0.0)
    base.update(kw)
    return AttentionCall(q, q if k is None else k, q if v is None else v, **base)


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    """TF32 off (the default) unless a test turns it on; torch's switch restored afterwards."""
    monkeypatch.delenv(env.TF32_ENV, raising=False)
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "none"
    yield
    matmul.fp32_precision = saved


class _DeviceRecorder:
    """Stands in for ``torch.cuda.device``: records each index entered and which one is current."""

    def __init__(self):
        self.entered: list[int] = []
        self.stack: list[int] = []

    def __call__(self, index):
        @contextlib.contextmanager
        def guard():
            self.entered.append(index)
            self.stack.append(index)
            try:
                yield
            finally:
                self.stack.pop()

        return guard()

    @property
    def current(self) -> int | None:
        return self.stack[-1] if self.stack else None


class _RecordingKernel:
    """A kernel object: ``fn[grid](*args, **meta)`` records the current (recorded) device, then runs
    the real kernel if there is one."""

    def __init__(self, name, recorder, seen, real=None):
        self.name, self.recorder, self.seen, self.real = name, recorder, seen, real

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.seen.append((self.name, self.recorder.current))
            if self.real is not None:
                self.real[grid](*args, **meta)

        return launch


# ---- 1. device guard ---------------------------------------------------------------------------------


def test_device_arch_of_cpu_tensors_is_the_default_without_asking_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert ops.device_arch([torch.zeros(1), None, 3]) == configs.DEFAULT_ARCH == 90
    assert ops.device_arch([_fake(1)]) == 80  # a CUDA tensor: its device's capability


def test_launch_device_is_the_first_cuda_tensors():
    cpu, on1, on0 = torch.empty(2), _fake(2), _fake(2, device="cuda:0")
    assert ops.launch_device([cpu, 3, 0.5, on1, on0]) == torch.device("cuda", 1)
    assert ops.launch_device([on0, on1]) == torch.device("cuda", 0)
    assert ops.launch_device([cpu, 3]) is None


def test_device_guard_enters_the_tensors_device(monkeypatch):
    rec = _DeviceRecorder()
    monkeypatch.setattr(torch.cuda, "device", rec)
    with ops.device_guard([torch.empty(1), _fake(2)]):
        assert rec.current == 1
    with ops.device_guard([torch.empty(1)]):  # CPU / interpreter: no guard, no CUDA call
        assert rec.current is None
    assert rec.entered == [1]


@pytest.mark.parametrize("interp", [True, False], ids=["interpreter-path", "autotuned-path"])
def test_launch_runs_inside_the_device_guard(monkeypatch, interp):
    rec, seen = _DeviceRecorder(), []
    fake = _RecordingKernel("fwd_softmax", rec, seen)
    monkeypatch.setattr(torch.cuda, "device", rec)
    monkeypatch.setattr(ops, "kernels", lambda: {"fwd_softmax": fake})
    monkeypatch.setattr(ops, "interpret_requested", lambda: interp)
    tuned = []
    monkeypatch.setattr(ops, "pick_tile", lambda key, tiles, bench: tuned.append(tiles) or tiles[0])
    meta = dict(HAS_ADD=False, HAS_KEEP=True, BLOCK_D=16, BLOCK_DV=64, F32_DOT=DOT_TF32)
    ops._launch("fwd_softmax", lambda bm, bn: (1, 1), [_fake(1, 2, 5, 16), 0.5, 7], meta, (2, 5, 5), False)
    assert seen == [("fwd_softmax", 1)]
    traits = configs.launch_traits(masked=True, fp32=True, ragged=True)  # N = 5: ragged
    fp32_masked = configs.autotune_list("fwd_softmax", 64, traits)
    assert tuned == ([] if interp else [fp32_masked])  # (block_d, masked, fp32): the fp32 tile list


@interpreted
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_every_launch_of_forward_and_backward_is_guarded(monkeypatch, normalizer):
    """Forward and the three backward kernels (the row-term kernel is launched on its own; entmax-1.5's
    tile-list launches too) all run with the tensors' device current: here the kernels run in the
    interpreter on CPU tensors and ``launch_device`` claims they are on ``cuda:1``."""
    rec, seen = _DeviceRecorder(), []
    real = ops.kernels()
    wrapped = {name: _RecordingKernel(name, rec, seen, fn) for name, fn in real.items()}
    monkeypatch.setattr(torch.cuda, "device", rec)
    monkeypatch.setattr(ops, "kernels", lambda: wrapped)
    monkeypatch.setattr(ops, "launch_device", lambda tensors: torch.device("cuda", 1))
    q, k, v = (torch.randn(1, 2, 19, 16, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, normalizer=normalizer, scale=0.25, backend="triton")
    out.sum().backward()
    fwd = "fwd_softmax" if normalizer == "softmax" else "fwd_entmax15"
    if normalizer == "softmax":
        backward = [("bwd_dkdv", 1), ("bwd_dq", 1)]
    else:  # entmax-1.5's backward: the list kernels, each after the launch that builds its tile lists
        backward = [("tile_lists", 1), ("bwd_dkdv_lists", 1), ("tile_lists", 1), ("bwd_dq_lists", 1)]
    assert seen == [(fwd, 1), ("bwd_delta", 1), *backward]
    ref = attention(
        q.detach(), k.detach(), v.detach(), normalizer=normalizer, scale=0.25, backend="reference"
    )
    torch.testing.assert_close(out.detach(), ref, atol=2e-5, rtol=0)


def test_one_reader_of_triton_interpret_and_kernels_resolved_once(monkeypatch):
    """``env.interpret_requested`` is the only reader of ``TRITON_INTERPRET``; the kernel modules are
    imported (or re-imported) once per setting, then served from the cache."""
    assert ops.interpret_requested is env.interpret_requested is kb.interpret_requested
    assert not hasattr(ops, "interpreting")
    first = ops.kernels()

    def no_import(*args, **kwargs):
        raise AssertionError("kernel modules imported again")

    monkeypatch.setattr(ops.importlib, "import_module", no_import)
    monkeypatch.setattr(ops.importlib, "reload", no_import)
    assert ops.kernels() is first
    assert set(first) == {
        "fwd_softmax",
        "fwd_entmax15",
        "fwd_entmax_alpha",
        "bwd_delta",
        "bwd_factors",
        "bwd_dkdv",
        "bwd_dq",
        "fwd_softmax_lists",
        "bwd_rows",
        "bwd_dkdv_lists",
        "bwd_dq_lists",
        "tile_lists",
    }


# ---- 2. one launch dtype -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtypes", "autocast", "want"),
    [
        ((BF16, BF16, BF16), None, BF16),
        ((F16, F16, F16), None, F16),
        ((F32, F32, BF16), None, F32),  # the common dtype
        ((F16, BF16, BF16), None, F32),
        ((F32, F32, BF16), BF16, BF16),  # timm qk_norm under autocast
        ((F32, F32, F32), F16, F16),
        ((BF16, BF16, BF16), F16, F16),
    ],
)
def test_launch_dtype_is_autocasts_else_the_common_one(dtypes, autocast, want):
    assert env.launch_dtype(dtypes, autocast) == (want, None)


def test_launch_dtype_declines_what_the_kernels_cannot_compute():
    reason = "dtype torch.float64 is not one of float16, bfloat16, float32"
    assert env.launch_dtype([F64, F64, F64]) == (None, reason)
    dtype, reason = env.launch_dtype([F32, F64, F32], BF16)  # autocast does not narrow float64
    assert dtype is None and "torch.float64" in reason
    dtype, reason = env.launch_dtype([F32, F32, F32], F64)
    assert dtype is None and reason.startswith("autocast dtype torch.float64")


def test_autocast_dtype_reads_the_autocast_state():
    assert kb.autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=BF16):
        assert kb.autocast_dtype("cpu") == BF16
        assert kb.autocast_dtype("cuda") is None
    assert kb.autocast_dtype("meta") is None


def test_mixed_dtypes_under_cuda_autocast_are_taken(monkeypatch):
    q, v = _fake(2, 3, 17, 32, dtype=F32), _fake(2, 3, 17, 32, dtype=BF16)
    call = _call(q, q, v, normalizer="entmax15")  # (auto leaves a small plain softmax to SDPA anyway)
    assert TritonBackend().unsupported(call) == FLOAT32_REASON  # no autocast: float32 is the common dtype
    assert TritonBackend().unsupported(call, explicit=True) is None
    monkeypatch.setattr(kb, "autocast_dtype", lambda device_type: BF16 if device_type == "cuda" else None)
    assert TritonBackend().unsupported(call) is None
    assert "float64" in TritonBackend().unsupported(_call(q, q, _fake(2, 3, 17, 32, dtype=F64)))


def _leaves(*dtypes, n=21, d=16):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 2, n, d, generator=g) * 2).to(dt).requires_grad_() for dt in dtypes]


@interpreted
def test_run_casts_to_the_autocast_dtype():
    q, k, v = _leaves(F32, F32, F32)
    with torch.autocast("cpu", dtype=BF16):
        out, _ = TritonBackend().run(_call(q, k, v))
    assert out.dtype == BF16
    ref = attention(*(t.detach().to(BF16).double() for t in (q, k, v)), scale=0.5, backend="reference")
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 2.5e-2
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert all(g.dtype == F32 and torch.isfinite(g).all() for g in grads)


@interpreted
def test_run_computes_mixed_dtypes_in_the_common_dtype():
    q, k, v = _leaves(F32, F32, BF16)
    out, _ = TritonBackend().run(_call(q, k, v))
    assert out.dtype == F32  # the call's dtype (the promoted one), as attention() promises
    ref = attention(*(t.detach().double() for t in (q, k, v)), scale=0.5, backend="reference")
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5  # float32 throughout
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert [g.dtype for g in grads] == [F32, F32, BF16]


@interpreted
@pytest.mark.parametrize("autocast", [None, BF16], ids=["no-autocast", "autocast-bf16"])
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_both_backends_follow_the_one_dtype_rule(normalizer, autocast):
    """float32 q, k with a bfloat16 v: the Triton and reference backends cast to the same dtype
    (``AttentionCall.dtype``) and agree."""
    q, k, v = _leaves(F32, F32, BF16)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        ours = attention(q, k, v, normalizer=normalizer, backend="triton")
        ref = attention(q, k, v, normalizer=normalizer, backend="reference")
    assert ours.dtype == ref.dtype == (autocast or F32)
    tol = 1e-5 if autocast is None else 2.5e-2  # bf16: tests/test_kernels.py's forward tolerance
    assert ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item() < tol


# ---- 3. float32 on CUDA: TF32 or not at all (for "auto") ---------------------------------------------


def test_float32_reason_is_a_function_of_device_dtype_and_flags():
    assert env.float32_reason("cuda", F32, explicit=False, tf32=False) == FLOAT32_REASON
    assert env.float32_reason("cuda", F32, explicit=False, tf32=True) is None
    assert env.float32_reason("cuda", F32, explicit=True, tf32=False) is None  # named: IEEE float32
    assert env.float32_reason("cuda", BF16, explicit=False, tf32=False) is None
    assert env.float32_reason("cpu", F32, explicit=True, tf32=False) is None  # the interpreter


def test_float32_cuda_inputs_need_tf32_for_auto(monkeypatch):
    backend = TritonBackend()
    call = _call(_fake(2, 3, 17, 32, dtype=F32), normalizer="entmax15")
    assert backend.unsupported(call) == FLOAT32_REASON
    assert backend.unsupported(_call(_fake(2, 3, 17, 32, dtype=F16), normalizer="entmax15")) is None
    monkeypatch.setenv(env.TF32_ENV, "1")
    assert backend.unsupported(call) is None
    monkeypatch.setenv(env.TF32_ENV, "0")
    assert backend.unsupported(call) == FLOAT32_REASON
    torch.backends.cuda.matmul.allow_tf32 = True  # restored by the fixture
    assert env.tf32_allowed() and backend.unsupported(call) is None


def test_auto_leaves_small_plain_softmax_to_sdpa_and_takes_it_from_2_to_the_29_scores():
    from vitattn.functional import GaussianBias, WindowMask, explain

    backend = TritonBackend()
    small = _call(_fake(32, 12, 197, 64))  # ViT-B/16: 2^23.8 scores
    reason = backend.unsupported(small)
    assert reason is not None and "plain softmax" in reason and "2^29" in reason
    assert backend.unsupported(small, explicit=True) is None  # backend="triton" still runs it
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(32, 12, 197, 64, device="cuda", dtype=BF16)
        assert explain(q, q, q).chosen == "sdpa"
        # the Triton path stays auto's choice for everything SDPA cannot fuse, at any size
        sigma, alpha = torch.rand(32, 12, 196, 2, device="cuda"), torch.rand(32, 12, 196, 1, device="cuda")
        assert explain(q, q, q, bias=GaussianBias(sigma, alpha, (14, 14), 1)).chosen == "triton"
        assert explain(q, q, q, normalizer="entmax15").chosen == "triton"
        assert explain(q, q, q, mask=torch.ones(197, 197, dtype=torch.bool, device="cuda")).chosen == "triton"
        assert explain(q, q, q, mask=WindowMask((14, 14), 3, 1)).chosen == "triton"
    at = 1 << 29  # B * H * N^2 = 2^29 exactly (2 x 2^28: N = 2^14, B * H = 2): taken
    assert backend.unsupported(_call(_fake(1, 2, 16384, 64))) is None
    below = _call(_fake(1, 2, 16384, 64), k=_fake(1, 2, 16383, 64), v=_fake(1, 2, 16383, 64))
    assert "plain softmax over B*H*Nq*Nk = 536838144 < 2^29" in str(backend.unsupported(below))
    assert kb.PLAIN_SOFTMAX_MIN_SCORES == at


@pytest.mark.parametrize(
    ("dtype", "device", "tf32", "interp", "want"),
    [
        (F32, "cuda", True, False, DOT_TF32),
        (F32, "cuda", False, False, DOT_IEEE),
        (F32, "cuda", True, True, DOT_IEEE),  # the interpreter runs float32 exactly
        (F32, "cpu", True, True, DOT_IEEE),
        (BF16, "cpu", False, True, DOT_IEEE),
        (BF16, "cuda", True, False, DOT_NATIVE),
        (F16, "cuda", False, False, DOT_NATIVE),
    ],
)
def test_dot_mode(dtype, device, tf32, interp, want):
    assert env.dot_mode(dtype, device, tf32, interp) == want


def test_launch_flags_carry_the_dot_mode(monkeypatch):
    monkeypatch.setattr(ops, "interpret_requested", lambda: False)
    q = _fake(1, 2, 5, 16, dtype=F32)

    def launch(tf32):
        return ops.KernelLaunch(q, q, q, None, None, None, None, 0.5, 0, 1, 0.0, False, tf32)

    assert launch(True).flags()["F32_DOT"] == DOT_TF32
    assert launch(False).flags()["F32_DOT"] == DOT_IEEE


_TF32_PTX = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from vitattn.kernels import configs, ops
    from vitattn.kernels._build import aot

    recs = aot.launches("entmax15", "gaussian", True, 32, "fp32")
    for pass_ in ("fwd", "bwd_dkdv", "bwd_dq"):
        build = aot.Build(80, "entmax15", "gaussian", pass_, configs.TileConfig(32, 32, 4, 1), 32, "fp32")
        rec = recs[build.kernel]
        for mode in (1, 2):
            consts = {**rec.meta, "F32_DOT": mode, "BLOCK_M": 32, "BLOCK_N": 32, **rec.tile_flags(32, 32)}
            src = aot.jit_source(rec.fn, rec.args_at(32, 32), consts, 80)
            ptx = triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4}).asm["ptx"]
            kind = "tf32-mma" if ".tf32.tf32" in ptx else "mma" if "mma.sync" in ptx else "no-mma"
            print(pass_, mode, kind)
    """
)


def _compile_check(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout.strip()


def test_float32_dots_are_tf32_or_ieee_as_asked():
    """``F32_DOT=2`` compiles to TF32 tensor-core MMAs (sm_80), ``F32_DOT=1`` to IEEE float32 (no MMA)."""
    want = "\n".join(f"{p} 1 no-mma\n{p} 2 tf32-mma" for p in ("fwd", "bwd_dkdv", "bwd_dq"))
    assert _compile_check(_TF32_PTX) == want


# ---- 4. 64-bit offsets -------------------------------------------------------------------------------

_NO_I32_MULTIPLY = textwrap.dedent(
    """
    import re
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from vitattn.kernels import ops
    from vitattn.kernels._build import aot

    def meta(*shape, dt=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dt)

    ops.I32_LIMIT = 1  # as if every offset passed 2^31: no launch may take 32-bit tile offsets (OFFS32)
    bad = []
    for entmax in (False, True):
        # every operand at once: a Gaussian bias on a 14 x 14 grid after one prefix token, an additive
        # mask (broadcast: its gradient by atomics) and a boolean mask
        n, d = 197, 48
        q, k, v = (meta(2, 2, n, d) for _ in range(3))
        den = meta(1, 2, 196, 2, dt=torch.float32).expand(2, 2, 196, 2)
        alpha = meta(1, 2, 196, dt=torch.float32).expand(2, 2, 196)
        launch = ops.KernelLaunch(q, k, v, meta(1, 2, n, n), meta(2, 1, n, n, dt=torch.bool), den, alpha,
                                  0.125, 1, 14, -84.5, entmax, False)
        with ops.capture() as recorded:
            out, stat, og, live = ops._forward(launch, store_og=True)
            ops._backward(launch, torch.empty_like(out), og if entmax else out, stat, live, True, True)
        for rec in recorded:
            kw = dict(rec.meta)
            if "BLOCK_N" not in kw and rec.shape[1]:
                kw.update(BLOCK_M=32, BLOCK_N=32, **rec.tile_flags(32, 32))
            src = aot.jit_source(rec.fn, rec.args_at(32, 32) if rec.shape[1] else rec.args, kw, 80)
            ttir = triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4}).asm["ttir"]
            bad += [f"{rec.name}/{entmax}: {line.strip()[:120]}" for line in ttir.splitlines()
                    if re.search(r"arith\\.muli .*: tensor<[0-9x]+xi32>", line)]
    print("\\n".join(bad) if bad else "ok")
    """
)


def test_pointer_offsets_are_multiplied_in_64_bits():
    """Where offsets may pass 2^31 (flat row indices over B * H * Nq rows, permuted layouts: here every
    launch is told so, ``ops.I32_LIMIT``), no kernel multiplies a tensor of offsets by a stride in int32
    (the TTIR for sm_80, every operand present). Where they fit, the kernels hold 32-bit tile offsets
    (``OFFS32``; ``tests/test_kernels.py`` runs both forms)."""
    assert _compile_check(_NO_I32_MULTIPLY) == "ok"
