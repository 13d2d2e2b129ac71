/* The offload pipeline of kvoffload.h, mostly in poll mode with a manual clock: registered blocks land
 * Registered in the destination with their hashes and bytes; the presence, frequency and user policies
 * (with the policy timeout); cancel at every stage before the upgrade (nothing copied) and after it (the
 * transfer completes); finished, cancelled-twice and released handles; stale weak handles; precondition
 * events and their timeout; a backend failing mid-batch (a source whose entry is gone or damaged is
 * dropped); priorities; on_done. A wrapping test backend
 * counts and records every copy the pipeline asks for. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvtest.h"
#include "offload_fixtures.h"

#include <stdatomic.h>

enum { SRC_BLOCKS = 32, DST_BLOCKS = 32, MAXN = 32 };

/* A source pool with registered blocks (inactive: only the pipeline's weak handles name them), a
 * destination pool in the other layout, a memcpy backend behind the test wrapper, a manual clock. */
typedef struct rig {
    kvb_pool *src, *dst;
    kvo_backend *mem;
    of_backend *w;
    of_clock clock;
    kvo_pipeline *p;
    kvb_hash h[MAXN];
    kvb_weak weak[MAXN];
    size_t n;
} rig;

static void rig_pools(rig *r, uint32_t src_blocks, size_t registered)
{
    memset(r, 0, sizeof *r);
    r->src = of_mem_pool(src_blocks, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    r->dst = of_mem_pool(DST_BLOCKS, KVB_LAYOUT_LAYER_SEPARATE);
    KVT_EQ(kvo_memcpy_backend_create(0, &r->mem), KVO_OK);
    r->w = of_backend_wrap(r->mem);
    r->clock.now = 1000000;
    r->n = registered;
    of_chain(1, registered, r->h);
    of_register(r->src, r->h, registered, NULL, r->weak);
}

static kvo_pipeline_config rig_config(rig *r) { return of_config(r->src, r->dst, of_backend_iface(r->w), KVO_MODE_POLL, &r->clock); }

static void rig_start(rig *r, const kvo_pipeline_config *pc) { r->p = of_pipeline(pc); }

/* The usual rig: 32-block pools, n registered source blocks, a poll-mode pipeline with defaults. */
static void rig_open(rig *r, size_t registered)
{
    rig_pools(r, SRC_BLOCKS, registered);
    kvo_pipeline_config pc = rig_config(r);
    rig_start(r, &pc);
}

static void rig_close(rig *r)
{
    kvo_pipeline_destroy(r->p);
    KVT_EQ(of_active(r->src), 0); /* nothing left referenced by the pipeline */
    KVT_EQ(of_active(r->dst), 0);
    OF_CHECK_POOL(r->src);
    OF_CHECK_POOL(r->dst);
    kvo_backend_destroy(of_backend_iface(r->w));
    kvo_backend_destroy(r->mem);
    kvb_pool_destroy(r->src);
    kvb_pool_destroy(r->dst);
}

static size_t saw(rig *r, const kvb_weak *blocks, size_t n) { return of_backend_saw_any(r->w, r->src, blocks, n); }

static void test_result_strings(void)
{
    KVT_CHECK(strcmp(kvo_result_string(KVO_OK), "ok") == 0);
    KVT_CHECK(strcmp(kvo_result_string(KVO_ECANCELLED), "cancelled") == 0);
    KVT_CHECK(strcmp(kvo_result_string(KVO_ESTALE), "transfer handle was released") == 0);
    KVT_CHECK(strcmp(kvo_result_string(KVB_ENOSPACE), kvb_result_string(KVB_ENOSPACE)) == 0);
}

static void test_create_refuses_bad_config(void)
{
    kvb_pool *a = of_mem_pool(4, KVB_LAYOUT_BLOCK_CONTIGUOUS), *b = NULL;
    kvo_backend *mem = NULL;
    kvo_pipeline *p = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 4;
    cfg.block_tokens = OF_TOKENS;
    cfg.storage = KVB_STORAGE_HOST;
    KVT_EQ(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, OF_TOKENS, 3, OF_HEADS, OF_DIM, OF_DTYPE, &cfg.layout), KVB_OK);
    KVT_EQ(kvb_pool_create(&cfg, &b), KVB_OK); /* 3 layers: 3 KiB blocks against 2 KiB */

    kvo_pipeline_config pc = of_config(a, b, mem, KVO_MODE_POLL, NULL);
    KVT_EQ(kvo_pipeline_create(&pc, &p), KVO_ELAYOUT);
    KVT_CHECK(p == NULL);
    pc = of_config(a, NULL, mem, KVO_MODE_POLL, NULL);
    KVT_EQ(kvo_pipeline_create(&pc, &p), KVO_EINVAL);
    pc = of_config(a, b, NULL, KVO_MODE_POLL, NULL);
    KVT_EQ(kvo_pipeline_create(&pc, &p), KVO_EINVAL);
    KVT_CHECK(p == NULL);
    kvo_backend_destroy(mem);
    kvb_pool_destroy(a);
    kvb_pool_destroy(b);
}

/* dst_priority names the destination's eviction level of the blocks that land: one the destination
 * does not have is refused at create (it used to be taken, and every landed block then stayed
 * referenced, since each release at that level failed); one it has is where landed blocks wait. */
static void test_dst_priority(void)
{
    rig r;
    rig_pools(&r, SRC_BLOCKS, 4);
    kvo_pipeline_config pc = rig_config(&r);
    kvo_pipeline *p = NULL;
    pc.dst_priority = 1; /* the destination has one level */
    KVT_EQ(kvo_pipeline_create(&pc, &p), KVO_EINVAL);
    KVT_CHECK(p == NULL);

    kvb_pool_config dc;
    KVT_EQ(kvb_pool_get_config(r.dst, &dc), KVB_OK);
    kvb_pool_destroy(r.dst);
    dc.priority_levels = 2;
    pc.dst = r.dst = of_pool_from(&dc);
    rig_start(&r, &pc);
    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 4);
    KVT_EQ(of_active(r.dst), 0); /* released, at level 1 */
    kvb_weak cand[4];
    size_t nc = 0;
    KVT_EQ(kvb_eviction_candidates(r.dst, 4, cand, &nc), KVB_OK);
    KVT_EQ(nc, 4);
    for (size_t i = 0; i < nc; i++) {
        kvb_block_info bi;
        KVT_EQ(kvb_block_get_info(r.dst, cand[i].id, &bi), KVB_OK);
        KVT_EQ(bi.priority, 1);
    }
    kvb_block b[4];
    size_t found = 0;
    KVT_EQ(kvb_match(r.dst, r.h, 4, b, &found), KVB_OK);
    KVT_EQ(found, 4);
    KVT_EQ(kvb_release(r.dst, b, found, NULL), KVB_OK); /* back at level 0: the match took them */
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    rig_close(&r);
}

/* The rig with a source pool of its own (storage, SRC_BLOCKS, `levels` priority levels, policy `ev`; FOL
 * with a fixed step, tails first) over a memory destination. */
static void offload_source_pool(rig *r, kvb_evict_policy ev, uint32_t levels)
{
    kvb_pool_config sc;
    memset(r, 0, sizeof *r);
    memset(&sc, 0, sizeof sc);
    sc.num_blocks = SRC_BLOCKS;
    sc.block_tokens = OF_TOKENS;
    sc.storage = KVB_STORAGE_HOST;
    sc.layout = of_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS);
    sc.eviction = ev;
    sc.priority_levels = levels;
    sc.fol_class_step = 1000;
    r->src = of_pool_from(&sc);
    r->dst = of_mem_pool(DST_BLOCKS, KVB_LAYOUT_LAYER_SEPARATE);
    KVT_EQ(kvo_memcpy_backend_create(0, &r->mem), KVO_OK);
    r->w = of_backend_wrap(r->mem);
    r->clock.now = 1000000;
}

/* The rig's first n source blocks: registered, inactive, at `level`. */
static void expect_sources_at_level(rig *r, size_t n, uint32_t level)
{
    for (size_t i = 0; i < n; i++) {
        kvb_block_info bi;
        KVT_EQ(kvb_block_get_info(r->src, r->weak[i].id, &bi), KVB_OK);
        KVT_EQ(bi.state, KVB_STATE_REGISTERED);
        KVT_EQ(bi.priority, level);
    }
}

/* An offload does not move its source blocks to another eviction level: the engine released them at
 * level 2, and the pipeline's own reference (upgrade, copy, release) is not the engine's release. It
 * released them at level 0, so every block offloaded from G1 became the first to be evicted there. */
static void test_offload_keeps_source_priority(void)
{
    rig r;
    offload_source_pool(&r, KVB_EVICT_DEFAULT, 3);
    r.n = 4;
    of_chain(1, 4, r.h);
    kvb_block held[4];
    of_register(r.src, r.h, 4, held, r.weak);
    kvb_release_opts o;
    memset(&o, 0, sizeof o);
    o.priority = 2;
    KVT_EQ(kvb_release(r.src, held, 4, &o), KVB_OK); /* the engine lets them go at level 2 */
    kvo_pipeline_config pc = rig_config(&r);
    rig_start(&r, &pc);
    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 4);
    KVT_EQ(of_active(r.src), 0);
    expect_sources_at_level(&r, 4, 2);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    rig_close(&r);
}

/* The level a source block keeps is the one its user gave it, also when the user lets it go while the
 * offload holds it (eager offload: the block is offered while the request runs, and the request may end
 * before the copy does): the engine releases 4 blocks at level 2 while their copy is in the backend; once
 * the pipeline gives them back (the last reference, no use) they are at level 2. They were at level 0:
 * the level a new block has, the one it had when it was last inactive (kvb_unpin's). */
static void test_source_released_during_its_offload_keeps_its_level(void)
{
    rig r;
    offload_source_pool(&r, KVB_EVICT_DEFAULT, 3);
    r.n = 4;
    of_chain(1, 4, r.h);
    kvb_block held[4];
    of_register(r.src, r.h, 4, held, r.weak); /* the engine's request holds them */
    kvo_pipeline_config pc = rig_config(&r);
    pc.min_batch = 1;
    rig_start(&r, &pc);
    of_backend_set_hold(r.w, 1);
    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(of_backend_held(r.w), 1);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_TRANSFERRING);
    kvb_release_opts o;
    memset(&o, 0, sizeof o);
    o.priority = 2;
    KVT_EQ(kvb_release(r.src, held, 4, &o), KVB_OK); /* the request ends, at level 2 */
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 4);
    KVT_EQ(of_active(r.src), 0);
    expect_sources_at_level(&r, 4, 2);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    rig_close(&r);
}

/* An offload is no use of its source blocks: the pipeline takes them (upgrade), copies them down and gives
 * them back, and the engine did not touch them. Before, both ends counted: under ARC the upgrade was a
 * hit that moved every offloaded block from T1 to T2 (eager offload made ARC's recency list empty), and
 * under FOL the release was a use that raised every offloaded block's count. ARC: 4 blocks released
 * once stay in T1. FOL (fixed step, tails first): a and b released once, a is offloaded (given back, it
 * is placed as released then: after b), then c is released once: b, a, c go in that order (with a use
 * counted, a's count was 2, its class after every tail: b, c, a). */
static void offload_through(rig *r, const kvb_weak *weak, size_t n)
{
    kvo_pipeline_config pc = rig_config(r);
    rig_start(r, &pc);
    kvo_transfer t = of_enqueue(r->p, weak, n, NULL);
    KVT_EQ(of_pump(r->p, &r->clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r->p, t).transferred, n);
    KVT_EQ(of_active(r->src), 0);
    KVT_EQ(kvo_transfer_release(r->p, t), KVO_OK);
}

static void test_offload_is_no_use_of_its_source(void)
{
    rig r;
    kvb_block held[4];
    kvb_pool_stats st;
    offload_source_pool(&r, KVB_EVICT_ARC, 1);
    of_chain(1, 4, r.h);
    of_register(r.src, r.h, 4, held, r.weak);
    KVT_EQ(kvb_release(r.src, held, 4, NULL), KVB_OK);
    KVT_EQ(kvb_pool_get_stats(r.src, &st), KVB_OK);
    KVT_EQ(st.list_blocks[0], 4); /* T1: seen once */
    offload_through(&r, r.weak, 4);
    KVT_EQ(kvb_pool_get_stats(r.src, &st), KVB_OK);
    KVT_EQ(st.list_blocks[0], 4);
    KVT_EQ(st.list_blocks[1], 0);
    rig_close(&r);

    kvb_hash a[1], b[1], c[1];
    kvb_weak wa[1], wb[1], wc[1], order[3];
    size_t got = 0;
    offload_source_pool(&r, KVB_EVICT_FOL, 1);
    of_chain(2, 1, a);
    of_chain(3, 1, b);
    of_chain(4, 1, c);
    of_register(r.src, a, 1, held, wa);
    KVT_EQ(kvb_release(r.src, held, 1, NULL), KVB_OK);
    of_register(r.src, b, 1, held, wb);
    KVT_EQ(kvb_release(r.src, held, 1, NULL), KVB_OK);
    offload_through(&r, wa, 1);
    of_register(r.src, c, 1, held, wc);
    KVT_EQ(kvb_release(r.src, held, 1, NULL), KVB_OK);
    KVT_EQ(kvb_eviction_candidates(r.src, 3, order, &got), KVB_OK);
    KVT_EQ(got, 3);
    KVT_EQ(order[0].id, wb[0].id);
    KVT_EQ(order[1].id, wa[0].id); /* still a tail seen once: the offload counted no use */
    KVT_EQ(order[2].id, wc[0].id);
    rig_close(&r);
}

