/* test_kernels.cu — device code the CUDA tests need (compiled by nvcc, called from test_cuda.c). */
#include <cuda_runtime.h>
#include <stddef.h>

/* The byte a filled block holds at offset i of the pool (the tests recompute it on the host). */
__host__ __device__ static inline unsigned char kvct__byte(unsigned seed, unsigned long long i)
{
    return (unsigned char)(seed * 29u + (unsigned)(i * 7u) + (unsigned)(i >> 11));
}

/* Spin for `spin_cycles` clock cycles, then fill [dst, dst + bytes) with kvct__byte(seed, i). */
__global__ void kvct__slow_fill(unsigned char *dst, unsigned long long bytes, unsigned seed, long long spin_cycles)
{
    unsigned long long i;
    if (spin_cycles > 0) {
        long long t0 = clock64();
        while (clock64() - t0 < spin_cycles) {
        }
    }
    for (i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < bytes; i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = kvct__byte(seed, i);
}

extern "C" unsigned char kvct_byte(unsigned seed, unsigned long long i) { return kvct__byte(seed, i); }

/* Launch the fill on `stream` (a cudaStream_t, NULL = legacy default stream); 0 or the cudaError_t. */
extern "C" int kvct_slow_fill(void *dst, unsigned long long bytes, unsigned seed, long long spin_cycles, void *stream)
{
    kvct__slow_fill<<<64, 256, 0, (cudaStream_t)stream>>>((unsigned char *)dst, bytes, seed, spin_cycles);
    return (int)cudaGetLastError();
}

/* Clock rate in kHz of the current device (for turning milliseconds into spin cycles). */
extern "C" int kvct_clock_khz(void)
{
    int dev = 0, khz = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess)
        return 1500000;
    return khz;
}

/* Leave a failed call's error on this thread (a cudaMalloc far too large), as an engine's own code may;
 * returns it (non-zero). kvct_take_error reads and clears the thread's last error. */
extern "C" int kvct_leave_error(void)
{
    void *p = NULL;
    cudaMalloc(&p, (size_t)1 << 50);
    return (int)cudaPeekAtLastError();
}

extern "C" int kvct_take_error(void) { return (int)cudaGetLastError(); }

/* A graph capture in global mode (PyTorch's default) on a new stream of the current device: begin it
 * (NULL on failure), and end it from the same thread (0, or the cudaError_t: 901 when invalidated). */
extern "C" void *kvct_capture_begin(void)
{
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return NULL;
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) != cudaSuccess) {
        cudaStreamDestroy(s);
        return NULL;
    }
    kvct__slow_fill<<<1, 1, 0, s>>>(NULL, 0, 0, 0); /* captured, never run */
    return s;
}

extern "C" int kvct_capture_end(void *stream)
{
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)stream, &g);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy((cudaStream_t)stream);
    (void)cudaGetLastError();
    return (int)e;
}
