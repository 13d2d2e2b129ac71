/* fuzz_ops.c — libFuzzer target: the input bytes are a program of pool, sequence and pipeline calls.
 *
 * Two small pools with storage (A, the device tier, and B, the host tier; different layouts, the same
 * block bytes), sequences on A, a poll-mode offload pipeline A -> B and an onboarding pipeline B -> A
 * with the inline memcpy backend, a manual clock, cancel tokens and precondition events. The first
 * bytes choose the configuration; then each op is one byte (which call) and the bytes it reads as
 * arguments. Ops are often invalid on purpose: stale and forged handles, weak handles where strong ones
 * belong, double releases, out-of-range sizes, NULL arrays, released transfers.
 *
 * The pipelines' backend copies with memcpy but may hold jobs until a later op and fail the copies the
 * input names (tests of joins, retries and cancels need copies that fail or finish late). At the end the
 * faults stop, held jobs finish, time moves on: every transfer not released must then be final.
 *
 * After every op both pools must pass kvb_pool_check(). Also checked: a failed call changes no set of
 * the pool (free / active / inactive / cached hashes); a call the manual says must fail does fail; and
 * every Registered block holds the bytes of its hash (written when it is registered here, copied by the
 * pipelines), checked on every match, landing and onboarding. Anything else is abort().
 *
 *   make fuzz FUZZ_SECONDS=60          libFuzzer from tests/fuzz/corpus (clang)
 *   make test                          runs build/fuzz/replay over the corpus once (any compiler)
 *   KVFUZZ_TRACE=1 build/fuzz/replay FILE...   prints each op and its result
 */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "fuzz_backend.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { FZ_SLOTS = 48, FZ_SEQS = 4, FZ_XFERS = 8, FZ_LAYERS = 2, FZ_PAGE = 8, FZ_MAX_N = 16, FZ_MAX_OPS = 400 };

/* A handle we hold or held: strong (alloc, match, upgrade, take, retain) or weak (weak_of, candidates).
 * The harness keeps the API's contract where the library cannot check it: it never releases a
 * reference it does not own (one a sequence or a pipeline holds), and only the owner of a block it
 * allocated writes to it. Everything else that is invalid, it does. */
typedef struct fz_slot {
    uint64_t id;
    int pool;   /* 0 = A, 1 = B */
    int held;   /* references this slot owns (0 after its release: a second one is a double release) */
    int mine;   /* allocated here: the lifecycle calls and register may write to it */
} fz_slot;

typedef struct fz_xfer {
    kvo_transfer t;
    int up;     /* 0 = offload A -> B, 1 = onboard B -> A */
    int live;   /* not released yet */
} fz_xfer;

typedef struct fz {
    const uint8_t *in;
    size_t n, at;
    int trace;
    kvb_pool *pool[2];
    uint32_t num_blocks[2], block_tokens;
    kvb_seq *seq[FZ_SEQS];
    kvo_backend *copy[2];
    fz_faulty faulty[2];     /* the pipelines' backends, over copy[] */
    kvo_pipeline *pipe[2];   /* [0] down A -> B, [1] up B -> A (NULL when the layouts refused) */
    kvo_token *token[2];
    kvo_event *cpu_event;
    kvo_event *custom_event;
    int custom_answer;       /* what custom_event's query says: 0 not yet, 1 signalled, -1 failed */
    uint64_t now, tick;      /* the manual clock: moves `tick` on every read */
    uint32_t policy_shift;   /* 0: no user policy */
    fz_slot slot[FZ_SLOTS];
    size_t next_slot;
    fz_xfer xfer[FZ_XFERS];
    size_t next_xfer;
    int op;                  /* index of the op running, for messages */
} fz;

/* ---- reading the input ------------------------------------------------------------------------ */

static uint8_t fz_u8(fz *f) { return f->at < f->n ? f->in[f->at++] : 0; }
static uint32_t fz_below(fz *f, uint32_t k) { return k ? (uint32_t)fz_u8(f) % k : 0; }
static uint64_t fz_u64(fz *f)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | fz_u8(f);
    return v;
}

static void fz_fail(fz *f, const char *what, int code)
{
    fprintf(stderr, "fuzz_ops: op %d (input byte %zu): %s (result %d: %s)\n", f->op, f->at, what, code,
            kvo_result_string(code));
    abort();
}

#define FZ_TRACE(f, ...)                                                                              \
    do {                                                                                              \
        if ((f)->trace) {                                                                             \
            fprintf(stderr, "  op %3d ", (f)->op);                                                    \
            fprintf(stderr, __VA_ARGS__);                                                             \
            fputc('\n', stderr);                                                                      \
        }                                                                                             \
    } while (0)

/* ---- hashes and bytes ------------------------------------------------------------------------- */

/* Eight chains of eight hashes: few enough that matches, duplicates and onboarding hits happen. */
static kvb_hash fz_hash(uint32_t chain, uint32_t depth)
{
    kvb_hash parent = {0, 0};
    for (uint32_t d = 0; d <= depth; d++) {
        uint32_t tok = chain * 100u + d;
        parent = kvb_hash_block(&parent, &tok, 1, NULL, 0, 0x5eed);
    }
    return parent;
}

static unsigned char fz_pattern(kvb_hash h, uint32_t layer, uint32_t part, uint32_t j)
{
    uint64_t x = h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)(layer * 2 + part) << 40) ^ j;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return (unsigned char)x;
}

/* Writes (write = 1) or checks the bytes of hash h in every page of a block the caller references.
 * Returns 0 when a page differs. */
