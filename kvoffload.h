/* kvoffload.h — moving KV blocks between tiers: cancellable queues, the offload pipeline, copy backends,
 * onboarding and the tier manager (part of kvcache)
 *
 * Do this in exactly one C or C++ file:    #define KVOFFLOAD_IMPLEMENTATION
 *                                           #include "kvoffload.h"
 * (it includes kvblock.h; define KVBLOCK_IMPLEMENTATION there too, or KVCACHE_IMPLEMENTATION for all).
 * Needs C11, POSIX threads and stb_ds.h (-I/usr/include/stb), -pthread, and _GNU_SOURCE (O_DIRECT,
 * preadv, posix_fallocate, clock_gettime under -std=c11): the implementation defines it before its first
 * include; a file that includes a system header before it must pass -D_GNU_SOURCE (an #error says so).
 *
 * Manual: 1. Quick start  2. Concepts  3. Pipeline rules  4. Backends  5. Tier manager
 *         6. Thread safety  7. Errors
 *
 * 1. QUICK START — offload registered device blocks to a host pool, then load them back
 *
 *     kvo_backend *copy;  kvo_memcpy_backend_create(0, &copy);         // 0 threads: copies inline
 *     kvo_pipeline_config pc = { .src = device, .dst = host, .backend = copy, .mode = KVO_MODE_POLL };
 *     kvo_pipeline *down;  kvo_pipeline_create(&pc, &down);
 *     kvo_transfer t;      kvo_enqueue(down, weak_blocks, n, NULL, &t);
 *     kvo_pipeline_drain(down, -1);                                      // or poll every step
 *     kvo_transfer_info info; kvo_transfer_get_info(down, t, &info);     // info.status == COMPLETE
 *     kvo_transfer_release(down, t);
 *
 * 2. CONCEPTS
 * A *container* is one enqueue: the blocks (weak handles into the source pool), an optional precondition
 * event (e.g. the forward pass that writes the blocks) and a cancel token. Its handle (kvo_transfer,
 * index + generation, like kvb_block) reports
 *     Evaluating -> Queued -> Transferring -> Complete | Cancelled | Failed
 * with counts: blocks transferred, skipped by policy, skipped because the policy timed out, dropped
 * because their weak handle could not be upgraded (evicted meanwhile), failed in the backend, and for
 * onboarding, found already present in the destination, or joined: already in flight to it for
 * another transfer of the pipeline, so waited for instead of copied twice (two requests with a common
 * prefix onboarded in one step move each block once).
 * Stages: PolicyEvaluator -> PreconditionAwaiter -> Batcher -> in-queue (weak batches, higher priority
 * first, FIFO within) -> on-deck (upgraded batches, bounded) -> TransferExecutor (backend), with a
 * CancelSweeper every sweep interval. A block that passes lands in the destination pool Registered
 * under the source block's hash (kvb_register_hashed), so a later lookup there finds it.
 *
 * 3. PIPELINE RULES (P1-P6 of Dynamo KVBM's offload pipeline)
 * P1 the container is the unit of cancellation; P2 its token travels with it through every queue;
 * P3 the upgrade weak -> strong is the point of no return for eviction: a block evicted before it is
 * dropped (counted), never copied; P4 the queues are swept of cancelled containers right before each
 * upgrade; P5 after the upgrade the blocks of all containers of a batch are flattened into one backend
 * job; P6 the precondition wait is cancellable (it is a poll, never a blocking wait).
 * The pipeline's reference to a source block is no use of it: taken and given back, it counts no hit for
 * the source pool's policy (ARC, S3-FIFO) and no reference for FOL, and the block keeps its level (as
 * kvb_pin / kvb_unpin); only an onboard's source block, matched in its tier, counts as used there. An
 * onboard's hold on a block it finds already in the destination is no use either (pinned; one not
 * taken goes back at its own level); blocks it lands go to dst_priority.
 * Cancel takes a container out anywhere before the backend has its job, on-deck batches included (its
 * copies leave the job, its references are given back, nothing of it is copied); once the backend has
 * the job, the transfer completes and cancel waits for it.
 * kvo_transfer_cancel sweeps at once and returns only when nothing of the container is in flight.
 * Defaults (zero in the config): max batch 64 blocks, min batch 8, flush 10 ms, policy timeout 100 ms,
 * sweep 10 ms, 1 concurrent transfer, on-deck 2 batches, precondition timeout 10 s. Offloads wait for
 * min batch blocks or the flush interval; a load (kvo_onboard) goes as soon as the backend can take it,
 * with whatever else waits: a request is held up until it lands.
 * Two ways to run: KVO_MODE_THREADS (one coordinator thread per pipeline; backends may have workers),
 * or KVO_MODE_POLL (no threads: kvo_pipeline_poll runs each stage once; with a clock callback and an
 * inline backend the results are fully deterministic). Both run the same stage code. The clock callback
 * times every interval and timeout of the config (policy, precondition, flush, sweep); only the timeouts of
 * the waits (drain, wait) are real time. So while a manual clock stands still, a policy answering "later"
 * or a precondition never signalled holds kvo_pipeline_drain until its own timeout, and drain(-1) for ever:
 * move the clock between bounded drains.
 * Policies: presence (skip blocks already in the destination or in flight; on by default), frequency
 * (offload only blocks offered at least N times), and a user callback that may answer "later"; the
 * evaluator gives up on a block after the policy timeout and counts it.
 *
 * 4. BACKENDS — struct kvo_backend: submit a job of (src block, dst block) copies, get one completion
 * call with a result per copy. A copy that fails because the source tier's entry is damaged
 * (KVO_ECHECKSUM) or gone (KVO_ENOTFOUND: e.g. Redis evicted it) is a miss, and once the job is done the
 * pipeline drops the source block (kvb_invalidate): lookups stop finding it there, and the next copy of
 * it down into that tier stores it again (the tier manager copies a block down when it lands in the tier
 * above, section 5: while that tier still holds it, offers stop there and do not). Built in:
 *   memcpy: host <-> host between pools with storage and the same pages (layers, parts, page bytes),
 *           across both layouts of kvblock.h; `threads` workers (0 = inline, for poll mode).
 *   disk:   the tier is one preallocated file with one 4 KiB-aligned slot per block of a metadata-only
 *           pool; O_DIRECT where the file system accepts it, buffered otherwise (said once through the
 *           log callback; a request O_DIRECT cannot take after it worked, e.g. one the kernel cut at the
 *           file size limit, goes on buffered alone). Each slot starts with a 4 KiB header (magic,
 *           version, block bytes, hash, checksum), verified on every read: a mismatch fails that copy
 *           with KVO_ECHECKSUM (a miss, and the tier's block is dropped as above), never wrong data.
 *           Version 2 since 0.2 (kvblock.h's hashes changed): a file 0.1 wrote holds only misses. A job
 *           of several blocks is written by two threads: one prepares the next slot (gathers it when
 *           needed, computes its checksum) while the other writes the last, so the checksum stays off
 *           the disk's critical path.
 *
 * 5. TIER MANAGER — a chain G1 -> G2 -> G3 (-> G4). Eager: every block offered in tier i (and every
 * block that lands in tier i) goes on to tier i + 1. Lazy: blocks go down only when they come near
 * eviction: each poll keeps `lazy_reserve` blocks of each tier ready to be taken without losing data,
 * its free blocks first, and for what they do not cover the next eviction candidates, backed below (a
 * tier with that many free blocks sends nothing). A full
 * destination or a backend error fails the offload quietly (counted); the next offer tries again. (An
 * offer of blocks a tier already holds stops there, so in eager mode the manager keeps weak handles to
 * the blocks whose hop out of a tier below G1 failed, and sends them again with the next offer that
 * reaches that tier, one that lands nothing new there included.) kvo_manager_lookup finds
 * the longest prefix across tiers and which tier holds each block; kvo_manager_onboard loads blocks from
 * a lower tier into G1.
 * A branch (branch_from = b): the last tier is fed from tier b instead of the one above it, beside b's
 * own chain, e.g. G1 -> G2 -> G3 with G2 -> G4 (num_tiers 4, branch_from 1). Whatever lands in (or is
 * offered to, or is backed from) tier b goes to both; the tier above the last is then a leaf. This is how
 * all four tiers run at once: G4 (kvremote.h) is fed from G2 rather than from G3 because its backend sends
 * block bytes straight from a memory pool to the socket; G3 is a file, so G3 -> G4 would read every block
 * back from disk first (disk bandwidth taken from onboarding) and reach the shared cache only after the
 * disk write, while every block G3 gets has passed through G2 anyway. down[i] is always the pipeline
 * into tier i + 1 (for the last tier, from b).
 *
 * 6. THREAD SAFETY — queues, tokens, events, pipelines and managers are safe from any thread. Completion
 * callbacks (on_done) run on the thread that finished the transfer, with no pipeline lock held; they may
 * call back into the pipeline, waits and drains included (on the coordinator thread these run the stages
 * themselves; a drain does not wait for the callbacks its own thread is delivering, nor, from on_done of
 * any pipeline, for those of another thread that drains or destroys a pipeline from on_done too; a
 * destroy waits for every other callback of its pipeline, so it is never called from one of that
 * pipeline's own: the call delivering it goes on using the pipeline). The policy, clock and precondition
 * query callbacks run with the pipeline's lock held, as on_stage does: they must not call into the
 * pipeline (its lock is not recursive: the thread waits for itself). A backend worker that runs a
 * callback is busy meanwhile: a wait there for a copy only that worker could make (a backend with one
 * worker) times out.
 *
 * 7. ERRORS — kvo_result: KVO_OK or a negative code; calls may also return kvb_result codes (-1..-99)
 * from the pools. kvo_result_string names both. A failed call changes nothing.
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
#ifndef KVOFFLOAD_H
#define KVOFFLOAD_H
#define KVOFFLOAD_VERSION_MAJOR 0
#define KVOFFLOAD_VERSION_MINOR 2
#define KVOFFLOAD_VERSION_PATCH 0

#include "kvblock.h"

#ifndef KVO_API
#ifdef KVO_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define KVO_API static __attribute__((unused))
#else
#define KVO_API static
#endif
#else
#define KVO_API extern
#endif
#endif

#define KVO_MAX_TIERS 4

#ifdef __cplusplus
extern "C" {
#endif

#define KVO__RESULTS(X)                                                            \
    X(KVO_OK,         0,    "ok")                                                  \
    X(KVO_EINVAL,    -101,  "invalid argument")                                    \
    X(KVO_ECANCELLED,-102,  "cancelled")                                           \
    X(KVO_ETIMEDOUT, -103,  "timed out")                                           \
    X(KVO_ESTALE,    -104,  "transfer handle was released")                        \
    X(KVO_ESTATE,    -105,  "not allowed in this state")                           \
    X(KVO_EFULL,     -106,  "destination tier full")                               \
    X(KVO_EIO,       -107,  "I/O error")                                           \
    X(KVO_ENOSPC,    -108,  "no space left on the disk")                           \
    X(KVO_ECHECKSUM, -109,  "stored block failed its header or checksum check")    \
    X(KVO_EBACKEND,  -110,  "copy backend error")                                  \
    X(KVO_ENOMEM,    -111,  "out of memory")                                       \
    X(KVO_ELAYOUT,   -112,  "pools have different block sizes")                    \
    X(KVO_ECLOSED,   -113,  "queue closed")                                        \
    X(KVO_EPRECOND,  -114,  "precondition event failed")                           \
    X(KVO_ENOTFOUND, -123,  "entry not in the source tier (evicted, expired, never written)")
/* KVO_ENOTFOUND keeps the value it had when only kvremote.h (Redis, whose codes are -121 ..) used it. */

#define KVO__ENUM_ITEM(name, value, text) name = value,
typedef enum kvo_result { KVO__RESULTS(KVO__ENUM_ITEM) KVO__RESULT_MIN = -124 } kvo_result; /* MIN: below every code */
#undef KVO__ENUM_ITEM

/* Name of a kvo_result or kvb_result code. Thread safety: pure function. */
KVO_API const char *kvo_result_string(int result);

/* ---- cancel tokens ------------------------------------------------------------------------------ */

typedef struct kvo_token kvo_token;

/* A token starts live; cancelling it is final. Containers hold a reference, so the creator may release
 * its own at any time. Thread safety: all token calls are safe from any thread. */
KVO_API kvo_result kvo_token_create(kvo_token **out);
KVO_API void kvo_token_cancel(kvo_token *token);
KVO_API int kvo_token_is_cancelled(const kvo_token *token);
KVO_API void kvo_token_retain(kvo_token *token);
KVO_API void kvo_token_release(kvo_token *token);

/* ---- precondition events ------------------------------------------------------------------------ */

typedef struct kvo_event kvo_event;

/* query: 1 signalled, 0 not yet, negative = failed (the waiting transfers fail with KVO_EPRECOND). A
 * pipeline polls a precondition with its lock held: the query must not call into that pipeline. */
typedef int (*kvo_event_query_fn)(void *user);

/* A CPU event (signal / query / wait), or one answered by `query` (e.g. a CUDA event, see kvcuda.cu).
 * Reference counted: transfers waiting on it hold a reference. Thread safety: any thread. */
KVO_API kvo_result kvo_event_create(kvo_event **out);
KVO_API kvo_result kvo_event_create_custom(kvo_event_query_fn query, void *user, kvo_event **out);
KVO_API kvo_result kvo_event_signal(kvo_event *event);
/* 1 signalled, 0 not yet, negative: failed or invalid. */
KVO_API int kvo_event_query(kvo_event *event);
/* Wait up to timeout_us (negative = forever): KVO_OK, KVO_ETIMEDOUT. Custom events are polled. */
KVO_API kvo_result kvo_event_wait(kvo_event *event, int64_t timeout_us);
KVO_API void kvo_event_retain(kvo_event *event);
KVO_API void kvo_event_release(kvo_event *event);

/* ---- cancellable queue -------------------------------------------------------------------------- */

typedef struct kvo_queue kvo_queue;
/* Called exactly once for each item the queue drops (cancelled, or left at destroy). In pop and sweep it
 * runs with the queue's lock held: it must not call this queue's functions. */
typedef void (*kvo_drop_fn)(void *item, void *user);

typedef struct kvo_queue_config {
    kvo_drop_fn on_drop; /* optional */
    void *user;
} kvo_queue_config;

/* Multi-producer multi-consumer FIFO of (item, token). config may be NULL. Thread safety: any thread. */
KVO_API kvo_result kvo_queue_create(const kvo_queue_config *config, kvo_queue **out);
/* Drops what is left (on_drop) and frees the queue. No other call may run or follow. */
KVO_API void kvo_queue_destroy(kvo_queue *queue);
/* KVO_ECANCELLED (refused, nothing kept) when the token is already cancelled; KVO_ECLOSED after close.
 * token may be NULL (never cancelled); the queue holds a reference to it. */
KVO_API kvo_result kvo_queue_push(kvo_queue *queue, void *item, kvo_token *token);
/* The oldest live item; cancelled items met on the way are dropped. Waits up to timeout_us (0 = do not
 * wait, negative = forever): KVO_ETIMEDOUT when nothing came, KVO_ECLOSED when closed and empty. */
KVO_API kvo_result kvo_queue_pop(kvo_queue *queue, void **out_item, int64_t timeout_us);
/* Drop every cancelled item, keeping the others in order; *out_dropped may be NULL. */
KVO_API kvo_result kvo_queue_sweep(kvo_queue *queue, size_t *out_dropped);
/* Items held (cancelled ones not yet swept included). */
KVO_API size_t kvo_queue_len(kvo_queue *queue);
/* Refuse further pushes and wake every waiting pop. */
KVO_API void kvo_queue_close(kvo_queue *queue);

/* ---- copy backends ------------------------------------------------------------------------------ */

/* One batch of block copies between two pools. results[i] is written by the backend (0 or a negative
 * code for that copy: KVO_ECHECKSUM or KVO_ENOTFOUND when the source's entry is damaged or gone, so the
 * pipeline drops the source block, section 4); done is called exactly once, from any thread, after
 * every copy finished. */
typedef struct kvo_copy_job {
    kvb_pool *src, *dst;
    const uint32_t *src_idx, *dst_idx; /* block indices (kvb_block_index) */
    const kvb_hash *hashes;            /* the hash of each block (disk headers, remote keys) */
    size_t n;
    int *results;
    uint64_t bytes;                    /* filled by the backend: bytes moved */
    void (*done)(struct kvo_copy_job *job, int result, const char *message);
    void *user;
} kvo_copy_job;

typedef struct kvo_backend kvo_backend;
struct kvo_backend {
    /* Start the job: returns KVO_OK (done will be called, maybe before submit returns) or an error
     * (done will not be called). */
    int (*submit)(kvo_backend *self, kvo_copy_job *job);
    void (*destroy)(kvo_backend *self);
    const char *name;
    void *impl;
};

/* Free a backend (its workers stop after the jobs in hand). NULL is a no-op. */
KVO_API void kvo_backend_destroy(kvo_backend *backend);
/* What the memcpy and disk backends check before they start a job, for one written by the user too:
 * both pools, done and (for n > 0) the index and result arrays given, and every index within its pool;
 * KVO_EINVAL otherwise. (The Redis backend checks the memory pool's indices: its entries are keyed by
 * hash.) Thread safety: any thread. */
KVO_API kvo_result kvo_copy_job_check(const kvo_copy_job *job);

/* memcpy between pools with storage whose blocks have the same pages (layers, parts, page bytes), in
 * either layout; a job between other pools is refused at submit with KVO_ELAYOUT (same block bytes cut
 * into other pages included: kvo_pipeline_create, which checks block bytes only, makes that pipeline,
 * and its transfers fail). threads = 0: inline in submit. Thread safety: submit from any thread. */
KVO_API kvo_result kvo_memcpy_backend_create(uint32_t threads, kvo_backend **out);

typedef void (*kvo_log_fn)(void *user, const char *message);

typedef struct kvo_disk_config {
    const char *path;        /* the file (created or reused, preallocated to num_blocks slots) */
    kvb_pool *disk_pool;     /* the disk tier: a metadata-only pool; block i lives in slot i */
    uint64_t block_bytes;    /* bytes of one block in the memory pools it copies to and from */
    int direct;              /* 0 = try O_DIRECT and fall back, -1 = never */
    uint32_t threads;        /* 0 = inline in submit */
    kvo_log_fn log;          /* one-line notes (the O_DIRECT fallback, a refused disk_pool); default: stderr */
    void *log_user;
} kvo_disk_config;

typedef struct kvo_disk_stats {
    uint64_t writes, reads, bytes_written, bytes_read;
    uint64_t checksum_errors, io_errors;
    int direct_io;           /* 1 when O_DIRECT is in use */
} kvo_disk_stats;

/* The disk backend: copies memory pool -> disk pool (write) and disk pool -> memory pool (read).
 * KVO_EINVAL for a missing path, pool or block_bytes, or a disk pool with storage (said through log; no
 * file made), KVO_ENOSPC when the file cannot be preallocated, KVO_EIO for other file errors. A job whose
 * memory pool's blocks are not block_bytes is refused at submit with KVO_ELAYOUT.
 * Thread safety: submit from any thread. */
KVO_API kvo_result kvo_disk_backend_create(const kvo_disk_config *config, kvo_backend **out);
KVO_API kvo_result kvo_disk_backend_stats(kvo_backend *disk, kvo_disk_stats *out);
/* Byte offset of the slot of block `index` in the file (header first, then the data); UINT64_MAX for a
 * backend that is no disk backend or an index past the disk pool's blocks. */
KVO_API uint64_t kvo_disk_slot_offset(kvo_backend *disk, uint32_t index);

/* 64-bit checksum of bytes (disk and remote slots). Thread safety: pure function. */
KVO_API uint64_t kvo_checksum(const void *data, size_t len);

/* ---- pipeline ----------------------------------------------------------------------------------- */

typedef enum kvo_mode { KVO_MODE_THREADS = 0, KVO_MODE_POLL } kvo_mode;

typedef enum kvo_status {
    KVO_STATUS_EVALUATING = 1,
    KVO_STATUS_QUEUED,
    KVO_STATUS_TRANSFERRING,
    KVO_STATUS_COMPLETE,
    KVO_STATUS_CANCELLED,
    KVO_STATUS_FAILED
} kvo_status;

typedef enum kvo_verdict { KVO_SKIP = 0, KVO_OFFER = 1, KVO_LATER = 2 } kvo_verdict;

/* User policy for one block: offer it, skip it, or ask again later (until the policy timeout). Called
 * with the pipeline's lock held: it must not call into the pipeline (kvo_pipeline_note_use included). */
typedef kvo_verdict (*kvo_policy_fn)(void *user, const kvb_hash *hash, uint32_t src_index);

/* Microseconds of a monotonic clock; the default reads CLOCK_MONOTONIC. Called with the pipeline's lock
 * held (as the policy is). */
typedef uint64_t (*kvo_clock_fn)(void *user);

typedef struct kvo_transfer { uint64_t id; } kvo_transfer;

typedef struct kvo_transfer_info {
    kvo_status status;
    int error;               /* why it failed (KVO_OK otherwise) */
    uint32_t blocks;         /* in the container */
    uint32_t transferred;    /* copied and registered in the destination */
    uint32_t present;        /* already in the destination (onboarding: returned as they are) */
    uint32_t joined;         /* onboarding: in flight to the destination for another transfer; waited
                                for and returned from there, not copied again */
    uint32_t skipped;        /* refused by a policy */
    uint32_t timed_out;      /* policy gave no answer in time */
    uint32_t dropped;        /* weak handle could not be upgraded */
    uint32_t failed;         /* the backend could not copy them */
    char message[128];       /* about its first failure: the backend's message when every failed copy of
                                the backend job was this transfer's, else "<backend> backend: <error>"
                                (a job mixes transfers, and its one message may be another's; a code
                                kvo_result_string does not name, e.g. kvremote.h's, as "error <code>") */
} kvo_transfer_info;

/* Every change of a transfer's status (Evaluating, Queued, Transferring, then one final status), called
 * with the pipeline's lock held: it must not call into the pipeline. For observers (kvs_bus). */
typedef struct kvo_stage_note {
    kvo_transfer transfer;
    uint32_t src_tier, dst_tier;  /* kvb_pool_config.tier of the two pools */
    int onboard;                  /* 1 for kvo_onboard transfers */
    const kvo_transfer_info *info; /* info->status is the new status */
} kvo_stage_note;
typedef void (*kvo_stage_fn)(void *user, const kvo_stage_note *note);

/* Called exactly once per transfer when it reaches a final state (memory for the call is reserved when
 * the transfer is accepted: out of memory then, kvo_enqueue / kvo_onboard fail with KVO_ENOMEM); dst holds
 * a weak handle per block of the container that is now in the destination (0 where none), in container
 * order. */
typedef void (*kvo_done_fn)(void *user, kvo_transfer transfer, const kvo_transfer_info *info,
                            const kvb_weak *dst, size_t n);

