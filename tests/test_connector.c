/* The connector of kvsched.h used directly, the way an engine with its own scheduler and worker would
 * (manual section 4): the scheduler side asks for lower-tier hits after the device prefix, takes them,
 * builds the step's metadata; the worker side binds it, starts loads and stores and reports what
 * finished; the scheduler side accounts it. Loads land registered in the device pool with the host's
 * bytes; eager stores of newly registered device blocks land in the host; lazy mode plans no stores;
 * dropped and finished plans load nothing; nothing stays pinned or pending. */
#include "oom_hooks.h" /* disarmed unless a test arms it */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "kvtest.h"
#include "sched_fixtures.h"

typedef struct rig {
    sf_env e;                 /* pools and manager only (no scheduler: the test is the scheduler) */
    kvs_connector *c;
    of_backend *spy;          /* with spy_down: the G1 -> G2 backend, which can hold jobs */
} rig;

/* How a rig differs from rig_open's: pipeline mode and on_stage observer; spy_down: G1 -> G2 copies go
 * through the test backend (r->spy), two jobs at once; device_eviction: the device pool's policy (FOL: a
 * fixed step, tails first); the pools' sizes (0: 16 device blocks, 32 host blocks). */
typedef struct rig_opts {
    kvo_mode pipeline_mode;
    kvo_stage_fn on_stage;
    void *stage_user;
    int spy_down;
    kvb_evict_policy device_eviction;
    uint32_t device_blocks, host_blocks;
    uint32_t copy_threads;    /* the memcpy backend's workers (0: copies inline) */
} rig_opts;

/* The pools, a manager over them and the connector. */
static void rig_open_ex(rig *r, kvs_offload_mode mode, const rig_opts *o)
{
    sf_env *e = &r->e;
    kvo_manager_config mc;
    kvb_layout layout;
    kvs_connector_config cc;
    memset(r, 0, sizeof *r);
    KVT_EQ(kvs_model_preset(KVS_MODEL_TINY, KVB_LAYOUT_BLOCK_CONTIGUOUS, &e->block_tokens, &layout), KVS_OK);
    e->layers = layout.num_layers;
    e->page_bytes = layout.page_bytes;
    e->token_bytes = layout.page_bytes / e->block_tokens;
    e->o.device_memory = 1;
    e->dev = sf__pool(o->device_blocks ? o->device_blocks : 16, 1, KVB_LAYOUT_BLOCK_CONTIGUOUS, 0);
    if (o->device_eviction) { /* the same pool under another policy */
        kvb_pool_config dc;
        KVT_EQ(kvb_pool_get_config(e->dev, &dc), KVB_OK);
        kvb_pool_destroy(e->dev);
        dc.eviction = o->device_eviction;
        dc.fol_class_step = 1000;
        KVT_EQ(kvb_pool_create(&dc, &e->dev), KVB_OK);
    }
    e->host = sf__pool(o->host_blocks ? o->host_blocks : 32, 1, KVB_LAYOUT_LAYER_SEPARATE, 1);
    KVT_EQ(kvo_memcpy_backend_create(o->copy_threads, &e->mem), KVO_OK);
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 2;
    mc.pools[0] = e->dev;
    mc.pools[1] = e->host;
    mc.down[0] = e->mem;
    mc.up[1] = e->mem;
    if (o->spy_down) {
        r->spy = of_backend_wrap(e->mem);
        mc.down[0] = of_backend_iface(r->spy);
        mc.pipeline.max_concurrent = 2;
    }
    mc.offload = mode == KVS_OFFLOAD_LAZY ? KVO_OFFLOAD_LAZY : KVO_OFFLOAD_EAGER;
    mc.lazy_reserve = 4;
    mc.pipeline.mode = o->pipeline_mode;
    mc.pipeline.on_stage = o->on_stage;
    mc.pipeline.stage_user = o->stage_user;
    mc.pipeline.min_batch = 1;
    KVT_EQ(kvo_manager_create(&mc, &e->m), KVO_OK);
    memset(&cc, 0, sizeof cc);
    cc.device = e->dev;
    cc.tiers = e->m;
    cc.offload = mode;
    KVT_EQ(kvs_connector_create(&cc, &r->c), KVS_OK);
}

static void rig_open(rig *r, kvs_offload_mode mode) { rig_open_ex(r, mode, &(rig_opts){.pipeline_mode = KVO_MODE_POLL}); }

static void rig_close(rig *r)
{
    sf_env *e = &r->e;
    KVT_EQ(kvo_manager_drain(e->m, 5000000), KVO_OK);
    kvs_connector_destroy(r->c);
    kvo_manager_destroy(e->m);
    KVT_EQ(of_active(e->dev), 0);
    KVT_EQ(of_active(e->host), 0);
    OF_CHECK_POOL(e->dev);
    OF_CHECK_POOL(e->host);
    if (r->spy) kvo_backend_destroy(of_backend_iface(r->spy));
    kvo_backend_destroy(e->mem);
    kvb_pool_destroy(e->dev);
    kvb_pool_destroy(e->host);
}

/* Writes the model's bytes of tokens [16k, 16k + 16) into a device or host block. */
static void fill_block(sf_env *e, kvb_pool *pool, kvb_block b, const uint32_t *tokens, size_t k)
{
    for (uint32_t layer = 0; layer < e->layers; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            unsigned char *page = NULL;
            KVT_EQ(kvb_block_data(pool, b, layer, part, (void **)&page), KVB_OK);
            if (!page) return;
            for (size_t slot = 0; slot < e->block_tokens; slot++) {
                size_t pos = k * e->block_tokens + slot;
                for (size_t j = 0; j < e->token_bytes; j++)
                    page[slot * e->token_bytes + j] = sf_kv_byte(tokens[pos], pos, layer, part, j);
            }
        }
}

/* Puts blocks 0 .. n-1 of `tokens` into the host, registered under their hashes with their bytes. */
/* Two computed device blocks of a 32-token prompt (tokens of seed 4 in u, chained hashes in hu),
 * registered and held: what a request leaves for the connector to store. */
static void register_computed_pair(sf_env *e, uint32_t u[32], kvb_hash hu[2], kvb_block held[2])
{
    kvb_hash parents[2];
    kvb_block b[2];
    size_t n = 0;
    sf_tokens(4, u, 32);
    KVT_EQ(kvb_hash_prompt(u, 32, 16, NULL, 0, 0, hu, 2, &n), KVB_OK);
    KVT_EQ(kvb_alloc(e->dev, 2, b), KVB_OK);
    memset(&parents[0], 0, sizeof parents[0]);
    parents[1] = hu[0];
    for (size_t k = 0; k < 2; k++) fill_block(e, e->dev, b[k], u, k);
    KVT_EQ(kvb_register_hashed(e->dev, b, 2, hu, parents, held), KVB_OK);
}

