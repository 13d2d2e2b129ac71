/* workloads — production-like traces for tuning eviction, and a sweep of the pool's policies over them
 *
 *   build/workloads --write SHAPE FILE [--block-tokens N] [--requests N] [--scale X] [--seed N]
 *       writes a Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids) that
 *       `serve_sim --trace FILE` replays
 *   build/workloads --sweep [--shapes a,b,..] [--capacities N,N,..] [--block-tokens N] [--requests N]
 *                   [--scale X] [--seed N] [--markdown]
 *       replays every shape through kvblock.h pools of each capacity, one request at a time, prompts only
 *       (as serve_sim --sequential does), and prints the block hit rate of each policy: LRU, FOL's
 *       self-tuning default, FOL at fixed steps 1k/3k/10k/30k/100k (and the best of them), ARC, S3-FIFO,
 *       then the share of the best fixed step's gain over LRU that the default keeps
 *   build/workloads --list    the shapes with their request and block counts
 * Shapes: chat api docs agent burst mixed longchat templates (examples/workloads.h says what each is).
 *
 * Build (make build/workloads does the same):
 *   cc -std=c11 -O2 -I. -I/usr/include/stb -pthread examples/workloads.c -o workloads -lm
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#define WORKLOADS_IMPLEMENTATION
#include "workloads.h"

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
} sweep_opts;

static void die(const char *msg)
{
    fprintf(stderr, "workloads: %s\n", msg);
    exit(2);
}

/* Block hit rate of one pool over the trace (wl_replay: as serve_sim --sequential replays). */
static double replay(const wl_trace *w, kvb_evict_policy ev, uint32_t step, uint32_t cap, uint32_t *out_step)
{
    kvb_pool_config cfg;
    kvb_pool_stats st;
    double rate;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = cap;
    cfg.block_tokens = 512;
    cfg.eviction = ev;
    cfg.fol_class_step = step;
    if ((rate = wl_replay(w, &cfg, &st)) < 0) die("replay failed (out of memory?)");
    if (out_step) *out_step = st.fol_class_step;
    return rate;
}

static void sweep(const sweep_opts *o)
{
    int s;
    printf(o->markdown ? "| workload | blocks | LRU | FOL default (step at end) | best fixed step | ARC | S3-FIFO | kept |\n"
                         "|---|---|---|---|---|---|---|---|\n"
                       : "%-6s %7s %8s %8s %8s %8s %8s %8s %8s %6s\n",
           "shape", "blocks", "LRU", "default", "(step)", "best", "(step)", "ARC", "S3-FIFO", "kept");
    for (s = 0; s < WL__COUNT; s++) {
        wl_trace w;
        uint32_t c;
        if (!o->shapes[s]) continue;
        if (wl_generate((wl_shape)s, o->block_tokens, o->requests, o->scale, o->seed, &w)) die("out of memory");
        for (c = 0; c < o->ncaps; c++) {
            uint32_t cap = o->caps[c], dstep = 0, k, best_step = 0;
            double lru = replay(&w, KVB_EVICT_LRU, 0, cap, NULL), def = replay(&w, KVB_EVICT_FOL, 0, cap, &dstep);
            double best = -1, kept, arc, s3;
            for (k = 0; k < N_FIXED; k++) {
                double v = replay(&w, KVB_EVICT_FOL, fixed_steps[k], cap, NULL);
                if (v > best) {
                    best = v;
                    best_step = fixed_steps[k];
                }
            }
            arc = replay(&w, KVB_EVICT_ARC, 0, cap, NULL);
            s3 = replay(&w, KVB_EVICT_S3FIFO, 0, cap, NULL);
            kept = best - lru > 1e-4 ? (def - lru) / (best - lru) : 1.0;
            if (o->markdown)
                printf("| %s | %u | %.4f | %.4f (%u) | %.4f (%u) | %.4f | %.4f | %.0f%% |\n", wl_shape_name((wl_shape)s), cap,
                       lru, def, dstep, best, best_step, arc, s3, 100 * kept);
            else
                printf("%-6s %7u %8.4f %8.4f %8u %8.4f %8u %8.4f %8.4f %5.0f%%\n", wl_shape_name((wl_shape)s), cap, lru, def,
                       dstep, best, best_step, arc, s3, 100 * kept);
            fflush(stdout);
        }
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
    if (wl_shape_from_name(shape_name, &shape)) die("unknown shape (chat api docs agent burst mixed longchat templates)");
    if (wl_generate(shape, o->block_tokens, o->requests, o->scale, o->seed, &w)) die("out of memory");
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
    fclose(f);
    fprintf(stderr, "%s: %zu requests, %llu prompt blocks, %zu distinct\n", path, w.n,
            (unsigned long long)w.total_blocks, n);
    free(keys);
    free(ids);
    wl_free(&w);
}

static void parse_caps(const char *s, sweep_opts *o)
{
    o->ncaps = 0;
    while (*s && o->ncaps < MAX_CAPS) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s || v < 1 || v > 100000000) die("--capacities: a list of block counts");
        o->caps[o->ncaps++] = (uint32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') die("--capacities: a list of block counts");
    }
}

static void parse_shapes(const char *s, sweep_opts *o)
{
    char buf[256], *tok, *save = NULL;
    memset(o->shapes, 0, sizeof o->shapes);
    snprintf(buf, sizeof buf, "%s", s);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        wl_shape sh;
        if (wl_shape_from_name(tok, &sh)) die("--shapes: chat api docs agent burst mixed longchat templates");
        o->shapes[sh] = 1;
    }
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
        if (!strcmp(a, "--sweep") || !strcmp(a, "--list") || !strcmp(a, "--markdown")) {
            do_sweep |= !strcmp(a, "--sweep");
            do_list |= !strcmp(a, "--list");
            o.markdown |= !strcmp(a, "--markdown");
            continue;
        }
        if (!strcmp(a, "--write") && v && i + 2 < argc) {
            write_shape = v;
            write_path = argv[i + 2];
            i += 2;
            continue;
        } else if (!v) die("missing value (see the comment at the top of examples/workloads.c)");
        else if (!strcmp(a, "--block-tokens")) o.block_tokens = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--requests")) o.requests = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--seed")) o.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--scale")) o.scale = strtod(v, NULL);
        else if (!strcmp(a, "--capacities")) parse_caps(v, &o);
        else if (!strcmp(a, "--shapes")) parse_shapes(v, &o);
        else die("unknown option (see the comment at the top of examples/workloads.c)");
        i++;
    }
    if (!o.block_tokens || !o.requests || o.scale <= 0) die("--block-tokens, --requests and --scale must be positive");
    if (write_shape) write_trace(write_shape, write_path, &o);
    if (do_list)
        for (i = 0; i < WL__COUNT; i++) {
            wl_trace w;
            if (wl_generate((wl_shape)i, o.block_tokens, o.requests, o.scale, o.seed, &w)) die("out of memory");
            printf("%-6s %6zu requests %9llu prompt blocks %9llu distinct (%.1f blocks a request)\n",
                   wl_shape_name((wl_shape)i), w.n, (unsigned long long)w.total_blocks,
                   (unsigned long long)w.unique_blocks, w.n ? (double)w.total_blocks / (double)w.n : 0.0);
            wl_free(&w);
        }
    if (do_sweep) sweep(&o);
    if (!write_shape && !do_list && !do_sweep) die("nothing to do: --sweep, --list or --write SHAPE FILE");
    return 0;
}
