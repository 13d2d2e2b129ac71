/* test_cuda.c — the GPU tier (kvcuda.h / kvcuda.cu).
 *
 * Without a device every GPU test prints one line "skip ...: skipped: no CUDA device" and counts as
 * skipped; the error-path tests (no device, NULL arguments, result strings) run everywhere.
 * With a device: round trips device -> pinned -> device for both layouts (and a mix) with random block
 * ids, byte-compared, by DMA, by the kernel and by the automatic choice; an offload waiting on a CUDA
 * event behind a slow kernel; cancel before the upgrade copies nothing; many small scattered copies in
 * one kernel job equal the same copies done one job each; per-copy errors; fork and copy-on-write of
 * sequences on a device pool; the tier manager taking blocks down to pinned memory and back; one
 * backend shared by four submitting threads. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvcuda.h"
#include "../kvtest.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

/* from test_kernels.cu */
unsigned char kvct_byte(unsigned seed, unsigned long long i);
int kvct_slow_fill(void *dst, unsigned long long bytes, unsigned seed, long long spin_cycles, void *stream);
int kvct_clock_khz(void);
int kvct_leave_error(void);
int kvct_take_error(void);
void *kvct_capture_begin(void);
int kvct_capture_end(void *stream);

static void watchdog_fired(int sig)
{
    static const char msg[] = "watchdog: test_cuda hung; giving up\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    (void)sig;
    _exit(3);
}

static kvc_context *gpu_or_null(void)
{
    kvc_context *ctx = NULL;
    if (kvc_context_create(0, &ctx) == KVC_OK) return ctx;
    kvc_context_destroy(ctx);
    return NULL;
}

#define NEED_GPU(ctx)                                 \
    kvc_context *ctx = gpu_or_null();                 \
    if (!ctx) KVT_SKIP("no CUDA device")

/* xorshift: reproducible random ids and bytes */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* k arrays of n distinct random ids (ids[j][i] < limits[j]) with the same run structure: chunks of 1..4
 * pairs that are consecutive in every array (about a third of the chunks are longer than 1), so merging
 * has something to merge. Returns the number of chunks. */
static size_t random_runs(uint64_t *seed, const uint32_t *limits, uint32_t **ids, int k, size_t n)
{
    unsigned char *used[3];
    size_t filled = 0, chunks = 0;
    for (int j = 0; j < k; j++) used[j] = (unsigned char *)calloc(limits[j], 1);
    while (filled < n) {
        size_t r = rng_next(seed) % 3 == 0 ? 2 + rng_next(seed) % 3 : 1;
        uint32_t start[3];
        if (r > n - filled) r = n - filled;
        for (int j = 0; j < k; j++) {
            for (int tries = 0;; tries++) {
                if (tries > 1000) r = 1; /* crowded: a single free id always exists (n < limit) */
                uint32_t s0 = (uint32_t)(rng_next(seed) % (limits[j] - r + 1));
                size_t f = 0;
                while (f < r && !used[j][s0 + f]) f++;
                if (f == r) {
                    start[j] = s0;
                    break;
                }
            }
        }
        for (int j = 0; j < k; j++) /* r may have shrunk after earlier arrays chose: still free */
            for (size_t f = 0; f < r; f++) {
                used[j][start[j] + f] = 1;
                ids[j][filled + f] = start[j] + (uint32_t)f;
            }
        filled += r;
        chunks++;
    }
    for (int j = 0; j < k; j++) free(used[j]);
    return chunks;
}

/* ---- waiting for a job ------------------------------------------------------------------------- */

typedef struct waiter {
    pthread_mutex_t m;
    pthread_cond_t c;
    int done, result, calls;
    char message[256];
} waiter;

static void job_done(kvo_copy_job *job, int result, const char *message)
{
    waiter *w = (waiter *)job->user;
    pthread_mutex_lock(&w->m);
    w->done = 1;
    w->calls++;
    w->result = result;
    snprintf(w->message, sizeof w->message, "%s", message ? message : "");
    pthread_cond_signal(&w->c);
    pthread_mutex_unlock(&w->m);
}

/* Submit a job src -> dst and wait for its done, without the test macros (submitting threads call it):
 * *submitted gets the submit's result, *calls the done calls seen; returns the job's overall result (the
 * submit's error when it failed). bytes and message may be NULL. */
static int submit_wait(kvo_backend *be, kvb_pool *src, kvb_pool *dst, const uint32_t *si, const uint32_t *di,
                       size_t n, int *results, int *submitted, int *calls, uint64_t *bytes, char *message)
{
    waiter w;
    kvo_copy_job job;
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.m, NULL);
    pthread_cond_init(&w.c, NULL);
    memset(&job, 0, sizeof job);
    job.src = src;
    job.dst = dst;
    job.src_idx = si;
    job.dst_idx = di;
    job.n = n;
    job.results = results;
    job.done = job_done;
    job.user = &w;
    int r = *submitted = be->submit(be, &job);
    if (r == KVO_OK) {
        pthread_mutex_lock(&w.m);
        while (!w.done) pthread_cond_wait(&w.c, &w.m);
        pthread_mutex_unlock(&w.m);
        r = w.result;
    }
    *calls = w.calls;
    if (bytes) *bytes = job.bytes;
    if (message) snprintf(message, 256, "%s", w.message);
    pthread_mutex_destroy(&w.m);
    pthread_cond_destroy(&w.c);
    return r;
}

/* Submit a job src -> dst and wait for its done; returns the job's overall result. */
static int run_job(kvo_backend *be, kvb_pool *src, kvb_pool *dst, const uint32_t *si, const uint32_t *di, size_t n,
                   int *results, uint64_t *bytes, char *message)
{
    int submitted = 0, calls = 0, r;
    for (size_t i = 0; i < n; i++) results[i] = KVO_EBACKEND;
    r = submit_wait(be, src, dst, si, di, n, results, &submitted, &calls, bytes, message);
    KVT_EQ(submitted, KVO_OK);
    if (submitted == KVO_OK) KVT_EQ(calls, 1);
    return r;
}

/* ---- pools ------------------------------------------------------------------------------------- */

static kvb_layout layout_of(kvb_layout_kind kind, uint32_t layers, uint64_t page)
{
    kvb_layout l;
    memset(&l, 0, sizeof l);
    l.kind = kind;
    l.num_layers = layers;
    l.num_parts = 2;
    l.page_bytes = page;
    return l;
}

static kvb_pool *make_pool(kvc_context *ctx, kvc_memory where, uint32_t blocks, kvb_layout layout)
{
    kvb_pool_config c;
    kvb_pool *p = NULL;
    memset(&c, 0, sizeof c);
    c.num_blocks = blocks;
    c.block_tokens = 16;
    c.layout = layout;
    kvc_result r = kvc_pool_create(ctx, where, &c, &p);
    if (r != KVC_OK) fprintf(stderr, "  kvc_pool_create: %s: %s\n", kvc_result_string(r), kvc_last_error_message(ctx));
    KVT_EQ(r, KVC_OK);
    return p;
}

/* The whole storage of a pool, copied to a new host buffer. */
static unsigned char *snapshot(kvc_context *ctx, kvb_pool *pool, uint64_t *bytes)
{
    void *base = NULL;
    KVT_EQ(kvb_pool_storage(pool, &base, bytes, NULL, NULL), KVB_OK);
    unsigned char *h = (unsigned char *)malloc((size_t)*bytes);
    KVT_EQ(kvc_memcpy(ctx, h, base, (size_t)*bytes), KVC_OK);
    return h;
}

static uint32_t num_blocks_of(kvb_pool *pool)
{
    kvb_pool_config c;
    memset(&c, 0, sizeof c);
    kvb_pool_get_config(pool, &c);
    return c.num_blocks;
}

/* Every (layer, part) page of src block si in snapshot a equals dst block di in snapshot b. */
static int same_block(const unsigned char *a, kvb_pool *pa, uint32_t si, const unsigned char *b, kvb_pool *pb,
                      uint32_t di)
{
    kvb_layout la, lb;
    kvb_pool_storage(pa, NULL, NULL, NULL, &la);
    kvb_pool_storage(pb, NULL, NULL, NULL, &lb);
    uint32_t na = num_blocks_of(pa), nb = num_blocks_of(pb);
    for (uint32_t l = 0; l < la.num_layers; l++)
        for (uint32_t q = 0; q < la.num_parts; q++)
            if (memcmp(a + kvb_layout_offset(&la, na, si, l, q), b + kvb_layout_offset(&lb, nb, di, l, q),
                       (size_t)la.page_bytes) != 0)
                return 0;
    return 1;
}

/* Fill a device pool's storage with random bytes. */
static void fill_random(kvc_context *ctx, kvb_pool *pool, uint64_t seed)
{
    void *base = NULL;
    uint64_t bytes = 0;
    KVT_EQ(kvb_pool_storage(pool, &base, &bytes, NULL, NULL), KVB_OK);
    unsigned char *h = (unsigned char *)malloc((size_t)bytes);
    for (uint64_t i = 0; i < bytes; i++) h[i] = (unsigned char)(rng_next(&seed) >> 29);
    KVT_EQ(kvc_memcpy(ctx, base, h, (size_t)bytes), KVC_OK);
    free(h);
}

/* ---- tests that run everywhere ----------------------------------------------------------------- */

static void test_result_strings(void)
{
    KVT_CHECK(strcmp(kvc_result_string(KVC_OK), "ok") == 0);
    KVT_CHECK(strcmp(kvc_result_string(KVC_ENODEVICE), "no CUDA device") == 0);
    KVT_CHECK(strstr(kvc_result_string(KVC_ENODRIVER), "driver") != NULL);
    KVT_CHECK(strstr(kvc_result_string(KVC_ENOMEM), "memory") != NULL);
    for (int r = KVC__RESULT_MIN + 1; r <= KVC_EINVAL; r++)
        KVT_CHECK(strcmp(kvc_result_string(r), kvo_result_string(0x7fff)) != 0);
    KVT_CHECK(strcmp(kvc_result_string(KVO_EPRECOND), kvo_result_string(KVO_EPRECOND)) == 0);
    KVT_CHECK(strcmp(kvc_result_string(KVB_ERANGE), kvb_result_string(KVB_ERANGE)) == 0);
}

