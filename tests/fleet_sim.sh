#!/bin/sh
# serve_sim --engines / --route (issue 18): a fleet of engines on one simulated clock with the KV-aware
# router in front. Everything here is simulated time, so every figure is deterministic:
#  - KV-aware routing never gets a lower fleet hit rate than round-robin, on synthetic workloads of
#    several seeds and fleet sizes, on every shape build/workloads generates (chat, api, docs, agent,
#    burst, mixed; 1,000 requests each, 4 engines) and on the sample trace;
#  - --engines auto keeps every engine under 0.8 utilisation without hits (and one engine fewer would
#    not), and keeps TTFT p99 within three full scheduler steps (5 ms + 8192 tokens x 60 us each);
#  - --engines 1 on a trace that overloads one engine warns on stderr and says so in the JSON;
#    --engines auto on it runs several engines and does not warn;
#  - the same fleet run twice gives the same report; bad combinations (and --shard values past 32 bits)
#    are refused with exit 2, and so are workloads' bad numbers, unwritable output, an empty --shapes list and
#    more than 32 --capacities (a sweep of nothing, or of the first 32, exited 0); --engines auto goes
#    with --record when it chooses one engine.
# Run from the repository root after `make build/serve_sim build/workloads`. Ends with "N passed, N failed".
SIM=${SIM:-build/serve_sim}
WORKLOADS=${WORKLOADS:-build/workloads}
TRACE=examples/traces/small.jsonl
passed=0
failed=0

if [ ! -x "$SIM" ] || ! command -v python3 >/dev/null 2>&1; then
    echo "FAIL: $SIM not built, or no python3 to read its JSON"
    echo "0 passed, 1 failed"
    exit 1
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/fleet_sim.XXXXXX") || { echo "0 passed, 1 failed"; exit 1; }
trap 'rm -rf "$dir"' EXIT
trap 'exit 1' INT TERM HUP

ok() { passed=$((passed + 1)); echo "ok: $*"; }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# field FILE KEY: a top-level number (or boolean) of serve_sim's JSON
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
# cmp_ge A B: A >= B as numbers
ge() { python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) >= float(sys.argv[2]) else 1)' "$1" "$2"; }

run() { # run NAME ARGS...: JSON to $dir/NAME.json, stderr to $dir/NAME.err
    name=$1
    shift
    if ! "$SIM" "$@" --json >"$dir/$name.json" 2>"$dir/$name.err"; then
        cat "$dir/$name.err"
        bad "serve_sim $* exited non-zero"
        return 1
    fi
}

# ---- KV-aware routing vs round-robin ---------------------------------------------------------------
for seed in 1 2 3; do
    for n in 2 4; do
        run kv --requests 1000 --seed $seed --engines $n --route kv || continue
        run rr --requests 1000 --seed $seed --engines $n --route rr || continue
        kv=$(field "$dir/kv.json" hit_rate)
        rr=$(field "$dir/rr.json" hit_rate)
        if ge "$kv" "$rr"; then ok "synthetic seed $seed, $n engines: kv hit rate $kv >= round-robin $rr"
        else bad "synthetic seed $seed, $n engines: kv hit rate $kv < round-robin $rr"; fi
    done
done
if [ -x "$WORKLOADS" ]; then
    for shape in chat api docs agent burst mixed longchat templates; do
        if ! "$WORKLOADS" --write $shape "$dir/$shape.jsonl" --requests 1000 >/dev/null 2>&1; then
            bad "$WORKLOADS --write $shape failed"
            continue
        fi
        run kv --trace "$dir/$shape.jsonl" --engines 4 --route kv || continue
        run rr --trace "$dir/$shape.jsonl" --engines 4 --route rr || continue
        kv=$(field "$dir/kv.json" hit_rate)
        rr=$(field "$dir/rr.json" hit_rate)
        if ge "$kv" "$rr"; then ok "generated $shape trace, 4 engines: kv hit rate $kv >= round-robin $rr"
        else bad "generated $shape trace, 4 engines: kv hit rate $kv < round-robin $rr"; fi
    done
else
    bad "$WORKLOADS not built (make build/workloads)"
fi
if run kv --trace $TRACE --engines 3 --route kv && run rr --trace $TRACE --engines 3 --route rr; then
    kv=$(field "$dir/kv.json" hit_rate)
    rr=$(field "$dir/rr.json" hit_rate)
    if ge "$kv" "$rr"; then ok "trace, 3 engines: kv hit rate $kv >= round-robin $rr"
    else bad "trace, 3 engines: kv hit rate $kv < round-robin $rr"; fi