static int fz_bytes(kvb_pool *pool, kvb_block b, kvb_hash h, int write)
{
    for (uint32_t layer = 0; layer < FZ_LAYERS; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            unsigned char *page = NULL;
            if (kvb_block_data(pool, b, layer, part, (void **)&page) != KVB_OK || !page) return 0;
            for (uint32_t j = 0; j < FZ_PAGE; j++) {
                if (write) page[j] = fz_pattern(h, layer, part, j);
                else if (page[j] != fz_pattern(h, layer, part, j)) return 0;
            }
        }
    return 1;
}

/* A block just registered here gets the bytes of its hash (a block already Registered has them). */
static void fz_stamp(fz *f, int p, kvb_block b)
{
    kvb_block_info info;
    if (kvb_block_get_info(f->pool[p], b.id, &info) == KVB_OK && info.state == KVB_STATE_REGISTERED)
        (void)fz_bytes(f->pool[p], b, info.hash, 1);
}

/* A Registered block we reference must hold the bytes of its hash. */
static void fz_verify(fz *f, int p, kvb_block b, const char *where)
{
    kvb_block_info info;
    if (kvb_block_get_info(f->pool[p], b.id, &info) != KVB_OK) fz_fail(f, "no info for a held block", 0);
    if (info.state == KVB_STATE_REGISTERED && !fz_bytes(f->pool[p], b, info.hash, 0)) fz_fail(f, where, 0);
}

/* ---- invariants ------------------------------------------------------------------------------- */

static void fz_check_pools(fz *f)
{
    for (int p = 0; p < 2; p++) {
        char why[256] = "";
        kvb_result r = kvb_pool_check(f->pool[p], why, sizeof why);
        if (r != KVB_OK) {
            fprintf(stderr, "fuzz_ops: pool %c check failed after op %d: %s\n", "AB"[p], f->op, why);
            abort();
        }
    }
}

typedef struct fz_sets { uint32_t free_blocks, active, inactive, hashes; } fz_sets;

static fz_sets fz_sets_of(fz *f, int p)
{
    kvb_pool_stats s;
    fz_sets x;
    if (kvb_pool_get_stats(f->pool[p], &s) != KVB_OK) fz_fail(f, "get_stats", 0);
    x.free_blocks = s.free_blocks;
    x.active = s.active_blocks;
    x.inactive = s.inactive_blocks;
    x.hashes = s.cached_hashes;
    return x;
}

/* "A call that fails changes nothing": after a failed call the pool's sets are as before. */
static void fz_unchanged_if_failed(fz *f, int p, fz_sets before, int result, const char *call)
{
    fz_sets after;
    if (result == KVB_OK) return;
    after = fz_sets_of(f, p);
    if (memcmp(&before, &after, sizeof before) != 0) {
        fprintf(stderr, "fuzz_ops: %s failed (%s) but changed pool %c: free %u->%u active %u->%u inactive "
                        "%u->%u hashes %u->%u\n",
                call, kvb_result_string(result), "AB"[p], before.free_blocks, after.free_blocks, before.active,
                after.active, before.inactive, after.inactive, before.hashes, after.hashes);
        fz_fail(f, "a failed call changed the pool", result);
    }
}

/* ---- slots ------------------------------------------------------------------------------------ */

static void fz_keep(fz *f, int p, uint64_t id, int held, int mine)
{
    fz_slot *s = &f->slot[f->next_slot++ % FZ_SLOTS];
    s->id = id;
    s->pool = p;
    s->held = held;
    s->mine = mine;
}

/* References we own on the block `id` names in pool p (over every slot). */
static int fz_ours(fz *f, int p, uint64_t id)
{
    int n = 0;
    for (size_t i = 0; i < FZ_SLOTS; i++)
        if (f->slot[i].pool == p && f->slot[i].id == id && f->slot[i].held > 0) n += f->slot[i].held;
    return n;
}

/* Mostly one of the eight handles kept last (so ops chain: alloc, init, add, ..., register), else any. */
static size_t fz_pick_index(fz *f)
{
    uint8_t b = fz_u8(f);
    if (b & 0x80) return (size_t)(b & 0x7f) % FZ_SLOTS;
    return (f->next_slot + FZ_SLOTS * 2 - 1 - (b & 7u)) % FZ_SLOTS;
}

static fz_slot *fz_pick(fz *f) { return &f->slot[fz_pick_index(f)]; }

/* ---- callbacks -------------------------------------------------------------------------------- */

static uint64_t fz_clock(void *user)
{
    fz *f = (fz *)user;
    f->now += f->tick;
    return f->now;
}

static kvo_verdict fz_policy(void *user, const kvb_hash *hash, uint32_t src_index)
{
    fz *f = (fz *)user;
    (void)src_index;
    return (kvo_verdict)((hash->lo >> f->policy_shift) % 3u);
}

static int fz_query(void *user) { return ((fz *)user)->custom_answer; }


typedef struct fz_done_ctx { fz *f; int dst; } fz_done_ctx;

/* Every block a transfer landed must carry the bytes of its hash. */
static void fz_on_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    fz_done_ctx *c = (fz_done_ctx *)user;
    (void)t;
    if (info->transferred + info->present > info->blocks) fz_fail(c->f, "transfer counts exceed its blocks", 0);
    for (size_t i = 0; i < n; i++) {
        kvb_block b;
        if (!dst[i].id || kvb_upgrade(c->f->pool[c->dst], dst[i], &b) != KVB_OK) continue;
        fz_verify(c->f, c->dst, b, "a landed block does not hold the bytes of its hash");
        if (kvb_release(c->f->pool[c->dst], &b, 1, NULL) != KVB_OK) fz_fail(c->f, "release of a landed block", 0);
    }
}

