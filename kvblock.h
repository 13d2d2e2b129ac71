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
 * Dynamo's block state diagram labels both exits of Partial "addTokens"; read here as: adding tokens keeps
 * a block Partial while space remains and the caller has more tokens to come (ready = 0); it becomes
 * ReadyForScheduling when the block is full (always) or when the caller says the tokens so far are to be
 * computed now (ready = 1, e.g. the last, partial block of a decode step; n may be 0 for that). Tokens can
 * be added only in Partial. kvb_register_hashed is the import path used by onboarding and trace replay:
 * the bytes were computed elsewhere and arrive with their hash. The last reference to a block that is not
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
 * block it returns; kvb_pin holds the same prefix without counting a use (a request waiting for loads
 * behind it), kvb_unpin lets it go. Duplicate registration (a second block with a
 * hash already present): policy KVB_DUP_ALLOW keeps both (the first stays the one matched; typical for
 * the device tier),
 * KVB_DUP_REJECT hands back the existing block (with a reference) and resets the duplicate; a duplicate
 * someone else also holds (kvb_retain: more references than the caller's) cannot be reset, and is kept
 * behind the first as under KVB_DUP_ALLOW.
 *
 * Eviction: KVB_EVICT_LINEAGE (default) evicts leaves first (blocks no other cached block names as
 * parent), least recently released first; KVB_EVICT_LRU is plain LRU. Every policy keeps one list per
 * priority level (kvb_release_opts.priority; level 0 is evicted first; under a leaves-first policy a
 * leaf of any level goes before a parent of a lower one). kvb_release releases an array
 * deepest first (last element first), so the tail blocks of a request are the first to go, as in vLLM.
 * KVB_EVICT_CUSTOM calls the kvb_evict_ops you give. FOL, ARC and S3-FIFO (below) take their victims
 * among leaves too, so no cached block ever loses its parent.
 *
 * KVB_EVICT_FOL, frequency-offset LRU: the pool's clock counts block references. A release is one
 * request touching its blocks (deepest first): every touched block gets last = clock, then the clock
 * advances by the count. A touch within the horizon H of the previous one raises the block's count
 * (saturating at 255), otherwise resets it to 1; the previous count and time come from the block, or
 * from a ghost table of about the last G evicted hashes: G / 8 sets of 8 (one cache line each), a
 * hash's set fixed by its hash, each set remembering its last 8 evicted hashes (a ghost that comes
 * back leaves its place empty), so that a lookup and a remembering read one line; 8 bytes a ghost,
 * taken from the pool's allocator when it is created. A ghost also carries the age of its eviction
 * (in sixteenths of G evictions), and one evicted more than G evictions ago is forgotten when it comes
 * back: a set fills at its own pace, and without this some ghosts outlived G by half again and more,
 * brought back counts from long ago, and (busy API sessions, README) kept the pool far below what its
 * shadows, which remember exactly the last G, predicted. A ghost keeps a count of at most 7 (above 4 all
 * counts are class 4). Class 0 = seen once and the request's tail block
 * (and a leaf); else class = min(count, 4); self-tuning adds a dead class, a tail the request ended
 * inside (below), always first. One LRU ring per class; the victim is, of the oldest leaf of
 * each ring, the one with the smallest last + W[class]; ties go to the deeper block. With a step s set
 * in the config (fol_class_step > 0), W = {-inf, 0, s, 2 s, 3 s}: class 0 always goes first. A parent
 * is touched whenever its child is, so it scores no lower unless its count restarted (horizon);
 * victims are leaves, so no block is evicted before its cached children. Defaults: no horizon (a count
 * restarts only when neither the block nor its ghost is remembered) and G = 4 x num_blocks, at most
 * 131,072. A large pool exists to catch reuse far apart, so a fixed horizon (formerly 40,000
 * references) or ghost bound (2 x num_blocks, at most 40,000) forgot the counts that matter most there;
 * on the production-like workloads (README, Eviction) these defaults gain more over LRU at every pool
 * size (most at 10,000 blocks and more), and 8 x num_blocks gains nothing more. The cap keeps the
 * table (1 MiB) in cache: uncapped, a pool of a million blocks would look up 32 MiB of ghosts for every
 * new block (kvbench evict_fol_vs_lru about 1.5 -> 1.7); set fol_ghost to remember more. (Issue 6's policy: step 10,000, H 40,000 and
 * G 40,000, set explicitly.)
 *
 * FOL's self-tuning step (fol_class_step = 0, the default). No fixed step suits every workload and pool
 * size: the best one on real traffic runs from 0.3 to 30 times the pool's size, and a wrong one loses
 * to LRU. So the pool measures, by miniature simulation (Waldspurger et al., USENIX ATC 2017; SHARDS,
 * FAST 2015): a fixed spatial sample of block hashes (a mix of the hash below a threshold, so a block is
 * always in or always out) is replayed through 11 metadata-only shadow pools of C x rate blocks (C = the
 * pool's size, rate = min(1, KVB_FOL_SHADOW_BLOCKS / C): every shadow holds 4,096 blocks, all of a
 * smaller pool), one per candidate: step 0 (LRU order) and s = C/4, C/2, C, 2 C, .. 64 C, with
 * W = {-s, 0, s, 2 s, 3 s} (class 0 one step below class 1, so that small steps stay close to LRU) or,
 * once the traffic has shown that tails die (below), W[0] = -inf; the eleventh is the probe (below).
 * Each shadow applies FOL's rules with its own ghosts (G x rate) and counts its hits, halved every 8
 * turnovers. The live pool starts at step C/2 (before its first eviction no step can be judged; on
 * real traffic a step pays more often than not, and the fall-back below bounds the cost where it does
 * not) and takes the best candidate's step when (1) its lead
 * over the current candidate is beyond noise (a paired test: lead - 2 > 2 sqrt(d), d = the sampled
 * blocks one of the two hit and the other missed), (2) some candidate has led so for a quarter of a
 * turnover, and (3) the best one is still gaining (a lead a burst earned in the past does not count).
 * A switch costs: the live pool does not have the shadow's contents. So the pool also counts its own
 * hits on the sampled blocks, and when, a turnover or more after its last switch (the time a new step
 * takes to fill the pool), they fall clearly behind the LRU-order shadow's (the same paired test, with
 * the noise of whole requests: a request's blocks hit or miss together), it goes back to LRU order and
 * waits twice as long before the next switch (the wait decays again).
 * Tails: whether class 0 (a request's deepest block, seen once) should go one step before class 1 or
 * before everything depends on the traffic. The next turn of a chat uses its last full block again; a
 * trace that names every block of a prompt (Mooncake's hash_ids) names its partial last one too, which
 * the next turn fills further, so that tail is rarely used again, and API calls and one-off documents
 * end in blocks nobody asks for again either (README, Eviction: "Dead tails"). The probe runs LRU order
 * with the other rule; when it leads the LRU-order candidate by the same test, for the same dwell, and
 * is still gaining, the pool and every candidate take its rule (the probe and the LRU-order candidate
 * trade tables, nothing is copied, the scores stay) and the probe goes on with the old rule, so traffic
 * that changes can bring it back (each change doubles the probe's wait, which decays as the step's
 * does, so a rule that pays only now and then does not flap). The pool starts with tails one step
 * before class 1;
 * kvb_pool_stats.fol_tails_first reports the rule in use. A caller that knows a request ends inside
 * its last block (a trace's partial last block, which an engine never registers) says so in
 * kvb_release_opts.last_block_tokens: seen once (and a leaf), that block is a dead tail and goes
 * before everything, whatever the rule (it is the tail, so the rule then concerns requests that end
 * on a block boundary; a fixed step takes it for a tail, first anyway). The shadows cost
 * about 22 x rate hash-table operations per registered block released (rate 1 up to 4,096 blocks, 0.1
 * at 40,960, 0.01 at 409,600): a sequential replay through FOL costs 4-15 times one through LRU in pools
 * of 1,000-30,000 blocks (0.2-0.8 us a prompt block, LRU 0.05), and the cycle of a full pool of a
 * million about 1.6-1.8 times LRU's (kvbench evict_fol_vs_lru; README, Numbers). Memory: at most about
 * 14 MiB (pools of 4,096 blocks and more; less below), taken from the pool's allocator when
 * it is created; nothing per reference. A
 * fixed step has no shadows; KVB_FOL_SHADOW_BLOCKS trades their accuracy for their cost.
 * kvb_pool_stats.fol_class_step reports the step in use. Measured on production-like workloads
 * (examples/workloads.h): never more than 0.002 below LRU, and most of the best fixed step's gain where
 * one gains (tests/test_policy_workloads.c, README).
 *
 * KVB_EVICT_ARC, the adaptive replacement cache (Megiddo and Modha, FAST 2003; what vLLM offers for its
 * CPU offload tier): T1 holds blocks seen once recently, T2 blocks seen again (a kvb_match, kvb_upgrade
 * or rejected duplicate of a cached block moves it to T2); ghost lists B1 and B2 remember what each
 * evicted. A new block whose hash is in B1 raises T1's target size p (by max(1, |B2| / |B1|)), one in B2
 * lowers it, and either enters T2. The victim is T1's least recently released leaf while |T1| > p, else
 * T2's; ARC's bounds |T1| + |B1| <= C and all four lists <= 2 C are kept as new blocks come in.
 * kvb_pool_stats gives list_blocks (T1, T2), ghost_blocks (B1, B2) and arc_target (p).
 *
 * KVB_EVICT_S3FIFO (Yang et al., SOSP 2023): a small FIFO queue (a tenth of the pool), a main FIFO
 * queue and a ghost queue of C hashes. New blocks enter the small queue, or the main queue when their
 * hash is a ghost. A hit counts (up to 3) but does not move the block: a block in use keeps its place.
 * While the small queue holds at least a tenth of the pool, its oldest block leaves (into the ghost
 * queue) unless it was hit there, in which case it moves to the main queue; otherwise the main
 * queue's oldest leaves unless its count is above 0 (it goes round again, one count less). Parents are
 * passed over until their children have gone. kvb_pool_stats gives list_blocks (small, main) and
 * ghost_blocks (G).
 *
 * Storage: KVB_STORAGE_NONE (metadata only, for schedulers and simulators: 10M blocks fit in about
 * 1 GiB), KVB_STORAGE_HOST (the pool allocates 4 KiB-aligned memory from the allocator) or
 * KVB_STORAGE_EXTERNAL (you give the memory, e.g. GPU memory from kvcuda). The layout says where
 * (block, layer, part) lives, part 0 = K and 1 = V:
 *   KVB_LAYOUT_BLOCK_CONTIGUOUS: offset = ((block * layers + layer) * parts + part) * page_bytes
 *   KVB_LAYOUT_LAYER_SEPARATE:   offset = ((layer * parts + part) * num_blocks + block) * page_bytes
 *
 * Sequences (kvb_seq): a request's tokens and block table. Append computes block hashes as blocks
 * fill and reuses cached blocks for the prefix; commit runs the lifecycle and registers full blocks
 * (an engine may move a sequence's blocks through Inflight and Complete itself; their tokens stay in
 * the sequence, so kvb_block_add_tokens and kvb_register refuse them with KVB_ESTATE);
 * fork shares every block (beam search); writing to a shared partial block copies it first
 * (copy-on-write, bytes included); truncate drops tokens and the blocks past the new end.
 * Block copies: those two copies (append into a shared partial block, truncate into a shared or
 * registered one) are the only bytes kvblock moves itself. They go through kvb_pool_config.copy_block
 * when it is set, memcpy otherwise; memory the CPU cannot touch (GPU memory) needs the hook, which
 * kvcuda's kvc_pool_create installs (a cudaMemcpyAsync per span on the context's stream, then a wait).
 * A failed copy fails the call with KVB_ECOPY and changes nothing (but the cached block evicted for
 * the copy when the pool had no free one), with one exception: a truncate in a full pool first frees
 * its tail to make room, and then ends at the block boundary below num_tokens.
 *
 * Events: with an event callback, the pool reports when a hash becomes present (STORED), stops being
 * present (REMOVED), or everything is dropped (CLEARED), in batches, once per public call (in parts, none
 * lost, where the memory for a batch ran out).
 *
 * 3. HASHING (fixed; another program can compute the same values)
 *
 * kvb_hash_block(parent, tokens, n, extra, n_extra, salt) -> {lo, hi}. Words are unsigned 64-bit,
 * arithmetic is modulo 2^64, rotl rotates left, and x * y is the full 128-bit product, taken as its
 * (low, high) halves. C[0..15] are the constants in kvb__hk below.
 *   Message: the tokens (32-bit ids) packed two per word, w = t[2i] | t[2i+1] << 32 (an odd last token
 *     has a zero high half), then each extra key as one word, then L = n | n_extra << 32.
 *   Digest (the parent does not enter): a = salt ^ C[8], b = rotl(salt, 32) ^ C[9]. The message is cut
 *     into groups of 8 words (the last group may be shorter; when it has an odd count, a 0 word is
 *     appended). For each group: a = rotl(a, 29), b = rotl(b, 37), then for each pair p = 0, 1, ..
 *     of the group, x and y its words 2p and 2p + 1:
 *         x' = x ^ C[2p], y' = y ^ C[2p + 1], (lo, hi) = x' * y', a += lo ^ y', b += hi ^ x'
 *   Final: x = parent.lo ^ a, y = parent.hi ^ b (the root's parent is {0, 0}), (l, h) = x * C[10],
 *     h += x * C[11] + y * C[10] (so (l, h) = (x, y) * (C[10], C[11]) modulo 2^128), then
 *     hash.lo = F(l ^ h, C[12], C[13]) and hash.hi = F(h, C[14], C[15]), where
 *     F(v, c, d): v ^= v >> 32; v *= c; v ^= v >> 29; v *= d; v ^= v >> 32.
 * So a 16-token block is two groups: its 8 token words, then (L, 0). Only the final step (about 20
 * cycles: one multiply layer, then the two F side by side) waits for the parent: in a chain
 * (kvb_hash_prompt, a sequence's blocks) the CPU digests a block while it still finishes the one
 * before. For a given message, distinct parents give distinct hashes (the final step is a bijection
 * of the parent); every output bit depends on every input bit; and each product carries the other
 * factor (lo ^ y', hi ^ x'), so a zero factor loses nothing.
 * Test vectors (checked by tests/test_hash.c; H1 and H7 are the second and third):
 *     parent 0, salt 0, tokens {}                  lo 0x237de0d3c7615ee3  hi 0xde132dd3b565387b
 *     parent 0, salt 0, tokens {0..15}             lo 0x45e8de8b7c892644  hi 0x8099931b7326f7ac
 *     parent 0, salt 7, tokens {0..15}             lo 0x4f0aa23360eabece  hi 0x52360e9a53096b1e
 *     parent H1, salt 0, tokens {0..15}            lo 0xa6427d87e40c323a  hi 0xed54198121b834f2
 *     parent 0, salt 0, tokens {0..15}, extra {7}  lo 0xaa5eff9efd34af3d  hi 0xc95504eb209cdccd
 *     parent 0, salt 0, tokens {0..4}              lo 0xfc85a53e2ddd558c  hi 0x14dc44751d20a9ed
 * The hash changed in 0.2.0 (0.1 chained the parent through every step): hashes computed by 0.1 match
 * nothing in 0.2. What is keyed by them outside a process is versioned so that old entries are only
 * misses (kvoffload.h's disk slots and kvremote.h's values, format 2).
 * A different hash can be plugged in with kvb_pool_config.hash_fn.
 *
 * 4. CONFIGURATION MACROS (define before the implementation)
 *     KVB_STATIC              make every function static (private to one translation unit)
 *     KVB_API                 declaration prefix (default extern)
 *     KVB_MALLOC(sz) / KVB_REALLOC(p, sz) / KVB_FREE(p)   all three or none: the default allocator
 *                             and every internal array (stb_ds); the runtime kvb_allocator in the
 *                             config, when given, serves the pool's metadata and storage. Internal
 *                             arrays and tables only grow, to what the workload needs at most, so
 *                             serving it again allocates nothing (tests/test_steady_alloc.c).
 *     KVB_MAX_EXTRA_KEYS      extra hash keys per block (default 8)
 *     KVB_NO_INT128           hash with the portable 128-bit product (four 32 x 32-bit products) even
 *                             where the compiler has unsigned __int128: the same values, slower
 *     KVB_FOL_SHADOW_BLOCKS   FOL self-tuning: blocks each shadow pool holds (default 4,096; section 2)
 *     KVB_FOL_GHOST_MAX       the largest fol_ghost a pool accepts (default 2^28: a 2 GiB table)
 *     KVB_NO_HUGE_PAGES       do not ask Linux for transparent huge pages (madvise) for the tables of
 *                             2 MiB or more the default allocator gives a pool (metadata, index,
 *                             storage); asked by default, it spares a cold lookup most of its TLB misses
 *                             (never asked with KVB_MALLOC defined: that memory is not the C library's)
 *
 * 5. THREAD SAFETY
 * A pool is safe to use from any number of threads: one mutex per pool, taken once per call, so batch
 * calls (arrays of blocks) keep the lock cost per block small. Event callbacks run with that mutex held
 * and must not call back into the same pool. A kvb_seq is used by one thread at a time.
 *
 * 6. ERRORS
 * Every function returns a kvb_result: KVB_OK (0) or a negative code; kvb_result_string names it.
 * A call that fails changes nothing. Out of memory (KVB_MALLOC / KVB_REALLOC returning NULL) included:
 * the sequence calls and kvb_request_begin take the memory they need (arrays, mutable block states,
 * room for their events) before they change anything, and return KVB_ENOMEM
 * (tests/test_oom.c fails each of their allocations in turn).
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
#ifndef KVBLOCK_H
#define KVBLOCK_H
#define KVBLOCK_VERSION_MAJOR 0
#define KVBLOCK_VERSION_MINOR 2
#define KVBLOCK_VERSION_PATCH 0

#include <stddef.h>
#include <stdint.h>

#ifndef KVB_API
#ifdef KVB_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define KVB_API static __attribute__((unused)) /* a program need not call every function */
#else
#define KVB_API static
#endif
#else
#define KVB_API extern
#endif
#endif

#ifndef KVB_MAX_EXTRA_KEYS
#define KVB_MAX_EXTRA_KEYS 8
#endif

#ifndef KVB_FOL_GHOST_MAX
#define KVB_FOL_GHOST_MAX (UINT32_C(1) << 28) /* largest kvb_pool_config.fol_ghost: a 2 GiB ghost table */
#endif
#ifndef KVB_FOL_SHADOW_BLOCKS
#define KVB_FOL_SHADOW_BLOCKS 4096 /* FOL self-tuning: blocks each shadow pool holds (section 2) */
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
    X(KVB_ECORRUPT, -14,  "pool invariant violated")                             \
    X(KVB_ECOPY,    -15,  "the pool's copy_block hook failed")

#define KVB__ENUM_ITEM(name, value, text) name = value,
typedef enum kvb_result { KVB__RESULTS(KVB__ENUM_ITEM) KVB__RESULT_MIN = -16 } kvb_result;
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
    KVB_EVICT_FOL,         /* frequency-offset LRU, self-tuning by default (see section 2) */
    KVB_EVICT_ARC,         /* adaptive replacement cache (Megiddo and Modha), leaves first */
    KVB_EVICT_S3FIFO,      /* S3-FIFO (Yang et al., SOSP 2023): small, main and ghost FIFO queues, leaves first */
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

/* Receives events in batches, at most once per public call (more often only where the memory for the
 * batch ran out: then it comes in parts, none lost), with the pool's mutex held. */
typedef void (*kvb_event_fn)(const kvb_event *events, size_t n, void *user);

/* Replacement block hash: must be deterministic and write *out. Sequence appends call it outside the
 * pool's lock, so it may run on several threads at once (one per sequence). */
typedef void (*kvb_hash_fn)(const kvb_hash *parent, const uint32_t *tokens, size_t n_tokens,
                            const uint64_t *extra, size_t n_extra, uint64_t salt, kvb_hash *out, void *user);

/* Custom eviction: the pool tells which blocks became evictable and which stopped being so, and asks
 * for a victim among the evictable ones (return its index, or UINT32_MAX for none). A refusal makes
 * kvb_alloc fail with KVB_ENOSPACE, giving back the blocks it took (blocks it evicted before the
 * refusal stay evicted); sequences expect a victim whenever one is evictable. */
typedef struct kvb_evict_ops {
    void (*on_inactive)(void *user, uint32_t index, uint32_t priority);
    void (*on_removed)(void *user, uint32_t index);
    uint32_t (*choose_victim)(void *user);
    void *user;
} kvb_evict_ops;

/* Copies one block's bytes to another block of the same pool (kvb_pool_config.copy_block): n spans of
 * `bytes` each, src[i] to dst[i] (one span, the whole block, in a block-contiguous pool; one per
 * (layer, part) page in a layer-separate one). The addresses are in the pool's storage, so for device
 * memory they are device addresses. Return 0 when the bytes are in place, nonzero on failure. Called
 * with the pool's lock held: it must not call the pool. */
typedef int (*kvb_copy_block_fn)(void *user, void *const *dst, const void *const *src, size_t n, uint64_t bytes);

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
    kvb_copy_block_fn copy_block; /* storage: copies for sequence copy-on-write; default memcpy */
    void *copy_user;            /* passed to copy_block */
    kvb_allocator allocator;    /* default: KVB_MALLOC / KVB_FREE */
    kvb_event_fn on_events;     /* optional */
    void *event_user;
    kvb_hash_fn hash_fn;        /* default kvb_hash_block */
    void *hash_user;
    kvb_evict_ops custom_eviction; /* with KVB_EVICT_CUSTOM */
    uint32_t fol_horizon;       /* KVB_EVICT_FOL: H in block references, default none (UINT32_MAX) */
    uint32_t fol_ghost;         /* G: evicted hashes remembered, default 4 x num_blocks up to 131,072;
                                   KVB_FOL_GHOST_MAX at most (8 bytes each) */
    uint32_t fol_class_step;    /* W[c] = (c - 1) * step for classes 1..4; 0 (default): adapted online */
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
    uint32_t fol_class_step; /* KVB_EVICT_FOL: the class step in use (chosen online when the config's is 0) */
    uint32_t fol_tails_first; /* KVB_EVICT_FOL: 1 when class 0 (a request's tail, seen once) goes before every
                                 other class (always with a fixed step; chosen online when the step is) */
    uint32_t list_blocks[2]; /* ARC: registered blocks in T1, T2; S3-FIFO: in the small, main queue */
    uint32_t ghost_blocks[2]; /* evicted hashes remembered: FOL: ghosts, 0; ARC: B1, B2; S3-FIFO: G, 0 */
    uint32_t arc_target;     /* ARC: p, the target size of T1 (ARC's adaptation) */
    uint64_t invalidated;    /* blocks dropped by kvb_invalidate */
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

typedef struct kvb_release_opts { /* zero it first (memset, or designated initializers): fields may be added */
    uint32_t priority;  /* eviction level for blocks that become inactive (0 = evicted first) */
    uint32_t last_block_tokens; /* the request ends inside its last block, after this many of its tokens
                                   (a trace's partial last block): only the same prompt can use it again,
                                   so self-tuning FOL evicts it first (section 2) when it is the last
                                   element, registered, a leaf and seen once. 0 or block_tokens: it ends
                                   on a block boundary */
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
 * exactly the matchable blocks, parent counts exact, and FOL's shadow pools sound. KVB_OK or
 * KVB_ECORRUPT with a reason in `why` (may be NULL). Cost O(blocks + shadow blocks). Thread safety:
 * safe from any thread. */
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
 * KVB_EDOUBLE (more releases than references, also within the array), KVB_ERANGE (priority, or
 * last_block_tokens above block_tokens). opts may be NULL. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_release(kvb_pool *pool, const kvb_block *blocks, size_t n,
                               const kvb_release_opts *opts);

/* State, references, tokens, hashes of a block; accepts strong or weak handles. A reused block:
 * KVB_ESTALE for a strong handle, KVB_EGONE for a weak one. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_get_info(kvb_pool *pool, uint64_t handle_id, kvb_block_info *out);

/* Empty -> Partial: set the parent hash (NULL = root), tenant salt and extra keys (at most
 * KVB_MAX_EXTRA_KEYS, e.g. a LoRA id or an image hash) that the block's hash will include.
 * Thread safety: safe from any thread (one writer per block). */
KVB_API kvb_result kvb_block_init(kvb_pool *pool, kvb_block block, const kvb_hash *parent, uint64_t salt,
                                  const uint64_t *extra, size_t n_extra);

/* Partial -> Partial / ReadyForScheduling (see the lifecycle table). KVB_ERANGE when the block would
 * exceed block_tokens; KVB_ESTATE for a sequence's block (kvb_seq_append fills it). Thread safety: safe
 * from any thread (one writer per block). */
KVB_API kvb_result kvb_block_add_tokens(kvb_pool *pool, kvb_block block, const uint32_t *tokens, size_t n,
                                        int ready);

/* ReadyForScheduling -> Inflight. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_schedule(kvb_pool *pool, kvb_block block);
/* ReadyForScheduling -> Partial. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_cancel_schedule(kvb_pool *pool, kvb_block block);
/* Inflight -> Complete (full) or Partial. Thread safety: safe from any thread. */
KVB_API kvb_result kvb_block_compute_done(kvb_pool *pool, kvb_block block);

/* Complete -> Registered, computing each hash. With KVB_DUP_REJECT a block whose hash is already
 * present is reset and out[i] is the existing block (the reference moves to it), unless the block has
 * other references than the caller's (then it is kept, as under KVB_DUP_ALLOW); otherwise out[i] =
 * blocks[i]. out may equal blocks. All or nothing: KVB_ENOMEM (nothing changed) when there is no memory
 * to count children whose parent is not cached (a leaves-first policy keeps such counts). KVB_ESTATE
 * for a sequence's block (kvb_seq_commit registers it). Thread safety: safe from any thread. */
KVB_API kvb_result kvb_register(kvb_pool *pool, const kvb_block *blocks, size_t n, kvb_block *out);

/* Empty -> Registered with given hashes (content computed elsewhere: onboarding, replay); parents may be
 * NULL (all roots). Each block counts block_tokens tokens. Duplicates and KVB_ENOMEM as kvb_register. Any
 * 128-bit values will do, sequence numbers included: the pool mixes them before it places them.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_register_hashed(kvb_pool *pool, const kvb_block *blocks, size_t n,
                                       const kvb_hash *hashes, const kvb_hash *parents, kvb_block *out);

/* Longest cached prefix of the hash chain `hashes`: stops at the first miss; takes a reference on each
 * matched block (taking inactive ones off the eviction list). *out_n = blocks matched.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_match(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks,
                             size_t *out_n);

/* The same prefix as kvb_match, with a reference on each matched block (so it cannot be evicted), but
 * not a use: no lookup or hit is counted and the policy counts nothing (ARC and S3-FIFO no hit; FOL no
 * use at kvb_unpin). For blocks a request will match later, held meanwhile (an engine waiting for loads
 * behind a cached prefix: vLLM holds them too); let them go with kvb_unpin. A block that was idle and
 * is idle again after kvb_unpin has its place in the eviction order as if released then (S3-FIFO: kept).
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_pin(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks,
                           size_t *out_n);

/* Let go of pins (kvb_pin): kvb_release's work and errors, but not a use (FOL does not count it); a block
 * whose last reference goes becomes inactive, as released now, at its level: the one of the last
 * kvb_release of it (also one while the pin was held), else the one it had when it last became inactive.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_unpin(kvb_pool *pool, const kvb_block *blocks, size_t n);

/* A request's prompt in one call (one lock, one pass): what kvb_match of `hashes`, kvb_alloc of the
 * blocks it did not match and kvb_register_hashed of them (each block's parent the hash before it, the
 * first one's the root) would do in a row. out_blocks gets all n blocks, each with a reference for the
 * caller (kvb_release them when the request ends); *out_cached = how many were matched. All or nothing:
 * KVB_ENOSPACE when the blocks not matched do not fit, KVB_ENOMEM out of memory (nothing changed, no
 * lookup counted); KVB_EINVAL on NULL arguments and for KVB_EVICT_CUSTOM pools (their policy may refuse
 * a victim halfway).
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_request_begin(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks,
                                     size_t *out_cached);

/* Length of the cached prefix of `hashes` without taking references or counting a lookup (for probes
 * across tiers). Thread safety: safe from any thread. */
KVB_API kvb_result kvb_lookup(kvb_pool *pool, const kvb_hash *hashes, size_t n, size_t *out_n);

/* Which of `hashes` are cached, each on its own (not only the prefix): present[i] = 1 or 0; the count
 * goes to *out_count (may be NULL). No references, no lookup counted. Thread safety: any thread. */
KVB_API kvb_result kvb_presence(kvb_pool *pool, const kvb_hash *hashes, size_t n, uint8_t *present,
                                size_t *out_count);

/* Drop the cached blocks of `hashes` that nobody holds, as an eviction would (out of the index, back
 * to the free set, every handle to them stale) but remembering nothing of them (no ghost): for entries
 * whose bytes are known bad (a lower tier's copy that failed its checksum) or stale. A block in use
 * stays cached until it is released; a hash not cached is skipped; duplicates of a hash go too. Cached
 * children of a dropped block stay, as they would after their parent's eviction. *out_dropped (may be
 * NULL): the blocks dropped. KVB_EINVAL for NULL hashes with n > 0. Thread safety: any thread. */
KVB_API kvb_result kvb_invalidate(kvb_pool *pool, const kvb_hash *hashes, size_t n, size_t *out_dropped);

/* Weak handles to the next (up to) max inactive blocks in eviction order, soonest first: what a lazy
 * offloader should copy down before they go. The order is the policy's, as the next evictions would
 * take them with no request in between (S3-FIFO's promotions and rounds included), but a parent is
 * listed where its own place puts it: an eviction passes over it while a child of it is cached.
 * For KVB_EVICT_CUSTOM: KVB_EINVAL.
 * Thread safety: safe from any thread. */
KVB_API kvb_result kvb_eviction_candidates(kvb_pool *pool, size_t max, kvb_weak *out, size_t *out_n);

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

/* Release every block as kvb_seq_destroy does and start over, empty, with `config` (may be NULL),
 * keeping the sequence's memory: whoever reuses sequences allocates nothing once they are large enough.
 * KVB_EINVAL / KVB_ERANGE as kvb_seq_create (nothing changed). Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_reset(kvb_seq *seq, const kvb_seq_config *config);

/* Make room in the sequence's arrays for num_tokens tokens in all (with their blocks and hashes):
 * appends up to there do not grow them. KVB_EINVAL for NULL, KVB_ERANGE for a count no memory could
 * hold, KVB_ENOMEM when the memory is not there (the sequence unchanged, but some room may be kept).
 * Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_reserve(kvb_seq *seq, size_t num_tokens);

/* Append tokens. While every earlier block came from the cache, blocks that become full are looked up
 * by hash and reused (their tokens count as computed; *out_cached_tokens, may be NULL, gets how many
 * this call reused); the rest go to new blocks. A shared partial last block is copied before it is
 * written (the pool's copy_block). All or nothing: KVB_ENOSPACE, KVB_ENOMEM and KVB_ECOPY change
 * nothing; KVB_ERANGE (nothing changed) for more tokens in all than kvb_seq_reserve takes.
 * Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_append(kvb_seq *seq, const uint32_t *tokens, size_t n, size_t *out_cached_tokens);

/* Append tokens the engine will compute, as kvb_seq_append does but never from the cache: their blocks
 * are new (or the partial last block) even where the cache holds them, and no block after them is
 * looked up either. For a prompt's last token, which an engine computes for its logits: with one token
 * a block, kvb_seq_append would match that token's block when the whole prompt is cached, and the
 * engine would write into a registered block another request may share. Errors as kvb_seq_append's.
 * Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_append_new(kvb_seq *seq, const uint32_t *tokens, size_t n);

/* Mark tokens [0, num_tokens) computed: each block that ends within them goes through
 * ReadyForScheduling, Inflight, compute done; full ones are registered (a duplicate may be replaced by
 * the existing block). KVB_ERANGE past the appended tokens; KVB_ENOMEM (nothing changed) when a pool
 * with an event callback has no memory for the events, or there is none to count orphaned children
 * (kvb_register). Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_commit(kvb_seq *seq, size_t num_tokens);

/* Batches for an engine's step (e.g. one sampled token for each decoding request): the pool is locked
 * once for all of them, and sequence i gets what kvb_seq_append(seqs[i], tokens[i], counts[i], NULL) or
 * kvb_seq_commit(seqs[i], num_tokens[i]) would do, in order. Every sequence must be on the same pool.
 * append_many stops at the first sequence whose append fails (its result is returned; it and the
 * ones after it are unchanged); *out_done = the sequences appended. commit_many checks every count
 * first (KVB_ERANGE, nothing changed), and the memory for its events (KVB_ENOMEM, nothing changed).
 * KVB_EINVAL on NULL arguments, sequences of different pools or a sequence that comes twice.
 * Thread safety: one thread per sequence; the pool serialises the batch with its other calls. */
KVB_API kvb_result kvb_seq_append_many(kvb_seq *const *seqs, const uint32_t *const *tokens, const size_t *counts,
                                       size_t n, size_t *out_done);
KVB_API kvb_result kvb_seq_commit_many(kvb_seq *const *seqs, const size_t *num_tokens, size_t n);

/* A new sequence sharing every block of seq (one more reference each), same tokens and salt.
 * KVB_ENOMEM: nothing changed, *out not written. Thread safety: one thread per sequence. */
KVB_API kvb_result kvb_seq_fork(kvb_seq *seq, kvb_seq **out);

/* Keep the first num_tokens tokens (e.g. rejected speculative tokens): blocks past the new end are
 * released; a kept last block that is now partial and shared or registered is replaced by a private
 * copy (the pool's copy_block). KVB_ERANGE past the end; KVB_ENOMEM (nothing changed); KVB_ECOPY when
 * the copy failed (see section 2, Block copies). Thread safety: one thread per sequence. */
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

/* ================================================================================================ */
/*                                        IMPLEMENTATION                                            */
/* ================================================================================================ */
#if defined(KVBLOCK_IMPLEMENTATION) || defined(KVCACHE_IMPLEMENTATION)
#ifndef KVBLOCK_IMPL_INCLUDED
#define KVBLOCK_IMPL_INCLUDED

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h> /* FOL's ghost sets are searched 4 tags at a time */
#endif

#if defined(KVB_MALLOC) || defined(KVB_REALLOC) || defined(KVB_FREE)
#if !defined(KVB_MALLOC) || !defined(KVB_REALLOC) || !defined(KVB_FREE)
#error "kvblock.h: define all of KVB_MALLOC, KVB_REALLOC and KVB_FREE, or none"
#endif
#else
#define KVB_MALLOC(sz) malloc(sz)
#define KVB_REALLOC(p, sz) realloc(p, sz)
#define KVB_FREE(p) free(p)
#if defined(__linux__) && !defined(KVB_NO_HUGE_PAGES)
#include <sys/mman.h>
#ifdef MADV_HUGEPAGE
#define KVB__HUGE_PAGES 1 /* the C library's own memory: large tables may ask for transparent huge pages */
#endif
#endif
#endif

/* stb_ds, private to this translation unit: its functions are renamed and declared static before the
 * include (a later `extern` keeps the internal linkage), so it never clashes with a user's own copy. */
#ifndef INCLUDE_STB_DS_H
#ifdef __cplusplus
extern "C" {
#endif
struct stbds_string_arena;
static void *kvb__stbds_arrgrowf(void *a, size_t elemsize, size_t addlen, size_t min_cap);
static void kvb__stbds_arrfreef(void *a);
static void kvb__stbds_hmfree_func(void *p, size_t elemsize);
static void *kvb__stbds_hmget_key(void *a, size_t elemsize, void *key, size_t keysize, int mode);
static void *kvb__stbds_hmget_key_ts(void *a, size_t elemsize, void *key, size_t keysize, ptrdiff_t *temp,
                                     int mode);
static void *kvb__stbds_hmput_default(void *a, size_t elemsize);
static void *kvb__stbds_hmput_key(void *a, size_t elemsize, void *key, size_t keysize, int mode);
static void *kvb__stbds_hmdel_key(void *a, size_t elemsize, void *key, size_t keysize, size_t keyoffset,
                                  int mode);
static void *kvb__stbds_shmode_func(size_t elemsize, int mode);
static void kvb__stbds_rand_seed(size_t seed);
static size_t kvb__stbds_hash_bytes(void *p, size_t len, size_t seed);
static size_t kvb__stbds_hash_string(char *str, size_t seed);
static char *kvb__stbds_stralloc(struct stbds_string_arena *a, char *str);
static void kvb__stbds_strreset(struct stbds_string_arena *a);
#ifdef __cplusplus
}
#endif
#define stbds_arrgrowf kvb__stbds_arrgrowf
#define stbds_arrfreef kvb__stbds_arrfreef
#define stbds_hmfree_func kvb__stbds_hmfree_func
#define stbds_hmget_key kvb__stbds_hmget_key
#define stbds_hmget_key_ts kvb__stbds_hmget_key_ts
#define stbds_hmput_default kvb__stbds_hmput_default
#define stbds_hmput_key kvb__stbds_hmput_key
#define stbds_hmdel_key kvb__stbds_hmdel_key
#define stbds_shmode_func kvb__stbds_shmode_func
#define stbds_rand_seed kvb__stbds_rand_seed
#define stbds_hash_bytes kvb__stbds_hash_bytes
#define stbds_hash_string kvb__stbds_hash_string
#define stbds_stralloc kvb__stbds_stralloc
#define stbds_strreset kvb__stbds_strreset
#define stbds_unit_tests kvb__stbds_unit_tests
#define STBDS_NO_SHORT_NAMES
#define STBDS_REALLOC(c, p, s) KVB_REALLOC(p, s)
#define STBDS_FREE(c, p) KVB_FREE(p)
#define STB_DS_IMPLEMENTATION
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-conversion"
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wshadow"
#endif
#include <stb_ds.h>
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef STB_DS_IMPLEMENTATION
#endif /* INCLUDE_STB_DS_H */
/* stb_ds passes a ptrdiff_t offset as size_t (clang -Wsign-conversion); the same value, cast. */
#undef STBDS_OFFSETOF
#define STBDS_OFFSETOF(var, field) ((size_t)((char *)&(var)->field - (char *)(var)))

/* stb_ds's hmput/hmget use `typeof` under gcc, which strict -std=c11 does not have. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__cplusplus) && defined(__STRICT_ANSI__) && \
    !defined(typeof)
#define typeof __typeof__
#define KVB__DEFINED_TYPEOF
#endif

#if defined(__GNUC__) || defined(__clang__)
/* The empty volatile asm keeps a helper that only prefetches from being taken for a pure function:
 * gcc deletes calls to those whose result is unused, prefetches and all. */
#define KVB__PREFETCH(p)                 \
    do {                                 \
        __builtin_prefetch(p);           \
        __asm__ __volatile__("");        \
    } while (0)
#define KVB__LIKELY(x) __builtin_expect(!!(x), 1)
#define KVB__UNLIKELY(x) __builtin_expect(!!(x), 0)
#define KVB__NOINLINE __attribute__((noinline))
#define KVB__ALWAYS_INLINE inline __attribute__((always_inline)) /* per block on a hot path, grown past */
                                                                /* what GCC inlines by itself */
/* v is computed here, in a register; no instruction. Without it GCC defers each product's fold in
 * kvb__hpair to the end of its group and holds four 128-bit products at once (spills, 15% slower). */
#define KVB__KEEP(v) __asm__("" : "+r"(v))
#else
#define KVB__PREFETCH(p) ((void)(p))
#define KVB__LIKELY(x) (x)
#define KVB__UNLIKELY(x) (x)
#define KVB__NOINLINE
#define KVB__ALWAYS_INLINE inline
#define KVB__KEEP(v) ((void)0)
#endif

/* Helpers on the per-block path of the batch calls are `static inline`: as calls (registers saved and
 * restored per block) they were about a fifth of a block cycle's instructions. */
#define KVB__NIL UINT32_MAX
/* Shrink an stb_ds array (stbds_arrsetlen also grows, and warns under -Wtype-limits for 0). */
#define KVB__ARR_SHRINK(a, n) ((a) ? (void)(stbds_header(a)->length = (size_t)(n)) : (void)0)
#define KVB__GEN_MASK UINT32_C(0x7fffffff)
#define KVB__MAX_LEVELS 16
#define KVB__MAX_BLOCK_TOKENS 32768
#define KVB__STORAGE_ALIGN 4096
#define KVB__LEAF_PENDING 8     /* new leaves a ring remembers behind its leaf search's place */
#define KVB__S3_SCAN_LIMIT 4096 /* S3-FIFO: blocks one victim search may pass (promote, requeue, skip) */
#define KVB__CLASSES 6     /* FOL classes; other policies use class 0 (ARC, S3-FIFO: and 1) */
#define KVB__CLS_DEAD 5    /* FOL, self-tuning: a request's partial last block, seen once: first out */
#define KVB__TAIL_DEAD 2   /* FOL touches: the block is the request's partial last block (1: its tail) */
/* FOL's self-tuning (section 2): private constants, overridable only to experiment. */
#define KVB__TUNE_LADDER 10  /* candidates: LRU order, then steps C/4, C/2, .. 64 C */
#define KVB__TUNE_PROBE 10   /* and the probe: LRU order with the other rule for tails */
#define KVB__TUNE_K 11       /* shadows in all */
#ifndef KVB__TUNE_START
#define KVB__TUNE_START 2    /* the candidate used until the shadows know better: step C/2 */
#endif
#ifndef KVB__TUNE_TAILS_START
#define KVB__TUNE_TAILS_START 0 /* the rule for tails used until the probe knows better: 1 = tails first */
#endif
#ifndef KVB__TUNE_MEMORY
#define KVB__TUNE_MEMORY 8   /* scores halve every 8 turnovers of a shadow */
#endif
#ifndef KVB__TUNE_MIN_CAP
#define KVB__TUNE_MIN_CAP 1024 /* .. counted as for a shadow of at least 1,024 blocks: small pools turn over
                                  within a few requests, too few to tell candidates apart */
#endif
#ifndef KVB__TUNE_Z
#define KVB__TUNE_Z 2.0      /* a candidate leads when it has 2 + 2 sqrt(d) more hits than the current one,
                                d = the blocks one of the two hit and the other missed (a paired test) */
#endif
#ifndef KVB__TUNE_DWELL
#define KVB__TUNE_DWELL 0.25 /* .. takes over when some candidate has led for a quarter of a turnover .. */
#endif
#ifndef KVB__TUNE_GAIN
#define KVB__TUNE_GAIN 0.0   /* .. and the best one is still gaining on the current one */
#endif
#ifndef KVB__TUNE_CAUTION
#define KVB__TUNE_CAUTION 2.0 /* the wait doubles each time switching fell behind LRU order */
#endif

/* meta flags */
#define KVB__F_INDEXED 1u  /* the block the index points to for its hash */
#define KVB__F_DUP 2u      /* registered, same hash as an indexed block, chained from it */
#define KVB__F_INACTIVE 4u /* on an eviction list (refs == 0, registered) */
#define KVB__F_MARK 8u     /* scratch for argument validation */
#define KVB__F_QUEUED 16u  /* S3-FIFO: in use, and its ring entry keeps its place for when it is released */
#define KVB__F_SAMPLED 32u /* FOL self-tuning: registered, and its hash is in the shadows' sample */
#define KVB__F_SEQ 64u     /* a sequence's block, not yet registered: its tokens are the sequence's (no
                              mutable state), and only its sequence changes it */
#define KVB__S_FREE 0      /* state of a block in the free set */

typedef struct kvb__meta { /* one cache line per block */
    kvb_hash hash;
    kvb_hash parent;
    uint32_t stamp;      /* which eviction-ring entry is current */
    uint32_t last;       /* FOL: clock at the last touch */
    uint32_t refs;
    uint32_t gen;
    uint32_t dup_next;   /* next block with the same hash */
    uint16_t ntok;
    uint8_t state;
    uint8_t prio;
    uint8_t flags;
    uint8_t cnt, cls;    /* FOL: saturating reference count, class 0..4 (KVB__CLS_DEAD: 5) */
    uint8_t depth;       /* FOL: position in the request that touched it last, up to 255 (ties) */
    uint32_t kids;       /* indexed blocks: registered blocks naming its hash as parent (leaf-first policies) */
} kvb__meta;
typedef char kvb__meta_is_one_cache_line[sizeof(kvb__meta) == 64 ? 1 : -1];

/* An index slot: the low 32 bits of the hash's mix (its home slot and a filter: the metadata confirms a match)
 * and the block, index + 1 (0 = empty). 8 bytes, so the index is sparse (load <= 1/3, short probes and
 * short deletion shifts) in the memory a denser one with wider slots would take. */
typedef struct kvb__slot { uint32_t tag; uint32_t ref; } kvb__slot;

typedef struct kvb__mut { /* what a mutable block needs until it is registered */
    uint64_t salt;
    uint32_t n_extra;
    uint64_t extra[KVB_MAX_EXTRA_KEYS];
    uint32_t tokens[1];
} kvb__mut;


/* Eviction order of one priority level and class: an array of (block, stamp) in release order, oldest
 * at head. A block taken back or evicted leaves a stale entry behind (no longer inactive, or its stamp
 * moved on), skipped when met and dropped by compaction. Unlike a linked list, the next victims sit
 * next to each other, so their metadata can be prefetched. An entry's stamp is its position plus the
 * ring's base, so a block's stamp also says where its entry is (compaction renumbers). */
typedef struct kvb__ring_entry { uint32_t idx, stamp; } kvb__ring_entry;
typedef struct kvb__ring {
    kvb__ring_entry *e; /* stb_ds array; live part [head, len) */
    size_t head;
    uint32_t base;      /* e[i].stamp == base + i */
    uint32_t id;        /* its place in the pool's rings: a block's entry is valid in its own ring only */
    uint32_t live;      /* inactive blocks at this level */
    uint32_t held;      /* S3-FIFO: entries kept for blocks in use, at the last compaction */
    size_t leafless_to; /* entries before it are stale, parents or pending: a leaf search resumes there */
    uint32_t pending[KVB__LEAF_PENDING]; /* stamps of blocks before leafless_to that turned into leaves */
    uint32_t n_pending;
} kvb__ring;
typedef struct kvb__kid_entry { kvb_hash key; uint32_t value; } kvb__kid_entry;
typedef struct kvb__count { kvb_hash key; uint32_t count; } kvb__count; /* count 0 = empty */
typedef struct kvb__ctab { /* a count per hash: open addressing on the hash; grows, never shrinks */
    kvb__count *e;
    uint64_t mask;
    uint32_t used;
} kvb__ctab;
typedef struct kvb__ghost { kvb_hash hash; uint8_t live; } kvb__ghost;
/* A ghost-index slot: the hash's low 32 bits (its home and a filter, so probes and deletions read no
 * ghost but the one they are after) and its circle position + 1, 0 = empty. */
typedef struct kvb__gslot { uint32_t lo32, ref; } kvb__gslot;
#define KVB__T1 0 /* ARC: seen once recently; S3-FIFO: the small queue */
#define KVB__T2 1 /* ARC: seen at least twice; S3-FIFO: the main queue */
typedef struct kvb__gset { /* evicted hashes remembered: a circle in eviction order and an index */
    kvb__ghost *e;
    kvb__gslot *index;    /* open addressing on the hash (at most 2^32 slots: lo32 is the home) */
    uint64_t mask;
    uint32_t cap, pos, live, skip; /* pos: where the next one goes (the oldest is there or after it) */
} kvb__gset;
/* FOL's ghosts: sets of up to KVB__GWAYS words, one cache line each, newest first; a word is
 * (last << 32) | (tag << 9) | (age stamp << 3) | count (1..7), 0 = empty. */
#define KVB__GWAYS 8 /* kvb__gtab_way writes out a set of 8 */
#define KVB__GCOUNT_MAX 7   /* counts above 4 all mean class 4 */
#define KVB__GAGE_LIMIT 16  /* a ghost is remembered for 16 stamps of G / 16 puts each */
typedef struct kvb__gtab {
    uint64_t *w;
    uint32_t sets, ways, live;
    uint32_t stamp;        /* the age stamp of the next put: one more every per_stamp puts (mod 64) */
    uint32_t per_stamp, until_next;
} kvb__gtab;

/* FOL's self-tuning (section 2): a shadow node is a sampled block, resident (where 1) or a ghost (2). */
typedef struct kvb__tnode {
    uint64_t key;              /* kvb__mix of the block's hash */
    uint32_t last, prev, next; /* clock at the last touch; class list links */
    uint32_t gpos;             /* ghosts: their place in the circle */
    uint8_t cnt, cls, depth, where;
} kvb__tnode;
typedef struct kvb__shadow { /* what a victim search reads first */
    kvb__tnode *node;
    kvb__gslot *index;         /* open addressing on key: its low 32 bits (home and filter), node + 1;
                                  slot s at index[s * KVB__TUNE_K] (kvb__tuner.index) */
    uint32_t classes;          /* bit c: class c's list is not empty */
    uint32_t resident;
    uint32_t head[KVB__CLASSES]; /* one LRU list per class, oldest at head */
    uint32_t age_mask[KVB__CLASSES]; /* the victim's order of each class (kvb__tune_rank) */
    uint64_t order[KVB__CLASSES];
    uint32_t tail[KVB__CLASSES];
    uint32_t *ghost;           /* circle of evicted nodes, gcap long */
    uint32_t *free;            /* free node stack */
    uint32_t nfree, gpos;
    int64_t step;              /* this candidate's class step */
    int tails_first;           /* class 0 goes before every other class (else one step before class 1) */
    double score;              /* its hits, halved every KVB__TUNE_MEMORY turnovers */
    double differ;             /* blocks hit here and missed by the current candidate or the other way */
    double base;               /* score - the current's when the present lead began */
} kvb__shadow;
typedef struct kvb__tuner {
    kvb__shadow sh[KVB__TUNE_K];
    kvb__gslot *index;         /* the shadows' indexes interleaved: a key's slots in all of them are
                                  side by side (two or three cache lines, not eleven); a column each */
    uint64_t imask, thresh;    /* index size - 1; a block is sampled when its mixed hash >> 32 < thresh */
    uint64_t seen;             /* sampled blocks since the scores were last halved */
    double live, live_differ;  /* the live pool's own hits on them; blocks where it and LRU order differ */
    double caution;            /* dwell multiplier: doubles each time switching lost to LRU order */
    uint32_t cap, gcap, nodes; /* a shadow's blocks, ghosts and nodes */
    uint32_t current;          /* the candidate whose step the pool uses */
    int tails_first;           /* the rule for tails the pool and the ladder use (the probe, the other) */
    uint64_t lead_for;         /* sampled blocks for which some candidate has been clearly ahead of it */
    uint64_t tails_lead_for;   /* .. for which the probe has been clearly ahead of LRU order */
    double tails_base;         /* the probe's score - LRU order's when its present lead began */
    double tails_caution;      /* the probe's dwell multiplier: doubles each time the rule changes */
    uint64_t since_switch;     /* sampled blocks since the live pool last changed its step */
    void *mem;
    size_t mem_bytes;
} kvb__tuner;

struct kvb_pool {
    kvb_pool_config cfg;
    pthread_mutex_t lock;
    kvb__meta *meta;
    uint32_t *free_stack;
    uint32_t n_free, n_active, n_inactive, n_cached;
    kvb__slot *slots;
    uint64_t slot_mask;
    kvb__ring rings[KVB__MAX_LEVELS * KVB__CLASSES]; /* eviction order per (priority level, class) */
    uint8_t ring_mask[KVB__MAX_LEVELS]; /* per level, bit c: ring (level, c) has inactive blocks */
    uint32_t clock;                  /* FOL: block references so far */
    kvb__gset ghost[2];              /* ARC: B1, B2; S3-FIFO: G */
    kvb__gtab fol_ghost;             /* FOL: about the last fol_ghost evicted hashes (section 2) */
    double arc_p;                    /* ARC: the target size of T1 */
    uint32_t n_cls[KVB__CLASSES];    /* ARC, S3-FIFO: registered blocks per list */
    int64_t fol_step;                /* FOL: the class step the keys use */
    int fol_adaptive;                /* FOL: fol_class_step 0, the step is chosen online (section 2) */
    int fol_tails_first;             /* FOL: class 0 goes first (a fixed step; online: the tuner's choice) */
    kvb__tuner tune;                 /* FOL self-tuning: the shadow pools */
    int track_kids;         /* the policy takes leaves first: child counts are kept */
    kvb__ctab orphans;      /* parent hash not indexed -> registered blocks naming it (cold path) */
    uint32_t *mut_slot;     /* block index -> 1 + its mutable state in mut_buf, 0 = none (made when first needed) */
    kvb__mut **mut_buf;     /* mutable states (stb_ds array), reused: the steady state allocates none */
    uint32_t *mut_free;     /* unused entries of mut_buf (stb_ds array) */
    uint32_t *scratch;      /* block indices of a call larger than KVB__SCRATCH (stb_ds array, only grows) */
    kvb_event *events;      /* pending batch (stb_ds array) */
    kvb_pool_stats stats;
    unsigned char *storage;
    uint64_t storage_bytes, block_bytes;
    size_t meta_bytes, slot_bytes;
};

static const uint64_t kvb__hk[16] = {
    UINT64_C(0x91d93080f9b439fd), UINT64_C(0x3ceaaf308142c8eb), UINT64_C(0x627655daa05f1119),
    UINT64_C(0x9dfb369bab13dfaf), UINT64_C(0x0ff9bb510944fe0d), UINT64_C(0x6301bbfca0c5154f),
    UINT64_C(0x047a8387cdde8d51), UINT64_C(0x6fced11d2bd8a1e7), UINT64_C(0xb7c1dce27f7695f5),
    UINT64_C(0x3a124c647e02ff05), UINT64_C(0x5cbd0ba3a1a6bcdf), UINT64_C(0x66080f174c96d8e3),
    UINT64_C(0x42f2dc05873f9bd1), UINT64_C(0xb120a366f0bbe9cf), UINT64_C(0xce4cda11b43c589b),
    UINT64_C(0x78b7d0ac84773ce1)};

/* ---- results and hashing ------------------------------------------------------------------------ */

KVB_API const char *kvb_result_string(int result)
{
    switch (result) {
#define KVB__STRING_CASE(name, value, text) case value: return text;
        KVB__RESULTS(KVB__STRING_CASE)
#undef KVB__STRING_CASE
    default: return "unknown result";
    }
}

static uint64_t kvb__rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The 128-bit product x * y: the low half, and the high half in *hi. Without unsigned __int128 (or with
 * KVB_NO_INT128) from four 32 x 32-bit products: the same result. */
static uint64_t kvb__mul128(uint64_t x, uint64_t y, uint64_t *hi)
{
#if defined(__SIZEOF_INT128__) && !defined(KVB_NO_INT128)
    __extension__ typedef unsigned __int128 kvb__u128;
    kvb__u128 p = (kvb__u128)x * y;
    *hi = (uint64_t)(p >> 64);
    return (uint64_t)p;
#else
    uint64_t xl = x & 0xffffffffu, xh = x >> 32, yl = y & 0xffffffffu, yh = y >> 32;
    uint64_t ll = xl * yl, lh = xl * yh, hl = xh * yl;
    uint64_t mid = (ll >> 32) + (lh & 0xffffffffu) + (hl & 0xffffffffu);
    *hi = xh * yh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    return (ll & 0xffffffffu) | (mid << 32);
#endif
}

/* F of section 3: an avalanche, and a bijection of 64-bit words (c, d odd). */
static uint64_t kvb__hfin(uint64_t v, uint64_t c, uint64_t d)
{
    v ^= v >> 32;
    v *= c;
    v ^= v >> 29;
    v *= d;
    return v ^ (v >> 32);
}

/* Pair p (0..3) of a group, added to the group's sums a, b (section 3). Each half of the product
 * carries the other factor, so a zero factor loses nothing. */
static inline void kvb__hpair(uint64_t *a, uint64_t *b, uint64_t x, uint64_t y, size_t p)
{
    uint64_t hi, lo;
    x ^= kvb__hk[2 * p];
    y ^= kvb__hk[2 * p + 1];
    lo = kvb__mul128(x, y, &hi) ^ y;
    hi ^= x;
    KVB__KEEP(lo);
    KVB__KEEP(hi);
    *a += lo;
    *b += hi;
}

static uint64_t kvb__tok2(const uint32_t *t) { return (uint64_t)t[0] | ((uint64_t)t[1] << 32); }

/* A group of 16 tokens: 8 words, 4 pairs. */
static inline void kvb__hgroup16(uint64_t *a, uint64_t *b, const uint32_t *t)
{
    uint64_t sa = kvb__rotl(*a, 29), sb = kvb__rotl(*b, 37);
    size_t p;
    for (p = 0; p < 4; p++) kvb__hpair(&sa, &sb, kvb__tok2(t + 4 * p), kvb__tok2(t + 4 * p + 2), p);
    *a = sa;
    *b = sb;
}

/* Word i of the message: the tokens two by two, then the extra keys, then L. */
static uint64_t kvb__hword(const uint32_t *tokens, size_t n, const uint64_t *extra, size_t n_extra, size_t i)
{
    size_t ntw = (n + 1) / 2;
    if (i < ntw) return 2 * i + 1 < n ? kvb__tok2(tokens + 2 * i) : (uint64_t)tokens[2 * i];
    if (i < ntw + n_extra) return extra[i - ntw];
    return (uint64_t)n | ((uint64_t)n_extra << 32);
}

/* The one step that waits for the parent: X = parent ^ (a, b), times K modulo 2^128, then F on each
 * half side by side. */
static kvb_hash kvb__hfinal(const kvb_hash *parent, uint64_t a, uint64_t b)
{
    kvb_hash h;
    uint64_t x = (parent ? parent->lo : 0) ^ a, y = (parent ? parent->hi : 0) ^ b, hi;
    uint64_t lo = kvb__mul128(x, kvb__hk[10], &hi);
    hi += x * kvb__hk[11] + y * kvb__hk[10];
    h.lo = kvb__hfin(lo ^ hi, kvb__hk[12], kvb__hk[13]);
    h.hi = kvb__hfin(hi, kvb__hk[14], kvb__hk[15]);
    return h;
}

/* Any block: its whole groups of 16 tokens, then the remaining words in groups of 8. Out of line, so
 * that the common case below keeps its registers. */
static KVB__NOINLINE kvb_hash kvb__hash_any(const kvb_hash *parent, const uint32_t *tokens, size_t n_tokens,
                                            const uint64_t *extra, size_t n_extra, uint64_t salt)
{
    uint64_t a = salt ^ kvb__hk[8], b = kvb__rotl(salt, 32) ^ kvb__hk[9];
    size_t m = (n_tokens + 1) / 2 + n_extra + 1, i, k, g;
    for (i = 0; i + 16 <= n_tokens; i += 16) kvb__hgroup16(&a, &b, tokens + i);
    for (i /= 2; i < m; i += g) {
        uint64_t w[8] = {0}, sa = kvb__rotl(a, 29), sb = kvb__rotl(b, 37);
        g = m - i < 8 ? m - i : 8;
        for (k = 0; k < g; k++) w[k] = kvb__hword(tokens, n_tokens, extra, n_extra, i + k);
        for (k = 0; 2 * k < g; k++) kvb__hpair(&sa, &sb, w[2 * k], w[2 * k + 1], k);
        a = sa;
        b = sb;
    }
    return kvb__hfinal(parent, a, b);
}

KVB_API kvb_hash kvb_hash_block(const kvb_hash *parent, const uint32_t *tokens, size_t n_tokens,
                                const uint64_t *extra, size_t n_extra, uint64_t salt)
{
    uint64_t a, b;
    size_t i;
    if (n_extra || n_tokens % 16) return kvb__hash_any(parent, tokens, n_tokens, extra, n_extra, salt);
    /* the common shape: whole groups of 16 tokens, then a last group of one pair (L, 0) */
    a = salt ^ kvb__hk[8];
    b = kvb__rotl(salt, 32) ^ kvb__hk[9];
    for (i = 0; i < n_tokens; i += 16) kvb__hgroup16(&a, &b, tokens + i);
    a = kvb__rotl(a, 29);
    b = kvb__rotl(b, 37);
    kvb__hpair(&a, &b, (uint64_t)n_tokens, 0, 0);
    return kvb__hfinal(parent, a, b);
}

KVB_API kvb_result kvb_hash_prompt(const uint32_t *tokens, size_t n_tokens, uint32_t block_tokens,
                                   const uint64_t *extra, size_t n_extra, uint64_t salt,
                                   kvb_hash *out, size_t max_out, size_t *out_n)
{
    size_t nb, i;
    const kvb_hash *parent = NULL;
    if ((!tokens && n_tokens) || (!extra && n_extra) || !out_n || block_tokens == 0 || (!out && max_out))
        return KVB_EINVAL;
    nb = n_tokens / block_tokens;
    if (nb > max_out) nb = max_out;
    for (i = 0; i < nb; i++) {
        out[i] = kvb_hash_block(parent, tokens + i * block_tokens, block_tokens, extra, n_extra, salt);
        parent = &out[i];
    }
    *out_n = nb;
    return KVB_OK;
}

static int kvb__hash_is_root(const kvb_hash *h) { return h->lo == 0 && h->hi == 0; }

/* ---- layout ------------------------------------------------------------------------------------- */

static kvb_layout kvb__layout_resolved(const kvb_layout *l)
{
    kvb_layout r = *l;
    if (!r.num_layers) r.num_layers = 1;
    if (!r.num_parts) r.num_parts = 2;
    return r;
}

KVB_API kvb_result kvb_layout_for_model(kvb_layout_kind kind, uint32_t block_tokens, uint32_t num_layers,
                                        uint32_t kv_heads, uint32_t head_dim, uint32_t dtype_bytes,
                                        kvb_layout *out)
{
    uint64_t page;
    if (!out) return KVB_EINVAL;
    if ((unsigned)kind >= KVB_LAYOUT__COUNT || !block_tokens || !num_layers || !kv_heads || !head_dim ||
        !dtype_bytes)
        return KVB_ECONFIG;
    page = (uint64_t)block_tokens * kv_heads; /* each factor < 2^32: check the products step by step */
    if (page > UINT64_MAX / head_dim) return KVB_EOVERFLOW;
    page *= head_dim;
    if (page > UINT64_MAX / dtype_bytes) return KVB_EOVERFLOW;
    page *= dtype_bytes;
    out->kind = kind;
    out->num_layers = num_layers;
    out->num_parts = 2;
    out->page_bytes = page;
    return KVB_OK;
}

KVB_API uint64_t kvb_layout_offset(const kvb_layout *layout, uint32_t num_blocks, uint32_t block,
                                   uint32_t layer, uint32_t part)
{
    kvb_layout l = kvb__layout_resolved(layout);
    if (l.kind == KVB_LAYOUT_LAYER_SEPARATE)
        return (((uint64_t)layer * l.num_parts + part) * num_blocks + block) * l.page_bytes;
    return (((uint64_t)block * l.num_layers + layer) * l.num_parts + part) * l.page_bytes;
}

/* ---- memory ------------------------------------------------------------------------------------- */

#ifdef KVB__HUGE_PAGES
#define KVB__HUGE_PAGE ((size_t)2 << 20)
/* Tables of a huge page or more start on one and ask the kernel for huge pages (where its setting is
 * "madvise", the usual default): a lookup's random reads in a pool of a million blocks then miss the
 * TLB far less often, and a miss walks a shorter table. Only the address space past the size is spare;
 * what is never touched is never backed. */
static size_t kvb__mem_align(size_t size, size_t align)
{
    return size >= KVB__HUGE_PAGE && align < KVB__HUGE_PAGE ? KVB__HUGE_PAGE : align;
}
static void kvb__mem_advise(void *p, size_t size)
{
    if (size >= KVB__HUGE_PAGE) (void)madvise(p, size, MADV_HUGEPAGE); /* advice: a refusal changes nothing */
}
#else
static size_t kvb__mem_align(size_t size, size_t align) { (void)size; return align; }
static void kvb__mem_advise(void *p, size_t size) { (void)p; (void)size; }
#endif

static void *kvb__mem_alloc(const kvb_allocator *a, size_t size, size_t align)
{
    unsigned char *raw, *p;
    if (a->alloc) return a->alloc(size, align, a->user);
    align = kvb__mem_align(size, align);
    if (size > SIZE_MAX - align - sizeof(void *)) return NULL;
    raw = (unsigned char *)KVB_MALLOC(size + align + sizeof(void *));
    if (!raw) return NULL;
    p = (unsigned char *)(((uintptr_t)raw + sizeof(void *) + align - 1) & ~(uintptr_t)(align - 1));
    memcpy(p - sizeof(void *), &raw, sizeof raw);
    kvb__mem_advise(p, size);
    return p;
}

static void kvb__mem_free(const kvb_allocator *a, void *p, size_t size)
{
    void *raw;
    if (!p) return;
    if (a->free) {
        a->free(p, size, a->user);
        return;
    }
    memcpy(&raw, (unsigned char *)p - sizeof(void *), sizeof raw);
    KVB_FREE(raw);
}

/* Capacity for cap elements in the stb_ds array *a (stbds_arrsetcap would wrap elemsize * cap, and
 * stb_ds's growth writes through a failed realloc): 0 when the memory is not there, *a unchanged. An
 * array grows with these before anything changes, so that a call out of memory can change nothing;
 * stbds_arrput and stbds_arraddnptr are used only within the capacity made so. */
static int kvb__arr_room(void **a, size_t elemsize, size_t cap)
{
    stbds_array_header *h;
    if (cap <= stbds_arrcap(*a)) return 1;
    if (cap > (SIZE_MAX - sizeof *h) / elemsize) return 0;
    h = (stbds_array_header *)KVB_REALLOC(*a ? stbds_header(*a) : NULL, elemsize * cap + sizeof *h);
    if (!h) return 0;
    if (!*a) {
        h->length = 0;
        h->hash_table = 0;
        h->temp = 0;
    }
    h->capacity = cap;
    *a = h + 1;
    return 1;
}

/* The capacity an array that has `have` and needs cap grows to: at least doubled, as stb_ds grows it
 * (amortised O(1) appends). */
static size_t kvb__grown(size_t have, size_t cap) { return cap < 4 ? 4 : cap / 2 < have ? 2 * have : cap; }

/* kvb__arr_room for an array that grows by appends. */
static int kvb__arr_fit(void **a, size_t elemsize, size_t cap)
{
    size_t have = stbds_arrcap(*a);
    return KVB__LIKELY(cap <= have) || kvb__arr_room(a, elemsize, kvb__grown(have, cap));
}

/* ---- handles ------------------------------------------------------------------------------------ */

static uint64_t kvb__handle(uint32_t idx, uint32_t gen) { return ((uint64_t)gen << 32) | ((uint64_t)idx + 1); }

KVB_API uint32_t kvb_block_index(uint64_t handle_id)
{
    uint32_t low = (uint32_t)handle_id;
    return low ? low - 1 : UINT32_MAX;
}

KVB_API kvb_weak kvb_weak_of(kvb_block block)
{
    kvb_weak w;
    w.id = block.id ? (block.id | KVB_WEAK_BIT) : 0;
    return w;
}

/* Find the block of a handle: index valid and generation current (a free block is never current). */
static kvb_result kvb__lookup_handle(const kvb_pool *p, uint64_t id, uint32_t *out_idx)
{
    uint32_t low = (uint32_t)id, idx;
    if (!id) return KVB_EINVAL;
    if (!low || low > p->cfg.num_blocks) return KVB_ERANGE;
    idx = low - 1;
    if (p->meta[idx].state == KVB__S_FREE || p->meta[idx].gen != ((uint32_t)(id >> 32) & KVB__GEN_MASK))
        return (id & KVB_WEAK_BIT) ? KVB_EGONE : KVB_ESTALE;
    *out_idx = idx;
    return KVB_OK;
}

/* A strong handle the caller holds a reference through. */
static kvb_result kvb__strong(const kvb_pool *p, kvb_block b, uint32_t *out_idx)
{
    kvb_result r;
    if (b.id & KVB_WEAK_BIT) return KVB_EWEAK;
    r = kvb__lookup_handle(p, b.id, out_idx);
    if (r != KVB_OK) return r;
    return p->meta[*out_idx].refs ? KVB_OK : KVB_ESTALE;
}

static kvb_block kvb__block_of(const kvb_pool *p, uint32_t idx)
{
    kvb_block b;
    b.id = kvb__handle(idx, p->meta[idx].gen);
    return b;
}

/* ---- events ------------------------------------------------------------------------------------- */

static void kvb__flush_events(kvb_pool *p)
{
    if (stbds_arrlen(p->events) == 0) return;
    p->cfg.on_events(p->events, stbds_arrlenu(p->events), p->cfg.event_user);
    KVB__ARR_SHRINK(p->events, 0);
}

static KVB__NOINLINE int kvb__events_grow(kvb_pool *p, size_t n)
{
    void *a = p->events;
    int ok = kvb__arr_fit(&a, sizeof *p->events, stbds_arrlenu(p->events) + n);
    p->events = (kvb_event *)a;
    return ok;
}

/* Room in the pending batch for n more events (always, for a pool without an event callback): the
 * sequence calls make it before they change anything, so that they can fail with KVB_ENOMEM instead. */
static inline int kvb__events_room(kvb_pool *p, size_t n)
{
    return KVB__LIKELY(!p->cfg.on_events || stbds_arrlenu(p->events) + n <= stbds_arrcap(p->events)) ||
           kvb__events_grow(p, n);
}

static KVB__NOINLINE void kvb__emit_event(kvb_pool *p, kvb_event_kind kind, const kvb__meta *m)
{
    kvb_event e;
    memset(&e, 0, sizeof e);
    e.kind = kind;
    e.tier = p->cfg.tier;
    if (m) {
        e.num_tokens = m->ntok;
        e.hash = m->hash;
        e.parent = m->parent;
    }
    if (!kvb__events_room(p, 1)) { /* out of memory: the batch so far goes now, and this event alone */
        kvb__flush_events(p);
        if (!stbds_arrcap(p->events)) {
            p->cfg.on_events(&e, 1, p->cfg.event_user);
            return;
        }
    }
    stbds_arrput(p->events, e);
}

/* An event for the pool's listener: without one, the usual case, only the test, inline where blocks are
 * stored and removed. */
static inline void kvb__emit(kvb_pool *p, kvb_event_kind kind, const kvb__meta *m)
{
    if (p->cfg.on_events) kvb__emit_event(p, kind, m);
}

static void kvb__unlock(kvb_pool *p)
{
    kvb__flush_events(p);
    pthread_mutex_unlock(&p->lock);
}

/* ---- prefix index: open addressing on the mixed hash, backward-shift deletion -------------------- */

/* Where a hash goes in the pool's tables: both halves mixed, so hashes that differ in a few bits only,
 * in their high bits or in `hi` alone (a simulator's sequence numbers, a custom hash_fn, block ids put
 * through kvb_register_hashed) spread over a table as uniform ones do. A table homes a hash on the low
 * bits of its mix; the index and the ghost sets keep its low 32 bits as a tag, and the shadows the whole
 * mix as a block's key. */
static inline uint64_t kvb__mix(const kvb_hash *h)
{
    uint64_t x = h->lo ^ (h->hi * UINT64_C(0x9e3779b97f4a7c15));
    x ^= x >> 29;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    return x ^ (x >> 32);
}

static uint32_t kvb__tag(const kvb_hash *h) { return (uint32_t)kvb__mix(h); }

/* The index slot where a search for h starts (to prefetch). */
static inline const kvb__slot *kvb__home(const kvb_pool *p, const kvb_hash *h)
{
    return &p->slots[kvb__mix(h) & p->slot_mask];
}

static int kvb__same_hash(const kvb_hash *a, const kvb_hash *b) { return a->lo == b->lo && a->hi == b->hi; }

/* The block indexed under h (whose kvb__mix is `mix`), or KVB__NIL with *empty = the slot where h would
 * go (may be NULL). */
static inline uint32_t kvb__find_or_empty(const kvb_pool *p, const kvb_hash *h, uint64_t mix, uint64_t *empty)
{
    uint64_t pos = mix & p->slot_mask;
    uint32_t tag = (uint32_t)mix;
    for (;;) {
        const kvb__slot *s = &p->slots[pos];
        if (!s->ref) {
            if (empty) *empty = pos;
            return KVB__NIL;
        }
        if (s->tag == tag && kvb__same_hash(&p->meta[s->ref - 1].hash, h)) return s->ref - 1;
        pos = (pos + 1) & p->slot_mask;
    }
}

static uint32_t kvb__find(const kvb_pool *p, const kvb_hash *h) { return kvb__find_or_empty(p, h, kvb__mix(h), NULL); }

static inline kvb__slot *kvb__slot_of(kvb_pool *p, uint32_t idx)
{
    uint64_t pos = kvb__mix(&p->meta[idx].hash) & p->slot_mask;
    while (p->slots[pos].ref != idx + 1) pos = (pos + 1) & p->slot_mask;
    return &p->slots[pos];
}

/* Index block idx at slot pos, the empty slot kvb__find_or_empty gave for its hash (mixed: mix). */
static void kvb__index_insert(kvb_pool *p, uint32_t idx, uint64_t pos, uint64_t mix)
{
    p->slots[pos].tag = (uint32_t)mix;
    p->slots[pos].ref = idx + 1;
    p->n_cached++;
}

static inline void kvb__index_delete(kvb_pool *p, kvb__slot *slot)
{
    uint64_t i = (uint64_t)(slot - p->slots), j = i, m = p->slot_mask;
    for (;;) {
        j = (j + 1) & m;
        if (!p->slots[j].ref) break;
        if (((j - p->slots[j].tag) & m) < ((j - i) & m)) continue; /* its home lies after i: it stays */
        p->slots[i] = p->slots[j];
        i = j;
    }
    p->slots[i].ref = 0;
    p->n_cached--;
}

/* ---- lineage counts: how many registered blocks name a hash as parent ---------------------------- */

/* Policies that take leaves first keep, on the indexed block of each hash, how many registered blocks
 * name that hash as parent: a child's registration and removal find their parent through the prefix
 * index, and eviction reads leafness from the block it already looks at. A child whose parent hash is
 * not indexed (it was evicted first, or never came) is counted in the orphan map, a cold path, and the
 * count moves to the block that indexes the hash next. LRU and custom eviction never ask. */

/* The map key of a parent hash. stb_ds's byte hash shifts each 4th byte into the sign bit of an int
 * (undefined behaviour for bytes >= 0x80), so bits 31 and 63 of each half are cleared: 124 bits left. */
static kvb_hash kvb__kid_key(const kvb_hash *h)
{
    const uint64_t keep = ~((UINT64_C(1) << 31) | (UINT64_C(1) << 63));
    kvb_hash k;
    k.lo = h->lo & keep;
    k.hi = h->hi & keep;
    return k;
}

static uint32_t kvb__find(const kvb_pool *p, const kvb_hash *h);

/* A count per hash (orphaned children here, in-flight and seen blocks in kvoffload.h): a table that only
 * grows (to the most hashes counted at once), so a steady state allocates nothing. The slot of h, or the
 * empty one where it goes. */
static uint64_t kvb__ctab_slot(const kvb__ctab *t, const kvb_hash *h)
{
    uint64_t s = kvb__mix(h) & t->mask;
    while (t->e[s].count && (t->e[s].key.lo != h->lo || t->e[s].key.hi != h->hi)) s = (s + 1) & t->mask;
    return s;
}

/* Room for k more hashes: the table doubles (rehash) until they fit below two thirds full. Returns 0 when
 * out of memory (the table as it was). */
static int kvb__ctab_reserve(kvb__ctab *t, uint64_t k)
{
    uint64_t n = t->e ? t->mask + 1 : 32, i;
    kvb__ctab g;
    if (t->e && (t->used + k) * 3 < (t->mask + 1) * 2) return 1;
    do
        n *= 2;
    while ((t->used + k) * 3 >= n * 2);
    if (n > SIZE_MAX / sizeof *g.e) return 0;
    g.e = (kvb__count *)KVB_MALLOC((size_t)n * sizeof *g.e);
    if (!g.e) return 0;
    memset(g.e, 0, (size_t)n * sizeof *g.e);
    g.mask = n - 1;
    g.used = t->used;
    for (i = 0; t->e && i <= t->mask; i++)
        if (t->e[i].count) g.e[kvb__ctab_slot(&g, &t->e[i].key)] = t->e[i];
    KVB_FREE(t->e);
    *t = g;
    return 1;
}

static int kvb__ctab_room(kvb__ctab *t) { return kvb__ctab_reserve(t, 1); }

/* Forget the hash at slot s (backward-shift deletion). */
static void kvb__ctab_delete(kvb__ctab *t, uint64_t s)
{
    uint64_t i = s, j = s, k, m = t->mask;
    for (;;) {
        j = (j + 1) & m;
        if (!t->e[j].count) break;
        k = kvb__mix(&t->e[j].key) & m;
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        t->e[i] = t->e[j];
        i = j;
    }
    t->e[i].count = 0;
    t->used--;
}

static uint32_t kvb__ctab_get(const kvb__ctab *t, const kvb_hash *h)
{
    return t->used ? t->e[kvb__ctab_slot(t, h)].count : 0;
}

/* count(h) += n (saturating). 0 when out of memory (nothing changed). */
static int kvb__ctab_add(kvb__ctab *t, const kvb_hash *h, uint32_t n)
{
    uint64_t s;
    if (!n) return 1;
    if (!kvb__ctab_room(t)) return 0;
    s = kvb__ctab_slot(t, h);
    if (!t->e[s].count) {
        t->e[s].key = *h;
        t->used++;
    }
    t->e[s].count = t->e[s].count > UINT32_MAX - n ? UINT32_MAX : t->e[s].count + n;
    return 1;
}

/* count(h) -= n, at least 0 (a hash at 0 is forgotten); take = 1: all of it. Returns what was removed. */
static uint32_t kvb__ctab_sub(kvb__ctab *t, const kvb_hash *h, uint32_t n, int take)
{
    uint64_t s;
    uint32_t c;
    if (!t->used) return 0;
    s = kvb__ctab_slot(t, h);
    if (!(c = t->e[s].count)) return 0;
    if (take || n >= c) {
        kvb__ctab_delete(t, s);
        return c;
    }
    t->e[s].count = c - n;
    return n;
}

static void kvb__ctab_free(kvb__ctab *t)
{
    KVB_FREE(t->e);
    memset(t, 0, sizeof *t);
}

/* The children counted under h, taken out (they now belong to the block that indexes h). */
static uint32_t kvb__orphans_take(kvb_pool *p, const kvb_hash *h) { return kvb__ctab_sub(&p->orphans, h, 0, 1); }

/* n more children under h. Out of memory, the count is lost: eviction may then take h's block before
 * its children when h is cached again (a leaf-first preference, never a wrong answer to a lookup). */
static void kvb__orphans_add(kvb_pool *p, const kvb_hash *h, uint32_t n) { (void)kvb__ctab_add(&p->orphans, h, n); }

static void kvb__orphans_drop(kvb_pool *p, const kvb_hash *h) { (void)kvb__ctab_sub(&p->orphans, h, 1, 0); }

/* Room for k more orphaned parents, made by a call that registers blocks before it changes anything: a
 * block registered while its parent is not cached is counted there, and a count lost to a failed growth
 * would let the parent, once cached, go before its child. k: the blocks whose parent may be missing
 * (those not chained to the block registered just before them). 0 when out of memory. */
static int kvb__orphans_room(kvb_pool *p, size_t k) { return !p->track_kids || !k || kvb__ctab_reserve(&p->orphans, k); }

/* The eviction ring of a block: its priority level and class. */
static uint32_t kvb__ring_of(const kvb__meta *m) { return (uint32_t)m->prio * KVB__CLASSES + m->cls; }

/* Ring r forgets its pending leaves: its leaf search resumes at the oldest of them instead. */
static void kvb__ring_fold_pending(kvb__ring *r)
{
    uint32_t k;
    for (k = 0; k < r->n_pending; k++) {
        size_t at = (uint32_t)(r->pending[k] - r->base);
        if (at < r->leafless_to) r->leafless_to = at;
    }
    r->n_pending = 0;
}

/* A cached block turned into a leaf. Where its entry comes before the place its ring's leaf search
 * reached, the ring remembers it (the search's place stays, so the parents passed are not passed
 * again); with too many remembered, the search moves back to the oldest of them. */
static void kvb__became_leaf(kvb_pool *p, uint32_t idx)
{
    const kvb__meta *m = &p->meta[idx];
    if (m->flags & KVB__F_INACTIVE) {
        kvb__ring *r = &p->rings[kvb__ring_of(m)];
        size_t at = (uint32_t)(m->stamp - r->base);
        if (at >= r->leafless_to) return;
        if (r->n_pending == KVB__LEAF_PENDING) {
            kvb__ring_fold_pending(r);
            if (at < r->leafless_to) r->leafless_to = at;
        } else {
            r->pending[r->n_pending++] = m->stamp;
        }
    }
}

/* The block indexed under h. `near` is a guess (KVB__NIL: none), such as the block registered just
 * before in the same chain: when it is indexed under h, the index is not probed. */
static inline uint32_t kvb__find_near(const kvb_pool *p, const kvb_hash *h, uint32_t near)
{
    if (near != KVB__NIL && (p->meta[near].flags & KVB__F_INDEXED) && kvb__same_hash(&p->meta[near].hash, h))
        return near;
    return kvb__find(p, h);
}

/* Count a registered child in (+1) or out (-1) of its parent (`near`: a guess at the parent's block). */
static inline void kvb__kids_add(kvb_pool *p, const kvb_hash *parent, int delta, uint32_t near)
{
    uint32_t holder;
    if (!p->track_kids || kvb__hash_is_root(parent)) return;
    if ((holder = kvb__find_near(p, parent, near)) != KVB__NIL) {
        kvb__meta *h = &p->meta[holder];
        if (delta > 0) h->kids++;
        else if (h->kids && !--h->kids) kvb__became_leaf(p, holder); /* 0 stays 0: a count lost (below) */
    } else if (delta > 0) kvb__orphans_add(p, parent, 1);
    else kvb__orphans_drop(p, parent);
}

/* ---- FOL's ghosts ------------------------------------------------------------------------------- */

/* FOL's ghosts (section 2) are a table of G words in sets of 8, one cache line each: a hash's set and
 * its 23-bit tag come from its mix (kvb__mix: the high half picks the set, the low one the tag). A set
 * keeps its last 8 puts, newest first, and a ghost that comes back leaves a hole that ages out with the
 * others, as in a circle of the last G evictions. A set fills at its own pace, so some of its ghosts
 * would outlive the circle's G evictions, by half again and more, and come back with a count from long
 * ago; on traffic where that happens often (busy API sessions) the longer stays of such blocks feed
 * more evictions and more returns, a pool far behind what a circle would keep. So each word also
 * carries an age stamp, one per G / 16 puts, and a ghost older than G puts (to a sixteenth) is
 * forgotten when it comes back. Lookups and puts read one line each and delete nothing elsewhere: an
 * exact circle with an index (kvb__gset) costs three random lines of a table six times the size. A
 * false match (another hash with the same set and tag: about 1 in a million lookups of a hash that is
 * no ghost) gives a block another's past count, which the policy survives. */
static uint64_t *kvb__gtab_set(const kvb__gtab *t, uint64_t mix)
{
    return t->w + (size_t)(((mix >> 32) * t->sets) >> 32) * t->ways;
}

static uint32_t kvb__gtab_tag(uint64_t mix) { return (uint32_t)mix & ~UINT32_C(0x1ff); }

/* ceil(G / 8) sets of 8 (one set of G when G < 8), allocated with the pool. */
static int kvb__gtab_init(kvb_pool *p, kvb__gtab *t, uint32_t cap)
{
    size_t bytes;
    t->ways = cap < KVB__GWAYS ? cap : KVB__GWAYS;
    t->sets = (uint32_t)(((uint64_t)cap + t->ways - 1) / t->ways);
    if ((uint64_t)t->sets * t->ways > SIZE_MAX / sizeof *t->w) return 0;
    bytes = (size_t)t->sets * t->ways * sizeof *t->w;
    if (!(t->w = (uint64_t *)kvb__mem_alloc(&p->cfg.allocator, bytes, 64))) return 0;
    memset(t->w, 0, bytes);
    t->live = t->stamp = 0;
    t->per_stamp = t->until_next = (uint32_t)(((uint64_t)t->sets * t->ways + KVB__GAGE_LIMIT - 1) / KVB__GAGE_LIMIT);
    return 1;
}

static void kvb__gtab_free(kvb_pool *p, kvb__gtab *t)
{
    kvb__mem_free(&p->cfg.allocator, t->w, (size_t)t->sets * t->ways * sizeof *t->w);
    memset(t, 0, sizeof *t);
}

/* The line a lookup or a put of h reads (to prefetch). */
static const uint64_t *kvb__gtab_line(const kvb__gtab *t, const kvb_hash *h)
{
    return kvb__gtab_set(t, kvb__mix(h));
}

/* Word w is a ghost with this tag (its count is never 0). The tag first: it nearly never matches. */
#define KVB__GTAB_IS(w, tag) (((uint32_t)(w) & ~UINT32_C(0x1ff)) == (tag) && (uint8_t)(w))

#if defined(__SSE2__)
/* Ways 4q..4q+3 of a set of 8 whose tag bits equal tag's, as bits 0..3: the low halves of four words side
 * by side, masked and compared at once. */
static inline uint32_t kvb__gtab_tags4(const uint64_t *set, uint32_t q, __m128i tag)
{
    __m128 a = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(const void *)(set + 4 * q)));
    __m128 b = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(const void *)(set + 4 * q + 2)));
    __m128i low = _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    __m128i eq = _mm_cmpeq_epi32(_mm_and_si128(low, _mm_set1_epi32(-0x200)), tag); /* ~0x1ff */
    return (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(eq));
}
#endif

/* The way of the set that holds the tag, or t->ways. Sets of 8 (KVB__GWAYS: all but the smallest tables)
 * are searched without a loop: with SSE2, every tag at once and then the (nearly always no) candidates
 * in full; else 8 compares written out. */
static KVB__ALWAYS_INLINE uint32_t kvb__gtab_way(const kvb__gtab *t, const uint64_t *set, uint32_t tag)
{
    uint32_t i;
    if (KVB__LIKELY(t->ways == 8)) {
#if defined(__SSE2__)
        __m128i want = _mm_set1_epi32((int)tag);
        uint32_t hits = kvb__gtab_tags4(set, 0, want) | kvb__gtab_tags4(set, 1, want) << 4;
        for (; hits; hits &= hits - 1) /* an empty word (0) matches a tag of 0: its count tells */
            if ((uint8_t)set[i = (uint32_t)__builtin_ctz(hits)]) return i;
        return 8;
#else
        return KVB__GTAB_IS(set[0], tag) ? 0 : KVB__GTAB_IS(set[1], tag) ? 1 : KVB__GTAB_IS(set[2], tag) ? 2 :
               KVB__GTAB_IS(set[3], tag) ? 3 : KVB__GTAB_IS(set[4], tag) ? 4 : KVB__GTAB_IS(set[5], tag) ? 5 :
               KVB__GTAB_IS(set[6], tag) ? 6 : KVB__GTAB_IS(set[7], tag) ? 7 : 8;
#endif
    }
    for (i = 0; i < t->ways && !KVB__GTAB_IS(set[i], tag); i++) {
    }
    return i;
}

/* The ghost of the hash mixed to `mix`, taken out of its set (it came back): its word, or 0. */
static uint64_t kvb__gtab_take(kvb__gtab *t, uint64_t mix)
{
    uint64_t *set = kvb__gtab_set(t, mix), word;
    uint32_t i = kvb__gtab_way(t, set, kvb__gtab_tag(mix));
    if (i == t->ways) return 0;
    word = set[i];
    set[i] = 0;
    t->live--;
    return word;
}

/* Every word of a set one way on (the last leaves), for a put at way 0. A set of 8 moves in four loads and
 * four stores with SSE2, not a call. */
static KVB__ALWAYS_INLINE void kvb__gtab_shift(uint64_t *set, uint32_t ways)
{
#if defined(__SSE2__)
    if (KVB__LIKELY(ways == 8)) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)set);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(set + 2));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(set + 4));
        uint64_t d = set[6];
        _mm_storeu_si128((__m128i *)(void *)(set + 1), a);
        _mm_storeu_si128((__m128i *)(void *)(set + 3), b);
        _mm_storeu_si128((__m128i *)(void *)(set + 5), c);
        set[7] = d;
        return;
    }
