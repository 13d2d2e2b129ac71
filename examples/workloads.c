/* workloads — production-like traces for tuning eviction, and a sweep of the pool's policies over them
 *
 *   build/workloads --write SHAPE FILE [--block-tokens N] [--requests N] [--scale X] [--seed N] [--partial-tail]
 *       writes a Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids) that
 *       `serve_sim --trace FILE` replays
 *   build/workloads --sweep [--shapes a,b,..] [--capacities N,N,..] [--block-tokens N] [--requests N]
 *                   [--scale X] [--seed N] [--partial-tail] [--markdown]
 *       replays every shape through kvblock.h pools of each capacity, one request at a time, prompts only
 *       (as serve_sim --sequential does), and prints the block hit rate of each policy: LRU, FOL's
 *       self-tuning default, FOL at fixed steps 1k/3k/10k/30k/100k (and the best of them), ARC, S3-FIFO,
 *       the offline optimum (Belady's rule: the block used again last goes), then the share of the best
 *       fixed step's gain over LRU that the default keeps, and the default's rule for tails at the end
 *       (first, or one step before class 1)
 *   build/workloads --list    the shapes with their request and block counts
 *   build/workloads --help    these forms in short
 *   --partial-tail: a prompt's partial last block is a block too (WL_PARTIAL_TAIL), as in a trace that
 *   names every block of a prompt: most of these tails are never used again
 * Shapes: chat api docs agent burst mixed longchat templates apisessions (examples/workloads.h says what each is).
 *
 * Build (make build/workloads does the same):
 *   cc -std=c11 -O2 -I. -I/usr/include/stb -pthread examples/workloads.c -o workloads -lm
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#define WORKLOADS_IMPLEMENTATION
#include "workloads.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CAPS 32
static const uint32_t fixed_steps[] = {1000, 3000, 10000, 30000, 100000};
#define N_FIXED (sizeof fixed_steps / sizeof fixed_steps[0])

typedef struct sweep_opts {
    uint32_t block_tokens, requests, caps[MAX_CAPS], ncaps;
    uint64_t seed;
    double scale;
    int markdown, shapes[WL__COUNT];
    unsigned flags;           /* wl_generate's */
} sweep_opts;

static void die(const char *msg)
{
    fprintf(stderr, "workloads: %s\n", msg);
    exit(2);
}

/* An option's value out of its range. */
static void die2(const char *opt, const char *what, uint64_t lo, uint64_t hi, const char *v)
{
    fprintf(stderr, "workloads: %s: '%s' is not %s in %llu..%llu\n", opt, v, what, (unsigned long long)lo,
            (unsigned long long)hi);
    exit(2);
}

/* --scale: a finite factor in (0, 1000] (prompt lengths are multiplied by it). */
static double scale_arg(const char *v)
{
    char *end = NULL;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x) || x <= 0 || x > 1000) {
        fprintf(stderr, "workloads: --scale: '%s' is not a number in (0, 1000]\n", v);
        exit(2);
    }
    return x;
}

/* Block hit rate of one pool over the trace (wl_replay: as serve_sim --sequential replays). */
static double replay(const wl_trace *w, kvb_evict_policy ev, uint32_t step, uint32_t cap, uint32_t *out_step,
                     uint32_t *out_tails)
{
    kvb_pool_config cfg;
    kvb_pool_stats st;
    double rate;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = cap;
    cfg.eviction = ev;
    cfg.fol_class_step = step;
    if ((rate = wl_replay(w, &cfg, &st)) < 0) die("replay failed (out of memory?)");
    if (out_step) *out_step = st.fol_class_step;
    if (out_tails) *out_tails = st.fol_tails_first;
    return rate;
}

/* ---- the offline optimum: Belady's rule with the prefix replay's hits ---------------------------- */

/* Dense ids for the trace's block identities (first seen first), and for each reference the request
 * that uses the same block next (UINT32_MAX for none). */
typedef struct future { uint32_t *id, *next_use; size_t *first; uint32_t ids; } future;

