/* kvbench_cuda.c — benchmarks of the GPU tier (kvcuda.h): `make bench-cuda`.
 *
 * Keys (GB/s = 1e9 bytes/s; a 16-token block of a model with 32 layers, 8 KV heads, head dim 128,
 * fp16: 32 KiB pages, 2 MiB blocks):
 *   d2h_gbps, h2d_gbps          one contiguous 512 MiB copy between device memory and pinned host
 *                               memory (kvc_memcpy), median of 5
 *   scattered_vs_contiguous     256 random blocks copied device -> pinned by the kvcuda backend (one
 *                               job, automatic choice; layer-separate device pool as vLLM keeps it,
 *                               i.e. 16384 scattered 32 KiB pages) / one contiguous copy of the same
 *                               512 MiB; a ratio of times, median of 5; the _h2d and _block_contiguous
 *                               variants the same for the other direction and for 2 MiB whole blocks
 *   submit_us_per_block         host time inside backend->submit for jobs of 64 random blocks
 *                               (layer-separate, so 64 x 64 pages merged into kernel chunks), per block,
 *                               the median of 200 jobs; _block_contiguous: the same with whole blocks (DMA)
 *   submit_floor_us_per_block   the driver calls such a submit cannot do without, made bare in the same
 *                               place (kvbench_cuda_floor.cu: one launch with the same parameter bytes +
 *                               one event record; for whole blocks one cudaMemcpyBatchAsync of the same
 *                               64 copies + one event record)
 *   submit_vs_floor             submit / floor (and _block_contiguous), the median of the 200 jobs' own
 *                               ratios (each job's floor measured next to it): what kvcuda adds
 *   pinned_alloc_gbps           kvc_pinned_alloc of 1 GiB (mmap, parallel first touch, cudaHostRegister)
 *   scattered_after_small_jobs_vs_contiguous   the scattered device -> pinned job again, after 100
 *                               one-block jobs on the same backend / the contiguous copy
 *   copy_cpu_share              CPU time of the process / wall time while the scattered jobs above ran
 *                               (the submitting thread sleeps meanwhile: the share is the completion
 *                               workers' polling), in cores
 * Goals on an H100 / H200: scattered >= 0.8 of contiguous; contiguous pinned >= 45 GB/s one way; submit
 * <= 1.5 x its floor. (The first goal for submit, 0.25 us per block, was set before a GPU was at hand: on
 * an H100 the driver calls alone cost more than that from a thread that has just waited for copies.)
 *
 * Run:  build/kvbench_cuda            a table
 *       build/kvbench_cuda --json     one JSON object: {"device": {...}, "<key>": value, ..., "goals": {...}}
 * Without a CUDA device it prints {"skipped": "no CUDA device", "reason": "..."} (or one line) and
 * exits 0. Needs about 4.7 GiB of device memory and 1.7 GiB of pinned host memory.
 */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#include "kvoffload.h"
#include "kvcuda.h"

/* bench/kvbench_cuda_floor.cu */
int kvbench_floor_launch(unsigned grid, unsigned threads);
int kvbench_floor_copies(void **dsts, void **srcs, size_t *sizes, size_t n, int d2h, int device);
int kvbench_floor_wait(void);

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

