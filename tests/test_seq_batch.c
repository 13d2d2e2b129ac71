/* Batched sequence calls (kvb_seq_append_many, kvb_seq_commit_many): one lock for a step's worth of
 * sequences, the same result as the calls one by one, a stop at the first append that does not fit
 * (it and the ones after it unchanged), and arguments checked before anything changes. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

enum { SEQS = 24, BT = 16 };

/* Per sequence i: a prompt of 20 + i tokens (some share their first block), appended and committed. */
static void start(kvb_pool *pool, kvb_seq **s, uint32_t *tok)
{
    for (int i = 0; i < SEQS; i++) {
        for (int t = 0; t < 20 + i; t++) tok[t] = (uint32_t)(t < BT ? t + (i % 3) * 100 : 1000 * i + t);
        KVT_EQ(kvb_seq_create(pool, NULL, &s[i]), KVB_OK);
        KVT_EQ(kvb_seq_append(s[i], tok, (size_t)(20 + i), NULL), KVB_OK);
        KVT_EQ(kvb_seq_commit(s[i], (size_t)(20 + i)), KVB_OK);
    }
}

/* Two pools driven the same way, one by batches and one call by call, end up the same. */
static void test_batches_equal_one_by_one(void)
{
    kvb_pool *a = fx_pool(512), *b = fx_pool(512);
    kvb_seq *sa[SEQS], *sb[SEQS];
    uint32_t tok[64], next[SEQS];
    const uint32_t *ptr[SEQS];
    size_t cnt[SEQS], upto[SEQS], done = 0;
    start(a, sa, tok);
    start(b, sb, tok);
    for (int step = 0; step < 40; step++) { /* decode: one token each, some cross a block */
        for (int i = 0; i < SEQS; i++) {
            kvb_seq_info info;
            next[i] = (uint32_t)(7 * step + i);
            ptr[i] = &next[i];
            cnt[i] = 1;
            KVT_EQ(kvb_seq_append(sb[i], &next[i], 1, NULL), KVB_OK);
            KVT_EQ(kvb_seq_get_info(sb[i], &info), KVB_OK);
            upto[i] = info.num_tokens;
            KVT_EQ(kvb_seq_commit(sb[i], upto[i]), KVB_OK);
        }
        KVT_EQ(kvb_seq_append_many(sa, ptr, cnt, SEQS, &done), KVB_OK);
        KVT_EQ(done, SEQS);
        KVT_EQ(kvb_seq_commit_many(sa, upto, SEQS), KVB_OK);
    }
    for (int i = 0; i < SEQS; i++) {
        const kvb_hash *ha, *hb;
        const kvb_block *ta, *tb;
        size_t na, nb, ka, kb;
        kvb_seq_info ia, ib;
        KVT_EQ(kvb_seq_hashes(sa[i], &ha, &na), KVB_OK);
        KVT_EQ(kvb_seq_hashes(sb[i], &hb, &nb), KVB_OK);
        KVT_EQ(na, nb);
        for (size_t k = 0; k < na && k < nb; k++) FX_HASH_EQ(ha[k], hb[k]);
        KVT_EQ(kvb_seq_blocks(sa[i], &ta, &ka), KVB_OK);
        KVT_EQ(kvb_seq_blocks(sb[i], &tb, &kb), KVB_OK);
        KVT_EQ(ka, kb);
        for (size_t k = 0; k < ka && k < kb; k++) {
            kvb_block_info x, y;
            KVT_EQ(kvb_block_get_info(a, ta[k].id, &x), KVB_OK);
            KVT_EQ(kvb_block_get_info(b, tb[k].id, &y), KVB_OK);
            KVT_EQ(x.state, y.state);
            KVT_EQ(x.refs, y.refs);
            KVT_EQ(x.num_tokens, y.num_tokens);
            KVT_EQ(ta[k].id, tb[k].id); /* the same blocks, allocated in the same order */
        }
        KVT_EQ(kvb_seq_get_info(sa[i], &ia), KVB_OK);
        KVT_EQ(kvb_seq_get_info(sb[i], &ib), KVB_OK);
        KVT_EQ(ia.num_computed, ib.num_computed);
        KVT_EQ(ia.num_cached, ib.num_cached);
    }
    kvb_pool_stats st_a, st_b;
    KVT_EQ(kvb_pool_get_stats(a, &st_a), KVB_OK);
    KVT_EQ(kvb_pool_get_stats(b, &st_b), KVB_OK);
    KVT_EQ(st_a.registrations, st_b.registrations);
    KVT_EQ(st_a.lookups, st_b.lookups);
    KVT_EQ(st_a.hit_blocks, st_b.hit_blocks);
    KVT_EQ(st_a.active_blocks, st_b.active_blocks);
    FX_CHECK_POOL(a);
    FX_CHECK_POOL(b);
    for (int i = 0; i < SEQS; i++) {
        kvb_seq_destroy(sa[i]);
        kvb_seq_destroy(sb[i]);
    }
    kvb_pool_destroy(a);
    kvb_pool_destroy(b);
}

