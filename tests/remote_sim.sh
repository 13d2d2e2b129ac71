#!/bin/sh
# serve_sim --remote against a real redis-server on loopback (issue 9): two runs of the same trace, each a
# fresh process with cold local tiers, share one Redis. The first finds nothing another run stored
# (remote_imported_blocks 0; its remote hits are blocks it offloaded itself and then lost from the
# device); the second gets remote hits for blocks the first stored, more hits in all, the bytes intact.
# Then the same in scheduler mode with all four tiers (--host-blocks --disk-blocks --remote): a second
# process with cold local tiers gets remote hits through the connector, every hit byte-checked. Last, a
# fleet (--engines 3) on one Redis: its engines import what the others stored. The second run's --svg
# hit rate counts its remote hits.
# Run from the repository root after `make build/serve_sim`. Ends with "N passed, N failed[, N skipped]".
SIM=${SIM:-build/serve_sim}
TRACE=examples/traces/small.jsonl

if ! command -v redis-server >/dev/null 2>&1; then
    echo "skipped: redis-server not installed"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
if [ ! -x "$SIM" ]; then
    echo "FAIL: $SIM not built"
    echo "0 passed, 1 failed"
    exit 1
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/remote_sim.XXXXXX") || { echo "0 passed, 1 failed"; exit 1; }
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; fi
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

fail() {
    echo "FAIL: $*"
    [ -f "$dir/redis.log" ] && tail -n 5 "$dir/redis.log"
    echo "0 passed, 1 failed"
    exit 1
}

# a port nothing listens on now (the kernel picks it); retried if redis-server loses the race for it
started=0
for attempt in 1 2 3; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()') ||
        fail "python3 could not find a free port"
    (cd "$dir" && exec redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
        --dir "$dir" --logfile "$dir/redis.log" --protected-mode yes) &
    pid=$!
    i=0
    while [ $i -lt 50 ]; do
        if python3 -c 'import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 0.2)
s.sendall(b"PING\r\n")
sys.exit(0 if s.recv(16).startswith(b"+PONG") else 1)' "$port" 2>/dev/null; then
            started=1
            break
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
        i=$((i + 1))
    done
    [ $started -eq 1 ] && break
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=""
done
[ $started -eq 1 ] || fail "redis-server did not start"

run() {
    "$SIM" --sequential --trace "$TRACE" --device-blocks 64 --host-blocks 0 \
        --remote "redis://127.0.0.1:$port" --json --svg "$dir/$1.svg" >"$dir/$1.json" 2>"$dir/$1.err"
    rc=$?
    [ $rc -eq 0 ] || { cat "$dir/$1.err"; fail "serve_sim run $1 exited $rc"; }
}
run 1
run 2

# scheduler mode, four tiers, on an empty Redis
python3 -c 'import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 2)
s.sendall(b"FLUSHALL\r\n")
sys.exit(0 if s.recv(16).startswith(b"+OK") else 1)' "$port" || fail "FLUSHALL"
run_sched() {
    "$SIM" --requests 300 --device-blocks 512 --host-blocks 1024 --disk-blocks 3000 \
        --remote "redis://127.0.0.1:$port" --json >"$dir/$1.json" 2>"$dir/$1.err"
    rc=$?
    [ $rc -eq 0 ] || { cat "$dir/$1.err"; fail "serve_sim run $1 exited $rc"; }
}
run_sched s1
run_sched s2

# a fleet of three engines on one (emptied) Redis, all four tiers each: engines import what the others
# stored, every hit byte-checked
python3 -c 'import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 2)
s.sendall(b"FLUSHALL\r\n")
sys.exit(0 if s.recv(16).startswith(b"+OK") else 1)' "$port" || fail "FLUSHALL"
"$SIM" --trace "$TRACE" --engines 3 --device-blocks 64 --host-blocks 256 --disk-blocks 512 \
    --remote "redis://127.0.0.1:$port" --json >"$dir/f.json" 2>"$dir/f.err" || { cat "$dir/f.err"; fail "fleet run exited $?"; }

python3 - "$dir/1.json" "$dir/2.json" "$dir/s1.json" "$dir/s2.json" "$dir/f.json" "$dir/2.svg" <<'EOF' || fail "checks above"
import json, re, sys
a, b, sa, sb, fl = (json.load(open(p)) for p in sys.argv[1:6])
for n, r in (("first", a), ("second", b), ("sched first", sa), ("sched second", sb)):
    print("%-6s run: hit_blocks %d of %d, remote_hit_blocks %d, remote_imported_blocks %d, data_mismatches %d"
          % (n, r["hit_blocks"], r["prompt_blocks"], r["remote_hit_blocks"], r["remote_imported_blocks"],
             r["data_mismatches"]))
bad = []
if a["remote_imported_blocks"] != 0: bad.append("the first run found blocks it did not store")
if b["remote_imported_blocks"] <= 0: bad.append("the second run found nothing the first stored")
if b["remote_hit_blocks"] <= a["remote_hit_blocks"]: bad.append("the second run got no more remote hits")
if b["hit_blocks"] <= a["hit_blocks"]: bad.append("the second run got no more hits")
if sa["remote_imported_blocks"] != 0: bad.append("the first scheduler run found blocks it did not store")
if sb["remote_imported_blocks"] <= 0 or sb["remote_hit_blocks"] <= 0:
    bad.append("the second scheduler run got no remote hits from what the first stored")
for n, r in (("sched first", sa), ("sched second", sb)):
    if not (r["offloaded_blocks_host_to_disk"] > 0 and r["offloaded_blocks_host_to_remote"] > 0 and r["disk_hit_blocks"] > 0):
        bad.append("%s run: host, disk and remote tiers not all in use" % n)
print("fleet  run: hit_blocks %d of %d, remote_hit_blocks %d, remote_imported_blocks %d over %d engines"
      % (fl["hit_blocks"], fl["prompt_blocks"], fl["remote_hit_blocks"], fl["remote_imported_blocks"], fl["engines"]))
if fl["remote_imported_blocks"] <= 0 or fl["remote_hit_blocks"] <= 0:
    bad.append("fleet run: no engine got remote hits from what another stored")
for n, r in (("first", a), ("second", b), ("sched first", sa), ("sched second", sb), ("fleet", fl)):
    if r["data_mismatches"] or r["remote_checksum_errors"] or r["remote_io_errors"]:
        bad.append("%s run: data mismatches or remote errors" % n)
    if r["verified_blocks"] < r["hit_blocks"]:
        bad.append("%s run: not every hit byte-checked" % n)
# --svg's cumulative hit rate (the orange line, panel y 300 = 0 .. 70 = 1) ends at the report's, G4 hits included
m = re.search(r'<polyline fill="none" points="([^"]*)" stroke="#ff7f0e"', open(sys.argv[6]).read())
svg_rate = (300 - float(m.group(1).split()[-1].split(",")[1])) / 230 if m else -1
print("second run: --svg cumulative hit rate %.3f, report %.3f" % (svg_rate, b["hit_rate"]))
if abs(svg_rate - b["hit_rate"]) > 0.01: bad.append("second run: --svg's hit rate leaves out the remote hits")
for m in bad: print("FAIL:", m)
sys.exit(1 if bad else 0)
EOF
echo "4 passed, 0 failed"
