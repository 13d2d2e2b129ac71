/* kvsched.h — driving kvcache from an engine's step loop: request slots, the connector between the
 * device pool and the lower tiers, and a continuous-batching scheduler (part of kvcache)
 *
 * Do this in exactly one C or C++ file:    #define KVSCHED_IMPLEMENTATION
 *                                           #include "kvsched.h"
 * (it includes kvoffload.h and kvblock.h; define their implementation macros there too, or
 * KVCACHE_IMPLEMENTATION for all). Needs C11, POSIX threads, stb_ds.h, -pthread.
 *
 * Manual: 1. Quick start  2. Slots  3. Scheduler  4. Connector  5. Sizing  6. Thread safety  7. Errors
 *         8. Observability: events, recorder, replay, breakpoints, console, metrics
 *
 * 1. QUICK START — one engine step
 *
 *     kvs_sched_config sc = { .device = device_pool, .tiers = manager };   // tiers optional
 *     kvs_sched *s;  kvs_sched_create(&sc, &s);
 *     kvs_request rq = { .prompt = tokens, .num_prompt = n, .max_new_tokens = 64 };
 *     uint64_t id;   kvs_sched_add(s, &rq, &id);
 *     for (;;) {
 *         kvs_step step;  kvs_sched_step(s, &step);          // prefill + decode groups, block tables
 *         if (!step.num_prefill && !step.num_decode && kvs_sched_idle(s)) {
 *             kvs_sched_complete(s, &step); break;            // an empty step too: else the next
 *         }                                                   // kvs_sched_step is KVS_ESTEP
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
 * requests (swap in), then waiting ones, and only when no request is swapped out (as vLLM: whoever was
 * preempted comes back first, whatever the priorities of those waiting). Admission matches the device prefix cache first, then asks the
 * connector for lower-tier hits among the full blocks before the last token's (that token is always
 * computed, for its logits, so its block is too): those blocks are onboarded (asynchronously) before the
 * request prefills, and its device prefix is held meanwhile (kvb_pin: not counted as a use), so that
 * no eviction cuts the prefix off from the loaded blocks (vLLM holds them too; without, 5% of the loaded
 * blocks in a serve_sim run were recomputed). When blocks run out, the victim is the running request of
 * lowest priority, latest arrival: KVS_PREEMPT_RECOMPUTE frees its blocks and requeues it;
 * KVS_PREEMPT_SWAP offloads its blocks to G2 first and onboards them back when it resumes (the
 * swap-out waits in kvs_sched_step for the G1 -> G2 pipeline to drain, at most 5 s of real time; what
 * G2 lacks when it resumes is recomputed). A waiting request may preempt running ones of strictly lower
 * priority, in that order and only as many as it needs, and only when preempting all of them could make
 * room for it (its cached prefix counted in its favour): else it waits and preempts none. The engine reports sampled tokens with kvs_sched_append; a request ends at max_new_tokens or
 * with kvs_sched_finish.
 *
 * 4. CONNECTOR (the shape of vLLM's KV connectors) — between the device pool and the tiers of a
 * kvo_manager. Scheduler side: get_num_new_matched_tokens (lower-tier hits after the device prefix,
 * counted in tokens from num_computed, which need not be a whole number of blocks: the offer then ends on
 * a block boundary and what is taken must too), update_state_after_alloc (how many of them the
 * scheduler takes), build_meta (this step's loads and stores, each with an event id), update_output
 * (what the worker finished), request_finished. Worker
 * side: bind_meta, start_loads (before the forward pass), start_stores (after it), get_finished.
 * Loads onboard into the device pool (allocating and registering the device blocks there), so the
 * request's own match then finds them. The lookup is kvo_manager_lookup over the manager's tiers, or
 * config.lookup: with a G4 tier in Redis, kvo_redis_tiers_lookup (kvremote.h) looks up device, host,
 * disk, then Redis, importing what other processes stored; loads from G4 go through the same
 * onboarding pipelines as host and disk. A load that fails or finds its entry gone (a Redis node lost,
 * an entry Redis evicted) lands nothing for those blocks: the request's match stops before them and
 * it computes them, a miss like any other. Stores: eager mode offers every newly registered device block
 * (start_stores makes one offer of all the bound stores: each event finishes when that transfer does);
 * lazy mode stores nothing until blocks near eviction, then keeps `lazy_reserve` device blocks ready to
 * be taken, free ones first and eviction candidates backed by G2 for the rest (kvo_manager_poll). Offloads hold only weak handles, so a finished request never has to
 * keep its blocks alive for a store (request_finished says 0). kvs_sched drives both sides itself; an
 * engine with its own scheduler and worker threads calls them directly.
 *
 * 5. SIZING — kvs_blocks_for_bytes turns a byte budget (like cpu_bytes_to_use_per_rank of vLLM's
 * SimpleCPUOffloadConnector) into a block count for a layout; kvs_model_preset gives model layouts.
 * KVS_MODEL_LLAMA3_8B: 16-token blocks, 32 layers, 8 KV heads (grouped-query attention: 32 query heads
 * share them) x head dim 128, fp16: pages of 32 KiB (one layer, K or V), 2 MiB per block, 128 KiB per
 * token (serve_sim's cost model).
 *
 * 6. THREAD SAFETY — a kvs_sched is used by one thread at a time (the engine's scheduler thread);
 * a kvs_connector's scheduler side and worker side may run on two threads (each side's calls from one
 * thread), its own lock orders them.
 *
 * 7. ERRORS — kvs_result: KVS_OK or negative; kvb_ and kvo_ codes pass through; kvs_result_string
 * names all. A failed call changes nothing.
 *
 * 8. OBSERVABILITY — give the scheduler a bus (kvs_sched_config.bus) and everything it decides becomes
 * an event; the pools and pipelines join through two adapters:
 *
 *     kvs_bus *bus;  kvs_bus_create(NULL, &bus);
 *     pool_cfg.on_events = kvs_bus_pool_events;      pool_cfg.event_user = bus;      // block events
 *     mgr_cfg.pipeline.on_stage = kvs_bus_transfer_stage; mgr_cfg.pipeline.stage_user = bus; // transfers
 *     sched_cfg.bus = bus;
 *     kvs_recorder *rec;  kvs_recorder_config rc = { .log_path = "run.kvslog" };
 *     kvs_recorder_create(bus, &rc, &rec);           // timeline in memory + append-only log
 *     kvs_console *con;   kvs_console_config cc = { .path = "/tmp/engine.sock" };
 *     kvs_console_start(bus, &cc, &con);             // examples/kvtop attaches here
 *
 * Events (kvs_event, 80 bytes, version KVS_EVENT_VERSION; JSON field names in brackets):
 *     slot        a slot changed state [from, to, tokens, computed]; from "" when the request was added
 *     admit       admitted [prompt_tokens, device_hit_tokens, lower_hit_tokens, priority, preemptions]
 *     step        a step was planned [step, prefill, decode, tokens, preempted, waiting, running,
 *                 swapped, onboarding, device_used, device_blocks]
 *     block_stored / block_removed / block_cleared   [tier, tokens, hash, parent] (hashes: 32 hex digits)
 *     transfer    [transfer, stage, src_tier, dst_tier, blocks, moved, error, onboard]; stages:
 *                 PendingEvaluation -> Promoted -> Skipped | Completed | Cancelled | Failed
 *     tiers       once per step [num_tiers, used[4], total[4], policies, device_step, device_tails]
 *                 (used: blocks holding data; policies: each tier's kvb_evict_policy, a byte per tier,
 *                 G1 lowest; device_step: G1's FOL class step in use, 0 for LRU order or another
 *                 policy; device_tails: 1 when G1's FOL puts tails first, kvb_pool_stats.fol_tails_first)
 *     add, tokens, run_step, complete, append, finish, abort, release: the scheduler's inputs; the
 *                 prompt follows an add in `tokens` events of up to 11 words [words]; an append carries
 *                 its first 10 tokens itself [n, words], the rest follow in `tokens` events
 *     paused / resumed   a thread stopped at a breakpoint or pause [call, state, finished]
 * Every event also has seq (from 1 per bus), t_ns, request (0 when none) and v. kvs_event_to_json
 * writes one flat JSON object, kvs_event_from_json reads it back.
 *
 * Subscribers: callbacks (run in the publishing thread under the bus's lock: quick, no kvs_bus_
 * calls) and ring readers (kvs_reader_open: a reader that falls behind loses the oldest events and is
 * told how many; the engine never waits for it). The recorder keeps the last `capacity` events and
 * appends each to its log: a 16-byte header ("KVSEVLOG", version, record size), then records of
 * KVS_RECORD_BYTES (the event's bytes, little-endian, then its CRC-32C). kvs_log_read returns every
 * record before a truncated or corrupt one and says where the damage is. kvs_replay feeds a log's
 * inputs to a fresh scheduler and checks it makes the same decisions (metadata-only pools are enough;
 * with lower tiers, use poll-mode pipelines and a fake clock so loads finish at the same steps).
 * Block events carry the hashes of the version that wrote the log: those of kvcache 0.1 match nothing
 * 0.2 computes (kvblock.h section 3). Replay recomputes hashes from the recorded tokens, so a 0.1 log
 * still replays; where a policy samples blocks by hash (FOL's self-tuning) its decisions may differ,
 * and replay says where.
 *
 * Hooks and breakpoints: kvs_bus_set_hook sees every scheduler and connector call before and after it
 * runs. A breakpoint (a call, a slot state, a request, or a combination) stops the thread that reaches
 * it until kvs_bus_resume, from code or the console; kvs_bus_pause stops the next thread at its next
 * call or transition. With no hook, breakpoint or pause the cost is one load and one predictable branch
 * per call (none at all without a bus).
 *
 * Console: kvs_console_start serves a Unix socket (mode 0600) from its own thread: a client gets the
 * log header, the live slots, the last step and tier events, the recent history, then every event as
 * it happens (records as in the log); it sends command lines: pause, resume, break state NAME,
 * break request ID, break call NAME, clear. A client more than 4 MiB behind skips events until it
 * catches up (the engine never waits for it): the gap in seq says how many it lost. Events published
 * faster than the console reads are lost at its own reader the same way; commands and new clients are
 * still served. A client the console cannot accept (the process out of file descriptors) waits in the
 * socket's queue: it is tried again about every 100 ms, the clients attached served meanwhile.
 *
 * Metrics: kvs_metrics_write renders the scheduler's, pools' and pipelines' counters and gauges in
 * Prometheus text format: kvcache_hit_blocks_total{tier="0"}, kvcache_transfer_blocks_total{tier="1",
 * direction="offload"}, kvcache_inflight_blocks, kvcache_evictions_total, kvcache_dedups_total,
 * kvcache_onboard_joined_blocks_total{tier="1"} (onboarded blocks that joined another request's copy), ...
 *
 * Thread safety: bus, reader, recorder and console functions from any thread; events may be published
 * from any thread (pipelines publish from theirs).
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
#ifndef KVSCHED_H
#define KVSCHED_H
#define KVSCHED_VERSION_MAJOR 0
#define KVSCHED_VERSION_MINOR 2
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
    X(KVS_ESTEP,    -206,  "step does not match the one in progress")               \
    X(KVS_ETIMEDOUT,-207,  "timed out")                                       \
    X(KVS_ELOG,     -208,  "event log damaged (records before the damage were kept)") \
    X(KVS_EIO,      -209,  "file or socket error")                            \
    X(KVS_ENOSPACE, -210,  "buffer too small")                                \
    X(KVS_EREPLAY,  -211,  "replay differs from the recording")

#define KVS__ENUM_ITEM(name, value, text) name = value,
typedef enum kvs_result { KVS__RESULTS(KVS__ENUM_ITEM) KVS__RESULT_MIN = -212 } kvs_result;
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

typedef struct kvs_bus kvs_bus;

/* A lookup over the tiers, kvo_manager_lookup's contract with user data first. kvremote.h's
 * kvo_redis_tiers_lookup (user = the Redis backend) also finds what other processes stored in G4. */
typedef kvo_result (*kvs_lookup_fn)(void *user, kvo_manager *tiers, const kvb_hash *hashes, size_t n,
                                    uint8_t *tier_of, size_t *out_n);

typedef struct kvs_connector_config {
    kvb_pool *device;             /* required: G1 */
    kvo_manager *tiers;           /* required: its G1 must be `device` */
    kvs_offload_mode offload;     /* lazy needs a lazy manager */
    kvs_bus *bus;                 /* optional: hooks and breakpoints (section 8) */
    kvs_lookup_fn lookup;         /* optional: default kvo_manager_lookup (section 4) */
    void *lookup_user;
} kvs_connector_config;

typedef struct kvs_connector kvs_connector;

/* The connector installs itself as the manager's on_offloaded hook (kvo_manager_claim_offloaded):
 * KVS_EINVAL when the manager has one already (another connector's, or a kvo_manager_config hook; of
 * two connectors created at once on one manager, one gets it), and when the connector is lazy and the
 * manager eager (nothing would ever be offered). Thread safety: any thread. */
KVS_API kvs_result kvs_connector_create(const kvs_connector_config *config, kvs_connector **out);
KVS_API void kvs_connector_destroy(kvs_connector *connector);

/* Out of memory, the calls below return KVS_ENOMEM and change nothing (an out parameter gets an empty
 * answer): what was noted, built or bound stays for the next call; blocks whose note_registered failed
 * are not offered, and a load whose blocks find no room is computed instead.
 *
 * Scheduler side. Tokens the lower tiers hold right after the first num_computed tokens (whole blocks
 * of `hashes`, the request's full-block hashes); *out_async = 1 when they must be loaded first. Counted
 * from num_computed itself: num_computed + *out_tokens ends on a block boundary within the hashes, also
 * when num_computed does not (the block it falls in is loaded whole). */
KVS_API kvs_result kvs_connector_get_num_new_matched_tokens(kvs_connector *c, uint64_t request,
                                                            const kvb_hash *hashes, size_t num_hashes,
                                                            size_t num_computed, size_t *out_tokens,
                                                            int *out_async);
/* The scheduler takes num_external_tokens of them (0 drops the plan): at most what was offered (after a
 * take, at most what was taken), and
 * num_computed + num_external_tokens on a block boundary (else KVS_EINVAL). Both calls return
 * KVS_ESTATE while the request's loads are on their way; a take once build_meta planned the loads is
 * KVS_ESTATE too (the plan keeps the loaded blocks; a new question makes a new plan). */
KVS_API kvs_result kvs_connector_update_state_after_alloc(kvs_connector *c, uint64_t request,
                                                          size_t num_external_tokens);
/* Device blocks of `request` newly registered by this step (eager stores). */
KVS_API kvs_result kvs_connector_note_registered(kvs_connector *c, uint64_t request, const kvb_block *blocks,
                                                 size_t n);
/* This step's loads and stores (valid until the next build_meta), with those of earlier steps not started
 * yet (a step's metadata never bound loses nothing; a load or store bound twice starts once). */
KVS_API kvs_result kvs_connector_build_meta(kvs_connector *c, kvs_connector_meta *out);
/* Account what the worker finished. In one process there is nothing left to carry over (get_finished
 * already let the finished loads and stores go): it checks its lists (KVS_EINVAL) and changes nothing. */
KVS_API kvs_result kvs_connector_update_output(kvs_connector *c, const kvs_worker_output *output);
/* Whether the request's blocks must stay alive after it ends (always 0 here: offloads hold weak
 * handles) — and forget the request: its loads, started or not, are cancelled (their transfers let go). */
KVS_API kvs_result kvs_connector_request_finished(kvs_connector *c, uint64_t request, int *out_keep_blocks);

/* Worker side. */
KVS_API kvs_result kvs_connector_bind_meta(kvs_connector *c, const kvs_connector_meta *meta);
KVS_API kvs_result kvs_connector_start_loads(kvs_connector *c);
KVS_API kvs_result kvs_connector_start_stores(kvs_connector *c);
/* Finished loads and stores since the last call (valid until the next call). Polls the tiers. */
KVS_API kvs_result kvs_connector_get_finished(kvs_connector *c, kvs_worker_output *out);
/* Loads and stores not reported finished yet: 0 when there are none. The units follow what each stage
 * holds (a load per run; a store per block until start_stores, then per event), so compare a count
 * with 0, not with get_finished's lists. */
KVS_API size_t kvs_connector_pending(kvs_connector *c);
/* The scheduler matched the loaded blocks of `request` into its sequence: the connector drops the
 * references it kept on them since the loads finished, and the plan. KVS_ESTATE, nothing changed, while
 * a take's loads are not all finished (taken, built or on their way); KVS_OK for a request with no plan. */
KVS_API kvs_result kvs_connector_release_loads(kvs_connector *c, uint64_t request);

/* ---- scheduler ---------------------------------------------------------------------------------- */

typedef enum kvs_preempt_mode { KVS_PREEMPT_RECOMPUTE = 0, KVS_PREEMPT_SWAP } kvs_preempt_mode;

typedef struct kvs_sched_config {
    kvb_pool *device;             /* required */
    kvo_manager *tiers;           /* optional; its G1 must be `device` (the connector takes its hook) */
    uint32_t max_tokens;          /* per step, default 8192 */
    uint32_t max_seqs;            /* per step, default 256 */
    kvs_preempt_mode preempt;     /* swap needs tiers with a G1 -> G2 pipeline */
    kvs_offload_mode offload;     /* the connector's: lazy needs a lazy manager */
    kvs_bus *bus;                 /* optional: events, hooks, breakpoints (section 8) */
    kvs_lookup_fn lookup;         /* optional: the connector's (kvs_connector_config) */
    void *lookup_user;
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
    size_t pending_transfers;                       /* 1 while it waits on its onboarding (its loads
                                                       planned, on their way, or landed and it not yet
                                                       admitted), else 0 */
} kvs_slot_info;

typedef struct kvs_sched_stats {
    uint64_t steps, admitted, finished, aborted, preempted_recompute, preempted_swap;
    uint64_t prompt_tokens, cached_tokens, lower_hit_tokens, computed_tokens;
    uint64_t commits_deferred;      /* sequence commits the device pool had no event memory for (KVB_ENOMEM):
                                       retried at each later complete and before the request's blocks go */
    uint64_t blocks_not_registered; /* full blocks given back unregistered (not cached): even that last
                                       retry found no memory */
    uint32_t waiting, running, swapped, onboarding;
} kvs_sched_stats;

typedef struct kvs_sched kvs_sched;

/* KVS_EINVAL: no device pool, or swap without tiers. Thread safety: any thread. */
KVS_API kvs_result kvs_sched_create(const kvs_sched_config *config, kvs_sched **out);
/* Aborts every request, frees everything. */
KVS_API void kvs_sched_destroy(kvs_sched *sched);
/* Queue a request (slot Initialized). KVS_ETOOBIG when prompt + max_new_tokens can never fit (a request
 * holds fewer than 2^32 tokens). */
KVS_API kvs_result kvs_sched_add(kvs_sched *sched, const kvs_request *request, uint64_t *out_id);
/* Plan the next step. The arrays in *out are valid until the next step (requests added, aborted or
 * released meanwhile leave them in place). KVS_ESTEP when the previous step was not completed (an empty
 * one too); KVS_ENOMEM (nothing changed) when requests added during the previous step left no room. */
KVS_API kvs_result kvs_sched_step(kvs_sched *sched, kvs_step *out);
/* The forward pass of `step` is done: computed tokens are committed (full blocks registered and, in
 * eager mode, offered to the lower tiers), slots advance. A device pool with an event callback that
 * finds no memory for a commit's events registers nothing: the step completes all the same (KVS_OK), the
 * commit is retried at each later complete and once more before the request's blocks go back, and
 * kvs_sched_stats counts it (commits_deferred; blocks_not_registered when that last try fails too). */
KVS_API kvs_result kvs_sched_complete(kvs_sched *sched, const kvs_step *step);
/* Tokens the engine sampled for a decoding request (appended to its sequence at the next step; the
 * device pool sees them when they fill a block or need a new one). A request that reaches max_new_tokens
 * finishes; KVS_EINVAL for more tokens than it has left, KVS_ETOOBIG when the request would outgrow the
 * device pool (or 2^32 - 1 tokens), or when n exceeds the step's token budget (max_tokens: the next step
 * computes all n at once) and the request goes on. */
KVS_API kvs_result kvs_sched_append(kvs_sched *sched, uint64_t request, const uint32_t *tokens, size_t n);
/* End a request normally (e.g. end of sequence): Finishing -> Finished, blocks released (they stay
 * cached). */
KVS_API kvs_result kvs_sched_finish(kvs_sched *sched, uint64_t request);
/* End a request in any state: cancels its transfers, releases its blocks. A load the backend already
 * copies cannot be called back (it writes device blocks): finish and abort wait for it (as long as the
 * backend takes), then release. */
KVS_API kvs_result kvs_sched_abort(kvs_sched *sched, uint64_t request);
/* Forget a Finished request (its slot info stays readable until then). */
KVS_API kvs_result kvs_sched_release(kvs_sched *sched, uint64_t request);
KVS_API kvs_result kvs_sched_get_slot(kvs_sched *sched, uint64_t request, kvs_slot_info *out);
KVS_API kvs_result kvs_sched_get_stats(kvs_sched *sched, kvs_sched_stats *out);
/* 1 when nothing is waiting, running, swapped or onboarding. */
KVS_API int kvs_sched_idle(kvs_sched *sched);
/* The scheduler's connector (NULL without tiers). */
KVS_API kvs_connector *kvs_sched_connector(kvs_sched *sched);

/* ---- observability: events, bus, recorder, log, replay, hooks, console, metrics (section 8) ------ */

#define KVS_EVENT_VERSION 1
#define KVS_RECORD_BYTES 84         /* one event in a log or on the console socket: 80 bytes + CRC-32C */
#define KVS_LOG_HEADER_BYTES 16

typedef enum kvs_event_kind {
    /* decisions: what replay compares */
    KVS_EV_SLOT = 1,          /* a slot changed state (from 0 when the request was added) */
    KVS_EV_ADMIT,             /* a request was admitted: its prompt and cache hits */
    KVS_EV_STEP,              /* a step was planned: its summary */
    /* cache and transfers (pools and pipelines publish them through the adapters below) */
    KVS_EV_BLOCK_STORED,
    KVS_EV_BLOCK_REMOVED,
    KVS_EV_BLOCK_CLEARED,
    KVS_EV_TRANSFER,          /* a transfer changed stage */
    KVS_EV_TIERS,             /* occupancy of each tier, once per step */
    /* inputs: the scheduler calls, enough to replay a run */
    KVS_EV_ADD,               /* kvs_sched_add: its extra keys and prompt follow in TOKENS events */
    KVS_EV_TOKENS,            /* words of the ADD or APPEND just before */
    KVS_EV_RUN_STEP,          /* kvs_sched_step */
    KVS_EV_COMPLETE,          /* kvs_sched_complete */
    KVS_EV_APPEND,            /* kvs_sched_append: its tokens follow in TOKENS events */
    KVS_EV_FINISH,
    KVS_EV_ABORT,
    KVS_EV_RELEASE,
    /* debugging */
    KVS_EV_PAUSED,            /* a thread stopped at a breakpoint or a pause */
    KVS_EV_RESUMED,
    KVS_EV__COUNT
} kvs_event_kind;

#define KVS_EV_MASK(kind) (1ull << (kind))
#define KVS_EV_DECISIONS (KVS_EV_MASK(KVS_EV_SLOT) | KVS_EV_MASK(KVS_EV_ADMIT) | KVS_EV_MASK(KVS_EV_STEP))

/* Transfer stages (from kvo_status): PendingEvaluation (a policy decides), Promoted (queued for the
 * copy, or copying), then one of Skipped (nothing needed copying: refused, present or gone), Completed,
 * Cancelled, Failed. */
typedef enum kvs_transfer_stage {
    KVS_XFER_PENDING = 1,
    KVS_XFER_PROMOTED,
    KVS_XFER_SKIPPED,
    KVS_XFER_COMPLETED,
    KVS_XFER_CANCELLED,
    KVS_XFER_FAILED
} kvs_transfer_stage;

/* Entry points that hooks and breakpoints see. */
typedef enum kvs_call {
    KVS_CALL_ADD = 1, KVS_CALL_STEP, KVS_CALL_COMPLETE, KVS_CALL_APPEND, KVS_CALL_FINISH, KVS_CALL_ABORT,
    KVS_CALL_RELEASE,
    KVS_CALL_GET_NUM_NEW_MATCHED_TOKENS, KVS_CALL_UPDATE_STATE_AFTER_ALLOC, KVS_CALL_NOTE_REGISTERED,
    KVS_CALL_BUILD_META, KVS_CALL_UPDATE_OUTPUT, KVS_CALL_REQUEST_FINISHED, KVS_CALL_BIND_META,
    KVS_CALL_START_LOADS, KVS_CALL_START_STORES, KVS_CALL_GET_FINISHED, KVS_CALL_RELEASE_LOADS,
    KVS_CALL__COUNT
} kvs_call;

/* One event: 80 bytes, fixed layout, every field fixed-width (see the table in section 8). Unused
 * fields are zero. The binary form (log, console socket) is these bytes, little-endian, + CRC-32C. */
typedef struct kvs_event {
    uint64_t seq;             /* position in the bus's stream, from 1 */
    uint64_t time_ns;         /* the bus's clock */
    uint64_t request;         /* 0 when the event is not about one request */
    uint16_t kind;            /* kvs_event_kind */
    uint16_t version;         /* KVS_EVENT_VERSION */
    uint32_t reserved;
    union {
        struct { uint32_t from, to; uint64_t tokens, computed; } slot;           /* kvs_slot_state */
        struct { uint64_t prompt_tokens, device_hit_tokens, lower_hit_tokens; int32_t priority;
                 uint32_t preemptions; } admit;
        struct { uint64_t step; uint32_t prefill, decode, tokens, preempted, waiting, running, swapped,
                 onboarding, device_used, device_blocks; } step;
        struct { uint32_t tier, tokens; kvb_hash hash, parent; } block;          /* STORED/REMOVED/CLEARED */
        struct { uint64_t transfer; uint32_t stage, src_tier, dst_tier, blocks, moved; int32_t error;
                 uint32_t onboard; } transfer;                                   /* moved: copied blocks */
        struct { uint32_t num_tiers, used[4], total[4];
                 uint32_t policies, device_step, device_tails; } tiers; /* policies: tier t's kvb_evict_policy
                                                                             in bits 8t..8t+7 */
        struct { uint64_t num_prompt, salt; uint32_t max_new_tokens; int32_t priority;
                 uint32_t num_extra; } add;
        struct { uint32_t n, words[11]; } tokens;                                /* ADD: extra keys (lo, hi) then prompt */
        struct { uint64_t step; } run;                                           /* RUN_STEP (id to be), COMPLETE */
        struct { uint64_t n; uint32_t words[10]; } append;                      /* the first 10 tokens */
        struct { uint32_t call, state, finished; } pause;                        /* where: a call or a slot state */
        uint8_t raw[48];
    } u;
} kvs_event;

/* "slot", "admit", ... / "PendingEvaluation", ... / "sched_step", ... Thread safety: pure functions. */
KVS_API const char *kvs_event_kind_name(kvs_event_kind kind);
KVS_API const char *kvs_transfer_stage_name(kvs_transfer_stage stage);
KVS_API const char *kvs_call_name(kvs_call call);

/* Binary form: out gets KVS_RECORD_BYTES. decode: KVS_ELOG when the CRC, kind or version is wrong. */
KVS_API kvs_result kvs_event_encode(const kvs_event *event, unsigned char *out);
KVS_API kvs_result kvs_event_decode(const unsigned char *in, kvs_event *out);
/* One JSON object on one line, fields named per kind (section 8). KVS_ENOSPACE (with *out_len = the
 * bytes needed, NUL excluded) when cap is too small; buf is then unchanged. */
KVS_API kvs_result kvs_event_to_json(const kvs_event *event, char *buf, size_t cap, size_t *out_len);
/* Parses what kvs_event_to_json writes. KVS_EINVAL for anything else. */
KVS_API kvs_result kvs_event_from_json(const char *json, kvs_event *out);

/* ---- bus: any number of subscribers; publishing never waits for a reader ---- */

typedef uint64_t (*kvs_clock_fn)(void *user);           /* nanoseconds */
typedef void (*kvs_event_fn)(void *user, const kvs_event *event);
/* will-call (finished = 0, result = 0) and finished-call hooks around the entry points. */
typedef void (*kvs_hook_fn)(void *user, kvs_call call, int finished, uint64_t request, int result);

typedef struct kvs_bus_config {
    kvs_clock_fn clock;       /* default CLOCK_MONOTONIC; a fake clock makes time_ns deterministic */
    void *clock_user;
} kvs_bus_config;

typedef struct kvs_reader kvs_reader;

/* config may be NULL. Thread safety: every kvs_bus_ and kvs_reader_ function, any thread. */
KVS_API kvs_result kvs_bus_create(const kvs_bus_config *config, kvs_bus **out);
/* After everything publishing to it is destroyed (schedulers, pools, pipelines, recorders, consoles),
 * and with no kvs_reader_ call in progress on another thread (readers left open are detached: they give
 * what they hold, and kvs_reader_close still frees them). */
KVS_API void kvs_bus_destroy(kvs_bus *bus);
/* Stamps seq, time_ns and version, then hands the event to every subscriber of its kind. */
KVS_API kvs_result kvs_bus_publish(kvs_bus *bus, kvs_event *event);
/* A callback, run in the publishing thread with the bus's lock held: it must be quick and must not
 * call kvs_bus_ functions. kinds: a mask of KVS_EV_MASK(kind), 0 = all. */
