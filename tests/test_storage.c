/* Storage of a kvblock.h pool: both layouts place every (block, layer, part) page where
 * kvb_layout_offset says, pages are aligned and disjoint and keep what is written; metadata-only,
 * external and user-allocated storage; configurations that are refused; a very large metadata pool; the
 * huge-page advice for large tables (Linux). */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#include "kvtest.h"
#include "fixtures.h"

#include <stdio.h>
#include <stdlib.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

enum { BLOCKS = 8, LAYERS = 3 };

/* 16 tokens x 2 kv heads x 8 dims x 2 bytes = 512-byte pages */
static kvb_layout small_layout(kvb_layout_kind kind)
{
    kvb_layout layout;
    memset(&layout, 0, sizeof layout);
    KVT_EQ(kvb_layout_for_model(kind, 16, LAYERS, 2, 8, 2, &layout), KVB_OK);
    return layout;
}

static kvb_pool_config storage_config(kvb_storage_kind storage, kvb_layout_kind kind)
{
    kvb_pool_config cfg = fx_config(BLOCKS);
    cfg.storage = storage;
    cfg.layout = small_layout(kind);
    return cfg;
}

/* The manual's two formulas, written out. */
static uint64_t manual_offset(const kvb_layout *l, uint32_t num_blocks, uint32_t block, uint32_t layer, uint32_t part)
{
    if (l->kind == KVB_LAYOUT_BLOCK_CONTIGUOUS)
        return (((uint64_t)block * l->num_layers + layer) * l->num_parts + part) * l->page_bytes;
    return (((uint64_t)layer * l->num_parts + part) * num_blocks + block) * l->page_bytes;
}

static void test_layout_for_model(void)
{
    kvb_layout l = small_layout(KVB_LAYOUT_LAYER_SEPARATE);
    KVT_EQ(l.kind, KVB_LAYOUT_LAYER_SEPARATE);
    KVT_EQ(l.num_layers, LAYERS);
    KVT_EQ(l.num_parts, 2);
    KVT_EQ(l.page_bytes, 512);
    KVT_EQ(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, 16, 0, 2, 8, 2, &l), KVB_ECONFIG);
    KVT_EQ(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, 16, 1, 2, 8, 0, &l), KVB_ECONFIG);
    KVT_EQ(kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, 32768, 1, UINT32_MAX, UINT32_MAX, 8, &l),
           KVB_EOVERFLOW);
    for (uint32_t blk = 0; blk < BLOCKS; blk++)
        for (uint32_t layer = 0; layer < LAYERS; layer++)
            for (uint32_t part = 0; part < 2; part++) {
                kvb_layout c = small_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS), s = small_layout(KVB_LAYOUT_LAYER_SEPARATE);
                KVT_EQ(kvb_layout_offset(&c, BLOCKS, blk, layer, part), manual_offset(&c, BLOCKS, blk, layer, part));
                KVT_EQ(kvb_layout_offset(&s, BLOCKS, blk, layer, part), manual_offset(&s, BLOCKS, blk, layer, part));
            }
}

static unsigned char pattern(uint32_t block, uint32_t layer, uint32_t part)
{
    return (unsigned char)(1 + block * 2 * LAYERS + layer * 2 + part);
}

