"""The JSON side of ``benchmarks/gpu_check.sh``: the environment step, each step's record, the goals.

Usage (the shell script calls these; stdlib only, except ``env`` which imports torch):

    python benchmarks/gpu_report.py env --json OUT/env.json [--peers DIR] [--sanitizer PATH]
    python benchmarks/gpu_report.py find-sanitizer
    python benchmarks/gpu_report.py finish NAME --json OUT/NAME.json --kind env|warm|pytest|memcheck|bench \
        [--rc N --seconds S --limit S --log FILE] [--skipped REASON] [--sanitizer PATH] [--note TEXT]
    python benchmarks/gpu_report.py summary OUT [--dry-run]
    python benchmarks/gpu_report.py runs RUN_DIR [RUN_DIR ...] [--json FILE]

``finish`` makes sure the step's JSON exists (a step killed before it wrote anything gets a record with
its exit status and the tail of its log) and adds a ``step`` object: name, status (ok, failed,
timeout, skipped), rc, seconds, limit, log tail. ``summary`` reads every step's JSON, prints the checks
(:func:`checks`) and the goals (:func:`goals`) as pass / fail / unknown and writes ``summary.json``;
its exit status is 1 if a check failed (the speed and memory goals are reported, not enforced).
``runs`` reads the bench JSON of several runs (each directory one run, each bench file one fresh
process) and prints, per row, its ratio to the reference in each run with the min / median / max over
the runs, and per goal how many runs pass it: a ratio counts only where it holds in every process.

The verdict rules, each tested on recorded step outcomes (``tests/test_gpu_check.py``):

- A step that did not finish (timeout, skipped, missing) gives *unknown* for what it did not show; it
  can still *fail* on what it did show (a failed test, a memcheck error, a compile error, a wrong kernel).
- Each speed row carries its gate (``vitattn.bench.kernels``): its forward and gradient errors against
  the reference backend in the same run. A goal whose vitattn row is wrong *fails*; a goal whose peer
  row is wrong, not ranked (fewer gradients than its family, e.g. FlexAttention falling back to q, k,
  v) or missing is *unknown*.
- The Gaussian goal is reported against unbiased SDPA flash and against the same bias materialized
  (dense bias + SDPA), and FlexAttention; at n4096 also for the kernels alone (the CUDA-graph row), so
  that a run says whether a miss is the kernels' or the host's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import sys
import sysconfig
from pathlib import Path
from typing import Any

LOG_TAIL = 40  # lines of a step's log kept in its JSON
FLASH_FRACTION = 0.95  # Gaussian softmax fwd+bwd >= 0.95x unbiased SDPA flash throughput
ENTMAX_VS_FLASH = 1.3  # entmax-1.5 fwd+bwd within 1.3x of SDPA flash
ENTMAX_VS_ADASPLASH = 2.0  # entmax-1.5 fwd+bwd at least 2x AdaSplash's throughput
LINEAR_MEMORY = 1.5  # peak(n16384) / peak(n4096) at equal B * N: 1 if linear in N, 4 if quadratic
GOAL_CASES = ("n4096", "n16384")
GRAPH_CASES = ("n4096",)  # the goal cases with CUDA-graph rows (bench_kernels: up to 2^30 scores)
STEP_FILES = (
    "env",
    "warm",
    "tests",
    "memcheck",
    "bench_n4096",
    "bench_n16384",
    "bench_extra",
    "summary",
)


# ---- compute-sanitizer ---------------------------------------------------------------------------------


def find_sanitizer(roots: list[str] | None = None, sites: list[str] | None = None) -> str | None:
    """``compute-sanitizer`` on PATH, else in a CUDA toolkit (``roots``: $CUDA_HOME, $CUDA_PATH,
    /usr/local/cuda*), else in pip's nvidia packages under ``sites`` (default: site-packages;
    ``nvidia-cuda-sanitizer-api-cu12`` installs ``nvidia/cuda_sanitizer_api/bin/compute-sanitizer``)."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    if roots is None:
        roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
        roots += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    if sites is None:
        sites = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    folders = [os.path.join(r, sub) for r in roots if r for sub in ("bin", "compute-sanitizer")]
    for site in sites:
        folders += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin")))
        folders += sorted(glob.glob(os.path.join(site, "nvidia", "*", "compute-sanitizer")))
    for folder in folders:
        exe = os.path.join(folder, "compute-sanitizer")
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return exe
    return None


