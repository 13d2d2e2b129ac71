/* kvcuda.cu — the GPU tier of kvcache: device and pinned memory, copy streams, CUDA events as offload
 * preconditions, and a kvoffload copy backend (merged runs, batched DMA or a gather/scatter kernel).
 *
 * The API and its manual are in kvcuda.h. Compiled by nvcc (`make cuda`); it calls only the public
 * kvb_ / kvo_ functions, whose implementation comes from the program's own C translation unit
 * (KVBLOCK_IMPLEMENTATION and KVOFFLOAD_IMPLEMENTATION are deliberately not defined here).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda_runtime.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "kvcuda.h"

/* cudaMemcpyBatchAsync: CUDA 12.8 added it with a failIdx argument, CUDA 13.0 dropped that argument. */
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
#define KVC__BATCH_API 2
#elif defined(CUDART_VERSION) && CUDART_VERSION >= 12080
#define KVC__BATCH_API 1
#else
#define KVC__BATCH_API 0
#endif

#define KVC__MSG 256
#define KVC__KERNEL_CHUNK (64u * 1024u)  /* kernel work item: runs are split into chunks of this */
#define KVC__DESC_MIN 4096               /* initial kernel descriptor capacity of a job slot */
#define KVC__INLINE_DESCS 160            /* descriptors passed in the launch itself (3840 of 4096 bytes) */

#if defined(__GNUC__)
#define KVC__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KVC__PRINTF(a, b)
#endif

/* ---- results ------------------------------------------------------------------------------------ */

extern "C" const char *kvc_result_string(int result)
{
    switch (result) {
#define KVC__CASE(name, value, text) \
    case value:                     \
        return text;
        KVC__RESULTS(KVC__CASE)
#undef KVC__CASE
    default:
        return kvo_result_string(result);
    }
}

/* ---- context ------------------------------------------------------------------------------------ */

typedef enum kvc__how { KVC__CUDA_MALLOC = 1, KVC__MMAP_REGISTER, KVC__HOST_ALLOC } kvc__how;

typedef struct kvc__alloc {
    void *ptr;
    size_t bytes;   /* as asked */
    size_t mapped;  /* mmap length (page-rounded) */
    kvc_memory kind;
    kvc__how how;
    kvc_memory seen;  /* what cudaPointerGetAttributes said of ptr when it was remembered, */
    void *dev;        /* with its address for kernels, */
    int device;       /* and its device: the copy backend's submit asks the table, not the driver */
} kvc__alloc;

struct kvc_context {
    kvc_result status;    /* KVC_OK, or why the context is unusable */
    int device;
    cudaStream_t stream[2];
    cudaStream_t cow_stream; /* sequence copy-on-write of device pools (kvc__copy_block) */
    int batch_ok;         /* cudaMemcpyBatchAsync usable (atomic) */
    kvc_device_info info;
    pthread_mutex_t lock; /* message, allocations */
    char message[KVC__MSG];
    kvc__alloc *allocs;
    size_t n_allocs, cap_allocs;
};

static void kvc__vset(kvc_context *ctx, const char *fmt, va_list ap)
{
    if (!ctx) return;
    pthread_mutex_lock(&ctx->lock);
    vsnprintf(ctx->message, sizeof ctx->message, fmt, ap);
    pthread_mutex_unlock(&ctx->lock);
}

static kvc_result kvc__fail(kvc_context *ctx, kvc_result code, const char *fmt, ...) KVC__PRINTF(3, 4);
static kvc_result kvc__fail(kvc_context *ctx, kvc_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvc__vset(ctx, fmt, ap);
    va_end(ap);
    return code;
}

/* A CUDA error as "cudaErrorX: text", clearing the thread's last error. */
static const char *kvc__cuda_text(cudaError_t e, char *buf, size_t size)
{
    (void)cudaGetLastError();
    snprintf(buf, size, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    return buf;
}

static kvc_result kvc__cuda_fail(kvc_context *ctx, cudaError_t e, const char *what)
{
    char t[160];
    kvc_result code = e == cudaErrorMemoryAllocation ? KVC_ENOMEM : KVC_ECUDA;
    return kvc__fail(ctx, code, "%s failed: %s", what, kvc__cuda_text(e, t, sizeof t));
}

/* A call selects its context's device on the calling thread and gives the caller's back when it
 * returns: an engine that drives several GPUs from one thread keeps the device it chose. */
struct kvc__device_scope {
    int prev; /* the caller's device, where the call changed it; -1 = unchanged */
    kvc__device_scope() : prev(-1) {}
    ~kvc__device_scope()
    {
        if (prev >= 0) cudaSetDevice(prev);
    }
    kvc__device_scope(const kvc__device_scope &) = delete;
    kvc__device_scope &operator=(const kvc__device_scope &) = delete;
};

static cudaError_t kvc__select(kvc__device_scope *scope, int device)
{
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == device) return cudaSuccess;
    if (scope->prev < 0 && cur >= 0) scope->prev = cur;
    return cudaSetDevice(device);
}

/* KVC_OK when ctx may be used; selects its device on this thread until `scope` ends. */
static kvc_result kvc__enter(kvc_context *ctx, kvc__device_scope *scope)
{
    cudaError_t e;
    if (!ctx) return KVC_EINVAL;
    if (ctx->status != KVC_OK) return ctx->status;
    e = kvc__select(scope, ctx->device);
    if (e != cudaSuccess) return kvc__cuda_fail(ctx, e, "cudaSetDevice");
    return KVC_OK;
}

extern "C" kvc_result kvc_probe(kvc_probe_info *out)
{
    int n = 0;
    cudaError_t e;
    char t[160];
    if (!out) return KVC_EINVAL;
    memset(out, 0, sizeof *out);
    cudaRuntimeGetVersion(&out->runtime_version);
    cudaDriverGetVersion(&out->driver_version); /* 0 when no driver is installed */
    e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0) {
        out->device_count = n;
        return KVC_OK;
    }
    if (e == cudaSuccess) {
        snprintf(out->message, sizeof out->message, "cudaGetDeviceCount reports 0 devices");
        return KVC_ENODEVICE;
    }
    kvc__cuda_text(e, t, sizeof t);
    if (out->driver_version == 0) {
        snprintf(out->message, sizeof out->message, "no CUDA driver (libcuda.so.1 not loadable; %s)", t);
        return KVC_ENODRIVER;
    }
    if (e == cudaErrorInsufficientDriver || e == cudaErrorSystemDriverMismatch ||
        e == cudaErrorCompatNotSupportedOnDevice) {
        snprintf(out->message, sizeof out->message, "CUDA driver %d.%d cannot run runtime %d.%d (%s)",
                 out->driver_version / 1000, out->driver_version % 1000 / 10, out->runtime_version / 1000,
                 out->runtime_version % 1000 / 10, t);
        return KVC_ENODRIVER;
    }
    snprintf(out->message, sizeof out->message, "cudaGetDeviceCount failed: %s", t);
    return KVC_ENODEVICE;
}

extern "C" kvc_result kvc_context_create(int device, kvc_context **out)
{
    kvc__device_scope ds;
    kvc_context *ctx;
    kvc_probe_info p;
    kvc_result r;
    cudaError_t e;
    struct cudaDeviceProp prop;
    int i, v = 0;
    if (!out) return KVC_EINVAL;
    *out = NULL;
    ctx = (kvc_context *)calloc(1, sizeof *ctx);
    if (!ctx) return KVC_ENOMEM;
    if (pthread_mutex_init(&ctx->lock, NULL) != 0) {
        free(ctx);
        return KVC_ENOMEM;
    }
    ctx->device = device;
    *out = ctx;
    r = kvc_probe(&p);
    if (r != KVC_OK)
        return ctx->status = kvc__fail(ctx, KVC_ENODEVICE, "no CUDA device: %s", p.message);
    if (device < 0 || device >= p.device_count)
        return ctx->status = kvc__fail(ctx, KVC_ENODEVICE, "no CUDA device %d: %d device(s) present", device,
                                       p.device_count);
    e = kvc__select(&ds, device);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) {
        r = kvc__cuda_fail(ctx, e, "initializing the CUDA device");
        return ctx->status = r == KVC_ENOMEM ? KVC_ENOMEM : KVC_ECUDA;
    }
    for (i = 0; i < 2; i++) {
        e = cudaStreamCreateWithFlags(&ctx->stream[i], cudaStreamNonBlocking);
        if (e != cudaSuccess) return ctx->status = kvc__cuda_fail(ctx, e, "cudaStreamCreateWithFlags");
    }
    e = cudaStreamCreateWithFlags(&ctx->cow_stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) return ctx->status = kvc__cuda_fail(ctx, e, "cudaStreamCreateWithFlags");
    ctx->info.device = device;
    snprintf(ctx->info.name, sizeof ctx->info.name, "%s", prop.name);
    ctx->info.total_bytes = prop.totalGlobalMem;
    ctx->info.cc_major = prop.major;
    ctx->info.cc_minor = prop.minor;
    ctx->info.sm_count = prop.multiProcessorCount;
    ctx->info.driver_version = p.driver_version;
    ctx->info.runtime_version = p.runtime_version;
    ctx->info.host_mapped = prop.canMapHostMemory ? 1 : 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrCanMapHostMemory, device) == cudaSuccess)
        ctx->info.host_mapped = v ? 1 : 0;
    ctx->batch_ok = KVC__BATCH_API && p.driver_version >= 12080;
    ctx->info.batch_copy = ctx->batch_ok;
    ctx->status = KVC_OK;
    return KVC_OK;
}

