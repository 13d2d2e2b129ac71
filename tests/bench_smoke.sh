#!/bin/sh
# kvbench runs to the end in the sections that need no Redis server, GPU or spare disk (cancel, pipeline,
# replay, sched, observe): their own checks hold (pool invariants, transfer states, hits against the
# bare LRU map) and none refuses its setup, as the cancel section did once a pipeline capped its
# batches. No time is judged here: `make bench` reports those against their goals.
BIN=${1:-build/kvbench}
if out=$("$BIN" --only cancel,pipeline,replay,sched,observe --json 2>&1) &&
   printf '%s\n' "$out" | grep -q '"sched_step_scaling"'; then
    echo "ok   kvbench --only cancel,pipeline,replay,sched,observe"
    echo "1 passed, 0 failed"
else
    printf '%s\n' "$out" | tail -n 5
    echo "FAIL kvbench --only cancel,pipeline,replay,sched,observe"
    echo "0 passed, 1 failed"
    exit 1
fi
