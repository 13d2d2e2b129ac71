/* workloads.h — synthetic traffic that looks like production, for tuning and testing eviction (part of
 * kvcache's examples; used by examples/workloads.c, tests/test_policy_workloads.c and the README table)
 *
 * Include it in one C file with WORKLOADS_IMPLEMENTATION defined (it is small and all static).
 *
 * A workload is a list of requests in arrival order; each request's prompt is a list of segments (a
 * system prompt, a document, a user turn, a model answer, a tool result), each with an id and a length
 * in tokens. Two prompts share a block exactly when they share every segment up to the block's end, so
 * block identities are chained hashes of the segment pieces, as the prefix hashes of a real engine
 * are. The shapes (wl_shape):
 *   chat   multi-turn sessions: a system prompt shared by many users (Zipf over 2,000), turns that carry the
 *          whole history, heavy-tailed turn counts and think times (lognormal, median 60 s, some hours)
 *   api    API traffic: per-application templates (system prompt + few-shot examples, Zipf over 20,000
 *          applications), then a unique query; a few exact repeats
 *   docs   one-off long documents (median 12k tokens) behind a short shared prompt; a third get a few
 *          follow-up questions within minutes
 *   agent  agent and tool loops: a tool-system prompt, then 5 to 100 calls whose context grows by the
 *          model's call and the tool's result each time, seconds apart
 *   burst  chat traffic with bursts of cold batch jobs (long unique prompts) that sweep the cache
 *   mixed  chat 40%, api 30%, agent 15%, docs 15% of the sessions, on one timeline
 *   longchat  long-context chat, where reuse is far apart: many concurrent conversations, half of them
 *          short-lived (minutes apart, a third go on), half long-running (ten minutes apart, four in five
 *          go on); 60% open with a document (median 10k tokens), 40% of those a popular shared one (Zipf
 *          over 10,000); system prompts Zipf over 100. A small pool keeps little by recency: what pays is
 *          keeping the documents and conversations that come back (frequency), as on public chat traces
 *   templates  API and tool traffic behind long per-application templates (system prompt Zipf over 20,
 *          template Zipf 0.7 over 5,000, median 5k tokens), a unique query each, sessions that call
 *          again after about two minutes half the time
 *   apisessions  busy API traffic behind many long templates (Zipf 0.8 over 20,000 applications, median
 *          6k tokens): nine in ten clients hold a session of quick calls (seconds apart, four in five go
 *          on) that each add a short turn; the rest make one call. How a cache ages what it remembers
 *          of evicted blocks decides most of what it keeps here (README, Eviction)
 * Lengths are scaled by `token_scale` (1 for 512-token blocks; smaller keeps 16-token workloads short).
 * Deterministic for a seed: the same call gives the same workload on every machine.
 *
 * Blocks: a request's blocks are the full blocks of its prompt, what an engine caches. With
 * WL_PARTIAL_TAIL the last, partial block of a prompt is a block too, as in a trace that names every
 * block of a prompt (Mooncake's hash_ids, which `serve_sim --trace --sequential` replays): it is shared
 * only by an identical prompt, since the next turn of a conversation fills it with more tokens, so most
 * such tails are never used again (README, Eviction: "Dead tails").
 */
#ifndef WORKLOADS_H
#define WORKLOADS_H
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define WL_FN static __attribute__((unused)) /* a program need not call every function */
#else
#define WL_FN static
#endif

typedef enum wl_shape { WL_CHAT, WL_API, WL_DOCS, WL_AGENT, WL_BURST, WL_MIXED, WL_LONGCHAT, WL_TEMPLATES, WL_APISESSIONS, WL__COUNT } wl_shape;

typedef struct wl_req {
    double t;                 /* arrival, seconds */
    uint32_t prompt_tokens;
    uint32_t output_tokens;
    uint32_t num_blocks;      /* full blocks of the prompt (and its partial last one, WL_PARTIAL_TAIL) */
    uint32_t last_tokens;     /* WL_PARTIAL_TAIL: the prompt's tokens in its partial last block (0: none) */
    uint64_t *blocks;         /* their chained identities (nonzero), block 0 first */
} wl_req;

