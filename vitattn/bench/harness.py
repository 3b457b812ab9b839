"""Side-by-side timing: every implementation of a case runs in the same process, interleaved in
rounds so that drift (thermal, other load) hits all of them alike, and results print as ratios."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Measurement:
    """One implementation on one case: median and best milliseconds per call."""

    case: str
    impl: str
    ms: float
    ms_min: float
    repeats: int
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class SuiteResult:
    """All measurements of a suite, with the implementation the ratios are relative to."""

    name: str
    title: str
    reference: str
    rows: list[Measurement]
    notes: list[str] = field(default_factory=list)

    def ratio(self, row: Measurement) -> float:
        """``row.ms / reference.ms`` within the same case."""
        ref = next(r for r in self.rows if r.case == row.case and r.impl == self.reference)
        return row.ms / ref.ms

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
        head += "  faults/call" if faults else ""
        lines = [self.title, machine_line(), head, "-" * len(head)]
        last_case = None
        for r in self.rows:
            case = r.case if r.case != last_case else ""
            last_case = r.case
            line = (
                f"{case:<{case_w}}  {r.impl:<{impl_w}}  {r.ms:>10.2f}  {r.ms_min:>9.2f}  "
                f"{self.ratio(r):>{ratio_w - 1}.2f}×"
            )
            if faults:
                line += f"  {r.extra.get('page_faults', float('nan')):>11.0f}"
            lines.append(line)
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        rows = [dict(asdict(r), ratio=self.ratio(r)) for r in self.rows]
        return {
            "suite": self.name,
            "title": self.title,
            "reference": self.reference,
            "machine": machine(),
            "rows": rows,
            "notes": self.notes,
        }


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
    impls: dict[str, Callable[[], object]],
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


KEEP_HEAP_HELP = "keep freed memory in the heap (glibc): no page-fault noise from the allocator"

SuiteFn = Callable[[bool], SuiteResult]
_SUITES: dict[str, tuple[SuiteFn, str]] = {}


def register_suite(name: str, help: str) -> Callable[[SuiteFn], SuiteFn]:
    """Decorator: make ``fn(quick) -> SuiteResult`` available as ``vitattn bench NAME``."""

    def deco(fn: SuiteFn) -> SuiteFn:
        _SUITES[name] = (fn, help)
        return fn

    return deco


def suites() -> dict[str, str]:
    """Registered suite names and their one-line descriptions."""
    return {name: help for name, (_, help) in _SUITES.items()}


def run_suites(
    names: Iterable[str], *, quick: bool = False, json_path: str | Path | None = None
) -> list[SuiteResult]:
    """Run suites by name, print their tables, and optionally write all results as JSON."""
    results = []
    for name in names:
        if name not in _SUITES:
            raise ValueError(f"unknown benchmark suite {name!r}; known: {sorted(_SUITES)}")
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
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.keep_heap and not keep_heap():
        print("--keep-heap: no glibc here, the allocator is left as it is", flush=True)
    run_suites([suite], quick=args.quick, json_path=args.out)