static void seed_host(sf_env *e, const uint32_t *tokens, const kvb_hash *h, size_t n)
{
    kvb_block *b = calloc(n, sizeof *b), *out = calloc(n, sizeof *out);
    kvb_hash *parents = calloc(n, sizeof *parents); /* block 0's: the root (zero) */
    KVT_CHECK(b && out && parents);
    KVT_EQ(kvb_alloc(e->host, n, b), KVB_OK);
    for (size_t i = 0; i < n; i++) {
        fill_block(e, e->host, b[i], tokens, i);
        if (i) parents[i] = h[i - 1];
    }
    KVT_EQ(kvb_register_hashed(e->host, b, n, h, parents, out), KVB_OK);
    KVT_EQ(kvb_release(e->host, out, n, NULL), KVB_OK);
    free(b);
    free(out);
    free(parents);
}

/* A rig (eager) whose host holds the 4 blocks (hashes h) of a 64-token prompt t (seed 3). */
static void open_with_prompt_on_host(rig *r, uint32_t *t, kvb_hash *h)
{
    size_t n = 0;
    rig_open(r, KVS_OFFLOAD_EAGER);
    sf_tokens(3, t, 64);
    KVT_EQ(kvb_hash_prompt(t, 64, 16, NULL, 0, 0, h, 4, &n), KVB_OK);
    seed_host(&r->e, t, h, 4);
}

static int contains(const uint64_t *a, size_t n, uint64_t x)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] == x) return 1;
    return 0;
}

/* Worker loop: get_finished / update_output until the loads of `request` (if any) and every store event
 * of `events` were reported. Returns 1 when everything was seen. */
static int pump(rig *r, uint64_t request, const uint64_t *events, size_t nev)
{
    int load_done = request == 0;
    size_t seen = 0;
    uint8_t got[64];
    memset(got, 0, sizeof got);
    for (int i = 0; i < 100 && (!load_done || seen < nev); i++) {
        kvs_worker_output out;
        memset(&out, 0, sizeof out);
        KVT_EQ(kvo_manager_drain(r->e.m, 5000000), KVO_OK);
        KVT_EQ(kvs_connector_get_finished(r->c, &out), KVS_OK);
        if (request && contains(out.finished_loads, out.num_finished_loads, request)) load_done = 1;
        for (size_t k = 0; k < nev && k < 64; k++)
            if (!got[k] && contains(out.finished_stores, out.num_finished_stores, events[k])) {
                got[k] = 1;
                seen++;
            }
        KVT_EQ(kvs_connector_update_output(r->c, &out), KVS_OK);
    }
    return load_done && seen == nev;
}

/* Scheduler side asks, takes, plans; worker side loads; the device then holds the host's blocks. Then
 * the request's own two new blocks are stored eagerly. */
static void test_load_then_store(void)
{
    rig r;
    uint32_t t[96], other[48];
    kvb_hash h[6], ho[3];
    size_t n = 0, tokens = 0;
    int async = -1;
    rig_open(&r, KVS_OFFLOAD_EAGER);
    sf_tokens(1, t, 96);
    sf_tokens(2, other, 48);
    KVT_EQ(kvb_hash_prompt(t, 96, 16, NULL, 0, 0, h, 6, &n), KVB_OK);
    KVT_EQ(kvb_hash_prompt(other, 48, 16, NULL, 0, 0, ho, 3, &n), KVB_OK);
    seed_host(&r.e, t, h, 4);

    /* matched tokens: the host's 4 blocks, after whatever the device already had */
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 7, h, 6, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(async, 1);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 7, h, 6, 16, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 48);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 7, h, 6, 64, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 0);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 8, ho, 3, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 0);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 7, h, 6, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 7, 8), KVS_EINVAL);    /* not a whole block */
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 7, 1000), KVS_EINVAL); /* more than offered */
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 7, 64), KVS_OK);

    kvs_connector_meta meta;
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 1);
    KVT_EQ(meta.num_stores, 0);
    if (meta.num_loads == 1) {
        KVT_EQ(meta.loads[0].request, 7);
        KVT_EQ(meta.loads[0].tier, 1);
        KVT_EQ(meta.loads[0].first_block, 0);
        KVT_EQ(meta.loads[0].num_blocks, 4);
    }
    if (meta.num_loads == 1) { /* a load past the request's plan (6 hashes) is refused, and nothing bound */
        kvs_load bad[2] = {meta.loads[0], meta.loads[0]};
        kvs_connector_meta wrong = meta;
        bad[1].first_block = 4;
        bad[1].num_blocks = 3;
        wrong.loads = bad;
        wrong.num_loads = 2;
        KVT_EQ(kvs_connector_bind_meta(r.c, &wrong), KVS_EINVAL);
        bad[1].first_block = UINT32_MAX;
        bad[1].num_blocks = 2;
        KVT_EQ(kvs_connector_bind_meta(r.c, &wrong), KVS_EINVAL);
        KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK);
        kvo_manager_stats ms;
        KVT_EQ(kvo_manager_get_stats(r.e.m, &ms), KVO_OK);
        KVT_EQ(ms.up[1].enqueued, 0);          /* nothing started */
        KVT_EQ(kvs_connector_pending(r.c), 1); /* the load built, still to come */
    }
    KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK);
    KVT_CHECK(kvs_connector_pending(r.c) >= 1); /* started, not reported yet */
    /* while they are on their way the plan stays: asking again or dropping it is refused */
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 7, h, 6, 0, &tokens, &async), KVS_ESTATE);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 7, 0), KVS_ESTATE);
    KVT_EQ(kvs_connector_start_stores(r.c), KVS_OK); /* nothing to store this step */
    KVT_CHECK(pump(&r, 7, NULL, 0));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    /* the device pool holds them, registered, with the host's bytes */
    KVT_EQ(of_present(r.e.dev, h, 4), 4);
    for (size_t k = 0; k < 4; k++) KVT_EQ(sf_pool_holds(&r.e, r.e.dev, h[k], t, k), 1);
    int keep = -1;
    KVT_EQ(kvs_connector_request_finished(r.c, 7, &keep), KVS_OK);
    KVT_EQ(keep, 0);

    /* the request (as the engine's sequence) reuses them and computes 2 more blocks */
    kvb_seq *seq = NULL;
    size_t cached = 0, nt = 0;
    const kvb_block *table = NULL;
    KVT_EQ(kvb_seq_create(r.e.dev, NULL, &seq), KVB_OK);
    KVT_EQ(kvb_seq_append(seq, t, 96, &cached), KVB_OK);
    KVT_EQ(cached, 64);
    KVT_EQ(kvb_seq_blocks(seq, &table, &nt), KVB_OK);
    KVT_EQ(nt, 6);
    for (size_t k = 4; k < 6 && k < nt; k++) fill_block(&r.e, r.e.dev, table[k], t, k);
    KVT_EQ(kvb_seq_commit(seq, 96), KVB_OK);
    KVT_EQ(kvb_seq_blocks(seq, &table, &nt), KVB_OK);
    KVT_EQ(kvs_connector_note_registered(r.c, 9, table + 4, 2), KVS_OK);
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 0);
    KVT_EQ(meta.num_stores, 2);
    uint64_t ev[2] = {0, 0};
    size_t nev = 0; /* distinct events (one may cover both stores) */
    for (size_t i = 0; i < meta.num_stores && i < 2; i++) {
        KVT_EQ(meta.stores[i].request, 9);
        KVT_EQ(meta.stores[i].block.id, table[4 + i].id);
        if (!contains(ev, nev, meta.stores[i].event)) ev[nev++] = meta.stores[i].event;
    }
    KVT_CHECK(nev >= 1);
    KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK);
    KVT_EQ(kvs_connector_start_stores(r.c), KVS_OK);
    KVT_CHECK(kvs_connector_pending(r.c) >= 1);
    KVT_CHECK(pump(&r, 0, ev, nev));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(sf_pool_holds(&r.e, r.e.host, h[4], t, 4), 1);
    KVT_EQ(sf_pool_holds(&r.e, r.e.host, h[5], t, 5), 1);
    KVT_EQ(kvs_connector_request_finished(r.c, 9, &keep), KVS_OK);
    KVT_EQ(keep, 0);
    /* the stores held no reference: the sequence's end leaves nothing pinned */
    kvb_seq_destroy(seq);
    KVT_EQ(of_active(r.e.dev), 0);
    KVT_EQ(of_active(r.e.host), 0);
    /* the next plan is empty */
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 0);
    KVT_EQ(meta.num_stores, 0);
    rig_close(&r);
}

