/* convert.cu — batched whole-page format changes: retier FP8 → TQ3 and promote TQ3 → FP8
 * (twins of kv_page_retier / kv_page_promote in page.c, row codecs of fp8.c and tq3.c).
 *
 *   FP8 row ──decode──► x[d] ──R (FWHT)──► y ──► TQ3 codes + FP16 γ | scale, zero   (retier)
 *   TQ3 row ──decode──► ŷ ──Rᵀ (FWHT)──► x̂ ──► FP8 codes + f32 scale                (promote)
 *
 * Retier (v4, docs/perf.md "retier v4"). The encoder (tq3.c "ENCODING") works on the FP8 codes
 * r of a row, not on r·scale: w = H·(sign ⊙ r) unnormalised, codes floor(sat(·)·FLOOR8), sums
 * in the "quad" order below; the scale only enters the stored metadata. Work split: a warp
 * holds 8 tokens of one (page, layer, kind, head) block, a token the 4 lanes of a quad, lane q
 * the coordinates (j mod L) + L·q + 4L·(j div L), j < d/4 (L = 16 at d = 64, else 32) — one
 * or two runs of consecutive bytes, and at d ≥ 128 whole K units (TQ3 layout 2, kv_format.h).
 * The first four Hadamard stages (coordinate bits 0, 1, log2 L, log2 L + 1) are mma.m16n8k16
 * with B = H_16: FP8 codes are exact FP16 operands and a sum of 16 of them is exact in FP32,
 * so the tensor cores give the twin's bits (the comment above Rt maps the fragments); the other
 * stages are float butterflies in the twin's order. Row sums are per lane pairwise, then the
 * quad's lanes by xor-shuffles 1, 2 — the twin's quad sums. A V unit holds 16 coordinates of a
 * token PAIR: the partner token is lane ^ 4; the two lanes exchange half units with shuffles
 * and each writes every other one (chunks hold 8 tokens starting at a multiple of 8, so the
 * partner is in the warp; with an odd page_tokens the last token's partner is past the end and
 * contributes zero codes). Grid: x = chunks (4 warps per block), y = layer, z = a slice of the
 * pairs; each warp runs its pairs' K and V rows alternately (the same mix of work per warp)
 * and loads one row ahead, a pair's page ids two rows ahead. One wave of blocks.
 * Cost (ncu, d = 128): ~630 warp instructions per row of 8 tokens (~20 per value; v2 had
 * ~1260), issue-bound at IPC ~3.
 * Promote: y = layer·2 + kind, one kind per warp, d/32 lanes per token (lane q owns the
 * coordinates 32q … 32q+31), no prefetch.
 *
 * Bit-exactness with the CPU twin (tq3.c, rotate.c, fp8.c spell out their evaluation order):
 *   - rotation signs: the twin multiplies by ±1 (exact); here the sign is XORed into the FP8
 *     code's sign bit (retier) or into the float's (promote). The per-coordinate signs
 *     (splitmix64) are computed once per block into shared memory;
 *   - every scalar step uses the twin's operation with explicit round-to-nearest intrinsics
 *     (__fmul_rn, __fadd_rn, …): nvcc would otherwise contract a·b+c into an FMA;
 *   - codes: t = fma.rn.sat (clamp to [0, 1], NaN → 0, as tq3.c sat01) and one round-down FMA
 *     t·FLOOR8 + 1.5·2^23 whose low bits are floor(t·FLOOR8) (tq3.c code_of computes the same
 *     floor of the exact product in double). The magic constant rides along in the shift-adds
 *     that place the codes in their unit words and is subtracted once per word;
 *   - K: E = 2c − 7 from the code (exact), ΣE² exact in float in any order, γ and a8 by IEEE
 *     division and square root as the twin;
 *   - value min/max are order-free (the twin makes a zero extreme +0).
 * Promote: decode (K: the lane's unit; V: the token's half of two units), inverse rotation
 * (signs multiplied as in rotate.c, butterflies in its order, the h ≥ 32 stages by shuffles
 * with fma(±1, own, other): one rounding, same bits) and the FP8 row codec, all order-fixed;
 * x/s uses Markstein's correction with the correctly rounded reciprocal when the scale is
 * ≥ 2^-100 (IEEE division otherwise, and for non-finite x).
 */
#include "kvkern_cuda.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <type_traits>

namespace {

constexpr int kWarps = 4; /* warps per block: small, so little is idle when heads·chunks is small */
constexpr int kThreads = 32 * kWarps;

__constant__ float c_centroid[KV_TQ3_LEVELS] = KV_TQ3_CENTROIDS_INIT;

/* Everything a warp needs to place its rows, computed once per launch on the host. */
struct ConvParams {
    uint8_t *sbase, *dbase; /* source / destination pool bases */
    const uint32_t *src, *dst;
    uint64_t seed;
    uint64_t spage, dpage, slayer, dlayer, dused; /* dused = layers · dlayer */
    uint32_t sblk_k, sblk_v, dblk_k, dblk_v;      /* block bytes per kind */
    uint32_t smeta_k, smeta_v, dmeta_k, dmeta_v; /* metadata offsets inside a block, by kind */
    uint32_t dcode_k, dcode_v, dmb_k, dmb_v;     /* code bytes, metadata bytes of a dst block */
    uint32_t spages, dpages, n;
    uint32_t heads, tokens, layers, cpb; /* cpb = chunks per block */
    uint32_t div_m, div_sh;              /* ⌊w / cpb⌋ = (w · div_m) >> div_sh for w < 2^31 */
};

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
        /* lower lane: a + b = fma(1, a, b); upper lane: a − b = fma(−1, b, a) — one rounding */
        const float sg = (q & (uint32_t)m) ? -1.0f : 1.0f;
#pragma unroll
        for (int j = 0; j < 32; j++)
            x[j] = __fmaf_rn(sg, x[j], __shfl_xor_sync(0xffffffffu, x[j], m));
    }
}

