/* serve_sim.c — a continuous-batching serving simulation on kvcache: the kvsched.h scheduler and
 * connector, the kvoffload.h tier manager and the kvblock.h pools, driven by a synthetic chat workload
 * or a Mooncake trace, in simulated time. This is what `make demo` runs.
 *
 *   make build/serve_sim && ./build/serve_sim                      # synthetic workload, report
 *   ./build/serve_sim --trace examples/traces/small.jsonl --json   # a trace, one JSON object
 *   ./build/serve_sim --sequential --trace FILE --device-blocks 10000 --host-blocks 0   # pure replay
 *   ./build/serve_sim --pace-us 20000 --console /tmp/kv.sock & ./build/kvtop /tmp/kv.sock   # watch it
 *   ./build/serve_sim --help
 *
 * Build by hand (drop -DKVO_WITH_REDIS and -lhiredis to build without the remote tier):
 *   cc -std=c11 -O2 -D_GNU_SOURCE -DKVO_WITH_REDIS -I. -I/usr/include/stb examples/serve_sim.c -o serve_sim \
 *      -pthread -lcjson -lhiredis -lm
 *
 * WHAT IT DOES
 * Requests arrive (synthetic: conversations; trace: at their timestamps) and go to kvs_sched_add. Each
 * engine step is kvs_sched_step -> "forward pass" (time advances by the cost model below) ->
 * kvs_sched_complete -> one sampled token per request that finished its prompt or decoded
 * (kvs_sched_append). The scheduler matches prompts against the device prefix cache, asks the
 * connector for host / disk hits (onboarded before the request prefills), registers computed blocks and,
 * in eager mode, offers them down the tiers. Pools are metadata-only by default (a copy backend that
 * moves no bytes); --bytes gives every tier real storage: memcpy between device and host memory, the
 * disk backend with a file under /tmp (removed at exit) for the disk tier, and every cached block is
 * checked byte for byte against the pattern written when it was computed.
 * The report compares simulated TTFT with a second run of the same arrivals with the cache off (every
 * request salted apart, no lower tiers).
 *
 * HITS. prompt_blocks counts the full blocks of every prompt; a hit block is one the request did not
 * compute: a device hit, or a block onboarded from host or disk for it (in the scheduler, counted when
 * the request is admitted; a host / disk hit is a block that landed on the device by an onboard planned
 * for that request). As in vLLM, the scheduler never lets a hit cover a prompt's last token, so the last
 * block of a block-aligned prompt is always computed: with a trace (every hash id a full block) each
 * request's last block is a miss under the scheduler, as it would be for an engine given the real,
 * unaligned input_length; --sequential counts every id.
 *
 * --sequential is a pure cache replay with no scheduler: one request at a time, prompt blocks only, no
 * decode. Trace parsing, token synthesis and hashing happen first; the timed loop is, per request:
 * kvb_match on the device pool (longest prefix), kvo_manager_lookup for the rest and onboarding of
 * lower-tier hits (when there are lower tiers), kvb_alloc + kvb_register_hashed of the missing blocks
 * (chained to their parents), an eager offer of those to the tier below, and kvb_release of all of
 * them (deepest first). replay_seconds is the wall time of that loop alone. --check-lru replays the
 * same requests through a plain LRU prefix cache of --device-blocks blocks written here (a block hits
 * only if every earlier block of its request hit; a request's blocks all become most recent, deepest
 * first, as kvb_release orders them) and fails (exit 1) when the two hit rates differ by more than 0.005.
 *
 * COST MODEL (simulated time; constants below, Llama-3-8B fp16 on one H100 as the reference point)
 *   step with any work      COST_STEP_US                    5 ms   (launch, sampling, scheduling)
 *   prefill                 COST_PREFILL_US per token       60 us  (~16.7k tokens/s)
 *   decode                  COST_DECODE_US per sequence     40 us
 *   onboarding              KV_BYTES_PER_TOKEN / bandwidth  128 KiB per token; host 25 GB/s, disk 4 GB/s
 *   a step lasts max(compute, onboarding started in it): copies overlap compute on their own engine;
 *   a step with nothing to do lasts COST_IDLE_US (1 ms) so that pipelines waiting for a flush move on.
 *   Offloaded / onboarded bytes are real bytes with --bytes, otherwise blocks x block_tokens x 128 KiB
 *   ("modeled").
 *
 * WORKLOADS
 *   synthetic (default; --requests N, --seed S): SYN_SYSTEM system prompts (200..1200 tokens) chosen
 *   with Zipf(1.1) popularity; with probability 0.5 a shared document (one of SYN_DOCS, 300..1500
 *   tokens, Zipf(0.9)) follows it; then a multi-turn chat: 1 + Geometric turns (mean 3, at most 10), each
 *   a user message (16..200 tokens) and a reply (16..128 tokens). Turn k's prompt is the whole history,
 *   the replies included, so a returning turn reuses the blocks its previous turn computed. Conversations
 *   start as a Poisson process (SYN_RATE per second); a turn comes an exponential think time (mean
 *   SYN_THINK_S) after the previous one finished. 16-token blocks by default.
 *   Mooncake traces (--trace FILE): one JSON object a line, {"timestamp": ms, "input_length": n,
 *   "output_length": n, "hash_ids": [...]}; each hash id names one block of --block-tokens tokens
 *   (default 512) together with its whole prefix, and becomes that many synthetic tokens derived from
 *   (id, position); an input_length beyond the ids adds tokens unique to the request. Malformed lines
 *   are reported with their line number and skipped, or stop the run with --strict (exit 2).
 *
 * REMOTE TIER (--remote redis://host:port, or a seed list host:port,host:port for a Redis Cluster)
 * adds G4 (kvremote.h) as the last tier: a metadata-only pool standing for what Redis holds, the Redis
 * backend copying into it from the tier above and onboarding from it to the device. Blocks are keyed by
 * their hashes under the namespace "serve_sim" (salt 0), so runs of the same workload, in any process or
 * on any machine pointed at the same servers, share them. --remote implies --bytes (Redis stores real
 * bytes; every hit is checked byte for byte). With --disk-blocks too, all four tiers run at once:
 * G1 -> G2 -> G3 and G2 -> G4 (a manager branch: Redis is fed from host memory, never read back from
 * disk; kvoffload.h section 5 says why), so a disk tier needs --host-blocks. Onboarding from G4 is
 * modeled at REMOTE_GBPS (2.5 GB/s). Both modes look up device, host, disk, then Redis
 * (kvo_redis_tiers_lookup; the scheduler through its connector), the entries other runs stored
 * imported into G4 and onboarded; a load that fails (an entry gone, a node lost) is recomputed.
 * The reports gain remote_hit_blocks (prompt blocks whose hit came from G4: stored by this run and lost
 * from the device, or by an earlier run) and
 * remote_imported_blocks (blocks found in Redis that this run did not store). A second run of the same
 * workload against the same Redis, with cold local tiers, gets remote hits (tests/remote_sim.sh).
 * Built with -DKVO_WITH_REDIS -lhiredis (the Makefile does); without KVO_WITH_REDIS, --remote stops the
 * run at start with "remote tier not built in" (exit 2).
 *
 * OBSERVABILITY (the scheduler run with the cache on; not with --sequential, which stops with exit 2):
 *   --console PATH  publish every event on a kvs_bus (slot transitions, admissions, steps, block events of
 *                   every pool, transfer stages of every pipeline, tier occupancy) and serve it with
 *                   kvs_console on the Unix socket PATH: build/kvtop PATH watches the run, pauses it and
 *                   sets breakpoints.
 *   --record FILE   a kvs_recorder writing every event to the log FILE (build/kvtop --log FILE reads it;
 *                   kvs_replay can feed it back). Either option creates the bus; events carry simulated
 *                   time, so the same run records the same log.
 *   --metrics FILE  kvs_metrics_write's Prometheus text at the end of the run into FILE (- = stdout, after
 *                   the report).
 *   --pace-us N     sleep N microseconds of real time after every engine step, so that a person (or a
 *                   test) can watch: ./build/serve_sim --pace-us 20000 --console /tmp/kv.sock &
 *                   ./build/kvtop /tmp/kv.sock
 *   The baseline run (cache off) is neither observed nor paced. Without these options there is no bus.
 *
 * EXIT STATUS: 0 ok; 1 a check failed (--check-lru, --bytes data check); 2 bad usage or input.
 */
