/* The continuous-batching scheduler of kvsched.h driven like an engine (the test acts as the model: it
 * writes KV bytes derived from (token, position, layer, part) into the device blocks of every token a
 * step computes, and samples one token per request that finished its prompt or decoded).
 *
 * - The seed's two-request walkthrough: A computes 4 full blocks, they are stored device -> host (and
 *   host -> disk in the G3 variant); the device forgets them; B (A's prompt + 2 blocks) gets A's 64 tokens
 *   from the lower tier: a load before its forward pass, Onboarding before Prefilling, its first prefill
 *   starts at 64 with A's bytes in place; B's own blocks are stored; the host ends with both requests'
 *   blocks registered and nothing pinned anywhere.
 * - Device prefix hits (salt and extra keys isolate), lazy offload (nothing stored without device
 *   pressure; under pressure the next eviction candidates are backed in the host).
 * - Budgets: 300 requests of 1..3000 tokens never exceed 8192 tokens or 256 sequences per step;
 *   chunked prefill covers each prompt exactly (no gaps, no overlaps); a 20000-token prompt takes 3
 *   steps; a small configured budget; 600 short requests meet the 256-sequence cap; priority then
 *   arrival order.
 * - Preemption, both when running requests outgrow the device and when a waiting request of higher
 *   priority arrives: the lowest-priority, latest request is the victim; recompute requeues it; swap
 *   brings its blocks back from the host (none recomputed) with their KV bytes intact.
 * - Abort in every reachable slot state (and in the middle of a step) leaves no pinned block, no
 *   pending transfer and pools that pass kvb_pool_check.
 * - Bad input, result strings, model presets and kvs_blocks_for_bytes. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "kvtest.h"
#include "sched_fixtures.h"
#include <fcntl.h>
#include <sys/wait.h>

static kvs_sched_config plain_config(kvb_pool *dev)
{
    kvs_sched_config sc;
    memset(&sc, 0, sizeof sc);
    sc.device = dev;
    return sc;
}

static kvo_manager_stats mstats(sf_env *e)
{
    kvo_manager_stats s;
    memset(&s, 0, sizeof s);
    KVT_EQ(kvo_manager_get_stats(e->m, &s), KVO_OK);
    return s;
}

static void hashes_of(const uint32_t *tokens, size_t n, kvb_hash *out, size_t max, size_t expect)
{
    size_t got = 0;
    KVT_EQ(kvb_hash_prompt(tokens, n, 16, NULL, 0, 0, out, max, &got), KVB_OK);
    KVT_EQ(got, expect);
}

static size_t lookup(kvb_pool *pool, const kvb_hash *h, size_t n)
{
    size_t got = (size_t)-1;
    KVT_EQ(kvb_lookup(pool, h, n, &got), KVB_OK);
    return got;
}

/* ---- the walkthrough --------------------------------------------------------------------------------- */

static void walkthrough(int with_disk)
{
    sf_env e;
    sf_opts o;
    uint32_t b[96];
    kvb_hash h[6];
    kvs_step st;
    const uint32_t lower_tier = with_disk ? 2 : 1;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = 32;
    o.disk_blocks = with_disk ? 32 : 0;
    sf_open(&e, &o);
    sf_tokens(7, b, 96);
    hashes_of(b, 96, h, 6, 6);

    /* A: no hit, 4 full blocks computed in one prefill step */
    uint64_t a = sf_add(&e, b, 64, 2, 0);
    size_t a_prefills = 0;
    for (int i = 0; i < 50 && !kvs_sched_idle(e.s); i++) {
        int is_prefill = 0;
        sf_plan(&e, &st);
        const kvs_sched_item *it = sf_item(&st, a, &is_prefill);
        if (it && is_prefill) {
            a_prefills++;
            KVT_EQ(it->num_computed, 0);
            KVT_EQ(it->num_new, 64);
            KVT_CHECK(it->num_blocks >= 4);
        }
        sf_model(&e, &st);
        sf_commit(&e, &st);
    }
    KVT_EQ(a_prefills, 1);
    kvs_slot_info ia = sf_slot(&e, a);
    KVT_EQ(ia.state, KVS_SLOT_FINISHED);
    KVT_EQ(ia.generated, 2);
    KVT_EQ(ia.num_lower_hit_tokens, 0);
    KVT_EQ(ia.num_cached, 0);
    KVT_EQ(sf_loads_of(&e, a), 0);
    KVT_EQ(lookup(e.dev, h, 6), 4);    /* A's full blocks are cached on the device */
    KVT_EQ(of_active(e.dev), 0);       /* finished: its blocks released (they stay cached) */

    /* the stores device -> host happen */
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(lookup(e.host, h, 6), 4);
    for (size_t k = 0; k < 4; k++) KVT_EQ(sf_pool_holds(&e, e.host, h[k], b, k), 1);
    KVT_EQ(mstats(&e).down[0].transferred, 4);
    KVT_EQ(of_stats(e.host).registrations, 4);
    if (with_disk) KVT_EQ(of_present(e.disk, h, 4), 4);
    KVT_EQ(of_active(e.host), 0);

    /* the device forgets A's blocks (and, with a disk, so does the host) */
    KVT_EQ(sf_release(&e, a), KVS_OK);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);
    if (with_disk) KVT_EQ(kvb_pool_reset(e.host), KVB_OK);
    KVT_EQ(lookup(e.dev, h, 6), 0);

    /* B: A's prompt + 2 more full blocks */
    uint64_t q = sf_add(&e, b, 96, 2, 0);
    uint64_t first_prefill_step = 0;
    size_t b_prefills = 0;
    for (int i = 0; i < 200 && !kvs_sched_idle(e.s); i++) {
        int is_prefill = 0;
        sf_plan(&e, &st);
        const kvs_sched_item *it = sf_item(&st, q, &is_prefill);
        if (it && is_prefill) {
            if (!b_prefills) {
                first_prefill_step = st.id;
                KVT_EQ(it->num_computed, 64);
                KVT_EQ(it->num_new, 32);
                KVT_CHECK(it->num_blocks >= 6);
                /* A's bytes came back from the lower tier into B's first 4 blocks */
                for (size_t k = 0; k < 4 && k < it->num_blocks; k++)
                    KVT_CHECK(sf_block_bytes_ok(&e, e.dev, it->blocks[k], b, k * 16));
                KVT_EQ(sf_slot(&e, q).num_lower_hit_tokens, 64);
            }
            b_prefills++;
        }
        sf_model(&e, &st);
        sf_commit(&e, &st);
    }
    KVT_EQ(b_prefills, 1);
    /* a load from the lower tier, planned no later than the forward pass that needs it */
    size_t nl = 0;
    for (size_t i = 0; i < e.nloads; i++) {
        if (e.loads[i].request != q) continue;
        nl++;
        KVT_EQ(e.loads[i].tier, lower_tier);
        KVT_EQ(e.loads[i].first_block, 0);
        KVT_EQ(e.loads[i].num_blocks, 4);
        KVT_CHECK(first_prefill_step != 0 && e.load_step[i] <= first_prefill_step);
    }
    KVT_EQ(nl, 1);
    KVT_CHECK(sf_seen_before(&e, q, KVS_SLOT_ONBOARDING, KVS_SLOT_PREFILLING) ||
              sf_seen_before(&e, q, KVS_SLOT_ONBOARD_STAGED, KVS_SLOT_PREFILLING));
    kvs_slot_info ib = sf_slot(&e, q);
    KVT_EQ(ib.state, KVS_SLOT_FINISHED);
    KVT_EQ(ib.generated, 2);
    KVT_EQ(ib.num_lower_hit_tokens, 64);
    KVT_EQ(ib.num_cached, 64);
    KVT_EQ(mstats(&e).up[lower_tier].transferred, 4);
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.admitted, 2);
    KVT_EQ(ss.finished, 2);
    KVT_EQ(ss.lower_hit_tokens, 64);
    KVT_EQ(ss.aborted, 0);

    /* B's own blocks are stored; the host holds both requests' blocks; nothing is pinned */
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(sf_pool_holds(&e, e.host, h[4], b, 4), 1);
    KVT_EQ(sf_pool_holds(&e, e.host, h[5], b, 5), 1);
    if (!with_disk) {
        KVT_EQ(lookup(e.host, h, 6), 6);
        KVT_EQ(mstats(&e).down[0].transferred, 6); /* A's four, then B's two */
    } else {
        uint8_t tier_of[6];
        size_t n = 0;
        KVT_EQ(kvo_manager_lookup(e.m, h, 6, tier_of, &n), KVO_OK);
        KVT_EQ(n, 6);
        KVT_EQ(of_present(e.disk, h, 6), 6);
    }
    KVT_EQ(of_active(e.host), 0);
    if (e.disk) KVT_EQ(of_active(e.disk), 0);
    KVT_EQ(of_active(e.dev), 0);
    KVT_EQ(sf_release(&e, q), KVS_OK);
    KVT_EQ(of_active(e.dev), 0);
    sf_check_pools(&e);
    sf_close(&e);
}

static void test_walkthrough_host(void) { walkthrough(0); }
/* The same with G3: A's blocks go on to the disk, the host forgets them too, B loads them from tier 2. */
static void test_walkthrough_disk(void) { walkthrough(1); }

/* ---- device prefix hits ----------------------------------------------------------------------------- */

/* The first prefill step of request id (run until it shows up); its item is copied to *out. */
static int first_prefill(sf_env *e, uint64_t id, kvs_sched_item *out)
{
    kvs_step st;
    int found = 0;
    for (int i = 0; i < 100 && !kvs_sched_idle(e->s); i++) {
        int is_prefill = 0;
        sf_plan(e, &st);
        const kvs_sched_item *it = sf_item(&st, id, &is_prefill);
        if (it && is_prefill && !found) {
            *out = *it;
            found = 1;
        }
        sf_model(e, &st);
        sf_commit(e, &st);
        if (found) break;
    }
    KVT_CHECK(found);
    return found;
}

static void test_device_prefix_hit(void)
{
    sf_env e;
    sf_opts o;
    uint32_t p[72];
    kvs_sched_item it;
    memset(&o, 0, sizeof o);
    o.device_blocks = 64;
    sf_open(&e, &o);
    sf_tokens(11, p, 72);
    uint64_t r1 = sf_add(&e, p, 72, 1, 0);
    sf_run(&e, 50);
    KVT_EQ(sf_state(&e, r1), KVS_SLOT_FINISHED);

    /* same prompt, same tenant: the 4 full blocks come from the device cache */
    uint64_t r2 = sf_add(&e, p, 72, 1, 0);
    if (first_prefill(&e, r2, &it)) {
        KVT_EQ(it.num_computed, 64);
        KVT_EQ(it.num_new, 8);
    }
    kvs_slot_info i2 = sf_slot(&e, r2);
    KVT_EQ(i2.num_cached, 64);
    KVT_EQ(i2.num_lower_hit_tokens, 0);
    sf_run(&e, 50);

    /* another tenant (salt) or extra key: no hit */
    kvs_request rq;
    uint64_t r3 = 0, r4 = 0, extra = 42;
    memset(&rq, 0, sizeof rq);
    rq.prompt = p;
    rq.num_prompt = 72;
    rq.max_new_tokens = 1;
    rq.salt = 9;
    KVT_EQ(sf_add_req(&e, &rq, &r3), KVS_OK);
    if (first_prefill(&e, r3, &it)) KVT_EQ(it.num_computed, 0);
    sf_run(&e, 50);
    rq.salt = 0;
    rq.extra = &extra;
    rq.num_extra = 1;
    KVT_EQ(sf_add_req(&e, &rq, &r4), KVS_OK);
    if (first_prefill(&e, r4, &it)) KVT_EQ(it.num_computed, 0);
    sf_run(&e, 50);

    /* a prompt that is entirely cached still computes at least its last token */
    uint64_t r5 = sf_add(&e, p, 64, 1, 0);
    if (first_prefill(&e, r5, &it)) {
        KVT_CHECK(it.num_new >= 1);
        KVT_EQ(it.num_computed + it.num_new, 64);
        KVT_CHECK(it.num_computed >= 48);
    }
    sf_run(&e, 50);
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.admitted, 5);
    KVT_EQ(ss.finished, 5);
    KVT_CHECK(ss.cached_tokens >= 64 + 48);
    KVT_EQ(ss.lower_hit_tokens, 0);
    uint64_t ids[5] = {r1, r2, r3, r4, r5};
    for (int i = 0; i < 5; i++) {
        KVT_EQ(sf_state(&e, ids[i]), KVS_SLOT_FINISHED);
        KVT_EQ(sf_release(&e, ids[i]), KVS_OK);
    }
    sf_close(&e);
}

/* ---- lazy offload ----------------------------------------------------------------------------------- */

