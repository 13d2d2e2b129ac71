/* fixtures.h — small helpers shared by the kvblock tests (include after kvblock.h and kvtest.h).
 * Everything is static inline so a test file pays only for what it uses. */
#ifndef KVB_FIXTURES_H
#define KVB_FIXTURES_H
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* A test program that hangs fails instead: after `seconds` it prints why and exits 1 (run.sh then
 * reports it as exiting without a summary). Call first thing in main. */
static inline void fx__watchdog_fired(int sig)
{
    static const char msg[] = "watchdog: the test program ran too long (a hang?)\n";
    (void)sig;
    if (write(STDERR_FILENO, msg, sizeof msg - 1) < 0) _exit(1);
    _exit(1);
}

static inline void fx_watchdog(unsigned seconds)
{
    signal(SIGALRM, fx__watchdog_fired);
    alarm(seconds);
}

/* kvb_pool_check must pass; prints the pool's reason when it does not. A macro so the failure names
 * the line of the test. */
#define FX_CHECK_POOL(pool)                                                          \
    do {                                                                             \
        char fx__why[256] = "";                                                      \
        kvb_result fx__r = kvb_pool_check((pool), fx__why, sizeof fx__why);          \
        if (fx__r != KVB_OK) fprintf(stderr, "  pool check: %s\n", fx__why);         \
        KVT_EQ(fx__r, KVB_OK);                                                       \
    } while (0)

#define FX_HASH_EQ(a, b) KVT_CHECK(fx_hash_eq((a), (b)))

static inline int fx_hash_eq(kvb_hash a, kvb_hash b) { return a.lo == b.lo && a.hi == b.hi; }

static inline kvb_hash fx_hash(uint64_t lo, uint64_t hi)
{
    kvb_hash h;
    h.lo = lo;
    h.hi = hi;
    return h;
}

/* The config every test starts from: num_blocks blocks of 16 tokens, everything else default. */
static inline kvb_pool_config fx_config(uint32_t num_blocks)
{
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = num_blocks;
    cfg.block_tokens = 16;
    return cfg;
}

static inline kvb_pool *fx_pool_from(const kvb_pool_config *cfg)
{
    kvb_pool *pool = NULL;
    KVT_EQ(kvb_pool_create(cfg, &pool), KVB_OK);
    return pool;
}

static inline kvb_pool *fx_pool(uint32_t num_blocks)
{
    kvb_pool_config cfg = fx_config(num_blocks);
    return fx_pool_from(&cfg);
}

static inline kvb_pool_stats fx_stats(kvb_pool *pool)
{
    kvb_pool_stats s;
    memset(&s, 0, sizeof s);
    KVT_EQ(kvb_pool_get_stats(pool, &s), KVB_OK);
    return s;
}

static inline int fx_stats_equal(const kvb_pool_stats *a, const kvb_pool_stats *b)
{
    return a->lookups == b->lookups && a->lookup_blocks == b->lookup_blocks &&
           a->hit_blocks == b->hit_blocks && a->hit_tokens == b->hit_tokens &&
           a->allocations == b->allocations && a->evictions == b->evictions &&
           a->registrations == b->registrations && a->dedups == b->dedups &&
           a->num_blocks == b->num_blocks && a->free_blocks == b->free_blocks &&
           a->active_blocks == b->active_blocks && a->inactive_blocks == b->inactive_blocks &&
           a->cached_hashes == b->cached_hashes;
}

/* Info of a live handle (strong or weak); a failed call leaves a zeroed info (state 0). */
static inline kvb_block_info fx_info(kvb_pool *pool, uint64_t id)
{
    kvb_block_info info;
    memset(&info, 0, sizeof info);
    KVT_EQ(kvb_block_get_info(pool, id, &info), KVB_OK);
    return info;
}