KVS_API kvs_result kvs_bus_subscribe(kvs_bus *bus, uint64_t kinds, kvs_event_fn fn, void *user, uint32_t *out_id);
KVS_API kvs_result kvs_bus_unsubscribe(kvs_bus *bus, uint32_t id);
/* A ring of `capacity` events (default 4096) read at the reader's pace: when it is full the oldest
 * event is dropped and counted. */
KVS_API kvs_result kvs_reader_open(kvs_bus *bus, uint64_t kinds, uint32_t capacity, kvs_reader **out);
KVS_API void kvs_reader_close(kvs_reader *reader);
/* Up to max events, oldest first; *out_lost (may be NULL) = events dropped since the last read. */
KVS_API kvs_result kvs_reader_read(kvs_reader *reader, kvs_event *out, size_t max, size_t *out_n, uint64_t *out_lost);
/* kvb_pool_config.on_events = kvs_bus_pool_events, .event_user = bus: block stored / removed / cleared. */
KVS_API void kvs_bus_pool_events(const kvb_event *events, size_t n, void *bus);
/* kvo_pipeline_config.on_stage = kvs_bus_transfer_stage, .stage_user = bus (also in a manager's template). */
KVS_API void kvs_bus_transfer_stage(void *bus, const kvo_stage_note *note);

/* ---- hooks and breakpoints ---- */

typedef struct kvs_breakpoint {
    kvs_call call;            /* 0 = any call; with a state: a transition within this scheduler call */
    kvs_slot_state state;     /* 0 = any; else stops when a slot enters this state */
    uint64_t request;         /* 0 = any request */
} kvs_breakpoint;             /* all zero is KVS_EINVAL: use kvs_bus_pause */

typedef struct kvs_pause_info {
    kvs_call call;            /* 0 when stopped at a slot transition */
    kvs_slot_state state;     /* the state entered (transition stops) */
    uint64_t request;
} kvs_pause_info;

/* One hook (NULL removes it). Returns once no call of the old hook is in progress on another thread, so
 * its user data may go then; not from within a hook. */
KVS_API kvs_result kvs_bus_set_hook(kvs_bus *bus, kvs_hook_fn fn, void *user);
KVS_API kvs_result kvs_bus_break_add(kvs_bus *bus, const kvs_breakpoint *bp, uint32_t *out_id);
/* id 0 removes all. KVS_ENOTFOUND for an unknown id. */
KVS_API kvs_result kvs_bus_break_remove(kvs_bus *bus, uint32_t id);
/* The next thread to reach a call or a slot transition stops there. */
KVS_API kvs_result kvs_bus_pause(kvs_bus *bus);
/* Lets every stopped thread go on (two may be stopped: a connector's two sides), and cancels a pause
 * not reached yet. */
KVS_API kvs_result kvs_bus_resume(kvs_bus *bus);
/* Wait until a thread is stopped; KVS_ETIMEDOUT after timeout_us (negative: no limit). out may be NULL. */
KVS_API kvs_result kvs_bus_wait_paused(kvs_bus *bus, int64_t timeout_us, kvs_pause_info *out);
/* 1 when a thread is stopped now (and where, when out is not NULL). */
KVS_API int kvs_bus_paused(kvs_bus *bus, kvs_pause_info *out);

/* ---- recorder and log file ---- */

typedef struct kvs_recorder_config {
    uint32_t capacity;        /* events kept in memory, default 65536 */
    uint64_t kinds;           /* 0 = all */
    const char *log_path;     /* optional: append-only log (created or truncated) */
} kvs_recorder_config;

typedef struct kvs_recorder kvs_recorder;

/* KVS_EIO when the log cannot be created. Thread safety: any thread. */
KVS_API kvs_result kvs_recorder_create(kvs_bus *bus, const kvs_recorder_config *config, kvs_recorder **out);
/* Unsubscribes, flushes and closes the log. */
KVS_API void kvs_recorder_destroy(kvs_recorder *recorder);
/* The timeline kept, oldest first, without consuming it: up to max events into out (out may be NULL
 * to ask *out_n = how many are kept); *out_dropped (may be NULL) = events that no longer fit. */
KVS_API kvs_result kvs_recorder_snapshot(kvs_recorder *recorder, kvs_event *out, size_t max, size_t *out_n,
                                         uint64_t *out_dropped);
/* Writes buffered records to the log file. KVS_EIO once a write has failed (at this flush and every
 * later one: the log stops there). kvs_recorder_destroy cannot report one: flush before it. */
KVS_API kvs_result kvs_recorder_flush(kvs_recorder *recorder);

typedef struct kvs_log_report {
    size_t records;           /* complete, valid records read */
    uint64_t damaged_at;      /* byte offset of the first bad record (0 when none) */
    int truncated;            /* the last record is cut short */
    int corrupt;              /* a record fails its CRC (or kind / version) */
} kvs_log_report;

/* Read a log: *out (free with kvs_log_free) gets every valid record before any damage. KVS_ELOG when
 * the file is damaged (the report says where and how; the records before it are still returned),
 * KVS_EIO when it cannot be read (a read that fails part way too: nothing is returned) or is not a log. */
KVS_API kvs_result kvs_log_read(const char *path, kvs_event **out, size_t *out_n, kvs_log_report *report);
KVS_API void kvs_log_free(kvs_event *events);

/* ---- replay ---- */

typedef struct kvs_replay_report {
    uint64_t inputs;          /* calls replayed */
    uint64_t compared;        /* decisions that matched */
    uint64_t mismatch_seq;    /* recorded seq of the first decision that differs, 0 when none */
    kvs_event expected, got;  /* at the mismatch (got.kind == 0: the fresh run made no such decision) */
} kvs_replay_report;

/* Feed the inputs of a recorded run into `fresh` (a new scheduler created on `bus` with the same
 * configuration, pools and tiers) and compare its decisions (kinds of compare_kinds, 0 =
 * KVS_EV_DECISIONS; input kinds, ADD .. RELEASE, are what is replayed and are not compared: naming only
 * them is KVS_EINVAL) with the recorded ones, event by event (time and seq aside; request ids mapped in
 * order of addition). KVS_OK when identical, KVS_EREPLAY at the first difference (report says which),
 * KVS_ENOMEM when the replay, or an add or append of the fresh scheduler, ran out of memory (the report
 * counts what was replayed and compared until then); memory the fresh scheduler does without (a request
 * that waits, a swap recomputed) changes its decisions: KVS_EREPLAY. */
KVS_API kvs_result kvs_replay(kvs_sched *fresh, kvs_bus *bus, const kvs_event *events, size_t n,
                              uint64_t compare_kinds, kvs_replay_report *report);

/* ---- console: what examples/kvtop attaches to ---- */

typedef struct kvs_console_config {
    const char *path;         /* required: the Unix socket to create (mode 0600; an old socket there is replaced) */
    uint32_t history;         /* events a new client gets first, default 8192 */
} kvs_console_config;

typedef struct kvs_console kvs_console;

/* Starts a thread serving the socket. KVS_EIO when the socket cannot be created, KVS_ENOMEM out of
 * memory; a start that fails before it binds leaves an old socket at the path as it was. */
KVS_API kvs_result kvs_console_start(kvs_bus *bus, const kvs_console_config *config, kvs_console **out);
/* Stops the thread, disconnects clients, removes the socket (unless another console has replaced it).
 * A pause or breakpoints a client set stay on the bus (as they do when a client leaves): the engine's
 * threads stop there until kvs_bus_resume / kvs_bus_break_remove. */
KVS_API void kvs_console_stop(kvs_console *console);

/* ---- metrics ---- */

/* Prometheus text exposition (version 0.0.4) of the scheduler's counters and its pools' and pipelines'
 * (prefix kvcache_, labels tier / direction; tier is a pool's place in the scheduler's chain: 0 the
 * device, then each down pipeline's destination, whatever kvb_pool_config.tier says); disk (optional)
 * adds its checksum and I/O errors. NUL-terminated; *out_len = its length without the NUL. KVS_ENOSPACE when cap < *out_len + 1, buf left
 * untouched (counters move: the next call may need a little more). The counters are read once per call,
 * so the text written is always whole, however other threads move them meanwhile. Thread safety: the
 * scheduler's thread (pools and pipelines may count from theirs). */
KVS_API kvs_result kvs_metrics_write(kvs_sched *sched, kvo_backend *disk, char *buf, size_t cap, size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif /* KVSCHED_H */

/* ================================================================================================ */
/*                                        IMPLEMENTATION                                            */
/* ================================================================================================ */
#if (defined(KVSCHED_IMPLEMENTATION) || defined(KVCACHE_IMPLEMENTATION)) && !defined(KVCACHE__POSIX_MISSING)
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
    kvb_result r;
    if (!out_block_tokens || !out_layout) return KVS_EINVAL;
    if (model == KVS_MODEL_LLAMA3_8B) r = kvb_layout_for_model(kind, 16, 32, 8, 128, 2, out_layout);
    else if (model == KVS_MODEL_TINY) r = kvb_layout_for_model(kind, 16, 2, 4, 16, 4, out_layout);
    else return KVS_EINVAL;
    if (r == KVB_OK) *out_block_tokens = 16; /* a refused preset writes nothing */
    return (kvs_result)r;
}

KVS_API uint32_t kvs_blocks_for_bytes(const kvb_layout *layout, uint64_t bytes)
{
    uint64_t block, n, layers, parts;
    if (!layout || !layout->page_bytes) return 0;
    layers = layout->num_layers ? layout->num_layers : 1;
    parts = layout->num_parts ? layout->num_parts : 2;
    if (layout->page_bytes > UINT64_MAX / layers / parts) return 0; /* a block larger than any budget (the product wrapped) */
    block = layout->page_bytes * layers * parts;
    n = bytes / block;
    return n > INT32_MAX ? (uint32_t)INT32_MAX : (uint32_t)n;
}

/* ---- id map ------------------------------------------------------------------------------------- */

/* A map from a 64-bit id (request, transfer) to a pointer, NULL = absent: open addressing on a
 * multiplicative hash, backward-shift deletion; it grows (at two thirds full) and never shrinks, so a
 * steady state allocates nothing, and a lookup is one probe with no byte hashing. */
typedef struct kvs__idslot { uint64_t key; void *val; } kvs__idslot;
typedef struct kvs__idmap { kvs__idslot *e; uint64_t mask; size_t used; } kvs__idmap;

static uint64_t kvs__id_home(const kvs__idmap *m, uint64_t key)
{
    return ((key * UINT64_C(0x9e3779b97f4a7c15)) >> 29) & m->mask;
}

static uint64_t kvs__id_slot(const kvs__idmap *m, uint64_t key)
{
    uint64_t s = kvs__id_home(m, key);
    while (m->e[s].val && m->e[s].key != key) s = (s + 1) & m->mask;
    return s;
}

static void *kvs__id_get(const kvs__idmap *m, uint64_t key)
{
    return m->used ? m->e[kvs__id_slot(m, key)].val : NULL;
}

/* Room for one more key without growing. 0 when out of memory (nothing changed). */
static int kvs__id_room(kvs__idmap *m)
{
    kvs__idmap g;
    uint64_t n, i;
    if (m->e && (m->used + 1) * 3 < (m->mask + 1) * 2) return 1;
    n = m->e ? (m->mask + 1) * 2 : 64;
    g.e = (kvs__idslot *)KVB_MALLOC((size_t)n * sizeof *g.e);
    if (!g.e) return 0;
    memset(g.e, 0, (size_t)n * sizeof *g.e);
    g.mask = n - 1;
    g.used = m->used;
    for (i = 0; m->e && i <= m->mask; i++)
        if (m->e[i].val) g.e[kvs__id_slot(&g, m->e[i].key)] = m->e[i];
    KVB_FREE(m->e);
    *m = g;
    return 1;
}

/* key -> val (val not NULL). 0 when out of memory (nothing changed). */
static int kvs__id_put(kvs__idmap *m, uint64_t key, void *val)
{
    uint64_t s;
    if (!kvs__id_room(m)) return 0;
    s = kvs__id_slot(m, key);
    if (!m->e[s].val) m->used++;
    m->e[s].key = key;
    m->e[s].val = val;
    return 1;
}

/* Remove key; returns its value (NULL when absent). */
static void *kvs__id_del(kvs__idmap *m, uint64_t key)
{
    uint64_t i, j, k;
    void *val;
    if (!m->used) return NULL;
    i = j = kvs__id_slot(m, key);
    if (!(val = m->e[i].val)) return NULL;
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->e[j].val) break;
        k = kvs__id_home(m, m->e[j].key);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        m->e[i] = m->e[j];
        i = j;
    }
    m->e[i].val = NULL;
    m->used--;
    return val;
}

static void kvs__id_clear(kvs__idmap *m)
{
    if (m->used) memset(m->e, 0, (size_t)(m->mask + 1) * sizeof *m->e);
    m->used = 0;
}

static void kvs__id_free(kvs__idmap *m)
{
    KVB_FREE(m->e);
    memset(m, 0, sizeof *m);
}

/* ---- events: names, binary form, JSON ----------------------------------------------------------- */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#if defined(__cplusplus)
static_assert(sizeof(kvs_event) == 80, "kvs_event is 80 bytes");
#else
_Static_assert(sizeof(kvs_event) == 80, "kvs_event is 80 bytes");
#endif

KVS_API const char *kvs_event_kind_name(kvs_event_kind kind)
{
    static const char *names[] = {"?", "slot", "admit", "step", "block_stored", "block_removed", "block_cleared",
                                  "transfer", "tiers", "add", "tokens", "run_step", "complete", "append",
                                  "finish", "abort", "release", "paused", "resumed"};
    return (unsigned)kind < KVS_EV__COUNT ? names[kind] : "?";
}

KVS_API const char *kvs_transfer_stage_name(kvs_transfer_stage stage)
{
    static const char *names[] = {"?", "PendingEvaluation", "Promoted", "Skipped", "Completed", "Cancelled", "Failed"};
    return (unsigned)stage <= KVS_XFER_FAILED ? names[stage] : "?";
}

KVS_API const char *kvs_call_name(kvs_call call)
{
    static const char *names[] = {"?", "sched_add", "sched_step", "sched_complete", "sched_append", "sched_finish",
                                  "sched_abort", "sched_release", "get_num_new_matched_tokens",
                                  "update_state_after_alloc", "note_registered", "build_meta", "update_output",
                                  "request_finished", "bind_meta", "start_loads", "start_stores", "get_finished",
                                  "release_loads"};
    return (unsigned)call < KVS_CALL__COUNT ? names[call] : "?";
}

/* CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), a byte at a time; the x86-64 crc32
 * instruction does 8 bytes in one when the CPU has it (every x86-64 since 2008), found at run time. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVS__HW_CRC 1
__attribute__((target("sse4.2"))) static uint32_t kvs__crc32c_hw(const unsigned char *p, size_t n)
{
    unsigned long long c = 0xffffffffu;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned long long w;
        memcpy(&w, p + i, 8);
        c = __builtin_ia32_crc32di(c, w);
    }
    for (; i < n; i++) c = __builtin_ia32_crc32qi((unsigned)c, p[i]);
    return ~(uint32_t)c;
}
#endif

static uint32_t kvs__crc32c_sw(const unsigned char *p, size_t n)
{
    static const uint32_t t[256] = {
        0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu, 0x26a1e7e8u, 0xd4ca64ebu,
        0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu, 0x4d43cfd0u, 0xbf284cd3u, 0xac78bf27u, 0x5e133c24u,
        0x105ec76fu, 0xe235446cu, 0xf165b798u, 0x030e349bu, 0xd7c45070u, 0x25afd373u, 0x36ff2087u, 0xc494a384u,
        0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u, 0x5d1d08bfu, 0xaf768bbcu, 0xbc267848u, 0x4e4dfb4bu,
        0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u, 0x33ed7d2au, 0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u,
        0xaa64d611u, 0x580f5512u, 0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau,
        0x30e349b1u, 0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu, 0x1642ae59u, 0xe4292d5au,
        0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au, 0x7da08661u, 0x8fcb0562u, 0x9c9bf696u, 0x6ef07595u,
        0x417b1dbcu, 0xb3109ebfu, 0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u, 0x67dafa54u, 0x95b17957u,
        0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu, 0xfe53516fu, 0xed03a29bu, 0x1f682198u,
        0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u, 0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u,
        0xdbfc821cu, 0x2997011fu, 0x3ac7f2ebu, 0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u,
        0x61c69362u, 0x93ad1061u, 0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu, 0x4767748au, 0xb50cf789u,
        0xeb1fcbadu, 0x197448aeu, 0x0a24bb5au, 0xf84f3859u, 0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u,
        0x7198540du, 0x83f3d70eu, 0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u, 0xa55230e6u,
        0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu, 0xdde0eb2au, 0x2f8b6829u,
        0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu, 0x456cac67u, 0xb7072f64u, 0xa457dc90u, 0x563c5f93u,
        0x082f63b7u, 0xfa44e0b4u, 0xe9141340u, 0x1b7f9043u, 0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu,
        0x92a8fc17u, 0x60c37f14u, 0x73938ce0u, 0x81f80fe3u, 0x55326b08u, 0xa759e80bu, 0xb4091bffu, 0x466298fcu,
        0x1871a4d8u, 0xea1a27dbu, 0xf94ad42fu, 0x0b21572cu, 0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u,
        0xa24bb5a6u, 0x502036a5u, 0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
        0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u, 0x0e330a81u, 0xfc588982u,
        0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du, 0x758fe5d6u, 0x87e466d5u, 0x94b49521u, 0x66df1622u,
        0x38cc2a06u, 0xcaa7a905u, 0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u, 0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu,
        0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u, 0x0417b1dbu, 0xf67c32d8u, 0xe52cc12cu, 0x1747422fu,
        0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu, 0x5a048dffu, 0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u,
        0xd3d3e1abu, 0x21b862a8u, 0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u,
        0x590ab964u, 0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u, 0x7fab5e8cu, 0x8dc0dd8fu,
        0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu, 0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u, 0x37faccf1u,
        0x69e9f0d5u, 0x9b8273d6u, 0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u, 0x4f48173du, 0xbd23943eu,
        0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au, 0xc69f7b69u, 0xd5cf889du, 0x27a40b9eu,
        0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu, 0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u};
    uint32_t c = 0xffffffffu;
    size_t i;
    for (i = 0; i < n; i++) c = (c >> 8) ^ t[(c ^ p[i]) & 0xff];
    return ~c;
}

static uint32_t kvs__crc32c(const unsigned char *p, size_t n)
{
#ifdef KVS__HW_CRC
    if (__builtin_cpu_supports("sse4.2")) return kvs__crc32c_hw(p, n);
#endif
    return kvs__crc32c_sw(p, n);
}

static void kvs__put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static uint32_t kvs__get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

KVS_API kvs_result kvs_event_encode(const kvs_event *event, unsigned char *out)
{
    if (!event || !out) return KVS_EINVAL;
    memcpy(out, event, sizeof *event);
    kvs__put32(out + sizeof *event, kvs__crc32c(out, sizeof *event));
    return KVS_OK;
}

KVS_API kvs_result kvs_event_decode(const unsigned char *in, kvs_event *out)
{
    kvs_event e;
    if (!in || !out) return KVS_EINVAL;
    if (kvs__crc32c(in, sizeof e) != kvs__get32(in + sizeof e)) return KVS_ELOG;
    memcpy(&e, in, sizeof e);
    if (!e.kind || e.kind >= KVS_EV__COUNT || e.version != KVS_EVENT_VERSION) return KVS_ELOG;
    *out = e;
    return KVS_OK;
}

/* JSON: every kind names its fields; a table drives both the writer and the parser. */
typedef enum kvs__ftype { KVS__F_U32, KVS__F_I32, KVS__F_U64, KVS__F_STATE, KVS__F_STAGE, KVS__F_CALL,
                          KVS__F_HASH, KVS__F_WORDS, KVS__F_ARR4, KVS__F_APPEND_WORDS } kvs__ftype;
typedef struct kvs__field { unsigned char kind; unsigned char type; unsigned short offset; const char *name; } kvs__field;

#define KVS__F(kind, type, member, name) {kind, type, (unsigned short)offsetof(kvs_event, u.member), name}
static const kvs__field kvs__fields[] = {
    KVS__F(KVS_EV_SLOT, KVS__F_STATE, slot.from, "from"), KVS__F(KVS_EV_SLOT, KVS__F_STATE, slot.to, "to"),
    KVS__F(KVS_EV_SLOT, KVS__F_U64, slot.tokens, "tokens"), KVS__F(KVS_EV_SLOT, KVS__F_U64, slot.computed, "computed"),
    KVS__F(KVS_EV_ADMIT, KVS__F_U64, admit.prompt_tokens, "prompt_tokens"),
    KVS__F(KVS_EV_ADMIT, KVS__F_U64, admit.device_hit_tokens, "device_hit_tokens"),
    KVS__F(KVS_EV_ADMIT, KVS__F_U64, admit.lower_hit_tokens, "lower_hit_tokens"),
    KVS__F(KVS_EV_ADMIT, KVS__F_I32, admit.priority, "priority"),
    KVS__F(KVS_EV_ADMIT, KVS__F_U32, admit.preemptions, "preemptions"),
    KVS__F(KVS_EV_STEP, KVS__F_U64, step.step, "step"), KVS__F(KVS_EV_STEP, KVS__F_U32, step.prefill, "prefill"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.decode, "decode"), KVS__F(KVS_EV_STEP, KVS__F_U32, step.tokens, "tokens"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.preempted, "preempted"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.waiting, "waiting"), KVS__F(KVS_EV_STEP, KVS__F_U32, step.running, "running"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.swapped, "swapped"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.onboarding, "onboarding"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.device_used, "device_used"),
    KVS__F(KVS_EV_STEP, KVS__F_U32, step.device_blocks, "device_blocks"),
    KVS__F(KVS_EV_BLOCK_STORED, KVS__F_U32, block.tier, "tier"),
    KVS__F(KVS_EV_BLOCK_STORED, KVS__F_U32, block.tokens, "tokens"),
    KVS__F(KVS_EV_BLOCK_STORED, KVS__F_HASH, block.hash, "hash"),
    KVS__F(KVS_EV_BLOCK_STORED, KVS__F_HASH, block.parent, "parent"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_U64, transfer.transfer, "transfer"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_STAGE, transfer.stage, "stage"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_U32, transfer.src_tier, "src_tier"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_U32, transfer.dst_tier, "dst_tier"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_U32, transfer.blocks, "blocks"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_U32, transfer.moved, "moved"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_I32, transfer.error, "error"),
    KVS__F(KVS_EV_TRANSFER, KVS__F_U32, transfer.onboard, "onboard"),
    KVS__F(KVS_EV_TIERS, KVS__F_U32, tiers.num_tiers, "num_tiers"),
    KVS__F(KVS_EV_TIERS, KVS__F_ARR4, tiers.used, "used"), KVS__F(KVS_EV_TIERS, KVS__F_ARR4, tiers.total, "total"),
    KVS__F(KVS_EV_TIERS, KVS__F_U32, tiers.policies, "policies"),
    KVS__F(KVS_EV_TIERS, KVS__F_U32, tiers.device_step, "device_step"),
    KVS__F(KVS_EV_TIERS, KVS__F_U32, tiers.device_tails, "device_tails"),
    KVS__F(KVS_EV_ADD, KVS__F_U64, add.num_prompt, "num_prompt"), KVS__F(KVS_EV_ADD, KVS__F_U64, add.salt, "salt"),
    KVS__F(KVS_EV_ADD, KVS__F_U32, add.max_new_tokens, "max_new_tokens"),
    KVS__F(KVS_EV_ADD, KVS__F_I32, add.priority, "priority"),
    KVS__F(KVS_EV_ADD, KVS__F_U32, add.num_extra, "num_extra"),
    KVS__F(KVS_EV_TOKENS, KVS__F_WORDS, tokens, "words"),
    KVS__F(KVS_EV_RUN_STEP, KVS__F_U64, run.step, "step"), KVS__F(KVS_EV_COMPLETE, KVS__F_U64, run.step, "step"),
    KVS__F(KVS_EV_APPEND, KVS__F_U64, append.n, "n"),
    KVS__F(KVS_EV_APPEND, KVS__F_APPEND_WORDS, append.words, "words"),
    KVS__F(KVS_EV_PAUSED, KVS__F_CALL, pause.call, "call"), KVS__F(KVS_EV_PAUSED, KVS__F_STATE, pause.state, "state"),
    KVS__F(KVS_EV_PAUSED, KVS__F_U32, pause.finished, "finished"),
    KVS__F(KVS_EV_RESUMED, KVS__F_CALL, pause.call, "call"), KVS__F(KVS_EV_RESUMED, KVS__F_STATE, pause.state, "state"),
    KVS__F(KVS_EV_RESUMED, KVS__F_U32, pause.finished, "finished")};
#undef KVS__F

/* The three block kinds share one payload. */
static int kvs__fields_of(uint16_t kind, uint16_t field_kind)
{
    if (kind == KVS_EV_BLOCK_REMOVED || kind == KVS_EV_BLOCK_CLEARED) kind = KVS_EV_BLOCK_STORED;
    return kind == field_kind;
}

typedef struct kvs__text { char *buf; size_t cap, len; } kvs__text;

