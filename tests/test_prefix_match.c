/* Prefix caching with kvblock.h: a second prompt with a common prefix finds and shares the first one's
 * blocks; matching stops at the first miss; salts and extra keys isolate; duplicates follow the pool's
 * policy; a failed allocation changes nothing; the statistics count exactly what happened. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

enum { COMMON = 48 };

/* The prompts: 48 common tokens, then `unique` tokens of their own starting at `first`. */
static size_t make_prompt(uint32_t *tokens, size_t unique, uint32_t first)
{
    fx_iota(tokens, COMMON, 1000);
    fx_iota(tokens + COMMON, unique, first);
    return COMMON + unique;
}

/* A request that runs to completion: append, commit everything, finish. Returns the cached tokens. */
static size_t serve(kvb_pool *pool, const kvb_seq_config *cfg, const uint32_t *tokens, size_t n)
{
    kvb_seq *seq = fx_seq(pool, cfg);
    size_t cached = (size_t)-1;
    KVT_EQ(kvb_seq_append(seq, tokens, n, &cached), KVB_OK);
    KVT_EQ(kvb_seq_commit(seq, n), KVB_OK);
    kvb_seq_destroy(seq);
    return cached;
}

static void test_second_prompt_shares_common_prefix(void)
{
    kvb_pool *pool = fx_pool(32);
    uint32_t prompt_a[64], prompt_b[64];
    size_t n_a = make_prompt(prompt_a, 7, 5000), n_b = make_prompt(prompt_b, 5, 6000);

    kvb_seq *a = fx_seq(pool, NULL);
    size_t cached = (size_t)-1;
    KVT_EQ(kvb_seq_append(a, prompt_a, n_a, &cached), KVB_OK);
    KVT_EQ(cached, 0);
    kvb_seq_info ia = fx_seq_info(a);
    KVT_EQ(ia.num_tokens, 55);
    KVT_EQ(ia.num_blocks, 4);
    KVT_EQ(ia.num_full, 3);
    KVT_EQ(ia.num_cached, 0);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.lookups, 1);
    KVT_EQ(st.hit_blocks, 0);
    KVT_EQ(st.allocations, 4);

    KVT_EQ(kvb_seq_commit(a, n_a), KVB_OK);
    kvb_block ta[8];
    KVT_EQ(fx_seq_table(a, ta, 8), 4);
    for (int i = 0; i < 3; i++) KVT_EQ(fx_info(pool, ta[i].id).state, KVB_STATE_REGISTERED);
    KVT_EQ(fx_info(pool, ta[3].id).state, KVB_STATE_PARTIAL); /* 7 tokens computed, not full */
    st = fx_stats(pool);
    KVT_EQ(st.registrations, 3);
    KVT_EQ(st.cached_hashes, 3);
    KVT_EQ(fx_seq_info(a).num_computed, 55);

    kvb_seq *b = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(b, prompt_b, n_b, &cached), KVB_OK);
    KVT_EQ(cached, 48);
    kvb_seq_info ib = fx_seq_info(b);
    KVT_EQ(ib.num_blocks, 4);
    KVT_EQ(ib.num_cached, 48);
    KVT_EQ(ib.num_computed, 48);
    kvb_block tb[8];
    KVT_EQ(fx_seq_table(b, tb, 8), 4);
    for (int i = 0; i < 3; i++) {
        KVT_EQ(tb[i].id, ta[i].id);
        KVT_EQ(fx_info(pool, tb[i].id).refs, 2);
    }
    KVT_CHECK(kvb_block_index(tb[3].id) != kvb_block_index(ta[3].id));
    KVT_EQ(fx_info(pool, tb[3].id).refs, 1);

    st = fx_stats(pool);
    KVT_EQ(st.lookups, 2);
    KVT_EQ(st.hit_blocks, 3);
    KVT_EQ(st.hit_tokens, 48);
    KVT_EQ(st.allocations, 5); /* 4 for a, 1 for b's own tail */
    KVT_EQ(st.registrations, 3);
    KVT_EQ(st.dedups, 0);
    KVT_EQ(st.evictions, 0);
    KVT_EQ(st.active_blocks, 5);
    KVT_EQ(st.inactive_blocks, 0);
    KVT_EQ(st.free_blocks, 27);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_seq_commit(b, n_b), KVB_OK);
    KVT_EQ(fx_stats(pool).registrations, 3); /* nothing new was full */
    kvb_seq_destroy(a);
    KVT_EQ(fx_info(pool, ta[0].id).refs, 1);
    KVT_EQ(fx_stats(pool).active_blocks, 4);
    kvb_seq_destroy(b);
    st = fx_stats(pool);
    KVT_EQ(st.active_blocks, 0);
    KVT_EQ(st.inactive_blocks, 3);
    KVT_EQ(st.free_blocks, 29);
    KVT_EQ(st.cached_hashes, 3);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_match_stops_at_first_miss(void)
{
    kvb_pool *pool = fx_pool(8);
    uint32_t tokens[64];
    fx_iota(tokens, 64, 1);
    kvb_hash h[4];
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(tokens, 64, 16, NULL, 0, 0, h, 4, &n), KVB_OK);
    kvb_block b[3] = {{0}};
    KVT_EQ(kvb_alloc(pool, 3, b), KVB_OK);
    kvb_hash have[3] = {h[0], h[1], h[3]}, parents[3] = {{0, 0}, h[0], h[2]}; /* block 2 is missing */
    fx_import(pool, b, 3, have, parents);
    KVT_EQ(kvb_release(pool, b, 3, NULL), KVB_OK);

    kvb_block got[4] = {{0}};
    KVT_EQ(kvb_match(pool, h, 4, got, &n), KVB_OK);
    KVT_EQ(n, 2);
    KVT_EQ(got[0].id, b[0].id);
    KVT_EQ(got[1].id, b[1].id);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.lookups, 1);
    KVT_EQ(st.hit_blocks, 2);
    KVT_EQ(st.hit_tokens, 32);
    KVT_EQ(st.active_blocks, 2);
    KVT_EQ(st.inactive_blocks, 1); /* the block after the gap stays cached, unreferenced */
    KVT_EQ(fx_info(pool, b[2].id).refs, 0);
    KVT_EQ(fx_lookup(pool, &h[3], 1), 1);

    KVT_EQ(kvb_match(pool, h + 1, 3, got + 2, &n), KVB_OK); /* the chain may start anywhere cached */
    KVT_EQ(n, 1);
    KVT_EQ(kvb_match(pool, h + 2, 2, got + 3, &n), KVB_OK); /* a miss first: nothing */
    KVT_EQ(n, 0);
    KVT_EQ(fx_info(pool, b[2].id).refs, 0);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, got, 3, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_salt_isolates_tenants(void)
{
    kvb_pool *pool = fx_pool(16);
    uint32_t tokens[40];
    fx_iota(tokens, 40, 7);
    kvb_seq_config tenant1 = {.salt = 1}, tenant2 = {.salt = 2};
    KVT_EQ(serve(pool, &tenant1, tokens, 40), 0);
    KVT_EQ(serve(pool, &tenant1, tokens, 40), 32);
    KVT_EQ(serve(pool, &tenant2, tokens, 40), 0);
    KVT_EQ(serve(pool, NULL, tokens, 40), 0);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.hit_blocks, 2);
    KVT_EQ(st.hit_tokens, 32);
    KVT_EQ(st.cached_hashes, 6); /* salt 1, salt 2, no salt: two full blocks each */
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_extra_keys_change_hits(void)
{
    kvb_pool *pool = fx_pool(16);
    uint32_t tokens[32];
    fx_iota(tokens, 32, 7);
    uint64_t lora7[1] = {7}, lora8[1] = {8}, lora7_image[2] = {7, 0xfeed};
    kvb_seq_config with7 = {.extra = lora7, .n_extra = 1}, with8 = {.extra = lora8, .n_extra = 1};
    kvb_seq_config with_image = {.extra = lora7_image, .n_extra = 2};
    KVT_EQ(serve(pool, &with7, tokens, 32), 0);
    KVT_EQ(serve(pool, &with7, tokens, 32), 32);
    KVT_EQ(serve(pool, &with8, tokens, 32), 0);
    KVT_EQ(serve(pool, &with_image, tokens, 32), 0);
    KVT_EQ(serve(pool, NULL, tokens, 32), 0);
    KVT_EQ(fx_stats(pool).hit_blocks, 2);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* Pool of 4: prompt p's two blocks were released before q's two, so p's are the older ones. A request
 * for p + 32 new tokens must take p's blocks before it allocates, and evict q's instead. */
static void test_hit_blocks_not_evicted_by_own_allocation(void)
{
    kvb_pool *pool = fx_pool(4);
    uint32_t p[64], q[32];
    fx_iota(p, 64, 100);
    fx_iota(q, 32, 900);
    kvb_hash hp[2], hq[2];
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(p, 32, 16, NULL, 0, 0, hp, 2, &n), KVB_OK);
    KVT_EQ(kvb_hash_prompt(q, 32, 16, NULL, 0, 0, hq, 2, &n), KVB_OK);
    KVT_EQ(serve(pool, NULL, p, 32), 0);
    KVT_EQ(serve(pool, NULL, q, 32), 0);
    KVT_EQ(fx_stats(pool).free_blocks, 0);

    kvb_seq *r = fx_seq(pool, NULL);
    size_t cached = 0;
    KVT_EQ(kvb_seq_append(r, p, 64, &cached), KVB_OK);
    KVT_EQ(cached, 32);
    const kvb_hash *hr = NULL;
    KVT_EQ(kvb_seq_hashes(r, &hr, &n), KVB_OK);
    KVT_EQ(n, 4);
    FX_HASH_EQ(hr[0], hp[0]);
    FX_HASH_EQ(hr[1], hp[1]);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.evictions, 2);
    KVT_EQ(st.hit_blocks, 2);
    KVT_EQ(st.allocations, 6);
    KVT_EQ(st.active_blocks, 4);
    KVT_EQ(fx_lookup(pool, hp, 2), 2);
    KVT_EQ(fx_lookup(pool, hq, 1), 0);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(r);
    kvb_pool_destroy(pool);
}

