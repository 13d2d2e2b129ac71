/* fuzz_diff.c — libFuzzer target: one random program of pool and sequence calls run on kvblock.h and on a
 * plain reference model written here (arrays, linear scans, no index, no rings), results compared.
 *
 * The model keeps, per block: state, references, generation, priority, hash, parent, tokens; the free
 * set as a stack (the last freed block is allocated next, lowest index first at the start, as the
 * manual's "lowest index allocated first"); the eviction order as a release counter (each block that
 * becomes inactive gets the next number; the victim is the smallest number of the lowest priority level,
 * and under KVB_EVICT_LINEAGE the smallest that is a leaf: not the indexed block of its hash, or one
 * with a duplicate, or one no registered block names as parent; the smallest of all when no leaf is
 * left); per hash, the registered blocks in the order the index answers for them (the first registered,
 * then the duplicates newest first). Sequences are modelled as the manual says: a prompt's full blocks
 * reused while every earlier one was cached, a shared partial last block copied before it is written.
 *
 * After every call: the result code, the handles and counts it returned, the pool's events (stored,
 * removed, cleared) of that call, the pool's statistics, every block's state / references / tokens /
 * priority / hash / parent (through its current handle), the eviction candidates in order, every
 * sequence's tokens, hashes and block table, and kvb_pool_check. A difference is abort().
 *
 *   make fuzz-diff FUZZ_SECONDS=60       libFuzzer from tests/fuzz/corpus_diff (clang)
 *   make test                            runs build/fuzz/replay_diff over that corpus once
 *   KVFUZZ_TRACE=1 build/fuzz/replay_diff FILE...   prints each op and its result
 */
#define KVBLOCK_IMPLEMENTATION
#include "kvblock.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { D_MAXB = 16, D_BT = 4, D_SLOTS = 24, D_SEQS = 3, D_UNI = 12, D_KNOWN = 64, D_MAX_OPS = 300, D_MAXN = 8,
       D_MAXTOK = 48, D_EVENTS = 256 };

/* ---- the reference model ------------------------------------------------------------------------- */

typedef struct mblock {
    int state;            /* 0 = free, else kvb_block_state */
    uint32_t refs, gen, prio, ntok;
    uint64_t salt;
    kvb_hash hash, parent;
    uint32_t tokens[D_BT];
    uint64_t when;        /* inactive: its place in the eviction order */
} mblock;

typedef struct mseq {
    int live;
    uint64_t salt;
    uint32_t tokens[D_MAXTOK];
    size_t len, computed, cached;
    kvb_hash hashes[D_MAXTOK / D_BT];
    size_t nh;
    uint32_t table[D_MAXTOK / D_BT + 1];
    size_t nb;
} mseq;

typedef struct model {
    uint32_t n, levels;
    int lineage, reject;
    mblock b[D_MAXB];
    uint32_t free_stack[D_MAXB], n_free;
    uint64_t clock;
    uint32_t reg[D_MAXB], nreg; /* registered blocks: index order of the answer per hash is kept in reg */
    kvb_pool_stats st;
    kvb_event ev[D_EVENTS];
    size_t nev;
    mseq seq[D_SEQS];
} model;

static int heq(kvb_hash a, kvb_hash b) { return a.lo == b.lo && a.hi == b.hi; }
static int hroot(kvb_hash a) { return !a.lo && !a.hi; }
static uint64_t m_handle(const model *m, uint32_t i) { return ((uint64_t)m->b[i].gen << 32) | (i + 1); }

static void m_event(model *m, kvb_event_kind k, const mblock *b)
{
    kvb_event *e;
    if (m->nev == D_EVENTS) abort();
    e = &m->ev[m->nev++];
    memset(e, 0, sizeof *e);
    e->kind = k;
    if (b) {
        e->num_tokens = b->ntok;
        e->hash = b->hash;
        e->parent = b->parent;
    }
}

/* The block the index answers for h: the first of reg[] (registration order, duplicates behind) that
 * carries h. reg[] keeps the answer first: see m_register. */
static uint32_t m_find(const model *m, kvb_hash h)
{
    for (uint32_t i = 0; i < m->nreg; i++)
        if (heq(m->b[m->reg[i]].hash, h)) return m->reg[i];
    return UINT32_MAX;
}

static uint32_t m_copies(const model *m, kvb_hash h)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < m->nreg; i++) c += heq(m->b[m->reg[i]].hash, h);
    return c;
}

static int m_leaf(const model *m, uint32_t x)
{
    const mblock *b = &m->b[x];
    if (m_find(m, b->hash) != x || m_copies(m, b->hash) > 1) return 1;
    for (uint32_t i = 0; i < m->nreg; i++)
        if (!hroot(b->hash) && heq(m->b[m->reg[i]].parent, b->hash)) return 0;
    return 1;
}

static int m_inactive(const mblock *b) { return b->state == KVB_STATE_REGISTERED && !b->refs; }

static uint32_t m_victim(const model *m)
{
    for (int leaves = m->lineage; leaves >= 0; leaves--)
        for (uint32_t lvl = 0; lvl < m->levels; lvl++) {
            uint32_t best = UINT32_MAX;
            for (uint32_t i = 0; i < m->n; i++)
                if (m_inactive(&m->b[i]) && m->b[i].prio == lvl && (!leaves || m_leaf(m, i)) &&
                    (best == UINT32_MAX || m->b[i].when < m->b[best].when))
                    best = i;
            if (best != UINT32_MAX) return best;
        }
    return UINT32_MAX;
}

static uint32_t m_count(const model *m, int what) /* 0 free, 1 active, 2 inactive */
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < m->n; i++) {
        const mblock *b = &m->b[i];
        c += what == 0 ? !b->state : what == 1 ? (b->state && b->refs > 0) : m_inactive(b);
    }
    return c;
}