static void future_make(const wl_trace *w, future *f)
{
    size_t mask = 1, q, i, r = 0;
    uint64_t *keys;
    uint32_t *vals, *seen;
    while (mask < 2 * w->total_blocks + 2) mask <<= 1;
    keys = (uint64_t *)calloc(mask, sizeof *keys);
    vals = (uint32_t *)calloc(mask, sizeof *vals);
    f->id = (uint32_t *)malloc((w->total_blocks + 1) * sizeof *f->id);
    f->next_use = (uint32_t *)malloc((w->total_blocks + 1) * sizeof *f->next_use);
    f->first = (size_t *)malloc((w->n + 1) * sizeof *f->first);
    if (!keys || !vals || !f->id || !f->next_use || !f->first) die("out of memory");
    mask--;
    f->ids = 0;
    for (q = 0; q < w->n; q++) {
        f->first[q] = r;
        for (i = 0; i < w->req[q].num_blocks; i++, r++) {
            size_t s = (size_t)(w->req[q].blocks[i] & mask);
            while (keys[s] && keys[s] != w->req[q].blocks[i]) s = (s + 1) & mask;
            if (!keys[s]) {
                keys[s] = w->req[q].blocks[i];
                vals[s] = f->ids++;
            }
            f->id[r] = vals[s];
        }
    }
    f->first[w->n] = r;
    if (!(seen = (uint32_t *)malloc((f->ids + 1) * sizeof *seen))) die("out of memory");
    memset(seen, 0xff, (f->ids + 1) * sizeof *seen);
    for (q = w->n; q-- > 0;)
        for (r = f->first[q]; r < f->first[q + 1]; r++) {
            f->next_use[r] = seen[f->id[r]];
            seen[f->id[r]] = (uint32_t)q;
        }
    free(seen);
    free(keys);
    free(vals);
}

static void future_free(future *f)
{
    free(f->id);
    free(f->next_use);
    free(f->first);
}

/* A max-heap of (next use, depth) keys, entries made stale by a newer one for the same block. */
typedef struct opt_entry { uint64_t key; uint32_t id, version; } opt_entry;

static void opt_push(opt_entry *h, size_t *n, opt_entry e)
{
    size_t i = (*n)++;
    while (i && h[(i - 1) / 2].key < e.key) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = e;
}

