/* sched_fixtures.h — helpers shared by the kvsched.h tests (include after kvsched.h and kvtest.h).
 *
 * - sf_legal: the slot table of kvsched.h section 2, written out by hand from the manual (the oracle the
 *   tests compare kvs_slot_transition_allowed and every observed slot change against).
 * - sf_env: a device pool (memory-backed with the KVS_MODEL_TINY layout, or metadata-only), optionally a
 *   host pool and a disk tier under a kvo_manager in KVO_MODE_POLL, and a kvs_sched on top.
 * - An engine loop that acts as the model: after kvs_sched_step it writes, for every token an item
 *   computes, bytes derived from (token, position, layer, part) into that token's slice of each page
 *   of the device block holding it; after kvs_sched_complete it samples one token for every request
 *   that now decodes with nothing left to compute.
 * - A slot tracker: after every call the tests make through these helpers, each request's state is read
 *   with kvs_sched_get_slot and the change since the last observation must follow the table (see
 *   sf_observed_ok for what one call may do in one go).
 * - Per-step invariants checked on every step: budgets, num_tokens = sum of num_new, no request twice,
 *   block tables long enough, preempted requests not scheduled in the same step.
 * Everything is static inline so a test file pays only for what it uses. */
#ifndef KVS_SCHED_FIXTURES_H
#define KVS_SCHED_FIXTURES_H
#include "offload_fixtures.h"

/* ---- the slot table -------------------------------------------------------------------------------- */

static inline int sf_state_valid(int s) { return s >= KVS_SLOT_INITIALIZED && s < KVS_SLOT__COUNT; }

/* Finishing -> Finishing: "any state but Finished -> Finishing" read literally includes it, but it is no
 * change of state; the tests do not hold the library to either answer. */
static inline int sf_ambiguous(int from, int to) { return from == KVS_SLOT_FINISHING && to == KVS_SLOT_FINISHING; }

/* 1 when from -> to is in the manual's table (section 2 of kvsched.h). */
static inline int sf_legal(int from, int to)
{
    if (!sf_state_valid(from) || !sf_state_valid(to)) return 0;
    if (to == KVS_SLOT_FINISHING) return from != KVS_SLOT_FINISHED && from != KVS_SLOT_FINISHING;
    switch (from) {
    case KVS_SLOT_INITIALIZED: return to == KVS_SLOT_ONBOARD_STAGED || to == KVS_SLOT_PREFILLING;
    case KVS_SLOT_ONBOARD_STAGED: return to == KVS_SLOT_ONBOARDING;
    case KVS_SLOT_ONBOARDING: return to == KVS_SLOT_PREFILLING;
    case KVS_SLOT_PREFILLING:
        return to == KVS_SLOT_DECODING || to == KVS_SLOT_SKIPPED_PREFILL || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_DECODING:
        return to == KVS_SLOT_PREFILLING || to == KVS_SLOT_SKIPPED_DECODE || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_SKIPPED_PREFILL: return to == KVS_SLOT_PREFILLING || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_SKIPPED_DECODE: return to == KVS_SLOT_DECODING || to == KVS_SLOT_PREEMPTED;
    case KVS_SLOT_PREEMPTED: return to == KVS_SLOT_INITIALIZED || to == KVS_SLOT_ONBOARDING;
    case KVS_SLOT_FINISHING: return to == KVS_SLOT_FINISHED;
    default: return 0;
    }
}

#define SF_BIT(s) (1u << (unsigned)(s))

/* 1 when a chain of 1 .. hops legal transitions leads from -> to with every state in between in `mids`. */
static inline int sf_path(int from, int to, unsigned mids, int hops)
{
    if (hops <= 0) return 0;
    if (sf_legal(from, to)) return 1;
    for (int m = KVS_SLOT_INITIALIZED; m < KVS_SLOT__COUNT; m++)
        if ((mids & SF_BIT(m)) && m != from && sf_legal(from, m) && sf_path(m, to, mids, hops - 1)) return 1;
    return 0;
}

typedef enum sf_call { SF_ADD = 1, SF_STEP, SF_COMPLETE, SF_APPEND, SF_FINISH, SF_ABORT, SF_OTHER } sf_call;

