/* kvroute.h — routing requests across a fleet of engines by what their KV caches hold (part of kvcache)
 *
 * Do this in exactly one C or C++ file:    #define KVROUTE_IMPLEMENTATION      (or KVCACHE_IMPLEMENTATION)
 *                                           #include "kvroute.h"
 * It includes kvsched.h (define the implementation macros of kvblock.h, kvoffload.h and kvsched.h there
 * too, or KVCACHE_IMPLEMENTATION for all). Needs C11 (or C++11), POSIX threads, -pthread. It is its own
 * header on top of the scheduler layer: an engine needs none of it, a fleet's
 * front end needs little else. kvcache.h inlines it after kvsched.h (part 4).
 *
 * Manual: 1. Quick start  2. Concepts  3. Policies  4. Feeding events  5. Configuration
 *         6. Thread safety  7. Errors
 *
 * 1. QUICK START — N engines, a router in front (a simulator loop looks the same)
 *
 *     kvs_router_config rc = { .num_workers = 4 };         // KV-aware by default
 *     kvs_router *router;  kvs_router_create(&rc, &router);
 *     for (w = 0; w < 4; w++) {                             // each engine's device pool feeds it
 *         kvb_pool_config pc = { .num_blocks = 9216, .on_events = kvs_router_pool_events,
 *                                .event_user = kvs_router_feed(router, w) };
 *         kvb_pool_create(&pc, &device[w]);   ... one scheduler per engine on its pool ...
 *     }
 *     // per request: its block hashes (kvb_hash_prompt) and each engine's outstanding work in blocks
 *     uint32_t w;  size_t overlap;
 *     kvs_router_route(router, hashes, n, loads, &w, &overlap);
 *     kvs_sched_add(engine[w], &request, &id);            // the engine's own match decides what hits
 *     ... as engine w registers and evicts blocks, its pool's events update the router's index ...
 *     kvs_router_destroy(router);                          // after the pools stop sending events
 *
 * 2. CONCEPTS
 *
 * Workers are numbered 0 .. num_workers - 1. The router keeps one index from a block's 128-bit sequence
 * hash to the set of workers that hold it: a bitmap of ceil(num_workers / 64) words per hash (one word
 * for up to 64 workers, more words, in chunks of 64, beyond). It is built only from the workers' block
 * events (kvb_event: STORED sets the worker's bit, REMOVED clears it, CLEARED clears it everywhere), so
 * it is the router's belief, not the truth: events lost, late or reordered leave stale bits, and a stale
 * bit costs one mispredicted hit, never a wrong answer — the engine's own kvb_match decides what is
 * cached. Events of a hash already in the state they announce (a STORED for a set bit, a REMOVED for a
 * clear one) change nothing and are counted (kvs_router_stats.stale_events). Only events of one tier
 * are indexed (kvs_router_config.tier, default 0: the device pool); the all-zero hash (the root) never
 * is.
 *
 * The index is open addressing (linear probing, backward-shift deletion) on the hash itself, at most
 * two thirds full, like kvblock.h's prefix index. A lookup of a request's hash chain costs one probe
 * per block, with the probes of the next blocks prefetched, and stops at the first block that no
 * worker holding the whole prefix so far holds (a worker's cache is a prefix cache: after its first
 * miss nothing counts). It never allocates: the index grows (doubling) only when STORED events would
 * take it past two thirds, and a worker's scratch is allocated at create.
 *
 * Overlap of worker w for a request of n blocks: the length of the longest prefix of its hashes that
 * the index says w holds (kvs_router_overlaps gives all of them).
 *
 * 3. POLICIES (kvs_router_config.policy; each route also reports the chosen worker's overlap)
 *     KVS_ROUTE_KV (default)   least cost, cost(w) = (n - overlap(w)) + load_weight x loads[w]: the
 *                              blocks left to prefill plus the worker's outstanding work, Dynamo's
 *                              cost shape. loads in blocks (e.g. prompt blocks waiting to prefill plus
 *                              blocks held by running requests); load_weight default 1.0
 *     KVS_ROUTE_ROUND_ROBIN    0, 1, 2, ... in turn
 *     KVS_ROUTE_LEAST_LOADED   least loads[w]
 *     KVS_ROUTE_AFFINITY       a key picks the worker, mix(key) mod num_workers: the same key always
 *                              goes to the same worker. kvs_router_route_key takes the key (e.g. the
 *                              conversation); kvs_router_route uses the hash of the first
 *                              min(n, affinity_blocks) blocks (traces carry no session id)
 * Ties (equal cost or load) go to the tied worker that won a tie least recently, and among those the
 * first at or after a cursor that moves by one each route, so equal workers take turns (also when only
 * some workers tie, or tied routes alternate with others); every choice is deterministic. loads may be NULL (all zero).
 *
 * 4. FEEDING EVENTS — three ways, all the same call underneath:
 *     direct      kvs_router_events(router, worker, events, n)     (returns errors, e.g. KVS_ENOMEM)
 *     pool        kvb_pool_config.on_events = kvs_router_pool_events,
 *                 .event_user = kvs_router_feed(router, worker)
 *     bus         kvs_bus_subscribe(bus, KVS_ROUTER_BUS_KINDS, kvs_router_bus_event,
 *                                   kvs_router_feed(router, worker), &id)   (one bus per engine)
 * The adapters cannot return an error: a batch they could not apply (out of memory while growing) is
 * dropped whole and counted (kvs_router_stats.dropped_events); the index is then stale, as after lost
 * events. A batch is applied all or nothing: the index is grown first for every STORED in it of a hash
 * it does not hold.
 *
 * 5. CONFIGURATION (kvs_router_config; zero means default)
 *     num_workers       required, 1 .. KVS_ROUTER_MAX_WORKERS (1024)
 *     policy            KVS_ROUTE_KV
 *     load_weight       1.0 (KV: cost of one block of outstanding work against one block to prefill;
 *                       0 .. 1e9; to route on cache alone pass loads = NULL)
 *     tier              0 (the tier whose events are indexed; others are ignored and counted)
 *     expected_blocks   16,384 distinct hashes sized up front (the index grows past them)
 *     affinity_blocks   4 (the blocks kvs_router_route's affinity key covers)
 * Memory: the index takes (16 + 8 x words) bytes per slot, slots = the power of two that keeps it at most
 * two thirds full (8 workers, 1M hashes: 2M slots, 48 MiB). Allocation goes through KVB_MALLOC /
 * KVB_FREE when they are defined (see kvblock.h), malloc / free otherwise.
 *
 * 6. THREAD SAFETY — a router is safe to use from any number of threads: one mutex per router, taken once
 * per call (a batch of events, a route). The adapters run in the pool's or bus's callback, under that
 * lock; the router never calls back into pools or buses, so the lock order is always theirs, then the
 * router's. kvs_router_feed needs no lock. Destroy only after every feeding pool and bus has stopped.
 *
 * 7. ERRORS — kvs_result codes (KVS_OK, KVS_EINVAL for NULL arguments or an unknown event kind,
 * KVS_ENOMEM, KVS_ENOSPACE for a buffer too small) and the router's own: KVS_ECONFIG (a configuration
 * value out of range), KVS_EWORKER (a worker index out of range), KVS_ELOAD (a load negative or not
 * finite, or under KVS_ROUTE_KV so large that load_weight x load is not). kvs_router_result_string
 * names them all. A call that fails changes nothing.
 */
