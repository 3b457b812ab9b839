"""The benchmark harness and the `vitattn` command's bench/info plumbing (no timing is asserted)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys

import pytest

import vitattn
from vitattn.bench.harness import Measurement, SuiteResult, compare, register_suite, run_suites
from vitattn.cli import main
from vitattn.functional import available_backends


def test_compare_runs_every_implementation_interleaved():
    calls: list[str] = []
    rows = compare(
        "case", {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeat=3
    )
    assert [r.impl for r in rows] == ["a", "b"] and all(r.repeats == 3 and r.ms >= 0 for r in rows)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then rounds alternate


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


def test_compare_counts_page_faults_and_renders_them():
    from vitattn.bench.harness import compare

    calls = []
    impls = {"ref": lambda: calls.append(1), "alloc": lambda: bytearray(64 << 20)}
    rows = compare("c", impls, warmup=1, repeat=2)
    assert len(calls) == 3 and [r.repeats for r in rows] == [2, 2]
    assert rows[0].extra["page_faults"] >= 0
    assert rows[1].extra["page_faults"] >= 1000  # 64 MiB of fresh zeroed pages each call
    text = SuiteResult("demo", "t", "ref", rows).render()
    assert "faults/call" in text.splitlines()[2]


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


def test_entmax_suite_without_the_entmax_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "entmax", None)  # `import entmax` raises ImportError
    with pytest.raises(ImportError, match=r"not installed; pip install 'vitattn\[bench\]'"):
        main(["bench", "entmax", "--quick"])


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
    assert backends == available_backends() and "torch" in backends
    assert {"torch", "timm", "entmax", "triton"} <= set(rows)
    assert rows == {dist: _installed_version(dist) for dist in rows}
    assert rows["torch"] == importlib.metadata.version("torch") != "not installed"


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
