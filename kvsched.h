/* kvsched.h — driving kvcache from an engine's step loop: request slots, the connector between the
 * device pool and the lower tiers, and a continuous-batching scheduler (part of kvcache)
 *
 * Do this in exactly one C or C++ file:    #define KVSCHED_IMPLEMENTATION
 *                                           #include "kvsched.h"
 * (it includes kvoffload.h and kvblock.h; define their implementation macros there too, or
 * KVCACHE_IMPLEMENTATION for all). Needs C11, POSIX threads, stb_ds.h, -pthread.
 *
 * Manual: 1. Quick start  2. Slots  3. Scheduler  4. Connector  5. Sizing  6. Thread safety  7. Errors
 *
 * 1. QUICK START — one engine step
 *
 *     kvs_sched_config sc = { .device = device_pool, .tiers = manager };   // tiers optional
 *     kvs_sched *s;  kvs_sched_create(&sc, &s);
 *     kvs_request rq = { .prompt = tokens, .num_prompt = n, .max_new_tokens = 64 };
 *     uint64_t id;   kvs_sched_add(s, &rq, &id);
 *     for (;;) {
 *         kvs_step step;  kvs_sched_step(s, &step);          // prefill + decode groups, block tables
 *         if (!step.num_prefill && !step.num_decode && kvs_sched_idle(s)) break;
 *         ... run the model on step.prefill[] and step.decode[] ...
 *         kvs_sched_complete(s, &step);                       // the forward pass is done
 *         for each item that produced a token: kvs_sched_append(s, item.request, &token, 1);
 *     }
 *
 * 2. SLOTS — every request has one; every transition is checked, an illegal one is KVS_ESTATE and
 * changes nothing:
 *     Initialized -> OnboardStaged -> Onboarding -> Prefilling <-> Decoding -> Finishing -> Finished
 *     Initialized -> Prefilling                      (no lower-tier hit)
 *     Prefilling -> SkippedPrefill -> Prefilling     (not scheduled this step: budget)
 *     Decoding -> SkippedDecode -> Decoding
 *     Prefilling | Decoding | Skipped* -> Preempted -> Initialized (recompute) | Onboarding (swap in)
 *     any state but Finished -> Finishing            (finish or abort)
 * kvs_slot_transition_allowed(from, to) is the table. A slot keeps its pending transfers until the
 * connector reports them finished; an abort cancels them.
 *
 * 3. SCHEDULER (continuous batching) — queues: waiting (priority, higher first, then arrival), running,
 * swapped. Each step, within the budgets (default 8192 tokens, 256 sequences): running decodes (one
 * token each) first, then running prefills (chunked when the prompt exceeds what is left), then swapped
 * requests (swap in), then waiting ones. Admission matches the device prefix cache first, then asks the
 * connector for lower-tier hits: those blocks are onboarded (asynchronously) before the request
 * prefills. When blocks run out, the victim is the running request of lowest priority, latest
 * arrival: KVS_PREEMPT_RECOMPUTE frees its blocks and requeues it; KVS_PREEMPT_SWAP offloads its blocks
 * to G2 first and onboards them back when it resumes. A waiting request may preempt running ones of
 * strictly lower priority. The engine reports sampled tokens with kvs_sched_append; a request ends at
 * max_new_tokens or with kvs_sched_finish.
 *
 * 4. CONNECTOR (the shape of vLLM's KV connectors) — between the device pool and the tiers of a
 * kvo_manager. Scheduler side: get_num_new_matched_tokens (lower-tier hits after the device prefix),
 * update_state_after_alloc (how many of them the scheduler takes), build_meta (this step's loads and
 * stores, each with an event id), update_output (what the worker finished), request_finished. Worker
 * side: bind_meta, start_loads (before the forward pass), start_stores (after it), get_finished.
 * Loads onboard into the device pool (allocating and registering the device blocks there), so the
 * request's own match then finds them. Stores: eager mode offers every newly registered device block;
 * lazy mode stores nothing until blocks near eviction, then keeps `lazy_reserve` eviction candidates
 * backed by G2 (kvo_manager_poll). Offloads hold only weak handles, so a finished request never has to
 * keep its blocks alive for a store (request_finished says 0). kvs_sched drives both sides itself; an
 * engine with its own scheduler and worker threads calls them directly.
 *
 * 5. SIZING — kvs_blocks_for_bytes turns a byte budget (like the seed's cpu_bytes_to_use_per_rank)
 * into a block count for a layout; kvs_model_preset gives model layouts. KVS_MODEL_LLAMA3_8B is the
 * seed's: 16-token blocks, 32 layers, 32 KV heads x head dim 128, fp16: pages of 128 KiB (one layer,
 * K or V), 8 MiB per block.
 *
 * 6. THREAD SAFETY — a kvs_sched is used by one thread at a time (the engine's scheduler thread);
 * a kvs_connector's scheduler side and worker side may run on two threads (each side's calls from one
 * thread), its own lock orders them.
 *
 * 7. ERRORS — kvs_result: KVS_OK or negative; kvb_ and kvo_ codes pass through; kvs_result_string
 * names all. A failed call changes nothing.
 */
#ifndef KVSCHED_H
#define KVSCHED_H
#define KVSCHED_VERSION_MAJOR 0
#define KVSCHED_VERSION_MINOR 1
#define KVSCHED_VERSION_PATCH 0

#include "kvoffload.h"

#ifndef KVS_API
#ifdef KVS_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define KVS_API static __attribute__((unused))
#else
#define KVS_API static
#endif
#else
#define KVS_API extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define KVS__RESULTS(X)                                                       \
    X(KVS_OK,        0,    "ok")                                              \
    X(KVS_EINVAL,   -201,  "invalid argument")                                \
    X(KVS_ESTATE,   -202,  "slot transition not allowed")                     \
    X(KVS_ENOTFOUND,-203,  "no such request")                                 \
    X(KVS_ETOOBIG,  -204,  "request can never fit the device pool")           \
    X(KVS_ENOMEM,   -205,  "out of memory")                                   \
    X(KVS_ESTEP,    -206,  "step does not match the one in progress")

#define KVS__ENUM_ITEM(name, value, text) name = value,
typedef enum kvs_result { KVS__RESULTS(KVS__ENUM_ITEM) KVS__RESULT_MIN = -207 } kvs_result;
#undef KVS__ENUM_ITEM

/* Name of a kvs_, kvo_ or kvb_ result. Thread safety: pure function. */
KVS_API const char *kvs_result_string(int result);

/* ---- slots -------------------------------------------------------------------------------------- */

typedef enum kvs_slot_state {
    KVS_SLOT_INITIALIZED = 1,
    KVS_SLOT_ONBOARD_STAGED,
    KVS_SLOT_ONBOARDING,
    KVS_SLOT_PREFILLING,
    KVS_SLOT_DECODING,
    KVS_SLOT_SKIPPED_PREFILL,
    KVS_SLOT_SKIPPED_DECODE,
    KVS_SLOT_PREEMPTED,
    KVS_SLOT_FINISHING,
    KVS_SLOT_FINISHED,
    KVS_SLOT__COUNT
} kvs_slot_state;

/* 1 when from -> to is in the table of section 2. Thread safety: pure function. */
KVS_API int kvs_slot_transition_allowed(kvs_slot_state from, kvs_slot_state to);
/* "Initialized", "OnboardStaged", ... Thread safety: pure function. */
KVS_API const char *kvs_slot_state_name(kvs_slot_state state);

/* ---- sizing ------------------------------------------------------------------------------------- */

typedef enum kvs_model { KVS_MODEL_LLAMA3_8B = 1, KVS_MODEL_TINY } kvs_model;

/* A model's cache layout: block tokens, layers, KV heads, head dim, dtype bytes (TINY: 16, 2, 4, 16,
 * 4 — the float32 model of examples/tiny_llm.c). KVS_EINVAL for an unknown model. */
KVS_API kvs_result kvs_model_preset(kvs_model model, kvb_layout_kind kind, uint32_t *out_block_tokens,
                                    kvb_layout *out_layout);
/* How many blocks of this layout fit in `bytes` (rounded down; 0 when not even one). */
KVS_API uint32_t kvs_blocks_for_bytes(const kvb_layout *layout, uint64_t bytes);

/* ---- connector ---------------------------------------------------------------------------------- */

typedef struct kvs_load {
    uint64_t request;
    uint64_t event;        /* id reported back by get_finished */
    uint32_t tier;         /* where the blocks are */
    uint32_t first_block;  /* index in the request's block hashes */
    uint32_t num_blocks;
} kvs_load;

typedef struct kvs_store {
    uint64_t request;
    uint64_t event;
    kvb_block block;       /* device block (the connector keeps no reference: offloads hold weak ones) */
} kvs_store;