static inline const char *sf_call_name(sf_call c)
{
    static const char *names[] = {"?", "add", "step", "complete", "append", "finish", "abort", "other"};
    return (unsigned)c < sizeof names / sizeof names[0] ? names[c] : "?";
}

/* The states are read after each call, so one call may show several transitions at once: a step may
 * admit, onboard, skip, preempt and requeue (intermediate states: anything but Finished); append (at
 * max_new_tokens), finish and abort go through Finishing; complete advances slots by one transition
 * (through Finishing at most). Each hop must still be in the table, at most 3 of them. */
static inline int sf_observed_ok(int from, int to, sf_call call)
{
    unsigned mids;
    if (from == to) return 1;
    if (sf_legal(from, to)) return 1;
    switch (call) {
    case SF_STEP:
        mids = 0;
        for (int s = KVS_SLOT_INITIALIZED; s < KVS_SLOT__COUNT; s++)
            if (s != KVS_SLOT_FINISHED) mids |= SF_BIT(s);
        return sf_path(from, to, mids, 3);
    case SF_COMPLETE:
    case SF_APPEND:
    case SF_FINISH:
    case SF_ABORT:
    case SF_OTHER: return sf_path(from, to, SF_BIT(KVS_SLOT_FINISHING), 2);
    default: return 0;
    }
}

/* ---- requests and tokens ------------------------------------------------------------------------- */

static inline uint64_t sf_rand(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

/* n prompt tokens derived from seed (distinct seeds give distinct prompts from the first token on). */
static inline void sf_tokens(uint64_t seed, uint32_t *out, size_t n)
{
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 0x1234567ull;
    for (size_t i = 0; i < n; i++) out[i] = (uint32_t)(sf_rand(&st) >> 40);
}

/* The token the "model" samples for request id at position pos. */
static inline uint32_t sf_sample(uint64_t id, size_t pos)
{
    uint64_t x = id * 0xff51afd7ed558ccdull ^ (uint64_t)pos * 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)(x & 0xffffffu) + 7u;
}

/* Byte j of the (layer, part) slice of the token at position pos. */
static inline unsigned char sf_kv_byte(uint32_t token, size_t pos, uint32_t layer, uint32_t part, size_t j)
{
    uint64_t x = (uint64_t)token * 0x9e3779b97f4a7c15ull ^ ((uint64_t)pos << 21) ^
                 ((uint64_t)(layer * 2 + part) << 54) ^ (uint64_t)j * 0xd6e8feb86659fd93ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return (unsigned char)x;
}

/* ---- the environment ------------------------------------------------------------------------------ */

typedef struct sf_opts {
    uint32_t device_blocks;   /* required */
    int device_memory;        /* 1: host storage in the TINY layout (block contiguous); 0: metadata only */
    uint32_t host_blocks;     /* 0: no tiers (no manager, no connector) */
    uint32_t disk_blocks;     /* 0: no G3 */
    kvs_offload_mode offload;
    kvs_preempt_mode preempt;
    uint32_t lazy_reserve;    /* manager's; 0 = its default */
    uint32_t min_batch;       /* pipeline template; 0 = 1 (every poll moves what is there) */
    int frozen_clock;         /* pipelines read a clock that never moves */
    uint32_t max_tokens, max_seqs; /* 0 = the scheduler's defaults (8192, 256) */
} sf_opts;

typedef struct sf_track {
    uint64_t id;
    int last;
    int gone;
    unsigned seen;            /* SF_BIT of each state observed */
    int hist[64];             /* distinct states in observation order */
    int nhist;
} sf_track;

typedef struct sf_env {
    sf_opts o;
    kvb_pool *dev, *host, *disk;
    kvo_backend *mem, *diskb;
    kvo_manager *m;
    kvs_sched *s;
    kvs_connector *c;
    of_clock clock;
    char dir[64], path[128];
    uint32_t block_tokens, layers;
    uint64_t page_bytes, block_bytes, token_bytes;
    uint32_t max_tokens, max_seqs;  /* effective budgets */
    /* tracker */
    sf_track *t;
    size_t nt, capt;
    unsigned seen;            /* every state observed in this env */
    size_t bad_transitions;
    size_t compound;          /* observations that were more than one transition */
    uint64_t steps;           /* steps planned */
    uint64_t max_step_tokens, max_step_seqs;
    /* every load and store of every planned step's connector metadata, with the step's id */
    kvs_load *loads;
    uint64_t *load_step;
    size_t nloads, caploads;
    kvs_store *stores;
    uint64_t *store_step;
    size_t nstores, capstores;
} sf_env;

