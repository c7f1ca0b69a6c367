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
 * Promote (v2, tq3.c "promote"): the same split and pipeline; the FP8 row comes from the exact
 * integer transform H·E (keys, E = 2c − 7) or H·c (values) of the codes, on the tensor cores.
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
 * Promote: the transform is exact (integers below 7d), so only the scalar steps are
 * order-fixed: the same IEEE operations as the twin (max, |g|·m, 448/m, x·r), the FP8
 * conversion cvt.rn.satfinite (= kv_fp8_from_float) and the rotation sign XORed into the
 * code byte (fp8(−x) = fp8(x) ^ 0x80).
 */
#include "kvkern_cuda.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <atomic>
#include <float.h>
#include <type_traits>

namespace {

constexpr int kWarps = 4; /* warps per block: small, so little is idle when heads·chunks is small */
constexpr int kThreads = 32 * kWarps;


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

/* A quad of lanes per row, 8 rows (tokens) per warp: a warp's rows are chunk tc of its head. */
__device__ __forceinline__ WarpPlace warp_place(const ConvParams &P, uint32_t wi, uint32_t layer)
{
    constexpr uint32_t LPR = 4, RPW = 32 / LPR;
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

/* w = H·(the lane's f16 pairs) on the lane's coordinates (tq3.c order): the stages over
 * coordinate bits 0, 1, Q, Q+1 as 2 mma per tile of 8 j's, then j bits 2, 3, … as float
 * butterflies. hp[p] holds j = 2p (low half), 2p + 1. */
template <int D>
__device__ __forceinline__ void hadamard_lane(const uint32_t (&hp)[Rt<D>::NV / 2],
                                              const uint32_t (&hb)[2][2], float (&x)[Rt<D>::NV])
{
    constexpr int NV = Rt<D>::NV;
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
}

/* B fragments of H_16 for the two n-tiles: k = 2q (+1), 2q + 8 (+9); n = 8h + lane/4 */
__device__ __forceinline__ void h16_frags(uint32_t lane, uint32_t (&hb)[2][2])
{
    const uint32_t q = lane & 3u;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        hb[h][0] = h16_pair(2 * q, 8 * h + (lane >> 2));
        hb[h][1] = h16_pair(2 * q + 8, 8 * h + (lane >> 2));
    }
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
    float x[NV];
    hadamard_lane<D>(hp, hb, x);

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

/* The pair loop of both kernels: pair after pair of this block's slice, the K row then the V
 * row of the warp's chunk, so that every warp does the same mix of work. Software pipeline: a
 * row is loaded one row ahead (the V row of pair i while K is converted, the K row of pair
 * i + 1 while V is), a pair's page ids two rows ahead. load(row, kind, go, src page) fills a
 * row (zeros when !go); run(row, kind, dst page) converts it; kind is an integral_constant. */
template <typename Row, typename Load, typename Run>
__device__ __forceinline__ void pair_loop(const ConvParams &P, const WarpPlace &w, Load load,
                                          Run run)
{
    using KindK = std::integral_constant<int, KV_KIND_K>;
    using KindV = std::integral_constant<int, KV_KIND_V>;
    const uint64_t per =
        P.n > blockIdx.z ? ((uint64_t)P.n - blockIdx.z + gridDim.z - 1) / gridDim.z : 0;
    uint32_t sp, dp;
    bool ok = pair_pages(P, 0, sp, dp);
    Row rk, rv;
    load(rk, KindK(), ok && w.rowok, sp);
    for (uint64_t i = 0; i < per; i++) { /* 64-bit: n close to 2^32 cannot wrap */
        const bool ok_i = ok;
        uint8_t *dpage = P.dbase + (uint64_t)dp * P.dpage;
        load(rv, KindV(), ok_i && w.rowok, sp);
        ok = pair_pages(P, i + 1, sp, dp);
        if (ok_i)
            run(rk, KindK(), dpage);
        load(rk, KindK(), ok && w.rowok, sp);
        if (ok_i)
            run(rv, KindV(), dpage);
    }
}

/* Per-warp setup shared by retier and promote: the block's sign masks in shared memory (all
 * threads, one barrier), then this warp's place; false for a warp past the last chunk (it
 * returns, having passed the barrier). */
template <int D>
__device__ __forceinline__ bool conv_warp(const ConvParams &P, uint32_t *s_sign, WarpPlace &w,
                                          uint32_t (&hb)[2][2], uint32_t &q)
{
    signs_to_smem<D>(s_sign, P.seed);
    __syncthreads();
    const uint32_t wi = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (wi >= P.heads * P.cpb)
        return false; /* whole warp */
    const uint32_t lane = threadIdx.x & 31u;
    q = lane & 3u;
    w = warp_place(P, wi, blockIdx.y);
    h16_frags(lane, hb);
    return true;
}

template <int D>
__global__ void __launch_bounds__(kThreads, Rt<D>::MINB) retier_kernel(ConvParams P)
{
    constexpr int L = Rt<D>::L;
    __shared__ __align__(16) uint32_t s_sign[D / 4];
    WarpPlace w;
    uint32_t hb[2][2], q;
    if (!conv_warp<D>(P, s_sign, w, hb, q))
        return;
    const uint32_t rowoff = w.token * D + L * q; /* this lane's first byte in a block */
    pair_loop<Fp8Row<D>>(
        P, w,
        [&](Fp8Row<D> &r, auto kind, bool go, uint32_t sp) {
            r.load(P, go, sp, w.soff(P, kind), rowoff, w.token);
        },
        [&](const Fp8Row<D> &r, auto kind, uint8_t *dpage) {
            retier_row<D, decltype(kind)::value>(P, w, q, s_sign, hb, r, dpage);
        });
}

/* ---- promote (v2: the exact integer transform on the tensor cores; tq3.c "promote") -------
 * The same work split as retier (8 tokens per warp, a quad per token, lane q owning the
 * coordinates (j mod L) + L·q + 4L·(j div L)). Keys: Y = H·E with E = 2c − 7; values:
 * Yc = H·c. Both are integers below 7d, so the four tensor-core stages and the float stages
 * are exact and the twin's order does not matter. The lane's code pairs become FP16 operands
 * by a shift, a mask with the exponent of 1024 ORed in, and one HSUB2. */

/* This lane's TQ3 code words of one row and the row's FP16 metadata (zeros where go is false).
 * K: the lane's K units (d ≥ 128: units q + 4u; d = 64: unit q/2, of which the lane owns the
 * low (q even) or high half). V: the units (token pair, group) of the lane's 16-coordinate
 * groups, shifted so that this token's half is the low one. */
template <int D> struct Tq3Row {
    static constexpr int NG = Rt<D>::NG;
    uint32_t u[NG][3];
    uint16_t m0, m1; /* K: γ; V: scale, zero */
    template <int KIND>
    __device__ __forceinline__ void load(const ConvParams &P, const WarpPlace &w, bool go,
                                         uint32_t sp, uint64_t soff, uint32_t q)
    {
        constexpr int L = Rt<D>::L;
        m0 = m1 = 0;
#pragma unroll
        for (int g = 0; g < NG; g++)
            u[g][0] = u[g][1] = u[g][2] = 0u;
        if (!go)
            return;
        const uint8_t *blk = P.sbase + (uint64_t)sp * P.spage + soff;
        const uint32_t *cw = reinterpret_cast<const uint32_t *>(blk);
        if (KIND == KV_KIND_K) {
            constexpr int NU = Rt<D>::NV >= 32 ? Rt<D>::NV / 32 : 1;
#pragma unroll
            for (int k = 0; k < NU; k++) {
                const uint32_t unit =
                    D == 64 ? w.token * 2 + q / 2 : w.token * (D / 32) + q + 4 * k;
#pragma unroll
                for (int b = 0; b < 3; b++)
                    u[k][b] = __ldg(cw + (uint64_t)unit * 3 + b);
            }
            m0 = __ldg(reinterpret_cast<const uint16_t *>(blk + P.smeta_k) + w.token);
        } else {
            const uint32_t sh = w.odd ? 16u : 0u;
#pragma unroll
            for (int g = 0; g < NG; g++) {
                const uint32_t g16 = L == 16 ? q : 2 * q + (g % 2) + 8 * (g / 2);
                const uint32_t unit = w.tpair * (D / 16) + g16;
#pragma unroll
                for (int b = 0; b < 3; b++)
                    u[g][b] = __ldg(cw + (uint64_t)unit * 3 + b) >> sh;
            }
            const uint16_t *m = reinterpret_cast<const uint16_t *>(blk + P.smeta_v);
            m0 = __ldg(m + w.token);
            m1 = __ldg(m + P.tokens + w.token);
        }
    }
};

/* Code of pair p (0..15), set h, of unit words u, in bits 0-2. */
__device__ __forceinline__ uint32_t unit_code(const uint32_t (&u)[3], int p, int h)
{
    if (p < 15)
        return (u[p / 5] >> (16 * h + 3 * (p % 5))) & 7u;
    const int b = 15 + 16 * h;
    return ((u[0] >> b) & 1u) | (((u[1] >> b) & 1u) << 1) | (((u[2] >> b) & 1u) << 2);
}

/* f16 pair (lo = a, hi = b) of two small integers as 1024 + n (bits 0x6400 | n, n < 1024). */
__device__ __forceinline__ uint32_t code_h2(uint32_t a, uint32_t b)
{
    return (a | (b << 16)) | 0x64006400u;
}

template <int D, int KIND>
__device__ __forceinline__ void promote_row(const ConvParams &P, const WarpPlace &w, uint32_t q,
                                            const uint32_t *s_sign, const uint32_t (&hb)[2][2],
                                            const Tq3Row<D> &row, uint8_t *dpage)
{
    constexpr int L = Rt<D>::L, NV = Rt<D>::NV;
    constexpr uint32_t kind = KIND;
    uint8_t *dblk = dpage + w.doff(P, kind);

    /* ---- code pairs → FP16 operands: keys E = 2c − 7, values c ---- */
    uint32_t hp[NV / 2];
    if constexpr (KIND == KV_KIND_K) {
        uint32_t lu[Rt<D>::NG][3];
#pragma unroll
        for (int g = 0; g < Rt<D>::NG; g++)
            lu[g][0] = row.u[g][0], lu[g][1] = row.u[g][1], lu[g][2] = row.u[g][2];
        if constexpr (D == 64) {
            /* the high half (q odd: pairs 8-15) moved to the places of pairs 0-7 */
            constexpr uint32_t S01 = 0x003F003Fu, S012 = 0x01FF01FFu;
            const uint32_t w1 = row.u[0][1], w2 = row.u[0][2];
            const uint32_t c15 = unit_code(row.u[0], 15, 0) | (unit_code(row.u[0], 15, 1) << 16);
            const uint32_t l0 = ((w1 >> 9) & S01) | ((w2 & S012) << 6);
            const uint32_t l1 = ((w2 >> 9) & S01) | (c15 << 6);
            if (q & 1u) {
                lu[0][0] = l0;
                lu[0][1] = l1;
            }
        }
#pragma unroll
        for (int P2 = 0; P2 < NV / 2; P2++) { /* pair P2: j = 2·P2, 2·P2 + 1 */
            const int k = (2 * P2) / 32, p = P2 % 16;
            /* 1024 + 2c in each half, minus 1031 = 2c − 7 (doubling 1024 + c would need the
             * constant 2055, which FP16 cannot hold) */
            const uint32_t h2 = code_h2(2 * unit_code(lu[k], p, 0), 2 * unit_code(lu[k], p, 1));
            const __half2 m1031(__ushort_as_half(0x6407u), __ushort_as_half(0x6407u));
            const __half2 e = __hsub2(*reinterpret_cast<const __half2 *>(&h2), m1031);
            hp[P2] = *reinterpret_cast<const uint32_t *>(&e);
        }
    } else {
#pragma unroll
        for (int P2 = 0; P2 < NV / 2; P2++) { /* group j/16, coordinates 2i, 2i + 1 of it */
            const int g = (2 * P2) / 16, i = P2 % 8;
            const uint32_t h =
                code_h2(unit_code(row.u[g], 2 * i, 0), unit_code(row.u[g], 2 * i + 1, 0));
            const __half2 m1024(__ushort_as_half(0x6400u), __ushort_as_half(0x6400u));
            const __half2 c = __hsub2(*reinterpret_cast<const __half2 *>(&h), m1024);
            hp[P2] = *reinterpret_cast<const uint32_t *>(&c);
        }
    }
    float x[NV];
    hadamard_lane<D>(hp, hb, x);

    /* ---- the FP8 row: scale = amax/448 of the decoded row, codes fp8(x·(±448/max)) ---- */
    float r = 0.0f, scale = 1.0f;
    bool live;
    if constexpr (KIND == KV_KIND_K) {
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++)
            m = fmaxf(m, fabsf(x[j]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float g =
            __fmul_rn(__fmul_rn(half_bits_to_float(row.m0), KV_TQ3_KEY_HALF_STEP), 1.0f / D);
        const float amax = __fmul_rn(fabsf(g), m);
        live = fabsf(g) <= FLT_MAX && m != 0.0f && amax >= FLT_MIN;
        if (live) {
            r = __fdiv_rn(KV_FP8_MAX, m);
            r = g < 0.0f ? -r : r;
            scale = __fdiv_rn(amax, KV_FP8_MAX);
        }
    } else {
        const float sv = half_bits_to_float(row.m0), z = half_bits_to_float(row.m1);
        float mu = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            x[j] = j == 0 && q == 0 ? __fmaf_rn(sv, x[0], __fmul_rn(z, (float)D))
                                    : __fmul_rn(sv, x[j]);
            mu = fmaxf(mu, fabsf(x[j]));
        }
        mu = fmaxf(mu, __shfl_xor_sync(0xffffffffu, mu, 1));
        mu = fmaxf(mu, __shfl_xor_sync(0xffffffffu, mu, 2));
        const float amax = __fmul_rn(mu, (float)(1.0 / sqrt((double)D)));
        live = fabsf(sv) <= FLT_MAX && fabsf(z) <= FLT_MAX && amax >= FLT_MIN;
        if (live) {
            r = __fdiv_rn(KV_FP8_MAX, mu);
            scale = __fdiv_rn(amax, KV_FP8_MAX);
        }
    }
    if (w.rowok) {
        uint8_t *drow = dblk + (uint64_t)w.token * D + L * q;
#pragma unroll
        for (int i = 0; i < NV / 16; i++) { /* 16 coordinates j = 16i …: run 16i/L */
            const uint32_t at = 4 * L * (16 * i / L) + (16 * i) % L;
            const uint4 sg = *reinterpret_cast<const uint4 *>(
                reinterpret_cast<const uint8_t *>(s_sign) + L * q + at);
            const uint32_t sgw[4] = {sg.x, sg.y, sg.z, sg.w};
            uint32_t cw[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int j = 16 * i + 4 * k;
                const uint32_t lo = __nv_cvt_float2_to_fp8x2(
                    make_float2(__fmul_rn(x[j], r), __fmul_rn(x[j + 1], r)), __NV_SATFINITE,
                    __NV_E4M3);
                const uint32_t hi = __nv_cvt_float2_to_fp8x2(
                    make_float2(__fmul_rn(x[j + 2], r), __fmul_rn(x[j + 3], r)), __NV_SATFINITE,
                    __NV_E4M3);
                cw[k] = live ? ((lo & 0xffffu) | (hi << 16)) ^ sgw[k] : 0u;
            }
            *reinterpret_cast<uint4 *>(drow + at) = make_uint4(cw[0], cw[1], cw[2], cw[3]);
        }
        if (q == 0)
            reinterpret_cast<float *>(dblk + P.dmeta_k)[w.token] = scale; /* FP8: K = V */
    }
    zero_pads(P, w, kind, dpage, dblk);
}

template <int D>
__global__ void __launch_bounds__(kThreads, Rt<D>::MINB) promote_kernel(ConvParams P)
{
    __shared__ __align__(16) uint32_t s_sign[D / 4];
    WarpPlace w;
    uint32_t hb[2][2], q;
    if (!conv_warp<D>(P, s_sign, w, hb, q))
        return;
    pair_loop<Tq3Row<D>>(
        P, w,
        [&](Tq3Row<D> &r, auto kind, bool go, uint32_t sp) {
            r.template load<decltype(kind)::value>(P, w, go, sp, w.soff(P, kind), q);
        },
        [&](const Tq3Row<D> &r, auto kind, uint8_t *dpage) {
            promote_row<D, decltype(kind)::value>(P, w, q, s_sign, hb, r, dpage);
        });
}

/* Blocks of the retier (promote) kernel resident on the whole GPU: SM count × blocks per SM,
 * queried once per process (attributes only, no stream work, so a launch stays capturable;
 * with several devices the first one's count sizes every grid, which changes only the speed).
 * Atomic because launchers may be called from several threads; a racing first call computes
 * the same value twice. */
template <int D> int resident_blocks(bool retier)
{
    static std::atomic<int> cached[2]; /* per kernel instance; static storage: zero */
    const int c = cached[retier].load(std::memory_order_relaxed);
    if (c > 0)
        return c;
    int dev = 0, sms = 0, per = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess)
        e = retier ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, retier_kernel<D>,
                                                                   kThreads, 0)
                   : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, promote_kernel<D>,
                                                                   kThreads, 0);
    if (e != cudaSuccess) {
        /* a plain guess; only the grid size depends on it. The failed query must not stay
         * pending for the caller: if the device is really broken the launch says so. */
        (void)cudaGetLastError();
        return 1024;
    }
    const int v = sms * (per > 0 ? per : 1);
    cached[retier].store(v, std::memory_order_relaxed);
    return v;
}