#define KVCACHE_IMPLEMENTATION
#include "kvsched.h"
#include "kvremote.h" /* the G4 tier (--remote); a stub that refuses it unless built with KVO_WITH_REDIS */

#include <cjson/cJSON.h>

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- the cost model ----------------------------------------------------------------------------- */

#define COST_STEP_US 5000.0
#define COST_PREFILL_US 60.0
#define COST_DECODE_US 40.0
#define COST_IDLE_US 1000.0
#define KV_BYTES_PER_TOKEN 131072.0 /* 32 layers x 8 KV heads x head dim 128 x (K, V) x fp16 */
#define HOST_GBPS 25.0
#define DISK_GBPS 4.0
#define REMOTE_GBPS 2.5 /* Redis over a 25 GbE link */

/* ---- the synthetic workload (defaults: 5000 requests, device 2048 blocks, host 16384) ------------- */

#define SYN_SYSTEM 16
#define SYN_DOCS 400
#define SYN_RATE 1.0     /* conversations per simulated second */
#define SYN_THINK_S 20.0 /* mean think time between turns */

/* TIER_KINDS: the kinds every report shows; TIER_REMOTE (G4, --remote) is reported only when present. */
enum { TIER_DEVICE, TIER_HOST, TIER_DISK, TIER_KINDS, TIER_REMOTE = TIER_KINDS, TIER_ALL };
static const char *const tier_names[TIER_ALL] = {"device", "host", "disk", "remote"};

/* ---- small utilities ---------------------------------------------------------------------------- */

static void die(int status, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "serve_sim: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) die(2, "out of memory (%zu bytes)", n);
    return q;
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) die(2, "out of memory");
    return p;
}

/* Grow array p (capacity *cap elements of `size`) so that index need - 1 is valid. */
static void *grow_to(void *p, size_t *cap, size_t need, size_t size)
{
    size_t c = *cap ? *cap : 16;
    if (need <= *cap) return p;
    while (c < need) c *= 2;
    *cap = c;
    return xrealloc(p, c * size);
}
#define GROW(p, cap, need) ((p) = grow_to((p), &(cap), (need), sizeof *(p)))

static void check_kv(int r, const char *what)
{
    if (r != 0) die(2, "%s: %s", what, kvs_result_string(r));
}