/* Pairwise sums (tq3.c "quad sums"), streamed: the N leaves of a lane are pushed in order and
 * combined like a binary counter (left + right at each level), so at most log2(N) + 1 partials
 * are live. quad() adds the quarters of the token (xor 1, then xor 2): (Q0 + Q1) + (Q2 + Q3) on
 * every lane, IEEE addition being commutative. */
template <int N> struct PairSum {
    static constexpr int K = N == 8 ? 3 : N == 16 ? 4 : 5; /* log2 N */
    static_assert(N == 8 || N == 16 || N == 32, "a lane has 8, 16 or 32 leaves");
    float lv[K + 1];
    template <int I> __device__ __forceinline__ void push(float v)
    {
#pragma unroll
        for (int l = 0; l < K; l++) {
            if ((I >> l) & 1) {
                v = __fadd_rn(lv[l], v);
            } else {
                lv[l] = v;
                return;
            }
        }
        lv[K] = v; /* I = N − 1: the lane's total */
    }
    __device__ __forceinline__ float quad() const
    {
        float v = lv[K];
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
        return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    }
};

/* Compile-time loop: f(integral_constant<int, I>) for I = 0 … N−1, so push<I> gets its I. */
template <int I, int N> struct Unroll {
    template <typename F> __device__ __forceinline__ static void run(F &&f)
    {
        f(std::integral_constant<int, I>());
        Unroll<I + 1, N>::run(f);
    }
};
template <int N> struct Unroll<N, N> {
    template <typename F> __device__ __forceinline__ static void run(F &&)
    {
    }
};

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
template <int LPR> __device__ __forceinline__ uint32_t row_or(uint32_t v)
{
#pragma unroll
    for (int m = 1; m < LPR; m <<= 1)
        v |= __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

/* Layout 2 (kv_format.h "TQ3 code units"). A lane packs its 32 codes in the form of a K unit:
 * code of SET h ∈ {0, 1} and pair p at bits 16h + 3·(p%5) of word p/5 (pair 15: unit_add15).
 * K: set = coordinate parity, pair = coordinate/2 — the lane's K unit itself. V: set =
 * coordinate/16, pair = coordinate%16 — the 16-bit halves are then exchanged between the two
 * lanes of a token pair (v_unit_word). One IMAD/LEA per code: the codes do not overlap. */
__host__ __device__ __forceinline__ void unit_add(uint32_t (&pk)[3], int p, int h, uint32_t c)
{
    pk[p / 5] += c << (16 * h + 3 * (p % 5));
}

/* Pair 15: bit b of the set-0 code at bit 15 of word b, of the set-1 code at bit 31. */
__host__ __device__ __forceinline__ void unit_add15(uint32_t (&pk)[3], uint32_t c0, uint32_t c1)
{
    const uint32_t cc = (c0 & 7u) | ((c1 & 7u) << 16);
    for (int b = 0; b < 3; b++)
        pk[b] |= ((cc >> b) & 0x10001u) << 15;
}

/* What unit_add adds besides the codes when each c is 0x4B400000 + code (the magic-number
 * rint of the value codes): the same for each word (5 pairs, 2 sets), wrapping mod 2^32. */
__host__ __device__ constexpr uint32_t unit_magic()
{
    uint32_t v = 0;
    for (int p = 0; p < 5; p++)
        for (int h = 0; h < 2; h++)
            v += 0x4B400000u << (16 * h + 3 * p);
    return v;
}

/* RN(a·b + c) clamped to [0, 1] (NaN → 0): PTX fma.rn.sat, one FFMA.SAT. */
__device__ __forceinline__ float fma_sat(float a, float b, float c)
{
    float r;
    asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

/* Sign masks of the rotation: byte k of word i is 0x80 where kv_rot_sign(seed, 4i + k) < 0. */
template <int D> __device__ __forceinline__ void signs_to_smem(uint32_t *s_sign, uint64_t seed)
{
    uint8_t *b = reinterpret_cast<uint8_t *>(s_sign);
    for (uint32_t i = threadIdx.x; i < (uint32_t)D; i += kThreads)
        b[i] = kv_rot_sign(seed, i) < 0.0f ? 0x80u : 0u;
}

/* Where a warp's rows live inside a page: the same for every pair of the launch. The block
 * (layer, kind, head) offset is layer base + kind part, computed per task (a few IMADs). */
struct WarpPlace {
    uint64_t slbase, dlbase; /* layer · layer bytes */
    uint32_t head, token; /* token: 0 where !rowok, so that loads stay inside the block */
    uint32_t tpair;       /* token / 2 before that clamp: the V unit row of the token's pair */
    bool rowok, pairok, odd, pad_owner, last_lh; /* last_lh: last layer and last head */
    __device__ __forceinline__ uint64_t soff(const ConvParams &P, uint32_t kind) const
    {
        return slbase + (kind ? (uint64_t)P.heads * P.sblk_k + (uint64_t)head * P.sblk_v
                              : (uint64_t)head * P.sblk_k);
    }
    __device__ __forceinline__ uint64_t doff(const ConvParams &P, uint32_t kind) const
    {
        return dlbase + (kind ? (uint64_t)P.heads * P.dblk_k + (uint64_t)head * P.dblk_v
                              : (uint64_t)head * P.dblk_k);
    }
};

/* LPR lanes per row, 32/LPR rows (tokens) per warp: a warp's rows are chunk tc of its head. */
template <int LPR>
__device__ __forceinline__ WarpPlace warp_place(const ConvParams &P, uint32_t wi, uint32_t layer)
{
    constexpr uint32_t RPW = 32 / LPR;
    WarpPlace w;
    w.head = (uint32_t)(((uint64_t)wi * P.div_m) >> P.div_sh);
    const uint32_t tc = wi - w.head * P.cpb;
    const uint32_t raw = tc * RPW + (threadIdx.x & 31u) / LPR;
    /* RPW is even, so a chunk holds whole token pairs and the partner of token raw is in
     * lane ^ LPR; with an odd page_tokens the last pair's second token is past the end */
    w.token = raw;
    w.tpair = raw >> 1;
    w.odd = raw & 1u;
    w.pairok = (raw & ~1u) < P.tokens;
    w.rowok = raw < P.tokens;
    if (!w.rowok)
        w.token = 0;
    w.slbase = (uint64_t)layer * P.slayer;
    w.dlbase = (uint64_t)layer * P.dlayer;
    w.pad_owner = tc == 0;
    w.last_lh = layer == P.layers - 1 && w.head == P.heads - 1;
    return w;
}

/* Zero the destination block's padding and, for the page's last block, the page tail (the
 * whole warp of the block's first chunk). */
__device__ __forceinline__ void zero_pads(const ConvParams &P, const WarpPlace &w, uint32_t kind,
                                          uint8_t *dpage, uint8_t *dblk)
{
    if (!w.pad_owner)
        return;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t mo = kind ? P.dmeta_v : P.dmeta_k;
    const uint32_t me = mo + (kind ? P.dmb_v : P.dmb_k);
    const uint32_t bb = kind ? P.dblk_v : P.dblk_k;
    for (uint32_t i = (kind ? P.dcode_v : P.dcode_k) + lane; i < mo; i += 32)
        dblk[i] = 0;
    for (uint32_t i = me + lane; i < bb; i += 32)
        dblk[i] = 0;
    if (w.last_lh && kind == KV_KIND_V)
        for (uint64_t i = P.dused + lane; i < P.dpage; i += 32)
            dpage[i] = 0;
}

/* ---- retier (v4: tensor-core Hadamard stages) -------------------------------------------
 * A warp holds 8 tokens, a token 4 lanes (its quad, g = lane/4 the token, t = lane%4). Lane t
 * owns the NV = d/4 coordinates (j mod L) + L·t + 4L·(j div L), j < NV (L = 16 at d = 64, else
 * 32): one or two runs of L consecutive bytes of the FP8 row, and at d ≥ 128 whole K units.
 * The Walsh–Hadamard stages over coordinate bits 0, 1, Q, Q+1 (Q = log2 L) are one
 * mma.m16n8k16 per tile of 8 j's: A row = (token, j bit 2), A column k = (bit 0, t, j bit 1)
 * ↔ coordinate bits (0, Q, Q+1, 1), B = H_16 in the same index (H is a tensor product of
 * H_2's, so any bit map applied to both k and n gives the Hadamard over those bits). The
 * outputs land on the lane's own coordinates: D[(token, b2)][n = (b0, t, b1)]. Inputs are the
 * FP8 codes (exact in FP16) and the sums of 16 of them are exact in FP32, so these four stages
 * equal the twin's butterflies bit for bit (tq3.c "ENCODING"); the remaining stages (j bits
 * 2, 3, …) run as float butterflies in the twin's order. */
template <int D> struct Rt {
    static constexpr int L = D == 64 ? 16 : 32; /* consecutive coordinates per run */
    static constexpr int NV = D / 4;            /* values per lane */
    static constexpr int NW = NV / 4;           /* FP8 words per lane */
    static constexpr int NG = NV / 16;          /* 16-coordinate V groups per lane */
    /* blocks per SM: 96 registers at d = 128 (6 blocks, 80 registers, measured the same) */
    static constexpr int MINB = D == 256 ? 3 : D == 128 ? 5 : 6;
};

__device__ __forceinline__ void mma_h16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

/* H_16[k][n] = (−1)^popc(k & n) as an f16 pair (k, k + 1) for column n. */
__device__ __forceinline__ uint32_t h16_pair(uint32_t k, uint32_t n)
{
    const uint32_t lo = (__popc(k & n) & 1u) ? 0xBC00u : 0x3C00u;
    const uint32_t hi = (__popc((k + 1) & n) & 1u) ? 0xBC00u : 0x3C00u;
    return lo | (hi << 16);
}

/* This lane's NV FP8 codes of one row and the row's scale (zeros where go is false). */
template <int D> struct Fp8Row {
    uint32_t cw[Rt<D>::NW];
    float s;
    __device__ __forceinline__ void load(const ConvParams &P, bool go, uint32_t sp, uint64_t soff,
                                         uint32_t rowoff, uint32_t token)
    {
        constexpr int L = Rt<D>::L;
        s = 0.0f;
#pragma unroll
        for (int i = 0; i < Rt<D>::NW; i++)
            cw[i] = 0;
        if (!go)
            return;
        const uint8_t *sblk = P.sbase + (uint64_t)sp * P.spage + soff;
        const uint8_t *row = sblk + rowoff;
#pragma unroll
        for (int i = 0; i < Rt<D>::NW / 4; i++) { /* 16 bytes: run i·16/L, offset (i·16) % L */
            const uint4 a = __ldg(reinterpret_cast<const uint4 *>(row + 4 * L * (16 * i / L) +
                                                                  (16 * i) % L));
            cw[4 * i] = a.x, cw[4 * i + 1] = a.y, cw[4 * i + 2] = a.z, cw[4 * i + 3] = a.w;
        }
        s = __ldg(reinterpret_cast<const float *>(sblk + P.smeta_k) + token); /* FP8: K = V */
    }
};

/* Source and destination page of pair i of this block's slice; false when the pair is past
 * the batch or outside its pool (the whole warp skips it). */
__device__ __forceinline__ bool pair_pages(const ConvParams &P, uint64_t i, uint32_t &sp,
                                           uint32_t &dp)
{
    const uint64_t pair = blockIdx.z + i * gridDim.z; /* 64-bit: no wrap */
    sp = dp = 0;
    if (pair >= P.n)
        return false;
    sp = __ldg(P.src + pair);
    dp = __ldg(P.dst + pair);
    return sp < P.spages && dp < P.dpages;
}

/* Code bits of t ∈ [0, 1]: 1.5·2^23 + floor(t·FLOOR8), the round-down FMA (tq3.c code_of). */
__device__ __forceinline__ uint32_t code_bits(float t)
{
    return __float_as_uint(__fmaf_rd(t, KV_TQ3_FLOOR8, 12582912.0f));
}
constexpr uint32_t kCodeMagic = 0x4B400000u; /* the bits of 1.5·2^23: low 22 bits clear */

/* What unit_add adds besides the codes for set-0 pairs only (the V half units): per word. */
__host__ __device__ constexpr uint32_t unit_magic_lo()
{
    uint32_t v = 0;
    for (int p = 0; p < 5; p++)
        v += kCodeMagic << (3 * p);
    return v;
}
/* The same for low-half K units at d = 64 (pairs 0-7: word 0 full, word 1 pairs 5-7). */
__host__ __device__ constexpr uint32_t unit_magic_w1_low8()
{
    uint32_t v = 0;
    for (int p = 0; p < 3; p++)
        for (int h = 0; h < 2; h++)
            v += kCodeMagic << (16 * h + 3 * p);
    return v;
}

/* Retier one row (this warp's 8 tokens of one block) of kind KIND: decode, rotate, encode,
 * store codes and metadata. Lanes of the warp take part in every shuffle (warp-uniform). */
template <int D, int KIND>
__device__ __forceinline__ void retier_row(const ConvParams &P, const WarpPlace &w, uint32_t q,
                                           const uint32_t *s_sign, const uint32_t (&hb)[2][2],
                                           const Fp8Row<D> &row, uint8_t *dpage)
{
    constexpr int L = Rt<D>::L, NV = Rt<D>::NV, NW = Rt<D>::NW, NG = Rt<D>::NG;
    constexpr uint32_t kind = KIND;
    const float isqd = (float)(1.0 / sqrt((double)D));
    const float ka8 = kv_tq3_key_a8(D);
    uint8_t *dblk = dpage + w.doff(P, kind);
    const float s = row.s;
    const uint32_t(&cw)[NW] = row.cw;

    /* ---- signs into the FP8 sign bits, FP8 pairs → f16 pairs (j = 2p, 2p + 1) ---- */
    uint32_t hp[NV / 2];
#pragma unroll
    for (int i = 0; i < NW / 4; i++) {
        const uint32_t at = 4 * L * (16 * i / L) + (16 * i) % L; /* coordinate of word 4i */
        const uint4 sg = *reinterpret_cast<const uint4 *>(
            reinterpret_cast<const uint8_t *>(s_sign) + L * q + at);
        const uint32_t sgw[4] = {sg.x, sg.y, sg.z, sg.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t v = cw[4 * i + k] ^ sgw[k];
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                    (__nv_fp8x2_storage_t)((v >> (16 * hh)) & 0xffffu), __NV_E4M3);
                hp[2 * (4 * i + k) + hh] = (uint32_t)hr.x | ((uint32_t)hr.y << 16);
            }
        }
    }
    /* ---- Hadamard stages over coordinate bits 0, 1, Q, Q+1 on the tensor cores ---- */
    float x[NV];
#pragma unroll
    for (int T = 0; T < NV / 8; T++) {
        const uint32_t a[4] = {hp[4 * T], hp[4 * T + 2], hp[4 * T + 1], hp[4 * T + 3]};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float c[4];
            mma_h16(c, a, hb[h][0], hb[h][1]);
            x[8 * T + 2 * h] = c[0];
            x[8 * T + 2 * h + 1] = c[1];
            x[8 * T + 2 * h + 4] = c[2];
            x[8 * T + 2 * h + 5] = c[3];
        }
    }
    /* ---- the other stages: j bits 2, 3, … in ascending order (tq3.c) ---- */
