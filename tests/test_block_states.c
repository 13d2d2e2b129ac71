/* The block lifecycle of kvblock.h: every transition in the manual's table works, every other
 * (state, call) pair is refused with KVB_ESTATE and changes nothing. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

enum { NUM_BLOCKS = 32 };

static const kvb_block_state ALL_STATES[] = {
    KVB_STATE_EMPTY, KVB_STATE_PARTIAL, KVB_STATE_READY,
    KVB_STATE_INFLIGHT, KVB_STATE_COMPLETE, KVB_STATE_REGISTERED,
};

typedef enum call {
    CALL_INIT, CALL_ADD_TOKENS, CALL_SCHEDULE, CALL_CANCEL, CALL_COMPUTE_DONE, CALL_REGISTER,
    CALL_REGISTER_HASHED, CALL__COUNT
} call;

static const char *const CALL_NAMES[CALL__COUNT] = {
    "init", "add_tokens", "schedule", "cancel_schedule", "compute_done", "register", "register_hashed",
};

/* The manual's table: the one call (or two) that leaves each state. */
static int is_legal(kvb_block_state from, call c)
{
    switch (from) {
    case KVB_STATE_EMPTY: return c == CALL_INIT || c == CALL_REGISTER_HASHED;
    case KVB_STATE_PARTIAL: return c == CALL_ADD_TOKENS;
    case KVB_STATE_READY: return c == CALL_SCHEDULE || c == CALL_CANCEL;
    case KVB_STATE_INFLIGHT: return c == CALL_COMPUTE_DONE;
    case KVB_STATE_COMPLETE: return c == CALL_REGISTER;
    default: return 0;
    }
}

static uint32_t TOKENS[16] = {
    100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115,
};

/* A fresh block driven to `state` along the shortest path of the table (5 tokens when not full). */
static kvb_block block_in_state(kvb_pool *pool, kvb_block_state state)
{
    kvb_block b = {0};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    if (state == KVB_STATE_EMPTY) return b;
    KVT_EQ(kvb_block_init(pool, b, NULL, 0, NULL, 0), KVB_OK);
    if (state == KVB_STATE_PARTIAL) {
        KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS, 5, 0), KVB_OK);
        return b;
    }
    int full = state == KVB_STATE_COMPLETE || state == KVB_STATE_REGISTERED;
    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS, full ? 16 : 5, 1), KVB_OK);
    if (state == KVB_STATE_READY) return b;
    KVT_EQ(kvb_block_schedule(pool, b), KVB_OK);
    if (state == KVB_STATE_INFLIGHT) return b;
    KVT_EQ(kvb_block_compute_done(pool, b), KVB_OK);
    if (state == KVB_STATE_COMPLETE) return b;
    KVT_EQ(kvb_register(pool, &b, 1, &b), KVB_OK);
    return b;
}

/* Arguments that would be valid in the legal state, so only the state can make the call fail.
 * add_tokens adds no token and asks for compute: legal from Partial, never out of range. */
static kvb_result do_call(kvb_pool *pool, kvb_block b, call c)
{
    kvb_hash h = fx_hash(0x1234, 0x5678);
    kvb_block out = {0};
    switch (c) {
    case CALL_INIT: return kvb_block_init(pool, b, NULL, 0, NULL, 0);
    case CALL_ADD_TOKENS: return kvb_block_add_tokens(pool, b, TOKENS, 0, 1);
    case CALL_SCHEDULE: return kvb_block_schedule(pool, b);
    case CALL_CANCEL: return kvb_block_cancel_schedule(pool, b);
    case CALL_COMPUTE_DONE: return kvb_block_compute_done(pool, b);
    case CALL_REGISTER: return kvb_register(pool, &b, 1, &out);
    case CALL_REGISTER_HASHED: return kvb_register_hashed(pool, &b, 1, &h, NULL, &out);
    default: return KVB_EINVAL;
    }
}

