/* link_use.c — the using half of the two-translation-unit link test (tests/compile/matrix.sh): it
 * includes MATRIX_HEADER plainly, without an implementation macro, and is linked with header.c built with
 * them. Also compiled as C++ against an implementation compiled as C. Exit status 0 when the calls
 * behave. */
#include MATRIX_HEADER

#include <stdio.h>
#include <string.h>

static int fails;

static void check(int ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "link test: %s\n", what);
        fails++;
    }
}

int main(void)
{
    kvb_pool_config cfg;
    kvb_pool *pool = NULL;
    kvb_block b, out;
    kvb_hash h = kvb_hash_block(NULL, NULL, 0, NULL, 0, 0);
    size_t got = 0;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 8;
    check(h.lo == UINT64_C(0x237de0d3c7615ee3) && h.hi == UINT64_C(0xde132dd3b565387b), "hash test vector");
    check(kvb_pool_create(&cfg, &pool) == KVB_OK, "pool_create");
    if (!pool) return 1;
    check(kvb_alloc(pool, 1, &b) == KVB_OK, "alloc");
    check(kvb_register_hashed(pool, &b, 1, &h, NULL, &out) == KVB_OK, "register_hashed");
    check(kvb_release(pool, &out, 1, NULL) == KVB_OK, "release");
    check(kvb_lookup(pool, &h, 1, &got) == KVB_OK && got == 1, "lookup finds the registered block");
    check(kvb_pool_check(pool, NULL, 0) == KVB_OK, "pool_check");
    kvb_pool_destroy(pool);
#ifdef KVOFFLOAD_H
    {
        kvo_token *token = NULL;
        kvo_queue *queue = NULL;
        void *item = NULL;
        int x = 7;
        check(kvo_token_create(&token) == KVO_OK, "token_create");
        check(kvo_queue_create(NULL, &queue) == KVO_OK, "queue_create");
        check(kvo_queue_push(queue, &x, token) == KVO_OK, "queue_push");
        check(kvo_queue_pop(queue, &item, 0) == KVO_OK && item == &x, "queue_pop");
        kvo_token_cancel(token);
        check(kvo_queue_push(queue, &x, token) == KVO_ECANCELLED, "push with a cancelled token");
        kvo_queue_destroy(queue);
        kvo_token_release(token);
    }
#endif
#ifdef KVSCHED_H
    check(kvs_result_string(KVS_OK) != NULL, "kvs_result_string");
#endif
    return fails ? 1 : 0;
}
