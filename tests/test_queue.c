/* The cancellable queue of kvoffload.h: a push under an already-cancelled token is refused and nothing is
 * kept; pop skips cancelled items and sweep drops them keeping the rest in order, each dropped item going
 * to on_drop exactly once (a counter per item proves it); pop times out, close wakes a waiting pop; and
 * four producers with four consumers pass every item through exactly once (popped or dropped). */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvtest.h"
#include "offload_fixtures.h"

#include <stdatomic.h>

enum { MAX_ITEMS = 8192 };

/* Items are indices into `drops`; on_drop counts per item. */
typedef struct drop_log {
    atomic_int drops[MAX_ITEMS];
    atomic_int total;
} drop_log;

static void count_drop(void *item, void *user)
{
    drop_log *log = (drop_log *)user;
    size_t id = (size_t)(uintptr_t)item;
    if (id < MAX_ITEMS) atomic_fetch_add(&log->drops[id], 1);
    atomic_fetch_add(&log->total, 1);
}

/* Item ids are stored as pointers; id 0 would be NULL, so ids start at 1. */
static void *item(size_t id) { return (void *)(uintptr_t)id; }
static size_t id_of(void *p) { return (size_t)(uintptr_t)p; }

static drop_log *new_log(void)
{
    drop_log *log = (drop_log *)calloc(1, sizeof *log);
    KVT_CHECK(log != NULL);
    return log;
}

static kvo_queue *new_queue(drop_log *log)
{
    kvo_queue_config cfg;
    kvo_queue *q = NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.on_drop = count_drop;
    cfg.user = log;
    KVT_EQ(kvo_queue_create(&cfg, &q), KVO_OK);
    return q;
}

static kvo_token *new_token(void)
{
    kvo_token *t = NULL;
    KVT_EQ(kvo_token_create(&t), KVO_OK);
    return t;
}

static void test_tokens(void)
{
    kvo_token *t = new_token();
    KVT_EQ(kvo_token_is_cancelled(t), 0);
    kvo_token_retain(t);
    kvo_token_cancel(t);
    KVT_CHECK(kvo_token_is_cancelled(t));
    kvo_token_cancel(t); /* cancelling is final and may be repeated */
    KVT_CHECK(kvo_token_is_cancelled(t));
    kvo_token_release(t);
    KVT_CHECK(kvo_token_is_cancelled(t)); /* still alive: one reference left */
    kvo_token_release(t);
}

/* A container whose token was cancelled before it was pushed is refused: the queue keeps nothing and
 * never calls on_drop for it (the caller still owns the item). */
static void test_push_of_cancelled_token_is_refused(void)
{
    drop_log *log = new_log();
    kvo_queue *q = new_queue(log);
    kvo_token *t = new_token();
    void *out = NULL;
    kvo_token_cancel(t);
    KVT_EQ(kvo_queue_push(q, item(1), t), KVO_ECANCELLED);
    KVT_EQ(kvo_queue_len(q), 0);
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_ETIMEDOUT);
    KVT_EQ(atomic_load(&log->drops[1]), 0);
    /* a live token and no token are both accepted */
    kvo_token *live = new_token();
    KVT_EQ(kvo_queue_push(q, item(2), live), KVO_OK);
    KVT_EQ(kvo_queue_push(q, item(3), NULL), KVO_OK);
    KVT_EQ(kvo_queue_len(q), 2);
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_OK);
    KVT_EQ(id_of(out), 2);
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_OK);
    KVT_EQ(id_of(out), 3);
    kvo_token_release(t);
    kvo_token_release(live);
    kvo_queue_destroy(q);
    KVT_EQ(atomic_load(&log->total), 0);
    free(log);
}

