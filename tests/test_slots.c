/* Request slots of kvsched.h (manual section 2): the names of the states, every legal transition of the
 * table, a table-driven check over every (from, to) pair that kvs_slot_transition_allowed is exactly
 * that table, illegal transitions asked through the request API being refused with KVS_ESTATE and
 * changing nothing, and whole scheduler runs (onboarding from the host, swap and recompute
 * preemption, chunked prefill under small budgets with finishes and aborts at random times) in which
 * every request's state, read after every call, only ever moves along the table. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "kvtest.h"
#include "sched_fixtures.h"

static const struct {
    kvs_slot_state state;
    const char *name;
} names[] = {
    {KVS_SLOT_INITIALIZED, "Initialized"},       {KVS_SLOT_ONBOARD_STAGED, "OnboardStaged"},
    {KVS_SLOT_ONBOARDING, "Onboarding"},         {KVS_SLOT_PREFILLING, "Prefilling"},
    {KVS_SLOT_DECODING, "Decoding"},             {KVS_SLOT_SKIPPED_PREFILL, "SkippedPrefill"},
    {KVS_SLOT_SKIPPED_DECODE, "SkippedDecode"},  {KVS_SLOT_PREEMPTED, "Preempted"},
    {KVS_SLOT_FINISHING, "Finishing"},           {KVS_SLOT_FINISHED, "Finished"},
};

static void test_state_names(void)
{
    KVT_EQ(sizeof names / sizeof names[0], KVS_SLOT__COUNT - 1);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *got = kvs_slot_state_name(names[i].state);
        KVT_CHECK(got != NULL);
        if (!got) continue;
        if (strcmp(got, names[i].name) != 0) fprintf(stderr, "  state %d: \"%s\", expected \"%s\"\n", names[i].state, got, names[i].name);
        KVT_CHECK(strcmp(got, names[i].name) == 0);
    }
    /* out of range: some text, never one of the real names */
    int bad[] = {0, KVS_SLOT__COUNT, -1, 1000};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        const char *got = kvs_slot_state_name((kvs_slot_state)bad[k]);
        KVT_CHECK(got != NULL);
        if (!got) continue;
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) KVT_CHECK(strcmp(got, names[i].name) != 0);
    }
}

/* Every arrow of the manual's diagram, written out one by one. */
static const struct {
    kvs_slot_state from, to;
} legal[] = {
    /* Initialized -> OnboardStaged -> Onboarding -> Prefilling <-> Decoding -> Finishing -> Finished */
    {KVS_SLOT_INITIALIZED, KVS_SLOT_ONBOARD_STAGED},
    {KVS_SLOT_ONBOARD_STAGED, KVS_SLOT_ONBOARDING},
    {KVS_SLOT_ONBOARDING, KVS_SLOT_PREFILLING},
    {KVS_SLOT_PREFILLING, KVS_SLOT_DECODING},
    {KVS_SLOT_DECODING, KVS_SLOT_PREFILLING},
    {KVS_SLOT_DECODING, KVS_SLOT_FINISHING},
    {KVS_SLOT_FINISHING, KVS_SLOT_FINISHED},
    /* Initialized -> Prefilling (no lower-tier hit) */
    {KVS_SLOT_INITIALIZED, KVS_SLOT_PREFILLING},
    /* Prefilling -> SkippedPrefill -> Prefilling */
    {KVS_SLOT_PREFILLING, KVS_SLOT_SKIPPED_PREFILL},
    {KVS_SLOT_SKIPPED_PREFILL, KVS_SLOT_PREFILLING},
    /* Decoding -> SkippedDecode -> Decoding */
    {KVS_SLOT_DECODING, KVS_SLOT_SKIPPED_DECODE},
    {KVS_SLOT_SKIPPED_DECODE, KVS_SLOT_DECODING},
    /* Prefilling | Decoding | Skipped* -> Preempted -> Initialized | Onboarding */
    {KVS_SLOT_PREFILLING, KVS_SLOT_PREEMPTED},
    {KVS_SLOT_DECODING, KVS_SLOT_PREEMPTED},
    {KVS_SLOT_SKIPPED_PREFILL, KVS_SLOT_PREEMPTED},
    {KVS_SLOT_SKIPPED_DECODE, KVS_SLOT_PREEMPTED},
    {KVS_SLOT_PREEMPTED, KVS_SLOT_INITIALIZED},
    {KVS_SLOT_PREEMPTED, KVS_SLOT_ONBOARDING},
    /* any state but Finished -> Finishing (Decoding -> Finishing is listed above) */
    {KVS_SLOT_INITIALIZED, KVS_SLOT_FINISHING},
    {KVS_SLOT_ONBOARD_STAGED, KVS_SLOT_FINISHING},
    {KVS_SLOT_ONBOARDING, KVS_SLOT_FINISHING},
    {KVS_SLOT_PREFILLING, KVS_SLOT_FINISHING},
    {KVS_SLOT_SKIPPED_PREFILL, KVS_SLOT_FINISHING},
    {KVS_SLOT_SKIPPED_DECODE, KVS_SLOT_FINISHING},
    {KVS_SLOT_PREEMPTED, KVS_SLOT_FINISHING},
};

