/* static_use.c — static mode (KVB_STATIC, KVO_STATIC, KVS_STATIC on the command line): the library is
 * private to this translation unit. tests/compile/matrix.sh checks that the object defines no global
 * symbol but main, then links and runs it. MATRIX_HEADER names the header. */
#include MATRIX_HEADER

#include <string.h>

int main(void)
{
    kvb_pool_config cfg;
    kvb_pool *pool;
    kvb_block b[2];
    kvb_pool_stats st;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 4;
    if (kvb_pool_create(&cfg, &pool) != KVB_OK) return 1;
    if (kvb_alloc(pool, 2, b) != KVB_OK) return 2;
    if (kvb_pool_get_stats(pool, &st) != KVB_OK || st.active_blocks != 2) return 3;
    if (kvb_release(pool, b, 2, NULL) != KVB_OK) return 4;
    kvb_pool_destroy(pool);
    return 0;
}
