/* kvbench.c — benchmarks of kvcache's kvblock.h and kvoffload.h (the numbers the README quotes come from here)
 *
 * Measures, in one run:
 *   hash_ns_per_block     kvb_hash_block chained over 16-token blocks (parent = previous hash)
 *   hash_vs_xxh3_128      ours / the same chain with XXH3_128bits over the same 88 bytes (with
 *                         libxxhash; xxh3_128_ns_per_block is that chain's time, for reference)
 *   block_cycle_ns        alloc 16 (each evicts) + register_hashed 16 + release 16, in a full pool
 *                         of 1,048,576 metadata-only blocks, per block; _1k: the same in 1,024 blocks
 *   match_ns_per_block    kvb_match of a 256-block chain + kvb_release of it, metadata not in cache
 *   route_ns_per_block    kvs_router_route (KV-aware, kvroute.h) over an index of 8 workers and 1,048,576
 *                         hashes (16,384 chains of 64 blocks: each held whole by one worker, a prefix by
 *                         another, half of them the first 0-16 blocks by a third), 4,096 requests per
 *                         repetition, each a random chain's first 4, 16, 32 or 64 blocks then 8 blocks
 *                         nobody holds, caches emptied before each repetition; per index probe (a route
 *                         stops at the first block no worker holds); route_ns: the same per route
 *   evict_lru_ns          block_cycle_ns's cycle under LRU, all of it timed; evict_fol_ns / evict_arc_ns /
 *                         evict_s3fifo_ns the same under FOL (self-tuning: its shadow pools' work is in the
 *                         release), ARC and S3-FIFO; evict_<policy>_vs_lru the ratios, _16k: the same in a
 *                         pool of 16,384 blocks (FOL's shadows sample a quarter of its blocks there); each
 *                         policy's rounds are interleaved with LRU's in a pool of its own (evict_lru_ns is
 *                         the LRU pool measured beside FOL's)
 *   replay_ns_per_block   a multi-turn chat trace (examples/workloads.h: 12,000 requests, shared system
 *                         prompts, conversations that grow turn by turn, 512-token blocks) replayed through a
 *                         10,000-block LRU pool as serve_sim --sequential does (kvb_match, kvb_alloc +
 *                         kvb_register_hashed of the misses, kvb_release), per prompt block;
 *                         bare_lru_ns_per_block: the same replay through a bare LRU prefix map written here
 *                         (a hash map and a linked list, serve_sim's reference_lru); replay_vs_bare_lru the
 *                         ratio (both must give the same hit rate, or the run stops); replay_fol_vs_lru: the
 *                         same replay under FOL (self-tuning, its default) / under LRU;
 *                         replay_request_ns_per_block: the LRU replay with kvb_request_begin (match, alloc
 *                         and register in one call) + kvb_release, replay_request_vs_bare_lru its ratio
 *   dram_floor_ns         independent random 64-byte reads with software prefetch, per read, from an
 *                         array of max(64 MiB, 2 x L3) (a large shared L3 would otherwise hold it)
 *   cold_read_ns          the same reads, 256 of them (one per block of the match's chain), each right after
 *                         the match's cache emptying, from a 64 MiB array advised huge pages (the big pool's
 *                         metadata, as kvblock.h allocates it): the least a cold lookup of the chain costs
 *                         per block, page walks included; cold_read_vs_dram_floor, match_vs_cold_read the
 *                         ratios (the match reads two lines a block: its index slot, then its metadata)
 * and from kvoffload.h (section "kvoffload.h" below):
 *   gather_vs_memcpy      memcpy backend (inline), one job of 256 random 16-token blocks of 128 KiB
 *                         (16 layers, 2 kv heads, head dim 64, fp16: 4 KiB pages) from a block-contiguous
 *                         to a layer-separate pool of 512 blocks each, GB/s / one contiguous memcpy of the
 *                         same 32 MiB between two buffers (caches emptied, left clean, before each; the
 *                         two interleaved, 9 rounds, medians);
 *                         contiguous_vs_memcpy: the same job block-contiguous -> block-contiguous;
 *                         memcpy_gbps: the reference (glibc memcpy; the backend uses streaming stores)
 *   pipeline_overhead_ns_per_block   enqueue -> Complete through the whole pipeline (KVO_MODE_POLL,
 *                         default config) with a backend that copies nothing, 64 containers of 64
 *                         metadata-only blocks, per block; _threads_: the same in KVO_MODE_THREADS
 *   load_latency_us       kvo_onboard of 2 blocks (below the min batch) in KVO_MODE_THREADS until
 *                         kvo_transfer_wait returns (the copy free), median of 63; thread_handoff_us:
 *                         two threads passing a turn through a condition variable and back, interleaved
 *                         with it (the floor of any threaded load); load_vs_handoff: their ratio
 *   disk_vs_sequential_write   disk backend (inline) writing 64 blocks of 2 MiB, fsync included / write()
 *                         of the same 128 MiB in 2 MiB chunks to the same file system with the same
 *                         O_DIRECT-ness, fsync included (the two interleaved, 7 rounds, medians);
 *                         disk_write_gbps, disk_read_gbps: the backend's write and its verified read back
 *                         from a dropped page cache (the onboarding path); GB/s = 1e9 bytes/s
 *   event_publish_ns      kvs_bus_publish of one event to a ring reader and an in-memory recorder;
 *                         event_log_vs_fwrite: the recorder appending 100,000 events to its log file
 *                         (CRC-32C, fclose included) / fwrite of as many 84-byte records to the same file
 *   sched_step_bus_idle_ratio   sched_step_us_1000 on a bus with no subscriber / without a bus (two
 *                         schedulers interleaved): the cost of being observable; _recorded_ratio: the
 *                         same with a recorder keeping every event (inputs included, for replay)
 *   cancel_latency_ms     kvo_transfer_cancel return time for a container sitting in the batcher below
 *                         min batch (KVO_MODE_THREADS), median of 50 (cancel_latency_max_ms: the
 *                         slowest); the goal is sweep interval + 1 ms
 * and from kvremote.h, when built with -DKVO_WITH_REDIS -lhiredis (the Makefile does) and redis-server and
 * redis-benchmark are installed (otherwise the keys are left out and the run says why):
 *   remote_put_gbps, remote_get_gbps   the Redis backend writing 256 blocks of 2 MiB to a redis-server
 *                         this run starts on loopback, in jobs of 64 (one pipelined round trip each), and
 *                         reading them back, checked; best of 3 (bench/kvbench_remote.h, as in
 *                         build/kvbench_remote); remote_vs_redis_benchmark: remote_put_gbps / the SET
 *                         throughput of `redis-benchmark -t set -d 2097152 -P 16 -c 1` on that server
 *
 * Run:  make bench                  a table: key, value, unit, goal, pass/miss
 *       build/kvbench --json        one JSON object on stdout:
 *                                   {"machine": {...}, "<key>": value, ..., "goals": {"<key>": goal}}
 * A whole run takes 10-15 s on a 2-core machine (well under 40 s). The disk part needs about 260 MiB free
 * in /tmp (a temporary directory, removed at the end, also when a check fails).
 *
 * Each measurement is repeated (after one untimed warm-up). Reported: the median, which ignores the
 * occasional outlier; for the two hash chains the minimum, since they are pure computation in L1/L2
 * where noise (other tenants, frequency changes) can only add time and the spread between runs is as
 * large as the difference being measured. To add a key: time it in a run_once function, summarize
 * with summarize_runs(), record it with results_add(); both output formats pick it up.
 *
 * To compare two versions of the headers, build one kvbench per version from a directory holding all
 * five (kvblock.h, kvoffload.h, kvsched.h, kvroute.h, kvremote.h), named first: -I that-dir -I. ...
 * kvroute.h includes the others from its own directory, so a directory without it compiles the
 * working tree's headers instead, and the A/B compares a build with itself. Interleave the runs.
 */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#define KVROUTE_IMPLEMENTATION
#include "kvroute.h" /* includes kvsched.h, kvoffload.h and kvblock.h */
#ifdef KVO_WITH_REDIS /* the G4 tier's keys: needs hiredis (-lhiredis) */
#define KVREMOTE_IMPLEMENTATION
#include "kvremote.h"
#include "tests/redis_fixtures.h"
#include "bench/kvbench_remote.h"
#endif
#define WORKLOADS_IMPLEMENTATION
#include "examples/workloads.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#ifdef KVBENCH_HAVE_XXHASH
#include <xxhash.h>
#endif

/* ---- goals -------------------------------------------------------------------------------------- */

#define NO_GOAL NAN

#define GOAL_HASH_NS            20.0
#define GOAL_HASH_VS_XXH3       1.25
#define GOAL_BLOCK_CYCLE_NS     60.0 /* issue 15: at 1M blocks */
#define GOAL_SCALING_1K_TO_1M   2.0
#define GOAL_MATCH_NS           40.0
#define GOAL_MATCH_VS_DRAM      1.5
#define GOAL_GATHER_VS_MEMCPY   0.9
#define GOAL_PIPELINE_NS        1000.0
#define GOAL_LOAD_VS_HANDOFF    10.0 /* a load costs a few thread handoffs, never a flush interval (10 ms) */
#define GOAL_DISK_VS_SEQ_WRITE  0.8
/* cancel_latency_ms: the pipeline's sweep interval + 1 ms (read from its resolved config) */
#define GOAL_CANCEL_SLACK_MS    1.0
#define GOAL_FOL_VS_LRU         1.5
#define GOAL_SCHED_STEP_US      100.0
#define GOAL_REMOTE_VS_REDIS    0.8
#define GOAL_SCHED_SCALING      4.5
#define GOAL_EVENT_PUBLISH_NS   100.0
#define GOAL_EVENT_LOG_VS_FWRITE 2.0
#define GOAL_SCHED_BUS_IDLE     1.05
#define GOAL_ROUTE_NS           50.0
#define GOAL_REPLAY_VS_BARE     1.5

/* ---- sizes -------------------------------------------------------------------------------------- */

#define BLOCK_TOKENS        16
#define BIG_POOL_BLOCKS     (1u << 20)
#define SMALL_POOL_BLOCKS   1024u
#define CYCLE_BATCH         16
#define CYCLE_ITERATIONS    16384     /* per repetition: 262,144 blocks cycled */
#define FILL_BATCH          4096
#define MATCH_CHAIN_BLOCKS  256
#define HASH_INPUTS         4096      /* 352 KiB of inputs: stays in L2, so the hash itself is timed */
#define HASH_PASSES         64
#define DRAM_READS          (1u << 21)
#define MIN_BIG_BUFFER      ((size_t)64 << 20)

/* kvroute.h */
#define ROUTE_WORKERS       8u
#define ROUTE_CHAINS        16384u
#define ROUTE_CHAIN_BLOCKS  64u       /* x 16,384 chains: 1,048,576 hashes */
#define ROUTE_REQUESTS      4096u
#define ROUTE_NEW_BLOCKS    8u        /* each request ends in blocks nobody holds (its new turn) */

/* kvoffload.h */
#define GATHER_BLOCKS       256u      /* copied per job: 32 MiB */
#define GATHER_POOL_BLOCKS  512u
#define GATHER_LAYERS       16u       /* x 2 kv heads x head dim 64 x fp16 x 16 tokens: 4 KiB pages, */
#define GATHER_KV_HEADS     2u        /* 128 KiB blocks */
#define GATHER_HEAD_DIM     64u
#define GATHER_BLOCK_BYTES  ((uint64_t)128 << 10)
#define PIPE_CONTAINERS     64u
#define PIPE_BLOCKS_PER     64u       /* = the default max batch: one batch per container */
#define PIPE_BLOCKS         (PIPE_CONTAINERS * PIPE_BLOCKS_PER)
#define LOAD_BLOCKS         2u        /* a small load: below the default min batch (8) */
#define DISK_BLOCKS         64u       /* 128 MiB */
#define DISK_LAYERS         32u       /* x 8 kv heads x head dim 128 x fp16 x 16 tokens: 2 MiB blocks */
#define DISK_KV_HEADS       8u
#define DISK_HEAD_DIM       128u
#define DISK_BLOCK_BYTES    ((uint64_t)2 << 20)
#define CANCEL_ROUNDS       10
#define CANCEL_PER_ROUND    5         /* 1-block containers: 5 blocks wait, below the min batch of 8 */
#define CANCEL_DST_BLOCKS   128       /* room for two default batches of 64 */
#define CANCEL_FLUSH_US     (10u * 1000000u) /* so nothing leaves the batcher before it is cancelled */
#define WAIT_LIMIT_US       INT64_C(10000000) /* 10 s: a transfer that takes longer is a bug */

#define REPS_HASH   15
#define REPS_CYCLE  5
#define REPS_MATCH  21
#define REPS_DRAM   7
#define REPS_COPY   9
#define REPS_PIPE   15
#define REPS_LOAD   63 /* summarize_interleaved keeps at most 64 */
#define REPS_DISK   7
#define REPS_EVICT  5
#define REPS_SCHED  31
#define REPS_OBSERVE 9
#define REPS_ROUTE  9
#define REPS_REPLAY 7
#define REPLAY_REQUESTS 12000u
#define REPLAY_POOL_BLOCKS 10000u
#define REPLAY_BLOCK_TOKENS 512u
#define EVICT_ITERATIONS 8192  /* x 16 evictions per repetition */
#define SCHED_PROMPT_BLOCKS 2  /* each request: 2 full blocks + 0..15 tokens, so 1 in 16 crosses a block per step */

/* ---- small utilities ---------------------------------------------------------------------------- */