/* printf into the text; past cap it only counts, so the caller learns the size it needs. */
static void kvs__printf(kvs__text *t, const char *fmt, ...)
{
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(t->len < t->cap ? t->buf + t->len : NULL, t->len < t->cap ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (n > 0) t->len += (size_t)n;
}

static void kvs__json_field(kvs__text *t, const kvs_event *e, const kvs__field *f)
{
    const unsigned char *p = (const unsigned char *)e + f->offset;
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    size_t i;
    memcpy(&u32, p, 4);
    kvs__printf(t, ",\"%s\":", f->name);
    switch ((kvs__ftype)f->type) {
    case KVS__F_U32: kvs__printf(t, "%u", u32); break;
    case KVS__F_I32: memcpy(&i32, p, 4); kvs__printf(t, "%d", i32); break;
    case KVS__F_U64: memcpy(&u64, p, 8); kvs__printf(t, "%llu", (unsigned long long)u64); break;
    case KVS__F_STATE: kvs__printf(t, "\"%s\"", u32 ? kvs_slot_state_name((kvs_slot_state)u32) : ""); break;
    case KVS__F_STAGE: kvs__printf(t, "\"%s\"", kvs_transfer_stage_name((kvs_transfer_stage)u32)); break;
    case KVS__F_CALL: kvs__printf(t, "\"%s\"", u32 ? kvs_call_name((kvs_call)u32) : ""); break;
    case KVS__F_HASH: {
        kvb_hash h;
        memcpy(&h, p, sizeof h);
        kvs__printf(t, "\"%016llx%016llx\"", (unsigned long long)h.hi, (unsigned long long)h.lo);
        break;
    }
    case KVS__F_WORDS:
        kvs__printf(t, "[");
        for (i = 0; i < e->u.tokens.n && i < 11; i++) kvs__printf(t, "%s%u", i ? "," : "", e->u.tokens.words[i]);
        kvs__printf(t, "]");
        break;
    case KVS__F_APPEND_WORDS:
        kvs__printf(t, "[");
        for (i = 0; i < e->u.append.n && i < 10; i++) kvs__printf(t, "%s%u", i ? "," : "", e->u.append.words[i]);
        kvs__printf(t, "]");
        break;
    case KVS__F_ARR4:
        kvs__printf(t, "[");
        for (i = 0; i < 4; i++) {
            memcpy(&u32, p + 4 * i, 4);
            kvs__printf(t, "%s%u", i ? "," : "", u32);
        }
        kvs__printf(t, "]");
        break;
    }
}

KVS_API kvs_result kvs_event_to_json(const kvs_event *event, char *buf, size_t cap, size_t *out_len)
{
    kvs__text t;
    char small[1];
    size_t i;
    if (!event || (!buf && cap) || !out_len || !event->kind || event->kind >= KVS_EV__COUNT) return KVS_EINVAL;
    t.buf = small; /* measure first: a short buffer is left untouched */
    t.cap = 0;
    t.len = 0;
    for (i = 0; i < 2; i++) {
        size_t f;
        kvs__printf(&t, "{\"v\":%u,\"seq\":%llu,\"t_ns\":%llu,\"kind\":\"%s\",\"request\":%llu", event->version,
                    (unsigned long long)event->seq, (unsigned long long)event->time_ns,
                    kvs_event_kind_name((kvs_event_kind)event->kind), (unsigned long long)event->request);
        for (f = 0; f < sizeof kvs__fields / sizeof kvs__fields[0]; f++)
            if (kvs__fields_of(event->kind, kvs__fields[f].kind)) kvs__json_field(&t, event, &kvs__fields[f]);
        kvs__printf(&t, "}");
        *out_len = t.len;
        if (i == 0 && t.len + 1 > cap) return KVS_ENOSPACE;
        t.buf = buf;
        t.cap = cap;
        t.len = 0;
    }
    return KVS_OK;
}

/* The parser reads the flat objects written above: keys, then a number, a string or an array of
 * numbers. */
typedef struct kvs__jval {
    char key[24];
    int is_str, is_arr;
    char str[40];
    uint64_t num;
    int neg;
    uint64_t arr[11];
    size_t n_arr;
} kvs__jval;

static const char *kvs__skip(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    return p;
}

static const char *kvs__jstring(const char *p, char *out, size_t cap)
{
    size_t n = 0;
    if (*p++ != '"') return NULL;
    while (*p && *p != '"') {
        if (*p == '\\' || n + 1 >= cap) return NULL;
        out[n++] = *p++;
    }
    if (*p != '"') return NULL;
    out[n] = 0;
    return p + 1;
}

static const char *kvs__jnumber(const char *p, uint64_t *out, int *neg)
{
    uint64_t v = 0;
    *neg = *p == '-';
    if (*neg) p++;
    if (*p < '0' || *p > '9') return NULL;
    while (*p >= '0' && *p <= '9') {
        if (v > (UINT64_MAX - (uint64_t)(*p - '0')) / 10) return NULL;
        v = v * 10 + (uint64_t)(*p++ - '0');
    }
    *out = v;
    return p;
}

static const char *kvs__jvalue(const char *p, kvs__jval *v)
{
    p = kvs__skip(p);
    if (*p == '"') return (v->is_str = 1, kvs__jstring(p, v->str, sizeof v->str));
    if (*p != '[') return kvs__jnumber(p, &v->num, &v->neg);
    v->is_arr = 1;
    p = kvs__skip(p + 1);
    if (*p == ']') return p + 1;
    for (;;) {
        int neg;
        if (v->n_arr >= 11 || !(p = kvs__jnumber(kvs__skip(p), &v->arr[v->n_arr++], &neg)) || neg) return NULL;
        p = kvs__skip(p);
        if (*p == ']') return p + 1;
        if (*p++ != ',') return NULL;
    }
}

static int kvs__name_index(const char *s, const char *(*name)(int), int count)
{
    int i;
    if (!*s) return 0;
    for (i = 1; i < count; i++)
        if (strcmp(s, name(i)) == 0) return i;
    return -1;
}

static const char *kvs__state_name_i(int i) { return kvs_slot_state_name((kvs_slot_state)i); }
static const char *kvs__stage_name_i(int i) { return kvs_transfer_stage_name((kvs_transfer_stage)i); }
static const char *kvs__call_name_i(int i) { return kvs_call_name((kvs_call)i); }
static const char *kvs__kind_name_i(int i) { return kvs_event_kind_name((kvs_event_kind)i); }

static int kvs__hex_hash(const char *s, kvb_hash *out)
{
    size_t i;
    uint64_t w[2] = {0, 0};
    if (strlen(s) != 32) return 0;
    for (i = 0; i < 32; i++) {
        int c = s[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return 0;
        w[i / 16] = w[i / 16] << 4 | (uint64_t)d;
    }
    out->hi = w[0];
    out->lo = w[1];
    return 1;
}

/* One parsed value into its field of the event. */
static int kvs__json_set(kvs_event *e, const kvs__field *f, const kvs__jval *v)
{
    unsigned char *p = (unsigned char *)e + f->offset;
    uint32_t u32;
    int32_t i32;
    int idx;
    size_t i;
    switch ((kvs__ftype)f->type) {
    case KVS__F_U32:
        if (v->is_str || v->is_arr || v->neg || v->num > UINT32_MAX) return 0;
        u32 = (uint32_t)v->num;
        memcpy(p, &u32, 4);
        return 1;
    case KVS__F_I32:
        if (v->is_str || v->is_arr || v->num > (v->neg ? 2147483648u : 2147483647u)) return 0;
        i32 = v->neg ? (int32_t)(-(int64_t)v->num) : (int32_t)v->num;
        memcpy(p, &i32, 4);
        return 1;
    case KVS__F_U64:
        if (v->is_str || v->is_arr || v->neg) return 0;
        memcpy(p, &v->num, 8);
        return 1;
    case KVS__F_STATE: case KVS__F_STAGE: case KVS__F_CALL:
        if (!v->is_str) return 0;
        idx = f->type == KVS__F_STATE ? kvs__name_index(v->str, kvs__state_name_i, KVS_SLOT__COUNT)
              : f->type == KVS__F_STAGE ? kvs__name_index(v->str, kvs__stage_name_i, KVS_XFER_FAILED + 1)
                                        : kvs__name_index(v->str, kvs__call_name_i, KVS_CALL__COUNT);
        if (idx < 0) return 0;
        u32 = (uint32_t)idx;
        memcpy(p, &u32, 4);
        return 1;
    case KVS__F_HASH: {
        kvb_hash h;
        if (!v->is_str || !kvs__hex_hash(v->str, &h)) return 0;
        memcpy(p, &h, sizeof h);
        return 1;
    }
    case KVS__F_WORDS:
        if (!v->is_arr) return 0;
        e->u.tokens.n = (uint32_t)v->n_arr;
        for (i = 0; i < v->n_arr; i++) {
            if (v->arr[i] > UINT32_MAX) return 0;
            e->u.tokens.words[i] = (uint32_t)v->arr[i];
        }
        return 1;
    case KVS__F_APPEND_WORDS: /* their count is checked against n once n is known */
        if (!v->is_arr || v->n_arr > 10) return 0;
        for (i = 0; i < v->n_arr; i++) {
            if (v->arr[i] > UINT32_MAX) return 0;
            e->u.append.words[i] = (uint32_t)v->arr[i];
        }
        return 1;
    case KVS__F_ARR4:
        if (!v->is_arr || v->n_arr != 4) return 0;
        for (i = 0; i < 4; i++) {
            if (v->arr[i] > UINT32_MAX) return 0;
            u32 = (uint32_t)v->arr[i];
            memcpy(p + 4 * i, &u32, 4);
        }
        return 1;
    }
    return 0;
}

static int kvs__json_common(kvs_event *e, const kvs__jval *v)
{
    int idx;
    if (v->is_arr || (v->is_str != (strcmp(v->key, "kind") == 0)) || v->neg) return 0;
    if (strcmp(v->key, "v") == 0 && v->num <= 0xffff) e->version = (uint16_t)v->num;
    else if (strcmp(v->key, "seq") == 0) e->seq = v->num;
    else if (strcmp(v->key, "t_ns") == 0) e->time_ns = v->num;
    else if (strcmp(v->key, "request") == 0) e->request = v->num;
    else if (strcmp(v->key, "kind") == 0 && (idx = kvs__name_index(v->str, kvs__kind_name_i, KVS_EV__COUNT)) > 0)
        e->kind = (uint16_t)idx;
    else return 0;
    return 1;
}

KVS_API kvs_result kvs_event_from_json(const char *json, kvs_event *out)
{
    kvs__jval vals[40];
    size_t n = 0, i, f;
    kvs_event e;
    const char *p;
    if (!json || !out) return KVS_EINVAL;
    p = kvs__skip(json);
    if (*p++ != '{') return KVS_EINVAL;
    for (;;) { /* collect key/value pairs; the kind decides what the others mean */
        p = kvs__skip(p);
        if (n >= sizeof vals / sizeof vals[0]) return KVS_EINVAL;
        memset(&vals[n], 0, sizeof vals[n]);
        if (!(p = kvs__jstring(p, vals[n].key, sizeof vals[n].key))) return KVS_EINVAL;
        for (i = 0; i < n; i++) /* a key twice is not something the writer writes */
            if (strcmp(vals[i].key, vals[n].key) == 0) return KVS_EINVAL;
        p = kvs__skip(p);
        if (*p++ != ':' || !(p = kvs__jvalue(p, &vals[n]))) return KVS_EINVAL;
        n++;
        p = kvs__skip(p);
        if (*p == '}') break;
        if (*p++ != ',') return KVS_EINVAL;
    }
    if (*kvs__skip(p + 1)) return KVS_EINVAL;
    memset(&e, 0, sizeof e);
    for (i = 0; i < n; i++) { /* the common fields first */
        if (strcmp(vals[i].key, "kind") == 0 && !kvs__json_common(&e, &vals[i])) return KVS_EINVAL;
    }
    if (!e.kind) return KVS_EINVAL;
    for (i = 0; i < n; i++) {
        int done = 0;
        if (strcmp(vals[i].key, "kind") == 0) continue;
        for (f = 0; f < sizeof kvs__fields / sizeof kvs__fields[0] && !done; f++)
            if (kvs__fields_of(e.kind, kvs__fields[f].kind) && strcmp(kvs__fields[f].name, vals[i].key) == 0) {
                if (!kvs__json_set(&e, &kvs__fields[f], &vals[i])) return KVS_EINVAL;
                done = 1;
            }
        if (!done && !kvs__json_common(&e, &vals[i])) return KVS_EINVAL;
    }
    if (e.kind == KVS_EV_APPEND) { /* as the writer writes it: min(n, 10) words */
        size_t words = 0;
        for (i = 0; i < n; i++)
            if (strcmp(vals[i].key, "words") == 0) words = vals[i].n_arr;
        if (words != (e.u.append.n < 10 ? e.u.append.n : 10)) return KVS_EINVAL;
    }
    *out = e;
    return KVS_OK;
}

/* ---- bus ---------------------------------------------------------------------------------------- */

typedef struct kvs__sub { uint32_t id; uint64_t kinds; kvs_event_fn fn; void *user; } kvs__sub;

/* The last `cap` events: when full, a new one pushes out the oldest, counted in `dropped`. Readers,
 * the recorder and the console's history are all one of these. */
typedef struct kvs__ring {
    kvs_event *ev;
    uint32_t cap, head, count;   /* oldest at head */
    uint64_t dropped;
} kvs__ring;

static int kvs__ring_init(kvs__ring *r, uint32_t cap)
{
    memset(r, 0, sizeof *r);
    r->cap = cap;
    r->ev = (kvs_event *)KVB_MALLOC((size_t)cap * sizeof *r->ev);
    return r->ev != NULL;
}

static void kvs__ring_put(kvs__ring *r, const kvs_event *e)
{
    if (r->count == r->cap) {
        r->head = (r->head + 1) % r->cap;
        r->count--;
        r->dropped++;
    }
    r->ev[(r->head + r->count) % r->cap] = *e;
    r->count++;
}

/* The i-th oldest event kept. */
static const kvs_event *kvs__ring_at(const kvs__ring *r, uint32_t i) { return &r->ev[(r->head + i) % r->cap]; }

struct kvs_reader {
    kvs_bus *bus;
    uint64_t kinds;
    kvs__ring ring;              /* ring.dropped: lost since the last read */
};

struct kvs_bus {
    kvs_bus_config cfg;
    pthread_mutex_t lock;
    pthread_cond_t cond;         /* a thread stopped, or resume */
    uint64_t seq;
    uint64_t wanted;             /* kinds some subscriber takes: read without the lock */
    uint32_t next_id;
    kvs__sub *subs;              /* stb_ds */
    kvs_reader **readers;        /* stb_ds */
    int armed;                   /* hook, breakpoints or a pause pending: read without the lock */
    kvs_hook_fn hook;
    void *hook_user;
    uint32_t hook_calls;         /* calls of the current hook in progress */
    uint32_t old_hook_calls;     /* calls of hooks replaced since in progress (cond: signalled at 0) */
    uint64_t hook_gen;           /* hooks set so far: tells a call of the current hook from an older one */
    kvs_breakpoint *bps;         /* stb_ds */
    uint32_t *bp_ids;            /* stb_ds, parallel to bps */
    int pause_pending;
    uint32_t stopped;            /* threads stopped now (resume sets 0, before they wake) */
    uint64_t resumes;            /* resume generation */
    kvs_pause_info where;
};

/* What a scheduler or connector reads when it has no bus: a constant zero, so the check before a hook
 * is one load and one predictable branch either way. */
static const int kvs__unarmed = 0;

static int kvs__is_armed(const int *armed) { return __atomic_load_n(armed, __ATOMIC_ACQUIRE); }

/* Whether an event of this kind would reach anyone: the scheduler builds none that would not. */
static int kvs__wants(const kvs_bus *b, kvs_event_kind kind)
{
    return b && (__atomic_load_n(&b->wanted, __ATOMIC_ACQUIRE) & KVS_EV_MASK(kind));
}

/* Locked: the union of the subscribers' kinds. */
static void kvs__rewant(kvs_bus *b)
{
    uint64_t w = 0;
    size_t i;
    for (i = 0; i < stbds_arrlenu(b->subs); i++) w |= b->subs[i].kinds ? b->subs[i].kinds : ~0ull;
    for (i = 0; i < stbds_arrlenu(b->readers); i++) w |= b->readers[i]->kinds ? b->readers[i]->kinds : ~0ull;
    __atomic_store_n(&b->wanted, w, __ATOMIC_RELEASE);
}

static uint64_t kvs__now_ns(const kvs_bus *b)
{
    struct timespec ts;
    if (b->cfg.clock) return b->cfg.clock(b->cfg.clock_user);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

KVS_API kvs_result kvs_bus_create(const kvs_bus_config *config, kvs_bus **out)
{
    kvs_bus *b;
    if (!out) return KVS_EINVAL;
    b = (kvs_bus *)KVB_MALLOC(sizeof *b);
    if (!b) return KVS_ENOMEM;
    memset(b, 0, sizeof *b);
    if (config) b->cfg = *config;
    if (pthread_mutex_init(&b->lock, NULL) != 0) {
        KVB_FREE(b);
        return KVS_ENOMEM;
    }
    if (kvo__cond_init(&b->cond) != 0) {
        pthread_mutex_destroy(&b->lock);
        KVB_FREE(b);
        return KVS_ENOMEM;
    }
    b->next_id = 1;
    *out = b;
    return KVS_OK;
}

KVS_API void kvs_bus_destroy(kvs_bus *bus)
{
    size_t i;
    if (!bus) return;
    for (i = 0; i < stbds_arrlenu(bus->readers); i++) bus->readers[i]->bus = NULL;
    stbds_arrfree(bus->subs);
    stbds_arrfree(bus->readers);
    stbds_arrfree(bus->bps);
    stbds_arrfree(bus->bp_ids);
    pthread_cond_destroy(&bus->cond);
    pthread_mutex_destroy(&bus->lock);
    KVB_FREE(bus);
}

/* Locked. */
static void kvs__publish_locked(kvs_bus *b, kvs_event *e)
{
    size_t i;
    uint64_t bit = KVS_EV_MASK(e->kind);
    e->seq = ++b->seq;
    e->time_ns = kvs__now_ns(b);
    e->version = KVS_EVENT_VERSION;
    for (i = 0; i < stbds_arrlenu(b->subs); i++)
        if (!b->subs[i].kinds || (b->subs[i].kinds & bit)) b->subs[i].fn(b->subs[i].user, e);
    for (i = 0; i < stbds_arrlenu(b->readers); i++)
        if (!b->readers[i]->kinds || (b->readers[i]->kinds & bit)) kvs__ring_put(&b->readers[i]->ring, e);
}

KVS_API kvs_result kvs_bus_publish(kvs_bus *bus, kvs_event *event)
{
    if (!bus || !event || !event->kind || event->kind >= KVS_EV__COUNT) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    kvs__publish_locked(bus, event);
    pthread_mutex_unlock(&bus->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_bus_subscribe(kvs_bus *bus, uint64_t kinds, kvs_event_fn fn, void *user, uint32_t *out_id)
{
    kvs__sub s;
    if (!bus || !fn) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    if (!kvo__fit(&bus->subs, stbds_arrlenu(bus->subs) + 1)) {
        pthread_mutex_unlock(&bus->lock);
        return KVS_ENOMEM;
    }
    s.id = bus->next_id++;
    s.kinds = kinds;
    s.fn = fn;
    s.user = user;
    stbds_arrput(bus->subs, s);
    kvs__rewant(bus);
    pthread_mutex_unlock(&bus->lock);
    if (out_id) *out_id = s.id;
    return KVS_OK;
}

KVS_API kvs_result kvs_bus_unsubscribe(kvs_bus *bus, uint32_t id)
{
    size_t i;
    kvs_result r = KVS_ENOTFOUND;
    if (!bus) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    for (i = 0; i < stbds_arrlenu(bus->subs); i++)
        if (bus->subs[i].id == id) {
            stbds_arrdel(bus->subs, i);
            r = KVS_OK;
            break;
        }
    kvs__rewant(bus);
    pthread_mutex_unlock(&bus->lock);
    return r;
}

KVS_API kvs_result kvs_reader_open(kvs_bus *bus, uint64_t kinds, uint32_t capacity, kvs_reader **out)
{
    kvs_reader *r;
    if (!bus || !out) return KVS_EINVAL;
    if (!capacity) capacity = 4096;
    r = (kvs_reader *)KVB_MALLOC(sizeof *r);
    if (!r) return KVS_ENOMEM;
    memset(r, 0, sizeof *r);
    if (!kvs__ring_init(&r->ring, capacity)) {
        KVB_FREE(r);
        return KVS_ENOMEM;
    }
    r->bus = bus;
    r->kinds = kinds;
    pthread_mutex_lock(&bus->lock);
    if (!kvo__fit(&bus->readers, stbds_arrlenu(bus->readers) + 1)) {
        pthread_mutex_unlock(&bus->lock);
        KVB_FREE(r->ring.ev);
        KVB_FREE(r);
        return KVS_ENOMEM;
    }
    stbds_arrput(bus->readers, r);
    kvs__rewant(bus);
    pthread_mutex_unlock(&bus->lock);
    *out = r;
    return KVS_OK;
}

KVS_API void kvs_reader_close(kvs_reader *reader)
{
    size_t i;
    if (!reader) return;
    if (reader->bus) {
        pthread_mutex_lock(&reader->bus->lock);
        for (i = 0; i < stbds_arrlenu(reader->bus->readers); i++)
            if (reader->bus->readers[i] == reader) {
                stbds_arrdelswap(reader->bus->readers, i);
                break;
            }
        kvs__rewant(reader->bus);
        pthread_mutex_unlock(&reader->bus->lock);
    }
    KVB_FREE(reader->ring.ev);
    KVB_FREE(reader);
}

KVS_API kvs_result kvs_reader_read(kvs_reader *reader, kvs_event *out, size_t max, size_t *out_n, uint64_t *out_lost)
{
    size_t n = 0;
    if (!reader || !out_n || (max && !out)) return KVS_EINVAL;
    if (reader->bus) pthread_mutex_lock(&reader->bus->lock);
    kvs__ring *ring = &reader->ring;
    for (; n < max && ring->count; n++) { /* consumed: the head moves on */
        out[n] = *kvs__ring_at(ring, 0);
        ring->head = (ring->head + 1) % ring->cap;
        ring->count--;
    }
    if (out_lost) *out_lost = ring->dropped;
    ring->dropped = 0; /* counted since the last read, whether that one asked or not */
    if (reader->bus) pthread_mutex_unlock(&reader->bus->lock);
    *out_n = n;
    return KVS_OK;
}

KVS_API void kvs_bus_pool_events(const kvb_event *events, size_t n, void *bus)
{
    kvs_bus *b = (kvs_bus *)bus;
    size_t i;
    if (!b || !events ||
        !(kvs__wants(b, KVS_EV_BLOCK_STORED) || kvs__wants(b, KVS_EV_BLOCK_REMOVED) || kvs__wants(b, KVS_EV_BLOCK_CLEARED)))
        return;
    pthread_mutex_lock(&b->lock);
    for (i = 0; i < n; i++) {
        kvs_event e;
        memset(&e, 0, sizeof e);
        e.kind = (uint16_t)(events[i].kind == KVB_EVENT_STORED    ? KVS_EV_BLOCK_STORED
                            : events[i].kind == KVB_EVENT_REMOVED ? KVS_EV_BLOCK_REMOVED
                                                                  : KVS_EV_BLOCK_CLEARED);
        e.u.block.tier = events[i].tier;
        e.u.block.tokens = events[i].num_tokens;
        e.u.block.hash = events[i].hash;
        e.u.block.parent = events[i].parent;
        kvs__publish_locked(b, &e);
    }
    pthread_mutex_unlock(&b->lock);
}

static kvs_transfer_stage kvs__stage_of(const kvo_transfer_info *info)
{
    switch (info->status) {
    case KVO_STATUS_EVALUATING: return KVS_XFER_PENDING;
    case KVO_STATUS_QUEUED: case KVO_STATUS_TRANSFERRING: return KVS_XFER_PROMOTED;
    case KVO_STATUS_COMPLETE: return info->transferred || info->failed ? KVS_XFER_COMPLETED : KVS_XFER_SKIPPED;
    case KVO_STATUS_CANCELLED: return KVS_XFER_CANCELLED;
    default: return KVS_XFER_FAILED;
    }
}

KVS_API void kvs_bus_transfer_stage(void *bus, const kvo_stage_note *note)
{
    kvs_event e;
    if (!kvs__wants((kvs_bus *)bus, KVS_EV_TRANSFER) || !note || !note->info) return;
    if (note->info->status == KVO_STATUS_TRANSFERRING) return; /* still Promoted */
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_TRANSFER;
    e.u.transfer.transfer = note->transfer.id;
    e.u.transfer.stage = kvs__stage_of(note->info);
    e.u.transfer.src_tier = note->src_tier;
    e.u.transfer.dst_tier = note->dst_tier;
    e.u.transfer.blocks = note->info->blocks;
    e.u.transfer.moved = note->info->transferred;
    e.u.transfer.error = note->info->error;
    e.u.transfer.onboard = (uint32_t)note->onboard;
    kvs_bus_publish((kvs_bus *)bus, &e);
}

/* ---- hooks and breakpoints ---------------------------------------------------------------------- */

/* Locked. */
static void kvs__rearm(kvs_bus *b)
{
    __atomic_store_n(&b->armed, b->hook || stbds_arrlen(b->bps) || b->pause_pending, __ATOMIC_RELEASE);
}

KVS_API kvs_result kvs_bus_set_hook(kvs_bus *bus, kvs_hook_fn fn, void *user)
{
    if (!bus) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    bus->hook = fn;
    bus->hook_user = user;
    bus->hook_gen++;
    bus->old_hook_calls += bus->hook_calls; /* the new hook's calls are not waited for: they never end */
    bus->hook_calls = 0;
    kvs__rearm(bus);
    while (bus->old_hook_calls) pthread_cond_wait(&bus->cond, &bus->lock); /* the old hook's user may go */
    pthread_mutex_unlock(&bus->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_bus_break_add(kvs_bus *bus, const kvs_breakpoint *bp, uint32_t *out_id)
{
    uint32_t id;
    if (!bus || !bp || (!bp->call && !bp->state && !bp->request) || (unsigned)bp->call >= KVS_CALL__COUNT ||
        (unsigned)bp->state >= KVS_SLOT__COUNT)
        return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    if (!kvo__fit(&bus->bps, stbds_arrlenu(bus->bps) + 1) || !kvo__fit(&bus->bp_ids, stbds_arrlenu(bus->bp_ids) + 1)) {
        pthread_mutex_unlock(&bus->lock);
        return KVS_ENOMEM;
    }
    id = bus->next_id++;
    stbds_arrput(bus->bps, *bp);
    stbds_arrput(bus->bp_ids, id);
    kvs__rearm(bus);
    pthread_mutex_unlock(&bus->lock);
    if (out_id) *out_id = id;
    return KVS_OK;
}

KVS_API kvs_result kvs_bus_break_remove(kvs_bus *bus, uint32_t id)
{
    size_t i;
    kvs_result r = id ? KVS_ENOTFOUND : KVS_OK;
    if (!bus) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    for (i = stbds_arrlenu(bus->bps); i-- > 0;)
        if (!id || bus->bp_ids[i] == id) {
            stbds_arrdel(bus->bps, i);
            stbds_arrdel(bus->bp_ids, i);
            r = KVS_OK;
        }
    kvs__rearm(bus);
    pthread_mutex_unlock(&bus->lock);
    return r;
}

KVS_API kvs_result kvs_bus_pause(kvs_bus *bus)
{
    if (!bus) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    bus->pause_pending = 1;
    kvs__rearm(bus);
    pthread_mutex_unlock(&bus->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_bus_resume(kvs_bus *bus)
{
    if (!bus) return KVS_EINVAL;
    pthread_mutex_lock(&bus->lock);
    bus->pause_pending = 0;
    kvs__rearm(bus);
    if (bus->stopped) { /* every stopped thread counts as going on now, before it wakes */
        bus->stopped = 0;
        bus->resumes++;
        pthread_cond_broadcast(&bus->cond);
    }
    pthread_mutex_unlock(&bus->lock);
    return KVS_OK;
}

KVS_API kvs_result kvs_bus_wait_paused(kvs_bus *bus, int64_t timeout_us, kvs_pause_info *out)
{
    struct timespec until;
    kvs_result r = KVS_OK;
    if (!bus) return KVS_EINVAL;
    until = kvo__deadline(timeout_us);
    pthread_mutex_lock(&bus->lock);
    while (!bus->stopped) {
        if (timeout_us < 0) {
            pthread_cond_wait(&bus->cond, &bus->lock);
        } else if (pthread_cond_timedwait(&bus->cond, &bus->lock, &until) == ETIMEDOUT && !bus->stopped) {
            r = KVS_ETIMEDOUT;
            break;
        }
    }
    if (r == KVS_OK && out) *out = bus->where;
    pthread_mutex_unlock(&bus->lock);
    return r;
}

KVS_API int kvs_bus_paused(kvs_bus *bus, kvs_pause_info *out)
{
    int stopped;
    if (!bus) return 0;
    pthread_mutex_lock(&bus->lock);
    stopped = bus->stopped > 0;
    if (stopped && out) *out = bus->where;
    pthread_mutex_unlock(&bus->lock);
    return stopped;
}

/* At a transition (at->call 0), a breakpoint naming a call and a state matches while the scheduler is in
 * that call (in_call); one naming a call and no state stops at the call only. */
static int kvs__bp_match(const kvs_breakpoint *bp, const kvs_pause_info *at, kvs_call in_call)
{
    kvs_call call = at->call ? at->call : bp->state ? in_call : (kvs_call)0;
    return (!bp->call || bp->call == call) && (!bp->state || bp->state == at->state) &&
           (!bp->request || bp->request == at->request);
}

/* A checkpoint: a call about to run (call != 0) or a slot entering a state (state != 0) during the
 * scheduler's call in_call. Stops the calling thread when a pause is pending or a breakpoint matches,
 * until kvs_bus_resume. */
static void kvs__checkpoint(kvs_bus *b, const kvs_pause_info *at, kvs_call in_call)
{
    size_t i;
    int stop;
    pthread_mutex_lock(&b->lock);
    stop = b->pause_pending;
    for (i = 0; i < stbds_arrlenu(b->bps) && !stop; i++) stop = kvs__bp_match(&b->bps[i], at, in_call);
    if (stop) {
        uint64_t gen = b->resumes;
        kvs_event e;
        memset(&e, 0, sizeof e);
        e.kind = KVS_EV_PAUSED;
        e.request = at->request;
        e.u.pause.call = (uint32_t)at->call;
        e.u.pause.state = (uint32_t)at->state;
        b->pause_pending = 0;
        kvs__rearm(b);
        b->where = *at;
        b->stopped++;
        kvs__publish_locked(b, &e);
        pthread_cond_broadcast(&b->cond);
        while (b->resumes == gen) pthread_cond_wait(&b->cond, &b->lock); /* resume cleared stopped */
        e.kind = KVS_EV_RESUMED;
        kvs__publish_locked(b, &e);
    }
    pthread_mutex_unlock(&b->lock);
}

static void kvs__hook(kvs_bus *b, kvs_call call, int finished, uint64_t request, int result)
{
    kvs_hook_fn fn;
    void *user;
    uint64_t gen;
    pthread_mutex_lock(&b->lock);
    fn = b->hook;
    user = b->hook_user;
    gen = b->hook_gen;
    if (fn) b->hook_calls++;
    pthread_mutex_unlock(&b->lock);
    if (!fn) return;
    fn(user, call, finished, request, result); /* no lock held: the hook may call kvs_bus_ functions */
    pthread_mutex_lock(&b->lock);
    if (gen == b->hook_gen) b->hook_calls--;
    else if (--b->old_hook_calls == 0) pthread_cond_broadcast(&b->cond); /* replaced meanwhile */
    pthread_mutex_unlock(&b->lock);
}

static void kvs__will_call(kvs_bus *b, kvs_call call, uint64_t request)
{
    kvs_pause_info at;
    kvs__hook(b, call, 0, request, 0);
    at.call = call;
    at.state = (kvs_slot_state)0;
    at.request = request;
    kvs__checkpoint(b, &at, (kvs_call)0);
}

/* The body of an entry point between its will-call and finished-call hooks when the bus is armed;
 * in_call (NULL for the connector's) names the call while it runs, for breakpoints on a call and a state. */
#define KVS__HOOKED(armed, bus, call, request, expr, in_call)        \
    do {                                                             \
        kvs_result hooked_r_;                                        \
        kvs_call *in_call_ = (in_call), outer_ = (kvs_call)0;       \
        if (!kvs__is_armed(armed)) return (expr);                    \
        kvs__will_call((bus), (call), (request));                    \
        if (in_call_) outer_ = *in_call_, *in_call_ = (call);        \
        hooked_r_ = (expr);                                          \
        if (in_call_) *in_call_ = outer_;                            \
        kvs__hook((bus), (call), 1, (request), (int)hooked_r_);      \
        return hooked_r_;                                            \
    } while (0)

/* ---- recorder and log --------------------------------------------------------------------------- */

static const char kvs__log_magic[8] = {'K', 'V', 'S', 'E', 'V', 'L', 'O', 'G'};

static void kvs__log_header(unsigned char *h)
{
    memcpy(h, kvs__log_magic, 8);
    kvs__put32(h + 8, KVS_EVENT_VERSION);
    kvs__put32(h + 12, KVS_RECORD_BYTES);
}

struct kvs_recorder {
    kvs_bus *bus;
    uint32_t sub;
    kvs__ring ring;
    FILE *log;
    int io_error;
};

/* Runs with the bus's lock held, which also guards the ring. */
static void kvs__record(void *user, const kvs_event *e)
{
    kvs_recorder *r = (kvs_recorder *)user;
    kvs__ring_put(&r->ring, e);
    if (r->log && !r->io_error) {
        unsigned char rec[KVS_RECORD_BYTES];
        kvs_event_encode(e, rec);
        if (fwrite(rec, sizeof rec, 1, r->log) != 1) r->io_error = 1;
    }
}

KVS_API kvs_result kvs_recorder_create(kvs_bus *bus, const kvs_recorder_config *config, kvs_recorder **out)
{
    kvs_recorder *r;
    kvs_result res;
    uint32_t cap = config && config->capacity ? config->capacity : 65536;
    if (!bus || !out) return KVS_EINVAL;
    r = (kvs_recorder *)KVB_MALLOC(sizeof *r);
    if (!r) return KVS_ENOMEM;
    memset(r, 0, sizeof *r);
    r->bus = bus;
    if (!kvs__ring_init(&r->ring, cap)) {
        KVB_FREE(r);
        return KVS_ENOMEM;
    }
    pthread_mutex_lock(&bus->lock); /* room for the subscription before the log is truncated */
    res = kvo__fit(&bus->subs, stbds_arrlenu(bus->subs) + 1) ? KVS_OK : KVS_ENOMEM;
    pthread_mutex_unlock(&bus->lock);
    if (res != KVS_OK) {
        KVB_FREE(r->ring.ev);
        KVB_FREE(r);
        return res;
    }
    if (config && config->log_path) {
        unsigned char h[KVS_LOG_HEADER_BYTES];
        kvs__log_header(h);
        /* flushed: a header that cannot be written (a full device) is a log that cannot be created */
        if (!(r->log = fopen(config->log_path, "wb")) || fwrite(h, sizeof h, 1, r->log) != 1 ||
            fflush(r->log) != 0) {
            if (r->log) fclose(r->log);
            KVB_FREE(r->ring.ev);
            KVB_FREE(r);
            return KVS_EIO;
        }
    }
    if ((res = kvs_bus_subscribe(bus, config ? config->kinds : 0, kvs__record, r, &r->sub)) != KVS_OK) {
        if (r->log) fclose(r->log);
        KVB_FREE(r->ring.ev);
        KVB_FREE(r);
        return res;
    }
    *out = r;
    return KVS_OK;
}

KVS_API void kvs_recorder_destroy(kvs_recorder *recorder)
{
    if (!recorder) return;
    kvs_bus_unsubscribe(recorder->bus, recorder->sub);
    if (recorder->log) fclose(recorder->log);
    KVB_FREE(recorder->ring.ev);
    KVB_FREE(recorder);
}

KVS_API kvs_result kvs_recorder_snapshot(kvs_recorder *recorder, kvs_event *out, size_t max, size_t *out_n,
                                         uint64_t *out_dropped)
{
    size_t n = 0;
    if (!recorder || !out_n || (max && !out)) return KVS_EINVAL;
    pthread_mutex_lock(&recorder->bus->lock);
    if (!out) n = recorder->ring.count;
    else
        for (; n < max && n < recorder->ring.count; n++) out[n] = *kvs__ring_at(&recorder->ring, (uint32_t)n);
    if (out_dropped) *out_dropped = recorder->ring.dropped;
    pthread_mutex_unlock(&recorder->bus->lock);
    *out_n = n;
    return KVS_OK;
}

KVS_API kvs_result kvs_recorder_flush(kvs_recorder *recorder)
{
    kvs_result r = KVS_OK;
    if (!recorder) return KVS_EINVAL;
    pthread_mutex_lock(&recorder->bus->lock);
    if (recorder->log && fflush(recorder->log) != 0) recorder->io_error = 1;
    if (recorder->io_error) r = KVS_EIO;
    pthread_mutex_unlock(&recorder->bus->lock);
    return r;
}

/* Tests: a seam between two records of kvs_log_read, where the file's reads can be made to fail. */
#ifndef KVS__LOG_BETWEEN_RECORDS
#define KVS__LOG_BETWEEN_RECORDS(f) ((void)(f))
#endif

KVS_API kvs_result kvs_log_read(const char *path, kvs_event **out, size_t *out_n, kvs_log_report *report)
{
    FILE *f;
    unsigned char h[KVS_LOG_HEADER_BYTES], want[KVS_LOG_HEADER_BYTES], rec[KVS_RECORD_BYTES];
    kvs_event *events = NULL, *copy;
    kvs_log_report rep;
    uint64_t at = KVS_LOG_HEADER_BYTES;
    size_t got;
    if (!path || !out || !out_n) return KVS_EINVAL;
    if (!(f = fopen(path, "rb"))) return KVS_EIO;
    kvs__log_header(want);
    if (fread(h, sizeof h, 1, f) != 1 || memcmp(h, want, sizeof h) != 0) {
        fclose(f);
        return KVS_EIO;
    }
    memset(&rep, 0, sizeof rep);
    while ((got = fread(rec, 1, sizeof rec, f)) > 0) {
        kvs_event e;
        if (got < sizeof rec) {
            rep.truncated = 1;
            rep.damaged_at = at;
            break;
        }
        if (kvs_event_decode(rec, &e) != KVS_OK) {
            rep.corrupt = 1;
            rep.damaged_at = at;
            break;
        }
        if (!kvo__fit(&events, stbds_arrlenu(events) + 1)) {
            fclose(f);
            stbds_arrfree(events);
            return KVS_ENOMEM;
        }
        stbds_arrput(events, e);
        at += sizeof rec;
        KVS__LOG_BETWEEN_RECORDS(f);
    }
    if (ferror(f)) { /* a read failed: not the end of the log, and not damage in it */
        fclose(f);
        stbds_arrfree(events);
        return KVS_EIO;
    }
    fclose(f);
    rep.records = stbds_arrlenu(events);
    copy = (kvs_event *)KVB_MALLOC((rep.records ? rep.records : 1) * sizeof *copy);
    if (!copy) {
        stbds_arrfree(events);
        return KVS_ENOMEM;
    }
    if (rep.records) memcpy(copy, events, rep.records * sizeof *events);
    stbds_arrfree(events);
    *out = copy;
    *out_n = rep.records;
    if (report) *report = rep;
    return rep.truncated || rep.corrupt ? KVS_ELOG : KVS_OK;
}

KVS_API void kvs_log_free(kvs_event *events) { KVB_FREE(events); }

/* ---- console ------------------------------------------------------------------------------------ */

typedef struct kvs__client {
    int fd;
    unsigned char *out;          /* stb_ds: bytes not sent yet */
    char line[256];
    size_t line_len;
    int overlong;                /* the line in progress outgrew `line`: dropped up to its newline */
} kvs__client;

/* The live slots: each request's last SLOT event (until it is released), in an array with a map from the
 * request to its place + 1. Both grow with a check: out of memory the console forgets them all, as when
 * its reader lost events (a client then sees slots from their next change on). */
typedef struct kvs__live_slots {
    kvs_event *last;             /* stb_ds */
    kvs__idmap at;
} kvs__live_slots;

#define KVS__CLIENT_BACKLOG (4u << 20) /* a client further behind than this skips events (seq shows the gap) */
#define KVS__ACCEPT_RETRY_US 100000    /* after a failed accept (out of descriptors): the next try */
#define KVS__PUMP_BATCHES 16           /* batches read per turn: then commands and clients get theirs */

struct kvs_console {
    kvs_bus *bus;
    kvs_reader *reader;
    char *path;
    int listen_fd, wake[2];
    int bound;                   /* path is a socket this console bound: sock_dev and sock_ino name it */
    dev_t sock_dev;
    ino_t sock_ino;
    uint64_t accept_after_us;    /* no accept before this (kvo__mono_us) */
    pthread_t thread;
    kvs__client *clients;        /* stb_ds */
    kvs__ring history;           /* the last cfg.history events */
    kvs__live_slots slots;
    kvs_event last_step, last_tiers, last_pause;
};

static void kvs__live_slots_forget(kvs__live_slots *l)
{
    stbds_arrfree(l->last);
    kvs__id_free(&l->at);
}

static void kvs__live_slot_put(kvs__live_slots *l, const kvs_event *e)
{
    size_t at = (size_t)(uintptr_t)kvs__id_get(&l->at, e->request), n = stbds_arrlenu(l->last);
    if (at) {
        l->last[at - 1] = *e;
    } else if (kvb__arr_fit((void **)&l->last, sizeof *l->last, n + 1) && kvs__id_room(&l->at)) {
        stbds_arrput(l->last, *e);
        kvs__id_put(&l->at, e->request, (void *)(uintptr_t)(n + 1));
    } else {
        kvs__live_slots_forget(l);
    }
}

/* A released request's slot goes, and the last one moves into its place. A refused release (the request
 * is not Finished) is published too: that slot lives on. */
static void kvs__live_slot_del(kvs__live_slots *l, uint64_t request)
{
    size_t at = (size_t)(uintptr_t)kvs__id_get(&l->at, request), last = stbds_arrlenu(l->last);
    if (!at || l->last[at - 1].u.slot.to != KVS_SLOT_FINISHED) return;
    (void)kvs__id_del(&l->at, request);
    if (at != last) {
        l->last[at - 1] = l->last[last - 1];
        kvs__id_put(&l->at, l->last[at - 1].request, (void *)(uintptr_t)at); /* replaces: no growth */
    }
    KVB__ARR_SHRINK(l->last, last - 1);
}

static void kvs__console_note(kvs_console *k, const kvs_event *e)
{
    kvs__ring_put(&k->history, e);
    if (e->kind == KVS_EV_SLOT) kvs__live_slot_put(&k->slots, e);
    else if (e->kind == KVS_EV_RELEASE) kvs__live_slot_del(&k->slots, e->request);
    else if (e->kind == KVS_EV_STEP) k->last_step = *e;
    else if (e->kind == KVS_EV_TIERS) k->last_tiers = *e;
    else if (e->kind == KVS_EV_PAUSED || e->kind == KVS_EV_RESUMED) k->last_pause = *e;
}

static void kvs__client_queue(kvs__client *c, const kvs_event *e)
{
    unsigned char rec[KVS_RECORD_BYTES];
    /* too far behind, or out of memory: it loses this one */
    if (stbds_arrlenu(c->out) >= KVS__CLIENT_BACKLOG || !kvo__fit(&c->out, stbds_arrlenu(c->out) + sizeof rec)) return;
    kvs_event_encode(e, rec);
    memcpy(stbds_arraddnptr(c->out, sizeof rec), rec, sizeof rec);
}

/* Send what the socket takes now; 0 when the client is gone. */
static int kvs__client_flush(kvs__client *c)
{
    size_t off = 0, len = stbds_arrlenu(c->out);
    while (off < len) {
        ssize_t n = send(c->fd, c->out + off, len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        return 0;
    }
    if (off) {
        memmove(c->out, c->out + off, len - off);
        KVB__ARR_SHRINK(c->out, len - off);
    }
    return 1;
}

/* A new client gets the header, the live slots, the last step / tiers / pause, then the history;
 * 0 when there is no memory for the header (the client is turned away). */
static int kvs__client_welcome(kvs_console *k, kvs__client *c)
{
    unsigned char h[KVS_LOG_HEADER_BYTES];
    ptrdiff_t i;
    uint32_t j;
    if (!kvo__fit(&c->out, sizeof h)) return 0;
    kvs__log_header(h);
    memcpy(stbds_arraddnptr(c->out, sizeof h), h, sizeof h);
    for (i = 0; i < (ptrdiff_t)stbds_arrlenu(k->slots.last); i++) kvs__client_queue(c, &k->slots.last[i]);
    if (k->last_step.kind) kvs__client_queue(c, &k->last_step);
    if (k->last_tiers.kind) kvs__client_queue(c, &k->last_tiers);
    if (k->last_pause.kind) kvs__client_queue(c, &k->last_pause);
    for (j = 0; j < k->history.count; j++) kvs__client_queue(c, kvs__ring_at(&k->history, j));
    return 1;
}

/* One command line from a client: pause, resume, break state|request|call X, clear. */
static void kvs__console_command(kvs_console *k, char *line)
{
    char what[32], arg[64];
    kvs_breakpoint bp;
    memset(&bp, 0, sizeof bp);
    if (strcmp(line, "pause") == 0) kvs_bus_pause(k->bus);
    else if (strcmp(line, "resume") == 0) kvs_bus_resume(k->bus);
    else if (strcmp(line, "clear") == 0) kvs_bus_break_remove(k->bus, 0);
    else if (sscanf(line, "break %31s %63s", what, arg) == 2) {
        if (strcmp(what, "state") == 0) bp.state = (kvs_slot_state)kvs__name_index(arg, kvs__state_name_i, KVS_SLOT__COUNT);
        else if (strcmp(what, "call") == 0) bp.call = (kvs_call)kvs__name_index(arg, kvs__call_name_i, KVS_CALL__COUNT);
        else if (strcmp(what, "request") == 0) bp.request = strtoull(arg, NULL, 10);
        if ((int)bp.state >= 0 && (int)bp.call >= 0) kvs_bus_break_add(k->bus, &bp, NULL);
    }
}

/* Reads a client's commands; 0 when it hung up. */
static int kvs__client_read(kvs_console *k, kvs__client *c)
{
    char buf[256];
    ssize_t n = recv(c->fd, buf, sizeof buf, MSG_DONTWAIT);
    ssize_t i;
    if (n == 0) return 0;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    for (i = 0; i < n; i++) {
        if (buf[i] == '\n') {
            c->line[c->line_len] = 0;
            if (c->line_len && c->line[c->line_len - 1] == '\r') c->line[c->line_len - 1] = 0;
            if (!c->overlong) kvs__console_command(k, c->line); /* no part of a longer line is a command */
            c->line_len = 0;
            c->overlong = 0;
        } else if (c->line_len + 1 >= sizeof c->line) {
            c->overlong = 1;
        } else {
            c->line[c->line_len++] = buf[i];
        }
    }
    return 1;
}

static void kvs__client_drop(kvs_console *k, size_t i)
{
    close(k->clients[i].fd);
    stbds_arrfree(k->clients[i].out);
    stbds_arrdelswap(k->clients, i);
}

/* New events, a batch at a time: to the model, to every client, and out as far as the sockets take.
 * At most KVS__PUMP_BATCHES: a bus published faster than that would keep the thread here for ever (its
 * reader loses what it cannot keep). Returns 1 when the last batch was full: more may be waiting. */
static int kvs__console_pump(kvs_console *k)
{
    kvs_event batch[256];
    size_t i, n;
    uint64_t lost = 0;
    int turns = 0;
    do {
        kvs_reader_read(k->reader, batch, sizeof batch / sizeof batch[0], &n, &lost);
        if (lost) kvs__live_slots_forget(&k->slots); /* a release may be among them: they cannot be told now */
        for (i = 0; i < n; i++) {
            size_t j;
            kvs__console_note(k, &batch[i]);
            for (j = 0; j < stbds_arrlenu(k->clients); j++) kvs__client_queue(&k->clients[j], &batch[i]);
        }
        for (i = stbds_arrlenu(k->clients); i-- > 0;)
            if (!kvs__client_flush(&k->clients[i])) kvs__client_drop(k, i);
    } while (n == sizeof batch / sizeof batch[0] && ++turns < KVS__PUMP_BATCHES);
    return n == sizeof batch / sizeof batch[0];
}

/* Stopping: what is published and queued still goes out, for up to a second. */
static void kvs__console_finish(kvs_console *k)
{
    uint64_t until = kvo__mono_us() + 1000000;
    size_t i;
    while (kvs__console_pump(k) && kvo__mono_us() < until) continue;
    for (;;) {
        size_t waiting = 0;
        for (i = stbds_arrlenu(k->clients); i-- > 0;) {
            if (!kvs__client_flush(&k->clients[i])) kvs__client_drop(k, i);
            else waiting += stbds_arrlen(k->clients[i].out) > 0;
        }
        if (!waiting || kvo__mono_us() >= until) return;
        poll(NULL, 0, 5);
    }
}

static void *kvs__console_main(void *arg)
{
    kvs_console *k = (kvs_console *)arg;
    int behind = 0; /* the last pump left events in the reader: poll without waiting */
    for (;;) {
        struct pollfd *fds = NULL;
        struct pollfd p;
        size_t i;
        int stop = 0;
        if (!kvo__fit(&fds, 2 + stbds_arrlenu(k->clients))) { /* out of memory: try again shortly, or stop */
            p.fd = k->wake[0];
            p.events = POLLIN;
            p.revents = 0;
            if (poll(&p, 1, 50) > 0 && p.revents) {
                kvs__console_finish(k);
                return NULL;
            }
            continue;
        }
        p.fd = k->wake[0];
        p.events = POLLIN;
        p.revents = 0;
        stbds_arrput(fds, p);
        p.fd = kvo__mono_us() < k->accept_after_us ? -1 : k->listen_fd; /* -1: poll skips it */
        stbds_arrput(fds, p);
        for (i = 0; i < stbds_arrlenu(k->clients); i++) {
            p.fd = k->clients[i].fd;
            p.events = (short)(POLLIN | (stbds_arrlen(k->clients[i].out) ? POLLOUT : 0));
            stbds_arrput(fds, p); /* within the room made */
        }
        poll(fds, (nfds_t)stbds_arrlenu(fds), behind ? 0 : 50);
        if (fds[0].revents) stop = 1;
        for (i = stbds_arrlenu(k->clients); i-- > 0;) /* commands and hang-ups (fds[i + 2] is client i) */
            if ((fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) && !kvs__client_read(k, &k->clients[i]))
                kvs__client_drop(k, i);
        if (fds[1].revents & POLLIN) {
            int fd = accept(k->listen_fd, NULL, NULL);
            if (fd >= 0) {
                kvs__client c;
                memset(&c, 0, sizeof c);
                c.fd = fd;
                fcntl(fd, F_SETFD, FD_CLOEXEC);
                if (kvo__fit(&k->clients, stbds_arrlenu(k->clients) + 1) && kvs__client_welcome(k, &c)) {
                    stbds_arrput(k->clients, c);
                } else { /* out of memory: turned away (it sees the connection close) */
                    stbds_arrfree(c.out);
                    close(fd);
                }
            } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
                /* out of descriptors or memory: the client stays queued, so the socket stays readable
                 * and trying again at once would spin; the clients attached are served meanwhile */
                k->accept_after_us = kvo__mono_us() + KVS__ACCEPT_RETRY_US;
            }
        }
        stbds_arrfree(fds);
        behind = kvs__console_pump(k);
        if (stop) {
            kvs__console_finish(k);
            return NULL;
        }
    }
}

/* The socket at k->path is still the one this console bound (another may have replaced it since). */
static int kvs__console_owns_path(const kvs_console *k)
{
    struct stat st;
    return k->bound && lstat(k->path, &st) == 0 && st.st_dev == k->sock_dev && st.st_ino == k->sock_ino;
}

KVS_API kvs_result kvs_console_start(kvs_bus *bus, const kvs_console_config *config, kvs_console **out)
{
    kvs_console *k;
    struct sockaddr_un addr;
    struct stat st;
    size_t len;
    kvs_result r = KVS_ENOMEM;
    if (!bus || !config || !config->path || !out) return KVS_EINVAL;
    len = strlen(config->path);
    if (!len || len >= sizeof addr.sun_path) return KVS_EINVAL;
    if (lstat(config->path, &st) == 0 && !S_ISSOCK(st.st_mode)) return KVS_EIO; /* never remove a file */
    k = (kvs_console *)KVB_MALLOC(sizeof *k);
    if (!k) return KVS_ENOMEM;
    memset(k, 0, sizeof *k);
    k->bus = bus;
    k->listen_fd = k->wake[0] = k->wake[1] = -1;
    /* all that can fail but the socket first: a start that fails leaves an old socket there */
    k->path = (char *)KVB_MALLOC(len + 1);
    if (!kvs__ring_init(&k->history, config->history ? config->history : 8192) || !k->path ||
        (r = kvs_reader_open(bus, 0, 65536, &k->reader)) != KVS_OK)
        goto fail;
    memcpy(k->path, config->path, len + 1);
    r = KVS_EIO;
    if (pipe(k->wake) != 0 || (k->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0) goto fail;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, config->path, len);
    unlink(config->path);
    /* bind, then 0600, then listen: nobody can connect before the mode is set */
    if (bind(k->listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0) goto fail;
    k->bound = lstat(config->path, &st) == 0;
    k->sock_dev = st.st_dev;
    k->sock_ino = st.st_ino;
    if (!k->bound || chmod(config->path, 0600) != 0 || listen(k->listen_fd, 8) != 0) goto fail;
    if (pthread_create(&k->thread, NULL, kvs__console_main, k) != 0) goto fail;
    *out = k;
    return KVS_OK;
fail:
    if (k->reader) kvs_reader_close(k->reader);
    if (k->listen_fd >= 0) close(k->listen_fd);
    if (k->path && kvs__console_owns_path(k)) unlink(k->path);
    if (k->wake[0] >= 0) close(k->wake[0]);
    if (k->wake[1] >= 0) close(k->wake[1]);
    KVB_FREE(k->history.ev);
    KVB_FREE(k->path);
    KVB_FREE(k);
    return r;
}

KVS_API void kvs_console_stop(kvs_console *console)
{
    if (!console) return;
    if (write(console->wake[1], "x", 1) < 0) { /* the thread also stops on its next poll of the pipe */ }
    pthread_join(console->thread, NULL);
    while (stbds_arrlen(console->clients)) kvs__client_drop(console, 0);
    stbds_arrfree(console->clients);
    kvs__live_slots_forget(&console->slots);
    kvs_reader_close(console->reader);
    close(console->listen_fd);
    close(console->wake[0]);
    close(console->wake[1]);
    if (kvs__console_owns_path(console)) unlink(console->path); /* not a newer console's */
    KVB_FREE(console->history.ev);
    KVB_FREE(console->path);
    KVB_FREE(console);
}

/* ---- connector ---------------------------------------------------------------------------------- */

typedef struct kvs__plan {    /* one request's lower-tier blocks, from the scheduler side */
    uint64_t request;
    kvb_hash *hashes;          /* stb_ds: the request's full-block hashes */
    kvs_load *runs;            /* stb_ds: planned runs (one tier each) */
    kvs_load *built;           /* stb_ds: runs given by build_meta and not started yet (each build repeats
                                * them, so a step's metadata never bound loses nothing) */
    int accepted;              /* update_state_after_alloc said how many */
    size_t computed;           /* num_computed of the question: the offer counts from it */
    size_t offered;            /* tokens get_num_new_matched_tokens offered */
    int async;                 /* the offer had blocks to load (*out_async = 1) */
    kvb_block *loaded;         /* stb_ds: device references kept after the loads */
    uint32_t loads_active;
    int consumed;              /* build_meta planned the take's loads: only a new question takes again */
    size_t room;               /* blocks each of its arrays has room for (kvs__plan_new); 0: not sized */
} kvs__plan;

typedef struct kvs__active_load { kvs_load load; kvo_transfer t; } kvs__active_load;
typedef struct kvs__active_store { uint64_t event, request; kvo_transfer t; int done; } kvs__active_store;

struct kvs_connector {
    kvs_connector_config cfg;
    const int *armed;          /* hooks or breakpoints on cfg.bus (kvs__unarmed without a bus) */
    pthread_mutex_t lock;
    uint32_t block_tokens;
    uint64_t next_event, step;
    kvs__plan *plans;          /* stb_ds */
    kvs__plan *spare_plans;    /* stb_ds: dropped plans, their arrays kept for the next */
    uint8_t *tier_of;          /* stb_ds scratch of get_num_new_matched_tokens (scheduler side) */
    kvb_block *got;            /* stb_ds scratch of kvs__load_over (worker side) */
    kvs_store *noted;          /* stores waiting for build_meta */
    kvs_store *built_stores;   /* stores given by build_meta and not started yet (each build repeats them) */
    kvs_load *meta_loads;      /* the last built meta */
    kvs_store *meta_stores;
    kvs_load *bound_loads;     /* the worker's copy */
    kvs_store *bound_stores;
    kvs__active_load *loads;
    kvs__active_store *stores;
    kvs__idmap offloaded;      /* transfer ids reported by the manager (a set: the value is the connector) */
    kvb_block *offer;          /* scratch of start_stores */
    uint64_t *fin_loads, *fin_stores;
};

static kvs__plan *kvs__plan_of(kvs_connector *c, uint64_t request)
{
    size_t i;
    for (i = 0; i < stbds_arrlenu(c->plans); i++)
        if (c->plans[i].request == request) return &c->plans[i];
    return NULL;
}

static void kvs__plan_free(kvs__plan *p)
{
    stbds_arrfree(p->loaded);
    stbds_arrfree(p->hashes);
    stbds_arrfree(p->runs);
    stbds_arrfree(p->built);
}

/* Pins given back (kvb_unpin: no use, each block its level). A list longer than any the pool has taken
 * before needs memory: without it, one block at a time (a single block needs none), the deepest first. */
static void kvs__unpin_all(kvb_pool *pool, const kvb_block *blocks, size_t n)
{
    if (n && kvb_unpin(pool, blocks, n) != KVB_OK)
        while (n-- > 0) (void)kvb_unpin(pool, &blocks[n], 1);
}

/* A plan is dropped with its device references; its arrays are kept for the next (kvs__plan_new), unless
 * they could not be given their room. Locked. */
static void kvs__plan_drop(kvs_connector *c, kvs__plan *p)
{
    size_t at = (size_t)(p - c->plans);
    /* held for the request, not used (its admission's match and release are): no use, each its level */
    kvs__unpin_all(c->cfg.device, p->loaded, stbds_arrlenu(p->loaded));
    KVB__ARR_SHRINK(p->loaded, 0);
    KVB__ARR_SHRINK(p->hashes, 0);
    KVB__ARR_SHRINK(p->runs, 0);
    KVB__ARR_SHRINK(p->built, 0);
    if (p->room && kvo__fit(&c->spare_plans, stbds_arrlenu(c->spare_plans) + 1)) stbds_arrput(c->spare_plans, *p);
    else kvs__plan_free(p);
    stbds_arrdelswap(c->plans, at);
}

/* An empty plan for `request` and n block hashes, not yet in c->plans, with room for n blocks in each
 * array (runs, built and loaded never hold more than its hashes): a dropped plan of n's class (room, a
 * power of two), else a new one. By class, as requests are (kvs__spare_for): which spare a plan gets never
 * decides what a later plan allocates (taken last in, first out, each spare grew as its own loads came
 * in, and had to meet the longest prompt before the steady state). Locked. */
static kvs__plan kvs__plan_new(kvs_connector *c, uint64_t request, size_t n)
{
    kvs__plan p;
    size_t i, room = 4;
    while (room < n) room *= 2;
    for (i = stbds_arrlenu(c->spare_plans); i-- > 0;)
        if (c->spare_plans[i].room == room) break;
    if (i != SIZE_MAX) {
        p = c->spare_plans[i];
        stbds_arrdelswap(c->spare_plans, i);
    } else {
        void *h = NULL, *runs = NULL, *built = NULL, *loaded = NULL;
        memset(&p, 0, sizeof p);
        /* out of memory: the arrays grow as they fill, and the plan is no spare of any class */
        if (kvb__arr_room(&h, sizeof *p.hashes, room) && kvb__arr_room(&runs, sizeof *p.runs, room) &&
            kvb__arr_room(&built, sizeof *p.built, room) && kvb__arr_room(&loaded, sizeof *p.loaded, room))
            p.room = room;
        p.hashes = (kvb_hash *)h, p.runs = (kvs_load *)runs, p.built = (kvs_load *)built, p.loaded = (kvb_block *)loaded;
    }
    p.request = request;
    p.accepted = 0;
    p.consumed = 0;
    p.computed = 0;
    p.offered = 0;
    p.async = 0;
    p.loads_active = 0;
    return p;
}

/* A G1 -> G2 transfer ended: recorded for get_finished, if one of the connector's stores still waits for
 * it. get_finished also takes a transfer it finds final or gone (kvs__offloaded): one that ended inside
 * the offer, before its store was listed, or whose record found no memory; so a record of a store
 * already reported would never be taken, and none is made. */
static void kvs__on_offloaded(void *user, uint32_t tier, kvo_transfer t, const kvo_transfer_info *info)
{
    kvs_connector *c = (kvs_connector *)user;
    size_t i;
    (void)info;
    if (tier != 0) return;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < stbds_arrlenu(c->stores); i++)
        if (!c->stores[i].done && c->stores[i].t.id == t.id) {
            (void)kvs__id_put(&c->offloaded, t.id, c); /* out of memory: get_finished sees it final */
            break;
        }
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
    kvo_manager_config mc;
    if (!config || !out || !config->device || !config->tiers || (unsigned)config->offload > KVS_OFFLOAD_LAZY ||
        !kvs__is_g1(config->tiers, config->device))
        return KVS_EINVAL;
    /* A lazy connector offers nothing, and an eager manager sends only what is offered: nothing would
     * ever go down. (An eager connector over a lazy manager works: the manager ignores the offers.) */
    if (kvo_manager_get_config(config->tiers, &mc) != KVO_OK || (config->offload == KVS_OFFLOAD_LAZY && mc.offload != KVO_OFFLOAD_LAZY))
        return KVS_EINVAL;
    c = (kvs_connector *)KVB_MALLOC(sizeof *c);
    if (!c) return KVS_ENOMEM;
    memset(c, 0, sizeof *c);
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        KVB_FREE(c);
        return KVS_ENOMEM;
    }
    c->cfg = *config;
    c->armed = config->bus ? &config->bus->armed : &kvs__unarmed;
    memset(&pc, 0, sizeof pc);
    kvb_pool_get_config(config->device, &pc);
    c->block_tokens = pc.block_tokens;
    c->next_event = 1;
    /* The manager tells one hook of its offloads: taking it from another connector (or the user) would
     * leave that one's stores pending for ever. Claimed, not checked then set: two connectors created at
     * once could both see none. Last, as the hook may be called at once. */
    if (kvo_manager_claim_offloaded(config->tiers, kvs__on_offloaded, c) != KVO_OK) {
        pthread_mutex_destroy(&c->lock);
        KVB_FREE(c);
        return KVS_EINVAL;
    }
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
    for (i = 0; i < stbds_arrlenu(c->spare_plans); i++) kvs__plan_free(&c->spare_plans[i]);
    stbds_arrfree(c->spare_plans);
    stbds_arrfree(c->tier_of);
    stbds_arrfree(c->got);
    stbds_arrfree(c->noted);
    stbds_arrfree(c->built_stores);
    stbds_arrfree(c->meta_loads);
    stbds_arrfree(c->meta_stores);
    stbds_arrfree(c->bound_loads);
    stbds_arrfree(c->bound_stores);
    stbds_arrfree(c->loads);
    stbds_arrfree(c->stores);
    stbds_arrfree(c->offer);
    kvs__id_free(&c->offloaded);
    stbds_arrfree(c->fin_loads);
    stbds_arrfree(c->fin_stores);
    pthread_mutex_destroy(&c->lock);
    KVB_FREE(c);
}

static kvs_result kvs__conn_get_num_new_matched_tokens(kvs_connector *c, uint64_t request,
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
    if (!kvo__fit(&c->tier_of, num_hashes)) return KVS_ENOMEM;
    KVB__ARR_SHRINK(c->tier_of, 0);
    tier_of = stbds_arraddnptr(c->tier_of, num_hashes);
    if (first >= num_hashes) { /* nothing after num_computed: no lookup, but the answer replaces the plan */
    } else if (c->cfg.lookup) {
        c->cfg.lookup(c->cfg.lookup_user, c->cfg.tiers, hashes, num_hashes, tier_of, &found);
    } else {
        kvo_manager_lookup(c->cfg.tiers, hashes, num_hashes, tier_of, &found);
    }
    pthread_mutex_lock(&c->lock);
    if ((p = kvs__plan_of(c, request)) != NULL && p->loads_active) { /* its loads are on their way: they end
                                                                       before the request asks again */
        pthread_mutex_unlock(&c->lock);
        return KVS_ESTATE;
    }
    if (found > first) { /* the new plan's room (a run, a built load and a loaded block per hash at most) */
        fresh = kvs__plan_new(c, request, num_hashes);
        if (!kvo__fit(&fresh.hashes, num_hashes) || !kvo__fit(&fresh.runs, num_hashes) ||
            !kvo__fit(&fresh.built, num_hashes) || !kvo__fit(&fresh.loaded, num_hashes) ||
            !kvo__fit(&c->plans, stbds_arrlenu(c->plans) + 1)) {
            kvs__plan_free(&fresh);
            pthread_mutex_unlock(&c->lock);
            return KVS_ENOMEM; /* the old plan stands */
        }
    }
    if ((p = kvs__plan_of(c, request)) != NULL) kvs__plan_drop(c, p); /* a new question replaces the plan */
    if (found > first) {
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
                stbds_arrput(fresh.runs, l); /* within the room made */
            }
        }
        fresh.computed = num_computed;
        fresh.offered = found * c->block_tokens - num_computed; /* from num_computed, not its block's start */
        fresh.async = stbds_arrlen(fresh.runs) > 0;
        stbds_arrput(c->plans, fresh);
        *out_tokens = fresh.offered;
        *out_async = fresh.async;
    }
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

static kvs_result kvs__conn_update_state_after_alloc(kvs_connector *c, uint64_t request,
                                                          size_t num_external_tokens)
{
    kvs__plan *p;
    kvs_result r = KVS_OK;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    p = kvs__plan_of(c, request);
    if (!p) {
        r = num_external_tokens ? KVS_ENOTFOUND : KVS_OK;
    } else if (p->loads_active) { /* taken already, its loads on their way */
        r = KVS_ESTATE;
    } else if (!num_external_tokens) {
        kvs__plan_drop(c, p);
    } else if (p->consumed) { /* its loads are done (or were computed instead): it keeps their blocks */
        r = KVS_ESTATE;
    } else if ((p->computed + num_external_tokens) % c->block_tokens || num_external_tokens > p->offered) {
        r = KVS_EINVAL; /* up to a block boundary, within what was offered */
    } else {
        /* the taken blocks end where the taken tokens do (runs skip those on the device already) */
        size_t keep_end = (p->computed + num_external_tokens) / c->block_tokens, i, w = 0;
        for (i = 0; i < stbds_arrlenu(p->runs); i++) { /* keep what lies before the accepted end */
            kvs_load *l = &p->runs[i];
            if (l->first_block >= keep_end) continue;
            if (l->first_block + l->num_blocks > keep_end) l->num_blocks = (uint32_t)(keep_end - l->first_block);
            p->runs[w++] = *l;
        }
        KVB__ARR_SHRINK(p->runs, w);
        p->accepted = 1;
        p->offered = num_external_tokens; /* the runs now end there: a later take may not reach past it */
    }
    pthread_mutex_unlock(&c->lock);
    return r;
}

static kvs_result kvs__conn_note_registered(kvs_connector *c, uint64_t request, const kvb_block *blocks,
                                                 size_t n)
{
    size_t i;
    uint64_t event;
    if (!c || (n && !blocks)) return KVS_EINVAL;
    if (!n || c->cfg.offload != KVS_OFFLOAD_EAGER) return KVS_OK;
    pthread_mutex_lock(&c->lock);
    if (!kvo__fit(&c->noted, stbds_arrlenu(c->noted) + n)) { /* out of memory: not offered */
        pthread_mutex_unlock(&c->lock);
        return KVS_ENOMEM;
    }
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

static kvs_result kvs__conn_build_meta(kvs_connector *c, kvs_connector_meta *out)
{
    size_t i, j;
    size_t loads = 0, built = 0;
    if (!c || !out) return KVS_EINVAL;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < stbds_arrlenu(c->plans); i++) { /* the room all of it takes, made first */
        const kvs__plan *p = &c->plans[i];
        loads += p->accepted && p->async && !stbds_arrlen(p->runs);
        built += stbds_arrlenu(p->built) + (p->accepted ? stbds_arrlenu(p->runs) : 0);
    }
    if (!kvo__fit(&c->loads, stbds_arrlenu(c->loads) + loads) || !kvo__fit(&c->meta_loads, built) ||
        !kvo__fit(&c->built_stores, stbds_arrlenu(c->built_stores) + stbds_arrlenu(c->noted)) ||
        !kvo__fit(&c->meta_stores, stbds_arrlenu(c->built_stores) + stbds_arrlenu(c->noted))) {
        out->step = c->step;
        pthread_mutex_unlock(&c->lock);
        return KVS_ENOMEM; /* nothing built (an empty meta): the next step builds it */
    }
    KVB__ARR_SHRINK(c->meta_loads, 0);
    KVB__ARR_SHRINK(c->meta_stores, 0);
    for (i = 0; i < stbds_arrlenu(c->plans); i++) {
        kvs__plan *p = &c->plans[i];
        if (p->accepted && p->async && !stbds_arrlen(p->runs)) { /* what was taken is on the device: nothing */
            kvs__active_load a;             /* to load, but the engine was told to wait: reported at once */
            memset(&a, 0, sizeof a);
            a.load.request = p->request;
            a.load.event = c->next_event++;
            stbds_arrput(c->loads, a);
            p->loads_active++;
        }
        for (j = 0; p->accepted && j < stbds_arrlenu(p->runs); j++) {
            p->runs[j].event = c->next_event++;
            stbds_arrput(p->built, p->runs[j]);
            p->loads_active++;
        }
        KVB__ARR_SHRINK(p->runs, 0);
        p->consumed |= p->accepted;
        p->accepted = 0;
        for (j = 0; j < stbds_arrlenu(p->built); j++) stbds_arrput(c->meta_loads, p->built[j]);
    }
    for (i = 0; i < stbds_arrlenu(c->noted); i++) stbds_arrput(c->built_stores, c->noted[i]);
    KVB__ARR_SHRINK(c->noted, 0);
    for (i = 0; i < stbds_arrlenu(c->built_stores); i++) stbds_arrput(c->meta_stores, c->built_stores[i]);
    out->step = ++c->step;
    out->loads = c->meta_loads;
    out->num_loads = stbds_arrlenu(c->meta_loads);
    out->stores = c->meta_stores;
    out->num_stores = stbds_arrlenu(c->meta_stores);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

/* Whether load l names blocks of plan p (its request's). */
static int kvs__load_in_plan(const kvs__plan *p, const kvs_load *l)
{
    return l->first_block <= stbds_arrlenu(p->hashes) && l->num_blocks <= stbds_arrlenu(p->hashes) - l->first_block;
}

static kvs_result kvs__conn_bind_meta(kvs_connector *c, const kvs_connector_meta *meta)
{
    size_t i;
    if (!c || !meta || (meta->num_loads && !meta->loads) || (meta->num_stores && !meta->stores)) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    for (i = 0; i < meta->num_loads; i++) { /* a request without a plan has finished: its loads are skipped */
        const kvs__plan *p = kvs__plan_of(c, meta->loads[i].request);
        if (p && !kvs__load_in_plan(p, &meta->loads[i])) { /* not what build_meta gave: nothing is bound */
            pthread_mutex_unlock(&c->lock);
            return KVS_EINVAL;
        }
    }
    if (!kvo__fit(&c->bound_loads, meta->num_loads) || !kvo__fit(&c->bound_stores, meta->num_stores)) {
        pthread_mutex_unlock(&c->lock);
        return KVS_ENOMEM; /* nothing bound */
    }
    KVB__ARR_SHRINK(c->bound_loads, 0);
    KVB__ARR_SHRINK(c->bound_stores, 0);
    if (meta->num_loads) memcpy(stbds_arraddnptr(c->bound_loads, meta->num_loads), meta->loads, meta->num_loads * sizeof *meta->loads);
    if (meta->num_stores) memcpy(stbds_arraddnptr(c->bound_stores, meta->num_stores), meta->stores, meta->num_stores * sizeof *meta->stores);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

static kvs_result kvs__conn_start_loads(kvs_connector *c)
{
    size_t i;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    if (!kvo__fit(&c->loads, stbds_arrlenu(c->loads) + stbds_arrlenu(c->bound_loads))) {
        pthread_mutex_unlock(&c->lock);
        return KVS_ENOMEM; /* none started: they stay bound for the next call */
    }
    for (i = 0; i < stbds_arrlenu(c->bound_loads); i++) {
        kvs__plan *p = kvs__plan_of(c, c->bound_loads[i].request);
        kvs__active_load a;
        size_t k = 0;
        while (p && k < stbds_arrlenu(p->built) && p->built[k].event != c->bound_loads[i].event) k++;
        if (!p || k == stbds_arrlenu(p->built)) continue; /* started already (a step's metadata bound twice),
                                                           * or its request finished since the bind */
        a.load = p->built[k];
        stbds_arrdel(p->built, k);
        a.t.id = 0;
        if (kvo_manager_onboard(c->cfg.tiers, a.load.tier, p->hashes + a.load.first_block, a.load.num_blocks, &a.t) != KVO_OK)
            a.t.id = 0; /* reported finished at once: the request computes those tokens instead */
        stbds_arrput(c->loads, a);
    }
    KVB__ARR_SHRINK(c->bound_loads, 0);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

/* One offer for all the bound stores (the pipeline's cost per transfer is paid once per step, not once
 * per request); each event finishes when that transfer does. */
static kvs_result kvs__conn_start_stores(kvs_connector *c)
{
    size_t i, n, k, w, at = 0, nb;
    kvo_transfer t;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    if (!kvo__fit(&c->offer, stbds_arrlenu(c->bound_stores)) ||
        !kvo__fit(&c->stores, stbds_arrlenu(c->stores) + stbds_arrlenu(c->bound_stores))) {
        pthread_mutex_unlock(&c->lock);
        return KVS_ENOMEM; /* none started: they stay bound for the next call */
    }
    nb = stbds_arrlenu(c->built_stores);
    for (i = w = 0; i < stbds_arrlenu(c->bound_stores); i++) { /* the bound stores not started yet */
        const kvs_store *b = &c->bound_stores[i];
        for (k = 0; k < nb; k++) { /* from the last one found on: they usually come in the built order */
            const kvs_store *s = &c->built_stores[(at + k) % nb];
            if (s->event && s->event == b->event && s->block.id == b->block.id) break;
        }
        if (k == nb) continue; /* started already: a step's metadata bound twice */
        at = (at + k) % nb;
        c->built_stores[at].event = 0; /* taken (events count from 1) */
        c->bound_stores[w++] = *b;
    }
    KVB__ARR_SHRINK(c->bound_stores, w);
    for (i = k = 0; i < nb; i++)
        if (c->built_stores[i].event) c->built_stores[k++] = c->built_stores[i];
    KVB__ARR_SHRINK(c->built_stores, k);
    n = w;
    KVB__ARR_SHRINK(c->offer, 0);
    for (i = 0; i < n; i++) stbds_arrput(c->offer, c->bound_stores[i].block);
    t.id = 0;
    if (n) {
        pthread_mutex_unlock(&c->lock); /* the hook takes the lock when a transfer finishes inline */
        kvo_manager_offer(c->cfg.tiers, 0, c->offer, n, &t);
        pthread_mutex_lock(&c->lock);
    }
    for (i = 0; i < n; i++) {
        kvs__active_store a;
        if (i && c->bound_stores[i].event == c->bound_stores[i - 1].event) continue;
        a.event = c->bound_stores[i].event;
        a.request = c->bound_stores[i].request;
        a.t = t;
        a.done = t.id == 0;
        stbds_arrput(c->stores, a);
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
        KVB__ARR_SHRINK(c->got, 0);
        got = kvo__fit(&c->got, info.blocks ? info.blocks : 1) ? stbds_arraddnptr(c->got, info.blocks ? info.blocks : 1)
                                                               : NULL; /* out of memory: computed instead */
        if (got && info.status == KVO_STATUS_COMPLETE && kvo_transfer_take_blocks(up, a->t, got, info.blocks, &n) == KVO_OK) {
            if (p && n && kvo__fit(&p->loaded, stbds_arrlenu(p->loaded) + n)) /* n = 0: a miss */
                memcpy(stbds_arraddnptr(p->loaded, n), got, n * sizeof *got);
            else kvs__unpin_all(c->cfg.device, got, n);
        }
        kvo_transfer_release(up, a->t); /* untaken blocks are released with it */
    }
    if (p && p->loads_active && --p->loads_active == 0) stbds_arrput(c->fin_loads, p->request);
    return 1;
}

/* The store's transfer t has ended: the manager told the hook (id in c->offloaded), or it is final or gone
 * (released by the manager after the hook) though the hook's call was lost (no memory for the pipeline's
 * on_done note, or for the id here). Locked. */
static int kvs__offloaded(kvs_connector *c, kvo_transfer t)
{
    kvo_transfer_info info;
    if (kvs__id_del(&c->offloaded, t.id)) return 1;
    if (kvo_transfer_get_info(kvo_manager_pipeline(c->cfg.tiers, 0, 0), t, &info) != KVO_OK) return 1;
    return info.status >= KVO_STATUS_COMPLETE;
}

static kvs_result kvs__conn_get_finished(kvs_connector *c, kvs_worker_output *out)
{
    size_t i, w;
    uint64_t fin = 0; /* a transfer seen finished: its other events finish with it */
    if (!c || !out) return KVS_EINVAL;
    memset(out, 0, sizeof *out);
    kvo_manager_poll(c->cfg.tiers);
    pthread_mutex_lock(&c->lock);
    if (!kvo__fit(&c->fin_loads, stbds_arrlenu(c->loads)) || !kvo__fit(&c->fin_stores, stbds_arrlenu(c->stores))) {
        pthread_mutex_unlock(&c->lock);
        return KVS_ENOMEM; /* nothing reported: the next call reports it */
    }
    KVB__ARR_SHRINK(c->fin_loads, 0);
    KVB__ARR_SHRINK(c->fin_stores, 0);
    for (i = w = 0; i < stbds_arrlenu(c->loads); i++)
        if (!kvs__load_over(c, &c->loads[i])) c->loads[w++] = c->loads[i];
    KVB__ARR_SHRINK(c->loads, w);
    for (i = w = 0; i < stbds_arrlenu(c->stores); i++) { /* the events of one transfer are neighbours */
        kvs__active_store *s = &c->stores[i];
        if (s->done || (s->t.id && s->t.id == fin) || kvs__offloaded(c, s->t)) {
            fin = s->t.id;
            stbds_arrput(c->fin_stores, s->event);
        } else {
            c->stores[w++] = *s;
        }
    }
    KVB__ARR_SHRINK(c->stores, w);
    /* What is left are ids of offloads that were not stores (lazy, swap, other offers): every pending
     * store's transfer is in c->stores by now (start_stores runs on this side's thread, not meanwhile),
     * and a store reported later is added later. Kept, they would pile up while stores are pending. */
    kvs__id_clear(&c->offloaded);
    out->finished_loads = c->fin_loads;
    out->num_finished_loads = stbds_arrlenu(c->fin_loads);
    out->finished_stores = c->fin_stores;
    out->num_finished_stores = stbds_arrlenu(c->fin_stores);
    pthread_mutex_unlock(&c->lock);
    return KVS_OK;
}

static kvs_result kvs__conn_update_output(kvs_connector *c, const kvs_worker_output *output)
{
    /* Loads keep their blocks in the plan until kvs_connector_release_loads / request_finished, and the
     * worker's lists were already cleared: in one process there is nothing left to carry over. */
    if (!c || !output || (output->num_finished_loads && !output->finished_loads) ||
        (output->num_finished_stores && !output->finished_stores))
        return KVS_EINVAL;
    return KVS_OK;
}

static kvs_result kvs__conn_release_loads(kvs_connector *c, uint64_t request)
{
    kvs__plan *p;
    kvs_result r = KVS_OK;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    p = kvs__plan_of(c, request);
    if (p && (p->loads_active || p->accepted)) r = KVS_ESTATE; /* the blocks are not all there yet */
    else if (p) kvs__plan_drop(c, p);
    pthread_mutex_unlock(&c->lock);
    return r;
}

/* The device blocks the loads of `request` landed in, held for it until its admission. */
static size_t kvs__conn_loaded(kvs_connector *c, uint64_t request)
{
    kvs__plan *p;
    size_t n;
    pthread_mutex_lock(&c->lock);
    n = (p = kvs__plan_of(c, request)) != NULL ? stbds_arrlenu(p->loaded) : 0;
    pthread_mutex_unlock(&c->lock);
    return n;
}

/* Drop every plan whose loads all finished, with the device references it kept (the blocks stay cached,
 * now evictable). 1 when there was one. */
static int kvs__conn_unpin_loads(kvs_connector *c)
{
    size_t i = 0;
    int any = 0;
    pthread_mutex_lock(&c->lock);
    while (i < stbds_arrlenu(c->plans)) {
        kvs__plan *p = &c->plans[i];
        if (stbds_arrlen(p->loaded) && !p->loads_active && !p->accepted) {
            kvs__plan_drop(c, p); /* the last plan moves to i */
            any = 1;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return any;
}

static kvs_result kvs__conn_request_finished(kvs_connector *c, uint64_t request, int *out_keep_blocks)
{
    size_t i, w;
    kvs__plan *p;
    kvs__active_load a;
    if (!c) return KVS_EINVAL;
    pthread_mutex_lock(&c->lock);
    for (i = w = 0; i < stbds_arrlenu(c->bound_loads); i++)
        if (c->bound_loads[i].request != request) c->bound_loads[w++] = c->bound_loads[i];
    KVB__ARR_SHRINK(c->bound_loads, w);
    if ((p = kvs__plan_of(c, request)) != NULL) kvs__plan_drop(c, p); /* start_loads starts no more of it */
    /* Its loads are cancelled one at a time without the lock: a cancel waits for a copy the backend has,
     * and the worker that makes it may first finish a store, whose hook (kvs__on_offloaded) takes the lock. */
    for (;;) {
        for (i = 0; i < stbds_arrlenu(c->loads) && c->loads[i].load.request != request; i++) {
        }
        if (i == stbds_arrlenu(c->loads)) break;
        a = c->loads[i];
        stbds_arrdel(c->loads, i);
        pthread_mutex_unlock(&c->lock);
        if (a.t.id) kvo_transfer_release(kvo_manager_pipeline(c->cfg.tiers, a.load.tier, 1), a.t);
        pthread_mutex_lock(&c->lock);
    }
    pthread_mutex_unlock(&c->lock);
    if (out_keep_blocks) *out_keep_blocks = 0;
    return KVS_OK;
}

KVS_API size_t kvs_connector_pending(kvs_connector *c)
{
    size_t n, i;
    if (!c) return 0;
    pthread_mutex_lock(&c->lock);
    /* taken, built (bound or not) or started; the bound ones are among the built or stale */
    n = stbds_arrlenu(c->loads) + stbds_arrlenu(c->stores) + stbds_arrlenu(c->noted) + stbds_arrlenu(c->built_stores);
    for (i = 0; i < stbds_arrlenu(c->plans); i++)
        n += stbds_arrlenu(c->plans[i].built) + (c->plans[i].accepted ? stbds_arrlenu(c->plans[i].runs) : 0) +
             (c->plans[i].accepted && c->plans[i].async && !stbds_arrlen(c->plans[i].runs)); /* reported at once */
    pthread_mutex_unlock(&c->lock);
    return n;
}


/* The public connector calls: the bodies above between the bus's hooks. */

KVS_API kvs_result kvs_connector_get_num_new_matched_tokens(kvs_connector *c, uint64_t request,
                                                            const kvb_hash *hashes, size_t num_hashes,
                                                            size_t num_computed, size_t *out_tokens,
                                                            int *out_async)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_GET_NUM_NEW_MATCHED_TOKENS, request,
                kvs__conn_get_num_new_matched_tokens(c, request, hashes, num_hashes, num_computed, out_tokens, out_async),
                NULL);
}

KVS_API kvs_result kvs_connector_update_state_after_alloc(kvs_connector *c, uint64_t request, size_t num_external_tokens)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_UPDATE_STATE_AFTER_ALLOC, request,
                kvs__conn_update_state_after_alloc(c, request, num_external_tokens), NULL);
}

KVS_API kvs_result kvs_connector_note_registered(kvs_connector *c, uint64_t request, const kvb_block *blocks, size_t n)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_NOTE_REGISTERED, request,
                kvs__conn_note_registered(c, request, blocks, n), NULL);
}

KVS_API kvs_result kvs_connector_build_meta(kvs_connector *c, kvs_connector_meta *out)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_BUILD_META, 0, kvs__conn_build_meta(c, out), NULL);
}

KVS_API kvs_result kvs_connector_bind_meta(kvs_connector *c, const kvs_connector_meta *meta)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_BIND_META, 0, kvs__conn_bind_meta(c, meta), NULL);
}

KVS_API kvs_result kvs_connector_start_loads(kvs_connector *c)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_START_LOADS, 0, kvs__conn_start_loads(c), NULL);
}

