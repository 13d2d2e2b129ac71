/* The G4 tier of kvremote.h against real Redis servers on loopback (started and stopped here, free
 * ports, one temp directory each, killed by a watchdog if anything hangs):
 * - two engine processes: A offloads a conversation G1 -> G2 -> G4; B, started fresh, finds the
 *   prefix in Redis (kvo_redis_manager_lookup), onboards it, and its bytes equal A's;
 * - a 3-node Redis Cluster: blocks spread over the nodes (routing checked against CLUSTER KEYSLOT), all
 *   read back; a slot resharded by hand is followed through ASK (while migrating) and MOVED (after);
 *   slots assigned after the backend read the map are found (their keys failed for good before); an
 *   import with a node lost imports the prefix found before it and returns the node's error; a MOVED
 *   is followed though the node the map is asked of still names the old owner (scripted nodes);
 * - the server killed mid-batch: the transfer Fails with a clear message, nothing hangs, local tiers
 *   keep working; after a restart transfers resume;
 * - values corrupted with redis-cli (data and header) are misses with checksum errors, never wrong
 *   bytes; a deleted entry and entries Redis evicted under maxmemory are plain misses (and the G4 pool
 *   drops a block whose entry a load found gone, so the next offer stores it again); a whole value
 *   of the other format version (kvcache 0.1) is a miss left in place; a key of ours holding a list is
 *   a damaged entry (a miss, deleted);
 * - tenants with different salts do not see each other's blocks;
 * - AUTH: no password and a wrong one fail create with KVO_EAUTH and a clear message that never holds
 *   the password; the right one from an environment variable works.
 * - the connector (kvsched.h) with kvo_redis_tiers_lookup: a cold engine finds another's blocks in Redis,
 *   loads them through its onboarding pipeline with the bytes intact; when the entries are gone by the
 *   time the load runs, the load lands nothing and the request computes those blocks (a miss).
 * - out of memory in create (no server needed): every allocation failing in turn, once or from then
 *   on, ends in KVO_ENOMEM (or, with the memory there, KVO_ECONNECT), nothing handed out or leaked;
 *   before, a failed string copy freed the clients' uninitialised memory.
 * - the reconnect backoff stops at reconnect_max_ms, past 2^31 ms too (no wrap to a short wait);
 * - scripted servers: a reconnect lost in its AUTH or PING counts one connect failure (no disconnect);
 *   reply data left on a connection after a batch's replies (a stray reply) fails that batch's copies
 *   (KVO_EIO) and drops the connection at once: no stray +OK is taken for a SET's answer.
 * Without redis-server the server tests are skipped with one line. */
#include "oom_hooks.h"
#define KVO_WITH_REDIS
#define KVCACHE_IMPLEMENTATION
#include "kvremote.h"
#include "kvsched.h"
#include "kvtest.h"
#include "offload_fixtures.h"
#include "redis_fixtures.h"

#include <sys/stat.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <ctype.h>

enum { MAXN = 64 };

/* ---- log capture: keeps the output clean and lets tests look for a leaked password -------------- */

typedef struct log_buf {
    pthread_mutex_t mu;
    int lines;
    char text[8192];
} log_buf;

static log_buf g_log = {PTHREAD_MUTEX_INITIALIZER, 0, ""};

static void capture_log(void *user, const char *message)
{
    log_buf *lb = (log_buf *)user;
    pthread_mutex_lock(&lb->mu);
    size_t len = strlen(lb->text);
    if (len + strlen(message) + 2 < sizeof lb->text) snprintf(lb->text + len, sizeof lb->text - len, "%s\n", message);
    lb->lines++;
    pthread_mutex_unlock(&lb->mu);
}

static int log_has(const char *s)
{
    pthread_mutex_lock(&g_log.mu);
    int has = strstr(g_log.text, s) != NULL;
    pthread_mutex_unlock(&g_log.mu);
    return has;
}

/* ---- backends and pipelines --------------------------------------------------------------------- */

static char g_err[512];

static kvo_redis_config rconfig(const char *servers, kvb_pool *g4, uint32_t threads)
{
    kvo_redis_config rc;
    memset(&rc, 0, sizeof rc);
    rc.servers = servers;
    rc.namespace_prefix = "kvtest";
    rc.salt = 42;
    rc.pool = g4;
    rc.layout = of_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS);
    rc.threads = threads;
    rc.connect_timeout_ms = 1000;
    rc.command_timeout_ms = 3000;
    rc.reconnect_min_ms = 50;
    rc.reconnect_max_ms = 200;
    rc.log = capture_log;
    rc.log_user = &g_log;
    rc.error = g_err;
    rc.error_size = sizeof g_err;
    return rc;
}

static kvo_backend *redis_open(const char *servers, kvb_pool *g4, uint32_t threads)
{
    kvo_redis_config rc = rconfig(servers, g4, threads);
    kvo_backend *b = NULL;
    g_err[0] = 0;
    kvo_result r = kvo_redis_backend_create(&rc, &b);
    if (r != KVO_OK) fprintf(stderr, "  redis backend: %s: %s\n", kvo_redis_result_string(r), g_err);
    KVT_EQ(r, KVO_OK);
    return b;
}

static kvo_redis_stats rstats(kvo_backend *b)
{
    kvo_redis_stats s;
    memset(&s, 0, sizeof s);
    KVT_EQ(kvo_redis_backend_stats(b, &s), KVO_OK);
    return s;
}

static void server_addr(int port, char *buf, size_t size) { snprintf(buf, size, "127.0.0.1:%d", port); }

/* Offloads the blocks of `hashes` (registered in from) into `to` (poll mode) until final. */
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

/* Onboards `hashes` from `from` into `to`; the taken blocks (Complete only) go to got, released by the
 * caller. */
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
    if (info.status == KVO_STATUS_COMPLETE) KVT_EQ(kvo_transfer_take_blocks(p, t, got, MAXN, n_got), KVO_OK);
    KVT_EQ(kvo_transfer_release(p, t), KVO_OK);
    kvo_pipeline_destroy(p);
    return info;
}

/* Onboards into a fresh pool and counts the blocks that arrived with the right bytes. */
static size_t read_back(kvb_pool *g4, kvo_backend *b, const kvb_hash *hashes, size_t n, kvo_transfer_info *out)
{
    kvb_pool *g1 = of_mem_pool(MAXN, KVB_LAYOUT_LAYER_SEPARATE);
    kvb_block got[MAXN];
    size_t ngot = 0, good = 0;
    kvo_transfer_info info = load(g4, g1, b, hashes, n, got, &ngot);
    for (size_t i = 0; i < ngot; i++) good += of_bytes_ok(g1, got[i], hashes[i]);
    if (ngot) KVT_EQ(kvb_release(g1, got, ngot, NULL), KVB_OK);
    if (!ngot) good = of_holds_all(g1, hashes, n); /* a Failed transfer leaves what arrived cached */
    OF_CHECK_POOL(g1);
    kvb_pool_destroy(g1);
    if (out) *out = info;
    return good;
}

/* ---- pure functions ----------------------------------------------------------------------------- */

static void test_crc16_and_slots(void)
{
    KVT_EQ(kvo_redis_crc16("123456789", 9), 0x31c3);
    KVT_EQ(kvo_redis_crc16("", 0), 0);
    KVT_EQ(kvo_redis_key_slot("foo", 3), 12182);
    KVT_EQ(kvo_redis_key_slot("bar", 3), 5061);
    KVT_EQ(kvo_redis_key_slot("{user1000}.following", 20), kvo_redis_key_slot("user1000", 8));
    KVT_EQ(kvo_redis_key_slot("{user1000}.followers", 20), kvo_redis_key_slot("user1000", 8));
    KVT_EQ(kvo_redis_key_slot("foo{}{bar}", 10), kvo_redis_crc16("foo{}{bar}", 10) & 16383);
    KVT_EQ(kvo_redis_key_slot("foo{{bar}}zap", 13), kvo_redis_crc16("{bar", 4) & 16383);
    KVT_EQ(kvo_redis_key_slot("foo{bar}{zap}", 13), kvo_redis_key_slot("bar", 3));
    KVT_EQ(kvo_redis_key_slot("{", 1), kvo_redis_crc16("{", 1) & 16383);
    KVT_EQ(kvo_redis_crc16(NULL, 5), 0); /* no bytes (it read through NULL) */
    KVT_EQ(kvo_redis_key_slot(NULL, 5), kvo_redis_key_slot("", 0));
}

static void test_key_format(void)
{
    kvb_hash h = {0x4f0aa23360eabeceull, 0x52360e9a53096b1eull}; /* H7 of kvblock.h section 3 */
    char key[KVO_REDIS_KEY_MAX], tiny[8], prefix[KVO_REDIS_MAX_PREFIX + 2];
    size_t len = kvo_redis_format_key("kvcache", 7, &h, key, sizeof key);
    KVT_CHECK(!strcmp(key, "kvcache:0000000000000007:52360e9a53096b1e4f0aa23360eabece"));
    KVT_EQ(len, strlen(key));
    KVT_EQ(kvo_redis_format_key(NULL, 0, &h, key, sizeof key), strlen("kvcache:") + 16 + 1 + 32);
    KVT_EQ(kvo_redis_format_key("kvcache", 7, &h, tiny, sizeof tiny), 0);
    memset(prefix, 'p', sizeof prefix - 1);
    prefix[sizeof prefix - 1] = 0;
    KVT_EQ(kvo_redis_format_key(prefix, 7, &h, key, sizeof key), 0); /* 129 characters */
    prefix[KVO_REDIS_MAX_PREFIX] = 0;
    KVT_EQ(kvo_redis_format_key(prefix, 7, &h, key, sizeof key), KVO_REDIS_MAX_PREFIX + 50);
    KVT_CHECK(kvo_redis_key_slot(key, strlen(key)) < 16384);
    KVT_CHECK(strstr(kvo_redis_result_string(KVO_EAUTH), "AUTH") != NULL);
    KVT_CHECK(!strcmp(kvo_redis_result_string(KVO_EIO), kvo_result_string(KVO_EIO)));
}

/* No server: create fails fast and says where it looked; bad configs are refused with a reason. */
/* The reconnect backoff: reconnect_min_ms, doubling, and from then on reconnect_max_ms, whatever max a
 * uint32_t holds. Past 2^31 ms the doubling used to wrap (3e9 ms came back as 1.7e9, 2^31 as 0: a
 * reconnect at once). Driven through the helper: the public way is one failed connect per wait. */
static void test_backoff_saturates(void)
{
    KVT_EQ(kvo__rbackoff_next(0, 100, 5000), 100);
    KVT_EQ(kvo__rbackoff_next(100, 100, 5000), 200);
    KVT_EQ(kvo__rbackoff_next(4000, 100, 5000), 5000);
    KVT_EQ(kvo__rbackoff_next(5000, 100, 5000), 5000);
    KVT_EQ(kvo__rbackoff_next(0x80000000u, 100, UINT32_MAX), UINT32_MAX);
    KVT_EQ(kvo__rbackoff_next(3000000000u, 100, UINT32_MAX), UINT32_MAX);
    KVT_EQ(kvo__rbackoff_next(3000000000u, 100, 4000000000u), 4000000000u);
    uint32_t wait = 0, last = 0;
    int rises = 1;
    for (int i = 0; i < 40; i++) {
        wait = kvo__rbackoff_next(wait, 100, UINT32_MAX);
        rises = rises && wait >= last;
        last = wait;
    }
    KVT_CHECK(rises);
    KVT_EQ(wait, UINT32_MAX);
}

static void test_no_server(void)
{
    kvb_pool *g4 = of_meta_pool(16);
    char addr[64];
    kvo_backend *b = (kvo_backend *)1;
    int port = rf_free_port();
    server_addr(port, addr, sizeof addr);
    kvo_redis_config rc = rconfig(addr, g4, 0);
    uint64_t t0 = of_now_us();
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_ECONNECT);
    KVT_CHECK(b == NULL);
    KVT_CHECK(of_now_us() - t0 < 2000000);
    KVT_CHECK(strstr(g_err, "cannot reach") != NULL);
    KVT_CHECK(strstr(g_err, addr) != NULL);

    rc = rconfig("no-port-here", g4, 0);
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    KVT_CHECK(strstr(g_err, "bad server list") != NULL);
    rc = rconfig("redis://default:hunter2-secret@127.0.0.1:6379", g4, 0);
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    KVT_CHECK(strstr(g_err, "credentials") != NULL);
    KVT_CHECK(strstr(g_err, "hunter2-secret") == NULL);
    rc = rconfig(addr, NULL, 0);
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    rc = rconfig(addr, g4, 0);
    rc.layout.page_bytes = (uint64_t)1 << 62; /* x 4 pages wrapped to a block of 0 bytes */
    rc.layout.num_layers = 2;
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    KVT_CHECK(strstr(g_err, "512 MiB") != NULL);
    /* a value is the 64-byte header and the block, and Redis refuses one over 512 MiB
     * (proto-max-bulk-len): a block of 512 MiB could never be stored (every SET reset the connection) */
    rc = rconfig(addr, g4, 0);
    rc.layout.num_layers = 1;
    rc.layout.num_parts = 2;
    rc.layout.page_bytes = (uint64_t)256 << 20;
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    KVT_CHECK(strstr(g_err, "512 MiB") != NULL);
    rc.layout.page_bytes = ((uint64_t)512 << 20) / 2 - KVO_REDIS_HEADER_BYTES / 2; /* value of 512 MiB */
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_ECONNECT);                    /* accepted: no server */
    rc = rconfig(addr, g4, 0);
    rc.password_env = "KVTEST_REDIS_PASSWORD_NOT_SET";
    unsetenv(rc.password_env);
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    KVT_CHECK(strstr(g_err, "KVTEST_REDIS_PASSWORD_NOT_SET") != NULL);
    kvb_pool_destroy(g4);
}

