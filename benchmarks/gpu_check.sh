#!/usr/bin/env bash
# One command on one H100 / H200, about 8 minutes: the GPU test suite (bf16 included), compute-sanitizer
# memcheck of every kernel on small cases, then the kernel benchmarks. Logs and JSON go to $OUT
# (default benchmarks/results). Exit status: non-zero if the tests or memcheck failed.
#
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
#
# Works without installing vitattn (PYTHONPATH=repo); optional peers (adasplash, entmax) are installed
# if pip can reach an index, else their benchmarks are skipped with a note.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET VITATTN_TRITON_TILES
status=0
start=$(date +%s)
stamp() { echo "=== [$(($(date +%s) - start))s] $*"; }

stamp "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

stamp "optional peers"
for pkg in adasplash entmax; do
  "$PY" -c "import $pkg" 2>/dev/null || timeout 60 "$PY" -m pip install -q "$pkg" >/dev/null 2>&1 \
    || echo "$pkg: not installed and not installable here (its benchmarks are skipped)"
done

stamp "GPU tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU tests FAILED"; status=1; }

stamp "compute-sanitizer memcheck"
if command -v compute-sanitizer >/dev/null 2>&1; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
    "$PY" benchmarks/memcheck_kernels.py 2>&1 | tee "$OUT/memcheck.log"
  rc="${PIPESTATUS[0]}"
  if grep -q "Device not supported" "$OUT/memcheck.log"; then
    echo "memcheck: compute-sanitizer does not support this device/runtime here (not counted as a failure)"
  elif [ "$rc" -ne 0 ]; then
    echo "memcheck FAILED (exit $rc)"; status=1
  fi
else
  echo "memcheck: compute-sanitizer not on PATH (skipped)" | tee "$OUT/memcheck.log"
fi

stamp "benchmarks"
timeout 270 "$PY" benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || echo "benchmarks did not finish (partial JSON kept, see bench.log)"

stamp "done, status $status"
exit "$status"
