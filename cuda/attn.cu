/* attn.cu — mixed-format split-K paged decode attention and the partition merge (twins of
 * kv_attn_partial / kv_attn_merge in attn.c; docs/attention.md has the math, docs/perf.md the
 * figures).
 *
 * Two partial kernels with one contract: attn_fast_kernel (the "v2" block comment further down;
 * page_tokens % 16 == 0, one launch for both formats, cp.async rings, bit-op TQ3 decode; its
 * variant P16 copies TQ3 tiles as whole blocks at page_tokens = 16, fast_run16) and the
 * original attn_partial_kernel described here, kept for every other page size.
 *
 * Grid of the partial kernel: (kv_heads · head_groups, num_splits, batch), one launch per format.
 * A block
 * owns one partition of kvkern.h — (sequence, split, format) — for one KV head and up to 8 of
 * its query heads, so every K/V code is fetched and decoded ONCE for the whole GQA group.
 * Separate blocks for FP8 and TQ3 keep each block's inner loop branch-free; a block whose split
 * holds no page of its format only scans the directory and stores the empty partition.
 *
 *   dir[page_ids[p]] ─► compacted list of (phys, live tokens) of this format in smem
 *        │  (read per page at run time; invalid entries are skipped)
 *        ▼
 *   8 warps, each takes 16-token tiles of the list:
 *        S[8 heads × 16 tok] = Q[8 × d] · Kᵀ        mma.m16n8k16 f16→f32, rows 8–15 unused
 *        online softmax in log2 units (q pre-scaled by sm_scale·log2 e)
 *        Oᵀ[d × 8 heads] += Vᵀ[d × 16 tok] · Pᵀ      mma.m16n8k16, P straight from S's registers
 *   block merge of the 8 warps (smem) ─► TQ3: Ō un-rotated once (FWHT in smem) ─► m, l, Ō
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16, g = lane/4, t = lane%4). The contraction index of
 * each MMA may be permuted freely as long as both operands agree; that is what lets every lane
 * read contiguous code bytes:
 *   QK:  B = Kᵀ, lane holds token g of the n-tile and coordinates 4·G(s,t) … +3 at k-step s,
 *        G(s,t) = (s/r)·4r + t·r + s%r with r = min(8, d/16) — for d = 128 lane t owns the 32
 *        coordinates 32t … 32t+31, i.e. 32 FP8 bytes or exactly TQ3 group t (12 bytes).
 *   PV:  A = Vᵀ (rows = coordinates), lane holds tokens 2t, 2t+1, 2t+8, 2t+9 and the d/8
 *        coordinates g·d/8 … of each: 16 FP8 bytes at d = 128, or half a TQ3 group. Row r of
 *        m-tile i is coordinate 4·(g·d/32 + i/2) + 2·(i%2) + r/8.
 *        B = Pᵀ: exactly the S accumulator registers of the two QK n-tiles (no shuffles).
 *
 * Decoding: FP8 pairs → f16x2 by cvt.e4m3x2 (exact). TQ3 (layout 2 of kv_format.h, whose
 * units hold code pairs in exactly these operand orders): a pair becomes an f16x2 of FP16
 * subnormals c·2^(e−24) by one AND (plus a shift for 2 of 5 pairs), and the kernels fold the
 * factor 2^(24−e), the grid's centre and the affine maps around the MMA (kTq3Mid below says
 * how, and why the rounding of the FP16 operands is not amplified). The query enters as FP16,
 * P'·scale as FP16 with a per-warp power-of-two factor F (from the first tile's largest scale)
 * that keeps it out of FP16's subnormal range. Accumulation is fp32 throughout.
 */
#include "kvkern_cuda.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <math.h>

#include <atomic>
#include <type_traits>
#include <utility>

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPageBatch = kThreads; /* directory entries compacted per round */
constexpr int kMaxGroup = 8;         /* query heads per block */
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* TQ3 operands (layout 2, kv_format.h; v13). A code c becomes an FP16 SUBNORMAL operand
 * x = c · 2^(e − 24) with no arithmetic: pairs 0-2 of each unit word sit at bits 3j, 16 + 3j
 * (j ≤ 2: inside the 10-bit mantissa field, exponent field 0), so one AND (LOP3) yields the
 * f16x2; pairs 3-4 take one shift of the word by 9 for both; pair 15 gathers its bits. The
 * exponent e of pair p is tq3_pair_exp(p) = 3·((p % 5) % 3), 0 for pair 15. The kernels fold
 * 2^(24 − e) into the other side of each product, where it costs nothing per token:
 *   K: the query operand of the coordinate pair is q·2^(24 − e − Z) (an exact power-of-two
 *      scaling before its FP16 rounding; Z, uniform over the warp, keeps the largest < 2^15).
 *      The level is C(c) = Δ(c − 3.5), so q·C = Δ·2^Z·(S − 3.5·Σ q'·2^(e − 24)) with S the MMA
 *      result; the offset sum is taken from the same FP16 operands the MMA reads, and Δ·2^Z
 *      joins γ in the per-token factor.
 *   V: s·c + z = s(c − 3.5) + (z + 3.5s). P' = FP16(p·s·F) enters the MMA; Σ P' per head is
 *      accumulated from the SAME rounded P', and each output coordinate is
 *      (O·2^(24 − e) − 3.5·Σ P')/F + Σ p(z + 3.5s), so P''s rounding multiplies |c − 3.5| ≤ 3.5
 *      (layout 1 put c ≤ 7 itself in the MMA); z + 3.5s is carried in fp32.
 * FP16 subnormals are exact operands of mma.sync (products are formed exactly, accumulation
 * is fp32). v9-v12 used the normal form 1 + c/8 (a shift and a LOP3 for every pair). */
constexpr float kTq3Mid = 3.5f; /* the code at the centre of the grid */

__host__ __device__ constexpr uint32_t tq3_pair_exp(uint32_t p)
{
    return p == 15 ? 0u : 3u * ((p % 5u) % 3u);
}
/* 2^k for an integer k in [−126, 127], exact */
__device__ __forceinline__ float pow2i(int k)
{
    return __int_as_float((127 + k) << 23);
}
/* Unit pair of the K operand a lane holds at k-step st, half h (h = 0: k positions 2t, 2t+1;
 * 1: 2t+8, 2t+9). d ≥ 128: pair 2(st % 8) + h of unit t + 4(st / 8); d = 64: unit t/2, pair
 * 8(t & 1) + 2st + h (the fragment layouts at the top of this file). */
template <int D> __device__ __forceinline__ uint32_t tq3_kpair(int st, int h, uint32_t t4)
{
    return D == 64 ? 8u * (t4 & 1u) + 2u * (uint32_t)st + (uint32_t)h
                   : 2u * (uint32_t)(st % 8) + (uint32_t)h;
}
/* Unit pair of the V operand row hr (0: row g, 1: row g + 8) of m-tile i, lane row g8. */
template <int D> __device__ __forceinline__ uint32_t tq3_vpair(int i, int hr, uint32_t g8)
{
    return D == 64 ? 8u * (g8 & 1u) + 2u * (uint32_t)i + (uint32_t)hr
                   : 2u * (uint32_t)(i % 8) + (uint32_t)hr;
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi)
{
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

/* two e4m3 codes (low byte → low half) to f16x2, exact */
__device__ __forceinline__ uint32_t fp8x2_to_h2(uint32_t two)
{
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
    return (uint32_t)r.x | ((uint32_t)r.y << 16);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel)
{
    return __byte_perm(a, b, sel);
}

/* The 16 pairs of a TQ3 unit (words w0..w2) as f16x2 subnormal operands c·2^(e − 24) (above):
 * one AND per pair for pairs 0-2 of a word, one shift and an AND each for pairs 3-4, six
 * instructions for pair 15 — 24 per unit (v12's normal form 1 + c/8 took 36). */
__device__ __forceinline__ void tq3_unit(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t (&h)[16])
{
    const uint32_t w[3] = {w0, w1, w2};
#pragma unroll
    for (int k = 0; k < 3; k++) {
        const uint32_t hi = w[k] >> 9;
        h[5 * k + 0] = w[k] & 0x00070007u;
        h[5 * k + 1] = w[k] & 0x00380038u;
        h[5 * k + 2] = w[k] & 0x01C001C0u;
        h[5 * k + 3] = hi & 0x00070007u;
        h[5 * k + 4] = hi & 0x00380038u;
    }
    /* bit b of pair 15's codes is bit 15 / 31 of word b; gathered to bits b / 16 + b */
    const uint32_t ab = ((w0 >> 15) & 0x00010001u) | ((w1 >> 14) & ~0x00010001u);
    h[15] = ((ab & 0x00030003u) | ((w2 >> 13) & ~0x00030003u)) & 0x00070007u;
}
/* The operand registers one TQ3 unit feeds: pairs 2j, 2j+1 go to dst[base + j][col] and
 * [col + 1] for the unit's 8 steps (d ≥ 128) or, at d = 64, the 4 steps of its half `upper`.
 * K (tq3_kpair's map): dst = kb, base 8·gi for unit t + 4gi, col 0, upper = t & 1.
 * V (tq3_vpair's map): dst = va, base 8·nu, col 2·(token pair), upper = g & 1. */
template <int D, int C>
__device__ __forceinline__ void tq3_place(uint32_t w0, uint32_t w1, uint32_t w2, bool upper,
                                          int base, int col, uint32_t (&dst)[D / 16][C])
{
    constexpr int STEPS = D == 64 ? D / 16 : 8;
    uint32_t h[16];
    tq3_unit(w0, w1, w2, h);
#pragma unroll
    for (int j = 0; j < STEPS; j++) {
        if (D == 64) {
            dst[j][col] = upper ? h[8 + 2 * j] : h[2 * j];
            dst[j][col + 1] = upper ? h[9 + 2 * j] : h[2 * j + 1];
        } else {
            dst[base + j][col] = h[2 * j];
            dst[base + j][col + 1] = h[2 * j + 1];
        }
    }
}
/* TQ3 query operands (above): the lane's K-side values v (already times the softmax factor)
 * become qa = FP16(v · 2^(24 − e − Z)) with Z uniform over the warp; returns Z, and in qs the
 * lane's Σ qa · 2^(e − 24) for the 3.5 offset. */
template <int D>
__device__ __forceinline__ int tq3_query(const float (&v)[D / 16][4], uint32_t t4,
                                         uint32_t (&qa)[D / 16][2], float &qs)
{
    float m = 0.0f;
#pragma unroll
    for (int st = 0; st < D / 16; st++)
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v[st][0]), fabsf(v[st][1])),
                           fmaxf(fabsf(v[st][2]), fabsf(v[st][3]))));
#pragma unroll
    for (int off = 1; off < 32; off <<= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    int ex = 0;
    if (m > 0.0f && m <= FLT_MAX)
        frexpf(m, &ex); /* m < 2^ex, so |v| · 2^(24 − Z) < 2^15 */
    const int Z = min(max(9 + ex, -90), 100);
    qs = 0.0f;
#pragma unroll
    for (int st = 0; st < D / 16; st++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int e = (int)tq3_pair_exp(tq3_kpair<D>(st, h, t4));
            const float sc = pow2i(24 - e - Z);
            qa[st][h] = pack_half2(v[st][2 * h] * sc, v[st][2 * h + 1] * sc);
            const float2 r = __half22float2(*reinterpret_cast<const __half2 *>(&qa[st][h]));
            qs += (r.x + r.y) * pow2i(e - 24);
        }
    }
    return Z;
}
/* 2^x by the SFU alone (v10): exp2f adds a range test and two multiplies around it to keep
 * results below 2^-126 exact; a probability that small is 0 to every sum here. ex2(−inf) = +0.
 * Relative error ≤ 2^-22 (PTX ISA), far inside the 1e-3 attention bound. */
__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
/* Σ of the four FP16 values of two f16x2 registers, in fp32 */
__device__ __forceinline__ float h2sum(uint32_t a, uint32_t b)
{
    const float2 x = __half22float2(*reinterpret_cast<const __half2 *>(&a));
    const float2 y = __half22float2(*reinterpret_cast<const __half2 *>(&b));
    return (x.x + x.y) + (y.x + y.y);
}

__device__ __forceinline__ float half_bits(uint16_t b)
{
    return __half2float(__ushort_as_half(b));
}

/* FP8 keys, QK operand of both kernels: the lane's D/4 code bytes of one token (row; the k
 * positions of lane t, coordinates 4·G(s, t) … of the map at the top of this file) widened
 * exactly to f16x2; zeros for a token that is not in the sequence (row == nullptr). */
template <int D>
__device__ __forceinline__ void fp8_kfrag(const uint8_t *row, uint32_t t4,
                                          uint32_t (&kb)[D / 16][2])
{
    uint32_t kw[D / 16];
    if (!row) {
#pragma unroll
        for (int st = 0; st < D / 16; st++)
            kw[st] = 0u;
    } else if (D == 64) {
        const uint4 v = *reinterpret_cast<const uint4 *>(row + 16 * t4);
        kw[0] = v.x, kw[1] = v.y, kw[2] = v.z, kw[3] = v.w;
    } else {
#pragma unroll
        for (int hh = 0; hh < D / 128; hh++) {
            const uint4 *r4 = reinterpret_cast<const uint4 *>(row + 128 * hh + 32 * t4);
            const uint4 v0 = r4[0], v1 = r4[1];
            kw[8 * hh + 0] = v0.x, kw[8 * hh + 1] = v0.y, kw[8 * hh + 2] = v0.z;
            kw[8 * hh + 3] = v0.w, kw[8 * hh + 4] = v1.x, kw[8 * hh + 5] = v1.y;
            kw[8 * hh + 6] = v1.z, kw[8 * hh + 7] = v1.w;
        }
    }
#pragma unroll
    for (int st = 0; st < D / 16; st++) {
        kb[st][0] = fp8x2_to_h2(kw[st] & 0xffffu);
        kb[st][1] = fp8x2_to_h2(kw[st] >> 16);
    }
}
/* N consecutive 32-bit words (N = 2 or a multiple of 4) by the widest aligned vector loads:
 * one uint2, or N/4 uint4. */
template <int N> __device__ __forceinline__ void ld_words(const void *p, uint32_t (&w)[N])
{
    static_assert(N == 2 || N % 4 == 0, "2 words or whole 16-byte vectors");
    if constexpr (N == 2) {
        const uint2 v = *reinterpret_cast<const uint2 *>(p);
        w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
        for (int c4 = 0; c4 < N / 4; c4++) {
            const uint4 v = reinterpret_cast<const uint4 *>(p)[c4];
            w[4 * c4 + 0] = v.x, w[4 * c4 + 1] = v.y, w[4 * c4 + 2] = v.z, w[4 * c4 + 3] = v.w;
        }
    }
}

/* FP8 values, PV operand of both kernels: the D/8 code bytes of coordinates g8·D/8 … of one
 * token (row), as D/32 words; zeros for a token that is not in the sequence (row == nullptr:
 * its bytes may be NaN codes, and 0 · NaN would poison the MMA). */
template <int D> __device__ __forceinline__ void fp8_vrow(const uint8_t *row, uint32_t (&w)[D / 32])
{
    if (row) {
        ld_words<D / 32>(row, w);
    } else {
#pragma unroll
        for (int c = 0; c < D / 32; c++)
            w[c] = 0u;
    }
}
/* Vᵀ A fragments from the words of tokens 2t, 2t+1, 2t+8, 2t+9 (vw[0..3]): m-tile 2c, 2c+1
 * take word c's bytes pairwise across the token pair, widened exactly to f16x2. */
template <int D>
__device__ __forceinline__ void fp8_vfrag(const uint32_t (&vw)[4][D / 32],
                                          uint32_t (&va)[D / 16][4])
{
#pragma unroll
    for (int c = 0; c < D / 32; c++) {
#pragma unroll
        for (int hp = 0; hp < 2; hp++) { /* token pair (2t, 2t+1) / (2t+8, 2t+9) */
            const uint32_t x0 = prmt(vw[2 * hp][c], vw[2 * hp + 1][c], 0x5140);
            const uint32_t x1 = prmt(vw[2 * hp][c], vw[2 * hp + 1][c], 0x7362);
            va[2 * c][2 * hp + 0] = fp8x2_to_h2(x0 & 0xffffu);
            va[2 * c][2 * hp + 1] = fp8x2_to_h2(x0 >> 16);
            va[2 * c + 1][2 * hp + 0] = fp8x2_to_h2(x1 & 0xffffu);
            va[2 * c + 1][2 * hp + 1] = fp8x2_to_h2(x1 >> 16);
        }
    }
}

