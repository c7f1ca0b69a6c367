/* convert.cu — batched whole-page format changes: retier FP8 → TQ3 and promote TQ3 → FP8
 * (twins of kv_page_retier / kv_page_promote in page.c, row codecs of fp8.c and tq3.c).
 *
 * Work split: a row is one (pair, layer, kind, head, token); it is handled by d/32 lanes, lane q
 * owning coordinates 32q … 32q+31, i.e. exactly one TQ3 group. That choice makes the bit planes
 * a lane-local affair (no ballots): a lane builds its three plane words with shifts and writes
 * 12 contiguous bytes; on the FP8 side it reads or writes 32 contiguous code bytes (two 16-byte
 * accesses). 256-thread blocks hold 256/(d/32) rows.
 *
 *   FP8 row ──decode──► x[d] ──R (FWHT)──► y ──► TQ3 codes + FP16 γ | scale, zero   (retier)
 *   TQ3 row ──decode──► ŷ ──Rᵀ (FWHT)──► x̂ ──► FP8 codes + f32 scale                (promote)
 *
 * Bit-exactness plan (tq3.c and rotate.c spell out the twin's evaluation order):
 *   - the Walsh–Hadamard butterflies run in the twin's stage order h = 1, 2, …, d/2; a
 *     butterfly (a+b, a−b) is the same IEEE operation wherever it runs, and the stages with
 *     h ≥ 32 exchange values between the row's lanes with shuffles, so y is bit-identical;
 *   - every scalar step uses the twin's operation with explicit round-to-nearest intrinsics
 *     (__fmul_rn, __fdiv_rn, __fadd_rn, __fsub_rn): nvcc would otherwise contract a·b+c into an
 *     FMA and change the last bit;
 *   - the twin accumulates ‖k‖², ⟨z, C[code]⟩ and ‖C[code]‖² in double, sequentially; here each
 *     lane sums its 32 terms in double and the row's lanes add their partials, so the double
 *     sums can differ in the last bits. The results are rounded to float (‖k‖) or FP16 (γ)
 *     afterwards, so the stored bytes are identical unless a double lands within ~1e-16 of a
 *     float/half rounding boundary: a code flip or a 1-ulp FP16 difference is possible in
 *     principle and is what tests/gpu/test_kernels counts (docs/perf.md has the counts);
 *   - value min/max are order-free (except for the sign of an all-zero minimum: the twin keeps
 *     the first of −0/+0 it meets, the GPU whichever the reduction meets); the value grid's
 *     float mean and variance are summed in the twin's sequential order (the running sum is
 *     passed lane to lane), so scale, zero and the value codes are bit-identical.
 * Promote is bit-exact: decode, inverse rotation and the FP8 row codec are all order-fixed.
 */
#include "kvkern_cuda.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <float.h>

namespace {

constexpr int kConvThreads = 256;

__constant__ float c_centroid[KV_TQ3_LEVELS] = KV_TQ3_CENTROIDS_INIT;

__device__ __forceinline__ float fp8_to_float(uint32_t code)
{
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

__device__ __forceinline__ uint16_t half_sat_bits(float x)
{
    x = x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x);
    return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ float half_bits_to_float(uint16_t b)
{
    return __half2float(__ushort_as_half(b));
}

/* In-place FWHT of the row's d values; this lane holds coordinates 32q … 32q+31. LPR lanes per
 * row are consecutive lanes of the warp. Stage order h = 1, 2, …, d/2 as in rotate.c. */
template <int LPR> __device__ __forceinline__ void fwht_row(float (&x)[32], uint32_t q)
{
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int j = 0; j < 32; j++) {
            if ((j & h) == 0) {
                const float a = x[j], b = x[j + h];
                x[j] = __fadd_rn(a, b);
                x[j + h] = __fsub_rn(a, b);
            }
        }
    }
#pragma unroll
    for (int m = 1; m < LPR; m <<= 1) {
        const bool upper = (q & (uint32_t)m) != 0;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const float o = __shfl_xor_sync(0xffffffffu, x[j], m);
            /* lower half keeps a + b, upper half keeps a − b with a the lower lane's value */
            x[j] = upper ? __fsub_rn(o, x[j]) : __fadd_rn(x[j], o);
        }
    }
}

