/* Out of memory in the sequence calls of kvblock.h: every allocation a call makes is made to fail in
 * turn. KVB_MALLOC and KVB_REALLOC (stb_ds arrays, mutable block states, the pool's scratch, the
 * pending events, the spans of a block copy) fail at the Nth call made during the call under test, once
 * or from then on, for N = 0, 1, .. until the call makes no Nth. Each time the call must return
 * KVB_ENOMEM without crashing, the pool must pass kvb_pool_check, and the sequences, the blocks they
 * hold and the pool's counters must be exactly as before (block handles included, so nothing was
 * allocated and given back either); the same call with the memory there must then succeed and leave
 * everything as a run that never failed, and releasing everything must leave no block referenced.
 * (append_many stops at the first sequence that fails: the ones before it are appended, it and the ones
 * after it are as before.) Scenarios: an append that fills the partial last block and several new ones;
 * one that matches more cached blocks than the stack scratch holds and then evicts for the rest; one
 * into a partial block shared with a fork (copy-on-write through more page spans than the stack holds);
 * append_many over three sequences; fork; request_begin, without and with events; commit and
 * commit_many with events; truncate into a shared block, and one that releases registered blocks;
 * block_init; register_hashed of children whose parent is not cached (the orphan counts). Last, events that find no memory for their batch (calls that reserve none) arrive in
 * parts, none lost, and releases that find no memory for the eviction rings cache less, under every
 * policy. */
#include "oom_hooks.h"
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

enum { BT = 4, MAX_SEQS = 4, MAX_TOKENS = 512, MAX_BLOCKS = 128, MAX_N = 4000 };

/* What a scenario works on: a pool, its sequences (a fork adds one), blocks the caller holds. */
typedef struct world {
    kvb_pool *pool;
    kvb_seq *seq[MAX_SEQS];
    size_t n_seq;
    kvb_block held[MAX_BLOCKS];
    size_t n_held;
    size_t out;  /* the call's count: cached tokens, cached blocks */
    size_t done; /* append_many: sequences appended so far */
    fx_events events;
} world;

typedef struct scenario {
    const char *name;
    void (*setup)(world *w);
    kvb_result (*act)(world *w); /* the call under test (after a failure, the same call again) */
} scenario;

/* ---- snapshots: everything a caller can see of the world ---- */

typedef struct seq_snap {
    kvb_seq_info info;
    uint32_t tokens[MAX_TOKENS];
    kvb_hash hashes[MAX_BLOCKS];
    kvb_block table[MAX_BLOCKS];
    kvb_block_info blocks[MAX_BLOCKS];
} seq_snap;

typedef struct snap {
    kvb_pool_stats stats;
    size_t n_seq, n_held, out, n_events;
    seq_snap seq[MAX_SEQS];
    kvb_block held[MAX_BLOCKS];
    kvb_block_info held_info[MAX_BLOCKS];
    kvb_event events[64];
} snap;

static void take_snap(world *w, snap *s)
{
    memset(s, 0, sizeof *s);
    s->stats = fx_stats(w->pool);
    s->n_seq = w->n_seq;
    s->n_held = w->n_held;
    s->out = w->out;
    s->n_events = w->events.n;
    for (size_t i = 0; i < w->events.n && i < 64; i++) s->events[i] = w->events.ev[i];
    for (size_t i = 0; i < w->n_seq; i++) {
        seq_snap *q = &s->seq[i];
        const uint32_t *tokens = NULL;
        const kvb_hash *hashes = NULL;
        size_t n = 0;
        q->info = fx_seq_info(w->seq[i]);
        KVT_CHECK(q->info.num_tokens <= MAX_TOKENS && q->info.num_blocks <= MAX_BLOCKS);
        KVT_EQ(kvb_seq_tokens(w->seq[i], &tokens, &n), KVB_OK);
        if (n) memcpy(q->tokens, tokens, n * sizeof *tokens);
        KVT_EQ(kvb_seq_hashes(w->seq[i], &hashes, &n), KVB_OK);
        if (n) memcpy(q->hashes, hashes, n * sizeof *hashes);
        n = fx_seq_table(w->seq[i], q->table, MAX_BLOCKS);
        for (size_t b = 0; b < n; b++) q->blocks[b] = fx_info(w->pool, q->table[b].id);
    }
    for (size_t i = 0; i < w->n_held; i++) {
        s->held[i] = w->held[i];
        s->held_info[i] = fx_info(w->pool, w->held[i].id);
    }
}