# ---- steps ---------------------------------------------------------------------------------------------


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {"data": data}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _tail(log: str | None) -> list[str]:
    if not log or not os.path.exists(log):
        return []
    with open(log, errors="replace") as f:
        return [line.rstrip("\n")[:300] for line in f.readlines()[-LOG_TAIL:]]


_PYTEST_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_pytest(log: str | None) -> dict[str, Any]:
    """Per-test outcomes from ``pytest -v`` output (as far as it got)."""
    outcomes: dict[str, str] = {}
    if log and os.path.exists(log):
        with open(log, errors="replace") as f:
            for line in f:
                m = _PYTEST_LINE.match(line.strip())
                if m:
                    outcomes[m.group(1)] = m.group(2).lower()
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    failed = sorted(t for t, o in outcomes.items() if o in ("failed", "error"))
    return {"counts": counts, "failed": failed, "tests": outcomes}


def parse_sanitizer(log: str | None) -> dict[str, Any]:
    """compute-sanitizer's verdict from its output: errors reported, or that it refused the device."""
    text = ""
    if log and os.path.exists(log):
        with open(log, errors="replace") as f:
            text = f.read()
    summary = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    return {
        "errors": int(summary[-1]) if summary else None,
        "unsupported": "Device not supported" in text,
    }


def finish(args: argparse.Namespace) -> int:
    path = Path(args.json)
    data = _read(path)
    if args.skipped:
        status = "skipped"
    elif args.rc in (124, 137):
        status = "timeout"
    else:
        status = "ok" if args.rc == 0 else "failed"
    data["step"] = {
        "name": args.name,
        "status": status,
        "rc": args.rc,
        "seconds": args.seconds,
        "limit_s": args.limit,
        "reason": args.skipped or "",
        "note": args.note or "",
        "log_tail": _tail(args.log),
    }
    if args.kind == "pytest":
        data["pytest"] = parse_pytest(args.log)
    if args.kind == "memcheck":
        san = parse_sanitizer(args.log) if args.sanitizer else {"errors": None, "unsupported": False}
        data["sanitizer"] = {"path": args.sanitizer or None, **san}
        data.setdefault("cases", [])
    if args.kind == "bench":
        data.setdefault("cases", [])
    if args.kind == "warm":
        data.setdefault("jobs", [])
    _write(path, data)
    print(
        f"--- {args.name}: {status}"
        + (f" ({args.skipped})" if args.skipped else f", rc {args.rc}, {args.seconds}s")
    )
    return 0


def env(args: argparse.Namespace) -> int:
    """Versions, the device, the peers found and the sanitizer, as ``env.json``."""
    import subprocess

    data: dict[str, Any] = {"python": sys.version.split()[0], "sanitizer": args.sanitizer or None}
    try:
        import torch

        data["torch"] = torch.__version__
        data["cuda_available"] = torch.cuda.is_available()
        data["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        data["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        from torch.nn.attention import SDPBackend

        data["sdpa_backends"] = sorted(n for n in dir(SDPBackend) if n.isupper())
    except Exception as exc:  # noqa: BLE001
        data["torch_error"] = f"{type(exc).__name__}: {exc}"
    for name in ("triton", "entmax", "adasplash"):
        try:
            mod = __import__(name)
            data[name] = getattr(mod, "__version__", "?") + f" ({Path(mod.__file__ or '').parent})"
        except Exception as exc:  # noqa: BLE001
            data[name] = None
            data[f"{name}_missing"] = f"{type(exc).__name__}: {exc}"
    if shutil.which("nvidia-smi"):
        q = "--query-gpu=name,memory.total,driver_version,clocks.max.sm"
        res = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True)
        data["nvidia_smi"] = (res.stdout or res.stderr).strip()
    data["peers_dir"] = args.peers or None
    _write(Path(args.json), data)
    for key in (
        "python",
        "torch",
        "triton",
        "device",
        "cudnn",
        "entmax",
        "adasplash",
        "sanitizer",
        "nvidia_smi",
    ):
        print(f"{key:<10} {data.get(key)}")
    return 0