static uint64_t mix64(uint64_t x)
{
    x += UINT64_C(0x9e3779b97f4a7c15);
    x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

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

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Percentile q (0..100) of v[0..n), nearest rank; sorts v. NAN for none. */
static double percentile(double *v, size_t n, double q)
{
    size_t k;
    if (!n) return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    k = (size_t)ceil(q / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

/* u64 -> u32 map: open addressing, linear probing, backward-shift deletion (no tombstones). Key 0 is
 * stored as itself; an empty slot has val == UINT32_MAX. */
typedef struct u64map { uint64_t *key; uint32_t *val; size_t mask, n; } u64map;

static void map_init(u64map *m, size_t expect)
{
    size_t cap = 16, i;
    while (cap < expect * 2) cap *= 2;
    m->key = (uint64_t *)xcalloc(cap, sizeof *m->key);
    m->val = (uint32_t *)xcalloc(cap, sizeof *m->val);
    for (i = 0; i < cap; i++) m->val[i] = UINT32_MAX;
    m->mask = cap - 1;
    m->n = 0;
}
static void map_free(u64map *m)
{
    free(m->key);
    free(m->val);
    memset(m, 0, sizeof *m);
}
static size_t map_slot(const u64map *m, uint64_t k)
{
    size_t i = (size_t)mix64(k) & m->mask;
    while (m->val[i] != UINT32_MAX && m->key[i] != k) i = (i + 1) & m->mask;
    return i;
}
static uint32_t map_get(const u64map *m, uint64_t k) { return m->val[map_slot(m, k)]; }
static void map_put(u64map *m, uint64_t k, uint32_t v)
{
    size_t i;
    if ((m->n + 1) * 2 > m->mask + 1) { /* grow */
        u64map g;
        size_t j;
        map_init(&g, m->mask + 1);
        for (j = 0; j <= m->mask; j++)
            if (m->val[j] != UINT32_MAX) map_put(&g, m->key[j], m->val[j]);
        map_free(m);
        *m = g;
    }
    i = map_slot(m, k);
    if (m->val[i] == UINT32_MAX) m->n++;
    m->key[i] = k;
    m->val[i] = v;
}
static void map_del(u64map *m, uint64_t k)
{
    size_t i = map_slot(m, k), j;
    if (m->val[i] == UINT32_MAX) return;
    m->val[i] = UINT32_MAX;
    m->n--;
    for (j = (i + 1) & m->mask; m->val[j] != UINT32_MAX; j = (j + 1) & m->mask) {
        size_t home = (size_t)mix64(m->key[j]) & m->mask;
        /* move j back to i when its home is not within (i, j] cyclically */
        if (((j - home) & m->mask) >= ((j - i) & m->mask)) {
            m->key[i] = m->key[j];
            m->val[i] = m->val[j];
            m->val[j] = UINT32_MAX;
            i = j;
        }
    }
}

/* ---- options ------------------------------------------------------------------------------------ */

#define UNSET UINT32_MAX

typedef struct options {
    uint32_t device_blocks, host_blocks, disk_blocks, block_tokens, requests;
    uint32_t eviction, offload; /* kvb_evict_policy, kvo_offload_mode; UNSET = default */
    uint64_t seed;
    const char *trace, *svg, *remote;
    const char *console, *record, *metrics; /* observability of the scheduler run (NULL: off) */
    uint32_t pace_us;        /* real microseconds slept after every engine step */
    int json, sequential, bytes, strict, check_lru, help;
    uint32_t remote_blocks; /* G4 pool size: set in main from the workload (its prompt blocks) */
} options;

typedef struct named { const char *name; uint32_t value; } named;

/* --eviction NAME: a new pool policy is one more line here. */
static const named eviction_names[] = {
    {"lineage", KVB_EVICT_LINEAGE},
    {"fol", KVB_EVICT_FOL},
    {"lru", KVB_EVICT_LRU},
    {NULL, 0},
};
static const named offload_names[] = {
    {"eager", KVO_OFFLOAD_EAGER},
    {"lazy", KVO_OFFLOAD_LAZY},
    {NULL, 0},
};

typedef enum optkind { OPT_FLAG, OPT_U32, OPT_U64, OPT_STR, OPT_NAME } optkind;

typedef struct optdef {
    const char *name;
    optkind kind;
    size_t offset;
    const named *names; /* OPT_NAME */
    const char *arg, *help;
} optdef;

#define OPT(field) offsetof(options, field)
static const optdef optdefs[] = {
    {"--device-blocks", OPT_U32, OPT(device_blocks), NULL, "N", "device (G1) blocks; default 2048 (synthetic), 1024 (trace)"},
    {"--host-blocks", OPT_U32, OPT(host_blocks), NULL, "N", "host (G2) blocks, 0 = no host tier; default 16384 / 8192"},
    {"--disk-blocks", OPT_U32, OPT(disk_blocks), NULL, "N", "disk (G3) blocks, 0 = no disk tier (default)"},
    {"--block-tokens", OPT_U32, OPT(block_tokens), NULL, "N", "tokens per block; default 16 (synthetic), 512 (trace)"},
    {"--eviction", OPT_NAME, OPT(eviction), eviction_names, "NAME", "device pool eviction policy (default lineage)"},
    {"--offload", OPT_NAME, OPT(offload), offload_names, "MODE", "offload to lower tiers (default eager)"},
    {"--seed", OPT_U64, OPT(seed), NULL, "N", "synthetic workload seed (default 1)"},
    {"--requests", OPT_U32, OPT(requests), NULL, "N", "synthetic workload size (default 5000)"},
    {"--trace", OPT_STR, OPT(trace), NULL, "FILE", "replay a Mooncake JSONL trace instead"},
    {"--strict", OPT_FLAG, OPT(strict), NULL, NULL, "stop at the first malformed trace line"},
    {"--sequential", OPT_FLAG, OPT(sequential), NULL, NULL, "pure cache replay: one request at a time, prompts only"},
    {"--check-lru", OPT_FLAG, OPT(check_lru), NULL, NULL, "compare the replay with a reference LRU cache (implies --sequential)"},
    {"--bytes", OPT_FLAG, OPT(bytes), NULL, NULL, "memory-backed pools, disk tier in a /tmp file, data checked"},
    {"--remote", OPT_STR, OPT(remote), NULL, "URL", "G4 tier in Redis, last: redis://host:port[,host:port...] (implies --bytes)"},
    {"--json", OPT_FLAG, OPT(json), NULL, NULL, "print one JSON object instead of the text report"},
    {"--svg", OPT_STR, OPT(svg), NULL, "FILE", "write a chart of hit rate and tier occupancy over time"},
    {"--console", OPT_STR, OPT(console), NULL, "PATH", "serve kvs_console on this Unix socket (build/kvtop PATH attaches)"},
    {"--record", OPT_STR, OPT(record), NULL, "FILE", "record every event to a log (build/kvtop --log FILE reads it)"},
    {"--metrics", OPT_STR, OPT(metrics), NULL, "FILE", "write the Prometheus metrics at the end of the run, - = stdout"},
    {"--pace-us", OPT_U32, OPT(pace_us), NULL, "N", "sleep N real microseconds after every engine step (default 0)"},
    {"--help", OPT_FLAG, OPT(help), NULL, NULL, "this text"},
};
#define NOPTS (sizeof optdefs / sizeof optdefs[0])

static const char *name_of(const named *t, uint32_t v)
{
    for (; t->name; t++)
        if (t->value == v) return t->name;
    return "?";
}

static void usage(FILE *f)
{
    size_t i;
    fprintf(f, "usage: serve_sim [options]\n"
               "A continuous-batching serving simulation on kvcache (see the top of examples/serve_sim.c).\n\n");
    for (i = 0; i < NOPTS; i++) {
        const optdef *d = &optdefs[i];
        char lhs[64];
        snprintf(lhs, sizeof lhs, "%s%s%s", d->name, d->arg ? " " : "", d->arg ? d->arg : "");
        fprintf(f, "  %-22s %s", lhs, d->help);
        if (d->names) {
            const named *n;
            fprintf(f, ":");
            for (n = d->names; n->name; n++) fprintf(f, " %s", n->name);
        }
        fputc('\n', f);
    }
}

static void parse_value(const optdef *d, const char *v, options *o)
{
    char *end;
    void *field = (char *)o + d->offset;
    unsigned long long x;
    const named *n;
    switch (d->kind) {
    case OPT_FLAG: *(int *)field = 1; return;
    case OPT_STR: *(const char **)field = v; return;
    case OPT_NAME:
        for (n = d->names; n->name; n++)
            if (!strcmp(n->name, v)) {
                *(uint32_t *)field = n->value;
                return;
            }
        die(2, "%s: unknown value '%s' (try --help)", d->name, v);
        return;
    case OPT_U32:
    case OPT_U64:
        errno = 0;
        x = strtoull(v, &end, 10);
        if (errno || end == v || *end || v[0] == '-' || (d->kind == OPT_U32 && x >= UINT32_MAX))
            die(2, "%s: '%s' is not a valid number", d->name, v);
        if (d->kind == OPT_U32) *(uint32_t *)field = (uint32_t)x;
        else *(uint64_t *)field = (uint64_t)x;
        return;
    }
}

static void parse_options(int argc, char **argv, options *o)
{
    int i;
    memset(o, 0, sizeof *o);
    o->device_blocks = o->host_blocks = o->disk_blocks = o->block_tokens = o->requests = UNSET;
    o->eviction = o->offload = UNSET;
    o->seed = 1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a), k;
        for (k = 0; k < NOPTS; k++)
            if (strlen(optdefs[k].name) == len && !strncmp(optdefs[k].name, a, len)) break;
        if (k == NOPTS) die(2, "unknown option '%s' (try --help)", a);
        if (optdefs[k].kind == OPT_FLAG) {
            if (eq) die(2, "%s takes no value", optdefs[k].name);
            parse_value(&optdefs[k], NULL, o);
        } else if (eq) {
            parse_value(&optdefs[k], eq + 1, o);
        } else {
            if (i + 1 >= argc) die(2, "%s needs a value (try --help)", optdefs[k].name);
            parse_value(&optdefs[k], argv[++i], o);
        }
    }
    if (o->help) return;
    if (o->check_lru) o->sequential = 1;
    if (o->block_tokens == UNSET) o->block_tokens = o->trace ? 512 : 16;
    if (o->device_blocks == UNSET) o->device_blocks = o->trace ? 1024 : 2048;
    if (o->host_blocks == UNSET) o->host_blocks = o->trace ? 8192 : 16384;
    if (o->disk_blocks == UNSET) o->disk_blocks = 0;
    if (o->requests == UNSET) o->requests = 5000;
    if (o->eviction == UNSET) o->eviction = o->check_lru ? KVB_EVICT_LRU : KVB_EVICT_LINEAGE;
    if (o->offload == UNSET) o->offload = KVO_OFFLOAD_EAGER;
    if (!o->device_blocks) die(2, "--device-blocks must be at least 1");
    if (!o->block_tokens || o->block_tokens > 32768) die(2, "--block-tokens must be 1..32768");
    if (!o->requests && !o->trace) die(2, "--requests must be at least 1");
    if (o->check_lru && (o->host_blocks || o->disk_blocks))
        die(2, "--check-lru compares the device pool alone with the reference: add --host-blocks 0 --disk-blocks 0");
    if (o->sequential && (o->console || o->record || o->metrics || o->pace_us))
        die(2, "--console, --record, --metrics and --pace-us observe the scheduler: drop --sequential%s",
            o->check_lru ? " and --check-lru (it implies --sequential)" : "");
    if ((o->console && !*o->console) || (o->record && !*o->record) || (o->metrics && !*o->metrics))
        die(2, "--console, --record and --metrics need a path");
    if (o->remote) {
        if (!*o->remote) die(2, "--remote needs redis://host:port");
        if (o->check_lru) die(2, "--check-lru compares the device pool alone with the reference: drop --remote");
        if (o->disk_blocks && !o->host_blocks) /* G4 is fed from G2 (a memory tier), beside G3 */
            die(2, "--remote with --disk-blocks needs a host tier (--host-blocks N): Redis is fed from host memory");
        o->bytes = 1; /* Redis stores real bytes: every pool above it is memory-backed */
    }
}

/* ---- workloads ---------------------------------------------------------------------------------- */

/* One request. Its prompt's full-block hashes are computed before any replay; hashes[-1] is the parent
 * of block 0 (the root), so hashes - 1 is the parents array of kvb_register_hashed. */
typedef struct sim_req {
    double arrival;          /* nominal arrival, seconds (trace: timestamp) */
    double think;            /* synthetic: gap after the previous turn finished */
    uint32_t conv, turn;     /* synthetic conversation and turn; trace: request number, 0 */
    uint32_t line;           /* trace line */
    uint32_t num_prompt, num_output, num_blocks;
    const kvb_hash *hashes;  /* num_blocks chained hashes (shared by the turns of a conversation) */
    const uint64_t *keys;    /* block identities for the reference LRU (trace: the hash ids) */
    const uint64_t *ids;     /* trace: the hash ids */
    uint32_t num_ids;
    int32_t next_turn;       /* synthetic: index of the conversation's next turn, -1 */
} sim_req;

typedef struct conv_info {
    uint32_t sys, doc;       /* doc UINT32_MAX: none */
    uint32_t first, turns;   /* its requests: first .. first + turns - 1 */
} conv_info;

typedef struct workload {
    int is_trace;
    uint32_t block_tokens;
    sim_req *reqs;
    size_t n, cap;
    size_t *order;           /* request indices by nominal arrival */
    conv_info *convs;
    size_t nconv;
    uint32_t sys_len[SYN_SYSTEM], doc_len[SYN_DOCS];
    uint32_t *user_len, *out_len; /* per request (synthetic) */
    size_t malformed;        /* trace lines skipped */
    void **owned;            /* allocations to free */
    size_t nowned, capowned;
} workload;

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

/* Token i of the reply to request r (what the simulated engine samples). */
static uint32_t output_token(const workload *w, const sim_req *r, uint32_t i)
{
    uint32_t t;
    if (w->is_trace) gen_tokens(&t, SEG_TRACE_REPLY, r->conv, i, 1);
    else gen_tokens(&t, SEG_REPLY, r->conv, ((uint64_t)r->turn << 32) | i, 1);
    return t;
}

/* The prompt of request r into buf (num_prompt tokens). */
static void fill_prompt(const workload *w, const sim_req *r, uint32_t *buf)
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
            for (i = 0; i < w->out_len[q]; i++) buf[at + i] = output_token(w, &w->reqs[q], (uint32_t)i);
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

/* Mooncake JSONL. Returns the number of requests read. */
static int json_uint(const cJSON *o, const char *name, double max, double *out, char *why, size_t whylen)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v) {
        snprintf(why, whylen, "field \"%s\" is missing", name);
        return 0;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > max || v->valuedouble != floor(v->valuedouble)) {
        snprintf(why, whylen, "field \"%s\" must be a non-negative integer", name);
        return 0;
    }
    *out = v->valuedouble;
    return 1;
}

