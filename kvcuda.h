/* kvcuda.h — the declaration of kvcuda.cu's API: the GPU tier of kvcache (device and pinned memory,
 * copy streams, CUDA events as offload preconditions, a kvoffload copy backend for scattered blocks)
 *
 * kvcuda.cu is the implementation; it is compiled by nvcc (`make cuda` -> build/libkvcuda.a) and calls
 * only the public kvb_ / kvo_ functions. Those come from your own C (or C++) translation unit:
 *
 *     // kv_impl.c — compiled with cc, exactly once in the program
 *     #define KVBLOCK_IMPLEMENTATION
 *     #define KVOFFLOAD_IMPLEMENTATION
 *     #include "kvoffload.h"
 *
 *     // everywhere else
 *     #include "kvcuda.h"              // includes kvoffload.h (and kvblock.h); no CUDA header needed
 *
 * kvcache.h carries these declarations too: with the single file, its KVCACHE_IMPLEMENTATION is that
 * C translation unit and no other header is needed.
 *
 * Link: kv_impl.o your.o build/libkvcuda.a -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt -lpthread
 * (built with the Makefile's flags the library needs no C++ runtime, so cc can link it). The Makefile
 * compiles code for sm_80, sm_86, sm_89 and sm_90 (A100, A10 / RTX 30xx, L4 / L40S / RTX 40xx, H100),
 * sm_100 / sm_120 where the toolkit has them, and compute_80 PTX that any newer GPU JIT-compiles;
 * `make cuda CUDA_ARCHS="86 90"` picks others. The kernels use nothing newer than sm_80. Streams and
 * events appear as `void *` (a cudaStream_t is a pointer), so C code can use this header without the
 * CUDA toolkit's headers.
 *
 * Manual: 1. Quick start  2. Concepts  3. The copy backend  4. Thread safety  5. Errors
 *
 * 1. QUICK START — offload registered device blocks to pinned host memory
 *
 *     kvc_context *gpu;
 *     if (kvc_context_create(0, &gpu) != KVC_OK) {            // KVC_ENODEVICE without a GPU
 *         fprintf(stderr, "%s\n", kvc_last_error_message(gpu)); kvc_context_destroy(gpu); ...
 *     }
 *     kvb_pool_config dc = { .num_blocks = 4096, .block_tokens = 16, .layout = layout };
 *     kvb_pool_config hc = { .num_blocks = 16384, .block_tokens = 16, .layout = layout, .tier = 1,
 *                            .duplicates = KVB_DUP_REJECT };
 *     kvb_pool *device, *host;
 *     kvc_pool_create(gpu, KVC_MEMORY_DEVICE, &dc, &device);  // cudaMalloc'd, zeroed
 *     kvc_pool_create(gpu, KVC_MEMORY_PINNED, &hc, &host);    // mmap + first touch + cudaHostRegister
 *     kvo_backend *copy;  kvc_backend_create(gpu, NULL, &copy);
 *     kvo_pipeline_config pc = { .src = device, .dst = host, .backend = copy };
 *     kvo_pipeline *down;  kvo_pipeline_create(&pc, &down);
 *     kvc_event *fwd;      kvc_event_create(gpu, &fwd);
 *     ... launch the forward pass on `stream` ...
 *     kvc_event_record(fwd, stream);                          // the offload waits for it
 *     kvo_enqueue_opts o = { .precondition = kvc_event_precondition(fwd) };
 *     kvo_enqueue(down, weak_blocks, n, &o, &t);
 *     ...
 *     kvo_pipeline_destroy(down); kvc_event_destroy(fwd); kvo_backend_destroy(copy);
 *     kvc_pool_destroy(gpu, host); kvc_pool_destroy(gpu, device); kvc_context_destroy(gpu);
 *
 * 2. CONCEPTS
 * Context: one per device. It holds the device index, one copy stream per direction (host->device,
 * device->host; device->device copies use the device->host stream), the allocations made through it
 * and the message of the last error. No global mutable state: everything hangs off the context.
 * Memory: device memory (cudaMalloc), pinned host memory (mmap, first touched by a few threads in
 * parallel so tens of GiB are ready in a fraction of a second, then cudaHostRegister; cudaHostAlloc
 * when registration fails), both zeroed. kvc_pool_create gives a kvb pool such memory as
 * KVB_STORAGE_EXTERNAL storage (either layout) and kvc_pool_destroy frees it with the pool.
 * Sequences on a device pool: kvblock copies block bytes itself in two places (kvb_seq copy-on-write
 * of a shared partial block, kvb_seq_truncate's private copy), through kvb_pool_config.copy_block.
 * kvc_pool_create(KVC_MEMORY_DEVICE) installs a device copy there (unless the config has its own):
 * a device-to-device cudaMemcpyAsync per span on a stream of the context's own, waited for before the
 * kvb_seq call returns, so kvb_seq_fork + appends work as on a host pool (beam search, parallel
 * sampling). That stream is not ordered after your kernels: the forward pass that wrote the shared
 * block must be complete (synchronize its stream) before the append or truncate that copies it.
 * A CUDA failure there fails the kvb_seq call with KVB_ECOPY; the context's message names the error.
 * Events: a kvc_event is a CUDA event that is also a kvoffload precondition event (its query is
 * cudaEventQuery: 1 done, 0 not ready, negative on error). Record it after the work that writes the
 * blocks; re-recording it is allowed (a transfer still waiting then waits for the new record, which is
 * later, so never too early). Destroy it only when no transfer waits on it any more (final, or after
 * kvo_pipeline_drain / kvo_pipeline_destroy).
 *
 * 3. THE COPY BACKEND (kvc_backend_create; used like kvo_memcpy_backend_create)
 * A job copies blocks between a device pool and a host pool (pinned, or pageable), in either
 * direction, or between two device pools. Which side is device memory: the context's own allocations
 * say (kvc_pool_create's memory is classified once, when allocated), anything else is asked of
 * cudaPointerGetAttributes, so pools over memory allocated elsewhere (an engine's own cudaMalloc'd KV
 * tensors, say) work too. Both pools need the same layer count, part count
 * and page bytes; their layouts may differ. The copies are first merged into runs: consecutive pairs
 * (src i, dst i), (src i + 1, dst i + 1) become one run of whole blocks when both pools are
 * block-contiguous; otherwise a run is one page per block, repeated for every (layer, part) at a fixed
 * stride (num_blocks * page in a layer-separate pool, page in a block-contiguous one), and consecutive
 * blocks merge when both pools are layer-separate. Then, by the average contiguous copy:
 *   DMA    (average >= kernel_below_bytes, or a side is pageable host memory): the runs' copies, each
 *          repetition one copy (merged again where they touch), in one cudaMemcpyBatchAsync where the
 *          toolkit (12.8+) and driver have it, else one cudaMemcpyAsync each;
 *   kernel (average < kernel_below_bytes): one launch for the whole job: the runs, cut into 64 KiB
 *          chunks, go to the device as descriptors (24 bytes each, one per chunk, not per page): up
 *          to 160 in the launch's own parameters, more through a pinned staging copy first; work
 *          item k is chunk k / repetitions at repetition k % repetitions; a few thread blocks take the
 *          items in turn, 16-byte vector loads and stores, four in flight per thread. The host side
 *          is reached through its mapped device address.
 * kvc_copy_on_host carries out the same plan on the CPU (for tests and for looking at a plan).
 * Completion: an event recorded after the copies, polled by one small worker thread per direction,
 * which calls job->done with a result per copy (config.sync = 1: submit waits and calls done itself).
 * Between polls a worker sleeps half the time the copies should still take at the speed its recent
 * jobs ran at, then poll_us once they are due: a long job costs a few wake-ups, not one per poll_us.
 * A copy whose block index is out of range fails alone with KVB_ERANGE; a CUDA error fails every copy
 * of the job with KVC_ECUDA and a message naming the call and the CUDA error (its own: an error an
 * earlier call left on the submitting thread is not taken for the launch's). Nothing aborts.
 * CUDA graphs: the workers' polls, a submit and a device pool's copy-on-write (kvc_copy_block) run in
 * relaxed stream-capture mode, so an engine thread capturing a graph in global mode (PyTorch's default)
 * neither fails their event queries and waits (a job reported failed while its copies still ran) nor
 * has its capture invalidated by them.
 *
 * 4. THREAD SAFETY — contexts, allocations, events and backends are safe to use from any thread. A
 * context must outlive its pools, events and backends. kvc_last_error_message returns a pointer into
 * the context that a later failure on another thread may overwrite; kvc_copy_error_message copies it
 * under the context's lock. A call selects its context's device on the calling thread while it runs
 * and leaves the thread's current device as it found it (a thread driving several GPUs keeps its own).
 *
 * 5. ERRORS — kvc_result: KVC_OK (0) or a negative code in -301..-309; calls that reach kvblock or
 * kvoffload may also return their codes. kvc_result_string names all of them. Every failure also
 * writes a one-line message on the context (the CUDA call and error, the size asked for, ...).
 * kvc_context_create fails with KVC_ENODEVICE when no device can be used (no driver, a driver older
 * than the runtime, zero devices, an index out of range); it still returns a context object holding
 * the message (like sqlite3_open), which the caller reads and destroys. kvc_probe tells the cases
 * apart (KVC_ENODRIVER vs KVC_ENODEVICE) without creating anything.
 */
