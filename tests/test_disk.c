/* The disk tier of kvoffload.h: a byte-for-byte round trip G1 -> G2 -> G3 (disk) -> G1 for both
 * layouts with blocks at scattered indices; a corrupted slot (data or header) is a miss plus a checksum
 * error, never wrong data, and so is a whole slot of kvcache 0.1's format; file errors (missing directory, preallocation refused, writes refused by
 * the kernel) give clear errors and Failed transfers with nothing lost above; the O_DIRECT fallback
 * is said once; a disk pool with storage is refused. File errors are provoked for real with RLIMIT_FSIZE (writes past it fail with EFBIG). */
#include "oom_hooks.h" /* first: out of memory on demand (disarmed unless a test arms it) */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvtest.h"
#include "offload_fixtures.h"

#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

enum { NB = 32, MAXN = 16 };

typedef struct log_count {
    atomic_int calls;
    char last[256];
} log_count;

static void count_log(void *user, const char *message)
{
    log_count *lc = (log_count *)user;
    if (atomic_fetch_add(&lc->calls, 1) == 0 && message) snprintf(lc->last, sizeof lc->last, "%s", message);
}

/* A disk tier: a metadata-only pool and its file in a fresh temp directory. */
typedef struct disk {
    char dir[64];
    char path[128];
    kvb_pool *pool;
    kvo_backend *backend;
    log_count log;
} disk;

/* A disk backend's config for the file at path: slots of pool, log lines counted in *lc (cleared). */
static kvo_disk_config disk_config_for(const char *path, kvb_pool *pool, uint64_t block_bytes, log_count *lc)
{
    kvo_disk_config dc;
    memset(&dc, 0, sizeof dc);
    memset(lc, 0, sizeof *lc);
    dc.path = path;
    dc.disk_pool = pool;
    dc.block_bytes = block_bytes;
    dc.log = count_log;
    dc.log_user = lc;
    return dc;
}

static kvo_disk_config disk_config(disk *d, int direct, uint32_t threads)
{
    kvo_disk_config dc = disk_config_for(d->path, d->pool, OF_BLOCK_BYTES, &d->log);
    dc.direct = direct;
    dc.threads = threads;
    return dc;
}

static int disk_open_in(disk *d, const char *base, int direct, uint32_t threads)
{
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "%s/kvtest-XXXXXX", base);
    if (!mkdtemp(d->dir)) return 0;
    snprintf(d->path, sizeof d->path, "%s/g3.kv", d->dir);
    d->pool = of_meta_pool(NB);
    kvo_disk_config dc = disk_config(d, direct, threads);
    KVT_EQ(kvo_disk_backend_create(&dc, &d->backend), KVO_OK);
    return d->backend != NULL;
}

static int disk_open(disk *d, uint32_t threads) { return disk_open_in(d, "/tmp", 0, threads); }

static void disk_close(disk *d)
{
    kvo_backend_destroy(d->backend);
    if (d->pool) {
        KVT_EQ(of_active(d->pool), 0);
        OF_CHECK_POOL(d->pool);
        kvb_pool_destroy(d->pool);
    }
    unlink(d->path);
    KVT_EQ(rmdir(d->dir), 0);
}

static kvo_disk_stats disk_stats(disk *d)
{
    kvo_disk_stats st;
    memset(&st, 0, sizeof st);
    KVT_EQ(kvo_disk_backend_stats(d->backend, &st), KVO_OK);
    return st;
}

/* Offloads the blocks of `hashes` (registered in from) into `to` and pumps until final. */
static kvo_transfer_info offload(kvb_pool *from, kvb_pool *to, kvo_backend *backend, const kvb_hash *hashes, size_t n)
{
    of_clock clock = {1000000};
    kvb_block strong[MAXN];
    kvb_weak weak[MAXN];
    size_t found = 0;
    kvo_transfer_info info;
    memset(&info, 0, sizeof info);
    kvo_pipeline_config pc = of_config(from, to, backend, KVO_MODE_POLL, &clock);
    kvo_pipeline *p = of_pipeline(&pc);
    if (!p) return info;
    KVT_EQ(kvb_match(from, hashes, n, strong, &found), KVB_OK);
    KVT_EQ(found, n);
    for (size_t i = 0; i < found; i++) weak[i] = kvb_weak_of(strong[i]);
    kvo_transfer t = of_enqueue(p, weak, found, NULL);
    KVT_EQ(kvb_release(from, strong, found, NULL), KVB_OK);
    of_pump(p, &clock, t, 1000, 500);
    info = of_info(p, t);
    KVT_EQ(kvo_transfer_release(p, t), KVO_OK);
    kvo_pipeline_destroy(p);
    return info;
}

/* Onboards `hashes` from `from` into `to`; the taken blocks go to got (*n_got), released by the caller. */
static kvo_transfer_info load(kvb_pool *from, kvb_pool *to, kvo_backend *backend, const kvb_hash *hashes, size_t n,
                              kvb_block *got, size_t *n_got)
{
    of_clock clock = {1000000};
    kvo_transfer t;
    kvo_transfer_info info;
    memset(&info, 0, sizeof info);
    *n_got = 0;
    kvo_pipeline_config pc = of_config(from, to, backend, KVO_MODE_POLL, &clock);
    kvo_pipeline *p = of_pipeline(&pc);
    if (!p) return info;
    KVT_EQ(kvo_onboard(p, hashes, n, NULL, &t), KVO_OK);
    of_pump(p, &clock, t, 1000, 500);
    info = of_info(p, t);
    if (info.status == KVO_STATUS_COMPLETE) {
        KVT_EQ(kvo_transfer_take_blocks(p, t, got, MAXN, n_got), KVO_OK);
    } else {
        size_t none = 0;
        KVT_EQ(kvo_transfer_take_blocks(p, t, got, MAXN, &none), KVO_ESTATE);
    }
    KVT_EQ(kvo_transfer_release(p, t), KVO_OK);
    kvo_pipeline_destroy(p);
    return info;
}

