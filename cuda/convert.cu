/* convert.cu — batched whole-page format changes: retier FP8 → TQ3 and promote TQ3 → FP8
 * (twins of kv_page_retier / kv_page_promote in page.c, row codecs of fp8.c and tq3.c).
 *
 *   FP8 row ──decode──► x[d] ──R (FWHT)──► y ──► TQ3 codes + FP16 γ | scale, zero   (retier)
 *   TQ3 row ──decode──► ŷ ──Rᵀ (FWHT)──► x̂ ──► FP8 codes + f32 scale                (promote)
 *
 * Work split (retier v2, docs/perf.md). A row is one (pair, layer, kind, head, token) and is
 * handled by d/32 consecutive lanes, lane q owning coordinates 32q … 32q+31 — exactly one TQ3
 * group, so its K unit (TQ3 layout 2, kv_format.h) is lane-local. A V unit holds 16
 * coordinates of a token PAIR: the two lanes of a pair (lane and lane ^ d/32, same q) exchange
 * their packed codes with three shuffles and each writes one of the two V units covering
 * their 32 coordinates (chunks hold an even number of tokens and start at an even one, so the
 * partner is always in the warp; with an odd page_tokens the last token's partner is past the
 * end and contributes zero codes). A warp owns a CHUNK of 32/(d/32) consecutive tokens
 * of one head; a task is the chunk's K rows or its V rows of one pair, so every branch on the
 * kind is warp-uniform and a K row never pays for the value grid nor a V row for the key grid
 * search. Retier grid: x = chunks (4 warps per block), y = layer, z = a slice of the pairs; each
 * warp runs the tasks (pair z, K), (z, V), (z + gridDim.z, K), … — K and V alternate so that
 * every warp does the same mix (K rows cost ~10% more) — and loads the next task's row before
 * computing the current one. One wave of blocks; block offsets, sign masks and constants are
 * set up once per warp. Promote: y = layer·2 + kind, one kind per warp, no prefetch.
 * Cost (ncu, d = 128): ~1260 warp instructions per task of 8 rows (≈ 39 per value), issue-bound
 * at IPC 3.0 with 19 warps per SM; docs/perf.md has the breakdown.
 *
 * Bit-exactness with the CPU twin (tq3.c, rotate.c, fp8.c spell out their evaluation order):
 *   - rotation signs: the twin multiplies x_i by ±1 (exact); here the sign is XORed into the
 *     FP8 code's sign bit before decoding, which gives the same float (−(f·s) = (−f)·s under
 *     round-to-nearest, ±0 included). The per-coordinate signs (splitmix64) are computed once
 *     per block into shared memory — in v1 they were recomputed per element and cost ~25% of
 *     the instructions;
 *   - the Walsh–Hadamard butterflies run in the twin's stage order h = 1, 2, …, d/2; the stages
 *     h ≥ 32 exchange values between the row's lanes with shuffles; the lower lane's a + b and
 *     the upper lane's a − b are one FFMA each (fma(±1, own, other): one rounding, same bits);
 *   - every scalar step uses the twin's operation with explicit round-to-nearest intrinsics
 *     (__fmul_rn, __fadd_rn, …): nvcc would otherwise contract a·b+c into an FMA;
 *   - every row sum (‖k‖², ⟨z, C⟩, ‖C‖² in double; Σy, Σ(y−mean)² in float) is tq3.c's
 *     pairwise sum: each lane builds the sub-tree of its 32 coordinates, the row's lanes add
 *     their partials with xor-shuffles m = 1, 2, 4. The double terms are exact products, so a
 *     leaf k0² + k1² is one DFMA. Metadata is therefore identical, not just within an ulp;
 *   - value min/max are order-free (the twin makes a zero extreme +0);
 *   - (y − zero)/scale: IEEE division by Markstein's correction with the correctly rounded
 *     reciprocal of the row's scale: t = u·r, e = fma(−t, s, u), q = fma(e, r, t) is RN(u/s)
 *     when nothing over- or underflows (scale is an FP16 ≥ 2^-24 and |u/s| stays ≲ 100 here;
 *     a tiny u only moves a quotient that rounds to code 0 anyway). Checked against IEEE
 *     division on 3.3e8 random pairs, quotients near k + ½ included, on the CPU. It runs on
 *     t/8 and r/8 (exact power-of-two scaling) so that the last fma's saturation (fma.rn.sat)
 *     clamps q to [0, 8]; one fminf makes it [0, 7];
 *   - value codes: rint(clamp(q, 0, 7)) by adding 1.5·2^23 (round half to even, as rintf);
 *     the twin clamps after rint, which gives the same code for every q;
 *   - K: code by a 3-compare binary search on the float midpoints (≥, NaN → 0, as tq3.c), C and
 *     C² (double, exact) from a shared-memory table; ÷D of sums is ×(1/D) (D a power of two:
 *     the same correctly rounded value);
 *   - codes go straight to their unit positions with one shift-add each (unit_add); the V
 *     rint's magic constant rides along and is subtracted once per word.
 * Promote: decode (K: the lane's unit; V: the token's half of two units), inverse rotation
 * (signs multiplied as in rotate.c) and the FP8 row codec, all order-fixed; x/s uses the same
 * Markstein step when the scale is ≥ 2^-100 (IEEE division otherwise, and for non-finite x).
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

/* Pairwise sums (tq3.c), streamed: leaves are pushed in index order and combined like a binary
 * counter (left + right at each level), so at most five partials are live instead of sixteen.
 * finish() adds the row's lanes (xor 1, 2, 4: the upper levels of the same tree). */