static void count_done(kvo_copy_job *job, int result, const char *message)
{
    (void)message;
    *(int *)job->user = result == KVO_OK ? 1 : -1;
}

/* A job naming a block past its pool is refused at submit (the memcpy backend copied from or to
 * wherever that index pointed), as kvo_copy_job_check says; a job within the pools is copied. */
static void test_backend_refuses_blocks_past_the_pool(void)
{
    kvb_pool *a = of_mem_pool(4, KVB_LAYOUT_BLOCK_CONTIGUOUS), *b = of_mem_pool(8, KVB_LAYOUT_LAYER_SEPARATE);
    kvo_backend *mem = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    uint32_t src_idx[2] = {0, 3}, dst_idx[2] = {7, 8};
    int results[2] = {0, 0}, done = 0;
    kvo_copy_job job;
    memset(&job, 0, sizeof job);
    job.src = a;
    job.dst = b;
    job.src_idx = src_idx;
    job.dst_idx = dst_idx;
    job.n = 2;
    job.results = results;
    job.done = count_done;
    job.user = &done;
    KVT_EQ(kvo_copy_job_check(&job), KVO_EINVAL); /* dst block 8 of 8 */
    KVT_EQ(mem->submit(mem, &job), KVO_EINVAL);
    KVT_EQ(done, 0);
    dst_idx[1] = 6;
    src_idx[1] = 4; /* src block 4 of 4 */
    KVT_EQ(mem->submit(mem, &job), KVO_EINVAL);
    src_idx[1] = 3;
    KVT_EQ(kvo_copy_job_check(&job), KVO_OK);
    KVT_EQ(mem->submit(mem, &job), KVO_OK);
    KVT_EQ(done, 1);
    job.results = NULL;
    KVT_EQ(kvo_copy_job_check(&job), KVO_EINVAL);
    KVT_EQ(kvo_copy_job_check(NULL), KVO_EINVAL);
    kvo_backend_destroy(mem);
    kvb_pool_destroy(a);
    kvb_pool_destroy(b);
}

/* The memcpy backend copies between pools whose blocks have the same pages (layers, parts, page bytes)
 * in either layout; pools of the same block bytes cut into other pages (here 1 layer of 1 KiB pages
 * against 2 layers of 512 bytes) are refused at submit with KVO_ELAYOUT (done not called), though a
 * pipeline between them is made (it checks block bytes only): each of its transfers fails with that
 * reason. Its manual said "same block bytes". */
static void test_memcpy_needs_the_same_pages(void)
{
    kvb_pool *a = of_mem_pool(4, KVB_LAYOUT_BLOCK_CONTIGUOUS), *b;
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 4;
    cfg.block_tokens = OF_TOKENS;
    cfg.storage = KVB_STORAGE_HOST;
    KVT_EQ(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, OF_TOKENS, 1, OF_HEADS * 2, OF_DIM, OF_DTYPE, &cfg.layout),
           KVB_OK);
    b = of_pool_from(&cfg);
    uint64_t ab = 0, bb = 0;
    KVT_EQ(kvb_pool_storage(a, NULL, NULL, &ab, NULL), KVB_OK);
    KVT_EQ(kvb_pool_storage(b, NULL, NULL, &bb, NULL), KVB_OK);
    KVT_EQ(ab, bb);
    kvo_backend *mem = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    uint32_t src_idx[1] = {0}, dst_idx[1] = {1};
    int results[1] = {0}, done = 0;
    kvo_copy_job job;
    memset(&job, 0, sizeof job);
    job.src = a;
    job.dst = b;
    job.src_idx = src_idx;
    job.dst_idx = dst_idx;
    job.n = 1;
    job.results = results;
    job.done = count_done;
    job.user = &done;
    KVT_EQ(mem->submit(mem, &job), KVO_ELAYOUT);
    KVT_EQ(done, 0);

    kvb_hash h[1];
    kvb_weak w[1];
    of_chain(5, 1, h);
    of_register(a, h, 1, NULL, w);
    kvo_pipeline_config pc = of_config(a, b, mem, KVO_MODE_POLL, NULL);
    pc.min_batch = 1;
    kvo_pipeline *p = of_pipeline(&pc);
    kvo_transfer t = of_enqueue(p, w, 1, NULL);
    KVT_EQ(kvo_pipeline_drain(p, 1000000), KVO_OK);
    KVT_EQ(of_status(p, t), KVO_STATUS_FAILED);
    KVT_EQ(of_info(p, t).error, KVO_ELAYOUT);
    KVT_EQ(kvo_transfer_release(p, t), KVO_OK);
    kvo_pipeline_destroy(p);
    KVT_EQ(of_active(a), 0);
    KVT_EQ(of_active(b), 0);
    kvo_backend_destroy(mem);
    kvb_pool_destroy(a);
    kvb_pool_destroy(b);
}

/* A handle names a transfer of its own pipeline only: the down and up pipelines between two pools hand
 * out their first handles in the same slot, and each refuses the other's (KVO_ESTALE), its own
 * transfer untouched. */
static void test_handles_of_another_pipeline_refused(void)
{
    rig r;
    rig_open(&r, 4);
    kvo_pipeline_config up = of_config(r.dst, r.src, of_backend_iface(r.w), KVO_MODE_POLL, &r.clock);
    kvo_pipeline *back = of_pipeline(&up);
    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL), u;
    KVT_EQ(kvo_onboard(back, r.h, 1, NULL, &u), KVO_OK);
    KVT_EQ((uint32_t)t.id, (uint32_t)u.id); /* the same slot */
    KVT_CHECK(t.id != u.id);
    kvo_transfer_info info;
    KVT_EQ(kvo_transfer_get_info(back, t, &info), KVO_ESTALE);
    KVT_EQ(kvo_transfer_release(back, t), KVO_ESTALE);
    KVT_EQ(kvo_transfer_release(r.p, u), KVO_ESTALE);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 4);
    KVT_EQ(kvo_transfer_get_info(back, u, &info), KVO_OK);
    KVT_EQ(kvo_transfer_release(back, u), KVO_OK);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    kvo_pipeline_destroy(back);
    rig_close(&r);
}

/* Batches fit the destination: into 16 blocks, four offloads of 8 each land (the default max_batch of
 * 64 merged them into one batch of 32, which failed whole with KVO_EFULL), two to a pair of batches on
 * deck. */
static void test_batches_fit_the_destination(void)
{
    rig r;
    rig_pools(&r, SRC_BLOCKS, 32);
    kvb_pool_destroy(r.dst);
    r.dst = of_mem_pool(16, KVB_LAYOUT_LAYER_SEPARATE);
    kvo_pipeline_config pc = rig_config(&r), got;
    rig_start(&r, &pc);
    KVT_EQ(kvo_pipeline_get_config(r.p, &got), KVO_OK);
    KVT_EQ(got.max_batch, 8); /* 16 blocks / 2 on deck */
    kvo_transfer t[4];
    for (int i = 0; i < 4; i++) t[i] = of_enqueue(r.p, r.weak + 8 * i, 8, NULL);
    for (int i = 0; i < 4; i++) {
        KVT_EQ(of_pump(r.p, &r.clock, t[i], 1000, 200), KVO_STATUS_COMPLETE);
        KVT_EQ(of_info(r.p, t[i]).transferred, 8);
        KVT_EQ(kvo_transfer_release(r.p, t[i]), KVO_OK);
    }
    KVT_EQ(of_holds_all(r.dst, r.h + 16, 16), 16); /* the last two stay; the first two were evicted */
    rig_close(&r);
}

/* Registered source blocks land Registered in the destination, under the same hashes, with the same
 * bytes (the layouts differ), and the source keeps its blocks. */
static void test_offload_lands_registered(void)
{
    rig r;
    rig_open(&r, 8);
    kvo_transfer t = of_enqueue(r.p, r.weak, 8, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.error, KVO_OK);
    KVT_EQ(info.blocks, 8);
    KVT_EQ(info.transferred, 8);
    KVT_EQ(info.skipped + info.present + info.timed_out + info.dropped + info.failed, 0);
    KVT_EQ(of_backend_copies(r.w), 8);

    KVT_EQ(of_holds_all(r.dst, r.h, 8), 8);
    size_t found = 0;
    KVT_EQ(kvb_lookup(r.dst, r.h, 8, &found), KVB_OK); /* matchable as a prefix, too */
    KVT_EQ(found, 8);
    kvb_block b[8];
    KVT_EQ(kvb_match(r.dst, r.h, 8, b, &found), KVB_OK);
    KVT_EQ(found, 8);
    for (size_t i = 0; i < found; i++) {
        kvb_block_info bi;
        KVT_EQ(kvb_block_get_info(r.dst, b[i].id, &bi), KVB_OK);
        KVT_EQ(bi.state, KVB_STATE_REGISTERED);
        KVT_EQ(bi.refs, 1); /* ours: the pipeline holds none after the transfer */
        KVT_CHECK(of_hash_eq(bi.hash, r.h[i]));
    }
    KVT_EQ(kvb_release(r.dst, b, found, NULL), KVB_OK);
    KVT_EQ(of_holds_all(r.src, r.h, 8), 8);

    kvo_pipeline_stats st;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &st), KVO_OK);
    KVT_EQ(st.enqueued, 1);
    KVT_EQ(st.transferred, 8);
    KVT_CHECK(st.batches >= 1);
    KVT_EQ(st.bytes, 8 * OF_BLOCK_BYTES);
    KVT_EQ(st.in_flight_blocks, 0);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    rig_close(&r);
}