/* One step's transfer metadata: built on the scheduler side, bound on the worker side. */
typedef struct kvs_connector_meta {
    uint64_t step;
    const kvs_load *loads;
    size_t num_loads;
    const kvs_store *stores;
    size_t num_stores;
} kvs_connector_meta;

/* What the worker finished since the last call. */
typedef struct kvs_worker_output {
    const uint64_t *finished_loads;   /* request ids whose loads are all done */
    size_t num_finished_loads;
    const uint64_t *finished_stores;  /* store event ids done (landed, skipped or failed) */
    size_t num_finished_stores;
} kvs_worker_output;

typedef enum kvs_offload_mode { KVS_OFFLOAD_EAGER = 0, KVS_OFFLOAD_LAZY } kvs_offload_mode;

typedef struct kvs_connector_config {
    kvb_pool *device;             /* required: G1 */
    kvo_manager *tiers;           /* required: its G1 must be `device` */
    kvs_offload_mode offload;
} kvs_connector_config;

typedef struct kvs_connector kvs_connector;

/* The connector installs itself as the manager's on_offloaded hook (kvo_manager_set_offloaded).
 * Thread safety: any thread. */
KVS_API kvs_result kvs_connector_create(const kvs_connector_config *config, kvs_connector **out);
KVS_API void kvs_connector_destroy(kvs_connector *connector);

/* Scheduler side. Tokens the lower tiers hold right after the first num_computed tokens (whole blocks
 * of `hashes`, the request's full-block hashes); *out_async = 1 when they must be loaded first. */
KVS_API kvs_result kvs_connector_get_num_new_matched_tokens(kvs_connector *c, uint64_t request,
                                                            const kvb_hash *hashes, size_t num_hashes,
                                                            size_t num_computed, size_t *out_tokens,
                                                            int *out_async);
/* The scheduler takes num_external_tokens of them (0 drops the plan). */
KVS_API kvs_result kvs_connector_update_state_after_alloc(kvs_connector *c, uint64_t request,
                                                          size_t num_external_tokens);
/* Device blocks of `request` newly registered by this step (eager stores). */
KVS_API kvs_result kvs_connector_note_registered(kvs_connector *c, uint64_t request, const kvb_block *blocks,
                                                 size_t n);
/* This step's loads and stores (valid until the next build_meta). */
KVS_API kvs_result kvs_connector_build_meta(kvs_connector *c, kvs_connector_meta *out);
/* Account what the worker finished (clears the request's pending loads and stores). */
KVS_API kvs_result kvs_connector_update_output(kvs_connector *c, const kvs_worker_output *output);
/* Whether the request's blocks must stay alive after it ends (always 0 here: offloads hold weak
 * handles) — and forget the request, cancelling its unstarted loads. */
KVS_API kvs_result kvs_connector_request_finished(kvs_connector *c, uint64_t request, int *out_keep_blocks);

/* Worker side. */
KVS_API kvs_result kvs_connector_bind_meta(kvs_connector *c, const kvs_connector_meta *meta);
KVS_API kvs_result kvs_connector_start_loads(kvs_connector *c);
KVS_API kvs_result kvs_connector_start_stores(kvs_connector *c);
/* Finished loads and stores since the last call (valid until the next call). Polls the tiers. */
KVS_API kvs_result kvs_connector_get_finished(kvs_connector *c, kvs_worker_output *out);
/* Pending loads + stores not reported finished yet. */
KVS_API size_t kvs_connector_pending(kvs_connector *c);
/* The scheduler matched the loaded blocks of `request` into its sequence: the connector drops the
 * references it kept on them since the loads finished. */
KVS_API kvs_result kvs_connector_release_loads(kvs_connector *c, uint64_t request);

/* ---- scheduler ---------------------------------------------------------------------------------- */

typedef enum kvs_preempt_mode { KVS_PREEMPT_RECOMPUTE = 0, KVS_PREEMPT_SWAP } kvs_preempt_mode;

typedef struct kvs_sched_config {
    kvb_pool *device;             /* required */
    kvo_manager *tiers;           /* optional; its G1 must be `device` (the connector takes its hook) */
    uint32_t max_tokens;          /* per step, default 8192 */
    uint32_t max_seqs;            /* per step, default 256 */
    kvs_preempt_mode preempt;     /* swap needs tiers */
    kvs_offload_mode offload;
} kvs_sched_config;

typedef struct kvs_request {
    const uint32_t *prompt;
    size_t num_prompt;            /* >= 1 */
    uint32_t max_new_tokens;      /* 0 = until kvs_sched_finish */
    int32_t priority;             /* higher is scheduled first and preempted last */
    uint64_t salt;                /* tenant */
    const uint64_t *extra;        /* extra hash keys (LoRA id, image hash), at most KVB_MAX_EXTRA_KEYS */
    size_t num_extra;
} kvs_request;

/* One request's part of a step. The pointers stay valid until the next kvs_sched_ call that changes
 * this request (step, append, finish, abort). */
typedef struct kvs_sched_item {
    uint64_t request;
    const kvb_block *blocks;      /* its block table */
    size_t num_blocks;
    size_t num_computed;          /* tokens already in the cache */
    size_t num_new;               /* tokens to compute now: [num_computed, num_computed + num_new) */
    const uint32_t *tokens;       /* all of its tokens */
    size_t num_tokens;            /* when num_computed + num_new reaches it, the item yields a token */
} kvs_sched_item;

typedef struct kvs_step {
    uint64_t id;
    kvs_sched_item *prefill;
    size_t num_prefill;
    kvs_sched_item *decode;
    size_t num_decode;
    size_t num_tokens;            /* sum of num_new */
    const uint64_t *preempted;    /* requests preempted in this step */
    size_t num_preempted;
    kvs_connector_meta meta;
} kvs_step;

typedef struct kvs_slot_info {
    kvs_slot_state state;
    int32_t priority;
    size_t num_tokens, num_computed, num_cached;   /* cached: device + lower tiers */
    size_t num_lower_hit_tokens;                    /* of which from lower tiers */
    uint32_t generated;
    uint32_t preemptions;
    size_t pending_transfers;
} kvs_slot_info;

typedef struct kvs_sched_stats {
    uint64_t steps, admitted, finished, aborted, preempted_recompute, preempted_swap;
    uint64_t prompt_tokens, cached_tokens, lower_hit_tokens, computed_tokens;
    uint32_t waiting, running, swapped, onboarding;
} kvs_sched_stats;

typedef struct kvs_sched kvs_sched;

/* KVS_EINVAL: no device pool, or swap without tiers. Thread safety: any thread. */
KVS_API kvs_result kvs_sched_create(const kvs_sched_config *config, kvs_sched **out);
/* Aborts every request, frees everything. */
KVS_API void kvs_sched_destroy(kvs_sched *sched);
/* Queue a request (slot Initialized). KVS_ETOOBIG when prompt + max_new_tokens can never fit. */
KVS_API kvs_result kvs_sched_add(kvs_sched *sched, const kvs_request *request, uint64_t *out_id);
/* Plan the next step. The arrays in *out are valid until the next call. KVS_ESTEP when the previous
 * step was not completed. */
KVS_API kvs_result kvs_sched_step(kvs_sched *sched, kvs_step *out);
/* The forward pass of `step` is done: computed tokens are committed (full blocks registered and, in
 * eager mode, offered to the lower tiers), slots advance. */
KVS_API kvs_result kvs_sched_complete(kvs_sched *sched, const kvs_step *step);
/* Tokens the engine sampled for a decoding request (appended to its sequence at the next step). A
 * request that reaches max_new_tokens finishes. */
KVS_API kvs_result kvs_sched_append(kvs_sched *sched, uint64_t request, const uint32_t *tokens, size_t n);
/* End a request normally (e.g. end of sequence): Finishing -> Finished, blocks released (they stay
 * cached). */
KVS_API kvs_result kvs_sched_finish(kvs_sched *sched, uint64_t request);
/* End a request in any state: cancels its transfers, releases its blocks. */
KVS_API kvs_result kvs_sched_abort(kvs_sched *sched, uint64_t request);
/* Forget a Finished request (its slot info stays readable until then). */
KVS_API kvs_result kvs_sched_release(kvs_sched *sched, uint64_t request);
KVS_API kvs_result kvs_sched_get_slot(kvs_sched *sched, uint64_t request, kvs_slot_info *out);
KVS_API kvs_result kvs_sched_get_stats(kvs_sched *sched, kvs_sched_stats *out);
/* 1 when nothing is waiting, running, swapped or onboarding. */
KVS_API int kvs_sched_idle(kvs_sched *sched);
/* The scheduler's connector (NULL without tiers). */
KVS_API kvs_connector *kvs_sched_connector(kvs_sched *sched);