/* Pop hands out the oldest live item and drops the cancelled ones it passes, each once. */
static void test_pop_skips_cancelled(void)
{
    drop_log *log = new_log();
    kvo_queue *q = new_queue(log);
    kvo_token *doomed = new_token(), *live = new_token();
    void *out = NULL;
    KVT_EQ(kvo_queue_push(q, item(1), doomed), KVO_OK);
    KVT_EQ(kvo_queue_push(q, item(2), doomed), KVO_OK);
    KVT_EQ(kvo_queue_push(q, item(3), live), KVO_OK);
    KVT_EQ(kvo_queue_push(q, item(4), doomed), KVO_OK);
    kvo_token_cancel(doomed);
    KVT_EQ(kvo_queue_len(q), 4); /* cancelled items count until they are dropped */
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_OK);
    KVT_EQ(id_of(out), 3);
    KVT_EQ(atomic_load(&log->drops[1]), 1);
    KVT_EQ(atomic_load(&log->drops[2]), 1);
    KVT_EQ(atomic_load(&log->drops[3]), 0);
    /* only item 4 is left, and it is cancelled: pop drops it and finds nothing */
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_ETIMEDOUT);
    KVT_EQ(atomic_load(&log->drops[4]), 1);
    KVT_EQ(kvo_queue_len(q), 0);
    kvo_token_release(doomed);
    kvo_token_release(live);
    kvo_queue_destroy(q);
    KVT_EQ(atomic_load(&log->total), 3); /* destroy found nothing more to drop */
    free(log);
}

/* Sweep drops every cancelled item once and keeps the others in their order. The creator's token
 * references go away before the sweep: the queue holds its own. */
static void test_sweep_keeps_order(void)
{
    drop_log *log = new_log();
    kvo_queue *q = new_queue(log);
    kvo_token *odd = new_token(), *even = new_token();
    size_t dropped = 0;
    void *out = NULL;
    for (size_t id = 1; id <= 10; id++) KVT_EQ(kvo_queue_push(q, item(id), id % 2 ? odd : even), KVO_OK);
    kvo_token_cancel(odd);
    kvo_token_release(odd);
    kvo_token_release(even);
    KVT_EQ(kvo_queue_sweep(q, &dropped), KVO_OK);
    KVT_EQ(dropped, 5);
    KVT_EQ(kvo_queue_len(q), 5);
    for (size_t id = 1; id <= 10; id += 2) KVT_EQ(atomic_load(&log->drops[id]), 1);
    KVT_EQ(kvo_queue_sweep(q, NULL), KVO_OK); /* nothing more to drop, nothing dropped twice */
    KVT_EQ(atomic_load(&log->total), 5);
    for (size_t id = 2; id <= 10; id += 2) {
        KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_OK);
        KVT_EQ(id_of(out), id);
    }
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_ETIMEDOUT);
    kvo_queue_destroy(q);
    for (size_t id = 1; id <= 10; id++) KVT_EQ(atomic_load(&log->drops[id]), id % 2);
    free(log);
}

/* Destroy drops what is left, live or cancelled, exactly once each. */
static void test_destroy_drops_leftovers(void)
{
    drop_log *log = new_log();
    kvo_queue *q = new_queue(log);
    kvo_token *t = new_token();
    KVT_EQ(kvo_queue_push(q, item(1), NULL), KVO_OK);
    KVT_EQ(kvo_queue_push(q, item(2), t), KVO_OK);
    KVT_EQ(kvo_queue_push(q, item(3), t), KVO_OK);
    kvo_token_cancel(t);
    KVT_EQ(kvo_queue_sweep(q, NULL), KVO_OK); /* 2 and 3 go now */
    KVT_EQ(kvo_queue_push(q, item(4), NULL), KVO_OK);
    kvo_token_release(t);
    kvo_queue_destroy(q);
    for (size_t id = 1; id <= 4; id++) KVT_EQ(atomic_load(&log->drops[id]), 1);
    KVT_EQ(atomic_load(&log->total), 4);
    free(log);
}

static void test_pop_timeout(void)
{
    drop_log *log = new_log();
    kvo_queue *q = new_queue(log);
    void *out = NULL;
    uint64_t t0 = of_now_us();
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_ETIMEDOUT); /* 0: do not wait */
    KVT_CHECK(of_now_us() - t0 < 500000);
    t0 = of_now_us();
    KVT_EQ(kvo_queue_pop(q, &out, 30000), KVO_ETIMEDOUT);
    uint64_t waited = of_now_us() - t0;
    KVT_CHECK(waited >= 25000);   /* it did wait about 30 ms */
    KVT_CHECK(waited < 3000000);  /* and did not hang */
    kvo_queue_destroy(q);
    free(log);
}