/* Per-block constants of one launch. */
struct AttnArgs {
    kv_geom_t g;
    kv_pools_t pools;
    const kv_dir_entry_t *dir;
    uint32_t dir_len;
    uint32_t layer;
    uint32_t batch;
    uint32_t q_heads;
    uint32_t group;       /* q_heads / kv_heads */
    uint32_t head_groups; /* ceil(group / 8) */
    uint32_t num_splits;
    float sm_scale;
    const uint32_t *indptr;
    const uint32_t *page_ids;
    const uint32_t *seq_len;
    const float *q;
    float *part_m, *part_l, *part_o;
};

/* Where the 16 tokens of a tile live, for the tokens this lane touches. */
struct TokRef {
    const uint8_t *page; /* nullptr: token not live */
    uint32_t slot;
};

template <int D, int FMT>
__global__ void __launch_bounds__(kThreads, D == 256 ? 1 : 2) attn_partial_kernel(AttnArgs a)
{
    constexpr int KS = D / 16;  /* k-steps of QK, m-tiles of PV */
    constexpr int NC = D / 32;  /* 4-coordinate chunks per lane in PV */
    constexpr int R = D / 16 < 8 ? D / 16 : 8;
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ float s_q[kMaxGroup][D];
    __shared__ float s_m[kWarps][kMaxGroup], s_l[kWarps][kMaxGroup], s_z[kWarps][kMaxGroup];
    __shared__ uint32_t s_phys[kPageBatch];
    __shared__ uint32_t s_ntok[kPageBatch];
    __shared__ uint32_t s_wcnt[kWarps];

    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const uint32_t g8 = lane >> 2, t4 = lane & 3u;
    const kv_geom_t &geo = a.g;
    const uint32_t kvh = blockIdx.x / a.head_groups, hg = blockIdx.x % a.head_groups;
    const uint32_t split = blockIdx.y, s = blockIdx.z;
    const uint32_t h0 = kvh * a.group + hg * kMaxGroup;
    const uint32_t gh = min(kMaxGroup, a.group - hg * kMaxGroup);
    const uint32_t pt = geo.page_tokens;

    /* ---- pages of this split (the twin's rule), pages past the sequence end dropped ---- */
    const uint32_t ip0 = a.indptr[s];
    const uint32_t np = a.indptr[s + 1] - ip0;
    const uint64_t cap = (uint64_t)np * pt;
    const uint32_t len = (uint32_t)min((uint64_t)a.seq_len[s], cap);
    const uint32_t live_pages = (uint32_t)(((uint64_t)len + pt - 1) / pt);
    uint64_t r0, r1;
    kv_attn_split_range(np, a.num_splits, split, &r0, &r1);
    const uint32_t p0 = (uint32_t)min(r0, (uint64_t)live_pages);
    const uint32_t p1 = (uint32_t)min(r1, (uint64_t)live_pages);

    /* ---- query: (rotated for TQ3) and scaled so that S comes out in log2 units ---- */
    for (uint32_t i = tid; i < kMaxGroup * D; i += kThreads) {
        const uint32_t h = i / D, x = i % D;
        float v = 0.0f;
        if (h < gh) {
            v = a.q[((uint64_t)s * a.q_heads + h0 + h) * D + x];
            if (FMT == KV_FMT_TQ3)
                v *= kv_rot_sign(geo.seed, x);
        }
        s_q[h][x] = v;
    }
    __syncthreads();
    float qf = a.sm_scale * kLog2e;
    if (FMT == KV_FMT_TQ3) {
        for (uint32_t hs = 1; hs < (uint32_t)D; hs <<= 1) {
            for (uint32_t i = tid; i < kMaxGroup * D / 2; i += kThreads) {
                const uint32_t h = i / (D / 2), j = i % (D / 2);
                const uint32_t lo = (j / hs) * 2 * hs + j % hs;
                const float x = s_q[h][lo], y = s_q[h][lo + hs];
                s_q[h][lo] = x + y;
                s_q[h][lo + hs] = x - y;
            }
            __syncthreads();
        }
        qf *= 1.0f / (float)D; /* R's 1/sqrt(d) and the centroids' 1/sqrt(d) */
    }
    uint32_t qa[KS][2];
    float qv[KS][4];
#pragma unroll
    for (int st = 0; st < KS; st++) {
        const uint32_t c = 4u * ((st / R) * 4 * R + t4 * R + st % R);
#pragma unroll
        for (int k = 0; k < 4; k++)
            qv[st][k] = s_q[g8][c + k] * qf;
        qa[st][0] = pack_half2(qv[st][0], qv[st][1]);
        qa[st][1] = pack_half2(qv[st][2], qv[st][3]);
    }
    /* TQ3: scaled operands; the key step with 2^Z in kstep, head g8's offset in kcorr */
    float kcorr = 0.0f, kstep = 0.0f;
    if (FMT == KV_FMT_TQ3) {
        float qsum;
        const int Z = tq3_query<D>(qv, t4, qa, qsum);
        qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
        qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
        kcorr = kTq3Mid * qsum;
        kstep = KV_TQ3_KEY_STEP * pow2i(Z);
    }

    const uint64_t page_bytes = kv_page_bytes(&geo, (kv_fmt_t)FMT);
    const uint64_t koff = kv_block_offset(&geo, (kv_fmt_t)FMT, a.layer, KV_KIND_K, kvh);
    const uint64_t voff = kv_block_offset(&geo, (kv_fmt_t)FMT, a.layer, KV_KIND_V, kvh);
    const uint64_t kmoff = kv_block_meta_offset(&geo, (kv_fmt_t)FMT, KV_KIND_K);
    const uint64_t vmoff = kv_block_meta_offset(&geo, (kv_fmt_t)FMT, KV_KIND_V);
    const uint8_t *pool = a.pools.base[FMT];
    const float rcp_pt = 1.0f / (float)pt;

    float o[KS][4];
#pragma unroll
    for (int i = 0; i < KS; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_run = -INFINITY, l_part = 0.0f, z_part = 0.0f, c_part = 0.0f, F = 0.0f;

    for (uint32_t pb = p0; pb < p1; pb += kPageBatch) {
        /* ---- compact this round's pages of format FMT into smem ---- */
        const uint32_t p = pb + tid;
        bool keep = false;
        uint32_t phys = 0, ntok = 0;
        if (p < p1) {
            const uint32_t id = a.page_ids[ip0 + p];
            if (id < a.dir_len) {
                const kv_dir_entry_t e = a.dir[id];
                phys = kv_dir_phys(e);
                keep = (kv_dir_flags(e) & KV_DIR_VALID) && kv_dir_fmt(e) == (kv_fmt_t)FMT &&
                       phys < a.pools.pages[FMT];
                ntok = min((uint64_t)pt, (uint64_t)len - (uint64_t)p * pt);
            }
        }
        const uint32_t bal = __ballot_sync(0xffffffffu, keep);
        if (lane == 0)
            s_wcnt[warp] = __popc(bal);
        __syncthreads();
        uint32_t before = 0, cnt = 0;
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            before += (uint32_t)w < warp ? s_wcnt[w] : 0u;
            cnt += s_wcnt[w];
        }
        if (keep) {
            const uint32_t pos = before + __popc(bal & ((1u << lane) - 1u));
            s_phys[pos] = phys;
            s_ntok[pos] = ntok;
        }
        __syncthreads();

        /* ---- 16-token tiles of the compacted list ---- */
        const uint32_t ntiles = (cnt * pt + 15) / 16;
        for (uint32_t tile = warp; tile < ntiles; tile += kWarps) {
            /* token κ of the tile → (entry, slot); float reciprocal corrected by ±1 (κ < 2^24) */
            auto tok = [&](uint32_t kap) -> TokRef {
                const uint32_t i = tile * 16 + kap;
                int e = (int)((float)i * rcp_pt);
                int r = (int)i - e * (int)pt;
                if (r < 0) {
                    e--;
                    r += (int)pt;
                } else if (r >= (int)pt) {
                    e++;
                    r -= (int)pt;
                }
                TokRef ref;
                ref.slot = (uint32_t)r;
                ref.page = ((uint32_t)e < cnt && (uint32_t)r < s_ntok[e])
                               ? pool + (uint64_t)s_phys[e] * page_bytes
                               : nullptr;
                return ref;
            };
            const TokRef tk[2] = {tok(g8), tok(g8 + 8)};
            const TokRef tv[4] = {tok(2 * t4), tok(2 * t4 + 1), tok(2 * t4 + 8), tok(2 * t4 + 9)};

            /* per-token metadata of the lane's 4 S columns / P rows */
            float kfac[4], vsc[4], vz[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                kfac[j] = vsc[j] = vz[j] = 0.0f;
                if (tv[j].page) {
                    const uint8_t *km = tv[j].page + koff + kmoff;
                    const uint8_t *vm = tv[j].page + voff + vmoff;
                    if (FMT == KV_FMT_FP8) {
                        kfac[j] = reinterpret_cast<const float *>(km)[tv[j].slot];
                        vsc[j] = reinterpret_cast<const float *>(vm)[tv[j].slot];
                    } else { /* the operand forms of the TQ3 maps (kTq3Mid above) */
                        const float sc =
                            half_bits(reinterpret_cast<const uint16_t *>(vm)[tv[j].slot]);
                        kfac[j] =
                            kstep * half_bits(reinterpret_cast<const uint16_t *>(km)[tv[j].slot]);
                        vsc[j] = sc;
                        vz[j] = half_bits(reinterpret_cast<const uint16_t *>(vm)[pt + tv[j].slot]) +
                                3.5f * sc;
                    }
                }
            }

            /* ---- S = Q Kᵀ ---- */
            float sc[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
                uint32_t kb[KS][2];
                if (FMT == KV_FMT_FP8) {
                    fp8_kfrag<D>(tk[nt].page ? tk[nt].page + koff + (uint64_t)tk[nt].slot * D
                                             : nullptr,
                                 t4, kb);
                } else { /* K units t4 (+ 4·gi) of the token; d = 64: half t4 & 1 of unit t4/2 */
                    constexpr int NG = D == 64 ? 1 : D / 128; /* units per lane */
#pragma unroll
                    for (int gi = 0; gi < NG; gi++) {
                        uint32_t w0 = 0u, w1 = 0u, w2 = 0u;
                        if (tk[nt].page) {
                            const uint32_t grp = D == 64 ? (t4 >> 1) : t4 + 4 * gi;
                            const uint32_t *wp =
                                reinterpret_cast<const uint32_t *>(tk[nt].page + koff) +
                                ((uint64_t)tk[nt].slot * (D / 32) + grp) * 3;
                            w0 = wp[0], w1 = wp[1], w2 = wp[2];
                        }
                        tq3_place<D, 2>(w0, w1, w2, t4 & 1u, 8 * gi, 0, kb);
                    }
                }
#pragma unroll
                for (int st = 0; st < KS; st++)
                    mma16816(sc[nt], qa[st][0], 0u, qa[st][1], 0u, kb[st][0], kb[st][1]);
            }

            /* ---- online softmax (head g8; this lane holds tokens 2t, 2t+1, 2t+8, 2t+9) ---- */
            float sv[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
            float tmax = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (FMT == KV_FMT_TQ3)
                    sv[j] -= kcorr;
                sv[j] = tv[j].page ? sv[j] * kfac[j] : -INFINITY;
                tmax = fmaxf(tmax, sv[j]);
            }
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
            const float m_new = fmaxf(m_run, tmax);
            float alpha = 1.0f, pr[4];
            if (m_new == -INFINITY) {
                pr[0] = pr[1] = pr[2] = pr[3] = 0.0f;
            } else {
                alpha = exp2f(m_run - m_new);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    pr[j] = exp2f(sv[j] - m_new);
            }
            m_run = m_new;
            l_part = l_part * alpha + (pr[0] + pr[1] + pr[2] + pr[3]);
            if (FMT == KV_FMT_TQ3)
                z_part = z_part * alpha +
                         (pr[0] * vz[0] + pr[1] * vz[1] + pr[2] * vz[2] + pr[3] * vz[3]);
            if (__any_sync(0xffffffffu, alpha != 1.0f)) {
                const float aA = __shfl_sync(0xffffffffu, alpha, 8 * t4);
                const float aB = __shfl_sync(0xffffffffu, alpha, 8 * t4 + 4);
#pragma unroll
                for (int i = 0; i < KS; i++) {
                    o[i][0] *= aA, o[i][1] *= aB, o[i][2] *= aA, o[i][3] *= aB;
                }
            }
            if (F == 0.0f) {
                /* first tile: power of two that brings the largest value scale to ≤ 1 */
                float mx = fmaxf(fmaxf(vsc[0], vsc[1]), fmaxf(vsc[2], vsc[3]));
#pragma unroll
                for (int off = 16; off > 0; off >>= 1)
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
                F = mx > 0.0f && mx <= FLT_MAX ? exp2f(-ceilf(log2f(mx))) : 1.0f;
            }
            const uint32_t pb0 = pack_half2(pr[0] * vsc[0] * F, pr[1] * vsc[1] * F);
            const uint32_t pb1 = pack_half2(pr[2] * vsc[2] * F, pr[3] * vsc[3] * F);
            if (FMT == KV_FMT_TQ3) /* Σ P' of head g8 from the rounded operands */
                c_part = c_part * alpha + h2sum(pb0, pb1);

            /* ---- Oᵀ += Vᵀ Pᵀ ---- */
            uint32_t va[KS][4];
            if (FMT == KV_FMT_FP8) {
                uint32_t vw[4][NC];
#pragma unroll
                for (int j = 0; j < 4; j++)
                    fp8_vrow<D>(tv[j].page ? tv[j].page + voff + (uint64_t)tv[j].slot * D +
                                                 g8 * (D / 8)
                                           : nullptr,
                                vw[j]);
                fp8_vfrag<D>(vw, va);
            } else {
                /* the lane's coordinates (D/8)·g8 + 2i + r/8 (m-tile i, row r) are pairs of the V
                 * units (D/8)·g8/16 … of a token pair. The tile's tokens 2t, 2t+1 need not be a
                 * stored pair (tiles cross pages here), so each sits in the low or high half of
                 * its own unit (slot parity): PRMT merges the two units' words into one whose
                 * low codes are token A's and high codes token B's, decoded once */
                constexpr int NU = D == 256 ? 2 : 1;  /* units per lane and token pair */
#pragma unroll
                for (int hp = 0; hp < 2; hp++) {
                    const TokRef &A = tv[2 * hp], &B = tv[2 * hp + 1];
                    const uint32_t sel =
                        ((A.slot & 1u) ? 0x32u : 0x10u) | ((B.slot & 1u) ? 0x7600u : 0x5400u);
#pragma unroll
                    for (int nu = 0; nu < NU; nu++) {
                        const uint32_t q = D == 64 ? g8 / 2 : (D / 128) * g8 + nu;
                        uint32_t wa[3] = {0u, 0u, 0u}, wb[3] = {0u, 0u, 0u};
                        if (A.page) {
                            const uint32_t *wp = reinterpret_cast<const uint32_t *>(A.page + voff) +
                                                 ((uint64_t)(A.slot / 2) * (D / 16) + q) * 3;
                            wa[0] = wp[0], wa[1] = wp[1], wa[2] = wp[2];
                        }
                        if (B.page) {
                            const uint32_t *wp = reinterpret_cast<const uint32_t *>(B.page + voff) +
                                                 ((uint64_t)(B.slot / 2) * (D / 16) + q) * 3;
                            wb[0] = wp[0], wb[1] = wp[1], wb[2] = wp[2];
                        }
                        tq3_place<D, 4>(prmt(wa[0], wb[0], sel), prmt(wa[1], wb[1], sel),
                                        prmt(wa[2], wb[2], sel), g8 & 1u, 8 * nu, 2 * hp, va);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < KS; i++)
                mma16816(o[i], va[i][0], va[i][1], va[i][2], va[i][3], pb0, pb1);
        }
        __syncthreads(); /* s_phys / s_ntok are rewritten next round */
    }

    /* ---- merge the warps ---- */
    l_part += __shfl_xor_sync(0xffffffffu, l_part, 1);
    l_part += __shfl_xor_sync(0xffffffffu, l_part, 2);
    z_part += __shfl_xor_sync(0xffffffffu, z_part, 1);
    z_part += __shfl_xor_sync(0xffffffffu, z_part, 2);
    c_part += __shfl_xor_sync(0xffffffffu, c_part, 1);
    c_part += __shfl_xor_sync(0xffffffffu, c_part, 2);
    /* o's columns are heads 2t, 2t+1; their Σ P' lives in lanes 8t and 8t + 4 */
    const float cA = kTq3Mid * __shfl_sync(0xffffffffu, c_part, 8 * t4);
    const float cB = kTq3Mid * __shfl_sync(0xffffffffu, c_part, 8 * t4 + 4);
    /* TQ3: row r of m-tile i carries 2^(e − 24) of its unit pair (kTq3Mid above) */
    __syncthreads(); /* every warp is done with the smem that s_o overlays */
    float *s_o = reinterpret_cast<float *>(smem); /* [kWarps][kMaxGroup][D] */
    if (t4 == 0) {
        s_m[warp][g8] = m_run;
        s_l[warp][g8] = l_part;
        s_z[warp][g8] = z_part;
    }
    const float invF = F > 0.0f ? 1.0f / F : 0.0f;
#pragma unroll
    for (int i = 0; i < KS; i++) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const uint32_t x = 4u * (g8 * (D / 32) + i / 2) + 2u * (i % 2) + hr;
            float *base = s_o + ((size_t)warp * kMaxGroup) * D;
            if (FMT == KV_FMT_TQ3) {
                const float vs = pow2i(24 - (int)tq3_pair_exp(tq3_vpair<D>(i, hr, g8)));
                base[(2 * t4) * D + x] = (o[i][2 * hr] * vs - cA) * invF;
                base[(2 * t4 + 1) * D + x] = (o[i][2 * hr + 1] * vs - cB) * invF;
            } else {
                base[(2 * t4) * D + x] = o[i][2 * hr] * invF;
                base[(2 * t4 + 1) * D + x] = o[i][2 * hr + 1] * invF;
            }
        }
    }
    __syncthreads();
    for (uint32_t i = tid; i < kMaxGroup * D; i += kThreads) {
        const uint32_t h = i / D, x = i % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; w++)
            M = s_l[w][h] > 0.0f ? fmaxf(M, s_m[w][h]) : M;
        float L = 0.0f, acc = 0.0f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < kWarps; w++) {
                if (s_l[w][h] > 0.0f) {
                    const float f = exp2f(s_m[w][h] - M);
                    L += f * s_l[w][h];
                    acc += f * (s_o[((size_t)w * kMaxGroup + h) * D + x] + s_z[w][h]);
                }
            }
        }
        s_q[h][x] = L > 0.0f ? acc / L : 0.0f;
        if (x == 0 && h < gh) {
            const size_t part =
                ((size_t)s * a.num_splits + split) * KV_FMT_COUNT + (size_t)FMT;
            a.part_m[part * a.q_heads + h0 + h] = L > 0.0f ? M * kLn2 : -INFINITY;
            a.part_l[part * a.q_heads + h0 + h] = L;
        }
    }
    __syncthreads();
    if (FMT == KV_FMT_TQ3) {
        /* Ō = Rᵀ ŷ: FWHT, then 1/sqrt(d) and the signs */
        for (uint32_t hs = 1; hs < (uint32_t)D; hs <<= 1) {
            for (uint32_t i = tid; i < kMaxGroup * D / 2; i += kThreads) {
                const uint32_t h = i / (D / 2), j = i % (D / 2);
                const uint32_t lo = (j / hs) * 2 * hs + j % hs;
                const float x = s_q[h][lo], y = s_q[h][lo + hs];
                s_q[h][lo] = x + y;
                s_q[h][lo + hs] = x - y;
            }
            __syncthreads();
        }
    }
    const float post = FMT == KV_FMT_TQ3 ? (float)(1.0 / sqrt((double)D)) : 1.0f;
    const size_t part = ((size_t)s * a.num_splits + split) * KV_FMT_COUNT + (size_t)FMT;
    for (uint32_t i = tid; i < gh * D; i += kThreads) {
        const uint32_t h = i / D, x = i % D;
        float v = s_q[h][x];
        if (FMT == KV_FMT_TQ3)
            v = v * post * kv_rot_sign(geo.seed, x);
        a.part_o[(part * a.q_heads + h0 + h) * D + x] = v;
    }
}