enum { LAYERS = 32, BLOCK_TOKENS = 16, KV_HEADS = 8, HEAD_DIM = 128, DTYPE = 2 };
enum { DEV_BLOCKS = 2048, HOST_BLOCKS = 512, SCATTER = 256, SUBMIT_JOB = 64, SUBMIT_JOBS = 200, REPS = 5 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* n distinct random ids below limit, in random order */
static void random_ids(uint64_t *seed, uint32_t limit, uint32_t *out, size_t n)
{
    unsigned char *used = (unsigned char *)calloc(limit, 1);
    for (size_t k = 0; k < n;) {
        uint32_t id = (uint32_t)(rng_next(seed) % limit);
        if (!used[id]) {
            used[id] = 1;
            out[k++] = id;
        }
    }
    free(used);
}

static void print_json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

/* ---- one job, waited for ----------------------------------------------------------------------- */

typedef struct waiter {
    pthread_mutex_t m;
    pthread_cond_t c;
    int done, result;
} waiter;

static void job_done(kvo_copy_job *job, int result, const char *message)
{
    waiter *w = (waiter *)job->user;
    (void)message;
    pthread_mutex_lock(&w->m);
    w->done = 1;
    w->result = result;
    pthread_cond_signal(&w->c);
    pthread_mutex_unlock(&w->m);
}

/* Submit and wait; *submit_s gets the time spent inside submit. Returns the job result. */
static int run_job(kvo_backend *be, kvb_pool *src, kvb_pool *dst, const uint32_t *si, const uint32_t *di, size_t n,
                   double *submit_s)
{
    waiter w;
    kvo_copy_job job;
    int *res = (int *)calloc(n, sizeof *res);
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.m, NULL);
    pthread_cond_init(&w.c, NULL);
    memset(&job, 0, sizeof job);
    job.src = src;
    job.dst = dst;
    job.src_idx = si;
    job.dst_idx = di;
    job.n = n;
    job.results = res;
    job.done = job_done;
    job.user = &w;
    double t0 = now_s();
    int r = be->submit(be, &job);
    if (submit_s) *submit_s = now_s() - t0;
    if (r == KVO_OK) {
        pthread_mutex_lock(&w.m);
        while (!w.done) pthread_cond_wait(&w.c, &w.m);
        pthread_mutex_unlock(&w.m);
        r = w.result;
    }
    pthread_mutex_destroy(&w.m);
    pthread_cond_destroy(&w.c);
    free(res);
    return r;
}

typedef struct result {
    const char *name;
    double value;
    const char *unit;
    double goal; /* NAN: none */
    int at_most;
} result;

static result results[32];
static int n_results;

static void add(const char *name, double value, const char *unit, double goal, int at_most)
{
    result r = {name, value, unit, goal, at_most};
    results[n_results++] = r;
}

static int fail(kvc_context *ctx, const char *what, int r)
{
    fprintf(stderr, "kvbench_cuda: %s: %s (%s)\n", what, kvc_result_string(r), kvc_last_error_message(ctx));
    return 1;
}

/* Time (s) of one scattered job src -> dst through backend be, median of REPS. */
static double cpu_s(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + (double)u.ru_utime.tv_usec * 1e-6 + (double)u.ru_stime.tv_sec +
           (double)u.ru_stime.tv_usec * 1e-6;
}

/* CPU seconds the process spent while scattered jobs ran, and their wall seconds (copy_cpu_share) */
static double busy_cpu, busy_wall;

static double scattered_time(kvo_backend *be, kvb_pool *src, kvb_pool *dst, const uint32_t *si, const uint32_t *di,
                             size_t n, int *ok)
{
    double t[REPS];
    run_job(be, src, dst, si, di, n, NULL); /* warm-up */
    for (int k = 0; k < REPS; k++) {
        double t0 = now_s(), c0 = cpu_s();
        if (run_job(be, src, dst, si, di, n, NULL) != KVO_OK) *ok = 0;
        t[k] = now_s() - t0;
        busy_cpu += cpu_s() - c0;
        busy_wall += t[k];
    }
    return median(t, REPS);
}

static double contiguous_time(kvc_context *ctx, void *dst, const void *src, size_t bytes, int *ok)
{
    double t[REPS];
    kvc_memcpy(ctx, dst, src, bytes); /* warm-up */
    for (int k = 0; k < REPS; k++) {
        double t0 = now_s();
        if (kvc_memcpy(ctx, dst, src, bytes) != KVC_OK) *ok = 0;
        t[k] = now_s() - t0;
    }
    return median(t, REPS);
}

