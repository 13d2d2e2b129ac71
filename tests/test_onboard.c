/* Onboarding with kvo_onboard: blocks found by hash in the source (host tier) are loaded into the
 * destination (device tier) with identical bytes and registered there; a hash already in the
 * destination returns the existing block without a copy; the first miss ends the request; the caller
 * takes the destination blocks once, as strong references; cancel, release without taking, destroy
 * without releasing, a full destination, the threaded mode, and two requests with a common prefix
 * moving each block once. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvtest.h"
#include "offload_fixtures.h"

enum { MAXN = 16 };

/* G2 (host, layer-separate) holds h[0..n) registered and inactive; G1 (device stand-in, contiguous) is
 * empty; the pipeline loads G2 -> G1 in poll mode through the counting wrapper. */
typedef struct rig {
    kvb_pool *g1, *g2;
    kvo_backend *mem;
    of_backend *w;
    of_clock clock;
    kvo_pipeline *p;
    kvb_hash h[MAXN];
    kvb_weak in_g2[MAXN];
} rig;

static void rig_open_with(rig *r, uint32_t g1_blocks, kvo_mode mode, uint32_t threads)
{
    memset(r, 0, sizeof *r);
    r->g2 = of_mem_pool(32, KVB_LAYOUT_LAYER_SEPARATE);
    r->g1 = of_mem_pool(g1_blocks, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    KVT_EQ(kvo_memcpy_backend_create(threads, &r->mem), KVO_OK);
    r->w = of_backend_wrap(r->mem);
    r->clock.now = 5000000;
    of_chain(11, MAXN, r->h);
    of_register(r->g2, r->h, MAXN, NULL, r->in_g2);
    kvo_pipeline_config pc = of_config(r->g2, r->g1, of_backend_iface(r->w), mode,
                                       mode == KVO_MODE_POLL ? &r->clock : NULL);
    r->p = of_pipeline(&pc);
}

static void rig_open(rig *r) { rig_open_with(r, 32, KVO_MODE_POLL, 0); }

static void rig_close(rig *r)
{
    kvo_pipeline_destroy(r->p);
    KVT_EQ(of_active(r->g1), 0);
    KVT_EQ(of_active(r->g2), 0);
    OF_CHECK_POOL(r->g1);
    OF_CHECK_POOL(r->g2);
    kvo_backend_destroy(of_backend_iface(r->w));
    kvo_backend_destroy(r->mem);
    kvb_pool_destroy(r->g1);
    kvb_pool_destroy(r->g2);
}

static kvo_transfer onboard(rig *r, const kvb_hash *hashes, size_t n)
{
    kvo_transfer t;
    memset(&t, 0, sizeof t);
    KVT_EQ(kvo_onboard(r->p, hashes, n, NULL, &t), KVO_OK);
    return t;
}

/* Hashes of 4 blocks found in G2 come back as 4 Registered G1 blocks with the same bytes, in hash
 * order, one reference each, now the caller's. */
static void test_onboard_loads_and_registers(void)
{
    rig r;
    rig_open(&r);
    kvo_transfer t = onboard(&r, r.h, 4);
    for (size_t i = 0; i < 4; i++) KVT_EQ(of_refs(r.g2, r.in_g2[i].id), 1); /* taken at once */
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.transferred, 4);
    KVT_EQ(info.present, 0);
    KVT_EQ(info.failed, 0);
    for (size_t i = 0; i < 4; i++) KVT_EQ(of_refs(r.g2, r.in_g2[i].id), 0); /* the source is let go */
    size_t found = 0;
    KVT_EQ(kvb_lookup(r.g1, r.h, 4, &found), KVB_OK);
    KVT_EQ(found, 4);

    kvb_block got[8];
    size_t n = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 8, &n), KVO_OK);
    KVT_EQ(n, 4);
    for (size_t i = 0; i < n; i++) {
        kvb_block_info bi;
        KVT_EQ(kvb_block_get_info(r.g1, got[i].id, &bi), KVB_OK);
        KVT_EQ(bi.state, KVB_STATE_REGISTERED);
        KVT_EQ(bi.refs, 1);
        KVT_CHECK(of_hash_eq(bi.hash, r.h[i]));
        KVT_CHECK(of_bytes_ok(r.g1, got[i], r.h[i]));
    }
    size_t again = 99;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 8, &again), KVO_ESTATE); /* only once */
    KVT_EQ(of_active(r.g1), 4);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    KVT_EQ(of_active(r.g1), 4); /* taken blocks are ours, release of the handle leaves them */
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    KVT_EQ(of_holds_all(r.g2, r.h, MAXN), MAXN); /* the host copy stays */
    rig_close(&r);
}

