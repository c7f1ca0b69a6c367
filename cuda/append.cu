/* append.cu — quantize new tokens' K and V rows of one layer into FP8 pages (twin of
 * kv_fp8_append in page.c).
 *
 * Work split: one warp per row (token t, kind K|V, kv head h); 8 rows per 256-thread block.
 * Lane j owns d/32 consecutive elements, so the fp16/bf16 reads are 8·d/32-byte vectors per
 * lane and the code write is d/32 consecutive bytes per lane: both coalesced across the warp.
 *
 *   row (t, kind, h) ──► dir[slot_page[t]] ──► FP8 page phys ──► block (layer, kind, h)
 *                        (read once per warp)                   code[slot_idx[t]][0..d)
 *                                                               scale[slot_idx[t]]
 *
 * Bit-exactness with the twin: amax is a max (order-free), scale = amax/448 by __fdiv_rn, each
 * code = __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), SATFINITE, E4M3), which is the conversion
 * kv_fp8_from_float reproduces bit for bit; fp16/bf16 → float is exact. No reciprocal multiply
 * and no fast-math anywhere, so the kernel and the twin produce the same bytes.
 *
 * Padding: the twin zeroes each written block's tail (after the scales) and the page tail; the
 * warps do the same (several warps may store the same zeros — identical values, no ordering
 * needed).
 */
#include "kvkern_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <float.h>

namespace {

constexpr int kAppendWarps = 8;

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<__half>(__half x)
{
    return __half2float(x);
}
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

template <typename T, int D>
__global__ void __launch_bounds__(kAppendWarps * 32)
    fp8_append_kernel(kv_geom_t g, kv_pools_t pools, const kv_dir_entry_t *__restrict__ dir,
                      uint32_t dir_len, uint32_t layer, uint32_t ntok,
                      const uint32_t *__restrict__ slot_page, const uint32_t *__restrict__ slot_idx,
                      const T *__restrict__ k, const T *__restrict__ v)
{
    constexpr int E = D / 32; /* elements per lane */
    const uint32_t lane = threadIdx.x & 31u;
    const uint64_t row = (uint64_t)blockIdx.x * kAppendWarps + (threadIdx.x >> 5);
    const uint64_t rows_per_tok = 2ull * g.kv_heads;
    if (row >= (uint64_t)ntok * rows_per_tok)
        return;
    const uint32_t t = (uint32_t)(row / rows_per_tok);
    const uint32_t r = (uint32_t)(row % rows_per_tok);
    const int kind = r < g.kv_heads ? KV_KIND_K : KV_KIND_V;
    const uint32_t h = kind == KV_KIND_K ? r : r - g.kv_heads;

    /* same acceptance rule as the twin's validation; a rejected token is skipped */
    const uint32_t lp = slot_page[t], slot = slot_idx[t];
    if (lp >= dir_len || slot >= g.page_tokens)
        return;
    const kv_dir_entry_t e = dir[lp];
    const uint32_t fl = kv_dir_flags(e);
    if (!(fl & KV_DIR_VALID) || (fl & KV_DIR_SEALED) || kv_dir_fmt(e) != KV_FMT_FP8 ||
        kv_dir_phys(e) >= pools.pages[KV_FMT_FP8])
        return;

    const T *src = (kind == KV_KIND_K ? k : v) + ((uint64_t)t * g.kv_heads + h) * D + lane * E;
    float x[E];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < E; i++) {
        x[i] = to_float<T>(src[i]);
        const float a = fabsf(x[i]);
        if (a <= FLT_MAX && a > amax) /* finite only, as the twin */
            amax = a;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = amax >= FLT_MIN ? __fdiv_rn(amax, KV_FP8_MAX) : 1.0f;

    const uint64_t page_bytes = kv_page_bytes(&g, KV_FMT_FP8);
    uint8_t *page = pools.base[KV_FMT_FP8] + (uint64_t)kv_dir_phys(e) * page_bytes;
    uint8_t *blk = page + kv_block_offset(&g, KV_FMT_FP8, layer, kind, h);

    uint8_t c[E];
#pragma unroll
    for (int i = 0; i < E; i++)
        c[i] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(x[i], s), __NV_SATFINITE, __NV_E4M3);
    uint8_t *dst = blk + (uint64_t)slot * D + lane * E;
    if constexpr (E == 2) {
        *reinterpret_cast<uint16_t *>(dst) = (uint16_t)(c[0] | (c[1] << 8));
    } else {
#pragma unroll
        for (int i = 0; i < E; i += 4)
            *reinterpret_cast<uint32_t *>(dst + i) =
                (uint32_t)c[i] | ((uint32_t)c[i + 1] << 8) | ((uint32_t)c[i + 2] << 16) |
                ((uint32_t)c[i + 3] << 24);
    }

