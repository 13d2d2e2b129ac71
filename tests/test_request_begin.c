/* kvb_request_begin: a request's match, allocation and registration in one call. Two pools replay the
 * same multi-turn trace (examples/workloads.h), one with kvb_request_begin and one with kvb_match +
 * kvb_alloc + kvb_register_hashed, under every built-in policy: the same hits, statistics, events and
 * blocks. A prompt that does not fit changes nothing; arguments are checked. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#define WORKLOADS_IMPLEMENTATION
#include "../examples/workloads.h"
#include "kvtest.h"
#include "fixtures.h"

enum { CAP = 300 };

typedef struct sink { kvb_event ev[4096]; size_t n; uint64_t total; } sink;
static void on_events(const kvb_event *e, size_t n, void *user)
{
    sink *s = (sink *)user;
    for (size_t i = 0; i < n; i++, s->total++)
        if (s->n < 4096) s->ev[s->n++] = e[i];
}

static void same_pools(kvb_pool *a, kvb_pool *b)
{
    kvb_pool_stats x, y;
    KVT_EQ(kvb_pool_get_stats(a, &x), KVB_OK);
    KVT_EQ(kvb_pool_get_stats(b, &y), KVB_OK);
    KVT_EQ(x.lookups, y.lookups);
    KVT_EQ(x.lookup_blocks, y.lookup_blocks);
    KVT_EQ(x.hit_blocks, y.hit_blocks);
    KVT_EQ(x.allocations, y.allocations);
    KVT_EQ(x.evictions, y.evictions);
    KVT_EQ(x.registrations, y.registrations);
    KVT_EQ(x.inactive_blocks, y.inactive_blocks);
    KVT_EQ(x.cached_hashes, y.cached_hashes);
    kvb_weak ca[CAP], cb[CAP]; /* the same blocks in the same eviction order (handles: index and generation) */
    size_t na = 0, nb = 0;
    KVT_EQ(kvb_eviction_candidates(a, CAP, ca, &na), KVB_OK);
    KVT_EQ(kvb_eviction_candidates(b, CAP, cb, &nb), KVB_OK);
    KVT_EQ(na, nb);
    for (size_t i = 0; i < na && i < nb; i++) KVT_EQ(ca[i].id, cb[i].id);
    FX_CHECK_POOL(a);
    FX_CHECK_POOL(b);
}

static void replay_both(kvb_evict_policy ev)
{
    wl_trace w;
    kvb_pool_config cfg = fx_config(CAP);
    kvb_pool *a, *b;
    static sink sa, sb;
    static kvb_hash h[CAP + 1];
    static kvb_block x[CAP], y[CAP];
    uint64_t hits_a = 0, hits_b = 0;
    memset(&sa, 0, sizeof sa);
    memset(&sb, 0, sizeof sb);
    cfg.eviction = ev;
    cfg.block_tokens = 512;
    cfg.on_events = on_events;
    cfg.event_user = &sa;
    KVT_EQ(kvb_pool_create(&cfg, &a), KVB_OK);
    cfg.event_user = &sb;
    KVT_EQ(kvb_pool_create(&cfg, &b), KVB_OK);
    KVT_EQ(wl_generate(WL_MIXED, 512, 1500, 1.0, 11, 0, &w), 0);
    for (size_t q = 0; q < w.n; q++) {
        size_t n = w.req[q].num_blocks < CAP ? w.req[q].num_blocks : CAP, m = 0, k = 0;
        if (!n) continue;
        for (size_t i = 0; i < n; i++) h[i + 1] = wl__block_hash(w.req[q].blocks[i]);
        KVT_EQ(kvb_request_begin(a, h + 1, n, x, &k), KVB_OK);
        KVT_EQ(kvb_match(b, h + 1, n, y, &m), KVB_OK);
        if (m < n) {
            KVT_EQ(kvb_alloc(b, n - m, y + m), KVB_OK);
            KVT_EQ(kvb_register_hashed(b, y + m, n - m, h + 1 + m, h + m, y + m), KVB_OK);
        }
        KVT_EQ(k, m);
        for (size_t i = 0; i < n; i++) KVT_EQ(x[i].id, y[i].id);
        hits_a += k;
        hits_b += m;
        KVT_EQ(kvb_release(a, x, n, NULL), KVB_OK);
        KVT_EQ(kvb_release(b, y, n, NULL), KVB_OK);
    }
    KVT_EQ(hits_a, hits_b);
    KVT_CHECK(hits_a > 0);
    KVT_EQ(sa.total, sb.total);
    for (size_t i = 0; i < sa.n && i < sb.n; i++) {
        KVT_EQ(sa.ev[i].kind, sb.ev[i].kind);
        FX_HASH_EQ(sa.ev[i].hash, sb.ev[i].hash);
    }
    same_pools(a, b);
    kvb_pool_destroy(a);
    kvb_pool_destroy(b);
    wl_free(&w);
}