/* kvo_pipeline_destroy with transfers never released: one complete whose blocks were never taken, one
 * still queued. The destination blocks the first holds go back (registered, so they stay cached), the
 * second's sources are let go, and neither pool has a block referenced afterwards (rig_close checks). */
static void test_destroy_releases_what_transfers_hold(void)
{
    rig r;
    rig_open(&r);
    kvo_transfer done = onboard(&r, r.h, 4);
    KVT_EQ(of_pump(r.p, &r.clock, done, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_active(r.g1), 4); /* held for kvo_transfer_take_blocks */
    kvo_transfer queued = onboard(&r, r.h + 8, 4);
    KVT_CHECK(!of_final(of_status(r.p, queued)));
    KVT_CHECK(of_active(r.g2) > 0); /* its sources are taken at once */
    rig_close(&r);
}

/* A load smaller than min_batch (8 by default) goes at once: a request waits for it, so the batcher
 * does not hold it for more blocks or for the flush interval (10 ms) as it does offloads. The clock
 * stands still here: before, the transfer stayed queued until 10 ms had passed. */
static void test_small_load_goes_at_once(void)
{
    rig r;
    rig_open(&r);
    uint64_t start = r.clock.now;
    kvo_transfer t = onboard(&r, r.h, 2);
    KVT_EQ(of_pump(r.p, &r.clock, t, 0, 10), KVO_STATUS_COMPLETE);
    KVT_EQ(r.clock.now, start);
    KVT_EQ(of_info(r.p, t).transferred, 2);
    kvb_block got[2];
    size_t n = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 2, &n), KVO_OK);
    KVT_EQ(n, 2);
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* ... but while the backend is busy (its one job in flight), loads that arrive meanwhile wait and share
 * batches of min_batch blocks instead of becoming one job each: one 1-block load goes at once, the 16
 * after it (one every 100 us) go as two jobs once the first is done. */
