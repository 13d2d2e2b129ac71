#!/bin/sh
# make demo-fleet (issue 16): a fleet of serve_sim processes sharing one Redis Cluster as G4.
#
# Starts a 3-node Redis Cluster on loopback (ports the kernel picks, --save '', everything removed at
# exit), then runs N serve_sim processes at once in scheduler mode, process i serving the conversations
# c with c mod N = i of one synthetic workload (--shard i/N), each with its own device and host pools
# and all on the cluster as G4; then the same N processes with no G4, each alone. It prints each
# process's and the fleet's hit rate by tier and TTFT, both runs side by side, and exits 0 when every
# hit was byte-checked and the fleet's hit rate with G4 is above the one without.
#
#   sh examples/demo_fleet.sh [--processes N] [--requests N] [--kill-after SECONDS] [--pace-us N]
#
# --kill-after S kills one cluster node (SIGKILL) S seconds into the G4 run (tests/fleet_cluster.sh
# does, with --pace-us to make the run last): the processes must still finish, every hit byte-checked,
# the loads that node held recomputed, and their reports say what was lost. Then the hit-rate
# comparison is not required. Needs redis-server, redis-cli and python3; SIM=path overrides
# build/serve_sim.
SIM=${SIM:-build/serve_sim}
N=3
REQUESTS=1500
KILL_AFTER=""
PACE=0
while [ $# -gt 0 ]; do
    case $1 in
    --processes) N=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --kill-after) KILL_AFTER=$2; shift 2 ;;
    --pace-us) PACE=$2; shift 2 ;;
    *) echo "usage: demo_fleet.sh [--processes N] [--requests N] [--kill-after SECONDS] [--pace-us N]"; exit 2 ;;
    esac
done
for tool in redis-server redis-cli python3; do
    command -v $tool >/dev/null 2>&1 || { echo "demo_fleet: $tool not installed (make deps)"; exit 2; }
done
[ -x "$SIM" ] || { echo "demo_fleet: $SIM not built (make build/serve_sim)"; exit 2; }

dir=$(mktemp -d "${TMPDIR:-/tmp}/demo_fleet.XXXXXX") || exit 2
pids=""
cleanup() {
    for p in $pids; do kill "$p" 2>/dev/null; done
    for p in $pids; do wait "$p" 2>/dev/null; done
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# a port p with p and p + 10000 (the cluster bus; so p <= 55535) both free now
free_port() {
    python3 -c 'import random, socket
for _ in range(1000):
    p, ss = random.randint(20000, 55535), []
    try:
        for q in (p, p + 10000):
            s = socket.socket(); ss.append(s); s.bind(("127.0.0.1", q))
        print(p); break
    except OSError: pass
    finally:
        for s in ss: s.close()'
}

# ---- the cluster --------------------------------------------------------------------------------
ports=""
seeds=""
for k in 1 2 3; do
    port=$(free_port) || exit 2
    mkdir -p "$dir/node$k"
    (cd "$dir/node$k" && exec redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
        --cluster-enabled yes --cluster-config-file "$dir/node$k/nodes.conf" --dir "$dir/node$k" \
        --logfile "$dir/node$k/redis.log" --protected-mode yes) &
    pids="$pids $!"
    eval "pid$k=$!"
    ports="$ports $port"
    seeds="$seeds${seeds:+,}127.0.0.1:$port"
done
for port in $ports; do
    i=0
    until redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; do
        i=$((i + 1))
        [ $i -lt 200 ] || { tail -n 3 "$dir"/node*/redis.log; echo "demo_fleet: redis-server on port $port did not start"; exit 2; }
        sleep 0.05
    done
done
# shellcheck disable=SC2086
redis-cli --cluster create $(for p in $ports; do printf '127.0.0.1:%s ' "$p"; done) --cluster-replicas 0 \
    --cluster-yes >"$dir/create.log" 2>&1 || { cat "$dir/create.log"; echo "demo_fleet: cluster create failed"; exit 2; }
for port in $ports; do
    i=0
    until redis-cli -p "$port" cluster info 2>/dev/null | grep -q "cluster_state:ok"; do
        i=$((i + 1))
        [ $i -lt 200 ] || { echo "demo_fleet: the cluster did not come up"; exit 2; }
        sleep 0.05
    done
done
echo "Redis Cluster: 3 nodes on 127.0.0.1 ports$ports"

# ---- the runs -------------------------------------------------------------------------------------
COMMON="--requests $REQUESTS --device-blocks 512 --host-blocks 1024 --bytes --json"
run_fleet() { # run_fleet NAME [serve_sim options]: N processes at once
    name=$1
    shift
    rpids=""
    i=0
    while [ $i -lt "$N" ]; do
        # shellcheck disable=SC2086
        "$SIM" $COMMON --shard "$i/$N" "$@" >"$dir/$name.$i.json" 2>"$dir/$name.$i.err" &
        rpids="$rpids $!"
        i=$((i + 1))
    done
    if [ -n "$KILL_AFTER" ] && [ "$name" = g4 ]; then
        sleep "$KILL_AFTER"
        alive=0
        for p in $rpids; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
        [ $alive -gt 0 ] || { echo "demo_fleet: the runs ended before ${KILL_AFTER} s: use a larger --pace-us"; exit 1; }
        kill -9 "$pid3" 2>/dev/null && echo "killed one cluster node (port ${ports##* }) ${KILL_AFTER} s into the run, $alive of $N processes still running"
    fi
    status=0
    for p in $rpids; do wait "$p" || status=1; done
    if [ $status -ne 0 ]; then
        cat "$dir/$name".*.err
        echo "demo_fleet: a serve_sim process failed"
        exit 1
    fi
}
run_fleet g4 --remote "$seeds" --pace-us "$PACE"
run_fleet alone

# ---- the report -----------------------------------------------------------------------------------
python3 - "$dir" "$N" "$KILL_AFTER" <<'EOF'
import json, math, sys
d, n, killed = sys.argv[1], int(sys.argv[2]), sys.argv[3] != ""
def load(name):
    return [json.load(open("%s/%s.%d.json" % (d, name, i))) for i in range(n)]
def pct(v, q):
    v = sorted(v)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)] if v else float("nan")
