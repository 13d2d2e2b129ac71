/* Stress: 8 producer threads, for about two seconds (and a bounded number of steps), enqueue blocks
 * against a threaded pipeline with a two-worker memcpy backend, cancel by token and by handle, release
 * handles early, wait on precondition events, and meanwhile register and evict source blocks (so many
 * weak handles go stale). Then everything drains: every handle ends in a final state with consistent
 * counts, no block is left referenced in either pool, both pools pass kvb_pool_check, and every block
 * that landed in the destination carries the bytes of its hash. Also run under ThreadSanitizer. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvtest.h"
#include "offload_fixtures.h"

#include <stdatomic.h>

enum { PRODUCERS = 8, MAX_STEPS = 50000, RING = 32, MAX_HANDLES = 256, MAX_EVENTS = 64 };
#define RUN_US 2000000u

typedef struct shared {
    kvb_pool *src, *dst;
    kvo_pipeline *p;
    uint64_t end_us;
    atomic_int complete, cancelled, failed, refused, early_released, bad;
    atomic_int steps;
} shared;

typedef struct producer {
    shared *s;
    uint32_t id;
    uint64_t rng;
    kvb_weak ring[RING];
    size_t ring_n, ring_next;
    uint64_t next_hash;
    kvo_transfer handles[MAX_HANDLES];
    size_t n_handles;
    kvo_event *events[MAX_EVENTS];
    size_t n_events;
} producer;

static uint64_t next_rand(producer *pr)
{
    pr->rng ^= pr->rng << 13;
    pr->rng ^= pr->rng >> 7;
    pr->rng ^= pr->rng << 17;
    return pr->rng;
}

static void bad(producer *pr, const char *what, int code)
{
    if (atomic_fetch_add(&pr->s->bad, 1) < 10) fprintf(stderr, "  producer %u: %s (%d)\n", pr->id, what, code);
}

/* Four new cached source blocks with this producer's hashes and bytes. */
static void register_some(producer *pr)
{
    kvb_block b[4], out[4];
    kvb_hash h[4];
    if (kvb_alloc(pr->s->src, 4, b) != KVB_OK) return; /* all in use right now: fine */
    for (size_t i = 0; i < 4; i++) {
        h[i].lo = next_rand(pr);
        h[i].hi = ((uint64_t)pr->id << 40) | pr->next_hash++;
        of_fill(pr->s->src, b[i], h[i]);
    }
    int r = kvb_register_hashed(pr->s->src, b, 4, h, NULL, out);
    if (r != KVB_OK) {
        bad(pr, "register_hashed", r);
        kvb_release(pr->s->src, b, 4, NULL);
        return;
    }
    for (size_t i = 0; i < 4; i++) {
        pr->ring[pr->ring_next] = kvb_weak_of(out[i]);
        pr->ring_next = (pr->ring_next + 1) % RING;
        if (pr->ring_n < RING) pr->ring_n++;
    }
    r = kvb_release(pr->s->src, out, 4, NULL);
    if (r != KVB_OK) bad(pr, "release", r);
}

static void signal_events(producer *pr)
{
    for (size_t i = 0; i < pr->n_events; i++) {
        kvo_event_signal(pr->events[i]);
        kvo_event_release(pr->events[i]);
    }
    pr->n_events = 0;
}

static void check_final(producer *pr, const kvo_transfer_info *info)
{
    shared *s = pr->s;
    uint32_t accounted = info->transferred + info->present + info->skipped + info->timed_out + info->dropped + info->failed;
    if (!of_final(info->status)) bad(pr, "not final", info->status);
    if (accounted > info->blocks) bad(pr, "counts exceed the container", (int)accounted);
    if (info->status == KVO_STATUS_CANCELLED && info->transferred) bad(pr, "cancelled but transferred", 0);
    if (info->status == KVO_STATUS_COMPLETE) atomic_fetch_add(&s->complete, 1);
    if (info->status == KVO_STATUS_CANCELLED) atomic_fetch_add(&s->cancelled, 1);
    if (info->status == KVO_STATUS_FAILED) atomic_fetch_add(&s->failed, 1);
}