static void release_all(kvb_pool *pool, kvb_block *blocks, size_t n)
{
    if (n) KVT_EQ(kvb_release(pool, blocks, n, NULL), KVB_OK);
}

/* ---- round trip ---- */

static void round_trip(kvb_layout_kind g1_kind, kvb_layout_kind g2_kind, uint32_t disk_threads, uint64_t seed)
{
    disk d;
    kvb_hash h[12];
    kvb_block held[NB], got[MAXN];
    size_t nheld, ngot = 0;
    if (!disk_open(&d, disk_threads)) return;
    of_chain(seed, 12, h);

    /* G1: twelve blocks at scattered indices */
    kvb_pool *g1 = of_mem_pool(NB, g1_kind);
    nheld = of_scatter(g1, NB, seed * 3 + 1, held);
    of_register(g1, h, 12, NULL, NULL);
    release_all(g1, held, nheld);

    /* G1 -> G2 (memcpy, other layout, scattered destination) */
    kvb_pool *g2 = of_mem_pool(NB, g2_kind);
    kvo_backend *mem = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    nheld = of_scatter(g2, NB, seed * 5 + 2, held);
    kvo_transfer_info info = offload(g1, g2, mem, h, 12);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, 12);
    release_all(g2, held, nheld);
    KVT_EQ(of_holds_all(g2, h, 12), 12);

    /* G2 -> G3 (disk write) */
    nheld = of_scatter(d.pool, NB, seed * 7 + 3, held);
    info = offload(g2, d.pool, d.backend, h, 12);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, 12);
    release_all(d.pool, held, nheld);
    KVT_EQ(of_present(d.pool, h, 12), 12);
    kvo_disk_stats st = disk_stats(&d);
    KVT_CHECK(st.writes >= 1);
    KVT_CHECK(st.bytes_written >= 12 * OF_BLOCK_BYTES);

    /* G3 -> a fresh G1 (disk read) */
    kvb_pool *g1b = of_mem_pool(NB, g1_kind);
    nheld = of_scatter(g1b, NB, seed * 11 + 4, held);
    info = load(d.pool, g1b, d.backend, h, 12, got, &ngot);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, 12);
    KVT_EQ(ngot, 12);
    size_t good = 0, in_order = 0;
    for (size_t i = 0; i < ngot; i++) {
        good += of_bytes_ok(g1b, got[i], h[i]);
        in_order += kvb_block_index(got[i].id) == i;
    }
    KVT_EQ(good, 12);
    KVT_CHECK(in_order < 12); /* the indices really were scattered */
    st = disk_stats(&d);
    KVT_CHECK(st.reads >= 1);
    KVT_CHECK(st.bytes_read >= 12 * OF_BLOCK_BYTES);
    KVT_EQ(st.checksum_errors, 0);
    KVT_EQ(st.io_errors, 0);
    release_all(g1b, got, ngot);
    release_all(g1b, held, nheld);
    size_t found = 0;
    KVT_EQ(kvb_lookup(g1b, h, 12, &found), KVB_OK); /* registered there */
    KVT_EQ(found, 12);

    kvb_pool *pools[3] = {g1, g2, g1b};
    for (int i = 0; i < 3; i++) {
        KVT_EQ(of_active(pools[i]), 0);
        OF_CHECK_POOL(pools[i]);
        kvb_pool_destroy(pools[i]);
    }
    kvo_backend_destroy(mem);
    disk_close(&d);
}

static void test_round_trip_contiguous(void) { round_trip(KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_LAYER_SEPARATE, 0, 21); }
static void test_round_trip_layer_separate(void) { round_trip(KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 22); }

/* ---- corruption ---- */

static uint32_t disk_index_of(kvb_pool *pool, kvb_hash h)
{
    kvb_block b;
    size_t n = 0;
    KVT_EQ(kvb_match(pool, &h, 1, &b, &n), KVB_OK);
    KVT_EQ(n, 1);
    if (n != 1) return 0;
    uint32_t idx = kvb_block_index(b.id);
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    return idx;
}

static void flip_byte(const char *path, uint64_t offset)
{
    int fd = open(path, O_RDWR);
    unsigned char c = 0;
    KVT_CHECK(fd >= 0);
    if (fd < 0) return;
    KVT_EQ(pread(fd, &c, 1, (off_t)offset), 1);
    c ^= 0xff;
    KVT_EQ(pwrite(fd, &c, 1, (off_t)offset), 1);
    KVT_EQ(fsync(fd), 0);
    close(fd);
}

/* A flipped data byte, and a flipped header byte, each make that block a miss with a checksum error;
 * the destination does not get it registered; the intact slots still load. */