#endif
    memmove(set + 1, set, (ways - 1) * sizeof *set);
}

/* A word taken back: its count, or 0 when it is older than G puts (forgotten, as a circle would). */
static uint8_t kvb__gtab_count(const kvb__gtab *t, uint64_t word)
{
    uint32_t age = (t->stamp - (uint32_t)(word >> 3)) & 63u;
    return age < KVB__GAGE_LIMIT ? (uint8_t)(word & 7u) : 0;
}

/* Remember an evicted hash with its count (>= 1) and last touch, newest in its set (an older ghost of
 * the same hash goes; the set's oldest word leaves). */
static void kvb__gtab_put(kvb__gtab *t, const kvb_hash *h, uint8_t cnt, uint32_t last)
{
    uint64_t mix = kvb__mix(h), *set = kvb__gtab_set(t, mix);
    uint32_t old = t->live ? kvb__gtab_way(t, set, kvb__gtab_tag(mix)) : t->ways;
    if (old < t->ways) { /* kvb__gtab_take's work, on the set at hand */
        set[old] = 0;
        t->live--;
    }
    t->live += !(uint8_t)set[t->ways - 1];
    kvb__gtab_shift(set, t->ways);
    set[0] = ((uint64_t)last << 32) | kvb__gtab_tag(mix) | t->stamp << 3 | (cnt < KVB__GCOUNT_MAX ? cnt : KVB__GCOUNT_MAX);
    if (!--t->until_next) { /* no division on the way: the stamp moves on every per_stamp puts */
        t->stamp = (t->stamp + 1) & 63u;
        t->until_next = t->per_stamp;
    }
}

