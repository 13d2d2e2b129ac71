/* kvblock.h — KV-cache blocks: lifecycle, sharing, prefix lookup, storage of one tier (part of kvcache)
 *
 * Do this in exactly one C or C++ file:    #define KVBLOCK_IMPLEMENTATION
 *                                           #include "kvblock.h"
 * Everywhere else just include it.  Needs C11 (or C++11), POSIX threads and stb_ds.h
 * (Debian: libstb-dev, compile with -I/usr/include/stb), link with -pthread.
 *
 * Manual: 1. Quick start  2. Concepts  3. Hashing  4. Configuration macros  5. Thread safety  6. Errors
 *
 * 1. QUICK START
 *
 *     kvb_pool_config cfg = { .num_blocks = 1024, .block_tokens = 16 };   // zero = default
 *     kvb_pool *pool;
 *     if (kvb_pool_create(&cfg, &pool) != KVB_OK) abort();
 *     kvb_seq *seq;
 *     kvb_seq_create(pool, NULL, &seq);                  // a request: tokens + block table
 *     size_t cached;
 *     kvb_seq_append(seq, prompt, prompt_len, &cached);  // reuses cached full blocks, allocates the rest
 *     ... run the model over tokens [cached, prompt_len) ...
 *     kvb_seq_commit(seq, prompt_len);                   // full blocks become Registered (shareable)
 *     kvb_seq_destroy(seq);                              // blocks stay cached until evicted
 *     kvb_pool_destroy(pool);
 *
 * 2. CONCEPTS
 *
 * Pool: N blocks of `block_tokens` tokens for one tier (device, host, disk...). Every block is in exactly
 * one set: free (never used or reset), active (strong references > 0), inactive (Registered, no
 * references, still matchable by hash, evictable). Allocation of n blocks is all-or-nothing: it takes
 * free blocks first, then evicts inactive ones.
 *
 * Lifecycle of a block (any other transition returns KVB_ESTATE and changes nothing):
 *
 *     from                 call                                          to
 *     (free)               kvb_alloc                                     Empty
 *     Empty                kvb_block_init(parent, salt, extra keys)      Partial
 *     Partial              kvb_block_add_tokens(.., ready = 0), not full Partial
 *     Partial              kvb_block_add_tokens(.., ready = 1) or full   ReadyForScheduling
 *     ReadyForScheduling   kvb_block_schedule                            Inflight
 *     ReadyForScheduling   kvb_block_cancel_schedule                     Partial
 *     Inflight             kvb_block_compute_done, not full              Partial
 *     Inflight             kvb_block_compute_done, full                  Complete
 *     Complete             kvb_register                                  Registered
 *     Empty                kvb_register_hashed (content made elsewhere)  Registered
 *
 * Reading of the seed's two "addTokens" exits of Partial: adding tokens keeps a block Partial while
 * space remains and the caller has more tokens to come (ready = 0); it becomes ReadyForScheduling when
 * the block is full (always) or when the caller says the tokens so far are to be computed now
 * (ready = 1, e.g. the last, partial block of a decode step; n may be 0 for that). Tokens can be added
 * only in Partial. kvb_register_hashed is the import path used by onboarding and trace replay: the
 * bytes were computed elsewhere and arrive with their hash. The last reference to a block that is not
 * Registered returns it to the free set; a Registered one becomes inactive.
 *
 * Handles are values: index + generation. A strong handle (kvb_block) stands for one counted
 * reference; a weak handle (kvb_weak, from kvb_weak_of) is not counted, and kvb_upgrade fails with
 * KVB_EGONE once the block was evicted or reset. Upgrading a weak handle to an inactive cached block
 * takes it off the eviction list. A stale strong handle (block since reused) gives KVB_ESTALE; a weak
 * handle passed where a strong one is expected gives KVB_EWEAK.
 *
 * Prefix index: Registered blocks are found by their 128-bit sequence hash. kvb_match returns the
 * longest cached prefix of a hash chain, stopping at the first miss, and takes a reference on each
 * block it returns. Duplicate registration (a second block with a hash already present): policy
 * KVB_DUP_ALLOW keeps both (the first stays the one matched; typical for the device tier),
 * KVB_DUP_REJECT hands back the existing block (with a reference) and resets the duplicate.
 *
 * Eviction: KVB_EVICT_LINEAGE (default) evicts leaves first (blocks no other cached block names as
 * parent), least recently released first; KVB_EVICT_LRU is plain LRU. Both keep one list per priority
 * level (kvb_release_opts.priority; level 0 is evicted first). kvb_release releases an array deepest
 * first (last element first), so the tail blocks of a request are the first to go, as in vLLM.
 * KVB_EVICT_CUSTOM calls the kvb_evict_ops you give.
 *
 * Storage: KVB_STORAGE_NONE (metadata only, for schedulers and simulators: 10M blocks fit in about
 * 1 GiB), KVB_STORAGE_HOST (the pool allocates 4 KiB-aligned memory from the allocator) or
 * KVB_STORAGE_EXTERNAL (you give the memory, e.g. GPU memory from kvcuda). The layout says where
 * (block, layer, part) lives, part 0 = K and 1 = V:
 *   KVB_LAYOUT_BLOCK_CONTIGUOUS: offset = ((block * layers + layer) * parts + part) * page_bytes
 *   KVB_LAYOUT_LAYER_SEPARATE:   offset = ((layer * parts + part) * num_blocks + block) * page_bytes
 *
 * Sequences (kvb_seq): a request's tokens and block table. Append computes block hashes as blocks
 * fill and reuses cached blocks for the prefix; commit runs the lifecycle and registers full blocks;
 * fork shares every block (beam search); writing to a shared partial block copies it first
 * (copy-on-write, bytes included); truncate drops tokens and the blocks past the new end.
 *
 * Events: with an event callback, the pool reports when a hash becomes present (STORED), stops being
 * present (REMOVED), or everything is dropped (CLEARED), in batches, once per public call.
 *
 * 3. HASHING (fixed; another program can compute the same values)
 *
 * kvb_hash_block(parent, tokens, n, extra, n_extra, salt). Words: tokens are 32-bit little-endian
 * ids packed two per 64-bit word (w = t[2i] | t[2i+1] << 32; an odd last token has zero high half),
 * then each extra key as one word, then L = n | n_extra << 32. M(x, y) = low ^ high half of the 128-bit
 * product x * y. C[0..15] are the constants in kvb__hk below. Words are taken in pairs (x, y), the
 * last pair padded with y = 0; for pair j, k = j & 15:
 *     a = parent.lo ^ salt ^ C[0]               b = parent.hi ^ rotl(salt, 32) ^ C[1]   (before)
 *     a = rotl(a, 29) + M(x ^ C[k], y ^ C[(k + 5) & 15])
 *     b = rotl(b, 37) ^ M(y ^ C[(k + 9) & 15], x ^ C[(k + 3) & 15])
 * then lo = a ^ F(b + C[6]), hi = b ^ F(lo + C[7]), lo = lo ^ F(hi + C[8]) with
 * F(v) = v ^= v >> 32, v *= C[2], v ^= v >> 29, v *= C[4], v ^= v >> 32.
 * Test vectors (parent = 0, salt = 0, no extra keys):
 *     tokens {}                 -> see kvb__vectors in tests/test_hash.c (kept in sync by the test)
 *     tokens {0..15}            -> lo = 0x(see tests)  hi = 0x(see tests)
 * A different hash can be plugged in with kvb_pool_config.hash_fn.
 *
 * 4. CONFIGURATION MACROS (define before the implementation)
 *     KVB_STATIC              make every function static (private to one translation unit)
 *     KVB_API                 declaration prefix (default extern)
 *     KVB_MALLOC(sz) / KVB_REALLOC(p, sz) / KVB_FREE(p)   all three or none: the default allocator
 *                             and every internal array (stb_ds); the runtime kvb_allocator in the
 *                             config, when given, serves the pool's metadata and storage.
 *     KVB_MAX_EXTRA_KEYS      extra hash keys per block (default 8)
 *
 * 5. THREAD SAFETY
 * A pool is safe to use from any number of threads: one mutex per pool, taken once per call, so batch
 * calls (arrays of blocks) keep the lock cost per block small. Event callbacks run with that mutex held
 * and must not call back into the same pool. A kvb_seq is used by one thread at a time.
 *
 * 6. ERRORS
 * Every function returns a kvb_result: KVB_OK (0) or a negative code; kvb_result_string names it.
 * A call that fails changes nothing.
 */