static int run(kvc_context *ctx, int json)
{
    kvc_device_info info;
    kvb_layout ls, bc;
    kvb_pool *dev_ls = NULL, *host_ls = NULL, *dev_bc = NULL, *host_bc = NULL;
    kvo_backend *be = NULL;
    kvc_result r;
    int ok = 1;
    uint64_t seed = 0x9e3779b97f4a7c15ull;

    if ((r = kvc_get_device_info(ctx, &info)) != KVC_OK) return fail(ctx, "kvc_get_device_info", r);
    kvb_layout_for_model(KVB_LAYOUT_LAYER_SEPARATE, BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, DTYPE, &ls);
    kvb_layout_for_model(KVB_LAYOUT_BLOCK_CONTIGUOUS, BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, DTYPE, &bc);
    const uint64_t block_bytes = ls.page_bytes * LAYERS * 2;
    const size_t scatter_bytes = (size_t)(SCATTER * block_bytes);

    /* pinned allocation speed (1 GiB) */
    {
        void *p = NULL;
        double t0 = now_s();
        if ((r = kvc_pinned_alloc(ctx, (size_t)1 << 30, &p)) != KVC_OK) return fail(ctx, "kvc_pinned_alloc", r);
        double dt = now_s() - t0;
        kvc_pinned_free(ctx, p);
        add("pinned_alloc_gbps", (double)(1u << 30) / dt / 1e9, "GB/s", NAN, 0);
    }

    kvb_pool_config c;
    memset(&c, 0, sizeof c);
    c.block_tokens = BLOCK_TOKENS;
    c.num_blocks = DEV_BLOCKS;
    c.layout = ls;
    if ((r = kvc_pool_create(ctx, KVC_MEMORY_DEVICE, &c, &dev_ls)) != KVC_OK) return fail(ctx, "device pool", r);
    c.num_blocks = HOST_BLOCKS;
    if ((r = kvc_pool_create(ctx, KVC_MEMORY_PINNED, &c, &host_ls)) != KVC_OK) return fail(ctx, "pinned pool", r);
    c.layout = bc;
    c.num_blocks = SCATTER + 64;
    if ((r = kvc_pool_create(ctx, KVC_MEMORY_DEVICE, &c, &dev_bc)) != KVC_OK) return fail(ctx, "device pool", r);
    if ((r = kvc_pool_create(ctx, KVC_MEMORY_PINNED, &c, &host_bc)) != KVC_OK) return fail(ctx, "pinned pool", r);
    if ((r = kvc_backend_create(ctx, NULL, &be)) != KVC_OK) return fail(ctx, "kvc_backend_create", r);

    void *dbase = NULL, *hbase = NULL;
    kvb_pool_storage(dev_ls, &dbase, NULL, NULL, NULL);
    kvb_pool_storage(host_ls, &hbase, NULL, NULL, NULL);

    /* contiguous bandwidth, the reference of the ratios */
    double t_d2h = contiguous_time(ctx, hbase, dbase, scatter_bytes, &ok);
    double t_h2d = contiguous_time(ctx, dbase, hbase, scatter_bytes, &ok);
    add("d2h_gbps", (double)scatter_bytes / t_d2h / 1e9, "GB/s", 45, 0);
    add("h2d_gbps", (double)scatter_bytes / t_h2d / 1e9, "GB/s", 45, 0);

    /* scattered: 256 random blocks */
    uint32_t si[SCATTER], di[SCATTER];
    random_ids(&seed, DEV_BLOCKS, si, SCATTER);
    random_ids(&seed, HOST_BLOCKS, di, SCATTER);
    double s_d2h = scattered_time(be, dev_ls, host_ls, si, di, SCATTER, &ok);
    double s_h2d = scattered_time(be, host_ls, dev_ls, di, si, SCATTER, &ok);
    add("scattered_vs_contiguous", t_d2h / s_d2h, "ratio", 0.8, 0);
    add("scattered_vs_contiguous_h2d", t_h2d / s_h2d, "ratio", 0.8, 0);
    add("scattered_gbps", (double)scatter_bytes / s_d2h / 1e9, "GB/s", NAN, 0);
    add("copy_cpu_share", busy_cpu / busy_wall, "cores", NAN, 1); /* the submitter waits: this is the workers */
    {
        uint32_t sb[SCATTER], db[SCATTER];
        void *b1 = NULL, *b2 = NULL;
        random_ids(&seed, SCATTER + 64, sb, SCATTER);
        random_ids(&seed, SCATTER + 64, db, SCATTER);
        kvb_pool_storage(dev_bc, &b1, NULL, NULL, NULL);
        kvb_pool_storage(host_bc, &b2, NULL, NULL, NULL);
        double tc = contiguous_time(ctx, b2, b1, scatter_bytes, &ok);
        double ts = scattered_time(be, dev_bc, host_bc, sb, db, SCATTER, &ok);
        add("scattered_vs_contiguous_block_contiguous", tc / ts, "ratio", 0.8, 0);
    }

    /* host submit cost, against the floor (kvbench_cuda_floor.cu): each timed call comes right after a
     * wait for copies, as an engine's offload thread would make it; floor and submit take turns at
     * being first after the wait, so both see the same thread state. */
    {
        kvo_backend *sub = NULL;
        if ((r = kvc_backend_create(ctx, NULL, &sub)) != KVC_OK) return fail(ctx, "kvc_backend_create", r);
        static double sub_k[SUBMIT_JOBS], flo_k[SUBMIT_JOBS], sub_bc[SUBMIT_JOBS], flo_bc[SUBMIT_JOBS];
        uint32_t a[SUBMIT_JOB], b[SUBMIT_JOB];
        void *dsts[SUBMIT_JOB], *srcs[SUBMIT_JOB];
        size_t sizes[SUBMIT_JOB];
        void *dbc = NULL, *hbc = NULL;
        kvb_pool_storage(dev_bc, &dbc, NULL, NULL, NULL);
        kvb_pool_storage(host_bc, &hbc, NULL, NULL, NULL);
        for (int k = 0; k < SUBMIT_JOBS + 10; k++) {
            double dt = 0, df = 0, t0;
            random_ids(&seed, DEV_BLOCKS, a, SUBMIT_JOB);
            random_ids(&seed, HOST_BLOCKS, b, SUBMIT_JOB);
            for (int turn = 0; turn < 2; turn++) {
                if ((turn ^ k) & 1) {
                    if (run_job(sub, dev_ls, host_ls, a, b, SUBMIT_JOB, &dt) != KVO_OK) ok = 0;
                } else {
                    t0 = now_s();
                    if (kvbench_floor_launch(16, 512) != 0) ok = 0; /* the backend's default grid */
                    df = now_s() - t0;
                    if (kvbench_floor_wait() != 0) ok = 0;
                }
            }
            if (k >= 10) sub_k[k - 10] = dt, flo_k[k - 10] = df;

            random_ids(&seed, SCATTER + 64, a, SUBMIT_JOB);
            random_ids(&seed, SCATTER + 64, b, SUBMIT_JOB);
            for (int i = 0; i < SUBMIT_JOB; i++) {
                srcs[i] = (unsigned char *)dbc + (size_t)a[i] * block_bytes;
                dsts[i] = (unsigned char *)hbc + (size_t)b[i] * block_bytes;
                sizes[i] = (size_t)block_bytes;
            }
            for (int turn = 0; turn < 2; turn++) {
                if ((turn ^ k) & 1) {
                    if (run_job(sub, dev_bc, host_bc, a, b, SUBMIT_JOB, &dt) != KVO_OK) ok = 0;
                } else {
                    t0 = now_s();
                    if (kvbench_floor_copies(dsts, srcs, sizes, SUBMIT_JOB, 1, info.device) != 0) ok = 0;
                    df = now_s() - t0;
                    if (kvbench_floor_wait() != 0) ok = 0;
                }
            }
            if (k >= 10) sub_bc[k - 10] = dt, flo_bc[k - 10] = df;
        }
        /* medians of the 200 jobs (a stall of this shared machine in one of them moves nothing); the ratio
         * is the median of each job's submit over the floor measured next to it, under the same conditions */
        static double rk[SUBMIT_JOBS], rb[SUBMIT_JOBS];
        for (int i = 0; i < SUBMIT_JOBS; i++) rk[i] = sub_k[i] / flo_k[i], rb[i] = sub_bc[i] / flo_bc[i];
        const double per = 1e6 / SUBMIT_JOB;
        add("submit_us_per_block", median(sub_k, SUBMIT_JOBS) * per, "us", NAN, 1);
        add("submit_floor_us_per_block", median(flo_k, SUBMIT_JOBS) * per, "us", NAN, 1);
        add("submit_vs_floor", median(rk, SUBMIT_JOBS), "ratio", 1.5, 1);
        add("submit_us_per_block_block_contiguous", median(sub_bc, SUBMIT_JOBS) * per, "us", NAN, 1);
        add("submit_floor_us_per_block_block_contiguous", median(flo_bc, SUBMIT_JOBS) * per, "us", NAN, 1);
        add("submit_vs_floor_block_contiguous", median(rb, SUBMIT_JOBS), "ratio", 1.5, 1);
        kvo_backend_destroy(sub);
    }

    /* the big scattered job again, on the same backend, right after 100 one-block jobs: its completion
     * worker must not have learnt from them to sleep past the big job's end */
    {
        uint32_t a1, b1;
        int ok1 = 1;
        for (int k = 0; k < 100; k++) {
            random_ids(&seed, DEV_BLOCKS, &a1, 1);
            random_ids(&seed, HOST_BLOCKS, &b1, 1);
            if (run_job(be, dev_ls, host_ls, &a1, &b1, 1, NULL) != KVO_OK) ok1 = 0;
        }
        double after = scattered_time(be, dev_ls, host_ls, si, di, SCATTER, &ok);
        if (!ok1) ok = 0;
        add("scattered_after_small_jobs_vs_contiguous", t_d2h / after, "ratio", 0.8, 0);
    }
    kvc_backend_stats st;
    kvc_backend_get_stats(be, &st);

    if (json) {
        printf("{\n  \"device\": {\"name\": ");
        print_json_string(info.name);
        printf(", \"cc\": \"%d.%d\", \"sms\": %d, \"driver\": %d, \"runtime\": %d, \"batch_copy\": %d},\n",
               info.cc_major, info.cc_minor, info.sm_count, info.driver_version, info.runtime_version,
               info.batch_copy);
        for (int i = 0; i < n_results; i++) printf("  \"%s\": %.6g,\n", results[i].name, results[i].value);
        printf("  \"scattered_kernel_jobs\": %llu, \"scattered_dma_jobs\": %llu, \"all_copies_ok\": %s,\n",
               (unsigned long long)st.kernel_jobs, (unsigned long long)st.dma_jobs, ok ? "true" : "false");
        printf("  \"goals\": {");
        const char *sep = "";
        for (int i = 0; i < n_results; i++) {
            if (isnan(results[i].goal)) continue;
            printf("%s\"%s\": %g", sep, results[i].name, results[i].goal);
            sep = ", ";
        }
        printf("}\n}\n");
    } else {
        printf("device: %s (cc %d.%d, %d SMs), driver %d, runtime %d, cudaMemcpyBatchAsync %s\n", info.name,
               info.cc_major, info.cc_minor, info.sm_count, info.driver_version, info.runtime_version,
               info.batch_copy ? "yes" : "no");
        for (int i = 0; i < n_results; i++) {
            char goal[32] = "-";
            if (!isnan(results[i].goal))
                snprintf(goal, sizeof goal, "%s %g", results[i].at_most ? "<=" : ">=", results[i].goal);
            int pass = isnan(results[i].goal) ||
                       (results[i].at_most ? results[i].value <= results[i].goal : results[i].value >= results[i].goal);
            printf("%-42s %10.3f  %-6s %8s  %s\n", results[i].name, results[i].value, results[i].unit, goal,
                   isnan(results[i].goal) ? "" : pass ? "pass" : "MISS");
        }
        if (!ok) printf("some copies failed: %s\n", kvc_last_error_message(ctx));
    }
    kvo_backend_destroy(be);
    kvc_pool_destroy(ctx, dev_ls);
    kvc_pool_destroy(ctx, host_ls);
    kvc_pool_destroy(ctx, dev_bc);
    kvc_pool_destroy(ctx, host_bc);
    return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else {
            fprintf(stderr, "usage: kvbench_cuda [--json]\n  Benchmarks kvcuda (GPU tier); a table, or one JSON object.\n");
            return strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ? 0 : 2;
        }
    }
    kvc_context *ctx = NULL;
    kvc_result r = kvc_context_create(0, &ctx);
    if (r == KVC_ENODEVICE) {
        if (json) {
            printf("{\"skipped\": \"no CUDA device\", \"reason\": ");
            print_json_string(kvc_last_error_message(ctx));
            printf("}\n");
        } else {
            printf("skipped: no CUDA device (%s)\n", kvc_last_error_message(ctx));
        }
        kvc_context_destroy(ctx);
        return 0;
    }
    if (r != KVC_OK) {
        fprintf(stderr, "kvbench_cuda: kvc_context_create: %s (%s)\n", kvc_result_string(r), kvc_last_error_message(ctx));
        kvc_context_destroy(ctx);
        return 1;
    }
    int rc = run(ctx, json);
    kvc_context_destroy(ctx);
    return rc;
}