static void test_corrupted_slot_is_a_miss(void)
{
    disk d;
    kvb_hash h[4];
    kvb_block got[MAXN];
    size_t ngot = 0;
    if (!disk_open(&d, 0)) return;
    of_chain(31, 4, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    of_register(g2, h, 4, NULL, NULL);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 4).transferred, 4);

    uint32_t i1 = disk_index_of(d.pool, h[1]), i2 = disk_index_of(d.pool, h[2]);
    KVT_CHECK(kvo_disk_slot_offset(d.backend, i1) % 4096 == 0);
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, i1) + 4096 + 100); /* data */
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, i2));              /* header: first byte (magic) */

    kvb_pool *g1 = of_mem_pool(NB, KVB_LAYOUT_LAYER_SEPARATE);
    kvo_transfer_info info = load(d.pool, g1, d.backend, &h[1], 1, got, &ngot);
    KVT_CHECK(of_final(info.status) && info.status != KVO_STATUS_CANCELLED);
    KVT_EQ(info.failed, 1);
    KVT_EQ(info.transferred, 0);
    KVT_EQ(ngot, 0);
    KVT_EQ(disk_stats(&d).checksum_errors, 1);
    KVT_CHECK(!of_has(g1, h[1]));

    info = load(d.pool, g1, d.backend, &h[2], 1, got, &ngot);
    KVT_EQ(info.failed, 1);
    KVT_EQ(info.transferred, 0);
    KVT_EQ(ngot, 0);
    KVT_EQ(disk_stats(&d).checksum_errors, 2);
    KVT_CHECK(!of_has(g1, h[2]));
    KVT_EQ(of_active(g1), 0);

    info = load(d.pool, g1, d.backend, &h[0], 1, got, &ngot); /* an intact neighbour */
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(ngot, 1);
    if (ngot == 1) KVT_CHECK(of_bytes_ok(g1, got[0], h[0]));
    release_all(g1, got, ngot);
    info = load(d.pool, g1, d.backend, &h[3], 1, got, &ngot);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(ngot, 1);
    if (ngot == 1) KVT_CHECK(of_bytes_ok(g1, got[0], h[3]));
    release_all(g1, got, ngot);
    KVT_EQ(disk_stats(&d).checksum_errors, 2);
    KVT_EQ(of_holds_all(g2, h, 4), 4);

    /* the bad entries left the disk tier's pool (else every load of them would fail the same way and an
     * offer would skip them as present): the next offer stores them again, and they load */
    KVT_CHECK(!of_has(d.pool, h[1]));
    KVT_CHECK(!of_has(d.pool, h[2]));
    KVT_CHECK(of_has(d.pool, h[0]) && of_has(d.pool, h[3]));
    KVT_EQ(of_stats(d.pool).invalidated, 2);
    OF_CHECK_POOL(d.pool);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 4).transferred, 2);
    for (int k = 1; k <= 2; k++) {
        info = load(d.pool, g1, d.backend, &h[k], 1, got, &ngot);
        KVT_EQ(info.status, KVO_STATUS_COMPLETE);
        KVT_EQ(ngot, 1);
        if (ngot == 1) KVT_CHECK(of_bytes_ok(g1, got[0], h[k]));
        release_all(g1, got, ngot);
    }
    KVT_EQ(disk_stats(&d).checksum_errors, 2);

    OF_CHECK_POOL(g1);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* A transfer's message is about its own failure. Two loads in one backend job, the first block's slot
 * corrupted: that load's message is the disk backend's, naming the slot. Both slots corrupted: the
 * job's one message names the slot of the first failure only, which is the other load's. Before, each
 * container took the job's message, so the first load said "slot <the other's> failed ..."; now a
 * container gets the backend's words only when every failed copy of the job is its own, else the
 * backend's name and its own error. */
static void test_message_of_a_shared_job_is_each_transfers_own(void)
{
    disk d;
    kvb_hash h[4];
    if (!disk_open(&d, 0)) return;
    of_chain(37, 4, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    of_register(g2, h, 4, NULL, NULL);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 4).transferred, 4);
    uint32_t slot[4];
    char name[4][32];
    for (int k = 0; k < 4; k++) {
        slot[k] = disk_index_of(d.pool, h[k]);
        snprintf(name[k], sizeof name[k], "slot %u ", slot[k]);
    }
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, slot[0]) + 4096 + 7);
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, slot[2]) + 4096 + 7);
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, slot[3]) + 4096 + 7);

    kvb_pool *g1 = of_mem_pool(NB, KVB_LAYOUT_LAYER_SEPARATE);
    of_clock clock = {1000000};
    kvo_pipeline_config pc = of_config(d.pool, g1, d.backend, KVO_MODE_POLL, &clock);
    kvo_pipeline *p = of_pipeline(&pc);
    for (int both = 0; both < 2; both++) { /* loads h[0] (bad) with h[1] (good), then h[2] with h[3] (bad) */
        kvo_transfer a, b;
        kvo_pipeline_stats before, after;
        KVT_EQ(kvo_pipeline_get_stats(p, &before), KVO_OK);
        KVT_EQ(kvo_onboard(p, &h[2 * both], 1, NULL, &a), KVO_OK);
        KVT_EQ(kvo_onboard(p, &h[2 * both + 1], 1, NULL, &b), KVO_OK);
        of_pump(p, &clock, a, 1000, 100);
        of_pump(p, &clock, b, 1000, 100);
        KVT_EQ(kvo_pipeline_get_stats(p, &after), KVO_OK);
        KVT_EQ(after.batches - before.batches, 1); /* one job for both */
        kvo_transfer_info ia = of_info(p, a), ib = of_info(p, b);
        KVT_EQ(ia.status, KVO_STATUS_FAILED);
        KVT_EQ(ia.error, KVO_ECHECKSUM);
        KVT_CHECK(ia.message[0] != 0);
        KVT_CHECK(strstr(ia.message, name[2 * both + 1]) == NULL); /* never the other load's slot */
        if (!both) {
            KVT_EQ(ib.status, KVO_STATUS_COMPLETE);
            KVT_EQ(ib.message[0], 0);
            KVT_CHECK(strstr(ia.message, name[0]) != NULL); /* the backend's own words: its slot */
        } else {
            KVT_EQ(ib.status, KVO_STATUS_FAILED);
            KVT_CHECK(strstr(ib.message, name[2]) == NULL);
            KVT_CHECK(strstr(ia.message, "disk") != NULL);
            KVT_CHECK(strstr(ia.message, kvo_result_string(KVO_ECHECKSUM)) != NULL);
        }
        size_t none = 0;
        kvb_block got[1];
        if (ib.status == KVO_STATUS_COMPLETE) {
            KVT_EQ(kvo_transfer_take_blocks(p, b, got, 1, &none), KVO_OK);
            release_all(g1, got, none);
        }
        KVT_EQ(kvo_transfer_release(p, a), KVO_OK);
        KVT_EQ(kvo_transfer_release(p, b), KVO_OK);
    }
    kvo_pipeline_destroy(p);
    KVT_EQ(of_active(g1), 0);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* One load of two blocks whose slots are both corrupted: its message, like its error, is about the
 * first failure. Before, the backend rewrote the job's message at every failed copy, so it named the
 * last slot that failed. */