/* ---- eviction lists ----------------------------------------------------------------------------- */

/* Entry e is its block's current place, in ring r, if the block is on a list at all. */
static inline int kvb__ring_place(const kvb__meta *m, const kvb__ring *r, const kvb__ring_entry *e)
{
    return m->stamp == e->stamp && kvb__ring_of(m) == r->id;
}

static inline int kvb__ring_valid(const kvb_pool *p, const kvb__ring *r, const kvb__ring_entry *e)
{
    const kvb__meta *m = &p->meta[e->idx];
    return (m->flags & KVB__F_INACTIVE) && kvb__ring_place(m, r, e);
}

/* An entry to keep: valid, or holding the place of an S3-FIFO block in use. */
static inline int kvb__ring_kept(const kvb_pool *p, const kvb__ring *r, const kvb__ring_entry *e)
{
    const kvb__meta *m = &p->meta[e->idx];
    return (m->flags & (KVB__F_INACTIVE | KVB__F_QUEUED)) && kvb__ring_place(m, r, e);
}

/* Move a ring's head past its stale entries (evicted, or taken again since they were pushed). */
static inline void kvb__ring_skip_stale(const kvb_pool *p, kvb__ring *r)
{
    size_t len = stbds_arrlenu(r->e);
    while (r->head < len && !kvb__ring_kept(p, r, &r->e[r->head])) r->head++;
}

/* One more, or one fewer, inactive block in m's ring; the level's mask names the rings that have some,
 * so FOL looks only at those. */
static inline void kvb__ring_gain(kvb_pool *p, const kvb__meta *m)
{
    if (!p->rings[kvb__ring_of(m)].live++) p->ring_mask[m->prio] |= (uint8_t)(1u << m->cls);
}

static inline void kvb__ring_lose(kvb_pool *p, const kvb__meta *m)
{
    if (!--p->rings[kvb__ring_of(m)].live) p->ring_mask[m->prio] &= (uint8_t)~(1u << m->cls);
}

/* Drop stale entries, those before the head included, once they outnumber the kept ones: the array
 * stays within twice the most entries a ring ever keeps, so a steady state never grows it. Kept entries
 * are renumbered from past the old stamps, and the leaf search keeps its place. */
static void kvb__ring_compact(kvb_pool *p, kvb__ring *r)
{
    size_t i, w = 0, len = stbds_arrlenu(r->e), leafless = 0;
    uint32_t base = r->base + (uint32_t)len;
    kvb__ring_skip_stale(p, r);
    if (p->cfg.eviction != KVB_EVICT_S3FIFO && len - r->head == r->live) { /* only evicted ones, before the head */
        w = len - r->head;
        memmove(r->e, r->e + r->head, w * sizeof *r->e);
        base = r->base + (uint32_t)r->head; /* positions and stamps moved together */
        leafless = r->leafless_to > r->head ? r->leafless_to - r->head : 0;
    } else {
        kvb__ring_fold_pending(r); /* renumbering: the pending stamps would name other entries */
        for (i = r->head; i < len; i++) {
            if (i == r->leafless_to) leafless = w;
            if (!kvb__ring_kept(p, r, &r->e[i])) continue;
            r->e[w] = r->e[i];
            r->e[w].stamp = p->meta[r->e[i].idx].stamp = base + (uint32_t)w;
            w++;
        }
        if (r->leafless_to >= len) leafless = w;
    }
    KVB__ARR_SHRINK(r->e, w);
    r->head = 0;
    r->base = base;
    r->leafless_to = leafless;
    r->held = (uint32_t)(w - r->live);
}

/* Room for `need` entries in ring r (0 when the memory is not there). A ring that grows writes its new
 * capacity at once: the pushes that fill it later, each under the lock in a release, would otherwise take
 * a page fault every 512 entries (with caches cold, several microseconds: the most a cold release cost). */
static int kvb__ring_fit(kvb__ring *r, size_t need)
{
    void *a = r->e;
    size_t len = stbds_arrlenu(r->e), cap = stbds_arrcap(r->e);
    if (!kvb__arr_fit(&a, sizeof *r->e, need)) return 0;
    r->e = (kvb__ring_entry *)a;
    if (stbds_arrcap(r->e) > cap) memset(r->e + len, 0, (stbds_arrcap(r->e) - len) * sizeof *r->e);
    return 1;
}

/* One more entry's room in a full ring, grown: 0 when the memory is not there. */
static KVB__NOINLINE int kvb__ring_grow(kvb__ring *r) { return kvb__ring_fit(r, stbds_arrlenu(r->e) + 1); }

static KVB__NOINLINE int kvb__ring_room(kvb_pool *p, kvb__ring *r);

/* Room for one more entry in ring r (kvb__ring_room when it is full). */
static inline int kvb__ring_has_room(kvb_pool *p, kvb__ring *r)
{
    return KVB__LIKELY(stbds_arrlenu(r->e) < stbds_arrcap(r->e)) || kvb__ring_room(p, r);
}

/* An inactive block onto the tail of its ring, which has room (kvb__ring_has_room). */
static inline void kvb__ring_push(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    kvb__ring *r = &p->rings[kvb__ring_of(m)];
    kvb__ring_entry e;
    e.idx = idx;
    e.stamp = m->stamp = r->base + (uint32_t)stbds_arrlenu(r->e);
    r->e[stbds_header(r->e)->length++] = e;
    kvb__ring_gain(p, m);
    if (stbds_arrlenu(r->e) >= 2 * ((size_t)r->live + r->held) + 64) kvb__ring_compact(p, r);
}

static void kvb__make_free(kvb_pool *p, uint32_t idx);

/* A released block its ring has no room for (out of memory): out of the cache. Kept out of line, so
 * that the release path it hangs off stays small enough to inline. */
static KVB__NOINLINE void kvb__free_for_want_of_room(kvb_pool *p, uint32_t idx) { kvb__make_free(p, idx); }

static inline void kvb__list_push(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    int ring = !(m->flags & KVB__F_QUEUED) && p->cfg.eviction != KVB_EVICT_CUSTOM;
    /* Room first, before the block is inactive (kvb__ring_room then neither keeps nor evicts an old entry
     * of it). Where even an eviction gives none (out of memory), the block leaves the cache instead, as
     * kvb_invalidate drops one: a release, which cannot fail, caches less rather than crash. */
    if (KVB__LIKELY(ring) && !kvb__ring_has_room(p, &p->rings[kvb__ring_of(m)])) {
        kvb__free_for_want_of_room(p, idx);
        return;
    }
    m->flags |= KVB__F_INACTIVE;
    p->n_inactive++;
    if (KVB__LIKELY(ring)) {
        kvb__ring_push(p, idx);
    } else if (p->cfg.eviction == KVB_EVICT_CUSTOM) {
        p->cfg.custom_eviction.on_inactive(p->cfg.custom_eviction.user, idx, m->prio);
    } else { /* S3-FIFO: back in its old place */
        m->flags &= (uint8_t)~KVB__F_QUEUED;
        kvb__ring_gain(p, m);
    }
}

static inline void kvb__list_remove(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    m->flags &= (uint8_t)~KVB__F_INACTIVE;
    p->n_inactive--;
    if (p->cfg.eviction == KVB_EVICT_CUSTOM) {
        p->cfg.custom_eviction.on_removed(p->cfg.custom_eviction.user, idx);
        return;
    }
    kvb__ring_lose(p, m); /* its entry is stale from now on */
    if (p->cfg.eviction == KVB_EVICT_S3FIFO) m->flags |= KVB__F_QUEUED; /* .. but keeps its place */
}

static inline int kvb__is_leaf(kvb_pool *p, uint32_t idx)
{
    const kvb__meta *m = &p->meta[idx];
    return !(m->flags & KVB__F_INDEXED) || m->dup_next != KVB__NIL || m->kids == 0;
}

/* ARC and S3-FIFO: the ghost-index slot of a hash mixed to `mix` in ghost list g (its home; a probe
 * rarely goes past it), fetched ahead of a lookup or a put. */