    const uint64_t meta = kv_block_meta_offset(&g, KV_FMT_FP8, KV_KIND_K); /* FP8: same for K and V */
    if (lane == 0)
        *reinterpret_cast<float *>(blk + meta + (uint64_t)slot * sizeof(float)) = s;
    /* block tail and (for the last block of the last layer) page tail padding */
    const uint64_t end = meta + kv_block_meta_bytes(&g, KV_FMT_FP8, kind);
    const uint64_t bb = kv_block_bytes(&g, KV_FMT_FP8, kind);
    for (uint64_t i = end + lane; i < bb; i += 32)
        blk[i] = 0;
    if (kind == KV_KIND_V && h == g.kv_heads - 1 && layer == g.layers - 1) {
        const uint64_t used = (uint64_t)g.layers * kv_layer_bytes(&g, KV_FMT_FP8);
        for (uint64_t i = used + lane; i < page_bytes; i += 32)
            page[i] = 0;
    }
}

/* Launch through cudaLaunchKernelEx rather than <<<>>>: its return value is this launch's own
 * error. cudaGetLastError after <<<>>> would also return (and clear) an error left pending by
 * an unrelated earlier call of the caller, e.g. a failed cudaMalloc, and report a kernel that
 * did run as KVK_EDEVICE. */
template <typename T>
cudaError_t launch_append(dim3 grid, cudaStream_t st, const kv_geom_t &g, const kv_pools_t &p,
                          const kv_dir_entry_t *dir, uint32_t dir_len, uint32_t layer,
                          uint32_t ntok, const uint32_t *sp, const uint32_t *si, const void *k,
                          const void *v)
{
    const T *kk = static_cast<const T *>(k), *vv = static_cast<const T *>(v);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kAppendWarps * 32);
    cfg.stream = st;
    switch (g.head_dim) {
    case 64:
        return cudaLaunchKernelEx(&cfg, fp8_append_kernel<T, 64>, g, p, dir, dir_len, layer, ntok,
                                  sp, si, kk, vv);
    case 128:
        return cudaLaunchKernelEx(&cfg, fp8_append_kernel<T, 128>, g, p, dir, dir_len, layer,
                                  ntok, sp, si, kk, vv);
    default:
        return cudaLaunchKernelEx(&cfg, fp8_append_kernel<T, 256>, g, p, dir, dir_len, layer,
                                  ntok, sp, si, kk, vv);
    }
}

} // namespace

extern "C" kvk_status_t kvk_cuda_fp8_append(const kv_geom_t *g, const kv_pools_t *pools,
                                            const kv_dir_entry_t *dir, uint32_t dir_len,
                                            uint32_t layer, uint32_t ntok,
                                            const uint32_t *slot_page, const uint32_t *slot_idx,
                                            const void *k, const void *v, kvk_dtype_t dtype,
                                            cudaStream_t stream)
{
    if (!kv_geom_valid(g) || !pools || !dir || layer >= g->layers)
        return KVK_EINVAL;
    if (dtype != KVK_DTYPE_F16 && dtype != KVK_DTYPE_BF16)
        return KVK_EINVAL;
    if (ntok == 0)
        return KVK_OK;
    if (!slot_page || !slot_idx || !k || !v || !pools->base[KV_FMT_FP8])
        return KVK_EINVAL;
    /* A misaligned load or store on the device is not a skipped token but a sticky error that
     * ends the caller's CUDA context, so every array is checked for its element alignment:
     * the vector stores of codes and the float scales need the pool's block alignment. */
    if ((uintptr_t)pools->base[KV_FMT_FP8] % KV_BLOCK_ALIGN != 0 ||
        (uintptr_t)dir % sizeof(kv_dir_entry_t) != 0 ||
        (uintptr_t)slot_page % sizeof(uint32_t) != 0 ||
        (uintptr_t)slot_idx % sizeof(uint32_t) != 0 || (uintptr_t)k % 2u != 0 ||
        (uintptr_t)v % 2u != 0)
        return KVK_EINVAL;
    /* the kernel's page offsets (phys · page_bytes from the base) must not wrap */
    const uint64_t pb = kv_page_bytes(g, KV_FMT_FP8);
    const uint64_t pages = pools->pages[KV_FMT_FP8];
    if (pages > (UINT64_MAX - (uintptr_t)pools->base[KV_FMT_FP8]) / pb)
        return KVK_EINVAL;
    const uint64_t rows = (uint64_t)ntok * 2 * g->kv_heads;
    const uint64_t blocks = (rows + kAppendWarps - 1) / kAppendWarps;
    if (blocks > 0x7fffffffull)
        return KVK_EINVAL;
    cudaError_t err;
    if (dtype == KVK_DTYPE_F16)
        err = launch_append<__half>(dim3((unsigned)blocks), stream, *g, *pools, dir, dir_len,
                                    layer, ntok, slot_page, slot_idx, k, v);
    else
        err = launch_append<__nv_bfloat16>(dim3((unsigned)blocks), stream, *g, *pools, dir,
                                           dir_len, layer, ntok, slot_page, slot_idx, k, v);
    if (err == cudaSuccess)
        return KVK_OK;
    /* the status reports it; leave no trace for the caller's next unrelated check (a sticky
     * error stays whatever we do) */
    (void)cudaGetLastError();
    return KVK_EDEVICE;
}