static void test_message_names_the_first_failure(void)
{
    disk d;
    kvb_hash h[3], ask[2];
    char first[32], last[32];
    if (!disk_open(&d, 0)) return;
    of_chain(41, 3, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    of_register(g2, h, 3, NULL, NULL);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 3).transferred, 3);
    snprintf(first, sizeof first, "slot %u ", disk_index_of(d.pool, h[0]));
    snprintf(last, sizeof last, "slot %u ", disk_index_of(d.pool, h[2]));
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, disk_index_of(d.pool, h[0])) + 4096 + 5);
    flip_byte(d.path, kvo_disk_slot_offset(d.backend, disk_index_of(d.pool, h[2])) + 4096 + 5);
    kvb_pool *g1 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    of_clock clock = {1000000};
    kvo_pipeline_config pc = of_config(d.pool, g1, d.backend, KVO_MODE_POLL, &clock);
    kvo_pipeline *p = of_pipeline(&pc);
    kvo_transfer t;
    ask[0] = h[0];
    ask[1] = h[2]; /* onboarding matches each hash on its own: both are loaded in one job */
    KVT_EQ(kvo_onboard(p, ask, 2, NULL, &t), KVO_OK);
    of_pump(p, &clock, t, 1000, 100);
    kvo_transfer_info info = of_info(p, t);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(info.error, KVO_ECHECKSUM);
    KVT_CHECK(strstr(info.message, first) != NULL);
    KVT_CHECK(strstr(info.message, last) == NULL);
    KVT_EQ(kvo_transfer_release(p, t), KVO_OK);
    kvo_pipeline_destroy(p);
    KVT_EQ(of_active(g1), 0);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* A slot written by kvcache 0.1 (slot format 1: its block hashes differ from 0.2's) is a miss even
 * when it is whole and names the hash asked for. */
static void test_old_format_version_is_a_miss(void)
{
    disk d;
    kvb_hash h[2];
    kvb_block got[MAXN];
    size_t ngot = 0;
    unsigned char hdr[48];
    if (!disk_open(&d, 0)) return;
    of_chain(32, 2, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    of_register(g2, h, 2, NULL, NULL);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 2).transferred, 2);
    uint64_t at = kvo_disk_slot_offset(d.backend, disk_index_of(d.pool, h[1]));
    int fd = open(d.path, O_RDWR);
    KVT_CHECK(fd >= 0);
    if (fd >= 0) { /* version 1, the header's own checksum (bytes 40..47, over 0..39) made right again */
        KVT_EQ(pread(fd, hdr, sizeof hdr, (off_t)at), (ssize_t)sizeof hdr);
        hdr[4] = 1;
        hdr[5] = 0;
        uint64_t sum = kvo_checksum(hdr, 40);
        for (int i = 0; i < 8; i++) hdr[40 + i] = (unsigned char)(sum >> (8 * i));
        KVT_EQ(pwrite(fd, hdr, sizeof hdr, (off_t)at), (ssize_t)sizeof hdr);
        KVT_EQ(fsync(fd), 0);
        close(fd);
    }
    kvb_pool *g1 = of_mem_pool(NB, KVB_LAYOUT_LAYER_SEPARATE);
    kvo_transfer_info info = load(d.pool, g1, d.backend, &h[1], 1, got, &ngot);
    KVT_EQ(info.failed, 1);
    KVT_EQ(ngot, 0);
    KVT_CHECK(!of_has(g1, h[1]));
    KVT_EQ(disk_stats(&d).checksum_errors, 1);
    info = load(d.pool, g1, d.backend, &h[0], 1, got, &ngot); /* the slot beside it, version 2 */
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(ngot, 1);
    if (ngot == 1) KVT_CHECK(of_bytes_ok(g1, got[0], h[0]));
    release_all(g1, got, ngot);
    OF_CHECK_POOL(g1);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* The checksum is stored (disk slots, Redis values): its values are fixed. */
static void test_checksum_function(void)
{
    const char a[] = "kv block bytes", b[] = "kv block bytez";
    unsigned char bytes[1000];
    for (int i = 0; i < 1000; i++) bytes[i] = (unsigned char)(i * 37 + 11);
    KVT_EQ(kvo_checksum(a, sizeof a), UINT64_C(0xf3c5f263144cf655));
    KVT_EQ(kvo_checksum(bytes, 1000), UINT64_C(0x6dc8f1bb05ddbc44));
    KVT_EQ(kvo_checksum(bytes, 77), UINT64_C(0x92361f5297146046));
    KVT_CHECK(kvo_checksum(a, sizeof a) != kvo_checksum(b, sizeof b));
    KVT_CHECK(kvo_checksum(a, sizeof a - 1) != kvo_checksum(a, sizeof a));
}

/* ---- file errors ---- */

static void test_bad_paths_and_config(void)
{
    char dir[64], path[160];
    kvo_backend *b = NULL;
    if (!of_tmpdir(dir, sizeof dir)) KVT_SKIP("cannot make a temp directory");
    kvb_pool *pool = of_meta_pool(8);
    snprintf(path, sizeof path, "%s/no/such/dir/g3.kv", dir);
    log_count lc;
    kvo_disk_config dc = disk_config_for(path, pool, OF_BLOCK_BYTES, &lc);
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_EIO);
    KVT_CHECK(b == NULL);
    KVT_CHECK(strcmp(kvo_result_string(KVO_EIO), "I/O error") == 0);

    snprintf(path, sizeof path, "%s/g3.kv", dir);
    dc.disk_pool = NULL;
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_EINVAL);
    dc.disk_pool = pool;
    dc.block_bytes = 0;
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_EINVAL);
    dc.path = NULL;
    dc.block_bytes = OF_BLOCK_BYTES;
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_EINVAL);
    KVT_CHECK(b == NULL);
    /* a slot's offset: none for no backend, another kind, or a block past the disk pool's 8 (was 0,
     * slot 0's own offset, where a test or tool would then flip bytes) */
    dc.path = path;
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_OK);
    kvo_backend *mem = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    KVT_EQ(kvo_disk_slot_offset(b, 0), 0);
    KVT_CHECK(kvo_disk_slot_offset(b, 7) > kvo_disk_slot_offset(b, 6));
    KVT_EQ(kvo_disk_slot_offset(b, 8), UINT64_MAX);
    KVT_EQ(kvo_disk_slot_offset(NULL, 0), UINT64_MAX);
    KVT_EQ(kvo_disk_slot_offset(mem, 0), UINT64_MAX);
    kvo_backend_destroy(mem);
    kvo_backend_destroy(b);
    unlink(path);
    kvb_pool_destroy(pool);
    KVT_EQ(rmdir(dir), 0);
}

