/* The KV-aware router (kvroute.h): its index is exactly what the workers' pools hold after random
 * streams of registrations, evictions and resets (pools wired to it directly or through a bus, 5 and
 * 70 workers: one bitmap word and two); lost, reordered and repeated events are survived (a stale entry
 * costs a mispredicted hit, the engine's own lookup decides) and a resync restores the truth; each
 * policy's rules; bad arguments give specific errors and change nothing; routing and steady-state
 * events do not allocate; engines on their own threads feed one router while another thread routes
 * (also under TSan). All deterministic (seeded) but the interleaving of that last one, whose final
 * index does not depend on it. */
#include <stdatomic.h>
#include <stdlib.h>
static atomic_size_t g_allocs; /* every KVB_MALLOC / KVB_REALLOC (pools allocate from several threads) */
static int g_fail_allocs;    /* when set, they fail */
static void *count_malloc(size_t n)
{
    g_allocs++;
    return g_fail_allocs ? NULL : malloc(n);
}
static void *count_realloc(void *p, size_t n)
{
    g_allocs++;
    return g_fail_allocs ? NULL : realloc(p, n);
}
#define KVB_MALLOC(sz) count_malloc(sz)
#define KVB_REALLOC(p, sz) count_realloc(p, sz)
#define KVB_FREE(p) free(p)
#define KVCACHE_IMPLEMENTATION
#include "kvroute.h"
#include "kvtest.h"
#include <float.h>

#include <math.h>

enum { CONVS = 40, MAXL = 24, POOL_BLOCKS = 48, MAX_WORKERS = 70 };

static kvb_hash g_chain[CONVS][MAXL]; /* conversation c's block hashes: the first 2 shared by c % 3 */

static uint64_t rnd(uint64_t *s)
{
    uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static void make_chains(void)
{
    uint32_t c, b, t, tokens[16];
    for (c = 0; c < CONVS; c++)
        for (b = 0; b < MAXL; b++) {
            for (t = 0; t < 16; t++) tokens[t] = b < 2 ? 1000 * (c % 3) + 16 * b + t : 100000 * c + 16 * b + t;
            g_chain[c][b] = kvb_hash_block(b ? &g_chain[c][b - 1] : NULL, tokens, 16, NULL, 0, 0);
        }
}

/* An engine serving a request: match the cached prefix, allocate (evicting) and register the rest,
 * release everything. Returns the blocks its own lookup found. */
static size_t serve(kvb_pool *pool, const kvb_hash *h, size_t k)
{
    kvb_block blocks[MAXL];
    kvb_hash parents[MAXL];
    size_t m = 0, i;
    KVT_EQ(kvb_match(pool, h, k, blocks, &m), KVB_OK);
    for (i = 0; i < k; i++) {
        parents[i].lo = i ? h[i - 1].lo : 0;
        parents[i].hi = i ? h[i - 1].hi : 0;
    }
    if (m < k) {
        KVT_EQ(kvb_alloc(pool, k - m, blocks + m), KVB_OK);
        KVT_EQ(kvb_register_hashed(pool, blocks + m, k - m, h + m, parents + m, blocks + m), KVB_OK);
    }
    KVT_EQ(kvb_release(pool, blocks, k, NULL), KVB_OK);
    return m;
}

static size_t pool_lookup(kvb_pool *pool, const kvb_hash *h, size_t n)
{
    size_t got = 0;
    KVT_EQ(kvb_lookup(pool, h, n, &got), KVB_OK);
    return got;
}

static kvb_pool *make_pool(kvb_event_fn fn, void *user)
{
    kvb_pool_config pc;
    kvb_pool *pool = NULL;
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = POOL_BLOCKS;
    pc.on_events = fn;
    pc.event_user = user;
    KVT_EQ(kvb_pool_create(&pc, &pool), KVB_OK);
    return pool;
}

static kvs_router *make_router(uint32_t workers, kvs_route_policy policy, uint32_t expected)
{
    kvs_router_config rc;
    kvs_router *r = NULL;
    memset(&rc, 0, sizeof rc);
    rc.num_workers = workers;
    rc.policy = policy;
    rc.expected_blocks = expected;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_OK);
    return r;
}

static kvs_router_stats stats_of(kvs_router *r)
{
    kvs_router_stats st;
    memset(&st, 0, sizeof st);
    KVT_EQ(kvs_router_get_stats(r, &st), KVS_OK);
    return st;
}

/* Brute force: every hash of the universe, every worker's pool asked; the index must say the same, hold
 * nothing else, and each worker's overlap must be its pool's own lookup. */
static void expect_index_matches(kvs_router *r, kvb_pool **pools, uint32_t nw)
{
    uint64_t want[2], got[2];
    size_t held = 0, over[MAX_WORKERS], w, c, b;
    int mismatches = 0;
    char why[128];
    for (c = 0; c < CONVS; c++)
        for (b = 0; b < MAXL; b++) {
            if (b < 2 && c >= 3) continue; /* shared blocks: counted once, for c < 3 */
            memset(want, 0, sizeof want);
            for (w = 0; w < nw; w++) {
                uint8_t present = 0;
                KVT_EQ(kvb_presence(pools[w], &g_chain[c][b], 1, &present, NULL), KVB_OK);
                if (present) want[w / 64] |= UINT64_C(1) << (w % 64);
            }
            KVT_EQ(kvs_router_holders(r, &g_chain[c][b], got, 2), KVS_OK);
            mismatches += want[0] != got[0] || want[1] != got[1];
            held += (want[0] | want[1]) != 0;
        }
    KVT_EQ(mismatches, 0);
    KVT_EQ(stats_of(r).hashes, held);
    KVT_EQ(kvs_router_check(r, why, sizeof why), KVS_OK);
    for (c = 0; c < CONVS; c++) {
        KVT_EQ(kvs_router_overlaps(r, g_chain[c], MAXL, over), KVS_OK);
        for (w = 0; w < nw; w++) mismatches += over[w] != pool_lookup(pools[w], g_chain[c], MAXL);
    }
    KVT_EQ(mismatches, 0);
}