static void test_states_reached_by_helper(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    for (size_t s = 0; s < sizeof ALL_STATES / sizeof ALL_STATES[0]; s++) {
        kvb_block b = block_in_state(pool, ALL_STATES[s]);
        KVT_EQ(fx_info(pool, b.id).state, ALL_STATES[s]);
        KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    }
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_every_other_transition_is_refused(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    for (size_t s = 0; s < sizeof ALL_STATES / sizeof ALL_STATES[0]; s++) {
        for (int c = 0; c < CALL__COUNT; c++) {
            if (is_legal(ALL_STATES[s], (call)c)) continue;
            kvb_block b = block_in_state(pool, ALL_STATES[s]);
            kvb_block_info before = fx_info(pool, b.id);
            kvb_pool_stats stats_before = fx_stats(pool);

            kvb_result r = do_call(pool, b, (call)c);

            kvb_block_info after = fx_info(pool, b.id);
            kvb_pool_stats stats_after = fx_stats(pool);
            if (r != KVB_ESTATE)
                fprintf(stderr, "  state %d, call %s: got %s\n", (int)ALL_STATES[s], CALL_NAMES[c],
                        kvb_result_string(r));
            KVT_EQ(r, KVB_ESTATE);
            KVT_CHECK(fx_info_equal(&before, &after));
            KVT_CHECK(fx_stats_equal(&stats_before, &stats_after));
            FX_CHECK_POOL(pool);
            KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
        }
    }
    kvb_pool_destroy(pool);
}

/* Walks every legal transition once, checking state and token count after each. */
static void test_every_legal_transition(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    kvb_hash parent = fx_hash(11, 22);
    uint64_t extra[1] = {42};
    kvb_block b = {0};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    kvb_block_info info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_EMPTY);
    KVT_EQ(info.refs, 1);
    KVT_EQ(info.num_tokens, 0);

    KVT_EQ(kvb_block_init(pool, b, &parent, 3, extra, 1), KVB_OK);
    info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_PARTIAL);
    FX_HASH_EQ(info.parent, parent);

    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS, 5, 0), KVB_OK);
    info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_PARTIAL);
    KVT_EQ(info.num_tokens, 5);

    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS, 0, 1), KVB_OK); /* decode step: compute what is there */
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_READY);
    KVT_EQ(kvb_block_cancel_schedule(pool, b), KVB_OK);
    info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_PARTIAL);
    KVT_EQ(info.num_tokens, 5);

    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS + 5, 3, 1), KVB_OK);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_READY);
    KVT_EQ(kvb_block_schedule(pool, b), KVB_OK);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_INFLIGHT);
    KVT_EQ(kvb_block_compute_done(pool, b), KVB_OK);
    info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_PARTIAL); /* 8 of 16 tokens: not full */
    KVT_EQ(info.num_tokens, 8);

    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS + 8, 8, 0), KVB_OK);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_READY); /* full: ready whatever the flag */
    KVT_EQ(kvb_block_schedule(pool, b), KVB_OK);
    KVT_EQ(kvb_block_compute_done(pool, b), KVB_OK);
    info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_COMPLETE);
    KVT_EQ(info.num_tokens, 16);

    kvb_block out = {0};
    KVT_EQ(kvb_register(pool, &b, 1, &out), KVB_OK);
    KVT_EQ(out.id, b.id);
    info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_REGISTERED);
    KVT_EQ(info.refs, 1);
    FX_HASH_EQ(info.hash, kvb_hash_block(&parent, TOKENS, 16, extra, 1, 3));
    FX_HASH_EQ(info.parent, parent);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 1);
    KVT_EQ(st.free_blocks, NUM_BLOCKS - 1);
    KVT_EQ(st.active_blocks, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_ready_flag(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    kvb_block b = block_in_state(pool, KVB_STATE_EMPTY);
    KVT_EQ(kvb_block_init(pool, b, NULL, 0, NULL, 0), KVB_OK);

    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS, 0, 0), KVB_OK); /* nothing added, nothing asked */
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_PARTIAL);
    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS, 10, 0), KVB_OK);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_PARTIAL);
    KVT_EQ(kvb_block_add_tokens(pool, b, TOKENS + 10, 6, 0), KVB_OK); /* fills it: ready regardless */
    kvb_block_info info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_READY);
    KVT_EQ(info.num_tokens, 16);

    kvb_block c = block_in_state(pool, KVB_STATE_PARTIAL); /* 5 tokens */
    KVT_EQ(kvb_block_add_tokens(pool, c, TOKENS + 5, 2, 1), KVB_OK);
    info = fx_info(pool, c.id);
    KVT_EQ(info.state, KVB_STATE_READY);
    KVT_EQ(info.num_tokens, 7);

    kvb_block d = block_in_state(pool, KVB_STATE_PARTIAL);
    KVT_EQ(kvb_block_add_tokens(pool, d, TOKENS, 11, 1), KVB_OK); /* exactly full with ready = 1 */
    KVT_EQ(fx_info(pool, d.id).state, KVB_STATE_READY);
    KVT_EQ(kvb_block_schedule(pool, d), KVB_OK);
    KVT_EQ(kvb_block_compute_done(pool, d), KVB_OK);
    KVT_EQ(fx_info(pool, d.id).state, KVB_STATE_COMPLETE);

    kvb_block all[3] = {b, c, d};
    KVT_EQ(kvb_release(pool, all, 3, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_add_tokens_past_capacity(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    uint32_t many[17];
    fx_iota(many, 17, 1);

    kvb_block b = block_in_state(pool, KVB_STATE_EMPTY);
    KVT_EQ(kvb_block_init(pool, b, NULL, 0, NULL, 0), KVB_OK);
    KVT_EQ(kvb_block_add_tokens(pool, b, many, 17, 0), KVB_ERANGE);
    kvb_block_info info = fx_info(pool, b.id);
    KVT_EQ(info.state, KVB_STATE_PARTIAL);
    KVT_EQ(info.num_tokens, 0);

    KVT_EQ(kvb_block_add_tokens(pool, b, many, 10, 0), KVB_OK);
    kvb_block_info before = fx_info(pool, b.id);
    KVT_EQ(kvb_block_add_tokens(pool, b, many, 7, 0), KVB_ERANGE); /* 10 + 7 > 16 */
    KVT_EQ(kvb_block_add_tokens(pool, b, many, 7, 1), KVB_ERANGE);
    kvb_block_info after = fx_info(pool, b.id);
    KVT_CHECK(fx_info_equal(&before, &after));
    KVT_EQ(after.num_tokens, 10);

    /* the refused tokens were not half-added: filling up with 6 gives the hash of the 16 tokens */
    KVT_EQ(kvb_block_add_tokens(pool, b, many + 10, 6, 0), KVB_OK);
    KVT_EQ(kvb_block_schedule(pool, b), KVB_OK);
    KVT_EQ(kvb_block_compute_done(pool, b), KVB_OK);
    KVT_EQ(kvb_register(pool, &b, 1, &b), KVB_OK);
    FX_HASH_EQ(fx_info(pool, b.id).hash, kvb_hash_block(NULL, many, 16, NULL, 0, 0));
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_too_many_extra_keys_refused(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    uint64_t extra[KVB_MAX_EXTRA_KEYS + 1] = {0};
    kvb_block b = block_in_state(pool, KVB_STATE_EMPTY);
    KVT_CHECK(kvb_block_init(pool, b, NULL, 0, extra, KVB_MAX_EXTRA_KEYS + 1) != KVB_OK);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_EMPTY);
    KVT_EQ(kvb_block_init(pool, b, NULL, 0, extra, KVB_MAX_EXTRA_KEYS), KVB_OK);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_PARTIAL);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_register_complete_blocks_in_one_call(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    uint32_t tokens[32];
    fx_iota(tokens, 32, 500);
    kvb_block b[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    kvb_hash h0 = kvb_hash_block(NULL, tokens, 16, NULL, 0, 9);
    fx_fill_block(pool, b[0], NULL, 9, tokens);
    fx_fill_block(pool, b[1], &h0, 9, tokens + 16);

    kvb_block out[2] = {{0}};
    KVT_EQ(kvb_register(pool, b, 2, out), KVB_OK);
    KVT_EQ(out[0].id, b[0].id); /* no duplicate: each block stands for itself */
    KVT_EQ(out[1].id, b[1].id);
    kvb_block_info i0 = fx_info(pool, b[0].id), i1 = fx_info(pool, b[1].id);
    KVT_EQ(i0.state, KVB_STATE_REGISTERED);
    KVT_EQ(i1.state, KVB_STATE_REGISTERED);
    FX_HASH_EQ(i0.hash, h0);
    FX_HASH_EQ(i1.parent, h0);
    FX_HASH_EQ(i1.hash, kvb_hash_block(&h0, tokens + 16, 16, NULL, 0, 9));
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.registrations, 2);
    KVT_EQ(st.cached_hashes, 2);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_register_hashed_from_empty(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    kvb_block b[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    kvb_hash hashes[2] = {fx_hash(0xa1, 0xa2), fx_hash(0xb1, 0xb2)};
    kvb_hash parents[2] = {fx_hash(0, 0), fx_hash(0xa1, 0xa2)};
    kvb_block out[2] = {{0}};
    KVT_EQ(kvb_register_hashed(pool, b, 2, hashes, parents, out), KVB_OK);
    for (int i = 0; i < 2; i++) {
        kvb_block_info info = fx_info(pool, b[i].id);
        KVT_EQ(out[i].id, b[i].id);
        KVT_EQ(info.state, KVB_STATE_REGISTERED);
        KVT_EQ(info.num_tokens, 16); /* an imported block counts block_tokens tokens */
        FX_HASH_EQ(info.hash, hashes[i]);
        FX_HASH_EQ(info.parent, parents[i]);
    }
    KVT_EQ(fx_lookup(pool, hashes, 2), 2);

    kvb_block c = {0};
    kvb_hash h = fx_hash(0xc1, 0xc2);
    KVT_EQ(kvb_alloc(pool, 1, &c), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, &c, 1, &h, NULL, &c), KVB_OK); /* parents NULL: a root */
    FX_HASH_EQ(fx_info(pool, c.id).parent, fx_hash(0, 0));
    KVT_EQ(fx_stats(pool).registrations, 3);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &c, 1, NULL), KVB_OK);
    KVT_EQ(fx_stats(pool).inactive_blocks, 3);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* One block in the wrong state refuses the whole array. */
static void test_register_is_all_or_nothing(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    kvb_block pair[2] = {block_in_state(pool, KVB_STATE_COMPLETE), block_in_state(pool, KVB_STATE_PARTIAL)};
    kvb_block out[2] = {{0}};
    kvb_pool_stats before = fx_stats(pool);
    KVT_EQ(kvb_register(pool, pair, 2, out), KVB_ESTATE);
    KVT_EQ(fx_info(pool, pair[0].id).state, KVB_STATE_COMPLETE);
    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));

    kvb_block empties[2] = {block_in_state(pool, KVB_STATE_EMPTY), block_in_state(pool, KVB_STATE_READY)};
    kvb_hash h[2] = {fx_hash(1, 2), fx_hash(3, 4)};
    before = fx_stats(pool);
    KVT_EQ(kvb_register_hashed(pool, empties, 2, h, NULL, out), KVB_ESTATE);
    KVT_EQ(fx_info(pool, empties[0].id).state, KVB_STATE_EMPTY);
    after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_lookup(pool, h, 1), 0);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, pair, 2, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, empties, 2, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

