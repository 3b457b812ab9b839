#!/usr/bin/env bash
# The GPU check: one command on one H200 (torch 2.11, Triton 3.6), at most 420 s for all steps (a
# 10-minute device call with time left for a rerun), nothing fetched there.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine, from anywhere; JSON under $OUT
#   bash benchmarks/gpu_check.sh --dry-run   # the same steps on the CPU, tiny shapes, TRITON_INTERPRET=1
#
# Steps, each under `timeout` and each writing its own JSON under $OUT (8 files in all, what one device
# call brings back):
#   env.json            versions, device, peers, compute-sanitizer (peers: wheels in .whl/, see README)
#   warm.json           benchmarks/warm_kernels.py: every kernel and tile the later steps launch, compiled
#                       first on all CPU cores into TRITON_CACHE_DIR (no timed step compiles), and the
#                       peers that compile on first use (FlexAttention's torch.compile into the shared
#                       TORCHINDUCTOR_CACHE_DIR, AdaSplash's Triton JIT)
#   tests.json          tests/test_kernels_gpu.py (pytest -v, outcomes per test: every autotune config
#                       forced in turn, a run-twice bitwise comparison, the reference in float64)
#   memcheck.json       compute-sanitizer memcheck of benchmarks/memcheck_kernels.py (a few small cases
#                       per kernel, PYTORCH_NO_CUDA_MEMORY_CACHING=1, one tile config per kernel)
#   bench_n4096.json, bench_n16384.json, bench_extra.json (sparse and vit_b; then vitattn's host time per call and a profile at vit_b)
#                       benchmarks/bench_kernels.py (ratio tables printed; every row gated on its error
#                       against the reference backend in the same run); the goal rows run first (the
#                       reference, the Gaussian and entmax-1.5 rows of vitattn and of the peers they are
#                       compared with), the goal cases n4096 and n16384 before the others
#   summary.json        the checks and goals (pass / fail / unknown, rules in gpu_report.py) and each
#                       step's status
# A step killed by its timeout loses only itself (gpu_report.py finish records its exit status and log
# tail), and its verdicts are unknown, never pass or fail. Before each step the remaining budget
# (GPU_CHECK_BUDGET_S, default 420 s; dry run 300 s) is checked: a step gets min(its own limit, what is
# left), and is skipped when under 15 s remain. The limits add up to 420 s (twice each in the dry run); the
# last step (bench_extra) also takes what the earlier ones left unused.
# Exit status: 1 if a check failed (a kernel that does not compile, a failed GPU test, a memcheck error),
# else 0 (speed goals are reported only).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
START=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/vitattn-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$WORK/triton-cache}"  # shared by the steps (compile once)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor-cache}"  # FlexAttention's compile
unset VITATTN_TRITON_TILES
if [ "$DRY" = 1 ]; then
  OUT="${OUT:-${TMPDIR:-/tmp}/vitattn-gpu-check-dry}"
  BUDGET="${GPU_CHECK_BUDGET_S:-300}"
  SCALE=2  # the interpreter on a shared CI machine: twice each step's limit (the budget still caps them)
  export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" CUDA_VISIBLE_DEVICES=""
  DRYFLAG=(--dry-run)
else
  OUT="${OUT:-benchmarks/results/gpu_check}"
  BUDGET="${GPU_CHECK_BUDGET_S:-420}"
  SCALE=1
  unset TRITON_INTERPRET
  DRYFLAG=()
fi
mkdir -p "$OUT"
RESERVE=5  # seconds kept for the summary
REPORT=("$PY" benchmarks/gpu_report.py)
stamp() { echo "=== [$(($(date +%s) - START))s] $*"; }
say() { echo "    $*"; }

