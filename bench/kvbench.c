/* kvbench.c — benchmarks of kvcache's kvblock.h (the numbers the README quotes come from here)
 *
 * Measures, in one run:
 *   hash_ns_per_block     kvb_hash_block chained over 16-token blocks (parent = previous hash)
 *   hash_vs_xxh3_128      ours / the same chain with XXH3_128bits over the same 88 bytes (with
 *                         libxxhash; xxh3_128_ns_per_block is that chain's time, for reference)
 *   block_cycle_ns        alloc 16 (each evicts) + register_hashed 16 + release 16, in a full pool
 *                         of 1,048,576 metadata-only blocks, per block; _1k: the same in 1,024 blocks
 *   match_ns_per_block    kvb_match of a 256-block chain + kvb_release of it, metadata not in cache
 *   dram_floor_ns         independent random 64-byte reads with software prefetch, per read, from an
 *                         array of max(64 MiB, 2 x L3) (a large shared L3 would otherwise hold it)
 * and ratios against the goals (section "goals" below).
 *
 * Run:  make bench                  a table: key, value, unit, goal, pass/miss
 *       build/kvbench --json        one JSON object on stdout:
 *                                   {"machine": {...}, "<key>": value, ..., "goals": {"<key>": goal}}
 * A whole run takes a few seconds (well under 30 s on a 2-core machine).
 *
 * Each measurement is repeated (after one untimed warm-up). Reported: the median, which ignores the
 * occasional outlier; for the two hash chains the minimum, since they are pure computation in L1/L2
 * where noise (other tenants, frequency changes) can only add time and the spread between runs is as
 * large as the difference being measured. To add a key: time it in a run_once function, summarize
 * with summarize_runs(), record it with results_add(); both output formats pick it up.
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVBENCH_HAVE_XXHASH
#include <xxhash.h>
#endif

/* ---- goals -------------------------------------------------------------------------------------- */

#define NO_GOAL NAN

#define GOAL_HASH_NS            20.0
#define GOAL_HASH_VS_XXH3       1.25
#define GOAL_BLOCK_CYCLE_NS     100.0
#define GOAL_SCALING_1K_TO_1M   2.0
#define GOAL_MATCH_NS           40.0
#define GOAL_MATCH_VS_DRAM      1.5

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

#define REPS_HASH   15
#define REPS_CYCLE  5
#define REPS_MATCH  21
#define REPS_DRAM   7

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

/* ---- results ------------------------------------------------------------------------------------ */

typedef enum goal_kind { GOAL_AT_MOST, GOAL_AT_LEAST } goal_kind;

typedef struct result {
    const char *name;
    const char *unit;
    double value;
    double goal;    /* NO_GOAL for reference values */
    goal_kind kind;
} result;

#define MAX_RESULTS 32
typedef struct results {
    result items[MAX_RESULTS];
    size_t n;
} results;

static void results_add(results *rs, const char *name, double value, const char *unit, double goal,
                        goal_kind kind)
{
    if (rs->n == MAX_RESULTS) die("too many results");
    rs->items[rs->n++] = (result){ .name = name, .unit = unit, .value = value, .goal = goal, .kind = kind };
}

static int result_has_goal(const result *r) { return !isnan(r->goal); }

static int result_meets_goal(const result *r)
{
    return r->kind == GOAL_AT_MOST ? r->value <= r->goal : r->value >= r->goal;
}

static void print_table(const results *rs, const machine_info *m)
{
    printf("kvbench — %ld cores, %s\n\n", m->cores, m->cpu);
    printf("%-22s %12s  %-9s %10s  %s\n", "key", "value", "unit", "goal", "result");
    for (size_t i = 0; i < rs->n; i++) {
        const result *r = &rs->items[i];
        char goal[32] = "-";
        if (result_has_goal(r))
            snprintf(goal, sizeof goal, "%s %g", r->kind == GOAL_AT_MOST ? "<=" : ">=", r->goal);
        printf("%-22s %12.3f  %-9s %10s  %s\n", r->name, r->value, r->unit, goal,
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
 * calls form one dependency chain. */
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

/* ---- the run ------------------------------------------------------------------------------------ */

static void usage(FILE *to)
{
    fprintf(to, "usage: kvbench [--json]\n"
                "  Benchmarks kvblock.h; prints a table, or with --json one JSON object on stdout.\n");
}

int main(int argc, char **argv)
{
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) json = 1;
        else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) { usage(stdout); return 0; }
        else { usage(stderr); return 2; }
    }

    machine_info machine = describe_machine();
    results rs = { .n = 0 };
    uint64_t rng = UINT64_C(0x6b76626c6f636b21);
    size_t big_bytes = big_buffer_bytes(&machine);
    unsigned char *big = alloc_touched(big_bytes);

    progress("hashing");
    bench_hash(&rs, &rng);

    progress("block cycle, 1k blocks");
    double cycle_1k = measure_block_cycle_1k(&rng);

    progress("filling 1M blocks");
    kvb_pool *pool = create_metadata_pool(BIG_POOL_BLOCKS);
    fill_with_inactive_blocks(pool, BIG_POOL_BLOCKS, &rng);
    progress("block cycle, 1M blocks");
    double cycle_1m = measure_block_cycle(pool, &rng);
    progress("prefix match, 1M blocks");
    double match = measure_match(pool, big, big_bytes, &rng);
    check_pool(pool, "after the 1M block cycle and match");
    kvb_pool_destroy(pool);

    progress("DRAM floor");
    double dram = measure_dram_floor(big, big_bytes, &rng);
    free(big);

    results_add(&rs, "block_cycle_ns", cycle_1m, "ns/block", GOAL_BLOCK_CYCLE_NS, GOAL_AT_MOST);
    results_add(&rs, "block_cycle_ns_1k", cycle_1k, "ns/block", NO_GOAL, GOAL_AT_MOST);
    results_add(&rs, "scaling_1k_to_1m", cycle_1m / cycle_1k, "ratio", GOAL_SCALING_1K_TO_1M, GOAL_AT_MOST);
    results_add(&rs, "match_ns_per_block", match, "ns/block", GOAL_MATCH_NS, GOAL_AT_MOST);
    results_add(&rs, "dram_floor_ns", dram, "ns/read", NO_GOAL, GOAL_AT_MOST);
    results_add(&rs, "match_vs_dram_floor", match / dram, "ratio", GOAL_MATCH_VS_DRAM, GOAL_AT_MOST);

    if (json) print_json(&rs, &machine);
    else print_table(&rs, &machine);
    return 0;
}
