/* One kvblock.h pool shared by eight threads that allocate, register, match, upgrade, serve whole
 * requests and release at random for about a second per duplicate policy. Afterwards no block is
 * lost and every invariant holds. Also built with ThreadSanitizer (`make tsan`), so the workers touch
 * no shared state but the pool: each has its own RNG and counters, checked after the join. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

#include <pthread.h>
#include <time.h>

enum {
    THREADS = 8,
    POOL_BLOCKS = 64,
    GROUPS = 6,         /* hash chains of 4: h[4g] is a root, h[4g+k] names h[4g+k-1] as parent */
    HASHES = 4 * GROUPS,
    MAX_HELD = 12,
    MAX_WEAK = 8,
    MAX_OPS = 200000,   /* per thread, in case the clock is slow to move */
};

typedef struct worker {
    kvb_pool *pool;
    const kvb_hash *hashes;
    const kvb_hash *parents;
    double deadline;
    uint64_t rng;
    kvb_block held[MAX_HELD];
    int empty[MAX_HELD]; /* held[i] is an Empty block this thread may register */
    size_t n_held;
    kvb_weak weak[MAX_WEAK];
    size_t n_weak;
    long ops, errors, nospace, hits;
    const char *first_error;
} worker;

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint32_t rnd(worker *w, uint32_t below)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return (uint32_t)(w->rng % below);
}

static void expect(worker *w, int ok, const char *what)
{
    if (ok) return;
    if (!w->errors) w->first_error = what;
    w->errors++;
}

static void hold(worker *w, kvb_block b, int empty)
{
    w->held[w->n_held] = b;
    w->empty[w->n_held] = empty;
    w->n_held++;
}

static void do_alloc(worker *w)
{
    kvb_block b[3];
    size_t n = 1 + rnd(w, 3);
    if (w->n_held + n > MAX_HELD) return;
    kvb_result r = kvb_alloc(w->pool, n, b);
    expect(w, r == KVB_OK || r == KVB_ENOSPACE, "alloc");
    if (r == KVB_ENOSPACE) w->nospace++;
    if (r == KVB_OK)
        for (size_t i = 0; i < n; i++) hold(w, b[i], 1);
}

/* Registers one Empty block: imported under a hash of the shared set, or computed through the
 * lifecycle from tokens of its own. */
static void do_register(worker *w)
{
    size_t i = 0;
    while (i < w->n_held && !w->empty[i]) i++;
    if (i == w->n_held) return;
    kvb_block out = {0};
    if (rnd(w, 4)) {
        uint32_t k = rnd(w, HASHES);
        kvb_result r = kvb_register_hashed(w->pool, &w->held[i], 1, &w->hashes[k], &w->parents[k], &out);
        expect(w, r == KVB_OK, "register_hashed");
    } else {
        uint32_t tokens[16];
        for (int t = 0; t < 16; t++) tokens[t] = rnd(w, 8);
        int ok = kvb_block_init(w->pool, w->held[i], NULL, 0, NULL, 0) == KVB_OK &&
                 kvb_block_add_tokens(w->pool, w->held[i], tokens, 16, 0) == KVB_OK &&
                 kvb_block_schedule(w->pool, w->held[i]) == KVB_OK &&
                 kvb_block_compute_done(w->pool, w->held[i]) == KVB_OK &&
                 kvb_register(w->pool, &w->held[i], 1, &out) == KVB_OK;
        expect(w, ok, "lifecycle");
    }
    if (!out.id) return;
    w->held[i] = out; /* under KVB_DUP_REJECT: the existing block */
    w->empty[i] = 0;
    if (w->n_weak < MAX_WEAK) w->weak[w->n_weak++] = kvb_weak_of(out);
    else w->weak[rnd(w, MAX_WEAK)] = kvb_weak_of(out);
}

static void do_match(worker *w)
{
    if (w->n_held + 4 > MAX_HELD) return;
    kvb_block out[4];
    size_t n = 0;
    kvb_result r = kvb_match(w->pool, &w->hashes[4 * rnd(w, GROUPS)], 4, out, &n);
    expect(w, r == KVB_OK && n <= 4, "match");
    w->hits += (long)n;
    for (size_t i = 0; i < n; i++) hold(w, out[i], 0);
}

static void do_upgrade(worker *w)
{
    if (!w->n_weak || w->n_held == MAX_HELD) return;
    kvb_block b = {0};
    kvb_result r = kvb_upgrade(w->pool, w->weak[rnd(w, (uint32_t)w->n_weak)], &b);
    expect(w, r == KVB_OK || r == KVB_EGONE, "upgrade");
    if (r == KVB_OK) hold(w, b, 0);
}