/* The disk pool stands for the file's slots and holds no bytes: one with storage is refused, the
 * reason said through the log, and no file is made. */
static void test_disk_pool_with_storage_refused(void)
{
    char dir[64], path[160];
    kvo_backend *b = NULL;
    log_count lc;
    if (!of_tmpdir(dir, sizeof dir)) KVT_SKIP("cannot make a temp directory");
    snprintf(path, sizeof path, "%s/g3.kv", dir);
    kvb_pool *mem = of_mem_pool(8, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvo_disk_config dc = disk_config_for(path, mem, OF_BLOCK_BYTES, &lc);
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_EINVAL);
    KVT_CHECK(b == NULL);
    KVT_EQ(atomic_load(&lc.calls), 1);
    KVT_CHECK(strstr(lc.last, "metadata-only") != NULL);
    KVT_CHECK(access(path, F_OK) != 0); /* nothing preallocated */
    if (b) kvo_backend_destroy(b);
    unlink(path);
    kvb_pool_destroy(mem);
    KVT_EQ(rmdir(dir), 0);
}

static int g_done_calls;
static void count_done(kvo_copy_job *job, int result, const char *message)
{
    (void)job;
    (void)result;
    (void)message;
    g_done_calls++;
}

/* A memory pool whose blocks are not the slot's block_bytes is refused at submit, both ways, with
 * KVO_ELAYOUT (done not called, nothing read or written): no copy of another size reaches the file. */
static void test_job_of_other_block_bytes_refused(void)
{
    disk d;
    if (!disk_open(&d, 0)) return;
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 4;
    cfg.block_tokens = OF_TOKENS;
    cfg.storage = KVB_STORAGE_HOST;
    cfg.layout = of_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS);
    cfg.layout.page_bytes /= 2; /* half the slot's bytes */
    kvb_pool *half = of_pool_from(&cfg);
    uint32_t src_idx[2] = {0, 1}, dst_idx[2] = {2, 3};
    kvb_hash h[2];
    int results[2] = {1, 1};
    of_chain(5, 2, h);
    kvo_copy_job job;
    memset(&job, 0, sizeof job);
    job.src = half; /* write: memory -> disk */
    job.dst = d.pool;
    job.src_idx = src_idx;
    job.dst_idx = dst_idx;
    job.hashes = h;
    job.n = 2;
    job.results = results;
    job.done = count_done;
    g_done_calls = 0;
    KVT_EQ(d.backend->submit(d.backend, &job), KVO_ELAYOUT);
    job.src = d.pool; /* read: disk -> memory */
    job.dst = half;
    KVT_EQ(d.backend->submit(d.backend, &job), KVO_ELAYOUT);
    KVT_EQ(g_done_calls, 0);
    KVT_EQ(results[0], 1);
    KVT_EQ(results[1], 1);
    kvo_disk_stats st = disk_stats(&d);
    KVT_EQ(st.writes + st.reads + st.bytes_written + st.bytes_read, 0);
    kvb_pool_destroy(half);
    disk_close(&d);
}

/* Runs with the file size limit set to `limit` bytes (SIGXFSZ ignored): writes at or past it fail with
 * EFBIG, as on a full or failing disk. */
typedef struct fsize_guard {
    struct rlimit old;
    void (*old_handler)(int);
} fsize_guard;

static int fsize_limit(fsize_guard *g, rlim_t limit)
{
    struct rlimit lim;
    if (getrlimit(RLIMIT_FSIZE, &g->old) != 0) return 0;
    g->old_handler = signal(SIGXFSZ, SIG_IGN);
    lim = g->old;
    lim.rlim_cur = limit;
    return setrlimit(RLIMIT_FSIZE, &lim) == 0;
}

static void fsize_restore(fsize_guard *g)
{
    setrlimit(RLIMIT_FSIZE, &g->old);
    signal(SIGXFSZ, g->old_handler);
}

/* A file that the disk cannot hold: posix_fallocate on a tmpfs larger than the whole file system fails
 * at once with ENOSPC (nothing is allocated). KVO_ENOSPC, no backend. */