/* A random stream on the pools: each step a worker serves a random turn of a random conversation, or
 * (2%) resets its pool. */
static void random_stream(kvb_pool **pools, uint32_t nw, int steps, uint64_t *seed,
                          void (*after)(uint32_t worker, void *user), void *user)
{
    int i;
    for (i = 0; i < steps; i++) {
        uint32_t w = (uint32_t)(rnd(seed) % nw);
        if (rnd(seed) % 50 == 0) KVT_EQ(kvb_pool_reset(pools[w]), KVB_OK);
        else serve(pools[w], g_chain[rnd(seed) % CONVS], 1 + rnd(seed) % MAXL);
        if (after) after(w, user);
    }
}

/* ---- the index against the pools ---------------------------------------------------------------- */

static void index_matches_pools(uint32_t nw, int steps, uint64_t seed)
{
    kvb_pool *pools[MAX_WORKERS];
    kvs_router *r = make_router(nw, KVS_ROUTE_KV, 64); /* small: grows on the way */
    uint32_t w;
    make_chains();
    for (w = 0; w < nw; w++) pools[w] = make_pool(kvs_router_pool_events, kvs_router_feed(r, w));
    random_stream(pools, nw, steps, &seed, NULL, NULL);
    expect_index_matches(r, pools, nw);
    KVT_CHECK(stats_of(r).hashes > 0);
    KVT_CHECK(stats_of(r).capacity > 128);  /* it grew */
    KVT_EQ(stats_of(r).stale_events, 0);    /* nothing was lost */
    for (w = 0; w < nw; w++) kvb_pool_destroy(pools[w]);
    kvs_router_destroy(r);
}

static void test_index_matches_pools_5_workers(void) { index_matches_pools(5, 3000, 1); }
static void test_index_matches_pools_70_workers(void) { index_matches_pools(70, 2000, 2); }

/* The same through each engine's event bus (kvs_bus_pool_events -> subscriber). */
static void test_index_fed_through_buses(void)
{
    enum { NW = 3 };
    kvb_pool *pools[NW];
    kvs_bus *buses[NW];
    kvs_router *r = make_router(NW, KVS_ROUTE_KV, 0);
    uint64_t seed = 3;
    uint32_t w, id;
    make_chains();
    for (w = 0; w < NW; w++) {
        KVT_EQ(kvs_bus_create(NULL, &buses[w]), KVS_OK);
        KVT_EQ(kvs_bus_subscribe(buses[w], KVS_ROUTER_BUS_KINDS, kvs_router_bus_event, kvs_router_feed(r, w), &id),
               KVS_OK);
        pools[w] = make_pool(kvs_bus_pool_events, buses[w]);
    }
    random_stream(pools, NW, 1500, &seed, NULL, NULL);
    expect_index_matches(r, pools, NW);
    for (w = 0; w < NW; w++) {
        kvb_pool_destroy(pools[w]);
        kvs_bus_destroy(buses[w]);
    }
    kvs_router_destroy(r);
}

/* ---- lost, reordered and repeated events -------------------------------------------------------- */

typedef struct capture { kvb_event ev[4 * MAXL + 8]; size_t n; } capture;

static void capture_events(const kvb_event *events, size_t n, void *user)
{
    capture *c = (capture *)user;
    size_t i;
    for (i = 0; i < n && c->n < sizeof c->ev / sizeof c->ev[0]; i++) c->ev[c->n++] = events[i];
}

typedef struct lossy {
    kvs_router *r;
    capture cap[4], held[4];
    uint64_t seed;
    int lost, reordered, repeated;
} lossy;

/* After each engine call: its events reach the router, or are lost (10%), held back behind the next
 * batch (10%), or come twice (5%). */
static void deliver_lossy(uint32_t w, void *user)
{
    lossy *l = (lossy *)user;
    capture *c = &l->cap[w], *h = &l->held[w];
    uint64_t x = rnd(&l->seed) % 100;
    if (x < 10) l->lost++;
    else if (x < 20 && !h->n) {
        *h = *c;
        l->reordered++;
    } else {
        KVT_EQ(kvs_router_events(l->r, w, c->ev, c->n), KVS_OK);
        if (x < 25) {
            KVT_EQ(kvs_router_events(l->r, w, c->ev, c->n), KVS_OK);
            l->repeated++;
        }
        if (h->n) KVT_EQ(kvs_router_events(l->r, w, h->ev, h->n), KVS_OK);
        h->n = 0;
    }
    c->n = 0;
}