#ifndef KVCUDA_H
#define KVCUDA_H
#define KVCUDA_VERSION_MAJOR 0
#define KVCUDA_VERSION_MINOR 2
#define KVCUDA_VERSION_PATCH 0

#include <stddef.h>
#include <stdint.h>
#include "kvoffload.h"

#ifndef KVC_API
#define KVC_API extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define KVC__RESULTS(X)                                                                         \
    X(KVC_OK,         0,    "ok")                                                               \
    X(KVC_EINVAL,    -301,  "invalid argument")                                                 \
    X(KVC_ENODRIVER, -302,  "no CUDA driver, or a driver older than the CUDA runtime")          \
    X(KVC_ENODEVICE, -303,  "no CUDA device")                                                   \
    X(KVC_ENOMEM,    -304,  "out of memory (device or pinned host)")                            \
    X(KVC_ECUDA,     -305,  "a CUDA call failed")                                               \
    X(KVC_ESTORAGE,  -306,  "pool storage is not memory this backend can copy")                 \
    X(KVC_ELAYOUT,   -307,  "pools differ in layers, parts or page bytes")                      \
    X(KVC_ESYSTEM,   -308,  "system call failed")                                               \
    X(KVC_ENOTFOUND, -309,  "pointer was not allocated by this context")