typedef struct wl_trace {
    wl_req *req;              /* arrival order */
    size_t n;
    uint64_t total_blocks;    /* sum of num_blocks */
    uint64_t unique_blocks;   /* distinct identities: the working set */
    uint64_t *store;          /* all block identities */
    uint32_t block_tokens;    /* tokens per block */
} wl_trace;

enum { WL_PARTIAL_TAIL = 1 }; /* wl_generate flags: a prompt's partial last block is a block too */

WL_FN const char *wl_shape_name(wl_shape s);
WL_FN int wl_shape_from_name(const char *name, wl_shape *out);
/* Generate about `requests` requests of one shape; flags: 0 or WL_PARTIAL_TAIL. Returns 0, or -1 on bad
 * arguments or when out of memory. */
WL_FN int wl_generate(wl_shape shape, uint32_t block_tokens, uint32_t requests, double token_scale, uint64_t seed,
                       unsigned flags, wl_trace *out);
WL_FN void wl_free(wl_trace *w);
#ifdef KVBLOCK_H
/* Replay a workload through a pool as serve_sim --sequential does: per request, match the cached prefix
 * (at most the pool's size), allocate and register the rest, release the whole chain, telling the pool
 * when the prompt ends inside its last block (WL_PARTIAL_TAIL). The pool is created from cfg (num_blocks
 * and eviction set by the caller; block_tokens is the workload's). Returns the block hit rate over all
 * prompt blocks, or -1 when a call fails; *out_stats (may be NULL) gets the pool's final statistics. */
WL_FN double wl_replay(const wl_trace *w, const kvb_pool_config *cfg, kvb_pool_stats *out_stats);
#endif
#endif

#ifdef WORKLOADS_IMPLEMENTATION
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const wl__names[WL__COUNT] = {"chat", "api", "docs", "agent", "burst", "mixed", "longchat", "templates", "apisessions"};

WL_FN const char *wl_shape_name(wl_shape s) { return (unsigned)s < WL__COUNT ? wl__names[s] : "?"; }

WL_FN int wl_shape_from_name(const char *name, wl_shape *out)
{
    int i;
    for (i = 0; i < WL__COUNT; i++)
        if (!strcmp(name, wl__names[i])) {
            *out = (wl_shape)i;
            return 0;
        }
    return -1;
}