static void test_lost_and_reordered_events_are_survived(void)
{
    enum { NW = 4 };
    kvb_pool *pools[NW];
    lossy l;
    uint64_t seed = 4, bits[1];
    uint32_t w, c, routed;
    size_t predicted = 0, real = 0, wrong = 0, overlap;
    kvb_event cleared;
    char why[128];
    memset(&l, 0, sizeof l);
    l.seed = 44;
    l.r = make_router(NW, KVS_ROUTE_KV, 0);
    make_chains();
    for (w = 0; w < NW; w++) pools[w] = make_pool(capture_events, &l.cap[w]);
    random_stream(pools, NW, 3000, &seed, deliver_lossy, &l);
    KVT_CHECK(l.lost > 0 && l.reordered > 0 && l.repeated > 0);
    KVT_CHECK(stats_of(l.r).stale_events > 0);
    KVT_EQ(kvs_router_check(l.r, why, sizeof why), KVS_OK);
    /* Routing on the stale index: the engine's own lookup decides what hits; a stale entry is a miss. */
    for (c = 0; c < CONVS; c++) {
        KVT_EQ(kvs_router_route(l.r, g_chain[c], MAXL, NULL, &routed, &overlap), KVS_OK);
        KVT_CHECK(routed < NW);
        predicted += overlap;
        real += pool_lookup(pools[routed], g_chain[c], MAXL);
        wrong += overlap != pool_lookup(pools[routed], g_chain[c], MAXL);
    }
    KVT_CHECK(wrong > 0); /* the stream did leave the index stale */
    printf("  lossy stream: %d lost, %d reordered, %d repeated batches; predicted %zu, engines found %zu\n",
           l.lost, l.reordered, l.repeated, predicted, real);
    /* Resync: a worker's CLEARED, then a STORED of what its pool holds, restores the truth. */
    memset(&cleared, 0, sizeof cleared);
    cleared.kind = KVB_EVENT_CLEARED;
    for (w = 0; w < NW; w++) {
        size_t b;
        KVT_EQ(kvs_router_events(l.r, w, &cleared, 1), KVS_OK);
        for (c = 0; c < CONVS; c++)
            for (b = 0; b < MAXL; b++) {
                kvb_event e;
                uint8_t present = 0;
                KVT_EQ(kvb_presence(pools[w], &g_chain[c][b], 1, &present, NULL), KVB_OK);
                if (!present) continue;
                memset(&e, 0, sizeof e);
                e.kind = KVB_EVENT_STORED;
                e.hash = g_chain[c][b];
                KVT_EQ(kvs_router_events(l.r, w, &e, 1), KVS_OK);
            }
    }
    expect_index_matches(l.r, pools, NW);
    for (w = 0; w < NW; w++) KVT_EQ(kvs_router_events(l.r, w, &cleared, 1), KVS_OK);
    KVT_EQ(stats_of(l.r).hashes, 0);
    KVT_EQ(kvs_router_holders(l.r, &g_chain[0][0], bits, 1), KVS_OK);
    KVT_EQ(bits[0], 0);
    for (w = 0; w < NW; w++) kvb_pool_destroy(pools[w]);
    kvs_router_destroy(l.r);
}

/* The two cases by hand: a lost REMOVED predicts a hit the engine does not have; a REMOVED that
 * overtakes its STORED leaves a stale bit; both are misses, and the next real events repair them. */
static void test_stale_entry_is_a_miss_not_a_hit(void)
{
    kvs_router *r = make_router(2, KVS_ROUTE_KV, 0);
    kvb_pool *pool;
    capture cap;
    uint32_t w = 9;
    size_t overlap = 9, ov[2];
    memset(&cap, 0, sizeof cap);
    make_chains();
    pool = make_pool(capture_events, &cap);
    serve(pool, g_chain[5], 8);
    KVT_EQ(kvs_router_events(r, 1, cap.ev, cap.n), KVS_OK); /* worker 1 stored 8 blocks */
    cap.n = 0;
    KVT_EQ(kvb_pool_reset(pool), KVB_OK);                   /* its CLEARED is lost */
    cap.n = 0;
    KVT_EQ(kvs_router_route(r, g_chain[5], 8, NULL, &w, &overlap), KVS_OK);
    KVT_EQ(w, 1);
    KVT_EQ(overlap, 8);                                     /* predicted ... */
    KVT_EQ(serve(pool, g_chain[5], 8), 0);                  /* ... but the engine finds nothing: a miss */
    /* its new STOREDs arrive after a late REMOVED of the first block: repeats, counted, no harm */
    {
        kvb_event late;
        memset(&late, 0, sizeof late);
        late.kind = KVB_EVENT_REMOVED;
        late.hash = g_chain[5][0];
        KVT_EQ(kvs_router_events(r, 1, &late, 1), KVS_OK);
    }
    KVT_EQ(kvs_router_events(r, 1, cap.ev, cap.n), KVS_OK);
    KVT_EQ(stats_of(r).stale_events, 7);
    KVT_EQ(kvs_router_route(r, g_chain[5], 8, NULL, &w, &overlap), KVS_OK);
    KVT_EQ(overlap, 8);
    KVT_EQ(pool_lookup(pool, g_chain[5], 8), 8);
    /* reordered: REMOVED before its STORED (the engine evicted it since) leaves a stale bit */
    {
        kvb_event ev[2];
        memset(ev, 0, sizeof ev);
        ev[0].kind = KVB_EVENT_REMOVED;
        ev[0].hash = g_chain[7][0];
        ev[1].kind = KVB_EVENT_STORED;
        ev[1].hash = g_chain[7][0];
        KVT_EQ(kvs_router_events(r, 0, ev, 2), KVS_OK);
        KVT_EQ(kvs_router_overlaps(r, g_chain[7], 1, ov), KVS_OK);
        KVT_EQ(ov[0], 1); /* worker 0 believed to hold it; its own lookup would say 0 */
        KVT_EQ(ov[1], 0);
    }
    kvb_pool_destroy(pool);
    kvs_router_destroy(r);
}

/* ---- policies ------------------------------------------------------------------------------------ */

/* Worker w stores blocks [from, to) of chain h. */
static void store(kvs_router *r, uint32_t w, const kvb_hash *h, size_t from, size_t to)
{
    kvb_event e[MAXL];
    size_t i;
    memset(e, 0, sizeof e);
    for (i = from; i < to; i++) {
        e[i - from].kind = KVB_EVENT_STORED;
        e[i - from].hash = h[i];
    }
    KVT_EQ(kvs_router_events(r, w, e, to - from), KVS_OK);
}

static uint32_t route(kvs_router *r, const kvb_hash *h, size_t n, const double *loads, size_t *overlap)
{
    uint32_t w = 999;
    KVT_EQ(kvs_router_route(r, h, n, loads, &w, overlap), KVS_OK);
    return w;
}

static void test_round_robin_takes_turns(void)
{
    kvs_router *r = make_router(3, KVS_ROUTE_ROUND_ROBIN, 0);
    double loads[3] = { 0, 100, 100 };
    size_t overlap;
    int i;
    make_chains();
    store(r, 2, g_chain[0], 0, 6);
    for (i = 0; i < 7; i++) KVT_EQ(route(r, g_chain[0], 6, loads, &overlap), (uint32_t)(i % 3));
    KVT_EQ(route(r, g_chain[0], 6, NULL, &overlap), 1);
    KVT_EQ(route(r, g_chain[0], 6, NULL, &overlap), 2);
    KVT_EQ(overlap, 6); /* the chosen worker's overlap, whatever the policy */
    kvs_router_destroy(r);
}

