/* Sequences of kvblock.h: incremental hashing as tokens arrive, fork and copy-on-write of the shared
 * partial block (bytes included), reference counting across forks, truncation (through shared blocks
 * and inside blocks the sequence alone holds), chunked commits, reserved room and a reset that keep the
 * same memory, an append that does not fit changing nothing, and those copies through the pool's
 * copy_block hook. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

enum { LAYERS = 2, PAGE = 512 }; /* 16 tokens x 2 heads x 8 dims x 2 bytes */

static kvb_pool *host_pool(uint32_t num_blocks)
{
    kvb_pool_config cfg = fx_config(num_blocks);
    cfg.storage = KVB_STORAGE_HOST;
    KVT_EQ(kvb_layout_for_model(KVB_LAYOUT_LAYER_SEPARATE, 16, LAYERS, 2, 8, 2, &cfg.layout), KVB_OK);
    return fx_pool_from(&cfg);
}

/* Fills every page of a block with one byte value. */
static void fill_block(kvb_pool *pool, kvb_block b, unsigned char value)
{
    for (uint32_t layer = 0; layer < LAYERS; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            void *p = NULL;
            KVT_EQ(kvb_block_data(pool, b, layer, part, &p), KVB_OK);
            if (p) memset(p, value, PAGE);
        }
}

/* Number of pages of a block that hold anything but `value`. */
static int pages_differing(kvb_pool *pool, kvb_block b, unsigned char value)
{
    int bad = 0;
    for (uint32_t layer = 0; layer < LAYERS; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            unsigned char *p = NULL;
            KVT_EQ(kvb_block_data(pool, b, layer, part, (void **)&p), KVB_OK);
            for (int i = 0; p && i < PAGE; i++)
                if (p[i] != value) {
                    bad++;
                    break;
                }
        }
    return bad;
}

/* The sequence's full-block hashes are those of kvb_hash_prompt over its tokens. */
static void check_hashes(const kvb_seq *seq, const uint32_t *tokens, size_t n_tokens, const uint64_t *extra,
                         size_t n_extra, uint64_t salt)
{
    kvb_hash want[16];
    size_t n_want = 0, n_got = 0;
    const kvb_hash *got = NULL;
    KVT_EQ(kvb_hash_prompt(tokens, n_tokens, 16, extra, n_extra, salt, want, 16, &n_want), KVB_OK);
    KVT_EQ(kvb_seq_hashes(seq, &got, &n_got), KVB_OK);
    KVT_EQ(n_got, n_want);
    for (size_t i = 0; i < n_got && i < n_want; i++) FX_HASH_EQ(got[i], want[i]);
}

static void test_append_in_pieces_hashes_like_prompt(void)
{
    kvb_pool *pool = fx_pool(16);
    uint64_t extra[1] = {5};
    kvb_seq_config cfg = {.salt = 9, .extra = extra, .n_extra = 1};
    kvb_seq *seq = fx_seq(pool, &cfg);
    uint32_t tokens[100];
    fx_iota(tokens, 100, 7);
    const size_t pieces[] = {1, 7, 15, 16, 17, 44};
    size_t done = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
        KVT_EQ(kvb_seq_append(seq, tokens + done, pieces[i], NULL), KVB_OK);
        done += pieces[i];
        check_hashes(seq, tokens, done, extra, 1, 9);
    }
    KVT_EQ(done, 100);
    kvb_seq_info info = fx_seq_info(seq);
    KVT_EQ(info.num_tokens, 100);
    KVT_EQ(info.num_blocks, 7);
    KVT_EQ(info.num_full, 6);
    const uint32_t *got = NULL;
    size_t n = 0;
    KVT_EQ(kvb_seq_tokens(seq, &got, &n), KVB_OK);
    KVT_EQ(n, 100);
    KVT_CHECK(got && memcmp(got, tokens, sizeof tokens) == 0);
    KVT_EQ(fx_stats(pool).active_blocks, 7);

    KVT_EQ(kvb_seq_commit(seq, 100), KVB_OK); /* registered under the same hashes */
    kvb_hash h[6];
    KVT_EQ(kvb_hash_prompt(tokens, 100, 16, extra, 1, 9, h, 6, &n), KVB_OK);
    KVT_EQ(fx_lookup(pool, h, 6), 6);
    kvb_seq_destroy(seq);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* s has one full block and a partial one with 4 tokens whose bytes were written before the fork. */