static void load_trace(workload *w, const options *o)
{
    FILE *f = fopen(o->trace, "r");
    char *line = NULL, why[160];
    size_t linecap = 0, bufcap = 0;
    ssize_t len;
    uint32_t *buf = NULL, lineno = 0;
    uint64_t tail_key = 0;
    if (!f) die(2, "%s: %s", o->trace, strerror(errno));
    w->is_trace = 1;
    while ((len = getline(&line, &linecap, f)) >= 0) {
        cJSON *obj;
        const cJSON *ids, *id;
        double ts = 0, in = 0, out = 0;
        const char *end = NULL;
        uint32_t nids, j;
        int ok = 1;
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (strspn(line, " \t") == (size_t)len) continue; /* blank */
        obj = cJSON_ParseWithLengthOpts(line, (size_t)len, &end, 0);
        why[0] = 0;
        if (!obj) {
            const char *at = cJSON_GetErrorPtr();
            snprintf(why, sizeof why, "not valid JSON (at column %ld)", at && at >= line && at <= line + len ? (long)(at - line) + 1 : 0L);
            ok = 0;
        } else if (strspn(end, " \t") != strlen(end)) {
            snprintf(why, sizeof why, "text after the JSON object (at column %ld)", (long)(end - line) + 1);
            ok = 0;
        } else if (!cJSON_IsObject(obj)) {
            snprintf(why, sizeof why, "not a JSON object");
            ok = 0;
        } else if (!json_uint(obj, "timestamp", 9.0e15, &ts, why, sizeof why) ||
                   !json_uint(obj, "input_length", 1.0e9, &in, why, sizeof why) ||
                   !json_uint(obj, "output_length", 1.0e9, &out, why, sizeof why)) {
            ok = 0;
        } else if (!cJSON_IsArray(ids = cJSON_GetObjectItemCaseSensitive(obj, "hash_ids"))) {
            snprintf(why, sizeof why, "field \"hash_ids\" %s", ids ? "must be an array" : "is missing");
            ok = 0;
        } else {
            cJSON_ArrayForEach(id, ids) {
                if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= 9.0e15 ||
                    id->valuedouble != floor(id->valuedouble)) {
                    snprintf(why, sizeof why, "\"hash_ids\" must hold non-negative integers");
                    ok = 0;
                    break;
                }
            }
            if (ok && ((double)cJSON_GetArraySize(ids) * o->block_tokens > 64.0 * 1024 * 1024 || in > 64.0 * 1024 * 1024)) {
                snprintf(why, sizeof why, "prompt longer than 64 Mi tokens");
                ok = 0;
            }
        }
        if (!ok) {
            fprintf(stderr, "serve_sim: %s:%u: %s%s\n", o->trace, lineno, why, o->strict ? "" : "; line skipped");
            cJSON_Delete(obj);
            w->malformed++;
            if (o->strict) die(2, "stopping at the first malformed line (--strict)");
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
            GROW(buf, bufcap, n + 1);
            fill_prompt(w, rq, buf);
            hash_tokens(w, buf, n, &h, &keys);
            for (j = nids; j < rq->num_blocks; j++) keys[j] = (UINT64_C(1) << 63) | tail_key++;
            for (j = 0; j < nids && j < rq->num_blocks; j++) keys[j] = idv[j];
            rq->hashes = h;
            rq->keys = keys;
        }
        cJSON_Delete(obj);
    }
    free(line);
    free(buf);
    fclose(f);
    if (!w->n) die(2, "%s: no requests", o->trace);
}