/* The byte range of pool f, [base, base + pages · page_bytes), as integers; false when its end
 * does not fit in 64 bits (the kernels' page offsets would wrap). */
bool pool_range(const kv_geom_t *g, const kv_pools_t *pools, kv_fmt_t f, uint64_t *lo,
                uint64_t *hi)
{
    const uint64_t pb = kv_page_bytes(g, f), base = (uintptr_t)pools->base[f];
    if (pools->pages[f] > (UINT64_MAX - base) / pb)
        return false;
    *lo = base;
    *hi = base + pools->pages[f] * pb;
    return true;
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
    /* misaligned loads are sticky device errors (the caller's context is lost), not skipped
     * pairs: pools at their block alignment, page ids at theirs */
    if ((uintptr_t)pools->base[KV_FMT_FP8] % KV_BLOCK_ALIGN ||
        (uintptr_t)pools->base[KV_FMT_TQ3] % KV_BLOCK_ALIGN ||
        (uintptr_t)src % sizeof(uint32_t) || (uintptr_t)dst % sizeof(uint32_t))
        return KVK_EINVAL;
    /* Overlapping pools would let a destination page overlap a source page that another block
     * is still reading (the twin refuses src == dst): the one aliasing the host can see. An
     * empty pool (0 pages) overlaps nothing. */
    uint64_t lo8, hi8, lot, hit;
    if (!pool_range(g, pools, KV_FMT_FP8, &lo8, &hi8) ||
        !pool_range(g, pools, KV_FMT_TQ3, &lot, &hit) ||
        (lo8 < hi8 && lot < hit && lo8 < hit && lot < hi8))
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
    const uint32_t rpw = 8u; /* rows (tokens) per warp: a quad per token */
    P.cpb = (g->page_tokens + rpw - 1) / rpw;
    /* ⌊w/cpb⌋ for w < 2^31 (Granlund–Montgomery): l = ⌈log2 cpb⌉, m = ⌈2^(31+l)/cpb⌉ ≤ 2^31 */
    uint32_t l = 0;
    while ((1u << l) < P.cpb)
        l++;
    P.div_m = (uint32_t)(((1ull << (31 + l)) + P.cpb - 1) / P.cpb);
    P.div_sh = 31 + l;

    const uint32_t chunks = g->kv_heads * P.cpb; /* ≤ 256 · 1024 */
    /* y = layer: a warp does the K and the V rows of its tokens */
    const uint32_t gx = (chunks + kWarps - 1) / kWarps, gy = g->layers;
    /* one wave of resident blocks; each warp then loops over its pairs (a second wave would
     * only add a tail) */
    const uint64_t want = (uint64_t)(g->head_dim == 64    ? resident_blocks<64>(retier)
                                     : g->head_dim == 128 ? resident_blocks<128>(retier)
                                                          : resident_blocks<256>(retier));
    uint64_t gz = (want + (uint64_t)gx * gy - 1) / ((uint64_t)gx * gy);
    gz = gz < 1 ? 1 : gz > n ? n : gz > 65535 ? 65535 : gz;
    /* cudaLaunchKernelEx returns this launch's own error; cudaGetLastError after <<<>>> would
     * also report (and clear) an unrelated error the caller left pending, and a conversion
     * that did run would look failed to kvd (append.cu says more) */
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(gx, gy, (uint32_t)gz);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = st;
    cudaError_t e;
    switch (g->head_dim) {
    case 64:
        e = retier ? cudaLaunchKernelEx(&cfg, retier_kernel<64>, P)
                   : cudaLaunchKernelEx(&cfg, promote_kernel<64>, P);
        break;
    case 128:
        e = retier ? cudaLaunchKernelEx(&cfg, retier_kernel<128>, P)
                   : cudaLaunchKernelEx(&cfg, promote_kernel<128>, P);
        break;
    default:
        e = retier ? cudaLaunchKernelEx(&cfg, retier_kernel<256>, P)
                   : cudaLaunchKernelEx(&cfg, promote_kernel<256>, P);
        break;
    }
    if (e == cudaSuccess)
        return KVK_OK;
    (void)cudaGetLastError(); /* reported by the status: do not leave it for the caller */
    return KVK_EDEVICE;
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
