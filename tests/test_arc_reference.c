/* kvblock.h's ARC against a textbook ARC (issue 14's bar: `--eviction arc` at or above an independent
 * ARC less 0.01, the room the leaves-first rule may take). The reference here follows Megiddo and Modha,
 * "ARC: A Self-Tuning, Low Overhead Replacement Cache" (FAST 2003), over block identities, with nothing
 * of kvblock.h: lists T1, T2 (cached) and B1, B2 (ghosts) of at most 2 C entries, the target p, and
 * REPLACE. Both replay every shape of examples/workloads.h as serve_sim --sequential does: per request,
 * the longest cached prefix hits, then every block of the request is referenced in order.
 *   - In every cell (shape x pool of 1,000 to 30,000 blocks, 512-token blocks, with and without each
 *     prompt's partial last block, WL_PARTIAL_TAIL, as a trace names it), kvblock.h's ARC is at or
 *     above the reference less 0.01, but one: busy API sessions (apisessions) at 3,000 blocks without
 *     partial tails, an open gap (README, Eviction), held to 0.02 until it is closed.
 *   - The reference is itself checked on a sequence whose outcome ARC's rules fix (test_reference_rules).
 * ARC's own rules (ghost hits move its target, leaves first) are tested in test_arc_s3fifo.
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"
#define WORKLOADS_IMPLEMENTATION
#include "../examples/workloads.h"
#include "kvtest.h"

#define REQUESTS 12000 /* as the README's table and issue 14's replays */
#define ALLOWED 0.01   /* issue 14: the room the leaves-first rule may take */
/* The cells where kvblock.h's ARC is known to be further below (README, Eviction): held to this much. */
static const struct { wl_shape shape; uint32_t cap; unsigned flags; double allowed; } known_gaps[] = {
    {WL_APISESSIONS, 3000, 0, 0.02}};

static double allowed_gap(wl_shape s, uint32_t cap, unsigned flags)
{
    for (size_t i = 0; i < sizeof known_gaps / sizeof known_gaps[0]; i++)
        if (known_gaps[i].shape == s && known_gaps[i].cap == cap && known_gaps[i].flags == flags)
            return known_gaps[i].allowed;
    return ALLOWED;
}
static const uint32_t caps[] = {1000, 3000, 10000, 30000};
#define NCAPS (sizeof caps / sizeof caps[0])

/* ---- the reference ---------------------------------------------------------------------------- */

enum { T1, T2, B1, B2, NLISTS };
typedef struct ref_node { uint64_t id; int list; uint32_t prev, next; } ref_node;
#define REF_NIL UINT32_MAX
typedef struct ref_arc {
    ref_node *node;               /* 2 C + 1 nodes: at most 2 C entries in the four lists */
    uint32_t *free, nfree;
    uint32_t head[NLISTS], tail[NLISTS], len[NLISTS]; /* LRU at head, MRU at tail */
    uint32_t *slot;               /* open addressing on the id: node + 1, 0 = empty */
    uint64_t mask;
    uint32_t c;
    double p;                     /* target size of T1 */
} ref_arc;

static uint64_t ref_home(const ref_arc *a, uint64_t id) { return (id * UINT64_C(0x9e3779b97f4a7c15)) >> 17 & a->mask; }

static uint64_t ref_slot(const ref_arc *a, uint64_t id)
{
    uint64_t s = ref_home(a, id);
    while (a->slot[s] && a->node[a->slot[s] - 1].id != id) s = (s + 1) & a->mask;
    return s;
}

static uint32_t ref_find(const ref_arc *a, uint64_t id)
{
    uint64_t s = ref_slot(a, id);
    return a->slot[s] ? a->slot[s] - 1 : REF_NIL;
}

/* Backward-shift deletion: later entries of the run move back unless their home lies after the gap. */
static void ref_unmap(ref_arc *a, uint64_t id)
{
    uint64_t i = ref_slot(a, id), j = i, k;
    for (;;) {
        j = (j + 1) & a->mask;
        if (!a->slot[j]) break;
        k = ref_home(a, a->node[a->slot[j] - 1].id);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        a->slot[i] = a->slot[j];
        i = j;
    }
    a->slot[i] = 0;
}

static void ref_unlink(ref_arc *a, uint32_t x)
{
    ref_node *n = &a->node[x];
    if (n->prev != REF_NIL) a->node[n->prev].next = n->next;
    else a->head[n->list] = n->next;
    if (n->next != REF_NIL) a->node[n->next].prev = n->prev;
    else a->tail[n->list] = n->prev;
    a->len[n->list]--;
}

