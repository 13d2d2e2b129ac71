/* tiers.c — one engine's tiers for serve_sim: pools (G1 device, G2 host, G3 disk, G4 Redis), copy
 * backends, the tier manager; transfer totals; the --bytes data patterns */
#include "sim.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- tiers: pools, copy backends, the tier manager ----------------------------------------------- */

/* Metadata-only pools move no bytes: this backend completes every copy at once. */
static int null_submit(kvo_backend *self, kvo_copy_job *job)
{
    size_t i;
    (void)self;
    for (i = 0; i < job->n; i++) job->results[i] = KVO_OK;
    job->bytes = 0;
    job->done(job, KVO_OK, NULL);
    return KVO_OK;
}
static void null_destroy(kvo_backend *self) { (void)self; }

static uint64_t sim_clock_us(void *user) { return (uint64_t)(*(const double *)user * 1e6); }

static void disk_log(void *user, const char *message)
{
    tiers *t = (tiers *)user;
    snprintf(t->disk_note, sizeof t->disk_note, "%s", message);
}

static kvb_pool *make_pool(const options *o, uint32_t blocks, uint32_t tier, kvb_evict_policy ev, kvb_dup_policy dup,
                           int storage, kvb_layout_kind kind, const kvb_layout *layout, kvb_event_fn on_events,
                           void *event_user)
{
    kvb_pool_config pc;
    kvb_pool *p;
    memset(&pc, 0, sizeof pc);
    pc.on_events = on_events;
    pc.event_user = event_user;
    pc.num_blocks = blocks;
    pc.block_tokens = o->block_tokens;
    pc.eviction = ev;
    pc.fol_class_step = o->fol_step;
    pc.fol_ghost = o->fol_ghost;
    pc.duplicates = dup;
    pc.tier = tier;
    if (storage) {
        pc.storage = KVB_STORAGE_HOST;
        pc.layout = *layout;
        pc.layout.kind = kind;
    }
    check_kv(kvb_pool_create(&pc, &p), "creating a pool");
    return p;
}

/* clock: the simulated time (NULL: the real clock). lower = 0: the device pool alone. on_events: the
 * device pool's event callback (may be NULL; it forwards to the bus itself). host_events (may be NULL):
 * the same for the host and disk pools, otherwise theirs go to the bus. bus (may be NULL): the lower
 * pools' block events and every pipeline's transfer stages go there. G4's events always go to the bus:
 * what Redis holds belongs to no engine. */