static void test_lazy_mode(void)
{
    sf_env e;
    sf_opts o;
    uint32_t p[16][208];
    uint64_t ids[16];
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = 64;
    o.offload = KVS_OFFLOAD_LAZY;
    o.lazy_reserve = 4;
    sf_open(&e, &o);
    for (int i = 0; i < 16; i++) sf_tokens(300 + (uint64_t)i, p[i], 208);

    /* one request with plenty of room: nothing goes to the host */
    ids[0] = sf_add(&e, p[0], 48, 2, 0);
    sf_run(&e, 50);
    KVT_EQ(sf_settle(&e), 0);
    for (int i = 0; i < 5; i++) KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(sf_state(&e, ids[0]), KVS_SLOT_FINISHED);
    KVT_CHECK(of_stats(e.dev).free_blocks >= 12);
    KVT_EQ(of_stats(e.host).registrations, 0);
    KVT_EQ(mstats(&e).down[0].transferred, 0);
    KVT_EQ(e.nstores, 0);

    /* pressure: 12 more requests of 3 full blocks each go through a 16-block device */
    for (int i = 1; i < 13; i++) ids[i] = sf_add(&e, p[i], 48, 2, 0);
    sf_run(&e, 500);
    KVT_EQ(sf_settle(&e), 0);
    KVT_CHECK(of_stats(e.dev).evictions > 0);
    KVT_CHECK(of_stats(e.host).registrations > 0);
    KVT_CHECK(mstats(&e).down[0].transferred > 0);

    /* a long request keeps the device nearly full: the next (up to) 4 eviction candidates are backed */
    ids[13] = sf_add(&e, p[13], 200, 0, 0);
    kvs_step st;
    for (int i = 0; i < 10 && sf_state(&e, ids[13]) != KVS_SLOT_DECODING; i++) sf_turn(&e, &st);
    KVT_EQ(sf_state(&e, ids[13]), KVS_SLOT_DECODING);
    for (int i = 0; i < 3; i++) {
        sf_turn(&e, &st);
        KVT_EQ(kvo_manager_drain(e.m, 5000000), KVO_OK);
    }
    sf_turn(&e, &st);
    KVT_EQ(kvo_manager_drain(e.m, 5000000), KVO_OK);
    kvb_weak cand[4];
    size_t nc = 0, backed = 0;
    KVT_EQ(kvb_eviction_candidates(e.dev, 4, cand, &nc), KVB_OK);
    KVT_CHECK(nc >= 1);
    for (size_t i = 0; i < nc; i++) backed += of_has(e.host, of_hash_of(e.dev, cand[i].id));
    KVT_EQ(backed, nc);
    KVT_EQ(sf_finish(&e, ids[13]), KVS_OK);
    sf_run(&e, 50);
    KVT_EQ(sf_settle(&e), 0);
    for (int i = 0; i < 14; i++) {
        KVT_EQ(sf_state(&e, ids[i]), KVS_SLOT_FINISHED);
        KVT_EQ(sf_release(&e, ids[i]), KVS_OK);
    }
    KVT_EQ(of_active(e.host), 0);
    sf_close(&e);
}

/* ---- budgets -------------------------------------------------------------------------------------- */

typedef struct req_log {
    uint64_t id;
    size_t prompt;
    size_t next;            /* next num_computed expected */
    size_t prefill_steps;
    uint64_t first_step, last_step;
    int prefill_done;
} req_log;

static req_log *find_log(req_log *logs, size_t n, uint64_t id)
{
    for (size_t i = 0; i < n; i++)
        if (logs[i].id == id) return &logs[i];
    return NULL;
}

/* Runs until idle; every item continues exactly where the request's last one ended: prefill chunks
 * from 0 to the prompt length, then decodes one token at a time. Returns steps. */
static size_t run_logged(sf_env *e, req_log *logs, size_t n, size_t max_steps, kvs_step *first)
{
    kvs_step st;
    size_t steps = 0;
    while (!kvs_sched_idle(e->s) && steps < max_steps) {
        sf_plan(e, &st);
        if (steps == 0 && first) *first = st;
        steps++;
        KVT_EQ(st.num_preempted, 0);
        for (size_t i = 0; i < st.num_prefill + st.num_decode; i++) {
            int is_prefill = i < st.num_prefill;
            const kvs_sched_item *it = is_prefill ? &st.prefill[i] : &st.decode[i - st.num_prefill];
            req_log *l = find_log(logs, n, it->request);
            KVT_CHECK(l != NULL);
            if (!l) continue;
            KVT_EQ(it->num_computed, l->next);
            if (is_prefill) {
                KVT_CHECK(!l->prefill_done);
                KVT_CHECK(it->num_computed + it->num_new <= l->prompt);
                if (!l->prefill_steps) l->first_step = st.id;
                l->prefill_steps++;
                l->last_step = st.id;
                if (it->num_computed + it->num_new == l->prompt) l->prefill_done = 1;
            } else {
                KVT_CHECK(l->prefill_done);
                l->last_step = st.id;
            }
            l->next = it->num_computed + it->num_new;
        }
        sf_model(e, &st);
        sf_commit(e, &st);
    }
    KVT_CHECK(kvs_sched_idle(e->s));
    return steps;
}

static void budget_case(uint32_t num_requests, size_t max_prompt, uint32_t max_tokens, uint32_t max_seqs, uint64_t seed)
{
    sf_env e;
    sf_opts o;
    uint64_t rng = seed;
    req_log *logs = (req_log *)calloc(num_requests, sizeof *logs);
    uint32_t *tokens = (uint32_t *)malloc(max_prompt * sizeof *tokens);
    kvs_step first;
    size_t total = 0, chunked = 0, longest = 0;
    KVT_CHECK(logs && tokens);
    if (!logs || !tokens) return;
    memset(&o, 0, sizeof o);
    o.device_blocks = 65536;
    o.max_tokens = max_tokens;
    o.max_seqs = max_seqs;
    sf_open(&e, &o);
    for (uint32_t i = 0; i < num_requests; i++) {
        size_t n = 1 + (size_t)(sf_rand(&rng) % max_prompt);
        sf_tokens(seed * 1000 + i, tokens, n);
        logs[i].prompt = n;
        logs[i].id = sf_add(&e, tokens, n, 4, 0);
        total += n;
        if (n > longest) longest = n;
    }
    KVT_EQ(sf_stats(&e).waiting, num_requests);
    size_t steps = run_logged(&e, logs, num_requests, 100000, &first);
    uint32_t budget = max_tokens ? max_tokens : 8192, seqs = max_seqs ? max_seqs : 256;
    /* the first step is full: the queue holds more than a step's worth of prompt */
    if (total > budget || num_requests > seqs)
        KVT_CHECK(first.num_tokens == budget || first.num_prefill + first.num_decode == seqs);
    KVT_CHECK(e.max_step_tokens <= budget);
    KVT_CHECK(e.max_step_seqs <= seqs);
    for (uint32_t i = 0; i < num_requests; i++) {
        req_log *l = &logs[i];
        kvs_slot_info info = sf_slot(&e, l->id);
        KVT_EQ(info.state, KVS_SLOT_FINISHED);
        KVT_EQ(info.generated, 4);
        KVT_CHECK(l->prefill_done);
        KVT_EQ(l->next, l->prompt + 3); /* the 4th sampled token is never computed */
        if (l->prefill_steps > 1) chunked++;
        if (l->prompt > budget) KVT_CHECK(l->prefill_steps >= (l->prompt + budget - 1) / budget);
        /* arrival order among equal priorities */
        if (i) KVT_CHECK(logs[i - 1].first_step <= l->first_step);
        KVT_EQ(sf_release(&e, l->id), KVS_OK);
    }
    if (total > budget) KVT_CHECK(chunked >= 1);
    fprintf(stderr, "  (%u requests, %zu prompt tokens: %zu steps, %zu prompts chunked, largest step %" PRIu64
                    " tokens / %" PRIu64 " sequences)\n",
            num_requests, total, steps, chunked, e.max_step_tokens, e.max_step_seqs);
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.admitted, num_requests);
    KVT_EQ(ss.finished, num_requests);
    KVT_EQ(ss.preempted_recompute + ss.preempted_swap, 0);
    KVT_EQ(ss.prompt_tokens, total);
    KVT_EQ(ss.computed_tokens, total + 3 * (size_t)num_requests); /* no cache hits: every token computed once */
    KVT_EQ(ss.cached_tokens, 0);
    KVT_EQ(ss.steps, e.steps);
    KVT_CHECK(steps >= total / budget);
    sf_close(&e);
    free(logs);
    free(tokens);
}

static void test_budget_300_requests(void) { budget_case(300, 3000, 0, 0, 77); }
static void test_budget_small_config(void) { budget_case(40, 200, 64, 4, 78); }
static void test_budget_many_short(void) { budget_case(600, 8, 0, 0, 79); } /* the 256-sequence cap */

/* A prompt of 20000 tokens with the default budget: 8192 + 8192 + 3616. */
static void test_chunked_long_prompt(void)
{
    sf_env e;
    sf_opts o;
    uint32_t *p = (uint32_t *)malloc(20000 * sizeof *p);
    req_log l;
    KVT_CHECK(p != NULL);
    if (!p) return;
    memset(&o, 0, sizeof o);
    o.device_blocks = 4096;
    sf_open(&e, &o);
    sf_tokens(31, p, 20000);
    memset(&l, 0, sizeof l);
    l.prompt = 20000;
    l.id = sf_add(&e, p, 20000, 2, 0);
    kvs_step st;
    size_t chunks[8], nchunks = 0;
    for (int i = 0; i < 20 && !kvs_sched_idle(e.s); i++) {
        int is_prefill = 0;
        sf_plan(&e, &st);
        const kvs_sched_item *it = sf_item(&st, l.id, &is_prefill);
        KVT_CHECK(it != NULL);
        if (it && is_prefill) {
            KVT_EQ(it->num_computed, l.next);
            if (nchunks < 8) chunks[nchunks++] = it->num_new;
            l.next += it->num_new;
            if (l.next < 20000) KVT_EQ(sf_state(&e, l.id), KVS_SLOT_PREFILLING);
        }
        sf_model(&e, &st);
        sf_commit(&e, &st);
        if (l.next < 20000) {
            kvs_slot_info info = sf_slot(&e, l.id);
            KVT_EQ(info.state, KVS_SLOT_PREFILLING);
            KVT_EQ(info.num_computed, l.next);
        }
    }
    KVT_EQ(nchunks, 3);
    if (nchunks == 3) {
        KVT_EQ(chunks[0], 8192);
        KVT_EQ(chunks[1], 8192);
        KVT_EQ(chunks[2], 3616);
    }
    KVT_EQ(sf_state(&e, l.id), KVS_SLOT_FINISHED);
    KVT_EQ(sf_release(&e, l.id), KVS_OK);
    sf_close(&e);
    free(p);
}

/* Waiting requests go by priority (higher first), then arrival; with one sequence per step the first
 * admitted runs to the end before the next starts. */
static void test_priority_order(void)
{
    sf_env e;
    sf_opts o;
    uint32_t p[4][20];
    req_log logs[4];
    int32_t prio[4] = {0, 0, 5, 2};
    memset(&o, 0, sizeof o);
    o.device_blocks = 64;
    o.max_seqs = 1;
    sf_open(&e, &o);
    memset(logs, 0, sizeof logs);
    for (int i = 0; i < 4; i++) {
        sf_tokens(40 + (uint64_t)i, p[i], 20);
        logs[i].prompt = 20;
        logs[i].id = sf_add(&e, p[i], 20, 2, prio[i]);
    }
    run_logged(&e, logs, 4, 200, NULL);
    /* order: 2 (priority 5), 3 (2), 0, 1 (0, by arrival) */
    KVT_CHECK(logs[2].last_step < logs[3].first_step);
    KVT_CHECK(logs[3].last_step < logs[0].first_step);
    KVT_CHECK(logs[0].last_step < logs[1].first_step);
    for (int i = 0; i < 4; i++) KVT_EQ(sf_release(&e, logs[i].id), KVS_OK);
    sf_close(&e);
}

/* ---- preemption ------------------------------------------------------------------------------------- */

/* Four requests of 56 tokens (4 blocks each) fill a 16-block device: priorities 1, 0, 0, 1. A request of
 * priority 5 needing 4 blocks arrives: the victim is #2 (lowest priority, latest arrival). */
