/* engine.c — serve_sim's serving loop: one engine (kvs_sched on its tiers) stepping in simulated time
 * under the cost model; the fleet (fleet.c) gives it requests and decides when it steps */
#include "sim.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the serving simulation: one engine's pieces ------------------------------------------------ */

/* Which blocks onboarding put on the device and no request has used yet: the device pool reports a
 * hash STORED during kvs_sched_step only when an onboard registered it (computed blocks are registered
 * by kvs_sched_complete); a block that is evicted again before use is forgotten. */
typedef struct landed {
    u64map hashes;
    int in_step;
    kvs_bus *bus;
    void *router_feed;       /* the fleet's router, NULL without one */
    u64map held;             /* hash -> how many of the engine's local tiers hold it (with a router) */
} landed;

/* The router indexes what an engine holds in any of its own tiers (device, host, disk): a turn whose
 * conversation was pushed down to host memory is still cheap there, onboarding beats prefill. A block
 * counts once however many tiers hold it: the router hears STORED (as tier 0) when the first tier takes
 * it and REMOVED when the last one lets it go. */
static void feed_router(landed *ld, const kvb_event *ev, size_t n)
{
    kvb_event out[64];
    size_t i, k = 0;
    for (i = 0; i < n; i++) {
        uint32_t c = map_get(&ld->held, ev[i].hash.lo);
        if (c == UINT32_MAX) c = 0;
        if (ev[i].kind == KVB_EVENT_STORED) {
            map_put(&ld->held, ev[i].hash.lo, c + 1);
            if (c) continue;
        } else if (ev[i].kind == KVB_EVENT_REMOVED && c) {
            if (c > 1) {
                map_put(&ld->held, ev[i].hash.lo, c - 1);
                continue;
            }
            map_del(&ld->held, ev[i].hash.lo);
        } else {
            continue; /* CLEARED (no pool here is cleared), or a REMOVED never stored */
        }
        out[k] = ev[i];
        out[k++].tier = 0;
        if (k == sizeof out / sizeof out[0]) {
            kvs_router_pool_events(out, k, ld->router_feed);
            k = 0;
        }
    }
    if (k) kvs_router_pool_events(out, k, ld->router_feed);
}

static void on_device_events(const kvb_event *ev, size_t n, void *user)
{
    landed *ld = (landed *)user;
    size_t i;
    for (i = 0; i < n; i++) {
        if (ev[i].kind == KVB_EVENT_STORED && ld->in_step) map_put(&ld->hashes, ev[i].hash.lo, 1);
        else if (ev[i].kind == KVB_EVENT_REMOVED) map_del(&ld->hashes, ev[i].hash.lo);
    }
    if (ld->bus) kvs_bus_pool_events(ev, n, ld->bus); /* --console, --record: the device pool's events too */
    if (ld->router_feed) feed_router(ld, ev, n);
}

/* The host and disk pools' events: to the bus when there is one, to the router. */
static void on_lower_events(const kvb_event *ev, size_t n, void *user)
{
    landed *ld = (landed *)user;
    if (ld->bus) kvs_bus_pool_events(ev, n, ld->bus);
    feed_router(ld, ev, n);
}

static uint64_t sim_clock_ns(void *user) { return (uint64_t)(*(const double *)user * 1e9); }

void observer_start(observer *ob, const options *o, double *clock)
{
    kvs_bus_config bc;
    memset(ob, 0, sizeof *ob);
    if (!o->console && !o->record) return;
    memset(&bc, 0, sizeof bc);
    bc.clock = sim_clock_ns;
    bc.clock_user = clock;
    check_kv(kvs_bus_create(&bc, &ob->bus), "kvs_bus_create");
    if (o->record) {
        kvs_recorder_config rc;
        memset(&rc, 0, sizeof rc);
        rc.log_path = o->record;
        if (kvs_recorder_create(ob->bus, &rc, &ob->recorder) != KVS_OK)
            die(2, "--record %s: cannot create the log", o->record);
    }
    if (o->console) {
        kvs_console_config cc;
        memset(&cc, 0, sizeof cc);
        cc.path = o->console;
        if (strlen(o->console) >= sizeof console_path)
            die(2, "--console %s: path too long for a Unix socket", o->console);
        if (kvs_console_start(ob->bus, &cc, &ob->console) != KVS_OK)
            die(2, "--console %s: cannot create the socket", o->console);
        snprintf(console_path, sizeof console_path, "%s", o->console);
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
    }
}

/* After the scheduler and the tiers (everything publishing) are gone. */
void observer_stop(observer *ob)
{
    if (ob->console) kvs_console_stop(ob->console);
    console_path[0] = 0;
    if (ob->recorder) kvs_recorder_destroy(ob->recorder);
    if (ob->bus) kvs_bus_destroy(ob->bus);
    memset(ob, 0, sizeof *ob);
}