# ---- goals ---------------------------------------------------------------------------------------------


def _rows(out: Path) -> tuple[dict[tuple[str, str, str], dict[str, Any]], str | None]:
    """``(case, mode, impl) -> row`` over every bench JSON, and the reference implementation."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    reference = None
    for path in sorted(out.glob("bench_*.json")):
        for case in _read(path).get("cases", []):
            reference = case.get("reference", reference)
            for row in case.get("rows", []):
                mode = row["case"].rsplit(" ", 1)[-1]
                rows[(case["case"], mode, row["impl"])] = row
    return rows, reference


def _goal(name: str, text: str, ok: bool | None, detail: str) -> dict[str, Any]:
    return {
        "goal": name,
        "text": text,
        "status": {True: "pass", False: "fail", None: "unknown"}[ok],
        "detail": detail,
    }


def _gate(row: dict[str, Any] | None) -> str:
    """``ok``, or why a row cannot be compared: ``missing``, ``wrong`` (its gate failed), ``unranked``,
    ``unchecked`` (no gate recorded)."""
    if row is None:
        return "missing"
    extra = row.get("extra", {})
    if "valid" not in extra:
        return "unchecked"
    if not extra["valid"]:
        return "wrong"
    if not extra.get("ranked", 1.0):
        return "unranked"
    return "ok"


def _errors(row: dict[str, Any]) -> str:
    extra = row.get("extra", {})
    rel, grad = extra.get("rel_err", float("nan")), extra.get("grad_err", float("nan"))
    return f"rel_err {rel:.2e}, grad_err {grad:.2e}"


def speed_goal(
    rows: dict[tuple[str, str, str], dict[str, Any]],
    name: str,
    text: str,
    case: str,
    ours: str,
    peer: str,
    ok: Any,
    describe: Any,
) -> dict[str, Any]:
    """A goal comparing the fwd+bwd rows ``ours`` and ``peer`` of ``case``: ``ok(ours_ms, peer_ms)`` when
    both pass their gates; fail when ours is wrong; unknown when a row is missing, unchecked, or the
    peer's is wrong or not ranked."""
    mine, theirs = rows.get((case, "fwd+bwd", ours)), rows.get((case, "fwd+bwd", peer))
    gate_mine, gate_theirs = _gate(mine), _gate(theirs)
    if gate_mine == "wrong":
        assert mine is not None
        return _goal(name, text, False, f"{ours} is wrong: {_errors(mine)}")
    if gate_mine != "ok" or gate_theirs != "ok":
        why = [f"{r} {g}" for r, g in ((ours, gate_mine), (peer, gate_theirs)) if g != "ok"]
        if gate_theirs == "wrong" and theirs is not None:
            why[-1] += f" ({_errors(theirs)})"
        return _goal(name, text, None, ", ".join(why))
    assert mine is not None and theirs is not None
    a, b = float(mine["ms"]), float(theirs["ms"])
    return _goal(name, text, bool(ok(a, b)), describe(a, b))