static void test_loads_share_batches_while_the_backend_is_busy(void)
{
    enum { LATER = 16 };
    kvb_pool *g2 = of_mem_pool(64, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g1 = of_mem_pool(64, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvo_backend *mem = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    of_backend *w = of_backend_wrap(mem);
    of_clock clock = {5000000};
    kvb_hash h[LATER + 1];
    kvb_weak wk[LATER + 1];
    kvo_transfer t[LATER + 1];
    for (int i = 0; i <= LATER; i++) { /* independent 1-block prompts */
        of_chain(200 + (uint64_t)i, 1, &h[i]);
        of_register(g2, &h[i], 1, NULL, &wk[i]);
    }
    kvo_pipeline_config pc = of_config(g2, g1, of_backend_iface(w), KVO_MODE_POLL, &clock);
    kvo_pipeline *p = of_pipeline(&pc);
    of_backend_set_hold(w, 1);
    for (int i = 0; i <= LATER; i++) {
        KVT_EQ(kvo_onboard(p, &h[i], 1, NULL, &t[i]), KVO_OK);
        KVT_EQ(kvo_pipeline_poll(p), KVO_OK);
        clock.now += 100;
    }
    KVT_EQ(w->jobs, 1); /* the first load; the others wait behind it */
    of_backend_set_hold(w, 0);
    of_backend_release(w);
    for (int i = 0; i <= LATER; i++) KVT_EQ(of_pump(p, &clock, t[i], 100, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(w->jobs, 3);
    KVT_EQ(w->copies, LATER + 1);
    for (int i = 0; i <= LATER; i++) {
        kvb_block b;
        size_t n = 0;
        KVT_EQ(kvo_transfer_take_blocks(p, t[i], &b, 1, &n), KVO_OK);
        KVT_EQ(n, 1);
        if (n) KVT_EQ(kvb_release(g1, &b, 1, NULL), KVB_OK);
        kvo_transfer_release(p, t[i]);
    }
    kvo_pipeline_destroy(p);
    KVT_EQ(of_active(g1), 0);
    KVT_EQ(of_active(g2), 0);
    kvo_backend_destroy(of_backend_iface(w));
    kvo_backend_destroy(mem);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
}

/* A hash already in G1 is returned as it is (counted present, no copy); the others are loaded. */
static void test_onboard_present_block_is_returned(void)
{
    rig r;
    kvb_weak existing;
    rig_open(&r);
    of_register(r.g1, r.h, 1, NULL, &existing); /* h[0] is already on the device, inactive */
    kvo_transfer t = onboard(&r, r.h, 3);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.present, 1);
    KVT_EQ(info.transferred, 2);
    KVT_EQ(of_backend_saw_src(r.w, r.g2, kvb_block_index(r.in_g2[0].id)), 0);
    KVT_EQ(of_backend_copies(r.w), 2);
    kvb_block got[4];
    size_t n = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 4, &n), KVO_OK);
    KVT_EQ(n, 3);
    KVT_EQ(kvb_block_index(got[0].id), kvb_block_index(existing.id)); /* the same block */
    for (size_t i = 0; i < n; i++) {
        KVT_EQ(of_refs(r.g1, got[i].id), 1);
        KVT_CHECK(of_hash_eq(of_hash_of(r.g1, got[i].id), r.h[i]));
        KVT_CHECK(of_bytes_ok(r.g1, got[i], r.h[i]));
    }
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* A block an onboard finds in G1 is held until the caller takes it, not used: the pipeline pins it
 * (no lookup counted, no ARC hit) and one not taken goes back unpinned, at the level it had. G1 under
 * ARC with 3 levels: h[0] released there once at level 2 (T1); an onboard of it completes at once and
 * is let go untaken: still T1, level 2, G1's lookups as before. Before, the onboard's match counted a
 * lookup and an ARC hit (T2), and its release put the block at the pipeline's dst_priority (0). */
static void test_present_block_is_held_not_used(void)
{
    rig r;
    kvb_pool_config gc;
    kvb_pool_stats st;
    kvb_block held;
    kvb_weak existing;
    kvb_block_info bi;
    rig_open(&r);
    kvo_pipeline_destroy(r.p);
    KVT_EQ(kvb_pool_get_config(r.g1, &gc), KVB_OK);
    kvb_pool_destroy(r.g1);
    gc.eviction = KVB_EVICT_ARC;
    gc.priority_levels = 3;
    KVT_EQ(kvb_pool_create(&gc, &r.g1), KVB_OK);
    kvo_pipeline_config pc = of_config(r.g2, r.g1, of_backend_iface(r.w), KVO_MODE_POLL, &r.clock);
    r.p = of_pipeline(&pc);
    of_register(r.g1, r.h, 1, &held, &existing);
    kvb_release_opts o;
    memset(&o, 0, sizeof o);
    o.priority = 2;
    KVT_EQ(kvb_release(r.g1, &held, 1, &o), KVB_OK);
    KVT_EQ(kvb_pool_get_stats(r.g1, &st), KVB_OK);
    uint64_t lookups = st.lookups;
    KVT_EQ(st.list_blocks[0], 1);
    kvo_transfer t = onboard(&r, r.h, 1);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).present, 1);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK); /* not taken */
    KVT_EQ(kvb_block_get_info(r.g1, existing.id, &bi), KVB_OK);
    KVT_EQ(bi.state, KVB_STATE_REGISTERED);
    KVT_EQ(bi.refs, 0);
    KVT_EQ(bi.priority, 2);
    KVT_EQ(kvb_pool_get_stats(r.g1, &st), KVB_OK);
    KVT_EQ(st.list_blocks[0], 1);
    KVT_EQ(st.list_blocks[1], 0);
    KVT_EQ(st.lookups, lookups);
    rig_close(&r);
}