typedef struct arrival_key { double t; size_t i; } arrival_key;
static int cmp_arrival(const void *a, const void *b)
{
    const arrival_key *x = (const arrival_key *)a, *y = (const arrival_key *)b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

static void load_workload(workload *w, const options *o)
{
    size_t i;
    memset(w, 0, sizeof *w);
    w->block_tokens = o->block_tokens;
    if (o->trace) load_trace(w, o);
    else make_synthetic(w, o);
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

static void free_workload(workload *w)
{
    size_t i;
    for (i = 0; i < w->nowned; i++) free(w->owned[i]);
    free(w->owned);
    free(w->reqs);
    free(w->convs);
    free(w->user_len);
    free(w->out_len);
}

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

static char tmp_path[64]; /* the --bytes disk file, removed at exit (also on SIGINT / SIGTERM) */
static char console_path[108]; /* --console: the socket, removed on SIGINT / SIGTERM too */
static void remove_tmp(void)
{
    if (tmp_path[0]) unlink(tmp_path);
    tmp_path[0] = 0;
}
static void on_signal(int sig)
{
    if (tmp_path[0]) unlink(tmp_path);
    if (console_path[0]) unlink(console_path);
    signal(sig, SIG_DFL);
    raise(sig);
}

typedef struct tiers {
    uint32_t n;              /* pools in the chain: the device, then host and disk when they have blocks,
                                then remote (G4) with --remote */
    int kind[TIER_ALL];      /* TIER_* of each */
    kvb_pool *pool[TIER_ALL];
    kvo_backend null_be, *mem, *disk, *redis;
    kvo_manager *mgr;        /* NULL when the device is alone */
    kvb_layout layout;       /* --bytes */
    uint64_t block_bytes;    /* --bytes: real bytes of one block */
    char disk_note[160];     /* what the disk backend said (the O_DIRECT fallback) */
} tiers;

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
 * device pool's event callback (may be NULL; it forwards to the bus itself). bus (may be NULL): the lower
 * pools' block events and every pipeline's transfer stages go there. */
static void open_tiers(tiers *t, const options *o, int lower, int bytes, double *clock, int sequential,
                       kvb_event_fn on_events, void *event_user, kvs_bus *bus)
{
    kvb_event_fn lower_events = bus ? kvs_bus_pool_events : NULL;
    kvo_manager_config mc;
    uint32_t i;
    memset(t, 0, sizeof *t);
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
                                  KVB_LAYOUT_LAYER_SEPARATE, &t->layout, lower_events, bus);
        t->kind[t->n++] = TIER_HOST;
    }
    if (o->disk_blocks) {
        t->pool[t->n] = make_pool(o, o->disk_blocks, t->n, KVB_EVICT_LINEAGE, KVB_DUP_REJECT, 0, 0, NULL, lower_events, bus);
        t->kind[t->n++] = TIER_DISK;
    }
    if (o->remote) { /* G4: a metadata-only pool standing for what Redis holds, filled through the backend */
        kvo_redis_config rc;
        char why[256] = "";
        int r;
        t->pool[t->n] = make_pool(o, o->remote_blocks, t->n, KVB_EVICT_LINEAGE, KVB_DUP_REJECT, 0, 0, NULL, lower_events,
                                  bus);
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
            snprintf(tmp_path, sizeof tmp_path, "/tmp/serve_sim.XXXXXX");
            if ((fd = mkstemp(tmp_path)) < 0) die(2, "cannot create a file under /tmp: %s", strerror(errno));
            close(fd);
            atexit(remove_tmp);
            signal(SIGINT, on_signal);
            signal(SIGTERM, on_signal);
            memset(&dc, 0, sizeof dc);
            dc.path = tmp_path;
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

static void close_tiers(tiers *t)
{
    uint32_t i;
    kvo_manager_destroy(t->mgr);
    kvo_backend_destroy(t->mem);
    kvo_backend_destroy(t->disk);
    kvo_backend_destroy(t->redis);
    for (i = 0; i < t->n; i++) kvb_pool_destroy(t->pool[i]);
    remove_tmp();
}

/* Transfer totals per direction, by tier kind: down[k] = into kind k (from down_from[k]: the tier above,
 * or host for G4 beside a disk tier), up[k] = from k to the device. Bytes are real with --bytes, modeled
 * otherwise. */
typedef struct traffic {
    uint64_t down_blocks[TIER_ALL], down_bytes[TIER_ALL], up_blocks[TIER_ALL], up_bytes[TIER_ALL];
    uint64_t evictions[TIER_ALL];
    int down_from[TIER_ALL]; /* kind of the tier it is fed from, -1 */
    int present[TIER_ALL];
    kvo_redis_stats redis;  /* --remote: the backend's counters (imported = blocks other runs stored) */
} traffic;

static void collect_traffic(tiers *t, const options *o, int bytes, traffic *tr)
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

static void pattern_write(const tiers *t, kvb_block b, const kvb_hash *h)
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

static int pattern_ok(const tiers *t, kvb_block b, const kvb_hash *h)
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

/* ---- time series for --svg ---------------------------------------------------------------------- */

typedef struct sample { double x; uint64_t hits[TIER_ALL], prompt; float occ[TIER_ALL]; } sample;
typedef struct series { sample *s; size_t n, cap; } series;

static void series_add(series *sv, const tiers *t, double x, const uint64_t *hits, uint64_t prompt)
{
    sample *s;
    uint32_t i;
    GROW(sv->s, sv->cap, sv->n + 1);
    s = &sv->s[sv->n++];
    memset(s, 0, sizeof *s);
    s->x = x;
    memcpy(s->hits, hits, sizeof s->hits);
    s->prompt = prompt;
    for (i = 0; i < TIER_ALL; i++) s->occ[i] = -1.0f;
    for (i = 0; i < t->n; i++) {
        kvb_pool_stats ps;
        memset(&ps, 0, sizeof ps);
        kvb_pool_get_stats(t->pool[i], &ps);
        if (!ps.num_blocks) continue;
        s->occ[t->kind[i]] = (float)(ps.num_blocks - ps.free_blocks) / (float)ps.num_blocks;
    }
}

/* ---- the results of a run ----------------------------------------------------------------------- */

typedef struct results {
    uint64_t requests, skipped, prompt_blocks, hit_blocks, tier_hits[TIER_ALL];
    double *ttft;            /* seconds, per finished request */
    size_t nttft;
    double *ttft_nocache;
    size_t nttft_nocache;
    double *cpu;             /* seconds of CPU per scheduler step */
    size_t ncpu;
    uint64_t steps, preempted;
    double sim_seconds, wall_seconds, replay_seconds;
    uint64_t verified, mismatches;
    traffic tr;
    double lru_rate;         /* --check-lru */
    int lru_checked;
    char *metrics;           /* --metrics: the Prometheus text at the end of the run */
    char disk_note[160];
} results;

/* ---- --sequential: the pure replay -------------------------------------------------------------- */

/* Lower-tier hits after the device prefix blocks [0, k): onboarded into the device, references in blk.
 * With --remote the lookup also asks Redis (kvo_redis_manager_lookup: local tiers first, then what other
 * runs or processes stored there). Returns the new end of the cached prefix. */
static size_t onboard_rest(tiers *t, const sim_req *r, size_t k, size_t n, kvb_block *blk, uint8_t *tier_of,
                           uint64_t *hits)
{
    size_t found = 0, i = 0;
    kvo_result lr = t->redis ? kvo_redis_manager_lookup(t->mgr, t->redis, r->hashes + k, n - k, tier_of, &found)
                             : kvo_manager_lookup(t->mgr, r->hashes + k, n - k, tier_of, &found);
    if (lr != KVO_OK) return k;
    while (i < found) {
        size_t j = i, got = 0, run;
        uint8_t tier = tier_of[i];
        while (j < found && tier_of[j] == tier) j++;
        run = j - i; /* blocks [i, j) are held by one tier */
        if (tier == 0) {
            kvb_match(t->pool[0], r->hashes + k + i, j - i, blk + k + i, &got);
        } else {
            kvo_pipeline *up = kvo_manager_pipeline(t->mgr, tier, 1);
            kvo_transfer x;
            kvo_status st = KVO_STATUS_FAILED;
            if (kvo_manager_onboard(t->mgr, tier, r->hashes + k + i, j - i, &x) != KVO_OK) break;
            kvo_transfer_wait(up, x, -1, &st);
            if (st == KVO_STATUS_COMPLETE) kvo_transfer_take_blocks(up, x, blk + k + i, j - i, &got);
            kvo_transfer_release(up, x);
        }
        hits[t->kind[tier]] += got;
        i += got;
        if (got < run) break; /* the prefix ends where a load came up short */
    }
    return k + i;
}

static void replay(const workload *w, const options *o, results *res, series *sv)
{
    tiers t;
    size_t q, maxb = 1, every = w->n / 600 + 1;
    kvb_block *blk;
    uint8_t *tier_of;
    double t0;
    open_tiers(&t, o, 1, o->bytes, NULL, 1, NULL, NULL, NULL);
    for (q = 0; q < w->n; q++)
        if (w->reqs[q].num_blocks > maxb) maxb = w->reqs[q].num_blocks;
    if (maxb > o->device_blocks) maxb = o->device_blocks;
    blk = (kvb_block *)xcalloc(maxb, sizeof *blk);
    tier_of = (uint8_t *)xcalloc(maxb, 1);
    if (sv) series_add(sv, &t, 0, res->tier_hits, 0);
    t0 = wall_now();
    for (q = 0; q < w->n; q++) {
        const sim_req *r = &w->reqs[w->order[q]];
        size_t n = r->num_blocks < o->device_blocks ? r->num_blocks : o->device_blocks, m = 0, k, i;
        res->prompt_blocks += r->num_blocks; /* blocks past the device size count as misses */
        if (!n) continue;
        kvb_match(t.pool[0], r->hashes, n, blk, &m);
        res->tier_hits[TIER_DEVICE] += m;
        k = m;
        if (t.mgr && k < n) k = onboard_rest(&t, r, k, n, blk, tier_of, res->tier_hits);
        if (o->bytes)
            for (i = 0; i < k; i++) {
                res->verified++;
                res->mismatches += !pattern_ok(&t, blk[i], &r->hashes[i]);
            }
        if (k < n) {
            check_kv(kvb_alloc(t.pool[0], n - k, blk + k), "kvb_alloc");
            check_kv(kvb_register_hashed(t.pool[0], blk + k, n - k, r->hashes + k, r->hashes + k - 1, blk + k),
                     "kvb_register_hashed");
            if (o->bytes)
                for (i = k; i < n; i++) pattern_write(&t, blk[i], &r->hashes[i]);
            if (t.mgr) kvo_manager_offer(t.mgr, 0, blk + k, n - k, NULL);
        }
        check_kv(kvb_release(t.pool[0], blk, n, NULL), "kvb_release");
        if (t.mgr) kvo_manager_poll(t.mgr);
        if (sv && (q % every == 0 || q + 1 == w->n)) series_add(sv, &t, (double)(q + 1), res->tier_hits, res->prompt_blocks);
    }
    res->replay_seconds = wall_now() - t0;
    if (t.mgr) kvo_manager_drain(t.mgr, 10 * 1000000);
    res->requests = w->n;
    res->hit_blocks = res->tier_hits[0] + res->tier_hits[1] + res->tier_hits[2] + res->tier_hits[TIER_REMOTE];
    collect_traffic(&t, o, o->bytes, &res->tr);
    snprintf(res->disk_note, sizeof res->disk_note, "%s", t.disk_note);
    close_tiers(&t);
    free(blk);
    free(tier_of);
}

/* The reference: a plain LRU prefix cache of `cap` blocks, keyed by block identity (the trace's hash
 * ids), written independently of kvblock.h. Per request: the prefix of cached blocks hits; the misses
 * are inserted (evicting the least recent); then the request's blocks become most recent, deepest
 * first — the order in which kvb_release gives them back, so block 0 ends most recent. */
typedef struct lru_ref {
    u64map map;             /* key -> node */
    uint64_t *key;
    uint32_t *prev, *next;  /* node cap is the list head: next = least recent, prev = most recent */
    uint32_t cap, n;
} lru_ref;

static void lru_unlink(lru_ref *c, uint32_t x)
{
    c->next[c->prev[x]] = c->next[x];
    c->prev[c->next[x]] = c->prev[x];
}
static void lru_push_mru(lru_ref *c, uint32_t x)
{
    uint32_t h = c->cap;
    c->prev[x] = c->prev[h];
    c->next[x] = h;
    c->next[c->prev[h]] = x;
    c->prev[h] = x;
}

static double reference_lru(const workload *w, uint32_t cap)
{
    lru_ref c;
    uint64_t hits = 0, total = 0;
    size_t q;
    memset(&c, 0, sizeof c);
    c.cap = cap;
    map_init(&c.map, cap);
    c.key = (uint64_t *)xcalloc(cap, sizeof *c.key);
    c.prev = (uint32_t *)xcalloc((size_t)cap + 1, sizeof *c.prev);
    c.next = (uint32_t *)xcalloc((size_t)cap + 1, sizeof *c.next);
    c.prev[cap] = c.next[cap] = cap;
    for (q = 0; q < w->n; q++) {
        const sim_req *r = &w->reqs[w->order[q]];
        size_t n = r->num_blocks < cap ? r->num_blocks : cap, m = 0, i;
        total += r->num_blocks;
        while (m < n && map_get(&c.map, r->keys[m]) != UINT32_MAX) m++;
        hits += m;
        for (i = 0; i < m; i++) { /* in use by the request: not evictable while its misses come in */
            uint32_t x = map_get(&c.map, r->keys[i]);
            lru_unlink(&c, x);
            lru_push_mru(&c, x);
        }
        for (i = m; i < n; i++) {
            uint32_t x = map_get(&c.map, r->keys[i]);
            if (x == UINT32_MAX) {
                if (c.n < cap) {
                    x = c.n++;
                } else { /* evict the least recent */
                    x = c.next[cap];
                    lru_unlink(&c, x);
                    map_del(&c.map, c.key[x]);
                }
                c.key[x] = r->keys[i];
                map_put(&c.map, r->keys[i], x);
            } else {
                lru_unlink(&c, x);
            }
            lru_push_mru(&c, x);
        }
        for (i = n; i-- > 0;) { /* released deepest first */
            uint32_t x = map_get(&c.map, r->keys[i]);
            lru_unlink(&c, x);
            lru_push_mru(&c, x);
        }
    }
    map_free(&c.map);
    free(c.key);
    free(c.prev);
    free(c.next);
    return total ? (double)hits / (double)total : 0.0;
}

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

/* cache_on = 0: the same arrivals with every request salted apart and no lower tiers (the baseline). */
static void run_sched(const workload *w, const options *o, int cache_on, results *res, series *sv, int progress)
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

/* ---- --svg -------------------------------------------------------------------------------------- */

static void svg_text_escaped(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else fputc(*s, f);
    }
}

/* Tick spacing: 1, 2 or 5 times a power of ten, about range / 6. */
static double nice_step(double range)
{
    double raw = range / 6.0, p = pow(10.0, floor(log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}

/* The last sample at or before each of nb equal intervals of x (NULL when the interval has none). */
static const sample *bucket_end(const series *sv, size_t *i, size_t b, size_t nb, double x0, double x1)
{
    double edge = x0 + (x1 - x0) * (double)(b + 1) / (double)nb;
    const sample *last = NULL;
    while (*i < sv->n && (sv->s[*i].x <= edge || b + 1 == nb)) last = &sv->s[(*i)++];
    return last;
}

static int write_svg(const char *path, const series *sv, const char *title, const char *xlabel)
{
    enum { W = 960, H = 690, L = 80, R = 40, B = 120 };
    const double top0 = 70, bot0 = 300, top1 = 370, bot1 = 580;
    const char *tier_color[TIER_KINDS] = {"#2ca02c", "#9467bd", "#8c564b"};
    const sample *first, *last;
    FILE *f;
    double x0, x1, step, v;
    size_t b, i, nb;
    int k;
    if (!sv->n) return 0;
    if (!(f = fopen(path, "w"))) return -1;
    first = &sv->s[0];
    last = &sv->s[sv->n - 1];
    x0 = first->x;
    x1 = last->x > x0 ? last->x : x0 + 1;
    nb = sv->n < B ? sv->n : B;
    step = nice_step(x1 - x0);
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, H, W, H);
    fprintf(f, "<text x=\"%d\" y=\"28\" font-size=\"16\" font-weight=\"bold\">", L);
    svg_text_escaped(f, title);
    fprintf(f, "</text>\n");
#define SX(x) (L + (double)(W - L - R) * ((x) - x0) / (x1 - x0))
#define SY(v, top, bot) ((bot) - ((bot) - (top)) * (v))
    for (k = 0; k < 2; k++) { /* the two panels: title, grid, axes */
        double top = k ? top1 : top0, bot = k ? bot1 : bot0;
        int g;
        fprintf(f, "<text x=\"%d\" y=\"%.0f\" font-weight=\"bold\">%s</text>\n", L, top - 10,
                k ? "tier occupancy (cached blocks / capacity)"
                  : "prefix-cache hit rate (hit blocks / prompt blocks)");
        for (g = 0; g <= 4; g++) {
            double y = bot - (bot - top) * g / 4.0;
            fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                       "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n",
                    L, y, W - R, y, L - 6, y + 4, g / 4.0);
        }
        for (v = ceil(x0 / step) * step; v <= x1 + 1e-9 * step; v += step)
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#eee\"/>"
                       "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n",
                    SX(v), top, SX(v), bot, SX(v), bot + 16, v);
        fprintf(f, "<rect x=\"%d\" y=\"%.0f\" width=\"%d\" height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n", L, top,
                W - L - R, bot - top);
        fprintf(f, "<text x=\"%d\" y=\"%.0f\" text-anchor=\"middle\">%s</text>\n", (W + L - R) / 2, bot + 34, xlabel);
    }
    /* hit rate per interval (all tiers, then host and disk alone) and cumulative */
    for (k = 0; k < 2 + TIER_KINDS - 1; k++) {
        static const char *style[] = {"stroke=\"#1f77b4\" stroke-width=\"1.5\"", "stroke=\"#ff7f0e\" stroke-width=\"2\"",
                                      "stroke=\"#9467bd\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"",
                                      "stroke=\"#8c564b\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\""};
        uint64_t ph = 0, pp = 0;
        int open = 0;
        if (k >= 2 && first->occ[k - 1] < 0) continue; /* no such tier */
        for (i = 0, b = 0; b < nb; b++) {
            const sample *e = bucket_end(sv, &i, b, nb, x0, x1);
            uint64_t h;
            if (!e) continue;
            h = k >= 2 ? e->hits[k - 1] : e->hits[0] + e->hits[1] + e->hits[2];
            if (k == 1 ? e->prompt > 0 : e->prompt > pp) {
                v = k == 1 ? (double)h / (double)e->prompt : (double)(h - ph) / (double)(e->prompt - pp);
                fprintf(f, "%s%.1f,%.1f", open ? " " : "<polyline fill=\"none\" points=\"", SX(e->x), SY(v, top0, bot0));
                open = 1;
            }
            ph = h;
            pp = e->prompt;
        }
        if (open) fprintf(f, "\" %s/>\n", style[k]);
    }
    for (k = 0; k < TIER_KINDS; k++) { /* occupancy per tier */
        int open = 0;
        if (first->occ[k] < 0) continue;
        for (i = 0, b = 0; b < nb; b++) {
            const sample *e = bucket_end(sv, &i, b, nb, x0, x1);
            if (!e) continue;
            fprintf(f, "%s%.1f,%.1f", open ? " " : "<polyline fill=\"none\" stroke-width=\"2\" points=\"", SX(e->x),
                    SY(e->occ[k], top1, bot1));
            open = 1;
        }
        if (open) fprintf(f, "\" stroke=\"%s\"/>\n", tier_color[k]);
    }
#undef SX
#undef SY
    { /* legend */
        static const char *names[] = {"hit rate per interval", "cumulative hit rate", "from host", "from disk"};
        static const char *colors[] = {"#1f77b4", "#ff7f0e", "#9467bd", "#8c564b"};
        double y = H - 44;
        int x = L;
        for (k = 0; k < 4; k++) {
            if (k >= 2 && first->occ[k - 1] < 0) continue;
            fprintf(f, "<line x1=\"%d\" y1=\"%.0f\" x2=\"%d\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"2\"%s/>"
                       "<text x=\"%d\" y=\"%.0f\">%s</text>\n",
                    x, y, x + 24, y, colors[k], k >= 2 ? " stroke-dasharray=\"4 3\"" : "", x + 30, y + 4, names[k]);
            x += k < 2 ? 165 : 95;
        }
        x = L;
        y = H - 20;
        for (k = 0; k < TIER_KINDS; k++) {
            if (first->occ[k] < 0) continue;
            fprintf(f, "<line x1=\"%d\" y1=\"%.0f\" x2=\"%d\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"4\"/>"
                       "<text x=\"%d\" y=\"%.0f\">%s occupancy</text>\n", x, y, x + 24, y, tier_color[k], x + 30, y + 4,
                    tier_names[k]);
            x += 165;
        }
    }
    fprintf(f, "</svg>\n");
    return fclose(f) == 0 ? 0 : -1;
}