static void kvc__free_alloc(const kvc__alloc *a)
{
    switch (a->how) {
    case KVC__CUDA_MALLOC:
        cudaFree(a->ptr);
        break;
    case KVC__MMAP_REGISTER:
        cudaHostUnregister(a->ptr);
        munmap(a->ptr, a->mapped);
        break;
    case KVC__HOST_ALLOC:
        cudaFreeHost(a->ptr);
        break;
    }
    (void)cudaGetLastError();
}

extern "C" void kvc_context_destroy(kvc_context *ctx)
{
    kvc__device_scope ds;
    size_t i;
    if (!ctx) return;
    if (ctx->status == KVC_OK) {
        kvc__select(&ds, ctx->device);
        for (i = 0; i < 2; i++) cudaStreamSynchronize(ctx->stream[i]);
    }
    for (i = 0; i < ctx->n_allocs; i++) kvc__free_alloc(&ctx->allocs[i]);
    for (i = 0; i < 2; i++)
        if (ctx->stream[i]) cudaStreamDestroy(ctx->stream[i]);
    if (ctx->cow_stream) cudaStreamDestroy(ctx->cow_stream);
    (void)cudaGetLastError();
    free(ctx->allocs);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
}

extern "C" const char *kvc_last_error_message(const kvc_context *ctx)
{
    return ctx ? ctx->message : "no context";
}

extern "C" size_t kvc_copy_error_message(kvc_context *ctx, char *buf, size_t size)
{
    size_t n;
    if (!ctx) {
        if (buf && size) snprintf(buf, size, "no context");
        return 10;
    }
    pthread_mutex_lock(&ctx->lock);
    n = strlen(ctx->message);
    if (buf && size) snprintf(buf, size, "%s", ctx->message);
    pthread_mutex_unlock(&ctx->lock);
    return n;
}

extern "C" kvc_result kvc_context_status(const kvc_context *ctx)
{
    return ctx ? ctx->status : KVC_EINVAL;
}

extern "C" kvc_result kvc_get_device_info(kvc_context *ctx, kvc_device_info *out)
{
    kvc__device_scope ds;
    kvc_result r;
    size_t fr = 0, tot = 0;
    if (!out) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_get_device_info: NULL out") : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    *out = ctx->info;
    out->batch_copy = __atomic_load_n(&ctx->batch_ok, __ATOMIC_RELAXED);
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) out->free_bytes = fr;
    (void)cudaGetLastError();
    return KVC_OK;
}

extern "C" void *kvc_stream(kvc_context *ctx, kvc_direction direction)
{
    if (!ctx || ctx->status != KVC_OK || (direction != KVC_H2D && direction != KVC_D2H)) return NULL;
    return (void *)ctx->stream[direction];
}

extern "C" kvc_result kvc_synchronize(kvc_context *ctx)
{
    kvc__device_scope ds;
    kvc_result r;
    int i;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    for (i = 0; i < 2; i++) {
        cudaError_t e = cudaStreamSynchronize(ctx->stream[i]);
        if (e != cudaSuccess) return kvc__cuda_fail(ctx, e, "cudaStreamSynchronize");
    }
    return KVC_OK;
}

/* ---- allocations -------------------------------------------------------------------------------- */

static kvc_memory kvc__classify(const void *p, void **dev, int *device);

static kvc_result kvc__remember(kvc_context *ctx, kvc__alloc *a)
{
    kvc_result r = KVC_OK;
    a->seen = kvc__classify(a->ptr, &a->dev, &a->device);
    pthread_mutex_lock(&ctx->lock);
    if (ctx->n_allocs == ctx->cap_allocs) {
        size_t cap = ctx->cap_allocs ? ctx->cap_allocs * 2 : 16;
        kvc__alloc *p = (kvc__alloc *)realloc(ctx->allocs, cap * sizeof *p);
        if (p) {
            ctx->allocs = p;
            ctx->cap_allocs = cap;
        } else {
            r = KVC_ENOMEM;
        }
    }
    if (r == KVC_OK) ctx->allocs[ctx->n_allocs++] = *a;
    pthread_mutex_unlock(&ctx->lock);
    if (r != KVC_OK) {
        kvc__free_alloc(a);
        kvc__fail(ctx, r, "out of host memory for the allocation table");
    }
    return r;
}

/* Take the allocation starting at ptr of this kind out of the table. */
static int kvc__forget(kvc_context *ctx, void *ptr, kvc_memory kind, kvc__alloc *out)
{
    size_t i;
    int found = 0;
    pthread_mutex_lock(&ctx->lock);
    for (i = 0; i < ctx->n_allocs; i++) {
        if (ctx->allocs[i].ptr == ptr && ctx->allocs[i].kind == kind) {
            *out = ctx->allocs[i];
            ctx->allocs[i] = ctx->allocs[--ctx->n_allocs];
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    return found;
}

extern "C" kvc_result kvc_device_alloc(kvc_context *ctx, size_t bytes, void **out)
{
    kvc__device_scope ds;
    kvc_result r;
    kvc__alloc a;
    cudaError_t e;
    void *p = NULL;
    char t[160];
    if (!out || !bytes) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_device_alloc: NULL out or 0 bytes") : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        size_t fr = 0, tot = 0;
        kvc__cuda_text(e, t, sizeof t);
        cudaMemGetInfo(&fr, &tot);
        (void)cudaGetLastError();
        return kvc__fail(ctx, e == cudaErrorMemoryAllocation ? KVC_ENOMEM : KVC_ECUDA,
                         "cudaMalloc of %zu bytes on device %d failed: %s (free %zu of %zu bytes)", bytes,
                         ctx->device, t, fr, tot);
    }
    e = cudaMemsetAsync(p, 0, bytes, ctx->stream[KVC_H2D]);
    if (e == cudaSuccess) e = cudaStreamSynchronize(ctx->stream[KVC_H2D]);
    if (e != cudaSuccess) {
        cudaFree(p);
        return kvc__cuda_fail(ctx, e, "cudaMemset of new device memory");
    }
    memset(&a, 0, sizeof a);
    a.ptr = p;
    a.bytes = a.mapped = bytes;
    a.kind = KVC_MEMORY_DEVICE;
    a.how = KVC__CUDA_MALLOC;
    if ((r = kvc__remember(ctx, &a)) != KVC_OK) return r;
    *out = p;
    return KVC_OK;
}

extern "C" kvc_result kvc_device_free(kvc_context *ctx, void *ptr)
{
    kvc__device_scope ds;
    kvc__alloc a;
    if (!ctx || !ptr) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_device_free: NULL pointer") : KVC_EINVAL;
    if (!kvc__forget(ctx, ptr, KVC_MEMORY_DEVICE, &a))
        return kvc__fail(ctx, KVC_ENOTFOUND, "kvc_device_free: %p is not device memory of this context", ptr);
    if (ctx->status == KVC_OK) kvc__select(&ds, ctx->device);
    kvc__free_alloc(&a);
    return KVC_OK;
}

typedef struct kvc__touch { unsigned char *p; size_t len, step; } kvc__touch;

static void *kvc__touch_main(void *arg)
{
    kvc__touch *t = (kvc__touch *)arg;
    size_t off;
    for (off = 0; off < t->len; off += t->step) ((volatile unsigned char *)t->p)[off] = 0;
    return NULL;
}

/* Fault every page of [p, p + len) in, in parallel: a few threads, each a 2 MiB-aligned share. */
static void kvc__first_touch(unsigned char *p, size_t len, size_t page)
{
    enum { MAX_THREADS = 8 };
    const size_t huge = (size_t)2 << 20;
    pthread_t th[MAX_THREADS];
    kvc__touch part[MAX_THREADS];
    int started[MAX_THREADS];
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t n = len / ((size_t)64 << 20) + 1, share, off = 0, i;
    if (cpus < 1) cpus = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n > (size_t)cpus) n = (size_t)cpus;
    share = (len / n + huge - 1) / huge * huge;
    for (i = 0; i < n; i++) {
        part[i].p = p + off;
        part[i].len = off >= len ? 0 : (len - off < share ? len - off : share);
        part[i].step = page;
        off += part[i].len;
        started[i] = i > 0 && part[i].len && pthread_create(&th[i], NULL, kvc__touch_main, &part[i]) == 0;
    }
    kvc__touch_main(&part[0]);
    for (i = 1; i < n; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            kvc__touch_main(&part[i]);
    }
}

