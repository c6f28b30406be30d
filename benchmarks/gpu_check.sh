#!/usr/bin/env bash
# The GPU check: on a lent GPU machine (one H200, torch 2.11+cu130, nvcc, no network, this repo copied in),
# from the repository root:
#
#     bash benchmarks/gpu_check.sh             # records, logs, JSON and Markdown go to $OUT (default benchmarks/out/gpu)
#     bash benchmarks/gpu_check.sh --dry-run   # every step's CPU part, CUDA parts "not run" (any machine)
#
# A thin driver: the steps live in benchmarks/gpu_check.py (env, build, tests, adam, offload, zero_offload,
# gelu, wrappers; `python benchmarks/gpu_check.py --list` prints each with its budget in seconds). Each step
# runs in its own process under `timeout` with its budget, so a crash or a hang in one is recorded and the
# next one still runs; the budgets add up to under 8 minutes on one H200. The report
# ($OUT/gpu_check.json, $OUT/gpu_check.md: a table for benchmarks/RESULTS.md) comes last, and the exit
# status is non-zero if any step failed or timed out. GPU_CHECK_STEPS="adam gelu" runs only those steps.
# The budgets are the H200's; GPU_CHECK_BUDGET_SCALE multiplies them (default 1, and 4 for --dry-run: a
# shared CPU machine is slower, and the dry run checks the logic, not the speed).
set -uo pipefail  # no -e: a failing step must not end the run
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT/steps"
rm -f "$OUT"/steps/*.json
export OUT
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
dry=()
scale="${GPU_CHECK_BUDGET_SCALE:-1}"
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); scale="${GPU_CHECK_BUDGET_SCALE:-4}"; fi
start=$(date +%s)

# "name budget" lines; an explicit list keeps the budgets of the known steps (unknown ones get 30 s and fail).
mapfile -t plan < <(python benchmarks/gpu_check.py --list)
steps=(${GPU_CHECK_STEPS:-$(printf '%s\n' "${plan[@]}" | cut -d' ' -f1)})
rcs=()
for name in "${steps[@]}"; do
  budget=30
  for line in "${plan[@]}"; do [ "${line%% *}" = "$name" ] && budget="${line##* }"; done
  limit=$(( budget * scale ))
  echo "=== $name (budget ${budget} s, timeout ${limit} s, at $(( $(date +%s) - start )) s)"
  # -k: a step that ignores SIGTERM (a wedged CUDA call) is killed 10 s later.
  timeout -k 10 "$limit" python benchmarks/gpu_check.py --step "$name" --out "$OUT" "${dry[@]}" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 3 "$OUT/$name.log"
  rcs+=(--rc "$name=$rc")
done

echo "=== report (at $(( $(date +%s) - start )) s)"
python benchmarks/gpu_check.py --report --out "$OUT" --steps "$(IFS=,; echo "${steps[*]}")" "${rcs[@]}"