/* Where there is no device, kvc_context_create says so with a message; where there is one, an index
 * past the last device does. Either way the failed context answers every call with its error. */
static void test_no_device_error(void)
{
    kvc_probe_info p;
    kvc_result pr = kvc_probe(&p);
    KVT_CHECK(pr == KVC_OK || pr == KVC_ENODRIVER || pr == KVC_ENODEVICE);
    KVT_CHECK(p.runtime_version > 0);
    if (pr != KVC_OK) {
        KVT_EQ(p.device_count, 0);
        KVT_CHECK(p.message[0] != 0);
    }
    int indices[2] = {pr == KVC_OK ? p.device_count : 0, -1};
    for (int k = 0; k < 2; k++) {
        kvc_context *ctx = NULL;
        KVT_EQ(kvc_context_create(indices[k], &ctx), KVC_ENODEVICE);
        KVT_CHECK(ctx != NULL);
        if (!ctx) continue;
        const char *msg = kvc_last_error_message(ctx);
        KVT_CHECK(strstr(msg, "no CUDA device") != NULL);
        if (pr != KVC_OK && k == 0) KVT_CHECK(strstr(msg, p.message) != NULL); /* the cause is named */
        char copy[512];
        KVT_EQ(kvc_copy_error_message(ctx, copy, sizeof copy), strlen(msg));
        KVT_CHECK(strcmp(copy, msg) == 0);
        KVT_EQ(kvc_context_status(ctx), KVC_ENODEVICE);
        void *ptr = NULL;
        kvo_backend *be = NULL;
        kvc_event *ev = NULL;
        kvc_device_info info;
        kvc_memory kind;
        KVT_EQ(kvc_device_alloc(ctx, 4096, &ptr), KVC_ENODEVICE);
        KVT_EQ(kvc_pinned_alloc(ctx, 4096, &ptr), KVC_ENODEVICE);
        KVT_CHECK(ptr == NULL);
        KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_ENODEVICE);
        KVT_CHECK(be == NULL);
        KVT_EQ(kvc_event_create(ctx, &ev), KVC_ENODEVICE);
        KVT_EQ(kvc_get_device_info(ctx, &info), KVC_ENODEVICE);
        KVT_EQ(kvc_memory_kind(ctx, copy, &kind), KVC_ENODEVICE);
        KVT_EQ(kvc_synchronize(ctx), KVC_ENODEVICE);
        KVT_CHECK(kvc_stream(ctx, KVC_D2H) == NULL);
        kvb_pool_config c;
        memset(&c, 0, sizeof c);
        c.num_blocks = 4;
        c.layout = layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 1, 256);
        kvb_pool *pool = NULL;
        KVT_EQ(kvc_pool_create(ctx, KVC_MEMORY_DEVICE, &c, &pool), KVC_ENODEVICE);
        KVT_EQ(kvc_device_free(ctx, copy), KVC_ENOTFOUND);
        KVT_CHECK(strstr(kvc_last_error_message(ctx), "not device memory") != NULL);
        kvc_context_destroy(ctx);
    }
}

static void test_null_arguments(void)
{
    kvc_context *failed = NULL;
    void *ptr = NULL;
    kvo_backend *be = NULL;
    kvc_event *ev = NULL;
    kvb_pool *pool = NULL;
    kvb_pool_config c;
    kvc_backend_stats st;
    kvc_device_info info;
    kvc_memory kind;
    memset(&c, 0, sizeof c);
    c.num_blocks = 4;
    c.layout = layout_of(KVB_LAYOUT_LAYER_SEPARATE, 2, 256);
    KVT_EQ(kvc_probe(NULL), KVC_EINVAL);
    KVT_EQ(kvc_context_create(0, NULL), KVC_EINVAL);
    KVT_EQ(kvc_context_status(NULL), KVC_EINVAL);
    KVT_CHECK(strcmp(kvc_last_error_message(NULL), "no context") == 0);
    kvc_context_destroy(NULL);
    KVT_EQ(kvc_get_device_info(NULL, &info), KVC_EINVAL);
    KVT_CHECK(kvc_stream(NULL, KVC_H2D) == NULL);
    KVT_EQ(kvc_synchronize(NULL), KVC_EINVAL);
    KVT_EQ(kvc_device_alloc(NULL, 4096, &ptr), KVC_EINVAL);
    KVT_EQ(kvc_device_free(NULL, &c), KVC_EINVAL);
    KVT_EQ(kvc_pinned_alloc(NULL, 4096, &ptr), KVC_EINVAL);
    KVT_EQ(kvc_pinned_free(NULL, &c), KVC_EINVAL);
    KVT_EQ(kvc_memory_kind(NULL, &c, &kind), KVC_EINVAL);
    KVT_EQ(kvc_memcpy(NULL, &c, &c, sizeof c), KVC_EINVAL);
    KVT_EQ(kvc_pool_storage_alloc(NULL, KVC_MEMORY_DEVICE, &c), KVC_EINVAL);
    KVT_EQ(kvc_pool_create(NULL, KVC_MEMORY_DEVICE, &c, &pool), KVC_EINVAL);
    KVT_EQ(kvc_pool_destroy(NULL, pool), KVC_EINVAL);
    KVT_EQ(kvc_event_create(NULL, &ev), KVC_EINVAL);
    KVT_EQ(kvc_event_record(NULL, NULL), KVC_EINVAL);
    KVT_CHECK(kvc_event_query(NULL) < 0);
    KVT_CHECK(kvc_event_precondition(NULL) == NULL);
    kvc_event_destroy(NULL);
    KVT_EQ(kvc_backend_create(NULL, NULL, &be), KVC_EINVAL);
    KVT_EQ(kvc_backend_get_stats(NULL, &st), KVC_EINVAL);
    kvo_backend *mc = NULL;
    KVT_EQ(kvo_memcpy_backend_create(0, &mc), KVO_OK);
    KVT_EQ(kvc_backend_get_stats(mc, &st), KVC_EINVAL); /* not a kvcuda backend */
    kvo_backend_destroy(mc);

    /* with a context (usable or failed): NULL outs and bad values are KVC_EINVAL, with a message */
    kvc_context_create(0, &failed);
    KVT_CHECK(failed != NULL);
    KVT_EQ(kvc_device_alloc(failed, 4096, NULL), KVC_EINVAL);
    KVT_EQ(kvc_device_alloc(failed, 0, &ptr), KVC_EINVAL);
    KVT_EQ(kvc_pinned_alloc(failed, 4096, NULL), KVC_EINVAL);
    KVT_EQ(kvc_backend_create(failed, NULL, NULL), KVC_EINVAL);
    KVT_EQ(kvc_event_create(failed, NULL), KVC_EINVAL);
    KVT_EQ(kvc_memcpy(failed, NULL, &c, 1), KVC_EINVAL);
    KVT_EQ(kvc_pool_storage_alloc(failed, KVC_MEMORY_HOST, &c), KVC_EINVAL);
    KVT_EQ(kvc_pool_storage_alloc(failed, KVC_MEMORY_DEVICE, NULL), KVC_EINVAL);
    KVT_EQ(kvc_pool_create(failed, KVC_MEMORY_PINNED, NULL, &pool), KVC_EINVAL);
    KVT_CHECK(strlen(kvc_last_error_message(failed)) > 0);
    KVT_EQ(kvc_pool_destroy(failed, NULL), KVC_OK);
    kvc_context_destroy(failed);
}

/* Section 5: every failure writes a one-line message on the context, a NULL argument's too (a failed
 * context serves: the argument checks come first). Runs without a GPU. */
static void test_null_argument_messages(void)
{
    kvc_context *ctx = NULL;
    KVT_EQ(kvc_context_create(-1, &ctx), KVC_ENODEVICE);
    KVT_CHECK(ctx != NULL);
    if (!ctx) return;
    KVT_EQ(kvc_get_device_info(ctx, NULL), KVC_EINVAL);
    KVT_CHECK(strstr(kvc_last_error_message(ctx), "kvc_get_device_info") != NULL);
    KVT_EQ(kvc_device_free(ctx, NULL), KVC_EINVAL);
    KVT_CHECK(strstr(kvc_last_error_message(ctx), "kvc_device_free") != NULL);
    KVT_EQ(kvc_pinned_free(ctx, NULL), KVC_EINVAL);
    KVT_CHECK(strstr(kvc_last_error_message(ctx), "kvc_pinned_free") != NULL);
    kvc_context_destroy(ctx);
}

/* kvc_copy_block (public, and the hook kvc_pool_create installs) checks its span arrays: NULL ones with
 * n > 0 are -1 with a message, on a usable context (a crash before) as on a failed one. */
static void test_copy_block_null_spans(void)
{
    kvc_context *ctx = gpu_or_null();
    if (!ctx) kvc_context_create(-1, &ctx);
    KVT_CHECK(ctx != NULL);
    if (!ctx) return;
    KVT_EQ(kvc_copy_block(NULL, NULL, NULL, 1, 256), -1);
    KVT_EQ(kvc_copy_block(ctx, NULL, NULL, 1, 256), -1);
    KVT_CHECK(strstr(kvc_last_error_message(ctx), "kvc_copy_block") != NULL);
    kvc_context_destroy(ctx);
}