KVS_API kvs_result kvs_connector_start_stores(kvs_connector *c)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_START_STORES, 0, kvs__conn_start_stores(c), NULL);
}

KVS_API kvs_result kvs_connector_get_finished(kvs_connector *c, kvs_worker_output *out)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_GET_FINISHED, 0, kvs__conn_get_finished(c, out), NULL);
}

KVS_API kvs_result kvs_connector_update_output(kvs_connector *c, const kvs_worker_output *output)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_UPDATE_OUTPUT, 0, kvs__conn_update_output(c, output), NULL);
}

KVS_API kvs_result kvs_connector_release_loads(kvs_connector *c, uint64_t request)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_RELEASE_LOADS, request, kvs__conn_release_loads(c, request), NULL);
}

KVS_API kvs_result kvs_connector_request_finished(kvs_connector *c, uint64_t request, int *out_keep_blocks)
{
    if (!c) return KVS_EINVAL;
    KVS__HOOKED(c->armed, c->cfg.bus, KVS_CALL_REQUEST_FINISHED, request,
                kvs__conn_request_finished(c, request, out_keep_blocks), NULL);
}

/* ---- scheduler ---------------------------------------------------------------------------------- */

/* A request. Its first cache line holds everything planning, completing and appending a decoding step
 * read and write (token counts in 32 bits to fit), so a decoding request costs the scheduler one line
 * per step, plus the line its new token goes to; the rest is read at admission, preemption and the ends
 * of blocks. */