static void test_least_loaded_picks_the_idlest(void)
{
    kvs_router *r = make_router(3, KVS_ROUTE_LEAST_LOADED, 0);
    double loads[3] = { 5, 2, 7 }, even[3] = { 1, 1, 1 };
    make_chains();
    store(r, 0, g_chain[1], 0, 10); /* cache is not its business */
    KVT_EQ(route(r, g_chain[1], 10, loads, NULL), 1);
    loads[1] = 9;
    KVT_EQ(route(r, g_chain[1], 10, loads, NULL), 0);
    /* ties take turns from the cursor: routes so far 2, so 2, 0, 1 */
    KVT_EQ(route(r, g_chain[1], 10, even, NULL), 2);
    KVT_EQ(route(r, g_chain[1], 10, even, NULL), 0);
    KVT_EQ(route(r, g_chain[1], 10, even, NULL), 1);
    kvs_router_destroy(r);
}

static void test_affinity_keeps_a_key_on_one_worker(void)
{
    kvs_router *r = make_router(4, KVS_ROUTE_AFFINITY, 0);
    double loads[4] = { 0, 50, 0, 9 };
    uint32_t w, first, hits[4] = { 0, 0, 0, 0 };
    uint64_t key;
    int i;
    make_chains();
    KVT_EQ(kvs_router_route_key(r, 42, NULL, 0, NULL, &first, NULL), KVS_OK);
    for (i = 0; i < 5; i++) {
        KVT_EQ(kvs_router_route_key(r, 42, g_chain[i], MAXL, loads, &w, NULL), KVS_OK);
        KVT_EQ(w, first); /* loads and hashes do not matter */
    }
    for (key = 0; key < 400; key++) {
        KVT_EQ(kvs_router_route_key(r, key, NULL, 0, NULL, &w, NULL), KVS_OK);
        hits[w]++;
    }
    for (w = 0; w < 4; w++) KVT_CHECK(hits[w] > 60); /* keys spread */
    /* without a key: the first 4 blocks are the key, so every turn of a conversation goes one way */
    first = route(r, g_chain[9], 4, NULL, NULL);
    for (i = 5; i <= MAXL; i++) KVT_EQ(route(r, g_chain[9], (size_t)i, loads, NULL), first);
    kvs_router_destroy(r);
}

static void test_kv_routes_to_least_prefill_plus_load(void)
{
    kvs_router_config rc;
    kvs_router *r = make_router(3, KVS_ROUTE_DEFAULT, 0);
    double loads[3] = { 0, 0, 0 };
    size_t overlap = 0, ov[3];
    uint32_t w;
    make_chains();
    KVT_EQ(kvs_router_get_config(r, &rc), KVS_OK);
    KVT_EQ(rc.policy, KVS_ROUTE_KV);
    KVT_CHECK(rc.load_weight == 1.0);
    store(r, 0, g_chain[2], 0, 4);
    store(r, 1, g_chain[2], 0, 10);
    KVT_EQ(route(r, g_chain[2], 12, loads, &overlap), 1); /* 2 blocks to prefill against 8 and 12 */
    KVT_EQ(overlap, 10);
    loads[1] = 7; /* 2 + 7 = 9 > 8 = worker 0's 8 + 0 */
    KVT_EQ(route(r, g_chain[2], 12, loads, &overlap), 0);
    KVT_EQ(overlap, 4);
    loads[1] = 5; /* 2 + 5 = 7 < 8 */
    KVT_EQ(route(r, g_chain[2], 12, loads, &overlap), 1);
    kvs_router_destroy(r);

    /* the weight converts load into blocks */
    memset(&rc, 0, sizeof rc);
    rc.num_workers = 3;
    rc.load_weight = 0.25;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_OK);
    store(r, 1, g_chain[2], 0, 10);
    loads[1] = 20; /* 2 + 5 < 12 */
    KVT_EQ(route(r, g_chain[2], 12, loads, &overlap), 1);
    loads[1] = 44; /* 2 + 11 > 12 */
    KVT_CHECK(route(r, g_chain[2], 12, loads, &overlap) != 1);

    /* overlap is a prefix: worker 2 holds blocks 0-2 and 4-9; one probe per block, stop at the
     * first block nobody holding the prefix has */
    store(r, 2, g_chain[3], 0, 3);
    store(r, 2, g_chain[3], 4, 10);
    store(r, 0, g_chain[3], 0, 6);
    KVT_EQ(kvs_router_overlaps(r, g_chain[3], 12, ov), KVS_OK);
    KVT_EQ(ov[0], 6);
    KVT_EQ(ov[1], 0);
    KVT_EQ(ov[2], 3);
    {
        kvs_router_stats before = stats_of(r), after;
        KVT_EQ(route(r, g_chain[3], 12, NULL, &overlap), 0);
        after = stats_of(r);
        KVT_EQ(after.probes - before.probes, 7); /* blocks 0..6: block 6 is nobody's */
        KVT_EQ(after.route_blocks - before.route_blocks, 12);
        KVT_EQ(after.overlap_blocks - before.overlap_blocks, 6);
    }
    /* a cold request (nobody holds anything) with equal loads: workers take turns */
    w = route(r, g_chain[30] + 2, 5, NULL, NULL);
    KVT_EQ(route(r, g_chain[30] + 2, 5, NULL, NULL), (w + 1) % 3);
    KVT_EQ(route(r, g_chain[30] + 2, 5, NULL, NULL), (w + 2) % 3);
    /* n = 0: least load */
    loads[0] = 3; loads[1] = 1; loads[2] = 2;
    KVT_EQ(route(r, NULL, 0, loads, &overlap), 1);
    KVT_EQ(overlap, 0);
    kvs_router_destroy(r);
}