/* An onboard let go untaken gives its destination blocks back deepest first, as one release does, so
 * that plain LRU (no leaf check) evicts a chain from its end: G1 under LRU holds h[0], h[1] (inactive);
 * an onboard of h[0..4) finds them present and lands h[2], h[3]; released untaken, G1's eviction order
 * is h[3], h[2], h[1], h[0]. With the pinned blocks given back before the landed ones, h[1] and h[0]
 * came first: the root evicted first leaves the landed blocks cached but unreachable. */
static void test_untaken_blocks_go_back_deepest_first(void)
{
    rig r;
    kvb_pool_config gc;
    kvb_weak cand[8];
    size_t n = 0;
    rig_open(&r);
    kvo_pipeline_destroy(r.p);
    KVT_EQ(kvb_pool_get_config(r.g1, &gc), KVB_OK);
    kvb_pool_destroy(r.g1);
    gc.eviction = KVB_EVICT_LRU;
    KVT_EQ(kvb_pool_create(&gc, &r.g1), KVB_OK);
    kvo_pipeline_config pc = of_config(r.g2, r.g1, of_backend_iface(r.w), KVO_MODE_POLL, &r.clock);
    r.p = of_pipeline(&pc);
    of_register(r.g1, r.h, 2, NULL, NULL);
    kvo_transfer t = onboard(&r, r.h, 4);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).present, 2);
    KVT_EQ(of_info(r.p, t).transferred, 2);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK); /* not taken */
    KVT_EQ(kvb_eviction_candidates(r.g1, 8, cand, &n), KVB_OK);
    KVT_EQ(n, 4);
    for (size_t i = 0; i < n && i < 4; i++) KVT_CHECK(of_hash_eq(of_hash_of(r.g1, cand[i].id), r.h[3 - i]));
    rig_close(&r);
}

/* h[2] is in neither tier: h[0], h[1] load; h[3], though in G2, is not asked for any more. */
static void test_miss_ends_the_prefix(void)
{
    rig r;
    rig_open(&r);
    kvb_hash ask[4] = {r.h[0], r.h[1], r.h[2], r.h[3]};
    ask[2].lo ^= 0x5a5a5a5a; /* nowhere */
    kvo_transfer t = onboard(&r, ask, 4);
    KVT_EQ(of_refs(r.g2, r.in_g2[3].id), 0);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 2);
    kvb_block got[4];
    size_t n = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 4, &n), KVO_OK);
    KVT_EQ(n, 2);
    for (size_t i = 0; i < n; i++) KVT_CHECK(of_hash_eq(of_hash_of(r.g1, got[i].id), r.h[i]));
    KVT_CHECK(!of_has(r.g1, r.h[3]));
    KVT_EQ(of_backend_saw_src(r.w, r.g2, kvb_block_index(r.in_g2[3].id)), 0);
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    kvo_transfer_release(r.p, t);

    /* a miss on the first hash: nothing to load, nothing to take */
    kvo_transfer none = onboard(&r, &ask[2], 1);
    KVT_EQ(of_pump(r.p, &r.clock, none, 1000, 200), KVO_STATUS_COMPLETE);
    n = 99;
    KVT_EQ(kvo_transfer_take_blocks(r.p, none, got, 4, &n), KVO_OK);
    KVT_EQ(n, 0);
    kvo_transfer_release(r.p, none);

    /* a repeated hash ends the prefix too (it used to wait on its own copy, Queued for ever) */
    kvb_hash rep[3] = {r.h[2], r.h[3], r.h[2]}; /* not in G1 yet */
    kvo_transfer again = onboard(&r, rep, 3);
    KVT_EQ(of_pump(r.p, &r.clock, again, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, again).transferred, 2);
    KVT_EQ(kvo_transfer_take_blocks(r.p, again, got, 4, &n), KVO_OK);
    KVT_EQ(n, 2);
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    kvo_transfer_release(r.p, again);
    rig_close(&r);
}

