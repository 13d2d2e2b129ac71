/* Eviction in kvblock.h: which inactive block goes first under the lineage and LRU policies, priority
 * levels, a user policy, and dropping the whole cache with kvb_pool_reset. The order is observed
 * through the REMOVED events a pool reports as it evicts. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

static kvb_pool *pool_with_events(uint32_t num_blocks, kvb_evict_policy policy, fx_events *rec)
{
    kvb_pool_config cfg = fx_config(num_blocks);
    cfg.eviction = policy;
    cfg.on_events = fx_record_events;
    cfg.event_user = rec;
    fx_events_clear(rec);
    return fx_pool_from(&cfg);
}

/* Hashes of the REMOVED events recorded so far, in order. */
static size_t removed_hashes(const fx_events *rec, kvb_hash *out, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; i < rec->n; i++)
        if (rec->ev[i].kind == KVB_EVENT_REMOVED && n < max) out[n++] = rec->ev[i].hash;
    return n;
}

static void serve(kvb_pool *pool, kvb_seq **out, const uint32_t *tokens, size_t n)
{
    KVT_EQ(kvb_seq_create(pool, NULL, out), KVB_OK);
    KVT_EQ(kvb_seq_append(*out, tokens, n, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(*out, n), KVB_OK);
}

/* The issue's two prompts (48 common tokens + 7 and + 5) finish; a 160-token prompt needs all ten
 * blocks of the pool: the three cached common blocks go, deepest first. */
static void issue_scenario(kvb_evict_policy policy)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(10, policy, &rec);
    uint32_t a[55], b[53], c[160];
    fx_iota(a, 48, 1000);
    fx_iota(a + 48, 7, 5000);
    fx_iota(b, 48, 1000);
    fx_iota(b + 48, 5, 6000);
    fx_iota(c, 160, 90000);
    kvb_hash common[3];
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(a, 48, 16, NULL, 0, 0, common, 3, &n), KVB_OK);

    kvb_seq *sa = NULL, *sb = NULL, *sc = NULL;
    serve(pool, &sa, a, 55);
    serve(pool, &sb, b, 53);
    kvb_seq_destroy(sa);
    kvb_seq_destroy(sb);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 3);
    KVT_EQ(st.free_blocks, 7);

    fx_events_clear(&rec);
    serve(pool, &sc, c, 160);
    kvb_hash removed[8];
    KVT_EQ(removed_hashes(&rec, removed, 8), 3);
    FX_HASH_EQ(removed[0], common[2]);
    FX_HASH_EQ(removed[1], common[1]);
    FX_HASH_EQ(removed[2], common[0]);
    KVT_EQ(fx_events_count(&rec, KVB_EVENT_STORED), 10);
    st = fx_stats(pool);
    KVT_EQ(st.evictions, 3);
    KVT_EQ(st.free_blocks, 0);
    KVT_EQ(fx_lookup(pool, common, 3), 0);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(sc);
    kvb_pool_destroy(pool);
}

static void test_issue_prompts_evicted_lineage(void) { issue_scenario(KVB_EVICT_LINEAGE); }
static void test_issue_prompts_evicted_lru(void) { issue_scenario(KVB_EVICT_LRU); }

/* Chains A -> B and X -> Y in a pool of four; they are released, then four allocations of one block
 * each evict them one by one. Returns the order as letters, e.g. "BAYX". */
enum release_mode { CHAINS_AS_ARRAYS, PARENTS_FIRST_ONE_BY_ONE };

