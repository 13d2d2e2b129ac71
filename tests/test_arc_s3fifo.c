/* ARC and S3-FIFO (KVB_EVICT_ARC, KVB_EVICT_S3FIFO, issue 14): each policy's own rules, observed through
 * the pool's statistics (list sizes, ghosts, ARC's target) and eviction order (REMOVED events), and the
 * prefix rule both share with the other policies: leaves before their parents, no orphans, in a long
 * random replay. Requests are served as a scheduler would: kvb_match, allocate and register the rest,
 * release the whole chain (deepest first).
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

#define MAXREQ 64

static kvb_hash key_hash(uint64_t key) { return fx_hash(key * UINT64_C(0x9e3779b97f4a7c15) + 1, key ^ 0xA5A5); }

/* One request over a chain: match + alloc + register + release. Returns the blocks matched. */
static size_t serve(kvb_pool *pool, const kvb_hash *h, size_t n)
{
    kvb_block b[MAXREQ], out[MAXREQ];
    kvb_hash parents[MAXREQ];
    size_t m = 0, i;
    KVT_EQ(kvb_match(pool, h, n, b, &m), KVB_OK);
    if (m < n) {
        KVT_EQ(kvb_alloc(pool, n - m, b + m), KVB_OK);
        for (i = m; i < n; i++) parents[i] = i ? h[i - 1] : fx_hash(0, 0);
        KVT_EQ(kvb_register_hashed(pool, b + m, n - m, h + m, parents + m, out + m), KVB_OK);
        for (i = m; i < n; i++) b[i] = out[i];
    }
    KVT_EQ(kvb_release(pool, b, n, NULL), KVB_OK);
    return m;
}

/* A single-block request (a root block with this key). */
static size_t serve_key(kvb_pool *pool, uint64_t key)
{
    kvb_hash h = key_hash(key);
    return serve(pool, &h, 1);
}

static int cached(kvb_pool *pool, uint64_t key) { return fx_lookup(pool, (kvb_hash[]){key_hash(key)}, 1) == 1; }

static kvb_pool *policy_pool(kvb_evict_policy ev, uint32_t blocks, fx_events *rec)
{
    kvb_pool_config cfg = fx_config(blocks);
    cfg.eviction = ev;
    if (rec) {
        cfg.on_events = fx_record_events;
        cfg.event_user = rec;
    }
    return fx_pool_from(&cfg);
}

/* ---- ARC ----------------------------------------------------------------------------------------- */

/* A new block enters T1; a hit moves it to T2. */
static void test_arc_hit_moves_to_t2(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_ARC, 8, NULL);
    serve_key(pool, 1);
    serve_key(pool, 2);
    KVT_EQ(fx_stats(pool).list_blocks[0], 2);
    KVT_EQ(fx_stats(pool).list_blocks[1], 0);
    KVT_EQ(serve_key(pool, 1), 1);
    KVT_EQ(fx_stats(pool).list_blocks[0], 1);
    KVT_EQ(fx_stats(pool).list_blocks[1], 1);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* With T1 above its target (0 at first), T1's oldest goes, not T2's, even when T2's is older. */