#ifndef KVBLOCK_H
#define KVBLOCK_H
#define KVBLOCK_VERSION_MAJOR 0
#define KVBLOCK_VERSION_MINOR 1
#define KVBLOCK_VERSION_PATCH 0

#include <stddef.h>
#include <stdint.h>

#ifndef KVB_API
#ifdef KVB_STATIC
#define KVB_API static
#else
#define KVB_API extern
#endif
#endif

#ifndef KVB_MAX_EXTRA_KEYS
#define KVB_MAX_EXTRA_KEYS 8
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- results ------------------------------------------------------------------------------------ */

#define KVB__RESULTS(X)                                                          \
    X(KVB_OK,        0,   "ok")                                                  \
    X(KVB_EINVAL,   -1,   "invalid argument")                                    \
    X(KVB_ESTATE,   -2,   "transition not allowed from this state")              \
    X(KVB_ENOSPACE, -3,   "not enough free or evictable blocks")                 \
    X(KVB_ESTALE,   -4,   "handle refers to a block that was reused")            \
    X(KVB_EGONE,    -5,   "weak handle: block was evicted or reset")             \
    X(KVB_EWEAK,    -6,   "weak handle given where a strong one is needed")      \
    X(KVB_ERANGE,   -7,   "index, layer or token count out of range")            \
    X(KVB_EDOUBLE,  -8,   "block released more often than it was referenced")   \
    X(KVB_EBUSY,    -9,   "blocks are still in use")                             \
    X(KVB_ENOMEM,   -10,  "out of memory")                                       \
    X(KVB_ECONFIG,  -11,  "invalid configuration value")                         \
    X(KVB_EOVERFLOW,-12,  "sizes overflow")                                      \
    X(KVB_ENODATA,  -13,  "pool has no storage (metadata only)")                 \
    X(KVB_ECORRUPT, -14,  "pool invariant violated")