template <typename T> struct PairSum {
    T lv[5];
    __device__ __forceinline__ static T add(T a, T b);
    template <int I> __device__ __forceinline__ void push(T v)
    {
#pragma unroll
        for (int l = 0; l < 5; l++) {
            if ((I >> l) & 1) {
                v = add(lv[l], v);
            } else {
                lv[l] = v;
                return;
            }
        }
        lv[4] = v; /* I = 15 ends here with the lane's total of 16 leaves */
    }
    template <int LPR> __device__ __forceinline__ T finish()
    {
        T v = lv[4];
#pragma unroll
        for (int m = 1; m < LPR; m <<= 1)
            v = add(v, __shfl_xor_sync(0xffffffffu, v, m));
        return v;
    }
};
template <> __device__ __forceinline__ double PairSum<double>::add(double a, double b)
{
    return __dadd_rn(a, b);
}
template <> __device__ __forceinline__ float PairSum<float>::add(float a, float b)
{
    return __fadd_rn(a, b);
}

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

/* V unit word b from this lane's packed words (own) and its pair partner's (other): the lane
 * of the even token writes the unit of coordinates 32q … 32q+15 (set 0 of both tokens), the
 * lane of the odd token the unit of 32q+16 … 32q+31 (set 1); low half = the even token. */
__host__ __device__ __forceinline__ uint32_t v_unit_word(uint32_t own, uint32_t other, bool odd)
{
#if defined(__CUDA_ARCH__)
    return __byte_perm(own, other, odd ? 0x3276u : 0x5410u);
#else
    return odd ? (other >> 16) | (own & 0xffff0000u) : (own & 0xffffu) | (other << 16);
#endif
}