static volatile uint64_t sink; /* results land here so the compiler cannot drop the work */

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("kvbench: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void expect_ok(kvb_result r, const char *what)
{
    if (r != KVB_OK) die("%s failed: %s", what, kvb_result_string(r));
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes);
    if (!p) die("out of memory (%zu bytes)", bytes);
    return p;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static void fill_random_hashes(kvb_hash *out, size_t n, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) {
        out[i].lo = splitmix64(rng);
        out[i].hi = splitmix64(rng);
    }
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef enum summary { MEDIAN, MINIMUM } summary;

/* One untimed warm-up call, then `reps` calls; each call times its own work and returns its value. */
static double summarize_runs(summary how, int reps, double (*run_once)(void *ctx), void *ctx)
{
    double values[64];
    if (reps < 1 || reps > 64) die("bad repetition count %d", reps);
    (void)run_once(ctx);
    for (int i = 0; i < reps; i++) values[i] = run_once(ctx);
    qsort(values, (size_t)reps, sizeof values[0], compare_doubles);
    return how == MINIMUM ? values[0] : values[reps / 2];
}

/* Two measurements meant to be divided by each other: after one untimed warm-up of each, `reps` rounds
 * of both, alternating which goes first, so drift in the machine (disk caches, other tenants) reaches
 * both alike. The summary of each goes to *out_a and *out_b. */
static void summarize_interleaved(summary how, int reps, double (*run_a)(void *ctx), double (*run_b)(void *ctx),
                                  void *ctx, double *out_a, double *out_b)
{
    double a[64], b[64];
    if (reps < 1 || reps > 64) die("bad repetition count %d", reps);
    (void)run_a(ctx);
    (void)run_b(ctx);
    for (int i = 0; i < reps; i++) {
        if (i & 1) {
            b[i] = run_b(ctx);
            a[i] = run_a(ctx);
        } else {
            a[i] = run_a(ctx);
            b[i] = run_b(ctx);
        }
    }
    qsort(a, (size_t)reps, sizeof a[0], compare_doubles);
    qsort(b, (size_t)reps, sizeof b[0], compare_doubles);
    *out_a = how == MINIMUM ? a[0] : a[reps / 2];
    *out_b = how == MINIMUM ? b[0] : b[reps / 2];
}

static void progress(const char *what)
{
    if (isatty(STDERR_FILENO)) fprintf(stderr, "kvbench: %s...\n", what);
}

/* ---- the machine -------------------------------------------------------------------------------- */

typedef struct machine_info {
    long cores;
    long l3_bytes; /* 0 when unknown */
    char cpu[256];
} machine_info;

static void read_cpu_model(char *out, size_t size)
{
    char line[512];
    snprintf(out, size, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) != 0) continue;
        const char *value = strchr(line, ':');
        if (!value) continue;
        value += 1 + strspn(value + 1, " \t");
        snprintf(out, size, "%s", value);
        out[strcspn(out, "\n")] = '\0';
        break;
    }
    fclose(f);
}

static machine_info describe_machine(void)
{
    machine_info m;
    m.cores = sysconf(_SC_NPROCESSORS_ONLN);
#ifdef _SC_LEVEL3_CACHE_SIZE
    m.l3_bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (m.l3_bytes < 0) m.l3_bytes = 0;
#else
    m.l3_bytes = 0;
#endif
    read_cpu_model(m.cpu, sizeof m.cpu);
    return m;
}

/* Memory that does not fit in the last-level cache: at least 64 MiB and twice the L3, so random reads
 * from it go to DRAM and streaming over it evicts everything else. */
static size_t big_buffer_bytes(const machine_info *m)
{
    size_t twice_l3 = 2 * (size_t)m->l3_bytes;
    return twice_l3 > MIN_BIG_BUFFER ? twice_l3 : MIN_BIG_BUFFER;
}

static unsigned char *alloc_touched(size_t bytes)
{
    unsigned char *p = xmalloc(bytes);
    memset(p, 1, bytes);
    return p;
}

/* Read and write one byte of every cache line of `buffer`: afterwards nothing else is cached. */
static void evict_caches(unsigned char *buffer, size_t bytes)
{
    volatile unsigned char *p = buffer;
    for (size_t i = 0; i < bytes; i += 64) p[i] = (unsigned char)(p[i] + 1);
}

/* Read one byte of every cache line of `buffer`: afterwards the caches hold only clean lines of it, so
 * a timed copy pays no write-back of data left dirty by earlier work (which would favour a copy with
 * streaming stores over one that allocates its destination in the cache). */
static void empty_caches_clean(const unsigned char *buffer, size_t bytes)
{
    const volatile unsigned char *p = buffer;
    unsigned sum = 0;
    for (size_t i = 0; i < bytes; i += 64) sum += p[i];
    sink = sum;
}

/* ---- results ------------------------------------------------------------------------------------ */

typedef enum goal_kind { GOAL_AT_MOST, GOAL_AT_LEAST } goal_kind;

typedef struct result {
    char name[64];      /* copied: callers build some names in a buffer they reuse */
    const char *unit;
    double value;
    double goal;    /* NO_GOAL for reference values */
    goal_kind kind;
} result;

#define MAX_RESULTS 64
typedef struct results {
    result items[MAX_RESULTS];
    size_t n;
} results;

static void results_add(results *rs, const char *name, double value, const char *unit, double goal,
                        goal_kind kind)
{
    if (rs->n == MAX_RESULTS) die("too many results");
    rs->items[rs->n] = (result){ .unit = unit, .value = value, .goal = goal, .kind = kind };
    snprintf(rs->items[rs->n++].name, sizeof rs->items[0].name, "%s", name);
}

static int result_has_goal(const result *r) { return !isnan(r->goal); }

static int result_meets_goal(const result *r)
{
    return r->kind == GOAL_AT_MOST ? r->value <= r->goal : r->value >= r->goal;
}

static void print_table(const results *rs, const machine_info *m)
{
    int width = 22;
    for (size_t i = 0; i < rs->n; i++)
        if ((int)strlen(rs->items[i].name) > width) width = (int)strlen(rs->items[i].name);
    printf("kvbench — %ld cores, %s\n\n", m->cores, m->cpu);
    printf("%-*s %12s  %-9s %10s  %s\n", width, "key", "value", "unit", "goal", "result");
    for (size_t i = 0; i < rs->n; i++) {
        const result *r = &rs->items[i];
        char goal[32] = "-";
        if (result_has_goal(r))
            snprintf(goal, sizeof goal, "%s %g", r->kind == GOAL_AT_MOST ? "<=" : ">=", r->goal);
        char value[32]; /* small values (e.g. a latency of microseconds in ms) keep 4 significant digits */
        if (r->value != 0 && fabs(r->value) < 0.1) snprintf(value, sizeof value, "%.4g", r->value);
        else snprintf(value, sizeof value, "%.3f", r->value);
        printf("%-*s %12s  %-9s %10s  %s\n", width, r->name, value, r->unit, goal,
               !result_has_goal(r) ? "" : result_meets_goal(r) ? "pass" : "MISS");
    }
}

static void print_json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

static void print_json_number(double v)
{
    if (isfinite(v)) printf("%.6g", v);
    else printf("null");
}

static void print_json(const results *rs, const machine_info *m)
{
    printf("{\n  \"machine\": {\"cores\": %ld, \"cpu\": ", m->cores);
    print_json_string(m->cpu);
    printf(", \"l3_bytes\": %ld},\n", m->l3_bytes);
    for (size_t i = 0; i < rs->n; i++) {
        printf("  \"%s\": ", rs->items[i].name);
        print_json_number(rs->items[i].value);
        printf(",\n");
    }
    printf("  \"goals\": {");
    const char *sep = "";
    for (size_t i = 0; i < rs->n; i++) {
        if (!result_has_goal(&rs->items[i])) continue;
        printf("%s\"%s\": ", sep, rs->items[i].name);
        print_json_number(rs->items[i].goal);
        sep = ", ";
    }
    printf("}\n}\n");
}

/* ---- hashing ------------------------------------------------------------------------------------ */

/* The bytes kvb_hash_block consumes for one full block without extra keys: parent, 16 tokens, salt.
 * XXH3 hashes exactly this record; ours reads the tokens and salt from it. */
typedef struct hash_input {
    kvb_hash parent;
    uint32_t tokens[BLOCK_TOKENS];
    uint64_t salt;
} hash_input;
_Static_assert(sizeof(hash_input) == 88, "hash_input must be the 88 bytes XXH3 is given");

typedef struct hash_bench {
    hash_input *inputs;
    size_t n;
} hash_bench;

/* Both hashes are called out of line (ours through this pointer, XXH3 from the shared library), as an
 * engine calls them from another translation unit; each output is the next input's parent, so the
 * calls form one dependency chain. Ours digests a block's tokens before its parent is known (kvblock.h
 * section 3), so the chain waits only for its final step: the overlap kvb_hash_prompt gets too. */
typedef kvb_hash (*block_hash_fn)(const kvb_hash *, const uint32_t *, size_t, const uint64_t *, size_t,
                                  uint64_t);
static block_hash_fn volatile kvb_hash_block_out_of_line = kvb_hash_block;

static double hash_chain_ours_once(void *ctx)
{
    const hash_bench *b = ctx;
    block_hash_fn hash = kvb_hash_block_out_of_line;
    kvb_hash h = { 0, 0 };
    uint64_t t0 = now_ns();
    for (int pass = 0; pass < HASH_PASSES; pass++)
        for (size_t i = 0; i < b->n; i++) h = hash(&h, b->inputs[i].tokens, BLOCK_TOKENS, NULL, 0, b->inputs[i].salt);
    uint64_t t1 = now_ns();
    sink = h.lo ^ h.hi;
    return (double)(t1 - t0) / ((double)b->n * HASH_PASSES);
}

#ifdef KVBENCH_HAVE_XXHASH
static double hash_chain_xxh3_once(void *ctx)
{
    hash_bench *b = ctx;
    XXH128_hash_t h = { 0, 0 };
    uint64_t t0 = now_ns();
    for (int pass = 0; pass < HASH_PASSES; pass++) {
        for (size_t i = 0; i < b->n; i++) {
            b->inputs[i].parent.lo = h.low64;
            b->inputs[i].parent.hi = h.high64;
            h = XXH3_128bits(&b->inputs[i], sizeof b->inputs[i]);
        }
    }
    uint64_t t1 = now_ns();
    sink = h.low64 ^ h.high64;
    return (double)(t1 - t0) / ((double)b->n * HASH_PASSES);
}
#endif

static void bench_hash(results *rs, uint64_t *rng)
{
    hash_bench b = { .inputs = xmalloc(HASH_INPUTS * sizeof(hash_input)), .n = HASH_INPUTS };
    uint64_t salt = splitmix64(rng);
    for (size_t i = 0; i < b.n; i++) {
        b.inputs[i].parent = (kvb_hash){ 0, 0 };
        for (int t = 0; t < BLOCK_TOKENS; t++) b.inputs[i].tokens[t] = (uint32_t)splitmix64(rng);
        b.inputs[i].salt = salt;
    }
    double ours = summarize_runs(MINIMUM, REPS_HASH, hash_chain_ours_once, &b);
    results_add(rs, "hash_ns_per_block", ours, "ns", GOAL_HASH_NS, GOAL_AT_MOST);
#ifdef KVBENCH_HAVE_XXHASH
    double xxh3 = summarize_runs(MINIMUM, REPS_HASH, hash_chain_xxh3_once, &b);
    results_add(rs, "xxh3_128_ns_per_block", xxh3, "ns", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "hash_vs_xxh3_128", ours / xxh3, "ratio", GOAL_HASH_VS_XXH3, GOAL_AT_MOST);
#endif
    free(b.inputs);
}

/* ---- block cycle -------------------------------------------------------------------------------- */

static kvb_pool *create_metadata_pool(uint32_t num_blocks)
{
    kvb_pool_config cfg = { .num_blocks = num_blocks, .block_tokens = BLOCK_TOKENS,
                            .storage = KVB_STORAGE_NONE };
    kvb_pool *pool;
    expect_ok(kvb_pool_create(&cfg, &pool), "kvb_pool_create");
    return pool;
}

/* Every block becomes Registered (random root hashes) and inactive, so every later allocation evicts. */
static void fill_with_inactive_blocks(kvb_pool *pool, uint32_t num_blocks, uint64_t *rng)
{
    kvb_block *blocks = xmalloc(FILL_BATCH * sizeof *blocks);
    kvb_block *registered = xmalloc(FILL_BATCH * sizeof *registered);
    kvb_hash *hashes = xmalloc(FILL_BATCH * sizeof *hashes);
    for (uint32_t done = 0; done < num_blocks;) {
        size_t n = num_blocks - done < FILL_BATCH ? num_blocks - done : FILL_BATCH;
        fill_random_hashes(hashes, n, rng);
        expect_ok(kvb_alloc(pool, n, blocks), "fill: kvb_alloc");
        expect_ok(kvb_register_hashed(pool, blocks, n, hashes, NULL, registered), "fill: kvb_register_hashed");
        expect_ok(kvb_release(pool, registered, n, NULL), "fill: kvb_release");
        done += (uint32_t)n;
    }
    kvb_pool_stats st;
    expect_ok(kvb_pool_get_stats(pool, &st), "kvb_pool_get_stats");
    if (st.free_blocks != 0 || st.inactive_blocks != num_blocks)
        die("fill: expected %u inactive blocks and none free, got %u inactive, %u free", num_blocks,
            st.inactive_blocks, st.free_blocks);
    free(blocks);
    free(registered);
    free(hashes);
}

typedef struct block_cycle_bench {
    kvb_pool *pool;
    kvb_hash *hashes; /* CYCLE_ITERATIONS * CYCLE_BATCH, new ones for every repetition */
    uint64_t *rng;
} block_cycle_bench;

