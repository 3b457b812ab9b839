"""Mixed precision in `vitattn study`: under CUDA bf16 autocast the study's LocAt and entmax-1.5
models send every attention call to the Triton kernels, forward and backward; the amp option's
defaults; bf16 / fp16 training on the CPU (the grad scaler's state survives a resume).

The CUDA proof runs without a GPU: the models live on fake CUDA tensors (``FakeTensorMode``: a
device and a dtype, no storage) and CUDA autocast is switched on the way ``torch.autocast("cuda")``
does it (the context manager itself refuses without a GPU). Every call's dispatch decision is
recorded by wrapping ``select_backend``; the autograd graph of the output shows which backward
each attention call gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.cli import main
from vitattn.functional import explain
from vitattn.functional.dispatch import backend_reasons
from vitattn.study import make_config
from vitattn.study.amp import autocast, grad_scaler, resolve_amp
from vitattn.study.model import build_model

pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402,F401  (registers the Triton custom ops)

_attention_module = importlib.import_module("vitattn.functional.attention")
KERNEL_BACKWARD = "GeneratedBackwardFor_vitattn_attention_fwd_defaultBackward"
DENSE_BACKWARDS = ("SoftmaxBackward0", "_SoftmaxBackward0", "Entmax15Function", "BmmBackward0")


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """CUDA autocast on, as ``torch.autocast("cuda", dtype)`` sets it (which needs a real GPU)."""
    enabled, old = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", old)


def _grad_nodes(out: torch.Tensor) -> list[str]:
    """Names of every node of ``out``'s autograd graph (one per op that recorded a backward)."""
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.name())
        stack += [f for f, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("attention", ["entmax15", "locat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_study_model_under_cuda_bf16_autocast_runs_every_attention_on_triton(
    monkeypatch, attention, compiled
):
    config = make_config("quick", depth=3)
    decisions = []
    select = _attention_module.select_backend

    def recording(call, backend):
        chosen = select(call, backend)
        decisions.append((chosen.name, call, chosen.path(call)))
        return chosen

    monkeypatch.setattr(_attention_module, "select_backend", recording)
    with torch.device("meta"):
        model = build_model(config, attention)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda").train()  # float32 weights that require grad, as in training
        x = torch.empty(8, 3, 32, 32, device="cuda")
        with cuda_autocast(torch.bfloat16):
            if compiled:
                torch._dynamo.reset()
                graphs = []

                def keep(gm, example_inputs):
                    graphs.append(gm)
                    return gm.forward

                out = torch.compile(model, backend=keep, fullgraph=True)(x)
            else:
                out = model(x)
    assert out.shape == (8, 10) and out.device.type == "cuda"
    recorded = list(decisions)  # (explain() below dispatches too)
    assert len(recorded) == 3, "one dispatch decision per block"
    for name, call, path in recorded:
        assert name == "triton", (name, path)
        assert call.needs_grad and call.compiling == compiled
        assert call.dtype == torch.bfloat16 and call.q.dtype == torch.bfloat16  # autocast's linears
        assert "forward + backward" in path
        assert explain(call).chosen == "triton"
        assert explain(dataclasses.replace(call, compiling=not compiled)).chosen == "triton"
    if attention == "locat":
        assert all("Gaussian bias" in path for _, _, path in recorded)
    if compiled:
        ops_in_graph = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
        assert ops_in_graph.count(torch.ops.vitattn.attention_fwd.default) == 3
    else:  # the backward of every attention call is the kernels' (attention_fwd's autograd formula)
        nodes = _grad_nodes(out)
        assert nodes.count(KERNEL_BACKWARD) == 3
        assert not any(n in DENSE_BACKWARDS for n in nodes), sorted(set(nodes))


class _Decided(Exception):
    pass


@pytest.mark.parametrize("attention", ["entmax15", "locat"])
def test_float32_on_cuda_is_what_the_kernels_decline(monkeypatch, attention):
    """Without autocast the same models' attention leaves the kernels (the reason: float32 needs
    TF32): why the trainer defaults to bf16 on CUDA. (The dense path does not run on fake tensors,
    so the first decision stops the forward.)"""
    decided = []
    select = _attention_module.select_backend

    def first(call, backend):
        decided.append((select(call, backend).name, backend_reasons(call)["triton"]))
        raise _Decided

    monkeypatch.setattr(_attention_module, "select_backend", first)
    with torch.device("meta"):
        model = build_model(make_config("quick"), attention)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(_Decided):
        model.to_empty(device="cuda").train()
        model(torch.empty(2, 3, 32, 32, device="cuda"))
    ((name, reason),) = decided
    assert name != "triton" and "float32" in reason and "TF32" in reason


def test_amp_defaults_and_choices():
    assert resolve_amp(None, torch.device("cuda")) == "bf16"
    assert resolve_amp(None, torch.device("cpu")) == "none"
    assert resolve_amp("fp16", torch.device("cpu")) == "fp16"
    with pytest.raises(ValueError, match="amp must be one of bf16, fp16, none"):
        resolve_amp("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="amp must be one of"):
        make_config(amp="half")
    assert grad_scaler(torch.device("cpu"), "fp16") is not None
    assert (
        grad_scaler(torch.device("cpu"), "bf16") is None and grad_scaler(torch.device("cpu"), "none") is None
    )
    with autocast(torch.device("cpu"), "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "none"):
        assert not torch.is_autocast_enabled("cpu")


TINY = [
    "--depth", "1", "--dim", "32", "--heads", "2", "--epochs", "2", "--batch-size", "16",
    "--limit-train", "32", "--limit-test", "16", "--analysis-images", "8", "--no-progress", "--no-probe",
    "--attention", "locat",
]  # fmt: skip


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_cpu_autocast_trains_and_resumes(tmp_path: Path, amp: str, capsys):
    out = tmp_path / amp
    assert main(["study", *TINY, "--amp", amp, "--out", str(out), "--stop-after-epochs", "1"]) == 0
    state = json.loads((out / "checkpoints/baseline-locat-s0/state.json").read_text())
    if amp == "fp16":
        assert state["scaler"]["scale"] > 0 and "_growth_tracker" in state["scaler"]
    else:
        assert state["scaler"] is None
    assert main(["study", *TINY, "--amp", amp, "--out", str(out)]) == 0
    assert "resumed from epoch 1" in capsys.readouterr().out
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["amp"] == amp and len(run["history"]) == 2
    assert all(torch.isfinite(torch.tensor(h["train_loss"])) for h in run["history"])


@pytest.mark.slow
def test_compile_trains_without_a_graph_break(tmp_path: Path):
    """`--compile`: the LocAt and entmax-1.5 training models compile (inductor; their CPU attention
    paths are custom ops) without a graph break, and train."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    args = [a for a in TINY if a not in ("--attention", "locat")]
    out = tmp_path / "compiled"
    code = main(
        ["study", *args, "--epochs", "1", "--attention", "locat", "entmax15", "--compile", "--out", str(out)]
    )
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["attention"] for r in runs] == ["locat", "entmax15"]
    assert all(torch.isfinite(torch.tensor(r["history"][0]["train_loss"])) for r in runs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 2
