/* engine.c — serve_sim's serving loop: one engine (kvs_sched on its tiers) stepping in simulated time
 * under the cost model, arrivals from the workload, observability on a bus */
#include "sim.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the serving simulation --------------------------------------------------------------------- */

typedef struct ev { double t; size_t req; } ev;
typedef struct heap { ev *e; size_t n, cap; } heap;

static int ev_less(const ev *a, const ev *b) { return a->t < b->t || (a->t == b->t && a->req < b->req); }

static void heap_push(heap *h, double t, size_t req)
{
    ev x;
    size_t i;
    x.t = t;
    x.req = req;
    GROW(h->e, h->cap, h->n + 1);
    for (i = h->n++; i > 0 && ev_less(&x, &h->e[(i - 1) / 2]); i = (i - 1) / 2) h->e[i] = h->e[(i - 1) / 2];
    h->e[i] = x;
}

static ev heap_pop(heap *h)
{
    ev top = h->e[0], x = h->e[--h->n];
    size_t i = 0, c;
    while ((c = 2 * i + 1) < h->n) {
        if (c + 1 < h->n && ev_less(&h->e[c + 1], &h->e[c])) c++;
        if (!ev_less(&h->e[c], &x)) break;
        h->e[i] = h->e[c];
        i = c;
    }
    if (h->n) h->e[i] = x;
    return top;
}

typedef struct live {                /* a request while the scheduler has it */
    uint64_t id;
    double arrival;
    uint8_t *load_tier;              /* per prompt block: the tier kind a load was planned from (0: none) */
    uint8_t counted, checked;
} live;

/* Which blocks onboarding put on the device and no request has used yet: the device pool reports a
 * hash STORED during kvs_sched_step only when an onboard registered it (computed blocks are registered
 * by kvs_sched_complete); a block that is evicted again before use is forgotten. */
typedef struct landed { u64map hashes; int in_step; kvs_bus *bus; } landed;

static void on_device_events(const kvb_event *ev, size_t n, void *user)
{
    landed *ld = (landed *)user;
    size_t i;
    for (i = 0; i < n; i++) {
        if (ev[i].kind == KVB_EVENT_STORED && ld->in_step) map_put(&ld->hashes, ev[i].hash.lo, 1);
        else if (ev[i].kind == KVB_EVENT_REMOVED) map_del(&ld->hashes, ev[i].hash.lo);
    }
    if (ld->bus) kvs_bus_pool_events(ev, n, ld->bus); /* --console, --record: the device pool's events too */
}

/* --console, --record, --metrics: the scheduler run with the cache on publishes every event on a bus
 * stamped with simulated time (a recorded run is deterministic); the baseline run is not observed. */
typedef struct observer {
    kvs_bus *bus;            /* NULL: nothing observes the run */
    kvs_console *console;
    kvs_recorder *recorder;
} observer;

static uint64_t sim_clock_ns(void *user) { return (uint64_t)(*(const double *)user * 1e9); }

static void observer_start(observer *ob, const options *o, double *clock)
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
static void observer_stop(observer *ob)
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

static void pace(uint32_t us)
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

static void show_progress(const char *label, size_t done, size_t total, double sim, int end)
{
    char bar[31];
    size_t k = total ? done * 30 / total : 30, i;
    if (end) {
        fprintf(stderr, "\r\033[K");
        return;
    }
    for (i = 0; i < 30; i++) bar[i] = i < k ? '=' : ' ';
    bar[30] = 0;
    fprintf(stderr, "\r%-9s [%s] %3zu%%  %zu/%zu requests  %.0f s simulated", label, bar,
            total ? done * 100 / total : 100, done, total, sim);
    fflush(stderr);
}

