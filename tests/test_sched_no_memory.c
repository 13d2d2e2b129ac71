/* Out of memory in the scheduler of kvsched.h (no tiers; tests/test_sched_oom.c covers the device pool's
 * event memory): every allocation (KVB_MALLOC and KVB_REALLOC) a call makes is made to fail in turn,
 * once or from then on, for N = 0, 1, .. until the call makes no Nth. kvs_sched_add returns KVS_ENOMEM
 * with nothing changed (no request, no count), or adds. The scheduler's own per-step lists never grow in
 * a step (their room is made at the add): steps, completes and appends with allocations failing succeed
 * (a request whose sequence finds no memory waits), and with the memory back every request finishes;
 * then everything is released, no device block is referenced and the pool passes kvb_pool_check. Before,
 * a step that planned more items than ever crashed in stb_ds's growth. (Leaks show at exit under
 * AddressSanitizer.) */
#include "oom_hooks.h"
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "kvtest.h"
#include "offload_fixtures.h"

enum { REQS = 6, MAX_N = 400, PROMPT = 40 };

typedef struct world {
    kvb_pool *dev, *host;
    kvo_backend *copy;
    kvo_manager *tiers;
    kvs_sched *s;
    uint64_t id[REQS + 1];
    size_t n;
    uint32_t token;
} world;

/* A device pool of num_blocks; with `tiers`, a host tier under an eager manager (poll mode): the
 * connector offers every registered block and onboards what the host holds. */
static void world_open(world *w, uint32_t num_blocks, int tiers, kvs_bus *bus)
{
    kvb_pool_config pc;
    kvs_sched_config sc;
    memset(w, 0, sizeof *w);
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = num_blocks;
    pc.block_tokens = 16;
    KVT_EQ(kvb_pool_create(&pc, &w->dev), KVB_OK);
    memset(&sc, 0, sizeof sc);
    sc.device = w->dev;
    sc.bus = bus;
    if (tiers) {
        kvo_manager_config mc;
        pc.num_blocks = 64;
        KVT_EQ(kvb_pool_create(&pc, &w->host), KVB_OK);
        KVT_EQ(kvo_memcpy_backend_create(0, &w->copy), KVO_OK);
        memset(&mc, 0, sizeof mc);
        mc.num_tiers = 2;
        mc.pools[0] = w->dev;
        mc.pools[1] = w->host;
        mc.down[0] = w->copy;
        mc.up[1] = w->copy;
        mc.pipeline.mode = KVO_MODE_POLL;
        KVT_EQ(kvo_manager_create(&mc, &w->tiers), KVO_OK);
        sc.tiers = w->tiers;
    }
    KVT_EQ(kvs_sched_create(&sc, &w->s), KVS_OK);
    w->token = 1000;
}

static kvs_result world_add(world *w, uint32_t seed)
{
    uint32_t prompt[PROMPT];
    kvs_request rq;
    for (uint32_t i = 0; i < PROMPT; i++) prompt[i] = i < 16 ? i : seed * 100 + i; /* a shared first block */
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = PROMPT - seed % 3;
    rq.max_new_tokens = 20 + seed;
    kvs_result r = kvs_sched_add(w->s, &rq, &w->id[w->n]);
    if (r == KVS_OK) w->n++;
    return r;
}

/* One step: schedule, complete, a sampled token for every request whose item computed its last token.
 * Returns how many requests are finished. */