/* ---- reports ------------------------------------------------------------------------------------ */

static double ratio(uint64_t a, uint64_t b) { return b ? (double)a / (double)b : 0.0; }

static void human_bytes(char *out, size_t len, uint64_t v)
{
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double x = (double)v;
    int u = 0;
    while (x >= 1024 && u < 4) {
        x /= 1024;
        u++;
    }
    snprintf(out, len, u ? "%.1f %s" : "%.0f %s", x, unit[u]);
}

typedef struct summary { double p50, p90, p99; } summary;
static summary ttft_summary(double *v, size_t n)
{
    summary s;
    s.p50 = percentile(v, n, 50) * 1e3;
    s.p90 = percentile(v, n, 90) * 1e3;
    s.p99 = percentile(v, n, 99) * 1e3;
    return s;
}

static void describe(char *out, size_t len, const workload *w, const options *o)
{
    if (w->is_trace)
        snprintf(out, len, "trace %s: %zu requests (%zu malformed lines skipped), %u tokens per block", o->trace, w->n,
                 w->malformed, o->block_tokens);
    else
        snprintf(out, len, "synthetic workload, seed %llu: %zu requests in %zu conversations, %u tokens per block",
                 (unsigned long long)o->seed, w->n, w->nconv, o->block_tokens);
}