static void preempt_case(kvs_preempt_mode mode, int with_host, kvs_offload_mode offload)
{
    sf_env e;
    sf_opts o;
    uint32_t p[5][64];
    int32_t prio[4] = {1, 0, 0, 1};
    uint64_t low[4], high;
    kvb_hash vh[3];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = with_host ? 64 : 0;
    o.preempt = mode;
    o.offload = offload;
    o.lazy_reserve = 4;
    sf_open(&e, &o);
    for (int i = 0; i < 5; i++) sf_tokens(200 + (uint64_t)i, p[i], 64);
    hashes_of(p[2], 56, vh, 3, 3);
    for (int i = 0; i < 4; i++) low[i] = sf_add(&e, p[i], 56, 8, prio[i]);
    for (int i = 0; i < 3 && sf_state(&e, low[3]) != KVS_SLOT_DECODING; i++) sf_turn(&e, &st);
    for (int i = 0; i < 4; i++) KVT_EQ(sf_state(&e, low[i]), KVS_SLOT_DECODING);
    KVT_EQ(of_active(e.dev), 16);

    high = sf_add(&e, p[4], 60, 3, 5);
    uint64_t added_at = e.steps, preempt_step = 0, high_first = 0;
    size_t npreempted = 0;
    int resumed = 0;
    for (int i = 0; i < 300 && !kvs_sched_idle(e.s); i++) {
        int is_prefill = 0;
        sf_plan(&e, &st);
        for (size_t k = 0; k < st.num_preempted; k++) {
            npreempted++;
            KVT_EQ(st.preempted[k], low[2]);
            if (st.preempted[k] == low[2] && !preempt_step) {
                int s = sf_state(&e, low[2]);
                preempt_step = e.steps;
                if (mode == KVS_PREEMPT_SWAP) KVT_EQ(s, KVS_SLOT_PREEMPTED);
                else KVT_CHECK(s == KVS_SLOT_PREEMPTED || s == KVS_SLOT_INITIALIZED);
                kvs_slot_info vi = sf_slot(&e, low[2]);
                KVT_EQ(vi.preemptions, 1);
            }
        }
        const kvs_sched_item *it = sf_item(&st, high, &is_prefill);
        if (it && is_prefill && !high_first) {
            high_first = e.steps;
            KVT_CHECK(preempt_step && preempt_step <= high_first);
            KVT_EQ(it->num_computed, 0);
            /* every device block is in use now: the victim's blocks were taken */
            KVT_EQ(of_present(e.dev, vh, 3), 0);
        }
        it = sf_item(&st, low[2], &is_prefill);
        if (it && preempt_step && !resumed) {
            resumed = 1;
            KVT_CHECK(is_prefill);
            if (mode == KVS_PREEMPT_SWAP) {
                /* swapped back in: its 3 full blocks came from the host, bytes intact */
                KVT_EQ(it->num_computed, 48);
                KVT_CHECK(sf_loads_of(&e, low[2]) >= 1);
                kvs_slot_info vi = sf_slot(&e, low[2]);
                KVT_CHECK(vi.num_lower_hit_tokens >= 48);
            } else if (!with_host) {
                KVT_EQ(it->num_computed, 0); /* recompute: nothing of it is cached anywhere */
            }
            for (size_t k = 0; k < it->num_computed / 16 && k < it->num_blocks; k++)
                KVT_CHECK(sf_block_bytes_ok(&e, e.dev, it->blocks[k], p[2], k * 16));
        }
        sf_model(&e, &st);
        sf_commit(&e, &st);
    }
    KVT_CHECK(kvs_sched_idle(e.s));
    KVT_EQ(npreempted, 1);
    KVT_CHECK(preempt_step > added_at && preempt_step <= added_at + 2);
    KVT_CHECK(high_first > added_at && high_first <= added_at + 3);
    KVT_CHECK(resumed);
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.preempted_swap, mode == KVS_PREEMPT_SWAP ? 1 : 0);
    KVT_EQ(ss.preempted_recompute, mode == KVS_PREEMPT_RECOMPUTE ? 1 : 0);
    KVT_EQ(ss.finished, 5);
    for (int i = 0; i < 4; i++) {
        kvs_slot_info info = sf_slot(&e, low[i]);
        KVT_EQ(info.state, KVS_SLOT_FINISHED);
        KVT_EQ(info.generated, 8);
        KVT_EQ(info.preemptions, i == 2 ? 1 : 0);
        KVT_EQ(sf_release(&e, low[i]), KVS_OK);
    }
    kvs_slot_info hi = sf_slot(&e, high);
    KVT_EQ(hi.state, KVS_SLOT_FINISHED);
    KVT_EQ(hi.generated, 3);
    KVT_EQ(hi.preemptions, 0);
    KVT_EQ(sf_release(&e, high), KVS_OK);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(of_active(e.dev), 0);
    if (e.host) KVT_EQ(of_active(e.host), 0);
    sf_close(&e);
}

static void test_waiting_preempts_recompute(void) { preempt_case(KVS_PREEMPT_RECOMPUTE, 0, KVS_OFFLOAD_EAGER); }
static void test_waiting_preempts_swap_bytes(void) { preempt_case(KVS_PREEMPT_SWAP, 1, KVS_OFFLOAD_EAGER); }

/* Running requests outgrow the device (sf_fill_device): in the step after their prefill, the victim
 * (#2: lowest priority, latest arrival) is preempted, the others go on; it resumes when they are done.
 * Swap: its 4 full blocks come back (device cache + host), bytes intact, only the sampled token is
 * computed again. Recompute: whatever is still cached is reused (bytes intact), the rest recomputed. */
static void growth_case(kvs_preempt_mode mode, int with_host, kvs_offload_mode offload)
{
    sf_env e;
    sf_opts o;
    uint32_t p[4][64];
    uint64_t low[4];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = with_host ? 64 : 0;
    o.preempt = mode;
    o.offload = offload;
    o.lazy_reserve = 4;
    sf_open(&e, &o);
    sf_fill_device(&e, 400, p, low);
    uint64_t preempt_step = 0;
    size_t npreempted = 0;
    int resumed = 0;
    for (int i = 0; i < 300 && !kvs_sched_idle(e.s); i++) {
        int is_prefill = 0;
        sf_plan(&e, &st);
        for (size_t k = 0; k < st.num_preempted; k++) {
            npreempted++;
            KVT_EQ(st.preempted[k], low[2]);
            if (!preempt_step) {
                int s = sf_state(&e, low[2]);
                preempt_step = e.steps;
                /* Preempted, requeued (recompute) or already swapping in (the table allows both) */
                KVT_CHECK(s == KVS_SLOT_PREEMPTED || s == KVS_SLOT_ONBOARD_STAGED || s == KVS_SLOT_ONBOARDING ||
                          (mode == KVS_PREEMPT_RECOMPUTE && s == KVS_SLOT_INITIALIZED));
                if (!with_host) KVT_CHECK(s == KVS_SLOT_PREEMPTED || s == KVS_SLOT_INITIALIZED);
                KVT_EQ(sf_slot(&e, low[2]).preemptions, 1);
                if (mode == KVS_PREEMPT_SWAP) { /* "offloads its blocks to G2 first" */
                    kvb_hash vh[4];
                    hashes_of(p[2], 64, vh, 4, 4);
                    KVT_EQ(of_present(e.host, vh, 4), 4);
                }
                /* the others decode on, in this very step */
                for (int r = 0; r < 4; r++)
                    if (r != 2) KVT_CHECK(sf_item(&st, low[r], NULL) != NULL);
            }
        }
        const kvs_sched_item *it = sf_item(&st, low[2], &is_prefill);
        if (it && preempt_step && !resumed) {
            resumed = 1;
            KVT_CHECK(is_prefill);
            if (mode == KVS_PREEMPT_SWAP) {
                /* swapped in: all 4 full blocks are back (none recomputed), only the sampled token is new */
                KVT_EQ(it->num_computed, 64);
                KVT_EQ(it->num_new, 1);
                KVT_EQ(mstats(&e).up[1].failed, 0); /* no swap-in copy failed (e.g. for want of device room) */
            }
            for (size_t k = 0; k < it->num_computed / 16 && k < it->num_blocks; k++)
                KVT_CHECK(sf_block_bytes_ok(&e, e.dev, it->blocks[k], p[2], k * 16));
        }
        sf_model(&e, &st);
        sf_commit(&e, &st);
    }
    KVT_CHECK(kvs_sched_idle(e.s));
    KVT_EQ(npreempted, 1);
    KVT_EQ(preempt_step, 2);
    KVT_CHECK(resumed);
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.preempted_swap, mode == KVS_PREEMPT_SWAP ? 1 : 0);
    KVT_EQ(ss.preempted_recompute, mode == KVS_PREEMPT_RECOMPUTE ? 1 : 0);
    KVT_EQ(ss.finished, 4);
    for (int i = 0; i < 4; i++) {
        kvs_slot_info info = sf_slot(&e, low[i]);
        KVT_EQ(info.state, KVS_SLOT_FINISHED);
        KVT_EQ(info.generated, 8);
        KVT_EQ(info.preemptions, i == 2 ? 1 : 0);
        KVT_EQ(sf_release(&e, low[i]), KVS_OK);
    }
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(of_active(e.dev), 0);
    if (e.host) KVT_EQ(of_active(e.host), 0);
    sf_close(&e);
}

static void test_outgrow_recompute(void) { growth_case(KVS_PREEMPT_RECOMPUTE, 0, KVS_OFFLOAD_EAGER); }
static void test_outgrow_recompute_with_host(void) { growth_case(KVS_PREEMPT_RECOMPUTE, 1, KVS_OFFLOAD_EAGER); }
static void test_outgrow_swap_bytes(void) { growth_case(KVS_PREEMPT_SWAP, 1, KVS_OFFLOAD_EAGER); }
static void test_outgrow_swap_bytes_lazy(void) { growth_case(KVS_PREEMPT_SWAP, 1, KVS_OFFLOAD_LAZY); }

/* A waiting request never preempts running ones of the same priority: it waits. */
static void test_no_preempt_equal_priority(void)
{
    sf_env e;
    sf_opts o;
    uint32_t p[5][64];
    uint64_t ids[5];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    sf_open(&e, &o);
    for (int i = 0; i < 5; i++) sf_tokens(250 + (uint64_t)i, p[i], 64);
    for (int i = 0; i < 4; i++) ids[i] = sf_add(&e, p[i], 56, 6, 1);
    for (int i = 0; i < 3 && sf_state(&e, ids[3]) != KVS_SLOT_DECODING; i++) sf_turn(&e, &st);
    ids[4] = sf_add(&e, p[4], 60, 2, 1);
    for (int i = 0; i < 3; i++) {
        sf_turn(&e, &st);
        KVT_EQ(st.num_preempted, 0);
        KVT_EQ(sf_state(&e, ids[4]), KVS_SLOT_INITIALIZED);
    }
    sf_run(&e, 200);
    for (int i = 0; i < 5; i++) {
        KVT_EQ(sf_state(&e, ids[i]), KVS_SLOT_FINISHED);
        KVT_EQ(sf_slot(&e, ids[i]).preemptions, 0);
        KVT_EQ(sf_release(&e, ids[i]), KVS_OK);
    }
    sf_close(&e);
}

/* A waiting request that would not fit even with every running request of lower priority preempted
 * preempts none of them: it waits, and they keep their blocks and their progress. Four requests of 56
 * tokens (4 blocks each) fill a 16-block device, priorities 2, 0, 0, 2; a request of priority 1 needs 9
 * blocks, and the two of priority 0 hold only 8. (It preempted both, then gave up: they lost their
 * blocks for nothing; with swap, the swapped queue then held the waiting one back as well.)
 * Shared: the two of priority 0 share their first 3 blocks with #0 (admitted a step before them), so the
 * device has 6 free blocks and preempting both gives back only 2 (their last blocks): 8, still short. */
static void futile_preempt_case(kvs_preempt_mode mode, int with_host, int shared)
{
    sf_env e;
    sf_opts o;
    uint32_t p[5][160];
    int32_t prio[4] = {2, 0, 0, 2};
    uint64_t low[4], high;
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = with_host ? 64 : 0;
    o.preempt = mode;
    sf_open(&e, &o);
    for (int i = 0; i < 5; i++) sf_tokens(270 + (uint64_t)i, p[i], 160);
    if (shared) memcpy(p[1], p[0], 48 * sizeof **p), memcpy(p[2], p[0], 48 * sizeof **p);
    for (int i = 0; i < 4; i++) {
        low[i] = sf_add(&e, p[i], 56, 8, prio[i]);
        if (shared && !i) sf_turn(&e, &st); /* #0's blocks registered: the next two match them */
    }
    for (int i = 0; i < 3 && sf_state(&e, low[3]) != KVS_SLOT_DECODING; i++) sf_turn(&e, &st);
    for (int i = 0; i < 4; i++) KVT_EQ(sf_state(&e, low[i]), KVS_SLOT_DECODING);
    KVT_EQ(of_active(e.dev), shared ? 10 : 16);
    high = sf_add(&e, p[4], 140, 4, 1); /* 9 blocks */
    for (int i = 0; i < 3; i++) {
        sf_turn(&e, &st);
        KVT_EQ(st.num_preempted, 0);
        KVT_EQ(sf_stats(&e).preempted_recompute + sf_stats(&e).preempted_swap, 0);
        KVT_EQ(sf_state(&e, high), KVS_SLOT_INITIALIZED);
        for (int r = 0; r < 4; r++) {
            KVT_EQ(sf_state(&e, low[r]), KVS_SLOT_DECODING);
            KVT_EQ(sf_slot(&e, low[r]).preemptions, 0);
        }
    }
    /* shared: once #0 is done, its blocks and the two victims' are enough (12 of 9): a preemption then
     * admits the waiting request in the same step; the others never preempt */
    size_t preempted = 0;
    for (int i = 0; i < 200 && !kvs_sched_idle(e.s); i++) {
        sf_plan(&e, &st);
        preempted += st.num_preempted;
        if (st.num_preempted) KVT_CHECK(sf_item(&st, high, NULL) != NULL);
        sf_model(&e, &st);
        sf_commit(&e, &st);
    }
    KVT_CHECK(kvs_sched_idle(e.s));
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.preempted_recompute + ss.preempted_swap, preempted);
    if (!shared) KVT_EQ(preempted, 0);
    KVT_EQ(ss.finished, 5);
    for (int i = 0; i < 4; i++) {
        kvs_slot_info info = sf_slot(&e, low[i]);
        KVT_EQ(info.state, KVS_SLOT_FINISHED);
        KVT_EQ(info.generated, 8);
        if (!shared) KVT_EQ(info.preemptions, 0);
        KVT_EQ(sf_release(&e, low[i]), KVS_OK);
    }
    KVT_EQ(sf_state(&e, high), KVS_SLOT_FINISHED);
    KVT_EQ(sf_slot(&e, high).generated, 4);
    KVT_EQ(sf_release(&e, high), KVS_OK);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(of_active(e.dev), 0);
    sf_check_pools(&e);
    sf_close(&e);
}