/* The connector destroyed while its loads are on their way (started, never reported): their transfers
 * are released with it, and the blocks they brought to the device are not left referenced. */
static void test_destroy_with_loads_in_flight(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    size_t tokens = 0;
    int async = -1;
    open_with_prompt_on_host(&r, t, h);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 5, h, 4, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 64), KVS_OK);
    kvs_connector_meta meta;
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 1);
    KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK);
    KVT_CHECK(kvs_connector_pending(r.c) >= 1);
    KVT_EQ(kvo_manager_drain(r.e.m, 5000000), KVO_OK); /* landed, held for the connector */
    KVT_CHECK(of_active(r.e.dev) > 0);
    kvs_connector_destroy(r.c);
    r.c = NULL;
    KVT_EQ(of_active(r.e.dev), 0); /* given back: registered, so still cached */
    KVT_EQ(of_present(r.e.dev, h, 4), 4);
    rig_close(&r); /* destroying NULL is a no-op; the pools end with nothing referenced */
}

/* Plans dropped (update_state_after_alloc with 0) or abandoned (request_finished before the step) load
 * nothing; nothing stays pending. */
static void test_dropped_plans(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    size_t tokens = 0;
    int async = 0, keep = -1;
    kvs_connector_meta meta;
    open_with_prompt_on_host(&r, t, h);

    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 1, h, 4, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 1, 0), KVS_OK);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 2, h, 4, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 2, 32), KVS_OK); /* takes only 2 of the 4 blocks */
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 3, h, 4, 0, &tokens, &async), KVS_OK);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 3, 64), KVS_OK);
    KVT_EQ(kvs_connector_request_finished(r.c, 3, &keep), KVS_OK);
    KVT_EQ(keep, 0);

    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 1);
    if (meta.num_loads == 1) {
        KVT_EQ(meta.loads[0].request, 2);
        KVT_EQ(meta.loads[0].first_block, 0);
        KVT_EQ(meta.loads[0].num_blocks, 2);
    }
    KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK);
    KVT_CHECK(pump(&r, 2, NULL, 0));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(of_present(r.e.dev, h, 4), 2);
    KVT_EQ(kvs_connector_request_finished(r.c, 2, &keep), KVS_OK);
    KVT_EQ(kvs_connector_request_finished(r.c, 1, &keep), KVS_OK);
    KVT_EQ(of_active(r.e.dev), 0);
    rig_close(&r);
}

/* Lazy: newly registered blocks are not planned as stores. */
static void test_lazy_plans_no_stores(void)
{
    rig r;
    uint32_t t[32];
    kvb_block b[2], out[2];
    kvb_hash h[2];
    size_t n = 0;
    kvs_connector_meta meta;
    rig_open(&r, KVS_OFFLOAD_LAZY);
    sf_tokens(4, t, 32);
    KVT_EQ(kvb_hash_prompt(t, 32, 16, NULL, 0, 0, h, 2, &n), KVB_OK);
    KVT_EQ(kvb_alloc(r.e.dev, 2, b), KVB_OK);
    kvb_hash parents[2];
    memset(&parents[0], 0, sizeof parents[0]);
    parents[1] = h[0];
    KVT_EQ(kvb_register_hashed(r.e.dev, b, 2, h, parents, out), KVB_OK);
    KVT_EQ(kvs_connector_note_registered(r.c, 5, out, 2), KVS_OK);
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_stores, 0);
    KVT_EQ(meta.num_loads, 0);
    KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_stores(r.c), KVS_OK);
    KVT_CHECK(pump(&r, 0, NULL, 0));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(of_present(r.e.host, h, 2), 0);
    KVT_EQ(kvb_release(r.e.dev, out, 2, NULL), KVB_OK);
    rig_close(&r);
}

static void test_connector_bad_input(void)
{
    rig r;
    size_t tokens = 0;
    int async = 0;
    kvb_hash h = {1, 2};
    kvs_worker_output out;
    rig_open(&r, KVS_OFFLOAD_EAGER);
    KVT_EQ(kvs_connector_create(NULL, &r.c), KVS_EINVAL);
    kvs_connector_config cc;
    kvs_connector *second = NULL;
    memset(&cc, 0, sizeof cc);
    cc.device = r.e.dev;
    cc.tiers = r.e.m;
    KVT_EQ(kvs_connector_create(&cc, &second), KVS_EINVAL); /* the manager reports to r.c already */
    KVT_CHECK(second == NULL);
    kvs_connector_destroy(r.c); /* gives the hook back: another may take it */
    r.c = NULL;
    KVT_EQ(kvs_connector_create(&cc, &r.c), KVS_OK);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(NULL, 1, &h, 1, 0, &tokens, &async), KVS_EINVAL);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 1, NULL, 1, 0, &tokens, &async), KVS_EINVAL);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 1, &h, 1, 0, NULL, &async), KVS_EINVAL);
    KVT_EQ(kvs_connector_build_meta(r.c, NULL), KVS_EINVAL);
    KVT_EQ(kvs_connector_bind_meta(r.c, NULL), KVS_EINVAL);
    KVT_EQ(kvs_connector_update_output(r.c, NULL), KVS_EINVAL);
    KVT_EQ(kvs_connector_get_finished(r.c, NULL), KVS_EINVAL);
    KVT_EQ(kvs_connector_note_registered(r.c, 1, NULL, 1), KVS_EINVAL);
    memset(&out, 0, sizeof out);
    KVT_EQ(kvs_connector_get_finished(r.c, &out), KVS_OK);
    KVT_EQ(out.num_finished_loads, 0);
    KVT_EQ(out.num_finished_stores, 0);
    KVT_EQ(kvs_connector_pending(r.c), 0);
    rig_close(&r);
}

/* The scheduler side asks for request `req`'s hits after `computed` tokens (expecting `expect` tokens)
 * and takes them all. */
static void ask_take(rig *r, uint64_t req, const kvb_hash *h, size_t nh, size_t computed, size_t expect)
{
    size_t tokens = 0;
    int async = 0;
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r->c, req, h, nh, computed, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, expect);
    KVT_EQ(kvs_connector_update_state_after_alloc(r->c, req, tokens), KVS_OK);
}