/* ---- setup and teardown ----------------------------------------------------------------------- */

static int fz_open(fz *f, fz_done_ctx done[2])
{
    uint8_t c0 = fz_u8(f), c1 = fz_u8(f), c2 = fz_u8(f), c3 = fz_u8(f);
    f->block_tokens = 1u + (c0 & 3u);
    for (int p = 0; p < 2; p++) {
        kvb_pool_config cfg;
        memset(&cfg, 0, sizeof cfg);
        f->num_blocks[p] = 1u + fz_below(f, 12);
        cfg.num_blocks = f->num_blocks[p];
        cfg.block_tokens = f->block_tokens;
        { /* three bits: lineage, LRU, FOL (self-tuning or a small fixed step), ARC, S3-FIFO */
            static const kvb_evict_policy pols[8] = {KVB_EVICT_LINEAGE, KVB_EVICT_LRU,    KVB_EVICT_FOL, KVB_EVICT_ARC,
                                                     KVB_EVICT_S3FIFO,  KVB_EVICT_FOL, KVB_EVICT_ARC, KVB_EVICT_S3FIFO};
            unsigned k = ((c0 >> (2 + p)) & 1u) | (((c1 >> (1 + 2 * p)) & 1u) << 1) | (((c3 >> (5 + p)) & 1u) << 2);
            cfg.eviction = pols[k];
            if (k == 5) cfg.fol_class_step = 3;
        }
        cfg.duplicates = (c0 >> (4 + p)) & 1 ? KVB_DUP_REJECT : KVB_DUP_ALLOW;
        cfg.priority_levels = 1u + ((c1 >> (2 * p)) & 1u) * 2u;
        cfg.tier = (uint32_t)p;
        cfg.storage = KVB_STORAGE_HOST;
        cfg.layout.kind = p ? KVB_LAYOUT_LAYER_SEPARATE : KVB_LAYOUT_BLOCK_CONTIGUOUS;
        cfg.layout.num_layers = FZ_LAYERS;
        cfg.layout.num_parts = 2;
        /* one input in 16 gives B other block bytes: the pipelines must refuse (KVO_ELAYOUT) */
        cfg.layout.page_bytes = p && (c1 & 0xf0) == 0xf0 ? FZ_PAGE * 2 : FZ_PAGE;
        if (kvb_pool_create(&cfg, &f->pool[p]) != KVB_OK) return 0;
    }
    f->tick = c2 & 0x80 ? 0 : (uint64_t)(c2 & 0x7f) * 10u;
    f->policy_shift = c3 & 0x80 ? 1u + (c3 & 31u) : 0;
    for (int d = 0; d < 2; d++) {
        kvo_pipeline_config pc;
        kvo_result r;
        if (kvo_memcpy_backend_create(0, &f->copy[d]) != KVO_OK) return 0;
        fz_faulty_init(&f->faulty[d], f->copy[d]);
        memset(&pc, 0, sizeof pc);
        pc.src = f->pool[d];
        pc.dst = f->pool[1 - d];
        pc.backend = &f->faulty[d].base;
        pc.mode = KVO_MODE_POLL;
        pc.max_batch = 1u + fz_below(f, 8);
        pc.min_batch = 1u + fz_below(f, 4);
        pc.flush_interval_us = 1u + fz_below(f, 4) * 500u;
        pc.policy_timeout_us = 1u + fz_below(f, 4) * 1000u;
        pc.sweep_interval_us = 1u + fz_below(f, 4) * 500u;
        pc.max_concurrent = 1u + fz_below(f, 2);
        pc.on_deck = 1u + fz_below(f, 3);
        pc.precondition_timeout_us = 1u + fz_below(f, 4) * 2000u;
        pc.presence = c3 & 0x40 ? -1 : 0;
        pc.min_frequency = (c3 >> 5) & 1u ? 2u : 0u;
        if (f->policy_shift) {
            pc.policy = fz_policy;
            pc.policy_user = f;
        }
        pc.clock = fz_clock;
        pc.clock_user = f;
        done[d].f = f;
        done[d].dst = 1 - d;
        pc.on_done = fz_on_done;
        pc.done_user = &done[d];
        pc.dst_priority = (c1 >> 4) & 1u;
        r = kvo_pipeline_create(&pc, &f->pipe[d]);
        { /* refused: B's other block bytes (KVO_ELAYOUT), or a level the destination lacks (KVO_EINVAL) */
            kvb_pool_config dc;
            int no_level = kvb_pool_get_config(pc.dst, &dc) == KVB_OK && pc.dst_priority >= dc.priority_levels;
            if (r == KVO_OK && no_level) fz_fail(f, "pipeline_create took a level its destination lacks", r);
            if (r != KVO_OK) {
                if (no_level ? r != KVO_EINVAL : (r != KVO_ELAYOUT || (c1 & 0xf0) != 0xf0)) fz_fail(f, "pipeline_create", r);
                f->pipe[d] = NULL;
            }
        }
    }
    if (kvo_token_create(&f->token[0]) != KVO_OK || kvo_token_create(&f->token[1]) != KVO_OK) return 0;
    if (kvo_event_create(&f->cpu_event) != KVO_OK) return 0;
    if (kvo_event_create_custom(fz_query, f, &f->custom_event) != KVO_OK) return 0;
    return 1;
}

