/* tiny_llm.c — a tiny decoder-only transformer on the CPU whose attention reads and writes its K/V only
 * through kvcache block tables (paged attention), served by kvsched.h's continuous-batching scheduler
 * with prefix caching and eager offload from the device tier (G1) to a host tier (G2) and a disk tier (G3).
 *
 * The model: float32, weights from a seeded PRNG (the same every run), 2 layers, 4 heads x 16 dims
 * (d_model 64), a byte vocabulary (256), RMSNorm, rotary positions, a SiLU MLP, greedy sampling.
 * Its K/V cache is a memory-backed kvblock.h pool in the layout of kvs_model_preset(KVS_MODEL_TINY):
 * position p of a request lives in block table[p / 16], slot p % 16; one page (one block, one layer,
 * K or V) holds 16 slots x 4 heads x 16 floats, and its address comes from kvb_block_data.
 *
 * Run:   build/tiny_llm           requests sharing a system prompt, in four phases (cold, warm, G1 dropped,
 *                                 G1 and G2 dropped): cached tokens per tier and the generated token ids
 *        build/tiny_llm --check   proves that logits are equal bit for bit to from-scratch runs with prefix
 *                                 hits, after onboarding from host and from disk, and after a fork with
 *                                 copy-on-write; one line per check, exit status 0 only if all hold
 *        build/tiny_llm_cuda --check --gpu   the same, with the fork check's pool in GPU memory
 *                                 (kvc_pool_create): the copy-on-write runs on the device through the
 *                                 pool's copy_block hook; the CPU model reads and writes the pages
 *                                 through a host copy of the blocks it uses (make build/tiny_llm_cuda)
 * Build: make build/tiny_llm, or
 *   cc -std=c11 -O2 -D_GNU_SOURCE -I. -I/usr/include/stb examples/tiny_llm.c -o tiny_llm -pthread -lm
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mkdtemp, and O_DIRECT in the disk backend */
#endif
#define KVCACHE_IMPLEMENTATION
#include "kvsched.h"
#ifdef TINY_LLM_CUDA
#include "kvcuda.h" /* build/tiny_llm_cuda: --gpu puts the fork check's pool in GPU memory */
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    LAYERS = 2,
    HEADS = 4,
    HEAD_DIM = 16,
    DIM = HEADS * HEAD_DIM,
    FFN = 4 * DIM,
    VOCAB = 256,
    BLOCK = 16,      /* tokens per block, as the preset says */
    MAX_POS = 256,   /* rotary table length: the longest request */
    MAX_PROMPT = 96,
    MAX_NEW = 12     /* tokens generated per request */
};

#define WEIGHT_SEED UINT64_C(0x5eed)
#define QK_SCALE 0.5f  /* weight ranges of wq, wk and of wv, wo: large enough that the output */
#define VO_SCALE 0.25f /* depends on the whole context, not only on the last token */

/* ---- model -------------------------------------------------------------------------------------- */

typedef struct layer_w {
    float *attn_norm, *wq, *wk, *wv, *wo; /* projections are [out][in], row-major */
    float *mlp_norm, *w_up, *w_down;
} layer_w;

typedef struct model {
    float *mem; /* every weight, one allocation */
    float *embed, *final_norm, *unembed;
    layer_w layer[LAYERS];
    float rope_cos[MAX_POS][HEAD_DIM / 2], rope_sin[MAX_POS][HEAD_DIM / 2];
} model;

/* splitmix64: small, seedable, the same on every platform. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1): 24 random bits, exact in a float. */
static float rng_uniform(uint64_t *s) { return (float)(rng_next(s) >> 40) * (2.0f / 16777216.0f) - 1.0f; }

static float *take(float **at, size_t n)
{
    float *p = *at;
    *at += n;
    return p;
}

static void fill(float *w, size_t n, float scale, float offset, uint64_t *rng)
{
    size_t i;
    for (i = 0; i < n; i++) w[i] = offset + scale * rng_uniform(rng);
}

/* Uniform weights of about 1/sqrt(fan in), so activations stay near unit size through both layers;
 * the attention projections are larger (QK_SCALE, VO_SCALE). */
static int model_create(model *m, uint64_t seed)
{
    size_t per_layer = 2 * DIM + 4 * DIM * DIM + 2 * FFN * DIM, total = 2 * VOCAB * DIM + DIM + LAYERS * per_layer;
    float *at;
    uint64_t rng = seed;
    int l, p, i;
    memset(m, 0, sizeof *m);
    if (!(m->mem = (float *)malloc(total * sizeof *m->mem))) return -1;
    at = m->mem;
    m->embed = take(&at, VOCAB * DIM);
    m->unembed = take(&at, VOCAB * DIM);
    m->final_norm = take(&at, DIM);
    fill(m->embed, VOCAB * DIM, 1.0f, 0.0f, &rng);
    fill(m->unembed, VOCAB * DIM, 1.0f / 8.0f, 0.0f, &rng);
    fill(m->final_norm, DIM, 0.1f, 1.0f, &rng);
    for (l = 0; l < LAYERS; l++) {
        layer_w *L = &m->layer[l];
        L->attn_norm = take(&at, DIM);
        L->wq = take(&at, DIM * DIM);
        L->wk = take(&at, DIM * DIM);
        L->wv = take(&at, DIM * DIM);
        L->wo = take(&at, DIM * DIM);
        L->mlp_norm = take(&at, DIM);
        L->w_up = take(&at, FFN * DIM);
        L->w_down = take(&at, DIM * FFN);
        fill(L->attn_norm, DIM, 0.1f, 1.0f, &rng);
        fill(L->wq, 2 * DIM * DIM, QK_SCALE, 0.0f, &rng); /* wq and wk: sharp attention, so context matters */
        fill(L->wv, 2 * DIM * DIM, VO_SCALE, 0.0f, &rng); /* wv and wo */
        fill(L->mlp_norm, DIM, 0.1f, 1.0f, &rng);
        fill(L->w_up, FFN * DIM, 1.0f / 8.0f, 0.0f, &rng);
        fill(L->w_down, DIM * FFN, 1.0f / 16.0f, 0.0f, &rng);
    }
    for (p = 0; p < MAX_POS; p++) /* rotary angles pos * 10000^(-2i/d), computed once */
        for (i = 0; i < HEAD_DIM / 2; i++) {
            double angle = p * pow(10000.0, -2.0 * i / HEAD_DIM);
            m->rope_cos[p][i] = (float)cos(angle);
            m->rope_sin[p][i] = (float)sin(angle);
        }
    return 0;
}

