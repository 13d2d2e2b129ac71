/* No allocation in the steady state (issue 15): once a pool has seen a workload, serving it again takes
 * nothing from the allocator. The compile-time allocator (KVB_MALLOC / KVB_REALLOC / KVB_FREE: stb_ds
 * arrays, ghost sets, mutable block state) and the runtime kvb_allocator (metadata, shadow pools) both
 * count their calls here.
 *   - a multi-turn chat trace (examples/workloads.h) replayed as serve_sim --sequential does, under every
 *     built-in policy, with an event sink: after two passes over the trace, a third allocates nothing;
 *   - blocks through their whole lifecycle (init, tokens, schedule, compute, register) and sequences
 *     (append, commit, release): after a warm-up round, more rounds allocate nothing.
 */
#include <stdlib.h>
static int armed;
static size_t macro_calls; /* KVB_MALLOC and KVB_REALLOC (a free is not an allocation, but counted too) */
static void *count_malloc(size_t n) { macro_calls++; return malloc(n); }
static void *count_realloc(void *p, size_t n) { macro_calls++; return realloc(p, n); }
static void count_free_macro(void *p) { if (p) macro_calls++; free(p); }
#define KVB_MALLOC(sz) count_malloc(sz)
#define KVB_REALLOC(p, sz) count_realloc(p, sz)
#define KVB_FREE(p) count_free_macro(p)
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#define WORKLOADS_IMPLEMENTATION
#include "../examples/workloads.h"
#include "kvtest.h"

static size_t runtime_calls;
static void *count_alloc(size_t size, size_t align, void *user)
{
    void *p = NULL;
    (void)user;
    runtime_calls++;
    return posix_memalign(&p, align < sizeof(void *) ? sizeof(void *) : align, size) ? NULL : p;
}
static void count_free(void *ptr, size_t size, void *user)
{
    (void)size;
    (void)user;
    runtime_calls++;
    free(ptr);
}

static size_t events_seen;
static void on_events(const kvb_event *e, size_t n, void *user)
{
    (void)e;
    (void)user;
    events_seen += n;
}

static size_t calls(void) { return macro_calls + runtime_calls; }

static kvb_pool_config config(uint32_t blocks, kvb_evict_policy ev)
{
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = blocks;
    cfg.eviction = ev;
    cfg.allocator.alloc = count_alloc;
    cfg.allocator.free = count_free;
    cfg.on_events = on_events;
    return cfg;
}

/* One pass of serve_sim --sequential over the trace: match, allocate and register the misses, release. */
static uint64_t replay_pass(kvb_pool *pool, const wl_trace *w, uint32_t cap, kvb_block *blk, kvb_hash *h)
{
    uint64_t hits = 0;
    for (size_t q = 0; q < w->n; q++) {
        size_t n = w->req[q].num_blocks < cap ? w->req[q].num_blocks : cap, m = 0;
        if (!n) continue;
        for (size_t i = 0; i < n; i++) h[i + 1] = wl__block_hash(w->req[q].blocks[i]);
        KVT_EQ(kvb_match(pool, h + 1, n, blk, &m), KVB_OK);
        hits += m;
        if (m < n) {
            KVT_EQ(kvb_alloc(pool, n - m, blk + m), KVB_OK);
            KVT_EQ(kvb_register_hashed(pool, blk + m, n - m, h + 1 + m, h + m, blk + m), KVB_OK);
        }
        KVT_EQ(kvb_release(pool, blk, n, NULL), KVB_OK);
    }
    return hits;
}