static inline void kvb__gset_prefetch(const kvb__gset *g, uint64_t mix)
{
    if (g->index) KVB__PREFETCH(&g->index[mix & g->mask]);
}

/* Victims leave a ring from its head in order, so their misses can start well before they are needed:
 * each eviction drops the stale entries at the head, then prefetches the metadata of the entry
 * 2 x KVB__VICTIM_AHEAD past it and the index slots (its own, and its parent's where child counts are
 * kept) of the entry KVB__VICTIM_AHEAD past it, whose metadata came in meanwhile, with the ghost slot
 * it will take: `ghost` 1 for FOL (its ghost table's set), 2 for ARC and S3-FIFO (the ghost list a
 * victim of its list goes to: ARC's B1 or B2, S3-FIFO's for the small queue only), 0 none. The window
 * rolls on from one call to the next. (The head's update also keeps compilers from taking a helper that
 * only prefetches for one without effects, and dropping its calls.) */
#define KVB__VICTIM_AHEAD 8
static KVB__ALWAYS_INLINE void kvb__ring_advance_to(const kvb_pool *p, kvb__ring *r, int ghost)
{
    size_t at, len = stbds_arrlenu(r->e);
    const kvb__meta *m;
    uint64_t mix;
    kvb__ring_skip_stale(p, r);
    at = r->head + KVB__VICTIM_AHEAD;
    if (at + KVB__VICTIM_AHEAD < len) KVB__PREFETCH(&p->meta[r->e[at + KVB__VICTIM_AHEAD].idx]);
    if (at >= len) return;
    m = &p->meta[r->e[at].idx];
    mix = kvb__mix(&m->hash);
    KVB__PREFETCH(&p->slots[mix & p->slot_mask]);
    if (ghost == 1 && p->fol_ghost.w) KVB__PREFETCH(kvb__gtab_set(&p->fol_ghost, mix));
    if (ghost == 2 && (m->cls == KVB__T1 || p->cfg.eviction == KVB_EVICT_ARC))
        kvb__gset_prefetch(&p->ghost[m->cls == KVB__T1 ? 0 : 1], mix);
    if (p->track_kids && !kvb__hash_is_root(&m->parent)) KVB__PREFETCH(kvb__home(p, &m->parent));
}

static inline void kvb__ring_advance(const kvb_pool *p, kvb__ring *r) { kvb__ring_advance_to(p, r, 0); }

/* The oldest of ring r's pending leaves that is still current and a leaf, or KVB__NIL; the others are
 * forgotten (stale, or parents again: the search's place holds for them). */
static uint32_t kvb__ring_pending_leaf(kvb_pool *p, kvb__ring *r)
{
    size_t best = SIZE_MAX, len = stbds_arrlenu(r->e);
    uint32_t k = 0;
    while (k < r->n_pending) {
        size_t at = (uint32_t)(r->pending[k] - r->base);
        if (at < len && at >= r->head && kvb__ring_valid(p, r, &r->e[at]) && kvb__is_leaf(p, r->e[at].idx)) {
            if (at < best) best = at;
            k++;
        } else {
            r->pending[k] = r->pending[--r->n_pending];
        }
    }
    return best == SIZE_MAX ? KVB__NIL : r->e[best].idx;
}

static int kvb__ring_is_pending(const kvb__ring *r, uint32_t stamp)
{
    uint32_t k;
    for (k = 0; k < r->n_pending; k++)
        if (r->pending[k] == stamp) return 1;
    return 0;
}

/* The oldest block of a ring (want_leaf: the oldest leaf), or KVB__NIL. Stale entries at the head are
 * dropped on the way. */
static inline uint32_t kvb__ring_victim(kvb_pool *p, uint32_t rid, int want_leaf)
{
    kvb__ring *r = &p->rings[rid];
    size_t i, len = stbds_arrlenu(r->e);
    uint32_t v;
    kvb__ring_skip_stale(p, r);
    if (!want_leaf) {
        for (i = r->head; i < len; i++)
            if (kvb__ring_valid(p, r, &r->e[i])) return r->e[i].idx;
        return KVB__NIL;
    }
    /* Parents whose children are cached stay where they are until one turns into a leaf (then it is
     * pending, kvb__became_leaf), so a search resumes where the last one stopped and passes each
     * parent once, however many come before the oldest leaf (FOL keeps shared prefixes in their own
     * class rings, in front of their children). The pending ones come before that place: the oldest
     * that is still current and a leaf goes first. */
    if (r->n_pending && (v = kvb__ring_pending_leaf(p, r)) != KVB__NIL) return v;
    for (i = r->leafless_to > r->head ? r->leafless_to : r->head; i < len; i++)
        if (kvb__ring_valid(p, r, &r->e[i]) && kvb__is_leaf(p, r->e[i].idx)) break;
    r->leafless_to = i;
    if (i >= len) return KVB__NIL;
    return r->e[i].idx;
}

/* The victim kvb__ring_victim would find, when it is ring r's head (after kvb__ring_advance: a current
 * entry), without its search: always for LRU; for leaves first, when no leaf is pending, no search stopped
 * past the head, and the head is a leaf. KVB__NIL: search. */
static inline uint32_t kvb__ring_head_victim(kvb_pool *p, kvb__ring *r, int want_leaf)
{
    uint32_t v;
    if (r->head >= stbds_arrlenu(r->e)) return KVB__NIL;
    v = r->e[r->head].idx;
    if (!want_leaf) return v;
    if (r->n_pending || r->leafless_to > r->head || !kvb__is_leaf(p, v)) return KVB__NIL;
    r->leafless_to = r->head;
    return v;
}

/* FOL, which looks at up to six rings per eviction and takes from one: a ring's oldest leaf, read straight
 * from the place its last search stopped while that entry is current and a leaf (every current entry
 * before it is a parent), else a search. */
static inline uint32_t kvb__ring_leaf(kvb_pool *p, uint32_t rid)
{
    const kvb__ring *r = &p->rings[rid];
    if (!r->n_pending && r->leafless_to < stbds_arrlenu(r->e)) {
        const kvb__ring_entry *e = &r->e[r->leafless_to];
        if (kvb__ring_valid(p, r, e) && kvb__is_leaf(p, e->idx)) return e->idx;
    }
    return kvb__ring_victim(p, rid, 1);
}

/* FOL: how far block v is from eviction in its class: age minus W[class]; larger goes first. Ages are
 * measured back from the clock, so the 32-bit clock may wrap. W[0] is -infinity with a configured
 * step, -step with the adaptive one. */
static int64_t kvb__fol_key(const kvb_pool *p, uint32_t v)
{
    const kvb__meta *m = &p->meta[v];
    if (m->cls == KVB__CLS_DEAD || (m->cls == 0 && p->fol_tails_first)) return INT64_MAX;
    return (int64_t)(uint32_t)(p->clock - m->last) - ((int64_t)m->cls - 1) * p->fol_step;
}

static int kvb__fol_before(const kvb_pool *p, uint32_t a, int64_t ka, uint32_t b, int64_t kb)
{
    return ka > kb || (ka == kb && p->meta[a].depth > p->meta[b].depth); /* ties: the deeper block */
}

/* FOL's rings roll their victim windows as LRU's do, and also fetch the ghost-index slot each coming
 * victim will take when it leaves (FOL remembers an evicted block's count): one mix of its hash for both. */
static inline void kvb__fol_ring_advance(const kvb_pool *p, kvb__ring *r) { kvb__ring_advance_to(p, r, 1); }

/* FOL: of the oldest leaf of each class ring of one level, the one with the smallest last + W[class].
 * Only leaves: a parent whose count restarted may score below its children, and evicting it would
 * orphan them (lineage_only = 0 takes the plain heads, the fallback when no leaf is found). */
static uint32_t kvb__fol_victim(kvb_pool *p, uint32_t lvl, int leaves_only)
{
    uint32_t cls, bits, best = KVB__NIL, best_rid = 0;
    int64_t best_key = 0;
    for (cls = 0, bits = p->ring_mask[lvl]; bits; cls++, bits >>= 1) {
        uint32_t rid = lvl * KVB__CLASSES + cls, v;
        int64_t key;
        if (!(bits & 1)) continue;
        if ((v = leaves_only ? kvb__ring_leaf(p, rid) : kvb__ring_victim(p, rid, 0)) == KVB__NIL) continue;
        key = kvb__fol_key(p, v);
        if (best == KVB__NIL || kvb__fol_before(p, v, key, best, best_key)) {
            best = v;
            best_key = key;
            best_rid = rid;
        }
    }
    if (best != KVB__NIL) {
        kvb__ring *r = &p->rings[best_rid];
        /* the victim leaves: a leaf search that stopped at it goes on from the next entry, so the next
         * eviction reads that one straight away (kvb__ring_leaf) instead of searching */
        if (leaves_only && r->leafless_to < stbds_arrlenu(r->e) && r->e[r->leafless_to].idx == best) r->leafless_to++;
        kvb__fol_ring_advance(p, r); /* only its head moves on */
    }
    return best;
}


/* ---- FOL's self-tuning step: miniature simulation (section 2) ---------------------------------- */

/* A shadow is a metadata-only FOL pool with one candidate step, fed the sampled blocks of every
 * request: nodes (resident or ghost) found through an open-addressing index on the hash (the shadows'
 * indexes interleaved, so that a sampled block's slots in all of them share two or three cache lines), one LRU
 * list per class, and a circle of ghosts in eviction order. All of it is allocated when the pool is
 * created. */
static int64_t kvb__tune_ladder(uint32_t k, uint32_t num_blocks)
{
    int64_t c = (int64_t)num_blocks;
    int64_t s = k == 0 ? 0 : (c << (k - 1)) / 4; /* 0, C/4, C/2, C, .. 64 C */
    return k == 0 ? 0 : s < 1 ? 1 : s > INT32_MAX ? INT32_MAX : s;
}

#define KVB__TUNE_RANK_FIRST (UINT64_C(1) << 36) /* a class that goes first */
/* The victim's order of class c in shadow sh (kvb__tune_rank), from its step and rule for tails. */
static uint64_t kvb__tune_order(const kvb__shadow *sh, uint32_t c)
{
    if (c == KVB__CLS_DEAD || (c == 0 && sh->tails_first)) return KVB__TUNE_RANK_FIRST;
    return (uint64_t)((INT64_C(1) << 34) - ((int64_t)c - 1) * sh->step);
}

/* Every shadow's rule for tails (the ladder's is the tuner's, the probe's the other) and the victim order
 * it and the shadow's step give. */
static void kvb__tune_rule(kvb__tuner *t)
{
    uint32_t k, c;
    for (k = 0; k < KVB__TUNE_K; k++) {
        kvb__shadow *sh = &t->sh[k];
        sh->tails_first = (k == KVB__TUNE_PROBE) != t->tails_first;
        for (c = 0; c < KVB__CLASSES; c++) {
            sh->order[c] = kvb__tune_order(sh, c);
            sh->age_mask[c] = sh->order[c] == KVB__TUNE_RANK_FIRST ? 0 : UINT32_MAX;
        }
    }
}

static kvb_result kvb__tune_create(kvb_pool *p)
{
    kvb__tuner *t = &p->tune;
    uint64_t c = p->cfg.num_blocks, min = KVB_FOL_SHADOW_BLOCKS, slots = 1, rate_q32;
    size_t per, index, bytes, off = 0;
    uint32_t k, i;
    unsigned char *mem;
    rate_q32 = c <= min ? (UINT64_C(1) << 32) : (min << 32) / c; /* sampled fraction, 32-bit fixed point */
    t->thresh = rate_q32;
    t->cap = (uint32_t)((c * rate_q32) >> 32);
    t->gcap = (uint32_t)(((uint64_t)p->cfg.fol_ghost * rate_q32) >> 32);
    if (t->cap < 1) t->cap = 1;
    t->nodes = t->cap + t->gcap + 1;
    while (slots < 2 * (uint64_t)t->nodes) slots <<= 1;
    t->imask = slots - 1;
    per = (size_t)t->nodes * sizeof(kvb__tnode) + ((size_t)t->gcap + 1) * sizeof(uint32_t) +
          (size_t)t->nodes * sizeof(uint32_t);
    per = (per + 63) & ~(size_t)63;
    index = ((size_t)slots * KVB__TUNE_K * sizeof(kvb__gslot) + 63) & ~(size_t)63;
    bytes = index + per * KVB__TUNE_K;
    mem = (unsigned char *)kvb__mem_alloc(&p->cfg.allocator, bytes, 64);
    if (!mem) return KVB_ENOMEM;
    memset(mem, 0, index); /* empty slots; a node is set when it is taken, the circles and stacks below */
    t->mem = mem;
    t->mem_bytes = bytes;
    t->index = (kvb__gslot *)mem;
    for (k = 0; k < KVB__TUNE_K; k++) {
        kvb__shadow *sh = &t->sh[k];
        sh->index = t->index + k;
        off = index + per * k;
        sh->node = (kvb__tnode *)(mem + off);
        off += (size_t)t->nodes * sizeof(kvb__tnode);
        sh->ghost = (uint32_t *)(mem + off);
        off += ((size_t)t->gcap + 1) * sizeof(uint32_t);
        sh->free = (uint32_t *)(mem + off);
        for (i = 0; i < t->nodes; i++) sh->free[i] = t->nodes - 1 - i;
        sh->nfree = t->nodes;
        for (i = 0; i <= t->gcap; i++) sh->ghost[i] = KVB__NIL;
        for (i = 0; i < KVB__CLASSES; i++) sh->head[i] = sh->tail[i] = KVB__NIL;
        sh->step = kvb__tune_ladder(k < KVB__TUNE_LADDER ? k : 0, p->cfg.num_blocks);
    }
    t->tails_first = KVB__TUNE_TAILS_START;
    kvb__tune_rule(t);
    p->fol_tails_first = t->tails_first;
    t->current = KVB__TUNE_START;
    t->caution = t->tails_caution = 1.0;
    p->fol_step = t->sh[t->current].step;
    return KVB_OK;
}

static void kvb__tune_free(kvb_pool *p)
{
    if (p->tune.mem) kvb__mem_free(&p->cfg.allocator, p->tune.mem, p->tune.mem_bytes);
    p->tune.mem = NULL;
}

/* Empty slot s of an open-addressing index of kvb__gslot whose slot j is index[j * stride] (the ghost
 * sets' 1, the shadows' KVB__TUNE_K): backward-shift deletion, each later entry of the run moving back
 * unless its home (lo32) lies after the gap. */
static inline void kvb__gslot_delete(kvb__gslot *index, size_t stride, uint64_t mask, uint64_t s)
{
    uint64_t i = s, j = s, k;
    for (;;) {
        j = (j + 1) & mask;
        if (!index[j * stride].ref) break;
        k = index[j * stride].lo32 & mask;
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        index[i * stride] = index[j * stride];
        i = j;
    }
    index[i * stride].ref = 0;
}

/* Shadow sh's index slot s. */
static inline kvb__gslot *kvb__tune_at(const kvb__shadow *sh, uint64_t s) { return &sh->index[s * KVB__TUNE_K]; }

/* The index slot naming key in shadow sh, or the empty slot where it would go (its number in *at). */
static inline kvb__gslot *kvb__tune_slot(const kvb__tuner *t, const kvb__shadow *sh, uint64_t key, uint64_t *at)
{
    uint64_t s = key & t->imask;
    kvb__gslot *e = kvb__tune_at(sh, s);
    while (e->ref && (e->lo32 != (uint32_t)key || sh->node[e->ref - 1].key != key))
        e = ++s <= t->imask ? e + KVB__TUNE_K : kvb__tune_at(sh, s = 0);
    *at = s;
    return e;
}

/* Forget key's node (a ghost, or an unlinked resident) and put it back on the free stack. */
static void kvb__tune_forget(const kvb__tuner *t, kvb__shadow *sh, uint64_t key)
{
    uint64_t s;
    uint32_t node = kvb__tune_slot(t, sh, key, &s)->ref - 1;
    sh->node[node].where = 0;
    sh->free[sh->nfree++] = node;
    kvb__gslot_delete(sh->index, KVB__TUNE_K, t->imask, s);
}

static void kvb__tune_unlink(kvb__shadow *sh, uint32_t x)
{
    kvb__tnode *n = &sh->node[x];
    if (n->prev != KVB__NIL) sh->node[n->prev].next = n->next;
    else sh->head[n->cls] = n->next;
    if (n->next != KVB__NIL) sh->node[n->next].prev = n->prev;
    else if ((sh->tail[n->cls] = n->prev) == KVB__NIL) sh->classes &= ~(1u << n->cls);
}

static void kvb__tune_push(kvb__shadow *sh, uint32_t x)
{
    kvb__tnode *n = &sh->node[x];
    n->prev = sh->tail[n->cls];
    n->next = KVB__NIL;
    if (n->prev != KVB__NIL) sh->node[n->prev].next = x;
    else {
        sh->head[n->cls] = x;
        sh->classes |= 1u << n->cls;
    }
    sh->tail[n->cls] = x;
}

/* The shadow's victim: FOL's rule with its own step and rule for tails, over the class heads (the largest
 * key = age - (c - 1) step, or a class that goes first; ties to the deeper block, then to the lower
 * class); blocks of the request being released (last == now) only when nothing else is left, as the
 * live pool holds them. One number ranks a head by all three, from a mask and an order per class:
 * (last != now) << 52 | (key + 2^34, or 2^36 first) << 8 | depth (|step| < 2^31, age < 2^32). */
static uint64_t kvb__tune_rank(const kvb__shadow *sh, uint32_t c, uint32_t now)
{
    const kvb__tnode *n = &sh->node[sh->head[c]];
    uint32_t age = now - n->last;
    uint64_t fresh = ((uint64_t)age + ((UINT64_C(1) << 52) - 1)) & (UINT64_C(1) << 52); /* age != 0, at bit 52 */
    return fresh + ((((uint64_t)(age & sh->age_mask[c])) + sh->order[c]) << 8) + n->depth;
}

static uint32_t kvb__tune_victim(const kvb__shadow *sh, uint32_t now)
{
    uint32_t c, bits, best = KVB__NIL;
    uint64_t best_rank = 0, rank; /* every rank is above 0 */
    for (c = 0, bits = sh->classes; bits; c++, bits >>= 1)
        if ((bits & 1u) && (rank = kvb__tune_rank(sh, c, now)) > best_rank) {
            best_rank = rank;
            best = sh->head[c];
        }
    return best;
}

/* The ghosts a shadow's next evictions push out are known in advance (the circle's next places), and
 * forgetting one reads its node and then its index slot, two misses in a row: like the live pool's
 * victim window, fetch the node of the ghost 2 x KVB__TUNE_AHEAD places on, and the slot of the one
 * KVB__TUNE_AHEAD on, whose node came in meanwhile, with the slot after it (the deletion's shift reads
 * on, and the shadows' indexes are interleaved: each slot of one is a line of its own). */
#define KVB__TUNE_AHEAD 2
static void kvb__tune_ghost_ahead(const kvb__tuner *t, const kvb__shadow *sh)
{
    uint32_t near = sh->gpos + KVB__TUNE_AHEAD, far = near + KVB__TUNE_AHEAD, x;
    if (t->gcap <= 2 * KVB__TUNE_AHEAD) return;
    near = near < t->gcap ? near : near - t->gcap;
    far = far < t->gcap ? far : far - t->gcap;
    if ((x = sh->ghost[far]) != KVB__NIL) KVB__PREFETCH(&sh->node[x]);
    if ((x = sh->ghost[near]) != KVB__NIL && sh->node[x].where == 2 && sh->node[x].gpos == near) {
        uint64_t s = sh->node[x].key & t->imask;
        KVB__PREFETCH(kvb__tune_at(sh, s));
        KVB__PREFETCH(kvb__tune_at(sh, (s + 1) & t->imask)); /* a deletion reads on; a row is 88 bytes */
    }
}

/* Evict the shadow's victim into its ghost circle (the oldest ghost goes). Returns whether a node was
 * forgotten (index slots may have moved). A call: inlined into kvb__release_touch with the rest of the
 * tuner, its victim search ran short of registers. */
static KVB__NOINLINE int kvb__tune_evict(const kvb__tuner *t, kvb__shadow *sh, uint32_t now)
{
    uint32_t v = kvb__tune_victim(sh, now), old, head;
    int forgot = 0;
    if (v == KVB__NIL) return 0;
    kvb__tune_unlink(sh, v);
    /* the class's next victim but one: its node is written when the new head goes (its prev) */
    if ((head = sh->head[sh->node[v].cls]) != KVB__NIL && sh->node[head].next != KVB__NIL)
        KVB__PREFETCH(&sh->node[sh->node[head].next]);
    sh->resident--;
    if (!t->gcap) {
        kvb__tune_forget(t, sh, sh->node[v].key);
        return 1;
    }
    old = sh->ghost[sh->gpos];
    if (old != KVB__NIL && sh->node[old].where == 2 && sh->node[old].gpos == sh->gpos) {
        kvb__tune_forget(t, sh, sh->node[old].key);
        forgot = 1;
    }
    sh->ghost[sh->gpos] = v;
    sh->node[v].gpos = sh->gpos;
    sh->node[v].where = 2;
    sh->gpos = sh->gpos + 1 < t->gcap ? sh->gpos + 1 : 0;
    kvb__tune_ghost_ahead(t, sh);
    return forgot;
}

/* FOL's class of a block with count cnt; tail as kvb__fol_touch's: seen once, a request's tail is class 0,
 * a dead one KVB__CLS_DEAD. */
static uint8_t kvb__fol_class(uint8_t cnt, int tail)
{
    if (cnt == 1 && tail) return tail == KVB__TAIL_DEAD ? KVB__CLS_DEAD : 0;
    return cnt < 4 ? cnt : 4;
}

/* One reference to a node: FOL's count, class and recency (kvb__fol_touch's rules, leaves unknown).
 * Inline: every sampled block touches a node in every shadow. */
static inline void kvb__tune_touch(const kvb_pool *p, kvb__shadow *sh, uint32_t x, uint32_t now, uint32_t depth, int tail)
{
    kvb__tnode *n = &sh->node[x];
    n->cnt = (n->cnt && (uint32_t)(now - n->last) <= p->cfg.fol_horizon) ? (uint8_t)(n->cnt < 255 ? n->cnt + 1 : 255) : 1;
    n->last = now;
    n->cls = kvb__fol_class(n->cnt, tail);
    n->depth = (uint8_t)(depth < UINT8_MAX ? depth : UINT8_MAX);
    n->where = 1;
    kvb__tune_push(sh, x);
}

/* A sampled block missed by shadow sh: back from its ghost, or new, after making room. */
static void kvb__tune_insert(const kvb_pool *p, kvb__shadow *sh, uint64_t key, uint32_t now, uint32_t depth, int tail)
{
    const kvb__tuner *t = &p->tune;
    uint64_t s;
    kvb__gslot *e = kvb__tune_slot(t, sh, key, &s);
    uint32_t x;
    if (e->ref && sh->node[e->ref - 1].where == 1) return; /* a hash twice in one request */
    if (sh->resident >= t->cap && kvb__tune_evict(t, sh, now))
        e = kvb__tune_slot(t, sh, key, &s); /* the slots moved */
    if (e->ref) {
        x = e->ref - 1; /* a ghost: its count and last touch come back */
    } else {
        x = sh->free[--sh->nfree];
        memset(&sh->node[x], 0, sizeof sh->node[x]);
        sh->node[x].key = key;
        e->lo32 = (uint32_t)key;
        e->ref = x + 1;
    }
    sh->resident++;
    kvb__tune_touch(p, sh, x, now, depth, tail);
}

/* Sampled or not, by the hash alone (mixed, so that a user's hash_fn with weak high bits samples evenly). */
static int kvb__tune_sampled(const kvb__tuner *t, const kvb_hash *h)
{
    return (((h->lo ^ h->hi) * UINT64_C(0x9e3779b97f4a7c15)) >> 32) < t->thresh;
}

/* Every shadow sees the request's sampled blocks idx[0..n) (registered ones; tail = the deepest, `kind`
 * as kvb__fol_touch's tail): first the hits (counted, then touched, deepest first), then the misses
 * come in. Returns the blocks sampled. */
/* Where the shadows keep the sampled blocks of a request: the index slots of each (all shadows' side by
 * side), then the nodes those slots name, so the misses of the shadows overlap instead of following
 * one another (in a large pool the shadows are touched rarely and are out of cache). */
static void kvb__tune_prefetch(const kvb_pool *p, const uint32_t *idx, size_t n)
{
    const kvb__tuner *t = &p->tune;
    size_t i, k, seen;
    for (int pass = 0; pass < 2; pass++)
        for (i = n, seen = 0; i-- > 0 && seen < 8;) {
            const kvb__meta *m = &p->meta[idx[i]];
            uint64_t key;
            const kvb__gslot *row;
            if (!(m->flags & KVB__F_SAMPLED)) continue;
            seen++;
            key = kvb__mix(&m->hash);
            row = &t->index[(key & t->imask) * KVB__TUNE_K];
            if (!pass) {
                KVB__PREFETCH(row); /* 88 bytes: two or three lines */
                KVB__PREFETCH(row + KVB__TUNE_K / 2);
                KVB__PREFETCH(row + KVB__TUNE_K - 1);
            } else {
                for (k = 0; k < KVB__TUNE_K; k++) {
                    const kvb__gslot *slot = kvb__tune_at(&t->sh[k], key & t->imask);
                    if (slot->ref && slot->lo32 == (uint32_t)key) KVB__PREFETCH(&t->sh[k].node[slot->ref - 1]);
                }
            }
        }
}

static size_t kvb__tune_feed(kvb_pool *p, const uint32_t *idx, size_t n, size_t tail, int kind)
{
    kvb__tuner *t = &p->tune;
    uint32_t k, now = p->clock, hit, diff, live;
    size_t i, sampled = 0;
    double live_lead = 0; /* the live pool's hits less LRU order's, in this request */
    kvb__tune_prefetch(p, idx, n);
    for (i = n; i-- > 0;) {
        const kvb__meta *m = &p->meta[idx[i]];
        uint64_t key;
        if (!(m->flags & KVB__F_SAMPLED)) continue;
        sampled++;
        key = kvb__mix(&m->hash);
        for (hit = 0, k = 0; k < KVB__TUNE_K; k++) {
            kvb__shadow *sh = &t->sh[k];
            uint64_t s;
            const kvb__gslot *e = kvb__tune_slot(t, sh, key, &s);
            uint32_t x = e->ref ? e->ref - 1 : KVB__NIL;
            if (x == KVB__NIL || sh->node[x].where != 1 || sh->node[x].last == now) continue;
            sh->score += 1.0;
            hit |= 1u << k;
            kvb__tune_unlink(sh, x);
            kvb__tune_touch(p, sh, x, now, (uint32_t)i, i == tail ? kind : 0);
        }
        /* the paired comparison's noise: blocks where k and the current (the probe: LRU order) differ; most
         * blocks hit or miss everywhere, and adding nothing leaves a count as it was */
        diff = (hit ^ (0u - ((hit >> t->current) & 1u))) & ((1u << KVB__TUNE_LADDER) - 1);
        diff |= (hit ^ (hit << KVB__TUNE_PROBE)) & (1u << KVB__TUNE_PROBE);
        for (k = 0; diff; k++, diff >>= 1)
            if (diff & 1u) t->sh[k].differ += 1.0;
        live = m->cnt != 0; /* the live pool had it cached: touched before, not registered by this request */
        t->live += (double)live;
        live_lead += (double)live - (double)(hit & 1u);
    }
    /* A request's blocks hit or miss together (a prefix), so the live pool's comparison with LRU order
     * takes the noise of whole requests: the sum of their squared differences. */
    t->live_differ += live_lead * live_lead;
    for (i = n; sampled && i-- > 0;) {
        const kvb__meta *m = &p->meta[idx[i]];
        uint64_t key;
        if (!(m->flags & KVB__F_SAMPLED)) continue;
        key = kvb__mix(&m->hash);
        for (k = 0; k < KVB__TUNE_K; k++) kvb__tune_insert(p, &t->sh[k], key, now, (uint32_t)i, i == tail ? kind : 0);
    }
    return sampled;
}

/* Sampled blocks in a shadow's turnover, counted as for a shadow of at least KVB__TUNE_MIN_CAP blocks
 * (the unit of the tuner's memory, dwells and waits). */
static uint32_t kvb__tune_turnover(const kvb__tuner *t)
{
    return t->cap > KVB__TUNE_MIN_CAP ? t->cap : KVB__TUNE_MIN_CAP;
}

/* The last few turnovers of a shadow weigh most: every count halves every KVB__TUNE_MEMORY of them. */
static void kvb__tune_decay(kvb__tuner *t, size_t sampled)
{
    uint32_t k;
    t->seen += sampled;
    if (t->seen < (uint64_t)KVB__TUNE_MEMORY * kvb__tune_turnover(t)) return;
    for (k = 0; k < KVB__TUNE_K; k++) {
        t->sh[k].score *= 0.5;
        t->sh[k].differ *= 0.5;
        t->sh[k].base *= 0.5;
    }
    t->live *= 0.5;
    t->live_differ *= 0.5;
    t->tails_base *= 0.5;
    t->caution = t->caution > 1.0 ? t->caution * 0.75 : 1.0;
    t->tails_caution = t->tails_caution > 1.0 ? t->tails_caution * 0.75 : 1.0;
    t->seen = 0;
}

/* a - b hits, less 2, is beyond the noise of the d blocks on which the two differ (z = KVB__TUNE_Z). */
static int kvb__tune_clear_lead(double a, double b, double d)
{
    double lead = a - b - 2.0;
    return lead > 0 && lead * lead > KVB__TUNE_Z * KVB__TUNE_Z * d;
}

static void kvb__tune_take(kvb_pool *p, uint32_t k)
{
    kvb__tuner *t = &p->tune;
    uint32_t j;
    for (j = 0; j < KVB__TUNE_LADDER; j++) t->sh[j].differ = 0; /* differences from the new current, from now on */
    t->current = k;
    t->lead_for = 0;
    t->since_switch = 0;
    p->fol_step = t->sh[k].step;
}

/* The live pool's own hits fell clearly behind LRU order's shadow: the switches cost more than they
 * gained. Back to LRU order, and slower to leave it again. */
static int kvb__tune_fall_back(kvb_pool *p)
{
    kvb__tuner *t = &p->tune;
    double turnover = (double)kvb__tune_turnover(t);
    if ((double)t->since_switch < turnover) return 0; /* a new step needs a turnover to fill the pool */
    if (!t->current || !kvb__tune_clear_lead(t->sh[0].score, t->live, t->live_differ)) return 0;
    kvb__tune_take(p, 0);
    t->caution = t->caution * KVB__TUNE_CAUTION < 16.0 ? t->caution * KVB__TUNE_CAUTION : 16.0;
    t->live = t->sh[0].score; /* judged afresh from here */
    t->live_differ = 0;
    return 1;
}

/* The best candidate takes over when some candidate has led the current one clearly for the dwell time
 * and the best is still gaining (a lead earned in a past phase, a burst, does not count). */
static void kvb__tune_choose(kvb_pool *p, size_t sampled)
{
    kvb__tuner *t = &p->tune;
    kvb__shadow *cur = &t->sh[t->current];
    uint32_t k, best = t->current;
    double dwell = t->caution * KVB__TUNE_DWELL * (double)kvb__tune_turnover(t);
    for (k = 0; k < KVB__TUNE_LADDER; k++)
        if (t->sh[k].score > t->sh[best].score) best = k;
    if (best == t->current || !kvb__tune_clear_lead(t->sh[best].score, cur->score, t->sh[best].differ)) {
        t->lead_for = 0;
        return;
    }
    if (!t->lead_for) /* a lead begins: what each candidate is ahead by now */
        for (k = 0; k < KVB__TUNE_LADDER; k++) t->sh[k].base = t->sh[k].score - cur->score;
    t->lead_for += sampled;
    if ((double)t->lead_for < dwell) return;
    if (t->sh[best].score - cur->score <= t->sh[best].base + KVB__TUNE_GAIN) t->lead_for = 0;
    else kvb__tune_take(p, best);
}

/* The probe (LRU order with the other rule for tails) has led LRU order clearly for the dwell time and
 * is still gaining: the pool and the ladder take its rule. The two trade tables (each then models its
 * rule), nothing is copied; the scores stay, so the ladder's stay comparable, and the probe starts level
 * with LRU order. */