static int seq_same(const seq_snap *a, const seq_snap *b)
{
    const kvb_seq_info *x = &a->info, *y = &b->info;
    if (x->num_tokens != y->num_tokens || x->num_computed != y->num_computed || x->num_cached != y->num_cached ||
        x->num_blocks != y->num_blocks || x->num_full != y->num_full)
        return 0;
    if (memcmp(a->tokens, b->tokens, x->num_tokens * sizeof a->tokens[0])) return 0;
    for (size_t i = 0; i < x->num_full; i++)
        if (!fx_hash_eq(a->hashes[i], b->hashes[i])) return 0;
    for (size_t i = 0; i < x->num_blocks; i++)
        if (a->table[i].id != b->table[i].id || !fx_info_equal(&a->blocks[i], &b->blocks[i])) return 0;
    return 1;
}

static int events_same(const snap *a, const snap *b)
{
    if (a->n_events != b->n_events) return 0;
    for (size_t i = 0; i < a->n_events && i < 64; i++) {
        const kvb_event *x = &a->events[i], *y = &b->events[i];
        if (x->kind != y->kind || x->num_tokens != y->num_tokens || !fx_hash_eq(x->hash, y->hash) ||
            !fx_hash_eq(x->parent, y->parent))
            return 0;
    }
    return 1;
}

/* Which part of two snapshots differs ("" when none); sequences from `from` on only. */
static const char *snap_diff(const snap *a, const snap *b, size_t from, int with_stats)
{
    if (with_stats && !fx_stats_equal(&a->stats, &b->stats)) return "pool stats";
    if (a->n_seq != b->n_seq) return "number of sequences";
    for (size_t i = from; i < a->n_seq; i++)
        if (!seq_same(&a->seq[i], &b->seq[i])) return "a sequence or its blocks";
    if (a->n_held != b->n_held || a->out != b->out) return "the call's output";
    for (size_t i = 0; i < a->n_held; i++)
        if (a->held[i].id != b->held[i].id || !fx_info_equal(&a->held_info[i], &b->held_info[i]))
            return "blocks the caller holds";
    if (!events_same(a, b)) return "events";
    return "";
}

static void world_free(world *w)
{
    for (size_t i = 0; i < w->n_seq; i++) kvb_seq_destroy(w->seq[i]);
    if (w->n_held) KVT_EQ(kvb_release(w->pool, w->held, w->n_held, NULL), KVB_OK);
    KVT_EQ(fx_stats(w->pool).active_blocks, 0);
    FX_CHECK_POOL(w->pool);
    kvb_pool_destroy(w->pool);
}

static snap before, after, want;