def goals(out: Path) -> list[dict[str, Any]]:
    """The goals of the GPU run (issue 23, item 6), each pass / fail / unknown (see the module docstring)."""
    rows, ref = _rows(out)
    ref = str(ref)
    result = []
    for case in GOAL_CASES:
        result.append(
            speed_goal(
                rows,
                f"gaussian_vs_flash_{case}",
                f"Gaussian softmax fwd+bwd >= {FLASH_FRACTION}x unbiased {ref} throughput, {case}",
                case,
                "gaussian vitattn",
                ref,
                lambda a, b: b / a >= FLASH_FRACTION,
                lambda a, b: f"throughput {b / a:.2f}x {ref} (ms: vitattn {a:.3f}, {ref} {b:.3f})",
            )
        )
        if case in GRAPH_CASES:  # the kernels alone: the same call replayed from a CUDA graph, no host work
            result.append(
                speed_goal(
                    rows,
                    f"gaussian_kernels_vs_flash_{case}",
                    f"Gaussian softmax fwd+bwd kernels alone (one CUDA-graph replay) >= {FLASH_FRACTION}x "
                    f"unbiased {ref} throughput, {case}",
                    case,
                    "gaussian vitattn graph",
                    ref,
                    lambda a, b: b / a >= FLASH_FRACTION,
                    lambda a, b: f"throughput {b / a:.2f}x {ref} (ms: vitattn graph {a:.3f}, {ref} {b:.3f})",
                )
            )
        for peer, label in (
            ("gaussian dense_sdpa", "the same bias materialized + SDPA"),
            ("gaussian flex", "FlexAttention"),
        ):
            result.append(
                speed_goal(
                    rows,
                    f"gaussian_vs_{peer.split()[1]}_{case}",
                    f"Gaussian softmax fwd+bwd ahead of {label}, {case}",
                    case,
                    "gaussian vitattn",
                    peer,
                    lambda a, b: a < b,
                    lambda a, b, p=peer: f"ms: vitattn {a:.3f}, {p} {b:.3f} ({b / a:.2f}x)",
                )
            )
        result.append(
            speed_goal(
                rows,
                f"entmax_vs_flash_{case}",
                f"entmax-1.5 fwd+bwd within {ENTMAX_VS_FLASH}x of {ref}, {case}",
                case,
                "entmax15 vitattn",
                ref,
                lambda a, b: a <= ENTMAX_VS_FLASH * b,
                lambda a, b: f"{a / b:.2f}x the ms of {ref}",
            )
        )
        result.append(
            speed_goal(
                rows,
                f"entmax_vs_adasplash_{case}",
                f"entmax-1.5 fwd+bwd >= {ENTMAX_VS_ADASPLASH}x AdaSplash's throughput, {case}",
                case,
                "entmax15 vitattn",
                "entmax15 adasplash",
                lambda a, b: b / a >= ENTMAX_VS_ADASPLASH,
                lambda a, b: f"{b / a:.2f}x (ms: vitattn {a:.3f}, adasplash {b:.3f})",
            )
        )
    ratios, missing = {}, []
    for (case, mode, impl), row in rows.items():
        if case != "n4096" or not impl.endswith("vitattn"):
            continue
        big = rows.get(("n16384", mode, impl))
        small_peak, big_peak = row["extra"].get("peak_mib"), (big or {}).get("extra", {}).get("peak_mib")
        if small_peak is None or big_peak is None:
            missing.append(f"{impl} {mode}")
        else:
            ratios[f"{impl} {mode}"] = big_peak / max(small_peak, 1e-9)
    ok = None if missing or not ratios else all(r <= LINEAR_MEMORY for r in ratios.values())
    detail = (
        ("missing peaks: " + ", ".join(missing))
        if ok is None
        else ", ".join(f"{k} {v:.2f}" for k, v in sorted(ratios.items()))
    )
    result.append(
        _goal(
            "memory_linear",
            f"peak memory linear in N (peak N16384 / N4096 at equal B*N <= "
            f"{LINEAR_MEMORY}) for every vitattn variant",
            ok,
            detail,
        )
    )
    mem = _read(out / "memcheck.json")
    san = mem.get("sanitizer", {})
    errors = san.get("errors")
    finished = mem.get("step", {}).get("status") == "ok"
    if san.get("unsupported"):
        ok, detail = None, "sanitizer refused the device"
    elif errors is None:
        ok, detail = None, "no sanitizer run"
    elif errors > 0:
        ok, detail = False, f"{errors} errors"
    else:
        ok = True if finished else None
        status = mem.get("step", {}).get("status")
        detail = "0 errors" if finished else f"0 errors before the step ended ({status})"
    result.append(_goal("sanitizer_clean", "0 compute-sanitizer memcheck errors", ok, detail))
    return result