static void m_unregister(model *m, uint32_t x)
{
    uint32_t i, at = m->nreg;
    int first = m_find(m, m->b[x].hash) == x, last = m_copies(m, m->b[x].hash) == 1;
    for (i = 0; i < m->nreg; i++)
        if (m->reg[i] == x) at = i;
    if (first && last) m_event(m, KVB_EVENT_REMOVED, &m->b[x]);
    memmove(&m->reg[at], &m->reg[at + 1], (m->nreg - at - 1) * sizeof m->reg[0]);
    m->nreg--;
    /* the next in line answers now: it is the newest duplicate, which sits right behind in reg[] */
}

static void m_make_free(model *m, uint32_t x)
{
    mblock *b = &m->b[x];
    uint32_t gen = (b->gen + 1) & 0x7fffffffu;
    if (b->state == KVB_STATE_REGISTERED) m_unregister(m, x);
    memset(b, 0, sizeof *b);
    b->gen = gen;
    m->free_stack[m->n_free++] = x;
}

static uint32_t m_alloc_one(model *m)
{
    uint32_t x;
    if (!m->n_free) {
        x = m_victim(m);
        m_make_free(m, x);
        m->n_free--;
        m->st.evictions++;
    } else {
        x = m->free_stack[--m->n_free];
    }
    m->b[x].state = KVB_STATE_EMPTY;
    m->b[x].refs = 1;
    m->st.allocations++;
    return x;
}

static void m_take_ref(model *m, uint32_t x) { m->b[x].refs++; }

/* One reference off; `use`: a release (kvb_release, a sequence's end) that names the level even when
 * other references stay (the level a later kvb_unpin of the last one keeps). */
static void m_drop_ref(model *m, uint32_t x, uint32_t prio, int use)
{
    mblock *b = &m->b[x];
    if (!b->refs) return;
    if (--b->refs) {
        if (use) b->prio = prio;
        return;
    }
    if (b->state == KVB_STATE_REGISTERED) {
        b->prio = prio;
        b->when = ++m->clock;
    } else {
        m_make_free(m, x);
    }
}

/* Registration: a new hash goes last in reg[]; a duplicate goes right behind the block that answers
 * for its hash, ahead of older duplicates (they answer in that order as the ones before them go). */
static uint32_t m_register(model *m, uint32_t x, kvb_hash h, kvb_hash parent, uint32_t ntok)
{
    uint32_t old = m_find(m, h), i, at = m->nreg;
    m->st.registrations++;
    if (old != UINT32_MAX) {
        m->st.dedups++;
        if (m->reject && m->b[x].refs == 1) {
            m_take_ref(m, old);
            m_drop_ref(m, x, 0, 0);
            return old;
        }
        for (i = 0; i < m->nreg; i++)
            if (m->reg[i] == old) at = i + 1;
    }
    m->b[x].hash = h;
    m->b[x].parent = parent;
    m->b[x].ntok = ntok;
    m->b[x].state = KVB_STATE_REGISTERED;
    memmove(&m->reg[at + 1], &m->reg[at], (m->nreg - at) * sizeof m->reg[0]);
    m->reg[at] = x;
    m->nreg++;
    if (old == UINT32_MAX) m_event(m, KVB_EVENT_STORED, &m->b[x]);
    return x;
}

static size_t m_prefix(const model *m, const kvb_hash *h, size_t n, uint32_t *idx)
{
    size_t k = 0;
    while (k < n && (idx[k] = m_find(m, h[k])) != UINT32_MAX) k++;
    return k;
}

/* ---- the program -------------------------------------------------------------------------------- */

typedef struct slot { uint64_t id; int held, mine; } slot;

typedef struct dz {
    const uint8_t *in;
    size_t n, at;
    int trace, op;
    kvb_pool *pool;
    model m;
    kvb_seq *seq[D_SEQS];
    slot s[D_SLOTS];
    kvb_hash uni[D_UNI];
    kvb_hash known[D_KNOWN];
    size_t nknown;
    kvb_event got[D_EVENTS];
    size_t ngot;
} dz;

static uint8_t u8(dz *d) { return d->at < d->n ? d->in[d->at++] : 0; }
static uint32_t below(dz *d, uint32_t k) { return k ? u8(d) % k : 0; }

static void fail(dz *d, const char *what, long long a, long long b)
{
    fprintf(stderr, "fuzz_diff: op %d: %s: library %lld, model %lld\n", d->op, what, a, b);
    abort();
}
#define SAME(what, a, b) do { if ((long long)(a) != (long long)(b)) fail(d, what, (long long)(a), (long long)(b)); } while (0)

static void on_events(const kvb_event *e, size_t n, void *user)
{
    dz *d = (dz *)user;
    for (size_t i = 0; i < n; i++) {
        if (d->ngot == D_EVENTS) abort();
        d->got[d->ngot++] = e[i];
    }
}

static void remember(dz *d, kvb_hash h)
{
    for (size_t i = 0; i < d->nknown; i++)
        if (heq(d->known[i], h)) return;
    if (d->nknown < D_KNOWN) d->known[d->nknown++] = h;
}

/* A hash to look up or register: one of a small universe (so chains and duplicates happen), or one a
 * block was registered under. */
static kvb_hash pick_hash(dz *d)
{
    uint8_t c = u8(d);
    if ((c & 1) && d->nknown) return d->known[(c >> 1) % d->nknown];
    return d->uni[(c >> 1) % D_UNI];
}

