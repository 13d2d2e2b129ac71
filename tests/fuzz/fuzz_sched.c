/* fuzz_sched.c — libFuzzer target: the input bytes are an engine driving kvsched.h's scheduler.
 *
 * A small device pool (memory-backed or metadata-only), optionally a host tier under a poll-mode
 * kvo_manager with the inline memcpy backend and a manual clock (so swap, offload and onboarding run),
 * and a kvs_sched on top. The first bytes choose the configuration; then each op is one byte (which
 * call) and the bytes it reads as arguments: add (prompts that often extend an earlier request's
 * tokens, so prefixes are shared), step, complete, append, finish, abort, release, get_slot / stats,
 * a whole engine turn, time and pool resets. Calls are often invalid on purpose: a second step before
 * complete, a second complete, a stale step, unknown, finished and released ids, too many tokens, NULL
 * arguments. After the input, the engine runs the scheduler dry (finishing each request as it decodes).
 *
 * The harness keeps its own model of every request (its tokens, the ends it was told) and checks after
 * every op: both pools pass kvb_pool_check; each slot's tokens, generation count and state (every
 * change along the table of kvsched.h section 2, within what the call may do); the scheduler's counters
 * (steps, prompt tokens, finished, aborted, computed tokens, preemptions exactly; admissions and cache
 * hits per step); the queues against the slot states; a failed call's result is the documented one and
 * changes nothing; every step's items (budgets, tokens, block tables, no block written by two items,
 * the KV bytes of every computed token in place, onboarded and swapped-in ones included). The dry run
 * must end (no step after step without progress), with no device or host block still referenced.
 * The tiers' copies may fail (an op names which): a store that never lands, a load recomputed.
 * Anything else is abort().
 *
 *   make fuzz-sched FUZZ_SECONDS=60    libFuzzer from tests/fuzz/corpus_sched (clang)
 *   make test                          runs build/fuzz/replay_sched over the corpus once (any compiler)
 *   KVFUZZ_TRACE=1 build/fuzz/replay_sched FILE...   prints each op and its result
 */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "fuzz_backend.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { FZ_REQS = 40, FZ_MAX_OPS = 300, FZ_LAYERS = 2, FZ_TOKEN_BYTES = 4, FZ_STALL = 64 };

typedef struct fz_req {
    uint64_t id;
    uint32_t *tokens;    /* prompt then every appended token */
    size_t len, cap, num_prompt;
    uint32_t max_new;    /* 0: until finish */
    int32_t priority;
    int state;           /* last observed */
    int released;
    uint32_t preemptions; /* last observed */
} fz_req;

typedef struct fz_item {
    uint64_t request;
    size_t num_computed, num_new;
    int decode;
} fz_item;

typedef struct fz {
    const uint8_t *in;
    size_t n, at;
    int trace, op;
    const char *opname;
    kvb_pool *dev, *host;
    kvo_backend *mem;
    fz_faulty failing;   /* over mem: what the tiers copy with (only its fail bits are set) */
    kvo_manager *m;
    kvs_sched *s;
    uint32_t bt, device_blocks, max_tokens, max_seqs;
    int memory;
    kvs_preempt_mode preempt;
    uint64_t now;        /* the pipelines' clock, in microseconds */
    fz_req req[FZ_REQS];
    size_t nreq;
    /* the step in progress (in_step) or the last one */
    int in_step;
    kvs_step step;
    fz_item items[FZ_REQS];
    size_t nitems;
    /* the counters as the harness expects them */
    uint64_t steps, prompt_tokens, finished, aborted, computed_tokens, released_preemptions;
    kvs_sched_stats last;
    uint64_t seed;       /* for tokens */
    /* an event bus: its decisions are replayed into a fresh scheduler at the end (without tiers, whose
     * timing replay does not reproduce, and without pool resets, which are not scheduler inputs) */
    kvs_bus *bus;
    kvs_event *events;
    size_t nevents, capevents;
    int events_lost, resets, dry;
    kvb_pool_config dev_cfg;
    kvs_sched_config sched_cfg;
    int hook_stack[8], hook_depth, hook_bad; /* will-call / finished-call pairs */
} fz;

/* ---- reading the input ------------------------------------------------------------------------ */

static uint8_t fz_u8(fz *f) { return f->at < f->n ? f->in[f->at++] : 0; }
static uint32_t fz_below(fz *f, uint32_t k) { return k ? (uint32_t)fz_u8(f) % k : 0; }

static void fz_fail(fz *f, const char *what, int code)
{
    fprintf(stderr, "fuzz_sched: op %d %s (input byte %zu): %s (result %d: %s)\n", f->op, f->opname ? f->opname : "",
            f->at, what, code, kvs_result_string(code));
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

static uint32_t fz_token(uint64_t seed, size_t pos)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull ^ (uint64_t)pos * 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 29;
    return (uint32_t)(x % 5000u);
}

/* Byte j of the (layer, part) slice of the token at position pos: the "model" writes it when a step
 * computes the token; whatever block holds that token later (a prefix hit, a copy from the host) must
 * hold the same bytes. */
static unsigned char fz_kv(uint32_t token, size_t pos, uint32_t layer, uint32_t part, size_t j)
{
    uint64_t x = (uint64_t)token * 0x9e3779b97f4a7c15ull ^ ((uint64_t)pos << 21) ^
                 ((uint64_t)(layer * 2 + part) << 54) ^ (uint64_t)j * 0xd6e8feb86659fd93ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return (unsigned char)x;
}

/* ---- the slot table (kvsched.h section 2, written out from the manual) ------------------------- */

static int fz_legal(int from, int to)
{
    if (from < KVS_SLOT_INITIALIZED || from >= KVS_SLOT__COUNT || to < KVS_SLOT_INITIALIZED || to >= KVS_SLOT__COUNT)
        return 0;
    if (to == KVS_SLOT_FINISHING) return from != KVS_SLOT_FINISHED && from != KVS_SLOT_FINISHING;
    switch (from) {
    case KVS_SLOT_INITIALIZED: return to == KVS_SLOT_ONBOARD_STAGED || to == KVS_SLOT_PREFILLING;
    case KVS_SLOT_ONBOARD_STAGED: return to == KVS_SLOT_ONBOARDING;
    case KVS_SLOT_ONBOARDING: return to == KVS_SLOT_PREFILLING;
    case KVS_SLOT_PREFILLING: return to == KVS_SLOT_DECODING || to == KVS_SLOT_SKIPPED_PREFILL || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_DECODING: return to == KVS_SLOT_PREFILLING || to == KVS_SLOT_SKIPPED_DECODE || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_SKIPPED_PREFILL: return to == KVS_SLOT_PREFILLING || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_SKIPPED_DECODE: return to == KVS_SLOT_DECODING || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_PREEMPTED: return to == KVS_SLOT_INITIALIZED || to == KVS_SLOT_ONBOARDING;
    case KVS_SLOT_FINISHING: return to == KVS_SLOT_FINISHED;
    default: return 0;
    }
}

/* A path of 1..hops legal transitions from -> to through states in `mids` (a bit per state). */
static int fz_path(int from, int to, unsigned mids, int hops)
{
    if (hops <= 0) return 0;
    if (fz_legal(from, to)) return 1;
    for (int m = KVS_SLOT_INITIALIZED; m < KVS_SLOT__COUNT; m++)
        if ((mids >> m & 1u) && m != from && fz_legal(from, m) && fz_path(m, to, mids, hops - 1)) return 1;
    return 0;
}

static int fz_pre_admit(int st)
{
    return st == KVS_SLOT_INITIALIZED || st == KVS_SLOT_PREEMPTED || st == KVS_SLOT_ONBOARD_STAGED || st == KVS_SLOT_ONBOARDING;
}