#define KVB__ENUM_ITEM(name, value, text) name = value,
typedef enum kvb_result { KVB__RESULTS(KVB__ENUM_ITEM) KVB__RESULT_MIN = -15 } kvb_result;
#undef KVB__ENUM_ITEM

/* Human-readable name of a result code ("unknown result" for other values).
 * Thread safety: pure function. */
KVB_API const char *kvb_result_string(int result);

/* ---- values ------------------------------------------------------------------------------------- */

/* 128-bit sequence hash: identifies a block together with its whole prefix. {0, 0} = the root. */
typedef struct kvb_hash { uint64_t lo, hi; } kvb_hash;

/* Strong handle: one counted reference. Bits 0..31 = index + 1, bits 32..62 = generation; 0 = none. */
typedef struct kvb_block { uint64_t id; } kvb_block;
/* Weak handle: not counted (bit 63 set). Upgrade with kvb_upgrade. */
typedef struct kvb_weak { uint64_t id; } kvb_weak;

#define KVB_WEAK_BIT (UINT64_C(1) << 63)

typedef enum kvb_block_state {
    KVB_STATE_EMPTY = 1,
    KVB_STATE_PARTIAL,
    KVB_STATE_READY,      /* ReadyForScheduling */
    KVB_STATE_INFLIGHT,
    KVB_STATE_COMPLETE,
    KVB_STATE_REGISTERED
} kvb_block_state;

typedef enum kvb_evict_policy {
    KVB_EVICT_DEFAULT = 0, /* = KVB_EVICT_LINEAGE */
    KVB_EVICT_LINEAGE,     /* leaves first, least recently released first, per priority level */
    KVB_EVICT_LRU,         /* least recently released first, per priority level */
    KVB_EVICT_CUSTOM,      /* kvb_pool_config.custom_eviction decides */
    KVB_EVICT__COUNT
} kvb_evict_policy;