static void fz_close(fz *f)
{
    for (int d = 0; d < 2; d++) kvo_pipeline_destroy(f->pipe[d]);
    fz_check_pools(f);
    for (int i = 0; i < FZ_SEQS; i++) kvb_seq_destroy(f->seq[i]);
    fz_check_pools(f);
    for (int p = 0; p < 2; p++) kvb_pool_destroy(f->pool[p]);
    for (int d = 0; d < 2; d++) kvo_backend_destroy(f->copy[d]);
    for (int i = 0; i < 2; i++)
        if (f->token[i]) kvo_token_release(f->token[i]);
    if (f->cpu_event) kvo_event_release(f->cpu_event);
    if (f->custom_event) kvo_event_release(f->custom_event);
}

/* ---- the ops ---------------------------------------------------------------------------------- */

/* n handles from the slots (any kind, any pool), for calls that take arrays */
static size_t fz_pick_blocks(fz *f, kvb_block *out, size_t *which, size_t max)
{
    size_t n = fz_below(f, (uint32_t)max + 1);
    for (size_t i = 0; i < n; i++) {
        which[i] = fz_pick_index(f);
        out[i].id = f->slot[which[i]].id;
    }
    return n;
}

static void op_alloc(fz *f)
{
    int p = fz_below(f, 2);
    uint8_t b = fz_u8(f);
    size_t n = b == 0xff ? SIZE_MAX / 2 : (size_t)(b % (f->num_blocks[p] + 3u));
    kvb_block out[FZ_MAX_N + 3];
    fz_sets before = fz_sets_of(f, p);
    kvb_result r = kvb_alloc(f->pool[p], n, n == SIZE_MAX / 2 ? NULL : out);
    FZ_TRACE(f, "alloc pool %c n %zu -> %s %#llx", "AB"[p], n, kvb_result_string(r), r == KVB_OK && n ? (unsigned long long)out[0].id : 0ull);
    if (n > f->num_blocks[p] && r == KVB_OK) fz_fail(f, "alloc of more blocks than the pool has succeeded", r);
    fz_unchanged_if_failed(f, p, before, r, "alloc");
    if (r == KVB_OK)
        for (size_t i = 0; i < n; i++) fz_keep(f, p, out[i].id, 1, 1);
}

/* Release or retain up to four handles of pool p at once. A handle that names a live block of p is
 * used only when the call cannot take a reference someone else owns: a release asks at most for the
 * references we own, or for more than the block has (then it must fail: KVB_EDOUBLE). Handles that
 * are weak, stale or from the other pool (naming no live block of p) must make the call fail. */
static void op_release_or_retain(fz *f, int release)
{
    int p = (int)fz_below(f, 2), must_fail = 0;
    kvb_block b[4];
    size_t which[4], n = fz_pick_blocks(f, b, which, 4);
    uint8_t prio = fz_u8(f);
    kvb_release_opts opts = {(uint32_t)(prio & 3u), (uint32_t)(prio >> 2) & 7u}; /* 5..7 > any block_tokens */
    fz_sets before;
    kvb_result r;
    for (size_t i = 0; i < n; i++) {
        kvb_block_info info;
        int asked = 0, live = kvb_block_get_info(f->pool[p], b[i].id, &info) == KVB_OK;
        if (b[i].id & KVB_WEAK_BIT || !live) {
            must_fail = 1;
            continue;
        }
        if (f->slot[which[i]].pool != p) return; /* names a live block of p: it might be someone else's */
        if (!release) continue;
        for (size_t k = 0; k < n; k++) asked += b[k].id == b[i].id;
        if (asked > (int)info.refs) must_fail = 1;                            /* a detectable double release */
        else if (asked > fz_ours(f, p, b[i].id)) return;                      /* would take someone's reference */
    }
    if (release && !(prio & 0x80) && opts.last_block_tokens > f->block_tokens) must_fail = 1; /* KVB_ERANGE */
    before = fz_sets_of(f, p);
    r = release ? kvb_release(f->pool[p], b, n, prio & 0x80 ? NULL : &opts) : kvb_retain(f->pool[p], b, n);
    FZ_TRACE(f, "%s pool %c n %zu [%#llx %#llx %#llx %#llx] -> %s", release ? "release" : "retain", "AB"[p], n,
             n > 0 ? (unsigned long long)b[0].id : 0ull, n > 1 ? (unsigned long long)b[1].id : 0ull,
             n > 2 ? (unsigned long long)b[2].id : 0ull, n > 3 ? (unsigned long long)b[3].id : 0ull,
             kvb_result_string(r));
    if (must_fail && r == KVB_OK)
        fz_fail(f, release ? "a release of weak, stale or over-released handles succeeded"
                           : "a retain of weak or stale handles succeeded", r);
    fz_unchanged_if_failed(f, p, before, r, release ? "release" : "retain");
    if (r != KVB_OK) return;
    for (size_t i = 0; i < n; i++) {
        fz_slot *s = &f->slot[which[i]];
        if (!release) s->held++;
        else if (s->held > 0) s->held--;
        else /* the reference came from another of our slots on the same block */
            for (size_t k = 0; k < FZ_SLOTS; k++)
                if (f->slot[k].pool == p && f->slot[k].id == s->id && f->slot[k].held > 0) {
                    f->slot[k].held--;
                    break;
                }
    }
}