#pragma unroll
    for (int hs = 4; hs < NV; hs <<= 1) {
#pragma unroll
        for (int j = 0; j < NV; j++) {
            if ((j & hs) == 0) {
                const float a = x[j], b = x[j + hs];
                x[j] = __fadd_rn(a, b);
                x[j + hs] = __fsub_rn(a, b);
            }
        }
    }

    if constexpr (KIND == KV_KIND_K) {
        /* ---- keys: ‖w‖², codes floor(sat(w·a8 + ½)·FLOOR8), E = 2c − 7, ⟨w, E⟩, ΣE² ---- */
        constexpr int NU = NV >= 32 ? NV / 32 : 1; /* K units (d = 64: half of one) */
        PairSum<NV / 2> t2;
        Unroll<0, NV / 2>::run([&](auto I) {
            const float a = x[2 * I], b = x[2 * I + 1];
            t2.push<I>(__fmaf_rn(b, b, __fmul_rn(a, a)));
        });
        const float nw2 = t2.quad();
        const bool live = nw2 > 0.0f && nw2 <= FLT_MAX && fabsf(s) <= FLT_MAX && s != 0.0f;
        const float a8 = __fdiv_rn(ka8, __fsqrt_rn(nw2));
        uint32_t pk[NU][3], c15[NU][2] = {};
#pragma unroll
        for (int u = 0; u < NU; u++)
            pk[u][0] = pk[u][1] = pk[u][2] = 0u;
        float ee = 0.0f; /* Σ E²: odd integers ≤ 49·d, exact in any order */
        PairSum<NV / 2> td;
        Unroll<0, NV / 2>::run([&](auto I) {
            float e[2];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int j = 2 * I + u, jj = j % 32; /* unit j / 32, position jj */
                const uint32_t cb = code_bits(fma_sat(x[j], a8, 0.5f));
                if (jj < 30)
                    unit_add(pk[j / 32], jj / 2, jj & 1, cb);
                else
                    c15[j / 32][jj & 1] = cb;
                const float cf = __fsub_rn(__uint_as_float(cb), 12582912.0f);
                e[u] = __fmaf_rn(cf, 2.0f, -7.0f);
                ee = __fmaf_rn(e[u], e[u], ee);
            }
            td.push<I>(__fmaf_rn(x[2 * I + 1], e[1], __fmul_rn(x[2 * I], e[0])));
        });
        const float dot = td.quad();
        ee = __fadd_rn(ee, __shfl_xor_sync(0xffffffffu, ee, 1));
        ee = __fadd_rn(ee, __shfl_xor_sync(0xffffffffu, ee, 2));
        uint16_t nb = 0;
        if (live)
            nb = half_sat_bits(
                __fdiv_rn(__fmul_rn(s, dot), __fmul_rn(KV_TQ3_KEY_HALF_STEP, ee)));
        if (w.rowok && q == 0)
            reinterpret_cast<uint16_t *>(dblk + P.dmeta_k)[w.token] = nb;
        if constexpr (D >= 128) {
#pragma unroll
            for (int u = 0; u < NU; u++) {
#pragma unroll
                for (int b = 0; b < 3; b++)
                    pk[u][b] = live ? pk[u][b] - unit_magic() : 0u;
                if (live)
                    unit_add15(pk[u], c15[u][0], c15[u][1]);
            }
            if (w.rowok) { /* units q and q + 4 of the token */
#pragma unroll
                for (int u = 0; u < NU; u++) {
                    uint32_t *wp = reinterpret_cast<uint32_t *>(dblk) +
                                   ((uint64_t)w.token * (D / 32) + q + 4 * u) * 3;
                    wp[0] = pk[u][0];
                    wp[1] = pk[u][1];
                    wp[2] = pk[u][2];
                }
            }
        } else {
            /* d = 64: lane q holds coordinates 16q … 16q+15, the low (q even) or high half
             * of unit q/2. Packed as pairs 0-7; an odd lane moves them to pairs 8-15 (word
             * 1 slots 3-4, word 2 slots 0-4, pair 15) and the even lane adds them in. */
            constexpr uint32_t S01 = 0x003F003Fu, S012 = 0x01FF01FFu; /* slots, both sets */
            uint32_t l0 = pk[0][0] - unit_magic(), l1 = pk[0][1] - unit_magic_w1_low8();
            uint32_t hi[3] = {0u, (l0 & S01) << 9, ((l0 >> 6) & S012) | ((l1 & S01) << 9)};
            unit_add15(hi, (l1 >> 6) & 7u, (l1 >> 22) & 7u);
            const bool odd_q = q & 1u;
            uint32_t own[3] = {odd_q ? hi[0] : l0, odd_q ? hi[1] : l1, odd_q ? hi[2] : 0u};
#pragma unroll
            for (int b = 0; b < 3; b++) {
                own[b] = live ? own[b] : 0u;
                own[b] |= __shfl_xor_sync(0xffffffffu, own[b], 1);
            }
            if (w.rowok && !odd_q) {
                uint32_t *wp = reinterpret_cast<uint32_t *>(dblk) +
                               ((uint64_t)w.token * 2 + q / 2) * 3;
                wp[0] = own[0];
                wp[1] = own[1];
                wp[2] = own[2];
            }
        }
    } else {
        /* ---- values: min/max, Σw, Σw² on w; grid in w units, stored in x units ---- */
        float lo = x[0], hi = x[0];
#pragma unroll
        for (int j = 1; j < NV; j++) {
            lo = fminf(lo, x[j]);
            hi = fmaxf(hi, x[j]);
        }
#pragma unroll
        for (int m = 1; m < 4; m <<= 1) {
            lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, m));
            hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, m));
        }
        lo = __fadd_rn(lo, 0.0f); /* zero extremes are +0 (tq3.c) */
        hi = __fadd_rn(hi, 0.0f);
        PairSum<NV / 2> ts, t2;
        Unroll<0, NV / 2>::run([&](auto I) {
            const float a = x[2 * I], b = x[2 * I + 1];
            ts.push<I>(__fadd_rn(a, b));
            t2.push<I>(__fmaf_rn(b, b, __fmul_rn(a, a)));
        });
        const float sum = ts.quad(), sq = t2.quad();
        const bool bad = !(sq <= FLT_MAX) || !(fabsf(s) <= FLT_MAX);
        uint16_t zh = 0, sh = 0;
        float a8 = 0.0f, b8 = 0.0f; /* codes 0 unless set below */
        if (!bad) {
            const float mean = __fmul_rn(sum, 1.0f / D); /* = sum/D exactly: D = 2^k */
            float var = __fmaf_rn(-mean, mean, __fmul_rn(sq, 1.0f / D));
            var = var > 0.0f ? var : 0.0f;
            const float step = __fmul_rn(KV_TQ3_VALUE_STEP_SIGMAS, __fsqrt_rn(var));
            float z0 = lo, s0 = __fdiv_rn(__fsub_rn(hi, lo), 7.0f);
            if (step < s0) { /* the clipped MSE-optimal grid is narrower than min/max */
                z0 = __fsub_rn(mean, __fmul_rn(3.5f, step));
                s0 = step;
            }
            const float k = __fmul_rn(s, isqd);
            zh = half_sat_bits(__fmul_rn(z0, k));
            sh = half_sat_bits(__fmul_rn(s0, k));
            const float zz = half_bits_to_float(zh), sv = half_bits_to_float(sh);
            if (sv != 0.0f) {
                a8 = __fmul_rn(__fdiv_rn(k, sv), 0.125f);
                b8 = __fmaf_rn(__fdiv_rn(-zz, sv), 0.125f, 0.0625f);
            }
        }
        if (w.rowok && q == 0) {
            uint16_t *m = reinterpret_cast<uint16_t *>(dblk + P.dmeta_v);
            m[w.token] = sh;
            m[P.tokens + w.token] = zh;
        }
        /* a8 = b8 = 0 gives t = 0: codes 0 */
        uint32_t pv[NG][3], c15[NG];