static void test_no_futile_preempt_recompute(void) { futile_preempt_case(KVS_PREEMPT_RECOMPUTE, 0, 0); }
static void test_no_futile_preempt_swap(void) { futile_preempt_case(KVS_PREEMPT_SWAP, 1, 0); }
static void test_no_futile_preempt_shared_blocks(void) { futile_preempt_case(KVS_PREEMPT_RECOMPUTE, 0, 1); }

/* ---- abort -------------------------------------------------------------------------------------------- */

/* After an abort: Finished, counted, nothing pinned once the other requests are done, nothing pending,
 * pools consistent. */
static void after_abort(sf_env *e, uint64_t id, uint64_t aborted_before)
{
    KVT_EQ(sf_state(e, id), KVS_SLOT_FINISHED);
    KVT_EQ(sf_stats(e).aborted, aborted_before + 1);
    sf_check_pools(e);
    sf_run(e, 300);
    KVT_EQ(sf_settle(e), 0);
    KVT_EQ(of_active(e->dev), 0);
    if (e->host) KVT_EQ(of_active(e->host), 0);
    sf_check_pools(e);
    KVT_EQ(sf_release(e, id), KVS_OK);
}

/* A device of device_blocks with memory over a host tier of 32, preempting by swap. */
static sf_opts swap_opts(uint32_t device_blocks)
{
    sf_opts o;
    memset(&o, 0, sizeof o);
    o.device_blocks = device_blocks;
    o.device_memory = 1;
    o.host_blocks = 32;
    o.preempt = KVS_PREEMPT_SWAP;
    return o;
}

static void open_abort_env(sf_env *e, int frozen)
{
    sf_opts o = swap_opts(16);
    o.max_tokens = 32;
    o.frozen_clock = frozen;
    o.min_batch = frozen ? 8 : 0;
    sf_open(e, &o);
}

static void test_abort_initialized(void)
{
    sf_env e;
    uint32_t p[2][40];
    kvs_step st;
    open_abort_env(&e, 0);
    sf_tokens(60, p[0], 40);
    sf_tokens(61, p[1], 40);
    /* right after add */
    uint64_t a = sf_add(&e, p[0], 40, 2, 0);
    KVT_EQ(sf_abort(&e, a), KVS_OK);
    after_abort(&e, a, 0);
    /* waiting behind a request that takes the whole token budget */
    uint64_t r = sf_add(&e, p[1], 40, 2, 0);
    uint64_t w = sf_add(&e, p[0], 40, 2, 0);
    sf_turn(&e, &st);
    KVT_EQ(sf_state(&e, w), KVS_SLOT_INITIALIZED);
    KVT_EQ(sf_abort(&e, w), KVS_OK);
    KVT_CHECK(sf_item(&st, w, NULL) == NULL);
    after_abort(&e, w, 1);
    KVT_EQ(sf_state(&e, r), KVS_SLOT_FINISHED);
    KVT_EQ(sf_release(&e, r), KVS_OK);
    sf_close(&e);
}

static void test_abort_onboarding(void)
{
    sf_env e;
    uint32_t p[80], other[40];
    kvs_step st;
    open_abort_env(&e, 1); /* frozen clock: a small load waits in the pipeline until someone drains */
    sf_tokens(62, p, 80);
    sf_tokens(63, other, 40);
    uint64_t a = sf_add(&e, p, 64, 1, 0);
    sf_run(&e, 50);
    KVT_EQ(sf_settle(&e), 0);
    kvb_hash h[5];
    hashes_of(p, 80, h, 5, 5);
    KVT_EQ(lookup(e.host, h, 5), 4);
    KVT_EQ(sf_release(&e, a), KVS_OK);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);

    uint64_t q = sf_add(&e, p, 80, 2, 0);
    sf_turn(&e, &st);
    int s = sf_state(&e, q);
    KVT_CHECK(s == KVS_SLOT_ONBOARD_STAGED || s == KVS_SLOT_ONBOARDING);
    KVT_CHECK(kvs_connector_pending(e.c) > 0);
    KVT_EQ(sf_slot(&e, q).num_lower_hit_tokens, 64);
    KVT_EQ(sf_abort(&e, q), KVS_OK);
    KVT_EQ(sf_slot(&e, q).pending_transfers, 0);
    after_abort(&e, q, 0);
    KVT_EQ(kvs_connector_pending(e.c), 0);
    /* the scheduler goes on */
    uint64_t r = sf_add(&e, other, 40, 2, 0);
    sf_run(&e, 50);
    KVT_EQ(sf_state(&e, r), KVS_SLOT_FINISHED);
    KVT_EQ(sf_release(&e, r), KVS_OK);
    sf_close(&e);
}

static void test_abort_prefilling(void)
{
    sf_env e;
    uint32_t p[100];
    kvs_step st;
    open_abort_env(&e, 0);
    sf_tokens(64, p, 100);
    uint64_t a = sf_add(&e, p, 100, 2, 0);
    sf_turn(&e, &st); /* 32 of 100 */
    KVT_EQ(sf_state(&e, a), KVS_SLOT_PREFILLING);
    KVT_EQ(sf_slot(&e, a).num_computed, 32);
    KVT_CHECK(of_active(e.dev) > 0);
    KVT_EQ(sf_abort(&e, a), KVS_OK);
    KVT_EQ(of_active(e.dev), 0); /* released at once */
    after_abort(&e, a, 0);
    sf_close(&e);
}

static void test_abort_decoding(void)
{
    sf_env e;
    uint32_t p[40];
    kvs_step st;
    open_abort_env(&e, 0);
    sf_tokens(65, p, 40);
    uint64_t a = sf_add(&e, p, 32, 0, 0);
    sf_turn(&e, &st); /* 2 full blocks: their stores are due */
    KVT_EQ(sf_state(&e, a), KVS_SLOT_DECODING);
    sf_turn(&e, &st);
    KVT_EQ(sf_state(&e, a), KVS_SLOT_DECODING);
    KVT_EQ(sf_abort(&e, a), KVS_OK);
    KVT_EQ(of_active(e.dev), 0);
    after_abort(&e, a, 0);
    sf_close(&e);
}

/* The victim of sf_fill_device right after its preemption: recompute without tiers leaves it Preempted
 * (or Initialized) in the waiting queue; swap leaves it Preempted or already swapping in. */
static void abort_victim(kvs_preempt_mode mode)
{
    sf_env e;
    sf_opts o;
    uint32_t p[4][64];
    uint64_t low[4];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = mode == KVS_PREEMPT_SWAP ? 64 : 0;
    o.preempt = mode;
    sf_open(&e, &o);
    sf_fill_device(&e, 260, p, low);
    sf_turn(&e, &st); /* the others outgrow the device: #2 goes */
    KVT_EQ(st.num_preempted, 1);
    int s = sf_state(&e, low[2]);
    if (mode == KVS_PREEMPT_SWAP)
        KVT_CHECK(s == KVS_SLOT_PREEMPTED || s == KVS_SLOT_ONBOARD_STAGED || s == KVS_SLOT_ONBOARDING);
    else
        KVT_CHECK(s == KVS_SLOT_PREEMPTED || s == KVS_SLOT_INITIALIZED);
    KVT_EQ(sf_abort(&e, low[2]), KVS_OK);
    kvs_sched_stats ss = sf_stats(&e);
    KVT_EQ(ss.swapped + ss.waiting + ss.onboarding, 0);
    KVT_EQ(ss.running, 3);
    KVT_EQ(of_active(e.dev), 15); /* the three others: 5 blocks each, nothing of the victim */
    after_abort(&e, low[2], 0);
    for (int i = 0; i < 4; i++) {
        if (i == 2) continue;
        KVT_EQ(sf_state(&e, low[i]), KVS_SLOT_FINISHED);
        KVT_EQ(sf_release(&e, low[i]), KVS_OK);
    }
    sf_close(&e);
}

static void test_abort_preempted(void) { abort_victim(KVS_PREEMPT_RECOMPUTE); }
static void test_abort_swapped(void) { abort_victim(KVS_PREEMPT_SWAP); }

/* Aborted between kvs_sched_step and kvs_sched_complete: the step still completes, the request is
 * Finished and out of the next steps, its blocks go back. (The model here skips the aborted item.) */
static void test_abort_mid_step(void)
{
    sf_env e;
    uint32_t p[2][40];
    kvs_step st, rest;
    kvs_sched_item keep[4];
    open_abort_env(&e, 0);
    sf_tokens(66, p[0], 40);
    sf_tokens(67, p[1], 40);
    uint64_t a = sf_add(&e, p[0], 20, 4, 0);
    uint64_t b = sf_add(&e, p[1], 10, 4, 0);
    sf_plan(&e, &st);
    KVT_CHECK(sf_item(&st, a, NULL) != NULL);
    KVT_CHECK(sf_item(&st, b, NULL) != NULL);
    const kvs_sched_item *ib = sf_item(&st, b, NULL);
    rest = st;
    rest.num_prefill = 0;
    rest.num_decode = 0;
    if (ib) {
        keep[0] = *ib;
        rest.prefill = keep;
        rest.num_prefill = 1;
    }
    KVT_EQ(sf_abort(&e, a), KVS_OK);
    sf_model(&e, &rest);
    sf_commit(&e, &st);
    KVT_EQ(sf_state(&e, a), KVS_SLOT_FINISHED);
    KVT_EQ(sf_state(&e, b), KVS_SLOT_DECODING);
    sf_turn(&e, &st);
    KVT_CHECK(sf_item(&st, a, NULL) == NULL);
    KVT_CHECK(sf_item(&st, b, NULL) != NULL);
    after_abort(&e, a, 0);
    KVT_EQ(sf_state(&e, b), KVS_SLOT_FINISHED);
    KVT_EQ(sf_release(&e, b), KVS_OK);
    sf_close(&e);
}

/* kvs_sched_item: "its block table (valid until the next step)" — also when the request is aborted
 * (and, release = 1, released: its id is gone at once) while the forward pass runs: the engine still
 * reads the items of the step in flight; the request's memory is reused only after the step completes.
 * Run in a child process so that a use after free (ASan) fails this test and not the whole program. */
static int mid_step_items_child(void *arg)
{
    int release = *(const int *)arg;
    sf_env e;
    uint32_t p[40], q[40];
    kvs_step st;
    kvs_slot_info si;
    open_abort_env(&e, 0);
    sf_tokens(68, p, 40);
    sf_tokens(69, q, 40);
    uint64_t a = sf_add(&e, p, 40, 4, 0);
    sf_plan(&e, &st);
    const kvs_sched_item *it = sf_item(&st, a, NULL);
    if (!it) return 2;
    const kvb_block *blocks = it->blocks;
    const uint32_t *tokens = it->tokens;
    size_t nb = it->num_blocks, n = it->num_computed + it->num_new;
    if (kvs_sched_abort(e.s, a) != KVS_OK) return 3;
    if (release && (kvs_sched_release(e.s, a) != KVS_OK || kvs_sched_get_slot(e.s, a, &si) != KVS_ENOTFOUND))
        return 5;
    volatile uint64_t sink = 0;
    for (size_t k = 0; k < nb; k++) sink += blocks[k].id;
    for (size_t k = 0; k < n; k++) sink += tokens[k];
    (void)sink;
    if (kvs_sched_complete(e.s, &st) != KVS_OK) return 4;
    if (release) { /* the next request runs (reusing the released one's memory) */
        uint64_t b = sf_add(&e, q, 40, 4, 0);
        sf_plan(&e, &st);
        if (!sf_item(&st, b, NULL) || kvs_sched_complete(e.s, &st) != KVS_OK) return 6;
    }
    return 0;
}