/* The sweep: for each N, a fresh world, the Nth allocation of the call fails (once, or from then on). */
static void sweep(const scenario *sc, int sticky)
{
    world w;
    long n;
    int failed = kvt__cur_failed;
    memset(&w, 0, sizeof w);
    sc->setup(&w);
    KVT_EQ(sc->act(&w), KVB_OK); /* the run that never fails */
    take_snap(&w, &want);
    world_free(&w);
    for (n = 0; n < MAX_N; n++) {
        kvb_result r;
        char why[256] = "";
        const char *diff;
        memset(&w, 0, sizeof w);
        sc->setup(&w);
        take_snap(&w, &before);
        oom_arm(n, sticky);
        r = sc->act(&w);
        oom_disarm();
        if (!oom_fired) { /* the call made fewer than n + 1 allocations: it ran as the reference did */
            KVT_EQ(r, KVB_OK);
            take_snap(&w, &after);
            KVT_CHECK(!*(diff = snap_diff(&after, &want, 0, 1)));
            world_free(&w);
            break;
        }
        if (r != KVB_ENOMEM) fprintf(stderr, "  %s, allocation %ld failed: result %d\n", sc->name, n, r);
        KVT_EQ(r, KVB_ENOMEM);
        if (kvb_pool_check(w.pool, why, sizeof why) != KVB_OK) {
            fprintf(stderr, "  %s, allocation %ld failed: pool check: %s\n", sc->name, n, why);
            KVT_CHECK(0);
        }
        take_snap(&w, &after);
        if (w.done) { /* append_many: the sequences before the failing one went through */
            for (size_t i = 0; i < w.done; i++) KVT_CHECK(seq_same(&after.seq[i], &want.seq[i]));
            diff = snap_diff(&after, &before, w.done, 0);
        } else {
            diff = snap_diff(&after, &before, 0, 1);
        }
        if (*diff) fprintf(stderr, "  %s, allocation %ld failed: %s changed\n", sc->name, n, diff);
        KVT_CHECK(!*diff);
        r = sc->act(&w);
        KVT_EQ(r, KVB_OK);
        take_snap(&w, &after);
        diff = snap_diff(&after, &want, 0, 1);
        if (*diff)
            fprintf(stderr, "  %s, allocation %ld failed, then the call again: %s differs\n", sc->name, n, diff);
        KVT_CHECK(!*diff);
        world_free(&w);
        if (kvt__cur_failed > failed) break; /* one report per scenario is enough */
    }
    KVT_CHECK(n > 0 && n < MAX_N); /* it did allocate, and stopped */
    printf("     %-44s %s: %ld allocations failed in turn\n", sc->name, sticky ? "from N on" : "only N   ", n);
}

/* ---- setups ---- */

static kvb_pool *pool_of(uint32_t blocks, int events, world *w)
{
    kvb_pool_config cfg = fx_config(blocks);
    cfg.block_tokens = BT;
    if (events) {
        cfg.on_events = fx_record_events;
        cfg.event_user = &w->events;
    }
    return fx_pool_from(&cfg);
}

/* A pool with storage whose copies need more page spans than kvblock keeps on the stack. */
static kvb_pool *paged_pool(uint32_t blocks)
{
    kvb_pool_config cfg = fx_config(blocks);
    cfg.block_tokens = BT;
    cfg.storage = KVB_STORAGE_HOST;
    cfg.layout.kind = KVB_LAYOUT_LAYER_SEPARATE;
    cfg.layout.num_layers = 40; /* 80 spans */
    cfg.layout.page_bytes = 64;
    return fx_pool_from(&cfg);
}

static kvb_seq *seq_with(world *w, uint32_t first, size_t n, size_t commit)
{
    uint32_t tokens[MAX_TOKENS];
    kvb_seq *s = fx_seq(w->pool, NULL);
    fx_iota(tokens, n, first);
    if (n) KVT_EQ(kvb_seq_append(s, tokens, n, NULL), KVB_OK);
    if (commit) KVT_EQ(kvb_seq_commit(s, commit), KVB_OK);
    w->seq[w->n_seq++] = s;
    return s;
}

/* A chain of n registered blocks that nobody holds (tokens first, first + 1, ..). */
static void cache_chain(world *w, uint32_t first, size_t blocks)
{
    kvb_seq *s = seq_with(w, first, blocks * BT, blocks * BT);
    kvb_seq_destroy(s);
    w->n_seq--;
}

static kvb_result append_tokens(world *w, size_t i, uint32_t first, size_t n)
{
    uint32_t tokens[MAX_TOKENS];
    fx_iota(tokens, n, first);
    return kvb_seq_append(w->seq[i], tokens, n, &w->out);
}