/* Presence: blocks already in the destination, or already on their way there, are not copied again. */
static void test_presence_skips_blocks_in_destination(void)
{
    rig r;
    rig_open(&r, 6);
    kvo_transfer first = of_enqueue(r.p, r.weak, 3, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, first, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, first).transferred, 3);

    kvo_transfer all = of_enqueue(r.p, r.weak, 6, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, all, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info info = of_info(r.p, all);
    KVT_EQ(info.transferred, 3);
    KVT_EQ(info.skipped + info.present, 3);
    for (size_t i = 0; i < 6; i++) KVT_EQ(saw(&r, &r.weak[i], 1), 1); /* each copied once, ever */
    KVT_EQ(of_holds_all(r.dst, r.h, 6), 6);

    /* in flight: the same blocks enqueued twice before the pipeline ran at all */
    kvb_hash h2[4];
    kvb_weak w2[4];
    of_chain(2, 4, h2);
    of_register(r.src, h2, 4, NULL, w2);
    kvo_transfer a = of_enqueue(r.p, w2, 4, NULL);
    kvo_transfer b = of_enqueue(r.p, w2, 4, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, b, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info ia = of_info(r.p, a), ib = of_info(r.p, b);
    KVT_EQ(ia.transferred, 4);
    KVT_EQ(ib.transferred, 0);
    KVT_EQ(ib.skipped + ib.present, 4);
    KVT_EQ(saw(&r, w2, 4), 4);
    kvo_transfer_release(r.p, first);
    kvo_transfer_release(r.p, all);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    rig_close(&r);
}

/* Frequency 2: a block goes down the second time it is offered (or once after one noted use). */
static void test_frequency_policy(void)
{
    rig r;
    rig_pools(&r, SRC_BLOCKS, 8);
    kvo_pipeline_config pc = rig_config(&r);
    pc.min_frequency = 2;
    rig_start(&r, &pc);

    kvo_transfer t1 = of_enqueue(r.p, r.weak, 4, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t1, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info i1 = of_info(r.p, t1);
    KVT_EQ(i1.skipped, 4);
    KVT_EQ(i1.transferred, 0);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(of_present(r.dst, r.h, 4), 0);

    kvo_transfer t2 = of_enqueue(r.p, r.weak, 4, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t2, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t2).transferred, 4);
    KVT_EQ(of_holds_all(r.dst, r.h, 4), 4);

    /* a prefix hit counts as a use: offered once afterwards, h4 and h5 go; h6 (offered once) does not */
    KVT_EQ(kvo_pipeline_note_use(r.p, &r.h[4], 2), KVO_OK);
    kvo_transfer t3 = of_enqueue(r.p, &r.weak[4], 3, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t3, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info i3 = of_info(r.p, t3);
    KVT_EQ(i3.transferred, 2);
    KVT_EQ(i3.skipped, 1);
    KVT_CHECK(of_has(r.dst, r.h[4]) && of_has(r.dst, r.h[5]) && !of_has(r.dst, r.h[6]));
    kvo_transfer_release(r.p, t1);
    kvo_transfer_release(r.p, t2);
    kvo_transfer_release(r.p, t3);
    rig_close(&r);
}

/* ---- user policy ---- */

typedef struct verdicts {
    rig *r;
    kvo_verdict answer[MAXN]; /* per registered block; KVO_LATER answers turn into OFFER at offer_at */
    uint64_t offer_at[MAXN];  /* 0 = never */
    int calls;
    int bad_index;            /* calls whose src_index was not the block of that hash */
} verdicts;

static kvo_verdict ask(void *user, const kvb_hash *hash, uint32_t src_index)
{
    verdicts *v = (verdicts *)user;
    v->calls++;
    for (size_t i = 0; i < v->r->n; i++)
        if (of_hash_eq(*hash, v->r->h[i])) {
            if (src_index != kvb_block_index(v->r->weak[i].id)) v->bad_index++;
            if (v->answer[i] == KVO_LATER && v->offer_at[i] && v->r->clock.now >= v->offer_at[i]) return KVO_OFFER;
            return v->answer[i];
        }
    v->bad_index++;
    return KVO_SKIP;
}

/* Offer, skip, "later" that turns into offer in time, and "later" until the policy timeout. */
static void test_user_policy_and_timeout(void)
{
    rig r;
    verdicts v;
    rig_pools(&r, SRC_BLOCKS, 4);
    memset(&v, 0, sizeof v);
    v.r = &r;
    v.answer[0] = KVO_OFFER;
    v.answer[1] = KVO_SKIP;
    v.answer[2] = KVO_LATER;
    v.offer_at[2] = r.clock.now + 500;
    v.answer[3] = KVO_LATER;
    kvo_pipeline_config pc = rig_config(&r);
    pc.policy = ask;
    pc.policy_user = &v;
    pc.policy_timeout_us = 1000;
    rig_start(&r, &pc);

    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL);
    of_polls(r.p, &r.clock, 100, 3); /* 300 us: block 3 (and maybe 2) still undecided */
    KVT_EQ(of_status(r.p, t), KVO_STATUS_EVALUATING);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(of_pump(r.p, &r.clock, t, 100, 500), KVO_STATUS_COMPLETE);
    KVT_CHECK(r.clock.now >= 1000000 + 1000); /* not before the timeout */
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.transferred, 2);
    KVT_EQ(info.skipped, 1);
    KVT_EQ(info.timed_out, 1);
    KVT_CHECK(of_has(r.dst, r.h[0]) && !of_has(r.dst, r.h[1]) && of_has(r.dst, r.h[2]) && !of_has(r.dst, r.h[3]));
    KVT_EQ(saw(&r, &r.weak[1], 1) + saw(&r, &r.weak[3], 1), 0);
    KVT_EQ(v.bad_index, 0);
    KVT_CHECK(v.calls >= 4);
    kvo_pipeline_stats st;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &st), KVO_OK);
    KVT_EQ(st.timed_out, 1);
    KVT_EQ(st.skipped, 1);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* ---- cancel before the upgrade: Cancelled, nothing copied ---- */

static void test_cancel_while_evaluating(void)
{
    rig r;
    verdicts v;
    rig_pools(&r, SRC_BLOCKS, 4);
    memset(&v, 0, sizeof v);
    v.r = &r;
    for (size_t i = 0; i < 4; i++) v.answer[i] = KVO_LATER;
    kvo_pipeline_config pc = rig_config(&r);
    pc.policy = ask;
    pc.policy_user = &v;
    rig_start(&r, &pc);

    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL);
    of_polls(r.p, &r.clock, 100, 3);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_EVALUATING);
    KVT_CHECK(v.calls > 0);
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, t, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_CANCELLED);
    int calls = v.calls;
    of_polls(r.p, &r.clock, 50000, 10); /* well past the policy timeout */
    KVT_EQ(v.calls, calls);             /* nobody asks about a cancelled container */
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.status, KVO_STATUS_CANCELLED);
    KVT_EQ(info.transferred + info.timed_out, 0);
    KVT_EQ(of_backend_copies(r.w), 0);
    kvo_pipeline_stats ps;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &ps), KVO_OK);
    KVT_EQ(ps.cancelled, 1);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

static void test_cancel_while_waiting_on_precondition(void)
{
    rig r;
    kvo_event *ev = NULL;
    rig_open(&r, 4);
    KVT_EQ(kvo_event_create(&ev), KVO_OK);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.precondition = ev;
    kvo_transfer t = of_enqueue(r.p, r.weak, 4, &opts);
    of_polls(r.p, &r.clock, 1000, 20);
    kvo_status s = of_status(r.p, t);
    KVT_CHECK(s == KVO_STATUS_EVALUATING || s == KVO_STATUS_QUEUED);
    KVT_EQ(of_backend_copies(r.w), 0);
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, t, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_CANCELLED);
    KVT_EQ(kvo_event_signal(ev), KVO_OK); /* the forward pass finishes after all */
    of_polls(r.p, &r.clock, 5000, 20);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_CANCELLED);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(of_present(r.dst, r.h, 4), 0);
    kvo_event_release(ev);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* Below min batch and before the flush interval the container sits in the batcher, still weak. */
static void test_cancel_while_batched(void)
{
    rig r;
    rig_open(&r, 8); /* defaults: min batch 8, flush 10 ms */
    kvo_transfer a = of_enqueue(r.p, r.weak, 2, NULL);
    of_polls(r.p, &r.clock, 0, 5); /* time stands still */
    KVT_EQ(of_status(r.p, a), KVO_STATUS_QUEUED);
    KVT_EQ(of_refs(r.src, r.weak[0].id), 0); /* not upgraded yet */
    KVT_EQ(of_backend_copies(r.w), 0);
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, a, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_CANCELLED);

    /* the batcher goes on with the next container once its flush interval passes */
    kvo_transfer c = of_enqueue(r.p, &r.weak[4], 2, NULL);
    of_polls(r.p, &r.clock, 0, 3);
    KVT_EQ(of_status(r.p, c), KVO_STATUS_QUEUED);
    r.clock.now += 20000;
    KVT_EQ(of_pump(r.p, &r.clock, c, 1000, 100), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, c).transferred, 2);
    KVT_EQ(saw(&r, r.weak, 2), 0);
    KVT_EQ(saw(&r, &r.weak[4], 2), 2);
    KVT_EQ(of_status(r.p, a), KVO_STATUS_CANCELLED);
    KVT_EQ(of_present(r.dst, r.h, 2), 0);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, c);
    rig_close(&r);
}

/* Cancels a transfer from another thread (poll-mode pipelines are safe from any thread, and cancel pumps
 * the stages itself), so the test can see whether cancel returned before the backend let anything go. */
typedef struct canceller {
    kvo_pipeline *p;
    kvo_transfer t;
    int result;
    kvo_status status;
    atomic_int returned;
} canceller;

static void *cancel_on_thread(void *arg)
{
    canceller *c = (canceller *)arg;
    c->result = kvo_transfer_cancel(c->p, c->t, &c->status);
    atomic_store(&c->returned, 1);
    return NULL;
}

/* The executor is busy with A (the backend holds its job), so B is upgraded onto the deck and waits;
 * cancelling B there gives Cancelled at once (B is not in the backend), releases its blocks, and nothing
 * of it is ever copied (issue 3: "cancel while on deck ... gives Cancelled and no copy"). The cancel
 * runs on a helper thread so that a cancel which waits for B's copy instead shows up as a failed check
 * here, not as a hang: A is let go once the cancel returned, or after 10 s either way. */
static void test_cancel_while_on_deck(void)
{
    rig r;
    canceller cn;
    pthread_t th;
    rig_pools(&r, SRC_BLOCKS, 8);
    kvo_pipeline_config pc = rig_config(&r);
    pc.max_batch = 4;
    pc.min_batch = 1;
    rig_start(&r, &pc);
    of_backend_set_hold(r.w, 1);

    kvo_transfer a = of_enqueue(r.p, r.weak, 4, NULL);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(of_backend_held(r.w), 1);
    KVT_EQ(of_status(r.p, a), KVO_STATUS_TRANSFERRING);

    kvo_transfer b = of_enqueue(r.p, &r.weak[4], 4, NULL);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(of_backend_held(r.w), 1); /* one job at a time */
    KVT_CHECK(!of_final(of_status(r.p, b)));
    for (size_t i = 4; i < 8; i++) KVT_EQ(of_refs(r.src, r.weak[i].id), 1); /* upgraded: on deck */

    memset(&cn, 0, sizeof cn);
    cn.p = r.p;
    cn.t = b;
    KVT_EQ(pthread_create(&th, NULL, cancel_on_thread, &cn), 0);
    uint64_t end = of_now_us() + 10000000; /* a cancel that waits for B's copy waits for ever here */
    while (!atomic_load(&cn.returned) && of_now_us() < end) of_sleep_us(1000);
    int returned_before_release = atomic_load(&cn.returned);
    if (returned_before_release)
        for (size_t i = 4; i < 8; i++) KVT_EQ(of_refs(r.src, r.weak[i].id), 0);
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);
    KVT_EQ(pthread_join(th, NULL), 0);
    KVT_CHECK(returned_before_release);
    KVT_EQ(cn.result, KVO_OK);
    KVT_EQ(cn.status, KVO_STATUS_CANCELLED);

    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 100), KVO_STATUS_COMPLETE);
    of_polls(r.p, &r.clock, 20000, 10);
    KVT_EQ(of_info(r.p, a).transferred, 4);
    KVT_EQ(of_status(r.p, b), KVO_STATUS_CANCELLED);
    KVT_EQ(of_info(r.p, b).transferred, 0);
    KVT_EQ(saw(&r, &r.weak[4], 4), 0);
    KVT_EQ(of_present(r.dst, &r.h[4], 4), 0);
    KVT_EQ(of_holds_all(r.dst, r.h, 4), 4);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    rig_close(&r);
}

/* One token shared by two containers cancels both; the sweeper drops them before any upgrade. */
/* A cancel that lands while the on-deck sweep runs (here: an observer of the first dropped container
 * cancels the next one's token, as another thread could at that moment) must not split a container: it
 * stays whole in the job until the next sweep drops it. Before, its copies stayed in the job while it was
 * finalized (sources given back): destination blocks leaked when the whole batch went, or the job copied
 * from sources already reused and registered the wrong bytes under its hashes. `third`: a third transfer
 * keeps the batch alive. */
static kvo_transfer sweep_x;
static kvo_token *sweep_ty;
static void cancel_y_when_x_drops(void *user, const kvo_stage_note *note)
{
    (void)user;
    if (note->transfer.id == sweep_x.id && note->info->status == KVO_STATUS_CANCELLED) kvo_token_cancel(sweep_ty);
}