#ifndef KVROUTE_H
#define KVROUTE_H
#define KVROUTE_VERSION_MAJOR 0
#define KVROUTE_VERSION_MINOR 2
#define KVROUTE_VERSION_PATCH 0

#include "kvsched.h"

#define KVS_ECONFIG (-221) /* a router configuration value is out of range */
#define KVS_EWORKER (-222) /* a worker index is out of range */
#define KVS_ELOAD (-223)   /* a load is negative or not finite */

#define KVS_ROUTER_MAX_WORKERS 1024
/* The bus events a router consumes: kvs_bus_subscribe(bus, KVS_ROUTER_BUS_KINDS, ...). */
#define KVS_ROUTER_BUS_KINDS \
    (KVS_EV_MASK(KVS_EV_BLOCK_STORED) | KVS_EV_MASK(KVS_EV_BLOCK_REMOVED) | KVS_EV_MASK(KVS_EV_BLOCK_CLEARED))

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvs_route_policy {
    KVS_ROUTE_DEFAULT = 0,  /* = KVS_ROUTE_KV */
    KVS_ROUTE_KV,           /* least (blocks to prefill + load_weight x load) */
    KVS_ROUTE_ROUND_ROBIN,
    KVS_ROUTE_LEAST_LOADED,
    KVS_ROUTE_AFFINITY,     /* a key picks the worker */
    KVS_ROUTE__COUNT
} kvs_route_policy;

typedef struct kvs_router_config {
    uint32_t num_workers;      /* required, 1 .. KVS_ROUTER_MAX_WORKERS */
    kvs_route_policy policy;   /* default KVS_ROUTE_KV */
    double load_weight;        /* KV: weight of a block of outstanding work; default 1.0 */
    uint32_t tier;             /* events of this tier are indexed; default 0 (device) */
    uint32_t expected_blocks;  /* distinct hashes the index is sized for at create; default 16,384 */
    uint32_t affinity_blocks;  /* kvs_router_route's affinity key: the first min(n, this) blocks; default 4 */
} kvs_router_config;

