#!/bin/sh
# build/kvtop against a running engine (issue 7), the way a person uses it: serve_sim --console serves a
# paced run on a Unix socket, kvtop runs in a detached tmux pane (160x50) and the pane is read back with
# capture-pane. Checks: the slot table and the hit rate appear; `p` pauses the engine (PAUSED shown, the
# step number stops); `r` resumes it (the step number moves again). Offline: kvtop --log --once on a log
# that serve_sim --record wrote shows the slots and the hit rate, and a log cut 10 bytes short is
# reported damaged at the right byte; a socket that is no kvcache console makes --once exit 1. Every wait
# has a deadline (10 s at most).
# Run from the repository root after `make build/serve_sim build/kvtop`. Ends with "N passed, N failed[, N skipped]".
# shellcheck disable=SC2317 # the functions below run through wait_for and the trap
SIM=${SIM:-build/serve_sim}
TOP=${TOP:-build/kvtop}

if ! command -v tmux >/dev/null 2>&1; then
    echo "skipped: tmux not installed"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
for p in "$SIM" "$TOP"; do
    if [ ! -x "$p" ]; then
        echo "FAIL: $p not built"
        echo "0 passed, 1 failed"
        exit 1
    fi
done

dir=$(mktemp -d "${TMPDIR:-/tmp}/kvtop_tmux.XXXXXX") || { echo "0 passed, 1 failed"; exit 1; }
session=kvtop$$
tm() { tmux -L "$session" -f /dev/null "$@"; } # a tmux server of its own: no user config, no other sessions
unset TMUX
sim_pid=""
cleanup() {
    tm kill-server 2>/dev/null
    if [ -n "$sim_pid" ]; then kill "$sim_pid" 2>/dev/null; wait "$sim_pid" 2>/dev/null; fi
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

passed=0 failed=0
ok() { echo "ok $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }
finish() {
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    exit
}

# wait_for SECONDS COMMAND...: runs COMMAND every 0.2 s until it succeeds (0) or SECONDS have passed (1)
wait_for() {
    tries=$(($1 * 5))
    shift
    while [ "$tries" -gt 0 ]; do
        "$@" && return 0
        sleep 0.2
        tries=$((tries - 1))
    done
    return 1
}

STATES='Initialized|OnboardStaged|Onboarding|Prefilling|Decoding|SkippedPrefill|SkippedDecode|Preempted|Finishing|Finished'
has_slots() { grep -q '^Slots (' "$1" && grep -Eq "^[> ] +[0-9]+  ($STATES) " "$1"; }
has_hit_rate() { grep -Eq '^hit rate [0-9]+\.[0-9]%' "$1"; }

# ---- offline: a recorded log ----------------------------------------------------------------------------
log=$dir/run.log
if "$SIM" --requests 50 --record "$log" >"$dir/record.out" 2>&1 && [ -s "$log" ]; then
    size=$(wc -c <"$log")
    records=$(((size - 16) / 84))
    "$TOP" --log "$log" --once >"$dir/once.txt" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && has_slots "$dir/once.txt" && has_hit_rate "$dir/once.txt" &&
        grep -q "^log: $records records" "$dir/once.txt"; then
        ok "log: kvtop --log --once shows the slots, the hit rate and all $records records"
    else
        fail "log: kvtop --log --once (exit $rc) should show Slots, a hit rate and 'log: $records records':"
        sed 's/^/    /' "$dir/once.txt"
    fi
    head -c $((size - 10)) "$log" >"$dir/cut.log"
    "$TOP" --log "$dir/cut.log" --once >"$dir/cut.txt" 2>&1
    rc=$?
    want="log damaged at byte $((16 + (records - 1) * 84)) (truncated), $((records - 1)) records kept"
    if [ $rc -eq 0 ] && grep -qF "$want" "$dir/cut.txt" && has_slots "$dir/cut.txt"; then
        ok "log: cut 10 bytes short, kvtop says '$want'"
    else
        fail "log: cut 10 bytes short, kvtop (exit $rc) should say '$want':"
        sed 's/^/    /' "$dir/cut.txt"
    fi
else
    fail "serve_sim --requests 50 --record did not write a log:"
    tail -n 5 "$dir/record.out"
    failed=$((failed + 1)) # the check of the cut log cannot run either
fi

# ---- a socket that is no kvcache console: --once says so and exits 1 ----------------------------------
other=$dir/other.sock
python3 - "$other" <<'EOF' &
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
s.settimeout(10)
c, _ = s.accept()
c.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
time.sleep(2)
EOF
i=0
while [ ! -S "$other" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
"$TOP" --once "$other" >"$dir/other.txt" 2>&1
rc=$?
if [ $rc -eq 1 ] && grep -q "not a kvcache event stream" "$dir/other.txt"; then
    ok "a socket that is no kvcache console: kvtop --once says so and exits 1"
else
    fail "a socket that is no kvcache console: kvtop --once exit $rc, expected 1:"
    sed 's/^/    /' "$dir/other.txt"
fi
wait

# ---- live: kvtop in a tmux pane on serve_sim's console ------------------------------------------------
sock=$dir/sock
"$SIM" --requests 400 --pace-us 20000 --console "$sock" >"$dir/sim.out" 2>&1 &
sim_pid=$!
socket_there() { [ -S "$sock" ]; }
if ! wait_for 10 socket_there; then
    fail "serve_sim --console did not create $sock in 10 s:"
    tail -n 5 "$dir/sim.out"
    failed=$((failed + 2)) # pause and resume cannot be checked
    finish
fi

# the pane keeps kvtop's exit status on screen if it ends early
tm new-session -d -s "$session" -x 160 -y 50 -c "$PWD" \
    "$TOP $sock; echo \"kvtop exited with status \$?\"; sleep 60" || {
    fail "tmux new-session failed"
    failed=$((failed + 2))
    finish
}
pane=$dir/pane.txt
capture() { tm capture-pane -p -t "$session" >"$pane" 2>/dev/null; }
show_pane() { sed 's/^/    | /' "$pane"; }
step_now() { capture && head -n 1 "$pane" | sed -n 's/.*  step \([0-9][0-9]*\) .*/\1/p'; }
slots_shown() { capture && has_slots "$pane" && has_hit_rate "$pane"; }
paused_shown() { capture && head -n 1 "$pane" | grep -q 'PAUSED at '; }
step_after() { s=$(step_now) && [ -n "$s" ] && [ "$s" -gt "$1" ] && ! head -n 1 "$pane" | grep -q PAUSED; }

if wait_for 10 slots_shown; then
    ok "live: the pane shows the slot table and the hit rate ($(grep '^hit rate' "$pane" | sed 's/  (.*//'))"
else
    fail "live: no slot table with a state and a 'hit rate' line in 10 s:"
    show_pane
fi

tm send-keys -t "$session" p
if wait_for 10 paused_shown; then
    s1=$(step_now)
    sleep 1
    s2=$(step_now)
    if [ -n "$s1" ] && [ "$s1" = "$s2" ]; then
        ok "live: p pauses the engine: $(head -n 1 "$pane" | sed 's/.*\[PAUSED/[PAUSED/'), step $s1 a second later too"
    else
        fail "live: paused, but the step moved from '$s1' to '$s2' in a second:"
        show_pane
    fi
else
    fail "live: p did not show PAUSED in 10 s:"
    show_pane
    s2=$(step_now)
fi

tm send-keys -t "$session" r
if [ -n "$s2" ] && wait_for 10 step_after "$s2"; then
    ok "live: r resumes it: step $s2 -> $(step_now)"
else
    fail "live: r did not move the step past '$s2' in 10 s:"
    show_pane
fi
finish