static double block_cycle_once(void *ctx)
{
    block_cycle_bench *b = ctx;
    kvb_block blocks[CYCLE_BATCH], registered[CYCLE_BATCH];
    fill_random_hashes(b->hashes, (size_t)CYCLE_ITERATIONS * CYCLE_BATCH, b->rng);
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < CYCLE_ITERATIONS; i++) {
        expect_ok(kvb_alloc(b->pool, CYCLE_BATCH, blocks), "cycle: kvb_alloc");
        expect_ok(kvb_register_hashed(b->pool, blocks, CYCLE_BATCH, b->hashes + i * CYCLE_BATCH, NULL,
                                      registered), "cycle: kvb_register_hashed");
        expect_ok(kvb_release(b->pool, registered, CYCLE_BATCH, NULL), "cycle: kvb_release");
    }
    uint64_t t1 = now_ns();
    return (double)(t1 - t0) / ((double)CYCLE_ITERATIONS * CYCLE_BATCH);
}

/* ns per block of alloc + register_hashed + release in a full pool (pool must already be full). */
static double measure_block_cycle(kvb_pool *pool, uint64_t *rng)
{
    block_cycle_bench b = { .pool = pool, .rng = rng,
                            .hashes = xmalloc((size_t)CYCLE_ITERATIONS * CYCLE_BATCH * sizeof(kvb_hash)) };
    double ns = summarize_runs(MEDIAN, REPS_CYCLE, block_cycle_once, &b);
    free(b.hashes);
    return ns;
}

static void check_pool(kvb_pool *pool, const char *when)
{
    char why[256] = "";
    if (kvb_pool_check(pool, why, sizeof why) != KVB_OK) die("pool check %s: %s", when, why);
}

static double measure_block_cycle_1k(uint64_t *rng)
{
    kvb_pool *pool = create_metadata_pool(SMALL_POOL_BLOCKS);
    fill_with_inactive_blocks(pool, SMALL_POOL_BLOCKS, rng);
    double ns = measure_block_cycle(pool, rng);
    check_pool(pool, "after the 1k block cycle");
    kvb_pool_destroy(pool);
    return ns;
}

/* ---- prefix match ------------------------------------------------------------------------------- */

typedef struct match_bench {
    kvb_pool *pool;
    kvb_hash chain[MATCH_CHAIN_BLOCKS];
    kvb_block matched[MATCH_CHAIN_BLOCKS];
    unsigned char *evict_buffer;
    size_t evict_bytes;
} match_bench;

/* A 256-block prompt chain, registered with its parents and released: cached, inactive, matchable. */
static void register_prompt_chain(match_bench *b, uint64_t *rng)
{
    enum { N = MATCH_CHAIN_BLOCKS };
    static uint32_t tokens[N * BLOCK_TOKENS];
    kvb_hash parents[N];
    kvb_block blocks[N], registered[N];
    size_t n = 0;
    for (size_t i = 0; i < N * BLOCK_TOKENS; i++) tokens[i] = (uint32_t)splitmix64(rng);
    expect_ok(kvb_hash_prompt(tokens, N * BLOCK_TOKENS, BLOCK_TOKENS, NULL, 0, 0, b->chain, N, &n),
              "kvb_hash_prompt");
    if (n != N) die("kvb_hash_prompt gave %zu hashes, expected %d", n, N);
    parents[0] = (kvb_hash){ 0, 0 };
    for (size_t i = 1; i < N; i++) parents[i] = b->chain[i - 1];
    expect_ok(kvb_alloc(b->pool, N, blocks), "chain: kvb_alloc");
    expect_ok(kvb_register_hashed(b->pool, blocks, N, b->chain, parents, registered), "chain: kvb_register_hashed");
    expect_ok(kvb_release(b->pool, registered, N, NULL), "chain: kvb_release");
}

/* Before each timed match the big buffer is streamed over (read + write of every cache line, at
 * least twice the L3), so the pool's index and block metadata come from DRAM; then the 4 KiB of hashes
 * are read back, since a caller has just computed them. Timed: kvb_match + kvb_release, per block.
 * The stream also empties the TLB and evicts the pool's page-table entries, so page walks come from
 * DRAM too (in the DRAM floor loop they stay cached): a cold lookup, the worst case an engine sees. */
static double match_once(void *ctx)
{
    match_bench *b = ctx;
    size_t n = 0;
    uint64_t warm = 0;
    evict_caches(b->evict_buffer, b->evict_bytes);
    for (size_t i = 0; i < MATCH_CHAIN_BLOCKS; i++) warm += b->chain[i].lo;
    sink = warm;
    uint64_t t0 = now_ns();
    expect_ok(kvb_match(b->pool, b->chain, MATCH_CHAIN_BLOCKS, b->matched, &n), "kvb_match");
    expect_ok(kvb_release(b->pool, b->matched, n, NULL), "match: kvb_release");
    uint64_t t1 = now_ns();
    if (n != MATCH_CHAIN_BLOCKS) die("kvb_match matched %zu of %d blocks", n, MATCH_CHAIN_BLOCKS);
    return (double)(t1 - t0) / MATCH_CHAIN_BLOCKS;
}

static double measure_match(kvb_pool *pool, unsigned char *evict_buffer, size_t evict_bytes, uint64_t *rng)
{
    match_bench *b = xmalloc(sizeof *b);
    *b = (match_bench){ .pool = pool, .evict_buffer = evict_buffer, .evict_bytes = evict_bytes };
    register_prompt_chain(b, rng);
    double ns = summarize_runs(MEDIAN, REPS_MATCH, match_once, b);
    free(b);
    return ns;
}

/* ---- DRAM floor --------------------------------------------------------------------------------- */

typedef struct dram_bench {
    const uint64_t *words;
    uint32_t *lines;   /* DRAM_READS random cache-line indices, plus `distance` more for the prefetches */
    size_t distance;
} dram_bench;

static double dram_reads_once(void *ctx)
{
    const dram_bench *b = ctx;
    const uint64_t *words = b->words;
    const uint32_t *lines = b->lines;
    size_t distance = b->distance;
    uint64_t sum = 0;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < DRAM_READS; i++) {
        __builtin_prefetch(&words[(size_t)lines[i + distance] * 8]);
        sum += words[(size_t)lines[i] * 8];
    }
    uint64_t t1 = now_ns();
    sink = sum;
    return (double)(t1 - t0) / DRAM_READS;
}

/* The best memory-level parallelism one core gets for independent reads: the lowest median over a few
 * prefetch distances. The array is the big buffer (at least 64 MiB and twice the L3). */
static double measure_dram_floor(const unsigned char *buffer, size_t bytes, uint64_t *rng)
{
    static const size_t distances[] = { 8, 16, 32, 64 };
    size_t max_distance = distances[sizeof distances / sizeof distances[0] - 1];
    size_t num_lines = bytes / 64;
    if (num_lines > UINT32_MAX) num_lines = UINT32_MAX;
    dram_bench b = { .words = (const uint64_t *)(const void *)buffer,
                     .lines = xmalloc((DRAM_READS + max_distance) * sizeof(uint32_t)) };
    for (size_t i = 0; i < DRAM_READS + max_distance; i++) b.lines[i] = (uint32_t)(splitmix64(rng) % num_lines);
    double best = INFINITY;
    for (size_t d = 0; d < sizeof distances / sizeof distances[0]; d++) {
        b.distance = distances[d];
        double ns = summarize_runs(MEDIAN, REPS_DRAM, dram_reads_once, &b);
        if (ns < best) best = ns;
    }
    free(b.lines);
    return best;
}

/* ---- cold reads: what the match's emptied caches cost by themselves ------------------------------ */

#define COLD_READS       MATCH_CHAIN_BLOCKS /* one line per block: the least any lookup of the chain reads */
#define COLD_READ_BYTES  ((size_t)BIG_POOL_BLOCKS * 64) /* the big pool's metadata: 64 bytes a block */
#define COLD_READ_AHEAD  16

typedef struct cold_bench {
    uint64_t *words;   /* COLD_READ_BYTES, 2 MiB aligned and advised huge pages, as the pool's tables are */
    uint32_t lines[COLD_READS + COLD_READ_AHEAD];
    unsigned char *evict_buffer;
    size_t evict_bytes;
    uint64_t *rng;
} cold_bench;

/* match_once's conditions for the simplest code: new random lines, the caches (and with them the TLB and
 * the page-table entries) emptied by the same stream, the line list read back, then COLD_READS
 * independent reads with a prefetch COLD_READ_AHEAD reads ahead. Per read. */
static double cold_reads_once(void *ctx)
{
    cold_bench *b = ctx;
    uint64_t sum = 0;
    size_t num_lines = COLD_READ_BYTES / 64;
    for (size_t i = 0; i < COLD_READS + COLD_READ_AHEAD; i++) b->lines[i] = (uint32_t)(splitmix64(b->rng) % num_lines);
    evict_caches(b->evict_buffer, b->evict_bytes);
    for (size_t i = 0; i < COLD_READS + COLD_READ_AHEAD; i++) sum += b->lines[i];
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < COLD_READS; i++) {
        __builtin_prefetch(&b->words[(size_t)b->lines[i + COLD_READ_AHEAD] * 8]);
        sum += b->words[(size_t)b->lines[i] * 8];
    }
    uint64_t t1 = now_ns();
    sink = sum;
    return (double)(t1 - t0) / COLD_READS;
}

static double measure_cold_reads(unsigned char *evict_buffer, size_t evict_bytes, uint64_t *rng)
{
    cold_bench *b = xmalloc(sizeof *b);
    void *words = NULL;
    if (posix_memalign(&words, (size_t)2 << 20, COLD_READ_BYTES) != 0) die("out of memory");
#ifdef MADV_HUGEPAGE
    (void)madvise(words, COLD_READ_BYTES, MADV_HUGEPAGE); /* advice, as kvblock.h gives its tables */
#endif
    memset(words, 1, COLD_READ_BYTES);
    *b = (cold_bench){ .words = words, .evict_buffer = evict_buffer, .evict_bytes = evict_bytes, .rng = rng };
    double ns = summarize_runs(MEDIAN, REPS_MATCH, cold_reads_once, b);
    free(words);
    free(b);
    return ns;
}

/* ---- kvoffload.h -------------------------------------------------------------------------------- */

static void expect_kvo(int r, const char *what)
{
    if (r != KVO_OK) die("%s failed: %s", what, kvo_result_string(r));
}

static int compare_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* n distinct indices in [0, range), in random order (partial Fisher-Yates over `scratch`, range long). */
static void random_distinct(uint32_t *out, size_t n, uint32_t *scratch, uint32_t range, uint64_t *rng)
{
    for (uint32_t i = 0; i < range; i++) scratch[i] = i;
    for (size_t i = 0; i < n; i++) {
        size_t j = i + (size_t)(splitmix64(rng) % (range - i));
        uint32_t t = scratch[i];
        scratch[i] = scratch[j];
        scratch[j] = t;
        out[i] = scratch[i];
    }
}

static kvb_layout model_layout(kvb_layout_kind kind, uint32_t layers, uint32_t kv_heads, uint32_t head_dim)
{
    kvb_layout layout;
    expect_ok(kvb_layout_for_model(kind, BLOCK_TOKENS, layers, kv_heads, head_dim, 2, &layout),
              "kvb_layout_for_model");
    return layout;
}

/* A pool with host storage, every byte written once (page faults happen here, not in a timing). */
static kvb_pool *create_storage_pool(uint32_t num_blocks, kvb_layout layout, uint64_t block_bytes,
                                     unsigned char fill, unsigned char **out_base)
{
    kvb_pool_config cfg = { .num_blocks = num_blocks, .block_tokens = BLOCK_TOKENS,
                            .storage = KVB_STORAGE_HOST, .layout = layout };
    kvb_pool *pool;
    void *base;
    uint64_t bytes, bb;
    expect_ok(kvb_pool_create(&cfg, &pool), "kvb_pool_create (host storage)");
    expect_ok(kvb_pool_storage(pool, &base, &bytes, &bb, NULL), "kvb_pool_storage");
    if (bb != block_bytes) die("pool block bytes %llu, expected %llu", (unsigned long long)bb,
                               (unsigned long long)block_bytes);
    memset(base, fill, (size_t)bytes);
    *out_base = base;
    return pool;
}

/* n blocks allocated and registered under random root hashes; the strong references stay the caller's. */
static void register_random_blocks(kvb_pool *pool, size_t n, kvb_block *out, kvb_hash *out_hashes, uint64_t *rng)
{
    kvb_block *fresh = xmalloc(n * sizeof *fresh);
    fill_random_hashes(out_hashes, n, rng);
    expect_ok(kvb_alloc(pool, n, fresh), "kvb_alloc");
    expect_ok(kvb_register_hashed(pool, fresh, n, out_hashes, NULL, out), "kvb_register_hashed");
    free(fresh);
}

/* A backend job run to completion from this thread (the backends here have no workers, so done is
 * called inside submit; the wait covers backends that finish elsewhere). */
typedef struct sync_job {
    kvo_copy_job job;
    int finished;
    int result;
    char message[160];
} sync_job;

static void sync_job_done(kvo_copy_job *job, int result, const char *message)
{
    sync_job *s = job->user;
    s->result = result;
    snprintf(s->message, sizeof s->message, "%s", message ? message : "");
    __atomic_store_n(&s->finished, 1, __ATOMIC_RELEASE);
}

static void sync_job_run(kvo_backend *backend, sync_job *s, const char *what)
{
    s->job.done = sync_job_done;
    s->job.user = s;
    s->finished = 0;
    expect_kvo(backend->submit(backend, &s->job), what);
    while (!__atomic_load_n(&s->finished, __ATOMIC_ACQUIRE)) sched_yield();
}