/* A handle: a slot's (strong), its weak form, a stale or forged one, or zero. */
static uint64_t pick_handle(dz *d, int *slot_out)
{
    uint8_t c = u8(d);
    uint32_t k = (uint32_t)(c >> 3) % D_SLOTS;
    *slot_out = -1;
    switch (c & 7) {
    case 0: return 0;
    case 1: return d->s[k].id | KVB_WEAK_BIT;
    case 2: return ((uint64_t)(u8(d) & 3) << 32) | (uint64_t)(u8(d) % (D_MAXB + 2));
    default: *slot_out = (int)k; return d->s[k].id;
    }
}

static void put_slot(dz *d, uint64_t id, int mine)
{
    for (int i = 0; i < D_SLOTS; i++)
        if (!d->s[i].held) {
            d->s[i].id = id;
            d->s[i].held = 1;
            d->s[i].mine = mine;
            return;
        }
    /* no room: the reference is kept by no slot (a leak the pool does not mind) */
}

/* ---- comparing ---------------------------------------------------------------------------------- */

static void compare(dz *d)
{
    model *m = &d->m;
    kvb_pool_stats st;
    kvb_weak cand[D_MAXB];
    size_t nc = 0, k = 0;
    char why[256] = "";
    if (kvb_pool_check(d->pool, why, sizeof why) != KVB_OK) {
        fprintf(stderr, "fuzz_diff: op %d: pool check: %s\n", d->op, why);
        abort();
    }
    SAME("events", d->ngot, m->nev);
    for (size_t i = 0; i < d->ngot; i++) {
        SAME("event kind", d->got[i].kind, m->ev[i].kind);
        SAME("event hash", d->got[i].hash.lo, m->ev[i].hash.lo);
        SAME("event parent", d->got[i].parent.lo, m->ev[i].parent.lo);
        SAME("event tokens", d->got[i].num_tokens, m->ev[i].num_tokens);
    }
    d->ngot = m->nev = 0;
    kvb_pool_get_stats(d->pool, &st);
    SAME("lookups", st.lookups, m->st.lookups);
    SAME("lookup blocks", st.lookup_blocks, m->st.lookup_blocks);
    SAME("hit blocks", st.hit_blocks, m->st.hit_blocks);
    SAME("hit tokens", st.hit_tokens, m->st.hit_tokens);
    SAME("allocations", st.allocations, m->st.allocations);
    SAME("evictions", st.evictions, m->st.evictions);
    SAME("registrations", st.registrations, m->st.registrations);
    SAME("dedups", st.dedups, m->st.dedups);
    SAME("invalidated total", st.invalidated, m->st.invalidated);
    SAME("free", st.free_blocks, m_count(m, 0));
    SAME("active", st.active_blocks, m_count(m, 1));
    SAME("inactive", st.inactive_blocks, m_count(m, 2));
    for (uint32_t i = 0; i < m->n; i++) {
        const mblock *b = &m->b[i];
        kvb_block_info info;
        kvb_result r = kvb_block_get_info(d->pool, m_handle(m, i), &info);
        SAME("block handle", r, b->state ? KVB_OK : KVB_ESTALE);
        if (r != KVB_OK) continue;
        SAME("block state", info.state, b->state);
        SAME("block refs", info.refs, b->refs);
        SAME("block tokens", info.num_tokens, b->ntok);
        SAME("block hash", info.hash.lo, b->hash.lo);
        SAME("block parent", info.parent.lo, b->parent.lo);
        if (m_inactive(b)) SAME("block priority", info.priority, b->prio);
    }
    kvb_eviction_candidates(d->pool, D_MAXB, cand, &nc);
    SAME("candidates", nc, m_count(m, 2));
    for (uint32_t taken = 0; k < nc; k++) { /* level by level, in release order: the smallest not taken */
        uint32_t best = UINT32_MAX;
        for (uint32_t i = 0; i < m->n; i++)
            if (m_inactive(&m->b[i]) && !(taken >> i & 1) &&
                (best == UINT32_MAX || m->b[i].prio < m->b[best].prio ||
                 (m->b[i].prio == m->b[best].prio && m->b[i].when < m->b[best].when)))
                best = i;
        SAME("candidate", cand[k].id, m_handle(m, best) | KVB_WEAK_BIT);
        taken |= 1u << best;
    }
    for (int q = 0; q < D_SEQS; q++) {
        const mseq *ms = &m->seq[q];
        const kvb_block *table;
        const kvb_hash *hs;
        const uint32_t *tok;
        size_t nt, nh, nb;
        kvb_seq_info info;
        if (!ms->live) continue;
        kvb_seq_get_info(d->seq[q], &info);
        kvb_seq_tokens(d->seq[q], &tok, &nt);
        kvb_seq_hashes(d->seq[q], &hs, &nh);
        kvb_seq_blocks(d->seq[q], &table, &nb);
        SAME("seq tokens", nt, ms->len);
        SAME("seq computed", info.num_computed, ms->computed);
        SAME("seq cached", info.num_cached, ms->cached);
        SAME("seq hashes", nh, ms->nh);
        SAME("seq blocks", nb, ms->nb);
        for (size_t i = 0; i < nt && i < ms->len; i++) SAME("seq token", tok[i], ms->tokens[i]);
        for (size_t i = 0; i < nh && i < ms->nh; i++) SAME("seq hash", hs[i].lo, ms->hashes[i].lo);
        for (size_t i = 0; i < nb && i < ms->nb; i++) SAME("seq block", table[i].id, m_handle(m, ms->table[i]));
    }
}