typedef enum kvb_dup_policy {
    KVB_DUP_DEFAULT = 0,   /* = KVB_DUP_ALLOW */
    KVB_DUP_ALLOW,         /* keep both blocks; the first registered stays the one matched */
    KVB_DUP_REJECT,        /* return the existing block and reset the duplicate */
    KVB_DUP__COUNT
} kvb_dup_policy;

typedef enum kvb_storage_kind {
    KVB_STORAGE_NONE = 0,  /* metadata only */
    KVB_STORAGE_HOST,      /* the pool allocates 4 KiB-aligned memory */
    KVB_STORAGE_EXTERNAL,  /* the caller gives external_base (external_bytes long) */
    KVB_STORAGE__COUNT
} kvb_storage_kind;

typedef enum kvb_layout_kind {
    KVB_LAYOUT_BLOCK_CONTIGUOUS = 0, /* all layers and parts of a block are one run */
    KVB_LAYOUT_LAYER_SEPARATE,       /* one array of blocks per (layer, part), as vLLM's per-layer tensors */
    KVB_LAYOUT__COUNT
} kvb_layout_kind;

/* Where the bytes of (block, layer, part) live. page_bytes = bytes of one block for one layer and part
 * (block_tokens * kv_heads * head_dim * dtype bytes). Zero fields default: layers 1, parts 2. */
typedef struct kvb_layout {
    kvb_layout_kind kind;
    uint32_t num_layers;
    uint32_t num_parts;
    uint64_t page_bytes;
} kvb_layout;

/* Runtime allocator: both functions or neither. align is a power of two. */
typedef struct kvb_allocator {
    void *(*alloc)(size_t size, size_t align, void *user);
    void (*free)(void *ptr, size_t size, void *user);
    void *user;
} kvb_allocator;

typedef enum kvb_event_kind { KVB_EVENT_STORED = 1, KVB_EVENT_REMOVED, KVB_EVENT_CLEARED } kvb_event_kind;

typedef struct kvb_event {
    kvb_event_kind kind;
    uint32_t tier;        /* kvb_pool_config.tier */
    uint32_t num_tokens;  /* tokens in the block (0 for CLEARED) */
    kvb_hash hash;        /* zero for CLEARED */
    kvb_hash parent;
} kvb_event;

/* Receives events in batches, at most once per public call, with the pool's mutex held. */
typedef void (*kvb_event_fn)(const kvb_event *events, size_t n, void *user);

/* Replacement block hash: must be deterministic and write *out. */
typedef void (*kvb_hash_fn)(const kvb_hash *parent, const uint32_t *tokens, size_t n_tokens,
                            const uint64_t *extra, size_t n_extra, uint64_t salt, kvb_hash *out, void *user);

/* Custom eviction: the pool tells which blocks became evictable and which stopped being so, and asks
 * for a victim among the evictable ones (return its index, or UINT32_MAX for none). */
typedef struct kvb_evict_ops {
    void (*on_inactive)(void *user, uint32_t index, uint32_t priority);
    void (*on_removed)(void *user, uint32_t index);
    uint32_t (*choose_victim)(void *user);
    void *user;
} kvb_evict_ops;

typedef struct kvb_pool_config {
    uint32_t num_blocks;        /* required, 1 .. 2^31 - 1 */
    uint32_t block_tokens;      /* default 16, at most 32768 */
    kvb_evict_policy eviction;  /* default lineage */
    kvb_dup_policy duplicates;  /* default allow */
    uint32_t priority_levels;   /* default 1, at most 16 */
    uint32_t tier;              /* stamped on events: 0 device, 1 host, 2 disk, 3 remote by convention */
    kvb_storage_kind storage;   /* default none */
    kvb_layout layout;          /* used with storage */
    void *external_base;        /* KVB_STORAGE_EXTERNAL: the memory (4 KiB-aligned not required) */
    uint64_t external_bytes;    /* its size; must hold the layout */
    kvb_allocator allocator;    /* default: KVB_MALLOC / KVB_FREE */
    kvb_event_fn on_events;     /* optional */
    void *event_user;
    kvb_hash_fn hash_fn;        /* default kvb_hash_block */
    void *hash_user;
    kvb_evict_ops custom_eviction; /* with KVB_EVICT_CUSTOM */
} kvb_pool_config;

