/* quickstart.c — kvblock.h in one page: a block's lifecycle, prefix reuse between two requests, and
 * eviction when an unrelated prompt needs the space. Build: make build/quickstart, or
 *   cc -std=c11 -O2 -D_GNU_SOURCE -I. -I/usr/include/stb examples/quickstart.c -o quickstart -pthread
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"

#include <stdio.h>
#include <stdlib.h>

static const char *state_name(kvb_block_state s)
{
    static const char *names[] = {"?", "Empty", "Partial", "ReadyForScheduling", "Inflight", "Complete",
                                  "Registered"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "?";
}

static void check(kvb_result r, const char *what)
{
    if (r != KVB_OK) {
        fprintf(stderr, "%s: %s\n", what, kvb_result_string(r));
        exit(1);
    }
}

static void print_state(kvb_pool *pool, kvb_block b, const char *after)
{
    kvb_block_info info;
    check(kvb_block_get_info(pool, b.id, &info), "info");
    printf("  after %-22s -> %-18s (%u tokens)\n", after, state_name(info.state), info.num_tokens);
}

static void on_events(const kvb_event *ev, size_t n, void *user)
{
    size_t i, *removed = (size_t *)user;
    for (i = 0; i < n; i++) removed[0] += ev[i].kind == KVB_EVENT_REMOVED;
}

/* 1. One block through its whole lifecycle with the low-level calls. */
static void show_lifecycle(kvb_pool *pool)
{
    uint32_t tokens[16];
    kvb_block b;
    size_t i;
    for (i = 0; i < 16; i++) tokens[i] = (uint32_t)(100 + i);
    printf("1. lifecycle of one block\n");
    check(kvb_alloc(pool, 1, &b), "alloc");
    print_state(pool, b, "alloc");
    check(kvb_block_init(pool, b, NULL, 0, NULL, 0), "init");
    print_state(pool, b, "init");
    check(kvb_block_add_tokens(pool, b, tokens, 10, 0), "add");
    print_state(pool, b, "add 10 tokens");
    check(kvb_block_add_tokens(pool, b, tokens + 10, 6, 0), "add");
    print_state(pool, b, "add 6 more (full)");
    check(kvb_block_schedule(pool, b), "schedule");
    print_state(pool, b, "schedule");
    check(kvb_block_compute_done(pool, b), "done");
    print_state(pool, b, "compute done");
    check(kvb_register(pool, &b, 1, &b), "register");
    print_state(pool, b, "register");
    printf("  adding tokens now: %s\n", kvb_result_string(kvb_block_add_tokens(pool, b, tokens, 1, 0)));
    check(kvb_release(pool, &b, 1, NULL), "release");
}

/* 2. Two requests sharing a 48-token system prompt. */
static void show_prefix_reuse(kvb_pool *pool)
{
    uint32_t prompt[64];
    kvb_seq *a, *b;
    size_t i, cached;
    kvb_pool_stats st;
    for (i = 0; i < 64; i++) prompt[i] = (uint32_t)(i < 48 ? 7 * i : 1000 + i);
    printf("2. prefix reuse (block size 16)\n");
    check(kvb_seq_create(pool, NULL, &a), "seq");
    check(kvb_seq_append(a, prompt, 55, &cached), "append");
    check(kvb_seq_commit(a, 55), "commit");
    printf("  request A: 55 tokens, %zu from cache\n", cached);
    prompt[50] = 4242; /* B shares the first 48 tokens only */
    check(kvb_seq_create(pool, NULL, &b), "seq");
    check(kvb_seq_append(b, prompt, 53, &cached), "append");
    check(kvb_seq_commit(b, 53), "commit");
    printf("  request B: 53 tokens, %zu from cache (3 blocks shared)\n", cached);
    check(kvb_pool_get_stats(pool, &st), "stats");
    printf("  pool: %u active, %u cached hashes, hit blocks %llu of %llu asked\n", st.active_blocks,
           st.cached_hashes, (unsigned long long)st.hit_blocks, (unsigned long long)st.lookup_blocks);
    kvb_seq_destroy(a);
    kvb_seq_destroy(b);
}

/* 3. An unrelated long prompt needs more blocks than are free: cached blocks are evicted. */
static void show_eviction(kvb_pool *pool, const size_t *removed)
{
    uint32_t prompt[160];
    kvb_seq *c;
    kvb_pool_stats st;
    size_t i, cached;
    char why[128];
    for (i = 0; i < 160; i++) prompt[i] = (uint32_t)(50000 + i);
    check(kvb_pool_get_stats(pool, &st), "stats");
    printf("3. eviction: %u free, %u inactive cached blocks, request C needs 10 blocks\n", st.free_blocks,
           st.inactive_blocks);
    check(kvb_seq_create(pool, NULL, &c), "seq");
    check(kvb_seq_append(c, prompt, 160, &cached), "append");
    check(kvb_pool_get_stats(pool, &st), "stats");
    printf("  evictions %llu, removed events %zu, cached hashes left %u\n", (unsigned long long)st.evictions,
           *removed, st.cached_hashes);
    kvb_seq_destroy(c);
    check(kvb_pool_check(pool, why, sizeof why), why);
    printf("  kvb_pool_check: ok\n");
}

int main(void)
{
    size_t removed = 0;
    kvb_pool_config cfg = {0};
    kvb_pool *pool;
    cfg.num_blocks = 12;
    cfg.block_tokens = 16;
    cfg.on_events = on_events;
    cfg.event_user = &removed;
    check(kvb_pool_create(&cfg, &pool), "pool");
    show_lifecycle(pool);
    show_prefix_reuse(pool);
    show_eviction(pool, &removed);
    kvb_pool_destroy(pool);
    return 0;
}