static inline void sf__quiet_log(void *user, const char *message)
{
    (void)user;
    (void)message;
}

static inline kvb_pool *sf__pool(uint32_t num_blocks, int memory, kvb_layout_kind kind, uint32_t tier)
{
    kvb_pool_config cfg;
    kvb_pool *pool = NULL;
    uint32_t bt = 0;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = num_blocks;
    cfg.tier = tier;
    KVT_EQ(kvs_model_preset(KVS_MODEL_TINY, kind, &bt, &cfg.layout), KVS_OK);
    cfg.block_tokens = bt;
    cfg.storage = memory ? KVB_STORAGE_HOST : KVB_STORAGE_NONE;
    KVT_EQ(kvb_pool_create(&cfg, &pool), KVB_OK);
    return pool;
}

static inline void sf_open(sf_env *e, const sf_opts *o)
{
    kvb_layout layout;
    kvs_sched_config sc;
    memset(e, 0, sizeof *e);
    e->o = *o;
    memset(&layout, 0, sizeof layout);
    KVT_EQ(kvs_model_preset(KVS_MODEL_TINY, KVB_LAYOUT_BLOCK_CONTIGUOUS, &e->block_tokens, &layout), KVS_OK);
    e->layers = layout.num_layers;
    e->page_bytes = layout.page_bytes;
    e->token_bytes = e->block_tokens ? layout.page_bytes / e->block_tokens : 0;
    e->block_bytes = layout.page_bytes * layout.num_layers * 2;
    e->dev = sf__pool(o->device_blocks, o->device_memory, KVB_LAYOUT_BLOCK_CONTIGUOUS, 0);
    if (o->host_blocks) {
        kvo_manager_config mc;
        e->host = sf__pool(o->host_blocks, 1, KVB_LAYOUT_LAYER_SEPARATE, 1);
        KVT_EQ(kvo_memcpy_backend_create(0, &e->mem), KVO_OK);
        memset(&mc, 0, sizeof mc);
        mc.num_tiers = 2;
        mc.pools[0] = e->dev;
        mc.pools[1] = e->host;
        mc.down[0] = e->mem;
        mc.up[1] = e->mem;
        if (o->disk_blocks) {
            kvo_disk_config dc;
            e->disk = sf__pool(o->disk_blocks, 0, KVB_LAYOUT_BLOCK_CONTIGUOUS, 2);
            KVT_CHECK(of_tmpdir(e->dir, sizeof e->dir));
            snprintf(e->path, sizeof e->path, "%s/g3.kv", e->dir);
            memset(&dc, 0, sizeof dc);
            dc.path = e->path;
            dc.disk_pool = e->disk;
            dc.block_bytes = e->block_bytes;
            dc.log = sf__quiet_log;
            KVT_EQ(kvo_disk_backend_create(&dc, &e->diskb), KVO_OK);
            mc.num_tiers = 3;
            mc.pools[2] = e->disk;
            mc.down[1] = e->diskb;
            mc.up[2] = e->diskb;
        }
        mc.offload = o->offload == KVS_OFFLOAD_LAZY ? KVO_OFFLOAD_LAZY : KVO_OFFLOAD_EAGER;
        mc.lazy_reserve = o->lazy_reserve;
        mc.pipeline.mode = KVO_MODE_POLL;
        mc.pipeline.min_batch = o->min_batch ? o->min_batch : 1;
        if (o->frozen_clock) {
            e->clock.now = 1000000;
            mc.pipeline.clock = of_clock_read;
            mc.pipeline.clock_user = &e->clock;
        }
        KVT_EQ(kvo_manager_create(&mc, &e->m), KVO_OK);
    }
    memset(&sc, 0, sizeof sc);
    sc.device = e->dev;
    sc.tiers = e->m;
    sc.max_tokens = o->max_tokens;
    sc.max_seqs = o->max_seqs;
    sc.preempt = o->preempt;
    sc.offload = o->offload;
    KVT_EQ(kvs_sched_create(&sc, &e->s), KVS_OK);
    e->c = e->s ? kvs_sched_connector(e->s) : NULL;
    KVT_CHECK((e->c != NULL) == (e->m != NULL));
    e->max_tokens = o->max_tokens ? o->max_tokens : 8192;
    e->max_seqs = o->max_seqs ? o->max_seqs : 256;
}