/* One step of both sides: build the metadata, bind it, start its loads and stores. */
static void start_step(rig *r, kvs_connector_meta *meta)
{
    memset(meta, 0, sizeof *meta);
    KVT_EQ(kvs_connector_build_meta(r->c, meta), KVS_OK);
    KVT_EQ(kvs_connector_bind_meta(r->c, meta), KVS_OK);
    KVT_EQ(kvs_connector_start_loads(r->c), KVS_OK);
    KVT_EQ(kvs_connector_start_stores(r->c), KVS_OK);
}

/* The host's copies evicted between the match and the load: the load lands nothing (a miss), the
 * request is still reported, nothing stays referenced. (Its plan had never kept a device block: the
 * empty landing was once copied into a NULL array, undefined behaviour that UBSan stopped on.) */
static void test_load_of_evicted_blocks(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    kvb_block all[32];
    kvs_connector_meta meta;
    open_with_prompt_on_host(&r, t, h);
    ask_take(&r, 5, h, 4, 0, 64);
    KVT_EQ(kvb_alloc(r.e.host, 32, all), KVB_OK); /* the whole host: its 4 cached blocks are evicted */
    KVT_EQ(kvb_release(r.e.host, all, 32, NULL), KVB_OK);
    KVT_EQ(of_present(r.e.host, h, 4), 0);
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 1);
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(of_present(r.e.dev, h, 4), 0);
    KVT_EQ(of_active(r.e.dev), 0);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    rig_close(&r);
}

/* A 64-token prompt (4 blocks of 16) whose block 0 the device holds (a reference in *held) and blocks
 * 1 .. 3 the host; request 5 asks with num_computed 0. */
static void offer_with_device_block_0(rig *r, kvb_hash *h, kvb_block *held, size_t *tokens, int *async)
{
    uint32_t t[64];
    kvb_hash zero;
    kvb_block b;
    size_t n = 0;
    rig_open(r, KVS_OFFLOAD_EAGER);
    sf_tokens(3, t, 64);
    KVT_EQ(kvb_hash_prompt(t, 64, 16, NULL, 0, 0, h, 4, &n), KVB_OK);
    seed_host(&r->e, t, h, 4);
    memset(&zero, 0, sizeof zero);
    KVT_EQ(kvb_alloc(r->e.dev, 1, &b), KVB_OK);
    KVT_EQ(kvb_register_hashed(r->e.dev, &b, 1, h, &zero, held), KVB_OK);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r->c, 5, h, 4, 0, tokens, async), KVS_OK);
}

/* The blocks right after num_computed are on the device already (the engine's own prefix count is
 * behind the pool's, e.g. another request's load just landed there): the offer counts them, and taking
 * part of it loads only what lies within the part taken. */
static void test_take_part_after_device_blocks(void)
{
    rig r;
    kvb_hash h[4];
    kvb_block held;
    size_t tokens = 0;
    int async = 0;
    kvs_connector_meta meta;
    offer_with_device_block_0(&r, h, &held, &tokens, &async);
    KVT_EQ(tokens, 64); /* block 0 on the device, 1 .. 3 in the host */
    KVT_EQ(async, 1);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 32), KVS_OK); /* blocks 0 and 1 */
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 1);
    if (meta.num_loads == 1) {
        KVT_EQ(meta.loads[0].first_block, 1);
        KVT_EQ(meta.loads[0].num_blocks, 1); /* block 1 only: block 2 was not taken */
    }
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(of_present(r.e.dev, h, 4), 2);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    KVT_EQ(kvb_release(r.e.dev, &held, 1, NULL), KVB_OK);
    rig_close(&r);
}

/* An offer that must be loaded (async), of which the scheduler takes only blocks already on the device:
 * nothing is left to load, and the request is still reported, so an engine waiting for its loads goes
 * on. */
static void test_take_only_device_part_of_async_offer(void)
{
    rig r;
    kvb_hash h[4];
    kvb_block held;
    size_t tokens = 0;
    int async = 0;
    kvs_connector_meta meta;
    offer_with_device_block_0(&r, h, &held, &tokens, &async);
    KVT_EQ(tokens, 64);
    KVT_EQ(async, 1);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 16), KVS_OK); /* block 0: on the device */
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 0);
    KVT_CHECK(pump(&r, 5, NULL, 0)); /* reported all the same */
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(of_present(r.e.dev, h, 4), 1);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    KVT_EQ(kvb_release(r.e.dev, &held, 1, NULL), KVB_OK);
    rig_close(&r);
}

/* Asking again replaces the plan, also when the new answer is 0 because num_computed now covers every
 * hash: the taken plan is not loaded behind the new answer's back. While loads are on their way the
 * question is refused whatever num_computed is. */
static void test_ask_again_past_the_hashes(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    size_t tokens = 9;
    int async = 9;
    kvs_connector_meta meta;
    open_with_prompt_on_host(&r, t, h);
    ask_take(&r, 5, h, 4, 0, 64);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 5, h, 4, 64, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 0);
    KVT_EQ(async, 0);
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 0); /* the answer was 0: nothing is loaded */
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(of_present(r.e.dev, h, 4), 0);

    ask_take(&r, 5, h, 4, 0, 64);
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 1);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 5, h, 4, 64, &tokens, &async), KVS_ESTATE);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 5, h, 0, 0, &tokens, &async), KVS_ESTATE);
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    rig_close(&r);
}

/* num_computed inside a block (20 of a 64-token prompt whose 4 blocks the host holds): the offer counts
 * from num_computed itself, so num_computed + offer ends with the hashes (64), never past them; what is
 * taken must end on a block boundary (whole blocks load: block 1, whose first 4 tokens were computed, is
 * loaded whole). */
static void test_offer_from_inside_a_block(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    size_t tokens = 0;
    int async = 0;
    kvs_connector_meta meta;
    open_with_prompt_on_host(&r, t, h);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 5, h, 4, 20, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 44); /* tokens 20 .. 63 */
    KVT_EQ(async, 1);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 48), KVS_EINVAL); /* past the offer */
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 16), KVS_EINVAL); /* 36: inside block 2 */
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 12), KVS_OK);     /* up to 32: block 1 */
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 1);
    if (meta.num_loads == 1) {
        KVT_EQ(meta.loads[0].first_block, 1);
        KVT_EQ(meta.loads[0].num_blocks, 1);
    }
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(of_present(r.e.dev, h, 4), 1); /* block 1 only */
    KVT_EQ(of_has(r.e.dev, h[1]), 1);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    rig_close(&r);
}

/* A step's metadata never bound (the engine built it and dropped it), then the next one bound twice and
 * started twice: what the first one held is not lost (the next build repeats what was not started, so
 * the request's loads are still done and reported, and the stores still go down), and nothing is
 * started twice. Meanwhile pending counts it all. */
