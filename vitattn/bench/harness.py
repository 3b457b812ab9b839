"""Side-by-side timing: every implementation of a case runs in the same process, interleaved in
rounds so that drift (thermal, other load) hits all of them alike, and results print as ratios.

Two ways to time a case. :func:`timed_rounds` (the CPU suites) leaves the timing itself to
``torch.utils.benchmark``: each round runs ``Timer.blocked_autorange`` once per implementation and
``Measurement.merge`` pools an implementation's rounds. :func:`compare` times one call per
implementation per round with ``time.perf_counter``, for callers that need that exact call order
(the GPU kernels suite sizes its own samples). Both count minor page faults per call.

One process is one sample of the allocator's and the OpenMP runtime's state: :func:`run_processes`
runs a suite in several fresh processes and reports the spread (min / median / max) of each
per-process ratio, so that no ratio comes from one lucky process.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


@dataclass
class Measurement:
    """One implementation on one case: median and best milliseconds per call.

    ``process_ms`` holds the median of each process when several processes were combined
    (:func:`combine_processes`); then ``ms`` is the median of those and ``ms_min`` the best call of all.
    """

    case: str
    impl: str
    ms: float
    ms_min: float
    repeats: int
    extra: dict[str, float] = field(default_factory=dict)
    process_ms: list[float] = field(default_factory=list)

    def per_process_ms(self) -> list[float]:
        """Median milliseconds of each process (one value for a single-process measurement)."""
        return list(self.process_ms) or [self.ms]


@dataclass(frozen=True)
class Goal:
    """A speed goal: ``impl / over`` (ms) in ``case`` at most ``limit`` (at least, if ``at_least``),
    in every process."""

    case: str
    impl: str
    over: str
    limit: float
    at_least: bool = False


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


@dataclass
class SuiteResult:
    """All measurements of a suite, with the implementation the ratios are relative to."""

    name: str
    title: str
    reference: str
    rows: list[Measurement]
    notes: list[str] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    processes: int = 1

    def row(self, case: str, impl: str) -> Measurement:
        """The measurement of ``impl`` in ``case``."""
        for r in self.rows:
            if r.case == case and r.impl == impl:
                return r
        raise KeyError(f"no measurement of {impl!r} in case {case!r}")

    def ratios(self, row: Measurement, over: str | None = None) -> list[float]:
        """Per-process ratios ``row.ms / over.ms`` (``over``: the reference by default), same case."""
        ref = self.row(row.case, self.reference if over is None else over)
        return [a / b for a, b in zip(row.per_process_ms(), ref.per_process_ms(), strict=True)]

    def ratio(self, row: Measurement) -> float:
        """``row.ms / reference.ms`` within the same case (the median per-process ratio when combined)."""
        return statistics.median(self.ratios(row))

    def goal_lines(self) -> list[str]:
        """One line per goal: the ratio's median (and spread over processes), met or MISSED."""
        lines = []
        for g in self.goals:
            ratios = self.ratios(self.row(g.case, g.impl), g.over)
            lo, mid, hi = _spread(ratios)
            worst = lo if g.at_least else hi
            met = worst >= g.limit if g.at_least else worst <= g.limit
            spread = (
                f" (min {lo:.2f}x, max {hi:.2f}x over {len(ratios)} processes)" if len(ratios) > 1 else ""
            )
            every = " in every process" if len(ratios) > 1 else ""
            lines.append(
                f"{g.case}: {g.impl} / {g.over} = {mid:.2f}x{spread} "
                f"(goal {'>=' if g.at_least else '<='} {g.limit:.2f}x{every}: {'met' if met else 'MISSED'})"
            )
        return lines

    def render(self) -> str:
        """A plain-text table: case, implementation, median ms, best ms, ratio to the reference, and
        page faults per call where they were counted."""
        impl_w = max(len(r.impl) for r in self.rows)
        case_w = max(max(len(r.case) for r in self.rows), 4)
        ratio_w = len(self.reference) + 4
        faults = any("page_faults" in r.extra for r in self.rows)
        head = f"{'case':<{case_w}}  {'implementation':<{impl_w}}  {'median ms':>10}  {'best ms':>9}  " + (
            f"{'× ' + self.reference:>{ratio_w}}"
        )
        spread = self.processes > 1
        head += f"  {'min':>6}  {'max':>6}" if spread else ""
        head += "  faults/call" if faults else ""
        lines = [self.title, machine_line(), head, "-" * len(head)]
        if spread:
            lines.insert(
                2,
                f"{self.processes} fresh processes: ms are medians over processes, the ratio is the "
                "median per-process ratio, min / max its spread",
            )
        last_case = None
        for r in self.rows:
            case = r.case if r.case != last_case else ""
            last_case = r.case
            line = (
                f"{case:<{case_w}}  {r.impl:<{impl_w}}  {r.ms:>10.2f}  {r.ms_min:>9.2f}  "
                f"{self.ratio(r):>{ratio_w - 1}.2f}×"
            )
            if spread:
                lo, _, hi = _spread(self.ratios(r))
                line += f"  {lo:>5.2f}×  {hi:>5.2f}×"
            if faults:
                line += f"  {r.extra.get('page_faults', float('nan')):>11.0f}"
            lines.append(line)
        lines.extend(self.notes)
        lines.extend(self.goal_lines())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        rows = []
        for r in self.rows:
            row = dict(asdict(r), ratio=self.ratio(r))
            if self.processes > 1:
                row["ratio_min"], row["ratio_median"], row["ratio_max"] = _spread(self.ratios(r))
            rows.append(row)
        return {
            "suite": self.name,
            "title": self.title,
            "reference": self.reference,
            "machine": machine(),
            "processes": self.processes,
            "rows": rows,
            "notes": self.notes,
            "goals": [asdict(g) for g in self.goals],
            "goal_lines": self.goal_lines(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> SuiteResult:
        """Inverse of :meth:`to_dict` (the machine and derived ratios are dropped)."""
        fields = {f for f in Measurement.__dataclass_fields__}
        rows = [Measurement(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]]
        return cls(
            name=data["suite"],
            title=data["title"],
            reference=data["reference"],
            rows=rows,
            notes=list(data.get("notes", [])),
            goals=[Goal(**g) for g in data.get("goals", [])],
            processes=int(data.get("processes", 1)),
        )


_HEAP = {"kept": False}


def keep_heap() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (for this process).

    By default glibc serves large blocks with ``mmap`` and trims the heap top, so a model that
    allocates and frees big activations faults fresh pages in on every forward; how much depends
    on the allocation history of everything in the process. Raising ``M_MMAP_THRESHOLD`` and
    ``M_TRIM_THRESHOLD`` (what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do at start-up)
    removes that cost for every implementation alike. Returns False where there is no glibc.
    """
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 1 << 31) == 1
    _HEAP["kept"] = _HEAP["kept"] or ok
    return ok


def machine() -> dict[str, str | int | bool]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "heap_kept": _HEAP["kept"],
    }


def machine_line() -> str:
    m = machine()
    heap = ", heap kept (glibc trimming off)" if m["heap_kept"] else ""
    return f"[{m['platform']}, torch {m['torch']}, {m['threads']} threads, cuda: {m['cuda']}{heap}]"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing, e.g. Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on the platforms CI runs
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def compare(
    case: str,
    impls: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 2,
    repeat: int = 10,
) -> list[Measurement]:
    """Time each callable of ``impls`` on one case, interleaved: ``repeat`` rounds of one call each.

    Each measurement's ``extra["page_faults"]`` is the mean number of minor page faults per call:
    memory the C allocator gave back to the OS and touched again, a cost on the CPU that depends
    on the allocation history of the whole process, not only on the implementation.
    """
    for fn in impls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in impls}
    faults: dict[str, int] = dict.fromkeys(impls, 0)
    for _ in range(repeat):
        for name, fn in impls.items():
            _sync()
            f0 = _minor_faults()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
            faults[name] += _minor_faults() - f0
    return [
        Measurement(case, name, statistics.median(t), min(t), repeat, {"page_faults": faults[name] / repeat})
        for name, t in times.items()
    ]


def _torch_benchmark() -> ModuleType:
    """``torch.utils.benchmark``, imported on first use. Its import loads ``torch.utils.cpp_extension``,
    which warns about ``CUDA_HOME`` on a CUDA build without a GPU; the harness compiles nothing, so that
    one logger is muted for the import."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.benchmark as benchmark
    finally:
        log.setLevel(level)
    return benchmark


def timed_rounds(
    case: str,
    impls: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 5,
    min_run_time: float = 0.5,
    warmup: int = 1,
    quick: bool = False,
) -> list[Measurement]:
    """Time each callable of ``impls`` on one case with ``torch.utils.benchmark``, interleaved.

    After ``warmup`` calls of each, ``rounds`` rounds run ``Timer.blocked_autorange(min_run_time=...)``
    once per implementation, in order (torch's timer sizes the block with untimed calls first, keeps
    torch's thread count and synchronizes an accelerator); ``Measurement.merge`` pools an
    implementation's blocks. ``ms`` is the median and ``ms_min`` the best per-call time over the
    blocks, ``repeats`` the number of timed blocks, ``extra["page_faults"]`` the mean minor page faults
    per call, the untimed ones included (see :func:`compare`). ``quick`` (a smoke run): 2 rounds of one
    block each.
    """
    if quick:
        rounds, min_run_time = 2, 0.0
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if min_run_time < 0:
        raise ValueError(f"min_run_time must be >= 0 seconds, got {min_run_time}")
    benchmark = _torch_benchmark()
    calls = dict.fromkeys(impls, 0)

    def counted(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            calls[name] += 1
            fn()

        return call

    threads = torch.get_num_threads()
    timers = {
        name: benchmark.Timer(
            "fn()", globals={"fn": counted(name, fn)}, label=case, description=name, num_threads=threads
        )
        for name, fn in impls.items()
    }
    for fn in impls.values():
        for _ in range(warmup):
            fn()
    blocks: dict[str, list[Any]] = {name: [] for name in impls}
    faults = dict.fromkeys(impls, 0)
    for _ in range(rounds):
        for name, timer in timers.items():
            f0 = _minor_faults()
            blocks[name].append(timer.blocked_autorange(min_run_time=min_run_time))
            faults[name] += _minor_faults() - f0
    out = []
    for name, measured in blocks.items():
        (merged,) = benchmark.Measurement.merge(measured)
        times, per_call = merged.times, {"page_faults": faults[name] / max(calls[name], 1)}
        out.append(Measurement(case, name, merged.median * 1e3, min(times) * 1e3, len(times), per_call))
    return out


KEEP_HEAP_HELP = "keep freed memory in the heap (glibc): no page-fault noise from the allocator"
PROCESSES_HELP = (
    "run each suite in N fresh processes, one after another, and report min / median / max of the "
    "per-process ratios (default 1: this process)"
)

SuiteFn = Callable[[bool], SuiteResult]
_SUITES: dict[str, tuple[SuiteFn, str]] = {}
_SPREAD_SUITES: set[str] = set()  # timing suites whose results several processes can combine


def register_suite(name: str, help: str, *, multiprocess: bool = False) -> Callable[[SuiteFn], SuiteFn]:
    """Decorator: make ``fn(quick) -> SuiteResult`` available as ``vitattn bench NAME``.

    ``multiprocess``: the suite returns a plain timing :class:`SuiteResult`, which
    :func:`run_suites` with ``processes > 1`` can combine across fresh processes.
    """

    def deco(fn: SuiteFn) -> SuiteFn:
        _SUITES[name] = (fn, help)
        if multiprocess:
            _SPREAD_SUITES.add(name)
        else:
            _SPREAD_SUITES.discard(name)
        return fn

    return deco


def suites() -> dict[str, str]:
    """Registered suite names and their one-line descriptions."""
    return {name: help for name, (_, help) in _SUITES.items()}


def combine_processes(results: Sequence[SuiteResult]) -> SuiteResult:
    """One suite's results from several processes as one result: per row, ``process_ms`` lists each
    process's median, ``ms`` is their median, ``ms_min`` the best call of all; notes are the first
    process's, goals are judged on every process."""
    if not results:
        raise ValueError("combine_processes needs at least one result")
    first = results[0]
    keys = [(r.case, r.impl) for r in first.rows]
    for other in results[1:]:
        if other.name != first.name or [(r.case, r.impl) for r in other.rows] != keys:
            raise ValueError(f"results of suite {other.name!r} do not have the rows of suite {first.name!r}")
    rows = []
    for i, r in enumerate(first.rows):
        same = [res.rows[i] for res in results]
        per = [x for m in same for x in m.per_process_ms()]
        extra = {
            k: statistics.median(m.extra[k] for m in same) for k in r.extra if all(k in m.extra for m in same)
        }
        rows.append(
            Measurement(
                r.case, r.impl, statistics.median(per), min(m.ms_min for m in same), r.repeats, extra, per
            )
        )
    return SuiteResult(
        first.name,
        first.title,
        first.reference,
        rows,
        list(first.notes),
        list(first.goals),
        processes=sum(res.processes for res in results),
    )


def _child_command(
    name: str, json_path: Path, *, quick: bool, threads: int | None, keep_heap: bool, imports: Sequence[str]
) -> list[str]:
    """``python -m vitattn bench NAME --json PATH ...`` (via ``-c`` when modules must be imported first)."""
    args = ["bench", name, "--json", str(json_path)]
    args += ["--quick"] if quick else []
    args += ["--threads", str(threads)] if threads is not None else []
    args += ["--keep-heap"] if keep_heap else []
    if not imports:
        return [sys.executable, "-m", "vitattn", *args]
    code = (
        "import importlib, sys\n"
        f"for m in {list(imports)!r}: importlib.import_module(m)\n"
        "from vitattn.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code, *args]


def run_processes(
    name: str,
    processes: int,
    *,
    quick: bool = False,
    threads: int | None = None,
    keep_heap: bool = False,
    imports: Sequence[str] = (),
) -> SuiteResult:
    """Run suite ``name`` in ``processes`` fresh processes, one after another, and combine them.

    Each child is ``sys.executable -m vitattn bench NAME --json ...`` with the same options; its
    table goes to this process's stdout only when it fails (with its stderr, in the error).
    """
    if name not in _SPREAD_SUITES:
        raise ValueError(
            f"benchmark suite {name!r} cannot be combined across processes (only timing suites: "
            f"{sorted(_SPREAD_SUITES)})"
        )
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    results = []
    with tempfile.TemporaryDirectory(prefix="vitattn-bench-") as tmp:
        for i in range(processes):
            path = Path(tmp) / f"{name}-{i}.json"
            cmd = _child_command(
                name, path, quick=quick, threads=threads, keep_heap=keep_heap, imports=imports
            )
            done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            if done.returncode != 0:
                raise RuntimeError(
                    f"vitattn bench {name}: process {i + 1}/{processes} exited with {done.returncode}:\n"
                    f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
                )
            (data,) = json.loads(path.read_text())
            results.append(SuiteResult.from_dict(data))
            print(f"[{name}: process {i + 1}/{processes} done]", flush=True)
    return combine_processes(results)


def run_suites(
    names: Iterable[str],
    *,
    quick: bool = False,
    json_path: str | Path | None = None,
    processes: int = 1,
    threads: int | None = None,
    keep_heap: bool = False,
    imports: Sequence[str] = (),
) -> list[SuiteResult]:
    """Run suites by name, print their tables, and optionally write all results as JSON.

    ``processes > 1`` runs each suite in that many fresh processes (:func:`run_processes`, which
    passes ``threads``, ``keep_heap`` and ``imports`` on); with 1 the suites run here, in this
    process, whose threads and heap the caller has set.
    """
    results = []
    names = list(names)
    for name in names:
        if name not in _SUITES:
            raise ValueError(f"unknown benchmark suite {name!r}; known: {sorted(_SUITES)}")
    for name in names:
        if processes > 1:
            result = run_processes(
                name, processes, quick=quick, threads=threads, keep_heap=keep_heap, imports=imports
            )
        else:
            result = _SUITES[name][0](quick)
        print(result.render(), end="\n\n", flush=True)
        results.append(result)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    return results


def script_main(suite: str, default_json: str, argv: Sequence[str] | None = None) -> None:
    """Entry point of a ``benchmarks/`` script: ``vitattn bench SUITE`` that also saves its JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=f"vitattn bench {suite}, saving JSON results")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default=default_json, help=f"JSON file (default {default_json})")
    parser.add_argument("--keep-heap", action="store_true", help=KEEP_HEAP_HELP)
    parser.add_argument("--processes", type=int, default=1, help=PROCESSES_HELP)
    args = parser.parse_args(argv)
    if args.processes > 1:
        run_suites(
            [suite],
            quick=args.quick,
            json_path=args.out,
            processes=args.processes,
            threads=args.threads,
            keep_heap=args.keep_heap,
        )
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.keep_heap and not keep_heap():
        print("--keep-heap: no glibc here, the allocator is left as it is", flush=True)
    run_suites([suite], quick=args.quick, json_path=args.out)
