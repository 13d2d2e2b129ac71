/* Handles of kvblock.h: stale strong handles, weak handles and their upgrade, double release, and
 * bad arguments — each refused with its result, changing nothing, leaving a consistent pool. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

/* One block, registered under `h` and released: inactive, cached. */
static kvb_block cached_block(kvb_pool *pool, kvb_hash h)
{
    kvb_block b = {0};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    fx_import(pool, &b, 1, &h, NULL);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    return b;
}

static void test_stale_handle_after_reuse(void)
{
    kvb_pool *pool = fx_pool(1); /* one block: the second allocation must reuse it */
    kvb_block old = {0}, now = {0};
    KVT_EQ(kvb_alloc(pool, 1, &old), KVB_OK);
    KVT_EQ(kvb_release(pool, &old, 1, NULL), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &now), KVB_OK);
    KVT_EQ(kvb_block_index(old.id), kvb_block_index(now.id));
    KVT_CHECK(old.id != now.id); /* same index, new generation */

    kvb_block_info info;
    kvb_block out = {0};
    void *data = NULL;
    KVT_EQ(kvb_block_get_info(pool, old.id, &info), KVB_ESTALE);
    KVT_EQ(kvb_block_init(pool, old, NULL, 0, NULL, 0), KVB_ESTALE);
    KVT_EQ(kvb_block_schedule(pool, old), KVB_ESTALE);
    KVT_EQ(kvb_retain(pool, &old, 1), KVB_ESTALE);
    KVT_EQ(kvb_release(pool, &old, 1, NULL), KVB_ESTALE);
    KVT_EQ(kvb_register(pool, &old, 1, &out), KVB_ESTALE);
    KVT_CHECK(kvb_block_data(pool, old, 0, 0, &data) != KVB_OK);

    info = fx_info(pool, now.id); /* the new owner is untouched */
    KVT_EQ(info.state, KVB_STATE_EMPTY);
    KVT_EQ(info.refs, 1);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, &now, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_weak_upgrade_while_active(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_block b = {0}, up = {0};
    kvb_hash h = fx_hash(1, 2);
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    fx_import(pool, &b, 1, &h, NULL);
    kvb_weak w = kvb_weak_of(b);
    KVT_CHECK((w.id & KVB_WEAK_BIT) != 0);
    KVT_EQ(kvb_block_index(w.id), kvb_block_index(b.id));
    KVT_EQ(fx_info(pool, w.id).refs, 1); /* a weak handle is not counted */

    KVT_EQ(kvb_upgrade(pool, w, &up), KVB_OK);
    KVT_EQ(up.id, b.id);
    KVT_EQ(fx_info(pool, b.id).refs, 2);
    KVT_EQ(kvb_release(pool, &up, 1, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    KVT_EQ(fx_info(pool, w.id).refs, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* Upgrading an inactive cached block takes it off the eviction list: with it the only block of the
 * pool, a following allocation finds nothing to evict. */
static void test_weak_upgrade_of_inactive_block(void)
{
    kvb_pool *pool = fx_pool(1);
    kvb_hash h = fx_hash(3, 4);
    kvb_weak w = kvb_weak_of(cached_block(pool, h));
    KVT_EQ(fx_stats(pool).inactive_blocks, 1);

    kvb_block up = {0}, other = {0};
    KVT_EQ(kvb_upgrade(pool, w, &up), KVB_OK);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 0);
    KVT_EQ(st.active_blocks, 1);
    KVT_EQ(fx_info(pool, up.id).refs, 1);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_alloc(pool, 1, &other), KVB_ENOSPACE);
    KVT_EQ(fx_stats(pool).evictions, 0);
    KVT_EQ(fx_info(pool, up.id).state, KVB_STATE_REGISTERED);
    KVT_EQ(fx_lookup(pool, &h, 1), 1);

    KVT_EQ(kvb_release(pool, &up, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_weak_upgrade_after_eviction(void)
{
    kvb_pool *pool = fx_pool(1);
    kvb_weak w = kvb_weak_of(cached_block(pool, fx_hash(5, 6)));
    kvb_block other = {0}, up = {0};
    KVT_EQ(kvb_alloc(pool, 1, &other), KVB_OK); /* evicts the cached block and reuses its index */
    KVT_EQ(fx_stats(pool).evictions, 1);

    KVT_EQ(kvb_upgrade(pool, w, &up), KVB_EGONE);
    KVT_EQ(up.id, 0);
    kvb_block_info info;
    kvb_result r = kvb_block_get_info(pool, w.id, &info); /* a weak handle may say so as EGONE */
    KVT_CHECK(r == KVB_ESTALE || r == KVB_EGONE);
    kvb_block_info now = fx_info(pool, other.id);
    KVT_EQ(now.refs, 1);
    KVT_EQ(now.state, KVB_STATE_EMPTY);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, &other, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_weak_upgrade_after_reset(void)
{
    kvb_pool *pool = fx_pool(2);
    kvb_weak w = kvb_weak_of(cached_block(pool, fx_hash(7, 8)));
    KVT_EQ(kvb_pool_reset(pool), KVB_OK);
    kvb_block up = {0};
    KVT_EQ(kvb_upgrade(pool, w, &up), KVB_EGONE);
    KVT_EQ(fx_stats(pool).free_blocks, 2);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_upgrade_of_strong_handle_refused(void)
{
    kvb_pool *pool = fx_pool(2);
    kvb_block b = {0}, up = {0};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    kvb_weak not_weak = {b.id};
    KVT_EQ(kvb_upgrade(pool, not_weak, &up), KVB_EINVAL);
    KVT_EQ(fx_info(pool, b.id).refs, 1);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_weak_handle_where_strong_needed(void)
{
    kvb_pool *pool = fx_pool(2);
    kvb_block b = {0};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    kvb_block as_strong = {kvb_weak_of(b).id};
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_release(pool, &as_strong, 1, NULL), KVB_EWEAK);
    KVT_EQ(kvb_retain(pool, &as_strong, 1), KVB_EWEAK);
    KVT_EQ(kvb_block_init(pool, as_strong, NULL, 0, NULL, 0), KVB_EWEAK);
    kvb_block pair[2] = {b, as_strong}; /* all or nothing: b keeps its reference */
    KVT_EQ(kvb_release(pool, pair, 2, NULL), KVB_EWEAK);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    kvb_block_info info = fx_info(pool, b.id);
    KVT_EQ(info.refs, 1);
    KVT_EQ(info.state, KVB_STATE_EMPTY);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_double_release(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_hash h = fx_hash(9, 10);
    kvb_block cached = cached_block(pool, h); /* refs 0, still the same generation */
    kvb_pool_stats before = fx_stats(pool);
    KVT_EQ(kvb_release(pool, &cached, 1, NULL), KVB_EDOUBLE);
    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_info(pool, cached.id).refs, 0);
    KVT_EQ(fx_lookup(pool, &h, 1), 1);
    FX_CHECK_POOL(pool);

    /* a freed block: refused either as a double release or as stale, and nothing moves */
    kvb_block gone = {0};
    KVT_EQ(kvb_alloc(pool, 1, &gone), KVB_OK);
    KVT_EQ(kvb_release(pool, &gone, 1, NULL), KVB_OK);
    before = fx_stats(pool);
    kvb_result r = kvb_release(pool, &gone, 1, NULL);
    KVT_CHECK(r == KVB_EDOUBLE || r == KVB_ESTALE);
    after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_double_release_within_one_array(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_block b[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    kvb_block twice[3] = {b[0], b[1], b[0]}; /* b[0] holds one reference, released twice */
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_release(pool, twice, 3, NULL), KVB_EDOUBLE);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_info(pool, b[0].id).refs, 1);
    KVT_EQ(fx_info(pool, b[1].id).refs, 1);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_retain(pool, &b[0], 1), KVB_OK); /* with two references the same array is fine */
    KVT_EQ(kvb_release(pool, twice, 3, NULL), KVB_OK);
    KVT_EQ(fx_stats(pool).free_blocks, 4);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A call refused as an invalid argument leaves a consistent pool. */
#define REFUSED(call)                        \
    do {                                     \
        KVT_EQ((call), KVB_EINVAL);          \
        FX_CHECK_POOL(pool);                 \
    } while (0)

static void test_null_arguments(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_pool_config cfg = fx_config(4);
    kvb_pool *none = NULL;
    kvb_block b = {0}, out = {0};
    kvb_hash h = fx_hash(1, 1);
    size_t n = 0;
    uint32_t tok = 1;
    kvb_seq *seq = NULL;
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    kvb_pool_stats before = fx_stats(pool);

    REFUSED(kvb_pool_create(NULL, &none));
    REFUSED(kvb_pool_create(&cfg, NULL));
    KVT_CHECK(none == NULL);
    REFUSED(kvb_pool_get_stats(pool, NULL));
    kvb_pool_stats scratch;
    REFUSED(kvb_pool_get_stats(NULL, &scratch));
    REFUSED(kvb_pool_get_config(pool, NULL));
    REFUSED(kvb_pool_check(NULL, NULL, 0));
    REFUSED(kvb_pool_reset(NULL));
    REFUSED(kvb_alloc(pool, 1, NULL));
    REFUSED(kvb_alloc(NULL, 1, &out));
    REFUSED(kvb_retain(pool, NULL, 1));
    REFUSED(kvb_release(pool, NULL, 1, NULL));
    REFUSED(kvb_release(NULL, &b, 1, NULL));
    REFUSED(kvb_block_get_info(pool, b.id, NULL));
    REFUSED(kvb_block_init(pool, b, NULL, 0, NULL, 2)); /* two extra keys, no array */
    REFUSED(kvb_block_init(NULL, b, NULL, 0, NULL, 0));
    REFUSED(kvb_register(pool, NULL, 1, &out));
    REFUSED(kvb_register_hashed(pool, &b, 1, NULL, NULL, &out));
    REFUSED(kvb_register_hashed(pool, NULL, 1, &h, NULL, &out));
    REFUSED(kvb_match(pool, NULL, 1, &out, &n));
    REFUSED(kvb_match(pool, &h, 1, NULL, &n));
    REFUSED(kvb_match(pool, &h, 1, &out, NULL));
    REFUSED(kvb_lookup(pool, &h, 1, NULL));
    REFUSED(kvb_lookup(pool, NULL, 1, &n));
    REFUSED(kvb_upgrade(pool, kvb_weak_of(b), NULL));
    REFUSED(kvb_block_data(pool, b, 0, 0, NULL));
    REFUSED(kvb_pool_storage(NULL, NULL, NULL, NULL, NULL));
    REFUSED(kvb_seq_create(NULL, NULL, &seq));
    REFUSED(kvb_seq_create(pool, NULL, NULL));
    REFUSED(kvb_hash_prompt(NULL, 16, 16, NULL, 0, 0, &h, 1, &n));
    REFUSED(kvb_hash_prompt(&tok, 1, 0, NULL, 0, 0, &h, 1, &n)); /* block_tokens 0 */
    REFUSED(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, 16, 1, 1, 1, 1, NULL));
    KVT_EQ(kvb_block_init(pool, b, NULL, 0, NULL, 0), KVB_OK);
    REFUSED(kvb_block_add_tokens(pool, b, NULL, 1, 0));
    KVT_EQ(fx_info(pool, b.id).num_tokens, 0);
    KVT_EQ(kvb_alloc(pool, 0, NULL), KVB_OK); /* nothing asked: no array needed */
    KVT_EQ(kvb_release(pool, NULL, 0, NULL), KVB_OK);
    kvb_seq_destroy(NULL);  /* no-ops */
    kvb_pool_destroy(NULL);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_info(pool, b.id).refs, 1);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_out_of_range_ids(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_block held = {0};
    KVT_EQ(kvb_alloc(pool, 1, &held), KVB_OK);
    kvb_pool_stats before = fx_stats(pool);
    const uint64_t gen1 = UINT64_C(1) << 32;
    const uint64_t bad_ids[] = {
        0,              /* "none" */
        5,              /* index 4 in a pool of 4 */
        1000 | gen1,    /* far out of range, with a generation */
        UINT32_MAX,     /* the largest index */
        gen1,           /* index bits 0 ("none") with a generation */
    };
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
        kvb_block bad = {bad_ids[i]}, out = {0};
        kvb_weak weak = {bad_ids[i] | KVB_WEAK_BIT};
        kvb_block_info info;
        void *data = NULL;
        KVT_CHECK(kvb_block_get_info(pool, bad.id, &info) != KVB_OK);
        KVT_CHECK(kvb_retain(pool, &bad, 1) != KVB_OK);
        KVT_CHECK(kvb_release(pool, &bad, 1, NULL) != KVB_OK);
        KVT_CHECK(kvb_block_init(pool, bad, NULL, 0, NULL, 0) != KVB_OK);
        KVT_CHECK(kvb_block_add_tokens(pool, bad, NULL, 0, 1) != KVB_OK);
        KVT_CHECK(kvb_block_compute_done(pool, bad) != KVB_OK);
        KVT_CHECK(kvb_register(pool, &bad, 1, &out) != KVB_OK);
        KVT_CHECK(kvb_upgrade(pool, weak, &out) != KVB_OK);
        KVT_CHECK(kvb_block_data(pool, bad, 0, 0, &data) != KVB_OK);
        kvb_block pair[2] = {held, bad}; /* all or nothing */
        KVT_CHECK(kvb_release(pool, pair, 2, NULL) != KVB_OK);
        FX_CHECK_POOL(pool);
    }
    KVT_EQ(kvb_block_index(0), UINT32_MAX);
    KVT_EQ(kvb_block_index(held.id), fx_info(pool, held.id).index);
    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_info(pool, held.id).refs, 1);
    KVT_EQ(kvb_release(pool, &held, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A registration batch with one bad handle last: the exact error of that handle, nothing registered,
 * and the good blocks registrable right after (nothing left marked by the checks). */
static void test_bad_handle_last_in_a_register_batch(void)
{
    enum { N = 4 };
    kvb_pool *pool = fx_pool(16);
    kvb_block good[N], batch[N + 1], out[N + 1], other, stale, freed;
    kvb_hash h[N + 1];
    kvb_pool_stats before;
    size_t i, k;
    KVT_EQ(kvb_alloc(pool, N, good), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &other), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &stale), KVB_OK);
    KVT_EQ(kvb_release(pool, &stale, 1, NULL), KVB_OK); /* free: its generation moves on */
    KVT_EQ(kvb_alloc(pool, 1, &freed), KVB_OK);
    KVT_EQ(kvb_block_index(freed.id), kvb_block_index(stale.id)); /* the same block, reused */
    for (i = 0; i < N + 1; i++) h[i] = (kvb_hash){ 0x5000 + i, 0x9 };
    KVT_EQ(kvb_block_init(pool, other, NULL, 0, NULL, 0), KVB_OK); /* Partial: the wrong state */
    struct { kvb_block bad; kvb_result want; } cases[] = {
        { { good[1].id }, KVB_EINVAL },                      /* the same block twice */
        { { other.id }, KVB_ESTATE },                        /* not Empty */
        { { good[0].id | KVB_WEAK_BIT }, KVB_EWEAK },         /* a weak handle */
        { { 0 }, KVB_EINVAL },                               /* none */
        { { 1000 }, KVB_ERANGE },                            /* out of range */
        { { stale.id }, KVB_ESTALE },                        /* released, its block since reused */
    };
    before = fx_stats(pool);
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        for (i = 0; i < N; i++) batch[i] = good[i];
        batch[N] = cases[k].bad;
        KVT_EQ(kvb_register_hashed(pool, batch, N + 1, h, NULL, out), cases[k].want);
        for (i = 0; i < N; i++) KVT_EQ(fx_info(pool, good[i].id).state, KVB_STATE_EMPTY);
        FX_CHECK_POOL(pool);
    }
    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(kvb_register_hashed(pool, good, N, h, NULL, out), KVB_OK); /* no mark left behind */
    for (i = 0; i < N; i++) KVT_EQ(fx_info(pool, out[i].id).state, KVB_STATE_REGISTERED);
    KVT_EQ(kvb_release(pool, out, N, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &other, 1, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &freed, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_result_strings(void)
{
    KVT_EQ(strcmp(kvb_result_string(KVB_OK), "ok"), 0);
    KVT_EQ(strcmp(kvb_result_string(KVB_ESTALE), "handle refers to a block that was reused"), 0);
    KVT_EQ(strcmp(kvb_result_string(-99), "unknown result"), 0);
    KVT_EQ(strcmp(kvb_result_string(1), "unknown result"), 0);
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_stale_handle_after_reuse);
    KVT_RUN(test_weak_upgrade_while_active);
    KVT_RUN(test_weak_upgrade_of_inactive_block);
    KVT_RUN(test_weak_upgrade_after_eviction);
    KVT_RUN(test_weak_upgrade_after_reset);
    KVT_RUN(test_upgrade_of_strong_handle_refused);
    KVT_RUN(test_weak_handle_where_strong_needed);
    KVT_RUN(test_double_release);
    KVT_RUN(test_double_release_within_one_array);
    KVT_RUN(test_null_arguments);
    KVT_RUN(test_out_of_range_ids);
    KVT_RUN(test_bad_handle_last_in_a_register_batch);
    KVT_RUN(test_result_strings);
    return kvt_summary();
}