typedef struct kvb_pool_stats {
    uint64_t lookups;        /* kvb_match calls */
    uint64_t lookup_blocks;  /* hashes asked for */
    uint64_t hit_blocks;     /* blocks matched */
    uint64_t hit_tokens;     /* tokens in matched blocks */
    uint64_t allocations;    /* blocks allocated */
    uint64_t evictions;      /* inactive blocks reused */
    uint64_t registrations;  /* blocks registered (import included) */
    uint64_t dedups;         /* registrations that found the hash already present */
    uint32_t num_blocks, free_blocks, active_blocks, inactive_blocks;
    uint32_t cached_hashes;  /* distinct hashes matchable */
} kvb_pool_stats;

typedef struct kvb_block_info {
    kvb_block_state state;
    uint32_t index;
    uint32_t refs;
    uint32_t num_tokens;
    uint32_t priority;
    kvb_hash hash;      /* Registered blocks */
    kvb_hash parent;    /* from init or registration */
} kvb_block_info;

typedef struct kvb_release_opts {
    uint32_t priority;  /* eviction level for blocks that become inactive (0 = evicted first) */
} kvb_release_opts;

typedef struct kvb_pool kvb_pool;

/* ---- hashing ------------------------------------------------------------------------------------ */

/* The sequence hash of one block (section 3). parent NULL = root. extra may be NULL when n_extra = 0.
 * Thread safety: pure function. */
KVB_API kvb_hash kvb_hash_block(const kvb_hash *parent, const uint32_t *tokens, size_t n_tokens,
                                const uint64_t *extra, size_t n_extra, uint64_t salt);

/* Hashes of every full block of `tokens` (n_tokens / block_tokens of them) chained from the root;
 * the same extra keys apply to every block. Writes min(that, max_out) hashes and the count to *out_n.
 * Returns KVB_EINVAL on NULL arguments or block_tokens == 0. Thread safety: pure function. */
KVB_API kvb_result kvb_hash_prompt(const uint32_t *tokens, size_t n_tokens, uint32_t block_tokens,
                                   const uint64_t *extra, size_t n_extra, uint64_t salt,
                                   kvb_hash *out, size_t max_out, size_t *out_n);

/* ---- layout ------------------------------------------------------------------------------------- */

/* A layout from model dimensions: page_bytes = block_tokens * kv_heads * head_dim * dtype_bytes, two
 * parts (K, V). Returns KVB_EINVAL on a NULL out, KVB_ECONFIG on a zero dimension, KVB_EOVERFLOW.
 * Thread safety: pure function. */
KVB_API kvb_result kvb_layout_for_model(kvb_layout_kind kind, uint32_t block_tokens, uint32_t num_layers,
                                        uint32_t kv_heads, uint32_t head_dim, uint32_t dtype_bytes,
                                        kvb_layout *out);

/* Byte offset of (block, layer, part) in a storage of num_blocks blocks with this (resolved) layout.
 * Thread safety: pure function; no range checks (see kvb_block_data for the checked form). */
KVB_API uint64_t kvb_layout_offset(const kvb_layout *layout, uint32_t num_blocks, uint32_t block,
                                   uint32_t layer, uint32_t part);

/* ---- pool --------------------------------------------------------------------------------------- */

/* Create a pool. Returns KVB_EINVAL (NULL arguments), KVB_ECONFIG (a value out of range, half an
 * allocator, missing page_bytes or external memory), KVB_EOVERFLOW, KVB_ENOMEM.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pool_create(const kvb_pool_config *config, kvb_pool **out_pool);

/* Destroy a pool and everything in it, blocks in use included (their handles become invalid). NULL is
 * a no-op. Thread safety: no other call on this pool may run or follow. */
KVB_API void kvb_pool_destroy(kvb_pool *pool);

