/* tq3.c — TQ3 rows: 3-bit rotated codes for keys (uniform grid + FP16 norm) and values (affine
 * + FP16 scale/zero). CPU twins of the retier/promote kernels' inner loops.
 *
 * A row's codes are one byte (0..7) per coordinate, codes[i] for coordinate i. Where they go
 * in a page block (units of 3 words, K: coordinate pairs of one token, V: one coordinate of a
 * token pair — kv_format.h, "TQ3 code units") is page.c's business, through kv_tq3_get/set:
 * this file never sees the storage, and the codes it computes do not depend on it. Decoders
 * read the low 3 bits of each code byte only (a caller's stray high bit cannot index past C).
 * Layout 1 (bit planes, before 2026-11-30) kept the codes as planes here; only that storage
 * changed, every evaluation order below is as it was (the GPU retier matches it bit for bit).
 *
 * ENCODING (retier v4, 2026-11-30; docs/formats.md "TQ3 encoder"). The encoders take the row
 * as x = s·r: the FP8 retier passes the row's decoded codes r (exact e4m3 values) and its
 * scale s, every other caller its vector and s = 1. All coordinate work happens on
 *   w = H·(sign ⊙ r)      (unnormalised Walsh–Hadamard transform: no 1/sqrt(d), no s)
 * so that y = R x = w · (s/sqrt(d)). The butterflies run over the coordinate bits 0, 1, Q, Q+1
 * first (Q = 4 at d = 64, else 5) and then the remaining bits in ascending order. The GPU does
 * the first four stages on the tensor cores: for FP8 inputs they are EXACT in float (sums of 16
 * values that are multiples of 2^-9 below 448 need 22 bits), so any order or hardware gives the
 * same bits there, and the later stages follow the order above.
 * Row sums (‖w‖², ⟨w, E⟩, Σw) are "quad sums" in the GPU's register order: quarter q ∈ 0..3
 * holds the coordinates (j mod L) + L·q + 4L·(j div L), j < d/4 (L = 16 at d = 64, else 32); a
 * quarter is the pairwise sum over j (leaves: j = 2i, 2i+1), the total (Q0 + Q1) + (Q2 + Q3).
 * A code is c = floor(t · KV_TQ3_FLOOR8) for t = sat(...) ∈ [0, 1] (sat: clamp, NaN → 0) —
 * the rule the GPU evaluates with one saturated FMA and one round-down FMA. A value exactly
 * on a boundary between two codes therefore takes the LOWER code (z = 0 → code 3 for keys).
 *
 * KEYS. The unit-variance coordinates are z = y·sqrt(d)/‖x‖ = w·sqrt(d)/‖w‖ (s cancels), and
 * the nearest uniform level (c − 3.5)·STEP is c = floor(z/STEP + 4): t = sat(w·a8 + 0.5) with
 * a8 = kv_tq3_key_a8(d) / sqrtf(‖w‖²). Decode: k̂ = γ · Rᵀ ĉ, ĉ_i = C[code_i]/sqrt(d); in float
 * t_i = C[code_i] · (γ·(1/sqrt(d))).
 *
 * Norm correction γ (FP16). Three candidates, with β = ⟨R k/‖k‖, ĉ⟩ (≤ ‖ĉ‖ by Cauchy):
 *   norm-preserving  γ = ‖k‖ / ‖ĉ‖            ‖k̂‖ = ‖k‖
 *   least squares    γ = ‖k‖ · β / ‖ĉ‖²        minimises ‖k − k̂‖²
 *   debiased         γ = ‖k‖ / β               for a query q isotropic around k, ĉ = β·ŷ + r with
 *                    r ⊥ ŷ, E[(Rq)·r | q·k] = 0, so E[q·k̂ | q·k] = γ·β·q·k/‖k‖ = q·k.
 * The shipped one is least squares (kvcodec's "gamma_study" measures all three on softmax
 * attention; docs/formats.md has the figures). With E_i = 2·code_i − 7 (odd, |E| ≤ 7) it is
 *   γ = ⟨y, ĉ⟩/‖ĉ‖² = s·⟨w, E⟩ / ((STEP/2)·ΣE²)
 * evaluated as (s·dot)/(KV_TQ3_KEY_HALF_STEP·ee): dot a quad sum (leaves fma(w1, E1, w0·E0)),
 * ee = ΣE² exact in integers. A zero or non-finite row (‖w‖² = 0, inf or NaN) or a zero or
 * non-finite s stores codes 0 and γ = 0: it decodes to zeros. γ saturates to ±65504.
 *
 * VALUES. On w: lo/hi = min/max (+0.0f added, so a zero extreme is +0 whatever the scan met),
 * sum = quad Σw, sq = quad Σw² (leaves fma(w1, w1, w0·w0)); mean = sum/d, var = max(sq/d −
 * mean², 0) (one fma). Grid choice: the rotated coordinates are close to Gaussian and the
 * min/max grid of d Gaussians spans ~4.9σ (d=64) to ~5.8σ (d=256): too coarse (NMSE 0.038 →
 * 0.055). The MSE-optimal uniform 8-level grid for N(μ,σ²) has step 0.5860σ (Max 1960; NMSE
 * 0.0374), clipping the tails; it is used whenever it is narrower than min/max, centred on the
 * mean. The grid (z0, s0), found in w units, is stored in x units, k = s·(float)(1/sqrt(d)):
 * zero = half(z0·k), scale = half(s0·k), and the codes come from the ROUNDED z = float(zero),
 * sv = float(scale) so that encode and decode agree on the grid: c = floor(t·FLOOR8) with
 * t = sat(w·a8 + b8), a8 = (k/sv)/8, b8 = fma(−z/sv, 1/8, 1/16) — i.e. round((y − z)/sv) with
 * halves down. sv == 0 (constant vector, or a range below FP16's smallest subnormal) gives
 * codes 0. A non-finite sq (inf/NaN input, or w overflowing) or s stores scale = zero = 0 and
 * codes 0. Decode: v̂ = Rᵀ(z + code·s) with z + code·s evaluated in float as (float)code·s + z
 * (a GPU fmaf differs by ≤ 1 ulp).
 *
 * Before retier v4 the encoders worked on x = s·r, rotated with rotate.c's order, searched the
 * key levels by comparisons, summed in index order (pairwise) in double and divided per value
 * (docs/perf.md "retier v4" says why that cost 39 instructions per value on the GPU). Pages
 * written by that encoder decode exactly as before; only new encodes differ, by rounding.
 */