#define KVC__ENUM_ITEM(name, value, text) name = value,
typedef enum kvc_result { KVC__RESULTS(KVC__ENUM_ITEM) KVC__RESULT_MIN = -310 } kvc_result;
#undef KVC__ENUM_ITEM

/* Name of a kvc_result, or of a kvo_result / kvb_result code. Thread safety: pure function. */
KVC_API const char *kvc_result_string(int result);

/* ---- probe and context -------------------------------------------------------------------------- */

typedef struct kvc_probe_info {
    int device_count;     /* 0 when none can be used */
    int driver_version;   /* e.g. 13000; 0 without a driver */
    int runtime_version;  /* of the CUDA runtime linked in */
    char message[256];    /* why none can be used ("" when some can) */
} kvc_probe_info;

/* Is there a driver and a device? KVC_OK, KVC_ENODRIVER (no libcuda, or older than the runtime),
 * KVC_ENODEVICE (no device, or another cudaGetDeviceCount error), KVC_EINVAL for NULL. Never aborts.
 * Thread safety: any thread. */
KVC_API kvc_result kvc_probe(kvc_probe_info *out);

typedef struct kvc_context kvc_context;

/* A context on device `device` (0-based): initializes it, creates the two copy streams.
 * KVC_EINVAL for a NULL out; KVC_ENODEVICE when cudaGetDeviceCount reports 0 or an error, or the index
 * is out of range; KVC_ECUDA when the device cannot be initialized; KVC_ENOMEM. On every failure but
 * KVC_EINVAL and a failed malloc, *out is a context in a failed state that holds the message
 * (kvc_last_error_message) and must be destroyed; every other call on it returns its error.
 * Thread safety: any thread. */
KVC_API kvc_result kvc_context_create(int device, kvc_context **out);

/* Wait for both copy streams, free every allocation still held by the context, destroy the streams
 * and the context. Pools, events and backends made with it must be gone first. NULL is a no-op. */
KVC_API void kvc_context_destroy(kvc_context *ctx);

/* The message of the last failure on this context ("" when none); "no context" for NULL. Valid until
 * the next failure or the destroy. Thread safety: see section 4. */
KVC_API const char *kvc_last_error_message(const kvc_context *ctx);

/* Copy that message into buf (size bytes, always terminated); returns its full length. */
KVC_API size_t kvc_copy_error_message(kvc_context *ctx, char *buf, size_t size);

/* KVC_OK for a usable context, else the error it failed with (KVC_EINVAL for NULL). */
KVC_API kvc_result kvc_context_status(const kvc_context *ctx);