/* ---- v2: pipelined single-launch kernel, page_tokens % 16 == 0 ---------------------------
 *
 * v1 (attn_partial_kernel above, still used when page_tokens is not a multiple of 16) was
 * latency-bound: each warp loaded a tile, then computed, with nothing in flight meanwhile, a
 * second launch for the other format, and 4096-entry tables whose 8-byte random reads had
 * ~3x bank conflicts. v2 keeps the fragment layouts and the partition contract and changes:
 *   - a tile is 16 tokens of ONE page (page_tokens % 16 == 0), so its K codes, K metadata, V
 *     codes and V metadata are 4-5 contiguous 16-byte-aligned runs. Each warp streams its own
 *     tiles through a ring of NS shared-memory stages with cp.async (16 B per lane per copy),
 *     NS-1 tiles in flight while it computes one: ~10 KB per warp in flight.
 *   - each warp finds its pages itself (32 directory entries per ballot), no block barrier in
 *     the main loop; a block handles both formats in one launch, one phase per format, and
 *     skips a phase whose format has no page in its split (pre-scan of the directory).
 *   - TQ3 K and V (v9-v13, layout 2): no table, no plane regrouping; a K unit is one token's
 *     32 coordinates of a lane's k positions, a V unit one coordinate range of a token pair,
 *     each decoded by tq3_unit in 24 instructions (v5's tables and regrouping took ~310 per
 *     16-token tile, docs/perf.md). Two tiles per loop iteration (v11).
 *   - QK as Sᵀ = K·Qᵀ: the 16 tokens fill the MMA rows (v4); P is moved back to the PV
 *     operand layout by two movmatrix.trans.
 *   - 16 warps per block, one block per SM at d ≤ 128 (v36: two blocks of 8 where the grid has
 *     more blocks than SMs, launch_partial) (≤ 128 registers; v22, 4 blocks of 4
 *     warps before), 2 blocks of 4 warps at d = 256; splits chosen so that all blocks are
 *     resident at once (kvk_cuda_attn_suggest_splits).
 *   - v7/v8 cut the fixed per-block costs that a timeline probe (KVK_ATTN_TRACE below) showed:
 *     bank conflicts in the warp merge (padded s_o) and in the QK operand reads (padded q
 *     rows), per-coordinate recomputation of the warp weights, run-time divisions in the
 *     FWHT, dependent directory loads in the format pre-scan, the first tiles requested before
 *     the query prologue; the merge kernel skips empty partitions.
 * docs/perf.md has each version's figures and what limits the TQ3 path (latency at this
 * occupancy plus integer decode work; ~33% of copy bandwidth at B=8 128K).
 */
/* v22: warps per block of the fast kernel. d ≤ 128: 16, ONE block per SM (the same warps per
 * SM as v5-v21's 4 blocks of 4). Blocks sharing an SM finished 20-30 µs apart although they
 * did the same work (the warp schedulers favour some blocks; timeline dump, docs/perf.md) and
 * the SM then ran on with fewer warps; the warps of ONE block, taking every kWarps-th page,
 * finish together, and a split 4× longer pays the prologue, the epilogue and the merge 4×
 * less (B=8 32K FP8 −3%, TQ3 −3-5%). d = 256 keeps 2 blocks of 4: one block of 8 warps was
 * 1.4× SLOWER for TQ3 at B=2 (16 splits instead of 33: the blocks' fixed costs did not shrink
 * and half the blocks' latency hiding went); its in-SM spread was only 1.5-2 µs anyway. */
#ifndef KVK_FAST_WARPS128
#define KVK_FAST_WARPS128 16
#endif
#ifndef KVK_FAST_WARPS256
#define KVK_FAST_WARPS256 4
#endif
/* d ≤ 128: warps of a block that has its SM to itself, and of one of two (launch_partial) */
constexpr int kWarpsOne = KVK_FAST_WARPS128, kWarpsTwo = KVK_FAST_WARPS128 / 2;

template <int D, int WARPS = D == 256 ? KVK_FAST_WARPS256 : KVK_FAST_WARPS128> struct FastCfg {
    static constexpr uint32_t kStage8 = 32u * D + 128u; /* K codes, K scales, V codes, V scales */
    static constexpr uint32_t kStageT = 12u * D + 96u;  /* K units, γ, V units, scale, zero */
    /* v5: 4 blocks (16 warps) per SM at d ≤ 128 — the TQ3 path is latency-bound (v4 ncu) —
     * so the rings shrink to fit 4 blocks: 2 FP8 / 6 TQ3 stages */
    static constexpr int kWarps = WARPS;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kMinBlocks = (D == 256 ? 8 : 16) / kWarps;
    static constexpr int kNs8 = 2;
    static constexpr int kNsT = 6; /* even: TQ3 takes two tiles per iteration (v11) */
    static constexpr uint32_t kWarpBuf =
        kNs8 * kStage8 > kNsT * kStageT ? kNs8 * kStage8 : kNsT * kStageT;
    static constexpr size_t kSmem = (size_t)kWarps * kWarpBuf;
    static constexpr uint32_t kORow = D + D / 32; /* padded row of the warp-merge buffer */
    static_assert(kSmem >= (size_t)kWarps * kMaxGroup * kORow * sizeof(float), "merge overlay");
    static_assert(kWarps >= 4, "at most two query heads per warp in the prologue");
    static_assert(kStage8 % 16 == 0 && kStageT % 16 == 0, "stage alignment");
};