static int fz_running(int st)
{
    return st == KVS_SLOT_PREFILLING || st == KVS_SLOT_DECODING || st == KVS_SLOT_SKIPPED_PREFILL ||
           st == KVS_SLOT_SKIPPED_DECODE;
}

/* What one call may do to a slot, as read after it: a step plans (admits, onboards, skips, preempts:
 * several transitions, never an end); complete advances a prefill that is done to Decoding; the ends
 * (finish, abort, an append at max_new_tokens) go through Finishing to Finished; nothing else moves. */
enum { FZ_CALL_STEP = 1, FZ_CALL_COMPLETE, FZ_CALL_END, FZ_CALL_OTHER };

static int fz_move_ok(int from, int to, int call)
{
    unsigned plan = 0;
    if (from == to) return 1;
    for (int s = KVS_SLOT_INITIALIZED; s < KVS_SLOT__COUNT; s++)
        if (s != KVS_SLOT_FINISHING && s != KVS_SLOT_FINISHED) plan |= 1u << s;
    switch (call) {
    case FZ_CALL_STEP: return (plan >> to & 1u) && fz_path(from, to, plan, 4);
    case FZ_CALL_COMPLETE: return from == KVS_SLOT_PREFILLING && to == KVS_SLOT_DECODING;
    case FZ_CALL_END: return to == KVS_SLOT_FINISHED && from != KVS_SLOT_FINISHED;
    default: return 0;
    }
}

/* ---- invariants ------------------------------------------------------------------------------- */

static void fz_check_pools(fz *f)
{
    kvb_pool *pools[2] = {f->dev, f->host};
    for (int p = 0; p < 2; p++) {
        char why[256] = "";
        if (!pools[p]) continue;
        if (kvb_pool_check(pools[p], why, sizeof why) != KVB_OK) {
            fprintf(stderr, "fuzz_sched: %s pool check failed: %s\n", p ? "host" : "device", why);
            fz_fail(f, "pool check", 0);
        }
    }
}

static kvb_pool_stats fz_pool_stats(fz *f, kvb_pool *pool)
{
    kvb_pool_stats st;
    memset(&st, 0, sizeof st);
    if (kvb_pool_get_stats(pool, &st) != KVB_OK) fz_fail(f, "kvb_pool_get_stats", 0);
    return st;
}

static kvs_sched_stats fz_stats(fz *f)
{
    kvs_sched_stats st;
    kvs_result r;
    memset(&st, 0, sizeof st);
    if ((r = kvs_sched_get_stats(f->s, &st)) != KVS_OK) fz_fail(f, "get_stats", r);
    return st;
}

static fz_req *fz_find(fz *f, uint64_t id)
{
    for (size_t i = 0; i < f->nreq; i++)
        if (f->req[i].id == id) return &f->req[i];
    return NULL;
}

/* Everything a failed call must leave as it was. */
typedef struct fz_snap {
    kvs_sched_stats stats;
    kvs_slot_info slot[FZ_REQS];
    kvs_result got[FZ_REQS];
    uint32_t free_blocks, active, inactive, hashes;
    int idle, in_step;
} fz_snap;

static void fz_snap_take(fz *f, fz_snap *s)
{
    kvb_pool_stats ps = fz_pool_stats(f, f->dev);
    memset(s, 0, sizeof *s);
    s->stats = fz_stats(f);
    for (size_t i = 0; i < f->nreq; i++) s->got[i] = kvs_sched_get_slot(f->s, f->req[i].id, &s->slot[i]);
    s->free_blocks = ps.free_blocks;
    s->active = ps.active_blocks;
    s->inactive = ps.inactive_blocks;
    s->hashes = ps.cached_hashes;
    s->idle = kvs_sched_idle(f->s);
    s->in_step = f->in_step;
}

static void fz_unchanged(fz *f, const fz_snap *before, const char *call, int result)
{
    fz_snap after;
    fz_snap_take(f, &after);
    if (memcmp(&before->stats, &after.stats, sizeof after.stats) != 0) fz_fail(f, call, result);
    for (size_t i = 0; i < f->nreq; i++)
        if (before->got[i] != after.got[i] || memcmp(&before->slot[i], &after.slot[i], sizeof after.slot[i]) != 0) {
            fprintf(stderr, "fuzz_sched: request %llu changed\n", (unsigned long long)f->req[i].id);
            fz_fail(f, call, result);
        }
    if (before->free_blocks != after.free_blocks || before->active != after.active ||
        before->inactive != after.inactive || before->hashes != after.hashes || before->idle != after.idle)
        fz_fail(f, call, result);
}

/* After every op: each request's slot against the model, the queues against the slots, the counters. */
static void fz_check(fz *f, int call, uint64_t target)
{
    kvs_sched_stats st = fz_stats(f);
    uint64_t preemptions = f->released_preemptions;
    uint32_t live = 0, running = 0;
    fz_check_pools(f);
    if (f->hook_bad || f->hook_depth) fz_fail(f, "hook calls not in will / finished pairs", 0);
    for (size_t i = 0; i < f->nreq; i++) {
        fz_req *q = &f->req[i];
        kvs_slot_info info;
        kvs_result r = kvs_sched_get_slot(f->s, q->id, &info);
        if (q->released) {
            if (r != KVS_ENOTFOUND) fz_fail(f, "get_slot of a released request found it", r);
            continue;
        }
        if (r != KVS_OK) fz_fail(f, "get_slot of a live request", r);
        if (!fz_move_ok(q->state, (int)info.state, call == FZ_CALL_END && q->id != target ? FZ_CALL_OTHER : call)) {
            fprintf(stderr, "fuzz_sched: request %llu: %s -> %s\n", (unsigned long long)q->id,
                    kvs_slot_state_name((kvs_slot_state)q->state), kvs_slot_state_name(info.state));
            fz_fail(f, "a slot change outside the table (or the call)", 0);
        }
        if (!kvs_slot_transition_allowed((kvs_slot_state)q->state, info.state) && fz_legal(q->state, (int)info.state))
            fz_fail(f, "kvs_slot_transition_allowed disagrees with the manual", 0);
        q->state = (int)info.state;
        if (info.num_tokens != q->len) {
            fprintf(stderr, "fuzz_sched: request %llu: %zu tokens, model %zu\n", (unsigned long long)q->id,
                    info.num_tokens, q->len);
            fz_fail(f, "slot tokens differ from prompt + appended", 0);
        }
        if (info.generated != q->len - q->num_prompt) fz_fail(f, "slot generated differs from appended", 0);
        if (info.priority != q->priority) fz_fail(f, "slot priority", 0);
        if (info.num_computed > info.num_tokens) fz_fail(f, "more tokens computed than the request has", 0);
        if (info.num_cached && (info.num_cached >= info.num_tokens || info.num_cached % f->bt))
            fz_fail(f, "cached tokens not whole blocks below the last token", 0);
        if (info.preemptions < q->preemptions) fz_fail(f, "preemptions went down", 0);
        if (info.state == KVS_SLOT_FINISHING) fz_fail(f, "a slot seen in Finishing", 0);
        if (fz_running((int)info.state) && info.num_lower_hit_tokens > info.num_cached)
            fz_fail(f, "lower-tier hits are not part of the cached tokens", 0); /* "cached: device + lower tiers" */
        q->preemptions = info.preemptions;
        preemptions += info.preemptions;
        if (info.state != KVS_SLOT_FINISHED) live++;
        if (fz_running((int)info.state)) running++;
    }
    if (st.waiting + st.running + st.swapped + st.onboarding != live || st.running != running) {
        fprintf(stderr, "fuzz_sched: waiting %u running %u swapped %u onboarding %u; live %u running %u\n", st.waiting,
                st.running, st.swapped, st.onboarding, live, running);
        fz_fail(f, "queues differ from the slots", 0);
    }
    if (kvs_sched_idle(f->s) != (live == 0)) fz_fail(f, "idle differs from the live requests", 0);
    if (st.steps != f->steps || st.prompt_tokens != f->prompt_tokens || st.finished != f->finished ||
        st.aborted != f->aborted || st.computed_tokens != f->computed_tokens) {
        fprintf(stderr, "fuzz_sched: steps %llu/%llu prompt %llu/%llu finished %llu/%llu aborted %llu/%llu computed %llu/%llu\n",
                (unsigned long long)st.steps, (unsigned long long)f->steps, (unsigned long long)st.prompt_tokens,
                (unsigned long long)f->prompt_tokens, (unsigned long long)st.finished, (unsigned long long)f->finished,
                (unsigned long long)st.aborted, (unsigned long long)f->aborted, (unsigned long long)st.computed_tokens,
                (unsigned long long)f->computed_tokens);
        fz_fail(f, "counters differ from the calls made", 0);
    }
    if (st.preempted_recompute + st.preempted_swap != preemptions) fz_fail(f, "preemption counters differ from the slots'", 0);
    if (f->preempt == KVS_PREEMPT_SWAP ? st.preempted_recompute != 0 : st.preempted_swap != 0)
        fz_fail(f, "a preemption of the other mode", 0);
    if (st.admitted < f->last.admitted || st.cached_tokens < f->last.cached_tokens ||
        st.lower_hit_tokens < f->last.lower_hit_tokens)
        fz_fail(f, "a counter went down", 0);
    f->last = st;
}

