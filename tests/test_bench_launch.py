"""The ``launch`` bench suite (:mod:`vitattn.bench.launch`): vitattn's and Triton's launch paths run on
the CPU through a stand-in driver. It needs triton imported without the interpreter, which the test
processes may not have (other test files turn it on at import): it runs in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json
    from vitattn.bench import launch
    from vitattn.kernels import ops

    out = {"paths": {}}
    with launch.stand_in_launches():
        for path in launch.PATHS:
            recorded = launch.recorded_launches(path)
            before = launch._StandInKernel.launched
            for c in recorded:
                launch.triton_call(c)()
                launch.vitattn_call(c)()
            out["paths"][path] = {
                "names": [c.name for c in recorded],
                "launched": launch._StandInKernel.launched - before,
            }
        caches = [f.device_caches[0][0] for f in ops.kernels().values() if 0 in f.device_caches]
        out["cached_inside"] = sum(len(cache) for cache in caches)
        out["tuned_inside"] = len(ops._TUNED)
    out["cached_after"] = sum(len(f.device_caches) for f in ops.kernels().values())
    out["tuned_after"] = len(ops._TUNED)
    result = launch.launch_suite(quick=True)
    out["rows"] = sorted({(r.case.split()[1], r.impl) for r in result.rows})
    out["ms"] = {f"{r.case.split()[1]} {r.impl}": r.ms for r in result.rows}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def launched() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_each_path_records_its_launches_and_both_calls_reach_the_launcher(launched):
    paths = launched["paths"]
    assert paths["softmax"]["names"] == ["fwd_softmax", "bwd_delta", "bwd_dkdv", "bwd_dq"]
    assert paths["gaussian"]["names"] == ["fwd_softmax", "bwd_delta", "bwd_factors", "bwd_dkdv", "bwd_dq"]
    assert paths["entmax15"]["names"] == ["fwd_entmax15", "bwd_delta", "bwd_dkdv_lists", "bwd_dq_lists"]
    for path, seen in paths.items():  # Triton's path and vitattn's, once each per launch
        # entmax-1.5's dK/dV and dQ build their tile lists with a launch of their own (kernels/tile_lists.py),
        # once per path: where Triton's path resolves its arguments, and in vitattn's call
        lists = 2 * 2 if path == "entmax15" else 0
        assert seen["launched"] == 2 * len(seen["names"]) + lists, path
    assert launched["cached_inside"] > 0 and launched["tuned_inside"] > 0


def test_leaving_the_stand_in_forgets_its_kernels_and_picks(launched):
    assert launched["cached_after"] == 0 and launched["tuned_after"] == 0


def test_the_suite_times_both_paths_of_every_path_against_one_sdpa_call(launched):
    impls = {"SDPA, one call (1x1x16x16)", "triton", "vitattn + triton"}
    assert launched["rows"] == sorted([p, i] for p in ("softmax", "gaussian", "entmax15") for i in impls)
    assert all(ms > 0 for ms in launched["ms"].values())


def test_the_stand_in_refuses_the_interpreter(monkeypatch):
    from vitattn.bench import launch
    from vitattn.kernels import ops

    monkeypatch.setattr(ops, "interpret_requested", lambda: True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET unset"), launch.stand_in_launches():
        pass


def test_an_unknown_path_is_refused():
    from vitattn.bench import launch

    with pytest.raises(ValueError, match="path must be one of .*got 'gauss'"):
        launch.recorded_launches("gauss")