#include "kvkern.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const float tq3_centroid[KV_TQ3_LEVELS] = KV_TQ3_CENTROIDS_INIT;

static uint16_t half_sat(float x)
{
    if (x > 65504.0f)
        x = 65504.0f;
    else if (x < -65504.0f)
        x = -65504.0f;
    return kv_half_from_float(x);
}

static int dim_ok(uint32_t d)
{
    return d >= 32 && d <= KV_MAX_HEAD_DIM && (d & (d - 1)) == 0;
}

static void codes_zero(uint32_t d, uint8_t *codes)
{
    memset(codes, 0, d);
}

/* Pairwise sum of t[0..n) (adjacent pairs first); t is overwritten, n a power of two. */
static float pairsum_f(float *t, uint32_t n)
{
    for (uint32_t h = 1; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += h << 1)
            t[i] = t[i] + t[i + h];
    return t[0];
}

/* The coordinate held at position j of quarter q (the GPU lane q of a token's quad). */
static uint32_t quad_coord(uint32_t d, uint32_t q, uint32_t j)
{
    uint32_t l = d == 64 ? 16u : 32u;
    return j % l + l * q + 4u * l * (j / l);
}

typedef enum { QUAD_SUM, QUAD_SQ, QUAD_DOT } quad_leaf_t;

/* Quad sum (header) of w (SUM), w² (SQ) or w·e (DOT). */
static float quad_sum(uint32_t d, const float *w, const float *e, quad_leaf_t leaf)
{
    float t[KV_MAX_HEAD_DIM / 8], part[4];
    uint32_t n = d / 8; /* leaves per quarter */
    for (uint32_t q = 0; q < 4; q++) {
        for (uint32_t i = 0; i < n; i++) {
            uint32_t a = quad_coord(d, q, 2 * i), b = quad_coord(d, q, 2 * i + 1);
            t[i] = leaf == QUAD_SUM  ? w[a] + w[b]
                   : leaf == QUAD_SQ ? fmaf(w[b], w[b], w[a] * w[a])
                                     : fmaf(w[b], e[b], w[a] * e[a]);
        }
        part[q] = pairsum_f(t, n);
    }
    return (part[0] + part[1]) + (part[2] + part[3]);
}

/* w = H·(sign ⊙ r), stages in the header's order. */
static void tq3_hadamard(uint64_t seed, uint32_t d, const float *r, float *w)
{
    uint32_t q = d == 64 ? 4u : 5u, order[8], n = 0;
    order[n++] = 0;
    order[n++] = 1;
    order[n++] = q;
    order[n++] = q + 1;
    for (uint32_t b = 2; (1u << b) < d; b++)
        if (b != q && b != q + 1)
            order[n++] = b;
    for (uint32_t i = 0; i < d; i++)
        w[i] = kv_rot_sign(seed, i) * r[i];
    for (uint32_t k = 0; k < n; k++) {
        uint32_t h = 1u << order[k];
        for (uint32_t i = 0; i < d; i++) {
            if (i & h)
                continue;
            float a = w[i], b = w[i | h];
            w[i] = a + b;
            w[i | h] = a - b;
        }
    }
}