static void model_destroy(model *m) { free(m->mem); }

/* out[r] = sum_c w[r][c] * x[c], always in the same order: results are bit-reproducible. */
static void matvec(float *out, const float *w, const float *x, int rows, int cols)
{
    int r, c;
    for (r = 0; r < rows; r++) {
        float s = 0.0f;
        for (c = 0; c < cols; c++) s += w[r * cols + c] * x[c];
        out[r] = s;
    }
}

static void rmsnorm(float *out, const float *x, const float *w)
{
    float ss = 0.0f, inv;
    int i;
    for (i = 0; i < DIM; i++) ss += x[i] * x[i];
    inv = 1.0f / sqrtf(ss / DIM + 1e-5f);
    for (i = 0; i < DIM; i++) out[i] = x[i] * inv * w[i];
}

static void rope(const model *m, float *v, size_t pos)
{
    int h, i;
    for (h = 0; h < HEADS; h++)
        for (i = 0; i < HEAD_DIM / 2; i++) {
            float *pair = v + h * HEAD_DIM + 2 * i, a = pair[0], b = pair[1];
            float c = m->rope_cos[pos][i], s = m->rope_sin[pos][i];
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
}

static void add(float *x, const float *y, int n)
{
    int i;
    for (i = 0; i < n; i++) x[i] += y[i];
}

static int argmax(const float *v, int n)
{
    int i, best = 0;
    for (i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* ---- paged K/V ---------------------------------------------------------------------------------- */

/* Page addresses of a request's blocks, resolved once per call: page[(block * LAYERS + layer) * 2 + part]. */
typedef struct kv_pages {
    float **page;
    size_t n_blocks;
} kv_pages;

static int pages_resolve(kvb_pool *pool, const kvb_block *table, size_t n_blocks, kv_pages *out)
{
    size_t b;
    uint32_t l, part;
    out->n_blocks = n_blocks;
    if (!(out->page = (float **)malloc((n_blocks ? n_blocks : 1) * LAYERS * 2 * sizeof *out->page))) return -1;
    for (b = 0; b < n_blocks; b++)
        for (l = 0; l < LAYERS; l++)
            for (part = 0; part < 2; part++) {
                void *p = NULL;
                if (kvb_block_data(pool, table[b], l, part, &p) != KVB_OK) {
                    free(out->page);
                    return -1;
                }
                out->page[(b * LAYERS + l) * 2 + part] = (float *)p;
            }
    return 0;
}

/* Position pos, one layer, K (part 0) or V (part 1): HEADS x HEAD_DIM floats in slot pos % BLOCK. */
static float *kv_slot(const kv_pages *pg, int layer, int part, size_t pos)
{
    return pg->page[((pos / BLOCK) * LAYERS + (size_t)layer) * 2 + (size_t)part] + (pos % BLOCK) * DIM;
}

/* Store this token's K/V. A Registered block is immutable (shared, matchable): there the token was
 * computed before, so the new K/V is compared with the stored bytes instead. 0 on a mismatch. */
static int kv_store(const kv_pages *pg, int layer, size_t pos, const float *k, const float *v, int read_only)
{
    float *ks = kv_slot(pg, layer, 0, pos), *vs = kv_slot(pg, layer, 1, pos);
    if (read_only) return !memcmp(ks, k, DIM * sizeof *k) && !memcmp(vs, v, DIM * sizeof *v);
    memcpy(ks, k, DIM * sizeof *k);
    memcpy(vs, v, DIM * sizeof *v);
    return 1;
}

/* Causal attention of query q (rotated) over slots [0, pos] of one layer, read back from the pool. */
static void attend(float *out, const kv_pages *pg, int layer, const float *q, size_t pos)
{
    static const float scale = 0.25f; /* 1 / sqrt(HEAD_DIM) */
    float w[MAX_POS];
    size_t t;
    int h, d;
    for (h = 0; h < HEADS; h++) {
        float mx = -INFINITY, sum = 0.0f, *o = out + h * HEAD_DIM;
        for (t = 0; t <= pos; t++) {
            const float *k = kv_slot(pg, layer, 0, t) + h * HEAD_DIM;
            float s = 0.0f;
            for (d = 0; d < HEAD_DIM; d++) s += q[h * HEAD_DIM + d] * k[d];
            w[t] = s * scale;
            if (w[t] > mx) mx = w[t];
        }
        for (t = 0; t <= pos; t++) sum += (w[t] = expf(w[t] - mx));
        memset(o, 0, HEAD_DIM * sizeof *o);
        for (t = 0; t <= pos; t++) {
            const float *v = kv_slot(pg, layer, 1, t) + h * HEAD_DIM;
            for (d = 0; d < HEAD_DIM; d++) o[d] += w[t] * v[d];
        }
        for (d = 0; d < HEAD_DIM; d++) o[d] /= sum;
    }
}

/* One token through both layers: its K/V go to its slot, then it attends over the request's slots.
 * logits may be NULL (tokens whose output nobody samples skip the head). 0 on a K/V mismatch. */
static int forward_token(const model *m, const kv_pages *pg, uint32_t token, size_t pos, int read_only,
                         float *logits)
{
    float x[DIM], h[DIM], q[DIM], k[DIM], v[DIM], att[DIM], up[FFN], o[DIM];
    int l, i, same = 1;
    memcpy(x, m->embed + (size_t)token * DIM, sizeof x);
    for (l = 0; l < LAYERS; l++) {
        const layer_w *L = &m->layer[l];
        rmsnorm(h, x, L->attn_norm);
        matvec(q, L->wq, h, DIM, DIM);
        matvec(k, L->wk, h, DIM, DIM);
        matvec(v, L->wv, h, DIM, DIM);
        rope(m, q, pos);
        rope(m, k, pos);
        same &= kv_store(pg, l, pos, k, v, read_only);
        attend(att, pg, l, q, pos);
        matvec(o, L->wo, att, DIM, DIM);
        add(x, o, DIM);
        rmsnorm(h, x, L->mlp_norm);
        matvec(up, L->w_up, h, FFN, DIM);
        for (i = 0; i < FFN; i++) up[i] = up[i] / (1.0f + expf(-up[i])); /* SiLU */
        matvec(o, L->w_down, up, DIM, FFN);
        add(x, o, DIM);
    }
    if (logits) {
        rmsnorm(h, x, m->final_norm);
        matvec(logits, m->unembed, h, VOCAB, DIM);
    }
    return same;
}

/* ---- engine: the model over block tables -------------------------------------------------------- */

/* A pool whose storage the CPU cannot touch (GPU memory): engine_run copies the blocks it uses to
 * `mirror` (same offsets) before computing, and the blocks it wrote back after. */
typedef struct device_view {
    kvb_pool *pool;
    unsigned char *base, *mirror;
    uint64_t block_bytes;
    int (*copy)(void *user, void *dst, const void *src, size_t bytes); /* kvc_memcpy */
    void *copy_user;
} device_view;

typedef struct engine {
    const model *m;
    device_view *dev;          /* NULL: every pool is host memory */
    uint64_t computed;         /* tokens run through the model */
    uint64_t rewrites;         /* tokens recomputed inside a Registered block (see kv_store) */
    uint64_t rewrite_mismatch; /* ... whose K/V differed from the stored bytes: must stay 0 */
} engine;

/* Compute tokens [from, to) of one request over its block table. Logits of each position p >= logits_from
 * go to logits[(p - logits_from) * VOCAB]. -1 when the table cannot hold the tokens. */
/* Device pools: blocks [first, last) of a resolved table between the device and the host mirror
 * (to_host = 1: device -> mirror), one copy per block (block-contiguous); the page addresses are turned
 * into mirror addresses when to_host. 0 on success. */
static int device_stage(const device_view *v, kv_pages *pg, size_t first, size_t last, int to_host)
{
    size_t b, i;
    for (b = first; b < last; b++) {
        float **page = pg->page + b * LAYERS * 2;
        unsigned char *dev = (unsigned char *)page[0], *host;
        if (!to_host) dev = v->base + ((unsigned char *)page[0] - v->mirror);
        host = v->mirror + (dev - v->base);
        if (to_host ? v->copy(v->copy_user, host, dev, (size_t)v->block_bytes)
                    : v->copy(v->copy_user, dev, host, (size_t)v->block_bytes))
            return -1;
        for (i = 0; to_host && i < LAYERS * 2; i++) page[i] = (float *)(v->mirror + ((unsigned char *)page[i] - v->base));
    }
    return 0;
}

static int engine_run(engine *e, kvb_pool *pool, const kvb_block *table, size_t n_blocks, const uint32_t *tokens,
                      size_t from, size_t to, size_t logits_from, float *logits)
{
    kv_pages pg;
    size_t need = (to + BLOCK - 1) / BLOCK, p;
    int read_only = 0;
    const device_view *dev = e->dev && e->dev->pool == pool ? e->dev : NULL;
    if (to > MAX_POS || need > n_blocks || pages_resolve(pool, table, need, &pg) != 0) return -1;
    if (dev && device_stage(dev, &pg, 0, need, 1) != 0) {
        free(pg.page);
        return -1;
    }
    for (p = from; p < to; p++) {
        if (p == from || p % BLOCK == 0) { /* the state of the block that takes this token */
            kvb_block_info info;
            if (kvb_block_get_info(pool, table[p / BLOCK].id, &info) != KVB_OK) {
                free(pg.page);
                return -1;
            }
            read_only = info.state == KVB_STATE_REGISTERED;
        }
        if (!forward_token(e->m, &pg, tokens[p], p, read_only, p >= logits_from ? logits + (p - logits_from) * VOCAB : NULL))
            e->rewrite_mismatch++;
        e->rewrites += (uint64_t)read_only;
        e->computed++;
    }
    read_only = dev && to > from ? device_stage(dev, &pg, from / BLOCK, need, 0) : 0; /* the blocks written */
    free(pg.page);
    return read_only == 0 ? 0 : -1;
}

/* kvb_pool_config.copy_block for the fork check: the hook through which kvblock copies a shared block
 * on write (a device pool gets a device copy from kvcuda); here memcpy, counted in *user. */
static int counted_copy(void *user, void *const *dst, const void *const *src, size_t n, uint64_t bytes)
{
    size_t i;
    for (i = 0; i < n; i++) memcpy(dst[i], src[i], (size_t)bytes);
    ++*(unsigned *)user;
    return 0;
}

/* A layout-true memory pool for the model's K/V: kvs_model_preset(KVS_MODEL_TINY). copies: NULL for
 * kvblock's own memcpy, else block copies go through counted_copy. */
static int kv_pool_create(uint32_t num_blocks, kvb_layout_kind kind, kvb_dup_policy dup, uint32_t tier, unsigned *copies,
                          kvb_pool **out)
{
    kvb_pool_config pc;
    memset(&pc, 0, sizeof pc);
    pc.copy_block = copies ? counted_copy : NULL;
    pc.copy_user = copies;
    if (kvs_model_preset(KVS_MODEL_TINY, kind, &pc.block_tokens, &pc.layout) != KVS_OK) return -1;
    pc.num_blocks = num_blocks;
    pc.storage = KVB_STORAGE_HOST;
    pc.duplicates = dup;
    pc.tier = tier;
    return kvb_pool_create(&pc, out) == KVB_OK ? 0 : -1;
}

/* Logits at positions [from, n) of `tokens`, from scratch: a fresh pool and one sequence, nothing cached. */
static int reference_logits(const model *m, const uint32_t *tokens, size_t n, size_t from, float *out)
{
    engine e;
    kvb_pool *pool = NULL;
    kvb_seq *seq = NULL;
    const kvb_block *table;
    size_t n_blocks, cached = 1;
    int r = -1;
    memset(&e, 0, sizeof e);
    e.m = m;
    if (kv_pool_create((uint32_t)((n + BLOCK - 1) / BLOCK), KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_DUP_ALLOW, 0, NULL, &pool) == 0 &&
        kvb_seq_create(pool, NULL, &seq) == KVB_OK && kvb_seq_append(seq, tokens, n, &cached) == KVB_OK && cached == 0 &&
        kvb_seq_blocks(seq, &table, &n_blocks) == KVB_OK &&
        engine_run(&e, pool, table, n_blocks, tokens, 0, n, from, out) == 0)
        r = 0;
    kvb_seq_destroy(seq);
    kvb_pool_destroy(pool);
    return r;
}

/* ---- tiers: G1 device, G2 host, G3 disk --------------------------------------------------------- */

typedef struct tiers {
    kvb_pool *pool[3]; /* G3 is metadata only: its bytes live in the file */
    kvo_backend *mem, *disk;
    kvo_manager *manager;
    char dir[4096], path[4096 + 16];
    char note[128];    /* what the disk backend said (the O_DIRECT fallback) */
} tiers;

static void disk_note(void *user, const char *message) { snprintf((char *)user, 128, "%s", message); }

static void tiers_close(tiers *t)
{
    int i;
    kvo_manager_destroy(t->manager);
    kvo_backend_destroy(t->disk);
    kvo_backend_destroy(t->mem);
    for (i = 0; i < 3; i++) kvb_pool_destroy(t->pool[i]);
    if (t->path[0]) unlink(t->path);
    if (t->dir[0]) rmdir(t->dir);
    memset(t, 0, sizeof *t);
}

static int tiers_open(tiers *t, uint32_t g1, uint32_t g2, uint32_t g3)
{
    const char *tmp = getenv("TMPDIR");
    kvb_pool_config pc;
    kvo_disk_config dc;
    kvo_manager_config mc;
    uint64_t block_bytes = 0;
    memset(t, 0, sizeof *t);
    memset(&pc, 0, sizeof pc);
    if ((size_t)snprintf(t->dir, sizeof t->dir, "%s/tiny_llm.XXXXXX", tmp && *tmp ? tmp : "/tmp") >= sizeof t->dir) {
        fprintf(stderr, "tiny_llm: TMPDIR is too long (%zu bytes)\n", strlen(tmp));
        t->dir[0] = 0;
        return -1;
    }
    if (!mkdtemp(t->dir)) {
        fprintf(stderr, "tiny_llm: cannot create %s for the disk tier (set TMPDIR)\n", t->dir);
        t->dir[0] = 0;
        return -1;
    }
    snprintf(t->path, sizeof t->path, "%s/g3.kv", t->dir);
    /* G2 uses the other layout on purpose: the copy backends gather and scatter between the two. */
    if (kv_pool_create(g1, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_DUP_ALLOW, 0, NULL, &t->pool[0]) != 0 ||
        kv_pool_create(g2, KVB_LAYOUT_LAYER_SEPARATE, KVB_DUP_REJECT, 1, NULL, &t->pool[1]) != 0 ||
        kvb_pool_storage(t->pool[0], NULL, NULL, &block_bytes, NULL) != KVB_OK)
        return -1;
    pc.num_blocks = g3;
    pc.block_tokens = BLOCK;
    pc.duplicates = KVB_DUP_REJECT;
    pc.tier = 2;
    if (kvb_pool_create(&pc, &t->pool[2]) != KVB_OK || kvo_memcpy_backend_create(0, &t->mem) != KVO_OK) return -1;
    memset(&dc, 0, sizeof dc);
    dc.path = t->path;
    dc.disk_pool = t->pool[2];
    dc.block_bytes = block_bytes;
    dc.log = disk_note;
    dc.log_user = t->note;
    if (kvo_disk_backend_create(&dc, &t->disk) != KVO_OK) return -1;
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 3;
    mc.pools[0] = t->pool[0];
    mc.pools[1] = t->pool[1];
    mc.pools[2] = t->pool[2];
    mc.down[0] = t->mem;  /* G1 -> G2 */
    mc.down[1] = t->disk; /* G2 -> G3 */
    mc.up[1] = t->mem;    /* G2 -> G1 */
    mc.up[2] = t->disk;   /* G3 -> G1 */
    mc.offload = KVO_OFFLOAD_EAGER;
    mc.pipeline.mode = KVO_MODE_POLL; /* no threads: every transfer moves when the scheduler polls */
    mc.pipeline.min_batch = 1;        /* each poll moves what waits: no 10 ms flush timer, same run every time */
    return kvo_manager_create(&mc, &t->manager) == KVO_OK ? 0 : -1;
}

/* Forget the cached blocks of the fastest `levels` tiers, after the offloads in flight have landed. */
static int tiers_drop(tiers *t, int levels)
{
    int i;
    if (kvo_manager_drain(t->manager, 5000000) != KVO_OK) return -1;
    for (i = 0; i < levels; i++)
        if (kvb_pool_reset(t->pool[i]) != KVB_OK) return -1;
    return 0;
}

static kvo_manager_stats tiers_stats(tiers *t)
{
    kvo_manager_stats s;
    memset(&s, 0, sizeof s);
    kvo_manager_get_stats(t->manager, &s);
    return s;
}

/* ---- serving: requests through the scheduler ---------------------------------------------------- */

typedef struct job {
    uint32_t prompt[MAX_PROMPT];
    size_t n_prompt;
    uint64_t id;
    uint32_t out[MAX_NEW];          /* sampled tokens */
    size_t n_out;
    float logits[MAX_NEW * VOCAB];  /* the logits each sampled token came from */
    size_t cached, lower;           /* prompt tokens from the cache; of those, loaded from G2/G3 */
} job;

typedef struct pending { job *j; uint32_t token; } pending;

static job *find_job(job *jobs, size_t n, uint64_t id)
{
    size_t i;
    for (i = 0; i < n; i++)
        if (jobs[i].id == id) return &jobs[i];
    return NULL;
}

/* Run one item of a step; when it reaches the end of its tokens, sample from its logits. */
static int run_item(engine *e, kvs_sched *s, kvb_pool *device, const kvs_sched_item *it, job *jobs, size_t n,
                    pending *pend, size_t *n_pend)
{
    job *j = find_job(jobs, n, it->request);
    kvs_slot_info si;
    size_t end = it->num_computed + it->num_new;
    int sample;
    if (!j || kvs_sched_get_slot(s, it->request, &si) != KVS_OK) return -1;
    /* Read the hits while the request runs: once it is Finished, kvsched.h reports num_cached 0. */
    j->cached = si.num_cached;
    j->lower = si.num_lower_hit_tokens;
    sample = end == si.num_tokens;
    if (sample && j->n_out >= MAX_NEW) return -1;
    if (engine_run(e, device, it->blocks, it->num_blocks, it->tokens, it->num_computed, end, sample ? end - 1 : SIZE_MAX,
                   j->logits + j->n_out * VOCAB) != 0)
        return -1;
    if (sample) {
        pend[*n_pend].j = j;
        pend[(*n_pend)++].token = (uint32_t)argmax(j->logits + j->n_out * VOCAB, VOCAB);
    }
    return 0;
}

/* One engine step: plan, forward pass over every item, complete, then hand the sampled tokens back. */
static int serve_step(engine *e, kvs_sched *s, kvb_pool *device, job *jobs, size_t n, int *out_idle)
{
    kvs_step st;
    pending pend[8];
    size_t i, n_pend = 0;
    if (kvs_sched_step(s, &st) != KVS_OK || st.num_prefill + st.num_decode > 8) return -1;
    for (i = 0; i < st.num_prefill; i++)
        if (run_item(e, s, device, &st.prefill[i], jobs, n, pend, &n_pend) != 0) return -1;
    for (i = 0; i < st.num_decode; i++)
        if (run_item(e, s, device, &st.decode[i], jobs, n, pend, &n_pend) != 0) return -1;
    if (kvs_sched_complete(s, &st) != KVS_OK) return -1;
    for (i = 0; i < n_pend; i++) {
        job *j = pend[i].j;
        j->out[j->n_out++] = pend[i].token;
        if (kvs_sched_append(s, j->id, &pend[i].token, 1) != KVS_OK) return -1;
    }
    *out_idle = !st.num_prefill && !st.num_decode && kvs_sched_idle(s);
    return 0;
}

/* Serve jobs to the end; each keeps its sampled tokens, their logits and its cache hits. */
static int serve(engine *e, kvs_sched *s, kvb_pool *device, job *jobs, size_t n, uint64_t *steps)
{
    size_t i;
    int idle = 0, guard;
    for (i = 0; i < n; i++) {
        kvs_request rq;
        memset(&rq, 0, sizeof rq);
        rq.prompt = jobs[i].prompt;
        rq.num_prompt = jobs[i].n_prompt;
        rq.max_new_tokens = MAX_NEW;
        if (kvs_sched_add(s, &rq, &jobs[i].id) != KVS_OK) return -1;
    }
    for (guard = 0; !idle && guard < 10000; guard++, (*steps)++)
        if (serve_step(e, s, device, jobs, n, &idle) != 0) return -1;
    for (i = 0; i < n; i++) {
        kvs_slot_info si;
        if (kvs_sched_get_slot(s, jobs[i].id, &si) != KVS_OK || si.state != KVS_SLOT_FINISHED) return -1;
        if (kvs_sched_release(s, jobs[i].id) != KVS_OK) return -1;
    }
    return idle ? 0 : -1;
}

/* ---- the scenario ------------------------------------------------------------------------------- */

static const char SYSTEM_PROMPT[] = "You are a tiny model; every answer is one line.\n"; /* 48 bytes: 3 blocks */
static const char *const QUESTIONS[] = {"User: what is a KV cache?\n", "User: why share a prefix?\n",
                                        "User: where do old blocks go?\n"};

/* Byte tokens: the system prompt, then question q (q < 0: the system prompt alone). */
static void make_prompt(job *j, int q)
{
    const char *parts[2];
    size_t i, k;
    parts[0] = SYSTEM_PROMPT;
    parts[1] = q >= 0 ? QUESTIONS[q] : "";
    memset(j, 0, sizeof *j);
    for (k = 0; k < 2; k++)
        for (i = 0; parts[k][i] && j->n_prompt < MAX_PROMPT; i++) j->prompt[j->n_prompt++] = (unsigned char)parts[k][i];
}

enum { PHASES = 4, JOBS = 7 };

typedef struct phase {
    const char *title;
    int drop;         /* tiers dropped before it (G1, then G2) */
    int first, count; /* its jobs */
    uint64_t from_host, from_disk; /* blocks onboarded during it */
} phase;

typedef struct world {
    model m;
    engine e;
    tiers t;
    kvs_sched *sched;
    job *jobs;
    phase phases[PHASES];
    uint64_t steps;
} world;

/* Four phases on one scheduler: cold; the shared system prompt hits G1 (one request is the system
 * prompt alone: a full hit); G1 dropped, so blocks come back from G2; G1 and G2 dropped: from G3. */
static int run_scenario(world *w)
{
    static const int questions[JOBS] = {0, 1, 2, -1, 0, 2, 1};
    static const phase plan[PHASES] = {{"cold cache", 0, 0, 1, 0, 0},
                                       {"warm: the system prompt is cached in G1", 0, 1, 3, 0, 0},
                                       {"G1 dropped (kvb_pool_reset): blocks come back from G2, host", 1, 4, 2, 0, 0},
                                       {"G1 and G2 dropped: blocks come back from G3, disk", 2, 6, 1, 0, 0}};
    kvs_sched_config sc;
    int i, k;
    memset(&sc, 0, sizeof sc);
    sc.device = w->t.pool[0];
    sc.tiers = w->t.manager;
    sc.max_tokens = 48; /* a small step budget: long prompts prefill in chunks, as in a real engine */
    sc.offload = KVS_OFFLOAD_EAGER;
    if (kvs_sched_create(&sc, &w->sched) != KVS_OK) return -1;
    for (k = 0; k < JOBS; k++) make_prompt(&w->jobs[k], questions[k]);
    for (i = 0; i < PHASES; i++) {
        phase *ph = &w->phases[i];
        kvo_manager_stats before, after;
        *ph = plan[i];
        if (ph->drop && tiers_drop(&w->t, ph->drop) != 0) return -1;
        before = tiers_stats(&w->t);
        if (serve(&w->e, w->sched, w->t.pool[0], w->jobs + ph->first, (size_t)ph->count, &w->steps) != 0) return -1;
        after = tiers_stats(&w->t);
        ph->from_host = after.up[1].transferred - before.up[1].transferred;
        ph->from_disk = after.up[2].transferred - before.up[2].transferred;
    }
    kvs_sched_destroy(w->sched); /* every request's blocks go back: the pools can be checked empty */
    w->sched = NULL;
    return kvo_manager_drain(w->t.manager, 5000000) == KVO_OK ? 0 : -1;
}

static int world_open(world *w)
{
    memset(w, 0, sizeof *w);
    if (model_create(&w->m, WEIGHT_SEED) != 0 || !(w->jobs = (job *)calloc(JOBS, sizeof *w->jobs))) return -1;
    w->e.m = &w->m;
    return tiers_open(&w->t, 64, 128, 256);
}

static void world_close(world *w)
{
    kvs_sched_destroy(w->sched);
    tiers_close(&w->t);
    free(w->jobs);
    model_destroy(&w->m);
}

/* ---- normal mode: what happened ----------------------------------------------------------------- */

static void print_job(const job *j)
{
    size_t i;
    printf("  request %llu: prompt %2zu tokens, cached %2zu (device %2zu, lower tiers %2zu), generated:",
           (unsigned long long)j->id, j->n_prompt, j->cached, j->cached - j->lower, j->lower);
    for (i = 0; i < j->n_out; i++) printf(" %u", j->out[i]);
    printf("  \"");
    for (i = 0; i < j->n_out; i++) putchar(j->out[i] >= 32 && j->out[i] < 127 ? (int)j->out[i] : '.');
    printf("\"\n");
}

static void print_report(world *w)
{
    kvo_manager_stats s = tiers_stats(&w->t);
    kvo_disk_stats ds;
    int i, k;
    memset(&ds, 0, sizeof ds);
    kvo_disk_backend_stats(w->t.disk, &ds);
    printf("tiny_llm: %d layers, %d heads x %d dims (d_model %d), vocab %d (bytes), weights from seed 0x%llx\n",
           LAYERS, HEADS, HEAD_DIM, DIM, VOCAB, (unsigned long long)WEIGHT_SEED);
    printf("K/V cache: %d-token blocks of %d KiB (%d layers x K,V x %d KiB pages); G1 device 64 blocks, G2 host 128,"
           " G3 disk 256 (a temporary file, %s)\n",
           BLOCK, LAYERS * 2 * BLOCK * DIM * 4 / 1024, LAYERS, BLOCK * DIM * 4 / 1024,
           ds.direct_io ? "O_DIRECT" : "buffered I/O");
    for (i = 0; i < PHASES; i++) {
        const phase *ph = &w->phases[i];
        printf("phase %d: %s\n", i + 1, ph->title);
        for (k = 0; k < ph->count; k++) print_job(&w->jobs[ph->first + k]);
    }
    printf("totals: %llu steps, %llu tokens computed; blocks offloaded G1->G2 %llu, G2->G3 %llu;"
           " onboarded G2->G1 %llu, G3->G1 %llu\n",
           (unsigned long long)w->steps, (unsigned long long)w->e.computed, (unsigned long long)s.down[0].transferred,
           (unsigned long long)s.down[1].transferred, (unsigned long long)s.up[1].transferred,
           (unsigned long long)s.up[2].transferred);
}

/* ---- check mode --------------------------------------------------------------------------------- */

static int n_passed, n_failed;

static void report(int ok, const char *name, const char *detail)
{
    printf("%-4s %s: %s\n", ok ? "ok" : "FAIL", name, detail);
    if (ok) n_passed++;
    else n_failed++;
}

/* A job's logits against a from-scratch run of the same tokens: prompt + every fed-back sample. */
static int job_matches_reference(const model *m, const job *j)
{
    uint32_t tokens[MAX_PROMPT + MAX_NEW];
    float *ref;
    size_t n = j->n_prompt + j->n_out - 1;
    int same;
    if (j->n_out != MAX_NEW) return 0;
    memcpy(tokens, j->prompt, j->n_prompt * sizeof *tokens);
    memcpy(tokens + j->n_prompt, j->out, (j->n_out - 1) * sizeof *tokens);
    if (!(ref = (float *)malloc(j->n_out * VOCAB * sizeof *ref))) return 0;
    same = reference_logits(m, tokens, n, j->n_prompt - 1, ref) == 0 &&
           memcmp(ref, j->logits, j->n_out * VOCAB * sizeof *ref) == 0;
    free(ref);
    return same;
}

/* Check 1: every request of phases 1-2 equals its from-scratch run; at least the warm ones hit G1. */
static void check_device_hits(world *w)
{
    char detail[256];
    int k, hits = 0, equal = 0, total = w->phases[0].count + w->phases[1].count;
    size_t cached = 0;
    for (k = 0; k < total; k++) {
        const job *j = &w->jobs[k];
        equal += job_matches_reference(&w->m, j);
        hits += j->cached > 0;
        cached += j->cached;
    }
    snprintf(detail, sizeof detail,
             "%d requests, %d with a G1 prefix hit (%zu cached tokens), %d of %d with logits equal bit for bit to a "
             "from-scratch run", total, hits, cached, equal, total);
    report(equal == total && hits >= 3, "1. prefix hits on the device", detail);
    snprintf(detail, sizeof detail,
             "a fully cached prompt computes its last token in a block of its own: %llu token(s) written into a "
             "Registered (shared) block", (unsigned long long)w->e.rewrites);
    report(w->e.rewrites == 0 && w->e.rewrite_mismatch == 0, "1b. full prefix hit, no write into shared blocks", detail);
}

/* Check 2: a phase whose requests were loaded back from one lower tier equals from-scratch runs. */
static void check_onboard(world *w, int p, int from_disk, const char *name)
{
    const phase *ph = &w->phases[p];
    char detail[256];
    int k, equal = 0, lower = 0;
    size_t tokens = 0;
    uint64_t here = from_disk ? ph->from_disk : ph->from_host, other = from_disk ? ph->from_host : ph->from_disk;
    for (k = 0; k < ph->count; k++) {
        const job *j = &w->jobs[ph->first + k];
        equal += job_matches_reference(&w->m, j);
        lower += j->lower > 0;
        tokens += j->lower;
    }
    snprintf(detail, sizeof detail,
             "%d of %d requests with lower-tier hits (%zu tokens), %llu blocks onboarded from %s (%llu from the other "
             "tier), %d of %d with logits equal bit for bit", lower, ph->count, tokens, (unsigned long long)here,
             from_disk ? "G3" : "G2", (unsigned long long)other, equal, ph->count);
    report(lower == ph->count && here > 0 && other == 0 && equal == ph->count, name, detail);
}

/* Append a branch's tokens to a forked sequence and compute positions [from, to) of them. */
static int fork_compute(engine *e, kvb_pool *pool, kvb_seq *seq, size_t from, size_t to, float *logits,
                        size_t logits_from)
{
    const kvb_block *table;
    const uint32_t *tokens;
    size_t n_blocks, n_tokens;
    if (kvb_seq_blocks(seq, &table, &n_blocks) != KVB_OK || kvb_seq_tokens(seq, &tokens, &n_tokens) != KVB_OK ||
        to > n_tokens)
        return -1;
    return engine_run(e, pool, table, n_blocks, tokens, from, to, logits_from, logits);
}

enum { FORK_PROMPT = 40, FORK_MORE = 20, FORK_ROWS = FORK_MORE + 1 };

/* The fork's pieces: a prompt ending mid-block, two continuations, their logits (prompt end first). */
typedef struct fork_case {
    uint32_t tokens[2][FORK_PROMPT + FORK_MORE];
    float logits[2][FORK_ROWS * VOCAB];
    int shared_full, copied_partial;
} fork_case;

/* Prompt, fork, append both branches (the first append copies the shared partial block), then compute
 * the branches interleaved so that each one's writes would show in the other if they shared a page. */
static int fork_run(engine *e, kvb_pool *pool, fork_case *fc)
{
    kvb_seq *a = NULL, *b = NULL;
    const kvb_block *ta, *tb;
    size_t na, nb, cached = 1;
    int r = -1;
    if (kvb_seq_create(pool, NULL, &a) != KVB_OK) return -1;
    if (kvb_seq_append(a, fc->tokens[0], FORK_PROMPT, &cached) == KVB_OK && cached == 0 &&
        fork_compute(e, pool, a, 0, FORK_PROMPT, fc->logits[0], FORK_PROMPT - 1) == 0 &&
        kvb_seq_commit(a, FORK_PROMPT) == KVB_OK && kvb_seq_fork(a, &b) == KVB_OK &&
        kvb_seq_append(a, fc->tokens[0] + FORK_PROMPT, FORK_MORE, NULL) == KVB_OK &&
        kvb_seq_append(b, fc->tokens[1] + FORK_PROMPT, FORK_MORE, NULL) == KVB_OK &&
        kvb_seq_blocks(a, &ta, &na) == KVB_OK && kvb_seq_blocks(b, &tb, &nb) == KVB_OK) {
        memcpy(fc->logits[1], fc->logits[0], VOCAB * sizeof(float)); /* both branches share the prompt's end */
        fc->shared_full = ta[0].id == tb[0].id && ta[1].id == tb[1].id;
        fc->copied_partial = ta[2].id != tb[2].id;
        if (fork_compute(e, pool, a, FORK_PROMPT, FORK_PROMPT + 4, fc->logits[0], FORK_PROMPT - 1) == 0 &&
            fork_compute(e, pool, b, FORK_PROMPT, FORK_PROMPT + FORK_MORE, fc->logits[1], FORK_PROMPT - 1) == 0 &&
            fork_compute(e, pool, a, FORK_PROMPT + 4, FORK_PROMPT + FORK_MORE, fc->logits[0], FORK_PROMPT - 1) == 0 &&
            kvb_seq_commit(a, FORK_PROMPT + FORK_MORE) == KVB_OK && kvb_seq_commit(b, FORK_PROMPT + FORK_MORE) == KVB_OK)
            r = 0;
    }
    kvb_seq_destroy(b);
    kvb_seq_destroy(a);
    return r;
}

#ifdef TINY_LLM_CUDA
/* The fork check's pool on the GPU: kvcuda's device block copy, counted. */
typedef struct gpu_fork { kvc_context *ctx; unsigned copies; device_view view; } gpu_fork;

static int counted_device_copy(void *user, void *const *dst, const void *const *src, size_t n, uint64_t bytes)
{
    gpu_fork *g = (gpu_fork *)user;
    g->copies++;
    return kvc_copy_block(g->ctx, dst, src, n, bytes);
}

static int device_memcpy(void *user, void *dst, const void *src, size_t bytes)
{
    return kvc_memcpy((kvc_context *)user, dst, src, bytes) == KVC_OK ? 0 : -1;
}

/* A 16-block device pool for the fork check with a host mirror for the CPU model; 0 on success. */
static int gpu_fork_pool(gpu_fork *g, kvb_pool **out)
{
    kvb_pool_config pc;
    void *base = NULL;
    uint64_t bytes = 0;
    memset(&pc, 0, sizeof pc);
    if (kvs_model_preset(KVS_MODEL_TINY, KVB_LAYOUT_BLOCK_CONTIGUOUS, &pc.block_tokens, &pc.layout) != KVS_OK) return -1;
    pc.num_blocks = 16;
    pc.copy_block = counted_device_copy;
    pc.copy_user = g;
    if (kvc_pool_create(g->ctx, KVC_MEMORY_DEVICE, &pc, out) != KVC_OK) {
        fprintf(stderr, "tiny_llm: device pool: %s\n", kvc_last_error_message(g->ctx));
        return -1;
    }
    kvb_pool_storage(*out, &base, &bytes, &g->view.block_bytes, NULL);
    g->view.pool = *out;
    g->view.base = (unsigned char *)base;
    g->view.mirror = (unsigned char *)calloc(1, (size_t)bytes);
    g->view.copy = device_memcpy;
    g->view.copy_user = g->ctx;
    return g->view.mirror ? 0 : -1;
}
#endif

/* Check 3: two continuations of one prompt after kvb_seq_fork equal their from-scratch runs. gpu: a
 * kvc_context, the pool is then in its GPU memory (build/tiny_llm_cuda --gpu), else NULL. */
static void check_fork(const model *m, void *gpu)
{
    static const char *const more[2] = {"User: tell me a story", "User: count to twenty"};
    fork_case *fc = (fork_case *)calloc(1, sizeof *fc);
    float *ref = (float *)malloc(FORK_ROWS * VOCAB * sizeof *ref);
    engine e;
    kvb_pool *pool = NULL;
    char detail[256];
    int i, k, equal = 0, ran = 0;
    unsigned copies = 0;
    int made;
#ifdef TINY_LLM_CUDA
    gpu_fork g;
    memset(&g, 0, sizeof g);
    g.ctx = (kvc_context *)gpu;
#endif
    (void)gpu;
    memset(&e, 0, sizeof e);
    e.m = m;
#ifdef TINY_LLM_CUDA
    if (gpu) {
        made = gpu_fork_pool(&g, &pool) == 0;
        e.dev = &g.view;
    } else
#endif
        made = kv_pool_create(16, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_DUP_ALLOW, 0, &copies, &pool) == 0;
    if (fc && ref && made) {
        for (k = 0; k < 2; k++)
            for (i = 0; i < FORK_PROMPT + FORK_MORE; i++)
                fc->tokens[k][i] = (unsigned char)(i < FORK_PROMPT ? SYSTEM_PROMPT[i] : more[k][i - FORK_PROMPT]);
        ran = fork_run(&e, pool, fc) == 0;
#ifdef TINY_LLM_CUDA
        if (gpu) copies = g.copies;
#endif
        for (k = 0; ran && k < 2; k++)
            equal += reference_logits(m, fc->tokens[k], FORK_PROMPT + FORK_MORE, FORK_PROMPT - 1, ref) == 0 &&
                     memcmp(ref, fc->logits[k], FORK_ROWS * VOCAB * sizeof *ref) == 0;
    }
    snprintf(detail, sizeof detail,
             "%sprompt of %d tokens (ends mid-block), 2 branches of %d tokens computed interleaved; full blocks %s, "
             "partial block %s (%u copy through copy_block); %d of 2 branches with logits equal bit for bit to a "
             "from-scratch run",
             gpu ? "pool in GPU memory: " : "", FORK_PROMPT, FORK_MORE, fc && fc->shared_full ? "shared" : "NOT shared",
             fc && fc->copied_partial ? "copied on write" : "NOT copied", copies, equal);
    report(ran && equal == 2 && fc->shared_full && fc->copied_partial && copies == 1 &&
               kvb_pool_check(pool, NULL, 0) == KVB_OK,
           "3. fork with copy-on-write", detail);
#ifdef TINY_LLM_CUDA
    if (gpu) {
        kvc_pool_destroy(g.ctx, pool);
        free(g.view.mirror);
        pool = NULL;
    }
#endif
    kvb_pool_destroy(pool);
    free(ref);
    free(fc);
}

/* Check 4: after everything, every tier passes its invariant check and holds no referenced block. */
static void check_pools(world *w)
{
    char detail[256], why[160] = "";
    int i, ok = 1;
    uint32_t active = 0;
    for (i = 0; i < 3; i++) {
        kvb_pool_stats st;
        if (kvb_pool_check(w->t.pool[i], why, sizeof why) != KVB_OK || kvb_pool_get_stats(w->t.pool[i], &st) != KVB_OK)
            ok = 0;
        else
            active += st.active_blocks;
    }
    snprintf(detail, sizeof detail, "kvb_pool_check on G1, G2, G3: %s; %u blocks still referenced",
             ok ? "consistent" : why, active);
    report(ok && active == 0, "4. pools after the run", detail);
}

static int run_checks(world *w, void *gpu)
{
    check_device_hits(w);
    check_onboard(w, 2, 0, "2a. offloaded, evicted from G1, onboarded from host");
    check_onboard(w, 3, 1, "2b. offloaded, evicted from G1 and G2, onboarded from disk");
    check_fork(&w->m, gpu);
    check_pools(w);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}

int main(int argc, char **argv)
{
    world *w;
    void *gpu = NULL;
    int check = 0, want_gpu = 0, bad = 0, rc, i;
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--check") == 0) check = 1;
        else if (strcmp(argv[i], "--gpu") == 0) want_gpu = 1;
        else bad = 1;
    }
#ifndef TINY_LLM_CUDA
    bad |= want_gpu; /* --gpu needs build/tiny_llm_cuda */
#endif
    if (bad || (want_gpu && !check)) {
        fprintf(stderr, "usage: %s [--check]%s\n", argv[0],
#ifdef TINY_LLM_CUDA
                " | --check --gpu"
#else
                " (--gpu: build/tiny_llm_cuda, make build/tiny_llm_cuda)"
#endif
        );
        return 2;
    }
#ifdef TINY_LLM_CUDA
    if (want_gpu) {
        kvc_context *ctx = NULL;
        if (kvc_context_create(0, &ctx) != KVC_OK) {
            printf("FAIL no usable GPU: %s\n0 passed, 1 failed\n", kvc_last_error_message(ctx));
            kvc_context_destroy(ctx);
            return 1;
        }
        gpu = ctx;
    }
#endif
    if (!(w = (world *)calloc(1, sizeof *w))) return 2;
    if (world_open(w) != 0 || run_scenario(w) != 0) {
        fprintf(stderr, "tiny_llm: setup or serving failed%s%s\n", w->t.note[0] ? ": " : "", w->t.note);
        if (check) printf("FAIL serving the requests\n0 passed, 1 failed\n");
        rc = check ? 1 : 2;
    } else if (check) {
        rc = run_checks(w, gpu);
    } else {
        print_report(w);
        rc = 0;
    }
    world_close(w);
    free(w);
#ifdef TINY_LLM_CUDA
    kvc_context_destroy((kvc_context *)gpu);
#endif
    return rc;
}