static void op_lifecycle(fz *f)
{
    fz_slot *s = fz_pick(f);
    int p = s->pool, what = (int)fz_below(f, 5);
    kvb_block b = {s->id};
    fz_sets before;
    kvb_result r = KVB_OK;
    if (!s->mine) return; /* one writer per block: blocks of sequences and matches are not ours to write */
    before = fz_sets_of(f, p);
    switch (what) {
    case 0: {
        uint32_t chain = fz_below(f, 8), depth = fz_below(f, 8);
        kvb_hash parent = fz_hash(chain, depth);
        uint64_t extra[KVB_MAX_EXTRA_KEYS + 1] = {0};
        size_t n_extra = fz_below(f, KVB_MAX_EXTRA_KEYS + 2);
        r = kvb_block_init(f->pool[p], b, depth == 7 ? NULL : &parent, fz_below(f, 2), extra, n_extra);
        if (n_extra > KVB_MAX_EXTRA_KEYS && r == KVB_OK) fz_fail(f, "init with too many extra keys succeeded", r);
        break;
    }
    case 1: {
        uint32_t tokens[8];
        size_t n = fz_below(f, f->block_tokens + 2);
        for (size_t i = 0; i < n; i++) tokens[i] = fz_below(f, 3);
        r = kvb_block_add_tokens(f->pool[p], b, tokens, n, (int)fz_below(f, 2));
        break;
    }
    case 2: r = kvb_block_schedule(f->pool[p], b); break;
    case 3: r = kvb_block_cancel_schedule(f->pool[p], b); break;
    default: r = kvb_block_compute_done(f->pool[p], b); break;
    }
    FZ_TRACE(f, "lifecycle %d pool %c -> %s", what, "AB"[p], kvb_result_string(r));
    fz_unchanged_if_failed(f, p, before, r, "lifecycle");
}

static void op_register(fz *f, int hashed)
{
    int p = fz_below(f, 2);
    kvb_block b[4], out[4];
    kvb_hash hashes[4], parents[4];
    size_t which[4], n = fz_pick_blocks(f, b, which, 4);
    uint32_t chain = fz_below(f, 8), depth = fz_below(f, 5);
    int roots = (int)fz_below(f, 4) == 0;
    fz_sets before;
    kvb_result r;
    for (size_t i = 0; i < n; i++) {
        if (!f->slot[which[i]].mine || f->slot[which[i]].pool != p) return; /* only blocks we allocated */
        hashes[i] = fz_hash(chain, depth + (uint32_t)i);
        parents[i] = depth + i ? fz_hash(chain, depth + (uint32_t)i - 1) : (kvb_hash){0, 0};
    }
    before = fz_sets_of(f, p);
    r = hashed ? kvb_register_hashed(f->pool[p], b, n, hashes, roots ? NULL : parents, out)
               : kvb_register(f->pool[p], b, n, out);
    FZ_TRACE(f, "%s pool %c n %zu -> %s", hashed ? "register_hashed" : "register", "AB"[p], n, kvb_result_string(r));
    fz_unchanged_if_failed(f, p, before, r, hashed ? "register_hashed" : "register");
    if (r != KVB_OK) return;
    for (size_t i = 0; i < n; i++) {
        if (out[i].id != b[i].id) { /* a duplicate: the reference moved to the existing block */
            f->slot[which[i]].id = out[i].id;
            f->slot[which[i]].mine = 0;
        }
        fz_stamp(f, p, out[i]);
    }
}

static void op_match(fz *f)
{
    int p = fz_below(f, 2), probe = (int)fz_below(f, 3);
    uint32_t chain = fz_below(f, 8);
    size_t n = fz_below(f, 9), got = 0;
    kvb_hash h[8];
    kvb_block out[8];
    uint8_t present[8];
    kvb_result r;
    for (size_t i = 0; i < n; i++) h[i] = fz_hash(chain, (uint32_t)i);
    if (probe == 1) r = kvb_lookup(f->pool[p], h, n, &got);
    else if (probe == 2) r = kvb_presence(f->pool[p], h, n, present, &got);
    else r = kvb_match(f->pool[p], h, n, out, &got);
    FZ_TRACE(f, "%s pool %c chain %u n %zu -> %s, %zu", probe == 1 ? "lookup" : probe == 2 ? "presence" : "match",
             "AB"[p], chain, n, kvb_result_string(r), got);
    if (r != KVB_OK) fz_fail(f, "match / lookup / presence of valid hashes failed", r);
    if (got > n) fz_fail(f, "matched more hashes than asked", r);
    if (probe) return;
    for (size_t i = 0; i < got; i++) {
        fz_verify(f, p, out[i], "a matched block does not hold the bytes of its hash");
        fz_keep(f, p, out[i].id, 1, 0);
    }
}

static void op_weak_upgrade(fz *f)
{
    fz_slot *s = fz_pick(f);
    int what = (int)fz_below(f, 3);
    if (what == 0) { /* weak_of */
        fz_keep(f, s->pool, kvb_weak_of((kvb_block){s->id}).id, 0, 0);
        FZ_TRACE(f, "weak_of");
        return;
    }
    {
        int p = what == 2 ? (int)fz_below(f, 2) : s->pool; /* 2: maybe the other pool's handle */
        kvb_weak w = {what == 2 && fz_below(f, 2) ? fz_u64(f) : s->id}; /* or a forged one */
        kvb_block out;
        fz_sets before = fz_sets_of(f, p);
        kvb_result r = kvb_upgrade(f->pool[p], w, &out);
        FZ_TRACE(f, "upgrade pool %c id %#llx -> %s", "AB"[p], (unsigned long long)w.id, kvb_result_string(r));
        if (!(w.id & KVB_WEAK_BIT) && r == KVB_OK) fz_fail(f, "upgrade of a strong handle succeeded", r);
        fz_unchanged_if_failed(f, p, before, r, "upgrade");
        if (r == KVB_OK) {
            fz_verify(f, p, out, "an upgraded block does not hold the bytes of its hash");
            fz_keep(f, p, out.id, 1, 0);
        }
    }
}

