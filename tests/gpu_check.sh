#!/bin/sh
# make gpu-check: the whole GPU-tier proof from one command, on a machine with an NVIDIA GPU.
# Builds the CUDA code for this GPU's architecture only (in build/gpu-smXX), runs the CUDA tests (none
# may skip), build/kvbench_cuda --json and tiny_llm's checks with its fork pool in GPU memory, and writes
# one summary, build/gpu-check.json: device, driver, toolkit, pass/fail counts, every bench key with its
# goal. Exit status 0 when every test passes and every goal is met. Without a GPU: one line, exit 0.
# Environment (set by the Makefile): BUILD, NVCC, MAKE. GPU_CHECK_PREBUILT=1 skips the build and runs
# what build/gpu-smXX already holds: for a GPU machine with no compiler or packages, given binaries built
# elsewhere with `make BUILD=build/gpu-smXX CUDA_ARCHS=XX build/gpu-smXX/cuda/test_cuda
# build/gpu-smXX/kvbench_cuda build/gpu-smXX/tiny_llm_cuda` (test_cuda needs libubsan.so.1 there).
set -u
BUILD=${BUILD:-build}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
MAKE=${MAKE:-make}
OUT=$BUILD/gpu-check.json

# Every "key": value line of kvbench_cuda's JSON ($1) as a summary entry with its goal; the bandwidth
# goal follows the PCIe generation ($2): >= 45 GB/s one way on Gen5, >= 20 on Gen4, none below.
bench_rows() {
    awk -v gen="$2" '
    /^  "[a-z0-9_]+": / && !/"scattered_kernel_jobs"/ {
        key = $1; gsub(/[":]/, "", key); val = $2; gsub(/,$/, "", val)
        if (key == "goals" || key == "device") next
        goal = "null"; met = "null"
        if (key ~ /^(d2h|h2d)_gbps$/) { if (gen >= 5) g = 45; else if (gen == 4) g = 20; else g = -1
                                         if (g > 0) { goal = "\">= " g "\""; met = (val + 0 >= g) ? "true" : "false" } }
        else if (key ~ /^scattered_(after_small_jobs_)?vs_contiguous/) { goal = "\">= 0.8\""; met = (val + 0 >= 0.8) ? "true" : "false" }
        else if (key ~ /^submit_vs_floor/) { goal = "\"<= 1.5\""; met = (val + 0 <= 1.5) ? "true" : "false" }
        else if (key == "all_copies_ok") { goal = "\"true\""; met = (val == "true") ? "true" : "false" }
        if (val !~ /^(true|false|-?[0-9.]+([eE][-+]?[0-9]+)?)$/) val = "null"
        printf "%s    \"%s\": {\"value\": %s, \"goal\": %s, \"met\": %s}", sep, key, val, goal, met; sep = ",\n"
    }
    / "scattered_kernel_jobs": / {   # three keys on one line
        n = split($0, f, /, /)
        for (i = 1; i <= n; i++) { split(f[i], kv, /: /); k = kv[1]; v = kv[2]; gsub(/[" ,]/, "", k); gsub(/[ ,]/, "", v)
            goal = "null"; met = "null"
            if (k == "all_copies_ok") { goal = "\"true\""; met = (v == "true") ? "true" : "false" }
            printf "%s    \"%s\": {\"value\": %s, \"goal\": %s, \"met\": %s}", sep, k, v, goal, met; sep = ",\n" }
    }' "$1"
}

# sh tests/gpu_check.sh --bench-rows FILE GEN: the summary's bench entries for FILE (checks the goal
# table without a GPU)
if [ "${1:-}" = --bench-rows ]; then bench_rows "$2" "$3"; echo; exit 0; fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "make gpu-check: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to check"
    exit 0
fi
PREBUILT=${GPU_CHECK_PREBUILT:-0}
if [ "$PREBUILT" != 1 ] && [ ! -x "$NVCC" ]; then
    echo "make gpu-check: a GPU is here but nvcc is not at $NVCC (set NVCC=/path/to/nvcc)"
    exit 1
fi

q() { nvidia-smi -i 0 --query-gpu="$1" --format=csv,noheader,nounits 2>/dev/null | head -n 1 | sed 's/^ *//; s/ *$//'; }
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g')"; }
name=$(q name)
driver=$(q driver_version)
cap=$(q compute_cap)
pcie_gen=$(q pcie.link.gen.max)
arch=$(printf '%s' "$cap" | tr -d '.')
case "$arch" in ''|*[!0-9]*) arch=$("$(dirname "$NVCC")/__nvcc_device_query" 2>/dev/null) ;; esac
case "$pcie_gen" in ''|*[!0-9]*) pcie_gen=0 ;; esac
toolkit=$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
[ "$PREBUILT" = 1 ] && toolkit="prebuilt${toolkit:+ (nvcc here: $toolkit)}"

GB=$BUILD/gpu-sm$arch
mkdir -p "$GB"
echo "make gpu-check: $name (sm_$arch, driver $driver, PCIe gen $pcie_gen), CUDA $toolkit; building in $GB"

# "N passed, N failed[, N skipped]" of a log -> "passed failed skipped" (-1 -1 -1 when absent)
counts() {
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" | tail -n 1)
    [ -n "$line" ] || { echo "-1 -1 -1"; return; }
    s=$(echo "$line" | sed -n -E 's/.*, ([0-9]+) skipped.*/\1/p')
    echo "$line" | sed -E "s/^([0-9]+) passed, ([0-9]+) failed.*/\1 \2 ${s:-0}/"
}

build_ok=true
if [ "$PREBUILT" = 1 ]; then
    for b in cuda/test_cuda kvbench_cuda tiny_llm_cuda; do
        [ -x "$GB/$b" ] || { echo "make gpu-check: GPU_CHECK_PREBUILT=1 but $GB/$b is not built"; build_ok=false; }
    done
else $MAKE --no-print-directory BUILD="$GB" CUDA_ARCHS="$arch" NVCC="$NVCC" \
    "$GB/cuda/test_cuda" "$GB/kvbench_cuda" "$GB/tiny_llm_cuda" >"$GB/build.log" 2>&1 || build_ok=false
    if [ "$build_ok" = false ]; then tail -n 20 "$GB/build.log"; fi
fi

"$GB/cuda/test_cuda" >"$GB/test_cuda.log" 2>&1
set -- $(counts "$GB/test_cuda.log"); t_pass=$1 t_fail=$2 t_skip=$3
"$GB/tiny_llm_cuda" --check --gpu >"$GB/tiny_llm.log" 2>&1
set -- $(counts "$GB/tiny_llm.log"); l_pass=$1 l_fail=$2 l_skip=$3
"$GB/kvbench_cuda" --json >"$GB/kvbench_cuda.json" 2>"$GB/kvbench_cuda.err"
bench_rc=$?

bench=$(bench_rows "$GB/kvbench_cuda.json" "$pcie_gen")
unmet=$(printf '%s\n' "$bench" | grep -c '"met": false')
bench_keys=$(printf '%s\n' "$bench" | grep -c '"value"')

ok=true
[ "$build_ok" = true ] && [ "$t_fail" -eq 0 ] && [ "$t_skip" -eq 0 ] && [ "$t_pass" -gt 0 ] && [ "$l_fail" -eq 0 ] &&
    [ "$l_pass" -gt 0 ] && [ "$bench_rc" -eq 0 ] && [ "$bench_keys" -gt 0 ] && [ "$unmet" -eq 0 ] || ok=false

{
    echo "{"
    echo "  \"ok\": $ok,"
    echo "  \"device\": {\"name\": $(json_str "$name"), \"compute_capability\": $(json_str "$cap"), \"arch\": \"sm_$arch\", \"pcie_gen_max\": $pcie_gen},"
    echo "  \"driver\": $(json_str "$driver"),"
    echo "  \"toolkit\": $(json_str "$toolkit"),"
    echo "  \"build_ok\": $build_ok,"
    echo "  \"cuda_tests\": {\"passed\": $t_pass, \"failed\": $t_fail, \"skipped\": $t_skip},"
    echo "  \"tiny_llm_gpu\": {\"passed\": $l_pass, \"failed\": $l_fail},"
    echo "  \"bench_exit\": $bench_rc,"
    echo "  \"goals_unmet\": $unmet,"
    echo "  \"bench\": {"
    printf '%s\n' "$bench"
    echo "  },"
    echo "  \"logs\": $(json_str "$GB")"
    echo "}"
} >"$OUT"

echo "cuda tests: $t_pass passed, $t_fail failed, $t_skip skipped; tiny_llm --gpu: $l_pass passed, $l_fail failed;" \
     "bench: $bench_keys keys, $unmet goal(s) unmet -> $OUT"
if [ "$ok" = true ]; then echo "gpu-check: ok"; exit 0; fi
echo "gpu-check: FAILED (logs in $GB)"
[ "$t_fail" -ne 0 ] || [ "$t_skip" -ne 0 ] && grep -E '^(FAIL|skip)|check failed' "$GB/test_cuda.log" | head -n 20
exit 1