#pragma unroll
        for (int g = 0; g < NG; g++)
            pv[g][0] = pv[g][1] = pv[g][2] = 0u;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const uint32_t cb = code_bits(fma_sat(x[j], a8, b8));
            if (j % 16 < 15)
                unit_add(pv[j / 16], j % 16, 0, cb);
            else
                c15[j / 16] = cb;
        }
        /* a token past the page end (the partner of an odd page's last token): codes 0 */
#pragma unroll
        for (int g = 0; g < NG; g++) {
#pragma unroll
            for (int b = 0; b < 3; b++)
                pv[g][b] = w.rowok ? pv[g][b] - unit_magic_lo() : 0u;
            unit_add15(pv[g], w.rowok ? c15[g] : 0u, 0u);
        }
        /* V unit (token pair, 16-group) = even token's codes low, odd token's high: the
         * partner token is lane ^ 4; the even token's lane writes groups 0, 2, …, the odd
         * one's groups 1, 3, … (at d = 64, one group: the even lane writes it) */
#pragma unroll
        for (int g2 = 0; g2 < (NG + 1) / 2; g2++) {
            const int ge = 2 * g2, go = NG > 1 ? 2 * g2 + 1 : 0;
            const int gw = w.odd && NG > 1 ? go : ge; /* the group this lane writes */
            uint32_t word[3];
#pragma unroll
            for (int b = 0; b < 3; b++) {
                const uint32_t own = w.odd ? pv[go][b] : pv[ge][b];
                const uint32_t send = NG > 1 ? (w.odd ? pv[ge][b] : pv[go][b]) : pv[ge][b];
                const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 4);
                word[b] = NG > 1 ? (w.odd ? __byte_perm(recv, own, 0x5410u)
                                          : __byte_perm(own, recv, 0x5410u))
                                 : __byte_perm(own, recv, 0x5410u);
            }
            const uint32_t g16 = L == 16 ? q : 2 * q + (gw % 2) + 8 * (gw / 2);
            if (w.pairok && (NG > 1 || !w.odd)) {
                uint32_t *wp = reinterpret_cast<uint32_t *>(dblk) +
                               ((uint64_t)w.tpair * (D / 16) + g16) * 3;
                wp[0] = word[0];
                wp[1] = word[1];
                wp[2] = word[2];
            }
        }
    }
    zero_pads(P, w, kind, dpage, dblk);
}