def checks(out: Path) -> list[dict[str, Any]]:
    """Correctness steps (the script's exit status): every kernel compiles, the GPU tests, the memcheck
    cases. A step that did not finish is unknown unless what it showed already failed."""
    result = []
    warm = _read(out / "warm.json")
    status = warm.get("step", {}).get("status")
    errors = warm.get("compile_errors", [])
    counts = warm.get("counts", {})
    if errors:
        ok: bool | None = False
    else:
        ok = True if status == "ok" and warm.get("jobs") else None
    result.append(
        _goal(
            "warm_compiles",
            "every kernel the run launches compiles (warm step)",
            ok,
            f"{counts}, {len(errors)} compile errors {errors[:3]}, step {status}",
        )
    )

    tests = _read(out / "tests.json")
    counts = tests.get("pytest", {}).get("counts", {})
    failed = tests.get("pytest", {}).get("failed", [])
    status = tests.get("step", {}).get("status")
    if failed:
        ok = False
    elif status == "ok":
        ok = True if counts.get("passed") else None
    else:  # killed, skipped or missing: what ran passed, the rest is not known
        ok = None
    result.append(_goal("gpu_tests", "tests/test_kernels_gpu.py passes", ok, f"{counts}, step {status}"))

    mem = _read(out / "memcheck.json")
    cases = mem.get("cases", [])
    bad = [f"{c['normalizer']} {c['kind']}" for c in cases if not c.get("ok")]
    san_errors = mem.get("sanitizer", {}).get("errors")
    status = mem.get("step", {}).get("status")
    if mem.get("sanitizer", {}).get("unsupported"):
        # a sanitizer that refuses the device breaks the program it runs: no verdict on the cases
        ok = None
    elif bad or san_errors:
        ok = False
    elif status == "ok" and cases:
        ok = True
    else:  # killed part-way or never run: the cases it did not reach are not known
        ok = None
    result.append(
        _goal(
            "memcheck_cases",
            "every memcheck case runs (and the sanitizer reports 0 errors)",
            ok,
            f"{len(cases)} cases, failed: {bad}, sanitizer errors: {san_errors}, step {status}",
        )
    )
    return result


def summary(args: argparse.Namespace) -> int:
    out = Path(args.out)
    steps = {name: _read(out / f"{name}.json").get("step", {}) for name in STEP_FILES if name != "summary"}
    result = {
        "dry_run": args.dry_run,
        "goals": goals(out),
        "checks": checks(out),
        "steps": {
            k: {"status": v.get("status"), "seconds": v.get("seconds"), "reason": v.get("reason")}
            for k, v in steps.items()
        },
    }
    sparse = [c for c in _read(out / "bench_extra.json").get("cases", []) if c.get("case") == "sparse"]
    if sparse:
        result["sparsity"] = sparse[0].get("sparsity", {})
    files = sorted(p.name for p in out.iterdir() if p.is_file()) + ["summary.json"]
    result["files"] = sorted(set(files))
    _write(out / "summary.json", result)
    print("GPU check" + (" (dry run: CPU numbers, not measurements)" if args.dry_run else ""))
    for name, step in result["steps"].items():
        status, seconds = step["status"] or "missing", step["seconds"] or ""
        print(f"  step  {name:<14} {status:<8} {seconds:>5}s {step['reason'] or ''}")
    for g in result["checks"] + result["goals"]:
        print(f"  {g['status'].upper():<8} {g['text']}: {g['detail']}")
    return 1 if any(c["status"] == "fail" for c in result["checks"]) else 0


def _ratios(rows: dict[tuple[str, str, str], dict[str, Any]], ref: str | None) -> dict[str, float]:
    """``"case mode impl" -> ms / the reference's ms`` of one run, for the rows that pass their gate."""
    out: dict[str, float] = {}
    for (case, mode, impl), row in rows.items():
        base = rows.get((case, mode, str(ref)))
        if base is not None and _gate(row) == "ok":
            out[f"{case} {mode} {impl}"] = float(row["ms"]) / float(base["ms"])
    return out