static void print_text(const workload *w, const options *o, results *r)
{
    char d[256], b1[32];
    int k, first, nk = o->remote ? TIER_ALL : TIER_KINDS;
    uint32_t bt = o->block_tokens;
    describe(d, sizeof d, w, o);
    printf("serve_sim — %s\n", d);
    printf("  pools: device %u blocks (%s eviction), host %u, disk %u — %s; offload %s%s\n\n", o->device_blocks,
           name_of(eviction_names, o->eviction), o->host_blocks, o->disk_blocks,
           o->bytes ? "memory-backed (--bytes)" : "metadata only", name_of(offload_names, o->offload),
           o->sequential ? "; sequential replay, no scheduler" : "");
    if (o->remote) printf("  remote (G4): Redis at %s, namespace serve_sim\n\n", o->remote);
    if (o->sequential) printf("%-22s %llu replayed\n", "requests", (unsigned long long)r->requests);
    else
        printf("%-22s %llu finished (%llu too big for the device pool)\n", "requests", (unsigned long long)r->requests,
               (unsigned long long)r->skipped);
    printf("%-22s %12llu blocks %14llu tokens\n", "prompt blocks", (unsigned long long)r->prompt_blocks,
           (unsigned long long)r->prompt_blocks * bt);
    printf("%-22s %12llu blocks %14llu tokens   hit rate %.4f\n", "hit blocks", (unsigned long long)r->hit_blocks,
           (unsigned long long)r->hit_blocks * bt, ratio(r->hit_blocks, r->prompt_blocks));
    for (k = 0; k < nk; k++)
        printf("  %-20s %12llu blocks %14llu tokens            %.4f%s\n", tier_names[k],
               (unsigned long long)r->tier_hits[k], (unsigned long long)r->tier_hits[k] * bt,
               ratio(r->tier_hits[k], r->prompt_blocks), r->tr.present[k] ? "" : "   (no such tier)");
    printf("%-22s", "evictions");
    for (k = 0; k < nk; k++)
        if (r->tr.present[k]) printf(" %s %llu ", tier_names[k], (unsigned long long)r->tr.evictions[k]);
    printf("\n");
    for (k = 0, first = 1; k < nk; k++) {
        char lbl[32];
        if (r->tr.down_from[k] < 0) continue;
        snprintf(lbl, sizeof lbl, "%s -> %s", tier_names[r->tr.down_from[k]], tier_names[k]);
        human_bytes(b1, sizeof b1, r->tr.down_bytes[k]);
        printf("%-22s %-16s %10llu blocks %12s%s\n", first ? "offloaded" : "", lbl,
               (unsigned long long)r->tr.down_blocks[k], b1, o->bytes ? "" : " (modeled)");
        first = 0;
    }
    for (k = 1; k < nk; k++) {
        char lbl[32];
        if (!r->tr.present[k]) continue;
        snprintf(lbl, sizeof lbl, "%s -> device", tier_names[k]);
        human_bytes(b1, sizeof b1, r->tr.up_bytes[k]);
        printf("%-22s %-16s %10llu blocks %12s%s\n", "onboarded", lbl, (unsigned long long)r->tr.up_blocks[k], b1,
               o->bytes ? "" : " (modeled)");
    }
    if (o->bytes)
        printf("%-22s %llu cached blocks checked byte for byte, %llu mismatches\n", "data check",
               (unsigned long long)r->verified, (unsigned long long)r->mismatches);
    if (r->disk_note[0]) printf("%-22s %s\n", "disk tier", r->disk_note);
    if (o->remote)
        printf("%-22s %llu blocks found in Redis that this run did not store; %llu checksum errors, %llu I/O errors\n",
               "remote tier", (unsigned long long)r->tr.redis.imported, (unsigned long long)r->tr.redis.checksum_errors,
               (unsigned long long)r->tr.redis.io_errors);
    if (o->sequential) {
        printf("%-22s %.6f s for %llu prompt blocks: %.1f ns per block\n", "replay loop", r->replay_seconds,
               (unsigned long long)r->prompt_blocks, r->prompt_blocks ? r->replay_seconds * 1e9 / (double)r->prompt_blocks : 0.0);
        if (r->lru_checked) {
            double pool = ratio(r->hit_blocks, r->prompt_blocks), diff = fabs(pool - r->lru_rate);
            printf("%-22s %.4f, pool (%s) %.4f: difference %.4f, %s\n", "LRU reference", r->lru_rate,
                   name_of(eviction_names, o->eviction), pool, diff, diff <= 0.005 ? "match (<= 0.005)" : "MISMATCH (> 0.005)");
        }
    } else {
        summary a = ttft_summary(r->ttft, r->nttft), b = ttft_summary(r->ttft_nocache, r->nttft_nocache);
        double mean = 0;
        size_t i;
        printf("%-22s with cache     p50 %9.1f ms   p90 %9.1f ms   p99 %9.1f ms\n", "TTFT (simulated)", a.p50, a.p90,
               a.p99);
        printf("%-22s without cache  p50 %9.1f ms   p90 %9.1f ms   p99 %9.1f ms\n", "", b.p50, b.p90, b.p99);
        for (i = 0; i < r->ncpu; i++) mean += r->cpu[i];
        mean = r->ncpu ? mean / (double)r->ncpu : 0;
        printf("%-22s %llu steps, %llu preemptions; CPU per step (kvs_sched_step + complete): mean %.1f us, p99 %.1f us\n",
               "scheduler", (unsigned long long)r->steps, (unsigned long long)r->preempted, mean * 1e6,
               percentile(r->cpu, r->ncpu, 99) * 1e6);
        printf("%-22s %.1f s simulated in %.2f s (with cache)\n", "time", r->sim_seconds, r->wall_seconds);
    }
}

static void json_num(cJSON *o, const char *k, double v) { cJSON_AddItemToObject(o, k, isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull()); }