template <int D>
__global__ void __launch_bounds__(kThreads, Rt<D>::MINB) retier_kernel(ConvParams P)
{
    constexpr int L = Rt<D>::L;
    __shared__ __align__(16) uint32_t s_sign[D / 4];
    signs_to_smem<D>(s_sign, P.seed);
    __syncthreads();

    const uint32_t wi = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (wi >= P.heads * P.cpb)
        return; /* whole warp */
    const uint32_t lane = threadIdx.x & 31u, q = lane & 3u;
    const WarpPlace w = warp_place<4>(P, wi, blockIdx.y);
    /* B fragments of H_16 for the two n-tiles: k = 2q (+1), 2q + 8 (+9); n = 8h + lane/4 */
    uint32_t hb[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        hb[h][0] = h16_pair(2 * q, 8 * h + (lane >> 2));
        hb[h][1] = h16_pair(2 * q + 8, 8 * h + (lane >> 2));
    }
    const uint32_t rowoff = w.token * D + L * q; /* this lane's first byte in a block */
    const uint64_t soff_k = w.soff(P, KV_KIND_K), soff_v = w.soff(P, KV_KIND_V);

    /* Pair after pair, K then V rows of the same chunk, so that every warp does the same mix of
     * work. Software pipeline: a row is loaded one row ahead (the V row of pair i while K is
     * computed, the K row of pair i + 1 while V is), a pair's page ids two rows ahead. */
    const uint64_t per =
        P.n > blockIdx.z ? ((uint64_t)P.n - blockIdx.z + gridDim.z - 1) / gridDim.z : 0;
    uint32_t sp, dp;
    bool ok = pair_pages(P, 0, sp, dp);
    Fp8Row<D> rk, rv;
    rk.load(P, ok && w.rowok, sp, soff_k, rowoff, w.token);
    for (uint64_t i = 0; i < per; i++) {
        const bool ok_i = ok;
        uint8_t *dpage = P.dbase + (uint64_t)dp * P.dpage;
        rv.load(P, ok_i && w.rowok, sp, soff_v, rowoff, w.token);
        ok = pair_pages(P, i + 1, sp, dp);
        if (ok_i)
            retier_row<D, KV_KIND_K>(P, w, q, s_sign, hb, rk, dpage);
        rk.load(P, ok && w.rowok, sp, soff_k, rowoff, w.token);
        if (ok_i)
            retier_row<D, KV_KIND_V>(P, w, q, s_sign, hb, rv, dpage);
    }
}

