/* installed.c — compiled by tests/compile/matrix.sh against an installed copy (make install into a
 * temporary prefix) with nothing but `pkg-config --cflags --libs kvcache`. */
#define _GNU_SOURCE /* the POSIX calls of the offload part under -std=c11, and O_DIRECT */
#define KVCACHE_IMPLEMENTATION
#include "kvcache.h"

#include <stdio.h>
#include <string.h>

int main(void)
{
    kvb_pool_config cfg;
    kvb_pool *pool;
    kvo_token *token;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 4;
    if (kvb_pool_create(&cfg, &pool) != KVB_OK) return 1;
    kvb_pool_destroy(pool);
    if (kvo_token_create(&token) != KVO_OK) return 2;
    kvo_token_release(token);
    printf("kvcache %d.%d.%d installed and working\n", KVCACHE_VERSION_MAJOR, KVCACHE_VERSION_MINOR,
           KVCACHE_VERSION_PATCH);
    return 0;
}