/* Tokens [0, upto) of request q are in its blocks (KV bytes as the model wrote them). */
static void fz_verify_bytes(fz *f, const fz_req *q, const kvs_sched_item *it, size_t upto)
{
    for (size_t p = 0; f->memory && p < upto; p++) {
        size_t b = p / f->bt, slot = p % f->bt;
        for (uint32_t layer = 0; layer < FZ_LAYERS; layer++)
            for (uint32_t part = 0; part < 2; part++) {
                unsigned char *page = NULL;
                kvb_result r = kvb_block_data(f->dev, it->blocks[b], layer, part, (void **)&page);
                if (r != KVB_OK || !page) fz_fail(f, "block_data of an item's block", r);
                page += slot * FZ_TOKEN_BYTES;
                for (size_t j = 0; j < FZ_TOKEN_BYTES; j++)
                    if (page[j] != fz_kv(q->tokens[p], p, layer, part, j)) {
                        fprintf(stderr, "fuzz_sched: request %llu token %zu (block %zu, computed %zu, new %zu)\n",
                                (unsigned long long)q->id, p, b, it->num_computed, it->num_new);
                        fz_fail(f, "a computed token's KV bytes are not in its block", 0);
                    }
            }
    }
}

/* The model's forward pass: the KV bytes of every token the item computes. */
static void fz_write_bytes(fz *f, const kvs_sched_item *it)
{
    for (size_t p = it->num_computed; f->memory && p < it->num_computed + it->num_new; p++) {
        size_t b = p / f->bt, slot = p % f->bt;
        for (uint32_t layer = 0; layer < FZ_LAYERS; layer++)
            for (uint32_t part = 0; part < 2; part++) {
                unsigned char *page = NULL;
                if (kvb_block_data(f->dev, it->blocks[b], layer, part, (void **)&page) != KVB_OK || !page)
                    fz_fail(f, "block_data of an item's block", 0);
                page += slot * FZ_TOKEN_BYTES;
                for (size_t j = 0; j < FZ_TOKEN_BYTES; j++) page[j] = fz_kv(it->tokens[p], p, layer, part, j);
            }
    }
}

/* ---- setup and teardown ----------------------------------------------------------------------- */

static uint64_t fz_clock(void *user) { return ((fz *)user)->now; }

/* Runs under the bus's lock: only copies. */
static void fz_record(void *user, const kvs_event *e)
{
    fz *f = (fz *)user;
    if (f->nevents == f->capevents) {
        size_t cap = f->capevents ? f->capevents * 2 : 1024;
        kvs_event *more = (kvs_event *)realloc(f->events, cap * sizeof *more);
        if (!more) {
            f->events_lost = 1;
            return;
        }
        f->events = more;
        f->capevents = cap;
    }
    f->events[f->nevents++] = *e;
}

/* Every call the hook sees before it runs, it sees again when it is done (connector calls nest). */
static void fz_hook(void *user, kvs_call call, int finished, uint64_t request, int result)
{
    fz *f = (fz *)user;
    (void)request;
    (void)result;
    if (!finished) {
        if (f->hook_depth < 8) f->hook_stack[f->hook_depth] = (int)call;
        f->hook_depth++;
    } else if (!f->hook_depth || (f->hook_depth <= 8 && f->hook_stack[f->hook_depth - 1] != (int)call)) {
        f->hook_bad = 1;
    } else {
        f->hook_depth--;
    }
}

static kvb_pool *fz_pool(fz *f, uint32_t blocks, int memory, kvb_layout_kind kind, uint32_t tier, uint8_t bits, int events)
{
    static const kvb_evict_policy pols[8] = {KVB_EVICT_LINEAGE, KVB_EVICT_LRU, KVB_EVICT_FOL, KVB_EVICT_ARC,
                                             KVB_EVICT_S3FIFO,  KVB_EVICT_LINEAGE, KVB_EVICT_FOL, KVB_EVICT_LRU};
    kvb_pool_config cfg;
    kvb_pool *pool = NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = blocks;
    cfg.block_tokens = f->bt;
    cfg.eviction = pols[bits & 7u];
    cfg.duplicates = bits & 8u ? KVB_DUP_REJECT : KVB_DUP_ALLOW;
    cfg.priority_levels = bits & 16u ? 2u : 1u;
    cfg.tier = tier;
    if (memory) {
        cfg.storage = KVB_STORAGE_HOST;
        if (kvb_layout_for_model(kind, f->bt, FZ_LAYERS, 1, 2, 2, &cfg.layout) != KVB_OK) fz_fail(f, "layout", 0);
    }
    if (!tier) f->dev_cfg = cfg;
    if (f->bus && events) {
        cfg.on_events = kvs_bus_pool_events;
        cfg.event_user = f->bus;
    }
    if (kvb_pool_create(&cfg, &pool) != KVB_OK) fz_fail(f, "pool_create", 0);
    return pool;
}

/* Config: block tokens 2..16, device blocks 8..64, tiers (host 4..64 blocks, eager or lazy), preemption
 * mode, budgets (the defaults or small ones), pool policies, the host pipelines' batching; an event bus
 * (recording, hooks, the pools' and pipelines' events too), and whether the run ends dry or is
 * destroyed as it stands. */
