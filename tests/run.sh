#!/bin/sh
# Runs every test program given on the command line and adds up their summaries.
# Ends with the plain line "N passed, N failed, N skipped"; exits non-zero if anything failed.
passed=0 failed=0 skipped=0
for t in "$@"; do
    echo "== $t"
    out=$(sh -c "$t" 2>&1); rc=$?
    printf '%s\n' "$out" | grep -v -E '^[0-9]+ passed, [0-9]+ failed'
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $t: exited $rc without a summary"; failed=$((failed + 1)); continue
    fi
    p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
    f=$(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
    s=$(echo "$line" | sed -n -E 's/.*, ([0-9]+) skipped.*/\1/p'); s=${s:-0}
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then echo "FAIL $t: exit status $rc"; failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