/* ---- two engine processes ----------------------------------------------------------------------- */

enum { CONV_BLOCKS = 8 };

/* The conversation: B's prompt continues A's by two blocks. */
static size_t conversation(size_t blocks, uint32_t extra_tokens, kvb_hash *out)
{
    uint32_t tokens[(CONV_BLOCKS + 2) * OF_TOKENS + OF_TOKENS];
    size_t n = blocks * OF_TOKENS + extra_tokens, got = 0;
    for (size_t i = 0; i < n; i++) tokens[i] = (uint32_t)(1000 + (i * 7919u) % 30011u);
    KVT_EQ(kvb_hash_prompt(tokens, n, OF_TOKENS, NULL, 0, 42, out, CONV_BLOCKS + 2, &got), KVB_OK);
    return got;
}

typedef struct engine {
    kvb_pool *g1, *g2, *g4;
    kvo_backend *mem, *redis;
    kvo_manager *m;
} engine;

static int engine_open(engine *e, int port)
{
    char addr[64];
    memset(e, 0, sizeof *e);
    server_addr(port, addr, sizeof addr);
    e->g1 = of_mem_pool(32, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    e->g2 = of_mem_pool(32, KVB_LAYOUT_LAYER_SEPARATE);
    e->g4 = of_meta_pool(128);
    KVT_EQ(kvo_memcpy_backend_create(0, &e->mem), KVO_OK);
    e->redis = redis_open(addr, e->g4, 1);
    if (!e->redis) return 0;
    kvo_manager_config mc;
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 3;
    mc.pools[0] = e->g1;
    mc.pools[1] = e->g2;
    mc.pools[2] = e->g4;
    mc.down[0] = e->mem;
    mc.down[1] = e->redis;
    mc.up[1] = e->mem;
    mc.up[2] = e->redis;
    mc.pipeline.mode = KVO_MODE_POLL;
    KVT_EQ(kvo_manager_create(&mc, &e->m), KVO_OK);
    return e->m != NULL;
}

static void engine_close(engine *e)
{
    kvo_manager_destroy(e->m);
    kvo_backend_destroy(e->redis);
    kvo_backend_destroy(e->mem);
    kvb_pool *pools[3] = {e->g1, e->g2, e->g4};
    for (int i = 0; i < 3; i++) {
        KVT_EQ(of_active(pools[i]), 0);
        OF_CHECK_POOL(pools[i]);
        kvb_pool_destroy(pools[i]);
    }
}

/* Block b of pool in canonical order (layer, part) into buf (OF_BLOCK_BYTES). */
static void block_bytes(kvb_pool *pool, kvb_block b, unsigned char *buf)
{
    for (uint32_t l = 0; l < OF_LAYERS; l++)
        for (uint32_t q = 0; q < 2; q++, buf += OF_PAGE_BYTES) {
            void *page = NULL;
            KVT_EQ(kvb_block_data(pool, b, l, q, &page), KVB_OK);
            if (page) memcpy(buf, page, OF_PAGE_BYTES);
        }
}

/* Engine A: computes a conversation (random K/V bytes, saved to `file`), offers it to the manager,
 * which moves it G1 -> G2 -> G4 (Redis). */
static void engine_a(int port, const char *file)
{
    engine e;
    kvb_hash h[CONV_BLOCKS + 2], parents[CONV_BLOCKS];
    kvb_block b[CONV_BLOCKS];
    static unsigned char bytes[CONV_BLOCKS][OF_BLOCK_BYTES];
    uint64_t seed = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ of_now_us();
    if (!engine_open(&e, port)) return;
    KVT_EQ(conversation(CONV_BLOCKS, 5, h), CONV_BLOCKS); /* 8 full blocks and 5 tokens */
    KVT_EQ(kvb_alloc(e.g1, CONV_BLOCKS, b), KVB_OK);
    for (size_t i = 0; i < CONV_BLOCKS; i++) {
        for (uint32_t l = 0; l < OF_LAYERS; l++)
            for (uint32_t q = 0; q < 2; q++) {
                unsigned char *page = NULL;
                KVT_EQ(kvb_block_data(e.g1, b[i], l, q, (void **)&page), KVB_OK);
                for (size_t j = 0; page && j < OF_PAGE_BYTES; j++) {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    page[j] = (unsigned char)seed;
                }
            }
        block_bytes(e.g1, b[i], bytes[i]);
        if (i) parents[i] = h[i - 1];
        else memset(&parents[0], 0, sizeof parents[0]);
    }
    KVT_EQ(kvb_register_hashed(e.g1, b, CONV_BLOCKS, h, parents, b), KVB_OK);
    KVT_EQ(kvo_manager_offer(e.m, 0, b, CONV_BLOCKS, NULL), KVO_OK);
    KVT_EQ(kvo_manager_drain(e.m, 10000000), KVO_OK);
    KVT_EQ(kvb_release(e.g1, b, CONV_BLOCKS, NULL), KVB_OK);
    kvo_manager_stats ms;
    KVT_EQ(kvo_manager_get_stats(e.m, &ms), KVO_OK);
    KVT_EQ(ms.down[0].transferred, CONV_BLOCKS);
    KVT_EQ(ms.down[1].transferred, CONV_BLOCKS);
    KVT_EQ(rstats(e.redis).puts, CONV_BLOCKS);
    KVT_EQ(of_present(e.g4, h, CONV_BLOCKS), CONV_BLOCKS);
    FILE *f = fopen(file, "wb");
    KVT_CHECK(f != NULL);
    if (f) {
        KVT_EQ(fwrite(bytes, 1, sizeof bytes, f), sizeof bytes);
        fclose(f);
    }
    printf("engine A (pid %d): offloaded %d blocks G1 -> G2 -> G4\n", (int)getpid(), CONV_BLOCKS);
    engine_close(&e);
}

/* Engine B: fresh pools; its prompt continues A's. The longest prefix comes from G4, is onboarded, and
 * the bytes are A's. */
static void engine_b(int port, const char *file)
{
    engine e;
    kvb_hash h[CONV_BLOCKS + 2];
    uint8_t tier_of[CONV_BLOCKS + 2];
    static unsigned char want[CONV_BLOCKS][OF_BLOCK_BYTES];
    unsigned char have[OF_BLOCK_BYTES];
    size_t found = 99, ngot = 0;
    kvb_block got[CONV_BLOCKS + 2];
    kvo_transfer t;
    FILE *f = fopen(file, "rb");
    KVT_CHECK(f != NULL);
    if (!f) return;
    KVT_EQ(fread(want, 1, sizeof want, f), sizeof want);
    fclose(f);
    if (!engine_open(&e, port)) return;
    KVT_EQ(conversation(CONV_BLOCKS + 2, 3, h), CONV_BLOCKS + 2);
    KVT_EQ(kvo_manager_lookup(e.m, h, CONV_BLOCKS + 2, tier_of, &found), KVO_OK);
    KVT_EQ(found, 0); /* cold local tiers */
    KVT_EQ(kvo_redis_manager_lookup(e.m, e.redis, h, CONV_BLOCKS + 2, tier_of, &found), KVO_OK);
    KVT_EQ(found, CONV_BLOCKS);
    for (size_t i = 0; i < found; i++) KVT_EQ(tier_of[i], 2);
    KVT_EQ(rstats(e.redis).imported, CONV_BLOCKS);
    KVT_EQ(kvo_manager_onboard(e.m, 2, h, found, &t), KVO_OK);
    kvo_pipeline *up = kvo_manager_pipeline(e.m, 2, 1);
    KVT_EQ(kvo_transfer_wait(up, t, 10000000, NULL), KVO_OK);
    kvo_transfer_info info = of_info(up, t);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, CONV_BLOCKS);
    KVT_EQ(kvo_transfer_take_blocks(up, t, got, CONV_BLOCKS + 2, &ngot), KVO_OK);
    KVT_EQ(ngot, CONV_BLOCKS);
    size_t equal = 0;
    for (size_t i = 0; i < ngot; i++) {
        block_bytes(e.g1, got[i], have);
        equal += !memcmp(have, want[i], OF_BLOCK_BYTES);
    }
    KVT_EQ(equal, CONV_BLOCKS);
    KVT_EQ(kvo_transfer_release(up, t), KVO_OK);
    if (ngot) KVT_EQ(kvb_release(e.g1, got, ngot, NULL), KVB_OK);
    kvo_redis_stats rs = rstats(e.redis);
    KVT_EQ(rs.gets, CONV_BLOCKS);
    KVT_EQ(rs.checksum_errors, 0);
    printf("engine B (pid %d): prefix hit %zu of %d blocks from G4, onboarded, %zu equal to A's bytes\n",
           (int)getpid(), found, CONV_BLOCKS + 2, equal);
    engine_close(&e);
}

