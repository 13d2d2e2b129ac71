/* workload.c — serve_sim's workloads: the synthetic chat workload and Mooncake JSONL traces, their
 * synthetic tokens and block hashes, in arrival order (the top of examples/serve_sim.c describes both) */
#include "sim.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* ---- random numbers ---------------------------------------------------------------------------- */

typedef struct rng { uint64_t s; } rng;
static uint64_t rng_next(rng *r) { return mix64(r->s += UINT64_C(0x9e3779b97f4a7c15)); }
static double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }
static uint32_t rng_range(rng *r, uint32_t lo, uint32_t hi) { return lo + (uint32_t)(rng_next(r) % (hi - lo + 1)); }
static double rng_exp(rng *r, double mean) { return -mean * log(1.0 - rng_unit(r)); }

/* Zipf(s) over n ranks: a cumulative table, sampled by bisection. */
typedef struct zipf { double *cdf; uint32_t n; } zipf;
static zipf zipf_make(uint32_t n, double s)
{
    zipf z;
    double sum = 0;
    uint32_t i;
    z.n = n;
    z.cdf = (double *)xcalloc(n, sizeof *z.cdf);
    for (i = 0; i < n; i++) z.cdf[i] = sum += 1.0 / pow((double)(i + 1), s);
    for (i = 0; i < n; i++) z.cdf[i] /= sum;
    return z;
}
static uint32_t zipf_draw(const zipf *z, rng *r)
{
    double u = rng_unit(r);
    uint32_t lo = 0, hi = z->n - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (z->cdf[mid] < u) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* ---- workloads ---------------------------------------------------------------------------------- */

static void *owned(workload *w, size_t bytes)
{
    void *p = xcalloc(1, bytes);
    GROW(w->owned, w->capowned, w->nowned + 1);
    w->owned[w->nowned++] = p;
    return p;
}

/* Synthetic token ids of one segment: (kind, a, b) names the segment, i the position in it. */
enum { SEG_SYSTEM = 1, SEG_DOC, SEG_USER, SEG_REPLY, SEG_TRACE_BLOCK, SEG_TRACE_TAIL, SEG_TRACE_REPLY };
static void gen_tokens(uint32_t *out, uint64_t kind, uint64_t a, uint64_t b, uint32_t n)
{
    uint64_t base = mix64(mix64(kind * UINT64_C(0x100000001b3) ^ a) ^ b);
    uint32_t i;
    for (i = 0; i < n; i++) out[i] = (uint32_t)(mix64(base + i) >> 33); /* 31-bit token ids */
}

uint32_t output_token(const workload *w, const sim_req *r, uint32_t i)
{
    uint32_t t;
    if (w->is_trace) gen_tokens(&t, SEG_TRACE_REPLY, r->conv, i, 1);
    else gen_tokens(&t, SEG_REPLY, r->conv, ((uint64_t)r->turn << 32) | i, 1);
    return t;
}

void fill_prompt(const workload *w, const sim_req *r, uint32_t *buf)
{
    uint32_t at = 0, j;
    if (w->is_trace) {
        for (j = 0; j < r->num_ids; j++, at += w->block_tokens)
            gen_tokens(buf + at, SEG_TRACE_BLOCK, r->ids[j], 0, w->block_tokens);
        if (at < r->num_prompt) gen_tokens(buf + at, SEG_TRACE_TAIL, r->line, 0, r->num_prompt - at);
        return;
    } else {
        const conv_info *c = &w->convs[r->conv];
        gen_tokens(buf, SEG_SYSTEM, c->sys, 0, w->sys_len[c->sys]);
        at = w->sys_len[c->sys];
        if (c->doc != UINT32_MAX) {
            gen_tokens(buf + at, SEG_DOC, c->doc, 0, w->doc_len[c->doc]);
            at += w->doc_len[c->doc];
        }
        for (j = 0; j <= r->turn; j++) {
            size_t q = c->first + j, i;
            gen_tokens(buf + at, SEG_USER, r->conv, j, w->user_len[q]);
            at += w->user_len[q];
            if (j == r->turn) break;
            sim_req turn; /* turn j's reply (by conversation and turn: --shard renumbers the requests) */
            memset(&turn, 0, sizeof turn);
            turn.conv = r->conv;
            turn.turn = j;
            for (i = 0; i < w->out_len[q]; i++) buf[at + i] = output_token(w, &turn, (uint32_t)i);
            at += w->out_len[q];
        }
    }
}

static sim_req *new_req(workload *w)
{
    GROW(w->reqs, w->cap, w->n + 1);
    memset(&w->reqs[w->n], 0, sizeof w->reqs[w->n]);
    w->reqs[w->n].next_turn = -1;
    return &w->reqs[w->n++];
}

/* Hashes (with the root in front) and reference keys of one token sequence. */
static void hash_tokens(workload *w, const uint32_t *tokens, size_t n, kvb_hash **out_hashes, uint64_t **out_keys)
{
    size_t nb = n / w->block_tokens, got = 0, i;
    kvb_hash *h = (kvb_hash *)owned(w, (nb + 1) * sizeof *h);
    uint64_t *k = (uint64_t *)owned(w, (nb ? nb : 1) * sizeof *k);
    kvb_hash_prompt(tokens, n, w->block_tokens, NULL, 0, 0, h + 1, nb, &got);
    for (i = 0; i < nb; i++) k[i] = h[i + 1].lo;
    *out_hashes = h + 1;
    *out_keys = k;
}

static void make_synthetic(workload *w, const options *o)
{
    rng r = {o->seed * UINT64_C(0x2545f4914f6cdd1d) + 17};
    zipf zs = zipf_make(SYN_SYSTEM, 1.1), zd = zipf_make(SYN_DOCS, 0.9);
    double t = 0;
    uint32_t i, *buf = NULL;
    size_t bufcap = 0, total = o->requests, q, capuo = 0, capuo2 = 0, capconv = 0;
    w->is_trace = 0;
    for (i = 0; i < SYN_SYSTEM; i++) w->sys_len[i] = rng_range(&r, 200, 1200);
    for (i = 0; i < SYN_DOCS; i++) w->doc_len[i] = rng_range(&r, 300, 1500);
    while (w->n < total) {
        conv_info c;
        uint32_t turns = 1, k;
        double at;
        while (turns < 10 && rng_unit(&r) < 2.0 / 3.0) turns++; /* geometric, mean 3 */
        if (turns > total - w->n) turns = (uint32_t)(total - w->n);
        t += rng_exp(&r, 1.0 / SYN_RATE);
        c.sys = zipf_draw(&zs, &r);
        c.doc = rng_unit(&r) < 0.5 ? zipf_draw(&zd, &r) : UINT32_MAX;
        c.first = (uint32_t)w->n;
        c.turns = turns;
        GROW(w->convs, capconv, w->nconv + 1);
        w->convs[w->nconv] = c;
        at = t;
        for (k = 0; k < turns; k++) {
            sim_req *rq = new_req(w);
            rq->conv = (uint32_t)w->nconv;
            rq->turn = k;
            rq->think = k ? rng_exp(&r, SYN_THINK_S) : 0;
            at += rq->think;
            rq->arrival = at;
            rq->next_turn = k + 1 < turns ? (int32_t)(w->n) : -1;
            GROW(w->user_len, capuo, w->n);
            GROW(w->out_len, capuo2, w->n);
            w->user_len[w->n - 1] = rng_range(&r, 16, 200);
            w->out_len[w->n - 1] = rng_range(&r, 16, 128);
            rq->num_output = w->out_len[w->n - 1];
        }
        w->nconv++;
    }
    /* prompt lengths, then one hash chain per conversation (every turn's prompt is a prefix of the last) */
    for (q = 0; q < w->nconv; q++) {
        conv_info *c = &w->convs[q];
        uint32_t len = w->sys_len[c->sys] + (c->doc != UINT32_MAX ? w->doc_len[c->doc] : 0), k;
        kvb_hash *h;
        uint64_t *keys;
        sim_req *last = &w->reqs[c->first + c->turns - 1];
        for (k = 0; k < c->turns; k++) {
            sim_req *rq = &w->reqs[c->first + k];
            len += w->user_len[c->first + k];
            rq->num_prompt = len;
            rq->num_blocks = len / o->block_tokens;
            len += w->out_len[c->first + k];
        }
        GROW(buf, bufcap, last->num_prompt);
        fill_prompt(w, last, buf);
        hash_tokens(w, buf, last->num_prompt, &h, &keys);
        for (k = 0; k < c->turns; k++) {
            w->reqs[c->first + k].hashes = h;
            w->reqs[c->first + k].keys = keys;
        }
    }
    free(buf);
    free(zs.cdf);
    free(zd.cdf);
}

/* ---- Mooncake JSONL traces ------------------------------------------------------------------------ */

/* A number field of a trace line into *out. A missing field is fine when `missing` is NULL (*out stays as
 * it was); otherwise it is malformed, and `missing` is added to the reason. */
static int json_uint(const cJSON *o, const char *name, double max, int integral, const char *missing, double *out,
                     char *why, size_t whylen)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v) {
        if (missing) snprintf(why, whylen, "field \"%s\" is missing%s", name, missing);
        return !missing;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > max ||
        (integral && v->valuedouble != floor(v->valuedouble))) {
        snprintf(why, whylen, "field \"%s\" must be a non-negative %s", name, integral ? "integer" : "number");
        return 0;
    }
    *out = v->valuedouble;
    return 1;
}