/* Ties between some workers only (a hot prefix held by 2 of 8, no loads): the tied workers take turns.
 * Ties used to go to the first tied worker at or after a cursor that moves by one each route, so the
 * tied worker after the gap of untied ones took nearly every request (7 of 8 here). */
static void test_ties_among_some_workers_take_turns(void)
{
    kvs_router *r = make_router(8, KVS_ROUTE_KV, 0);
    kvs_router *ll = make_router(8, KVS_ROUTE_LEAST_LOADED, 0);
    double loads[8] = { 5, 5, 1, 1, 5, 5, 5, 5 };
    uint32_t got[8] = { 0 }, lgot[8] = { 0 };
    int i;
    make_chains();
    store(r, 2, g_chain[5], 0, 6);
    store(r, 3, g_chain[5], 0, 6);
    for (i = 0; i < 16; i++) {
        got[route(r, g_chain[5], 6, NULL, NULL)]++;
        lgot[route(ll, g_chain[5], 6, loads, NULL)]++;
    }
    KVT_EQ(got[2], 8);
    KVT_EQ(got[3], 8);
    KVT_EQ(lgot[2], 8);
    KVT_EQ(lgot[3], 8);
    /* interleaved with routes that have one best worker: still turns */
    memset(got, 0, sizeof got);
    store(r, 6, g_chain[6], 0, 6);
    for (i = 0; i < 16; i++) {
        got[route(r, g_chain[5], 6, NULL, NULL)]++;
        KVT_EQ(route(r, g_chain[6], 6, NULL, NULL), 6);
    }
    KVT_EQ(got[2], 8);
    KVT_EQ(got[3], 8);
    kvs_router_destroy(r);
    kvs_router_destroy(ll);
}

/* load_weight x load past DBL_MAX (weight 1e9 is allowed, loads are only checked finite) made every
 * loaded worker cost infinity: the cached prefix no longer counted and the tie cursor picked. Such a
 * load is now refused (KVS_ELOAD), like an infinite one, and nothing changes. */
static void test_weighted_load_overflow_is_refused(void)
{
    kvs_router_config rc;
    kvs_router *r = NULL;
    double loads[2] = { 1e300, 1e300 }, fine[2] = { 1e5, 1e5 };
    uint32_t w = 77;
    make_chains();
    memset(&rc, 0, sizeof rc);
    rc.num_workers = 2;
    rc.load_weight = 1e9;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_OK);
    store(r, 1, g_chain[7], 0, 6);
    KVT_EQ(kvs_router_route(r, g_chain[7], 6, loads, &w, NULL), KVS_ELOAD);
    KVT_EQ(w, 77);
    KVT_EQ(stats_of(r).routes, 0);
    /* large but representable: worker 1's cached prefix still decides */
    KVT_EQ(route(r, g_chain[7], 6, fine, NULL), 1);
    KVT_EQ(route(r, g_chain[7], 6, fine, NULL), 1);
    kvs_router_destroy(r);
}

/* More than 64 workers: the bitmaps take a second word; worker 100 is found like worker 0. */
static void test_workers_beyond_64(void)
{
    kvs_router *r = make_router(130, KVS_ROUTE_KV, 0);
    size_t ov[130], overlap;
    uint64_t bits[3];
    make_chains();
    store(r, 100, g_chain[4], 0, 9);
    store(r, 129, g_chain[4], 0, 5);
    store(r, 3, g_chain[4], 0, 2);
    KVT_EQ(kvs_router_overlaps(r, g_chain[4], 12, ov), KVS_OK);
    KVT_EQ(ov[100], 9);
    KVT_EQ(ov[129], 5);
    KVT_EQ(ov[3], 2);
    KVT_EQ(ov[0], 0);
    KVT_EQ(route(r, g_chain[4], 12, NULL, &overlap), 100);
    KVT_EQ(overlap, 9);
    KVT_EQ(kvs_router_holders(r, &g_chain[4][0], bits, 3), KVS_OK);
    KVT_EQ(bits[0], UINT64_C(1) << 3);
    KVT_EQ(bits[1], UINT64_C(1) << 36);
    KVT_EQ(bits[2], UINT64_C(1) << 1);
    KVT_EQ(kvs_router_holders(r, &g_chain[4][0], bits, 2), KVS_ENOSPACE);
    KVT_EQ(kvs_router_check(r, NULL, 0), KVS_OK);
    kvs_router_destroy(r);
}

/* Engines with real pools, conversations that come back turn after turn: routing by cache finds more
 * of them in the engine it picks than round robin does (the engines' own lookups count the hits). */
static size_t fleet_hits(kvs_route_policy policy)
{
    enum { NW = 4 };
    kvb_pool *pools[NW];
    kvs_router *r = make_router(NW, policy, 0);
    uint64_t seed = 77;
    uint32_t w, turn[CONVS];
    double loads[NW];
    size_t hits = 0;
    int i;
    memset(turn, 0, sizeof turn);
    memset(loads, 0, sizeof loads);
    for (w = 0; w < NW; w++) pools[w] = make_pool(kvs_router_pool_events, kvs_router_feed(r, w));
    for (i = 0; i < 600; i++) {
        uint32_t c = (uint32_t)(rnd(&seed) % CONVS);
        size_t n = 2 + 2 * (turn[c]++ % 11);
        uint32_t to = route(r, g_chain[c], n, loads, NULL);
        hits += serve(pools[to], g_chain[c], n);
        for (w = 0; w < NW; w++) loads[w] *= 0.9; /* recent work in blocks, decaying */
        loads[to] += (double)n;
    }
    for (w = 0; w < NW; w++) kvb_pool_destroy(pools[w]);
    kvs_router_destroy(r);
    return hits;
}

static void test_kv_finds_more_than_round_robin(void)
{
    size_t rr, kv;
    make_chains();
    rr = fleet_hits(KVS_ROUTE_ROUND_ROBIN);
    kv = fleet_hits(KVS_ROUTE_KV);
    printf("  fleet of 4: hit blocks round robin %zu, kv %zu\n", rr, kv);
    KVT_CHECK(kv > rr);
}