static void test_fork_copies_shared_partial_block_on_write(void)
{
    kvb_pool *pool = host_pool(16);
    uint32_t tokens[20];
    fx_iota(tokens, 20, 300);
    kvb_seq *s = fx_seq(pool, NULL), *t = NULL;
    KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(s, 20), KVB_OK);
    kvb_block before[2];
    KVT_EQ(fx_seq_table(s, before, 2), 2);
    fill_block(pool, before[0], 0xcd);
    fill_block(pool, before[1], 0xab);

    KVT_EQ(kvb_seq_fork(s, &t), KVB_OK);
    kvb_block tt[2];
    KVT_EQ(fx_seq_table(t, tt, 2), 2);
    KVT_EQ(tt[0].id, before[0].id);
    KVT_EQ(tt[1].id, before[1].id);
    KVT_EQ(fx_info(pool, before[1].id).refs, 2);
    KVT_EQ(fx_seq_info(t).num_tokens, 20);

    uint32_t for_s = 1111, for_t = 2222;
    KVT_EQ(kvb_seq_append(s, &for_s, 1, NULL), KVB_OK);
    KVT_EQ(kvb_seq_append(t, &for_t, 1, NULL), KVB_OK);
    kvb_block ts[2];
    KVT_EQ(fx_seq_table(s, ts, 2), 2);
    KVT_EQ(fx_seq_table(t, tt, 2), 2);
    KVT_EQ(ts[0].id, before[0].id); /* the full block stays shared */
    KVT_EQ(fx_info(pool, ts[0].id).refs, 2);
    KVT_CHECK(kvb_block_index(ts[1].id) != kvb_block_index(tt[1].id));
    KVT_EQ(fx_info(pool, ts[1].id).refs, 1);
    KVT_EQ(fx_info(pool, tt[1].id).refs, 1);
    KVT_EQ(pages_differing(pool, ts[1], 0xab), 0); /* both kept the bytes written before the fork */
    KVT_EQ(pages_differing(pool, tt[1], 0xab), 0);
    KVT_EQ(pages_differing(pool, ts[0], 0xcd), 0);

    fill_block(pool, ts[1], 0x11); /* and now they are independent */
    fill_block(pool, tt[1], 0x22);
    KVT_EQ(pages_differing(pool, ts[1], 0x11), 0);
    KVT_EQ(pages_differing(pool, tt[1], 0x22), 0);

    const uint32_t *got = NULL;
    size_t n = 0;
    KVT_EQ(kvb_seq_tokens(s, &got, &n), KVB_OK);
    KVT_CHECK(n == 21 && got[20] == 1111 && got[19] == tokens[19]);
    KVT_EQ(kvb_seq_tokens(t, &got, &n), KVB_OK);
    KVT_CHECK(n == 21 && got[20] == 2222);

    uint32_t rest[11];
    fx_iota(rest, 11, 400); /* fill both to 32 tokens: the second blocks hash differently */
    KVT_EQ(kvb_seq_append(s, rest, 11, NULL), KVB_OK);
    KVT_EQ(kvb_seq_append(t, rest, 11, NULL), KVB_OK);
    uint32_t all_s[32], all_t[32];
    memcpy(all_s, tokens, sizeof tokens);
    memcpy(all_t, tokens, sizeof tokens);
    all_s[20] = 1111;
    all_t[20] = 2222;
    memcpy(all_s + 21, rest, sizeof rest);
    memcpy(all_t + 21, rest, sizeof rest);
    check_hashes(s, all_s, 32, NULL, 0, 0);
    check_hashes(t, all_t, 32, NULL, 0, 0);
    FX_CHECK_POOL(pool);

    kvb_seq_destroy(s);
    kvb_seq_destroy(t);
    KVT_EQ(fx_stats(pool).active_blocks, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_shared_blocks_freed_by_last_owner(void)
{
    kvb_pool *pool = fx_pool(16);
    uint32_t tokens[40];
    fx_iota(tokens, 40, 1);
    kvb_seq *s = fx_seq(pool, NULL), *t = NULL;
    KVT_EQ(kvb_seq_append(s, tokens, 40, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(s, 32), KVB_OK); /* the two full blocks registered, the tail not computed */
    KVT_EQ(kvb_seq_fork(s, &t), KVB_OK);
    kvb_block table[3];
    KVT_EQ(fx_seq_table(t, table, 3), 3);
    for (int i = 0; i < 3; i++) KVT_EQ(fx_info(pool, table[i].id).refs, 2);
    KVT_EQ(fx_stats(pool).active_blocks, 3);

    kvb_seq_destroy(s);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.active_blocks, 3);
    KVT_EQ(st.inactive_blocks, 0);
    for (int i = 0; i < 3; i++) KVT_EQ(fx_info(pool, table[i].id).refs, 1);

    kvb_seq_destroy(t);
    st = fx_stats(pool);
    KVT_EQ(st.active_blocks, 0);
    KVT_EQ(st.inactive_blocks, 2); /* registered: cached */
    KVT_EQ(st.free_blocks, 14);    /* the unregistered tail */
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_truncate_releases_tail_and_copies_kept_partial(void)
{
    kvb_pool *pool = host_pool(16);
    uint32_t tokens[40];
    fx_iota(tokens, 40, 50);
    kvb_seq *s = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(s, tokens, 40, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(s, 40), KVB_OK);
    kvb_block before[3];
    KVT_EQ(fx_seq_table(s, before, 3), 3);
    fill_block(pool, before[1], 0x77);
    kvb_hash h[2];
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(tokens, 40, 16, NULL, 0, 0, h, 2, &n), KVB_OK);

    kvb_pool_stats st0 = fx_stats(pool);
    KVT_EQ(kvb_seq_truncate(s, 41), KVB_ERANGE);
    kvb_pool_stats st1 = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&st0, &st1));
    KVT_EQ(fx_seq_info(s).num_tokens, 40);

    KVT_EQ(kvb_seq_truncate(s, 20), KVB_OK);
    kvb_seq_info info = fx_seq_info(s);
    KVT_EQ(info.num_tokens, 20);
    KVT_EQ(info.num_blocks, 2);
    KVT_EQ(info.num_full, 1);
    kvb_block after[3];
    KVT_EQ(fx_seq_table(s, after, 3), 2);
    KVT_EQ(after[0].id, before[0].id);
    KVT_CHECK(kvb_block_index(after[1].id) != kvb_block_index(before[1].id)); /* a private copy */
    kvb_block_info copy = fx_info(pool, after[1].id);
    KVT_CHECK(copy.state != KVB_STATE_REGISTERED);
    KVT_EQ(copy.refs, 1);
    KVT_EQ(copy.num_tokens, 4);
    KVT_EQ(pages_differing(pool, after[1], 0x77), 0); /* with the bytes */
    kvb_block_info original = fx_info(pool, before[1].id);
    KVT_EQ(original.state, KVB_STATE_REGISTERED); /* still cached for whoever has those 32 tokens */
    KVT_EQ(original.refs, 0);
    KVT_EQ(fx_lookup(pool, h, 2), 2);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.active_blocks, 2);
    KVT_EQ(st.inactive_blocks, 1);
    KVT_EQ(st.free_blocks, 13); /* the tail block went back */
    FX_CHECK_POOL(pool);

    uint32_t other[12];
    fx_iota(other, 12, 7000); /* a different continuation */
    KVT_EQ(kvb_seq_append(s, other, 12, NULL), KVB_OK);
    uint32_t all[32];
    memcpy(all, tokens, 20 * sizeof all[0]);
    memcpy(all + 20, other, sizeof other);
    check_hashes(s, all, 32, NULL, 0, 0);
    KVT_EQ(kvb_seq_commit(s, 32), KVB_OK);
    kvb_hash h2[2];
    KVT_EQ(kvb_hash_prompt(all, 32, 16, NULL, 0, 0, h2, 2, &n), KVB_OK);
    KVT_EQ(fx_lookup(pool, h2, 2), 2);

    KVT_EQ(kvb_seq_truncate(s, 16), KVB_OK); /* at a block boundary: nothing to copy */
    KVT_EQ(fx_seq_table(s, after, 3), 1);
    KVT_EQ(after[0].id, before[0].id);
    kvb_seq_destroy(s);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* Truncating inside blocks only this sequence holds (not registered): no copy, the block keeps its id
 * and bytes and becomes partial at the new length; a block the engine has scheduled (Inflight) or
 * computed (Complete) cannot be cut: KVB_ESTATE, nothing changed. */
