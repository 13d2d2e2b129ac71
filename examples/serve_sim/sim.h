/* sim.h — what the files of serve_sim share: the cost model, options, workloads, tiers, results.
 * The program is described at the top of examples/serve_sim.c (main and options); each file here holds
 * one concern:
 *   util.c      allocation, errors, clocks, percentiles, a u64 -> u32 map, signal clean-up
 *   workload.c  the synthetic chat workload and Mooncake trace loading, token synthesis and hashing
 *   tiers.c     pools, copy backends and the tier manager of one engine; traffic; --bytes patterns
 *   replay.c    --sequential (the pure cache replay) and the reference LRU of --check-lru
 *   engine.c    one engine: a kvs_sched on its tiers, stepped in simulated time under the cost model
 *   fleet.c     N engines on one clock with a kvs_router in front; offered load against capacity
 *   svg.c       the time series and the --svg chart
 *   report.c    the text and JSON reports
 */
#ifndef SERVE_SIM_H
#define SERVE_SIM_H

#include "kvsched.h"
#include "kvremote.h" /* the G4 tier (--remote); a stub that refuses it unless built with KVO_WITH_REDIS */
#include "kvroute.h"  /* the fleet's router (--engines, --route) */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ---- the cost model ----------------------------------------------------------------------------- */

#define COST_STEP_US 5000.0
#define COST_PREFILL_US 60.0
#define COST_DECODE_US 40.0
#define COST_IDLE_US 1000.0
#define KV_BYTES_PER_TOKEN 131072.0 /* 32 layers x 8 KV heads x head dim 128 x (K, V) x fp16 */
#define HOST_GBPS 25.0
#define DISK_GBPS 4.0
#define REMOTE_GBPS 2.5 /* Redis over a 25 GbE link */

/* ---- the synthetic workload (defaults: 5000 requests, device 2048 blocks, host 16384) ------------- */

#define SYN_SYSTEM 16
#define SYN_DOCS 400
#define SYN_RATE 1.0     /* conversations per simulated second */
#define SYN_THINK_S 20.0 /* mean think time between turns */

/* TIER_KINDS: the kinds every report shows; TIER_REMOTE (G4, --remote) is reported only when present. */
enum { TIER_DEVICE, TIER_HOST, TIER_DISK, TIER_KINDS, TIER_REMOTE = TIER_KINDS, TIER_ALL };
extern const char *const tier_names[TIER_ALL];

/* ---- util.c ------------------------------------------------------------------------------------- */

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3), noreturn))
#endif
void die(int status, const char *fmt, ...);
void *xrealloc(void *p, size_t n);
void *xcalloc(size_t n, size_t size);
/* Grow array p (capacity *cap elements of `size`) so that index need - 1 is valid. */
void *grow_to(void *p, size_t *cap, size_t need, size_t size);
#define GROW(p, cap, need) ((p) = grow_to((p), &(cap), (need), sizeof *(p)))
void check_kv(int r, const char *what);
double wall_now(void);
double cpu_now(void);
/* Percentile q (0..100) of v[0..n), nearest rank; sorts v. NAN for none. */
double percentile(double *v, size_t n, double q);