static void cancel_during_on_deck_sweep(int third)
{
    kvb_pool *src = of_mem_pool(32, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvb_pool *dst = of_mem_pool(64, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvo_backend *mem;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    of_backend *w = of_backend_wrap(mem);
    of_clock clk = {1000000};
    kvb_hash h[10];
    kvb_weak weak[10];
    of_chain(1, 10, h);
    of_register(src, h, 10, NULL, weak);
    kvo_pipeline_config pc = of_config(src, dst, of_backend_iface(w), KVO_MODE_POLL, &clk);
    pc.max_batch = 6;
    pc.min_batch = 1;
    pc.on_stage = cancel_y_when_x_drops;
    kvo_pipeline *p = of_pipeline(&pc);

    of_backend_set_hold(w, 1);
    kvo_transfer a = of_enqueue(p, weak, 4, NULL); /* holds the backend */
    of_polls(p, &clk, 1000, 3);
    KVT_EQ(of_backend_held(w), 1);
    kvo_token *tx, *ty;
    KVT_EQ(kvo_token_create(&tx), KVO_OK);
    KVT_EQ(kvo_token_create(&ty), KVO_OK);
    sweep_ty = ty;
    kvo_enqueue_opts ox = {0}, oy = {0};
    ox.token = tx;
    oy.token = ty;
    sweep_x = of_enqueue(p, &weak[4], 2, &ox);
    kvo_transfer y = of_enqueue(p, &weak[6], 2, &oy), z = {0};
    if (third) z = of_enqueue(p, &weak[8], 2, NULL);
    of_polls(p, &clk, 1000, 1); /* X, Y (and Z) in one batch, upgraded, on deck */
    KVT_EQ(of_refs(src, weak[6].id), 1);

    kvo_status sx;
    KVT_EQ(kvo_transfer_cancel(p, sweep_x, &sx), KVO_OK);
    KVT_EQ(sx, KVO_STATUS_CANCELLED);
    kvo_status sy = of_status(p, y);
    if (sy == KVO_STATUS_CANCELLED) /* dropped whole, or not at all: never its references alone */
        KVT_EQ(of_refs(src, weak[6].id) + of_refs(src, weak[7].id), 0);
    else
        KVT_EQ(of_refs(src, weak[6].id) + of_refs(src, weak[7].id), 2);

    /* every source block nobody holds is reused for other bytes */
    kvb_block grab[32];
    kvb_pool_stats ss = of_stats(src);
    uint32_t avail = ss.free_blocks + ss.inactive_blocks;
    KVT_EQ(kvb_alloc(src, avail, grab), KVB_OK);
    for (uint32_t i = 0; i < avail; i++) of_fill(src, grab[i], (kvb_hash){0xdead + i, 0xbeef});

    of_backend_set_hold(w, 0);
    of_backend_release(w);
    of_polls(p, &clk, 1000, 5);
    KVT_EQ(kvo_pipeline_drain(p, 1000000), KVO_OK);
    /* too late to cancel (it ran whole, from sources it held) or dropped whole by a later sweep */
    sy = of_status(p, y);
    KVT_CHECK(sy == KVO_STATUS_COMPLETE || sy == KVO_STATUS_CANCELLED);
    int landed = sy == KVO_STATUS_COMPLETE;
    KVT_EQ(of_holds(dst, h[6]), landed); /* 1: the right bytes; never -1, the bytes of a reused source */
    KVT_EQ(of_holds(dst, h[7]), landed);
    KVT_EQ(of_backend_copies(w), 4u + (landed ? 2u : 0u) + (third ? 2u : 0u));
    if (third) KVT_EQ(of_holds_all(dst, &h[8], 2), 2);

    KVT_EQ(kvb_release(src, grab, avail, NULL), KVB_OK);
    KVT_EQ(kvo_transfer_release(p, a), KVO_OK);
    KVT_EQ(kvo_transfer_release(p, sweep_x), KVO_OK);
    KVT_EQ(kvo_transfer_release(p, y), KVO_OK);
    if (third) KVT_EQ(kvo_transfer_release(p, z), KVO_OK);
    kvo_pipeline_destroy(p);
    KVT_EQ(of_active(src), 0);
    KVT_EQ(of_active(dst), 0); /* no destination block left referenced */
    char why[256] = "";
    KVT_EQ(kvb_pool_check(dst, why, sizeof why), KVB_OK);
    kvo_token_release(tx);
    kvo_token_release(ty);
    kvo_backend_destroy(of_backend_iface(w));
    kvo_backend_destroy(mem);
    kvb_pool_destroy(src);
    kvb_pool_destroy(dst);
}

static void test_cancel_during_the_on_deck_sweep_whole_batch(void) { cancel_during_on_deck_sweep(0); }
static void test_cancel_during_the_on_deck_sweep_batch_lives_on(void) { cancel_during_on_deck_sweep(1); }

static void test_cancel_by_shared_token(void)
{
    rig r;
    kvo_token *tok = NULL;
    rig_open(&r, 8);
    KVT_EQ(kvo_token_create(&tok), KVO_OK);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.token = tok;
    kvo_transfer x = of_enqueue(r.p, r.weak, 2, &opts);
    kvo_transfer y = of_enqueue(r.p, &r.weak[2], 2, &opts);
    kvo_token_release(tok); /* the containers hold their own references */
    of_polls(r.p, &r.clock, 0, 3);
    kvo_token_cancel(tok);
    of_polls(r.p, &r.clock, 5000, 10); /* past the sweep and flush intervals */
    KVT_EQ(of_status(r.p, x), KVO_STATUS_CANCELLED);
    KVT_EQ(of_status(r.p, y), KVO_STATUS_CANCELLED);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(of_present(r.dst, r.h, 4), 0);
    kvo_transfer_release(r.p, x);
    kvo_transfer_release(r.p, y);
    rig_close(&r);
}

/* ---- cancel after the upgrade: the transfer completes, and cancel returns only then ---- */

typedef struct releaser {
    of_backend *w;
    atomic_int released;
} releaser;

static void *release_later(void *arg)
{
    releaser *rel = (releaser *)arg;
    of_sleep_us(100000);
    atomic_store(&rel->released, 1);
    of_backend_set_hold(rel->w, 0);
    of_backend_release(rel->w);
    return NULL;
}

static void test_cancel_after_upgrade_completes(void)
{
    rig r;
    releaser rel;
    pthread_t th;
    rig_pools(&r, SRC_BLOCKS, 4);
    kvo_pipeline_config pc = of_config(r.src, r.dst, of_backend_iface(r.w), KVO_MODE_THREADS, NULL);
    pc.min_batch = 1;
    rig_start(&r, &pc);
    of_backend_set_hold(r.w, 1);

    kvo_transfer t = of_enqueue(r.p, r.weak, 4, NULL);
    KVT_EQ(of_backend_wait_held(r.w, 1, 5000000), 1); /* the backend is in the middle of the job */
    for (int i = 0; i < 1000 && of_status(r.p, t) != KVO_STATUS_TRANSFERRING; i++) of_sleep_us(1000);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_TRANSFERRING);
    memset(&rel, 0, sizeof rel);
    rel.w = r.w;
    KVT_EQ(pthread_create(&th, NULL, release_later, &rel), 0);
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, t, &st), KVO_OK);
    KVT_EQ(atomic_load(&rel.released), 1); /* cancel waited for the copy in flight */
    KVT_EQ(st, KVO_STATUS_COMPLETE);
    KVT_EQ(pthread_join(th, NULL), 0);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, 4);
    KVT_EQ(of_holds_all(r.dst, r.h, 4), 4);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* ---- handles ---- */

static void test_finished_cancelled_and_released_handles(void)
{
    rig r;
    rig_open(&r, 8);
    kvo_transfer done = of_enqueue(r.p, r.weak, 8, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, done, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, done, &st), KVO_OK); /* too late: stays complete */
    KVT_EQ(st, KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, done).transferred, 8);

    kvb_hash h2[2];
    kvb_weak w2[2];
    of_chain(3, 2, h2);
    of_register(r.src, h2, 2, NULL, w2);
    kvo_transfer twice = of_enqueue(r.p, w2, 2, NULL);
    of_polls(r.p, &r.clock, 0, 2);
    st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, twice, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_CANCELLED);
    st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_cancel(r.p, twice, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_CANCELLED);
    KVT_EQ(kvo_transfer_cancel(r.p, twice, NULL), KVO_OK);

    KVT_EQ(kvo_transfer_release(r.p, done), KVO_OK);
    KVT_EQ(kvo_transfer_release(r.p, twice), KVO_OK);
    kvo_transfer_info info;
    KVT_EQ(kvo_transfer_get_info(r.p, done, &info), KVO_ESTALE);
    KVT_EQ(kvo_transfer_get_info(r.p, twice, &info), KVO_ESTALE);
    KVT_EQ(kvo_transfer_wait(r.p, done, 1000, &st), KVO_ESTALE);
    KVT_EQ(kvo_transfer_cancel(r.p, twice, &st), KVO_ESTALE);

    /* a new transfer may reuse the slot; the old handle stays stale */
    kvo_transfer fresh = of_enqueue(r.p, w2, 2, NULL);
    KVT_CHECK(fresh.id != done.id && fresh.id != twice.id);
    KVT_EQ(kvo_transfer_get_info(r.p, twice, &info), KVO_ESTALE);
    KVT_EQ(kvo_transfer_get_info(r.p, done, &info), KVO_ESTALE);
    KVT_EQ(kvo_transfer_get_info(r.p, fresh, &info), KVO_OK);
    r.clock.now += 20000;
    KVT_EQ(of_pump(r.p, &r.clock, fresh, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, fresh).transferred, 2); /* the cancelled copy no longer counts as in flight */
    KVT_EQ(kvo_transfer_release(r.p, fresh), KVO_OK);
    rig_close(&r);
}

/* An empty offer may name no array (blocks NULL, n 0): it completes at once with nothing copied. */
static void test_enqueue_of_nothing(void)
{
    rig r;
    rig_open(&r, 8);
    kvo_transfer t;
    KVT_EQ(kvo_enqueue(r.p, NULL, 0, NULL, &t), KVO_OK);
    of_polls(r.p, &r.clock, 5000, 4);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 0);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    rig_close(&r);
}

/* A count above UINT32_MAX (an underflowed length, say) is refused at once, for an offload and for an
 * onboarding alike. Before, sizing its container doubled a capacity until it wrapped to 0 and spun for
 * ever, the pipeline locked. */
static void test_enqueue_of_too_many(void)
{
    rig r;
    rig_open(&r, 8);
    kvo_transfer t = {77};
    KVT_EQ(kvo_enqueue(r.p, r.weak, (size_t)-1, NULL, &t), KVO_EINVAL);
    KVT_EQ(kvo_onboard(r.p, r.h, (size_t)-1, NULL, &t), KVO_EINVAL);
    if (sizeof(size_t) > 4) KVT_EQ(kvo_enqueue(r.p, r.weak, (size_t)UINT32_MAX + 1, NULL, &t), KVO_EINVAL);
    KVT_EQ(t.id, 77);
    KVT_EQ(kvo_enqueue(r.p, r.weak, 8, NULL, &t), KVO_OK); /* the pipeline goes on */
    of_polls(r.p, &r.clock, 5000, 10);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_COMPLETE);
    KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    rig_close(&r);
}

static void test_enqueue_with_cancelled_token(void)
{
    rig r;
    kvo_token *tok = NULL;
    rig_open(&r, 8);
    KVT_EQ(kvo_token_create(&tok), KVO_OK);
    kvo_token_cancel(tok);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.token = tok;
    kvo_transfer t;
    KVT_EQ(kvo_enqueue(r.p, r.weak, 8, &opts, &t), KVO_ECANCELLED);
    kvo_token_release(tok);
    of_polls(r.p, &r.clock, 5000, 10);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(of_present(r.dst, r.h, 8), 0);
    kvo_pipeline_stats st;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &st), KVO_OK);
    KVT_EQ(st.in_flight_blocks, 0);
    rig_close(&r);
}

/* kvo_transfer_wait in poll mode pumps the pipeline itself (real time here: no clock), and times out
 * on a transfer held back by an unsignalled precondition. */
static void test_wait_in_poll_mode(void)
{
    rig r;
    kvo_event *ev = NULL;
    rig_pools(&r, SRC_BLOCKS, 4);
    kvo_pipeline_config pc = of_config(r.src, r.dst, of_backend_iface(r.w), KVO_MODE_POLL, NULL);
    rig_start(&r, &pc);
    kvo_transfer t = of_enqueue(r.p, r.weak, 2, NULL); /* below min batch: goes at the flush, 10 ms */
    kvo_status st = KVO_STATUS_EVALUATING;
    KVT_EQ(kvo_transfer_wait(r.p, t, 2000000, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_COMPLETE);

    KVT_EQ(kvo_event_create(&ev), KVO_OK);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.precondition = ev;
    kvo_transfer u = of_enqueue(r.p, &r.weak[2], 2, &opts);
    uint64_t t0 = of_now_us();
    KVT_EQ(kvo_transfer_wait(r.p, u, 30000, &st), KVO_ETIMEDOUT);
    KVT_CHECK(of_now_us() - t0 >= 25000);
    KVT_CHECK(of_now_us() - t0 < 2000000);
    KVT_EQ(kvo_event_signal(ev), KVO_OK);
    KVT_EQ(kvo_transfer_wait(r.p, u, 2000000, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_COMPLETE);
    KVT_EQ(of_holds_all(r.dst, r.h, 4), 4);
    kvo_event_release(ev);
    kvo_transfer_release(r.p, t);
    kvo_transfer_release(r.p, u);
    rig_close(&r);
}

/* ---- stale weak handles ---- */

/* The source pool is full of cached blocks. A container of the four next eviction candidates sits in
 * the batcher when the engine allocates two blocks: the two evicted ones are dropped at the upgrade,
 * not copied; the other two go down. */
static void test_stale_weak_refs_are_dropped(void)
{
    rig r;
    kvb_weak cand[8];
    kvb_hash ch[8];
    kvb_block taken[2];
    size_t nc = 0;
    rig_pools(&r, 8, 8); /* src: 8 blocks, all registered and inactive */
    kvo_pipeline_config pc = rig_config(&r);
    rig_start(&r, &pc);
    KVT_EQ(kvb_eviction_candidates(r.src, 8, cand, &nc), KVB_OK);
    KVT_EQ(nc, 8);
    for (size_t i = 0; i < 4; i++) ch[i] = of_hash_of(r.src, cand[i].id);

    kvo_transfer t = of_enqueue(r.p, cand, 4, NULL);
    of_polls(r.p, &r.clock, 0, 3);
    KVT_EQ(of_status(r.p, t), KVO_STATUS_QUEUED);
    KVT_EQ(kvb_alloc(r.src, 2, taken), KVB_OK); /* evicts cand[0] and cand[1] */
    kvb_block probe;
    KVT_CHECK(kvb_upgrade(r.src, cand[0], &probe) != KVB_OK);
    KVT_CHECK(kvb_upgrade(r.src, cand[1], &probe) != KVB_OK);
    r.clock.now += 20000;
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.dropped, 2);
    KVT_EQ(info.transferred, 2);
    KVT_EQ(saw(&r, cand, 2), 0); /* the blocks now at those indices are the engine's */
    KVT_CHECK(!of_has(r.dst, ch[0]) && !of_has(r.dst, ch[1]));
    KVT_EQ(of_holds(r.dst, ch[2]), 1);
    KVT_EQ(of_holds(r.dst, ch[3]), 1);
    kvo_pipeline_stats st;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &st), KVO_OK);
    KVT_EQ(st.dropped, 2);
    KVT_EQ(kvb_release(r.src, taken, 2, NULL), KVB_OK);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* ---- preconditions ---- */