static size_t world_step(world *w)
{
    kvs_step st;
    size_t finished = 0;
    KVT_EQ(kvs_sched_step(w->s, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(w->s, &st), KVS_OK);
    for (size_t i = 0; i < st.num_prefill + st.num_decode; i++) {
        const kvs_sched_item *it = i < st.num_prefill ? &st.prefill[i] : &st.decode[i - st.num_prefill];
        if (it->num_computed + it->num_new < it->num_tokens) continue;
        kvs_result r = kvs_sched_append(w->s, it->request, &w->token, 1);
        KVT_CHECK(r == KVS_OK);
        w->token++;
    }
    for (size_t i = 0; i < w->n; i++) {
        kvs_slot_info si;
        if (kvs_sched_get_slot(w->s, w->id[i], &si) == KVS_OK && si.state == KVS_SLOT_FINISHED) finished++;
    }
    return finished;
}

/* With the memory there: run to the end, release every request, and nothing is held. */
static void world_finish(world *w)
{
    char why[256] = "";
    kvb_pool_stats ps0;
    oom_disarm();
    for (int i = 0; i < 400 && world_step(w) < w->n; i++) {
    }
    KVT_EQ(world_step(w), w->n);
    for (size_t i = 0; i < w->n; i++) KVT_EQ(kvs_sched_release(w->s, w->id[i]), KVS_OK);
    KVT_EQ(kvs_sched_idle(w->s), 1);
    kvs_sched_destroy(w->s);
    if (w->tiers) {
        kvo_manager_destroy(w->tiers);
        kvo_backend_destroy(w->copy);
        KVT_EQ(kvb_pool_get_stats(w->host, &ps0), KVB_OK);
        KVT_EQ(ps0.active_blocks, 0);
        KVT_EQ(kvb_pool_check(w->host, why, sizeof why), KVB_OK);
        kvb_pool_destroy(w->host);
    }
    kvb_pool_stats ps;
    KVT_EQ(kvb_pool_get_stats(w->dev, &ps), KVB_OK);
    KVT_EQ(ps.active_blocks, 0);
    KVT_EQ(kvb_pool_check(w->dev, why, sizeof why), KVB_OK);
    kvb_pool_destroy(w->dev);
}

static void test_add_out_of_memory(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            world w;
            kvs_sched_stats before, after;
            world_open(&w, 24, 0, NULL); /* 6 prompts of 3 blocks and their tokens do not all fit: preemption */
            for (uint32_t i = 0; i < 3; i++) KVT_EQ(world_add(&w, i), KVS_OK);
            (void)world_step(&w);
            KVT_EQ(kvs_sched_get_stats(w.s, &before), KVS_OK);
            oom_arm(at, sticky);
            kvs_result r = world_add(&w, 3);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(r == KVS_OK || r == KVS_ENOMEM);
            KVT_EQ(kvs_sched_get_stats(w.s, &after), KVS_OK);
            if (r == KVS_ENOMEM) {
                KVT_EQ(after.waiting, before.waiting);
                KVT_EQ(after.prompt_tokens, before.prompt_tokens);
                kvs_slot_info si;
                KVT_EQ(kvs_sched_get_slot(w.s, w.id[2] + 1, &si), KVS_ENOTFOUND);
            }
            KVT_EQ(world_add(&w, 4), KVS_OK); /* the memory is back */
            world_finish(&w);
            if (!fired) break;
        }
}

/* The ADD event of an add refused out of memory is never published: the log would name an id the next
 * add takes (two ADDs for one request, and a replay with a request too many). The ADD of the add that
 * succeeds names the id it returns. Before, the event went out before the add made its room. */
static int adds_seen;
static uint64_t last_add;
static void count_adds(void *user, const kvs_event *e)
{
    (void)user;
    if (e->kind != KVS_EV_ADD) return;
    adds_seen++;
    last_add = e->request;
}

static void test_add_out_of_memory_publishes_no_add(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            world w;
            kvs_bus *bus = NULL;
            KVT_EQ(kvs_bus_create(NULL, &bus), KVS_OK);
            KVT_EQ(kvs_bus_subscribe(bus, KVS_EV_MASK(KVS_EV_ADD), count_adds, NULL, NULL), KVS_OK);
            world_open(&w, 24, 0, bus);
            for (uint32_t i = 0; i < 3; i++) KVT_EQ(world_add(&w, i), KVS_OK);
            adds_seen = 0;
            oom_arm(at, sticky);
            kvs_result r = world_add(&w, 3);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(r == KVS_OK || r == KVS_ENOMEM);
            KVT_EQ(adds_seen, r == KVS_OK ? 1 : 0);
            if (r == KVS_OK) KVT_EQ(last_add, w.id[w.n - 1]);
            KVT_EQ(world_add(&w, 4), KVS_OK); /* the memory is back */
            KVT_EQ(last_add, w.id[w.n - 1]);
            world_finish(&w);
            kvs_bus_destroy(bus);
            if (!fired) break;
        }
}

/* A recorded run replayed with every allocation failing in turn (once, or from then on): kvs_replay ends
 * in KVS_ENOMEM, or in KVS_OK / KVS_EREPLAY when the memory it missed was one the fresh scheduler does
 * without (a request that waits differs from the record); never a crash, and nothing leaks. With the
 * memory there the replay matches. Before, its stb_ds arrays and maps wrote through a failed realloc. */
static void test_replay_out_of_memory(void)
{
    kvs_bus *bus = NULL;
    kvs_recorder *rec = NULL;
    kvs_recorder_config rc;
    kvs_event *ev;
    size_t n = 0, got = 0;
    uint64_t dropped = 1;
    world w;
    int nomem = 0, whole = 0;
    KVT_EQ(kvs_bus_create(NULL, &bus), KVS_OK);
    memset(&rc, 0, sizeof rc);
    rc.capacity = 1u << 14;
    KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_OK);
    world_open(&w, 24, 0, bus); /* preemption: decisions of every kind */
    for (uint32_t i = 0; i < REQS; i++) KVT_EQ(world_add(&w, i), KVS_OK);
    world_finish(&w);
    KVT_EQ(kvs_recorder_snapshot(rec, NULL, 0, &n, &dropped), KVS_OK);
    ev = (kvs_event *)calloc(n, sizeof *ev);
    KVT_EQ(kvs_recorder_snapshot(rec, ev, n, &got, &dropped), KVS_OK);
    KVT_EQ(got, n);
    KVT_EQ(dropped, 0);
    kvs_recorder_destroy(rec);
    kvs_bus_destroy(bus);
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < 20 * MAX_N; at++) {
            world f;
            kvs_replay_report rep;
            char why[256] = "";
            KVT_EQ(kvs_bus_create(NULL, &bus), KVS_OK);
            world_open(&f, 24, 0, bus);
            oom_arm(at, sticky);
            kvs_result r = kvs_replay(f.s, bus, ev, n, 0, &rep);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(r == KVS_OK || r == KVS_ENOMEM || r == KVS_EREPLAY);
            nomem += r == KVS_ENOMEM;
            kvs_sched_destroy(f.s);
            KVT_EQ(kvb_pool_check(f.dev, why, sizeof why), KVB_OK);
            kvb_pool_destroy(f.dev);
            kvs_bus_destroy(bus);
            if (!fired) {
                KVT_EQ(r, KVS_OK);
                KVT_CHECK(rep.compared > 20);
                whole++;
                break;
            }
        }
    KVT_EQ(whole, 2);
    KVT_CHECK(nomem > 0);
    free(ev);
}