static void test_failed_allocation_changes_nothing(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_block held = {0}, cached = {0}, out[4] = {{0}};
    kvb_hash h = fx_hash(0x51, 0x52);
    KVT_EQ(kvb_alloc(pool, 1, &held), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &cached), KVB_OK);
    fx_import(pool, &cached, 1, &h, NULL);
    KVT_EQ(kvb_release(pool, &cached, 1, NULL), KVB_OK); /* 1 active, 1 inactive, 2 free */
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_alloc(pool, 4, out), KVB_ENOSPACE);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_info(pool, held.id).refs, 1);
    KVT_EQ(fx_info(pool, cached.id).refs, 0);
    KVT_EQ(fx_lookup(pool, &h, 1), 1);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_alloc(pool, 3, out), KVB_OK); /* exactly free + evictable */
    KVT_EQ(fx_stats(pool).evictions, 1);
    KVT_EQ(kvb_release(pool, out, 3, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &held, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* The same through a sequence whose prompt hits: the hit blocks it took are given back. */
static void test_failed_append_with_hits_changes_nothing(void)
{
    kvb_pool *pool = fx_pool(4);
    uint32_t p[80];
    fx_iota(p, 80, 300);
    KVT_EQ(serve(pool, NULL, p, 32), 0); /* two cached blocks */
    kvb_block held = {0};
    KVT_EQ(kvb_alloc(pool, 1, &held), KVB_OK); /* one free block left */
    kvb_pool_stats before = fx_stats(pool);

    kvb_seq *s = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(s, p, 80, NULL), KVB_ENOSPACE); /* 2 hits + 3 new blocks > 2 + 1 */

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(after.inactive_blocks, 2);
    kvb_seq_info info = fx_seq_info(s);
    KVT_EQ(info.num_tokens, 0);
    KVT_EQ(info.num_blocks, 0);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(s);
    KVT_EQ(kvb_release(pool, &held, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

/* Two blocks with the same content registered separately. */
static void register_twice(kvb_pool *pool, kvb_block b[2], kvb_block out[2])
{
    uint32_t tokens[16];
    fx_iota(tokens, 16, 40);
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    fx_fill_block(pool, b[0], NULL, 0, tokens);
    fx_fill_block(pool, b[1], NULL, 0, tokens);
    KVT_EQ(kvb_register(pool, &b[0], 1, &out[0]), KVB_OK);
    KVT_EQ(kvb_register(pool, &b[1], 1, &out[1]), KVB_OK);
}

static void test_duplicates_allowed(void)
{
    kvb_pool *pool = fx_pool(8);
    kvb_block b[2], out[2];
    register_twice(pool, b, out);
    KVT_EQ(out[0].id, b[0].id);
    KVT_EQ(out[1].id, b[1].id);
    kvb_block_info i0 = fx_info(pool, b[0].id), i1 = fx_info(pool, b[1].id);
    KVT_EQ(i0.state, KVB_STATE_REGISTERED);
    KVT_EQ(i1.state, KVB_STATE_REGISTERED);
    FX_HASH_EQ(i0.hash, i1.hash);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.registrations, 2);
    KVT_EQ(st.dedups, 1);
    KVT_EQ(st.cached_hashes, 1);
    KVT_EQ(st.active_blocks, 2);

    kvb_block hit = {0};
    size_t n = 0;
    KVT_EQ(kvb_match(pool, &i0.hash, 1, &hit, &n), KVB_OK);
    KVT_EQ(n, 1);
    KVT_EQ(hit.id, b[0].id); /* the first registered is the one matched */
    KVT_EQ(kvb_release(pool, &hit, 1, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 2);
    KVT_EQ(st.cached_hashes, 1);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_duplicates_rejected(void)
{
    kvb_pool_config cfg = fx_config(8);
    cfg.duplicates = KVB_DUP_REJECT;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_block b[2], out[2];
    register_twice(pool, b, out);
    KVT_EQ(out[0].id, b[0].id);
    KVT_EQ(out[1].id, b[0].id); /* the existing block, with the duplicate's reference */
    KVT_EQ(fx_info(pool, b[0].id).refs, 2);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.registrations, 2);
    KVT_EQ(st.dedups, 1);
    KVT_EQ(st.cached_hashes, 1);
    KVT_EQ(st.active_blocks, 1);
    KVT_EQ(st.free_blocks, 7); /* the duplicate was reset */
    FX_CHECK_POOL(pool);

    kvb_block c = {0}, c_out = {0}; /* the import path dedups the same way */
    kvb_hash h = fx_info(pool, b[0].id).hash;
    KVT_EQ(kvb_alloc(pool, 1, &c), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, &c, 1, &h, NULL, &c_out), KVB_OK);
    KVT_EQ(c_out.id, b[0].id);
    KVT_EQ(fx_info(pool, b[0].id).refs, 3);
    st = fx_stats(pool);
    KVT_EQ(st.dedups, 2);
    KVT_EQ(st.free_blocks, 7);

    kvb_block all[3] = {out[0], out[1], c_out};
    KVT_EQ(kvb_release(pool, all, 3, NULL), KVB_OK);
    st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 1);
    KVT_EQ(st.free_blocks, 7);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* Two requests with the same prompt both miss (neither has committed), then both commit. */
static void race_two_requests(kvb_pool *pool, kvb_block ta[2], kvb_block tb[2])
{
    uint32_t tokens[32];
    fx_iota(tokens, 32, 800);
    kvb_seq *a = fx_seq(pool, NULL), *b = fx_seq(pool, NULL);
    size_t cached = 1;
    KVT_EQ(kvb_seq_append(a, tokens, 32, &cached), KVB_OK);
    KVT_EQ(cached, 0);
    KVT_EQ(kvb_seq_append(b, tokens, 32, &cached), KVB_OK);
    KVT_EQ(cached, 0);
    KVT_EQ(kvb_seq_commit(a, 32), KVB_OK);
    KVT_EQ(kvb_seq_commit(b, 32), KVB_OK);
    KVT_EQ(fx_seq_table(a, ta, 2), 2);
    KVT_EQ(fx_seq_table(b, tb, 2), 2);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.registrations, 4);
    KVT_EQ(st.dedups, 2);
    KVT_EQ(st.cached_hashes, 2);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(a);
    kvb_seq_destroy(b);
}

static void test_duplicate_commits_allowed(void)
{
    kvb_pool *pool = fx_pool(8);
    kvb_block ta[2], tb[2];
    race_two_requests(pool, ta, tb);
    KVT_CHECK(kvb_block_index(ta[0].id) != kvb_block_index(tb[0].id)); /* each kept its own blocks */
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 4);
    KVT_EQ(st.free_blocks, 4);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* KVB_DUP_REJECT cannot reset a duplicate someone else also holds (kvb_retain): it is kept behind the
 * first, as under KVB_DUP_ALLOW, and out[i] is the block given. */
static void test_held_duplicate_kept_under_reject(void)
{
    kvb_pool_config cfg = fx_config(8);
    cfg.duplicates = KVB_DUP_REJECT;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash h = fx_hash(5, 50);
    kvb_block a, b, a_out, b_out;
    KVT_EQ(kvb_alloc(pool, 1, &a), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, &a, 1, &h, NULL, &a_out), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    KVT_EQ(kvb_retain(pool, &b, 1), KVB_OK); /* a second holder */
    KVT_EQ(kvb_register_hashed(pool, &b, 1, &h, NULL, &b_out), KVB_OK);
    KVT_EQ(b_out.id, b.id);
    KVT_EQ(fx_info(pool, b.id).state, KVB_STATE_REGISTERED);
    KVT_EQ(fx_info(pool, a_out.id).refs, 1);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.dedups, 1); /* the hash was found present */
    KVT_EQ(st.cached_hashes, 1);
    KVT_EQ(st.active_blocks, 2);
    KVT_EQ(st.free_blocks, 6); /* nothing reset */
    FX_CHECK_POOL(pool);
    kvb_block all[3] = {a_out, b_out, b_out};
    KVT_EQ(kvb_release(pool, all, 3, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_duplicate_commits_rejected(void)
{
    kvb_pool_config cfg = fx_config(8);
    cfg.duplicates = KVB_DUP_REJECT;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_block ta[2], tb[2];
    race_two_requests(pool, ta, tb);
    KVT_EQ(tb[0].id, ta[0].id); /* the second request now holds the first one's blocks */
    KVT_EQ(tb[1].id, ta[1].id);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 2);
    KVT_EQ(st.free_blocks, 6);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_lookup_takes_no_reference(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_block b[2] = {{0}};
    kvb_hash chain[3] = {fx_hash(1, 10), fx_hash(2, 20), fx_hash(3, 30)};
    kvb_hash parents[2] = {{0, 0}, fx_hash(1, 10)};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    fx_import(pool, b, 2, chain, parents);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(fx_lookup(pool, chain, 3), 2);
    KVT_EQ(fx_lookup(pool, chain + 1, 2), 1);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after)); /* no lookup counted, nothing taken off the list */
    KVT_EQ(after.inactive_blocks, 2);
    KVT_EQ(fx_info(pool, b[0].id).refs, 0);

    kvb_block got[3];
    size_t n = 0;
    KVT_EQ(kvb_match(pool, chain, 3, got, &n), KVB_OK);
    KVT_EQ(n, 2);
    after = fx_stats(pool);
    KVT_EQ(after.lookups, 1);
    KVT_EQ(after.lookup_blocks, 3);
    KVT_EQ(after.hit_blocks, 2);
    KVT_EQ(after.inactive_blocks, 0);
    KVT_EQ(kvb_release(pool, got, n, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static int compare_tagged(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Two hashes (i, 7) and (j, 7) whose index tags (the low 32 bits of their mix, what a slot keeps of
 * them) are equal: there are some among 2^18, by the birthday bound. */
static void same_tag_pair(kvb_hash *a, kvb_hash *b)
{
    enum { N = 1 << 18 };
    uint64_t *t = malloc(N * sizeof *t);
    KVT_CHECK(t != NULL);
    for (uint64_t i = 0; i < N; i++) {
        kvb_hash h = fx_hash(i, 7);
        t[i] = ((uint64_t)kvb__tag(&h) << 32) | i;
    }
    qsort(t, N, sizeof *t, compare_tagged);
    for (size_t i = 1; i < N; i++)
        if (t[i] >> 32 == t[i - 1] >> 32) {
            *a = fx_hash((uint32_t)t[i - 1], 7);
            *b = fx_hash((uint32_t)t[i], 7);
            free(t);
            return;
        }
    free(t);
    KVT_CHECK(!"no two of 2^18 hashes share a tag");
}

/* Hashes that share their index tag, their low half, or all but a few bits are different hashes: each
 * finds its own block, an absent one finds none, and taking one out of the index leaves the others
 * findable. */
static void test_near_collisions_told_apart(void)
{
    kvb_pool *pool = fx_pool(8);
    const uint64_t low = 0x1234567u, far = UINT64_C(1) << 40;
    kvb_hash h[6] = {fx_hash(low, 1), fx_hash(low + far, 2), fx_hash(low + 2 * far, 3), fx_hash(low, 4),
                     fx_hash(low + 64, 5), fx_hash(low + 3 * far, 6)}; /* h[5] is never registered */
    same_tag_pair(&h[1], &h[2]);
    KVT_EQ(kvb__tag(&h[1]), kvb__tag(&h[2]));
    kvb_block b[5] = {{0}}, got[1];
    uint8_t present[6];
    size_t n = 0, count = 0;
    KVT_EQ(kvb_alloc(pool, 5, b), KVB_OK);
    fx_import(pool, b, 5, h, NULL);
    KVT_EQ(kvb_release(pool, b, 5, NULL), KVB_OK);
    for (int i = 0; i < 5; i++) {
        KVT_EQ(kvb_match(pool, &h[i], 1, got, &n), KVB_OK);
        KVT_EQ(n, 1);
        KVT_EQ(got[0].id, b[i].id);
        FX_HASH_EQ(fx_info(pool, got[0].id).hash, h[i]);
        KVT_EQ(kvb_release(pool, got, 1, NULL), KVB_OK);
    }
    KVT_EQ(fx_lookup(pool, &h[5], 1), 0);
    KVT_EQ(kvb_presence(pool, h, 6, present, &count), KVB_OK);
    KVT_EQ(count, 5);
    KVT_EQ(present[5], 0);

    kvb_block fresh[4] = {{0}}; /* the 3 free blocks, then the least recently released (h[0]) is evicted */
    KVT_EQ(kvb_alloc(pool, 4, fresh), KVB_OK);
    KVT_EQ(fx_stats(pool).evictions, 1);
    KVT_EQ(fx_lookup(pool, &h[0], 1), 0);
    for (int i = 1; i < 5; i++) KVT_EQ(fx_lookup(pool, &h[i], 1), 1);
    KVT_EQ(kvb_release(pool, fresh, 4, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* The longest run of occupied index slots (a search for an absent hash homed in it walks all of it). */
static uint64_t longest_run(const kvb_pool *pool)
{
    uint64_t best = 0, run = 0;
    for (uint64_t s = 0; s <= 2 * pool->slot_mask + 1; s++) { /* twice round: a run may wrap */
        run = pool->slots[s & pool->slot_mask].ref ? run + 1 : 0;
        if (run > best) best = run;
    }
    return best > pool->slot_mask ? pool->slot_mask + 1 : best;
}

/* Hashes with structure (sequence numbers, ids in the high bits, only `hi` varying: what a simulator or
 * a custom hash_fn may hand kvb_register_hashed) spread over the index as random ones do: no long runs
 * of occupied slots, which would make every search that lands in one walk it. */
static void test_structured_hashes_spread(void)
{
    enum { N = 20000 };
    static kvb_hash h[N];
    static kvb_block b[N], out[N];
    static uint8_t present[N];
    for (int shape = 0; shape < 5; shape++) {
        kvb_pool *pool = fx_pool(N);
        for (uint64_t j = 0; j < N; j++) {
            switch (shape) {
            case 0: h[j] = fx_hash(1000 + j, 0); break;          /* consecutive */
            case 1: h[j] = fx_hash(j << 32, 0); break;           /* only the high half of lo */
            case 2: h[j] = fx_hash(j << 20, 5); break;           /* a stride that is a power of two */
            case 3: h[j] = fx_hash(42, j); break;                /* only hi */
            default: {                                            /* kvb_hash_block's, for comparison */
                uint32_t t = (uint32_t)j;
                h[j] = kvb_hash_block(NULL, &t, 1, NULL, 0, 0);
            }
            }
        }
        KVT_EQ(kvb_alloc(pool, N, b), KVB_OK);
        KVT_EQ(kvb_register_hashed(pool, b, N, h, NULL, out), KVB_OK);
        KVT_EQ(fx_lookup(pool, h, N), N);
        size_t count = 0;
        KVT_EQ(kvb_presence(pool, h, N, present, &count), KVB_OK);
        KVT_EQ(count, N);
        uint64_t run = longest_run(pool);
        if (run > 64) fprintf(stderr, "  shape %d: a run of %llu occupied slots\n", shape, (unsigned long long)run);
        KVT_CHECK(run <= 64); /* 20,000 of 65,536 slots at random: the longest run is about 15-25 */
        KVT_EQ(kvb_release(pool, out, N, NULL), KVB_OK);
        FX_CHECK_POOL(pool);
        kvb_pool_destroy(pool);
    }
}

/* kvb_register_hashed writes a batch's metadata first and indexes it after (the index slots come in
 * meanwhile): the result must be what registering the same blocks one call each gives, with a child
 * before its parent in the batch, a hash twice, and a chain through the duplicate. Both pools evict the
 * same blocks in the same order afterwards (lineage: the child counts decide it). */
static void test_register_batch_same_as_one_by_one(void)
{
    enum { N = 6, C = 8 };
    kvb_pool *batch = fx_pool(C), *single = fx_pool(C);
    kvb_hash h[N], par[N];
    kvb_block a[N], b[N], out_a[N], out_b[N];
    size_t i;
    for (i = 0; i < N; i++) h[i] = (kvb_hash){ 0x1000 + i, 0x77 };
    h[4] = h[1];                        /* a duplicate in the batch */
    par[0] = (kvb_hash){ 0, 0 };
    par[1] = h[0];
    par[2] = h[3];                      /* its parent comes later in the batch */
    par[3] = h[1];
    par[4] = h[0];
    par[5] = h[4];                      /* a chain through the duplicate */
    KVT_EQ(kvb_alloc(batch, N, a), KVB_OK);
    KVT_EQ(kvb_alloc(single, N, b), KVB_OK);
    KVT_EQ(kvb_register_hashed(batch, a, N, h, par, out_a), KVB_OK);
    for (i = 0; i < N; i++) KVT_EQ(kvb_register_hashed(single, &b[i], 1, &h[i], &par[i], &out_b[i]), KVB_OK);
    for (i = 0; i < N; i++) {
        kvb_block_info ia, ib;
        KVT_EQ(out_a[i].id, out_b[i].id);
        KVT_EQ(kvb_block_get_info(batch, out_a[i].id, &ia), KVB_OK);
        KVT_EQ(kvb_block_get_info(single, out_b[i].id, &ib), KVB_OK);
        KVT_EQ(ia.state, KVB_STATE_REGISTERED);
        KVT_EQ(ia.state, ib.state);
        KVT_EQ(ia.refs, ib.refs);
        FX_HASH_EQ(ia.hash, h[i]);
        FX_HASH_EQ(ia.parent, par[i]);
        FX_HASH_EQ(ib.hash, h[i]);
        FX_HASH_EQ(ib.parent, par[i]);
    }
    FX_CHECK_POOL(batch); /* child counts, orphans, index, duplicate chains */
    FX_CHECK_POOL(single);
    KVT_EQ(fx_stats(batch).dedups, fx_stats(single).dedups);
    { /* the same block answers for each hash (the first of the duplicates registered) */
        kvb_hash chain[4] = { h[0], h[1], h[3], h[2] };
        kvb_block ma[4], mb[4];
        size_t ka = 0, kb = 0;
        KVT_EQ(kvb_match(batch, chain, 4, ma, &ka), KVB_OK);
        KVT_EQ(kvb_match(single, chain, 4, mb, &kb), KVB_OK);
        KVT_EQ(ka, 4);
        KVT_EQ(kb, 4);
        for (i = 0; i < 4; i++) KVT_EQ(ma[i].id, mb[i].id);
        KVT_EQ(ma[1].id, out_a[1].id);
        KVT_EQ(kvb_release(batch, ma, ka, NULL), KVB_OK);
        KVT_EQ(kvb_release(single, mb, kb, NULL), KVB_OK);
    }
    KVT_EQ(kvb_release(batch, out_a, N, NULL), KVB_OK);
    KVT_EQ(kvb_release(single, out_b, N, NULL), KVB_OK);
    for (i = 0; i < C; i++) { /* 2 free blocks, then the 6 inactive ones in eviction order */
        KVT_EQ(kvb_alloc(batch, 1, a), KVB_OK);
        KVT_EQ(kvb_alloc(single, 1, b), KVB_OK);
        KVT_EQ(kvb_block_index(a[0].id), kvb_block_index(b[0].id));
    }
    FX_CHECK_POOL(batch);
    kvb_pool_destroy(batch);
    kvb_pool_destroy(single);
}

/* n single blocks registered with hashes (i + 1, salt) as roots, each its own request, released in order. */
static void register_roots(kvb_pool *pool, size_t n, uint64_t salt, kvb_hash *h)
{
    kvb_block b[8], out[8];
    KVT_CHECK(n <= 8);
    KVT_EQ(kvb_alloc(pool, n, b), KVB_OK);
    for (size_t i = 0; i < n; i++) h[i] = fx_hash(i + 1, salt);
    KVT_EQ(kvb_register_hashed(pool, b, n, h, NULL, out), KVB_OK);
    for (size_t i = 0; i < n; i++) KVT_EQ(kvb_release(pool, &out[i], 1, NULL), KVB_OK);
}

/* kvb_pin: the prefix kvb_match would give, held (nothing evicts it), with no lookup or hit counted; the
 * pins go with kvb_unpin, and then the blocks are inactive and cached as before. */
static void test_pin_holds_a_prefix_without_counting(void)
{
    kvb_pool *pool = fx_pool(8);
    kvb_block chain[4], reg[4], pins[5], all[8];
    kvb_hash h[5], parents[4];
    size_t n = 99;
    KVT_EQ(kvb_alloc(pool, 4, chain), KVB_OK);
    for (int i = 0; i < 5; i++) h[i] = fx_hash(100 + (uint64_t)i, 7);
    parents[0] = fx_hash(0, 0);
    for (int i = 1; i < 4; i++) parents[i] = h[i - 1];
    KVT_EQ(kvb_register_hashed(pool, chain, 4, h, parents, reg), KVB_OK);
    KVT_EQ(kvb_release(pool, reg, 4, NULL), KVB_OK);
    kvb_pool_stats before = fx_stats(pool);
    KVT_EQ(kvb_pin(pool, h, 5, pins, &n), KVB_OK); /* the 5th hash was never registered */
    KVT_EQ(n, 4);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.lookups, before.lookups);
    KVT_EQ(st.lookup_blocks, before.lookup_blocks);
    KVT_EQ(st.hit_blocks, before.hit_blocks);
    KVT_EQ(st.hit_tokens, before.hit_tokens);
    KVT_EQ(st.inactive_blocks, 0);
    KVT_EQ(st.active_blocks, 4);
    for (int i = 0; i < 4; i++) {
        KVT_EQ(pins[i].id, reg[i].id);
        KVT_EQ(fx_info(pool, pins[i].id).refs, 1);
    }
    /* every other block can be taken; the pinned ones cannot be evicted */
    KVT_EQ(kvb_alloc(pool, 4, all), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, all + 4), KVB_ENOSPACE);
    KVT_EQ(fx_lookup(pool, h, 5), 4);
    KVT_EQ(kvb_release(pool, all, 4, NULL), KVB_OK);
    KVT_EQ(kvb_unpin(pool, pins, 4), KVB_OK);
    st = fx_stats(pool);
    KVT_EQ(st.inactive_blocks, 4);
    KVT_EQ(st.active_blocks, 0);
    KVT_EQ(st.lookups, before.lookups);
    KVT_EQ(fx_lookup(pool, h, 4), 4);
    KVT_EQ(kvb_unpin(pool, pins, 1), KVB_EDOUBLE);
    KVT_EQ(kvb_unpin(NULL, pins, 1), KVB_EINVAL);
    KVT_EQ(kvb_unpin(pool, NULL, 1), KVB_EINVAL);
    KVT_EQ(kvb_unpin(pool, NULL, 0), KVB_OK);
    /* bad input */
    KVT_EQ(kvb_pin(NULL, h, 1, pins, &n), KVB_EINVAL);
    KVT_EQ(kvb_pin(pool, NULL, 1, pins, &n), KVB_EINVAL);
    KVT_EQ(kvb_pin(pool, h, 1, NULL, &n), KVB_EINVAL);
    KVT_EQ(kvb_pin(pool, h, 1, pins, NULL), KVB_EINVAL);
    KVT_EQ(kvb_pin(pool, NULL, 0, NULL, &n), KVB_OK);
    KVT_EQ(n, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* ARC sees a kvb_match as a hit (the block moves to T2); a pin and its release are no use: it stays in T1. */
static void test_pin_is_no_hit_for_arc(void)
{
    kvb_pool_config cfg = fx_config(8);
    cfg.eviction = KVB_EVICT_ARC;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash h[2];
    kvb_block b;
    size_t n = 0;
    register_roots(pool, 2, 9, h);
    KVT_EQ(fx_stats(pool).list_blocks[0], 2);
    KVT_EQ(kvb_pin(pool, h, 1, &b, &n), KVB_OK);
    KVT_EQ(n, 1);
    KVT_EQ(kvb_unpin(pool, &b, 1), KVB_OK);
    KVT_EQ(fx_stats(pool).list_blocks[0], 2);
    KVT_EQ(fx_stats(pool).list_blocks[1], 0);
    KVT_EQ(kvb_match(pool, h, 1, &b, &n), KVB_OK); /* a use: to T2 */
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    KVT_EQ(fx_stats(pool).list_blocks[1], 1);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* FOL counts each release as a use; not a release of pins. Two blocks, each its own request's tail
 * (class 0, first out under a fixed step); b is used again (count 2). a pinned and let go is still
 * seen once, so a full pool evicts a; counted as a use, a would be class 2 too, and b (released
 * earlier) would go. */
static void test_unpin_is_no_use_for_fol(void)
{
    kvb_pool_config cfg = fx_config(2);
    cfg.eviction = KVB_EVICT_FOL;
    cfg.fol_class_step = 1000;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_hash h[2];
    kvb_block b, fresh;
    size_t n = 0;
    register_roots(pool, 2, 11, h);
    KVT_EQ(kvb_match(pool, h + 1, 1, &b, &n), KVB_OK);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    KVT_EQ(kvb_pin(pool, h, 1, &b, &n), KVB_OK);
    KVT_EQ(n, 1);
    KVT_EQ(kvb_unpin(pool, &b, 1), KVB_OK);
    KVT_EQ(kvb_alloc(pool, 1, &fresh), KVB_OK);
    KVT_EQ(fx_lookup(pool, h, 1), 0);     /* a went */
    KVT_EQ(fx_lookup(pool, h + 1, 1), 1); /* b stays */
    KVT_EQ(kvb_release(pool, &fresh, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A block let go by kvb_unpin keeps its priority level (kvb_release would put it at opts' level, 0 by
 * default). */
static void test_unpin_keeps_the_level(void)
{
    kvb_pool_config cfg = fx_config(4);
    cfg.priority_levels = 2;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_block b, reg, pin;
    kvb_hash h = fx_hash(5, 5);
    size_t n = 0;
    kvb_release_opts high = {.priority = 1};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    KVT_EQ(kvb_register_hashed(pool, &b, 1, &h, NULL, &reg), KVB_OK);
    KVT_EQ(kvb_release(pool, &reg, 1, &high), KVB_OK);
    KVT_EQ(fx_info(pool, reg.id).priority, 1);
    KVT_EQ(kvb_pin(pool, &h, 1, &pin, &n), KVB_OK);
    KVT_EQ(n, 1);
    KVT_EQ(kvb_unpin(pool, &pin, 1), KVB_OK);
    KVT_EQ(fx_info(pool, reg.id).priority, 1);
    KVT_EQ(fx_stats(pool).inactive_blocks, 1);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A kvb_release while a pin is held names the level the block goes to when the pin goes last (the
 * user's level, not the one the block had before it was taken: an offload holding a block while its
 * request ends must not move it). Every policy; under S3-FIFO the block gives up its place at the old
 * level and stays evictable at the new one. */
static void test_release_under_a_pin_sets_the_level(void)
{
    static const kvb_evict_policy ev[] = {KVB_EVICT_LINEAGE, KVB_EVICT_LRU, KVB_EVICT_FOL, KVB_EVICT_ARC,
                                          KVB_EVICT_S3FIFO};
    for (size_t e = 0; e < sizeof ev / sizeof ev[0]; e++) {
        kvb_pool_config cfg = fx_config(4);
        cfg.priority_levels = 2;
        cfg.eviction = ev[e];
        kvb_pool *pool = fx_pool_from(&cfg);
        kvb_block b, reg, pin, use, fresh[4];
        kvb_weak cand[4];
        kvb_hash h = fx_hash(5, 5);
        size_t n = 0;
        kvb_release_opts high = {.priority = 1};
        KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
        KVT_EQ(kvb_register_hashed(pool, &b, 1, &h, NULL, &reg), KVB_OK);
        KVT_EQ(kvb_release(pool, &reg, 1, NULL), KVB_OK); /* level 0, inactive (S3-FIFO: queued there) */
        KVT_EQ(kvb_pin(pool, &h, 1, &pin, &n), KVB_OK);
        KVT_EQ(kvb_match(pool, &h, 1, &use, &n), KVB_OK);
        KVT_EQ(n, 1);
        KVT_EQ(kvb_release(pool, &use, 1, &high), KVB_OK); /* the user's release, at level 1: not the last */
        KVT_EQ(kvb_unpin(pool, &pin, 1), KVB_OK);
        KVT_EQ(fx_info(pool, reg.id).priority, 1);
        KVT_EQ(fx_stats(pool).inactive_blocks, 1);
        KVT_EQ(kvb_eviction_candidates(pool, 4, cand, &n), KVB_OK);
        KVT_EQ(n, 1);
        FX_CHECK_POOL(pool);
        KVT_EQ(kvb_alloc(pool, 4, fresh), KVB_OK); /* it can be evicted */
        KVT_EQ(kvb_release(pool, fresh, 4, NULL), KVB_OK);
        FX_CHECK_POOL(pool);
        kvb_pool_destroy(pool);
    }
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_second_prompt_shares_common_prefix);
    KVT_RUN(test_match_stops_at_first_miss);
    KVT_RUN(test_salt_isolates_tenants);
    KVT_RUN(test_extra_keys_change_hits);
    KVT_RUN(test_hit_blocks_not_evicted_by_own_allocation);
    KVT_RUN(test_failed_allocation_changes_nothing);
    KVT_RUN(test_failed_append_with_hits_changes_nothing);
    KVT_RUN(test_duplicates_allowed);
    KVT_RUN(test_duplicates_rejected);
    KVT_RUN(test_duplicate_commits_allowed);
    KVT_RUN(test_duplicate_commits_rejected);
    KVT_RUN(test_held_duplicate_kept_under_reject);
    KVT_RUN(test_lookup_takes_no_reference);
    KVT_RUN(test_near_collisions_told_apart);
    KVT_RUN(test_structured_hashes_spread);
    KVT_RUN(test_register_batch_same_as_one_by_one);
    KVT_RUN(test_pin_holds_a_prefix_without_counting);
    KVT_RUN(test_pin_is_no_hit_for_arc);
    KVT_RUN(test_unpin_is_no_use_for_fol);
    KVT_RUN(test_unpin_keeps_the_level);
    KVT_RUN(test_release_under_a_pin_sets_the_level);
    return kvt_summary();
}