/* kvs_metrics_write's text, in a buffer of the size it asks for. */
static char *metrics_text(kvs_sched *s, kvo_backend *disk)
{
    size_t cap = 16384, len = 0;
    char *buf = NULL;
    for (;;) {
        int r;
        buf = (char *)xrealloc(buf, cap);
        r = kvs_metrics_write(s, disk, buf, cap, &len);
        if (r != KVS_ENOSPACE) {
            check_kv(r, "kvs_metrics_write");
            return buf;
        }
        if (len + 1 <= cap) die(2, "kvs_metrics_write: asks for %zu bytes with %zu given", len + 1, cap);
        cap = len + 1;
    }
}

void pace(uint32_t us)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(us / 1000000);
    ts.tv_nsec = (long)(us % 1000000) * 1000;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* Hits of a request, counted once, when it is first admitted: its cached blocks (device + onboarded).
 * A cached block is a host or disk hit when a load was planned for it from there and it landed on the
 * device by that onboarding (the first request to use a landed block gets the lower-tier hit). */
static void count_hits(results *res, const sim_req *r, live *l, uint64_t cached, landed *ld)
{
    uint64_t j;
    if (cached > r->num_blocks) cached = r->num_blocks;
    res->prompt_blocks += r->num_blocks;
    res->hit_blocks += cached;
    for (j = 0; j < cached; j++) {
        int tier = l->load_tier ? l->load_tier[j] : TIER_DEVICE;
        if (tier != TIER_DEVICE) {
            if (map_get(&ld->hashes, r->hashes[j].lo) != UINT32_MAX) map_del(&ld->hashes, r->hashes[j].lo);
            else tier = TIER_DEVICE;
        }
        res->tier_hits[tier]++;
    }
    free(l->load_tier);
    l->load_tier = NULL;
}

/* ---- one engine: a scheduler on its tiers, stepped by the fleet -------------------------------- */

struct engine {
    uint32_t index;
    double now;                      /* this engine's clock: when its last step ended */
    const workload *w;
    const options *o;
    int cache_on, bytes;
    tiers t;
    kvs_sched *s;
    live *L;                         /* the fleet's, one per request */
    u64map ids;                      /* scheduler request id -> request index */
    landed ld;
    size_t *pending, npending, cappending; /* added, not yet admitted: the queue */
    size_t *done, ndone, capdone;    /* requests the last step finished */
    uint32_t *buf;
    size_t capbuf, capcpu, capttft, empty;
    kvb_block *full;
    size_t nfull, capfull;
    double backlog;                  /* prompt blocks routed here and not yet past their first token */
    double active;                   /* prompt blocks of the requests decoding here */
    results res;
};

engine *engine_open(uint32_t index, const workload *w, const options *o, int cache_on, live *L, kvs_bus *bus,
                    void *router_feed)
{
    engine *e = (engine *)xcalloc(1, sizeof *e);
    kvs_sched_config sc;
    e->index = index;
    e->w = w;
    e->o = o;
    e->cache_on = cache_on;
    e->bytes = cache_on && o->bytes;
    e->L = L;
    map_init(&e->ids, 1024);
    map_init(&e->ld.hashes, 1024);
    e->ld.bus = bus;
    e->ld.router_feed = router_feed;
    map_init(&e->ld.held, 1024);
    open_tiers(&e->t, o, index, cache_on, e->bytes, &e->now, 0, on_device_events, &e->ld,
               router_feed ? on_lower_events : NULL, &e->ld, bus);
    memset(&sc, 0, sizeof sc);
    sc.device = e->t.pool[0];
    sc.tiers = e->t.mgr;
    sc.offload = o->offload == KVO_OFFLOAD_LAZY ? KVS_OFFLOAD_LAZY : KVS_OFFLOAD_EAGER;
    sc.bus = bus;
    if (e->t.redis) { /* device, host, disk, then Redis, with what other processes stored */
        sc.lookup = kvo_redis_tiers_lookup;
        sc.lookup_user = e->t.redis;
    }
    check_kv(kvs_sched_create(&sc, &e->s), "kvs_sched_create");
    return e;
}

double engine_clock(const engine *e) { return e->now; }
void engine_set_clock(engine *e, double t) { e->now = t; }
int engine_idle(const engine *e) { return kvs_sched_idle(e->s); }
size_t engine_queue(const engine *e) { return e->npending; }
double engine_backlog(const engine *e) { return e->backlog; }
double engine_active(const engine *e) { return e->active; }
results *engine_results(engine *e) { return &e->res; }
const tiers *engine_tiers(const engine *e) { return &e->t; }