/* 6 tokens (block 0 registered, block 1 partial), then 19: the partial block fills and 5 new ones. */
static void setup_partial(world *w)
{
    w->pool = pool_of(32, 0, w);
    seq_with(w, 100, 6, 4);
}
static kvb_result act_partial(world *w) { return append_tokens(w, 0, 106, 19); }

/* 72 cached blocks and an unrelated chain of 8 fill the pool; the append matches the 72 (more than the
 * stack scratch) and needs 2 new blocks, evicting the chain's last two. */
static void setup_matched(world *w)
{
    w->pool = pool_of(80, 1, w);
    cache_chain(w, 1, 72);
    cache_chain(w, 5000, 8);
    seq_with(w, 0, 0, 0);
    fx_events_clear(&w->events);
}
static kvb_result act_matched(world *w) { return append_tokens(w, 0, 1, 72 * BT + 6); }

/* 6 tokens shared with a fork; the fork appends 7: its copy of the partial block, then 2 new blocks. */
static void setup_shared(world *w)
{
    seq_with(w, 100, 6, 4);
    KVT_EQ(kvb_seq_fork(w->seq[0], &w->seq[1]), KVB_OK);
    w->n_seq = 2;
}
static void setup_shared_paged(world *w)
{
    w->pool = paged_pool(16);
    setup_shared(w);
}
static kvb_result act_shared(world *w) { return append_tokens(w, 1, 900, 7); }

/* Three sequences: one ending inside a block, one on a block boundary, one empty. */
static void setup_many(world *w)
{
    w->pool = pool_of(32, 0, w);
    seq_with(w, 100, 6, 4);
    seq_with(w, 200, 8, 8);
    seq_with(w, 300, 0, 0);
}
static kvb_result act_many(world *w)
{
    static uint32_t t0[7], t1[9], t2[5];
    const uint32_t *tokens[3] = {t0, t1, t2};
    const size_t counts[3] = {7, 9, 5};
    size_t done = 0;
    kvb_result r;
    fx_iota(t0, 7, 106);
    fx_iota(t1, 9, 208);
    fx_iota(t2, 5, 300);
    r = kvb_seq_append_many(w->seq + w->done, tokens + w->done, counts + w->done, 3 - w->done, &done);
    w->done += done;
    return r;
}

/* A sequence of 10 tokens, 8 committed, and its fork. */
static void setup_fork(world *w)
{
    w->pool = pool_of(16, 0, w);
    seq_with(w, 100, 10, 8);
}
static kvb_result act_fork(world *w)
{
    kvb_seq *c = NULL;
    kvb_result r = kvb_seq_fork(w->seq[0], &c);
    if (r == KVB_OK) w->seq[w->n_seq++] = c;
    else KVT_CHECK(c == NULL);
    return r;
}

/* 20 cached blocks, then 30 of another chain, 30 free: a request of 70 hashes (more than the stack
 * scratch) matches the 20 and registers 50, evicting 20 of the other chain. */
static kvb_hash req_hashes[70];
static void setup_request_in(world *w, int events)
{
    kvb_block b[30];
    size_t cached = 0;
    w->pool = pool_of(80, events, w);
    for (size_t i = 0; i < 70; i++) req_hashes[i] = fx_hash(i + 1, 77);
    KVT_EQ(kvb_request_begin(w->pool, req_hashes, 20, b, &cached), KVB_OK);
    KVT_EQ(kvb_release(w->pool, b, 20, NULL), KVB_OK);
    cache_chain(w, 5000, 30);
    fx_events_clear(&w->events);
}
static void setup_request(world *w) { setup_request_in(w, 0); }
static void setup_request_events(world *w) { setup_request_in(w, 1); }
static kvb_result act_request(world *w)
{
    kvb_result r = kvb_request_begin(w->pool, req_hashes, 70, w->held, &w->out);
    if (r == KVB_OK) w->n_held = 70;
    return r;
}