extern "C" kvc_result kvc_pinned_alloc(kvc_context *ctx, size_t bytes, void **out)
{
    kvc__device_scope ds;
    kvc_result r;
    kvc__alloc a;
    cudaError_t e;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), len;
    void *p;
    char reg[224] = "", t[160];
    if (!out || !bytes) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_pinned_alloc: NULL out or 0 bytes") : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    if (page < 4096) page = 4096;
    len = (bytes + page - 1) / page * page;
    memset(&a, 0, sizeof a);
    a.bytes = bytes;
    a.kind = KVC_MEMORY_PINNED;
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        snprintf(reg, sizeof reg, "mmap of %zu bytes: %s", len, strerror(errno));
    } else {
#ifdef MADV_HUGEPAGE
        if (len >= ((size_t)2 << 20)) madvise(p, len, MADV_HUGEPAGE);
#endif
        kvc__first_touch((unsigned char *)p, len, page);
        e = cudaHostRegister(p, len, cudaHostRegisterPortable | cudaHostRegisterMapped);
        if (e == cudaSuccess) {
            a.ptr = p;
            a.mapped = len;
            a.how = KVC__MMAP_REGISTER;
        } else {
            snprintf(reg, sizeof reg, "cudaHostRegister of %zu bytes: %s", len, kvc__cuda_text(e, t, sizeof t));
            munmap(p, len);
        }
    }
    if (!a.ptr) {
        p = NULL;
        e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
        if (e != cudaSuccess)
            return kvc__fail(ctx, KVC_ENOMEM, "pinned allocation of %zu bytes failed: %s; cudaHostAlloc: %s", bytes,
                             reg, kvc__cuda_text(e, t, sizeof t));
        memset(p, 0, bytes);
        a.ptr = p;
        a.mapped = bytes;
        a.how = KVC__HOST_ALLOC;
    }
    if ((r = kvc__remember(ctx, &a)) != KVC_OK) return r;
    *out = a.ptr;
    return KVC_OK;
}

extern "C" kvc_result kvc_pinned_free(kvc_context *ctx, void *ptr)
{
    kvc__device_scope ds;
    kvc__alloc a;
    if (!ctx || !ptr) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_pinned_free: NULL pointer") : KVC_EINVAL;
    if (!kvc__forget(ctx, ptr, KVC_MEMORY_PINNED, &a))
        return kvc__fail(ctx, KVC_ENOTFOUND, "kvc_pinned_free: %p is not pinned memory of this context", ptr);
    if (ctx->status == KVC_OK) kvc__select(&ds, ctx->device);
    kvc__free_alloc(&a);
    return KVC_OK;
}

/* Kind of memory at p and the address a kernel on this device uses for it (NULL: none). */
static kvc_memory kvc__classify(const void *p, void **dev, int *device)
{
    struct cudaPointerAttributes a;
    cudaError_t e;
    memset(&a, 0, sizeof a);
    *dev = NULL;
    *device = -1;
    e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return KVC_MEMORY_HOST;
    }
    switch (a.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
        *dev = a.devicePointer ? a.devicePointer : (void *)p;
        *device = a.device;
        return KVC_MEMORY_DEVICE;
    case cudaMemoryTypeHost:
        *dev = a.devicePointer;
        return KVC_MEMORY_PINNED;
    default:
        return KVC_MEMORY_HOST;
    }
}

/* The context's allocation holding p, copied to *out. 0: none. */
static int kvc__alloc_of(kvc_context *ctx, const void *p, kvc__alloc *out)
{
    const unsigned char *q = (const unsigned char *)p;
    size_t i;
    int found = 0;
    pthread_mutex_lock(&ctx->lock);
    for (i = 0; i < ctx->n_allocs && !found; i++) {
        const unsigned char *b = (const unsigned char *)ctx->allocs[i].ptr;
        if (q >= b && q < b + ctx->allocs[i].bytes) {
            *out = ctx->allocs[i];
            found = 1;
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    return found;
}

extern "C" kvc_result kvc_memory_kind(kvc_context *ctx, const void *ptr, kvc_memory *out)
{
    kvc__device_scope ds;
    kvc_result r;
    kvc__alloc a;
    void *dev;
    int device;
    if (!ptr || !out) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_memory_kind: NULL argument") : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    *out = kvc__alloc_of(ctx, ptr, &a) ? a.kind : kvc__classify(ptr, &dev, &device);
    return KVC_OK;
}

extern "C" kvc_result kvc_memcpy(kvc_context *ctx, void *dst, const void *src, size_t bytes)
{
    kvc__device_scope ds;
    kvc_result r;
    cudaError_t e;
    if (!dst || !src) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_memcpy: NULL pointer") : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    if (!bytes) return KVC_OK;
    e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
    if (e != cudaSuccess) return kvc__cuda_fail(ctx, e, "cudaMemcpy");
    return KVC_OK;
}

/* ---- pools -------------------------------------------------------------------------------------- */

extern "C" kvc_result kvc_pool_storage_alloc(kvc_context *ctx, kvc_memory where, kvb_pool_config *config)
{
    kvc__device_scope ds;
    kvc_result r;
    kvb_layout l;
    uint64_t per_block, total;
    void *p = NULL;
    if (!config || (where != KVC_MEMORY_DEVICE && where != KVC_MEMORY_PINNED))
        return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_pool_storage_alloc: NULL config or memory kind not device/pinned")
                   : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    l = config->layout;
    if (!l.num_layers) l.num_layers = 1;
    if (!l.num_parts) l.num_parts = 2;
    if (!config->num_blocks || !l.page_bytes || (l.kind != KVB_LAYOUT_BLOCK_CONTIGUOUS && l.kind != KVB_LAYOUT_LAYER_SEPARATE))
        return kvc__fail(ctx, KVC_EINVAL, "kvc_pool_storage_alloc: num_blocks, layout.page_bytes and a layout kind are required");
    per_block = (uint64_t)l.num_layers * l.num_parts;
    if (l.page_bytes > UINT64_MAX / per_block || l.page_bytes * per_block > UINT64_MAX / config->num_blocks ||
        l.page_bytes * per_block * config->num_blocks > (uint64_t)SIZE_MAX)
        return kvc__fail(ctx, KVC_EINVAL, "kvc_pool_storage_alloc: pool size overflows");
    total = l.page_bytes * per_block * config->num_blocks;
    r = where == KVC_MEMORY_DEVICE ? kvc_device_alloc(ctx, (size_t)total, &p) : kvc_pinned_alloc(ctx, (size_t)total, &p);
    if (r != KVC_OK) return r;
    config->layout = l;
    config->storage = KVB_STORAGE_EXTERNAL;
    config->external_base = p;
    config->external_bytes = total;
    return KVC_OK;
}

/* kvb_pool_config.copy_block of a device pool (sequence copy-on-write and truncate): one device-to-
 * device cudaMemcpyAsync per span on the context's own copy-on-write stream, then a wait for that
 * stream only, so offloads in flight on the copy streams do not hold the pool's lock. */
static cudaError_t kvc__copy_spans(kvc_context *ctx, void *const *dst, const void *const *src, size_t n, uint64_t bytes)
{
    cudaError_t e = cudaSuccess;
    size_t i;
    for (i = 0; i < n && e == cudaSuccess; i++)
        e = cudaMemcpyAsync(dst[i], src[i], (size_t)bytes, cudaMemcpyDeviceToDevice, ctx->cow_stream);
    if (e == cudaSuccess) return cudaStreamSynchronize(ctx->cow_stream);
    cudaStreamSynchronize(ctx->cow_stream); /* spans queued before the failed one: ended before -1 */
    return e;
}

extern "C" int kvc_copy_block(void *user, void *const *dst, const void *const *src, size_t n, uint64_t bytes)
{
    kvc__device_scope ds;
    kvc_context *ctx = (kvc_context *)user;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t e;
    if (!ctx) return -1;
    if (n && (!dst || !src)) {
        kvc__fail(ctx, KVC_EINVAL, "kvc_copy_block: NULL span array");
        return -1;
    }
    if (kvc__enter(ctx, &ds) != KVC_OK) return -1;
    /* relaxed capture mode, as kvc__submit: another thread capturing a graph in global mode would have
     * the wait fail and its capture invalidated; this thread touches only its own stream */
    cudaThreadExchangeStreamCaptureMode(&mode);
    e = kvc__copy_spans(ctx, dst, src, n, bytes);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) {
        kvc__cuda_fail(ctx, e, "kvcuda: block copy for sequence copy-on-write");
        (void)cudaGetLastError();
        return -1;
    }
    return 0;
}

extern "C" kvc_result kvc_pool_create(kvc_context *ctx, kvc_memory where, const kvb_pool_config *config, kvb_pool **out)
{
    kvb_pool_config c;
    kvc_result r;
    int br;
    if (!config || !out) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_pool_create: NULL argument") : KVC_EINVAL;
    c = *config;
    if ((r = kvc_pool_storage_alloc(ctx, where, &c)) != KVC_OK) return r;
    if (where == KVC_MEMORY_DEVICE && !c.copy_block) { /* the CPU cannot memcpy device memory */
        c.copy_block = kvc_copy_block;
        c.copy_user = ctx;
    }
    br = kvb_pool_create(&c, out);
    if (br != KVB_OK) {
        if (where == KVC_MEMORY_DEVICE)
            kvc_device_free(ctx, c.external_base);
        else
            kvc_pinned_free(ctx, c.external_base);
        return kvc__fail(ctx, (kvc_result)br, "kvb_pool_create: %s", kvb_result_string(br));
    }
    return KVC_OK;
}

extern "C" kvc_result kvc_pool_destroy(kvc_context *ctx, kvb_pool *pool)
{
    void *base = NULL;
    kvc_memory kind = KVC_MEMORY_UNKNOWN;
    size_t i;
    if (!ctx) return KVC_EINVAL;
    if (!pool) return KVC_OK;
    kvb_pool_storage(pool, &base, NULL, NULL, NULL);
    pthread_mutex_lock(&ctx->lock);
    for (i = 0; i < ctx->n_allocs; i++)
        if (ctx->allocs[i].ptr == base) kind = ctx->allocs[i].kind;
    pthread_mutex_unlock(&ctx->lock);
    if (!base || kind == KVC_MEMORY_UNKNOWN)
        return kvc__fail(ctx, KVC_ENOTFOUND, "kvc_pool_destroy: the pool's storage was not allocated by this context");
    kvb_pool_destroy(pool);
    return kind == KVC_MEMORY_DEVICE ? kvc_device_free(ctx, base) : kvc_pinned_free(ctx, base);
}

/* ---- events ------------------------------------------------------------------------------------- */

struct kvc_event {
    kvc_context *ctx;
    cudaEvent_t ev;
    kvo_event *pre;
};

static int kvc__event_query_cb(void *user) { return kvc_event_query((kvc_event *)user); }

extern "C" kvc_result kvc_event_create(kvc_context *ctx, kvc_event **out)
{
    kvc__device_scope ds;
    kvc_result r;
    kvc_event *ev;
    cudaError_t e;
    if (!out) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_event_create: NULL out") : KVC_EINVAL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    ev = (kvc_event *)calloc(1, sizeof *ev);
    if (!ev) return kvc__fail(ctx, KVC_ENOMEM, "kvc_event_create: out of host memory");
    ev->ctx = ctx;
    e = cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        free(ev);
        return kvc__cuda_fail(ctx, e, "cudaEventCreateWithFlags");
    }
    if (kvo_event_create_custom(kvc__event_query_cb, ev, &ev->pre) != KVO_OK) {
        cudaEventDestroy(ev->ev);
        free(ev);
        return kvc__fail(ctx, KVC_ENOMEM, "kvo_event_create_custom: out of host memory");
    }
    *out = ev;
    return KVC_OK;
}