static void test_arc_evicts_t1_above_target(void)
{
    fx_events rec;
    kvb_pool *pool = policy_pool(KVB_EVICT_ARC, 4, &rec);
    serve_key(pool, 1);
    serve_key(pool, 1); /* 1 in T2, released before the others: the oldest block */
    serve_key(pool, 2);
    serve_key(pool, 3);
    serve_key(pool, 4);
    fx_events_clear(&rec);
    serve_key(pool, 5);
    KVT_EQ(fx_events_count(&rec, KVB_EVENT_REMOVED), 1);
    KVT_CHECK(cached(pool, 1)); /* T2 kept */
    KVT_CHECK(!cached(pool, 2)); /* T1's oldest went */
    KVT_EQ(fx_stats(pool).ghost_blocks[0], 1); /* remembered in B1 */
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A miss that finds its hash in B1 raises T1's target (recency would have paid) and enters T2; one in
 * B2 lowers it (frequency would have paid). */
static void test_arc_ghost_hits_adapt_target(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_ARC, 4, NULL);
    serve_key(pool, 1);
    serve_key(pool, 1); /* T2 = {1} */
    serve_key(pool, 2);
    serve_key(pool, 3);
    serve_key(pool, 4); /* T1 = {2, 3, 4} */
    serve_key(pool, 5); /* T1 above its target 0: 2 goes to B1 */
    KVT_CHECK(!cached(pool, 2));
    KVT_EQ(fx_stats(pool).ghost_blocks[0], 1);
    KVT_EQ(fx_stats(pool).arc_target, 0);
    KVT_EQ(serve_key(pool, 2), 0); /* a B1 ghost hit: the target grows, 2 enters T2 (3 went to B1) */
    KVT_EQ(fx_stats(pool).arc_target, 1);
    KVT_EQ(fx_stats(pool).list_blocks[1], 2);
    KVT_EQ(serve_key(pool, 4), 1); /* hits: T2 = {1, 2, 4, 5}, T1 empty */
    KVT_EQ(serve_key(pool, 5), 1);
    KVT_EQ(fx_stats(pool).list_blocks[0], 0);
    serve_key(pool, 6); /* T1 (0) not above its target: T2's oldest (1) goes to B2 */
    KVT_CHECK(!cached(pool, 1));
    KVT_EQ(fx_stats(pool).ghost_blocks[1], 1);
    KVT_EQ(serve_key(pool, 1), 0); /* a B2 ghost hit: the target shrinks */
    KVT_EQ(fx_stats(pool).arc_target, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A full T1 of one-off blocks evicts without ghosts (ARC's case |T1| = c). */
static void test_arc_full_t1_keeps_no_ghosts(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_ARC, 4, NULL);
    for (uint64_t k = 1; k <= 12; k++) serve_key(pool, k);
    KVT_EQ(fx_stats(pool).list_blocks[0], 4);
    KVT_CHECK(fx_stats(pool).ghost_blocks[0] <= 1);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* ARC keeps blocks used twice in a row (T2) through scans of one-off blocks; LRU does not. */
static void test_arc_resists_scans(void)
{
    kvb_pool *arc = policy_pool(KVB_EVICT_ARC, 16, NULL), *lru = policy_pool(KVB_EVICT_LRU, 16, NULL);
    size_t hits_arc = 0, hits_lru = 0;
    uint64_t scan = 1000;
    for (int round = 0; round < 50; round++) {
        for (uint64_t k = 1; k <= 4; k++) { /* the first use of a round is counted; a second one follows */
            hits_arc += serve_key(arc, k);
            hits_lru += serve_key(lru, k);
            serve_key(arc, k);
            serve_key(lru, k);
        }
        for (int i = 0; i < 20; i++, scan++) {
            serve_key(arc, scan);
            serve_key(lru, scan);
        }
    }
    KVT_EQ(hits_lru, 0);
    KVT_CHECK(hits_arc >= 150);
    FX_CHECK_POOL(arc);
    kvb_pool_destroy(arc);
    kvb_pool_destroy(lru);
}

/* ---- S3-FIFO ------------------------------------------------------------------------------------- */

/* A block not hit in the small queue leaves first, into the ghost queue; coming back it enters the
 * main queue directly. */
static void test_s3fifo_ghost_promotes(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, 10, NULL);
    uint64_t k;
    for (k = 1; k <= 10; k++) serve_key(pool, k);
    KVT_EQ(fx_stats(pool).list_blocks[0], 10);
    serve_key(pool, 11);
    KVT_CHECK(!cached(pool, 1)); /* FIFO: the first in goes */
    KVT_EQ(fx_stats(pool).ghost_blocks[0], 1);
    KVT_EQ(serve_key(pool, 1), 0); /* back: a ghost hit */
    KVT_EQ(fx_stats(pool).ghost_blocks[0], 1); /* 1 left G, 2 went there */
    KVT_EQ(fx_stats(pool).list_blocks[1], 1);  /* 1 is in the main queue */
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A block hit while in the small queue is moved to the main queue when its turn comes, not evicted;
 * a hit does not move a block within its queue (FIFO, not LRU). */
static void test_s3fifo_small_queue_admits_hit_blocks(void)
{
    fx_events rec;
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, 10, &rec);
    uint64_t k;
    for (k = 1; k <= 10; k++) serve_key(pool, k);
    KVT_EQ(serve_key(pool, 1), 1); /* hit: counted, stays first in line */
    KVT_EQ(serve_key(pool, 3), 1);
    fx_events_clear(&rec);
    serve_key(pool, 11);
    KVT_CHECK(cached(pool, 1)); /* promoted to the main queue */
    KVT_CHECK(!cached(pool, 2)); /* the next one in line, never hit, went */
    KVT_EQ(fx_stats(pool).list_blocks[1], 1);
    serve_key(pool, 12);
    KVT_CHECK(cached(pool, 3));
    KVT_CHECK(!cached(pool, 4));
    KVT_EQ(fx_stats(pool).list_blocks[1], 2);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* In the main queue a block with hits goes round again (one count less) instead of leaving. */
static void test_s3fifo_main_queue_reinserts(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, 10, NULL);
    uint64_t k;
    for (k = 1; k <= 10; k++) {
        serve_key(pool, k);
        serve_key(pool, k); /* one hit each */
    }
    for (k = 11; k <= 19; k++) serve_key(pool, k); /* the small queue moves 1..9 to main as it evicts */
    KVT_EQ(fx_stats(pool).list_blocks[1], 9);
    for (k = 2; k <= 9; k++)
        if (cached(pool, k)) serve_key(pool, k); /* hits in main: all but block 1 */
    for (k = 20; k <= 40; k++) serve_key(pool, k);
    KVT_CHECK(!cached(pool, 1)); /* no hit in main: the first to leave it */
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A block in use keeps its place in line while it is referenced. */
static void test_s3fifo_place_kept_while_in_use(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, 10, NULL);
    kvb_block held;
    size_t m = 0;
    uint64_t k;
    for (k = 1; k <= 10; k++) serve_key(pool, k);
    kvb_hash h = key_hash(1);
    KVT_EQ(kvb_match(pool, &h, 1, &held, &m), KVB_OK);
    KVT_EQ(m, 1);
    serve_key(pool, 11); /* 1 is in use: 2 goes */
    KVT_CHECK(!cached(pool, 2));
    KVT_EQ(kvb_release(pool, &held, 1, NULL), KVB_OK); /* 1 hit once: its count is 1, still first */
    serve_key(pool, 12); /* 1 is first and was hit: promoted; 3 goes */
    KVT_CHECK(cached(pool, 1));
    KVT_CHECK(!cached(pool, 3));
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* ---- the prefix rule ------------------------------------------------------------------------------ */

/* Random chains sharing prefixes: after every request no cached block lacks its parent, and the pool's
 * invariants (lists, sizes, rings) hold. */
static void prefix_rule(kvb_evict_policy ev)
{
    kvb_pool *pool = policy_pool(ev, 64, NULL);
    uint64_t rng = 12345;
    kvb_hash h[MAXREQ];
    for (int r = 0; r < 4000; r++) {
        size_t n, i;
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t base = (rng >> 33) % 40, len = 2 + (rng >> 20) % 12;
        kvb_hash parent = fx_hash(0, 0);
        for (n = 0; n < len; n++) { /* a prefix shared among requests with the same base, then their own */
            uint64_t id = n < 4 ? base * 16 + n : 100000 + (uint64_t)r * 16 + n;
            h[n] = parent = fx_hash(parent.lo * 31 + id * UINT64_C(0x9e3779b97f4a7c15) + 7, id);
        }
        serve(pool, h, n);
        if (r % 50 == 0) {
            FX_CHECK_POOL(pool);
            for (i = 1; i < n; i++) /* a cached block's parent is cached */
                if (fx_lookup(pool, h + i, 1)) KVT_CHECK(fx_lookup(pool, h + i - 1, 1));
        }
    }
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_arc_no_orphans(void) { prefix_rule(KVB_EVICT_ARC); }
static void test_s3fifo_no_orphans(void) { prefix_rule(KVB_EVICT_S3FIFO); }

/* Two priority levels: a parent P inactive at level 0 (its child still held), a leaf L inactive at level
 * 1. The eviction takes L: a leaf of any level goes before a parent (the rule LINEAGE keeps too). Before,
 * FOL, ARC and S3-FIFO fell back to level 0's oldest inner block at once, and P went. */
static void test_leaf_of_a_higher_level_before_a_parent(void)
{
    static const kvb_evict_policy pol[] = {KVB_EVICT_LINEAGE, KVB_EVICT_FOL, KVB_EVICT_ARC, KVB_EVICT_S3FIFO};
    for (size_t k = 0; k < sizeof pol / sizeof pol[0]; k++) {
        kvb_pool_config cfg = fx_config(3);
        kvb_pool *pool;
        kvb_block b[3], o[3], nb;
        kvb_hash h[3] = {key_hash(1), key_hash(2), key_hash(3)}, par[2];
        kvb_release_opts level1 = {0, 0};
        par[0] = fx_hash(0, 0);
        par[1] = h[0];
        cfg.eviction = pol[k];
        cfg.priority_levels = 2;
        pool = fx_pool_from(&cfg);
        KVT_EQ(kvb_alloc(pool, 3, b), KVB_OK);
        KVT_EQ(kvb_register_hashed(pool, b, 2, h, par, o), KVB_OK);         /* P, and C its child */
        KVT_EQ(kvb_register_hashed(pool, b + 2, 1, h + 2, NULL, o + 2), KVB_OK); /* L, a root */
        KVT_EQ(kvb_release(pool, &o[0], 1, NULL), KVB_OK);                  /* P: level 0, C still held */
        level1.priority = 1;
        KVT_EQ(kvb_release(pool, &o[2], 1, &level1), KVB_OK);              /* L: level 1 */
        KVT_EQ(kvb_alloc(pool, 1, &nb), KVB_OK);                           /* one eviction */
        KVT_EQ(fx_lookup(pool, &h[0], 1), 1);
        KVT_EQ(fx_lookup(pool, &h[2], 1), 0);
        FX_CHECK_POOL(pool);
        KVT_EQ(kvb_release(pool, &nb, 1, NULL), KVB_OK);
        KVT_EQ(kvb_release(pool, &o[1], 1, NULL), KVB_OK);
        kvb_pool_destroy(pool);
    }
}

/* S3-FIFO, two levels: a chain of 5,000 blocks at level 0, its leaf behind more parents than one victim
 * scan passes (KVB__S3_SCAN_LIMIT), and 50 roots at level 1. Evictions take level 0's blocks, the leaf
 * first, never level 1's while level 0 has a leaf. Before (a review of the multi-level fix), a scan that
 * gave up moved on to level 1 and drained it. */
static void test_s3fifo_long_chain_stays_at_its_level(void)
{
    enum { N = 5000, M = 50 };
    kvb_pool_config cfg = fx_config(N + M);
    kvb_pool *pool;
    kvb_block *b = (kvb_block *)calloc(N + M, sizeof *b), nb[M];
    kvb_hash *h = (kvb_hash *)calloc(N + M, sizeof *h), *par = (kvb_hash *)calloc(N + M, sizeof *par);
    kvb_release_opts level1 = {0, 0};
    kvb_block_info info;
    uint32_t i, gone0 = 0, gone1 = 0;
    cfg.eviction = KVB_EVICT_S3FIFO;
    cfg.priority_levels = 2;
    pool = fx_pool_from(&cfg);
    for (i = 0; i < N + M; i++) {
        h[i] = key_hash(i + 1);
        if (i && i < N) par[i] = h[i - 1];
    }
    KVT_EQ(kvb_alloc(pool, N + M, b), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, b, N + M, h, par, b), KVB_OK);
    for (i = 0; i < N; i++) KVT_EQ(kvb_release(pool, b + i, 1, NULL), KVB_OK); /* oldest first: parents ahead */
    level1.priority = 1;
    KVT_EQ(kvb_release(pool, b + N, M, &level1), KVB_OK);
    KVT_EQ(kvb_alloc(pool, M, nb), KVB_OK);
    for (i = 0; i < N + M; i++)
        if (kvb_block_get_info(pool, kvb_weak_of(b[i]).id, &info) != KVB_OK) *(i < N ? &gone0 : &gone1) += 1;
    KVT_EQ(gone1, 0);
    KVT_EQ(gone0, M);
    KVT_CHECK(kvb_block_get_info(pool, kvb_weak_of(b[N - 1]).id, &info) != KVB_OK); /* the leaf went */
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, nb, M, NULL), KVB_OK);
    kvb_pool_destroy(pool);
    free(b);
    free(h);
    free(par);
}

/* S3-FIFO: the small queue holds only a parent P (at its target size) and P's child C, hit once, waits
 * in the main queue. The victim is C, the leaf: a pass that finds no leaf in one queue looks in the
 * other. Before, four passes went through the small queue and P was evicted, C orphaned. */
static void test_s3fifo_leaf_in_the_main_queue_before_a_parent(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, 3, NULL);
    kvb_hash h[2];
    kvb_block b[2], c, nb[2];
    size_t got = 0;
    h[0] = key_hash(1);
    h[1] = fx_hash(h[0].lo * 31 + 7, 2);
    KVT_EQ(kvb_request_begin(pool, h, 2, b, &got), KVB_OK); /* P and C enter the small queue */
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    KVT_EQ(kvb_upgrade(pool, kvb_weak_of(b[1]), &c), KVB_OK); /* a hit on C */
    KVT_EQ(kvb_release(pool, &c, 1, NULL), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 2, nb), KVB_OK); /* the free block, then one eviction */
    KVT_EQ(fx_lookup(pool, &h[0], 1), 1);  /* P stays */
    KVT_EQ(fx_lookup(pool, h, 2), 1);      /* C went */
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, nb, 2, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