static void test_same_as_separate_calls_lru(void) { replay_both(KVB_EVICT_LRU); }
static void test_same_as_separate_calls_lineage(void) { replay_both(KVB_EVICT_LINEAGE); }
static void test_same_as_separate_calls_fol(void) { replay_both(KVB_EVICT_FOL); }
static void test_same_as_separate_calls_arc(void) { replay_both(KVB_EVICT_ARC); }
static void test_same_as_separate_calls_s3fifo(void) { replay_both(KVB_EVICT_S3FIFO); }

/* 6 blocks: a cached chain of 2 is held by another request; a prompt of 2 cached + 5 new needs 5 of
 * the 4 left: KVB_ENOSPACE, and the pool is as before (no reference, no lookup counted). */
static void test_no_space_changes_nothing(void)
{
    kvb_pool *p = fx_pool(6);
    kvb_hash h[7];
    kvb_block held[2], out[7];
    size_t k = 99;
    kvb_pool_stats before, after;
    for (int i = 0; i < 7; i++) h[i] = fx_hash((uint64_t)i + 1, 77);
    KVT_EQ(kvb_request_begin(p, h, 2, held, &k), KVB_OK);
    KVT_EQ(k, 0);
    KVT_EQ(kvb_pool_get_stats(p, &before), KVB_OK);
    k = 99;
    KVT_EQ(kvb_request_begin(p, h, 7, out, &k), KVB_ENOSPACE);
    KVT_EQ(k, 99);
    KVT_EQ(kvb_pool_get_stats(p, &after), KVB_OK);
    KVT_EQ(after.lookups, before.lookups);
    KVT_EQ(after.active_blocks, 2);
    KVT_EQ(after.free_blocks, 4);
    KVT_EQ(kvb_request_begin(p, h, 6, out, &k), KVB_OK); /* 2 cached (shared) + 4 new: fits */
    KVT_EQ(k, 2);
    KVT_EQ(out[0].id, held[0].id);
    KVT_EQ(kvb_release(p, out, 6, NULL), KVB_OK);
    KVT_EQ(kvb_release(p, held, 2, NULL), KVB_OK);
    FX_CHECK_POOL(p);
    kvb_pool_destroy(p);
}

static uint32_t refuse(void *user) { (void)user; return UINT32_MAX; }
static void noop_inactive(void *user, uint32_t i, uint32_t prio) { (void)user; (void)i; (void)prio; }
static void noop_removed(void *user, uint32_t i) { (void)user; (void)i; }

static void test_arguments(void)
{
    kvb_pool *p = fx_pool(4), *c;
    kvb_pool_config cfg = fx_config(4);
    kvb_hash h = fx_hash(1, 2);
    kvb_block out[1];
    size_t k;
    KVT_EQ(kvb_request_begin(NULL, &h, 1, out, &k), KVB_EINVAL);
    KVT_EQ(kvb_request_begin(p, NULL, 1, out, &k), KVB_EINVAL);
    KVT_EQ(kvb_request_begin(p, &h, 1, NULL, &k), KVB_EINVAL);
    KVT_EQ(kvb_request_begin(p, &h, 1, out, NULL), KVB_EINVAL);
    KVT_EQ(kvb_request_begin(p, NULL, 0, NULL, &k), KVB_OK);
    KVT_EQ(k, 0);
    cfg.eviction = KVB_EVICT_CUSTOM;
    cfg.custom_eviction.choose_victim = refuse;
    cfg.custom_eviction.on_inactive = noop_inactive;
    cfg.custom_eviction.on_removed = noop_removed;
    KVT_EQ(kvb_pool_create(&cfg, &c), KVB_OK);
    KVT_EQ(kvb_request_begin(c, &h, 1, out, &k), KVB_EINVAL);
    kvb_pool_destroy(c);
    kvb_pool_destroy(p);
}

int main(void)
{
    fx_watchdog(120);
    KVT_RUN(test_same_as_separate_calls_lru);
    KVT_RUN(test_same_as_separate_calls_lineage);
    KVT_RUN(test_same_as_separate_calls_fol);
    KVT_RUN(test_same_as_separate_calls_arc);
    KVT_RUN(test_same_as_separate_calls_s3fifo);
    KVT_RUN(test_no_space_changes_nothing);
    KVT_RUN(test_arguments);
    return kvt_summary();
}