static void mid_step_items_stay_valid(int release)
{
    of_in_child(mid_step_items_child, &release, "the aborted request's block table or tokens were freed mid-step?");
}
static void test_abort_mid_step_items_stay_valid(void) { mid_step_items_stay_valid(0); }
static void test_release_mid_step_items_stay_valid(void) { mid_step_items_stay_valid(1); }

/* Requests arrive while the forward pass runs: adding them between kvs_sched_step and kvs_sched_complete
 * must leave the step's arrays (its items and preempted list) where the engine reads them. 100 adds grow
 * every per-request list of the scheduler past the room the first request made. Run in a child process
 * so that a use after free (ASan) fails this test and not the whole program. */
static int add_mid_step_child(void *arg)
{
    (void)arg;
    sf_env e;
    uint32_t p[40];
    kvs_step st;
    open_abort_env(&e, 0);
    sf_tokens(71, p, 40);
    uint64_t a = sf_add(&e, p, 40, 4, 0);
    sf_plan(&e, &st);
    if (st.num_prefill != 1) return 2;
    for (int i = 0; i < 100; i++) {
        uint64_t id = 0;
        kvs_request rq;
        memset(&rq, 0, sizeof rq);
        rq.prompt = p;
        rq.num_prompt = 8 + (size_t)i % 30;
        rq.max_new_tokens = 1;
        if (kvs_sched_add(e.s, &rq, &id) != KVS_OK) return 3;
    }
    volatile uint64_t sink = st.prefill[0].request + st.prefill[0].num_new; /* the engine reads its items */
    if (sink != a + 32) return 4;
    if (kvs_sched_complete(e.s, &st) != KVS_OK) return 5;
    if (kvs_sched_step(e.s, &st) != KVS_OK || kvs_sched_complete(e.s, &st) != KVS_OK) return 6;
    return 0;
}

static void test_add_mid_step_items_stay_valid(void)
{
    of_in_child(add_mid_step_child, NULL, "the step's items were freed by an add mid-step?");
}

/* kvs_sched_destroy with requests in every state aborts them all (the pools show nothing pinned). */
static void test_destroy_aborts_everything(void)
{
    sf_env e;
    uint32_t p[4][100];
    kvs_step st;
    open_abort_env(&e, 0);
    for (int i = 0; i < 4; i++) sf_tokens(70 + (uint64_t)i, p[i], 100);
    sf_add(&e, p[0], 20, 0, 0);
    sf_turn(&e, &st); /* decoding */
    sf_add(&e, p[1], 100, 0, 0);
    sf_turn(&e, &st); /* prefilling */
    sf_add(&e, p[2], 30, 0, 0); /* waiting */
    KVT_CHECK(of_active(e.dev) > 0);
    kvs_sched_destroy(e.s);
    e.s = NULL;
    KVT_EQ(kvo_manager_drain(e.m, 5000000), KVO_OK);
    KVT_EQ(of_active(e.dev), 0);
    KVT_EQ(of_active(e.host), 0);
    sf_close(&e);
}

/* ---- bad input -------------------------------------------------------------------------------------- */

/* ---- found by tests/fuzz/fuzz_sched.c ------------------------------------------------------------------ */

/* Loads kept for a waiting request pin their device blocks until it is admitted. When the request ahead
 * of it in the queue needs those blocks and nothing runs that could give any back, the pinned loads must
 * give way: else neither request ever runs. B (priority -1) loads 5 blocks from the host, then H
 * (priority 0, 11 of the device's 12 blocks) arrives and queues ahead of B. */
static void test_pinned_loads_do_not_block_the_queue(void)
{
    sf_env e;
    sf_opts o;
    uint32_t a[81], h[160];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 12;
    o.device_memory = 1;
    o.host_blocks = 32;
    sf_open(&e, &o);
    sf_tokens(41, a, 81);
    sf_tokens(42, h, 160);
    uint64_t ra = sf_add(&e, a, 80, 1, 0); /* A's 5 full blocks go to the host */
    sf_run(&e, 20);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(sf_release(&e, ra), KVS_OK);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);
    uint64_t rb = sf_add(&e, a, 81, 1, -1);
    sf_turn(&e, &st);                      /* B's loads start */
    KVT_EQ(st.meta.num_loads, 1);
    uint64_t rh = sf_add(&e, h, 160, 2, 0);
    sf_run(&e, 40);                        /* H first (B's blocks evicted as needed), then B */
    KVT_EQ(sf_state(&e, rh), KVS_SLOT_FINISHED);
    KVT_EQ(sf_state(&e, rb), KVS_SLOT_FINISHED);
    sf_close(&e);
}

/* A swapped request whose loads landed holds their blocks; with nothing running, those must not keep it
 * out. R (7 of the device's 8 blocks) is swapped out by X's growth; when X is done, R loads back the
 * blocks X evicted and must then be admitted, though the free and evictable blocks alone are fewer than
 * its 7. */
static void test_swapped_request_own_loads_do_not_block_it(void)
{
    sf_env e;
    sf_opts o;
    uint32_t x[15], r[97];
    o = swap_opts(8);
    sf_open(&e, &o);
    sf_tokens(51, x, 15);
    sf_tokens(52, r, 97);
    uint64_t rx = sf_add(&e, x, 15, 40, 0);
    uint64_t rr = sf_add(&e, r, 97, 7, 0);
    sf_run(&e, 200);
    KVT_EQ(sf_slot(&e, rr).preemptions, 1);
    KVT_CHECK(sf_loads_of(&e, rr) >= 1);
    KVT_EQ(sf_state(&e, rx), KVS_SLOT_FINISHED);
    KVT_EQ(sf_state(&e, rr), KVS_SLOT_FINISHED);
    sf_close(&e);
}

/* The same with something still running: the device has room for R beside X (its 6 loaded blocks and
 * one free), so R is admitted as soon as its loads land. Before, the blocks its own loads held did not
 * count as room, so R (and the waiting queue behind it) waited until X had grown to fill the device and
 * preempted itself. R (priority -1, 7 of the device's 12 blocks) runs beside X (priority 1, 1 block);
 * Y (priority 0, 11 blocks) swaps R out, evicting all of its blocks, and ends after its prefill. */
static void test_swapped_request_own_loads_count_as_room(void)
{
    sf_env e;
    sf_opts o;
    uint32_t x[4], r[97], y[176];
    kvs_step st;
    int steps = 0;
    o = swap_opts(12);
    sf_open(&e, &o);
    sf_tokens(81, x, 4);
    sf_tokens(82, r, 97);
    sf_tokens(83, y, 176);
    uint64_t rx = sf_add(&e, x, 4, 100, 1);
    uint64_t rr = sf_add(&e, r, 97, 50, -1);
    sf_turn(&e, &st);
    uint64_t ry = sf_add(&e, y, 176, 1, 0);
    sf_turn(&e, &st);
    KVT_EQ(sf_state(&e, rr), KVS_SLOT_PREEMPTED);
    KVT_EQ(sf_state(&e, ry), KVS_SLOT_FINISHED);
    while (steps < 10 && sf_state(&e, rr) != KVS_SLOT_DECODING) {
        sf_turn(&e, &st);
        steps++;
    }
    KVT_CHECK(steps <= 3); /* staged, loaded, admitted */
    KVT_EQ(sf_state(&e, rr), KVS_SLOT_DECODING);
    KVT_EQ(sf_slot(&e, rr).num_lower_hit_tokens, 96);
    KVT_EQ(sf_slot(&e, rx).preemptions, 0);
    KVT_EQ(sf_state(&e, rx), KVS_SLOT_DECODING);
    sf_run(&e, 400);
    KVT_EQ(sf_state(&e, rr), KVS_SLOT_FINISHED);
    KVT_EQ(sf_state(&e, rx), KVS_SLOT_FINISHED);
    sf_close(&e);
}

/* A decode computes all of its new tokens in one step, so an append of more tokens than the step's token
 * budget could never be scheduled: it is refused (KVS_ETOOBIG, nothing changed), unless it ends the
 * request. Budget 8: 9 tokens refused, 8 taken and computed in one step; 10 that reach max_new_tokens
 * end the request. */
static void test_append_beyond_step_budget(void)
{
    sf_env e;
    sf_opts o;
    uint32_t p[6], t[10];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.max_tokens = 8;
    sf_open(&e, &o);
    sf_tokens(61, p, 6);
    sf_tokens(62, t, 10);
    uint64_t a = sf_add(&e, p, 5, 0, 0);
    uint64_t b = sf_add(&e, p, 6, 10, 0);
    KVT_EQ(kvs_sched_step(e.s, &st), KVS_OK); /* a's 5 tokens, b's first 3 */
    KVT_EQ(kvs_sched_complete(e.s, &st), KVS_OK);
    KVT_EQ(sf_state(&e, a), KVS_SLOT_DECODING);
    KVT_EQ(kvs_sched_append(e.s, a, t, 9), KVS_ETOOBIG);
    KVT_EQ(sf_slot(&e, a).num_tokens, 5);
    KVT_EQ(kvs_sched_append(e.s, a, t, 8), KVS_OK);
    KVT_EQ(kvs_sched_step(e.s, &st), KVS_OK);
    const kvs_sched_item *it = sf_item(&st, a, NULL);
    KVT_CHECK(it != NULL);
    if (it) KVT_EQ(it->num_new, 8);
    KVT_EQ(kvs_sched_complete(e.s, &st), KVS_OK);
    for (int i = 0; i < 3 && sf_state(&e, b) != KVS_SLOT_DECODING; i++) {
        KVT_EQ(kvs_sched_step(e.s, &st), KVS_OK);
        KVT_EQ(kvs_sched_complete(e.s, &st), KVS_OK);
    }
    KVT_EQ(sf_slot(&e, b).num_computed, 6);
    KVT_EQ(kvs_sched_append(e.s, b, t, 10), KVS_OK);
    KVT_EQ(sf_state(&e, b), KVS_SLOT_FINISHED);
    KVT_EQ(kvs_sched_finish(e.s, a), KVS_OK);
    sf_close(&e);
}

/* A slot's lower-tier hits are part of its cached tokens ("cached: device + lower tiers"), and so in the
 * counters: a prompt of exactly 4 blocks found in the host caches 48 tokens (the last token, in the 4th
 * block, is always computed), so at most 48 of them came from the host (3 blocks are loaded:
 * test_onboard_skips_last_token_block). */
/* A device of 16 blocks over a host tier of 32, after a first request of prompt b (len tokens, seed)
 * ran and went: its 4 full blocks (hashes h) are on the host, and still cached on the device. */
static void open_after_a_stored_prompt(sf_env *e, uint32_t seed, uint32_t *b, size_t len, kvb_hash *h)
{
    sf_opts o;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = 32;
    sf_open(e, &o);
    sf_tokens(seed, b, len);
    hashes_of(b, len, h, 4, 4);
    uint64_t a = sf_add(e, b, len, 1, 0);
    sf_run(e, 10);
    KVT_EQ(sf_settle(e), 0);
    KVT_EQ(lookup(e->host, h, 4), 4);
    KVT_EQ(sf_release(e, a), KVS_OK);
}

static void test_lower_hits_within_cached(void)
{
    sf_env e;
    uint32_t b[64];
    kvb_hash h[4];
    open_after_a_stored_prompt(&e, 71, b, 64, h);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);
    uint64_t q = sf_add(&e, b, 64, 1, 0);
    sf_run(&e, 10);
    KVT_EQ(sf_loads_of(&e, q), 1);
    kvs_slot_info iq = sf_slot(&e, q);
    KVT_EQ(iq.num_cached, 48);
    KVT_EQ(iq.num_lower_hit_tokens, 48);
    KVT_EQ(sf_stats(&e).lower_hit_tokens, 48);
    sf_close(&e);
}

/* Blocks loaded from the host for request q, from the scheduler's log of planned loads. */
static size_t loaded_blocks_of(const sf_env *e, uint64_t q)
{
    size_t n = 0;
    for (size_t i = 0; i < e->nloads; i++)
        if (e->loads[i].request == q) n += e->loads[i].num_blocks;
    return n;
}

/* A block's references, by its handle. */
static uint32_t refs_of(kvb_pool *pool, kvb_block b)
{
    kvb_block_info info;
    memset(&info, 0, sizeof info);
    KVT_EQ(kvb_block_get_info(pool, b.id, &info), KVB_OK);
    return info.refs;
}

/* A 72-token prompt b (4 full blocks, hashes h) stored as by open_after_a_stored_prompt; blocks 2 and 3
 * dropped from the device; q (prompt b, priority 0) added and staged: blocks 0 and 1 held on the
 * device, 2 and 3 loading. Returns q. */