typedef struct waiter {
    kvo_queue *q;
    int result;
    void *out;
    uint64_t waited_us;
    atomic_int started;
} waiter;

static void *pop_waiting(void *arg)
{
    waiter *w = (waiter *)arg;
    uint64_t t0 = of_now_us();
    atomic_store(&w->started, 1);
    w->result = kvo_queue_pop(w->q, &w->out, 5000000); /* up to 5 s */
    w->waited_us = of_now_us() - t0;
    return NULL;
}

/* A pop waiting on an empty queue is woken by close (KVO_ECLOSED) long before its timeout; a closed
 * queue refuses pushes but still hands out what it holds. */
static void test_close_wakes_pop(void)
{
    drop_log *log = new_log();
    kvo_queue *q = new_queue(log);
    waiter w;
    pthread_t th;
    void *out = NULL;
    memset(&w, 0, sizeof w);
    w.q = q;
    KVT_EQ(pthread_create(&th, NULL, pop_waiting, &w), 0);
    while (!atomic_load(&w.started)) of_sleep_us(1000);
    of_sleep_us(50000); /* let it block in pop */
    kvo_queue_close(q);
    KVT_EQ(pthread_join(th, NULL), 0);
    KVT_EQ(w.result, KVO_ECLOSED);
    KVT_CHECK(w.waited_us < 4000000);
    KVT_EQ(kvo_queue_push(q, item(1), NULL), KVO_ECLOSED);
    KVT_EQ(kvo_queue_len(q), 0);
    KVT_EQ(kvo_queue_pop(q, &out, 1000000), KVO_ECLOSED); /* closed and empty: no wait */
    kvo_queue_destroy(q);
    KVT_EQ(atomic_load(&log->drops[1]), 0); /* refused, not dropped */
    free(log);

    /* items pushed before close still come out after it */
    log = new_log();
    q = new_queue(log);
    KVT_EQ(kvo_queue_push(q, item(7), NULL), KVO_OK);
    kvo_queue_close(q);
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_OK);
    KVT_EQ(id_of(out), 7);
    KVT_EQ(kvo_queue_pop(q, &out, 0), KVO_ECLOSED);
    kvo_queue_destroy(q);
    KVT_EQ(atomic_load(&log->total), 0);
    free(log);
}

/* ---- 4 producers x 4 consumers ---- */

enum { PRODUCERS = 4, CONSUMERS = 4, PER_PRODUCER = 1500, BACKLOG = 100 };

typedef struct mpmc {
    kvo_queue *q;
    drop_log *log;
    atomic_int popped[MAX_ITEMS];
    atomic_int refused[MAX_ITEMS];
    atomic_int producers_left;
    atomic_int bad_results;
} mpmc;

typedef struct producer_arg {
    mpmc *m;
    int index;
} producer_arg;

static void *produce(void *arg)
{
    producer_arg *pa = (producer_arg *)arg;
    mpmc *m = pa->m;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(pa->index + 1);
    kvo_token *group = NULL, *dead = NULL;
    if (kvo_token_create(&dead) != KVO_OK) return NULL;
    kvo_token_cancel(dead);
    for (int i = 0; i < PER_PRODUCER; i++) {
        size_t id = 1 + (size_t)pa->index * PER_PRODUCER + (size_t)i;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if (!group || rng % 8 == 0) {
            /* a new group; the old one is cancelled now and then, with items of it still queued */
            if (group) {
                if (rng % 3 == 0) kvo_token_cancel(group);
                kvo_token_release(group);
            }
            if (kvo_token_create(&group) != KVO_OK) group = NULL;
        }
        kvo_token *token = (rng >> 20) % 5 == 0 ? NULL : group;
        if ((rng >> 24) % 50 == 0) token = dead; /* must be refused */
        int r = kvo_queue_push(m->q, item(id), token);
        if (r == KVO_ECANCELLED) atomic_fetch_add(&m->refused[id], 1);
        if (r != (token == dead ? KVO_ECANCELLED : KVO_OK)) atomic_fetch_add(&m->bad_results, 1);
    }
    kvo_token_release(dead);
    if (group) {
        kvo_token_cancel(group);
        kvo_token_release(group);
    }
    atomic_fetch_sub(&m->producers_left, 1);
    return NULL;
}