/* ---- tracking -------------------------------------------------------------------------------------- */

static inline sf_track *sf_tracked(sf_env *e, uint64_t id)
{
    for (size_t i = e->nt; i > 0; i--)
        if (e->t[i - 1].id == id) return &e->t[i - 1];
    return NULL;
}

static inline void sf__note(sf_env *e, sf_track *t, int st, sf_call call)
{
    if (!sf_state_valid(st)) {
        fprintf(stderr, "  request %" PRIu64 ": state %d out of range after %s\n", t->id, st, sf_call_name(call));
        KVT_CHECK(sf_state_valid(st));
        return;
    }
    if (st != t->last) {
        int ok = t->last == 0 ? st == KVS_SLOT_INITIALIZED : sf_observed_ok(t->last, st, call);
        if (!ok) {
            fprintf(stderr, "  request %" PRIu64 ": observed %s -> %s after %s: not in the table\n", t->id,
                    t->last ? kvs_slot_state_name((kvs_slot_state)t->last) : "(new)",
                    kvs_slot_state_name((kvs_slot_state)st), sf_call_name(call));
            e->bad_transitions++;
        }
        KVT_CHECK(ok);
        if (t->last && !sf_legal(t->last, st)) {
            e->compound++;
            if (getenv("SF_VERBOSE"))
                fprintf(stderr, "  (request %" PRIu64 ": %s -> %s within one %s)\n", t->id,
                        kvs_slot_state_name((kvs_slot_state)t->last), kvs_slot_state_name((kvs_slot_state)st),
                        sf_call_name(call));
        }
        if (t->nhist < 64) t->hist[t->nhist++] = st;
        t->last = st;
    }
    t->seen |= SF_BIT(st);
    e->seen |= SF_BIT(st);
}

/* Reads the slot of one request (id != 0) or of every tracked one, and checks the changes. */
static inline void sf_track_now(sf_env *e, uint64_t id, sf_call call)
{
    for (size_t i = 0; i < e->nt; i++) {
        sf_track *t = &e->t[i];
        kvs_slot_info info;
        kvs_result r;
        if (t->gone || (id && t->id != id)) continue;
        memset(&info, 0, sizeof info);
        r = kvs_sched_get_slot(e->s, t->id, &info);
        if (r != KVS_OK) {
            fprintf(stderr, "  request %" PRIu64 ": kvs_sched_get_slot says %s after %s (never released)\n", t->id,
                    kvs_result_string(r), sf_call_name(call));
            KVT_EQ(r, KVS_OK);
            t->gone = 1;
            continue;
        }
        sf__note(e, t, (int)info.state, call);
    }
}

static inline sf_track *sf__track_add(sf_env *e, uint64_t id)
{
    if (e->nt == e->capt) {
        size_t cap = e->capt ? e->capt * 2 : 64;
        sf_track *t = (sf_track *)realloc(e->t, cap * sizeof *t);
        KVT_CHECK(t != NULL);
        if (!t) return NULL;
        e->t = t;
        e->capt = cap;
    }
    memset(&e->t[e->nt], 0, sizeof e->t[0]);
    e->t[e->nt].id = id;
    return &e->t[e->nt++];
}

/* 1 when the request was seen in state a and later (at any observation after that) in state b. */
static inline int sf_seen_before(sf_env *e, uint64_t id, int a, int b)
{
    sf_track *t = sf_tracked(e, id);
    int got_a = 0;
    if (!t) return 0;
    for (int i = 0; i < t->nhist; i++) {
        if (t->hist[i] == a) got_a = 1;
        else if (got_a && t->hist[i] == b) return 1;
    }
    return 0;
}