void run_sched(const workload *w, const options *o, int cache_on, results *res, series *sv, int progress)
{
    double now = 0, wall0 = wall_now(), shown = 0;
    tiers t;
    kvs_sched_config sc;
    kvs_sched *s;
    live *L = (live *)xcalloc(w->n, sizeof *L);
    u64map ids;
    heap hp;
    size_t remaining = w->n, i, q, npending = 0, cappending = 0, capbuf = 0, capcpu = 0, capttft = 0, nfull = 0,
           capfull = 0, empty = 0;
    uint32_t *buf = NULL, bt = o->block_tokens;
    size_t *pending = NULL;
    kvb_block *full = NULL;
    int bytes = cache_on && o->bytes;
    const char *label = cache_on ? "cache on" : "cache off";
    landed ld;
    observer ob;

    memset(&hp, 0, sizeof hp);
    map_init(&ids, 1024);
    map_init(&ld.hashes, 1024);
    ld.in_step = 0;
    if (cache_on) observer_start(&ob, o, &now);
    else memset(&ob, 0, sizeof ob);
    ld.bus = ob.bus;
    open_tiers(&t, o, cache_on, bytes, &now, 0, on_device_events, &ld, ob.bus);
    memset(&sc, 0, sizeof sc);
    sc.device = t.pool[0];
    sc.tiers = t.mgr;
    sc.offload = o->offload == KVO_OFFLOAD_LAZY ? KVS_OFFLOAD_LAZY : KVS_OFFLOAD_EAGER;
    sc.bus = ob.bus;
    if (t.redis) { /* device, host, disk, then Redis, with what other processes stored */
        sc.lookup = kvo_redis_tiers_lookup;
        sc.lookup_user = t.redis;
    }
    check_kv(kvs_sched_create(&sc, &s), "kvs_sched_create");
    for (q = 0; q < w->n; q++)
        if (w->is_trace || w->reqs[q].turn == 0) heap_push(&hp, w->reqs[q].arrival, q);
    if (sv) series_add(sv, &t, 0, res->tier_hits, 0);

    while (remaining) {
        kvs_step st;
        double c0, cpu, compute_us, load_us = 0, dt;
        size_t prefill_tokens = 0, k;

        /* 1. arrivals */
        while (hp.n && hp.e[0].t <= now) {
            ev e = heap_pop(&hp);
            const sim_req *r = &w->reqs[e.req];
            kvs_request rq;
            uint64_t id;
            int rc;
            GROW(buf, capbuf, r->num_prompt);
            fill_prompt(w, r, buf);
            memset(&rq, 0, sizeof rq);
            rq.prompt = buf;
            rq.num_prompt = r->num_prompt;
            rq.max_new_tokens = r->num_output;
            rq.salt = cache_on ? 0 : (uint64_t)e.req + 1;
            rc = kvs_sched_add(s, &rq, &id);
            if (rc == KVS_ETOOBIG) { /* it, and the later turns of its conversation, can never run */
                int32_t x = (int32_t)e.req;
                for (; x >= 0; x = w->reqs[x].next_turn) {
                    res->skipped++;
                    remaining--;
                }
                continue;
            }
            check_kv(rc, "kvs_sched_add");
            L[e.req].id = id;
            L[e.req].arrival = e.t;
            map_put(&ids, id, (uint32_t)e.req);
            GROW(pending, cappending, npending + 1);
            pending[npending++] = e.req;
        }
        if (!remaining) break;
        if (kvs_sched_idle(s)) { /* nothing to run: jump to the next arrival */
            if (!hp.n) die(2, "internal: %zu requests unfinished and none to come", remaining);
            if (hp.e[0].t > now) now = hp.e[0].t;
            continue;
        }

        /* 2. plan the step */
        ld.in_step = 1;
        c0 = cpu_now();
        check_kv(kvs_sched_step(s, &st), "kvs_sched_step");
        cpu = cpu_now() - c0;
        ld.in_step = 0;
        for (i = 0; i < st.meta.num_loads; i++) { /* onboarding started in this step */
            const kvs_load *lo = &st.meta.loads[i];
            uint32_t req = map_get(&ids, lo->request);
            int kind = t.kind[lo->tier < t.n ? lo->tier : 0];
            double gbps = kind == TIER_DISK ? DISK_GBPS : kind == TIER_REMOTE ? REMOTE_GBPS : HOST_GBPS;
            load_us += (double)lo->num_blocks * bt * KV_BYTES_PER_TOKEN / (gbps * 1e3);
            if (req != UINT32_MAX && !L[req].counted) {
                const sim_req *r = &w->reqs[req];
                uint32_t j;
                if (!L[req].load_tier) L[req].load_tier = (uint8_t *)xcalloc(r->num_blocks, 1);
                for (j = lo->first_block; j < lo->first_block + lo->num_blocks && j < r->num_blocks; j++)
                    L[req].load_tier[j] = (uint8_t)kind;
            }
        }

        /* 3. the forward pass: it reads the cached blocks (--bytes: checked the first time) and writes
         * the new ones (--bytes: their pattern, once kvs_sched_complete has registered them) */
        for (k = 0; k < 2; k++) {
            const kvs_sched_item *items = k ? st.decode : st.prefill;
            size_t n = k ? st.num_decode : st.num_prefill;
            for (i = 0; i < n; i++) {
                const kvs_sched_item *it = &items[i];
                size_t j;
                if (!k) prefill_tokens += it->num_new;
                if (!bytes) continue;
                if (!k) {
                    uint32_t req = map_get(&ids, it->request);
                    if (req != UINT32_MAX && !L[req].checked) {
                        const sim_req *r = &w->reqs[req];
                        L[req].checked = 1;
                        for (j = 0; j < it->num_computed / bt && j < r->num_blocks && j < it->num_blocks; j++) {
                            res->verified++;
                            res->mismatches += !pattern_ok(&t, it->blocks[j], &r->hashes[j]);
                        }
                    }
                }
                for (j = it->num_computed / bt; j < (it->num_computed + it->num_new) / bt && j < it->num_blocks; j++) {
                    GROW(full, capfull, nfull + 1);
                    full[nfull++] = it->blocks[j];
                }
            }
        }
        compute_us = st.num_prefill + st.num_decode
                         ? COST_STEP_US + (double)prefill_tokens * COST_PREFILL_US + (double)st.num_decode * COST_DECODE_US
                         : 0;
        c0 = cpu_now();
        check_kv(kvs_sched_complete(s, &st), "kvs_sched_complete");
        cpu += cpu_now() - c0;
        GROW(res->cpu, capcpu, res->ncpu + 1);
        res->cpu[res->ncpu++] = cpu;
        for (i = 0; i < nfull; i++) {
            kvb_block_info info;
            if (kvb_block_get_info(t.pool[0], full[i].id, &info) == KVB_OK && info.state == KVB_STATE_REGISTERED)
                pattern_write(&t, full[i], &info.hash);
        }
        nfull = 0;
        dt = compute_us > load_us ? compute_us : load_us;
        if (dt <= 0) dt = COST_IDLE_US;
        now += dt * 1e-6;
        res->steps++;
        res->preempted += st.num_preempted;
        if (st.num_prefill || st.num_decode) empty = 0;
        else if (++empty > 1000000) die(2, "internal: the scheduler makes no progress");

        /* 4. requests admitted by this step: count their hits */
        for (i = 0; i < npending;) {
            size_t req = pending[i];
            kvs_slot_info si;
            check_kv(kvs_sched_get_slot(s, L[req].id, &si), "kvs_sched_get_slot");
            if (si.state == KVS_SLOT_INITIALIZED || si.state == KVS_SLOT_ONBOARD_STAGED || si.state == KVS_SLOT_ONBOARDING) {
                i++;
                continue;
            }
            count_hits(res, &w->reqs[req], &L[req], si.state == KVS_SLOT_PREEMPTED ? 0 : si.num_cached / bt, &ld);
            L[req].counted = 1;
            pending[i] = pending[--npending];
        }

        /* 5. sample one token for every request whose tokens are all computed */
        for (k = 0; k < 2; k++) {
            const kvs_sched_item *items = k ? st.decode : st.prefill;
            size_t n = k ? st.num_decode : st.num_prefill;
            for (i = 0; i < n; i++) {
                uint64_t id = items[i].request;
                uint32_t req = id ? map_get(&ids, id) : UINT32_MAX, tok;
                const sim_req *r;
                kvs_slot_info si;
                if (req == UINT32_MAX) continue;
                r = &w->reqs[req];
                check_kv(kvs_sched_get_slot(s, id, &si), "kvs_sched_get_slot");
                if (si.state != KVS_SLOT_DECODING || si.num_tokens > si.num_computed) continue;
                tok = output_token(w, r, si.generated);
                if (!si.generated) {
                    GROW(res->ttft, capttft, res->nttft + 1);
                    res->ttft[res->nttft++] = now - L[req].arrival;
                }
                check_kv(kvs_sched_append(s, id, &tok, 1), "kvs_sched_append");
                if (si.generated + 1 < r->num_output) continue;
                check_kv(kvs_sched_release(s, id), "kvs_sched_release"); /* finished at max_new_tokens */
                map_del(&ids, id);
                remaining--;
                res->requests++;
                if (r->next_turn >= 0) heap_push(&hp, now + w->reqs[r->next_turn].think, (size_t)r->next_turn);
            }
        }
        if (sv) series_add(sv, &t, now, res->tier_hits, res->prompt_blocks);
        if (cache_on && o->pace_us) pace(o->pace_us);
        if (progress && (res->steps & 255) == 0 && wall_now() - shown > 0.1) {
            shown = wall_now();
            show_progress(label, w->n - remaining, w->n, now, 0);
        }
    }
    if (progress) show_progress(label, 0, 0, 0, 1);
    if (t.mgr) kvo_manager_drain(t.mgr, 10 * 1000000);
    res->sim_seconds = now;
    res->wall_seconds = wall_now() - wall0;
    collect_traffic(&t, o, bytes, &res->tr);
    snprintf(res->disk_note, sizeof res->disk_note, "%s", t.disk_note);
    if (cache_on && o->metrics) res->metrics = metrics_text(s, t.disk);
    kvs_sched_destroy(s);
    close_tiers(&t);
    observer_stop(&ob);
    map_free(&ids);
    map_free(&ld.hashes);
    for (q = 0; q < w->n; q++) free(L[q].load_tier);
    free(hp.e);
    free(L);
    free(buf);
    free(pending);
    free(full);
}
