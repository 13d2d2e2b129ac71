/* fleet.c — serve_sim's fleet: N engines (engine.c) on one simulated clock, a kvs_router (kvroute.h) in
 * front fed by every engine's device-pool events, and the offered load of a workload against the cost
 * model (what --engines auto sizes the fleet from).
 *
 * The clock. Each engine has its own: the end of its last step. The fleet handles events in time
 * order: the next arrival (a request of the workload, or a conversation's next turn) when it is due no
 * later than the earliest busy engine's clock, otherwise that engine's next step. A request is routed
 * when it arrives, with every engine's backlog as it stands then; an engine that is mid-step takes it
 * at its next step, an idle one jumps its clock to the arrival. With one engine this is the loop
 * serve_sim always ran, and there is no router.
 *
 * Routing (--route): kv (default; least blocks to prefill + load, KVS_ROUTE_KV), rr, least (least load),
 * affinity (the conversation on synthetic workloads; for traces, which carry no session id,
 * the hash of the first blocks). The load the router weighs is an engine's backlog, the prompt blocks
 * routed to it that the router did not expect it to hold until their first token, plus ACTIVE_WEIGHT x
 * the prompt blocks of the requests decoding there. */
#include "sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A decoding request's prompt blocks weigh this much of a block to prefill in an engine's load: enough
 * that new conversations spread over the fleet when backlogs are empty (at 8 engines on a chat trace the
 * busiest engine's prefill work fell from 1.68x the mean to 1.08x), not enough to pull a turn away from
 * the engine that holds its conversation (the hit rate moved by under 0.01). */
#define ACTIVE_WEIGHT 0.15
#define OFFER_WINDOW_S 600.0 /* the offered load is the busiest 10 minutes' */

/* ---- arrivals: a heap by time, then request index ------------------------------------------------ */

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

/* ---- offered load against capacity ------------------------------------------------------------- */

/* Busy seconds per second that request r asks of an engine without cache hits: every prompt token
 * prefilled, every output token one decode slot (step overheads amortise under load). */
static double request_work(const sim_req *r)
{
    return ((double)r->num_prompt * COST_PREFILL_US + (double)r->num_output * COST_DECODE_US) * 1e-6;
}

/* The load of the busiest OFFER_WINDOW_S of arrivals (the whole span when shorter): a fleet sized for the
 * mean over a trace with a long quiet tail (sessions whose last turns come hours later) would drown in
 * its first hour. */
capacity offered_load(const workload *w)
{
    capacity c;
    double prompt = 0, output = 0, work = 0, best = -1, first, last;
    size_t a = 0, b;
    memset(&c, 0, sizeof c);
    c.engine_tps = 1e6 / COST_PREFILL_US;
    if (w->n < 2) return c;
    first = w->reqs[w->order[0]].arrival;
    last = w->reqs[w->order[w->n - 1]].arrival;
    c.span_s = last - first;
    if (c.span_s <= 0) return c; /* all at once: no rate to speak of */
    c.window_s = c.span_s < OFFER_WINDOW_S ? c.span_s : OFFER_WINDOW_S;
    for (b = 0; b < w->n; b++) { /* windows [arrival of a, + window_s] over the requests in arrival order */
        const sim_req *r = &w->reqs[w->order[b]];
        c.mean_work += request_work(r);
        prompt += r->num_prompt;
        output += r->num_output;
        work += request_work(r);
        while (r->arrival - w->reqs[w->order[a]].arrival > c.window_s) {
            const sim_req *x = &w->reqs[w->order[a++]];
            prompt -= x->num_prompt;
            output -= x->num_output;
            work -= request_work(x);
        }
        if (work > best) {
            best = work;
            c.prompt_tps = prompt / c.window_s;
            c.output_tps = output / c.window_s;
        }
    }
    c.work = best / c.window_s;
    c.mean_work /= c.span_s;
    return c;
}

uint32_t engines_for(const capacity *c)
{
    uint32_t n = 1;
    while (n < MAX_ENGINES && c->work / n >= 0.8) n++;
    return n;
}

/* ---- the fleet ---------------------------------------------------------------------------------- */

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

typedef struct fleet {
    const workload *w;
    const options *o;
    uint32_t n;
    engine **e;
    kvs_router *router;      /* NULL with one engine */
    double *loads;
    fleet_report *fr;
    double qnext, qstep;     /* the next queue sample's time, the interval */
} fleet;

static kvs_router *make_router(const options *o)
{
    kvs_router_config rc;
    kvs_router *r;
    int rv;
    memset(&rc, 0, sizeof rc);
    rc.num_workers = o->engines;
    rc.policy = (kvs_route_policy)o->route;
    rc.expected_blocks = o->engines * o->device_blocks;
    if ((rv = kvs_router_create(&rc, &r)) != KVS_OK) die(2, "kvs_router_create: %s", kvs_router_result_string(rv));
    return r;
}

/* The engine for request req, and the blocks the router expects it to hold. */
static uint32_t route(fleet *f, size_t req, size_t *overlap)
{
    const sim_req *r = &f->w->reqs[req];
    uint32_t to = 0, i;
    *overlap = 0;
    if (!f->router) return 0;
    for (i = 0; i < f->n; i++) f->loads[i] = engine_backlog(f->e[i]) + ACTIVE_WEIGHT * engine_active(f->e[i]);
    if (f->w->is_trace) check_kv(kvs_router_route(f->router, r->hashes, r->num_blocks, f->loads, &to, overlap), "route");
    else check_kv(kvs_router_route_key(f->router, r->conv, r->hashes, r->num_blocks, f->loads, &to, overlap), "route");
    return to;
}

/* The busy engine with the earliest clock (ties: the lowest index), or NULL when all are idle. */
static engine *next_engine(const fleet *f)
{
    engine *best = NULL;
    uint32_t i;
    for (i = 0; i < f->n; i++)
        if (!engine_idle(f->e[i]) && (!best || engine_clock(f->e[i]) < engine_clock(best))) best = f->e[i];
    return best;
}

static void queue_record(fleet *f, double at)
{
    fleet_report *fr = f->fr;
    uint32_t i;
    fr->qt = (double *)xrealloc(fr->qt, (fr->nq + 1) * sizeof *fr->qt);
    fr->qlen = (uint32_t *)xrealloc(fr->qlen, (fr->nq + 1) * f->n * sizeof *fr->qlen);
    fr->qt[fr->nq] = at;
    for (i = 0; i < f->n; i++) fr->qlen[fr->nq * f->n + i] = (uint32_t)engine_queue(f->e[i]);
    fr->nq++;
}

/* The queues at each sample time t has passed: the first and the last of them when it passed several
 * (the queues stood still in between), so a clock far past the samples (a run that drains long after a
 * short trace) costs two samples, not millions. */
static void queue_sample(fleet *f, double t)
{
    double last;
    if (!f->fr || t < f->qnext) return;
    last = f->qnext + floor((t - f->qnext) / f->qstep) * f->qstep;
    queue_record(f, f->qnext);
    if (last > f->qnext) queue_record(f, last);
    f->qnext = last + f->qstep;
}

/* Hit totals of the fleet and the mean occupancy of each tier, for --svg. */
static void fleet_sample(const fleet *f, series *sv, double x)
{
    uint64_t hits[TIER_ALL], prompt = 0;
    float occ[TIER_ALL];
    double sum[TIER_ALL];
    int have[TIER_ALL], k;
    uint32_t i;
    memset(hits, 0, sizeof hits);
    memset(sum, 0, sizeof sum);
    memset(have, 0, sizeof have);
    for (i = 0; i < f->n; i++) {
        const results *r = engine_results(f->e[i]);
        float o1[TIER_ALL];
        tiers_occupancy(engine_tiers(f->e[i]), o1);
        for (k = 0; k < TIER_ALL; k++) {
            hits[k] += r->tier_hits[k];
            if (o1[k] >= 0) {
                sum[k] += o1[k];
                have[k]++;
            }
        }
        prompt += r->prompt_blocks;
    }
    for (k = 0; k < TIER_ALL; k++) occ[k] = have[k] ? (float)(sum[k] / have[k]) : -1.0f;
    series_add(sv, x, hits, prompt, occ, tiers_fol_step(engine_tiers(f->e[0]))); /* engine 1's step */
}

/* The fleet's totals from its engines' (the TTFT and CPU arrays concatenated). */
static void add_results(results *to, const results *r, int first)
{
    int k;
    to->requests += r->requests;
    to->prompt_blocks += r->prompt_blocks;
    to->hit_blocks += r->hit_blocks;
    for (k = 0; k < TIER_ALL; k++) {
        to->tier_hits[k] += r->tier_hits[k];
        to->tr.down_blocks[k] += r->tr.down_blocks[k];
        to->tr.down_bytes[k] += r->tr.down_bytes[k];
        to->tr.up_blocks[k] += r->tr.up_blocks[k];
        to->tr.up_bytes[k] += r->tr.up_bytes[k];
        to->tr.evictions[k] += r->tr.evictions[k];
        if (first) {
            to->tr.down_from[k] = r->tr.down_from[k];
            to->tr.present[k] = r->tr.present[k];
        }
    }
    to->tr.redis.imported += r->tr.redis.imported;
    to->tr.redis.checksum_errors += r->tr.redis.checksum_errors;
    to->tr.redis.io_errors += r->tr.redis.io_errors;
    to->tr.redis.misses += r->tr.redis.misses;
    to->tr.redis.remote_errors += r->tr.redis.remote_errors;
    to->tr.redis.lookup_errors += r->tr.redis.lookup_errors;
    to->tr.redis.disconnects += r->tr.redis.disconnects;
    to->tr.redis.connect_failures += r->tr.redis.connect_failures;
    to->ttft = (double *)xrealloc(to->ttft, (to->nttft + r->nttft) * sizeof *to->ttft);
    if (r->nttft) memcpy(to->ttft + to->nttft, r->ttft, r->nttft * sizeof *r->ttft);
    to->nttft += r->nttft;
    to->cpu = (double *)xrealloc(to->cpu, (to->ncpu + r->ncpu) * sizeof *to->cpu);
    if (r->ncpu) memcpy(to->cpu + to->ncpu, r->cpu, r->ncpu * sizeof *r->cpu);
    to->ncpu += r->ncpu;
    to->steps += r->steps;
    to->preempted += r->preempted;
    to->prefill_tokens += r->prefill_tokens;
    to->busy_seconds += r->busy_seconds;
    to->verified += r->verified;
    to->mismatches += r->mismatches;
    if (r->sim_seconds > to->sim_seconds) to->sim_seconds = r->sim_seconds;
    if (first) {
        snprintf(to->disk_note, sizeof to->disk_note, "%s", r->disk_note);
        to->metrics = r->metrics;
    }
}

/* Requests skipped as too big for an engine: the request and its conversation's later turns. */
static size_t skip_chain(const workload *w, size_t req)
{
    size_t n = 0;
    int32_t x = (int32_t)req;
    for (; x >= 0; x = w->reqs[x].next_turn) n++;
    return n;
}

void run_fleet(const workload *w, const options *o, int cache_on, results *res, fleet_report *fr, series *sv,
               int progress)
{
    fleet f;
    live *L = (live *)xcalloc(w->n, sizeof *L);
    heap hp;
    observer ob;
    double obs_now = 0, wall0 = wall_now(), shown = 0, last_x = 0, sim = 0, svg_next = 0;
    size_t remaining = w->n, q, skipped = 0, steps = 0;
    const char *label = cache_on ? "cache on" : "cache off";
    uint32_t i;
    capacity cap = offered_load(w);

    memset(&f, 0, sizeof f);
    memset(&hp, 0, sizeof hp);
    f.w = w;
    f.o = o;
    f.n = o->engines ? o->engines : 1;
    f.e = (engine **)xcalloc(f.n, sizeof *f.e);
    f.loads = (double *)xcalloc(f.n, sizeof *f.loads);
    f.fr = fr;
    f.qstep = cap.span_s > 0 ? cap.span_s / 200 : 1.0;
    f.qnext = w->n ? w->reqs[w->order[0]].arrival : 0; /* a trace's clock may start anywhere (epoch times) */
    if (fr) {
        memset(fr, 0, sizeof *fr);
        fr->n = f.n;
    }
    if (f.n > 1) f.router = make_router(o);
    if (cache_on) observer_start(&ob, o, &obs_now); /* one engine only (main checks) */
    else memset(&ob, 0, sizeof ob);
    for (i = 0; i < f.n; i++)
        f.e[i] = engine_open(i, w, o, cache_on, L, ob.bus, f.router ? kvs_router_feed(f.router, i) : NULL);
    for (q = 0; q < w->n; q++)
        if (w->is_trace || w->reqs[q].turn == 0) heap_push(&hp, w->reqs[q].arrival, q);
    if (sv) fleet_sample(&f, sv, 0);

    while (remaining) {
        engine *e = next_engine(&f);
        const size_t *done;
        size_t nd, k;
        if (hp.n && (!e || hp.e[0].t <= engine_clock(e))) { /* an arrival: route it */
            ev a = heap_pop(&hp);
            size_t overlap;
            uint32_t to = route(&f, a.req, &overlap);
            engine *x = f.e[to];
            if (engine_idle(x) && engine_clock(x) < a.t) engine_set_clock(x, a.t);
            obs_now = engine_clock(x);
            if (!engine_add(x, a.req, a.t, (double)(w->reqs[a.req].num_blocks - overlap))) {
                size_t n = skip_chain(w, a.req); /* it, and its conversation's later turns, can never run */
                skipped += n;
                remaining -= n;
                continue;
            }
            if (fr && engine_queue(x) > engine_results(x)->queue_max)
                engine_results(x)->queue_max = (uint32_t)engine_queue(x);
            continue;
        }
        if (!e) die(2, "internal: %zu requests unfinished and none to come", remaining);
        obs_now = engine_clock(e);
        queue_sample(&f, obs_now);
        nd = engine_step(e, &done);
        for (k = 0; k < nd; k++) {
            const sim_req *r = &w->reqs[done[k]];
            remaining--;
            if (r->next_turn >= 0) heap_push(&hp, engine_clock(e) + w->reqs[r->next_turn].think, (size_t)r->next_turn);
        }
        steps++;
        if (engine_clock(e) > last_x) last_x = engine_clock(e);
        if (sv && (f.n == 1 || last_x >= svg_next)) { /* a fleet: some 2,000 samples, not one per step */
            fleet_sample(&f, sv, last_x);
            svg_next = last_x + f.qstep / 10;
        }
        if (cache_on && o->pace_us) pace(o->pace_us);
        if (progress && (steps & 255) == 0 && wall_now() - shown > 0.1) {
            shown = wall_now();
            show_progress(label, w->n - remaining, w->n, last_x, 0);
        }
    }
    if (progress) show_progress(label, 0, 0, 0, 1);
    memset(res, 0, sizeof *res);
    for (i = 0; i < f.n; i++) engine_close(f.e[i]);
    for (i = 0; i < f.n; i++) {
        results *r = engine_results(f.e[i]);
        add_results(res, r, i == 0);
        if (r->sim_seconds > sim) sim = r->sim_seconds;
    }
    res->skipped = skipped;
    res->wall_seconds = wall_now() - wall0;
    if (fr) { /* each engine's results move to the report; queue means from the samples */
        fr->engine = (results *)xcalloc(f.n, sizeof *fr->engine);
        for (i = 0; i < f.n; i++) {
            results *r = engine_results(f.e[i]);
            double sum = 0;
            for (q = 0; q < fr->nq; q++) sum += fr->qlen[q * f.n + i];
            r->queue_mean = fr->nq ? sum / (double)fr->nq : 0;
            fr->engine[i] = *r;
            r->ttft = r->cpu = NULL;
        }
    }
    for (i = 0; i < f.n; i++) {
        results *r = engine_results(f.e[i]);
        free(r->ttft);
        free(r->cpu);
        engine_free(f.e[i]);
    }
    kvs_router_destroy(f.router);
    observer_stop(&ob);
    for (q = 0; q < w->n; q++) free(L[q].load_tier);
    free(L);
    free(hp.e);
    free(f.e);
    free(f.loads);
}

void fleet_report_free(fleet_report *fr)
{
    uint32_t i;
    if (!fr->engine) return;
    for (i = 0; i < fr->n; i++) {
        free(fr->engine[i].ttft);
        free(fr->engine[i].cpu);
    }
    free(fr->engine);
    free(fr->qt);
    free(fr->qlen);
    memset(fr, 0, sizeof *fr);
}