typedef struct kvs_router_stats {
    uint64_t routes;          /* successful route calls */
    uint64_t route_blocks;    /* hashes given to them */
    uint64_t probes;          /* index probes they made (at most one per block) */
    uint64_t overlap_blocks;  /* the chosen workers' overlaps, summed: predicted hits */
    uint64_t events;          /* events that changed the index (so not a CLEARED of a worker that
                                 holds nothing: that one is counted nowhere) */
    uint64_t stale_events;    /* STORED of a set bit, REMOVED of a clear one: nothing to change */
    uint64_t ignored_events;  /* of another tier, or of the zero hash */
    uint64_t dropped_events;  /* events of batches the adapters could not apply (out of memory) */
    uint64_t hashes;          /* distinct hashes in the index */
    uint64_t capacity;        /* its slots */
} kvs_router_stats;

typedef struct kvs_router kvs_router;

/* Name of a router, kvs_, kvo_ or kvb_ result. Thread safety: pure function. */
KVS_API const char *kvs_router_result_string(int result);

/* Create a router (config -> create -> destroy). KVS_EINVAL on NULL arguments, KVS_ECONFIG for a value
 * out of range (section 5), KVS_ENOMEM. Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_create(const kvs_router_config *config, kvs_router **out);

/* Free the router; NULL is a no-op. Thread safety: no other call on it may run or follow, and no pool
 * or bus may still feed it. */
KVS_API void kvs_router_destroy(kvs_router *router);

/* The resolved configuration (defaults filled in). Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_get_config(const kvs_router *router, kvs_router_config *out);

/* Counters and the index's size. Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_get_stats(kvs_router *router, kvs_router_stats *out);

/* Apply a batch of worker `worker`'s block events, in order (section 2). All or nothing: KVS_EINVAL
 * (NULL router, NULL events with n > 0, an unknown kind), KVS_EWORKER, KVS_ENOMEM (growing the index).
 * Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_events(kvs_router *router, uint32_t worker, const kvb_event *events, size_t n);

/* The user pointer that ties an adapter to (router, worker): pass it as kvb_pool_config.event_user or
 * as a bus subscriber's user. NULL for a NULL router or a worker out of range. Valid for the router's
 * lifetime. Thread safety: safe from any thread (no lock). */
KVS_API void *kvs_router_feed(kvs_router *router, uint32_t worker);

/* kvb_pool_config.on_events adapter (a kvb_event_fn); feed = kvs_router_feed(router, worker). */
KVS_API void kvs_router_pool_events(const kvb_event *events, size_t n, void *feed);

/* kvs_bus subscriber adapter (a kvs_event_fn) for KVS_ROUTER_BUS_KINDS; other kinds are ignored. */
KVS_API void kvs_router_bus_event(void *feed, const kvs_event *event);

/* Route a request whose full blocks have the hash chain `hashes` (n of them, may be 0): the policy's
 * worker goes to *out_worker and that worker's overlap (blocks of the prefix the index says it holds)
 * to *out_overlap (may be NULL). loads: num_workers outstanding-work figures, or NULL for all zero.
 * KVS_EINVAL (NULL router, out_worker, or hashes with n > 0), KVS_ELOAD; nothing changes then (the
 * tie cursor included). Never allocates. Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_route(kvs_router *router, const kvb_hash *hashes, size_t n, const double *loads,
                                    uint32_t *out_worker, size_t *out_overlap);

/* kvs_router_route with the affinity key given (KVS_ROUTE_AFFINITY; other policies ignore it). */
KVS_API kvs_result kvs_router_route_key(kvs_router *router, uint64_t key, const kvb_hash *hashes, size_t n,
                                        const double *loads, uint32_t *out_worker, size_t *out_overlap);

/* Every worker's overlap for the chain: out has num_workers entries. Counts no route. KVS_EINVAL on NULL
 * arguments. Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_overlaps(kvs_router *router, const kvb_hash *hashes, size_t n, size_t *out);

/* The workers the index says hold `hash`: bit w % 64 of word w / 64, all zero when none. words >=
 * ceil(num_workers / 64), else KVS_ENOSPACE. Thread safety: safe from any thread. */
KVS_API kvs_result kvs_router_holders(kvs_router *router, const kvb_hash *hash, uint64_t *out_bits, size_t words);

/* Check the index: every entry reachable from its home slot, none empty, counts right. KVS_OK, or
 * KVB_ECORRUPT (cast) with a reason in why (may be NULL). Cost O(slots). Thread safety: any thread. */
KVS_API kvs_result kvs_router_check(kvs_router *router, char *why, size_t why_size);

#ifdef __cplusplus
}
#endif
#endif /* KVROUTE_H */