static void test_preallocation_no_space(void)
{
    struct statvfs vs;
    char dir[64], path[160];
    kvo_backend *b = NULL;
    if (statvfs("/dev/shm", &vs) != 0 || vs.f_blocks == 0 || access("/dev/shm", W_OK) != 0)
        KVT_SKIP("no size-limited writable tmpfs at /dev/shm");
    uint64_t fs_bytes = (uint64_t)vs.f_blocks * vs.f_frsize;
    uint64_t block_bytes = UINT64_C(64) << 20;                         /* 64 MiB blocks */
    uint64_t slots = fs_bytes / block_bytes + 16;                      /* more than the fs holds */
    snprintf(dir, sizeof dir, "/dev/shm/kvtest-XXXXXX");
    if (!mkdtemp(dir)) KVT_SKIP("cannot make a directory in /dev/shm");
    snprintf(path, sizeof path, "%s/g3.kv", dir);
    kvb_pool *pool = of_meta_pool((uint32_t)slots);
    log_count lc;
    kvo_disk_config dc = disk_config_for(path, pool, block_bytes, &lc);
    KVT_EQ(kvo_disk_backend_create(&dc, &b), KVO_ENOSPC);
    KVT_CHECK(b == NULL);
    KVT_CHECK(strcmp(kvo_result_string(KVO_ENOSPC), "no space left on the disk") == 0);
    if (b) kvo_backend_destroy(b);
    struct stat sb;
    KVT_CHECK(stat(path, &sb) != 0 || sb.st_blocks * 512 < (long long)block_bytes); /* nothing held */
    unlink(path);
    kvb_pool_destroy(pool);
    KVT_EQ(rmdir(dir), 0);
}

/* The file may not grow (RLIMIT_FSIZE: the kernel answers EFBIG): a clear disk error, no backend. */
static void test_preallocation_refused(void)
{
    char dir[64], path[160];
    kvo_backend *b = NULL;
    fsize_guard g;
    int r;
    if (!of_tmpdir(dir, sizeof dir)) KVT_SKIP("cannot make a temp directory");
    snprintf(path, sizeof path, "%s/g3.kv", dir);
    kvb_pool *pool = of_meta_pool(1024); /* 1024 slots of at least 6 KiB: several MiB */
    log_count lc;
    kvo_disk_config dc = disk_config_for(path, pool, OF_BLOCK_BYTES, &lc);
    if (!fsize_limit(&g, 64 * 1024)) {
        kvb_pool_destroy(pool);
        rmdir(dir);
        KVT_SKIP("cannot lower RLIMIT_FSIZE");
    }
    r = kvo_disk_backend_create(&dc, &b);
    fsize_restore(&g);
    KVT_CHECK(r == KVO_ENOSPC || r == KVO_EIO); /* EFBIG is neither exactly; either is a clear answer */
    KVT_CHECK(b == NULL);
    if (b) kvo_backend_destroy(b);
    unlink(path);
    kvb_pool_destroy(pool);
    KVT_EQ(rmdir(dir), 0);
}

/* Out of memory at each allocation of a create in turn (the workers' queue, threads and arguments
 * included): KVO_ENOMEM, no backend, and no file holding the tier's space is left behind, as for a
 * preallocation that failed. Before, the workers were started after the file was preallocated, so a
 * create that failed there left the whole file (32 MiB here) on the disk. */
static void test_create_out_of_memory_holds_no_space(void)
{
    char dir[64], path[160];
    uint64_t block_bytes = UINT64_C(1) << 20;
    int tries = 0;
    if (!of_tmpdir(dir, sizeof dir)) KVT_SKIP("cannot make a temp directory");
    snprintf(path, sizeof path, "%s/g3.kv", dir);
    kvb_pool *pool = of_meta_pool(NB);
    log_count lc;
    kvo_disk_config dc = disk_config_for(path, pool, block_bytes, &lc);
    dc.threads = 2;
    for (long at = 0; at < 64; at++) {
        kvo_backend *b = NULL;
        struct stat sb;
        oom_arm(at, 0);
        kvo_result r = kvo_disk_backend_create(&dc, &b);
        int fired = oom_fired;
        oom_disarm();
        if (!fired) { /* every allocation of the call was tried */
            KVT_EQ(r, KVO_OK);
            kvo_backend_destroy(b);
            break;
        }
        tries++;
        KVT_EQ(r, KVO_ENOMEM);
        KVT_CHECK(b == NULL);
        if (b) kvo_backend_destroy(b);
        KVT_CHECK(stat(path, &sb) != 0 || (uint64_t)sb.st_blocks * 512 < block_bytes); /* nothing held */
        unlink(path);
    }
    KVT_CHECK(tries >= 4);
    unlink(path);
    kvb_pool_destroy(pool);
    KVT_EQ(rmdir(dir), 0);
}

/* Writes start failing after the file was made: the offload is Failed with a message, the disk tier
 * gets nothing and holds nothing, the host tier keeps every block; once writes work again, a retry
 * succeeds. */
static void test_write_failure_loses_nothing(void)
{
    disk d;
    kvb_hash h[6];
    fsize_guard g;
    if (!disk_open(&d, 0)) return;
    of_chain(41, 6, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_LAYER_SEPARATE);
    of_register(g2, h, 6, NULL, NULL);
    uint32_t disk_active = of_active(d.pool);

    if (!fsize_limit(&g, 0)) {
        kvb_pool_destroy(g2);
        disk_close(&d);
        KVT_SKIP("cannot lower RLIMIT_FSIZE");
    }
    kvo_transfer_info info = offload(g2, d.pool, d.backend, h, 6);
    fsize_restore(&g);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_CHECK(info.error < 0);
    KVT_CHECK(info.failed >= 1);
    KVT_CHECK(info.message[0] != '\0');
    KVT_CHECK(disk_stats(&d).io_errors >= 1);
    KVT_EQ(of_present(d.pool, h, 6), 0);
    KVT_EQ(of_active(d.pool), disk_active);
    OF_CHECK_POOL(d.pool);
    KVT_EQ(of_holds_all(g2, h, 6), 6);
    KVT_EQ(of_active(g2), 0);
    OF_CHECK_POOL(g2);

    info = offload(g2, d.pool, d.backend, h, 6);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, 6);
    KVT_EQ(of_present(d.pool, h, 6), 6);
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* Holds every free block of the disk pool but the one at `index`, so that the next offload lands in that
 * slot; returns how many are held (release them later). */