static void test_every_legal_transition(void)
{
    for (size_t i = 0; i < sizeof legal / sizeof legal[0]; i++) {
        int got = kvs_slot_transition_allowed(legal[i].from, legal[i].to);
        if (got != 1)
            fprintf(stderr, "  %s -> %s refused\n", kvs_slot_state_name(legal[i].from), kvs_slot_state_name(legal[i].to));
        KVT_EQ(got, 1);
        KVT_EQ(sf_legal(legal[i].from, legal[i].to), 1); /* the fixtures' table agrees with this list */
    }
}

/* Over every pair, out-of-range states included: allowed exactly on the table. */
static void test_transition_table_exact(void)
{
    size_t n_legal = 0, n_fixture = 0;
    for (int from = -1; from <= KVS_SLOT__COUNT; from++)
        for (int to = -1; to <= KVS_SLOT__COUNT; to++) {
            int want = 0, got;
            for (size_t i = 0; i < sizeof legal / sizeof legal[0]; i++)
                if ((int)legal[i].from == from && (int)legal[i].to == to) want = 1;
            n_legal += (size_t)want;
            if (sf_ambiguous(from, to)) continue;
            n_fixture += (size_t)sf_legal(from, to);
            KVT_EQ(sf_legal(from, to), want);
            got = kvs_slot_transition_allowed((kvs_slot_state)from, (kvs_slot_state)to);
            if (got != want)
                fprintf(stderr, "  %d -> %d (%s -> %s): allowed says %d, the table %d\n", from, to,
                        sf_state_valid(from) ? kvs_slot_state_name((kvs_slot_state)from) : "?",
                        sf_state_valid(to) ? kvs_slot_state_name((kvs_slot_state)to) : "?", got, want);
            KVT_EQ(got, want);
        }
    KVT_EQ(n_legal, 25);
    KVT_EQ(n_fixture, 25);
    /* nothing leaves Finished, and no state goes to itself (except the open Finishing case) */
    for (int s = KVS_SLOT_INITIALIZED; s < KVS_SLOT__COUNT; s++) {
        KVT_EQ(kvs_slot_transition_allowed(KVS_SLOT_FINISHED, (kvs_slot_state)s), 0);
        if (s != KVS_SLOT_FINISHING) KVT_EQ(kvs_slot_transition_allowed((kvs_slot_state)s, (kvs_slot_state)s), 0);
    }
}

