#!/usr/bin/env bash
# The GPU check: on a lent GPU machine (one H100 or H200, torch 2.11+cu130, nvcc, no network, this repo
# copied in without build outputs), from the repository root:
#
#     bash benchmarks/gpu_check.sh             # the report, one log and a tar.gz go to $OUT (default benchmarks/out/gpu)
#     bash benchmarks/gpu_check.sh --dry-run   # every step's CPU part, CUDA parts "not run" (any machine)
#
# A thin driver: the steps live in benchmarks/gpu_check.py (env, build, tests, adam, offload, zero_offload,
# gelu, wrappers; `python3 benchmarks/gpu_check.py --list` prints each with its budget in seconds, then the
# run's total). Each step runs in its own process under `timeout` with its budget, so a crash or a hang in
# one is recorded and the next one still runs; a step whose budget no longer fits in what is left of the
# total is skipped ("skipped: no time left"), so the whole run ends inside 8 minutes.
#
# Only 8 files come back from a lent machine's $OUT, so the step records and logs stay in a scratch folder
# ($GPU_CHECK_WORK, default a fresh /tmp/gpu_check.*) and $OUT holds four: gpu_check.json, gpu_check.md (a
# table for benchmarks/RESULTS.md), gpu_check.log (everything this prints) and gpu_check_work.tar.gz (the
# scratch folder). The report and the tar.gz are rewritten after every step, so a run killed later still
# leaves current ones. The exit status is non-zero if any step did not pass.
#
# GPU_CHECK_STEPS="adam gelu" runs only those steps. PYTHON picks the interpreter (default python3). The
# budgets are the H100/H200's; GPU_CHECK_BUDGET_SCALE multiplies them and the total (default 1, and 4 for
# --dry-run: a shared CPU machine is slower, and the dry run checks the logic, not the speed).
set -uo pipefail  # no -e: a failing step must not end the run
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/out/gpu}"
own_work=""
if [ -n "${GPU_CHECK_WORK:-}" ]; then WORK="$GPU_CHECK_WORK"; else WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"; own_work=1; fi
mkdir -p "$OUT" "$WORK/steps"
rm -f "$WORK"/steps/*.json "$WORK"/*.log \
  "$OUT/gpu_check.json" "$OUT/gpu_check.md" "$OUT/gpu_check.log" "$OUT/gpu_check_work.tar.gz"
export OUT GPU_CHECK_WORK="$WORK"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# NCCL on one machine with no network: loopback only, and warnings only. Unbuffered Python: a step killed
# by its timeout leaves its log up to the moment it stopped.
export NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=WARN PYTHONUNBUFFERED=1
dry=()
scale="${GPU_CHECK_BUDGET_SCALE:-1}"
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); scale="${GPU_CHECK_BUDGET_SCALE:-4}"; fi

main() {
  local start total line name budget limit now left rc i no_ext="" plan=() names=() budgets=() st=() ext=()
  start=$(date +%s)
  # "name budget" lines, then "total seconds"; an explicit list keeps the budgets of the known steps
  # (unknown ones get 30 s and fail).
  mapfile -t plan < <("$PY" benchmarks/gpu_check.py --list)
  total=""
  for line in "${plan[@]}"; do [ "${line%% *}" = total ] && total="${line##* }"; done
  if [ -z "$total" ]; then echo "gpu_check: '$PY benchmarks/gpu_check.py --list' failed (set PYTHON?)"; return 2; fi
  local deadline=$(( start + total * scale ))
  for name in ${GPU_CHECK_STEPS:-$(printf '%s\n' "${plan[@]}" | cut -d' ' -f1 | grep -vx total)}; do
    budget=30
    for line in "${plan[@]}"; do [ "${line%% *}" = "$name" ] && budget="${line##* }"; done
    names+=("$name"); budgets+=("$budget"); st+=("")  # st: exit code, "skip", or "" (not run yet)
  done

  regen() {  # the report from what the steps wrote so far; "$@": --print
    local args=() j
    for j in "${!names[@]}"; do args+=("${names[$j]}:${budgets[$j]}${st[$j]:+:${st[$j]}}"); done
    "$PY" benchmarks/gpu_check_report.py --work "$WORK" --out "$OUT" --total "$total" "$@" "${args[@]}"
  }

  for i in "${!names[@]}"; do
    name="${names[$i]}"
    limit=$(( budgets[i] * scale ))
    now=$(date +%s)
    left=$(( deadline - now ))
    if [ "$left" -lt "$limit" ]; then
      echo "=== $name skipped: no time left (${left} s of the total, budget ${limit} s)"
      st[$i]=skip
      regen >/dev/null
      continue
    fi
    # Once the build failed (or with no built library at all), the steps must neither load a broken library
    # nor start the compile-on-first-use of pyparallel/_jit.py (minutes, past their timeouts): they run on
    # the plain-torch references, and the adam and gelu steps fail their CUDA parts for want of the kernels.
    ext=()
    if [ "$name" != build ] && { [ -n "$no_ext" ] || ! compgen -G 'pyparallel/_C*.so' >/dev/null; }; then
      ext=(PYPARALLEL_NO_EXT=1)
    fi
    echo "=== $name (budget ${budgets[$i]} s, timeout ${limit} s, at $(( now - start )) s${ext[*]:+, ${ext[*]}})"
    # -k: a step that ignores SIGTERM (a wedged CUDA call) is killed 10 s later.
    timeout -k 10 "$limit" env "${ext[@]}" "$PY" benchmarks/gpu_check.py --step "$name" --work "$WORK" \
      --deadline "$(( now + limit ))" "${dry[@]}" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    st[$i]=$rc
    if [ "$name" = build ] && [ "$rc" -ne 0 ]; then no_ext=1; fi
    regen >/dev/null
    tar -czf "$WORK.tar.gz" -C "$WORK" . && mv -f "$WORK.tar.gz" "$OUT/gpu_check_work.tar.gz"
  done

  echo "=== report (at $(( $(date +%s) - start )) s)"
  regen --print
}

main "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ -n "$own_work" ]; then rm -rf "$WORK"; fi
exit "$rc"