extern "C" kvc_result kvc_event_record(kvc_event *event, void *stream)
{
    kvc__device_scope ds;
    kvc_result r;
    cudaError_t e;
    if (!event) return KVC_EINVAL;
    if ((r = kvc__enter(event->ctx, &ds)) != KVC_OK) return r;
    e = cudaEventRecord(event->ev, (cudaStream_t)stream);
    if (e != cudaSuccess) return kvc__cuda_fail(event->ctx, e, "cudaEventRecord");
    return KVC_OK;
}

extern "C" int kvc_event_query(kvc_event *event)
{
    cudaError_t e;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (!event) return KVC_EINVAL;
    cudaThreadExchangeStreamCaptureMode(&mode); /* see kvc__submit */
    e = cudaEventQuery(event->ev);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (e == cudaSuccess) return 1;
    if (e == cudaErrorNotReady) return 0;
    return kvc__cuda_fail(event->ctx, e, "cudaEventQuery (precondition event)");
}

extern "C" kvo_event *kvc_event_precondition(kvc_event *event) { return event ? event->pre : NULL; }

extern "C" void kvc_event_destroy(kvc_event *event)
{
    if (!event) return;
    kvo_event_release(event->pre);
    cudaEventDestroy(event->ev);
    (void)cudaGetLastError();
    free(event);
}

/* ---- the copy kernel ---------------------------------------------------------------------------- */

/* A kernel descriptor: one contiguous piece (at most KVC__KERNEL_CHUNK bytes) of a merged run at its
 * first repetition; repetition r of it lies r * sstride / r * dstride further (kernel arguments). */
typedef struct kvc__desc { unsigned long long src, dst, bytes; } kvc__desc;

/* Work item k of a launch: descriptor k / count at repetition k % count. Shared by the kernel and by
 * kvc_copy_on_host, so the CPU checks the very addresses the GPU copies. */
__host__ __device__ static inline void kvc__item(const kvc__desc *descs, unsigned long long k, unsigned count,
                                                 unsigned long long sstride, unsigned long long dstride,
                                                 unsigned long long *src, unsigned long long *dst,
                                                 unsigned long long *bytes)
{
    const kvc__desc *d = &descs[k / count];
    unsigned long long r = k % count;
    *src = d->src + r * sstride;
    *dst = d->dst + r * dstride;
    *bytes = d->bytes;
}

/* Thread block b takes items b, b + gridDim.x, ...; its threads copy one item together, 16 bytes per
 * load with four loads in flight per thread (byte by byte when an end is not 16-byte aligned). Plain
 * loads and stores only (no cp.async, TMA or clusters), so the same source runs on sm_80 and later. */
__device__ static void kvc__copy_items(const kvc__desc *__restrict__ descs, unsigned long long items, unsigned count,
                                       unsigned long long sstride, unsigned long long dstride)
{
    unsigned long long k;
    for (k = blockIdx.x; k < items; k += gridDim.x) {
        unsigned long long src, dst, bytes;
        kvc__item(descs, k, count, sstride, dstride, &src, &dst, &bytes);
        if (((src | dst | bytes) & 15ull) == 0) {
            const uint4 *s4 = (const uint4 *)src;
            uint4 *d4 = (uint4 *)dst;
            unsigned long long n4 = bytes >> 4, i = threadIdx.x, step = blockDim.x;
            for (; i + 3 * step < n4; i += 4 * step) {
                uint4 a = s4[i], b = s4[i + step], c = s4[i + 2 * step], e = s4[i + 3 * step];
                d4[i] = a;
                d4[i + step] = b;
                d4[i + 2 * step] = c;
                d4[i + 3 * step] = e;
            }
            for (; i < n4; i += step) d4[i] = s4[i];
        } else {
            const unsigned char *s1 = (const unsigned char *)src;
            unsigned char *d1 = (unsigned char *)dst;
            unsigned long long i;
            for (i = threadIdx.x; i < bytes; i += blockDim.x) d1[i] = s1[i];
        }
    }
}

/* Descriptors staged in device memory (a copy of the job slot's pinned array): any number. */
__global__ void kvc__copy_kernel(const kvc__desc *__restrict__ descs, unsigned long long items, unsigned count,
                                 unsigned long long sstride, unsigned long long dstride)
{
    kvc__copy_items(descs, items, count, sstride, dstride);
}

/* Up to KVC__INLINE_DESCS descriptors in the launch's own parameters: a job of a few hundred scattered
 * blocks then costs one driver call instead of two (the staging copy is the slower one from a thread
 * that has been waiting). __grid_constant__ reads them in place, without a per-thread copy. */
typedef struct kvc__inline_descs { kvc__desc d[KVC__INLINE_DESCS]; } kvc__inline_descs;
static_assert(sizeof(kvc__inline_descs) + 32 <= 4096, "a launch's parameters must fit in 4 KiB");

__global__ void kvc__copy_kernel_inline(const __grid_constant__ kvc__inline_descs descs, unsigned long long items,
                                        unsigned count, unsigned long long sstride, unsigned long long dstride)
{
    kvc__copy_items(descs.d, items, count, sstride, dstride);
}

/* ---- the copy plan ------------------------------------------------------------------------------ */

typedef struct kvc__side {
    unsigned char *base;  /* address for DMA (and the CPU) */
    unsigned char *dev;   /* address for the kernel (NULL: not reachable) */
    kvc_memory mem;
    int device;
    uint32_t num_blocks;
    uint64_t block_bytes;
    kvb_layout layout;
} kvc__side;

/* A merged run: the copies of consecutive pairs (src i, dst i), (src i + 1, dst i + 1), ... at the
 * first repetition, as offsets from the pool bases. The plan repeats every run `count` times (the
 * (layer, part) pages, 1 when both pools are block-contiguous and whole blocks are copied). */
typedef struct kvc__run { uint64_t src, dst, bytes; } kvc__run;