/* Illegal transitions asked for through the API are KVS_ESTATE and change nothing. */
static void test_illegal_requests_refused(void)
{
    sf_env e;
    sf_opts o;
    uint32_t prompt[40];
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 32;
    sf_open(&e, &o);
    sf_tokens(1, prompt, 40);
    uint64_t a = sf_add(&e, prompt, 40, 2, 0);

    /* Initialized: nothing to append to (a sampled token belongs to a decoding request) */
    kvs_slot_info before = sf_slot(&e, a), after;
    uint32_t tok = 5;
    KVT_EQ(kvs_sched_append(e.s, a, &tok, 1), KVS_ESTATE);
    after = sf_slot(&e, a);
    KVT_EQ(after.state, KVS_SLOT_INITIALIZED);
    KVT_EQ(after.num_tokens, before.num_tokens);
    KVT_EQ(after.generated, 0);
    /* release is for Finished requests only */
    KVT_CHECK(kvs_sched_release(e.s, a) != KVS_OK);
    KVT_EQ(sf_state(&e, a), KVS_SLOT_INITIALIZED);

    /* Prefilling (the step is in progress): still no append */
    sf_plan(&e, &st);
    KVT_EQ(sf_state(&e, a), KVS_SLOT_PREFILLING);
    KVT_EQ(kvs_sched_append(e.s, a, &tok, 1), KVS_ESTATE);
    KVT_EQ(sf_slot(&e, a).num_tokens, 40);
    sf_model(&e, &st);
    sf_commit(&e, &st); /* now Decoding, one token appended */
    KVT_EQ(sf_state(&e, a), KVS_SLOT_DECODING);
    KVT_EQ(sf_slot(&e, a).num_tokens, 41);
    KVT_CHECK(kvs_sched_release(e.s, a) != KVS_OK);

    sf_run(&e, 20); /* max_new_tokens 2: Finished */
    before = sf_slot(&e, a);
    KVT_EQ(before.state, KVS_SLOT_FINISHED);
    KVT_EQ(before.generated, 2);
    /* Finished -> Finishing is not in the table: finish, abort and append are refused */
    KVT_EQ(kvs_sched_finish(e.s, a), KVS_ESTATE);
    KVT_EQ(kvs_sched_abort(e.s, a), KVS_ESTATE);
    KVT_EQ(kvs_sched_append(e.s, a, &tok, 1), KVS_ESTATE);
    after = sf_slot(&e, a);
    KVT_EQ(after.state, KVS_SLOT_FINISHED);
    KVT_EQ(after.num_tokens, before.num_tokens);
    KVT_EQ(after.generated, before.generated);
    kvs_sched_stats stats = sf_stats(&e);
    KVT_EQ(stats.aborted, 0);
    KVT_EQ(stats.finished, 1);
    KVT_EQ(sf_release(&e, a), KVS_OK);
    KVT_EQ(kvs_sched_release(e.s, a), KVS_ENOTFOUND);
    sf_close(&e);
}

/* A request that finds its first blocks in the host goes Initialized -> (OnboardStaged ->) Onboarding
 * -> Prefilling -> Decoding -> Finished; the one before it never onboards. */