/* One trace line's request: the parsed object, its numbers in *ts, *in, *out and its hash ids in *ids.
 * output_length may be left out with --sequential, which never decodes (*out stays 0). NULL, with the
 * reason in why, when the line is malformed. */
static cJSON *parse_trace_line(const char *line, size_t len, const options *o, double *ts, double *in,
                               double *out, const cJSON **ids, char *why, size_t whylen)
{
    static const char no_output[] = " (the scheduler decodes that many tokens; --sequential replays without it)";
    const char *end = NULL;
    const cJSON *id;
    cJSON *obj = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    int ok = 1;
    if (!obj) {
        const char *at = cJSON_GetErrorPtr();
        snprintf(why, whylen, "not valid JSON (at column %ld)", at && at >= line && at <= line + len ? (long)(at - line) + 1 : 0L);
        return NULL;
    }
    if (strspn(end, " \t") != strlen(end)) {
        snprintf(why, whylen, "text after the JSON object (at column %ld)", (long)(end - line) + 1);
        ok = 0;
    } else if (!cJSON_IsObject(obj)) {
        snprintf(why, whylen, "not a JSON object");
        ok = 0;
    } else if (!json_uint(obj, "timestamp", 9.0e15, 0, "", ts, why, whylen) /* ms, fractions allowed */ ||
               !json_uint(obj, "input_length", 1.0e9, 1, "", in, why, whylen) ||
               !json_uint(obj, "output_length", 1.0e9, 1, o->sequential ? NULL : no_output, out, why, whylen)) {
        ok = 0;
    } else if (!cJSON_IsArray(*ids = cJSON_GetObjectItemCaseSensitive(obj, "hash_ids"))) {
        snprintf(why, whylen, "field \"hash_ids\" %s", *ids ? "must be an array" : "is missing");
        ok = 0;
    } else {
        cJSON_ArrayForEach(id, *ids) {
            if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= 9.0e15 ||
                id->valuedouble != floor(id->valuedouble)) {
                snprintf(why, whylen, "\"hash_ids\" must hold non-negative integers below 9e15 (read as "
                         "doubles: larger ids would collide)");
                ok = 0;
                break;
            }
        }
        if (ok && ((double)cJSON_GetArraySize(*ids) * o->block_tokens > 64.0 * 1024 * 1024 || *in > 64.0 * 1024 * 1024)) {
            snprintf(why, whylen, "prompt longer than 64 Mi tokens");
            ok = 0;
        } else if (ok && *in < 1 && !cJSON_GetArraySize(*ids)) {
            snprintf(why, whylen, "an empty prompt (\"input_length\" 0 and no \"hash_ids\")");
            ok = 0;
        }
    }
    if (ok) return obj;
    cJSON_Delete(obj);
    return NULL;
}