static void op_peek(fz *f)
{
    fz_slot *s = fz_pick(f);
    int p = (int)fz_below(f, 2);
    uint64_t id = fz_below(f, 4) ? s->id : fz_u64(f);
    uint32_t layer = fz_below(f, FZ_LAYERS + 1), part = fz_below(f, 3); /* one past the end of each too */
    kvb_block_info info;
    void *data = NULL;
    kvb_result r = kvb_block_get_info(f->pool[p], id, &info);
    kvb_result d = kvb_block_data(f->pool[p], (kvb_block){id}, layer, part, &data);
    FZ_TRACE(f, "peek pool %c -> %s / %s", "AB"[p], kvb_result_string(r), kvb_result_string(d));
    if (d == KVB_OK && !data) fz_fail(f, "block_data gave no address", d);
    if (d == KVB_OK && (layer >= FZ_LAYERS || part >= 2)) fz_fail(f, "block_data out of range succeeded", d);
}

static void op_seq(fz *f)
{
    int i = (int)fz_below(f, FZ_SEQS), what = (int)fz_below(f, 7);
    kvb_seq *s = f->seq[i];
    kvb_seq_info info = {0};
    kvb_result r = KVB_OK;
    if (what != 0 && !s) return;
    if (s && kvb_seq_get_info(s, &info) != KVB_OK) fz_fail(f, "seq_get_info", 0);
    switch (what) {
    case 0: { /* create (replacing) */
        uint64_t extra[KVB_MAX_EXTRA_KEYS + 1] = {1, 2, 3};
        kvb_seq_config sc;
        int with_config;
        sc.salt = fz_below(f, 2);
        sc.extra = extra;
        sc.n_extra = fz_below(f, 3) ? 0 : fz_below(f, KVB_MAX_EXTRA_KEYS + 2); /* may be one too many */
        with_config = fz_below(f, 4) != 0;
        kvb_seq_destroy(s);
        f->seq[i] = NULL;
        r = kvb_seq_create(f->pool[0], with_config ? &sc : NULL, &f->seq[i]);
        if (with_config && sc.n_extra > KVB_MAX_EXTRA_KEYS && r == KVB_OK)
            fz_fail(f, "seq_create with too many extra keys succeeded", r);
        if (r != KVB_OK) f->seq[i] = NULL;
        break;
    }
    case 1: { /* append */
        uint32_t tokens[16];
        size_t n = fz_below(f, 17), cached = 0;
        fz_sets before = fz_sets_of(f, 0);
        kvb_seq_info after;
        for (size_t k = 0; k < n; k++) tokens[k] = fz_below(f, 3);
        r = kvb_seq_append(s, tokens, n, &cached);
        if (r != KVB_OK) {
            fz_unchanged_if_failed(f, 0, before, r, "seq_append");
            if (kvb_seq_get_info(s, &after) != KVB_OK || memcmp(&after, &info, sizeof info) != 0)
                fz_fail(f, "a failed seq_append changed the sequence", r);
        } else if (cached > n) {
            fz_fail(f, "seq_append reused more tokens than it got", r);
        }
        break;
    }
    case 2: { /* commit: may ask past the end (KVB_ERANGE) */
        size_t upto = fz_below(f, (uint32_t)info.num_tokens + 3);
        const kvb_block *table;
        size_t nb;
        r = kvb_seq_commit(s, upto);
        if (upto > info.num_tokens && r == KVB_OK) fz_fail(f, "commit past the appended tokens succeeded", r);
        if (kvb_seq_blocks(s, &table, &nb) != KVB_OK) fz_fail(f, "seq_blocks", 0);
        for (size_t k = 0; k < nb; k++) fz_stamp(f, 0, table[k]);
        break;
    }
    case 3: { /* fork into another sequence slot */
        int j = (int)fz_below(f, FZ_SEQS);
        kvb_seq *child = NULL;
        if (j == i) break;
        r = kvb_seq_fork(s, &child);
        if (r == KVB_OK) {
            kvb_seq_destroy(f->seq[j]);
            f->seq[j] = child;
        }
        break;
    }
    case 4: /* truncate: may ask past the end */
        r = kvb_seq_truncate(s, fz_below(f, (uint32_t)info.num_tokens + 2));
        break;
    case 5: /* destroy */
        kvb_seq_destroy(s);
        f->seq[i] = NULL;
        break;
    default: { /* take a reference of our own on one of its blocks */
        const kvb_block *table;
        size_t nb;
        if (kvb_seq_blocks(s, &table, &nb) != KVB_OK) fz_fail(f, "seq_blocks", 0);
        if (nb) {
            kvb_block b = table[fz_below(f, (uint32_t)nb)];
            r = kvb_retain(f->pool[0], &b, 1);
            if (r != KVB_OK) fz_fail(f, "retain of a sequence's block failed", r);
            fz_keep(f, 0, b.id, 1, 0);
        }
        break;
    }
    }
    FZ_TRACE(f, "seq %d op %d (tokens %zu) -> %s", i, what, info.num_tokens, kvb_result_string(r));
}

