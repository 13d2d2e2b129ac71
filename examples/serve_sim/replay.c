/* replay.c — serve_sim --sequential: the pure cache replay, one request at a time, and the reference
 * LRU of --check-lru */
#include "sim.h"

#include <stdlib.h>
#include <string.h>

/* ---- --sequential: the pure replay -------------------------------------------------------------- */

/* Lower-tier hits after the device prefix blocks [0, k): onboarded into the device, references in blk.
 * With --remote the lookup also asks Redis (kvo_redis_manager_lookup: local tiers first, then what other
 * runs or processes stored there). Returns the new end of the cached prefix. */
static size_t onboard_rest(tiers *t, const sim_req *r, size_t k, size_t n, kvb_block *blk, uint8_t *tier_of,
                           uint64_t *hits)
{
    size_t found = 0, i = 0;
    kvo_result lr = t->redis ? kvo_redis_manager_lookup(t->mgr, t->redis, r->hashes + k, n - k, tier_of, &found)
                             : kvo_manager_lookup(t->mgr, r->hashes + k, n - k, tier_of, &found);
    if (lr != KVO_OK) return k;
    while (i < found) {
        size_t j = i, got = 0, run;
        uint8_t tier = tier_of[i];
        while (j < found && tier_of[j] == tier) j++;
        run = j - i; /* blocks [i, j) are held by one tier */
        if (tier == 0) {
            kvb_match(t->pool[0], r->hashes + k + i, j - i, blk + k + i, &got);
        } else {
            kvo_pipeline *up = kvo_manager_pipeline(t->mgr, tier, 1);
            kvo_transfer x;
            kvo_status st = KVO_STATUS_FAILED;
            if (kvo_manager_onboard(t->mgr, tier, r->hashes + k + i, j - i, &x) != KVO_OK) break;
            kvo_transfer_wait(up, x, -1, &st);
            if (st == KVO_STATUS_COMPLETE) kvo_transfer_take_blocks(up, x, blk + k + i, j - i, &got);
            kvo_transfer_release(up, x);
        }
        hits[t->kind[tier]] += got;
        i += got;
        if (got < run) break; /* the prefix ends where a load came up short */
    }
    return k + i;
}

