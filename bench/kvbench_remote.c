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
 * Without redis-server / redis-benchmark it says so and exits 0 (JSON: {"skipped": "..."}).
 * The measurement itself is bench/kvbench_remote.h (build/kvbench --json reports the same keys). */
#ifndef KVO_WITH_REDIS
#define KVO_WITH_REDIS
#endif
#define KVCACHE_IMPLEMENTATION
#include "kvremote.h"
#include "tests/redis_fixtures.h"
#include "bench/kvbench_remote.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    kbr_figures f;
    char why[256] = "";
    rf_watchdog(600);
    int got = kbr_measure(n, rounds, &f, why, sizeof why);
    if (got == 0) {
        if (json) printf("{\"skipped\": \"%s\"}\n", why);
        else printf("kvbench_remote: skipped: %s\n", why);
        return 0;
    }
    if (got < 0) {
        fprintf(stderr, "kvbench_remote: %s\n", why);
        return 1;
    }
    if (json) {
        printf("{\"remote_blocks\": %zu, \"remote_block_bytes\": %llu, \"remote_put_gbps\": %.3f, \"remote_get_gbps\": %.3f, "
               "\"redis_benchmark_set_gbps\": %.3f, \"remote_vs_redis_benchmark\": %.3f}\n",
               f.blocks, (unsigned long long)f.block_bytes, f.put_gbps, f.get_gbps, f.redis_benchmark_gbps,
               f.vs_redis_benchmark);
    } else {
        printf("kvbench_remote: %zu blocks of %llu bytes over loopback, best of %d rounds\n", f.blocks,
               (unsigned long long)f.block_bytes, rounds);
        printf("  remote_put_gbps            %8.3f\n", f.put_gbps);
        printf("  remote_get_gbps            %8.3f\n", f.get_gbps);
        printf("  redis-benchmark SET gbps   %8.3f   (-t set -d 2097152 -P 16 -c 1 -n %zu)\n", f.redis_benchmark_gbps, n);
        printf("  remote_vs_redis_benchmark  %8.3f   (goal >= 0.8)\n", f.vs_redis_benchmark);
    }
    return 0;
}