static inline int sf_state(sf_env *e, uint64_t id)
{
    kvs_slot_info info;
    memset(&info, 0, sizeof info);
    if (kvs_sched_get_slot(e->s, id, &info) != KVS_OK) return 0;
    return (int)info.state;
}

static inline kvs_slot_info sf_slot(sf_env *e, uint64_t id)
{
    kvs_slot_info info;
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_sched_get_slot(e->s, id, &info), KVS_OK);
    return info;
}

static inline kvs_sched_stats sf_stats(sf_env *e)
{
    kvs_sched_stats st;
    memset(&st, 0, sizeof st);
    KVT_EQ(kvs_sched_get_stats(e->s, &st), KVS_OK);
    return st;
}

/* ---- the request API through the tracker ------------------------------------------------------------ */

static inline kvs_result sf_add_req(sf_env *e, const kvs_request *rq, uint64_t *out_id)
{
    uint64_t id = 0;
    kvs_result r = kvs_sched_add(e->s, rq, &id);
    if (r == KVS_OK) {
        KVT_CHECK(sf_tracked(e, id) == NULL); /* ids are not reused */
        sf__track_add(e, id);
        sf_track_now(e, id, SF_ADD);
    }
    if (out_id) *out_id = id;
    return r;
}

static inline uint64_t sf_add(sf_env *e, const uint32_t *prompt, size_t n, uint32_t max_new, int32_t priority)
{
    kvs_request rq;
    uint64_t id = 0;
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = n;
    rq.max_new_tokens = max_new;
    rq.priority = priority;
    KVT_EQ(sf_add_req(e, &rq, &id), KVS_OK);
    return id;
}

static inline kvs_result sf_abort(sf_env *e, uint64_t id)
{
    kvs_result r = kvs_sched_abort(e->s, id);
    if (sf_tracked(e, id)) sf_track_now(e, id, SF_ABORT);
    if (r == KVS_OK) {
        int st = sf_state(e, id);
        KVT_CHECK(st == KVS_SLOT_FINISHING || st == KVS_SLOT_FINISHED);
    }
    return r;
}

static inline kvs_result sf_finish(sf_env *e, uint64_t id)
{
    kvs_result r = kvs_sched_finish(e->s, id);
    if (sf_tracked(e, id)) sf_track_now(e, id, SF_FINISH);
    if (r == KVS_OK) {
        int st = sf_state(e, id);
        KVT_CHECK(st == KVS_SLOT_FINISHING || st == KVS_SLOT_FINISHED);
    }
    return r;
}

static inline kvs_result sf_append(sf_env *e, uint64_t id, uint32_t token)
{
    kvs_result r = kvs_sched_append(e->s, id, &token, 1);
    if (sf_tracked(e, id)) sf_track_now(e, id, SF_APPEND);
    return r;
}

static inline kvs_result sf_release(sf_env *e, uint64_t id)
{
    kvs_result r = kvs_sched_release(e->s, id);
    sf_track *t = sf_tracked(e, id);
    if (r == KVS_OK && t) {
        kvs_slot_info info;
        t->gone = 1;
        KVT_EQ(kvs_sched_get_slot(e->s, id, &info), KVS_ENOTFOUND);
    }
    return r;
}

/* ---- the engine loop -------------------------------------------------------------------------------- */

/* Checks that hold for every step: the budgets, num_tokens, no request twice, block tables that cover
 * the tokens computed, preempted requests not scheduled. */
