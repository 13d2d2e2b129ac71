/* kvremote.h — the G4 tier of kvcache: KV blocks in Redis (one server or a Redis Cluster), shared by
 * every engine process that points at the same servers (part of kvcache)
 *
 * Do this in exactly one C file:     #define KVO_WITH_REDIS
 *                                     #define KVREMOTE_IMPLEMENTATION      (or KVCACHE_IMPLEMENTATION)
 *                                     #include "kvremote.h"
 * and link with -lhiredis (Debian: libhiredis-dev; `make deps` installs it and redis-server). It includes
 * kvoffload.h (define its implementation macros there too, or KVCACHE_IMPLEMENTATION for all). Needs
 * C11, POSIX threads and sockets, _GNU_SOURCE (MSG_NOSIGNAL, MSG_MORE; defined by the implementation
 * unless a system header came first: then pass -D_GNU_SOURCE, as an #error says).
 * Without KVO_WITH_REDIS nothing needs hiredis: the declarations stay, and the implementation macro
 * compiles stubs whose create fails with KVO_ENOREMOTE, so a program can offer the remote tier as an
 * option and still build where hiredis is missing. kvcache.h carries this header whole (same macros).
 *
 * Manual: 1. Quick start  2. Concepts  3. Keys and values  4. Redis Cluster  5. Security  6. Faults
 *         7. Configuration  8. Thread safety  9. Errors
 *
 * 1. QUICK START — G1 (device) -> G2 (host) -> G4 (Redis), and a second process finding the blocks
 *
 *     kvb_pool *g4;   // metadata-only pool: the remote tier as this process knows it
 *     kvo_redis_config rc = { .servers = "127.0.0.1:6379", .namespace_prefix = "llama3-8b",
 *                             .salt = tenant, .pool = g4, .layout = host_layout, .threads = 1 };
 *     kvo_backend *redis;  kvo_redis_backend_create(&rc, &redis);
 *     kvo_manager_config mc = { .num_tiers = 3, .pools = {g1, g2, g4},
 *                               .down = {mem, redis}, .up = {NULL, mem, redis} };
 *     ... offer blocks to the manager as usual: eager mode copies G2 -> G4 ...
 *     // any process: longest prefix over G1, G2 and what Redis holds (tier_of[i]: the fastest tier
 *     // holding block i), then load what G4 holds; a process that just started finds it all there
 *     kvo_redis_manager_lookup(manager, redis, hashes, n, tier_of, &found);
 *     for (k = 0; k < found && tier_of[k] == 2; k++) {}
 *     if (k) kvo_manager_onboard(manager, 2, hashes, k, &t);   // blocks from k on: their own tiers
 *
 * 2. CONCEPTS
 * The G4 tier is a metadata-only kvb pool plus the Redis servers. A block of that pool stands for one
 * remote entry: being there means this process knows the entry was written (by itself, or found by
 * kvo_redis_import). Its block index means nothing; the entry is found by the block's hash. So the
 * pipelines, kvo_manager_lookup and kvo_onboard work on G4 unchanged: offloading into G4 SETs the
 * blocks, onboarding from G4 GETs them. Entries other processes wrote are learnt with
 * kvo_redis_import (or kvo_redis_manager_lookup, which imports what lies past the local prefix).
 * Capacity and eviction are Redis's own (maxmemory with allkeys-lru): an entry Redis evicted stays
 * known in the G4 pool until a read finds it gone; that read fails the copy with KVO_ENOTFOUND, a miss
 * like any other, and the pipeline drops the block from the G4 pool (kvoffload.h, section 4), so
 * lookups stop finding it there; it is stored again when it next lands in the tier G4 is fed from (an
 * offer of a block that tier still holds stops there). kvo_redis_lookup always asks the servers.
 * Every batch is one round trip: the commands of a job go out pipelined (to each node its share), then
 * the replies are read (reads of more than window_bytes of values per node take a round trip per
 * window). Block bytes go from the pool's memory straight to the socket, and from the socket straight
 * into the destination block, when the block is one contiguous run (BLOCK_CONTIGUOUS); other layouts
 * go through one gather buffer, made at a client's first such batch (out of memory, that batch's copies
 * fail with KVO_ENOMEM and the connection is kept).
 *
 * 3. KEYS AND VALUES
 * Key:   <namespace_prefix>:<salt as 16 hex digits>:<hash.hi as 16 hex><hash.lo as 16 hex>
 *        e.g. kvcache:0000000000000007:52360e9a53096b1e4f0aa23360eabece (kvo_redis_format_key; the
 *        hash is H7 of kvblock.h section 3).
 * Value: a 64-byte header, then the block bytes in canonical order (layer by layer, K then V, one page
 *        each), so pools of either layout read and write the same values. Header, little-endian:
 *        0 magic "KVR1"  4 u16 format version (2)  6 u16 flags (0)  8 u32 layers  12 u32 parts
 *        16 u64 page bytes  24 u64 block bytes  32 u64 hash.lo  40 u64 hash.hi
 *        48 u64 kvo_checksum(data)  56 u64 kvo_checksum(header bytes 0..55)
 *        Layers, parts and page bytes are the layout code: a reader with another layout sees a miss.
 * Every read checks the whole header and the data checksum: a mismatch fails that copy with
 * KVO_ECHECKSUM (a miss), counts a checksum error, and never lets wrong bytes through (a destination
 * block that received them is never registered). A damaged entry (a key holding another type than a
 * string included) is deleted; an intact one written with another layout or format version is left
 * alone.
 * Version 1 was kvcache 0.1, whose block hashes (kvblock.h section 3) differ from 0.2's: a 0.2 engine
 * never asks for 0.1's keys (its hashes of the same prompt are other values), and a value of the other
 * version reads as a miss even under the same key; entries 0.1 left age out under Redis's maxmemory
 * policy. Engines that should share blocks run the same version.
 *
 * 4. REDIS CLUSTER
 * `servers` is a seed list "host:port,host:port" (a leading "redis://" is accepted). At create the first
 * seed that answers is asked CLUSTER SLOTS: a server with cluster support disabled is used as a single
 * server (config.cluster: 0 detect, 1 require a cluster, -1 never). In a cluster each key goes to the
 * node owning its hash slot (CRC16/XMODEM of the key, or of its {hash tag}, mod 16384; see
 * kvo_redis_key_slot), a batch is split per node (one pipeline each, all nodes written before any is
 * read), MOVED gives the slot to the node named at once, then asks that node first for the whole map
 * (CLUSTER SLOTS: another node may not know of the move yet; the keys redirected go to the node named
 * whatever map comes back), ASK sends ASKING then the command to the node named, without changing the
 * map. A key whose slot the map gives no node asks for the map again (once a batch) and fails with
 * KVO_EREMOTE only if no node serves it still. A key redirected more than max_redirects times fails
 * with KVO_EREMOTE.
 *
 * 5. SECURITY
 * AUTH with `password` (and `username` for an ACL user), or with the value of the environment variable
 * named by `password_env` (e.g. "KVCACHE_REDIS_PASSWORD"; set but empty counts as none). The password
 * is sent on every new connection and never written to a log, a message or an error; the backend's
 * copy is wiped at destroy. A refused password fails create with KVO_EAUTH and a message naming the
 * server ("AUTH refused: WRONGPASS ..."); a server that wants a password when none was given fails it
 * with KVO_EAUTH too ("requires a password"). The namespace includes the tenant salt: tenants with
 * different salts never read each other's blocks, even for the same hashes.
 *
 * 6. FAULTS
 * Connect and command timeouts bound every call (a job never hangs). A connection lost or timed out
 * mid-batch fails the copies of that node with KVO_EIO and a message saying which server and why
 * ("connection lost mid-batch: ..."), so the pipeline marks those transfers Failed; the other tiers are
 * untouched. Copies whose cluster slot has no known node fail the same way (KVO_EIO, the last node's
 * reason) while no node can be asked for the map. The next job reconnects; after a failed connect, that
 * node is not tried again before a backoff (reconnect_min_ms, doubling up to reconnect_max_ms), and jobs
 * meanwhile fail at once ("down ...; next reconnect attempt in N ms"). Reply data left on a connection
 * once a batch has read its replies (a reply no command asked for) means the answers may not have been
 * the commands' own: that node's copies of the batch fail with KVO_EIO ("reply data no command asked
 * for ..."), nothing they read is counted, and the connection is dropped (the next job reconnects).
 * Commands are written with send(MSG_NOSIGNAL): a closed connection never raises SIGPIPE.
 *
 * 7. CONFIGURATION — see kvo_redis_config below; zero fields take the defaults given there.
 *
 * 8. THREAD SAFETY — submit, lookup, import and stats are safe from any thread. With threads = 0 jobs
 * run inline in submit (for poll mode); otherwise each worker has its own connections. Lookups and
 * imports use one more set of connections, shared under a lock with inline jobs. The log callback runs
 * with a set of connections locked: it may call kvo_redis_backend_stats (which takes no such lock), not
 * lookup, import or (threads = 0) submit.
 *
 * 9. ERRORS — kvo_result codes, plus the remote ones below (kvo_redis_result_string names them all):
 * KVO_EAUTH, KVO_ECONNECT (no server reachable at create), KVO_EREMOTE (an error reply, a cluster that
 * does not serve the slot, too many redirects), KVO_ENOREMOTE (built without KVO_WITH_REDIS). An entry
 * not in Redis is KVO_ENOTFOUND (a miss; a kvo_result since the pipeline drops such a block, its value
 * unchanged), lost connections are KVO_EIO, bad values KVO_ECHECKSUM.
 */
/* POSIX for the implementations (clock_gettime, preadv, sockets, O_DIRECT): asked of the C library before
 * it reads its first header. A system header included earlier has fixed what it declares (glibc's
 * features.h), so then the compile stops here with the flag to add instead of deep inside the code. */
#if defined(KVCACHE_IMPLEMENTATION) || defined(KVOFFLOAD_IMPLEMENTATION) || defined(KVSCHED_IMPLEMENTATION) || \
    defined(KVREMOTE_IMPLEMENTATION)
#if !defined(_GNU_SOURCE) && !defined(_FEATURES_H)
#define _GNU_SOURCE
#elif defined(__GLIBC__) && !defined(_DEFAULT_SOURCE) && !defined(KVCACHE__POSIX_MISSING)
#define KVCACHE__POSIX_MISSING /* one #error, and the implementations below are left out */
#error "kvcache: a system header was included before the implementation without POSIX: compile with -D_GNU_SOURCE"
#endif
#endif
#ifndef KVREMOTE_H
#define KVREMOTE_H
#define KVREMOTE_VERSION_MAJOR 0
#define KVREMOTE_VERSION_MINOR 2
#define KVREMOTE_VERSION_PATCH 0

#include "kvoffload.h"

#define KVO_EAUTH (-121)     /* the server refused the credentials, or wants some */
#define KVO_ECONNECT (-122)  /* no server of the seed list could be reached */
/* KVO_ENOTFOUND (-123), the entry is not in Redis (evicted, expired, never written), is kvoffload.h's */
#define KVO_EREMOTE (-124)   /* an error reply from the server, or a slot no node serves */
#define KVO_ENOREMOTE (-125) /* built without KVO_WITH_REDIS */

#define KVO_REDIS_HEADER_BYTES 64
#define KVO_REDIS_MAX_PREFIX 128                          /* namespace prefix length */
#define KVO_REDIS_KEY_MAX (KVO_REDIS_MAX_PREFIX + 52 + 1) /* longest key plus its NUL */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvo_redis_config {
    const char *servers;          /* "host:port[,host:port...]", default "127.0.0.1:6379" */
    int cluster;                  /* 0 = detect, 1 = require a cluster, -1 = a single server */
    const char *namespace_prefix; /* default "kvcache": e.g. the model; at most 128 characters */
    uint64_t salt;                /* tenant salt, part of every key */
    kvb_pool *pool;               /* required: the G4 tier, a metadata-only pool */
    kvb_layout layout;            /* required: layout of the memory pools it copies to and from
                                     (page_bytes; layers default 1, parts 2; the kind does not matter) */
    const char *password;         /* optional AUTH password */
    const char *password_env;     /* optional: environment variable holding it, used when password is
                                     NULL; unset = KVO_EINVAL at create */
    const char *username;         /* optional ACL user */
    uint32_t connect_timeout_ms;  /* default 1000 */
    uint32_t command_timeout_ms;  /* default 5000: longest wait for one read or write on a socket */
    uint32_t reconnect_min_ms;    /* backoff after a failed connect, default 100, doubling ... */
    uint32_t reconnect_max_ms;    /* ... up to this, default 5000 */
    uint32_t max_redirects;       /* per key, default 5 */
    uint64_t window_bytes;        /* values asked of one node per round trip, default 64 MiB: Redis holds
                                     pending replies in memory that counts against maxmemory, so a
                                     bigger read batch takes more round trips instead */
    uint32_t ttl_s;               /* 0 = no expiry (default), else SET ... EX ttl_s */
    uint32_t threads;             /* worker threads, 0 = inline in submit; at most 64 */
    kvo_log_fn log;               /* connection lost / back, bad values; default stderr */
    void *log_user;
    char *error;                  /* optional: why create failed (never holds the password) */
    size_t error_size;
} kvo_redis_config;