static kvb_pool *host_pool(uint32_t blocks, kvb_layout layout)
{
    kvb_pool_config c;
    kvb_pool *p = NULL;
    void *base = NULL;
    uint64_t bytes = 0;
    memset(&c, 0, sizeof c);
    c.num_blocks = blocks;
    c.block_tokens = 16;
    c.storage = KVB_STORAGE_HOST;
    c.layout = layout;
    KVT_EQ(kvb_pool_create(&c, &p), KVB_OK);
    if (p && kvb_pool_storage(p, &base, &bytes, NULL, NULL) == KVB_OK) memset(base, 0, (size_t)bytes);
    return p;
}

static kvo_copy_job job_of(kvb_pool *src, kvb_pool *dst, const uint32_t *si, const uint32_t *di, size_t n, int *results)
{
    kvo_copy_job job;
    memset(&job, 0, sizeof job);
    job.src = src;
    job.dst = dst;
    job.src_idx = si;
    job.dst_idx = di;
    job.n = n;
    job.results = results;
    return job;
}

/* The copy plan carried out on the CPU (kvc_copy_on_host): for every pair of layouts, DMA, kernel and
 * automatic plans, pages below and above the kernel's 64 KiB chunk and one that is not a multiple of
 * 16, random ids with runs: the destination equals, byte for byte, what the memcpy backend makes of
 * the same job (so blocks not named stay zero), and merging leaves at most one copy per run of
 * consecutive ids (per (layer, part) page array when a pool is layer-separate). Runs without a GPU. */
static void test_plan_on_host(void)
{
    enum { NS = 40, ND = 56, N = 24, LAYERS = 3 };
    const uint64_t pages[3] = {4096 + 512, 48 * 1024, 1000};
    const kvb_layout_kind kinds[2] = {KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_LAYER_SEPARATE};
    const kvc_copy_method methods[3] = {KVC_COPY_DMA, KVC_COPY_KERNEL, KVC_COPY_AUTO};
    kvo_backend *mc = NULL;
    uint64_t seed = 4242;
    KVT_EQ(kvo_memcpy_backend_create(0, &mc), KVO_OK);
    if (!mc) return;
    for (int pg = 0; pg < 3; pg++)
        for (int sk = 0; sk < 2; sk++)
            for (int dk = 0; dk < 2; dk++)
                for (int m = 0; m < 3; m++) {
                    kvb_pool *src = host_pool(NS, layout_of(kinds[sk], LAYERS, pages[pg]));
                    kvb_pool *d1 = host_pool(ND, layout_of(kinds[dk], LAYERS, pages[pg]));
                    kvb_pool *d2 = host_pool(ND, layout_of(kinds[dk], LAYERS, pages[pg]));
                    if (!src || !d1 || !d2) return;
                    void *sb = NULL, *b1 = NULL, *b2 = NULL;
                    uint64_t sbytes = 0, dbytes = 0, block_bytes = 0;
                    kvb_pool_storage(src, &sb, &sbytes, &block_bytes, NULL);
                    kvb_pool_storage(d1, &b1, &dbytes, NULL, NULL);
                    kvb_pool_storage(d2, &b2, NULL, NULL, NULL);
                    for (uint64_t j = 0; j < sbytes; j++) ((unsigned char *)sb)[j] = (unsigned char)(rng_next(&seed) >> 31);
                    uint32_t si[N], di[N], limits[2] = {NS, ND}, *ids[2] = {si, di};
                    int res[N], res2[N];
                    size_t chunks = random_runs(&seed, limits, ids, 2, N);
                    kvc_backend_config cfg;
                    memset(&cfg, 0, sizeof cfg);
                    cfg.method = methods[m];
                    kvc_backend_stats plan;
                    kvo_copy_job job = job_of(src, d1, si, di, N, res);
                    KVT_EQ(kvc_copy_on_host(&cfg, &job, &plan), KVC_OK);
                    for (size_t i = 0; i < N; i++) KVT_EQ(res[i], KVC_OK);
                    KVT_EQ(job.bytes, N * block_bytes);
                    KVT_EQ(run_job(mc, src, d2, si, di, N, res2, NULL, NULL), KVO_OK);
                    int same = memcmp(b1, b2, (size_t)dbytes) == 0;
                    if (!same)
                        fprintf(stderr, "  page %llu, layouts %d -> %d, method %d: bytes differ\n",
                                (unsigned long long)pages[pg], sk, dk, (int)methods[m]);
                    KVT_CHECK(same);
                    KVT_EQ(plan.jobs, 1);
                    KVT_EQ(plan.copies, N);
                    KVT_EQ(plan.bytes, N * block_bytes);
                    KVT_EQ(plan.failed_jobs, 0);
                    uint64_t units = sk == 0 && dk == 0 ? 1 : 2 * LAYERS;
                    if (sk == dk) KVT_CHECK(plan.runs <= chunks * units);
                    KVT_CHECK(plan.runs <= (uint64_t)N * units);
                    if (methods[m] == KVC_COPY_KERNEL) KVT_EQ(plan.kernel_jobs, 1);
                    if (methods[m] == KVC_COPY_DMA) KVT_EQ(plan.dma_jobs, 1);
                    if (methods[m] == KVC_COPY_AUTO) /* kernel below 256 KiB average runs: all but 288 KiB blocks */
                        KVT_EQ(plan.kernel_jobs, !(sk == 0 && dk == 0 && pages[pg] == 48 * 1024));
                    kvb_pool_destroy(src);
                    kvb_pool_destroy(d1);
                    kvb_pool_destroy(d2);
                }
    kvo_backend_destroy(mc);

    /* per-copy and per-job errors */
    kvb_pool *a = host_pool(8, layout_of(KVB_LAYOUT_LAYER_SEPARATE, 2, 512));
    kvb_pool *b = host_pool(8, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 512));
    kvb_pool *c = host_pool(8, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 1024));
    kvb_pool_config mc_cfg;
    memset(&mc_cfg, 0, sizeof mc_cfg);
    mc_cfg.num_blocks = 8;
    kvb_pool *meta = NULL;
    KVT_EQ(kvb_pool_create(&mc_cfg, &meta), KVB_OK);
    uint32_t si[3] = {1, 8, 2}, di[3] = {3, 4, 9};
    int res[3];
    kvc_backend_stats plan;
    kvo_copy_job job = job_of(a, b, si, di, 3, res);
    KVT_EQ(kvc_copy_on_host(NULL, &job, &plan), KVB_ERANGE);
    KVT_EQ(res[0], KVC_OK);
    KVT_EQ(res[1], KVB_ERANGE);
    KVT_EQ(res[2], KVB_ERANGE);
    KVT_EQ(job.bytes, 2 * 2 * 512);
    KVT_EQ(plan.failed_jobs, 1);
    job = job_of(a, c, si, di, 1, res);
    KVT_EQ(kvc_copy_on_host(NULL, &job, NULL), KVC_ELAYOUT);
    KVT_EQ(res[0], KVC_ELAYOUT);
    job = job_of(meta, b, si, di, 1, res);
    KVT_EQ(kvc_copy_on_host(NULL, &job, NULL), KVC_ESTORAGE);
    KVT_EQ(res[0], KVC_ESTORAGE);
    KVT_EQ(kvc_copy_on_host(NULL, NULL, NULL), KVC_EINVAL);
    { /* 2^32 one-byte pages a block: more than a plan's 32-bit page count (the storage is never read) */
        kvb_pool_config big_cfg;
        kvb_pool *big[2] = {NULL, NULL};
        uint32_t zero = 0;
        memset(&big_cfg, 0, sizeof big_cfg);
        big_cfg.num_blocks = 1;
        big_cfg.storage = KVB_STORAGE_EXTERNAL;
        big_cfg.layout = layout_of(KVB_LAYOUT_LAYER_SEPARATE, 1, 1);
        big_cfg.layout.num_layers = big_cfg.layout.num_parts = 65536;
        big_cfg.external_base = (void *)(uintptr_t)4096;
        big_cfg.external_bytes = (uint64_t)1 << 32;
        KVT_EQ(kvb_pool_create(&big_cfg, &big[0]), KVB_OK);
        KVT_EQ(kvb_pool_create(&big_cfg, &big[1]), KVB_OK);
        job = job_of(big[0], big[1], &zero, &zero, 1, res);
        KVT_EQ(kvc_copy_on_host(NULL, &job, NULL), KVC_ELAYOUT);
        KVT_EQ(res[0], KVC_ELAYOUT);
        kvb_pool_destroy(big[0]);
        kvb_pool_destroy(big[1]);
    }
    job = job_of(a, b, NULL, di, 1, res);
    KVT_EQ(kvc_copy_on_host(NULL, &job, NULL), KVC_EINVAL);
    kvb_pool_destroy(a);
    kvb_pool_destroy(b);
    kvb_pool_destroy(c);
    kvb_pool_destroy(meta);
}

/* ---- GPU tests --------------------------------------------------------------------------------- */