static void ref_push_mru(ref_arc *a, uint32_t x, int list)
{
    ref_node *n = &a->node[x];
    n->list = list;
    n->next = REF_NIL;
    n->prev = a->tail[list];
    if (n->prev != REF_NIL) a->node[n->prev].next = x;
    else a->head[list] = x;
    a->tail[list] = x;
    a->len[list]++;
}

static void ref_move(ref_arc *a, uint32_t x, int list)
{
    ref_unlink(a, x);
    ref_push_mru(a, x, list);
}

/* The LRU entry of a ghost list is forgotten. */
static void ref_forget_lru(ref_arc *a, int list)
{
    uint32_t x = a->head[list];
    ref_unlink(a, x);
    ref_unmap(a, a->node[x].id);
    a->free[a->nfree++] = x;
}

/* REPLACE(x, p): T1's LRU page to B1 when T1 exceeds its target (or meets it and x was in B2), else
 * T2's LRU page to B2. */
static void ref_replace(ref_arc *a, int in_b2)
{
    if (a->len[T1] && ((double)a->len[T1] > a->p || (in_b2 && (double)a->len[T1] == a->p)))
        ref_move(a, a->head[T1], B1);
    else if (a->len[T2])
        ref_move(a, a->head[T2], B2);
    else
        ref_move(a, a->head[T1], B1);
}

static void ref_reference(ref_arc *a, uint64_t id)
{
    uint32_t x = ref_find(a, id), total;
    double c = (double)a->c;
    if (x != REF_NIL && a->node[x].list <= T2) { /* case I: a hit */
        ref_move(a, x, T2);
        return;
    }
    if (x != REF_NIL && a->node[x].list == B1) { /* case II: T1 was too small */
        a->p += a->len[B1] >= a->len[B2] ? 1.0 : (double)a->len[B2] / a->len[B1];
        if (a->p > c) a->p = c;
        ref_replace(a, 0);
        ref_move(a, x, T2);
        return;
    }
    if (x != REF_NIL) { /* case III: in B2, T2 was too small */
        a->p -= a->len[B2] >= a->len[B1] ? 1.0 : (double)a->len[B1] / a->len[B2];
        if (a->p < 0) a->p = 0;
        ref_replace(a, 1);
        ref_move(a, x, T2);
        return;
    }
    total = a->len[T1] + a->len[T2] + a->len[B1] + a->len[B2]; /* case IV: new */
    if (a->len[T1] + a->len[B1] == a->c) {
        if (a->len[T1] < a->c) {
            ref_forget_lru(a, B1);
            ref_replace(a, 0);
        } else {
            ref_forget_lru(a, T1);
        }
    } else if (total >= a->c) {
        if (total == 2 * a->c) ref_forget_lru(a, B2);
        ref_replace(a, 0);
    }
    x = a->free[--a->nfree];
    a->node[x].id = id;
    a->slot[ref_slot(a, id)] = x + 1;
    ref_push_mru(a, x, T1);
}

static int ref_cached(const ref_arc *a, uint64_t id)
{
    uint32_t x = ref_find(a, id);
    return x != REF_NIL && a->node[x].list <= T2;
}

static int ref_init(ref_arc *a, uint32_t c)
{
    uint64_t slots = 1;
    memset(a, 0, sizeof *a);
    while (slots < 4 * (uint64_t)c + 4) slots <<= 1; /* at most 2 C entries: load <= 1/2 */
    a->node = (ref_node *)calloc(2 * (size_t)c + 1, sizeof *a->node);
    a->free = (uint32_t *)malloc((2 * (size_t)c + 1) * sizeof *a->free);
    a->slot = (uint32_t *)calloc(slots, sizeof *a->slot);
    if (!a->node || !a->free || !a->slot) return -1;
    a->mask = slots - 1;
    a->c = c;
    for (uint32_t i = 0; i < 2 * c + 1; i++) a->free[a->nfree++] = 2 * c - i;
    for (int l = 0; l < NLISTS; l++) a->head[l] = a->tail[l] = REF_NIL;
    return 0;
}

static void ref_free(ref_arc *a)
{
    free(a->node);
    free(a->free);
    free(a->slot);
}