/* Every page of every block: at its offset, inside the storage, and holding its own bytes. */
static void check_host_pool(kvb_layout_kind kind)
{
    kvb_pool_config cfg = storage_config(KVB_STORAGE_HOST, kind);
    kvb_pool *pool = fx_pool_from(&cfg);
    void *base = NULL;
    uint64_t bytes = 0, block_bytes = 0;
    kvb_layout layout;
    KVT_EQ(kvb_pool_storage(pool, &base, &bytes, &block_bytes, &layout), KVB_OK);
    KVT_CHECK(base != NULL);
    KVT_EQ((uintptr_t)base % 4096, 0);
    KVT_EQ(block_bytes, (uint64_t)LAYERS * 2 * 512);
    KVT_EQ(bytes, (uint64_t)BLOCKS * block_bytes);
    KVT_EQ(layout.kind, kind);
    KVT_EQ(layout.page_bytes, 512);

    kvb_block b[BLOCKS];
    KVT_EQ(kvb_alloc(pool, BLOCKS, b), KVB_OK);
    unsigned char *pages[BLOCKS][LAYERS][2];
    for (uint32_t i = 0; i < BLOCKS; i++) {
        uint32_t index = kvb_block_index(b[i].id);
        for (uint32_t layer = 0; layer < LAYERS; layer++)
            for (uint32_t part = 0; part < 2; part++) {
                void *p = NULL;
                KVT_EQ(kvb_block_data(pool, b[i], layer, part, &p), KVB_OK);
                KVT_CHECK((unsigned char *)p == (unsigned char *)base + kvb_layout_offset(&layout, BLOCKS, index, layer, part));
                KVT_CHECK((unsigned char *)p + 512 <= (unsigned char *)base + bytes);
                pages[i][layer][part] = (unsigned char *)p;
                memset(p, pattern(i, layer, part), 512); /* ASan catches a page outside the storage */
            }
    }
    /* distinct pages do not overlap: each still holds only its own byte */
    int bad_pages = 0;
    for (uint32_t i = 0; i < BLOCKS; i++)
        for (uint32_t layer = 0; layer < LAYERS; layer++)
            for (uint32_t part = 0; part < 2; part++) {
                const unsigned char *p = pages[i][layer][part];
                for (int k = 0; k < 512; k++)
                    if (p[k] != pattern(i, layer, part)) {
                        bad_pages++;
                        break;
                    }
            }
    KVT_EQ(bad_pages, 0);

    void *p = NULL;
    KVT_EQ(kvb_block_data(pool, b[0], LAYERS, 0, &p), KVB_ERANGE);
    KVT_EQ(kvb_block_data(pool, b[0], 0, 2, &p), KVB_ERANGE);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, b, BLOCKS, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_host_storage_block_contiguous(void) { check_host_pool(KVB_LAYOUT_BLOCK_CONTIGUOUS); }
static void test_host_storage_layer_separate(void) { check_host_pool(KVB_LAYOUT_LAYER_SEPARATE); }

/* A cached block keeps its bytes: registered, released, matched again, the data is still there. */
static void test_cached_block_keeps_its_bytes(void)
{
    kvb_pool_config cfg = storage_config(KVB_STORAGE_HOST, KVB_LAYOUT_LAYER_SEPARATE);
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_block b = {0}, hit = {0};
    kvb_hash h = fx_hash(42, 42);
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    unsigned char *p = NULL;
    KVT_EQ(kvb_block_data(pool, b, 1, 1, (void **)&p), KVB_OK);
    memset(p, 0x5a, 512);
    fx_import(pool, &b, 1, &h, NULL);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);

    kvb_block other[4];
    KVT_EQ(kvb_alloc(pool, 4, other), KVB_OK); /* free blocks are used first: the cached one stays */
    size_t n = 0;
    KVT_EQ(kvb_match(pool, &h, 1, &hit, &n), KVB_OK);
    KVT_EQ(n, 1);
    unsigned char *q = NULL;
    KVT_EQ(kvb_block_data(pool, hit, 1, 1, (void **)&q), KVB_OK);
    KVT_CHECK(q == p);
    KVT_EQ(q[0], 0x5a);
    KVT_EQ(q[511], 0x5a);
    KVT_EQ(kvb_release(pool, other, 4, NULL), KVB_OK);
    KVT_EQ(kvb_release(pool, &hit, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_metadata_only_pool_has_no_data(void)
{
    kvb_pool *pool = fx_pool(4);
    kvb_block b = {0};
    void *p = &b;
    void *base = &b;
    uint64_t bytes = 1, block_bytes = 1;
    kvb_layout layout;
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    KVT_EQ(kvb_block_data(pool, b, 0, 0, &p), KVB_ENODATA);
    KVT_EQ(kvb_pool_storage(pool, &base, &bytes, &block_bytes, &layout), KVB_OK);
    KVT_CHECK(base == NULL);
    KVT_EQ(bytes, 0);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    kvb_pool_destroy(pool);
}

static void test_external_storage(void)
{
    kvb_pool_config cfg = storage_config(KVB_STORAGE_EXTERNAL, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    uint64_t need = (uint64_t)BLOCKS * LAYERS * 2 * 512;
    unsigned char *mem = malloc((size_t)need + 8);
    KVT_CHECK(mem != NULL);
    if (!mem) return;
    cfg.external_base = mem + 8; /* 4 KiB alignment is not required */
    cfg.external_bytes = need;
    kvb_pool *pool = fx_pool_from(&cfg);
    void *base = NULL;
    uint64_t bytes = 0, block_bytes = 0;
    kvb_layout layout;
    KVT_EQ(kvb_pool_storage(pool, &base, &bytes, &block_bytes, &layout), KVB_OK);
    KVT_CHECK(base == mem + 8);
    KVT_EQ(bytes, need);
    kvb_block b = {0};
    KVT_EQ(kvb_alloc(pool, 1, &b), KVB_OK);
    void *p = NULL;
    KVT_EQ(kvb_block_data(pool, b, 2, 1, &p), KVB_OK);
    KVT_CHECK((unsigned char *)p == mem + 8 + kvb_layout_offset(&cfg.layout, BLOCKS, kvb_block_index(b.id), 2, 1));
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    FX_CHECK_POOL(pool);
    kvb_pool_destroy(pool);

    kvb_pool *refused = NULL;
    cfg.external_bytes = need - 1; /* does not hold the layout */
    KVT_EQ(kvb_pool_create(&cfg, &refused), KVB_ECONFIG);
    cfg.external_bytes = need;
    cfg.external_base = NULL;
    KVT_EQ(kvb_pool_create(&cfg, &refused), KVB_ECONFIG);
    KVT_CHECK(refused == NULL);
    free(mem);
}

/* ---- a user allocator ---------------------------------------------------------------------------- */

typedef struct counting {
    int allocs, frees;
    uint64_t bytes_out, bytes_back, largest_aligned_4k;
} counting;

static void *counting_alloc(size_t size, size_t align, void *user)
{
    counting *c = (counting *)user;
    void *p = NULL;
    if (align < sizeof(void *)) align = sizeof(void *);
    if (posix_memalign(&p, align, size ? size : 1) != 0) return NULL;
    c->allocs++;
    c->bytes_out += size;
    if (align >= 4096 && size > c->largest_aligned_4k) c->largest_aligned_4k = size;
    return p;
}

static void counting_free(void *ptr, size_t size, void *user)
{
    counting *c = (counting *)user;
    if (!ptr) return;
    c->frees++;
    c->bytes_back += size;
    free(ptr);
}

static void test_user_allocator_serves_metadata_and_storage(void)
{
    counting c;
    memset(&c, 0, sizeof c);
    kvb_pool_config cfg = storage_config(KVB_STORAGE_HOST, KVB_LAYOUT_LAYER_SEPARATE);
    cfg.allocator.alloc = counting_alloc;
    cfg.allocator.free = counting_free;
    cfg.allocator.user = &c;
    kvb_pool *pool = fx_pool_from(&cfg);
    KVT_CHECK(c.allocs >= 2); /* metadata and storage */
    KVT_CHECK(c.largest_aligned_4k >= (uint64_t)BLOCKS * LAYERS * 2 * 512);
    kvb_block b[2];
    KVT_EQ(kvb_alloc(pool, 2, b), KVB_OK);
    KVT_EQ(kvb_release(pool, b, 2, NULL), KVB_OK);
    kvb_pool_destroy(pool);
    KVT_EQ(c.frees, c.allocs);
    KVT_EQ(c.bytes_back, c.bytes_out);

    memset(&c, 0, sizeof c); /* metadata only: still the user's memory */
    kvb_pool_config meta = fx_config(64);
    meta.allocator = cfg.allocator;
    pool = fx_pool_from(&meta);
    KVT_CHECK(c.allocs >= 1);
    kvb_pool_destroy(pool);
    KVT_EQ(c.frees, c.allocs);
}

/* Bytes of this process's mappings that carry the huge-page advice (VmFlags "hg" in /proc/self/smaps),
 * or -1 where there is no smaps to read. */
static long long advised_huge_bytes(void)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    long long total = 0, size_kb = 0;
    if (!f) return -1;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "Size: %lld kB", &size_kb) == 1) continue;
        if (strncmp(line, "VmFlags:", 8) == 0 && strstr(line, " hg")) total += size_kb * 1024;
    }
    fclose(f);
    return total;
}