/* A sequence's unregistered blocks hold no copy of its tokens (they stay in the sequence): only the
 * sequence fills and registers them. The engine may still take them through the lifecycle (Inflight,
 * Complete); kvb_block_add_tokens and kvb_register refuse them with KVB_ESTATE, changing nothing, and
 * kvb_seq_commit registers them. Before, both went through: the block counted a token the sequence did
 * not have, and kvb_register hashed a copy of the tokens kept for it. */
static void test_sequence_blocks_change_through_the_sequence(void)
{
    kvb_pool *pool = host_pool(8);
    uint32_t tokens[20], one = 7;
    fx_iota(tokens, 20, 500);
    kvb_seq *s = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
    kvb_block b[2], out;
    KVT_EQ(fx_seq_table(s, b, 2), 2);
    KVT_EQ(kvb_block_add_tokens(pool, b[1], &one, 1, 0), KVB_ESTATE);
    KVT_EQ(fx_info(pool, b[1].id).num_tokens, 4);
    KVT_EQ(kvb_block_schedule(pool, b[0]), KVB_OK);
    KVT_EQ(kvb_block_compute_done(pool, b[0]), KVB_OK);
    KVT_EQ(fx_info(pool, b[0].id).state, KVB_STATE_COMPLETE);
    kvb_pool_stats st0 = fx_stats(pool);
    out.id = 99;
    KVT_EQ(kvb_register(pool, b, 1, &out), KVB_ESTATE);
    KVT_EQ(out.id, 99);
    KVT_EQ(fx_info(pool, b[0].id).state, KVB_STATE_COMPLETE);
    kvb_pool_stats st1 = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&st0, &st1));
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_seq_commit(s, 16), KVB_OK);
    kvb_block_info info = fx_info(pool, b[0].id);
    KVT_EQ(info.state, KVB_STATE_REGISTERED);
    kvb_hash root = {0, 0}, h = kvb_hash_block(&root, tokens, 16, NULL, 0, 0);
    KVT_EQ(info.hash.lo, h.lo);
    KVT_EQ(info.hash.hi, h.hi);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(s);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_truncate_inside_private_blocks(void)
{
    kvb_pool *pool = host_pool(8);
    uint32_t tokens[20], more[6];
    fx_iota(tokens, 20, 300);
    fx_iota(more, 6, 9000);
    kvb_seq *s = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK); /* block 0 full, block 1 holds 4 tokens */
    kvb_block before[2], after[2];
    KVT_EQ(fx_seq_table(s, before, 2), 2);
    KVT_EQ(fx_info(pool, before[0].id).state, KVB_STATE_READY);
    KVT_EQ(fx_info(pool, before[1].id).state, KVB_STATE_PARTIAL);
    fill_block(pool, before[0], 0x31);
    fill_block(pool, before[1], 0x32);
    kvb_pool_stats st0 = fx_stats(pool);

    KVT_EQ(kvb_seq_truncate(s, 18), KVB_OK); /* inside the partial block */
    KVT_EQ(fx_seq_info(s).num_tokens, 18);
    KVT_EQ(fx_seq_table(s, after, 2), 2);
    KVT_EQ(after[0].id, before[0].id);
    KVT_EQ(after[1].id, before[1].id);
    kvb_block_info b1 = fx_info(pool, after[1].id);
    KVT_EQ(b1.state, KVB_STATE_PARTIAL);
    KVT_EQ(b1.num_tokens, 2);
    KVT_EQ(pages_differing(pool, after[1], 0x32), 0);
    kvb_pool_stats st1 = fx_stats(pool);
    KVT_EQ(st1.free_blocks, st0.free_blocks); /* nothing copied, nothing freed */
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_seq_truncate(s, 10), KVB_OK); /* inside the full, unregistered block: block 1 goes */
    kvb_seq_info info = fx_seq_info(s);
    KVT_EQ(info.num_tokens, 10);
    KVT_EQ(info.num_blocks, 1);
    KVT_EQ(info.num_full, 0);
    KVT_EQ(fx_seq_table(s, after, 2), 1);
    KVT_EQ(after[0].id, before[0].id);
    kvb_block_info b0 = fx_info(pool, after[0].id);
    KVT_EQ(b0.state, KVB_STATE_PARTIAL);
    KVT_EQ(b0.num_tokens, 10);
    KVT_EQ(pages_differing(pool, after[0], 0x31), 0);
    KVT_EQ(fx_stats(pool).free_blocks, st0.free_blocks + 1);
    FX_CHECK_POOL(pool);

    KVT_EQ(kvb_seq_append(s, more, 6, NULL), KVB_OK); /* full again, with the new tokens */
    uint32_t all[16];
    memcpy(all, tokens, 10 * sizeof all[0]);
    memcpy(all + 10, more, sizeof more);
    check_hashes(s, all, 16, NULL, 0, 0);
    KVT_EQ(fx_info(pool, after[0].id).state, KVB_STATE_READY);

    KVT_EQ(kvb_block_schedule(pool, after[0]), KVB_OK); /* the engine computes it: Inflight */
    kvb_pool_stats st2 = fx_stats(pool);
    KVT_EQ(kvb_seq_truncate(s, 12), KVB_ESTATE);
    KVT_EQ(fx_seq_info(s).num_tokens, 16);
    KVT_EQ(fx_info(pool, after[0].id).state, KVB_STATE_INFLIGHT);
    KVT_EQ(fx_info(pool, after[0].id).num_tokens, 16);
    kvb_pool_stats st3 = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&st2, &st3));
    KVT_EQ(kvb_block_compute_done(pool, after[0]), KVB_OK);
    KVT_EQ(kvb_seq_truncate(s, 12), KVB_ESTATE);
    KVT_EQ(fx_info(pool, after[0].id).state, KVB_STATE_COMPLETE);
    KVT_EQ(kvb_seq_truncate(s, 0), KVB_OK); /* whole blocks can always go */
    KVT_EQ(fx_seq_info(s).num_blocks, 0);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(s);
    KVT_EQ(fx_stats(pool).free_blocks, 8);
    kvb_pool_destroy(pool);
}