/* device A -> pinned H -> device B with random ids; every block byte-compared at each hop. */
static void roundtrip(kvc_context *ctx, kvb_layout_kind dev_kind, kvb_layout_kind host_kind, kvc_copy_method method,
                      uint64_t seed, int batch_api)
{
    enum { NA = 96, NH = 160, NB = 80, N = 48, LAYERS = 3 };
    const uint64_t page = 4096 + 512; /* 16-byte multiple, not a power of two */
    kvb_pool *a = make_pool(ctx, KVC_MEMORY_DEVICE, NA, layout_of(dev_kind, LAYERS, page));
    kvb_pool *h = make_pool(ctx, KVC_MEMORY_PINNED, NH, layout_of(host_kind, LAYERS, page));
    kvb_pool *b = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(dev_kind, LAYERS, page));
    if (!a || !h || !b) return;
    kvc_backend_config bc;
    memset(&bc, 0, sizeof bc);
    bc.method = method;
    bc.batch_api = batch_api;
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, &bc, &be), KVC_OK);
    if (!be) return;
    fill_random(ctx, a, seed);
    uint32_t ai[N], hi[N], bi[N];
    int res[N];
    uint64_t bytes = 0, block_bytes = 0;
    char msg[256];
    uint32_t limits[3] = {NA, NH, NB}, *ids[3] = {ai, hi, bi};
    size_t chunks = random_runs(&seed, limits, ids, 3, N);
    KVT_EQ(kvb_pool_storage(a, NULL, NULL, &block_bytes, NULL), KVB_OK);

    KVT_EQ(run_job(be, a, h, ai, hi, N, res, &bytes, msg), KVO_OK);
    for (size_t i = 0; i < N; i++) KVT_EQ(res[i], KVO_OK);
    KVT_EQ(bytes, N * block_bytes);
    KVT_EQ(run_job(be, h, b, hi, bi, N, res, &bytes, msg), KVO_OK);
    for (size_t i = 0; i < N; i++) KVT_EQ(res[i], KVO_OK);

    uint64_t sa, sh, sb;
    unsigned char *ha = snapshot(ctx, a, &sa), *hh = snapshot(ctx, h, &sh), *hb = snapshot(ctx, b, &sb);
    size_t bad_h = 0, bad_b = 0;
    for (size_t i = 0; i < N; i++) {
        bad_h += !same_block(ha, a, ai[i], hh, h, hi[i]);
        bad_b += !same_block(ha, a, ai[i], hb, b, bi[i]);
    }
    KVT_EQ(bad_h, 0);
    KVT_EQ(bad_b, 0);
    /* blocks not named stay zero in B */
    unsigned char *named = (unsigned char *)calloc(NB, 1);
    for (size_t i = 0; i < N; i++) named[bi[i]] = 1;
    unsigned char *zero = (unsigned char *)calloc((size_t)page, 1);
    size_t nonzero = 0;
    kvb_layout lb;
    kvb_pool_storage(b, NULL, NULL, NULL, &lb);
    for (uint32_t k = 0; k < NB; k++) {
        if (named[k]) continue;
        for (uint32_t l = 0; l < LAYERS; l++)
            for (uint32_t q = 0; q < 2; q++)
                nonzero += memcmp(hb + kvb_layout_offset(&lb, NB, k, l, q), zero, (size_t)page) != 0;
    }
    KVT_EQ(nonzero, 0);

    kvc_backend_stats st;
    KVT_EQ(kvc_backend_get_stats(be, &st), KVC_OK);
    KVT_EQ(st.jobs, 2);
    KVT_EQ(st.copies, 2 * N);
    KVT_EQ(st.failed_jobs, 0);
    KVT_EQ(st.bytes, 2 * N * block_bytes);
    KVT_CHECK(st.runs > 0);
    if (dev_kind == host_kind) { /* merged: at most one run per chunk (per page array when layer-separate) */
        uint64_t units = dev_kind == KVB_LAYOUT_BLOCK_CONTIGUOUS ? 1 : 2 * LAYERS;
        KVT_CHECK(st.runs <= 2 * chunks * units);
        KVT_CHECK(chunks < N);
    } else {
        KVT_CHECK(st.runs <= 2 * (uint64_t)N * 2 * LAYERS);
    }
    if (method == KVC_COPY_KERNEL) KVT_EQ(st.kernel_jobs, 2);
    if (method == KVC_COPY_DMA) KVT_EQ(st.dma_jobs, 2);
    if (batch_api < 0) KVT_EQ(st.batch_calls, 0); /* the per-run path: one cudaMemcpyAsync per copy */
    free(named);
    free(zero);
    free(ha);
    free(hh);
    free(hb);
    kvo_backend_destroy(be);
    KVT_EQ(kvc_pool_destroy(ctx, a), KVC_OK);
    KVT_EQ(kvc_pool_destroy(ctx, h), KVC_OK);
    KVT_EQ(kvc_pool_destroy(ctx, b), KVC_OK);
}

static void test_roundtrip_block_contiguous(void)
{
    NEED_GPU(ctx);
    roundtrip(ctx, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_AUTO, 11, 0);
    roundtrip(ctx, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_DMA, 12, 0);
    roundtrip(ctx, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_KERNEL, 13, 0);
    kvc_context_destroy(ctx);
}

static void test_roundtrip_layer_separate(void)
{
    NEED_GPU(ctx);
    roundtrip(ctx, KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_LAYER_SEPARATE, KVC_COPY_AUTO, 21, 0);
    roundtrip(ctx, KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_LAYER_SEPARATE, KVC_COPY_DMA, 22, 0);
    roundtrip(ctx, KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_LAYER_SEPARATE, KVC_COPY_KERNEL, 23, 0);
    kvc_context_destroy(ctx);
}

/* vLLM-style per-layer device tensors against a block-contiguous host tier, and the reverse. */
static void test_roundtrip_mixed_layouts(void)
{
    NEED_GPU(ctx);
    roundtrip(ctx, KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_DMA, 31, 0);
    roundtrip(ctx, KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_KERNEL, 32, 0);
    roundtrip(ctx, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_LAYER_SEPARATE, KVC_COPY_AUTO, 33, 0);
    kvc_context_destroy(ctx);
}

/* DMA without cudaMemcpyBatchAsync (batch_api -1), the path a toolkit or driver older than 12.8 takes:
 * one cudaMemcpyAsync per merged copy, same bytes. */
static void test_roundtrip_per_run_copies(void)
{
    NEED_GPU(ctx);
    roundtrip(ctx, KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_DMA, 41, -1);
    roundtrip(ctx, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVB_LAYOUT_BLOCK_CONTIGUOUS, KVC_COPY_DMA, 42, -1);
    kvc_context_destroy(ctx);
}

/* Register n blocks of a pool under synthetic hashes; strong handles kept in out. */
static void register_blocks(kvb_pool *pool, size_t n, uint64_t salt, kvb_block *out, kvb_weak *weak, kvb_hash *hashes)
{
    kvb_block b[64];
    KVT_CHECK(n <= 64);
    KVT_EQ(kvb_alloc(pool, n, b), KVB_OK);
    for (size_t i = 0; i < n; i++) {
        hashes[i].lo = salt * 1000003u + i + 1;
        hashes[i].hi = salt;
    }
    KVT_EQ(kvb_register_hashed(pool, b, n, hashes, NULL, out), KVB_OK);
    for (size_t i = 0; i < n; i++) weak[i] = kvb_weak_of(out[i]);
}

typedef struct landed {
    pthread_mutex_t m;
    kvb_weak dst[64];
    size_t n;
    int calls;
} landed;

static void on_transfer_done(void *user, kvo_transfer t, const kvo_transfer_info *info, const kvb_weak *dst, size_t n)
{
    landed *l = (landed *)user;
    (void)t;
    (void)info;
    pthread_mutex_lock(&l->m);
    for (size_t i = 0; i < n && i < 64; i++) l->dst[i] = dst[i];
    l->n = n;
    l->calls++;
    pthread_mutex_unlock(&l->m);
}

/* A slow kernel writes the device blocks; the offload waits on the CUDA event recorded after it, so
 * the host copy holds the kernel's bytes (without the wait the copy stream would read zeros). */
static void test_precondition_event(void)
{
    NEED_GPU(ctx);
    enum { NB = 32, N = 24 };
    const uint64_t page = 2048;
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_LAYER_SEPARATE, 4, page));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, NB, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 4, page));
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_OK);
    kvc_event *ev = NULL;
    KVT_EQ(kvc_event_create(ctx, &ev), KVC_OK);
    if (!dev || !host || !be || !ev) return;
    KVT_EQ(kvc_event_query(ev), 1); /* never recorded: done */
    landed l;
    memset(&l, 0, sizeof l);
    pthread_mutex_init(&l.m, NULL);
    kvo_pipeline_config pc;
    memset(&pc, 0, sizeof pc);
    pc.src = dev;
    pc.dst = host;
    pc.backend = be;
    pc.mode = KVO_MODE_THREADS;
    pc.min_batch = 1;
    pc.on_done = on_transfer_done;
    pc.done_user = &l;
    kvo_pipeline *pl = NULL;
    KVT_EQ(kvo_pipeline_create(&pc, &pl), KVO_OK);
    kvb_block strong[N];
    kvb_weak weak[N];
    kvb_hash hashes[N];
    register_blocks(dev, N, 7, strong, weak, hashes);

    void *base = NULL;
    uint64_t bytes = 0;
    kvb_pool_storage(dev, &base, &bytes, NULL, NULL);
    long long spin = (long long)kvct_clock_khz() * 300; /* about 300 ms */
    KVT_EQ(kvct_slow_fill(base, bytes, 5, spin, NULL), 0);
    KVT_EQ(kvc_event_record(ev, NULL), KVC_OK);
    KVT_EQ(kvc_event_query(ev), 0); /* the kernel is still spinning */
    kvo_enqueue_opts o;
    memset(&o, 0, sizeof o);
    o.precondition = kvc_event_precondition(ev);
    kvo_transfer t;
    KVT_EQ(kvo_enqueue(pl, weak, N, &o, &t), KVO_OK);
    kvo_status status = 0;
    KVT_EQ(kvo_transfer_wait(pl, t, 10 * 1000 * 1000, &status), KVO_OK);
    KVT_EQ(status, KVO_STATUS_COMPLETE);
    kvo_transfer_info info;
    KVT_EQ(kvo_transfer_get_info(pl, t, &info), KVO_OK);
    KVT_EQ(info.transferred, N);
    KVT_EQ(kvc_event_query(ev), 1);
    KVT_EQ(kvo_pipeline_drain(pl, 5 * 1000 * 1000), KVO_OK);

    /* each landed host block equals the kernel's bytes of its source block */
    kvb_layout ld, lh;
    void *hbase = NULL;
    kvb_pool_storage(dev, NULL, NULL, NULL, &ld);
    kvb_pool_storage(host, &hbase, NULL, NULL, &lh);
    pthread_mutex_lock(&l.m);
    KVT_EQ(l.calls, 1);
    KVT_EQ(l.n, N);
    size_t bad = 0;
    for (size_t i = 0; i < l.n; i++) {
        uint32_t si = kvb_block_index(strong[i].id), hi = kvb_block_index(l.dst[i].id);
        KVT_CHECK(hi < NB);
        if (hi >= NB) continue;
        for (uint32_t la = 0; la < 4; la++)
            for (uint32_t q = 0; q < 2; q++) {
                uint64_t so = kvb_layout_offset(&ld, NB, si, la, q);
                const unsigned char *hp = (const unsigned char *)hbase + kvb_layout_offset(&lh, NB, hi, la, q);
                for (uint64_t j = 0; j < page; j++) bad += hp[j] != kvct_byte(5, so + j);
            }
    }
    pthread_mutex_unlock(&l.m);
    KVT_EQ(bad, 0);
    KVT_EQ(kvo_transfer_release(pl, t), KVO_OK);
    kvo_pipeline_destroy(pl);
    kvc_event_destroy(ev);
    kvo_backend_destroy(be);
    KVT_EQ(kvb_release(dev, strong, N, NULL), KVB_OK);
    KVT_EQ(kvc_pool_destroy(ctx, host), KVC_OK);
    KVT_EQ(kvc_pool_destroy(ctx, dev), KVC_OK);
    pthread_mutex_destroy(&l.m);
    kvc_context_destroy(ctx);
}