typedef struct kvs__req {
    uint64_t id;
    uint32_t *tokens;          /* prompt then generated tokens: len of cap used */
    const kvb_block *table;    /* seq's block table (num_blocks) as of the last push (kvs__synced) */
    uint64_t planned;          /* the step that scheduled it (kvs__scheduled) */
    uint32_t len, cap;
    uint32_t computed;         /* tokens computed */
    uint32_t in_seq;           /* tokens appended to seq (the rest wait: kvs__must_push) */
    uint32_t end;              /* len at which it finishes (prompt + max_new_tokens); UINT32_MAX: never */
    uint32_t num_blocks;
    uint32_t item;             /* while planned: its index in the step's prefill or decode items */
    kvs_slot_state state;
    /* second line on */
    kvb_seq *seq;
    kvb_seq *kept_seq;         /* an empty sequence kept for the next admission (its memory reused) */
    size_t registered_blocks;
    size_t owed;               /* tokens whose commit found no memory (kvs__commit_owed); 0: none */
    uint64_t arrival;
    int32_t priority;
    uint32_t preemptions;
    size_t num_prompt;
    size_t cached, lower_hit;
    size_t lower_from;         /* the token the planned loads start at (the device prefix then found) */
    kvb_block *pins;           /* stb_ds: that device prefix, held while the loads run (kvs__pin_prefix);
                                * the array is kept with the struct */
    uint64_t salt;
    uint64_t extra[KVB_MAX_EXTRA_KEYS];
    size_t num_extra;
    int swapped, drop_after_step;
    int released;              /* by kvs_sched_release while its blocks wait for the step to complete */
    uint32_t spare_class;      /* the class of the buffer it was given (kvs__spare_for): its spares' */
    uint64_t preempted_in;     /* the step that preempted it: not resumed in that same step */
    size_t at;                 /* its place in kvs_sched.all */
} kvs__req;
typedef char kvs__req_hot_part_is_one_line[offsetof(kvs__req, seq) <= 64 ? 1 : -1];
#define KVS__SLAB 64
/* A request's place in a slab: an odd number of cache lines, so that the first lines of neighbours fall
 * in different cache sets (at a power-of-two stride a pass over 4,000 requests used a quarter of them). */
typedef union kvs__req_slot {
    kvs__req r;
    unsigned char lines[5 * 64];
} kvs__req_slot;
typedef char kvs__req_fits_its_slot[sizeof(kvs__req) <= 5 * 64 ? 1 : -1];
#define KVS__CLASSES 33        /* a request's token buffer holds 2^c tokens (UINT32_MAX in class 32) */

struct kvs_sched {
    kvs_sched_config cfg;
    const int *armed;          /* hooks or breakpoints on cfg.bus (kvs__unarmed without a bus) */
    kvs_call in_call;          /* the public call running, when the bus was armed as it began (else 0) */
    kvs_connector *conn;
    uint32_t block_tokens, device_blocks;
    kvs__idmap reqs;           /* id -> request */
    kvs__req **all;            /* stb_ds: every request, in the order they came (a removal moves the last) */
    kvs__req **spare[KVS__CLASSES]; /* stb_ds: released requests, kept with their token buffers and
                                * sequences for the next, by the class their buffer was given (kvs__spare_for) */
    void **slabs;              /* stb_ds: where the requests live, KVS__SLAB to a slab */
    kvs__req_slot *slab_next;
    size_t slab_left;
    kvs__req **order;          /* stb_ds: scratch of kvs__schedule_running, kept between steps */
    size_t drops;              /* requests that give their blocks back when the step completes */
    size_t owing;              /* requests with a commit owed (kvs__req.owed) */
    /* stb_ds scratch of one step's batches (kept between steps, so the steady state allocates nothing) */
    kvs__req **batch;
    kvb_seq **batch_seqs;
    const uint32_t **batch_tokens;
    size_t *batch_counts;
    kvs__req **waiting, **running, **swapped, **onboarding;
    uint64_t next_id, next_arrival, step_id;
    int in_step;
    size_t tokens_left, seqs_left; /* the budgets of the step being planned */
    kvs_sched_item *prefill, *decode;
    kvs__req **planned[2];     /* stb_ds: the request of each prefill [0] and decode [1] item */
    kvs__req **commits[2];     /* stb_ds: those of them whose item fills a block, in the same order */
    size_t *prefills;          /* stb_ds: where in kvs__schedule_running's order the prefill pass looks */
    size_t next_append;        /* the decode item whose request is expected to append next */
    size_t decode_tokens;      /* tokens of the step's decode items outside commits: counted at complete */
    kvb_hash *hashes;          /* stb_ds scratch of kvs__stage_onboard */
    kvb_weak *swap_out;        /* stb_ds scratch of kvs__swap_out */
    uint64_t *tally;           /* kvs__room_after_preempting: per device block, its references << 32 |
                                * those held by victims (zero between calls; made at the first) */
    uint32_t *touched;         /* stb_ds: the tally's entries set in a call */
    uint32_t *words;           /* stb_ds scratch of kvs__emit_add */
    uint64_t *preempted;
    kvs_sched_stats stats;
};