static void fz_open(fz *f)
{
    uint8_t c0 = fz_u8(f), c1 = fz_u8(f), c2 = fz_u8(f), c3 = fz_u8(f), c4 = fz_u8(f), c5 = fz_u8(f), c6 = fz_u8(f);
    uint8_t c7 = fz_u8(f);
    int tiers = c2 & 1, lazy = tiers && (c2 & 4);
    kvs_sched_config sc;
    kvs_result r;
    f->dry = !(c7 & 2); /* else the scheduler is destroyed as it is: mid-step, requests live */
    if (c7 & 1) {
        if (kvs_bus_create(NULL, &f->bus) != KVS_OK) fz_fail(f, "bus_create", 0);
        if (kvs_bus_subscribe(f->bus, 0, fz_record, f, NULL) != KVS_OK) fz_fail(f, "bus_subscribe", 0);
        if (c7 & 4 && kvs_bus_set_hook(f->bus, fz_hook, f) != KVS_OK) fz_fail(f, "bus_set_hook", 0);
    }
    f->bt = (c7 & 0xc0) == 0xc0 ? 1u : 2u + c0 % 15u; /* one token a block too (a page size engines use) */
    f->device_blocks = 8u + c1 % 57u;
    f->memory = tiers || (c2 & 8);
    f->preempt = tiers && (c2 & 2) ? KVS_PREEMPT_SWAP : KVS_PREEMPT_RECOMPUTE;
    f->now = 1000000;
    f->dev = fz_pool(f, f->device_blocks, f->memory, KVB_LAYOUT_BLOCK_CONTIGUOUS, 0, (uint8_t)(c2 >> 3), c7 & 16);
    if (tiers) {
        kvo_manager_config mc;
        kvo_result mr;
        f->host = fz_pool(f, 4u + c3 % 61u, 1, KVB_LAYOUT_LAYER_SEPARATE, 1, c6, c7 & 32);
        if (kvo_memcpy_backend_create(0, &f->mem) != KVO_OK) fz_fail(f, "memcpy backend", 0);
        fz_faulty_init(&f->failing, f->mem);
        memset(&mc, 0, sizeof mc);
        mc.num_tiers = 2;
        mc.pools[0] = f->dev;
        mc.pools[1] = f->host;
        mc.down[0] = &f->failing.base;
        mc.up[1] = &f->failing.base;
        mc.offload = lazy ? KVO_OFFLOAD_LAZY : KVO_OFFLOAD_EAGER;
        mc.lazy_reserve = (c6 >> 5) & 3u ? ((c6 >> 5) & 7u) * 2u : 0u;
        mc.pipeline.mode = KVO_MODE_POLL;
        mc.pipeline.min_batch = c6 & 0x80 ? 1u + (c5 >> 5) : 1u;
        mc.pipeline.max_batch = (c5 & 0x10) ? 2u : 0u;
        mc.pipeline.clock = fz_clock;
        mc.pipeline.clock_user = f;
        if (f->bus && (c7 & 8)) {
            mc.pipeline.on_stage = kvs_bus_transfer_stage;
            mc.pipeline.stage_user = f->bus;
        }
        if ((mr = kvo_manager_create(&mc, &f->m)) != KVO_OK) fz_fail(f, "manager_create", mr);
    }
    memset(&sc, 0, sizeof sc);
    sc.device = f->dev;
    sc.tiers = f->m;
    sc.max_tokens = c4 & 0x80 ? 1u + (c4 & 0x3f) : 0u;
    sc.max_seqs = c5 & 0x0f;
    sc.preempt = f->preempt;
    sc.offload = lazy ? KVS_OFFLOAD_LAZY : KVS_OFFLOAD_EAGER;
    sc.bus = f->bus;
    f->sched_cfg = sc;
    { /* swap without tiers, a mode out of range: refused */
        kvs_sched_config bad = sc;
        kvs_sched *none = NULL;
        bad.tiers = NULL;
        bad.preempt = KVS_PREEMPT_SWAP;
        if (kvs_sched_create(&bad, &none) != KVS_EINVAL || none) fz_fail(f, "swap without tiers was taken", 0);
        bad = sc;
        bad.preempt = (kvs_preempt_mode)7;
        if (kvs_sched_create(&bad, &none) != KVS_EINVAL || none) fz_fail(f, "an unknown preempt mode was taken", 0);
        if (kvs_sched_create(NULL, &none) != KVS_EINVAL) fz_fail(f, "create(NULL)", 0);
    }
    if ((r = kvs_sched_create(&sc, &f->s)) != KVS_OK) fz_fail(f, "sched_create", r);
    if ((kvs_sched_connector(f->s) != NULL) != tiers) fz_fail(f, "connector without tiers or none with", 0);
    f->max_tokens = sc.max_tokens ? sc.max_tokens : 8192;
    f->max_seqs = sc.max_seqs ? sc.max_seqs : 256;
    for (int a = 0; a <= KVS_SLOT__COUNT; a++) /* the library's table is the manual's */
        for (int b = 0; b <= KVS_SLOT__COUNT; b++)
            if (!(a == KVS_SLOT_FINISHING && b == KVS_SLOT_FINISHING) &&
                !kvs_slot_transition_allowed((kvs_slot_state)a, (kvs_slot_state)b) != !fz_legal(a, b))
                fz_fail(f, "kvs_slot_transition_allowed differs from the manual's table", 0);
    f->last = fz_stats(f);
    FZ_TRACE(f, "config: block_tokens %u device %u memory %d host %u %s %s max_tokens %u max_seqs %u", f->bt,
             f->device_blocks, f->memory, f->host ? fz_pool_stats(f, f->host).num_blocks : 0, lazy ? "lazy" : "eager",
             f->preempt == KVS_PREEMPT_SWAP ? "swap" : "recompute", f->max_tokens, f->max_seqs);
}

/* ---- the step --------------------------------------------------------------------------------- */