static void op_pool(fz *f)
{
    int p = (int)fz_below(f, 2), what = (int)fz_below(f, 3);
    kvb_result r;
    if (what == 0) {
        kvb_pool_stats st;
        fz_sets before = fz_sets_of(f, p);
        if (kvb_pool_get_stats(f->pool[p], &st) != KVB_OK) fz_fail(f, "get_stats", 0);
        r = kvb_pool_reset(f->pool[p]);
        if (st.active_blocks && r == KVB_OK) fz_fail(f, "reset with active blocks succeeded", r);
        fz_unchanged_if_failed(f, p, before, r, "pool_reset");
    } else if (what == 1) {
        kvb_weak w[8];
        size_t n = 0, max = fz_below(f, 9);
        r = kvb_eviction_candidates(f->pool[p], max, w, &n);
        if (r == KVB_OK && n > max) fz_fail(f, "more eviction candidates than asked", r);
        for (size_t i = 0; r == KVB_OK && i < n; i++) fz_keep(f, p, w[i].id, 0, 0);
    } else { /* NULL arrays with counts: must be refused */
        size_t got;
        r = kvb_alloc(f->pool[p], 2, NULL);
        if (r == KVB_OK) fz_fail(f, "alloc into NULL succeeded", r);
        r = kvb_match(f->pool[p], NULL, 2, NULL, &got);
        if (r == KVB_OK) fz_fail(f, "match of NULL hashes succeeded", r);
        r = kvb_release(f->pool[p], NULL, 1, NULL);
        if (r == KVB_OK) fz_fail(f, "release of NULL succeeded", r);
    }
    FZ_TRACE(f, "pool %c op %d -> %s", "AB"[p], what, kvb_result_string(r));
}

static fz_xfer *fz_new_xfer(fz *f)
{
    fz_xfer *x = &f->xfer[f->next_xfer++ % FZ_XFERS];
    if (x->live) { /* make room (a release cancels, which waits out what is in flight) */
        fz_faulty_release(&f->faulty[x->up]);
        (void)kvo_transfer_release(f->pipe[x->up], x->t);
    }
    x->live = 0;
    return x;
}

static void op_enqueue(fz *f, int up)
{
    kvo_pipeline *pl = f->pipe[up];
    kvo_enqueue_opts opts;
    int use_opts = (int)fz_below(f, 2);
    uint8_t o = fz_u8(f);
    fz_xfer *x;
    kvo_result r;
    kvo_transfer t = {0};
    if (!pl) return;
    memset(&opts, 0, sizeof opts);
    opts.token = o & 1 ? f->token[(o >> 1) & 1] : NULL;
    opts.precondition = o & 4 ? (o & 8 ? f->custom_event : f->cpu_event) : NULL;
    opts.priority = (o >> 4) & 3u;
    if (!up) { /* offload: weak handles from the slots (strong, stale, foreign ones included) */
        kvb_weak w[FZ_MAX_N];
        size_t n = fz_below(f, FZ_MAX_N + 1);
        for (size_t i = 0; i < n; i++) {
            fz_slot *s = fz_pick(f);
            w[i].id = fz_below(f, 8) ? kvb_weak_of((kvb_block){s->id}).id : s->id;
        }
        r = kvo_enqueue(pl, w, n, use_opts ? &opts : NULL, &t);
    } else { /* onboard a prefix of a chain */
        kvb_hash h[8];
        uint32_t chain = fz_below(f, 8);
        size_t n = fz_below(f, 9);
        for (size_t i = 0; i < n; i++) h[i] = fz_hash(chain, (uint32_t)i);
        r = kvo_onboard(pl, h, n, use_opts ? &opts : NULL, &t);
    }
    FZ_TRACE(f, "%s -> %s", up ? "onboard" : "enqueue", kvo_result_string(r));
    if (opts.token && use_opts && kvo_token_is_cancelled(opts.token) && r == KVO_OK)
        fz_fail(f, "enqueue with a cancelled token succeeded", r);
    if (r != KVO_OK) return;
    x = fz_new_xfer(f);
    x->t = t;
    x->up = up;
    x->live = 1;
}

static void op_transfer(fz *f)
{
    fz_xfer *x = &f->xfer[fz_below(f, FZ_XFERS)];
    kvo_pipeline *pl = f->pipe[x->up];
    int what = (int)fz_below(f, 5);
    kvo_result r = KVO_OK;
    kvo_status st = (kvo_status)0;
    if (!pl || !x->t.id) return;
    switch (what) {
    case 0: {
        kvo_transfer_info info;
        r = kvo_transfer_get_info(pl, x->t, &info);
        if (!x->live && r == KVO_OK) fz_fail(f, "info of a released transfer succeeded", r);
        break;
    }
    case 1: r = kvo_transfer_wait(pl, x->t, (int64_t)fz_below(f, 3) * 200, &st); break;
    case 2:
        fz_faulty_release(&f->faulty[x->up]); /* cancel waits out what is in flight: the backend finishes it */
        r = kvo_transfer_cancel(pl, x->t, &st);
        if (r == KVO_OK && st != KVO_STATUS_CANCELLED && st != KVO_STATUS_COMPLETE && st != KVO_STATUS_FAILED)
            fz_fail(f, "cancel returned with the transfer not final", r);
        break;
    case 3: { /* onboarding result: the destination blocks become ours */
        kvb_block out[8];
        size_t n = 0, max = fz_below(f, 9);
        r = kvo_transfer_take_blocks(pl, x->t, out, max, &n);
        if (r == KVO_OK && n > max) fz_fail(f, "took more blocks than asked", r);
        for (size_t i = 0; r == KVO_OK && i < n; i++) {
            fz_verify(f, 0, out[i], "an onboarded block does not hold the bytes of its hash");
            fz_keep(f, 0, out[i].id, 1, 0);
        }
        break;
    }
    default:
        fz_faulty_release(&f->faulty[x->up]); /* a release cancels first (see above) */
        r = kvo_transfer_release(pl, x->t);
        if (!x->live && r == KVO_OK) fz_fail(f, "second release of a transfer succeeded", r);
        x->live = 0;
        break;
    }
    FZ_TRACE(f, "transfer %s op %d -> %s (status %d)", x->up ? "up" : "down", what, kvo_result_string(r), (int)st);
}