/* The resolved configuration (defaults filled in). Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pool_get_config(const kvb_pool *pool, kvb_pool_config *out);

/* Counters and set sizes. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pool_get_stats(kvb_pool *pool, kvb_pool_stats *out);

/* Check every invariant: each block in exactly one set, lists and counts consistent, the index holds
 * exactly the matchable blocks, parent counts exact. KVB_OK or KVB_ECORRUPT with a reason in `why`
 * (may be NULL). Cost O(blocks). Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pool_check(kvb_pool *pool, char *why, size_t why_size);

/* Drop every cached block (inactive ones become free; one CLEARED event). KVB_EBUSY, changing
 * nothing, while any block is active. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pool_reset(kvb_pool *pool);

/* Storage of the pool: base address (NULL for metadata-only), total bytes, bytes of one block (all
 * layers and parts), and the resolved layout. Valid for the pool's lifetime.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pool_storage(const kvb_pool *pool, void **out_base, uint64_t *out_bytes,
                                    uint64_t *out_block_bytes, kvb_layout *out_layout);

/* ---- blocks ------------------------------------------------------------------------------------- */

/* Allocate n blocks in state Empty with one reference each, all or nothing: KVB_ENOSPACE (nothing
 * changed) when free plus evictable blocks are fewer than n. KVB_EINVAL on NULL out with n > 0.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_alloc(kvb_pool *pool, size_t n, kvb_block *out);

/* Add one reference to each block (sharing, e.g. a fork). All or nothing.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_retain(kvb_pool *pool, const kvb_block *blocks, size_t n);

/* Drop one reference from each block, last element first (deepest first). A block whose last reference
 * goes becomes inactive (Registered) or free (otherwise). All or nothing: KVB_ESTALE, KVB_EWEAK,
 * KVB_EDOUBLE (more releases than references, also within the array), KVB_ERANGE (priority).
 * opts may be NULL. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_release(kvb_pool *pool, const kvb_block *blocks, size_t n,
                               const kvb_release_opts *opts);

/* State, references, tokens, hashes of a block; accepts strong or weak handles. KVB_ESTALE for a
 * reused block. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_get_info(kvb_pool *pool, uint64_t handle_id, kvb_block_info *out);

/* Empty -> Partial: set the parent hash (NULL = root), tenant salt and extra keys (at most
 * KVB_MAX_EXTRA_KEYS, e.g. a LoRA id or an image hash) that the block's hash will include.
 * Thread safety: safe from any thread (one writer per block). */
KVB_API kvb_result kvb_block_init(kvb_pool *pool, kvb_block block, const kvb_hash *parent, uint64_t salt,
                                  const uint64_t *extra, size_t n_extra);

/* Partial -> Partial / ReadyForScheduling (see the lifecycle table). KVB_ERANGE when the block would
 * exceed block_tokens. Thread safety: safe from any thread (one writer per block). */
KVB_API kvb_result kvb_block_add_tokens(kvb_pool *pool, kvb_block block, const uint32_t *tokens, size_t n,
                                        int ready);

/* ReadyForScheduling -> Inflight. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_schedule(kvb_pool *pool, kvb_block block);
/* ReadyForScheduling -> Partial. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_cancel_schedule(kvb_pool *pool, kvb_block block);
/* Inflight -> Complete (full) or Partial. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_compute_done(kvb_pool *pool, kvb_block block);

/* Complete -> Registered, computing each hash. With KVB_DUP_REJECT a block whose hash is already
 * present is reset and out[i] is the existing block (the reference moves to it); otherwise out[i] =
 * blocks[i]. out may equal blocks. All or nothing. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_register(kvb_pool *pool, const kvb_block *blocks, size_t n, kvb_block *out);

/* Empty -> Registered with given hashes (content computed elsewhere: onboarding, replay); parents may be
 * NULL (all roots). Each block counts block_tokens tokens. Duplicates as kvb_register.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_register_hashed(kvb_pool *pool, const kvb_block *blocks, size_t n,
                                       const kvb_hash *hashes, const kvb_hash *parents, kvb_block *out);

/* Longest cached prefix of the hash chain `hashes`: stops at the first miss; takes a reference on each
 * matched block (taking inactive ones off the eviction list). *out_n = blocks matched.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_match(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks,
                             size_t *out_n);

/* Length of the cached prefix of `hashes` without taking references or counting a lookup (for probes
 * across tiers). Thread safety: safe from any thread. */