/* ================================================================================================ */
/*                                        IMPLEMENTATION                                            */
/* ================================================================================================ */
#if defined(KVROUTE_IMPLEMENTATION) || defined(KVCACHE_IMPLEMENTATION)
#ifndef KVROUTE_IMPL_INCLUDED
#define KVROUTE_IMPL_INCLUDED

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVB_MALLOC
#define KVS__RALLOC(sz) KVB_MALLOC(sz)
#define KVS__RFREE(p) KVB_FREE(p)
#else
#define KVS__RALLOC(sz) malloc(sz)
#define KVS__RFREE(p) free(p)
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVS__RPREFETCH(p) __builtin_prefetch(p)
#define KVS__RCTZ(x) ((uint32_t)__builtin_ctzll(x))
#else
#define KVS__RPREFETCH(p) ((void)(p))
static uint32_t KVS__RCTZ(uint64_t x)
{
    uint32_t n = 0;
    while (!(x & 1)) { x >>= 1; n++; }
    return n;
}
#endif

#define KVS__RMAX_WEIGHT 1e9 /* load_weight: a block of work worth a billion to prefill is all load */
#define KVS__RDEF_WEIGHT 1.0
#define KVS__RDEF_EXPECTED 16384u
#define KVS__RDEF_AFFINITY 4u
#define KVS__RAHEAD 16 /* probes prefetched ahead of the one made (a power of two) */

typedef struct kvs__feed { kvs_router *router; uint32_t worker; } kvs__feed;

struct kvs_router {
    kvs_router_config cfg;
    pthread_mutex_t lock;
    uint64_t *slots;      /* capacity slots of `stride` words: lo, hi, then `words` bitmap words */
    size_t capacity, mask, count, stride, words;
    kvs__feed *feeds;     /* one per worker: the adapters' user pointers */
    size_t *overlap;      /* scratch of a route: one per worker */
    uint64_t *alive;      /* scratch of a route: workers holding the whole prefix so far */
    uint32_t cursor;      /* round robin, and where ties start */
    uint64_t *tie_won;    /* per worker: when it last won a tie (a count of ties broken), 0 never */
    uint64_t ties;        /* ties broken (KV and least-loaded routes with several best workers) */
    kvs_router_stats stats;
};

KVS_API const char *kvs_router_result_string(int result)
{
    switch (result) {
    case KVS_ECONFIG: return "router configuration value out of range";
    case KVS_EWORKER: return "worker index out of range";
    case KVS_ELOAD: return "load is negative or not finite";
    default: return kvs_result_string(result);
    }
}

/* ---- the index: open addressing on the mixed hash, linear probing, backward-shift deletion ------- */

/* A hash's home slot: kvblock.h's mix of both halves, so structured hashes spread as uniform ones do. */
static size_t kvs__rhome(const kvs_router *r, const kvb_hash *h) { return (size_t)kvb__mix(h) & r->mask; }

static uint64_t *kvs__rslot(const kvs_router *r, size_t pos) { return r->slots + pos * r->stride; }
static int kvs__rempty(const uint64_t *s) { return (s[0] | s[1]) == 0; }

/* The slot holding h, searched from pos (h's home), or NULL. */
static uint64_t *kvs__rfind_from(const kvs_router *r, const kvb_hash *h, size_t pos)
{
    for (;;) {
        uint64_t *s = kvs__rslot(r, pos);
        if (s[0] == h->lo && s[1] == h->hi) return s;
        if (kvs__rempty(s)) return NULL;
        pos = (pos + 1) & r->mask;
    }
}

static uint64_t *kvs__rfind(const kvs_router *r, const kvb_hash *h) { return kvs__rfind_from(r, h, kvs__rhome(r, h)); }

/* A free slot for h, which is not in the table (the table has room). */
static uint64_t *kvs__rinsert(kvs_router *r, const kvb_hash *h)
{
    size_t pos = kvs__rhome(r, h);
    uint64_t *s;
    while (!kvs__rempty(s = kvs__rslot(r, pos))) pos = (pos + 1) & r->mask;
    s[0] = h->lo;
    s[1] = h->hi;
    r->count++;
    return s;
}

/* The home of the hash an occupied slot holds. */
static size_t kvs__rslot_home(const kvs_router *r, const uint64_t *s)
{
    kvb_hash h;
    h.lo = s[0];
    h.hi = s[1];
    return kvs__rhome(r, &h);
}

static void kvs__rdelete(kvs_router *r, size_t i)
{
    size_t j = i, k, m = r->mask;
    for (;;) {
        j = (j + 1) & m;
        if (kvs__rempty(kvs__rslot(r, j))) break;
        k = kvs__rslot_home(r, kvs__rslot(r, j));
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue; /* home lies between: stays */
        memcpy(kvs__rslot(r, i), kvs__rslot(r, j), r->stride * sizeof(uint64_t));
        i = j;
    }
    memset(kvs__rslot(r, i), 0, r->stride * sizeof(uint64_t));
    r->count--;
}

static int kvs__rbits_zero(const kvs_router *r, const uint64_t *s)
{
    size_t k;
    for (k = 0; k < r->words; k++)
        if (s[2 + k]) return 0;
    return 1;
}

/* Slots for `hashes` distinct hashes at most two thirds full, one slot always empty; 0 for more than
 * a size_t can count. */
