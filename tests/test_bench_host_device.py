"""The device-side host measurement (:mod:`vitattn.bench.host_device`, run by ``bench_kernels.py
--host-case`` in the GPU check), here in its dry form: the CPU with the kernels stubbed out."""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")
from vitattn.bench import host_device  # noqa: E402
from vitattn.kernels import ops  # noqa: E402

interpreted = pytest.mark.triton_interpreter


@interpreted
def test_host_times_cover_every_row_and_mode_and_restore_the_kernels():
    before = dict(ops.kernels())
    rows = host_device.host_times("vit_b", dry=True, calls=2)
    assert [(r["impl"], r["mode"]) for r in rows] == [
        (impl, mode) for impl in host_device.ROWS for mode in host_device.MODES
    ]
    for r in rows:
        assert r["calls"] == 2 and r["shape"] == [1, 2, 17, 16]
        assert 0 < r["host_us"] <= r["call_us"], r
    assert ops.kernels() == before


@interpreted
def test_host_profile_sees_the_backward_and_counts_per_call():
    prof = host_device.host_profile("vit_b", dry=True, calls=3, top=400)
    found = {f["function"].rsplit("(", 1)[1].rstrip(")"): f for f in prof["functions"]}
    # one Gaussian fwd+bwd: its backward's Python, and three tuned launches (forward, dK/dV, dQ)
    assert found["_bwd_body"]["ncalls"] == 1.0
    assert found["_launch"]["ncalls"] == 3.0
    assert prof["profiled_us_per_call"] > 0 and len(prof["functions"]) <= 400
    lines = host_device.host_lines([], prof)
    assert lines[0].startswith("host profile vit_b gaussian vitattn fwd+bwd")


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        host_device.host_times("vit_b", dry=True, calls=0)
    with pytest.raises(ValueError, match="calls and top must be >= 1"):
        host_device.host_profile("vit_b", dry=True, top=0)
    with pytest.raises(ValueError, match=r"case_name must be one of .*'vit_b'.*got 'vit-b'"):
        host_device.host_times("vit-b", dry=True)