static void test_precondition_gates_the_copy(void)
{
    rig r;
    kvo_event *ev = NULL;
    rig_open(&r, 8);
    KVT_EQ(kvo_event_create(&ev), KVO_OK);
    KVT_EQ(kvo_event_query(ev), 0);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.precondition = ev;
    kvo_transfer t = of_enqueue(r.p, r.weak, 8, &opts);
    of_polls(r.p, &r.clock, 1000, 30); /* 30 ms: well past flush, well before the 10 s timeout */
    KVT_CHECK(!of_final(of_status(r.p, t)));
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(kvo_event_signal(ev), KVO_OK);
    KVT_EQ(kvo_event_query(ev), 1);
    KVT_EQ(kvo_event_wait(ev, 0), KVO_OK);
    kvo_event_release(ev); /* the container keeps its own reference */
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_info(r.p, t).transferred, 8);
    KVT_EQ(of_holds_all(r.dst, r.h, 8), 8);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

static void test_precondition_timeout_fails(void)
{
    rig r;
    kvo_event *ev = NULL;
    rig_pools(&r, SRC_BLOCKS, 8);
    kvo_pipeline_config pc = rig_config(&r);
    pc.precondition_timeout_us = 5000;
    rig_start(&r, &pc);
    KVT_EQ(kvo_event_create(&ev), KVO_OK);
    KVT_EQ(kvo_event_wait(ev, 1000), KVO_ETIMEDOUT);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.precondition = ev;
    kvo_transfer t = of_enqueue(r.p, r.weak, 8, &opts);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 100), KVO_STATUS_FAILED);
    KVT_CHECK(r.clock.now >= 1000000 + 5000);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_CHECK(info.error < 0);
    KVT_EQ(info.transferred, 0);
    KVT_EQ(of_backend_copies(r.w), 0);
    KVT_EQ(of_present(r.dst, r.h, 8), 0);
    kvo_event_release(ev);
    kvo_transfer_release(r.p, t);
    rig_close(&r);
}

/* Poll mode with a manual clock: the policy and precondition timeouts follow that clock, the drain's own
 * timeout the real one. While the clock stands still, a policy that answers "later" and a precondition
 * never signalled hold the drain (20 ms of real time are far past both timeouts: KVO_ETIMEDOUT, both
 * transfers still waiting; with -1 it would never return); once the clock passes the timeouts it ends. */
static void test_drain_waits_for_a_manual_clock(void)
{
    rig r;
    verdicts v;
    kvo_event *ev = NULL;
    kvo_enqueue_opts opts;
    rig_pools(&r, SRC_BLOCKS, 4);
    memset(&v, 0, sizeof v);
    v.r = &r;
    v.answer[0] = v.answer[1] = KVO_LATER;
    v.answer[2] = v.answer[3] = KVO_OFFER;
    kvo_pipeline_config pc = rig_config(&r);
    pc.policy = ask;
    pc.policy_user = &v;
    pc.policy_timeout_us = 1000;
    pc.precondition_timeout_us = 1000;
    rig_start(&r, &pc);
    KVT_EQ(kvo_event_create(&ev), KVO_OK);
    memset(&opts, 0, sizeof opts);
    opts.precondition = ev;
    kvo_transfer later = of_enqueue(r.p, r.weak, 2, NULL);
    kvo_transfer gated = of_enqueue(r.p, r.weak + 2, 2, &opts);
    KVT_EQ(kvo_pipeline_drain(r.p, 20000), KVO_ETIMEDOUT);
    KVT_EQ(of_status(r.p, later), KVO_STATUS_EVALUATING);
    KVT_CHECK(of_status(r.p, gated) != KVO_STATUS_COMPLETE && of_status(r.p, gated) != KVO_STATUS_FAILED);
    r.clock.now += 2000; /* past both timeouts */
    KVT_EQ(kvo_pipeline_drain(r.p, -1), KVO_OK);
    KVT_EQ(of_info(r.p, later).timed_out, 2);
    KVT_EQ(of_status(r.p, gated), KVO_STATUS_FAILED);
    KVT_EQ(of_backend_copies(r.w), 0);
    kvo_event_release(ev);
    kvo_transfer_release(r.p, later);
    kvo_transfer_release(r.p, gated);
    rig_close(&r);
}

typedef struct scripted_event {
    int calls, signal_after; /* answer 0 until signal_after calls, then `then` */
    int then;
} scripted_event;

static int scripted_query(void *user)
{
    scripted_event *e = (scripted_event *)user;
    return ++e->calls > e->signal_after ? e->then : 0;
}

/* Custom events (the shape CUDA events take): polled, never waited on; a negative answer fails the
 * transfers waiting on it with KVO_EPRECOND. */
static void test_custom_precondition_events(void)
{
    rig r;
    scripted_event ok = {0, 3, 1}, bad = {0, 2, -1};
    kvo_event *evok = NULL, *evbad = NULL;
    rig_open(&r, 8);
    KVT_EQ(kvo_event_create_custom(scripted_query, &ok, &evok), KVO_OK);
    KVT_EQ(kvo_event_create_custom(scripted_query, &bad, &evbad), KVO_OK);
    kvo_enqueue_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.precondition = evok;
    kvo_transfer a = of_enqueue(r.p, r.weak, 4, &opts);
    opts.precondition = evbad;
    kvo_transfer b = of_enqueue(r.p, &r.weak[4], 4, &opts);
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, b, 1000, 200), KVO_STATUS_FAILED);
    KVT_CHECK(ok.calls > 3);
    KVT_EQ(of_info(r.p, a).transferred, 4);
    KVT_EQ(of_info(r.p, b).error, KVO_EPRECOND);
    KVT_EQ(saw(&r, &r.weak[4], 4), 0);
    KVT_EQ(of_holds_all(r.dst, r.h, 4), 4);
    KVT_EQ(of_present(r.dst, &r.h[4], 4), 0);
    kvo_event_release(evok);
    kvo_event_release(evbad);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    rig_close(&r);
}

/* kvo_event_wait on a custom event polls its query: until it says done (KVO_OK), failed (KVO_EPRECOND)
 * or the timeout passes (KVO_ETIMEDOUT); kvo_event_signal is for plain events only. */
static void test_wait_on_custom_events(void)
{
    scripted_event later = {0, 3, 1}, failing = {0, 2, -1}, never = {0, 1 << 30, 1};
    kvo_event *e1 = NULL, *e2 = NULL, *e3 = NULL;
    KVT_EQ(kvo_event_create_custom(scripted_query, &later, &e1), KVO_OK);
    KVT_EQ(kvo_event_create_custom(scripted_query, &failing, &e2), KVO_OK);
    KVT_EQ(kvo_event_create_custom(scripted_query, &never, &e3), KVO_OK);
    KVT_EQ(kvo_event_wait(e1, -1), KVO_OK);
    KVT_EQ(later.calls, 4); /* three "not yet", then done */
    KVT_EQ(kvo_event_wait(e2, -1), KVO_EPRECOND);
    KVT_EQ(failing.calls, 3);
    KVT_EQ(kvo_event_wait(e3, 2000), KVO_ETIMEDOUT);
    KVT_CHECK(never.calls >= 2);
    KVT_EQ(kvo_event_signal(e3), KVO_EINVAL);
    KVT_EQ(kvo_event_wait(NULL, 0), KVO_EINVAL);
    kvo_event_release(e1);
    kvo_event_release(e2);
    kvo_event_release(e3);
}

/* ---- backend faults ---- */

/* The backend fails the 3rd copy of an 8-block job: the handle is Failed with the backend's code and
 * message, every block the transfer held is released in both pools, the failed block is not in the
 * destination, and the source keeps all eight, intact and matchable; a retry then completes. */
static void test_backend_failure_mid_batch(void)
{
    rig r;
    rig_open(&r, 8);
    uint32_t src_active = of_active(r.src), dst_active = of_active(r.dst);
    of_backend_set_fail(r.w, 3, KVO_EIO);
    kvo_transfer t = of_enqueue(r.p, r.weak, 8, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_FAILED);
    kvo_transfer_info info = of_info(r.p, t);
    KVT_EQ(info.error, KVO_EIO);
    KVT_CHECK(info.failed >= 1);
    KVT_CHECK(info.transferred + info.failed <= 8);
    KVT_CHECK(strstr(info.message, "injected") != NULL);
    KVT_CHECK(!of_has(r.dst, r.w->failed_hash));
    KVT_EQ(of_active(r.src), src_active);
    KVT_EQ(of_active(r.dst), dst_active);
    OF_CHECK_POOL(r.src);
    OF_CHECK_POOL(r.dst);
    KVT_EQ(of_holds_all(r.src, r.h, 8), 8);
    size_t found = 0;
    KVT_EQ(kvb_lookup(r.src, r.h, 8, &found), KVB_OK);
    KVT_EQ(found, 8);
    kvo_pipeline_stats st;
    KVT_EQ(kvo_pipeline_get_stats(r.p, &st), KVO_OK);
    KVT_EQ(st.in_flight_blocks, 0);
    KVT_CHECK(st.failed >= 1);

    of_backend_set_fail(r.w, 0, 0);
    kvo_transfer again = of_enqueue(r.p, r.weak, 8, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, again, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_holds_all(r.dst, r.h, 8), 8);
    kvo_transfer_release(r.p, t);
    kvo_transfer_release(r.p, again);
    rig_close(&r);
}

static kvo_pipeline_stats stats_of(kvo_pipeline *p)
{
    kvo_pipeline_stats st;
    memset(&st, 0, sizeof st);
    KVT_EQ(kvo_pipeline_get_stats(p, &st), KVO_OK);
    return st;
}

/* dest_full counts transfers that found the destination full, as its comment says: two offloads in
 * one batch into a full destination are 2. Before, it counted the batch: 1. */
static void test_dest_full_counts_transfers(void)
{
    rig r;
    kvb_block engine[DST_BLOCKS];
    rig_open(&r, 4);
    KVT_EQ(kvb_alloc(r.dst, DST_BLOCKS, engine), KVB_OK); /* no room left */
    kvo_transfer a = of_enqueue(r.p, r.weak, 2, NULL);
    kvo_transfer b = of_enqueue(r.p, &r.weak[2], 2, NULL); /* below min batch: one batch at the flush */
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 200), KVO_STATUS_FAILED);
    KVT_EQ(of_pump(r.p, &r.clock, b, 1000, 200), KVO_STATUS_FAILED);
    KVT_EQ(of_info(r.p, a).error, KVO_EFULL);
    KVT_EQ(of_info(r.p, b).error, KVO_EFULL);
    KVT_EQ(stats_of(r.p).dest_full, 2);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    KVT_EQ(kvb_release(r.dst, engine, DST_BLOCKS, NULL), KVB_OK);
    rig_close(&r);
}

/* in_flight_blocks counts the blocks upgraded and not landed yet: on deck, and in the backend. Before,
 * a job handed to the backend left the count, so a pipeline busy copying reported 0. */
