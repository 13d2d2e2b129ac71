/* No allocation in the steady state (issue 15): once a pool has seen a workload, serving it again takes
 * nothing from the allocator. The compile-time allocator (KVB_MALLOC / KVB_REALLOC / KVB_FREE: stb_ds
 * arrays, ghost sets, mutable block state) and the runtime kvb_allocator (metadata, shadow pools) both
 * count their calls here.
 *   - a multi-turn chat trace (examples/workloads.h) replayed as serve_sim --sequential does, under every
 *     built-in policy, with an event sink: after two passes over the trace, a third allocates nothing;
 *   - blocks through their whole lifecycle (init, tokens, schedule, compute, register) and sequences
 *     (append, commit, release): after a warm-up round, more rounds allocate nothing;
 *   - an engine's scheduler steps (kvsched.h) with the connector and a host tier (eager offload through
 *     the memcpy backend, or lazy: each poll backs the next eviction candidates; onboarding of host
 *     hits; a device too small, whose requests are swapped out and back): requests arrive, prefill,
 *     decode, finish and are released, so every step sees all of that; after one cycle of that traffic
 *     (1,500 requests, from an idle engine with empty caches), the same cycle twice more allocates
 *     nothing.
 * Who allocates: ARM=<lru|lineage|fol|arc|s3fifo|life|sched> prints the stack of every call in that
 * check's measured part (ASan builds; elsewhere `break count_malloc if armed` in gdb).
 */
#include <stdlib.h>
static int armed;
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define WHO_ALLOCATES() (armed ? __sanitizer_print_stack_trace() : (void)0)
#else
#define WHO_ALLOCATES() ((void)0)
#endif
static size_t macro_calls; /* KVB_MALLOC and KVB_REALLOC (a free is not an allocation, but counted too) */
static void *count_malloc(size_t n) { macro_calls++; WHO_ALLOCATES(); return malloc(n); }
static void *count_realloc(void *p, size_t n) { macro_calls++; WHO_ALLOCATES(); return realloc(p, n); }
static void count_free_macro(void *p) { if (p) macro_calls++; free(p); }
#define KVB_MALLOC(sz) count_malloc(sz)
#define KVB_REALLOC(p, sz) count_realloc(p, sz)
#define KVB_FREE(p) count_free_macro(p)
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#define WORKLOADS_IMPLEMENTATION
#include "../examples/workloads.h"
#include "kvtest.h"