/* clamp to [0, 1] with NaN → 0 (PTX fma.rn.sat) */
static float sat01(float t)
{
    return t > 0.0f ? (t < 1.0f ? t : 1.0f) : 0.0f;
}

/* floor(t · FLOOR8) for t ∈ [0, 1]: the product of two floats is exact in double. */
static uint32_t code_of(float t)
{
    return (uint32_t)floor((double)t * (double)KV_TQ3_FLOOR8);
}

void kv_tq3_encode_key_scaled(uint64_t seed, uint32_t d, const float *r, float s, uint8_t *codes,
                              uint16_t *norm)
{
    float w[KV_MAX_HEAD_DIM], e[KV_MAX_HEAD_DIM];
    if (!dim_ok(d))
        return;
    codes_zero(d, codes);
    *norm = 0;
    tq3_hadamard(seed, d, r, w);
    float nw2 = quad_sum(d, w, NULL, QUAD_SQ);
    if (!(nw2 > 0.0f) || !isfinite(nw2) || !isfinite(s) || s == 0.0f)
        return;
    float a8 = kv_tq3_key_a8(d) / sqrtf(nw2);
    uint32_t ee = 0;
    for (uint32_t i = 0; i < d; i++) {
        uint32_t c = code_of(sat01(fmaf(w[i], a8, 0.5f)));
        int32_t en = 2 * (int32_t)c - 7;
        codes[i] = (uint8_t)c;
        e[i] = (float)en;
        ee += (uint32_t)(en * en);
    }
    float dot = quad_sum(d, w, e, QUAD_DOT);
    *norm = half_sat((s * dot) / (KV_TQ3_KEY_HALF_STEP * (float)ee));
}

void kv_tq3_encode_key(uint64_t seed, uint32_t d, const float *k, uint8_t *codes, uint16_t *norm)
{
    kv_tq3_encode_key_scaled(seed, d, k, 1.0f, codes, norm);
}

void kv_tq3_decode_key(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t norm, float *k)
{
    if (!dim_ok(d))
        return;
    float g = kv_half_to_float(norm) * (float)(1.0 / sqrt((double)d));
    for (uint32_t i = 0; i < d; i++)
        k[i] = tq3_centroid[codes[i] & 7u] * g;
    kv_rot_inverse(seed, d, k, k);
}

void kv_tq3_encode_value_scaled(uint64_t seed, uint32_t d, const float *r, float s,
                                uint8_t *codes, uint16_t *scale, uint16_t *zero)
{
    float w[KV_MAX_HEAD_DIM];
    if (!dim_ok(d))
        return;
    codes_zero(d, codes);
    *scale = 0;
    *zero = 0;
    tq3_hadamard(seed, d, r, w);
    float sum = quad_sum(d, w, NULL, QUAD_SUM), sq = quad_sum(d, w, NULL, QUAD_SQ);
    if (!isfinite(sq) || !isfinite(s))
        return;
    float lo = w[0], hi = w[0];
    for (uint32_t i = 1; i < d; i++) {
        lo = w[i] < lo ? w[i] : lo;
        hi = w[i] > hi ? w[i] : hi;
    }
    lo = lo + 0.0f; /* −0 → +0: the extreme's value, not which zero the scan met first */
    hi = hi + 0.0f;
    float inv_d = 1.0f / (float)d; /* exact: d is a power of two */
    float mean = sum * inv_d;
    float var = fmaf(-mean, mean, sq * inv_d);
    var = var > 0.0f ? var : 0.0f;
    float step = KV_TQ3_VALUE_STEP_SIGMAS * sqrtf(var);
    float z0 = lo, s0 = (hi - lo) / 7.0f;
    if (step < s0) { /* the clipped MSE-optimal grid is narrower than min/max */
        z0 = mean - 3.5f * step;
        s0 = step;
    }
    float k = s * (float)(1.0 / sqrt((double)d));
    uint16_t zh = half_sat(z0 * k), sh = half_sat(s0 * k);
    *scale = sh;
    *zero = zh;
    float z = kv_half_to_float(zh), sv = kv_half_to_float(sh);
    if (sv == 0.0f)
        return;
    float a8 = (k / sv) * 0.125f, b8 = fmaf(-z / sv, 0.125f, 0.0625f);
    for (uint32_t i = 0; i < d; i++)
        codes[i] = (uint8_t)code_of(sat01(fmaf(w[i], a8, b8)));
}

void kv_tq3_encode_value(uint64_t seed, uint32_t d, const float *v, uint8_t *codes,
                         uint16_t *scale, uint16_t *zero)
{
    kv_tq3_encode_value_scaled(seed, d, v, 1.0f, codes, scale, zero);
}