/* take_blocks before Complete and after a cancel is refused; a cancelled onboarding gives back its
 * source references and registers nothing; releasing an untaken result releases its blocks. */
static void test_take_cancel_and_release_rules(void)
{
    rig r;
    rig_open(&r);
    kvb_block got[4];
    size_t n = 0;
    kvo_transfer early = onboard(&r, r.h, 2);
    KVT_EQ(kvo_transfer_take_blocks(r.p, early, got, 4, &n), KVO_ESTATE); /* not complete yet */
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, early, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_CANCELLED);
    KVT_EQ(kvo_transfer_take_blocks(r.p, early, got, 4, &n), KVO_ESTATE);
    of_polls(r.p, &r.clock, 5000, 10);
    KVT_EQ(of_refs(r.g2, r.in_g2[0].id), 0);
    KVT_EQ(of_refs(r.g2, r.in_g2[1].id), 0);
    KVT_EQ(of_present(r.g1, r.h, 2), 0);
    KVT_EQ(of_backend_copies(r.w), 0);
    kvo_transfer_release(r.p, early);

    kvo_transfer untaken = onboard(&r, &r.h[4], 3);
    KVT_EQ(of_pump(r.p, &r.clock, untaken, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_active(r.g1), 3); /* held for the caller to take */
    KVT_EQ(kvo_transfer_release(r.p, untaken), KVO_OK);
    KVT_EQ(of_active(r.g1), 0);
    KVT_EQ(of_holds_all(r.g1, &r.h[4], 3), 3); /* still registered, cached */
    rig_close(&r);
}

/* take_blocks takes at most max (section "kvo_transfer_take_blocks"): a caller with room for fewer
 * blocks than were loaded gets the first max of them, a shorter prefix, and the rest are given back at
 * once (still registered: cached, and found by the next match). Before, a max below the count was
 * refused with KVO_EINVAL. */
static void test_take_at_most_max(void)
{
    rig r;
    rig_open(&r);
    kvo_transfer t = onboard(&r, r.h, 4);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_active(r.g1), 4);
    kvb_block got[4];
    size_t n = 99;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 2, &n), KVO_OK);
    KVT_EQ(n, 2);
    for (size_t i = 0; i < n && i < 2; i++) {
        KVT_EQ(of_refs(r.g1, got[i].id), 1);
        KVT_CHECK(of_hash_eq(of_hash_of(r.g1, got[i].id), r.h[i])); /* the prefix, in hash order */
    }
    KVT_EQ(of_active(r.g1), 2);               /* the other two went back at once */
    KVT_EQ(of_holds_all(r.g1, &r.h[2], 2), 2); /* ... and stay cached */
    size_t again = 99;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 4, &again), KVO_ESTATE); /* still only once */
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    KVT_EQ(of_active(r.g1), 2);
    if (n == 2) KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);

    kvo_transfer none = onboard(&r, &r.h[8], 3); /* max 0: nothing taken, everything given back */
    KVT_EQ(of_pump(r.p, &r.clock, none, 1000, 200), KVO_STATUS_COMPLETE);
    n = 99;
    KVT_EQ(kvo_transfer_take_blocks(r.p, none, NULL, 0, &n), KVO_OK);
    KVT_EQ(n, 0);
    KVT_EQ(of_active(r.g1), 0);
    KVT_EQ(kvo_transfer_release(r.p, none), KVO_OK);
    rig_close(&r);
}

/* G1 has no room (every block held by the engine): the onboarding fails, counted as a full
 * destination, and the source references are given back. */