int engine_add(engine *e, size_t req, double arrival, double backlog)
{
    const sim_req *r = &e->w->reqs[req];
    kvs_request rq;
    uint64_t id;
    int rc;
    GROW(e->buf, e->capbuf, r->num_prompt);
    fill_prompt(e->w, r, e->buf);
    memset(&rq, 0, sizeof rq);
    rq.prompt = e->buf;
    rq.num_prompt = r->num_prompt;
    rq.max_new_tokens = r->num_output;
    rq.salt = e->cache_on ? 0 : (uint64_t)req + 1;
    rc = kvs_sched_add(e->s, &rq, &id);
    if (rc == KVS_ETOOBIG) return 0;
    check_kv(rc, "kvs_sched_add");
    e->L[req].id = id;
    e->L[req].arrival = arrival;
    e->L[req].backlog = backlog;
    e->backlog += backlog;
    map_put(&e->ids, id, (uint32_t)req);
    GROW(e->pending, e->cappending, e->npending + 1);
    e->pending[e->npending++] = req;
    return 1;
}

/* Onboarding started in a step: its modeled time, and which tier each block's load comes from. */
static double note_loads(engine *e, const kvs_step *st)
{
    double load_us = 0;
    size_t i;
    for (i = 0; i < st->meta.num_loads; i++) {
        const kvs_load *lo = &st->meta.loads[i];
        uint32_t req = map_get(&e->ids, lo->request);
        int kind = e->t.kind[lo->tier < e->t.n ? lo->tier : 0];
        double gbps = kind == TIER_DISK ? DISK_GBPS : kind == TIER_REMOTE ? REMOTE_GBPS : HOST_GBPS;
        load_us += (double)lo->num_blocks * e->o->block_tokens * KV_BYTES_PER_TOKEN / (gbps * 1e3);
        if (req != UINT32_MAX && !e->L[req].counted) {
            const sim_req *r = &e->w->reqs[req];
            uint32_t j;
            if (!e->L[req].load_tier) e->L[req].load_tier = (uint8_t *)xcalloc(r->num_blocks, 1);
            for (j = lo->first_block; j < lo->first_block + lo->num_blocks && j < r->num_blocks; j++)
                e->L[req].load_tier[j] = (uint8_t)kind;
        }
    }
    return load_us;
}

/* The forward pass reads the cached blocks (--bytes: checked the first time) and writes the new ones
 * (--bytes: their pattern, once kvs_sched_complete has registered them). Returns the prefill tokens. */
static size_t forward(engine *e, const kvs_step *st)
{
    uint32_t bt = e->o->block_tokens;
    size_t prefill_tokens = 0, i, k;
    for (k = 0; k < 2; k++) {
        const kvs_sched_item *items = k ? st->decode : st->prefill;
        size_t n = k ? st->num_decode : st->num_prefill;
        for (i = 0; i < n; i++) {
            const kvs_sched_item *it = &items[i];
            size_t j;
            if (!k) prefill_tokens += it->num_new;
            if (!e->bytes) continue;
            if (!k) {
                uint32_t req = map_get(&e->ids, it->request);
                if (req != UINT32_MAX && !e->L[req].checked) {
                    const sim_req *r = &e->w->reqs[req];
                    e->L[req].checked = 1;
                    for (j = 0; j < it->num_computed / bt && j < r->num_blocks && j < it->num_blocks; j++) {
                        e->res.verified++;
                        e->res.mismatches += !pattern_ok(&e->t, it->blocks[j], &r->hashes[j]);
                    }
                }
            }
            for (j = it->num_computed / bt; j < (it->num_computed + it->num_new) / bt && j < it->num_blocks; j++) {
                GROW(e->full, e->capfull, e->nfull + 1);
                e->full[e->nfull++] = it->blocks[j];
            }
        }
    }
    return prefill_tokens;
}

/* Requests admitted by this step: count their hits. */
static void count_admitted(engine *e)
{
    size_t i;
    for (i = 0; i < e->npending;) {
        size_t req = e->pending[i];
        kvs_slot_info si;
        check_kv(kvs_sched_get_slot(e->s, e->L[req].id, &si), "kvs_sched_get_slot");
        if (si.state == KVS_SLOT_INITIALIZED || si.state == KVS_SLOT_ONBOARD_STAGED || si.state == KVS_SLOT_ONBOARDING) {
            i++;
            continue;
        }
        count_hits(&e->res, &e->w->reqs[req], &e->L[req],
                   si.state == KVS_SLOT_PREEMPTED ? 0 : si.num_cached / e->o->block_tokens, &e->ld);
        e->L[req].counted = 1;
        e->pending[i] = e->pending[--e->npending];
    }
}