static void fz_check_step(fz *f, const fz_snap *before)
{
    const kvs_step *st = &f->step;
    size_t nitems = st->num_prefill + st->num_decode, sum = 0, admitted = 0, admitted_cached = 0, admitted_lower = 0;
    int exact = 1;
    uint64_t written[64 * 16];
    size_t nwritten = 0;
    kvs_sched_stats now;
    if (st->id != f->steps) fz_fail(f, "step id is not the count of steps", 0);
    if ((st->num_prefill && !st->prefill) || (st->num_decode && !st->decode) || (st->num_preempted && !st->preempted))
        fz_fail(f, "step arrays missing", 0);
    if (nitems > f->max_seqs || nitems > FZ_REQS) fz_fail(f, "more items than the sequence budget", 0);
    f->nitems = 0;
    for (size_t i = 0; i < nitems; i++) {
        int decode = i >= st->num_prefill;
        const kvs_sched_item *it = decode ? &st->decode[i - st->num_prefill] : &st->prefill[i];
        fz_req *q = fz_find(f, it->request);
        kvs_slot_info info;
        size_t end = it->num_computed + it->num_new;
        if (!q || q->released) fz_fail(f, "an item of an unknown request", 0);
        if (kvs_sched_get_slot(f->s, q->id, &info) != KVS_OK) fz_fail(f, "get_slot of an item", 0);
        if (info.state != (decode ? KVS_SLOT_DECODING : KVS_SLOT_PREFILLING)) fz_fail(f, "item in the wrong state", 0);
        if (it->num_new < 1 || end > q->len || (decode && end != q->len)) fz_fail(f, "item token range", 0);
        if (it->num_computed != info.num_computed) fz_fail(f, "item computed differs from its slot", 0);
        if (it->num_tokens != q->len || !it->tokens || memcmp(it->tokens, q->tokens, q->len * sizeof *q->tokens) != 0)
            fz_fail(f, "item tokens differ from prompt + appended", 0);
        if ((uint64_t)it->num_blocks * f->bt < end || (it->num_blocks && !it->blocks))
            fz_fail(f, "item block table too short", 0);
        for (size_t k = 0; k < i; k++)
            if (f->items[k].request == it->request) fz_fail(f, "a request twice in one step", 0);
        for (size_t k = 0; k < st->num_preempted; k++)
            if (st->preempted[k] == it->request) fz_fail(f, "a preempted request scheduled", 0);
        for (size_t b = 0; b < (end + f->bt - 1) / f->bt; b++) { /* the blocks the item reads and writes */
            kvb_block_info bi;
            if (kvb_block_get_info(f->dev, it->blocks[b].id, &bi) != KVB_OK || bi.refs == 0)
                fz_fail(f, "an item's block is not a live referenced block", 0);
            if ((b + 1) * f->bt <= it->num_computed && bi.state != KVB_STATE_REGISTERED)
                fz_fail(f, "a full computed block not registered", 0);
            if ((b + 1) * f->bt > it->num_computed) { /* written by this item */
                if (bi.state == KVB_STATE_REGISTERED) fz_fail(f, "an item writes into a registered block", 0);
                for (size_t k = 0; k < nwritten; k++)
                    if (written[k] == it->blocks[b].id) fz_fail(f, "two items write one block", 0);
                if (nwritten < sizeof written / sizeof *written) written[nwritten++] = it->blocks[b].id;
            }
        }
        fz_verify_bytes(f, q, it, it->num_computed);
        sum += it->num_new;
        f->items[f->nitems].request = it->request;
        f->items[f->nitems].num_computed = it->num_computed;
        f->items[f->nitems].num_new = it->num_new;
        f->items[f->nitems].decode = decode;
        f->nitems++;
    }
    if (sum != st->num_tokens || sum > f->max_tokens) fz_fail(f, "step tokens (sum or budget)", 0);
    for (size_t k = 0; k < st->num_preempted; k++) {
        fz_req *q = fz_find(f, st->preempted[k]);
        size_t qi;
        kvs_slot_info info;
        if (!q || q->released) fz_fail(f, "an unknown request preempted", 0);
        qi = (size_t)(q - f->req);
        if (kvs_sched_get_slot(f->s, q->id, &info) != KVS_OK || info.state != KVS_SLOT_PREEMPTED)
            fz_fail(f, "a preempted request not Preempted", 0);
        for (size_t j = 0; j < k; j++)
            if (st->preempted[j] == q->id) fz_fail(f, "a request preempted twice in one step", 0);
        if (info.preemptions != before->slot[qi].preemptions + 1) fz_fail(f, "preemptions not counted once", 0);
        if (fz_pre_admit((int)before->slot[qi].state)) { /* admitted, then preempted, in this step */
            admitted++;
            exact = 0;
        }
    }
    for (size_t i = 0; i < f->nreq; i++) { /* admissions: waiting before, running now */
        kvs_slot_info info;
        int was_preempted = 0;
        if (f->req[i].released || before->got[i] != KVS_OK) continue;
        if (kvs_sched_get_slot(f->s, f->req[i].id, &info) != KVS_OK) fz_fail(f, "get_slot", 0);
        for (size_t k = 0; k < st->num_preempted; k++) was_preempted |= st->preempted[k] == f->req[i].id;
        if (!was_preempted && info.preemptions != before->slot[i].preemptions)
            fz_fail(f, "preemptions counted for a request the step does not list", 0);
        if (fz_pre_admit((int)before->slot[i].state) && fz_running((int)info.state)) {
            admitted++;
            admitted_cached += info.num_cached;
            admitted_lower += info.num_lower_hit_tokens;
        }
    }
    now = fz_stats(f);
    if (now.admitted - before->stats.admitted != admitted) {
        fprintf(stderr, "fuzz_sched: admitted +%llu, seen %zu\n", (unsigned long long)(now.admitted - before->stats.admitted),
                admitted);
        fz_fail(f, "admissions differ from the slots that started", 0);
    }
    if (exact ? now.cached_tokens - before->stats.cached_tokens != admitted_cached
              : now.cached_tokens - before->stats.cached_tokens < admitted_cached)
        fz_fail(f, "cached tokens differ from the admitted slots'", 0);
    if (exact ? now.lower_hit_tokens - before->stats.lower_hit_tokens != admitted_lower
              : now.lower_hit_tokens - before->stats.lower_hit_tokens < admitted_lower)
        fz_fail(f, "lower-tier hits differ from the admitted slots'", 0);
    for (size_t i = 0; i < st->meta.num_loads; i++) {
        const kvs_load *l = &st->meta.loads[i];
        fz_req *q = fz_find(f, l->request);
        if (!q || l->tier != 1 || l->num_blocks < 1 || (uint64_t)(l->first_block + l->num_blocks) * f->bt > q->len)
            fz_fail(f, "a load outside its request", 0);
    }
    for (size_t i = 0; i < nitems; i++) fz_write_bytes(f, i < st->num_prefill ? &st->prefill[i] : &st->decode[i - st->num_prefill]);
}

static kvs_result fz_step(fz *f)
{
    fz_snap before;
    kvs_step st;
    kvs_result r;
    fz_snap_take(f, &before);
    memset(&st, 0, sizeof st);
    r = kvs_sched_step(f->s, &st);
    if (f->in_step) { /* a second step before complete */
        if (r != KVS_ESTEP) fz_fail(f, "step before complete did not fail with KVS_ESTEP", r);
        fz_unchanged(f, &before, "a refused step changed something", r);
        FZ_TRACE(f, "step (in step) -> %s", kvs_result_string(r));
        return r;
    }
    if (r != KVS_OK) fz_fail(f, "step", r);
    f->steps++;
    f->in_step = 1;
    f->step = st;
    fz_check_step(f, &before);
    FZ_TRACE(f, "step %llu -> prefill %zu decode %zu tokens %zu preempted %zu loads %zu stores %zu",
             (unsigned long long)st.id, st.num_prefill, st.num_decode, st.num_tokens, st.num_preempted,
             st.meta.num_loads, st.meta.num_stores);
    fz_check(f, FZ_CALL_STEP, 0);
    return r;
}

static kvs_result fz_complete(fz *f, int how)
{
    fz_snap before;
    kvs_step st = f->step;
    kvs_result r, want = KVS_OK;
    uint64_t computed = 0;
    if (how == 1) st.id += 1u + fz_below(f, 3); /* a step that is not the one in progress */
    else if (how == 2) st.id -= 1;
    if (!f->in_step || how) want = KVS_ESTEP;
    fz_snap_take(f, &before);
    r = how == 3 ? kvs_sched_complete(f->s, NULL) : kvs_sched_complete(f->s, &st);
    if (how == 3) want = KVS_EINVAL;
    FZ_TRACE(f, "complete%s (step %llu) -> %s", how ? " (wrong)" : "", (unsigned long long)st.id, kvs_result_string(r));
    if (r != want) fz_fail(f, "complete's result", r);
    if (r != KVS_OK) {
        fz_unchanged(f, &before, "a refused complete changed something", r);
        return r;
    }
    for (size_t i = 0; i < f->nitems; i++) { /* items of requests that ended meanwhile are not counted */
        fz_req *q = fz_find(f, f->items[i].request);
        if (q && q->state != KVS_SLOT_FINISHED) computed += f->items[i].num_new;
    }
    f->computed_tokens += computed;
    f->in_step = 0;
    fz_check(f, FZ_CALL_COMPLETE, 0);
    for (size_t i = 0; i < f->nitems; i++) { /* what the items computed is now computed */
        fz_req *q = fz_find(f, f->items[i].request);
        kvs_slot_info info;
        if (!q || q->released || q->state == KVS_SLOT_FINISHED) continue;
        if (kvs_sched_get_slot(f->s, q->id, &info) != KVS_OK) fz_fail(f, "get_slot", 0);
        if (info.num_computed != f->items[i].num_computed + f->items[i].num_new)
            fz_fail(f, "complete did not commit an item's tokens", 0);
        if (info.state != (info.num_computed == info.num_tokens ? KVS_SLOT_DECODING : KVS_SLOT_PREFILLING))
            fz_fail(f, "state after complete", 0);
    }
    return r;
}

/* ---- request calls ---------------------------------------------------------------------------- */

static int fz_reserve(fz_req *q, size_t need)
{
    if (need <= q->cap) return 1;
    {
        size_t cap = need * 2;
        uint32_t *t = (uint32_t *)realloc(q->tokens, cap * sizeof *t);
        if (!t) return 0;
        q->tokens = t;
        q->cap = cap;
    }
    return 1;
}