/* S3-FIFO: the small queue below its target (2 of 40 blocks), the main queue 30 parents (a chain whose
 * leaf is in use), then 150 blocks hit once, then 5 never hit. The rule: the hit ones go round (one
 * count less) and the main queue's oldest leaf with no count left, Z1, leaves; the small queue's block
 * S stays. Before, each block that went round restarted the scan at the main queue's head, passing the
 * 30 parents again each time: the scan's budget (KVB__S3_SCAN_LIMIT) ran out after about 130 of them,
 * and the fallback took the small queue's oldest leaf, S. */
static void test_s3fifo_requeue_does_not_rescan_parents(void)
{
    enum { C = 400, NP = 30, NQ = 150, NZ = 5, NF = C - NP - 1 - NQ - NZ };
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, C, NULL);
    kvb_block chain[NP + 1], b, *hold = (kvb_block *)calloc(C, sizeof *hold);
    kvb_hash h[NP + 1], par[NP + 1], *f = (kvb_hash *)calloc(NF, sizeof *f);
    size_t m = 0, nhold = 0, i;
    for (i = 0; i <= NP; i++) {
        h[i] = key_hash(1000 + i);
        par[i] = i ? h[i - 1] : fx_hash(0, 0);
    }
    KVT_EQ(kvb_alloc(pool, NP + 1, chain), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, chain, NP + 1, h, par, chain), KVB_OK);
    KVT_EQ(kvb_release(pool, chain, NP, NULL), KVB_OK); /* the leaf, chain[NP], stays in use */
    for (i = 0; i < NQ + NZ; i++) serve_key(pool, 2000 + i); /* Q1..Q150, Z1..Z5 */
    for (i = 0; i < NF; i++) {
        f[i] = key_hash(3000 + i);
        serve(pool, &f[i], 1);
    }
    KVT_EQ(fx_stats(pool).free_blocks, 0);
    for (i = 0; i < NP; i++) { /* one hit each on P, Q and Z: promoted when the small queue's turn comes */
        KVT_EQ(kvb_match(pool, &h[i], 1, &b, &m), KVB_OK);
        KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    }
    for (i = 0; i < NQ + NZ; i++) KVT_EQ(serve_key(pool, 2000 + i), 1);
    KVT_EQ(kvb_alloc(pool, 1, &hold[nhold++]), KVB_OK); /* P, Q, Z move to the main queue; F1 goes */
    KVT_EQ(fx_stats(pool).list_blocks[1], NP + NQ + NZ);
    KVT_EQ(kvb_invalidate(pool, f + 1, NF - 2, &m), KVB_OK); /* the small queue: the leaf and S = F214 */
    KVT_EQ(m, NF - 2);
    KVT_EQ(fx_stats(pool).list_blocks[0], 2);
    while (fx_stats(pool).free_blocks) KVT_EQ(kvb_alloc(pool, 1, &hold[nhold++]), KVB_OK);
    for (i = 0; i < NQ; i++) KVT_EQ(serve_key(pool, 2000 + i), 1); /* hits in the main queue */
    KVT_EQ(kvb_alloc(pool, 1, &hold[nhold++]), KVB_OK); /* one eviction */
    KVT_EQ(fx_lookup(pool, &f[NF - 1], 1), 1); /* S stays: the small queue is below its target */
    KVT_CHECK(!cached(pool, 2000 + NQ)); /* Z1 went */
    for (i = 0; i < NQ; i++) KVT_CHECK(cached(pool, 2000 + i));
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, hold, nhold, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &chain[NP], 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
    free(hold);
    free(f);
}