static inline void sf_check_step(sf_env *e, const kvs_step *st)
{
    size_t sum = 0, nitems = st->num_prefill + st->num_decode;
    KVT_CHECK(st->num_prefill == 0 || st->prefill != NULL);
    KVT_CHECK(st->num_decode == 0 || st->decode != NULL);
    KVT_CHECK(st->num_preempted == 0 || st->preempted != NULL);
    for (size_t i = 0; i < nitems; i++) {
        const kvs_sched_item *it = i < st->num_prefill ? &st->prefill[i] : &st->decode[i - st->num_prefill];
        sum += it->num_new;
        KVT_CHECK(it->num_new >= 1);
        KVT_CHECK(it->tokens != NULL);
        KVT_CHECK(it->num_blocks * e->block_tokens >= it->num_computed + it->num_new);
        KVT_CHECK(it->num_blocks == 0 || it->blocks != NULL);
        if (i >= st->num_prefill) KVT_EQ(it->num_new, 1); /* a decode computes one token */
        for (size_t k = 0; k < i; k++) {
            const kvs_sched_item *o = k < st->num_prefill ? &st->prefill[k] : &st->decode[k - st->num_prefill];
            KVT_CHECK(o->request != it->request);
        }
        for (size_t k = 0; k < st->num_preempted; k++) KVT_CHECK(st->preempted[k] != it->request);
    }
    KVT_EQ(st->num_tokens, sum);
    KVT_CHECK(st->num_tokens <= e->max_tokens);
    KVT_CHECK(nitems <= e->max_seqs);
    if (st->num_tokens > e->max_step_tokens) e->max_step_tokens = st->num_tokens;
    if (nitems > e->max_step_seqs) e->max_step_seqs = nitems;
    KVT_CHECK(st->meta.num_loads == 0 || st->meta.loads != NULL);
    KVT_CHECK(st->meta.num_stores == 0 || st->meta.stores != NULL);
}

static inline const kvs_sched_item *sf_item(const kvs_step *st, uint64_t id, int *is_prefill)
{
    for (size_t i = 0; i < st->num_prefill; i++)
        if (st->prefill[i].request == id) {
            if (is_prefill) *is_prefill = 1;
            return &st->prefill[i];
        }
    for (size_t i = 0; i < st->num_decode; i++)
        if (st->decode[i].request == id) {
            if (is_prefill) *is_prefill = 0;
            return &st->decode[i];
        }
    return NULL;
}

static inline int sf_was_preempted(const kvs_step *st, uint64_t id)
{
    for (size_t i = 0; i < st->num_preempted; i++)
        if (st->preempted[i] == id) return 1;
    return 0;
}

/* Appends the step's loads and stores to the log; load event ids are unique, store event ids are not
 * reused from one step to another. */
static inline void sf__log_meta(sf_env *e, const kvs_step *st)
{
    const kvs_connector_meta *m = &st->meta;
    if (m->num_loads && m->loads) {
        if (e->nloads + m->num_loads > e->caploads) {
            size_t cap = (e->nloads + m->num_loads) * 2;
            kvs_load *l = (kvs_load *)realloc(e->loads, cap * sizeof *l);
            uint64_t *ls = (uint64_t *)realloc(e->load_step, cap * sizeof *ls);
            KVT_CHECK(l && ls);
            if (l) e->loads = l;
            if (ls) e->load_step = ls;
            if (!l || !ls) return;
            e->caploads = cap;
        }
        for (size_t i = 0; i < m->num_loads; i++) {
            for (size_t k = 0; k < e->nloads; k++) KVT_CHECK(e->loads[k].event != m->loads[i].event);
            KVT_CHECK(m->loads[i].num_blocks >= 1);
            KVT_CHECK(m->loads[i].tier >= 1);
            e->loads[e->nloads] = m->loads[i];
            e->load_step[e->nloads++] = st->id;
        }
    }
    if (m->num_stores && m->stores) {
        if (e->nstores + m->num_stores > e->capstores) {
            size_t cap = (e->nstores + m->num_stores) * 2;
            kvs_store *s2 = (kvs_store *)realloc(e->stores, cap * sizeof *s2);
            uint64_t *ss = (uint64_t *)realloc(e->store_step, cap * sizeof *ss);
            KVT_CHECK(s2 && ss);
            if (s2) e->stores = s2;
            if (ss) e->store_step = ss;
            if (!s2 || !ss) return;
            e->capstores = cap;
        }
        for (size_t i = 0; i < m->num_stores; i++) {
            /* one event may cover several stores of a step; events of earlier steps are not reused */
            for (size_t k = 0; k < e->nstores; k++)
                if (e->store_step[k] != st->id) KVT_CHECK(e->stores[k].event != m->stores[i].event);
            e->stores[e->nstores] = m->stores[i];
            e->store_step[e->nstores++] = st->id;
        }
    }
}

/* Logged stores (or loads) of one request. */
static inline size_t sf_stores_of(const sf_env *e, uint64_t id)
{
    size_t n = 0;
    for (size_t i = 0; i < e->nstores; i++) n += e->stores[i].request == id;
    return n;
}