static opt_entry opt_pop(opt_entry *h, size_t *n)
{
    opt_entry top = h[0], last = h[--*n];
    size_t i = 0, c;
    while ((c = 2 * i + 1) < *n) {
        if (c + 1 < *n && h[c + 1].key > h[c].key) c++;
        if (h[c].key <= last.key) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

/* Belady's offline optimum for the replay wl_replay does: each request hits its longest cached prefix
 * (at most the pool's size) and leaves all its blocks cached; then, while the pool holds too many,
 * the block used again last goes (never again first; ties: the deeper one, so no block outlives its
 * parent, which a child's use always uses too). */
static double optimum(const wl_trace *w, const future *f, uint32_t cap)
{
    uint8_t *cached = (uint8_t *)calloc(f->ids + 1, 1);
    uint32_t *version = (uint32_t *)calloc(f->ids + 1, sizeof *version);
    opt_entry *heap = (opt_entry *)malloc((f->first[w->n] + 1) * sizeof *heap);
    size_t heap_n = 0, held = 0, q, i;
    uint64_t hits = 0;
    if (!cached || !version || !heap) die("out of memory");
    for (q = 0; q < w->n; q++) {
        size_t n = w->req[q].num_blocks < cap ? w->req[q].num_blocks : cap, m = 0;
        const uint32_t *id = f->id + f->first[q], *next = f->next_use + f->first[q];
        while (m < n && cached[id[m]]) m++;
        hits += m;
        for (i = 0; i < n; i++) {
            opt_entry e;
            held += !cached[id[i]];
            cached[id[i]] = 1;
            e.key = ((uint64_t)next[i] << 16) | (i < 0xffff ? i : 0xffff);
            e.id = id[i];
            e.version = ++version[id[i]];
            opt_push(heap, &heap_n, e);
        }
        while (held > cap) {
            opt_entry e = opt_pop(heap, &heap_n);
            if (e.version != version[e.id] || !cached[e.id]) continue;
            cached[e.id] = 0;
            held--;
        }
    }
    free(cached);
    free(version);
    free(heap);
    return w->total_blocks ? (double)hits / (double)w->total_blocks : 0.0;
}

static void sweep(const sweep_opts *o)
{
    int s;
    printf(o->markdown ? "| workload | blocks | LRU | FOL default (step at end, * tails first) | best fixed step | ARC | S3-FIFO | optimum | kept |\n"
                         "|---|---|---|---|---|---|---|---|---|\n"
                       : "%-9s %7s %8s %8s %8s %8s %8s %8s %8s %8s %6s %6s\n",
           "shape", "blocks", "LRU", "default", "(step)", "best", "(step)", "ARC", "S3-FIFO", "optimum", "kept", "tails");
    for (s = 0; s < WL__COUNT; s++) {
        wl_trace w;
        uint32_t c;
        if (!o->shapes[s]) continue;
        future f;
        if (wl_generate((wl_shape)s, o->block_tokens, o->requests, o->scale, o->seed, o->flags, &w)) die("out of memory");
        future_make(&w, &f);
        for (c = 0; c < o->ncaps; c++) {
            uint32_t cap = o->caps[c], dstep = 0, dtails = 0, k, best_step = 0;
            double lru = replay(&w, KVB_EVICT_LRU, 0, cap, NULL, NULL), def = replay(&w, KVB_EVICT_FOL, 0, cap, &dstep, &dtails);
            double best = -1, kept, arc, s3, opt = optimum(&w, &f, cap);
            for (k = 0; k < N_FIXED; k++) {
                double v = replay(&w, KVB_EVICT_FOL, fixed_steps[k], cap, NULL, NULL);
                if (v > best) {
                    best = v;
                    best_step = fixed_steps[k];
                }
            }
            arc = replay(&w, KVB_EVICT_ARC, 0, cap, NULL, NULL);
            s3 = replay(&w, KVB_EVICT_S3FIFO, 0, cap, NULL, NULL);
            kept = best - lru > 1e-4 ? (def - lru) / (best - lru) : 1.0;
            if (o->markdown)
                printf("| %s | %u | %.4f | %.4f (%u%s) | %.4f (%u) | %.4f | %.4f | %.4f | %.0f%% |\n", wl_shape_name((wl_shape)s),
                       cap, lru, def, dstep, dtails ? "*" : "", best, best_step, arc, s3, opt, 100 * kept);
            else
                printf("%-9s %7u %8.4f %8.4f %8u %8.4f %8u %8.4f %8.4f %8.4f %5.0f%% %6s\n", wl_shape_name((wl_shape)s), cap,
                       lru, def, dstep, best, best_step, arc, s3, opt, 100 * kept, dtails ? "first" : "step");
            fflush(stdout);
        }
        future_free(&f);
        wl_free(&w);
    }
}

static void write_trace(const char *shape_name, const char *path, const sweep_opts *o)
{
    wl_shape shape;
    wl_trace w;
    FILE *f;
    size_t q, i, n = 0, mask;
    uint64_t *keys;
    uint32_t *ids, next = 0;
    if (wl_shape_from_name(shape_name, &shape)) die("unknown shape (chat api docs agent burst mixed longchat templates apisessions)");
    if (wl_generate(shape, o->block_tokens, o->requests, o->scale, o->seed, o->flags, &w)) die("out of memory");
    for (mask = 1; mask < 2 * w.total_blocks + 2; mask <<= 1) {}
    keys = (uint64_t *)calloc(mask, sizeof *keys);
    ids = (uint32_t *)calloc(mask, sizeof *ids);
    if (!keys || !ids) die("out of memory");
    mask--;
    if (!(f = fopen(path, "w"))) die("cannot write the trace file");
    for (q = 0; q < w.n; q++) {
        const wl_req *r = &w.req[q];
        fprintf(f, "{\"timestamp\": %.0f, \"input_length\": %u, \"output_length\": %u, \"hash_ids\": [", r->t * 1000.0,
                r->prompt_tokens, r->output_tokens);
        for (i = 0; i < r->num_blocks; i++) { /* identities become small integers, first seen first */
            size_t s = (size_t)(r->blocks[i] & mask);
            while (keys[s] && keys[s] != r->blocks[i]) s = (s + 1) & mask;
            if (!keys[s]) {
                keys[s] = r->blocks[i];
                ids[s] = next++;
                n++;
            }
            fprintf(f, i ? ", %u" : "%u", ids[s]);
        }
        fprintf(f, "]}\n");
    }
    if (ferror(f) | fclose(f)) die("cannot write the trace file (disk full?)");
    fprintf(stderr, "%s: %zu requests, %llu prompt blocks, %zu distinct\n", path, w.n,
            (unsigned long long)w.total_blocks, n);
    free(keys);
    free(ids);
    wl_free(&w);
}

/* A whole decimal number in [lo, hi], else die naming the option. */
static uint64_t number_arg(const char *opt, const char *v, uint64_t lo, uint64_t hi)
{
    char *end = NULL;
    unsigned long long x;
    errno = 0;
    x = isdigit((unsigned char)v[0]) ? strtoull(v, &end, 10) : 0;
    if (!end || *end || errno || x < lo || x > hi)
        die2(opt, "a whole number", lo, hi, v);
    return (uint64_t)x;
}

/* --capacities: 1 to MAX_CAPS block counts, comma-separated (more are refused, not dropped) */
static void parse_caps(const char *s, sweep_opts *o)
{
    o->ncaps = 0;
    while (*s) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s || v < 1 || v > 100000000) die("--capacities: a list of block counts");
        if (o->ncaps == MAX_CAPS) die("--capacities: at most 32 block counts");
        o->caps[o->ncaps++] = (uint32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') die("--capacities: a list of block counts");
    }
    if (!o->ncaps) die("--capacities: a list of block counts");
}

/* --shapes: one or more names, comma-separated (none, or a list cut short by the buffer, is refused) */
static void parse_shapes(const char *s, sweep_opts *o)
{
    char buf[256], *tok, *save = NULL;
    int any = 0;
    memset(o->shapes, 0, sizeof o->shapes);
    if (strlen(s) >= sizeof buf) die("--shapes: chat api docs agent burst mixed longchat templates apisessions");
    snprintf(buf, sizeof buf, "%s", s);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        wl_shape sh;
        if (wl_shape_from_name(tok, &sh)) die("--shapes: chat api docs agent burst mixed longchat templates apisessions");
        o->shapes[sh] = 1;
        any = 1;
    }
    if (!any) die("--shapes: chat api docs agent burst mixed longchat templates apisessions");
}