# step NAME LIMIT KIND [finish options --] CMD...: run CMD under timeout, log to $WORK, record the step.
step() {
  local name=$1 limit=$2 kind=$3
  shift 3
  local extra=()
  while [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  local json="$OUT/$name.json" log="$WORK/$name.log"
  limit=$((limit * SCALE))
  local left=$((BUDGET - ($(date +%s) - START) - RESERVE))
  if [ "$left" -lt 15 ]; then
    stamp "$name: skipped (budget: ${left}s left of ${BUDGET}s)"
    "${REPORT[@]}" finish "$name" --json "$json" --kind "$kind" "${extra[@]}" --skipped "budget: ${left}s left"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  stamp "$name (limit ${limit}s)"
  local t0
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  "${REPORT[@]}" finish "$name" --json "$json" --kind "$kind" "${extra[@]}" --rc "$rc" \
    --seconds $(($(date +%s) - t0)) --limit "$limit" --log "$log"
}

# ---- peers: wheels in .whl/ (filled on a machine with an index: see benchmarks/README.md) ----
PEERS=""
if compgen -G ".whl/*.whl" >/dev/null; then
  PEERS="$WORK/peers"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target "$PEERS" \
      adasplash entmax >"$WORK/pip.log" 2>&1; then
    export PYTHONPATH="$PEERS:$PYTHONPATH"
    say "peers: installed adasplash, entmax from .whl/ into $PEERS"
  else
    say "peers: pip install from .whl/ failed: $(tail -1 "$WORK/pip.log")"
  fi
else
  say "peers: no .whl/ folder (their benchmarks are skipped unless installed already)"
fi

SAN=""
if [ "$DRY" = 1 ]; then
  say "compute-sanitizer: skipped (dry run: it needs CUDA); the memcheck cases run without it"
else
  SAN="$("${REPORT[@]}" find-sanitizer)" || say "compute-sanitizer: not found (PATH, CUDA toolkit, pip nvidia packages)"
fi

step env 15 env -- "${REPORT[@]}" env --json "$OUT/env.json" --peers "$PEERS" --sanitizer "$SAN"

# compile first, on every core: nothing after this compiles (the Triton cache is shared by the steps)
CORES="$(nproc 2>/dev/null || echo 2)"
step warm 95 warm -- "$PY" benchmarks/warm_kernels.py --jobs "$CORES" --out "$OUT/warm.json" "${DRYFLAG[@]}"

if [ "$DRY" = 1 ]; then
  reason="dry run: tests/test_kernels_gpu.py needs CUDA (every test in it skips without a GPU)"
  stamp "tests: skipped ($reason)"
  "${REPORT[@]}" finish tests --json "$OUT/tests.json" --kind pytest --skipped "$reason"
else
  step tests 85 pytest -- "$PY" -m pytest -v -rs -p no:cacheprovider tests/test_kernels_gpu.py
fi

MEMCHECK=("$PY" benchmarks/memcheck_kernels.py --out "$OUT/memcheck.json" "${DRYFLAG[@]}")
if [ -n "$SAN" ]; then
  step memcheck 50 memcheck --sanitizer "$SAN" -- env PYTORCH_NO_CUDA_MEMORY_CACHING=1 VITATTN_TRITON_TILES=first \
    "$SAN" --tool memcheck --error-exitcode 3 --print-limit 20 "${MEMCHECK[@]}"
else
  step memcheck 50 memcheck --note "no compute-sanitizer: cases run unchecked" -- \
    env PYTORCH_NO_CUDA_MEMORY_CACHING=1 VITATTN_TRITON_TILES=first "${MEMCHECK[@]}"
fi

# n4096 and n16384 carry the goals; sparse and vit_b share one step (one JSON), the last, which also takes
# whatever the earlier steps left of the budget (their limits are upper bounds, rarely used up)
for spec in n4096:70:n4096 n16384:65:n16384 extra:40:sparse,vit_b; do
  IFS=: read -r name limit cases <<<"$spec"
  left=$((BUDGET - ($(date +%s) - START) - RESERVE))
  [ "$name" = extra ] && [ "$left" -gt $((limit * SCALE)) ] && limit=$((left / SCALE))
  [ "$((limit * SCALE))" -gt "$left" ] && limit=$((left / SCALE))
  host=()
  [ "$name" = extra ] && host=(--host-case vit_b)  # vitattn's host time and profile at ViT-B/16's size
  step "bench_$name" "$limit" bench -- "$PY" benchmarks/bench_kernels.py --case ${cases//,/ } \
    --seconds "$((limit * SCALE))" --started "$(date +%s)" --out "$OUT/bench_$name.json" "${host[@]}" \
    "${DRYFLAG[@]}"
done

stamp "summary"
"${REPORT[@]}" summary "$OUT" "${DRYFLAG[@]}"
status=$?
stamp "done in $(($(date +%s) - START))s, status $status; JSON in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$status"