static kvs__req *kvs__find(kvs_sched *s, uint64_t id)
{
    return (kvs__req *)kvs__id_get(&s->reqs, id);
}

/* Whether r has an item in the step being planned (or, between step and complete, in the step). */
static int kvs__scheduled(const kvs_sched *s, const kvs__req *r)
{
    return r->planned == s->step_id + (s->in_step ? 0 : 1);
}

/* Which list of the step r's item is in: 0 prefill, 1 decode. r is scheduled. */
static int kvs__item_list(const kvs_sched *s, const kvs__req *r)
{
    return !(r->item < stbds_arrlenu(s->planned[0]) && s->planned[0][r->item] == r);
}

/* Whether r was a decode item of the step just completed and nothing has touched it since. complete
 * does not visit those (a decode computes all of its request's tokens, and at 4,000 requests that pass
 * missed the cache once a request): r->computed still has the count before the step, r->len the count
 * after it, until kvs__settle writes it down. */
static int kvs__unsettled(const kvs_sched *s, const kvs__req *r)
{
    return r->planned == s->step_id && !s->in_step && r->state == KVS_SLOT_DECODING;
}

static size_t kvs__computed(const kvs_sched *s, const kvs__req *r)
{
    return kvs__unsettled(s, r) ? r->len : r->computed;
}

/* Before anything reads or changes r's counts. */
static void kvs__settle(kvs_sched *s, kvs__req *r)
{
    if (!kvs__unsettled(s, r)) return;
    r->computed = r->len;
    r->planned = 0;
}

/* Take r out of the step's commits (list a); 0 when it was not there. */
static int kvs__drop_commit(kvs_sched *s, int a, const kvs__req *r)
{
    size_t i;
    for (i = stbds_arrlenu(s->commits[a]); i-- > 0;)
        if (s->commits[a][i] == r) {
            stbds_arrdel(s->commits[a], i);
            return 1;
        }
    return 0;
}

static void kvs__emit_slot(kvs_sched *s, const kvs__req *r, kvs_slot_state from)
{
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_SLOT;
    e.request = r->id;
    e.u.slot.from = (uint32_t)from;
    e.u.slot.to = (uint32_t)r->state;
    e.u.slot.tokens = r->len;
    e.u.slot.computed = kvs__computed(s, r);
    kvs_bus_publish(s->cfg.bus, &e);
}

static kvs_result kvs__change_state(kvs_sched *s, kvs__req *r, kvs_slot_state to)
{
    kvs_slot_state from = r->state;
    if (!kvs_slot_transition_allowed(from, to)) return KVS_ESTATE;
    r->state = to;
    if (kvs__wants(s->cfg.bus, KVS_EV_SLOT)) kvs__emit_slot(s, r, from);
    if (kvs__is_armed(s->armed)) {
        kvs_pause_info at;
        at.call = (kvs_call)0;
        at.state = to;
        at.request = r->id;
        kvs__checkpoint(s->cfg.bus, &at, s->in_call);
    }
    return KVS_OK;
}

/* r -> to (no change when r is there already: a decoding request stays Decoding step after step). */
static kvs_result kvs__set_state(kvs_sched *s, kvs__req *r, kvs_slot_state to)
{
    return r->state == to ? KVS_OK : kvs__change_state(s, r, to);
}

/* An input event (a scheduler call) with `words` following in TOKENS events, for replay. */
static void kvs__emit_input(kvs_sched *s, kvs_event *e, const uint32_t *words, size_t n)
{
    size_t i = 0;
    pthread_mutex_lock(&s->cfg.bus->lock); /* one call's records stay together */
    kvs__publish_locked(s->cfg.bus, e);
    while (i < n) {
        kvs_event t;
        size_t k = n - i < 11 ? n - i : 11;
        memset(&t, 0, sizeof t);
        t.kind = KVS_EV_TOKENS;
        t.request = e->request;
        t.u.tokens.n = (uint32_t)k;
        memcpy(t.u.tokens.words, words + i, k * sizeof *words);
        kvs__publish_locked(s->cfg.bus, &t);
        i += k;
    }
    pthread_mutex_unlock(&s->cfg.bus->lock);
}

static void kvs__emit_call(kvs_sched *s, kvs_event_kind kind, uint64_t request)
{
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.kind = (uint16_t)kind;
    e.request = request;
    kvs__emit_input(s, &e, NULL, 0);
}

/* Queue order: higher priority first, then earlier arrival. */
static int kvs__before(const kvs__req *a, const kvs__req *b)
{
    return a->priority != b->priority ? a->priority > b->priority : a->arrival < b->arrival;
}

/* Room for n requests in the arrays a step hands out (its items, its preempted). */
static int kvs__out_room(kvs_sched *s, size_t n)
{
    return kvo__fit(&s->prefill, n) && kvo__fit(&s->decode, n) && kvo__fit(&s->preempted, n);
}

/* Room for every request the scheduler will hold once one more is added (n of them): each per-step list
 * (the queues, the step's items and their requests, the batches, the preempted) holds a request at most
 * once, so with this room made at kvs_sched_add a step never grows one, and out of memory an add fails
 * (KVS_ENOMEM) with nothing changed instead of a step failing half done. The spares of the new request's
 * class make room for it too: released, it goes there; so do those released during the step, out of
 * kvs_sched.all but not yet spares (counted among s->drops). An add between step and complete leaves the
 * arrays the engine is reading where they are: the next step makes their room first (kvs__sched_step). */
static int kvs__room_for_requests(kvs_sched *s, size_t n, unsigned cls)
{
    return kvo__fit(&s->all, n) && kvo__fit(&s->waiting, n) && kvo__fit(&s->running, n) &&
           kvo__fit(&s->swapped, n) && kvo__fit(&s->onboarding, n) && kvo__fit(&s->order, n) &&
           kvo__fit(&s->planned[0], n) && kvo__fit(&s->planned[1], n) && kvo__fit(&s->commits[0], n) &&
           kvo__fit(&s->commits[1], n) && (s->in_step || kvs__out_room(s, n)) &&
           kvo__fit(&s->batch, n) && kvo__fit(&s->batch_seqs, n) && kvo__fit(&s->batch_tokens, n) &&
           kvo__fit(&s->batch_counts, n) && kvo__fit(&s->prefills, n) &&
           kvo__fit(&s->spare[cls], stbds_arrlenu(s->spare[cls]) + n + s->drops);
}

static void kvs__queue_insert(kvs__req ***q, kvs__req *r)
{
    size_t at = stbds_arrlenu(*q);
    while (at > 0 && kvs__before(r, (*q)[at - 1])) at--;
    stbds_arrput(*q, r); /* within the room kvs__room_for_requests made */
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
    if (!config || !out || !config->device ||
        (config->preempt == KVS_PREEMPT_SWAP && !kvo_manager_pipeline(config->tiers, 0, 0)) || /* G1 -> G2 */
        (unsigned)config->preempt > KVS_PREEMPT_SWAP || (unsigned)config->offload > KVS_OFFLOAD_LAZY)
        return KVS_EINVAL;
    s = (kvs_sched *)KVB_MALLOC(sizeof *s);
    if (!s) return KVS_ENOMEM;
    memset(s, 0, sizeof *s);
    s->cfg = *config;
    s->armed = config->bus ? &config->bus->armed : &kvs__unarmed;
    if (!s->cfg.max_tokens) s->cfg.max_tokens = 8192;
    if (!s->cfg.max_seqs) s->cfg.max_seqs = 256;
    memset(&pc, 0, sizeof pc);
    kvb_pool_get_config(config->device, &pc);
    s->block_tokens = pc.block_tokens;
    s->device_blocks = pc.num_blocks;
    s->next_id = 1;
    if (config->tiers) {
        kvs_connector_config cc;
        memset(&cc, 0, sizeof cc);
        cc.device = config->device;
        cc.tiers = config->tiers;
        cc.offload = config->offload;
        cc.bus = config->bus;
        cc.lookup = config->lookup;
        cc.lookup_user = config->lookup_user;
        if ((r = kvs_connector_create(&cc, &s->conn)) != KVS_OK) {
            KVB_FREE(s);
            return r;
        }
    }
    *out = s;
    return KVS_OK;
}

/* r's sequence, empty, with its salt, extra keys and room for r's token buffer: the one r kept from
 * before (its memory reused) or a new one. */
static int kvs__seq_open(kvs_sched *s, kvs__req *r)
{
    kvb_seq_config sc;
    memset(&sc, 0, sizeof sc);
    sc.salt = r->salt;
    sc.extra = r->extra;
    sc.n_extra = r->num_extra;
    if (r->kept_seq && kvb_seq_reset(r->kept_seq, &sc) == KVB_OK) {
        r->seq = r->kept_seq;
        r->kept_seq = NULL;
    } else if (kvb_seq_create(s->cfg.device, &sc, &r->seq) != KVB_OK) {
        return 0;
    }
    kvb_seq_reserve(r->seq, r->cap);
    return 1;
}

/* r's blocks go back (as kvb_seq_destroy gives them back); the sequence is kept for its next admission,
 * or the next request that reuses r's struct. */
static void kvs__seq_close(kvs__req *r)
{
    if (!r->seq) return;
    if (r->kept_seq || kvb_seq_reset(r->seq, NULL) != KVB_OK) kvb_seq_destroy(r->seq);
    else r->kept_seq = r->seq;
    r->seq = NULL;
}

/* A commit of r's first `tokens` found no memory for the pool's events (nothing changed): r owes it. */
static void kvs__owe(kvs_sched *s, kvs__req *r, size_t tokens)
{
    s->stats.commits_deferred++;
    if (!r->owed) s->owing++;
    if (tokens > r->owed) r->owed = tokens;
}

/* Commit what r owes: 1 when it is committed now (or nothing was owed), 0 when still out of memory. */
static int kvs__repay(kvs_sched *s, kvs__req *r)
{
    if (!r->owed) return 1;
    if (r->seq && kvb_seq_commit(r->seq, r->owed) == KVB_ENOMEM) return 0;
    r->owed = 0;
    s->owing--;
    return 1;
}

/* The device prefix r held while its loads ran goes (kvb_unpin: not a use). */
static void kvs__unpin_prefix(kvs_sched *s, kvs__req *r)
{
    kvs__unpin_all(s->cfg.device, r->pins, stbds_arrlenu(r->pins));
    KVB__ARR_SHRINK(r->pins, 0);
}

/* Give back a request's device blocks and its connector state (its counts stay readable). A commit it
 * still owes is tried a last time: failing that, its blocks go back uncached, and are counted. */
static void kvs__drop_blocks(kvs_sched *s, kvs__req *r)
{
    kvs__unpin_prefix(s, r);
    if (!kvs__repay(s, r)) {
        size_t full = r->owed / s->block_tokens;
        s->stats.blocks_not_registered += full > r->registered_blocks ? full - r->registered_blocks : 0;
        r->owed = 0;
        s->owing--;
    }
    kvs__seq_close(r);
    r->in_seq = r->num_blocks = 0;
    r->table = NULL;
    if (s->conn) kvs_connector_request_finished(s->conn, r->id, NULL);
}

static void kvs__req_free(kvs__req *r)
{
    kvb_seq_destroy(r->kept_seq);
    stbds_arrfree(r->pins);
    KVB_FREE(r->tokens);
}

/* The class of a buffer of n tokens: the c with 2^(c-1) < n <= 2^c (0 for n <= 1). */
static unsigned kvs__class(size_t n)
{
    unsigned c = 0;
    while (c < KVS__CLASSES - 1 && ((size_t)1 << c) < n) c++;
    return c;
}

/* Room for `need` tokens in r->tokens: the whole of need's class (a power of two, so at least doubling).
 * 0 when out of memory (nothing changed). */
static int kvs__reserve(kvs__req *r, size_t need)
{
    uint32_t *t;
    unsigned c = kvs__class(need);
    size_t cap = c < KVS__CLASSES - 1 ? (size_t)1 << c : UINT32_MAX;
    if (need <= r->cap) return 1;
    if (!(t = (uint32_t *)KVB_REALLOC(r->tokens, cap * sizeof *t))) return 0;
    r->tokens = t;
    r->cap = (uint32_t)cap;
    return 1;
}

/* A released request goes back to the spares of the class it was given at its add, however its buffer
 * grew since (kvs_sched_append): by the class of its buffer, a request that outgrew its class would leave
 * it for a larger one, and every such request would take a new struct and buffer, the larger class
 * keeping each of them for ever. */
static void kvs__req_spare(kvs_sched *s, kvs__req *r)
{
    stbds_arrput(s->spare[r->spare_class], r); /* within the room made at its add (kvs__room_for_requests) */
}

/* A released request given need's class, or NULL (its buffer holds that class, or more when it grew,
 * or less after an out-of-memory: kvs__reserve sees to it). Only that class, so that which spare a
 * request gets never decides what a later one allocates: each class keeps as many structs as it had
 * requests at once, and the same traffic again allocates nothing. (Taken last in, first out whatever
 * their size, every spare had to meet the largest request before the steady state came.) */
static kvs__req *kvs__spare_for(kvs_sched *s, size_t need)
{
    unsigned c = kvs__class(need);
    return stbds_arrlen(s->spare[c]) ? stbds_arrpop(s->spare[c]) : NULL;
}

/* A request struct for `need` tokens, aligned to a cache line: a released one (its token buffer and
 * sequence kept) or a new one from the current slab. */
static kvs__req *kvs__req_new(kvs_sched *s, size_t need)
{
    kvs__req *r;
    if ((r = kvs__spare_for(s, need)) != NULL) {
        uint32_t *tokens;
        uint32_t cap;
        kvb_seq *kept;
        kvb_block *pins;
        tokens = r->tokens;
        cap = r->cap;
        kept = r->kept_seq;
        pins = r->pins;
        memset(r, 0, sizeof *r);
        r->tokens = tokens;
        r->cap = cap;
        r->kept_seq = kept;
        r->pins = pins;
    } else {
        if (!s->slab_left) { /* requests side by side: a pass over them in arrival order is a stream */
            void *block;
            if (!kvo__fit(&s->slabs, stbds_arrlenu(s->slabs) + 1)) return NULL;
            if (!(block = KVB_MALLOC(KVS__SLAB * sizeof(kvs__req_slot) + 63))) return NULL;
            stbds_arrput(s->slabs, block);
            s->slab_next = (kvs__req_slot *)(void *)(((uintptr_t)block + 63) & ~(uintptr_t)63);
            s->slab_left = KVS__SLAB;
        }
        r = &s->slab_next++->r;
        s->slab_left--;
        memset(r, 0, sizeof *r);
    }
    return r;
}

KVS_API void kvs_sched_destroy(kvs_sched *sched)
{
    size_t i;
    if (!sched) return;
    for (i = 0; sched->in_step && i < stbds_arrlenu(sched->planned[0]) + stbds_arrlenu(sched->planned[1]); i++) {
        size_t n0 = stbds_arrlenu(sched->planned[0]);
        kvs__req *r = i < n0 ? sched->planned[0][i] : sched->planned[1][i - n0];
        if (!r->released || !r->drop_after_step) continue; /* released during the step, blocks not given back */
        kvs__drop_blocks(sched, r);
        kvs__req_free(r);
    }
    for (i = 0; i < stbds_arrlenu(sched->all); i++) {
        kvs__drop_blocks(sched, sched->all[i]);
        kvs__req_free(sched->all[i]);
    }
    kvs__id_free(&sched->reqs);
    stbds_arrfree(sched->all);
    for (i = 0; i < KVS__CLASSES; i++) {
        while (stbds_arrlen(sched->spare[i])) kvs__req_free(stbds_arrpop(sched->spare[i]));
        stbds_arrfree(sched->spare[i]);
    }
    for (i = 0; i < stbds_arrlenu(sched->slabs); i++) KVB_FREE(sched->slabs[i]);
    stbds_arrfree(sched->slabs);
    stbds_arrfree(sched->order);
    stbds_arrfree(sched->batch);
    stbds_arrfree(sched->batch_seqs);
    stbds_arrfree(sched->batch_tokens);
    stbds_arrfree(sched->batch_counts);
    stbds_arrfree(sched->waiting);
    stbds_arrfree(sched->running);
    stbds_arrfree(sched->swapped);
    stbds_arrfree(sched->onboarding);
    stbds_arrfree(sched->prefill);
    stbds_arrfree(sched->decode);
    stbds_arrfree(sched->planned[0]);
    stbds_arrfree(sched->planned[1]);
    stbds_arrfree(sched->commits[0]);
    stbds_arrfree(sched->commits[1]);
    stbds_arrfree(sched->hashes);
    stbds_arrfree(sched->swap_out);
    KVB_FREE(sched->tally);
    stbds_arrfree(sched->touched);
    stbds_arrfree(sched->words);
    stbds_arrfree(sched->prefills);
    stbds_arrfree(sched->preempted);
    kvs_connector_destroy(sched->conn);
    KVB_FREE(sched);
}

/* ADD: the request's id, its parameters; then its extra keys (lo, hi words) and prompt (s->words has room
 * for them). */
static void kvs__emit_add(kvs_sched *s, const kvs_request *rq, uint64_t id)
{
    kvs_event e;
    uint32_t *words;
    size_t i;
    KVB__ARR_SHRINK(s->words, 0);
    words = stbds_arraddnptr(s->words, 2 * rq->num_extra + rq->num_prompt);
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_ADD;
    e.request = id;
    e.u.add.num_prompt = rq->num_prompt;
    e.u.add.salt = rq->salt;
    e.u.add.max_new_tokens = rq->max_new_tokens;
    e.u.add.priority = rq->priority;
    e.u.add.num_extra = (uint32_t)rq->num_extra;
    for (i = 0; i < rq->num_extra; i++) {
        words[2 * i] = (uint32_t)rq->extra[i];
        words[2 * i + 1] = (uint32_t)(rq->extra[i] >> 32);
    }
    memcpy(words + 2 * rq->num_extra, rq->prompt, rq->num_prompt * sizeof *words);
    kvs__emit_input(s, &e, words, 2 * rq->num_extra + rq->num_prompt);
}

static kvs_result kvs__sched_add(kvs_sched *sched, const kvs_request *request, uint64_t *out_id)
{
    kvs__req *r;
    size_t need, room;
    int add_event;
    if (!sched || !request || !out_id || !request->num_prompt || !request->prompt ||
        (request->num_extra && !request->extra) || request->num_extra > KVB_MAX_EXTRA_KEYS)
        return KVS_EINVAL;
    if (request->num_prompt >= UINT32_MAX - request->max_new_tokens) return KVS_ETOOBIG; /* before any sum wraps */
    need = (request->num_prompt + request->max_new_tokens + sched->block_tokens - 1) / sched->block_tokens;
    if (need > sched->device_blocks) return KVS_ETOOBIG;
    add_event = kvs__wants(sched->cfg.bus, KVS_EV_ADD); /* asked once: the room below is for it */
    if (add_event && !kvo__fit(&sched->words, 2 * request->num_extra + request->num_prompt)) return KVS_ENOMEM;
    /* room for the tokens it may generate when that is a modest number (else for 256 at first): decoding
     * does not reallocate step after step */
    room = request->num_prompt + (request->max_new_tokens && request->max_new_tokens <= 4096 ? request->max_new_tokens : 256);
    /* the room first: a request that cannot be added then goes back to the spares without allocating */
    if (!kvs__room_for_requests(sched, stbds_arrlenu(sched->all) + 1, kvs__class(room)) ||
        !(r = kvs__req_new(sched, room)))
        return KVS_ENOMEM;
    r->spare_class = kvs__class(room);
    if (!kvs__reserve(r, room)) {
        kvs__req_spare(sched, r); /* not freed: the last step's items may still name it */
        return KVS_ENOMEM;
    }
    r->id = sched->next_id++;
    r->arrival = sched->next_arrival++;
    r->state = KVS_SLOT_INITIALIZED;
    r->priority = request->priority;
    r->num_prompt = request->num_prompt;
    r->end = request->max_new_tokens ? (uint32_t)(request->num_prompt + request->max_new_tokens) : UINT32_MAX;
    r->salt = request->salt;
    r->num_extra = request->num_extra;
    if (request->num_extra) memcpy(r->extra, request->extra, request->num_extra * sizeof *r->extra);
    memcpy(r->tokens, request->prompt, request->num_prompt * sizeof *r->tokens);
    r->len = (uint32_t)request->num_prompt;
    if (!kvs__id_put(&sched->reqs, r->id, r)) {
        sched->next_id--;
        sched->next_arrival--;
        kvs__req_spare(sched, r);
        return KVS_ENOMEM;
    }
    /* the event once nothing can fail: a refused add names no id (the next add takes it) */
    if (add_event) kvs__emit_add(sched, request, r->id);
    r->at = stbds_arrlenu(sched->all);
    stbds_arrput(sched->all, r);
    kvs__queue_insert(&sched->waiting, r);
    sched->stats.prompt_tokens += request->num_prompt;
    if (kvs__wants(sched->cfg.bus, KVS_EV_SLOT)) kvs__emit_slot(sched, r, (kvs_slot_state)0);
    *out_id = r->id;
    return KVS_OK;
}

/* The running request to preempt: lowest priority, latest arrival, priority below `below` (INT32_MAX + 1:
 * any), not `self`. (A victim already scheduled this step loses its item: kvs__preempt.) */
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
    kvs_sched_item **items;
    kvs__req **reqs;
    size_t i, n, num_new;
    int a;
    if (!kvs__scheduled(s, v)) return;
    a = kvs__item_list(s, v);
    items = a ? &s->decode : &s->prefill;
    reqs = s->planned[a];
    i = v->item;
    n = stbds_arrlenu(reqs);
    num_new = (*items)[i].num_new;
    s->tokens_left += num_new;
    s->seqs_left++;
    memmove(&(*items)[i], &(*items)[i + 1], (n - 1 - i) * sizeof **items);
    memmove(&reqs[i], &reqs[i + 1], (n - 1 - i) * sizeof *reqs);
    stbds_header(*items)->length--;
    stbds_header(reqs)->length--;
    for (; i + 1 < n; i++) reqs[i]->item = (uint32_t)i;
    if (!kvs__drop_commit(s, a, v) && a) s->decode_tokens -= num_new; /* counted in bulk (kvs__item) */
    v->planned = 0;
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
    if (!full || !down || !kvo__fit(&s->swap_out, full)) return; /* out of memory: recomputed instead */
    KVB__ARR_SHRINK(s->swap_out, 0);
    w = stbds_arraddnptr(s->swap_out, full); /* kept between swaps: a steady state allocates nothing */
    for (i = 0; i < full; i++) w[i] = kvb_weak_of(table[i]);
    if (kvo_enqueue(down, w, full, NULL, &t) == KVO_OK) kvo_pipeline_drain(down, 5 * 1000000);
}