static inline size_t sf_loads_of(const sf_env *e, uint64_t id)
{
    size_t n = 0;
    for (size_t i = 0; i < e->nloads; i++) n += e->loads[i].request == id;
    return n;
}

/* Plans a step (checks it, logs its transfers, tracks every slot). */
static inline kvs_result sf_plan(sf_env *e, kvs_step *st)
{
    kvs_result r;
    memset(st, 0, sizeof *st);
    r = kvs_sched_step(e->s, st);
    KVT_EQ(r, KVS_OK);
    if (r != KVS_OK) return r;
    e->steps++;
    sf_check_step(e, st);
    sf__log_meta(e, st);
    sf_track_now(e, 0, SF_STEP);
    return r;
}

/* Acts as the model's forward pass: writes the KV bytes of every token the step computes. */
static inline void sf_model(sf_env *e, const kvs_step *st)
{
    size_t nitems = st->num_prefill + st->num_decode;
    if (!e->o.device_memory) return;
    for (size_t i = 0; i < nitems; i++) {
        const kvs_sched_item *it = i < st->num_prefill ? &st->prefill[i] : &st->decode[i - st->num_prefill];
        for (size_t p = it->num_computed; p < it->num_computed + it->num_new; p++) {
            size_t b = p / e->block_tokens, slot = p % e->block_tokens;
            if (b >= it->num_blocks) break;
            for (uint32_t layer = 0; layer < e->layers; layer++)
                for (uint32_t part = 0; part < 2; part++) {
                    unsigned char *page = NULL;
                    kvb_result r = kvb_block_data(e->dev, it->blocks[b], layer, part, (void **)&page);
                    KVT_EQ(r, KVB_OK);
                    if (r != KVB_OK || !page) return;
                    page += slot * e->token_bytes;
                    for (size_t j = 0; j < e->token_bytes; j++) page[j] = sf_kv_byte(it->tokens[p], p, layer, part, j);
                }
        }
    }
}

/* 1 when block b of `pool` holds the bytes of tokens [first_pos, first_pos + block_tokens). */
static inline int sf_block_bytes_ok(sf_env *e, kvb_pool *pool, kvb_block b, const uint32_t *tokens, size_t first_pos)
{
    for (uint32_t layer = 0; layer < e->layers; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            unsigned char *page = NULL;
            if (kvb_block_data(pool, b, layer, part, (void **)&page) != KVB_OK || !page) return 0;
            for (size_t slot = 0; slot < e->block_tokens; slot++) {
                size_t p = first_pos + slot;
                for (size_t j = 0; j < e->token_bytes; j++)
                    if (page[slot * e->token_bytes + j] != sf_kv_byte(tokens[p], p, layer, part, j)) return 0;
            }
        }
    return 1;
}

/* For the block of hash h (block index k of `tokens`) in a memory pool: 1 held with the right bytes,
 * 0 absent, -1 held with other bytes. Takes and drops a reference. */
static inline int sf_pool_holds(sf_env *e, kvb_pool *pool, kvb_hash h, const uint32_t *tokens, size_t k)
{
    kvb_block b;
    size_t n = 0;
    int ok;
    KVT_EQ(kvb_match(pool, &h, 1, &b, &n), KVB_OK);
    if (n != 1) return 0;
    ok = sf_block_bytes_ok(e, pool, b, tokens, k * e->block_tokens) ? 1 : -1;
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    return ok;
}

/* Completes the step and samples a token for every request of the step that now decodes with all of
 * its tokens computed. */
static inline kvs_result sf_commit(sf_env *e, const kvs_step *st)
{
    size_t nitems = st->num_prefill + st->num_decode;
    kvs_result r = kvs_sched_complete(e->s, st);
    KVT_EQ(r, KVS_OK);
    if (r != KVS_OK) return r;
    sf_track_now(e, 0, SF_COMPLETE);
    for (size_t i = 0; i < nitems; i++) {
        const kvs_sched_item *it = i < st->num_prefill ? &st->prefill[i] : &st->decode[i - st->num_prefill];
        kvs_slot_info info;
        if (kvs_sched_get_slot(e->s, it->request, &info) != KVS_OK) continue;
        if (info.state == KVS_SLOT_DECODING && info.num_computed == info.num_tokens)
            KVT_EQ(sf_append(e, it->request, sf_sample(it->request, info.num_tokens)), KVS_OK);
    }
    return r;
}