static void test_chunked_commit_registers_full_blocks_only(void)
{
    kvb_pool *pool = fx_pool(16);
    uint32_t tokens[64];
    fx_iota(tokens, 64, 20);
    kvb_seq *s = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(s, tokens, 64, NULL), KVB_OK);
    kvb_block table[4];
    KVT_EQ(fx_seq_table(s, table, 4), 4);

    const size_t chunks[] = {20, 40, 64};
    const int registered[] = {1, 2, 4};
    for (int c = 0; c < 3; c++) {
        KVT_EQ(kvb_seq_commit(s, chunks[c]), KVB_OK);
        KVT_EQ(fx_seq_info(s).num_computed, chunks[c]);
        KVT_EQ(fx_stats(pool).registrations, registered[c]);
        for (int i = 0; i < 4; i++)
            KVT_EQ(fx_info(pool, table[i].id).state == KVB_STATE_REGISTERED, i < registered[c]);
        FX_CHECK_POOL(pool);
    }
    KVT_EQ(kvb_seq_commit(s, 65), KVB_ERANGE);
    KVT_EQ(fx_stats(pool).registrations, 4);
    kvb_seq_destroy(s);
    KVT_EQ(fx_stats(pool).inactive_blocks, 4);
    kvb_pool_destroy(pool);
}

/* kvb_seq_append_new never takes blocks from the cache, where kvb_seq_append would: with one token a
 * block, a fully cached prompt's last token is a cached block by itself, which the engine must not be
 * told to write. Its block is new (Empty, the sequence's alone), no lookup is counted, and appends
 * after it match nothing either. With 4 tokens a block, full cached blocks are not taken. */
static void append_new_never_matches(uint32_t bt)
{
    kvb_pool_config cfg = fx_config(32);
    cfg.block_tokens = bt;
    kvb_pool *pool = fx_pool_from(&cfg);
    uint32_t tokens[8];
    fx_iota(tokens, 8, 70);
    kvb_seq *a = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(a, tokens, 8, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(a, 8), KVB_OK); /* every full block of the prompt registered */
    size_t registered = fx_stats(pool).registrations;

    kvb_seq *b = fx_seq(pool, NULL), *c = fx_seq(pool, NULL);
    size_t cached = 0;
    KVT_EQ(kvb_seq_append(b, tokens, 7, &cached), KVB_OK); /* the prompt but its last token */
    KVT_EQ(cached, bt == 1 ? 7u : 4u);
    kvb_pool_stats before = fx_stats(pool);
    KVT_EQ(kvb_seq_append_new(b, tokens + 7, 1), KVB_OK);
    kvb_block tb[8], ta[8];
    KVT_EQ(fx_seq_table(b, tb, 8), 8 / bt);
    KVT_EQ(fx_seq_table(a, ta, 8), 8 / bt);
    kvb_block_info last = fx_info(pool, tb[8 / bt - 1].id);
    KVT_CHECK(tb[8 / bt - 1].id != ta[8 / bt - 1].id); /* not the cached block */
    KVT_CHECK(last.state != KVB_STATE_REGISTERED);
    KVT_EQ(last.refs, 1);
    KVT_EQ(fx_stats(pool).lookups, before.lookups); /* nothing looked up */
    KVT_EQ(fx_seq_info(b).num_computed, bt == 1 ? 7u : 4u);
    uint32_t more = 99;
    KVT_EQ(kvb_seq_append(b, &more, 1, &cached), KVB_OK); /* past a computed token: no match either */
    KVT_EQ(cached, 0);

    /* from the start: full cached blocks are not taken (kvb_seq_append would take them) */
    KVT_EQ(kvb_seq_append_new(c, tokens, 8), KVB_OK);
    kvb_block tc[8];
    KVT_EQ(fx_seq_table(c, tc, 8), 8 / bt);
    for (uint32_t i = 0; i < 8 / bt; i++) {
        KVT_CHECK(tc[i].id != ta[i].id);
        KVT_EQ(fx_info(pool, tc[i].id).refs, 1);
    }
    KVT_EQ(fx_seq_info(c).num_computed, 0);
    KVT_EQ(kvb_seq_append_new(NULL, tokens, 1), KVB_EINVAL);
    KVT_EQ(kvb_seq_append_new(c, NULL, 1), KVB_EINVAL);
    KVT_EQ(kvb_seq_append_new(c, NULL, 0), KVB_OK);
    KVT_EQ(fx_stats(pool).registrations, registered);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(a);
    kvb_seq_destroy(b);
    kvb_seq_destroy(c);
    KVT_EQ(fx_stats(pool).active_blocks, 0);
    kvb_pool_destroy(pool);
}