/* The tier manager over the GPU backend, as an engine runs it: blocks written on the device go down to
 * pinned host memory (eager offload), leave the device under pressure, the device memory is scrawled
 * over, and the blocks come back by onboarding, byte for byte. The device pool is layer-separate (its
 * pages go by the kernel), the host pool block-contiguous; one backend serves both directions. */
static void test_manager_round_trip(void)
{
    NEED_GPU(ctx);
    enum { ND = 24, NH = 64, N = 16, LAYERS = 4 };
    const uint64_t page = 2048;
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, ND, layout_of(KVB_LAYOUT_LAYER_SEPARATE, LAYERS, page));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, NH, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, LAYERS, page));
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_OK);
    if (!dev || !host || !be) return;
    kvo_manager_config mc;
    memset(&mc, 0, sizeof mc);
    mc.num_tiers = 2;
    mc.pools[0] = dev;
    mc.pools[1] = host;
    mc.down[0] = be;
    mc.up[1] = be;
    mc.offload = KVO_OFFLOAD_EAGER;
    mc.pipeline.mode = KVO_MODE_THREADS;
    mc.pipeline.min_batch = 1;
    kvo_manager *mgr = NULL;
    KVT_EQ(kvo_manager_create(&mc, &mgr), KVO_OK);
    if (!mgr) return;

    kvb_block strong[N], back[N], filler[ND];
    kvb_weak weak[N];
    kvb_hash hashes[N];
    uint8_t tier_of[N];
    size_t found = 0, got = 0;
    uint64_t bytes = 0;
    register_blocks(dev, N, 11, strong, weak, hashes);
    fill_random(ctx, dev, 0x5eed);
    unsigned char *before = snapshot(ctx, dev, &bytes);
    KVT_EQ(kvo_manager_offer(mgr, 0, strong, N, NULL), KVO_OK);
    KVT_EQ(kvo_manager_drain(mgr, 10 * 1000 * 1000), KVO_OK);
    KVT_EQ(kvb_release(dev, strong, N, NULL), KVB_OK);

    /* pressure: the whole device pool taken by other blocks evicts them, then the bytes change */
    KVT_EQ(kvb_alloc(dev, ND, filler), KVB_OK);
    KVT_EQ(kvb_release(dev, filler, ND, NULL), KVB_OK);
    fill_random(ctx, dev, 0xbad);
    KVT_EQ(kvo_manager_lookup(mgr, hashes, N, tier_of, &found), KVO_OK);
    KVT_EQ(found, N);
    for (size_t i = 0; i < found; i++) KVT_EQ(tier_of[i], 1);

    kvo_transfer x;
    kvo_status st = KVO_STATUS_FAILED;
    kvo_pipeline *up = kvo_manager_pipeline(mgr, 1, 1);
    KVT_CHECK(up != NULL);
    KVT_EQ(kvo_manager_onboard(mgr, 1, hashes, N, &x), KVO_OK);
    KVT_EQ(kvo_transfer_wait(up, x, 10 * 1000 * 1000, &st), KVO_OK);
    KVT_EQ(st, KVO_STATUS_COMPLETE);
    KVT_EQ(kvo_transfer_take_blocks(up, x, back, N, &got), KVO_OK);
    KVT_EQ(got, N);
    KVT_EQ(kvo_transfer_release(up, x), KVO_OK);
    unsigned char *after = snapshot(ctx, dev, &bytes);
    size_t bad = 0;
    for (size_t i = 0; i < got; i++)
        bad += !same_block(before, dev, kvb_block_index(strong[i].id), after, dev, kvb_block_index(back[i].id));
    KVT_EQ(bad, 0);
    KVT_EQ(kvb_release(dev, back, got, NULL), KVB_OK);

    kvc_backend_stats bs;
    KVT_EQ(kvc_backend_get_stats(be, &bs), KVC_OK);
    KVT_CHECK(bs.jobs >= 2); /* down and up, each in one batch or more */
    KVT_EQ(bs.copies, 2 * N);
    KVT_EQ(bs.failed_jobs, 0);
    KVT_EQ(bs.kernel_jobs, bs.jobs); /* 2 KiB pages: the kernel */
    free(before);
    free(after);
    kvo_manager_destroy(mgr);
    kvo_backend_destroy(be);
    KVT_EQ(kvb_pool_check(dev, NULL, 0), KVB_OK);
    KVT_EQ(kvc_pool_destroy(ctx, dev), KVC_OK);
    KVT_EQ(kvc_pool_destroy(ctx, host), KVC_OK);
    kvc_context_destroy(ctx);
}

/* One backend shared by several threads, each submitting its own jobs in both directions at once: a
 * device range goes to the thread's pinned range (kernel or DMA, by the job's size), comes back to a
 * second device range, round after round with new random ids, every block byte-compared each time. The
 * backend's queues, free list and per-direction workers are shared; the blocks are not. */
enum { CS_THREADS = 4, CS_ROUNDS = 24, CS_PER = 24, CS_JOB = 12 };

/* Blocks a and b of a device pool hold the same bytes (each page copied out on its own: other threads
 * copy other blocks of the pool meanwhile). 1: equal. */
static int device_blocks_equal(kvc_context *ctx, kvb_pool *pool, uint32_t a, uint32_t b)
{
    void *base = NULL;
    kvb_layout l;
    unsigned char pa[4096], pb[4096];
    uint32_t n = num_blocks_of(pool);
    if (kvb_pool_storage(pool, &base, NULL, NULL, &l) != KVB_OK || l.page_bytes > sizeof pa) return 0;
    for (uint32_t layer = 0; layer < l.num_layers; layer++)
        for (uint32_t q = 0; q < l.num_parts; q++) {
            const unsigned char *d = (const unsigned char *)base;
            if (kvc_memcpy(ctx, pa, d + kvb_layout_offset(&l, n, a, layer, q), (size_t)l.page_bytes) != KVC_OK ||
                kvc_memcpy(ctx, pb, d + kvb_layout_offset(&l, n, b, layer, q), (size_t)l.page_bytes) != KVC_OK ||
                memcmp(pa, pb, (size_t)l.page_bytes) != 0)
                return 0;
        }
    return 1;
}

/* Every page of block b of a device pool set to bytes from seed. 1: done. */
static int device_block_fill(kvc_context *ctx, kvb_pool *pool, uint32_t b, uint64_t seed)
{
    void *base = NULL;
    kvb_layout l;
    unsigned char page[4096];
    uint32_t n = num_blocks_of(pool);
    if (kvb_pool_storage(pool, &base, NULL, NULL, &l) != KVB_OK || l.page_bytes > sizeof page) return 0;
    for (uint32_t layer = 0; layer < l.num_layers; layer++)
        for (uint32_t q = 0; q < l.num_parts; q++) {
            for (uint64_t j = 0; j < l.page_bytes; j++) page[j] = (unsigned char)(rng_next(&seed) >> 29);
            if (kvc_memcpy(ctx, (unsigned char *)base + kvb_layout_offset(&l, n, b, layer, q), page,
                           (size_t)l.page_bytes) != KVC_OK)
                return 0;
        }
    return 1;
}

/* A job submitted and waited for from a submitting thread: its result, -1 when done was not called once. */
static int cs_job(kvo_backend *be, kvb_pool *src, kvb_pool *dst, const uint32_t *si, const uint32_t *di, size_t n,
                  int *results)
{
    int submitted = 0, calls = 0;
    int r = submit_wait(be, src, dst, si, di, n, results, &submitted, &calls, NULL, NULL);
    return submitted == KVO_OK && calls != 1 ? -1 : r;
}

typedef struct cs_arg {
    kvc_context *ctx;
    kvo_backend *be;
    kvb_pool *dev, *host; /* thread t owns device blocks [t * 2 * CS_PER, (t + 1) * 2 * CS_PER) and host
                             blocks [t * CS_PER, (t + 1) * CS_PER) */
    int t, bad, failed;
} cs_arg;

/* Each round: new bytes in the blocks going out, other new bytes where they come back, so every round's
 * copies in both directions must have happened for the blocks to match. */
