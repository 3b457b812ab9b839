"""``benchmarks/gpu_check.sh``: its dry run on the CPU (every step, tiny shapes, TRITON_INTERPRET=1), the
budget check, the step records of ``benchmarks/gpu_report.py`` and the pass / fail rules of the goals.

The dry run is a subprocess with ``OMP_NUM_THREADS=1`` (it starts several Python processes in turn).
"""

from __future__ import annotations

import dataclasses
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
    "warm.json",
    "tests.json",
    "memcheck.json",
    "bench_n4096.json",
    "bench_n16384.json",
    "bench_extra.json",
    "summary.json",
}
BENCH_CASES = {
    "bench_n4096.json": ["n4096"],
    "bench_n16384.json": ["n16384"],
    "bench_extra.json": ["sparse", "vit_b"],
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


@pytest.mark.slow  # the whole device check run dry in a subprocess (~40 s)
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


def _bench_cases(out: Path):
    for name, cases in BENCH_CASES.items():
        data = json.loads((out / name).read_text())
        assert data["dry_run"] is True and data["suite"] == "kernels"
        assert [c["case"] for c in data["cases"]] == cases
        yield from data["cases"]


@pytest.mark.slow  # the whole device check run dry in a subprocess (~40 s)
def test_dry_run_bench_json_has_every_family_and_the_reasons_for_what_it_skipped(dry_run):
    out, _ = dry_run
    for c in _bench_cases(out):
        case = c["case"]
        assert c["complete"] and c["modes_done"] == ["fwd+bwd", "fwd"]
        assert c["reference"] == "softmax sdpa"
        impls = {(r["case"].rsplit(" ", 1)[1], r["impl"]) for r in c["rows"]}
        for row in c["rows"]:
            assert row["ms"] > 0 and math.isfinite(row["ratio"]) and "tflops" in row["extra"]
            # every row is gated against the reference backend in the same run, gradients included
            extra = row["extra"]
            assert extra["valid"] == 1.0 and extra["ranked"] == 1.0 and extra["rel_err"] < 1e-4, row
            if not row["impl"].endswith("flex"):  # the CPU FlexAttention has no backward: forward only
                assert extra["grad_err"] < 2e-4, row
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


@pytest.mark.slow  # the whole device check run dry in a subprocess (~40 s)
def test_dry_run_extra_step_measures_vitattns_host_time_at_vit_b(dry_run):
    out, _ = dry_run
    host = json.loads((out / "bench_extra.json").read_text())["host"]
    assert {(r["case"], r["impl"], r["mode"]) for r in host["times"]} == {
        ("vit_b", impl, mode)
        for impl in ("softmax vitattn", "gaussian vitattn", "entmax15 vitattn")
        for mode in ("fwd", "fwd+bwd")
    }
    assert all(0 < r["host_us"] <= r["call_us"] for r in host["times"])
    prof = host["profile"]
    assert (prof["case"], prof["impl"], prof["mode"]) == ("vit_b", "gaussian vitattn", "fwd+bwd")
    assert len(prof["functions"]) == 25 and prof["functions"][0]["own_us"] >= prof["functions"][-1]["own_us"]


@pytest.mark.slow  # the whole device check run dry in a subprocess (~40 s)
def test_dry_run_memcheck_and_summary(dry_run):
    out, _ = dry_run
    mem = json.loads((out / "memcheck.json").read_text())
    assert mem["cases"] and all(c["ok"] for c in mem["cases"])
    assert mem["sanitizer"] == {"path": None, "errors": None, "unsupported": False}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and set(summary["files"]) == FILES
    goals = {g["goal"]: g["status"] for g in summary["goals"]}
    assert set(goals) == {
        f"{goal}_{case}"
        for case in ("n4096", "n16384")
        for goal in (
            "gaussian_vs_flash",
            "gaussian_vs_dense_sdpa",
            "gaussian_vs_flex",
            "entmax_vs_flash",
            "entmax_vs_adasplash",
        )
    } | {"gaussian_kernels_vs_flash_n4096", "memory_linear", "sanitizer_clean"}
    # no AdaSplash, no FlexAttention backward, no CUDA graph, no peak memory and no sanitizer on the CPU
    for name in (
        "entmax_vs_adasplash_n4096",
        "gaussian_vs_flex_n4096",
        "gaussian_kernels_vs_flash_n4096",
        "memory_linear",
        "sanitizer_clean",
    ):
        assert goals[name] == "unknown", name
    checks = {c["goal"]: c["status"] for c in summary["checks"]}
    assert checks == {"warm_compiles": "pass", "gpu_tests": "unknown", "memcheck_cases": "pass"}
    assert {s: v["status"] for s, v in summary["steps"].items()}["bench_n4096"] == "ok"
    warm = json.loads((out / "warm.json").read_text())
    assert warm["jobs"] and warm["compile_errors"] == [] and warm["jobs_total"] == len(warm["jobs"])


def test_budget_check_skips_steps_and_still_writes_their_json(tmp_path):
    res = _dry_run(tmp_path, budget=12)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES
    for name in ("env", "warm", "memcheck", "bench_n4096", "bench_extra"):
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


def _row(
    case: str,
    impl: str,
    ms: float,
    peak: float | None = None,
    valid: bool = True,
    ranked: bool = True,
    mode: str = "fwd+bwd",
) -> dict:
    extra = {"rel_err": 1e-3 if valid else 0.5, "grad_err": 2e-3}
    extra.update(valid=float(valid), ranked=float(ranked))
    if peak is not None:
        extra["peak_mib"] = peak
    return {"case": f"{case} B1 {mode}", "impl": impl, "ms": ms, "extra": extra}


def _bench(out: Path, name: str, case: str, rows: list[dict]) -> None:
    """A bench JSON with the given rows (reference: SDPA flash)."""
    data = {"cases": [{"case": case, "reference": "softmax sdpa_flash", "rows": rows}]}
    (out / f"bench_{name}.json").write_text(json.dumps(data))


def _good_run(out: Path, ours_ms: float = 1.0 / 0.95 - 1e-3, graph_ms: float = 0.9) -> None:
    _bench(
        out,
        "n4096",
        "n4096",
        [
            _row("n4096", "softmax sdpa_flash", 1.0, 10.0),
            _row("n4096", "gaussian vitattn", ours_ms, 20.0),
            _row("n4096", "gaussian vitattn graph", graph_ms),
            _row("n4096", "gaussian flex", 2.0),
            _row("n4096", "gaussian dense_sdpa", 1.1),
            _row("n4096", "entmax15 vitattn", 1.3, 30.0),
            _row("n4096", "entmax15 adasplash", 2.6),
        ],
    )
    _bench(
        out,
        "n16384",
        "n16384",
        [
            _row("n16384", "softmax sdpa_flash", 4.0, 10.0),
            _row("n16384", "gaussian vitattn", 5.0, 29.0),
            _row("n16384", "entmax15 vitattn", 6.1, 45.1),
            _row("n16384", "entmax15 adasplash", 6.0),
        ],
    )
    (out / "memcheck.json").write_text(
        json.dumps(
            {
                "cases": [{"normalizer": "softmax", "kind": "none", "ok": True}],
                "sanitizer": {"errors": 0, "unsupported": False},
                "step": {"status": "ok"},
            }
        )
    )


@pytest.mark.parametrize("ours_ms, passes", [(1.0 / 0.95 - 1e-3, True), (1.0 / 0.95 + 1e-3, False)])
def test_goal_thresholds(tmp_path, ours_ms, passes):
    report = _report()
    _good_run(tmp_path, ours_ms)
    goals = {g["goal"]: g["status"] for g in report.goals(tmp_path)}
    assert goals["gaussian_vs_flash_n4096"] == ("pass" if passes else "fail")
    assert goals["gaussian_kernels_vs_flash_n4096"] == "pass"  # 0.9 ms against 1.0: 1.11x
    assert "gaussian_kernels_vs_flash_n16384" not in goals  # no graph rows there
    # the Gaussian kernel against the same bias materialized (dense + SDPA) and FlexAttention, both reported
    assert goals["gaussian_vs_dense_sdpa_n4096"] == ("pass" if ours_ms < 1.1 else "fail")
    assert goals["gaussian_vs_flex_n4096"] == "pass"
    assert goals["gaussian_vs_flex_n16384"] == "unknown"  # no flex row at n16384
    assert goals["entmax_vs_adasplash_n4096"] == "pass" and goals["entmax_vs_adasplash_n16384"] == "fail"
    assert goals["entmax_vs_flash_n4096"] == "pass"
    assert goals["entmax_vs_flash_n16384"] == "fail"  # 6.1 > 1.3 * 4
    assert goals["memory_linear"] == "fail"  # entmax15 vitattn: 45.1 / 30 > 1.5 (gaussian: 29 / 20 passes)
    assert goals["sanitizer_clean"] == "pass"


@pytest.mark.parametrize("graph_ms, status", [(1.0 / 0.95 - 1e-3, "pass"), (1.0 / 0.95 + 1e-3, "fail")])
def test_kernel_goal_reads_the_graph_row(tmp_path, graph_ms, status):
    report = _report()
    _good_run(tmp_path, ours_ms=2.0, graph_ms=graph_ms)
    goals = {g["goal"]: g for g in report.goals(tmp_path)}
    assert goals["gaussian_vs_flash_n4096"]["status"] == "fail"
    assert goals["gaussian_kernels_vs_flash_n4096"]["status"] == status
    assert "vitattn graph" in goals["gaussian_kernels_vs_flash_n4096"]["detail"]


def test_a_wrong_vitattn_row_fails_its_goals_and_a_wrong_or_unranked_peer_gives_no_verdict(tmp_path):
    report = _report()
    _good_run(tmp_path)
    _bench(
        tmp_path,
        "n4096",
        "n4096",
        [
            _row("n4096", "softmax sdpa_flash", 1.0, 10.0),
            _row("n4096", "gaussian vitattn", 0.5, 20.0, valid=False),  # fast, but wrong
            _row("n4096", "gaussian flex", 2.0, ranked=False),  # q, k, v gradients only
            _row("n4096", "gaussian dense_sdpa", 1.1),
            _row("n4096", "entmax15 vitattn", 1.3, 30.0),
            _row("n4096", "entmax15 adasplash", 2.6, valid=False),  # a peer that is wrong
        ],
    )
    goals = {g["goal"]: g for g in report.goals(tmp_path)}
    assert goals["gaussian_vs_flash_n4096"]["status"] == "fail"
    assert "wrong" in goals["gaussian_vs_flash_n4096"]["detail"]
    assert goals["gaussian_vs_dense_sdpa_n4096"]["status"] == "fail"
    assert goals["entmax_vs_adasplash_n4096"]["status"] == "unknown"
    assert "entmax15 adasplash wrong" in goals["entmax_vs_adasplash_n4096"]["detail"]
    assert goals["entmax_vs_flash_n4096"]["status"] == "pass"
    # ours right, the peer ran with fewer gradients: reported, not ranked
    _bench(
        tmp_path,
        "n4096",
        "n4096",
        [
            _row("n4096", "softmax sdpa_flash", 1.0),
            _row("n4096", "gaussian vitattn", 1.0),
            _row("n4096", "gaussian flex", 2.0, ranked=False),
        ],
    )
    goals = {g["goal"]: g for g in report.goals(tmp_path)}
    assert goals["gaussian_vs_flex_n4096"]["status"] == "unknown"
    assert "gaussian flex unranked" in goals["gaussian_vs_flex_n4096"]["detail"]
    # a row without a gate (an old JSON) is not compared either
    row = _row("n4096", "gaussian vitattn", 1.0)
    del row["extra"]["valid"]
    _bench(tmp_path, "n4096", "n4096", [_row("n4096", "softmax sdpa_flash", 1.0), row])
    assert {g["goal"]: g["status"] for g in report.goals(tmp_path)}["gaussian_vs_flash_n4096"] == "unknown"


def _step(out: Path, name: str, status: str, **data) -> None:
    (out / f"{name}.json").write_text(json.dumps({**data, "step": {"name": name, "status": status}}))


@pytest.mark.parametrize(
    "status, counts, failed, verdict",
    [
        ("ok", {"passed": 40}, [], "pass"),
        ("timeout", {"passed": 12}, [], "unknown"),  # killed part-way after passes: not a FAIL
        ("timeout", {"passed": 12, "failed": 1}, ["t::a"], "fail"),  # what it showed failed
        ("failed", {"passed": 39, "failed": 1}, ["t::a"], "fail"),
        ("skipped", {}, [], "unknown"),
        ("ok", {}, [], "unknown"),  # nothing ran
    ],
)
def test_gpu_tests_verdict(tmp_path, status, counts, failed, verdict):
    report = _report()
    _step(tmp_path, "tests", status, pytest={"counts": counts, "failed": failed, "tests": {}})
    assert {c["goal"]: c["status"] for c in report.checks(tmp_path)}["gpu_tests"] == verdict


@pytest.mark.parametrize(
    "status, cases_ok, errors, verdict, clean",
    [
        ("ok", [True, True], 0, "pass", "pass"),
        ("timeout", [True], 0, "unknown", "unknown"),  # killed part-way: never a pass
        ("timeout", [True, False], 0, "fail", "unknown"),  # a case it reached failed
        ("ok", [True, True], 2, "fail", "fail"),
        ("timeout", [True], 3, "fail", "fail"),
        ("skipped", [], None, "unknown", "unknown"),
    ],
)
def test_memcheck_verdict(tmp_path, status, cases_ok, errors, verdict, clean):
    report = _report()
    cases = [{"normalizer": "softmax", "kind": f"k{i}", "ok": ok} for i, ok in enumerate(cases_ok)]
    _step(tmp_path, "memcheck", status, cases=cases, sanitizer={"errors": errors, "unsupported": False})
    assert {c["goal"]: c["status"] for c in report.checks(tmp_path)}["memcheck_cases"] == verdict
    assert {g["goal"]: g["status"] for g in report.goals(tmp_path)}["sanitizer_clean"] == clean


@pytest.mark.parametrize(
    "status, compile_errors, jobs, verdict",
    [
        ("ok", [], 10, "pass"),
        ("ok", ["tests config 2 entmax15 gaussian 197 64"], 10, "fail"),
        ("timeout", [], 4, "unknown"),  # compiled part of it: the steps after compile the rest
        ("timeout", ["bench n4096 gaussian vitattn fwd+bwd"], 4, "fail"),
        ("skipped", [], 0, "unknown"),
    ],
)
def test_warm_verdict(tmp_path, status, compile_errors, jobs, verdict):
    report = _report()
    records = [{"name": str(i)} for i in range(jobs)]
    _step(tmp_path, "warm", status, compile_errors=compile_errors, jobs=records, counts={})
    assert {c["goal"]: c["status"] for c in report.checks(tmp_path)}["warm_compiles"] == verdict


def test_summary_exit_status_follows_the_checks(tmp_path):
    report = _report()
    _good_run(tmp_path)
    _step(tmp_path, "warm", "ok", compile_errors=[], jobs=[{"name": "a"}], counts={})
    _step(tmp_path, "tests", "timeout", pytest={"counts": {"passed": 3}, "failed": [], "tests": {}})
    assert report.main(["summary", str(tmp_path)]) == 0  # unknown is not a failure
    _step(tmp_path, "tests", "failed", pytest={"counts": {"failed": 1}, "failed": ["t::x"], "tests": {}})
    assert report.main(["summary", str(tmp_path)]) == 1


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


@pytest.mark.slow  # the whole device check run dry in a subprocess (~40 s)
def test_dry_run_gives_the_last_bench_step_what_the_earlier_steps_left(dry_run):
    out, res = dry_run
    steps = json.loads((out / "summary.json").read_text())["steps"]
    extra = json.loads((out / "bench_extra.json").read_text())["step"]
    # the dry run's budget is 300 s and its limits double (extra: 40 s -> 80 s); the steps before it end
    # far inside their limits, so the last step's limit is the budget's remainder, above its own 80 s
    used = sum(int(s["seconds"] or 0) for name, s in steps.items() if name != "bench_extra")
    assert extra["limit_s"] > 80 and extra["limit_s"] <= 300 - used, (extra, used)
    assert "--started" in (ROOT / "benchmarks" / "gpu_check.sh").read_text()


@pytest.mark.slow  # a subprocess importing torch
def test_bench_deadline_counts_from_started_and_skips_whole_cases(tmp_path):
    import time

    script = ROOT / "benchmarks" / "bench_kernels.py"
    out = tmp_path / "bench.json"
    # a limit that began 100 s ago is already past its deadline: no case starts, each is reported
    res = subprocess.run(
        [sys.executable, str(script), "--case", "vit_b", "sparse", "--dry-run", "--seconds", "30",
         "--started", str(time.time() - 100), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "vit_b: skipped (out of time" in res.stdout and "sparse: skipped (out of time" in res.stdout


def test_runs_gives_min_median_max_per_row_and_goal_pass_counts(tmp_path, capsys):
    report = _report()
    dirs = []
    for i, ours in enumerate((1.0, 1.2, 0.9)):
        d = tmp_path / f"run{i}"
        d.mkdir()
        _good_run(d, ours)
        dirs.append(d)
    (dirs[2] / "bench_n16384.json").unlink()  # a run without the n16384 case: its goals are unknown there
    assert report.main(["runs", *map(str, dirs), "--json", str(tmp_path / "runs.json")]) == 0
    saved = json.loads((tmp_path / "runs.json").read_text())
    rows = {r["row"]: r for r in saved["ratios"]}
    g = rows["n4096 fwd+bwd gaussian vitattn"]
    assert (g["min"], g["median"], g["max"], g["runs"]) == (0.9, 1.0, 1.2, 3)
    assert rows["n16384 fwd+bwd entmax15 vitattn"]["runs"] == 2
    assert rows["n16384 fwd+bwd entmax15 vitattn"]["ratios"][2] is None
    # 1.0 and 0.9 ms are >= 0.95x the throughput of 1.0 ms; 1.2 ms is not
    assert saved["goals"]["gaussian_vs_flash_n4096"] == ["pass", "fail", "pass"]
    assert saved["goals"]["entmax_vs_flash_n16384"] == ["fail", "fail", "unknown"]
    printed = capsys.readouterr().out
    assert "throughput, n4096: 2 of 3 runs pass (pass, fail, pass)" in printed
    with pytest.raises(SystemExit, match="not found"):
        report.main(["runs", str(dirs[0]), str(tmp_path / "no_such_run")])


def test_the_step_limits_fit_the_budget():
    """The steps' own limits (``step NAME LIMIT`` and the bench specs ``name:LIMIT:cases``) add up to at
    most the 420 s budget, so that one 10-minute device call leaves time for a rerun."""
    import re

    text = SCRIPT.read_text()
    limits = [int(m) for m in re.findall(r"^\s*step \w+ (\d+) ", text, flags=re.M)]
    specs = re.search(r"for spec in (.+?); do", text)
    assert specs is not None
    benches = [int(spec.split(":")[1]) for spec in specs.group(1).split()]
    memcheck = [m for m in re.findall(r"^\s*step memcheck (\d+) ", text, flags=re.M)]
    assert len(memcheck) == 2 and len(set(memcheck)) == 1  # one of the two memcheck branches runs
    total = sum(limits) - int(memcheck[0]) + sum(benches)
    assert len(benches) == 3 and total <= 420, (limits, benches, total)


def test_runs_lists_the_tuning_keys_whose_tile_differs_between_runs(tmp_path, capsys):
    report = _report()
    dirs = []
    for i, tile in enumerate(("128x64 w8 s3", "64x64 w4 s3", "128x64 w8 s3")):
        d = tmp_path / f"run{i}"
        d.mkdir()
        _good_run(d, 1.0)
        bench = d / "bench_n4096.json"
        data = json.loads(bench.read_text())
        data["tuning"] = {"fwd|a": {"tile": tile, "source": "timed"}, "dq|b": {"tile": "64x64 w4 s3"}}
        bench.write_text(json.dumps(data))
        dirs.append(d)
    assert report.main(["runs", *map(str, dirs), "--json", str(tmp_path / "runs.json")]) == 0
    saved = json.loads((tmp_path / "runs.json").read_text())
    assert saved["differing_picks"] == {"fwd|a": ["128x64 w8 s3", "64x64 w4 s3", "128x64 w8 s3"]}
    assert "tile differs between runs: fwd|a: 128x64 w8 s3, 64x64 w4 s3" in capsys.readouterr().out


def test_bench_reports_each_timed_pick_with_every_candidates_lower_time(monkeypatch):
    from vitattn.bench import kernels as kb

    ms = {"128x64 w8 s3": [0.9], "64x64 w4 s3": [0.6, 0.5]}
    log = {
        "fwd|x": {"tile": "64x64 w4 s3", "source": "timed", "ms": ms},
        "dq|y": {"tile": "64x64 w4 s3", "source": "disk"},
    }
    assert kb.tuning_lines(log) == ["tuned fwd|x: 64x64 w4 s3 (128x64 w8 s3 0.9, 64x64 w4 s3 0.5)"]
    ops = pytest.importorskip("vitattn.kernels.ops")
    monkeypatch.setattr(ops, "_TUNING_LOG", log)
    assert kb.payload([], 0.0, dry=True)["tuning"] == log


def test_graph_rows_replay_the_vitattn_calls_and_skip_the_largest_case(monkeypatch):
    from vitattn.bench import kernels as kb

    graphs = [i for i in kb.implementations("cuda") if i.graph]
    assert [i.name for i in graphs] == ["gaussian vitattn graph", "softmax vitattn graph"]
    assert all(i.cuda_only for i in graphs)
    assert not any(i.graph for i in kb.implementations("cuda", local=True))
    monkeypatch.setattr(kb, "_triton_declines", lambda device: None)
    plain = dataclasses.replace(graphs[0], cuda_only=None)
    n4096, n16384 = 4 * 12 * 4096**2, 12 * 16384**2
    assert kb._unavailable(plain, "cpu", "fwd+bwd", n4096) is None
    assert "2^30" in str(kb._unavailable(plain, "cpu", "fwd+bwd", n16384))
    assert kb._unavailable(graphs[0], "cpu", "fwd", n4096) == "needs CUDA: CUDA graphs"