static void test_append_new_never_matches_one_token_blocks(void) { append_new_never_matches(1); }
static void test_append_new_never_matches_four_token_blocks(void) { append_new_never_matches(4); }

/* Reserved room keeps appends in place; a reset gives the blocks back as a destroy does (full ones stay
 * cached) and starts over with the new salt and keys, in the same memory; a bad config changes nothing. */
static void test_reset_releases_blocks_and_starts_over(void)
{
    kvb_pool *pool = fx_pool(16);
    uint64_t extra[1] = {3};
    kvb_seq_config first = {.salt = 1}, again = {.salt = 2, .extra = extra, .n_extra = 1};
    kvb_seq_config bad = {.n_extra = 1};
    kvb_seq *s = fx_seq(pool, &first);
    uint32_t tokens[40];
    const uint32_t *kept = NULL, *now = NULL;
    size_t n = 0;
    kvb_hash h[2];
    fx_iota(tokens, 40, 11);
    KVT_EQ(kvb_seq_reserve(s, 64), KVB_OK);
    KVT_EQ(kvb_seq_reserve(NULL, 64), KVB_EINVAL);
    KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
    KVT_EQ(kvb_seq_tokens(s, &kept, &n), KVB_OK);
    KVT_EQ(kvb_seq_append(s, tokens + 20, 20, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(s, 40), KVB_OK);
    KVT_EQ(kvb_seq_tokens(s, &now, &n), KVB_OK);
    KVT_CHECK(now == kept); /* appends within the reserved room did not move the array */
    KVT_EQ(kvb_seq_reset(s, &bad), KVB_EINVAL);
    KVT_EQ(fx_seq_info(s).num_tokens, 40); /* nothing changed */
    KVT_EQ(kvb_seq_reset(NULL, NULL), KVB_EINVAL);

    KVT_EQ(kvb_seq_reset(s, &again), KVB_OK);
    KVT_EQ(fx_seq_info(s).num_tokens, 0);
    KVT_EQ(fx_seq_info(s).num_blocks, 0);
    KVT_EQ(fx_stats(pool).active_blocks, 0);
    KVT_EQ(fx_stats(pool).inactive_blocks, 2); /* the full blocks stay cached */
    KVT_EQ(kvb_hash_prompt(tokens, 40, 16, NULL, 0, 1, h, 2, &n), KVB_OK);
    KVT_EQ(fx_lookup(pool, h, 2), 2);

    KVT_EQ(kvb_seq_append(s, tokens, 40, NULL), KVB_OK); /* the new salt and keys: no hit */
    KVT_EQ(fx_seq_info(s).num_cached, 0);
    check_hashes(s, tokens, 40, extra, 1, 2);
    KVT_EQ(kvb_seq_tokens(s, &now, &n), KVB_OK);
    KVT_CHECK(now == kept); /* the same array after the reset */
    kvb_seq_destroy(s);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

static void test_append_without_space_changes_nothing(void)
{
    kvb_pool *pool = fx_pool(4);
    uint32_t tokens[72];
    fx_iota(tokens, 72, 1);
    kvb_seq *s = fx_seq(pool, NULL), *t = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(s, tokens, 40, NULL), KVB_OK); /* 3 blocks, the last with 8 tokens */
    kvb_block table[4];
    KVT_EQ(fx_seq_table(s, table, 4), 3);
    kvb_block_info tail = fx_info(pool, table[2].id);
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_seq_append(t, tokens, 40, NULL), KVB_ENOSPACE);
    KVT_EQ(fx_seq_info(t).num_tokens, 0);
    KVT_EQ(fx_seq_info(t).num_blocks, 0);
    KVT_EQ(kvb_seq_append(s, tokens + 40, 32, NULL), KVB_ENOSPACE); /* 8 fit, 24 need 2 more blocks */

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    kvb_seq_info info = fx_seq_info(s);
    KVT_EQ(info.num_tokens, 40);
    KVT_EQ(info.num_blocks, 3);
    KVT_EQ(info.num_full, 2);
    kvb_block_info tail_after = fx_info(pool, table[2].id);
    KVT_CHECK(fx_info_equal(&tail, &tail_after));
    check_hashes(s, tokens, 40, NULL, 0, 0);
    KVT_EQ(kvb_seq_append(s, tokens + 40, 24, NULL), KVB_OK); /* what fits still fits */
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(s);
    kvb_seq_destroy(t);
    kvb_pool_destroy(pool);
}

/* Copy-on-write needs a block too: with none left, writing to the shared tail is refused cleanly. */
static void test_copy_on_write_without_space_changes_nothing(void)
{
    kvb_pool *pool = fx_pool(3);
    uint32_t tokens[21];
    fx_iota(tokens, 21, 1);
    kvb_seq *s = fx_seq(pool, NULL), *t = NULL;
    KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
    KVT_EQ(kvb_seq_fork(s, &t), KVB_OK);
    kvb_block last = {0};
    KVT_EQ(kvb_alloc(pool, 1, &last), KVB_OK); /* the pool is now full */
    kvb_block table[2];
    KVT_EQ(fx_seq_table(s, table, 2), 2);
    kvb_pool_stats before = fx_stats(pool);

    KVT_EQ(kvb_seq_append(s, tokens + 20, 1, NULL), KVB_ENOSPACE);

    kvb_pool_stats after = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&before, &after));
    KVT_EQ(fx_info(pool, table[1].id).refs, 2);
    KVT_EQ(fx_info(pool, table[1].id).num_tokens, 4);
    KVT_EQ(fx_seq_info(s).num_tokens, 20);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, &last, 1, NULL), KVB_OK);
    KVT_EQ(kvb_seq_append(s, tokens + 20, 1, NULL), KVB_OK);
    KVT_EQ(fx_info(pool, table[1].id).refs, 1);
    kvb_seq_destroy(s);
    kvb_seq_destroy(t);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* ---- the copy_block hook: what a device pool (kvcuda) plugs in ---------------------------------- */