static void test_run_onboarding(void)
{
    sf_env e;
    sf_opts o;
    uint32_t b[96];
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = 32;
    sf_open(&e, &o);
    sf_tokens(2, b, 96);
    uint64_t a = sf_add(&e, b, 64, 2, 0);
    sf_run(&e, 50);
    KVT_EQ(sf_settle(&e), 0);
    KVT_EQ(sf_state(&e, a), KVS_SLOT_FINISHED);
    KVT_EQ(sf_release(&e, a), KVS_OK);
    KVT_EQ(kvb_pool_reset(e.dev), KVB_OK);

    uint64_t q = sf_add(&e, b, 96, 2, 0);
    sf_run(&e, 200);
    KVT_EQ(sf_settle(&e), 0);
    sf_track *ta = sf_tracked(&e, a), *tq = sf_tracked(&e, q);
    KVT_CHECK(ta && tq);
    if (ta && tq) {
        KVT_CHECK(ta->seen & SF_BIT(KVS_SLOT_PREFILLING));
        KVT_CHECK(ta->seen & SF_BIT(KVS_SLOT_DECODING));
        KVT_CHECK(!(ta->seen & (SF_BIT(KVS_SLOT_ONBOARD_STAGED) | SF_BIT(KVS_SLOT_ONBOARDING))));
        KVT_CHECK(sf_seen_before(&e, q, KVS_SLOT_ONBOARDING, KVS_SLOT_PREFILLING) ||
                  sf_seen_before(&e, q, KVS_SLOT_ONBOARD_STAGED, KVS_SLOT_PREFILLING));
        KVT_CHECK(sf_seen_before(&e, q, KVS_SLOT_PREFILLING, KVS_SLOT_DECODING));
        KVT_EQ(tq->last, KVS_SLOT_FINISHED);
    }
    KVT_EQ(sf_release(&e, q), KVS_OK);
    sf_close(&e);
}

/* Four running requests outgrow a full device (sf_fill_device): the victim (lowest priority, latest
 * arrival) is Preempted, later comes back and finishes; every slot moves along the table. */
static void run_preemption(kvs_preempt_mode mode)
{
    sf_env e;
    sf_opts o;
    uint32_t p[4][64];
    uint64_t low[4];
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.device_memory = 1;
    o.host_blocks = mode == KVS_PREEMPT_SWAP ? 64 : 0; /* recompute: no tiers, nothing to swap in */
    o.preempt = mode;
    sf_open(&e, &o);
    sf_fill_device(&e, 100, p, low);
    sf_run(&e, 200);
    KVT_EQ(sf_settle(&e), 0);
    sf_track *victim = sf_tracked(&e, low[2]);
    KVT_CHECK(victim != NULL);
    if (victim) {
        /* seen Preempted, or what may follow it within the same step: back to Initialized (recompute)
         * or swapping in (Onboarding) */
        int after = 0;
        for (int i = 1; i < victim->nhist; i++)
            after |= victim->hist[i] == KVS_SLOT_INITIALIZED || victim->hist[i] == KVS_SLOT_ONBOARDING;
        KVT_CHECK((victim->seen & SF_BIT(KVS_SLOT_PREEMPTED)) || after);
        KVT_EQ(victim->last, KVS_SLOT_FINISHED);
        KVT_EQ(sf_slot(&e, low[2]).preemptions, 1);
        /* after the preemption it prefilled again, then decoded */
        int pre = 0, again = 0, decoded = 0;
        for (int i = 1; i < victim->nhist; i++) {
            int h = victim->hist[i];
            if (h == KVS_SLOT_PREEMPTED || h == KVS_SLOT_INITIALIZED || h == KVS_SLOT_ONBOARD_STAGED || h == KVS_SLOT_ONBOARDING) pre = 1;
            if (pre && victim->hist[i] == KVS_SLOT_PREFILLING) again = 1;
            if (again && victim->hist[i] == KVS_SLOT_DECODING) decoded = 1;
        }
        KVT_CHECK(again);
        KVT_CHECK(decoded);
    }
    if (mode == KVS_PREEMPT_RECOMPUTE) /* no lower tier to onboard from: it waits as Preempted or Initialized */
        KVT_CHECK(e.seen & (SF_BIT(KVS_SLOT_PREEMPTED)));
    for (int i = 0; i < 4; i++) {
        KVT_EQ(sf_state(&e, low[i]), KVS_SLOT_FINISHED);
        if (i != 2) KVT_EQ(sf_slot(&e, low[i]).preemptions, 0);
        KVT_EQ(sf_release(&e, low[i]), KVS_OK);
    }
    sf_close(&e);
}

static void test_run_swap_preemption(void) { run_preemption(KVS_PREEMPT_SWAP); }
static void test_run_recompute_preemption(void) { run_preemption(KVS_PREEMPT_RECOMPUTE); }