/* Four sequences each needing a new block, in a pool with two free: the first two get theirs, the third
 * stops the batch with KVB_ENOSPACE, and it and the fourth are as before. */
static void test_append_many_stops_at_first_failure(void)
{
    kvb_pool *pool = fx_pool(6);
    kvb_seq *s[4];
    uint32_t tok[BT], more[4] = {1, 2, 3, 4};
    const uint32_t *ptr[4] = {&more[0], &more[1], &more[2], &more[3]};
    size_t cnt[4] = {1, 1, 1, 1}, done = 99;
    for (int i = 0; i < 4; i++) {
        for (int t = 0; t < BT; t++) tok[t] = (uint32_t)(100 * i + t);
        KVT_EQ(kvb_seq_create(pool, NULL, &s[i]), KVB_OK);
        KVT_EQ(kvb_seq_append(s[i], tok, BT, NULL), KVB_OK); /* one full block each: 4 of 6 used */
    }
    KVT_EQ(kvb_seq_append_many(s, ptr, cnt, 4, &done), KVB_ENOSPACE);
    KVT_EQ(done, 2);
    for (int i = 0; i < 4; i++) {
        kvb_seq_info info;
        KVT_EQ(kvb_seq_get_info(s[i], &info), KVB_OK);
        KVT_EQ(info.num_tokens, i < 2 ? BT + 1 : BT);
        KVT_EQ(info.num_blocks, i < 2 ? 2 : 1);
    }
    FX_CHECK_POOL(pool);
    for (int i = 0; i < 4; i++) kvb_seq_destroy(s[i]);
    kvb_pool_destroy(pool);
}

static void test_arguments(void)
{
    kvb_pool *p = fx_pool(16), *q = fx_pool(16);
    kvb_seq *s[2], *other[2];
    uint32_t t = 5;
    const uint32_t *ptr[2] = {&t, &t};
    size_t cnt[2] = {1, 1}, upto[2] = {0, 5}, done = 7;
    KVT_EQ(kvb_seq_create(p, NULL, &s[0]), KVB_OK);
    KVT_EQ(kvb_seq_create(p, NULL, &s[1]), KVB_OK);
    KVT_EQ(kvb_seq_create(q, NULL, &other[1]), KVB_OK);
    other[0] = s[0];
    KVT_EQ(kvb_seq_append_many(s, ptr, cnt, 2, NULL), KVB_EINVAL);
    KVT_EQ(kvb_seq_append_many(NULL, ptr, cnt, 2, &done), KVB_EINVAL);
    KVT_EQ(kvb_seq_append_many(other, ptr, cnt, 2, &done), KVB_EINVAL); /* two pools */
    kvb_seq *twice[2] = {s[0], s[0]};
    KVT_EQ(kvb_seq_append_many(twice, ptr, cnt, 2, &done), KVB_EINVAL);
    KVT_EQ(kvb_seq_commit_many(twice, cnt, 2), KVB_EINVAL);
    KVT_EQ(kvb_seq_commit_many(s, upto, 2), KVB_ERANGE); /* 5 tokens past the end: nothing changes */
    KVT_EQ(kvb_seq_append_many(s, ptr, cnt, 0, &done), KVB_OK);
    KVT_EQ(done, 0);
    KVT_EQ(kvb_seq_append_many(s, ptr, cnt, 2, &done), KVB_OK);
    KVT_EQ(done, 2);
    for (int i = 0; i < 2; i++) {
        kvb_seq_info info;
        KVT_EQ(kvb_seq_get_info(s[i], &info), KVB_OK);
        KVT_EQ(info.num_tokens, 1);
        KVT_EQ(info.num_computed, 0);
    }
    FX_CHECK_POOL(p);
    kvb_seq_destroy(s[0]);
    kvb_seq_destroy(s[1]);
    kvb_seq_destroy(other[1]);
    kvb_pool_destroy(p);
    kvb_pool_destroy(q);
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_batches_equal_one_by_one);
    KVT_RUN(test_append_many_stops_at_first_failure);
    KVT_RUN(test_arguments);
    return kvt_summary();
}