void kv_tq3_decode_value(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t scale,
                         uint16_t zero, float *v)
{
    if (!dim_ok(d))
        return;
    float s = kv_half_to_float(scale), z = kv_half_to_float(zero);
    for (uint32_t i = 0; i < d; i++)
        v[i] = (float)(codes[i] & 7u) * s + z;
    kv_rot_inverse(seed, d, v, v);
}

/* ---- promote (TQ3 → FP8), the twin of convert.cu's promote kernel -------------------------
 * The decoded rows are k̂ = g·(sign ⊙ H·E) with E = 2c − 7, g = γ·(STEP/2)/d, and
 * v̂ = (sign ⊙ u)/sqrt(d) with u = sv·(H·c) + z·d·e_0 (H·1 = d·e_0). H·E and H·c are integers
 * below 7d, exact in any order (the GPU computes them on the tensor cores), so promote is
 * defined on them: with m = max|Y| (keys, Y = H·E) or mu = max|u| (values) the FP8 row gets
 * scale = RN(amax)/448 with amax = |g|·m resp. mu·(1/sqrt(d)), the FP8 row codec's scale,
 * and the codes fp8(Y_i·(±448/m)) resp. fp8(u_i·(±448/mu)) — the decoded value over the
 * scale, up to the rounding of 448/m. The sign is the rotation's sign (times γ's for keys):
 * fp8(−x) = fp8(x) ^ 0x80, so the GPU flips the code bytes. A row whose metadata is not finite,
 * or whose amax is zero or below FLT_MIN, promotes to the zero row (codes 0, scale 1, as the
 * FP8 codec stores a zero row). Before retier v4 promote was the FP8 codec applied to the
 * float decode (kv_tq3_decode_*); the two agree to the FP8 step (test_page). */
static void hadamard_int(uint32_t d, int32_t *y)
{
    for (uint32_t h = 1; h < d; h <<= 1)
        for (uint32_t i = 0; i < d; i++)
            if (!(i & h)) {
                int32_t a = y[i], b = y[i | h];
                y[i] = a + b;
                y[i | h] = a - b;
            }
}

static void fp8_zero_row(uint32_t d, uint8_t *fp8, float *scale)
{
    memset(fp8, 0, d);
    *scale = 1.0f;
}

static void fp8_signed_codes(uint64_t seed, uint32_t d, const float *x, float r, uint8_t *fp8)
{
    for (uint32_t i = 0; i < d; i++)
        fp8[i] = (uint8_t)(kv_fp8_from_float(x[i] * r) ^
                           (kv_rot_sign(seed, i) < 0.0f ? 0x80u : 0u));
}

void kv_tq3_key_to_fp8(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t norm,
                       uint8_t *fp8, float *scale)
{
    int32_t y[KV_MAX_HEAD_DIM];
    float x[KV_MAX_HEAD_DIM];
    if (!dim_ok(d))
        return;
    int32_t m = 0;
    for (uint32_t i = 0; i < d; i++)
        y[i] = 2 * (int32_t)(codes[i] & 7u) - 7;
    hadamard_int(d, y);
    for (uint32_t i = 0; i < d; i++) {
        m = abs(y[i]) > m ? abs(y[i]) : m;
        x[i] = (float)y[i];
    }
    float g = (kv_half_to_float(norm) * KV_TQ3_KEY_HALF_STEP) * (1.0f / (float)d);
    float amax = fabsf(g) * (float)m;
    if (!isfinite(g) || m == 0 || !(amax >= FLT_MIN)) {
        fp8_zero_row(d, fp8, scale);
        return;
    }
    float r = KV_FP8_MAX / (float)m;
    fp8_signed_codes(seed, d, x, g < 0.0f ? -r : r, fp8);
    *scale = amax / KV_FP8_MAX;
}

void kv_tq3_value_to_fp8(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t scale,
                         uint16_t zero, uint8_t *fp8, float *fscale)
{
    int32_t y[KV_MAX_HEAD_DIM];
    float u[KV_MAX_HEAD_DIM];
    if (!dim_ok(d))
        return;
    for (uint32_t i = 0; i < d; i++)
        y[i] = (int32_t)(codes[i] & 7u);
    hadamard_int(d, y);
    float sv = kv_half_to_float(scale), z = kv_half_to_float(zero), mu = 0.0f;
    for (uint32_t i = 0; i < d; i++) {
        u[i] = i == 0 ? fmaf(sv, (float)y[0], z * (float)d) : sv * (float)y[i];
        mu = fabsf(u[i]) > mu ? fabsf(u[i]) : mu;
    }
    float amax = mu * (float)(1.0 / sqrt((double)d));
    if (!isfinite(sv) || !isfinite(z) || !(amax >= FLT_MIN)) {
        fp8_zero_row(d, fp8, fscale);
        return;
    }
    fp8_signed_codes(seed, d, u, KV_FP8_MAX / mu, fp8);
    *fscale = amax / KV_FP8_MAX;
}