static size_t kvs__rcapacity_for(size_t hashes)
{
    size_t c = 16;
    if (hashes > SIZE_MAX / 4) return 0; /* more than memory holds (a 32-bit size_t: 2^30 hashes) */
    while (c < hashes + hashes / 2 + 1) c <<= 1;
    return c;
}

/* Make room for `more` new hashes: rehash into a larger table. KVS_ENOMEM changes nothing. */
static kvs_result kvs__rreserve(kvs_router *r, size_t more)
{
    size_t cap = kvs__rcapacity_for(r->count + more), i, old_cap = r->capacity;
    uint64_t *old = r->slots, *fresh;
    if (cap && cap <= r->capacity) return KVS_OK;
    if (!cap || cap > SIZE_MAX / (r->stride * sizeof(uint64_t))) return KVS_ENOMEM;
    fresh = (uint64_t *)KVS__RALLOC(cap * r->stride * sizeof(uint64_t));
    if (!fresh) return KVS_ENOMEM;
    memset(fresh, 0, cap * r->stride * sizeof(uint64_t));
    r->slots = fresh;
    r->capacity = cap;
    r->mask = cap - 1;
    r->count = 0;
    for (i = 0; i < old_cap; i++) {
        const uint64_t *s = old + i * r->stride;
        kvb_hash h;
        if (kvs__rempty(s)) continue;
        h.lo = s[0];
        h.hi = s[1];
        memcpy(kvs__rinsert(r, &h) + 2, s + 2, r->words * sizeof(uint64_t));
    }
    KVS__RFREE(old);
    r->stats.capacity = cap;
    return KVS_OK;
}

/* ---- create / destroy ------------------------------------------------------------------------- */

static kvs_result kvs__rresolve(const kvs_router_config *in, kvs_router_config *c)
{
    *c = *in;
    if (c->num_workers < 1 || c->num_workers > KVS_ROUTER_MAX_WORKERS) return (kvs_result)KVS_ECONFIG;
    if ((int)c->policy < 0 || c->policy >= KVS_ROUTE__COUNT) return (kvs_result)KVS_ECONFIG;
    /* NaN too; above the bound, weight x load overflows and ties every loaded worker (at infinity),
     * whatever its cached prefix */
    if (!(c->load_weight >= 0) || !(c->load_weight <= KVS__RMAX_WEIGHT)) return (kvs_result)KVS_ECONFIG;
    if (c->policy == KVS_ROUTE_DEFAULT) c->policy = KVS_ROUTE_KV;
    if (c->load_weight == 0) c->load_weight = KVS__RDEF_WEIGHT;
    if (!c->expected_blocks) c->expected_blocks = KVS__RDEF_EXPECTED;
    if (!c->affinity_blocks) c->affinity_blocks = KVS__RDEF_AFFINITY;
    return KVS_OK;
}

KVS_API void kvs_router_destroy(kvs_router *router)
{
    if (!router) return;
    pthread_mutex_destroy(&router->lock);
    KVS__RFREE(router->slots);
    KVS__RFREE(router->feeds);
    KVS__RFREE(router->overlap);
    KVS__RFREE(router->alive);
    KVS__RFREE(router->tie_won);
    KVS__RFREE(router);
}

KVS_API kvs_result kvs_router_create(const kvs_router_config *config, kvs_router **out)
{
    kvs_router_config c;
    kvs_router *r;
    kvs_result res;
    uint32_t w;
    if (!config || !out) return KVS_EINVAL;
    res = kvs__rresolve(config, &c);
    if (res != KVS_OK) return res;
    r = (kvs_router *)KVS__RALLOC(sizeof *r);
    if (!r) return KVS_ENOMEM;
    memset(r, 0, sizeof *r);
    r->cfg = c;
    r->words = (c.num_workers + 63u) / 64u;
    r->stride = 2 + r->words;
    r->feeds = (kvs__feed *)KVS__RALLOC(c.num_workers * sizeof *r->feeds);
    r->overlap = (size_t *)KVS__RALLOC(c.num_workers * sizeof *r->overlap);
    r->alive = (uint64_t *)KVS__RALLOC(r->words * sizeof *r->alive);
    r->tie_won = (uint64_t *)KVS__RALLOC(c.num_workers * sizeof *r->tie_won);
    if (!r->feeds || !r->overlap || !r->alive || !r->tie_won || kvs__rreserve(r, c.expected_blocks) != KVS_OK ||
        pthread_mutex_init(&r->lock, NULL) != 0) {
        KVS__RFREE(r->slots);
        KVS__RFREE(r->feeds);
        KVS__RFREE(r->overlap);
        KVS__RFREE(r->alive);
        KVS__RFREE(r->tie_won);
        KVS__RFREE(r);
        return KVS_ENOMEM;
    }
    memset(r->tie_won, 0, c.num_workers * sizeof *r->tie_won);
    for (w = 0; w < c.num_workers; w++) {
        r->feeds[w].router = r;
        r->feeds[w].worker = w;
    }
    *out = r;
    return KVS_OK;
}

