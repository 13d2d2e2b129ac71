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
#define KVS_API static
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

/* One request's part of a step. */
typedef struct kvs_sched_item {
    uint64_t request;
    const kvb_block *blocks;      /* its block table (valid until the next step) */
    size_t num_blocks;
    size_t num_computed;          /* tokens already in the cache */
    size_t num_new;               /* tokens to compute now: [num_computed, num_computed + num_new) */
    const uint32_t *tokens;       /* all of its tokens */
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