typedef struct kvo_pipeline_config {
    kvb_pool *src, *dst;          /* required */
    kvo_backend *backend;         /* required */
    kvo_mode mode;
    uint32_t max_batch;           /* blocks, default 64; at most the destination's blocks / on_deck */
    uint32_t min_batch;           /* default 8 (a load does not wait for it) */
    uint32_t flush_interval_us;   /* default 10 ms (nor for this) */
    uint32_t policy_timeout_us;   /* default 100 ms */
    uint32_t sweep_interval_us;   /* default 10 ms */
    uint32_t max_concurrent;      /* backend jobs in flight, default 1 */
    uint32_t on_deck;             /* upgraded batches kept ready, default 2 */
    uint64_t precondition_timeout_us; /* default 10 s */
    int presence;                 /* 0 = on (default), -1 = off */
    uint32_t min_frequency;       /* 0 = off: offload blocks offered at least this often */
    kvo_policy_fn policy;         /* optional */
    void *policy_user;
    kvo_clock_fn clock;           /* optional, for deterministic runs */
    void *clock_user;
    kvo_done_fn on_done;          /* optional; exactly once per transfer */
    void *done_user;
    kvo_stage_fn on_stage;        /* optional: every status change */
    void *stage_user;
    uint32_t dst_priority;        /* eviction level of landed blocks in the destination (below its
                                     priority_levels) */
} kvo_pipeline_config;

typedef struct kvo_enqueue_opts {
    kvo_token *token;             /* optional; shared tokens cancel many containers at once */
    kvo_event *precondition;      /* optional */
    uint32_t priority;            /* higher goes first */
} kvo_enqueue_opts;

typedef struct kvo_pipeline_stats {
    uint64_t enqueued, transferred, present, skipped, timed_out, dropped, failed, cancelled;
    uint64_t joined;              /* onboarded blocks that joined another transfer's copy */
    uint64_t dest_full;           /* transfers that found the destination full (failed with KVO_EFULL) */
    uint64_t batches, bytes;
    uint32_t in_flight_blocks;    /* now: blocks upgraded and not landed yet (on deck or in the backend) */
    uint64_t notes_lost;          /* always 0, kept for the ABI: each transfer's on_done note is reserved
                                     when it is accepted, so none is lost */
} kvo_pipeline_stats;

typedef struct kvo_pipeline kvo_pipeline;

/* Create a pipeline from src to dst through backend. KVO_EINVAL for missing pools/backend or a
 * dst_priority the destination has no level for, KVO_ELAYOUT when both pools have storage of different
 * block sizes. Thread safety: any thread. */
KVO_API kvo_result kvo_pipeline_create(const kvo_pipeline_config *config, kvo_pipeline **out);
/* Cancel what has not started, wait for what is in flight, release every handle, free. Not from a
 * callback of this pipeline (the call delivering it uses the pipeline after the callback returns). */
KVO_API void kvo_pipeline_destroy(kvo_pipeline *pipeline);

/* Offload: enqueue n weak handles of source blocks (Registered). Stale handles are counted as dropped
 * when the batch is upgraded. KVO_EINVAL for n above UINT32_MAX (a transfer counts its blocks in 32
 * bits), KVO_ECANCELLED when the token is already cancelled, KVO_ENOMEM when out of memory (nothing
 * enqueued; the memory on_done will need is taken here, so it is always called). opts may be NULL. Out
 * of memory later, in a stage, a transfer fails with KVO_ENOMEM. Thread safety: any thread. */
KVO_API kvo_result kvo_enqueue(kvo_pipeline *pipeline, const kvb_weak *blocks, size_t n,
                               const kvo_enqueue_opts *opts, kvo_transfer *out);

/* Onboard: load the blocks with these hashes from the source pool into the destination. Each hash is
 * matched in the destination first (present: its block is returned as it is), then among the blocks
 * this pipeline has in flight (joined: another transfer is copying it; this one waits for that copy
 * and then takes the block from the destination, so two requests with a common prefix move it once;
 * should that copy fail, this transfer loads the block itself), then in the source (references taken
 * at once); a hash in none of them is a miss and ends the request there (longest prefix).
 * The destination blocks, one strong reference each, are taken with kvo_transfer_take_blocks. Results as
 * kvo_enqueue's. Thread safety: any thread. */
KVO_API kvo_result kvo_onboard(kvo_pipeline *pipeline, const kvb_hash *hashes, size_t n,
                               const kvo_enqueue_opts *opts, kvo_transfer *out);

/* Run every stage once (KVO_MODE_POLL; in thread mode it only wakes the coordinator). */
KVO_API kvo_result kvo_pipeline_poll(kvo_pipeline *pipeline);
/* Push everything pending through regardless of min batch and flush interval, and wait (poll mode:
 * pump, at least one pass) until nothing is left in any stage or timeout_us passes (negative = forever):
 * KVO_ETIMEDOUT.
 * timeout_us is real time; the policy and precondition timeouts follow the config's clock: with a manual
 * clock that does not move, a "later" answer or an unsignalled precondition never ends (section 3).
 * From on_done (of this or any other pipeline) it waits for everything but the callbacks its own thread
 * is delivering (that one and those queued after it) and those of other threads that drain, or destroy a
 * pipeline, from on_done too, whichever pipeline they drain (each would wait for the other). */
KVO_API kvo_result kvo_pipeline_drain(kvo_pipeline *pipeline, int64_t timeout_us);
/* Frequency policy: count uses of blocks (e.g. prefix hits) without offering them. */
KVO_API kvo_result kvo_pipeline_note_use(kvo_pipeline *pipeline, const kvb_hash *hashes, size_t n);
KVO_API kvo_result kvo_pipeline_get_stats(kvo_pipeline *pipeline, kvo_pipeline_stats *out);
KVO_API kvo_result kvo_pipeline_get_config(const kvo_pipeline *pipeline, kvo_pipeline_config *out);

/* Status and counts. KVO_ESTALE for a released handle. */
KVO_API kvo_result kvo_transfer_get_info(kvo_pipeline *pipeline, kvo_transfer transfer, kvo_transfer_info *out);
/* Wait for a final state up to timeout_us (negative = forever; poll mode pumps the pipeline meanwhile,
 * at least one pass, so timeout 0 polls):
 * KVO_OK, KVO_ETIMEDOUT, KVO_ESTALE (also when the handle is released while this waits, e.g. by an
 * on_done callback, as the tier manager's are). *out_status may be NULL. */
KVO_API kvo_result kvo_transfer_wait(kvo_pipeline *pipeline, kvo_transfer transfer, int64_t timeout_us,
                                     kvo_status *out_status);
/* Cancel: sweeps the queues at once; returns when nothing of the container is in flight. The final
 * status goes to *out_status (may be NULL): Cancelled (on-deck batches included, though upgraded and
 * reported Transferring), or Complete / Failed when the backend already had its job or it had finished. Cancelling twice is fine. KVO_ESTALE for a released handle (also one released
 * while this waits). */
KVO_API kvo_result kvo_transfer_cancel(kvo_pipeline *pipeline, kvo_transfer transfer, kvo_status *out_status);
/* Onboarding result: the destination blocks (strong references, now the caller's), in hash order; at
 * most max, count in *out_n. A max below the transfer's blocks takes their first max (a shorter prefix)
 * and gives the rest back at once (they stay cached). Only once, after Complete: KVO_ESTATE otherwise. */
KVO_API kvo_result kvo_transfer_take_blocks(kvo_pipeline *pipeline, kvo_transfer transfer, kvb_block *out,
                                            size_t max, size_t *out_n);
/* Forget the handle (cancelling it first if it is not final; untaken onboarded blocks are released). */
KVO_API kvo_result kvo_transfer_release(kvo_pipeline *pipeline, kvo_transfer transfer);

/* ---- tier manager ------------------------------------------------------------------------------- */

typedef enum kvo_offload_mode { KVO_OFFLOAD_EAGER = 0, KVO_OFFLOAD_LAZY } kvo_offload_mode;

/* Told of every finished offload into tier + 1 (from tier, or from branch_from into the last tier; the
 * transfer handle is released right after). */
typedef void (*kvo_offloaded_fn)(void *user, uint32_t tier, kvo_transfer transfer, const kvo_transfer_info *info);

typedef struct kvo_manager_config {
    uint32_t num_tiers;                     /* 2 .. KVO_MAX_TIERS */
    kvb_pool *pools[KVO_MAX_TIERS];         /* G1 (fastest) first */
    kvo_backend *down[KVO_MAX_TIERS];       /* down[i] copies tier i -> i + 1 */
    kvo_backend *up[KVO_MAX_TIERS];         /* up[i] copies tier i -> G1 (i >= 1) */
    kvo_offload_mode offload;
    uint32_t branch_from;                   /* 0 = a chain; else the tier (1 .. num_tiers - 3) the last tier
                                               copies from, with backend down[num_tiers - 2] (section 5) */
    uint32_t lazy_reserve;                  /* lazy: blocks kept ready to be taken, free ones or eviction
                                               candidates backed below (section 5), default 64 (at
                                               most a tier's blocks) */
    kvo_pipeline_config pipeline;           /* template: mode, batching, policies (pools and backend
                                               ignored); on_done is the manager's (KVO_EINVAL if set): a
                                               finished offload is told through on_offloaded */
    kvo_offloaded_fn on_offloaded;          /* optional */
    void *offloaded_user;
} kvo_manager_config;

typedef struct kvo_manager_stats {
    kvo_pipeline_stats down[KVO_MAX_TIERS]; /* tier i -> i + 1 (the last: from branch_from at a branch) */
    kvo_pipeline_stats up[KVO_MAX_TIERS];   /* tier i -> G1 */
} kvo_manager_stats;

typedef struct kvo_manager kvo_manager;

KVO_API kvo_result kvo_manager_create(const kvo_manager_config *config, kvo_manager **out);
KVO_API void kvo_manager_destroy(kvo_manager *manager);
/* Blocks just registered in `tier`: eager mode sends them down (with those that failed to go down from
 * `tier` before, section 5); lazy mode ignores them (poll finds them when they near eviction). *out
 * (may be NULL) gets the transfer, {0} when none was started; the manager releases it after
 * on_offloaded. KVO_EINVAL (*out untouched) for a NULL manager, a tier past the last, NULL blocks with
 * n > 0 or n above UINT32_MAX (kvo_enqueue's bound). KVO_ENOMEM when out of memory: nothing sent, except
 * at a branch tier, where the copy down the first of its two pipelines may be on its way when the second
 * refuses (*out is {0}).
 * Thread safety: any thread. */
KVO_API kvo_result kvo_manager_offer(kvo_manager *manager, uint32_t tier, const kvb_block *blocks, size_t n,
                                     kvo_transfer *out);
/* Pump the pipelines (poll mode) and, in lazy mode, send down the eviction candidates. Call once per
 * engine step in either mode. */
KVO_API kvo_result kvo_manager_poll(kvo_manager *manager);
/* Longest prefix of `hashes` held in any tier: tier_of[i] = the fastest tier holding block i, for
 * i < *out_n. Thread safety: any thread. */
KVO_API kvo_result kvo_manager_lookup(kvo_manager *manager, const kvb_hash *hashes, size_t n,
                                      uint8_t *tier_of, size_t *out_n);
/* Load `hashes` from `tier` (>= 1) into G1: a kvo_onboard on that tier's up pipeline. */
KVO_API kvo_result kvo_manager_onboard(kvo_manager *manager, uint32_t tier, const kvb_hash *hashes, size_t n,
                                       kvo_transfer *out);
KVO_API kvo_pipeline *kvo_manager_pipeline(kvo_manager *manager, uint32_t from_tier, int up);
/* The configuration in use: lazy_reserve's default filled in, the hook now installed, the pipeline
 * template as given (each pipeline's own, defaults and clamps applied: kvo_pipeline_get_config of
 * kvo_manager_pipeline). Thread safety: any thread. */
KVO_API kvo_result kvo_manager_get_config(const kvo_manager *manager, kvo_manager_config *out);
/* Replace the on_offloaded hook at any time (e.g. a connector installing itself, or taking itself back
 * before it is freed): returns once no call of the hooks it replaced is in progress on another thread, so
 * their user data may go then (calls of the new one are not waited for). Not from within a hook. */
KVO_API kvo_result kvo_manager_set_offloaded(kvo_manager *manager, kvo_offloaded_fn fn, void *user);
/* Install the on_offloaded hook only while the manager has none: KVO_OK, or KVO_ESTATE when it has one
 * (from its config or a set or claim), which stays; KVO_EINVAL for a NULL manager or fn. The check and
 * the set are one step: of two claims at once, one wins. Thread safety: any thread. */
KVO_API kvo_result kvo_manager_claim_offloaded(kvo_manager *manager, kvo_offloaded_fn fn, void *user);
/* Finish everything in flight (drains each pipeline, eager chains included), within timeout_us for the
 * whole call (negative = no limit): KVO_OK, or KVO_ETIMEDOUT with work still in flight. */
KVO_API kvo_result kvo_manager_drain(kvo_manager *manager, int64_t timeout_us);
KVO_API kvo_result kvo_manager_get_stats(kvo_manager *manager, kvo_manager_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* KVOFFLOAD_H */

/* ================================================================================================ */
/*                                        IMPLEMENTATION                                            */
/* ================================================================================================ */
#if (defined(KVOFFLOAD_IMPLEMENTATION) || defined(KVCACHE_IMPLEMENTATION)) && !defined(KVCACHE__POSIX_MISSING)
#ifndef KVOFFLOAD_IMPL_INCLUDED
#define KVOFFLOAD_IMPL_INCLUDED
#ifndef KVBLOCK_IMPL_INCLUDED
#error "kvoffload.h: define KVBLOCK_IMPLEMENTATION in this file too (or KVCACHE_IMPLEMENTATION)"
#endif

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/uio.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__) && !defined(__cplusplus) && defined(__STRICT_ANSI__) && \
    !defined(typeof)
#define typeof __typeof__
#define KVO__DEFINED_TYPEOF
#endif

/* gcc/clang atomics work the same in C and C++ (stdatomic.h is C only). */
#define KVO__LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define KVO__STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define KVO__ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)

#define KVO__US_PER_S INT64_C(1000000)
/* Insert v at i of an stb_ds array (stbds_arrins trips -Wsign-compare). */
#define KVO__ARR_INSERT(a, i, v)                                                                      \
    do {                                                                                              \
        size_t kvo__at = (i);                                                                         \
        stbds_arrput((a), (v));                                                                       \
        memmove(&(a)[kvo__at + 1], &(a)[kvo__at], sizeof *(a) * (stbds_arrlenu(a) - 1 - kvo__at));    \
        (a)[kvo__at] = (v);                                                                           \
    } while (0)
/* Room for `need` elements in the stb_ds array *pa, grown as appends grow it (kvb__arr_fit): 0 when the
 * memory is not there, the array unchanged. Every append that could grow an array has its room made so
 * first: stb_ds's own growth writes through a failed realloc. */
#define kvo__fit(pa, need) kvb__arr_fit((void **)(void *)(pa), sizeof **(pa), (need))
#define KVO__SLOT_ALIGN 4096u
#define KVO__HEADER_BYTES 4096u
#define KVO__DISK_MAGIC 0x3142564bu /* "KVB1" */
#define KVO__DISK_VERSION 2u /* 2 since 0.2, whose block hashes differ: a slot 0.1 wrote never verifies */

KVO_API const char *kvo_result_string(int result)
{
    switch (result) {
#define KVO__STRING_CASE(name, value, text) case value: return text;
        KVO__RESULTS(KVO__STRING_CASE)
#undef KVO__STRING_CASE
    default: return kvb_result_string(result);
    }
}

/* ---- time --------------------------------------------------------------------------------------- */

static uint64_t kvo__mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static struct timespec kvo__deadline(int64_t timeout_us)
{
    struct timespec ts;
    if (timeout_us < 0) timeout_us = 0; /* a deadline in the past would leave tv_nsec negative: EINVAL */
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(timeout_us / KVO__US_PER_S);
    ts.tv_nsec += (long)(timeout_us % KVO__US_PER_S) * 1000;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

static int kvo__cond_init(pthread_cond_t *c)
{
    pthread_condattr_t a;
    int r;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    r = pthread_cond_init(c, &a);
    pthread_condattr_destroy(&a);
    return r;
}

/* Wait on c until woken or the deadline (NULL = forever); returns 0 on timeout. */
static int kvo__cond_wait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *deadline)
{
    if (!deadline) return pthread_cond_wait(c, m) == 0;
    return pthread_cond_timedwait(c, m, deadline) != ETIMEDOUT;
}

static void kvo__sleep_us(uint64_t us)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(us / 1000000u);
    ts.tv_nsec = (long)(us % 1000000u) * 1000;
    nanosleep(&ts, NULL);
}

/* ---- tokens ------------------------------------------------------------------------------------- */

struct kvo_token {
    int cancelled;
    int refs;
    kvo_token *parent; /* a container's own token is also cancelled by the caller's */
};

static kvo_result kvo__token_new(kvo_token *parent, kvo_token **out)
{
    kvo_token *t = (kvo_token *)KVB_MALLOC(sizeof *t);
    if (!t) return KVO_ENOMEM;
    t->cancelled = 0;
    t->refs = 1;
    t->parent = parent;
    if (parent) kvo_token_retain(parent);
    *out = t;
    return KVO_OK;
}

KVO_API kvo_result kvo_token_create(kvo_token **out)
{
    if (!out) return KVO_EINVAL;
    return kvo__token_new(NULL, out);
}

KVO_API void kvo_token_cancel(kvo_token *token)
{
    if (token) KVO__STORE(&token->cancelled, 1);
}

KVO_API int kvo_token_is_cancelled(const kvo_token *token)
{
    for (; token; token = token->parent)
        if (KVO__LOAD(&token->cancelled)) return 1;
    return 0;
}

KVO_API void kvo_token_retain(kvo_token *token)
{
    if (token) KVO__ADD(&token->refs, 1);
}

KVO_API void kvo_token_release(kvo_token *token)
{
    if (!token || KVO__ADD(&token->refs, -1) != 0) return;
    kvo_token_release(token->parent);
    KVB_FREE(token);
}

/* ---- events ------------------------------------------------------------------------------------- */

struct kvo_event {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int signalled;
    int refs;
    kvo_event_query_fn query;
    void *user;
};

KVO_API kvo_result kvo_event_create_custom(kvo_event_query_fn query, void *user, kvo_event **out)
{
    kvo_event *e;
    if (!out) return KVO_EINVAL;
    e = (kvo_event *)KVB_MALLOC(sizeof *e);
    if (!e) return KVO_ENOMEM;
    memset(e, 0, sizeof *e);
    if (pthread_mutex_init(&e->lock, NULL) != 0 || kvo__cond_init(&e->cond) != 0) {
        KVB_FREE(e);
        return KVO_ENOMEM;
    }
    e->refs = 1;
    e->query = query;
    e->user = user;
    *out = e;
    return KVO_OK;
}

KVO_API kvo_result kvo_event_create(kvo_event **out) { return kvo_event_create_custom(NULL, NULL, out); }

KVO_API kvo_result kvo_event_signal(kvo_event *event)
{
    if (!event || event->query) return KVO_EINVAL;
    pthread_mutex_lock(&event->lock);
    event->signalled = 1;
    pthread_cond_broadcast(&event->cond);
    pthread_mutex_unlock(&event->lock);
    return KVO_OK;
}

KVO_API int kvo_event_query(kvo_event *event)
{
    int s;
    if (!event) return KVO_EINVAL;
    if (event->query) return event->query(event->user);
    pthread_mutex_lock(&event->lock);
    s = event->signalled;
    pthread_mutex_unlock(&event->lock);
    return s;
}

KVO_API kvo_result kvo_event_wait(kvo_event *event, int64_t timeout_us)
{
    struct timespec dl;
    int s = 0;
    uint64_t start = kvo__mono_us();
    if (!event) return KVO_EINVAL;
    if (event->query) { /* custom events can only be polled */
        while ((s = event->query(event->user)) == 0) {
            if (timeout_us >= 0 && kvo__mono_us() - start >= (uint64_t)timeout_us) return KVO_ETIMEDOUT;
            kvo__sleep_us(50);
        }
        return s > 0 ? KVO_OK : KVO_EPRECOND;
    }
    dl = kvo__deadline(timeout_us < 0 ? 0 : timeout_us);
    pthread_mutex_lock(&event->lock);
    while (!event->signalled && kvo__cond_wait(&event->cond, &event->lock, timeout_us < 0 ? NULL : &dl)) {
    }
    s = event->signalled;
    pthread_mutex_unlock(&event->lock);
    return s ? KVO_OK : KVO_ETIMEDOUT;
}

KVO_API void kvo_event_retain(kvo_event *event)
{
    if (event) KVO__ADD(&event->refs, 1);
}

KVO_API void kvo_event_release(kvo_event *event)
{
    if (!event || KVO__ADD(&event->refs, -1) != 0) return;
    pthread_mutex_destroy(&event->lock);
    pthread_cond_destroy(&event->cond);
    KVB_FREE(event);
}

/* ---- cancellable queue -------------------------------------------------------------------------- */

typedef struct kvo__qitem { void *item; kvo_token *token; } kvo__qitem;

struct kvo_queue {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvo__qitem *items; /* stb_ds array; live part is [head, len) */
    size_t head;
    int closed;
    kvo_queue_config cfg;
};

KVO_API kvo_result kvo_queue_create(const kvo_queue_config *config, kvo_queue **out)
{
    kvo_queue *q;
    if (!out) return KVO_EINVAL;
    q = (kvo_queue *)KVB_MALLOC(sizeof *q);
    if (!q) return KVO_ENOMEM;
    memset(q, 0, sizeof *q);
    if (config) q->cfg = *config;
    if (pthread_mutex_init(&q->lock, NULL) != 0 || kvo__cond_init(&q->cond) != 0) {
        KVB_FREE(q);
        return KVO_ENOMEM;
    }
    *out = q;
    return KVO_OK;
}

static void kvo__qdrop(kvo_queue *q, kvo__qitem *it)
{
    if (q->cfg.on_drop) q->cfg.on_drop(it->item, q->cfg.user);
    kvo_token_release(it->token);
}

KVO_API void kvo_queue_destroy(kvo_queue *queue)
{
    size_t i;
    if (!queue) return;
    for (i = queue->head; i < stbds_arrlenu(queue->items); i++) kvo__qdrop(queue, &queue->items[i]);
    stbds_arrfree(queue->items);
    pthread_mutex_destroy(&queue->lock);
    pthread_cond_destroy(&queue->cond);
    KVB_FREE(queue);
}

KVO_API kvo_result kvo_queue_push(kvo_queue *queue, void *item, kvo_token *token)
{
    kvo__qitem it;
    if (!queue) return KVO_EINVAL;
    if (kvo_token_is_cancelled(token)) return KVO_ECANCELLED;
    pthread_mutex_lock(&queue->lock);
    if (queue->closed) {
        pthread_mutex_unlock(&queue->lock);
        return KVO_ECLOSED;
    }
    if (!kvo__fit(&queue->items, stbds_arrlenu(queue->items) + 1)) {
        pthread_mutex_unlock(&queue->lock);
        return KVO_ENOMEM;
    }
    it.item = item;
    it.token = token;
    kvo_token_retain(token);
    stbds_arrput(queue->items, it); /* within the room made */
    pthread_cond_signal(&queue->cond);
    pthread_mutex_unlock(&queue->lock);
    return KVO_OK;
}

/* Keep the live part at the front once the consumed part dominates. Queue locked. */
static void kvo__qcompact(kvo_queue *q)
{
    size_t len = stbds_arrlenu(q->items);
    if (q->head < 64 || q->head * 2 < len) return;
    memmove(q->items, q->items + q->head, (len - q->head) * sizeof *q->items);
    KVB__ARR_SHRINK(q->items, len - q->head);
    q->head = 0;
}