def _picks(out: Path) -> dict[str, str]:
    """``tuning key -> tile`` of one run, over its bench JSON (``tuning``, written by bench_kernels.py)."""
    picks: dict[str, str] = {}
    for path in sorted(out.glob("bench_*.json")):
        for key, entry in (_read(path).get("tuning") or {}).items():
            picks[key] = str(entry.get("tile"))
    return picks


def differing_picks(per_run: list[dict[str, str]]) -> dict[str, list[str | None]]:
    """The tuning keys whose tile is not the same in every run that has them: key -> each run's tile."""
    keys = sorted({k for r in per_run for k in r})
    out: dict[str, list[str | None]] = {}
    for key in keys:
        tiles = [r.get(key) for r in per_run]
        if len({t for t in tiles if t is not None}) > 1:
            out[key] = tiles
    return out


def runs(args: argparse.Namespace) -> int:
    """Min / median / max of every ratio and each goal's pass count over several runs (one process each)."""
    dirs = [Path(d) for d in args.run_dirs]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise SystemExit(f"gpu_report.py runs: run_dirs must be directories; not found: {missing}")
    per_run = [_ratios(*_rows(d)) for d in dirs]
    keys = sorted({k for r in per_run for k in r})
    table: list[dict[str, Any]] = []
    for key in keys:
        values = [r[key] for r in per_run if key in r]
        table.append(
            {
                "row": key,
                "ratios": [r.get(key) for r in per_run],
                "min": min(values),
                "median": statistics.median(values),
                "max": max(values),
                "runs": len(values),
            }
        )
    verdicts: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    for d in dirs:
        for g in goals(d):
            verdicts.setdefault(g["goal"], []).append(g["status"])
            texts[g["goal"]] = g["text"]
    print(f"{len(dirs)} runs: " + ", ".join(str(d) for d in dirs))
    print(f"{'row (ratio = ms / reference ms)':<58} {'min':>6} {'median':>7} {'max':>6}  runs")
    for t in table:
        print(f"{t['row']:<58} {t['min']:>6.2f} {t['median']:>7.2f} {t['max']:>6.2f}  {t['runs']}")
    for name, statuses in verdicts.items():
        counted = [s for s in statuses if s != "unknown"]
        passed = sum(s == "pass" for s in counted)
        print(f"  goal {texts[name]}: {passed} of {len(counted)} runs pass ({', '.join(statuses)})")
    differ = differing_picks([_picks(d) for d in dirs])
    for key, tiles in differ.items():
        print(f"  tile differs between runs: {key}: " + ", ".join(str(t) for t in tiles))
    if args.json:
        _write(
            Path(args.json),
            {"runs": [str(d) for d in dirs], "ratios": table, "goals": verdicts, "differing_picks": differ},
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env")
    p.add_argument("--json", required=True)
    p.add_argument("--peers")
    p.add_argument("--sanitizer")
    sub.add_parser("find-sanitizer")
    p = sub.add_parser("finish")
    p.add_argument("name")
    p.add_argument("--json", required=True)
    p.add_argument("--kind", choices=["env", "warm", "pytest", "memcheck", "bench"], required=True)
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--log")
    p.add_argument("--skipped")
    p.add_argument("--sanitizer")
    p.add_argument("--note")
    p = sub.add_parser("summary")
    p.add_argument("out")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("runs")
    p.add_argument("run_dirs", nargs="+", help="one directory of bench_*.json per run (fresh process)")
    p.add_argument("--json", help="write the table and the goals' verdicts here")
    args = parser.parse_args(argv)
    if args.cmd == "find-sanitizer":
        exe = find_sanitizer()
        print(exe or "")
        return 0 if exe else 1
    return {"env": env, "finish": finish, "summary": summary, "runs": runs}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