/* The model's answer to a handle (kvb__lookup_handle, then strong-only checks). */
static kvb_result m_lookup(const model *m, uint64_t id, uint32_t *x)
{
    uint32_t low = (uint32_t)id;
    if (!id) return KVB_EINVAL;
    if (!low || low > m->n) return KVB_ERANGE;
    *x = low - 1;
    if (!m->b[*x].state || m->b[*x].gen != ((uint32_t)(id >> 32) & 0x7fffffffu))
        return (id & KVB_WEAK_BIT) ? KVB_EGONE : KVB_ESTALE;
    return KVB_OK;
}

static kvb_result m_strong(const model *m, uint64_t id, uint32_t *x)
{
    kvb_result r;
    if (id & KVB_WEAK_BIT) return KVB_EWEAK;
    if ((r = m_lookup(m, id, x)) != KVB_OK) return r;
    return m->b[*x].refs ? KVB_OK : KVB_ESTALE;
}

/* ---- ops ------------------------------------------------------------------------------------------ */

static void op_alloc(dz *d)
{
    size_t n = below(d, 6);
    kvb_block out[8];
    kvb_result r = kvb_alloc(d->pool, n, out), want = n > m_count(&d->m, 0) + m_count(&d->m, 2) ? KVB_ENOSPACE : KVB_OK;
    SAME("alloc", r, want);
    for (size_t i = 0; r == KVB_OK && i < n; i++) {
        uint32_t x = m_alloc_one(&d->m);
        SAME("alloc handle", out[i].id, m_handle(&d->m, x));
        put_slot(d, out[i].id, 1);
    }
}

/* kvb_release, or kvb_unpin (no options: each block keeps its level). */
static void op_release(dz *d, int unpin)
{
    kvb_block b[D_MAXN];
    int sl[D_MAXN], uses[D_SLOTS] = {0};
    uint8_t pb = unpin ? 0 : u8(d); /* the level and where the request ends in its last block (policies here ignore it) */
    uint32_t x[D_MAXN], prio = pb % (d->m.levels + 1), last = (uint32_t)(pb >> 4) % (D_BT + 2);
    size_t n = below(d, D_MAXN), i, k = 0;
    kvb_release_opts o = {.priority = prio, .last_block_tokens = last};
    kvb_result want = KVB_OK, r;
    for (i = 0; i < n; i++) { /* never a reference this harness does not own (a sequence's) */
        uint64_t id = pick_handle(d, &sl[k]);
        if (sl[k] >= 0 && uses[sl[k]] >= d->s[sl[k]].held) continue;
        if (sl[k] < 0 && !(id & KVB_WEAK_BIT) && m_lookup(&d->m, id, &x[k]) == KVB_OK && d->m.b[x[k]].refs) continue;
        if (sl[k] >= 0) uses[sl[k]]++;
        b[k++].id = id;
    }
    n = k;
    if (prio >= d->m.levels || last > D_BT) want = KVB_ERANGE;
    for (i = 0; want == KVB_OK && i < n; i++) {
        if (b[i].id & KVB_WEAK_BIT) want = KVB_EWEAK;
        else if ((want = m_lookup(&d->m, b[i].id, &x[i])) == KVB_OK && !d->m.b[x[i]].refs) want = KVB_EDOUBLE;
    }
    r = unpin ? kvb_unpin(d->pool, b, n) : kvb_release(d->pool, b, n, &o);
    SAME(unpin ? "unpin" : "release", r, want);
    if (r != KVB_OK) return;
    for (i = n; i-- > 0;) m_drop_ref(&d->m, x[i], unpin ? d->m.b[x[i]].prio : prio, !unpin);
    for (i = 0; i < n; i++) d->s[sl[i]].held--;
}

static void op_retain(dz *d)
{
    int sl;
    uint32_t x;
    kvb_block b;
    kvb_result want, r;
    b.id = pick_handle(d, &sl);
    want = m_strong(&d->m, b.id, &x);
    r = kvb_retain(d->pool, &b, 1);
    SAME("retain", r, want);
    if (r != KVB_OK) return;
    m_take_ref(&d->m, x);
    if (sl >= 0) d->s[sl].held++;
    else put_slot(d, b.id, 0);
}

/* Register handles (Empty ones with hashes given, or Complete ones: their hash is computed). */
static void op_register(dz *d, int hashed)
{
    kvb_block b[D_MAXN], out[D_MAXN];
    kvb_hash h[D_MAXN], par[D_MAXN];
    int sl[D_MAXN];
    uint32_t x[D_MAXN];
    size_t n = 1 + below(d, 4), i, j;
    int with_parents = u8(d) & 1;
    kvb_result want = KVB_OK, r;
    for (i = 0; i < n; i++) {
        b[i].id = pick_handle(d, &sl[i]);
        h[i] = pick_hash(d);
        par[i] = (u8(d) & 3) ? (i ? h[i - 1] : pick_hash(d)) : (kvb_hash){0, 0};
    }
    for (i = 0; want == KVB_OK && i < n; i++) want = m_strong(&d->m, b[i].id, &x[i]); /* every handle first */
    for (i = 0; want == KVB_OK && i < n; i++) {
        if (d->m.b[x[i]].state != (hashed ? KVB_STATE_EMPTY : KVB_STATE_COMPLETE)) want = KVB_ESTATE;
        for (j = 0; want == KVB_OK && j < i; j++)
            if (x[j] == x[i]) want = KVB_EINVAL;
    }
    r = hashed ? kvb_register_hashed(d->pool, b, n, h, with_parents ? par : NULL, out) : kvb_register(d->pool, b, n, out);
    SAME(hashed ? "register_hashed" : "register", r, want);
    if (r != KVB_OK) return;
    for (i = 0; i < n; i++) {
        mblock *mb = &d->m.b[x[i]];
        uint32_t got;
        if (!hashed) {
            kvb_hash p = mb->parent;
            h[i] = kvb_hash_block(hroot(p) ? NULL : &p, mb->tokens, mb->ntok, NULL, 0, mb->salt);
            got = m_register(&d->m, x[i], h[i], p, mb->ntok);
        } else {
            got = m_register(&d->m, x[i], h[i], with_parents ? par[i] : (kvb_hash){0, 0}, D_BT);
        }
        remember(d, h[i]);
        SAME("registered handle", out[i].id, m_handle(&d->m, got));
        if (sl[i] >= 0 && d->s[sl[i]].id != out[i].id) { /* the reference moved (duplicate rejected) */
            d->s[sl[i]].id = out[i].id;
            d->s[sl[i]].mine = 0;
        }
    }
}

