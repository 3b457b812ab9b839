"""The dispatch table of docs/functional.md ("Which backend runs a call") is what the dispatcher does: each
row's call is built (on fake CUDA tensors for the CUDA rows) and ``explain()`` must pick the row's backend
and name the row's path, for every value of the columns marked "any"."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.functional import GaussianBias, WindowMask, explain, make_call

DOC = Path(__file__).resolve().parents[1] / "docs" / "functional.md"
HEADING = "#### Which backend runs a call"
COLUMNS = ["device", "dtype", "normalizer", "bias", "mask", "grad", "compile", "other", "backend", "path"]
DTYPES = {str(t)[6:]: t for t in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _rows() -> list[dict[str, str]]:
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} lost its section {HEADING!r}"
    lines = text.split(HEADING, 1)[1].splitlines()
    table = [line for line in itertools.dropwhile(lambda s: not s.startswith("|"), lines)]
    table = list(itertools.takewhile(lambda s: s.startswith("|"), table))
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == COLUMNS, header
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    return [dict(zip(COLUMNS, row, strict=True)) for row in cells]


ROWS = _rows()


def _values(cell: str) -> list[bool]:
    return {"yes": [True], "no": [False], "any": [False, True]}[cell]


def _call(row: dict[str, str], grad: bool, compiling: bool):
    """The AttentionCall of a row (inside whatever context the caller set up)."""
    device, dtype = row["device"], DTYPES[row["dtype"]]
    other = row["other"]
    b = 0 if other == "empty batch" else 2
    d = 256 if other == "head dim 256" else 16
    grid, prefix = (3, 3), 1
    n = 16384 if other == "2^29 scores" else prefix + grid[0] * grid[1]  # 2 * 3 * 16384^2 = 1.5 * 2^30
    q, k, v = (torch.randn(b, 3, n, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
    bias: torch.Tensor | GaussianBias | None = None
    if row["bias"] == "dense":
        bias = torch.randn(n, n, device=device, dtype=dtype, requires_grad=grad)
    elif row["bias"] == "gaussian":
        sigma = torch.rand(b, 3, 9, 2, device=device, requires_grad=grad)
        alpha = torch.rand(b, 3, 9, 1, device=device, requires_grad=grad)
        bias = GaussianBias(sigma, alpha, grid, prefix)
    mask: torch.Tensor | WindowMask | None = None
    if row["mask"] == "bool":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)
    elif row["mask"] == "float":
        mask = torch.zeros(n, n, device=device, dtype=dtype)
    elif row["mask"] == "window":
        mask = WindowMask(grid, 2, prefix)
    normalizer: object = row["normalizer"]
    if normalizer == "alpha tensor":  # one learnable alpha per head
        normalizer = torch.full((3,), 1.3, device=device, requires_grad=grad)
    elif normalizer[0].isdigit():  # type: ignore[index]
        normalizer = float(normalizer)  # type: ignore[arg-type]
    call = make_call(
        q, k, v,
        normalizer=normalizer,  # type: ignore[arg-type]
        mask=mask, bias=bias, return_weights=other == "weights", dropout_p=0.1 if other == "dropout" else 0.0,
    )  # fmt: skip
    assert call.needs_grad == grad
    return dataclasses.replace(call, compiling=compiling)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "|".join(v for v in r.values() if v)[:90])
def test_each_row_of_the_docs_table(row: dict[str, str]) -> None:
    nothing = contextlib.nullcontext()
    fake = FakeTensorMode(allow_non_fake_inputs=True) if row["device"] == "cuda" else nothing
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if row["other"] == "bf16 autocast" else nothing
    for grad, compiling in itertools.product(_values(row["grad"]), _values(row["compile"])):
        with fake, autocast:
            report = explain(_call(row, grad, compiling))
            assert report.chosen == row["backend"], (grad, compiling, str(report))
            assert report.path == row["path"], (grad, compiling, str(report))


def test_the_table_covers_every_backend_and_device() -> None:
    assert {r["backend"] for r in ROWS} == {"triton", "cpu_blocked", "sdpa", "reference"}
    assert {r["device"] for r in ROWS} == {"cpu", "cuda"}
    cpu_paths = {r["path"] for r in ROWS if r["backend"] == "cpu_blocked"}
    assert len(cpu_paths) >= 8  # both normalizers, inference and training, eager and custom ops