/* ---- randomness ---- */
typedef struct wl__rng { uint64_t s; } wl__rng;
static uint64_t wl__mix(uint64_t x)
{
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}
static uint64_t wl__next(wl__rng *r) { return wl__mix(r->s += UINT64_C(0x9e3779b97f4a7c15)); }
static double wl__unit(wl__rng *r) { return ((double)(wl__next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
static double wl__exp(wl__rng *r, double mean) { return -mean * log(wl__unit(r)); }
static double wl__normal(wl__rng *r) { return sqrt(-2.0 * log(wl__unit(r))) * cos(6.283185307179586 * wl__unit(r)); }
static double wl__lognormal(wl__rng *r, double median, double sigma) { return median * exp(sigma * wl__normal(r)); }
static uint32_t wl__geometric(wl__rng *r, double mean) { return (uint32_t)floor(wl__exp(r, mean)); }

/* Zipf(s) over n items by inversion of a precomputed CDF. */
typedef struct wl__zipf { double *cdf; uint32_t n; } wl__zipf;
static int wl__zipf_make(wl__zipf *z, uint32_t n, double s)
{
    double sum = 0;
    uint32_t i;
    z->n = n;
    z->cdf = (double *)malloc(n * sizeof *z->cdf);
    if (!z->cdf) return -1;
    for (i = 0; i < n; i++) z->cdf[i] = (sum += pow((double)i + 1.0, -s));
    for (i = 0; i < n; i++) z->cdf[i] /= sum;
    return 0;
}
static uint32_t wl__zipf_draw(const wl__zipf *z, wl__rng *r)
{
    double u = wl__unit(r);
    uint32_t lo = 0, hi = z->n - 1;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (z->cdf[mid] < u) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* ---- prompts as segment lists ---- */
typedef struct wl__seg { uint64_t id; uint32_t len; } wl__seg;
typedef struct wl__pending { double t; uint32_t output; size_t first, nseg; } wl__pending; /* segs [first, +nseg) */

typedef struct wl__gen {
    wl__rng rng;
    double scale;
    wl__seg *segs;            /* every pending request's segments, back to back */
    size_t nsegs, capsegs;
    wl__pending *req;
    size_t nreq, capreq;
    uint64_t next_id;         /* unique segment ids */
    wl__zipf sys, apps, tools, capps, docsys, lsys, ldocs, tsys, tmpl;
    int fail;
} wl__gen;

static void *wl__grow(void *p, size_t *cap, size_t need, size_t size, int *fail)
{
    size_t c = *cap ? *cap : 64;
    void *q;
    if (need <= *cap) return p;
    while (c < need) c *= 2;
    q = realloc(p, c * size);
    if (!q) {
        *fail = 1;
        return p;
    }
    *cap = c;
    return q;
}

static uint32_t wl__len(wl__gen *g, double median, double sigma, double max)
{
    double v = wl__lognormal(&g->rng, median, sigma) * g->scale;
    if (v > max * g->scale) v = max * g->scale;
    return v < 1 ? 1u : (uint32_t)v;
}

/* Stable length of a shared segment: drawn from its id, so every user of it sees the same one. */
static uint32_t wl__shared_len(wl__gen *g, uint64_t id, double median, double sigma)
{
    wl__rng r = {wl__mix(id ^ UINT64_C(0x51ed270b27a1d3c5))};
    double v = wl__lognormal(&r, median, sigma) * g->scale;
    return v < 1 ? 1u : (uint32_t)v;
}

/* A session's context: the segments every later request of it starts with. */
typedef struct wl__ctx { wl__seg *s; size_t n, cap; } wl__ctx;
static void wl__ctx_add(wl__gen *g, wl__ctx *c, uint64_t id, uint32_t len)
{
    c->s = (wl__seg *)wl__grow(c->s, &c->cap, c->n + 1, sizeof *c->s, &g->fail);
    if (g->fail) return;
    c->s[c->n].id = id;
    c->s[c->n].len = len;
    c->n++;
}

/* A request whose prompt is the context (and, already in it, its newest segment). */
static void wl__emit(wl__gen *g, double t, const wl__ctx *c, uint32_t output)
{
    g->segs = (wl__seg *)wl__grow(g->segs, &g->capsegs, g->nsegs + c->n, sizeof *g->segs, &g->fail);
    g->req = (wl__pending *)wl__grow(g->req, &g->capreq, g->nreq + 1, sizeof *g->req, &g->fail);
    if (g->fail) return;
    memcpy(g->segs + g->nsegs, c->s, c->n * sizeof *c->s);
    g->req[g->nreq].t = t;
    g->req[g->nreq].output = output;
    g->req[g->nreq].first = g->nsegs;
    g->req[g->nreq].nseg = c->n;
    g->nsegs += c->n;
    g->nreq++;
}

static uint64_t wl__fresh(wl__gen *g) { return ++g->next_id; }
#define WL__SHARED(kind, i) ((UINT64_C(1) << 62) | ((uint64_t)(kind) << 40) | (uint64_t)(i))

static void wl__chat_session(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t turns = 1 + (uint32_t)fmin(60.0, floor(wl__exp(&g->rng, 1.0) * wl__exp(&g->rng, 2.0)));
    uint32_t sys = wl__zipf_draw(&g->sys, &g->rng), i;
    wl__ctx_add(g, &c, WL__SHARED(1, sys), wl__shared_len(g, WL__SHARED(1, sys), 2000, 0.7));
    for (i = 0; i < turns && !g->fail; i++) {
        uint32_t out = wl__len(g, 350, 0.8, 4000);
        wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 500, 1.5, 60000)); /* the user's turn, pasted text too */
        wl__emit(g, t, &c, out);
        wl__ctx_add(g, &c, wl__fresh(g), out); /* the answer joins the history */
        t += wl__lognormal(&g->rng, 60.0, 2.0);
    }
    free(c.s);
}

static void wl__api_request(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t app = wl__zipf_draw(&g->apps, &g->rng);
    wl__ctx_add(g, &c, WL__SHARED(2, app), wl__shared_len(g, WL__SHARED(2, app), 1500, 1.0));
    if (app % 3 == 0) /* few-shot examples shared by the application's callers */
        wl__ctx_add(g, &c, WL__SHARED(3, app), wl__shared_len(g, WL__SHARED(3, app), 2500, 0.7));
    if (wl__unit(&g->rng) < 0.05) /* an exact repeat of a popular query */
        wl__ctx_add(g, &c, WL__SHARED(4, app * 8 + (uint32_t)(wl__next(&g->rng) % 8)), 600 * g->scale < 1 ? 1 : (uint32_t)(600 * g->scale));
    else
        wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 800, 1.3, 30000));
    wl__emit(g, t, &c, wl__len(g, 150, 1.0, 4000));
    free(c.s);
}