static void kvb__tune_tails(kvb_pool *p, size_t sampled)
{
    kvb__tuner *t = &p->tune;
    kvb__shadow *probe = &t->sh[KVB__TUNE_PROBE], *lru = &t->sh[0], was;
    double dwell = t->tails_caution * KVB__TUNE_DWELL * (double)kvb__tune_turnover(t);
    if (!kvb__tune_clear_lead(probe->score, lru->score, probe->differ)) {
        t->tails_lead_for = 0;
        return;
    }
    if (!t->tails_lead_for) t->tails_base = probe->score - lru->score;
    t->tails_lead_for += sampled;
    if ((double)t->tails_lead_for < dwell) return;
    if (probe->score - lru->score <= t->tails_base + KVB__TUNE_GAIN) {
        t->tails_lead_for = 0;
        return;
    }
    was = *lru;
    *lru = *probe;
    lru->score = was.score;
    lru->differ = was.differ;
    lru->base = was.base;
    *probe = was;
    probe->differ = 0;
    t->tails_first = !t->tails_first;
    kvb__tune_rule(t);
    t->tails_lead_for = 0;
    t->since_switch = 0; /* the live pool changes: judged against LRU order again a turnover on */
    t->tails_caution = t->tails_caution * KVB__TUNE_CAUTION < 16.0 ? t->tails_caution * KVB__TUNE_CAUTION : 16.0;
    p->fol_tails_first = t->tails_first;
}

/* A request is released: the shadows see it, then the live pool may change its step or its rule for
 * tails. */
static void kvb__tune_request(kvb_pool *p, const uint32_t *idx, size_t n, size_t tail, int kind)
{
    size_t sampled = kvb__tune_feed(p, idx, n, tail, kind);
    if (!sampled) return;
    kvb__tune_decay(&p->tune, sampled);
    p->tune.since_switch += sampled;
    if (!kvb__tune_fall_back(p)) kvb__tune_choose(p, sampled);
    kvb__tune_tails(p, sampled);
}

/* A ghost set: a circle of exactly the last `cap` evicted hashes, found through an open-addressing
 * index on the mixed hash, like the prefix index: ARC keeps two (B1, B2), whose sizes steer it,
 * S3-FIFO one (G). (FOL's ghosts, which carry a count and need no exact size, are kvb__gtab below.)
 * Allocated when first used. */
static int kvb__gset_init(kvb__gset *g, uint32_t cap)
{
    uint64_t slots = 1;
    if (g->e) return 1;
    if (!cap) return 0;
    if (cap > UINT32_C(1) << 31) cap = UINT32_C(1) << 31; /* the slots' home is the hash's low 32 bits */
    while (slots < 2 * (uint64_t)cap) slots <<= 1;
    g->e = (kvb__ghost *)KVB_MALLOC(cap * sizeof *g->e);
    g->index = (kvb__gslot *)KVB_MALLOC(slots * sizeof *g->index);
    if (!g->e || !g->index) {
        KVB_FREE(g->e);
        KVB_FREE(g->index);
        g->e = NULL;
        g->index = NULL;
        return 0;
    }
    memset(g->e, 0, cap * sizeof *g->e);
    memset(g->index, 0, slots * sizeof *g->index);
    g->mask = slots - 1;
    g->cap = cap;
    g->pos = g->live = g->skip = 0;
    return 1;
}

static void kvb__gset_free(kvb__gset *g)
{
    KVB_FREE(g->e);
    KVB_FREE(g->index);
    memset(g, 0, sizeof *g);
}

/* The index slot naming h, or the empty slot where it would go. */
static uint64_t kvb__gset_slot(const kvb__gset *g, const kvb_hash *h)
{
    uint64_t mix = kvb__mix(h), s = mix & g->mask;
    uint32_t lo32 = (uint32_t)mix;
    while (g->index[s].ref) {
        if (g->index[s].lo32 == lo32) {
            const kvb__ghost *e = &g->e[g->index[s].ref - 1];
            if (e->hash.lo == h->lo && e->hash.hi == h->hi) break;
        }
        s = (s + 1) & g->mask;
    }
    return s;
}

/* The ghost of h, or NULL. */
static kvb__ghost *kvb__gset_find(const kvb__gset *g, const kvb_hash *h)
{
    uint64_t s;
    if (!g->e || !g->live) return NULL;
    s = kvb__gset_slot(g, h);
    return g->index[s].ref ? &g->e[g->index[s].ref - 1] : NULL;
}

/* Forget the ghost named at index slot s (backward-shift deletion). */
static void kvb__gset_drop_slot(kvb__gset *g, uint64_t s)
{
    g->e[g->index[s].ref - 1].live = 0;
    g->live--;
    kvb__gslot_delete(g->index, 1, g->mask, s);
}

/* Forget ghost e: its slot is the one on its probe path that names its circle position. */
static void kvb__gset_drop(kvb__gset *g, const kvb__ghost *e)
{
    uint64_t s = kvb__mix(&e->hash) & g->mask;
    uint32_t ref = (uint32_t)(e - g->e) + 1;
    while (g->index[s].ref != ref) s = (s + 1) & g->mask;
    kvb__gset_drop_slot(g, s);
}

/* Forget the oldest ghost. The circle runs oldest to newest from pos; `skip` slots from pos are known
 * empty, so repeated calls do not rescan them. */
static void kvb__gset_drop_oldest(kvb__gset *g)
{
    while (g->live && g->skip < g->cap) {
        kvb__ghost *e = &g->e[(g->pos + g->skip) % g->cap];
        g->skip++;
        if (e->live) {
            kvb__gset_drop(g, e);
            return;
        }
    }
}

/* The circle's oldest ghosts leave in order, each from a random index slot: the slot of the one
 * KVB__VICTIM_AHEAD places on from pos is fetched now. */
static inline void kvb__gset_fetch_ahead(const kvb__gset *g, uint32_t pos)
{
    uint32_t ahead = pos + KVB__VICTIM_AHEAD;
    if (ahead >= g->cap) ahead %= g->cap;
    if (g->e[ahead].live) kvb__gset_prefetch(g, kvb__mix(&g->e[ahead].hash));
}

/* Remember a block's hash (an older ghost of the same hash goes; when full, the oldest goes). */
static void kvb__gset_put(kvb__gset *g, uint32_t cap, const kvb_hash *h)
{
    uint32_t pos;
    uint64_t s;
    kvb__ghost *e;
    if (!kvb__gset_init(g, cap)) return;
    pos = g->pos;
    g->pos = pos + 1 < g->cap ? pos + 1 : 0;
    g->skip = g->skip ? g->skip - 1 : 0;
    kvb__gset_fetch_ahead(g, pos);
    if (g->e[pos].live) kvb__gset_drop(g, &g->e[pos]); /* the oldest leaves */
    s = kvb__gset_slot(g, h);
    if (g->index[s].ref) { /* put again: the older entry goes */
        kvb__gset_drop_slot(g, s);
        s = kvb__gset_slot(g, h);
    }
    e = &g->e[pos];
    e->hash = *h;
    e->live = 1;
    g->live++;
    g->index[s].lo32 = (uint32_t)kvb__mix(h);
    g->index[s].ref = pos + 1;
}

/* ---- FOL bookkeeping ---------------------------------------------------------------------------- */

/* One reference to a registered block by the request releasing it; tail: 1 when it is the request's
 * deepest block, KVB__TAIL_DEAD when that block is partial (self-tuning only), else 0. */
static void kvb__fol_touch(kvb_pool *p, uint32_t idx, uint32_t depth, int tail)
{
    kvb__meta *m = &p->meta[idx];
    uint64_t g;
    if (!m->cnt && p->fol_ghost.live && (g = kvb__gtab_take(&p->fol_ghost, kvb__mix(&m->hash))) != 0 &&
        (m->cnt = kvb__gtab_count(&p->fol_ghost, g)) != 0)
        m->last = (uint32_t)(g >> 32); /* first touch since it was registered: its evicted past comes back */
    m->cnt = (m->cnt && (uint32_t)(p->clock - m->last) <= p->cfg.fol_horizon) ? (uint8_t)(m->cnt < 255 ? m->cnt + 1 : 255)
                                                                              : 1;
    m->last = p->clock;
    /* Class 0 (or dead) only for a leaf: a parent that restarted at count 1 still has its children cached. */
    m->cls = kvb__fol_class(m->cnt, tail && kvb__is_leaf(p, idx) ? tail : 0);
    m->depth = (uint8_t)(depth < UINT8_MAX ? depth : UINT8_MAX);
}

/* FOL: a victim with a count leaves a ghost (its count and last touch). */
static void kvb__fol_forget(kvb_pool *p, const kvb__meta *m)
{
    if (m->cnt) kvb__gtab_put(&p->fol_ghost, &m->hash, m->cnt, m->last);
}

/* ---- ARC and S3-FIFO (section 2) ----------------------------------------------------------------- */

static int kvb__two_lists(const kvb_pool *p)
{
    return p->cfg.eviction == KVB_EVICT_ARC || p->cfg.eviction == KVB_EVICT_S3FIFO;
}

/* A registered block moves to class c (inactive ones change ring). */
static void kvb__set_cls(kvb_pool *p, uint32_t idx, uint32_t c)
{
    kvb__meta *m = &p->meta[idx];
    if (m->cls == c) return;
    /* out of memory for the ring it would go to, an inactive block stays in its class */
    if ((m->flags & KVB__F_INACTIVE) && !kvb__ring_has_room(p, &p->rings[(uint32_t)m->prio * KVB__CLASSES + c]))
        return;
    p->n_cls[m->cls]--;
    p->n_cls[c]++;
    if (m->flags & KVB__F_INACTIVE) {
        kvb__ring_lose(p, m);
        m->cls = (uint8_t)c;
        kvb__ring_push(p, idx);
    } else {
        m->cls = (uint8_t)c;
    }
}

/* The ghost-index slots kvb__two_lists_insert will probe for a hash mixed to `mix` (ARC: B1, then B2). */
static inline void kvb__two_lists_prefetch(const kvb_pool *p, uint64_t mix)
{
    if (p->ghost[0].live) kvb__gset_prefetch(&p->ghost[0], mix);
    if (p->cfg.eviction == KVB_EVICT_ARC && p->ghost[1].live) kvb__gset_prefetch(&p->ghost[1], mix);
}

/* A block is registered (a miss came in): a ghost hit sends it to T2 / the main queue; ARC's ghost
 * hits move the target size of T1 toward the list that would have kept it. */
static void kvb__two_lists_insert(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    kvb__ghost *g;
    double b1 = (double)p->ghost[0].live, b2 = (double)p->ghost[1].live, c = (double)p->cfg.num_blocks;
    m->cls = KVB__T1;
    m->cnt = 0;
    if (p->cfg.eviction == KVB_EVICT_ARC) {
        if ((g = kvb__gset_find(&p->ghost[0], &m->hash)) != NULL) {
            p->arc_p += b2 > b1 ? b2 / b1 : 1.0;
            if (p->arc_p > c) p->arc_p = c;
            kvb__gset_drop(&p->ghost[0], g);
            m->cls = KVB__T2;
        } else if ((g = kvb__gset_find(&p->ghost[1], &m->hash)) != NULL) {
            p->arc_p -= b1 > b2 ? b1 / b2 : 1.0;
            if (p->arc_p < 0) p->arc_p = 0;
            kvb__gset_drop(&p->ghost[1], g);
            m->cls = KVB__T2;
        } else { /* a new block: ARC's bounds on the ghosts, |T1| + |B1| <= c and all four lists <= 2c */
            uint32_t n = p->cfg.num_blocks;
            while (p->ghost[0].live && p->ghost[0].live + p->n_cls[KVB__T1] >= n) kvb__gset_drop_oldest(&p->ghost[0]);
            while (p->ghost[1].live && p->ghost[0].live + p->ghost[1].live + p->n_cls[KVB__T1] + p->n_cls[KVB__T2] >= 2 * n)
                kvb__gset_drop_oldest(&p->ghost[1]);
        }
    } else if ((g = kvb__gset_find(&p->ghost[0], &m->hash)) != NULL) {
        kvb__gset_drop(&p->ghost[0], g);
        m->cls = KVB__T2;
    }
    p->n_cls[m->cls]++;
}

/* A cached block is referenced again (a match, an upgrade, a rejected duplicate). */
static void kvb__two_lists_hit(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    if (p->cfg.eviction == KVB_EVICT_ARC) kvb__set_cls(p, idx, KVB__T2);
    else if (m->cnt < 3) m->cnt++; /* S3-FIFO: a hit only counts; the block keeps its place */
}

/* A victim leaves: ARC remembers it in B1 or B2 (bounded when a new block comes in); S3-FIFO remembers
 * what leaves the small queue. */
static void kvb__two_lists_evicted(kvb_pool *p, const kvb__meta *m)
{
    uint32_t c = p->cfg.num_blocks;
    if (p->cfg.eviction == KVB_EVICT_S3FIFO) {
        if (m->cls == KVB__T1) kvb__gset_put(&p->ghost[0], c, &m->hash);
        return;
    }
    kvb__gset_put(&p->ghost[m->cls == KVB__T1 ? 0 : 1], c, &m->hash);
}

/* ARC's REPLACE among the leaves of one level: T1's oldest while T1 is larger than its target p, else
 * T2's; the other list when the chosen one has no evictable leaf. */
static uint32_t kvb__arc_victim(kvb_pool *p, uint32_t lvl)
{
    uint32_t first = (p->n_cls[KVB__T1] > 0 && (double)p->n_cls[KVB__T1] > p->arc_p) ? KVB__T1 : KVB__T2, v;
    uint32_t rid = lvl * KVB__CLASSES + first, other = lvl * KVB__CLASSES + (first ^ 1u);
    if (p->rings[rid].live) kvb__ring_advance_to(p, &p->rings[rid], 2);
    if (p->rings[rid].live && (v = kvb__ring_victim(p, rid, 1)) != KVB__NIL) return v;
    if (p->rings[other].live && (v = kvb__ring_victim(p, other, 1)) != KVB__NIL) return v;
    return KVB__NIL;
}

/* S3-FIFO among the leaves of one level: while the small queue holds at least a tenth of the pool, its
 * oldest block leaves unless it was hit there (then it moves to the main queue); else the main queue's
 * oldest leaves unless its count is above 0 (then it goes round again, one count less). Blocks stay in
 * their place while in use; parents are passed over (their children go first). */
static uint32_t kvb__s3_victim(kvb_pool *p, uint32_t lvl)
{
    uint32_t target = p->cfg.num_blocks / 10 ? p->cfg.num_blocks / 10 : 1, steps = 0, q;
    uint32_t leafless = KVB__NIL; /* the queue the last pass went through to its end without a leaf */
    for (q = 0; q < 4 && steps < KVB__S3_SCAN_LIMIT; q++) {
        uint32_t cls = (p->n_cls[KVB__T1] >= target || !p->rings[lvl * KVB__CLASSES + KVB__T2].live) ? KVB__T1 : KVB__T2;
        uint32_t rid;
        kvb__ring *r;
        size_t i;
        if (cls == leafless) cls ^= 1u; /* its leaves may be in the other one (a child back from the ghost) */
        rid = lvl * KVB__CLASSES + cls;
        r = &p->rings[rid];
        if (!r->live) cls ^= 1u, rid = lvl * KVB__CLASSES + cls, r = &p->rings[rid];
        kvb__ring_advance_to(p, r, 2); /* past the dead (not rescanned), fetching what comes */
        for (i = r->head; i < stbds_arrlenu(r->e) && steps < KVB__S3_SCAN_LIMIT; i++) {
            uint32_t v = r->e[i].idx;
            kvb__meta *m = &p->meta[v];
            if (!kvb__ring_valid(p, r, &r->e[i])) continue;
            steps++;
            if (cls == KVB__T1 && m->cnt) { /* hit while small: promoted */
                m->cnt = 0;
                kvb__set_cls(p, v, KVB__T2);
                r = &p->rings[rid];
                if (p->n_cls[KVB__T1] < target) break; /* the small queue is small enough now */
                continue;
            }
            if (cls == KVB__T2 && m->cnt) { /* hit in the main queue: round again */
                uint32_t base = r->base;
                m->cnt--;
                if (stbds_arrlenu(r->e) >= stbds_arrcap(r->e) && !kvb__ring_grow(r)) continue; /* out of memory: */
                kvb__ring_lose(p, m);                                   /* it keeps its place */
                kvb__ring_push(p, v);
                r = &p->rings[rid];
                /* The push compacted this very ring (entries renumbered): scan again from its head. Else
                 * go on: passing the parents before it again for each block that goes round spent the
                 * scan's budget, and the fallback then took a block of the small queue. */
                if (r->base != base) {
                    i = r->head;
                    i--;
                }
                continue;
            }
            if (kvb__is_leaf(p, v)) return v;
        }
        leafless = i >= stbds_arrlenu(r->e) ? cls : KVB__NIL;
    }
    return KVB__NIL;
}


/* S3-FIFO's search stops after KVB__S3_SCAN_LIMIT blocks: the oldest leaf of the level's queues, small
 * first, by a plain scan, before a higher level is touched. (Not the rings' resumable leaf search: S3-FIFO
 * keeps a block's place while it is in use, which that search's bookkeeping does not follow.) Only when
 * the bounded search gave up: a level with a chain longer than the limit ahead of its leaf. */
static uint32_t kvb__leaf_of_level(kvb_pool *p, uint32_t lvl)
{
    uint32_t c;
    size_t i;
    for (c = KVB__T1; c <= KVB__T2; c++) {
        const kvb__ring *r = &p->rings[lvl * KVB__CLASSES + c];
        for (i = r->head; r->live && i < stbds_arrlenu(r->e); i++)
            if (kvb__ring_valid(p, r, &r->e[i]) && kvb__is_leaf(p, r->e[i].idx)) return r->e[i].idx;
    }
    return KVB__NIL;
}

/* The next victim under the pool's policy, lowest priority level first; KVB__NIL for none. */
static uint32_t kvb__policy_victim(kvb_pool *p)
{
    uint32_t lvl, i;
    int lineage = p->cfg.eviction == KVB_EVICT_LINEAGE;
    if (p->cfg.eviction == KVB_EVICT_CUSTOM) {
        i = p->cfg.custom_eviction.choose_victim(p->cfg.custom_eviction.user);
        return (i < p->cfg.num_blocks && (p->meta[i].flags & KVB__F_INACTIVE)) ? i : KVB__NIL;
    }
    for (lvl = 0; lvl < p->cfg.priority_levels; lvl++) {
        /* FOL, ARC and S3-FIFO: leaves only, so a higher level's leaf goes before a lower level's parent */
        if (p->cfg.eviction == KVB_EVICT_FOL) {
            if ((i = kvb__fol_victim(p, lvl, 1)) != KVB__NIL) return i;
            continue;
        }
        if (p->cfg.eviction == KVB_EVICT_ARC && (i = kvb__arc_victim(p, lvl)) != KVB__NIL) return i;
        if (p->cfg.eviction == KVB_EVICT_S3FIFO && ((i = kvb__s3_victim(p, lvl)) != KVB__NIL ||
                                                    (i = kvb__leaf_of_level(p, lvl)) != KVB__NIL))
            return i;
        if (kvb__two_lists(p) || !p->rings[lvl * KVB__CLASSES].live) continue;
        kvb__ring_advance(p, &p->rings[lvl * KVB__CLASSES]);
        if ((i = kvb__ring_victim(p, lvl * KVB__CLASSES, lineage)) != KVB__NIL) return i;
    }
    for (lvl = 0; lvl < p->cfg.priority_levels; lvl++) /* only inner blocks left: oldest of the lowest level */
        if ((p->cfg.eviction == KVB_EVICT_FOL && (i = kvb__fol_victim(p, lvl, 0)) != KVB__NIL) ||
            (i = kvb__ring_victim(p, lvl * KVB__CLASSES, 0)) != KVB__NIL ||
            (kvb__two_lists(p) && (i = kvb__ring_victim(p, lvl * KVB__CLASSES + KVB__T2, 0)) != KVB__NIL))
            return i;
    return KVB__NIL;
}

/* The same, LRU and lineage first: the oldest block (leaf) of the lowest level that has one. */
static inline uint32_t kvb__choose_victim(kvb_pool *p)
{
    uint32_t lvl, i;
    int lineage = p->cfg.eviction == KVB_EVICT_LINEAGE;
    if (!lineage && p->cfg.eviction != KVB_EVICT_LRU) {
        if (p->cfg.eviction == KVB_EVICT_FOL && (i = kvb__fol_victim(p, 0, 1)) != KVB__NIL)
            return i; /* a leaf of the lowest level: kvb__policy_victim's first answer, one call sooner */
        return kvb__policy_victim(p);
    }
    for (lvl = 0; lvl < p->cfg.priority_levels; lvl++) {
        kvb__ring *r = &p->rings[lvl * KVB__CLASSES];
        if (!r->live) continue;
        kvb__ring_advance(p, r); /* past the stale entries */
        if ((i = kvb__ring_head_victim(p, r, lineage)) != KVB__NIL) return i;
        if ((i = kvb__ring_victim(p, lvl * KVB__CLASSES, lineage)) != KVB__NIL) return i;
    }
    return kvb__policy_victim(p); /* only inner blocks left */
}

/* ---- block state changes (pool locked) ----------------------------------------------------------- */

static kvb__mut *kvb__mut_of(const kvb_pool *p, uint32_t idx)
{
    return p->mut_slot && p->mut_slot[idx] ? p->mut_buf[p->mut_slot[idx] - 1] : NULL;
}

/* Mutable states for n blocks about to be initialised, made (when every one made so far is in use) before
 * anything changes, so that kvb__mut_take cannot fail after: 0 when out of memory (those made stay on the
 * free list). The free list has room for every state, so giving one back never allocates. */
static KVB__NOINLINE int kvb__mut_make(kvb_pool *p, size_t n)
{
    size_t bytes = sizeof(kvb__mut) + sizeof(uint32_t) * p->cfg.block_tokens, made, want;
    void *buf = p->mut_buf, *fl = p->mut_free;
    int ok;
    if (!p->mut_slot) {
        p->mut_slot = (uint32_t *)kvb__mem_alloc(&p->cfg.allocator, (size_t)p->cfg.num_blocks * sizeof(uint32_t), 64);
        if (!p->mut_slot) return 0;
        memset(p->mut_slot, 0, (size_t)p->cfg.num_blocks * sizeof(uint32_t));
    }
    if (stbds_arrlenu(p->mut_free) >= n) return 1;
    made = stbds_arrlenu(p->mut_buf);
    want = made + n - stbds_arrlenu(p->mut_free);
    ok = kvb__arr_fit(&buf, sizeof *p->mut_buf, want) && kvb__arr_fit(&fl, sizeof *p->mut_free, want);
    p->mut_buf = (kvb__mut **)buf, p->mut_free = (uint32_t *)fl;
    for (; ok && made < want; made++) {
        kvb__mut *mu = (kvb__mut *)KVB_MALLOC(bytes);
        if (!mu) return 0;
        stbds_arrput(p->mut_buf, mu);
        stbds_arrput(p->mut_free, (uint32_t)made);
    }
    return ok;
}

static inline int kvb__mut_reserve(kvb_pool *p, size_t n)
{
    return KVB__LIKELY(n <= stbds_arrlenu(p->mut_free)) || kvb__mut_make(p, n); /* free states: the table exists */
}

/* A reserved mutable state for block idx. */
static kvb__mut *kvb__mut_take(kvb_pool *p, uint32_t idx)
{
    uint32_t e = stbds_arrpop(p->mut_free);
    p->mut_slot[idx] = e + 1;
    return p->mut_buf[e];
}

static void kvb__mut_drop(kvb_pool *p, uint32_t idx)
{
    if (!p->mut_slot || !p->mut_slot[idx]) return;
    stbds_arrput(p->mut_free, p->mut_slot[idx] - 1);
    p->mut_slot[idx] = 0;
}

/* Take a registered block out of the index (promoting a duplicate) or out of its duplicate chain. */
static inline void kvb__unindex(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    if (m->flags & KVB__F_INDEXED) {
        kvb__slot *s = kvb__slot_of(p, idx);
        if (m->dup_next != KVB__NIL) {
            s->ref = m->dup_next + 1;
            p->meta[m->dup_next].flags = (uint8_t)((p->meta[m->dup_next].flags & ~KVB__F_DUP) | KVB__F_INDEXED);
            p->meta[m->dup_next].kids = m->kids;
        } else {
            kvb__emit(p, KVB_EVENT_REMOVED, m);
            kvb__index_delete(p, s);
            /* its children outlive it; out of memory their count is lost (a parent evicted before its
             * children is the inner-only fallback's, or kvb_invalidate's) */
            if (m->kids) kvb__orphans_add(p, &m->hash, m->kids);
        }
    } else if (m->flags & KVB__F_DUP) {
        uint32_t c = kvb__find(p, &m->hash);
        while (p->meta[c].dup_next != idx) c = p->meta[c].dup_next;
        p->meta[c].dup_next = m->dup_next;
    }
    m->flags &= (uint8_t)~(KVB__F_INDEXED | KVB__F_DUP);
    m->dup_next = KVB__NIL;
    m->kids = 0;
    kvb__kids_add(p, &m->parent, -1, KVB__NIL);
}

/* A block as new (free state), keeping only its eviction-ring stamp; a new generation invalidates
 * every handle to it. */
static inline void kvb__reset_meta(kvb__meta *m)
{
    uint32_t gen = (m->gen + 1) & KVB__GEN_MASK, stamp = m->stamp;
    memset(m, 0, sizeof *m);
    m->gen = gen;
    m->stamp = stamp;
    m->dup_next = KVB__NIL;
}

/* A registered block leaves: out of its list's count and the index. */
static inline void kvb__forget(kvb_pool *p, uint32_t idx)
{
    if (kvb__two_lists(p)) p->n_cls[p->meta[idx].cls]--;
    kvb__unindex(p, idx);
}

/* A block onto the free stack as new. */
static void kvb__push_free(kvb_pool *p, uint32_t idx)
{
    kvb__reset_meta(&p->meta[idx]);
    p->free_stack[p->n_free++] = idx;
}

/* Any block back to the free set. */
static void kvb__make_free(kvb_pool *p, uint32_t idx)
{
    if (p->meta[idx].state == KVB_STATE_REGISTERED) kvb__forget(p, idx);
    else if (!(p->meta[idx].flags & KVB__F_SEQ)) kvb__mut_drop(p, idx);
    kvb__push_free(p, idx);
}

/* Evict inactive block idx: off its list, out of the index, reset as new. */
static inline void kvb__evict(kvb_pool *p, uint32_t idx)
{
    kvb__list_remove(p, idx);
    if (p->cfg.eviction == KVB_EVICT_FOL) kvb__fol_forget(p, &p->meta[idx]);
    else if (kvb__two_lists(p)) kvb__two_lists_evicted(p, &p->meta[idx]);
    kvb__forget(p, idx); /* inactive blocks are registered */
    kvb__reset_meta(&p->meta[idx]);
    p->stats.evictions++;
}

/* Evict the policy's victim. KVB__NIL when none. */
static inline uint32_t kvb__evict_one(kvb_pool *p)
{
    uint32_t idx = kvb__choose_victim(p);
    if (idx == KVB__NIL) return KVB__NIL; /* only a custom policy can refuse */
    kvb__evict(p, idx);
    return idx;
}

/* Room for one more entry in a full ring: grown; out of memory, made by dropping its stale entries, else
 * by evicting its oldest leaf to the free set (a leaf: no cached child loses its count), so that the
 * ring then keeps no more blocks than it has room for. 0 when none of that gives it. */
static KVB__NOINLINE int kvb__ring_room(kvb_pool *p, kvb__ring *r)
{
    uint32_t v;
    if (kvb__ring_grow(r)) return 1;
    if (!stbds_arrlenu(r->e)) return 0;
    kvb__ring_compact(p, r);
    if (stbds_arrlenu(r->e) < stbds_arrcap(r->e)) return 1;
    if ((v = kvb__ring_victim(p, r->id, 1)) == KVB__NIL) return 0;
    kvb__evict(p, v);
    p->free_stack[p->n_free++] = v;
    kvb__ring_compact(p, r);
    return stbds_arrlenu(r->e) < stbds_arrcap(r->e);
}

static inline uint32_t kvb__alloc_one(kvb_pool *p)
{
    uint32_t idx;
    kvb__meta *m;
    if (p->n_free) idx = p->free_stack[--p->n_free];
    else if ((idx = kvb__evict_one(p)) == KVB__NIL) return KVB__NIL;
    m = &p->meta[idx];
    m->state = KVB_STATE_EMPTY;
    m->refs = 1;
    p->n_active++;
    p->stats.allocations++;
    return idx;
}

/* Undo kvb__alloc_one (and an init) for a block nobody saw: back on the free stack as it was, generation
 * unchanged. */
static void kvb__unalloc(kvb_pool *p, uint32_t idx)
{
    kvb__meta *m = &p->meta[idx];
    uint32_t gen = m->gen;
    kvb__mut_drop(p, idx);
    kvb__reset_meta(m);
    m->gen = gen;
    p->free_stack[p->n_free++] = idx;
    p->n_active--;
    p->stats.allocations--;
}

static int kvb__available(const kvb_pool *p, size_t n) { return n <= (size_t)p->n_free + p->n_inactive; }

/* A reference that is not a use (kvb_pin): off the eviction list, nothing else. */
static inline void kvb__take_pin(kvb_pool *p, uint32_t idx)
{
    if (p->meta[idx].refs++ == 0) {
        kvb__list_remove(p, idx);
        p->n_active++;
    }
}

static inline void kvb__take_ref(kvb_pool *p, uint32_t idx)
{
    kvb__take_pin(p, idx);
    if (kvb__two_lists(p) && p->meta[idx].state == KVB_STATE_REGISTERED) kvb__two_lists_hit(p, idx);
}

/* The last reference to a block went: it becomes inactive (registered) or free. */
#define KVB__OWN_LEVEL UINT32_MAX /* a release's level: each block keeps the one it has (kvb_unpin) */
static KVB__ALWAYS_INLINE void kvb__unreferenced(kvb_pool *p, uint32_t idx, uint32_t prio)
{
    kvb__meta *m = &p->meta[idx];
    if (prio == KVB__OWN_LEVEL) prio = m->prio;
    p->n_active--;
    if (m->state == KVB_STATE_REGISTERED) {
        if (m->prio != prio) m->flags &= (uint8_t)~KVB__F_QUEUED; /* S3-FIFO: another level, another place */
        m->prio = (uint8_t)prio;
        kvb__list_push(p, idx);
    } else {
        kvb__make_free(p, idx);
    }
}

/* A use (kvb_release) that leaves other references behind still names the block's level: the one it goes
 * to when the last reference goes without a level of its own (kvb_unpin: a pin, an offload's copy).
 * An S3-FIFO place kept at another level is given up, as kvb__unreferenced gives it up. */
static KVB__ALWAYS_INLINE void kvb__note_level(kvb__meta *m, uint32_t prio)
{
    if (prio == KVB__OWN_LEVEL || m->prio == prio) return;
    m->flags &= (uint8_t)~KVB__F_QUEUED;
    m->prio = (uint8_t)prio;
}

/* Drop one reference; the last one makes the block inactive or free. */
static inline void kvb__drop_ref(kvb_pool *p, uint32_t idx, uint32_t prio)
{
    kvb__meta *m = &p->meta[idx];
    if (!m->refs) return; /* a caller released a reference it did not own: never wrap the count */
    if (!--m->refs) kvb__unreferenced(p, idx, prio);
}

/* FOL: a request touches its blocks idx[0..n) as it lets them go, deepest (last) first. Its tail is the
 * deepest registered block; `partial`: the request ends inside its last block, which self-tuning FOL
 * then takes, when it is the tail, for a dead one (only the same prompt can use it again). */
static void kvb__release_touch(kvb_pool *p, const uint32_t *idx, size_t n, int partial)
{
    const kvb__gtab *g = &p->fol_ghost;
    size_t i, tail = n, sampled = 0;
    int kind;
    for (i = n; i-- > 0;) { /* the deepest registered block; the sampled ones; the ghosts to look up */
        const kvb__meta *m = &p->meta[idx[i]];
        if (m->state != KVB_STATE_REGISTERED) continue;
        if (tail == n) tail = i;
        sampled += (m->flags & KVB__F_SAMPLED) != 0;
        if (!m->cnt && g->live) KVB__PREFETCH(kvb__gtab_line(g, &m->hash)); /* their misses overlap */
    }
    kind = partial && p->fol_adaptive && tail == n - 1 ? KVB__TAIL_DEAD : 1;
    if (sampled) kvb__tune_request(p, idx, n, tail, kind); /* before the touches: it reads which were cached */
    for (i = n; i-- > 0;)
        if (p->meta[idx[i]].state == KVB_STATE_REGISTERED)
            kvb__fol_touch(p, idx[i], (uint32_t)i, i == tail ? kind : 0);
    p->clock += (uint32_t)n;
}

/* A request lets go of its blocks idx[0..n), deepest (last) first: FOL touches them (unless the
 * release only drops rejected tokens), then each drops one reference. */
static void kvb__release_request(kvb_pool *p, const uint32_t *idx, size_t n, uint32_t prio, int touch, int partial)
{
    size_t i;
    if (touch && p->cfg.eviction == KVB_EVICT_FOL) kvb__release_touch(p, idx, n, partial);
    for (i = n; i-- > 0;) {
        kvb__drop_ref(p, idx[i], prio);
        if (touch && p->meta[idx[i]].refs) kvb__note_level(&p->meta[idx[i]], prio);
    }
}