/* Whether this kernel keeps the huge-page advice (a kernel without transparent huge pages refuses it, and
 * the pools then go without, as documented): an anonymous mapping of two huge pages asks for it. */
#if defined(__linux__) && defined(MADV_HUGEPAGE)
static int kernel_keeps_huge_advice(void)
{
    size_t bytes = (size_t)4 << 20;
    long long before = advised_huge_bytes();
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int kept;
    if (m == MAP_FAILED) return 0;
    kept = madvise(m, bytes, MADV_HUGEPAGE) == 0 && advised_huge_bytes() - before >= (long long)bytes;
    munmap(m, bytes);
    return kept;
}
#endif

/* The default allocator asks for huge pages for the tables of 2 MiB or more (a pool of 200,000 blocks:
 * 12.8 MB of metadata, an 8 MiB index), so cold lookups miss the TLB less; the user's allocator is left
 * to decide for itself. */
static void test_large_tables_ask_for_huge_pages(void)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    long long before = advised_huge_bytes();
    if (before < 0) {
        KVT_SKIP("no /proc/self/smaps to read the advice from");
        return;
    }
    if (!kernel_keeps_huge_advice()) {
        KVT_SKIP("the kernel refuses the huge-page advice (no transparent huge pages)");
        return;
    }
    before = advised_huge_bytes();
    kvb_pool *pool = fx_pool(200000);
    long long with_pool = advised_huge_bytes();