static void wl__docs_session(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t sys = wl__zipf_draw(&g->docsys, &g->rng), follow = 0, i;
    wl__ctx_add(g, &c, WL__SHARED(5, sys), wl__shared_len(g, WL__SHARED(5, sys), 400, 0.5));
    wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 12000, 0.7, 120000)); /* the document */
    wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 60, 0.8, 2000));
    if (wl__unit(&g->rng) < 0.33) follow = 1 + wl__geometric(&g->rng, 2.0);
    for (i = 0; i <= follow && !g->fail; i++) {
        uint32_t out = wl__len(g, 400, 0.7, 4000);
        if (i) wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 60, 0.8, 2000));
        wl__emit(g, t, &c, out);
        wl__ctx_add(g, &c, wl__fresh(g), out);
        t += wl__exp(&g->rng, 90.0);
    }
    free(c.s);
}

static void wl__agent_session(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t tool = wl__zipf_draw(&g->tools, &g->rng), calls = 5 + (uint32_t)fmin(95.0, wl__geometric(&g->rng, 12.0)), i;
    wl__ctx_add(g, &c, WL__SHARED(6, tool), wl__shared_len(g, WL__SHARED(6, tool), 6000, 0.5));
    wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 300, 1.0, 8000)); /* the task */
    for (i = 0; i < calls && !g->fail; i++) {
        uint32_t out = wl__len(g, 150, 0.8, 2000);
        wl__emit(g, t, &c, out);
        wl__ctx_add(g, &c, wl__fresh(g), out);                            /* the model's call */
        wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 900, 1.3, 30000));    /* the tool's result */
        t += 1.0 + wl__exp(&g->rng, 4.0);
    }
    free(c.s);
}

/* Turns of a conversation on context c: each adds the user's turn, runs, then adds the answer; after a
 * think time (lognormal) it goes on with probability p_more. */
static void wl__turns(wl__gen *g, wl__ctx *c, double t, double user_median, double think_median, double think_sigma,
                      double p_more)
{
    do {
        uint32_t out = wl__len(g, 350, 0.8, 4000);
        wl__ctx_add(g, c, wl__fresh(g), wl__len(g, user_median, 1.2, 30000));
        wl__emit(g, t, c, out);
        wl__ctx_add(g, c, wl__fresh(g), out);
        t += wl__lognormal(&g->rng, think_median, think_sigma);
    } while (!g->fail && c->n < 400 && wl__unit(&g->rng) < p_more);
}