typedef struct kvc__op {
    struct kvc__op *next;
    kvo_copy_job *job;
    int dir;
    cudaEvent_t done_ev;
    int error;
    char message[KVC__MSG];
    uint32_t src_blocks, dst_blocks;
    uint64_t block_bytes;
    kvc__run *runs;             /* the plan */
    size_t n_runs, cap_runs;
    uint32_t count;             /* repetitions of each run */
    uint64_t sstride, dstride;  /* bytes between repetitions */
    uint64_t total;             /* bytes of the plan */
    uint64_t queued_ns;         /* when its copies were put on the stream */
    void **dsts, **srcs;        /* the plan as single copies (DMA) */
    size_t *sizes;
    size_t n_copies, cap_dma;
    kvc__desc *hdesc, *ddesc;   /* the plan as kernel descriptors: pinned staging and device copy */
    size_t cap_desc;
} kvc__op;

static void kvc__op_set_error(kvc__op *op, int code, const char *fmt, ...) KVC__PRINTF(3, 4);
static void kvc__op_set_error(kvc__op *op, int code, const char *fmt, ...)
{
    va_list ap;
    if (op->error) return; /* the first error explains the rest */
    op->error = code;
    va_start(ap, fmt);
    vsnprintf(op->message, sizeof op->message, fmt, ap);
    va_end(ap);
}

static int kvc__grow(void **p, size_t *cap, size_t need, size_t size)
{
    size_t c = *cap ? *cap : 64;
    void *q;
    if (need <= *cap) return 1;
    while (c < need) c *= 2;
    q = realloc(*p, c * size);
    if (!q) return 0;
    *p = q;
    *cap = c;
    return 1;
}

/* Memory kind of p: from the context's table when p lies in one of its allocations (no driver call),
 * else from the driver. */
static kvc_memory kvc__classify_in(kvc_context *ctx, const void *p, void **dev, int *device)
{
    kvc__alloc a;
    if (!kvc__alloc_of(ctx, p, &a)) return kvc__classify(p, dev, device);
    *dev = a.dev ? (unsigned char *)a.dev + ((const unsigned char *)p - (const unsigned char *)a.ptr) : NULL;
    *device = a.device;
    return a.seen;
}

/* Storage, geometry and (ctx given) memory kind of a pool; without ctx, host memory. 0: no storage. */
static int kvc__side_of(kvc_context *ctx, kvb_pool *pool, kvc__side *s)
{
    void *base = NULL, *dev = NULL;
    kvb_pool_config c;
    memset(s, 0, sizeof *s);
    memset(&c, 0, sizeof c);
    if (kvb_pool_storage(pool, &base, NULL, &s->block_bytes, &s->layout) != KVB_OK || !base) return 0;
    kvb_pool_get_config(pool, &c);
    s->num_blocks = c.num_blocks;
    s->base = (unsigned char *)base;
    s->device = -1;
    if (ctx) {
        s->mem = kvc__classify_in(ctx, base, &dev, &s->device);
        s->dev = (unsigned char *)dev;
    } else {
        s->mem = KVC_MEMORY_HOST;
        s->dev = s->base;
    }
    return 1;
}

/* The same pages on both sides, and few enough (layers x parts) per block for a plan's 32-bit count. */
static int kvc__same_pages(const kvc__side *s, const kvc__side *d)
{
    return s->layout.num_layers == d->layout.num_layers && s->layout.num_parts == d->layout.num_parts &&
           s->layout.page_bytes == d->layout.page_bytes &&
           (uint64_t)s->layout.num_layers * s->layout.num_parts <= UINT32_MAX;
}

/* Offset of block b's first page (layer 0, part 0). */
static inline uint64_t kvc__first_page(const kvc__side *g, uint32_t b)
{
    const kvb_layout *y = &g->layout;
    if (y->kind == KVB_LAYOUT_LAYER_SEPARATE) return (uint64_t)b * y->page_bytes;
    return (uint64_t)b * y->num_layers * y->num_parts * y->page_bytes;
}

/* Merge the job's copies into runs. Both block-contiguous: whole blocks, one repetition. Otherwise
 * one page per block, repeated for each (layer, part) r = layer * parts + part, which lies r *
 * num_blocks * page further in a layer-separate pool and r * page further in a block-contiguous one;
 * consecutive blocks are merged where both sides keep a block's page next to the next block's (two
 * layer-separate pools, or one (layer, part) only). Copies whose index is out of range are left out. */
static int kvc__plan(kvc__op *op, const kvo_copy_job *job, const kvc__side *s, const kvc__side *d)
{
    const uint64_t page = s->layout.page_bytes;
    const int s_ls = s->layout.kind == KVB_LAYOUT_LAYER_SEPARATE, d_ls = d->layout.kind == KVB_LAYOUT_LAYER_SEPARATE;
    uint64_t unit, s_step, d_step;
    int merge;
    size_t i;
    op->n_runs = 0;
    op->total = 0;
    if (!s_ls && !d_ls) {
        op->count = 1;
        unit = s->block_bytes;
        op->sstride = op->dstride = 0;
    } else {
        op->count = s->layout.num_layers * s->layout.num_parts;
        unit = page;
        op->sstride = s_ls ? (uint64_t)s->num_blocks * page : page;
        op->dstride = d_ls ? (uint64_t)d->num_blocks * page : page;
    }
    s_step = s_ls ? page : s->block_bytes; /* distance from a block's page to the next block's */
    d_step = d_ls ? page : d->block_bytes;
    merge = s_step == unit && d_step == unit;
    if (!kvc__grow((void **)&op->runs, &op->cap_runs, job->n ? job->n : 1, sizeof *op->runs)) return 0;
    for (i = 0; i < job->n; i++) {
        uint64_t so, dof;
        kvc__run *last = op->n_runs ? &op->runs[op->n_runs - 1] : NULL;
        if (job->src_idx[i] >= s->num_blocks || job->dst_idx[i] >= d->num_blocks) continue;
        so = kvc__first_page(s, job->src_idx[i]);
        dof = kvc__first_page(d, job->dst_idx[i]);
        if (merge && last && last->src + last->bytes == so && last->dst + last->bytes == dof) {
            last->bytes += unit;
        } else {
            op->runs[op->n_runs].src = so;
            op->runs[op->n_runs].dst = dof;
            op->runs[op->n_runs].bytes = unit;
            op->n_runs++;
        }
        op->total += unit * op->count;
    }
    return 1;
}

/* The plan as single copies (dsts / srcs / sizes), each repetition of each run, a copy that continues
 * the previous one at both ends merged into it. 0: out of memory. */
static int kvc__expand(kvc__op *op, unsigned char *sbase, unsigned char *dbase)
{
    size_t i, need = op->n_runs * op->count;
    uint32_t r;
    op->n_copies = 0;
    if (need > op->cap_dma) {
        size_t cap = need * 2;
        void **dsts = (void **)realloc(op->dsts, cap * sizeof *dsts);
        void **srcs = dsts ? (void **)realloc(op->srcs, cap * sizeof *srcs) : NULL;
        size_t *sizes = srcs ? (size_t *)realloc(op->sizes, cap * sizeof *sizes) : NULL;
        if (dsts) op->dsts = dsts;
        if (srcs) op->srcs = srcs;
        if (!sizes) return 0; /* cap_dma unchanged: the arrays grow again together next time */
        op->sizes = sizes;
        op->cap_dma = cap;
    }
    for (i = 0; i < op->n_runs; i++) {
        for (r = 0; r < op->count; r++) {
            unsigned char *src = sbase + op->runs[i].src + r * op->sstride;
            unsigned char *dst = dbase + op->runs[i].dst + r * op->dstride;
            size_t k = op->n_copies;
            if (k && (unsigned char *)op->srcs[k - 1] + op->sizes[k - 1] == src &&
                (unsigned char *)op->dsts[k - 1] + op->sizes[k - 1] == dst) {
                op->sizes[k - 1] += (size_t)op->runs[i].bytes;
                continue;
            }
            op->srcs[k] = src;
            op->dsts[k] = dst;
            op->sizes[k] = (size_t)op->runs[i].bytes;
            op->n_copies++;
        }
    }
    return 1;
}

static size_t kvc__descs_needed(const kvc__op *op)
{
    size_t i, n = 0;
    for (i = 0; i < op->n_runs; i++) n += (size_t)((op->runs[i].bytes + KVC__KERNEL_CHUNK - 1) / KVC__KERNEL_CHUNK);
    return n;
}

/* The plan as kernel descriptors (runs cut into chunks); returns how many. */
static size_t kvc__build_descs(const kvc__op *op, kvc__desc *out, const unsigned char *sdev, const unsigned char *ddev)
{
    size_t i, n = 0;
    for (i = 0; i < op->n_runs; i++) {
        uint64_t off;
        for (off = 0; off < op->runs[i].bytes; off += KVC__KERNEL_CHUNK) {
            uint64_t left = op->runs[i].bytes - off;
            out[n].src = (unsigned long long)(uintptr_t)(sdev + op->runs[i].src + off);
            out[n].dst = (unsigned long long)(uintptr_t)(ddev + op->runs[i].dst + off);
            out[n].bytes = left < KVC__KERNEL_CHUNK ? left : KVC__KERNEL_CHUNK;
            n++;
        }
    }
    return n;
}