#ifdef __cplusplus
}
#endif
#endif /* KVSCHED_H */

/* ================================================================================================ */
/*                                        IMPLEMENTATION                                            */
/* ================================================================================================ */
#if defined(KVSCHED_IMPLEMENTATION) || defined(KVCACHE_IMPLEMENTATION)
#ifndef KVSCHED_IMPL_INCLUDED
#define KVSCHED_IMPL_INCLUDED
#ifndef KVOFFLOAD_IMPL_INCLUDED
#error "kvsched.h: define KVBLOCK_IMPLEMENTATION and KVOFFLOAD_IMPLEMENTATION in this file too (or KVCACHE_IMPLEMENTATION)"
#endif

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && !defined(__cplusplus) && defined(__STRICT_ANSI__) && \
    !defined(typeof)
#define typeof __typeof__
#define KVS__DEFINED_TYPEOF
#endif

KVS_API const char *kvs_result_string(int result)
{
    switch (result) {
#define KVS__STRING_CASE(name, value, text) case value: return text;
        KVS__RESULTS(KVS__STRING_CASE)
#undef KVS__STRING_CASE
    default: return kvo_result_string(result);
    }
}

/* ---- slots -------------------------------------------------------------------------------------- */

static const unsigned char kvs__edges[][2] = {
    {KVS_SLOT_INITIALIZED, KVS_SLOT_ONBOARD_STAGED}, {KVS_SLOT_INITIALIZED, KVS_SLOT_PREFILLING},
    {KVS_SLOT_ONBOARD_STAGED, KVS_SLOT_ONBOARDING},  {KVS_SLOT_ONBOARDING, KVS_SLOT_PREFILLING},
    {KVS_SLOT_PREFILLING, KVS_SLOT_DECODING},
    {KVS_SLOT_PREFILLING, KVS_SLOT_SKIPPED_PREFILL}, {KVS_SLOT_PREFILLING, KVS_SLOT_PREEMPTED},
    {KVS_SLOT_SKIPPED_PREFILL, KVS_SLOT_PREFILLING}, {KVS_SLOT_SKIPPED_PREFILL, KVS_SLOT_PREEMPTED},
    {KVS_SLOT_DECODING, KVS_SLOT_PREFILLING},        {KVS_SLOT_DECODING, KVS_SLOT_SKIPPED_DECODE},
    {KVS_SLOT_DECODING, KVS_SLOT_PREEMPTED},         {KVS_SLOT_SKIPPED_DECODE, KVS_SLOT_DECODING},
    {KVS_SLOT_SKIPPED_DECODE, KVS_SLOT_PREEMPTED},   {KVS_SLOT_PREEMPTED, KVS_SLOT_INITIALIZED},
    {KVS_SLOT_PREEMPTED, KVS_SLOT_ONBOARDING},       {KVS_SLOT_FINISHING, KVS_SLOT_FINISHED}};

KVS_API int kvs_slot_transition_allowed(kvs_slot_state from, kvs_slot_state to)
{
    size_t i;
    if (from < KVS_SLOT_INITIALIZED || from >= KVS_SLOT__COUNT || to < KVS_SLOT_INITIALIZED || to >= KVS_SLOT__COUNT)
        return 0;
    if (to == KVS_SLOT_FINISHING) return from != KVS_SLOT_FINISHING && from != KVS_SLOT_FINISHED;
    for (i = 0; i < sizeof kvs__edges / sizeof kvs__edges[0]; i++)
        if (kvs__edges[i][0] == from && kvs__edges[i][1] == to) return 1;
    return 0;
}

KVS_API const char *kvs_slot_state_name(kvs_slot_state state)
{
    static const char *names[] = {"?", "Initialized", "OnboardStaged", "Onboarding", "Prefilling", "Decoding",
                                  "SkippedPrefill", "SkippedDecode", "Preempted", "Finishing", "Finished"};
    return (unsigned)state < KVS_SLOT__COUNT ? names[state] : "?";
}

/* ---- sizing ------------------------------------------------------------------------------------- */

KVS_API kvs_result kvs_model_preset(kvs_model model, kvb_layout_kind kind, uint32_t *out_block_tokens,
                                    kvb_layout *out_layout)
{
    if (!out_block_tokens || !out_layout) return KVS_EINVAL;
    *out_block_tokens = 16;
    if (model == KVS_MODEL_LLAMA3_8B) return (kvs_result)kvb_layout_for_model(kind, 16, 32, 32, 128, 2, out_layout);
    if (model == KVS_MODEL_TINY) return (kvs_result)kvb_layout_for_model(kind, 16, 2, 4, 16, 4, out_layout);
    return KVS_EINVAL;
}

KVS_API uint32_t kvs_blocks_for_bytes(const kvb_layout *layout, uint64_t bytes)
{
    uint64_t block, n;
    if (!layout || !layout->page_bytes) return 0;
    block = layout->page_bytes * (layout->num_layers ? layout->num_layers : 1) * (layout->num_parts ? layout->num_parts : 2);
    n = bytes / block;
    return n > INT32_MAX ? (uint32_t)INT32_MAX : (uint32_t)n;
}

/* ---- connector ---------------------------------------------------------------------------------- */

typedef struct kvs__plan {    /* one request's lower-tier blocks, from the scheduler side */
    uint64_t request;
    kvb_hash *hashes;          /* stb_ds: the request's full-block hashes */
    kvs_load *runs;            /* stb_ds: planned runs (one tier each) */
    int accepted;              /* update_state_after_alloc said how many */
    kvb_block *loaded;         /* stb_ds: device references kept after the loads */
    uint32_t loads_active;
} kvs__plan;

typedef struct kvs__active_load { kvs_load load; kvo_transfer t; } kvs__active_load;
typedef struct kvs__id_entry { uint64_t key; int value; } kvs__id_entry;
typedef struct kvs__active_store { uint64_t event, request; kvo_transfer t; int done; } kvs__active_store;

struct kvs_connector {
    kvs_connector_config cfg;
    pthread_mutex_t lock;
    uint32_t block_tokens;
    uint64_t next_event, step;
    kvs__plan *plans;          /* stb_ds */
    kvs_store *noted;          /* stores waiting for build_meta */
    kvs_load *meta_loads;      /* the last built meta */
    kvs_store *meta_stores;
    kvs_load *bound_loads;     /* the worker's copy */
    kvs_store *bound_stores;
    kvs__active_load *loads;
    kvs__active_store *stores;
    kvs__id_entry *offloaded;  /* transfer ids reported by the manager (stb_ds set) */
    uint64_t *fin_loads, *fin_stores;
};

static kvs__plan *kvs__plan_of(kvs_connector *c, uint64_t request)
{
    size_t i;
    for (i = 0; i < stbds_arrlenu(c->plans); i++)
        if (c->plans[i].request == request) return &c->plans[i];
    return NULL;
}

static void kvs__plan_drop(kvs_connector *c, kvs__plan *p)
{
    size_t at = (size_t)(p - c->plans);
    if (stbds_arrlen(p->loaded)) kvb_release(c->cfg.device, p->loaded, stbds_arrlenu(p->loaded), NULL);
    stbds_arrfree(p->loaded);
    stbds_arrfree(p->hashes);
    stbds_arrfree(p->runs);
    stbds_arrdelswap(c->plans, at);
}

static void kvs__on_offloaded(void *user, uint32_t tier, kvo_transfer t, const kvo_transfer_info *info)
{
    kvs_connector *c = (kvs_connector *)user;
    (void)info;
    if (tier != 0) return;
    pthread_mutex_lock(&c->lock);
    stbds_hmput(c->offloaded, t.id, 1);
    pthread_mutex_unlock(&c->lock);
}

/* The manager's G1 is `device`: its first offload pipeline starts there (or its onboards end there). */
static int kvs__is_g1(kvo_manager *m, kvb_pool *device)
{
    kvo_pipeline_config pc;
    uint32_t t;
    if (kvo_pipeline_get_config(kvo_manager_pipeline(m, 0, 0), &pc) == KVO_OK) return pc.src == device;
    for (t = 1; t < KVO_MAX_TIERS; t++)
        if (kvo_pipeline_get_config(kvo_manager_pipeline(m, t, 1), &pc) == KVO_OK) return pc.dst == device;
    return 0;
}