/* Signal what this producer still holds back, then wait for each of its handles (bounded), check it
 * and release it. */
static void finish_handles(producer *pr)
{
    shared *s = pr->s;
    signal_events(pr);
    for (size_t i = 0; i < pr->n_handles; i++) {
        kvo_status st = KVO_STATUS_EVALUATING;
        int r = kvo_transfer_wait(s->p, pr->handles[i], 20000000, &st);
        if (r != KVO_OK) {
            bad(pr, "wait", r);
            continue;
        }
        kvo_transfer_info info;
        r = kvo_transfer_get_info(s->p, pr->handles[i], &info);
        if (r != KVO_OK) bad(pr, "get_info", r);
        else check_final(pr, &info);
        r = kvo_transfer_release(s->p, pr->handles[i]);
        if (r != KVO_OK) bad(pr, "release", r);
    }
    pr->n_handles = 0;
}

static void enqueue_some(producer *pr)
{
    shared *s = pr->s;
    kvb_weak blocks[6];
    size_t n = 1 + next_rand(pr) % 6;
    uint64_t r = next_rand(pr);
    kvo_token *token = NULL;
    kvo_event *ev = NULL;
    kvo_enqueue_opts o;
    kvo_transfer t;
    if (!pr->ring_n) return;
    if (pr->n_handles >= MAX_HANDLES) finish_handles(pr);
    for (size_t i = 0; i < n; i++) blocks[i] = pr->ring[next_rand(pr) % pr->ring_n];
    memset(&o, 0, sizeof o);
    o.priority = (uint32_t)(r % 4);
    if ((r >> 8) % 4 == 0 && kvo_token_create(&token) == KVO_OK) o.token = token;
    if ((r >> 16) % 10 == 0 && pr->n_events < MAX_EVENTS && kvo_event_create(&ev) == KVO_OK) o.precondition = ev;
    int precancelled = token && (r >> 24) % 8 == 0;
    if (precancelled) kvo_token_cancel(token);
    int res = kvo_enqueue(s->p, blocks, n, &o, &t);
    if (precancelled) {
        if (res != KVO_ECANCELLED) bad(pr, "enqueue under a cancelled token", res);
        else atomic_fetch_add(&s->refused, 1);
    } else if (res != KVO_OK) {
        bad(pr, "enqueue", res);
    } else {
        pr->handles[pr->n_handles++] = t;
        if (token && (r >> 32) % 2 == 0) kvo_token_cancel(token); /* right behind it */
    }
    if (ev) {
        if ((r >> 40) % 2 == 0) {
            kvo_event_signal(ev);
            kvo_event_release(ev);
        } else {
            pr->events[pr->n_events++] = ev;
        }
    }
    kvo_token_release(token);
}

static void *produce(void *arg)
{
    producer *pr = (producer *)arg;
    shared *s = pr->s;
    for (int step = 0; step < MAX_STEPS && of_now_us() < s->end_us; step++) {
        uint64_t action = next_rand(pr) % 16;
        atomic_fetch_add(&s->steps, 1);
        if (action < 8) {
            enqueue_some(pr);
        } else if (action < 10 && pr->n_handles) {
            kvo_status st = KVO_STATUS_EVALUATING;
            kvo_transfer t = pr->handles[next_rand(pr) % pr->n_handles];
            int r = kvo_transfer_cancel(s->p, t, &st);
            if (r != KVO_OK) bad(pr, "cancel", r);
            else if (!of_final(st)) bad(pr, "cancel returned a non-final status", st);
        } else if (action == 10 && pr->n_handles) {
            size_t k = next_rand(pr) % pr->n_handles;
            int r = kvo_transfer_release(s->p, pr->handles[k]);
            if (r != KVO_OK) bad(pr, "early release", r);
            pr->handles[k] = pr->handles[--pr->n_handles];
            atomic_fetch_add(&s->early_released, 1);
        } else if (action < 13) {
            register_some(pr);
        } else if (action < 15) {
            kvb_block churn[3]; /* the engine allocating: evicts cached blocks */
            if (kvb_alloc(s->src, 3, churn) == KVB_OK) kvb_release(s->src, churn, 3, NULL);
        } else {
            signal_events(pr);
        }
    }
    finish_handles(pr);
    return NULL;
}

