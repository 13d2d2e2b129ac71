/* Block hashing of kvblock.h: the properties a prefix cache relies on, the byte order of manual
 * section 3 (checked against an independent implementation written from the manual), fixed test
 * vectors, and a user hash function plugged into a pool. */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

/* ---- section 3, written again from the manual's words -------------------------------------------- */

static const uint64_t C[16] = { /* the constants of kvb__hk */
    UINT64_C(0x91d93080f9b439fd), UINT64_C(0x3ceaaf308142c8eb), UINT64_C(0x627655daa05f1119),
    UINT64_C(0x9dfb369bab13dfaf), UINT64_C(0x0ff9bb510944fe0d), UINT64_C(0x6301bbfca0c5154f),
    UINT64_C(0x047a8387cdde8d51), UINT64_C(0x6fced11d2bd8a1e7), UINT64_C(0xb7c1dce27f7695f5),
    UINT64_C(0x3a124c647e02ff05), UINT64_C(0x5cbd0ba3a1a6bcdf), UINT64_C(0x66080f174c96d8e3),
    UINT64_C(0x42f2dc05873f9bd1), UINT64_C(0xb120a366f0bbe9cf), UINT64_C(0xce4cda11b43c589b),
    UINT64_C(0x78b7d0ac84773ce1),
};

static uint64_t rotl(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }

/* low ^ high half of the 128-bit product, from four 32x32 products */
static uint64_t mix(uint64_t x, uint64_t y)
{
    uint64_t x0 = (uint32_t)x, x1 = x >> 32, y0 = (uint32_t)y, y1 = y >> 32;
    uint64_t p00 = x0 * y0, p01 = x0 * y1, p10 = x1 * y0, p11 = x1 * y1;
    uint64_t carry = ((p00 >> 32) + (uint32_t)p01 + (uint32_t)p10) >> 32;
    uint64_t low = x * y;
    uint64_t high = p11 + (p01 >> 32) + (p10 >> 32) + carry;
    return low ^ high;
}

static uint64_t fin(uint64_t v)
{
    v ^= v >> 32;
    v *= C[2];
    v ^= v >> 29;
    v *= C[4];
    v ^= v >> 32;
    return v;
}