static void wl__longchat_session(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t sys = wl__zipf_draw(&g->lsys, &g->rng);
    int long_running = wl__unit(&g->rng) < 0.5;
    wl__ctx_add(g, &c, WL__SHARED(7, sys), wl__shared_len(g, WL__SHARED(7, sys), 800, 0.8));
    if (wl__unit(&g->rng) < 0.6) {
        if (wl__unit(&g->rng) < 0.4) {
            uint32_t d = wl__zipf_draw(&g->ldocs, &g->rng);
            wl__ctx_add(g, &c, WL__SHARED(8, d), wl__shared_len(g, WL__SHARED(8, d), 10000, 0.9));
        } else {
            wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 10000, 0.9, 120000));
        }
    }
    if (long_running) wl__turns(g, &c, t, 300, 600.0, 0.8, 0.8);
    else wl__turns(g, &c, t, 300, 300.0, 1.2, 0.35);
    free(c.s);
}

static void wl__templates_session(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t sys = wl__zipf_draw(&g->tsys, &g->rng), tmpl = wl__zipf_draw(&g->tmpl, &g->rng);
    wl__ctx_add(g, &c, WL__SHARED(9, sys), wl__shared_len(g, WL__SHARED(9, sys), 1000, 0.8));
    wl__ctx_add(g, &c, WL__SHARED(10, tmpl), wl__shared_len(g, WL__SHARED(10, tmpl), 5000, 0.9));
    wl__turns(g, &c, t, 600, 120.0, 1.2, 0.5);
    free(c.s);
}

static void wl__apisessions_client(wl__gen *g, double t)
{
    wl__ctx c = {0};
    uint32_t app = wl__zipf_draw(&g->capps, &g->rng);
    wl__ctx_add(g, &c, WL__SHARED(11, app), wl__shared_len(g, WL__SHARED(11, app), 6000, 1.0));
    if (wl__unit(&g->rng) < 0.9) {
        wl__turns(g, &c, t, 100, 5.0, 0.5, 0.8);
    } else {
        uint32_t out = wl__len(g, 350, 0.8, 4000);
        wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 100, 1.3, 30000));
        wl__emit(g, t, &c, out);
    }
    free(c.s);
}

static void wl__cold_request(wl__gen *g, double t)
{
    wl__ctx c = {0};
    wl__ctx_add(g, &c, wl__fresh(g), wl__len(g, 5000, 0.6, 60000));
    wl__emit(g, t, &c, wl__len(g, 100, 0.5, 1000));
    free(c.s);
}

static int wl__cmp_pending(const void *a, const void *b)
{
    const wl__pending *x = (const wl__pending *)a, *y = (const wl__pending *)b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return (x->first > y->first) - (x->first < y->first);
}

/* Sessions start as a Poisson process; each shape's rate gives about 4 requests a second in all (busy
 * API traffic, apisessions, about 50). */
static void wl__sessions(wl__gen *g, wl_shape shape, uint32_t requests)
{
    double t = 0, next_burst = 600.0;
    while (g->nreq < requests && !g->fail) {
        wl_shape s = shape;
        double u = wl__unit(&g->rng);
        if (shape == WL_MIXED) s = u < 0.4 ? WL_CHAT : u < 0.7 ? WL_API : u < 0.85 ? WL_AGENT : WL_DOCS;
        switch (s) {
        case WL_CHAT: t += wl__exp(&g->rng, 1.0); wl__chat_session(g, t); break;
        case WL_API: t += wl__exp(&g->rng, 0.25); wl__api_request(g, t); break;
        case WL_DOCS: t += wl__exp(&g->rng, 0.5); wl__docs_session(g, t); break;
        case WL_AGENT: t += wl__exp(&g->rng, 5.0); wl__agent_session(g, t); break;
        case WL_LONGCHAT: t += wl__exp(&g->rng, 1.0); wl__longchat_session(g, t); break;
        case WL_TEMPLATES: t += wl__exp(&g->rng, 0.5); wl__templates_session(g, t); break;
        case WL_APISESSIONS: t += wl__exp(&g->rng, 0.1); wl__apisessions_client(g, t); break;
        case WL_BURST:
            t += wl__exp(&g->rng, 1.0);
            wl__chat_session(g, t);
            if (t >= next_burst) { /* a batch job: a few hundred cold prompts within a minute */
                uint32_t n = 100 + (uint32_t)(wl__next(&g->rng) % 300), i;
                for (i = 0; i < n && !g->fail; i++) wl__cold_request(g, t + 60.0 * i / n);
                next_burst = t + wl__exp(&g->rng, 900.0);
            }
            break;
        default: break;
        }
    }
}