/* ---- threads: each engine feeds the router from its own thread while another routes -------------- */

typedef struct engine_thread {
    kvb_pool *pool;
    uint64_t seed;
} engine_thread;

static void *engine_main(void *arg)
{
    engine_thread *e = (engine_thread *)arg;
    int i;
    for (i = 0; i < 400; i++) {
        if (rnd(&e->seed) % 50 == 0) (void)kvb_pool_reset(e->pool);
        else serve(e->pool, g_chain[rnd(&e->seed) % CONVS], 1 + rnd(&e->seed) % MAXL);
    }
    return NULL;
}

typedef struct router_thread { kvs_router *r; atomic_int stop; size_t routes; } router_thread;

static void *router_main(void *arg)
{
    router_thread *t = (router_thread *)arg;
    double loads[4] = { 1, 2, 3, 4 };
    uint32_t w;
    size_t overlap, c = 0;
    while (!atomic_load(&t->stop) || c < 100) {
        if (kvs_router_route(t->r, g_chain[c % CONVS], 1 + c % MAXL, loads, &w, &overlap) != KVS_OK || w >= 4) break;
        c++;
    }
    t->routes = c;
    return NULL;
}

static void test_engines_on_threads_feed_one_router(void)
{
    enum { NW = 4 };
    kvb_pool *pools[NW];
    engine_thread eng[NW];
    pthread_t th[NW], rt;
    router_thread rtd;
    uint32_t w;
    make_chains();
    memset(&rtd, 0, sizeof rtd);
    rtd.r = make_router(NW, KVS_ROUTE_KV, 32);
    for (w = 0; w < NW; w++) {
        pools[w] = make_pool(kvs_router_pool_events, kvs_router_feed(rtd.r, w));
        eng[w].pool = pools[w];
        eng[w].seed = 100 + w;
    }
    KVT_EQ(pthread_create(&rt, NULL, router_main, &rtd), 0);
    for (w = 0; w < NW; w++) KVT_EQ(pthread_create(&th[w], NULL, engine_main, &eng[w]), 0);
    for (w = 0; w < NW; w++) pthread_join(th[w], NULL);
    atomic_store(&rtd.stop, 1);
    pthread_join(rt, NULL);
    KVT_CHECK(rtd.routes >= 100);
    KVT_EQ(stats_of(rtd.r).routes, rtd.routes);
    expect_index_matches(rtd.r, pools, NW); /* each engine's events arrive in its order: exact again */
    for (w = 0; w < NW; w++) kvb_pool_destroy(pools[w]);
    kvs_router_destroy(rtd.r);
}

/* ---- bad arguments -------------------------------------------------------------------------------- */

static void test_bad_arguments_change_nothing(void)
{
    kvs_router_config rc;
    kvs_router *r = NULL;
    kvs_router_stats st;
    kvb_event ev[3];
    double loads[3] = { 0, -1, 0 };
    uint32_t w = 77;
    size_t overlap = 77, ov[3];
    uint64_t bits[1];
    make_chains();
    memset(&rc, 0, sizeof rc);
    KVT_EQ(kvs_router_create(NULL, &r), KVS_EINVAL);
    KVT_EQ(kvs_router_create(&rc, NULL), KVS_EINVAL);
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG); /* no workers */
    rc.num_workers = KVS_ROUTER_MAX_WORKERS + 1;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG);
    rc.num_workers = 3;
    rc.load_weight = -1;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG);
    rc.load_weight = NAN;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG);
    rc.load_weight = INFINITY;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG);
    rc.load_weight = DBL_MAX; /* finite, but weight x load overflowed: every loaded worker tied */
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG);
    rc.load_weight = 1e9;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_OK);
    kvs_router_destroy(r);
    r = NULL;
    rc.load_weight = 0;
    rc.policy = KVS_ROUTE__COUNT;
    KVT_EQ(kvs_router_create(&rc, &r), KVS_ECONFIG);
    KVT_CHECK(r == NULL);
    r = make_router(3, KVS_ROUTE_ROUND_ROBIN, 0);

    /* events: a bad kind anywhere in a batch refuses the whole batch */
    memset(ev, 0, sizeof ev);
    ev[0].kind = KVB_EVENT_STORED;
    ev[0].hash = g_chain[0][0];
    ev[1].kind = (kvb_event_kind)0;
    ev[2].kind = KVB_EVENT_STORED;
    ev[2].hash = g_chain[0][1];
    KVT_EQ(kvs_router_events(r, 0, ev, 3), KVS_EINVAL);
    KVT_EQ(kvs_router_events(r, 3, ev, 1), KVS_EWORKER);
    KVT_EQ(kvs_router_events(NULL, 0, ev, 1), KVS_EINVAL);
    KVT_EQ(kvs_router_events(r, 0, NULL, 1), KVS_EINVAL);
    KVT_EQ(kvs_router_events(r, 0, NULL, 0), KVS_OK);
    st = stats_of(r);
    KVT_EQ(st.hashes, 0);
    KVT_EQ(st.events, 0);
    /* other tiers and the zero hash are ignored, not errors */
    ev[1] = ev[0];
    ev[1].tier = 1;
    ev[2].hash.lo = ev[2].hash.hi = 0;
    KVT_EQ(kvs_router_events(r, 0, ev, 3), KVS_OK);
    st = stats_of(r);
    KVT_EQ(st.hashes, 1);
    KVT_EQ(st.ignored_events, 2);

    /* routes: the cursor does not move on a refused one */
    KVT_EQ(kvs_router_route(r, g_chain[0], 2, NULL, NULL, &overlap), KVS_EINVAL);
    KVT_EQ(kvs_router_route(NULL, g_chain[0], 2, NULL, &w, &overlap), KVS_EINVAL);
    KVT_EQ(kvs_router_route(r, NULL, 2, NULL, &w, &overlap), KVS_EINVAL);
    KVT_EQ(kvs_router_route(r, g_chain[0], 2, loads, &w, &overlap), KVS_ELOAD);
    loads[1] = NAN;
    KVT_EQ(kvs_router_route(r, g_chain[0], 2, loads, &w, &overlap), KVS_ELOAD);
    loads[1] = INFINITY;
    KVT_EQ(kvs_router_route_key(r, 1, g_chain[0], 2, loads, &w, &overlap), KVS_ELOAD);
    KVT_EQ(w, 77);
    KVT_EQ(overlap, 77);
    KVT_EQ(stats_of(r).routes, 0);
    KVT_EQ(route(r, g_chain[0], 2, NULL, &overlap), 0); /* the first turn */
    KVT_EQ(overlap, 1);

    KVT_EQ(kvs_router_overlaps(r, g_chain[0], 2, NULL), KVS_EINVAL);
    KVT_EQ(kvs_router_overlaps(r, NULL, 2, ov), KVS_EINVAL);
    KVT_EQ(kvs_router_holders(r, NULL, bits, 1), KVS_EINVAL);
    KVT_EQ(kvs_router_holders(r, &g_chain[0][0], bits, 0), KVS_ENOSPACE);
    KVT_EQ(kvs_router_get_stats(r, NULL), KVS_EINVAL);
    KVT_EQ(kvs_router_get_config(NULL, &rc), KVS_EINVAL);
    KVT_EQ(kvs_router_check(NULL, NULL, 0), KVS_EINVAL);
    KVT_CHECK(kvs_router_feed(r, 3) == NULL);
    KVT_CHECK(kvs_router_feed(NULL, 0) == NULL);
    KVT_CHECK(kvs_router_feed(r, 2) != NULL);
    kvs_router_pool_events(ev, 1, NULL);  /* adapters ignore what they cannot use */
    kvs_router_bus_event(NULL, NULL);
    kvs_router_destroy(NULL);
    KVT_EQ(stats_of(r).hashes, 1);
    KVT_CHECK(strcmp(kvs_router_result_string(KVS_EWORKER), "worker index out of range") == 0);
    KVT_CHECK(strcmp(kvs_router_result_string(KVS_ECONFIG), "router configuration value out of range") == 0);
    KVT_CHECK(strcmp(kvs_router_result_string(KVS_ELOAD), "load is negative or not finite") == 0);
    KVT_CHECK(strcmp(kvs_router_result_string(KVS_ENOSPACE), kvs_result_string(KVS_ENOSPACE)) == 0);
    kvs_router_destroy(r);
}