static void replay_twice(kvb_evict_policy ev, const char *name)
{
    enum { CAP = 1000 };
    wl_trace w;
    kvb_pool_config cfg = config(CAP, ev);
    kvb_pool *pool;
    static kvb_block blk[CAP];
    static kvb_hash h[CAP + 1];
    uint64_t hits;
    size_t before;
    KVT_EQ(wl_generate(WL_CHAT, 512, 3000, 1.0, 5, &w), 0);
    KVT_EQ(kvb_pool_create(&cfg, &pool), KVB_OK);
    /* warm-up: the scratch array, ghost sets, event batch and orphan table reach their size in one pass;
     * an eviction ring's array stops growing once it holds twice its largest live count (+ 64), which
     * S3-FIFO's main queue reaches in the second */
    (void)replay_pass(pool, &w, CAP, blk, h);
    (void)replay_pass(pool, &w, CAP, blk, h);
    before = calls();
    armed = getenv("ARM") && !strcmp(getenv("ARM"), name);
    hits = replay_pass(pool, &w, CAP, blk, h);
    if (calls() != before) fprintf(stderr, "  %s: %zu allocator calls in the second pass\n", name, calls() - before);
    KVT_EQ(calls() - before, 0);
    KVT_CHECK(hits > 0);
    KVT_CHECK(events_seen > 0);
    KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
    kvb_pool_destroy(pool);
    wl_free(&w);
}

static void test_replay_lru(void) { replay_twice(KVB_EVICT_LRU, "lru"); }
static void test_replay_lineage(void) { replay_twice(KVB_EVICT_LINEAGE, "lineage"); }
static void test_replay_fol(void) { replay_twice(KVB_EVICT_FOL, "fol"); }
static void test_replay_arc(void) { replay_twice(KVB_EVICT_ARC, "arc"); }
static void test_replay_s3fifo(void) { replay_twice(KVB_EVICT_S3FIFO, "s3fifo"); }

/* Blocks through the whole lifecycle, 8 at a time, chained: each round registers new hashes (the pool
 * is small, so it evicts), then releases them. */
static void lifecycle_round(kvb_pool *pool, uint32_t round)
{
    enum { N = 8, T = 16 };
    kvb_block b[N], out[N];
    uint32_t tokens[T];
    kvb_hash parent = {0, 0};
    KVT_EQ(kvb_alloc(pool, N, b), KVB_OK);
    for (size_t i = 0; i < N; i++) {
        kvb_block_info info;
        for (uint32_t t = 0; t < T; t++) tokens[t] = round * 1000u + (uint32_t)i * T + t;
        KVT_EQ(kvb_block_init(pool, b[i], i ? &parent : NULL, 0, NULL, 0), KVB_OK);
        KVT_EQ(kvb_block_add_tokens(pool, b[i], tokens, T, 0), KVB_OK);
        KVT_EQ(kvb_block_schedule(pool, b[i]), KVB_OK);
        KVT_EQ(kvb_block_compute_done(pool, b[i]), KVB_OK);
        KVT_EQ(kvb_register(pool, &b[i], 1, &out[i]), KVB_OK);
        KVT_EQ(kvb_block_get_info(pool, out[i].id, &info), KVB_OK);
        parent = info.hash;
    }
    KVT_EQ(kvb_release(pool, out, N, NULL), KVB_OK);
}

static void test_block_lifecycle(void)
{
    kvb_pool_config cfg = config(64, KVB_EVICT_LINEAGE);
    kvb_pool *pool;
    size_t before;
    uint32_t r;
    KVT_EQ(kvb_pool_create(&cfg, &pool), KVB_OK);
    for (r = 0; r < 64; r++) lifecycle_round(pool, r);
    before = calls();
    armed = getenv("ARM") && !strcmp(getenv("ARM"), "life");
    for (; r < 1000; r++) lifecycle_round(pool, r);
    KVT_EQ(calls() - before, 0);
    KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
    kvb_pool_destroy(pool);
}

int main(void)
{
    KVT_RUN(test_replay_lru);
    KVT_RUN(test_replay_lineage);
    KVT_RUN(test_replay_fol);
    KVT_RUN(test_replay_arc);
    KVT_RUN(test_replay_s3fifo);
    KVT_RUN(test_block_lifecycle);
    return kvt_summary();
}