/* A lookup of n hashes matched blocks x[0..k) (handles out): a reference each, counted as the pool counts
 * (kvb_match and kvb_request_begin). */
static void take_matched(dz *d, const uint32_t *x, size_t k, size_t n, const kvb_block *out)
{
    d->m.st.lookups++;
    d->m.st.lookup_blocks += n;
    d->m.st.hit_blocks += k;
    for (size_t i = 0; i < k; i++) {
        m_take_ref(&d->m, x[i]);
        d->m.st.hit_tokens += d->m.b[x[i]].ntok;
        SAME("matched handle", out[i].id, m_handle(&d->m, x[i]));
        put_slot(d, out[i].id, 0);
    }
}

/* kvb_pin: kvb_match's prefix and references, nothing counted. */
static void op_pin(dz *d)
{
    kvb_hash h[D_MAXN];
    kvb_block out[D_MAXN];
    uint32_t x[D_MAXN];
    size_t n = below(d, D_MAXN), k = 0, want, i;
    for (i = 0; i < n; i++) h[i] = pick_hash(d);
    want = m_prefix(&d->m, h, n, x);
    SAME("pin", kvb_pin(d->pool, h, n, out, &k), KVB_OK);
    SAME("pinned", k, want);
    for (i = 0; i < k; i++) {
        m_take_ref(&d->m, x[i]);
        SAME("pinned handle", out[i].id, m_handle(&d->m, x[i]));
        put_slot(d, out[i].id, 0);
    }
}

static void op_match(dz *d, int how) /* 0 match, 1 lookup, 2 presence */
{
    kvb_hash h[D_MAXN];
    kvb_block out[D_MAXN];
    uint32_t x[D_MAXN];
    uint8_t present[D_MAXN];
    size_t n = below(d, D_MAXN), k = 0, want, i, count = 0;
    for (i = 0; i < n; i++) h[i] = pick_hash(d);
    want = m_prefix(&d->m, h, n, x);
    if (how == 0) {
        SAME("match", kvb_match(d->pool, h, n, out, &k), KVB_OK);
        SAME("matched", k, want);
        take_matched(d, x, k, n, out);
    } else if (how == 1) {
        SAME("lookup", kvb_lookup(d->pool, h, n, &k), KVB_OK);
        SAME("looked up", k, want);
    } else {
        SAME("presence", kvb_presence(d->pool, h, n, present, &count), KVB_OK);
        for (i = 0; i < n; i++) {
            SAME("present", present[i], m_find(&d->m, h[i]) != UINT32_MAX);
            count -= present[i];
        }
        SAME("present count", count, 0);
    }
}

/* kvb_request_begin: the cached prefix matched and counted as kvb_match does; then the rest allocated
 * (every block first, evicting as kvb_alloc does) and registered in order, each under the hash before it
 * as parent; KVB_ENOSPACE, nothing changed, when the free and inactive blocks, less the inactive ones it
 * matched (each once), cannot hold the rest. */
static void op_request_begin(dz *d)
{
    kvb_hash h[D_MAXN];
    kvb_block out[D_MAXN];
    uint32_t x[D_MAXN];
    size_t n = below(d, D_MAXN), k = 0, want, i, j, inactive_hit = 0;
    kvb_result r, want_r = KVB_OK;
    for (i = 0; i < n; i++) h[i] = pick_hash(d);
    want = m_prefix(&d->m, h, n, x);
    for (i = 0; i < want; i++) {
        for (j = 0; j < i && x[j] != x[i]; j++) {
        }
        inactive_hit += j == i && !d->m.b[x[i]].refs;
    }
    if (n - want > (size_t)m_count(&d->m, 0) + m_count(&d->m, 2) - inactive_hit) want_r = KVB_ENOSPACE;
    r = kvb_request_begin(d->pool, h, n, out, &k);
    SAME("request_begin", r, want_r);
    if (r != KVB_OK) return;
    SAME("request_begin cached", k, want);
    take_matched(d, x, k, n, out);
    for (i = k; i < n; i++) x[i] = m_alloc_one(&d->m);
    for (i = k; i < n; i++) {
        uint32_t got = m_register(&d->m, x[i], h[i], i ? h[i - 1] : (kvb_hash){0, 0}, D_BT);
        remember(d, h[i]);
        SAME("request_begin new handle", out[i].id, m_handle(&d->m, got));
        put_slot(d, out[i].id, got == x[i]);
    }
}

/* kvb_invalidate on the model: per hash, in the order the index answers, every inactive registered
 * block goes back to the free set as an eviction would (events included), with no eviction counted. */
static void op_invalidate(dz *d)
{
    kvb_hash h[D_MAXN];
    size_t n = below(d, D_MAXN), dropped = 99, want = 0, i, j;
    for (i = 0; i < n; i++) h[i] = pick_hash(d);
    SAME("invalidate", kvb_invalidate(d->pool, n ? h : NULL, n, &dropped), KVB_OK);
    for (i = 0; i < n; i++)
        for (;;) {
            uint32_t x = UINT32_MAX;
            for (j = 0; j < d->m.nreg && x == UINT32_MAX; j++)
                if (heq(d->m.b[d->m.reg[j]].hash, h[i]) && m_inactive(&d->m.b[d->m.reg[j]])) x = d->m.reg[j];
            if (x == UINT32_MAX) break;
            m_make_free(&d->m, x);
            want++;
        }
    d->m.st.invalidated += want;
    SAME("invalidated", dropped, want);
}

