/* Block hashing of kvblock.h: the properties a prefix cache relies on, the definition of manual
 * section 3 (checked against an independent implementation written from the manual), fixed test
 * vectors, the quality of the mix (avalanche, no collisions over structured inputs, salt and parent
 * sensitivity), and a user hash function plugged into a pool. test_hash_portable.c runs all of it
 * again with the portable multiply (KVB_NO_INT128). */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

#include <stdlib.h>

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

/* the 128-bit product x * y as (low, high), from four 32 x 32-bit products */
static void product(uint64_t x, uint64_t y, uint64_t *low, uint64_t *high)
{
    uint64_t x0 = (uint32_t)x, x1 = x >> 32, y0 = (uint32_t)y, y1 = y >> 32;
    uint64_t p00 = x0 * y0, p01 = x0 * y1, p10 = x1 * y0, p11 = x1 * y1;
    uint64_t carry = ((p00 >> 32) + (uint32_t)p01 + (uint32_t)p10) >> 32;
    *low = x * y;
    *high = p11 + (p01 >> 32) + (p10 >> 32) + carry;
}

static uint64_t F(uint64_t v, uint64_t c, uint64_t d)
{
    v ^= v >> 32;
    v *= c;
    v ^= v >> 29;
    v *= d;
    v ^= v >> 32;
    return v;
}