template <int D> __global__ void __launch_bounds__(kThreads) promote_kernel(ConvParams P)
{
    constexpr int LPR = D / 32;
    __shared__ uint32_t s_sign[D / 4];
    __shared__ float s_cent[KV_TQ3_LEVELS];
    signs_to_smem<D>(s_sign, P.seed);
    if (threadIdx.x < KV_TQ3_LEVELS)
        s_cent[threadIdx.x] = c_centroid[threadIdx.x];
    __syncthreads();

    const uint32_t wi = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (wi >= P.heads * P.cpb)
        return;
    const uint32_t q = threadIdx.x % LPR;
    const WarpPlace w = warp_place<LPR>(P, wi, blockIdx.y >> 1);
    const uint32_t kind = blockIdx.y & 1u;
    uint32_t sg[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        sg[i] = s_sign[8 * q + i];
    const float inv = (float)(1.0 / sqrt((double)D));

    for (uint64_t pair = blockIdx.z; pair < P.n; pair += gridDim.z) { /* 64-bit: no wrap */
        const uint32_t sp = P.src[pair], dp = P.dst[pair];
        if (sp >= P.spages || dp >= P.dpages)
            continue;
        const uint8_t *sblk = P.sbase + (uint64_t)sp * P.spage + w.soff(P, kind);
        uint8_t *dpage = P.dbase + (uint64_t)dp * P.dpage;
        uint8_t *dblk = dpage + w.doff(P, kind);

        float x[32];
        if (w.rowok) {
            const uint32_t *cw = reinterpret_cast<const uint32_t *>(sblk);
            const uint16_t *m =
                reinterpret_cast<const uint16_t *>(sblk + (kind ? P.smeta_v : P.smeta_k));
            if (kind == KV_KIND_K) {
                /* K unit (token, q): coordinate 2p + h is pair p, half h */
                const uint32_t *wp = cw + ((uint64_t)w.token * LPR + q) * 3;
                const uint32_t u[3] = {__ldg(wp), __ldg(wp + 1), __ldg(wp + 2)};
                const float gm = __fmul_rn(half_bits_to_float(__ldg(m + w.token)), inv);
#pragma unroll
                for (int j = 0; j < 32; j++)
                    x[j] = __fmul_rn(s_cent[kv_tq3_unit_get(u, j >> 1, j & 1)], gm);
            } else {
                /* V units (token/2, 2q) and (token/2, 2q + 1): coordinates 32q … 32q+15 and
                 * 32q+16 … 32q+31, this token's codes in the half (token & 1); moved to the
                 * low half, a code is then pair j%16, half 0 */
                const uint32_t *wp = cw + ((uint64_t)(w.token >> 1) * (2 * LPR) + 2 * q) * 3;
                const uint32_t sh = 16 * (w.token & 1u);
                uint32_t u0[3], u1[3];
#pragma unroll
                for (int b = 0; b < 3; b++) {
                    u0[b] = __ldg(wp + b) >> sh;
                    u1[b] = __ldg(wp + 3 + b) >> sh;
                }
                const float s = half_bits_to_float(__ldg(m + w.token));
                const float z = half_bits_to_float(__ldg(m + P.tokens + w.token));
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    const uint32_t c = kv_tq3_unit_get(j < 16 ? u0 : u1, j & 15, 0);
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
            /* ×(±1) as rotate.c: sign bit of byte j%4 of the mask word moved to bit 31 */
            const float sgn = __uint_as_float(
                0x3f800000u | ((sg[j / 4] << (24 - 8 * (j % 4))) & 0x80000000u));
            x[j] = __fmul_rn(__fmul_rn(x[j], inv), sgn);
            const float a = fabsf(x[j]);
            if (a <= FLT_MAX && a > amax)
                amax = a;
        }
        amax = row_max<LPR>(amax);
        const float s = amax >= FLT_MIN ? __fdiv_rn(amax, KV_FP8_MAX) : 1.0f;
        const bool fast = s >= 0x1p-100f;
        const float rs = __frcp_rn(s);
        uint32_t cw[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float qv[4];
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const float v = x[4 * i + b];
                const float t0 = __fmul_rn(v, rs);
                const float e = __fmaf_rn(-t0, s, v);
                /* e = 0: t0 is exact (and keeps the sign of a zero v, which t0 + 0 would not);
                 * e is NaN only when t0 overflowed (v = ±inf): IEEE division then */
                float r = e == 0.0f ? t0 : __fmaf_rn(e, rs, t0);
                if (!fast || e != e)
                    r = __fdiv_rn(v, s);
                qv[b] = r;
            }
            const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(qv[0], qv[1]),
                                                         __NV_SATFINITE, __NV_E4M3);
            const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(qv[2], qv[3]),
                                                         __NV_SATFINITE, __NV_E4M3);
            cw[i] = (lo & 0xffffu) | (hi << 16);
        }
        if (w.rowok) {
            uint4 *c4 = reinterpret_cast<uint4 *>(dblk + (uint64_t)w.token * D + 32 * q);
            c4[0] = make_uint4(cw[0], cw[1], cw[2], cw[3]);
            c4[1] = make_uint4(cw[4], cw[5], cw[6], cw[7]);
            if (q == 0)
                reinterpret_cast<float *>(dblk + P.dmeta_k)[w.token] = s; /* FP8: K = V */
        }
        zero_pads(P, w, kind, dpage, dblk);
    }
}

