/* offload_fixtures.h — helpers shared by the kvoffload.h tests (include after kvoffload.h and kvtest.h).
 *
 * Pools with small pages (2 layers, 2 kv heads, head dim 8, 2-byte dtype: 512-byte pages, 2 KiB blocks),
 * block bytes derived from the block's hash so any copy can be checked anywhere, a manual clock for
 * poll mode, a test backend that wraps another one (counts and records every copy, fails the Nth copy or
 * every submit with a chosen error, or holds jobs until the test lets them go), and temp directories.
 * Everything is static inline so a test file pays only for what it uses. */
#ifndef KVO_OFFLOAD_FIXTURES_H
#define KVO_OFFLOAD_FIXTURES_H
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

enum { OF_LAYERS = 2, OF_HEADS = 2, OF_DIM = 8, OF_DTYPE = 2, OF_TOKENS = 16 };
#define OF_PAGE_BYTES ((uint64_t)OF_TOKENS * OF_HEADS * OF_DIM * OF_DTYPE)     /* 512 */
#define OF_BLOCK_BYTES (OF_PAGE_BYTES * OF_LAYERS * 2)                         /* 2048 */

/* ---- time ---------------------------------------------------------------------------------------- */

static inline uint64_t of_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static inline void of_sleep_us(uint64_t us)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(us / 1000000u);
    ts.tv_nsec = (long)(us % 1000000u) * 1000L;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* A hang is a failure, not a stuck build: after `seconds` the program says so and exits (run.sh then
 * reports it without a summary). Call first thing in main. */
static inline void of__watchdog_fired(int sig)
{
    static const char msg[] = "watchdog: the test program hung; giving up\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    (void)sig;
    _exit(3);
}

static inline void of_watchdog(unsigned seconds)
{
    signal(SIGALRM, of__watchdog_fired);
    alarm(seconds);
}

/* Runs body(arg) in a child process with stderr silenced, so that a crash (ASan, UBSan, a signal) fails
 * the calling test and not the whole program: the child exits with body's result, 0 when it passed;
 * `suspect` names the fault a failure points to. */
static inline void of_in_child(int (*body)(void *), void *arg, const char *suspect)
{
    pid_t pid;
    int status = 0;
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    KVT_CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) dup2(fd, 2);
        _exit(body(arg));
    }
    if (pid > 0) {
        KVT_EQ(waitpid(pid, &status, 0), pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            fprintf(stderr, "  child: %s %d (%s)\n", WIFEXITED(status) ? "exit" : "signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), suspect);
        KVT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
}

/* Two tiers, g1 over g2, copied both ways by a new inline memcpy backend (*mem), pipelines in poll mode:
 * the manager in *m (NULL when create failed: checked). */
static inline void of_memcpy_tiers(kvb_pool *g1, kvb_pool *g2, kvo_backend **mem, kvo_manager **m)
{
    kvo_manager_config mc;
    *m = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, mem), KVO_OK);
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 2;
    mc.pools[0] = g1;
    mc.pools[1] = g2;
    mc.down[0] = *mem;
    mc.up[1] = *mem;
    mc.pipeline.mode = KVO_MODE_POLL;
    KVT_EQ(kvo_manager_create(&mc, m), KVO_OK);
}

/* A manual clock for kvo_pipeline_config.clock: time moves only when the test says so. */
typedef struct of_clock {
    uint64_t now;
} of_clock;

static inline uint64_t of_clock_read(void *user) { return ((of_clock *)user)->now; }

/* ---- hashes and pools ---------------------------------------------------------------------------- */

#define OF_CHECK_POOL(pool)                                                          \
    do {                                                                             \
        char of__why[256] = "";                                                      \
        kvb_result of__r = kvb_pool_check((pool), of__why, sizeof of__why);          \
        if (of__r != KVB_OK) fprintf(stderr, "  pool check: %s\n", of__why);         \
        KVT_EQ(of__r, KVB_OK);                                                       \
    } while (0)

static inline int of_hash_eq(kvb_hash a, kvb_hash b) { return a.lo == b.lo && a.hi == b.hi; }

/* n chained block hashes of a prompt whose tokens are derived from `prompt` (distinct prompts give
 * distinct chains). */