static void op_upgrade(dz *d)
{
    int sl;
    uint32_t x;
    kvb_weak w;
    kvb_block out;
    kvb_result want, r;
    w.id = pick_handle(d, &sl) | ((u8(d) & 3) ? KVB_WEAK_BIT : 0);
    if (!(w.id & KVB_WEAK_BIT)) want = KVB_EINVAL;
    else if ((want = m_lookup(&d->m, w.id, &x)) == KVB_OK && !d->m.b[x].refs && d->m.b[x].state != KVB_STATE_REGISTERED)
        want = KVB_EGONE;
    r = kvb_upgrade(d->pool, w, &out);
    SAME("upgrade", r, want);
    if (r != KVB_OK) return;
    m_take_ref(&d->m, x);
    put_slot(d, out.id, 0);
}

/* The lifecycle calls, on blocks this harness allocated. */
static void op_lifecycle(dz *d)
{
    int sl, what = (int)below(d, 5);
    uint32_t x, tok[D_BT + 2];
    kvb_block b;
    kvb_result want, r;
    kvb_hash parent = pick_hash(d);
    int root = u8(d) & 1, ready = u8(d) & 1;
    size_t n = below(d, D_BT + 2);
    uint64_t salt = below(d, 3);
    static const int from[5] = {KVB_STATE_EMPTY, KVB_STATE_PARTIAL, KVB_STATE_READY, KVB_STATE_READY, KVB_STATE_INFLIGHT};
    b.id = pick_handle(d, &sl);
    for (size_t i = 0; i < n; i++) tok[i] = below(d, 4);
    want = m_strong(&d->m, b.id, &x);
    /* one writer per block: only blocks allocated here (a sequence's blocks are its own) */
    if ((sl >= 0 && !d->s[sl].mine) || (sl < 0 && want == KVB_OK)) return;
    if (want == KVB_OK && d->m.b[x].state != from[what]) want = KVB_ESTATE;
    if (want == KVB_OK && what == 1 && n > D_BT - d->m.b[x].ntok) want = KVB_ERANGE;
    switch (what) {
    case 0: r = kvb_block_init(d->pool, b, root ? NULL : &parent, salt, NULL, 0); break;
    case 1: r = kvb_block_add_tokens(d->pool, b, tok, n, ready); break;
    case 2: r = kvb_block_schedule(d->pool, b); break;
    case 3: r = kvb_block_cancel_schedule(d->pool, b); break;
    default: r = kvb_block_compute_done(d->pool, b); break;
    }
    SAME("lifecycle", r, want);
    if (r != KVB_OK) return;
    mblock *mb = &d->m.b[x];
    switch (what) {
    case 0:
        mb->parent = root ? (kvb_hash){0, 0} : parent;
        mb->salt = salt;
        mb->ntok = 0;
        mb->state = KVB_STATE_PARTIAL;
        break;
    case 1:
        memcpy(mb->tokens + mb->ntok, tok, n * sizeof *tok);
        mb->ntok += (uint32_t)n;
        mb->state = (mb->ntok == D_BT || ready) ? KVB_STATE_READY : KVB_STATE_PARTIAL;
        break;
    case 2: mb->state = KVB_STATE_INFLIGHT; break;
    case 3: mb->state = KVB_STATE_PARTIAL; break;
    default: mb->state = mb->ntok == D_BT ? KVB_STATE_COMPLETE : KVB_STATE_PARTIAL; break;
    }
}

static void op_reset(dz *d)
{
    kvb_result want = m_count(&d->m, 1) ? KVB_EBUSY : KVB_OK;
    SAME("reset", kvb_pool_reset(d->pool), want);
    if (want != KVB_OK) return;
    for (uint32_t i = 0; i < d->m.n; i++)
        if (m_inactive(&d->m.b[i])) {
            uint32_t gen = (d->m.b[i].gen + 1) & 0x7fffffffu;
            memset(&d->m.b[i], 0, sizeof d->m.b[i]);
            d->m.b[i].gen = gen;
            d->m.free_stack[d->m.n_free++] = i;
        }
    d->m.nreg = 0;
    m_event(&d->m, KVB_EVENT_CLEARED, NULL);
}

/* ---- sequences ------------------------------------------------------------------------------------ */

static void op_seq_create(dz *d)
{
    int q = (int)below(d, D_SEQS);
    kvb_seq_config c = {below(d, 2), NULL, 0};
    if (d->m.seq[q].live) return;
    SAME("seq create", kvb_seq_create(d->pool, &c, &d->seq[q]), KVB_OK);
    memset(&d->m.seq[q], 0, sizeof d->m.seq[q]);
    d->m.seq[q].live = 1;
    d->m.seq[q].salt = c.salt;
}

