/* Out of memory in kvoffload.h: every allocation a call makes (KVB_MALLOC and KVB_REALLOC: the pipeline's
 * arrays, queues, handle slots, batches, notes) is made to fail in turn, once or from then on, for
 * N = 0, 1, .. until the call makes no Nth. Never a crash: kvo_pipeline_create and kvo_enqueue return
 * KVO_ENOMEM with nothing made or enqueued; out of memory in a stage (kvo_pipeline_poll) or in an onboard,
 * a transfer ends failed with KVO_ENOMEM, or completes; the tier manager's offer returns KVO_ENOMEM or
 * sends. Afterwards, with the memory there, everything drains: every transfer final, no block in the
 * destination with wrong bytes (a landed block may be left uncached: out of memory for its eviction
 * ring, a release caches less), on_done called exactly once per transfer (its note is reserved when the
 * transfer is accepted; stats.notes_lost stays 0), and once every transfer is released and the pipeline
 * destroyed, no block of either pool is referenced and both pass kvb_pool_check. (Leaks show at exit
 * under AddressSanitizer.) */
#include "oom_hooks.h"
static long oom_iters; /* runs armed */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvtest.h"
#include "offload_fixtures.h"

enum { BLOCKS = 12, MAX_N = 400 };

typedef struct rig {
    kvb_pool *src, *dst;
    kvo_backend *mem;
    of_clock clock;
    kvb_hash h[BLOCKS];
    kvb_weak weak[BLOCKS];
    kvo_pipeline_config pc;
    kvo_pipeline *p;
    int done_calls;
} rig;

static void count_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    (void)t;
    (void)info;
    (void)dst;
    (void)n;
    ((rig *)user)->done_calls++;
}

/* Pools and a backend with the memory there; the pipeline is the test's to make. */
static void rig_open(rig *r, kvo_mode mode)
{
    memset(r, 0, sizeof *r);
    r->src = of_mem_pool(32, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    r->dst = of_mem_pool(32, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    KVT_EQ(kvo_memcpy_backend_create(0, &r->mem), KVO_OK);
    r->clock.now = 1000000;
    of_chain(7, BLOCKS, r->h);
    of_register(r->src, r->h, BLOCKS, NULL, r->weak);
    r->pc = of_config(r->src, r->dst, r->mem, mode, &r->clock);
    r->pc.min_batch = 1;
    r->pc.max_batch = 4; /* several batches: the batcher, the queue of batches, on deck */
    r->pc.on_done = count_done;
    r->pc.done_user = r;
}

/* Drain with the memory there; every transfer in t[0..n) is final (complete, or failed out of memory
 * when `failed_ok`); on_done came for each but those lost; then release, destroy, and nothing is held. */
static void rig_finish(rig *r, const kvo_transfer *t, size_t n, int failed_ok)
{
    kvo_pipeline_stats st;
    oom_disarm();
    if (r->p) {
        of_polls(r->p, &r->clock, 20000, 20);
        KVT_EQ(kvo_pipeline_drain(r->p, 5000000), KVO_OK);
        for (size_t i = 0; i < n; i++) {
            kvo_transfer_info info = of_info(r->p, t[i]);
            KVT_CHECK(info.status == KVO_STATUS_COMPLETE ||
                      (failed_ok && info.status == KVO_STATUS_FAILED && info.error == KVO_ENOMEM));
            if (info.status == KVO_STATUS_COMPLETE && !t[i].id) KVT_CHECK(0);
        }
        KVT_EQ(kvo_pipeline_get_stats(r->p, &st), KVO_OK);
        KVT_EQ((uint64_t)r->done_calls, st.enqueued);
        KVT_EQ(st.notes_lost, 0);
        for (size_t i = 0; i < n; i++) KVT_EQ(kvo_transfer_release(r->p, t[i]), KVO_OK);
        kvo_pipeline_destroy(r->p);
    }
    KVT_EQ(of_active(r->src), 0);
    KVT_EQ(of_active(r->dst), 0);
    char why[256] = "";
    KVT_EQ(kvb_pool_check(r->src, why, sizeof why), KVB_OK);
    /* a registration in the destination whose parent is not there yet counts its child as an orphan:
     * out of memory for that count, the registration fails (the transfer with KVO_ENOMEM), no count lost */
    KVT_EQ(kvb_pool_check(r->dst, why, sizeof why), KVB_OK);
    kvo_backend_destroy(r->mem);
    kvb_pool_destroy(r->src);
    kvb_pool_destroy(r->dst);
}

static void test_create_out_of_memory(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            rig r;
            rig_open(&r, KVO_MODE_POLL);
            oom_arm(at, sticky);
            oom_iters++;
            kvo_result cr = kvo_pipeline_create(&r.pc, &r.p);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(cr == KVO_OK || cr == KVO_ENOMEM);
            if (cr != KVO_OK) r.p = NULL;
            rig_finish(&r, NULL, 0, 0);
            if (!fired) break;
        }
}

/* kvo_enqueue out of memory: KVO_ENOMEM and nothing enqueued (no note of any stage, no count, and the
 * next transfer gets the handle it would have got: handles are in events, and a recording replays them),
 * or OK; either way the pipeline goes on and what was enqueued lands. */
static int stage_notes;
static void count_stage(void *user, const kvo_stage_note *note)
{
    (void)user;
    (void)note;
    stage_notes++;
}

static void test_enqueue_out_of_memory(void)
{
    kvo_transfer first = {0}; /* the first handle of a pipeline between these pools */
    {
        rig r;
        rig_open(&r, KVO_MODE_POLL);
        r.p = of_pipeline(&r.pc);
        first = of_enqueue(r.p, r.weak, 8, NULL);
        rig_finish(&r, &first, 1, 0);
    }
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            rig r;
            kvo_transfer t[2] = {{0}, {0}};
            kvo_pipeline_stats st;
            rig_open(&r, KVO_MODE_POLL);
            r.pc.on_stage = count_stage;
            r.p = of_pipeline(&r.pc);
            stage_notes = 0;
            oom_arm(at, sticky);
            oom_iters++;
            kvo_result er = kvo_enqueue(r.p, r.weak, 8, NULL, &t[0]);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(er == KVO_OK || er == KVO_ENOMEM);
            KVT_EQ(kvo_pipeline_get_stats(r.p, &st), KVO_OK);
            if (er == KVO_ENOMEM) {
                KVT_EQ(st.enqueued, 0);
                KVT_EQ(stage_notes, 0);
                t[0].id = 0;
            }
            KVT_EQ(kvo_enqueue(r.p, &r.weak[8], 4, NULL, &t[1]), KVO_OK); /* the memory is back */
            KVT_EQ(er == KVO_OK ? t[0].id : t[1].id, first.id);
            of_polls(r.p, &r.clock, 20000, 20);
            KVT_EQ(of_holds_all(r.dst, &r.h[8], 4), 4);
            if (er == KVO_OK) KVT_EQ(of_holds_all(r.dst, r.h, 8), 8);
            rig_finish(&r, er == KVO_OK ? t : &t[1], er == KVO_OK ? 2 : 1, 0);
            if (!fired) break;
        }
}