static inline void of_chain(uint64_t prompt, size_t n, kvb_hash *out)
{
    uint32_t tokens[64 * OF_TOKENS];
    size_t got = 0;
    KVT_CHECK(n <= 64);
    if (n > 64) n = 64;
    for (size_t i = 0; i < n * OF_TOKENS; i++) tokens[i] = (uint32_t)(prompt * 7919u + i * 31u + 1u);
    KVT_EQ(kvb_hash_prompt(tokens, n * OF_TOKENS, OF_TOKENS, NULL, 0, prompt, out, n, &got), KVB_OK);
    KVT_EQ(got, n);
}

static inline kvb_layout of_layout(kvb_layout_kind kind)
{
    kvb_layout layout;
    memset(&layout, 0, sizeof layout);
    KVT_EQ(kvb_layout_for_model(kind, OF_TOKENS, OF_LAYERS, OF_HEADS, OF_DIM, OF_DTYPE, &layout), KVB_OK);
    return layout;
}

static inline kvb_pool *of_pool_from(const kvb_pool_config *cfg)
{
    kvb_pool *pool = NULL;
    KVT_EQ(kvb_pool_create(cfg, &pool), KVB_OK);
    return pool;
}

/* A pool with host storage in the given layout (the memory tiers G1 and G2). */
static inline kvb_pool *of_mem_pool(uint32_t num_blocks, kvb_layout_kind kind)
{
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = num_blocks;
    cfg.block_tokens = OF_TOKENS;
    cfg.storage = KVB_STORAGE_HOST;
    cfg.layout = of_layout(kind);
    return of_pool_from(&cfg);
}

/* A metadata-only pool (the disk tier, schedulers). */
static inline kvb_pool *of_meta_pool(uint32_t num_blocks)
{
    kvb_pool_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_blocks = num_blocks;
    cfg.block_tokens = OF_TOKENS;
    return of_pool_from(&cfg);
}

static inline kvb_pool_stats of_stats(kvb_pool *pool)
{
    kvb_pool_stats s;
    memset(&s, 0, sizeof s);
    KVT_EQ(kvb_pool_get_stats(pool, &s), KVB_OK);
    return s;
}

static inline uint32_t of_active(kvb_pool *pool) { return of_stats(pool).active_blocks; }

/* References currently held on the block a (weak or strong) handle names; UINT32_MAX when stale. */
static inline uint32_t of_refs(kvb_pool *pool, uint64_t id)
{
    kvb_block_info info;
    if (kvb_block_get_info(pool, id, &info) != KVB_OK) return UINT32_MAX;
    return info.refs;
}

/* How many of `hashes` the pool holds (each on its own, not only the prefix). */
static inline size_t of_present(kvb_pool *pool, const kvb_hash *hashes, size_t n)
{
    uint8_t present[256];
    size_t count = (size_t)-1;
    KVT_CHECK(n <= 256);
    KVT_EQ(kvb_presence(pool, hashes, n, present, &count), KVB_OK);
    return count;
}

static inline int of_has(kvb_pool *pool, kvb_hash h) { return of_present(pool, &h, 1) == 1; }

/* ---- block bytes --------------------------------------------------------------------------------- */

/* Byte j of page (layer, part) of the block whose hash is h. */
static inline unsigned char of_pattern(kvb_hash h, uint32_t layer, uint32_t part, uint64_t j)
{
    uint64_t x = h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)(layer * 2 + part) << 40) ^ (j * 0x2545f4914f6cdd1dull);
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (unsigned char)x;
}

/* Writes the pattern of hash h into every page of a block the caller references. */
static inline void of_fill(kvb_pool *pool, kvb_block b, kvb_hash h)
{
    for (uint32_t layer = 0; layer < OF_LAYERS; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            unsigned char *page = NULL;
            KVT_EQ(kvb_block_data(pool, b, layer, part, (void **)&page), KVB_OK);
            if (!page) return;
            for (uint64_t j = 0; j < OF_PAGE_BYTES; j++) page[j] = of_pattern(h, layer, part, j);
        }
}

