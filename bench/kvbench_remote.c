/* kvbench_remote — the G4 tier's throughput over loopback, against a redis-server it starts itself.
 *
 *   build/kvbench_remote [--json] [--blocks N] [--rounds R]
 *
 * 256 blocks of 2 MiB (32 layers x K/V x 32 KiB pages, block-contiguous host pool) go to Redis in
 * backend jobs of 64 blocks (the pipeline's default batch; one pipelined round trip each), then come
 * back into a second pool (header and checksum checked on every block). Figures are the best of R
 * rounds: remote_put_gbps, remote_get_gbps (GB/s = 1e9 bytes/s of block bytes), and
 * remote_vs_redis_benchmark = remote_put_gbps / the SET throughput `redis-benchmark -t set -d 2097152
 * -P 16 -c 1 -n 256` reaches on the same server in the same run (one connection, like the backend).
 * Without redis-server / redis-benchmark it says so and exits 0 (JSON: {"skipped": "..."}). */
#define KVO_WITH_REDIS
#define KVCACHE_IMPLEMENTATION
#include "kvremote.h"
#include "tests/redis_fixtures.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK_TOKENS 16
#define LAYERS 32
#define PAGE_BYTES (32u * 1024u)
#define BATCH 64

typedef struct waiter {
    int done, result;
} waiter;

static void on_done(kvo_copy_job *job, int result, const char *message)
{
    waiter *w = (waiter *)job->user;
    if (result != KVO_OK) fprintf(stderr, "kvbench_remote: job failed: %s\n", message ? message : kvo_redis_result_string(result));
    w->done = 1;
    w->result = result;
}

static double now_s(void) { return (double)rf_now_us() / 1e6; }

/* All blocks in jobs of BATCH; 1 when every copy succeeded. */
static int run(kvo_backend *b, kvb_pool *src, kvb_pool *dst, const uint32_t *idx, const kvb_hash *h, size_t n,
               int *results)
{
    for (size_t at = 0; at < n; at += BATCH) {
        waiter w = {0, 0};
        kvo_copy_job job;
        memset(&job, 0, sizeof job);
        job.src = src;
        job.dst = dst;
        job.src_idx = idx + at;
        job.dst_idx = idx + at;
        job.hashes = h + at;
        job.n = n - at < BATCH ? n - at : BATCH;
        job.results = results + at;
        job.done = on_done;
        job.user = &w;
        if (b->submit(b, &job) != KVO_OK || !w.done || w.result != KVO_OK) return 0;
    }
    return 1;
}

static kvb_pool *pool(uint32_t n, int storage, const kvb_layout *layout)
{
    kvb_pool_config c;
    kvb_pool *p = NULL;
    memset(&c, 0, sizeof c);
    c.num_blocks = n;
    c.block_tokens = BLOCK_TOKENS;
    if (storage) {
        c.storage = KVB_STORAGE_HOST;
        c.layout = *layout;
    }
    return kvb_pool_create(&c, &p) == KVB_OK ? p : NULL;
}

/* SET requests per second redis-benchmark reaches (its -q line), or 0. */
static double redis_benchmark(int port, const char *dir, size_t n)
{
    char portbuf[16], nbuf[16], log[128], line[512];
    double best = 0;
    snprintf(portbuf, sizeof portbuf, "%d", port);
    snprintf(nbuf, sizeof nbuf, "%zu", n);
    snprintf(log, sizeof log, "%s/rf.log", dir);
    unlink(log);
    const char *argv[] = {"redis-benchmark", "-h", "127.0.0.1", "-p", portbuf, "-t", "set", "-d", "2097152", "-P", "16",
                          "-c", "1", "-n", nbuf, "-q", NULL};
    if (rf_run(argv, log, 120000) != 0) return 0;
    FILE *f = fopen(log, "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) { /* "SET: 123.45 requests per second, p50=..." (after \r updates) */
        char *p = strstr(line, "SET: ");
        while (p) {
            char *q = strstr(p + 5, "SET: ");
            double v = atof(p + 5);
            if (!q && strstr(p, "requests per second") && v > best) best = v;
            p = q;
        }
    }
    fclose(f);
    return best;
}