/* RN(a·b + c) clamped to [0, 1] (NaN → 0): PTX fma.rn.sat, one FFMA.SAT. */
__device__ __forceinline__ float fma_sat(float a, float b, float c)
{
    float r;
    asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

/* Key code #{ j : z ≥ b_j } by binary search on the ascending b (NaN → 0, ties up). */
__device__ __forceinline__ uint32_t lm_code(float z, const float (&b)[KV_TQ3_LEVELS - 1])
{
    const bool p2 = z >= b[3];
    const bool p1 = z >= (p2 ? b[5] : b[1]);
    const float bu = p2 ? b[6] : b[2], bl = p2 ? b[4] : b[0];
    const bool p0 = z >= (p1 ? bu : bl);
    return (p2 ? 4u : 0u) | (p1 ? 2u : 0u) | (p0 ? 1u : 0u);
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
    uint32_t vunit;       /* retier: the V unit this lane writes (see the kernel) */
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

template <int D>
__device__ __forceinline__ WarpPlace warp_place(const ConvParams &P, uint32_t wi, uint32_t layer)
{
    constexpr uint32_t LPR = D / 32, RPW = 32 / LPR;
    WarpPlace w;
    w.head = (uint32_t)(((uint64_t)wi * P.div_m) >> P.div_sh);
    const uint32_t tc = wi - w.head * P.cpb;
    const uint32_t raw = tc * RPW + (threadIdx.x & 31u) / LPR;
    /* RPW is even, so a chunk holds whole token pairs and the partner of token raw is in
     * lane ^ LPR; with an odd page_tokens the last pair's second token is past the end */
    w.token = raw;
    w.odd = raw & 1u;
    w.pairok = (raw & ~1u) < P.tokens;
    w.vunit = (raw >> 1) * (2 * LPR) + 2 * (threadIdx.x % LPR) + w.odd;
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

/* One FP8 row of task t (pair blockIdx.z + (t/2)·gridDim.z, kind t%2): this lane's 32 codes
 * and the row's scale, or ok = false when the pair is past the batch or outside its pool. */
template <int D> struct FetchFp8 {
    uint32_t cw[8];
    float s;
    uint32_t dp, kind;
    bool ok;
    __device__ __forceinline__ void load(const ConvParams &P, const WarpPlace &w, uint32_t q,
                                         uint64_t t)
    {
        const uint64_t pair64 = blockIdx.z + (t >> 1) * gridDim.z; /* 64-bit: no wrap */
        kind = (uint32_t)(t & 1u);
        ok = false;
        s = 0.0f;
        dp = 0;
#pragma unroll
        for (int i = 0; i < 8; i++)
            cw[i] = 0;
        if (pair64 >= P.n)
            return;
        const uint32_t sp = __ldg(P.src + pair64);
        dp = __ldg(P.dst + pair64);
        if (sp >= P.spages || dp >= P.dpages)
            return;
        ok = true;
        if (!w.rowok)
            return;
        const uint8_t *sblk = P.sbase + (uint64_t)sp * P.spage + w.soff(P, kind);
        const uint4 *c4 = reinterpret_cast<const uint4 *>(sblk + (uint64_t)w.token * D + 32 * q);
        const uint4 a = __ldg(c4), b = __ldg(c4 + 1);
        cw[0] = a.x, cw[1] = a.y, cw[2] = a.z, cw[3] = a.w;
        cw[4] = b.x, cw[5] = b.y, cw[6] = b.z, cw[7] = b.w;
        s = __ldg(reinterpret_cast<const float *>(sblk + P.smeta_k) + w.token); /* FP8: K = V */
    }
};

template <int D> __global__ void __launch_bounds__(kThreads, 6) retier_kernel(ConvParams P)
{
    constexpr int LPR = D / 32;
    __shared__ __align__(16) uint32_t s_sign[D / 4];
    __shared__ double2 s_cd[KV_TQ3_LEVELS]; /* {C, C²} in double (C² exact) */
    signs_to_smem<D>(s_sign, P.seed);
    if (threadIdx.x < KV_TQ3_LEVELS) {
        const double c = (double)c_centroid[threadIdx.x];
        s_cd[threadIdx.x] = make_double2(c, c * c);
    }
    __syncthreads();

    const uint32_t wi = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (wi >= P.heads * P.cpb)
        return; /* whole warp */
    const uint32_t q = threadIdx.x % LPR;
    const WarpPlace w = warp_place<D>(P, wi, blockIdx.y);
    /* this lane's sign masks, re-read per task (two 16-byte LDS) to keep 8 registers free */
    const uint4 *sg4 = reinterpret_cast<const uint4 *>(s_sign) + 2 * q;
    float bnd[KV_TQ3_LEVELS - 1];
#pragma unroll
    for (int j = 0; j < KV_TQ3_LEVELS - 1; j++)
        bnd[j] = __fmul_rn(0.5f, __fadd_rn(c_centroid[j], c_centroid[j + 1]));
    const float inv = (float)(1.0 / sqrt((double)D));
    const float sqd = __fsqrt_rn((float)D);

    /* Tasks alternate K and V rows of the same chunk, pair after pair, so every warp does the
     * same mix of work (K rows cost ~10% more; a warp of one kind would finish early and leave
     * a tail). Software pipeline: the next task's row is loaded before this one is computed,
     * so the load latency hides behind ~1000 instructions. */
    /* pairs of this slice (64-bit so that n close to 2^32 cannot wrap) */
    const uint64_t per =
        P.n > blockIdx.z ? ((uint64_t)P.n - blockIdx.z + gridDim.z - 1) / gridDim.z : 0;
    FetchFp8<D> cur, nxt;
    cur.load(P, w, q, 0);
    for (uint64_t t = 0; t < 2 * per; t++) {
        nxt.load(P, w, q, t + 1);
        if (!cur.ok) { /* pair outside its pool: skipped by the whole warp */
            cur = nxt;
            continue;
        }
        const uint32_t kind = cur.kind;
        uint8_t *dpage = P.dbase + (uint64_t)cur.dp * P.dpage;
        uint8_t *dblk = dpage + w.doff(P, kind);
        const float s = cur.s;
        uint32_t cw[8];
#pragma unroll
        for (int i = 0; i < 8; i++)
            cw[i] = cur.cw[i];
        cur = nxt;

        /* ---- rotation signs, decode: x = ±fp8 · scale ---- */
        const uint4 ga = sg4[0], gb = sg4[1];
        const uint32_t sg[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
        float x[32];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t v = cw[i] ^ sg[i];
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                    (__nv_fp8x2_storage_t)((v >> (16 * hh)) & 0xffffu), __NV_E4M3);
                const float2 f = __half22float2(__half2(hr));
                x[4 * i + 2 * hh] = __fmul_rn(f.x, s);
                x[4 * i + 2 * hh + 1] = __fmul_rn(f.y, s);
            }
        }

        /* ---- ‖x‖² (K only; squares of ±x are the same) ---- */
        double ss = 0.0;
        if (kind == KV_KIND_K) {
            PairSum<double> t;
            Unroll<0, 16>::run([&](auto I) {
                const double a = (double)x[2 * I], b = (double)x[2 * I + 1];
                t.push<I>(__fma_rn(b, b, __dmul_rn(a, a)));
            });
            ss = t.finish<LPR>();
        }

        /* ---- y = R x ---- */
        fwht_row<LPR>(x, q);
#pragma unroll
        for (int j = 0; j < 32; j++)
            x[j] = __fmul_rn(x[j], inv);

        uint32_t pk[3] = {0u, 0u, 0u};
        if (kind == KV_KIND_K) {
            const float nrm = __double2float_rn(__dsqrt_rn(ss));
            const bool live = nrm > 0.0f && nrm <= FLT_MAX;
            const float sc = __fdiv_rn(sqd, nrm);
            PairSum<double> td, tc;
            Unroll<0, 16>::run([&](auto I) {
                constexpr int i = I;
                const float z0 = __fmul_rn(x[2 * i], sc), z1 = __fmul_rn(x[2 * i + 1], sc);
                const uint32_t c0 = lm_code(z0, bnd), c1 = lm_code(z1, bnd);
                if (i < 15) { /* pair i = coordinates 2i (set 0), 2i + 1 (set 1) */
                    unit_add(pk, i, 0, c0);
                    unit_add(pk, i, 1, c1);
                } else {
                    unit_add15(pk, c0, c1);
                }
                const double2 k0 = s_cd[c0], k1 = s_cd[c1];
                td.push<i>(__fma_rn((double)z1, k1.x, __dmul_rn((double)z0, k0.x)));
                tc.push<i>(__dadd_rn(k0.y, k1.y));
            });
            const double dot = td.finish<LPR>(), cc = tc.finish<LPR>();
            uint16_t nb = 0;
            if (live) {
                /* ÷D: D is a power of two, so ×(1/D) is the same correctly rounded value */
                const double beta = __dmul_rn(dot, 1.0 / D), c2 = __dmul_rn(cc, 1.0 / D);
                nb = half_sat_bits(__double2float_rn(__ddiv_rn(__dmul_rn((double)nrm, beta), c2)));
            } else {
#pragma unroll
                for (int b = 0; b < 3; b++)
                    pk[b] = 0;
            }
            if (w.rowok && q == 0)
                reinterpret_cast<uint16_t *>(dblk + P.dmeta_k)[w.token] = nb;
        } else {
            float lo = x[0], hi = x[0];
#pragma unroll
            for (int j = 0; j < 32; j++) {
                lo = fminf(lo, x[j]);
                hi = fmaxf(hi, x[j]);
            }
            PairSum<float> ts;
            Unroll<0, 16>::run([&](auto I) { ts.push<I>(__fadd_rn(x[2 * I], x[2 * I + 1])); });
            const float sum = ts.finish<LPR>();
            /* a non-finite y makes the sum non-finite; the exact test runs only then */
            uint32_t bad = 0;
            if (!isfinite(sum)) {
#pragma unroll
                for (int j = 0; j < 32; j++)
                    bad |= isfinite(x[j]) ? 0u : 1u;
            }
            bad = row_or<LPR>(bad);
            lo = __fadd_rn(row_min<LPR>(lo), 0.0f); /* zero extremes are +0 (tq3.c) */
            hi = __fadd_rn(row_max<LPR>(hi), 0.0f);
            const float mean = __fmul_rn(sum, 1.0f / D); /* = sum/D exactly: D = 2^k */
            PairSum<float> tv;
            Unroll<0, 16>::run([&](auto I) {
                const float e0 = __fsub_rn(x[2 * I], mean), e1 = __fsub_rn(x[2 * I + 1], mean);
                tv.push<I>(__fadd_rn(__fmul_rn(e0, e0), __fmul_rn(e1, e1)));
            });
            const float var = tv.finish<LPR>();
            uint16_t zh = 0, sh = 0;
            uint32_t c15[2];
            if (!bad) {
                const float step =
                    __fmul_rn(KV_TQ3_VALUE_STEP_SIGMAS, __fsqrt_rn(__fmul_rn(var, 1.0f / D)));
                float z0 = lo, s0 = __fdiv_rn(__fsub_rn(hi, lo), 7.0f);
                if (step < s0) { /* the clipped MSE-optimal grid is narrower than min/max */
                    z0 = __fsub_rn(mean, __fmul_rn(3.5f, step));
                    s0 = step;
                }
                zh = half_sat_bits(z0);
                sh = half_sat_bits(s0);
                const float zz = half_bits_to_float(zh), sv = half_bits_to_float(sh);
                if (sv > 0.0f) {
                    /* everything ÷8 (exact) so that the fma's saturation clamps q to [0, 8] */
                    const float rs8 = __fmul_rn(__frcp_rn(sv), 0.125f), s8 = __fmul_rn(sv, 8.0f);
#pragma unroll
                    for (int j = 0; j < 32; j++) {
                        const float u = __fsub_rn(x[j], zz);
                        const float t8 = __fmul_rn(u, rs8);
                        const float q8 = fminf(fma_sat(__fmaf_rn(-t8, s8, u), rs8, t8), 0.875f);
                        /* 1.5·2^23 + k has k in its low bits: rint, half to even */
                        const uint32_t qm = __float_as_uint(__fmaf_rn(q8, 8.0f, 12582912.0f));
                        if ((j & 15) < 15) /* pair j%16 of set j/16 */
                            unit_add(pk, j & 15, j >> 4, qm);
                        else
                            c15[j >> 4] = qm; /* low bits: the code (0x4B400000 has none) */
                    }
                    /* remove the constant 0x4B400000 that every add carried along */
#pragma unroll
                    for (int b = 0; b < 3; b++)
                        pk[b] -= unit_magic();
                    unit_add15(pk, c15[0], c15[1]);
                }
            }
            if (w.rowok && q == 0) {
                uint16_t *m = reinterpret_cast<uint16_t *>(dblk + P.dmeta_v);
                m[w.token] = sh;
                m[P.tokens + w.token] = zh;
            }
        }
        /* a token past the page end (the partner of an odd page's last token) has codes 0 */
        if (!w.rowok) {
#pragma unroll
            for (int b = 0; b < 3; b++)
                pk[b] = 0;
        }
        uint64_t unit = (uint64_t)w.token * LPR + q; /* K: unit (token, q) */
        bool store = w.rowok;
        if (kind == KV_KIND_V) { /* warp-uniform: every lane takes part in the shuffles */
#pragma unroll
            for (int b = 0; b < 3; b++)
                pk[b] = v_unit_word(pk[b], __shfl_xor_sync(0xffffffffu, pk[b], LPR), w.odd);
            unit = w.vunit;
            store = w.pairok;
        }
        if (store) {
            uint32_t *wp = reinterpret_cast<uint32_t *>(dblk) + unit * 3;
            wp[0] = pk[0];
            wp[1] = pk[1];
            wp[2] = pk[2];
        }
        zero_pads(P, w, kind, dpage, dblk);
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
    const WarpPlace w = warp_place<D>(P, wi, blockIdx.y >> 1);
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
int resident_blocks(bool retier)
{
    static int cached[2] = {0, 0};
    if (cached[retier] > 0)
        return cached[retier];
    int dev = 0, sms = 0, per = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 1024; /* a plain guess; only the grid size depends on it */
    const cudaError_t e =
        retier
            ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, retier_kernel<128>, kThreads, 0)
            : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, promote_kernel<128>, kThreads, 0);
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
    const uint32_t rpw = 32u / (g->head_dim / 32u); /* rows (tokens) per warp */
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
    const uint64_t want = (uint64_t)resident_blocks(retier);
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
