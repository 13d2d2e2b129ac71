/* kvbench_remote.h — the G4 tier's throughput measurement, shared by build/kvbench_remote and
 * build/kvbench --json (both built with -DKVO_WITH_REDIS -lhiredis). Include after kvremote.h (with its
 * implementation compiled in this program) and tests/redis_fixtures.h.
 *
 * kbr_measure starts its own redis-server on a free loopback port (maxmemory 4gb), writes n blocks of
 * 2 MiB (32 layers x K/V x 32 KiB pages, block-contiguous host pool) to Redis through the backend in
 * jobs of 64 blocks (the pipeline's default batch; one pipelined round trip each), reads them back into
 * a second pool (header and checksum checked on every block, then all bytes compared), best of `rounds`;
 * then the SET throughput `redis-benchmark -t set -d 2097152 -P 16 -c 1 -n n` reaches on the same server
 * (one connection, like the backend). GB/s = 1e9 bytes/s of block bytes.
 * Returns 1 with the figures, 0 when skipped (no redis-server / redis-benchmark; why says so), -1 on
 * failure (why says what). The server is always stopped. */
#ifndef KVBENCH_REMOTE_H
#define KVBENCH_REMOTE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KBR_BLOCK_TOKENS 16
#define KBR_LAYERS 32
#define KBR_PAGE_BYTES (32u * 1024u)
#define KBR_BATCH 64

typedef struct kbr_figures {
    size_t blocks;
    uint64_t block_bytes;
    double put_gbps, get_gbps;     /* best of the rounds */
    double redis_benchmark_gbps;   /* redis-benchmark SET, same server, same run */
    double vs_redis_benchmark;     /* put_gbps / redis_benchmark_gbps (0 when that is unknown) */
} kbr_figures;

typedef struct kbr_waiter {
    int done, result;
} kbr_waiter;

static void kbr_on_done(kvo_copy_job *job, int result, const char *message)
{
    kbr_waiter *w = (kbr_waiter *)job->user;
    if (result != KVO_OK)
        fprintf(stderr, "kvbench_remote: job failed: %s\n", message ? message : kvo_redis_result_string(result));
    w->done = 1;
    w->result = result;
}

static double kbr_now_s(void) { return (double)rf_now_us() / 1e6; }

/* All blocks in jobs of KBR_BATCH; 1 when every copy succeeded. */
static int kbr_run(kvo_backend *b, kvb_pool *src, kvb_pool *dst, const uint32_t *idx, const kvb_hash *h, size_t n,
                   int *results)
{
    for (size_t at = 0; at < n; at += KBR_BATCH) {
        kbr_waiter w = {0, 0};
        kvo_copy_job job;
        memset(&job, 0, sizeof job);
        job.src = src;
        job.dst = dst;
        job.src_idx = idx + at;
        job.dst_idx = idx + at;
        job.hashes = h + at;
        job.n = n - at < KBR_BATCH ? n - at : KBR_BATCH;
        job.results = results + at;
        job.done = kbr_on_done;
        job.user = &w;
        if (b->submit(b, &job) != KVO_OK || !w.done || w.result != KVO_OK) return 0;
    }
    return 1;
}

static kvb_pool *kbr_pool(uint32_t n, int storage, const kvb_layout *layout)
{
    kvb_pool_config c;
    kvb_pool *p = NULL;
    memset(&c, 0, sizeof c);
    c.num_blocks = n;
    c.block_tokens = KBR_BLOCK_TOKENS;
    if (storage) {
        c.storage = KVB_STORAGE_HOST;
        c.layout = *layout;
    }
    return kvb_pool_create(&c, &p) == KVB_OK ? p : NULL;
}

/* SET requests per second redis-benchmark reaches (its -q line), or 0. */
static double kbr_redis_benchmark(int port, const char *dir, size_t n)
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

static int kbr_measure(size_t n, int rounds, kbr_figures *out, char *why, size_t why_size)
{
    char prog[512];
    memset(out, 0, sizeof *out);
    if (!rf_have_redis() || !rf_which("redis-benchmark", prog, sizeof prog)) {
        snprintf(why, why_size, "redis-server or redis-benchmark not installed");
        return 0;
    }
    const char *extra[] = {"--maxmemory", "4gb", NULL};
    rf_server s;
    if (!rf_start(&s, extra)) {
        snprintf(why, why_size, "redis-server did not start");
        return -1;
    }
    kvb_layout layout = {KVB_LAYOUT_BLOCK_CONTIGUOUS, KBR_LAYERS, 2, KBR_PAGE_BYTES};
    uint64_t block_bytes = (uint64_t)KBR_LAYERS * 2 * KBR_PAGE_BYTES;
    kvb_pool *src = kbr_pool((uint32_t)n, 1, &layout), *back = kbr_pool((uint32_t)n, 1, &layout),
             *g4 = kbr_pool((uint32_t)n, 0, NULL);
    kvb_hash *h = (kvb_hash *)calloc(n, sizeof *h);
    uint32_t *idx = (uint32_t *)calloc(n, sizeof *idx);
    int *results = (int *)calloc(n, sizeof *results);
    char addr[64];
    kvo_backend *b = NULL;
    int ok = src && back && g4 && h && idx && results;
    snprintf(why, why_size, "out of memory");
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
        rc.error = why;
        rc.error_size = why_size;
        ok = kvo_redis_backend_create(&rc, &b) == KVO_OK;
    }
    double best_put = 0, best_get = 0;
    for (int r = 0; ok && r < rounds; r++) {
        double t0 = kbr_now_s();
        ok = kbr_run(b, src, g4, idx, h, n, results);
        double t1 = kbr_now_s();
        ok = ok && kbr_run(b, g4, back, idx, h, n, results);
        double t2 = kbr_now_s();
        double put = (double)(n * block_bytes) / (t1 - t0) / 1e9, get = (double)(n * block_bytes) / (t2 - t1) / 1e9;
        if (!ok) snprintf(why, why_size, "a copy job failed");
        if (put > best_put) best_put = put;
        if (get > best_get) best_get = get;
    }
    if (ok) {
        void *a = NULL, *c = NULL;
        kvb_pool_storage(src, &a, NULL, NULL, NULL);
        kvb_pool_storage(back, &c, NULL, NULL, NULL);
        ok = !memcmp(a, c, n * block_bytes);
        if (!ok) snprintf(why, why_size, "the blocks read back differ");
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
        double v = kbr_redis_benchmark(s.port, s.dir, n);
        if (v > rps) rps = v;
    }
    rf_stop(&s);
    if (!ok) return -1;
    out->blocks = n;
    out->block_bytes = block_bytes;
    out->put_gbps = best_put;
    out->get_gbps = best_get;
    out->redis_benchmark_gbps = rps * 2097152.0 / 1e9;
    out->vs_redis_benchmark = out->redis_benchmark_gbps > 0 ? best_put / out->redis_benchmark_gbps : 0;
    why[0] = 0;
    return 1;
}

#endif