static void *cs_main(void *p)
{
    cs_arg *a = (cs_arg *)p;
    uint64_t seed = 0x1234567ull * (uint64_t)(a->t + 1);
    uint32_t di[CS_JOB], hi[CS_JOB], bi[CS_JOB];
    int res[CS_JOB];
    for (int round = 0; round < CS_ROUNDS; round++) {
        unsigned char used[2 * CS_PER], usedh[CS_PER];
        memset(used, 0, sizeof used);
        memset(usedh, 0, sizeof usedh);
        size_t n = 1 + (size_t)(rng_next(&seed) % CS_JOB);
        for (size_t i = 0; i < n; i++) { /* distinct ids: device in its first half, back to its second */
            uint32_t x, y;
            do x = (uint32_t)(rng_next(&seed) % CS_PER); while (used[x]);
            used[x] = 1;
            do y = (uint32_t)(rng_next(&seed) % CS_PER); while (usedh[y]);
            usedh[y] = 1;
            di[i] = (uint32_t)(a->t * 2 * CS_PER) + x;
            hi[i] = (uint32_t)(a->t * CS_PER) + y;
            bi[i] = (uint32_t)(a->t * 2 * CS_PER + CS_PER) + x;
            if (!device_block_fill(a->ctx, a->dev, di[i], rng_next(&seed)) ||
                !device_block_fill(a->ctx, a->dev, bi[i], rng_next(&seed)))
                a->failed++;
        }
        if (cs_job(a->be, a->dev, a->host, di, hi, n, res) != KVO_OK) a->failed++;
        if (cs_job(a->be, a->host, a->dev, hi, bi, n, res) != KVO_OK) a->failed++;
        for (size_t i = 0; i < n; i++) /* the block went out and came back: compare on the device side */
            a->bad += !device_blocks_equal(a->ctx, a->dev, di[i], bi[i]);
    }
    return NULL;
}

static void test_concurrent_submitters(void)
{
    NEED_GPU(ctx);
    const uint64_t page = 4096;
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, CS_THREADS * 2 * CS_PER, layout_of(KVB_LAYOUT_LAYER_SEPARATE, 2, page));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, CS_THREADS * CS_PER, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, page));
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_OK);
    if (!dev || !host || !be) return;
    pthread_t th[CS_THREADS];
    cs_arg args[CS_THREADS];
    int started[CS_THREADS] = {0}, bad = 0, failed = 0;
    for (int t = 0; t < CS_THREADS; t++) {
        memset(&args[t], 0, sizeof args[t]);
        args[t].ctx = ctx;
        args[t].be = be;
        args[t].dev = dev;
        args[t].host = host;
        args[t].t = t;
        started[t] = pthread_create(&th[t], NULL, cs_main, &args[t]) == 0;
        KVT_CHECK(started[t]);
    }
    for (int t = 0; t < CS_THREADS; t++) {
        if (!started[t]) continue;
        pthread_join(th[t], NULL);
        bad += args[t].bad;
        failed += args[t].failed;
    }
    KVT_EQ(failed, 0);
    KVT_EQ(bad, 0);
    kvc_backend_stats st;
    KVT_EQ(kvc_backend_get_stats(be, &st), KVC_OK);
    KVT_EQ(st.jobs, 2 * CS_THREADS * CS_ROUNDS);
    KVT_EQ(st.failed_jobs, 0);
    kvo_backend_destroy(be);
    KVT_EQ(kvc_pool_destroy(ctx, dev), KVC_OK);
    KVT_EQ(kvc_pool_destroy(ctx, host), KVC_OK);
    kvc_context_destroy(ctx);
}

/* A transfer cancelled while it waits on its CUDA precondition never reaches the backend: no job, no
 * bytes in the host pool, nothing registered there. */
static void test_cancel_before_upgrade(void)
{
    NEED_GPU(ctx);
    enum { NB = 16, N = 12 };
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 1024));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, NB, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 1024));
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_OK);
    kvc_event *ev = NULL;
    KVT_EQ(kvc_event_create(ctx, &ev), KVC_OK);
    if (!dev || !host || !be || !ev) return;
    kvo_pipeline_config pc;
    memset(&pc, 0, sizeof pc);
    pc.src = dev;
    pc.dst = host;
    pc.backend = be;
    pc.mode = KVO_MODE_THREADS;
    pc.min_batch = 1;
    kvo_pipeline *pl = NULL;
    KVT_EQ(kvo_pipeline_create(&pc, &pl), KVO_OK);
    kvb_block strong[N];
    kvb_weak weak[N];
    kvb_hash hashes[N];
    register_blocks(dev, N, 9, strong, weak, hashes);
    void *base = NULL, *hbase = NULL;
    uint64_t bytes = 0, hbytes = 0;
    kvb_pool_storage(dev, &base, &bytes, NULL, NULL);
    kvb_pool_storage(host, &hbase, &hbytes, NULL, NULL);
    KVT_EQ(kvct_slow_fill(base, bytes, 3, (long long)kvct_clock_khz() * 200, NULL), 0);
    KVT_EQ(kvc_event_record(ev, NULL), KVC_OK);
    kvo_token *tok = NULL;
    KVT_EQ(kvo_token_create(&tok), KVO_OK);
    kvo_enqueue_opts o;
    memset(&o, 0, sizeof o);
    o.precondition = kvc_event_precondition(ev);
    o.token = tok;
    kvo_transfer t;
    KVT_EQ(kvo_enqueue(pl, weak, N, &o, &t), KVO_OK);
    KVT_EQ(kvc_event_query(ev), 0);
    kvo_status status = 0;
    KVT_EQ(kvo_transfer_cancel(pl, t, &status), KVO_OK);
    KVT_EQ(status, KVO_STATUS_CANCELLED);
    KVT_EQ(kvc_synchronize(ctx), KVC_OK);
    while (kvc_event_query(ev) == 0) usleep(1000); /* the kernel has finished: nothing may follow it */
    KVT_EQ(kvo_pipeline_drain(pl, 5 * 1000 * 1000), KVO_OK);
    kvc_backend_stats st;
    KVT_EQ(kvc_backend_get_stats(be, &st), KVC_OK);
    KVT_EQ(st.jobs, 0);
    KVT_EQ(st.bytes, 0);
    kvb_pool_stats hs;
    KVT_EQ(kvb_pool_get_stats(host, &hs), KVB_OK);
    KVT_EQ(hs.cached_hashes, 0);
    KVT_EQ(hs.registrations, 0);
    size_t nonzero = 0;
    for (uint64_t j = 0; j < hbytes; j++) nonzero += ((const unsigned char *)hbase)[j] != 0;
    KVT_EQ(nonzero, 0);
    kvo_transfer_info info;
    KVT_EQ(kvo_transfer_get_info(pl, t, &info), KVO_OK);
    KVT_EQ(info.transferred, 0);
    KVT_EQ(kvo_transfer_release(pl, t), KVO_OK);
    kvo_token_release(tok);
    kvo_pipeline_destroy(pl);
    kvc_event_destroy(ev);
    kvo_backend_destroy(be);
    KVT_EQ(kvb_release(dev, strong, N, NULL), KVB_OK);
    KVT_EQ(kvc_pool_destroy(ctx, host), KVC_OK);
    KVT_EQ(kvc_pool_destroy(ctx, dev), KVC_OK);
    kvc_context_destroy(ctx);
}

/* Many small scattered blocks in one job (the automatic choice takes the kernel) give the same host
 * pool, byte for byte, as the same copies done one job each by DMA; both directions. */
static void test_scattered_equals_one_by_one(void)
{
    NEED_GPU(ctx);
    enum { NB = 1024, NH = 700, N = 400, LAYERS = 8 };
    const uint64_t page = 256; /* 16 tokens x 8 bytes: tiny pages, the kernel's case */
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_LAYER_SEPARATE, LAYERS, page));
    kvb_pool *h1 = make_pool(ctx, KVC_MEMORY_PINNED, NH, layout_of(KVB_LAYOUT_LAYER_SEPARATE, LAYERS, page));
    kvb_pool *h2 = make_pool(ctx, KVC_MEMORY_PINNED, NH, layout_of(KVB_LAYOUT_LAYER_SEPARATE, LAYERS, page));
    kvb_pool *d1 = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_LAYER_SEPARATE, LAYERS, page));
    kvb_pool *d2 = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_LAYER_SEPARATE, LAYERS, page));
    kvo_backend *many = NULL, *one = NULL;
    kvc_backend_config bc;
    memset(&bc, 0, sizeof bc);
    KVT_EQ(kvc_backend_create(ctx, &bc, &many), KVC_OK);
    bc.method = KVC_COPY_DMA;
    bc.sync = 1;
    KVT_EQ(kvc_backend_create(ctx, &bc, &one), KVC_OK);
    if (!dev || !h1 || !h2 || !d1 || !d2 || !many || !one) return;
    fill_random(ctx, dev, 77);
    uint64_t seed = 99;
    static uint32_t si[N], hi[N], di[N];
    static int res[N];
    uint32_t limits[3] = {NB, NH, NB}, *ids[3] = {si, hi, di};
    random_runs(&seed, limits, ids, 3, N);
    KVT_EQ(run_job(many, dev, h1, si, hi, N, res, NULL, NULL), KVO_OK);
    for (size_t i = 0; i < N; i++) {
        int r1 = KVO_EBACKEND;
        KVT_EQ(run_job(one, dev, h2, &si[i], &hi[i], 1, &r1, NULL, NULL), KVO_OK);
        KVT_EQ(r1, KVO_OK);
    }
    KVT_EQ(run_job(many, h1, d1, hi, di, N, res, NULL, NULL), KVO_OK);
    for (size_t i = 0; i < N; i++) {
        int r1 = KVO_EBACKEND;
        KVT_EQ(run_job(one, h2, d2, &hi[i], &di[i], 1, &r1, NULL, NULL), KVO_OK);
    }
    uint64_t b1, b2, c1, c2;
    unsigned char *s1 = snapshot(ctx, h1, &b1), *s2 = snapshot(ctx, h2, &b2);
    unsigned char *e1 = snapshot(ctx, d1, &c1), *e2 = snapshot(ctx, d2, &c2);
    KVT_EQ(b1, b2);
    KVT_CHECK(memcmp(s1, s2, (size_t)b1) == 0);
    KVT_CHECK(memcmp(e1, e2, (size_t)c1) == 0);
    uint64_t sd;
    unsigned char *sdev = snapshot(ctx, dev, &sd);
    size_t bad = 0;
    for (size_t i = 0; i < N; i++) bad += !same_block(sdev, dev, si[i], e1, d1, di[i]);
    KVT_EQ(bad, 0);
    kvc_backend_stats st;
    KVT_EQ(kvc_backend_get_stats(many, &st), KVC_OK);
    KVT_EQ(st.kernel_jobs, 2); /* automatic: average run far below 256 KiB */
    KVT_EQ(st.dma_jobs, 0);
    KVT_EQ(kvc_backend_get_stats(one, &st), KVC_OK);
    KVT_EQ(st.dma_jobs, 2 * N);
    free(s1);
    free(s2);
    free(e1);
    free(e2);
    free(sdev);
    kvo_backend_destroy(many);
    kvo_backend_destroy(one);
    kvc_pool_destroy(ctx, dev);
    kvc_pool_destroy(ctx, h1);
    kvc_pool_destroy(ctx, h2);
    kvc_pool_destroy(ctx, d1);
    kvc_pool_destroy(ctx, d2);
    kvc_context_destroy(ctx);
}