static uint64_t stage_two_loading(sf_env *e, uint32_t seed, uint32_t *b, kvb_hash *h, uint32_t max_new)
{
    size_t dropped = 0;
    kvs_step st;
    open_after_a_stored_prompt(e, seed, b, 72, h);
    KVT_EQ(kvb_invalidate(e->dev, h + 2, 2, &dropped), KVB_OK);
    KVT_EQ(dropped, 2);
    KVT_EQ(lookup(e->dev, h, 4), 2);
    uint64_t q = sf_add(e, b, 72, max_new, 0);
    sf_turn(e, &st); /* q's loads of blocks 2 and 3 start */
    KVT_EQ(sf_state(e, q), KVS_SLOT_ONBOARDING);
    return q;
}

/* The device prefix is held while the loads behind it run: a block of it that went meanwhile would stop
 * the admission's match before the loaded blocks, which would then be recomputed (vLLM holds them too).
 * A 72-token prompt (4 full blocks), all on the host, blocks 0 and 1 still on the device: blocks 2 and
 * 3 are loaded; while they load, block 1 cannot be dropped (kvb_invalidate drops only blocks nobody
 * holds). q caches all 4 blocks: 2 from the device, 2 from the host. (Before, block 1 went, q cached
 * block 0 alone and recomputed the loaded ones.) That the hold counts no lookup and is no use to the
 * policy: test_prefix_match (kvb_pin). */
static void test_device_prefix_held_while_loading(void)
{
    sf_env e;
    uint32_t b[72];
    kvb_hash h[4];
    size_t dropped = 0;
    kvs_step st;
    uint64_t q = stage_two_loading(&e, 73, b, h, 1);
    KVT_EQ(loaded_blocks_of(&e, q), 2);
    KVT_EQ(kvb_invalidate(e.dev, h + 1, 1, &dropped), KVB_OK);
    KVT_EQ(dropped, 0); /* held */
    const kvs_sched_item *it = NULL;
    for (int i = 0; i < 10 && !it; i++) {
        KVT_EQ(sf_plan(&e, &st), KVS_OK);
        if ((it = sf_item(&st, q, NULL)) != NULL) /* admitted: the hold went, its sequence's references stay */
            for (size_t j = 0; j < 4; j++) KVT_EQ(refs_of(e.dev, it->blocks[j]), 1);
        sf_model(&e, &st);
        sf_commit(&e, &st);
    }
    KVT_CHECK(it != NULL);
    sf_run(&e, 10);
    KVT_EQ(sf_settle(&e), 0);
    kvs_slot_info iq = sf_slot(&e, q);
    KVT_EQ(iq.num_cached, 64);
    KVT_EQ(iq.num_lower_hit_tokens, 32);
    KVT_EQ(sf_stats(&e).lower_hit_tokens, 32);
    KVT_EQ(sf_stats(&e).cached_tokens, 64);
    kvb_pool_stats ps;
    KVT_EQ(kvb_pool_get_stats(e.dev, &ps), KVB_OK);
    KVT_EQ(ps.active_blocks, 0); /* q finished: the hold went at its admission, its own references at its end */
    sf_close(&e);
}

/* A request that ends while its loads run gives its held prefix back: aborted while onboarding, the
 * device's blocks are all evictable again (and sf_close checks the pool). */
static void test_abort_while_loading_lets_the_prefix_go(void)
{
    sf_env e;
    uint32_t b[72];
    kvb_hash h[4];
    size_t dropped = 0;
    uint64_t q = stage_two_loading(&e, 75, b, h, 1);
    KVT_EQ(kvb_invalidate(e.dev, h + 1, 1, &dropped), KVB_OK);
    KVT_EQ(dropped, 0);
    KVT_EQ(sf_abort(&e, q), KVS_OK);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(kvb_invalidate(e.dev, h, 2, &dropped), KVB_OK);
    KVT_EQ(dropped, 2); /* nobody holds them now */
    sf_close(&e);
}

/* A request that cannot get in after its loads holds nothing while it waits: q (priority 0) is staged
 * with blocks 0 and 1 held on the device and 2 and 3 loading; r (priority 1, 12 blocks) takes the rest
 * of the device. When q's loads are done it does not fit and may preempt nobody: its hold goes (blocks 0
 * and 1 idle, evictable), and the loaded blocks stay pinned for it. */
static void test_waiting_request_lets_its_prefix_go(void)
{
    sf_env e;
    uint32_t b[72], c[180];
    kvb_hash h[4];
    kvs_step st;
    kvb_pool_stats ps;
    uint64_t q = stage_two_loading(&e, 77, b, h, 4);
    sf_tokens(78, c, 180);
    uint64_t r = sf_add(&e, c, 180, 5, 1);
    sf_turn(&e, &st); /* r in; q's loads are done, it does not fit */
    KVT_EQ(sf_state(&e, r), KVS_SLOT_DECODING);
    KVT_EQ(sf_state(&e, q), KVS_SLOT_ONBOARDING);
    KVT_EQ(kvb_pool_get_stats(e.dev, &ps), KVB_OK);
    KVT_EQ(ps.free_blocks, 0);
    KVT_EQ(ps.inactive_blocks, 2);
    kvb_weak idle[4];
    size_t nidle = 0, seen = 0;
    KVT_EQ(kvb_eviction_candidates(e.dev, 4, idle, &nidle), KVB_OK);
    KVT_EQ(nidle, 2);
    for (size_t k = 0; k < nidle; k++) {
        kvb_block_info bi;
        KVT_EQ(kvb_block_get_info(e.dev, idle[k].id, &bi), KVB_OK);
        for (int z = 0; z < 2; z++) seen += bi.hash.lo == h[z].lo && bi.hash.hi == h[z].hi;
    }
    KVT_EQ(seen, 2); /* q's prefix, held no more */
    sf_run(&e, 100);
    KVT_EQ(sf_settle(&e), 0);
    sf_close(&e);
}

/* A request whose loads are done counts its own held prefix as room: its prefix blocks are its own
 * (kvs__fits). Device of 16 over a host of 32, one admission a step: prompts a and b (72 tokens: 4 full
 * blocks and 8 more) each stored on the host, blocks 0 and 1 of each still on the device. q (a) and q2
 * (b) are staged together: each holds its 2 device blocks and loads 2. The test then holds 4 free
 * blocks, so 4 are free or evictable: q needs 5, 2 of them its own held prefix, 1 to allocate. It is
 * admitted with nothing else let go: q2 keeps its held prefix and its loaded blocks (4 active blocks).
 * Without its own hold counted, q "did not fit" with nothing running, and the deadlock breaker let go
 * of every queued request's holds and loads first, q2's too. */
static void test_own_held_prefix_counts_as_room(void)
{
    sf_env e;
    sf_opts o;
    uint32_t a[72], b[72];
    kvb_hash ha[4], hb[4];
    size_t dropped = 0;
    kvs_step st;
    kvb_pool_stats ps;
    kvb_block hold[4];
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = 32;
    o.max_seqs = 1;
    sf_open(&e, &o);
    sf_tokens(81, a, 72);
    sf_tokens(82, b, 72);
    hashes_of(a, 72, ha, 4, 4);
    hashes_of(b, 72, hb, 4, 4);
    uint64_t x = sf_add(&e, a, 72, 1, 0), y = sf_add(&e, b, 72, 1, 0);
    sf_run(&e, 20);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(lookup(e.host, ha, 4), 4);
    KVT_EQ(lookup(e.host, hb, 4), 4);
    KVT_EQ(sf_release(&e, x), KVS_OK);
    KVT_EQ(sf_release(&e, y), KVS_OK);
    KVT_EQ(kvb_invalidate(e.dev, ha + 2, 2, &dropped), KVB_OK);
    KVT_EQ(dropped, 2);
    KVT_EQ(kvb_invalidate(e.dev, hb + 2, 2, &dropped), KVB_OK);
    KVT_EQ(dropped, 2);
    uint64_t q = sf_add(&e, a, 72, 4, 0), q2 = sf_add(&e, b, 72, 4, 0);
    sf_turn(&e, &st); /* both staged: 2 held each, 2 to load each (their device blocks taken as they land) */
    KVT_EQ(sf_state(&e, q), KVS_SLOT_ONBOARDING);
    KVT_EQ(sf_state(&e, q2), KVS_SLOT_ONBOARDING);
    KVT_EQ(kvb_pool_get_stats(e.dev, &ps), KVB_OK);
    KVT_EQ(ps.active_blocks, 4);
    KVT_EQ(kvb_alloc(e.dev, 4, hold), KVB_OK); /* 16 - 4 held - 4 loaded - these 4: 4 left */
    for (int i = 0; i < 4 && sf_state(&e, q) != KVS_SLOT_DECODING; i++) sf_turn(&e, &st);
    KVT_EQ(sf_state(&e, q), KVS_SLOT_DECODING);
    KVT_EQ(sf_slot(&e, q).num_cached, 64);
    KVT_EQ(sf_state(&e, q2), KVS_SLOT_ONBOARDING); /* not admitted yet: one admission a step */
    KVT_EQ(kvb_invalidate(e.dev, hb, 4, &dropped), KVB_OK);
    KVT_EQ(dropped, 0); /* q2's prefix still held, its loaded blocks still pinned */
    KVT_EQ(kvb_release(e.dev, hold, 4, NULL), KVB_OK);
    sf_run(&e, 40);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(sf_slot(&e, q2).num_cached, 64);
    sf_close(&e);
}

/* A request's lower-tier hits belong to the admission whose loads were staged for it. q (priority 0)
 * is admitted with 3 blocks loaded from the host (48 tokens); r (the same prompt, priority 1) shares
 * them; once q has 85 tokens, f and g (one prompt, priority 1) fill the device and q is preempted. When
 * f finishes, only its own blocks come back (g shares the rest): fewer than q's 6, so q is admitted
 * without staging (kvs__admit_queue), and gets in, its prefix held by r. Its cached tokens are device
 * hits: the first admission's 48 lower-tier tokens were counted again (96). */
static void test_lower_hits_not_counted_again(void)
{
    sf_env e;
    uint32_t b[64], c[64];
    kvb_hash h[4];
    kvs_step st;
    kvb_pool_stats ps;
    open_after_a_stored_prompt(&e, 79, b, 64, h);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);
    uint64_t q = sf_add(&e, b, 64, 40, 0);
    for (int i = 0; i < 10 && sf_state(&e, q) != KVS_SLOT_DECODING; i++) sf_turn(&e, &st);
    KVT_EQ(sf_state(&e, q), KVS_SLOT_DECODING);
    KVT_EQ(sf_slot(&e, q).num_lower_hit_tokens, 48);
    KVT_EQ(sf_stats(&e).lower_hit_tokens, 48);
    uint64_t r = sf_add(&e, b, 64, 40, 1);
    for (int i = 0; i < 20; i++) sf_turn(&e, &st);
    KVT_EQ(sf_slot(&e, q).num_tokens, 85);
    sf_tokens(80, c, 64);
    uint64_t f = sf_add(&e, c, 64, 8, 1);
    (void)sf_add(&e, c, 64, 40, 1);
    int preempted = 0, back = 0;
    for (int i = 0; i < 40 && !back; i++) {
        KVT_EQ(kvb_pool_get_stats(e.dev, &ps), KVB_OK);
        size_t room = (size_t)ps.free_blocks + ps.inactive_blocks;
        sf_turn(&e, &st);
        if (sf_state(&e, q) == KVS_SLOT_PREEMPTED) preempted = 1;
        else if (preempted) {
            back = 1;
            KVT_CHECK(room < 6); /* the admission without staging */
            KVT_EQ(sf_state(&e, f), KVS_SLOT_FINISHED);
        }
    }
    KVT_CHECK(preempted && back);
    KVT_EQ(sf_state(&e, r), KVS_SLOT_DECODING);
    KVT_EQ(sf_loads_of(&e, q), 1);
    KVT_EQ(sf_slot(&e, q).num_lower_hit_tokens, 0);
    KVT_EQ(sf_stats(&e).lower_hit_tokens, 48);
    sf_run(&e, 200);
    sf_close(&e);
}

/* A prompt whose last token ends a block: admission never matches that block (the last token is always
 * computed, for its logits), so onboarding must not load it. A 64-token prompt, all 4 blocks on the host
 * and none on the device: 3 blocks come up, the 4th is computed. A 56-token prompt (3 full blocks and 8
 * tokens) still gets all 3 of its full blocks. */