int main(int argc, char **argv)
{
    int json = 0, rounds = 3;
    size_t n = 256;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--blocks") && i + 1 < argc) n = (size_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--json] [--blocks N] [--rounds R]\n", argv[0]);
            return 2;
        }
    }
    char prog[512];
    if (!rf_have_redis() || !rf_which("redis-benchmark", prog, sizeof prog)) {
        if (json) printf("{\"skipped\": \"redis-server or redis-benchmark not installed\"}\n");
        else printf("kvbench_remote: skipped: redis-server or redis-benchmark not installed\n");
        return 0;
    }
    rf_watchdog(600);
    const char *extra[] = {"--maxmemory", "4gb", NULL};
    rf_server s;
    if (!rf_start(&s, extra)) {
        fprintf(stderr, "kvbench_remote: redis-server did not start\n");
        return 1;
    }
    kvb_layout layout = {KVB_LAYOUT_BLOCK_CONTIGUOUS, LAYERS, 2, PAGE_BYTES};
    uint64_t block_bytes = (uint64_t)LAYERS * 2 * PAGE_BYTES;
    kvb_pool *src = pool((uint32_t)n, 1, &layout), *back = pool((uint32_t)n, 1, &layout), *g4 = pool((uint32_t)n, 0, NULL);
    kvb_hash *h = (kvb_hash *)calloc(n, sizeof *h);
    uint32_t *idx = (uint32_t *)calloc(n, sizeof *idx);
    int *results = (int *)calloc(n, sizeof *results);
    char addr[64];
    kvo_backend *b = NULL;
    int ok = src && back && g4 && h && idx && results;
    if (ok) {
        void *base = NULL;
        kvb_pool_storage(src, &base, NULL, NULL, NULL);
        uint64_t x = 0x9e3779b97f4a7c15ull;
        uint64_t *w = (uint64_t *)base;
        for (size_t i = 0; i < n * block_bytes / 8; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w[i] = x;
        }
        void *bb = NULL;
        kvb_pool_storage(back, &bb, NULL, NULL, NULL);
        memset(bb, 0, n * block_bytes); /* fault the pages in before timing */
        for (size_t i = 0; i < n; i++) {
            h[i].lo = 0xabcdef12345ull + i;
            h[i].hi = 0x1234ull * (i + 7);
            idx[i] = (uint32_t)i;
        }
        snprintf(addr, sizeof addr, "127.0.0.1:%d", s.port);
        kvo_redis_config rc;
        memset(&rc, 0, sizeof rc);
        rc.servers = addr;
        rc.namespace_prefix = "kvbench";
        rc.pool = g4;
        rc.layout = layout;
        rc.command_timeout_ms = 30000;
        ok = kvo_redis_backend_create(&rc, &b) == KVO_OK;
    }
    double best_put = 0, best_get = 0;
    for (int r = 0; ok && r < rounds; r++) {
        double t0 = now_s();
        ok = run(b, src, g4, idx, h, n, results);
        double t1 = now_s();
        ok = ok && run(b, g4, back, idx, h, n, results);
        double t2 = now_s();
        double put = (double)(n * block_bytes) / (t1 - t0) / 1e9, get = (double)(n * block_bytes) / (t2 - t1) / 1e9;
        if (put > best_put) best_put = put;
        if (get > best_get) best_get = get;
    }
    if (ok) {
        void *a = NULL, *c = NULL;
        kvb_pool_storage(src, &a, NULL, NULL, NULL);
        kvb_pool_storage(back, &c, NULL, NULL, NULL);
        ok = !memcmp(a, c, n * block_bytes);
        if (!ok) fprintf(stderr, "kvbench_remote: the blocks read back differ\n");
    }
    kvo_backend_destroy(b);
    kvb_pool_destroy(src);
    kvb_pool_destroy(back);
    kvb_pool_destroy(g4);
    free(h);
    free(idx);
    free(results);
    redisReply *flush = ok ? rf_cmd(s.port, NULL, "FLUSHALL") : NULL; /* the blocks' memory back */
    if (flush) freeReplyObject(flush);
    double rps = 0;
    for (int r = 0; ok && r < rounds; r++) {
        double v = redis_benchmark(s.port, s.dir, n);
        if (v > rps) rps = v;
    }
    rf_stop(&s);
    if (!ok) return 1;
    double ref_gbps = rps * 2097152.0 / 1e9;
    double ratio = ref_gbps > 0 ? best_put / ref_gbps : 0;
    if (json) {
        printf("{\"remote_blocks\": %zu, \"remote_block_bytes\": %llu, \"remote_put_gbps\": %.3f, \"remote_get_gbps\": %.3f, "
               "\"redis_benchmark_set_gbps\": %.3f, \"remote_vs_redis_benchmark\": %.3f}\n",
               n, (unsigned long long)block_bytes, best_put, best_get, ref_gbps, ratio);
    } else {
        printf("kvbench_remote: %zu blocks of %llu bytes over loopback, best of %d rounds\n", n,
               (unsigned long long)block_bytes, rounds);
        printf("  remote_put_gbps            %8.3f\n", best_put);
        printf("  remote_get_gbps            %8.3f\n", best_get);
        printf("  redis-benchmark SET gbps   %8.3f   (-t set -d 2097152 -P 16 -c 1 -n %zu)\n", ref_gbps, n);
        printf("  remote_vs_redis_benchmark  %8.3f   (goal >= 0.8)\n", ratio);
    }
    return 0;
}