/* Kernel or DMA for this plan: the kernel needs both sides reachable by this device. */
static int kvc__use_kernel(const kvc_backend_config *cfg, const kvc__op *op, const kvc__side *s, const kvc__side *d,
                           int device)
{
    if (!s->dev || !d->dev || (s->mem == KVC_MEMORY_DEVICE && s->device != device) ||
        (d->mem == KVC_MEMORY_DEVICE && d->device != device))
        return 0;
    if (cfg->method == KVC_COPY_KERNEL) return 1;
    return cfg->method == KVC_COPY_AUTO && op->total / ((uint64_t)op->n_runs * op->count) < cfg->kernel_below_bytes;
}

static void kvc__config_defaults(kvc_backend_config *c)
{
    if (!c->kernel_below_bytes) c->kernel_below_bytes = 256u * 1024u;
    if (!c->kernel_blocks) c->kernel_blocks = 16;
    if (!c->kernel_threads) c->kernel_threads = 512;
    if (!c->poll_us) c->poll_us = 10;
}

/* ---- the copy backend --------------------------------------------------------------------------- */

typedef struct kvc__backend {
    kvo_backend base;
    kvc_context *ctx;
    kvc_backend_config cfg;
    pthread_mutex_t lock;          /* free list, queues, stats, stopping */
    pthread_cond_t cond;
    pthread_mutex_t submit_lock[2]; /* stream order = queue order */
    kvc__op *free_ops;
    kvc__op *head[2], *tail[2];
    pthread_t worker[2];
    int started[2];
    int stopping;
    kvc_backend_stats stats;
    double bytes_per_ns[2];        /* recent copy speed per direction (the workers' own; starts at 64 GB/s) */
    uint64_t last_done_ns[2];      /* when the worker saw the last copies of a direction end */
} kvc__backend;

typedef struct kvc__worker_arg { kvc__backend *b; int dir; } kvc__worker_arg;

static void kvc__op_free(kvc__op *op)
{
    if (op->done_ev) cudaEventDestroy(op->done_ev);
    if (op->hdesc) cudaFreeHost(op->hdesc);
    if (op->ddesc) cudaFree(op->ddesc);
    (void)cudaGetLastError();
    free(op->runs);
    free(op->dsts);
    free(op->srcs);
    free(op->sizes);
    free(op);
}

static kvc__op *kvc__op_get(kvc__backend *b)
{
    kvc__op *op;
    pthread_mutex_lock(&b->lock);
    op = b->free_ops;
    if (op) b->free_ops = op->next;
    pthread_mutex_unlock(&b->lock);
    if (op) return op;
    op = (kvc__op *)calloc(1, sizeof *op);
    if (!op) return NULL;
    if (cudaEventCreateWithFlags(&op->done_ev, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        op->done_ev = NULL;
        kvc__op_free(op);
        return NULL;
    }
    return op;
}

static void kvc__enqueue_dma(kvc__backend *b, kvc__op *op, const kvc__side *s, const kvc__side *d, cudaStream_t st)
{
    kvc_context *ctx = b->ctx;
    size_t i;
    char t[160];
    if (!kvc__expand(op, s->base, d->base)) {
        kvc__op_set_error(op, KVC_ENOMEM, "kvcuda: out of host memory for %zu copies", op->n_runs * op->count);
        return;
    }
#if KVC__BATCH_API
    if (b->cfg.batch_api >= 0 && op->n_copies > 1 && __atomic_load_n(&ctx->batch_ok, __ATOMIC_RELAXED)) {
        struct cudaMemcpyAttributes attr;
        size_t idx = 0;
        cudaError_t e;
        memset(&attr, 0, sizeof attr);
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.srcLocHint.type = s->mem == KVC_MEMORY_DEVICE ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
        attr.srcLocHint.id = s->mem == KVC_MEMORY_DEVICE ? s->device : 0;
        attr.dstLocHint.type = d->mem == KVC_MEMORY_DEVICE ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
        attr.dstLocHint.id = d->mem == KVC_MEMORY_DEVICE ? d->device : 0;
#if KVC__BATCH_API == 2
        e = cudaMemcpyBatchAsync(op->dsts, (const void *const *)op->srcs, op->sizes, op->n_copies, &attr, &idx, 1, st);
#else
        {
            size_t fail_idx = 0;
            e = cudaMemcpyBatchAsync(op->dsts, op->srcs, op->sizes, op->n_copies, &attr, &idx, 1, &fail_idx, st);
        }
#endif
        if (e == cudaSuccess) {
            pthread_mutex_lock(&b->lock);
            b->stats.batch_calls++;
            pthread_mutex_unlock(&b->lock);
            return;
        }
        (void)cudaGetLastError();
        if (e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver)
            __atomic_store_n(&ctx->batch_ok, 0, __ATOMIC_RELAXED); /* not on this driver: never again */
        else if (e != cudaErrorInvalidValue) {
            kvc__op_set_error(op, KVC_ECUDA, "kvcuda: cudaMemcpyBatchAsync of %zu copies failed: %s", op->n_copies,
                              kvc__cuda_text(e, t, sizeof t));
            return;
        }
        /* refused: fall back to one cudaMemcpyAsync per copy */
    }
#else
    (void)ctx;
#endif
    for (i = 0; i < op->n_copies; i++) {
        cudaError_t e = cudaMemcpyAsync(op->dsts[i], op->srcs[i], op->sizes[i], cudaMemcpyDefault, st);
        if (e != cudaSuccess) {
            kvc__op_set_error(op, KVC_ECUDA, "kvcuda: cudaMemcpyAsync (copy %zu of %zu, %zu bytes) failed: %s", i + 1,
                              op->n_copies, op->sizes[i], kvc__cuda_text(e, t, sizeof t));
            return;
        }
    }
}

/* The launch's error, if any, becomes the op's. cudaLaunchKernel returns the launch's own error: a
 * cudaGetLastError after <<<>>> would also return an earlier failure left on the calling thread. */
static void kvc__launch(kvc__backend *b, kvc__op *op, const void *kernel, void **args, unsigned grid,
                        unsigned long long items, cudaStream_t st)
{
    char t[160];
    cudaError_t e = cudaLaunchKernel(kernel, dim3(grid), dim3(b->cfg.kernel_threads), args, 0, st);
    if (e != cudaSuccess)
        kvc__op_set_error(op, KVC_ECUDA, "kvcuda: copy kernel launch (%u x %u threads, %llu items) failed: %s", grid,
                          b->cfg.kernel_threads, items, kvc__cuda_text(e, t, sizeof t));
}

static void kvc__enqueue_kernel(kvc__backend *b, kvc__op *op, const kvc__side *s, const kvc__side *d, cudaStream_t st)
{
    size_t n, need = kvc__descs_needed(op);
    unsigned long long items, sstride = op->sstride, dstride = op->dstride;
    unsigned count = op->count;
    unsigned grid;
    cudaError_t e;
    char t[160];
    if (need <= KVC__INLINE_DESCS) {
        kvc__inline_descs inl;
        n = kvc__build_descs(op, inl.d, s->dev, d->dev);
        items = (unsigned long long)n * op->count;
        grid = items < b->cfg.kernel_blocks ? (unsigned)items : b->cfg.kernel_blocks;
        void *args[] = {&inl, &items, &count, &sstride, &dstride};
        kvc__launch(b, op, (const void *)kvc__copy_kernel_inline, args, grid, items, st);
        return;
    }
    if (need > op->cap_desc) {
        size_t cap = op->cap_desc ? op->cap_desc : KVC__DESC_MIN;
        while (cap < need) cap *= 2;
        if (op->hdesc) cudaFreeHost(op->hdesc);
        if (op->ddesc) cudaFree(op->ddesc);
        op->hdesc = op->ddesc = NULL;
        op->cap_desc = 0;
        e = cudaHostAlloc((void **)&op->hdesc, cap * sizeof(kvc__desc), cudaHostAllocDefault);
        if (e == cudaSuccess) e = cudaMalloc((void **)&op->ddesc, cap * sizeof(kvc__desc));
        if (e != cudaSuccess) {
            kvc__op_set_error(op, e == cudaErrorMemoryAllocation ? KVC_ENOMEM : KVC_ECUDA,
                              "kvcuda: allocating %zu kernel descriptors failed: %s", cap, kvc__cuda_text(e, t, sizeof t));
            return;
        }
        op->cap_desc = cap;
    }
    n = kvc__build_descs(op, op->hdesc, s->dev, d->dev);
    e = cudaMemcpyAsync(op->ddesc, op->hdesc, n * sizeof(kvc__desc), cudaMemcpyHostToDevice, st);
    if (e != cudaSuccess) {
        kvc__op_set_error(op, KVC_ECUDA, "kvcuda: copying %zu kernel descriptors failed: %s", n,
                          kvc__cuda_text(e, t, sizeof t));
        return;
    }
    items = (unsigned long long)n * op->count;
    grid = items < b->cfg.kernel_blocks ? (unsigned)items : b->cfg.kernel_blocks;
    {
        const kvc__desc *descs = op->ddesc;
        void *args[] = {&descs, &items, &count, &sstride, &dstride};
        kvc__launch(b, op, (const void *)kvc__copy_kernel, args, grid, items, st);
    }
}

static uint64_t kvc__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Poll the op's event until the copies ended (or failed). Between polls the worker sleeps half of the
 * time the copies should still take at the direction's recent speed (a 128 MiB job: about ten wake-ups,
 * not a few hundred; at most 1 ms at a time), then poll_us once they are due; the speed is learnt from
 * the jobs that ended. (Learning only from jobs of 200 us and more, and raising the speed at once to
 * any faster one, was tried: on an H100 a big job after small ones then ran at half speed in two runs
 * of four, for a reason not found.) */