static size_t runtime_calls;
static void *count_alloc(size_t size, size_t align, void *user)
{
    void *p = NULL;
    (void)user;
    runtime_calls++;
    WHO_ALLOCATES();
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
    KVT_EQ(wl_generate(WL_CHAT, 512, 3000, 1.0, 5, 0, &w), 0);
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

/* ---- the scheduler's steady state ------------------------------------------------------------------ */

enum { SYSTEMS = 6, SYSTEM_TOKENS = 64, QUESTIONS = 150, RUNNING = 48, ARRIVALS = 1500, BT = 16 };

typedef struct engine {
    kvb_pool *device, *host;
    kvo_backend *copy;
    kvo_manager *tiers;
    kvs_sched *sched;
    uint64_t rng, live[RUNNING]; /* the requests not yet released */
    size_t live_n, to_add;       /* to_add: requests this cycle has still to add */
    uint32_t prompt[SYSTEM_TOKENS + 200];
    uint64_t steps, finished, decoded, admitted_with_hits;
} engine;

static uint32_t eng_rand(engine *e, uint32_t below)
{
    e->rng ^= e->rng << 13;
    e->rng ^= e->rng >> 7;
    e->rng ^= e->rng << 17;
    return (uint32_t)(e->rng % below);
}

static kvb_pool *eng_pool(uint32_t blocks, uint32_t tier)
{
    kvb_pool_config cfg = config(blocks, KVB_EVICT_LINEAGE);
    cfg.block_tokens = BT;
    cfg.tier = tier;
    cfg.storage = KVB_STORAGE_HOST;
    cfg.layout.kind = KVB_LAYOUT_BLOCK_CONTIGUOUS;
    cfg.layout.num_layers = 1;
    cfg.layout.num_parts = 2;
    cfg.layout.page_bytes = 64;
    cfg.on_events = NULL;
    kvb_pool *pool = NULL;
    KVT_EQ(kvb_pool_create(&cfg, &pool), KVB_OK);
    return pool;
}

/* A request: one of a few system prompts, then one of QUESTIONS questions (asked again now and then:
 * by then the device has evicted it, the host tier still holds it); it generates 4..60 tokens. */
static void eng_add(engine *e)
{
    uint32_t sys = eng_rand(e, SYSTEMS), q = eng_rand(e, QUESTIONS), own = 8 + (q * 37u) % 150u;
    kvs_request rq;
    uint64_t id;
    for (uint32_t i = 0; i < SYSTEM_TOKENS; i++) e->prompt[i] = sys * 1000u + i;
    for (uint32_t i = 0; i < own; i++) e->prompt[SYSTEM_TOKENS + i] = 100000u + q * 1000u + i;
    memset(&rq, 0, sizeof rq);
    rq.prompt = e->prompt;
    rq.num_prompt = SYSTEM_TOKENS + own;
    rq.max_new_tokens = 4 + eng_rand(e, 57);
    KVT_EQ(kvs_sched_add(e->sched, &rq, &id), KVS_OK);
    e->live[e->live_n++] = id;
    e->to_add--;
}

/* One engine step: plan, complete, sample a token for every item that ends its tokens; then release
 * the requests that finished and add as many new ones while the cycle has some left. */
static void eng_step(engine *e)
{
    kvs_step st;
    KVT_EQ(kvs_sched_step(e->sched, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(e->sched, &st), KVS_OK);
    e->steps++;
    for (size_t i = 0; i < st.num_prefill + st.num_decode; i++) {
        const kvs_sched_item *it = i < st.num_prefill ? &st.prefill[i] : &st.decode[i - st.num_prefill];
        uint32_t t = (uint32_t)(it->request * 7919u + it->num_tokens);
        if (it->num_computed + it->num_new < it->num_tokens) continue;
        KVT_EQ(kvs_sched_append(e->sched, it->request, &t, 1), KVS_OK);
        e->decoded++;
    }
    for (size_t i = 0; i < e->live_n;) {
        kvs_slot_info info;
        KVT_EQ(kvs_sched_get_slot(e->sched, e->live[i], &info), KVS_OK);
        if (info.state != KVS_SLOT_FINISHED) {
            i++;
            continue;
        }
        e->admitted_with_hits += info.num_lower_hit_tokens > 0;
        KVT_EQ(kvs_sched_release(e->sched, e->live[i]), KVS_OK);
        e->live[i] = e->live[--e->live_n];
        e->finished++;
        if (e->to_add) eng_add(e);
    }
}

/* One cycle of the workload, from an idle engine with empty caches: ARRIVALS requests drawn from the
 * same seed, RUNNING of them live at a time, until the last one is released; then the transfers still
 * on their way end and both caches are emptied. So the next cycle starts where this one did and repeats
 * it step for step: its queues, bursts and peaks are those this one reached. */
static void eng_cycle(engine *e)
{
    kvs_connector *conn = kvs_sched_connector(e->sched);
    e->rng = 0x2545f4914f6cdd1dull;
    e->to_add = ARRIVALS;
    while (e->live_n < RUNNING) eng_add(e);
    while (e->live_n) eng_step(e);
    for (int i = 0; i < 100 && (!kvs_sched_idle(e->sched) || kvs_connector_pending(conn)); i++) {
        KVT_EQ(kvo_manager_drain(e->tiers, 5000000), KVO_OK);
        eng_step(e); /* the scheduler hears of what finished */
    }
    KVT_CHECK(kvs_sched_idle(e->sched) && !kvs_connector_pending(conn));
    KVT_EQ(kvb_pool_reset(e->device), KVB_OK);
    KVT_EQ(kvb_pool_reset(e->host), KVB_OK);
}

typedef struct cycle_counts { uint64_t steps, finished, admitted_with_hits, decoded, preempted_swap; } cycle_counts;

static cycle_counts eng_counts(const engine *e)
{
    cycle_counts c;
    kvs_sched_stats st;
    KVT_EQ(kvs_sched_get_stats(e->sched, &st), KVS_OK);
    c.steps = e->steps;
    c.finished = e->finished;
    c.admitted_with_hits = e->admitted_with_hits;
    c.decoded = e->decoded;
    c.preempted_swap = st.preempted_swap;
    return c;
}

/* What one cycle did: the counts now less those before it. */
static cycle_counts eng_cycle_counted(engine *e)
{
    cycle_counts a = eng_counts(e), b;
    eng_cycle(e);
    b = eng_counts(e);
    b.steps -= a.steps;
    b.finished -= a.finished;
    b.admitted_with_hits -= a.admitted_with_hits;
    b.decoded -= a.decoded;
    b.preempted_swap -= a.preempted_swap;
    return b;
}

/* Warm-up is two cycles: the traffic reaches every queue length, burst and peak it will reach, and every
 * buffer, table and spare its size for them. The first starts from empty tiers, the second from what a
 * cycle leaves behind, as every later one does (with swap preemption the second reached one more request
 * at once, since requests hold their device prefixes while their loads run). Each later cycle repeats
 * the second step for step (checked: the same counts), so it reaches no state the warm-up did not, and
 * two of them must allocate nothing: what
 * would is growth the library lets drift (an array that never reuses its room, a spare that is of the
 * wrong size because it came back in another order). (A warm-up of so many steps of endless random
 * traffic made the check depend on where it ended: that traffic sets new records, such as more requests
 * onboarding at once than ever before, ever more rarely but never for the last time.) */
static void sched_steps(kvo_offload_mode mode, kvs_preempt_mode preempt, uint32_t device_blocks, const char *name)
{
    engine e;
    cycle_counts first, again;
    memset(&e, 0, sizeof e);
    e.device = eng_pool(device_blocks, 0); /* small: the device evicts, the host tier serves hits back */
    e.host = eng_pool(4096, 1);
    KVT_EQ(kvo_memcpy_backend_create(0, &e.copy), KVO_OK);
    kvo_manager_config mc;
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 2;
    mc.pools[0] = e.device;
    mc.pools[1] = e.host;
    mc.down[0] = e.copy;
    mc.up[1] = e.copy;
    mc.pipeline.mode = KVO_MODE_POLL;
    mc.pipeline.min_batch = 1;
    mc.offload = mode;
    KVT_EQ(kvo_manager_create(&mc, &e.tiers), KVO_OK);
    kvs_sched_config sc;
    memset(&sc, 0, sizeof sc);
    sc.device = e.device;
    sc.tiers = e.tiers;
    sc.offload = mode == KVO_OFFLOAD_LAZY ? KVS_OFFLOAD_LAZY : KVS_OFFLOAD_EAGER;
    sc.preempt = preempt;
    KVT_EQ(kvs_sched_create(&sc, &e.sched), KVS_OK);
    (void)eng_cycle_counted(&e); /* from empty tiers */
    first = eng_cycle_counted(&e); /* from the state a cycle leaves behind, as every later one starts */
    for (int k = 2; k <= 3; k++) {
        size_t before = calls();
        armed = getenv("ARM") && !strcmp(getenv("ARM"), "sched");
        again = eng_cycle_counted(&e);
        armed = 0;
        if (calls() != before) fprintf(stderr, "  scheduler (%s): %zu allocator calls in cycle %d\n", name, calls() - before, k + 1);
        KVT_EQ(calls() - before, 0);
        KVT_CHECK(memcmp(&again, &first, sizeof first) == 0); /* the same cycle again */
    }
    printf("  (%s, a cycle: %llu steps, %llu requests finished, %llu of them onboarded from the host tier, %llu tokens "
           "sampled, %llu swapped out)\n",
           name, (unsigned long long)again.steps, (unsigned long long)again.finished,
           (unsigned long long)again.admitted_with_hits, (unsigned long long)again.decoded,
           (unsigned long long)again.preempted_swap);
    KVT_EQ(again.finished, ARRIVALS);
    KVT_CHECK(again.steps > 1000);
    KVT_CHECK(again.admitted_with_hits > 10);   /* some were onboarded from the host tier */
    KVT_CHECK(again.decoded > 10000);
    if (preempt == KVS_PREEMPT_SWAP) KVT_CHECK(again.preempted_swap > 10); /* swaps among them */
    kvs_sched_destroy(e.sched);
    kvo_manager_destroy(e.tiers);
    kvo_backend_destroy(e.copy);
    KVT_EQ(kvb_pool_check(e.device, NULL, 0), KVB_OK);
    kvb_pool_destroy(e.device);
    kvb_pool_destroy(e.host);
}

static void test_sched_steps_eager(void) { sched_steps(KVO_OFFLOAD_EAGER, KVS_PREEMPT_RECOMPUTE, 600, "eager offload"); }
/* Lazy: each poll backs the device's next eviction candidates below (lazy_reserve) */
static void test_sched_steps_lazy(void) { sched_steps(KVO_OFFLOAD_LAZY, KVS_PREEMPT_RECOMPUTE, 600, "lazy offload"); }
/* A device too small for the running requests: some are preempted, swapped out to the host and back. */
static void test_sched_steps_swap(void) { sched_steps(KVO_OFFLOAD_EAGER, KVS_PREEMPT_SWAP, 300, "swap preemption"); }

/* Requests without max_new_tokens get a token buffer for their prompt and 256 more; these generate
 * 600 at once, so their buffers grow past the size they were given. Released, their structs must serve
 * the next such requests: OUTGROW of them live at a time, the same traffic again allocates nothing
 * (and the scheduler keeps no more released requests than it ever had live). */
enum { OUTGROW = 4, OUTGROW_PROMPT = 20, OUTGROW_MORE = 600 };

static void outgrow_cycle(kvs_sched *s, kvb_pool *device, uint32_t round)
{
    static uint32_t more[OUTGROW_MORE];
    uint32_t prompt[OUTGROW_PROMPT];
    uint64_t id[OUTGROW];
    int grown[OUTGROW] = {0}, finished = 0;
    kvs_request rq;
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = OUTGROW_PROMPT;
    rq.max_new_tokens = 0; /* no limit: the engine says when it ends */
    for (int k = 0; k < OUTGROW; k++) {
        for (uint32_t i = 0; i < OUTGROW_PROMPT; i++) prompt[i] = round * 100000u + (uint32_t)k * 1000u + i;
        KVT_EQ(kvs_sched_add(s, &rq, &id[k]), KVS_OK);
    }
    for (uint32_t i = 0; i < OUTGROW_MORE; i++) more[i] = 7u + i;
    for (int step = 0; step < 100 && finished < OUTGROW; step++) {
        kvs_step st;
        KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
        KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
        for (size_t i = 0; i < st.num_prefill + st.num_decode; i++) {
            const kvs_sched_item *it = i < st.num_prefill ? &st.prefill[i] : &st.decode[i - st.num_prefill];
            int k = 0;
            if (it->num_computed + it->num_new < it->num_tokens) continue;
            while (k < OUTGROW && id[k] != it->request) k++;
            if (k == OUTGROW) continue;
            if (!grown[k]) {
                KVT_EQ(kvs_sched_append(s, it->request, more, OUTGROW_MORE), KVS_OK);
                grown[k] = 1;
            } else {
                KVT_EQ(kvs_sched_finish(s, it->request), KVS_OK);
                finished++;
            }
        }
    }
    KVT_EQ(finished, OUTGROW);
    for (int k = 0; k < OUTGROW; k++) KVT_EQ(kvs_sched_release(s, id[k]), KVS_OK);
    for (int i = 0; i < 3; i++) { /* released requests whose blocks the last step still named */
        kvs_step st;
        KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
        KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
    }
    KVT_CHECK(kvs_sched_idle(s));
    KVT_EQ(kvb_pool_reset(device), KVB_OK); /* the next cycle starts where this one did */
}

static void test_sched_requests_outgrow_their_buffers(void)
{
    kvb_pool *device = eng_pool(512, 0);
    kvs_sched *s;
    kvs_sched_config sc;
    memset(&sc, 0, sizeof sc);
    sc.device = device;
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_OK);
    outgrow_cycle(s, device, 0);
    outgrow_cycle(s, device, 1);
    for (uint32_t round = 2; round < 6; round++) {
        size_t before = calls();
        armed = getenv("ARM") && !strcmp(getenv("ARM"), "outgrow");
        outgrow_cycle(s, device, round);
        armed = 0;
        if (calls() != before) fprintf(stderr, "  outgrowing requests: %zu allocator calls in round %u\n", calls() - before, round);
        KVT_EQ(calls() - before, 0);
    }
    kvs_sched_destroy(s);
    KVT_EQ(kvb_pool_check(device, NULL, 0), KVB_OK);
    kvb_pool_destroy(device);
}

int main(void)
{
    KVT_RUN(test_replay_lru);
    KVT_RUN(test_replay_lineage);
    KVT_RUN(test_replay_fol);
    KVT_RUN(test_replay_arc);
    KVT_RUN(test_replay_s3fifo);
    KVT_RUN(test_block_lifecycle);
    KVT_RUN(test_sched_steps_eager);
    KVT_RUN(test_sched_steps_lazy);
    KVT_RUN(test_sched_steps_swap);
    KVT_RUN(test_sched_requests_outgrow_their_buffers);
    return kvt_summary();
}