/* 5 full blocks and 2 tokens appended, nothing committed; the commit registers the 5 (events: the
 * pool's first, so its event array grows). commit_many: the same over two sequences. */
static void setup_commit(world *w)
{
    w->pool = pool_of(32, 1, w);
    seq_with(w, 100, 22, 0);
    seq_with(w, 200, 12, 0);
}
static kvb_result act_commit(world *w) { return kvb_seq_commit(w->seq[0], 22); }
static kvb_result act_commit_many(world *w)
{
    size_t counts[2] = {22, 12};
    return kvb_seq_commit_many(w->seq, counts, 2);
}

/* A fork truncated inside a block it shares: the kept partial block is copied (80 page spans), the
 * shared tail released. */
static kvb_result act_truncate_shared(world *w) { return kvb_seq_truncate(w->seq[1], 2); }

/* 12 registered blocks held by one sequence; a truncate to 5 tokens copies the kept registered block
 * and releases the other 10 into the eviction rings. */
static void setup_truncate_registered(world *w)
{
    w->pool = pool_of(32, 1, w);
    seq_with(w, 100, 12 * BT, 12 * BT);
    fx_events_clear(&w->events);
}
static kvb_result act_truncate_registered(world *w) { return kvb_seq_truncate(w->seq[0], 5); }

/* Three blocks registered as a chain whose parent is not cached (onboarded children, say): the first
 * is counted among the orphans, in a table the call must grow. Before, its growth failing lost the
 * count and the call still succeeded: the parent, once cached, could go before its child, and its
 * count wrapped to 4,294,967,295 when the child went. */
static void setup_orphans(world *w)
{
    w->pool = pool_of(8, 0, w);
    KVT_EQ(kvb_alloc(w->pool, 3, w->held), KVB_OK);
    w->n_held = 3;
}
static kvb_result act_orphans(world *w)
{
    kvb_hash h[3], parents[3];
    parents[0] = fx_hash(999, 999); /* not cached */
    for (size_t i = 0; i < 3; i++) {
        h[i] = fx_hash(1000 + i, 7);
        if (i) parents[i] = h[i - 1];
    }
    return kvb_register_hashed(w->pool, w->held, 3, h, parents, w->held);
}

/* A block of a fresh pool (no mutable state made yet) initialised. */
static void setup_block_init(world *w)
{
    w->pool = pool_of(8, 0, w);
    KVT_EQ(kvb_alloc(w->pool, 1, w->held), KVB_OK);
    w->n_held = 1;
}
static kvb_result act_block_init(world *w)
{
    uint64_t extra[2] = {7, 8};
    return kvb_block_init(w->pool, w->held[0], NULL, 3, extra, 2);
}

static const scenario scenarios[] = {
    {"append: partial block, then new blocks", setup_partial, act_partial},
    {"append: 72 cached blocks matched, then evicts", setup_matched, act_matched},
    {"append: into a forked partial block (copy)", setup_shared_paged, act_shared},
    {"append_many: three sequences", setup_many, act_many},
    {"fork", setup_fork, act_fork},
    {"request_begin: 20 matched, 50 new", setup_request, act_request},
    {"request_begin: the same, with events", setup_request_events, act_request},
    {"commit: 5 blocks registered, events", setup_commit, act_commit},
    {"commit_many: 8 blocks registered, events", setup_commit, act_commit_many},
    {"truncate: a fork into its shared block", setup_shared_paged, act_truncate_shared},
    {"truncate: registered blocks released", setup_truncate_registered, act_truncate_registered},
    {"block_init: the pool's first mutable state", setup_block_init, act_block_init},
    {"register_hashed: children of a parent not cached", setup_orphans, act_orphans},
};

static const char *only; /* argv[1]: run the scenarios whose name contains it */

static void run_all(int sticky)
{
    for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
        int failed = kvt__cur_failed;
        if (only && !strstr(scenarios[i].name, only)) continue;
        sweep(&scenarios[i], sticky);
        if (kvt__cur_failed > failed) fprintf(stderr, "  ^ %s\n", scenarios[i].name);
    }
}