static void kvc__wait(kvc__backend *b, kvc__op *op)
{
    unsigned spins = 0;
    int dir = op->dir;
    uint64_t begun;
    double expect;
    char t[160];
    pthread_mutex_lock(&b->lock); /* config.sync: submitters wait themselves, on any thread */
    begun = op->queued_ns > b->last_done_ns[dir] ? op->queued_ns : b->last_done_ns[dir];
    expect = (double)op->total / b->bytes_per_ns[dir];
    pthread_mutex_unlock(&b->lock);
    for (;;) {
        cudaError_t e = cudaEventQuery(op->done_ev);
        uint64_t now = kvc__now_ns();
        if (e == cudaSuccess || e != cudaErrorNotReady) {
            pthread_mutex_lock(&b->lock);
            if (e == cudaSuccess && now - begun > 20000 && op->total) { /* long enough to tell the speed */
                double seen = (double)op->total / (double)(now - begun);
                b->bytes_per_ns[dir] = 0.75 * b->bytes_per_ns[dir] + 0.25 * seen;
            }
            b->last_done_ns[dir] = now;
            pthread_mutex_unlock(&b->lock);
            if (e != cudaSuccess)
                kvc__op_set_error(op, KVC_ECUDA, "kvcuda: block copies failed: %s", kvc__cuda_text(e, t, sizeof t));
            return;
        }
        if (spins++ < 16) {
            sched_yield();
        } else {
            double left = expect - (double)(now - begun);
            uint64_t ns = (uint64_t)b->cfg.poll_us * 1000;
            struct timespec ts;
            if (left > 4.0 * (double)ns) { /* half what is left, at most 1 ms */
                ns = (uint64_t)(left / 2);
                if (ns > 1000000) ns = 1000000;
            }
            ts.tv_sec = (time_t)(ns / 1000000000u);
            ts.tv_nsec = (long)(ns % 1000000000u);
            nanosleep(&ts, NULL);
        }
    }
}

/* Per-copy results, counters, the op back to the free list, then job->done. */
static void kvc__finish(kvc__backend *b, kvc__op *op)
{
    kvo_copy_job *job = op->job;
    char msg[KVC__MSG];
    size_t i, ok = 0, range = 0;
    int result = op->error;
    for (i = 0; i < job->n; i++) {
        if (job->src_idx[i] >= op->src_blocks || job->dst_idx[i] >= op->dst_blocks) {
            job->results[i] = KVB_ERANGE;
            range++;
        } else {
            job->results[i] = op->error;
            if (!op->error) ok++;
        }
    }
    job->bytes = ok * op->block_bytes;
    msg[0] = 0;
    if (op->error) {
        snprintf(msg, sizeof msg, "%s", op->message);
        kvc__fail(b->ctx, (kvc_result)op->error, "%s", op->message);
    } else if (range) {
        result = KVB_ERANGE;
        snprintf(msg, sizeof msg, "kvcuda: %zu of %zu copies name a block index out of range", range, job->n);
        kvc__fail(b->ctx, KVC_EINVAL, "%s", msg);
    }
    pthread_mutex_lock(&b->lock);
    b->stats.bytes += job->bytes;
    if (result) b->stats.failed_jobs++;
    op->job = NULL;
    op->next = b->free_ops;
    b->free_ops = op;
    pthread_mutex_unlock(&b->lock);
    job->done(job, result, msg[0] ? msg : NULL);
}

static void *kvc__worker_main(void *arg)
{
    kvc__worker_arg a = *(kvc__worker_arg *)arg;
    kvc__backend *b = a.b;
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    free(arg);
    /* Another thread capturing a graph in global mode (PyTorch's default) makes cudaEventQuery here fail
     * (and invalidates that capture); relaxed mode allows it: this thread touches only its own events. */
    cudaThreadExchangeStreamCaptureMode(&relaxed);
#ifdef PR_SET_TIMERSLACK
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL); /* short polls: 1 us timer slack */
#endif
    cudaSetDevice(b->ctx->device);
    pthread_mutex_lock(&b->lock);
    for (;;) {
        kvc__op *op;
        while (!b->head[a.dir] && !b->stopping) pthread_cond_wait(&b->cond, &b->lock);
        op = b->head[a.dir];
        if (!op) break; /* stopping, and nothing left */
        pthread_mutex_unlock(&b->lock);
        kvc__wait(b, op);
        pthread_mutex_lock(&b->lock);
        b->head[a.dir] = op->next;
        if (!b->head[a.dir]) b->tail[a.dir] = NULL;
        pthread_mutex_unlock(&b->lock);
        kvc__finish(b, op);
        pthread_mutex_lock(&b->lock);
    }
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

/* A job that never reached the GPU still counts (the queued ones count under the submit's own lock). */
static void kvc__count_job(kvc__backend *b, size_t copies)
{
    pthread_mutex_lock(&b->lock);
    b->stats.jobs++;
    b->stats.copies += copies;
    pthread_mutex_unlock(&b->lock);
}

static int kvc__submit_relaxed(kvo_backend *self, kvo_copy_job *job);

/* The submit in relaxed capture mode: its calls (event query and record, cudaMalloc of descriptors,
 * copies and launches on the context's own streams) must not fail, nor break a capture, because
 * another thread is capturing a graph in global mode (see kvc__worker_main). */
static int kvc__submit(kvo_backend *self, kvo_copy_job *job)
{
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    int r;
    cudaThreadExchangeStreamCaptureMode(&mode);
    r = kvc__submit_relaxed(self, job);
    cudaThreadExchangeStreamCaptureMode(&mode);
    return r;
}

static int kvc__submit_relaxed(kvo_backend *self, kvo_copy_job *job)
{
    kvc__device_scope ds;
    kvc__backend *b = (kvc__backend *)self->impl;
    kvc_context *ctx = b->ctx;
    kvc__side s, d;
    kvc__op *op;
    cudaStream_t st;
    cudaError_t e;
    int kernel, dir;
    char t[160];
    if (!job || !job->src || !job->dst || !job->done || (job->n && (!job->src_idx || !job->dst_idx || !job->results)))
        return KVO_EINVAL;
    e = kvc__select(&ds, ctx->device); /* before kvc__op_get: a new slot's event belongs to this device */
    op = kvc__op_get(b);
    if (!op) return KVO_ENOMEM;
    op->job = job;
    op->error = 0;
    op->message[0] = 0;
    op->src_blocks = op->dst_blocks = UINT32_MAX;
    op->block_bytes = 0;
    op->dir = KVC_D2H;

    if (e != cudaSuccess)
        kvc__op_set_error(op, KVC_ECUDA, "kvcuda: cudaSetDevice(%d) failed: %s", ctx->device, kvc__cuda_text(e, t, sizeof t));
    else if (!kvc__side_of(ctx, job->src, &s) || !kvc__side_of(ctx, job->dst, &d))
        kvc__op_set_error(op, KVC_ESTORAGE, "kvcuda: a pool of the job has no storage (metadata only)");
    else if (!kvc__same_pages(&s, &d))
        kvc__op_set_error(op, KVC_ELAYOUT,
                          "kvcuda: pools differ (or a block has 2^32 pages or more): %u x %u pages of %llu bytes"
                          " vs %u x %u pages of %llu bytes",
                          s.layout.num_layers, s.layout.num_parts, (unsigned long long)s.layout.page_bytes,
                          d.layout.num_layers, d.layout.num_parts, (unsigned long long)d.layout.page_bytes);
    else if (s.mem != KVC_MEMORY_DEVICE && d.mem != KVC_MEMORY_DEVICE)
        kvc__op_set_error(op, KVC_ESTORAGE, "kvcuda: neither pool is device memory (use the memcpy backend)");
    if (op->error) { /* nothing reached the GPU: every copy fails with the error */
        kvc__count_job(b, job->n);
        kvc__finish(b, op);
        return KVO_OK;
    }
    op->src_blocks = s.num_blocks;
    op->dst_blocks = d.num_blocks;
    op->block_bytes = s.block_bytes;
    op->dir = s.mem != KVC_MEMORY_DEVICE ? KVC_H2D : KVC_D2H; /* device -> device uses the d2h stream */
    if (!kvc__plan(op, job, &s, &d)) kvc__op_set_error(op, KVC_ENOMEM, "kvcuda: out of host memory planning %zu copies", job->n);
    if (op->error || !op->n_runs) {
        kvc__count_job(b, job->n);
        kvc__finish(b, op);
        return KVO_OK;
    }
    kernel = kvc__use_kernel(&b->cfg, op, &s, &d, ctx->device);
    dir = op->dir; /* once queued, the op may finish and be reused before this call returns */
    st = ctx->stream[dir];

    pthread_mutex_lock(&b->submit_lock[dir]);
    if (kernel)
        kvc__enqueue_kernel(b, op, &s, &d, st);
    else
        kvc__enqueue_dma(b, op, &s, &d, st);
    e = cudaEventRecord(op->done_ev, st);
    op->queued_ns = kvc__now_ns();
    if (e != cudaSuccess) { /* cannot mark the end: wait for the stream here instead */
        kvc__op_set_error(op, KVC_ECUDA, "kvcuda: cudaEventRecord failed: %s", kvc__cuda_text(e, t, sizeof t));
        cudaStreamSynchronize(st);
        (void)cudaGetLastError();
    }
    pthread_mutex_lock(&b->lock);
    b->stats.jobs++;
    b->stats.copies += job->n;
    b->stats.runs += kernel ? op->n_runs * op->count : op->n_copies;
    if (kernel)
        b->stats.kernel_jobs++;
    else
        b->stats.dma_jobs++;
    if (!b->cfg.sync) {
        op->next = NULL;
        if (b->tail[dir])
            b->tail[dir]->next = op;
        else
            b->head[dir] = op;
        b->tail[dir] = op;
        pthread_cond_broadcast(&b->cond);
    }
    pthread_mutex_unlock(&b->lock);
    pthread_mutex_unlock(&b->submit_lock[dir]);
    if (b->cfg.sync) {
        kvc__wait(b, op);
        kvc__finish(b, op);
    }
    return KVO_OK;
}