#ifdef KVB_NO_HUGE_PAGES
    KVT_EQ(with_pool, before);
#else
    KVT_CHECK(with_pool - before >= 200000LL * 64 + (8LL << 20) - (4LL << 20)); /* less a partial page each */
#endif
    kvb_pool_destroy(pool);
    KVT_CHECK(advised_huge_bytes() <= with_pool);

    counting c;
    memset(&c, 0, sizeof c);
    kvb_pool_config cfg = fx_config(200000);
    cfg.allocator.alloc = counting_alloc;
    cfg.allocator.free = counting_free;
    cfg.allocator.user = &c;
    before = advised_huge_bytes();
    pool = fx_pool_from(&cfg);
    KVT_EQ(advised_huge_bytes(), before);
    kvb_pool_destroy(pool);
#else
    KVT_SKIP("huge pages are asked for on Linux only");
#endif
}

static void test_half_an_allocator_refused(void)
{
    counting c;
    memset(&c, 0, sizeof c);
    kvb_pool_config cfg = fx_config(4);
    kvb_pool *pool = NULL;
    cfg.allocator.alloc = counting_alloc;
    cfg.allocator.user = &c;
    KVT_EQ(kvb_pool_create(&cfg, &pool), KVB_ECONFIG);
    cfg.allocator.alloc = NULL;
    cfg.allocator.free = counting_free;
    KVT_EQ(kvb_pool_create(&cfg, &pool), KVB_ECONFIG);
    KVT_CHECK(pool == NULL);
    KVT_EQ(c.allocs, 0);
}

/* ---- configuration ------------------------------------------------------------------------------- */

static kvb_result create_and_destroy(const kvb_pool_config *cfg)
{
    kvb_pool *pool = NULL;
    kvb_result r = kvb_pool_create(cfg, &pool);
    KVT_CHECK((r == KVB_OK) == (pool != NULL));
    kvb_pool_destroy(pool);
    return r;
}

static void test_defaults_resolved(void)
{
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 4; /* block_tokens 0: the default */
    kvb_pool *pool = fx_pool_from(&cfg);
    kvb_pool_config got;
    memset(&got, 0xff, sizeof got);
    KVT_EQ(kvb_pool_get_config(pool, &got), KVB_OK);
    KVT_EQ(got.num_blocks, 4);
    KVT_EQ(got.block_tokens, 16);
    KVT_EQ(got.eviction, KVB_EVICT_LINEAGE);
    KVT_EQ(got.duplicates, KVB_DUP_ALLOW);
    KVT_EQ(got.priority_levels, 1);
    KVT_EQ(got.storage, KVB_STORAGE_NONE);
    kvb_pool_destroy(pool);

    kvb_pool_config host = fx_config(4);
    host.storage = KVB_STORAGE_HOST;
    host.layout.page_bytes = 256; /* layers and parts default to 1 and 2 */
    pool = fx_pool_from(&host);
    kvb_layout layout;
    void *base = NULL;
    uint64_t bytes = 0, block_bytes = 0;
    KVT_EQ(kvb_pool_storage(pool, &base, &bytes, &block_bytes, &layout), KVB_OK);
    KVT_CHECK(base != NULL);
    KVT_EQ(bytes, 4 * 512);
    KVT_EQ(layout.num_layers, 1);
    KVT_EQ(layout.num_parts, 2);
    KVT_EQ(block_bytes, 512);
    kvb_pool_destroy(pool);
}

/* Callbacks that are never reached: only their presence is checked. */
static void custom_on_inactive(void *user, uint32_t block, uint32_t priority)
{
    (void)user, (void)block, (void)priority;
}
static void custom_on_removed(void *user, uint32_t block) { (void)user, (void)block; }
static uint32_t custom_choose(void *user)
{
    (void)user;
    return UINT32_MAX;
}