typedef struct kvc_device_info {
    int device;
    char name[256];
    uint64_t total_bytes, free_bytes;
    int cc_major, cc_minor;
    int sm_count;
    int driver_version, runtime_version;
    int batch_copy;       /* 1 when cudaMemcpyBatchAsync is compiled in and the driver has it */
    int host_mapped;      /* 1 when pinned host memory can be read by kernels */
} kvc_device_info;

/* Device name, memory, compute capability... Thread safety: any thread. */
KVC_API kvc_result kvc_get_device_info(kvc_context *ctx, kvc_device_info *out);

typedef enum kvc_direction { KVC_H2D = 0, KVC_D2H = 1 } kvc_direction;

/* The context's copy stream for a direction (a cudaStream_t), NULL for a failed context. */
KVC_API void *kvc_stream(kvc_context *ctx, kvc_direction direction);

/* Wait until both copy streams are idle. */
KVC_API kvc_result kvc_synchronize(kvc_context *ctx);

/* ---- memory ------------------------------------------------------------------------------------- */

typedef enum kvc_memory {
    KVC_MEMORY_UNKNOWN = 0,
    KVC_MEMORY_DEVICE,   /* cudaMalloc (or managed) memory of a device */
    KVC_MEMORY_PINNED,   /* page-locked host memory, mapped for the device */
    KVC_MEMORY_HOST      /* ordinary (pageable) host memory: DMA only */
} kvc_memory;

/* bytes (> 0) of zeroed device memory: KVC_ENOMEM (message: size, free and total bytes), KVC_ECUDA.
 * Freed by kvc_device_free or at kvc_context_destroy. Thread safety: any thread. */
KVC_API kvc_result kvc_device_alloc(kvc_context *ctx, size_t bytes, void **out);
/* KVC_ENOTFOUND for a pointer this context did not allocate as device memory. */
KVC_API kvc_result kvc_device_free(kvc_context *ctx, void *ptr);

/* bytes (> 0) of zeroed pinned host memory: mmap (transparent huge pages advised), first touch by up
 * to 8 threads in parallel, cudaHostRegister (portable, mapped); cudaHostAlloc when registration
 * fails. KVC_ENOMEM when both fail (the message gives both errors). Thread safety: any thread. */
KVC_API kvc_result kvc_pinned_alloc(kvc_context *ctx, size_t bytes, void **out);
/* KVC_ENOTFOUND for a pointer this context did not allocate as pinned memory. */
KVC_API kvc_result kvc_pinned_free(kvc_context *ctx, void *ptr);

/* What kind of memory ptr is (this context's allocations first, then cudaPointerGetAttributes). */
KVC_API kvc_result kvc_memory_kind(kvc_context *ctx, const void *ptr, kvc_memory *out);

/* Synchronous copy of bytes between any two of device / pinned / host memory (cudaMemcpyDefault). */
KVC_API kvc_result kvc_memcpy(kvc_context *ctx, void *dst, const void *src, size_t bytes);

/* ---- pools -------------------------------------------------------------------------------------- */

/* Allocate storage for `config` (num_blocks and layout, either kind; page_bytes required, zero layers
 * and parts default to 1 and 2) in device or pinned memory and set config->storage =
 * KVB_STORAGE_EXTERNAL, external_base and external_bytes. Free it with kvc_device_free /
 * kvc_pinned_free after the pool is destroyed (or use kvc_pool_create). KVC_EINVAL for another kind
 * or a missing page_bytes, KVC_ENOMEM. Thread safety: any thread. */
KVC_API kvc_result kvc_pool_storage_alloc(kvc_context *ctx, kvc_memory where, kvb_pool_config *config);

/* kvc_pool_storage_alloc on a copy of config, then kvb_pool_create; kvb_result codes pass through
 * (the memory is freed again). A device pool gets the device block copy as config.copy_block when
 * the config has none (section 2). Thread safety: any thread. */
KVC_API kvc_result kvc_pool_create(kvc_context *ctx, kvc_memory where, const kvb_pool_config *config,
                                   kvb_pool **out);

/* The device block copy kvc_pool_create installs as kvb_pool_config.copy_block (user = the
 * kvc_context): set it yourself on a pool over device memory you allocated (an engine's own KV
 * tensors, KVB_STORAGE_EXTERNAL), or call it from a hook of your own. 0 on success, -1 on a CUDA
 * error (message on the context). Thread safety: any thread. */
KVC_API int kvc_copy_block(void *user, void *const *dst, const void *const *src, size_t n, uint64_t bytes);