static void test_meta_not_bound_then_bound_twice(void)
{
    rig r;
    uint32_t t[64], u[32];
    kvb_hash h[4], hu[2];
    kvb_block held[2];
    size_t n = 0;
    kvs_connector_meta meta;
    kvo_manager_stats ms;
    rig_open(&r, KVS_OFFLOAD_EAGER);
    sf_tokens(3, t, 64);
    KVT_EQ(kvb_hash_prompt(t, 64, 16, NULL, 0, 0, h, 4, &n), KVB_OK);
    seed_host(&r.e, t, h, 4);
    register_computed_pair(&r.e, u, hu, held); /* of another request, to store */
    KVT_EQ(kvs_connector_note_registered(r.c, 9, held, 2), KVS_OK);
    ask_take(&r, 5, h, 4, 0, 64);

    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK); /* never bound */
    KVT_EQ(meta.num_loads, 1);
    KVT_EQ(meta.num_stores, 2);
    uint64_t load_event = meta.num_loads ? meta.loads[0].event : 0;
    uint64_t store_event = meta.num_stores ? meta.stores[0].event : 0;
    KVT_EQ(kvs_connector_pending(r.c), 3); /* 1 load, 2 stores, none reported */

    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 1); /* the same load again */
    KVT_EQ(meta.num_stores, 2);
    if (meta.num_loads == 1) KVT_EQ(meta.loads[0].event, load_event);
    if (meta.num_stores == 2) KVT_EQ(meta.stores[0].event, store_event);
    for (int twice = 0; twice < 2; twice++) {
        KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
        KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK);
        KVT_EQ(kvs_connector_start_stores(r.c), KVS_OK);
    }
    KVT_CHECK(pump(&r, 5, &store_event, 1));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(kvo_manager_get_stats(r.e.m, &ms), KVO_OK);
    KVT_EQ(ms.up[1].enqueued, 1);     /* one onboard of the 4 blocks, not two */
    KVT_EQ(ms.up[1].transferred, 4);
    KVT_EQ(ms.up[1].present, 0);
    KVT_EQ(ms.down[0].enqueued, 1);   /* one offer of the 2 blocks */
    KVT_EQ(ms.down[0].transferred, 2);
    KVT_EQ(of_present(r.e.dev, h, 4), 4);
    for (size_t k = 0; k < 2; k++) KVT_EQ(sf_pool_holds(&r.e, r.e.host, hu[k], u, k), 1);
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK); /* everything started: nothing repeated */
    KVT_EQ(meta.num_loads, 0);
    KVT_EQ(meta.num_stores, 0);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    KVT_EQ(kvb_release(r.e.dev, held, 2, NULL), KVB_OK);
    rig_close(&r);
}

/* An on_stage observer that stalls the pipeline thread finishing a store (an offload from G1) for 0.3 s,
 * once armed; `entered` says it is there. Relaxed atomics: they order nothing for ThreadSanitizer. */
typedef struct stall { int armed, entered; } stall;

static void stall_finished_store(void *user, const kvo_stage_note *note)
{
    stall *st = (stall *)user;
    if (note->onboard || note->src_tier != 0 || note->info->status < KVO_STATUS_COMPLETE) return;
    if (!__atomic_load_n(&st->armed, __ATOMIC_RELAXED)) return;
    __atomic_store_n(&st->entered, 1, __ATOMIC_RELAXED);
    of_sleep_us(300000);
}

/* The connector destroyed (no drain: pipelines in thread mode) while a pipeline thread is finishing one of
 * its stores: that thread then tells the manager's on_offloaded hook, which the destroy took back. The
 * hook must not be read while it is replaced, nor called with the freed connector: under ThreadSanitizer
 * the hook's replacement and its call were a data race (kvo_manager_set_offloaded against
 * kvo__manager_down_done); a thread that read the hook just before the destroy called it with freed
 * memory. */
static void test_destroy_with_stores_in_flight(void)
{
    rig r;
    stall st = {1, 0};
    uint32_t u[32];
    kvb_hash hu[2];
    kvb_block held[2];
    kvs_connector_meta meta;
    rig_open_ex(&r, KVS_OFFLOAD_EAGER, &(rig_opts){.pipeline_mode = KVO_MODE_THREADS, .on_stage = stall_finished_store, .stage_user = &st});
    register_computed_pair(&r.e, u, hu, held);
    KVT_EQ(kvs_connector_note_registered(r.c, 9, held, 2), KVS_OK);
    start_step(&r, &meta);
    KVT_EQ(meta.num_stores, 2);
    for (int i = 0; i < 5000 && !__atomic_load_n(&st.entered, __ATOMIC_RELAXED); i++) of_sleep_us(1000);
    KVT_EQ(__atomic_load_n(&st.entered, __ATOMIC_RELAXED), 1);
    kvs_connector_destroy(r.c); /* the store's transfer is final, its hook call still to come */
    r.c = NULL;
    KVT_EQ(kvo_manager_drain(r.e.m, 5000000), KVO_OK);
    __atomic_store_n(&st.armed, 0, __ATOMIC_RELAXED);
    KVT_EQ(sf_pool_holds(&r.e, r.e.host, hu[0], u, 0), 1); /* the store itself went on */
    KVT_EQ(kvb_release(r.e.dev, held, 2, NULL), KVB_OK);
    rig_close(&r);
}

/* request_finished on the scheduler's thread while the worker's loads and stores share one backend
 * worker (one memcpy backend with a thread, both directions, as sf_open and tiny_llm share one): the
 * worker finishes a store (held in on_stage until the call has begun) while the request's load waits
 * in the backend's queue behind it. request_finished cancels the load, which waits for the backend's
 * copy; the worker, done with the store, tells the manager's hook (kvs__on_offloaded), which takes the
 * connector's lock. Before, request_finished waited with that lock held: the worker waited for the
 * lock, the load for the worker, and both threads for ever (the call never returned here). */
typedef struct finish_call { kvs_connector *c; int calling, returned; } finish_call;

static void *finish_on_thread(void *arg)
{
    finish_call *f = (finish_call *)arg;
    __atomic_store_n(&f->calling, 1, __ATOMIC_RELAXED);
    KVT_EQ(kvs_connector_request_finished(f->c, 7, NULL), KVS_OK);
    __atomic_store_n(&f->returned, 1, __ATOMIC_RELAXED);
    return NULL;
}

typedef struct store_gate { int armed, entered; finish_call *f; } store_gate;

/* Holds the thread finishing a store (the backend's worker) until request_finished has been called and
 * has had 0.1 s to reach its wait. */
static void gate_finished_store(void *user, const kvo_stage_note *note)
{
    store_gate *g = (store_gate *)user;
    if (note->onboard || note->src_tier != 0 || note->info->status < KVO_STATUS_COMPLETE) return;
    if (!__atomic_load_n(&g->armed, __ATOMIC_RELAXED)) return;
    __atomic_store_n(&g->entered, 1, __ATOMIC_RELAXED);
    for (int i = 0; i < 5000 && !__atomic_load_n(&g->f->calling, __ATOMIC_RELAXED); i++) of_sleep_us(1000);
    of_sleep_us(100000);
}