typedef struct kvo_redis_stats {
    uint64_t puts, gets;                 /* copies that succeeded */
    uint64_t bytes_put, bytes_got;       /* block bytes */
    uint64_t misses;                     /* reads of entries Redis does not have */
    uint64_t checksum_errors;            /* values with a bad header or checksum (reads and lookups) */
    uint64_t io_errors;                  /* copies failed by a lost, refused or timed out connection */
    uint64_t remote_errors;              /* copies failed by an error reply */
    uint64_t lookups, lookup_keys, lookup_errors;
    uint64_t imported;                   /* blocks registered in the G4 pool by import */
    uint64_t moved, ask, slot_refreshes; /* cluster redirects followed, CLUSTER SLOTS asked */
    uint64_t connects;                   /* connections made (connected, AUTH and PING answered) */
    uint64_t connect_failures;           /* attempts that failed: refused, timed out, or AUTH/PING not
                                            answered or refused; each attempt counted once */
    uint64_t disconnects;                /* connections that were up and were lost or dropped */
    uint32_t nodes;                      /* servers known (control connections, as of their last use) */
    int cluster;                         /* 1 when talking to a cluster */
} kvo_redis_stats;

/* The Redis backend for the G4 tier: copies memory pool -> config.pool (SET) and config.pool -> memory
 * pool (GET), keyed by the jobs' hashes. Connects at once (AUTH, cluster detection): KVO_ECONNECT when
 * no seed answers, KVO_EAUTH for credentials, KVO_EINVAL for a bad config; the reason goes to
 * config.error. Thread safety: any thread. Free with kvo_backend_destroy. */
KVO_API kvo_result kvo_redis_backend_create(const kvo_redis_config *config, kvo_backend **out);
KVO_API kvo_result kvo_redis_backend_stats(kvo_backend *redis, kvo_redis_stats *out);

/* Longest prefix of `hashes` whose entries are in Redis now (one pipelined GETRANGE of the headers per
 * node). A server that cannot be asked ends the prefix there and its error is returned (with the
 * prefix found before it). Thread safety: any thread. */
KVO_API kvo_result kvo_redis_lookup(kvo_backend *redis, const kvb_hash *hashes, size_t n, size_t *out_prefix);

/* Registers in g4_pool (normally config.pool) the prefix of `hashes` present in Redis, so that
 * kvo_manager_lookup and onboarding from G4 see entries other processes wrote. parents may be NULL:
 * then each block's parent is the previous hash (the first's is the root). Blocks already in the pool
 * stay as they are (in a pool short of room the new ones may take the place of some). KVO_EINVAL for a
 * pool with storage (the import copies no bytes). *out_n = length of the prefix the pool holds after
 * the import. A server that cannot be asked ends the prefix there, as in kvo_redis_lookup: what was
 * found before it is imported (*out_n counts it) and the server's error is returned (KVO_EIO,
 * KVO_EREMOTE...), so a result other than KVO_OK with *out_n > 0 is a prefix that may be short.
 * Thread safety: any thread. */
KVO_API kvo_result kvo_redis_import(kvo_backend *redis, kvb_pool *g4_pool, const kvb_hash *hashes,
                                    const kvb_hash *parents, size_t n, size_t *out_n);

/* kvo_manager_lookup that includes what Redis holds: the hashes past the local prefix are imported
 * (kvo_redis_import into the backend's pool, which must be one of the manager's tiers: KVO_EINVAL
 * otherwise), then the manager looks again. An unreachable Redis leaves the local answer, one reachable
 * in part adds what it found before the server it could not ask (KVO_OK; counted in lookup_errors).
 * Thread safety: any thread. */
KVO_API kvo_result kvo_redis_manager_lookup(kvo_manager *manager, kvo_backend *redis, const kvb_hash *hashes,
                                            size_t n, uint8_t *tier_of, size_t *out_n);
/* The same with the backend as user data first: the shape of kvsched.h's kvs_lookup_fn, so a connector
 * or scheduler looks up device, host, disk, then Redis (config.lookup = kvo_redis_tiers_lookup,
 * config.lookup_user = the Redis backend). Thread safety: any thread. */
KVO_API kvo_result kvo_redis_tiers_lookup(void *redis, kvo_manager *manager, const kvb_hash *hashes, size_t n,
                                          uint8_t *tier_of, size_t *out_n);

/* The key of a block: written to buf (NUL-terminated) when it fits; returns its length (0 on error). */
KVO_API size_t kvo_redis_key(kvo_backend *redis, const kvb_hash *hash, char *buf, size_t size);
KVO_API size_t kvo_redis_format_key(const char *namespace_prefix, uint64_t salt, const kvb_hash *hash, char *buf,
                                    size_t size);
/* CRC16/XMODEM (poly 0x1021, init 0): "123456789" -> 0x31c3; NULL data counts as no bytes. Pure. */
KVO_API uint16_t kvo_redis_crc16(const void *data, size_t len);
/* Redis Cluster hash slot of a key (0 .. 16383), {hash tags} included; NULL is the empty key. Pure. */
KVO_API uint16_t kvo_redis_key_slot(const char *key, size_t len);
/* Name of a kvo_result, kvb_result or remote code. Pure. */
KVO_API const char *kvo_redis_result_string(int result);

#ifdef __cplusplus
}
#endif
#endif /* KVREMOTE_H */

/* ================================================================================================ */
/*                                        IMPLEMENTATION                                            */
/* ================================================================================================ */
#if (defined(KVREMOTE_IMPLEMENTATION) || defined(KVCACHE_IMPLEMENTATION)) && !defined(KVCACHE__POSIX_MISSING)
#ifndef KVREMOTE_IMPL_INCLUDED
#define KVREMOTE_IMPL_INCLUDED
#if defined(KVO_STATIC) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* a program uses only some of the API */
#define KVO__R_POP_DIAGNOSTICS
#endif

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* snprintf for messages: cut to fit, on purpose (a host name or a reply may be long). */
static int kvo__rmsg(char *buf, size_t size, const char *fmt, ...)
{
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(buf, size, fmt, ap);
    va_end(ap);
    return n;
}

#ifdef KVB_MALLOC
#define KVO__RALLOC(sz) KVB_MALLOC(sz)
#define KVO__RFREE(p) KVB_FREE(p)
#else
#define KVO__RALLOC(sz) malloc(sz)
#define KVO__RFREE(p) free(p)
#endif

KVO_API const char *kvo_redis_result_string(int result)
{
    switch (result) {
    case KVO_EAUTH: return "remote server refused the credentials (AUTH)";
    case KVO_ECONNECT: return "cannot connect to the remote server";
    case KVO_ENOTFOUND: return "block not in the remote store (evicted or never written)";
    case KVO_EREMOTE: return "remote server error";
    case KVO_ENOREMOTE: return "remote tier not built in (define KVO_WITH_REDIS, link -lhiredis)";
    default: return kvo_result_string(result);
    }
}