static inline uint64_t mix64(uint64_t x)
{
    x += UINT64_C(0x9e3779b97f4a7c15);
    x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

/* u64 -> u32 map: open addressing, linear probing, backward-shift deletion (no tombstones). Key 0 is
 * stored as itself; an empty slot has val == UINT32_MAX. */
typedef struct u64map { uint64_t *key; uint32_t *val; size_t mask, n; } u64map;
void map_init(u64map *m, size_t expect);
void map_free(u64map *m);
uint32_t map_get(const u64map *m, uint64_t k);
void map_put(u64map *m, uint64_t k, uint32_t v);
void map_del(u64map *m, uint64_t k);

#define MAX_ENGINES 1024 /* --engines: as many as a kvs_router takes */
extern char tmp_paths[MAX_ENGINES][64]; /* each engine's --bytes disk file, removed at exit and on SIGINT / SIGTERM */
extern char console_path[108];          /* --console: the socket, removed on SIGINT / SIGTERM too */
void remove_tmp(uint32_t engine);
void remove_tmp_all(void);
void on_signal(int sig);

/* ---- options (examples/serve_sim.c) ------------------------------------------------------------- */

#define UNSET UINT32_MAX

typedef struct options {
    uint32_t device_blocks, host_blocks, disk_blocks, block_tokens, requests;
    uint32_t eviction, offload; /* kvb_evict_policy, kvo_offload_mode; UNSET = default */
    uint32_t fol_step, fol_ghost; /* --fol-step, --fol-ghost: kvb_pool_config's (0 = its default) */
    uint32_t timing_runs;    /* --sequential, device only: runs of the timed loop, the median reported */
    uint64_t seed;
    const char *trace, *svg, *remote;
    const char *console, *record, *metrics; /* observability of the scheduler run (NULL: off) */
    uint32_t pace_us;        /* real microseconds slept after every engine step */
    int json, sequential, bytes, strict, skip_bad, check_lru, help;
    uint32_t remote_blocks; /* G4 pool size: set in main from the workload (its prompt blocks) */
    const char *engines_arg; /* --engines N | auto */
    uint32_t engines;        /* resolved: engines in the fleet (main sets it, "auto" from the workload) */
    uint32_t route;          /* kvs_route_policy */
    const char *shard_arg;   /* --shard i/N */
    uint32_t shard, shards;  /* resolved: this process serves conversations c with c % shards == shard */
} options;

const char *eviction_name(uint32_t policy);
const char *offload_name(uint32_t mode);
const char *route_name(uint32_t policy);

/* ---- workload.c --------------------------------------------------------------------------------- */

/* One request. Its prompt's full-block hashes are computed before any replay; hashes[-1] is the parent
 * of block 0 (the root), so hashes - 1 is the parents array of kvb_register_hashed. */
typedef struct sim_req {
    double arrival;          /* nominal arrival, seconds (trace: timestamp) */
    double think;            /* synthetic: gap after the previous turn finished */
    uint32_t conv, turn;     /* synthetic conversation and turn; trace: request number, 0 */
    uint32_t line;           /* trace line */
    uint32_t num_prompt, num_output, num_blocks;
    uint32_t last_tokens;    /* trace: the prompt ends inside its last id's block, after this many tokens (0: no) */
    const kvb_hash *hashes;  /* num_blocks chained hashes (shared by the turns of a conversation) */
    const uint64_t *keys;    /* block identities for the reference LRU: the chained hashes' low words */
    const uint64_t *ids;     /* trace: the hash ids */
    uint32_t num_ids;
    int32_t next_turn;       /* synthetic: index of the conversation's next turn, -1 */
} sim_req;

typedef struct conv_info {
    uint32_t sys, doc;       /* doc UINT32_MAX: none */
    uint32_t first, turns;   /* its requests: first .. first + turns - 1 */
} conv_info;

typedef struct workload {
    int is_trace;
    uint32_t block_tokens;
    sim_req *reqs;
    size_t n, cap;
    size_t *order;           /* request indices by nominal arrival */
    conv_info *convs;
    size_t nconv;
    uint32_t sys_len[SYN_SYSTEM], doc_len[SYN_DOCS];
    uint32_t *user_len, *out_len; /* per request (synthetic) */
    size_t malformed;        /* trace lines skipped */
    size_t partial_last;     /* trace: requests whose prompt ends inside the block of its last id */
    void **owned;            /* allocations to free */
    size_t nowned, capowned;
} workload;

void load_workload(workload *w, const options *o);
void free_workload(workload *w);
/* Token i of the reply to request r (what the simulated engine samples). */
uint32_t output_token(const workload *w, const sim_req *r, uint32_t i);
/* The prompt of request r into buf (num_prompt tokens). */
void fill_prompt(const workload *w, const sim_req *r, uint32_t *buf);

/* ---- tiers.c ------------------------------------------------------------------------------------ */

typedef struct tiers {
    uint32_t engine;         /* its engine in the fleet */
    uint32_t n;              /* pools in the chain: the device, then host and disk when they have blocks,
                                then remote (G4) with --remote */
    int kind[TIER_ALL];      /* TIER_* of each */
    kvb_pool *pool[TIER_ALL];
    kvo_backend null_be, *mem, *disk, *redis;
    kvo_manager *mgr;        /* NULL when the device is alone */
    kvb_layout layout;       /* --bytes */
    uint64_t block_bytes;    /* --bytes: real bytes of one block */
    char disk_note[160];     /* what the disk backend said (the O_DIRECT fallback) */
} tiers;

/* Transfer totals per direction, by tier kind: down[k] = into kind k (from down_from[k]: the tier above,
 * or host for G4 beside a disk tier), up[k] = from k to the device. Bytes are real with --bytes, modeled
 * otherwise. */
typedef struct traffic {
    uint64_t down_blocks[TIER_ALL], down_bytes[TIER_ALL], up_blocks[TIER_ALL], up_bytes[TIER_ALL];
    uint64_t evictions[TIER_ALL];
    uint32_t device_step;    /* FOL: the device pool's class step in use at the end */
    uint32_t device_tails;   /* FOL: 1 when the device pool puts tails first at the end */
    int down_from[TIER_ALL]; /* kind of the tier it is fed from, -1 */
    int present[TIER_ALL];
    kvo_redis_stats redis;  /* --remote: the backend's counters (imported = blocks other runs stored) */
} traffic;

/* engine: which engine of the fleet (0 .. MAX_ENGINES - 1) the tiers belong to */
void open_tiers(tiers *t, const options *o, uint32_t engine, int lower, int bytes, double *clock, int sequential,
                kvb_event_fn on_events, void *event_user, kvb_event_fn host_events, void *host_user, kvs_bus *bus);
void close_tiers(tiers *t);
void collect_traffic(tiers *t, const options *o, int bytes, traffic *tr);
void pattern_write(const tiers *t, kvb_block b, const kvb_hash *h);
int pattern_ok(const tiers *t, kvb_block b, const kvb_hash *h);

/* ---- svg.c -------------------------------------------------------------------------------------- */

typedef struct sample { double x; uint64_t hits[TIER_ALL], prompt; float occ[TIER_ALL]; uint32_t step; } sample;
typedef struct series { sample *s; size_t n, cap; } series;

/* occ[TIER_ALL]: each tier's cached blocks / capacity, -1 where the tier is absent */
void tiers_occupancy(const tiers *t, float *occ);
/* step: the device pool's FOL class step (tiers_fol_step; 0 for other policies) */
void series_add(series *sv, double x, const uint64_t *hits, uint64_t prompt, const float *occ, uint32_t step);
uint32_t tiers_fol_step(const tiers *t);

/* ---- the results of a run ----------------------------------------------------------------------- */

typedef struct results {
    uint64_t requests, skipped, prompt_blocks, hit_blocks, tier_hits[TIER_ALL];
    double *ttft;            /* seconds, per finished request */
    size_t nttft;
    double *ttft_nocache;
    size_t nttft_nocache;
    double *cpu;             /* seconds of CPU per scheduler step */
    size_t ncpu;
    uint64_t steps, preempted;
    uint64_t prefill_tokens; /* computed by prefill (the engine's prefill work) */
    double busy_seconds;     /* simulated time spent in steps with work */
    double queue_mean;       /* requests waiting for admission, averaged over the queue samples */
    uint32_t queue_max;
    double sim_seconds, wall_seconds, replay_seconds;
    uint64_t verified, mismatches;
    traffic tr;
    double lru_rate;         /* --check-lru */
    double lru_seconds;      /* .. and the time the reference's loop took */
    int lru_checked;
    uint32_t timing_runs;    /* replay_seconds (and lru_seconds) are the medians of this many runs (0: one) */
    char *metrics;           /* --metrics: the Prometheus text at the end of the run */
    char disk_note[160];
} results;

/* ---- replay.c ----------------------------------------------------------------------------------- */

void replay(const workload *w, const options *o, results *res, series *sv);
void replay_timing_rounds(const workload *w, const options *o, results *res);
double reference_lru(const workload *w, uint32_t cap, double *out_seconds); /* its loop's wall time */

/* ---- engine.c: one engine (a scheduler on its own tiers) with its own clock ---------------------- */

typedef struct live {                /* a request while a scheduler has it */
    uint64_t id;
    double arrival;
    double backlog;                  /* prompt blocks it adds to its engine's backlog until its first token */
    uint8_t *load_tier;              /* per prompt block: the tier kind a load was planned from (0: none) */
    uint8_t counted, checked;
} live;

/* --console, --record, --metrics: the scheduler run with the cache on publishes every event on a bus
 * stamped with simulated time (a recorded run is deterministic); the baseline run is not observed. */
typedef struct observer {
    kvs_bus *bus;            /* NULL: nothing observes the run */
    kvs_console *console;
    kvs_recorder *recorder;
} observer;
void observer_start(observer *ob, const options *o, double *clock);
void observer_stop(observer *ob); /* after the scheduler and the tiers (everything publishing) are gone */
void pace(uint32_t us);

typedef struct engine engine;
/* cache_on = 0: every request salted apart and no lower tiers (the baseline). L: one per request, shared
 * by the fleet. bus, router_feed (may be NULL): where the device pool's block events also go. */
engine *engine_open(uint32_t index, const workload *w, const options *o, int cache_on, live *L, kvs_bus *bus,
                    void *router_feed);
/* Give it request req (arrived at `arrival`, adding `backlog` blocks to its backlog). 0: too big for it. */
int engine_add(engine *e, size_t req, double arrival, double backlog);
/* One scheduler step at its clock, which advances by the step's cost; *finished: the requests it ended. */
size_t engine_step(engine *e, const size_t **finished);
double engine_clock(const engine *e);
void engine_set_clock(engine *e, double t);
int engine_idle(const engine *e);
size_t engine_queue(const engine *e);    /* requests added and not yet admitted */
double engine_backlog(const engine *e);  /* prompt blocks routed to it and not yet past their first token */
double engine_active(const engine *e);   /* prompt blocks of the requests decoding on it */
results *engine_results(engine *e);
const tiers *engine_tiers(const engine *e);
void engine_close(engine *e);            /* drain, collect its traffic into its results, free the scheduler */
void engine_free(engine *e);

/* ---- fleet.c: N engines on one simulated clock, a kvs_router in front ---------------------------- */

/* The offered load of a workload against the cost model, without cache hits: the busiest 600 s of
 * arrivals (the whole span when shorter). */
typedef struct capacity {
    double span_s;                   /* first to last nominal arrival */
    double window_s;                 /* the window the rates are measured over: 600 s, or the span */
    double prompt_tps, output_tps;   /* offered tokens per second in the busiest window */
    double engine_tps;               /* prefill tokens per second one engine computes (1e6 / COST_PREFILL_US) */
    double work;                     /* engines' worth of work: busy seconds per second without hits, in the
                                        busiest window */
    double mean_work;                /* the same over the whole span */
} capacity;
capacity offered_load(const workload *w);
/* The smallest N that keeps every engine's utilisation (work / N) under 0.8. */
uint32_t engines_for(const capacity *c);

typedef struct fleet_report {
    uint32_t n;                      /* engines */
    results *engine;                 /* each engine's results (ttft arrays owned here) */
    double *qt;                      /* queue samples: times, and n counts each in qlen */
    uint32_t *qlen;
    size_t nq;
} fleet_report;
/* Serve the workload on o->engines engines; res gets the fleet's totals (TTFT of every request), fr
 * (may be NULL) each engine's. */
void run_fleet(const workload *w, const options *o, int cache_on, results *res, fleet_report *fr, series *sv,
               int progress);
void fleet_report_free(fleet_report *fr);

/* svg.c: fr (may be NULL) adds the fleet's panels when it has several engines */
int write_svg(const char *path, const series *sv, const fleet_report *fr, const char *title, const char *xlabel);

/* ---- report.c ----------------------------------------------------------------------------------- */

double ratio(uint64_t a, uint64_t b);
void describe(char *out, size_t len, const workload *w, const options *o);
/* fr (NULL with --sequential): each engine's results when there are several; cap: the offered load */
void print_text(const workload *w, const options *o, results *r, const fleet_report *fr, const capacity *cap);
void print_json(const workload *w, const options *o, results *r, const fleet_report *fr, const capacity *cap);

#endif /* SERVE_SIM_H */