KVS_API kvs_result kvs_router_get_config(const kvs_router *router, kvs_router_config *out)
{
    if (!router || !out) return KVS_EINVAL;
    *out = router->cfg; /* immutable after create */
    return KVS_OK;
}

KVS_API kvs_result kvs_router_get_stats(kvs_router *router, kvs_router_stats *out)
{
    if (!router || !out) return KVS_EINVAL;
    pthread_mutex_lock(&router->lock);
    *out = router->stats;
    out->hashes = router->count;
    out->capacity = router->capacity;
    pthread_mutex_unlock(&router->lock);
    return KVS_OK;
}

/* ---- events ------------------------------------------------------------------------------------ */

static int kvs__rindexed(const kvs_router *r, const kvb_event *e)
{
    return e->tier == r->cfg.tier && (e->kind == KVB_EVENT_CLEARED || (e->hash.lo | e->hash.hi) != 0);
}

static void kvs__rstored(kvs_router *r, uint64_t word, uint64_t bit, const kvb_hash *h)
{
    uint64_t *s = kvs__rfind(r, h);
    if (!s) s = kvs__rinsert(r, h); /* room was reserved for the batch */
    if (s[2 + word] & bit) { r->stats.stale_events++; return; }
    s[2 + word] |= bit;
    r->stats.events++;
}

static void kvs__rremoved(kvs_router *r, uint64_t word, uint64_t bit, const kvb_hash *h)
{
    uint64_t *s = kvs__rfind(r, h);
    if (!s || !(s[2 + word] & bit)) { r->stats.stale_events++; return; }
    s[2 + word] &= ~bit;
    r->stats.events++;
    if (kvs__rbits_zero(r, s)) kvs__rdelete(r, (size_t)(s - r->slots) / r->stride);
}

/* A worker dropped everything: clear its bit in every entry. A deletion shifts later entries back into
 * slot i, so i is looked at again; entries shifted across the wrap were already cleared. */
static void kvs__rcleared(kvs_router *r, uint64_t word, uint64_t bit)
{
    size_t i = 0;
    int changed = 0;
    while (i < r->capacity) {
        uint64_t *s = kvs__rslot(r, i);
        if (!kvs__rempty(s) && (s[2 + word] & bit)) {
            s[2 + word] &= ~bit;
            changed = 1;
            if (kvs__rbits_zero(r, s)) { kvs__rdelete(r, i); continue; }
        }
        i++;
    }
    /* a worker that held nothing: no change, and not stale either (a pool reset twice sends two) */
    if (changed) r->stats.events++;
}

static kvs_result kvs__rapply(kvs_router *r, uint32_t worker, const kvb_event *events, size_t n)
{
    size_t i, stored = 0;
    uint64_t word = worker / 64u, bit = UINT64_C(1) << (worker % 64u);
    kvs_result res;
    for (i = 0; i < n; i++) {
        if (events[i].kind != KVB_EVENT_STORED && events[i].kind != KVB_EVENT_REMOVED &&
            events[i].kind != KVB_EVENT_CLEARED)
            return KVS_EINVAL;
        /* a hash the index holds needs no slot (one the batch deletes first frees the slot it takes) */
        stored += (size_t)(events[i].kind == KVB_EVENT_STORED && kvs__rindexed(r, &events[i]) &&
                           !kvs__rfind(r, &events[i].hash));
    }
    res = kvs__rreserve(r, stored);
    if (res != KVS_OK) return res;
    for (i = 0; i < n; i++) {
        const kvb_event *e = &events[i];
        if (!kvs__rindexed(r, e)) r->stats.ignored_events++;
        else if (e->kind == KVB_EVENT_STORED) kvs__rstored(r, word, bit, &e->hash);
        else if (e->kind == KVB_EVENT_REMOVED) kvs__rremoved(r, word, bit, &e->hash);
        else kvs__rcleared(r, word, bit);
    }
    return KVS_OK;
}

KVS_API kvs_result kvs_router_events(kvs_router *router, uint32_t worker, const kvb_event *events, size_t n)
{
    kvs_result res;
    if (!router || (!events && n)) return KVS_EINVAL;
    if (worker >= router->cfg.num_workers) return (kvs_result)KVS_EWORKER;
    pthread_mutex_lock(&router->lock);
    res = kvs__rapply(router, worker, events, n);
    pthread_mutex_unlock(&router->lock);
    return res;
}

KVS_API void *kvs_router_feed(kvs_router *router, uint32_t worker)
{
    if (!router || worker >= router->cfg.num_workers) return NULL;
    return &router->feeds[worker];
}

