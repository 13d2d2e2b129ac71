#!/bin/sh
# serve_sim's eviction options (issue 14): every policy replays the sample trace with its pool checked;
# --fol-step gives FOL a fixed step and the report says it; the self-tuning default reports the step and
# the rule for tails it chose; a device-only replay is timed --timing-runs times (5), once with 1; a bad
# policy name or value exits 2 (a number with blanks or a sign too); prompts that end inside their last id's block are counted; fractional ms
# timestamps are read, not skipped; a trace with more than 1% of its lines malformed exits 2 unless
# --skip-bad (a file in another format says so in a few lines, a gzip'd one in one), one cut off mid-line
# replays the rest with a warning; output_length may be left out with
# --sequential, not without; timestamps that count from anywhere (epoch ms) start the clock at the first
# arrival (the queue samples once spun up to it, for ever); a directory or an empty prompt is an error
# that says so; --check-lru matches on a trace that reuses an id under another prefix. Ends with
# "N passed, N failed".
SIM=${SIM:-build/serve_sim}
T=examples/traces/small.jsonl
pass=0 fail=0
ok() { echo "ok   $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }
for e in lineage lru fol arc s3fifo; do
    out=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --eviction $e --json 2>&1) &&
        echo "$out" | grep -q "\"eviction\":[[:space:]]*\"$e\"" && ok "--eviction $e" || bad "--eviction $e"
done
out=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --eviction fol --fol-step 100 --json)
echo "$out" | grep -q '"fol_step_end":[[:space:]]*100' && ok "--fol-step 100 is the step in use" || bad "--fol-step 100"
echo "$out" | grep -q '"fol_tails_first_end":[[:space:]]*1' && ok "a fixed step puts tails first" || bad "fixed step: tails first"
out=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --eviction fol)
echo "$out" | grep -q "FOL class step .*(self-tuning), tails " && ok "the self-tuning step and rule for tails are reported" ||
    bad "self-tuning step report"
a=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --eviction fol --json | grep -o '"hit_blocks":[^,]*')
b=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --eviction fol --fol-ghost 500 --json | grep -o '"hit_blocks":[^,]*')
[ -n "$a" ] && [ -n "$b" ] && ok "--fol-ghost accepted ($a / $b)" || bad "--fol-ghost"
svg=$(mktemp /tmp/eviction_sim.XXXXXX)
$SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --eviction fol --svg "$svg" >/dev/null &&
    grep -q "FOL class step" "$svg" && ok "--svg draws the FOL step over time" || bad "--svg FOL step"
rm -f "$svg"
out=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --check-lru --json)
echo "$out" | grep -q '"timing_runs":[[:space:]]*5' && ok "the device-only replay is timed 5 times (median)" ||
    bad "timing runs by default"
out=$($SIM --sequential --trace $T --device-blocks 64 --host-blocks 0 --check-lru --timing-runs 1 --json)
echo "$out" | grep -q '"timing_runs":[[:space:]]*1' && ok "--timing-runs 1: one timed run" || bad "--timing-runs 1"
pt=$(mktemp /tmp/eviction_sim.XXXXXX)
printf '%s\n' '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}' \
    '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]}' >"$pt"
out=$($SIM --sequential --trace "$pt" --device-blocks 8 --host-blocks 0 --eviction fol --json)
echo "$out" | grep -q '"partial_last_blocks":[[:space:]]*1' && ok "a prompt that ends inside its last id's block is counted (and told)" ||
    bad "partial last blocks"
rm -f "$pt"
ft=$(mktemp /tmp/eviction_sim.XXXXXX)
printf '%s\n' '{"timestamp": 0.0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}' \
    '{"timestamp": 0.5, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}' \
    '{"timestamp": 1.25, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}' >"$ft"
out=$($SIM --sequential --trace "$ft" --device-blocks 8 --host-blocks 0 --json 2>/dev/null)
echo "$out" | grep -q '"requests":[[:space:]]*3' && echo "$out" | grep -q '"hit_blocks":[[:space:]]*4' &&
    ok "fractional ms timestamps are read, not skipped" || bad "fractional timestamps"
rm -f "$ft"
printf '%s\n' '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [4611686018427387904, 2]}' >"$ft"
$SIM --sequential --trace "$ft" --device-blocks 8 --host-blocks 0 2>&1 | grep -q 'below 9e15' &&
    ok "a hash id past 9e15 is reported as out of range" || bad "hash id range message"