/* 1 when every page of block b holds the pattern of h. */
static inline int of_bytes_ok(kvb_pool *pool, kvb_block b, kvb_hash h)
{
    for (uint32_t layer = 0; layer < OF_LAYERS; layer++)
        for (uint32_t part = 0; part < 2; part++) {
            unsigned char *page = NULL;
            if (kvb_block_data(pool, b, layer, part, (void **)&page) != KVB_OK || !page) return 0;
            for (uint64_t j = 0; j < OF_PAGE_BYTES; j++)
                if (page[j] != of_pattern(h, layer, part, j)) return 0;
        }
    return 1;
}

/* 1 when the pool holds h and its block carries the bytes of h; 0 when absent; -1 when the bytes differ.
 * Takes and drops a reference (kvb_match), so the block stays where it was. */
static inline int of_holds(kvb_pool *pool, kvb_hash h)
{
    kvb_block b;
    size_t n = 0;
    int ok;
    KVT_EQ(kvb_match(pool, &h, 1, &b, &n), KVB_OK);
    if (n != 1) return 0;
    ok = of_bytes_ok(pool, b, h) ? 1 : -1;
    KVT_EQ(kvb_release(pool, &b, 1, NULL), KVB_OK);
    return ok;
}

/* Count of hashes whose blocks are held with the right bytes. */
static inline size_t of_holds_all(kvb_pool *pool, const kvb_hash *hashes, size_t n)
{
    size_t good = 0;
    for (size_t i = 0; i < n; i++) good += of_holds(pool, hashes[i]) == 1;
    return good;
}

/* Registers n blocks with these hashes (chained: each names the previous as parent) and, when the pool
 * has storage, the bytes of their hashes. weak (may be NULL) gets a weak handle per block; strong (may
 * be NULL) keeps the references, otherwise they are released and the blocks stay cached, inactive. */
static inline void of_register(kvb_pool *pool, const kvb_hash *hashes, size_t n, kvb_block *strong, kvb_weak *weak)
{
    kvb_block b[64], out[64];
    kvb_hash parents[64];
    void *base = NULL;
    KVT_CHECK(n <= 64);
    if (n > 64) return;
    KVT_EQ(kvb_alloc(pool, n, b), KVB_OK);
    KVT_EQ(kvb_pool_storage(pool, &base, NULL, NULL, NULL), KVB_OK);
    for (size_t i = 0; i < n; i++) {
        if (i == 0) memset(&parents[0], 0, sizeof parents[0]);
        else parents[i] = hashes[i - 1];
        if (base) of_fill(pool, b[i], hashes[i]);
    }
    KVT_EQ(kvb_register_hashed(pool, b, n, hashes, parents, out), KVB_OK);
    for (size_t i = 0; i < n; i++) {
        if (weak) weak[i] = kvb_weak_of(out[i]);
        if (strong) strong[i] = out[i];
    }
    if (!strong) KVT_EQ(kvb_release(pool, out, n, NULL), KVB_OK);
}

/* Hash of the block a live (weak or strong) handle names. */
static inline kvb_hash of_hash_of(kvb_pool *pool, uint64_t id)
{
    kvb_block_info info;
    memset(&info, 0, sizeof info);
    KVT_EQ(kvb_block_get_info(pool, id, &info), KVB_OK);
    return info.hash;
}

/* Holds a scattered set of blocks (about every other one, chosen by seed) active, so that blocks the
 * library allocates next land at unordered indices; returns how many were taken (release them later). */
static inline size_t of_scatter(kvb_pool *pool, uint32_t num_blocks, uint64_t seed, kvb_block *held)
{
    kvb_block all[256];
    size_t kept = 0, back = 0;
    kvb_block give[256];
    KVT_CHECK(num_blocks <= 256);
    KVT_EQ(kvb_alloc(pool, num_blocks, all), KVB_OK);
    for (uint32_t i = 0; i < num_blocks; i++) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        if (seed & 1) held[kept++] = all[i];
        else give[back++] = all[i];
    }
    /* shuffle what goes back, so the free list order is not the index order either */
    for (size_t i = back; i > 1; i--) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        size_t j = (size_t)(seed % i);
        kvb_block t = give[i - 1];
        give[i - 1] = give[j];
        give[j] = t;
    }
    for (size_t i = 0; i < back; i++) KVT_EQ(kvb_release(pool, &give[i], 1, NULL), KVB_OK);
    return kept;
}