KVS_API void kvs_router_pool_events(const kvb_event *events, size_t n, void *feed)
{
    kvs__feed *f = (kvs__feed *)feed;
    if (!f || !f->router || !events) return;
    pthread_mutex_lock(&f->router->lock);
    if (kvs__rapply(f->router, f->worker, events, n) != KVS_OK) f->router->stats.dropped_events += n;
    pthread_mutex_unlock(&f->router->lock);
}

KVS_API void kvs_router_bus_event(void *feed, const kvs_event *event)
{
    kvb_event e;
    if (!event) return;
    memset(&e, 0, sizeof e);
    switch (event->kind) {
    case KVS_EV_BLOCK_STORED: e.kind = KVB_EVENT_STORED; break;
    case KVS_EV_BLOCK_REMOVED: e.kind = KVB_EVENT_REMOVED; break;
    case KVS_EV_BLOCK_CLEARED: e.kind = KVB_EVENT_CLEARED; break;
    default: return;
    }
    e.tier = event->u.block.tier;
    e.num_tokens = event->u.block.tokens;
    e.hash = event->u.block.hash;
    e.parent = event->u.block.parent;
    kvs_router_pool_events(&e, 1, feed);
}

/* ---- lookups ----------------------------------------------------------------------------------- */

/* Every worker's overlap into r->overlap; returns the probes made. A worker leaves `alive` at its
 * first miss and keeps the position as its overlap; the scan ends when none is left. The homes of the
 * next KVS__RAHEAD hashes are fetched ahead and kept until their turn. */
static size_t kvs__rscan(kvs_router *r, const kvb_hash *hashes, size_t n)
{
    size_t i, k, W = r->words, nw = r->cfg.num_workers, home[KVS__RAHEAD]; /* hash i's at i % KVS__RAHEAD */
    for (k = 0; k < W; k++) r->alive[k] = ~UINT64_C(0);
    if (nw % 64) r->alive[W - 1] = (UINT64_C(1) << (nw % 64)) - 1;
    for (i = 0; i < n && i < KVS__RAHEAD; i++) KVS__RPREFETCH(kvs__rslot(r, home[i] = kvs__rhome(r, &hashes[i])));
    for (i = 0; i < n; i++) {
        const uint64_t *s;
        uint64_t any = 0;
        size_t own = home[i % KVS__RAHEAD];
        if (i + KVS__RAHEAD < n)
            KVS__RPREFETCH(kvs__rslot(r, home[i % KVS__RAHEAD] = kvs__rhome(r, &hashes[i + KVS__RAHEAD])));
        s = kvs__rfind_from(r, &hashes[i], own);
        for (k = 0; k < W; k++) {
            uint64_t held = s ? s[2 + k] : 0, gone = r->alive[k] & ~held;
            for (; gone; gone &= gone - 1) r->overlap[k * 64 + KVS__RCTZ(gone)] = i;
            any |= r->alive[k] &= held;
        }
        if (!any) return i + 1;
    }
    for (k = 0; k < W; k++)
        for (; r->alive[k]; r->alive[k] &= r->alive[k] - 1) r->overlap[k * 64 + KVS__RCTZ(r->alive[k])] = n;
    return n;
}