__device__ __forceinline__ void cp16(void *dst, const void *src)
{
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
/* the same with a shared-window address already in 32 bits */
__device__ __forceinline__ void cp16s(uint32_t dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
/* v34: the FP8 phase's copies of page bytes (cp_seg) carry an L2 evict-first policy. A decode
 * call streams 13 MB-2.2 GB of pages (the benchmark's cases), each byte read once, through a
 * 60 MB L2, and with the default policy that stream evicts what the call and the next one read
 * again (page ids, directory entries, queries, partitions, the kernels' code). On the H200
 * all-FP8 at B=8 8K and 32K ran 2-5% faster with the hint, both back to back and after a
 * 256 MB read had filled L2 (as between two layers of an engine). The same hint on the TQ3
 * copies made TQ3 and the mix faster back to back but 2-4% slower at B=8 8K/32K after the
 * L2-filling read, so those copies keep the default policy (docs/perf.md "Session 14").
 * createpolicy is a non-volatile asm, so the compiler may share one policy between copies: it
 * builds it once per tile's copies (not once per thread), most of the FP8 loop's growth at
 * d = 128 from 658 to 679 instructions (P16); the loop ran faster all the same. */
__device__ __forceinline__ uint64_t kv_policy()
{
    uint64_t p; /* not volatile: the compiler may compute it once */
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
__device__ __forceinline__ void cp16_kv(void *dst, const void *src)
{
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(d),
                 "l"(src), "l"(kv_policy())
                 : "memory");
}
/* a bulk prefetch of bytes (a multiple of 16, from a 16-byte aligned p) into L2 */
__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes)
{
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_seg(uint8_t *dst, const uint8_t *src, uint32_t bytes,
                                       uint32_t lane)
{
    for (uint32_t c = lane * 16u; c < bytes; c += 512u)
        cp16_kv(dst + c, src + c);
}

/* transpose of an 8×8 b16 matrix held in the m8n8 fragment layout (row lane/4, columns
 * 2·(lane%4), +1) */
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x)
{
    uint32_t r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

struct FastBlock {
    uint32_t kvh, split, s, h0, gh, pt, ip0, len, p0, p1;
};
/* live tokens of page p (< the live pages) of the block's sequence */
__device__ __forceinline__ uint32_t fast_page_tokens(const FastBlock &bk, uint64_t p)
{
    return (uint32_t)min((uint64_t)bk.pt, (uint64_t)bk.len - p * bk.pt);
}

/* Timeline probe of the fast kernel, compiled only with -DKVK_ATTN_TRACE (a separate bench
 * binary, never the library build): thread 0 of each of the first kTraceBlocks blocks records
 * clock64 at points 0-8 and 14-15 (the TRACE calls), %globaltimer at start (10) and end (11)
 * and its SM (12). docs/perf.md v7 reads it. */
#ifdef KVK_ATTN_TRACE
constexpr int kTraceBlocks = 4096;
__device__ unsigned long long g_trace[kTraceBlocks][16];
__device__ __forceinline__ void trace_put(int k, unsigned long long v)
{
    const uint32_t b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0 && b < (uint32_t)kTraceBlocks)
        g_trace[b][k] = v;
}
__device__ __forceinline__ unsigned long long gtimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define TRACE(k) trace_put((k), (unsigned long long)clock64())
#define TRACE_GT(k) trace_put((k), gtimer())
#else
#define TRACE(k) ((void)0)
#define TRACE_GT(k) ((void)0)
#endif
/* -DKVK_ATTN_TRACE_FINE as well: the TQ3 phase also records inside its prologue (2: first
 * tiles issued, 3: query rotated, 4: after the barrier that publishes it) and its epilogue
 * (9: warp partials stored, 13: weights computed) — slots the FP8 phase owns, so read only
 * all-TQ3 cases of such a build (bench/trace_dump.py). Slot 14 marks, with
 * KVK_ATTN_TRACE_FINE=1, the end of the first head's warp combine in the epilogue; with =2, the
 * query's arrival (its first use, the rotation signs) in the prologue; with =3, the first tile
 * requested (after the phase's first directory batch). */
#if defined(KVK_ATTN_TRACE) && defined(KVK_ATTN_TRACE_FINE)
#define TRACE_FINE(fmt, k)                                                                        \
    do {                                                                                           \
        if ((fmt) == KV_FMT_TQ3)                                                                   \
            TRACE(k);                                                                              \
    } while (0)
#define TRACE_FINE14(fmt, where)                                                                  \
    do {                                                                                           \
        if ((where) == KVK_ATTN_TRACE_FINE)                                                        \
            TRACE_FINE(fmt, 14);                                                                   \
    } while (0)
#else
#define TRACE_FINE(fmt, k) ((void)0)
#define TRACE_FINE14(fmt, where) ((void)0)
#endif

/* v8: rows of the fast kernel's q buffer are D + 4 floats. With rows of D floats every lane's
 * read of its QK operand (row g8, coordinates 4·(t4·R + s) …) hit one bank: 32-way conflicts
 * on 4·KS loads per lane. Padded rows and one 16-byte load per k-step leave 4-way conflicts
 * on KS loads (timeline probe: FP8 prologue 11.0k → 8.7k cycles at d = 256, unchanged at
 * d = 128, where the directory and query loads dominate it). */
template <int D> struct FastQRow {
    static constexpr int kLen = D + 4;
};

template <int D> struct FastSmem {
    float (*q)[FastQRow<D>::kLen];
    float (*m)[kMaxGroup];
    float (*l)[kMaxGroup];
    float (*z)[kMaxGroup];
    uint32_t (*tn)[8];
    uint32_t *sgn; /* [32]: bit k of word ℓ is the rotation sign of coordinate ℓ·D/32 + k */
    uint8_t *buf;
};

/* v15: in-register FWHT (unnormalised) of one row of D values held by a warp, lane ℓ holding
 * elements ℓ·D/32 … +D/32 − 1: the butterflies within a lane first, then one xor-shuffle per
 * remaining stage (the lane with the bit clear keeps a + b, the other b − a's negation, a − b).
 * v7/v8 ran the stages in shared memory with a block barrier each (log2 D of them, in the
 * prologue and again in the epilogue of every TQ3 phase: ~16k and ~7k cycles per block at
 * d = 128 in the timeline probe). The summation order differs from kv_rot_forward's; the
 * attention contract is a tolerance, not bits. */
template <int D> __device__ __forceinline__ void fwht_warp(float (&v)[D / 32], uint32_t lane)
{
    constexpr int NE = D / 32;
#pragma unroll
    for (int h = 1; h < NE; h <<= 1) {
#pragma unroll
        for (int k = 0; k < NE; k++) {
            if (!(k & h)) {
                const float x = v[k], y = v[k + h];
                v[k] = x + y;
                v[k + h] = x - y;
            }
        }
    }
#pragma unroll
    for (uint32_t m = 1; m < 32; m <<= 1) {
#pragma unroll
        for (int k = 0; k < NE; k++) {
            const float o = __shfl_xor_sync(0xffffffffu, v[k], m);
            v[k] = (lane & m) ? o - v[k] : v[k] + o;
        }
    }
}

template <int D, int FMT, bool P16, int WARPS>
__device__ __forceinline__ void fast_phase(const AttnArgs &a, const FastBlock &bk,
                                           const FastSmem<D> &sm)
{
    using C = FastCfg<D, WARPS>;
    constexpr int KS = D / 16;
    constexpr int NC = D / 32;
    constexpr int R = D / 16 < 8 ? D / 16 : 8;
    constexpr int NS = FMT == KV_FMT_FP8 ? C::kNs8 : C::kNsT;
    constexpr uint32_t STAGE = FMT == KV_FMT_FP8 ? C::kStage8 : C::kStageT;
    /* v11: tiles per loop iteration. TQ3 takes two: twice the independent work between the
     * waits (its loop is latency-bound at 4 warps per scheduler) and one softmax reduction,
     * vote and loop overhead per two tiles. FP8 keeps one (its 2-stage ring is what fits). */
    constexpr int TPI = FMT == KV_FMT_TQ3 ? 2 : 1;
    static_assert(NS % TPI == 0 && NS > TPI, "the ring holds whole iterations plus one");
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const uint32_t g8 = lane >> 2, t4 = lane & 3u;
    const kv_geom_t &geo = a.g;
    const uint32_t pt = bk.pt;

    __syncthreads(); /* s_q and the rings may still be read by the previous phase */
    const uint64_t page_bytes = kv_page_bytes(&geo, (kv_fmt_t)FMT);
    const uint64_t koff = kv_block_offset(&geo, (kv_fmt_t)FMT, a.layer, KV_KIND_K, bk.kvh);
    const uint64_t voff = kv_block_offset(&geo, (kv_fmt_t)FMT, a.layer, KV_KIND_V, bk.kvh);
    const uint64_t kmoff = kv_block_meta_offset(&geo, (kv_fmt_t)FMT, KV_KIND_K);
    const uint64_t vmoff = kv_block_meta_offset(&geo, (kv_fmt_t)FMT, KV_KIND_V);
    const uint8_t *pool = a.pools.base[FMT];
    uint8_t *ring = sm.buf + (size_t)warp * C::kWarpBuf;

    /* v32's plan where the launcher found it valid (fast_run16: pt = 16, each block's
     * metadata right after its codes, a page's offset within the 32-bit factor of IMAD.WIDE);
     * a kernel of its own, so that neither plan's code sits in the other's loop */
    constexpr bool run16 = FMT == KV_FMT_TQ3 && P16;
    /* page numbers: < 2^28 (a sequence's live tokens fit 32 bits and pt ≥ 16), so 32 bits
     * carry the cursor with room for its last step; v32 uses that (one register fewer in a
     * loop at the register limit), the other plans keep v14's 64 */
    using ItBase = typename std::conditional<run16, uint32_t, uint64_t>::type;

    /* ---- this warp's tiles: pages p0 + warp + kWarps·k of format FMT, 16 tokens each ---- */
    ItBase it_base = (ItBase)bk.p0 + warp;
    uint32_t it_mask = 0, it_phys = 0, it_ntok = 0;
    uint32_t cur_phys = 0, cur_ntok = 0, cur_tok = 0;
    /* one directory batch: the warp's next 32 pages, one per lane; it_mask marks those of
     * format FMT */
    auto refill = [&]() {
        const ItBase p = it_base + (ItBase)C::kWarps * lane;
        bool keep = false;
        it_phys = it_ntok = 0;
        if (p < bk.p1) {
            const uint32_t id = a.page_ids[bk.ip0 + p];
            if (id < a.dir_len) {
                const kv_dir_entry_t e = a.dir[id];
                it_phys = kv_dir_phys(e);
                keep = (kv_dir_flags(e) & KV_DIR_VALID) && kv_dir_fmt(e) == (kv_fmt_t)FMT &&
                       it_phys < a.pools.pages[FMT];
                it_ntok = fast_page_tokens(bk, p);
            }
        }
        if constexpr (run16) /* phys · 32 + tokens, one word (phys < 2^27: fast_run16) */
            it_phys = (it_phys << 5) | it_ntok;
        it_mask = __ballot_sync(0xffffffffu, keep);
        it_base += (ItBase)C::kWarps * 32u;
    };
    /* v14: the common case (the next tile starts a page that the current batch holds) is
     * straight-line code; only a batch refill loops */
    auto next = [&](uint32_t &phys, uint32_t &tok0, uint32_t &n) {
        if (cur_tok >= cur_ntok) {
            while (it_mask == 0) {
                if (it_base >= bk.p1) {
                    phys = tok0 = n = 0;
                    return;
                }
                refill();
            }
            const int l = __ffs(it_mask) - 1;
            it_mask &= it_mask - 1u;
            cur_phys = __shfl_sync(0xffffffffu, it_phys, l);
            cur_ntok = __shfl_sync(0xffffffffu, it_ntok, l);
            cur_tok = 0;
        }
        phys = cur_phys;
        tok0 = cur_tok;
        n = min(16u, cur_ntok - cur_tok);
        cur_tok += 16u;
    };
    /* v10: a TQ3 stage is one contiguous run of 16-byte chunks in shared memory (K codes, γ,
     * V codes, scale, zero: 12D + 96 bytes) gathered from five runs of the page.
     * v32: at page_tokens = 16 (kvd's default: one tile per page) those five runs are two, the
     * head's K block (codes, γ: 6D + 32 bytes) and V block (codes, scale, zero: 6D + 64), and
     * the stage holds them back to back. Lanes 0-15 copy the K block and lanes 16-31 the V
     * block, chunk j of lane ℓ at 16·(ℓ % 16) + 256·j of its run, so a tile costs one 64-bit
     * source per lane (phys · page_bytes plus a per-lane constant: one IMAD.WIDE) and the
     * chunks are immediate offsets from it. v14's plan (below) spent ~84 executed instructions
     * per tile in the loop's SASS on the directory step, a modulo for the stage and a 64-bit
     * add per chunk; it stays for other page sizes: lane chunks c = lane + 32j keep their
     * offset from the page's K block at tok0 = 0 and their growth per token (codes: 12·D/32
     * bytes, FP16 metadata: 2). Offsets inside one layer fit 32 bits (a layer is < 2^30 bytes
     * at the geometry limits). */
    constexpr int NCH = (int)((C::kStageT / 16 + 31) / 32);
    constexpr uint32_t KB16 = 6u * D + 32u, VB16 = 6u * D + 64u; /* the blocks at pt = 16 */
    static_assert(KB16 + VB16 == C::kStageT && (VB16 + 255) / 256 == (uint32_t)NCH,
                  "a pt = 16 TQ3 stage is the K block, then the V block");
    uint32_t coff[NCH], cmeta = 0; /* bit j: chunk j is FP16 metadata (grows 2 B per token) */
    const bool last_ok = 16u * (lane + 32u * (NCH - 1)) < C::kStageT;
    const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring) + 16u * lane;
    const uint32_t vlane = lane >> 4, l16 = 16u * (lane & 15u);
    const uint8_t *lsrc = pool + (vlane ? voff : koff) + l16;          /* + phys · page_bytes */
    const uint32_t ldst = (uint32_t)__cvta_generic_to_shared(ring) + (vlane ? KB16 : 0u) + l16;
    /* lanes whose last chunk lies inside their block, as a constant lane mask */
    constexpr uint32_t kLast16 =
        ((1u << ((KB16 - 256u * (NCH - 1)) / 16u)) - 1u) |
        (((1u << ((VB16 - 256u * (NCH - 1)) / 16u)) - 1u) << 16);
    static_assert((KB16 - 256u * (NCH - 1)) / 16u <= 16u && (VB16 - 256u * (NCH - 1)) / 16u <= 16u,
                  "the last chunks of a block fit in its 16 lanes");
    const bool last16 = (kLast16 >> lane) & 1u;
    const uint32_t tn_s = (uint32_t)__cvta_generic_to_shared(&sm.tn[warp][0]);
    const uint32_t pb32 = (uint32_t)page_bytes;
    if (FMT == KV_FMT_TQ3 && !run16) {
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            const uint32_t b = 16u * (lane + 32u * (uint32_t)j);
            const uint32_t vk = (uint32_t)(voff - koff);
            coff[j] = 0u;
            if (b < 6u * D) {
                coff[j] = b;
            } else if (b < 6u * D + 32u) {
                coff[j] = (uint32_t)kmoff + (b - 6u * D), cmeta |= 1u << j;
            } else if (b < 12u * D + 32u) {
                coff[j] = vk + (b - 6u * D - 32u);
            } else if (b < 12u * D + 64u) {
                coff[j] = vk + (uint32_t)vmoff + (b - 12u * D - 32u), cmeta |= 1u << j;
            } else {
                coff[j] = vk + (uint32_t)vmoff + 2u * pt + (b - 12u * D - 64u);
                cmeta |= 1u << j;
            }
        }
    }
    /* v32: the directory step of a pt = 16 tile, where every tile starts a page: no token
     * cursor, the batch refilled (rarely) before the lowest marked lane is taken */
    auto next16 = [&](uint32_t &phys, uint32_t &n) {
        if (it_mask == 0 && it_base < bk.p1) { /* a do-while, so that ptxas keeps the refill's
                                                  constants out of the tile's path */
            do
                refill();
            while (it_mask == 0 && it_base < bk.p1);
        }
        const uint32_t m = it_mask;
        const uint32_t l = (uint32_t)(__ffs(m) - 1) & 31u;
        it_mask = m & (m - 1u);
        const uint32_t pk = __shfl_sync(0xffffffffu, it_phys, l); /* refill's packed word */
        phys = pk >> 5;
        n = m ? pk & 31u : 0u;
    };
    auto issue = [&](uint32_t stage) {
        uint32_t phys, tok0 = 0, n;
        if constexpr (run16)
            next16(phys, n);
        else
            next(phys, tok0, n);
        if (lane == 0) {
            if constexpr (run16) /* a 32-bit shared address, not the generic one rebuilt */
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(tn_s + 4u * stage), "r"(n)
                             : "memory");
            else
                sm.tn[warp][stage] = n;
        }
        if (n) {
            if (FMT == KV_FMT_FP8) {
                const uint8_t *pg = pool + (uint64_t)phys * page_bytes;
                uint8_t *st = ring + stage * STAGE;
                cp_seg(st, pg + koff + (uint64_t)tok0 * D, 16u * D, lane);
                cp_seg(st + 16 * D, pg + koff + kmoff + 4ull * tok0, 64u, lane);
                cp_seg(st + 16 * D + 64, pg + voff + (uint64_t)tok0 * D, 16u * D, lane);
                cp_seg(st + 32 * D + 64, pg + voff + vmoff + 4ull * tok0, 64u, lane);
            } else if constexpr (run16) { /* v32 */
                const uint8_t *src = lsrc + (uint64_t)phys * pb32;
                const uint32_t dst = ldst + stage * STAGE;
#pragma unroll
                for (int j = 0; j < NCH; j++)
                    if (j < NCH - 1 || last16)
                        cp16s(dst + 256u * j, src + 256u * j);
            } else { /* K units of tokens tok0…, V units of pairs tok0/2… (tok0 even) */
                const uint8_t *kb = pool + (uint64_t)phys * page_bytes + koff;
                const uint32_t ss = ring_s + stage * STAGE;
                if (tok0 == 0) {
#pragma unroll
                    for (int j = 0; j < NCH; j++)
                        if (j < NCH - 1 || last_ok)
                            cp16s(ss + 512u * j, kb + coff[j]);
                } else {
#pragma unroll
                    for (int j = 0; j < NCH; j++)
                        if (j < NCH - 1 || last_ok)
                            cp16s(ss + 512u * j,
                                  kb + coff[j] + tok0 * ((cmeta >> j) & 1u ? 2u : 12u * (D / 32)));
                }
            }
        }
        cp_commit();
    };

    /* v15: warp w < kMaxGroup/2 loads query heads 2w, 2w + 1 (lane ℓ: coordinates ℓ·D/32 …)
     * BEFORE the first NS − TPI tiles are requested (v7), so the query and the directory walk
     * are in flight together; TQ3 rotates them in registers (fwht_warp); one barrier publishes
     * them. The epilogue uses the same warp ↔ head map. (v22 with 16 warps: one head per warp
     * over 8 warps instead measured 2-4% slower at B=8 32K: 128 registers instead of 122.)
     * v24: the prologue and the epilogue run once per block, so their code is fetched cold
     * (a fine timeline showed ~5-6 cycles per instruction there: 5.8k cycles to rotate two
     * heads at d = 256, 6.9k to combine and un-rotate them). Their loops over heads, warps,
     * tiles and signs stay rolled (#pragma unroll 1) wherever no register array is indexed by
     * the loop variable: the query rows pass through shared memory for that. At d = 256 this
     * took B=2 32K TQ3 from 0.0385-0.0392 to 0.0317-0.0327 ms (and its loop got faster too: the
     * kernel's code shrank from 136 to 94 KB); at d ≤ 128, where the code is half as long per
     * head and 16 warps wait on each rolled step, it cost 3%, so there the loops over heads,
     * tiles and warps stay unrolled (kCold* below). */
    constexpr int kColdHeads = D == 256 ? 1 : 2;                   /* epilogue head loop */
    constexpr int kColdTiles = D == 256 ? 1 : NS - TPI;            /* of the first requests */
    constexpr int kColdWarps = D == 256 ? 4 : (int)C::kWarps;      /* of the warp combine */
    constexpr int NE = D / 32;
    constexpr int HPW = 2;
    const bool qwarp = HPW * warp < (uint32_t)kMaxGroup; /* this warp holds query heads */
    float qr[HPW][NE];
#pragma unroll
    for (int hw = 0; hw < HPW; hw++) {
        const uint32_t h = HPW * warp + hw;
        const float *src = a.q + ((uint64_t)bk.s * a.q_heads + bk.h0 + h) * D + lane * NE;
#pragma unroll
        for (int k = 0; k < NE; k++)
            qr[hw][k] = qwarp && h < bk.gh ? src[k] : 0.0f;
    }
#pragma unroll kColdTiles
    for (int i = 0; i < NS - TPI; i++) {
        issue((uint32_t)i);
        if (i == 0)
            TRACE_FINE14(FMT, 3);
    }
    TRACE_FINE(FMT, 2);
    if (D == 256) { /* v24: rows through shared memory, heads and signs in rolled loops */
        if (qwarp) { /* warp-uniform; each warp's own rows, so no barrier before the rotation */
#pragma unroll
            for (int hw = 0; hw < HPW; hw++) {
#pragma unroll
                for (int k = 0; k < NE; k++)
                    sm.q[HPW * warp + hw][lane * NE + k] = qr[hw][k];
            }
        }
        if (FMT == KV_FMT_TQ3) {
            uint32_t neg = 0; /* bit k: coordinate lane·NE + k is negated (epilogue too) */
#pragma unroll 1
            for (int k = 0; k < NE; k++)
                neg |= (kv_rot_sign(geo.seed, lane * NE + k) < 0.0f ? 1u : 0u) << k;
            TRACE_FINE14(FMT, 2);
            if (warp == 0)
                sm.sgn[lane] = neg;
#pragma unroll 1
            for (int hw = 0; hw < HPW && qwarp; hw++) {
                float *row = &sm.q[HPW * warp + hw][lane * NE];
                float v[NE];
#pragma unroll
                for (int k = 0; k < NE; k++)
                    v[k] = (neg >> k) & 1u ? -row[k] : row[k];
                fwht_warp<D>(v, lane);
#pragma unroll
                for (int k = 0; k < NE; k++)
                    row[k] = v[k];
            }
        }
    } else { /* v15-v23 as they were: rotation in registers, everything unrolled */
        if (FMT == KV_FMT_TQ3) {
            uint32_t neg = 0; /* the signs again for the epilogue, one word per lane */
#pragma unroll
            for (int k = 0; k < NE; k++) {
                const float sg = kv_rot_sign(geo.seed, lane * NE + k);
                neg |= (sg < 0.0f ? 1u : 0u) << k;
#pragma unroll
                for (int hw = 0; hw < HPW; hw++)
                    qr[hw][k] *= sg;
            }
            TRACE_FINE14(FMT, 2);
            if (warp == 0)
                sm.sgn[lane] = neg;
            if (qwarp) { /* warp-uniform */
#pragma unroll
                for (int hw = 0; hw < HPW; hw++)
                    fwht_warp<D>(qr[hw], lane);
            }
        }
        if (qwarp) {
#pragma unroll
            for (int hw = 0; hw < HPW; hw++) {
#pragma unroll
                for (int k = 0; k < NE; k++)
                    sm.q[HPW * warp + hw][lane * NE + k] = qr[hw][k];
            }
        }
    }
    TRACE_FINE(FMT, 3);
    __syncthreads();
    TRACE_FINE(FMT, 4);
    float qf = a.sm_scale * kLog2e;
    if (FMT == KV_FMT_TQ3)
        qf *= 1.0f / (float)D;
    uint32_t qa[KS][2];
    float qv[KS][4];