static kvb_hash reference_hash(kvb_hash parent, const uint32_t *tokens, size_t n, const uint64_t *extra,
                               size_t n_extra, uint64_t salt)
{
    uint64_t words[400];
    size_t w = 0;
    for (size_t i = 0; i < n; i += 2)
        words[w++] = (uint64_t)tokens[i] | (i + 1 < n ? (uint64_t)tokens[i + 1] << 32 : 0);
    for (size_t i = 0; i < n_extra; i++) words[w++] = extra[i];
    words[w++] = (uint64_t)n | (uint64_t)n_extra << 32;

    uint64_t a = salt ^ C[8], b = rotl(salt, 32) ^ C[9];
    for (size_t g = 0; g < w; g += 8) { /* groups of 8 words */
        a = rotl(a, 29);
        b = rotl(b, 37);
        for (size_t p = 0; p < 4 && g + 2 * p < w; p++) {
            uint64_t x = words[g + 2 * p] ^ C[2 * p];
            uint64_t y = (g + 2 * p + 1 < w ? words[g + 2 * p + 1] : 0) ^ C[2 * p + 1];
            uint64_t lo, hi;
            product(x, y, &lo, &hi);
            a += lo ^ y;
            b += hi ^ x;
        }
    }
    uint64_t x = parent.lo ^ a, y = parent.hi ^ b, l, h;
    product(x, C[10], &l, &h);
    h += x * C[11] + y * C[10];
    return fx_hash(F(l ^ h, C[12], C[13]), F(h, C[14], C[15]));
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

/* The manual's description is the contract: the code must agree with it on any input, the common
 * shape (whole groups of 16 tokens, no extra keys) as much as any other. */
static void test_matches_manual_description(void)
{
    uint64_t rng = 0x9e3779b97f4a7c15u;
    uint32_t tokens[300];
    uint64_t extra[20];
    int mismatches = 0, common = 0;
    for (int iter = 0; iter < 3000; iter++) {
        size_t n, n_extra;
        if (iter % 2) { /* up to 300 tokens (more than 16 groups of words) and up to 20 extra keys */
            n = (size_t)(rng_next(&rng) % 301);
            n_extra = (size_t)(rng_next(&rng) % 21);
        } else { /* 0 to 320 tokens by 16, no extra keys */
            n = 16 * (size_t)(rng_next(&rng) % 19);
            n_extra = 0;
        }
        common += n % 16 == 0 && n_extra == 0;
        for (size_t i = 0; i < n; i++) tokens[i] = (uint32_t)rng_next(&rng);
        for (size_t i = 0; i < n_extra; i++) extra[i] = rng_next(&rng);
        kvb_hash parent = iter % 3 ? fx_hash(rng_next(&rng), rng_next(&rng)) : fx_hash(0, 0);
        uint64_t salt = iter % 5 ? rng_next(&rng) : 0;
        kvb_hash got = kvb_hash_block(&parent, tokens, n, extra, n_extra, salt);
        kvb_hash want = reference_hash(parent, tokens, n, extra, n_extra, salt);
        mismatches += !fx_hash_eq(got, want);
    }
    KVT_EQ(mismatches, 0);
    KVT_CHECK(common >= 1500);
}

/* ---- test vectors (all but "parent H7, salt 7" are quoted in the manual, section 3) --------------- */

enum { NUM_VECTORS = 7 };

typedef struct vector {
    const char *what;
    kvb_hash want;
} vector;

static const vector VECTORS[NUM_VECTORS] = {
    {"parent 0, salt 0, tokens {}", {UINT64_C(0x237de0d3c7615ee3), UINT64_C(0xde132dd3b565387b)}},
    {"parent 0, salt 0, tokens {0..15} (= H1)", {UINT64_C(0x45e8de8b7c892644), UINT64_C(0x8099931b7326f7ac)}},
    {"parent 0, salt 7, tokens {0..15} (= H7)", {UINT64_C(0x4f0aa23360eabece), UINT64_C(0x52360e9a53096b1e)}},
    {"parent H1, salt 0, tokens {0..15}", {UINT64_C(0xa6427d87e40c323a), UINT64_C(0xed54198121b834f2)}},
    {"parent 0, salt 0, tokens {0..15}, extra {7}", {UINT64_C(0xaa5eff9efd34af3d), UINT64_C(0xc95504eb209cdccd)}},
    {"parent 0, salt 0, tokens {0..4}", {UINT64_C(0xfc85a53e2ddd558c), UINT64_C(0x14dc44751d20a9ed)}},
    {"parent H7, salt 7, tokens {0..15}", {UINT64_C(0x784d09367c018ebc), UINT64_C(0xca3dc1235d282880)}},
};

static void vectors_compute(kvb_hash got[NUM_VECTORS])
{
    const uint64_t lora[1] = {7};
    got[0] = kvb_hash_block(NULL, NULL, 0, NULL, 0, 0);
    got[1] = kvb_hash_block(NULL, T16, 16, NULL, 0, 0);
    got[2] = kvb_hash_block(NULL, T16, 16, NULL, 0, 7);
    got[3] = kvb_hash_block(&got[1], T16, 16, NULL, 0, 0);
    got[4] = kvb_hash_block(NULL, T16, 16, lora, 1, 0);
    got[5] = kvb_hash_block(NULL, T16, 5, NULL, 0, 0);
    got[6] = kvb_hash_block(&got[2], T16, 16, NULL, 0, 7);
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

/* ---- quality ----------------------------------------------------------------------------------------- */

/* One block's inputs, and flipping bit `bit` of them: parent (128 bits), then the tokens (32 each), the
 * salt (64), the extra keys (64 each). */
typedef struct block_input {
    kvb_hash parent;
    uint32_t tokens[16];
    size_t n;
    uint64_t salt;
    uint64_t extra[2];
    size_t n_extra;
} block_input;

static size_t input_bits(const block_input *in) { return 128 + 32 * in->n + 64 + 64 * in->n_extra; }

static void flip_bit(block_input *in, size_t bit)
{
    if (bit < 64) in->parent.lo ^= UINT64_C(1) << bit;
    else if (bit < 128) in->parent.hi ^= UINT64_C(1) << (bit - 64);
    else if ((bit -= 128) < 32 * in->n) in->tokens[bit / 32] ^= UINT32_C(1) << (bit % 32);
    else if ((bit -= 32 * in->n) < 64) in->salt ^= UINT64_C(1) << bit;
    else in->extra[(bit - 64) / 64] ^= UINT64_C(1) << ((bit - 64) % 64);
}

static kvb_hash hash_input(const block_input *in)
{
    return kvb_hash_block(&in->parent, in->tokens, in->n, in->extra, in->n_extra, in->salt);
}

/* Flipping any one input bit flips each output bit with probability near 1/2: 2,000 random inputs
 * (half of them with small token ids, as a vocabulary gives), every (input bit, output bit) between 0.4
 * and 0.6 (the statistical spread is 0.011). Two shapes: 16 tokens (the common case) and 5 tokens
 * with 2 extra keys (the general one). */
static void avalanche(size_t n, size_t n_extra, uint64_t seed)
{
    enum { SAMPLES = 2000 };
    static uint32_t flips[128 + 32 * 16 + 64 + 64 * 2][128];
    block_input in;
    memset(flips, 0, sizeof flips);
    memset(&in, 0, sizeof in);
    in.n = n;
    in.n_extra = n_extra;
    size_t bits = input_bits(&in);
    for (int s = 0; s < SAMPLES; s++) {
        in.parent = fx_hash(rng_next(&seed), rng_next(&seed));
        for (size_t i = 0; i < n; i++) in.tokens[i] = (uint32_t)rng_next(&seed) & (s % 2 ? 0x1ffffu : UINT32_MAX);
        in.salt = s % 4 == 1 ? 0 : rng_next(&seed);
        for (size_t i = 0; i < n_extra; i++) in.extra[i] = rng_next(&seed);
        kvb_hash h = hash_input(&in);
        for (size_t b = 0; b < bits; b++) {
            block_input f = in;
            flip_bit(&f, b);
            kvb_hash g = hash_input(&f);
            uint64_t d[2] = {h.lo ^ g.lo, h.hi ^ g.hi};
            for (unsigned o = 0; o < 128; o++) flips[b][o] += (uint32_t)(d[o / 64] >> (o % 64)) & 1u;
        }
    }
    uint32_t lo = SAMPLES, hi = 0;
    size_t outside = 0;
    for (size_t b = 0; b < bits; b++)
        for (unsigned o = 0; o < 128; o++) {
            uint32_t c = flips[b][o];
            lo = c < lo ? c : lo;
            hi = c > hi ? c : hi;
            outside += c < SAMPLES * 4 / 10 || c > SAMPLES * 6 / 10;
        }
    if (outside)
        fprintf(stderr, "  %zu tokens, %zu extra keys: flip counts %u..%u of %d\n", n, n_extra, lo, hi, SAMPLES);
    KVT_EQ(outside, 0);
}

static void test_avalanche(void)
{
    avalanche(16, 0, 0x243f6a8885a308d3u);
    avalanche(5, 2, 0x13198a2e03707344u);
}

/* 2^20 hashes of structured inputs, all distinct, and distinct in each 64-bit half alone too (for
 * 2^20 random values a 64-bit collision has odds of 3 in 100 million, so one means structure). */
enum { FAMILY = 1 << 18 };

static int cmp_u64(const void *pa, const void *pb)
{
    uint64_t a = *(const uint64_t *)pa, b = *(const uint64_t *)pb;
    return a < b ? -1 : a > b;
}

static size_t duplicates(uint64_t *v, size_t n)
{
    size_t d = 0;
    qsort(v, n, sizeof *v, cmp_u64);
    for (size_t i = 1; i < n; i++) d += v[i] == v[i - 1];
    return d;
}

static void test_no_collisions_structured(void)
{
    kvb_hash *h = (kvb_hash *)malloc(4 * FAMILY * sizeof *h);
    uint64_t *half = (uint64_t *)malloc(4 * FAMILY * sizeof *half);
    uint32_t t[16];
    size_t m = 0;
    KVT_CHECK(h && half);
    if (!h || !half) goto out;
    /* a chain of sequential token ids: 0..15, 16..31, ... */
    for (size_t i = 0; i < FAMILY; i++, m++) {
        for (uint32_t k = 0; k < 16; k++) t[k] = (uint32_t)(16 * i) + k;
        h[m] = kvb_hash_block(i ? &h[m - 1] : NULL, t, 16, NULL, 0, 0);
    }
    /* a chain of all-zero blocks: only the parent changes */
    memset(t, 0, sizeof t);
    for (size_t i = 0; i < FAMILY; i++, m++) h[m] = kvb_hash_block(i ? &h[m - 1] : NULL, t, 16, NULL, 0, 0);
    /* root blocks of zeros but one token, 1..16,384 at each of the 16 positions */
    for (size_t i = 0; i < FAMILY; i++, m++) {
        memset(t, 0, sizeof t);
        t[i % 16] = (uint32_t)(i / 16 + 1);
        h[m] = kvb_hash_block(NULL, t, 16, NULL, 0, 0);
    }
    /* tokens 0..15 from the root under salts 1..2^18 (salt 0 is the first chain's first block) */
    for (uint32_t k = 0; k < 16; k++) t[k] = k;
    for (size_t i = 0; i < FAMILY; i++, m++) h[m] = kvb_hash_block(NULL, t, 16, NULL, 0, (uint64_t)i + 1);
    for (size_t i = 0; i < m; i++) half[i] = h[i].lo;
    KVT_EQ(duplicates(half, m), 0);
    for (size_t i = 0; i < m; i++) half[i] = h[i].hi;
    KVT_EQ(duplicates(half, m), 0);
out:
    free(h);
    free(half);
}

/* Lengths are part of the message: 0..64 zero tokens with 0..8 zero extra keys, under salts 0 and 1,
 * give 1,170 distinct hashes. */
static void test_lengths_distinct(void)
{
    static uint32_t zeros[64];
    static const uint64_t ezero[8];
    uint64_t lo[2 * 65 * 9];
    size_t m = 0;
    for (uint64_t salt = 0; salt < 2; salt++)
        for (size_t n = 0; n <= 64; n++)
            for (size_t e = 0; e <= 8; e++) lo[m++] = kvb_hash_block(NULL, zeros, n, ezero, e, salt).lo;
    KVT_EQ(m, 1170);
    KVT_EQ(duplicates(lo, m), 0);
}

static size_t ones(uint64_t v)
{
    size_t c = 0;
    for (; v; v &= v - 1) c++;
    return c;
}

/* Tenants: one prompt under two salts shares no block hash, and hashes of one salt differ from the
 * other's in about half their bits. */
static void test_salts_isolate_tenants(void)
{
    uint32_t tokens[64 * 16];
    kvb_hash a[64], b[64];
    size_t na = 0, nb = 0, bits = 0;
    fx_iota(tokens, 64 * 16, 5000);
    KVT_EQ(kvb_hash_prompt(tokens, 64 * 16, 16, NULL, 0, 1, a, 64, &na), KVB_OK);
    KVT_EQ(kvb_hash_prompt(tokens, 64 * 16, 16, NULL, 0, 2, b, 64, &nb), KVB_OK);
    KVT_EQ(na, 64);
    KVT_EQ(nb, 64);
    for (size_t i = 0; i < 64; i++)
        for (size_t j = 0; j < 64; j++) KVT_CHECK(!fx_hash_eq(a[i], b[j]));
    for (size_t i = 0; i < 64; i++) bits += ones(a[i].lo ^ b[i].lo) + ones(a[i].hi ^ b[i].hi);
    KVT_CHECK(bits > 64 * 128 * 45 / 100 && bits < 64 * 128 * 55 / 100);
}

/* The parent: for one block, the parent -> hash map is a bijection (distinct parents, distinct
 * hashes: 2^16 parents differing in one bit or in small values), and a chain depends on its whole
 * prefix (changing the first block changes the 64th hash). */
static void test_parent_sensitivity(void)
{
    uint64_t *lo = (uint64_t *)malloc(2 * 65536 * sizeof *lo);
    uint32_t tokens[64 * 16];
    kvb_hash a[64], b[64];
    size_t n = 0, m = 0;
    KVT_CHECK(lo != NULL);
    if (!lo) return;
    for (uint64_t i = 0; i < 65536; i++) {
        kvb_hash small = fx_hash(i, 0), sparse = fx_hash(UINT64_C(1) << (i % 64), (i + 1) << 16);
        lo[m++] = kvb_hash_block(&small, T16, 16, NULL, 0, 0).lo;
        lo[m++] = kvb_hash_block(&sparse, T16, 16, NULL, 0, 0).lo;
    }
    KVT_EQ(duplicates(lo, m), 0);
    free(lo);
    fx_iota(tokens, 64 * 16, 0);
    KVT_EQ(kvb_hash_prompt(tokens, 64 * 16, 16, NULL, 0, 0, a, 64, &n), KVB_OK);
    tokens[0] = 1;
    KVT_EQ(kvb_hash_prompt(tokens, 64 * 16, 16, NULL, 0, 0, b, 64, &n), KVB_OK);
    for (size_t i = 0; i < 64; i++) KVT_CHECK(!fx_hash_eq(a[i], b[i]));
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
    KVT_RUN(test_avalanche);
    KVT_RUN(test_no_collisions_structured);
    KVT_RUN(test_lengths_distinct);
    KVT_RUN(test_salts_isolate_tenants);
    KVT_RUN(test_parent_sensitivity);
    KVT_RUN(test_custom_hash_fn_used_by_register);
    KVT_RUN(test_custom_hash_fn_used_by_sequences);
    return kvt_summary();
}
