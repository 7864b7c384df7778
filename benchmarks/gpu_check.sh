#!/usr/bin/env bash
# The GPU check, prepared for a short GPU session (about 15 minutes of device time in all).
#
#   bash benchmarks/gpu_check.sh          # from anywhere; OUT=/some/dir to collect logs and results
#
# 0. Compiles every launch ahead of time for this GPU (`benchmarks/kernels_static.py --subset`,
#    cap: 120 s; no GPU time needed, it runs on the CPU): a compile error, a shared-memory overflow
#    or a register spill stops the script here, before any GPU time goes to finding it.
# 1. Prints the GPU (nvidia-smi -L) and labkit.describe(); stops unless Triton runs *compiled*.
# 2. Runs the kernel, paging and engine tests with every tensor on the GPU (cap: 200 s).
# 3. Runs `benchmarks/paged_attention.py --quick`: the goal points only (cap: 240 s).
# 4. Copies the logs and the benchmark's new JSON into $OUT when OUT is set.
# Steps 2 and 3 run even if one fails; the exit status is non-zero if either did. The caps keep
# the whole script under 10 minutes; a healthy run should take well under that.
#
# Python: .venv/bin/python after `make setup`; else a python3 that already has torch, triton and
# pytest (an offline GPU image, where `make setup` cannot download anything); else `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
elif python3 -c "import torch, triton, pytest" 2>/dev/null; then
    PY=python3
else
    make setup
    PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOGS=$(mktemp -d)
START="$LOGS/start"
touch "$START"
failed=()

echo "== static check: compile every launch for sm75..sm90 (CPU only) =="
# A launch that fails to compile, overflows or spills stops the script; a static check that cannot
# run at all (another Triton version's internals, a timeout) only warns: the GPU tests still say more.
if timeout 120 env -u TRITON_INTERPRET "$PY" benchmarks/kernels_static.py --subset >"$LOGS/gpu_check_static.log" 2>&1; then
    tail -n 1 "$LOGS/gpu_check_static.log"
elif grep -q '^PROBLEM' "$LOGS/gpu_check_static.log"; then
    grep '^PROBLEM' "$LOGS/gpu_check_static.log"
    echo "gpu_check: the static check found launches that cannot run well; fix them before using GPU time"
    exit 1
else
    tail -n 5 "$LOGS/gpu_check_static.log"
    echo "gpu_check: WARNING: the static check could not run (log: $LOGS/gpu_check_static.log); going on"
fi

if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
"$PY" - <<'PY'
import sys
import labkit
print(labkit.describe())
if labkit.RUNTIME.triton_mode != "compiled":
    sys.exit("gpu_check: Triton does not run compiled here, so this would not check the GPU kernels")
PY

# -n 4: compiling the kernels' many specialisations is CPU work, done in parallel (if xdist is there).
xdist=()
if "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n 4); fi
echo "== tests (${xdist[*]:-serial}) =="
timeout 200 "$PY" -m pytest -q -x -rs -p no:cacheprovider --durations=5 "${xdist[@]}" \
    tests/test_kernels.py tests/test_paging.py tests/test_engine.py 2>&1 | tee "$LOGS/gpu_check_tests.log" \
    || failed+=("tests")

echo "== benchmarks/paged_attention.py --quick =="
timeout 240 "$PY" benchmarks/paged_attention.py --quick 2>&1 | tee "$LOGS/gpu_check_benchmark.log" \
    || failed+=("benchmark")

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    cp "$LOGS"/*.log "$OUT"/
    find benchmarks/results -name 'paged_attention_*.json' -newer "$START" -exec cp {} "$OUT"/ \;
    echo "copied to $OUT:" && ls "$OUT"
fi
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]} (logs in $LOGS)"
    exit 1
fi
echo "gpu_check: all passed (logs in $LOGS)"