/* Eviction candidates name inactive blocks only, T1 / the small queue first. */
static void test_candidates(void)
{
    for (int p = 0; p < 2; p++) {
        kvb_pool *pool = policy_pool(p ? KVB_EVICT_S3FIFO : KVB_EVICT_ARC, 8, NULL);
        kvb_weak w[8];
        size_t n = 0;
        for (uint64_t k = 1; k <= 6; k++) serve_key(pool, k);
        KVT_EQ(kvb_eviction_candidates(pool, 8, w, &n), KVB_OK);
        KVT_EQ(n, 6);
        kvb_block b;
        KVT_EQ(kvb_upgrade(pool, w[0], &b), KVB_OK);
        KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
        FX_CHECK_POOL(pool);
        kvb_pool_destroy(pool);
    }
}

/* ARC's candidates follow its victim rule: with T1 at or below the target (after a ghost hit in B1),
 * T2's oldest goes first, and each candidate listed first is the block the next eviction takes, to the
 * last. Before, T1 was always listed first. */
static void test_arc_candidates_in_eviction_order(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_ARC, 4, NULL);
    kvb_block nb[4];
    kvb_pool_stats st;
    serve_key(pool, 1), serve_key(pool, 1), serve_key(pool, 2), serve_key(pool, 2); /* T2 = {1, 2} */
    serve_key(pool, 3), serve_key(pool, 4);                                         /* T1 = {3, 4} */
    serve_key(pool, 5); /* 3 goes to B1 */
    serve_key(pool, 3); /* 4 goes; 3 comes back from B1: the target rises to 1, 3 into T2 */
    st = fx_stats(pool);
    KVT_EQ(st.list_blocks[0], 1);
    KVT_EQ(st.arc_target, 1);
    for (int j = 0; j < 4; j++) {
        kvb_weak w[4];
        kvb_block_info info;
        size_t n = 0;
        KVT_EQ(kvb_eviction_candidates(pool, 4, w, &n), KVB_OK);
        KVT_EQ(n, (size_t)(4 - j));
        if (!j) { /* T2 = {1, 2, 3} oldest first, then T1 = {5} */
            KVT_EQ(fx_info(pool, w[0].id).hash.lo, key_hash(1).lo);
            KVT_EQ(fx_info(pool, w[3].id).hash.lo, key_hash(5).lo);
        }
        KVT_EQ(kvb_alloc(pool, 1, &nb[j]), KVB_OK); /* one eviction */
        KVT_CHECK(kvb_block_get_info(pool, w[0].id, &info) != KVB_OK); /* the first candidate went */
        for (size_t i = 1; i < n; i++) KVT_EQ(kvb_block_get_info(pool, w[i].id, &info), KVB_OK);
    }
    KVT_EQ(kvb_release(pool, nb, 4, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* S3-FIFO's candidates follow its victim rule: hit blocks of the small queue are promoted (not listed
 * where they stand), main-queue blocks with a count go round once per count, and the small queue is
 * listed only while it holds its target. Each eviction takes the first candidate listed before it, to
 * the last. Before, the candidates were the small queue then the main queue in ring order. */
static void test_s3fifo_candidates_in_eviction_order(void)
{
    kvb_pool *pool = policy_pool(KVB_EVICT_S3FIFO, 20, NULL); /* the small queue's target: 2 */
    kvb_block held[20];
    kvb_weak w[20];
    size_t n = 0;
    for (uint64_t k = 1; k <= 20; k++) serve_key(pool, k);
    serve_key(pool, 3), serve_key(pool, 7), serve_key(pool, 12); /* hit while small */
    KVT_EQ(kvb_alloc(pool, 4, held), KVB_OK); /* 1, 2, 4, 5 go; 3 moves to the main queue */
    serve_key(pool, 3), serve_key(pool, 3);   /* its count: 2 */
    KVT_EQ(kvb_eviction_candidates(pool, 20, w, &n), KVB_OK);
    KVT_EQ(n, 16);
    KVT_EQ(fx_info(pool, w[0].id).hash.lo, key_hash(6).lo);
    for (size_t j = 0; j < n; j++) {
        kvb_block_info info;
        KVT_EQ(kvb_alloc(pool, 1, &held[4 + j]), KVB_OK); /* one eviction */
        KVT_CHECK(kvb_block_get_info(pool, w[j].id, &info) != KVB_OK); /* the next candidate went */
        for (size_t i = j + 1; i < n; i++) KVT_EQ(kvb_block_get_info(pool, w[i].id, &info), KVB_OK);
    }
    KVT_EQ(kvb_release(pool, held, 20, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

int main(void)
{
    KVT_RUN(test_arc_hit_moves_to_t2);
    KVT_RUN(test_arc_evicts_t1_above_target);
    KVT_RUN(test_arc_ghost_hits_adapt_target);
    KVT_RUN(test_arc_full_t1_keeps_no_ghosts);
    KVT_RUN(test_arc_resists_scans);
    KVT_RUN(test_arc_no_orphans);
    KVT_RUN(test_s3fifo_ghost_promotes);
    KVT_RUN(test_s3fifo_small_queue_admits_hit_blocks);
    KVT_RUN(test_s3fifo_main_queue_reinserts);
    KVT_RUN(test_s3fifo_place_kept_while_in_use);
    KVT_RUN(test_s3fifo_no_orphans);
    KVT_RUN(test_leaf_of_a_higher_level_before_a_parent);
    KVT_RUN(test_s3fifo_leaf_in_the_main_queue_before_a_parent);
    KVT_RUN(test_s3fifo_long_chain_stays_at_its_level);
    KVT_RUN(test_s3fifo_requeue_does_not_rescan_parents);
    KVT_RUN(test_candidates);
    KVT_RUN(test_arc_candidates_in_eviction_order);
    KVT_RUN(test_s3fifo_candidates_in_eviction_order);
    return kvt_summary();
}
