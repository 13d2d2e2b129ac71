/* kvs_sched_complete when the device pool has no memory for its event batch: kvb_seq_commit_many then
 * returns KVB_ENOMEM and registers nothing. The step's full blocks must not be lost silently: the
 * scheduler retries the commit at the next complete (whether or not a block fills then), once more before
 * the request's blocks go back, and counts both (kvs_sched_stats.commits_deferred, and
 * blocks_not_registered when even the last try found no memory: those blocks are not cached). */
#include <stdlib.h>
static int oom_on;       /* every allocation fails while set */
static long oom_refused; /* allocations refused */
static void *oom_malloc(size_t n) { return oom_on ? (oom_refused++, NULL) : malloc(n); }
static void *oom_realloc(void *p, size_t n) { return oom_on ? (oom_refused++, NULL) : realloc(p, n); }
#define KVB_MALLOC(sz) oom_malloc(sz)
#define KVB_REALLOC(p, sz) oom_realloc(p, sz)
#define KVB_FREE(p) free(p)
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "kvtest.h"

enum { BT = 16 };

static size_t stored_events;
static void count_events(const kvb_event *ev, size_t n, void *user)
{
    (void)user;
    for (size_t i = 0; i < n; i++) stored_events += ev[i].kind == KVB_EVENT_STORED;
}

typedef struct world {
    kvb_pool *pool;
    kvs_sched *s;
    uint32_t prompt[40 * BT];
} world;

static void world_open(world *w)
{
    kvb_pool_config pc;
    kvs_sched_config sc;
    memset(w, 0, sizeof *w);
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = 128;
    pc.block_tokens = BT;
    pc.on_events = count_events;
    KVT_EQ(kvb_pool_create(&pc, &w->pool), KVB_OK);
    memset(&sc, 0, sizeof sc);
    sc.device = w->pool;
    KVT_EQ(kvs_sched_create(&sc, &w->s), KVS_OK);
    for (size_t i = 0; i < sizeof w->prompt / sizeof w->prompt[0]; i++) w->prompt[i] = (uint32_t)(i * 7919u + 13u);
    stored_events = 0;
}

static void world_close(world *w)
{
    kvb_pool_stats ps;
    kvs_sched_destroy(w->s);
    KVT_EQ(kvb_pool_get_stats(w->pool, &ps), KVB_OK);
    KVT_EQ(ps.active_blocks, 0);
    kvb_pool_destroy(w->pool);
}

/* Adds a request of n prompt tokens (from `first`) and runs one step, its prefill (complete with the
 * memory gone when `starve`), then appends its first token. The request's id in *id. */
static void prefill(world *w, size_t first, size_t n, uint32_t max_new, int starve, uint64_t *id)
{
    kvs_request rq;
    kvs_step st;
    uint32_t tok = 5;
    memset(&rq, 0, sizeof rq);
    rq.prompt = w->prompt + first;
    rq.num_prompt = n;
    rq.max_new_tokens = max_new;
    KVT_EQ(kvs_sched_add(w->s, &rq, id), KVS_OK);
    KVT_EQ(kvs_sched_step(w->s, &st), KVS_OK);
    KVT_EQ(st.num_prefill, 1);
    oom_on = starve;
    KVT_EQ(kvs_sched_complete(w->s, &st), KVS_OK); /* the step is done whatever the pool's memory */
    oom_on = 0;
    KVT_EQ(kvs_sched_append(w->s, *id, &tok, 1), KVS_OK); /* its first token (max_new 1: it finishes) */
}

/* One decode step of request `id`, its sampled token appended. */
static void decode(world *w, uint64_t id, int starve)
{
    kvs_step st;
    uint32_t tok = 5;
    KVT_EQ(kvs_sched_step(w->s, &st), KVS_OK);
    KVT_EQ(st.num_decode, 1);
    oom_on = starve;
    KVT_EQ(kvs_sched_complete(w->s, &st), KVS_OK);
    oom_on = 0;
    KVT_EQ(kvs_sched_append(w->s, id, &tok, 1), KVS_OK);
}

/* A first request warms the scheduler's arrays and the pool's event batch (1 block); the second's 32
 * blocks need a bigger batch, which the starved complete cannot have. The next step (a decode that fills
 * no block) registers them. */
static void test_commit_retried_at_the_next_step(void)
{
    world w;
    uint64_t a, b;
    kvs_sched_stats ss;
    world_open(&w);
    prefill(&w, 0, BT + 1, 1, 0, &a);
    KVT_EQ(stored_events, 1);
    prefill(&w, BT + 1, 32 * BT + 1, 8, 1, &b);
    KVT_CHECK(oom_refused > 0);
    KVT_EQ(stored_events, 1); /* nothing registered: the batch could not grow */
    KVT_EQ(kvs_sched_get_stats(w.s, &ss), KVS_OK);
    KVT_EQ(ss.commits_deferred, 1);
    KVT_EQ(ss.blocks_not_registered, 0);
    decode(&w, b, 0);
    KVT_EQ(stored_events, 1 + 32); /* retried: all 32 registered, none lost */
    KVT_EQ(kvs_sched_get_stats(w.s, &ss), KVS_OK);
    KVT_EQ(ss.commits_deferred, 1);
    KVT_EQ(ss.blocks_not_registered, 0);
    world_close(&w);
}

/* The request ends (abort) while its commit is owed: the last try before its blocks go back registers
 * them when the memory is there again... */
static void test_commit_retried_before_the_blocks_go(void)
{
    world w;
    uint64_t a, b;
    world_open(&w);
    prefill(&w, 0, BT + 1, 1, 0, &a);
    prefill(&w, BT + 1, 32 * BT + 1, 8, 1, &b);
    KVT_EQ(stored_events, 1);
    KVT_EQ(kvs_sched_abort(w.s, b), KVS_OK);
    KVT_EQ(stored_events, 1 + 32);
    world_close(&w);
}

/* ... and when it is not, the blocks go back unregistered, counted: a final, reported state. */
static void test_commit_never_possible_is_counted(void)
{
    world w;
    uint64_t a, b;
    kvs_sched_stats ss;
    world_open(&w);
    prefill(&w, 0, BT + 1, 1, 0, &a);
    prefill(&w, BT + 1, 32 * BT + 1, 8, 1, &b);
    oom_on = 1;
    KVT_EQ(kvs_sched_abort(w.s, b), KVS_OK);
    oom_on = 0;
    KVT_EQ(stored_events, 1);
    KVT_EQ(kvs_sched_get_stats(w.s, &ss), KVS_OK);
    KVT_EQ(ss.commits_deferred, 1);
    KVT_EQ(ss.blocks_not_registered, 32);
    { /* the Prometheus text reports both */
        static char text[16384];
        size_t len = 0;
        KVT_EQ(kvs_metrics_write(w.s, NULL, text, sizeof text, &len), KVS_OK);
        KVT_CHECK(strstr(text, "\nkvcache_commits_deferred_total 1\n") != NULL);
        KVT_CHECK(strstr(text, "\nkvcache_blocks_not_registered_total 32\n") != NULL);
    }
    world_close(&w);
}

int main(void)
{
    KVT_RUN(test_commit_retried_at_the_next_step);
    KVT_RUN(test_commit_retried_before_the_blocks_go);
    KVT_RUN(test_commit_never_possible_is_counted);
    return kvt_summary();
}