/* A compressed file, told by its first bytes: the name of the format and the command that unpacks it. */
static void refuse_packed(const char *path, const char *line, size_t len)
{
    static const struct { const char *magic, *format, *unpack; } packed[] = {
        {"\x1f\x8b", "gzip", "gunzip -k"}, {"\x28\xb5\x2f\xfd", "zstd", "unzstd"},
        {"\xfd" "7zXZ", "xz", "unxz -k"}, {"BZh", "bzip2", "bunzip2 -k"}};
    size_t i;
    for (i = 0; i < sizeof packed / sizeof packed[0]; i++)
        if (len >= strlen(packed[i].magic) && !memcmp(line, packed[i].magic, strlen(packed[i].magic)))
            die(2, "%s: %s-compressed; a trace is read as plain JSON lines: decompress it first (%s %s)", path,
                packed[i].format, packed[i].unpack, path);
}

enum { MALFORMED_SHOWN = 5 }; /* malformed lines told one by one; the rest are counted */

/* A malformed line: told (the first MALFORMED_SHOWN), counted; --strict stops at it. */
static void malformed_line(workload *w, const options *o, uint32_t lineno, const char *why)
{
    if (w->malformed++ < MALFORMED_SHOWN)
        fprintf(stderr, "serve_sim: %s:%u: %s%s\n", o->trace, lineno, why, o->skip_bad ? "; line skipped" : "");
    if (o->strict) die(2, "stopping at the first malformed line (--strict)");
}

