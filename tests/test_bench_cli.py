"""The benchmark harness and the `vitattn` command's bench/info plumbing (no timing is asserted)."""

from __future__ import annotations

import importlib.metadata
import json
import mmap
import os
import platform
import re
import subprocess
import sys

import pytest
import torch

import vitattn
from vitattn.bench.harness import Goal, Measurement, SuiteResult, compare, register_suite, run_suites
from vitattn.cli import main
from vitattn.functional import available_backends


def test_compare_runs_every_implementation_interleaved():
    calls: list[str] = []
    rows = compare(
        "case", {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeat=3
    )
    assert [r.impl for r in rows] == ["a", "b"] and all(r.repeats == 3 and r.ms >= 0 for r in rows)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then rounds alternate


def test_timed_rounds_interleaves_implementations_through_torch_benchmark():
    from vitattn.bench.harness import timed_rounds

    calls: list[str] = []
    rows = timed_rounds(
        "case", {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, min_run_time=0.0
    )
    assert [(r.case, r.impl) for r in rows] == [("case", "a"), ("case", "b")]
    assert all(r.repeats == 3 and 0 <= r.ms_min <= r.ms for r in rows)  # one block per round, merged
    assert calls[:2] == ["a", "b"]  # the warm-up call of each, then every round times a, then b
    runs = [name for i, name in enumerate(calls[2:]) if i == 0 or calls[2:][i - 1] != name]
    assert runs == ["a", "b"] * 3


def test_timed_rounds_counts_page_faults_per_call_and_refuses_bad_settings(monkeypatch):
    import vitattn.bench.harness as harness

    counter = [0]
    monkeypatch.setattr(harness, "_minor_faults", lambda: counter[0])

    def faulting(n: int):
        def fn() -> None:
            counter[0] += n

        return fn

    rows = harness.timed_rounds("c", {"three": faulting(3), "seven": faulting(7)}, rounds=2, min_run_time=0.0)
    assert [(r.impl, r.extra["page_faults"]) for r in rows] == [("three", 3.0), ("seven", 7.0)]
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        harness.timed_rounds("c", {"x": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="min_run_time must be >= 0 seconds, got -1"):
        harness.timed_rounds("c", {"x": lambda: None}, min_run_time=-1)


def test_ratios_and_rendering_are_relative_to_the_reference_in_each_case():
    rows = [
        Measurement("x", "ref", 2.0, 2.0, 1),
        Measurement("x", "other", 5.0, 4.0, 1),
        Measurement("y", "ref", 1.0, 1.0, 1),
        Measurement("y", "other", 3.0, 3.0, 1),
    ]
    result = SuiteResult("demo", "demo title", "ref", rows)
    assert [result.ratio(r) for r in rows] == [1.0, 2.5, 1.0, 3.0]
    text = result.render()
    assert "demo title" in text and "2.50×" in text and "3.00×" in text
    assert json.loads(json.dumps(result.to_dict()))["rows"][1]["ratio"] == 2.5
    assert "faults/call" not in text


def _touch_fresh_pages(n_bytes: int = 64 << 20) -> None:
    """Fault in ``n_bytes`` of fresh anonymous pages (small pages), whatever the C allocator's settings:
    a ``bytearray`` of that size reuses the heap once ``harness.keep_heap`` ran in this process."""
    with mmap.mmap(-1, n_bytes) as region:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            region.madvise(mmap.MADV_NOHUGEPAGE)
        region[:: mmap.PAGESIZE] = b"\x01" * (n_bytes // mmap.PAGESIZE)


def test_compare_counts_page_faults_and_renders_them():
    from vitattn.bench.harness import compare

    calls = []
    impls = {"ref": lambda: calls.append(1), "alloc": _touch_fresh_pages}
    rows = compare("c", impls, warmup=1, repeat=2)
    assert len(calls) == 3 and [r.repeats for r in rows] == [2, 2]
    assert rows[0].extra["page_faults"] < 100  # appending to a list touches no fresh page
    assert rows[1].extra["page_faults"] >= 1000  # 64 MiB of fresh zeroed pages each call
    text = SuiteResult("demo", "t", "ref", rows).render()
    assert "faults/call" in text.splitlines()[2]


def test_compare_attributes_page_faults_to_the_call_that_made_them(monkeypatch):
    import vitattn.bench.harness as harness

    counter = [0]
    monkeypatch.setattr(harness, "_minor_faults", lambda: counter[0])

    def faulting(n: int):
        def fn() -> None:
            counter[0] += n

        return fn

    rows = harness.compare("c", {"three": faulting(3), "seven": faulting(7)}, warmup=2, repeat=4)
    # the mean per timed call, each implementation its own, warm-up calls not counted
    assert [(r.impl, r.extra["page_faults"]) for r in rows] == [("three", 3.0), ("seven", 7.0)]


def test_run_suites_writes_json_and_rejects_unknown_names(tmp_path, capsys, monkeypatch):
    import vitattn.bench.harness as harness

    monkeypatch.setattr(harness, "_SUITES", dict(harness._SUITES))  # the test suite does not outlive the test

    @register_suite("_test_suite", "a suite for this test")
    def _suite(quick: bool) -> SuiteResult:
        return SuiteResult("_test_suite", "t", "ref", [Measurement("c", "ref", 1.0, 1.0, 1)])

    out = tmp_path / "r.json"
    run_suites(["_test_suite"], json_path=out)
    assert json.loads(out.read_text())[0]["suite"] == "_test_suite"
    with pytest.raises(ValueError, match="unknown benchmark suite 'nope'"):
        run_suites(["nope"])
    assert main(["bench", "nope"]) == 2
    assert main(["bench", "--list"]) == 0
    assert "entmax" in capsys.readouterr().out


def test_entmax_suite_without_the_entmax_package_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "entmax", None)  # `import entmax` raises ImportError
    assert main(["bench", "entmax", "--quick"]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert re.search(r"not installed; pip install 'vitattn\[bench\]'", err) and len(err.splitlines()) == 1


def _installed_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_info_prints_versions_and_backends(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"vitattn {importlib.metadata.version('vitattn')}"
    assert lines[0] == f"vitattn {vitattn.__version__}"
    machine = ("python", "cpu threads", "cuda")  # facts about this machine, not distributions
    rows = dict(line.strip().split(maxsplit=1) for line in lines[1:] if not line.strip().startswith(machine))
    backends = rows.pop("backends").split(", ")
    assert backends == available_backends() and "reference" in backends
    assert rows.pop("group") == "torch = cpu_blocked, sdpa, reference"
    assert {"torch", "timm", "entmax", "triton"} <= set(rows)
    assert rows == {dist: _installed_version(dist) for dist in rows}
    assert rows["torch"] == importlib.metadata.version("torch") != "not installed"


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_heap_removes_allocator_page_faults():
    script = """
from vitattn.bench.harness import compare, keep_heap, machine_line
big = lambda: bytearray(64 << 20)  # above glibc's largest mmap threshold: fresh pages every call
before = compare("c", {"big": big}, warmup=1, repeat=3)[0].extra["page_faults"]
assert "heap kept" not in machine_line()
assert keep_heap()
after = compare("c", {"big": big}, warmup=1, repeat=3)[0].extra["page_faults"]
print(before, after, "heap kept" in machine_line())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    before, after, kept = out.split()
    assert float(before) > 10_000 and float(after) < 100 and kept == "True"


def _result(name: str, ms: dict[tuple[str, str], float]) -> SuiteResult:
    rows = [Measurement(case, impl, t, t, 1) for (case, impl), t in ms.items()]
    return SuiteResult(name, "t", "ref", rows, goals=[Goal("c", "new", "ref", 1.5)])


def test_combine_processes_reports_the_spread_of_per_process_ratios():
    from vitattn.bench.harness import combine_processes

    runs = [
        _result("s", {("c", "ref"): 10.0, ("c", "new"): 12.0}),  # 1.2x
        _result("s", {("c", "ref"): 20.0, ("c", "new"): 40.0}),  # 2.0x: one slow, unlucky process
        _result("s", {("c", "ref"): 10.0, ("c", "new"): 13.0}),  # 1.3x
    ]
    combined = combine_processes(runs)
    new = combined.row("c", "new")
    assert combined.processes == 3 and new.process_ms == [12.0, 40.0, 13.0] and new.ms == 13.0
    assert combined.ratios(new) == [1.2, 2.0, 1.3] and combined.ratio(new) == 1.3  # median of ratios
    text = combined.render()
    assert "3 fresh processes" in text and "1.30×   1.20×   2.00×" in text
    (goal,) = combined.goal_lines()
    assert "new / ref = 1.30x (min 1.20x, max 2.00x over 3 processes)" in goal and goal.endswith("MISSED)")
    data = json.loads(json.dumps(combined.to_dict()))
    assert (
        data["processes"] == 3 and data["rows"][1]["ratio_max"] == 2.0 and data["rows"][1]["ratio_min"] == 1.2
    )
    assert SuiteResult.from_dict(data).row("c", "new").process_ms == [12.0, 40.0, 13.0]
    with pytest.raises(ValueError, match="do not have the rows"):
        combine_processes([runs[0], _result("s", {("c", "ref"): 1.0})])


@pytest.mark.slow
def test_bench_processes_runs_fresh_children_and_prints_the_spread(tmp_path, capsys, monkeypatch):
    import vitattn.bench.harness as harness

    monkeypatch.setattr(harness, "_SUITES", dict(harness._SUITES))
    monkeypatch.setattr(harness, "_SPREAD_SUITES", set(harness._SPREAD_SUITES))
    out = tmp_path / "spread.json"
    argv = ["bench", "_tiny", "--processes", "2", "--threads", "1", "--quick", "--json", str(out)]
    assert main([*argv, "--import-module", "tests.bench_tiny_suite"]) == 0
    text = capsys.readouterr().out
    assert "[_tiny: process 2/2 done]" in text and "2 fresh processes" in text
    (data,) = json.loads(out.read_text())
    assert data["processes"] == 2 and data["suite"] == "_tiny"
    for row in data["rows"]:
        assert len(row["process_ms"]) == 2 and row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    met, missed = data["goal_lines"]
    assert "in every process: met" in met and "MISSED" in missed
    assert data["title"] == "tiny (pid " + data["title"].split("pid ")[1]  # the first child's title
    assert str(os.getpid()) not in data["title"]  # measured in a child, not here


def test_bench_processes_refuses_suites_it_cannot_combine(capsys):
    assert main(["bench", "transfer", "--processes", "2"]) == 2
    assert "cannot be combined across processes" in capsys.readouterr().err
    assert main(["bench", "models", "--processes", "0"]) == 2
    assert "--processes must be >= 1, got 0" in capsys.readouterr().err


def test_a_failing_child_is_reported_with_its_stderr(monkeypatch):
    import vitattn.bench.harness as harness

    monkeypatch.setattr(harness, "_SPREAD_SUITES", {"models"})
    monkeypatch.setattr(
        harness, "_child_command", lambda *a, **k: [sys.executable, "-c", "raise SystemExit('boom')"]
    )
    with pytest.raises(RuntimeError, match=r"process 1/2 exited with 1:\nboom"):
        harness.run_processes("models", 2)


def test_train_suite_builds_the_three_vit_tinies():
    from timm.layers import Attention as TimmAttention

    from vitattn.bench import train
    from vitattn.layers import EntmaxAttention, LocAtAttention

    models = train.models()
    assert list(models) == [train.REFERENCE, "locatvit_tiny", "vit_tiny entmax15"]
    ref, locat, entmax = models.values()
    assert type(ref.blocks[0].attn) is TimmAttention and isinstance(locat.blocks[11].attn, LocAtAttention)
    assert isinstance(entmax.blocks[5].attn, EntmaxAttention) and locat.prr is not None
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert sizes[train.REFERENCE] == sizes["vit_tiny entmax15"]  # same weights, another normalizer


def test_train_suite_times_a_whole_training_step(monkeypatch, capsys):
    """The step updates the weights (AdamW ran); the suite prints the three implementations and
    their ratios (tiny stand-ins here: the real suite's 224 px ViT-Tinies are for `vitattn bench`)."""
    import timm

    from vitattn.bench import train

    def tiny() -> dict[str, torch.nn.Module]:
        torch.manual_seed(0)
        args = dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=1000)
        return {
            train.REFERENCE: timm.create_model("vit_tiny_patch16_224", **args),
            "locatvit_tiny": timm.create_model("locatvit_tiny", **args),
            "vit_tiny entmax15": vitattn.patch(timm.create_model("vit_tiny_patch16_224", **args), "entmax15"),
        }

    model = tiny()["locatvit_tiny"]
    before = [p.detach().clone() for p in model.parameters()]
    step = train.training_step(model, torch.randn(2, 3, 32, 32), torch.tensor([1, 2]), None)
    step()
    pairs = zip(before, model.parameters(), strict=True)
    moved = [not torch.equal(a, b) for a, b in pairs if b.grad is not None]
    assert moved and all(moved)
    monkeypatch.setattr(train, "models", tiny)
    monkeypatch.setattr(train, "SIZE", 32)
    assert main(["bench", "train", "--quick"]) == 0
    text = capsys.readouterr().out
    assert "One training step, cpu float32, ratio = ms / timm vit_tiny" in text
    for name in ("locatvit_tiny", "vit_tiny entmax15"):
        assert name in text
    assert "train step 32px b8 cpu float32" in text and "1.00×" in text