static void kvs__preempt(kvs_sched *s, kvs__req *v)
{
    kvs__unschedule(s, v);
    v->preempted_in = s->step_id + 1; /* the step being planned */
    kvs__queue_remove(s->running, v);
    if (s->cfg.preempt == KVS_PREEMPT_SWAP) kvs__swap_out(s, v);
    kvs__drop_blocks(s, v);
    v->computed = 0; /* recomputed (or reloaded) from scratch */
    v->cached = v->registered_blocks = 0;
    kvs__set_state(s, v, KVS_SLOT_PREEMPTED);
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

/* Whether r's new tokens go to its sequence now: they need a new block. Otherwise they wait in
 * r->tokens, and planning the step touches neither the sequence nor the pool; tokens that fill the last
 * block go to the sequence when the step completes, just before its commit registers the block (one
 * visit of the sequence, not two). A decoding request reaches the pool twice per block. */
static int kvs__must_push(const kvs_sched *s, const kvs__req *r)
{
    return (uint64_t)r->len > (uint64_t)r->num_blocks * s->block_tokens;
}

/* Whether the item of r (computing [num_computed, num_computed + num_new)) fills a block. A decode whose
 * tokens wait stays within its last block (the earlier ones are full, and its computed tokens reach
 * into the last), so it fills that block exactly when its tokens do. */
static int kvs__item_fills(const kvs_sched *s, const kvs__req *r, size_t num_computed, size_t num_new, int decode)
{
    if (decode && r->in_seq < r->len) return (uint64_t)r->len == (uint64_t)r->num_blocks * s->block_tokens;
    return (num_computed + num_new) / s->block_tokens > num_computed / s->block_tokens;
}

static void kvs__item(kvs_sched *s, kvs__req *r, size_t num_computed, size_t num_new, int decode)
{
    kvs_sched_item *it = decode ? stbds_arraddnptr(s->decode, 1) : stbds_arraddnptr(s->prefill, 1);
    it->request = r->id;
    it->blocks = r->table;
    it->num_blocks = r->num_blocks;
    it->num_computed = num_computed;
    it->num_new = num_new;
    it->tokens = r->tokens;
    it->num_tokens = r->len;
    r->planned = s->step_id + 1;
    r->item = (uint32_t)stbds_arrlenu(s->planned[decode]);
    stbds_arrput(s->planned[decode], r);
    if (kvs__item_fills(s, r, num_computed, num_new, decode)) stbds_arrput(s->commits[decode], r);
    else if (decode) s->decode_tokens += num_new;
}

/* r's sequence has all of its tokens: its table as the step's items show it. */
static void kvs__synced(kvs__req *r)
{
    const kvb_block *table = NULL;
    size_t n = 0;
    kvb_seq_blocks(r->seq, &table, &n);
    r->in_seq = r->len;
    r->table = table;
    r->num_blocks = (uint32_t)n;
}

/* Bring the sequence up to the request's tokens (sampled tokens since the last step), preempting
 * others when blocks run out. 0 when r itself had to go. */
static int kvs__grow(kvs_sched *s, kvs__req *r, int64_t preempt_below)
{
    while (r->in_seq < r->len) {
        kvs__req *v;
        if (kvb_seq_append(r->seq, r->tokens + r->in_seq, r->len - r->in_seq, NULL) == KVB_OK) {
            kvs__synced(r);
            return 1;
        }
        v = kvs__victim(s, preempt_below, NULL);
        if (!v || v == r) return 0;
        kvs__preempt(s, v);
    }
    return 1;
}

/* Schedule what `r` computes next within the budget (a decode must get all of its tokens): 1 when it
 * got a share. */
static int kvs__schedule_compute(kvs_sched *s, kvs__req *r, int decode)
{
    size_t *tokens_left = &s->tokens_left, *seqs_left = &s->seqs_left;
    size_t len = r->len, from = r->computed, n;
    if (from >= len) return 0;
    n = len - from;
    if (!*seqs_left || !*tokens_left || (decode && n > *tokens_left)) return 0;
    if (n > *tokens_left) n = *tokens_left; /* chunked prefill */
    kvs__item(s, r, from, n, decode);
    *tokens_left -= n;
    (*seqs_left)--;
    return 1;
}

/* r has grown (or had to go): it gets its share of the budget, or is skipped this step. */
static void kvs__schedule_grown(kvs_sched *s, kvs__req *r, int decoding, int grown)
{
    if (!grown) { /* nobody else to preempt: r goes */
        kvs__preempt(s, r);
        return;
    }
    if (kvs__schedule_compute(s, r, decoding))
        kvs__set_state(s, r, decoding ? KVS_SLOT_DECODING : KVS_SLOT_PREFILLING);
    else
        kvs__set_state(s, r, decoding ? KVS_SLOT_SKIPPED_DECODE : KVS_SLOT_SKIPPED_PREFILL);
}

/* Whether r grows and is scheduled in this pass (decodes first, then prefills). */
static int kvs__wants_growth(kvs_sched *s, kvs__req *r, int decode_pass)
{
    int decoding = r->state == KVS_SLOT_DECODING || r->state == KVS_SLOT_SKIPPED_DECODE;
    kvs__settle(s, r);
    if (r->state == KVS_SLOT_PREEMPTED || r->state == KVS_SLOT_FINISHED) return 0; /* a victim meanwhile */
    if (decoding != decode_pass || kvs__scheduled(s, r)) return 0;
    return !(decoding && r->len <= r->computed); /* waiting for its sampled token */
}

/* Decoding requests planned per batch of sequence appends: few enough that their lines stay in L1
 * between gathering the batch and scheduling them. */
#define KVS__WINDOW 64

/* The decoding requests from order[from] on that grow in this pass, a window at a time: those whose
 * tokens must go to their sequence now (kvs__must_push) are appended in one batch (one lock of the
 * device pool), then the window is scheduled in order up to the first append that failed, which takes
 * the slow path (preempting others) exactly where the one-by-one loop would have. Returns where the pass
 * goes on. */
static size_t kvs__grow_decodes(kvs_sched *s, kvs__req **order, size_t from, size_t n)
{
    size_t end, i, j = 0, k, done = 0;
    KVB__ARR_SHRINK(s->batch, 0);
    KVB__ARR_SHRINK(s->batch_seqs, 0);
    KVB__ARR_SHRINK(s->batch_tokens, 0);
    KVB__ARR_SHRINK(s->batch_counts, 0);
    for (end = from; end < n && end - from < KVS__WINDOW && kvs__wants_growth(s, order[end], 1); end++) {
        kvs__req *r = order[end];
        if (end + 32 < n) KVB__PREFETCH(order[end + 32]);
        if (!kvs__must_push(s, r)) continue;
        stbds_arrput(s->batch, r);
        stbds_arrput(s->batch_seqs, r->seq);
        stbds_arrput(s->batch_tokens, r->tokens + r->in_seq);
        stbds_arrput(s->batch_counts, r->len - r->in_seq);
    }
    if (end == from) { /* order[from] does not grow in this pass: the prefill pass looks at it */
        if (kvs__wants_growth(s, order[from], 0)) stbds_arrput(s->prefills, from);
        return from + 1;
    }
    k = stbds_arrlenu(s->batch);
    if (k) kvb_seq_append_many(s->batch_seqs, s->batch_tokens, s->batch_counts, k, &done);
    for (i = from; i < end; i++) {
        kvs__req *r = order[i];
        if (j < k && s->batch[j] == r) {
            if (j == done) break;
            kvs__synced(r);
            j++;
        }
        kvs__schedule_grown(s, r, 1, 1);
    }
    if (i == end) return end;
    kvs__schedule_grown(s, order[i], 1, kvs__grow(s, order[i], (int64_t)INT32_MAX + 1));
    return i + 1;
}

static void kvs__schedule_running(kvs_sched *s)
{
    kvs__req **order; /* a snapshot: preemption takes requests out of s->running meanwhile */
    size_t i, n;
    KVB__ARR_SHRINK(s->order, 0);
    if (stbds_arrlen(s->running)) memcpy(stbds_arraddnptr(s->order, stbds_arrlenu(s->running)), s->running, stbds_arrlenu(s->running) * sizeof *s->order);
    order = s->order;
    n = stbds_arrlenu(order);
    KVB__ARR_SHRINK(s->prefills, 0);
    for (i = 0; i < n;) i = kvs__grow_decodes(s, order, i, n); /* decodes first, in batches */
    for (i = 0; i < stbds_arrlenu(s->prefills); i++) { /* then prefills: the decode pass saw where they are */
        kvs__req *r = order[s->prefills[i]];
        if (kvs__wants_growth(s, r, 0)) kvs__schedule_grown(s, r, 0, kvs__grow(s, r, (int64_t)INT32_MAX + 1));
    }
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

/* Lower tiers first: when they hold blocks past the device prefix, the request waits for the loads.
 * Only the blocks admission can match are asked for: those before the last token's (kvs__admit computes
 * that token, so a prompt that fills its last block recomputes that block; loading it would be wasted). */
/* r's cached device prefix (*dev blocks of hashes[0..nh)), held until r's admission matches it
 * (kvs__admit): while its loads run, other requests' blocks are evicted, and a prefix block that went
 * would stop the match before the loaded blocks, which would then be recomputed. Held as pins, not uses
 * (kvb_pin: no lookup counted, no policy sees it; the admission's match is the use). Out of memory for
 * the list, not held (looked up only, as before). */
static void kvs__pin_prefix(kvs_sched *s, kvs__req *r, const kvb_hash *hashes, size_t nh, size_t *dev)
{
    size_t room = r->cap / s->block_tokens; /* room for any prompt its token buffer holds: a struct reused
                                             * for a longer one (same class) needs no more (the steady state) */
    KVB__ARR_SHRINK(r->pins, 0);
    if (kvo__fit(&r->pins, room > nh ? room : nh) && kvb_pin(s->cfg.device, hashes, nh, r->pins, dev) == KVB_OK)
        stbds_arrsetlen(r->pins, *dev);
    else if (kvb_lookup(s->cfg.device, hashes, nh, dev) != KVB_OK)
        *dev = 0;
}

static int kvs__stage_onboard(kvs_sched *s, kvs__req *r)
{
    kvb_hash *hashes;
    size_t nh = r->len ? (r->len - 1) / s->block_tokens : 0, dev = 0, ext = 0;
    int async = 0;
    r->lower_hit = 0;
    if (!s->conn || !nh || !kvo__fit(&s->hashes, nh)) return 0; /* out of memory: nothing loaded */
    KVB__ARR_SHRINK(s->hashes, 0);
    hashes = stbds_arraddnptr(s->hashes, nh);
    kvs__prompt_hashes(s, r, hashes, nh);
    kvs__pin_prefix(s, r, hashes, nh, &dev);
    kvs_connector_get_num_new_matched_tokens(s->conn, r->id, hashes, nh, dev * s->block_tokens, &ext, &async);
    if (!async) {
        kvs_connector_update_state_after_alloc(s->conn, r->id, 0);
        kvs__unpin_prefix(s, r); /* admitted now: its match takes them */
        return 0;
    }
    kvs_connector_update_state_after_alloc(s->conn, r->id, ext);
    r->lower_hit = ext;
    r->lower_from = dev * s->block_tokens;
    if (r->state == KVS_SLOT_PREEMPTED) kvs__set_state(s, r, KVS_SLOT_ONBOARDING);
    else kvs__set_state(s, r, KVS_SLOT_ONBOARD_STAGED);
    return 1;
}

static void kvs__emit_admit(kvs_sched *s, const kvs__req *r, size_t cached)
{
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_ADMIT;
    e.request = r->id;
    e.u.admit.prompt_tokens = r->len;
    e.u.admit.lower_hit_tokens = r->lower_hit < cached ? r->lower_hit : cached;
    e.u.admit.device_hit_tokens = cached - e.u.admit.lower_hit_tokens;
    e.u.admit.priority = r->priority;
    e.u.admit.preemptions = r->preemptions;
    kvs_bus_publish(s->cfg.bus, &e);
}

/* Whether r could get its blocks once every running request of lower priority is preempted: counted
 * before anything is, so that a request that would not fit even then preempts nobody (they would lose
 * their blocks, and their progress, for nothing). What the victims give back is exact: a block goes
 * back when all of its references are theirs (not one shared with a request that stays, or held by a
 * transfer): a tally per block index, linear in the victims' blocks, each block's references asked
 * once. r's own need is counted generously: its cached device prefix is taken off its need, while the
 * same blocks, when nobody or only victims hold them, are counted as room too (telling them apart needs
 * their indices), so a request that fits is never held back by the count (and one whose prefix sits in
 * such blocks may still preempt for nothing). When the count cannot be made (out of memory), 1: try as
 * before. */
static int kvs__room_after_preempting(kvs_sched *s, const kvs__req *r)
{
    kvb_pool_stats ps;
    const kvb_block *table;
    size_t full = r->len ? (r->len - 1) / s->block_tokens : 0, matched = full, need, have, bound, i, j, n;
    int fits = 0;
    if (kvb_pool_get_stats(s->cfg.device, &ps) != KVB_OK) return 1;
    if (full && kvo__fit(&s->hashes, full)) {
        kvb_hash *h;
        KVB__ARR_SHRINK(s->hashes, 0);
        h = stbds_arraddnptr(s->hashes, full);
        kvs__prompt_hashes(s, r, h, full);
        if (kvb_lookup(s->cfg.device, h, full, &matched) != KVB_OK) matched = full;
    }
    need = (r->len + s->block_tokens - 1) / s->block_tokens - matched;
    have = (size_t)ps.free_blocks + ps.inactive_blocks;
    if (need <= have) return 1;
    bound = have; /* at most every block of every victim: no need to look closer when even that is short */
    for (i = stbds_arrlenu(s->running); i-- > 0;) {
        kvs__req *v = s->running[i];
        if (v == r || v->priority >= r->priority || !v->seq) continue;
        table = NULL;
        n = 0;
        kvb_seq_blocks(v->seq, &table, &n);
        bound += n;
    }
    if (bound < need) return 0;
    if (!s->tally) {
        if (!(s->tally = (uint64_t *)KVB_MALLOC((size_t)ps.num_blocks * sizeof *s->tally))) return 1;
        memset(s->tally, 0, (size_t)ps.num_blocks * sizeof *s->tally);
    }
    KVB__ARR_SHRINK(s->touched, 0);
    for (i = stbds_arrlenu(s->running); i-- > 0 && !fits;) { /* the victims in kvs__victim's order */
        kvs__req *v = s->running[i];
        if (v == r || v->priority >= r->priority || !v->seq) continue;
        table = NULL;
        n = 0;
        kvb_seq_blocks(v->seq, &table, &n);
        for (j = 0; j < n && !fits; j++) {
            uint32_t at = kvb_block_index(table[j].id);
            uint64_t *t = at < ps.num_blocks ? &s->tally[at] : NULL;
            if (t && !*t) { /* first seen: its references, asked once however many victims share it */
                kvb_block_info info;
                if (kvb_block_get_info(s->cfg.device, table[j].id, &info) != KVB_OK || info.refs <= 1) t = NULL;
                else if (kvo__fit(&s->touched, stbds_arrlenu(s->touched) + 1)) {
                    stbds_arrput(s->touched, at);
                    *t = (uint64_t)info.refs << 32;
                } else {
                    fits = 1; /* out of memory: try as before */
                    break;
                }
            }
            if (!t) {
                have++; /* its only reference (or unknown: counted, never held against r) */
            } else {
                uint64_t c = ++*t;
                have += (uint32_t)c == (uint32_t)(c >> 32); /* the last of its references is a victim's */
            }
            fits = have >= need;
        }
    }
    for (i = 0; i < stbds_arrlenu(s->touched); i++) s->tally[s->touched[i]] = 0; /* back to zero for the next */
    return fits;
}

/* Admit r: match the device cache, allocate the rest, schedule its first chunk. 0 when it does not fit;
 * it then preempts nobody unless preempting the candidates could make it fit (kvs__room_after_preempting),
 * and then only until it does. */
static int kvs__admit(kvs_sched *s, kvs__req *r)
{
    size_t cached = 0;
    int planned = 0;
    if (!kvs__seq_open(s, r)) {
        kvs__unpin_prefix(s, r);
        return 0;
    }
    for (;;) { /* the last token is appended on its own, never from the cache (with one token a block,
                * its block could be cached too): the engine always computes at least one token (for
                * its logits) in a block of its own, as in vLLM */
        kvs__req *v;
        size_t len = r->len;
        if (kvb_seq_append(r->seq, r->tokens, len - 1, &cached) == KVB_OK) {
            if (kvb_seq_append_new(r->seq, r->tokens + len - 1, 1) == KVB_OK) {
                kvs__synced(r);
                break;
            }
            kvb_seq_truncate(r->seq, 0);
        }
        v = kvs__victim(s, r->priority, r);
        if (v && !planned) { /* before the first preemption: would all of them be enough? */
            planned = 1;
            if (!kvs__room_after_preempting(s, r)) v = NULL;
        }
        if (!v) {
            kvs__seq_close(r);
            kvs__unpin_prefix(s, r); /* it waits: it holds nothing */
            return 0;
        }
        kvs__preempt(s, v);
    }
    kvs__unpin_prefix(s, r); /* the match holds them now */
    if (s->conn) kvs_connector_release_loads(s->conn, r->id);
    r->computed = (uint32_t)cached;
    r->cached = cached;
    /* the loaded blocks the match reaches: it may stop before their end (evicted once unpinned, or after
     * a gap) or before their start (a block of the device prefix went while they loaded: held since
     * staging, unless that found no memory to list it; they are recomputed, and the tokens it caches
     * are device hits). Only loads staged for this admission count: a request let in without staging
     * (the device had no room for all of its blocks, kvs__admit_queue) keeps the count of an earlier
     * admission, whose loaded blocks it now finds on the device. */
    if (r->state != KVS_SLOT_ONBOARDING || cached <= r->lower_from) r->lower_hit = 0;
    else if (r->lower_hit > cached - r->lower_from) r->lower_hit = cached - r->lower_from;
    r->registered_blocks = cached / s->block_tokens;
    s->stats.cached_tokens += cached;
    s->stats.lower_hit_tokens += r->lower_hit;
    s->stats.admitted++;
    if (kvs__wants(s->cfg.bus, KVS_EV_ADMIT)) kvs__emit_admit(s, r, cached);
    if (r->state == KVS_SLOT_PREEMPTED) kvs__set_state(s, r, KVS_SLOT_INITIALIZED);
    kvs__set_state(s, r, KVS_SLOT_PREFILLING); /* a resumed request prefills what was not cached, then decodes */
    kvs__queue_insert(&s->running, r);
    if (!kvs__schedule_compute(s, r, 0)) kvs__set_state(s, r, KVS_SLOT_SKIPPED_PREFILL);
    return 1;
}

/* Whether the device has room (free or evictable blocks, or those held for r: its pinned prefix and the
 * blocks its loads landed in) for all of r's blocks. Without its loaded blocks, a swapped request whose
 * loads landed waited, and the waiting queue behind it, until nothing ran (kvs__unpin_loads). */
static int kvs__fits(kvs_sched *s, const kvs__req *r)
{
    kvb_pool_stats st;
    size_t need = (r->len + s->block_tokens - 1) / s->block_tokens;
    if (kvb_pool_get_stats(s->cfg.device, &st) != KVB_OK) return 0;
    return need <= (size_t)st.free_blocks + st.inactive_blocks + stbds_arrlenu(r->pins) +
                       (s->conn ? kvs__conn_loaded(s->conn, r->id) : 0);
}

/* The device prefixes held by the requests of queue q (kvs__pin_prefix) go: 1 when one did. */
static int kvs__unpin_queued(kvs_sched *s, kvs__req **q)
{
    size_t i;
    int any = 0;
    for (i = 0; i < stbds_arrlenu(q); i++)
        if (stbds_arrlenu(q[i]->pins)) {
            kvs__unpin_prefix(s, q[i]);
            any = 1;
        }
    return any;
}

/* Loads that landed for queued requests pin their device blocks until those are admitted, and their
 * device prefixes are held from staging on. When a request cannot get in and nothing runs that would
 * give blocks back, they give theirs back (still cached, now evictable; its own too, which it then
 * matches): else it would wait for ever for blocks that wait for it, its own or those of requests queued
 * behind it. 1 when it should be tried again (once a pass). */
static int kvs__unpin_loads(kvs_sched *s, int *tried)
{
    int any;
    if (*tried || !s->conn || stbds_arrlen(s->running)) return 0;
    *tried = 1;
    any = kvs__unpin_queued(s, s->waiting) | kvs__unpin_queued(s, s->swapped) | kvs__unpin_queued(s, s->onboarding);
    return kvs__conn_unpin_loads(s->conn) | any;
}

/* Waiting (or swapped) requests in order, while the budgets last. */
static void kvs__admit_queue(kvs_sched *s, kvs__req ***q)
{
    size_t i = 0;
    int unpinned = 0;
    while (i < stbds_arrlenu(*q) && s->tokens_left && s->seqs_left) {
        kvs__req *r = (*q)[i];
        if (r->preempted_in == s->step_id + 1) { /* preempted while planning this step: not back yet */
            i++;
            continue;
        }
        if (!kvs__fits(s, r)) { /* loads would find no room: wait (a swapped request) or try preempting */
            if (kvs__unpin_loads(s, &unpinned)) continue;
            if (r->swapped) break;
        } else if (r->state != KVS_SLOT_ONBOARDING && kvs__stage_onboard(s, r)) {
            kvs__queue_remove(*q, r);
            kvs__queue_insert(&s->onboarding, r);
            continue;
        }
        kvs__queue_remove(*q, r);
        if (!kvs__admit(s, r)) { /* does not fit: it keeps its place */
            kvs__queue_insert(q, r);
            if (kvs__unpin_loads(s, &unpinned)) continue;
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
        if (s->onboarding[i]->state == KVS_SLOT_ONBOARD_STAGED) kvs__set_state(s, s->onboarding[i], KVS_SLOT_ONBOARDING);
}

/* The step's summary, then the occupancy of every tier. */
static void kvs__emit_step(kvs_sched *s, const kvs_step *st)
{
    kvs_event e;
    kvb_pool_stats ps;
    uint32_t t;
    memset(&e, 0, sizeof e);
    memset(&ps, 0, sizeof ps);
    kvb_pool_get_stats(s->cfg.device, &ps);
    e.kind = KVS_EV_STEP;
    e.u.step.step = st->id;
    e.u.step.prefill = (uint32_t)st->num_prefill;
    e.u.step.decode = (uint32_t)st->num_decode;
    e.u.step.tokens = (uint32_t)st->num_tokens;
    e.u.step.preempted = (uint32_t)st->num_preempted;
    e.u.step.waiting = (uint32_t)stbds_arrlenu(s->waiting);
    e.u.step.running = (uint32_t)stbds_arrlenu(s->running);
    e.u.step.swapped = (uint32_t)stbds_arrlenu(s->swapped);
    e.u.step.onboarding = (uint32_t)stbds_arrlenu(s->onboarding);
    e.u.step.device_used = ps.num_blocks - ps.free_blocks;
    e.u.step.device_blocks = ps.num_blocks;
    if (kvs__wants(s->cfg.bus, KVS_EV_STEP)) kvs_bus_publish(s->cfg.bus, &e);
    if (!kvs__wants(s->cfg.bus, KVS_EV_TIERS)) return;
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_TIERS;
    for (t = 0; t < 4; t++) { /* G1's stats are those of the step event above */
        kvo_pipeline_config pc;
        if (t && (!s->cfg.tiers ||
                  kvo_pipeline_get_config(kvo_manager_pipeline(s->cfg.tiers, t - 1, 0), &pc) != KVO_OK ||
                  kvb_pool_get_stats(pc.dst, &ps) != KVB_OK))
            break;
        e.u.tiers.used[t] = ps.num_blocks - ps.free_blocks;
        e.u.tiers.total[t] = ps.num_blocks;
        e.u.tiers.num_tiers = t + 1;
        {
            kvb_pool_config bc;
            if (kvb_pool_get_config(t ? pc.dst : s->cfg.device, &bc) == KVB_OK)
                e.u.tiers.policies |= ((uint32_t)bc.eviction & 0xffu) << (8 * t);
        }
        if (!t) e.u.tiers.device_step = ps.fol_class_step; /* FOL: the class step in use */
        if (!t) e.u.tiers.device_tails = ps.fol_tails_first; /* .. and its rule for tails */
    }
    kvs_bus_publish(s->cfg.bus, &e);
}

static kvs_result kvs__sched_step(kvs_sched *sched, kvs_step *out)
{
    if (!sched || !out) return KVS_EINVAL;
    if (sched->in_step) return KVS_ESTEP;
    if (!kvs__out_room(sched, stbds_arrlenu(sched->all))) return KVS_ENOMEM; /* adds during the last step */
    if (kvs__wants(sched->cfg.bus, KVS_EV_RUN_STEP)) {
        kvs_event e;
        memset(&e, 0, sizeof e);
        e.kind = KVS_EV_RUN_STEP;
        e.u.run.step = sched->step_id + 1;
        kvs__emit_input(sched, &e, NULL, 0);
    }
    KVB__ARR_SHRINK(sched->prefill, 0);
    KVB__ARR_SHRINK(sched->decode, 0);
    KVB__ARR_SHRINK(sched->preempted, 0);
    KVB__ARR_SHRINK(sched->planned[0], 0);
    KVB__ARR_SHRINK(sched->planned[1], 0);
    KVB__ARR_SHRINK(sched->commits[0], 0);
    KVB__ARR_SHRINK(sched->commits[1], 0);
    sched->decode_tokens = 0;
    sched->next_append = 0;
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
    if (kvs__wants(sched->cfg.bus, KVS_EV_STEP) || kvs__wants(sched->cfg.bus, KVS_EV_TIERS))
        kvs__emit_step(sched, out);
    return KVS_OK;
}

/* r's blocks registered up to its computed tokens go to the connector (eager mode stores them). */
static void kvs__note_registered(kvs_sched *s, kvs__req *r)
{
    size_t full = r->computed / s->block_tokens;
    if (full <= r->registered_blocks) return;
    if (s->conn) kvs_connector_note_registered(s->conn, r->id, r->table + r->registered_blocks, full - r->registered_blocks);
    r->registered_blocks = full;
}

/* After an item's tokens were committed: counts, and the blocks that filled go to the connector. */
static void kvs__committed(kvs_sched *s, kvs__req *r, size_t done)
{
    size_t before = r->computed / s->block_tokens;
    if (done > r->computed) {
        s->stats.computed_tokens += done - r->computed;
        r->computed = (uint32_t)done;
    }
    if (r->computed / s->block_tokens > before && !r->owed) kvs__note_registered(s, r); /* owed: when repaid */
    if (r->state == KVS_SLOT_PREFILLING && r->computed >= r->len) kvs__set_state(s, r, KVS_SLOT_DECODING);
}

/* The request of a step's item, NULL when it ended during the step (its first line only). */
static kvs__req *kvs__item_req(kvs__req *r)
{
    return r && r->table && r->state != KVS_SLOT_FINISHED ? r : NULL;
}

/* The tokens that fill the last block of a decoding request (kvs__must_push) go to its sequence: in one
 * batch, before the commit. The block is there and partial: nothing to allocate. */
static void kvs__push_fills(kvs_sched *s)
{
    size_t i, k, done = 0;
    KVB__ARR_SHRINK(s->batch, 0);
    KVB__ARR_SHRINK(s->batch_seqs, 0);
    KVB__ARR_SHRINK(s->batch_tokens, 0);
    KVB__ARR_SHRINK(s->batch_counts, 0);
    for (i = 0; i < stbds_arrlenu(s->commits[1]); i++) {
        kvs__req *r = kvs__item_req(s->commits[1][i]);
        if (!r || r->in_seq == r->len) continue;
        stbds_arrput(s->batch, r);
        stbds_arrput(s->batch_seqs, r->seq);
        stbds_arrput(s->batch_tokens, r->tokens + r->in_seq);
        stbds_arrput(s->batch_counts, r->len - r->in_seq);
    }
    k = stbds_arrlenu(s->batch);
    if (k) kvb_seq_append_many(s->batch_seqs, s->batch_tokens, s->batch_counts, k, &done);
    for (i = 0; i < done; i++) kvs__synced(s->batch[i]); /* one that failed is committed as far as its seq goes */
}

/* The batch of kvs__commit_items found no memory for its events (nothing committed): each sequence alone
 * needs less; those that still find none owe their commit. */
static KVB__NOINLINE void kvs__commit_apart(kvs_sched *s)
{
    size_t a, i, k = 0;
    for (a = 0; a < 2; a++)
        for (i = 0; i < stbds_arrlenu(s->commits[a]); i++) { /* the batch's requests, in its order */
            kvs__req *r = kvs__item_req(s->commits[a][i]);
            if (!r) continue;
            if (kvb_seq_commit(s->batch_seqs[k], s->batch_counts[k]) == KVB_ENOMEM) kvs__owe(s, r, s->batch_counts[k]);
            k++;
        }
}

/* Every owed commit tried again; those that go through are noted to the connector now. */
static KVB__NOINLINE void kvs__repay_all(kvs_sched *s)
{
    size_t i;
    for (i = 0; i < stbds_arrlenu(s->all) && s->owing; i++) {
        kvs__req *r = s->all[i];
        if (r->owed && kvs__repay(s, r)) kvs__note_registered(s, r);
    }
}

/* Commit what the step's items computed: the sequences where a block filled (kvs_sched.commits; for the
 * others a commit would change nothing) in one batch, one lock of the device pool, in the step's order;
 * then the counts and connector notes of the prefills and of the decodes that filled a block, in the
 * step's order. The other decodes are not visited (kvs__unsettled); their tokens are counted at once.
 * Commits that find no memory for the pool's events are owed, and tried again at each complete (a
 * decode may not fill a block for many steps) and before the request's blocks go (kvs__drop_blocks). */
static void kvs__commit_items(kvs_sched *s)
{
    size_t a, i, k, n;
    kvs__push_fills(s);
    KVB__ARR_SHRINK(s->batch_seqs, 0);
    KVB__ARR_SHRINK(s->batch_counts, 0);
    for (a = 0; a < 2; a++)
        for (i = 0; i < stbds_arrlenu(s->commits[a]); i++) {
            kvs__req *r = kvs__item_req(s->commits[a][i]);
            if (!r) continue;
            stbds_arrput(s->batch_seqs, r->seq);
            stbds_arrput(s->batch_counts, a ? r->in_seq : s->prefill[r->item].num_computed + s->prefill[r->item].num_new);
        }
    k = stbds_arrlenu(s->batch_seqs);
    if (k && kvb_seq_commit_many(s->batch_seqs, s->batch_counts, k) != KVB_OK) kvs__commit_apart(s);
    for (i = 0; i < stbds_arrlenu(s->prefill); i++) {
        kvs__req *r = kvs__item_req(s->planned[0][i]);
        if (r) kvs__committed(s, r, s->prefill[i].num_computed + s->prefill[i].num_new);
    }
    for (i = 0, n = stbds_arrlenu(s->commits[1]); i < n; i++) { /* the other decodes: kvs__unsettled */
        kvs__req *r = kvs__item_req(s->commits[1][i]);
        if (r) kvs__committed(s, r, r->len);
    }
    s->stats.computed_tokens += s->decode_tokens;
    s->decode_tokens = 0;
    if (KVB__UNLIKELY(s->owing)) kvs__repay_all(s);
}

static kvs_result kvs__sched_complete(kvs_sched *sched, const kvs_step *step)
{
    size_t i, a;
    if (!sched || !step) return KVS_EINVAL;
    if (!sched->in_step || step->id != sched->step_id) return KVS_ESTEP;
    if (kvs__wants(sched->cfg.bus, KVS_EV_COMPLETE)) {
        kvs_event e;
        memset(&e, 0, sizeof e);
        e.kind = KVS_EV_COMPLETE;
        e.u.run.step = step->id;
        kvs__emit_input(sched, &e, NULL, 0);
    }
    kvs__commit_items(sched);
    sched->in_step = 0;
    for (a = 0; a < 2 && sched->drops; a++) { /* requests that ended during the step give their blocks back now */
        for (i = 0; i < stbds_arrlenu(sched->planned[a]); i++) {
            kvs__req *r = sched->planned[a][i];
            if (r && r->drop_after_step) {
                r->drop_after_step = 0;
                sched->drops--;
                kvs__drop_blocks(sched, r);
                if (r->released) {
                    r->id = 0;
                    kvs__req_spare(sched, r);
                }
            }
        }
    }
    return KVS_OK;
}

/* Finishing -> Finished: blocks released (they stay cached), connector told. */
static kvs_result kvs__end(kvs_sched *s, kvs__req *r, int aborted)
{
    kvs_result res;
    kvs__settle(s, r);
    if ((res = kvs__set_state(s, r, KVS_SLOT_FINISHING)) != KVS_OK) return res;
    kvs__unqueue(s, r);
    if (s->in_step && kvs__scheduled(s, r)) { /* the engine holds its block table */
        r->drop_after_step = 1;
        s->drops++;
        if (kvs__item_list(s, r) && !kvs__drop_commit(s, 1, r)) s->decode_tokens -= s->decode[r->item].num_new;
    }
    else kvs__drop_blocks(s, r);
    kvs__set_state(s, r, KVS_SLOT_FINISHED);
    if (aborted) s->stats.aborted++;
    else s->stats.finished++;
    return KVS_OK;
}

/* An engine appends the step's sampled tokens in about the order of the step's decode items. The request
 * at s->next_append is tried before the id map (a sequential read instead of a random probe): a struct
 * is never freed while the scheduler lives, and a released one has id 0 until it is reused. */
static kvs__req *kvs__find_appended(kvs_sched *s, uint64_t id)
{
    size_t i = s->next_append;
    /* id 0 is never given out: a released request's struct, still named by the last step, has it */
    if (id && !s->in_step && i < stbds_arrlenu(s->planned[1]) && s->planned[1][i]->id == id) return s->planned[1][i];
    return kvs__find(s, id);
}

/* After r's append: the next append is expected for the item after r's; the requests of the items a
 * little further on, and the token slots of those nearer, are fetched now. */
static void kvs__expect_appends(kvs_sched *s, const kvs__req *r)
{
    size_t i = r->item, n = stbds_arrlenu(s->planned[1]);
    if (r->planned != s->step_id || i >= n || s->planned[1][i] != r) return; /* not a decode of the last step */
    s->next_append = i + 1;
    if (i + 16 < n) KVB__PREFETCH(s->planned[1][i + 16]);
    if (i + 8 < n) {
        const kvs__req *next = s->planned[1][i + 8];
        KVB__PREFETCH(next->tokens + next->len);
    }
}

static kvs_result kvs__sched_append(kvs_sched *sched, uint64_t request, const uint32_t *tokens, size_t n)
{
    kvs__req *r;
    if (!sched || (n && !tokens)) return KVS_EINVAL;
    if (!(r = kvs__find_appended(sched, request))) return KVS_ENOTFOUND;
    if (kvs__wants(sched->cfg.bus, KVS_EV_APPEND)) {
        kvs_event e;
        memset(&e, 0, sizeof e);
        e.kind = KVS_EV_APPEND;
        e.request = request;
        e.u.append.n = n;
        if (n) memcpy(e.u.append.words, tokens, (n < 10 ? n : 10) * sizeof *tokens); /* n = 0: tokens may be NULL */
        kvs__emit_input(sched, &e, n > 10 ? tokens + 10 : NULL, n < 10 ? 0 : n - 10);
    }
    if (r->state != KVS_SLOT_DECODING && r->state != KVS_SLOT_SKIPPED_DECODE) return KVS_ESTATE;
    kvs__expect_appends(sched, r);
    kvs__settle(sched, r);
    if (r->len > r->computed) return KVS_ESTATE; /* the last token is not computed yet */
    if (!n) return KVS_OK;
    if (n >= UINT32_MAX - r->len || (r->len + n + sched->block_tokens - 1) / sched->block_tokens > sched->device_blocks)
        return KVS_ETOOBIG; /* it could never be scheduled again */
    if (r->end != UINT32_MAX && n > r->end - r->len) return KVS_EINVAL; /* past max_new_tokens */
    if (n > sched->cfg.max_tokens && r->len + n < r->end)
        return KVS_ETOOBIG; /* a decode computes all of its tokens in one step: no step has room for these */
    if (!kvs__reserve(r, r->len + n)) return KVS_ENOMEM;
    if (n == 1) r->tokens[r->len] = *tokens;
    else memcpy(r->tokens + r->len, tokens, n * sizeof *tokens);
    r->len += (uint32_t)n;
    if (r->len >= r->end) return kvs__end(sched, r, 0); /* max_new_tokens generated */
    return KVS_OK;
}

static kvs_result kvs__sched_finish(kvs_sched *sched, uint64_t request)
{
    kvs__req *r;
    if (!sched) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    if (kvs__wants(sched->cfg.bus, KVS_EV_FINISH)) kvs__emit_call(sched, KVS_EV_FINISH, request);
    return kvs__end(sched, r, 0);
}

static kvs_result kvs__sched_abort(kvs_sched *sched, uint64_t request)
{
    kvs__req *r;
    if (!sched) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    if (kvs__wants(sched->cfg.bus, KVS_EV_ABORT)) kvs__emit_call(sched, KVS_EV_ABORT, request);
    return kvs__end(sched, r, 1);
}

static kvs_result kvs__sched_release(kvs_sched *sched, uint64_t request)
{
    kvs__req *r;
    if (!sched) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    if (kvs__wants(sched->cfg.bus, KVS_EV_RELEASE)) kvs__emit_call(sched, KVS_EV_RELEASE, request);
    if (r->state != KVS_SLOT_FINISHED) return KVS_ESTATE;
    (void)kvs__id_del(&sched->reqs, request);
    stbds_arrdelswap(sched->all, r->at);
    if (r->at < stbds_arrlenu(sched->all)) sched->all[r->at]->at = r->at;
    if (r->drop_after_step) {
        r->released = 1; /* the engine holds its block table until the step completes */
    } else {
        r->id = 0;
        kvs__req_spare(sched, r);
    }
    return KVS_OK;
}

/* The public scheduler calls: the bodies above between the bus's hooks. */

KVS_API kvs_result kvs_sched_add(kvs_sched *sched, const kvs_request *request, uint64_t *out_id)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_ADD, 0, kvs__sched_add(sched, request, out_id), &sched->in_call);
}

KVS_API kvs_result kvs_sched_step(kvs_sched *sched, kvs_step *out)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_STEP, 0, kvs__sched_step(sched, out), &sched->in_call);
}