/* Registration, part 1: the block's own metadata, which needs no index slot. */
static KVB__ALWAYS_INLINE void kvb__register_meta(kvb_pool *p, uint32_t idx, const kvb_hash *hash,
                                                 const kvb_hash *parent, uint32_t ntok)
{
    kvb__meta *m = &p->meta[idx];
    if (m->flags & KVB__F_SEQ) m->flags &= (uint8_t)~KVB__F_SEQ; /* a sequence's: no mutable state */
    else kvb__mut_drop(p, idx);
    m->hash = *hash;
    m->parent = parent ? *parent : m->parent;
    m->ntok = (uint16_t)ntok;
    m->state = KVB_STATE_REGISTERED;
    if (p->fol_adaptive && kvb__tune_sampled(&p->tune, hash)) m->flags |= KVB__F_SAMPLED;
}

/* Registration, part 2, after kvb__register_meta: the index (or the chain of the block indexed under
 * the same hash), the parent's count of children, the event. */
static KVB__ALWAYS_INLINE void kvb__register_index(kvb_pool *p, uint32_t idx, uint32_t old, uint64_t slot,
                                                   uint64_t mix, uint32_t near)
{
    kvb__meta *m = &p->meta[idx];
    kvb__kids_add(p, &m->parent, +1, near);
    if (old == KVB__NIL) {
        m->flags |= KVB__F_INDEXED;
        kvb__index_insert(p, idx, slot, mix);
        m->kids = kvb__orphans_take(p, &m->hash); /* children cached before it */
        kvb__emit(p, KVB_EVENT_STORED, m);
    } else { /* keep the first block matchable; chain this one behind it */
        m->flags |= KVB__F_DUP;
        m->dup_next = p->meta[old].dup_next;
        p->meta[old].dup_next = idx;
        kvb__became_leaf(p, old); /* a block with a duplicate behind it is a leaf */
    }
    if (kvb__two_lists(p)) kvb__two_lists_insert(p, idx);
}

/* The block indexed under hash (KVB__NIL: none; *slot: where it is or where it would go), counted as a
 * registration (and a duplicate). */
static KVB__ALWAYS_INLINE uint32_t kvb__register_find(kvb_pool *p, const kvb_hash *hash, uint64_t mix, uint64_t *slot)
{
    uint32_t old = kvb__find_or_empty(p, hash, mix, slot); /* the index does not change until it is used */
    p->stats.registrations++;
    if (old != KVB__NIL) p->stats.dedups++;
    return old;
}

/* Register a block under `hash`: returns the block that now carries the caller's reference (the
 * existing one when the pool rejects duplicates). `near`: the block that may index `parent` (the one
 * registered or matched just before in the same chain), or KVB__NIL. */
static inline uint32_t kvb__register_one(kvb_pool *p, uint32_t idx, const kvb_hash *hash, uint64_t mix,
                                         const kvb_hash *parent, uint32_t ntok, uint32_t near)
{
    uint64_t slot = 0;
    uint32_t old = kvb__register_find(p, hash, mix, &slot);
    if (old != KVB__NIL && p->cfg.duplicates == KVB_DUP_REJECT && p->meta[idx].refs == 1) {
        kvb__take_ref(p, old);
        kvb__drop_ref(p, idx, 0); /* not registered: back to free */
        return old;
    }
    kvb__register_meta(p, idx, hash, parent, ntok);
    kvb__register_index(p, idx, old, slot, mix, near);
    return idx;
}

static kvb_hash kvb__hash(const kvb_pool *p, const kvb_hash *parent, const uint32_t *tokens, size_t n,
                          const uint64_t *extra, size_t n_extra, uint64_t salt)
{
    kvb_hash h;
    if (!p->cfg.hash_fn) return kvb_hash_block(parent, tokens, n, extra, n_extra, salt);
    p->cfg.hash_fn(parent, tokens, n, extra, n_extra, salt, &h, p->cfg.hash_user);
    return h;
}

/* ---- pool --------------------------------------------------------------------------------------- */

/* FOL remembers the last four pools' worth of evicted hashes (section 2 says why four), up to a table
 * that stays in cache: past it, every new block's ghost lookup would be a miss to memory. */
#define KVB__FOL_GHOST_CACHED (UINT64_C(1) << 17) /* 1 MiB of ghosts */
static uint32_t kvb__fol_ghost_default(uint32_t num_blocks)
{
    uint64_t g = 4 * (uint64_t)num_blocks;
    if (g > KVB__FOL_GHOST_CACHED) g = KVB__FOL_GHOST_CACHED;
    return g < 1 ? 1 : g > KVB_FOL_GHOST_MAX ? KVB_FOL_GHOST_MAX : (uint32_t)g;
}

static kvb_result kvb__resolve_config(const kvb_pool_config *in, kvb_pool_config *c, uint64_t *block_bytes)
{
    *c = *in;
    if (!c->block_tokens) c->block_tokens = 16;
    if (c->eviction == KVB_EVICT_DEFAULT) c->eviction = KVB_EVICT_LINEAGE;
    if (c->duplicates == KVB_DUP_DEFAULT) c->duplicates = KVB_DUP_ALLOW;
    if (!c->priority_levels) c->priority_levels = 1;
    if (!c->fol_horizon) c->fol_horizon = UINT32_MAX; /* none: a count restarts only when forgotten */
    if (!c->fol_ghost) c->fol_ghost = kvb__fol_ghost_default(c->num_blocks);
    c->layout = kvb__layout_resolved(&c->layout);
    if (!c->num_blocks || c->num_blocks > INT32_MAX || c->block_tokens > KVB__MAX_BLOCK_TOKENS ||
        c->priority_levels > KVB__MAX_LEVELS || (unsigned)c->eviction >= KVB_EVICT__COUNT || c->fol_ghost > KVB_FOL_GHOST_MAX ||
        (unsigned)c->duplicates >= KVB_DUP__COUNT || (unsigned)c->storage >= KVB_STORAGE__COUNT ||
        (unsigned)c->layout.kind >= KVB_LAYOUT__COUNT || (!c->allocator.alloc != !c->allocator.free))
        return KVB_ECONFIG;
    if (c->eviction == KVB_EVICT_CUSTOM && (!c->custom_eviction.on_inactive || !c->custom_eviction.on_removed ||
                                            !c->custom_eviction.choose_victim))
        return KVB_ECONFIG;
    *block_bytes = 0;
    if (c->storage == KVB_STORAGE_NONE) return KVB_OK;
    if (!c->layout.page_bytes) return KVB_ECONFIG;
    if (c->layout.page_bytes > UINT64_MAX / c->layout.num_layers / c->layout.num_parts) return KVB_EOVERFLOW;
    *block_bytes = c->layout.page_bytes * c->layout.num_layers * c->layout.num_parts;
    if (*block_bytes > (uint64_t)SIZE_MAX / c->num_blocks) return KVB_EOVERFLOW;
    if (c->storage == KVB_STORAGE_EXTERNAL &&
        (!c->external_base || c->external_bytes < *block_bytes * c->num_blocks))
        return KVB_ECONFIG;
    return KVB_OK;
}

static void kvb__pool_free_parts(kvb_pool *p)
{
    const kvb_allocator *a = &p->cfg.allocator;
    ptrdiff_t i;
    for (i = 0; i < stbds_arrlen(p->mut_buf); i++) KVB_FREE(p->mut_buf[i]);
    stbds_arrfree(p->mut_buf);
    stbds_arrfree(p->mut_free);
    stbds_arrfree(p->scratch);
    kvb__mem_free(a, p->mut_slot, (size_t)p->cfg.num_blocks * sizeof(uint32_t));
    kvb__ctab_free(&p->orphans);
    stbds_arrfree(p->events);
    for (i = 0; i < KVB__MAX_LEVELS * KVB__CLASSES; i++) stbds_arrfree(p->rings[i].e);
    kvb__gset_free(&p->ghost[0]);
    kvb__gset_free(&p->ghost[1]);
    kvb__gtab_free(p, &p->fol_ghost);
    kvb__tune_free(p);
    kvb__mem_free(a, p->meta, p->meta_bytes);
    kvb__mem_free(a, p->slots, p->slot_bytes);
    kvb__mem_free(a, p->free_stack, (size_t)p->cfg.num_blocks * sizeof(uint32_t));
    if (p->cfg.storage == KVB_STORAGE_HOST) kvb__mem_free(a, p->storage, (size_t)p->storage_bytes);
}

KVB_API kvb_result kvb_pool_create(const kvb_pool_config *config, kvb_pool **out_pool)
{
    kvb_pool_config c;
    kvb_pool *p;
    uint64_t block_bytes, slots = 1;
    uint32_t i;
    kvb_result r;
    if (!config || !out_pool) return KVB_EINVAL;
    r = kvb__resolve_config(config, &c, &block_bytes);
    if (r != KVB_OK) return r;
    p = (kvb_pool *)kvb__mem_alloc(&c.allocator, sizeof *p, 64);
    if (!p) return KVB_ENOMEM;
    memset(p, 0, sizeof *p);
    p->cfg = c;
    p->block_bytes = block_bytes;
    p->storage_bytes = block_bytes * c.num_blocks;
    /* load <= 1/3; at most 2^32 slots, so a slot's tag holds its home */
    while (slots < 3 * (uint64_t)c.num_blocks && slots < (UINT64_C(1) << 32)) slots <<= 1;
    p->slot_mask = slots - 1;
    p->meta_bytes = (size_t)c.num_blocks * sizeof(kvb__meta);
    p->slot_bytes = (size_t)slots * sizeof(kvb__slot);
    p->meta = (kvb__meta *)kvb__mem_alloc(&c.allocator, p->meta_bytes, 64);
    p->slots = (kvb__slot *)kvb__mem_alloc(&c.allocator, p->slot_bytes, 64);
    p->free_stack = (uint32_t *)kvb__mem_alloc(&c.allocator, (size_t)c.num_blocks * sizeof(uint32_t), 64);
    if (c.storage == KVB_STORAGE_HOST)
        p->storage = (unsigned char *)kvb__mem_alloc(&c.allocator, (size_t)p->storage_bytes, KVB__STORAGE_ALIGN);
    else if (c.storage == KVB_STORAGE_EXTERNAL)
        p->storage = (unsigned char *)c.external_base;
    if (!p->meta || !p->slots || !p->free_stack || (c.storage == KVB_STORAGE_HOST && !p->storage) ||
        pthread_mutex_init(&p->lock, NULL) != 0) {
        kvb__pool_free_parts(p);
        kvb__mem_free(&c.allocator, p, sizeof *p);
        return KVB_ENOMEM;
    }
    memset(p->meta, 0, p->meta_bytes);
    memset(p->slots, 0, p->slot_bytes);
    for (i = 0; i < c.num_blocks; i++) { /* lowest index allocated first */
        p->meta[i].dup_next = KVB__NIL;
        p->meta[i].gen = 1;
        p->free_stack[i] = c.num_blocks - 1 - i;
    }
    p->n_free = c.num_blocks;
    p->fol_adaptive = c.eviction == KVB_EVICT_FOL && !c.fol_class_step;
    p->track_kids = c.eviction != KVB_EVICT_LRU && c.eviction != KVB_EVICT_CUSTOM;
    for (i = 0; i < KVB__MAX_LEVELS * KVB__CLASSES; i++) p->rings[i].id = (uint32_t)i;
    p->fol_step = c.fol_class_step;
    p->fol_tails_first = !p->fol_adaptive;
    if ((c.eviction == KVB_EVICT_FOL && !kvb__gtab_init(p, &p->fol_ghost, c.fol_ghost)) ||
        (p->fol_adaptive && kvb__tune_create(p) != KVB_OK)) {
        pthread_mutex_destroy(&p->lock);
        kvb__pool_free_parts(p);
        kvb__mem_free(&c.allocator, p, sizeof *p);
        return KVB_ENOMEM;
    }
    *out_pool = p;
    return KVB_OK;
}

KVB_API void kvb_pool_destroy(kvb_pool *pool)
{
    kvb_allocator a;
    if (!pool) return;
    a = pool->cfg.allocator;
    pthread_mutex_destroy(&pool->lock);
    kvb__pool_free_parts(pool);
    kvb__mem_free(&a, pool, sizeof *pool);
}

KVB_API kvb_result kvb_pool_get_config(const kvb_pool *pool, kvb_pool_config *out)
{
    if (!pool || !out) return KVB_EINVAL;
    *out = pool->cfg;
    return KVB_OK;
}

/* An inactive block with hash h (the indexed one or a duplicate), or KVB__NIL. */
static uint32_t kvb__inactive_of(const kvb_pool *p, const kvb_hash *h)
{
    uint32_t x;
    for (x = kvb__find(p, h); x != KVB__NIL; x = p->meta[x].dup_next)
        if (!p->meta[x].refs) return x;
    return KVB__NIL;
}

KVB_API kvb_result kvb_invalidate(kvb_pool *pool, const kvb_hash *hashes, size_t n, size_t *out_dropped)
{
    size_t i, dropped = 0;
    uint32_t idx;
    if (!pool || (n && !hashes)) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    for (i = 0; i < n; i++)
        while ((idx = kvb__inactive_of(pool, &hashes[i])) != KVB__NIL) {
            kvb__list_remove(pool, idx);
            kvb__make_free(pool, idx);
            dropped++;
        }
    pool->stats.invalidated += dropped;
    kvb__unlock(pool);
    if (out_dropped) *out_dropped = dropped;
    return KVB_OK;
}

KVB_API kvb_result kvb_pool_get_stats(kvb_pool *pool, kvb_pool_stats *out)
{
    if (!pool || !out) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    *out = pool->stats;
    out->num_blocks = pool->cfg.num_blocks;
    out->free_blocks = pool->n_free;
    out->active_blocks = pool->n_active;
    out->inactive_blocks = pool->n_inactive;
    out->cached_hashes = pool->n_cached;
    out->fol_class_step = pool->cfg.eviction == KVB_EVICT_FOL ? (uint32_t)pool->fol_step : 0;
    out->fol_tails_first = pool->cfg.eviction == KVB_EVICT_FOL ? (uint32_t)pool->fol_tails_first : 0;
    if (kvb__two_lists(pool)) {
        out->list_blocks[0] = pool->n_cls[KVB__T1];
        out->list_blocks[1] = pool->n_cls[KVB__T2];
    }
    out->ghost_blocks[0] = pool->cfg.eviction == KVB_EVICT_FOL ? pool->fol_ghost.live : pool->ghost[0].live;
    out->ghost_blocks[1] = pool->ghost[1].live;
    out->arc_target = pool->cfg.eviction == KVB_EVICT_ARC ? (uint32_t)(pool->arc_p + 0.5) : 0;
    pthread_mutex_unlock(&pool->lock);
    return KVB_OK;
}

KVB_API kvb_result kvb_pool_storage(const kvb_pool *pool, void **out_base, uint64_t *out_bytes,
                                    uint64_t *out_block_bytes, kvb_layout *out_layout)
{
    if (!pool) return KVB_EINVAL;
    if (out_base) *out_base = pool->storage;
    if (out_bytes) *out_bytes = pool->storage_bytes;
    if (out_block_bytes) *out_block_bytes = pool->block_bytes;
    if (out_layout) *out_layout = pool->cfg.layout;
    return KVB_OK;
}

KVB_API kvb_result kvb_pool_reset(kvb_pool *pool)
{
    uint32_t i;
    kvb_pool_config *c;
    if (!pool) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (pool->n_active) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_EBUSY;
    }
    c = &pool->cfg;
    for (i = 0; i < c->num_blocks; i++) {
        kvb__meta *m = &pool->meta[i];
        if (!(m->flags & KVB__F_INACTIVE)) continue;
        if (c->eviction == KVB_EVICT_CUSTOM) c->custom_eviction.on_removed(c->custom_eviction.user, i);
        kvb__push_free(pool, i);
    }
    pool->n_inactive = 0;
    pool->n_cached = 0;
    memset(pool->n_cls, 0, sizeof pool->n_cls); /* no block is active: every registered one went */
    memset(pool->slots, 0, pool->slot_bytes);
    if (pool->orphans.e) memset(pool->orphans.e, 0, (size_t)(pool->orphans.mask + 1) * sizeof *pool->orphans.e);
    pool->orphans.used = 0;
    for (i = 0; i < KVB__MAX_LEVELS * KVB__CLASSES; i++) {
        KVB__ARR_SHRINK(pool->rings[i].e, 0);
        pool->rings[i].head = 0;
        pool->rings[i].live = 0;
        pool->rings[i].held = 0;
        pool->rings[i].leafless_to = 0;
        pool->rings[i].n_pending = 0;
    }
    memset(pool->ring_mask, 0, sizeof pool->ring_mask);
    kvb__emit(pool, KVB_EVENT_CLEARED, NULL);
    kvb__unlock(pool);
    return KVB_OK;
}

/* ---- blocks ------------------------------------------------------------------------------------- */

KVB_API kvb_result kvb_alloc(kvb_pool *pool, size_t n, kvb_block *out)
{
    size_t i;
    if (!pool || (!out && n)) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!kvb__available(pool, n)) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOSPACE;
    }
    for (i = 0; i < n; i++) {
        uint32_t idx = kvb__alloc_one(pool);
        if (idx == KVB__NIL) { /* a custom policy refused: give back what this call took */
            while (i-- > 0) kvb__unalloc(pool, kvb_block_index(out[i].id));
            kvb__unlock(pool);
            return KVB_ENOSPACE;
        }
        out[i] = kvb__block_of(pool, idx);
    }
    kvb__unlock(pool);
    return KVB_OK;
}

/* Resolve n strong handles into idx (caller-provided), all or nothing. */
static kvb_result kvb__strong_all(const kvb_pool *p, const kvb_block *blocks, size_t n, uint32_t *idx)
{
    size_t i;
    for (i = 0; i < n; i++) {
        kvb_result r = kvb__strong(p, blocks[i], &idx[i]);
        if (r != KVB_OK) return r;
    }
    return KVB_OK;
}

/* Block indices of one call (pool locked): small arrays on the stack, larger ones in the pool's scratch
 * array, which only grows (to the largest call seen), so the steady state allocates nothing. */
#define KVB__SCRATCH 64
static uint32_t *kvb__scratch(kvb_pool *p, uint32_t *stack, size_t n)
{
    void *a = p->scratch;
    if (n <= KVB__SCRATCH) return stack;
    if (!kvb__arr_fit(&a, sizeof *p->scratch, n)) return NULL;
    p->scratch = (uint32_t *)a;
    return p->scratch;
}

KVB_API kvb_result kvb_retain(kvb_pool *pool, const kvb_block *blocks, size_t n)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    size_t i;
    kvb_result r;
    if (!pool || (!blocks && n)) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    r = kvb__strong_all(pool, blocks, n, idx);
    if (r == KVB_OK)
        for (i = 0; i < n; i++) pool->meta[idx[i]].refs++;
    kvb__unlock(pool);
    return r;
}

/* Drop one reference from each of idx[0..n), deepest (last) first. Validates first: on a double
 * release (more drops of a block than it has references) nothing changes. */
static kvb_result kvb__release_all(kvb_pool *p, const uint32_t *idx, size_t n, uint32_t prio, int touch, int partial)
{
    size_t i, bad = n;
    for (i = 0; i < n; i++) {
        if (p->meta[idx[i]].refs == 0) {
            bad = i;
            break;
        }
        p->meta[idx[i]].refs--; /* tentative */
    }
    if (bad < n) {
        while (i-- > 0) p->meta[idx[i]].refs++;
        return KVB_EDOUBLE;
    }
    for (i = 0; i < n; i++) p->meta[idx[i]].refs++;
    kvb__release_request(p, idx, n, prio, touch, partial);
    return KVB_OK;
}

/* kvb_release's one pass: resolve each handle and take its reference off, tentatively (marked). Returns 0
 * with nothing changed at the first bad handle, count at zero or block met twice; the careful path then
 * finds the exact error, or releases the repeated block in order. */
static int kvb__release_take(kvb_pool *p, const kvb_block *blocks, size_t n, uint32_t *idx)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint64_t id = blocks[i].id;
        uint32_t x = (uint32_t)id - 1; /* handle 0 wraps out of range */
        kvb__meta *m = &p->meta[x < p->cfg.num_blocks ? x : 0];
        if ((id & KVB_WEAK_BIT) || x >= p->cfg.num_blocks || m->state == KVB__S_FREE ||
            m->gen != ((uint32_t)(id >> 32) & KVB__GEN_MASK) || !m->refs || (m->flags & KVB__F_MARK))
            break;
        m->refs--;
        m->flags |= KVB__F_MARK;
        idx[i] = x;
    }
    if (i == n) return 1;
    while (i-- > 0) {
        p->meta[idx[i]].refs++;
        p->meta[idx[i]].flags &= (uint8_t)~KVB__F_MARK;
    }
    return 0;
}

/* The references kvb__release_take took off: the unreferenced blocks leave, deepest first (FOL counts the
 * release as a use when `touch`: not for pins). */
static KVB__ALWAYS_INLINE void kvb__release_taken(kvb_pool *p, const uint32_t *idx, size_t n, uint32_t prio, int touch,
                                                  int partial)
{
    size_t i;
    if (touch && p->cfg.eviction == KVB_EVICT_FOL) kvb__release_touch(p, idx, n, partial);
    for (i = n; i-- > 0;) {
        kvb__meta *m = &p->meta[idx[i]];
        m->flags &= (uint8_t)~KVB__F_MARK;
        if (!m->refs) kvb__unreferenced(p, idx[i], prio);
        else if (touch) kvb__note_level(m, prio);
    }
}

/* kvb_release and kvb_unpin, arguments checked: one reference off each block, all or nothing. */
static KVB__ALWAYS_INLINE kvb_result kvb__release_blocks(kvb_pool *pool, const kvb_block *blocks, size_t n, uint32_t prio,
                                                        int touch, int partial)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    size_t i;
    kvb_result r = KVB_OK;
    if (!n) return KVB_OK;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    if (KVB__LIKELY(kvb__release_take(pool, blocks, n, idx))) {
        kvb__release_taken(pool, idx, n, prio, touch, partial);
        kvb__unlock(pool);
        return KVB_OK;
    }
    for (i = 0; i < n && r == KVB_OK; i++) {
        if (blocks[i].id & KVB_WEAK_BIT) r = KVB_EWEAK;
        else if ((r = kvb__lookup_handle(pool, blocks[i].id, &idx[i])) == KVB_OK && !pool->meta[idx[i]].refs)
            r = KVB_EDOUBLE;
    }
    if (r == KVB_OK) r = kvb__release_all(pool, idx, n, prio, touch, partial);
    kvb__unlock(pool);
    return r;
}

KVB_API kvb_result kvb_release(kvb_pool *pool, const kvb_block *blocks, size_t n, const kvb_release_opts *opts)
{
    uint32_t prio = opts ? opts->priority : 0, last = opts ? opts->last_block_tokens : 0;
    if (!pool || (!blocks && n)) return KVB_EINVAL;
    if (prio >= pool->cfg.priority_levels || last > pool->cfg.block_tokens) return KVB_ERANGE;
    return kvb__release_blocks(pool, blocks, n, prio, 1, last && last < pool->cfg.block_tokens);
}

KVB_API kvb_result kvb_unpin(kvb_pool *pool, const kvb_block *blocks, size_t n)
{
    if (!pool || (!blocks && n)) return KVB_EINVAL;
    return kvb__release_blocks(pool, blocks, n, KVB__OWN_LEVEL, 0, 0);
}

KVB_API kvb_result kvb_block_get_info(kvb_pool *pool, uint64_t handle_id, kvb_block_info *out)
{
    uint32_t idx;
    kvb_result r;
    if (!pool || !out) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    r = kvb__lookup_handle(pool, handle_id, &idx);
    if (r == KVB_OK) {
        const kvb__meta *m = &pool->meta[idx];
        memset(out, 0, sizeof *out);
        out->state = (kvb_block_state)m->state;
        out->index = idx;
        out->refs = m->refs;
        out->num_tokens = m->ntok;
        out->priority = m->prio;
        out->hash = m->hash;
        out->parent = m->parent;
    }
    pthread_mutex_unlock(&pool->lock);
    return r;
}

/* Lock the pool and resolve a strong handle in the expected state; on failure the pool is unlocked. */
static kvb_result kvb__lock_block(kvb_pool *p, kvb_block b, int state, uint32_t *idx)
{
    kvb_result r;
    pthread_mutex_lock(&p->lock);
    r = kvb__strong(p, b, idx);
    if (r == KVB_OK && p->meta[*idx].state != state) r = KVB_ESTATE;
    if (r != KVB_OK) pthread_mutex_unlock(&p->lock);
    return r;
}

/* Empty -> Partial with a mutable state kvb__mut_reserve made. */
static void kvb__init_reserved(kvb_pool *p, uint32_t idx, const kvb_hash *parent, uint64_t salt,
                               const uint64_t *extra, size_t n_extra)
{
    kvb__mut *mu = kvb__mut_take(p, idx);
    kvb__meta *m = &p->meta[idx];
    memset(mu, 0, sizeof *mu);
    mu->salt = salt;
    mu->n_extra = (uint32_t)n_extra;
    if (n_extra) memcpy(mu->extra, extra, n_extra * sizeof *extra);
    if (parent) m->parent = *parent;
    else memset(&m->parent, 0, sizeof m->parent);
    m->ntok = 0;
    m->state = KVB_STATE_PARTIAL;
}

/* Empty -> Partial for a sequence: no mutable state (the tokens stay in the sequence, whose hashes are
 * computed as blocks fill; a commit registers with them). Fewer lines touched per new block: a decode
 * crossing a block boundary is the scheduler step's main cost in a large batch. */
static void kvb__init_seq(kvb_pool *p, uint32_t idx, const kvb_hash *parent)
{
    kvb__meta *m = &p->meta[idx];
    if (parent) m->parent = *parent;
    else memset(&m->parent, 0, sizeof m->parent);
    m->ntok = 0;
    m->state = KVB_STATE_PARTIAL;
    m->flags |= KVB__F_SEQ;
}

KVB_API kvb_result kvb_block_init(kvb_pool *pool, kvb_block block, const kvb_hash *parent, uint64_t salt,
                                  const uint64_t *extra, size_t n_extra)
{
    uint32_t idx;
    kvb_result r;
    if (!pool || (!extra && n_extra)) return KVB_EINVAL;
    if (n_extra > KVB_MAX_EXTRA_KEYS) return KVB_ERANGE;
    if ((r = kvb__lock_block(pool, block, KVB_STATE_EMPTY, &idx)) != KVB_OK) return r;
    if (kvb__mut_reserve(pool, 1)) kvb__init_reserved(pool, idx, parent, salt, extra, n_extra);
    else r = KVB_ENOMEM;
    kvb__unlock(pool);
    return r;
}

static void kvb__add_tokens(kvb_pool *p, uint32_t idx, const uint32_t *tokens, size_t n, int ready)
{
    kvb__meta *m = &p->meta[idx];
    kvb__mut *mu = kvb__mut_of(p, idx);
    if (n) memcpy(mu->tokens + m->ntok, tokens, n * sizeof *tokens);
    m->ntok = (uint16_t)(m->ntok + n);
    m->state = (m->ntok == p->cfg.block_tokens || ready) ? KVB_STATE_READY : KVB_STATE_PARTIAL;
}

/* A sequence's block holds n more of its tokens (kept in the sequence). */
static void kvb__seq_add_tokens(kvb_pool *p, uint32_t idx, size_t n)
{
    kvb__meta *m = &p->meta[idx];
    m->ntok = (uint16_t)(m->ntok + n);
    m->state = m->ntok == p->cfg.block_tokens ? KVB_STATE_READY : KVB_STATE_PARTIAL;
}

KVB_API kvb_result kvb_block_add_tokens(kvb_pool *pool, kvb_block block, const uint32_t *tokens, size_t n,
                                        int ready)
{
    uint32_t idx;
    kvb_result r;
    if (!pool || (!tokens && n)) return KVB_EINVAL;
    if ((r = kvb__lock_block(pool, block, KVB_STATE_PARTIAL, &idx)) != KVB_OK) return r;
    if (pool->meta[idx].flags & KVB__F_SEQ) r = KVB_ESTATE; /* its sequence's tokens: kvb_seq_append */
    else if (n > (size_t)pool->cfg.block_tokens - pool->meta[idx].ntok) r = KVB_ERANGE;
    else kvb__add_tokens(pool, idx, tokens, n, ready);
    kvb__unlock(pool);
    return r;
}

/* One step of the lifecycle table for a locked, resolved block. */
static void kvb__advance(kvb_pool *p, uint32_t idx, int to)
{
    kvb__meta *m = &p->meta[idx];
    if (to == KVB_STATE_COMPLETE && m->ntok < p->cfg.block_tokens) to = KVB_STATE_PARTIAL;
    m->state = (uint8_t)to;
}

static kvb_result kvb__transition(kvb_pool *p, kvb_block b, int from, int to)
{
    uint32_t idx;
    kvb_result r;
    if (!p) return KVB_EINVAL;
    if ((r = kvb__lock_block(p, b, from, &idx)) != KVB_OK) return r;
    kvb__advance(p, idx, to);
    kvb__unlock(p);
    return KVB_OK;
}

KVB_API kvb_result kvb_block_schedule(kvb_pool *pool, kvb_block block)
{
    return kvb__transition(pool, block, KVB_STATE_READY, KVB_STATE_INFLIGHT);
}

KVB_API kvb_result kvb_block_cancel_schedule(kvb_pool *pool, kvb_block block)
{
    return kvb__transition(pool, block, KVB_STATE_READY, KVB_STATE_PARTIAL);
}

KVB_API kvb_result kvb_block_compute_done(kvb_pool *pool, kvb_block block)
{
    return kvb__transition(pool, block, KVB_STATE_INFLIGHT, KVB_STATE_COMPLETE);
}

/* Validate handles for registration: strong, in `state`, each block once. */
static kvb_result kvb__check_for_register(kvb_pool *p, const kvb_block *blocks, size_t n, int state,
                                          uint32_t *idx)
{
    size_t i;
    kvb_result r;
    for (i = 0; i < n; i++) { /* the usual case in one pass: strong, current, referenced, in state, once */
        uint64_t id = blocks[i].id;
        uint32_t x = (uint32_t)id - 1; /* handle 0 wraps out of range */
        kvb__meta *m = &p->meta[x < p->cfg.num_blocks ? x : 0];
        if ((id & KVB_WEAK_BIT) || x >= p->cfg.num_blocks || m->state != state ||
            m->gen != ((uint32_t)(id >> 32) & KVB__GEN_MASK) || !m->refs ||
            (m->flags & (KVB__F_MARK | KVB__F_SEQ)))
            break;
        m->flags |= KVB__F_MARK;
        idx[i] = x;
    }
    r = i == n ? KVB_OK : KVB_EINVAL; /* a bad one: its exact error from the careful checks below */
    while (i-- > 0) p->meta[idx[i]].flags &= (uint8_t)~KVB__F_MARK;
    if (r == KVB_OK) return r;
    r = kvb__strong_all(p, blocks, n, idx);
    for (i = 0; r == KVB_OK && i < n; i++) {
        if (p->meta[idx[i]].state != state || (p->meta[idx[i]].flags & KVB__F_SEQ))
            r = KVB_ESTATE; /* a sequence's block: kvb_seq_commit registers it */
        else if (p->meta[idx[i]].flags & KVB__F_MARK) r = KVB_EINVAL; /* same block twice */
        else p->meta[idx[i]].flags |= KVB__F_MARK;
    }
    while (i-- > 0) p->meta[idx[i]].flags &= (uint8_t)~KVB__F_MARK;
    return r;
}

KVB_API kvb_result kvb_register(kvb_pool *pool, const kvb_block *blocks, size_t n, kvb_block *out)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    size_t i;
    kvb_result r;
    if (!pool || (n && (!blocks || !out))) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    r = kvb__check_for_register(pool, blocks, n, KVB_STATE_COMPLETE, idx);
    if (r == KVB_OK && !kvb__orphans_room(pool, n)) r = KVB_ENOMEM; /* parents chained or not: unknown yet */
    for (i = 0; r == KVB_OK && i < n; i++) {
        kvb__meta *m = &pool->meta[idx[i]];
        kvb__mut *mu = kvb__mut_of(pool, idx[i]);
        kvb_hash parent = m->parent;
        kvb_hash h = kvb__hash(pool, &parent, mu->tokens, m->ntok, mu->extra, mu->n_extra, mu->salt);
        out[i] = kvb__block_of(pool, kvb__register_one(pool, idx[i], &h, kvb__mix(&h), &parent, m->ntok,
                                                       i ? kvb_block_index(out[i - 1].id) : KVB__NIL));
    }
    kvb__unlock(pool);
    return r;
}