/* The expected result of an append of n tokens, from the slot as it is. */
static kvs_result fz_append_expect(fz *f, fz_req *q, size_t n, int *ends, int *either)
{
    kvs_slot_info info;
    *ends = *either = 0;
    if (!q || q->released || kvs_sched_get_slot(f->s, q->id, &info) != KVS_OK) return KVS_ENOTFOUND;
    if (info.state != KVS_SLOT_DECODING && info.state != KVS_SLOT_SKIPPED_DECODE) return KVS_ESTATE;
    if (info.num_tokens > info.num_computed) return KVS_ESTATE;
    if (!n) return KVS_OK;
    {
        int big = (q->len + n + f->bt - 1) / f->bt > f->device_blocks;
        int past = q->max_new && q->len + n > q->num_prompt + q->max_new;
        if (big && past) *either = 1; /* too many tokens both ways: the manual names no order */
        if (big) return KVS_ETOOBIG;
        if (past) return KVS_EINVAL;
        *ends = q->max_new && q->len + n == q->num_prompt + q->max_new;
        if (n > f->max_tokens && !*ends) return KVS_ETOOBIG; /* more than a step computes: never scheduled */
    }
    return KVS_OK;
}

static kvs_result fz_append(fz *f, uint64_t id, size_t n, int null_tokens)
{
    uint32_t tokens[64];
    fz_req *q = fz_find(f, id);
    fz_snap before;
    int ends = 0, either = 0;
    kvs_result want, r;
    if (n > 64) n = 64;
    for (size_t i = 0; i < n; i++) tokens[i] = fz_token(f->seed + id, (q ? q->len : 0) + i);
    f->seed++;
    want = null_tokens && n ? KVS_EINVAL : fz_append_expect(f, q, n, &ends, &either);
    fz_snap_take(f, &before);
    r = kvs_sched_append(f->s, id, null_tokens ? NULL : tokens, n);
    FZ_TRACE(f, "append %llu n %zu%s -> %s (want %s)", (unsigned long long)id, n, null_tokens ? " NULL" : "",
             kvs_result_string(r), kvs_result_string(want));
    if (r != want && !(either && (r == KVS_EINVAL || r == KVS_ETOOBIG))) fz_fail(f, "append's result", r);
    if (r != KVS_OK) {
        fz_unchanged(f, &before, "a refused append changed something", r);
        return r;
    }
    if (n) {
        if (!fz_reserve(q, q->len + n)) abort();
        memcpy(q->tokens + q->len, tokens, n * sizeof *tokens);
        q->len += n;
    }
    if (ends) f->finished++;
    fz_check(f, ends ? FZ_CALL_END : FZ_CALL_OTHER, id);
    if (ends != (q->state == KVS_SLOT_FINISHED)) fz_fail(f, "an append at max_new_tokens did not finish (or one before)", 0);
    return r;
}

static kvs_result fz_end(fz *f, uint64_t id, int abort_it)
{
    fz_req *q = fz_find(f, id);
    fz_snap before;
    kvs_result want = !q || q->released ? KVS_ENOTFOUND : q->state == KVS_SLOT_FINISHED ? KVS_ESTATE : KVS_OK, r;
    fz_snap_take(f, &before);
    r = abort_it ? kvs_sched_abort(f->s, id) : kvs_sched_finish(f->s, id);
    FZ_TRACE(f, "%s %llu -> %s", abort_it ? "abort" : "finish", (unsigned long long)id, kvs_result_string(r));
    if (r != want) fz_fail(f, abort_it ? "abort's result" : "finish's result", r);
    if (r != KVS_OK) {
        fz_unchanged(f, &before, "a refused finish / abort changed something", r);
        return r;
    }
    if (abort_it) f->aborted++;
    else f->finished++;
    fz_check(f, FZ_CALL_END, id);
    if (q->state != KVS_SLOT_FINISHED) fz_fail(f, "an ended request is not Finished", 0);
    return r;
}

static void fz_release(fz *f, uint64_t id)
{
    fz_req *q = fz_find(f, id);
    fz_snap before;
    kvs_result want = !q || q->released ? KVS_ENOTFOUND : q->state != KVS_SLOT_FINISHED ? KVS_ESTATE : KVS_OK, r;
    fz_snap_take(f, &before);
    r = kvs_sched_release(f->s, id);
    FZ_TRACE(f, "release %llu -> %s", (unsigned long long)id, kvs_result_string(r));
    if (r != want) fz_fail(f, "release's result", r);
    if (r != KVS_OK) {
        fz_unchanged(f, &before, "a refused release changed something", r);
        return;
    }
    q->released = 1;
    f->released_preemptions += q->preemptions;
    fz_check(f, FZ_CALL_OTHER, 0);
}

/* A request id: mostly a tracked one (live or not), sometimes one never given out. */
static uint64_t fz_pick_id(fz *f)
{
    uint8_t b = fz_u8(f);
    if (b >= 0xf0) {
        static const uint64_t odd[4] = {0, UINT64_MAX, 1u << 20, 12345};
        return odd[b & 3];
    }
    if (!f->nreq) return 1 + (b & 3u);
    return f->req[b % f->nreq].id;
}

/* The id of one of the last step's items, or any. */
static uint64_t fz_pick_item_id(fz *f)
{
    uint8_t b = fz_u8(f);
    if (f->nitems && !(b & 0x80)) return f->items[b % f->nitems].request;
    return fz_pick_id(f);
}

/* ---- the ops ---------------------------------------------------------------------------------- */

static void op_add(fz *f)
{
    uint8_t mode = fz_u8(f), lenb = fz_u8(f), seed = fz_u8(f), mnt = fz_u8(f), misc = fz_u8(f);
    size_t prefix = 0, ext, np;
    const fz_req *from = NULL;
    uint32_t *prompt;
    uint64_t extra[KVB_MAX_EXTRA_KEYS + 1] = {7, 8, 9};
    kvs_request rq;
    kvs_result want = KVS_OK, r;
    uint64_t id = 0;
    fz_snap before;
    if ((mode & 3) && f->nreq) { /* extend what an earlier request holds (its generated tokens too) */
        uint8_t pb = fz_u8(f);
        from = &f->req[fz_u8(f) % f->nreq];
        if ((mode & 3) == 3) prefix = from->num_prompt; /* the same prompt again */
        else if (pb & 1) prefix = (size_t)(pb >> 1) % (from->len / f->bt + 1) * f->bt;
        else prefix = (size_t)(pb >> 1) % (from->len + 1);
    }
    ext = lenb & 0x80 ? (size_t)(lenb & 0x7f) * 8u : (size_t)(lenb % 24u);
    if ((mode & 3) == 3 && !(lenb & 0x40)) ext = 0;
    np = prefix + ext;
    prompt = (uint32_t *)malloc((np ? np : 1) * sizeof *prompt);
    if (!prompt) abort();
    if (prefix) memcpy(prompt, from->tokens, prefix * sizeof *prompt);
    for (size_t i = prefix; i < np; i++) prompt[i] = fz_token(seed + 1000u * (mode >> 2), i);
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = np;
    rq.max_new_tokens = mnt < 96 ? 0u : mnt < 250 ? 1u + (mnt & 15u) : 1000000u;
    rq.priority = (int32_t)(misc & 7u) < 5 ? 0 : (int32_t)(misc & 7u) - 6; /* 0 mostly, -1, 1 */
    rq.salt = misc >> 3 & 1u;
    rq.extra = extra;
    rq.num_extra = misc >> 4 & 1u ? 1u : 0u;
    if ((misc >> 5) == 7) { /* invalid on purpose */
        switch (seed & 3) {
        case 0: rq.num_extra = KVB_MAX_EXTRA_KEYS + 1; break;
        case 1: rq.prompt = NULL; rq.num_prompt = np ? np : 1; break;
        case 2: rq.extra = NULL; rq.num_extra = 1; break;
        default: rq.num_prompt = 0; break;
        }
    }
    if (!rq.prompt || !rq.num_prompt || rq.num_extra > KVB_MAX_EXTRA_KEYS || (rq.num_extra && !rq.extra))
        want = KVS_EINVAL;
    else if ((rq.num_prompt + rq.max_new_tokens + f->bt - 1) / f->bt > f->device_blocks)
        want = KVS_ETOOBIG;
    else if (f->nreq == FZ_REQS)
        want = KVS_EINVAL, rq.num_prompt = 0; /* tracked requests are full: an invalid add instead */
    fz_snap_take(f, &before);
    r = kvs_sched_add(f->s, &rq, &id);
    FZ_TRACE(f, "add prompt %zu (prefix %zu of %llu) max_new %u prio %d salt %llu extra %zu -> %s id %llu", rq.num_prompt,
             prefix, from ? (unsigned long long)from->id : 0ull, rq.max_new_tokens, rq.priority,
             (unsigned long long)rq.salt, rq.num_extra, kvs_result_string(r), (unsigned long long)id);
    if (r != want) fz_fail(f, "add's result", r);
    if (r != KVS_OK) {
        free(prompt);
        fz_unchanged(f, &before, "a refused add changed something", r);
        return;
    }
    if (fz_find(f, id) || (f->nreq && id <= f->req[f->nreq - 1].id)) fz_fail(f, "add gave an id again", 0);
    {
        fz_req *q = &f->req[f->nreq++];
        memset(q, 0, sizeof *q);
        q->id = id;
        q->tokens = prompt;
        q->len = q->cap = q->num_prompt = np;
        q->max_new = rq.max_new_tokens;
        q->priority = rq.priority;
        q->state = KVS_SLOT_INITIALIZED;
    }
    f->prompt_tokens += np;
    fz_check(f, FZ_CALL_OTHER, 0);
}