/* Out of memory while the stages move three transfers along (policy, precondition, batcher, the queue of
 * batches, on deck, the backend, the notes): each ends complete or failed with KVO_ENOMEM, no block lands
 * with wrong bytes, and nothing is held after. */
static void test_stages_out_of_memory(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            rig r;
            kvo_transfer t[3];
            kvo_enqueue_opts lo = {0}, hi = {0};
            rig_open(&r, KVO_MODE_POLL);
            r.p = of_pipeline(&r.pc);
            lo.priority = 1;
            hi.priority = 5;
            KVT_EQ(kvo_enqueue(r.p, r.weak, 4, &lo, &t[0]), KVO_OK);
            KVT_EQ(kvo_enqueue(r.p, &r.weak[4], 4, &hi, &t[1]), KVO_OK);
            KVT_EQ(kvo_enqueue(r.p, &r.weak[8], 4, NULL, &t[2]), KVO_OK);
            oom_arm(at, sticky);
            oom_iters++;
            of_polls(r.p, &r.clock, 20000, 6);
            int fired = oom_fired;
            oom_disarm();
            of_polls(r.p, &r.clock, 20000, 20);
            KVT_EQ(kvo_pipeline_drain(r.p, 5000000), KVO_OK);
            /* a landed block is where it belongs with the right bytes, or not cached at all: out of memory
             * for its eviction ring a release caches less (kvblock.h) */
            for (int i = 0; i < BLOCKS; i++) KVT_CHECK(of_holds(r.dst, r.h[i]) >= 0);
            rig_finish(&r, t, 3, 1);
            if (!fired) break;
        }
}