static void op_pump(fz *f)
{
    int d = (int)fz_below(f, 2), what = (int)fz_below(f, 8);
    kvo_pipeline *pl = f->pipe[d];
    kvo_result r = KVO_OK;
    if (what == 0) f->now += (uint64_t)fz_u8(f) * 100u;
    else if (what == 1) f->custom_answer = (int)fz_below(f, 3) - 1;
    else if (what == 2) r = kvo_event_signal(f->cpu_event);
    else if (what == 3) { /* tokens: cancel one, or put a fresh one in its place */
        int i = (int)fz_below(f, 2);
        if (fz_below(f, 2)) kvo_token_cancel(f->token[i]);
        else {
            kvo_token_release(f->token[i]);
            f->token[i] = NULL;
            if (kvo_token_create(&f->token[i]) != KVO_OK) fz_fail(f, "token_create", 0);
        }
    } else if (what == 6) { /* the backend's faults from now on */
        uint8_t v = fz_u8(f);
        f->faulty[d].hold = v & 1;
        f->faulty[d].refuse = (v & 0xf0) == 0xf0;
        f->faulty[d].fail_bits = v & 2 ? fz_u8(f) : 0;
    } else if (what == 7) fz_faulty_release(&f->faulty[d]);
    else if (pl && what == 4) r = kvo_pipeline_poll(pl);
    else if (pl) {
        r = kvo_pipeline_drain(pl, (int64_t)fz_below(f, 3) * 300);
        if (r != KVO_OK && r != KVO_ETIMEDOUT) fz_fail(f, "drain", r);
    }
    FZ_TRACE(f, "pump %d pipe %s -> %s", what, d ? "up" : "down", kvo_result_string(r));
}

/* The end of an input: the backends work again and let their held jobs go, events and time move on, and
 * the pipelines are polled: every transfer not released must then be final (nothing waits for ever). */
static void fz_settle(fz *f)
{
    for (int d = 0; d < 2; d++) {
        f->faulty[d].hold = f->faulty[d].refuse = 0;
        f->faulty[d].fail_bits = 0;
        fz_faulty_release(&f->faulty[d]);
    }
    f->custom_answer = 1;
    if (kvo_event_signal(f->cpu_event) != KVO_OK) fz_fail(f, "event_signal", 0);
    for (int round = 0; round < 64; round++) {
        f->now += 100000;
        for (int d = 0; d < 2; d++)
            if (f->pipe[d] && kvo_pipeline_poll(f->pipe[d]) != KVO_OK) fz_fail(f, "poll", 0);
    }
    for (size_t i = 0; i < FZ_XFERS; i++) {
        fz_xfer *x = &f->xfer[i];
        kvo_transfer_info info;
        if (!x->live || !x->t.id || !f->pipe[x->up]) continue;
        if (kvo_transfer_get_info(f->pipe[x->up], x->t, &info) != KVO_OK) fz_fail(f, "info of a live transfer", 0);
        if (info.status != KVO_STATUS_COMPLETE && info.status != KVO_STATUS_FAILED &&
            info.status != KVO_STATUS_CANCELLED)
            fz_fail(f, "a transfer never ended", (int)info.status);
    }
}

static void fz_run(fz *f)
{
    fz_done_ctx done[2];
    if (!fz_open(f, done)) fz_fail(f, "setup", 0);
    fz_check_pools(f);
    for (f->op = 0; f->at < f->n && f->op < FZ_MAX_OPS; f->op++) {
        switch (fz_u8(f) % 16) {
        case 0: op_alloc(f); break;
        case 1: op_release_or_retain(f, 1); break;
        case 2: op_release_or_retain(f, 0); break;
        case 3: op_lifecycle(f); break;
        case 4: op_register(f, 0); break;
        case 5: op_register(f, 1); break;
        case 6: op_match(f); break;
        case 7: op_weak_upgrade(f); break;
        case 8: op_peek(f); break;
        case 9: case 10: op_seq(f); break;
        case 11: op_pool(f); break;
        case 12: op_enqueue(f, (int)fz_below(f, 2)); break;
        case 13: op_transfer(f); break;
        default: op_pump(f); break;
        }
        fz_check_pools(f);
    }
    fz_settle(f);
    fz_check_pools(f);
    fz_close(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int trace = -1;
    fz *f = (fz *)calloc(1, sizeof *f);
    if (!f) return 0;
    if (trace < 0) trace = getenv("KVFUZZ_TRACE") != NULL;
    f->in = data;
    f->n = size;
    f->trace = trace;
    fz_run(f);
    free(f);
    return 0;
}

#ifdef KVFUZZ_REPLAY
#ifndef KVFUZZ_CORPUS
#define KVFUZZ_CORPUS "tests/fuzz/corpus"
#endif
#include "fuzz_replay.h"
#endif