/* Errors with a device: an index out of range fails that copy alone; pools without device memory or
 * with different pages fail the job with a message; an impossible allocation is KVC_ENOMEM. */
static void test_copy_errors(void)
{
    NEED_GPU(ctx);
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, 8, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 512));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, 8, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 512));
    kvb_pool *other = make_pool(ctx, KVC_MEMORY_PINNED, 8, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 1024));
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_OK);
    if (!dev || !host || !other || !be) return;
    uint32_t si[3] = {1, 9, 2}, di[3] = {0, 1, 50};
    int res[3];
    uint64_t bytes = 0, bb = 0;
    char msg[256];
    kvb_pool_storage(dev, NULL, NULL, &bb, NULL);
    KVT_EQ(run_job(be, dev, host, si, di, 3, res, &bytes, msg), KVB_ERANGE);
    KVT_EQ(res[0], KVO_OK);
    KVT_EQ(res[1], KVB_ERANGE);
    KVT_EQ(res[2], KVB_ERANGE);
    KVT_EQ(bytes, bb);
    KVT_CHECK(strstr(msg, "out of range") != NULL);
    KVT_EQ(run_job(be, host, host, si, di, 1, res, NULL, msg), KVC_ESTORAGE);
    KVT_EQ(res[0], KVC_ESTORAGE);
    KVT_CHECK(strstr(msg, "device memory") != NULL);
    KVT_EQ(run_job(be, dev, other, si, di, 1, res, NULL, msg), KVC_ELAYOUT);
    KVT_EQ(res[0], KVC_ELAYOUT);
    void *p = NULL;
    KVT_EQ(kvc_device_alloc(ctx, (size_t)1 << 60, &p), KVC_ENOMEM);
    KVT_CHECK(strstr(kvc_last_error_message(ctx), "cudaMalloc") != NULL);
    kvc_memory kind = KVC_MEMORY_UNKNOWN;
    void *hb = NULL, *db = NULL;
    kvb_pool_storage(host, &hb, NULL, NULL, NULL);
    kvb_pool_storage(dev, &db, NULL, NULL, NULL);
    KVT_EQ(kvc_memory_kind(ctx, hb, &kind), KVC_OK);
    KVT_EQ(kind, KVC_MEMORY_PINNED);
    KVT_EQ(kvc_memory_kind(ctx, db, &kind), KVC_OK);
    KVT_EQ(kind, KVC_MEMORY_DEVICE);
    KVT_EQ(kvc_memory_kind(ctx, msg, &kind), KVC_OK);
    KVT_EQ(kind, KVC_MEMORY_HOST);
    kvc_device_info info;
    KVT_EQ(kvc_get_device_info(ctx, &info), KVC_OK);
    KVT_CHECK(info.name[0] != 0 && info.sm_count > 0);
    kvo_backend_destroy(be);
    kvc_pool_destroy(ctx, dev);
    kvc_pool_destroy(ctx, host);
    kvc_pool_destroy(ctx, other);
    kvc_context_destroy(ctx);
}

/* kvb_seq_fork + appends on a device pool: the shared partial block is copied on the device by the
 * copy_block hook kvc_pool_create installs (a CPU memcpy of device memory would crash), bytes equal;
 * a truncate into a registered block too. Both layouts. */
static void test_fork_on_device_pool(void)
{
    NEED_GPU(ctx);
    const kvb_layout_kind kinds[2] = {KVB_LAYOUT_LAYER_SEPARATE, KVB_LAYOUT_BLOCK_CONTIGUOUS};
    for (int k = 0; k < 2; k++) {
        kvb_pool *pool = make_pool(ctx, KVC_MEMORY_DEVICE, 16, layout_of(kinds[k], 3, 4096 + 256));
        if (!pool) break;
        kvb_pool_config cfg;
        memset(&cfg, 0, sizeof cfg);
        KVT_EQ(kvb_pool_get_config(pool, &cfg), KVB_OK);
        KVT_CHECK(cfg.copy_block != NULL && cfg.copy_user == (void *)ctx);
        fill_random(ctx, pool, 500 + (uint64_t)k);
        uint32_t tokens[40];
        for (uint32_t i = 0; i < 40; i++) tokens[i] = 100 + i;
        kvb_seq *s = NULL, *t = NULL;
        KVT_EQ(kvb_seq_create(pool, NULL, &s), KVB_OK);
        KVT_EQ(kvb_seq_append(s, tokens, 20, NULL), KVB_OK);
        KVT_EQ(kvb_seq_commit(s, 20), KVB_OK);
        KVT_EQ(kvb_seq_fork(s, &t), KVB_OK);
        const kvb_block *table = NULL;
        size_t n = 0;
        KVT_EQ(kvb_seq_blocks(s, &table, &n), KVB_OK);
        uint32_t shared = kvb_block_index(table[1].id);
        uint64_t bytes = 0;
        unsigned char *before = snapshot(ctx, pool, &bytes);

        KVT_EQ(kvb_seq_append(s, tokens + 20, 1, NULL), KVB_OK); /* s copies the shared block */
        KVT_EQ(kvb_seq_append(t, tokens + 30, 1, NULL), KVB_OK); /* t is its last owner: writes in place */
        KVT_EQ(kvb_seq_blocks(s, &table, &n), KVB_OK);
        uint32_t copy = kvb_block_index(table[1].id);
        KVT_CHECK(copy != shared);
        unsigned char *after = snapshot(ctx, pool, &bytes);
        KVT_CHECK(same_block(before, pool, shared, after, pool, copy));
        KVT_CHECK(same_block(before, pool, shared, after, pool, shared));

        KVT_EQ(kvb_seq_append(s, tokens + 21, 11, NULL), KVB_OK);
        KVT_EQ(kvb_seq_commit(s, 32), KVB_OK); /* s's block 1 is registered: truncating into it copies */
        free(before);
        before = snapshot(ctx, pool, &bytes);
        KVT_EQ(kvb_seq_truncate(s, 24), KVB_OK);
        KVT_EQ(kvb_seq_blocks(s, &table, &n), KVB_OK);
        KVT_EQ(n, 2);
        free(after);
        after = snapshot(ctx, pool, &bytes);
        KVT_CHECK(kvb_block_index(table[1].id) != copy);
        KVT_CHECK(same_block(before, pool, copy, after, pool, kvb_block_index(table[1].id)));
        free(before);
        free(after);
        kvb_seq_destroy(s);
        kvb_seq_destroy(t);
        KVT_EQ(kvb_pool_check(pool, NULL, 0), KVB_OK);
        KVT_EQ(kvc_pool_destroy(ctx, pool), KVC_OK);
    }
    kvc_context_destroy(ctx);
}

/* A CUDA error left on the submitting thread by earlier, unrelated code (the engine's own failed
 * cudaMalloc, say) is not the copy kernel's: the job succeeds, every block lands. */
static void test_stale_thread_error(void)
{
    NEED_GPU(ctx);
    enum { NB = 16, N = 6 };
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_LAYER_SEPARATE, 2, 1024));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, NB, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 1024));
    kvo_backend *sync_be = NULL, *async_be = NULL;
    kvc_backend_config bc;
    memset(&bc, 0, sizeof bc);
    bc.method = KVC_COPY_KERNEL;
    KVT_EQ(kvc_backend_create(ctx, &bc, &async_be), KVC_OK);
    bc.sync = 1;
    KVT_EQ(kvc_backend_create(ctx, &bc, &sync_be), KVC_OK);
    if (!dev || !host || !sync_be || !async_be) return;
    fill_random(ctx, dev, 61);
    uint32_t si[N] = {1, 3, 5, 8, 9, 14}, di[N] = {0, 2, 4, 6, 7, 15};
    int res[N];
    char msg[256];
    kvo_backend *bes[2] = {sync_be, async_be};
    for (int k = 0; k < 2; k++) {
        KVT_CHECK(kvct_leave_error() != 0);
        KVT_EQ(run_job(bes[k], dev, host, si, di, N, res, NULL, msg), KVO_OK);
        if (msg[0]) fprintf(stderr, "  %s\n", msg);
        (void)kvct_take_error();
    }
    uint64_t a, b;
    unsigned char *sd = snapshot(ctx, dev, &a), *sh = snapshot(ctx, host, &b);
    size_t bad = 0;
    for (size_t i = 0; i < N; i++) bad += !same_block(sd, dev, si[i], sh, host, di[i]);
    KVT_EQ(bad, 0);
    free(sd);
    free(sh);
    kvo_backend_destroy(sync_be);
    kvo_backend_destroy(async_be);
    kvc_pool_destroy(ctx, dev);
    kvc_pool_destroy(ctx, host);
    kvc_context_destroy(ctx);
}