/* ---- pipelines ----------------------------------------------------------------------------------- */

static inline int of_final(kvo_status s)
{
    return s == KVO_STATUS_COMPLETE || s == KVO_STATUS_CANCELLED || s == KVO_STATUS_FAILED;
}

/* A config with every field zero (defaults) but these. clock may be NULL (real time). */
static inline kvo_pipeline_config of_config(kvb_pool *src, kvb_pool *dst, kvo_backend *backend, kvo_mode mode,
                                            of_clock *clock)
{
    kvo_pipeline_config pc;
    memset(&pc, 0, sizeof pc);
    pc.src = src;
    pc.dst = dst;
    pc.backend = backend;
    pc.mode = mode;
    if (clock) {
        pc.clock = of_clock_read;
        pc.clock_user = clock;
    }
    return pc;
}

static inline kvo_pipeline *of_pipeline(const kvo_pipeline_config *pc)
{
    kvo_pipeline *p = NULL;
    KVT_EQ(kvo_pipeline_create(pc, &p), KVO_OK);
    return p;
}

static inline kvo_transfer_info of_info(kvo_pipeline *p, kvo_transfer t)
{
    kvo_transfer_info info;
    memset(&info, 0, sizeof info);
    KVT_EQ(kvo_transfer_get_info(p, t, &info), KVO_OK);
    return info;
}

static inline kvo_status of_status(kvo_pipeline *p, kvo_transfer t) { return of_info(p, t).status; }

/* Enqueue that must be accepted. opts may be NULL. */
static inline kvo_transfer of_enqueue(kvo_pipeline *p, const kvb_weak *blocks, size_t n, const kvo_enqueue_opts *opts)
{
    kvo_transfer t;
    memset(&t, 0, sizeof t);
    KVT_EQ(kvo_enqueue(p, blocks, n, opts, &t), KVO_OK);
    return t;
}

/* Poll mode: `polls` rounds of kvo_pipeline_poll, the manual clock (may be NULL) moving step_us after
 * each. */
static inline void of_polls(kvo_pipeline *p, of_clock *clock, uint64_t step_us, int polls)
{
    for (int i = 0; i < polls; i++) {
        KVT_EQ(kvo_pipeline_poll(p), KVO_OK);
        if (clock) clock->now += step_us;
    }
}

/* Poll mode: poll (moving the clock step_us each round) until the transfer is final, at most max_polls
 * rounds; returns the status then. While the transfer sits in a backend with worker threads
 * (Transferring), rounds wait a little real time and do not count (up to 20 s in all). */
static inline kvo_status of_pump(kvo_pipeline *p, of_clock *clock, kvo_transfer t, uint64_t step_us, int max_polls)
{
    kvo_status s = of_status(p, t);
    uint64_t give_up = of_now_us() + 20000000;
    for (int i = 0; i < max_polls && !of_final(s);) {
        KVT_EQ(kvo_pipeline_poll(p), KVO_OK);
        s = of_status(p, t);
        if (s == KVO_STATUS_TRANSFERRING && of_now_us() < give_up) {
            of_sleep_us(200);
            continue;
        }
        if (clock) clock->now += step_us;
        i++;
    }
    return s;
}

/* ---- a test backend wrapping another ------------------------------------------------------------- */

#define OF_MAX_SEEN 4096
#define OF_MAX_HELD 64

typedef struct of_copy {
    kvb_pool *src, *dst;
    uint32_t src_idx, dst_idx;
    kvb_hash hash; /* zero when the job carried no hashes */
} of_copy;

typedef struct of_held {
    kvo_copy_job *job;
    size_t fail_i;
} of_held;