static void test_in_flight_blocks_include_the_backends_jobs(void)
{
    rig r;
    rig_pools(&r, SRC_BLOCKS, 8);
    kvo_pipeline_config pc = rig_config(&r);
    pc.max_batch = 4;
    pc.min_batch = 1;
    rig_start(&r, &pc);
    of_backend_set_hold(r.w, 1);
    kvo_transfer a = of_enqueue(r.p, r.weak, 4, NULL);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(of_backend_held(r.w), 1);
    KVT_EQ(stats_of(r.p).in_flight_blocks, 4); /* in the backend */
    kvo_transfer b = of_enqueue(r.p, &r.weak[4], 3, NULL);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(of_backend_held(r.w), 1);
    KVT_EQ(stats_of(r.p).in_flight_blocks, 7); /* and on deck */
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);
    KVT_EQ(of_pump(r.p, &r.clock, a, 1000, 100), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, b, 1000, 100), KVO_STATUS_COMPLETE);
    KVT_EQ(stats_of(r.p).in_flight_blocks, 0);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    rig_close(&r);
}

/* A copy failing because the source's entry is gone (KVO_ENOTFOUND, as Redis reports an evicted one) or
 * damaged (KVO_ECHECKSUM) is a miss reported with that code, and the source block is dropped once the
 * job is done (kvb_invalidate), so lookups there stop finding it; the other sources stay. (A copy failed
 * otherwise leaves its source: test_backend_failure_mid_batch.) */
static void test_lost_source_dropped(void)
{
    const int codes[2] = {KVO_ENOTFOUND, KVO_ECHECKSUM};
    KVT_CHECK(strstr(kvo_result_string(KVO_ENOTFOUND), "not in the source tier") != NULL);
    for (int i = 0; i < 2; i++) {
        rig r;
        rig_open(&r, 8);
        of_backend_set_fail(r.w, 3, codes[i]);
        kvo_transfer t = of_enqueue(r.p, r.weak, 8, NULL);
        KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_FAILED);
        kvo_transfer_info info = of_info(r.p, t);
        KVT_EQ(info.error, codes[i]);
        KVT_EQ(info.failed, 1);
        KVT_EQ(info.transferred, 7);
        KVT_CHECK(!of_has(r.src, r.w->failed_hash));
        KVT_EQ(of_stats(r.src).invalidated, 1);
        KVT_EQ(of_present(r.src, r.h, 8), 7);
        kvo_transfer_release(r.p, t);
        rig_close(&r);
    }
}

/* A backend that refuses the whole job (submit error): Failed with that code, nothing held. */
static void test_backend_refuses_job(void)
{
    rig r;
    rig_open(&r, 8);
    of_backend_set_submit_error(r.w, KVO_EBACKEND);
    kvo_transfer t = of_enqueue(r.p, r.weak, 8, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_FAILED);
    KVT_EQ(of_info(r.p, t).error, KVO_EBACKEND);
    KVT_EQ(of_info(r.p, t).transferred, 0);
    KVT_EQ(of_present(r.dst, r.h, 8), 0);
    KVT_EQ(of_active(r.src), 0);
    KVT_EQ(of_active(r.dst), 0);
    of_backend_set_submit_error(r.w, 0);
    kvo_transfer again = of_enqueue(r.p, r.weak, 8, NULL);
    KVT_EQ(of_pump(r.p, &r.clock, again, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_holds_all(r.dst, r.h, 8), 8);
    kvo_transfer_release(r.p, t);
    kvo_transfer_release(r.p, again);
    rig_close(&r);
}

/* A refused job reports the backend's reason, not a generic backend error: the disk backend refuses a
 * memory pool of other block bytes with KVO_ELAYOUT, the Redis one a pool without storage with
 * KVB_ENODATA. Before, every copy kept the placeholder result KVO_EBACKEND the upgrade puts there. */
static void test_backend_refusal_reason_reported(void)
{
    static const int reasons[] = {KVO_ELAYOUT, KVB_ENODATA, KVO_EINVAL};
    rig r;
    rig_open(&r, 6);
    for (size_t i = 0; i < 3; i++) {
        of_backend_set_submit_error(r.w, reasons[i]);
        kvo_transfer t = of_enqueue(r.p, &r.weak[2 * i], 2, NULL);
        KVT_EQ(of_pump(r.p, &r.clock, t, 1000, 200), KVO_STATUS_FAILED);
        kvo_transfer_info info = of_info(r.p, t);
        KVT_EQ(info.error, reasons[i]);
        KVT_EQ(info.failed, 2);
        KVT_EQ(info.transferred, 0);
        KVT_CHECK(strcmp(info.message, "backend refused the job") == 0);
        KVT_EQ(kvo_transfer_release(r.p, t), KVO_OK);
    }
    KVT_EQ(of_present(r.dst, r.h, 6), 0);
    KVT_EQ(of_active(r.src), 0);
    KVT_EQ(of_active(r.dst), 0);
    rig_close(&r);
}

/* Two transfers whose copies fail in one backend job get a message of their own, "<backend> backend:
 * <error>": for a code kvoffload.h does not name (another library's: kvremote.h's KVO_EREMOTE -124,
 * kvcuda.h's -3xx), the code itself, not "unknown result". */
enum { FOREIGN_ERROR = -124 };

static int fail_all_submit(kvo_backend *self, kvo_copy_job *job)
{
    (void)self;
    for (size_t i = 0; i < job->n; i++) job->results[i] = FOREIGN_ERROR;
    job->done(job, FOREIGN_ERROR, "remote: ERR the server said no");
    return KVO_OK;
}

static void test_message_of_a_code_kvoffload_does_not_name(void)
{
    rig r;
    kvo_backend fail_all = {fail_all_submit, NULL, "remote", NULL};
    rig_pools(&r, SRC_BLOCKS, 2);
    kvo_pipeline_config pc = rig_config(&r);
    pc.backend = &fail_all;
    pc.min_batch = 2;
    rig_start(&r, &pc);
    kvo_transfer a = of_enqueue(r.p, &r.weak[0], 1, NULL), b = of_enqueue(r.p, &r.weak[1], 1, NULL);
    KVT_EQ(kvo_pipeline_drain(r.p, 1000000), KVO_OK);
    kvo_transfer t[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        kvo_transfer_info info = of_info(r.p, t[i]);
        KVT_EQ(info.status, KVO_STATUS_FAILED);
        KVT_EQ(info.error, FOREIGN_ERROR);
        KVT_CHECK(strstr(info.message, "remote backend") != NULL);
        KVT_CHECK(strstr(info.message, "-124") != NULL);
        KVT_CHECK(strstr(info.message, "unknown") == NULL);
        if (strstr(info.message, "-124") == NULL) fprintf(stderr, "  message: \"%s\"\n", info.message);
        KVT_EQ(kvo_transfer_release(r.p, t[i]), KVO_OK);
    }
    kvo_pipeline_destroy(r.p);
    r.p = NULL;
    rig_close(&r);
}

/* ---- priorities ---- */

/* While the executor is busy, a low-priority and then a high-priority container are batched; the high
 * one is copied first. */
static void test_priority_order(void)
{
    rig r;
    rig_pools(&r, SRC_BLOCKS, 12);
    kvo_pipeline_config pc = rig_config(&r);
    pc.max_batch = 4;
    pc.min_batch = 1;
    rig_start(&r, &pc);
    of_backend_set_hold(r.w, 1);
    kvo_transfer filler = of_enqueue(r.p, r.weak, 4, NULL);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(of_backend_held(r.w), 1);

    kvo_enqueue_opts lo, hi;
    memset(&lo, 0, sizeof lo);
    memset(&hi, 0, sizeof hi);
    lo.priority = 1;
    hi.priority = 5;
    kvo_transfer tl = of_enqueue(r.p, &r.weak[4], 4, &lo);
    kvo_transfer th = of_enqueue(r.p, &r.weak[8], 4, &hi);
    of_polls(r.p, &r.clock, 1000, 5);
    of_backend_set_hold(r.w, 0);
    of_backend_release(r.w);
    KVT_EQ(of_pump(r.p, &r.clock, tl, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, th, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_status(r.p, filler), KVO_STATUS_COMPLETE);
    long last_high = -1, first_low = 1 << 30;
    for (size_t i = 0; i < 4; i++) {
        long ph = of_backend_position(r.w, r.h[8 + i]), pl = of_backend_position(r.w, r.h[4 + i]);
        KVT_CHECK(ph >= 0 && pl >= 0);
        if (ph > last_high) last_high = ph;
        if (pl < first_low) first_low = pl;
    }
    KVT_CHECK(last_high < first_low);
    KVT_EQ(of_holds_all(r.dst, r.h, 12), 12);
    kvo_transfer_release(r.p, filler);
    kvo_transfer_release(r.p, tl);
    kvo_transfer_release(r.p, th);
    rig_close(&r);
}

/* ---- on_done ---- */

typedef struct done_log {
    kvo_pipeline *p;
    int calls;
    kvo_transfer t[4];
    kvo_transfer_info info[4];
    kvb_weak dst[4][8];
    size_t n[4];
    int reentrant_ok; /* kvo_transfer_get_info from inside the callback worked and saw the final state */
} done_log;

static void on_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    done_log *log = (done_log *)user;
    kvo_transfer_info again;
    if (log->calls < 4) {
        int k = log->calls;
        log->t[k] = t;
        log->info[k] = *info;
        log->n[k] = n;
        for (size_t i = 0; i < n && i < 8; i++) log->dst[k][i] = dst[i];
    }
    log->calls++;
    if (kvo_transfer_get_info(log->p, t, &again) == KVO_OK && again.status == info->status) log->reentrant_ok++;
}

static int find_call(const done_log *log, kvo_transfer t)
{
    int found = -1, count = 0;
    for (int i = 0; i < log->calls && i < 4; i++)
        if (log->t[i].id == t.id) {
            found = i;
            count++;
        }
    return count == 1 ? found : -1;
}

/* on_done: once per transfer, with the container's destination blocks as weak handles in container
 * order and 0 where a block did not get there (here: evicted from the source before the upgrade). */
static void test_on_done_once_with_destination_handles(void)
{
    rig r;
    done_log log;
    kvb_weak cand[6], order[4];
    kvb_hash ch[6];
    kvb_block taken;
    size_t nc = 0;
    rig_pools(&r, 6, 6);
    memset(&log, 0, sizeof log);
    kvo_pipeline_config pc = rig_config(&r);
    pc.on_done = on_done;
    pc.done_user = &log;
    rig_start(&r, &pc);
    log.p = r.p;
    KVT_EQ(kvb_eviction_candidates(r.src, 6, cand, &nc), KVB_OK);
    KVT_EQ(nc, 6);
    for (size_t i = 0; i < 6; i++) ch[i] = of_hash_of(r.src, cand[i].id);
    order[0] = cand[1];
    order[1] = cand[0]; /* the next to be evicted */
    order[2] = cand[2];
    order[3] = cand[3];
    kvo_transfer t1 = of_enqueue(r.p, order, 4, NULL);
    kvo_transfer t2 = of_enqueue(r.p, &cand[4], 2, NULL);
    KVT_EQ(kvb_alloc(r.src, 1, &taken), KVB_OK); /* evicts cand[0] */
    KVT_EQ(of_pump(r.p, &r.clock, t1, 1000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, t2, 1000, 200), KVO_STATUS_COMPLETE);
    of_polls(r.p, &r.clock, 1000, 5);
    KVT_EQ(log.calls, 2);
    KVT_EQ(log.reentrant_ok, 2);
    int k1 = find_call(&log, t1), k2 = find_call(&log, t2);
    KVT_CHECK(k1 >= 0 && k2 >= 0);
    if (k1 >= 0 && k2 >= 0) {
        KVT_EQ(log.n[k1], 4);
        KVT_EQ(log.info[k1].status, KVO_STATUS_COMPLETE);
        KVT_EQ(log.info[k1].transferred, 3);
        KVT_EQ(log.info[k1].dropped, 1);
        KVT_EQ(log.dst[k1][1].id, 0);
        kvb_hash expect[4] = {ch[1], ch[0], ch[2], ch[3]};
        for (size_t i = 0; i < 4; i++) {
            if (i == 1) continue;
            KVT_CHECK(log.dst[k1][i].id & KVB_WEAK_BIT);
            KVT_CHECK(of_hash_eq(of_hash_of(r.dst, log.dst[k1][i].id), expect[i]));
        }
        KVT_EQ(log.n[k2], 2);
        KVT_EQ(log.info[k2].transferred, 2);
        for (size_t i = 0; i < 2; i++) {
            kvb_block b;
            KVT_EQ(kvb_upgrade(r.dst, log.dst[k2][i], &b), KVB_OK);
            KVT_CHECK(of_bytes_ok(r.dst, b, ch[4 + i]));
            KVT_EQ(kvb_release(r.dst, &b, 1, NULL), KVB_OK);
        }
    }
    KVT_EQ(kvb_release(r.src, &taken, 1, NULL), KVB_OK);
    kvo_transfer_release(r.p, t1);
    kvo_transfer_release(r.p, t2);
    of_polls(r.p, &r.clock, 1000, 3);
    KVT_EQ(log.calls, 2); /* releasing does not call it again */
    rig_close(&r);
}

/* on_done may release its own transfer (the tier manager does, for every offload it starts) while a
 * caller waits on or cancels that transfer: the waiter then gets KVO_ESTALE and reads nothing of the
 * released container. They held the container across the wait; with 16 spare containers kept the
 * released one is freed, and the waiter read freed memory (ASan: heap-use-after-free). 17 one-block
 * transfers, so that the one waited on is released last, when the spares are full. */
typedef struct self_release {
    kvo_pipeline *p;
    atomic_int calls;
} self_release;

static void release_in_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    self_release *sr = (self_release *)user;
    (void)info;
    (void)dst;
    (void)n;
    atomic_fetch_add(&sr->calls, 1);
    KVT_EQ(kvo_transfer_release(sr->p, t), KVO_OK);
}