static void sync_job_check(const sync_job *s, uint64_t block_bytes, const char *what)
{
    if (s->result != KVO_OK) die("%s: job failed: %s (%s)", what, kvo_result_string(s->result), s->message);
    for (size_t i = 0; i < s->job.n; i++)
        if (s->job.results[i] != KVO_OK) die("%s: copy %zu failed: %s", what, i, kvo_result_string(s->job.results[i]));
    if (s->job.bytes != s->job.n * block_bytes)
        die("%s: backend reports %llu bytes moved, expected %llu", what, (unsigned long long)s->job.bytes,
            (unsigned long long)(s->job.n * block_bytes));
}

/* -- gather_vs_memcpy -- */

typedef struct copy_bench {
    kvo_backend *backend;
    kvb_pool *src, *dst;
    unsigned char *src_base, *dst_base;
    kvb_layout src_layout, dst_layout;   /* resolved */
    uint32_t src_idx[GATHER_BLOCKS], dst_idx[GATHER_BLOCKS], scratch[GATHER_POOL_BLOCKS];
    int results[GATHER_BLOCKS];
    unsigned char *plain_src, *plain_dst; /* the reference memcpy */
    unsigned char *evict_buffer;
    size_t evict_bytes;
    uint64_t *rng;
} copy_bench;

/* bytes per nanosecond = GB/s */
static double gbps_of(uint64_t bytes, uint64_t ns) { return (double)bytes / (double)ns; }

/* New random distinct source and destination blocks, caches emptied, then one timed job. GB/s. */
static double backend_copy_once(void *ctx)
{
    copy_bench *b = ctx;
    sync_job s;
    memset(&s, 0, sizeof s);
    random_distinct(b->src_idx, GATHER_BLOCKS, b->scratch, GATHER_POOL_BLOCKS, b->rng);
    random_distinct(b->dst_idx, GATHER_BLOCKS, b->scratch, GATHER_POOL_BLOCKS, b->rng);
    s.job = (kvo_copy_job){ .src = b->src, .dst = b->dst, .src_idx = b->src_idx, .dst_idx = b->dst_idx,
                            .n = GATHER_BLOCKS, .results = b->results };
    empty_caches_clean(b->evict_buffer, b->evict_bytes);
    uint64_t t0 = now_ns();
    sync_job_run(b->backend, &s, "memcpy backend submit");
    uint64_t t1 = now_ns();
    sync_job_check(&s, GATHER_BLOCK_BYTES, "memcpy backend");
    return gbps_of((uint64_t)GATHER_BLOCKS * GATHER_BLOCK_BYTES, t1 - t0);
}

static double plain_memcpy_once(void *ctx)
{
    copy_bench *b = ctx;
    size_t bytes = (size_t)GATHER_BLOCKS * GATHER_BLOCK_BYTES;
    empty_caches_clean(b->evict_buffer, b->evict_bytes);
    uint64_t t0 = now_ns();
    memcpy(b->plain_dst, b->plain_src, bytes);
    uint64_t t1 = now_ns();
    sink = b->plain_dst[bytes / 2];
    return gbps_of(bytes, t1 - t0);
}

/* Every page of every block of the last job arrived where the destination layout puts it. */
static void verify_copy(const copy_bench *b, const char *what)
{
    for (size_t i = 0; i < GATHER_BLOCKS; i++)
        for (uint32_t l = 0; l < b->src_layout.num_layers; l++)
            for (uint32_t q = 0; q < b->src_layout.num_parts; q++) {
                const unsigned char *from =
                    b->src_base + kvb_layout_offset(&b->src_layout, GATHER_POOL_BLOCKS, b->src_idx[i], l, q);
                const unsigned char *to =
                    b->dst_base + kvb_layout_offset(&b->dst_layout, GATHER_POOL_BLOCKS, b->dst_idx[i], l, q);
                if (memcmp(from, to, (size_t)b->src_layout.page_bytes) != 0)
                    die("%s: block %u layer %u part %u not copied to block %u", what, b->src_idx[i], l, q,
                        b->dst_idx[i]);
            }
}

static void resolved_layout(kvb_pool *pool, kvb_layout *out)
{
    expect_ok(kvb_pool_storage(pool, NULL, NULL, NULL, out), "kvb_pool_storage");
}

static void bench_gather(results *rs, unsigned char *evict_buffer, size_t evict_bytes, uint64_t *rng)
{
    copy_bench *b = xmalloc(sizeof *b);
    kvb_layout contiguous = model_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS, GATHER_LAYERS, GATHER_KV_HEADS, GATHER_HEAD_DIM);
    kvb_layout separate = model_layout(KVB_LAYOUT_LAYER_SEPARATE, GATHER_LAYERS, GATHER_KV_HEADS, GATHER_HEAD_DIM);
    unsigned char *sep_base, *contig_base;
    size_t bytes = (size_t)GATHER_BLOCKS * GATHER_BLOCK_BYTES;
    memset(b, 0, sizeof *b);
    b->evict_buffer = evict_buffer;
    b->evict_bytes = evict_bytes;
    b->rng = rng;
    expect_kvo(kvo_memcpy_backend_create(0, &b->backend), "kvo_memcpy_backend_create");
    b->src = create_storage_pool(GATHER_POOL_BLOCKS, contiguous, GATHER_BLOCK_BYTES, 0, &b->src_base);
    for (size_t i = 0; i < (size_t)GATHER_POOL_BLOCKS * GATHER_BLOCK_BYTES / 8; i++)
        ((uint64_t *)(void *)b->src_base)[i] = splitmix64(rng);
    kvb_pool *dst_sep = create_storage_pool(GATHER_POOL_BLOCKS, separate, GATHER_BLOCK_BYTES, 1, &sep_base);
    kvb_pool *dst_contig = create_storage_pool(GATHER_POOL_BLOCKS, contiguous, GATHER_BLOCK_BYTES, 1, &contig_base);
    b->plain_src = alloc_touched(bytes);
    b->plain_dst = alloc_touched(bytes);
    resolved_layout(b->src, &b->src_layout);

    /* each backend case interleaved with the reference memcpy: memory bandwidth drifts with other tenants */
    double gather, plain, contig, plain2;
    b->dst = dst_sep;
    b->dst_base = sep_base;
    resolved_layout(b->dst, &b->dst_layout);
    summarize_interleaved(MEDIAN, REPS_COPY, backend_copy_once, plain_memcpy_once, b, &gather, &plain);
    verify_copy(b, "contiguous -> layer-separate");

    b->dst = dst_contig;
    b->dst_base = contig_base;
    resolved_layout(b->dst, &b->dst_layout);
    summarize_interleaved(MEDIAN, REPS_COPY, backend_copy_once, plain_memcpy_once, b, &contig, &plain2);
    verify_copy(b, "contiguous -> contiguous");

    results_add(rs, "gather_vs_memcpy", gather / plain, "ratio", GOAL_GATHER_VS_MEMCPY, GOAL_AT_LEAST);
    results_add(rs, "contiguous_vs_memcpy", contig / plain2, "ratio", NO_GOAL, GOAL_AT_LEAST);
    results_add(rs, "memcpy_gbps", plain, "GB/s", NO_GOAL, GOAL_AT_LEAST);

    kvo_backend_destroy(b->backend);
    kvb_pool_destroy(b->src);
    kvb_pool_destroy(dst_sep);
    kvb_pool_destroy(dst_contig);
    free(b->plain_src);
    free(b->plain_dst);
    free(b);
}

/* -- pipeline_overhead_ns_per_block -- */

/* A backend that copies nothing: every copy succeeds at once, inside submit. */
static int noop_submit(kvo_backend *self, kvo_copy_job *job)
{
    (void)self;
    for (size_t i = 0; i < job->n; i++) job->results[i] = KVO_OK;
    job->bytes = 0;
    job->done(job, KVO_OK, NULL);
    return KVO_OK;
}

static void noop_destroy(kvo_backend *self) { (void)self; }

static kvo_backend noop_backend = { .submit = noop_submit, .destroy = noop_destroy, .name = "noop" };

typedef struct pipeline_bench {
    kvo_pipeline *pl;
    kvb_pool *dst;
    kvb_weak *weak;             /* PIPE_BLOCKS registered source blocks */
    kvo_transfer handles[PIPE_CONTAINERS];
} pipeline_bench;

static void check_transfer(kvo_pipeline *pl, kvo_transfer t, kvo_status want, uint32_t transferred, const char *what)
{
    kvo_transfer_info info;
    expect_kvo(kvo_transfer_get_info(pl, t, &info), "kvo_transfer_get_info");
    if (info.status != want || info.transferred != transferred)
        die("%s: transfer status %d (want %d), %u of %u blocks transferred (want %u), skipped %u, dropped %u, "
            "failed %u, error %s", what, (int)info.status, (int)want, info.transferred, info.blocks, transferred,
            info.skipped, info.dropped, info.failed, kvo_result_string(info.error));
}

/* Timed: the first enqueue until the drain returns. Then every transfer is checked and released, and
 * the destination (now holding all blocks, inactive) is reset for the next repetition. */
static double pipeline_once(void *ctx)
{
    pipeline_bench *b = ctx;
    uint64_t t0 = now_ns();
    for (size_t c = 0; c < PIPE_CONTAINERS; c++)
        expect_kvo(kvo_enqueue(b->pl, b->weak + c * PIPE_BLOCKS_PER, PIPE_BLOCKS_PER, NULL, &b->handles[c]),
                   "kvo_enqueue");
    expect_kvo(kvo_pipeline_drain(b->pl, WAIT_LIMIT_US), "kvo_pipeline_drain");
    uint64_t t1 = now_ns();
    for (size_t c = 0; c < PIPE_CONTAINERS; c++) {
        check_transfer(b->pl, b->handles[c], KVO_STATUS_COMPLETE, PIPE_BLOCKS_PER, "pipeline overhead");
        expect_kvo(kvo_transfer_release(b->pl, b->handles[c]), "kvo_transfer_release");
    }
    kvb_pool_stats st;
    expect_ok(kvb_pool_get_stats(b->dst, &st), "kvb_pool_get_stats");
    if (st.inactive_blocks != PIPE_BLOCKS || st.active_blocks != 0)
        die("pipeline overhead: destination holds %u inactive and %u active blocks, expected %u and 0",
            st.inactive_blocks, st.active_blocks, PIPE_BLOCKS);
    expect_ok(kvb_pool_reset(b->dst), "kvb_pool_reset");
    return (double)(t1 - t0) / PIPE_BLOCKS;
}

static double measure_pipeline(kvo_mode mode, uint64_t *rng)
{
    pipeline_bench b;
    kvb_pool *src = create_metadata_pool(PIPE_BLOCKS);
    kvb_block *strong = xmalloc(PIPE_BLOCKS * sizeof *strong);
    kvb_hash *hashes = xmalloc(PIPE_BLOCKS * sizeof *hashes);
    memset(&b, 0, sizeof b);
    b.dst = create_metadata_pool(PIPE_BLOCKS);
    b.weak = xmalloc(PIPE_BLOCKS * sizeof *b.weak);
    register_random_blocks(src, PIPE_BLOCKS, strong, hashes, rng);
    for (size_t i = 0; i < PIPE_BLOCKS; i++) b.weak[i] = kvb_weak_of(strong[i]);
    kvo_pipeline_config pc = { .src = src, .dst = b.dst, .backend = &noop_backend, .mode = mode };
    expect_kvo(kvo_pipeline_create(&pc, &b.pl), "kvo_pipeline_create");
    double ns = summarize_runs(MEDIAN, REPS_PIPE, pipeline_once, &b);
    kvo_pipeline_destroy(b.pl);
    expect_ok(kvb_release(src, strong, PIPE_BLOCKS, NULL), "kvb_release");
    check_pool(src, "after the pipeline benchmark (source)");
    check_pool(b.dst, "after the pipeline benchmark (destination)");
    kvb_pool_destroy(src);
    kvb_pool_destroy(b.dst);
    free(strong);
    free(hashes);
    free(b.weak);
    return ns;
}

/* -- load_latency_us -- */

/* A small load a request waits for: kvo_onboard of LOAD_BLOCKS blocks in KVO_MODE_THREADS (the copy
 * itself free), until kvo_transfer_wait returns. Its floor: two threads handing a turn to each other
 * through a condition variable and back (a threaded pipeline needs at least that: the caller wakes the
 * coordinator, which wakes the caller). */
typedef struct load_bench {
    kvo_pipeline *pl;
    kvb_pool *dst;
    kvb_hash hashes[LOAD_BLOCKS];
} load_bench;

typedef struct handoff {
    pthread_mutex_t m;
    pthread_cond_t c;
    int turn, stop; /* 1: the helper's turn, 0: the caller's */
} handoff;

typedef struct load_pair { load_bench *load; handoff *wake; } load_pair; /* the interleaved runs' context */

static double load_once(void *ctx)
{
    load_bench *b = ((load_pair *)ctx)->load;
    kvo_transfer t;
    kvo_status st = 0;
    kvb_block got[LOAD_BLOCKS];
    size_t n = 0;
    uint64_t t0 = now_ns();
    expect_kvo(kvo_onboard(b->pl, b->hashes, LOAD_BLOCKS, NULL, &t), "kvo_onboard");
    expect_kvo(kvo_transfer_wait(b->pl, t, WAIT_LIMIT_US, &st), "kvo_transfer_wait");
    uint64_t t1 = now_ns();
    check_transfer(b->pl, t, KVO_STATUS_COMPLETE, LOAD_BLOCKS, "load latency");
    expect_kvo(kvo_transfer_take_blocks(b->pl, t, got, LOAD_BLOCKS, &n), "kvo_transfer_take_blocks");
    expect_ok(kvb_release(b->dst, got, n, NULL), "kvb_release");
    expect_kvo(kvo_transfer_release(b->pl, t), "kvo_transfer_release");
    expect_ok(kvb_pool_reset(b->dst), "kvb_pool_reset"); /* loaded again next time, not found present */
    return (double)(t1 - t0) / 1000.0;
}