static void test_each_allocation_failing_once_changes_nothing(void) { run_all(0); }
static void test_allocations_failing_from_n_on_change_nothing(void) { run_all(1); }

/* Calls that do not reserve room for their events (kvb_register_hashed here) still deliver every event,
 * in order, when the pending batch cannot grow: the batch so far goes early, then each event alone. */
static void test_events_without_memory_come_in_parts(void)
{
    enum { N = 10 };
    kvb_hash h[N];
    for (size_t i = 0; i < N; i++) h[i] = fx_hash(i + 1, 99);
    for (int warm = 0; warm < 2; warm++) { /* an empty batch array, then one with room for 4 */
        world w;
        kvb_block b[N], out[N];
        memset(&w, 0, sizeof w);
        w.pool = pool_of(16, 1, &w);
        if (warm) {
            KVT_EQ(kvb_alloc(w.pool, 2, b), KVB_OK);
            KVT_EQ(kvb_register_hashed(w.pool, b, 2, h + N - 2, NULL, out), KVB_OK); /* room for 4 */
            KVT_EQ(kvb_release(w.pool, out, 2, NULL), KVB_OK);
            fx_events_clear(&w.events);
        }
        KVT_EQ(kvb_alloc(w.pool, N - 2, b), KVB_OK);
        oom_arm(0, 1);
        KVT_EQ(kvb_register_hashed(w.pool, b, N - 2, h, NULL, out), KVB_OK);
        oom_disarm();
        KVT_CHECK(oom_fired);
        KVT_EQ(w.events.n, N - 2);
        for (size_t i = 0; i < w.events.n; i++) {
            KVT_EQ(w.events.ev[i].kind, KVB_EVENT_STORED);
            FX_HASH_EQ(w.events.ev[i].hash, h[i]);
        }
        KVT_EQ(w.events.calls, warm ? 2 : N - 2); /* 4 + 4, or each alone */
        FX_CHECK_POOL(w.pool);
        KVT_EQ(kvb_release(w.pool, out, N - 2, NULL), KVB_OK);
        world_free(&w);
    }
}

/* Releases cannot fail: a block whose last reference goes and whose eviction ring cannot grow takes the
 * place of the ring's stale entries, or, when it has none, leaves the cache (as kvb_invalidate drops
 * one) instead of crashing in stb_ds. */
static void test_releases_without_ring_memory_cache_less(void)
{
    world w;
    kvb_hash h[4];
    kvb_block b[4];
    size_t cached = 0;
    kvb_pool_stats st;

    memset(&w, 0, sizeof w); /* a sequence of 6 registered blocks, the pool's rings not made yet */
    w.pool = pool_of(16, 1, &w);
    kvb_seq *s = seq_with(&w, 100, 6 * BT, 6 * BT);
    fx_events_clear(&w.events);
    oom_arm(0, 1);
    kvb_seq_destroy(s);
    oom_disarm();
    w.n_seq = 0;
    KVT_CHECK(oom_fired);
    st = fx_stats(w.pool);
    KVT_EQ(st.active_blocks, 0);
    KVT_EQ(st.inactive_blocks, 0);
    KVT_EQ(st.cached_hashes, 0);
    KVT_EQ(st.free_blocks, 16);
    KVT_EQ(fx_events_count(&w.events, KVB_EVENT_REMOVED), 6);
    world_free(&w);

    memset(&w, 0, sizeof w); /* a ring full of stale entries: room enough */
    w.pool = pool_of(16, 0, &w);
    for (size_t i = 0; i < 4; i++) h[i] = fx_hash(i + 1, 5);
    KVT_EQ(kvb_request_begin(w.pool, h, 4, b, &cached), KVB_OK);
    KVT_EQ(kvb_release(w.pool, b, 4, NULL), KVB_OK); /* 4 entries, room for 4 */
    KVT_EQ(kvb_match(w.pool, h, 4, b, &cached), KVB_OK);
    KVT_EQ(cached, 4); /* the 4 entries are stale */
    oom_arm(0, 1);
    KVT_EQ(kvb_release(w.pool, b, 4, NULL), KVB_OK);
    oom_disarm();
    KVT_CHECK(oom_fired);
    st = fx_stats(w.pool);
    KVT_EQ(st.inactive_blocks, 4);
    KVT_EQ(st.cached_hashes, 4);
    KVT_EQ(fx_lookup(w.pool, h, 4), 4);
    world_free(&w);
}