template <int LPR, typename T> __device__ __forceinline__ T row_sum(T v)
{
#pragma unroll
    for (int m = 1; m < LPR; m <<= 1)
        v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
template <int LPR> __device__ __forceinline__ float row_max(float v)
{
#pragma unroll
    for (int m = 1; m < LPR; m <<= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}
template <int LPR> __device__ __forceinline__ float row_min(float v)
{
#pragma unroll
    for (int m = 1; m < LPR; m <<= 1)
        v = fminf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

/* Σ v over the row in coordinate order 0, 1, …, d−1 with one float add at a time — the twin's
 * exact order (tq3.c sums the rotated values sequentially in float). The running sum is
 * handed from lane to lane of the row; all lanes get the total. */
template <int LPR> __device__ __forceinline__ float row_seq_sum(const float (&v)[32], uint32_t q)
{
    const uint32_t base = (threadIdx.x & 31u) & ~(uint32_t)(LPR - 1);
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < LPR; k++) {
        const float run = k == 0 ? 0.0f : __shfl_sync(0xffffffffu, acc, base + k - 1);
        if (q == (uint32_t)k) {
            acc = run;
#pragma unroll
            for (int j = 0; j < 32; j++)
                acc = __fadd_rn(acc, v[j]);
        }
    }
    return __shfl_sync(0xffffffffu, acc, base + LPR - 1);
}

/* Where a row lives: its block in the source and destination pages and the token. */
struct RowAddr {
    const uint8_t *sblk;
    uint8_t *dblk;
    uint8_t *dpage;
    uint32_t token;
    int kind;
    bool last_block; /* (last layer, V, last head): owns the page tail */
    bool ok;
};

__device__ __forceinline__ RowAddr row_addr(const kv_geom_t &g, const kv_pools_t &pools,
                                            uint32_t n, const uint32_t *src, const uint32_t *dst,
                                            kv_fmt_t sf, kv_fmt_t df, uint32_t pair, uint32_t row)
{
    RowAddr r;
    const uint32_t pt = g.page_tokens, blocks = g.layers * 2u * g.kv_heads;
    const uint32_t blk = row / pt; /* ((layer·2 + kind)·kv_heads + head) */
    r.token = row - blk * pt;
    const uint32_t lk = blk / g.kv_heads;
    const uint32_t head = blk - lk * g.kv_heads;
    r.kind = (int)(lk & 1u);
    const uint32_t layer = lk >> 1;
    r.last_block = blk == blocks - 1;
    r.ok = false;
    r.sblk = nullptr;
    r.dblk = nullptr;
    r.dpage = nullptr;
    if (pair >= n)
        return r;
    const uint32_t sp = src[pair], dp = dst[pair];
    if (sp >= pools.pages[sf] || dp >= pools.pages[df])
        return r;
    r.sblk = pools.base[sf] + (uint64_t)sp * kv_page_bytes(&g, sf) +
             kv_block_offset(&g, sf, layer, r.kind, head);
    r.dpage = pools.base[df] + (uint64_t)dp * kv_page_bytes(&g, df);
    r.dblk = r.dpage + kv_block_offset(&g, df, layer, r.kind, head);
    r.ok = true;
    return r;
}

/* Zero the destination block's padding (token-0 row) and the page tail (last block). */
__device__ __forceinline__ void zero_pads(const kv_geom_t &g, kv_fmt_t df, const RowAddr &r,
                                          uint32_t q, uint32_t lpr)
{
    if (r.token != 0)
        return;
    const uint64_t cb = kv_block_code_bytes(&g, df), mo = kv_block_meta_offset(&g, df);
    const uint64_t me = mo + kv_block_meta_bytes(&g, df, r.kind), bb = kv_block_bytes(&g, df, r.kind);
    for (uint64_t i = cb + q; i < mo; i += lpr)
        r.dblk[i] = 0;
    for (uint64_t i = me + q; i < bb; i += lpr)
        r.dblk[i] = 0;
    if (r.last_block) {
        const uint64_t used = (uint64_t)g.layers * kv_layer_bytes(&g, df);
        const uint64_t pb = kv_page_bytes(&g, df);
        for (uint64_t i = used + q; i < pb; i += lpr)
            r.dpage[i] = 0;
    }
}

/* Row r of pair blockIdx.y: r = ((layer·2 + kind)·kv_heads + head)·page_tokens + token. The
 * pair comes from the grid so that only 32-bit divisions remain per row. */
template <int D>
__global__ void __launch_bounds__(kConvThreads)
    retier_kernel(kv_geom_t g, kv_pools_t pools, uint32_t pair0, uint32_t n,
                  const uint32_t *__restrict__ src, const uint32_t *__restrict__ dst,
                  uint32_t rows_per_page)
{
    constexpr int LPR = D / 32;
    __shared__ float s_cent[KV_TQ3_LEVELS];
    if (threadIdx.x < KV_TQ3_LEVELS)
        s_cent[threadIdx.x] = c_centroid[threadIdx.x];
    __syncthreads();

    const uint32_t q = threadIdx.x % LPR;
    const uint32_t row = blockIdx.x * (kConvThreads / LPR) + threadIdx.x / LPR;
    const uint32_t pair = pair0 + blockIdx.y;
    RowAddr r = row_addr(g, pools, n, src, dst, KV_FMT_FP8, KV_FMT_TQ3, pair,
                         row < rows_per_page ? row : 0);
    const bool ok = r.ok && row < rows_per_page; /* every lane stays for the shuffles */

    float x[32];
    if (ok) {
        const uint4 *c4 = reinterpret_cast<const uint4 *>(r.sblk + (uint64_t)r.token * D + 32 * q);
        const uint4 a = c4[0], b = c4[1];
        const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        const float s = *reinterpret_cast<const float *>(
            r.sblk + kv_block_meta_offset(&g, KV_FMT_FP8) + (uint64_t)r.token * 4);
#pragma unroll
        for (int j = 0; j < 32; j++)
            x[j] = __fmul_rn(fp8_to_float((w[j / 4] >> (8 * (j % 4))) & 0xffu), s);
    } else {
#pragma unroll
        for (int j = 0; j < 32; j++)
            x[j] = 0.0f;
    }

    /* Rows of one warp may be of different kinds (page_tokens small or odd), so every shuffle
     * below is executed by all lanes; only shuffle-free work is under a kind branch. */
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < 32; j++)
        ss += (double)x[j] * (double)x[j];
    ss = row_sum<LPR>(ss);
#pragma unroll
    for (int j = 0; j < 32; j++)
        x[j] = __fmul_rn(kv_rot_sign(g.seed, 32 * q + j), x[j]);
    fwht_row<LPR>(x, q);
    const float inv = (float)(1.0 / sqrt((double)D));
#pragma unroll
    for (int j = 0; j < 32; j++)
        x[j] = __fmul_rn(x[j], inv); /* y = R x, as kv_rot_forward */

    uint32_t pw[3] = {0u, 0u, 0u};
    const float nrm = (float)sqrt(ss);
    const bool live = nrm > 0.0f && nrm <= FLT_MAX;
    double dot = 0.0, cc = 0.0;
    if (r.kind == KV_KIND_K && live) {
        float bnd[KV_TQ3_LEVELS - 1];
#pragma unroll
        for (int j = 0; j < KV_TQ3_LEVELS - 1; j++)
            bnd[j] = __fmul_rn(0.5f, __fadd_rn(s_cent[j], s_cent[j + 1]));
        const float sc = __fdiv_rn(__fsqrt_rn((float)D), nrm);
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const float z = __fmul_rn(x[j], sc);
            /* the twin's #{ j : z ≥ b_j } by binary search on the ascending b (NaN → 0) */
            uint32_t c = z >= bnd[3] ? 4u : 0u;
            c += z >= (c ? bnd[5] : bnd[1]) ? 2u : 0u;
            c += z >= (c == 0 ? bnd[0] : c == 2 ? bnd[2] : c == 4 ? bnd[4] : bnd[6]) ? 1u : 0u;
            const float cv = s_cent[c];
            dot += (double)z * (double)cv;
            cc += (double)cv * (double)cv;
            pw[0] |= (c & 1u) << j;
            pw[1] |= ((c >> 1) & 1u) << j;
            pw[2] |= ((c >> 2) & 1u) << j;
        }
    }
    dot = row_sum<LPR>(dot);
    cc = row_sum<LPR>(cc);

    float lo = FLT_MAX, hi = -FLT_MAX;
    int bad = 0;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        bad |= !isfinite(x[j]);
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    lo = row_min<LPR>(lo);
    hi = row_max<LPR>(hi);
    bad = row_sum<LPR>(bad);
    /* value grid (tq3.c): mean and variance summed sequentially in float, step 0.586σ */
    const float sum = row_seq_sum<LPR>(x, q);
    const float mean = __fdiv_rn(sum, (float)D);
    float dev[32];
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const float e = __fsub_rn(x[j], mean);
        dev[j] = __fmul_rn(e, e);
    }
    const float var = row_seq_sum<LPR>(dev, q);
    if (!ok)
        return;

    const uint64_t meta = kv_block_meta_offset(&g, KV_FMT_TQ3);
    if (r.kind == KV_KIND_K) {
        const double beta = dot / D, c2 = cc / D;
        const uint16_t nb = live ? half_sat_bits((float)((double)nrm * beta / c2)) : 0;
        if (q == 0)
            *reinterpret_cast<uint16_t *>(r.dblk + meta + (uint64_t)r.token * 2) = nb;
    } else {
        uint16_t zh = 0, sh = 0;
        if (!bad) {
            const float step =
                __fmul_rn(KV_TQ3_VALUE_STEP_SIGMAS, __fsqrt_rn(__fdiv_rn(var, (float)D)));
            float z0 = lo, s0 = __fdiv_rn(__fsub_rn(hi, lo), 7.0f);
            if (step < s0) { /* the clipped MSE-optimal grid is narrower than min/max */
                z0 = __fsub_rn(mean, __fmul_rn(3.5f, step));
                s0 = step;
            }
            zh = half_sat_bits(z0);
            sh = half_sat_bits(s0);
            const float z = half_bits_to_float(zh), s = half_bits_to_float(sh);
            if (s > 0.0f) {
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    const float qv = rintf(__fdiv_rn(__fsub_rn(x[j], z), s));
                    const uint32_t c = qv >= 7.0f ? 7u : qv > 0.0f ? (uint32_t)qv : 0u;
                    pw[0] |= (c & 1u) << j;
                    pw[1] |= ((c >> 1) & 1u) << j;
                    pw[2] |= ((c >> 2) & 1u) << j;
                }
            }
        }
        if (q == 0) {
            uint16_t *m = reinterpret_cast<uint16_t *>(r.dblk + meta);
            m[r.token] = sh;
            m[g.page_tokens + r.token] = zh;
        }
    }
    uint32_t *wp = reinterpret_cast<uint32_t *>(r.dblk) + ((uint64_t)r.token * LPR + q) * 3;
    wp[0] = pw[0];
    wp[1] = pw[1];
    wp[2] = pw[2];
    zero_pads(g, KV_FMT_TQ3, r, q, LPR);
}

