#!/bin/sh
# matrix.sh — the compile matrix of `make test`: every header and kvcache.h as C11 (gcc, clang), as
# C++17 (g++, clang++) and in static mode, a two-translation-unit link, the examples with the command
# each documents, the README's quick start both ways, and an install into a temporary prefix.
#
# Prints one line per entry (ok / FAIL / skip, as kvtest.h) and the summary "N passed, N failed,
# N skipped" that tests/run.sh adds up. Run from the repository root; the Makefile passes the settings
# (defaults below) and documents the warning flags. A failed entry prints its command's output.
set -u

B=${MATRIX_DIR:-build/matrix}
PARTS=${MATRIX_PARTS:-kvblock.h kvoffload.h}
OTHER=${MATRIX_OTHER_HEADERS:-}   # headers outside kvcache.h (kvcuda.h, ...): C and C++, not static mode
STB=${MATRIX_STB_INC:-/usr/include/stb}
CUDA_LIB=${MATRIX_CUDA_LIB:-build/libkvcuda.a} # installed too when it was built (make cuda)
JOBS=${MATRIX_JOBS:-2}
MAKE_CMD=${MATRIX_MAKE:-make}
GCC=${MATRIX_GCC:-gcc}
CLANG=${MATRIX_CLANG:-clang}
GXX=${MATRIX_GXX:-g++}
CLANGXX=${MATRIX_CLANGXX:-clang++}
WARN_C=${MATRIX_WARN_C:--std=c11 -Wall -Wextra -Wpedantic -Werror -Wshadow -Wstrict-prototypes}
WARN_CXX=${MATRIX_WARN_CXX:--std=c++17 -Wall -Wextra -Wpedantic -Werror -Wshadow}
CONV_GCC=${MATRIX_CONV_GCC:--Wconversion -Wsign-conversion}
CONV_CLANG=${MATRIX_CONV_CLANG:-}
STATIC_WAIVE=${MATRIX_STATIC_WAIVE:-}
# Each header compiles once with gcc -O0, clang, g++ and clang++ (front-end warnings; clang and the C++
# compilers only check, -fsyntax-only); kvcache.h, which holds all the code, also with gcc at OPT and at
# -O3, where gcc's -Wmaybe-uninitialized runs (make demo builds at -O2, make bench at -O3).
OPT=${MATRIX_OPT:--O2}
# The commands the README gives for its quick start; entries below run them as written.
README_SPLIT='cc -std=c11 -I. -I/usr/include/stb example.c -o example -pthread && ./example'
README_SINGLE='cc -std=c11 -I/usr/include/stb example.c -o example -pthread && ./example'
# A new user's first try: strict C11, warnings as errors, no -D_GNU_SOURCE (the implementation asks for
# POSIX itself), no -pthread (glibc 2.34+ has the threads in libc).
PLAIN_C11="$GCC -std=c11 -Wall -Wextra -Werror -I. -I$STB" 

ROOT=$(pwd)
rm -rf "$B"
mkdir -p "$B" || exit 1

# ---- entries: recorded first, then run by JOBS lanes that each claim the next one not taken ----------

n=0
quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
entry() { # entry NAME COMMAND [ARGS...]: COMMAND exits 0 (ok), 77 (skip: last output line says why) or else
    n=$((n + 1))
    id=$(printf '%03d' "$n")
    printf '%s\n' "$1" >"$B/$id.name"
    shift
    cmd=""
    for a in "$@"; do cmd="$cmd $(quote "$a")"; done
    printf '%s\n' "$cmd" >"$B/$id.cmd"
}

lane() {
    i=0
    while [ "$i" -lt "$n" ]; do
        i=$((i + 1))
        id=$(printf '%03d' "$i")
        mkdir "$B/$id.claim" 2>/dev/null || continue # mkdir is atomic: one lane gets each entry
        (eval "$(cat "$B/$id.cmd")") >"$B/$id.log" 2>&1
        echo $? >"$B/$id.rc"
    done
}

have() { command -v "$1" >/dev/null 2>&1 || { echo "$1 not found"; exit 77; }; }

impl_of() { # the implementation macros a header needs in one translation unit
    case $1 in
        kvblock.h) echo "-DKVBLOCK_IMPLEMENTATION" ;;
        kvoffload.h) echo "-DKVBLOCK_IMPLEMENTATION -DKVOFFLOAD_IMPLEMENTATION" ;;
        kvsched.h) echo "-DKVBLOCK_IMPLEMENTATION -DKVOFFLOAD_IMPLEMENTATION -DKVSCHED_IMPLEMENTATION" ;;
        *) echo "-DKVCACHE_IMPLEMENTATION" ;;
    esac
}