/* Sample one token for every request whose tokens are all computed; finished ones go to e->done. */
static void sample_tokens(engine *e, const kvs_step *st)
{
    size_t i, k;
    for (k = 0; k < 2; k++) {
        const kvs_sched_item *items = k ? st->decode : st->prefill;
        size_t n = k ? st->num_decode : st->num_prefill;
        for (i = 0; i < n; i++) {
            uint64_t id = items[i].request;
            uint32_t req = id ? map_get(&e->ids, id) : UINT32_MAX, tok;
            const sim_req *r;
            kvs_slot_info si;
            if (req == UINT32_MAX) continue;
            r = &e->w->reqs[req];
            check_kv(kvs_sched_get_slot(e->s, id, &si), "kvs_sched_get_slot");
            if (si.state != KVS_SLOT_DECODING || si.num_tokens > si.num_computed) continue;
            tok = output_token(e->w, r, si.generated);
            if (!si.generated) {
                GROW(e->res.ttft, e->capttft, e->res.nttft + 1);
                e->res.ttft[e->res.nttft++] = e->now - e->L[req].arrival;
                e->backlog -= e->L[req].backlog;
                e->L[req].backlog = 0;
                e->active += r->num_blocks;
            }
            check_kv(kvs_sched_append(e->s, id, &tok, 1), "kvs_sched_append");
            if (si.generated + 1 < r->num_output) continue;
            check_kv(kvs_sched_release(e->s, id), "kvs_sched_release"); /* finished at max_new_tokens */
            map_del(&e->ids, id);
            e->active -= r->num_blocks;
            e->res.requests++;
            GROW(e->done, e->capdone, e->ndone + 1);
            e->done[e->ndone++] = req;
        }
    }
}

size_t engine_step(engine *e, const size_t **finished)
{
    kvs_step st;
    double c0, cpu, compute_us, load_us, dt;
    size_t prefill_tokens, i;
    e->ndone = 0;
    e->ld.in_step = 1;
    c0 = cpu_now();
    check_kv(kvs_sched_step(e->s, &st), "kvs_sched_step");
    cpu = cpu_now() - c0;
    e->ld.in_step = 0;
    load_us = note_loads(e, &st);
    prefill_tokens = forward(e, &st);
    compute_us = st.num_prefill + st.num_decode
                     ? COST_STEP_US + (double)prefill_tokens * COST_PREFILL_US + (double)st.num_decode * COST_DECODE_US
                     : 0;
    c0 = cpu_now();
    check_kv(kvs_sched_complete(e->s, &st), "kvs_sched_complete");
    cpu += cpu_now() - c0;
    GROW(e->res.cpu, e->capcpu, e->res.ncpu + 1);
    e->res.cpu[e->res.ncpu++] = cpu;
    for (i = 0; i < e->nfull; i++) {
        kvb_block_info info;
        if (kvb_block_get_info(e->t.pool[0], e->full[i].id, &info) == KVB_OK && info.state == KVB_STATE_REGISTERED)
            pattern_write(&e->t, e->full[i], &info.hash);
    }
    e->nfull = 0;
    dt = compute_us > load_us ? compute_us : load_us;
    if (dt <= 0) dt = COST_IDLE_US;
    e->now += dt * 1e-6;
    if (st.num_prefill || st.num_decode) e->res.busy_seconds += dt * 1e-6;
    e->res.prefill_tokens += prefill_tokens;
    e->res.steps++;
    e->res.preempted += st.num_preempted;
    if (st.num_prefill || st.num_decode) e->empty = 0;
    else if (++e->empty > 1000000) die(2, "internal: the scheduler makes no progress");
    count_admitted(e);
    sample_tokens(e, &st);
    *finished = e->done;
    return e->ndone;
}

void engine_close(engine *e)
{
    if (e->t.mgr) kvo_manager_drain(e->t.mgr, 10 * 1000000);
    e->res.sim_seconds = e->now;
    collect_traffic(&e->t, e->o, e->bytes, &e->res.tr);
    snprintf(e->res.disk_note, sizeof e->res.disk_note, "%s", e->t.disk_note);
    if (e->cache_on && e->o->metrics) e->res.metrics = metrics_text(e->s, e->t.disk);
    kvs_sched_destroy(e->s);
    close_tiers(&e->t);
    map_free(&e->ids);
    map_free(&e->ld.hashes);
    map_free(&e->ld.held);
    free(e->buf);
    free(e->pending);
    free(e->done);
    free(e->full);
}

void engine_free(engine *e) { free(e); }