static void test_request_finished_while_the_backend_finishes_a_store(void)
{
    rig r;
    finish_call f = {NULL, 0, 0};
    store_gate g = {1, 0, &f};
    uint32_t t[64], u[32];
    kvb_hash h[4], hu[2];
    kvb_block held[2];
    size_t n = 0, tokens = 0;
    int async = 0;
    pthread_t th;
    kvs_connector_meta meta;
    kvo_pipeline_stats ps;
    rig_open_ex(&r, KVS_OFFLOAD_EAGER, &(rig_opts){.pipeline_mode = KVO_MODE_THREADS, .copy_threads = 1,
                                                   .on_stage = gate_finished_store, .stage_user = &g});
    f.c = r.c;
    sf_tokens(3, t, 64);
    KVT_EQ(kvb_hash_prompt(t, 64, 16, NULL, 0, 0, h, 4, &n), KVB_OK);
    seed_host(&r.e, t, h, 4);
    register_computed_pair(&r.e, u, hu, held);

    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 7, h, 4, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 7, 64), KVS_OK);
    KVT_EQ(kvs_connector_note_registered(r.c, 9, held, 2), KVS_OK);
    memset(&meta, 0, sizeof meta);
    KVT_EQ(kvs_connector_build_meta(r.c, &meta), KVS_OK);
    KVT_EQ(meta.num_loads, 1);
    KVT_EQ(kvs_connector_bind_meta(r.c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_stores(r.c), KVS_OK); /* the worker copies it, then waits in on_stage */
    for (int i = 0; i < 5000 && !__atomic_load_n(&g.entered, __ATOMIC_RELAXED); i++) of_sleep_us(1000);
    KVT_EQ(__atomic_load_n(&g.entered, __ATOMIC_RELAXED), 1);
    KVT_EQ(kvs_connector_start_loads(r.c), KVS_OK); /* its job waits behind the store's */
    memset(&ps, 0, sizeof ps);
    for (int i = 0; i < 5000 && ps.in_flight_blocks < 4; i++) {
        KVT_EQ(kvo_pipeline_get_stats(kvo_manager_pipeline(r.e.m, 1, 1), &ps), KVO_OK);
        if (ps.in_flight_blocks < 4) of_sleep_us(1000);
    }
    KVT_EQ(ps.in_flight_blocks, 4);
    of_sleep_us(20000); /* from on deck to the backend's queue */
    KVT_EQ(pthread_create(&th, NULL, finish_on_thread, &f), 0);
    for (int i = 0; i < 5000 && !__atomic_load_n(&f.returned, __ATOMIC_RELAXED); i++) of_sleep_us(1000);
    KVT_EQ(__atomic_load_n(&f.returned, __ATOMIC_RELAXED), 1);
    if (!__atomic_load_n(&f.returned, __ATOMIC_RELAXED)) return; /* both threads wait for ever: no cleanup */
    pthread_join(th, NULL);
    __atomic_store_n(&g.armed, 0, __ATOMIC_RELAXED);
    KVT_CHECK(pump(&r, 0, NULL, 0));
    KVT_EQ(kvb_release(r.e.dev, held, 2, NULL), KVB_OK);
    rig_close(&r);
}

/* The manager tells the connector of every G1 -> G2 offload, stores or not (a swap-out, a lazy backing,
 * another caller's offer); the connector keeps the ids to match them with its stores. Ids that match
 * no store were dropped only when no store was pending at get_finished, so with a store always pending
 * (a busy engine) they piled up: here one store stays in the backend while 200 other offloads finish,
 * and the connector's set held 200 ids (it is read directly: nothing public shows it). Now it keeps
 * none of them; the pending store is still reported when it lands. */
static void test_other_offloads_do_not_pile_up(void)
{
    rig r;
    uint32_t u[32], v[16];
    kvb_hash hu[2], hv[1], parents[2];
    kvb_block b[3], held[2], other;
    size_t n = 0;
    kvs_connector_meta meta;
    rig_open_ex(&r, KVS_OFFLOAD_EAGER, &(rig_opts){.pipeline_mode = KVO_MODE_POLL, .spy_down = 1});
    sf_tokens(4, u, 32);
    sf_tokens(5, v, 16);
    KVT_EQ(kvb_hash_prompt(u, 32, 16, NULL, 0, 0, hu, 2, &n), KVB_OK);
    KVT_EQ(kvb_hash_prompt(v, 16, 16, NULL, 0, 0, hv, 1, &n), KVB_OK);
    KVT_EQ(kvb_alloc(r.e.dev, 3, b), KVB_OK);
    memset(&parents[0], 0, sizeof parents[0]);
    parents[1] = hu[0];
    for (size_t k = 0; k < 2; k++) fill_block(&r.e, r.e.dev, b[k], u, k);
    fill_block(&r.e, r.e.dev, b[2], v, 0);
    KVT_EQ(kvb_register_hashed(r.e.dev, b, 2, hu, parents, held), KVB_OK);
    KVT_EQ(kvb_register_hashed(r.e.dev, &b[2], 1, hv, parents, &other), KVB_OK);

    of_backend_set_hold(r.spy, 1); /* the store's job stays in the backend */
    KVT_EQ(kvs_connector_note_registered(r.c, 9, held, 2), KVS_OK);
    start_step(&r, &meta);
    KVT_EQ(meta.num_stores, 2);
    uint64_t store_event = meta.num_stores ? meta.stores[0].event : 0;
    for (int i = 0; i < 20 && !of_backend_held(r.spy); i++) KVT_EQ(kvo_manager_poll(r.e.m), KVO_OK);
    KVT_EQ(of_backend_held(r.spy), 1);
    of_backend_set_hold(r.spy, 0);

    for (int round = 0; round < 200; round++) { /* offloads that are not stores, each reported */
        kvs_worker_output out;
        memset(&out, 0, sizeof out);
        KVT_EQ(kvo_manager_offer(r.e.m, 0, &other, 1, NULL), KVO_OK);
        KVT_EQ(kvs_connector_get_finished(r.c, &out), KVS_OK);
        KVT_EQ(out.num_finished_stores, 0);
        KVT_EQ(kvs_connector_update_output(r.c, &out), KVS_OK);
    }
    kvo_manager_stats ms;
    KVT_EQ(kvo_manager_get_stats(r.e.m, &ms), KVO_OK);
    KVT_EQ(ms.down[0].enqueued, 201);
    KVT_EQ(kvs_connector_pending(r.c), 1); /* the store's event */
    KVT_EQ(r.c->offloaded.used, 0);        /* before: 200 */

    of_backend_release(r.spy);
    KVT_CHECK(pump(&r, 0, &store_event, 1));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(r.c->offloaded.used, 0);
    for (size_t k = 0; k < 2; k++) KVT_EQ(sf_pool_holds(&r.e, r.e.host, hu[k], u, k), 1);
    KVT_EQ(kvb_release(r.e.dev, held, 2, NULL), KVB_OK);
    KVT_EQ(kvb_release(r.e.dev, &other, 1, NULL), KVB_OK);
    rig_close(&r);
}

/* Two connectors created at once on one manager: exactly one gets its hook. Before, each checked that
 * the manager had no hook and then set its own, so both could pass the check, the second replacing the
 * first's hook (whose stores would stay pending for ever). */
typedef struct create_race {
    pthread_barrier_t *go;
    kvs_connector_config cc;
    kvs_connector *c;
    kvs_result r;
} create_race;

static void *create_on_thread(void *arg)
{
    create_race *x = (create_race *)arg;
    pthread_barrier_wait(x->go);
    x->r = kvs_connector_create(&x->cc, &x->c);
    return NULL;
}

