"""``benchmarks/gpu_check.sh``: its dry run on the CPU (every step, tiny shapes, TRITON_INTERPRET=1), the
budget check, the step records of ``benchmarks/gpu_report.py`` and the pass / fail rules of the goals.

The dry run is a subprocess with ``OMP_NUM_THREADS=1`` (it starts several Python processes in turn).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
FILES = {
    "env.json",
    "tests.json",
    "memcheck.json",
    "bench_n4096.json",
    "bench_n16384.json",
    "bench_sparse.json",
    "bench_vit_b.json",
    "summary.json",
}
OUT_FILE_LIMIT = 8  # what one device call brings back


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "benchmarks" / "gpu_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(out: Path, budget: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VITATTN_TRITON_TILES")}
    env.update(OUT=str(out), OMP_NUM_THREADS="1", PYTHON=sys.executable)
    if budget is not None:
        env["GPU_CHECK_BUDGET_S"] = str(budget)
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu_check")
    return out, _dry_run(out)


def test_dry_run_writes_one_json_per_step_within_the_file_limit(dry_run):
    out, res = dry_run
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    assert names == FILES and len(names) <= OUT_FILE_LIMIT
    for name in FILES - {"summary.json"}:
        step = json.loads((out / name).read_text())["step"]
        assert step["name"] == name.removesuffix(".json")
        assert step["status"] == ("skipped" if name == "tests.json" else "ok"), (name, step)
    assert "needs CUDA" in json.loads((out / "tests.json").read_text())["step"]["reason"]
    assert "compute-sanitizer: skipped (dry run" in res.stdout  # the printed reasons


def test_dry_run_bench_json_has_every_family_and_the_reasons_for_what_it_skipped(dry_run):
    out, _ = dry_run
    for case in ("n4096", "n16384", "sparse", "vit_b"):
        data = json.loads((out / f"bench_{case}.json").read_text())
        assert data["dry_run"] is True and data["suite"] == "kernels"
        (c,) = data["cases"]
        assert c["case"] == case and c["complete"] and c["modes_done"] == ["fwd+bwd", "fwd"]
        assert c["reference"] == "softmax sdpa"
        impls = {(r["case"].rsplit(" ", 1)[1], r["impl"]) for r in c["rows"]}
        for row in c["rows"]:
            assert row["ms"] > 0 and math.isfinite(row["ratio"]) and "tflops" in row["extra"]
            assert row["extra"].get("rel_err", 0.0) < 1e-4, row  # every peer computes the same attention
        wanted = {"entmax15 vitattn", "softmax sdpa"}
        if case == "sparse":
            wanted |= {"entmax15 vitattn random"}
            assert 0 < c["sparsity"]["live_tile_fraction"] < c["sparsity"]["random_live_tile_fraction"] == 1.0
        else:
            wanted |= {
                "softmax vitattn",
                "gaussian vitattn",
                "entmax15+gaussian vitattn",
                "gaussian dense_sdpa",
                "entmax15 entmax_pkg",
            }
            assert ("fwd", "gaussian flex") in impls  # eager FlexAttention forward on the CPU
        for mode in ("fwd", "fwd+bwd"):
            assert {(mode, w) for w in wanted} <= impls, (case, mode, impls)
        skipped = {(s["mode"], s["impl"]): s["reason"] for s in c["skipped"]}
        assert skipped[("fwd", "entmax15 adasplash")].startswith("needs CUDA")
        if case != "sparse":
            assert skipped[("fwd+bwd", "softmax sdpa_cudnn")].startswith("needs CUDA")
            assert skipped[("fwd+bwd", "gaussian flex")].startswith("needs CUDA")


def test_dry_run_memcheck_and_summary(dry_run):
    out, _ = dry_run
    mem = json.loads((out / "memcheck.json").read_text())
    assert mem["cases"] and all(c["ok"] for c in mem["cases"])
    assert mem["sanitizer"] == {"path": None, "errors": None, "unsupported": False}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and set(summary["files"]) == FILES
    goals = {g["goal"]: g["status"] for g in summary["goals"]}
    assert set(goals) == {
        "gaussian_vs_flash",
        "gaussian_ahead",
        "entmax_vs_adasplash_n4096",
        "entmax_vs_flash_n4096",
        "entmax_vs_adasplash_n16384",
        "entmax_vs_flash_n16384",
        "memory_linear",
        "sanitizer_clean",
    }
    # no AdaSplash, no peak memory and no sanitizer on the CPU: unknown, never a pass
    for name in ("entmax_vs_adasplash_n4096", "memory_linear", "sanitizer_clean", "gaussian_ahead"):
        assert goals[name] == "unknown", name
    assert {s: v["status"] for s, v in summary["steps"].items()}["bench_n4096"] == "ok"


def test_budget_check_skips_steps_and_still_writes_their_json(tmp_path):
    res = _dry_run(tmp_path, budget=12)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES
    for name in ("env", "memcheck", "bench_n4096", "bench_vit_b"):
        step = json.loads((tmp_path / f"{name}.json").read_text())["step"]
        assert step["status"] == "skipped" and step["reason"].startswith("budget"), (name, step)


def test_finish_records_a_killed_step_with_its_log_tail(tmp_path):
    report = _report()
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    report.main(
        [
            "finish",
            "bench_x",
            "--json",
            str(tmp_path / "x.json"),
            "--kind",
            "bench",
            "--rc",
            "124",
            "--seconds",
            "70",
            "--limit",
            "70",
            "--log",
            str(log),
        ]
    )
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["cases"] == [] and data["step"]["status"] == "timeout" and data["step"]["rc"] == 124
    assert data["step"]["log_tail"] == [f"line {i}" for i in range(100 - report.LOG_TAIL, 100)]


def test_pytest_and_sanitizer_logs_are_parsed(tmp_path):
    report = _report()
    log = tmp_path / "p.log"
    log.write_text(
        "tests/test_kernels_gpu.py::test_a[softmax-none] PASSED    [ 10%]\n"
        "tests/test_kernels_gpu.py::test_b FAILED    [ 20%]\n"
        "tests/test_kernels_gpu.py::test_c SKIPPED (needs a CUDA GPU)    [ 30%]\n"
        "FAILED tests/test_kernels_gpu.py::test_b - AssertionError\n"
    )
    parsed = report.parse_pytest(str(log))
    assert parsed["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert parsed["failed"] == ["tests/test_kernels_gpu.py::test_b"]
    log.write_text("========= COMPUTE-SANITIZER\nok softmax\n========= ERROR SUMMARY: 3 errors\n")
    assert report.parse_sanitizer(str(log)) == {"errors": 3, "unsupported": False}
    log.write_text("========= Error: Device not supported\n")
    assert report.parse_sanitizer(str(log)) == {"errors": None, "unsupported": True}


def _bench(out: Path, case: str, rows: dict[str, tuple[float, float | None]]) -> None:
    """A bench JSON with fwd+bwd rows ``impl -> (ms, peak MiB)``."""
    data = {
        "cases": [
            {
                "case": case,
                "reference": "softmax sdpa_flash",
                "rows": [
                    {
                        "case": f"{case} B1 fwd+bwd",
                        "impl": impl,
                        "ms": ms,
                        "extra": {} if peak is None else {"peak_mib": peak},
                    }
                    for impl, (ms, peak) in rows.items()
                ],
            }
        ]
    }
    (out / f"bench_{case}.json").write_text(json.dumps(data))


@pytest.mark.parametrize("ours_ms, passes", [(1.0 / 0.85 - 1e-3, True), (1.0 / 0.85 + 1e-3, False)])
def test_goal_thresholds(tmp_path, ours_ms, passes):
    report = _report()
    _bench(
        tmp_path,
        "n4096",
        {
            "softmax sdpa_flash": (1.0, 10.0),
            "gaussian vitattn": (ours_ms, 20.0),
            "gaussian flex": (2.0, None),
            "gaussian dense_sdpa": (1.1, None),
            "entmax15 vitattn": (1.5, 30.0),
            "entmax15 adasplash": (1.6, 30.0),
        },
    )
    _bench(
        tmp_path,
        "n16384",
        {
            "softmax sdpa_flash": (4.0, 10.0),
            "gaussian vitattn": (5.0, 29.0),
            "entmax15 vitattn": (6.1, 45.1),
            "entmax15 adasplash": (6.0, 30.0),
        },
    )
    (tmp_path / "memcheck.json").write_text(json.dumps({"sanitizer": {"errors": 0, "unsupported": False}}))
    goals = {g["goal"]: g["status"] for g in report.goals(tmp_path)}
    assert goals["gaussian_vs_flash"] == ("pass" if passes else "fail")
    assert goals["gaussian_ahead"] == ("pass" if ours_ms < 1.1 else "fail")
    assert goals["entmax_vs_adasplash_n4096"] == "pass" and goals["entmax_vs_adasplash_n16384"] == "fail"
    assert (
        goals["entmax_vs_flash_n4096"] == "pass" and goals["entmax_vs_flash_n16384"] == "fail"
    )  # 6.1 > 1.5 * 4
    assert goals["memory_linear"] == "fail"  # entmax15 vitattn: 45.1 / 30 > 1.5 (gaussian: 29 / 20 passes)
    assert goals["sanitizer_clean"] == "pass"


def test_find_sanitizer_in_pips_nvidia_package(tmp_path, monkeypatch):
    report = _report()
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    assert report.find_sanitizer(roots=[], sites=[str(tmp_path)]) is None
    exe = tmp_path / "nvidia" / "cuda_sanitizer_api" / "bin" / "compute-sanitizer"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    assert report.find_sanitizer(roots=[], sites=[str(tmp_path)]) is None  # not executable
    exe.chmod(0o755)
    assert report.find_sanitizer(roots=[], sites=[str(tmp_path)]) == str(exe)
    monkeypatch.setattr(report.shutil, "which", lambda name: "/opt/cuda/bin/" + name)
    assert report.find_sanitizer(roots=[], sites=[str(tmp_path)]) == "/opt/cuda/bin/compute-sanitizer"


def test_local_inputs_have_local_scores_and_block_sparse_entmax():
    from vitattn.bench.kernels import block_support, make_inputs

    x = make_inputs((1, 1, 1024, 16), "cpu", torch.float32, local=True)
    rand = make_inputs((1, 1, 1024, 16), "cpu", torch.float32)
    scores = (x.q @ x.k.transpose(-1, -2))[0, 0] * 16**-0.5
    # independent formula: A (cos(w dr) + cos(w dc)) on the 32 x 32 grid, w = pi / 32, radius 2
    w, radius = math.pi / 32, 2.0
    amp = 4.0 / w**2 * math.sqrt(3.0 / (math.pi * radius**6))
    r, c = torch.arange(1024) // 32, torch.arange(1024) % 32
    want = amp * (torch.cos(w * (r[:, None] - r[None, :])) + torch.cos(w * (c[:, None] - c[None, :])))
    assert (scores - want).abs().max() < 0.05 * amp
    local, other = block_support(x), block_support(rand)
    assert local["live_tile_fraction"] < 0.3 and other["live_tile_fraction"] == 1.0
    assert 3 < local["mean_support_keys"] < 40  # a disc of about radius 2 patches (pi r^2 ~ 13)


def test_a_passed_deadline_skips_every_implementation_not_started():
    import time

    from vitattn.bench.kernels import CASES, run_case

    res = run_case(
        CASES["vit_b"], device="cpu", dtype=torch.float32, dry=True, rounds=1, deadline=time.time() - 1
    )
    assert res.rows == [] and res.modes_done == ["fwd+bwd", "fwd"]
    reasons = {(s["mode"], s["impl"]): s["reason"] for s in res.skipped}
    for mode in ("fwd", "fwd+bwd"):
        for impl in ("softmax sdpa", "gaussian dense_sdpa", "entmax15 entmax_pkg"):
            assert reasons[(mode, impl)] == "out of time: the run's time limit is near"
    assert res.to_dict()["complete"] is True and res.to_dict()["rows"] == []


def test_a_sanitizer_that_refuses_the_device_gives_no_verdict(tmp_path):
    report = _report()
    mem = {
        "cases": [{"normalizer": "softmax", "kind": "none", "ok": False}],
        "sanitizer": {"errors": None, "unsupported": True},
    }
    (tmp_path / "memcheck.json").write_text(json.dumps(mem))
    by = {c["goal"]: c["status"] for c in report.checks(tmp_path)}
    assert by["memcheck_cases"] == "unknown"
    mem["sanitizer"] = {"errors": 0, "unsupported": False}
    (tmp_path / "memcheck.json").write_text(json.dumps(mem))
    assert {c["goal"]: c["status"] for c in report.checks(tmp_path)}["memcheck_cases"] == "fail"


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_an_implementation_that_fails_is_reported_and_the_others_still_timed(mode):
    from vitattn.bench import kernels as kb

    case = kb.CASES["vit_b"]
    x = kb.make_inputs(case.dry_shape, "cpu", torch.float32)

    def broken(_x):
        def fn():
            raise RuntimeError("boom")

        return fn

    res = kb.CaseResult(case, case.dry_shape, "cpu", torch.float32, dry=True)
    impls = [
        (kb.Impl("softmax sdpa", "softmax", kb._sdpa(None)), x),
        (kb.Impl("softmax broken", "softmax", broken), x),
    ]
    kb._measure_mode(res, impls, mode, rounds=1)
    assert [r.impl for r in res.rows] == ["softmax sdpa"] and res.rows[0].ms > 0
    assert res.skipped == [{"mode": mode, "impl": "softmax broken", "reason": "failed: RuntimeError: boom"}]


def test_skip_notes_group_by_reason():
    """One printed line per reason (impls and their modes listed once), not one per impl and mode."""
    from vitattn.bench import kernels as kb

    case = kb.CASES["vit_b"]
    a = kb.CaseResult(case, case.dry_shape, "cpu", torch.float32, dry=True)
    b = kb.CaseResult(case, case.dry_shape, "cpu", torch.float32, dry=True)
    a.skipped = [
        {"mode": "fwd+bwd", "impl": "x", "reason": "needs CUDA"},
        {"mode": "fwd+bwd", "impl": "y", "reason": "failed: boom"},
        {"mode": "fwd", "impl": "x", "reason": "needs CUDA"},
    ]
    b.skipped = [
        {"mode": "fwd", "impl": "z", "reason": "needs CUDA"},
        {"mode": "fwd", "impl": "x", "reason": "needs CUDA"},  # x's fwd again, from another case
    ]
    assert kb.skip_notes([a, b]) == [
        "skipped (needs CUDA): x [fwd+bwd, fwd], z [fwd]",
        "skipped (failed: boom): y [fwd+bwd]",
    ]