static void test_full_destination(void)
{
    rig r;
    kvb_block engine[4];
    rig_open_with(&r, 4, KVO_MODE_POLL, 0);
    KVT_EQ(kvb_alloc(r.g1, 4, engine), KVB_OK);
    kvo_transfer t = onboard(&r, r.h, 2);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_FAILED);
    KVT_EQ(of_info(r.p, t).error, KVO_EFULL);
    kvo_pipeline_stats ps;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &ps), KVO_OK);
    KVT_CHECK(ps.dest_full >= 1);
    KVT_EQ(of_refs(r.g2, r.in_g2[0].id), 0);
    KVT_EQ(of_active(r.g1), 4);
    kvo_transfer_release(r.p, t);
    KVT_EQ(kvb_release(r.g1, engine, 4, NULL), KVB_OK);

    kvo_transfer retry = onboard(&r, r.h, 2);
    KVT_EQ(of_pump(r.p, &r.clock, retry, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, retry).transferred, 2);
    kvo_transfer_release(r.p, retry);
    rig_close(&r);
}

/* The same through the threaded pipeline and a memcpy backend with two workers. */
static void test_onboard_threaded(void)
{
    rig r;
    rig_open_with(&r, 32, KVO_MODE_THREADS, 2);
    kvo_transfer t = onboard(&r, r.h, MAXN);
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_wait(r.p, t, 10000000, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_COMPLETE);
    kvb_block got[MAXN];
    size_t n = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, MAXN, &n), KVO_OK);
    KVT_EQ(n, MAXN);
    size_t good = 0;
    for (size_t i = 0; i < n; i++) good += of_bytes_ok(r.g1, got[i], r.h[i]);
    KVT_EQ(good, MAXN);
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* Two requests with the same prefix onboarded in one step: the second joins the first's copies and
 * loads only its own tail; each block moves once, both get the same G1 blocks with the right bytes. */
static void test_same_prefix_in_one_step_moves_each_block_once(void)
{
    rig r;
    rig_open(&r);
    kvo_transfer a = onboard(&r, r.h, 6), b = onboard(&r, r.h, 8); /* b: the same 6, then 2 more */
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, b, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_backend_copies(r.w), 8);
    for (size_t i = 0; i < 8; i++) KVT_EQ(of_backend_saw_src(r.w, r.g2, kvb_block_index(r.in_g2[i].id)), 1);
    kvo_transfer_info ia = of_info(r.p, a), ib = of_info(r.p, b);
    KVT_EQ(ia.transferred, 6);
    KVT_EQ(ia.joined, 0);
    KVT_EQ(ib.transferred, 2);
    KVT_EQ(ib.joined, 6);
    KVT_EQ(ib.present, 0);
    kvo_pipeline_stats ps;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &ps), KVO_OK);
    KVT_EQ(ps.joined, 6);
    KVT_EQ(ps.transferred, 8);
    kvb_block ga[8], gb[8];
    size_t na = 0, nb = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, a, ga, 8, &na), KVO_OK);
    KVT_EQ(kvo_transfer_take_blocks(r.p, b, gb, 8, &nb), KVO_OK);
    KVT_EQ(na, 6);
    KVT_EQ(nb, 8);
    for (size_t i = 0; i < nb; i++) {
        if (i < na) KVT_EQ(kvb_block_index(gb[i].id), kvb_block_index(ga[i].id));
        KVT_EQ(of_refs(r.g1, gb[i].id), i < na ? 2 : 1);
        KVT_CHECK(of_hash_eq(of_hash_of(r.g1, gb[i].id), r.h[i]));
        KVT_CHECK(of_bytes_ok(r.g1, gb[i], r.h[i]));
    }
    KVT_EQ(kvb_release(r.g1, ga, na, NULL), KVB_OK);
    KVT_EQ(kvb_release(r.g1, gb, nb, NULL), KVB_OK);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    rig_close(&r);
}

/* The copy a request joined fails: that request loads the block itself once the failed transfer is
 * over, and takes the one that did land. */