static void test_two_connectors_created_at_once(void)
{
    rig r;
    pthread_barrier_t go;
    int both = 0, none = 0;
    rig_open(&r, KVS_OFFLOAD_EAGER);
    kvs_connector_destroy(r.c); /* the manager without a hook */
    r.c = NULL;
    KVT_EQ(pthread_barrier_init(&go, NULL, 2), 0);
    for (int round = 0; round < 1000; round++) {
        create_race x[2];
        pthread_t th[2];
        for (int i = 0; i < 2; i++) {
            memset(&x[i], 0, sizeof x[i]);
            x[i].go = &go;
            x[i].cc.device = r.e.dev;
            x[i].cc.tiers = r.e.m;
            KVT_EQ(pthread_create(&th[i], NULL, create_on_thread, &x[i]), 0);
        }
        for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
        int ok = (x[0].r == KVS_OK) + (x[1].r == KVS_OK);
        both += ok == 2;
        none += ok == 0;
        for (int i = 0; i < 2; i++) {
            if (x[i].r != KVS_OK) KVT_EQ(x[i].r, KVS_EINVAL);
            if (x[i].r != KVS_OK) KVT_CHECK(x[i].c == NULL);
        }
        for (int i = 0; i < 2; i++)
            if (x[i].r == KVS_OK) kvs_connector_destroy(x[i].c); /* gives the hook back */
    }
    KVT_EQ(both, 0);
    KVT_EQ(none, 0);
    pthread_barrier_destroy(&go);
    rig_close(&r);
}


/* A store whose transfer ends while allocation `at` (and with `sticky` every later one) fails: the
 * pipeline may have no memory for its on_done note (then the manager's hook is not called), or the
 * connector's hook none for the transfer's id. The store must still be reported (landed or failed), not
 * stay pending for ever: before, get_finished only ever matched the hook's ids, so the event was never
 * reported and pending stayed 1. Returns whether allocation `at` came. */
static int store_with_lost_hook_call(long at, int sticky)
{
    rig r;
    uint32_t u[32];
    kvb_hash hu[2];
    kvb_block held[2];
    int fired;
    kvs_connector_meta meta;
    rig_open(&r, KVS_OFFLOAD_EAGER);
    register_computed_pair(&r.e, u, hu, held);
    KVT_EQ(kvs_connector_note_registered(r.c, 9, held, 2), KVS_OK);
    start_step(&r, &meta);
    KVT_EQ(meta.num_stores, 2);
    uint64_t store_event = meta.num_stores ? meta.stores[0].event : 0;
    oom_arm(at, sticky);
    (void)kvo_manager_drain(r.e.m, 5000000);
    fired = oom_fired;
    oom_disarm();
    KVT_CHECK(pump(&r, 0, &store_event, 1));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(kvb_release(r.e.dev, held, 2, NULL), KVB_OK);
    rig_close(&r);
    return fired;
}

static void test_store_reported_when_its_hook_call_is_lost(void)
{
    (void)store_with_lost_hook_call(0, 1); /* no memory at all: the pipeline's note is lost */
    for (long at = 0; at < 64 && store_with_lost_hook_call(at, 0); at++) {
    } /* each allocation on its own: the note's, the hook's id map's */
}

/* A take, then a second, larger take of the same offer: the first trimmed the plan to its blocks, so the
 * second cannot be honoured and is refused (KVS_EINVAL, the plan as the first take left it). Before, it
 * returned KVS_OK and the step loaded only the first take's 2 blocks: the engine waited for 64 tokens
 * and was told its loads were done with 2 of the 4 blocks never loaded. */
static void test_second_larger_take_is_refused(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    size_t tokens = 0;
    int async = 0;
    kvs_connector_meta meta;
    open_with_prompt_on_host(&r, t, h);
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(r.c, 5, h, 4, 0, &tokens, &async), KVS_OK);
    KVT_EQ(tokens, 64);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 32), KVS_OK);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 64), KVS_EINVAL); /* more than the plan holds now */
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 32), KVS_OK);     /* the same again is fine */
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 1);
    if (meta.num_loads == 1) {
        KVT_EQ(meta.loads[0].first_block, 0);
        KVT_EQ(meta.loads[0].num_blocks, 2);
    }
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(of_present(r.e.dev, h, 4), 2);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    rig_close(&r);
}

/* A taken async offer whose taken blocks are all on the device: build_meta will report its load done at
 * once, and until then pending counts it, as it counts a taken plan's runs. Before, pending was 0 before
 * build_meta and 1 after it. */
static void test_pending_counts_a_taken_offer_with_nothing_to_load(void)
{
    rig r;
    kvb_hash h[4];
    kvb_block held;
    size_t tokens = 0;
    int async = 0;
    kvs_connector_meta meta;
    offer_with_device_block_0(&r, h, &held, &tokens, &async);
    KVT_EQ(async, 1);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 16), KVS_OK); /* block 0: on the device */
    KVT_EQ(kvs_connector_pending(r.c), 1);
    start_step(&r, &meta);
    KVT_EQ(kvs_connector_pending(r.c), 1);
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(kvs_connector_pending(r.c), 0);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    KVT_EQ(kvb_release(r.e.dev, &held, 1, NULL), KVB_OK);
    rig_close(&r);
}

/* update_output checks its lists as bind_meta checks the metadata's: a count with no list is KVS_EINVAL
 * (it returned KVS_OK). */
static void test_update_output_checks_its_lists(void)
{
    rig r;
    uint64_t one = 1;
    kvs_worker_output out;
    rig_open(&r, KVS_OFFLOAD_EAGER);
    memset(&out, 0, sizeof out);
    out.num_finished_loads = 1;
    KVT_EQ(kvs_connector_update_output(r.c, &out), KVS_EINVAL);
    memset(&out, 0, sizeof out);
    out.num_finished_stores = 1;
    KVT_EQ(kvs_connector_update_output(r.c, &out), KVS_EINVAL);
    out.finished_stores = &one;
    KVT_EQ(kvs_connector_update_output(r.c, &out), KVS_OK);
    rig_close(&r);
}

/* The connector's hold on loaded device blocks (until the request takes them) is no use of them: the
 * request's own match and release are. FOL device (fixed step, tails first): the 2 blocks of a 32-token
 * prompt are loaded from the host for request 5, the engine matches them, the plan goes
 * (request_finished), the engine releases them: each used once, block 1 a tail seen once. Then y, a
 * block of its own, is released once: block 1, older, goes first. Before, the connector's release counted
 * a use too: their counts were 2, block 1's class after every tail, and y went first. */