static void do_release(worker *w)
{
    if (!w->n_held) return;
    size_t i = rnd(w, (uint32_t)w->n_held);
    kvb_release_opts opts = {.priority = rnd(w, 2)};
    expect(w, kvb_release(w->pool, &w->held[i], 1, &opts) == KVB_OK, "release");
    w->n_held--;
    w->held[i] = w->held[w->n_held];
    w->empty[i] = w->empty[w->n_held];
}

/* A whole request on a prompt shared with other threads: append, commit, finish. */
static void do_request(worker *w)
{
    uint32_t tokens[40];
    uint32_t prompt = rnd(w, 3);
    for (uint32_t i = 0; i < 40; i++) tokens[i] = prompt * 1000 + i;
    kvb_seq *seq = NULL;
    expect(w, kvb_seq_create(w->pool, NULL, &seq) == KVB_OK, "seq_create");
    size_t cached = 0;
    kvb_result r = kvb_seq_append(seq, tokens, 40, &cached);
    expect(w, r == KVB_OK || r == KVB_ENOSPACE, "seq_append");
    if (r == KVB_OK) expect(w, kvb_seq_commit(seq, 40) == KVB_OK, "seq_commit");
    if (r == KVB_ENOSPACE) w->nospace++;
    kvb_seq_destroy(seq);
}

static void *work(void *arg)
{
    worker *w = (worker *)arg;
    while (w->ops < MAX_OPS && (w->ops % 64 || now_seconds() < w->deadline)) {
        uint32_t r = rnd(w, 100);
        if (r < 22) do_alloc(w);
        else if (r < 40) do_register(w);
        else if (r < 58) do_match(w);
        else if (r < 63) do_upgrade(w);
        else if (r < 67) do_request(w);
        else if (r < 68) expect(w, kvb_pool_check(w->pool, NULL, 0) == KVB_OK, "pool_check");
        else do_release(w);
        w->ops++;
    }
    while (w->n_held) do_release(w);
    return NULL;
}

static void stress(kvb_dup_policy duplicates, double seconds)
{
    kvb_pool_config cfg = fx_config(POOL_BLOCKS);
    cfg.duplicates = duplicates;
    cfg.priority_levels = 2;
    kvb_pool *pool = fx_pool_from(&cfg);
    if (!pool) return;
    kvb_hash hashes[HASHES], parents[HASHES];
    for (int i = 0; i < HASHES; i++) {
        hashes[i] = fx_hash((uint64_t)i + 1, 0x5eed);
        parents[i] = i % 4 ? hashes[i - 1] : fx_hash(0, 0);
    }

    static worker workers[THREADS];
    pthread_t threads[THREADS];
    double deadline = now_seconds() + seconds;
    for (int t = 0; t < THREADS; t++) {
        memset(&workers[t], 0, sizeof workers[t]);
        workers[t].pool = pool;
        workers[t].hashes = hashes;
        workers[t].parents = parents;
        workers[t].deadline = deadline;
        workers[t].rng = 0x9e3779b97f4a7c15u * (uint64_t)(t + 1) + (uint64_t)duplicates;
        KVT_EQ(pthread_create(&threads[t], NULL, work, &workers[t]), 0);
    }
    long ops = 0, errors = 0, hits = 0;
    for (int t = 0; t < THREADS; t++) {
        KVT_EQ(pthread_join(threads[t], NULL), 0);
        ops += workers[t].ops;
        errors += workers[t].errors;
        hits += workers[t].hits;
        if (workers[t].errors) fprintf(stderr, "  thread %d: first failed call: %s\n", t, workers[t].first_error);
    }
    KVT_EQ(errors, 0);
    KVT_CHECK(ops > THREADS * 100L);
    KVT_CHECK(hits > 0);

    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.free_blocks + st.active_blocks + st.inactive_blocks, POOL_BLOCKS); /* nothing lost */
    KVT_EQ(st.active_blocks, 0);
    KVT_CHECK(st.hit_blocks >= (uint64_t)hits);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_threads_duplicates_allowed(void) { stress(KVB_DUP_ALLOW, 1.0); }
static void test_threads_duplicates_rejected(void) { stress(KVB_DUP_REJECT, 1.0); }

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_threads_duplicates_allowed);
    KVT_RUN(test_threads_duplicates_rejected);
    return kvt_summary();
}