static void *consume(void *arg)
{
    mpmc *m = (mpmc *)arg;
    uint64_t end = of_now_us() + 20000000; /* bounded: 20 s at most */
    int sweeps = 0;
    while (of_now_us() < end) {
        void *out = NULL;
        int r = kvo_queue_pop(m->q, &out, 2000);
        if (r == KVO_OK) atomic_fetch_add(&m->popped[id_of(out)], 1);
        else if (r == KVO_ECLOSED) break;
        else if (r != KVO_ETIMEDOUT) break;
        if (++sweeps % 64 == 0) kvo_queue_sweep(m->q, NULL);
    }
    return NULL;
}

/* Every item pushed is either popped or dropped, exactly once; refused pushes are neither. */
static void test_mpmc_every_item_once(void)
{
    mpmc *m = (mpmc *)calloc(1, sizeof *m);
    pthread_t prod[PRODUCERS], cons[CONSUMERS];
    producer_arg args[PRODUCERS];
    KVT_CHECK(m != NULL);
    if (!m) return;
    m->log = new_log();
    m->q = new_queue(m->log);
    atomic_store(&m->producers_left, PRODUCERS);
    /* a backlog cancelled before any consumer runs: all of it must be dropped, none popped */
    kvo_token *backlog = new_token();
    for (size_t k = 0; k < BACKLOG; k++)
        KVT_EQ(kvo_queue_push(m->q, item((size_t)PRODUCERS * PER_PRODUCER + 1 + k), backlog), KVO_OK);
    kvo_token_cancel(backlog);
    kvo_token_release(backlog);
    for (int i = 0; i < CONSUMERS; i++) KVT_EQ(pthread_create(&cons[i], NULL, consume, m), 0);
    for (int i = 0; i < PRODUCERS; i++) {
        args[i].m = m;
        args[i].index = i;
        KVT_EQ(pthread_create(&prod[i], NULL, produce, &args[i]), 0);
    }
    for (int i = 0; i < PRODUCERS; i++) KVT_EQ(pthread_join(prod[i], NULL), 0);
    kvo_queue_close(m->q); /* consumers take what is left, then see KVO_ECLOSED */
    for (int i = 0; i < CONSUMERS; i++) KVT_EQ(pthread_join(cons[i], NULL), 0);
    KVT_EQ(atomic_load(&m->bad_results), 0);
    kvo_queue_destroy(m->q);

    int wrong = 0, popped = 0, dropped = 0, refused = 0;
    for (size_t id = 1; id <= (size_t)PRODUCERS * PER_PRODUCER + BACKLOG; id++) {
        int p = atomic_load(&m->popped[id]), d = atomic_load(&m->log->drops[id]),
            r = atomic_load(&m->refused[id]);
        popped += p;
        dropped += d;
        refused += r;
        if (p + d + r != 1 || (r && (p || d))) {
            if (wrong < 5) fprintf(stderr, "  item %zu: popped %d, dropped %d, refused %d\n", id, p, d, r);
            wrong++;
        }
    }
    KVT_EQ(wrong, 0);
    KVT_EQ(popped + dropped + refused, PRODUCERS * PER_PRODUCER + BACKLOG);
    for (size_t k = 0; k < BACKLOG; k++) KVT_EQ(atomic_load(&m->popped[(size_t)PRODUCERS * PER_PRODUCER + 1 + k]), 0);
    KVT_CHECK(popped > 0);
    KVT_CHECK(dropped >= BACKLOG);
    KVT_CHECK(refused > 0);
    KVT_EQ(atomic_load(&m->log->total), dropped);
    free(m->log);
    free(m);
}

int main(void)
{
    of_watchdog(120);
    KVT_RUN(test_tokens);
    KVT_RUN(test_push_of_cancelled_token_is_refused);
    KVT_RUN(test_pop_skips_cancelled);
    KVT_RUN(test_sweep_keeps_order);
    KVT_RUN(test_destroy_drops_leftovers);
    KVT_RUN(test_pop_timeout);
    KVT_RUN(test_close_wakes_pop);
    KVT_RUN(test_mpmc_every_item_once);
    return kvt_summary();
}