static void test_producers_against_threaded_pipeline(void)
{
    shared *s = (shared *)calloc(1, sizeof *s);
    producer *prs = (producer *)calloc(PRODUCERS, sizeof *prs);
    pthread_t th[PRODUCERS];
    kvo_backend *mem = NULL;
    KVT_CHECK(s && prs);
    if (!s || !prs) {
        free(s);
        free(prs);
        return;
    }
    s->src = of_mem_pool(1024, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    s->dst = of_mem_pool(256, KVB_LAYOUT_LAYER_SEPARATE);
    KVT_EQ(kvo_memcpy_backend_create(2, &mem), KVO_OK);
    kvo_pipeline_config pc = of_config(s->src, s->dst, mem, KVO_MODE_THREADS, NULL);
    pc.max_batch = 32;
    pc.min_batch = 4;
    pc.flush_interval_us = 1000;
    pc.sweep_interval_us = 1000;
    pc.max_concurrent = 2;
    s->p = of_pipeline(&pc);
    if (!s->p) return;
    uint32_t src_base = of_active(s->src), dst_base = of_active(s->dst);

    s->end_us = of_now_us() + RUN_US;
    for (uint32_t i = 0; i < PRODUCERS; i++) {
        prs[i].s = s;
        prs[i].id = i + 1;
        prs[i].rng = 0x9e3779b97f4a7c15ull * (i + 1) + 12345;
        register_some(&prs[i]);
        register_some(&prs[i]);
        KVT_EQ(pthread_create(&th[i], NULL, produce, &prs[i]), 0);
    }
    for (uint32_t i = 0; i < PRODUCERS; i++) KVT_EQ(pthread_join(th[i], NULL), 0);

    KVT_EQ(kvo_pipeline_drain(s->p, 20000000), KVO_OK);
    kvo_pipeline_stats st;
    KVT_EQ(kvo_pipeline_get_stats(s->p, &st), KVO_OK);
    kvo_pipeline_destroy(s->p);
    kvo_backend_destroy(mem);

    printf("     %d steps: %d complete, %d cancelled, %d failed, %d refused, %d released early; "
           "%llu blocks transferred, %llu dropped, %llu skipped\n",
           atomic_load(&s->steps), atomic_load(&s->complete), atomic_load(&s->cancelled), atomic_load(&s->failed),
           atomic_load(&s->refused), atomic_load(&s->early_released), (unsigned long long)st.transferred,
           (unsigned long long)st.dropped, (unsigned long long)st.skipped);
    KVT_EQ(atomic_load(&s->bad), 0);
    KVT_CHECK(atomic_load(&s->complete) > 0);
    KVT_CHECK(atomic_load(&s->cancelled) > 0);
    KVT_CHECK(st.transferred > 0);
    KVT_EQ(of_active(s->src), src_base);
    KVT_EQ(of_active(s->dst), dst_base);
    OF_CHECK_POOL(s->src);
    OF_CHECK_POOL(s->dst);

    /* every block that landed carries the bytes of its hash */
    kvb_weak landed[256];
    size_t n = 0, good = 0;
    KVT_EQ(kvb_eviction_candidates(s->dst, 256, landed, &n), KVB_OK);
    KVT_CHECK(n > 0);
    for (size_t i = 0; i < n; i++) {
        kvb_block b;
        if (kvb_upgrade(s->dst, landed[i], &b) != KVB_OK) continue;
        good += of_bytes_ok(s->dst, b, of_hash_of(s->dst, b.id));
        kvb_release(s->dst, &b, 1, NULL);
    }
    KVT_EQ(good, n);
    kvb_pool_destroy(s->src);
    kvb_pool_destroy(s->dst);
    free(s);
    free(prs);
}

int main(void)
{
    of_watchdog(240);
    KVT_RUN(test_producers_against_threaded_pipeline);
    return kvt_summary();
}