/* One engine step: plan, model, complete, sample. Returns the number of items. */
static inline size_t sf_turn(sf_env *e, kvs_step *st)
{
    if (sf_plan(e, st) != KVS_OK) return 0;
    sf_model(e, st);
    sf_commit(e, st);
    return st->num_prefill + st->num_decode;
}

/* Steps until the scheduler is idle (at most max_steps); returns the steps run. */
static inline size_t sf_run(sf_env *e, size_t max_steps)
{
    kvs_step st;
    size_t n = 0;
    while (!kvs_sched_idle(e->s) && n < max_steps) {
        sf_turn(e, &st);
        n++;
    }
    KVT_CHECK(kvs_sched_idle(e->s));
    return n;
}

/* Lets every transfer finish: drains the tiers and runs (empty) steps so the scheduler hears of them,
 * until the connector has nothing pending. Returns what is still pending. */
static inline size_t sf_settle(sf_env *e)
{
    kvs_step st;
    for (int i = 0; i < 50; i++) {
        if (e->m) KVT_EQ(kvo_manager_drain(e->m, 5000000), KVO_OK);
        sf_turn(e, &st);
        if ((!e->c || kvs_connector_pending(e->c) == 0) && kvs_sched_idle(e->s)) break;
    }
    if (e->m) KVT_EQ(kvo_manager_drain(e->m, 5000000), KVO_OK);
    return e->c ? kvs_connector_pending(e->c) : 0;
}

/* Four requests of 64 tokens (4 full blocks each; priorities 1, 0, 0, 1; max_new_tokens 8) fill a
 * 16-block device in one prefill step. Their first sampled tokens need a 5th block each: in the next
 * step the running requests outgrow the device and one must be preempted, the one of lowest priority
 * and latest arrival: ids[2]. Adds them and runs the prefill step only; prompts[i] gets request i's
 * 64 tokens (seeded with seed + i). */
static inline void sf_fill_device(sf_env *e, uint64_t seed, uint32_t prompts[4][64], uint64_t ids[4])
{
    static const int32_t prio[4] = {1, 0, 0, 1};
    kvs_step st;
    for (int i = 0; i < 4; i++) {
        sf_tokens(seed + (uint64_t)i, prompts[i], 64);
        ids[i] = sf_add(e, prompts[i], 64, 8, prio[i]);
    }
    sf_turn(e, &st);
    KVT_EQ(st.num_prefill, 4);
    for (int i = 0; i < 4; i++) KVT_EQ(sf_state(e, ids[i]), KVS_SLOT_DECODING);
    KVT_EQ(of_active(e->dev), 16);
}

static inline void sf_check_pools(sf_env *e)
{
    OF_CHECK_POOL(e->dev);
    if (e->host) OF_CHECK_POOL(e->host);
    if (e->disk) OF_CHECK_POOL(e->disk);
}

/* Settles, destroys the scheduler, checks that no pool has a block pinned and every pool passes its
 * check, frees everything. */
static inline void sf_close(sf_env *e)
{
    if (e->s) {
        if (kvs_sched_idle(e->s)) KVT_EQ(sf_settle(e), 0);
        kvs_sched_destroy(e->s);
    }
    kvo_manager_destroy(e->m);
    kvb_pool *pools[3] = {e->dev, e->host, e->disk};
    for (int i = 0; i < 3; i++) {
        if (!pools[i]) continue;
        KVT_EQ(of_active(pools[i]), 0);
        OF_CHECK_POOL(pools[i]);
    }
    KVT_EQ(e->bad_transitions, 0);
    kvo_backend_destroy(e->diskb);
    kvo_backend_destroy(e->mem);
    for (int i = 0; i < 3; i++) kvb_pool_destroy(pools[i]);
    if (e->path[0]) {
        unlink(e->path);
        KVT_EQ(rmdir(e->dir), 0);
    }
    free(e->t);
    free(e->loads);
    free(e->load_step);
    free(e->stores);
    free(e->store_step);
    memset(e, 0, sizeof *e);
}

#endif