/* ---- allocation --------------------------------------------------------------------------------- */

static void test_steady_state_does_not_allocate(void)
{
    kvs_router *r = make_router(8, KVS_ROUTE_KV, 16);
    double loads[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    size_t before, c, grown_to, overlap;
    kvb_event e;
    make_chains();
    before = g_allocs;
    for (c = 0; c < CONVS; c++) store(r, (uint32_t)(c % 8), g_chain[c], 0, MAXL);
    KVT_CHECK(g_allocs > before); /* the index grew for them (and the counter counts) */
    grown_to = (size_t)stats_of(r).capacity;

    /* routing, removals and re-stores below the capacity: no allocation at all */
    before = g_allocs;
    for (c = 0; c < 1000; c++) {
        uint32_t w = route(r, g_chain[c % CONVS], 1 + c % MAXL, c % 2 ? loads : NULL, &overlap);
        KVT_CHECK(w < 8);
    }
    memset(&e, 0, sizeof e);
    for (c = 0; c < CONVS; c++) {
        e.kind = KVB_EVENT_REMOVED;
        e.hash = g_chain[c][MAXL - 1];
        KVT_EQ(kvs_router_events(r, (uint32_t)(c % 8), &e, 1), KVS_OK);
        e.kind = KVB_EVENT_STORED;
        KVT_EQ(kvs_router_events(r, (uint32_t)(c % 8), &e, 1), KVS_OK);
    }
    KVT_EQ(g_allocs - before, 0);
    KVT_EQ(stats_of(r).capacity, grown_to);

    /* growth that cannot allocate: refused whole, KVS_ENOMEM; through the adapter, counted as dropped */
    {
        kvs_router *small = make_router(2, KVS_ROUTE_KV, 8);
        kvs_router_stats st;
        store(small, 0, g_chain[0], 0, 8);
        g_fail_allocs = 1;
        memset(&e, 0, sizeof e);
        {
            kvb_event many[MAXL];
            size_t i;
            memset(many, 0, sizeof many);
            for (i = 0; i < MAXL; i++) {
                many[i].kind = KVB_EVENT_STORED;
                many[i].hash = g_chain[1][i];
            }
            KVT_EQ(kvs_router_events(small, 1, many, MAXL), KVS_ENOMEM);
            kvs_router_pool_events(many, MAXL, kvs_router_feed(small, 1));
        }
        g_fail_allocs = 0;
        st = stats_of(small);
        KVT_EQ(st.hashes, 8);
        KVT_EQ(st.dropped_events, MAXL);
        KVT_EQ(kvs_router_check(small, NULL, 0), KVS_OK);
        kvs_router_destroy(small);
    }
    /* a create that cannot allocate returns KVS_ENOMEM */
    {
        kvs_router_config rc;
        kvs_router *none = NULL;
        memset(&rc, 0, sizeof rc);
        rc.num_workers = 2;
        g_fail_allocs = 1;
        KVT_EQ(kvs_router_create(&rc, &none), KVS_ENOMEM);
        g_fail_allocs = 0;
        KVT_CHECK(none == NULL);
    }
    kvs_router_destroy(r);
}

/* STOREDs of hashes the index already holds (another worker's blocks, repeats) add no entry: they do
 * not grow the index, so at two thirds full they need no memory. The batch used to reserve a slot for
 * every STORED: the table doubled for nothing, and with no memory the batch was refused (KVS_ENOMEM;
 * through an adapter, dropped with its REMOVEDs) though it needed none. */
static void test_stores_of_held_hashes_do_not_grow(void)
{
    kvs_router *r = make_router(2, KVS_ROUTE_KV, 8); /* 16 slots: 10 hashes at most */
    uint64_t cap, bits[1];
    size_t before, b;
    make_chains();
    store(r, 0, g_chain[0], 0, 10);
    cap = stats_of(r).capacity;
    KVT_EQ(cap, 16);
    KVT_EQ(stats_of(r).hashes, 10);
    before = g_allocs;
    g_fail_allocs = 1;
    store(r, 1, g_chain[0], 0, 10); /* KVS_OK expected: the same 10 hashes */
    store(r, 0, g_chain[0], 0, 10); /* repeats */
    g_fail_allocs = 0;
    KVT_EQ(g_allocs - before, 0);
    KVT_EQ(stats_of(r).capacity, cap);
    KVT_EQ(stats_of(r).hashes, 10);
    KVT_EQ(stats_of(r).stale_events, 10);
    for (b = 0; b < 10; b++) {
        KVT_EQ(kvs_router_holders(r, &g_chain[0][b], bits, 1), KVS_OK);
        KVT_EQ(bits[0], 3);
    }
    KVT_EQ(kvs_router_check(r, NULL, 0), KVS_OK);
    kvs_router_destroy(r);
}

/* stats.events counts the events that changed the index: a CLEARED of a worker that holds nothing (a
 * pool reset twice, or before it stored anything) changes nothing and is not counted; nor is it stale
 * (the index agrees with the pool), so a faithful feed still shows no stale events. */
static void test_cleared_of_an_empty_worker_changes_nothing(void)
{
    kvs_router *r = make_router(2, KVS_ROUTE_KV, 0);
    kvb_event cleared;
    uint64_t bits[1];
    kvs_router_stats st;
    make_chains();
    store(r, 0, g_chain[1], 0, 3);
    KVT_EQ(stats_of(r).events, 3);
    memset(&cleared, 0, sizeof cleared);
    cleared.kind = KVB_EVENT_CLEARED;
    KVT_EQ(kvs_router_events(r, 1, &cleared, 1), KVS_OK); /* worker 1 holds nothing */
    st = stats_of(r);
    KVT_EQ(st.events, 3);
    KVT_EQ(st.stale_events, 0);
    KVT_EQ(st.hashes, 3);
    KVT_EQ(kvs_router_holders(r, &g_chain[1][0], bits, 1), KVS_OK);
    KVT_EQ(bits[0], 1);
    KVT_EQ(kvs_router_events(r, 0, &cleared, 1), KVS_OK); /* worker 0's clears its three */
    st = stats_of(r);
    KVT_EQ(st.events, 4);
    KVT_EQ(st.hashes, 0);
    KVT_EQ(kvs_router_events(r, 0, &cleared, 1), KVS_OK); /* again: nothing left */
    st = stats_of(r);
    KVT_EQ(st.events, 4);
    KVT_EQ(st.stale_events, 0);
    KVT_EQ(kvs_router_check(r, NULL, 0), KVS_OK);
    kvs_router_destroy(r);
}

/* The index's size for a count of hashes never overflows: beyond what a size_t can count it is 0, which
 * growing reports as KVS_ENOMEM, the router unchanged. (With a 32-bit size_t, an expected_blocks near
 * its maximum took the doubling past the top bit, and it went round for ever.) */
static void test_capacity_beyond_memory_is_refused(void)
{
    kvs_router *r = make_router(2, KVS_ROUTE_KV, 8);
    size_t top = (size_t)1 << (sizeof(size_t) * 8 - 1);
    KVT_EQ(kvs__rcapacity_for(0), 16);
    KVT_EQ(kvs__rcapacity_for(10), 16);
    KVT_EQ(kvs__rcapacity_for(11), 32);
    KVT_EQ(kvs__rcapacity_for(SIZE_MAX / 4), top);
    KVT_EQ(kvs__rcapacity_for(SIZE_MAX / 4 + 1), 0);
    KVT_EQ(kvs__rcapacity_for(SIZE_MAX), 0);
    make_chains();
    store(r, 0, g_chain[0], 0, 4);
    KVT_EQ(kvs__rreserve(r, SIZE_MAX / 2), KVS_ENOMEM);
    KVT_EQ(stats_of(r).capacity, 16);
    KVT_EQ(stats_of(r).hashes, 4);
    KVT_EQ(kvs_router_check(r, NULL, 0), KVS_OK);
    kvs_router_destroy(r);
}

int main(void)
{
    KVT_RUN(test_index_matches_pools_5_workers);
    KVT_RUN(test_index_matches_pools_70_workers);
    KVT_RUN(test_index_fed_through_buses);
    KVT_RUN(test_lost_and_reordered_events_are_survived);
    KVT_RUN(test_stale_entry_is_a_miss_not_a_hit);
    KVT_RUN(test_round_robin_takes_turns);
    KVT_RUN(test_least_loaded_picks_the_idlest);
    KVT_RUN(test_affinity_keeps_a_key_on_one_worker);
    KVT_RUN(test_kv_routes_to_least_prefill_plus_load);
    KVT_RUN(test_ties_among_some_workers_take_turns);
    KVT_RUN(test_weighted_load_overflow_is_refused);
    KVT_RUN(test_workers_beyond_64);
    KVT_RUN(test_kv_finds_more_than_round_robin);
    KVT_RUN(test_engines_on_threads_feed_one_router);
    KVT_RUN(test_bad_arguments_change_nothing);
    KVT_RUN(test_steady_state_does_not_allocate);
    KVT_RUN(test_stores_of_held_hashes_do_not_grow);
    KVT_RUN(test_capacity_beyond_memory_is_refused);
    KVT_RUN(test_cleared_of_an_empty_worker_changes_nothing);
    return kvt_summary();
}