typedef struct of_backend {
    kvo_backend base; /* what pipelines get: of_backend_iface(w) */
    kvo_backend *inner;
    pthread_mutex_t mu;
    /* settings (change under of_backend_set_* or before use) */
    uint64_t fail_at;   /* fail the fail_at-th copy ever submitted (1-based), 0 = never */
    int fail_error;
    int submit_error;   /* nonzero: refuse every job with it */
    int hold;           /* keep jobs until of_backend_release */
    /* what happened */
    uint64_t copies;    /* copies in accepted jobs */
    uint64_t jobs;      /* accepted jobs */
    uint64_t jobs_done; /* done callbacks passed on */
    uint64_t refused;   /* jobs refused with submit_error */
    of_copy seen[OF_MAX_SEEN];
    size_t n_seen;
    kvb_hash failed_hash; /* the hash of the copy failed on purpose */
    of_held held[OF_MAX_HELD];
    size_t n_held;
} of_backend;

typedef struct of__wrap {
    kvo_copy_job job;
    kvo_copy_job *outer;
    of_backend *w;
    size_t fail_i;
} of__wrap;

static inline void of__wrap_done(kvo_copy_job *job, int result, const char *message)
{
    of__wrap *wrap = (of__wrap *)job->user;
    kvo_copy_job *outer = wrap->outer;
    of_backend *w = wrap->w;
    size_t fail_i = wrap->fail_i;
    int fail_error;
    outer->bytes = job->bytes;
    pthread_mutex_lock(&w->mu);
    fail_error = w->fail_error;
    w->jobs_done++;
    pthread_mutex_unlock(&w->mu);
    free(wrap);
    if (fail_i != SIZE_MAX) {
        outer->results[fail_i] = fail_error;
        result = fail_error;
        message = "injected fault";
    }
    outer->done(outer, result, message);
}

/* Hands a job (already counted) to the inner backend, failing copy fail_i (SIZE_MAX = none). */
static inline int of__forward(of_backend *w, kvo_copy_job *job, size_t fail_i)
{
    of__wrap *wrap = (of__wrap *)malloc(sizeof *wrap);
    int r;
    if (!wrap) return KVO_ENOMEM;
    wrap->job = *job;
    wrap->job.done = of__wrap_done;
    wrap->job.user = wrap;
    wrap->job.bytes = 0;
    wrap->outer = job;
    wrap->w = w;
    wrap->fail_i = fail_i;
    r = w->inner->submit(w->inner, &wrap->job);
    if (r != 0) free(wrap);
    return r;
}

static inline int of__submit(kvo_backend *self, kvo_copy_job *job)
{
    of_backend *w = (of_backend *)self->impl;
    size_t fail_i = SIZE_MAX;
    int hold;
    pthread_mutex_lock(&w->mu);
    if (w->submit_error) {
        int e = w->submit_error;
        w->refused++;
        pthread_mutex_unlock(&w->mu);
        return e;
    }
    w->jobs++;
    for (size_t i = 0; i < job->n; i++) {
        w->copies++;
        if (w->fail_at && w->copies == w->fail_at) {
            fail_i = i;
            if (job->hashes) w->failed_hash = job->hashes[i];
        }
        if (w->n_seen < OF_MAX_SEEN) {
            of_copy *c = &w->seen[w->n_seen++];
            c->src = job->src;
            c->dst = job->dst;
            c->src_idx = job->src_idx[i];
            c->dst_idx = job->dst_idx[i];
            if (job->hashes) c->hash = job->hashes[i];
            else memset(&c->hash, 0, sizeof c->hash);
        }
    }
    hold = w->hold && w->n_held < OF_MAX_HELD;
    if (hold) {
        w->held[w->n_held].job = job;
        w->held[w->n_held].fail_i = fail_i;
        w->n_held++;
    }
    pthread_mutex_unlock(&w->mu);
    if (hold) return KVO_OK;
    return of__forward(w, job, fail_i);
}

static inline void of__destroy(kvo_backend *self)
{
    of_backend *w = (of_backend *)self->impl;
    pthread_mutex_destroy(&w->mu);
    free(w);
}

/* A wrapper around inner (which the test keeps and destroys itself, after the wrapper). */
static inline of_backend *of_backend_wrap(kvo_backend *inner)
{
    of_backend *w = (of_backend *)calloc(1, sizeof *w);
    KVT_CHECK(w != NULL);
    if (!w) return NULL;
    w->inner = inner;
    pthread_mutex_init(&w->mu, NULL);
    w->base.submit = of__submit;
    w->base.destroy = of__destroy;
    w->base.name = "test-wrapper";
    w->base.impl = w;
    return w;
}