#pragma unroll
    for (int st = 0; st < KS; st++) {
        const uint32_t c = 4u * ((st / R) * 4 * R + t4 * R + st % R);
        const float4 v = *reinterpret_cast<const float4 *>(&sm.q[g8][c]);
        qv[st][0] = v.x * qf, qv[st][1] = v.y * qf, qv[st][2] = v.z * qf, qv[st][3] = v.w * qf;
        qa[st][0] = pack_half2(qv[st][0], qv[st][1]);
        qa[st][1] = pack_half2(qv[st][2], qv[st][3]);
    }
    /* TQ3 (kTq3Mid at the top): scaled operands, the key step with 2^Z, and 3.5 · Σ of each
     * head's operands; this lane holds head g8's, its S columns are heads 2t, 2t+1 (lanes 8t,
     * 8t + 4) */
    float kc2[2] = {0.0f, 0.0f}, kstep = 0.0f;
    if (FMT == KV_FMT_TQ3) {
        float qs;
        kstep = KV_TQ3_KEY_STEP * pow2i(tq3_query<D>(qv, t4, qa, qs));
        qs += __shfl_xor_sync(0xffffffffu, qs, 1);
        qs += __shfl_xor_sync(0xffffffffu, qs, 2);
        kc2[0] = kTq3Mid * __shfl_sync(0xffffffffu, qs, 8 * t4);
        kc2[1] = kTq3Mid * __shfl_sync(0xffffffffu, qs, 8 * t4 + 4);
    }

    float o[KS][4];
#pragma unroll
    for (int i = 0; i < KS; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    /* per head 2t4 / 2t4+1 (uniform over g8); l and z are this lane's tokens' share */
    float m_run2[2] = {-INFINITY, -INFINITY}, l_part2[2] = {0.0f, 0.0f};
    float z_part2[2] = {0.0f, 0.0f}, c_part2[2] = {0.0f, 0.0f}, F = 0.0f;

    uint32_t head = 0, ihead = NS - TPI; /* the stages consumed and refilled next */
    TRACE(2 + 3 * FMT);
    for (;;) {
        /* refill the TPI stages the previous iteration consumed, then wait for this one's */
#pragma unroll
        for (int u = 0; u < TPI; u++)
            issue(ihead + u);
        cp_wait<NS - TPI>();
        __syncwarp();
        uint32_t nt_[TPI];
#pragma unroll
        for (int u = 0; u < TPI; u++)
            nt_[u] = sm.tn[warp][head + u];
        if (nt_[0] == 0)
            break;
        const uint32_t tk[2] = {g8, g8 + 8};
        const uint32_t tv[4] = {2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9};

        /* ---- per tile u: metadata, K decode and Sᵀ (a tile past the end has n = 0: its
         * stale stage is decoded but every score is masked, so it adds nothing) ---- */
        float kfac_[TPI][2], vsc_[TPI][2], vz_[TPI][2], sv_[TPI][2][2];
#pragma unroll
        for (int u = 0; u < TPI; u++) {
            const uint32_t n = nt_[u];
            const uint8_t *st = ring + (head + u) * STAGE;
            float(&kfac)[2] = kfac_[u];
            float(&vsc)[2] = vsc_[u];
            float(&vz)[2] = vz_[u];
            /* metadata of this lane's S rows: tokens g8 and g8 + 8 */
#pragma unroll
            for (int j = 0; j < 2; j++) {
                kfac[j] = vsc[j] = vz[j] = 0.0f;
                if (tk[j] < n) {
                    if (FMT == KV_FMT_FP8) {
                        kfac[j] = reinterpret_cast<const float *>(st + 16 * D)[tk[j]];
                        vsc[j] = reinterpret_cast<const float *>(st + 32 * D + 64)[tk[j]];
                    } else { /* the operand forms of the TQ3 maps (kTq3Mid) */
                        const float sc =
                            half_bits(reinterpret_cast<const uint16_t *>(st + 12 * D + 32)[tk[j]]);
                        kfac[j] = kstep *
                                  half_bits(reinterpret_cast<const uint16_t *>(st + 6 * D)[tk[j]]);
                        vsc[j] = sc;
                        vz[j] =
                            half_bits(reinterpret_cast<const uint16_t *>(st + 12 * D + 64)[tk[j]]) +
                            3.5f * sc;
                    }
                }
            }

            /* ---- Sᵀ = K Qᵀ (v4: tokens are the 16 MMA rows, heads the 8 columns, so no
             * half-empty A operand; K's fragments for token g8 / g8 + 8 are v3's B fragments of
             * n-tile 0 / 1, and Q's B fragment is v3's A fragment). Tokens ≥ n hold stale or
             * out-of-sequence bytes: masked below. ---- */
            uint32_t kbt[2][KS][2];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                uint32_t(&kb)[KS][2] = kbt[nt];
                if (FMT == KV_FMT_FP8) { /* tokens ≥ n: stale bytes, their scores are masked */
                    fp8_kfrag<D>(st + tk[nt] * D, t4, kb);
                } else { /* K units t4 (+ 4·gi) of the token; d = 64: half t4 & 1 of unit t4/2 */
                    constexpr int NG = D == 64 ? 1 : D / 128; /* units per lane */
#pragma unroll
                    for (int gi = 0; gi < NG; gi++) {
                        const uint32_t grp = D == 64 ? (t4 >> 1) : t4 + 4 * gi;
                        const uint32_t *wp =
                            reinterpret_cast<const uint32_t *>(st) + (tk[nt] * (D / 32) + grp) * 3;
                        tq3_place<D, 2>(wp[0], wp[1], wp[2], t4 & 1u, 8 * gi, 0, kb);
                    }
                }
            }
            /* v11: two accumulators (even / odd k-steps) halve the dependent MMA chain */
            float sA[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sB[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s2 = 0; s2 < KS; s2++)
                mma16816(s2 % 2 ? sB : sA, kbt[0][s2][0], kbt[1][s2][0], kbt[0][s2][1],
                         kbt[1][s2][1], qa[s2][0], qa[s2][1]);

                /* this lane holds tokens g8, g8 + 8 of heads 2t, 2t+1: sv[token][head] */
#pragma unroll
            for (int j = 0; j < 2; j++) {
                sv_[u][j][0] = tk[j] < n ? (sA[2 * j] + sB[2 * j] - kc2[0]) * kfac[j] : -INFINITY;
                sv_[u][j][1] =
                    tk[j] < n ? (sA[2 * j + 1] + sB[2 * j + 1] - kc2[1]) * kfac[j] : -INFINITY;
            }
        }

        /* ---- online softmax over the TPI tiles ---- */
        /* v10: the running maximum moves only when a score exceeds it, which after the first
         * tiles is rare: only then the warp-wide reduction and the rescale of o, l, z, c.
         * Otherwise p = 2^(s − m) uses the standing maximum (p ≤ 1 always). */
        float tm[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int u = 0; u < TPI; u++) {
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
                tm[hh] = fmaxf(tm[hh], fmaxf(sv_[u][0][hh], sv_[u][1][hh]));
        }
        if (__any_sync(0xffffffffu, tm[0] > m_run2[0] || tm[1] > m_run2[1])) {
            float alpha[2];
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                float tmax = tm[hh];
#pragma unroll
                for (int off = 4; off < 32; off <<= 1)
                    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
                const float m_new = fmaxf(m_run2[hh], tmax);
                /* m_new == m_run2 covers −inf = −inf; from −inf to finite, ex2(−inf) = 0 */
                alpha[hh] = m_new == m_run2[hh] ? 1.0f : ex2(m_run2[hh] - m_new);
                m_run2[hh] = m_new;
                l_part2[hh] *= alpha[hh];
                z_part2[hh] *= alpha[hh];
                c_part2[hh] *= alpha[hh];
            }
#pragma unroll
            for (int i = 0; i < KS; i++) {
                o[i][0] *= alpha[0], o[i][1] *= alpha[1], o[i][2] *= alpha[0], o[i][3] *= alpha[1];
            }
        }
        float pr_[TPI][2][2];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            /* all scores of a head still −inf: m = 0 keeps −inf − m from being NaN */
            const float mref = m_run2[hh] == -INFINITY ? 0.0f : m_run2[hh];
#pragma unroll
            for (int u = 0; u < TPI; u++) {
                pr_[u][0][hh] = ex2(sv_[u][0][hh] - mref);
                pr_[u][1][hh] = ex2(sv_[u][1][hh] - mref);
                l_part2[hh] += pr_[u][0][hh] + pr_[u][1][hh];
                if (FMT == KV_FMT_TQ3)
                    z_part2[hh] += pr_[u][0][hh] * vz_[u][0] + pr_[u][1][hh] * vz_[u][1];
            }
        }
        if (F == 0.0f) {
            float mx = fmaxf(vsc_[0][0], vsc_[0][1]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            F = mx > 0.0f && mx <= FLT_MAX ? exp2f(-ceilf(log2f(mx))) : 1.0f;
        }
        /* ---- per tile u: Oᵀ += Vᵀ P'ᵀ ---- */
#pragma unroll
        for (int u = 0; u < TPI; u++) {
            const uint32_t n = nt_[u];
            const uint8_t *st = ring + (head + u) * STAGE;
            const float(&pr)[2][2] = pr_[u];
            const float(&vsc)[2] = vsc_[u];
            /* P'ᵀ in the accumulator layout (row = token, pair = heads 2t, 2t+1), two 8×8
             * blocks; transposed in registers they are exactly the B fragments of PV (k = tokens
             * 2t, 2t+1 and 2t+8, 2t+9, n = head g8) */
            const uint32_t pp0 = pack_half2(pr[0][0] * vsc[0] * F, pr[0][1] * vsc[0] * F);
            const uint32_t pp1 = pack_half2(pr[1][0] * vsc[1] * F, pr[1][1] * vsc[1] * F);
            if (FMT == KV_FMT_TQ3) { /* Σ P' per head from the rounded operands (kTq3Mid) */
                const float2 x0 = __half22float2(*reinterpret_cast<const __half2 *>(&pp0));
                const float2 x1 = __half22float2(*reinterpret_cast<const __half2 *>(&pp1));
                c_part2[0] += x0.x + x1.x;
                c_part2[1] += x0.y + x1.y;
            }
            const uint32_t pb0 = movmatrix_t(pp0);
            const uint32_t pb1 = movmatrix_t(pp1);

            uint32_t va[KS][4];
            if (FMT == KV_FMT_FP8) {
                uint32_t vw[4][NC];
                /* out-of-sequence FP8 bytes may be NaN codes: never use them */
#pragma unroll
                for (int j = 0; j < 4; j++)
                    fp8_vrow<D>(tv[j] < n ? st + 16 * D + 64 + tv[j] * D + g8 * (D / 8) : nullptr,
                                vw[j]);
                fp8_vfrag<D>(vw, va);
            } else {
                /* the lane's coordinates (D/8)·g8 + 2i + r/8 (m-tile i, row r) are pairs of V unit
                 * (D/8)·g8/16 (+1 at d = 256) of token pairs t and t + 4 of the tile: tokens
                 * 2t, 2t+1 and 2t+8, 2t+9, exactly the A fragment's k order */
                constexpr int NU = D == 256 ? 2 : 1;  /* units per lane and token pair */
#pragma unroll
                for (int hp = 0; hp < 2; hp++) {
#pragma unroll
                    for (int nu = 0; nu < NU; nu++) {
                        const uint32_t q = D == 64 ? g8 / 2 : (D / 128) * g8 + nu;
                        const uint32_t *wp = reinterpret_cast<const uint32_t *>(st + 6 * D + 32) +
                                             ((t4 + 4 * hp) * (D / 16) + q) * 3;
                        tq3_place<D, 4>(wp[0], wp[1], wp[2], g8 & 1u, 8 * nu, 2 * hp, va);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < KS; i++)
                mma16816(o[i], va[i][0], va[i][1], va[i][2], va[i][3], pb0, pb1);
        }
        __syncwarp(); /* the stages are refilled by the next iteration's issue */
        head = head + TPI == (uint32_t)NS ? 0u : head + TPI;
        ihead = ihead + TPI == (uint32_t)NS ? 0u : ihead + TPI;
    }
    cp_wait<0>();
    TRACE(3 + 3 * FMT);

    /* ---- merge the warps (as v1, with per-lane head pairs) ---- */
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            l_part2[hh] += __shfl_xor_sync(0xffffffffu, l_part2[hh], off);
            c_part2[hh] += __shfl_xor_sync(0xffffffffu, c_part2[hh], off);
            z_part2[hh] += __shfl_xor_sync(0xffffffffu, z_part2[hh], off);
        }
    }
    __syncthreads(); /* every warp is done with the rings that s_o overlays */
    TRACE(14 + FMT);
    /* [kWarps][kMaxGroup][kORow]: element x of a row at x + x / 32. v7: with rows of exactly
     * D floats, the stores below (lane → head 2t4 / 2t4+1, coordinate 4·(g8·D/32 + i/2) + …)
     * put all 32 lanes of a warp in one bank at d = 256 (16 at d = 128): 64 × 32-way
     * conflicts per warp; the FP8 epilogue at B=2 d=256 took 27k cycles, 14k padded
     * (timeline probe, docs/perf.md v7) */
    float *s_o = reinterpret_cast<float *>(sm.buf);
    if (g8 == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            sm.m[warp][2 * t4 + hh] = m_run2[hh];
            sm.l[warp][2 * t4 + hh] = l_part2[hh];
            sm.z[warp][2 * t4 + hh] = z_part2[hh];
        }
    }
    const float invF = F > 0.0f ? 1.0f / F : 0.0f;
#pragma unroll
    for (int i = 0; i < KS; i++) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const uint32_t x = 4u * (g8 * (D / 32) + i / 2) + 2u * (i % 2) + hr;
            float *base = s_o + ((size_t)warp * kMaxGroup) * C::kORow + x + x / 32;
            if (FMT == KV_FMT_TQ3) { /* row r of m-tile i carries 2^(e − 24) of its pair */
                const float vs = pow2i(24 - (int)tq3_pair_exp(tq3_vpair<D>(i, hr, g8)));
                base[(2 * t4) * C::kORow] = (o[i][2 * hr] * vs - kTq3Mid * c_part2[0]) * invF;
                base[(2 * t4 + 1) * C::kORow] =
                    (o[i][2 * hr + 1] * vs - kTq3Mid * c_part2[1]) * invF;
            } else {
                base[(2 * t4) * C::kORow] = o[i][2 * hr] * invF;
                base[(2 * t4 + 1) * C::kORow] = o[i][2 * hr + 1] * invF;
            }
        }
    }
    __syncthreads();
    TRACE_FINE(FMT, 9);
    const size_t part = ((size_t)bk.s * a.num_splits + bk.split) * KV_FMT_COUNT + (size_t)FMT;
    /* v8: the per-head weights of the kWarps warps, exp2(m_w − M) / L, once per head (they were
     * recomputed, with a division, for every one of the D coordinates); sm.l[w][h] is
     * overwritten by the weight (only thread h touches column h here) */
    if (tid < (uint32_t)kMaxGroup) { /* unrolled: rolled, 16 dependent steps took 6.5k cycles */
        const uint32_t h = tid;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < C::kWarps; w++)
            M = sm.l[w][h] > 0.0f ? fmaxf(M, sm.m[w][h]) : M;
        float f[C::kWarps], L = 0.0f;