/* Small budgets (48 tokens, 3 sequences), a device that runs out, swap preemption, and at random steps:
 * new requests of random priority, finishes and aborts (also of requests still waiting, onboarding or
 * swapped out). Every observation follows the table; everything ends Finished. */
static void test_run_mixed(void)
{
    sf_env e;
    sf_opts o;
    uint64_t rng = 12345, ids[60];
    uint32_t prompts[60][160];
    size_t lens[60];
    size_t added = 0;
    kvs_step st;
    memset(&o, 0, sizeof o);
    o.device_blocks = 24;
    o.device_memory = 1;
    o.host_blocks = 64;
    o.preempt = KVS_PREEMPT_SWAP;
    o.max_tokens = 48;
    o.max_seqs = 3;
    sf_open(&e, &o);
    for (size_t i = 0; i < 60; i++) {
        /* every third prompt shares its first 48 tokens with prompt 0 */
        sf_tokens(500 + i, prompts[i], 160);
        if (i % 3 == 2) memcpy(prompts[i], prompts[0], 48 * sizeof prompts[0][0]);
        lens[i] = 1 + (size_t)(sf_rand(&rng) % 150);
        if (i % 3 == 2 && lens[i] < 64) lens[i] = 64;
    }
    for (int stepno = 0; stepno < 3000 && (added < 60 || !kvs_sched_idle(e.s)); stepno++) {
        if (added < 60 && sf_rand(&rng) % 3 == 0) {
            ids[added] = sf_add(&e, prompts[added], lens[added], (uint32_t)(1 + sf_rand(&rng) % 6),
                                (int32_t)(sf_rand(&rng) % 3));
            added++;
        }
        if (added && sf_rand(&rng) % 17 == 0) { /* abort or finish someone, whatever its state */
            uint64_t id = ids[sf_rand(&rng) % added];
            int s = sf_state(&e, id);
            kvs_result r = sf_rand(&rng) & 1 ? sf_abort(&e, id) : sf_finish(&e, id);
            if (s == KVS_SLOT_FINISHED) KVT_EQ(r, KVS_ESTATE);
            else if (s != KVS_SLOT_FINISHING) KVT_EQ(r, KVS_OK);
        }
        if (stepno % 25 == 24) kvb_pool_reset(e.dev); /* refused (KVB_EBUSY) while anything runs */
        sf_turn(&e, &st);
    }
    KVT_EQ(added, 60);
    KVT_CHECK(kvs_sched_idle(e.s));
    KVT_EQ(sf_settle(&e), 0);
    for (size_t i = 0; i < added; i++) {
        KVT_EQ(sf_state(&e, ids[i]), KVS_SLOT_FINISHED);
        KVT_EQ(sf_release(&e, ids[i]), KVS_OK);
    }
    KVT_CHECK(e.seen & SF_BIT(KVS_SLOT_PREFILLING));
    KVT_CHECK(e.seen & SF_BIT(KVS_SLOT_DECODING));
    KVT_CHECK(e.seen & SF_BIT(KVS_SLOT_FINISHED));
    KVT_CHECK(e.max_step_tokens <= 48);
    KVT_CHECK(e.max_step_seqs <= 3);
    fprintf(stderr, "  (mixed run: %" PRIu64 " steps, states seen 0x%x, %zu observations spanning several transitions)\n",
            e.steps, e.seen, e.compound);
    sf_close(&e);
}

int main(void)
{
    of_watchdog(60);
    KVT_RUN(test_state_names);
    KVT_RUN(test_every_legal_transition);
    KVT_RUN(test_transition_table_exact);
    KVT_RUN(test_illegal_requests_refused);
    KVT_RUN(test_run_onboarding);
    KVT_RUN(test_run_swap_preemption);
    KVT_RUN(test_run_recompute_preemption);
    KVT_RUN(test_run_mixed);
    return kvt_summary();
}