static size_t hold_all_but(kvb_pool *pool, uint32_t index, kvb_block *held)
{
    size_t n = of_stats(pool).free_blocks, k = 0;
    kvb_block all[NB];
    KVT_CHECK(n <= NB);
    if (n > NB) return 0;
    KVT_EQ(kvb_alloc(pool, n, all), KVB_OK);
    for (size_t i = 0; i < n; i++) {
        if (kvb_block_index(all[i].id) == index) KVT_EQ(kvb_release(pool, &all[i], 1, NULL), KVB_OK);
        else held[k++] = all[i];
    }
    return k;
}

/* A write the kernel cuts short inside a slot (here at the file size limit; under O_DIRECT the cut length
 * is refused with EINVAL) fails that copy and nothing more: it is not an O_DIRECT refusal by the file
 * system, so the backend keeps direct I/O and says nothing, and it goes on with the file it has open,
 * even when that file's path was removed meanwhile. Before, the EINVAL switched the backend to buffered
 * I/O for good with "O_DIRECT refused by the file system" in the log, and reopened the file by its path:
 * a new empty file there, so every block stored before read back as a miss (the fd it closed could be in
 * use by another thread as well). */
static void test_cut_write_is_not_a_direct_io_refusal(void)
{
    disk d;
    kvb_hash h[3];
    kvb_block held[NB], got[MAXN];
    size_t nheld, ngot = 0;
    fsize_guard g;
    if (!disk_open(&d, 0)) return;
    if (!disk_stats(&d).direct_io) {
        disk_close(&d);
        KVT_SKIP("no O_DIRECT on /tmp");
    }
    of_chain(42, 3, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_LAYER_SEPARATE);
    of_register(g2, h, 3, NULL, NULL);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 2).transferred, 2);
    KVT_EQ(unlink(d.path), 0); /* someone removes the file: the backend keeps the one it has open */

    nheld = hold_all_but(d.pool, NB - 1, held);
    uint64_t cut = kvo_disk_slot_offset(d.backend, NB - 1) + 4096 + 100; /* inside the slot's data */
    if (!fsize_limit(&g, (rlim_t)cut)) {
        release_all(d.pool, held, nheld);
        kvb_pool_destroy(g2);
        disk_close(&d);
        KVT_SKIP("cannot lower RLIMIT_FSIZE");
    }
    kvo_transfer_info info = offload(g2, d.pool, d.backend, &h[2], 1);
    fsize_restore(&g);
    release_all(d.pool, held, nheld);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(info.failed, 1);
    KVT_CHECK(!of_has(d.pool, h[2]));
    kvo_disk_stats st = disk_stats(&d);
    KVT_EQ(st.direct_io, 1);
    KVT_EQ(atomic_load(&d.log.calls), 0);

    kvb_pool *g1 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    info = load(d.pool, g1, d.backend, h, 2, got, &ngot); /* stored before: still there */
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(ngot, 2);
    for (size_t i = 0; i < ngot; i++) KVT_CHECK(of_bytes_ok(g1, got[i], h[i]));
    release_all(g1, got, ngot);
    KVT_EQ(offload(g2, d.pool, d.backend, &h[2], 1).transferred, 1); /* and a retry works */
    info = load(d.pool, g1, d.backend, &h[2], 1, got, &ngot);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(ngot, 1);
    if (ngot == 1) KVT_CHECK(of_bytes_ok(g1, got[0], h[2]));
    release_all(g1, got, ngot);
    KVT_EQ(disk_stats(&d).checksum_errors, 0);
    OF_CHECK_POOL(g1);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* The O_DIRECT fallback is said through the log callback; the callback may ask the backend how it
 * stands (kvo_disk_backend_stats: direct_io now 0). Here the backend's first O_DIRECT transfer is a
 * write the kernel cuts at the file size limit (EINVAL): taken, as documented, for a refusal by the file
 * system, so the fallback is said. Before, the backend called the log with its own lock held, so a stats
 * call from the callback waited for ever (here: a helper thread's call, waited for up to 10 s). */
typedef struct stats_from_log {
    kvo_backend *backend;
    atomic_int calls, answered, direct_io;
    pthread_t helper;
    int started;
} stats_from_log;

static void *stats_from_log_helper(void *arg)
{
    stats_from_log *s = (stats_from_log *)arg;
    kvo_disk_stats st;
    memset(&st, 0, sizeof st);
    if (kvo_disk_backend_stats(s->backend, &st) == KVO_OK) atomic_store(&s->direct_io, st.direct_io);
    atomic_store(&s->answered, 1);
    return NULL;
}

static void stats_from_log_cb(void *user, const char *message)
{
    stats_from_log *s = (stats_from_log *)user;
    (void)message;
    if (atomic_fetch_add(&s->calls, 1) != 0 || !s->backend) return;
    s->started = pthread_create(&s->helper, NULL, stats_from_log_helper, s) == 0;
    uint64_t end = of_now_us() + 10000000; /* a stats call that waits for the log's lock waits for ever */
    while (s->started && !atomic_load(&s->answered) && of_now_us() < end) of_sleep_us(1000);
}

static void test_log_callback_may_read_stats(void)
{
    disk d;
    kvb_hash h[1];
    kvb_block held[NB];
    size_t nheld;
    fsize_guard g;
    stats_from_log s;
    memset(&d, 0, sizeof d);
    memset(&s, 0, sizeof s);
    snprintf(d.dir, sizeof d.dir, "/tmp/kvtest-XXXXXX");
    if (!mkdtemp(d.dir)) KVT_SKIP("cannot make a temp directory");
    snprintf(d.path, sizeof d.path, "%s/g3.kv", d.dir);
    d.pool = of_meta_pool(NB);
    kvo_disk_config dc = disk_config(&d, 0, 0);
    dc.log = stats_from_log_cb;
    dc.log_user = &s;
    KVT_EQ(kvo_disk_backend_create(&dc, &d.backend), KVO_OK);
    if (!d.backend) return;
    s.backend = d.backend;
    if (!disk_stats(&d).direct_io) {
        disk_close(&d);
        KVT_SKIP("no O_DIRECT on /tmp");
    }
    of_chain(43, 1, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_LAYER_SEPARATE);
    of_register(g2, h, 1, NULL, NULL);
    nheld = hold_all_but(d.pool, NB - 1, held);
    uint64_t cut = kvo_disk_slot_offset(d.backend, NB - 1) + 4096 + 100; /* inside the slot's data */
    if (!fsize_limit(&g, (rlim_t)cut)) {
        release_all(d.pool, held, nheld);
        kvb_pool_destroy(g2);
        disk_close(&d);
        KVT_SKIP("cannot lower RLIMIT_FSIZE");
    }
    kvo_transfer_info info = offload(g2, d.pool, d.backend, h, 1);
    fsize_restore(&g);
    release_all(d.pool, held, nheld);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(atomic_load(&s.calls), 1);
    KVT_EQ(atomic_load(&s.answered), 1); /* within the callback: the stats call did not wait for it */
    if (s.started) pthread_join(s.helper, NULL);
    KVT_EQ(atomic_load(&s.direct_io), 0);
    KVT_EQ(disk_stats(&d).direct_io, 0);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 1).transferred, 1); /* buffered from now on */
    kvb_pool_destroy(g2);
    disk_close(&d);
}

