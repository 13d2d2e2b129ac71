/* kvbench_cuda_floor.cu — the floor that kvbench_cuda measures the copy backend's submit against: the
 * driver calls a submit cannot do without, made bare, on a stream of their own. A kernel job: one launch
 * with the parameter bytes of kvcuda.cu's inline-descriptor launch (an empty kernel: the launch's host
 * cost is what is measured) and one event record. A DMA job: one cudaMemcpyBatchAsync of the job's copies
 * (one cudaMemcpyAsync each where the toolkit lacks it) and one event record. */
#include <cuda_runtime.h>
#include <stddef.h>

/* as big as kvcuda.cu's kvc__inline_descs (160 descriptors of 24 bytes) */
typedef struct kvbench_floor_params { unsigned long long w[480]; } kvbench_floor_params;

__global__ void kvbench_floor_kernel(const __grid_constant__ kvbench_floor_params p, unsigned long long items,
                                     unsigned count, unsigned long long sstride, unsigned long long dstride)
{
    (void)p, (void)items, (void)count, (void)sstride, (void)dstride;
}

static cudaStream_t kvbench_floor_stream;
static cudaEvent_t kvbench_floor_event;

static int kvbench_floor_init(void)
{
    if (kvbench_floor_stream) return 1;
    return cudaStreamCreateWithFlags(&kvbench_floor_stream, cudaStreamNonBlocking) == cudaSuccess &&
           cudaEventCreateWithFlags(&kvbench_floor_event, cudaEventDisableTiming) == cudaSuccess;
}

/* One launch (grid x threads) and one event record. 0 on success. */
extern "C" int kvbench_floor_launch(unsigned grid, unsigned threads)
{
    static kvbench_floor_params p;
    if (!kvbench_floor_init()) return -1;
    kvbench_floor_kernel<<<grid, threads, 0, kvbench_floor_stream>>>(p, 0, 1, 0, 0);
    if (cudaGetLastError() != cudaSuccess) return -1;
    return cudaEventRecord(kvbench_floor_event, kvbench_floor_stream) == cudaSuccess ? 0 : -1;
}

/* n copies (device -> pinned host when d2h, else the other way) in one batch, and one event record. */
extern "C" int kvbench_floor_copies(void **dsts, void **srcs, size_t *sizes, size_t n, int d2h, int device)
{
    if (!kvbench_floor_init()) return -1;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    {
        struct cudaMemcpyAttributes attr = {};
        size_t idx = 0;
        cudaError_t e;
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.srcLocHint.type = d2h ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
        attr.srcLocHint.id = d2h ? device : 0;
        attr.dstLocHint.type = d2h ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
        attr.dstLocHint.id = d2h ? 0 : device;
#if CUDART_VERSION >= 13000
        e = cudaMemcpyBatchAsync(dsts, (const void *const *)srcs, sizes, n, &attr, &idx, 1, kvbench_floor_stream);
#else
        size_t fail_idx = 0;
        e = cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &idx, 1, &fail_idx, kvbench_floor_stream);
#endif
        if (e != cudaSuccess) (void)cudaGetLastError();
        if (e == cudaSuccess) return cudaEventRecord(kvbench_floor_event, kvbench_floor_stream) == cudaSuccess ? 0 : -1;
    }
#endif
    for (size_t i = 0; i < n; i++)
        if (cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, kvbench_floor_stream) != cudaSuccess) return -1;
    return cudaEventRecord(kvbench_floor_event, kvbench_floor_stream) == cudaSuccess ? 0 : -1;
}

/* Wait for the floor's work, sleeping. 0 on success. */
extern "C" int kvbench_floor_wait(void)
{
    return kvbench_floor_stream && cudaStreamSynchronize(kvbench_floor_stream) == cudaSuccess ? 0 : -1;
}