KVS_API kvs_result kvs_connector_create(const kvs_connector_config *config, kvs_connector **out)
{
    kvs_connector *c;
    kvb_pool_config pc;
    if (!config || !out || !config->device || !config->tiers || (unsigned)config->offload > KVS_OFFLOAD_LAZY ||
        !kvs__is_g1(config->tiers, config->device))
        return KVS_EINVAL;
    c = (kvs_connector *)KVB_MALLOC(sizeof *c);
    if (!c) return KVS_ENOMEM;
    memset(c, 0, sizeof *c);
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        KVB_FREE(c);
        return KVS_ENOMEM;
    }
    c->cfg = *config;
    memset(&pc, 0, sizeof pc);
    kvb_pool_get_config(config->device, &pc);
    c->block_tokens = pc.block_tokens;
    c->next_event = 1;
    kvo_manager_set_offloaded(config->tiers, kvs__on_offloaded, c);
    *out = c;
    return KVS_OK;
}

KVS_API void kvs_connector_destroy(kvs_connector *c)
{
    size_t i;
    if (!c) return;
    kvo_manager_set_offloaded(c->cfg.tiers, NULL, NULL);
    for (i = 0; i < stbds_arrlenu(c->loads); i++) {
        kvo_pipeline *up = kvo_manager_pipeline(c->cfg.tiers, c->loads[i].load.tier, 1);
        kvo_transfer_release(up, c->loads[i].t);
    }
    while (stbds_arrlen(c->plans)) kvs__plan_drop(c, &c->plans[0]);
    stbds_arrfree(c->plans);
    stbds_arrfree(c->noted);
    stbds_arrfree(c->meta_loads);
    stbds_arrfree(c->meta_stores);
    stbds_arrfree(c->bound_loads);
    stbds_arrfree(c->bound_stores);
    stbds_arrfree(c->loads);
    stbds_arrfree(c->stores);
    stbds_hmfree(c->offloaded);
    stbds_arrfree(c->fin_loads);
    stbds_arrfree(c->fin_stores);
    pthread_mutex_destroy(&c->lock);
    KVB_FREE(c);
}