top_part() { # the last split header with its own implementation macro: it includes the ones below
    for p in $PARTS; do
        case $p in kvblock.h | kvoffload.h | kvsched.h) t=$p ;; esac
    done
    echo "$t"
}

# ---- the entries ----------------------------------------------------------------------------------

fresh() { # kvcache.h is what amalgamate.sh writes from the split headers
    [ -f kvcache.h ] || { echo "kvcache.h is missing: run sh amalgamate.sh"; exit 1; }
    sh amalgamate.sh "$B/kvcache.fresh.h" || exit 1
    cmp -s kvcache.h "$B/kvcache.fresh.h" && exit 0
    diff -u kvcache.h "$B/kvcache.fresh.h" | head -20
    echo "kvcache.h is out of date with the split headers: run sh amalgamate.sh"
    exit 1
}

compile() { # compile CC FLAGS HEADER: the header with its implementation as one translation unit
    have "$1"
    case "$2" in *-DKVO_WITH_REDIS*) [ -f /usr/include/hiredis/hiredis.h ] || { echo "no hiredis/hiredis.h"; exit 77; } ;; esac
    # shellcheck disable=SC2046,SC2086
    "$1" $2 -D_GNU_SOURCE -I. -I"$STB" $(impl_of "$3") -DMATRIX_HEADER="\"$3\"" \
        -c tests/compile/header.c -o "$B/$(echo "$1 $2 $3" | cksum | tr ' ' _).o"
}

static_mode() { # static_mode CC FLAGS HEADER: everything private; links and runs
    have "$1"
    o=$B/$(echo "static $1 $3" | tr -c 'A-Za-z0-9.\n' _)
    # shellcheck disable=SC2046,SC2086
    "$1" $2 $STATIC_WAIVE -D_GNU_SOURCE -I. -I"$STB" $(impl_of "$3") -DKVB_STATIC -DKVO_STATIC -DKVS_STATIC \
        -DMATRIX_HEADER="\"$3\"" -c tests/compile/static_use.c -o "$o.o" || exit 1
    globals=$(nm -g --defined-only "$o.o" | awk '{print $3}' | grep -v '^main$')
    if [ -n "$globals" ]; then
        echo "static mode left global symbols:"
        echo "$globals" | head -20
        exit 1
    fi
    "$1" "$o.o" -o "$o" -pthread -lm && "$o"
}

link_two() { # link_two NAME IMPL-HEADER USE-HEADER USE-COMPILER USE-LANG: implementation in one object, use in another
    have "$4"
    d=$B/link-$1
    mkdir -p "$d"
    # shellcheck disable=SC2046,SC2086
    $GCC $WARN_C -D_GNU_SOURCE -I. -I"$STB" $(impl_of "$2") -DMATRIX_HEADER="\"$2\"" \
        -c tests/compile/header.c -o "$d/impl.o" || exit 1
    # shellcheck disable=SC2086
    "$4" $5 -D_GNU_SOURCE -I. -I"$STB" -DMATRIX_HEADER="\"$3\"" -c tests/compile/link_use.c -o "$d/use.o" || exit 1
    "$4" "$d/use.o" "$d/impl.o" -o "$d/prog" -pthread -lm && "$d/prog"
}