#pragma unroll
        for (int w = 0; w < C::kWarps; w++) {
            f[w] = M != -INFINITY && sm.l[w][h] > 0.0f ? exp2f(sm.m[w][h] - M) : 0.0f;
            L += f[w] * sm.l[w][h];
        }
        const float rL = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
        for (int w = 0; w < C::kWarps; w++)
            sm.l[w][h] = f[w] * rL;
        if (h < bk.gh) {
            a.part_m[part * a.q_heads + bk.h0 + h] = L > 0.0f ? M * kLn2 : -INFINITY;
            a.part_l[part * a.q_heads + bk.h0 + h] = L;
        }
    }
    __syncthreads();
    TRACE_FINE(FMT, 13);
    /* v15: warp w combines, un-rotates (TQ3) and stores heads 2w, 2w + 1 in registers, lane ℓ
     * holding coordinates ℓ·D/32 … (the s_o reads are conflict-free with the padded rows).
     * v24 (d = 256): heads in a rolled loop and warps in one unrolled by 4 (cold code, see the
     * prologue), the sums in the same order. */
    const float post = FMT == KV_FMT_TQ3 ? (float)(1.0 / sqrt((double)D)) : 1.0f;
    const uint32_t xo = lane * NE + lane * NE / 32; /* padded offset of the lane's first x */
#pragma unroll kColdHeads
    for (int hw = 0; hw < HPW && qwarp; hw++) { /* the prologue's warp ↔ head map */
        const uint32_t h = HPW * warp + hw;
        float v[NE];
#pragma unroll
        for (int k = 0; k < NE; k++)
            v[k] = 0.0f;
#pragma unroll kColdWarps
        for (int w = 0; w < C::kWarps; w++) {
            const float gw = sm.l[w][h], zw = sm.z[w][h];
            const float *src = s_o + ((size_t)w * kMaxGroup + h) * C::kORow + xo;
            if (gw != 0.0f) {
#pragma unroll
                for (int k = 0; k < NE; k++)
                    v[k] += gw * (src[k] + zw);
            }
        }
        if (hw == 0)
            TRACE_FINE14(FMT, 1);
        if (FMT == KV_FMT_TQ3) {
            fwht_warp<D>(v, lane);
            const uint32_t neg = sm.sgn[lane]; /* written before the prologue's barrier */
#pragma unroll
            for (int k = 0; k < NE; k++)
                v[k] = v[k] * ((neg >> k) & 1u ? -post : post);
        }
        if (h < bk.gh) {
            float *dst = a.part_o + (part * a.q_heads + bk.h0 + h) * D + lane * NE;
#pragma unroll
            for (int k = 0; k < NE; k++)
                dst[k] = v[k];
        }
    }
    TRACE(4 + 3 * FMT);
}

/* the empty partition of kvkern.h: (−inf, 0) and no Ō row, which the merge never reads for
 * l = 0 (kvkern_cuda.h). v31: writing the gh·D zeros took 12 stores and their index math per
 * thread of a d = 256 block without FP8 pages, cold code ahead of its TQ3 phase. */
template <int D, int WARPS>
__device__ __forceinline__ void fast_empty(const AttnArgs &a, const FastBlock &bk, int fmt)
{
    const size_t part = ((size_t)bk.s * a.num_splits + bk.split) * KV_FMT_COUNT + (size_t)fmt;
    if constexpr (D == 256) {
        if (threadIdx.x < bk.gh) {
            a.part_m[part * a.q_heads + bk.h0 + threadIdx.x] = -INFINITY;
            a.part_l[part * a.q_heads + bk.h0 + threadIdx.x] = 0.0f;
        }
    } else { /* v29's loop, zeros included: dropping them re-drew this kernel's hot loops into
              * slower forms (bench/sass_loops.py), and its blocks write few of them */
        for (uint32_t i = threadIdx.x; i < bk.gh * D; i += FastCfg<D, WARPS>::kThreads) {
            const uint32_t h = i / D, x = i % D;
            if (x == 0) {
                a.part_m[part * a.q_heads + bk.h0 + h] = -INFINITY;
                a.part_l[part * a.q_heads + bk.h0 + h] = 0.0f;
            }
            a.part_o[(part * a.q_heads + bk.h0 + h) * D + x] = 0.0f;
        }
    }
}

/* v28: the FP8 tail. In kvd's layout a sequence holds three FP8 pages beside its TQ3 ones
 * (the first page, the last two), so a split of the mix holds one to three of them (three
 * where one split covers the sequence: every batch of 17 or more sequences at 8 KV heads), and
 * v26's block-wide FP8 phase for them cost ~11k cycles per block at B=8 32K (a prologue and an
 * epilogue for 16 warps, 14 of them idle): the whole gap between the mix and all-TQ3. v35:
 * three pages (48 tokens) instead of two. At one split (B=32-128, 4K-8K tokens, 32 query / 8
 * KV heads) the FP8 phase had made the mix 12-18% slower than all-TQ3; with the tail it runs
 * 6-9% faster than v34 (B=32 4K 0.0717 → 0.0670 ms, B=128 8K 0.4008 → 0.3740; H200, session
 * 15), while the two-split shapes' mix lost 1-2.5% (B=8 32K 0.0798 → 0.0806), not to the
 * third item of no tokens: skipping it (below) measured within 0.5%. Forms with fewer items
 * re-drew the FP8 loop slower (docs/perf.md "Session 15"). A split that holds TQ3 pages and
 * at most kTailPages FP8 pages of at most kTailTokens live tokens runs no FP8 phase:
 * - the prescan lists those pages in s_f8 (kF8…) and prefetches them into L2;
 * - after the TQ3 phase's loops, while warps 0-3 still combine the TQ3 heads, warps 4-15
 *   stage the tokens' K and V rows and the group's query rows in the rings past the combine's
 *   buffer with one cp.async round trip; each computes half of one head's FP8 partition
 *   (16 tokens) in plain FP32, and a second pass merges the halves (v29 with quarters of 8
 *   tokens; v28 ran the tail after the combine with all 16 warps: B=8 32K mix 0.0833 → 0.0821
 *   ms in one call; v30's halves: one round of items instead of two, 0.0825 → 0.0821).
 * fast_tail is a separate function (__noinline__, scalar arguments): inlined (session 7,
 * branch v27-fp8-tail) similar code moved ptxas's register and pipe choices in the hot loops
 * and made all-TQ3 2-3% and all-FP8 1-7% slower although neither runs it. ptxas still sees
 * the call, and any edit of this file re-draws the loops' code (docs/perf.md "Session 8":
 * variants of this same tail measured all-TQ3 0.0789-0.0808 ms at B=8 32K), so every change
 * here needs the A/B of docs/perf.md, and the SASS of the loops tells the draws apart.
 * Same partition semantics as fast_phase's: m in natural-log units, l = Σ 2^(s − m), Ō = Σ …/l.
 * Called by every thread of the block: warps below kTailWarp0 return at once, the others
 * synchronise among themselves (named barrier 1; no __syncthreads may follow the call in the
 * kernel). buf: the rings; k0 / v0, k1 / v1, k2 / v2: the K / V block of page 0 / 1 / 2
 * (sequence order) at token 0, scales at + kmoff / + vmoff; n0 ≥ 1, n0 + n1 + n2 ≤
 * kTailTokens (an absent page: n = 0); q: the group's gh query rows (16-byte aligned: the
 * launcher checks); qs: sm_scale · log2 e; out_*: head 0's partition row (heads are
 * consecutive rows).
 * Only at D ≤ 128 (16 warps): at d = 256 the FP8 phase already fits in the slack that
 * decision 47 leaves the end splits (mix and all-TQ3 measure the same there). */
constexpr uint32_t kTailPages = 3;
constexpr uint32_t kTailTokens = 48;
/* fast_phase's combine warps: its HPW = 2 heads per warp (the prologue's qwarp map) */
constexpr uint32_t kTailWarp0 = kMaxGroup / 2;
template <int D> constexpr bool tail_enabled() { return D <= 128; }
/* the words of the fast kernel's s_f8 */
enum : uint32_t {
    kF8Count = 0, /* FP8 pages listed by the prescan (when they are few) */
    kF8Phys = 1,  /* [kTailPages] their physical pages */
    kF8Page = 4,  /* [kTailPages] their logical pages, in the order listed */
    kF8On = 8,    /* the block runs the tail */
};
static_assert(kF8Page + kTailPages <= kF8On, "s_f8's words do not overlap");
template <int D, int NT>
__device__ __noinline__ void fast_tail(uint8_t *buf, const uint8_t *k0, const uint8_t *v0,
                                       const uint8_t *k1, const uint8_t *v1, const uint8_t *k2,
                                       const uint8_t *v2, uint32_t n0, uint32_t n1, uint32_t n2,
                                       uint64_t kmoff, uint64_t vmoff,
                                       const float *q, uint32_t gh, float qs, float *out_m,
                                       float *out_l, float *out_o)
{
    /* NE ≤ 4 (D ≤ 128, tail_enabled): a lane's V coordinates are at most one word */
    constexpr uint32_t NE = D / 32, CH = D / 16; /* 16-byte chunks of a code row */
    /* warps kTailWarp0 … run the tail while warps 0 … kTailWarp0 − 1 may still combine the
     * TQ3 heads (fast_phase's last loop, after its last barrier: every warp's TQ3 loop is
     * over), so the stages sit past the combine's buffer (kSo) and the barriers are named
     * ones of the tail warps only */
    constexpr uint32_t TT = NT - 32 * kTailWarp0, NTW = TT / 32;
    using C = FastCfg<D, (int)NT / 32>;
    constexpr size_t kSo = (size_t)C::kWarps * kMaxGroup * C::kORow * 4;
    static_assert(!tail_enabled<D>() || kSo + 2 * kTailTokens * D + 4 * kMaxGroup * D +
                                             4 * 4 * kMaxGroup * (D + 2) <=
                      C::kSmem,
                  "the tail's stages and partials fit in the rings past the combine's buffer");
    if (threadIdx.x < 32 * kTailWarp0)
        return;
    const uint32_t tid = threadIdx.x - 32 * kTailWarp0, lane = tid & 31u, nt = n0 + n1 + n2;
    const uint32_t n01 = n0 + n1;
    uint8_t *sk = buf + kSo, *sv = sk + kTailTokens * D;
    float *sq = reinterpret_cast<float *>(sk + 2 * kTailTokens * D);
    /* ---- stage: K rows, V rows (token t at t·D), query rows ---- */
    for (uint32_t c = tid; c < nt * CH; c += TT) {
        const uint32_t t = c / CH, x = 16 * (c % CH);
        const size_t r = (size_t)(t < n0 ? t : t < n01 ? t - n0 : t - n01) * D + x;
        cp16(sk + t * D + x, (t < n0 ? k0 : t < n01 ? k1 : k2) + r);
        cp16(sv + t * D + x, (t < n0 ? v0 : t < n01 ? v1 : v2) + r);
    }
    for (uint32_t c = tid; c < gh * (D / 4); c += TT)
        cp16(sq + 4 * c, q + 4 * c);
    cp_commit();
    /* this lane's token scales, in flight with the copies: tokens lane and lane + 32 */
    float lsc_k[2] = {0.0f, 0.0f}, lsc_v[2] = {0.0f, 0.0f};
#pragma unroll
    for (uint32_t u = 0; u < 2; u++) {
        const uint32_t t = lane + 32u * u;
        if (t < nt) {
            const uint32_t row = t < n0 ? t : t < n01 ? t - n0 : t - n01;
            lsc_k[u] = reinterpret_cast<const float *>((t < n0 ? k0 : t < n01 ? k1 : k2) +
                                                       kmoff)[row];
            lsc_v[u] = reinterpret_cast<const float *>((t < n0 ? v0 : t < n01 ? v1 : v2) +
                                                       vmoff)[row];
        }
    }
    cp_wait<0>();
    asm volatile("bar.sync 1, %0;" ::"r"(TT) : "memory");
    /* ---- one item per warp: head h, tokens TI·q … TI·q + TI − 1 (lane LPT·i + j: token
     * TI·q + i, coordinates j·D/LPT …, chunks staggered by j); each writes its partial (Ō
     * unnormalised, m, l) to xs, and warp h merges head h's IPH. One warp per head took 3.8k
     * cycles at B=8 32K (timeline), a quarter per warp 2.8k (v29: LPT = 4, 8 tokens an item,
     * 16 items for 4 heads and 32 tokens: two rounds on 12 warps). v30: LPT = 2, 16 tokens an
     * item, 8 items: one round. ---- */
    constexpr uint32_t LPT = 2, TI = 32 / LPT, IPH = kTailTokens / TI;
    constexpr uint32_t W = NTW, QC = D / LPT / 16; /* 16-byte chunks of a lane's part row */
    float *xs = sq + kMaxGroup * D;          /* [item][D + 2]: Ō, m, l */
    const uint32_t warp = tid >> 5, ti = lane / LPT, tj = lane % LPT; /* warp: of the tail's */
    for (uint32_t it = warp; it < IPH * gh; it += W) {
        const uint32_t h = it / IPH, t = TI * (it % IPH) + ti;
        const uint32_t up = TI * (it % IPH) >= 32u; /* warp-uniform: the item's 16 tokens */
        if (TI * (it % IPH) >= nt) { /* no tokens (one or two pages): the empty partial only */
            float *xr = xs + it * (D + 2);
#pragma unroll
            for (uint32_t k = 0; k < NE && k < 4; k++)
                xr[lane * NE + k] = 0.0f;
            if (lane == 0)
                xr[D] = -INFINITY, xr[D + 1] = 0.0f;
            continue;
        }
        const float *qh = sq + h * D + tj * (D / LPT);
        float s, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (t < nt) {
#pragma unroll
            for (uint32_t j = 0; j < QC; j++) {
                const uint32_t c0 = 16u * ((j + tj) % QC);
                const uint4 kw =
                    *reinterpret_cast<const uint4 *>(sk + t * D + tj * (D / LPT) + c0);
                const uint32_t w4[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float4 qv = *reinterpret_cast<const float4 *>(qh + c0 + 4 * k);
                    const uint32_t lo = fp8x2_to_h2(w4[k] & 0xffffu);
                    const uint32_t hi = fp8x2_to_h2(w4[k] >> 16);
                    const float2 x01 = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
                    const float2 x23 = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
                    acc[k] = fmaf(x01.x, qv.x,
                                  fmaf(x01.y, qv.y, fmaf(x23.x, qv.z, fmaf(x23.y, qv.w, acc[k]))));
                }
            }
        }
        float d = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
        for (uint32_t off = 1; off < LPT; off <<= 1)
            d += __shfl_xor_sync(0xffffffffu, d, off);
        const float kst = __shfl_sync(0xffffffffu, up ? lsc_k[1] : lsc_k[0], t & 31u);
        s = t < nt ? d * qs * kst : -INFINITY;
        float m = s;
#pragma unroll
        for (uint32_t off = LPT; off < 32; off <<= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        /* an empty item (every token ≥ nt): m = −inf, l = 0, Ō = 0 */
        const float p = t < nt ? ex2(s - m) : 0.0f;
        float l = p;
#pragma unroll
        for (uint32_t off = LPT; off < 32; off <<= 1)
            l += __shfl_xor_sync(0xffffffffu, l, off);
        const float w = p * __shfl_sync(0xffffffffu, up ? lsc_v[1] : lsc_v[0], t & 31u);
        float o[NE];
#pragma unroll
        for (uint32_t k = 0; k < NE; k++)
            o[k] = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < TI; i++) {
            const uint32_t tt = TI * (it % IPH) + i;
            const float wt = __shfl_sync(0xffffffffu, w, LPT * i);
            if (tt < nt) {
                const uint8_t *vr = sv + tt * D + lane * NE;
                const uint32_t word = NE == 2 ? *reinterpret_cast<const uint16_t *>(vr)
                                              : *reinterpret_cast<const uint32_t *>(vr);
                const uint32_t lo = fp8x2_to_h2(word & 0xffffu), hi = fp8x2_to_h2(word >> 16);
                const float2 x01 = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
                const float2 x23 = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
                const float x[4] = {x01.x, x01.y, x23.x, x23.y};
#pragma unroll
                for (uint32_t k = 0; k < NE && k < 4; k++)
                    o[k] = fmaf(wt, x[k], o[k]);
            }
        }
        float *xr = xs + it * (D + 2);
#pragma unroll
        for (uint32_t k = 0; k < NE && k < 4; k++)
            xr[lane * NE + k] = o[k];
        if (lane == 0)
            xr[D] = m, xr[D + 1] = l;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(TT) : "memory");
    for (uint32_t h = warp; h < gh; h += W) {
        const float *xr = xs + IPH * h * (D + 2);
        float mq[IPH], lq[IPH], M = -INFINITY;
#pragma unroll
        for (uint32_t j = 0; j < IPH; j++) {
            mq[j] = xr[j * (D + 2) + D], lq[j] = xr[j * (D + 2) + D + 1];
            M = fmaxf(M, mq[j]);
        }
        float L = 0.0f, wq[IPH];
#pragma unroll
        for (uint32_t j = 0; j < IPH; j++) {
            wq[j] = lq[j] > 0.0f ? ex2(mq[j] - M) : 0.0f;
            L += wq[j] * lq[j];
        }
        const float rl = 1.0f / L; /* L ≥ 1: the maximum's own term */
        if (lane == 0) {
            out_m[h] = M * kLn2;
            out_l[h] = L;
        }
#pragma unroll
        for (uint32_t k = 0; k < NE && k < 4; k++) {
            float v = 0.0f;
#pragma unroll
            for (uint32_t j = 0; j < IPH; j++)
                v = fmaf(wq[j], xr[j * (D + 2) + lane * NE + k], v);
            out_o[h * D + lane * NE + k] = v * rl;
        }
    }
}