static void eviction_order(kvb_evict_policy policy, enum release_mode mode, char order[5])
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(4, policy, &rec);
    const char *names = "ABXY";
    kvb_hash h[4] = {fx_hash(0xa, 1), fx_hash(0xb, 1), fx_hash(0x10, 1), fx_hash(0x11, 1)};
    kvb_hash parents[4] = {{0, 0}, h[0], {0, 0}, h[2]};
    kvb_block blk[4] = {{0}};
    KVT_EQ(kvb_alloc(pool, 4, blk), KVB_OK);
    fx_import(pool, blk, 4, h, parents);
    if (mode == CHAINS_AS_ARRAYS) {
        KVT_EQ(kvb_release(pool, blk, 2, NULL), KVB_OK);     /* [A, B]: B first */
        KVT_EQ(kvb_release(pool, blk + 2, 2, NULL), KVB_OK); /* [X, Y]: Y first */
    } else {
        for (int i = 0; i < 4; i++) KVT_EQ(kvb_release(pool, &blk[i], 1, NULL), KVB_OK);
    }
    FX_CHECK_POOL(pool);

    kvb_block fresh[4] = {{0}};
    memset(order, 0, 5);
    for (int step = 0; step < 4; step++) {
        fx_events_clear(&rec);
        KVT_EQ(kvb_alloc(pool, 1, &fresh[step]), KVB_OK);
        kvb_hash gone = {0, 0};
        KVT_EQ(removed_hashes(&rec, &gone, 1), 1);
        for (int i = 0; i < 4; i++)
            if (fx_hash_eq(gone, h[i])) order[step] = names[i];
        KVT_EQ(fx_lookup(pool, &gone, 1), 0);
        FX_CHECK_POOL(pool);
    }
    KVT_EQ(fx_stats(pool).evictions, 4);
    KVT_EQ(kvb_release(pool, fresh, 4, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

#define CHECK_ORDER(policy, mode, want)                                          \
    do {                                                                         \
        char got_[5];                                                            \
        eviction_order((policy), (mode), got_);                                  \
        if (strcmp(got_, (want)) != 0) fprintf(stderr, "  order %s\n", got_);    \
        KVT_EQ(strcmp(got_, (want)), 0);                                         \
    } while (0)

static void test_lineage_evicts_leaves_first(void)
{
    CHECK_ORDER(KVB_EVICT_LINEAGE, CHAINS_AS_ARRAYS, "BAYX");
    /* A was released before B, but while B is cached A is not a leaf */
    CHECK_ORDER(KVB_EVICT_LINEAGE, PARENTS_FIRST_ONE_BY_ONE, "BAYX");
    CHECK_ORDER(KVB_EVICT_DEFAULT, PARENTS_FIRST_ONE_BY_ONE, "BAYX");
}

/* A chain of 3,000 blocks released root first, one by one: its only leaf sits behind 2,999 of its own
 * parents in release order. Each eviction still takes the oldest leaf (the deepest block, then its
 * parent, which just became one), never a parent whose child is cached. */
static void deep_chain_scenario(kvb_evict_policy policy)
{
    enum { N = 3000 };
    fx_events rec;
    kvb_pool *pool = pool_with_events(N, policy, &rec);
    static kvb_hash h[N], parents[N];
    static kvb_block blk[N];
    for (uint32_t i = 0; i < N; i++) {
        h[i] = fx_hash(0x100000u + i, 7);
        parents[i] = i ? h[i - 1] : fx_hash(0, 0);
    }
    KVT_EQ(kvb_alloc(pool, N, blk), KVB_OK);
    for (uint32_t i = 0; i < N; i += 60) fx_import(pool, blk + i, 60, h + i, parents + i);
    for (uint32_t i = 0; i < N; i++) KVT_EQ(kvb_release(pool, &blk[i], 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_block fresh[3] = {{0}};
    for (uint32_t step = 0; step < 3; step++) {
        kvb_hash gone = {0, 0};
        fx_events_clear(&rec);
        KVT_EQ(kvb_alloc(pool, 1, &fresh[step]), KVB_OK);
        KVT_EQ(removed_hashes(&rec, &gone, 1), 1);
        KVT_CHECK(fx_hash_eq(gone, h[N - 1 - step]));
        KVT_EQ(fx_lookup(pool, h, N - 1 - step), N - 1 - step); /* the rest of the chain still matches */
        FX_CHECK_POOL(pool);
    }
    KVT_EQ(kvb_release(pool, fresh, 3, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

/* Roots P_1..P_k released first (their children still held), then the children C_1..C_k: the ring
 * holds P_1..P_k, C_1..C_k, and evictions alternate C_1, P_1, C_2, P_2, .. (each P_j is a leaf once
 * C_j is gone, and older than every C). The search keeps its place past the P's: the P_j that turn
 * into leaves are remembered, not found by passing the others again. */
static void roots_then_children_scenario(kvb_evict_policy policy)
{
    enum { K = 50 };
    fx_events rec;
    kvb_pool *pool = pool_with_events(2 * K, policy, &rec);
    kvb_hash h[2 * K], parents[2 * K];
    kvb_block blk[2 * K], fresh[2 * K];
    for (uint32_t j = 0; j < K; j++) {
        h[2 * j] = fx_hash(0x9e3779b97f4a7c15ull * (j + 1), 1);
        h[2 * j + 1] = fx_hash(0xc2b2ae3d27d4eb4full * (j + 1), 2);
        parents[2 * j] = fx_hash(0, 0);
        parents[2 * j + 1] = h[2 * j];
    }
    KVT_EQ(kvb_alloc(pool, 2 * K, blk), KVB_OK);
    for (uint32_t i = 0; i < 2 * K; i += 50) fx_import(pool, blk + i, 50, h + i, parents + i); /* pairs whole */
    for (uint32_t j = 0; j < K; j++) KVT_EQ(kvb_release(pool, &blk[2 * j], 1, NULL), KVB_OK);
    for (uint32_t j = 0; j < K; j++) KVT_EQ(kvb_release(pool, &blk[2 * j + 1], 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    for (uint32_t step = 0; step < 2 * K; step++) {
        kvb_hash gone = {0, 0};
        uint32_t j = step / 2, want = step % 2 ? 2 * j : 2 * j + 1;
        fx_events_clear(&rec);
        KVT_EQ(kvb_alloc(pool, 1, &fresh[step]), KVB_OK);
        KVT_EQ(removed_hashes(&rec, &gone, 1), 1);
        KVT_CHECK(fx_hash_eq(gone, h[want]));
        FX_CHECK_POOL(pool);
    }
    KVT_EQ(kvb_release(pool, fresh, 2 * K, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_new_leaves_behind_the_search(void)
{
    roots_then_children_scenario(KVB_EVICT_LINEAGE);
    roots_then_children_scenario(KVB_EVICT_ARC);
}

static void test_leaf_behind_thousands_of_parents(void)
{
    deep_chain_scenario(KVB_EVICT_LINEAGE);
    deep_chain_scenario(KVB_EVICT_ARC);
    deep_chain_scenario(KVB_EVICT_FOL);
}

/* A registration finds its parent's block through the block registered just before it in the same
 * call when that one holds the parent hash, and through the index otherwise: the block before is a
 * duplicate (not indexed), another chain's block, or the existing block a rejecting pool handed back.
 * Every count lands on the parent's indexed block: the pool's brute-force check agrees, and the parent
 * outlives all its children. */
static void parent_guess_scenario(kvb_dup_policy dups)
{
    enum { N = 12 };
    fx_events rec;
    kvb_pool_config cfg = fx_config(N);
    cfg.eviction = KVB_EVICT_LINEAGE;
    cfg.duplicates = dups;
    cfg.on_events = fx_record_events;
    cfg.event_user = &rec;
    fx_events_clear(&rec);
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash root = fx_hash(0, 0), a = fx_hash(0xa1, 1), b = fx_hash(0xb2, 2), c = fx_hash(0xc3, 3);
    kvb_hash d = fx_hash(0xd4, 4), x = fx_hash(0xe5, 5), e = fx_hash(0xf6, 6);
    kvb_hash h1[2] = { a, b }, p1[2] = { root, a };       /* B after its parent A */
    kvb_hash h2[2] = { a, c }, p2[2] = { root, a };       /* C after A again: a duplicate, or A handed back */
    kvb_hash h3[2] = { x, d }, p3[2] = { root, a };       /* D after another chain's root */
    kvb_hash chain[3] = { a, b, e };                      /* E after the matched A, B */
    kvb_block blk[6], out[6], held[3];
    size_t cached = 0;
    KVT_EQ(kvb_alloc(pool, 6, blk), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, blk, 2, h1, p1, out), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, blk + 2, 2, h2, p2, out + 2), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, blk + 4, 2, h3, p3, out + 4), KVB_OK);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, out, 6, NULL), KVB_OK);
    KVT_EQ(kvb_request_begin(pool, chain, 3, held, &cached), KVB_OK);
    KVT_EQ(cached, 2);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, held, 3, NULL), KVB_OK);
    kvb_block fresh[N];
    fx_events_clear(&rec);
    KVT_EQ(kvb_alloc(pool, N, fresh), KVB_OK); /* everything cached leaves, leaves first */
    kvb_hash gone[N];
    size_t n = removed_hashes(&rec, gone, N), at_a = n, at_b = n;
    for (size_t i = 0; i < n; i++) {
        if (fx_hash_eq(gone[i], a)) at_a = i;
        if (fx_hash_eq(gone[i], b)) at_b = i;
    }
    KVT_CHECK(at_a < n && at_b < at_a); /* B (and E behind it) before A */
    for (size_t i = at_a + 1; i < n; i++) /* nothing that named A as parent outlived it */
        KVT_CHECK(!fx_hash_eq(gone[i], b) && !fx_hash_eq(gone[i], c) && !fx_hash_eq(gone[i], d) &&
                  !fx_hash_eq(gone[i], e));
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, fresh, N, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_parent_found_past_a_wrong_guess(void)
{
    parent_guess_scenario(KVB_DUP_ALLOW);
    parent_guess_scenario(KVB_DUP_REJECT);
}

static void test_lru_follows_release_order(void)
{
    CHECK_ORDER(KVB_EVICT_LRU, CHAINS_AS_ARRAYS, "BAYX"); /* kvb_release goes deepest first */
    CHECK_ORDER(KVB_EVICT_LRU, PARENTS_FIRST_ONE_BY_ONE, "ABXY");
}

/* p is released first with priority 1, q later with priority 0: q goes first anyway. */
static void priority_scenario(kvb_evict_policy policy)
{
    kvb_pool_config cfg = fx_config(2);
    cfg.eviction = policy;
    cfg.priority_levels = 2;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash hp = fx_hash(0x77, 1), hq = fx_hash(0x78, 1);
    kvb_block p = {0}, q = {0}, fresh = {0};
    KVT_EQ(kvb_alloc(pool, 1, &p), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &q), KVB_OK);
    fx_import(pool, &p, 1, &hp, NULL);
    fx_import(pool, &q, 1, &hq, NULL);

    kvb_release_opts too_high = {.priority = 2}, keep = {.priority = 1}, normal = {.priority = 0};
    KVT_EQ(kvb_release(pool, &p, 1, &too_high), KVB_ERANGE);
    KVT_EQ(fx_info(pool, p.id).refs, 1);
    KVT_EQ(kvb_release(pool, &p, 1, &keep), KVB_OK);
    KVT_EQ(kvb_release(pool, &q, 1, &normal), KVB_OK);
    KVT_EQ(fx_info(pool, p.id).priority, 1);
    KVT_EQ(fx_info(pool, q.id).priority, 0);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_alloc(pool, 1, &fresh), KVB_OK);
    KVT_EQ(fx_lookup(pool, &hq, 1), 0);
    KVT_EQ(fx_lookup(pool, &hp, 1), 1);
    KVT_EQ(kvb_release(pool, &fresh, 1, NULL), KVB_OK); /* back to free: the next alloc takes it */
    kvb_block both[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, both), KVB_OK);
    KVT_EQ(fx_lookup(pool, &hp, 1), 0);
    KVT_EQ(fx_stats(pool).evictions, 2);
    KVT_EQ(kvb_release(pool, both, 2, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_priority_outlives_lower_level_lineage(void) { priority_scenario(KVB_EVICT_LINEAGE); }
static void test_priority_outlives_lower_level_lru(void) { priority_scenario(KVB_EVICT_LRU); }

/* ---- a user policy: most recently released first ------------------------------------------------- */

typedef struct mru {
    uint32_t index[64];
    size_t n;
    int inactive_calls, removed_calls, choose_calls;
} mru;

static void mru_drop(mru *m, uint32_t index)
{
    for (size_t i = 0; i < m->n; i++)
        if (m->index[i] == index) {
            memmove(&m->index[i], &m->index[i + 1], (m->n - i - 1) * sizeof m->index[0]);
            m->n--;
            return;
        }
}

static void mru_on_inactive(void *user, uint32_t index, uint32_t priority)
{
    mru *m = (mru *)user;
    (void)priority;
    m->inactive_calls++;
    if (m->n < 64) m->index[m->n++] = index;
}

static void mru_on_removed(void *user, uint32_t index)
{
    mru *m = (mru *)user;
    m->removed_calls++;
    mru_drop(m, index);
}

static uint32_t mru_choose(void *user)
{
    mru *m = (mru *)user;
    m->choose_calls++;
    if (m->n == 0) return UINT32_MAX;
    uint32_t victim = m->index[m->n - 1];
    mru_drop(m, victim); /* whether or not the pool also reports it removed */
    return victim;
}

static void test_custom_policy_is_obeyed(void)
{
    mru m;
    memset(&m, 0, sizeof m);
    kvb_pool_config cfg = fx_config(4);
    cfg.eviction = KVB_EVICT_CUSTOM;
    cfg.custom_eviction.on_inactive = mru_on_inactive;
    cfg.custom_eviction.on_removed = mru_on_removed;
    cfg.custom_eviction.choose_victim = mru_choose;
    cfg.custom_eviction.user = &m;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash h[4] = {fx_hash(1, 9), fx_hash(2, 9), fx_hash(3, 9), fx_hash(4, 9)};
    kvb_block blk[4] = {{0}};
    KVT_EQ(kvb_alloc(pool, 4, blk), KVB_OK);
    fx_import(pool, blk, 4, h, NULL);
    for (int i = 0; i < 4; i++) KVT_EQ(kvb_release(pool, &blk[i], 1, NULL), KVB_OK);
    KVT_EQ(m.inactive_calls, 4);
    KVT_EQ(m.n, 4);
    KVT_EQ(m.index[3], kvb_block_index(blk[3].id));

    kvb_block hit = {0};
    size_t n = 0;
    KVT_EQ(kvb_match(pool, &h[0], 1, &hit, &n), KVB_OK); /* no longer evictable: the policy is told */
    KVT_EQ(n, 1);
    KVT_EQ(m.removed_calls, 1);
    KVT_EQ(m.n, 3);

    kvb_block fresh[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 1, &fresh[0]), KVB_OK);
    KVT_EQ(fx_lookup(pool, &h[3], 1), 0); /* most recently released */
    KVT_EQ(fx_lookup(pool, &h[2], 1), 1);
    KVT_EQ(kvb_alloc(pool, 1, &fresh[1]), KVB_OK);
    KVT_EQ(fx_lookup(pool, &h[2], 1), 0);
    KVT_EQ(fx_lookup(pool, &h[1], 1), 1);
    KVT_CHECK(m.choose_calls >= 2);
    KVT_EQ(fx_stats(pool).evictions, 2);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_release(pool, fresh, 2, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &hit, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A policy that finds nothing worth evicting (UINT32_MAX: "none") makes the allocation fail cleanly. */
static void never_inactive(void *user, uint32_t index, uint32_t priority)
{
    (void)index;
    (void)priority;
    ++*(int *)user;
}
static void never_removed(void *user, uint32_t index)
{
    (void)user;
    (void)index;
}
static uint32_t never_choose(void *user)
{
    (void)user;
    return UINT32_MAX;
}

static void test_custom_policy_may_refuse(void)
{
    int inactive = 0;
    kvb_pool_config cfg = fx_config(2);
    cfg.eviction = KVB_EVICT_CUSTOM;
    cfg.custom_eviction.on_inactive = never_inactive;
    cfg.custom_eviction.on_removed = never_removed;
    cfg.custom_eviction.choose_victim = never_choose;
    cfg.custom_eviction.user = &inactive;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash h = fx_hash(0xabc, 1);
    kvb_block b = {0}, out[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    fx_import(pool, &b, 1, &h, NULL);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK); /* one inactive, one free */
    KVT_EQ(inactive, 1);
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_alloc(pool, 2, out), KVB_ENOSPACE);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_lookup(pool, &h, 1), 1);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_reset_refused_while_active(void)
{
    fx_events rec;
    kvb_pool_config cfg = fx_config(4);
    cfg.tier = 2;
    cfg.on_events = fx_record_events;
    cfg.event_user = &rec;
    fx_events_clear(&rec);
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_block active = {0}, cached = {0};
    kvb_hash h = fx_hash(0xcafe, 0);
    KVT_EQ(kvb_alloc(pool, 1, &active), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &cached), KVB_OK);
    fx_import(pool, &cached, 1, &h, NULL);
    KVT_EQ(kvb_release(pool, &cached, 1, NULL), KVB_OK);
    fx_events_clear(&rec);
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_pool_reset(pool), KVB_EBUSY);
    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_lookup(pool, &h, 1), 1);
    KVT_EQ(rec.n, 0);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_release(pool, &active, 1, NULL), KVB_OK);
    KVT_EQ(kvb_pool_reset(pool), KVB_OK);
    KVT_EQ(fx_events_count(&rec, KVB_EVENT_CLEARED), 1);
    for (size_t i = 0; i < rec.n; i++) {
        if (rec.ev[i].kind != KVB_EVENT_CLEARED) continue;
        KVT_EQ(rec.ev[i].tier, 2);
        KVT_EQ(rec.ev[i].num_tokens, 0);
        FX_HASH_EQ(rec.ev[i].hash, fx_hash(0, 0));
    }
    after = fx_stats(pool);
    KVT_EQ(after.free_blocks, 4);
    KVT_EQ(after.inactive_blocks, 0);
    KVT_EQ(after.cached_hashes, 0);
    KVT_EQ(fx_lookup(pool, &h, 1), 0);
    FX_CHECK_POOL(pool);

    /* reset blocks are as good as new ones */
    kvb_block fresh[4] = {{0}};
    KVT_EQ(kvb_alloc(pool, 4, fresh), KVB_OK);
    for (int i = 0; i < 4; i++) {
        kvb_block_info info = fx_info(pool, fresh[i].id);
        KVT_EQ(info.state, KVB_STATE_EMPTY);
        KVT_EQ(info.refs, 1);
        KVT_EQ(info.num_tokens, 0);
        KVT_EQ(info.priority, 0);
        FX_HASH_EQ(info.hash, fx_hash(0, 0));
        FX_HASH_EQ(info.parent, fx_hash(0, 0));
    }
    KVT_EQ(kvb_release(pool, fresh, 4, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A chain of n blocks (hashes 1..n, each the parent of the next) registered and released. */
static void cached_chain(kvb_pool *pool, kvb_hash *h, size_t n, uint64_t first)
{
    kvb_block b[8], r[8];
    kvb_hash parents[8];
    for (size_t i = 0; i < n; i++) {
        h[i] = fx_hash(first + i, 77);
        parents[i] = i ? h[i - 1] : fx_hash(0, 0);
    }
    KVT_EQ(kvb_alloc(pool, n, b), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, b, n, h, parents, r), KVB_OK);
    KVT_EQ(kvb_release(pool, r, n, NULL), KVB_OK);
}

/* kvb_invalidate drops what nobody holds, under every policy: a middle block of a chain (its
 * children stay, matchable once their parent is back), a block in use only once released, every
 * duplicate of a hash; it leaves no ghost, and refuses NULL hashes. */
static void test_invalidate(void)
{
    static const kvb_evict_policy pol[] = {KVB_EVICT_LINEAGE, KVB_EVICT_LRU, KVB_EVICT_FOL, KVB_EVICT_ARC,
                                           KVB_EVICT_S3FIFO};
    for (size_t p = 0; p < sizeof pol / sizeof pol[0]; p++) {
        fx_events rec;
        kvb_pool *pool = pool_with_events(8, pol[p], &rec);
        kvb_hash h[4], other = fx_hash(999, 1);
        kvb_block held[4], dup[1], dup_r[1];
        size_t n = 0, dropped = 9;
        cached_chain(pool, h, 4, 1);
        kvb_pool_stats before = fx_stats(pool);
        KVT_EQ(kvb_invalidate(pool, &h[1], 1, &dropped), KVB_OK);
        KVT_EQ(dropped, 1);
        kvb_pool_stats st = fx_stats(pool);
        KVT_EQ(st.free_blocks, before.free_blocks + 1);
        KVT_EQ(st.inactive_blocks, before.inactive_blocks - 1);
        KVT_EQ(st.cached_hashes, 3);
        KVT_EQ(st.invalidated, 1);
        KVT_EQ(st.evictions, before.evictions);
        KVT_EQ(st.ghost_blocks[0], before.ghost_blocks[0]); /* no ghost: FOL, ARC, S3-FIFO remember nothing */
        KVT_EQ(st.ghost_blocks[1], before.ghost_blocks[1]);
        KVT_EQ(fx_events_count(&rec, KVB_EVENT_REMOVED), 1);
        KVT_EQ(fx_lookup(pool, h, 4), 1); /* the prefix stops where the dropped block was */
        KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
        /* in use: it stays until released */
        KVT_EQ(kvb_match(pool, h, 1, held, &n), KVB_OK);
        KVT_EQ(n, 1);
        KVT_EQ(kvb_invalidate(pool, h, 1, &dropped), KVB_OK);
        KVT_EQ(dropped, 0);
        KVT_EQ(fx_lookup(pool, h, 1), 1);
        KVT_EQ(kvb_release(pool, held, 1, NULL), KVB_OK);
        KVT_EQ(kvb_invalidate(pool, h, 1, NULL), KVB_OK);
        KVT_EQ(fx_lookup(pool, h, 1), 0);
        kvb_block_info info;
        KVT_EQ(kvb_block_get_info(pool, held[0].id, &info), KVB_ESTALE); /* its handles are stale */
        /* a hash registered twice: both blocks go */
        KVT_EQ(kvb_alloc(pool, 1, dup), KVB_OK);
        KVT_EQ(kvb_register_hashed(pool, dup, 1, &h[2], &h[1], dup_r), KVB_OK);
        KVT_EQ(kvb_release(pool, dup_r, 1, NULL), KVB_OK);
        KVT_EQ(kvb_invalidate(pool, &h[2], 1, &dropped), KVB_OK);
        KVT_EQ(dropped, 2);
        KVT_EQ(kvb_invalidate(pool, &other, 1, &dropped), KVB_OK); /* not cached: nothing */
        KVT_EQ(dropped, 0);
        KVT_EQ(kvb_invalidate(pool, NULL, 1, NULL), KVB_EINVAL);
        KVT_EQ(kvb_invalidate(pool, NULL, 0, NULL), KVB_OK);
        KVT_EQ(kvb_invalidate(NULL, h, 1, NULL), KVB_EINVAL);
        KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
        st = fx_stats(pool);
        KVT_EQ(st.invalidated, 4);
        KVT_EQ(st.cached_hashes, 1); /* h[3] */
        /* the dropped hashes come back as new blocks: FOL remembers no count for them */
        cached_chain(pool, h, 3, 1);
        KVT_EQ(fx_lookup(pool, h, 4), 4);
        KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
        kvb_pool_destroy(pool);
    }
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_issue_prompts_evicted_lineage);
    KVT_RUN(test_issue_prompts_evicted_lru);
    KVT_RUN(test_lineage_evicts_leaves_first);
    KVT_RUN(test_lru_follows_release_order);
    KVT_RUN(test_leaf_behind_thousands_of_parents);
    KVT_RUN(test_new_leaves_behind_the_search);
    KVT_RUN(test_parent_found_past_a_wrong_guess);
    KVT_RUN(test_priority_outlives_lower_level_lineage);
    KVT_RUN(test_priority_outlives_lower_level_lru);
    KVT_RUN(test_custom_policy_is_obeyed);
    KVT_RUN(test_reset_refused_while_active);
    KVT_RUN(test_invalidate);
    KVT_RUN(test_custom_policy_may_refuse); /* last: a pool that follows an invalid victim may crash */
    return kvt_summary();
}