static inline kvo_backend *of_backend_iface(of_backend *w) { return &w->base; }

static inline void of_backend_set_fail(of_backend *w, uint64_t fail_at, int error)
{
    pthread_mutex_lock(&w->mu);
    w->fail_at = fail_at;
    w->fail_error = error;
    pthread_mutex_unlock(&w->mu);
}

static inline void of_backend_set_submit_error(of_backend *w, int error)
{
    pthread_mutex_lock(&w->mu);
    w->submit_error = error;
    pthread_mutex_unlock(&w->mu);
}

static inline void of_backend_set_hold(of_backend *w, int hold)
{
    pthread_mutex_lock(&w->mu);
    w->hold = hold;
    pthread_mutex_unlock(&w->mu);
}

static inline size_t of_backend_held(of_backend *w)
{
    size_t n;
    pthread_mutex_lock(&w->mu);
    n = w->n_held;
    pthread_mutex_unlock(&w->mu);
    return n;
}

/* Waits (really, up to timeout_us) until at least n jobs are held; returns how many are. */
static inline size_t of_backend_wait_held(of_backend *w, size_t n, uint64_t timeout_us)
{
    uint64_t end = of_now_us() + timeout_us;
    size_t held;
    while ((held = of_backend_held(w)) < n && of_now_us() < end) of_sleep_us(1000);
    return held;
}

/* Lets every held job go to the inner backend (their done callbacks run now or from its workers). */
static inline void of_backend_release(of_backend *w)
{
    of_held jobs[OF_MAX_HELD];
    size_t n;
    pthread_mutex_lock(&w->mu);
    n = w->n_held;
    memcpy(jobs, w->held, n * sizeof jobs[0]);
    w->n_held = 0;
    pthread_mutex_unlock(&w->mu);
    for (size_t i = 0; i < n; i++) {
        int r = of__forward(w, jobs[i].job, jobs[i].fail_i);
        if (r != 0) {
            for (size_t k = 0; k < jobs[i].job->n; k++) jobs[i].job->results[k] = r;
            jobs[i].job->done(jobs[i].job, r, "inner backend refused a held job");
        }
    }
}

static inline uint64_t of_backend_copies(of_backend *w)
{
    uint64_t n;
    pthread_mutex_lock(&w->mu);
    n = w->copies;
    pthread_mutex_unlock(&w->mu);
    return n;
}

/* Copies submitted so far whose source was block `index` of pool `src`. */
static inline size_t of_backend_saw_src(of_backend *w, kvb_pool *src, uint32_t index)
{
    size_t count = 0;
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; i < w->n_seen; i++) count += w->seen[i].src == src && w->seen[i].src_idx == index;
    pthread_mutex_unlock(&w->mu);
    return count;
}

/* Copies submitted so far from any of these (weak or strong) source handles. */
static inline size_t of_backend_saw_any(of_backend *w, kvb_pool *src, const kvb_weak *blocks, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += of_backend_saw_src(w, src, kvb_block_index(blocks[i].id));
    return count;
}

/* Position (0-based) of the first copy of hash h among all copies submitted, or -1. */
static inline long of_backend_position(of_backend *w, kvb_hash h)
{
    long pos = -1;
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; i < w->n_seen && pos < 0; i++)
        if (of_hash_eq(w->seen[i].hash, h)) pos = (long)i;
    pthread_mutex_unlock(&w->mu);
    return pos;
}

/* ---- files --------------------------------------------------------------------------------------- */

/* A fresh directory /tmp/kvtest-XXXXXX in buf (size >= 32); 0 on failure. */
static inline int of_tmpdir(char *buf, size_t size)
{
    if (size < 32) return 0;
    snprintf(buf, size, "/tmp/kvtest-XXXXXX");
    return mkdtemp(buf) != NULL;
}

/* Reads len bytes at offset of a file; 1 on success. */
static inline int of_file_read(const char *path, uint64_t offset, void *buf, size_t len)
{
    FILE *f = fopen(path, "rb");
    int ok;
    if (!f) return 0;
    ok = fseeko(f, (off_t)offset, SEEK_SET) == 0 && fread(buf, 1, len, f) == len;
    fclose(f);
    return ok;
}

#endif