static void *handoff_helper(void *arg)
{
    handoff *h = arg;
    pthread_mutex_lock(&h->m);
    for (;;) {
        while (h->turn != 1 && !h->stop) pthread_cond_wait(&h->c, &h->m);
        if (h->stop) break;
        h->turn = 0;
        pthread_cond_broadcast(&h->c);
    }
    pthread_mutex_unlock(&h->m);
    return NULL;
}

static double handoff_once(void *ctx)
{
    handoff *h = ((load_pair *)ctx)->wake;
    uint64_t t0 = now_ns();
    pthread_mutex_lock(&h->m);
    h->turn = 1;
    pthread_cond_broadcast(&h->c);
    while (h->turn != 0) pthread_cond_wait(&h->c, &h->m);
    pthread_mutex_unlock(&h->m);
    return (double)(now_ns() - t0) / 1000.0;
}

static void bench_load_latency(results *rs, uint64_t *rng)
{
    load_bench b;
    kvb_block strong[LOAD_BLOCKS];
    kvb_pool *src = create_metadata_pool(64);
    memset(&b, 0, sizeof b);
    b.dst = create_metadata_pool(64);
    register_random_blocks(src, LOAD_BLOCKS, strong, b.hashes, rng);
    expect_ok(kvb_release(src, strong, LOAD_BLOCKS, NULL), "kvb_release");
    kvo_pipeline_config pc = { .src = src, .dst = b.dst, .backend = &noop_backend, .mode = KVO_MODE_THREADS,
                               .presence = -1 };
    expect_kvo(kvo_pipeline_create(&pc, &b.pl), "kvo_pipeline_create");
    handoff h = { .turn = 0 };
    pthread_t helper;
    pthread_mutex_init(&h.m, NULL);
    pthread_cond_init(&h.c, NULL);
    if (pthread_create(&helper, NULL, handoff_helper, &h) != 0) die("load latency: pthread_create");
    double load, wake;
    load_pair pair = { &b, &h };
    summarize_interleaved(MEDIAN, REPS_LOAD, handoff_once, load_once, &pair, &wake, &load);
    pthread_mutex_lock(&h.m);
    h.stop = 1;
    pthread_cond_broadcast(&h.c);
    pthread_mutex_unlock(&h.m);
    pthread_join(helper, NULL);
    kvo_pipeline_destroy(b.pl);
    check_pool(src, "after the load latency benchmark (source)");
    check_pool(b.dst, "after the load latency benchmark (destination)");
    kvb_pool_destroy(src);
    kvb_pool_destroy(b.dst);
    results_add(rs, "load_latency_us", load, "us", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "thread_handoff_us", wake, "us", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "load_vs_handoff", load / wake, "ratio", GOAL_LOAD_VS_HANDOFF, GOAL_AT_MOST);
}

static void bench_pipeline(results *rs, uint64_t *rng)
{
    double poll = measure_pipeline(KVO_MODE_POLL, rng);
    double threads = measure_pipeline(KVO_MODE_THREADS, rng);
    results_add(rs, "pipeline_overhead_ns_per_block", poll, "ns/block", GOAL_PIPELINE_NS, GOAL_AT_MOST);
    results_add(rs, "pipeline_overhead_threads_ns_per_block", threads, "ns/block", NO_GOAL, GOAL_AT_MOST);
    bench_load_latency(rs, rng);
}

/* -- disk_vs_sequential_write -- */

/* The temp directory and its files, removed at exit too (a failed check dies half-way). */
static char disk_dir[64], disk_tier_path[96], disk_plain_path[96];

static void disk_cleanup(void)
{
    if (disk_tier_path[0]) unlink(disk_tier_path);
    if (disk_plain_path[0]) unlink(disk_plain_path);
    if (disk_dir[0]) rmdir(disk_dir);
    disk_tier_path[0] = disk_plain_path[0] = disk_dir[0] = '\0';
}

typedef struct disk_bench {
    kvo_backend *backend;
    kvb_pool *mem, *back, *disk;   /* source memory pool, read-back memory pool, the disk tier */
    unsigned char *mem_base, *back_base;
    uint32_t idx[DISK_BLOCKS];     /* block i <-> slot i: a sequential write, like the reference */
    kvb_hash hashes[DISK_BLOCKS];
    int results[DISK_BLOCKS];
    int tier_fd;                   /* a second descriptor of the tier file, for fsync and fadvise */
    int plain_fd;
} disk_bench;

static void fsync_or_die(int fd, const char *what)
{
    if (fsync(fd) != 0) die("fsync (%s): %s", what, strerror(errno));
}

/* Both writes are timed up to and including an fsync of their file: with O_DIRECT it costs little
 * (the data went to the device already), buffered it makes both measure the device, not the page cache. */
static double disk_write_once(void *ctx)
{
    disk_bench *b = ctx;
    sync_job s;
    memset(&s, 0, sizeof s);
    s.job = (kvo_copy_job){ .src = b->mem, .dst = b->disk, .src_idx = b->idx, .dst_idx = b->idx,
                            .hashes = b->hashes, .n = DISK_BLOCKS, .results = b->results };
    uint64_t t0 = now_ns();
    sync_job_run(b->backend, &s, "disk backend submit (write)");
    fsync_or_die(b->tier_fd, "tier file");
    uint64_t t1 = now_ns();
    sync_job_check(&s, DISK_BLOCK_BYTES, "disk backend write");
    return gbps_of((uint64_t)DISK_BLOCKS * DISK_BLOCK_BYTES, t1 - t0);
}

/* write() of the source pool's 128 MiB (4 KiB-aligned, so O_DIRECT takes it) in 2 MiB chunks. */
static double plain_write_once(void *ctx)
{
    disk_bench *b = ctx;
    size_t total = (size_t)DISK_BLOCKS * DISK_BLOCK_BYTES;
    if (lseek(b->plain_fd, 0, SEEK_SET) != 0) die("lseek: %s", strerror(errno));
    uint64_t t0 = now_ns();
    for (size_t done = 0; done < total;) {
        size_t chunk = (size_t)DISK_BLOCK_BYTES - done % DISK_BLOCK_BYTES;
        ssize_t w = write(b->plain_fd, b->mem_base + done, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("write %s: %s", disk_plain_path, w < 0 ? strerror(errno) : "wrote nothing");
        done += (size_t)w;
    }
    fsync_or_die(b->plain_fd, "plain file");
    uint64_t t1 = now_ns();
    return gbps_of(total, t1 - t0);
}

/* The onboarding path: read every slot back, verified by the backend (header + checksum); the page
 * cache is dropped first so a buffered tier reads from the device, as O_DIRECT does. Checked after:
 * every byte equals the source. */
static double disk_read_once(void *ctx)
{
    disk_bench *b = ctx;
    sync_job s;
    memset(&s, 0, sizeof s);
    memset(b->back_base, 0, (size_t)DISK_BLOCKS * DISK_BLOCK_BYTES);
    fsync_or_die(b->tier_fd, "tier file");
    (void)posix_fadvise(b->tier_fd, 0, 0, POSIX_FADV_DONTNEED);
    s.job = (kvo_copy_job){ .src = b->disk, .dst = b->back, .src_idx = b->idx, .dst_idx = b->idx,
                            .hashes = b->hashes, .n = DISK_BLOCKS, .results = b->results };
    uint64_t t0 = now_ns();
    sync_job_run(b->backend, &s, "disk backend submit (read)");
    uint64_t t1 = now_ns();
    sync_job_check(&s, DISK_BLOCK_BYTES, "disk backend read");
    if (memcmp(b->back_base, b->mem_base, (size_t)DISK_BLOCKS * DISK_BLOCK_BYTES) != 0)
        die("disk backend read: the bytes read back differ from the bytes written");
    return gbps_of((uint64_t)DISK_BLOCKS * DISK_BLOCK_BYTES, t1 - t0);
}

static void bench_disk(results *rs, uint64_t *rng)
{
    disk_bench b;
    kvo_disk_stats st;
    memset(&b, 0, sizeof b);
    snprintf(disk_dir, sizeof disk_dir, "/tmp/kvbench.XXXXXX");
    if (!mkdtemp(disk_dir)) {
        disk_dir[0] = '\0';
        die("mkdtemp under /tmp: %s", strerror(errno));
    }
    atexit(disk_cleanup);
    snprintf(disk_tier_path, sizeof disk_tier_path, "%s/tier.kv", disk_dir);
    snprintf(disk_plain_path, sizeof disk_plain_path, "%s/plain.bin", disk_dir);

    kvb_layout layout = model_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS, DISK_LAYERS, DISK_KV_HEADS, DISK_HEAD_DIM);
    b.mem = create_storage_pool(DISK_BLOCKS, layout, DISK_BLOCK_BYTES, 0, &b.mem_base);
    for (size_t i = 0; i < (size_t)DISK_BLOCKS * DISK_BLOCK_BYTES / 8; i++)
        ((uint64_t *)(void *)b.mem_base)[i] = splitmix64(rng);
    b.back = create_storage_pool(DISK_BLOCKS, layout, DISK_BLOCK_BYTES, 0, &b.back_base);
    b.disk = create_metadata_pool(DISK_BLOCKS);
    for (uint32_t i = 0; i < DISK_BLOCKS; i++) b.idx[i] = i;
    fill_random_hashes(b.hashes, DISK_BLOCKS, rng);

    kvo_disk_config dc = { .path = disk_tier_path, .disk_pool = b.disk, .block_bytes = DISK_BLOCK_BYTES,
                           .direct = 0, .threads = 0 };
    expect_kvo(kvo_disk_backend_create(&dc, &b.backend), "kvo_disk_backend_create");
    b.tier_fd = open(disk_tier_path, O_RDWR | O_CLOEXEC);
    if (b.tier_fd < 0) die("open %s: %s", disk_tier_path, strerror(errno));

    (void)disk_write_once(&b);
    /* The backend may fall back from O_DIRECT at its first write: ask only now. */
    expect_kvo(kvo_disk_backend_stats(b.backend, &st), "kvo_disk_backend_stats");
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC;
#ifdef O_DIRECT
    if (st.direct_io) flags |= O_DIRECT;
#endif
    b.plain_fd = open(disk_plain_path, flags, 0600);
    if (b.plain_fd < 0) die("open %s%s: %s", disk_plain_path, st.direct_io ? " (O_DIRECT)" : "", strerror(errno));
    /* preallocated like the tier file, so neither write pays for block allocation */
    int e = posix_fallocate(b.plain_fd, 0, (off_t)(DISK_BLOCKS * DISK_BLOCK_BYTES));
    if (e) die("posix_fallocate %s: %s", disk_plain_path, strerror(e));
    double backend_write, plain_write;
    summarize_interleaved(MEDIAN, REPS_DISK, disk_write_once, plain_write_once, &b, &backend_write, &plain_write);
    double backend_read = summarize_runs(MEDIAN, REPS_DISK, disk_read_once, &b);

    expect_kvo(kvo_disk_backend_stats(b.backend, &st), "kvo_disk_backend_stats");
    if (st.checksum_errors || st.io_errors)
        die("disk backend: %llu checksum errors, %llu I/O errors", (unsigned long long)st.checksum_errors,
            (unsigned long long)st.io_errors);
    if (isatty(STDERR_FILENO))
        fprintf(stderr, "kvbench: disk tier %s, %s I/O\n", disk_dir, st.direct_io ? "O_DIRECT" : "buffered");

    results_add(rs, "disk_vs_sequential_write", backend_write / plain_write, "ratio", GOAL_DISK_VS_SEQ_WRITE,
                GOAL_AT_LEAST);
    results_add(rs, "disk_write_gbps", backend_write, "GB/s", NO_GOAL, GOAL_AT_LEAST);
    results_add(rs, "disk_read_gbps", backend_read, "GB/s", NO_GOAL, GOAL_AT_LEAST);
    results_add(rs, "disk_plain_write_gbps", plain_write, "GB/s", NO_GOAL, GOAL_AT_LEAST);
    results_add(rs, "disk_direct_io", st.direct_io, "0/1", NO_GOAL, GOAL_AT_LEAST);

    close(b.plain_fd);
    close(b.tier_fd);
    kvo_backend_destroy(b.backend);
    kvb_pool_destroy(b.mem);
    kvb_pool_destroy(b.back);
    kvb_pool_destroy(b.disk);
    disk_cleanup();
}

/* -- cancel_latency_ms -- */