/* ---- O_DIRECT ---- */

static int direct_supported(const char *dir)
{
    char probe[160];
    snprintf(probe, sizeof probe, "%s/probe", dir);
    int fd = open(probe, O_CREAT | O_RDWR | O_DIRECT, 0600);
    if (fd >= 0) close(fd);
    unlink(probe);
    return fd >= 0;
}

/* O_DIRECT where the file system takes it; otherwise buffered I/O, said exactly once through the log
 * callback however many jobs run; never silent, never a hang. */
static void direct_or_fallback(const char *base)
{
    disk d;
    kvb_hash h[4];
    kvb_block got[MAXN];
    size_t ngot = 0;
    if (!disk_open_in(&d, base, 0, 0)) return;
    int supported = direct_supported(d.dir);
    of_chain(51, 4, h);
    kvb_pool *g2 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    of_register(g2, h, 4, NULL, NULL);
    KVT_EQ(offload(g2, d.pool, d.backend, h, 2).transferred, 2);
    KVT_EQ(offload(g2, d.pool, d.backend, &h[2], 2).transferred, 2);
    kvb_pool *g1 = of_mem_pool(NB, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    KVT_EQ(load(d.pool, g1, d.backend, h, 4, got, &ngot).transferred, 4);
    release_all(g1, got, ngot);
    KVT_EQ(of_holds_all(g1, h, 4), 4);
    kvo_disk_stats st = disk_stats(&d);
    int calls = atomic_load(&d.log.calls);
    printf("     %s: O_DIRECT %s by the fs, backend direct_io=%d, log calls %d%s%s\n", base,
           supported ? "accepted" : "refused", st.direct_io, calls, calls ? ": " : "", calls ? d.log.last : "");
    if (!supported) {
        KVT_EQ(st.direct_io, 0);
        KVT_EQ(calls, 1);
    } else {
        KVT_CHECK(calls <= 1);
        KVT_EQ(calls, st.direct_io ? 0 : 1); /* a fallback is said, direct I/O needs no note */
    }
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    disk_close(&d);

    /* direct = -1: buffered by choice */
    if (!disk_open_in(&d, base, -1, 0)) return;
    KVT_EQ(disk_stats(&d).direct_io, 0);
    KVT_CHECK(atomic_load(&d.log.calls) <= 1);
    disk_close(&d);
}

static void test_direct_io_or_fallback_tmp(void) { direct_or_fallback("/tmp"); }

static void test_direct_io_or_fallback_shm(void)
{
    struct stat sb;
    if (stat("/dev/shm", &sb) != 0 || !S_ISDIR(sb.st_mode) || access("/dev/shm", W_OK) != 0)
        KVT_SKIP("no writable /dev/shm");
    direct_or_fallback("/dev/shm");
}

int main(void)
{
    of_watchdog(120);
    KVT_RUN(test_round_trip_contiguous);
    KVT_RUN(test_round_trip_layer_separate);
    KVT_RUN(test_corrupted_slot_is_a_miss);
    KVT_RUN(test_message_of_a_shared_job_is_each_transfers_own);
    KVT_RUN(test_message_names_the_first_failure);
    KVT_RUN(test_old_format_version_is_a_miss);
    KVT_RUN(test_checksum_function);
    KVT_RUN(test_bad_paths_and_config);
    KVT_RUN(test_disk_pool_with_storage_refused);
    KVT_RUN(test_job_of_other_block_bytes_refused);
    KVT_RUN(test_preallocation_no_space);
    KVT_RUN(test_preallocation_refused);
    KVT_RUN(test_create_out_of_memory_holds_no_space);
    KVT_RUN(test_write_failure_loses_nothing);
    KVT_RUN(test_cut_write_is_not_a_direct_io_refusal);
    KVT_RUN(test_log_callback_may_read_stats);
    KVT_RUN(test_direct_io_or_fallback_tmp);
    KVT_RUN(test_direct_io_or_fallback_shm);
    return kvt_summary();
}
