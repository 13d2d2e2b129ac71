#!/bin/sh
# make demo-fleet as a test (issue 16): N serve_sim processes, each a disjoint share of one workload's
# conversations (--shard i/N), on a 3-node Redis Cluster as their shared G4 (examples/demo_fleet.sh).
#  1. the fleet's hit rate with G4 is above the same processes' without it, every hit byte-checked;
#  2. one cluster node killed (SIGKILL) a second into the run, the processes paced to last longer: every
#     process still finishes, every hit is still byte-checked, and the reports say what was lost.
# Run from the repository root after `make build/serve_sim`. Ends with "N passed, N failed[, N skipped]".
SIM=${SIM:-build/serve_sim}
export SIM
for tool in redis-server redis-cli python3; do
    if ! command -v $tool >/dev/null 2>&1; then
        echo "skipped: $tool not installed"
        echo "0 passed, 0 failed, 2 skipped"
        exit 0
    fi
done
passed=0
failed=0
out=$(mktemp "${TMPDIR:-/tmp}/fleet_cluster.XXXXXX") || { echo "0 passed, 1 failed"; exit 1; }
trap 'rm -f "$out"' EXIT

if sh examples/demo_fleet.sh --requests 900 >"$out" 2>&1; then
    passed=$((passed + 1))
    grep "^fleet" "$out"
    echo "ok: the fleet's hit rate with G4 is above its hit rate without, every hit byte-checked"
else
    failed=$((failed + 1))
    cat "$out"
    echo "FAIL: demo_fleet.sh"
fi
if sh examples/demo_fleet.sh --requests 600 --pace-us 300 --kill-after 1 >"$out" 2>&1 &&
    grep -q "^killed one cluster node" "$out" && grep -q "^after the node was killed: [1-9]" "$out"; then
    passed=$((passed + 1))
    grep "^killed\|^after" "$out"
    echo "ok: a cluster node killed mid-run: every process finished, every hit byte-checked, the loss reported"
else
    failed=$((failed + 1))
    cat "$out"
    echo "FAIL: demo_fleet.sh --kill-after 1"
fi
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