static void op_append(fz *f)
{
    uint64_t id = fz_pick_item_id(f);
    uint8_t b = fz_u8(f);
    size_t n = b & 0x40 ? (size_t)(b & 0x3f) : (size_t)(b & 3u);
    fz_append(f, id, n, b == 0xff);
}

/* Invalid arguments of every call: the documented KVS_EINVAL, nothing changed. Also get_slot and idle. */
static void op_misc(fz *f)
{
    uint8_t what = fz_u8(f);
    fz_snap before;
    kvs_slot_info info;
    kvs_sched_stats st;
    uint64_t id = fz_pick_id(f);
    uint32_t tok = 1;
    kvs_request rq;
    fz_snap_take(f, &before);
    memset(&rq, 0, sizeof rq);
    rq.prompt = &tok;
    rq.num_prompt = 1;
    switch (what % 10) {
    case 0: {
        fz_req *q = fz_find(f, id);
        kvs_result r = kvs_sched_get_slot(f->s, id, &info);
        if (r != (!q || q->released ? KVS_ENOTFOUND : KVS_OK)) fz_fail(f, "get_slot's result", r);
        break;
    }
    case 1: if (kvs_sched_get_slot(f->s, id, NULL) != KVS_EINVAL) fz_fail(f, "get_slot(NULL)", 0); break;
    case 2: if (kvs_sched_get_stats(f->s, NULL) != KVS_EINVAL || kvs_sched_get_stats(NULL, &st) != KVS_EINVAL) fz_fail(f, "get_stats(NULL)", 0); break;
    case 3: if (kvs_sched_step(f->s, NULL) != KVS_EINVAL || kvs_sched_step(NULL, &f->step) != KVS_EINVAL) fz_fail(f, "step(NULL)", 0); break;
    case 4: if (kvs_sched_add(f->s, NULL, &id) != KVS_EINVAL || kvs_sched_add(f->s, &rq, NULL) != KVS_EINVAL) fz_fail(f, "add(NULL)", 0); break;
    case 5: if (kvs_sched_add(NULL, &rq, &id) != KVS_EINVAL || kvs_sched_complete(NULL, &f->step) != KVS_EINVAL) fz_fail(f, "NULL sched", 0); break;
    case 6:
        if (kvs_sched_append(NULL, id, &tok, 1) != KVS_EINVAL || kvs_sched_finish(NULL, id) != KVS_EINVAL ||
            kvs_sched_abort(NULL, id) != KVS_EINVAL || kvs_sched_release(NULL, id) != KVS_EINVAL ||
            kvs_sched_get_slot(NULL, id, &info) != KVS_EINVAL || !kvs_sched_idle(NULL) || kvs_sched_connector(NULL))
            fz_fail(f, "NULL sched", 0);
        break;
    case 7: if (kvs_sched_complete(f->s, NULL) != KVS_EINVAL) fz_fail(f, "complete(NULL)", 0); break;
    default: (void)kvs_sched_idle(f->s); break;
    }
    FZ_TRACE(f, "misc %d id %llu", what % 10, (unsigned long long)id);
    fz_unchanged(f, &before, "a refused call (or a read) changed something", 0);
}

/* Time passes for the pipelines; the tiers are pumped, drained, or a pool is reset (refused while a
 * block is referenced). */
static void op_time(fz *f)
{
    uint8_t b = fz_u8(f);
    f->now += (uint64_t)(b >> 2) * 1000u;
    if ((b & 3) == 0 && b >= 0xf0) f->failing.fail_bits = fz_u8(f); /* the tiers' copies fail from now on */
    if (f->m && (b & 3) == 1) (void)kvo_manager_poll(f->m);
    if (f->m && (b & 3) == 2 && kvo_manager_drain(f->m, 5000000) != KVO_OK) fz_fail(f, "manager drain", 0);
    if ((b & 3) == 3) {
        kvb_pool *pool = b & 4 && f->host ? f->host : f->dev;
        kvb_pool_stats ps = fz_pool_stats(f, pool);
        kvb_result r = kvb_pool_reset(pool);
        if ((r == KVB_OK) != (ps.active_blocks == 0)) fz_fail(f, "pool reset", r);
        f->resets += pool == f->dev && r == KVB_OK;
    }
    FZ_TRACE(f, "time +%u ms, %d", b >> 2, b & 3);
    fz_check(f, FZ_CALL_OTHER, 0);
}

/* The engine's sampler after a complete: a token for the items (those `mode` picks) whose request now
 * decodes with all of its tokens computed; one that would outgrow the device is finished instead. */
static void fz_sample(fz *f, uint8_t mode)
{
    for (size_t i = 0; i < f->nitems; i++) {
        fz_req *q = fz_find(f, f->items[i].request);
        kvs_slot_info info;
        if (!q || q->released || q->state == KVS_SLOT_FINISHED) continue;
        if (kvs_sched_get_slot(f->s, q->id, &info) != KVS_OK) fz_fail(f, "get_slot", 0);
        if (info.state != KVS_SLOT_DECODING || info.num_computed != info.num_tokens) continue;
        if ((mode & 1) && fz_append(f, q->id, 1, 0) == KVS_ETOOBIG) fz_end(f, q->id, 0);
        mode = (uint8_t)(mode >> 1 | mode << 7);
    }
}

/* One engine turn: (complete,) step, complete, sample. */
static void op_turn(fz *f)
{
    uint8_t mode = fz_u8(f);
    if (f->in_step) fz_complete(f, 0);
    fz_step(f);
    fz_complete(f, 0);
    fz_sample(f, (uint8_t)(mode | 0x55));
}

/* What a stall looks like: the live slots, the queues, the pools. */
static void fz_dump(fz *f)
{
    kvs_sched_stats st = fz_stats(f);
    kvb_pool_stats d = fz_pool_stats(f, f->dev);
    fprintf(stderr, "fuzz_sched: waiting %u running %u swapped %u onboarding %u; device free %u active %u inactive %u",
            st.waiting, st.running, st.swapped, st.onboarding, d.free_blocks, d.active_blocks, d.inactive_blocks);
    if (f->host) {
        kvb_pool_stats h = fz_pool_stats(f, f->host);
        fprintf(stderr, "; host free %u active %u inactive %u; connector pending %zu", h.free_blocks, h.active_blocks,
                h.inactive_blocks, kvs_connector_pending(kvs_sched_connector(f->s)));
    }
    fputc('\n', stderr);
    for (size_t i = 0; i < f->nreq; i++) {
        kvs_slot_info info;
        if (f->req[i].released || kvs_sched_get_slot(f->s, f->req[i].id, &info) != KVS_OK ||
            info.state == KVS_SLOT_FINISHED)
            continue;
        fprintf(stderr, "  request %llu: %s tokens %zu computed %zu cached %zu lower %zu priority %d preemptions %u\n",
                (unsigned long long)f->req[i].id, kvs_slot_state_name(info.state), info.num_tokens, info.num_computed,
                info.num_cached, info.num_lower_hit_tokens, info.priority, info.preemptions);
    }
}