template <int D>
__global__ void __launch_bounds__(kConvThreads)
    promote_kernel(kv_geom_t g, kv_pools_t pools, uint32_t pair0, uint32_t n,
                   const uint32_t *__restrict__ src, const uint32_t *__restrict__ dst,
                   uint32_t rows_per_page)
{
    constexpr int LPR = D / 32;
    __shared__ float s_cent[KV_TQ3_LEVELS];
    if (threadIdx.x < KV_TQ3_LEVELS)
        s_cent[threadIdx.x] = c_centroid[threadIdx.x];
    __syncthreads();

    const uint32_t q = threadIdx.x % LPR;
    const uint32_t row = blockIdx.x * (kConvThreads / LPR) + threadIdx.x / LPR;
    const uint32_t pair = pair0 + blockIdx.y;
    RowAddr r = row_addr(g, pools, n, src, dst, KV_FMT_TQ3, KV_FMT_FP8, pair,
                         row < rows_per_page ? row : 0);
    const bool ok = r.ok && row < rows_per_page;

    float x[32];
    const float inv = (float)(1.0 / sqrt((double)D));
    if (ok) {
        const uint32_t *wp =
            reinterpret_cast<const uint32_t *>(r.sblk) + ((uint64_t)r.token * LPR + q) * 3;
        const uint32_t w0 = wp[0], w1 = wp[1], w2 = wp[2];
        const uint16_t *m =
            reinterpret_cast<const uint16_t *>(r.sblk + kv_block_meta_offset(&g, KV_FMT_TQ3));
        if (r.kind == KV_KIND_K) {
            const float gm = __fmul_rn(half_bits_to_float(m[r.token]), inv);
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const uint32_t c =
                    ((w0 >> j) & 1u) | (((w1 >> j) & 1u) << 1) | (((w2 >> j) & 1u) << 2);
                x[j] = __fmul_rn(s_cent[c], gm);
            }
        } else {
            const float s = half_bits_to_float(m[r.token]);
            const float z = half_bits_to_float(m[g.page_tokens + r.token]);
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const uint32_t c =
                    ((w0 >> j) & 1u) | (((w1 >> j) & 1u) << 1) | (((w2 >> j) & 1u) << 2);
                x[j] = __fadd_rn(__fmul_rn((float)c, s), z);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < 32; j++)
            x[j] = 0.0f;
    }
    fwht_row<LPR>(x, q);
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        x[j] = __fmul_rn(__fmul_rn(x[j], inv), kv_rot_sign(g.seed, 32 * q + j));
        const float a = fabsf(x[j]);
        if (a <= FLT_MAX && a > amax)
            amax = a;
    }
    amax = row_max<LPR>(amax);
    if (!ok)
        return;
    const float s = amax >= FLT_MIN ? __fdiv_rn(amax, KV_FP8_MAX) : 1.0f;
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        uint32_t v = 0;
#pragma unroll
        for (int b = 0; b < 4; b++)
            v |= (uint32_t)__nv_cvt_float_to_fp8(__fdiv_rn(x[4 * i + b], s), __NV_SATFINITE,
                                                  __NV_E4M3)
                 << (8 * b);
        w[i] = v;
    }
    uint4 *c4 = reinterpret_cast<uint4 *>(r.dblk + (uint64_t)r.token * D + 32 * q);
    c4[0] = make_uint4(w[0], w[1], w[2], w[3]);
    c4[1] = make_uint4(w[4], w[5], w[6], w[7]);
    if (q == 0)
        *reinterpret_cast<float *>(r.dblk + kv_block_meta_offset(&g, KV_FMT_FP8) +
                                   (uint64_t)r.token * 4) = s;
    zero_pads(g, KV_FMT_FP8, r, q, LPR);
}