static void onboard_all_on_host(size_t len, size_t expect_loaded)
{
    sf_env e;
    sf_opts o;
    uint32_t b[64];
    kvb_hash h[4];
    kvo_manager_stats m0, m1;
    size_t full = len / 16;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = 32;
    sf_open(&e, &o);
    sf_tokens(72, b, len);
    hashes_of(b, len, h, 4, full);
    uint64_t a = sf_add(&e, b, len, 1, 0);
    sf_run(&e, 10);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(lookup(e.host, h, full), full);
    KVT_EQ(sf_release(&e, a), KVS_OK);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);
    KVT_EQ(kvo_manager_get_stats(e.m, &m0), KVO_OK);
    uint64_t q = sf_add(&e, b, len, 1, 0);
    kvs_step st;
    int pre = 0;
    const kvs_sched_item *it = NULL;
    for (int i = 0; i < 10 && !it; i++) { /* onboard, then the step that admits q */
        sf_turn(&e, &st);
        it = sf_item(&st, q, &pre);
    }
    KVT_CHECK(it != NULL && pre);
    if (it) {
        KVT_EQ(it->num_computed, expect_loaded * 16);
        KVT_EQ(it->num_new, len - expect_loaded * 16);
    }
    sf_run(&e, 10);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(kvo_manager_get_stats(e.m, &m1), KVO_OK);
    KVT_EQ(loaded_blocks_of(&e, q), expect_loaded);
    KVT_EQ(m1.up[1].transferred - m0.up[1].transferred, expect_loaded); /* what actually moved */
    kvs_slot_info iq = sf_slot(&e, q);
    KVT_EQ(iq.num_cached, expect_loaded * 16);
    KVT_EQ(iq.num_lower_hit_tokens, expect_loaded * 16);
    KVT_EQ(sf_stats(&e).lower_hit_tokens, expect_loaded * 16);
    KVT_EQ(lookup(e.dev, h, full), full); /* the computed last block is registered as usual */
    sf_close(&e);
}

static void test_onboard_skips_last_token_block(void)
{
    onboard_all_on_host(64, 3);
    onboard_all_on_host(56, 3);
}

static void test_bad_input(void)
{
    kvb_pool_config pc;
    kvb_pool *dev = NULL, *other = NULL, *host = NULL;
    kvs_sched *s = NULL;
    kvs_sched_config sc;
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = 8;
    pc.block_tokens = 16;
    KVT_EQ(kvb_pool_create(&pc, &dev), KVB_OK);
    KVT_EQ(kvb_pool_create(&pc, &other), KVB_OK);
    pc.num_blocks = 16;
    KVT_EQ(kvb_pool_create(&pc, &host), KVB_OK);

    /* create */
    sc = plain_config(dev);
    KVT_EQ(kvs_sched_create(NULL, &s), KVS_EINVAL);
    KVT_EQ(kvs_sched_create(&sc, NULL), KVS_EINVAL);
    sc.device = NULL;
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_EINVAL);
    sc = plain_config(dev);
    sc.preempt = KVS_PREEMPT_SWAP; /* swap needs tiers */
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_EINVAL);
    KVT_CHECK(s == NULL);

    /* tiers whose G1 is another pool */
    kvo_backend *mem = NULL;
    kvo_manager *m = NULL;
    kvo_manager_config mc;
    KVT_EQ(kvo_memcpy_backend_create(0, &mem), KVO_OK);
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 2;
    mc.pools[0] = other;
    mc.pools[1] = host;
    mc.down[0] = mem;
    mc.up[1] = mem;
    mc.pipeline.mode = KVO_MODE_POLL;
    KVT_EQ(kvo_manager_create(&mc, &m), KVO_OK);
    sc = plain_config(dev);
    sc.tiers = m;
    KVT_CHECK(kvs_sched_create(&sc, &s) != KVS_OK);
    kvs_sched_destroy(s); /* in case it was accepted */
    s = NULL;
    kvs_connector_config cc;
    kvs_connector *c = NULL;
    memset(&cc, 0, sizeof cc);
    cc.device = dev;
    cc.tiers = m;
    KVT_CHECK(kvs_connector_create(&cc, &c) != KVS_OK);
    kvs_connector_destroy(c);
    c = NULL;
    KVT_EQ(kvs_connector_create(NULL, &c), KVS_EINVAL);
    cc.tiers = NULL;
    KVT_EQ(kvs_connector_create(&cc, &c), KVS_EINVAL); /* tiers are required for a connector */
    cc.tiers = m;
    cc.device = NULL;
    KVT_EQ(kvs_connector_create(&cc, &c), KVS_EINVAL);
    KVT_CHECK(c == NULL);
    kvo_manager_destroy(m);

    /* tiers on `dev`: swap needs their G1 -> G2 pipeline; a lazy connector needs a lazy manager */
    mc.pools[0] = dev;
    mc.down[0] = NULL; /* onboarding only */
    KVT_EQ(kvo_manager_create(&mc, &m), KVO_OK);
    sc = plain_config(dev);
    sc.tiers = m;
    sc.preempt = KVS_PREEMPT_SWAP;
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_EINVAL); /* swapping out would move nothing */
    KVT_CHECK(s == NULL);
    kvo_manager_destroy(m);
    mc.down[0] = mem; /* eager */
    KVT_EQ(kvo_manager_create(&mc, &m), KVO_OK);
    sc.tiers = m;
    sc.preempt = KVS_PREEMPT_RECOMPUTE;
    sc.offload = KVS_OFFLOAD_LAZY;
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_EINVAL); /* nothing would ever be offered */
    KVT_CHECK(s == NULL);
    sc.offload = KVS_OFFLOAD_EAGER;
    sc.preempt = KVS_PREEMPT_SWAP;
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_OK);
    kvs_sched_destroy(s);
    s = NULL;
    kvo_manager_destroy(m);
    mc.offload = KVO_OFFLOAD_LAZY;
    KVT_EQ(kvo_manager_create(&mc, &m), KVO_OK);
    kvo_manager_config got;
    KVT_EQ(kvo_manager_get_config(m, &got), KVO_OK);
    KVT_EQ(got.offload, KVO_OFFLOAD_LAZY);
    KVT_EQ(got.lazy_reserve, 64); /* the default, filled in */
    KVT_EQ(kvo_manager_get_config(NULL, &got), KVO_EINVAL);
    KVT_EQ(kvo_manager_get_config(m, NULL), KVO_EINVAL);
    sc.tiers = m;
    sc.offload = KVS_OFFLOAD_LAZY;
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_OK);
    kvs_sched_destroy(s);
    s = NULL;
    kvo_manager_destroy(m);
    kvo_backend_destroy(mem);

    sc = plain_config(dev);
    KVT_EQ(kvs_sched_create(&sc, &s), KVS_OK);
    KVT_CHECK(kvs_sched_connector(s) == NULL);
    KVT_EQ(kvs_sched_idle(s), 1);

    /* add */
    uint32_t p[200];
    uint64_t id = 0, extra[KVB_MAX_EXTRA_KEYS + 1];
    kvs_request rq;
    sf_tokens(90, p, 200);
    memset(extra, 0, sizeof extra);
    memset(&rq, 0, sizeof rq);
    rq.prompt = p;
    rq.num_prompt = 20;
    rq.max_new_tokens = 4;
    KVT_EQ(kvs_sched_add(NULL, &rq, &id), KVS_EINVAL);
    KVT_EQ(kvs_sched_add(s, NULL, &id), KVS_EINVAL);
    rq.num_prompt = 0;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_EINVAL);
    rq.num_prompt = 20;
    rq.prompt = NULL;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_EINVAL);
    rq.prompt = p;
    rq.extra = NULL;
    rq.num_extra = 1;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_EINVAL);
    rq.extra = extra;
    rq.num_extra = KVB_MAX_EXTRA_KEYS + 1;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_EINVAL);
    rq.extra = NULL;
    rq.num_extra = 0;
    /* the device holds 8 blocks = 128 tokens */
    rq.num_prompt = 129;
    rq.max_new_tokens = 1;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_ETOOBIG);
    rq.num_prompt = 100;
    rq.max_new_tokens = 100;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_ETOOBIG);
    KVT_EQ(kvs_sched_idle(s), 1); /* a failed call changes nothing */
    kvs_sched_stats ss;
    KVT_EQ(kvs_sched_get_stats(s, &ss), KVS_OK);
    KVT_EQ(ss.waiting, 0);
    KVT_EQ(ss.admitted, 0);
    KVT_EQ(kvs_sched_get_stats(s, NULL), KVS_EINVAL);
    KVT_EQ(kvs_sched_get_stats(NULL, &ss), KVS_EINVAL);
    rq.num_prompt = 20;
    rq.max_new_tokens = 4;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_OK);
    KVT_EQ(kvs_sched_idle(s), 0);

    /* unknown ids */
    kvs_slot_info info;
    uint32_t tok = 1;
    const uint64_t bogus = id + 12345;
    KVT_EQ(kvs_sched_get_slot(s, bogus, &info), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_append(s, bogus, &tok, 1), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_finish(s, bogus), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_abort(s, bogus), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_release(s, bogus), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_get_slot(s, id, NULL), KVS_EINVAL);
    KVT_EQ(kvs_sched_get_slot(NULL, id, &info), KVS_EINVAL);

    /* append to a request that is not decoding */
    KVT_EQ(kvs_sched_append(s, id, &tok, 1), KVS_ESTATE);
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.num_tokens, 20);

    /* steps: complete without a step, with a wrong one, twice; a second step before completing */
    kvs_step st, wrong;
    memset(&st, 0, sizeof st);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_ESTEP);
    KVT_EQ(kvs_sched_step(s, NULL), KVS_EINVAL);
    KVT_EQ(kvs_sched_step(NULL, &st), KVS_EINVAL);
    KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
    KVT_EQ(st.num_prefill, 1);
    kvs_step again;
    KVT_EQ(kvs_sched_step(s, &again), KVS_ESTEP);
    wrong = st;
    wrong.id = st.id + 1;
    KVT_EQ(kvs_sched_complete(s, &wrong), KVS_ESTEP);
    KVT_EQ(kvs_sched_complete(s, NULL), KVS_EINVAL);
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.num_computed, 0); /* nothing committed by the refused calls */
    KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_ESTEP);
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.num_computed, 20);
    KVT_EQ(info.state, KVS_SLOT_DECODING);
    KVT_EQ(kvs_sched_append(s, id, NULL, 1), KVS_EINVAL);
    uint32_t many[120];
    sf_tokens(91, many, 120);
    KVT_EQ(kvs_sched_append(s, id, many, 5), KVS_EINVAL); /* past max_new_tokens: 4 left */
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.num_tokens, 20);
    KVT_EQ(kvs_sched_append(s, id, &tok, 1), KVS_OK);
    KVT_EQ(kvs_sched_finish(s, id), KVS_OK);
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.state, KVS_SLOT_FINISHED);
    KVT_EQ(kvs_sched_release(s, id), KVS_OK);
    KVT_EQ(kvs_sched_idle(s), 1);

    /* no max_new_tokens: it may grow to the device pool (8 blocks of 16), not past it */
    rq.max_new_tokens = 0;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_OK);
    KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_append(s, id, many, 109), KVS_ETOOBIG); /* 129 tokens: it could never run again */
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.num_tokens, 20);
    KVT_EQ(kvs_sched_append(s, id, many, 108), KVS_OK); /* 128: the whole device */
    KVT_EQ(kvs_sched_finish(s, id), KVS_OK);
    KVT_EQ(kvs_sched_release(s, id), KVS_OK);
    KVT_EQ(kvs_sched_idle(s), 1);
    KVT_EQ(of_active(dev), 0);
    kvs_sched_destroy(s);
    OF_CHECK_POOL(dev);
    kvb_pool_destroy(dev);
    kvb_pool_destroy(other);
    kvb_pool_destroy(host);
}

/* ---- sizing and strings ----------------------------------------------------------------------------- */