fi

# ---- --engines auto ----------------------------------------------------------------------------
# p99 within three full steps: 3 x (5 ms + 8192 x 60 us)
few_steps=1489.5
check_auto() { # check_auto LABEL (reads $dir/auto.json)
    n=$(field "$dir/auto.json" engines)
    work=$(field "$dir/auto.json" offered_work_engines)
    p99=$(field "$dir/auto.json" ttft_p99_ms)
    if python3 -c 'import sys; n, w = int(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if w / n < 0.8 and (n == 1 or w / (n - 1) >= 0.8) else 1)' "$n" "$work"; then
        ok "$1: --engines auto chose $n for $work engines' work (the smallest under 0.8 utilisation)"
    else
        bad "$1: --engines auto chose $n for $work engines' work"
    fi
    if ge "$few_steps" "$p99"; then ok "$1: TTFT p99 $p99 ms within three full steps ($few_steps ms)"
    else bad "$1: TTFT p99 $p99 ms beyond three full steps ($few_steps ms)"; fi
}
if run auto --engines auto; then check_auto "synthetic"; fi
if run auto --trace $TRACE --engines auto; then
    check_auto "trace"
    n=$(field "$dir/auto.json" engines)
    if [ "$n" -ge 2 ] && ! grep -q "warning" "$dir/auto.err"; then ok "trace: auto runs $n engines, no warning"
    else bad "trace: auto runs $n engines; stderr: $(cat "$dir/auto.err")"; fi
fi

# ---- one engine on an overloaded trace warns ----------------------------------------------------------
if run one --trace $TRACE --engines 1; then
    if grep -q "warning: offered load .* cannot keep up" "$dir/one.err" && [ "$(field "$dir/one.json" overloaded)" = True ]; then
        ok "trace, 1 engine: warns that the load exceeds its capacity"
    else
        bad "trace, 1 engine: no overload warning (stderr: $(cat "$dir/one.err"))"
    fi
fi
if "$SIM" --trace $TRACE --engines 1 2>&1 >/dev/null | grep -q "OVERLOADED\|warning"; then
    ok "trace, 1 engine: the text run warns too"
else
    bad "trace, 1 engine: the text run does not warn"
fi

# ---- determinism, refusals -----------------------------------------------------------------------
run a --requests 800 --engines 3 --route kv && run b --requests 800 --engines 3 --route kv &&
    if python3 - "$dir/a.json" "$dir/b.json" <<'EOF'
import json, sys
def strip(d):
    for k in ("wall_seconds", "cpu_us_per_step", "cpu_us_per_step_p99"):
        d.pop(k, None)
    return d
sys.exit(0 if strip(json.load(open(sys.argv[1]))) == strip(json.load(open(sys.argv[2]))) else 1)
EOF
    then ok "the same fleet run twice reports the same"
    else bad "two runs of the same fleet differ"; fi
for args in "--engines 2 --sequential" "--engines 0" "--engines 2 --record $dir/x.log" "--route nearest" \
    "--shard 1/4294967298" "--shard 0/4294967297" "--shard 2/2"; do
    # shellcheck disable=SC2086
    "$SIM" --requests 10 $args >/dev/null 2>"$dir/refused.err"
    rc=$?
    if [ $rc -eq 2 ]; then ok "refused with exit 2: $args"
    else bad "$args: exit $rc, expected 2"; fi
done

for args in "--list --requests 4294967297" "--list --requests 10x" "--list --block-tokens 4294967808" \
    "--list --scale nan" "--write chat /dev/full --requests 20" "--write chat" "--sweep --requests 10 --shapes ," \
    "--sweep --requests 10 --shapes chat --capacities $(seq -s, 1 33)"; do
    # shellcheck disable=SC2086
    "$WORKLOADS" $args >/dev/null 2>"$dir/wl.err"
    rc=$?
    if [ $rc -eq 2 ] && [ -s "$dir/wl.err" ]; then ok "workloads refuses with exit 2: $args"
    else bad "workloads $args: exit $rc, expected 2 with a message"; fi
done
if "$SIM" --requests 10 --engines auto --record "$dir/auto.log" >/dev/null 2>"$dir/auto.err"; then
    ok "--engines auto with --record (it chose one engine)"
else bad "--engines auto --record: $(cat "$dir/auto.err")"; fi

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
