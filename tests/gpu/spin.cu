/* spin.cu — a kernel that keeps writing one word pattern over a buffer for a given time; the
 * "dead client with a kernel in flight" check of it_cuda_share (process E) launches it on its
 * own page and is killed while it runs. */
#include <cuda_runtime_api.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_fill(volatile uint32_t *p, size_t words, uint32_t v, unsigned long long ns)
{
    const unsigned long long t0 = now_ns();
    do {
        for (size_t i = threadIdx.x; i < words; i += blockDim.x)
            p[i] = v;
    } while (now_ns() - t0 < ns);
}

} // namespace

/* launch spin_fill on the default stream: `bytes` (a multiple of 4) at p, for `ms` ms */
extern "C" int it_spin_fill(void *p, size_t bytes, uint32_t v, uint32_t ms)
{
    spin_fill<<<1, 256>>>(static_cast<volatile uint32_t *>(p), bytes / 4, v,
                          (unsigned long long)ms * 1000000ull);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