/* Requests added with the memory there, then steps with allocations failing (from the Nth on, or only
 * the Nth): every call succeeds and every request finishes. Four requests run first, so the step's lists
 * hold four; then two more come, and the next step plans six items: with a device that holds them all
 * (64 blocks) the lists must not grow then, and with one that does not (24) preemption runs without
 * memory too. */
static void steps_without_memory(uint32_t num_blocks, int tiers)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            world w;
            world_open(&w, num_blocks, tiers, NULL);
            for (uint32_t i = 0; i < 4; i++) KVT_EQ(world_add(&w, i), KVS_OK);
            for (int i = 0; i < 2; i++) (void)world_step(&w); /* the step's lists hold 4 */
            for (uint32_t i = 4; i < REQS; i++) KVT_EQ(world_add(&w, i), KVS_OK);
            oom_arm(at, sticky);
            for (int i = 0; i < 60; i++) (void)world_step(&w);
            int fired = oom_fired;
            world_finish(&w);
            if (!fired) break;
        }
}

static void test_steps_without_memory_all_running(void) { steps_without_memory(64, 0); }
static void test_steps_without_memory_preempting(void) { steps_without_memory(24, 0); }
/* With a host tier: the connector's stores, loads and their reports without memory too. */
static void test_steps_without_memory_host_tier(void) { steps_without_memory(24, 1); }

/* Requests released between step and complete go to the spares when the step completes; the room for
 * them there must have been made at their adds like every other's, also when more requests of their class
 * were added meanwhile. Four requests are aborted and released mid-step, four more added mid-step; with
 * no memory at all, ending and releasing the four new ones must not allocate. Before, the spares' room
 * counted only the requests not released (the four pending ones not among them), so the releases grew
 * the spare list, and without memory stb_ds's growth crashed. In a child process: a crash fails this
 * test, not the whole program. */
static int release_after_mid_step_child(void *arg)
{
    (void)arg;
    world w;
    kvs_step st;
    uint32_t prompt[PROMPT];
    uint64_t a[4], b[4];
    kvs_request rq;
    world_open(&w, 64, 0, NULL);
    for (uint32_t i = 0; i < PROMPT; i++) prompt[i] = 7 * i + 1;
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = PROMPT;
    rq.max_new_tokens = 1;
    for (int i = 0; i < 4; i++)
        if (kvs_sched_add(w.s, &rq, &a[i]) != KVS_OK) return 2;
    if (kvs_sched_step(w.s, &st) != KVS_OK || st.num_prefill != 4) return 3;
    for (int i = 0; i < 4; i++)
        if (kvs_sched_abort(w.s, a[i]) != KVS_OK || kvs_sched_release(w.s, a[i]) != KVS_OK) return 4;
    for (int i = 0; i < 4; i++)
        if (kvs_sched_add(w.s, &rq, &b[i]) != KVS_OK) return 5;
    if (kvs_sched_complete(w.s, &st) != KVS_OK) return 6;
    oom_arm(0, 1);
    for (int i = 0; i < 4; i++)
        if (kvs_sched_finish(w.s, b[i]) != KVS_OK || kvs_sched_release(w.s, b[i]) != KVS_OK) return 7;
    oom_disarm();
    return oom_fired ? 8 : 0;
}

static void test_release_after_mid_step_releases_without_memory(void)
{
    of_in_child(release_after_mid_step_child, NULL, "a release allocated?");
}

int main(void)
{
    of_watchdog(300);
    KVT_RUN(test_add_out_of_memory);
    KVT_RUN(test_add_out_of_memory_publishes_no_add);
    KVT_RUN(test_replay_out_of_memory);
    KVT_RUN(test_steps_without_memory_all_running);
    KVT_RUN(test_steps_without_memory_preempting);
    KVT_RUN(test_steps_without_memory_host_tier);
    KVT_RUN(test_release_after_mid_step_releases_without_memory);
    return kvt_summary();
}