void replay(const workload *w, const options *o, results *res, series *sv)
{
    tiers t;
    size_t q, maxb = 1, every = w->n / 600 + 1;
    kvb_block *blk;
    uint8_t *tier_of;
    double t0;
    kvb_release_opts rel = {0, 0};
    open_tiers(&t, o, 0, 1, o->bytes, NULL, 1, NULL, NULL, NULL, NULL, NULL);
    for (q = 0; q < w->n; q++)
        if (w->reqs[q].num_blocks > maxb) maxb = w->reqs[q].num_blocks;
    if (maxb > o->device_blocks) maxb = o->device_blocks;
    blk = (kvb_block *)xcalloc(maxb, sizeof *blk);
    tier_of = (uint8_t *)xcalloc(maxb, 1);
    if (sv) {
        float occ[TIER_ALL];
        tiers_occupancy(&t, occ);
        series_add(sv, 0, res->tier_hits, 0, occ, tiers_fol_step(&t));
    }
    t0 = wall_now();
    for (q = 0; q < w->n; q++) {
        const sim_req *r = &w->reqs[w->order[q]];
        size_t n = r->num_blocks < o->device_blocks ? r->num_blocks : o->device_blocks, m = 0, k, i;
        res->prompt_blocks += r->num_blocks; /* blocks past the device size count as misses */
        if (!n) continue;
        if (!t.mgr && !o->bytes) { /* the device alone: the prompt in one call, as an engine without tiers */
            check_kv(kvb_request_begin(t.pool[0], r->hashes, n, blk, &m), "kvb_request_begin");
            res->tier_hits[TIER_DEVICE] += m;
            rel.last_block_tokens = n == r->num_blocks ? r->last_tokens : 0;
            check_kv(kvb_release(t.pool[0], blk, n, &rel), "kvb_release");
            if (sv && (q % every == 0 || q + 1 == w->n)) {
                float occ[TIER_ALL];
                tiers_occupancy(&t, occ);
                series_add(sv, (double)(q + 1), res->tier_hits, res->prompt_blocks, occ, tiers_fol_step(&t));
            }
            continue;
        }
        kvb_match(t.pool[0], r->hashes, n, blk, &m);
        res->tier_hits[TIER_DEVICE] += m;
        k = m;
        if (t.mgr && k < n) k = onboard_rest(&t, r, k, n, blk, tier_of, res->tier_hits);
        if (o->bytes)
            for (i = 0; i < k; i++) {
                res->verified++;
                res->mismatches += !pattern_ok(&t, blk[i], &r->hashes[i]);
            }
        if (k < n) {
            check_kv(kvb_alloc(t.pool[0], n - k, blk + k), "kvb_alloc");
            check_kv(kvb_register_hashed(t.pool[0], blk + k, n - k, r->hashes + k, r->hashes + k - 1, blk + k),
                     "kvb_register_hashed");
            if (o->bytes)
                for (i = k; i < n; i++) pattern_write(&t, blk[i], &r->hashes[i]);
            if (t.mgr) kvo_manager_offer(t.mgr, 0, blk + k, n - k, NULL);
        }
        rel.last_block_tokens = n == r->num_blocks ? r->last_tokens : 0; /* a prompt cut to the pool ends whole */
        check_kv(kvb_release(t.pool[0], blk, n, &rel), "kvb_release");
        if (t.mgr) kvo_manager_poll(t.mgr);
        if (sv && (q % every == 0 || q + 1 == w->n)) {
            float occ[TIER_ALL];
            tiers_occupancy(&t, occ);
            series_add(sv, (double)(q + 1), res->tier_hits, res->prompt_blocks, occ, tiers_fol_step(&t));
        }
    }
    res->replay_seconds = wall_now() - t0;
    if (t.mgr) kvo_manager_drain(t.mgr, 10 * 1000000);
    res->requests = w->n;
    res->hit_blocks = res->tier_hits[0] + res->tier_hits[1] + res->tier_hits[2] + res->tier_hits[TIER_REMOTE];
    collect_traffic(&t, o, o->bytes, &res->tr);
    snprintf(res->disk_note, sizeof res->disk_note, "%s", t.disk_note);
    close_tiers(&t);
    free(blk);
    free(tier_of);
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_of(double *v, size_t n)
{
    qsort(v, n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* A replay loop of a few tens of milliseconds is at the mercy of a shared machine: one run of it, or of
 * the reference, can take twice as long as the next. With the device pool alone (nothing outside the
 * process) and nothing else in the loop (no --bytes patterns, no --svg samples: every run the same
 * work), the loop runs --timing-runs times in all, each on a fresh pool (the same hits, checked),
 * alternating with the reference's runs under --check-lru, and replay_seconds and lru_seconds become the
 * medians: the ratio of two medians of alternating runs, as kvbench measures. */
void replay_timing_rounds(const workload *w, const options *o, results *res)
{
    double replay_s[100], lru_s[100];
    uint32_t i, n = o->timing_runs;
    if (n <= 1 || n > 100 || o->host_blocks || o->disk_blocks || o->remote || o->bytes || o->svg) return;
    replay_s[0] = res->replay_seconds;
    lru_s[0] = res->lru_seconds;
    for (i = 1; i < n; i++) {
        results again;
        memset(&again, 0, sizeof again);
        replay(w, o, &again, NULL);
        if (again.hit_blocks != res->hit_blocks) die(2, "replay: run %u hit %llu blocks, the first %llu", i + 1,
                                                     (unsigned long long)again.hit_blocks,
                                                     (unsigned long long)res->hit_blocks);
        replay_s[i] = again.replay_seconds;
        if (res->lru_checked) reference_lru(w, o->device_blocks, &lru_s[i]);
    }
    res->replay_seconds = median_of(replay_s, n);
    if (res->lru_checked) res->lru_seconds = median_of(lru_s, n);
    res->timing_runs = n;
}

/* The reference: a plain LRU prefix cache of `cap` blocks, keyed by block identity (the trace's hash
 * ids), written independently of kvblock.h. Per request: the prefix of cached blocks hits; the misses
 * are inserted (evicting the least recent); then the request's blocks become most recent, deepest
 * first — the order in which kvb_release gives them back, so block 0 ends most recent. */
typedef struct lru_ref {
    u64map map;             /* key -> node */
    uint64_t *key;
    uint32_t *prev, *next;  /* node cap is the list head: next = least recent, prev = most recent */
    uint32_t cap, n;
} lru_ref;

static void lru_unlink(lru_ref *c, uint32_t x)
{
    c->next[c->prev[x]] = c->next[x];
    c->prev[c->next[x]] = c->prev[x];
}
static void lru_push_mru(lru_ref *c, uint32_t x)
{
    uint32_t h = c->cap;
    c->prev[x] = c->prev[h];
    c->next[x] = h;
    c->next[c->prev[h]] = x;
    c->prev[h] = x;
}

double reference_lru(const workload *w, uint32_t cap, double *out_seconds)
{
    lru_ref c;
    uint64_t hits = 0, total = 0;
    size_t q;
    double t0;
    memset(&c, 0, sizeof c);
    c.cap = cap;
    map_init(&c.map, cap);
    c.key = (uint64_t *)xcalloc(cap, sizeof *c.key);
    c.prev = (uint32_t *)xcalloc((size_t)cap + 1, sizeof *c.prev);
    c.next = (uint32_t *)xcalloc((size_t)cap + 1, sizeof *c.next);
    c.prev[cap] = c.next[cap] = cap;
    /* touched before the clock starts, as the pool's memory is when it is created: the loop is timed */
    memset(c.map.key, 0, (c.map.mask + 1) * sizeof *c.map.key);
    memset(c.key, 0, cap * sizeof *c.key);
    memset(c.prev, 0, cap * sizeof *c.prev);
    memset(c.next, 0, cap * sizeof *c.next);
    t0 = wall_now();
    for (q = 0; q < w->n; q++) {
        const sim_req *r = &w->reqs[w->order[q]];
        size_t n = r->num_blocks < cap ? r->num_blocks : cap, m = 0, i;
        total += r->num_blocks;
        while (m < n && map_get(&c.map, r->keys[m]) != UINT32_MAX) m++;
        hits += m;
        for (i = 0; i < m; i++) { /* in use by the request: not evictable while its misses come in */
            uint32_t x = map_get(&c.map, r->keys[i]);
            lru_unlink(&c, x);
            lru_push_mru(&c, x);
        }
        for (i = m; i < n; i++) {
            uint32_t x = map_get(&c.map, r->keys[i]);
            if (x == UINT32_MAX) {
                if (c.n < cap) {
                    x = c.n++;
                } else { /* evict the least recent */
                    x = c.next[cap];
                    lru_unlink(&c, x);
                    map_del(&c.map, c.key[x]);
                }
                c.key[x] = r->keys[i];
                map_put(&c.map, r->keys[i], x);
            } else {
                lru_unlink(&c, x);
            }
            lru_push_mru(&c, x);
        }
        for (i = n; i-- > 0;) { /* released deepest first */
            uint32_t x = map_get(&c.map, r->keys[i]);
            lru_unlink(&c, x);
            lru_push_mru(&c, x);
        }
    }
    *out_seconds = wall_now() - t0;
    map_free(&c.map);
    free(c.key);
    free(c.prev);
    free(c.next);
    return total ? (double)hits / (double)total : 0.0;
}