KVO_API kvo_result kvo_queue_pop(kvo_queue *queue, void **out_item, int64_t timeout_us)
{
    struct timespec dl;
    kvo_result r = KVO_ETIMEDOUT;
    if (!queue || !out_item) return KVO_EINVAL;
    if (timeout_us > 0) dl = kvo__deadline(timeout_us);
    pthread_mutex_lock(&queue->lock);
    for (;;) {
        while (queue->head < stbds_arrlenu(queue->items)) {
            kvo__qitem it = queue->items[queue->head++];
            if (kvo_token_is_cancelled(it.token)) {
                kvo__qdrop(queue, &it);
                continue;
            }
            kvo_token_release(it.token);
            *out_item = it.item;
            r = KVO_OK;
            break;
        }
        if (r == KVO_OK) break;
        if (queue->closed) {
            r = KVO_ECLOSED;
            break;
        }
        if (timeout_us == 0) break;
        if (!kvo__cond_wait(&queue->cond, &queue->lock, timeout_us < 0 ? NULL : &dl)) {
            timeout_us = 0; /* one last look */
        }
    }
    kvo__qcompact(queue);
    pthread_mutex_unlock(&queue->lock);
    return r;
}

KVO_API kvo_result kvo_queue_sweep(kvo_queue *queue, size_t *out_dropped)
{
    size_t i, w, dropped = 0;
    if (!queue) return KVO_EINVAL;
    pthread_mutex_lock(&queue->lock);
    for (i = w = queue->head; i < stbds_arrlenu(queue->items); i++) {
        if (kvo_token_is_cancelled(queue->items[i].token)) {
            kvo__qdrop(queue, &queue->items[i]);
            dropped++;
        } else {
            queue->items[w++] = queue->items[i];
        }
    }
    KVB__ARR_SHRINK(queue->items, w);
    pthread_mutex_unlock(&queue->lock);
    if (out_dropped) *out_dropped = dropped;
    return KVO_OK;
}

KVO_API size_t kvo_queue_len(kvo_queue *queue)
{
    size_t n;
    if (!queue) return 0;
    pthread_mutex_lock(&queue->lock);
    n = stbds_arrlenu(queue->items) - queue->head;
    pthread_mutex_unlock(&queue->lock);
    return n;
}

KVO_API void kvo_queue_close(kvo_queue *queue)
{
    if (!queue) return;
    pthread_mutex_lock(&queue->lock);
    queue->closed = 1;
    pthread_cond_broadcast(&queue->cond);
    pthread_mutex_unlock(&queue->lock);
}

/* ---- checksum ----------------------------------------------------------------------------------- */

/* Low ^ high half of the 128-bit product (kvblock.h's kvb__mul128). */
static uint64_t kvo__mum(uint64_t x, uint64_t y)
{
    uint64_t hi, lo = kvb__mul128(x, y, &hi);
    return lo ^ hi;
}

static uint64_t kvo__le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* the checksum is defined on little-endian hosts' byte order */
    return v;
}

/* Four independent lanes of multiply-fold over 32-byte stripes, then the tail and the length. */
KVO_API uint64_t kvo_checksum(const void *data, size_t len)
{
    static const uint64_t k[4] = {UINT64_C(0x9e3779b97f4a7c15), UINT64_C(0xc2b2ae3d27d4eb4f),
                                  UINT64_C(0x165667b19e3779f9), UINT64_C(0xd6e8feb86659fd93)};
    const unsigned char *p = (const unsigned char *)data;
    uint64_t a[4] = {k[0], k[1], k[2], k[3]}, h;
    size_t i = 0, j;
    for (; i + 32 <= len; i += 32)
        for (j = 0; j < 4; j++) a[j] += kvo__mum(kvo__le64(p + i + 8 * j) ^ k[j], k[(j + 1) & 3] + (uint64_t)i);
    h = a[0] ^ (a[1] << 1 | a[1] >> 63) ^ (a[2] << 2 | a[2] >> 62) ^ (a[3] << 3 | a[3] >> 61);
    for (; i < len; i++) h = kvo__mum(h ^ p[i], k[i & 3]);
    return kvo__mum(h ^ (uint64_t)len, k[0]);
}

/* ---- copying pages between pools ---------------------------------------------------------------- */

typedef struct kvo__geom { unsigned char *base; uint64_t block_bytes; kvb_layout layout; uint32_t num_blocks; } kvo__geom;

static int kvo__geom_of(kvb_pool *p, kvo__geom *g)
{
    void *base = NULL;
    kvb_pool_config c;
    memset(g, 0, sizeof *g);
    memset(&c, 0, sizeof c);
    kvb_pool_storage(p, &base, NULL, &g->block_bytes, &g->layout);
    kvb_pool_get_config(p, &c);
    g->base = (unsigned char *)base;
    g->num_blocks = c.num_blocks;
    return base != NULL;
}

static unsigned char *kvo__page(const kvo__geom *g, uint32_t block, uint32_t layer, uint32_t part)
{
    return g->base + kvb_layout_offset(&g->layout, g->num_blocks, block, layer, part);
}

static int kvo__same_pages(const kvo__geom *a, const kvo__geom *b)
{
    return a->layout.num_layers == b->layout.num_layers && a->layout.num_parts == b->layout.num_parts &&
           a->layout.page_bytes == b->layout.page_bytes;
}

/* Block `bi` of g to/from a contiguous buffer in (layer, part) order: the canonical on-disk form. */
static void kvo__gather(const kvo__geom *g, uint32_t bi, unsigned char *buf)
{
    uint32_t l, q;
    size_t page = (size_t)g->layout.page_bytes;
    if (g->layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS) {
        memcpy(buf, kvo__page(g, bi, 0, 0), (size_t)g->block_bytes);
        return;
    }
    for (l = 0; l < g->layout.num_layers; l++)
        for (q = 0; q < g->layout.num_parts; q++, buf += page) memcpy(buf, kvo__page(g, bi, l, q), page);
}

static void kvo__scatter(const kvo__geom *g, uint32_t bi, const unsigned char *buf)
{
    uint32_t l, q;
    size_t page = (size_t)g->layout.page_bytes;
    if (g->layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS) {
        memcpy(kvo__page(g, bi, 0, 0), buf, (size_t)g->block_bytes);
        return;
    }
    for (l = 0; l < g->layout.num_layers; l++)
        for (q = 0; q < g->layout.num_parts; q++, buf += page) memcpy(kvo__page(g, bi, l, q), buf, page);
}

/* Large pages go to the other tier with streaming stores: the copy is not read back soon, so it should
 * not push the working set out of the cache, and it skips the read-for-ownership of the destination.
 * Callers end a job with kvo__copy_fence. */