static void test_loaded_blocks_are_no_use_of_the_connector(void)
{
    rig r;
    uint32_t t[32], ty[16];
    kvb_hash h[2], hy[1];
    size_t n = 0, m = 0, got = 0;
    kvb_block x[2], y, yr;
    kvb_weak order[2];
    kvb_block_info i0, i1;
    kvs_connector_meta meta;
    rig_open_ex(&r, KVS_OFFLOAD_EAGER, &(rig_opts){.pipeline_mode = KVO_MODE_POLL, .device_eviction = KVB_EVICT_FOL});
    sf_tokens(91, t, 32);
    sf_tokens(92, ty, 16);
    KVT_EQ(kvb_hash_prompt(t, 32, 16, NULL, 0, 0, h, 2, &n), KVB_OK);
    KVT_EQ(kvb_hash_prompt(ty, 16, 16, NULL, 0, 0, hy, 1, &n), KVB_OK);
    seed_host(&r.e, t, h, 2);
    ask_take(&r, 5, h, 2, 0, 32);
    start_step(&r, &meta);
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(kvb_match(r.e.dev, h, 2, x, &m), KVB_OK);
    KVT_EQ(m, 2);
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    KVT_EQ(kvb_release(r.e.dev, x, 2, NULL), KVB_OK);
    KVT_EQ(kvb_alloc(r.e.dev, 1, &y), KVB_OK);
    KVT_EQ(kvb_register_hashed(r.e.dev, &y, 1, hy, NULL, &yr), KVB_OK);
    KVT_EQ(kvb_release(r.e.dev, &yr, 1, NULL), KVB_OK);
    KVT_EQ(of_active(r.e.dev), 0);
    KVT_EQ(kvb_eviction_candidates(r.e.dev, 2, order, &got), KVB_OK);
    KVT_EQ(got, 2);
    KVT_EQ(kvb_block_get_info(r.e.dev, order[0].id, &i0), KVB_OK);
    KVT_EQ(kvb_block_get_info(r.e.dev, order[1].id, &i1), KVB_OK);
    KVT_CHECK(i0.hash.lo == h[1].lo && i0.hash.hi == h[1].hi); /* block 1 first, then y */
    KVT_CHECK(i1.hash.lo == hy[0].lo && i1.hash.hi == hy[0].hi);
    rig_close(&r);
}

/* More blocks kept for a request than any earlier call on the device pool took (kvb_unpin's list then
 * needs memory of its own): the plan is dropped with no memory left, and its blocks go back one at a
 * time. The device holds block 33 of a 66-block prompt, so the host's copy is loaded in two runs (33 and
 * 32 blocks, each landing in one call) and the plan keeps 65. Before, kvb_unpin's KVB_ENOMEM was ignored
 * and all 65 stayed pinned for ever. */
#define MANY_LOADED 66
static void test_many_kept_blocks_unpinned_without_memory(void)
{
    rig r;
    uint32_t *t = calloc(MANY_LOADED * 16, sizeof *t);
    kvb_hash h[MANY_LOADED];
    kvb_block b, held;
    size_t n = 0;
    kvs_connector_meta meta;
    kvs_result res;
    rig_open_ex(&r, KVS_OFFLOAD_EAGER, &(rig_opts){.pipeline_mode = KVO_MODE_POLL, .device_blocks = 80,
                                                   .host_blocks = 80});
    sf_tokens(93, t, MANY_LOADED * 16);
    KVT_EQ(kvb_hash_prompt(t, MANY_LOADED * 16, 16, NULL, 0, 0, h, MANY_LOADED, &n), KVB_OK);
    seed_host(&r.e, t, h, MANY_LOADED);
    KVT_EQ(kvb_alloc(r.e.dev, 1, &b), KVB_OK);
    fill_block(&r.e, r.e.dev, b, t, 33);
    KVT_EQ(kvb_register_hashed(r.e.dev, &b, 1, &h[33], &h[32], &held), KVB_OK);
    KVT_EQ(kvb_release(r.e.dev, &held, 1, NULL), KVB_OK);
    ask_take(&r, 5, h, MANY_LOADED, 0, MANY_LOADED * 16);
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 2);
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(of_active(r.e.dev), MANY_LOADED - 1); /* the connector keeps them for the request */
    oom_arm(0, 1);
    res = kvs_connector_request_finished(r.c, 5, NULL);
    oom_disarm();
    KVT_EQ(res, KVS_OK);
    KVT_EQ(of_active(r.e.dev), 0);
    free(t);
    rig_close(&r);
}

/* A take is planned once: asked for again once build_meta planned its loads, it is KVS_ESTATE (before, it
 * was accepted: the next get_finished reported the request's loads finished a second time, and the plan
 * kept the loaded blocks through release_loads, till request_finished). release_loads is KVS_ESTATE while
 * the loads are on their way (it did nothing and said KVS_OK: the blocks that landed were kept on), then
 * lets them go. */
static void test_take_is_planned_once(void)
{
    rig r;
    uint32_t t[64];
    kvb_hash h[4];
    kvs_connector_meta meta;
    kvs_worker_output out;
    open_with_prompt_on_host(&r, t, h);
    ask_take(&r, 5, h, 4, 0, 64);
    KVT_EQ(kvs_connector_release_loads(r.c, 5), KVS_ESTATE); /* taken, not built */
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 1);
    KVT_EQ(kvs_connector_release_loads(r.c, 5), KVS_ESTATE); /* on their way */
    KVT_CHECK(pump(&r, 5, NULL, 0));
    KVT_EQ(of_active(r.e.dev), 4);
    KVT_EQ(kvs_connector_update_state_after_alloc(r.c, 5, 64), KVS_ESTATE);
    KVT_EQ(kvs_connector_pending(r.c), 0);
    start_step(&r, &meta);
    KVT_EQ(meta.num_loads, 0);
    memset(&out, 0, sizeof out);
    KVT_EQ(kvs_connector_get_finished(r.c, &out), KVS_OK);
    KVT_EQ(out.num_finished_loads, 0);
    KVT_EQ(kvs_connector_release_loads(r.c, 5), KVS_OK);
    KVT_EQ(of_active(r.e.dev), 0);
    KVT_EQ(kvs_connector_release_loads(r.c, 5), KVS_OK); /* no plan: nothing to do */
    KVT_EQ(kvs_connector_request_finished(r.c, 5, NULL), KVS_OK);
    rig_close(&r);
}

int main(void)
{
    of_watchdog(60);
    KVT_RUN(test_load_then_store);
    KVT_RUN(test_destroy_with_loads_in_flight);
    KVT_RUN(test_dropped_plans);
    KVT_RUN(test_lazy_plans_no_stores);
    KVT_RUN(test_connector_bad_input);
    KVT_RUN(test_load_of_evicted_blocks);
    KVT_RUN(test_take_part_after_device_blocks);
    KVT_RUN(test_take_only_device_part_of_async_offer);
    KVT_RUN(test_ask_again_past_the_hashes);
    KVT_RUN(test_offer_from_inside_a_block);
    KVT_RUN(test_meta_not_bound_then_bound_twice);
    KVT_RUN(test_destroy_with_stores_in_flight);
    KVT_RUN(test_other_offloads_do_not_pile_up);
    KVT_RUN(test_two_connectors_created_at_once);
    KVT_RUN(test_request_finished_while_the_backend_finishes_a_store);
    KVT_RUN(test_store_reported_when_its_hook_call_is_lost);
    KVT_RUN(test_second_larger_take_is_refused);
    KVT_RUN(test_pending_counts_a_taken_offer_with_nothing_to_load);
    KVT_RUN(test_update_output_checks_its_lists);
    KVT_RUN(test_loaded_blocks_are_no_use_of_the_connector);
    KVT_RUN(test_many_kept_blocks_unpinned_without_memory);
    KVT_RUN(test_take_is_planned_once);
    return kvt_summary();
}