/* The manual's kvb_seq_append on the model. */
static kvb_result m_seq_append(model *m, mseq *s, const uint32_t *tokens, size_t n, size_t *cached_out)
{
    size_t len = s->len, total = len + n, n_old = s->nh, n_new = total / D_BT - n_old, nb_old = s->nb;
    size_t nb_new = (total + D_BT - 1) / D_BT, k = 0, i, need, room, inactive_hit = 0;
    uint32_t x[D_MAXTOK / D_BT + 1], last = UINT32_MAX;
    kvb_hash fresh[D_MAXTOK / D_BT + 1];
    uint32_t all[D_MAXTOK];
    *cached_out = 0;
    if (!n) return KVB_OK;
    memcpy(all, s->tokens, len * sizeof *all);
    memcpy(all + len, tokens, n * sizeof *all);
    for (i = 0; i < n_new; i++) {
        size_t b = n_old + i;
        const kvb_hash *p = b == 0 ? NULL : b - 1 < n_old ? &s->hashes[b - 1] : &fresh[b - 1 - n_old];
        fresh[i] = kvb_hash_block(p, all + b * D_BT, D_BT, NULL, 0, s->salt);
    }
    if (len % D_BT) {
        last = s->table[nb_old - 1];
        if (m->b[last].state != KVB_STATE_PARTIAL) return KVB_ESTATE;
    }
    int reuse = s->cached == len && len % D_BT == 0 && n_new;
    if (reuse) k = m_prefix(m, fresh, n_new, x);
    for (i = 0; i < k; i++) inactive_hit += m->b[x[i]].refs == 0;
    need = nb_new - nb_old - k + (last != UINT32_MAX && m->b[last].refs > 1);
    room = m_count(m, 0) + m_count(m, 2) - inactive_hit;
    if (need > room) return KVB_ENOSPACE;
    if (reuse) {
        m->st.lookups++;
        m->st.lookup_blocks += n_new;
        m->st.hit_blocks += k;
        for (i = 0; i < k; i++) {
            m_take_ref(m, x[i]);
            m->st.hit_tokens += m->b[x[i]].ntok;
            s->table[s->nb++] = x[i];
        }
    }
    if (last != UINT32_MAX) {
        size_t have = len % D_BT, fill = D_BT - have < n ? D_BT - have : n;
        if (m->b[last].refs > 1) { /* copy on write */
            uint32_t c = m_alloc_one(m);
            m->b[c].parent = m->b[last].parent;
            m->b[c].salt = s->salt;
            memcpy(m->b[c].tokens, all + (nb_old - 1) * D_BT, have * sizeof *all);
            m->b[c].ntok = (uint32_t)have;
            m->b[c].state = KVB_STATE_PARTIAL;
            m_drop_ref(m, last, 0, 0); /* a copy-on-write's drop: no use */
            s->table[nb_old - 1] = last = c;
        }
        memcpy(m->b[last].tokens + have, all + len, fill * sizeof *all);
        m->b[last].ntok += (uint32_t)fill;
        m->b[last].state = m->b[last].ntok == D_BT ? KVB_STATE_READY : KVB_STATE_PARTIAL;
    }
    for (size_t b = nb_old + k; b < nb_new; b++) {
        uint32_t c = m_alloc_one(m);
        size_t end = (b + 1) * D_BT < total ? (b + 1) * D_BT : total;
        m->b[c].parent = b == 0 ? (kvb_hash){0, 0} : b - 1 < n_old ? s->hashes[b - 1] : fresh[b - 1 - n_old];
        m->b[c].salt = s->salt;
        memcpy(m->b[c].tokens, all + b * D_BT, (end - b * D_BT) * sizeof *all);
        m->b[c].ntok = (uint32_t)(end - b * D_BT);
        m->b[c].state = m->b[c].ntok == D_BT ? KVB_STATE_READY : KVB_STATE_PARTIAL;
        s->table[s->nb++] = c;
    }
    memcpy(s->tokens, all, total * sizeof *all);
    s->len = total;
    for (i = 0; i < n_new; i++) s->hashes[s->nh++] = fresh[i];
    s->cached += k * D_BT;
    if (k) s->computed = s->cached;
    *cached_out = k * D_BT;
    return KVB_OK;
}

static void m_seq_commit(model *m, mseq *s, size_t upto)
{
    for (size_t b = s->computed / D_BT; b < s->nb; b++) {
        size_t end = (b + 1) * D_BT < s->len ? (b + 1) * D_BT : s->len;
        mblock *mb = &m->b[s->table[b]];
        if (end > upto) break;
        if (mb->state == KVB_STATE_PARTIAL || mb->state == KVB_STATE_READY || mb->state == KVB_STATE_INFLIGHT)
            mb->state = mb->ntok == D_BT ? KVB_STATE_COMPLETE : KVB_STATE_PARTIAL;
        if (mb->state == KVB_STATE_COMPLETE)
            s->table[b] = m_register(m, s->table[b], s->hashes[b], mb->parent, mb->ntok);
    }
    if (upto > s->computed) s->computed = upto;
}

static void op_seq_append(dz *d, int batch)
{
    int q = (int)below(d, D_SEQS);
    uint32_t tok[2 * D_BT + 2];
    size_t n = below(d, 2 * D_BT + 2), cached = 9, want_cached = 0, done = 7;
    mseq *s = &d->m.seq[q];
    kvb_result r, want;
    for (size_t i = 0; i < n; i++) tok[i] = below(d, 3) + (uint32_t)q * (u8(d) & 1);
    if (!s->live || s->len + n > D_MAXTOK) return;
    if (batch) {
        const uint32_t *tp = tok;
        r = kvb_seq_append_many(&d->seq[q], &tp, &n, 1, &done);
    } else {
        r = kvb_seq_append(d->seq[q], tok, n, &cached);
    }
    want = m_seq_append(&d->m, s, tok, n, &want_cached);
    SAME("seq append", r, want);
    if (batch) SAME("seq appended", done, r == KVB_OK);
    else SAME("seq cached", cached, r == KVB_OK ? want_cached : 0);
}