static void test_joined_copy_that_fails_is_loaded_again(void)
{
    rig r;
    rig_open(&r);
    of_backend_set_fail(r.w, 1, KVO_EIO); /* the first copy (h[0] for a) fails */
    kvo_transfer a = onboard(&r, r.h, 2), b = onboard(&r, r.h, 2);
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 200), KVO_STATUS_FAILED);
    KVT_EQ(of_pump(r.p, &r.clock, b, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info ib = of_info(r.p, b);
    KVT_EQ(ib.transferred, 1);
    KVT_EQ(ib.joined, 1);
    KVT_EQ(of_backend_copies(r.w), 3);
    kvb_block got[2];
    size_t n = 0;
    KVT_EQ(kvo_transfer_take_blocks(r.p, b, got, 2, &n), KVO_OK);
    KVT_EQ(n, 2);
    for (size_t i = 0; i < n; i++) KVT_CHECK(of_bytes_ok(r.g1, got[i], r.h[i]));
    KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    rig_close(&r);
}

/* A joined block whose copy failed and that is gone from the source too fails without ever having been
 * counted in flight: finishing its transfer must not take one off the count of another transfer's copy
 * of the same hash, or a third request would copy that block again instead of joining. */
static void test_failed_join_leaves_other_copies_in_flight(void)
{
    rig r;
    rig_open(&r);
    kvb_hash h0 = r.h[0], a_hashes[2] = {r.h[5], r.h[0]};
    of_backend_set_fail(r.w, 1, KVO_EIO);          /* b's copy of h0 fails */
    kvo_transfer b = onboard(&r, &h0, 1);
    kvo_transfer a = onboard(&r, a_hashes, 2);      /* h5 loaded, h0 joins b */
    KVT_EQ(kvo_pipeline_poll(r.p), KVO_OK);         /* b runs and fails; a still waits for the join */
    KVT_EQ(of_status(r.p, b), KVO_STATUS_FAILED);
    size_t dropped = 0;
    KVT_EQ(kvb_invalidate(r.g2, &h0, 1, &dropped), KVB_OK); /* h0 leaves the source */
    KVT_EQ(dropped, 1);
    of_backend_set_hold(r.w, 1);
    KVT_EQ(kvo_pipeline_poll(r.p), KVO_OK);         /* a: h0 failed (nowhere), h5 goes to the backend */
    KVT_EQ(of_backend_held(r.w), 1);
    of_register(r.g2, &h0, 1, NULL, NULL);          /* h0 comes back to the source */
    kvo_transfer c = onboard(&r, &h0, 1);           /* c loads it: h0 in flight */
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);                        /* a finishes */
    KVT_EQ(of_status(r.p, a), KVO_STATUS_FAILED);
    KVT_EQ(of_info(r.p, a).error, KVO_ENOTFOUND);   /* failed says why: h0 is nowhere (was KVO_OK) */
    kvo_transfer d = onboard(&r, &h0, 1);           /* must join c's copy */
    KVT_EQ(of_pump(r.p, &r.clock, c, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, d, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info id = of_info(r.p, d);
    KVT_EQ(id.joined, 1);
    KVT_EQ(id.transferred, 0);
    KVT_EQ(of_backend_copies(r.w), 3);              /* b's h0, a's h5, c's h0: never a second h0 */
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    kvo_transfer_release(r.p, c);
    kvo_transfer_release(r.p, d);
    rig_close(&r);
}

/* Two requests that each wait for the other's copy: a loads h0 and joins h1 from b0, whose copy fails;
 * c then loads h1 itself (nothing brings it any more) and joins a's h0. a waits for c's h1 and c for
 * a's h0, both in the precondition stage: neither ever reached the backend, and both hung in Queued. */
static void test_requests_joining_each_other_end(void)
{
    rig r;
    rig_open(&r);
    of_backend_set_hold(r.w, 1);
    of_backend_set_fail(r.w, 1, KVO_EIO);           /* b0's copy of h1 fails */
    kvo_transfer b0 = onboard(&r, &r.h[1], 1);
    KVT_EQ(kvo_pipeline_poll(r.p), KVO_OK);         /* b0 in the backend, held */
    KVT_EQ(of_backend_held(r.w), 1);
    kvo_transfer a = onboard(&r, r.h, 2);           /* h0 loaded, h1 joins b0 */
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);                        /* b0 fails */
    KVT_EQ(of_status(r.p, b0), KVO_STATUS_FAILED);
    kvo_transfer c = onboard(&r, r.h, 2);           /* h0 joins a, h1 loaded */
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, c, 1000, 200), KVO_STATUS_COMPLETE);
    for (int k = 0; k < 2; k++) {
        kvo_transfer t = k ? c : a;
        kvb_block got[2];
        size_t n = 0;
        if (kvo_transfer_take_blocks(r.p, t, got, 2, &n) != KVO_OK) continue;
        KVT_EQ(n, 2);
        for (size_t i = 0; i < n; i++) KVT_CHECK(of_bytes_ok(r.g1, got[i], r.h[i]));
        KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    }
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b0);
    kvo_transfer_release(r.p, c);
    rig_close(&r);
}