tiers = ["device", "host", "remote"]
def row(label, r, ttft):
    p = r["prompt_blocks"]
    return "%-10s %8d %8.4f %s   %9.1f %9.1f" % (label, r["requests"], r["hit_blocks"] / p if p else 0,
        " ".join("%7.4f" % (r.get(t + "_hit_blocks", 0) / p if p else 0) for t in tiers), pct(ttft, 50), pct(ttft, 99))
def table(title, runs):
    print("\n%s" % title)
    print("%-10s %8s %8s %s   %9s %9s" % ("process", "requests", "hit rate", " ".join("%7s" % t for t in tiers),
                                          "TTFT p50", "p99 ms"))
    total = {"requests": 0, "prompt_blocks": 0, "hit_blocks": 0}
    for t in tiers: total[t + "_hit_blocks"] = 0
    ttft = []
    for i, r in enumerate(runs):
        print(row("shard %d" % i, r, r["ttft_ms"]))
        for k in total: total[k] += r.get(k, 0)
        ttft += r["ttft_ms"]
    print(row("fleet", total, ttft))
    return total["hit_blocks"] / total["prompt_blocks"]
g4, alone = load("g4"), load("alone")
rate_g4 = table("with G4 (the Redis Cluster shared by all %d processes)" % n, g4)
rate_alone = table("without G4 (each process alone)", alone)
bad = []
for name, runs in (("with G4", g4), ("alone", alone)):
    for i, r in enumerate(runs):
        if r["data_mismatches"] or r.get("remote_checksum_errors", 0) or r["verified_blocks"] < r["hit_blocks"]:
            bad.append("%s, shard %d: a hit was not byte-checked or did not match" % (name, i))
lost = sum(r["remote_io_errors"] + r["remote_misses"] + r["remote_lookup_errors"] + r["remote_error_replies"] +
           r["remote_disconnects"] + r["remote_connect_failures"] for r in g4)
imported = sum(r["remote_imported_blocks"] for r in g4)
print("\nfleet hit rate %.4f with G4, %.4f without; %d blocks one process found that another had stored"
      % (rate_g4, rate_alone, imported))
if killed:
    print("after the node was killed: %d remote reads, copies, lookups or connections failed, recomputed" % lost)
    if lost == 0: bad.append("a node was killed but no report says anything was lost")
elif rate_g4 <= rate_alone:
    bad.append("the fleet's hit rate with G4 is not above the one without")
for m in bad: print("FAIL:", m)
sys.exit(1 if bad else 0)
EOF