/* The last reference to a block that is not Registered returns it to the free set. */
static void test_unregistered_block_returns_to_free(void)
{
    kvb_pool *pool = fx_pool(NUM_BLOCKS);
    kvb_block_state states[] = {KVB_STATE_EMPTY, KVB_STATE_PARTIAL, KVB_STATE_READY, KVB_STATE_INFLIGHT,
                                KVB_STATE_COMPLETE};
    for (size_t s = 0; s < sizeof states / sizeof states[0]; s++) {
        kvb_block b = block_in_state(pool, states[s]);
        KVT_EQ(fx_stats(pool).active_blocks, 1);
        KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
        kvb_pool_stats st = fx_stats(pool);
        KVT_EQ(st.free_blocks, NUM_BLOCKS);
        KVT_EQ(st.active_blocks, 0);
        KVT_EQ(st.inactive_blocks, 0);
        FX_CHECK_POOL(pool);
    }
    kvb_pool_destroy(pool);
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_states_reached_by_helper);
    KVT_RUN(test_every_legal_transition);
    KVT_RUN(test_every_other_transition_is_refused);
    KVT_RUN(test_ready_flag);
    KVT_RUN(test_add_tokens_past_capacity);
    KVT_RUN(test_too_many_extra_keys_refused);
    KVT_RUN(test_register_complete_blocks_in_one_call);
    KVT_RUN(test_register_hashed_from_empty);
    KVT_RUN(test_register_is_all_or_nothing);
    KVT_RUN(test_unregistered_block_returns_to_free);
    return kvt_summary();
}