void open_tiers(tiers *t, const options *o, uint32_t engine, int lower, int bytes, double *clock, int sequential,
                kvb_event_fn on_events, void *event_user, kvb_event_fn host_events, void *host_user, kvs_bus *bus)
{
    kvb_event_fn lower_events = bus ? kvs_bus_pool_events : NULL;
    void *lower_user = bus;
    if (host_events) {
        lower_events = host_events;
        lower_user = host_user;
    }
    kvo_manager_config mc;
    uint32_t i;
    memset(t, 0, sizeof *t);
    t->engine = engine;
    t->null_be.submit = null_submit;
    t->null_be.destroy = null_destroy;
    t->null_be.name = "null";
    if (bytes) { /* small pages keep memory modest: 2 layers x 2 KV heads x head dim 16 x fp16 */
        check_kv(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, o->block_tokens, 2, 2, 16, 2, &t->layout), "layout");
        t->block_bytes = t->layout.page_bytes * 4;
    }
    t->pool[0] = make_pool(o, o->device_blocks, 0, (kvb_evict_policy)o->eviction, KVB_DUP_ALLOW, bytes,
                           KVB_LAYOUT_BLOCK_CONTIGUOUS, &t->layout, on_events, event_user);
    t->kind[0] = TIER_DEVICE;
    t->n = 1;
    if (!lower || (!o->host_blocks && !o->disk_blocks && !o->remote)) return;
    if (o->host_blocks) {
        t->pool[t->n] = make_pool(o, o->host_blocks, t->n, KVB_EVICT_LINEAGE, KVB_DUP_REJECT, bytes,
                                  KVB_LAYOUT_LAYER_SEPARATE, &t->layout, lower_events, lower_user);
        t->kind[t->n++] = TIER_HOST;
    }
    if (o->disk_blocks) {
        t->pool[t->n] = make_pool(o, o->disk_blocks, t->n, KVB_EVICT_LINEAGE, KVB_DUP_REJECT, 0, 0, NULL, lower_events, lower_user);
        t->kind[t->n++] = TIER_DISK;
    }
    if (o->remote) { /* G4: a metadata-only pool standing for what Redis holds, filled through the backend */
        kvo_redis_config rc;
        char why[256] = "";
        int r;
        t->pool[t->n] = make_pool(o, o->remote_blocks, t->n, KVB_EVICT_LINEAGE, KVB_DUP_REJECT, 0, 0, NULL,
                                  bus ? kvs_bus_pool_events : NULL, bus);
        t->kind[t->n++] = TIER_REMOTE;
        memset(&rc, 0, sizeof rc);
        rc.servers = o->remote;
        rc.namespace_prefix = "serve_sim";
        rc.pool = t->pool[t->n - 1];
        rc.layout = t->layout;
        rc.threads = 0; /* jobs run inline in submit: the pipelines are polled */
        rc.error = why;
        rc.error_size = sizeof why;
        if ((r = kvo_redis_backend_create(&rc, &t->redis)) != KVO_OK)
            die(2, "--remote %s: %s%s%s", o->remote, kvo_redis_result_string(r), why[0] ? ": " : "", why);
    }
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = t->n;
    for (i = 0; i < t->n; i++) {
        mc.pools[i] = t->pool[i];
        if (i + 1 < t->n) mc.down[i] = &t->null_be;
        if (i) mc.up[i] = &t->null_be;
    }
    if (bytes) {
        check_kv(kvo_memcpy_backend_create(0, &t->mem), "memcpy backend");
        for (i = 0; i < t->n; i++) {
            if (i + 1 < t->n) mc.down[i] = t->kind[i + 1] == TIER_DISK ? NULL : t->mem;
            if (i) mc.up[i] = t->kind[i] == TIER_DISK ? NULL : t->mem;
        }
        if (o->disk_blocks) {
            uint32_t d = t->kind[t->n - 1] == TIER_DISK ? t->n - 1 : t->n - 2; /* before G4, when there */
            kvo_disk_config dc;
            int fd;
            char *path = tmp_paths[engine];
            static int cleanup_set;
            snprintf(path, sizeof tmp_paths[0], "/tmp/serve_sim.XXXXXX");
            if ((fd = mkstemp(path)) < 0) die(2, "cannot create a file under /tmp: %s", strerror(errno));
            close(fd);
            if (!cleanup_set++) atexit(remove_tmp_all);
            signal(SIGINT, on_signal);
            signal(SIGTERM, on_signal);
            memset(&dc, 0, sizeof dc);
            dc.path = path;
            dc.disk_pool = t->pool[d];
            dc.block_bytes = t->block_bytes;
            dc.log = disk_log;
            dc.log_user = t;
            check_kv(kvo_disk_backend_create(&dc, &t->disk), "disk backend");
            mc.down[d - 1] = t->disk;
            mc.up[d] = t->disk;
        }
        if (t->redis) { /* with a disk tier, G4 is a branch from G2: G1 -> G2 -> G3 and G2 -> G4 */
            mc.down[t->n - 2] = t->redis;
            mc.up[t->n - 1] = t->redis;
            if (o->disk_blocks) mc.branch_from = 1;
        }
    }
    mc.offload = (kvo_offload_mode)o->offload;
    mc.pipeline.mode = KVO_MODE_POLL; /* no threads: the simulation pumps the pipelines, deterministically */
    mc.pipeline.clock = clock ? sim_clock_us : NULL;
    mc.pipeline.clock_user = clock;
    if (sequential) mc.pipeline.min_batch = 1; /* one request at a time: nothing to batch with */
    mc.pipeline.on_stage = bus ? kvs_bus_transfer_stage : NULL;
    mc.pipeline.stage_user = bus;
    check_kv(kvo_manager_create(&mc, &t->mgr), "tier manager");
}