template <int D, bool P16, int WARPS>
__global__ void __launch_bounds__(FastCfg<D, WARPS>::kThreads, FastCfg<D, WARPS>::kMinBlocks)
    attn_fast_kernel(AttnArgs a)
{
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ __align__(16) float s_q[kMaxGroup][FastQRow<D>::kLen];
    constexpr int W = FastCfg<D, WARPS>::kWarps, NT = FastCfg<D, WARPS>::kThreads;
    __shared__ float s_m[W][kMaxGroup], s_l[W][kMaxGroup], s_z[W][kMaxGroup];
    __shared__ uint32_t s_tn[W][8];
    __shared__ uint32_t s_sgn[32];
    __shared__ uint32_t s_f8[32]; /* the FP8 tail's list (kF8…): 32 words, see below */
    /* The dynamic part (the rings) starts right after these, at 16-byte alignment only (an
     * __align__ on smem is not honoured; checked on the H200), so they must add up to whole
     * 128-byte lines: with 16 bytes more of them (a 2-word array, session 6) every ring sat 16
     * bytes off its old place and the FP8 loop ran 12-15% slower, the TQ3 loop 2-5%, with the
     * same instructions. Moves by multiples of 32 bytes inside the rings (TQ3 stages padded to
     * 128 bytes, the FP8 stage's V codes moved to a line) changed nothing, so what matters is
     * probably a 16-byte copy destination against a 32-byte source sector (docs/perf.md).
     * Grouping the arrays in one padded struct instead moved the register allocation and cost
     * B=8 32K mix 2%. Any array added here must be counted here. */
    static_assert((sizeof(s_q) + sizeof(s_m) + sizeof(s_l) + sizeof(s_z) + sizeof(s_tn) +
                   sizeof(s_sgn) + sizeof(s_f8)) % 128 == 0,
                  "the rings after the static shared arrays stay on 128-byte lines");

    TRACE_GT(10);
    TRACE(0);
    FastBlock bk;
    bk.kvh = blockIdx.x / a.head_groups;
    const uint32_t hg = blockIdx.x % a.head_groups;
    bk.split = blockIdx.y;
    bk.s = blockIdx.z;
    bk.h0 = bk.kvh * a.group + hg * kMaxGroup;
    bk.gh = min(kMaxGroup, a.group - hg * kMaxGroup);
    bk.pt = a.g.page_tokens;
    bk.ip0 = a.indptr[bk.s];
    const uint32_t np = a.indptr[bk.s + 1] - bk.ip0;
    const uint64_t cap = (uint64_t)np * bk.pt;
    bk.len = (uint32_t)min((uint64_t)a.seq_len[bk.s], cap);
    const uint32_t live_pages = (uint32_t)(((uint64_t)bk.len + bk.pt - 1) / bk.pt);
    uint64_t r0, r1; /* the twin's split (kvkern.h), pages past the sequence end dropped */
    kv_attn_split_range(np, a.num_splits, bk.split, &r0, &r1);
    bk.p0 = (uint32_t)min(r0, (uint64_t)live_pages);
    bk.p1 = (uint32_t)min(r1, (uint64_t)live_pages);

    /* which formats does this split hold at all? (v7: 4 ids, then 4 entries per thread in
     * flight, instead of one dependent id → entry pair per iteration) */
    bool has8 = false, hast = false; /* has8: without the tail (d = 256), v26's flag */
    uint32_t c8 = 0, p8 = 0, phys8 = 0; /* this thread's FP8 pages: count, the first one */
    if (threadIdx.x == 0) /* before the first barrier; the atomics and reads come after it */
        s_f8[kF8Count] = s_f8[kF8On] = 0;
    for (uint32_t pb = bk.p0 + threadIdx.x; pb < bk.p1; pb += 4 * NT) {
        uint32_t id[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t p = pb + (uint32_t)k * NT;
            id[k] = p < bk.p1 ? a.page_ids[bk.ip0 + p] : 0xffffffffu;
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (id[k] < a.dir_len) {
                const kv_dir_entry_t e = a.dir[id[k]];
                const int f = (int)kv_dir_fmt(e);
                if ((kv_dir_flags(e) & KV_DIR_VALID) && f < KV_FMT_COUNT &&
                    kv_dir_phys(e) < a.pools.pages[f]) {
                    if (f == KV_FMT_FP8) {
                        if (!tail_enabled<D>())
                            has8 = true;
                        else if (c8++ == 0)
                            p8 = pb + (uint32_t)k * NT, phys8 = kv_dir_phys(e);
                    } else {
                        hast = true;
                    }
                }
            }
        }
    }
    TRACE(1);
    /* threads that saw an FP8 page (a vote where there is no tail: d = 256 keeps v26's code) */
    const uint32_t n8 = tail_enabled<D>() ? (uint32_t)__syncthreads_count(c8 != 0)
                                          : (uint32_t)__syncthreads_or(has8);
    const bool h8 = n8 != 0;
    const bool ht = __syncthreads_or(hast) != 0;
    /* the FP8 tail (fast_tail): TQ3 pages and at most kTailPages FP8 pages, one per thread (a
     * thread sees a second one only in a split of more than NT pages: then no tail), of at
     * most kTailTokens tokens. It needs ht: the TQ3 phase's barriers publish s_f8[kF8On]. */
    bool tail = false;
    if (tail_enabled<D>() && ht && n8 - 1u < kTailPages && __syncthreads_or(c8 > 1) == 0) {
        if (c8 != 0) {
            const uint32_t i = atomicAdd(&s_f8[kF8Count], 1u);
            s_f8[kF8Phys + i] = phys8;
            s_f8[kF8Page + i] = p8;
            /* the tail reads this page's K and V blocks after the TQ3 phase: into L2 now */
            const kv_geom_t &geo = a.g;
            const uint8_t *pg =
                a.pools.base[KV_FMT_FP8] + (uint64_t)phys8 * kv_page_bytes(&geo, KV_FMT_FP8);
            prefetch_l2(pg + kv_block_offset(&geo, KV_FMT_FP8, a.layer, KV_KIND_K, bk.kvh),
                        (uint32_t)kv_block_bytes(&geo, KV_FMT_FP8, KV_KIND_K));
            prefetch_l2(pg + kv_block_offset(&geo, KV_FMT_FP8, a.layer, KV_KIND_V, bk.kvh),
                        (uint32_t)kv_block_bytes(&geo, KV_FMT_FP8, KV_KIND_V));
        }
        __syncthreads();
        uint32_t ntok = 0;
        for (uint32_t i = 0; i < n8; i++)
            ntok += fast_page_tokens(bk, s_f8[kF8Page + i]);
        tail = ntok <= kTailTokens;
    }
    if (tail && threadIdx.x == 0) /* only then: ht, so the TQ3 phase's barriers publish it */
        s_f8[kF8On] = 1;

    FastSmem<D> sm = {s_q, s_m, s_l, s_z, s_tn, s_sgn, smem};
    if (h8 && !tail)
        fast_phase<D, KV_FMT_FP8, P16, WARPS>(a, bk, sm);
    else if (!tail)
        fast_empty<D, WARPS>(a, bk, KV_FMT_FP8);
    if (ht)
        fast_phase<D, KV_FMT_TQ3, P16, WARPS>(a, bk, sm);
    else
        fast_empty<D, WARPS>(a, bk, KV_FMT_TQ3);
    /* s_f8 again, not `tail`: a register live across the phases' loops moves ptxas's
     * allocation of them. Block-uniform. */
    if (tail_enabled<D>() && s_f8[kF8On]) {
        const uint32_t n8 = s_f8[kF8Count];
        /* pages in sequence order, so that a token's lane does not depend on the atomics; an
         * absent page sorts last (logical ~0) and keeps page 0's physical page (n = 0) */
        uint32_t lp[kTailPages], ph[kTailPages];
#pragma unroll
        for (uint32_t i = 0; i < kTailPages; i++) {
            lp[i] = i < n8 ? s_f8[kF8Page + i] : ~0u;
            ph[i] = s_f8[kF8Phys + (i < n8 ? i : 0u)];
        }
        static_assert(kTailPages == 3, "the sorting network below sorts three");
#pragma unroll
        for (uint32_t k = 0; k < 3; k++) {
            const uint32_t i = k == 1 ? 1u : 0u; /* compare-exchange (0,1), (1,2), (0,1) */
            if (lp[i + 1] < lp[i]) {
                const uint32_t tl = lp[i], tp = ph[i];
                lp[i] = lp[i + 1], ph[i] = ph[i + 1];
                lp[i + 1] = tl, ph[i + 1] = tp;
            }
        }
        const kv_geom_t &geo = a.g;
        const uint64_t pb8 = kv_page_bytes(&geo, KV_FMT_FP8);
        const uint64_t koff = kv_block_offset(&geo, KV_FMT_FP8, a.layer, KV_KIND_K, bk.kvh);
        const uint64_t voff = kv_block_offset(&geo, KV_FMT_FP8, a.layer, KV_KIND_V, bk.kvh);
        const uint8_t *pg0 = a.pools.base[KV_FMT_FP8] + (uint64_t)ph[0] * pb8;
        const uint8_t *pg1 = a.pools.base[KV_FMT_FP8] + (uint64_t)ph[1] * pb8;
        const uint8_t *pg2 = a.pools.base[KV_FMT_FP8] + (uint64_t)ph[2] * pb8;
        const uint32_t n0 = fast_page_tokens(bk, lp[0]);
        const uint32_t n1 = n8 >= 2 ? fast_page_tokens(bk, lp[1]) : 0u;
        const uint32_t n2 = n8 >= 3 ? fast_page_tokens(bk, lp[2]) : 0u;
        const size_t part = ((size_t)bk.s * a.num_splits + bk.split) * KV_FMT_COUNT + KV_FMT_FP8;
        const size_t row = part * a.q_heads + bk.h0;
        fast_tail<D, NT>(smem, pg0 + koff, pg0 + voff, pg1 + koff, pg1 + voff, pg2 + koff,
                         pg2 + voff, n0, n1, n2,
                         kv_block_meta_offset(&geo, KV_FMT_FP8, KV_KIND_K),
                         kv_block_meta_offset(&geo, KV_FMT_FP8, KV_KIND_V),
                         a.q + ((uint64_t)bk.s * a.q_heads + bk.h0) * D, bk.gh,
                         a.sm_scale * kLog2e, a.part_m + row, a.part_l + row, a.part_o + row * D);
    }
    TRACE(8);
#ifdef KVK_ATTN_TRACE
    {
        uint32_t smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        trace_put(12, smid);
    }
#endif
    TRACE_GT(11);
}

/* Weight of partition (m, l) in the merge with maximum M (natural-log units). */
__device__ __forceinline__ float merge_weight(float m, float l, float M)
{
    return l > 0.0f && M != -INFINITY ? expf(m - M) * l : 0.0f;
}

/* One block per (query head, sequence, slice of the head's coordinates: launch_merge), W warps
 * (merge_warps); partition j is summed by warp j % W, each lane owning NE consecutive
 * coordinates of the slice (8- or 16-byte vector loads).
 * v21: no block barrier before the sums. Each warp issues the Ō rows of its first
 * kMergeBatch partitions first — speculatively: a row whose partition turns out empty may be
 * garbage, so it enters through a select, never a multiply — then takes the maximum M over
 * all partitions' (m, l) itself (lane-strided loads and shuffles; every warp computes the same
 * M) and its partitions' weights w = exp(m − M)·l. One barrier joins the warps' sums, added in
 * warp order, so the output stays deterministic. v20 (a pass-1 barrier, weights in shared
 * memory, then the row loads) took 5.0 µs at B=8 32K and 5.8 µs at B=2 d=256 (ncu), two
 * dependent global round trips plus barriers; v7 waited per 16-partition round. */
constexpr int kMergeBatch = 8;
/* v25: warps per merge block, so that every row is in a warp's first batch (W·kMergeBatch ≥
 * parts, up to 256 partitions): with 8 warps, B=2 d=256 (66 partitions) needed a second round
 * trip for two warps, and the block waited for them (merge alone 4.55 → 4.21 µs on the H200) */
constexpr int merge_warps(uint32_t parts)
{
    return parts <= 8u * kMergeBatch ? 8 : parts <= 16u * kMergeBatch ? 16 : 32;
}

/* the lane's NE coordinates of one partition row */
template <int NE>
__device__ __forceinline__ void merge_load(const float *__restrict__ row, float (&v)[NE])
{
    uint32_t w[NE];
    ld_words<NE>(row, w);
#pragma unroll
    for (int c = 0; c < NE; c++)
        v[c] = __uint_as_float(w[c]);
}