KVB_API kvb_result kvb_lookup(kvb_pool *pool, const kvb_hash *hashes, size_t n, size_t *out_n);

/* A weak handle to the same block. Thread safety: pure function. */
KVB_API kvb_weak kvb_weak_of(kvb_block block);

/* Weak -> strong (one new reference): KVB_EGONE once the block was evicted or reset, KVB_EINVAL for a
 * handle that is not weak. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_upgrade(kvb_pool *pool, kvb_weak weak, kvb_block *out);

/* Index of a block in the pool's storage (0 .. num_blocks - 1); UINT32_MAX for none.
 * Thread safety: pure function. */
KVB_API uint32_t kvb_block_index(uint64_t handle_id);

/* Address of (block, layer, part) for a block this caller references. KVB_ENODATA for metadata-only
 * pools, KVB_ERANGE for layer or part out of range. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_data(kvb_pool *pool, kvb_block block, uint32_t layer, uint32_t part,
                                  void **out_ptr);

/* ---- sequences ---------------------------------------------------------------------------------- */

typedef struct kvb_seq kvb_seq;

typedef struct kvb_seq_config {
    uint64_t salt;                      /* tenant isolation */
    const uint64_t *extra;              /* extra keys for every block (copied) */
    size_t n_extra;
} kvb_seq_config;

typedef struct kvb_seq_info {
    size_t num_tokens;     /* appended */
    size_t num_computed;   /* committed or taken from the cache */
    size_t num_cached;     /* tokens that came from cached blocks */
    size_t num_blocks;     /* block table length */
    size_t num_full;       /* full blocks (hashes known) */
} kvb_seq_info;

/* A new empty sequence on `pool`; config may be NULL. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_seq_create(kvb_pool *pool, const kvb_seq_config *config, kvb_seq **out);

/* Release every block (deepest first) and free the sequence. NULL is a no-op. */
KVB_API void kvb_seq_destroy(kvb_seq *seq);

/* Append tokens. While every earlier block came from the cache, blocks that become full are looked up
 * by hash and reused (their tokens count as computed; *out_cached_tokens, may be NULL, gets how many
 * this call reused); the rest go to new blocks. A shared partial last block is copied before it is
 * written. All or nothing: KVB_ENOSPACE changes nothing. Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_append(kvb_seq *seq, const uint32_t *tokens, size_t n, size_t *out_cached_tokens);

/* Mark tokens [0, num_tokens) computed: each block that ends within them goes through
 * ReadyForScheduling, Inflight, compute done; full ones are registered (a duplicate may be replaced by
 * the existing block). KVB_ERANGE past the appended tokens. Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_commit(kvb_seq *seq, size_t num_tokens);

/* A new sequence sharing every block of seq (one more reference each), same tokens and salt.
 * Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_fork(kvb_seq *seq, kvb_seq **out);

/* Keep the first num_tokens tokens (e.g. rejected speculative tokens): blocks past the new end are
 * released; a kept last block that is now partial and shared or registered is replaced by a private
 * copy. KVB_ERANGE past the end. Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_truncate(kvb_seq *seq, size_t num_tokens);

/* The block table (valid until the next call that changes the sequence) and counts. */
KVB_API kvb_result kvb_seq_blocks(const kvb_seq *seq, const kvb_block **out_table, size_t *out_n);
KVB_API kvb_result kvb_seq_get_info(const kvb_seq *seq, kvb_seq_info *out);
/* The tokens (valid until the next call that changes the sequence). */
KVB_API kvb_result kvb_seq_tokens(const kvb_seq *seq, const uint32_t **out_tokens, size_t *out_n);
/* Hashes of the full blocks (valid until the next call that changes the sequence). */
KVB_API kvb_result kvb_seq_hashes(const kvb_seq *seq, const kvb_hash **out_hashes, size_t *out_n);

#ifdef __cplusplus
}
#endif
#endif /* KVBLOCK_H */