/* Onboarding out of memory: the transfer fails (KVO_ENOMEM) or loads; nothing is held after. */
static void test_onboard_out_of_memory(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            rig r;
            kvo_transfer t = {0};
            rig_open(&r, KVO_MODE_POLL);
            r.pc.presence = -1;
            r.p = of_pipeline(&r.pc);
            oom_arm(at, sticky);
            oom_iters++;
            kvo_result orr = kvo_onboard(r.p, r.h, 6, NULL, &t);
            of_polls(r.p, &r.clock, 20000, 6);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(orr == KVO_OK || orr == KVO_ENOMEM);
            if (orr == KVO_OK) {
                of_polls(r.p, &r.clock, 20000, 10);
                kvo_transfer_info info = of_info(r.p, t);
                KVT_CHECK(info.status == KVO_STATUS_COMPLETE ||
                          (info.status == KVO_STATUS_FAILED && info.error == KVO_ENOMEM));
                if (info.status == KVO_STATUS_COMPLETE) {
                    kvb_block got[6];
                    size_t k = 0;
                    KVT_EQ(kvo_transfer_take_blocks(r.p, t, got, 6, &k), KVO_OK);
                    KVT_EQ(k, 6);
                    KVT_EQ(kvb_release(r.dst, got, k, NULL), KVB_OK);
                }
            }
            rig_finish(&r, orr == KVO_OK ? &t : NULL, orr == KVO_OK ? 1 : 0, 1);
            if (!fired) break;
        }
}

/* A tier manager G1 -> G2 -> G3 (eager, poll mode, memcpy copies) over three small pools, with six
 * chained blocks registered in G1 and held (strong). */
typedef struct chain3 {
    kvb_pool *pools[3];
    kvo_backend *mem;
    kvo_manager *m;
    kvb_block strong[6];
} chain3;

static void chain3_open(chain3 *c, uint64_t prompt, uint32_t max_batch, kvo_offloaded_fn on_offloaded)
{
    kvb_hash h[6];
    kvo_manager_config mc;
    for (int i = 0; i < 3; i++) c->pools[i] = of_mem_pool(32, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    KVT_EQ(kvo_memcpy_backend_create(0, &c->mem), KVO_OK);
    of_chain(prompt, 6, h);
    of_register(c->pools[0], h, 6, c->strong, NULL);
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 3;
    for (int i = 0; i < 3; i++) mc.pools[i] = c->pools[i];
    mc.down[0] = mc.down[1] = c->mem;
    mc.pipeline.mode = KVO_MODE_POLL;
    mc.pipeline.min_batch = 1;
    mc.pipeline.max_batch = max_batch;
    mc.on_offloaded = on_offloaded;
    KVT_EQ(kvo_manager_create(&mc, &c->m), KVO_OK);
}

/* The manager goes; every pool then holds nothing referenced and passes its check. */
static void chain3_close(chain3 *c)
{
    kvo_manager_destroy(c->m);
    KVT_EQ(kvb_release(c->pools[0], c->strong, 6, NULL), KVB_OK);
    for (int i = 0; i < 3; i++) {
        char why[256] = "";
        KVT_EQ(of_active(c->pools[i]), 0);
        KVT_EQ(kvb_pool_check(c->pools[i], why, sizeof why), KVB_OK);
        kvb_pool_destroy(c->pools[i]);
    }
    kvo_backend_destroy(c->mem);
}

/* The tier manager's offer (eager, G1 -> G2 -> G3): KVO_ENOMEM, or it sends; either way every pool
 * ends with nothing referenced once the manager is gone. */
static void test_manager_offer_out_of_memory(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            chain3 c;
            chain3_open(&c, 9, 0, NULL);
            oom_arm(at, sticky);
            oom_iters++;
            kvo_result r = kvo_manager_offer(c.m, 0, c.strong, 6, NULL);
            for (int i = 0; i < 8; i++) kvo_manager_poll(c.m);
            int fired = oom_fired;
            oom_disarm();
            KVT_CHECK(r == KVO_OK || r == KVO_ENOMEM);
            KVT_EQ(kvo_manager_drain(c.m, 5000000), KVO_OK);
            chain3_close(&c);
            if (!fired) break;
        }
}

/* on_done out of memory (before, kvo__finalize allocated its note and, failing, dropped it: no on_done,
 * stats.notes_lost): a tier manager (G1 -> G2 -> G3, eager) whose offers are in flight runs out of memory
 * at each allocation in turn while its pipelines finish them. Every transfer still reaches the manager's
 * on_done: on_offloaded is told of each one of each pipeline, G2 -> G3 included (the chain goes on from
 * there, and the handle is released there), and no note is lost. */
static int offloaded[3];
static void count_offloaded(void *user, uint32_t tier, kvo_transfer t, const kvo_transfer_info *info)
{
    (void)user;
    (void)t;
    (void)info;
    offloaded[tier]++;
}