typedef struct copy_log {
    int calls, fail;      /* fail: refuse every copy */
    size_t n;             /* spans of the last call */
    uint64_t bytes;       /* span size of the last call */
} copy_log;

static int logged_copy(void *user, void *const *dst, const void *const *src, size_t n, uint64_t bytes)
{
    copy_log *log = (copy_log *)user;
    log->calls++;
    log->n = n;
    log->bytes = bytes;
    if (log->fail) return -1;
    for (size_t i = 0; i < n; i++) memcpy(dst[i], src[i], (size_t)bytes);
    return 0;
}

static kvb_pool *hooked_pool(uint32_t num_blocks, kvb_layout_kind kind, copy_log *log)
{
    kvb_pool_config cfg = fx_config(num_blocks);
    cfg.storage = KVB_STORAGE_HOST;
    cfg.copy_block = logged_copy;
    cfg.copy_user = log;
    KVT_EQ(kvb_layout_for_model(kind, 16, LAYERS, 2, 8, 2, &cfg.layout), KVB_OK);
    return fx_pool_from(&cfg);
}

/* Fork, then both branches write the shared partial block: each copy goes through the hook (one span
 * per page in a layer-separate pool, the whole block in a block-contiguous one) with the bytes; a
 * truncate into a registered block copies through it too. */
static void test_copy_hook_carries_fork_and_truncate(void)
{
    const kvb_layout_kind kinds[2] = {KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_BLOCK_CONTIGUOUS};
    for (int k = 0; k < 2; k++) {
        copy_log log;
        memset(&log, 0, sizeof log);
        kvb_pool *pool = hooked_pool(16, kinds[k], &log);
        uint32_t tokens[40];
        fx_iota(tokens, 40, 900);
        kvb_seq *s = fx_seq(pool, NULL), *t = NULL;
        KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
        KVT_EQ(kvb_seq_commit(s, 20), KVB_OK);
        kvb_block before[2];
        KVT_EQ(fx_seq_table(s, before, 2), 2);
        fill_block(pool, before[1], 0x5a);
        KVT_EQ(kvb_seq_fork(s, &t), KVB_OK);
        KVT_EQ(log.calls, 0); /* a fork shares, it copies nothing */

        KVT_EQ(kvb_seq_append(s, tokens + 20, 1, NULL), KVB_OK);
        KVT_EQ(log.calls, 1);
        KVT_EQ(log.n, kinds[k] == KVB_LAYOUT_LAYER_SEPARATE ? 2 * LAYERS : 1);
        KVT_EQ(log.bytes, kinds[k] == KVB_LAYOUT_LAYER_SEPARATE ? PAGE : 2 * LAYERS * PAGE);
        KVT_EQ(kvb_seq_append(t, tokens + 30, 1, NULL), KVB_OK); /* t is the last owner now: no copy */
        KVT_EQ(log.calls, 1);
        kvb_block ts[2], tt[2];
        KVT_EQ(fx_seq_table(s, ts, 2), 2);
        KVT_EQ(fx_seq_table(t, tt, 2), 2);
        KVT_CHECK(kvb_block_index(ts[1].id) != kvb_block_index(tt[1].id));
        KVT_EQ(pages_differing(pool, ts[1], 0x5a), 0);
        KVT_EQ(pages_differing(pool, tt[1], 0x5a), 0);

        KVT_EQ(kvb_seq_append(s, tokens + 21, 11, NULL), KVB_OK);
        KVT_EQ(kvb_seq_commit(s, 32), KVB_OK); /* block 1 of s is registered now */
        KVT_EQ(fx_seq_table(s, ts, 2), 2);
        fill_block(pool, ts[1], 0x6b);
        KVT_EQ(kvb_seq_truncate(s, 24), KVB_OK);
        KVT_EQ(log.calls, 2);
        kvb_block after[2];
        KVT_EQ(fx_seq_table(s, after, 2), 2);
        KVT_CHECK(kvb_block_index(after[1].id) != kvb_block_index(ts[1].id));
        KVT_EQ(pages_differing(pool, after[1], 0x6b), 0);
        kvb_seq_destroy(s);
        kvb_seq_destroy(t);
        FX_CHECK_POOL(pool);
        kvb_pool_destroy(pool);
    }
}

/* A hook that fails: append and truncate return KVB_ECOPY and change nothing; a truncate that had to
 * free its tail for the copy ends at the block boundary below. */