example() { # example FILE: the cc command its first comment documents, output into $B
    f=$1
    cmd=$(awk '
        /\*\// { if (!go) exit }
        go { line = $0; sub(/^ \*[ \t]*/, "", line); cmd = cmd " " line; if (line !~ /\\$/) { print cmd; exit } next }
        /^ \*[ \t]+cc / { go = 1; line = $0; sub(/^ \*[ \t]*/, "", line); cmd = line; if (line !~ /\\$/) { print cmd; exit } }
    ' "$f" | sed 's/\\//g')
    [ -n "$cmd" ] || { echo "$f: no documented cc line in its first comment"; exit 1; }
    out=$(echo "$cmd" | sed -n 's/.* -o \([^ ]*\).*/\1/p')
    [ -n "$out" ] || { echo "$f: its cc line names no -o output"; exit 1; }
    mkdir -p "$B/examples"
    cmd=$(echo "$cmd" | sed "s# -o $out # -o $B/examples/$out #; s# -o $out\$# -o $B/examples/$out#")
    echo "$cmd"
    sh -c "$cmd"
}

single_example() { # single_example FILE: the quick start made the README's single-file program
    sed -i -e 's/^#define KVBLOCK_IMPLEMENTATION$/#define KVCACHE_IMPLEMENTATION/' \
        -e 's/^#include "kvblock.h"$/#include "kvcache.h"/' "$1"
    grep -q '^#include "kvcache.h"$' "$1" || { echo "quick start: no kvblock.h include to replace"; exit 1; }
}

posix_late() { # a system header before the implementation: one #error naming the flag; with it, a build
    d=$B/posix-late
    mkdir -p "$d"
    awk '/^## Quick start/ { q = 1 } q && /^```c$/ { c = 1; next } c && /^```$/ { exit } c' README.md >"$d/body.c"
    single_example "$d/body.c" || exit 1
    { echo '#include <stdio.h> /* before the implementation: too late to ask for POSIX */'; cat "$d/body.c"; } >"$d/example.c"
    cp kvcache.h "$d/"
    # shellcheck disable=SC2086
    out=$(cd "$d" && $PLAIN_C11 example.c -o example 2>&1) && { echo "compiled without -D_GNU_SOURCE"; exit 1; }
    errors=$(printf '%s\n' "$out" | grep -c ': error:')
    printf '%s\n' "$out" | grep -q ': error: #error.*compile with -D_GNU_SOURCE' && [ "$errors" -eq 1 ] || {
        printf '%s\n' "$out" | head -20; echo "expected one #error naming -D_GNU_SOURCE ($errors error lines)"; exit 1; }
    # shellcheck disable=SC2086
    (cd "$d" && $PLAIN_C11 -D_GNU_SOURCE example.c -o example && ./example) || exit 1
}

readme_quickstart() { # readme_quickstart split|single|plain: the README's program and command, as written
    d=$B/readme-$1               # (plain: the single-file program with $PLAIN_C11)
    mkdir -p "$d"
    awk '/^## Quick start/ { q = 1 } q && /^```c$/ { c = 1; next } c && /^```$/ { exit } c' README.md >"$d/example.c"
    [ -s "$d/example.c" ] || { echo "README.md: no c block under ## Quick start"; exit 1; }
    if [ "$1" = split ]; then
        cmd=$README_SPLIT
        for p in $PARTS; do cp "$p" "$d/"; done
    else
        cmd=$README_SINGLE
        cp kvcache.h "$d/"
        single_example "$d/example.c" || exit 1
    fi
    if [ "$1" = plain ]; then
        cmd="$PLAIN_C11 example.c -o example && ./example"
    else
        grep -qF -- "$cmd" README.md || { echo "README.md no longer gives: $cmd (update tests/compile/matrix.sh with it)"; exit 1; }
    fi
    out=$(cd "$d" && sh -c "$cmd") || { echo "$out"; exit 1; }
    echo "$out"
    echo "$out" | grep -q '32 of 40' || { echo "expected '32 of 40' in the output"; exit 1; }
}

install_prefix() { # make install into a fresh prefix, use it through pkg-config, make uninstall
    have pkg-config
    case $B in /*) prefix=$B/prefix ;; *) prefix=$ROOT/$B/prefix ;; esac # MATRIX_DIR may be absolute
    rm -rf "$prefix"
    MAKEFLAGS='' MFLAGS='' MAKELEVEL='' $MAKE_CMD --no-print-directory -s install PREFIX="$prefix" || exit 1
    for f in $PARTS kvcache.h; do [ -f "$prefix/include/$f" ] || { echo "not installed: include/$f"; exit 1; }; done
    if [ -f "$CUDA_LIB" ]; then
        [ -f "$prefix/lib/libkvcuda.a" ] || { echo "$CUDA_LIB was built but not installed into lib/"; exit 1; }
    fi
    pc=$prefix/share/pkgconfig
    [ -f "$pc/kvcache.pc" ] || { echo "not installed: share/pkgconfig/kvcache.pc"; exit 1; }
    cflags=$(PKG_CONFIG_PATH=$pc pkg-config --cflags kvcache) || exit 1
    libs=$(PKG_CONFIG_PATH=$pc pkg-config --libs kvcache) || exit 1
    echo "pkg-config: --cflags $cflags --libs $libs"
    mkdir -p "$prefix/app" && cp tests/compile/installed.c "$prefix/app/" || exit 1
    # shellcheck disable=SC2086
    (cd "$prefix/app" && $GCC -std=c11 $cflags installed.c -o installed $libs && ./installed) || exit 1
    MAKEFLAGS='' MFLAGS='' MAKELEVEL='' $MAKE_CMD --no-print-directory -s uninstall PREFIX="$prefix" || exit 1
    left=$(find "$prefix" -type f ! -path "$prefix/app/*")
    [ -z "$left" ] || { echo "left after make uninstall: $left"; exit 1; }
}

# ---- the matrix -------------------------------------------------------------------------------------

# the slowest first, so that the lanes end together
for f in examples/*.c; do
    [ -f "$f" ] && entry "example $f with its documented cc line" example "$f"
done
entry "c11 gcc $OPT kvcache.h" compile "$GCC" "$WARN_C $CONV_GCC $OPT" kvcache.h
entry "c11 gcc -O3 kvcache.h" compile "$GCC" "$WARN_C $CONV_GCC -O3" kvcache.h
# kvremote.h's Redis code (KVO_WITH_REDIS; the entries below compile its stubs)
entry "c11 gcc $OPT kvcache.h with KVO_WITH_REDIS" compile "$GCC" "$WARN_C $CONV_GCC $OPT -DKVO_WITH_REDIS" kvcache.h
entry "c11 clang kvcache.h with KVO_WITH_REDIS" compile "$CLANG" "$WARN_C $CONV_CLANG -fsyntax-only -DKVO_WITH_REDIS" kvcache.h
entry "c++17 g++ kvcache.h with KVO_WITH_REDIS" compile "$GXX" "-x c++ $WARN_CXX $CONV_GCC -fsyntax-only -DKVO_WITH_REDIS" kvcache.h
entry "make install into a prefix, pkg-config, make uninstall" install_prefix
top=$(top_part)
entry "link: implementation and use in two C files ($top)" link_two split "$top" "$top" "$GCC" "$WARN_C"
entry "link: implementation and use in two C files (kvcache.h)" link_two single kvcache.h kvcache.h "$GCC" "$WARN_C"
entry "link: kvcache.h implementation, C++ use of $top" link_two mixed kvcache.h "$top" "$GXX" "-x c++ $WARN_CXX"
for h in $PARTS kvcache.h; do
    entry "static gcc $h" static_mode "$GCC" "$WARN_C $CONV_GCC" "$h"
    entry "static clang $h" static_mode "$CLANG" "$WARN_C $CONV_CLANG" "$h"
    entry "c11 gcc $h" compile "$GCC" "$WARN_C $CONV_GCC -O0" "$h"
    entry "c11 clang $h" compile "$CLANG" "$WARN_C $CONV_CLANG -fsyntax-only" "$h"
    entry "c++17 g++ $h" compile "$GXX" "-x c++ $WARN_CXX $CONV_GCC -fsyntax-only" "$h"
    entry "c++17 clang++ $h" compile "$CLANGXX" "-x c++ $WARN_CXX $CONV_CLANG -fsyntax-only" "$h"
done
for h in $OTHER; do
    entry "c11 gcc $h" compile "$GCC" "$WARN_C $CONV_GCC -O0" "$h"
    entry "c11 clang $h" compile "$CLANG" "$WARN_C $CONV_CLANG -fsyntax-only" "$h"
    entry "c++17 g++ $h" compile "$GXX" "-x c++ $WARN_CXX $CONV_GCC -fsyntax-only" "$h"
    entry "c++17 clang++ $h" compile "$CLANGXX" "-x c++ $WARN_CXX $CONV_CLANG -fsyntax-only" "$h"
done
entry "README quick start, split headers, as written" readme_quickstart split
entry "README quick start, kvcache.h, as written" readme_quickstart single
entry "README quick start, kvcache.h, $PLAIN_C11 (no -D_GNU_SOURCE)" readme_quickstart plain
entry "a system header before kvcache.h's implementation: one #error naming -D_GNU_SOURCE" posix_late
entry "kvcache.h matches amalgamate.sh's output" fresh

l=0
while [ "$l" -lt "$JOBS" ]; do
    lane &
    l=$((l + 1))
done
wait

# ---- report ---------------------------------------------------------------------------------------

passed=0 failed=0 skipped=0
i=0
while [ "$i" -lt "$n" ]; do
    i=$((i + 1))
    id=$(printf '%03d' "$i")
    name=$(cat "$B/$id.name")
    rc=$(cat "$B/$id.rc" 2>/dev/null || echo 1)
    if [ "$rc" = 0 ]; then
        passed=$((passed + 1))
        echo "ok   $name"
    elif [ "$rc" = 77 ]; then
        skipped=$((skipped + 1))
        echo "skip $name: skipped: $(tail -n 1 "$B/$id.log")"
    else
        failed=$((failed + 1))
        echo "FAIL $name"
        tail -n 30 "$B/$id.log" | sed 's/^/  /'
    fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