/* One request names h0 twice while another's copy of it is in flight: both places join that copy. The
 * copy fails; the request loads h0 itself once, and its second place must not become a second copy of
 * the same hash (it waited on its own load, and the join-cycle breaker copied h0 again). */
static void test_repeated_join_after_failed_copy_copies_once(void)
{
    rig r;
    rig_open(&r);
    of_backend_set_hold(r.w, 1);
    of_backend_set_fail(r.w, 1, KVO_EIO);           /* b0's copy of h0 fails */
    kvo_transfer b0 = onboard(&r, &r.h[0], 1);
    KVT_EQ(kvo_pipeline_poll(r.p), KVO_OK);         /* b0 in the backend, held */
    KVT_EQ(of_backend_held(r.w), 1);
    kvb_hash rep[2] = {r.h[0], r.h[0]};
    kvo_transfer a = onboard(&r, rep, 2);           /* both join b0 */
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);                        /* b0 fails */
    KVT_EQ(of_status(r.p, b0), KVO_STATUS_FAILED);
    kvo_status sa = of_pump(r.p, &r.clock, a, 1000, 200);
    KVT_CHECK(of_final(sa));
    KVT_EQ(of_backend_copies(r.w), 2);              /* b0's failed h0 and a's: never a third */
    KVT_EQ(of_backend_saw_src(r.w, r.g2, kvb_block_index(r.in_g2[0].id)), 2);
    kvb_block got[2];
    size_t n = 0;
    if (sa == KVO_STATUS_COMPLETE) {
        KVT_EQ(kvo_transfer_take_blocks(r.p, a, got, 2, &n), KVO_OK);
        for (size_t i = 0; i < n; i++) KVT_CHECK(of_bytes_ok(r.g1, got[i], r.h[0]));
        KVT_EQ(kvb_release(r.g1, got, n, NULL), KVB_OK);
    }
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b0);
    rig_close(&r);
}

int main(void)
{
    of_watchdog(120);
    KVT_RUN(test_onboard_loads_and_registers);
    KVT_RUN(test_destroy_releases_what_transfers_hold);
    KVT_RUN(test_small_load_goes_at_once);
    KVT_RUN(test_loads_share_batches_while_the_backend_is_busy);
    KVT_RUN(test_onboard_present_block_is_returned);
    KVT_RUN(test_miss_ends_the_prefix);
    KVT_RUN(test_take_cancel_and_release_rules);
    KVT_RUN(test_take_at_most_max);
    KVT_RUN(test_full_destination);
    KVT_RUN(test_onboard_threaded);
    KVT_RUN(test_same_prefix_in_one_step_moves_each_block_once);
    KVT_RUN(test_joined_copy_that_fails_is_loaded_again);
    KVT_RUN(test_failed_join_leaves_other_copies_in_flight);
    KVT_RUN(test_requests_joining_each_other_end);
    KVT_RUN(test_repeated_join_after_failed_copy_copies_once);
    KVT_RUN(test_present_block_is_held_not_used);
    KVT_RUN(test_untaken_blocks_go_back_deepest_first);
    return kvt_summary();
}