KVO_API uint16_t kvo_redis_crc16(const void *data, size_t len)
{
    const unsigned char *p = (const unsigned char *)data;
    uint16_t crc = 0;
    size_t i;
    int b;
    if (!p) return 0; /* no bytes: the CRC of none */
    for (i = 0; i < len; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (b = 0; b < 8; b++) crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

KVO_API uint16_t kvo_redis_key_slot(const char *key, size_t len)
{
    size_t s, e;
    if (!key) return 0; /* the empty key's slot */
    for (s = 0; s < len && key[s] != '{'; s++) {
    }
    if (s < len) {
        for (e = s + 1; e < len && key[e] != '}'; e++) {
        }
        if (e < len && e != s + 1) return (uint16_t)(kvo_redis_crc16(key + s + 1, e - s - 1) & 16383);
    }
    return (uint16_t)(kvo_redis_crc16(key, len) & 16383);
}

KVO_API size_t kvo_redis_format_key(const char *namespace_prefix, uint64_t salt, const kvb_hash *hash, char *buf,
                                    size_t size)
{
    int len;
    if (!hash || !buf || !size) return 0;
    if (!namespace_prefix) namespace_prefix = "kvcache";
    if (strlen(namespace_prefix) > KVO_REDIS_MAX_PREFIX) return 0;
    len = kvo__rmsg(buf, size, "%s:%016llx:%016llx%016llx", namespace_prefix, (unsigned long long)salt,
                   (unsigned long long)hash->hi, (unsigned long long)hash->lo);
    if (len < 0 || (size_t)len >= size) return 0;
    return (size_t)len;
}

static void kvo__rsay_error(const kvo_redis_config *config, const char *msg)
{
    if (config && config->error && config->error_size) kvo__rmsg(config->error, config->error_size, "%s", msg);
}

KVO_API kvo_result kvo_redis_tiers_lookup(void *redis, kvo_manager *manager, const kvb_hash *hashes, size_t n,
                                          uint8_t *tier_of, size_t *out_n)
{
    return kvo_redis_manager_lookup(manager, (kvo_backend *)redis, hashes, n, tier_of, out_n);
}

#ifndef KVO_WITH_REDIS
/* ---- stubs: built without hiredis --------------------------------------------------------------- */

KVO_API kvo_result kvo_redis_backend_create(const kvo_redis_config *config, kvo_backend **out)
{
    if (out) *out = NULL;
    kvo__rsay_error(config, "kvremote.h: built without the remote tier (define KVO_WITH_REDIS and link -lhiredis)");
    return (kvo_result)KVO_ENOREMOTE;
}

KVO_API kvo_result kvo_redis_backend_stats(kvo_backend *redis, kvo_redis_stats *out)
{
    (void)redis;
    if (out) memset(out, 0, sizeof *out);
    return (kvo_result)KVO_ENOREMOTE;
}

KVO_API kvo_result kvo_redis_lookup(kvo_backend *redis, const kvb_hash *hashes, size_t n, size_t *out_prefix)
{
    (void)redis;
    (void)hashes;
    (void)n;
    if (out_prefix) *out_prefix = 0;
    return (kvo_result)KVO_ENOREMOTE;
}

KVO_API kvo_result kvo_redis_import(kvo_backend *redis, kvb_pool *g4_pool, const kvb_hash *hashes,
                                    const kvb_hash *parents, size_t n, size_t *out_n)
{
    (void)redis;
    (void)g4_pool;
    (void)hashes;
    (void)parents;
    (void)n;
    if (out_n) *out_n = 0;
    return (kvo_result)KVO_ENOREMOTE;
}

KVO_API kvo_result kvo_redis_manager_lookup(kvo_manager *manager, kvo_backend *redis, const kvb_hash *hashes,
                                            size_t n, uint8_t *tier_of, size_t *out_n)
{
    (void)redis;
    return kvo_manager_lookup(manager, hashes, n, tier_of, out_n);
}

KVO_API size_t kvo_redis_key(kvo_backend *redis, const kvb_hash *hash, char *buf, size_t size)
{
    (void)redis;
    (void)hash;
    if (buf && size) buf[0] = 0;
    return 0;
}

#else /* KVO_WITH_REDIS */
/* ---- the Redis backend -------------------------------------------------------------------------- */

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <hiredis/hiredis.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif
#ifndef MSG_MORE
#define MSG_MORE 0
#endif
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

#define KVO__R_MAGIC 0x3152564bu /* "KVR1" */
#define KVO__R_VERSION 2u /* 2 since 0.2, whose block hashes differ (manual section 3) */
#define KVO__R_PENDING 1
#define KVO__R_NO_NODE 0xffffu
#define KVO__R_SLOTS 16384
#define KVO__R_RBUF (256u * 1024u)
#define KVO__R_MSG 256

enum { KVO__OP_SET = 0, KVO__OP_GET, KVO__OP_HEAD, KVO__OP_DEL };

typedef struct kvo__rnode {
    char host[256];
    int port;
    redisContext *c;      /* NULL while not connected */
    uint64_t next_try_us; /* no connect before this */
    uint32_t backoff_ms;
    int said_down;        /* the loss was logged */
    char why[160];        /* the last connection error */
} kvo__rnode;

typedef struct kvo__rclient { /* one set of connections: a worker's, or the shared control one */
    pthread_mutex_t lock;
    kvo__rnode *nodes;
    size_t n_nodes, cap_nodes;
    uint16_t *slot_node; /* cluster: node of each slot, KVO__R_NO_NODE when unknown */
    int have_map;
    char *rbuf;          /* receive chunk */
    size_t rpos, rlen;   /* GET replies: bytes of rbuf received, not parsed yet */
    unsigned char *gather; /* one block in canonical order */
    char *out;           /* small commands of one node, pipelined */
    size_t out_len, out_cap;
} kvo__rclient;

typedef struct kvo__redis {
    kvo_backend base;
    kvo_redis_config cfg;
    char *servers, *prefix, *password, *username;
    kvb_pool *pool;
    kvb_layout layout;
    uint64_t block_bytes;
    int cluster;
    char single_host[256]; /* a single server: the seed that answered */
    int single_port;
    kvo__rclient *clients; /* [0, threads): workers; [threads]: control and inline jobs */
    uint32_t n_clients;
    kvo_queue *jobs;
    pthread_t *threads;
    uint32_t n_threads;    /* workers asked for (their clients come first) */
    uint32_t n_started;    /* worker threads running */
    pthread_mutex_t stats_lock;
    kvo_redis_stats stats;
} kvo__redis;

typedef struct kvo__rgeom {
    unsigned char *base;
    kvb_layout layout;
    uint32_t num_blocks;
    uint64_t block_bytes;
} kvo__rgeom;

typedef struct kvo__ritem {
    char key[KVO_REDIS_KEY_MAX];
    size_t klen;
    uint16_t slot;
    int result;        /* KVO__R_PENDING until known */
    int ask;           /* node to send ASKING to, -1 = none */
    int node;          /* node of the current round */
    uint32_t redirects;
    int moved;         /* node this round's MOVED named, -1 = none */
    uint32_t block;    /* memory block (SET: source, GET: destination) */
    int corrupt;       /* a damaged value (not one of another layout): deleted after the batch */
} kvo__ritem;

typedef struct kvo__rop {
    kvo__redis *r;
    kvo__rclient *cl;
    int kind;
    kvo__ritem *items;
    size_t n;
    const kvb_hash *hashes;
    kvo__rgeom mem;
    uint64_t bytes;
    int moved_to;          /* node the round's last MOVED named (the map is asked of it), -1 = none */
    int tryagain;
    int asked_unserved;    /* the map was asked again for a slot it gave no node */
    char msg[KVO__R_MSG];  /* the first failure */
    kvo_redis_stats delta; /* counted under stats_lock at the end */
} kvo__rop;

/* ---- small helpers ------------------------------------------------------------------------------ */

static uint64_t kvo__rnow_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void kvo__rsleep_ms(uint32_t ms)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(ms / 1000u);
    ts.tv_nsec = (long)(ms % 1000u) * 1000000L;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void kvo__rput(unsigned char *p, uint64_t v, int bytes)
{
    int i;
    for (i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t kvo__rget(const unsigned char *p, int bytes)
{
    uint64_t v = 0;
    int i;
    for (i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static char *kvo__rstrdup(const char *s)
{
    size_t n;
    char *d;
    if (!s) return NULL;
    n = strlen(s) + 1;
    d = (char *)KVO__RALLOC(n);
    if (d) memcpy(d, s, n);
    return d;
}

static void kvo__rwipe(char *s)
{
    volatile char *p = s;
    if (!s) return;
    while (*p) *p++ = 0;
}

static void kvo__rlog(kvo__redis *r, const char *msg)
{
    if (r->cfg.log) r->cfg.log(r->cfg.log_user, msg);
    else fprintf(stderr, "kvremote: %s\n", msg);
}

static struct timeval kvo__rtv(uint32_t ms)
{
    struct timeval tv;
    tv.tv_sec = (time_t)(ms / 1000u);
    tv.tv_usec = (suseconds_t)((ms % 1000u) * 1000u);
    return tv;
}

static int kvo__rgeom_of(kvb_pool *p, kvo__rgeom *g)
{
    void *base = NULL;
    kvb_pool_config c;
    memset(g, 0, sizeof *g);
    memset(&c, 0, sizeof c);
    if (kvb_pool_storage(p, &base, NULL, &g->block_bytes, &g->layout) != KVB_OK) return 0;
    kvb_pool_get_config(p, &c);
    g->base = (unsigned char *)base;
    g->num_blocks = c.num_blocks;
    return base != NULL;
}

static unsigned char *kvo__rpage(const kvo__rgeom *g, uint32_t block, uint32_t layer, uint32_t part)
{
    return g->base + kvb_layout_offset(&g->layout, g->num_blocks, block, layer, part);
}

/* The block as one run when the layout keeps it so, else NULL. */
static unsigned char *kvo__rrun(const kvo__rgeom *g, uint32_t block)
{
    return g->layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS ? kvo__rpage(g, block, 0, 0) : NULL;
}

static void kvo__rgather(const kvo__rgeom *g, uint32_t block, unsigned char *buf)
{
    uint32_t l, q;
    size_t page = (size_t)g->layout.page_bytes;
    for (l = 0; l < g->layout.num_layers; l++)
        for (q = 0; q < g->layout.num_parts; q++, buf += page) memcpy(buf, kvo__rpage(g, block, l, q), page);
}

static void kvo__rscatter(const kvo__rgeom *g, uint32_t block, const unsigned char *buf)
{
    uint32_t l, q;
    size_t page = (size_t)g->layout.page_bytes;
    if (g->layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS) {
        memcpy(kvo__rpage(g, block, 0, 0), buf, (size_t)g->block_bytes);
        return;
    }
    for (l = 0; l < g->layout.num_layers; l++)
        for (q = 0; q < g->layout.num_parts; q++, buf += page) memcpy(kvo__rpage(g, block, l, q), buf, page);
}

/* ---- values ------------------------------------------------------------------------------------- */

static void kvo__rheader(const kvo__redis *r, const kvb_hash *h, const unsigned char *data, unsigned char *hdr)
{
    kvo__rput(hdr, KVO__R_MAGIC, 4);
    kvo__rput(hdr + 4, KVO__R_VERSION, 2);
    kvo__rput(hdr + 6, 0, 2);
    kvo__rput(hdr + 8, r->layout.num_layers, 4);
    kvo__rput(hdr + 12, r->layout.num_parts, 4);
    kvo__rput(hdr + 16, r->layout.page_bytes, 8);
    kvo__rput(hdr + 24, r->block_bytes, 8);
    kvo__rput(hdr + 32, h->lo, 8);
    kvo__rput(hdr + 40, h->hi, 8);
    kvo__rput(hdr + 48, kvo_checksum(data, (size_t)r->block_bytes), 8);
    kvo__rput(hdr + 56, kvo_checksum(hdr, 56), 8);
}

/* A header is good when it is whole and names this format, layout, size and hash. */
static int kvo__rheader_ok(const kvo__redis *r, const kvb_hash *h, const unsigned char *hdr)
{
    return kvo__rget(hdr, 4) == KVO__R_MAGIC && kvo__rget(hdr + 4, 2) == KVO__R_VERSION &&
           kvo__rget(hdr + 56, 8) == kvo_checksum(hdr, 56) && kvo__rget(hdr + 8, 4) == r->layout.num_layers &&
           kvo__rget(hdr + 12, 4) == r->layout.num_parts && kvo__rget(hdr + 16, 8) == r->layout.page_bytes &&
           kvo__rget(hdr + 24, 8) == r->block_bytes && kvo__rget(hdr + 32, 8) == h->lo &&
           kvo__rget(hdr + 40, 8) == h->hi;
}

/* ---- connections -------------------------------------------------------------------------------- */

static void kvo__rclient_free(kvo__rclient *cl);

static int kvo__rclient_init(kvo__rclient *cl)
{
    size_t i;
    memset(cl, 0, sizeof *cl);
    if (pthread_mutex_init(&cl->lock, NULL) != 0) return 0;
    cl->slot_node = (uint16_t *)KVO__RALLOC(KVO__R_SLOTS * sizeof *cl->slot_node);
    cl->rbuf = (char *)KVO__RALLOC(KVO__R_RBUF);
    if (!cl->slot_node || !cl->rbuf) {
        kvo__rclient_free(cl);
        return 0;
    }
    for (i = 0; i < KVO__R_SLOTS; i++) cl->slot_node[i] = KVO__R_NO_NODE;
    return 1;
}

static void kvo__rclient_free(kvo__rclient *cl)
{
    size_t i;
    for (i = 0; i < cl->n_nodes; i++)
        if (cl->nodes[i].c) redisFree(cl->nodes[i].c);
    KVO__RFREE(cl->nodes);
    KVO__RFREE(cl->slot_node);
    KVO__RFREE(cl->rbuf);
    KVO__RFREE(cl->gather);
    KVO__RFREE(cl->out);
    pthread_mutex_destroy(&cl->lock);
}

/* Index of host:port among the client's nodes, added when new; -1 when there are too many, KVO__R_NOMEM
 * when out of memory. */
#define KVO__R_NOMEM (-3) /* kvo__rnode_find and the parsers above it: out of memory */
static int kvo__rnode_find(kvo__rclient *cl, const char *host, size_t host_len, int port)
{
    size_t i;
    kvo__rnode *nd;
    if (host_len >= sizeof cl->nodes[0].host) host_len = sizeof cl->nodes[0].host - 1;
    for (i = 0; i < cl->n_nodes; i++)
        if (cl->nodes[i].port == port && strlen(cl->nodes[i].host) == host_len &&
            !memcmp(cl->nodes[i].host, host, host_len))
            return (int)i;
    if (cl->n_nodes >= KVO__R_NO_NODE - 1) return -1;
    if (cl->n_nodes == cl->cap_nodes) {
        size_t cap = cl->cap_nodes ? 2 * cl->cap_nodes : 4;
        kvo__rnode *nn = (kvo__rnode *)KVO__RALLOC(cap * sizeof *nn);
        if (!nn) return KVO__R_NOMEM;
        if (cl->n_nodes) memcpy(nn, cl->nodes, cl->n_nodes * sizeof *nn);
        KVO__RFREE(cl->nodes);
        cl->nodes = nn;
        cl->cap_nodes = cap;
    }
    nd = &cl->nodes[cl->n_nodes];
    memset(nd, 0, sizeof *nd);
    memcpy(nd->host, host, host_len);
    nd->host[host_len] = 0;
    nd->port = port;
    return (int)cl->n_nodes++;
}

/* "host:port" (the last colon splits, so bare IPv6 works; [v6]:port too) into a node. */
static int kvo__rnode_parse(kvo__rclient *cl, const char *s, size_t len)
{
    size_t colon = len, hs = 0, he;
    long port = 0;
    size_t i;
    for (i = len; i > 0; i--)
        if (s[i - 1] == ':') {
            colon = i - 1;
            break;
        }
    if (colon == len || colon + 1 == len) return -1;
    for (i = colon + 1; i < len; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        port = port * 10 + (s[i] - '0');
        if (port > 65535) return -1;
    }
    he = colon;
    if (he >= 2 && s[0] == '[' && s[he - 1] == ']') {
        hs = 1;
        he--;
    }
    if (he <= hs || port <= 0) return -1;
    return kvo__rnode_find(cl, s + hs, he - hs, (int)port);
}

/* The seeds of config.servers into the client's nodes; the count, -1 for a malformed list, -2 for one
 * holding credentials (user:password@host: refused, so that no message ever repeats them), KVO__R_NOMEM
 * when out of memory. */
static int kvo__rseeds(kvo__redis *r, kvo__rclient *cl)
{
    const char *p = r->servers;
    int count = 0;
    if (strchr(p, '@')) return -2;
    if (!strncmp(p, "redis://", 8)) p += 8;
    while (*p) {
        const char *e = p;
        while (*e && *e != ',') e++;
        while (p < e && *p == ' ') p++;
        if (e > p) {
            const char *t = e;
            if (!strncmp(p, "redis://", 8)) p += 8;
            while (t > p && (t[-1] == ' ' || t[-1] == '/')) t--;
            int node = kvo__rnode_parse(cl, p, (size_t)(t - p));
            if (node < 0) return node == KVO__R_NOMEM ? KVO__R_NOMEM : -1;
            count++;
        }
        p = *e ? e + 1 : e;
    }
    return count;
}

/* Writes every byte of the iovecs (adjusting them); 0 or -1 with why. */
static int kvo__rsend(int fd, struct iovec *iov, int cnt, int more, char *why, size_t why_size)
{
    while (cnt > 0) {
        struct msghdr mh;
        ssize_t w;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)(cnt < IOV_MAX ? cnt : IOV_MAX);
        w = sendmsg(fd, &mh, MSG_NOSIGNAL | (more ? MSG_MORE : 0));
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) kvo__rmsg(why, why_size, "write timed out");
            else kvo__rmsg(why, why_size, "%s", strerror(errno));
            return -1;
        }
        while (cnt > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

static int kvo__rsend_buf(int fd, const void *buf, size_t len, char *why, size_t why_size)
{
    struct iovec iov;
    iov.iov_base = (void *)(uintptr_t)buf;
    iov.iov_len = len;
    return kvo__rsend(fd, &iov, 1, 0, why, why_size);
}

/* One reply from the node's connection; 0, or -1 with why (the connection is then unusable). */
static int kvo__rread(kvo__rclient *cl, kvo__rnode *nd, redisReply **out, char *why, size_t why_size)
{
    void *reply = NULL;
    *out = NULL;
    for (;;) {
        ssize_t got;
        if (redisReaderGetReply(nd->c->reader, &reply) != REDIS_OK) {
            kvo__rmsg(why, why_size, "protocol error: %s", nd->c->reader->errstr);
            return -1;
        }
        if (reply) {
            *out = (redisReply *)reply;
            return 0;
        }
        got = recv(nd->c->fd, cl->rbuf, KVO__R_RBUF, 0);
        if (got > 0) {
            if (redisReaderFeed(nd->c->reader, cl->rbuf, (size_t)got) != REDIS_OK) {
                kvo__rmsg(why, why_size, "out of memory reading a reply");
                return -1;
            }
        } else if (got == 0) {
            kvo__rmsg(why, why_size, "connection closed by the server");
            return -1;
        } else if (errno != EINTR) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) kvo__rmsg(why, why_size, "read timed out");
            else kvo__rmsg(why, why_size, "%s", strerror(errno));
            return -1;
        }
    }
}

static void kvo__rdrop(kvo__redis *r, kvo__rnode *nd, const char *why, kvo_redis_stats *delta)
{
    char msg[KVO__R_MSG + 64];
    if (!nd->c) return;
    redisFree(nd->c);
    nd->c = NULL;
    nd->next_try_us = 0; /* the next job may reconnect at once; backoff starts if that fails */
    kvo__rmsg(nd->why, sizeof nd->why, "%s", why);
    delta->disconnects++;
    if (!nd->said_down) {
        kvo__rmsg(msg, sizeof msg, "redis %s:%d: connection lost (%s)", nd->host, nd->port, why);
        kvo__rlog(r, msg);
        nd->said_down = 1;
    }
}

/* Send one command and read its reply (connection set up). KVO_OK, or KVO_EIO with msg. */
static int kvo__rcall(kvo__redis *r, kvo__rclient *cl, kvo__rnode *nd, int argc, const char **argv, redisReply **out,
                      char *msg, size_t msg_size, kvo_redis_stats *delta)
{
    char *cmd = NULL, why[160];
    int len = redisFormatCommandArgv(&cmd, argc, argv, NULL), e;
    *out = NULL;
    if (len < 0 || !cmd) {
        kvo__rmsg(msg, msg_size, "redis %s:%d: out of memory", nd->host, nd->port);
        return KVO_ENOMEM;
    }
    e = kvo__rsend_buf(nd->c->fd, cmd, (size_t)len, why, sizeof why);
    memset(cmd, 0, (size_t)len); /* it may hold the password */
    redisFreeCommand(cmd);
    if (e == 0) e = kvo__rread(cl, nd, out, why, sizeof why);
    if (e) {
        kvo__rmsg(msg, msg_size, "redis %s:%d: %s", nd->host, nd->port, why);
        kvo__rdrop(r, nd, why, delta);
        return KVO_EIO;
    }
    return KVO_OK;
}

static ssize_t kvo__rpeek(kvo__rnode *nd)
{
    char b;
    ssize_t got;
    do got = recv(nd->c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    while (got < 0 && errno == EINTR);
    return got;
}

/* Between batches nothing may be waiting on a connection: readable means closed (or out of step), and so
 * do bytes left in the reader (a reply nobody asked for came in with the last one: it would be taken
 * for the next command's answer). */
static int kvo__ralive(kvo__rnode *nd)
{
    if (nd->c->reader && nd->c->reader->pos < nd->c->reader->len) return 0;
    return kvo__rpeek(nd) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* AUTH (when configured), then PING: KVO_OK, KVO_EAUTH or KVO_EIO, with msg. */
static int kvo__rhello(kvo__redis *r, kvo__rclient *cl, kvo__rnode *nd, char *msg, size_t msg_size,
                       kvo_redis_stats *delta)
{
    redisReply *reply = NULL;
    const char *argv[3];
    int e;
    if (r->password) {
        int argc = 0;
        argv[argc++] = "AUTH";
        if (r->username) argv[argc++] = r->username;
        argv[argc++] = r->password;
        e = kvo__rcall(r, cl, nd, argc, argv, &reply, msg, msg_size, delta);
        if (e) return e;
        if (reply->type == REDIS_REPLY_ERROR) {
            kvo__rmsg(msg, msg_size, "redis %s:%d: AUTH refused: %.*s", nd->host, nd->port, (int)(reply->len > 120 ? 120 : reply->len),
                     reply->str);
            freeReplyObject(reply);
            return KVO_EAUTH;
        }
        freeReplyObject(reply);
    }
    argv[0] = "PING";
    e = kvo__rcall(r, cl, nd, 1, argv, &reply, msg, msg_size, delta);
    if (e) return e;
    if (reply->type == REDIS_REPLY_ERROR) {
        int noauth = reply->len >= 6 && !memcmp(reply->str, "NOAUTH", 6);
        if (noauth)
            kvo__rmsg(msg, msg_size, "redis %s:%d: the server requires a password (NOAUTH); set password or password_env",
                     nd->host, nd->port);
        else
            kvo__rmsg(msg, msg_size, "redis %s:%d: PING refused: %.*s", nd->host, nd->port,
                     (int)(reply->len > 120 ? 120 : reply->len), reply->str);
        freeReplyObject(reply);
        return noauth ? KVO_EAUTH : KVO_EREMOTE;
    }
    freeReplyObject(reply);
    return KVO_OK;
}

/* The wait after a failed connect, given the last one (0: none yet): min_ms, then doubling up to max_ms. */
static uint32_t kvo__rbackoff_next(uint32_t backoff_ms, uint32_t min_ms, uint32_t max_ms)
{
    uint64_t next = backoff_ms ? (uint64_t)backoff_ms * 2 : min_ms; /* 64 bits: no wrap past 2^31 ms */
    return next > max_ms ? max_ms : (uint32_t)next;
}

/* A usable connection to node i: KVO_OK, or a code with msg (KVO_EIO while backing off or unreachable,
 * KVO_EAUTH). */
static int kvo__rconnect(kvo__redis *r, kvo__rclient *cl, size_t i, char *msg, size_t msg_size, kvo_redis_stats *delta)
{
    kvo__rnode *nd = &cl->nodes[i];
    uint64_t now = kvo__rnow_us();
    redisContext *c;
    kvo_redis_stats hello;
    int e;
    if (nd->c && kvo__ralive(nd)) return KVO_OK;
    if (nd->c) kvo__rdrop(r, nd, "connection closed while idle", delta);
    if (now < nd->next_try_us) {
        kvo__rmsg(msg, msg_size, "redis %s:%d: down (%s); next reconnect attempt in %llu ms", nd->host, nd->port,
                 nd->why, (unsigned long long)((nd->next_try_us - now + 999) / 1000));
        return KVO_EIO;
    }
    c = redisConnectWithTimeout(nd->host, nd->port, kvo__rtv(r->cfg.connect_timeout_ms));
    if (!c || c->err) {
        kvo__rmsg(nd->why, sizeof nd->why, "%s", c ? c->errstr : "out of memory");
        if (c) redisFree(c);
        e = KVO_EIO;
        kvo__rmsg(msg, msg_size, "redis %s:%d: cannot connect: %s", nd->host, nd->port, nd->why);
    } else {
        redisSetTimeout(c, kvo__rtv(r->cfg.command_timeout_ms));
        redisEnableKeepAlive(c);
        nd->c = c;
        /* a handshake lost on the connection is this failed connect (counted below), not a disconnect:
         * the connection was never up */
        memset(&hello, 0, sizeof hello);
        e = kvo__rhello(r, cl, nd, msg, msg_size, &hello);
        if (e && nd->c) {
            redisFree(nd->c);
            nd->c = NULL;
        }
        if (e) kvo__rmsg(nd->why, sizeof nd->why, "%s", e == KVO_EAUTH ? "authentication failed" : "handshake failed");
    }
    if (e) {
        nd->backoff_ms = kvo__rbackoff_next(nd->backoff_ms, r->cfg.reconnect_min_ms, r->cfg.reconnect_max_ms);
        nd->next_try_us = kvo__rnow_us() + (uint64_t)nd->backoff_ms * 1000u;
        delta->connect_failures++;
        return e;
    }
    if (nd->said_down) {
        char note[KVO__R_MSG + 64];
        kvo__rmsg(note, sizeof note, "redis %s:%d: connected again", nd->host, nd->port);
        kvo__rlog(r, note);
        nd->said_down = 0;
    }
    nd->backoff_ms = 0;
    nd->next_try_us = 0;
    delta->connects++;
    return KVO_OK;
}

/* ---- cluster slot map --------------------------------------------------------------------------- */

static int kvo__rint(const redisReply *x, long long *v)
{
    if (!x || x->type != REDIS_REPLY_INTEGER) return 0;
    *v = x->integer;
    return 1;
}

/* Fill the map from a CLUSTER SLOTS reply got from node `from`; 1 when it was an array of ranges. */
static int kvo__rmap_from(kvo__rclient *cl, const redisReply *reply, size_t from)
{
    size_t i, s;
    if (reply->type != REDIS_REPLY_ARRAY) return 0;
    for (s = 0; s < KVO__R_SLOTS; s++) cl->slot_node[s] = KVO__R_NO_NODE;
    for (i = 0; i < reply->elements; i++) {
        const redisReply *range = reply->element[i], *master;
        long long lo, hi, port;
        char host[256];
        size_t host_len;
        int node;
        if (range->type != REDIS_REPLY_ARRAY || range->elements < 3) continue;
        master = range->element[2];
        if (!kvo__rint(range->element[0], &lo) || !kvo__rint(range->element[1], &hi) ||
            master->type != REDIS_REPLY_ARRAY || master->elements < 2 || !kvo__rint(master->element[1], &port))
            continue;
        /* copied: adding a node may move cl->nodes */
        host_len = master->element[0]->type == REDIS_REPLY_STRING ? master->element[0]->len : 0;
        if (host_len >= sizeof host) host_len = sizeof host - 1;
        if (host_len) memcpy(host, master->element[0]->str, host_len);
        host[host_len] = 0;
        if (!host_len || (host_len == 1 && host[0] == '?')) { /* the node does not know its address */
            kvo__rmsg(host, sizeof host, "%s", cl->nodes[from].host);
            host_len = strlen(host);
        }
        node = kvo__rnode_find(cl, host, host_len, (int)port);
        if (node < 0 || lo < 0 || hi >= KVO__R_SLOTS) continue;
        for (s = (size_t)lo; s <= (size_t)hi; s++) cl->slot_node[s] = (uint16_t)node;
    }
    cl->have_map = 1;
    return 1;
}

/* Ask CLUSTER SLOTS of the first node that answers: `first` (-1 = none), then connected ones, then the
 * others. 1 when the map was filled, 0 when a node answered without one, -1 when none could be asked
 * (why: the last node's reason). */
static int kvo__rrefresh(kvo__redis *r, kvo__rclient *cl, int first, kvo_redis_stats *delta, char *why,
                         size_t why_size)
{
    int pass, answered = 0;
    size_t i;
    const char *argv[2] = {"CLUSTER", "SLOTS"};
    char msg[KVO__R_MSG] = "no node known";
    for (pass = 0; pass < 3; pass++)
        for (i = 0; i < cl->n_nodes; i++) {
            redisReply *reply = NULL;
            int ok;
            if (pass != ((int)i == first ? 0 : cl->nodes[i].c ? 1 : 2)) continue;
            if (kvo__rconnect(r, cl, i, msg, sizeof msg, delta) != KVO_OK) continue;
            if (kvo__rcall(r, cl, &cl->nodes[i], 2, argv, &reply, msg, sizeof msg, delta) != KVO_OK) continue;
            delta->slot_refreshes++;
            answered = 1;
            ok = kvo__rmap_from(cl, reply, i);
            freeReplyObject(reply);
            if (ok) return 1;
        }
    if (answered) return 0;
    kvo__rmsg(why, why_size, "%s", msg);
    return -1;
}

/* ---- batches ------------------------------------------------------------------------------------ */

static void kvo__rfail(kvo__rop *op, kvo__ritem *it, int code, const char *msg)
{
    it->result = code;
    if (code == KVO_EIO) op->delta.io_errors++;
    else if (code == KVO_EREMOTE || code == KVO_EAUTH) op->delta.remote_errors++;
    if (msg && !op->msg[0]) kvo__rmsg(op->msg, sizeof op->msg, "%s", msg);
}

static int kvo__rout_add(kvo__rclient *cl, const char *s, size_t len)
{
    if (cl->out_len + len > cl->out_cap) {
        size_t cap = cl->out_cap ? cl->out_cap : 4096;
        char *o;
        while (cap < cl->out_len + len) cap *= 2;
        o = (char *)KVO__RALLOC(cap);
        if (!o) return 0;
        if (cl->out_len) memcpy(o, cl->out, cl->out_len);
        KVO__RFREE(cl->out);
        cl->out = o;
        cl->out_cap = cap;
    }
    memcpy(cl->out + cl->out_len, s, len);
    cl->out_len += len;
    return 1;
}

static const char kvo__rasking[] = "*1\r\n$6\r\nASKING\r\n";

/* The small commands (GET, GETRANGE, DEL) of node k's items, pipelined in one write; KVO__R_NOMEM (nothing
 * sent) when the out buffer cannot grow. */
static int kvo__rsend_small(kvo__rop *op, size_t k, char *why, size_t why_size)
{
    kvo__rclient *cl = op->cl;
    size_t i;
    char head[64];
    cl->out_len = 0;
    for (i = 0; i < op->n; i++) {
        kvo__ritem *it = &op->items[i];
        int hl;
        if (it->result != KVO__R_PENDING || it->node != (int)k) continue;
        if (it->ask >= 0 && !kvo__rout_add(cl, kvo__rasking, sizeof kvo__rasking - 1)) goto oom;
        if (op->kind == KVO__OP_HEAD) hl = kvo__rmsg(head, sizeof head, "*4\r\n$8\r\nGETRANGE\r\n$%zu\r\n", it->klen);
        else if (op->kind == KVO__OP_DEL) hl = kvo__rmsg(head, sizeof head, "*2\r\n$3\r\nDEL\r\n$%zu\r\n", it->klen);
        else hl = kvo__rmsg(head, sizeof head, "*2\r\n$3\r\nGET\r\n$%zu\r\n", it->klen);
        if (!kvo__rout_add(cl, head, (size_t)hl) || !kvo__rout_add(cl, it->key, it->klen) ||
            !kvo__rout_add(cl, "\r\n", 2))
            goto oom;
        if (op->kind == KVO__OP_HEAD && !kvo__rout_add(cl, "$1\r\n0\r\n$2\r\n63\r\n", 15)) goto oom;
    }
    return kvo__rsend_buf(cl->nodes[k].c->fd, cl->out, cl->out_len, why, why_size);
oom:
    kvo__rmsg(why, why_size, "out of memory");
    return KVO__R_NOMEM;
}

/* The SETs of node k's items: header and suffix around the block bytes, straight from the pool when
 * the block is one run. */
static int kvo__rsend_sets(kvo__rop *op, size_t k, char *why, size_t why_size)
{
    kvo__redis *r = op->r;
    kvo__rclient *cl = op->cl;
    size_t i, last = op->n;
    char head[KVO_REDIS_KEY_MAX + 96], tail[64];
    unsigned char hdr[KVO_REDIS_HEADER_BYTES];
    int tl;
    if (r->cfg.ttl_s) {
        char ttl[16];
        int n = kvo__rmsg(ttl, sizeof ttl, "%u", r->cfg.ttl_s);
        tl = kvo__rmsg(tail, sizeof tail, "\r\n$2\r\nEX\r\n$%d\r\n%s\r\n", n, ttl);
    } else {
        tl = kvo__rmsg(tail, sizeof tail, "\r\n");
    }
    for (i = 0; i < op->n; i++)
        if (op->items[i].result == KVO__R_PENDING && op->items[i].node == (int)k) last = i;
    for (i = 0; i < op->n; i++) {
        kvo__ritem *it = &op->items[i];
        unsigned char *data;
        struct iovec iov[4];
        int hl = 0;
        if (it->result != KVO__R_PENDING || it->node != (int)k) continue;
        data = kvo__rrun(&op->mem, it->block);
        if (!data) { /* the gather buffer is there (kvo__rgather_ready) */
            kvo__rgather(&op->mem, it->block, cl->gather);
            data = cl->gather;
        }
        kvo__rheader(r, &op->hashes[i], data, hdr);
        if (it->ask >= 0) hl = kvo__rmsg(head, sizeof head, "%s", kvo__rasking);
        hl += kvo__rmsg(head + hl, sizeof head - (size_t)hl, "*%d\r\n$3\r\nSET\r\n$%zu\r\n%s\r\n$%llu\r\n",
                       r->cfg.ttl_s ? 5 : 3, it->klen, it->key,
                       (unsigned long long)(KVO_REDIS_HEADER_BYTES + r->block_bytes));
        iov[0].iov_base = head;
        iov[0].iov_len = (size_t)hl;
        iov[1].iov_base = hdr;
        iov[1].iov_len = sizeof hdr;
        iov[2].iov_base = data;
        iov[2].iov_len = (size_t)r->block_bytes;
        iov[3].iov_base = tail;
        iov[3].iov_len = (size_t)tl;
        if (kvo__rsend(cl->nodes[k].c->fd, iov, 4, i != last, why, why_size)) return -1;
    }
    return 0;
}

/* host:port of a MOVED / ASK error ("MOVED 3999 127.0.0.1:6381"); the node index or -1. */
static int kvo__rredirect_node(kvo__rclient *cl, size_t from, const char *s, size_t len)
{
    size_t i = 0, sp = 0;
    int spaces = 0;
    for (i = 0; i < len; i++)
        if (s[i] == ' ' && ++spaces == 2) {
            sp = i + 1;
            break;
        }
    if (!sp || sp >= len) return -1;
    if (s[sp] == ':') { /* empty host: the node that answered */
        char buf[300];
        int bl = kvo__rmsg(buf, sizeof buf, "%s%.*s", cl->nodes[from].host, (int)(len - sp), s + sp);
        if (bl <= 0 || (size_t)bl >= sizeof buf) return -1;
        return kvo__rnode_parse(cl, buf, (size_t)bl);
    }
    return kvo__rnode_parse(cl, s + sp, len - sp);
}

/* A value read for item i: hdr holds its first min(len, 64) bytes, data the block bytes when len is
 * right (NULL otherwise); in_place: data already is the destination block. */
static void kvo__rvalue(kvo__rop *op, size_t i, const unsigned char *hdr, size_t len, const unsigned char *data,
                        int in_place)
{
    kvo__redis *r = op->r;
    kvo__ritem *it = &op->items[i];
    char msg[KVO__R_MSG + KVO_REDIS_KEY_MAX];
    int whole = len >= KVO_REDIS_HEADER_BYTES && kvo__rget(hdr, 4) == KVO__R_MAGIC &&
                kvo__rget(hdr + 56, 8) == kvo_checksum(hdr, 56);
    int mine = whole && kvo__rheader_ok(r, &op->hashes[i], hdr);
    if (mine && data && kvo__rget(hdr + 48, 8) == kvo_checksum(data, (size_t)r->block_bytes)) {
        if (!in_place) kvo__rscatter(&op->mem, it->block, data);
        it->result = KVO_OK;
        op->bytes += r->block_bytes;
        op->delta.gets++;
        return;
    }
    /* a damaged value is deleted; a whole one of another layout, format version or hash (same length as
     * it says) is only a miss */
    it->corrupt = !whole || mine || len != KVO_REDIS_HEADER_BYTES + kvo__rget(hdr + 24, 8);
    if (it->corrupt)
        kvo__rmsg(msg, sizeof msg, "redis: %s failed its header or checksum check (a miss; entry deleted)", it->key);
    else
        kvo__rmsg(msg, sizeof msg, "redis: %s holds a block of another layout, format version or hash (a miss)",
                  it->key);
    op->delta.checksum_errors++;
    kvo__rlog(r, msg);
    kvo__rfail(op, it, KVO_ECHECKSUM, msg);
}

/* One reply of item i (sent to node k). */
static void kvo__rreply(kvo__rop *op, size_t k, size_t i, redisReply *reply)
{
    kvo__redis *r = op->r;
    kvo__ritem *it = &op->items[i];
    char msg[KVO__R_MSG + KVO_REDIS_KEY_MAX];
    if (reply->type == REDIS_REPLY_ERROR) {
        int moved = reply->len > 6 && !memcmp(reply->str, "MOVED ", 6);
        int ask = reply->len > 4 && !memcmp(reply->str, "ASK ", 4);
        if ((moved || ask) && r->cluster) {
            int node = kvo__rredirect_node(op->cl, k, reply->str, reply->len);
            if (node >= 0 && it->redirects < r->cfg.max_redirects) {
                it->redirects++;
                if (moved) { /* the slot's owner at once; the whole map after the round */
                    op->cl->slot_node[it->slot] = (uint16_t)node;
                    it->moved = op->moved_to = node;
                    op->delta.moved++;
                    it->ask = -1;
                } else {
                    op->delta.ask++;
                    it->ask = node;
                }
                return; /* stays pending: next round */
            }
            kvo__rmsg(msg, sizeof msg, "redis: %s: too many redirects (last: %.*s)", it->key,
                     (int)(reply->len > 80 ? 80 : reply->len), reply->str);
            kvo__rfail(op, it, KVO_EREMOTE, msg);
            return;
        }
        if (reply->len >= 8 && !memcmp(reply->str, "TRYAGAIN", 8) && it->redirects < r->cfg.max_redirects) {
            it->redirects++;
            op->tryagain = 1;
            return;
        }
        if (reply->len >= 9 && !memcmp(reply->str, "WRONGTYPE", 9) &&
            (op->kind == KVO__OP_GET || op->kind == KVO__OP_HEAD)) {
            /* only strings are written under our keys: another type there is a damaged entry (a miss,
             * deleted by a read), not a server error */
            op->delta.checksum_errors++;
            if (op->kind == KVO__OP_HEAD) {
                it->result = KVO_ECHECKSUM;
                return;
            }
            it->corrupt = 1;
            kvo__rmsg(msg, sizeof msg, "redis: %s holds another type than a string (a miss; entry deleted)",
                      it->key);
            kvo__rlog(r, msg);
            kvo__rfail(op, it, KVO_ECHECKSUM, msg);
            return;
        }
        kvo__rmsg(msg, sizeof msg, "redis %s:%d: %s: %.*s", op->cl->nodes[k].host, op->cl->nodes[k].port, it->key,
                 (int)(reply->len > 120 ? 120 : reply->len), reply->str);
        kvo__rfail(op, it, reply->len >= 6 && !memcmp(reply->str, "NOAUTH", 6) ? KVO_EAUTH : KVO_EREMOTE, msg);
        return;
    }
    it->ask = -1;
    switch (op->kind) {
    case KVO__OP_SET:
        if (reply->type == REDIS_REPLY_STATUS) {
            it->result = KVO_OK;
            op->bytes += r->block_bytes;
            op->delta.puts++;
            return;
        }
        break;
    case KVO__OP_DEL:
        it->result = KVO_OK;
        return;
    case KVO__OP_HEAD:
        if (reply->type == REDIS_REPLY_STRING && reply->len == 0) {
            it->result = KVO_ENOTFOUND;
            return;
        }
        if (reply->type == REDIS_REPLY_STRING && reply->len == KVO_REDIS_HEADER_BYTES &&
            kvo__rheader_ok(r, &op->hashes[i], (const unsigned char *)reply->str)) {
            it->result = KVO_OK;
            return;
        }
        if (reply->type == REDIS_REPLY_STRING) {
            op->delta.checksum_errors++;
            it->result = KVO_ECHECKSUM;
            return;
        }
        break;
    case KVO__OP_GET:
        if (reply->type == REDIS_REPLY_NIL) {
            kvo__rmsg(msg, sizeof msg, "redis: %s: not found (evicted or expired)", it->key);
            op->delta.misses++;
            kvo__rfail(op, it, KVO_ENOTFOUND, msg);
            return;
        }
        if (reply->type == REDIS_REPLY_STRING) {
            const unsigned char *v = (const unsigned char *)reply->str;
            kvo__rvalue(op, i, v, reply->len,
                        reply->len == KVO_REDIS_HEADER_BYTES + r->block_bytes ? v + KVO_REDIS_HEADER_BYTES : NULL, 0);
            return;
        }
        break;
    default: break;
    }
    kvo__rmsg(msg, sizeof msg, "redis %s:%d: %s: unexpected reply type %d", op->cl->nodes[k].host, op->cl->nodes[k].port,
             it->key, reply->type);
    kvo__rfail(op, it, KVO_EREMOTE, msg);
}

/* ---- GET replies, read by hand: a value goes from the socket straight into its block ------------- */

static int kvo__rrecv_failed(ssize_t got, char *why, size_t why_size)
{
    if (got == 0) kvo__rmsg(why, why_size, "connection closed by the server");
    else if (errno == EAGAIN || errno == EWOULDBLOCK) kvo__rmsg(why, why_size, "read timed out");
    else kvo__rmsg(why, why_size, "%s", strerror(errno));
    return -1;
}

/* More bytes into rbuf (compacting it first when full); 0, or -1 with why. */
static int kvo__rfill(kvo__rclient *cl, kvo__rnode *nd, char *why, size_t why_size)
{
    ssize_t got;
    if (cl->rpos == cl->rlen) {
        cl->rpos = cl->rlen = 0;
    } else if (cl->rpos && cl->rlen == KVO__R_RBUF) {
        memmove(cl->rbuf, cl->rbuf + cl->rpos, cl->rlen - cl->rpos);
        cl->rlen -= cl->rpos;
        cl->rpos = 0;
    }
    if (cl->rlen == KVO__R_RBUF) {
        kvo__rmsg(why, why_size, "protocol error: reply line too long");
        return -1;
    }
    for (;;) {
        got = recv(nd->c->fd, cl->rbuf + cl->rlen, KVO__R_RBUF - cl->rlen, 0);
        if (got > 0) {
            cl->rlen += (size_t)got;
            return 0;
        }
        if (got < 0 && errno == EINTR) continue;
        return kvo__rrecv_failed(got, why, why_size);
    }
}

/* One reply line, without its CRLF (valid until the next read). */
static int kvo__rline(kvo__rclient *cl, kvo__rnode *nd, char **line, size_t *len, char *why, size_t why_size)
{
    size_t from = cl->rpos;
    for (;;) {
        char *nl = from < cl->rlen ? (char *)memchr(cl->rbuf + from, '\n', cl->rlen - from) : NULL;
        if (nl) {
            size_t end = (size_t)(nl - cl->rbuf);
            if (end == cl->rpos || cl->rbuf[end - 1] != '\r') {
                kvo__rmsg(why, why_size, "protocol error: bad reply line");
                return -1;
            }
            *line = cl->rbuf + cl->rpos;
            *len = end - 1 - cl->rpos;
            cl->rpos = end + 1;
            return 0;
        }
        from = cl->rlen - cl->rpos; /* searched already, relative to rpos (fill may move it) */
        if (kvo__rfill(cl, nd, why, why_size)) return -1;
        from += cl->rpos;
    }
}

/* n bytes into dst (NULL: dropped): what is buffered first, large rests straight from the socket. */
static int kvo__rtake(kvo__rclient *cl, kvo__rnode *nd, unsigned char *dst, size_t n, char *why, size_t why_size)
{
    while (n) {
        size_t have = cl->rlen - cl->rpos;
        if (have) {
            size_t t = have < n ? have : n;
            if (dst) {
                memcpy(dst, cl->rbuf + cl->rpos, t);
                dst += t;
            }
            cl->rpos += t;
            n -= t;
        } else if (dst && n >= 4096) {
            ssize_t got = recv(nd->c->fd, dst, n, 0);
            if (got > 0) {
                dst += got;
                n -= (size_t)got;
            } else if (!(got < 0 && errno == EINTR)) {
                return kvo__rrecv_failed(got, why, why_size);
            }
        } else if (kvo__rfill(cl, nd, why, why_size)) {
            return -1;
        }
    }
    return 0;
}

/* ASKING's reply: "+OK". */
static int kvo__rread_status(kvo__rclient *cl, kvo__rnode *nd, char *why, size_t why_size)
{
    char *line;
    size_t len;
    if (kvo__rline(cl, nd, &line, &len, why, why_size)) return -1;
    if (len && line[0] == '+') return 0;
    kvo__rmsg(why, why_size, "ASKING refused: %.*s", (int)(len > 100 ? 100 : len), line);
    return -1;
}

/* The reply to GET item i from node k: an error (MOVED, ASK...) or nil goes the common way; a value is
 * read into its block (block-contiguous destination) or the gather buffer, then checked. */
static int kvo__rread_get(kvo__rop *op, size_t k, size_t i, char *why, size_t why_size)
{
    kvo__rclient *cl = op->cl;
    kvo__rnode *nd = &cl->nodes[k];
    kvo__redis *r = op->r;
    unsigned char hdr[KVO_REDIS_HEADER_BYTES], crlf[2], *data = NULL;
    char *line, ebuf[256];
    size_t len, hl, j;
    long long vlen = 0;
    int in_place = 0, neg = 0;
    redisReply fake;
    if (kvo__rline(cl, nd, &line, &len, why, why_size)) return -1;
    memset(&fake, 0, sizeof fake);
    if (len >= 1 && line[0] == '-') {
        fake.type = REDIS_REPLY_ERROR;
        fake.len = len - 1 < sizeof ebuf - 1 ? len - 1 : sizeof ebuf - 1;
        memcpy(ebuf, line + 1, fake.len);
        ebuf[fake.len] = 0;
        fake.str = ebuf;
        kvo__rreply(op, k, i, &fake);
        return 0;
    }
    if (len < 2 || line[0] != '$') {
        kvo__rmsg(why, why_size, "protocol error: unexpected reply to GET");
        return -1;
    }
    for (j = 1; j < len; j++) {
        if (j == 1 && line[j] == '-') {
            neg = 1;
            continue;
        }
        if (line[j] < '0' || line[j] > '9' || vlen > (1LL << 40)) {
            kvo__rmsg(why, why_size, "protocol error: bad bulk length");
            return -1;
        }
        vlen = vlen * 10 + (line[j] - '0');
    }
    if (neg) {
        fake.type = REDIS_REPLY_NIL;
        kvo__rreply(op, k, i, &fake);
        return 0;
    }
    hl = (size_t)vlen < sizeof hdr ? (size_t)vlen : sizeof hdr;
    if (kvo__rtake(cl, nd, hdr, hl, why, why_size)) return -1;
    if ((uint64_t)vlen == KVO_REDIS_HEADER_BYTES + r->block_bytes) {
        data = kvo__rrun(&op->mem, op->items[i].block);
        in_place = data != NULL;
        if (!data) data = cl->gather; /* there: kvo__rgather_ready */
    }
    if (kvo__rtake(cl, nd, data, (size_t)vlen - hl, why, why_size) || kvo__rtake(cl, nd, crlf, 2, why, why_size))
        return -1;
    if (crlf[0] != '\r' || crlf[1] != '\n') {
        kvo__rmsg(why, why_size, "protocol error: bulk value not followed by CRLF");
        return -1;
    }
    kvo__rvalue(op, i, hdr, (size_t)vlen, data, in_place);
    return 0;
}

/* The client's gather buffer, made before anything is sent when the pool's blocks are not one run each:
 * out of memory, every item fails with KVO_ENOMEM and no connection is touched (0). */
static int kvo__rgather_ready(kvo__rop *op)
{
    size_t i;
    if ((op->kind != KVO__OP_SET && op->kind != KVO__OP_GET) || !op->n || op->cl->gather ||
        op->mem.layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS)
        return 1;
    if ((op->cl->gather = (unsigned char *)KVO__RALLOC((size_t)op->r->block_bytes))) return 1;
    for (i = 0; i < op->n; i++)
        if (op->items[i].result == KVO__R_PENDING) kvo__rfail(op, &op->items[i], KVO_ENOMEM, "out of memory");
    return 0;
}

/* What a node's replies counted in an op, to be undone when they turn out not to be its own. */
typedef struct kvo__rmark {
    kvo_redis_stats delta;
    uint64_t bytes;
    int had_msg;
} kvo__rmark;

static kvo__rmark kvo__rmark_of(const kvo__rop *op)
{
    kvo__rmark m;
    m.delta = op->delta;
    m.bytes = op->bytes;
    m.had_msg = op->msg[0] != 0;
    return m;
}

/* Reply bytes no command asked for, once the round's replies are read: in the hand reader's buffer, in
 * hiredis's, or waiting on the socket (a close is not: the next batch finds it). */
static int kvo__rleft_over(const kvo__rclient *cl, kvo__rnode *nd)
{
    if (cl->rpos != cl->rlen || (nd->c->reader && nd->c->reader->pos < nd->c->reader->len)) return 1;
    return kvo__rpeek(nd) > 0;
}

/* Node k's connection is out of step: a stray reply shifts every answer after it, so none of this
 * round's is taken. What they counted is undone, the connection dropped, the node's copies of the
 * round fail with KVO_EIO. */
static void kvo__rout_of_step(kvo__rop *op, size_t k, const kvo__rmark *mark)
{
    kvo__rclient *cl = op->cl;
    const char *why = "reply data no command asked for after the batch's replies";
    char msg[KVO__R_MSG + 64];
    size_t i, n = 0;
    op->delta = mark->delta;
    op->bytes = mark->bytes;
    if (!mark->had_msg) op->msg[0] = 0;
    for (i = 0; i < op->n; i++) n += op->items[i].node == (int)k;
    kvo__rmsg(msg, sizeof msg, "redis %s:%d: %s (%zu copies failed)", cl->nodes[k].host, cl->nodes[k].port, why, n);
    kvo__rdrop(op->r, &cl->nodes[k], why, &op->delta);
    if (op->r->cluster) cl->have_map = 0; /* a redirect read may have been another key's */
    for (i = 0; i < op->n; i++)
        if (op->items[i].node == (int)k) {
            op->items[i].corrupt = 0; /* no entry is deleted on a reply that may not be its own */
            kvo__rfail(op, &op->items[i], KVO_EIO, msg);
        }
}

/* Run the op: rounds of (route, write every node's pipeline, read every node's replies) until no item is
 * pending; redirects and TRYAGAIN send items to another round. */
static void kvo__rop_run(kvo__rop *op)
{
    kvo__redis *r = op->r;
    kvo__rclient *cl = op->cl;
    uint32_t round, tryagains = 0;
    int unreached;
    size_t i, k, nn, window = op->n ? op->n : 1, cap;
    char msg[KVO__R_MSG + 64], why[160];
    unsigned char *sent = NULL;
    size_t *taken = NULL;
    if (!kvo__rgather_ready(op)) return;
    if (op->kind == KVO__OP_GET) {
        window = (size_t)(r->cfg.window_bytes / (r->block_bytes + KVO_REDIS_HEADER_BYTES));
        if (!window) window = 1;
    }
    /* every round settles or redirects each item it sends: this bounds the rounds */
    cap = ((size_t)r->cfg.max_redirects + 2) * (1 + op->n / window) + 1;
    for (round = 0;; round++) {
        size_t pending = 0;
        for (i = 0; i < op->n; i++) pending += op->items[i].result == KVO__R_PENDING;
        if (!pending) break;
        if (round > cap) {
            for (i = 0; i < op->n; i++)
                if (op->items[i].result == KVO__R_PENDING)
                    kvo__rfail(op, &op->items[i], KVO_EREMOTE, "redis: the cluster kept redirecting the batch");
            break;
        }
        if (op->tryagain) kvo__rsleep_ms(10u * (++tryagains < 10 ? tryagains : 10));
        op->tryagain = 0;
        op->moved_to = -1;
        /* route; a node gets at most `window` items a round, the others wait for the next */
        unreached = 0;
        if (r->cluster && !cl->have_map) {
            unreached = kvo__rrefresh(r, cl, -1, &op->delta, why, sizeof why) < 0;
        } else if (r->cluster && !op->asked_unserved) {
            /* a slot the map gives no node may have been assigned since it was read (a cluster still
             * being set up, a slot moved by hand): ask again, once a batch, before failing its keys;
             * nothing else would ever refresh it */
            for (i = 0; i < op->n; i++)
                if (op->items[i].result == KVO__R_PENDING && op->items[i].ask < 0 &&
                    cl->slot_node[op->items[i].slot] == KVO__R_NO_NODE)
                    break;
            if (i < op->n) {
                op->asked_unserved = 1;
                unreached = kvo__rrefresh(r, cl, -1, &op->delta, why, sizeof why) < 0;
            }
        }
        KVO__RFREE(sent);
        KVO__RFREE(taken);
        sent = (unsigned char *)KVO__RALLOC(cl->n_nodes ? cl->n_nodes : 1);
        taken = (size_t *)KVO__RALLOC((cl->n_nodes ? cl->n_nodes : 1) * sizeof *taken);
        if (taken) memset(taken, 0, (cl->n_nodes ? cl->n_nodes : 1) * sizeof *taken);
        for (i = 0; taken && i < op->n; i++) {
            kvo__ritem *it = &op->items[i];
            it->node = -1; /* a node's items are those sent to it this round (kvo__rout_of_step) */
            if (it->result != KVO__R_PENDING) continue;
            it->moved = -1;
            if (it->ask >= 0) it->node = it->ask;
            else if (!r->cluster) it->node = 0;
            else if (cl->slot_node[it->slot] != KVO__R_NO_NODE) it->node = cl->slot_node[it->slot];
            else if (unreached) { /* not known to be unserved: no node could be asked */
                kvo__rmsg(msg, sizeof msg, "redis: no cluster node reachable for slot %u (%s)", it->slot, why);
                kvo__rfail(op, it, KVO_EIO, msg);
                continue;
            } else {
                kvo__rmsg(msg, sizeof msg, "redis: no cluster node serves slot %u (of %s)", it->slot, it->key);
                kvo__rfail(op, it, KVO_EREMOTE, msg);
                continue;
            }
            if (taken[it->node]++ >= window) it->node = -1;
        }
        if (!sent || !taken) {
            for (i = 0; i < op->n; i++)
                if (op->items[i].result == KVO__R_PENDING) kvo__rfail(op, &op->items[i], KVO_ENOMEM, "out of memory");
            break;
        }
        nn = cl->n_nodes; /* redirects may add nodes while replies are read */
        memset(sent, 0, nn ? nn : 1);
        /* write every node's share */
        for (k = 0; k < nn; k++) {
            size_t mine = 0;
            int e;
            for (i = 0; i < op->n; i++) mine += op->items[i].result == KVO__R_PENDING && op->items[i].node == (int)k;
            if (!mine) continue;
            e = kvo__rconnect(r, cl, k, msg, sizeof msg, &op->delta);
            if (e == KVO_OK) {
                e = op->kind == KVO__OP_SET ? kvo__rsend_sets(op, k, why, sizeof why)
                                            : kvo__rsend_small(op, k, why, sizeof why);
                if (e == KVO__R_NOMEM) { /* nothing went out: the connection stays */
                    kvo__rmsg(msg, sizeof msg, "redis %s:%d: out of memory", cl->nodes[k].host, cl->nodes[k].port);
                    e = KVO_ENOMEM;
                } else if (e) {
                    kvo__rmsg(msg, sizeof msg, "redis %s:%d: connection lost mid-batch: %s (%zu copies failed)",
                             cl->nodes[k].host, cl->nodes[k].port, why, mine);
                    kvo__rdrop(r, &cl->nodes[k], why, &op->delta);
                    e = KVO_EIO;
                }
            }
            if (e) {
                for (i = 0; i < op->n; i++)
                    if (op->items[i].result == KVO__R_PENDING && op->items[i].node == (int)k)
                        kvo__rfail(op, &op->items[i], e, msg);
                if (r->cluster && e != KVO_ENOMEM)
                    cl->have_map = 0; /* a failover may have moved its slots: ask again next job */
                continue;
            }
            sent[k] = 1;
        }
        /* read every node's replies, in order */
        for (k = 0; k < nn; k++) {
            kvo__rmark mark;
            if (!sent[k]) continue;
            cl->rpos = cl->rlen = 0;
            mark = kvo__rmark_of(op);
            for (i = 0; i < op->n; i++) {
                kvo__ritem *it = &op->items[i];
                redisReply *reply = NULL;
                if (it->result != KVO__R_PENDING || it->node != (int)k) continue;
                if (op->kind == KVO__OP_GET) { /* values straight into their blocks */
                    if (it->ask >= 0 && kvo__rread_status(cl, &cl->nodes[k], why, sizeof why)) goto lost;
                    if (kvo__rread_get(op, k, i, why, sizeof why)) goto lost;
                    continue;
                }
                if (it->ask >= 0) { /* ASKING's +OK */
                    if (kvo__rread(cl, &cl->nodes[k], &reply, why, sizeof why)) goto lost;
                    freeReplyObject(reply);
                }
                if (kvo__rread(cl, &cl->nodes[k], &reply, why, sizeof why)) goto lost;
                kvo__rreply(op, k, i, reply);
                freeReplyObject(reply);
                continue;
            lost: {
                size_t left = 0, j;
                for (j = i; j < op->n; j++) left += op->items[j].result == KVO__R_PENDING && op->items[j].node == (int)k;
                kvo__rmsg(msg, sizeof msg, "redis %s:%d: connection lost mid-batch: %s (%zu copies failed)",
                         cl->nodes[k].host, cl->nodes[k].port, why, left);
                kvo__rdrop(r, &cl->nodes[k], why, &op->delta);
                if (r->cluster) cl->have_map = 0;
                for (j = i; j < op->n; j++)
                    if (op->items[j].result == KVO__R_PENDING && op->items[j].node == (int)k)
                        kvo__rfail(op, &op->items[j], KVO_EIO, msg);
                break;
            }
            }
            if (cl->nodes[k].c && kvo__rleft_over(cl, &cl->nodes[k])) kvo__rout_of_step(op, k, &mark);
            cl->rpos = cl->rlen = 0;
        }
        if (op->moved_to >= 0) {
            /* asked of the new owner first: another node may not know yet, and its map would send the
             * keys back to the old owner (MOVED again, until too many redirects); so whichever node
             * answers, this round's MOVEDs stand */
            kvo__rrefresh(r, cl, op->moved_to, &op->delta, why, sizeof why);
            for (i = 0; i < op->n; i++)
                if (op->items[i].result == KVO__R_PENDING && op->items[i].moved >= 0)
                    cl->slot_node[op->items[i].slot] = (uint16_t)op->items[i].moved;
        }
    }
    KVO__RFREE(sent);
    KVO__RFREE(taken);
}

static void kvo__rstats_add(kvo__redis *r, const kvo_redis_stats *d)
{
    kvo_redis_stats *s = &r->stats;
    pthread_mutex_lock(&r->stats_lock);
    s->puts += d->puts;
    s->gets += d->gets;
    s->bytes_put += d->bytes_put;
    s->bytes_got += d->bytes_got;
    s->misses += d->misses;
    s->checksum_errors += d->checksum_errors;
    s->io_errors += d->io_errors;
    s->remote_errors += d->remote_errors;
    s->lookups += d->lookups;
    s->lookup_keys += d->lookup_keys;
    s->lookup_errors += d->lookup_errors;
    s->imported += d->imported;
    s->moved += d->moved;
    s->ask += d->ask;
    s->slot_refreshes += d->slot_refreshes;
    s->connects += d->connects;
    s->connect_failures += d->connect_failures;
    s->disconnects += d->disconnects;
    if (d->nodes) s->nodes = d->nodes; /* the control connections' count, taken under their lock */
    pthread_mutex_unlock(&r->stats_lock);
}

/* Items for n hashes (keys, slots); NULL when out of memory. */
static kvo__ritem *kvo__ritems(kvo__redis *r, const kvb_hash *hashes, size_t n)
{
    kvo__ritem *items = (kvo__ritem *)KVO__RALLOC((n ? n : 1) * sizeof *items);
    size_t i;
    if (!items) return NULL;
    for (i = 0; i < n; i++) {
        kvo__ritem *it = &items[i];
        it->klen = kvo_redis_format_key(r->prefix, r->cfg.salt, &hashes[i], it->key, sizeof it->key);
        it->slot = kvo_redis_key_slot(it->key, it->klen);
        it->result = KVO__R_PENDING;
        it->ask = -1;
        it->node = -1;
        it->redirects = 0;
        it->moved = -1;
        it->block = 0;
        it->corrupt = 0;
    }
    return items;
}

static void kvo__rop_init(kvo__rop *op, kvo__redis *r, kvo__rclient *cl, int kind, const kvb_hash *hashes,
                          kvo__ritem *items, size_t n)
{
    memset(op, 0, sizeof *op);
    op->r = r;
    op->cl = cl;
    op->kind = kind;
    op->hashes = hashes;
    op->items = items;
    op->n = n;
}

/* Delete the entries that failed their check (best effort), so no reader meets them again. Locked. */
static void kvo__rdelete_bad(kvo__redis *r, kvo__rclient *cl, const kvo__rop *get, kvo_redis_stats *delta)
{
    size_t i, bad = 0;
    kvo__ritem *items;
    kvo__rop del;
    for (i = 0; i < get->n; i++) bad += get->items[i].result == KVO_ECHECKSUM && get->items[i].corrupt;
    if (!bad || !(items = (kvo__ritem *)KVO__RALLOC(bad * sizeof *items))) return;
    bad = 0;
    for (i = 0; i < get->n; i++)
        if (get->items[i].result == KVO_ECHECKSUM && get->items[i].corrupt) {
            items[bad] = get->items[i];
            items[bad].result = KVO__R_PENDING;
            items[bad].ask = -1;
            items[bad].redirects = 0;
            bad++;
        }
    kvo__rop_init(&del, r, cl, KVO__OP_DEL, NULL, items, bad);
    kvo__rop_run(&del);
    /* not its io_errors: those copies failed their check, not on a connection (disconnects say the rest) */
    delta->moved += del.delta.moved;
    delta->ask += del.delta.ask;
    delta->slot_refreshes += del.delta.slot_refreshes;
    delta->connects += del.delta.connects;
    delta->connect_failures += del.delta.connect_failures;
    delta->disconnects += del.delta.disconnects;
    KVO__RFREE(items);
}

static void kvo__rjob(kvo__redis *r, kvo__rclient *cl, kvo_copy_job *job)
{
    int writing = job->dst == r->pool, result = KVO_OK;
    kvo__ritem *items;
    kvo__rop op;
    size_t i;
    job->bytes = 0;
    if (!job->n) {
        job->done(job, KVO_OK, NULL);
        return;
    }
    items = kvo__ritems(r, job->hashes, job->n);
    if (!items) {
        for (i = 0; i < job->n; i++) job->results[i] = KVO_ENOMEM;
        job->done(job, KVO_ENOMEM, "redis: out of memory");
        return;
    }
    for (i = 0; i < job->n; i++) items[i].block = writing ? job->src_idx[i] : job->dst_idx[i];
    pthread_mutex_lock(&cl->lock);
    kvo__rop_init(&op, r, cl, writing ? KVO__OP_SET : KVO__OP_GET, job->hashes, items, job->n);
    kvo__rgeom_of(writing ? job->src : job->dst, &op.mem);
    kvo__rop_run(&op);
    if (!writing) kvo__rdelete_bad(r, cl, &op, &op.delta);
    if (cl == &r->clients[r->n_threads]) op.delta.nodes = (uint32_t)cl->n_nodes;
    pthread_mutex_unlock(&cl->lock);
    if (writing) op.delta.bytes_put = op.bytes;
    else op.delta.bytes_got = op.bytes;
    kvo__rstats_add(r, &op.delta);
    for (i = 0; i < job->n; i++) {
        job->results[i] = items[i].result;
        if (result == KVO_OK) result = items[i].result;
    }
    KVO__RFREE(items);
    job->bytes = op.bytes;
    job->done(job, result, result == KVO_OK ? NULL : op.msg);
}

/* ---- workers ------------------------------------------------------------------------------------ */

typedef struct kvo__rworker_arg { kvo__redis *r; uint32_t id; } kvo__rworker_arg;

static void *kvo__rworker(void *arg)
{
    kvo__rworker_arg a = *(kvo__rworker_arg *)arg;
    void *job;
    KVO__RFREE(arg);
    while (kvo_queue_pop(a.r->jobs, &job, -1) == KVO_OK) kvo__rjob(a.r, &a.r->clients[a.id], (kvo_copy_job *)job);
    return NULL;
}

static int kvo__redis_submit(kvo_backend *self, kvo_copy_job *job)
{
    kvo__redis *r = (kvo__redis *)self->impl;
    kvo__rgeom mem;
    kvb_pool *other;
    kvb_pool_config oc;
    size_t i;
    if (!job || !job->done || !job->hashes || (job->n && (!job->src_idx || !job->dst_idx || !job->results)))
        return KVO_EINVAL;
    if ((job->dst == r->pool) == (job->src == r->pool)) return KVO_EINVAL;
    other = job->dst == r->pool ? job->src : job->dst;
    if (kvb_pool_get_config(other, &oc) != KVB_OK) return KVO_EINVAL;
    for (i = 0; i < job->n; i++) /* the memory pool's blocks (entries are keyed by hash, not by index) */
        if ((job->dst == r->pool ? job->src_idx[i] : job->dst_idx[i]) >= oc.num_blocks) return KVO_EINVAL;
    if (!kvo__rgeom_of(other, &mem)) return KVB_ENODATA;
    if (mem.layout.num_layers != r->layout.num_layers || mem.layout.num_parts != r->layout.num_parts ||
        mem.layout.page_bytes != r->layout.page_bytes)
        return KVO_ELAYOUT;
    if (!r->n_threads) {
        kvo__rjob(r, &r->clients[r->n_threads], job);
        return KVO_OK;
    }
    return kvo_queue_push(r->jobs, job, NULL);
}

static void kvo__redis_free(kvo__redis *r)
{
    uint32_t i;
    if (r->jobs) kvo_queue_close(r->jobs);
    for (i = 0; i < r->n_started; i++) pthread_join(r->threads[i], NULL);
    if (r->jobs) kvo_queue_destroy(r->jobs);
    KVO__RFREE(r->threads);
    for (i = 0; i < r->n_clients; i++) kvo__rclient_free(&r->clients[i]);
    KVO__RFREE(r->clients);
    kvo__rwipe(r->password);
    KVO__RFREE(r->password);
    KVO__RFREE(r->username);
    KVO__RFREE(r->servers);
    KVO__RFREE(r->prefix);
    pthread_mutex_destroy(&r->stats_lock);
    KVO__RFREE(r);
}

static void kvo__redis_destroy(kvo_backend *self) { kvo__redis_free((kvo__redis *)self->impl); }

/* Give every client the nodes to start from: the seeds (cluster; the map comes on first use) or the one
 * server. */
static int kvo__rclient_seed(kvo__redis *r, kvo__rclient *cl)
{
    if (cl->n_nodes) return 1;
    if (!r->cluster) return kvo__rnode_find(cl, r->single_host, strlen(r->single_host), r->single_port) == 0;
    return kvo__rseeds(r, cl) > 0;
}

/* Reach the first seed that answers, detect a cluster; the control client keeps the connections. */
static kvo_result kvo__redis_detect(kvo__redis *r, char *msg, size_t msg_size)
{
    kvo__rclient *cl = &r->clients[r->n_threads];
    kvo_redis_stats delta;
    int count = kvo__rseeds(r, cl), e = KVO_ECONNECT;
    size_t i;
    char why[KVO__R_MSG] = "";
    memset(&delta, 0, sizeof delta);
    if (count == -2) {
        kvo__rmsg(msg, msg_size, "redis: the server list holds credentials (user:password@host); give them as "
                                 "password / password_env");
        return KVO_EINVAL;
    }
    if (count == KVO__R_NOMEM) {
        kvo__rmsg(msg, msg_size, "redis: out of memory");
        return KVO_ENOMEM;
    }
    if (count <= 0) {
        kvo__rmsg(msg, msg_size, "redis: bad server list \"%s\" (want host:port[,host:port...])", r->servers);
        return KVO_EINVAL;
    }
    for (i = 0; i < cl->n_nodes; i++) {
        redisReply *reply = NULL;
        const char *argv[2] = {"CLUSTER", "SLOTS"};
        int cluster;
        e = kvo__rconnect(r, cl, i, why, sizeof why, &delta);
        if (e == KVO_EAUTH) {
            kvo__rmsg(msg, msg_size, "%s", why);
            return (kvo_result)KVO_EAUTH;
        }
        if (e) continue;
        if (r->cfg.cluster < 0) {
            cluster = 0;
        } else {
            e = kvo__rcall(r, cl, &cl->nodes[i], 2, argv, &reply, why, sizeof why, &delta);
            if (e) continue;
            cluster = reply->type == REDIS_REPLY_ARRAY;
            if (cluster) {
                r->cluster = 1;
                delta.slot_refreshes++;
                kvo__rmap_from(cl, reply, i);
            }
            freeReplyObject(reply);
        }
        if (!cluster && r->cfg.cluster > 0) {
            kvo__rmsg(msg, msg_size, "redis %s:%d: not a cluster node (config.cluster = 1)", cl->nodes[i].host,
                     cl->nodes[i].port);
            return KVO_EINVAL;
        }
        if (!cluster) { /* keep only this server */
            kvo__rnode keep = cl->nodes[i];
            size_t j;
            for (j = 0; j < cl->n_nodes; j++)
                if (j != i && cl->nodes[j].c) redisFree(cl->nodes[j].c);
            cl->nodes[0] = keep;
            cl->n_nodes = 1;
            kvo__rmsg(r->single_host, sizeof r->single_host, "%s", keep.host);
            r->single_port = keep.port;
        }
        delta.nodes = (uint32_t)cl->n_nodes;
        kvo__rstats_add(r, &delta);
        return KVO_OK;
    }
    kvo__rmsg(msg, msg_size, "redis: cannot reach any of \"%s\" (%s)", r->servers, why[0] ? why : "no answer");
    return (kvo_result)KVO_ECONNECT;
}

/* bytes of a block: a value (the header, then the block) may be at most 512 MiB, Redis's default
 * proto-max-bulk-len; a longer one is refused and the connection closed */
#define KVO__R_MAX_BLOCK (((uint64_t)512 << 20) - KVO_REDIS_HEADER_BYTES)

KVO_API kvo_result kvo_redis_backend_create(const kvo_redis_config *config, kvo_backend **out)
{
    kvo__redis *r;
    const char *password;
    kvb_pool_config pool_config;
    char msg[KVO__R_MSG + 128] = "";
    kvo_result e;
    uint32_t i;
    if (out) *out = NULL;
    if (!config || !out || !config->pool || !config->layout.page_bytes || config->threads > 64 ||
        (config->namespace_prefix && strlen(config->namespace_prefix) > KVO_REDIS_MAX_PREFIX) ||
        config->layout.page_bytes > KVO__R_MAX_BLOCK / (config->layout.num_layers ? config->layout.num_layers : 1) /
                                        (config->layout.num_parts ? config->layout.num_parts : 2)) {
        kvo__rsay_error(config, "redis: invalid config (pool and layout.page_bytes are required; a block of at "
                                "most 512 MiB less the 64-byte header, a Redis value's limit; threads <= 64; "
                                "namespace_prefix <= 128 characters)");
        return KVO_EINVAL;
    }
    if (kvb_pool_get_config(config->pool, &pool_config) != KVB_OK || pool_config.storage != KVB_STORAGE_NONE) {
        kvo__rsay_error(config, "redis: config.pool must be a metadata-only pool (its blocks stand for entries in "
                                "Redis; no bytes are copied into it)");
        return KVO_EINVAL;
    }
    password = config->password;
    if (!password && config->password_env) {
        password = getenv(config->password_env);
        if (!password) {
            kvo__rmsg(msg, sizeof msg, "redis: password_env names %s, which is not set", config->password_env);
            kvo__rsay_error(config, msg);
            return KVO_EINVAL;
        }
        if (!*password) password = NULL;
    }
    r = (kvo__redis *)KVO__RALLOC(sizeof *r);
    if (!r) return KVO_ENOMEM;
    memset(r, 0, sizeof *r);
    if (pthread_mutex_init(&r->stats_lock, NULL) != 0) {
        KVO__RFREE(r);
        return KVO_ENOMEM;
    }
    r->cfg = *config;
    r->cfg.servers = r->cfg.namespace_prefix = r->cfg.password = r->cfg.password_env = r->cfg.username = NULL;
    r->cfg.error = NULL;
    if (!r->cfg.connect_timeout_ms) r->cfg.connect_timeout_ms = 1000;
    if (!r->cfg.command_timeout_ms) r->cfg.command_timeout_ms = 5000;
    if (!r->cfg.reconnect_min_ms) r->cfg.reconnect_min_ms = 100;
    if (!r->cfg.reconnect_max_ms) r->cfg.reconnect_max_ms = 5000;
    if (r->cfg.reconnect_max_ms < r->cfg.reconnect_min_ms) r->cfg.reconnect_max_ms = r->cfg.reconnect_min_ms;
    if (!r->cfg.max_redirects) r->cfg.max_redirects = 5;
    if (!r->cfg.window_bytes) r->cfg.window_bytes = (uint64_t)64 << 20;
    r->pool = config->pool;
    r->layout = config->layout;
    if (!r->layout.num_layers) r->layout.num_layers = 1;
    if (!r->layout.num_parts) r->layout.num_parts = 2;
    r->block_bytes = r->layout.page_bytes * r->layout.num_layers * r->layout.num_parts;
    r->servers = kvo__rstrdup(config->servers ? config->servers : "127.0.0.1:6379");
    r->prefix = kvo__rstrdup(config->namespace_prefix ? config->namespace_prefix : "kvcache");
    r->password = kvo__rstrdup(password);
    r->username = kvo__rstrdup(config->username);
    r->n_clients = config->threads + 1;
    r->clients = (kvo__rclient *)KVO__RALLOC(r->n_clients * sizeof *r->clients);
    r->base.submit = kvo__redis_submit;
    r->base.destroy = kvo__redis_destroy;
    r->base.name = "redis";
    r->base.impl = r;
    if (!r->servers || !r->prefix || (password && !r->password) || (config->username && !r->username) || !r->clients) {
        r->n_clients = 0; /* none set up yet: the free walks none */
        kvo__redis_free(r);
        return KVO_ENOMEM;
    }
    for (i = 0; i < r->n_clients; i++)
        if (!kvo__rclient_init(&r->clients[i])) { /* it gave back what it took */
            r->n_clients = i;
            kvo__redis_free(r);
            return KVO_ENOMEM;
        }
    r->n_threads = config->threads; /* clients[n_threads] is the control client */
    e = kvo__redis_detect(r, msg, sizeof msg);
    for (i = 0; e == KVO_OK && i < r->n_threads; i++)
        if (!kvo__rclient_seed(r, &r->clients[i])) e = KVO_ENOMEM;
    if (e == KVO_OK && r->n_threads) {
        if (kvo_queue_create(NULL, &r->jobs) != KVO_OK ||
            !(r->threads = (pthread_t *)KVO__RALLOC(r->n_threads * sizeof *r->threads))) {
            e = KVO_ENOMEM;
        } else {
            for (i = 0; i < r->n_threads; i++) {
                kvo__rworker_arg *a = (kvo__rworker_arg *)KVO__RALLOC(sizeof *a);
                if (!a) break;
                a->r = r;
                a->id = i;
                if (pthread_create(&r->threads[i], NULL, kvo__rworker, a) != 0) {
                    KVO__RFREE(a);
                    break;
                }
                r->n_started++;
            }
            if (r->n_started != r->n_threads) e = KVO_ENOMEM;
        }
    }
    if (e != KVO_OK) {
        if (e == KVO_ENOMEM && !msg[0]) kvo__rmsg(msg, sizeof msg, "redis: out of memory");
        kvo__rsay_error(config, msg);
        if (config->log) config->log(config->log_user, msg);
        kvo__redis_free(r);
        return e;
    }
    r->stats.cluster = r->cluster;
    *out = &r->base;
    return KVO_OK;
}

static kvo__redis *kvo__redis_of(kvo_backend *b)
{
    return b && b->submit == kvo__redis_submit ? (kvo__redis *)b->impl : NULL;
}

KVO_API kvo_result kvo_redis_backend_stats(kvo_backend *redis, kvo_redis_stats *out)
{
    kvo__redis *r = kvo__redis_of(redis);
    if (!r || !out) return KVO_EINVAL;
    /* not the control connections' lock: the log callback, called with it held, may ask for stats */
    pthread_mutex_lock(&r->stats_lock);
    *out = r->stats;
    pthread_mutex_unlock(&r->stats_lock);
    out->cluster = r->cluster;
    return KVO_OK;
}

KVO_API kvo_result kvo_redis_lookup(kvo_backend *redis, const kvb_hash *hashes, size_t n, size_t *out_prefix)
{
    kvo__redis *r = kvo__redis_of(redis);
    kvo__rclient *cl;
    kvo__ritem *items;
    kvo__rop op;
    size_t i;
    int result = KVO_OK;
    if (out_prefix) *out_prefix = 0;
    if (!r || !out_prefix || (n && !hashes) || n > SIZE_MAX / sizeof *items) return KVO_EINVAL;
    if (!n) return KVO_OK;
    if (!(items = kvo__ritems(r, hashes, n))) return KVO_ENOMEM;
    cl = &r->clients[r->n_threads];
    pthread_mutex_lock(&cl->lock);
    kvo__rop_init(&op, r, cl, KVO__OP_HEAD, hashes, items, n);
    kvo__rop_run(&op);
    op.delta.nodes = (uint32_t)cl->n_nodes;
    pthread_mutex_unlock(&cl->lock);
    for (i = 0; i < n && items[i].result == KVO_OK; i++) {
    }
    *out_prefix = i;
    if (i < n && items[i].result != KVO_ENOTFOUND && items[i].result != KVO_ECHECKSUM) result = items[i].result;
    op.delta.lookups = 1;
    op.delta.lookup_keys = n;
    op.delta.lookup_errors = result != KVO_OK;
    /* failures of keys past the prefix do not count as copy errors */
    op.delta.io_errors = op.delta.remote_errors = 0;
    kvo__rstats_add(r, &op.delta);
    KVO__RFREE(items);
    return (kvo_result)result;
}

KVO_API kvo_result kvo_redis_import(kvo_backend *redis, kvb_pool *g4_pool, const kvb_hash *hashes,
                                    const kvb_hash *parents, size_t n, size_t *out_n)
{
    kvo__redis *r = kvo__redis_of(redis);
    size_t prefix = 0, i, missing = 0, done = 0;
    uint8_t *present = NULL;
    kvb_hash *mh = NULL, *mp = NULL;
    kvb_block *blocks = NULL;
    kvb_pool_config pc;
    kvo_result e, looked;
    kvo_redis_stats delta;
    if (out_n) *out_n = 0;
    if (!r || !g4_pool || !out_n || (n && !hashes) || kvb_pool_get_config(g4_pool, &pc) != KVB_OK ||
        pc.storage != KVB_STORAGE_NONE) /* a pool with storage would serve bytes nobody copied */
        return KVO_EINVAL;
    looked = kvo_redis_lookup(redis, hashes, n, &prefix);
    if (!prefix) return looked;
    present = (uint8_t *)KVO__RALLOC(prefix);
    mh = (kvb_hash *)KVO__RALLOC(prefix * sizeof *mh);
    mp = (kvb_hash *)KVO__RALLOC(prefix * sizeof *mp);
    blocks = (kvb_block *)KVO__RALLOC(prefix * sizeof *blocks);
    if (!present || !mh || !mp || !blocks) {
        e = KVO_ENOMEM;
        goto out;
    }
    if ((e = (kvo_result)kvb_presence(g4_pool, hashes, prefix, present, NULL)) != KVO_OK) goto out;
    for (i = 0; i < prefix; i++) {
        if (present[i]) continue;
        mh[missing] = hashes[i];
        if (parents) mp[missing] = parents[i];
        else if (i) mp[missing] = hashes[i - 1];
        else memset(&mp[missing], 0, sizeof mp[missing]);
        missing++;
    }
    /* all at once, or as many as the pool can take (one by one, from the front) */
    if (missing && kvb_alloc(g4_pool, missing, blocks) == KVB_OK) done = missing;
    else
        while (done < missing && kvb_alloc(g4_pool, 1, &blocks[done]) == KVB_OK) done++;
    if (done && kvb_register_hashed(g4_pool, blocks, done, mh, mp, blocks) == KVB_OK) {
        kvb_release(g4_pool, blocks, done, NULL);
    } else if (done) {
        kvb_release(g4_pool, blocks, done, NULL);
        done = 0;
    }
    /* What the pool holds now: in a pool short of room the new blocks may have taken the place of
     * some that were there (asked without a lookup, so the pool's statistics do not change) */
    if ((e = (kvo_result)kvb_presence(g4_pool, hashes, prefix, present, NULL)) != KVO_OK) goto out;
    for (i = 0; i < prefix && present[i]; i++) {
    }
    *out_n = i;
    e = looked; /* a server not asked: the prefix found before it is imported, and may be short */
out:
    memset(&delta, 0, sizeof delta);
    delta.imported = done;
    kvo__rstats_add(r, &delta);
    KVO__RFREE(present);
    KVO__RFREE(mh);
    KVO__RFREE(mp);
    KVO__RFREE(blocks);
    return e;
}

KVO_API kvo_result kvo_redis_manager_lookup(kvo_manager *manager, kvo_backend *redis, const kvb_hash *hashes,
                                            size_t n, uint8_t *tier_of, size_t *out_n)
{
    kvo__redis *r = kvo__redis_of(redis);
    kvb_hash *parents;
    size_t found = 0, got = 0, i;
    kvo_result e;
    kvo_manager_config mc;
    uint32_t t = 0;
    if (out_n) *out_n = 0;
    if (!r || kvo_manager_get_config(manager, &mc) != KVO_OK) return KVO_EINVAL;
    while (t < mc.num_tiers && mc.pools[t] != r->pool) t++;
    if (t == mc.num_tiers) return KVO_EINVAL; /* it imports into a pool the manager never looks in */
    e = kvo_manager_lookup(manager, hashes, n, tier_of, &found);
    if (out_n) *out_n = found;
    if (e != KVO_OK || found == n) return e;
    if (!(parents = (kvb_hash *)KVO__RALLOC((n - found) * sizeof *parents))) return KVO_OK;
    for (i = found; i < n; i++) {
        if (i) parents[i - found] = hashes[i - 1];
        else memset(&parents[0], 0, sizeof parents[0]);
    }
    kvo_redis_import(redis, r->pool, hashes + found, parents, n - found, &got); /* errors: counted */
    KVO__RFREE(parents);
    if (got) e = kvo_manager_lookup(manager, hashes, n, tier_of, out_n);
    return e;
}

KVO_API size_t kvo_redis_key(kvo_backend *redis, const kvb_hash *hash, char *buf, size_t size)
{
    kvo__redis *r = kvo__redis_of(redis);
    if (!r) {
        if (buf && size) buf[0] = 0;
        return 0;
    }
    return kvo_redis_format_key(r->prefix, r->cfg.salt, hash, buf, size);
}

#endif /* KVO_WITH_REDIS */
#ifdef KVO__R_POP_DIAGNOSTICS
#pragma GCC diagnostic pop
#undef KVO__R_POP_DIAGNOSTICS
#endif
#endif /* KVREMOTE_IMPL_INCLUDED */
#endif /* KVREMOTE_IMPLEMENTATION || KVCACHE_IMPLEMENTATION */