/* Runs this program again as an engine; its exit status. */
static int run_engine(const char *role, int port, const char *file)
{
    char portbuf[16];
    snprintf(portbuf, sizeof portbuf, "%d", port);
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        char *argv[] = {(char *)"/proc/self/exe", (char *)role, portbuf, (char *)file, NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    int status = 0;
    rf__track(pid, 1);
    waitpid(pid, &status, 0);
    rf__track(pid, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_two_processes(void)
{
    rf_server s;
    char file[128];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    snprintf(file, sizeof file, "%s/a.bytes", s.dir);
    KVT_EQ(run_engine("engine-a", s.port, file), 0);
    KVT_EQ(rf_int(s.port, NULL, "DBSIZE"), CONV_BLOCKS);
    KVT_EQ(run_engine("engine-b", s.port, file), 0);
    unlink(file);
    rf_stop(&s);
}

/* ---- Redis Cluster ------------------------------------------------------------------------------ */

static redisReply *cmd_argv(int port, int argc, const char **argv)
{
    redisContext *c = rf_connect(port, NULL);
    redisReply *r;
    if (!c) return NULL;
    r = (redisReply *)redisCommandArgv(c, argc, argv, NULL);
    redisFree(c);
    return r;
}

static int reply_ok(redisReply *r)
{
    int ok = r && r->type == REDIS_REPLY_STATUS;
    if (r && !ok) fprintf(stderr, "  redis: %s\n", r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
    if (r) freeReplyObject(r);
    return ok;
}

static void node_id(int port, char *buf, size_t size)
{
    redisReply *r = rf_cmd(port, NULL, "CLUSTER MYID");
    snprintf(buf, size, "%s", r && r->type == REDIS_REPLY_STRING ? r->str : "");
    if (r) freeReplyObject(r);
}

enum { CHAINS = 6, CHAIN_LEN = 8, ALL = CHAINS * CHAIN_LEN };

static void test_cluster(void)
{
    rf_server n[3];
    char seeds[128], key[KVO_REDIS_KEY_MAX];
    kvb_hash h[ALL];
    memset(n, 0, sizeof n);
    if (!rf_cluster_start(n)) {
        KVT_CHECK(!"the 3-node cluster did not come up");
        for (int i = 0; i < 3; i++) rf_stop(&n[i]);
        return;
    }
    /* two of the three nodes as seeds: the third is found through CLUSTER SLOTS */
    snprintf(seeds, sizeof seeds, "redis://127.0.0.1:%d, 127.0.0.1:%d", n[1].port, n[2].port);
    kvb_pool *g1 = of_mem_pool(ALL, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(128);
    kvo_backend *b = redis_open(seeds, g4, 1); /* one worker: its slot map is the one that goes stale */
    if (!b) goto out;
    KVT_EQ(rstats(b).cluster, 1);
    for (int c = 0; c < CHAINS; c++) {
        of_chain(100 + (uint64_t)c, CHAIN_LEN, &h[c * CHAIN_LEN]);
        of_register(g1, &h[c * CHAIN_LEN], CHAIN_LEN, NULL, NULL);
    }
    kvo_transfer_info info = offload(g1, g4, b, h, ALL);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, ALL);

    /* spread: every node holds some, together all; our slots are the server's */
    long long total = 0;
    for (int i = 0; i < 3; i++) {
        long long keys = rf_int(n[i].port, NULL, "DBSIZE");
        KVT_CHECK(keys > 0);
        total += keys;
    }
    KVT_EQ(total, ALL);
    KVT_EQ(rstats(b).nodes, 3);
    size_t same_slot = 0;
    for (size_t i = 0; i < ALL; i++) {
        kvo_redis_key(b, &h[i], key, sizeof key);
        redisReply *r = rf_cmd(n[0].port, NULL, "CLUSTER KEYSLOT %s", key);
        same_slot += r && r->type == REDIS_REPLY_INTEGER && r->integer == kvo_redis_key_slot(key, strlen(key));
        if (r) freeReplyObject(r);
    }
    KVT_EQ(same_slot, ALL);
    KVT_EQ(read_back(g4, b, h, ALL, &info), ALL);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    size_t prefix = 0;
    KVT_EQ(kvo_redis_lookup(b, h, CHAIN_LEN, &prefix), KVO_OK);
    KVT_EQ(prefix, CHAIN_LEN);

    /* reshard the slot of block 0 to another node, by hand */
    kvo_redis_key(b, &h[0], key, sizeof key);
    int slot = kvo_redis_key_slot(key, strlen(key)), from = -1;
    for (int i = 0; i < 3; i++) {
        if (rf_int(n[i].port, NULL, "CLUSTER COUNTKEYSINSLOT %d", slot) > 0) from = i;
    }
    KVT_CHECK(from >= 0);
    if (from < 0) goto out;
    int to = (from + 1) % 3;
    char id_from[64], id_to[64], slotbuf[16], portbuf[16];
    node_id(n[from].port, id_from, sizeof id_from);
    node_id(n[to].port, id_to, sizeof id_to);
    snprintf(slotbuf, sizeof slotbuf, "%d", slot);
    snprintf(portbuf, sizeof portbuf, "%d", n[to].port);
    const char *importing[] = {"CLUSTER", "SETSLOT", slotbuf, "IMPORTING", id_from};
    const char *migrating[] = {"CLUSTER", "SETSLOT", slotbuf, "MIGRATING", id_to};
    KVT_CHECK(reply_ok(cmd_argv(n[to].port, 5, importing)));
    KVT_CHECK(reply_ok(cmd_argv(n[from].port, 5, migrating)));
    redisReply *keys = rf_cmd(n[from].port, NULL, "CLUSTER GETKEYSINSLOT %d 1000", slot);
    KVT_CHECK(keys && keys->type == REDIS_REPLY_ARRAY && keys->elements >= 1);
    if (keys && keys->type == REDIS_REPLY_ARRAY && keys->elements >= 1) {
        const char *mig[64] = {"MIGRATE", "127.0.0.1", portbuf, "", "0", "5000", "KEYS"};
        int argc = 7;
        for (size_t i = 0; i < keys->elements && argc < 64; i++) mig[argc++] = keys->element[i]->str;
        KVT_CHECK(reply_ok(cmd_argv(n[from].port, argc, mig)));
    }
    if (keys) freeReplyObject(keys);

    /* while migrating: the old owner answers ASK, the backend asks the new one */
    kvo_redis_stats before = rstats(b);
    KVT_EQ(read_back(g4, b, h, ALL, &info), ALL);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_CHECK(rstats(b).ask > before.ask);

    /* migration done: every node says the new owner; the backend's map is stale and MOVED fixes it */
    const char *node_cmd[] = {"CLUSTER", "SETSLOT", slotbuf, "NODE", id_to};
    KVT_CHECK(reply_ok(cmd_argv(n[to].port, 5, node_cmd)));
    KVT_CHECK(reply_ok(cmd_argv(n[from].port, 5, node_cmd)));
    KVT_CHECK(reply_ok(cmd_argv(n[3 - from - to].port, 5, node_cmd)));
    before = rstats(b);
    KVT_EQ(read_back(g4, b, h, ALL, &info), ALL);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    kvo_redis_stats after = rstats(b);
    KVT_CHECK(after.moved > before.moved);
    KVT_CHECK(after.slot_refreshes > before.slot_refreshes);
    /* and the control connections (lookups) follow too */
    KVT_EQ(kvo_redis_lookup(b, h, CHAIN_LEN, &prefix), KVO_OK);
    KVT_EQ(prefix, CHAIN_LEN);
    KVT_EQ(after.checksum_errors + after.io_errors + after.misses, 0);
out:
    kvo_backend_destroy(b);
    KVT_EQ(of_active(g4), 0);
    OF_CHECK_POOL(g4);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    for (int i = 0; i < 3; i++) rf_stop(&n[i]);
}

/* A cluster whose slots are assigned after the backend first read the map (engines started while the
 * cluster is still being set up): keys of a slot the map gave no node fail while no node serves it, then
 * work once the cluster serves it, for the worker's connections (jobs) and the control ones (lookups).
 * The map used to be asked again only after a MOVED or a lost connection, neither of which an unserved
 * slot ever gives: its keys failed for good. */
static void test_cluster_slots_assigned_later(void)
{
    rf_server n[3];
    char seeds[64];
    kvb_hash h[8];
    memset(n, 0, sizeof n);
    for (int i = 0; i < 3; i++)
        if (!rf_start_on(&n[i], 0, 1, NULL)) {
            KVT_CHECK(!"a cluster node did not start");
            for (int j = 0; j < 3; j++) rf_stop(&n[j]);
            return;
        }
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", n[0].port);
    kvb_pool *g1 = of_mem_pool(16, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(16);
    kvo_backend *b = redis_open(seeds, g4, 1); /* cluster support on, no slot assigned yet */
    if (!b) goto out;
    KVT_EQ(rstats(b).cluster, 1);
    of_chain(31, 8, h);
    of_register(g1, h, 8, NULL, NULL);
    kvo_transfer_info info = offload(g1, g4, b, h, 8);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(info.error, KVO_EREMOTE);
    KVT_CHECK(strstr(info.message, "no cluster node serves slot") != NULL);
    size_t prefix = 99;
    KVT_EQ(kvo_redis_lookup(b, h, 8, &prefix), KVO_EREMOTE);
    KVT_EQ(prefix, 0);

    KVT_CHECK(rf_cluster_create(n));
    info = offload(g1, g4, b, h, 8);
    if (info.status != KVO_STATUS_COMPLETE) fprintf(stderr, "  offload: %s\n", info.message);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
    KVT_EQ(info.transferred, 8);
    KVT_EQ(kvo_redis_lookup(b, h, 8, &prefix), KVO_OK);
    KVT_EQ(prefix, 8);
    KVT_EQ(read_back(g4, b, h, 8, &info), 8);
    KVT_EQ(info.status, KVO_STATUS_COMPLETE);
out:
    kvo_backend_destroy(b);
    OF_CHECK_POOL(g4);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    for (int i = 0; i < 3; i++) rf_stop(&n[i]);
}

/* A worker's connections learn the cluster's map on their first job: when no node can be asked then
 * (the whole cluster down), that job's copies fail with KVO_EIO and a reason naming a server, as lost
 * connections do (they used to fail with KVO_EREMOTE "no cluster node serves slot", counted as remote
 * errors, though nothing had said so). */
static void test_cluster_unreachable_worker(void)
{
    rf_server n[3];
    char seeds[64];
    kvb_hash h[4];
    memset(n, 0, sizeof n);
    if (!rf_cluster_start(n)) {
        KVT_CHECK(!"the 3-node cluster did not come up");
        for (int i = 0; i < 3; i++) rf_stop(&n[i]);
        return;
    }
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d,127.0.0.1:%d", n[0].port, n[1].port);
    kvb_pool *g1 = of_mem_pool(8, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(8);
    kvo_backend *b = redis_open(seeds, g4, 1);
    if (!b) goto out;
    of_chain(41, 4, h);
    of_register(g1, h, 4, NULL, NULL);
    for (int i = 0; i < 3; i++) rf_kill(&n[i]);
    kvo_transfer_info info = offload(g1, g4, b, h, 4);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(info.failed, 4);
    KVT_EQ(info.error, KVO_EIO);
    KVT_CHECK(strstr(info.message, "no cluster node reachable") != NULL);
    if (!strstr(info.message, "cannot connect")) fprintf(stderr, "  message: %s\n", info.message);
    KVT_CHECK(strstr(info.message, "cannot connect") != NULL);
    kvo_redis_stats rs = rstats(b);
    KVT_EQ(rs.io_errors, 4);
    KVT_EQ(rs.remote_errors, 0);
out:
    kvo_backend_destroy(b);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    for (int i = 0; i < 3; i++) rf_stop(&n[i]);
}

/* A cluster node lost while a conversation's blocks are imported: the blocks found on the nodes still
 * up before the first one it held are imported, and the import says the answer may be short (the lost
 * node's KVO_EIO, as kvo_redis_lookup does), with *out_n counting what it imported. It used to return
 * KVO_OK whenever some prefix was found, so a caller could not tell "Redis has only these" from "Redis
 * could not be asked about the rest". */
static void test_cluster_import_node_lost(void)
{
    rf_server n[3];
    char seeds[96], key[KVO_REDIS_KEY_MAX];
    kvb_hash h[CHAIN_LEN];
    int owner[CHAIN_LEN];
    size_t k = 0, prefix = 99, known = 99;
    memset(n, 0, sizeof n);
    if (!rf_cluster_start(n)) {
        KVT_CHECK(!"the 3-node cluster did not come up");
        for (int i = 0; i < 3; i++) rf_stop(&n[i]);
        return;
    }
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d", n[0].port, n[1].port, n[2].port);
    kvb_pool *g1 = of_mem_pool(CHAIN_LEN, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(16);
    kvb_pool *fresh = of_meta_pool(16);
    kvo_backend *b = redis_open(seeds, g4, 0);
    if (!b) goto out;
    of_chain(51, CHAIN_LEN, h);
    of_register(g1, h, CHAIN_LEN, NULL, NULL);
    KVT_EQ(offload(g1, g4, b, h, CHAIN_LEN).status, KVO_STATUS_COMPLETE);
    /* the first block held by another node than block 0's: its node goes */
    for (size_t i = 0; i < CHAIN_LEN; i++) {
        kvo_redis_key(b, &h[i], key, sizeof key);
        owner[i] = -1;
        for (int j = 0; j < 3; j++)
            if (rf_int(n[j].port, NULL, "EXISTS %s", key) == 1) owner[i] = j;
        KVT_CHECK(owner[i] >= 0);
        if (!k && owner[i] != owner[0]) k = i;
    }
    KVT_CHECK(k > 0);
    if (!k) goto out;
    rf_kill(&n[owner[k]]);

    KVT_EQ(kvo_redis_lookup(b, h, CHAIN_LEN, &prefix), KVO_EIO);
    KVT_EQ(prefix, k);
    KVT_EQ(kvo_redis_import(b, fresh, h, NULL, CHAIN_LEN, &known), KVO_EIO);
    KVT_EQ(known, k);
    KVT_EQ(of_present(fresh, h, CHAIN_LEN), k);
    KVT_EQ(rstats(b).imported, k);
    OF_CHECK_POOL(fresh);
out:
    kvo_backend_destroy(b);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    kvb_pool_destroy(fresh);
    for (int i = 0; i < 3; i++) rf_stop(&n[i]);
}

/* ---- faults ------------------------------------------------------------------------------------- */

static kvo_status wait_final(kvo_pipeline *p, kvo_transfer t, uint64_t timeout_us)
{
    kvo_status st = KVO_STATUS_EVALUATING;
    kvo_result r = kvo_transfer_wait(p, t, (int64_t)timeout_us, &st);
    KVT_EQ(r, KVO_OK);
    return st;
}

static kvo_transfer enqueue_all(kvo_pipeline *p, kvb_pool *from, const kvb_hash *hashes, size_t n)
{
    kvb_block strong[MAXN];
    kvb_weak weak[MAXN];
    size_t found = 0;
    KVT_EQ(kvb_match(from, hashes, n, strong, &found), KVB_OK);
    KVT_EQ(found, n);
    for (size_t i = 0; i < found; i++) weak[i] = kvb_weak_of(strong[i]);
    kvo_transfer t = of_enqueue(p, weak, found, NULL);
    KVT_EQ(kvb_release(from, strong, found, NULL), KVB_OK);
    return t;
}

static void test_kill_and_restart(void)
{
    rf_server s;
    char addr[64], portstr[16];
    kvb_hash warm[4], h[16], local[4];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    snprintf(portstr, sizeof portstr, ":%d", s.port);
    kvb_pool *g1 = of_mem_pool(16, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvb_pool *g2 = of_mem_pool(32, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(64);
    kvo_backend *b = redis_open(addr, g4, 1), *mem = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    kvo_pipeline *down = NULL, *local_p = NULL;
    of_backend *spy = NULL;
    if (!b) goto out;
    of_chain(7, 4, warm);
    of_chain(8, 16, h);
    of_chain(9, 4, local);
    of_register(g2, warm, 4, NULL, NULL);
    of_register(g2, h, 16, NULL, NULL);
    of_register(g1, local, 4, NULL, NULL);
    spy = of_backend_wrap(b); /* counts the copies the Redis backend got */
    kvo_pipeline_config pc = of_config(g2, g4, of_backend_iface(spy), KVO_MODE_THREADS, NULL);
    pc.min_batch = 1;
    pc.flush_interval_us = 1000;
    down = of_pipeline(&pc);
    kvo_pipeline_config lc = of_config(g1, g2, mem, KVO_MODE_THREADS, NULL);
    lc.min_batch = 1;
    lc.flush_interval_us = 1000;
    local_p = of_pipeline(&lc);
    if (!down || !local_p) goto out;

    /* warm: the connection is up */
    kvo_transfer t = enqueue_all(down, g2, warm, 4);
    KVT_EQ(wait_final(down, t, 5000000), KVO_STATUS_COMPLETE);
    KVT_EQ(kvo_transfer_release(down, t), KVO_OK);

    /* the server freezes, the batch goes out, the server dies with it in flight */
    kill(s.pid, SIGSTOP);
    t = enqueue_all(down, g2, h, 16);
    uint64_t end = of_now_us() + 3000000;
    while (of_status(down, t) != KVO_STATUS_TRANSFERRING && of_now_us() < end) of_sleep_us(1000);
    KVT_EQ(of_status(down, t), KVO_STATUS_TRANSFERRING);
    while (of_backend_copies(spy) < 4 + 16 && of_now_us() < end) of_sleep_us(1000);
    KVT_EQ(of_backend_copies(spy), 4 + 16); /* the backend has the batch; the frozen server holds it */
    of_sleep_us(50000);
    rf_kill(&s);
    uint64_t t0 = of_now_us();
    KVT_EQ(wait_final(down, t, 5000000), KVO_STATUS_FAILED);
    KVT_CHECK(of_now_us() - t0 < 2000000); /* no hang: the loss is seen at once */
    kvo_transfer_info info = of_info(down, t);
    KVT_EQ(info.failed, 16);
    KVT_EQ(info.transferred, 0);
    KVT_EQ(info.error, KVO_EIO);
    KVT_CHECK(strstr(info.message, "connection lost mid-batch") != NULL);
    KVT_CHECK(strstr(info.message, portstr) != NULL);
    KVT_EQ(kvo_transfer_release(down, t), KVO_OK);
    KVT_EQ(of_present(g4, h, 16), 0);
    KVT_CHECK(log_has("connection lost"));

    /* local tiers keep working: G2 intact, G1 -> G2 still copies */
    KVT_EQ(of_holds_all(g2, h, 16), 16);
    t = enqueue_all(local_p, g1, local, 4);
    KVT_EQ(wait_final(local_p, t, 5000000), KVO_STATUS_COMPLETE);
    KVT_EQ(kvo_transfer_release(local_p, t), KVO_OK);
    KVT_EQ(of_holds_all(g2, local, 4), 4);

    /* while down: jobs and lookups fail fast, with a reason */
    t0 = of_now_us();
    t = enqueue_all(down, g2, h, 16);
    KVT_EQ(wait_final(down, t, 5000000), KVO_STATUS_FAILED);
    info = of_info(down, t);
    KVT_CHECK(strstr(info.message, portstr) != NULL);
    KVT_EQ(kvo_transfer_release(down, t), KVO_OK);
    size_t prefix = 99;
    KVT_EQ(kvo_redis_lookup(b, warm, 4, &prefix), KVO_EIO);
    KVT_EQ(prefix, 0);
    KVT_CHECK(of_now_us() - t0 < 2000000);

    /* restart on the same port: after the backoff, transfers resume */
    KVT_CHECK(rf_start_on(&s, s.port, 0, NULL));
    int attempts = 0;
    kvo_status st = KVO_STATUS_FAILED;
    for (end = of_now_us() + 5000000; st != KVO_STATUS_COMPLETE && of_now_us() < end; attempts++) {
        t = enqueue_all(down, g2, h, 16);
        st = wait_final(down, t, 5000000);
        KVT_EQ(kvo_transfer_release(down, t), KVO_OK);
        if (st != KVO_STATUS_COMPLETE) of_sleep_us(50000);
    }
    KVT_EQ(st, KVO_STATUS_COMPLETE);
    KVT_CHECK(attempts <= 10);
    KVT_EQ(of_present(g4, h, 16), 16);
    KVT_EQ(read_back(g4, b, h, 16, NULL), 16);
    KVT_CHECK(log_has("connected again"));
    kvo_redis_stats rs = rstats(b);
    KVT_CHECK(rs.io_errors >= 16);
    KVT_CHECK(rs.disconnects >= 1);
    KVT_CHECK(rs.connects >= 2);
    /* the warm blocks went with the old server: known in G4, gone in Redis: a miss, not a hang */
    kvo_transfer_info li;
    KVT_EQ(read_back(g4, b, warm, 4, &li), 0);
    KVT_EQ(li.status, KVO_STATUS_FAILED);
    KVT_EQ(li.error, KVO_ENOTFOUND);
out:
    kvo_pipeline_destroy(down);
    kvo_pipeline_destroy(local_p);
    if (spy) kvo_backend_destroy(of_backend_iface(spy));
    kvo_backend_destroy(b);
    kvo_backend_destroy(mem);
    OF_CHECK_POOL(g2);
    OF_CHECK_POOL(g4);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g2);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

static int cli(int port, const char *a1, const char *a2, const char *a3, const char *a4)
{
    char portbuf[16];
    snprintf(portbuf, sizeof portbuf, "%d", port);
    const char *argv[] = {"redis-cli", "-h", "127.0.0.1", "-p", portbuf, a1, a2, a3, a4, NULL};
    return rf_run(argv, NULL, 5000);
}

static long long exists(int port, const char *key)
{
    redisReply *r = rf_cmd(port, NULL, "EXISTS %s", key);
    long long v = r && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r) freeReplyObject(r);
    return v;
}

/* Values damaged with redis-cli, a deleted entry; then tenants and expiry. */
static void test_corrupt_and_tenants(void)
{
    rf_server s;
    char addr[64], k2[KVO_REDIS_KEY_MAX], k4[KVO_REDIS_KEY_MAX], k5[KVO_REDIS_KEY_MAX];
    kvb_hash h[6];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *g1 = of_mem_pool(16, KVB_LAYOUT_LAYER_SEPARATE), *g4 = of_meta_pool(64), *g4o = of_meta_pool(8);
    kvo_backend *b = redis_open(addr, g4, 0), *other = NULL;
    if (!b) goto out;
    of_chain(11, 6, h);
    of_register(g1, h, 6, NULL, NULL);
    kvo_transfer_info info = offload(g1, g4, b, h, 6);
    KVT_EQ(info.transferred, 6);
    kvo_redis_key(b, &h[2], k2, sizeof k2);
    kvo_redis_key(b, &h[4], k4, sizeof k4);
    kvo_redis_key(b, &h[5], k5, sizeof k5);
    KVT_EQ(cli(s.port, "SETRANGE", k2, "100", "XYZ"), 0); /* in the data */
    KVT_EQ(cli(s.port, "SETRANGE", k4, "0", "JUNK"), 0);  /* in the header */
    KVT_EQ(cli(s.port, "DEL", k5, NULL, NULL), 0);        /* as if Redis evicted it */

    /* lookups read headers: the junk header ends the prefix there and counts */
    size_t prefix = 0;
    KVT_EQ(kvo_redis_lookup(b, h, 6, &prefix), KVO_OK);
    KVT_EQ(prefix, 4);
    KVT_EQ(rstats(b).checksum_errors, 1);

    /* reads: damaged values and the missing one are misses; what arrives is right */
    kvb_pool *dst = of_mem_pool(16, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvb_block got[MAXN];
    size_t ngot = 0;
    info = load(g4, dst, b, h, 6, got, &ngot);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(info.transferred, 3);
    KVT_EQ(info.failed, 3);
    KVT_CHECK(strstr(info.message, "checksum") != NULL);
    KVT_EQ(of_holds(dst, h[0]), 1);
    KVT_EQ(of_holds(dst, h[1]), 1);
    KVT_EQ(of_holds(dst, h[3]), 1);
    KVT_EQ(of_has(dst, h[2]), 0);
    KVT_EQ(of_has(dst, h[4]), 0);
    KVT_EQ(of_has(dst, h[5]), 0);
    OF_CHECK_POOL(dst);
    kvb_pool_destroy(dst);
    kvo_redis_stats rs = rstats(b);
    KVT_EQ(rs.checksum_errors, 3);
    KVT_EQ(rs.misses, 1);
    KVT_EQ(rs.gets, 3);
    KVT_CHECK(log_has("failed its header or checksum check"));
    /* the damaged entries are gone, so no reader meets them again: from Redis, and from the G4 pool
     * (kvb_invalidate after the load), so the next offer stores them again; so is the deleted one,
     * from the G4 pool (test_lost_entry_dropped) */
    KVT_EQ(exists(s.port, k2), 0);
    KVT_EQ(exists(s.port, k4), 0);
    KVT_EQ(of_has(g4, h[2]), 0);
    KVT_EQ(of_has(g4, h[4]), 0);
    KVT_EQ(of_has(g4, h[5]), 0);
    KVT_EQ(of_stats(g4).invalidated, 3);
    KVT_EQ(kvo_redis_lookup(b, h, 6, &prefix), KVO_OK);
    KVT_EQ(prefix, 2);

    /* import: a fresh G4 view learns the prefix Redis holds */
    kvb_pool *fresh = of_meta_pool(8);
    size_t known = 0;
    KVT_EQ(kvo_redis_import(b, fresh, h, NULL, 6, &known), KVO_OK);
    KVT_EQ(known, 2);
    KVT_EQ(of_present(fresh, h, 6), 2);
    KVT_EQ(kvo_redis_import(b, fresh, h, NULL, 6, &known), KVO_OK); /* again: nothing new */
    KVT_EQ(of_stats(fresh).registrations, 2);
    OF_CHECK_POOL(fresh);
    kvb_pool_destroy(fresh);

    /* tenants: another salt, same server, same hashes: nothing; its own entries expire (ttl_s) */
    kvo_redis_config rc = rconfig(addr, g4o, 0);
    rc.salt = 43;
    rc.ttl_s = 60;
    KVT_EQ(kvo_redis_backend_create(&rc, &other), KVO_OK);
    if (other) {
        KVT_EQ(kvo_redis_lookup(other, h, 2, &prefix), KVO_OK);
        KVT_EQ(prefix, 0);
        char ko[KVO_REDIS_KEY_MAX], kb[KVO_REDIS_KEY_MAX];
        kvo_redis_key(other, &h[0], ko, sizeof ko);
        kvo_redis_key(b, &h[0], kb, sizeof kb);
        KVT_CHECK(strcmp(ko, kb) != 0);
        KVT_EQ(offload(g1, g4o, other, h, 2).transferred, 2);
        KVT_EQ(kvo_redis_lookup(other, h, 6, &prefix), KVO_OK);
        KVT_EQ(prefix, 2);
        long long ttl = rf_int(s.port, NULL, "TTL %s", ko);
        KVT_CHECK(ttl > 0 && ttl <= 60);
        KVT_EQ(rf_int(s.port, NULL, "TTL %s", kb), -1); /* no expiry by default */
    }
    KVT_EQ(kvo_redis_lookup(b, h, 6, &prefix), KVO_OK);
    KVT_EQ(prefix, 2);
out:
    kvo_backend_destroy(other);
    kvo_backend_destroy(b);
    OF_CHECK_POOL(g4);
    OF_CHECK_POOL(g4o);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    kvb_pool_destroy(g4o);
    rf_stop(&s);
}

/* A key of ours holding another type than a string (written by something else under the namespace):
 * damaged like a bad value, so a miss counted as a checksum error in lookups and reads, and deleted by
 * the read. It used to be an error reply: lookups failed with KVO_EREMOTE instead of ending the
 * prefix there, and reads failed with KVO_EREMOTE on every try, the key left in place. */
static void test_wrong_type_value(void)
{
    rf_server s;
    char addr[64], k1[KVO_REDIS_KEY_MAX];
    kvb_hash h[3];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *g1 = of_mem_pool(8, KVB_LAYOUT_LAYER_SEPARATE), *g4 = of_meta_pool(8), *dst = NULL;
    kvo_backend *b = redis_open(addr, g4, 0);
    if (!b) goto out;
    of_chain(13, 3, h);
    of_register(g1, h, 3, NULL, NULL);
    KVT_EQ(offload(g1, g4, b, h, 3).transferred, 3);
    kvo_redis_key(b, &h[1], k1, sizeof k1);
    KVT_EQ(cli(s.port, "DEL", k1, NULL, NULL), 0);
    KVT_EQ(cli(s.port, "RPUSH", k1, "not-a-block", NULL), 0);
    size_t prefix = 99;
    KVT_EQ(kvo_redis_lookup(b, h, 3, &prefix), KVO_OK);
    KVT_EQ(prefix, 1);
    kvo_redis_stats rs = rstats(b);
    KVT_EQ(rs.checksum_errors, 1);
    KVT_EQ(rs.lookup_errors, 0);
    dst = of_mem_pool(8, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvb_block got[MAXN];
    size_t ngot = 0;
    kvo_transfer_info info = load(g4, dst, b, h, 3, got, &ngot);
    KVT_EQ(info.transferred, 2);
    KVT_EQ(info.failed, 1);
    KVT_EQ(info.error, KVO_ECHECKSUM);
    KVT_EQ(of_holds(dst, h[0]), 1);
    KVT_EQ(of_has(dst, h[1]), 0);
    KVT_EQ(of_holds(dst, h[2]), 1);
    rs = rstats(b);
    KVT_EQ(rs.checksum_errors, 2);
    KVT_EQ(rs.remote_errors, 0);
    KVT_EQ(exists(s.port, k1), 0); /* deleted: no reader meets it again */
    OF_CHECK_POOL(dst);
out:
    kvo_backend_destroy(b);
    kvb_pool_destroy(dst);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

/* A value written by kvcache 0.1 (format version 1, whose hashes differ) under a key a 0.2 engine asks
 * for: a miss, never its bytes, and left in place (it is whole: an older engine may still read it). */
static void test_other_format_version(void)
{
    rf_server s;
    char addr[64], k1[KVO_REDIS_KEY_MAX];
    kvb_hash h[2];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *g1 = of_mem_pool(16, KVB_LAYOUT_LAYER_SEPARATE), *g4 = of_meta_pool(8), *dst = NULL;
    kvo_backend *b = redis_open(addr, g4, 0);
    if (!b) goto out;
    of_chain(12, 2, h);
    of_register(g1, h, 2, NULL, NULL);
    KVT_EQ(offload(g1, g4, b, h, 2).transferred, 2);
    kvo_redis_key(b, &h[1], k1, sizeof k1);
    redisReply *v = rf_cmd(s.port, NULL, "GET %s", k1);
    KVT_CHECK(v && v->type == REDIS_REPLY_STRING && v->len > KVO_REDIS_HEADER_BYTES);
    if (v && v->type == REDIS_REPLY_STRING && v->len > KVO_REDIS_HEADER_BYTES) {
        unsigned char *val = (unsigned char *)v->str;
        uint64_t sum;
        val[4] = 1; /* format version 1, header checksum made right again */
        val[5] = 0;
        sum = kvo_checksum(val, 56);
        for (int i = 0; i < 8; i++) val[56 + i] = (unsigned char)(sum >> (8 * i));
        redisReply *set = rf_cmd(s.port, NULL, "SET %s %b", k1, v->str, v->len);
        KVT_CHECK(set && set->type == REDIS_REPLY_STATUS);
        if (set) freeReplyObject(set);
    }
    if (v) freeReplyObject(v);
    dst = of_mem_pool(16, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvb_block got[MAXN];
    size_t ngot = 0;
    kvo_transfer_info info = load(g4, dst, b, h, 2, got, &ngot);
    KVT_EQ(info.transferred, 1);
    KVT_EQ(info.failed, 1);
    KVT_EQ(of_holds(dst, h[0]), 1);
    KVT_EQ(of_has(dst, h[1]), 0);
    KVT_CHECK(log_has("format version"));
    KVT_EQ(exists(s.port, k1), 1);
    OF_CHECK_POOL(dst);
out:
    kvo_backend_destroy(b);
    kvb_pool_destroy(dst);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

typedef struct job_wait {
    pthread_mutex_t mu;
    int done, result;
} job_wait;

static void job_done(kvo_copy_job *job, int result, const char *message)
{
    job_wait *w = (job_wait *)job->user;
    (void)message;
    pthread_mutex_lock(&w->mu);
    w->done = 1;
    w->result = result;
    pthread_mutex_unlock(&w->mu);
}

static kvo_copy_job job_of(kvb_pool *src, kvb_pool *dst, const uint32_t *src_idx, const uint32_t *dst_idx,
                           const kvb_hash *hashes, size_t n, int *results, job_wait *w)
{
    kvo_copy_job job;
    memset(&job, 0, sizeof job);
    job.src = src;
    job.dst = dst;
    job.src_idx = src_idx;
    job.dst_idx = dst_idx;
    job.hashes = hashes;
    job.n = n;
    job.results = results;
    job.done = job_done;
    job.user = w;
    return job;
}

/* One backend job (inline backend: done before submit returns). */
static int run_job(kvo_backend *b, kvb_pool *src, kvb_pool *dst, const uint32_t *src_idx, const uint32_t *dst_idx,
                   const kvb_hash *hashes, size_t n, int *results)
{
    job_wait w = {PTHREAD_MUTEX_INITIALIZER, 0, 0};
    kvo_copy_job job = job_of(src, dst, src_idx, dst_idx, hashes, n, results, &w);
    KVT_EQ(b->submit(b, &job), KVO_OK);
    KVT_EQ(w.done, 1);
    return w.result;
}

/* ---- scripted servers: one connection at a time, on a thread ---------------------------------------- */

typedef struct script_server script_server;
/* The reply to one command (name upper-cased, key its first argument); out is room to write it in; NULL
 * closes the connection instead. */
typedef const char *(*script_fn)(script_server *sv, const char *name, const char *key, char *out, size_t size);

struct script_server {
    int listen_fd, port;
    pthread_t thread;
    script_fn answer;
    int getranges;             /* GETRANGEs answered */
    int sets;                  /* SETs stored (read after script_stop) */
    int map_port, moved_port;  /* cluster nodes: the owner CLUSTER SLOTS names (0: itself, -1: none);
                                  MOVED's target (0: none) */
    int pings;                 /* PINGs answered */
    int drop_auth;             /* lost_hello_answer: close on a later AUTH (else on a later PING) */
    char buf[65536];
};

static int script_command(script_server *sv, int fd, size_t *len, char *name, size_t name_size, char *key,
                          size_t key_size)
{
    char *buf = sv->buf;
    for (;;) { /* one RESP array of bulk strings: name = its first, upper-cased; key = its second */
        size_t pos = 0, n, i, k;
        char *end;
        if (*len && buf[0] == '*' && (end = memchr(buf, '\n', *len)) != NULL) {
            n = strtoul(buf + 1, NULL, 10);
            pos = (size_t)(end - buf) + 1;
            key[0] = 0;
            for (i = 0; i < n && pos < *len; i++) {
                char *e2 = memchr(buf + pos, '\n', *len - pos);
                size_t l;
                if (!e2 || buf[pos] != '$') break;
                l = strtoul(buf + pos + 1, NULL, 10);
                if ((size_t)(e2 - buf) + 1 + l + 2 > *len) break;
                if (i == 0)
                    for (k = 0; k < l && k + 1 < name_size; k++) name[k] = (char)toupper((unsigned char)e2[1 + k]), name[k + 1] = 0;
                if (i == 1)
                    for (k = 0; k < l && k + 1 < key_size; k++) key[k] = e2[1 + k], key[k + 1] = 0;
                pos = (size_t)(e2 - buf) + 1 + l + 2;
            }
            if (i == n) {
                memmove(buf, buf + pos, *len - pos);
                *len -= pos;
                return 1;
            }
        }
        ssize_t got = recv(fd, buf + *len, sizeof sv->buf - *len, 0);
        if (got <= 0) return 0;
        *len += (size_t)got;
    }
}

static void *script_serve(void *arg)
{
    script_server *sv = (script_server *)arg;
    int fd;
    while ((fd = accept(sv->listen_fd, NULL, NULL)) >= 0) {
        size_t len = 0;
        char name[32] = "", key[256] = "", out[256];
        while (script_command(sv, fd, &len, name, sizeof name, key, sizeof key)) {
            const char *reply = sv->answer(sv, name, key, out, sizeof out);
            if (!reply || send(fd, reply, strlen(reply), MSG_NOSIGNAL) < 0) break;
        }
        close(fd);
    }
    return NULL;
}

static int script_start(script_server *sv, script_fn answer)
{
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    int one = 1;
    sv->answer = answer;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if ((sv->listen_fd = socket(AF_INET, SOCK_STREAM, 0)) < 0) return 0;
    setsockopt(sv->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(sv->listen_fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(sv->listen_fd, 8) != 0 ||
        getsockname(sv->listen_fd, (struct sockaddr *)&a, &al) != 0) {
        close(sv->listen_fd);
        return 0;
    }
    sv->port = ntohs(a.sin_port);
    return pthread_create(&sv->thread, NULL, script_serve, sv) == 0;
}

static void script_stop(script_server *sv)
{
    shutdown(sv->listen_fd, SHUT_RDWR);
    close(sv->listen_fd);
    pthread_join(sv->thread, NULL);
}

/* A Redis out of step: answers as one with a full memory would (SET -> -OOM, GET -> nil, GETRANGE -> an
 * empty string), but sends one reply nobody asked for after the first GETRANGE, in the same write: the
 * client then holds it in its reader, behind the answer it wanted. */
static const char *stray_answer(script_server *sv, const char *name, const char *key, char *out, size_t size)
{
    (void)key;
    (void)out;
    (void)size;
    if (!strcmp(name, "PING")) return "+PONG\r\n";
    if (!strcmp(name, "CLUSTER")) return "-ERR This instance has cluster support disabled\r\n";
    if (!strcmp(name, "GETRANGE")) return sv->getranges++ ? "$0\r\n\r\n" : "$0\r\n\r\n+OK\r\n";
    if (!strcmp(name, "SET")) return "-OOM command not allowed when used memory > 'maxmemory'.\r\n";
    if (!strcmp(name, "GET")) return "$-1\r\n";
    return "-ERR unknown\r\n";
}

/* A node of a scripted cluster: CLUSTER SLOTS gives every slot to map_port (0: to itself; -1: an error
 * instead); with moved_port set, every key is answered MOVED there; without, SETs are stored and reads
 * miss. */
static const char *cluster_node_answer(script_server *sv, const char *name, const char *key, char *out, size_t size)
{
    if (!strcmp(name, "PING")) return "+PONG\r\n";
    if (!strcmp(name, "CLUSTER") && sv->map_port < 0) return "-ERR no map here\r\n";
    if (!strcmp(name, "CLUSTER")) {
        snprintf(out, size, "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n",
                 sv->map_port ? sv->map_port : sv->port);
        return out;
    }
    if (sv->moved_port) {
        snprintf(out, size, "-MOVED %u 127.0.0.1:%d\r\n", (unsigned)kvo_redis_key_slot(key, strlen(key)),
                 sv->moved_port);
        return out;
    }
    if (!strcmp(name, "SET")) {
        sv->sets++;
        return "+OK\r\n";
    }
    if (!strcmp(name, "GETRANGE")) return "$0\r\n\r\n";
    if (!strcmp(name, "GET")) return "$-1\r\n";
    return "-ERR unknown\r\n";
}

/* A backend on a scripted server (answer), with a memory pool and a G4 pool of 4 blocks each:
 * scripted_start starts the server and fills rc (tests may change it), scripted_connect makes the
 * backend (s->b, NULL when create failed: checked), scripted_stop undoes both. */
typedef struct scripted {
    script_server sv;
    char addr[64];
    kvb_pool *mem, *g4;
    kvo_redis_config rc;
    kvo_backend *b;
} scripted;

static int scripted_start(scripted *s, script_fn answer)
{
    if (!script_start(&s->sv, answer)) {
        KVT_CHECK(!"the scripted server did not start");
        return 0;
    }
    server_addr(s->sv.port, s->addr, sizeof s->addr);
    s->mem = of_mem_pool(4, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    s->g4 = of_meta_pool(4);
    s->rc = rconfig(s->addr, s->g4, 0);
    s->b = NULL;
    return 1;
}

static kvo_backend *scripted_connect(scripted *s)
{
    KVT_EQ(kvo_redis_backend_create(&s->rc, &s->b), KVO_OK);
    return s->b;
}

static void scripted_stop(scripted *s)
{
    if (s->b) kvo_backend_destroy(s->b);
    kvb_pool_destroy(s->mem);
    kvb_pool_destroy(s->g4);
    script_stop(&s->sv);
}

/* A reply left over in the client's reader is not taken for the next command's: the lookup that
 * received it fails (KVO_EIO: its own answer may have been the stray one), the connection is dropped at
 * once and made again, and the SET that follows reports the server's refusal (it was taken as stored,
 * from the stray +OK). */
static void test_stray_reply(void)
{
    scripted s;
    memset(&s, 0, sizeof s);
    if (!scripted_start(&s, stray_answer)) return;
    kvb_pool *mem = s.mem, *g4 = s.g4;
    kvo_backend *b = scripted_connect(&s);
    if (b) {
        kvb_hash h[1] = {{11, 1}};
        uint32_t idx[1] = {0};
        int results[1] = {0};
        kvb_block bl[1];
        size_t n = 9;
        KVT_EQ(kvb_alloc(mem, 1, bl), KVB_OK);
        KVT_EQ(kvo_redis_lookup(b, h, 1, &n), KVO_EIO);
        KVT_EQ(n, 0);
        KVT_EQ(rstats(b).disconnects, 1);
        KVT_EQ(rstats(b).lookup_errors, 1);
        KVT_EQ(run_job(b, mem, g4, idx, idx, h, 1, results), KVO_EREMOTE);
        KVT_EQ(results[0], KVO_EREMOTE);
        kvo_redis_stats st;
        KVT_EQ(kvo_redis_backend_stats(b, &st), KVO_OK);
        KVT_EQ(st.puts, 0);
        KVT_EQ(st.disconnects, 1);
        KVT_EQ(st.connects, 2);
    }
    scripted_stop(&s);
}

/* A server out of step inside a batch: the first SET of a job gets no answer of its own, the second
 * gets "+OK", a stray "+OK" and the refusal it meant ("-OOM"), in one write; a GET gets nil and a stray
 * nil. */
static const char *left_over_answer(script_server *sv, const char *name, const char *key, char *out, size_t size)
{
    (void)key;
    (void)out;
    (void)size;
    if (!strcmp(name, "PING")) return "+PONG\r\n";
    if (!strcmp(name, "CLUSTER")) return "-ERR This instance has cluster support disabled\r\n";
    if (!strcmp(name, "SET")) /* sets counts the SETs received here */
        return sv->sets++ % 2 ? "+OK\r\n+OK\r\n-OOM command not allowed when used memory > 'maxmemory'.\r\n" : "";
    if (!strcmp(name, "GET")) return "$-1\r\n$-1\r\n";
    return "-ERR unknown\r\n";
}

/* Reply data left on a connection when a batch has read its replies means the replies were not the
 * batch's own: the connection is dropped and the copies it carried fail (KVO_EIO), none counted as
 * stored, got or missed. Before, the SETs were both taken as stored (the second from the stray +OK;
 * the server refused it) and the leftover dropped the connection only at the next batch; a GET's
 * leftover dropped it, but the copy kept its answer (a miss). */
static void test_reply_data_left_after_a_batch(void)
{
    scripted s;
    memset(&s, 0, sizeof s);
    if (!scripted_start(&s, left_over_answer)) return;
    kvb_pool *mem = s.mem, *g4 = s.g4;
    kvo_backend *b = scripted_connect(&s);
    if (b) {
        kvb_hash h[2] = {{51, 5}, {52, 5}};
        uint32_t idx[2] = {0, 1};
        int results[2] = {1, 1};
        kvb_block bl[2];
        KVT_EQ(kvb_alloc(mem, 2, bl), KVB_OK);
        kvo_redis_stats before = rstats(b);
        KVT_EQ(run_job(b, mem, g4, idx, idx, h, 2, results), KVO_EIO);
        KVT_EQ(results[0], KVO_EIO);
        KVT_EQ(results[1], KVO_EIO);
        kvo_redis_stats set = rstats(b);
        KVT_EQ(set.puts, 0);
        KVT_EQ(set.remote_errors, 0);
        KVT_EQ(set.io_errors, 2);
        KVT_EQ(set.disconnects - before.disconnects, 1); /* dropped at once, not at the next batch */
        KVT_CHECK(log_has("reply data no command asked for"));
        KVT_EQ(run_job(b, g4, mem, idx, idx, h, 1, results), KVO_EIO);
        KVT_EQ(results[0], KVO_EIO);
        kvo_redis_stats get = rstats(b);
        KVT_EQ(get.misses, 0);
        KVT_EQ(get.io_errors, 3);
        KVT_EQ(get.connects - set.connects, 1);
        KVT_EQ(get.disconnects - set.disconnects, 1);
    }
    scripted_stop(&s);
    KVT_EQ(s.sv.sets, 2);
}

/* A MOVED is not undone by a stale map. After a MOVED the map is asked again; it used to be asked of the
 * first connected node, which may not know the new owner yet: its answer put the slot back on the old
 * owner, which answered MOVED again, until the copy failed with "too many redirects". Scripted nodes: C,
 * the seed, still gives every slot to A; A has handed them to B and answers MOVED B; B serves them. The
 * copy goes A, MOVED, B (one redirect). The map is asked of B first: a key of another slot then goes
 * straight to B. When B gives no map (owner_maps = 0) C's stale one comes back, and the redirected key
 * still goes to B; a key of another slot then takes a MOVED of its own. */
static void moved_with_stale_map(int owner_maps)
{
    script_server *nd = (script_server *)calloc(3, sizeof *nd), *c = &nd[0], *a = &nd[1], *bn = &nd[2];
    char seeds[64], key[2][KVO_REDIS_KEY_MAX];
    kvb_hash h[2] = {{7001, 77}, {7002, 77}};
    uint32_t idx[1] = {0};
    int results[1] = {1};
    bn->map_port = owner_maps ? 0 : -1;
    int up = script_start(bn, cluster_node_answer);
    a->map_port = a->moved_port = bn->port;
    up = up && script_start(a, cluster_node_answer);
    c->map_port = c->moved_port = a->port;
    up = up && script_start(c, cluster_node_answer);
    KVT_CHECK(up);
    if (!up) return; /* a hung thread would be the watchdog's */
    server_addr(c->port, seeds, sizeof seeds);
    kvb_pool *mem = of_mem_pool(2, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(4);
    kvb_block bl[2];
    KVT_EQ(kvb_alloc(mem, 2, bl), KVB_OK);
    kvo_backend *b = redis_open(seeds, g4, 0);
    if (b) {
        KVT_EQ(rstats(b).cluster, 1);
        for (int i = 0; i < 2; i++) kvo_redis_key(b, &h[i], key[i], sizeof key[i]);
        KVT_CHECK(kvo_redis_key_slot(key[0], strlen(key[0])) != kvo_redis_key_slot(key[1], strlen(key[1])));
        KVT_EQ(run_job(b, mem, g4, idx, idx, &h[0], 1, results), KVO_OK);
        if (results[0] != KVO_OK) fprintf(stderr, "  copy: %s\n", kvo_redis_result_string(results[0]));
        KVT_EQ(rstats(b).moved, 1);
        KVT_EQ(run_job(b, mem, g4, idx, idx, &h[1], 1, results), KVO_OK);
        KVT_EQ(rstats(b).moved, owner_maps ? 1 : 2);
        kvo_backend_destroy(b);
    }
    for (int i = 0; i < 3; i++) script_stop(&nd[i]);
    KVT_EQ(bn->sets, 2);
    KVT_EQ(a->sets + c->sets, 0);
    kvb_pool_destroy(mem);
    kvb_pool_destroy(g4);
    free(nd);
}

static void test_cluster_moved_stale_map(void)
{
    moved_with_stale_map(1);
    moved_with_stale_map(0);
}

/* A log callback that reads the backend's statistics, as a reporter might: the loss of a connection is
 * logged while a lookup or an inline job holds its connections, and stats used to wait on the same lock
 * (a deadlock). Run on a thread, so that a hang fails the test instead of stopping the program. */
typedef struct log_stats_ctx {
    kvo_backend *b;
    kvb_pool *mem, *g4;
    int lookup_result, job_result, logged, done;
} log_stats_ctx;

static log_stats_ctx *g_log_stats; /* keeps a hung test's state reachable (no leak report on top) */

static void log_reading_stats(void *user, const char *message)
{
    log_stats_ctx *x = (log_stats_ctx *)user;
    kvo_redis_stats st;
    (void)message;
    if (x->b && kvo_redis_backend_stats(x->b, &st) == KVO_OK) x->logged++;
}

static void *log_stats_calls(void *arg)
{
    log_stats_ctx *x = (log_stats_ctx *)arg;
    kvb_hash h[1] = {{21, 3}};
    uint32_t idx[1] = {0};
    int results[1] = {0};
    size_t n = 0;
    x->lookup_result = kvo_redis_lookup(x->b, h, 1, &n); /* the loss is seen here */
    x->job_result = run_job(x->b, x->mem, x->g4, idx, idx, h, 1, results); /* and here: down */
    __atomic_store_n(&x->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void test_log_reads_stats(void)
{
    rf_server s;
    char addr[64];
    pthread_t t;
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    log_stats_ctx *x = (log_stats_ctx *)calloc(1, sizeof *x); /* left behind if the calls hang */
    x->mem = of_mem_pool(4, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    x->g4 = of_meta_pool(4);
    g_log_stats = x;
    kvo_redis_config rc = rconfig(addr, x->g4, 0);
    rc.log = log_reading_stats;
    rc.log_user = x;
    KVT_EQ(kvo_redis_backend_create(&rc, &x->b), KVO_OK);
    if (!x->b) goto out;
    kvb_block bl[1];
    KVT_EQ(kvb_alloc(x->mem, 1, bl), KVB_OK);
    size_t n = 0;
    kvb_hash h[1] = {{21, 3}};
    KVT_EQ(kvo_redis_lookup(x->b, h, 1, &n), KVO_OK); /* connected */
    rf_kill(&s);
    KVT_EQ(pthread_create(&t, NULL, log_stats_calls, x), 0);
    int done = 0;
    for (uint64_t end = of_now_us() + 5000000; !done && of_now_us() < end;)
        if (!(done = __atomic_load_n(&x->done, __ATOMIC_ACQUIRE))) of_sleep_us(1000);
    KVT_CHECK(done);
    if (!done) { /* deadlocked: the thread, its backend and pools stay as they are */
        pthread_detach(t);
        rf_stop(&s);
        return;
    }
    pthread_join(t, NULL);
    KVT_EQ(x->lookup_result, KVO_EIO);
    KVT_EQ(x->job_result, KVO_EIO);
    KVT_CHECK(x->logged >= 1);
    KVT_EQ(rstats(x->b).disconnects, 1);
    kvo_backend_destroy(x->b);
out:
    kvb_pool_destroy(x->mem);
    kvb_pool_destroy(x->g4);
    free(x);
    rf_stop(&s);
}

/* What the calls refuse: a lookup of more hashes than memory has room for, an import into a pool with
 * storage (it copies no bytes), a job naming a block past the memory pool; and an import into a full
 * pool reports the prefix the pool holds after it (its new blocks took the place of one it held, and it
 * reported all three). */
static void test_remote_bounds(void)
{
    rf_server s;
    char addr[64];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *mem = of_mem_pool(16, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(16), *small = of_meta_pool(2);
    kvo_backend *b = NULL;
    kvo_redis_config rc = rconfig(addr, g4, 0);
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_OK);
    if (!b) goto out;
    kvb_hash h[4];
    uint32_t idx[4] = {0, 1, 2, 3}, far[4] = {0, 1, 2, 16};
    int results[4];
    kvb_block bl[4], sb[2];
    for (int i = 0; i < 4; i++) {
        h[i].lo = 500u + (unsigned)i;
        h[i].hi = 9;
    }
    KVT_EQ(kvb_alloc(mem, 4, bl), KVB_OK);
    for (int i = 0; i < 4; i++) of_fill(mem, bl[i], h[i]);
    size_t n = 0;
    KVT_EQ(kvo_redis_lookup(b, h, SIZE_MAX / 64, &n), KVO_EINVAL); /* its item array would wrap */
    job_wait w = {PTHREAD_MUTEX_INITIALIZER, 0, 0};
    kvo_copy_job job = job_of(mem, g4, far, idx, h, 4, results, &w);
    KVT_EQ(b->submit(b, &job), KVO_EINVAL); /* memory block 16 of 16 */
    KVT_EQ(w.done, 0);
    KVT_EQ(run_job(b, mem, g4, idx, idx, h, 4, results), KVO_OK);
    KVT_EQ(kvo_redis_lookup(b, h, 4, &n), KVO_OK);
    KVT_EQ(n, 4);
    KVT_EQ(kvo_redis_import(b, mem, h, NULL, 4, &n), KVO_EINVAL);
    KVT_EQ(n, 0);
    { /* a manager none of whose tiers is the backend's pool: refused, and that pool left as it was (the
         entries went into it, where the manager never looks) */
        kvb_pool *other = of_meta_pool(4);
        kvo_manager_config mc;
        kvo_manager *m = NULL;
        uint8_t tier_of[4];
        memset(&mc, 0, sizeof mc);
        mc.num_tiers = 2;
        mc.pools[0] = mem;
        mc.pools[1] = other;
        mc.pipeline.mode = KVO_MODE_POLL;
        KVT_EQ(kvo_manager_create(&mc, &m), KVO_OK);
        n = 7;
        KVT_EQ(kvo_redis_manager_lookup(m, b, h, 4, tier_of, &n), KVO_EINVAL);
        KVT_EQ(n, 0);
        KVT_EQ(of_present(g4, h, 4), 0);
        kvo_manager_destroy(m);
        kvb_pool_destroy(other);
    }
    kvb_hash par[2] = {{0, 0}, h[0]};
    KVT_EQ(kvb_alloc(small, 2, sb), KVB_OK);
    KVT_EQ(kvb_register_hashed(small, sb, 2, h, par, sb), KVB_OK);
    KVT_EQ(kvb_release(small, sb, 2, NULL), KVB_OK);
    KVT_EQ(kvo_redis_import(b, small, h, NULL, 3, &n), KVO_OK);
    size_t known = 0;
    kvb_pool_stats ps;
    KVT_EQ(kvb_pool_get_stats(small, &ps), KVB_OK);
    KVT_EQ(ps.lookups, 0); /* the import asked without lookups */
    KVT_EQ(kvb_lookup(small, h, 4, &known), KVB_OK);
    KVT_CHECK(known < 3); /* two blocks: three cannot all be there */
    KVT_EQ(n, known);
    OF_CHECK_POOL(small);
    kvo_backend_destroy(b);
out:
    kvb_pool_destroy(mem);
    kvb_pool_destroy(g4);
    kvb_pool_destroy(small);
    rf_stop(&s);
}

/* Redis's own eviction (maxmemory, allkeys-lru): the entries it dropped are misses; a read batch larger
 * than the window goes in several round trips. */
static void test_server_eviction(void)
{
    enum { N = 3000 };
    rf_server s;
    char addr[64];
    const char *extra[] = {"--maxmemory", "3mb", NULL};
    if (!rf_start(&s, extra)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *mem = of_mem_pool(N, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(16);
    kvb_pool *back = of_mem_pool(N, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvo_backend *b = NULL;
    kvo_redis_config rc = rconfig(addr, g4, 0);
    rc.window_bytes = 100 * (OF_BLOCK_BYTES + KVO_REDIS_HEADER_BYTES); /* reads: 30 round trips of 100 */
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_OK);
    static kvb_hash h[N];
    static uint32_t idx[N];
    static int results[N];
    kvb_block blocks[1];
    if (!b) goto out;
    for (uint32_t i = 0; i < N; i++) {
        h[i].lo = 0x1234567ull * (i + 1);
        h[i].hi = ~(uint64_t)i;
        idx[i] = i;
        KVT_EQ(kvb_alloc(mem, 1, blocks), KVB_OK);
        KVT_EQ(kvb_block_index(blocks[0].id), i);
        of_fill(mem, blocks[0], h[i]);
    }
    KVT_EQ(run_job(b, mem, g4, idx, idx, h, N, results), KVO_OK);
    redisReply *r = rf_cmd(s.port, NULL, "INFO stats");
    const char *ev = r && r->type == REDIS_REPLY_STRING ? strstr(r->str, "evicted_keys:") : NULL;
    long long evicted = ev ? atoll(ev + 13) : 0;
    if (r) freeReplyObject(r);
    KVT_CHECK(evicted > 0);
    int res = run_job(b, g4, back, idx, idx, h, N, results);
    KVT_EQ(res, KVO_ENOTFOUND);
    size_t ok = 0, missing = 0, right = 0;
    for (uint32_t i = 0; i < N; i++) {
        if (results[i] == KVO_OK) {
            ok++;
            for (uint32_t l = 0; l < OF_LAYERS; l++) {
                unsigned char *page = (unsigned char *)0;
                void *base = NULL;
                kvb_layout lay;
                KVT_EQ(kvb_pool_storage(back, &base, NULL, NULL, &lay), KVB_OK);
                page = (unsigned char *)base + kvb_layout_offset(&lay, N, i, l, 1);
                right += page[7] == of_pattern(h[i], l, 1, 7);
            }
        } else {
            missing += results[i] == KVO_ENOTFOUND;
        }
    }
    KVT_EQ(ok + missing, N);
    KVT_EQ(right, ok * OF_LAYERS);
    KVT_CHECK(ok > 0);
    KVT_CHECK(missing > 0);
    KVT_EQ(rstats(b).misses, missing);
    KVT_EQ(rstats(b).checksum_errors, 0);
out:
    kvo_backend_destroy(b);
    kvb_pool_destroy(mem);
    kvb_pool_destroy(back);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

static void test_auth(void)
{
    rf_server s;
    char addr[64], pw[64];
    snprintf(pw, sizeof pw, "kv-secret-%d", (int)getpid());
    const char *extra[] = {"--requirepass", pw, NULL};
    if (!rf_start(&s, extra)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *g1 = of_mem_pool(8, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(8);
    kvo_backend *b = (kvo_backend *)1;
    kvo_redis_config rc = rconfig(addr, g4, 0);
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EAUTH);
    KVT_CHECK(b == NULL);
    KVT_CHECK(strstr(g_err, "requires a password") != NULL);
    KVT_CHECK(strstr(g_err, addr) != NULL);

    rc.password = "wrong-guess-1234";
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EAUTH);
    KVT_CHECK(strstr(g_err, "AUTH refused") != NULL);
    KVT_CHECK(strstr(g_err, "wrong-guess-1234") == NULL);
    KVT_CHECK(!log_has("wrong-guess-1234"));

    rc.password = NULL;
    rc.password_env = "KVCACHE_REDIS_PASSWORD";
    setenv("KVCACHE_REDIS_PASSWORD", pw, 1);
    b = NULL;
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_OK);
    unsetenv("KVCACHE_REDIS_PASSWORD");
    if (b) {
        kvb_hash h[4];
        of_chain(21, 4, h);
        of_register(g1, h, 4, NULL, NULL);
        KVT_EQ(offload(g1, g4, b, h, 4).transferred, 4);
        size_t prefix = 0;
        KVT_EQ(kvo_redis_lookup(b, h, 4, &prefix), KVO_OK);
        KVT_EQ(prefix, 4);
        KVT_EQ(read_back(g4, b, h, 4, NULL), 4);
        kvo_backend_destroy(b);
    }
    KVT_CHECK(!log_has(pw));
    KVT_CHECK(strstr(g_err, pw) == NULL);
    OF_CHECK_POOL(g4);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

/* The connector's lookup and loads for request 1 over e's tiers: tokens it plans, device blocks it
 * landed (references in got, *ngot). */
static size_t connector_load(engine *e, const kvb_hash *h, size_t n, int flush_port, kvb_block *got, size_t *ngot)
{
    kvs_connector_config cc;
    kvs_connector *c = NULL;
    kvs_connector_meta meta;
    size_t tokens = 0;
    int async = 0, done = 0;
    memset(&cc, 0, sizeof cc);
    cc.device = e->g1;
    cc.tiers = e->m;
    cc.lookup = kvo_redis_tiers_lookup;
    cc.lookup_user = e->redis;
    KVT_EQ(kvs_connector_create(&cc, &c), KVS_OK);
    if (!c) return 0;
    KVT_EQ(kvs_connector_get_num_new_matched_tokens(c, 1, h, n, 0, &tokens, &async), KVS_OK);
    KVT_EQ(async, tokens > 0);
    KVT_EQ(kvs_connector_update_state_after_alloc(c, 1, tokens), KVS_OK);
    if (flush_port) { /* lost between the lookup and the load */
        redisReply *r = rf_cmd(flush_port, NULL, "FLUSHALL");
        if (r) freeReplyObject(r);
    }
    KVT_EQ(kvs_connector_build_meta(c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_bind_meta(c, &meta), KVS_OK);
    KVT_EQ(kvs_connector_start_loads(c), KVS_OK);
    for (int i = 0; i < 100 && !done; i++) {
        kvs_worker_output out;
        KVT_EQ(kvo_manager_drain(e->m, 5000000), KVO_OK);
        KVT_EQ(kvs_connector_get_finished(c, &out), KVS_OK);
        for (size_t k = 0; k < out.num_finished_loads; k++) done |= out.finished_loads[k] == 1;
        KVT_EQ(kvs_connector_update_output(c, &out), KVS_OK);
    }
    KVT_CHECK(done);
    *ngot = 0;
    KVT_EQ(kvb_match(e->g1, h, n, got, ngot), KVB_OK); /* what the request's own match finds */
    KVT_EQ(kvs_connector_release_loads(c, 1), KVS_OK);
    KVT_EQ(kvs_connector_request_finished(c, 1, NULL), KVS_OK);
    kvs_connector_destroy(c);
    return tokens;
}

static void test_connector_g4(void)
{
    rf_server s;
    engine a, b;
    kvb_hash h[CONV_BLOCKS + 2];
    kvb_block blocks[CONV_BLOCKS], got[CONV_BLOCKS];
    size_t ngot = 0;
    kvo_redis_stats st;
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    KVT_EQ(conversation(CONV_BLOCKS, 5, h), CONV_BLOCKS);
    if (engine_open(&a, s.port)) { /* A computes the conversation: G1 -> G2 -> G4 */
        of_register(a.g1, h, CONV_BLOCKS, blocks, NULL);
        KVT_EQ(kvo_manager_offer(a.m, 0, blocks, CONV_BLOCKS, NULL), KVO_OK);
        KVT_EQ(kvo_manager_drain(a.m, 10000000), KVO_OK);
        KVT_EQ(kvb_release(a.g1, blocks, CONV_BLOCKS, NULL), KVB_OK);
        engine_close(&a);
    }
    KVT_EQ(rf_int(s.port, NULL, "DBSIZE"), CONV_BLOCKS);
    if (engine_open(&b, s.port)) { /* B, cold: every block comes from Redis */
        KVT_EQ(connector_load(&b, h, CONV_BLOCKS, 0, got, &ngot), CONV_BLOCKS * OF_TOKENS);
        KVT_EQ(ngot, CONV_BLOCKS);
        for (size_t i = 0; i < ngot; i++) KVT_CHECK(of_bytes_ok(b.g1, got[i], h[i]));
        if (ngot) KVT_EQ(kvb_release(b.g1, got, ngot, NULL), KVB_OK);
        engine_close(&b);
    }
    if (engine_open(&b, s.port)) { /* cold again, and the entries vanish after the lookup: a miss */
        KVT_EQ(connector_load(&b, h, CONV_BLOCKS, s.port, got, &ngot), CONV_BLOCKS * OF_TOKENS);
        KVT_EQ(ngot, 0);
        KVT_EQ(kvo_redis_backend_stats(b.redis, &st), KVO_OK);
        KVT_CHECK(st.misses > 0);
        engine_close(&b);
    }
    rf_stop(&s);
}

/* An entry Redis lost (deleted here, as an eviction would) under a block the G4 pool still knows: the
 * load fails that copy with KVO_ENOTFOUND (a miss), and the G4 pool drops the block, so lookups stop
 * finding it there and the next offer stores it again. It used to stay known until that pool evicted
 * it: every load of it a miss, and offers skipped it as present. */
static void test_lost_entry_dropped(void)
{
    rf_server s;
    engine e;
    kvb_hash h[4];
    kvb_block b[4], got[4];
    uint8_t tier_of[4];
    size_t n = 0, ngot = 0;
    char key[KVO_REDIS_KEY_MAX];
    kvo_transfer t;
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    if (!engine_open(&e, s.port)) {
        rf_stop(&s);
        return;
    }
    of_chain(19, 4, h);
    of_register(e.g1, h, 4, b, NULL);
    KVT_EQ(kvo_manager_offer(e.m, 0, b, 4, NULL), KVO_OK);
    KVT_EQ(kvo_manager_drain(e.m, 10000000), KVO_OK);
    KVT_EQ(kvb_release(e.g1, b, 4, NULL), KVB_OK);
    KVT_EQ(of_present(e.g4, h, 4), 4);
    KVT_EQ(rf_int(s.port, NULL, "DBSIZE"), 4);

    /* Redis loses h[2]; G1 and G2 lose everything, so the blocks are to come from G4 */
    kvo_redis_key(e.redis, &h[2], key, sizeof key);
    KVT_EQ(rf_int(s.port, NULL, "DEL %s", key), 1);
    KVT_EQ(kvb_pool_reset(e.g1), KVB_OK);
    KVT_EQ(kvb_pool_reset(e.g2), KVB_OK);
    KVT_EQ(kvo_manager_onboard(e.m, 2, h, 4, &t), KVO_OK);
    KVT_EQ(kvo_manager_drain(e.m, 10000000), KVO_OK);
    kvo_pipeline *up = kvo_manager_pipeline(e.m, 2, 1);
    kvo_transfer_info info = of_info(up, t);
    KVT_EQ(info.status, KVO_STATUS_FAILED);
    KVT_EQ(info.transferred, 3);
    KVT_EQ(info.failed, 1);
    KVT_EQ(info.error, KVO_ENOTFOUND);
    KVT_EQ(kvo_transfer_release(up, t), KVO_OK);
    KVT_EQ(rstats(e.redis).misses, 1);

    /* the G4 pool forgot it: the prefix ends there across the tiers */
    KVT_EQ(of_has(e.g4, h[2]), 0);
    KVT_EQ(of_stats(e.g4).invalidated, 1);
    KVT_EQ(kvo_manager_lookup(e.m, h, 4, tier_of, &n), KVO_OK);
    KVT_EQ(n, 2);

    /* the engine computes it again and offers it: it goes down to Redis again */
    of_register(e.g1, &h[2], 1, b, NULL);
    KVT_EQ(kvo_manager_offer(e.m, 0, b, 1, NULL), KVO_OK);
    KVT_EQ(kvo_manager_drain(e.m, 10000000), KVO_OK);
    KVT_EQ(kvb_release(e.g1, b, 1, NULL), KVB_OK);
    KVT_EQ(rf_int(s.port, NULL, "EXISTS %s", key), 1);
    KVT_EQ(of_has(e.g4, h[2]), 1);

    /* and all four load from G4 with their bytes */
    KVT_EQ(kvb_pool_reset(e.g1), KVB_OK);
    KVT_EQ(kvb_pool_reset(e.g2), KVB_OK);
    KVT_EQ(kvo_manager_lookup(e.m, h, 4, tier_of, &n), KVO_OK);
    KVT_EQ(n, 4);
    KVT_EQ(kvo_manager_onboard(e.m, 2, h, 4, &t), KVO_OK);
    KVT_EQ(kvo_manager_drain(e.m, 10000000), KVO_OK);
    KVT_EQ(of_status(up, t), KVO_STATUS_COMPLETE);
    KVT_EQ(kvo_transfer_take_blocks(up, t, got, 4, &ngot), KVO_OK);
    KVT_EQ(ngot, 4);
    for (size_t i = 0; i < ngot; i++) KVT_CHECK(of_bytes_ok(e.g1, got[i], h[i]));
    if (ngot) KVT_EQ(kvb_release(e.g1, got, ngot, NULL), KVB_OK);
    KVT_EQ(kvo_transfer_release(up, t), KVO_OK);
    engine_close(&e);
    rf_stop(&s);
}

/* Out of memory anywhere in create: KVO_ENOMEM with nothing handed out (and, under AddressSanitizer,
 * nothing leaked), never a crash; the seed list's node array failing to grow is no "bad server list". */
static void test_create_out_of_memory(void)
{
    kvb_pool *g4 = of_meta_pool(16);
    char addr[64];
    int enomem = 0, reached_connect = 0;
    server_addr(rf_free_port(), addr, sizeof addr);
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0;; at++) {
            kvo_redis_config rc = rconfig(addr, g4, 2);
            kvo_backend *b = (kvo_backend *)1;
            kvo_result r;
            int fired;
            rc.password = "pw";
            rc.username = "user";
            oom_arm(at, sticky);
            r = kvo_redis_backend_create(&rc, &b);
            fired = oom_fired;
            oom_disarm();
            KVT_CHECK(r == KVO_ENOMEM || r == KVO_ECONNECT);
            KVT_CHECK(b == NULL);
            enomem += r == KVO_ENOMEM;
            reached_connect += r == KVO_ECONNECT;
            if (!fired) break;
        }
    KVT_CHECK(enomem >= 10); /* the strings, the clients, each client's tables, the node list */
    KVT_CHECK(reached_connect >= 2);
    kvb_pool_destroy(g4);
}

/* A pool whose blocks are not one run each goes through the client's gather buffer, made at the first
 * such batch: with each allocation of the pump failing in turn, the copies end final, Failed with
 * KVO_ENOMEM or Complete, never an I/O error, and the connection is kept. Before, a gather buffer out
 * of memory was "connection lost mid-batch": KVO_EIO, an io_error, the node dropped. */
static void test_gather_out_of_memory(void)
{
    rf_server s;
    char addr[64];
    kvb_hash h[2];
    int enomem = 0;
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *g1 = of_mem_pool(8, KVB_LAYOUT_LAYER_SEPARATE), *g4 = of_meta_pool(8);
    of_chain(31, 2, h);
    of_register(g1, h, 2, NULL, NULL);
    for (long at = 0;; at++) {
        of_clock clock = {1000000};
        kvb_block strong[2];
        kvb_weak weak[2];
        size_t found = 0;
        int fired;
        kvo_backend *b = redis_open(addr, g4, 0);
        kvo_pipeline_config pc = of_config(g1, g4, b, KVO_MODE_POLL, &clock);
        kvo_pipeline *p = of_pipeline(&pc);
        if (!b || !p) break;
        KVT_EQ(kvb_match(g1, h, 2, strong, &found), KVB_OK);
        for (size_t i = 0; i < found; i++) weak[i] = kvb_weak_of(strong[i]);
        kvo_transfer t = of_enqueue(p, weak, found, NULL);
        KVT_EQ(kvb_release(g1, strong, found, NULL), KVB_OK);
        oom_arm(at, 0);
        kvo_status st = of_pump(p, &clock, t, 1000, 500);
        fired = oom_fired;
        oom_disarm();
        of_pump(p, &clock, t, 1000, 500);
        kvo_transfer_info info = of_info(p, t);
        KVT_CHECK(info.status == KVO_STATUS_COMPLETE || info.status == KVO_STATUS_FAILED);
        KVT_CHECK(info.error == KVO_OK || info.error == KVO_ENOMEM);
        KVT_EQ(rstats(b).io_errors, 0);
        enomem += info.error == KVO_ENOMEM;
        (void)st;
        KVT_EQ(kvo_transfer_release(p, t), KVO_OK);
        kvo_pipeline_destroy(p);
        kvo_backend_destroy(b);
        for (size_t i = 0; i < 2; i++) { /* each round stores anew */
            kvb_block blk;
            if (kvb_match(g4, &h[i], 1, &blk, &found) == KVB_OK && found) {
                KVT_EQ(kvb_release(g4, &blk, 1, NULL), KVB_OK);
                KVT_EQ(kvb_invalidate(g4, &h[i], 1, NULL), KVB_OK);
            }
        }
        if (!fired) break;
    }
    KVT_CHECK(enomem >= 1);
    kvb_pool_destroy(g1);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

/* The pipelined small commands (GETRANGE of a lookup, the GETs of a read, the DELs after it) are built
 * in the client's out buffer before anything is sent: with each allocation failing in turn, a lookup and
 * a read end in KVO_OK, a miss or KVO_ENOMEM, never an I/O error, and the connection is kept. Before,
 * the out buffer failing to grow was "connection lost mid-batch: out of memory": KVO_EIO, an io_error
 * for each copy and the node dropped, though nothing had been sent. */
static void test_out_buffer_out_of_memory(void)
{
    enum { KEYS = 200 };
    rf_server s;
    char addr[64];
    static kvb_hash h[KEYS];
    static uint32_t idx[KEYS];
    static int results[KEYS];
    int enomem = 0;
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *mem = of_mem_pool(KEYS, KVB_LAYOUT_BLOCK_CONTIGUOUS), *g4 = of_meta_pool(16);
    for (uint32_t i = 0; i < KEYS; i++) {
        h[i].lo = 7000u + i; /* never written: lookups and reads miss */
        h[i].hi = 61;
        idx[i] = i;
    }
    for (long at = 0;; at++) {
        size_t n = 99;
        int fired;
        kvo_backend *b = redis_open(addr, g4, 0);
        if (!b) break;
        KVT_EQ(kvo_redis_lookup(b, h, 1, &n), KVO_OK); /* connected; the out buffer is small yet */
        oom_arm(at, 0);
        int jr = run_job(b, g4, mem, idx, idx, h, KEYS, results);
        kvo_result lr = kvo_redis_lookup(b, h, KEYS, &n);
        fired = oom_fired;
        oom_disarm();
        KVT_CHECK(lr == KVO_OK || lr == KVO_ENOMEM);
        KVT_EQ(n, 0);
        KVT_CHECK(jr == KVO_ENOTFOUND || jr == KVO_ENOMEM);
        size_t other = 0;
        for (size_t i = 0; i < KEYS; i++) other += results[i] != KVO_ENOTFOUND && results[i] != KVO_ENOMEM;
        KVT_EQ(other, 0);
        enomem += lr == KVO_ENOMEM || jr == KVO_ENOMEM;
        kvo_redis_stats rs = rstats(b);
        KVT_EQ(rs.io_errors, 0);
        KVT_EQ(rs.disconnects, 0);
        KVT_EQ(rs.connects, 1);
        kvo_backend_destroy(b);
        if (!fired) break;
    }
    KVT_CHECK(enomem >= 2);
    kvb_pool_destroy(mem);
    kvb_pool_destroy(g4);
    rf_stop(&s);
}

/* A server whose values are damaged (GET: 3 bytes) and that drops the connection at the DEL that follows:
 * the read is a miss (KVO_ECHECKSUM, one checksum error) and no copy failed on the connection, so no
 * io_error. The DEL's lost connection used to be added to io_errors: the damaged copy was counted both
 * as a checksum error and as an I/O error. */
static const char *damaged_answer(script_server *sv, const char *name, const char *key, char *out, size_t size)
{
    (void)sv;
    (void)key;
    (void)out;
    (void)size;
    if (!strcmp(name, "PING")) return "+PONG\r\n";
    if (!strcmp(name, "CLUSTER")) return "-ERR This instance has cluster support disabled\r\n";
    if (!strcmp(name, "GET")) return "$3\r\nabc\r\n";
    if (!strcmp(name, "DEL")) return NULL; /* connection closed */
    return "-ERR unknown\r\n";
}

static void test_damaged_entry_delete_lost(void)
{
    scripted s;
    memset(&s, 0, sizeof s);
    if (!scripted_start(&s, damaged_answer)) return;
    kvb_pool *mem = s.mem, *g4 = s.g4;
    kvo_backend *b = scripted_connect(&s);
    if (b) {
        kvb_hash h[1] = {{12, 2}};
        uint32_t idx[1] = {0};
        int results[1] = {0};
        KVT_EQ(run_job(b, g4, mem, idx, idx, h, 1, results), KVO_ECHECKSUM);
        KVT_EQ(results[0], KVO_ECHECKSUM);
        kvo_redis_stats st = rstats(b);
        KVT_EQ(st.checksum_errors, 1);
        KVT_EQ(st.io_errors, 0);
        KVT_EQ(st.gets, 0);
        KVT_EQ(st.disconnects, 1); /* the DEL's connection went: counted there */
    }
    scripted_stop(&s);
}

/* A server that lets the first connection in, closes it at its SET (lost mid-batch), then closes every
 * later connection in its handshake: at AUTH when drop_auth, else at PING. */
static const char *lost_hello_answer(script_server *sv, const char *name, const char *key, char *out, size_t size)
{
    (void)key;
    (void)out;
    (void)size;
    if (!strcmp(name, "AUTH")) return sv->pings && sv->drop_auth ? NULL : "+OK\r\n";
    if (!strcmp(name, "PING")) return sv->pings++ ? NULL : "+PONG\r\n";
    if (!strcmp(name, "CLUSTER")) return "-ERR This instance has cluster support disabled\r\n";
    return NULL; /* SET: connection closed */
}

/* A reconnect whose AUTH or PING is lost on the connection is one failed connect: counted in
 * connect_failures only. It used to count a disconnect as well (the handshake's call dropped a
 * connection that had never been up). */
static void reconnect_lost_in_handshake(int on_auth)
{
    scripted s;
    memset(&s, 0, sizeof s);
    s.sv.drop_auth = on_auth;
    if (!scripted_start(&s, lost_hello_answer)) return;
    kvb_pool *mem = s.mem, *g4 = s.g4;
    s.rc.password = on_auth ? "hello-test-pw" : NULL;
    s.rc.reconnect_min_ms = s.rc.reconnect_max_ms = 60000; /* the third job finds the node backing off */
    kvo_backend *b = scripted_connect(&s);
    if (b) {
        kvb_hash h[1] = {{41, 4}};
        uint32_t idx[1] = {0};
        int results[1] = {0};
        kvb_block bl[1];
        KVT_EQ(kvb_alloc(mem, 1, bl), KVB_OK);
        KVT_EQ(run_job(b, mem, g4, idx, idx, h, 1, results), KVO_EIO); /* lost at the SET */
        kvo_redis_stats lost = rstats(b);
        KVT_EQ(lost.disconnects, 1);
        KVT_EQ(lost.connect_failures, 0);
        KVT_EQ(run_job(b, mem, g4, idx, idx, h, 1, results), KVO_EIO); /* the reconnect, lost in AUTH/PING */
        kvo_redis_stats failed = rstats(b);
        KVT_EQ(failed.connect_failures, 1);
        KVT_EQ(failed.disconnects, 1);
        KVT_EQ(failed.connects, lost.connects);
        KVT_EQ(run_job(b, mem, g4, idx, idx, h, 1, results), KVO_EIO); /* backing off: no attempt */
        kvo_redis_stats waiting = rstats(b);
        KVT_EQ(waiting.connect_failures, 1);
        KVT_EQ(waiting.disconnects, 1);
        KVT_EQ(waiting.io_errors, 3);
    }
    scripted_stop(&s);
    KVT_EQ(s.sv.pings, on_auth ? 1 : 2);
}

static void test_reconnect_lost_in_handshake(void)
{
    reconnect_lost_in_handshake(0);
    reconnect_lost_in_handshake(1);
}

/* config.pool is the G4 tier, a metadata-only pool: one with storage is refused at create (KVO_EINVAL,
 * with a reason), as kvo_redis_import refuses it. It used to be taken: its blocks' bytes were never
 * written (the copies go to Redis), and kvo_redis_manager_lookup, whose import into it always failed,
 * silently never found what Redis held. */
static void test_pool_with_storage_refused(void)
{
    rf_server s;
    char addr[64];
    if (!rf_start(&s, NULL)) {
        KVT_CHECK(!"redis-server did not start");
        return;
    }
    server_addr(s.port, addr, sizeof addr);
    kvb_pool *mem = of_mem_pool(4, KVB_LAYOUT_BLOCK_CONTIGUOUS);
    kvo_backend *b = (kvo_backend *)1;
    kvo_redis_config rc = rconfig(addr, mem, 0);
    g_err[0] = 0;
    KVT_EQ(kvo_redis_backend_create(&rc, &b), KVO_EINVAL);
    KVT_CHECK(b == NULL);
    KVT_CHECK(strstr(g_err, "metadata-only") != NULL);
    if (b && b != (kvo_backend *)1) kvo_backend_destroy(b);
    kvb_pool_destroy(mem);
    rf_stop(&s);
}

static void test_servers_skipped(void) { KVT_SKIP("redis-server not installed"); }

int main(int argc, char **argv)
{
    if (argc == 4 && (!strcmp(argv[1], "engine-a") || !strcmp(argv[1], "engine-b"))) {
        rf_watchdog(30);
        if (!strcmp(argv[1], "engine-a")) engine_a(atoi(argv[2]), argv[3]);
        else engine_b(atoi(argv[2]), argv[3]);
        return kvt__cur_failed ? 1 : 0;
    }
    rf_watchdog(90);
    KVT_RUN(test_crc16_and_slots);
    KVT_RUN(test_key_format);
    KVT_RUN(test_no_server);
    KVT_RUN(test_backoff_saturates);
    KVT_RUN(test_create_out_of_memory);
    if (!rf_have_redis()) {
        KVT_RUN(test_servers_skipped);
        return kvt_summary();
    }
    KVT_RUN(test_two_processes);
    KVT_RUN(test_connector_g4);
    KVT_RUN(test_cluster);
    KVT_RUN(test_cluster_slots_assigned_later);
    KVT_RUN(test_cluster_unreachable_worker);
    KVT_RUN(test_cluster_import_node_lost);
    KVT_RUN(test_cluster_moved_stale_map);
    KVT_RUN(test_kill_and_restart);
    KVT_RUN(test_corrupt_and_tenants);
    KVT_RUN(test_other_format_version);
    KVT_RUN(test_wrong_type_value);
    KVT_RUN(test_server_eviction);
    KVT_RUN(test_lost_entry_dropped);
    KVT_RUN(test_remote_bounds);
    KVT_RUN(test_gather_out_of_memory);
    KVT_RUN(test_out_buffer_out_of_memory);
    KVT_RUN(test_damaged_entry_delete_lost);
    KVT_RUN(test_pool_with_storage_refused);
    KVT_RUN(test_stray_reply);
    KVT_RUN(test_reply_data_left_after_a_batch);
    KVT_RUN(test_reconnect_lost_in_handshake);
    KVT_RUN(test_log_reads_stats);
    KVT_RUN(test_auth);
    rf_kill_all();
    return kvt_summary();
}
