"""Compile, before anything is timed, every Triton kernel the GPU check will launch, on all CPU cores.

Usage: python benchmarks/warm_kernels.py [--jobs N] [--out warm.json] [--dry-run]

The GPU check's steps (``tests/test_kernels_gpu.py``, ``benchmarks/memcheck_kernels.py``, the
``vitattn.bench.kernels`` cases) each list their launches (``warm_calls``, ``CASES``, ``warm_specs``);
this script runs every one of them in a pool of worker processes with ``VITATTN_TRITON_COMPILE_ONLY=1``:
each launch compiles, with the very arguments the step will pass, the tiles it would run (every
candidate where the autotuner would time them) into ``TRITON_CACHE_DIR``, and launches nothing. The
steps then find every kernel in the cache. The peers that compile on first use are warmed the same way
(``peer_warm_specs``: FlexAttention's ``torch.compile`` into the shared ``TORCHINDUCTOR_CACHE_DIR``,
AdaSplash's Triton JIT into ``TRITON_CACHE_DIR``, run once at each benchmark shape); a peer that cannot
run here (not installed, CUDA-only in the dry run) is recorded as ``skipped`` with its reason. They are
listed first: the longest compiles start first. A job's own error (its outputs are uninitialized, so a
comparison may fail) is recorded and ignored; a compile error is reported (``compile_errors``).
``--dry-run`` lists the same jobs and runs the CPU ones (interpreter: nothing to compile).
The JSON (rewritten as jobs finish): each job's name, seconds, status and error; the kernels in the
cache; the workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMPILE_ERRORS = ("CompilationError", "PTXASError", "OutOfResources", "CompileTimeAssertionFailure")


def jobs(dry: bool) -> list[dict[str, Any]]:
    """Every launch of the GPU check as a job: ``{"name", "kind", "args", "env"}`` (picklable)."""
    from vitattn.bench.kernels import peer_warm_specs, warm_specs

    out: list[dict[str, Any]] = [
        {"name": "peer " + " ".join(spec), "kind": "peer", "args": [*spec, dry], "env": {}}
        for spec in peer_warm_specs()
    ]
    if not dry:
        sys.path.insert(0, str(ROOT))
        from tests.test_kernels_gpu import warm_calls

        out += [
            {"name": name, "kind": "tests", "args": [i], "env": env}
            for i, (name, env, _call) in enumerate(warm_calls())
        ]
    from memcheck_kernels import CASES, DRY_CASES

    first = {"VITATTN_TRITON_TILES": "first"}
    for case in DRY_CASES if dry else CASES:
        out.append(
            {
                "name": "memcheck " + " ".join(map(str, case)),
                "kind": "memcheck",
                "args": list(case),
                "env": first,
            }
        )
    for spec in warm_specs():
        out.append({"name": "bench " + " ".join(spec), "kind": "bench", "args": [*spec, dry], "env": {}})
    return out


def run_job(job: dict[str, Any], dry: bool) -> dict[str, Any]:
    """Run one job in this worker under ``VITATTN_TRITON_COMPILE_ONLY=1`` and its environment."""
    os.environ["VITATTN_TRITON_COMPILE_ONLY"] = "1"
    os.environ.pop("VITATTN_TRITON_TILES", None)
    os.environ.update({k: v for k, v in job["env"].items() if v})
    t0 = time.time()
    record = {"name": job["name"], "status": "ok", "error": ""}
    try:
        if job["kind"] == "tests":
            sys.path.insert(0, str(ROOT))
            from tests.test_kernels_gpu import warm_calls

            warm_calls()[job["args"][0]][2]()
        elif job["kind"] == "memcheck":
            import torch
            from memcheck_kernels import run_case

            dev, dt = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
            normalizer, kind, d = job["args"]
            # compile only: no kernel runs, so the gradients are unwritten memory (not checked)
            if dry:
                run_case(normalizer, kind, d, dev, dt, n=17, b=1, h=1, check_finite=False)
            else:
                run_case(normalizer, kind, d, dev, dt, check_finite=False)
        elif job["kind"] == "peer":
            from vitattn.bench.kernels import warm_peer

            reason = warm_peer(*job["args"])
            if reason is not None:
                record.update(status="skipped", error=reason)
        else:
            from vitattn.bench.kernels import warm_one

            warm_one(*job["args"])
    except Exception as exc:  # noqa: BLE001  (uninitialized outputs may fail a check: not a compile error)
        name = type(exc).__name__
        compile_error = name in COMPILE_ERRORS or "ptxas" in str(exc).lower()
        record["status"] = "compile_error" if compile_error else "ran_with_error"
        record["error"] = f"{name}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        if compile_error:
            record["traceback"] = traceback.format_exc()[-2000:]
    record["seconds"] = round(time.time() - t0, 2)
    return record


def _cached_kernels() -> int:
    folder = os.environ.get("TRITON_CACHE_DIR")
    if not folder or not os.path.isdir(folder):
        return 0
    return sum(1 for _root, _dirs, files in os.walk(folder) for f in files if f.endswith(".cubin"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--out", help="JSON file (rewritten as jobs finish)")
    parser.add_argument("--dry-run", action="store_true", help="CPU jobs only (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    start = time.time()
    todo = jobs(args.dry_run)
    before = _cached_kernels()
    records: list[dict[str, Any]] = []
    workers = max(1, min(args.jobs, len(todo)))

    def save() -> None:
        if not args.out:
            return
        counts: dict[str, int] = {}
        for r in records:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        payload = {
            "dry_run": args.dry_run,
            "workers": workers,
            "jobs_total": len(todo),
            "counts": counts,
            "compile_errors": [r["name"] for r in records if r["status"] == "compile_error"],
            "kernels_in_cache": _cached_kernels(),
            "kernels_in_cache_before": before,
            "seconds": round(time.time() - start, 1),
            "jobs": records,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")

    cache = os.environ.get("TRITON_CACHE_DIR", "(default)")
    print(f"warm: {len(todo)} jobs on {workers} workers into {cache}", flush=True)
    ctx = get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = [pool.submit(run_job, job, args.dry_run) for job in todo]
        for fut in as_completed(futures):
            rec = fut.result()
            records.append(rec)
            line = f"  {rec['status']:<15} {rec['seconds']:>6.1f}s {rec['name']} {rec['error'][:100]}"
            print(line, flush=True)
            save()
    save()
    bad = [r for r in records if r["status"] == "compile_error"]
    print(
        f"warm: {len(records)} jobs in {time.time() - start:.0f}s, {_cached_kernels() - before} kernels "
        f"compiled, {len(bad)} compile errors",
        flush=True,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