/* Every policy: requests that share prefixes, a few with memory, then 600 more with every allocation
 * failing, as the cached set grows past what the eviction rings had room for and fills the pool.
 * Their releases and evictions (S3-FIFO requeues and promotes blocks while it chooses) must never
 * crash, every request must still be served (request_begin needs no memory here) and the pool must
 * stay consistent, but for one thing: a release that finds no room in its ring, no stale entry and no
 * leaf to evict there drops its block, and when that block has cached children and the orphan table
 * cannot grow either, their count is lost (kvb__orphans_add: a leaf-first preference, never a wrong
 * answer to a lookup), which kvb_pool_check reports. (FOL and S3-FIFO reach that here.) */
static void test_policies_keep_serving_without_memory(void)
{
    static const kvb_evict_policy policies[] = {KVB_EVICT_LINEAGE, KVB_EVICT_LRU, KVB_EVICT_FOL, KVB_EVICT_ARC,
                                                KVB_EVICT_S3FIFO};
    for (size_t pi = 0; pi < sizeof policies / sizeof policies[0]; pi++) {
        kvb_pool_config cfg = fx_config(160);
        kvb_pool *pool;
        uint64_t rng = 12345;
        int bad = 0, lost = 0;
        cfg.eviction = policies[pi];
        pool = fx_pool_from(&cfg);
        for (int round = 0; round < 620 && !bad; round++) {
            kvb_hash h[24];
            kvb_block b[24];
            size_t n, cached = 0, prompt;
            char why[256] = "";
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            prompt = (size_t)(rng >> 40) % 48; /* 48 prompts: a shared head, then their own tails */
            n = 4 + (size_t)(rng >> 33) % 20;
            for (size_t i = 0; i < n; i++) h[i] = fx_hash(i < 3 ? i + 1 : prompt * 100 + i, 42);
            if (round == 20) oom_arm(0, 1);
            if (kvb_request_begin(pool, h, n, b, &cached) != KVB_OK) bad = 1;
            else if (kvb_release(pool, b, n, NULL) != KVB_OK) bad = 2;
            oom_disarm(); /* the pool check allocates */
            if (kvb_pool_check(pool, why, sizeof why) == KVB_OK) {
            } else if (strstr(why, "orphan count") || strstr(why, "child count")) {
                lost++;
            } else {
                fprintf(stderr, "  policy %d, round %d: %s\n", (int)policies[pi], round, why);
                bad = 3;
            }
            if (round >= 20) oom_arm(0, 1);
        }
        oom_disarm();
        KVT_EQ(bad, 0);
        KVT_EQ(fx_stats(pool).active_blocks, 0);
        printf("     policy %d: %llu evictions, %d rounds with a child count lost\n", (int)policies[pi],
               (unsigned long long)fx_stats(pool).evictions, lost);
        kvb_pool_destroy(pool);
    }
}

int main(int argc, char **argv)
{
    only = argc > 1 ? argv[1] : NULL;
    fx_watchdog(120);
    KVT_RUN(test_each_allocation_failing_once_changes_nothing);
    KVT_RUN(test_allocations_failing_from_n_on_change_nothing);
    KVT_RUN(test_events_without_memory_come_in_parts);
    KVT_RUN(test_releases_without_ring_memory_cache_less);
    KVT_RUN(test_policies_keep_serving_without_memory);
    return kvt_summary();
}