static kvb_hash reference_hash(kvb_hash parent, const uint32_t *tokens, size_t n, const uint64_t *extra,
                               size_t n_extra, uint64_t salt)
{
    uint64_t words[256];
    size_t w = 0;
    for (size_t i = 0; i < n; i += 2)
        words[w++] = (uint64_t)tokens[i] | (i + 1 < n ? (uint64_t)tokens[i + 1] << 32 : 0);
    for (size_t i = 0; i < n_extra; i++) words[w++] = extra[i];
    words[w++] = (uint64_t)n | (uint64_t)n_extra << 32;

    uint64_t a = parent.lo ^ salt ^ C[0], b = parent.hi ^ rotl(salt, 32) ^ C[1];
    for (size_t i = 0, j = 0; i < w; i += 2, j++) {
        uint64_t x = words[i], y = i + 1 < w ? words[i + 1] : 0;
        size_t k = j & 15;
        a = rotl(a, 29) + mix(x ^ C[k], y ^ C[(k + 5) & 15]);
        b = rotl(b, 37) ^ mix(y ^ C[(k + 9) & 15], x ^ C[(k + 3) & 15]);
    }
    kvb_hash h;
    h.lo = a ^ fin(b + C[6]);
    h.hi = b ^ fin(h.lo + C[7]);
    h.lo ^= fin(h.hi + C[8]);
    return h;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* ---- properties ------------------------------------------------------------------------------------ */

static uint32_t T16[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static void test_deterministic(void)
{
    kvb_hash p = fx_hash(123, 456);
    uint64_t extra[2] = {7, 8};
    kvb_hash a = kvb_hash_block(&p, T16, 16, extra, 2, 99);
    kvb_hash b = kvb_hash_block(&p, T16, 16, extra, 2, 99);
    FX_HASH_EQ(a, b);
    uint32_t other[16];
    memcpy(other, T16, sizeof other);
    other[15] = 16; /* one token differs */
    KVT_CHECK(!fx_hash_eq(a, kvb_hash_block(&p, other, 16, extra, 2, 99)));
}

static void test_null_parent_is_root(void)
{
    kvb_hash zero = fx_hash(0, 0);
    FX_HASH_EQ(kvb_hash_block(NULL, T16, 16, NULL, 0, 0), kvb_hash_block(&zero, T16, 16, NULL, 0, 0));
    uint64_t unused = 5; /* n_extra 0: the pointer is not read */
    FX_HASH_EQ(kvb_hash_block(NULL, T16, 16, &unused, 0, 0), kvb_hash_block(NULL, T16, 16, NULL, 0, 0));
}

static void test_salt_changes_hash(void)
{
    kvb_hash h0 = kvb_hash_block(NULL, T16, 16, NULL, 0, 0);
    kvb_hash h1 = kvb_hash_block(NULL, T16, 16, NULL, 0, 1);
    kvb_hash h2 = kvb_hash_block(NULL, T16, 16, NULL, 0, 2);
    KVT_CHECK(!fx_hash_eq(h0, h1));
    KVT_CHECK(!fx_hash_eq(h1, h2));
    KVT_CHECK(!fx_hash_eq(h0, h2));
    /* salt and parent enter differently: salt 5 is not parent {5, 0} */
    kvb_hash p5 = fx_hash(5, 0);
    KVT_CHECK(!fx_hash_eq(kvb_hash_block(NULL, T16, 16, NULL, 0, 5), kvb_hash_block(&p5, T16, 16, NULL, 0, 0)));
}

static void test_extra_keys_change_hash(void)
{
    uint64_t lora7[1] = {7}, lora8[1] = {8}, both[2] = {7, 8}, swapped[2] = {8, 7};
    kvb_hash none = kvb_hash_block(NULL, T16, 16, NULL, 0, 0);
    kvb_hash h7 = kvb_hash_block(NULL, T16, 16, lora7, 1, 0);
    kvb_hash h8 = kvb_hash_block(NULL, T16, 16, lora8, 1, 0);
    KVT_CHECK(!fx_hash_eq(none, h7));
    KVT_CHECK(!fx_hash_eq(h7, h8));
    KVT_CHECK(!fx_hash_eq(kvb_hash_block(NULL, T16, 16, both, 2, 0), kvb_hash_block(NULL, T16, 16, swapped, 2, 0)));
    uint64_t zero[1] = {0}; /* a zero key still counts */
    KVT_CHECK(!fx_hash_eq(none, kvb_hash_block(NULL, T16, 16, zero, 1, 0)));
}

static void test_prompt_chains_block_hashes(void)
{
    uint32_t tokens[50];
    fx_iota(tokens, 50, 1000);
    uint64_t extra[1] = {77};
    kvb_hash out[4] = {{0, 0}};
    size_t n = 0;
    KVT_EQ(kvb_hash_prompt(tokens, 50, 16, extra, 1, 3, out, 4, &n), KVB_OK);
    KVT_EQ(n, 3); /* 50 / 16: the 2 tokens past the last full block have no hash */

    kvb_hash parent = fx_hash(0, 0);
    for (size_t i = 0; i < 3; i++) {
        kvb_hash h = kvb_hash_block(i ? &parent : NULL, tokens + 16 * i, 16, extra, 1, 3);
        FX_HASH_EQ(out[i], h);
        parent = h;
    }
    FX_HASH_EQ(out[3], fx_hash(0, 0)); /* untouched */

    kvb_hash two[3] = {{0, 0}, {0, 0}, {0xdead, 0xbeef}};
    KVT_EQ(kvb_hash_prompt(tokens, 50, 16, extra, 1, 3, two, 2, &n), KVB_OK);
    KVT_EQ(n, 2);
    FX_HASH_EQ(two[0], out[0]);
    FX_HASH_EQ(two[1], out[1]);
    FX_HASH_EQ(two[2], fx_hash(0xdead, 0xbeef)); /* max_out respected */

    KVT_EQ(kvb_hash_prompt(tokens, 15, 16, NULL, 0, 0, out, 4, &n), KVB_OK);
    KVT_EQ(n, 0);
    KVT_EQ(kvb_hash_prompt(tokens, 50, 5, NULL, 0, 0, out, 4, &n), KVB_OK); /* another block size */
    FX_HASH_EQ(out[0], kvb_hash_block(NULL, tokens, 5, NULL, 0, 0));
}

static void test_odd_token_counts(void)
{
    uint32_t t3[3] = {1, 2, 3}, t4[4] = {1, 2, 3, 0};
    /* {1,2,3} and {1,2,3,0} pack into the same words; the length word tells them apart */
    KVT_CHECK(!fx_hash_eq(kvb_hash_block(NULL, t3, 3, NULL, 0, 0), kvb_hash_block(NULL, t4, 4, NULL, 0, 0)));
    uint32_t zero = 0;
    KVT_CHECK(!fx_hash_eq(kvb_hash_block(NULL, &zero, 1, NULL, 0, 0), kvb_hash_block(NULL, NULL, 0, NULL, 0, 0)));
    FX_HASH_EQ(kvb_hash_block(NULL, t3, 3, NULL, 0, 0), reference_hash(fx_hash(0, 0), t3, 3, NULL, 0, 0));
}

static void test_tokens_and_extras_not_confusable(void)
{
    uint32_t t12[2] = {1, 2}, t1[1] = {1};
    uint64_t e2[1] = {2};
    uint64_t packed[1] = {UINT64_C(1) | UINT64_C(2) << 32}; /* the word tokens {1, 2} pack into */
    kvb_hash tokens_only = kvb_hash_block(NULL, t12, 2, NULL, 0, 0);
    KVT_CHECK(!fx_hash_eq(tokens_only, kvb_hash_block(NULL, t1, 1, e2, 1, 0)));
    KVT_CHECK(!fx_hash_eq(tokens_only, kvb_hash_block(NULL, NULL, 0, packed, 1, 0)));
}

/* The manual's description is the contract: the code must agree with it on any input. */
static void test_matches_manual_description(void)
{
    uint64_t rng = 0x9e3779b97f4a7c15u;
    uint32_t tokens[100];
    uint64_t extra[KVB_MAX_EXTRA_KEYS];
    int mismatches = 0;
    for (int iter = 0; iter < 2000; iter++) {
        size_t n = (size_t)(rng_next(&rng) % 101); /* up to 100 tokens: more than 16 pairs */
        size_t n_extra = (size_t)(rng_next(&rng) % (KVB_MAX_EXTRA_KEYS + 1));
        for (size_t i = 0; i < n; i++) tokens[i] = (uint32_t)rng_next(&rng);
        for (size_t i = 0; i < n_extra; i++) extra[i] = rng_next(&rng);
        kvb_hash parent = iter % 3 ? fx_hash(rng_next(&rng), rng_next(&rng)) : fx_hash(0, 0);
        uint64_t salt = iter % 2 ? rng_next(&rng) : 0;
        kvb_hash got = kvb_hash_block(&parent, tokens, n, extra, n_extra, salt);
        kvb_hash want = reference_hash(parent, tokens, n, extra, n_extra, salt);
        mismatches += !fx_hash_eq(got, want);
    }
    KVT_EQ(mismatches, 0);
}

/* ---- test vectors (the first four are quoted in the manual, section 3) ---------------------------- */

enum { NUM_VECTORS = 6 };

typedef struct vector {
    const char *what;
    kvb_hash want;
} vector;

static const vector VECTORS[NUM_VECTORS] = {
    {"parent 0, salt 0, tokens {}", {UINT64_C(0x5ed53f36b77dd8fb), UINT64_C(0x36f15e0212bfd3cc)}},
    {"parent 0, salt 0, tokens {0..15} (= H1)", {UINT64_C(0x85eed2fee4858a4c), UINT64_C(0x7de4593b80f59852)}},
    {"parent 0, salt 7, tokens {0..15} (= H7)", {UINT64_C(0xa2162a7d519c2643), UINT64_C(0x47ec946ad670ce66)}},
    {"parent H1, salt 0, tokens {0..15}", {UINT64_C(0xa3fe00e17e8a2202), UINT64_C(0xe0b8b099f4579957)}},
    {"parent H7, salt 7, tokens {0..15}", {UINT64_C(0x15b06eff45ce007c), UINT64_C(0x5f6340a95fb42f07)}},
    {"parent 0, salt 0, tokens {0..15}, extra {7}", {UINT64_C(0xa2a0dfdfd83abc4f), UINT64_C(0x7139f6deb715106b)}},
};

static void vectors_compute(kvb_hash got[NUM_VECTORS])
{
    const uint64_t lora[1] = {7};
    got[0] = kvb_hash_block(NULL, NULL, 0, NULL, 0, 0);
    got[1] = kvb_hash_block(NULL, T16, 16, NULL, 0, 0);
    got[2] = kvb_hash_block(NULL, T16, 16, NULL, 0, 7);
    got[3] = kvb_hash_block(&got[1], T16, 16, NULL, 0, 0);
    got[4] = kvb_hash_block(&got[2], T16, 16, NULL, 0, 7);
    got[5] = kvb_hash_block(NULL, T16, 16, lora, 1, 0);
}

static void test_vectors(void)
{
    kvb_hash got[NUM_VECTORS];
    vectors_compute(got);
    for (size_t i = 0; i < NUM_VECTORS; i++) {
        if (!fx_hash_eq(got[i], VECTORS[i].want))
            fprintf(stderr, "  %s: lo = 0x%016" PRIx64 " hi = 0x%016" PRIx64 "\n", VECTORS[i].what, got[i].lo,
                    got[i].hi);
        FX_HASH_EQ(got[i], VECTORS[i].want);
    }
}

/* ---- a user hash function ------------------------------------------------------------------------ */

typedef struct toy_state { int calls; } toy_state;

/* lo = parent.lo + sum of tokens, hi = salt: easy to predict */
static void toy_hash(const kvb_hash *parent, const uint32_t *tokens, size_t n_tokens, const uint64_t *extra,
                     size_t n_extra, uint64_t salt, kvb_hash *out, void *user)
{
    (void)extra;
    (void)n_extra;
    uint64_t sum = parent ? parent->lo : 0;
    for (size_t i = 0; i < n_tokens; i++) sum += tokens[i];
    out->lo = sum;
    out->hi = salt;
    ((toy_state *)user)->calls++;
}

static void test_custom_hash_fn_used_by_register(void)
{
    toy_state toy = {0};
    kvb_pool_config cfg = fx_config(8);
    cfg.hash_fn = toy_hash;
    cfg.hash_user = &toy;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_block b[2] = {{0}};
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    kvb_hash first = fx_hash(120, 4); /* 0 + 1 + ... + 15 = 120, salt 4 */
    fx_fill_block(pool, b[0], NULL, 4, T16);
    fx_fill_block(pool, b[1], &first, 4, T16);
    KVT_EQ(kvb_register(pool, b, 2, b), KVB_OK);
    KVT_CHECK(toy.calls >= 2);
    FX_HASH_EQ(fx_info(pool, b[0].id).hash, first);
    FX_HASH_EQ(fx_info(pool, b[1].id).hash, fx_hash(240, 4));
    kvb_hash chain[2] = {first, fx_hash(240, 4)};
    KVT_EQ(fx_lookup(pool, chain, 2), 2);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

/* A sequence on that pool hashes its blocks the same way, so its prompts find what was registered. */
static void test_custom_hash_fn_used_by_sequences(void)
{
    toy_state toy = {0};
    kvb_pool_config cfg = fx_config(8);
    cfg.hash_fn = toy_hash;
    cfg.hash_user = &toy;
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_seq_config sc = {.salt = 4};
    kvb_seq *seq = NULL;
    KVT_EQ(kvb_seq_create(pool, &sc, &seq), KVB_OK);
    uint32_t tokens[32];
    memcpy(tokens, T16, sizeof T16);
    memcpy(tokens + 16, T16, sizeof T16);
    KVT_EQ(kvb_seq_append(seq, tokens, 32, NULL), KVB_OK);
    const kvb_hash *hashes = NULL;
    size_t n = 0;
    KVT_EQ(kvb_seq_hashes(seq, &hashes, &n), KVB_OK);
    KVT_EQ(n, 2);
    if (n == 2) {
        FX_HASH_EQ(hashes[0], fx_hash(120, 4));
        FX_HASH_EQ(hashes[1], fx_hash(240, 4));
    }
    KVT_EQ(kvb_seq_commit(seq, 32), KVB_OK);
    kvb_hash chain[2] = {fx_hash(120, 4), fx_hash(240, 4)};
    KVT_EQ(fx_lookup(pool, chain, 2), 2);
    kvb_seq_destroy(seq);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);
}

int main(int argc, char **argv)
{
    fx_watchdog(60);
    if (argc > 1 && strcmp(argv[1], "--print-vectors") == 0) {
        kvb_hash got[NUM_VECTORS];
        vectors_compute(got);
        for (size_t i = 0; i < NUM_VECTORS; i++)
            printf("%-46s lo = 0x%016" PRIx64 "  hi = 0x%016" PRIx64 "\n", VECTORS[i].what, got[i].lo, got[i].hi);
        return 0;
    }
    KVT_RUN(test_deterministic);
    KVT_RUN(test_null_parent_is_root);
    KVT_RUN(test_salt_changes_hash);
    KVT_RUN(test_extra_keys_change_hash);
    KVT_RUN(test_prompt_chains_block_hashes);
    KVT_RUN(test_odd_token_counts);
    KVT_RUN(test_tokens_and_extras_not_confusable);
    KVT_RUN(test_matches_manual_description);
    KVT_RUN(test_vectors);
    KVT_RUN(test_custom_hash_fn_used_by_register);
    KVT_RUN(test_custom_hash_fn_used_by_sequences);
    return kvt_summary();
}