template <int NE, int W>
__global__ void __launch_bounds__(32 * W)
    attn_merge_kernel(uint32_t parts, uint32_t q_heads, uint32_t dfull,
                      const float *__restrict__ pm, const float *__restrict__ pl,
                      const float *__restrict__ po, float *__restrict__ out)
{
    /* v26: block z merges coordinates [z·D, z·D + D) of rows dfull long (dfull / D blocks per
     * head; launch_merge) */
    constexpr uint32_t D = 32u * NE;
    constexpr int kMergeWarps = W, kMergeThreads = 32 * W;
    __shared__ __align__(16) float s_acc[kMergeWarps][D];
    __shared__ float s_L[kMergeWarps];
    const uint32_t h = blockIdx.x, s = blockIdx.y, x0 = blockIdx.z * D, tid = threadIdx.x;
    const uint32_t warp = tid >> 5, lane = tid & 31u;
    const size_t ml0 = (size_t)s * parts * q_heads + h; /* (m, l) of partition j at ml0 + j·H */
    const float *base = po + ((size_t)s * parts * q_heads + h) * dfull + x0 + lane * NE;
    const size_t rows = (size_t)q_heads * dfull; /* floats between partition rows */
    float v[kMergeBatch][NE];
    auto load_batch = [&](uint32_t j0) {
#pragma unroll
        for (int u = 0; u < kMergeBatch; u++) {
            const uint32_t j = j0 + (uint32_t)u * kMergeWarps;
            if (j < parts)
                merge_load<NE>(base + (size_t)j * rows, v[u]);
        }
    };
    load_batch(warp); /* in flight while M is found */
    float M = -INFINITY;
    for (uint32_t j = lane; j < parts; j += 32) { /* m and l loaded together: one round trip */
        const float l = pl[ml0 + (size_t)j * q_heads], m = pm[ml0 + (size_t)j * q_heads];
        M = l > 0.0f ? fmaxf(M, m) : M;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float acc[NE], L = 0.0f;
#pragma unroll
    for (int k = 0; k < NE; k++)
        acc[k] = 0.0f;
    for (uint32_t j0 = warp; j0 < parts && M != -INFINITY; j0 += kMergeWarps * kMergeBatch) {
        if (j0 != warp)
            load_batch(j0);
#pragma unroll
        for (int u = 0; u < kMergeBatch; u++) { /* the sums, in partition order */
            const uint32_t j = j0 + (uint32_t)u * kMergeWarps;
            if (j < parts) {
                const size_t i = ml0 + (size_t)j * q_heads;
                const float l = pl[i], w = merge_weight(pm[i], l, M);
                if (l > 0.0f) { /* warp-uniform; an empty partition's row is never used */
                    L += w;
#pragma unroll
                    for (int k = 0; k < NE; k++)
                        acc[k] = fmaf(w, v[u][k], acc[k]);
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NE; k++)
        s_acc[warp][lane * NE + k] = acc[k];
    if (lane == 0)
        s_L[warp] = L;
    __syncthreads();
    for (uint32_t x = tid; x < D; x += kMergeThreads) {
        float a = 0.0f, LL = 0.0f;
#pragma unroll
        for (int w = 0; w < kMergeWarps; w++) {
            a += s_acc[w][x];
            LL += s_L[w];
        }
        out[((size_t)s * q_heads + h) * dfull + x0 + x] = LL > 0.0f ? a / LL : 0.0f;
    }
}

template <int D, int FMT> size_t partial_smem()
{
    return (size_t)kWarps * kMaxGroup * D * sizeof(float); /* the warp merge */
}

template <int D, int FMT> cudaError_t set_attr()
{
    return cudaFuncSetAttribute(attn_partial_kernel<D, FMT>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)partial_smem<D, FMT>());
}

template <int D, int WARPS> cudaError_t set_fast_attr()
{
    cudaError_t e = cudaSuccess;
    for (auto k : {attn_fast_kernel<D, false, WARPS>, attn_fast_kernel<D, true, WARPS>})
        if (e == cudaSuccess) /* v14's plan, v32's */
            e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)FastCfg<D, WARPS>::kSmem);
    return e;
}

/* v32: may the TQ3 phase copy a tile as the page's K and V blocks (fast_phase's run16)? At 16
 * tokens per page, with each block's metadata right after its codes, a page's offset in the
 * pool computable from 32-bit factors, and pools of at most 2^27 pages (page numbers below
 * 2^27: one shuffled word carries a page's number and its token count). kv_format.h's layout
 * meets the first two at every valid geometry today; they are checked so that a layout change
 * falls back instead of reading wrong bytes. Where not, attn_fast_kernel<D, false> runs v14's
 * copy plan, with the same results (test_kernels "both copy plans agree"). */
bool fast_run16(const kv_geom_t &g, const kv_pools_t &pools)
{
    const uint64_t code = 6ull * g.head_dim; /* 16 tokens of 12·D/32 code bytes */
    return g.page_tokens == 16 && kv_block_meta_offset(&g, KV_FMT_TQ3, KV_KIND_K) == code &&
           kv_block_meta_offset(&g, KV_FMT_TQ3, KV_KIND_V) == code &&
           kv_page_bytes(&g, KV_FMT_TQ3) <= 0xffffffffull &&
           pools.pages[KV_FMT_TQ3] <= (1u << 27);
}

cudaError_t init_once()
{
    static const cudaError_t err = [] {
        cudaError_t e = cudaSuccess;
        const cudaError_t r[] = {set_attr<64, KV_FMT_FP8>(),  set_attr<64, KV_FMT_TQ3>(),
                                 set_attr<128, KV_FMT_FP8>(), set_attr<128, KV_FMT_TQ3>(),
                                 set_attr<256, KV_FMT_FP8>(), set_attr<256, KV_FMT_TQ3>(),
                                 set_fast_attr<64, kWarpsOne>(),
                                 set_fast_attr<128, kWarpsOne>(),
                                 set_fast_attr<64, kWarpsTwo>(),
                                 set_fast_attr<128, kWarpsTwo>(),
                                 set_fast_attr<256, KVK_FAST_WARPS256>()};
        for (cudaError_t x : r)
            e = e == cudaSuccess ? x : e;
        return e;
    }();
    return err;
}

/* Launches go through cudaLaunchKernelEx, whose return value is that launch's own error: with
 * <<<>>> and cudaGetLastError an error the caller had left pending (a failed cudaMalloc) failed
 * a launch that ran, and was cleared (kvkern_cuda.h "Errors"). A failed launch's error is
 * consumed here, as the other launchers do. */
template <typename... P, typename... A>
cudaError_t launch_ex(void (*kernel)(P...), dim3 grid, uint32_t threads, size_t smem,
                      cudaStream_t st, A &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
    if (e != cudaSuccess)
        (void)cudaGetLastError();
    return e;
}

template <int D, int WARPS> cudaError_t launch_fast(const AttnArgs &a, dim3 grid, cudaStream_t st)
{
    return launch_ex(fast_run16(a.g, a.pools) ? attn_fast_kernel<D, true, WARPS>
                                              : attn_fast_kernel<D, false, WARPS>,
                     grid, FastCfg<D, WARPS>::kThreads, FastCfg<D, WARPS>::kSmem, st, a);
}

/* v36: the d ≤ 128 grid's blocks per SM. One block of 16 warps (v22) where the grid fits the
 * SMs at one block each (kvk_cuda_attn_suggest_splits' splits at B=8); two of 8 where it does
 * not (one split, B × KV heads over the SM count: serving batches), so that the grid runs in
 * half the waves and one block's prologue and epilogue overlap the other's loop. H200, session
 * 15: B=32 4K all-TQ3 0.0609 → 0.0487 ms, mix 0.0672 → 0.0541, B=128 4K 0.2333 → 0.1803;
 * at B=8 (128 blocks) two of 8 were 2-4% slower. */
/* The current device's SM count, queried once per device (up to kSmCache devices; beyond,
 * every call): launch_partial runs on every decode call. 0 when the runtime cannot say. */
constexpr int kSmCache = 64;
int current_sm_count()
{
    static std::atomic<int> cache[kSmCache];
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (dev >= 0 && dev < kSmCache && (sms = cache[dev].load(std::memory_order_relaxed)) > 0)
        return sms;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (dev >= 0 && dev < kSmCache)
        cache[dev].store(sms, std::memory_order_relaxed);
    return sms;
}

bool two_per_sm(dim3 grid)
{
    const int sms = current_sm_count();
    return sms > 0 && (uint64_t)grid.x * grid.y * grid.z > (uint64_t)sms;
}

template <int D> cudaError_t launch_partial(const AttnArgs &a, dim3 grid, cudaStream_t st)
{
    if (a.g.page_tokens % 16 == 0) {
        if constexpr (D == 256)
            return launch_fast<D, KVK_FAST_WARPS256>(a, grid, st);
        else
            return two_per_sm(grid) ? launch_fast<D, kWarpsTwo>(a, grid, st)
                                    : launch_fast<D, kWarpsOne>(a, grid, st);
    }
    cudaError_t e = launch_ex(attn_partial_kernel<D, KV_FMT_FP8>, grid, kThreads,
                              partial_smem<D, KV_FMT_FP8>(), st, a);
    if (e != cudaSuccess)
        return e;
    return launch_ex(attn_partial_kernel<D, KV_FMT_TQ3>, grid, kThreads,
                     partial_smem<D, KV_FMT_TQ3>(), st, a);
}

/* NE coordinates per lane; a head's d coordinates over d / (32·NE) blocks (grid.z).
 * v26: NE = 4 at d = 256 too, each head over two blocks (96 instead of 48 at B=2, half the
 * bytes each): merge alone 3.9 → 3.55 µs at B=2 d=256 32K on the H200. NE = 2 (four and two
 * blocks per head) was slower at both d: 4.1 and, at B=8 d=128, 2.9 vs 2.55 µs. */
template <int NE>
cudaError_t launch_merge(int w, dim3 grid, cudaStream_t st, uint32_t parts, uint32_t q_heads,
                         uint32_t d, const float *pm, const float *pl, const float *po,
                         float *out)
{
    grid.z = d / (32u * NE);
    if (w == 8)
        return launch_ex(attn_merge_kernel<NE, 8>, grid, 256, 0, st, parts, q_heads, d, pm, pl,
                         po, out);
    if (w == 16)
        return launch_ex(attn_merge_kernel<NE, 16>, grid, 512, 0, st, parts, q_heads, d, pm, pl,
                         po, out);
    return launch_ex(attn_merge_kernel<NE, 32>, grid, 1024, 0, st, parts, q_heads, d, pm, pl, po,
                     out);
}

size_t align256(size_t x)
{
    return (x + 255) / 256 * 256;
}

} // namespace

extern "C" kvk_status_t kvk_cuda_init(void)
{
    return init_once() == cudaSuccess ? KVK_OK : KVK_EDEVICE;
}

extern "C" kvk_status_t kvk_cuda_attn_partial(const kv_geom_t *g, const kv_pools_t *pools,
                                              const kv_dir_entry_t *dir, uint32_t dir_len,
                                              const kv_attn_batch_t *b, const float *q,
                                              uint32_t num_splits, float *part_m, float *part_l,
                                              float *part_o, cudaStream_t stream)
{
    if (!kv_geom_valid(g) || !pools || !b || num_splits == 0 || !part_m || !part_l || !part_o)
        return KVK_EINVAL;
    if (b->q_heads == 0 || b->q_heads % g->kv_heads != 0 || b->layer >= g->layers ||
        !isfinite(b->sm_scale))
        return KVK_EINVAL;
    if (b->batch == 0)
        return KVK_OK;
    /* q 16-byte aligned: the fast kernel's FP8 tail stages query rows with cp.async; every
     * other array to its element (a misaligned load is a sticky error of the caller's context) */
    if (!q || !b->page_indptr || !b->page_ids || !b->seq_len || !dir || (uintptr_t)q % 16u)
        return KVK_EINVAL;
    if ((uintptr_t)dir % 8u || (uintptr_t)b->page_indptr % 4u || (uintptr_t)b->page_ids % 4u ||
        (uintptr_t)b->seq_len % 4u || (uintptr_t)part_m % 4u || (uintptr_t)part_l % 4u ||
        (uintptr_t)part_o % 4u)
        return KVK_EINVAL;
    for (int f = 0; f < KV_FMT_COUNT; f++)
        if ((uintptr_t)pools->base[f] % KV_BLOCK_ALIGN != 0)
            return KVK_EINVAL;
    const uint32_t group = b->q_heads / g->kv_heads;
    const uint32_t hgs = (group + kMaxGroup - 1) / kMaxGroup;
    if ((uint64_t)g->kv_heads * hgs > 0x7fffffffull || num_splits > 65535u ||
        (uint64_t)b->batch * KV_FMT_COUNT > 65535u)
        return KVK_EINVAL;
    if (init_once() != cudaSuccess)
        return KVK_EDEVICE;

    AttnArgs a;
    a.g = *g;
    a.pools = *pools;
    a.dir = dir;
    a.dir_len = dir_len;
    a.layer = b->layer;
    a.batch = b->batch;
    a.q_heads = b->q_heads;
    a.group = group;
    a.head_groups = hgs;
    a.num_splits = num_splits;
    a.sm_scale = b->sm_scale;
    a.indptr = b->page_indptr;
    a.page_ids = b->page_ids;
    a.seq_len = b->seq_len;
    a.q = q;
    a.part_m = part_m;
    a.part_l = part_l;
    a.part_o = part_o;

    /* one launch per format, so that each kernel is branch-free on the format */
    const dim3 grid(g->kv_heads * hgs, num_splits, b->batch);
    cudaError_t err;
    switch (g->head_dim) {
    case 64:
        err = launch_partial<64>(a, grid, stream);
        break;
    case 128:
        err = launch_partial<128>(a, grid, stream);
        break;
    default:
        err = launch_partial<256>(a, grid, stream);
        break;
    }
    return err == cudaSuccess ? KVK_OK : KVK_EDEVICE;
}

extern "C" kvk_status_t kvk_cuda_attn_merge(uint32_t batch, uint32_t parts_per_seq,
                                            uint32_t q_heads, uint32_t d, const float *part_m,
                                            const float *part_l, const float *part_o, float *out,
                                            cudaStream_t stream)
{
    if (parts_per_seq == 0 || q_heads == 0 || (d != 64 && d != 128 && d != 256))
        return KVK_EINVAL;
    if (batch == 0)
        return KVK_OK;
    /* Ō rows are read as 8/16-byte vectors: part_o aligned as the workspace pieces are */
    if (!part_m || !part_l || !part_o || !out || batch > 65535u || (uintptr_t)part_o % 16u ||
        (uintptr_t)part_m % 4u || (uintptr_t)part_l % 4u || (uintptr_t)out % 4u)
        return KVK_EINVAL;
    const dim3 grid(q_heads, batch);
    const int w = merge_warps(parts_per_seq);
    cudaError_t e;
    if (d == 64)
        e = launch_merge<2>(w, grid, stream, parts_per_seq, q_heads, d, part_m, part_l, part_o,
                            out);
    else /* 128: one block per head; 256: two (launch_merge) */
        e = launch_merge<4>(w, grid, stream, parts_per_seq, q_heads, d, part_m, part_l, part_o,
                            out);
    return e == cudaSuccess ? KVK_OK : KVK_EDEVICE;
}

extern "C" size_t kvk_cuda_attn_workspace_bytes(uint32_t batch, uint32_t q_heads,
                                                uint32_t head_dim, uint32_t num_splits)
{
    const uint64_t rows = (uint64_t)batch * num_splits * KV_FMT_COUNT * q_heads;
    if (rows > (1ull << 40) / (head_dim + 2))
        return 0;
    return align256(rows * sizeof(float)) * 2 + align256(rows * head_dim * sizeof(float));
}

extern "C" uint32_t kvk_cuda_attn_suggest_splits(uint32_t batch, uint32_t kv_heads,
                                                 uint32_t q_heads, uint32_t head_dim,
                                                 uint32_t max_pages, uint32_t sm_count)
{
    const uint64_t group = kv_heads ? (q_heads / kv_heads) : 1;
    const uint64_t blocks = (uint64_t)batch * kv_heads * ((group + kMaxGroup - 1) / kMaxGroup);
    if (blocks == 0 || max_pages == 0)
        return 1;
    /* One wave: the fast kernel's launch bounds guarantee kMinBlocks resident blocks per SM
     * (v22: one block of 16 warps at head_dim ≤ 128, two of 4 at 256), so that many blocks all
     * run at once and each does the same work (a second, partial wave would idle most of the
     * device at its end). At least 16 pages a split. Where one split still leaves more blocks
     * than SMs (serving batches), launch_partial runs two blocks of 8 warps per SM (v36). */
    const uint64_t per_sm = head_dim > 128 ? FastCfg<256>::kMinBlocks : FastCfg<128>::kMinBlocks;
    uint64_t want = (uint64_t)sm_count * per_sm / blocks;
    const uint64_t by_pages = max_pages / 16;
    want = want < by_pages ? want : by_pages;
    want = want < 1 ? 1 : want;
    return (uint32_t)(want > 65535 ? 65535 : want);
}

extern "C" kvk_status_t kvk_cuda_attn_decode(const kv_geom_t *g, const kv_pools_t *pools,
                                             const kv_dir_entry_t *dir, uint32_t dir_len,
                                             const kv_attn_batch_t *b, const float *q,
                                             uint32_t num_splits, void *workspace,
                                             size_t ws_bytes, float *out, cudaStream_t stream)
{
    if (!kv_geom_valid(g) || !b || !out || num_splits == 0)
        return KVK_EINVAL;
    const size_t need = kvk_cuda_attn_workspace_bytes(b->batch, b->q_heads, g->head_dim,
                                                      num_splits);
    if (need == 0 || ws_bytes < need || !workspace || (uintptr_t)workspace % 256 != 0)
        return KVK_EINVAL;
    const uint64_t rows = (uint64_t)b->batch * num_splits * KV_FMT_COUNT * b->q_heads;
    uint8_t *w = static_cast<uint8_t *>(workspace);
    float *pm = reinterpret_cast<float *>(w);
    float *pl = reinterpret_cast<float *>(w + align256(rows * sizeof(float)));
    float *po = reinterpret_cast<float *>(w + 2 * align256(rows * sizeof(float)));
    kvk_status_t rc = kvk_cuda_attn_partial(g, pools, dir, dir_len, b, q, num_splits, pm, pl, po,
                                            stream);
    if (rc != KVK_OK)
        return rc;
    return kvk_cuda_attn_merge(b->batch, num_splits * KV_FMT_COUNT, b->q_heads, g->head_dim, pm,
                               pl, po, out, stream);
}

#ifdef KVK_ATTN_TRACE
/* copy the probe records of the last launch (g_trace), or clear them; trace builds only */
extern "C" int kvk_cuda_attn_trace(unsigned long long *host, size_t blocks, int clear)
{
    static unsigned long long zero[kTraceBlocks][16];
    if (clear)
        return cudaMemcpyToSymbol(g_trace, zero, sizeof zero) == cudaSuccess ? 0 : -1;
    const size_t n = (blocks < (size_t)kTraceBlocks ? blocks : (size_t)kTraceBlocks) * 16 * 8;
    return cudaMemcpyFromSymbol(host, g_trace, n) == cudaSuccess ? 0 : -1;
}
#endif
