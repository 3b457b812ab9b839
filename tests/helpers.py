"""Shared test helpers (not tests): the official LocAt / PRR re-statements and ``stress_gaug`` used by
several test files, and the Triton-interpreter child run behind ``@pytest.mark.triton_interpreter``.

Test files import helpers from here (and formulas from :mod:`reference_formulas`), never from another
test file.

Triton reads ``TRITON_INTERPRET`` when a kernel (and each of ``triton.language``'s own helpers) is
*defined*, that is when triton is first imported. A test marked ``@pytest.mark.triton_interpreter``
therefore runs in this process only when this process imported triton with the variable set
(``pytest tests/test_kernels.py`` alone). Otherwise (the whole suite, where earlier modules imported
timm and through it triton) ``conftest.py`` hands the call to :class:`InterpreterRuns`: the first
marked test of a file starts one child pytest with ``TRITON_INTERPRET=1`` on every marked test of that
file selected in this session, and each test then reports its own case's outcome from the child's
JUnit XML; a failing case fails under its own name, with the child's traceback.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import entmax
import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from .reference_formulas import naive_gaug_bias


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Wrap ``owner.name`` so each call appends 1 to the returned list (and still runs the original)."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


# ---- official LocAt / PRR semantics, re-stated (the GAug bias is reference_formulas.naive_gaug_bias) --


def official_locat_attention(
    attn: nn.Module,
    x: torch.Tensor,
    grid: tuple[int, int],
    prefix: int,
    init_grid: tuple[int, int],
    normalizer: str = "softmax",
) -> torch.Tensor:
    """What an official LocAt attention layer computes for ``x: (B, N, C)`` (eval, no mask); a gated
    layer's α (the identity start) is times its per-head ``gate``."""
    b, n, _ = x.shape
    h, d = attn.num_heads, attn.head_dim
    q, k, v = attn.qkv(x).reshape(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(q), attn.k_norm(k)
    c = max(init_grid) ** 2
    shift = math.log(c - 1) if c > 2 else 0.0
    q_sp = q[:, :, prefix:]
    var = c * torch.sigmoid(q_sp @ attn.gaug.log_var.weight.T + attn.gaug.log_var.bias - shift)
    alpha = F.softplus(q_sp @ attn.gaug.log_alpha.weight.T + attn.gaug.log_alpha.bias)
    if getattr(attn.gaug, "gate", None) is not None:
        alpha = alpha * attn.gaug.gate.view(-1, 1, 1)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5 + naive_gaug_bias(
        var, alpha, grid, prefix, init_grid
    ).float()
    probs = scores.softmax(-1) if normalizer == "softmax" else entmax.entmax15(scores, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, n, h * d)
    return attn.proj(attn.norm(out))


def official_prr(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    b, n, c = x.shape
    xh = x.reshape(b, n, num_heads, c // num_heads).transpose(1, 2)
    probs = ((xh @ xh.transpose(-1, -2)) * (c // num_heads) ** -0.5).softmax(-1)
    return (probs @ xh).transpose(1, 2).reshape(b, n, c)


def stress_gaug(model: nn.Module, seed: int = 0) -> None:
    """GAug params with σ from tiny to huge and α around 1-3 (a gate, where there is one, in [-1.5, 1.5]:
    negative amplitudes too), attention weights scaled up."""
    # imported here: conftest.py imports this module, and vitattn.layers imports timm, and through it
    # triton, which must not happen before tests/test_kernels.py sets TRITON_INTERPRET
    from vitattn.layers import Attention, GaussianAugment

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GaussianAugment):
                m.log_var.weight.copy_(torch.randn(m.log_var.weight.shape, generator=g) * 2.0)
                m.log_var.bias.copy_(torch.rand(2, generator=g) * 12 - 6)
                m.log_alpha.weight.copy_(torch.randn(m.log_alpha.weight.shape, generator=g) * 0.2)
                m.log_alpha.bias.copy_(torch.rand(1, generator=g) * 2 + 0.5)
                if m.gate is not None:
                    m.gate.copy_(torch.rand(m.gate.shape, generator=g) * 3 - 1.5)
            elif isinstance(m, Attention):
                m.qkv.weight.mul_(3.0)


# ---- the Triton interpreter child run --------------------------------------------------------------------

INTERPRETER_MARK = "triton_interpreter"
CHILD_ENV = "VITATTN_TEST_INTERPRETER_CHILD"  # set in the child: it must never start a child itself
CHILD_TIMEOUT_S = 1800


def triton_interpreted() -> bool:
    """Whether this process imported triton with ``TRITON_INTERPRET=1`` (its helpers are interpreted)."""
    lang = sys.modules.get("triton.language")
    if lang is None:
        return False
    return type(lang.zeros).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class ChildOutcome:
    outcome: str  # passed | failed | skipped
    text: str = ""


class InterpreterRuns:
    """One child pytest per test file for the ``triton_interpreter`` tests, run on first need."""

    def __init__(self, rootpath: Path) -> None:
        self.rootpath = rootpath
        self._results: dict[Path, dict[str, ChildOutcome]] = {}

    def outcome(self, item: pytest.Item) -> ChildOutcome:
        path = Path(item.path)
        if path not in self._results:
            selected = [
                i.nodeid
                for i in item.session.items
                if Path(i.path) == path and i.get_closest_marker(INTERPRETER_MARK) is not None
            ]
            self._results[path] = self._run(selected)
        found = self._results[path].get(item.name)
        if found is None:
            return ChildOutcome("failed", self._results[path].get("", ChildOutcome("failed")).text)
        return found

    def _run(self, nodeids: list[str]) -> dict[str, ChildOutcome]:
        env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_ENV: "1"}
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "interpreter.xml"
            cmd = [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                f"--junitxml={report}", "-o", "junit_logging=no", *nodeids,
            ]  # fmt: skip
            try:
                res = subprocess.run(
                    cmd, cwd=self.rootpath, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
                )
            except subprocess.TimeoutExpired as err:
                return {"": ChildOutcome("failed", f"the interpreter child ran past {err.timeout} s")}
            tail = f"child pytest exit code {res.returncode}:\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
            if not report.exists():
                return {"": ChildOutcome("failed", f"the interpreter child wrote no report; {tail}")}
            results = parse_junit(report)
        results[""] = ChildOutcome("failed", f"this case did not run in the interpreter child; {tail}")
        return results


def parse_junit(path: Path) -> dict[str, ChildOutcome]:
    """``{test name: outcome}`` from a JUnit XML report (names as ``item.name``: function[params])."""
    results: dict[str, ChildOutcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        bad = [e for e in case if e.tag in ("failure", "error")]
        skipped = case.find("skipped")
        if bad:
            text = "\n".join(f"{e.get('message', '')}\n{e.text or ''}" for e in bad)
            results[name] = ChildOutcome("failed", text)
        elif skipped is not None:
            results[name] = ChildOutcome("skipped", skipped.get("message", ""))
        else:
            results[name] = ChildOutcome("passed")
    return results


def run_in_interpreter_child(runs: InterpreterRuns, item: pytest.Function) -> None:
    """Report ``item``'s outcome in the interpreter child as this test's own (called by conftest.py)."""
    if os.environ.get(CHILD_ENV):
        pytest.fail("interpreter child: triton was imported before TRITON_INTERPRET=1 took effect")
    result = runs.outcome(item)
    if result.outcome == "skipped":
        pytest.skip(f"skipped under TRITON_INTERPRET=1: {result.text}")
    if result.outcome == "failed":
        pytest.fail(
            f"{item.nodeid} failed under TRITON_INTERPRET=1 (run in a child pytest):\n{result.text}",
            pytrace=False,
        )


# ---- hypothesis strategies shared by several test files -------------------------------------------------


@st.composite
def bias_cases(draw):
    """``(sigma, alpha, grid, prefix, initial_grid)`` of a drawn Gaussian bias in float64: grids up to 7x7,
    0 / 1 / 5 prefix tokens, B <= 2, H <= 3, an optional resolution change, σ over many magnitudes."""
    gh, gw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    prefix = draw(st.sampled_from([0, 1, 5]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    resize = draw(st.sampled_from([None, (1, 1), (2, 3), (4, 4)]))
    initial = (gh, gw) if resize is None else (max(1, gh - resize[0]), max(1, gw - resize[1]))
    log_sigma = draw(st.floats(-6, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sigma = torch.exp(torch.randn(b, h, gh * gw, 2, generator=g, dtype=torch.float64) * 2 + log_sigma)
    alpha = torch.rand(b, h, gh * gw, 1, generator=g, dtype=torch.float64) * 3
    return sigma, alpha, (gh, gw), prefix, initial
