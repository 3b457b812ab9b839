"""Ahead-of-time compilation of the kernels for sm_80 and sm_90, no GPU needed.

Runs ``python -m vitattn.kernels._build.aot --quick`` on a few variants (the heaviest kernels: entmax-1.5
with the Gaussian bias, every pass; softmax with an additive mask, forward; the first autotune config of
each, both archs) in a subprocess without TRITON_INTERPRET; CI runs the whole command (every variant and
config, with the static report: ``tests/test_kernels_static.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _aot(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "vitattn.kernels._build.aot", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_variants_compile_for_sm80_and_sm90():
    variants = ("entmax15/gaussian/*", "softmax/additive/fwd")
    res = _aot("--arch", "80", "90", "--quick", "--jobs", "2", "--variants", *variants)
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-4000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "compiled 4 kernel variants for sm_80, sm_90"
    rows = [line for line in lines if line.startswith("sm_") and line.rstrip().endswith(" ok")]
    assert len(rows) == 2 * (4 + 4)  # + the backward's row kernels and its list kernel, per arch
    for line in rows:
        arch = line.split()[0]
        if any(f"-/-/{name} " in line for name in ("delta", "factors", "rows", "lists")):
            continue
        assert ("HMMA" in line) if arch == "sm_80" else ("HGMMA" in line or "HMMA" in line), line
        smem = float(line.split()[6])  # arch, variant, config (3 words), D, smem
        assert smem <= (163 if arch == "sm_80" else 227), line
    assert re.search(r"sm_90: max shared [\d.]+ KiB", res.stdout)


@pytest.mark.slow
def test_refuses_to_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "vitattn.kernels._build.aot", "--arch", "90", "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "unset TRITON_INTERPRET" in res.stderr


@pytest.mark.slow
def test_runtime_never_imports_the_build_tools():
    code = (
        "import sys, torch, vitattn, vitattn.kernels.ops, vitattn.kernels.backend\n"
        "from vitattn.functional import attention\n"
        "attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)))\n"
        "print(sorted(m for m in sys.modules if m.startswith('vitattn.kernels._build')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]


@pytest.mark.slow
def test_names_the_triton_it_imported_and_refuses_another_version():
    import triton

    res = _aot("--arch", "90", "--quick", "--expect-triton", "0.0.0")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.splitlines()[0].startswith(f"triton {triton.__version__} (")
    assert f"expected triton 0.0.0, imported {triton.__version__}" in res.stderr