rm -f "$ft"
M=examples/traces/malformed.jsonl # 5 lines, 2 of them malformed
err=$($SIM --sequential --trace $M --device-blocks 64 --host-blocks 0 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && echo "$err" | grep -q '2 of 5 lines malformed.*--skip-bad' &&
    ok "a trace with malformed lines exits 2 and says how many" || bad "malformed lines: exit $rc: $err"
out=$($SIM --sequential --trace $M --device-blocks 64 --host-blocks 0 --skip-bad --json 2>/dev/null) &&
    echo "$out" | grep -q '"malformed_lines":[[:space:]]*2' && echo "$out" | grep -q '"requests":[[:space:]]*3' &&
    ok "--skip-bad replays the good lines and counts the others" || bad "--skip-bad"
{ i=0; while [ $i -lt 150 ]; do echo "{\"timestamp\": $i, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1, 2]}"
  i=$((i + 1)); done; printf '{"timestamp": 150, "input_len'; } >"$ft"
out=$($SIM --sequential --trace "$ft" --device-blocks 8 --host-blocks 0 --json 2>"$ft.err") &&
    grep -q '1 of 151 lines malformed, skipped' "$ft.err" && echo "$out" | grep -q '"requests":[[:space:]]*150' &&
    ok "a long trace cut off mid-line replays the rest with a warning" || bad "a trace cut off mid-line: $(cat "$ft.err")"
rm -f "$ft.err"
{ echo "timestamp,input_length,output_length"; i=0; while [ $i -lt 40 ]; do echo "$i,1024,1"; i=$((i + 1)); done
  head -n 2 $T; } >"$ft"
err=$($SIM --sequential --trace "$ft" --device-blocks 64 --host-blocks 0 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(echo "$err" | wc -l)" -le 6 ] && echo "$err" | grep -q '41 of 43 lines malformed' &&
    ok "a file in another format exits 2 in a few lines" || bad "another format: exit $rc: $err"
gzip -c $T >"$ft"
err=$($SIM --sequential --trace "$ft" --device-blocks 64 --host-blocks 0 --skip-bad 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(echo "$err" | wc -l)" -eq 1 ] && echo "$err" | grep -q 'gzip-compressed.*gunzip' &&
    ok "a gzip'd trace exits 2 with one message" || bad "gzip'd trace: exit $rc: $err"
printf '%s\n' '{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}' \
    '{"timestamp": 1, "input_length": 1024, "hash_ids": [1, 2]}' >"$ft"
out=$($SIM --sequential --trace "$ft" --device-blocks 8 --host-blocks 0 --json) &&
    echo "$out" | grep -q '"requests":[[:space:]]*2' && echo "$out" | grep -q '"hit_blocks":[[:space:]]*2' &&
    ok "--sequential replays lines without output_length" || bad "--sequential without output_length"
err=$($SIM --trace "$ft" --device-blocks 8 --host-blocks 0 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && echo "$err" | grep -q '"output_length" is missing.*--sequential' &&
    ok "the scheduler still needs output_length, and says --sequential does not" || bad "scheduler without output_length: exit $rc: $err"
rm -f "$ft"
$SIM --sequential --trace $T --host-blocks 0 --timing-runs 0 >/dev/null 2>&1; [ $? -eq 2 ] && ok "--timing-runs 0 exits 2" ||
    bad "--timing-runs 0"
$SIM --sequential --trace $T --eviction nosuch >/dev/null 2>&1; [ $? -eq 2 ] && ok "unknown policy exits 2" || bad "unknown policy"
$SIM --sequential --trace $T --fol-step x >/dev/null 2>&1; [ $? -eq 2 ] && ok "bad --fol-step exits 2" || bad "bad --fol-step"
for v in " -1" "+1" " 1"; do # strtoull's blanks and sign: " -1" was seed 2^64 - 1
    $SIM --requests 1 --seed "$v" >/dev/null 2>&1; [ $? -eq 2 ] && ok "--seed '$v' exits 2" || bad "--seed '$v' accepted"
done
ft=$(mktemp /tmp/eviction_sim.XXXXXX)
printf '{"timestamp": 1700000000000, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]}\n{"timestamp": 1700000060000, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]}\n' >"$ft"
out=$(timeout 60 $SIM --trace "$ft" --block-tokens 512 --json 2>&1)
echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if 60 <= d["sim_seconds"] < 120 else 1)' 2>/dev/null &&
    ok "epoch timestamps: the clock starts at the first arrival (60 s simulated)" || bad "epoch timestamps: $out"
printf '{"timestamp": 0, "input_length": 0, "output_length": 4, "hash_ids": []}\n' >"$ft"
err=$($SIM --trace "$ft" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && echo "$err" | grep -q "empty prompt" && ok "an empty prompt is a malformed line" || bad "empty prompt: exit $rc: $err"
printf '{"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [0, 1]}\n{"timestamp": 1, "input_length": 16, "output_length": 4, "hash_ids": [1]}\n' >"$ft"
$SIM --check-lru --trace "$ft" --block-tokens 16 --host-blocks 0 --device-blocks 8 >/dev/null 2>&1 &&
    ok "--check-lru matches when an id comes back under another prefix" || bad "--check-lru with an id under another prefix"
rm -f "$ft"
d=$(mktemp -d /tmp/eviction_sim.XXXXXX)
err=$($SIM --trace "$d" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && echo "$err" | grep -q "Is a directory" && ok "a directory for --trace says so" || bad "--trace DIR: exit $rc: $err"
rmdir "$d"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