KVB_API kvb_result kvb_register_hashed(kvb_pool *pool, const kvb_block *blocks, size_t n,
                                       const kvb_hash *hashes, const kvb_hash *parents, kvb_block *out)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    uint64_t mix[KVB__SCRATCH]; /* of the first hashes: computed for the prefetch, used to register */
    size_t i, unchained = 0; /* blocks whose parent is not the hash before them: it may be missing */
    kvb_result r;
    kvb_hash root = {0, 0};
    if (!pool || (n && (!blocks || !out || !hashes))) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    for (i = 0; i < n; i++) { /* they come in while kvb__check_for_register runs */
        uint64_t x = kvb__mix(&hashes[i]);
        if (i < KVB__SCRATCH) mix[i] = x;
        KVB__PREFETCH(&pool->slots[x & pool->slot_mask]);
        if (parents && pool->track_kids && !(i && kvb__same_hash(&parents[i], &hashes[i - 1])) && /* else: near */
            !kvb__hash_is_root(&parents[i])) {
            KVB__PREFETCH(kvb__home(pool, &parents[i]));
            unchained++;
        }
    }
    if (kvb__two_lists(pool)) /* and their ghost lookups */
        for (i = 0; i < n && i < KVB__SCRATCH; i++) kvb__two_lists_prefetch(pool, mix[i]);
    r = kvb__check_for_register(pool, blocks, n, KVB_STATE_EMPTY, idx);
    if (r == KVB_OK && !kvb__orphans_room(pool, unchained)) r = KVB_ENOMEM;
    if (r == KVB_OK && pool->cfg.duplicates != KVB_DUP_REJECT && n <= KVB__SCRATCH) {
        /* every block is registered: the metadata of all first, while the index slots come in */
        for (i = 0; i < n; i++) kvb__register_meta(pool, idx[i], &hashes[i], parents ? &parents[i] : &root,
                                                   pool->cfg.block_tokens);
        for (i = 0; i < n; i++) {
            uint64_t slot = 0;
            uint32_t old = kvb__register_find(pool, &hashes[i], mix[i], &slot);
            kvb__register_index(pool, idx[i], old, slot, mix[i], i ? idx[i - 1] : KVB__NIL);
            out[i] = kvb__block_of(pool, idx[i]);
        }
    } else {
        for (i = 0; r == KVB_OK && i < n; i++)
            out[i] = kvb__block_of(pool, kvb__register_one(pool, idx[i], &hashes[i],
                                                           i < KVB__SCRATCH ? mix[i] : kvb__mix(&hashes[i]),
                                                           parents ? &parents[i] : &root,
                                                           pool->cfg.block_tokens,
                                                           i ? kvb_block_index(out[i - 1].id) : KVB__NIL));
    }
    kvb__unlock(pool);
    return r;
}

/* Probe the index slots for h without touching block metadata: the candidate block or KVB__NIL. */
static inline uint32_t kvb__probe(const kvb_pool *p, uint64_t mix)
{
    uint64_t pos = mix & p->slot_mask;
    uint32_t tag = (uint32_t)mix;
    for (; p->slots[pos].ref; pos = (pos + 1) & p->slot_mask)
        if (p->slots[pos].tag == tag) return p->slots[pos].ref - 1;
    return KVB__NIL;
}

/* Length of the longest cached prefix, block indices in idx. The slots are probed in order with the
 * slot KVB__SLOT_AHEAD hashes on already on its way (their mixes kept until their turn), and the
 * metadata of each candidate is prefetched as it is found, so a long chain keeps many misses in flight;
 * a second pass confirms the full hashes (a slot holds 32 bits of them) on metadata that has arrived by
 * then. */
#define KVB__SLOT_AHEAD 16 /* a power of two */
static size_t kvb__prefix(kvb_pool *p, const kvb_hash *hashes, size_t n, uint32_t *idx)
{
    uint64_t mix[KVB__SLOT_AHEAD], next; /* hash i's at i % KVB__SLOT_AHEAD */
    size_t i, k = n;
    for (i = 0; i < n && i < KVB__SLOT_AHEAD; i++) {
        mix[i] = kvb__mix(&hashes[i]);
        KVB__PREFETCH(&p->slots[mix[i] & p->slot_mask]);
    }
    for (i = 0; i < n; i++) {
        uint64_t own = mix[i % KVB__SLOT_AHEAD];
        if (i + KVB__SLOT_AHEAD < n) {
            mix[i % KVB__SLOT_AHEAD] = next = kvb__mix(&hashes[i + KVB__SLOT_AHEAD]);
            KVB__PREFETCH(&p->slots[next & p->slot_mask]);
        }
        if ((idx[i] = kvb__probe(p, own)) == KVB__NIL) {
            k = i;
            break;
        }
        KVB__PREFETCH(&p->meta[idx[i]]);
    }
    for (i = 0; i < k; i++)
        if (!kvb__same_hash(&p->meta[idx[i]].hash, &hashes[i]) && (idx[i] = kvb__find(p, &hashes[i])) == KVB__NIL)
            return i;
    return k;
}

/* Take references on the k matched blocks of a lookup of n hashes, and count it. */
static void kvb__take_matched(kvb_pool *p, const uint32_t *idx, size_t k, size_t n, kvb_block *out)
{
    size_t i;
    for (i = 0; i < k; i++) {
        kvb__take_ref(p, idx[i]);
        if (out) out[i] = kvb__block_of(p, idx[i]);
        p->stats.hit_tokens += p->meta[idx[i]].ntok;
    }
    p->stats.lookups++;
    p->stats.lookup_blocks += n;
    p->stats.hit_blocks += k;
}

/* kvb_match (a use: counted, the policy told) and kvb_pin (neither). */
static KVB__ALWAYS_INLINE kvb_result kvb__match_prefix(kvb_pool *pool, const kvb_hash *hashes, size_t n,
                                                       kvb_block *out_blocks, size_t *out_n, int use)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    size_t i, k;
    if (!pool || !out_n || (n && (!hashes || !out_blocks))) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    k = kvb__prefix(pool, hashes, n, idx);
    if (use) kvb__take_matched(pool, idx, k, n, out_blocks);
    else
        for (i = 0; i < k; i++) {
            kvb__take_pin(pool, idx[i]);
            out_blocks[i] = kvb__block_of(pool, idx[i]);
        }
    *out_n = k;
    kvb__unlock(pool);
    return KVB_OK;
}

KVB_API kvb_result kvb_match(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks, size_t *out_n)
{
    return kvb__match_prefix(pool, hashes, n, out_blocks, out_n, 1);
}

KVB_API kvb_result kvb_pin(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks, size_t *out_n)
{
    return kvb__match_prefix(pool, hashes, n, out_blocks, out_n, 0);
}

KVB_API kvb_result kvb_request_begin(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *out_blocks,
                                     size_t *out_cached)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    uint64_t mix[KVB__SCRATCH]; /* of the first misses: computed for the prefetch, used to register */
    size_t k, i, inactive_hit = 0;
    kvb_hash root = {0, 0};
    if (!pool || !out_cached || (n && (!hashes || !out_blocks)) || pool->cfg.eviction == KVB_EVICT_CUSTOM)
        return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    k = kvb__prefix(pool, hashes, n, idx);
    for (i = 0; i < k; i++) inactive_hit += pool->meta[idx[i]].refs++ == 0; /* each block once */
    for (i = 0; i < k; i++) pool->meta[idx[i]].refs--;
    if (n - k > (size_t)pool->n_free + pool->n_inactive - inactive_hit) { /* matched blocks stay cached */
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOSPACE;
    }
    /* each new block's event, and those of the evictions it makes */
    if (!kvb__events_room(pool, 2 * (n - k) - (n - k < pool->n_free ? n - k : pool->n_free))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    kvb__take_matched(pool, idx, k, n, out_blocks);
    /* The first KVB__SCRATCH misses' index slots (and ghost lookups) are fetched while their blocks are
     * found; each later one's as the one KVB__SCRATCH before it registers (its mix where that one's was). */
    for (i = k; i < n && i - k < KVB__SCRATCH; i++) {
        mix[i - k] = kvb__mix(&hashes[i]);
        KVB__PREFETCH(&pool->slots[mix[i - k] & pool->slot_mask]);
    }
    if (kvb__two_lists(pool))
        for (i = k; i < n && i - k < KVB__SCRATCH; i++) kvb__two_lists_prefetch(pool, mix[i - k]);
    for (i = k; i < n; i++) idx[i] = kvb__alloc_one(pool); /* every block first, as kvb_alloc would */
    for (i = k; i < n; i++) {
        uint64_t own = mix[(i - k) % KVB__SCRATCH];
        if (i + KVB__SCRATCH < n) {
            mix[(i - k) % KVB__SCRATCH] = kvb__mix(&hashes[i + KVB__SCRATCH]);
            KVB__PREFETCH(&pool->slots[mix[(i - k) % KVB__SCRATCH] & pool->slot_mask]);
        }
        out_blocks[i] = kvb__block_of(pool, kvb__register_one(pool, idx[i], &hashes[i], own,
                                                             i ? &hashes[i - 1] : &root,
                                                             pool->cfg.block_tokens,
                                                             i ? kvb_block_index(out_blocks[i - 1].id) : KVB__NIL));
    }
    *out_cached = k;
    kvb__unlock(pool);
    return KVB_OK;
}

KVB_API kvb_result kvb_lookup(kvb_pool *pool, const kvb_hash *hashes, size_t n, size_t *out_n)
{
    uint32_t stack[KVB__SCRATCH], *idx;
    if (!pool || !out_n || (n && !hashes)) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    if (!(idx = kvb__scratch(pool, stack, n))) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    *out_n = kvb__prefix(pool, hashes, n, idx);
    pthread_mutex_unlock(&pool->lock);
    return KVB_OK;
}

KVB_API kvb_result kvb_presence(kvb_pool *pool, const kvb_hash *hashes, size_t n, uint8_t *present,
                                size_t *out_count)
{
    uint64_t mix[KVB__SLOT_AHEAD], next; /* as kvb__prefix: hash i's at i % KVB__SLOT_AHEAD */
    size_t i, count = 0;
    if (!pool || (n && (!hashes || !present))) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    for (i = 0; i < n && i < KVB__SLOT_AHEAD; i++) {
        mix[i] = kvb__mix(&hashes[i]);
        KVB__PREFETCH(&pool->slots[mix[i] & pool->slot_mask]);
    }
    for (i = 0; i < n; i++) {
        uint64_t own = mix[i % KVB__SLOT_AHEAD];
        if (i + KVB__SLOT_AHEAD < n) {
            mix[i % KVB__SLOT_AHEAD] = next = kvb__mix(&hashes[i + KVB__SLOT_AHEAD]);
            KVB__PREFETCH(&pool->slots[next & pool->slot_mask]);
        }
        present[i] = kvb__find_or_empty(pool, &hashes[i], own, NULL) != KVB__NIL;
        count += present[i];
    }
    pthread_mutex_unlock(&pool->lock);
    if (out_count) *out_count = count;
    return KVB_OK;
}

/* FOL's eviction order of one level without evicting: merge the class rings by key. */
static size_t kvb__fol_candidates(kvb_pool *p, uint32_t lvl, kvb_weak *out, size_t max)
{
    size_t cur[KVB__CLASSES], k = 0, cls;
    for (cls = 0; cls < KVB__CLASSES; cls++) cur[cls] = p->rings[lvl * KVB__CLASSES + cls].head;
    while (k < max) {
        size_t best = KVB__CLASSES;
        uint32_t bv = 0;
        int64_t bk = 0;
        for (cls = 0; cls < KVB__CLASSES; cls++) {
            const kvb__ring *r = &p->rings[lvl * KVB__CLASSES + cls];
            while (cur[cls] < stbds_arrlenu(r->e) && !kvb__ring_valid(p, r, &r->e[cur[cls]])) cur[cls]++;
            if (cur[cls] < stbds_arrlenu(r->e)) {
                uint32_t v = r->e[cur[cls]].idx;
                int64_t key = kvb__fol_key(p, v);
                if (best == KVB__CLASSES || kvb__fol_before(p, v, key, bv, bk)) {
                    best = cls;
                    bv = v;
                    bk = key;
                }
            }
        }
        if (best == KVB__CLASSES) break;
        out[k++] = kvb_weak_of(kvb__block_of(p, bv));
        cur[best]++;
    }
    return k;
}

/* ARC's eviction order of one level without evicting (kvb__arc_victim's rule, blocks in use passed
 * over): T1's oldest while T1 holds more than the target, else T2's, each eviction one block less in
 * its list; *t1 = T1's size, carried from level to level. */
static size_t kvb__arc_candidates(kvb_pool *p, uint32_t lvl, kvb_weak *out, size_t max, uint32_t *t1)
{
    const kvb__ring *r1 = &p->rings[lvl * KVB__CLASSES + KVB__T1], *r2 = &p->rings[lvl * KVB__CLASSES + KVB__T2];
    size_t i1 = r1->head, i2 = r2->head, k = 0;
    while (k < max) {
        while (i1 < stbds_arrlenu(r1->e) && !kvb__ring_valid(p, r1, &r1->e[i1])) i1++;
        while (i2 < stbds_arrlenu(r2->e) && !kvb__ring_valid(p, r2, &r2->e[i2])) i2++;
        if (i1 < stbds_arrlenu(r1->e) && ((*t1 > 0 && (double)*t1 > p->arc_p) || i2 >= stbds_arrlenu(r2->e))) {
            out[k++] = kvb_weak_of(kvb__block_of(p, r1->e[i1++].idx));
            (*t1)--;
        } else if (i2 < stbds_arrlenu(r2->e)) {
            out[k++] = kvb_weak_of(kvb__block_of(p, r2->e[i2++].idx));
        } else {
            break;
        }
    }
    return k;
}

/* S3-FIFO's eviction order of one level without evicting (kvb__s3_victim's rule, parents not passed
 * over): the small queue while it holds its target (a block hit there moves to the main queue's end
 * instead), then the main queue, whose blocks go round once per count: the blocks of count c leave in
 * round c, in queue order, and the promoted ones (count 0) after the main queue's own in round 0; then
 * what the small queue still holds. *t1 = the small queue's size, carried from level to level. The
 * rounds may pass over much of the main queue: *budget bounds the entries read (a lazy offloader asks
 * every step); when it runs out, so would the victim search's (KVB__S3_SCAN_LIMIT), whose fallback
 * takes the queues' plain order (kvb__rings_in_order). */
static size_t kvb__s3_candidates(kvb_pool *p, uint32_t lvl, kvb_weak *out, size_t max, uint32_t *t1,
                                 size_t *budget)
{
    const kvb__ring *r1 = &p->rings[lvl * KVB__CLASSES + KVB__T1], *r2 = &p->rings[lvl * KVB__CLASSES + KVB__T2];
    uint32_t target = p->cfg.num_blocks / 10 ? p->cfg.num_blocks / 10 : 1, round;
    size_t i, i1 = r1->head, promoted_to, k = 0;
    for (; k < max && *t1 >= target && i1 < stbds_arrlenu(r1->e) && *budget; i1++, --*budget) {
        if (!kvb__ring_valid(p, r1, &r1->e[i1])) continue;
        if (!p->meta[r1->e[i1].idx].cnt) out[k++] = kvb_weak_of(kvb__block_of(p, r1->e[i1].idx));
        (*t1)--;
    }
    promoted_to = i1;
    for (round = 0; round <= 3 && k < max; round++) {
        for (i = r2->head; i < stbds_arrlenu(r2->e) && k < max && *budget; i++, --*budget) {
            uint32_t cnt = p->meta[r2->e[i].idx].cnt;
            if (kvb__ring_valid(p, r2, &r2->e[i]) && (cnt < 3 ? cnt : 3) == round)
                out[k++] = kvb_weak_of(kvb__block_of(p, r2->e[i].idx));
        }
        for (i = r1->head; round == 0 && i < promoted_to && k < max && *budget; i++, --*budget)
            if (kvb__ring_valid(p, r1, &r1->e[i]) && p->meta[r1->e[i].idx].cnt)
                out[k++] = kvb_weak_of(kvb__block_of(p, r1->e[i].idx));
    }
    for (; k < max && i1 < stbds_arrlenu(r1->e) && *budget; i1++, --*budget) /* main is empty: the rest */
        if (kvb__ring_valid(p, r1, &r1->e[i1])) {
            out[k++] = kvb_weak_of(kvb__block_of(p, r1->e[i1].idx));
            (*t1)--;
        }
    return k;
}

/* The valid entries of a level's first `rings` rings, each from its head: the eviction order of LRU and
 * lineage (one ring), and S3-FIFO's fallback (small queue, then main). */
static size_t kvb__rings_in_order(kvb_pool *p, uint32_t lvl, uint32_t rings, kvb_weak *out, size_t max)
{
    size_t k = 0, i;
    uint32_t c;
    for (c = 0; c < rings; c++) {
        const kvb__ring *r = &p->rings[lvl * KVB__CLASSES + c];
        for (i = r->head; i < stbds_arrlenu(r->e) && k < max; i++)
            if (kvb__ring_valid(p, r, &r->e[i])) out[k++] = kvb_weak_of(kvb__block_of(p, r->e[i].idx));
    }
    return k;
}

KVB_API kvb_result kvb_eviction_candidates(kvb_pool *pool, size_t max, kvb_weak *out, size_t *out_n)
{
    size_t k = 0, budget = (size_t)4 * KVB__S3_SCAN_LIMIT + (max < SIZE_MAX / 8 ? 4 * max : SIZE_MAX / 2);
    uint32_t lvl, t1;
    if (!pool || !out_n || (max && !out) || pool->cfg.eviction == KVB_EVICT_CUSTOM) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    t1 = pool->n_cls[KVB__T1];
    for (lvl = 0; lvl < pool->cfg.priority_levels && k < max; lvl++) {
        if (pool->cfg.eviction == KVB_EVICT_FOL) {
            k += kvb__fol_candidates(pool, lvl, out + k, max - k);
            continue;
        }
        if (pool->cfg.eviction == KVB_EVICT_ARC) {
            k += kvb__arc_candidates(pool, lvl, out + k, max - k, &t1);
            continue;
        }
        if (pool->cfg.eviction == KVB_EVICT_S3FIFO) {
            size_t from = k;
            k += kvb__s3_candidates(pool, lvl, out + k, max - k, &t1, &budget);
            if (!budget && k < max) k = from + kvb__rings_in_order(pool, lvl, 2, out + from, max - from);
            continue;
        }
        k += kvb__rings_in_order(pool, lvl, 1, out + k, max - k);
    }
    pthread_mutex_unlock(&pool->lock);
    *out_n = k;
    return KVB_OK;
}

/* kvb_upgrade; `use` 0: the reference is no use of the block (no policy hit, as kvb_pin's): kvoffload.h's
 * offloads, which copy a block down and give it back, take theirs so. */
static kvb_result kvb__upgrade(kvb_pool *pool, kvb_weak weak, kvb_block *out, int use)
{
    uint32_t idx;
    kvb_result r;
    if (!pool || !out || !(weak.id & KVB_WEAK_BIT)) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    r = kvb__lookup_handle(pool, weak.id, &idx);
    if (r == KVB_OK && pool->meta[idx].refs == 0 && pool->meta[idx].state != KVB_STATE_REGISTERED)
        r = KVB_EGONE;
    if (r == KVB_OK) {
        if (use) kvb__take_ref(pool, idx);
        else kvb__take_pin(pool, idx);
        out->id = weak.id & ~KVB_WEAK_BIT;
    }
    pthread_mutex_unlock(&pool->lock);
    return r;
}

KVB_API kvb_result kvb_upgrade(kvb_pool *pool, kvb_weak weak, kvb_block *out)
{
    return kvb__upgrade(pool, weak, out, 1);
}

static unsigned char *kvb__page(const kvb_pool *p, uint32_t idx, uint32_t layer, uint32_t part)
{
    return p->storage + kvb_layout_offset(&p->cfg.layout, p->cfg.num_blocks, idx, layer, part);
}

KVB_API kvb_result kvb_block_data(kvb_pool *pool, kvb_block block, uint32_t layer, uint32_t part,
                                  void **out_ptr)
{
    uint32_t idx;
    kvb_result r;
    if (!pool || !out_ptr) return KVB_EINVAL;
    if (pool->cfg.storage == KVB_STORAGE_NONE) return KVB_ENODATA;
    if (layer >= pool->cfg.layout.num_layers || part >= pool->cfg.layout.num_parts) return KVB_ERANGE;
    pthread_mutex_lock(&pool->lock);
    r = kvb__strong(pool, block, &idx);
    if (r == KVB_OK) *out_ptr = kvb__page(pool, idx, layer, part);
    pthread_mutex_unlock(&pool->lock);
    return r;
}

/* Spans of one block's bytes: the whole block, or one per (layer, part) page. */
static size_t kvb__copy_span_count(const kvb_pool *p)
{
    const kvb_layout *y = &p->cfg.layout;
    return y->kind == KVB_LAYOUT_BLOCK_CONTIGUOUS ? 1 : (size_t)y->num_layers * y->num_parts;
}

/* Room for the spans of one block copy (dst spans, then src spans): `stack` (2 x KVB__COPY_STACK
 * pointers) when they fit, else memory taken here, before the copy changes anything; NULL when it is
 * not there. kvb__copy_spans_free gives it back. */
#define KVB__COPY_STACK 64
static void **kvb__copy_spans(const kvb_pool *p, void **stack)
{
    size_t n = kvb__copy_span_count(p);
    if (!p->storage || n <= KVB__COPY_STACK) return stack;
    return (void **)KVB_MALLOC(2 * n * sizeof *stack);
}

static void kvb__copy_spans_free(void **span, void **stack)
{
    if (span && span != stack) KVB_FREE(span);
}

/* Block src's bytes to block dst as spans (in `span`, from kvb__copy_spans): through the pool's
 * copy_block hook when it has one, else memcpy. KVB_ECOPY when the hook fails. Pool locked. */
static kvb_result kvb__copy_bytes(kvb_pool *p, uint32_t dst, uint32_t src, void **span)
{
    const kvb_layout *y = &p->cfg.layout;
    int whole = y->kind == KVB_LAYOUT_BLOCK_CONTIGUOUS;
    size_t n = kvb__copy_span_count(p), i;
    uint64_t bytes = whole ? p->block_bytes : y->page_bytes;
    kvb_result r = KVB_OK;
    if (!p->storage) return KVB_OK;
    for (i = 0; i < n; i++) { /* dst spans first, then src spans */
        span[i] = kvb__page(p, dst, (uint32_t)(i / y->num_parts), (uint32_t)(i % y->num_parts));
        span[n + i] = kvb__page(p, src, (uint32_t)(i / y->num_parts), (uint32_t)(i % y->num_parts));
    }
    if (p->cfg.copy_block)
        r = p->cfg.copy_block(p->cfg.copy_user, span, (const void *const *)(span + n), n, bytes) == 0 ? KVB_OK : KVB_ECOPY;
    else
        for (i = 0; i < n; i++) memcpy(span[i], span[n + i], (size_t)bytes);
    return r;
}

/* ---- check -------------------------------------------------------------------------------------- */

#define KVB__FAIL(...)                                           \
    do {                                                         \
        if (why && why_size) snprintf(why, why_size, __VA_ARGS__); \
        r = KVB_ECORRUPT;                                        \
        goto done;                                               \
    } while (0)

static int kvb__findable(const kvb_pool *p, uint64_t slot)
{
    uint64_t pos = p->slots[slot].tag & p->slot_mask;
    for (; pos != slot; pos = (pos + 1) & p->slot_mask)
        if (!p->slots[pos].ref) return 0;
    return 1;
}

/* FOL's shadows: each class list linked both ways, its nodes resident and of its class, as many as the
 * shadow counts and no more than it holds; the ladder follows the pool's rule for tails, the probe the
 * other one at LRU order. */
static kvb_result kvb__tune_check(const kvb_pool *pool, char *why, size_t why_size)
{
    const kvb__tuner *t = &pool->tune;
    kvb_result r = KVB_OK;
    uint32_t k, c;
    if (pool->fol_tails_first != t->tails_first) KVB__FAIL("FOL: the pool's rule for tails is not the tuner's");
    for (k = 0; k < KVB__TUNE_K; k++) {
        const kvb__shadow *sh = &t->sh[k];
        uint32_t count = 0;
        if (sh->tails_first != ((k == KVB__TUNE_PROBE) != t->tails_first))
            KVB__FAIL("FOL shadow %u: rule for tails %d, tuner %d", k, sh->tails_first, t->tails_first);
        if (k == KVB__TUNE_PROBE && sh->step != t->sh[0].step) KVB__FAIL("FOL probe: step %lld", (long long)sh->step);
        for (c = 0; c < k; c++) /* a column of the index each, a permutation (kvb__tune_tails trades two) */
            if (sh->index == t->sh[c].index) KVB__FAIL("FOL shadows %u and %u: one index column", c, k);
        if (sh->index < t->index || sh->index >= t->index + KVB__TUNE_K) KVB__FAIL("FOL shadow %u: index column", k);
        if (sh->resident > t->cap) KVB__FAIL("FOL shadow %u: %u resident, holds %u", k, sh->resident, t->cap);
        for (c = 0; c < KVB__CLASSES; c++) {
            uint32_t x = sh->head[c], prev = KVB__NIL;
            for (; x != KVB__NIL; prev = x, x = sh->node[x].next) {
                if (x >= t->nodes || ++count > sh->resident) KVB__FAIL("FOL shadow %u: class %u list runs on", k, c);
                /* count <= resident <= cap < nodes: the walk ends */
                if (sh->node[x].prev != prev || sh->node[x].where != 1 || sh->node[x].cls != c)
                    KVB__FAIL("FOL shadow %u: node %u misplaced in class %u", k, x, c);
            }
            if (sh->tail[c] != prev) KVB__FAIL("FOL shadow %u: class %u tail", k, c);
            if (!!(sh->classes & (1u << c)) != (prev != KVB__NIL)) KVB__FAIL("FOL shadow %u: class %u's bit", k, c);
            if (sh->order[c] != kvb__tune_order(sh, c) || sh->age_mask[c] != (sh->order[c] == KVB__TUNE_RANK_FIRST ? 0 : UINT32_MAX))
                KVB__FAIL("FOL shadow %u: class %u's victim order", k, c);
        }
        if (count != sh->resident) KVB__FAIL("FOL shadow %u: %u resident, counted %u", k, sh->resident, count);
    }
done:
    return r;
}

KVB_API kvb_result kvb_pool_check(kvb_pool *pool, char *why, size_t why_size)
{
    kvb_result r = KVB_OK;
    uint32_t i, n, lvl, cnt, n_free = 0, n_active = 0, n_inactive = 0, n_cached = 0;
    uint64_t s;
    unsigned char *seen = NULL;
    kvb__kid_entry *kids = NULL;
    ptrdiff_t k;
    if (!pool) return KVB_EINVAL;
    pthread_mutex_lock(&pool->lock);
    n = pool->cfg.num_blocks;
    seen = (unsigned char *)KVB_MALLOC(n);
    if (!seen) {
        pthread_mutex_unlock(&pool->lock);
        return KVB_ENOMEM;
    }
    memset(seen, 0, n);
    if (pool->n_free > n) KVB__FAIL("free count %u > blocks", pool->n_free);
    for (i = 0; i < pool->n_free; i++) {
        uint32_t f = pool->free_stack[i];
        if (f >= n || seen[f]++) KVB__FAIL("free stack entry %u repeated or out of range", f);
        if (pool->meta[f].state != KVB__S_FREE) KVB__FAIL("block %u on the free stack is not free", f);
    }
    for (i = 0; i < n; i++) {
        const kvb__meta *m = &pool->meta[i];
        int mutable_state = m->state >= KVB_STATE_PARTIAL && m->state <= KVB_STATE_COMPLETE;
        if (m->state == KVB__S_FREE) {
            n_free++;
            if (!seen[i] || m->refs || m->flags) KVB__FAIL("free block %u: stacked %d refs %u flags %u", i, seen[i], m->refs, m->flags);
        } else if (m->refs) {
            n_active++;
            if (m->flags & KVB__F_INACTIVE) KVB__FAIL("active block %u on an eviction list", i);
        } else {
            n_inactive++;
            if (m->state != KVB_STATE_REGISTERED || !(m->flags & KVB__F_INACTIVE))
                KVB__FAIL("unreferenced block %u neither free nor inactive (state %u)", i, m->state);
        }
        if ((mutable_state && !(m->flags & KVB__F_SEQ)) != (kvb__mut_of(pool, i) != NULL))
            KVB__FAIL("block %u: mutable state mismatch", i);
        if ((m->flags & KVB__F_SEQ) && (m->state < KVB_STATE_PARTIAL || m->state > KVB_STATE_COMPLETE))
            KVB__FAIL("block %u: a sequence's block in state %u", i, m->state);
        if (m->ntok > pool->cfg.block_tokens) KVB__FAIL("block %u holds %u tokens", i, m->ntok);
        if ((m->state == KVB_STATE_REGISTERED) != !!(m->flags & (KVB__F_INDEXED | KVB__F_DUP)))
            KVB__FAIL("block %u: registered but neither indexed nor duplicate", i);
        if (m->state == KVB_STATE_REGISTERED) {
            uint32_t c = kvb__find(pool, &m->hash);
            while (c != KVB__NIL && c != i) c = pool->meta[c].dup_next;
            if (c != i) KVB__FAIL("registered block %u not reachable from the index", i);
            if (pool->track_kids && !kvb__hash_is_root(&m->parent)) { /* children counted by brute force */
                kvb_hash key = kvb__kid_key(&m->parent);
                k = stbds_hmgeti(kids, key);
                if (k < 0) stbds_hmput(kids, key, 1u);
                else kids[k].value++;
            }
        }
    }
    if (kvb__two_lists(pool)) { /* ARC, S3-FIFO: list sizes */
        uint32_t per[2] = {0, 0};
        for (i = 0; i < n; i++)
            if (pool->meta[i].state == KVB_STATE_REGISTERED) {
                if (pool->meta[i].cls > KVB__T2) KVB__FAIL("block %u in list %u", i, pool->meta[i].cls);
                per[pool->meta[i].cls]++;
            }
        if (per[0] != pool->n_cls[0] || per[1] != pool->n_cls[1])
            KVB__FAIL("list sizes %u/%u and %u/%u", per[0], pool->n_cls[0], per[1], pool->n_cls[1]);
    }
    if (n_free != pool->n_free || n_active != pool->n_active || n_inactive != pool->n_inactive)
        KVB__FAIL("set sizes free %u/%u active %u/%u inactive %u/%u", n_free, pool->n_free, n_active,
                  pool->n_active, n_inactive, pool->n_inactive);
    if (pool->cfg.eviction != KVB_EVICT_CUSTOM) {
        for (lvl = 0, cnt = 0; lvl < KVB__MAX_LEVELS * KVB__CLASSES; lvl++) {
            const kvb__ring *rg = &pool->rings[lvl];
            uint32_t live = 0;
            size_t e;
            if (rg->id != lvl) KVB__FAIL("eviction ring %u numbered %u", lvl, rg->id);
            for (e = 0; e < stbds_arrlenu(rg->e); e++)
                if (rg->e[e].stamp != rg->base + (uint32_t)e) KVB__FAIL("eviction ring %u: entry %zu stamped out of place", lvl, e);
            for (e = rg->head; e < stbds_arrlenu(rg->e); e++) {
                if (rg->e[e].idx >= n) KVB__FAIL("eviction ring %u names block %u", lvl, rg->e[e].idx);
                if (!kvb__ring_valid(pool, rg, &rg->e[e])) continue;
                if (e < rg->leafless_to && kvb__is_leaf(pool, rg->e[e].idx) && !kvb__ring_is_pending(rg, rg->e[e].stamp))
                    KVB__FAIL("eviction ring %u: leaf %u before where its leaf search resumes", lvl, rg->e[e].idx);
                live++;
            }
            if (live != rg->live) KVB__FAIL("eviction ring %u: %u live entries, counted %u", lvl, live, rg->live);
            cnt += live;
        }
        if (cnt != n_inactive) KVB__FAIL("eviction rings hold %u of %u inactive blocks", cnt, n_inactive);
    }
    for (s = 0; s <= pool->slot_mask; s++) {
        uint32_t ref = pool->slots[s].ref;
        if (!ref) continue;
        n_cached++;
        if (ref > n || !(pool->meta[ref - 1].flags & KVB__F_INDEXED) ||
            kvb__tag(&pool->meta[ref - 1].hash) != pool->slots[s].tag)
            KVB__FAIL("index slot %llu names block %u wrongly", (unsigned long long)s, ref - 1);
        if (!kvb__findable(pool, s)) KVB__FAIL("index slot %llu unreachable by probing", (unsigned long long)s);
    }
    if (n_cached != pool->n_cached) KVB__FAIL("index holds %u hashes, counted %u", n_cached, pool->n_cached);
    for (i = 0; i < n; i++) { /* an indexed block carries its hash's children; the rest are orphans */
        const kvb__meta *m = &pool->meta[i];
        kvb_hash key = kvb__kid_key(&m->hash);
        uint32_t want = 0;
        if (!(m->flags & KVB__F_INDEXED)) {
            if (m->kids) KVB__FAIL("block %u not indexed, with a child count %u", i, m->kids);
            continue;
        }
        if ((k = stbds_hmgeti(kids, key)) >= 0) {
            want = kids[k].value;
            (void)stbds_hmdel(kids, key);
        }
        if (m->kids != want) KVB__FAIL("block %u: child count %u, counted %u", i, m->kids, want);
    }
    if ((size_t)stbds_hmlen(kids) != pool->orphans.used)
        KVB__FAIL("orphan counts: %u parents, counted %d", pool->orphans.used, (int)stbds_hmlen(kids));
    for (s = 0; pool->orphans.e && s <= pool->orphans.mask; s++) {
        const kvb__count *o = &pool->orphans.e[s];
        kvb_hash key = kvb__kid_key(&o->key);
        if (!o->count) continue;
        k = stbds_hmgeti(kids, key);
        if (k < 0 || kids[k].value != o->count) KVB__FAIL("orphan count mismatch");
        if (kvb__ctab_get(&pool->orphans, &o->key) != o->count) KVB__FAIL("orphan count unreachable by probing");
        if (kvb__find(pool, &o->key) != KVB__NIL) KVB__FAIL("orphan count for an indexed hash");
    }
    if (pool->fol_adaptive && (r = kvb__tune_check(pool, why, why_size)) != KVB_OK) goto done;
done:
    stbds_hmfree(kids);
    KVB_FREE(seen);
    pthread_mutex_unlock(&pool->lock);
    return r;
}
#undef KVB__FAIL