/* Blocks of the retier (promote) kernel resident on the whole GPU: SM count × blocks per SM,
 * queried once (attributes only, no stream work, so a launch stays capturable). */
template <int D> int resident_blocks(bool retier)
{
    static int cached[2] = {0, 0}; /* per kernel instance; a racing first call computes twice */
    if (cached[retier] > 0)
        return cached[retier];
    int dev = 0, sms = 0, per = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 1024; /* a plain guess; only the grid size depends on it */
    const cudaError_t e =
        retier
            ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, retier_kernel<D>, kThreads, 0)
            : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, promote_kernel<D>, kThreads, 0);
    if (e != cudaSuccess)
        return 1024;
    cached[retier] = sms * (per > 0 ? per : 1);
    return cached[retier];
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
    const kv_fmt_t sf = retier ? KV_FMT_FP8 : KV_FMT_TQ3, df = retier ? KV_FMT_TQ3 : KV_FMT_FP8;
    ConvParams P;
    P.sbase = pools->base[sf];
    P.dbase = pools->base[df];
    P.src = src;
    P.dst = dst;
    P.seed = g->seed;
    P.spage = kv_page_bytes(g, sf);
    P.dpage = kv_page_bytes(g, df);
    P.slayer = kv_layer_bytes(g, sf);
    P.dlayer = kv_layer_bytes(g, df);
    P.dused = (uint64_t)g->layers * P.dlayer;
    /* one block: ≤ 4096 tokens · 256 B + metadata < 2^32 */
    P.sblk_k = (uint32_t)kv_block_bytes(g, sf, KV_KIND_K);
    P.sblk_v = (uint32_t)kv_block_bytes(g, sf, KV_KIND_V);
    P.dblk_k = (uint32_t)kv_block_bytes(g, df, KV_KIND_K);
    P.dblk_v = (uint32_t)kv_block_bytes(g, df, KV_KIND_V);
    P.smeta_k = (uint32_t)kv_block_meta_offset(g, sf, KV_KIND_K);
    P.smeta_v = (uint32_t)kv_block_meta_offset(g, sf, KV_KIND_V);
    P.dmeta_k = (uint32_t)kv_block_meta_offset(g, df, KV_KIND_K);
    P.dmeta_v = (uint32_t)kv_block_meta_offset(g, df, KV_KIND_V);
    P.dcode_k = (uint32_t)kv_block_code_bytes(g, df, KV_KIND_K);
    P.dcode_v = (uint32_t)kv_block_code_bytes(g, df, KV_KIND_V);
    P.dmb_k = (uint32_t)kv_block_meta_bytes(g, df, KV_KIND_K);
    P.dmb_v = (uint32_t)kv_block_meta_bytes(g, df, KV_KIND_V);
    P.spages = pools->pages[sf];
    P.dpages = pools->pages[df];
    P.n = n;
    P.heads = g->kv_heads;
    P.tokens = g->page_tokens;
    P.layers = g->layers;
    /* rows (tokens) per warp: retier 8 (a quad per token), promote 32/(d/32) */
    const uint32_t rpw = retier ? 8u : 32u / (g->head_dim / 32u);
    P.cpb = (g->page_tokens + rpw - 1) / rpw;
    /* ⌊w/cpb⌋ for w < 2^31 (Granlund–Montgomery): l = ⌈log2 cpb⌉, m = ⌈2^(31+l)/cpb⌉ ≤ 2^31 */
    uint32_t l = 0;
    while ((1u << l) < P.cpb)
        l++;
    P.div_m = (uint32_t)(((1ull << (31 + l)) + P.cpb - 1) / P.cpb);
    P.div_sh = 31 + l;

    const uint32_t chunks = g->kv_heads * P.cpb; /* ≤ 256 · 1024 */
    /* retier: y = layer (a warp does K and V); promote: y = layer·2 + kind */
    const uint32_t gx = (chunks + kWarps - 1) / kWarps, gy = (retier ? 1u : 2u) * g->layers;
    /* one wave of resident blocks; each warp then loops over its pairs (a second wave would
     * only add a tail) */
    const uint64_t want = (uint64_t)(g->head_dim == 64    ? resident_blocks<64>(retier)
                                     : g->head_dim == 128 ? resident_blocks<128>(retier)
                                                          : resident_blocks<256>(retier));
    uint64_t gz = (want + (uint64_t)gx * gy - 1) / ((uint64_t)gx * gy);
    gz = gz < 1 ? 1 : gz > n ? n : gz > 65535 ? 65535 : gz;
    const dim3 grid(gx, gy, (uint32_t)gz), block(kThreads);
    switch (g->head_dim) {
    case 64:
        if (retier)
            retier_kernel<64><<<grid, block, 0, st>>>(P);
        else
            promote_kernel<64><<<grid, block, 0, st>>>(P);
        break;
    case 128:
        if (retier)
            retier_kernel<128><<<grid, block, 0, st>>>(P);
        else
            promote_kernel<128><<<grid, block, 0, st>>>(P);
        break;
    default:
        if (retier)
            retier_kernel<256><<<grid, block, 0, st>>>(P);
        else
            promote_kernel<256><<<grid, block, 0, st>>>(P);
        break;
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