KVS_API kvs_result kvs_connector_get_num_new_matched_tokens(kvs_connector *c, uint64_t request,
                                                            const kvb_hash *hashes, size_t num_hashes,
                                                            size_t num_computed, size_t *out_tokens,
                                                            int *out_async)
{
    uint8_t *tier_of;
    size_t found = 0, first, i;
    kvs__plan *p, fresh;
    if (!c || !out_tokens || !out_async || (num_hashes && !hashes)) return KVS_EINVAL;
    *out_tokens = 0;
    *out_async = 0;
    first = num_computed / c->block_tokens;
    if (first >= num_hashes) return KVS_OK;
    tier_of = (uint8_t *)KVB_MALLOC(num_hashes);
    if (!tier_of) return KVS_ENOMEM;
    kvo_manager_lookup(c->cfg.tiers, hashes, num_hashes, tier_of, &found);
    pthread_mutex_lock(&c->lock);
    if ((p = kvs__plan_of(c, request)) != NULL) kvs__plan_drop(c, p); /* a new question replaces the plan */
    if (found > first) {
        memset(&fresh, 0, sizeof fresh);
        fresh.request = request;
        memcpy(stbds_arraddnptr(fresh.hashes, num_hashes), hashes, num_hashes * sizeof *hashes);
        for (i = first; i < found; i++) { /* runs of blocks held by one lower tier */
            kvs_load *last = stbds_arrlen(fresh.runs) ? &stbds_arrlast(fresh.runs) : NULL;
            if (tier_of[i] == 0) continue; /* on the device already */
            if (last && last->tier == tier_of[i] && last->first_block + last->num_blocks == i) {
                last->num_blocks++;
            } else {
                kvs_load l;
                memset(&l, 0, sizeof l);
                l.request = request;
                l.tier = tier_of[i];
                l.first_block = (uint32_t)i;
                l.num_blocks = 1;
                stbds_arrput(fresh.runs, l);
            }
        }
        stbds_arrput(c->plans, fresh);
        *out_tokens = (found - first) * c->block_tokens;
        *out_async = stbds_arrlen(fresh.runs) > 0;
    }
    pthread_mutex_unlock(&c->lock);
    KVB_FREE(tier_of);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_update_state_after_alloc(kvs_connector *c, uint64_t request,
                                                          size_t num_external_tokens)
{
    kvs__plan *p;
    kvs_result r = KVS_OK;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    p = kvs__plan_of(c, request);
    if (!p) {
        r = num_external_tokens ? KVS_ENOTFOUND : KVS_OK;
    } else if (!num_external_tokens) {
        kvs__plan_drop(c, p);
    } else {
        size_t keep_end = (size_t)(stbds_arrlen(p->runs) ? p->runs[0].first_block : 0) +
                          num_external_tokens / c->block_tokens, i, w = 0;
        for (i = 0; i < stbds_arrlenu(p->runs); i++) { /* keep what lies before the accepted end */
            kvs_load *l = &p->runs[i];
            if (l->first_block >= keep_end) continue;
            if (l->first_block + l->num_blocks > keep_end) l->num_blocks = (uint32_t)(keep_end - l->first_block);
            p->runs[w++] = *l;
        }
        KVB__ARR_SHRINK(p->runs, w);
        p->accepted = 1;
    }
    pthread_mutex_unlock(&c->lock);
    return r;
}

KVS_API kvs_result kvs_connector_note_registered(kvs_connector *c, uint64_t request, const kvb_block *blocks,
                                                 size_t n)
{
    size_t i;
    uint64_t event;
    if (!c || (n && !blocks)) return KVS_EINVAL;
    if (!n || c->cfg.offload != KVS_OFFLOAD_EAGER) return KVS_OK;
    pthread_mutex_lock(&c->lock);
    event = c->next_event++;
    for (i = 0; i < n; i++) {
        kvs_store s;
        s.request = request;
        s.event = event;
        s.block = blocks[i];
        stbds_arrput(c->noted, s);
    }
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_build_meta(kvs_connector *c, kvs_connector_meta *out)
{
    size_t i, j;
    if (!c || !out) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    KVB__ARR_SHRINK(c->meta_loads, 0);
    KVB__ARR_SHRINK(c->meta_stores, 0);
    for (i = 0; i < stbds_arrlenu(c->plans); i++) {
        kvs__plan *p = &c->plans[i];
        if (!p->accepted) continue;
        for (j = 0; j < stbds_arrlenu(p->runs); j++) {
            p->runs[j].event = c->next_event++;
            stbds_arrput(c->meta_loads, p->runs[j]);
        }
        p->loads_active += (uint32_t)stbds_arrlen(p->runs);
        KVB__ARR_SHRINK(p->runs, 0);
        p->accepted = 0;
    }
    for (i = 0; i < stbds_arrlenu(c->noted); i++) stbds_arrput(c->meta_stores, c->noted[i]);
    KVB__ARR_SHRINK(c->noted, 0);
    out->step = ++c->step;
    out->loads = c->meta_loads;
    out->num_loads = stbds_arrlenu(c->meta_loads);
    out->stores = c->meta_stores;
    out->num_stores = stbds_arrlenu(c->meta_stores);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_bind_meta(kvs_connector *c, const kvs_connector_meta *meta)
{
    if (!c || !meta || (meta->num_loads && !meta->loads) || (meta->num_stores && !meta->stores)) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    KVB__ARR_SHRINK(c->bound_loads, 0);
    KVB__ARR_SHRINK(c->bound_stores, 0);
    if (meta->num_loads) memcpy(stbds_arraddnptr(c->bound_loads, meta->num_loads), meta->loads, meta->num_loads * sizeof *meta->loads);
    if (meta->num_stores) memcpy(stbds_arraddnptr(c->bound_stores, meta->num_stores), meta->stores, meta->num_stores * sizeof *meta->stores);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_start_loads(kvs_connector *c)
{
    size_t i;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < stbds_arrlenu(c->bound_loads); i++) {
        kvs_load *l = &c->bound_loads[i];
        kvs__plan *p = kvs__plan_of(c, l->request);
        kvs__active_load a;
        a.load = *l;
        a.t.id = 0;
        if (!p || kvo_manager_onboard(c->cfg.tiers, l->tier, p->hashes + l->first_block, l->num_blocks, &a.t) != KVO_OK)
            a.t.id = 0; /* reported finished at once: the request computes those tokens instead */
        stbds_arrput(c->loads, a);
    }
    KVB__ARR_SHRINK(c->bound_loads, 0);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_start_stores(kvs_connector *c)
{
    size_t i = 0, j;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    while (i < stbds_arrlenu(c->bound_stores)) { /* one offer per event */
        kvb_block *blocks = NULL;
        kvs__active_store a;
        for (j = i; j < stbds_arrlenu(c->bound_stores) && c->bound_stores[j].event == c->bound_stores[i].event; j++)
            stbds_arrput(blocks, c->bound_stores[j].block);
        a.event = c->bound_stores[i].event;
        a.request = c->bound_stores[i].request;
        a.done = 0;
        a.t.id = 0;
        pthread_mutex_unlock(&c->lock); /* the hook takes the lock when a transfer finishes inline */
        kvo_manager_offer(c->cfg.tiers, 0, blocks, stbds_arrlenu(blocks), &a.t);
        pthread_mutex_lock(&c->lock);
        a.done = a.t.id == 0;
        stbds_arrput(c->stores, a);
        stbds_arrfree(blocks);
        i = j;
    }
    KVB__ARR_SHRINK(c->bound_stores, 0);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

/* A load is over when its transfer is final: its device blocks are kept for the request. Locked. */
static int kvs__load_over(kvs_connector *c, kvs__active_load *a)
{
    kvo_pipeline *up = kvo_manager_pipeline(c->cfg.tiers, a->load.tier, 1);
    kvo_transfer_info info;
    kvs__plan *p = kvs__plan_of(c, a->load.request);
    if (a->t.id) {
        kvb_block *got;
        size_t n = 0;
        if (kvo_transfer_get_info(up, a->t, &info) != KVO_OK) info.status = KVO_STATUS_FAILED;
        if (info.status < KVO_STATUS_COMPLETE) return 0;
        got = (kvb_block *)KVB_MALLOC((info.blocks ? info.blocks : 1) * sizeof *got);
        if (got && info.status == KVO_STATUS_COMPLETE && kvo_transfer_take_blocks(up, a->t, got, info.blocks, &n) == KVO_OK) {
            if (p) memcpy(stbds_arraddnptr(p->loaded, n), got, n * sizeof *got);
            else if (n) kvb_release(c->cfg.device, got, n, NULL);
        }
        KVB_FREE(got);
        kvo_transfer_release(up, a->t); /* untaken blocks are released with it */
    }
    if (p && p->loads_active && --p->loads_active == 0) stbds_arrput(c->fin_loads, p->request);
    return 1;
}

static int kvs__offloaded(kvs_connector *c, uint64_t id)
{
    if (stbds_hmgeti(c->offloaded, id) < 0) return 0;
    (void)stbds_hmdel(c->offloaded, id);
    return 1;
}

KVS_API kvs_result kvs_connector_get_finished(kvs_connector *c, kvs_worker_output *out)
{
    size_t i, w;
    if (!c || !out) return KVS_EINVAL;
    kvo_manager_poll(c->cfg.tiers);
    pthread_mutex_lock(&c->lock);
    KVB__ARR_SHRINK(c->fin_loads, 0);
    KVB__ARR_SHRINK(c->fin_stores, 0);
    for (i = w = 0; i < stbds_arrlenu(c->loads); i++)
        if (!kvs__load_over(c, &c->loads[i])) c->loads[w++] = c->loads[i];
    KVB__ARR_SHRINK(c->loads, w);
    for (i = w = 0; i < stbds_arrlenu(c->stores); i++) {
        kvs__active_store *s = &c->stores[i];
        if (s->done || kvs__offloaded(c, s->t.id)) stbds_arrput(c->fin_stores, s->event);
        else c->stores[w++] = *s;
    }
    KVB__ARR_SHRINK(c->stores, w);
    if (!w) stbds_hmfree(c->offloaded); /* ids of offloads that were not stores (lazy, swap) */
    out->finished_loads = c->fin_loads;
    out->num_finished_loads = stbds_arrlenu(c->fin_loads);
    out->finished_stores = c->fin_stores;
    out->num_finished_stores = stbds_arrlenu(c->fin_stores);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_update_output(kvs_connector *c, const kvs_worker_output *output)
{
    /* Loads keep their blocks in the plan until kvs_connector_release_loads / request_finished, and the
     * worker's lists were already cleared: in one process there is nothing left to carry over. */
    if (!c || !output) return KVS_EINVAL;
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_release_loads(kvs_connector *c, uint64_t request)
{
    kvs__plan *p;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    p = kvs__plan_of(c, request);
    if (p && !p->loads_active && !p->accepted) kvs__plan_drop(c, p);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_connector_request_finished(kvs_connector *c, uint64_t request, int *out_keep_blocks)
{
    size_t i, w;
    kvs__plan *p;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    for (i = w = 0; i < stbds_arrlenu(c->loads); i++) { /* cancel its loads */
        kvs__active_load *a = &c->loads[i];
        if (a->load.request != request) {
            c->loads[w++] = *a;
            continue;
        }
        if (a->t.id) kvo_transfer_release(kvo_manager_pipeline(c->cfg.tiers, a->load.tier, 1), a->t);
    }
    KVB__ARR_SHRINK(c->loads, w);
    for (i = w = 0; i < stbds_arrlenu(c->bound_loads); i++)
        if (c->bound_loads[i].request != request) c->bound_loads[w++] = c->bound_loads[i];
    KVB__ARR_SHRINK(c->bound_loads, w);
    if ((p = kvs__plan_of(c, request)) != NULL) kvs__plan_drop(c, p);
    pthread_mutex_unlock(&c->lock);
    if (out_keep_blocks) *out_keep_blocks = 0;
    return KVS_OK;
}

KVS_API size_t kvs_connector_pending(kvs_connector *c)
{
    size_t n, i;
    if (!c) return 0;
    pthread_mutex_lock(&c->lock);
    n = stbds_arrlenu(c->loads) + stbds_arrlenu(c->stores) + stbds_arrlenu(c->noted) + stbds_arrlenu(c->bound_loads) +
        stbds_arrlenu(c->bound_stores);
    for (i = 0; i < stbds_arrlenu(c->plans); i++) n += c->plans[i].accepted ? stbds_arrlenu(c->plans[i].runs) : 0;
    pthread_mutex_unlock(&c->lock);
    return n;
}

/* ---- scheduler ---------------------------------------------------------------------------------- */

typedef struct kvs__req {
    uint64_t id, arrival;
    kvs_slot_state state;
    int32_t priority;
    uint32_t *tokens;          /* stb_ds: prompt and generated tokens */
    size_t num_prompt;
    uint32_t max_new, generated, preemptions;
    kvb_seq *seq;
    size_t computed, cached, lower_hit, registered_blocks;
    uint64_t salt;
    uint64_t extra[KVB_MAX_EXTRA_KEYS];
    size_t num_extra;
    int swapped, scheduled, drop_after_step;
    uint64_t preempted_in;     /* the step that preempted it: not resumed in that same step */
} kvs__req;

typedef struct kvs__req_entry { uint64_t key; kvs__req *value; } kvs__req_entry;

struct kvs_sched {
    kvs_sched_config cfg;
    kvs_connector *conn;
    uint32_t block_tokens, device_blocks;
    kvs__req_entry *reqs;      /* stb_ds map id -> request */
    kvs__req **waiting, **running, **swapped, **onboarding;
    uint64_t next_id, next_arrival, step_id;
    int in_step;
    size_t tokens_left, seqs_left; /* the budgets of the step being planned */
    kvs_sched_item *prefill, *decode;
    uint64_t *preempted;
    kvs_sched_stats stats;
};

static kvs__req *kvs__find(kvs_sched *s, uint64_t id)
{
    ptrdiff_t i = stbds_hmgeti(s->reqs, id);
    return i < 0 ? NULL : s->reqs[i].value;
}

static kvs_result kvs__set_state(kvs__req *r, kvs_slot_state to)
{
    if (r->state == to) return KVS_OK;
    if (!kvs_slot_transition_allowed(r->state, to)) return KVS_ESTATE;
    r->state = to;
    return KVS_OK;
}

/* Queue order: higher priority first, then earlier arrival. */
static int kvs__before(const kvs__req *a, const kvs__req *b)
{
    return a->priority != b->priority ? a->priority > b->priority : a->arrival < b->arrival;
}

static void kvs__queue_insert(kvs__req ***q, kvs__req *r)
{
    size_t at = stbds_arrlenu(*q);
    while (at > 0 && kvs__before(r, (*q)[at - 1])) at--;
    stbds_arrput(*q, r);
    memmove(&(*q)[at + 1], &(*q)[at], (stbds_arrlenu(*q) - 1 - at) * sizeof **q);
    (*q)[at] = r;
}

static int kvs__queue_remove(kvs__req **q, kvs__req *r)
{
    size_t i;
    for (i = 0; i < stbds_arrlenu(q); i++)
        if (q[i] == r) {
            memmove(&q[i], &q[i + 1], (stbds_arrlenu(q) - 1 - i) * sizeof *q);
            stbds_header(q)->length--;
            return 1;
        }
    return 0;
}

static void kvs__unqueue(kvs_sched *s, kvs__req *r)
{
    if (!kvs__queue_remove(s->waiting, r) && !kvs__queue_remove(s->running, r) &&
        !kvs__queue_remove(s->swapped, r))
        kvs__queue_remove(s->onboarding, r);
}

KVS_API kvs_result kvs_sched_create(const kvs_sched_config *config, kvs_sched **out)
{
    kvs_sched *s;
    kvb_pool_config pc;
    kvs_result r;
    if (!config || !out || !config->device || (config->preempt == KVS_PREEMPT_SWAP && !config->tiers) ||
        (unsigned)config->preempt > KVS_PREEMPT_SWAP || (unsigned)config->offload > KVS_OFFLOAD_LAZY)
        return KVS_EINVAL;
    s = (kvs_sched *)KVB_MALLOC(sizeof *s);
    if (!s) return KVS_ENOMEM;
    memset(s, 0, sizeof *s);
    s->cfg = *config;
    if (!s->cfg.max_tokens) s->cfg.max_tokens = 8192;
    if (!s->cfg.max_seqs) s->cfg.max_seqs = 256;
    memset(&pc, 0, sizeof pc);
    kvb_pool_get_config(config->device, &pc);
    s->block_tokens = pc.block_tokens;
    s->device_blocks = pc.num_blocks;
    s->next_id = 1;
    if (config->tiers) {
        kvs_connector_config cc;
        cc.device = config->device;
        cc.tiers = config->tiers;
        cc.offload = config->offload;
        if ((r = kvs_connector_create(&cc, &s->conn)) != KVS_OK) {
            KVB_FREE(s);
            return r;
        }
    }
    *out = s;
    return KVS_OK;
}

/* Give back a request's device blocks and its connector state (its counts stay readable). */
static void kvs__drop_blocks(kvs_sched *s, kvs__req *r)
{
    kvb_seq_destroy(r->seq);
    r->seq = NULL;
    if (s->conn) kvs_connector_request_finished(s->conn, r->id, NULL);
}

static void kvs__req_free(kvs__req *r)
{
    stbds_arrfree(r->tokens);
    KVB_FREE(r);
}

KVS_API void kvs_sched_destroy(kvs_sched *sched)
{
    ptrdiff_t i;
    if (!sched) return;
    for (i = 0; i < stbds_hmlen(sched->reqs); i++) {
        kvs__drop_blocks(sched, sched->reqs[i].value);
        kvs__req_free(sched->reqs[i].value);
    }
    stbds_hmfree(sched->reqs);
    stbds_arrfree(sched->waiting);
    stbds_arrfree(sched->running);
    stbds_arrfree(sched->swapped);
    stbds_arrfree(sched->onboarding);
    stbds_arrfree(sched->prefill);
    stbds_arrfree(sched->decode);
    stbds_arrfree(sched->preempted);
    kvs_connector_destroy(sched->conn);
    KVB_FREE(sched);
}

KVS_API kvs_result kvs_sched_add(kvs_sched *sched, const kvs_request *request, uint64_t *out_id)
{
    kvs__req *r;
    size_t need;
    if (!sched || !request || !out_id || !request->num_prompt || !request->prompt ||
        (request->num_extra && !request->extra) || request->num_extra > KVB_MAX_EXTRA_KEYS)
        return KVS_EINVAL;
    need = (request->num_prompt + request->max_new_tokens + sched->block_tokens - 1) / sched->block_tokens;
    if (need > sched->device_blocks) return KVS_ETOOBIG;
    r = (kvs__req *)KVB_MALLOC(sizeof *r);
    if (!r) return KVS_ENOMEM;
    memset(r, 0, sizeof *r);
    r->id = sched->next_id++;
    r->arrival = sched->next_arrival++;
    r->state = KVS_SLOT_INITIALIZED;
    r->priority = request->priority;
    r->num_prompt = request->num_prompt;
    r->max_new = request->max_new_tokens;
    r->salt = request->salt;
    r->num_extra = request->num_extra;
    if (request->num_extra) memcpy(r->extra, request->extra, request->num_extra * sizeof *r->extra);
    memcpy(stbds_arraddnptr(r->tokens, request->num_prompt), request->prompt, request->num_prompt * sizeof *r->tokens);
    stbds_hmput(sched->reqs, r->id, r);
    kvs__queue_insert(&sched->waiting, r);
    sched->stats.prompt_tokens += request->num_prompt;
    *out_id = r->id;
    return KVS_OK;
}

/* The running request to preempt for `for_r`: lowest priority, latest arrival, not scheduled this step,
 * of priority below `below` (INT32_MAX + 1 = any). */
/* The running request to preempt: lowest priority, latest arrival, priority below `below`, not `self`. */
static kvs__req *kvs__victim(kvs_sched *s, int64_t below, const kvs__req *self)
{
    size_t i = stbds_arrlenu(s->running);
    while (i-- > 0) {
        kvs__req *v = s->running[i];
        if (v != self && v->priority < below) return v;
    }
    return NULL;
}

/* Take a request's item out of the step being planned and give its budget back. */
static void kvs__unschedule(kvs_sched *s, kvs__req *v)
{
    kvs_sched_item **arrs[2];
    size_t a, i;
    arrs[0] = &s->prefill;
    arrs[1] = &s->decode;
    if (!v->scheduled) return;
    for (a = 0; a < 2; a++)
        for (i = 0; i < stbds_arrlenu(*arrs[a]); i++)
            if ((*arrs[a])[i].request == v->id) {
                s->tokens_left += (*arrs[a])[i].num_new;
                s->seqs_left++;
                memmove(&(*arrs[a])[i], &(*arrs[a])[i + 1], (stbds_arrlenu(*arrs[a]) - 1 - i) * sizeof **arrs[a]);
                stbds_header(*arrs[a])->length--;
                break;
            }
    v->scheduled = 0;
}

/* Swap: its registered blocks go to G2 first (synchronously, whatever the offload mode), so they come
 * back when it resumes. */
static void kvs__swap_out(kvs_sched *s, kvs__req *v)
{
    const kvb_block *table = NULL;
    size_t n = 0, full, i;
    kvo_pipeline *down = kvo_manager_pipeline(s->cfg.tiers, 0, 0);
    kvb_weak *w;
    kvo_transfer t;
    kvb_seq_blocks(v->seq, &table, &n);
    full = v->registered_blocks < n ? v->registered_blocks : n;
    if (!full || !down || !(w = (kvb_weak *)KVB_MALLOC(full * sizeof *w))) return;
    for (i = 0; i < full; i++) w[i] = kvb_weak_of(table[i]);
    if (kvo_enqueue(down, w, full, NULL, &t) == KVO_OK) kvo_pipeline_drain(down, 5 * 1000000);
    KVB_FREE(w);
}

static void kvs__preempt(kvs_sched *s, kvs__req *v)
{
    kvs__unschedule(s, v);
    v->preempted_in = s->step_id + 1; /* the step being planned */
    kvs__queue_remove(s->running, v);
    if (s->cfg.preempt == KVS_PREEMPT_SWAP) kvs__swap_out(s, v);
    kvs__drop_blocks(s, v);
    v->computed = v->cached = v->registered_blocks = 0; /* recomputed (or reloaded) from scratch */
    kvs__set_state(v, KVS_SLOT_PREEMPTED);
    v->preemptions++;
    v->swapped = s->cfg.preempt == KVS_PREEMPT_SWAP;
    if (v->swapped) {
        s->stats.preempted_swap++;
        kvs__queue_insert(&s->swapped, v);
    } else {
        s->stats.preempted_recompute++;
        kvs__queue_insert(&s->waiting, v);
    }
    stbds_arrput(s->preempted, v->id);
}

static void kvs__item(kvs_sched *s, kvs__req *r, size_t num_computed, size_t num_new, int decode)
{
    kvs_sched_item it;
    it.request = r->id;
    kvb_seq_blocks(r->seq, &it.blocks, &it.num_blocks);
    it.num_computed = num_computed;
    it.num_new = num_new;
    it.tokens = r->tokens;
    it.num_tokens = stbds_arrlenu(r->tokens);
    r->scheduled = 1;
    if (decode) stbds_arrput(s->decode, it);
    else stbds_arrput(s->prefill, it);
}

/* Bring the sequence up to the request's tokens (sampled tokens since the last step), preempting
 * others when blocks run out. 0 when r itself had to go. */
static int kvs__grow(kvs_sched *s, kvs__req *r, int64_t preempt_below)
{
    size_t have;
    kvb_seq_info info;
    memset(&info, 0, sizeof info);
    kvb_seq_get_info(r->seq, &info);
    have = info.num_tokens;
    while (have < stbds_arrlenu(r->tokens)) {
        kvs__req *v;
        if (kvb_seq_append(r->seq, r->tokens + have, stbds_arrlenu(r->tokens) - have, NULL) == KVB_OK) return 1;
        v = kvs__victim(s, preempt_below, NULL);
        if (!v || v == r) return 0;
        kvs__preempt(s, v);
    }
    return 1;
}

/* Schedule what `r` computes next within the budget: 1 when it got a share. */
static int kvs__schedule_compute(kvs_sched *s, kvs__req *r)
{
    size_t *tokens_left = &s->tokens_left, *seqs_left = &s->seqs_left;
    size_t len = stbds_arrlenu(r->tokens), from = r->computed, n;
    int decode = r->computed >= r->num_prompt && r->state != KVS_SLOT_PREFILLING && r->state != KVS_SLOT_SKIPPED_PREFILL;
    if (from >= len) return 0;
    n = len - from;
    if (!*seqs_left || !*tokens_left || (decode && n > *tokens_left)) return 0;
    if (n > *tokens_left) n = *tokens_left; /* chunked prefill */
    kvs__item(s, r, from, n, decode);
    *tokens_left -= n;
    (*seqs_left)--;
    return 1;
}

static void kvs__schedule_running(kvs_sched *s)
{
    kvs__req **order = NULL; /* a snapshot: preemption takes requests out of s->running meanwhile */
    size_t i;
    if (stbds_arrlen(s->running)) memcpy(stbds_arraddnptr(order, stbds_arrlenu(s->running)), s->running, stbds_arrlenu(s->running) * sizeof *order);
    for (i = 0; i < 2 * stbds_arrlenu(order); i++) { /* decodes first, then prefills */
        kvs__req *r = order[i % stbds_arrlenu(order)];
        int decoding = r->state == KVS_SLOT_DECODING || r->state == KVS_SLOT_SKIPPED_DECODE;
        if (r->state == KVS_SLOT_PREEMPTED || r->state == KVS_SLOT_FINISHED) continue; /* a victim meanwhile */
        if (decoding != (i < stbds_arrlenu(order)) || r->scheduled) continue;
        if (decoding && stbds_arrlenu(r->tokens) <= r->computed) continue; /* waiting for its sampled token */
        if (!kvs__grow(s, r, (int64_t)INT32_MAX + 1)) { /* nobody else to preempt: r goes */
            kvs__preempt(s, r);
            continue;
        }
        if (kvs__schedule_compute(s, r))
            kvs__set_state(r, decoding ? KVS_SLOT_DECODING : KVS_SLOT_PREFILLING);
        else
            kvs__set_state(r, decoding ? KVS_SLOT_SKIPPED_DECODE : KVS_SLOT_SKIPPED_PREFILL);
    }
    stbds_arrfree(order);
}

/* The full-block hashes of r's tokens with the device pool's hash function. */
static void kvs__prompt_hashes(kvs_sched *s, const kvs__req *r, kvb_hash *out, size_t n)
{
    kvb_pool_config pc;
    size_t i;
    memset(&pc, 0, sizeof pc);
    kvb_pool_get_config(s->cfg.device, &pc);
    for (i = 0; i < n; i++) {
        const kvb_hash *parent = i ? &out[i - 1] : NULL;
        const uint32_t *t = r->tokens + i * s->block_tokens;
        if (pc.hash_fn) pc.hash_fn(parent, t, s->block_tokens, r->extra, r->num_extra, r->salt, &out[i], pc.hash_user);
        else out[i] = kvb_hash_block(parent, t, s->block_tokens, r->extra, r->num_extra, r->salt);
    }
}

/* Lower tiers first: when they hold blocks past the device prefix, the request waits for the loads. */
static int kvs__stage_onboard(kvs_sched *s, kvs__req *r)
{
    kvb_hash *hashes;
    size_t nh = stbds_arrlenu(r->tokens) / s->block_tokens, dev = 0, ext = 0;
    int async = 0;
    r->lower_hit = 0;
    if (!s->conn || !nh) return 0;
    hashes = (kvb_hash *)KVB_MALLOC(nh * sizeof *hashes);
    if (!hashes) return 0;
    kvs__prompt_hashes(s, r, hashes, nh);
    kvb_lookup(s->cfg.device, hashes, nh, &dev);
    kvs_connector_get_num_new_matched_tokens(s->conn, r->id, hashes, nh, dev * s->block_tokens, &ext, &async);
    KVB_FREE(hashes);
    if (!async) {
        kvs_connector_update_state_after_alloc(s->conn, r->id, 0);
        return 0;
    }
    kvs_connector_update_state_after_alloc(s->conn, r->id, ext);
    r->lower_hit = ext;
    if (r->state == KVS_SLOT_PREEMPTED) kvs__set_state(r, KVS_SLOT_ONBOARDING);
    else kvs__set_state(r, KVS_SLOT_ONBOARD_STAGED);
    return 1;
}

/* Admit r: match the device cache, allocate the rest, schedule its first chunk. 0 when it does not fit. */
static int kvs__admit(kvs_sched *s, kvs__req *r)
{
    kvb_seq_config sc;
    size_t cached = 0;
    sc.salt = r->salt;
    sc.extra = r->extra;
    sc.n_extra = r->num_extra;
    if (kvb_seq_create(s->cfg.device, &sc, &r->seq) != KVB_OK) return 0;
    for (;;) { /* the last token is appended on its own: a hit never covers it, so the engine always
                * computes at least one token (for its logits) in a block of its own, as in vLLM */
        kvs__req *v;
        size_t len = stbds_arrlenu(r->tokens);
        if (kvb_seq_append(r->seq, r->tokens, len - 1, &cached) == KVB_OK) {
            if (kvb_seq_append(r->seq, r->tokens + len - 1, 1, NULL) == KVB_OK) break;
            kvb_seq_truncate(r->seq, 0);
        }
        v = kvs__victim(s, r->priority, r);
        if (!v) {
            kvb_seq_destroy(r->seq);
            r->seq = NULL;
            return 0;
        }
        kvs__preempt(s, v);
    }
    if (s->conn) kvs_connector_release_loads(s->conn, r->id);
    r->computed = r->cached = cached;
    r->registered_blocks = cached / s->block_tokens;
    s->stats.cached_tokens += cached;
    s->stats.lower_hit_tokens += r->lower_hit;
    s->stats.admitted++;
    if (r->state == KVS_SLOT_PREEMPTED) kvs__set_state(r, KVS_SLOT_INITIALIZED);
    kvs__set_state(r, KVS_SLOT_PREFILLING); /* a resumed request prefills what was not cached, then decodes */
    kvs__queue_insert(&s->running, r);
    if (!kvs__schedule_compute(s, r)) kvs__set_state(r, KVS_SLOT_SKIPPED_PREFILL);
    return 1;
}

/* Whether the device has room (free or evictable blocks) for all of r's blocks. */
static int kvs__fits(kvs_sched *s, const kvs__req *r)
{
    kvb_pool_stats st;
    size_t need = (stbds_arrlenu(r->tokens) + s->block_tokens - 1) / s->block_tokens;
    if (kvb_pool_get_stats(s->cfg.device, &st) != KVB_OK) return 0;
    return need <= (size_t)st.free_blocks + st.inactive_blocks;
}

/* Waiting (or swapped) requests in order, while the budgets last. */
static void kvs__admit_queue(kvs_sched *s, kvs__req ***q)
{
    size_t i = 0;
    while (i < stbds_arrlenu(*q) && s->tokens_left && s->seqs_left) {
        kvs__req *r = (*q)[i];
        if (r->preempted_in == s->step_id + 1) { /* preempted while planning this step: not back yet */
            i++;
            continue;
        }
        if (!kvs__fits(s, r)) { /* loads would find no room: wait (a swapped request) or try preempting */
            if (r->swapped) break;
        } else if (r->state != KVS_SLOT_ONBOARDING && kvs__stage_onboard(s, r)) {
            kvs__queue_remove(*q, r);
            kvs__queue_insert(&s->onboarding, r);
            continue;
        }
        kvs__queue_remove(*q, r);
        if (!kvs__admit(s, r)) { /* does not fit: it keeps its place */
            kvs__queue_insert(q, r);
            break;
        }
    }
}

/* Loads that finished: those requests go back to be admitted (their blocks are now on the device). */
static void kvs__collect_loads(kvs_sched *s)
{
    kvs_worker_output out;
    size_t i;
    if (!s->conn) return;
    kvs_connector_get_finished(s->conn, &out);
    for (i = 0; i < out.num_finished_loads; i++) {
        kvs__req *r = kvs__find(s, out.finished_loads[i]);
        if (!r || !kvs__queue_remove(s->onboarding, r)) continue;
        kvs__queue_insert(r->swapped ? &s->swapped : &s->waiting, r);
    }
    kvs_connector_update_output(s->conn, &out);
}

/* The step's connector work: loads before the forward pass, and the stores of blocks the previous
 * forward pass registered. */
static void kvs__start_transfers(kvs_sched *s, kvs_connector_meta *meta)
{
    size_t i;
    if (!s->conn) {
        memset(meta, 0, sizeof *meta);
        return;
    }
    kvs_connector_build_meta(s->conn, meta);
    kvs_connector_bind_meta(s->conn, meta);
    kvs_connector_start_stores(s->conn);
    kvs_connector_start_loads(s->conn);
    for (i = 0; i < stbds_arrlenu(s->onboarding); i++)
        if (s->onboarding[i]->state == KVS_SLOT_ONBOARD_STAGED) kvs__set_state(s->onboarding[i], KVS_SLOT_ONBOARDING);
}

KVS_API kvs_result kvs_sched_step(kvs_sched *sched, kvs_step *out)
{
    size_t i;
    if (!sched || !out) return KVS_EINVAL;
    if (sched->in_step) return KVS_ESTEP;
    KVB__ARR_SHRINK(sched->prefill, 0);
    KVB__ARR_SHRINK(sched->decode, 0);
    KVB__ARR_SHRINK(sched->preempted, 0);
    for (i = 0; i < stbds_arrlenu(sched->running); i++) sched->running[i]->scheduled = 0;
    sched->tokens_left = sched->cfg.max_tokens;
    sched->seqs_left = sched->cfg.max_seqs;
    kvs__collect_loads(sched);
    kvs__schedule_running(sched);
    kvs__admit_queue(sched, &sched->swapped);
    if (!stbds_arrlen(sched->swapped)) kvs__admit_queue(sched, &sched->waiting);
    memset(out, 0, sizeof *out);
    kvs__start_transfers(sched, &out->meta);
    out->id = ++sched->step_id;
    out->prefill = sched->prefill;
    out->num_prefill = stbds_arrlenu(sched->prefill);
    out->decode = sched->decode;
    out->num_decode = stbds_arrlenu(sched->decode);
    out->num_tokens = sched->cfg.max_tokens - sched->tokens_left;
    out->preempted = sched->preempted;
    out->num_preempted = stbds_arrlenu(sched->preempted);
    sched->in_step = 1;
    sched->stats.steps++;
    return KVS_OK;
}

/* Commit what an item computed; in eager mode the newly registered blocks go to the connector. */
static void kvs__commit_item(kvs_sched *s, const kvs_sched_item *it)
{
    kvs__req *r = kvs__find(s, it->request);
    const kvb_block *table = NULL;
    size_t n = 0, done;
    if (!r || !r->seq || r->state == KVS_SLOT_FINISHED) return; /* aborted during the step */
    done = it->num_computed + it->num_new;
    kvb_seq_commit(r->seq, done);
    if (done > r->computed) {
        s->stats.computed_tokens += done - r->computed;
        r->computed = done;
    }
    kvb_seq_blocks(r->seq, &table, &n);
    if (s->conn && r->computed / s->block_tokens > r->registered_blocks)
        kvs_connector_note_registered(s->conn, r->id, table + r->registered_blocks,
                                      r->computed / s->block_tokens - r->registered_blocks);
    if (r->computed / s->block_tokens > r->registered_blocks) r->registered_blocks = r->computed / s->block_tokens;
    if (r->state == KVS_SLOT_PREFILLING && r->computed >= stbds_arrlenu(r->tokens)) kvs__set_state(r, KVS_SLOT_DECODING);
}

KVS_API kvs_result kvs_sched_complete(kvs_sched *sched, const kvs_step *step)
{
    size_t i, a;
    if (!sched || !step) return KVS_EINVAL;
    if (!sched->in_step || step->id != sched->step_id) return KVS_ESTEP;
    for (i = 0; i < stbds_arrlenu(sched->prefill); i++) kvs__commit_item(sched, &sched->prefill[i]);
    for (i = 0; i < stbds_arrlenu(sched->decode); i++) kvs__commit_item(sched, &sched->decode[i]);
    sched->in_step = 0;
    for (a = 0; a < 2; a++) { /* requests that ended during the step give their blocks back now */
        kvs_sched_item *items = a ? sched->decode : sched->prefill;
        for (i = 0; i < stbds_arrlenu(items); i++) {
            kvs__req *r = kvs__find(sched, items[i].request);
            if (r && r->drop_after_step) {
                r->drop_after_step = 0;
                kvs__drop_blocks(sched, r);
            }
        }
    }
    return KVS_OK;
}

/* Finishing -> Finished: blocks released (they stay cached), connector told. */
static kvs_result kvs__end(kvs_sched *s, kvs__req *r, int aborted)
{
    kvs_result res = kvs__set_state(r, KVS_SLOT_FINISHING);
    if (res != KVS_OK) return res;
    kvs__unqueue(s, r);
    if (s->in_step && r->scheduled) r->drop_after_step = 1; /* the engine holds its block table */
    else kvs__drop_blocks(s, r);
    kvs__set_state(r, KVS_SLOT_FINISHED);
    if (aborted) s->stats.aborted++;
    else s->stats.finished++;
    return KVS_OK;
}

KVS_API kvs_result kvs_sched_append(kvs_sched *sched, uint64_t request, const uint32_t *tokens, size_t n)
{
    kvs__req *r;
    if (!sched || (n && !tokens)) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    if (r->state != KVS_SLOT_DECODING && r->state != KVS_SLOT_SKIPPED_DECODE) return KVS_ESTATE;
    if (stbds_arrlenu(r->tokens) > r->computed) return KVS_ESTATE; /* the last token is not computed yet */
    if (!n) return KVS_OK;
    memcpy(stbds_arraddnptr(r->tokens, n), tokens, n * sizeof *tokens);
    r->generated += (uint32_t)n;
    if (r->max_new && r->generated >= r->max_new) return kvs__end(sched, r, 0);
    return KVS_OK;
}

KVS_API kvs_result kvs_sched_finish(kvs_sched *sched, uint64_t request)
{
    kvs__req *r;
    if (!sched) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    return kvs__end(sched, r, 0);
}

KVS_API kvs_result kvs_sched_abort(kvs_sched *sched, uint64_t request)
{
    kvs__req *r;
    if (!sched) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    return kvs__end(sched, r, 1);
}

KVS_API kvs_result kvs_sched_release(kvs_sched *sched, uint64_t request)
{
    kvs__req *r;
    if (!sched) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    if (r->state != KVS_SLOT_FINISHED) return KVS_ESTATE;
    (void)stbds_hmdel(sched->reqs, request);
    kvs__req_free(r);
    return KVS_OK;
}

KVS_API kvs_result kvs_sched_get_slot(kvs_sched *sched, uint64_t request, kvs_slot_info *out)
{
    kvs__req *r;
    if (!sched || !out) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    memset(out, 0, sizeof *out);
    out->state = r->state;
    out->priority = r->priority;
    out->num_tokens = stbds_arrlenu(r->tokens);
    out->num_computed = r->computed;
    out->num_cached = r->cached;
    out->num_lower_hit_tokens = r->lower_hit;
    out->generated = r->generated;
    out->preemptions = r->preemptions;
    out->pending_transfers = r->state == KVS_SLOT_ONBOARD_STAGED || r->state == KVS_SLOT_ONBOARDING;
    return KVS_OK;
}

KVS_API kvs_result kvs_sched_get_stats(kvs_sched *sched, kvs_sched_stats *out)
{
    if (!sched || !out) return KVS_EINVAL;
    *out = sched->stats;
    out->waiting = (uint32_t)stbds_arrlenu(sched->waiting);
    out->running = (uint32_t)stbds_arrlenu(sched->running);
    out->swapped = (uint32_t)stbds_arrlenu(sched->swapped);
    out->onboarding = (uint32_t)stbds_arrlenu(sched->onboarding);
    return KVS_OK;
}

KVS_API int kvs_sched_idle(kvs_sched *sched)
{
    return !sched || (!stbds_arrlen(sched->waiting) && !stbds_arrlen(sched->running) && !stbds_arrlen(sched->swapped) &&
                      !stbds_arrlen(sched->onboarding));
}

KVS_API kvs_connector *kvs_sched_connector(kvs_sched *sched) { return sched ? sched->conn : NULL; }

#ifdef KVS__DEFINED_TYPEOF
#undef typeof
#undef KVS__DEFINED_TYPEOF
#endif

#endif /* KVSCHED_IMPL_INCLUDED */
#endif /* KVSCHED_IMPLEMENTATION || KVCACHE_IMPLEMENTATION */