static void op_seq_commit(dz *d, int batch)
{
    int q = (int)below(d, D_SEQS);
    mseq *s = &d->m.seq[q];
    size_t upto;
    kvb_result r;
    if (!s->live) return;
    upto = below(d, (uint32_t)s->len + 2);
    r = batch ? kvb_seq_commit_many(&d->seq[q], &upto, 1) : kvb_seq_commit(d->seq[q], upto);
    SAME("seq commit", r, upto > s->len ? KVB_ERANGE : KVB_OK);
    if (r == KVB_OK) m_seq_commit(&d->m, s, upto);
    for (size_t b = 0; r == KVB_OK && b < s->nh; b++) remember(d, s->hashes[b]);
}

static void op_seq_destroy(dz *d)
{
    int q = (int)below(d, D_SEQS);
    mseq *s = &d->m.seq[q];
    if (!s->live) return;
    kvb_seq_destroy(d->seq[q]);
    d->seq[q] = NULL;
    for (size_t i = s->nb; i-- > 0;) m_drop_ref(&d->m, s->table[i], 0, 1);
    s->live = 0;
}

static void op_seq_fork(dz *d)
{
    int q = (int)below(d, D_SEQS), c = (int)below(d, D_SEQS);
    if (!d->m.seq[q].live || d->m.seq[c].live) return;
    SAME("seq fork", kvb_seq_fork(d->seq[q], &d->seq[c]), KVB_OK);
    d->m.seq[c] = d->m.seq[q];
    for (size_t i = 0; i < d->m.seq[c].nb; i++) m_take_ref(&d->m, d->m.seq[c].table[i]);
}

/* ---- the target ----------------------------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static dz d;
    kvb_pool_config cfg;
    uint8_t c0, c1;
    memset(&d, 0, sizeof d);
    d.in = data;
    d.n = size;
    d.trace = getenv("KVFUZZ_TRACE") != NULL;
    c0 = u8(&d);
    c1 = u8(&d);
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = 1 + c0 % D_MAXB;
    cfg.block_tokens = D_BT;
    cfg.eviction = (c0 >> 4) & 1 ? KVB_EVICT_LINEAGE : KVB_EVICT_LRU;
    cfg.duplicates = (c0 >> 5) & 1 ? KVB_DUP_REJECT : KVB_DUP_ALLOW;
    cfg.priority_levels = 1 + c1 % 3;
    cfg.on_events = on_events;
    cfg.event_user = &d;
    if (kvb_pool_create(&cfg, &d.pool) != KVB_OK) abort();
    d.m.n = cfg.num_blocks;
    d.m.levels = cfg.priority_levels;
    d.m.lineage = cfg.eviction == KVB_EVICT_LINEAGE;
    d.m.reject = cfg.duplicates == KVB_DUP_REJECT;
    for (uint32_t i = 0; i < d.m.n; i++) {
        d.m.b[i].gen = 1;
        d.m.free_stack[i] = d.m.n - 1 - i;
    }
    d.m.n_free = d.m.n;
    for (int i = 0; i < D_UNI; i++) { /* a chain of 6 and 6 roots */
        kvb_hash p = d.uni[i ? i - 1 : 0];
        uint32_t t = (uint32_t)i;
        d.uni[i] = kvb_hash_block(i && i < 6 ? &p : NULL, &t, 1, NULL, 0, 99);
    }
    /* near collisions, which the index must tell apart: the same index tag (the low 32 bits of the hash's
     * kvb__mix, found by a search over lo) as a chain block and as another root, and the same low half as
     * another root */
    d.uni[7] = (kvb_hash){ UINT64_C(0xdf00a6d8e0e1d72d), UINT64_C(0x983d7d5994d52da0) };
    d.uni[9] = (kvb_hash){ UINT64_C(0x45b19edfca4d2087), UINT64_C(0x2bd5dc1e2365568d) };
    if (kvb__tag(&d.uni[7]) != kvb__tag(&d.uni[3]) || kvb__tag(&d.uni[9]) != kvb__tag(&d.uni[8]))
        abort(); /* kvb__mix changed: search for new ones */
    d.uni[11].lo = d.uni[10].lo;
    for (d.op = 0; d.op < D_MAX_OPS && d.at < d.n; d.op++) {
        uint8_t op = u8(&d) % 21;
        if (d.trace) fprintf(stderr, "op %d: %u\n", d.op, op);
        switch (op) {
        case 0: case 1: op_alloc(&d); break;
        case 2: case 3: op_release(&d, 0); break;
        case 4: op_retain(&d); break;
        case 5: op_register(&d, 1); break;
        case 6: op_register(&d, 0); break;
        case 7: op_match(&d, 0); break;
        case 8: { /* lookup, presence, or request_begin */
            int how = 1 + (int)below(&d, 3);
            if (how == 3) op_request_begin(&d);
            else op_match(&d, how);
            break;
        }
        case 9: op_upgrade(&d); break;
        case 10: case 11: op_lifecycle(&d); break;
        case 12: op_reset(&d); break;
        case 13: op_seq_create(&d); break;
        case 14: op_seq_append(&d, u8(&d) & 1); break;
        case 15: op_seq_commit(&d, u8(&d) & 1); break;
        case 16: op_seq_destroy(&d); break;
        case 17: op_seq_fork(&d); break;
        case 18: op_invalidate(&d); break;
        case 19: op_pin(&d); break;
        default: op_release(&d, 1); break;
        }
        compare(&d);
    }
    for (int q = 0; q < D_SEQS; q++)
        if (d.m.seq[q].live) kvb_seq_destroy(d.seq[q]);
    kvb_pool_destroy(d.pool);
    return 0;
}

#ifdef KVFUZZ_REPLAY
#ifndef KVFUZZ_CORPUS
#define KVFUZZ_CORPUS "tests/fuzz/corpus_diff"
#endif
#include "fuzz_replay.h"
#endif