void close_tiers(tiers *t)
{
    uint32_t i;
    kvo_manager_destroy(t->mgr);
    kvo_backend_destroy(t->mem);
    kvo_backend_destroy(t->disk);
    kvo_backend_destroy(t->redis);
    for (i = 0; i < t->n; i++) kvb_pool_destroy(t->pool[i]);
    remove_tmp(t->engine);
}

void collect_traffic(tiers *t, const options *o, int bytes, traffic *tr)
{
    kvo_manager_stats ms;
    uint32_t i;
    double modeled = (double)o->block_tokens * KV_BYTES_PER_TOKEN;
    memset(tr, 0, sizeof *tr);
    for (i = 0; i < TIER_ALL; i++) tr->down_from[i] = -1;
    memset(&ms, 0, sizeof ms);
    if (t->mgr) kvo_manager_get_stats(t->mgr, &ms);
    if (t->redis) kvo_redis_backend_stats(t->redis, &tr->redis);
    for (i = 0; i < t->n; i++) {
        kvb_pool_stats ps;
        int k = t->kind[i];
        memset(&ps, 0, sizeof ps);
        kvb_pool_get_stats(t->pool[i], &ps);
        tr->present[k] = 1;
        tr->evictions[k] = ps.evictions;
        if (k == TIER_DEVICE) tr->device_step = ps.fol_class_step;
        if (k == TIER_DEVICE) tr->device_tails = ps.fol_tails_first;
        if (!t->mgr) continue;
        if (i + 1 < t->n && kvo_manager_pipeline(t->mgr, i, 0)) { /* the edge into tier i + 1 */
            int to = t->kind[i + 1];
            kvo_pipeline_config pc;
            uint32_t from = i;
            if (kvo_pipeline_get_config(kvo_manager_pipeline(t->mgr, i, 0), &pc) == KVO_OK)
                while (from > 0 && t->pool[from] != pc.src) from--;
            tr->down_from[to] = t->kind[from];
            tr->down_blocks[to] = ms.down[i].transferred;
            tr->down_bytes[to] = bytes ? ms.down[i].bytes : (uint64_t)(modeled * (double)ms.down[i].transferred);
        }
        if (i) {
            tr->up_blocks[k] = ms.up[i].transferred;
            tr->up_bytes[k] = bytes ? ms.up[i].bytes : (uint64_t)(modeled * (double)ms.up[i].transferred);
        }
    }
}

/* ---- --bytes: every computed block gets a pattern derived from its hash, checked whenever it is used
 * again (device hit or onboarded from host or disk) --------------------------------------------------- */

static uint64_t pattern_word(const kvb_hash *h, uint32_t page, size_t i)
{
    return mix64(h->lo ^ ((uint64_t)page << 48) ^ (uint64_t)i) ^ h->hi;
}

void pattern_write(const tiers *t, kvb_block b, const kvb_hash *h)
{
    uint32_t l, p;
    for (l = 0; l < t->layout.num_layers; l++)
        for (p = 0; p < 2; p++) {
            void *ptr;
            size_t i, n = (size_t)(t->layout.page_bytes / 8);
            check_kv(kvb_block_data(t->pool[0], b, l, p, &ptr), "block data");
            for (i = 0; i < n; i++) {
                uint64_t v = pattern_word(h, l * 2 + p, i);
                memcpy((unsigned char *)ptr + 8 * i, &v, 8);
            }
        }
}

int pattern_ok(const tiers *t, kvb_block b, const kvb_hash *h)
{
    uint32_t l, p;
    for (l = 0; l < t->layout.num_layers; l++)
        for (p = 0; p < 2; p++) {
            void *ptr;
            size_t i, n = (size_t)(t->layout.page_bytes / 8);
            if (kvb_block_data(t->pool[0], b, l, p, &ptr) != KVB_OK) return 0;
            for (i = 0; i < n; i++) {
                uint64_t v;
                memcpy(&v, (unsigned char *)ptr + 8 * i, 8);
                if (v != pattern_word(h, l * 2 + p, i)) return 0;
            }
        }
    return 1;
}