static void test_manager_done_out_of_memory(void)
{
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0; at < MAX_N; at++) {
            chain3 c;
            kvo_manager_stats ms;
            memset(offloaded, 0, sizeof offloaded);
            chain3_open(&c, 11, 2, count_offloaded); /* batches of 2: several transfers end in one poll */
            KVT_EQ(kvo_manager_offer(c.m, 0, c.strong, 2, NULL), KVO_OK);
            KVT_EQ(kvo_manager_offer(c.m, 0, &c.strong[2], 2, NULL), KVO_OK);
            KVT_EQ(kvo_manager_offer(c.m, 0, &c.strong[4], 2, NULL), KVO_OK);
            oom_arm(at, sticky);
            oom_iters++;
            for (int i = 0; i < 8; i++) kvo_manager_poll(c.m);
            int fired = oom_fired;
            oom_disarm();
            KVT_EQ(kvo_manager_drain(c.m, 5000000), KVO_OK);
            KVT_EQ(kvo_manager_get_stats(c.m, &ms), KVO_OK);
            for (int i = 0; i < 2; i++) {
                KVT_EQ(ms.down[i].notes_lost, 0);
                KVT_EQ((uint64_t)offloaded[i], ms.down[i].enqueued); /* each handle released by on_done */
            }
            KVT_EQ(ms.down[0].enqueued, 3);
            chain3_close(&c);
            if (!fired) break;
        }
}

/* At a branch (G2 feeds G3 and G4), an offer refused out of memory sends nothing down the pipeline it
 * did not reach: the second pipeline never gets the blocks, and with the first refused, neither tier
 * gets any. Before, the offer went on down the second pipeline after the first refused, and returned
 * KVO_ENOMEM with the blocks on their way to G4. */
static void test_manager_offer_at_a_branch_out_of_memory(void)
{
    int refused_first = 0, refused_second = 0;
    for (long at = 0; at < MAX_N; at++) {
        kvb_pool *pools[4];
        kvo_backend *mem;
        kvo_manager *m;
        kvo_manager_stats ms;
        kvb_hash h[4];
        kvb_block strong[4];
        kvo_transfer t = {77};
        for (int i = 0; i < 4; i++) pools[i] = of_mem_pool(16, KVB_LAYOUT_BLOCK_CONTIGUOUS);
        KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
        of_chain(5, 4, h);
        of_register(pools[1], h, 4, strong, NULL);
        kvo_manager_config mc;
        memset(&mc, 0, sizeof mc);
        mc.num_tiers = 4;
        mc.branch_from = 1;
        for (int i = 0; i < 4; i++) mc.pools[i] = pools[i];
        mc.down[0] = mc.down[1] = mc.down[2] = mem;
        mc.pipeline.mode = KVO_MODE_POLL;
        mc.pipeline.min_batch = 1;
        KVT_EQ(kvo_manager_create(&mc, &m), KVO_OK);
        oom_arm(at, 0);
        oom_iters++;
        kvo_result r = kvo_manager_offer(m, 1, strong, 4, &t);
        int fired = oom_fired;
        oom_disarm();
        KVT_CHECK(r == KVO_OK || r == KVO_ENOMEM);
        KVT_EQ(kvo_manager_get_stats(m, &ms), KVO_OK);
        if (r == KVO_ENOMEM) {
            KVT_EQ(t.id, 0);
            KVT_EQ(ms.down[2].enqueued, 0); /* G2 -> G4, the second: never reached */
            refused_first += ms.down[1].enqueued == 0;
            refused_second += ms.down[1].enqueued == 1;
        } else {
            KVT_EQ(ms.down[1].enqueued, 1);
            KVT_EQ(ms.down[2].enqueued, 1);
        }
        KVT_EQ(kvo_manager_drain(m, 5000000), KVO_OK);
        if (r == KVO_ENOMEM && ms.down[1].enqueued == 0) {
            KVT_EQ(of_present(pools[2], h, 4), 0);
            KVT_EQ(of_present(pools[3], h, 4), 0);
        }
        if (r == KVO_OK) KVT_EQ(of_present(pools[3], h, 4), 4);
        kvo_manager_destroy(m);
        KVT_EQ(kvb_release(pools[1], strong, 4, NULL), KVB_OK);
        for (int i = 0; i < 4; i++) {
            KVT_EQ(of_active(pools[i]), 0);
            kvb_pool_destroy(pools[i]);
        }
        kvo_backend_destroy(mem);
        if (!fired) break;
    }
    KVT_CHECK(refused_first > 0);
    KVT_CHECK(refused_second > 0);
}

int main(void)
{
    of_watchdog(300);
    KVT_RUN(test_create_out_of_memory);
    KVT_RUN(test_enqueue_out_of_memory);
    KVT_RUN(test_stages_out_of_memory);
    KVT_RUN(test_onboard_out_of_memory);
    KVT_RUN(test_manager_offer_out_of_memory);
    KVT_RUN(test_manager_offer_at_a_branch_out_of_memory);
    KVT_RUN(test_manager_done_out_of_memory);
    printf("     %ld runs out of memory\n", oom_iters);
    return kvt_summary();
}
