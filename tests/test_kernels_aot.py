"""Ahead-of-time compilation of the kernels for sm_80 and sm_90, no GPU needed.

Runs ``python -m vitattn.kernels.aot --quick`` (every variant, the first autotune config of each
kernel, both archs) in a subprocess without TRITON_INTERPRET; CI runs the whole command (every config).
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
        [sys.executable, "-m", "vitattn.kernels.aot", *args],
        env=env, capture_output=True, text=True, timeout=600,
    )


def test_every_variant_compiles_for_sm80_and_sm90():
    res = _aot("--arch", "80", "90", "--quick", "--jobs", "1")
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-4000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "compiled 24 kernel variants for sm_80, sm_90"
    rows = [line for line in lines if line.startswith("sm_") and line.rstrip().endswith(" ok")]
    assert len(rows) == 2 * (24 + 1)  # + the backward's row-term kernel per arch
    for line in rows:
        arch = line.split()[0]
        if "/delta" in line:
            continue
        assert ("mma.sync" in line) if arch == "sm_80" else ("wgmma" in line or "mma.sync" in line), line
        smem = float(line.split()[5])
        assert smem <= (163 if arch == "sm_80" else 227), line
    assert re.search(r"sm_90: max shared [\d.]+ KiB", res.stdout)


def test_refuses_to_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "vitattn.kernels.aot", "--arch", "90", "--quick"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 2 and "unset TRITON_INTERPRET" in res.stderr