static int wl__cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Chained identities of the full blocks of segments segs[0..n) (and of the partial last one with
 * `tail`): a running hash over the pieces, so a partial block's identity differs from that of the same
 * block filled further. */
static uint32_t wl__blocks(const wl__seg *segs, size_t n, uint32_t bt, int tail, uint64_t *out)
{
    uint64_t h = UINT64_C(0x243f6a8885a308d3);
    uint32_t fill = 0, nb = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t off = 0;
        while (off < segs[i].len) {
            uint32_t take = segs[i].len - off < bt - fill ? segs[i].len - off : bt - fill;
            h = wl__mix(h ^ wl__mix(segs[i].id * UINT64_C(0x9e3779b97f4a7c15) + ((uint64_t)off << 20) + take));
            fill += take;
            off += take;
            if (fill == bt) {
                if (out) out[nb] = h | 1;
                nb++;
                fill = 0;
            }
        }
    }
    if (tail && fill) {
        if (out) out[nb] = wl__mix(h ^ UINT64_C(0x7a11)) | 1;
        nb++;
    }
    return nb;
}

WL_FN int wl_generate(wl_shape shape, uint32_t block_tokens, uint32_t requests, double token_scale, uint64_t seed,
                       unsigned flags, wl_trace *out)
{
    int tail = (flags & WL_PARTIAL_TAIL) != 0;
    wl__gen g;
    size_t i, total = 0, off = 0;
    memset(out, 0, sizeof *out);
    memset(&g, 0, sizeof g);
    if ((unsigned)shape >= WL__COUNT || !block_tokens || token_scale <= 0 || (flags & ~(unsigned)WL_PARTIAL_TAIL)) return -1;
    g.rng.s = wl__mix(seed * 0x2545f4914f6cdd1dULL + (uint64_t)shape * 7919 + 1);
    g.scale = token_scale;
    if (wl__zipf_make(&g.sys, 2000, 0.9) || wl__zipf_make(&g.apps, 20000, 0.8) || wl__zipf_make(&g.tools, 20, 1.0) ||
        wl__zipf_make(&g.lsys, 100, 1.0) || wl__zipf_make(&g.ldocs, 10000, 0.9) || wl__zipf_make(&g.tsys, 20, 1.0) ||
        wl__zipf_make(&g.tmpl, 5000, 0.7) || wl__zipf_make(&g.capps, 20000, 0.8) ||
        wl__zipf_make(&g.docsys, 10, 1.0))
        g.fail = 1;
    /* Sessions start until twice the requests exist; the earliest `requests` by arrival are kept, so the
     * trace is a window of steady traffic, not its ramp-down (the last sessions' later turns, hours on). */
    if (!g.fail) wl__sessions(&g, shape, requests > UINT32_MAX / 2 ? UINT32_MAX : 2 * requests);
    if (!g.fail) qsort(g.req, g.nreq, sizeof *g.req, wl__cmp_pending);
    if (!g.fail && g.nreq > requests) g.nreq = requests;
    for (i = 0; i < g.nreq && !g.fail; i++) total += wl__blocks(g.segs + g.req[i].first, g.req[i].nseg, block_tokens, tail, NULL);
    if (!g.fail) {
        out->req = (wl_req *)calloc(g.nreq ? g.nreq : 1, sizeof *out->req);
        out->store = (uint64_t *)malloc((total ? total : 1) * sizeof *out->store);
        if (!out->req || !out->store) g.fail = 1;
    }
    for (i = 0; i < g.nreq && !g.fail; i++) {
        wl_req *r = &out->req[i];
        size_t j;
        r->t = g.req[i].t;
        r->blocks = out->store + off;
        r->num_blocks = wl__blocks(g.segs + g.req[i].first, g.req[i].nseg, block_tokens, tail, r->blocks);
        for (j = 0; j < g.req[i].nseg; j++) r->prompt_tokens += g.segs[g.req[i].first + j].len;
        r->last_tokens = tail ? r->prompt_tokens % block_tokens : 0;
        r->output_tokens = g.req[i].output;
        off += r->num_blocks;
    }
    out->n = g.fail ? 0 : g.nreq;
    out->total_blocks = total;
    out->block_tokens = block_tokens;
    if (!g.fail && total) { /* distinct identities: sort a copy */
        uint64_t *c = (uint64_t *)malloc(total * sizeof *c);
        if (c) {
            size_t u = 0;
            memcpy(c, out->store, total * sizeof *c);
            qsort(c, total, sizeof *c, wl__cmp_u64);
            for (i = 0; i < total; i++) u += !i || c[i] != c[i - 1];
            out->unique_blocks = u;
            free(c);
        }
    }
    free(g.segs);
    free(g.req);
    free(g.sys.cdf);
    free(g.apps.cdf);
    free(g.tools.cdf);
    free(g.docsys.cdf);
    free(g.lsys.cdf);
    free(g.ldocs.cdf);
    free(g.tsys.cdf);
    free(g.tmpl.cdf);
    free(g.capps.cdf);
    if (g.fail) {
        wl_free(out);
        return -1;
    }
    return 0;
}