static void test_bad_configs_refused(void)
{
    kvb_pool_config cfg = fx_config(0);
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg = fx_config(UINT32_C(1) << 31);
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg = fx_config(4);
    cfg.block_tokens = 32769;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg.block_tokens = 32768;
    KVT_EQ(create_and_destroy(&cfg), KVB_OK);
    cfg = fx_config(4);
    cfg.priority_levels = 17;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg.priority_levels = 16;
    KVT_EQ(create_and_destroy(&cfg), KVB_OK);
    cfg = fx_config(4);
    cfg.eviction = KVB_EVICT__COUNT;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg = fx_config(4);
    cfg.duplicates = KVB_DUP__COUNT;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg = fx_config(4);
    cfg.storage = KVB_STORAGE__COUNT;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg = fx_config(4);
    cfg.storage = KVB_STORAGE_HOST; /* no page_bytes */
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg.layout = small_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS);
    cfg.layout.kind = KVB_LAYOUT__COUNT;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg = fx_config(4);
    cfg.eviction = KVB_EVICT_CUSTOM; /* a custom policy needs all three callbacks */
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg.custom_eviction.on_inactive = custom_on_inactive;
    cfg.custom_eviction.on_removed = custom_on_removed;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg.custom_eviction.on_removed = NULL;
    cfg.custom_eviction.choose_victim = custom_choose;
    KVT_EQ(create_and_destroy(&cfg), KVB_ECONFIG);
    cfg.custom_eviction.on_removed = custom_on_removed;
    KVT_EQ(create_and_destroy(&cfg), KVB_OK);
}

static void test_overflowing_sizes_refused(void)
{
    kvb_pool_config cfg = fx_config(1024);
    cfg.storage = KVB_STORAGE_HOST;
    cfg.layout.num_layers = 1024;
    cfg.layout.page_bytes = UINT64_C(1) << 50; /* 2^10 blocks x 2^10 layers x 2 parts x 2^50 */
    KVT_EQ(create_and_destroy(&cfg), KVB_EOVERFLOW);
    cfg.storage = KVB_STORAGE_EXTERNAL;
    cfg.external_base = &cfg;
    cfg.external_bytes = UINT64_MAX;
    KVT_EQ(create_and_destroy(&cfg), KVB_EOVERFLOW);
    cfg = fx_config(4);
    cfg.storage = KVB_STORAGE_HOST;
    cfg.layout.page_bytes = UINT64_MAX / 2 + 1; /* one page of a block already overflows with 2 parts */
    KVT_EQ(create_and_destroy(&cfg), KVB_EOVERFLOW);
}

static void test_ten_million_block_metadata_pool(void)
{
    kvb_pool *pool = fx_pool(10000000);
    if (!pool) return;
    kvb_block *b = calloc(1000, sizeof *b);
    KVT_CHECK(b != NULL);
    if (!b) return;
    for (int i = 0; i < 1000; i += 100) KVT_EQ(kvb_alloc(pool, 100, b + i), KVB_OK);
    kvb_pool_stats st = fx_stats(pool);
    KVT_EQ(st.num_blocks, 10000000);
    KVT_EQ(st.active_blocks, 1000);
    KVT_EQ(st.free_blocks, 10000000 - 1000);
    FX_CHECK_POOL(pool);
    KVT_EQ(kvb_release(pool, b, 1000, NULL), KVB_OK);
    KVT_EQ(fx_stats(pool).free_blocks, 10000000);
    free(b);
    kvb_pool_destroy(pool);
}

int main(void)
{
    fx_watchdog(60);
    KVT_RUN(test_layout_for_model);
    KVT_RUN(test_host_storage_block_contiguous);
    KVT_RUN(test_host_storage_layer_separate);
    KVT_RUN(test_cached_block_keeps_its_bytes);
    KVT_RUN(test_metadata_only_pool_has_no_data);
    KVT_RUN(test_external_storage);
    KVT_RUN(test_user_allocator_serves_metadata_and_storage);
    KVT_RUN(test_large_tables_ask_for_huge_pages);
    KVT_RUN(test_half_an_allocator_refused);
    KVT_RUN(test_defaults_resolved);
    KVT_RUN(test_bad_configs_refused);
    KVT_RUN(test_overflowing_sizes_refused);
    KVT_RUN(test_ten_million_block_metadata_pool);
    return kvt_summary();
}