static inline int fx_info_equal(const kvb_block_info *a, const kvb_block_info *b)
{
    return a->state == b->state && a->index == b->index && a->refs == b->refs &&
           a->num_tokens == b->num_tokens && a->priority == b->priority &&
           fx_hash_eq(a->hash, b->hash) && fx_hash_eq(a->parent, b->parent);
}

/* tokens[i] = first + i */
static inline void fx_iota(uint32_t *tokens, size_t n, uint32_t first)
{
    for (size_t i = 0; i < n; i++) tokens[i] = first + (uint32_t)i;
}

/* Length of the cached prefix of `hashes` (kvb_lookup: no references, no stats). */
static inline size_t fx_lookup(kvb_pool *pool, const kvb_hash *hashes, size_t n)
{
    size_t found = (size_t)-1;
    KVT_EQ(kvb_lookup(pool, hashes, n, &found), KVB_OK);
    return found;
}

/* Takes one block from Empty through the lifecycle to Complete with 16 tokens (block_tokens 16). */
static inline void fx_fill_block(kvb_pool *pool, kvb_block b, const kvb_hash *parent, uint64_t salt,
                                 const uint32_t *tokens16)
{
    KVT_EQ(kvb_block_init(pool, b, parent, salt, NULL, 0), KVB_OK);
    KVT_EQ(kvb_block_add_tokens(pool, b, tokens16, 16, 0), KVB_OK);
    KVT_EQ(kvb_block_schedule(pool, b), KVB_OK);
    KVT_EQ(kvb_block_compute_done(pool, b), KVB_OK);
}

/* Registers `n` already allocated Empty blocks with the given hashes (parents may be NULL). */
static inline void fx_import(kvb_pool *pool, const kvb_block *blocks, size_t n, const kvb_hash *hashes,
                             const kvb_hash *parents)
{
    kvb_block out[64];
    KVT_CHECK(n <= 64);
    KVT_EQ(kvb_register_hashed(pool, blocks, n, hashes, parents, out), KVB_OK);
}

/* ---- sequences ---- */

static inline kvb_seq *fx_seq(kvb_pool *pool, const kvb_seq_config *cfg)
{
    kvb_seq *seq = NULL;
    KVT_EQ(kvb_seq_create(pool, cfg, &seq), KVB_OK);
    return seq;
}

static inline kvb_seq_info fx_seq_info(const kvb_seq *seq)
{
    kvb_seq_info info;
    memset(&info, 0, sizeof info);
    KVT_EQ(kvb_seq_get_info(seq, &info), KVB_OK);
    return info;
}

/* Copies the block table (the pointer is only valid until the sequence changes); returns its length. */
static inline size_t fx_seq_table(const kvb_seq *seq, kvb_block *out, size_t max)
{
    const kvb_block *table = NULL;
    size_t n = 0;
    KVT_EQ(kvb_seq_blocks(seq, &table, &n), KVB_OK);
    KVT_CHECK(n <= max);
    for (size_t i = 0; i < n && i < max; i++) out[i] = table[i];
    return n;
}

/* An event sink that records what it is given. */
typedef struct fx_events {
    kvb_event ev[512];
    size_t n;       /* events recorded */
    size_t calls;   /* callback invocations */
    size_t dropped; /* events beyond the capacity of ev */
} fx_events;

static inline void fx_record_events(const kvb_event *events, size_t n, void *user)
{
    fx_events *rec = (fx_events *)user;
    rec->calls++;
    for (size_t i = 0; i < n; i++) {
        if (rec->n < sizeof rec->ev / sizeof rec->ev[0]) rec->ev[rec->n++] = events[i];
        else rec->dropped++;
    }
}

static inline void fx_events_clear(fx_events *rec) { memset(rec, 0, sizeof *rec); }

/* Number of recorded events of one kind. */
static inline size_t fx_events_count(const fx_events *rec, kvb_event_kind kind)
{
    size_t c = 0;
    for (size_t i = 0; i < rec->n; i++) c += rec->ev[i].kind == kind;
    return c;
}

#endif
