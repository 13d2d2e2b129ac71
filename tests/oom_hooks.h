/* oom_hooks.h — out of memory on demand for the tests: include it first, before any kvcache header (it
 * defines KVB_MALLOC, KVB_REALLOC and KVB_FREE). oom_arm(N, sticky) makes the Nth allocation from then on
 * (counted from 0) fail, and with `sticky` every one after it too; oom_fired says whether the Nth came
 * (a call that makes fewer allocations ends the sweep over N); oom_disarm() gives the memory back. */
#ifndef KVT_OOM_HOOKS_H
#define KVT_OOM_HOOKS_H
#include <stdlib.h>

static long oom_at = -1; /* the allocation, counted from 0 while armed, that fails; -1: none */
static int oom_sticky;   /* every allocation from oom_at on fails too */
static long oom_count;   /* allocations asked for while armed */
static int oom_fired;

static inline int oom_fail(void)
{
    long i;
    if (oom_at < 0) return 0;
    i = oom_count++;
    if (i == oom_at || (oom_sticky && i > oom_at)) oom_fired = 1;
    return i == oom_at || (oom_sticky && i > oom_at);
}

static inline void *oom_malloc(size_t n) { return oom_fail() ? NULL : malloc(n); }
static inline void *oom_realloc(void *p, size_t n) { return oom_fail() ? NULL : realloc(p, n); }

static inline void oom_arm(long at, int sticky)
{
    oom_at = at;
    oom_sticky = sticky;
    oom_count = 0;
    oom_fired = 0;
}

static inline void oom_disarm(void) { oom_at = -1; }

#define KVB_MALLOC(sz) oom_malloc(sz)
#define KVB_REALLOC(p, sz) oom_realloc(p, sz)
#define KVB_FREE(p) free(p)
#endif