static void kvc__destroy(kvo_backend *self)
{
    kvc__device_scope ds;
    kvc__backend *b = (kvc__backend *)self->impl;
    kvc__op *op;
    int i;
    pthread_mutex_lock(&b->lock);
    b->stopping = 1;
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
    for (i = 0; i < 2; i++)
        if (b->started[i]) pthread_join(b->worker[i], NULL);
    if (b->ctx->status == KVC_OK) kvc__select(&ds, b->ctx->device);
    while ((op = b->free_ops) != NULL) {
        b->free_ops = op->next;
        kvc__op_free(op);
    }
    pthread_cond_destroy(&b->cond);
    pthread_mutex_destroy(&b->lock);
    for (i = 0; i < 2; i++) pthread_mutex_destroy(&b->submit_lock[i]);
    free(b);
}

extern "C" kvc_result kvc_backend_create(kvc_context *ctx, const kvc_backend_config *config, kvo_backend **out)
{
    kvc__device_scope ds;
    kvc__backend *b;
    kvc_backend_config c;
    kvc_result r;
    int i;
    if (!out) return ctx ? kvc__fail(ctx, KVC_EINVAL, "kvc_backend_create: NULL out") : KVC_EINVAL;
    *out = NULL;
    if ((r = kvc__enter(ctx, &ds)) != KVC_OK) return r;
    memset(&c, 0, sizeof c);
    if (config) c = *config;
    kvc__config_defaults(&c);
    if (c.method < KVC_COPY_AUTO || c.method > KVC_COPY_KERNEL || c.kernel_threads % 32 || c.kernel_threads > 1024 ||
        c.kernel_blocks > 65535 || c.poll_us > 1000000)
        return kvc__fail(ctx, KVC_EINVAL,
                         "kvc_backend_create: method, kernel_threads (multiple of 32, <= 1024), kernel_blocks "
                         "(<= 65535) or poll_us (<= 1 s) out of range");
    b = (kvc__backend *)calloc(1, sizeof *b);
    if (!b) return kvc__fail(ctx, KVC_ENOMEM, "kvc_backend_create: out of host memory");
    b->ctx = ctx;
    b->cfg = c;
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->cond, NULL);
    for (i = 0; i < 2; i++) pthread_mutex_init(&b->submit_lock[i], NULL);
    b->base.submit = kvc__submit;
    b->base.destroy = kvc__destroy;
    b->bytes_per_ns[0] = b->bytes_per_ns[1] = 64.0; /* optimistic: a first job's worker polls early */
    b->base.name = "cuda";
    b->base.impl = b;
    for (i = 0; i < 2 && !c.sync; i++) {
        kvc__worker_arg *a = (kvc__worker_arg *)malloc(sizeof *a);
        if (!a) break;
        a->b = b;
        a->dir = i;
        if (pthread_create(&b->worker[i], NULL, kvc__worker_main, a) != 0) {
            free(a);
            break;
        }
        b->started[i] = 1;
    }
    if (!c.sync && !(b->started[0] && b->started[1])) {
        kvc__destroy(&b->base);
        return kvc__fail(ctx, KVC_ESYSTEM, "kvc_backend_create: cannot start the completion threads");
    }
    *out = &b->base;
    return KVC_OK;
}

extern "C" kvc_result kvc_backend_get_stats(kvo_backend *backend, kvc_backend_stats *out)
{
    kvc__backend *b;
    if (!backend || !out || backend->submit != kvc__submit) return KVC_EINVAL;
    b = (kvc__backend *)backend->impl;
    pthread_mutex_lock(&b->lock);
    *out = b->stats;
    pthread_mutex_unlock(&b->lock);
    return KVC_OK;
}

extern "C" kvc_result kvc_copy_on_host(const kvc_backend_config *config, kvo_copy_job *job, kvc_backend_stats *plan)
{
    kvc_backend_config c;
    kvc__side s, d;
    kvc__op op;
    int kernel = 0, r = KVC_OK;
    size_t i, ok = 0, range = 0;
    if (!job || !job->src || !job->dst || (job->n && (!job->src_idx || !job->dst_idx || !job->results)))
        return KVC_EINVAL;
    memset(&c, 0, sizeof c);
    if (config) c = *config;
    kvc__config_defaults(&c);
    if (c.method < KVC_COPY_AUTO || c.method > KVC_COPY_KERNEL) return KVC_EINVAL;
    memset(&op, 0, sizeof op);
    if (!kvc__side_of(NULL, job->src, &s) || !kvc__side_of(NULL, job->dst, &d))
        r = KVC_ESTORAGE;
    else if (!kvc__same_pages(&s, &d))
        r = KVC_ELAYOUT;
    else if (!kvc__plan(&op, job, &s, &d))
        r = KVC_ENOMEM;
    if (r == KVC_OK && op.n_runs) {
        kernel = kvc__use_kernel(&c, &op, &s, &d, -1);
        if (kernel) {
            size_t n = kvc__descs_needed(&op);
            kvc__desc *descs = (kvc__desc *)malloc(n * sizeof *descs);
            if (!descs) {
                r = KVC_ENOMEM;
            } else {
                unsigned long long k, items;
                n = kvc__build_descs(&op, descs, s.dev, d.dev);
                items = (unsigned long long)n * op.count;
                for (k = 0; k < items; k++) {
                    unsigned long long src, dst, bytes;
                    kvc__item(descs, k, op.count, op.sstride, op.dstride, &src, &dst, &bytes);
                    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)bytes);
                }
                free(descs);
            }
        } else if (!kvc__expand(&op, s.base, d.base)) {
            r = KVC_ENOMEM;
        } else {
            for (i = 0; i < op.n_copies; i++) memcpy(op.dsts[i], op.srcs[i], op.sizes[i]);
        }
    }
    for (i = 0; i < job->n; i++) {
        if (r != KVC_OK) {
            job->results[i] = r;
        } else if (job->src_idx[i] >= s.num_blocks || job->dst_idx[i] >= d.num_blocks) {
            job->results[i] = KVB_ERANGE;
            range++;
        } else {
            job->results[i] = KVC_OK;
            ok++;
        }
    }
    job->bytes = r == KVC_OK ? ok * s.block_bytes : 0;
    if (plan) {
        memset(plan, 0, sizeof *plan);
        plan->jobs = 1;
        plan->copies = job->n;
        plan->runs = kernel ? op.n_runs * op.count : op.n_copies;
        plan->kernel_jobs = r == KVC_OK && op.n_runs && kernel;
        plan->dma_jobs = r == KVC_OK && op.n_runs && !kernel;
        plan->bytes = job->bytes;
        plan->failed_jobs = r != KVC_OK || range;
    }
    free(op.runs);
    free(op.dsts);
    free(op.srcs);
    free(op.sizes);
    if (r != KVC_OK) return (kvc_result)r;
    return range ? (kvc_result)KVB_ERANGE : KVC_OK;
}