static void test_failed_copy_changes_nothing(void)
{
    copy_log log;
    memset(&log, 0, sizeof log);
    log.fail = 1;
    kvb_pool *pool = hooked_pool(8, KVB_LAYOUT_LAYER_SEPARATE, &log);
    uint32_t tokens[40];
    fx_iota(tokens, 40, 1);
    kvb_seq *s = fx_seq(pool, NULL), *t = NULL;
    KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
    KVT_EQ(kvb_seq_fork(s, &t), KVB_OK);
    kvb_block table[2];
    KVT_EQ(fx_seq_table(s, table, 2), 2);
    kvb_pool_stats st0 = fx_stats(pool);
    KVT_EQ(kvb_seq_append(s, tokens + 20, 1, NULL), KVB_ECOPY);
    kvb_pool_stats st1 = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&st0, &st1));
    KVT_EQ(log.calls, 1);
    KVT_EQ(fx_seq_info(s).num_tokens, 20);
    KVT_EQ(fx_info(pool, table[1].id).refs, 2);
    KVT_EQ(kvb_seq_truncate(s, 18), KVB_ECOPY); /* into the shared block: a copy, refused */
    st1 = fx_stats(pool);
    KVT_CHECK(fx_stats_equal(&st0, &st1));
    KVT_EQ(fx_seq_info(s).num_tokens, 20);
    FX_CHECK_POOL(pool);

    /* a full pool: s = [b0 shared with t, b1' its own copy, registered, b2 its own partial tail] */
    log.fail = 0;
    KVT_EQ(kvb_seq_append(s, tokens + 20, 20, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(s, 40), KVB_OK);
    kvb_block rest[4];
    KVT_EQ(kvb_alloc(pool, 4, rest), KVB_OK);
    KVT_EQ(fx_stats(pool).free_blocks, 0);
    log.fail = 1;
    log.calls = 0;
    KVT_EQ(kvb_seq_truncate(s, 20), KVB_ECOPY);
    KVT_EQ(log.calls, 1);
    kvb_seq_info info = fx_seq_info(s);
    KVT_EQ(info.num_tokens, 16);
    KVT_EQ(info.num_blocks, 1);
    KVT_EQ(info.num_full, 1);
    KVT_EQ(fx_seq_info(t).num_tokens, 20); /* the other owner keeps everything */
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, rest, 4, NULL), KVB_OK);
    kvb_seq_destroy(s);
    kvb_seq_destroy(t);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A hash_fn that leaves out the parent gives equal blocks equal hashes, so one cached block can match
 * several blocks of an append: it frees room once, not once per match. One block in the pool, cached and
 * inactive; an append of two such blocks and a partial third needs a block it cannot have: KVB_ENOSPACE,
 * nothing changed (it used to count the cached block twice, pass the space check and write through
 * KVB__NIL when it allocated the third). */
static void tokens_only_hash(const kvb_hash *parent, const uint32_t *tokens, size_t n, const uint64_t *extra,
                             size_t n_extra, uint64_t salt, kvb_hash *out, void *user)
{
    (void)parent;
    (void)user;
    *out = kvb_hash_block(NULL, tokens, n, extra, n_extra, salt);
}

static void test_append_counts_a_block_matched_twice_once(void)
{
    kvb_pool_config cfg = fx_config(1);
    cfg.hash_fn = tokens_only_hash;
    kvb_pool *pool = fx_pool_from(&cfg);
    uint32_t tokens[33];
    for (int i = 0; i < 33; i++) tokens[i] = 1;
    tokens[32] = 2;
    kvb_seq *a = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(a, tokens, 16, NULL), KVB_OK);
    KVT_EQ(kvb_seq_commit(a, 16), KVB_OK);
    kvb_seq_destroy(a);
    KVT_EQ(fx_stats(pool).inactive_blocks, 1);
    kvb_seq *b = fx_seq(pool, NULL);
    KVT_EQ(kvb_seq_append(b, tokens, 33, NULL), KVB_ENOSPACE);
    KVT_EQ(fx_seq_info(b).num_tokens, 0);
    KVT_EQ(fx_seq_info(b).num_blocks, 0);
    KVT_EQ(fx_stats(pool).inactive_blocks, 1);
    size_t cached = 0;
    KVT_EQ(kvb_seq_append(b, tokens, 32, &cached), KVB_OK); /* both matches fit: the one block, twice */
    KVT_EQ(cached, 32);
    FX_CHECK_POOL(pool);
    kvb_seq_destroy(b);
    KVT_EQ(fx_stats(pool).active_blocks, 0);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A reserve no memory could hold is refused, and the sequence works as before: stbds_arrsetcap wrapped
 * 4 x 2^62 bytes of tokens to a 32-byte buffer with a capacity of 2^62, then crashed on the NULL of the
 * next, failed realloc. */