/* A trace with more than MALFORMED_TOLERATED of its lines malformed replays only with --skip-bad: a hit
 * rate over what is left of a file in another format, or of a badly damaged one, would look like an
 * answer. Up to that share (a long trace cut off mid-line, a stray line) it replays, with a warning. */
#define MALFORMED_TOLERATED 0.01
static void check_malformed(const workload *w, const options *o, uint32_t lines)
{
    char shown[48] = "";
    if (w->malformed > MALFORMED_SHOWN) snprintf(shown, sizeof shown, " (the first %d shown above)", MALFORMED_SHOWN);
    if (!w->n)
        die(2, "%s: no requests in %u line%s%s: a trace has one JSON object a line, {\"timestamp\": ms, "
               "\"input_length\": n, \"output_length\": n, \"hash_ids\": [...]}", o->trace, lines,
            lines == 1 ? "" : "s", shown);
    if (!w->malformed) return;
    if (!o->skip_bad && (double)w->malformed > MALFORMED_TOLERATED * lines)
        die(2, "%s: %zu of %u lines malformed%s; fix them, or pass --skip-bad to replay the other %zu", o->trace,
            w->malformed, lines, shown, w->n);
    fprintf(stderr, "serve_sim: %s: %zu of %u lines malformed%s, skipped%s\n", o->trace, w->malformed, lines, shown,
            o->skip_bad ? " (--skip-bad)" : " (at most 1% of the lines: replaying the rest)");
}

/* A trace's timestamps may count from anywhere (epoch milliseconds, say): the run's clock starts at the
 * first arrival, so simulated time, the report and the charts count from there. */
static void start_clock_at_first_arrival(workload *w)
{
    double first = 0;
    size_t i;
    for (i = 0; i < w->n; i++)
        if (!i || w->reqs[i].arrival < first) first = w->reqs[i].arrival;
    for (i = 0; i < w->n; i++) w->reqs[i].arrival -= first;
}

