"""The JSON side of ``benchmarks/gpu_check.sh``: the environment step, each step's record, the goals.

Usage (the shell script calls these; stdlib only, except ``env`` which imports torch):

    python benchmarks/gpu_report.py env --json OUT/env.json [--peers DIR] [--sanitizer PATH]
    python benchmarks/gpu_report.py find-sanitizer
    python benchmarks/gpu_report.py finish NAME --json OUT/NAME.json --kind pytest|memcheck|bench|env \
        [--rc N --seconds S --limit S --log FILE] [--skipped REASON] [--sanitizer PATH] [--note TEXT]
    python benchmarks/gpu_report.py summary OUT [--dry-run]

``finish`` makes sure the step's JSON exists (a step killed before it wrote anything gets a record with
its exit status and the tail of its log) and adds a ``step`` object: name, status (ok, failed,
timeout, skipped), rc, seconds, limit, log tail. ``summary`` reads every step's JSON, prints the goals
of issue #13 item 6 as pass / fail / unknown and writes ``summary.json``; its exit status is 1 if the
GPU tests or the memcheck failed (the speed and memory goals are reported, not enforced).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

LOG_TAIL = 40  # lines of a step's log kept in its JSON
FLASH_FRACTION = 0.85  # Gaussian softmax fwd+bwd >= 0.85x SDPA flash throughput at N 4096
ENTMAX_VS_FLASH = 1.5  # entmax-1.5 fwd+bwd within 1.5x of SDPA flash at N 4096 and 16384
LINEAR_MEMORY = 1.5  # peak(n16384) / peak(n4096) at equal B * N: 1 if linear in N, 4 if quadratic
STEP_FILES = (
    "env",
    "tests",
    "memcheck",
    "bench_n4096",
    "bench_n16384",
    "bench_sparse",
    "bench_vit_b",
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


def goals(out: Path) -> list[dict[str, Any]]:
    """The goals of the GPU run (issue #13 item 6), each pass / fail / unknown (data missing)."""
    rows, ref = _rows(out)

    def ms(case: str, impl: str, mode: str = "fwd+bwd") -> float | None:
        row = rows.get((case, mode, impl))
        return None if row is None else float(row["ms"])

    result = []
    ours, flash = ms("n4096", "gaussian vitattn"), ms("n4096", str(ref))
    flex, dense = ms("n4096", "gaussian flex"), ms("n4096", "gaussian dense_sdpa")
    ok = None if ours is None or flash is None else flash / ours >= FLASH_FRACTION
    detail = "missing rows" if ok is None else f"throughput {flash / ours:.2f}x {ref}"
    result.append(
        _goal(
            "gaussian_vs_flash",
            f"Gaussian softmax fwd+bwd >= {FLASH_FRACTION}x {ref} throughput, N 4096",
            ok,
            detail,
        )
    )
    ok = None if ours is None or flex is None or dense is None else ours < flex and ours < dense
    detail = "missing rows" if ok is None else f"ms: vitattn {ours:.3f}, flex {flex:.3f}, dense {dense:.3f}"
    result.append(
        _goal(
            "gaussian_ahead",
            "Gaussian softmax fwd+bwd ahead of FlexAttention and the dense-bias path, N 4096",
            ok,
            detail,
        )
    )
    for case in ("n4096", "n16384"):
        ent, ada, fl = ms(case, "entmax15 vitattn"), ms(case, "entmax15 adasplash"), ms(case, str(ref))
        ok = None if ent is None or ada is None else ent < ada
        detail = "missing rows" if ok is None else f"ms: vitattn {ent:.3f}, adasplash {ada:.3f}"
        result.append(
            _goal(
                f"entmax_vs_adasplash_{case}", f"entmax-1.5 fwd+bwd faster than AdaSplash, {case}", ok, detail
            )
        )
        ok = None if ent is None or fl is None else ent <= ENTMAX_VS_FLASH * fl
        detail = "missing rows" if ok is None else f"{ent / fl:.2f}x the ms of {ref}"
        result.append(
            _goal(
                f"entmax_vs_flash_{case}",
                f"entmax-1.5 fwd+bwd within {ENTMAX_VS_FLASH}x of {ref}, {case}",
                ok,
                detail,
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
    san = _read(out / "memcheck.json").get("sanitizer", {})
    errors = san.get("errors")
    ok = None if errors is None or san.get("unsupported") else errors == 0
    detail = (
        "sanitizer refused the device"
        if san.get("unsupported")
        else "no sanitizer run"
        if errors is None
        else f"{errors} errors"
    )
    result.append(_goal("sanitizer_clean", "0 compute-sanitizer memcheck errors", ok, detail))
    return result


def checks(out: Path) -> list[dict[str, Any]]:
    """Correctness steps (the script's exit status): the GPU tests and the memcheck cases."""
    tests = _read(out / "tests.json")
    counts = tests.get("pytest", {}).get("counts", {})
    failed = tests.get("pytest", {}).get("failed", [])
    status = tests.get("step", {}).get("status")
    ok = (
        None
        if not counts.get("passed") and not failed and status != "failed"
        else not failed and status == "ok"
    )
    out_checks = [_goal("gpu_tests", "tests/test_kernels_gpu.py passes", ok, f"{counts}, step {status}")]
    mem = _read(out / "memcheck.json")
    cases = mem.get("cases", [])
    bad = [f"{c['normalizer']} {c['kind']}" for c in cases if not c.get("ok")]
    san_errors = mem.get("sanitizer", {}).get("errors")
    # a sanitizer that refuses the device (gVisor) breaks the program it runs: no verdict on the cases
    ok = None if not cases or mem.get("sanitizer", {}).get("unsupported") else not bad and not san_errors
    out_checks.append(
        _goal(
            "memcheck_cases",
            "every memcheck case runs (and the sanitizer reports 0 errors)",
            ok,
            f"{len(cases)} cases, failed: {bad}, sanitizer errors: {san_errors}",
        )
    )
    return out_checks


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
    sparse = [c for c in _read(out / "bench_sparse.json").get("cases", [])]
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
    p.add_argument("--kind", choices=["env", "pytest", "memcheck", "bench"], required=True)
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
    args = parser.parse_args(argv)
    if args.cmd == "find-sanitizer":
        exe = find_sanitizer()
        print(exe or "")
        return 0 if exe else 1
    return {"env": env, "finish": finish, "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