/* After the input: every request runs to its end (finished as soon as it decodes: the sampler visits
 * every request, not only the last step's); the scheduler must get there without stalling, within a
 * bound (each request, once first in line, needs its tokens over the budget plus a few steps), and give
 * every block back. */
static void fz_dry_run(fz *f)
{
    int stall = 0;
    uint64_t bound = 256;
    f->opname = "dry run";
    if (f->in_step) fz_complete(f, 0);
    for (size_t i = 0; i < f->nreq; i++)
        if (!f->req[i].released && f->req[i].state != KVS_SLOT_FINISHED) bound += f->req[i].len / f->max_tokens + 16;
    for (uint64_t turn = 0; !kvs_sched_idle(f->s); turn++) {
        kvs_sched_stats before = fz_stats(f);
        int moved;
        if (turn == bound) {
            fz_dump(f);
            fz_fail(f, "the dry run did not end", 0);
        }
        f->op++;
        f->now += 20000;
        fz_step(f);
        moved = f->step.num_prefill || f->step.num_decode || f->step.num_preempted;
        fz_complete(f, 0);
        for (size_t i = 0; i < f->nreq; i++) {
            fz_req *q = &f->req[i];
            kvs_slot_info info;
            if (q->released || q->state == KVS_SLOT_FINISHED) continue;
            if (kvs_sched_get_slot(f->s, q->id, &info) != KVS_OK) fz_fail(f, "get_slot", 0);
            if (info.state != KVS_SLOT_DECODING || info.num_computed != info.num_tokens) continue;
            if (fz_append(f, q->id, 1, 0) == KVS_OK && q->state != KVS_SLOT_FINISHED) fz_end(f, q->id, 0);
            else if (q->state != KVS_SLOT_FINISHED) fz_end(f, q->id, 0);
        }
        {
            kvs_sched_stats after = fz_stats(f);
            moved |= after.admitted != before.admitted || after.onboarding != before.onboarding ||
                     after.finished != before.finished;
        }
        stall = moved ? 0 : stall + 1;
        if (stall >= FZ_STALL) {
            fz_dump(f);
            fz_fail(f, "the scheduler stalls: steps plan nothing while requests wait", 0);
        }
    }
    if (f->m && kvo_manager_drain(f->m, 5000000) != KVO_OK) fz_fail(f, "manager drain", 0);
    fz_step(f); /* the connector hears of the last transfers */
    fz_complete(f, 0);
    if (f->m && kvo_manager_drain(f->m, 5000000) != KVO_OK) fz_fail(f, "manager drain", 0);
    if (fz_pool_stats(f, f->dev).active_blocks) fz_fail(f, "device blocks still referenced with every request ended", 0);
    if (f->host && fz_pool_stats(f, f->host).active_blocks)
        fz_fail(f, "host blocks still referenced with every request ended", 0);
    for (size_t i = 0; i < f->nreq; i++)
        if (!f->req[i].released) fz_release(f, f->req[i].id);
}

/* The recorded run fed into a fresh scheduler (metadata-only pool, same configuration) makes the same
 * decisions. */
static void fz_replay_check(fz *f)
{
    kvs_bus *bus = NULL;
    kvb_pool *pool = NULL;
    kvs_sched *fresh = NULL;
    kvb_pool_config pc = f->dev_cfg;
    kvs_sched_config sc = f->sched_cfg;
    kvs_replay_report rep;
    kvs_result r;
    if (!f->bus || f->m || f->resets || f->events_lost) return;
    pc.storage = KVB_STORAGE_NONE;
    memset(&pc.layout, 0, sizeof pc.layout);
    if (kvs_bus_create(NULL, &bus) != KVS_OK || kvb_pool_create(&pc, &pool) != KVB_OK) fz_fail(f, "replay setup", 0);
    sc.device = pool;
    sc.bus = bus;
    if ((r = kvs_sched_create(&sc, &fresh)) != KVS_OK) fz_fail(f, "replay setup", r);
    memset(&rep, 0, sizeof rep);
    r = kvs_replay(fresh, bus, f->events, f->nevents, 0, &rep);
    FZ_TRACE(f, "replay of %zu events: %s (%llu inputs, %llu decisions)", f->nevents, kvs_result_string(r),
             (unsigned long long)rep.inputs, (unsigned long long)rep.compared);
    if (r != KVS_OK) {
        char want[512] = "", got[512] = "";
        kvs_event_to_json(&rep.expected, want, sizeof want, NULL);
        kvs_event_to_json(&rep.got, got, sizeof got, NULL);
        fprintf(stderr, "fuzz_sched: replay differs at seq %llu:\n  recorded %s\n  replayed %s\n",
                (unsigned long long)rep.mismatch_seq, want, got);
        fz_fail(f, "a replay of the recorded run decides otherwise", r);
    }
    kvs_sched_destroy(fresh);
    kvb_pool_destroy(pool);
    kvs_bus_destroy(bus);
}

static void fz_close(fz *f)
{
    fz_replay_check(f);
    kvs_sched_destroy(f->s);
    f->s = NULL;
    if (f->m) {
        if (kvo_manager_drain(f->m, 5000000) != KVO_OK) fz_fail(f, "manager drain", 0);
        kvo_manager_destroy(f->m);
    }
    fz_check_pools(f);
    if (fz_pool_stats(f, f->dev).active_blocks) fz_fail(f, "device blocks referenced after destroy", 0);
    if (f->host && fz_pool_stats(f, f->host).active_blocks) fz_fail(f, "host blocks referenced after destroy", 0);
    kvo_backend_destroy(f->mem);
    kvb_pool_destroy(f->host);
    kvb_pool_destroy(f->dev);
    kvs_bus_destroy(f->bus);
    free(f->events);
    for (size_t i = 0; i < f->nreq; i++) free(f->req[i].tokens);
}

static void fz_run(fz *f)
{
    fz_open(f);
    fz_check(f, FZ_CALL_OTHER, 0);
    for (f->op = 0; f->at < f->n && f->op < FZ_MAX_OPS; f->op++) {
        uint8_t op = fz_u8(f);
        switch (op % 16) {
        case 0: case 1: f->opname = "add"; op_add(f); break;
        case 2: f->opname = "step"; fz_step(f); break;
        case 3: case 4: f->opname = "complete"; fz_complete(f, op >= 0xc0 ? 1 + (op >> 4 & 3) % 3 : 0); break;
        case 5: case 6: f->opname = "append"; op_append(f); break;
        case 7: f->opname = "finish"; fz_end(f, fz_pick_item_id(f), 0); break;
        case 8: f->opname = "abort"; fz_end(f, fz_pick_item_id(f), 1); break;
        case 9: f->opname = "release"; fz_release(f, fz_pick_id(f)); break;
        case 10: f->opname = "misc"; op_misc(f); break;
        case 11: f->opname = "time"; op_time(f); break;
        default: f->opname = "turn"; op_turn(f); break;
        }
    }
    if (f->dry) fz_dry_run(f);
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
#define KVFUZZ_CORPUS "tests/fuzz/corpus_sched"
#endif
#include "fuzz_replay.h"
#endif