/* kvc_copy_block whose second span fails (a NULL destination: cudaErrorInvalidValue at the call) returns
 * -1 only after the first span's copy ended: kvblock then gives the new block back (KVB_ECOPY, nothing
 * changed), and nothing may write it any more. The first span is 1 GiB; its last page is read at once
 * through the legacy stream, which does not wait for the copy-on-write stream (a still running copy
 * has not reached it yet). Needs a GPU. */
static void test_copy_block_failure_waits(void)
{
    NEED_GPU(ctx);
    const size_t bytes = (size_t)1 << 30, tail = 4096;
    void *a = NULL, *b = NULL;
    KVT_EQ(kvc_device_alloc(ctx, bytes, &a), KVC_OK);
    KVT_EQ(kvc_device_alloc(ctx, bytes, &b), KVC_OK);
    unsigned char *h = (unsigned char *)malloc(tail);
    if (a && b && h) {
        KVT_EQ(kvct_slow_fill(a, bytes, 7, 0, NULL), 0);
        KVT_EQ(kvc_memcpy(ctx, h, (unsigned char *)a + bytes - tail, tail), KVC_OK); /* after the fill */
        size_t bad = 0;
        for (size_t i = 0; i < tail; i++) bad += h[i] != kvct_byte(7, bytes - tail + i);
        KVT_EQ(bad, 0);
        void *dst[2] = {b, NULL};
        const void *src[2] = {a, a};
        KVT_EQ(kvc_copy_block(ctx, dst, src, 2, bytes), -1);
        KVT_EQ(kvc_memcpy(ctx, h, (unsigned char *)b + bytes - tail, tail), KVC_OK);
        bad = 0;
        for (size_t i = 0; i < tail; i++) bad += h[i] != kvct_byte(7, bytes - tail + i);
        if (bad) fprintf(stderr, "  %zu of %zu bytes of the first span's end not copied at the return\n", bad, tail);
        KVT_EQ(bad, 0);
        KVT_CHECK(strstr(kvc_last_error_message(ctx), "copy-on-write") != NULL);
    }
    free(h);
    if (a) kvc_device_free(ctx, a);
    if (b) kvc_device_free(ctx, b);
    kvc_context_destroy(ctx);
}

typedef struct capture_arg {
    pthread_mutex_t m;
    pthread_cond_t c;
    int state; /* 0 starting, 1 capturing, -1 could not begin, 2 asked to end */
    int end_error;
} capture_arg;

static void *capture_main(void *p)
{
    capture_arg *a = (capture_arg *)p;
    void *s = kvct_capture_begin();
    pthread_mutex_lock(&a->m);
    a->state = s ? 1 : -1;
    pthread_cond_broadcast(&a->c);
    while (s && a->state != 2) pthread_cond_wait(&a->c, &a->m);
    pthread_mutex_unlock(&a->m);
    if (s) a->end_error = kvct_capture_end(s);
    return NULL;
}

/* Another thread begins a global-mode capture (capture_main) and holds it until capture_stop, which joins
 * it (ca->end_error: the capture's end). */
static void capture_start(capture_arg *ca, pthread_t *th)
{
    memset(ca, 0, sizeof *ca);
    pthread_mutex_init(&ca->m, NULL);
    pthread_cond_init(&ca->c, NULL);
    KVT_EQ(pthread_create(th, NULL, capture_main, ca), 0);
    pthread_mutex_lock(&ca->m);
    while (ca->state == 0) pthread_cond_wait(&ca->c, &ca->m);
    pthread_mutex_unlock(&ca->m);
    KVT_EQ(ca->state, 1);
}

static void capture_stop(capture_arg *ca, pthread_t th)
{
    pthread_mutex_lock(&ca->m);
    ca->state = 2;
    pthread_cond_broadcast(&ca->c);
    pthread_mutex_unlock(&ca->m);
    pthread_join(th, NULL);
}

/* Another thread captures a CUDA graph in global mode (PyTorch's default) while a job's copies run: the
 * completion worker's polls must neither fail the job early (done called while the copies still run)
 * nor invalidate that capture. */
static void test_capture_on_another_thread(void)
{
    NEED_GPU(ctx);
    enum { NB = 16, N = 6 };
    kvb_pool *dev = make_pool(ctx, KVC_MEMORY_DEVICE, NB, layout_of(KVB_LAYOUT_LAYER_SEPARATE, 2, 1024));
    kvb_pool *host = make_pool(ctx, KVC_MEMORY_PINNED, NB, layout_of(KVB_LAYOUT_BLOCK_CONTIGUOUS, 2, 1024));
    kvo_backend *be = NULL;
    KVT_EQ(kvc_backend_create(ctx, NULL, &be), KVC_OK);
    void *scratch = NULL;
    KVT_EQ(kvc_device_alloc(ctx, 4096, &scratch), KVC_OK);
    if (!dev || !host || !be || !scratch) return;
    fill_random(ctx, dev, 62);
    capture_arg ca;
    pthread_t th;
    capture_start(&ca, &th);
    /* about 100 ms of work ahead of the copies on their stream: the worker polls during the capture */
    KVT_EQ(kvct_slow_fill(scratch, 4096, 1, (long long)kvct_clock_khz() * 100, kvc_stream(ctx, KVC_D2H)), 0);
    uint32_t si[N] = {1, 3, 5, 8, 9, 14}, di[N] = {0, 2, 4, 6, 7, 15};
    int res[N];
    char msg[256];
    int r = run_job(be, dev, host, si, di, N, res, NULL, msg);
    capture_stop(&ca, th);
    KVT_EQ(r, KVO_OK);
    if (r != KVO_OK) fprintf(stderr, "  %s\n", msg);
    KVT_EQ(ca.end_error, 0); /* the capture was not invalidated */
    uint64_t a, b;
    unsigned char *sd = snapshot(ctx, dev, &a), *sh = snapshot(ctx, host, &b); /* at done: no sync first */
    size_t bad = 0;
    for (size_t i = 0; i < N; i++) bad += !same_block(sd, dev, si[i], sh, host, di[i]);
    KVT_EQ(bad, 0);
    free(sd);
    free(sh);
    KVT_EQ(kvc_synchronize(ctx), KVC_OK);
    kvo_backend_destroy(be);
    kvc_device_free(ctx, scratch);
    kvc_pool_destroy(ctx, dev);
    kvc_pool_destroy(ctx, host);
    pthread_mutex_destroy(&ca.m);
    pthread_cond_destroy(&ca.c);
    kvc_context_destroy(ctx);
}

/* kvc_copy_block (sequence copy-on-write on a device pool) while another thread captures a graph in
 * global mode: its wait on the copy-on-write stream neither fails nor invalidates that capture (relaxed
 * capture mode, as the submits). Needs a GPU. */
static void test_copy_block_while_another_thread_captures(void)
{
    NEED_GPU(ctx);
    const size_t bytes = (size_t)1 << 20;
    void *a = NULL, *b = NULL;
    unsigned char *h = (unsigned char *)malloc(bytes);
    KVT_EQ(kvc_device_alloc(ctx, bytes, &a), KVC_OK);
    KVT_EQ(kvc_device_alloc(ctx, bytes, &b), KVC_OK);
    if (!a || !b || !h) {
        free(h);
        kvc_context_destroy(ctx);
        return;
    }
    KVT_EQ(kvct_slow_fill(a, bytes, 9, 0, NULL), 0);
    KVT_EQ(kvc_synchronize(ctx), KVC_OK);
    capture_arg ca;
    pthread_t th;
    capture_start(&ca, &th);
    void *dst[1] = {b};
    const void *src[1] = {a};
    int r = kvc_copy_block(ctx, dst, src, 1, bytes);
    capture_stop(&ca, th);
    KVT_EQ(r, 0);
    if (r) fprintf(stderr, "  %s\n", kvc_last_error_message(ctx));
    KVT_EQ(ca.end_error, 0); /* the capture was not invalidated */
    KVT_EQ(kvc_memcpy(ctx, h, b, bytes), KVC_OK);
    size_t bad = 0;
    for (size_t i = 0; i < bytes; i++) bad += h[i] != kvct_byte(9, i);
    KVT_EQ(bad, 0);
    free(h);
    kvc_device_free(ctx, a);
    kvc_device_free(ctx, b);
    pthread_mutex_destroy(&ca.m);
    pthread_cond_destroy(&ca.c);
    kvc_context_destroy(ctx);
}

int main(void)
{
    signal(SIGALRM, watchdog_fired);
    alarm(300);
    KVT_RUN(test_result_strings);
    KVT_RUN(test_no_device_error);
    KVT_RUN(test_null_arguments);
    KVT_RUN(test_null_argument_messages);
    KVT_RUN(test_copy_block_null_spans);
    KVT_RUN(test_plan_on_host);
    KVT_RUN(test_roundtrip_block_contiguous);
    KVT_RUN(test_roundtrip_layer_separate);
    KVT_RUN(test_roundtrip_mixed_layouts);
    KVT_RUN(test_roundtrip_per_run_copies);
    KVT_RUN(test_precondition_event);
    KVT_RUN(test_cancel_before_upgrade);
    KVT_RUN(test_scattered_equals_one_by_one);
    KVT_RUN(test_copy_errors);
    KVT_RUN(test_fork_on_device_pool);
    KVT_RUN(test_manager_round_trip);
    KVT_RUN(test_concurrent_submitters);
    KVT_RUN(test_stale_thread_error);
    KVT_RUN(test_capture_on_another_thread);
    KVT_RUN(test_copy_block_while_another_thread_captures);
    KVT_RUN(test_copy_block_failure_waits);
    return kvt_summary();
}