static void print_json(const workload *w, const options *o, results *r)
{
    cJSON *j = cJSON_CreateObject();
    char key[96], *text;
    int k, nk = o->remote ? TIER_ALL : TIER_KINDS;
    uint32_t bt = o->block_tokens;
    cJSON_AddStringToObject(j, "workload", w->is_trace ? "trace" : "synthetic");
    if (w->is_trace) cJSON_AddStringToObject(j, "trace", o->trace);
    else json_num(j, "seed", (double)o->seed);
    cJSON_AddStringToObject(j, "mode", o->sequential ? "sequential" : "scheduler");
    json_num(j, "block_tokens", bt);
    json_num(j, "device_blocks", o->device_blocks);
    json_num(j, "host_blocks", o->host_blocks);
    json_num(j, "disk_blocks", o->disk_blocks);
    if (o->remote) cJSON_AddStringToObject(j, "remote", o->remote);
    cJSON_AddStringToObject(j, "eviction", name_of(eviction_names, o->eviction));
    cJSON_AddStringToObject(j, "offload", name_of(offload_names, o->offload));
    cJSON_AddBoolToObject(j, "bytes", o->bytes);
    json_num(j, "requests", (double)r->requests);
    json_num(j, "skipped_requests", (double)r->skipped);
    json_num(j, "malformed_lines", (double)w->malformed);
    json_num(j, "prompt_blocks", (double)r->prompt_blocks);
    json_num(j, "prompt_tokens", (double)r->prompt_blocks * bt);
    json_num(j, "hit_blocks", (double)r->hit_blocks);
    json_num(j, "hit_tokens", (double)r->hit_blocks * bt);
    json_num(j, "hit_rate", ratio(r->hit_blocks, r->prompt_blocks));
    for (k = 0; k < nk; k++) {
        snprintf(key, sizeof key, "%s_hit_blocks", tier_names[k]);
        json_num(j, key, (double)r->tier_hits[k]);
        snprintf(key, sizeof key, "%s_hit_tokens", tier_names[k]);
        json_num(j, key, (double)r->tier_hits[k] * bt);
        snprintf(key, sizeof key, "%s_hit_rate", tier_names[k]);
        json_num(j, key, ratio(r->tier_hits[k], r->prompt_blocks));
    }
    for (k = 0; k < nk; k++) {
        if (!r->tr.present[k]) continue;
        snprintf(key, sizeof key, "%s_evictions", tier_names[k]);
        json_num(j, key, (double)r->tr.evictions[k]);
    }
    for (k = 0; k < nk; k++) {
        if (r->tr.down_from[k] >= 0) {
            snprintf(key, sizeof key, "offloaded_blocks_%s_to_%s", tier_names[r->tr.down_from[k]], tier_names[k]);
            json_num(j, key, (double)r->tr.down_blocks[k]);
            snprintf(key, sizeof key, "offloaded_bytes_%s_to_%s", tier_names[r->tr.down_from[k]], tier_names[k]);
            json_num(j, key, (double)r->tr.down_bytes[k]);
        }
        if (k && r->tr.present[k]) {
            snprintf(key, sizeof key, "onboarded_blocks_%s_to_device", tier_names[k]);
            json_num(j, key, (double)r->tr.up_blocks[k]);
            snprintf(key, sizeof key, "onboarded_bytes_%s_to_device", tier_names[k]);
            json_num(j, key, (double)r->tr.up_bytes[k]);
        }
    }
    if (o->remote) {
        json_num(j, "remote_imported_blocks", (double)r->tr.redis.imported);
        json_num(j, "remote_checksum_errors", (double)r->tr.redis.checksum_errors);
        json_num(j, "remote_io_errors", (double)r->tr.redis.io_errors);
    }
    cJSON_AddBoolToObject(j, "bytes_modeled", !o->bytes);
    if (o->bytes) {
        json_num(j, "verified_blocks", (double)r->verified);
        json_num(j, "data_mismatches", (double)r->mismatches);
    }
    if (o->sequential) {
        json_num(j, "replay_seconds", r->replay_seconds);
        json_num(j, "replay_ns_per_block", r->prompt_blocks ? r->replay_seconds * 1e9 / (double)r->prompt_blocks : 0);
        if (r->lru_checked) {
            json_num(j, "lru_reference_hit_rate", r->lru_rate);
            cJSON_AddBoolToObject(j, "lru_match", fabs(ratio(r->hit_blocks, r->prompt_blocks) - r->lru_rate) <= 0.005);
        }
    } else {
        summary a = ttft_summary(r->ttft, r->nttft), b = ttft_summary(r->ttft_nocache, r->nttft_nocache);
        double mean = 0;
        size_t i;
        for (i = 0; i < r->ncpu; i++) mean += r->cpu[i];
        mean = r->ncpu ? mean / (double)r->ncpu : 0;
        json_num(j, "ttft_p50_ms", a.p50);
        json_num(j, "ttft_p90_ms", a.p90);
        json_num(j, "ttft_p99_ms", a.p99);
        json_num(j, "ttft_nocache_p50_ms", b.p50);
        json_num(j, "ttft_nocache_p90_ms", b.p90);
        json_num(j, "ttft_nocache_p99_ms", b.p99);
        json_num(j, "steps", (double)r->steps);
        json_num(j, "preemptions", (double)r->preempted);
        json_num(j, "cpu_us_per_step", mean * 1e6);
        json_num(j, "cpu_us_per_step_p99", percentile(r->cpu, r->ncpu, 99) * 1e6);
        json_num(j, "sim_seconds", r->sim_seconds);
        json_num(j, "wall_seconds", r->wall_seconds);
    }
    text = cJSON_Print(j);
    if (!text) die(2, "out of memory");
    printf("%s\n", text);
    cJSON_free(text);
    cJSON_Delete(j);
}

int main(int argc, char **argv)
{
    options o;
    workload w;
    results res, base;
    series sv;
    int status = 0, lru_failed = 0;
    parse_options(argc, argv, &o);
    if (o.help) {
        usage(stdout);
        return 0;
    }
    load_workload(&w, &o);
    if (o.remote) { /* G4 remembers every block the workload could compute (at least 1024, at most 4 Mi) */
        uint64_t total = 0;
        size_t q;
        for (q = 0; q < w.n; q++) total += w.reqs[q].num_blocks;
        o.remote_blocks = (uint32_t)(total < 1024 ? 1024 : total > (UINT64_C(1) << 22) ? (UINT64_C(1) << 22) : total);
    }
    memset(&res, 0, sizeof res);
    memset(&base, 0, sizeof base);
    memset(&sv, 0, sizeof sv);
    if (o.sequential) {
        replay(&w, &o, &res, o.svg ? &sv : NULL);
        if (o.check_lru) {
            res.lru_rate = reference_lru(&w, o.device_blocks);
            res.lru_checked = 1;
            lru_failed = fabs(ratio(res.hit_blocks, res.prompt_blocks) - res.lru_rate) > 0.005;
        }
    } else {
        int progress = isatty(STDERR_FILENO);
        run_sched(&w, &o, 1, &res, o.svg ? &sv : NULL, progress);
        run_sched(&w, &o, 0, &base, NULL, progress);
        res.ttft_nocache = base.ttft;
        res.nttft_nocache = base.nttft;
    }
    if (res.mismatches || lru_failed) status = 1;
    if (o.svg) {
        char title[300];
        describe(title, sizeof title, &w, &o);
        if (write_svg(o.svg, &sv, title, o.sequential ? "requests replayed" : "simulated seconds") != 0)
            die(2, "%s: %s", o.svg, strerror(errno));
    }
    if (o.json) {
        print_json(&w, &o, &res);
    } else {
        print_text(&w, &o, &res);
        if (o.check_lru || o.bytes) { /* the summary line tests/run.sh adds up */
            int failed = (res.mismatches > 0) + lru_failed;
            int checks = (o.check_lru != 0) + (o.bytes != 0);
            printf("%d passed, %d failed\n", checks - failed, failed);
        }
    }
    if (res.metrics) { /* after the report: --metrics - puts it last on stdout */
        FILE *f = strcmp(o.metrics, "-") ? fopen(o.metrics, "w") : stdout;
        if (!f || fputs(res.metrics, f) < 0 || (f != stdout && fclose(f) != 0))
            die(2, "--metrics %s: %s", o.metrics, strerror(errno));
        free(res.metrics);
    }
    free(res.ttft);
    free(res.cpu);
    free(base.ttft);
    free(base.cpu);
    free(sv.s);
    free_workload(&w);
    return status;
}