/* ---- sequences ---------------------------------------------------------------------------------- */

struct kvb_seq { /* what an append or a commit reads first (one cache line), the rest after */
    kvb_pool *pool;
    uint32_t *tokens;  /* stb_ds arrays; the table and hashes have room for the blocks of as many tokens */
    kvb_block *table;  /* as tokens has room for (kvb__seq_room) */
    kvb_hash *hashes;  /* one per full block */
    size_t computed, cached;
    size_t len0, nh0;  /* an append in progress: tokens and hashes before it */
    uint64_t salt;
    uint64_t extra[KVB_MAX_EXTRA_KEYS];
    size_t n_extra;
    int in_batch;      /* scratch: seen in the batch being checked */
};

static kvb_result kvb__seq_config_check(const kvb_seq_config *config)
{
    if (config && !config->extra && config->n_extra) return KVB_EINVAL;
    if (config && config->n_extra > KVB_MAX_EXTRA_KEYS) return KVB_ERANGE;
    return KVB_OK;
}

/* Salt and extra keys of an empty sequence. */
static void kvb__seq_configure(kvb_seq *s, const kvb_seq_config *config)
{
    s->salt = config ? config->salt : 0;
    s->n_extra = config ? config->n_extra : 0;
    if (s->n_extra) memcpy(s->extra, config->extra, s->n_extra * sizeof *s->extra);
}

KVB_API kvb_result kvb_seq_create(kvb_pool *pool, const kvb_seq_config *config, kvb_seq **out)
{
    kvb_seq *s;
    kvb_result r;
    if (!pool || !out) return KVB_EINVAL;
    if ((r = kvb__seq_config_check(config)) != KVB_OK) return r;
    s = (kvb_seq *)KVB_MALLOC(sizeof *s);
    if (!s) return KVB_ENOMEM;
    memset(s, 0, sizeof *s);
    s->pool = pool;
    kvb__seq_configure(s, config);
    *out = s;
    return KVB_OK;
}

/* Drop the sequence's references on table[from..), deepest first; `touch`: the request ends (FOL counts
 * it as a reference), not a truncation. Pool locked. */
static void kvb__seq_drop_tail(kvb_seq *s, size_t from, int touch)
{
    size_t i, n = stbds_arrlenu(s->table) - from;
    uint32_t stack[KVB__SCRATCH] = {0}, *idx = kvb__scratch(s->pool, stack, n);
    if (idx) {
        for (i = 0; i < n; i++) idx[i] = kvb_block_index(s->table[from + i].id);
        kvb__release_request(s->pool, idx, n, 0, touch, 0);
    } else {
        for (i = stbds_arrlenu(s->table); i-- > from;) kvb__drop_ref(s->pool, kvb_block_index(s->table[i].id), 0);
    }
    KVB__ARR_SHRINK(s->table, from);
}

/* The sequence's memory (its blocks released already). */
static void kvb__seq_free(kvb_seq *s)
{
    stbds_arrfree(s->tokens);
    stbds_arrfree(s->table);
    stbds_arrfree(s->hashes);
    KVB_FREE(s);
}

KVB_API void kvb_seq_destroy(kvb_seq *seq)
{
    if (!seq) return;
    pthread_mutex_lock(&seq->pool->lock);
    kvb__seq_drop_tail(seq, 0, 1);
    kvb__unlock(seq->pool);
    kvb__seq_free(seq);
}

KVB_API kvb_result kvb_seq_reset(kvb_seq *seq, const kvb_seq_config *config)
{
    kvb_result r;
    if (!seq) return KVB_EINVAL;
    if ((r = kvb__seq_config_check(config)) != KVB_OK) return r;
    pthread_mutex_lock(&seq->pool->lock);
    kvb__seq_drop_tail(seq, 0, 1);
    kvb__unlock(seq->pool);
    KVB__ARR_SHRINK(seq->tokens, 0);
    KVB__ARR_SHRINK(seq->hashes, 0);
    seq->computed = seq->cached = seq->len0 = seq->nh0 = 0;
    kvb__seq_configure(seq, config);
    return KVB_OK;
}

/* Room in the sequence's arrays for cap tokens with their hashes and blocks: the hashes and the table
 * first, so that they always have room for the blocks of as many tokens as the tokens array has room for
 * (an append then checks the tokens' room alone). 0 when the memory is not there (some room may be kept). */
static int kvb__seq_room(kvb_seq *s, size_t cap)
{
    size_t bt = s->pool->cfg.block_tokens;
    void *t = s->tokens, *h = s->hashes, *b = s->table;
    int ok = kvb__arr_room(&h, sizeof *s->hashes, cap / bt) &&
             kvb__arr_room(&b, sizeof *s->table, cap / bt + (cap % bt != 0)) &&
             kvb__arr_room(&t, sizeof *s->tokens, cap);
    s->tokens = (uint32_t *)t, s->hashes = (kvb_hash *)h, s->table = (kvb_block *)b;
    return ok;
}

KVB_API kvb_result kvb_seq_reserve(kvb_seq *seq, size_t num_tokens)
{
    if (!seq) return KVB_EINVAL;
    if (num_tokens > SIZE_MAX / (2 * sizeof(kvb_hash))) return KVB_ERANGE; /* more than memory holds */
    return kvb__seq_room(seq, num_tokens) ? KVB_OK : KVB_ENOMEM;
}

static const kvb_hash *kvb__seq_parent(const kvb_seq *s, size_t block, const kvb_hash *fresh, size_t n_old)
{
    if (block == 0) return NULL;
    return block - 1 < n_old ? &s->hashes[block - 1] : &fresh[block - 1 - n_old];
}

/* A private copy of block b holding its first ntok tokens (copy-on-write); the old reference is
 * dropped. Pool locked, everything ready: a block available, room for the event of an eviction, the
 * copy's spans (kvb__copy_spans). Fails only when the copy does (KVB_ECOPY): the new block goes back as
 * it was (an eviction made for it stays) and the sequence keeps the shared one. */
static kvb_result kvb__seq_cow(kvb_seq *s, size_t b, uint32_t ntok, void **span)
{
    kvb_pool *p = s->pool;
    uint32_t old = kvb_block_index(s->table[b].id), idx = kvb__alloc_one(p);
    kvb__init_seq(p, idx, &p->meta[old].parent);
    kvb__seq_add_tokens(p, idx, ntok);
    p->meta[idx].state = KVB_STATE_PARTIAL;
    if (kvb__copy_bytes(p, idx, old, span) != KVB_OK) {
        kvb__unalloc(p, idx);
        return KVB_ECOPY;
    }
    kvb__drop_ref(p, old, 0);
    s->table[b] = kvb__block_of(p, idx);
    return KVB_OK;
}

/* Fill new blocks nb_from..nb_to with the tokens from the table's end on. Pool locked, everything
 * ready: the blocks available, room in the table. */
static void kvb__seq_fill_new(kvb_seq *s, size_t nb_from, size_t nb_to, const kvb_hash *fresh, size_t n_old,
                              size_t total)
{
    kvb_pool *p = s->pool;
    size_t b, bt = p->cfg.block_tokens;
    for (b = nb_from; b < nb_to; b++) {
        uint32_t idx = kvb__alloc_one(p);
        size_t end = (b + 1) * bt < total ? (b + 1) * bt : total;
        kvb__init_seq(p, idx, kvb__seq_parent(s, b, fresh, n_old));
        kvb__seq_add_tokens(p, idx, end - b * bt);
        stbds_arrput(s->table, kvb__block_of(p, idx));
    }
}

/* Append, step 1 (pool not locked): room in the sequence's arrays for the tokens, the hashes of the
 * blocks they fill and the blocks (KVB_ENOMEM, nothing changed, when the memory is not there; KVB_ERANGE
 * for more tokens in all than kvb_seq_reserve takes); then the
 * tokens and hashes go on tentatively (the old lengths in len0 and nh0 for kvb__seq_rollback). The
 * hashes are computed here, outside the pool's lock. */
static kvb_result kvb__seq_prepare(kvb_seq *s, const uint32_t *tokens, size_t n)
{
    kvb_pool *p = s->pool;
    size_t bt = p->cfg.block_tokens, i, len = stbds_arrlenu(s->tokens), total = len + n, n_new;
    s->len0 = len;
    s->nh0 = stbds_arrlenu(s->hashes);
    if (!n) return KVB_OK;
    if (KVB__UNLIKELY(n > SIZE_MAX / (2 * sizeof(kvb_hash)) - len)) /* kvb_seq_reserve's bound; len + n */
        return KVB_ERANGE;                                          /* could wrap below the room */
    if (KVB__UNLIKELY(total > stbds_arrcap(s->tokens)) &&
        !kvb__seq_room(s, kvb__grown(stbds_arrcap(s->tokens), total)))
        return KVB_ENOMEM;
    memcpy(s->tokens + len, tokens, n * sizeof *tokens); /* within the room: hashes and table have theirs */
    stbds_header(s->tokens)->length = total;
    n_new = total / bt - s->nh0;
    if (n_new) stbds_header(s->hashes)->length = s->nh0 + n_new;
    for (i = s->nh0; i < s->nh0 + n_new; i++)
        s->hashes[i] = kvb__hash(p, i ? &s->hashes[i - 1] : NULL, s->tokens + i * bt, bt, s->extra, s->n_extra, s->salt);
    return KVB_OK;
}

static void kvb__seq_rollback(kvb_seq *s)
{
    KVB__ARR_SHRINK(s->tokens, s->len0);
    KVB__ARR_SHRINK(s->hashes, s->nh0);
}

/* A copy-on-write (kvb__seq_cow) with spans of its own, taken first. */
static kvb_result kvb__seq_cow_alone(kvb_seq *s, size_t b, uint32_t ntok)
{
    void *stack[2 * KVB__COPY_STACK] = {0}, **span = kvb__copy_spans(s->pool, stack); /* zeroed: -O2 cannot see n >= 1 */
    kvb_result r = span ? kvb__seq_cow(s, b, ntok, span) : KVB_ENOMEM;
    kvb__copy_spans_free(span, stack);
    return r;
}

/* Append, step 2 (pool locked): reuse cached blocks for the new full blocks while every earlier one was
 * cached (`match`: 0 for kvb_seq_append_new), fill the partial last block (copied first when shared),
 * allocate the rest. All or nothing: what can fail (space, memory, the copy) is done or checked before
 * the rest changes anything. */
static kvb_result kvb__seq_append_locked(kvb_seq *s, size_t *out_cached_tokens, int match)
{
    kvb_pool *p = s->pool;
    size_t bt = p->cfg.block_tokens, len = s->len0, total = stbds_arrlenu(s->tokens), n = total - len;
    size_t n_old = s->nh0, n_new = stbds_arrlenu(s->hashes) - n_old, nb_old = stbds_arrlenu(s->table);
    size_t nb_new = (total + bt - 1) / bt, k = 0, need, i, inactive_hit = 0, room;
    uint32_t stack[KVB__SCRATCH], *idx = stack, last = KVB__NIL;
    const kvb_hash *fresh = n_new ? s->hashes + n_old : NULL;
    kvb_result r;
    int cow;
    if (!n) return KVB_OK;
    if (len % bt) { /* the partial last block takes tokens first: it must be writable */
        last = kvb_block_index(s->table[nb_old - 1].id);
        if (p->meta[last].state != KVB_STATE_PARTIAL) return KVB_ESTATE;
    }
    match = match && s->cached == len && len % bt == 0 && n_new;
    if (match) {
        if (!(idx = kvb__scratch(p, stack, n_new))) return KVB_ENOMEM;
        k = kvb__prefix(p, fresh, n_new, idx);
    }
    for (i = 0; i < k; i++) inactive_hit += p->meta[idx[i]].refs++ == 0; /* each block once: a hash_fn */
    for (i = 0; i < k; i++) p->meta[idx[i]].refs--; /* that leaves out the parent can match one twice */
    cow = last != KVB__NIL && p->meta[last].refs > 1;
    need = nb_new - nb_old - k + (size_t)cow;
    room = (size_t)p->n_free + p->n_inactive - inactive_hit;
    if (need > room) return KVB_ENOSPACE;
    /* the events of the evictions it makes */
    if (need && !kvb__events_room(p, need > p->n_free ? need - p->n_free : 0)) return KVB_ENOMEM;
    /* the copy first (never with matched blocks: those start on a block boundary) */
    if (cow && (r = kvb__seq_cow_alone(s, nb_old - 1, (uint32_t)(len % bt))) != KVB_OK) return r;
    if (k) {
        kvb__take_matched(p, idx, k, n_new, NULL);
        for (i = 0; i < k; i++) stbds_arrput(s->table, kvb__block_of(p, idx[i]));
    } else if (match) {
        kvb__take_matched(p, idx, 0, n_new, NULL); /* a lookup that missed still counts */
    }
    if (last != KVB__NIL) {
        size_t fill = bt - len % bt < n ? bt - len % bt : n;
        kvb__seq_add_tokens(p, kvb_block_index(s->table[nb_old - 1].id), fill);
    }
    kvb__seq_fill_new(s, nb_old + k, nb_new, fresh, n_old, total);
    s->cached += k * bt;
    if (k) s->computed = s->cached;
    if (out_cached_tokens) *out_cached_tokens = k * bt;
    return KVB_OK;
}

static kvb_result kvb__seq_append(kvb_seq *seq, const uint32_t *tokens, size_t n, size_t *out_cached_tokens,
                                  int match)
{
    kvb_pool *p;
    kvb_result r;
    if (!seq || (!tokens && n)) return KVB_EINVAL;
    if (out_cached_tokens) *out_cached_tokens = 0;
    if (!n) return KVB_OK;
    p = seq->pool;
    if ((r = kvb__seq_prepare(seq, tokens, n)) != KVB_OK) return r;
    pthread_mutex_lock(&p->lock);
    r = kvb__seq_append_locked(seq, out_cached_tokens, match);
    kvb__unlock(p);
    if (r != KVB_OK) kvb__seq_rollback(seq);
    return r;
}

KVB_API kvb_result kvb_seq_append(kvb_seq *seq, const uint32_t *tokens, size_t n, size_t *out_cached_tokens)
{
    return kvb__seq_append(seq, tokens, n, out_cached_tokens, 1);
}

KVB_API kvb_result kvb_seq_append_new(kvb_seq *seq, const uint32_t *tokens, size_t n)
{
    return kvb__seq_append(seq, tokens, n, NULL, 0);
}

/* A batch walks many sequences: their structs (kvb__seqs_one_pool touched them first), the headers of
 * their arrays, then the ends of the arrays, then the metadata of their last blocks (meta >= 1) and the
 * index slot of their last block hash (meta = 2: a commit registers it) are fetched a few sequences
 * ahead, each stage from what the one before brought in, so the misses overlap instead of adding up. */
static void kvb__seq_prefetch(kvb_seq *const *seqs, size_t i, size_t n, int meta)
{
    if (i + 8 < n) KVB__PREFETCH(seqs[i + 8]);
    if (i + 6 < n) {
        const kvb_seq *s = seqs[i + 6];
        if (s->tokens) KVB__PREFETCH(stbds_header(s->tokens));
        if (s->table) KVB__PREFETCH(stbds_header(s->table));
        if (s->hashes) KVB__PREFETCH(stbds_header(s->hashes));
    }
    if (i + 4 < n) {
        const kvb_seq *s = seqs[i + 4];
        size_t nb = stbds_arrlenu(s->table);
        if (s->tokens) KVB__PREFETCH(s->tokens + stbds_arrlenu(s->tokens));
        if (nb) KVB__PREFETCH(s->table + nb - 1);
        if (meta == 2 && stbds_arrlenu(s->hashes)) KVB__PREFETCH(s->hashes + stbds_arrlenu(s->hashes) - 1);
    }
    if (meta && i + 2 < n) {
        const kvb_seq *s = seqs[i + 2];
        size_t nb = stbds_arrlenu(s->table), nh = stbds_arrlenu(s->hashes);
        if (nb) KVB__PREFETCH(&s->pool->meta[kvb_block_index(s->table[nb - 1].id)]);
        if (meta == 2 && nh) KVB__PREFETCH(kvb__home(s->pool, &s->hashes[nh - 1]));
    }
}

/* The sequences of a batch share one pool and come once each. */
static int kvb__seqs_one_pool(kvb_seq *const *seqs, size_t n)
{
    size_t i, ok = 1;
    for (i = 0; i < n && ok; i++) {
        if (i + 8 < n && seqs[i + 8]) KVB__PREFETCH(seqs[i + 8]);
        ok = seqs[i] && seqs[i]->pool == seqs[0]->pool && !seqs[i]->in_batch;
        if (ok) seqs[i]->in_batch = 1;
    }
    while (i-- > 0)
        if (seqs[i]) seqs[i]->in_batch = 0;
    return (int)ok;
}

KVB_API kvb_result kvb_seq_append_many(kvb_seq *const *seqs, const uint32_t *const *tokens, const size_t *counts,
                                       size_t n, size_t *out_done)
{
    kvb_pool *p;
    size_t i, ready, done = 0;
    kvb_result r = KVB_OK, prepared = KVB_OK;
    if (!out_done || (n && (!seqs || !tokens || !counts))) return KVB_EINVAL;
    *out_done = 0;
    if (!n) return KVB_OK;
    if (!kvb__seqs_one_pool(seqs, n)) return KVB_EINVAL;
    for (i = 0; i < n; i++)
        if (!tokens[i] && counts[i]) return KVB_EINVAL;
    p = seqs[0]->pool;
    for (ready = 0; ready < n; ready++) { /* out of memory here: the ones before it are still appended */
        kvb__seq_prefetch(seqs, ready, n, 0);
        if ((prepared = kvb__seq_prepare(seqs[ready], tokens[ready], counts[ready])) != KVB_OK) break;
    }
    pthread_mutex_lock(&p->lock);
    for (; done < ready; done++) {
        kvb__seq_prefetch(seqs, done, ready, 1);
        if ((r = kvb__seq_append_locked(seqs[done], NULL, 1)) != KVB_OK) break;
    }
    kvb__unlock(p);
    for (i = done; i < ready; i++) kvb__seq_rollback(seqs[i]);
    *out_done = done;
    return r != KVB_OK ? r : prepared;
}

/* Commit, pool locked (see kvb_seq_commit). */
static void kvb__seq_commit_locked(kvb_seq *seq, size_t num_tokens)
{
    kvb_pool *p = seq->pool;
    size_t b, bt = p->cfg.block_tokens, len = stbds_arrlenu(seq->tokens), nb = stbds_arrlenu(seq->table);
    size_t from = seq->computed / bt, full = 0; /* blocks before full: their slots fetched ahead */
    uint64_t mix[KVB__SLOT_AHEAD]; /* a prefill's: block b's at b % KVB__SLOT_AHEAD, its slot on the way */
    if (num_tokens > seq->computed + bt) /* else one block at most: a decode's, its slot fetched by the batch */
        full = num_tokens / bt < stbds_arrlenu(seq->hashes) ? num_tokens / bt : stbds_arrlenu(seq->hashes);
    for (b = from; b < full && b < from + KVB__SLOT_AHEAD; b++) {
        mix[b % KVB__SLOT_AHEAD] = kvb__mix(&seq->hashes[b]);
        KVB__PREFETCH(&p->slots[mix[b % KVB__SLOT_AHEAD] & p->slot_mask]);
    }
    for (b = from; b < nb; b++) { /* every block that ends within the computed tokens */
        size_t end = (b + 1) * bt < len ? (b + 1) * bt : len;
        uint32_t idx = kvb_block_index(seq->table[b].id);
        kvb__meta *m = &p->meta[idx];
        if (end > num_tokens) break;
        if (m->state == KVB_STATE_PARTIAL) m->state = KVB_STATE_READY;
        if (m->state == KVB_STATE_READY) m->state = KVB_STATE_INFLIGHT;
        if (m->state == KVB_STATE_INFLIGHT) kvb__advance(p, idx, KVB_STATE_COMPLETE);
        if (m->state == KVB_STATE_COMPLETE) {
            kvb_hash parent = m->parent;
            const kvb_hash *h = &seq->hashes[b];
            uint32_t near = b ? kvb_block_index(seq->table[b - 1].id) : KVB__NIL;
            uint64_t x = b < full ? mix[b % KVB__SLOT_AHEAD] : kvb__mix(h);
            seq->table[b] = kvb__block_of(p, kvb__register_one(p, idx, h, x, &parent, m->ntok, near));
        }
        if (b + KVB__SLOT_AHEAD < full) {
            mix[b % KVB__SLOT_AHEAD] = kvb__mix(&seq->hashes[b + KVB__SLOT_AHEAD]);
            KVB__PREFETCH(&p->slots[mix[b % KVB__SLOT_AHEAD] & p->slot_mask]);
        }
    }
    if (num_tokens > seq->computed) seq->computed = num_tokens;
}

/* The blocks a commit up to num_tokens may register: a STORED event each at most. */
static size_t kvb__seq_commit_blocks(const kvb_seq *seq, size_t num_tokens)
{
    size_t bt = seq->pool->cfg.block_tokens, from = seq->computed / bt, to = num_tokens / bt;
    return to > from ? to - from : 0;
}

KVB_API kvb_result kvb_seq_commit(kvb_seq *seq, size_t num_tokens)
{
    kvb_result r = KVB_OK;
    if (!seq) return KVB_EINVAL;
    if (num_tokens > stbds_arrlenu(seq->tokens)) return KVB_ERANGE;
    pthread_mutex_lock(&seq->pool->lock);
    if ((seq->pool->cfg.on_events && !kvb__events_room(seq->pool, kvb__seq_commit_blocks(seq, num_tokens))) ||
        !kvb__orphans_room(seq->pool, kvb__seq_commit_blocks(seq, num_tokens) != 0))
        r = KVB_ENOMEM;
    else
        kvb__seq_commit_locked(seq, num_tokens);
    kvb__unlock(seq->pool);
    return r;
}

KVB_API kvb_result kvb_seq_commit_many(kvb_seq *const *seqs, const size_t *num_tokens, size_t n)
{
    size_t i;
    if (n && (!seqs || !num_tokens)) return KVB_EINVAL;
    if (!n) return KVB_OK;
    if (!kvb__seqs_one_pool(seqs, n)) return KVB_EINVAL;
    for (i = 0; i < n; i++)
        if (num_tokens[i] > stbds_arrlenu(seqs[i]->tokens)) return KVB_ERANGE;
    pthread_mutex_lock(&seqs[0]->pool->lock);
    {
        size_t events = 0, firsts = 0; /* a sequence's first block committed: chained to one of its own */
        for (i = 0; i < n; i++) {
            size_t k = kvb__seq_commit_blocks(seqs[i], num_tokens[i]);
            events += k;
            firsts += k != 0;
        }
        if ((seqs[0]->pool->cfg.on_events && !kvb__events_room(seqs[0]->pool, events)) ||
            !kvb__orphans_room(seqs[0]->pool, firsts)) {
            pthread_mutex_unlock(&seqs[0]->pool->lock);
            return KVB_ENOMEM;
        }
    }
    for (i = 0; i < n; i++) {
        kvb__seq_prefetch(seqs, i, n, 2);
        kvb__seq_commit_locked(seqs[i], num_tokens[i]);
    }
    kvb__unlock(seqs[0]->pool);
    return KVB_OK;
}

KVB_API kvb_result kvb_seq_fork(kvb_seq *seq, kvb_seq **out)
{
    kvb_seq *c;
    size_t i, nt, nh;
    kvb_result r;
    if (!seq || !out) return KVB_EINVAL;
    if ((r = kvb_seq_create(seq->pool, NULL, &c)) != KVB_OK) return r;
    nt = stbds_arrlenu(seq->tokens), nh = stbds_arrlenu(seq->hashes);
    if (!kvb__seq_room(c, nt)) { /* before a reference is taken: seq and the pool unchanged */
        kvb__seq_free(c);
        return KVB_ENOMEM;
    }
    c->salt = seq->salt;
    c->n_extra = seq->n_extra;
    memcpy(c->extra, seq->extra, sizeof c->extra);
    c->computed = seq->computed;
    c->cached = seq->cached;
    if (nt) memcpy(stbds_arraddnptr(c->tokens, nt), seq->tokens, nt * sizeof *c->tokens);
    if (nh) memcpy(stbds_arraddnptr(c->hashes, nh), seq->hashes, nh * sizeof *c->hashes);
    pthread_mutex_lock(&seq->pool->lock);
    for (i = 0; i < stbds_arrlenu(seq->table); i++) {
        seq->pool->meta[kvb_block_index(seq->table[i].id)].refs++;
        stbds_arrput(c->table, seq->table[i]);
    }
    pthread_mutex_unlock(&seq->pool->lock);
    *out = c;
    return KVB_OK;
}

/* Room in the eviction rings of level 0 for each registered block of blocks[0..n), should a release
 * make it inactive: kvb__list_push then grows no ring. */
static int kvb__rings_room(kvb_pool *p, const kvb_block *blocks, size_t n)
{
    size_t per[KVB__CLASSES] = {0}, i;
    if (p->cfg.eviction == KVB_EVICT_CUSTOM) return 1;
    for (i = 0; i < n; i++) {
        const kvb__meta *m = &p->meta[kvb_block_index(blocks[i].id)];
        per[m->cls] += m->state == KVB_STATE_REGISTERED;
    }
    for (i = 0; i < KVB__CLASSES; i++)
        if (!kvb__ring_fit(&p->rings[i], stbds_arrlenu(p->rings[i].e) + per[i])) return 0;
    return 1;
}

/* Truncate's copy of its kept last block (keep - 1, shared or registered, rem tokens kept) and the drop
 * of the blocks past it. The copy goes first when a block is available, so that a failed copy changes
 * nothing; else the tail goes first to make room, and a failed copy then ends the sequence at the block
 * boundary below (*num_tokens). The memory is taken first (KVB_ENOMEM, nothing changed). Pool locked. */
static kvb_result kvb__seq_truncate_cow(kvb_seq *s, size_t keep, uint32_t rem, size_t *num_tokens)
{
    kvb_pool *p = s->pool;
    void *stack[2 * KVB__COPY_STACK] = {0}, **span = NULL; /* zeroed: -O2 cannot see n >= 1 */
    kvb_result r;
    if (!kvb__events_room(p, !p->n_free) || !(span = kvb__copy_spans(p, stack))) return KVB_ENOMEM;
    if (kvb__available(p, 1)) {
        if ((r = kvb__seq_cow(s, keep - 1, rem, span)) == KVB_OK) kvb__seq_drop_tail(s, keep, 0);
    } else {
        kvb__seq_drop_tail(s, keep, 0);
        if ((r = kvb__seq_cow(s, keep - 1, rem, span)) != KVB_OK) {
            kvb__seq_drop_tail(s, keep - 1, 0);
            *num_tokens = (keep - 1) * p->cfg.block_tokens;
        }
    }
    kvb__copy_spans_free(span, stack);
    return r;
}

KVB_API kvb_result kvb_seq_truncate(kvb_seq *seq, size_t num_tokens)
{
    kvb_pool *p;
    size_t bt, len, nb, keep, rem, i, freed = 0;
    uint32_t last = KVB__NIL;
    int cow = 0;
    kvb_result r = KVB_OK;
    if (!seq) return KVB_EINVAL;
    p = seq->pool;
    bt = p->cfg.block_tokens;
    len = stbds_arrlenu(seq->tokens);
    nb = stbds_arrlenu(seq->table);
    if (num_tokens > len) return KVB_ERANGE;
    if (num_tokens == len) return KVB_OK;
    keep = (num_tokens + bt - 1) / bt;
    rem = num_tokens % bt;
    pthread_mutex_lock(&p->lock);
    if (rem) {
        last = kvb_block_index(seq->table[keep - 1].id);
        cow = p->meta[last].state == KVB_STATE_REGISTERED || p->meta[last].refs > 1;
        if (!cow && p->meta[last].state != KVB_STATE_PARTIAL && p->meta[last].state != KVB_STATE_READY)
            r = KVB_ESTATE;
    }
    for (i = keep; i < nb; i++) freed += p->meta[kvb_block_index(seq->table[i].id)].refs == 1;
    if (r == KVB_OK && cow && !kvb__available(p, 1) && !freed) r = KVB_ENOSPACE;
    /* the blocks let go (the copied one too) may become inactive: their rings' room first */
    if (r == KVB_OK && !kvb__rings_room(p, seq->table + (keep - (size_t)cow), nb - keep + (size_t)cow)) r = KVB_ENOMEM;
    if (r == KVB_OK && cow) {
        r = kvb__seq_truncate_cow(seq, keep, (uint32_t)rem, &num_tokens);
    } else if (r == KVB_OK) {
        kvb__seq_drop_tail(seq, keep, 0);
        if (last != KVB__NIL) {
            p->meta[last].ntok = (uint16_t)rem;
            p->meta[last].state = KVB_STATE_PARTIAL;
        }
    }
    kvb__unlock(p);
    if (r != KVB_OK && stbds_arrlenu(seq->table) == nb) return r;
    KVB__ARR_SHRINK(seq->tokens, num_tokens);
    KVB__ARR_SHRINK(seq->hashes, num_tokens / bt);
    if (seq->computed > num_tokens) seq->computed = num_tokens;
    if (seq->cached > num_tokens) seq->cached = num_tokens;
    return r;
}

KVB_API kvb_result kvb_seq_blocks(const kvb_seq *seq, const kvb_block **out_table, size_t *out_n)
{
    if (!seq || !out_table || !out_n) return KVB_EINVAL;
    *out_table = seq->table;
    *out_n = stbds_arrlenu(seq->table);
    return KVB_OK;
}

KVB_API kvb_result kvb_seq_get_info(const kvb_seq *seq, kvb_seq_info *out)
{
    if (!seq || !out) return KVB_EINVAL;
    out->num_tokens = stbds_arrlenu(seq->tokens);
    out->num_computed = seq->computed;
    out->num_cached = seq->cached;
    out->num_blocks = stbds_arrlenu(seq->table);
    out->num_full = stbds_arrlenu(seq->hashes);
    return KVB_OK;
}

KVB_API kvb_result kvb_seq_tokens(const kvb_seq *seq, const uint32_t **out_tokens, size_t *out_n)
{
    if (!seq || !out_tokens || !out_n) return KVB_EINVAL;
    *out_tokens = seq->tokens;
    *out_n = stbds_arrlenu(seq->tokens);
    return KVB_OK;
}

KVB_API kvb_result kvb_seq_hashes(const kvb_seq *seq, const kvb_hash **out_hashes, size_t *out_n)
{
    if (!seq || !out_hashes || !out_n) return KVB_EINVAL;
    *out_hashes = seq->hashes;
    *out_n = stbds_arrlenu(seq->hashes);
    return KVB_OK;
}

#ifdef KVB__DEFINED_TYPEOF
#undef typeof
#undef KVB__DEFINED_TYPEOF
#endif

#endif /* KVBLOCK_IMPL_INCLUDED */
#endif /* KVBLOCK_IMPLEMENTATION || KVCACHE_IMPLEMENTATION */
