/* kvtest.h — the tiny test harness of kvcache's tests.
 *
 * A test file defines `static void test_x(void)` functions using KVT_CHECK / KVT_EQ, and a main that
 * runs them with KVT_RUN(test_x) and ends with `return kvt_summary();`. Each test prints one line
 * (ok / FAIL / skip) and the summary prints `N passed, N failed[, N skipped]`; tests/run.sh adds up
 * the summaries of all test programs. A failed check records file:line and the test goes on.
 */
#ifndef KVTEST_H
#define KVTEST_H
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kvt__passed, kvt__failed, kvt__skipped, kvt__cur_failed, kvt__cur_skipped;
static const char *kvt__skip_reason = "";

#define KVT_CHECK(cond)                                                                       \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "  %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);       \
            kvt__cur_failed++;                                                                \
        }                                                                                     \
    } while (0)

#define KVT_EQ(a, b)                                                                          \
    do {                                                                                      \
        long long kvt__a = (long long)(a), kvt__b = (long long)(b);                           \
        if (kvt__a != kvt__b) {                                                               \
            fprintf(stderr, "  %s:%d: %s == %s failed: %lld != %lld\n", __FILE__, __LINE__,  \
                    #a, #b, kvt__a, kvt__b);                                                  \
            kvt__cur_failed++;                                                                \
        }                                                                                     \
    } while (0)

/* Stop the current test as skipped, with one line saying why. */
#define KVT_SKIP(reason)                                                                      \
    do {                                                                                      \
        kvt__cur_skipped = 1;                                                                 \
        kvt__skip_reason = (reason);                                                          \
        return;                                                                               \
    } while (0)

#define KVT_RUN(fn)                                                                           \
    do {                                                                                      \
        kvt__cur_failed = 0;                                                                  \
        kvt__cur_skipped = 0;                                                                 \
        fn();                                                                                 \
        if (kvt__cur_skipped && !kvt__cur_failed) {                                           \
            kvt__skipped++;                                                                   \
            printf("skip %s: skipped: %s\n", #fn, kvt__skip_reason);                          \
        } else if (kvt__cur_failed) {                                                         \
            kvt__failed++;                                                                    \
            printf("FAIL %s (%d checks)\n", #fn, kvt__cur_failed);                            \
        } else {                                                                              \
            kvt__passed++;                                                                    \
            printf("ok   %s\n", #fn);                                                         \
        }                                                                                     \
        fflush(stdout);                                                                       \
    } while (0)

static int kvt_summary(void)
{
    printf("%d passed, %d failed, %d skipped\n", kvt__passed, kvt__failed, kvt__skipped);
    return kvt__failed ? 1 : 0;
}

#endif