static void load_trace(workload *w, const options *o)
{
    FILE *f = fopen(o->trace, "r");
    char *line = NULL, why[160];
    size_t linecap = 0, bufcap = 0;
    ssize_t len;
    uint32_t *buf = NULL, lineno = 0, lines = 0;
    if (!f) die(2, "%s: %s", o->trace, strerror(errno));
    w->is_trace = 1;
    while ((len = getline(&line, &linecap, f)) >= 0) {
        cJSON *obj;
        const cJSON *ids = NULL, *id;
        double ts = 0, in = 0, out = 0;
        uint32_t nids, j;
        if (++lineno == 1) refuse_packed(o->trace, line, (size_t)len);
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (strspn(line, " \t") == (size_t)len) continue; /* blank */
        lines++;
        if (!(obj = parse_trace_line(line, (size_t)len, o, &ts, &in, &out, &ids, why, sizeof why))) {
            malformed_line(w, o, lineno, why);
            continue;
        }
        {
            sim_req *rq = new_req(w);
            uint64_t *idv, *keys;
            kvb_hash *h;
            size_t n;
            nids = (uint32_t)cJSON_GetArraySize(ids);
            idv = (uint64_t *)owned(w, (nids ? nids : 1) * sizeof *idv);
            j = 0;
            cJSON_ArrayForEach(id, ids) idv[j++] = (uint64_t)id->valuedouble;
            rq->arrival = ts / 1000.0;
            rq->conv = (uint32_t)(w->n - 1);
            rq->line = lineno;
            rq->ids = idv;
            rq->num_ids = nids;
            n = (size_t)nids * o->block_tokens;
            if ((double)n < in) n = (size_t)in; /* tokens past the ids are the request's own */
            rq->num_prompt = (uint32_t)n;
            rq->num_output = out >= 1 ? (uint32_t)(out < 1e6 ? out : 1e6) : 1;
            rq->num_blocks = (uint32_t)(n / o->block_tokens);
            if (nids && in < (double)n && in > (double)(nids - 1) * o->block_tokens) /* the last id names a partial block */
                rq->last_tokens = (uint32_t)(in - (double)(nids - 1) * o->block_tokens);
            GROW(buf, bufcap, n + 1);
            fill_prompt(w, rq, buf);
            /* the reference LRU keys blocks by their chained hashes, as the pool does: an id reused under
             * another prefix is another block (its KV differs) */
            hash_tokens(w, buf, n, &h, &keys);
            rq->hashes = h;
            rq->keys = keys;
        }
        cJSON_Delete(obj);
    }
    if (ferror(f)) die(2, "%s: %s", o->trace, strerror(errno)); /* a directory, an I/O error */
    free(line);
    free(buf);
    fclose(f);
    check_malformed(w, o, lines);
    start_clock_at_first_arrival(w);
}

typedef struct arrival_key { double t; size_t i; } arrival_key;
static int cmp_arrival(const void *a, const void *b)
{
    const arrival_key *x = (const arrival_key *)a, *y = (const arrival_key *)b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* --shard i/N: keep conversation c when c % N == i (a trace's "conversation" is its request number). The
 * turns of a conversation stay together; convs and the per-turn lengths keep their indices, only the
 * requests are renumbered (next_turn follows). */
static void keep_shard(workload *w, uint32_t shard, uint32_t shards)
{
    int32_t *to = (int32_t *)xcalloc(w->n, sizeof *to);
    size_t q, k = 0;
    for (q = 0; q < w->n; q++) to[q] = w->reqs[q].conv % shards == shard ? (int32_t)k++ : -1;
    for (q = 0; q < w->n; q++) { /* to[q] <= q: nothing is overwritten before it is read */
        sim_req r = w->reqs[q];
        if (to[q] < 0) continue;
        if (r.next_turn >= 0) r.next_turn = to[r.next_turn];
        w->reqs[to[q]] = r;
    }
    w->n = k;
    free(to);
}

void load_workload(workload *w, const options *o)
{
    size_t i;
    memset(w, 0, sizeof *w);
    w->block_tokens = o->block_tokens;
    if (o->trace) load_trace(w, o);
    else make_synthetic(w, o);
    if (o->shards > 1) {
        keep_shard(w, o->shard, o->shards);
        if (!w->n) die(2, "--shard %u/%u: no requests in this share of the workload", o->shard, o->shards);
    }
    for (i = 0; i < w->n; i++) w->partial_last += w->reqs[i].last_tokens != 0;
    arrival_key *keys = (arrival_key *)xcalloc(w->n, sizeof *keys);
    w->order = (size_t *)owned(w, w->n * sizeof *w->order);
    for (i = 0; i < w->n; i++) {
        keys[i].t = w->reqs[i].arrival;
        keys[i].i = i;
    }
    qsort(keys, w->n, sizeof *keys, cmp_arrival);
    for (i = 0; i < w->n; i++) w->order[i] = keys[i].i;
    free(keys);
}

void free_workload(workload *w)
{
    size_t i;
    for (i = 0; i < w->nowned; i++) free(w->owned[i]);
    free(w->owned);
    free(w->reqs);
    free(w->convs);
    free(w->user_len);
    free(w->out_len);
}
