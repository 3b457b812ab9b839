"""The fused Triton kernels against their peers on one GPU, side by side in one process (bf16).

Usage: python benchmarks/bench_kernels.py [--case vit_b n4096 n16384 sparse] [--out results.json]
       [--rounds 5] [--seconds LIMIT [--started EPOCH]] [--host-case vit_b] [--dry-run]

The cases, implementations and measurements are :mod:`vitattn.bench.kernels` (``vitattn bench kernels``
runs all cases into one table); this script runs the named cases, prints each case's ratio table and
writes the JSON after every mode, so a run killed part-way keeps what it measured; with ``--seconds``
implementations not started by ``LIMIT - max(10 s, 10 %)`` are skipped (the others are still timed), and a
case not started by then is skipped whole; ``--started`` is when the limit began (seconds since the epoch,
default: when this script's ``main`` runs), so a caller's ``timeout`` and this deadline count the
interpreter's start-up alike. At the end, one line per kernel launch whose tile was timed in this process
(the pick and every candidate's time; the JSON's ``tuning`` holds every pick and how it was got).
``--host-case``: then the host time of vitattn's calls on that case's shape, and a profile of the
Gaussian fwd+bwd's (:mod:`vitattn.bench.host_device`; the JSON's ``host``), unless the deadline passed.
``--dry-run``: tiny shapes on the CPU in float32 (set ``TRITON_INTERPRET=1`` for the Triton rows),
CUDA-only peers skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vitattn.bench.host_device import host_lines, host_profile, host_times
from vitattn.bench.kernels import CASES, CaseResult, payload, run_cases, tuning_lines, tuning_log

HOST_CALLS = 50  # calls per host-time row and profiled calls (dry run, kernels stubbed: 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="benchmarks/results/kernels_gpu.json", help="JSON file")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; dry run 1)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (plumbing only)")
    parser.add_argument("--seconds", type=float, help="time limit: later implementations are skipped near it")
    parser.add_argument("--started", type=float, help="when --seconds began (time.time(); default: now)")
    parser.add_argument("--host-case", choices=list(CASES), help="then the host time of vitattn's calls here")
    args = parser.parse_args(argv)
    start, done = time.time(), []
    began = start if args.started is None else args.started
    deadline = None if args.seconds is None else began + args.seconds - max(10.0, 0.1 * args.seconds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    host: dict[str, object] = {}

    def save(current: CaseResult | None) -> None:
        results = [*done, current] if current is not None and current not in done else done
        data = payload(results, start, args.dry_run)
        if host:
            data["host"] = host
        out.write_text(json.dumps(data, indent=1) + "\n")

    for name in args.case:
        if deadline is not None and time.time() > deadline:
            print(f"{name}: skipped (out of time: the run's time limit is near)\n", flush=True)
            continue
        (res,) = run_cases([name], dry=args.dry_run, rounds=args.rounds, on_mode=save, deadline=deadline)
        done.append(res)
        save(res)
        result = res.suite_result()
        print(result.render() if result.rows else f"{name}: nothing measured", flush=True)
        for s in res.skipped:
            print(f"  skipped {s['impl']} ({s['mode']}): {s['reason']}", flush=True)
        print(flush=True)
    if args.host_case is not None:
        if deadline is not None and time.time() > deadline:
            host["skipped"] = "out of time: the run's time limit is near"
            print(f"host {args.host_case}: skipped ({host['skipped']})", flush=True)
        else:
            calls = 5 if args.dry_run else HOST_CALLS
            host["times"] = host_times(args.host_case, dry=args.dry_run, calls=calls)
            host["profile"] = host_profile(args.host_case, dry=args.dry_run, calls=calls)
            for line in host_lines(host["times"], host["profile"]):  # type: ignore[arg-type]
                print(line, flush=True)
        save(None)
    for line in tuning_lines(tuning_log()):
        print(line, flush=True)
    print(f"wrote {out} ({time.time() - start:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