KVS_API kvs_result kvs_sched_complete(kvs_sched *sched, const kvs_step *step)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_COMPLETE, 0, kvs__sched_complete(sched, step), &sched->in_call);
}

KVS_API kvs_result kvs_sched_append(kvs_sched *sched, uint64_t request, const uint32_t *tokens, size_t n)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_APPEND, request,
                kvs__sched_append(sched, request, tokens, n), &sched->in_call);
}

KVS_API kvs_result kvs_sched_finish(kvs_sched *sched, uint64_t request)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_FINISH, request, kvs__sched_finish(sched, request),
                &sched->in_call);
}

KVS_API kvs_result kvs_sched_abort(kvs_sched *sched, uint64_t request)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_ABORT, request, kvs__sched_abort(sched, request),
                &sched->in_call);
}

KVS_API kvs_result kvs_sched_release(kvs_sched *sched, uint64_t request)
{
    if (!sched) return KVS_EINVAL;
    KVS__HOOKED(sched->armed, sched->cfg.bus, KVS_CALL_RELEASE, request, kvs__sched_release(sched, request),
                &sched->in_call);
}

KVS_API kvs_result kvs_sched_get_slot(kvs_sched *sched, uint64_t request, kvs_slot_info *out)
{
    kvs__req *r;
    if (!sched || !out) return KVS_EINVAL;
    if (!(r = kvs__find(sched, request))) return KVS_ENOTFOUND;
    memset(out, 0, sizeof *out);
    out->state = r->state;
    out->priority = r->priority;
    out->num_tokens = r->len;
    out->num_computed = kvs__computed(sched, r);
    out->num_cached = r->cached;
    out->num_lower_hit_tokens = r->lower_hit;
    out->generated = (uint32_t)(r->len - r->num_prompt);
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

/* ---- replay ------------------------------------------------------------------------------------- */

/* Request ids of the recorded run and of the fresh one, paired in order of addition: each map gives the
 * pair's place + 1 (kvs__idmap takes no NULL value). Every array and map grows with a check, so a replay
 * out of memory ends in KVS_ENOMEM instead of stb_ds writing through a failed realloc. */
typedef struct kvs__id_pair { uint64_t recorded, fresh; } kvs__id_pair;

typedef struct kvs__replay {
    kvs_event *got;              /* stb_ds: the fresh run's decisions */
    size_t next;                 /* the first not compared yet */
    kvs__id_pair *pairs;         /* stb_ds */
    kvs__idmap to_fresh, to_recorded;
    uint32_t *words;             /* stb_ds: an input's TOKENS */
    int nomem;                   /* the replaying thread ran out of memory */
    int got_nomem;               /* the collector could not keep a decision (under bus->lock: pipelines'
                                    threads publish too) */
    kvs_step step;
} kvs__replay;

static void kvs__replay_collect(void *user, const kvs_event *e)
{
    kvs__replay *rp = (kvs__replay *)user;
    if (!kvb__arr_fit((void **)&rp->got, sizeof *rp->got, stbds_arrlenu(rp->got) + 1)) {
        rp->got_nomem = 1;
        return;
    }
    stbds_arrput(rp->got, *e);
}

/* The other run's id of `id` (0: none). */
static uint64_t kvs__map(const kvs__replay *rp, const kvs__idmap *m, uint64_t id, int to_fresh)
{
    size_t at = (size_t)(uintptr_t)kvs__id_get(m, id);
    return !at ? 0 : to_fresh ? rp->pairs[at - 1].fresh : rp->pairs[at - 1].recorded;
}

/* Appends n words to rp->words; 0 out of memory (rp->nomem set). */
static int kvs__replay_put_words(kvs__replay *rp, const uint32_t *w, size_t n)
{
    if (!n) return 1;
    if (!kvb__arr_fit((void **)&rp->words, sizeof *rp->words, stbds_arrlenu(rp->words) + n)) return !(rp->nomem = 1);
    memcpy(stbds_arraddnptr(rp->words, n), w, n * sizeof *w);
    return 1;
}

/* `first` (carried by the input itself), then the words of the TOKENS events after events[at]; returns
 * the index after them. */
static size_t kvs__replay_words(kvs__replay *rp, const kvs_event *events, size_t n, size_t at, const uint32_t *first,
                                size_t n_first)
{
    KVB__ARR_SHRINK(rp->words, 0);
    kvs__replay_put_words(rp, first, n_first);
    while (++at < n && events[at].kind == KVS_EV_TOKENS && events[at].u.tokens.n <= 11)
        kvs__replay_put_words(rp, events[at].u.tokens.words, events[at].u.tokens.n);
    return at;
}

/* Room for one more pair before the add, so an added request is always mapped. */
static int kvs__replay_pair_room(kvs__replay *rp)
{
    size_t n = stbds_arrlenu(rp->pairs);
    return kvb__arr_fit((void **)&rp->pairs, sizeof *rp->pairs, n + 1) && kvs__id_room(&rp->to_fresh) &&
           kvs__id_room(&rp->to_recorded);
}

static void kvs__replay_add(kvs_sched *s, kvs__replay *rp, const kvs_event *e)
{
    kvs_request rq;
    uint64_t extra[KVB_MAX_EXTRA_KEYS], id = 0;
    size_t i, ne = e->u.add.num_extra;
    kvs_result r;
    if (rp->nomem || ne > KVB_MAX_EXTRA_KEYS || stbds_arrlenu(rp->words) != 2 * ne + e->u.add.num_prompt) return;
    if (!kvs__replay_pair_room(rp)) {
        rp->nomem = 1;
        return;
    }
    for (i = 0; i < ne; i++) extra[i] = (uint64_t)rp->words[2 * i] | (uint64_t)rp->words[2 * i + 1] << 32;
    memset(&rq, 0, sizeof rq);
    rq.prompt = rp->words + 2 * ne;
    rq.num_prompt = (size_t)e->u.add.num_prompt;
    rq.max_new_tokens = e->u.add.max_new_tokens;
    rq.priority = e->u.add.priority;
    rq.salt = e->u.add.salt;
    rq.extra = extra;
    rq.num_extra = ne;
    if ((r = kvs_sched_add(s, &rq, &id)) == KVS_ENOMEM) rp->nomem = 1; /* the recorded add had succeeded */
    if (r != KVS_OK) return;
    kvs__id_pair pair = { e->request, id };
    stbds_arrput(rp->pairs, pair); /* within the room made above */
    kvs__id_put(&rp->to_fresh, e->request, (void *)(uintptr_t)stbds_arrlenu(rp->pairs));
    kvs__id_put(&rp->to_recorded, id, (void *)(uintptr_t)stbds_arrlenu(rp->pairs));
}

/* Replays one input event (and its TOKENS); returns the index of the next event. */
static size_t kvs__replay_input(kvs_sched *s, kvs__replay *rp, const kvs_event *events, size_t n, size_t at)
{
    const kvs_event *e = &events[at];
    uint64_t id = kvs__map(rp, &rp->to_fresh, e->request, 1);
    size_t next = at + 1;
    switch ((kvs_event_kind)e->kind) {
    case KVS_EV_ADD:
        next = kvs__replay_words(rp, events, n, at, NULL, 0);
        kvs__replay_add(s, rp, e);
        break;
    case KVS_EV_APPEND: { /* its first tokens inline, the rest in TOKENS */
        size_t inline_n = e->u.append.n < 10 ? (size_t)e->u.append.n : 10;
        next = kvs__replay_words(rp, events, n, at, e->u.append.words, inline_n);
        if (!rp->nomem && kvs_sched_append(s, id, rp->words, stbds_arrlenu(rp->words)) == KVS_ENOMEM) rp->nomem = 1;
        break;
    }
    case KVS_EV_RUN_STEP: kvs_sched_step(s, &rp->step); break;
    case KVS_EV_COMPLETE: kvs_sched_complete(s, &rp->step); break;
    case KVS_EV_FINISH: kvs_sched_finish(s, id); break;
    case KVS_EV_ABORT: kvs_sched_abort(s, id); break;
    case KVS_EV_RELEASE: kvs_sched_release(s, id); break;
    default: break;
    }
    return next;
}

static int kvs__is_input(uint16_t kind) { return kind >= KVS_EV_ADD && kind <= KVS_EV_RELEASE; }

#define KVS__INPUTS (KVS_EV_MASK(KVS_EV_RELEASE + 1) - KVS_EV_MASK(KVS_EV_ADD)) /* ADD .. RELEASE */

/* The fresh decision equals the recorded one: kind, request (mapped back) and payload. */
static int kvs__same_decision(kvs__replay *rp, const kvs_event *want, const kvs_event *got)
{
    uint64_t req = got->request ? kvs__map(rp, &rp->to_recorded, got->request, 0) : 0;
    return want->kind == got->kind && want->request == req && memcmp(&want->u, &got->u, sizeof want->u) == 0;
}

KVS_API kvs_result kvs_replay(kvs_sched *fresh, kvs_bus *bus, const kvs_event *events, size_t n,
                              uint64_t compare_kinds, kvs_replay_report *report)
{
    kvs__replay rp;
    kvs_replay_report rep;
    uint32_t sub;
    size_t i = 0;
    kvs_result r = KVS_OK;
    if (!fresh || !bus || (n && !events) || fresh->cfg.bus != bus) return KVS_EINVAL;
    if (!compare_kinds) compare_kinds = KVS_EV_DECISIONS;
    compare_kinds &= ~KVS__INPUTS; /* replayed, not compared: the collector would take the fresh ones for decisions */
    if (!compare_kinds) return KVS_EINVAL; /* a subscription to no kind would be one to every kind */
    memset(&rp, 0, sizeof rp);
    memset(&rep, 0, sizeof rep);
    if ((r = kvs_bus_subscribe(bus, compare_kinds, kvs__replay_collect, &rp, &sub)) != KVS_OK) return r;
    while (i < n && r == KVS_OK) {
        const kvs_event *e = &events[i];
        if (kvs__is_input(e->kind)) {
            rep.inputs++;
            i = kvs__replay_input(fresh, &rp, events, n, i);
            pthread_mutex_lock(&bus->lock); /* the collector sets got_nomem under it */
            if (rp.nomem || rp.got_nomem) r = KVS_ENOMEM;
            pthread_mutex_unlock(&bus->lock);
            continue;
        }
        if (e->kind < 64 && (compare_kinds & KVS_EV_MASK(e->kind))) {
            pthread_mutex_lock(&bus->lock); /* the collector runs under it */
            if (rp.nomem || rp.got_nomem) {
                r = KVS_ENOMEM;
            } else if (rp.next >= stbds_arrlenu(rp.got) || !kvs__same_decision(&rp, e, &rp.got[rp.next])) {
                rep.mismatch_seq = e->seq;
                rep.expected = *e;
                if (rp.next < stbds_arrlenu(rp.got)) rep.got = rp.got[rp.next];
                r = KVS_EREPLAY;
            } else {
                rep.compared++;
                rp.next++;
            }
            pthread_mutex_unlock(&bus->lock);
        }
        i++;
    }
    kvs_bus_unsubscribe(bus, sub);
    if (r == KVS_OK && (rp.nomem || rp.got_nomem)) r = KVS_ENOMEM; /* a decision made after the last input */
    if (r == KVS_OK && rp.next < stbds_arrlenu(rp.got)) { /* the fresh run decided more */
        rep.mismatch_seq = n ? events[n - 1].seq + 1 : 1;
        rep.got = rp.got[rp.next];
        r = KVS_EREPLAY;
    }
    stbds_arrfree(rp.got);
    stbds_arrfree(rp.pairs);
    kvs__id_free(&rp.to_fresh);
    kvs__id_free(&rp.to_recorded);
    stbds_arrfree(rp.words);
    if (report) *report = rep;
    return r;
}

/* ---- metrics ------------------------------------------------------------------------------------ */

static void kvs__family(kvs__text *t, const char *name, const char *type, const char *help)
{
    kvs__printf(t, "# HELP kvcache_%s %s\n# TYPE kvcache_%s %s\n", name, help, name, type);
}

/* What kvs_metrics_write reports, read once (each part under its own lock, the scheduler's on its own
 * thread): both passes, the measuring one and the writing one, render this, so the length measured is
 * the length written however the counters move meanwhile (pipelines and pools count from their threads). */
typedef struct kvs__metrics_snap {
    kvs_sched_stats sched;                 /* with the queue lengths */
    int has_bus;
    uint64_t events;                       /* the bus's sequence */
    uint32_t num_pools;
    kvb_pool_stats pool[KVO_MAX_TIERS];    /* G1, then each pipeline's destination down the chain: the
                                              place is the tier label, as on the pipelines' series */
    int has_pipelines;
    unsigned char pipeline[2][KVO_MAX_TIERS]; /* [up][tier]: the manager has that pipeline */
    kvo_manager_stats pipelines;
    int has_disk;
    uint32_t disk_tier;                    /* the tier the disk backend writes into */
    kvo_disk_stats disk;
} kvs__metrics_snap;

static void kvs__metrics_read(kvs__metrics_snap *m, kvs_sched *s, kvo_backend *disk)
{
    kvb_pool *pools[KVO_MAX_TIERS];
    uint32_t i, up;
    memset(m, 0, sizeof *m);
    kvs_sched_get_stats(s, &m->sched);
    if (s->cfg.bus) {
        pthread_mutex_lock(&s->cfg.bus->lock);
        m->events = s->cfg.bus->seq;
        pthread_mutex_unlock(&s->cfg.bus->lock);
        m->has_bus = 1;
    }
    pools[m->num_pools++] = s->cfg.device;
    for (i = 0; s->cfg.tiers && i + 1 < KVO_MAX_TIERS; i++) {
        kvo_pipeline_config pc;
        if (kvo_pipeline_get_config(kvo_manager_pipeline(s->cfg.tiers, i, 0), &pc) != KVO_OK) break;
        pools[m->num_pools++] = pc.dst;
    }
    for (i = 0; i < m->num_pools; i++) kvb_pool_get_stats(pools[i], &m->pool[i]);
    if (s->cfg.tiers && kvo_manager_get_stats(s->cfg.tiers, &m->pipelines) == KVO_OK) {
        m->has_pipelines = 1;
        for (up = 0; up < 2; up++)
            for (i = 0; i < KVO_MAX_TIERS; i++)
                m->pipeline[up][i] = kvo_manager_pipeline(s->cfg.tiers, i, (int)up) != NULL;
    }
    if (disk && kvo_disk_backend_stats(disk, &m->disk) == KVO_OK) {
        m->has_disk = 1;
        for (i = 0; s->cfg.tiers && i + 1 < KVO_MAX_TIERS; i++) {
            kvo_pipeline_config pc;
            if (kvo_pipeline_get_config(kvo_manager_pipeline(s->cfg.tiers, i, 0), &pc) == KVO_OK && pc.backend == disk)
                m->disk_tier = i + 1; /* the pipeline's destination */
        }
    }
}

/* Pool counters and gauges, one family at a time across every tier. */
static void kvs__pool_metrics(kvs__text *t, const kvs__metrics_snap *m)
{
    static const struct { const char *name, *type, *help; size_t off; } rows[] = {
        {"lookups_total", "counter", "Prefix lookups (kvb_match calls).", offsetof(kvb_pool_stats, lookups)},
        {"lookup_blocks_total", "counter", "Block hashes looked up.", offsetof(kvb_pool_stats, lookup_blocks)},
        {"hit_blocks_total", "counter", "Blocks found by prefix lookups.", offsetof(kvb_pool_stats, hit_blocks)},
        {"hit_tokens_total", "counter", "Tokens in blocks found by prefix lookups.",
         offsetof(kvb_pool_stats, hit_tokens)},
        {"allocations_total", "counter", "Blocks allocated.", offsetof(kvb_pool_stats, allocations)},
        {"evictions_total", "counter", "Cached blocks evicted for reuse.", offsetof(kvb_pool_stats, evictions)},
        {"registrations_total", "counter", "Blocks registered.", offsetof(kvb_pool_stats, registrations)},
        {"dedups_total", "counter", "Registrations that found the block already cached.",
         offsetof(kvb_pool_stats, dedups)},
        {"invalidated_total", "counter", "Cached blocks dropped as bad (a lower tier's copy failed its check).",
         offsetof(kvb_pool_stats, invalidated)}};
    const kvb_pool_stats *st = m->pool;
    uint32_t i, n = m->num_pools;
    size_t r;
    for (r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        kvs__family(t, rows[r].name, rows[r].type, rows[r].help);
        for (i = 0; i < n; i++) {
            uint64_t v;
            memcpy(&v, (const unsigned char *)&st[i] + rows[r].off, sizeof v);
            kvs__printf(t, "kvcache_%s{tier=\"%u\"} %llu\n", rows[r].name, i, (unsigned long long)v);
        }
    }
    kvs__family(t, "blocks", "gauge", "Blocks by state: free, active (referenced), inactive (cached, evictable).");
    for (i = 0; i < n; i++)
        kvs__printf(t, "kvcache_blocks{tier=\"%u\",state=\"free\"} %u\nkvcache_blocks{tier=\"%u\",state=\"active\"} %u\n"
                       "kvcache_blocks{tier=\"%u\",state=\"inactive\"} %u\n",
                    i, st[i].free_blocks, i, st[i].active_blocks, i, st[i].inactive_blocks);
    kvs__family(t, "capacity_blocks", "gauge", "Blocks in the pool.");
    for (i = 0; i < n; i++) kvs__printf(t, "kvcache_capacity_blocks{tier=\"%u\"} %u\n", i, st[i].num_blocks);
    kvs__family(t, "cached_hashes", "gauge", "Distinct block hashes that can be matched.");
    for (i = 0; i < n; i++) kvs__printf(t, "kvcache_cached_hashes{tier=\"%u\"} %u\n", i, st[i].cached_hashes);
}

/* Pipeline counters: offload into tier t + 1 (direction "offload", tier = destination) and onboarding
 * from tier t (direction "onboard", tier = source). */
static void kvs__pipeline_metrics(kvs__text *t, const kvs__metrics_snap *m)
{
    static const struct { const char *name, *type, *help; size_t off; int u32; } rows[] = {
        {"transfer_blocks_total", "counter", "Blocks copied and registered in the destination.",
         offsetof(kvo_pipeline_stats, transferred), 0},
        {"transfer_bytes_total", "counter", "Bytes copied.", offsetof(kvo_pipeline_stats, bytes), 0},
        {"transfer_present_blocks_total", "counter", "Blocks already in the destination (deduplicated).",
         offsetof(kvo_pipeline_stats, present), 0},
        {"transfer_skipped_blocks_total", "counter", "Blocks refused by a policy.",
         offsetof(kvo_pipeline_stats, skipped), 0},
        {"transfer_dropped_blocks_total", "counter", "Blocks evicted before they could be copied.",
         offsetof(kvo_pipeline_stats, dropped), 0},
        {"transfer_failed_blocks_total", "counter", "Blocks the backend failed to copy.",
         offsetof(kvo_pipeline_stats, failed), 0},
        {"transfer_cancelled_total", "counter", "Transfers cancelled.", offsetof(kvo_pipeline_stats, cancelled), 0},
        {"transfer_batches_total", "counter", "Backend jobs.", offsetof(kvo_pipeline_stats, batches), 0},
        {"transfer_dest_full_total", "counter", "Transfers that found the destination full.",
         offsetof(kvo_pipeline_stats, dest_full), 0},
        {"inflight_blocks", "gauge", "Blocks upgraded and not landed yet (on deck or being copied).",
         offsetof(kvo_pipeline_stats, in_flight_blocks), 1}};
    const kvo_manager_stats *ms = &m->pipelines;
    size_t r;
    uint32_t tier, up;
    if (!m->has_pipelines) return;
    for (r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        kvs__family(t, rows[r].name, rows[r].type, rows[r].help);
        for (up = 0; up < 2; up++)
            for (tier = up; tier < KVO_MAX_TIERS; tier++) {
                const kvo_pipeline_stats *ps = up ? &ms->up[tier] : &ms->down[tier];
                uint64_t v = 0;
                uint32_t v32;
                if (!m->pipeline[up][tier]) continue;
                if (rows[r].u32) {
                    memcpy(&v32, (const unsigned char *)ps + rows[r].off, sizeof v32);
                    v = v32;
                } else {
                    memcpy(&v, (const unsigned char *)ps + rows[r].off, sizeof v);
                }
                kvs__printf(t, "kvcache_%s{tier=\"%u\",direction=\"%s\"} %llu\n", rows[r].name, up ? tier : tier + 1,
                            up ? "onboard" : "offload", (unsigned long long)v);
            }
    }
    kvs__family(t, "onboard_joined_blocks_total", "counter",
                "Blocks to onboard that were already in flight to G1 for another request: waited for, not copied.");
    for (tier = 1; tier < KVO_MAX_TIERS; tier++)
        if (m->pipeline[1][tier])
            kvs__printf(t, "kvcache_onboard_joined_blocks_total{tier=\"%u\"} %llu\n", tier,
                        (unsigned long long)ms->up[tier].joined);
}

static void kvs__disk_metrics(kvs__text *t, const kvs__metrics_snap *m)
{
    if (!m->has_disk) return;
    kvs__family(t, "checksum_errors_total", "counter", "Blocks read back whose checksum did not match.");
    kvs__printf(t, "kvcache_checksum_errors_total{tier=\"%u\"} %llu\n", m->disk_tier,
                (unsigned long long)m->disk.checksum_errors);
    kvs__family(t, "io_errors_total", "counter", "Failed reads and writes.");
    kvs__printf(t, "kvcache_io_errors_total{tier=\"%u\"} %llu\n", m->disk_tier, (unsigned long long)m->disk.io_errors);
}

static void kvs__sched_metrics(kvs__text *t, const kvs__metrics_snap *m)
{
    const kvs_sched_stats *st = &m->sched;
    kvs__family(t, "steps_total", "counter", "Scheduler steps planned.");
    kvs__printf(t, "kvcache_steps_total %llu\n", (unsigned long long)st->steps);
    kvs__family(t, "requests_total", "counter", "Requests by outcome.");
    kvs__printf(t, "kvcache_requests_total{outcome=\"admitted\"} %llu\nkvcache_requests_total{outcome=\"finished\"} %llu\n"
                   "kvcache_requests_total{outcome=\"aborted\"} %llu\n",
                (unsigned long long)st->admitted, (unsigned long long)st->finished, (unsigned long long)st->aborted);
    kvs__family(t, "preemptions_total", "counter", "Requests preempted, by mode.");
    kvs__printf(t, "kvcache_preemptions_total{mode=\"recompute\"} %llu\nkvcache_preemptions_total{mode=\"swap\"} %llu\n",
                (unsigned long long)st->preempted_recompute, (unsigned long long)st->preempted_swap);
    kvs__family(t, "request_tokens_total", "counter",
                "Prompt tokens added, cached at admission (device and lower tiers), and computed.");
    kvs__printf(t, "kvcache_request_tokens_total{kind=\"prompt\"} %llu\nkvcache_request_tokens_total{kind=\"cached\"} %llu\n"
                   "kvcache_request_tokens_total{kind=\"lower_tier_hit\"} %llu\n"
                   "kvcache_request_tokens_total{kind=\"computed\"} %llu\n",
                (unsigned long long)st->prompt_tokens, (unsigned long long)st->cached_tokens,
                (unsigned long long)st->lower_hit_tokens, (unsigned long long)st->computed_tokens);
    kvs__family(t, "requests", "gauge", "Requests by queue.");
    kvs__printf(t, "kvcache_requests{queue=\"waiting\"} %u\nkvcache_requests{queue=\"running\"} %u\n"
                   "kvcache_requests{queue=\"swapped\"} %u\nkvcache_requests{queue=\"onboarding\"} %u\n",
                st->waiting, st->running, st->swapped, st->onboarding);
    kvs__family(t, "commits_deferred_total", "counter",
                "Sequence commits the device pool had no event memory for (retried at later steps).");
    kvs__printf(t, "kvcache_commits_deferred_total %llu\n", (unsigned long long)st->commits_deferred);
    kvs__family(t, "blocks_not_registered_total", "counter",
                "Full blocks given back uncached because their commit never found memory.");
    kvs__printf(t, "kvcache_blocks_not_registered_total %llu\n", (unsigned long long)st->blocks_not_registered);
    if (m->has_bus) {
        kvs__family(t, "events_total", "counter", "Events published on the scheduler's bus.");
        kvs__printf(t, "kvcache_events_total %llu\n", (unsigned long long)m->events);
    }
}

/* A test's seam (tests/test_observe.c): runs between the measuring pass and the writing one, where
 * another thread may move any counter. */
#ifndef KVS__METRICS_BETWEEN_PASSES
#define KVS__METRICS_BETWEEN_PASSES(sched) ((void)(sched))
#endif

KVS_API kvs_result kvs_metrics_write(kvs_sched *sched, kvo_backend *disk, char *buf, size_t cap, size_t *out_len)
{
    kvs__metrics_snap m;
    kvs__text t;
    char none[1];
    int pass;
    if (!sched || (!buf && cap) || !out_len) return KVS_EINVAL;
    kvs__metrics_read(&m, sched, disk);
    t.buf = none; /* measure, then write only when it fits: a short buffer is left untouched */
    t.cap = 0;
    for (pass = 0; pass < 2; pass++) {
        t.len = 0;
        kvs__sched_metrics(&t, &m);
        kvs__pool_metrics(&t, &m);
        kvs__pipeline_metrics(&t, &m);
        kvs__disk_metrics(&t, &m);
        *out_len = t.len;
        if (pass == 0 && t.len + 1 > cap) return KVS_ENOSPACE;
        if (pass == 0) KVS__METRICS_BETWEEN_PASSES(sched);
        t.buf = buf;
        t.cap = cap;
    }
    return KVS_OK;
}

#ifdef KVS__DEFINED_TYPEOF
#undef typeof
#undef KVS__DEFINED_TYPEOF
#endif

#endif /* KVSCHED_IMPL_INCLUDED */
#endif /* KVSCHED_IMPLEMENTATION || KVCACHE_IMPLEMENTATION */