static void test_sizing(void)
{
    kvb_layout l;
    uint32_t bt = 0;
    const uint64_t MiB = 1024ull * 1024ull, GiB = 1024ull * MiB;
    kvb_layout_kind kinds[2] = {KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_LAYER_SEPARATE};
    for (int k = 0; k < 2; k++) {
        memset(&l, 0, sizeof l);
        KVT_EQ(kvs_model_preset(KVS_MODEL_LLAMA3_8B, kinds[k], &bt, &l), KVS_OK);
        KVT_EQ(bt, 16);
        KVT_EQ(l.kind, kinds[k]);
        KVT_EQ(l.num_layers, 32);
        KVT_CHECK(l.num_parts == 2 || l.num_parts == 0);
        KVT_EQ(l.page_bytes, 32 * 1024); /* 16 tokens x 8 KV heads x 128 dims x 2 bytes */
        KVT_EQ(kvs_blocks_for_bytes(&l, GiB), 512);
        KVT_EQ(kvs_blocks_for_bytes(&l, 2 * MiB), 1);
        KVT_EQ(kvs_blocks_for_bytes(&l, 2 * MiB - 1), 0);
        KVT_EQ(kvs_blocks_for_bytes(&l, 4 * MiB - 1), 1);
        KVT_EQ(kvs_blocks_for_bytes(&l, 0), 0);
        KVT_EQ(kvs_blocks_for_bytes(&l, 80 * GiB), 40960);
        KVT_EQ(kvs_blocks_for_bytes(&l, 40 * GiB + 5), 20480);
    }
    memset(&l, 0, sizeof l);
    KVT_EQ(kvs_model_preset(KVS_MODEL_TINY, KVB_LAYOUT_BLOCK_CONTIGUOUS, &bt, &l), KVS_OK);
    KVT_EQ(bt, 16);
    KVT_EQ(l.num_layers, 2);
    KVT_EQ(l.page_bytes, 16 * 4 * 16 * 4);
    KVT_EQ(kvs_blocks_for_bytes(&l, MiB), 64);
    /* a pool made from the preset has the block size the sizing assumed */
    kvb_pool_config pc;
    kvb_pool *pool = NULL;
    uint64_t block_bytes = 0;
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = kvs_blocks_for_bytes(&l, MiB);
    pc.block_tokens = bt;
    pc.storage = KVB_STORAGE_HOST;
    pc.layout = l;
    KVT_EQ(kvb_pool_create(&pc, &pool), KVB_OK);
    KVT_EQ(kvb_pool_storage(pool, NULL, NULL, &block_bytes, NULL), KVB_OK);
    KVT_EQ(block_bytes, 16384);
    KVT_EQ(block_bytes * pc.num_blocks, MiB);
    kvb_pool_destroy(pool);
    /* bad models */
    memset(&l, 0, sizeof l);
    KVT_EQ(kvs_model_preset((kvs_model)0, KVB_LAYOUT_BLOCK_CONTIGUOUS, &bt, &l), KVS_EINVAL);
    KVT_EQ(kvs_model_preset((kvs_model)99, KVB_LAYOUT_BLOCK_CONTIGUOUS, &bt, &l), KVS_EINVAL);
    KVT_EQ(kvs_model_preset((kvs_model)-1, KVB_LAYOUT_BLOCK_CONTIGUOUS, &bt, &l), KVS_EINVAL);
}

/* A refused preset leaves its outputs as they were (a failed call changes nothing): the block size was
 * written before the model was known. */
static void test_refused_preset_changes_nothing(void)
{
    uint32_t bt = 7;
    kvb_layout l;
    memset(&l, 0xab, sizeof l);
    kvb_layout before = l;
    KVT_EQ(kvs_model_preset((kvs_model)99, KVB_LAYOUT_BLOCK_CONTIGUOUS, &bt, &l), KVS_EINVAL);
    KVT_EQ(bt, 7);
    KVT_CHECK(memcmp(&l, &before, sizeof l) == 0);
    KVT_CHECK(kvs_model_preset(KVS_MODEL_TINY, (kvb_layout_kind)99, &bt, &l) != KVS_OK); /* a bad layout kind */
    KVT_EQ(bt, 7);
}

/* A layout whose block size does not fit 64 bits: not even one block fits any byte budget. The product
 * wrapped: to 0 (a division by zero) or to a small block size (many blocks). */
static void test_blocks_for_bytes_of_a_huge_block(void)
{
    kvb_layout l;
    memset(&l, 0, sizeof l);
    l.page_bytes = UINT64_C(1) << 32;
    l.num_layers = UINT32_C(1) << 31;
    l.num_parts = 2; /* 2^64 bytes a block: wrapped to 0 */
    KVT_EQ(kvs_blocks_for_bytes(&l, UINT64_MAX), 0);
    l.page_bytes = (UINT64_C(1) << 62) + 1;
    l.num_layers = 4;
    l.num_parts = 1; /* 2^64 + 4: wrapped to 4 */
    KVT_EQ(kvs_blocks_for_bytes(&l, 1024), 0);
    l.page_bytes = UINT64_C(1) << 20;
    l.num_layers = 4;
    l.num_parts = 2; /* 8 MiB: no overflow */
    KVT_EQ(kvs_blocks_for_bytes(&l, UINT64_C(1) << 30), 128);
}

static void test_result_strings(void)
{
    int codes[] = {KVS_OK, KVS_EINVAL, KVS_ESTATE, KVS_ENOTFOUND, KVS_ETOOBIG, KVS_ENOMEM, KVS_ESTEP};
    const char *unknown = kvs_result_string(-9999);
    KVT_CHECK(unknown != NULL);
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        const char *s = kvs_result_string(codes[i]);
        KVT_CHECK(s != NULL && s[0]);
        if (!s) continue;
        if (unknown) KVT_CHECK(strcmp(s, unknown) != 0);
        for (size_t k = 0; k < i; k++) KVT_CHECK(strcmp(s, kvs_result_string(codes[k])) != 0);
    }
    KVT_CHECK(strcmp(kvs_result_string(KVS_ESTATE), "slot transition not allowed") == 0);
    KVT_CHECK(strcmp(kvs_result_string(KVS_ETOOBIG), "request can never fit the device pool") == 0);
    /* kvb_ and kvo_ codes pass through */
    KVT_CHECK(strcmp(kvs_result_string(KVB_ENOSPACE), kvb_result_string(KVB_ENOSPACE)) == 0);
    KVT_CHECK(strcmp(kvs_result_string(KVB_ECORRUPT), kvb_result_string(KVB_ECORRUPT)) == 0);
    KVT_CHECK(strcmp(kvs_result_string(KVO_EFULL), kvo_result_string(KVO_EFULL)) == 0);
    KVT_CHECK(strcmp(kvs_result_string(KVO_ECHECKSUM), kvo_result_string(KVO_ECHECKSUM)) == 0);
}

/* A scheduler over a device pool of its own (no tiers, no bus). */
static void open_plain_sched(uint32_t num_blocks, uint32_t block_tokens, kvb_pool **dev, kvs_sched **s)
{
    kvb_pool_config pc;
    kvs_sched_config sc;
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = num_blocks;
    pc.block_tokens = block_tokens;
    KVT_EQ(kvb_pool_create(&pc, dev), KVB_OK);
    memset(&sc, 0, sizeof sc);
    sc.device = *dev;
    KVT_EQ(kvs_sched_create(&sc, s), KVS_OK);
}

/* One token a block: a prompt whose every token is cached (a running request's identical prompt) still
 * has its last token computed into a block of its own, never into the registered block the other
 * request holds. */
static void test_one_token_blocks_last_token_in_a_block_of_its_own(void)
{
    kvb_pool *dev;
    kvs_sched *s;
    kvs_step st;
    kvs_request rq;
    uint32_t prompt[8] = {11, 12, 13, 14, 15, 16, 17, 18};
    uint64_t a, b;
    open_plain_sched(32, 1, &dev, &s);
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = 8;
    KVT_EQ(kvs_sched_add(s, &rq, &a), KVS_OK);
    KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_OK); /* a's prompt registered, a still running */
    KVT_EQ(kvs_sched_add(s, &rq, &b), KVS_OK);
    KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
    int seen = 0;
    for (size_t i = 0; i < st.num_prefill; i++) {
        const kvs_sched_item *it = &st.prefill[i];
        if (it->request != b) continue;
        seen = 1;
        KVT_EQ(it->num_computed, 7); /* the rest came from the cache */
        KVT_EQ(it->num_new, 1);
        for (size_t t = it->num_computed; t < it->num_computed + it->num_new; t++) {
            kvb_block_info bi;
            KVT_EQ(kvb_block_get_info(dev, it->blocks[t].id, &bi), KVB_OK);
            KVT_CHECK(bi.state != KVB_STATE_REGISTERED);
            KVT_EQ(bi.refs, 1);
        }
    }
    KVT_EQ(seen, 1);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
    char why[256] = "";
    KVT_EQ(kvb_pool_check(dev, why, sizeof why), KVB_OK);
    kvs_sched_destroy(s);
    kvb_pool_destroy(dev);
}

/* Id 0 is never given out; a released request's struct keeps it, and the last step may still name that
 * struct (its decode item): an append to id 0 must answer "no such request" like the other calls, not
 * find the released struct. */
static void test_append_to_id_zero_after_a_release(void)
{
    kvb_pool *dev;
    kvs_sched *s;
    kvs_step st;
    kvs_request rq;
    uint32_t prompt[5] = {1, 2, 3, 4, 5}, tok = 9;
    uint64_t a;
    open_plain_sched(8, 4, &dev, &s);
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = 5;
    KVT_EQ(kvs_sched_add(s, &rq, &a), KVS_OK);
    KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_append(s, a, &tok, 1), KVS_OK);
    KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
    KVT_EQ(st.num_decode, 1);
    KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
    KVT_EQ(kvs_sched_finish(s, a), KVS_OK);
    KVT_EQ(kvs_sched_release(s, a), KVS_OK);
    KVT_EQ(kvs_sched_append(s, 0, &tok, 1), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_append(s, a, &tok, 1), KVS_ENOTFOUND);
    KVT_EQ(kvs_sched_finish(s, 0), KVS_ENOTFOUND);
    kvs_sched_destroy(s);
    kvb_pool_destroy(dev);
}

/* A prompt length so large that prompt + max_new_tokens wraps around size_t is too big (it holds more than
 * 2^32 - 1 tokens), not a small request: the check must not wrap, and the prompt is never read. */
static void test_add_huge_prompt_is_too_big(void)
{
    kvb_pool *dev;
    kvs_sched *s;
    kvs_request rq;
    uint32_t prompt[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint64_t id = 0;
    open_plain_sched(8, 4, &dev, &s);
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = SIZE_MAX - 10; /* + 20 wraps to 9 */
    rq.max_new_tokens = 20;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_ETOOBIG);
    rq.num_prompt = SIZE_MAX; /* + block_tokens - 1 wraps */
    rq.max_new_tokens = 0;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_ETOOBIG);
    rq.num_prompt = (size_t)UINT32_MAX;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_ETOOBIG);
    KVT_EQ(id, 0);
    KVT_EQ(kvs_sched_idle(s), 1);
    rq.num_prompt = 8;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_OK);
    KVT_EQ(id, 1); /* the refused adds took no id */
    kvs_sched_destroy(s);
    kvb_pool_destroy(dev);
}

int main(void)
{
    of_watchdog(120);
    KVT_RUN(test_walkthrough_host);
    KVT_RUN(test_append_to_id_zero_after_a_release);
    KVT_RUN(test_one_token_blocks_last_token_in_a_block_of_its_own);
    KVT_RUN(test_walkthrough_disk);
    KVT_RUN(test_device_prefix_hit);
    KVT_RUN(test_lazy_mode);
    KVT_RUN(test_budget_300_requests);
    KVT_RUN(test_budget_small_config);
    KVT_RUN(test_budget_many_short);
    KVT_RUN(test_chunked_long_prompt);
    KVT_RUN(test_priority_order);
    KVT_RUN(test_outgrow_recompute);
    KVT_RUN(test_outgrow_recompute_with_host);
    KVT_RUN(test_outgrow_swap_bytes);
    KVT_RUN(test_outgrow_swap_bytes_lazy);
    KVT_RUN(test_waiting_preempts_recompute);
    KVT_RUN(test_waiting_preempts_swap_bytes);
    KVT_RUN(test_no_preempt_equal_priority);
    KVT_RUN(test_no_futile_preempt_recompute);
    KVT_RUN(test_no_futile_preempt_swap);
    KVT_RUN(test_no_futile_preempt_shared_blocks);
    KVT_RUN(test_abort_initialized);
    KVT_RUN(test_abort_onboarding);
    KVT_RUN(test_abort_prefilling);
    KVT_RUN(test_abort_decoding);
    KVT_RUN(test_abort_preempted);
    KVT_RUN(test_abort_swapped);
    KVT_RUN(test_abort_mid_step);
    KVT_RUN(test_abort_mid_step_items_stay_valid);
    KVT_RUN(test_release_mid_step_items_stay_valid);
    KVT_RUN(test_add_mid_step_items_stay_valid);
    KVT_RUN(test_destroy_aborts_everything);
    KVT_RUN(test_pinned_loads_do_not_block_the_queue);
    KVT_RUN(test_swapped_request_own_loads_do_not_block_it);
    KVT_RUN(test_swapped_request_own_loads_count_as_room);
    KVT_RUN(test_append_beyond_step_budget);
    KVT_RUN(test_lower_hits_within_cached);
    KVT_RUN(test_onboard_skips_last_token_block);
    KVT_RUN(test_device_prefix_held_while_loading);
    KVT_RUN(test_abort_while_loading_lets_the_prefix_go);
    KVT_RUN(test_waiting_request_lets_its_prefix_go);
    KVT_RUN(test_own_held_prefix_counts_as_room);
    KVT_RUN(test_lower_hits_not_counted_again);
    KVT_RUN(test_bad_input);
    KVT_RUN(test_sizing);
    KVT_RUN(test_result_strings);
    KVT_RUN(test_add_huge_prompt_is_too_big);
    KVT_RUN(test_refused_preset_changes_nothing);
    KVT_RUN(test_blocks_for_bytes_of_a_huge_block);
    return kvt_summary();
}