/* The block hit rate of a workload through the reference, replayed as wl_replay does. */
static double ref_replay(const wl_trace *w, uint32_t c)
{
    ref_arc a;
    uint64_t hits = 0;
    if (ref_init(&a, c)) return -1.0;
    for (size_t q = 0; q < w->n; q++) {
        const wl_req *r = &w->req[q];
        size_t n = r->num_blocks < c ? r->num_blocks : c, m = 0, i;
        while (m < n && ref_cached(&a, r->blocks[m])) m++;
        hits += m;
        for (i = 0; i < n; i++) ref_reference(&a, r->blocks[i]);
    }
    ref_free(&a);
    return w->total_blocks ? (double)hits / (double)w->total_blocks : 0.0;
}

/* ---- the tests -------------------------------------------------------------------------------- */

/* ARC's rules fix this outcome (C = 2): after a, b, a the cache holds T1 = {b}, T2 = {a}; c comes in
 * (the cache is full and T1 is above p = 0: REPLACE takes T1's b to B1); b again is a B1 hit: p rises
 * to 1, T1 (one page) is no longer above it, so REPLACE takes T2's a to B2, and b joins T2. */
static void test_reference_rules(void)
{
    ref_arc a;
    KVT_EQ(ref_init(&a, 2), 0);
    ref_reference(&a, 1);
    ref_reference(&a, 2);
    ref_reference(&a, 1);
    KVT_EQ(a.len[T1], 1);
    KVT_EQ(a.len[T2], 1);
    KVT_CHECK(ref_cached(&a, 1) && ref_cached(&a, 2));
    ref_reference(&a, 3);
    KVT_CHECK(ref_cached(&a, 3) && ref_cached(&a, 1) && !ref_cached(&a, 2));
    KVT_EQ(a.len[B1], 1);
    ref_reference(&a, 2); /* a ghost hit in B1: p grows to 1 */
    KVT_CHECK(a.p == 1.0);
    KVT_CHECK(ref_cached(&a, 2) && ref_cached(&a, 3) && !ref_cached(&a, 1));
    KVT_EQ(a.len[B2], 1);
    KVT_EQ(a.node[ref_find(&a, 2)].list, T2);
    ref_free(&a);
}

static void arc_against_reference(unsigned flags)
{
    double sum = 0, worst = 1;
    int cells = 0;
    printf("| workload%s | pool blocks | LRU | ARC (kvblock.h) | ARC (reference) | difference |\n|---|---|---|---|---|---|\n",
           flags & WL_PARTIAL_TAIL ? " (partial tails)" : "");
    for (int s = 0; s < WL__COUNT; s++) {
        wl_trace w;
        KVT_EQ(wl_generate((wl_shape)s, 512, REQUESTS, 1.0, 1, flags, &w), 0);
        for (size_t c = 0; c < NCAPS; c++) {
            kvb_pool_config cfg;
            double lru, ours, ref;
            memset(&cfg, 0, sizeof cfg);
            cfg.num_blocks = caps[c];
            cfg.eviction = KVB_EVICT_LRU;
            lru = wl_replay(&w, &cfg, NULL);
            cfg.eviction = KVB_EVICT_ARC;
            ours = wl_replay(&w, &cfg, NULL);
            ref = ref_replay(&w, caps[c]);
            KVT_CHECK(lru >= 0 && ours >= 0 && ref >= 0);
            printf("| %s | %u | %.4f | %.4f | %.4f | %+.4f |%s\n", wl_shape_name((wl_shape)s), caps[c], lru, ours, ref,
                   ours - ref, allowed_gap((wl_shape)s, caps[c], flags) > ALLOWED ? " known gap" : "");
            KVT_CHECK(ours >= ref - allowed_gap((wl_shape)s, caps[c], flags));
            sum += ours - ref;
            worst = ours - ref < worst ? ours - ref : worst;
            cells++;
        }
        wl_free(&w);
    }
    printf("kvblock.h's ARC less the reference: mean %+.4f, lowest %+.4f over %d cells\n", sum / cells, worst, cells);
    fflush(stdout);
}

static void test_arc_at_least_reference(void) { arc_against_reference(0); }
static void test_arc_at_least_reference_partial_tails(void) { arc_against_reference(WL_PARTIAL_TAIL); }

int main(void)
{
    KVT_RUN(test_reference_rules);
    KVT_RUN(test_arc_at_least_reference);
    KVT_RUN(test_arc_at_least_reference_partial_tails);
    return kvt_summary();
}