static void *release_held_later(void *arg)
{
    of_backend *w = (of_backend *)arg;
    of_sleep_us(100000); /* the canceller is waiting by then */
    of_backend_release(w);
    return NULL;
}

static void test_wait_and_cancel_while_on_done_releases(void)
{
    enum { N = 17 };
    for (int cancel = 0; cancel < 2; cancel++) {
        rig r;
        self_release sr;
        kvo_transfer t[N];
        kvo_status st = KVO_STATUS_EVALUATING;
        pthread_t helper;
        rig_pools(&r, SRC_BLOCKS, N);
        atomic_init(&sr.calls, 0);
        kvo_pipeline_config pc = rig_config(&r);
        pc.on_done = release_in_done;
        pc.done_user = &sr;
        pc.max_concurrent = 2;
        rig_start(&r, &pc);
        sr.p = r.p;
        if (cancel) of_backend_set_hold(r.w, 1);
        for (int i = 0; i < N; i++) t[i] = of_enqueue(r.p, &r.weak[i], 1, NULL);
        /* the waiter sees the transfer final, or already released by on_done (KVO_ESTALE): which one
         * depends on the threads' timing (under TSan it is often the first); never freed memory */
        kvo_result wr;
        if (!cancel) {
            wr = kvo_transfer_wait(r.p, t[N - 1], 5000000, &st);
        } else {
            of_polls(r.p, &r.clock, 1000, 3);
            KVT_EQ(of_backend_held(r.w), 2); /* 16 + 1 blocks: both jobs in the backend */
            KVT_EQ(pthread_create(&helper, NULL, release_held_later, r.w), 0);
            wr = kvo_transfer_cancel(r.p, t[N - 1], &st);
            pthread_join(helper, NULL);
        }
        KVT_CHECK(wr == KVO_ESTALE || (wr == KVO_OK && st == KVO_STATUS_COMPLETE));
        KVT_EQ(atomic_load(&sr.calls), N);
        KVT_EQ(of_holds_all(r.dst, r.h, N), N);
        for (int i = 0; i < N; i++) KVT_EQ(kvo_transfer_release(r.p, t[i]), KVO_ESTALE);
        rig_close(&r);
    }
}

/* on_done may call back into the pipeline (section 6), also to wait for another transfer. In threads
 * mode with an inline backend on_done runs on the coordinator thread, and a wait there slept until the
 * coordinator moved the other transfer on: itself, so it timed out (forever without a timeout). */
typedef struct wait_in_done_ctx {
    kvo_pipeline *p;
    kvo_transfer other;
    kvo_event *go;
    atomic_int armed, done;
    int result;
    kvo_status status;
    uint64_t waited_us;
} wait_in_done_ctx;

static void wait_in_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    wait_in_done_ctx *w = (wait_in_done_ctx *)user;
    uint64_t t0 = of_now_us();
    (void)info;
    (void)dst;
    (void)n;
    if (t.id == w->other.id || !atomic_exchange(&w->armed, 0)) return;
    KVT_EQ(kvo_event_signal(w->go), KVO_OK);
    w->result = kvo_transfer_wait(w->p, w->other, 10000000, &w->status);
    w->waited_us = of_now_us() - t0;
    atomic_store(&w->done, 1);
}

static void test_wait_from_on_done_in_threads_mode(void)
{
    rig r;
    wait_in_done_ctx w;
    kvo_enqueue_opts o;
    memset(&w, 0, sizeof w);
    memset(&o, 0, sizeof o);
    rig_pools(&r, SRC_BLOCKS, 2);
    kvo_pipeline_config pc = of_config(r.src, r.dst, of_backend_iface(r.w), KVO_MODE_THREADS, NULL);
    pc.on_done = wait_in_done;
    pc.done_user = &w;
    pc.min_batch = 1;
    rig_start(&r, &pc);
    w.p = r.p;
    KVT_EQ(kvo_event_create(&w.go), KVO_OK);
    o.precondition = w.go;
    w.other = of_enqueue(r.p, &r.weak[1], 1, &o); /* waits for the event on_done signals */
    atomic_store(&w.armed, 1);
    kvo_transfer first = of_enqueue(r.p, &r.weak[0], 1, NULL);
    uint64_t end = of_now_us() + 30000000;
    while (!atomic_load(&w.done) && of_now_us() < end) of_sleep_us(1000); /* the test thread stays out */
    KVT_EQ(atomic_load(&w.done), 1);
    KVT_EQ(w.result, KVO_OK);
    KVT_EQ(w.status, KVO_STATUS_COMPLETE);
    KVT_CHECK(w.waited_us < 5000000); /* not until its timeout (10 s) */
    KVT_EQ(of_holds_all(r.dst, r.h, 2), 2);
    KVT_EQ(kvo_transfer_release(r.p, first), KVO_OK);
    KVT_EQ(kvo_transfer_release(r.p, w.other), KVO_OK);
    kvo_event_release(w.go);
    rig_close(&r);
}

static kvo_verdict later_for_last(void *user, const kvb_hash *hash, uint32_t src_index)
{
    const kvb_hash *last = (const kvb_hash *)user;
    (void)src_index;
    return hash->lo == last->lo && hash->hi == last->hi ? KVO_LATER : KVO_OFFER;
}

/* Presence: a block already offered counts as in flight from its verdict on, for the rest of its own
 * container and for containers evaluated while its container still waits for another block's policy. */