static void usage(void)
{
    printf("usage: workloads --write SHAPE FILE [--block-tokens N] [--requests N] [--scale X] [--seed N] [--partial-tail]\n"
           "       workloads --sweep [--shapes a,b,..] [--capacities N,N,..] [--block-tokens N] [--requests N]\n"
           "                 [--scale X] [--seed N] [--partial-tail] [--markdown]\n"
           "       workloads --list\n"
           "Shapes: chat api docs agent burst mixed longchat templates apisessions (the top of examples/workloads.c\n"
           "says what each option does).\n");
}

int main(int argc, char **argv)
{
    sweep_opts o;
    const char *write_shape = NULL, *write_path = NULL;
    int i, do_sweep = 0, do_list = 0;
    memset(&o, 0, sizeof o);
    o.block_tokens = 512;
    o.requests = 12000;
    o.seed = 1;
    o.scale = 1.0;
    for (i = 0; i < WL__COUNT; i++) o.shapes[i] = 1;
    parse_caps("1000,3000,10000,30000", &o);
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (!strcmp(a, "--sweep") || !strcmp(a, "--list") || !strcmp(a, "--markdown") || !strcmp(a, "--partial-tail")) {
            do_sweep |= !strcmp(a, "--sweep");
            do_list |= !strcmp(a, "--list");
            o.markdown |= !strcmp(a, "--markdown");
            if (!strcmp(a, "--partial-tail")) o.flags |= WL_PARTIAL_TAIL;
            continue;
        }
        if (!strcmp(a, "--write")) {
            if (!v || i + 2 >= argc) die("--write needs SHAPE FILE");
            write_shape = v;
            write_path = argv[i + 2];
            i += 2;
            continue;
        }
        if (strcmp(a, "--block-tokens") && strcmp(a, "--requests") && strcmp(a, "--seed") && strcmp(a, "--scale") &&
            strcmp(a, "--capacities") && strcmp(a, "--shapes"))
            die("unknown option (workloads --help)");
        if (!v) die("missing value (see the comment at the top of examples/workloads.c)");
        if (!strcmp(a, "--block-tokens")) o.block_tokens = (uint32_t)number_arg(a, v, 1, 32768);
        else if (!strcmp(a, "--requests")) o.requests = (uint32_t)number_arg(a, v, 1, 10000000);
        else if (!strcmp(a, "--seed")) o.seed = number_arg(a, v, 0, UINT64_MAX);
        else if (!strcmp(a, "--scale")) o.scale = scale_arg(v);
        else if (!strcmp(a, "--capacities")) parse_caps(v, &o);
        else if (!strcmp(a, "--shapes")) parse_shapes(v, &o);
        i++;
    }

    if (write_shape) write_trace(write_shape, write_path, &o);
    if (do_list)
        for (i = 0; i < WL__COUNT; i++) {
            wl_trace w;
            if (wl_generate((wl_shape)i, o.block_tokens, o.requests, o.scale, o.seed, o.flags, &w)) die("out of memory");
            printf("%-6s %6zu requests %9llu prompt blocks %9llu distinct (%.1f blocks a request)\n",
                   wl_shape_name((wl_shape)i), w.n, (unsigned long long)w.total_blocks,
                   (unsigned long long)w.unique_blocks, w.n ? (double)w.total_blocks / (double)w.n : 0.0);
            wl_free(&w);
        }
    if (do_sweep) sweep(&o);
    if (!write_shape && !do_list && !do_sweep) die("nothing to do: --sweep, --list or --write SHAPE FILE");
    return 0;
}