#define KVO__STREAM_MIN 1024u
static void kvo__copy(void *dst, const void *src, size_t n)
{
#if defined(__SSE2__)
    if (n >= KVO__STREAM_MIN && !(((uintptr_t)dst | (uintptr_t)src | n) & 63)) {
        __m128i *d = (__m128i *)dst;
        const __m128i *s = (const __m128i *)src;
        size_t i;
        for (i = 0; i < n / 16; i += 4) {
            __m128i a = _mm_load_si128(s + i), b = _mm_load_si128(s + i + 1);
            __m128i c = _mm_load_si128(s + i + 2), e = _mm_load_si128(s + i + 3);
            _mm_stream_si128(d + i, a);
            _mm_stream_si128(d + i + 1, b);
            _mm_stream_si128(d + i + 2, c);
            _mm_stream_si128(d + i + 3, e);
        }
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void kvo__copy_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static void kvo__copy_block(const kvo__geom *s, uint32_t si, const kvo__geom *d, uint32_t di)
{
    uint32_t l, q;
    if (s->layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS && d->layout.kind == KVB_LAYOUT_BLOCK_CONTIGUOUS) {
        kvo__copy(kvo__page(d, di, 0, 0), kvo__page(s, si, 0, 0), (size_t)s->block_bytes);
        return;
    }
    for (l = 0; l < s->layout.num_layers; l++)
        for (q = 0; q < s->layout.num_parts; q++)
            kvo__copy(kvo__page(d, di, l, q), kvo__page(s, si, l, q), (size_t)s->layout.page_bytes);
}

/* ---- backends: a shared worker pool ------------------------------------------------------------- */

KVO_API void kvo_backend_destroy(kvo_backend *backend)
{
    if (backend && backend->destroy) backend->destroy(backend);
}

typedef void (*kvo__run_fn)(kvo_backend *self, kvo_copy_job *job, uint32_t worker);

typedef struct kvo__workers {
    kvo_queue *jobs;
    pthread_t *threads;
    uint32_t n;
    kvo_backend *owner;
    kvo__run_fn run;
} kvo__workers;

typedef struct kvo__worker_arg { kvo__workers *w; uint32_t id; } kvo__worker_arg;

static void *kvo__worker_main(void *arg)
{
    kvo__worker_arg a = *(kvo__worker_arg *)arg;
    void *job;
    KVB_FREE(arg);
    while (kvo_queue_pop(a.w->jobs, &job, -1) == KVO_OK) a.w->run(a.w->owner, (kvo_copy_job *)job, a.id);
    return NULL;
}

static kvo_result kvo__workers_start(kvo__workers *w, uint32_t n, kvo_backend *owner, kvo__run_fn run)
{
    uint32_t i;
    memset(w, 0, sizeof *w);
    w->owner = owner;
    w->run = run;
    if (!n) return KVO_OK;
    if (kvo_queue_create(NULL, &w->jobs) != KVO_OK) return KVO_ENOMEM;
    w->threads = (pthread_t *)KVB_MALLOC(n * sizeof *w->threads);
    if (!w->threads) return KVO_ENOMEM;
    for (i = 0; i < n; i++) {
        kvo__worker_arg *a = (kvo__worker_arg *)KVB_MALLOC(sizeof *a);
        if (!a) break;
        a->w = w;
        a->id = i;
        if (pthread_create(&w->threads[i], NULL, kvo__worker_main, a) != 0) {
            KVB_FREE(a);
            break;
        }
        w->n++;
    }
    return w->n == n ? KVO_OK : KVO_ENOMEM;
}

static void kvo__workers_stop(kvo__workers *w)
{
    uint32_t i;
    if (w->jobs) kvo_queue_close(w->jobs);
    for (i = 0; i < w->n; i++) pthread_join(w->threads[i], NULL);
    kvo_queue_destroy(w->jobs);
    KVB_FREE(w->threads);
}

/* Run inline (no workers) or hand to a worker. */
static int kvo__workers_submit(kvo__workers *w, kvo_copy_job *job)
{
    if (!w->n) {
        w->run(w->owner, job, 0);
        return KVO_OK;
    }
    return kvo_queue_push(w->jobs, job, NULL);
}

/* ---- memcpy backend ----------------------------------------------------------------------------- */

typedef struct kvo__memcpy { kvo_backend base; kvo__workers workers; } kvo__memcpy;

static void kvo__memcpy_run(kvo_backend *self, kvo_copy_job *job, uint32_t worker)
{
    kvo__geom s, d;
    size_t i;
    (void)self;
    (void)worker;
    kvo__geom_of(job->src, &s);
    kvo__geom_of(job->dst, &d);
    job->bytes = 0;
    for (i = 0; i < job->n; i++) {
        kvo__copy_block(&s, job->src_idx[i], &d, job->dst_idx[i]);
        job->results[i] = KVO_OK;
        job->bytes += s.block_bytes;
    }
    kvo__copy_fence();
    job->done(job, KVO_OK, NULL);
}

KVO_API kvo_result kvo_copy_job_check(const kvo_copy_job *job)
{
    kvb_pool_config sc, dc;
    size_t i;
    if (!job || !job->src || !job->dst || !job->done || (job->n && (!job->src_idx || !job->dst_idx || !job->results)) ||
        kvb_pool_get_config(job->src, &sc) != KVB_OK || kvb_pool_get_config(job->dst, &dc) != KVB_OK)
        return KVO_EINVAL;
    for (i = 0; i < job->n; i++) /* a block past its pool would be read or written anywhere */
        if (job->src_idx[i] >= sc.num_blocks || job->dst_idx[i] >= dc.num_blocks) return KVO_EINVAL;
    return KVO_OK;
}

static int kvo__memcpy_submit(kvo_backend *self, kvo_copy_job *job)
{
    kvo__geom s, d;
    if (kvo_copy_job_check(job) != KVO_OK) return KVO_EINVAL;
    if (!kvo__geom_of(job->src, &s) || !kvo__geom_of(job->dst, &d)) return KVB_ENODATA;
    if (!kvo__same_pages(&s, &d)) return KVO_ELAYOUT;
    return kvo__workers_submit(&((kvo__memcpy *)self->impl)->workers, job);
}

static void kvo__memcpy_destroy(kvo_backend *self)
{
    kvo__memcpy *m = (kvo__memcpy *)self->impl;
    kvo__workers_stop(&m->workers);
    KVB_FREE(m);
}

KVO_API kvo_result kvo_memcpy_backend_create(uint32_t threads, kvo_backend **out)
{
    kvo__memcpy *m;
    if (!out || threads > 256) return KVO_EINVAL;
    m = (kvo__memcpy *)KVB_MALLOC(sizeof *m);
    if (!m) return KVO_ENOMEM;
    memset(m, 0, sizeof *m);
    m->base.submit = kvo__memcpy_submit;
    m->base.destroy = kvo__memcpy_destroy;
    m->base.name = "memcpy";
    m->base.impl = m;
    if (kvo__workers_start(&m->workers, threads, &m->base, kvo__memcpy_run) != KVO_OK) {
        kvo__memcpy_destroy(&m->base);
        return KVO_ENOMEM;
    }
    *out = &m->base;
    return KVO_OK;
}

/* ---- disk backend ------------------------------------------------------------------------------- */

typedef struct kvo__disk {
    kvo_backend base;
    kvo__workers workers;
    pthread_mutex_t lock; /* stats, the O_DIRECT fallback */
    int fd, direct;
    int bfd;              /* the same file without O_DIRECT (fd itself when that is buffered): opened with fd,
                             closed with it, so no fd in use is ever closed and the path is never reopened */
    int direct_ok;        /* an O_DIRECT transfer succeeded: the file system takes it */
    kvb_pool *pool;
    uint32_t num_slots;
    uint64_t block_bytes, data_bytes, slot_bytes;
    kvo_disk_stats stats;
    kvo_log_fn log;
    void *log_user;
    char *path;
} kvo__disk;

static void kvo__put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

static void kvo__disk_header(const kvo__disk *d, const kvb_hash *h, const unsigned char *data, unsigned char *hdr)
{
    uint32_t magic = KVO__DISK_MAGIC;
    uint16_t version = KVO__DISK_VERSION, flags = 0;
    memset(hdr, 0, KVO__HEADER_BYTES);
    memcpy(hdr, &magic, 4);
    memcpy(hdr + 4, &version, 2);
    memcpy(hdr + 6, &flags, 2);
    kvo__put64(hdr + 8, d->block_bytes);
    kvo__put64(hdr + 16, h->lo);
    kvo__put64(hdr + 24, h->hi);
    kvo__put64(hdr + 32, kvo_checksum(data, (size_t)d->block_bytes));
    kvo__put64(hdr + 40, kvo_checksum(hdr, 40));
}

/* A slot is good when its header is whole, names this hash and size, and the data matches. */
static int kvo__disk_verify(const kvo__disk *d, const kvb_hash *h, const unsigned char *slot,
                            const unsigned char *data)
{
    uint32_t magic;
    uint16_t version;
    memcpy(&magic, slot, 4);
    memcpy(&version, slot + 4, 2);
    return magic == KVO__DISK_MAGIC && version == KVO__DISK_VERSION &&
           kvo__le64(slot + 40) == kvo_checksum(slot, 40) && kvo__le64(slot + 8) == d->block_bytes &&
           kvo__le64(slot + 16) == h->lo && kvo__le64(slot + 24) == h->hi &&
           kvo__le64(slot + 32) == kvo_checksum(data, (size_t)d->block_bytes);
}

static void kvo__disk_say(kvo__disk *d, const char *msg)
{
    if (d->log) d->log(d->log_user, msg);
    else fprintf(stderr, "kvoffload: %s\n", msg);
}

static int kvo__errno_result(int e) { return e == ENOSPC || e == EDQUOT ? KVO_ENOSPC : KVO_EIO; }

static int kvo__disk_open(kvo__disk *d, int direct)
{
    int flags = O_RDWR | O_CREAT | O_CLOEXEC;
#ifdef O_DIRECT
    if (direct) flags |= O_DIRECT;
#else
    (void)direct;
#endif
    return open(d->path, flags, 0600);
}

/* An O_DIRECT transfer answered EINVAL; returns the buffered fd to go on with. Before any direct transfer
 * succeeded, the file system refuses O_DIRECT: buffered from now on, said once. After one did, it was
 * this request's (a length the kernel cut at the file size limit, the unaligned rest of a short
 * transfer): only this one goes on buffered. */
static int kvo__disk_fallback(kvo__disk *d)
{
    char msg[512];
    int say = 0;
    pthread_mutex_lock(&d->lock);
    if (d->direct && !KVO__LOAD(&d->direct_ok)) { /* set outside the lock (kvo__disk_io) */
        d->direct = 0;
        d->stats.direct_io = 0;
        say = 1;
    }
    pthread_mutex_unlock(&d->lock);
    if (say) { /* outside the lock: the callback may call back (kvo_disk_backend_stats) */
        snprintf(msg, sizeof msg, "%s: O_DIRECT refused by the file system, using buffered I/O", d->path);
        kvo__disk_say(d, msg);
    }
    return d->bfd;
}

/* Whole-slot I/O of the header and the data (two buffers: the data may be a pool block itself), retrying
 * short transfers, EINTR and an O_DIRECT refusal. 0 or errno. */
static int kvo__disk_io(kvo__disk *d, int write, unsigned char *hdr, unsigned char *data, uint64_t off)
{
    size_t done = 0, len = (size_t)d->slot_bytes;
    int fd, direct;
    pthread_mutex_lock(&d->lock);
    direct = d->direct;
    fd = direct ? d->fd : d->bfd;
    pthread_mutex_unlock(&d->lock);
    while (done < len) {
        struct iovec iov[2];
        int cnt = 0;
        ssize_t r;
        if (done < KVO__HEADER_BYTES) {
            iov[cnt].iov_base = hdr + done;
            iov[cnt++].iov_len = KVO__HEADER_BYTES - done;
        }
        iov[cnt].iov_base = data + (done > KVO__HEADER_BYTES ? done - KVO__HEADER_BYTES : 0);
        iov[cnt].iov_len = len - (done > KVO__HEADER_BYTES ? done : KVO__HEADER_BYTES);
        cnt++;
        r = write ? pwritev(fd, iov, cnt, (off_t)(off + done)) : preadv(fd, iov, cnt, (off_t)(off + done));
        if (r > 0) {
            done += (size_t)r;
            if (direct && !KVO__LOAD(&d->direct_ok)) KVO__STORE(&d->direct_ok, 1);
        } else if (r == 0) {
            if (write) return EIO;
            memset(done < KVO__HEADER_BYTES ? hdr + done : data + (done - KVO__HEADER_BYTES), 0,
                   done < KVO__HEADER_BYTES ? KVO__HEADER_BYTES - done : len - done); /* past the end: empty */
            if (done < KVO__HEADER_BYTES) memset(data, 0, (size_t)d->data_bytes);
            return 0;
        } else if (errno == EINVAL && direct) {
            fd = kvo__disk_fallback(d);
            direct = 0;
        } else if (errno != EINTR) {
            return errno;
        }
    }
    return 0;
}

/* The block's own memory can be the I/O buffer when it is one aligned, slot-sized run. */
static unsigned char *kvo__disk_direct_data(const kvo__disk *d, const kvo__geom *mem, uint32_t block)
{
    unsigned char *p;
    if (mem->layout.kind != KVB_LAYOUT_BLOCK_CONTIGUOUS || d->block_bytes != d->data_bytes) return NULL;
    p = kvo__page(mem, block, 0, 0);
    return ((uintptr_t)p & (KVO__SLOT_ALIGN - 1)) ? NULL : p;
}

/* Slot i of a write job made ready in buf (a slot-sized, aligned buffer): its data is the pool block
 * itself when that can be written directly, else gathered into buf; then the header with the checksum. */
static unsigned char *kvo__disk_prepare_slot(const kvo__disk *d, const kvo_copy_job *job, const kvo__geom *mem,
                                             size_t i, unsigned char *buf)
{
    unsigned char *data = kvo__disk_direct_data(d, mem, job->src_idx[i]);
    if (!data) {
        data = buf + KVO__HEADER_BYTES;
        memset(data + d->block_bytes, 0, (size_t)(d->data_bytes - d->block_bytes));
        kvo__gather(mem, job->src_idx[i], data);
    }
    kvo__disk_header(d, &job->hashes[i], data, buf);
    return data;
}

/* A write job's two threads: the preparer fills buf[i & 1] for slot i once slot i - 2 is written; the
 * writer writes slot i once it is ready. */
typedef struct kvo__disk_pipe {
    const kvo__disk *d;
    const kvo_copy_job *job;
    const kvo__geom *mem;
    unsigned char *buf[2], *data[2];
    size_t ready, written;
    int stop;
    pthread_mutex_t lock;
    pthread_cond_t cond;
} kvo__disk_pipe;

static void *kvo__disk_preparer(void *arg)
{
    kvo__disk_pipe *q = (kvo__disk_pipe *)arg;
    size_t i;
    for (i = 0; i < q->job->n; i++) {
        unsigned char *data;
        pthread_mutex_lock(&q->lock);
        while (!q->stop && q->written + 2 <= i) pthread_cond_wait(&q->cond, &q->lock);
        pthread_mutex_unlock(&q->lock);
        if (q->stop) break;
        data = kvo__disk_prepare_slot(q->d, q->job, q->mem, i, q->buf[i & 1]);
        pthread_mutex_lock(&q->lock);
        q->data[i & 1] = data;
        q->ready = i + 1;
        pthread_cond_broadcast(&q->cond);
        pthread_mutex_unlock(&q->lock);
    }
    return NULL;
}

/* The slot of copy i is in place (or failed): the job's result, counts and message. */
static void kvo__disk_note(kvo__disk *d, kvo_copy_job *job, size_t i, int e, int writing, int *result,
                           uint64_t *bytes, uint64_t *io_errors, char *msg, size_t msg_size)
{
    uint32_t slot = writing ? job->dst_idx[i] : job->src_idx[i];
    if (!e) {
        job->results[i] = KVO_OK;
        *bytes += d->block_bytes;
        return;
    }
    job->results[i] = kvo__errno_result(e);
    (*io_errors)++;
    if (*result == KVO_OK) { /* the message, like the result, tells of the first failure */
        *result = job->results[i];
        snprintf(msg, msg_size, "%s: %s slot %u: %s", d->path, writing ? "write" : "read", slot, strerror(e));
    }
}

/* Write the job's slots in order; with two or more, the next slot is prepared on a second thread while
 * this one writes (one thread alone when that thread cannot be started). */
static int kvo__disk_write_job(kvo__disk *d, kvo_copy_job *job, const kvo__geom *mem, unsigned char *bufs,
                               uint64_t *bytes, uint64_t *io_errors, char *msg, size_t msg_size)
{
    kvo__disk_pipe q;
    pthread_t helper;
    int result = KVO_OK, threaded = 0;
    size_t i;
    memset(&q, 0, sizeof q);
    q.d = d;
    q.job = job;
    q.mem = mem;
    q.buf[0] = bufs;
    q.buf[1] = bufs + d->slot_bytes;
    if (job->n > 1 && pthread_mutex_init(&q.lock, NULL) == 0) {
        if (pthread_cond_init(&q.cond, NULL) == 0) {
            threaded = pthread_create(&helper, NULL, kvo__disk_preparer, &q) == 0;
            if (!threaded) pthread_cond_destroy(&q.cond);
        }
        if (!threaded) pthread_mutex_destroy(&q.lock);
    }
    for (i = 0; i < job->n; i++) {
        unsigned char *buf = q.buf[i & 1], *data;
        if (threaded) {
            pthread_mutex_lock(&q.lock);
            while (q.ready <= i) pthread_cond_wait(&q.cond, &q.lock);
            data = q.data[i & 1];
            pthread_mutex_unlock(&q.lock);
        } else {
            data = kvo__disk_prepare_slot(d, job, mem, i, buf);
        }
        kvo__disk_note(d, job, i, kvo__disk_io(d, 1, buf, data, (uint64_t)job->dst_idx[i] * d->slot_bytes), 1,
                       &result, bytes, io_errors, msg, msg_size);
        if (threaded) {
            pthread_mutex_lock(&q.lock);
            q.written = i + 1;
            pthread_cond_broadcast(&q.cond);
            pthread_mutex_unlock(&q.lock);
        }
    }
    if (threaded) {
        pthread_join(helper, NULL);
        pthread_cond_destroy(&q.cond);
        pthread_mutex_destroy(&q.lock);
    }
    return result;
}

/* Read the job's slots, each verified (header and checksum) before it is scattered into the pool. */
static int kvo__disk_read_job(kvo__disk *d, kvo_copy_job *job, const kvo__geom *mem, unsigned char *buf,
                              uint64_t *bytes, uint64_t *checksum_errors, uint64_t *io_errors, char *msg,
                              size_t msg_size)
{
    int result = KVO_OK;
    size_t i;
    for (i = 0; i < job->n; i++) {
        uint32_t slot = job->src_idx[i];
        unsigned char *data = kvo__disk_direct_data(d, mem, job->dst_idx[i]);
        int e;
        if (!data) data = buf + KVO__HEADER_BYTES;
        e = kvo__disk_io(d, 0, buf, data, (uint64_t)slot * d->slot_bytes);
        if (!e && !kvo__disk_verify(d, &job->hashes[i], buf, data)) {
            job->results[i] = KVO_ECHECKSUM;
            (*checksum_errors)++;
            if (result == KVO_OK) {
                result = KVO_ECHECKSUM;
                snprintf(msg, msg_size, "%s: slot %u failed its header or checksum check", d->path, slot);
            }
            continue;
        }
        if (!e && data == buf + KVO__HEADER_BYTES) kvo__scatter(mem, job->dst_idx[i], data);
        kvo__disk_note(d, job, i, e, 0, &result, bytes, io_errors, msg, msg_size);
    }
    return result;
}

static void kvo__disk_run(kvo_backend *self, kvo_copy_job *job, uint32_t worker)
{
    kvo__disk *d = (kvo__disk *)self->impl;
    int writing = job->dst == d->pool, result = KVO_OK;
    kvo__geom mem;
    unsigned char *buf = NULL;
    char msg[256] = "";
    size_t i;
    uint64_t bytes = 0, checksum_errors = 0, io_errors = 0;
    (void)worker;
    kvo__geom_of(writing ? job->src : job->dst, &mem);
    if (posix_memalign((void **)&buf, KVO__SLOT_ALIGN, (size_t)d->slot_bytes * (writing && job->n > 1 ? 2 : 1)) != 0)
        buf = NULL;
    if (!buf) {
        for (i = 0; i < job->n; i++) job->results[i] = KVO_ENOMEM;
        result = job->n ? KVO_ENOMEM : KVO_OK;
    } else if (writing) {
        result = kvo__disk_write_job(d, job, &mem, buf, &bytes, &io_errors, msg, sizeof msg);
    } else {
        result = kvo__disk_read_job(d, job, &mem, buf, &bytes, &checksum_errors, &io_errors, msg, sizeof msg);
    }
    free(buf);
    pthread_mutex_lock(&d->lock);
    if (writing) {
        d->stats.writes += job->n;
        d->stats.bytes_written += bytes;
    } else {
        d->stats.reads += job->n;
        d->stats.bytes_read += bytes;
    }
    d->stats.checksum_errors += checksum_errors;
    d->stats.io_errors += io_errors;
    pthread_mutex_unlock(&d->lock);
    job->bytes = bytes;
    job->done(job, result, msg[0] ? msg : NULL);
}

static int kvo__disk_submit(kvo_backend *self, kvo_copy_job *job)
{
    kvo__disk *d = (kvo__disk *)self->impl;
    kvo__geom mem;
    if (kvo_copy_job_check(job) != KVO_OK || !job->hashes) return KVO_EINVAL;
    if ((job->dst == d->pool) == (job->src == d->pool)) return KVO_EINVAL;
    if (!kvo__geom_of(job->dst == d->pool ? job->src : job->dst, &mem)) return KVB_ENODATA;
    if (mem.block_bytes != d->block_bytes) return KVO_ELAYOUT;
    return kvo__workers_submit(&d->workers, job);
}

static void kvo__disk_destroy(kvo_backend *self)
{
    kvo__disk *d = (kvo__disk *)self->impl;
    kvo__workers_stop(&d->workers);
    if (d->bfd >= 0 && d->bfd != d->fd) close(d->bfd);
    if (d->fd >= 0) close(d->fd);
    pthread_mutex_destroy(&d->lock);
    KVB_FREE(d->path);
    KVB_FREE(d);
}

static kvo_result kvo__disk_prepare_file(kvo__disk *d, int direct)
{
    char msg[512];
    uint64_t total = (uint64_t)d->num_slots * d->slot_bytes;
    int e;
    d->fd = kvo__disk_open(d, direct);
    if (d->fd < 0 && direct && errno == EINVAL) {
        d->fd = kvo__disk_open(d, 0);
        if (d->fd >= 0) {
            snprintf(msg, sizeof msg, "%s: O_DIRECT refused by the file system, using buffered I/O", d->path);
            kvo__disk_say(d, msg);
            direct = 0;
        }
    }
    if (d->fd < 0) return (kvo_result)kvo__errno_result(errno);
    d->bfd = direct ? kvo__disk_open(d, 0) : d->fd;
    if (d->bfd < 0) return (kvo_result)kvo__errno_result(errno);
    d->direct = direct;
    d->stats.direct_io = direct;
    e = posix_fallocate(d->fd, 0, (off_t)total);
    if (e == ENOSPC || e == EDQUOT) return KVO_ENOSPC;
    if (e && ftruncate(d->fd, (off_t)total) != 0) return (kvo_result)kvo__errno_result(errno);
    return KVO_OK;
}

KVO_API kvo_result kvo_disk_backend_create(const kvo_disk_config *config, kvo_backend **out)
{
    kvo__disk *d;
    kvb_pool_config pc;
    kvo_result r;
    if (!config || !out || !config->path || !config->disk_pool || !config->block_bytes || config->threads > 256)
        return KVO_EINVAL;
    memset(&pc, 0, sizeof pc);
    if (kvb_pool_get_config(config->disk_pool, &pc) != KVB_OK || pc.storage != KVB_STORAGE_NONE) {
        /* its blocks stand for slots of the file: bytes in the pool itself would be served by nobody */
        if (config->log) config->log(config->log_user, "disk: config.disk_pool must be a metadata-only pool");
        else fprintf(stderr, "kvoffload: disk: config.disk_pool must be a metadata-only pool\n");
        return KVO_EINVAL;
    }
    d = (kvo__disk *)KVB_MALLOC(sizeof *d);
    if (!d) return KVO_ENOMEM;
    memset(d, 0, sizeof *d);
    d->fd = d->bfd = -1;
    d->path = (char *)KVB_MALLOC(strlen(config->path) + 1);
    if (!d->path || pthread_mutex_init(&d->lock, NULL) != 0) {
        KVB_FREE(d->path);
        KVB_FREE(d);
        return KVO_ENOMEM;
    }
    strcpy(d->path, config->path);
    d->pool = config->disk_pool;
    d->num_slots = pc.num_blocks;
    d->block_bytes = config->block_bytes;
    d->data_bytes = (config->block_bytes + KVO__SLOT_ALIGN - 1) / KVO__SLOT_ALIGN * KVO__SLOT_ALIGN;
    d->slot_bytes = KVO__HEADER_BYTES + d->data_bytes;
    d->log = config->log;
    d->log_user = config->log_user;
    d->base.submit = kvo__disk_submit;
    d->base.destroy = kvo__disk_destroy;
    d->base.name = "disk";
    d->base.impl = d;
    /* the workers first: a create that fails after the file was preallocated would leave it behind */
    r = kvo__workers_start(&d->workers, config->threads, &d->base, kvo__disk_run);
    if (r == KVO_OK) r = kvo__disk_prepare_file(d, config->direct >= 0);
    if (r != KVO_OK) {
        kvo__disk_destroy(&d->base);
        return r;
    }
    *out = &d->base;
    return KVO_OK;
}

KVO_API kvo_result kvo_disk_backend_stats(kvo_backend *disk, kvo_disk_stats *out)
{
    kvo__disk *d;
    if (!disk || !out || disk->submit != kvo__disk_submit) return KVO_EINVAL;
    d = (kvo__disk *)disk->impl;
    pthread_mutex_lock(&d->lock);
    *out = d->stats;
    pthread_mutex_unlock(&d->lock);
    return KVO_OK;
}

KVO_API uint64_t kvo_disk_slot_offset(kvo_backend *disk, uint32_t index)
{
    if (!disk || disk->submit != kvo__disk_submit || index >= ((kvo__disk *)disk->impl)->num_slots)
        return UINT64_MAX; /* not 0: that is slot 0's */
    return (uint64_t)index * ((kvo__disk *)disk->impl)->slot_bytes;
}

/* ---- pipeline: containers, handles, stages ------------------------------------------------------ */

enum { /* per-block progress inside a container */
    KVO__B_NEW = 0, /* hash not read yet */
    KVO__B_EVAL,    /* waiting for the policy */
    KVO__B_OFFER,
    KVO__B_SKIP,
    KVO__B_TIMEOUT,
    KVO__B_PRESENT,
    KVO__B_DROPPED,
    KVO__B_DONE,
    KVO__B_FAILED,
    KVO__B_JOINING, /* onboarding: waits for another transfer's copy of the hash */
    KVO__B_JOINED,  /* ... which landed: dst_keep holds the block */
    KVO__B_LOST     /* ... which failed, and the block is nowhere now: failed, never counted in flight */
};

typedef struct kvo__container {
    size_t cap;             /* blocks its arrays have room for (kvo__container_new reuses containers) */
    uint32_t slot;
    kvo_token *token;       /* its own; the caller's token is its parent */
    kvo_event *pre;
    uint32_t priority;
    int onboard, final, taken, inflight_marked;
    int swept;              /* kvo__sweep_on_deck: its token read cancelled in this sweep */
    int join_wait;          /* kvo__break_join_cycles: 1 waits for joins, 2 ... for ones that end */
    uint64_t t_enqueue, t_eval;
    size_t n;
    kvb_weak *src;
    kvb_block *src_strong;  /* held after the upgrade (onboarding: from the start) */
    kvb_hash *hashes, *parents;
    uint8_t *state;
    kvb_weak *dst_weak;
    kvb_block *dst_keep;    /* onboarding: the caller's references */
    struct kvo__note *note; /* on_done's, reserved while it is not final (pipelines with on_done) */
    kvo_transfer_info info;
} kvo__container;

typedef struct kvo__hslot { uint32_t gen; kvo__container *c; } kvo__hslot;

/* A transfer's on_done note, reserved when the transfer is accepted (kvo__note_reserve) so that its
 * end is told without allocating; once final, in the pipeline's list of notes to deliver (FIFO). */
typedef struct kvo__note {
    struct kvo__note *next;
    kvo_transfer t;
    kvo_transfer_info info;
    kvb_weak *dst;          /* room for cap handles, n of them used: in the same allocation, after it */
    size_t n, cap;
} kvo__note;

/* A thread delivering on_done callbacks (on its stack, in kvo_pipeline.delivering while it does). */
typedef struct kvo__delivery {
    pthread_t thread;
    uint32_t draining;  /* its thread drains a pipeline from one of these callbacks (kvo__others_delivering);
                         * under pl's lock */
    kvo_pipeline *pl;
    struct kvo__delivery *next;  /* the pipeline's next delivery in progress */
    struct kvo__delivery *outer; /* the thread's delivery this one runs inside (a callback that delivers) */
} kvo__delivery;

#ifdef __cplusplus
#define KVO__THREAD_LOCAL thread_local
#else
#define KVO__THREAD_LOCAL _Thread_local
#endif
/* The calling thread's innermost delivery, of any pipeline: a drain from a callback marks the thread's
 * deliveries as draining in their own pipelines, so that a callback of another pipeline that drains
 * this thread's pipeline does not wait for them either (each would wait for the other). Per thread, so
 * nothing is shared between pools or pipelines. */
static KVO__THREAD_LOCAL kvo__delivery *kvo__current;

typedef struct kvo__batch {
    kvo_pipeline *pl;
    kvo__container **cs;    /* stb_ds array */
    uint32_t priority, blocks;
    kvo_copy_job job;
    /* after the upgrade, one entry per copy: */
    uint32_t *src_idx, *dst_idx;
    kvb_hash *hashes, *parents;
    int *results;
    kvb_block *src_b, *dst_b;
    kvo__container **owner;
    uint32_t *owner_i;
    unsigned char *mem;     /* the arrays above, room for mem_cap copies (kept when the batch is reused) */
    size_t mem_cap;
} kvo__batch;

struct kvo_pipeline {
    kvo_pipeline_config cfg;
    pthread_mutex_t lock;
    pthread_cond_t cond;      /* progress: final states, finished jobs, work for the coordinator */
    kvo_queue *q_eval, *q_pre, *q_batch;
    uint64_t batch_since;     /* when q_batch last went from empty to non-empty */
    kvo__batch **in_queue;    /* weak batches, higher priority first, FIFO within */
    kvo__batch **on_deck;     /* upgraded batches */
    uint32_t executing;       /* jobs handed to the backend and not done */
    uint32_t executing_blocks; /* ... and their copies */
    kvo__hslot *slots;
    uint32_t *free_slots;
    kvb__ctab inflight, freq;  /* blocks in flight, blocks seen (frequency policy), per hash */
    kvb__ctab join_loads;     /* scratch of kvo__break_join_cycles: blocks loaded by containers that wait */
    struct kvo__join_pair *join_pairs; /* stb_ds scratch of the same: joins sorted by hash, */
    uint32_t *join_blocked, *join_work; /* each waiting container's blocked joins, the worklist */
    uint64_t last_sweep;
    uint64_t moves;           /* counts every change of stage: tells a pass that did something */
    int draining, stopping, has_thread;
    kvo__delivery *delivering; /* deliveries of on_done callbacks in progress, one per thread and nesting */
    pthread_t thread;
    kvo_pipeline_stats stats;
    kvo__note *notes, *notes_last; /* final, to deliver (kvo__unlock), oldest first */
    uint32_t src_tier, dst_tier;
    uint32_t first_gen;       /* generation of a new handle slot: from the pools, so pipelines differ */
    /* kept for reuse, so that a steady stream of transfers allocates nothing (lock held) */
    kvo__container **spare_cs;
    kvo__batch **spare_bs;
    kvo__container **batcher_cs; /* scratch of kvo__stage_batcher */
    kvo__container **stage_cs; /* scratch of kvo__stage_policy and kvo__stage_precondition (put back) */
    uint8_t *present;         /* scratch of kvo__evaluate */
    kvb_hash *bad;            /* scratch of kvo__batch_finish: sources whose entry is damaged or gone */
    uint32_t keep_failed;     /* tier manager (eager): keep up to this many failed sources for its next send */
    kvb_weak *failed_src;     /* ... here: weak handles of sources whose copy failed (kvo__take_failed) */
    kvo__note *spare_notes;   /* a list, spare_notes_n long */
    uint32_t spare_notes_n;
};

#define KVO__SPARES 16 /* of each kind; beyond that they are freed */

static uint64_t kvo__now(const kvo_pipeline *pl)
{
    return pl->cfg.clock ? pl->cfg.clock(pl->cfg.clock_user) : kvo__mono_us();
}


static uint32_t kvo__count_get(const kvb__ctab *m, const kvb_hash *h) { return kvb__ctab_get(m, h); }

/* Out of memory a count is lost: a block may then be offered twice or once too few (policies only). */
static void kvo__count_add(kvb__ctab *m, const kvb_hash *h, int delta)
{
    if (delta > 0) (void)kvb__ctab_add(m, h, (uint32_t)delta);
    else (void)kvb__ctab_sub(m, h, (uint32_t)-delta, 0);
}

static size_t kvo__container_bytes(size_t cap)
{
    return sizeof(kvo__container) + cap * (sizeof(kvb_weak) * 2 + sizeof(kvb_block) * 2 + sizeof(kvb_hash) * 2 + 1);
}

/* A container for n blocks: a spare one with room, or a new one with room to be reused (at least 64
 * blocks, a power of two). Its own token, if it kept one, stays for kvo__container_open. Locked. */
static kvo__container *kvo__container_new(kvo_pipeline *pl, size_t n)
{
    kvo__container *c = NULL;
    kvo_token *token = NULL;
    unsigned char *p;
    size_t i, cap = 64;
    for (i = stbds_arrlenu(pl->spare_cs); i-- > 0;)
        if (pl->spare_cs[i]->cap >= n) {
            c = pl->spare_cs[i];
            stbds_arrdelswap(pl->spare_cs, i);
            break;
        }
    if (c) {
        cap = c->cap;
        token = c->token;
    } else {
        while (cap < n) cap *= 2; /* n <= SIZE_MAX / 2 (the entry points'), so this ends without wrapping */
        if (cap > (SIZE_MAX - sizeof *c) / kvo__container_bytes(1)) return NULL; /* a 32-bit size_t */
        if (!(c = (kvo__container *)KVB_MALLOC(kvo__container_bytes(cap)))) return NULL;
    }
    memset(c, 0, sizeof *c);
    c->cap = cap;
    c->token = token;
    p = (unsigned char *)(c + 1);
    c->n = n;
    c->hashes = (kvb_hash *)(void *)p;
    p += cap * sizeof(kvb_hash);
    c->parents = (kvb_hash *)(void *)p;
    p += cap * sizeof(kvb_hash);
    c->src = (kvb_weak *)(void *)p;
    p += cap * sizeof(kvb_weak);
    c->dst_weak = (kvb_weak *)(void *)p;
    p += cap * sizeof(kvb_weak);
    c->src_strong = (kvb_block *)(void *)p;
    p += cap * sizeof(kvb_block);
    c->dst_keep = (kvb_block *)(void *)p;
    p += cap * sizeof(kvb_block);
    c->state = p;
    memset(c->hashes, 0, n * sizeof *c->hashes);
    memset(c->parents, 0, n * sizeof *c->parents);
    memset(c->src, 0, n * sizeof *c->src);
    memset(c->dst_weak, 0, n * sizeof *c->dst_weak);
    memset(c->src_strong, 0, n * sizeof *c->src_strong);
    memset(c->dst_keep, 0, n * sizeof *c->dst_keep);
    memset(c->state, 0, n);
    c->info.blocks = (uint32_t)n;
    c->info.status = KVO_STATUS_EVALUATING;
    return c;
}

/* A note delivered, or never used, to the spares (beyond KVO__SPARES freed). Locked. */
static void kvo__note_recycle(kvo_pipeline *pl, kvo__note *note)
{
    if (pl->spare_notes_n < KVO__SPARES) {
        note->next = pl->spare_notes;
        pl->spare_notes = note;
        pl->spare_notes_n++;
        return;
    }
    KVB_FREE(note);
}

/* c's on_done note, for up to n blocks: a spare with room, or a new one with room to be reused (as
 * kvo__container_new sizes containers). Taken when c is accepted, so that kvo__finalize never needs
 * memory to tell c's end. 0 when out of memory (nothing changed). Locked. */
static int kvo__note_reserve(kvo_pipeline *pl, kvo__container *c, size_t n)
{
    kvo__note **at, *note = NULL;
    size_t cap = 64;
    if (!pl->cfg.on_done) return 1;
    for (at = &pl->spare_notes; *at; at = &(*at)->next)
        if ((*at)->cap >= n) {
            note = *at;
            *at = note->next;
            pl->spare_notes_n--;
            break;
        }
    if (!note) {
        while (cap < n) cap *= 2; /* n <= SIZE_MAX / 2: no wrap */
        if (cap > (SIZE_MAX - sizeof *note) / sizeof *note->dst) return 0;
        if (!(note = (kvo__note *)KVB_MALLOC(sizeof *note + cap * sizeof *note->dst))) return 0;
        note->dst = (kvb_weak *)(void *)(note + 1);
        note->cap = cap;
    }
    note->next = NULL;
    c->note = note;
    return 1;
}

/* A released container goes to the spares; its own token stays with it when nothing else holds it. */
static void kvo__container_recycle(kvo_pipeline *pl, kvo__container *c)
{
    if (c->note) { /* never final (a call that failed): its note was not used */
        kvo__note_recycle(pl, c->note);
        c->note = NULL;
    }
    if (c->token && KVO__LOAD(&c->token->refs) == 1) {
        kvo_token_release(c->token->parent);
        c->token->parent = NULL;
    } else {
        kvo_token_release(c->token);
        c->token = NULL;
    }
    if (stbds_arrlenu(pl->spare_cs) < KVO__SPARES && kvo__fit(&pl->spare_cs, stbds_arrlenu(pl->spare_cs) + 1)) {
        stbds_arrput(pl->spare_cs, c);
        return;
    }
    kvo_token_release(c->token);
    KVB_FREE(c);
}

static kvo_transfer kvo__handle_of(const kvo_pipeline *pl, const kvo__container *c)
{
    kvo_transfer t;
    t.id = ((uint64_t)pl->slots[c->slot].gen << 32) | ((uint64_t)c->slot + 1);
    return t;
}

static uint64_t kvo__pool_mix(const kvb_pool_config *c)
{
    uint64_t x = ((uint64_t)c->tier << 40) ^ ((uint64_t)c->num_blocks << 8) ^ ((uint64_t)c->block_tokens << 32) ^
                 ((uint64_t)c->layout.kind << 4) ^ ((uint64_t)c->eviction << 1) ^ (uint64_t)c->storage;
    return (x ^ (x >> 29)) * UINT64_C(0xbf58476d1ce4e5b9);
}

static void kvo__pool_tiers(kvo_pipeline *pl)
{
    kvb_pool_config sc, dc;
    uint64_t x;
    memset(&sc, 0, sizeof sc);
    kvb_pool_get_config(pl->cfg.src, &sc);
    pl->src_tier = sc.tier;
    memset(&dc, 0, sizeof dc);
    kvb_pool_get_config(pl->cfg.dst, &dc);
    pl->dst_tier = dc.tier;
    /* Handles are a slot and its generation. Starting the generations where the two pools' settings (in
     * this order) put them, and not at 1, keeps a handle of one pipeline from naming a transfer of
     * another (a manager's down and up pipelines between the same pools) unless their pools are alike,
     * and every run gives the same handles (they are in events, and recordings replay). */
    x = kvo__pool_mix(&sc);
    x = (x << 17 | x >> 47) ^ kvo__pool_mix(&dc);
    x = (x ^ (x >> 31)) * UINT64_C(0x9e3779b97f4a7c15);
    pl->first_gen = (uint32_t)(x >> 33) | 1u; /* 31 bits, never 0 */
}

/* A container changed status: tell the observer, if any. Locked. */
static void kvo__stage(const kvo_pipeline *pl, const kvo__container *c, kvo_status st)
{
    kvo_stage_note note;
    kvo_transfer_info info;
    if (!pl->cfg.on_stage) return;
    info = c->info;
    info.status = st;
    note.transfer = kvo__handle_of(pl, c);
    note.src_tier = pl->src_tier;
    note.dst_tier = pl->dst_tier;
    note.onboard = c->onboard;
    note.info = &info;
    pl->cfg.on_stage(pl->cfg.stage_user, &note);
}

static kvo__container *kvo__resolve(kvo_pipeline *pl, kvo_transfer t)
{
    uint32_t low = (uint32_t)t.id;
    if (!low || low > stbds_arrlenu(pl->slots)) return NULL;
    if (pl->slots[low - 1].gen != (uint32_t)(t.id >> 32) || !pl->slots[low - 1].c) return NULL;
    return pl->slots[low - 1].c;
}

/* A handle slot for c: 0 when out of memory (nothing changed). The free list keeps room for every slot,
 * so that giving one back (kvo_transfer_release) never allocates. */
static int kvo__slot_alloc(kvo_pipeline *pl, kvo__container *c)
{
    uint32_t s;
    if (stbds_arrlen(pl->free_slots)) {
        s = stbds_arrpop(pl->free_slots);
    } else {
        kvo__hslot h;
        size_t n = stbds_arrlenu(pl->slots) + 1;
        if (!kvo__fit(&pl->slots, n) || !kvo__fit(&pl->free_slots, n)) return 0;
        h.gen = pl->first_gen;
        h.c = NULL;
        s = (uint32_t)stbds_arrlenu(pl->slots);
        stbds_arrput(pl->slots, h);
    }
    pl->slots[s].c = c;
    c->slot = s;
    return 1;
}

/* c's slot back to the free list (which has room: kvo__slot_alloc), its handle stale from now on. */
static void kvo__slot_free(kvo_pipeline *pl, const kvo__container *c)
{
    pl->slots[c->slot].c = NULL;
    pl->slots[c->slot].gen = (pl->slots[c->slot].gen + 1) & 0x7fffffffu;
    stbds_arrput(pl->free_slots, c->slot);
}

/* c's slot, whose handle was never given out (a call that fails after kvo__slot_alloc), back on top of
 * the free list with its generation: the next handle is the one it would have been. */
static void kvo__slot_unalloc(kvo_pipeline *pl, const kvo__container *c)
{
    pl->slots[c->slot].c = NULL;
    stbds_arrput(pl->free_slots, c->slot);
}

/* Release levels: each block keeps the level it had (the pipeline's reference to a source block is not
 * the release that set it): an onboard's source block was used (matched in its tier: kvb_release's
 * use, kvb_unpin's level); an offload's was not (copied down: kvb_unpin, no use, as its upgrade took it). */
#define KVO__OWN_LEVEL UINT32_MAX
#define KVO__OWN_LEVEL_NO_USE (UINT32_MAX - 1)

static kvb_result kvo__release(kvb_pool *pool, const kvb_block *blocks, size_t n, const kvb_release_opts *o)
{
    if (o->priority == KVO__OWN_LEVEL) return kvb__release_blocks(pool, blocks, n, KVB__OWN_LEVEL, 1, 0);
    if (o->priority == KVO__OWN_LEVEL_NO_USE) return kvb_unpin(pool, blocks, n);
    return kvb_release(pool, blocks, n, o);
}

/* Release the non-zero handles among blocks[0..n) in one call, then clear them. */
static void kvo__release_held(kvb_pool *pool, kvb_block *blocks, size_t n, uint32_t prio)
{
    kvb_release_opts o;
    size_t i, k = 0;
    for (i = 0; i < n; i++) /* the held ones to the front, in order, and released in one call */
        if (blocks[i].id) blocks[k++] = blocks[i];
    memset(&o, 0, sizeof o);
    o.priority = prio;
    if (k && kvo__release(pool, blocks, k, &o) != KVB_OK) /* out of memory for a long batch: one at a time */
        for (i = 0; i < k; i++) (void)kvo__release(pool, &blocks[i], 1, &o);
    for (i = 0; i < n && k; i++) blocks[i].id = 0;
}

/* An onboard's references in the destination go back: a block it found there (present, or landed by a
 * transfer it joined) was held, not used (kvb_pin): unpinned, its level kept; a block it landed itself
 * goes to dst_priority. Deepest first, as one release gives a chain back (plain LRU evicts in that
 * order, with no leaf check): each run of one kind, from the last run to the first. Then all are cleared. */
static void kvo__release_dst(kvo_pipeline *pl, kvo__container *c)
{
    size_t end = c->n, i;
    while (end > 0) {
        int pinned = -1; /* the kind of the run ending at end: none yet */
        for (i = end; i > 0; i--) {
            int p;
            if (!c->dst_keep[i - 1].id) continue;
            p = c->state[i - 1] == KVO__B_PRESENT || c->state[i - 1] == KVO__B_JOINED;
            if (pinned < 0) pinned = p;
            else if (p != pinned) break;
        }
        if (pinned >= 0) /* [i, end): one run, and blocks already given back */
            kvo__release_held(pl->cfg.dst, c->dst_keep + i, end - i, pinned ? KVO__OWN_LEVEL_NO_USE : pl->cfg.dst_priority);
        end = i;
    }
}

static void kvo__unmark_inflight(kvo_pipeline *pl, kvo__container *c)
{
    size_t i;
    if (!c->inflight_marked) return;
    for (i = 0; i < c->n; i++)
        if (c->state[i] == KVO__B_OFFER || c->state[i] == KVO__B_DONE || c->state[i] == KVO__B_FAILED)
            kvo__count_add(&pl->inflight, &c->hashes[i], -1);
    c->inflight_marked = 0;
}

/* The sources of c's failed copies join pl->failed_src, up to keep_failed of them in all. Locked. */
static void kvo__keep_failed(kvo_pipeline *pl, const kvo__container *c)
{
    size_t j;
    for (j = 0; j < c->n && stbds_arrlenu(pl->failed_src) < pl->keep_failed; j++)
        if (c->state[j] == KVO__B_FAILED) {
            if (!kvo__fit(&pl->failed_src, stbds_arrlenu(pl->failed_src) + 1)) return; /* out of memory: not
                                                                                        tried again */
            stbds_arrput(pl->failed_src, c->src[j]);
        }
}

/* c's reserved note, filled in, joins the notes to deliver: nothing allocated, so on_done is never
 * lost (c->n <= the n it was reserved for: an onboard only shortens it). Locked. */
static void kvo__note_queue(kvo_pipeline *pl, kvo__container *c)
{
    kvo__note *note = c->note;
    c->note = NULL;
    note->t = kvo__handle_of(pl, c);
    note->info = c->info;
    note->n = c->n;
    if (c->n) memcpy(note->dst, c->dst_weak, c->n * sizeof *note->dst);
    note->next = NULL;
    if (pl->notes) pl->notes_last->next = note;
    else pl->notes = note;
    pl->notes_last = note;
}

/* A container reaches its final state: give back what it holds, count it, queue its on_done. */
static void kvo__finalize(kvo_pipeline *pl, kvo__container *c, kvo_status st, int err)
{
    kvo_pipeline_stats *s = &pl->stats;
    if (c->final) return;
    if (pl->keep_failed && c->info.failed && !c->onboard) kvo__keep_failed(pl, c);
    /* the source's level stays; an offload's reference was no use of its block either */
    kvo__release_held(pl->cfg.src, c->src_strong, c->n, c->onboard ? KVO__OWN_LEVEL : KVO__OWN_LEVEL_NO_USE);
    if (st != KVO_STATUS_COMPLETE) kvo__release_dst(pl, c);
    kvo__unmark_inflight(pl, c);
    kvo_event_release(c->pre);
    c->pre = NULL;
    c->final = 1;
    pl->moves++;
    c->info.status = st;
    if (err && !c->info.error) c->info.error = err;
    kvo__stage(pl, c, st);
    s->transferred += c->info.transferred;
    s->present += c->info.present;
    s->joined += c->info.joined;
    s->skipped += c->info.skipped;
    s->timed_out += c->info.timed_out;
    s->dropped += c->info.dropped;
    s->failed += c->info.failed;
    s->cancelled += st == KVO_STATUS_CANCELLED;
    if (c->note) kvo__note_queue(pl, c);
    pthread_cond_broadcast(&pl->cond);
}

static void kvo__on_drop(void *item, void *user)
{
    kvo__finalize((kvo_pipeline *)user, (kvo__container *)item, KVO_STATUS_CANCELLED, KVO_ECANCELLED);
}

/* c on to the next stage's queue; where it cannot go (cancelled, or no memory for the queue) it ends
 * there: cancelled, or failed with KVO_ENOMEM. */
static void kvo__push_or_end(kvo_pipeline *pl, kvo_queue *q, kvo__container *c)
{
    kvo_result r = kvo_queue_push(q, c, c->token);
    if (r == KVO_ENOMEM) kvo__finalize(pl, c, KVO_STATUS_FAILED, KVO_ENOMEM);
    else if (r != KVO_OK) kvo__on_drop(c, pl);
}

/* Delivered notes go back to the spares (lock held). */
static void kvo__notes_done(kvo_pipeline *pl, kvo__note *notes)
{
    while (notes) {
        kvo__note *next = notes->next;
        kvo__note_recycle(pl, notes);
        notes = next;
    }
}

/* Unlock, then deliver the completion callbacks gathered meanwhile. */
static void kvo__unlock(kvo_pipeline *pl)
{
    kvo__note *notes = pl->notes, *note;
    kvo__delivery me, **at;
    if (!notes) {
        pthread_mutex_unlock(&pl->lock);
        return;
    }
    pl->notes = NULL;
    me.thread = pthread_self(); /* a drain waits for callbacks in progress: they may start follow-up work */
    me.draining = 0;
    me.pl = pl;
    me.next = pl->delivering;
    me.outer = kvo__current;
    pl->delivering = &me;
    kvo__current = &me;
    pthread_mutex_unlock(&pl->lock);
    for (note = notes; note; note = note->next)
        pl->cfg.on_done(pl->cfg.done_user, note->t, &note->info, note->dst, note->n);
    kvo__current = me.outer;
    pthread_mutex_lock(&pl->lock);
    kvo__notes_done(pl, notes);
    for (at = &pl->delivering; *at != &me; at = &(*at)->next) {
    }
    *at = me.next;
    pthread_cond_broadcast(&pl->cond);
    pthread_mutex_unlock(&pl->lock);
}

/* A batch done with goes to the spares with its arrays (lock held). */
static void kvo__batch_free(kvo__batch *b)
{
    kvo_pipeline *pl = b->pl;
    if (stbds_arrlenu(pl->spare_bs) < KVO__SPARES && kvo__fit(&pl->spare_bs, stbds_arrlenu(pl->spare_bs) + 1)) {
        KVB__ARR_SHRINK(b->cs, 0);
        stbds_arrput(pl->spare_bs, b);
        return;
    }
    stbds_arrfree(b->cs);
    KVB_FREE(b->mem);
    KVB_FREE(b);
}

/* A batch for the batcher: a spare one (its arrays kept) or a new one. NULL when out of memory. */
static kvo__batch *kvo__batch_new(kvo_pipeline *pl, uint32_t priority)
{
    kvo__batch *b;
    kvo__container **cs = NULL;
    unsigned char *mem = NULL;
    size_t mem_cap = 0;
    if (stbds_arrlen(pl->spare_bs)) {
        b = stbds_arrpop(pl->spare_bs);
        cs = b->cs;
        mem = b->mem;
        mem_cap = b->mem_cap;
    } else if (!(b = (kvo__batch *)KVB_MALLOC(sizeof *b))) {
        return NULL;
    }
    memset(b, 0, sizeof *b);
    b->cs = cs;
    b->mem = mem;
    b->mem_cap = mem_cap;
    b->pl = pl;
    b->priority = priority;
    return b;
}

static void kvo__notes_free(kvo__note *notes)
{
    while (notes) {
        kvo__note *next = notes->next;
        KVB_FREE(notes);
        notes = next;
    }
}

/* Everything the pipeline keeps for reuse (destroy). */
static void kvo__free_spares(kvo_pipeline *pl)
{
    size_t i;
    for (i = 0; i < stbds_arrlenu(pl->spare_cs); i++) {
        kvo_token_release(pl->spare_cs[i]->token);
        KVB_FREE(pl->spare_cs[i]);
    }
    for (i = 0; i < stbds_arrlenu(pl->spare_bs); i++) {
        stbds_arrfree(pl->spare_bs[i]->cs);
        KVB_FREE(pl->spare_bs[i]->mem);
        KVB_FREE(pl->spare_bs[i]);
    }
    kvo__notes_free(pl->spare_notes);
    pl->spare_notes = NULL;
    pl->spare_notes_n = 0;
    stbds_arrfree(pl->spare_cs);
    stbds_arrfree(pl->spare_bs);
    stbds_arrfree(pl->batcher_cs);
    stbds_arrfree(pl->stage_cs);
    stbds_arrfree(pl->present);
    stbds_arrfree(pl->bad);
    stbds_arrfree(pl->failed_src);
}

/* Take cancelled containers out of an upgraded batch that the backend has not got yet: their copies
 * leave the job, their destination blocks go back to free (their sources in kvo__finalize). A token is
 * read once per sweep: one cancelled while the sweep runs (by another thread, or by an observer of a
 * container dropped here) stays whole in the job until the next, since dropping a container whose
 * copies stayed would give back sources the job still reads and strand its destination blocks. */
static void kvo__sweep_on_deck(kvo_pipeline *pl, kvo__batch *b)
{
    size_t k, w, i;
    for (i = 0; i < stbds_arrlenu(b->cs); i++) b->cs[i]->swept = kvo_token_is_cancelled(b->cs[i]->token);
    for (k = w = 0; k < b->job.n; k++) {
        if (b->owner[k]->swept) {
            kvb_release(pl->cfg.dst, &b->dst_b[k], 1, NULL);
            continue;
        }
        b->src_idx[w] = b->src_idx[k];
        b->dst_idx[w] = b->dst_idx[k];
        b->hashes[w] = b->hashes[k];
        b->parents[w] = b->parents[k];
        b->src_b[w] = b->src_b[k];
        b->dst_b[w] = b->dst_b[k];
        b->owner[w] = b->owner[k];
        b->owner_i[w] = b->owner_i[k];
        w++;
    }
    b->job.n = w;
    for (i = k = 0; i < stbds_arrlenu(b->cs); i++) {
        if (b->cs[i]->swept) kvo__on_drop(b->cs[i], pl);
        else b->cs[k++] = b->cs[i];
    }
    KVB__ARR_SHRINK(b->cs, k);
}

/* P4: the batch about to be upgraded loses its cancelled containers first. */
static void kvo__sweep_batch(kvo_pipeline *pl, kvo__batch *b)
{
    size_t j, w;
    for (j = w = 0; j < stbds_arrlenu(b->cs); j++) {
        if (kvo_token_is_cancelled(b->cs[j]->token)) kvo__on_drop(b->cs[j], pl);
        else b->cs[w++] = b->cs[j];
    }
    KVB__ARR_SHRINK(b->cs, w);
}

/* CancelSweeper: drop cancelled containers from every queue and every batch not yet in the backend. */
static void kvo__sweep_all(kvo_pipeline *pl)
{
    size_t i, w;
    for (i = w = 0; i < stbds_arrlenu(pl->on_deck); i++) {
        kvo__sweep_on_deck(pl, pl->on_deck[i]);
        if (stbds_arrlen(pl->on_deck[i]->cs)) pl->on_deck[w++] = pl->on_deck[i];
        else kvo__batch_free(pl->on_deck[i]);
    }
    KVB__ARR_SHRINK(pl->on_deck, w);
    kvo_queue_sweep(pl->q_eval, NULL);
    kvo_queue_sweep(pl->q_pre, NULL);
    kvo_queue_sweep(pl->q_batch, NULL);
    for (i = 0; i < stbds_arrlenu(pl->in_queue); i++) kvo__sweep_batch(pl, pl->in_queue[i]);
    for (i = w = 0; i < stbds_arrlenu(pl->in_queue); i++) {
        if (stbds_arrlen(pl->in_queue[i]->cs)) pl->in_queue[w++] = pl->in_queue[i];
        else kvo__batch_free(pl->in_queue[i]);
    }
    KVB__ARR_SHRINK(pl->in_queue, w);
    pl->last_sweep = kvo__now(pl);
}

/* PolicyEvaluator, one block. Returns the block's new state. */
/* A new block's hash and parent from the source (0 when it is gone or not registered: dropped). */
static int kvo__identify_block(kvo_pipeline *pl, kvo__container *c, size_t i)
{
    kvb_block_info info;
    if (kvb_block_get_info(pl->cfg.src, c->src[i].id, &info) != KVB_OK || info.state != KVB_STATE_REGISTERED) return 0;
    c->hashes[i] = info.hash;
    c->parents[i] = info.parent;
    return 1;
}

/* PolicyEvaluator, one block, its hash known (`present`: in the destination). Returns its new state. */
static uint8_t kvo__evaluate_block(kvo_pipeline *pl, kvo__container *c, size_t i, uint64_t now, uint8_t present)
{
    const kvo_pipeline_config *cfg = &pl->cfg;
    if (c->state[i] == KVO__B_NEW && cfg->min_frequency) kvo__count_add(&pl->freq, &c->hashes[i], 1);
    if (cfg->presence >= 0) {
        if (present || kvo__count_get(&pl->inflight, &c->hashes[i])) return KVO__B_SKIP;
    }
    if (cfg->min_frequency && kvo__count_get(&pl->freq, &c->hashes[i]) < cfg->min_frequency) return KVO__B_SKIP;
    if (cfg->policy) {
        kvo_verdict v = cfg->policy(cfg->policy_user, &c->hashes[i], kvb_block_index(c->src[i].id));
        if (v == KVO_LATER) return now - c->t_eval >= cfg->policy_timeout_us ? KVO__B_TIMEOUT : KVO__B_EVAL;
        if (v != KVO_OFFER) return KVO__B_SKIP;
    }
    return KVO__B_OFFER;
}

/* Count a block's final verdict into the container's info. */
static void kvo__count_verdict(kvo__container *c, size_t i)
{
    switch (c->state[i]) {
    case KVO__B_SKIP: c->info.skipped++; break;
    case KVO__B_TIMEOUT: c->info.timed_out++; break;
    case KVO__B_DROPPED: c->info.dropped++; break;
    default: break;
    }
}

/* Whether the destination holds c's block i, asked alone (no memory to ask for the container at once). */
static uint8_t kvo__present_one(kvo_pipeline *pl, const kvo__container *c, size_t i)
{
    uint8_t one = 0;
    if (pl->cfg.presence < 0 || kvb_presence(pl->cfg.dst, &c->hashes[i], 1, &one, NULL) != KVB_OK) return 0;
    return one;
}

/* Evaluate a container: 1 when every block has a verdict. */
static int kvo__evaluate(kvo_pipeline *pl, kvo__container *c, uint64_t now)
{
    size_t i, offered = 0;
    int pending = 0;
    uint8_t *present = NULL;
    for (i = 0; i < c->n; i++)
        if (c->state[i] == KVO__B_NEW && !kvo__identify_block(pl, c, i)) c->state[i] = KVO__B_DROPPED;
    if (pl->cfg.presence >= 0 && c->n && kvo__fit(&pl->present, c->n)) { /* the destination asked once for
                                                                             the whole container */
        KVB__ARR_SHRINK(pl->present, 0);
        present = stbds_arraddnptr(pl->present, c->n);
        if (kvb_presence(pl->cfg.dst, c->hashes, c->n, present, NULL) != KVB_OK) memset(present, 0, c->n);
    }
    for (i = 0; i < c->n; i++) {
        if (c->state[i] == KVO__B_NEW || c->state[i] == KVO__B_EVAL) {
            c->state[i] = kvo__evaluate_block(pl, c, i, now, present ? present[i] : kvo__present_one(pl, c, i));
            if (c->state[i] == KVO__B_EVAL) pending = 1;
            /* in flight from its verdict on: a repeat later in this container, or in one evaluated while
               this one waits for another block's policy, is skipped by presence, not copied twice */
            if (c->state[i] == KVO__B_OFFER) kvo__count_add(&pl->inflight, &c->hashes[i], 1);
        }
    }
    c->inflight_marked = 1;
    if (pending) return 0;
    for (i = 0; i < c->n; i++) {
        kvo__count_verdict(c, i);
        offered += c->state[i] == KVO__B_OFFER;
    }
    return offered ? 1 : 2; /* 2: nothing to copy */
}

/* A container that waits in its stage goes back to that stage's queue after the pass (pl->stage_cs);
 * with no memory to keep it aside it fails (KVO_ENOMEM). */
static void kvo__set_aside(kvo_pipeline *pl, kvo__container *c)
{
    if (kvo__fit(&pl->stage_cs, stbds_arrlenu(pl->stage_cs) + 1)) stbds_arrput(pl->stage_cs, c);
    else kvo__finalize(pl, c, KVO_STATUS_FAILED, KVO_ENOMEM);
}

static void kvo__stage_policy(kvo_pipeline *pl, uint64_t now)
{
    kvo__container **later;
    void *item;
    size_t i;
    KVB__ARR_SHRINK(pl->stage_cs, 0);
    while (kvo_queue_pop(pl->q_eval, &item, 0) == KVO_OK) {
        kvo__container *c = (kvo__container *)item;
        int r = kvo__evaluate(pl, c, now);
        if (r == 0) {
            kvo__set_aside(pl, c);
        } else if (r == 2) {
            kvo__finalize(pl, c, KVO_STATUS_COMPLETE, KVO_OK);
        } else {
            c->info.status = KVO_STATUS_QUEUED;
            kvo__stage(pl, c, KVO_STATUS_QUEUED);
            pl->moves++;
            kvo__push_or_end(pl, pl->q_pre, c);
        }
    }
    later = pl->stage_cs;
    for (i = 0; i < stbds_arrlenu(later); i++)
        kvo__push_or_end(pl, pl->q_eval, later[i]);
}

static void kvo__to_batcher(kvo_pipeline *pl, kvo__container *c, uint64_t now)
{
    if (kvo_queue_len(pl->q_batch) == 0) pl->batch_since = now;
    pl->moves++;
    kvo__push_or_end(pl, pl->q_batch, c);
}

static uint32_t kvo__offered(const kvo__container *c);

static int kvo__joining(const kvo__container *c)
{
    size_t i;
    for (i = 0; c->onboard && i < c->n; i++)
        if (c->state[i] == KVO__B_JOINING) return 1;
    return 0;
}

/* An onboarding block that joined another transfer's copy, which did not land, is loaded from the source
 * like any other, else (gone from there too) failed. */
static void kvo__load_joined(kvo_pipeline *pl, kvo__container *c, size_t i)
{
    kvb_block_info info;
    size_t k;
    if (kvb_match(pl->cfg.src, &c->hashes[i], 1, &c->src_strong[i], &k) == KVB_OK && k) {
        kvb_block_get_info(pl->cfg.src, c->src_strong[i].id, &info);
        c->parents[i] = info.parent;
        c->state[i] = KVO__B_OFFER;
        kvo__count_add(&pl->inflight, &c->hashes[i], 1);
    } else { /* not KVO__B_FAILED: that one is counted in flight, and its end would uncount another's copy */
        c->state[i] = KVO__B_LOST;
        c->info.failed++;
        if (!c->info.error) c->info.error = KVO_ENOTFOUND; /* a failed transfer says why */
    }
}

/* Onboarding blocks that joined another transfer, once nothing of their hash is in flight any more:
 * taken from the destination where that copy landed, else (it failed, or the block went again) loaded
 * from the source like any other, else failed. 1 while some still wait. */
static int kvo__resolve_joins(kvo_pipeline *pl, kvo__container *c)
{
    size_t i, k;
    int waiting = 0;
    for (i = 0; i < c->n; i++) {
        if (c->state[i] != KVO__B_JOINING) continue;
        if (kvo__count_get(&pl->inflight, &c->hashes[i])) {
            waiting = 1;
        } else if (kvb_pin(pl->cfg.dst, &c->hashes[i], 1, &c->dst_keep[i], &k) == KVB_OK && k) {
            c->state[i] = KVO__B_JOINED;
            c->dst_weak[i] = kvb_weak_of(c->dst_keep[i]);
            c->info.joined++;
        } else {
            kvo__load_joined(pl, c, i);
        }
    }
    return waiting;
}

/* A joined hash and the waiting container (its place in the stage's list) that joined it. */
typedef struct kvo__join_pair { kvb_hash h; uint32_t c; } kvo__join_pair;

static int kvo__join_pair_cmp(const void *a, const void *b)
{
    const kvb_hash *x = &((const kvo__join_pair *)a)->h, *y = &((const kvo__join_pair *)b)->h;
    return x->hi != y->hi ? (x->hi < y->hi ? -1 : 1) : x->lo != y->lo ? (x->lo < y->lo ? -1 : 1) : 0;
}

/* Waiting container k has one blocked join fewer; at none its waits end (the worklist gets it). */
static void kvo__join_unblock(kvo_pipeline *pl, kvo__container **waiting, uint32_t k)
{
    if (waiting[k]->join_wait == 1 && !--pl->join_blocked[k]) stbds_arrput(pl->join_work, k); /* within room */
}

/* The count of loads of h by waiting containers went to 0: the joiners of h are unblocked once each. */
static void kvo__join_loads_gone(kvo_pipeline *pl, kvo__container **waiting, const kvb_hash *h)
{
    kvo__join_pair key;
    size_t lo = 0, hi = stbds_arrlenu(pl->join_pairs);
    key.h = *h;
    while (lo < hi) { /* the first pair of h */
        size_t mid = lo + (hi - lo) / 2;
        if (kvo__join_pair_cmp(&pl->join_pairs[mid], &key) < 0) lo = mid + 1;
        else hi = mid;
    }
    for (; lo < stbds_arrlenu(pl->join_pairs) && !kvo__join_pair_cmp(&pl->join_pairs[lo], &key); lo++)
        kvo__join_unblock(pl, waiting, pl->join_pairs[lo].c);
}

/* Joining onboarding containers wait in the precondition stage while they hold their own loads in flight,
 * and another may join those: a join of a copy that failed is loaded by its container itself, which a
 * newer request joins, while the first joins that one's load of another hash (each waits for the other,
 * for ever). The waits that end are found by a topological sort (Kahn's worklist, linear but for sorting
 * the joins): a waiting container none of whose joined hashes a waiting container loads, then those that
 * wait only for such ones; the oldest left, in a cycle or behind one, loads the hashes it waits for from
 * those itself (a second copy). Out of memory for its lists it waits for the next pass. Locked. */
static void kvo__break_join_cycles(kvo_pipeline *pl, kvo__container **waiting)
{
    size_t i, j, n = stbds_arrlenu(waiting), pairs = 0;
    kvo__container *stuck = NULL;
    for (i = 0; i < n; i++)
        for (j = 0; waiting[i]->join_wait && j < waiting[i]->n; j++) pairs += waiting[i]->state[j] == KVO__B_JOINING;
    if (n > UINT32_MAX || !kvb__arr_fit((void **)&pl->join_pairs, sizeof *pl->join_pairs, pairs) ||
        !kvb__arr_fit((void **)&pl->join_blocked, sizeof *pl->join_blocked, n) ||
        !kvb__arr_fit((void **)&pl->join_work, sizeof *pl->join_work, n))
        return;
    KVB__ARR_SHRINK(pl->join_pairs, 0);
    KVB__ARR_SHRINK(pl->join_blocked, n);
    KVB__ARR_SHRINK(pl->join_work, 0);
    for (i = 0; i < n; i++)
        for (j = 0; waiting[i]->join_wait && j < waiting[i]->n; j++) {
            if (waiting[i]->state[j] == KVO__B_OFFER) kvo__count_add(&pl->join_loads, &waiting[i]->hashes[j], 1);
            if (waiting[i]->state[j] == KVO__B_JOINING) {
                kvo__join_pair p;
                p.h = waiting[i]->hashes[j];
                p.c = (uint32_t)i;
                stbds_arrput(pl->join_pairs, p); /* within the room made */
            }
        }
    qsort(pl->join_pairs, pairs, sizeof *pl->join_pairs, kvo__join_pair_cmp);
    for (i = 0; i < n; i++) {
        pl->join_blocked[i] = 0;
        for (j = 0; waiting[i]->join_wait && j < waiting[i]->n; j++)
            pl->join_blocked[i] += waiting[i]->state[j] == KVO__B_JOINING &&
                                   kvo__count_get(&pl->join_loads, &waiting[i]->hashes[j]) != 0;
        if (waiting[i]->join_wait == 1 && !pl->join_blocked[i]) stbds_arrput(pl->join_work, (uint32_t)i);
    }
    while (stbds_arrlenu(pl->join_work)) {
        kvo__container *c = waiting[stbds_arrpop(pl->join_work)];
        c->join_wait = 2; /* its waits end: so do its loads */
        for (j = 0; j < c->n; j++)
            if (c->state[j] == KVO__B_OFFER && kvo__count_get(&pl->join_loads, &c->hashes[j])) {
                kvo__count_add(&pl->join_loads, &c->hashes[j], -1);
                if (!kvo__count_get(&pl->join_loads, &c->hashes[j])) kvo__join_loads_gone(pl, waiting, &c->hashes[j]);
            }
    }
    for (i = 0; i < n && !stuck; i++)
        if (waiting[i]->join_wait == 1) stuck = waiting[i];
    for (j = 0; stuck && j < stuck->n; j++)
        if (stuck->state[j] == KVO__B_JOINING && kvo__count_get(&pl->join_loads, &stuck->hashes[j]))
            kvo__load_joined(pl, stuck, j);
    for (i = 0; i < n; i++) /* the table back to empty (it keeps its room) */
        for (j = 0; waiting[i]->join_wait && j < waiting[i]->n; j++)
            if (waiting[i]->state[j] == KVO__B_OFFER) (void)kvb__ctab_sub(&pl->join_loads, &waiting[i]->hashes[j], 0, 1);
}

/* PreconditionAwaiter: a poll of each event (and of the copies joined onboarding blocks wait for), so
 * waiting never blocks and a sweep can cancel it. */
static void kvo__stage_precondition(kvo_pipeline *pl, uint64_t now)
{
    kvo__container **waiting;
    void *item;
    size_t i;
    int joins = 0;
    KVB__ARR_SHRINK(pl->stage_cs, 0);
    while (kvo_queue_pop(pl->q_pre, &item, 0) == KVO_OK) {
        kvo__container *c = (kvo__container *)item;
        int s = c->pre ? kvo_event_query(c->pre) : 1;
        c->join_wait = 0;
        if (s > 0 && c->onboard && kvo__resolve_joins(pl, c)) {
            c->join_wait = 1;
            kvo__set_aside(pl, c); /* no timeout: the copies it waits for end (kvo__break_join_cycles) */
            joins = 1;
        }
        else if (s > 0 && c->onboard && !kvo__offered(c))
            kvo__finalize(pl, c, c->info.failed ? KVO_STATUS_FAILED : KVO_STATUS_COMPLETE, KVO_OK);
        else if (s > 0) kvo__to_batcher(pl, c, now);
        else if (s < 0) kvo__finalize(pl, c, KVO_STATUS_FAILED, KVO_EPRECOND);
        else if (now - c->t_enqueue >= pl->cfg.precondition_timeout_us) kvo__finalize(pl, c, KVO_STATUS_FAILED, KVO_ETIMEDOUT);
        else kvo__set_aside(pl, c);
    }
    waiting = pl->stage_cs;
    if (joins) kvo__break_join_cycles(pl, waiting);
    for (i = 0; i < stbds_arrlenu(waiting); i++)
        kvo__push_or_end(pl, pl->q_pre, waiting[i]);
}

static uint32_t kvo__offered(const kvo__container *c)
{
    size_t i;
    uint32_t k = 0;
    for (i = 0; i < c->n; i++) k += c->state[i] == KVO__B_OFFER;
    return k;
}

/* A batch's containers fail (err) and the batch goes. */
static void kvo__batch_fail(kvo_pipeline *pl, kvo__batch *b, int err)
{
    size_t i;
    for (i = 0; i < stbds_arrlenu(b->cs); i++) kvo__finalize(pl, b->cs[i], KVO_STATUS_FAILED, err);
    kvo__batch_free(b);
}

/* A batch into the queue of those waiting for the backend, by priority; an empty one goes, and one there
 * is no memory to queue fails (KVO_ENOMEM). */
static void kvo__in_queue_insert(kvo_pipeline *pl, kvo__batch *b)
{
    size_t at = stbds_arrlenu(pl->in_queue);
    if (!stbds_arrlenu(b->cs) || !kvo__fit(&pl->in_queue, at + 1)) {
        kvo__batch_fail(pl, b, KVO_ENOMEM);
        return;
    }
    pl->moves++;
    while (at > 0 && pl->in_queue[at - 1]->priority < b->priority) at--;
    KVO__ARR_INSERT(pl->in_queue, at, b);
}

/* Batcher: once min_batch blocks wait (or the flush interval passed, or a drain asks, or an onboarding
 * transfer waits and the backend could take a batch now: a request is held up until its blocks arrive,
 * so a load goes at once, with whatever else waits; while the backend is busy, loads that come meanwhile
 * join one batch), group the waiting containers by priority into weak batches of at most max_batch
 * blocks. */
static void kvo__stage_batcher(kvo_pipeline *pl, uint64_t now)
{
    kvo__container **cs;
    kvo__batch *b = NULL;
    void *item;
    size_t i, j;
    uint32_t waiting = 0;
    int load = 0;
    if (!kvo_queue_len(pl->q_batch)) return;
    {   /* count the blocks waiting: the queue holds containers */
        kvo_queue *q = pl->q_batch;
        pthread_mutex_lock(&q->lock);
        for (i = q->head; i < stbds_arrlenu(q->items); i++) {
            const kvo__container *c = (const kvo__container *)q->items[i].item;
            waiting += kvo__offered(c);
            load |= c->onboard;
        }
        pthread_mutex_unlock(&q->lock);
    }
    if (load && (pl->executing >= pl->cfg.max_concurrent || stbds_arrlen(pl->on_deck) || stbds_arrlen(pl->in_queue)))
        load = 0; /* it could not start now anyway: what comes meanwhile joins its batch */
    if (!pl->draining && !load && waiting < pl->cfg.min_batch && now - pl->batch_since < pl->cfg.flush_interval_us)
        return;
    KVB__ARR_SHRINK(pl->batcher_cs, 0);
    while (kvo_queue_pop(pl->q_batch, &item, 0) == KVO_OK) {
        kvo__container *c = (kvo__container *)item;
        if (!kvo__fit(&pl->batcher_cs, stbds_arrlenu(pl->batcher_cs) + 1)) {
            kvo__finalize(pl, c, KVO_STATUS_FAILED, KVO_ENOMEM);
            continue;
        }
        cs = pl->batcher_cs;
        for (j = stbds_arrlenu(cs); j > 0 && cs[j - 1]->priority < c->priority; j--) {
        }
        KVO__ARR_INSERT(pl->batcher_cs, j, c); /* stable: FIFO within a priority (within the room made) */
    }
    cs = pl->batcher_cs;
    for (i = 0; i < stbds_arrlenu(cs); i++) {
        uint32_t k = kvo__offered(cs[i]);
        if (b && (b->priority != cs[i]->priority || b->blocks + k > pl->cfg.max_batch)) {
            kvo__in_queue_insert(pl, b);
            b = NULL;
        }
        if ((!b && !(b = kvo__batch_new(pl, cs[i]->priority))) || !kvo__fit(&b->cs, stbds_arrlenu(b->cs) + 1)) {
            kvo__finalize(pl, cs[i], KVO_STATUS_FAILED, KVO_ENOMEM);
            continue;
        }
        stbds_arrput(b->cs, cs[i]);
        b->blocks += k;
    }
    if (b) kvo__in_queue_insert(pl, b);
}

/* The upgrade (P3): weak -> strong for every offered block of the batch, just after a sweep (P4), then
 * destination blocks, then one flat job for all containers (P5). Returns the number of copies, 0 when
 * nothing is left to copy, or a negative result. */
static int kvo__upgrade(kvo_pipeline *pl, kvo__batch *b)
{
    size_t i, j, k = 0, n = 0;
    unsigned char *mem;
    kvb_result r;
    for (i = 0; i < stbds_arrlenu(b->cs); i++) {
        kvo__container *c = b->cs[i];
        c->info.status = KVO_STATUS_TRANSFERRING;
        kvo__stage(pl, c, KVO_STATUS_TRANSFERRING);
        for (j = 0; j < c->n; j++) {
            if (c->state[j] != KVO__B_OFFER) continue;
            if (!c->onboard && kvb__upgrade(pl->cfg.src, c->src[j], &c->src_strong[j], 0) != KVB_OK) {
                c->state[j] = KVO__B_DROPPED; /* evicted since it was enqueued: discarded, not copied */
                c->info.dropped++;
                kvo__count_add(&pl->inflight, &c->hashes[j], -1);
                continue;
            }
            n++;
        }
    }
    if (!n) return 0;
    if (n > b->mem_cap) { /* kept with the batch when it is reused */
        size_t cap = b->mem_cap ? b->mem_cap : 64;
        while (cap < n) cap *= 2;
        KVB_FREE(b->mem);
        b->mem_cap = 0;
        b->mem = (unsigned char *)KVB_MALLOC(cap * (4 * sizeof(uint32_t) + 2 * sizeof(kvb_hash) + sizeof(int) +
                                                    2 * sizeof(kvb_block) + sizeof(kvo__container *)));
        if (!b->mem) return KVO_ENOMEM;
        b->mem_cap = cap;
    }
    mem = b->mem;
    b->src_idx = (uint32_t *)(void *)mem; /* one allocation, carved by alignment (largest first) */
    b->hashes = (kvb_hash *)(void *)(mem + n * 4 * sizeof(uint32_t));
    b->parents = b->hashes + n;
    b->src_b = (kvb_block *)(void *)(b->parents + n);
    b->dst_b = b->src_b + n;
    b->owner = (kvo__container **)(void *)(b->dst_b + n);
    b->dst_idx = b->src_idx + n;
    b->owner_i = b->dst_idx + n;
    b->results = (int *)(void *)(b->owner_i + n);
    for (i = 0; i < stbds_arrlenu(b->cs); i++) {
        kvo__container *c = b->cs[i];
        for (j = 0; j < c->n; j++) {
            if (c->state[j] != KVO__B_OFFER) continue;
            b->src_b[k] = c->src_strong[j];
            b->src_idx[k] = kvb_block_index(c->src_strong[j].id);
            b->hashes[k] = c->hashes[j];
            b->parents[k] = c->parents[j];
            b->owner[k] = c;
            b->owner_i[k] = (uint32_t)j;
            b->results[k] = KVO_EBACKEND;
            k++;
        }
    }
    r = kvb_alloc(pl->cfg.dst, n, b->dst_b);
    if (r != KVB_OK) return r == KVB_ENOSPACE ? KVO_EFULL : (int)r;
    for (k = 0; k < n; k++) b->dst_idx[k] = kvb_block_index(b->dst_b[k].id);
    b->job.src = pl->cfg.src;
    b->job.dst = pl->cfg.dst;
    b->job.src_idx = b->src_idx;
    b->job.dst_idx = b->dst_idx;
    b->job.hashes = b->hashes;
    b->job.n = n;
    b->job.results = b->results;
    b->job.user = b;
    return (int)n;
}

/* Finish every container of a batch that will not reach the backend; returns how many had copies in it.
 * Failed (err): those with copies fail; one whose blocks were all dropped at the upgrade had nothing to
 * copy, and ends as it would alone. */
static size_t kvo__batch_abort(kvo_pipeline *pl, kvo__batch *b, kvo_status st, int err)
{
    size_t i, j, copying = 0;
    for (i = 0; i < stbds_arrlenu(b->cs); i++) {
        kvo__container *c = b->cs[i];
        uint32_t offered = kvo__offered(c);
        for (j = 0; j < c->n && st == KVO_STATUS_FAILED; j++)
            if (c->state[j] == KVO__B_OFFER) {
                c->state[j] = KVO__B_FAILED;
                c->info.failed++;
            }
        copying += offered > 0;
        if (st == KVO_STATUS_FAILED && !offered)
            kvo__finalize(pl, c, c->info.failed ? KVO_STATUS_FAILED : KVO_STATUS_COMPLETE, KVO_OK);
        else
            kvo__finalize(pl, c, st, err);
    }
    kvo__batch_free(b);
    return copying;
}

static void kvo__fill_on_deck(kvo_pipeline *pl)
{
    while (stbds_arrlenu(pl->on_deck) < pl->cfg.on_deck && stbds_arrlen(pl->in_queue)) {
        kvo__batch *b = pl->in_queue[0];
        int n;
        stbds_arrdel(pl->in_queue, 0);
        if (!kvo__fit(&pl->on_deck, stbds_arrlenu(pl->on_deck) + 1)) { /* made at create: never here */
            kvo__batch_fail(pl, b, KVO_ENOMEM);
            continue;
        }
        kvo__sweep_batch(pl, b);
        n = kvo__upgrade(pl, b);
        pl->moves++;
        if (n > 0) {
            stbds_arrput(pl->on_deck, b);
        } else if (n == 0) {
            kvo__batch_abort(pl, b, KVO_STATUS_COMPLETE, KVO_OK);
        } else {
            size_t failing = kvo__batch_abort(pl, b, KVO_STATUS_FAILED, n);
            if (n == KVO_EFULL) pl->stats.dest_full += failing; /* transfers, not batches */
        }
    }
}

/* Whether kvo_result_string names the code (a kvo_result or kvb_result). */
static int kvo__named(int result)
{
    switch (result) {
#define KVO__NAMED_CASE(name, value, text) case value:
        KVO__RESULTS(KVO__NAMED_CASE)
#undef KVO__NAMED_CASE
        return 1;
    default: return result < 0 && result > KVB__RESULT_MIN; /* a kvb_result */
    }
}

/* Block j of container c did not land: its destination block (never registered) goes back to free.
 * message: about this failure, or NULL, when the container's message names the backend and its error. */
static void kvo__landing_failed(kvo_pipeline *pl, kvo__container *c, uint32_t j, kvb_block *dst, int err,
                                const char *message)
{
    kvb_release(pl->cfg.dst, dst, 1, NULL);
    dst->id = 0;
    c->state[j] = KVO__B_FAILED;
    c->info.failed++;
    if (!c->info.error) c->info.error = err;
    if (c->info.message[0]) return;
    if (message) snprintf(c->info.message, sizeof c->info.message, "%s", message);
    else if (kvo__named(c->info.error))
        snprintf(c->info.message, sizeof c->info.message, "%s backend: %s",
                 pl->cfg.backend->name ? pl->cfg.backend->name : "copy", kvo_result_string(c->info.error));
    else /* another library's code (kvremote.h's, kvcuda.h's): its number, which that library names */
        snprintf(c->info.message, sizeof c->info.message, "%s backend: error %d",
                 pl->cfg.backend->name ? pl->cfg.backend->name : "copy", c->info.error);
}

/* The job's one message may be about any failed copy: it is a container's only when every failed copy
 * of the job is that container's, or when it is about the whole job (`whole`). */
static const char *kvo__message_of(const kvo__batch *b, const char *message, int whole)
{
    const kvo__container *failing = NULL;
    size_t k;
    if (!message || whole) return message;
    for (k = 0; k < b->job.n; k++) {
        if (b->results[k] == KVO_OK) continue;
        if (failing && failing != b->owner[k]) return NULL;
        failing = b->owner[k];
    }
    return message;
}

/* A copy failed this way: the source tier's entry is damaged or gone, so its block there is dropped. */
static int kvo__source_lost(int result) { return result == KVO_ECHECKSUM || result == KVO_ENOTFOUND; }

/* Register what arrived, give back every block the batch held, finish its containers. Locked. */
static void kvo__batch_finish(kvo_pipeline *pl, kvo__batch *b, int result, const char *message, int whole)
{
    size_t k, n = b->job.n, i;
    kvb_block *keep = b->dst_b; /* reused in place: successes first */
    size_t ok = 0;
    kvb_result r;
    message = kvo__message_of(b, message, whole);
    for (k = 0; k < n; k++) {
        if (b->results[k] == KVO_OK) {
            b->dst_b[ok] = b->dst_b[k];
            b->hashes[ok] = b->hashes[k];
            b->parents[ok] = b->parents[k];
            b->owner[ok] = b->owner[k];
            b->owner_i[ok] = b->owner_i[k];
            ok++;
        } else {
            if (kvo__source_lost(b->results[k]) && kvo__fit(&pl->bad, stbds_arrlenu(pl->bad) + 1)) /* else it
                                                                       stays, and fails the next load too */
                stbds_arrput(pl->bad, b->hashes[k]);
            kvo__landing_failed(pl, b->owner[k], b->owner_i[k], &b->dst_b[k], b->results[k] ? b->results[k] : result,
                                message);
        }
    }
    if (ok && (r = kvb_register_hashed(pl->cfg.dst, keep, ok, b->hashes, b->parents, keep)) != KVB_OK) {
        for (k = 0; k < ok; k++) /* out of memory: the copies are there but cannot be found */
            kvo__landing_failed(pl, b->owner[k], b->owner_i[k], &keep[k], r == KVB_ENOMEM ? KVO_ENOMEM : (int)r,
                                "registering in the destination failed");
        ok = 0;
    }
    for (k = 0; k < ok; k++) {
        kvo__container *c = b->owner[k];
        uint32_t j = b->owner_i[k];
        c->state[j] = KVO__B_DONE;
        c->info.transferred++;
        c->dst_weak[j] = kvb_weak_of(keep[k]);
        if (c->onboard) {
            c->dst_keep[j] = keep[k];
            keep[k].id = 0;
        }
    }
    kvo__release_held(pl->cfg.dst, keep, ok, pl->cfg.dst_priority);
    for (i = 0; i < stbds_arrlenu(b->cs); i++)
        kvo__finalize(pl, b->cs[i], b->cs[i]->info.failed ? KVO_STATUS_FAILED : KVO_STATUS_COMPLETE, KVO_OK);
    if (stbds_arrlen(pl->bad)) { /* their sources are released now: drop them, or every load of the hash
                                    would fail the same way while the entry stays (a later offer stores it
                                    again) */
        kvb_invalidate(pl->cfg.src, pl->bad, stbds_arrlenu(pl->bad), NULL);
        KVB__ARR_SHRINK(pl->bad, 0);
    }
    pl->stats.batches++;
    pl->stats.bytes += b->job.bytes;
    pl->executing--;
    pl->executing_blocks -= (uint32_t)b->job.n;
    kvo__batch_free(b);
    pthread_cond_broadcast(&pl->cond);
}

static void kvo__job_done(kvo_copy_job *job, int result, const char *message)
{
    kvo__batch *b = (kvo__batch *)job->user;
    kvo_pipeline *pl = b->pl;
    pthread_mutex_lock(&pl->lock);
    kvo__batch_finish(pl, b, result, message, 0);
    kvo__unlock(pl);
}

/* TransferExecutor: hand on-deck batches to the backend, up to max_concurrent. The lock is dropped
 * around submit, since a backend may finish (and call back) before submit returns. */
static void kvo__stage_execute(kvo_pipeline *pl)
{
    while (pl->executing < pl->cfg.max_concurrent && stbds_arrlen(pl->on_deck)) {
        kvo__batch *b = pl->on_deck[0];
        int r;
        stbds_arrdel(pl->on_deck, 0);
        pl->executing++;
        pl->executing_blocks += (uint32_t)b->job.n;
        pl->moves++;
        b->job.done = kvo__job_done;
        pthread_mutex_unlock(&pl->lock);
        r = pl->cfg.backend->submit(pl->cfg.backend, &b->job);
        pthread_mutex_lock(&pl->lock);
        if (r != KVO_OK) {
            size_t k;
            for (k = 0; k < b->job.n; k++) b->results[k] = r; /* its reason, not the placeholder */
            kvo__batch_finish(pl, b, r, "backend refused the job", 1);
        }
    }
}

/* One pass of every stage; 1 when anything moved. */
static int kvo__step(kvo_pipeline *pl)
{
    uint64_t now = kvo__now(pl), before = pl->moves;
    if (now - pl->last_sweep >= pl->cfg.sweep_interval_us) kvo__sweep_all(pl);
    kvo__stage_policy(pl, now);
    kvo__stage_precondition(pl, now);
    kvo__stage_batcher(pl, now);
    kvo__fill_on_deck(pl);
    kvo__stage_execute(pl);
    return pl->moves != before;
}

/* Callbacks delivered by other threads than the caller: a drain from on_done cannot wait for its own
 * (nor for the ones its thread delivers after it), which would never end; nor, when the caller is inside
 * a callback of any pipeline, for those of a thread that drains (or destroys a pipeline) from one of them:
 * that one may wait for the caller's, and each would end only by a timeout, or never. `all`: those too
 * (destroy frees what their deliveries still use). */
static int kvo__others_delivering(const kvo_pipeline *pl, int all)
{
    const kvo__delivery *d;
    pthread_t self = pthread_self();
    int inside = !all && kvo__current != NULL;
    for (d = pl->delivering; d; d = d->next)
        if (!pthread_equal(d->thread, self) && !(inside && d->draining)) return 1;
    return 0;
}

/* The caller's deliveries in progress, of every pipeline, say it drains (delta 1) or no longer does (-1),
 * each under its own pipeline's lock (taken one at a time: never two locks at once), waking that
 * pipeline's drains to look again. Not locked. */
static void kvo__mark_draining(int delta)
{
    kvo__delivery *d;
    for (d = kvo__current; d; d = d->outer) {
        pthread_mutex_lock(&d->pl->lock);
        d->draining = (uint32_t)((int)d->draining + delta);
        pthread_cond_broadcast(&d->pl->cond);
        pthread_mutex_unlock(&d->pl->lock);
    }
}

static int kvo__idle(kvo_pipeline *pl, int all)
{
    return !kvo_queue_len(pl->q_eval) && !kvo_queue_len(pl->q_pre) && !kvo_queue_len(pl->q_batch) &&
           !stbds_arrlen(pl->in_queue) && !stbds_arrlen(pl->on_deck) && !pl->executing && !pl->notes &&
           !kvo__others_delivering(pl, all);
}

/* How long the coordinator may sleep: short while anything is polled (policies, events, batches). */
static int64_t kvo__coordinator_wait_us(kvo_pipeline *pl)
{
    if (kvo_queue_len(pl->q_eval) || kvo_queue_len(pl->q_pre)) return 1000;
    if (kvo_queue_len(pl->q_batch) || stbds_arrlen(pl->in_queue) || stbds_arrlen(pl->on_deck))
        return pl->cfg.flush_interval_us < 1000 ? pl->cfg.flush_interval_us : 1000;
    return -1;
}

static void *kvo__coordinator(void *arg)
{
    kvo_pipeline *pl = (kvo_pipeline *)arg;
    pthread_mutex_lock(&pl->lock);
    while (!pl->stopping) {
        int64_t wait_us;
        int moved = kvo__step(pl);
        if (moved || pl->notes) { /* deliver callbacks, then look again */
            kvo__unlock(pl);
            pthread_mutex_lock(&pl->lock);
            continue;
        }
        wait_us = kvo__coordinator_wait_us(pl);
        if (pl->stopping) break; /* destroy may have signalled while submit ran unlocked */
        if (wait_us < 0) {
            pthread_cond_wait(&pl->cond, &pl->lock);
        } else {
            struct timespec dl = kvo__deadline(wait_us);
            kvo__cond_wait(&pl->cond, &pl->lock, &dl);
        }
    }
    kvo__unlock(pl);
    return NULL;
}

/* Out of time: the callbacks already queued are delivered first (the caller's unlock would deliver them
 * before it returns anyway), then done is asked once more, so that a pass which ended everything (its
 * notes not yet told) is not answered with a timeout. Locked on entry and exit. */
static int kvo__last_look(kvo_pipeline *pl, int (*done)(kvo_pipeline *, void *), void *arg)
{
    if (!pl->notes) return 0;
    kvo__unlock(pl);
    pthread_mutex_lock(&pl->lock);
    return done(pl, arg);
}

/* Let the pipeline move on while the caller waits for `done(pl, arg)`: poll mode pumps the stages,
 * thread mode sleeps on the condition, except on the coordinator thread itself (an on_done it delivers
 * waiting on another transfer), which pumps as poll mode does, at least one pass however short the timeout
 * (0 included). Locked on entry and exit. 0 on timeout. */
static int kvo__wait_until(kvo_pipeline *pl, int (*done)(kvo_pipeline *, void *), void *arg, int64_t timeout_us)
{
    uint64_t start = kvo__mono_us();
    int pumped = 0;
    while (!done(pl, arg)) {
        int64_t left = timeout_us < 0 ? 1000 : timeout_us - (int64_t)(kvo__mono_us() - start);
        int pumps = pl->cfg.mode == KVO_MODE_POLL || !pl->has_thread || pthread_equal(pthread_self(), pl->thread);
        struct timespec dl;
        if (left <= 0 && (pumped || !pumps)) /* a pump makes one pass even with no time: timeout 0 polls */
            return kvo__last_look(pl, done, arg);
        if (pumps) {
            int moved = kvo__step(pl);
            pumped = 1;
            if (done(pl, arg)) break;
            if (left <= 0) return kvo__last_look(pl, done, arg);
            if (moved) continue; /* keep pumping while something moves */
        } else {
            pthread_cond_broadcast(&pl->cond); /* wake the coordinator */
        }
        if (pl->notes) {
            kvo__unlock(pl);
            pthread_mutex_lock(&pl->lock);
            continue;
        }
        dl = kvo__deadline(left < 1000 ? left : 1000);
        kvo__cond_wait(&pl->cond, &pl->lock, &dl);
    }
    return 1;
}

/* The transfer (arg: its handle) is final, or gone: released meanwhile, by on_done (the tier manager
 * releases its offloads there) or another thread, its container then reused or freed. So a wait looks
 * the container up by its handle each time and never holds it across the unlocked parts. */
static int kvo__is_final(kvo_pipeline *pl, void *arg)
{
    kvo__container *c = kvo__resolve(pl, *(const kvo_transfer *)arg);
    return !c || c->final;
}

static int kvo__is_idle(kvo_pipeline *pl, void *unused)
{
    (void)unused;
    return kvo__idle(pl, 0);
}

/* Idle, and no other thread inside a callback of the pipeline, not even one that drains: destroy. */
static int kvo__is_quiet(kvo_pipeline *pl, void *unused)
{
    (void)unused;
    return kvo__idle(pl, 1);
}

/* ---- pipeline: public ------------------------------------------------------------------------- */

static void kvo__pipeline_defaults(kvo_pipeline_config *c)
{
    if (!c->max_batch) c->max_batch = 64;
    if (!c->min_batch) c->min_batch = 8;
    if (!c->flush_interval_us) c->flush_interval_us = 10000;
    if (!c->policy_timeout_us) c->policy_timeout_us = 100000;
    if (!c->sweep_interval_us) c->sweep_interval_us = 10000;
    if (!c->max_concurrent) c->max_concurrent = 1;
    if (!c->on_deck) c->on_deck = 2;
    if (!c->precondition_timeout_us) c->precondition_timeout_us = 10u * 1000000u;
}

KVO_API kvo_result kvo_pipeline_create(const kvo_pipeline_config *config, kvo_pipeline **out)
{
    kvo_pipeline *pl;
    kvo_queue_config qc;
    uint64_t sb = 0, db = 0;
    void *sbase = NULL, *dbase = NULL;
    kvb_pool_config dc;
    if (!config || !out || !config->src || !config->dst || !config->backend || !config->backend->submit ||
        config->src == config->dst || (unsigned)config->mode > KVO_MODE_POLL)
        return KVO_EINVAL;
    /* Landed blocks are released at dst_priority: at a level the destination lacks every release would
     * fail and each block stay referenced. */
    if (kvb_pool_get_config(config->dst, &dc) != KVB_OK || config->dst_priority >= dc.priority_levels)
        return KVO_EINVAL;
    kvb_pool_storage(config->src, &sbase, NULL, &sb, NULL);
    kvb_pool_storage(config->dst, &dbase, NULL, &db, NULL);
    if (sbase && dbase && sb != db) return KVO_ELAYOUT;
    pl = (kvo_pipeline *)KVB_MALLOC(sizeof *pl);
    if (!pl) return KVO_ENOMEM;
    memset(pl, 0, sizeof *pl);
    pl->cfg = *config;
    kvo__pipeline_defaults(&pl->cfg);
    kvo__pool_tiers(pl);
    /* A batch takes all of its destination blocks at once, and on_deck batches wait upgraded: larger
     * batches than the destination holds would fail whole (KVO_EFULL) where their containers fit alone. */
    if (pl->cfg.max_batch > dc.num_blocks / pl->cfg.on_deck)
        pl->cfg.max_batch = dc.num_blocks / pl->cfg.on_deck ? dc.num_blocks / pl->cfg.on_deck : 1;
    if (pl->cfg.min_batch > pl->cfg.max_batch) pl->cfg.min_batch = pl->cfg.max_batch;
    qc.on_drop = kvo__on_drop;
    qc.user = pl;
    if (pthread_mutex_init(&pl->lock, NULL) != 0 || kvo__cond_init(&pl->cond) != 0 ||
        kvo_queue_create(&qc, &pl->q_eval) != KVO_OK || kvo_queue_create(&qc, &pl->q_pre) != KVO_OK ||
        kvo_queue_create(&qc, &pl->q_batch) != KVO_OK) {
        kvo_queue_destroy(pl->q_eval);
        kvo_queue_destroy(pl->q_pre);
        KVB_FREE(pl);
        return KVO_ENOMEM;
    }
    pl->last_sweep = kvo__now(pl);
    /* containers put back in a stage are few: room for them from the start; and for the batches on deck */
    if (!kvo__fit(&pl->stage_cs, 16) || !kvo__fit(&pl->on_deck, pl->cfg.on_deck)) {
        pl->stopping = 1;
        kvo_pipeline_destroy(pl);
        return KVO_ENOMEM;
    }
    if (pl->cfg.mode == KVO_MODE_THREADS) {
        if (pthread_create(&pl->thread, NULL, kvo__coordinator, pl) != 0) {
            pl->stopping = 1;
            kvo_pipeline_destroy(pl);
            return KVO_ENOMEM;
        }
        pl->has_thread = 1;
    }
    *out = pl;
    return KVO_OK;
}

KVO_API void kvo_pipeline_destroy(kvo_pipeline *pipeline)
{
    size_t i;
    if (!pipeline) return;
    pthread_mutex_lock(&pipeline->lock);
    for (i = 0; i < stbds_arrlenu(pipeline->slots); i++)
        if (pipeline->slots[i].c) kvo_token_cancel(pipeline->slots[i].c->token);
    kvo__sweep_all(pipeline);
    pipeline->stopping = 1;
    pthread_cond_broadcast(&pipeline->cond);
    kvo__unlock(pipeline);
    if (pipeline->has_thread) pthread_join(pipeline->thread, NULL);
    pipeline->has_thread = 0;
    kvo__mark_draining(1); /* from on_done: it waits as a drain does, and a drain need not wait for it */
    pthread_mutex_lock(&pipeline->lock);
    kvo__wait_until(pipeline, kvo__is_quiet, NULL, -1); /* what was upgraded completes (P3) */
    kvo__unlock(pipeline);
    kvo__mark_draining(-1);
    for (i = 0; i < stbds_arrlenu(pipeline->slots); i++) {
        kvo__container *c = pipeline->slots[i].c;
        if (!c) continue;
        kvo__release_dst(pipeline, c);
        kvo_token_release(c->token);
        KVB_FREE(c->note); /* NULL once final */
        KVB_FREE(c);
    }
    kvo__free_spares(pipeline);
    kvo_queue_destroy(pipeline->q_eval);
    kvo_queue_destroy(pipeline->q_pre);
    kvo_queue_destroy(pipeline->q_batch);
    stbds_arrfree(pipeline->in_queue);
    stbds_arrfree(pipeline->on_deck);
    stbds_arrfree(pipeline->slots);
    stbds_arrfree(pipeline->free_slots);
    kvb__ctab_free(&pipeline->inflight);
    kvb__ctab_free(&pipeline->freq);
    kvb__ctab_free(&pipeline->join_loads);
    stbds_arrfree(pipeline->join_pairs);
    stbds_arrfree(pipeline->join_blocked);
    stbds_arrfree(pipeline->join_work);
    kvo__notes_free(pipeline->notes);
    pthread_mutex_destroy(&pipeline->lock);
    pthread_cond_destroy(&pipeline->cond);
    KVB_FREE(pipeline);
}

/* A new container holding a reference to the caller's token and event. */
static kvo_result kvo__container_open(kvo_pipeline *pl, size_t n, const kvo_enqueue_opts *opts, kvo__container **out)
{
    kvo__container *c;
    kvo_token *parent = opts ? opts->token : NULL;
    if (opts && kvo_token_is_cancelled(opts->token)) return KVO_ECANCELLED;
    c = kvo__container_new(pl, n);
    if (!c) return KVO_ENOMEM;
    if (c->token) { /* kept from its last use: nobody else holds it */
        c->token->cancelled = 0;
        c->token->parent = parent;
        kvo_token_retain(parent);
    } else if (kvo__token_new(parent, &c->token) != KVO_OK) {
        KVB_FREE(c);
        return KVO_ENOMEM;
    }
    if (!kvo__note_reserve(pl, c, n) || !kvo__slot_alloc(pl, c)) {
        kvo__container_recycle(pl, c);
        return KVO_ENOMEM;
    }
    if (opts) {
        c->pre = opts->precondition;
        kvo_event_retain(c->pre);
        c->priority = opts->priority;
    }
    c->t_enqueue = c->t_eval = kvo__now(pl);
    *out = c;
    pl->stats.enqueued++;
    return KVO_OK;
}

KVO_API kvo_result kvo_enqueue(kvo_pipeline *pipeline, const kvb_weak *blocks, size_t n,
                               const kvo_enqueue_opts *opts, kvo_transfer *out)
{
    kvo__container *c;
    kvo_result r;
    if (!pipeline || !out || (n && !blocks) || (uint64_t)n > UINT32_MAX || n > SIZE_MAX / 2) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    r = kvo__container_open(pipeline, n, opts, &c);
    if (r == KVO_OK) {
        if (n) memcpy(c->src, blocks, n * sizeof *blocks); /* blocks may be NULL when n is 0 */
        r = kvo_queue_push(pipeline->q_eval, c, c->token); /* before its first note: nobody pops meanwhile */
        if (r == KVO_ENOMEM) { /* as if never enqueued */
            kvo_event_release(c->pre);
            c->pre = NULL;
            pipeline->stats.enqueued--;
            kvo__slot_unalloc(pipeline, c);
            kvo__container_recycle(pipeline, c);
            kvo__unlock(pipeline);
            return KVO_ENOMEM;
        }
        *out = kvo__handle_of(pipeline, c);
        kvo__stage(pipeline, c, KVO_STATUS_EVALUATING);
        if (r != KVO_OK) kvo__on_drop(c, pipeline); /* its token was cancelled meanwhile */
        r = KVO_OK;
        pthread_cond_broadcast(&pipeline->cond);
    }
    kvo__unlock(pipeline);
    return r;
}

/* Onboarding: present blocks are matched in the destination, blocks in flight to it joined, the rest
 * taken in the source at once. */
/* Whether c offers c->hashes[i] at an earlier place: a prefix has no repeats (each hash chains its
 * parent's), so a repeat ends it. */
static int kvo__offers_earlier(const kvo__container *c, size_t i)
{
    size_t j;
    for (j = 0; j < i; j++)
        if (c->state[j] == KVO__B_OFFER && c->hashes[j].lo == c->hashes[i].lo && c->hashes[j].hi == c->hashes[i].hi)
            return 1;
    return 0;
}

/* Whether c joins c->hashes[i] at an earlier place too: both would wait for the same copy, and should it
 * fail, the first loads the block and the second waits on that load of its own (the join-cycle breaker
 * then copied it twice). The joins of c are counted in pl->join_loads (scratch, empty between passes)
 * while it is matched; out of memory for that, a scan. Locked. */
static int kvo__joins_earlier(kvo_pipeline *pl, const kvo__container *c, size_t i)
{
    size_t j;
    if (kvo__count_get(&pl->join_loads, &c->hashes[i])) return 1;
    if (kvb__ctab_add(&pl->join_loads, &c->hashes[i], 1)) return 0;
    for (j = 0; j < i; j++)
        if (c->state[j] == KVO__B_JOINING && c->hashes[j].lo == c->hashes[i].lo && c->hashes[j].hi == c->hashes[i].hi)
            return 1;
    return 0;
}

static size_t kvo__onboard_match(kvo_pipeline *pl, kvo__container *c, const kvb_hash *hashes, size_t n)
{
    size_t i, k, offers = 0; /* a join scans for a repeat only after an offer: joining another's prefix stays linear */
    for (i = 0; i < n; i++) {
        kvb_block_info info;
        c->hashes[i] = hashes[i];
        if (kvb_pin(pl->cfg.dst, &hashes[i], 1, &c->dst_keep[i], &k) == KVB_OK && k) { /* held: no use of it */
            c->state[i] = KVO__B_PRESENT;
            c->dst_weak[i] = kvb_weak_of(c->dst_keep[i]);
            c->info.present++;
            continue;
        }
        if (kvo__count_get(&pl->inflight, &hashes[i])) { /* another transfer brings it: no second copy */
            if (offers && kvo__offers_earlier(c, i)) break; /* a repeat of its own: waiting on it would never end */
            if (kvo__joins_earlier(pl, c, i)) break;        /* a repeat of its own join ends it too */
            c->state[i] = KVO__B_JOINING;
            continue;
        }
        if (kvb_match(pl->cfg.src, &hashes[i], 1, &c->src_strong[i], &k) != KVB_OK || !k) break;
        kvb_block_get_info(pl->cfg.src, c->src_strong[i].id, &info);
        c->parents[i] = info.parent;
        c->state[i] = KVO__B_OFFER;
        kvo__count_add(&pl->inflight, &hashes[i], 1);
        offers++;
    }
    for (k = 0; k < i; k++) /* the scratch table back to empty */
        if (c->state[k] == KVO__B_JOINING) (void)kvb__ctab_sub(&pl->join_loads, &c->hashes[k], 0, 1);
    c->inflight_marked = 1;
    return i;
}

KVO_API kvo_result kvo_onboard(kvo_pipeline *pipeline, const kvb_hash *hashes, size_t n,
                               const kvo_enqueue_opts *opts, kvo_transfer *out)
{
    kvo__container *c;
    kvo_result r;
    size_t found;
    if (!pipeline || !out || (n && !hashes) || (uint64_t)n > UINT32_MAX || n > SIZE_MAX / 2) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    r = kvo__container_open(pipeline, n, opts, &c);
    if (r == KVO_OK) {
        c->onboard = 1;
        found = kvo__onboard_match(pipeline, c, hashes, n);
        c->n = found; /* the longest prefix found */
        c->info.blocks = (uint32_t)found;
        *out = kvo__handle_of(pipeline, c);
        if (!kvo__offered(c) && !kvo__joining(c)) {
            kvo__finalize(pipeline, c, KVO_STATUS_COMPLETE, KVO_OK);
        } else {
            c->info.status = KVO_STATUS_QUEUED;
            kvo__stage(pipeline, c, KVO_STATUS_QUEUED);
            kvo__push_or_end(pipeline, pipeline->q_pre, c);
        }
        pthread_cond_broadcast(&pipeline->cond);
    }
    kvo__unlock(pipeline);
    return r;
}

KVO_API kvo_result kvo_pipeline_poll(kvo_pipeline *pipeline)
{
    if (!pipeline) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    if (pipeline->cfg.mode == KVO_MODE_POLL) kvo__step(pipeline);
    else pthread_cond_broadcast(&pipeline->cond);
    kvo__unlock(pipeline);
    return KVO_OK;
}

KVO_API kvo_result kvo_pipeline_drain(kvo_pipeline *pipeline, int64_t timeout_us)
{
    int ok;
    if (!pipeline) return KVO_EINVAL;
    kvo__mark_draining(1); /* from on_done: another callback's drain need not wait for this one */
    pthread_mutex_lock(&pipeline->lock);
    pipeline->draining++;
    pthread_cond_broadcast(&pipeline->cond);
    ok = kvo__wait_until(pipeline, kvo__is_idle, NULL, timeout_us);
    pipeline->draining--;
    kvo__unlock(pipeline);
    kvo__mark_draining(-1);
    return ok ? KVO_OK : KVO_ETIMEDOUT;
}

KVO_API kvo_result kvo_pipeline_note_use(kvo_pipeline *pipeline, const kvb_hash *hashes, size_t n)
{
    size_t i;
    if (!pipeline || (n && !hashes)) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    for (i = 0; i < n; i++) kvo__count_add(&pipeline->freq, &hashes[i], 1);
    pthread_mutex_unlock(&pipeline->lock);
    return KVO_OK;
}

KVO_API kvo_result kvo_pipeline_get_stats(kvo_pipeline *pipeline, kvo_pipeline_stats *out)
{
    size_t i;
    if (!pipeline || !out) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    *out = pipeline->stats;
    out->in_flight_blocks = pipeline->executing_blocks;
    for (i = 0; i < stbds_arrlenu(pipeline->on_deck); i++) out->in_flight_blocks += (uint32_t)pipeline->on_deck[i]->job.n;
    pthread_mutex_unlock(&pipeline->lock);
    return KVO_OK;
}

KVO_API kvo_result kvo_pipeline_get_config(const kvo_pipeline *pipeline, kvo_pipeline_config *out)
{
    if (!pipeline || !out) return KVO_EINVAL;
    *out = pipeline->cfg;
    return KVO_OK;
}

KVO_API kvo_result kvo_transfer_get_info(kvo_pipeline *pipeline, kvo_transfer transfer, kvo_transfer_info *out)
{
    kvo__container *c;
    if (!pipeline || !out) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    c = kvo__resolve(pipeline, transfer);
    if (c) *out = c->info;
    pthread_mutex_unlock(&pipeline->lock);
    return c ? KVO_OK : KVO_ESTALE;
}

KVO_API kvo_result kvo_transfer_wait(kvo_pipeline *pipeline, kvo_transfer transfer, int64_t timeout_us,
                                     kvo_status *out_status)
{
    kvo__container *c;
    kvo_result r = KVO_OK;
    if (!pipeline) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    c = kvo__resolve(pipeline, transfer);
    if (c) {
        int ok = kvo__wait_until(pipeline, kvo__is_final, &transfer, timeout_us);
        c = kvo__resolve(pipeline, transfer); /* released meanwhile: KVO_ESTALE */
        if (c && !ok) r = KVO_ETIMEDOUT;
    }
    if (!c) r = KVO_ESTALE;
    else if (out_status) *out_status = c->info.status;
    kvo__unlock(pipeline);
    return r;
}

/* Cancel with the lock held: sweep now, then wait out a transfer already past its upgrade. Returns its
 * container, final, or NULL when the handle is stale (also when it was released during the wait). */
static kvo__container *kvo__cancel_locked(kvo_pipeline *pl, kvo_transfer t)
{
    kvo__container *c = kvo__resolve(pl, t);
    if (!c || c->final) return c;
    kvo_token_cancel(c->token);
    kvo__sweep_all(pl);
    kvo__wait_until(pl, kvo__is_final, &t, -1);
    return kvo__resolve(pl, t);
}

KVO_API kvo_result kvo_transfer_cancel(kvo_pipeline *pipeline, kvo_transfer transfer, kvo_status *out_status)
{
    kvo__container *c;
    if (!pipeline) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    c = kvo__cancel_locked(pipeline, transfer);
    if (c && out_status) *out_status = c->info.status;
    kvo__unlock(pipeline);
    return c ? KVO_OK : KVO_ESTALE;
}

KVO_API kvo_result kvo_transfer_take_blocks(kvo_pipeline *pipeline, kvo_transfer transfer, kvb_block *out,
                                            size_t max, size_t *out_n)
{
    kvo__container *c;
    kvo_result r = KVO_OK;
    size_t i, k = 0;
    if (!pipeline || !out_n || (max && !out)) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    c = kvo__resolve(pipeline, transfer);
    if (!c) r = KVO_ESTALE;
    else if (!c->onboard || c->info.status != KVO_STATUS_COMPLETE || c->taken) r = KVO_ESTATE;
    if (r == KVO_OK) {
        for (i = 0; i < c->n && k < max; i++) {
            out[k++] = c->dst_keep[i];
            c->dst_keep[i].id = 0;
        }
        /* what did not fit goes back now (it stays cached), not at kvo_transfer_release */
        kvo__release_dst(pipeline, c);
        c->taken = 1;
        *out_n = k;
    }
    pthread_mutex_unlock(&pipeline->lock);
    return r;
}

KVO_API kvo_result kvo_transfer_release(kvo_pipeline *pipeline, kvo_transfer transfer)
{
    kvo__container *c;
    if (!pipeline) return KVO_EINVAL;
    pthread_mutex_lock(&pipeline->lock);
    c = kvo__cancel_locked(pipeline, transfer); /* NULL also when released by another meanwhile */
    if (c) {
        kvo__release_dst(pipeline, c);
        kvo__slot_free(pipeline, c);
        kvo__container_recycle(pipeline, c);
    }
    kvo__unlock(pipeline);
    return c ? KVO_OK : KVO_ESTALE;
}

/* ---- tier manager ------------------------------------------------------------------------------- */

typedef struct kvo__edge {
    kvo_manager *m;
    uint32_t tier;
    pthread_mutex_t lock;      /* the scratch below: callbacks of one pipeline may come from two threads */
    kvb_weak *scratch;         /* stb_ds: weak handles on their way down from this tier (kept) */
    kvb_weak *retry;           /* stb_ds: failed ones going down from this tier again (kept) */
} kvo__edge;

struct kvo_manager {
    kvo_manager_config cfg;
    kvo_pipeline *down[KVO_MAX_TIERS], *up[KVO_MAX_TIERS];
    uint32_t from[KVO_MAX_TIERS];   /* down[i] copies from[i] -> i + 1: i, or branch_from for the last */
    kvo__edge edges[KVO_MAX_TIERS];
    pthread_mutex_t hook_lock; /* cfg.on_offloaded / offloaded_user, and hook_calls */
    pthread_cond_t hook_idle;  /* old_hook_calls went to 0 */
    uint32_t hook_calls;       /* calls of the current on_offloaded in progress (pipeline threads) */
    uint32_t old_hook_calls;   /* calls of replaced ones in progress: what set_offloaded waits for */
    uint64_t hook_gen;         /* hooks set so far: tells a call of the current hook from an older one */
};

/* The sources of pl's failed copies kept so far, moved into *out (an stb_ds array, emptied first);
 * returns how many. */
static size_t kvo__take_failed(kvo_pipeline *pl, kvb_weak **out)
{
    kvb_weak *kept;
    size_t n;
    KVB__ARR_SHRINK(*out, 0);
    if (!pl->keep_failed) return 0; /* set at the manager's creation: G1's pipelines keep none */
    pthread_mutex_lock(&pl->lock);
    n = stbds_arrlenu(pl->failed_src);
    if (n) { /* swapped: both arrays keep their room */
        kept = pl->failed_src;
        pl->failed_src = *out;
        *out = kept;
    }
    pthread_mutex_unlock(&pl->lock);
    return n;
}

/* Blocks of `tier` go down every pipeline that copies from it (two at a branch), and with them, on a
 * separate transfer, the blocks whose copy down that pipeline failed before (eager mode): a later offer
 * of those stops at this tier, which holds them, so this is their next try. *out gets the first
 * transfer of w (n may be 0); the handles are released when the transfers are done
 * (kvo__manager_down_done). An enqueue refused (out of memory) ends the sends there, retries included,
 * and *out is left as it was: with the first refused nothing is sent; at a branch, a refusal of the
 * second leaves the first on its way. The caller holds the edge of `tier`. */
static kvo_result kvo__manager_send(kvo_manager *m, uint32_t tier, const kvb_weak *w, size_t n, kvo_transfer *out)
{
    kvo__edge *e = &m->edges[tier];
    kvo_result r;
    kvo_transfer sent = {0};
    uint32_t i;
    for (i = 0; i + 1 < m->cfg.num_tiers; i++) {
        kvo_transfer t;
        size_t again;
        if (!m->down[i] || m->from[i] != tier) continue;
        if (n) {
            if ((r = kvo_enqueue(m->down[i], w, n, NULL, &t)) != KVO_OK) return r;
            if (!sent.id) sent = t;
        }
        if ((again = kvo__take_failed(m->down[i], &e->retry)) > 0)
            (void)kvo_enqueue(m->down[i], e->retry, again, NULL, &t); /* refused (out of memory): lost, as a
                                                                         failed offer is */
    }
    if (out && sent.id) *out = sent;
    return KVO_OK;
}

/* An offload into tier + 1 finished: eager mode sends what landed on down. */
static void kvo__manager_down_done(void *user, kvo_transfer t, const kvo_transfer_info *info,
                                   const kvb_weak *dst, size_t n)
{
    kvo__edge *e = (kvo__edge *)user;
    kvo_manager *m = e->m;
    uint32_t next = e->tier + 1;
    kvo_offloaded_fn hook;
    void *hook_user;
    uint64_t gen;
    pthread_mutex_lock(&m->hook_lock); /* a hook being replaced is not called once set_offloaded returns */
    hook = m->cfg.on_offloaded;
    hook_user = m->cfg.offloaded_user;
    gen = m->hook_gen;
    if (hook) m->hook_calls++;
    pthread_mutex_unlock(&m->hook_lock);
    if (hook) {
        hook(hook_user, e->tier, t, info);
        pthread_mutex_lock(&m->hook_lock);
        if (gen == m->hook_gen) m->hook_calls--;
        else if (--m->old_hook_calls == 0) pthread_cond_broadcast(&m->hook_idle); /* replaced meanwhile */
        pthread_mutex_unlock(&m->hook_lock);
    }
    if (m->cfg.offload == KVO_OFFLOAD_EAGER && next < m->cfg.num_tiers) {
        kvo__edge *landed = &m->edges[next]; /* what landed in `next` goes on from there (and what failed
                                                to go on before, even when nothing landed) */
        size_t i;
        pthread_mutex_lock(&landed->lock);
        KVB__ARR_SHRINK(landed->scratch, 0);
        if (kvo__fit(&landed->scratch, n)) /* else out of memory: they stay where they landed */
            for (i = 0; i < n; i++)
                if (dst[i].id) stbds_arrput(landed->scratch, dst[i]);
        kvo__manager_send(m, next, landed->scratch, stbds_arrlenu(landed->scratch), NULL);
        pthread_mutex_unlock(&landed->lock);
    }
    kvo_transfer_release(m->down[e->tier], t);
}

/* Eager mode, a pipeline from a tier below G1: blocks there arrived through the chain, and an offer of
 * them stops at the tier that holds them, so the manager keeps the sources of failed copies for the
 * pipeline's next send (kvo__manager_send), at most as many as the tier has blocks. (G1's own blocks
 * fail into a G2 that lacks them: the next offer of them tries again by itself.) */
static void kvo__manager_keep_failed(kvo_pipeline *pl, kvb_pool *src)
{
    kvb_pool_config pc;
    if (kvb_pool_get_config(src, &pc) != KVB_OK) return;
    pthread_mutex_lock(&pl->lock);
    pl->keep_failed = pc.num_blocks;
    pthread_mutex_unlock(&pl->lock);
}

KVO_API kvo_result kvo_manager_create(const kvo_manager_config *config, kvo_manager **out)
{
    kvo_manager *m;
    uint32_t i;
    kvo_result r = KVO_OK;
    if (!config || !out || config->num_tiers < 2 || config->num_tiers > KVO_MAX_TIERS ||
        (unsigned)config->offload > KVO_OFFLOAD_LAZY ||
        (config->branch_from && (config->num_tiers < 4 || config->branch_from > config->num_tiers - 3)) ||
        config->pipeline.on_done) /* the manager's own: it would never be called */
        return KVO_EINVAL;
    for (i = 0; i < config->num_tiers; i++)
        if (!config->pools[i]) return KVO_EINVAL;
    m = (kvo_manager *)KVB_MALLOC(sizeof *m);
    if (!m) return KVO_ENOMEM;
    memset(m, 0, sizeof *m);
    m->cfg = *config;
    if (!m->cfg.lazy_reserve) m->cfg.lazy_reserve = 64;
    for (i = 0; i < KVO_MAX_TIERS; i++) pthread_mutex_init(&m->edges[i].lock, NULL);
    pthread_mutex_init(&m->hook_lock, NULL);
    pthread_cond_init(&m->hook_idle, NULL);
    for (i = 0; i < config->num_tiers && r == KVO_OK; i++) {
        kvo_pipeline_config pc = config->pipeline;
        m->edges[i].m = m;
        m->edges[i].tier = i;
        m->from[i] = config->branch_from && i + 2 == config->num_tiers ? config->branch_from : i;
        if (i + 1 < config->num_tiers && config->down[i]) {
            pc.src = config->pools[m->from[i]];
            pc.dst = config->pools[i + 1];
            pc.backend = config->down[i];
            pc.on_done = kvo__manager_down_done;
            pc.done_user = &m->edges[i];
            r = kvo_pipeline_create(&pc, &m->down[i]);
            if (r == KVO_OK && config->offload == KVO_OFFLOAD_EAGER && m->from[i] > 0)
                kvo__manager_keep_failed(m->down[i], config->pools[m->from[i]]);
        }
        if (r == KVO_OK && i >= 1 && config->up[i]) {
            pc = config->pipeline;
            pc.src = config->pools[i];
            pc.dst = config->pools[0];
            pc.backend = config->up[i];
            pc.on_done = NULL;
            pc.presence = -1; /* onboarding matches the destination itself */
            r = kvo_pipeline_create(&pc, &m->up[i]);
        }
    }
    if (r != KVO_OK) {
        kvo_manager_destroy(m);
        return r;
    }
    *out = m;
    return KVO_OK;
}

KVO_API void kvo_manager_destroy(kvo_manager *manager)
{
    uint32_t i;
    if (!manager) return;
    /* Top down, so chained offloads find their next stage: a copy landing in tier i + 1 goes on down
     * pipelines from that tier, which come later. Their callbacks read down[] (kvo__manager_send) while
     * this runs: it is left as it is, and a destroyed pipeline's entry is never one they use. */
    for (i = 0; i < KVO_MAX_TIERS; i++) kvo_pipeline_destroy(manager->down[i]);
    for (i = 0; i < KVO_MAX_TIERS; i++) kvo_pipeline_destroy(manager->up[i]);
    for (i = 0; i < KVO_MAX_TIERS; i++) {
        stbds_arrfree(manager->edges[i].scratch);
        stbds_arrfree(manager->edges[i].retry);
        pthread_mutex_destroy(&manager->edges[i].lock);
    }
    pthread_mutex_destroy(&manager->hook_lock);
    pthread_cond_destroy(&manager->hook_idle);
    KVB_FREE(manager);
}

KVO_API kvo_result kvo_manager_offer(kvo_manager *manager, uint32_t tier, const kvb_block *blocks, size_t n,
                                     kvo_transfer *out)
{
    kvo__edge *e;
    kvo_result r;
    size_t i;
    /* n as kvo_enqueue bounds it, checked before the scratch is sized for n and n blocks are read */
    if (!manager || tier >= manager->cfg.num_tiers || (n && !blocks) || (uint64_t)n > UINT32_MAX) return KVO_EINVAL;
    if (out) out->id = 0;
    if (!n || manager->cfg.offload != KVO_OFFLOAD_EAGER) return KVO_OK;
    e = &manager->edges[tier];
    pthread_mutex_lock(&e->lock);
    if (!kvo__fit(&e->scratch, n)) {
        pthread_mutex_unlock(&e->lock);
        return KVO_ENOMEM;
    }
    KVB__ARR_SHRINK(e->scratch, 0);
    for (i = 0; i < n; i++) stbds_arrput(e->scratch, kvb_weak_of(blocks[i]));
    r = kvo__manager_send(manager, tier, e->scratch, n, out); /* released by kvo__manager_down_done */
    pthread_mutex_unlock(&e->lock);
    return r;
}

/* Lazy mode: keep lazy_reserve blocks of each tier (at most all of them) ready to be taken without
 * losing data: free ones, and for what free blocks do not cover, the next eviction candidates backed by
 * the tier below. The candidates go through the edge's scratch, so a steady state allocates nothing. */
static void kvo__manager_back_candidates(kvo_manager *m, uint32_t tier)
{
    kvb_pool_stats st;
    kvo__edge *e = &m->edges[tier];
    size_t n = 0, want;
    if (kvb_pool_get_stats(m->cfg.pools[tier], &st) != KVB_OK) return;
    want = m->cfg.lazy_reserve < st.num_blocks ? m->cfg.lazy_reserve : st.num_blocks;
    if (st.free_blocks >= want) return;
    want -= st.free_blocks;
    pthread_mutex_lock(&e->lock);
    if (!kvo__fit(&e->scratch, want)) { /* out of memory: backed at the next poll */
        pthread_mutex_unlock(&e->lock);
        return;
    }
    KVB__ARR_SHRINK(e->scratch, want);
    if (kvb_eviction_candidates(m->cfg.pools[tier], want, e->scratch, &n) == KVB_OK && n)
        kvo__manager_send(m, tier, e->scratch, n, NULL);
    pthread_mutex_unlock(&e->lock);
}

KVO_API kvo_result kvo_manager_poll(kvo_manager *manager)
{
    uint32_t i;
    if (!manager) return KVO_EINVAL;
    for (i = 0; i < manager->cfg.num_tiers; i++) {
        if (manager->cfg.offload == KVO_OFFLOAD_LAZY && manager->down[i] && manager->from[i] == i)
            kvo__manager_back_candidates(manager, i); /* a branch's source is backed for both with its own */
        if (manager->down[i]) kvo_pipeline_poll(manager->down[i]);
        if (manager->up[i]) kvo_pipeline_poll(manager->up[i]);
    }
    return KVO_OK;
}

KVO_API kvo_result kvo_manager_lookup(kvo_manager *manager, const kvb_hash *hashes, size_t n,
                                      uint8_t *tier_of, size_t *out_n)
{
    uint8_t present[256]; /* a chunk at a time: no allocation */
    size_t i, at, found = 0;
    uint32_t t;
    kvo_result r = KVO_OK;
    if (!manager || !out_n || (n && (!hashes || !tier_of))) return KVO_EINVAL;
    if (n) memset(tier_of, 0xff, n);
    for (at = 0; at < n && r == KVO_OK; at += sizeof present) {
        size_t k = n - at < sizeof present ? n - at : sizeof present;
        for (t = 0; t < manager->cfg.num_tiers; t++) { /* fastest tier first; each fills what is still open */
            if (kvb_presence(manager->cfg.pools[t], hashes + at, k, present, NULL) != KVB_OK) {
                r = KVO_EINVAL;
                break;
            }
            for (i = 0; i < k; i++)
                if (present[i] && tier_of[at + i] == 0xff) tier_of[at + i] = (uint8_t)t;
        }
    }
    while (found < n && tier_of[found] != 0xff) found++;
    *out_n = found;
    return r;
}

KVO_API kvo_result kvo_manager_onboard(kvo_manager *manager, uint32_t tier, const kvb_hash *hashes, size_t n,
                                       kvo_transfer *out)
{
    if (!manager || tier == 0 || tier >= manager->cfg.num_tiers || !manager->up[tier]) return KVO_EINVAL;
    return kvo_onboard(manager->up[tier], hashes, n, NULL, out);
}

KVO_API kvo_pipeline *kvo_manager_pipeline(kvo_manager *manager, uint32_t from_tier, int up)
{
    if (!manager || from_tier >= KVO_MAX_TIERS) return NULL;
    return up ? manager->up[from_tier] : manager->down[from_tier];
}

KVO_API kvo_result kvo_manager_get_config(const kvo_manager *manager, kvo_manager_config *out)
{
    pthread_mutex_t *hook_lock;
    if (!manager || !out) return KVO_EINVAL;
    hook_lock = (pthread_mutex_t *)&manager->hook_lock; /* the hook may be replaced meanwhile */
    pthread_mutex_lock(hook_lock);
    *out = manager->cfg;
    pthread_mutex_unlock(hook_lock);
    return KVO_OK;
}

KVO_API kvo_result kvo_manager_set_offloaded(kvo_manager *manager, kvo_offloaded_fn fn, void *user)
{
    if (!manager) return KVO_EINVAL;
    pthread_mutex_lock(&manager->hook_lock);
    manager->cfg.on_offloaded = fn;
    manager->cfg.offloaded_user = user;
    manager->hook_gen++;
    manager->old_hook_calls += manager->hook_calls; /* the new hook's calls are not waited for */
    manager->hook_calls = 0;
    while (manager->old_hook_calls) pthread_cond_wait(&manager->hook_idle, &manager->hook_lock);
    pthread_mutex_unlock(&manager->hook_lock);
    return KVO_OK;
}

KVO_API kvo_result kvo_manager_claim_offloaded(kvo_manager *manager, kvo_offloaded_fn fn, void *user)
{
    kvo_result r = KVO_ESTATE;
    if (!manager || !fn) return KVO_EINVAL;
    pthread_mutex_lock(&manager->hook_lock);
    if (!manager->cfg.on_offloaded) { /* no hook: no call of one in progress to wait for */
        manager->cfg.on_offloaded = fn;
        manager->cfg.offloaded_user = user;
        r = KVO_OK;
    }
    pthread_mutex_unlock(&manager->hook_lock);
    return r;
}

/* What is left of a drain's timeout started at `start` (negative: none, it waits for ever). */
static int64_t kvo__time_left(int64_t timeout_us, uint64_t start)
{
    int64_t left = timeout_us - (int64_t)(kvo__mono_us() - start);
    return timeout_us < 0 ? timeout_us : left > 0 ? left : 0;
}

KVO_API kvo_result kvo_manager_drain(kvo_manager *manager, int64_t timeout_us)
{
    uint32_t i;
    uint64_t start = kvo__mono_us();
    kvo_result r = KVO_OK;
    if (!manager) return KVO_EINVAL;
    for (i = 0; i < manager->cfg.num_tiers && r == KVO_OK; i++) { /* in chain order: eager work flows down */
        if (manager->down[i]) r = kvo_pipeline_drain(manager->down[i], kvo__time_left(timeout_us, start));
        if (r == KVO_OK && manager->up[i]) r = kvo_pipeline_drain(manager->up[i], kvo__time_left(timeout_us, start));
    }
    return r;
}

KVO_API kvo_result kvo_manager_get_stats(kvo_manager *manager, kvo_manager_stats *out)
{
    uint32_t i;
    if (!manager || !out) return KVO_EINVAL;
    memset(out, 0, sizeof *out);
    for (i = 0; i < KVO_MAX_TIERS; i++) {
        if (manager->down[i]) kvo_pipeline_get_stats(manager->down[i], &out->down[i]);
        if (manager->up[i]) kvo_pipeline_get_stats(manager->up[i], &out->up[i]);
    }
    return KVO_OK;
}

#ifdef KVO__DEFINED_TYPEOF
#undef typeof
#undef KVO__DEFINED_TYPEOF
#endif

#endif /* KVOFFLOAD_IMPL_INCLUDED */
#endif /* KVOFFLOAD_IMPLEMENTATION || KVCACHE_IMPLEMENTATION */