#ifdef KVBLOCK_H
static kvb_hash wl__block_hash(uint64_t id)
{
    kvb_hash h;
    h.lo = wl__mix(id); /* ids are odd: the low bits an index uses must vary */
    h.hi = wl__mix(id ^ UINT64_C(0x6a09e667f3bcc909));
    return h;
}

WL_FN double wl_replay(const wl_trace *w, const kvb_pool_config *cfg, kvb_pool_stats *out_stats)
{
    uint32_t cap = cfg->num_blocks;
    kvb_pool_config c = *cfg;
    kvb_pool *pool = NULL;
    kvb_block *blk = (kvb_block *)calloc(cap ? cap : 1, sizeof *blk);
    kvb_hash *h = (kvb_hash *)calloc((size_t)cap + 1, sizeof *h);
    uint64_t hits = 0;
    size_t q;
    kvb_release_opts rel = {0, 0};
    int ok;
    c.block_tokens = w->block_tokens;
    ok = blk && h && kvb_pool_create(&c, &pool) == KVB_OK;
    for (q = 0; ok && q < w->n; q++) {
        const wl_req *r = &w->req[q];
        size_t n = r->num_blocks < cap ? r->num_blocks : cap, m = 0, i;
        if (!n) continue;
        for (i = 0; i < n; i++) h[i + 1] = wl__block_hash(r->blocks[i]);
        ok = kvb_match(pool, h + 1, n, blk, &m) == KVB_OK;
        hits += m;
        if (ok && m < n)
            ok = kvb_alloc(pool, n - m, blk + m) == KVB_OK &&
                 kvb_register_hashed(pool, blk + m, n - m, h + 1 + m, h + m, blk + m) == KVB_OK;
        rel.last_block_tokens = n == r->num_blocks ? r->last_tokens : 0; /* a prompt cut to the pool ends whole */
        ok = ok && kvb_release(pool, blk, n, &rel) == KVB_OK;
    }
    if (ok && out_stats) kvb_pool_get_stats(pool, out_stats);
    kvb_pool_destroy(pool);
    free(blk);
    free(h);
    return !ok ? -1.0 : w->total_blocks ? (double)hits / (double)w->total_blocks : 0.0;
}
#endif

WL_FN void wl_free(wl_trace *w)
{
    free(w->req);
    free(w->store);
    memset(w, 0, sizeof *w);
}
#endif