static void sleep_us(uint64_t us)
{
    struct timespec ts = { .tv_sec = (time_t)(us / 1000000u), .tv_nsec = (long)(us % 1000000u) * 1000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Wait until the coordinator has moved the container on to the batcher (status Queued; with no
 * precondition the same step hands it from the evaluator through the awaiter to the batcher). */
static void wait_queued(kvo_pipeline *pl, kvo_transfer t)
{
    uint64_t start = now_ns();
    for (;;) {
        kvo_transfer_info info;
        expect_kvo(kvo_transfer_get_info(pl, t, &info), "kvo_transfer_get_info");
        if (info.status == KVO_STATUS_QUEUED) return;
        if (info.status != KVO_STATUS_EVALUATING) die("cancel latency: transfer left the batcher (status %d)", (int)info.status);
        if (now_ns() - start > 1000000000u) die("cancel latency: transfer not queued after 1 s");
        sleep_us(50);
    }
}

static void bench_cancel(results *rs, uint64_t *rng)
{
    enum { N = CANCEL_ROUNDS * CANCEL_PER_ROUND };
    /* the destination is sized for the default batches (a pipeline caps max_batch at its blocks / on_deck,
     * and min_batch at max_batch): 5 blocks would make a batch of 2 */
    kvb_pool *src = create_metadata_pool(CANCEL_PER_ROUND), *dst = create_metadata_pool(CANCEL_DST_BLOCKS);
    kvb_block strong[CANCEL_PER_ROUND];
    kvb_hash hashes[CANCEL_PER_ROUND];
    kvb_weak weak[CANCEL_PER_ROUND];
    kvo_transfer t[CANCEL_PER_ROUND];
    uint64_t ns[N];
    kvo_pipeline *pl;
    kvo_pipeline_config pc = { .src = src, .dst = dst, .backend = &noop_backend, .mode = KVO_MODE_THREADS,
                               .flush_interval_us = CANCEL_FLUSH_US };
    register_random_blocks(src, CANCEL_PER_ROUND, strong, hashes, rng);
    for (size_t i = 0; i < CANCEL_PER_ROUND; i++) weak[i] = kvb_weak_of(strong[i]);
    expect_kvo(kvo_pipeline_create(&pc, &pl), "kvo_pipeline_create");
    expect_kvo(kvo_pipeline_get_config(pl, &pc), "kvo_pipeline_get_config");
    if (CANCEL_PER_ROUND >= pc.min_batch) die("cancel latency: %d blocks would fill a batch", CANCEL_PER_ROUND);
    for (size_t r = 0; r < CANCEL_ROUNDS; r++) {
        for (size_t i = 0; i < CANCEL_PER_ROUND; i++) expect_kvo(kvo_enqueue(pl, &weak[i], 1, NULL, &t[i]), "kvo_enqueue");
        for (size_t i = 0; i < CANCEL_PER_ROUND; i++) wait_queued(pl, t[i]);
        sleep_us(2000); /* the coordinator is back to its timed wait */
        for (size_t i = 0; i < CANCEL_PER_ROUND; i++) {
            kvo_status st = 0;
            uint64_t t0 = now_ns();
            expect_kvo(kvo_transfer_cancel(pl, t[i], &st), "kvo_transfer_cancel");
            uint64_t t1 = now_ns();
            if (st != KVO_STATUS_CANCELLED) die("cancel latency: final status %d, expected Cancelled", (int)st);
            check_transfer(pl, t[i], KVO_STATUS_CANCELLED, 0, "cancel latency");
            expect_kvo(kvo_transfer_release(pl, t[i]), "kvo_transfer_release");
            ns[r * CANCEL_PER_ROUND + i] = t1 - t0;
        }
    }
    kvo_pipeline_stats ps;
    expect_kvo(kvo_pipeline_get_stats(pl, &ps), "kvo_pipeline_get_stats");
    if (ps.cancelled != N || ps.batches != 0) die("cancel latency: %llu cancelled, %llu batches; expected %d and 0",
                                                  (unsigned long long)ps.cancelled, (unsigned long long)ps.batches, N);
    kvo_pipeline_destroy(pl);
    expect_ok(kvb_release(src, strong, CANCEL_PER_ROUND, NULL), "kvb_release");
    check_pool(src, "after the cancel benchmark");
    kvb_pool_destroy(src);
    kvb_pool_destroy(dst);
    qsort(ns, N, sizeof ns[0], compare_u64);
    results_add(rs, "cancel_latency_ms", (double)ns[N / 2] / 1e6, "ms",
                (double)pc.sweep_interval_us / 1000.0 + GOAL_CANCEL_SLACK_MS, GOAL_AT_MOST);
    results_add(rs, "cancel_latency_max_ms", (double)ns[N - 1] / 1e6, "ms", NO_GOAL, GOAL_AT_MOST);
}

/* ---- the run ------------------------------------------------------------------------------------ */

static void usage(FILE *to)
{
    fprintf(to, "usage: kvbench [--json] [--only SECTION,..]\n"
                "  Benchmarks kvblock.h and kvoffload.h; prints a table, or with --json one JSON object on stdout.\n"
                "  Sections: core gather pipeline disk cancel evict replay sched observe remote (default: all).\n");
}


/* ---- eviction policies: LRU vs FOL, ARC, S3-FIFO ----------------------------------------------------- */

typedef struct evict_bench { kvb_pool *pool; kvb_hash *hashes; uint64_t *rng; } evict_bench;

/* ns per block of a full cycle in a full pool: alloc 16 (each evicts) + register_hashed 16 + release 16.
 * The whole cycle is timed: FOL's shadow pools do their work when a request is released. */
static double evict_once(void *ctx)
{
    evict_bench *b = ctx;
    kvb_block blocks[CYCLE_BATCH], registered[CYCLE_BATCH];
    fill_random_hashes(b->hashes, (size_t)EVICT_ITERATIONS * CYCLE_BATCH, b->rng);
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < EVICT_ITERATIONS; i++) {
        expect_ok(kvb_alloc(b->pool, CYCLE_BATCH, blocks), "evict: kvb_alloc");
        expect_ok(kvb_register_hashed(b->pool, blocks, CYCLE_BATCH, b->hashes + i * CYCLE_BATCH, NULL, registered),
                  "evict: kvb_register_hashed");
        expect_ok(kvb_release(b->pool, registered, CYCLE_BATCH, NULL), "evict: kvb_release");
    }
    return (double)(now_ns() - t0) / ((double)EVICT_ITERATIONS * CYCLE_BATCH);
}

static void evict_bench_make(evict_bench *b, kvb_evict_policy policy, uint32_t blocks, uint64_t *rng)
{
    kvb_pool_config cfg = { .num_blocks = blocks, .block_tokens = BLOCK_TOKENS, .eviction = policy };
    *b = (evict_bench){ .rng = rng, .hashes = xmalloc((size_t)EVICT_ITERATIONS * CYCLE_BATCH * sizeof(kvb_hash)) };
    expect_ok(kvb_pool_create(&cfg, &b->pool), "kvb_pool_create (evict)");
    fill_with_inactive_blocks(b->pool, blocks, rng);
}

static void evict_bench_free(evict_bench *b)
{
    check_pool(b->pool, "after the eviction bench");
    kvb_pool_destroy(b->pool);
    free(b->hashes);
}

typedef struct evict_pair { evict_bench lru, other; } evict_pair;
static double evict_lru_once(void *ctx) { return evict_once(&((evict_pair *)ctx)->lru); }
static double evict_other_once(void *ctx) { return evict_once(&((evict_pair *)ctx)->other); }

/* A policy and LRU in pools of the same size, their rounds interleaved (summarize_interleaved): this
 * VM's memory speed drifts by up to 2x from minute to minute, and the ratio is what is judged. */
static void measure_evict_pair(kvb_evict_policy policy, uint32_t blocks, uint64_t *rng, double *lru, double *ns)
{
    evict_pair pair;
    evict_bench_make(&pair.lru, KVB_EVICT_LRU, blocks, rng);
    evict_bench_make(&pair.other, policy, blocks, rng);
    summarize_interleaved(MEDIAN, REPS_EVICT, evict_lru_once, evict_other_once, &pair, lru, ns);
    evict_bench_free(&pair.lru);
    evict_bench_free(&pair.other);
}

/* Each policy against LRU in the same run, in the big pool and in one of 16,384 blocks (where FOL's
 * shadows sample a quarter of the blocks instead of 0.4%). */
static void bench_evict(results *rs, uint64_t *rng)
{
    static const struct { kvb_evict_policy ev; const char *ns, *vs, *vs16k; double goal; } pol[] = {
        {KVB_EVICT_FOL, "evict_fol_ns", "evict_fol_vs_lru", "evict_fol_vs_lru_16k", GOAL_FOL_VS_LRU},
        {KVB_EVICT_ARC, "evict_arc_ns", "evict_arc_vs_lru", "evict_arc_vs_lru_16k", NO_GOAL},
        {KVB_EVICT_S3FIFO, "evict_s3fifo_ns", "evict_s3fifo_vs_lru", "evict_s3fifo_vs_lru_16k", NO_GOAL}};
    for (size_t i = 0; i < sizeof pol / sizeof pol[0]; i++) {
        double lru, ns, lru16k, ns16k;
        measure_evict_pair(pol[i].ev, BIG_POOL_BLOCKS, rng, &lru, &ns);
        measure_evict_pair(pol[i].ev, 16384, rng, &lru16k, &ns16k);
        if (i == 0) results_add(rs, "evict_lru_ns", lru, "ns/block", NO_GOAL, GOAL_AT_MOST);
        results_add(rs, pol[i].ns, ns, "ns/block", NO_GOAL, GOAL_AT_MOST);
        results_add(rs, pol[i].vs, ns / lru, "ratio", pol[i].goal, GOAL_AT_MOST);
        results_add(rs, pol[i].vs16k, ns16k / lru16k, "ratio", pol[i].goal, GOAL_AT_MOST);
    }
}

/* ---- replay: a multi-turn trace through kvblock.h and through a bare LRU prefix map ------------------ */

/* The trace as the replay sees it: per request, the parent of its first block (the root) followed by
 * its block hashes, clipped to the pool's size, so a request's parents are hashes[off - 1 + i]. */
typedef struct replay_trace {
    kvb_hash *hashes;
    size_t *off, *len;  /* request q: hashes[off[q] .. off[q] + len[q]) */
    size_t n, blocks, max_len;
} replay_trace;

static void replay_trace_make(replay_trace *t)
{
    wl_trace w;
    if (wl_generate(WL_CHAT, REPLAY_BLOCK_TOKENS, REPLAY_REQUESTS, 1.0, 1, 0, &w) != 0) die("replay: wl_generate");
    t->n = w.n;
    t->off = xmalloc(w.n * sizeof *t->off);
    t->len = xmalloc(w.n * sizeof *t->len);
    t->hashes = xmalloc((w.total_blocks + w.n) * sizeof *t->hashes);
    t->blocks = t->max_len = 0;
    size_t at = 0;
    for (size_t q = 0; q < w.n; q++) {
        size_t n = w.req[q].num_blocks < REPLAY_POOL_BLOCKS ? w.req[q].num_blocks : REPLAY_POOL_BLOCKS;
        t->hashes[at++] = (kvb_hash){ 0, 0 };
        t->off[q] = at;
        t->len[q] = n;
        for (size_t i = 0; i < n; i++) { /* identities to 128-bit hashes, high half mixed */
            uint64_t s = w.req[q].blocks[i];
            t->hashes[at + i] = (kvb_hash){ w.req[q].blocks[i], splitmix64(&s) };
        }
        at += n;
        t->blocks += n;
        if (n > t->max_len) t->max_len = n;
    }
    wl_free(&w);
}

/* The bare reference: an open-addressing map from hash to node and a doubly linked LRU list (node cap is
 * the head: next = least recent). Per request: the cached prefix hits, the misses come in (evicting the
 * least recent), then every block becomes most recent, deepest first, as kvb_release gives them back. */
typedef struct bare_lru {
    uint32_t *slot;                 /* node + 1, 0 = empty */
    uint64_t mask;
    kvb_hash *key;
    uint32_t *prev, *next, cap, used;
} bare_lru;

static uint64_t bare_slot(const bare_lru *c, const kvb_hash *h)
{
    uint64_t s = h->lo & c->mask;
    while (c->slot[s] && (c->key[c->slot[s] - 1].lo != h->lo || c->key[c->slot[s] - 1].hi != h->hi))
        s = (s + 1) & c->mask;
    return s;
}
static void bare_del(bare_lru *c, uint64_t i) /* backward-shift deletion */
{
    for (uint64_t j = i;;) {
        j = (j + 1) & c->mask;
        if (!c->slot[j]) break;
        uint64_t k = c->key[c->slot[j] - 1].lo & c->mask;
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        c->slot[i] = c->slot[j];
        i = j;
    }
    c->slot[i] = 0;
}
static void bare_unlink(bare_lru *c, uint32_t x) { c->next[c->prev[x]] = c->next[x]; c->prev[c->next[x]] = c->prev[x]; }
static void bare_push(bare_lru *c, uint32_t x)
{
    c->prev[x] = c->prev[c->cap];
    c->next[x] = c->cap;
    c->next[c->prev[c->cap]] = x;
    c->prev[c->cap] = x;
}
static void bare_init(bare_lru *c, uint32_t cap)
{
    uint64_t slots = 1;
    while (slots < 2 * (uint64_t)cap) slots <<= 1;
    *c = (bare_lru){ .slot = calloc(slots, sizeof(uint32_t)), .mask = slots - 1, .key = xmalloc(cap * sizeof(kvb_hash)),
                     .prev = xmalloc((cap + 1) * sizeof(uint32_t)), .next = xmalloc((cap + 1) * sizeof(uint32_t)),
                     .cap = cap };
    if (!c->slot) die("out of memory");
    c->prev[cap] = c->next[cap] = cap;
}
static void bare_free(bare_lru *c) { free(c->slot); free(c->key); free(c->prev); free(c->next); }

static uint64_t bare_request(bare_lru *c, const kvb_hash *h, size_t n)
{
    size_t m = 0;
    while (m < n && c->slot[bare_slot(c, &h[m])]) m++;
    for (size_t i = 0; i < n; i++) { /* in use by the request: most recent while its misses come in */
        uint64_t s = bare_slot(c, &h[i]);
        uint32_t x = c->slot[s] ? c->slot[s] - 1 : UINT32_MAX;
        if (x == UINT32_MAX) {
            if (c->used < c->cap) x = c->used++;
            else {
                x = c->next[c->cap];
                bare_unlink(c, x);
                bare_del(c, bare_slot(c, &c->key[x]));
                s = bare_slot(c, &h[i]);
            }
            c->key[x] = h[i];
            c->slot[s] = x + 1;
        } else {
            bare_unlink(c, x);
        }
        bare_push(c, x);
    }
    for (size_t i = n; i-- > 0;) { /* released deepest first */
        uint32_t x = c->slot[bare_slot(c, &h[i])] - 1;
        bare_unlink(c, x);
        bare_push(c, x);
    }
    return m;
}

typedef struct replay_bench {
    replay_trace t;
    kvb_block *blk;
    uint64_t hits_lib, hits_bare;
    kvb_evict_policy policy;
    int one_call;       /* kvb_request_begin instead of kvb_match + kvb_alloc + kvb_register_hashed */
} replay_bench;

/* serve_sim --sequential's loop: match, allocate and register the misses, release the whole chain. */
static double replay_lib_once(void *ctx)
{
    replay_bench *b = ctx;
    kvb_pool_config cfg = { .num_blocks = REPLAY_POOL_BLOCKS, .block_tokens = REPLAY_BLOCK_TOKENS, .eviction = b->policy };
    kvb_pool *pool;
    uint64_t hits = 0;
    expect_ok(kvb_pool_create(&cfg, &pool), "kvb_pool_create (replay)");
    uint64_t t0 = now_ns();
    for (size_t q = 0; q < b->t.n; q++) {
        const kvb_hash *h = b->t.hashes + b->t.off[q];
        size_t n = b->t.len[q], m = 0;
        if (!n) continue;
        if (b->one_call) {
            expect_ok(kvb_request_begin(pool, h, n, b->blk, &m), "replay: kvb_request_begin");
            hits += m;
            expect_ok(kvb_release(pool, b->blk, n, NULL), "replay: kvb_release");
            continue;
        }
        expect_ok(kvb_match(pool, h, n, b->blk, &m), "replay: kvb_match");
        hits += m;
        if (m < n) {
            expect_ok(kvb_alloc(pool, n - m, b->blk + m), "replay: kvb_alloc");
            expect_ok(kvb_register_hashed(pool, b->blk + m, n - m, h + m, h + m - 1, b->blk + m),
                      "replay: kvb_register_hashed");
        }
        expect_ok(kvb_release(pool, b->blk, n, NULL), "replay: kvb_release");
    }
    uint64_t t1 = now_ns();
    check_pool(pool, "after the replay");
    kvb_pool_destroy(pool);
    b->hits_lib = hits;
    return (double)(t1 - t0) / (double)b->t.blocks;
}

static double replay_bare_once(void *ctx)
{
    replay_bench *b = ctx;
    bare_lru c;
    uint64_t hits = 0;
    bare_init(&c, REPLAY_POOL_BLOCKS);
    uint64_t t0 = now_ns();
    for (size_t q = 0; q < b->t.n; q++) hits += bare_request(&c, b->t.hashes + b->t.off[q], b->t.len[q]);
    uint64_t t1 = now_ns();
    bare_free(&c);
    b->hits_bare = hits;
    return (double)(t1 - t0) / (double)b->t.blocks;
}

static void bench_replay(results *rs)
{
    replay_bench b = { .policy = KVB_EVICT_LRU };
    double lib, bare, fol, one, bare1;
    replay_trace_make(&b.t);
    b.blk = xmalloc(b.t.max_len * sizeof *b.blk);
    summarize_interleaved(MEDIAN, REPS_REPLAY, replay_lib_once, replay_bare_once, &b, &lib, &bare);
    if (b.hits_lib != b.hits_bare)
        die("replay: kvblock.h hit %llu blocks, the bare LRU map %llu", (unsigned long long)b.hits_lib,
            (unsigned long long)b.hits_bare);
    uint64_t hits = b.hits_lib;
    b.one_call = 1;
    summarize_interleaved(MEDIAN, REPS_REPLAY, replay_lib_once, replay_bare_once, &b, &one, &bare1);
    if (b.hits_lib != hits) die("replay: kvb_request_begin hit %llu blocks, the separate calls %llu",
                                (unsigned long long)b.hits_lib, (unsigned long long)hits);
    b.one_call = 0;
    b.policy = KVB_EVICT_FOL; /* self-tuning (fol_class_step 0) */
    fol = summarize_runs(MEDIAN, REPS_REPLAY, replay_lib_once, &b);
    free(b.blk);
    free(b.t.hashes);
    free(b.t.off);
    free(b.t.len);
    results_add(rs, "replay_ns_per_block", lib, "ns/block", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "bare_lru_ns_per_block", bare, "ns/block", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "replay_vs_bare_lru", lib / bare, "ratio", GOAL_REPLAY_VS_BARE, GOAL_AT_MOST);
    results_add(rs, "replay_fol_vs_lru", fol / lib, "ratio", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "replay_request_ns_per_block", one, "ns/block", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "replay_request_vs_bare_lru", one / bare1, "ratio", GOAL_REPLAY_VS_BARE, GOAL_AT_MOST);
}

/* ---- scheduler step ------------------------------------------------------------------------------ */

/* An engine's steady state: n requests decoding, one token each per step, with the connector, eager
 * offload to a host tier through the memcpy backend (small pages: the copies are not what is measured). */
typedef struct sched_bench {
    kvb_pool *device, *host;
    kvo_backend *copy;
    kvo_manager *tiers;
    kvs_sched *sched;
    uint32_t token;
} sched_bench;

/* The KV memory an engine serves from is resident (written by its forward passes; the host tier pinned
 * at start-up), so the pools' storage is touched here: otherwise each step's stores copy from and into
 * never-touched pages and the step measures first-touch page faults (about 26 us each on a VM), not the
 * scheduler. */
static kvb_pool *sched_pool(uint32_t blocks)
{
    kvb_pool_config cfg = { .num_blocks = blocks, .block_tokens = BLOCK_TOKENS, .storage = KVB_STORAGE_HOST,
                            .layout = { .kind = KVB_LAYOUT_BLOCK_CONTIGUOUS, .num_layers = 1, .num_parts = 2,
                                        .page_bytes = 64 } };
    kvb_pool *p;
    void *base;
    uint64_t bytes;
    expect_ok(kvb_pool_create(&cfg, &p), "kvb_pool_create (sched)");
    expect_ok(kvb_pool_storage(p, &base, &bytes, NULL, NULL), "kvb_pool_storage (sched)");
    memset(base, 0, (size_t)bytes);
    return p;
}

/* One step as the engine runs it: plan, (forward pass), complete, append the sampled tokens. */
static size_t sched_step(sched_bench *b)
{
    kvs_step st;
    size_t decoded = 0;
    if (kvs_sched_step(b->sched, &st) != KVS_OK) die("kvs_sched_step failed");
    if (kvs_sched_complete(b->sched, &st) != KVS_OK) die("kvs_sched_complete failed");
    for (size_t i = 0; i < st.num_prefill + st.num_decode; i++) {
        const kvs_sched_item *it = i < st.num_prefill ? &st.prefill[i] : &st.decode[i - st.num_prefill];
        if (it->num_computed + it->num_new < it->num_tokens) continue;
        uint32_t t = b->token++;
        if (kvs_sched_append(b->sched, it->request, &t, 1) != KVS_OK) die("kvs_sched_append failed");
        decoded += i >= st.num_prefill;
    }
    return decoded;
}

static void sched_setup(sched_bench *b, uint32_t requests, kvs_bus *bus)
{
    uint32_t blocks = requests * (SCHED_PROMPT_BLOCKS + 8);
    memset(b, 0, sizeof *b);
    b->device = sched_pool(blocks);
    b->host = sched_pool(blocks);
    expect_kvo(kvo_memcpy_backend_create(0, &b->copy), "kvo_memcpy_backend_create");
    kvo_manager_config mc = { .num_tiers = 2, .pools = { b->device, b->host }, .down = { b->copy },
                              .up = { NULL, b->copy }, .pipeline = { .mode = KVO_MODE_POLL } };
    expect_kvo(kvo_manager_create(&mc, &b->tiers), "kvo_manager_create");
    kvs_sched_config sc = { .device = b->device, .tiers = b->tiers, .max_seqs = requests, .bus = bus };
    if (kvs_sched_create(&sc, &b->sched) != KVS_OK) die("kvs_sched_create failed");
    uint32_t *prompt = xmalloc((SCHED_PROMPT_BLOCKS + 1) * BLOCK_TOKENS * sizeof *prompt);
    for (uint32_t r = 0; r < requests; r++) {
        size_t n = SCHED_PROMPT_BLOCKS * BLOCK_TOKENS + r % BLOCK_TOKENS + 1;
        for (size_t i = 0; i < n; i++) prompt[i] = r * 1000u + (uint32_t)i; /* no sharing between requests */
        kvs_request rq = { .prompt = prompt, .num_prompt = n };
        uint64_t id;
        if (kvs_sched_add(b->sched, &rq, &id) != KVS_OK) die("kvs_sched_add failed");
    }
    free(prompt);
    for (int i = 0; i < 64; i++) /* prefill until everyone decodes */
        if (sched_step(b) == requests) return;
    die("sched bench: requests did not all reach decoding");
}

static void sched_teardown(sched_bench *b)
{
    kvs_sched_destroy(b->sched);
    kvo_manager_destroy(b->tiers);
    kvo_backend_destroy(b->copy);
    check_pool(b->device, "after the scheduler bench");
    kvb_pool_destroy(b->device);
    kvb_pool_destroy(b->host);
}

static double sched_step_once(void *ctx)
{
    sched_bench *b = ctx;
    uint64_t t0 = now_ns();
    size_t decoded = sched_step(b);
    uint64_t t1 = now_ns();
    if (!decoded) die("sched bench: a step decoded nothing");
    return (double)(t1 - t0) / 1000.0;
}

static double measure_sched_step(uint32_t requests)
{
    sched_bench b;
    sched_setup(&b, requests, NULL);
    double us = summarize_runs(MEDIAN, REPS_SCHED, sched_step_once, &b);
    sched_teardown(&b);
    return us;
}

/* ---- kvsched.h observability: events, the log, the cost to the scheduler ------------------------ */

#define OBSERVE_EVENTS 100000

typedef struct observe_bench {
    char dir[64], path[96];
    kvs_event event;
} observe_bench;

static kvs_bus *observe_bus(void)
{
    kvs_bus *bus;
    if (kvs_bus_create(NULL, &bus) != KVS_OK) die("kvs_bus_create failed");
    return bus;
}

static void observe_publish_all(kvs_bus *bus, kvs_event *e)
{
    for (int i = 0; i < OBSERVE_EVENTS; i++) {
        e->request = (uint64_t)i;
        if (kvs_bus_publish(bus, e) != KVS_OK) die("kvs_bus_publish failed");
    }
}

/* A bus with a ring reader (never read: it drops the oldest) and an in-memory recorder. */
static double publish_once(void *ctx)
{
    observe_bench *b = ctx;
    kvs_bus *bus = observe_bus();
    kvs_reader *reader;
    kvs_recorder *rec;
    kvs_recorder_config rc = { .capacity = 65536 };
    if (kvs_reader_open(bus, 0, 4096, &reader) != KVS_OK || kvs_recorder_create(bus, &rc, &rec) != KVS_OK)
        die("observe bench: reader or recorder");
    uint64_t t0 = now_ns();
    observe_publish_all(bus, &b->event);
    uint64_t t1 = now_ns();
    kvs_recorder_destroy(rec);
    kvs_reader_close(reader);
    kvs_bus_destroy(bus);
    return (double)(t1 - t0) / OBSERVE_EVENTS;
}

/* The recorder appending every event to its log file, closed (flushed) at the end. */
static double log_once(void *ctx)
{
    observe_bench *b = ctx;
    kvs_bus *bus = observe_bus();
    kvs_recorder *rec;
    kvs_recorder_config rc = { .capacity = 1024, .log_path = b->path };
    uint64_t t0 = now_ns();
    if (kvs_recorder_create(bus, &rc, &rec) != KVS_OK) die("observe bench: recorder with a log");
    observe_publish_all(bus, &b->event);
    kvs_recorder_destroy(rec);
    uint64_t t1 = now_ns();
    kvs_bus_destroy(bus);
    return (double)(t1 - t0) / OBSERVE_EVENTS;
}

/* The limit: fwrite of the same number of records of the same size to the same file, closed. */
static double fwrite_once(void *ctx)
{
    observe_bench *b = ctx;
    unsigned char rec[KVS_RECORD_BYTES];
    memset(rec, 0x5a, sizeof rec);
    uint64_t t0 = now_ns();
    FILE *f = fopen(b->path, "wb");
    if (!f) die("observe bench: cannot write %s", b->path);
    for (int i = 0; i < OBSERVE_EVENTS; i++) {
        rec[0] = (unsigned char)i;
        if (fwrite(rec, sizeof rec, 1, f) != 1) die("observe bench: fwrite failed");
    }
    if (fclose(f) != 0) die("observe bench: fclose failed");
    uint64_t t1 = now_ns();
    return (double)(t1 - t0) / OBSERVE_EVENTS;
}

/* Two schedulers in the same steady state, one of them observed: their step times interleaved. */
typedef struct sched_pair { sched_bench plain, observed; } sched_pair;

static double sched_plain_once(void *ctx) { return sched_step_once(&((sched_pair *)ctx)->plain); }
static double sched_observed_once(void *ctx) { return sched_step_once(&((sched_pair *)ctx)->observed); }

static double measure_sched_observed(uint32_t requests, int record)
{
    sched_pair p;
    kvs_bus *bus = observe_bus();
    kvs_recorder *rec = NULL;
    kvs_recorder_config rc = { .capacity = 1u << 20 };
    if (record && kvs_recorder_create(bus, &rc, &rec) != KVS_OK) die("observe bench: recorder");
    sched_setup(&p.plain, requests, NULL);
    sched_setup(&p.observed, requests, bus);
    double plain, observed;
    summarize_interleaved(MEDIAN, REPS_SCHED, sched_plain_once, sched_observed_once, &p, &plain, &observed);
    sched_teardown(&p.observed);
    sched_teardown(&p.plain);
    kvs_recorder_destroy(rec);
    kvs_bus_destroy(bus);
    return observed / plain;
}

static void bench_observe(results *rs)
{
    observe_bench b;
    memset(&b, 0, sizeof b);
    snprintf(b.dir, sizeof b.dir, "/tmp/kvbench_observe.XXXXXX");
    if (!mkdtemp(b.dir)) die("observe bench: mkdtemp failed");
    snprintf(b.path, sizeof b.path, "%s/events.kvslog", b.dir);
    b.event.kind = KVS_EV_STEP;
    b.event.u.step.step = 7;
    b.event.u.step.decode = 1000;
    double publish = summarize_runs(MEDIAN, REPS_OBSERVE, publish_once, &b);
    double logged, plain;
    summarize_interleaved(MEDIAN, REPS_OBSERVE, log_once, fwrite_once, &b, &logged, &plain);
    unlink(b.path);
    rmdir(b.dir);
    results_add(rs, "event_publish_ns", publish, "ns/event", GOAL_EVENT_PUBLISH_NS, GOAL_AT_MOST);
    results_add(rs, "event_log_ns", logged, "ns/event", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "event_log_vs_fwrite", logged / plain, "ratio", GOAL_EVENT_LOG_VS_FWRITE, GOAL_AT_MOST);
    results_add(rs, "sched_step_bus_idle_ratio", measure_sched_observed(1000, 0), "ratio", GOAL_SCHED_BUS_IDLE,
                GOAL_AT_MOST);
    results_add(rs, "sched_step_recorded_ratio", measure_sched_observed(1000, 1), "ratio", NO_GOAL, GOAL_AT_MOST);
}

/* ---- kvroute.h: routing over a fleet's index ------------------------------------------------------ */

typedef struct route_bench {
    kvs_router *router;
    kvb_hash *chains;       /* ROUTE_CHAINS x ROUTE_CHAIN_BLOCKS */
    kvb_hash *requests;     /* ROUTE_REQUESTS x (ROUTE_CHAIN_BLOCKS + ROUTE_NEW_BLOCKS) */
    size_t *lengths;
    double loads[ROUTE_WORKERS];
    uint64_t *rng;
    unsigned char *evict_buffer;
    size_t evict_bytes;
    double last_route_ns;
} route_bench;

static void route_store(kvs_router *r, uint32_t worker, const kvb_hash *chain, size_t n)
{
    kvb_event ev[ROUTE_CHAIN_BLOCKS];
    memset(ev, 0, sizeof ev);
    for (size_t i = 0; i < n; i++) {
        ev[i].kind = KVB_EVENT_STORED;
        ev[i].hash = chain[i];
    }
    if (kvs_router_events(r, worker, ev, n) != KVS_OK) die("route bench: kvs_router_events");
}

/* Each repetition routes fresh requests (built untimed, then the caches emptied) with fresh loads. */
static double route_once(void *ctx)
{
    route_bench *b = ctx;
    enum { STRIDE = ROUTE_CHAIN_BLOCKS + ROUTE_NEW_BLOCKS };
    static const size_t prefixes[] = { 4, 16, 32, 64 };
    for (size_t q = 0; q < ROUTE_REQUESTS; q++) {
        const kvb_hash *chain = b->chains + (splitmix64(b->rng) % ROUTE_CHAINS) * ROUTE_CHAIN_BLOCKS;
        size_t k = prefixes[splitmix64(b->rng) % 4];
        memcpy(b->requests + q * STRIDE, chain, k * sizeof *chain);
        fill_random_hashes(b->requests + q * STRIDE + k, ROUTE_NEW_BLOCKS, b->rng);
        b->lengths[q] = k + ROUTE_NEW_BLOCKS;
    }
    for (uint32_t w = 0; w < ROUTE_WORKERS; w++) b->loads[w] = (double)(splitmix64(b->rng) % 64);
    evict_caches(b->evict_buffer, b->evict_bytes);
    kvs_router_stats before, after;
    if (kvs_router_get_stats(b->router, &before) != KVS_OK) die("route bench: kvs_router_get_stats");
    uint64_t sum = 0, t0 = now_ns();
    for (size_t q = 0; q < ROUTE_REQUESTS; q++) {
        uint32_t w;
        size_t overlap;
        if (kvs_router_route(b->router, b->requests + q * STRIDE, b->lengths[q], b->loads, &w, &overlap) != KVS_OK)
            die("route bench: kvs_router_route");
        sum += w + overlap;
    }
    uint64_t t1 = now_ns();
    sink = sum;
    if (kvs_router_get_stats(b->router, &after) != KVS_OK) die("route bench: kvs_router_get_stats");
    b->last_route_ns = (double)(t1 - t0) / ROUTE_REQUESTS;
    return (double)(t1 - t0) / (double)(after.probes - before.probes);
}

static double route_per_route_once(void *ctx)
{
    route_bench *b = ctx;
    (void)route_once(b);
    return b->last_route_ns;
}

static void bench_route(results *rs, unsigned char *evict_buffer, size_t evict_bytes, uint64_t *rng)
{
    route_bench b = { .evict_buffer = evict_buffer, .evict_bytes = evict_bytes, .rng = rng };
    kvs_router_config rc = { .num_workers = ROUTE_WORKERS, .expected_blocks = ROUTE_CHAINS * ROUTE_CHAIN_BLOCKS };
    if (kvs_router_create(&rc, &b.router) != KVS_OK) die("route bench: kvs_router_create");
    b.chains = xmalloc((size_t)ROUTE_CHAINS * ROUTE_CHAIN_BLOCKS * sizeof *b.chains);
    b.requests = xmalloc((size_t)ROUTE_REQUESTS * (ROUTE_CHAIN_BLOCKS + ROUTE_NEW_BLOCKS) * sizeof *b.requests);
    b.lengths = xmalloc(ROUTE_REQUESTS * sizeof *b.lengths);
    fill_random_hashes(b.chains, (size_t)ROUTE_CHAINS * ROUTE_CHAIN_BLOCKS, rng);
    for (uint32_t c = 0; c < ROUTE_CHAINS; c++) {
        const kvb_hash *chain = b.chains + (size_t)c * ROUTE_CHAIN_BLOCKS;
        uint32_t home = c % ROUTE_WORKERS;
        route_store(b.router, home, chain, ROUTE_CHAIN_BLOCKS);
        route_store(b.router, (home + 1 + (uint32_t)(splitmix64(rng) % (ROUTE_WORKERS - 1))) % ROUTE_WORKERS, chain,
                    splitmix64(rng) % (ROUTE_CHAIN_BLOCKS + 1));
        if (c & 1) route_store(b.router, (uint32_t)(splitmix64(rng) % ROUTE_WORKERS), chain, splitmix64(rng) % 17);
    }
    kvs_router_stats st;
    if (kvs_router_get_stats(b.router, &st) != KVS_OK) die("route bench: kvs_router_get_stats");
    if (st.hashes != (uint64_t)ROUTE_CHAINS * ROUTE_CHAIN_BLOCKS) die("route bench: index holds %llu hashes",
                                                                      (unsigned long long)st.hashes);
    double per_block = summarize_runs(MEDIAN, REPS_ROUTE, route_once, &b);
    double per_route = summarize_runs(MEDIAN, REPS_ROUTE, route_per_route_once, &b);
    free(b.lengths);
    free(b.requests);
    free(b.chains);
    kvs_router_destroy(b.router);
    results_add(rs, "route_ns_per_block", per_block, "ns/block", GOAL_ROUTE_NS, GOAL_AT_MOST);
    results_add(rs, "route_ns", per_route, "ns/route", NO_GOAL, GOAL_AT_MOST);
}

/* ---- kvremote.h: the Redis G4 tier over loopback ------------------------------------------------ */

static void bench_remote(results *rs)
{
#ifdef KVO_WITH_REDIS
    kbr_figures f;
    char why[256] = "";
    int got = kbr_measure(256, 3, &f, why, sizeof why);
    if (got <= 0) {
        fprintf(stderr, "kvbench: remote tier %s: %s (no remote_* keys)\n", got ? "failed" : "skipped", why);
        return;
    }
    results_add(rs, "remote_put_gbps", f.put_gbps, "GB/s", NO_GOAL, GOAL_AT_LEAST);
    results_add(rs, "remote_get_gbps", f.get_gbps, "GB/s", NO_GOAL, GOAL_AT_LEAST);
    results_add(rs, "remote_vs_redis_benchmark", f.vs_redis_benchmark, "ratio", GOAL_REMOTE_VS_REDIS, GOAL_AT_LEAST);
#else
    (void)rs;
    fprintf(stderr, "kvbench: remote tier skipped: built without KVO_WITH_REDIS (no remote_* keys)\n");
#endif
}

static void bench_sched(results *rs)
{
    double us1k = measure_sched_step(1000), us4k = measure_sched_step(4000);
    results_add(rs, "sched_step_us_1000", us1k, "us", GOAL_SCHED_STEP_US, GOAL_AT_MOST);
    results_add(rs, "sched_step_us_4000", us4k, "us", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "sched_step_scaling", us4k / us1k, "ratio", GOAL_SCHED_SCALING, GOAL_AT_MOST);
}

/* Hashing aside, the block-level keys: the cycle at 1k and 1M blocks, the cold match, the router, the
 * DRAM floor they are measured against. */
static void bench_core(results *rs, unsigned char *big, size_t big_bytes, uint64_t *rng)
{
    progress("block cycle, 1k blocks");
    double cycle_1k = measure_block_cycle_1k(rng);

    progress("filling 1M blocks");
    kvb_pool *pool = create_metadata_pool(BIG_POOL_BLOCKS);
    fill_with_inactive_blocks(pool, BIG_POOL_BLOCKS, rng);
    progress("block cycle, 1M blocks");
    double cycle_1m = measure_block_cycle(pool, rng);
    progress("prefix match, 1M blocks");
    double match = measure_match(pool, big, big_bytes, rng);
    check_pool(pool, "after the 1M block cycle and match");
    kvb_pool_destroy(pool);

    progress("router: 8 workers, 1M hashes");
    bench_route(rs, big, big_bytes, rng);

    progress("DRAM floor");
    double dram = measure_dram_floor(big, big_bytes, rng);
    progress("cold reads");
    double cold = measure_cold_reads(big, big_bytes, rng);

    results_add(rs, "block_cycle_ns", cycle_1m, "ns/block", GOAL_BLOCK_CYCLE_NS, GOAL_AT_MOST);
    results_add(rs, "block_cycle_ns_1k", cycle_1k, "ns/block", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "scaling_1k_to_1m", cycle_1m / cycle_1k, "ratio", GOAL_SCALING_1K_TO_1M, GOAL_AT_MOST);
    results_add(rs, "match_ns_per_block", match, "ns/block", GOAL_MATCH_NS, GOAL_AT_MOST);
    results_add(rs, "dram_floor_ns", dram, "ns/read", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "match_vs_dram_floor", match / dram, "ratio", GOAL_MATCH_VS_DRAM, GOAL_AT_MOST);
    results_add(rs, "cold_read_ns", cold, "ns/read", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "cold_read_vs_dram_floor", cold / dram, "ratio", NO_GOAL, GOAL_AT_MOST);
    results_add(rs, "match_vs_cold_read", match / cold, "ratio", NO_GOAL, GOAL_AT_MOST);
}

/* --only a,b: run only the named sections (core gather pipeline disk cancel evict replay sched observe
 * remote), for iterating on one of them. */
static const char *only;
static int want(const char *section)
{
    size_t n = strlen(section);
    for (const char *p = only; p && *p; p += strcspn(p, ",") + (p[strcspn(p, ",")] == ',')) {
        if (strncmp(p, section, n) == 0 && (p[n] == ',' || p[n] == '\0')) return 1;
    }
    return !only;
}

int main(int argc, char **argv)
{
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) json = 1;
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
        else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) { usage(stdout); return 0; }
        else { usage(stderr); return 2; }
    }

    machine_info machine = describe_machine();
    results rs = { .n = 0 };
    uint64_t rng = UINT64_C(0x6b76626c6f636b21);
    size_t big_bytes = big_buffer_bytes(&machine);
    unsigned char *big = alloc_touched(big_bytes);

    if (want("core")) {
        progress("hashing");
        bench_hash(&rs, &rng);
        bench_core(&rs, big, big_bytes, &rng);
    }
    if (want("gather")) {
        progress("memcpy backend, gather/scatter");
        bench_gather(&rs, big, big_bytes, &rng);
    }
    free(big);
    if (want("pipeline")) {
        progress("pipeline overhead, poll and threads");
        bench_pipeline(&rs, &rng);
    }
    if (want("disk")) {
        progress("disk backend");
        bench_disk(&rs, &rng);
    }
    if (want("cancel")) {
        progress("cancel latency");
        bench_cancel(&rs, &rng);
    }
    if (want("evict")) {
        progress("eviction: LRU vs FOL, 1M blocks");
        bench_evict(&rs, &rng);
    }
    if (want("replay")) {
        progress("replay: a chat trace through kvblock.h and a bare LRU map");
        bench_replay(&rs);
    }
    if (want("sched")) {
        progress("scheduler step, 1000 and 4000 decoding requests");
        bench_sched(&rs);
    }
    if (want("observe")) {
        progress("events: publish, log, the scheduler observed");
        bench_observe(&rs);
    }
    if (want("remote")) {
        progress("remote tier (Redis on loopback), 256 blocks of 2 MiB");
        bench_remote(&rs);
    }

    if (json) print_json(&rs, &machine);
    else print_table(&rs, &machine);
    return 0;
}