static void test_presence_counts_offers_of_a_pending_container(void)
{
    rig r;
    rig_pools(&r, SRC_BLOCKS, 4);
    kvo_pipeline_config pc = rig_config(&r);
    pc.policy = later_for_last;
    pc.policy_user = &r.h[3];
    rig_start(&r, &pc);
    kvb_weak twice[2] = {r.weak[0], r.weak[0]};
    kvo_transfer d = of_enqueue(r.p, twice, 2, NULL);
    kvo_transfer a = of_enqueue(r.p, &r.weak[1], 3, NULL); /* blocks 1, 2 offered, 3 answered later */
    KVT_EQ(kvo_pipeline_poll(r.p), KVO_OK);
    kvo_transfer b = of_enqueue(r.p, &r.weak[1], 1, NULL); /* block 1 again, while a is pending */
    KVT_EQ(of_pump(r.p, &r.clock, a, 10000, 200), KVO_STATUS_COMPLETE); /* the manual clock moves */
    KVT_EQ(of_pump(r.p, &r.clock, b, 10000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(of_pump(r.p, &r.clock, d, 10000, 200), KVO_STATUS_COMPLETE);
    kvo_transfer_info id = of_info(r.p, d), ia = of_info(r.p, a), ib = of_info(r.p, b);
    KVT_EQ(id.transferred, 1);
    KVT_EQ(id.skipped, 1);
    KVT_EQ(ia.transferred, 2);
    KVT_EQ(ia.timed_out, 1);
    KVT_EQ(ib.transferred, 0);
    KVT_EQ(ib.skipped, 1);
    KVT_EQ(saw(&r, r.weak, 3), 3);
    kvo_transfer_release(r.p, a);
    kvo_transfer_release(r.p, b);
    kvo_transfer_release(r.p, d);
    rig_close(&r);
}

/* A drain from on_done (section 6: callbacks may call back in) waits for everything but the callbacks
 * its own thread is delivering. Before, the pipeline counted the callback calling drain as work in
 * progress, so drain never saw it idle and returned KVO_ETIMEDOUT after its full timeout (for ever
 * with a negative one): in poll mode, in threads mode on the coordinator thread (an inline backend),
 * and on a backend worker's thread alike. The callback here signals the precondition of a second
 * transfer and drains: that one completes inside the drain, which returns at once. */
typedef struct drain_in_done_ctx {
    kvo_pipeline *p;
    kvo_transfer other;
    kvo_event *go;
    atomic_int armed, done;
    int result;
    kvo_transfer_info other_info;
    uint64_t waited_us;
} drain_in_done_ctx;

static void drain_in_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    drain_in_done_ctx *d = (drain_in_done_ctx *)user;
    uint64_t t0 = of_now_us();
    (void)info;
    (void)dst;
    (void)n;
    if (t.id == d->other.id || !atomic_exchange(&d->armed, 0)) return;
    KVT_EQ(kvo_event_signal(d->go), KVO_OK);
    d->result = kvo_pipeline_drain(d->p, 10000000);
    d->waited_us = of_now_us() - t0;
    KVT_EQ(kvo_transfer_get_info(d->p, d->other, &d->other_info), KVO_OK);
    atomic_store(&d->done, 1);
}

static void drain_from_on_done(kvo_mode mode, uint32_t backend_threads)
{
    rig r;
    drain_in_done_ctx d;
    kvo_enqueue_opts o;
    memset(&d, 0, sizeof d);
    memset(&o, 0, sizeof o);
    rig_pools(&r, SRC_BLOCKS, 2);
    if (backend_threads) { /* the wrapper over a memcpy backend with workers: on_done runs on one */
        kvo_backend_destroy(of_backend_iface(r.w));
        kvo_backend_destroy(r.mem);
        KVT_EQ(kvo_memcpy_backend_create(backend_threads, &r.mem), KVO_OK);
        r.w = of_backend_wrap(r.mem);
    }
    kvo_pipeline_config pc = of_config(r.src, r.dst, of_backend_iface(r.w), mode, NULL);
    pc.on_done = drain_in_done;
    pc.done_user = &d;
    pc.min_batch = 1;
    rig_start(&r, &pc);
    d.p = r.p;
    KVT_EQ(kvo_event_create(&d.go), KVO_OK);
    o.precondition = d.go;
    d.other = of_enqueue(r.p, &r.weak[1], 1, &o); /* waits for the event on_done signals */
    atomic_store(&d.armed, 1);
    kvo_transfer first = of_enqueue(r.p, &r.weak[0], 1, NULL);
    uint64_t end = of_now_us() + 30000000;
    while (!atomic_load(&d.done) && of_now_us() < end) { /* the test thread only pumps poll mode */
        if (mode == KVO_MODE_POLL) KVT_EQ(kvo_pipeline_poll(r.p), KVO_OK);
        else of_sleep_us(1000);
    }
    KVT_EQ(atomic_load(&d.done), 1);
    KVT_EQ(d.result, KVO_OK);
    KVT_CHECK(d.waited_us < 5000000); /* not until its timeout (10 s) */
    KVT_EQ(d.other_info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(of_holds_all(r.dst, r.h, 2), 2);
    KVT_EQ(kvo_transfer_release(r.p, first), KVO_OK);
    KVT_EQ(kvo_transfer_release(r.p, d.other), KVO_OK);
    kvo_event_release(d.go);
    rig_close(&r);
}

static void test_drain_from_on_done(void)
{
    drain_from_on_done(KVO_MODE_POLL, 0);
    drain_from_on_done(KVO_MODE_THREADS, 0); /* on the coordinator thread */
    drain_from_on_done(KVO_MODE_THREADS, 2); /* on a worker of the backend */
}

/* Two backend workers each deliver the on_done of their own job, and both callbacks drain at once.
 * Neither may wait for the other's callback to end: the other waits too, so each drain would only end
 * by its timeout (never with a negative one). Nothing else is pending: both drains return KVO_OK at
 * once. */
typedef struct two_drains_ctx {
    kvo_pipeline *p;
    atomic_int entered, finished;
    int result[2];
    uint64_t waited_us[2];
} two_drains_ctx;

static void drain_in_both_dones(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst,
                                size_t n)
{
    two_drains_ctx *d = (two_drains_ctx *)user;
    int me = atomic_fetch_add(&d->entered, 1);
    uint64_t t0 = of_now_us(), end = t0 + 5000000;
    (void)t;
    (void)info;
    (void)dst;
    (void)n;
    if (me > 1) return;
    while (atomic_load(&d->entered) < 2 && of_now_us() < end) of_sleep_us(200); /* both in their callback */
    t0 = of_now_us();
    d->result[me] = kvo_pipeline_drain(d->p, 10000000);
    d->waited_us[me] = of_now_us() - t0;
    atomic_fetch_add(&d->finished, 1);
}

static void test_drains_from_two_on_dones_at_once(void)
{
    rig r;
    two_drains_ctx d;
    memset(&d, 0, sizeof d);
    rig_pools(&r, SRC_BLOCKS, 2);
    kvo_backend_destroy(of_backend_iface(r.w));
    kvo_backend_destroy(r.mem);
    KVT_EQ(kvo_memcpy_backend_create(2, &r.mem), KVO_OK);
    r.w = of_backend_wrap(r.mem);
    kvo_pipeline_config pc = of_config(r.src, r.dst, of_backend_iface(r.w), KVO_MODE_THREADS, NULL);
    pc.on_done = drain_in_both_dones;
    pc.done_user = &d;
    pc.min_batch = 1;
    pc.max_batch = 1;      /* one job per transfer */
    pc.max_concurrent = 2; /* both with the backend at once: one on each worker */
    rig_start(&r, &pc);
    d.p = r.p;
    kvo_transfer a = of_enqueue(r.p, &r.weak[0], 1, NULL), b = of_enqueue(r.p, &r.weak[1], 1, NULL);
    uint64_t end = of_now_us() + 30000000;
    while (atomic_load(&d.finished) < 2 && of_now_us() < end) of_sleep_us(1000);
    KVT_EQ(atomic_load(&d.entered), 2);
    KVT_EQ(atomic_load(&d.finished), 2);
    for (int i = 0; i < 2; i++) {
        KVT_EQ(d.result[i], KVO_OK);
        KVT_CHECK(d.waited_us[i] < 5000000); /* not until its timeout (10 s) */
    }
    KVT_EQ(of_holds_all(r.dst, r.h, 2), 2);
    KVT_EQ(kvo_transfer_release(r.p, a), KVO_OK);
    KVT_EQ(kvo_transfer_release(r.p, b), KVO_OK);
    rig_close(&r);
}

/* Two pipelines whose on_done callbacks, running at once, each drain the other pipeline: each drain
 * would wait for the other's callback, which waits for it. */
typedef struct cross_drains_ctx {
    kvo_pipeline *p[2];
    atomic_int entered, finished;
    int result[2];
    uint64_t waited_us[2];
} cross_drains_ctx;

typedef struct cross_drain_side {
    cross_drains_ctx *c;
    int me;
} cross_drain_side;

static void drain_the_other_pipeline(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst,
                                     size_t n)
{
    cross_drain_side *side = (cross_drain_side *)user;
    cross_drains_ctx *c = side->c;
    uint64_t t0 = of_now_us(), end = t0 + 5000000;
    (void)t;
    (void)info;
    (void)dst;
    (void)n;
    if (atomic_fetch_add(&c->entered, 1) > 1) return;
    while (atomic_load(&c->entered) < 2 && of_now_us() < end) of_sleep_us(200); /* both in their callback */
    t0 = of_now_us();
    c->result[side->me] = kvo_pipeline_drain(c->p[1 - side->me], 10000000);
    c->waited_us[side->me] = of_now_us() - t0;
    atomic_fetch_add(&c->finished, 1);
}

static void test_two_pipelines_draining_each_other_from_on_done(void)
{
    rig r[2];
    cross_drains_ctx c;
    cross_drain_side side[2];
    kvo_transfer t[2];
    memset(&c, 0, sizeof c);
    for (int i = 0; i < 2; i++) {
        side[i] = (cross_drain_side){ &c, i };
        rig_pools(&r[i], SRC_BLOCKS, 1);
        kvo_pipeline_config pc = of_config(r[i].src, r[i].dst, of_backend_iface(r[i].w), KVO_MODE_THREADS, NULL);
        pc.on_done = drain_the_other_pipeline;
        pc.done_user = &side[i];
        pc.min_batch = 1;
        rig_start(&r[i], &pc);
        c.p[i] = r[i].p;
    }
    for (int i = 0; i < 2; i++) t[i] = of_enqueue(r[i].p, &r[i].weak[0], 1, NULL);
    uint64_t end = of_now_us() + 30000000;
    while (atomic_load(&c.finished) < 2 && of_now_us() < end) of_sleep_us(1000);
    KVT_EQ(atomic_load(&c.entered), 2);
    KVT_EQ(atomic_load(&c.finished), 2);
    for (int i = 0; i < 2; i++) {
        KVT_EQ(c.result[i], KVO_OK);
        KVT_CHECK(c.waited_us[i] < 5000000); /* not until its timeout (10 s) */
        KVT_EQ(of_holds_all(r[i].dst, r[i].h, 1), 1);
        KVT_EQ(kvo_transfer_release(r[i].p, t[i]), KVO_OK);
    }
    for (int i = 0; i < 2; i++) rig_close(&r[i]);
}

/* A pipeline destroyed from the on_done of another pipeline while a third thread is inside one of its
 * own callbacks, draining from there: destroy frees what that callback's delivery still uses, so it waits
 * for it whatever it does (a drain from on_done may pass over a callback that drains; destroy may not).
 * P's callback runs on its backend's worker (destroy joins only P's coordinator) and drains Q; Q's
 * callback, on Q's coordinator, destroys P. The destroying callback waits as a drain does, so the drain
 * passes over it (else each would wait for the other, the drain until its timeout, or forever): the
 * drain ends at once, then P's callback, then the destroy. */
typedef struct destroy_ctx {
    kvo_pipeline *p, *q;
    int destroy_first;         /* the destroy starts before the drain (else after) */
    atomic_int p_in, q_in, p_done, q_done, p_done_when_destroyed, drain_result;
    atomic_llong drain_us;
} destroy_ctx;

static void drain_q_from_p(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    destroy_ctx *c = (destroy_ctx *)user;
    uint64_t end = of_now_us() + 5000000;
    (void)t;
    (void)info;
    (void)dst;
    (void)n;
    if (atomic_fetch_add(&c->p_in, 1)) return;
    while (!atomic_load(&c->q_in) && of_now_us() < end) of_sleep_us(200);
    if (c->destroy_first) of_sleep_us(100000); /* Q's callback is in its destroy of P */
    uint64_t t0 = of_now_us();
    atomic_store(&c->drain_result, kvo_pipeline_drain(c->q, 10000000));
    atomic_store(&c->drain_us, (long long)(of_now_us() - t0));
    atomic_store(&c->p_done, 1);
}

static void destroy_p_from_q(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst,
                             size_t n)
{
    destroy_ctx *c = (destroy_ctx *)user;
    uint64_t end = of_now_us() + 5000000;
    (void)t;
    (void)info;
    (void)dst;
    (void)n;
    if (atomic_fetch_add(&c->q_in, 1)) return;
    while (!atomic_load(&c->p_in) && of_now_us() < end) of_sleep_us(200);
    if (!c->destroy_first) of_sleep_us(50000); /* P's callback is in its drain of Q */
    kvo_pipeline_destroy(c->p);
    atomic_store(&c->p_done_when_destroyed, atomic_load(&c->p_done));
    atomic_store(&c->q_done, 1);
}

static void destroy_from_on_done_while_draining(int destroy_first)
{
    rig r[2];
    destroy_ctx c;
    memset(&c, 0, sizeof c);
    c.destroy_first = destroy_first;
    rig_pools(&r[0], SRC_BLOCKS, 1);
    kvo_backend_destroy(of_backend_iface(r[0].w));
    kvo_backend_destroy(r[0].mem);
    KVT_EQ(kvo_memcpy_backend_create(1, &r[0].mem), KVO_OK); /* P's on_done on the backend's worker */
    r[0].w = of_backend_wrap(r[0].mem);
    rig_pools(&r[1], SRC_BLOCKS, 1);
    for (int i = 0; i < 2; i++) {
        kvo_pipeline_config pc = of_config(r[i].src, r[i].dst, of_backend_iface(r[i].w), KVO_MODE_THREADS, NULL);
        pc.on_done = i ? destroy_p_from_q : drain_q_from_p;
        pc.done_user = &c;
        pc.min_batch = 1;
        rig_start(&r[i], &pc);
    }
    c.p = r[0].p;
    c.q = r[1].p;
    (void)of_enqueue(r[0].p, &r[0].weak[0], 1, NULL); /* released by the destroy */
    kvo_transfer tq = of_enqueue(r[1].p, &r[1].weak[0], 1, NULL);
    uint64_t end = of_now_us() + 30000000;
    while (!(atomic_load(&c.q_done) && atomic_load(&c.p_done)) && of_now_us() < end) of_sleep_us(1000);
    KVT_EQ(atomic_load(&c.q_done), 1);
    KVT_EQ(atomic_load(&c.p_done), 1);
    KVT_EQ(atomic_load(&c.p_done_when_destroyed), 1); /* destroy returned after P's callback, not before */
    KVT_EQ(atomic_load(&c.drain_result), KVO_OK);     /* the drain passed over the destroying callback .. */
    KVT_CHECK(atomic_load(&c.drain_us) < 5000000);    /* .. rather than wait for it until its timeout */
    r[0].p = NULL; /* destroyed */
    KVT_EQ(kvo_transfer_release(r[1].p, tq), KVO_OK);
    for (int i = 0; i < 2; i++) rig_close(&r[i]);
}

static void test_destroy_from_on_done_waits_for_a_draining_callback(void) { destroy_from_on_done_while_draining(0); }
static void test_drain_from_on_done_passes_over_a_destroying_callback(void) { destroy_from_on_done_while_draining(1); }

int main(void)
{
    of_watchdog(120);
    KVT_RUN(test_result_strings);
    KVT_RUN(test_create_refuses_bad_config);
    KVT_RUN(test_dst_priority);
    KVT_RUN(test_offload_keeps_source_priority);
    KVT_RUN(test_source_released_during_its_offload_keeps_its_level);
    KVT_RUN(test_offload_is_no_use_of_its_source);
    KVT_RUN(test_batches_fit_the_destination);
    KVT_RUN(test_handles_of_another_pipeline_refused);
    KVT_RUN(test_backend_refuses_blocks_past_the_pool);
    KVT_RUN(test_memcpy_needs_the_same_pages);
    KVT_RUN(test_offload_lands_registered);
    KVT_RUN(test_presence_skips_blocks_in_destination);
    KVT_RUN(test_presence_counts_offers_of_a_pending_container);
    KVT_RUN(test_frequency_policy);
    KVT_RUN(test_user_policy_and_timeout);
    KVT_RUN(test_cancel_while_evaluating);
    KVT_RUN(test_cancel_while_waiting_on_precondition);
    KVT_RUN(test_cancel_while_batched);
    KVT_RUN(test_cancel_while_on_deck);
    KVT_RUN(test_cancel_during_the_on_deck_sweep_whole_batch);
    KVT_RUN(test_cancel_during_the_on_deck_sweep_batch_lives_on);
    KVT_RUN(test_cancel_by_shared_token);
    KVT_RUN(test_cancel_after_upgrade_completes);
    KVT_RUN(test_finished_cancelled_and_released_handles);
    KVT_RUN(test_enqueue_of_nothing);
    KVT_RUN(test_enqueue_of_too_many);
    KVT_RUN(test_enqueue_with_cancelled_token);
    KVT_RUN(test_wait_in_poll_mode);
    KVT_RUN(test_stale_weak_refs_are_dropped);
    KVT_RUN(test_precondition_gates_the_copy);
    KVT_RUN(test_precondition_timeout_fails);
    KVT_RUN(test_drain_waits_for_a_manual_clock);
    KVT_RUN(test_custom_precondition_events);
    KVT_RUN(test_wait_on_custom_events);
    KVT_RUN(test_backend_failure_mid_batch);
    KVT_RUN(test_lost_source_dropped);
    KVT_RUN(test_backend_refuses_job);
    KVT_RUN(test_dest_full_counts_transfers);
    KVT_RUN(test_in_flight_blocks_include_the_backends_jobs);
    KVT_RUN(test_backend_refusal_reason_reported);
    KVT_RUN(test_message_of_a_code_kvoffload_does_not_name);
    KVT_RUN(test_priority_order);
    KVT_RUN(test_on_done_once_with_destination_handles);
    KVT_RUN(test_wait_and_cancel_while_on_done_releases);
    KVT_RUN(test_wait_from_on_done_in_threads_mode);
    KVT_RUN(test_drain_from_on_done);
    KVT_RUN(test_drains_from_two_on_dones_at_once);
    KVT_RUN(test_two_pipelines_draining_each_other_from_on_done);
    KVT_RUN(test_destroy_from_on_done_waits_for_a_draining_callback);
    KVT_RUN(test_drain_from_on_done_passes_over_a_destroying_callback);
    return kvt_summary();
}