static uint64_t kvs__rmix(uint64_t x)
{
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

static double kvs__rcost(const kvs_router *r, uint32_t w, size_t n, const double *loads)
{
    double load = loads ? loads[w] : 0;
    if (r->cfg.policy == KVS_ROUTE_LEAST_LOADED) return load;
    return (double)(n - r->overlap[w]) + r->cfg.load_weight * load;
}

/* The policy's choice; r->overlap holds the scan when the policy needs it. Of several workers of the
 * least cost, the one that won a tie least recently, the first at or after the cursor among equals:
 * a cursor alone gave nearly every tie to the tied worker after a run of untied ones. */
static uint32_t kvs__rchoose(kvs_router *r, uint64_t key, size_t n, const double *loads)
{
    uint32_t nw = r->cfg.num_workers, best = r->cursor % nw, j, tied = 0, pick = best;
    double best_cost = INFINITY;
    switch (r->cfg.policy) {
    case KVS_ROUTE_ROUND_ROBIN: return best;
    case KVS_ROUTE_AFFINITY: return (uint32_t)(kvs__rmix(key) % nw);
    default: break;
    }
    for (j = 0; j < nw; j++) {
        uint32_t w = (r->cursor + j) % nw;
        double cost = kvs__rcost(r, w, n, loads);
        if (cost < best_cost) {
            best_cost = cost;
            best = w;
        }
    }
    for (j = 0; j < nw; j++) {
        uint32_t w = (r->cursor + j) % nw;
        if (!(kvs__rcost(r, w, n, loads) == best_cost) && w != best) continue;
        if (!tied++ || r->tie_won[w] < r->tie_won[pick]) pick = w;
    }
    if (tied > 1) r->tie_won[pick] = ++r->ties;
    return pick;
}

static kvs_result kvs__rroute(kvs_router *r, int keyed, uint64_t key, const kvb_hash *hashes, size_t n,
                              const double *loads, uint32_t *out_worker, size_t *out_overlap)
{
    uint32_t w, nw;
    size_t probes;
    if (!r || !out_worker || (!hashes && n)) return KVS_EINVAL;
    nw = r->cfg.num_workers;
    if (loads)
        for (w = 0; w < nw; w++) /* KV: load_weight x load must stay finite, or loaded workers all tie */
            if (!(loads[w] >= 0) || !isfinite(loads[w]) ||
                (r->cfg.policy == KVS_ROUTE_KV && !isfinite(r->cfg.load_weight * loads[w])))
                return (kvs_result)KVS_ELOAD;
    if (!keyed) key = n ? hashes[(n < r->cfg.affinity_blocks ? n : r->cfg.affinity_blocks) - 1].lo : 0;
    pthread_mutex_lock(&r->lock);
    probes = kvs__rscan(r, hashes, n);
    w = kvs__rchoose(r, key, n, loads);
    r->cursor = (r->cursor + 1) % nw;
    r->stats.routes++;
    r->stats.route_blocks += n;
    r->stats.probes += probes;
    r->stats.overlap_blocks += r->overlap[w];
    *out_worker = w;
    if (out_overlap) *out_overlap = r->overlap[w];
    pthread_mutex_unlock(&r->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_router_route(kvs_router *router, const kvb_hash *hashes, size_t n, const double *loads,
                                    uint32_t *out_worker, size_t *out_overlap)
{
    return kvs__rroute(router, 0, 0, hashes, n, loads, out_worker, out_overlap);
}

KVS_API kvs_result kvs_router_route_key(kvs_router *router, uint64_t key, const kvb_hash *hashes, size_t n,
                                        const double *loads, uint32_t *out_worker, size_t *out_overlap)
{
    return kvs__rroute(router, 1, key, hashes, n, loads, out_worker, out_overlap);
}

KVS_API kvs_result kvs_router_overlaps(kvs_router *router, const kvb_hash *hashes, size_t n, size_t *out)
{
    if (!router || !out || (!hashes && n)) return KVS_EINVAL;
    pthread_mutex_lock(&router->lock);
    kvs__rscan(router, hashes, n);
    memcpy(out, router->overlap, router->cfg.num_workers * sizeof *out);
    pthread_mutex_unlock(&router->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_router_holders(kvs_router *router, const kvb_hash *hash, uint64_t *out_bits, size_t words)
{
    const uint64_t *s;
    if (!router || !hash || !out_bits) return KVS_EINVAL;
    if (words < router->words) return KVS_ENOSPACE;
    memset(out_bits, 0, words * sizeof *out_bits);
    pthread_mutex_lock(&router->lock);
    s = (hash->lo | hash->hi) ? kvs__rfind(router, hash) : NULL;
    if (s) memcpy(out_bits, s + 2, router->words * sizeof *out_bits);
    pthread_mutex_unlock(&router->lock);
    return KVS_OK;
}

static kvs_result kvs__rcorrupt(char *why, size_t why_size, const char *text, size_t slot)
{
    if (why && why_size) snprintf(why, why_size, "%s (slot %zu)", text, slot);
    return (kvs_result)KVB_ECORRUPT;
}

KVS_API kvs_result kvs_router_check(kvs_router *router, char *why, size_t why_size)
{
    size_t i, live = 0, nw;
    kvs_result res = KVS_OK;
    if (!router) return KVS_EINVAL;
    nw = router->cfg.num_workers;
    pthread_mutex_lock(&router->lock);
    for (i = 0; i < router->capacity && res == KVS_OK; i++) {
        const uint64_t *s = kvs__rslot(router, i);
        kvb_hash h;
        if (kvs__rempty(s)) continue;
        live++;
        h.lo = s[0];
        h.hi = s[1];
        if (kvs__rbits_zero(router, s)) res = kvs__rcorrupt(why, why_size, "entry held by no worker", i);
        else if (nw % 64 && (s[2 + router->words - 1] >> (nw % 64)))
            res = kvs__rcorrupt(why, why_size, "bit of a worker that does not exist", i);
        else if (kvs__rfind(router, &h) != s) res = kvs__rcorrupt(why, why_size, "entry not reachable from its home", i);
    }
    if (res == KVS_OK && live != router->count) res = kvs__rcorrupt(why, why_size, "count differs from the entries", 0);
    if (res == KVS_OK && router->count * 3 > router->capacity * 2)
        res = kvs__rcorrupt(why, why_size, "index over two thirds full", 0);
    pthread_mutex_unlock(&router->lock);
    if (res == KVS_OK && why && why_size) why[0] = 0;
    return res;
}

#endif /* KVROUTE_IMPL_INCLUDED */
#endif /* KVROUTE_IMPLEMENTATION || KVCACHE_IMPLEMENTATION */
