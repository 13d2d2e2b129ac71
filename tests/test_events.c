/* Events of kvblock.h: STORED when a hash becomes present, REMOVED when it stops being present, with
 * hash, parent, tier and token count, delivered in one batch per public call. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

enum { TIER = 1 };

static kvb_pool *pool_with_events(uint32_t num_blocks, fx_events *rec)
{
    kvb_pool_config cfg = fx_config(num_blocks);
    cfg.tier = TIER;
    cfg.on_events = fx_record_events;
    cfg.event_user = rec;
    fx_events_clear(rec);
    return fx_pool_from(&cfg);
}

#define CHECK_EVENT(e, kind_, hash_, parent_)             \
    do {                                                  \
        KVT_EQ((e).kind, (kind_));                        \
        KVT_EQ((e).tier, TIER);                           \
        KVT_EQ((e).num_tokens, 16);                       \
        FX_HASH_EQ((e).hash, (hash_));                    \
        FX_HASH_EQ((e).parent, (parent_));                \
    } while (0)

static void test_register_reports_stored_in_one_batch(void)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(8, &rec);
    uint32_t tokens[48];
    fx_iota(tokens, 48, 10);
    kvb_hash h[3];
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(tokens, 48, 16, NULL, 0, 0, h, 3, &n), KVB_OK);
    kvb_block b[3] = {{0}};
    KVT_EQ(kvb_alloc(pool, 3, b), KVB_OK);
    for (int i = 0; i < 3; i++) fx_fill_block(pool, b[i], i ? &h[i - 1] : NULL, 0, tokens + 16 * i);
    KVT_EQ(rec.n, 0); /* nothing is present before registration */

    KVT_EQ(kvb_register(pool, b, 3, b), KVB_OK);
    KVT_EQ(rec.calls, 1);
    KVT_EQ(rec.n, 3);
    CHECK_EVENT(rec.ev[0], KVB_EVENT_STORED, h[0], fx_hash(0, 0));
    CHECK_EVENT(rec.ev[1], KVB_EVENT_STORED, h[1], h[0]);
    CHECK_EVENT(rec.ev[2], KVB_EVENT_STORED, h[2], h[1]);

    fx_events_clear(&rec);
    KVT_EQ(kvb_release(pool, b, 3, NULL), KVB_OK); /* inactive: still present, nothing to say */
    KVT_EQ(rec.n, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_import_reports_given_parents(void)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(8, &rec);
    kvb_hash h[2] = {fx_hash(0x100, 1), fx_hash(0x200, 2)}, parents[2] = {fx_hash(0x99, 9), fx_hash(0x100, 1)};
    kvb_block b[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    fx_import(pool, b, 2, h, parents);
    KVT_EQ(rec.calls, 1);
    KVT_EQ(rec.n, 2);
    CHECK_EVENT(rec.ev[0], KVB_EVENT_STORED, h[0], parents[0]);
    CHECK_EVENT(rec.ev[1], KVB_EVENT_STORED, h[1], parents[1]);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_sequence_commit_reports_full_blocks(void)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(8, &rec);
    uint32_t tokens[53];
    fx_iota(tokens, 53, 3);
    kvb_hash h[3];
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(tokens, 53, 16, NULL, 0, 0, h, 3, &n), KVB_OK);
    kvb_seq *seq = NULL;
    KVT_EQ(kvb_seq_create(pool, NULL, &seq), KVB_OK);
    KVT_EQ(kvb_seq_append(seq, tokens, 53, NULL), KVB_OK);
    KVT_EQ(rec.n, 0);

    KVT_EQ(kvb_seq_commit(seq, 53), KVB_OK);
    KVT_EQ(rec.calls, 1);
    KVT_EQ(fx_events_count(&rec, KVB_EVENT_STORED), 3);
    KVT_EQ(rec.n, 3);
    for (size_t i = 0; i < 3 && i < rec.n; i++)
        CHECK_EVENT(rec.ev[i], KVB_EVENT_STORED, h[i], i ? h[i - 1] : fx_hash(0, 0));
    kvb_seq_destroy(seq);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_eviction_reports_removed_in_one_batch(void)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(3, &rec);
    kvb_hash h[3] = {fx_hash(1, 1), fx_hash(2, 2), fx_hash(3, 3)}, parents[3] = {{0, 0}, {0, 0}, {0, 0}};
    kvb_block b[3] = {{0}};
    KVT_EQ(kvb_alloc(pool, 3, b), KVB_OK);
    fx_import(pool, b, 3, h, parents);
    KVT_EQ(kvb_release(pool, b, 3, NULL), KVB_OK);
    fx_events_clear(&rec);

    kvb_block fresh[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, fresh), KVB_OK);
    KVT_EQ(rec.calls, 1);
    KVT_EQ(rec.n, 2);
    KVT_EQ(fx_events_count(&rec, KVB_EVENT_REMOVED), 2);
    size_t still = 0;
    for (size_t i = 0; i < rec.n; i++) {
        KVT_EQ(rec.ev[i].tier, TIER);
        KVT_EQ(rec.ev[i].num_tokens, 16);
        KVT_EQ(fx_lookup(pool, &rec.ev[i].hash, 1), 0); /* what was reported gone is gone */
    }
    for (int i = 0; i < 3; i++) still += fx_lookup(pool, &h[i], 1);
    KVT_EQ(still, 1);
    KVT_EQ(kvb_release(pool, fresh, 2, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* With duplicates allowed, a hash stays present while any of its blocks is cached. */
static void test_duplicate_hash_present_until_last_copy_goes(void)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(2, &rec);
    uint32_t tokens[16];
    fx_iota(tokens, 16, 77);
    kvb_hash h = kvb_hash_block(NULL, tokens, 16, NULL, 0, 0);
    kvb_block b[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    fx_fill_block(pool, b[0], NULL, 0, tokens);
    fx_fill_block(pool, b[1], NULL, 0, tokens);
    KVT_EQ(kvb_register(pool, &b[0], 1, &b[0]), KVB_OK);
    KVT_EQ(kvb_register(pool, &b[1], 1, &b[1]), KVB_OK);
    KVT_EQ(fx_events_count(&rec, KVB_EVENT_STORED), 1); /* the hash became present once */
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);

    fx_events_clear(&rec);
    kvb_block fresh[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 1, &fresh[0]), KVB_OK);
    KVT_EQ(rec.n, 0); /* one copy left */
    KVT_EQ(fx_lookup(pool, &h, 1), 1);
    KVT_EQ(kvb_alloc(pool, 1, &fresh[1]), KVB_OK);
    KVT_EQ(rec.n, 1);
    CHECK_EVENT(rec.ev[0], KVB_EVENT_REMOVED, h, fx_hash(0, 0));
    KVT_EQ(fx_lookup(pool, &h, 1), 0);
    KVT_EQ(kvb_release(pool, fresh, 2, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* Calls that neither store nor remove a hash do not call back with anything. */
static void test_quiet_calls_report_nothing(void)
{
    fx_events rec;
    kvb_pool *pool = pool_with_events(4, &rec);
    kvb_block b[2] = {{0}}, hit = {0};
    kvb_hash h = fx_hash(5, 5);
    size_t n = 0;
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    KVT_EQ(kvb_retain(pool, b, 2), KVB_OK);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    fx_import(pool, &b[0], 1, &h, NULL);
    size_t calls_before = rec.calls;
    KVT_EQ(kvb_match(pool, &h, 1, &hit, &n), KVB_OK);
    KVT_EQ(fx_lookup(pool, &h, 1), 1);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &hit, 1, NULL), KVB_OK);
    KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
    KVT_EQ(rec.n, 1); /* only the import's STORED */
    KVT_EQ(rec.calls, calls_before);
    kvb_pool_destroy(pool);
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_register_reports_stored_in_one_batch);
    KVT_RUN(test_import_reports_given_parents);
    KVT_RUN(test_sequence_commit_reports_full_blocks);
    KVT_RUN(test_eviction_reports_removed_in_one_batch);
    KVT_RUN(test_duplicate_hash_present_until_last_copy_goes);
    KVT_RUN(test_quiet_calls_report_nothing);
    return kvt_summary();
}