static void test_reserve_beyond_memory_is_refused(void)
{
    kvb_pool *pool = fx_pool(8);
    kvb_seq *seq = fx_seq(pool, NULL);
    uint32_t tokens[100];
    fx_iota(tokens, 100, 1);
    KVT_EQ(kvb_seq_reserve(seq, (SIZE_MAX >> 2) + 1), KVB_ERANGE);
    KVT_EQ(kvb_seq_reserve(seq, SIZE_MAX), KVB_ERANGE);
    KVT_EQ(kvb_seq_reserve(seq, 40), KVB_OK);
    KVT_EQ(kvb_seq_append(seq, tokens, 100, NULL), KVB_OK); /* past the reservation: the arrays grow */
    KVT_EQ(fx_seq_info(seq).num_tokens, 100);
    check_hashes(seq, tokens, 100, NULL, 0, 0);
    KVT_EQ(kvb_seq_reserve(NULL, 1), KVB_EINVAL);
    kvb_seq_destroy(seq);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* An append whose count would take the sequence past what kvb_seq_reserve takes is refused, changing
 * nothing: the length plus a count near SIZE_MAX wrapped below the tokens' room, and the append copied
 * that count of tokens (an ASan negative-size memcpy). */
static void test_append_past_any_memory_is_refused(void)
{
    kvb_pool *pool = fx_pool(8);
    kvb_seq *seq = fx_seq(pool, NULL);
    uint32_t tokens[40];
    const uint32_t *ptr[1] = {tokens};
    size_t cnt[1] = {SIZE_MAX - 2}, done = 7, cached = 7;
    kvb_seq_info info;
    fx_iota(tokens, 40, 1);
    KVT_EQ(kvb_seq_append(seq, tokens, 5, NULL), KVB_OK);
    KVT_EQ(kvb_seq_append(seq, tokens, SIZE_MAX - 2, &cached), KVB_ERANGE);
    KVT_EQ(cached, 0);
    KVT_EQ(kvb_seq_append(seq, tokens, SIZE_MAX, NULL), KVB_ERANGE);
    KVT_EQ(kvb_seq_append_new(seq, tokens, SIZE_MAX - 4), KVB_ERANGE);
    KVT_EQ(kvb_seq_append_many(&seq, ptr, cnt, 1, &done), KVB_ERANGE);
    KVT_EQ(done, 0);
    info = fx_seq_info(seq);
    KVT_EQ(info.num_tokens, 5);
    KVT_EQ(info.num_blocks, 1);
    KVT_EQ(kvb_seq_append(seq, tokens + 5, 35, NULL), KVB_OK); /* and it works as before */
    check_hashes(seq, tokens, 40, NULL, 0, 0);
    kvb_seq_destroy(seq);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

/* A prefill's commit fetches the index slots of the blocks it registers ahead (16 at a time): the
 * outcome must be what committing a block at a time gives, after a cached prefix, with duplicates of
 * another sequence's blocks among them and a partial block at the end. */
static void test_long_commit_same_as_block_by_block(void)
{
    enum { PREFIX = 5, NEW = 40, TAIL = 7, TOTAL = (PREFIX + NEW) * 16 + TAIL };
    static uint32_t tokens[TOTAL];
    kvb_pool *pool[2];
    kvb_seq *kept[2];
    kvb_block table[2][PREFIX + NEW + 1];
    size_t n[2], i;
    fx_iota(tokens, TOTAL, 700);
    for (int k = 0; k < 2; k++) {
        kvb_seq *first, *twin, *seq;
        size_t cached = 0;
        pool[k] = fx_pool(4 * (PREFIX + NEW + 1));
        first = fx_seq(pool[k], NULL); /* the cached prefix */
        KVT_EQ(kvb_seq_append(first, tokens, PREFIX * 16, &cached), KVB_OK);
        KVT_EQ(kvb_seq_commit(first, PREFIX * 16), KVB_OK);
        kvb_seq_destroy(first);
        seq = fx_seq(pool[k], NULL);
        twin = fx_seq(pool[k], NULL);
        KVT_EQ(kvb_seq_append(seq, tokens, TOTAL, &cached), KVB_OK);
        KVT_EQ(cached, PREFIX * 16);
        KVT_EQ(kvb_seq_append(twin, tokens, (PREFIX + 20) * 16, &cached), KVB_OK);
        KVT_EQ(kvb_seq_commit(twin, (PREFIX + 20) * 16), KVB_OK); /* registered first: seq's are duplicates */
        if (k == 0) {
            KVT_EQ(kvb_seq_commit(seq, TOTAL), KVB_OK);
        } else {
            for (size_t upto = (PREFIX + 1) * 16; upto <= (PREFIX + NEW) * 16; upto += 16)
                KVT_EQ(kvb_seq_commit(seq, upto), KVB_OK);
            KVT_EQ(kvb_seq_commit(seq, TOTAL), KVB_OK);
        }
        n[k] = fx_seq_table(seq, table[k], PREFIX + NEW + 1);
        FX_CHECK_POOL(pool[k]);
        kvb_seq_destroy(twin);
        kept[k] = seq; /* its blocks are compared below */
    }
    KVT_EQ(n[0], PREFIX + NEW + 1);
    KVT_EQ(n[0], n[1]);
    for (i = 0; i < n[0] && i < n[1]; i++) {
        kvb_block_info a, b;
        KVT_EQ(table[0][i].id, table[1][i].id);
        KVT_EQ(kvb_block_get_info(pool[0], table[0][i].id, &a), KVB_OK);
        KVT_EQ(kvb_block_get_info(pool[1], table[1][i].id, &b), KVB_OK);
        kvb_block_state want = i < PREFIX + NEW ? KVB_STATE_REGISTERED : KVB_STATE_PARTIAL; /* full blocks only */
        if (a.state != want) fprintf(stderr, "  block %zu: state %d\n", i, (int)a.state);
        KVT_EQ(a.state, want);
        KVT_EQ(a.state, b.state);
        KVT_EQ(a.refs, b.refs);
        FX_HASH_EQ(a.hash, b.hash);
    }
    KVT_EQ(fx_stats(pool[0]).registrations, fx_stats(pool[1]).registrations);
    KVT_EQ(fx_stats(pool[0]).dedups, fx_stats(pool[1]).dedups);
    KVT_EQ(fx_stats(pool[0]).dedups, 20);
    kvb_seq_destroy(kept[0]);
    kvb_seq_destroy(kept[1]);
    kvb_pool_destroy(pool[0]);
    kvb_pool_destroy(pool[1]);
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_append_in_pieces_hashes_like_prompt);
    KVT_RUN(test_fork_copies_shared_partial_block_on_write);
    KVT_RUN(test_shared_blocks_freed_by_last_owner);
    KVT_RUN(test_truncate_releases_tail_and_copies_kept_partial);
    KVT_RUN(test_truncate_inside_private_blocks);
    KVT_RUN(test_sequence_blocks_change_through_the_sequence);
    KVT_RUN(test_chunked_commit_registers_full_blocks_only);
    KVT_RUN(test_append_new_never_matches_one_token_blocks);
    KVT_RUN(test_append_new_never_matches_four_token_blocks);
    KVT_RUN(test_reset_releases_blocks_and_starts_over);
    KVT_RUN(test_append_without_space_changes_nothing);
    KVT_RUN(test_copy_on_write_without_space_changes_nothing);
    KVT_RUN(test_copy_hook_carries_fork_and_truncate);
    KVT_RUN(test_failed_copy_changes_nothing);
    KVT_RUN(test_append_counts_a_block_matched_twice_once);
    KVT_RUN(test_reserve_beyond_memory_is_refused);
    KVT_RUN(test_append_past_any_memory_is_refused);
    KVT_RUN(test_long_commit_same_as_block_by_block);
    return kvt_summary();
}