kvk_status_t convert_launch(bool retier, const kv_geom_t *g, const kv_pools_t *pools, uint32_t n,
                            const uint32_t *src, const uint32_t *dst, cudaStream_t st)
{
    if (!kv_geom_valid(g) || !pools)
        return KVK_EINVAL;
    if (n == 0)
        return KVK_OK;
    if (!src || !dst || !pools->base[KV_FMT_FP8] || !pools->base[KV_FMT_TQ3])
        return KVK_EINVAL;
    if ((uintptr_t)pools->base[KV_FMT_FP8] % KV_BLOCK_ALIGN ||
        (uintptr_t)pools->base[KV_FMT_TQ3] % KV_BLOCK_ALIGN)
        return KVK_EINVAL;
    /* rows of one page: layers·2·kv_heads·page_tokens ≤ 1024·2·256·4096 = 2^31 */
    const uint32_t rows = g->layers * 2u * g->kv_heads * g->page_tokens;
    const uint32_t per_block = kConvThreads / (g->head_dim / 32);
    const uint32_t bx = (rows + per_block - 1) / per_block;
    const dim3 block(kConvThreads);
    for (uint32_t p0 = 0; p0 < n; p0 += 65535u) { /* gridDim.y limit */
        const dim3 grid(bx, n - p0 < 65535u ? n - p0 : 65535u);
        switch (g->head_dim) {
        case 64:
            if (retier)
                retier_kernel<64><<<grid, block, 0, st>>>(*g, *pools, p0, n, src, dst, rows);
            else
                promote_kernel<64><<<grid, block, 0, st>>>(*g, *pools, p0, n, src, dst, rows);
            break;
        case 128:
            if (retier)
                retier_kernel<128><<<grid, block, 0, st>>>(*g, *pools, p0, n, src, dst, rows);
            else
                promote_kernel<128><<<grid, block, 0, st>>>(*g, *pools, p0, n, src, dst, rows);
            break;
        default:
            if (retier)
                retier_kernel<256><<<grid, block, 0, st>>>(*g, *pools, p0, n, src, dst, rows);
            else
                promote_kernel<256><<<grid, block, 0, st>>>(*g, *pools, p0, n, src, dst, rows);
            break;
        }
        if (cudaGetLastError() != cudaSuccess)
            return KVK_EDEVICE;
    }
    return cudaGetLastError() == cudaSuccess ? KVK_OK : KVK_EDEVICE;
}

} // namespace

extern "C" kvk_status_t kvk_cuda_page_retier(const kv_geom_t *g, const kv_pools_t *pools,
                                             uint32_t n, const uint32_t *src_phys,
                                             const uint32_t *dst_phys, cudaStream_t stream)
{
    return convert_launch(true, g, pools, n, src_phys, dst_phys, stream);
}

extern "C" kvk_status_t kvk_cuda_page_promote(const kv_geom_t *g, const kv_pools_t *pools,
                                              uint32_t n, const uint32_t *src_phys,
                                              const uint32_t *dst_phys, cudaStream_t stream)
{
    return convert_launch(false, g, pools, n, src_phys, dst_phys, stream);
}