/* kvb_pool_destroy, then free the pool's memory. No copy may be in flight on it. NULL pool: no-op. */
KVC_API kvc_result kvc_pool_destroy(kvc_context *ctx, kvb_pool *pool);

/* ---- events ------------------------------------------------------------------------------------- */

typedef struct kvc_event kvc_event;

/* A CUDA event (timing disabled) wrapped as a kvoffload precondition event. Until its first record
 * it counts as done. Thread safety: any thread. */
KVC_API kvc_result kvc_event_create(kvc_context *ctx, kvc_event **out);
/* Record it on `stream` (a cudaStream_t; NULL = the legacy default stream) after the work to wait for. */
KVC_API kvc_result kvc_event_record(kvc_event *event, void *stream);
/* 1 done, 0 not yet, negative (KVC_ECUDA) when the work failed. */
KVC_API int kvc_event_query(kvc_event *event);
/* The kvoffload event for kvo_enqueue_opts.precondition (owned by the kvc_event; its query reads the
 * kvc_event, so a transfer waiting on it needs the kvc_event too: see Events, section 2). */
KVC_API kvo_event *kvc_event_precondition(kvc_event *event);
/* See section 2 for when. NULL is a no-op. */
KVC_API void kvc_event_destroy(kvc_event *event);

/* ---- copy backend ------------------------------------------------------------------------------- */

typedef enum kvc_copy_method {
    KVC_COPY_AUTO = 0,   /* kernel when the average run is below kernel_below_bytes, else DMA */
    KVC_COPY_DMA,        /* always DMA */
    KVC_COPY_KERNEL      /* always the kernel (DMA anyway when a side is pageable host memory) */
} kvc_copy_method;

/* Zero fields mean the default. */
typedef struct kvc_backend_config {
    kvc_copy_method method;      /* default auto */
    uint64_t kernel_below_bytes; /* auto: average run size below which the kernel is used, default 256 KiB */
    int batch_api;               /* 0 = cudaMemcpyBatchAsync when available, -1 = one cudaMemcpyAsync per run */
    uint32_t kernel_blocks;      /* thread blocks of the copy kernel, default 16 */
    uint32_t kernel_threads;     /* threads per block, a multiple of 32 up to 1024, default 512 */
    int sync;                    /* 1: submit waits for the copies and calls done before it returns */
    uint32_t poll_us;            /* how often the completion workers poll their event once the copies
                                    are due (before: longer sleeps, see section 3), default 10 us */
} kvc_backend_config;

typedef struct kvc_backend_stats {
    uint64_t jobs, copies;       /* jobs submitted, block copies in them */
    uint64_t runs;               /* contiguous copies after merging (kernel: before 64 KiB chunking) */
    uint64_t dma_jobs, kernel_jobs;
    uint64_t batch_calls;        /* cudaMemcpyBatchAsync calls */
    uint64_t bytes;              /* bytes copied */
    uint64_t failed_jobs;
} kvc_backend_stats;

/* A kvoffload copy backend on ctx (see section 3); config may be NULL. Use it as any kvo_backend
 * (kvo_pipeline_config.backend, kvo_manager_config.down / up) and free it with kvo_backend_destroy,
 * which waits for the jobs in flight. Thread safety: submit from any thread. */
KVC_API kvc_result kvc_backend_create(kvc_context *ctx, const kvc_backend_config *config, kvo_backend **out);

/* Counters of a backend made by kvc_backend_create (KVC_EINVAL for another backend). */
KVC_API kvc_result kvc_backend_get_stats(kvo_backend *backend, kvc_backend_stats *out);

/* Carry out a job's copy plan on the CPU: the very runs (DMA) or kernel work items (the addresses the
 * kernel computes) that the backend would issue for this config, each done with memcpy. Both pools
 * need storage the CPU can address (host or pinned). For tests and for inspecting a plan without a
 * device: no CUDA call is made. config may be NULL; AUTO assumes the kernel reaches both pools. Fills
 * job->results and job->bytes; job->done is not called. Returns KVC_OK, KVB_ERANGE (some copies named
 * a block out of range; the others were made), KVC_ESTORAGE, KVC_ELAYOUT, KVC_ENOMEM or KVC_EINVAL.
 * *plan (may be NULL) gets the counters a backend would add for this job. Thread safety: any thread. */
KVC_API kvc_result kvc_copy_on_host(const kvc_backend_config *config, kvo_copy_job *job, kvc_backend_stats *plan);

#ifdef __cplusplus
}
#endif
#endif /* KVCUDA_H */
