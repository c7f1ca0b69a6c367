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
 * KEYS. y = R k, n = ‖k‖ (accumulated in double, rounded to float), z_i = y_i · (sqrt(d)/n)
 * (float: sc = sqrtf(d)/n, z_i = y_i·sc), i.e. the i-th coordinate of R(k/‖k‖) scaled to unit
 * variance. code_i = #{ j ∈ 0..6 : z_i ≥ b_j } with b_j = 0.5f·(C_j + C_{j+1}) in float,
 * C = KV_TQ3_CENTROIDS_INIT = KV_TQ3_KEY_STEP·(i − 3.5), the uniform grid of layout 2 (it was
 * Lloyd–Max in layout 1; the rule is unchanged, only C changed). So boundaries are the float
 * midpoints and a value exactly on a boundary takes the UPPER code (z = 0 → code 4). The GPU
 * must use the same comparison (≥).
 * Decode: k̂ = γ · Rᵀ ĉ, ĉ_i = C[code_i]/sqrt(d); in float t_i = C[code_i] · (γ·(1/sqrt(d))).
 *
 * Norm correction γ (FP16). Three candidates, with β = ⟨R k/‖k‖, ĉ⟩ (≤ ‖ĉ‖ by Cauchy):
 *   norm-preserving  γ = ‖k‖ / ‖ĉ‖            ‖k̂‖ = ‖k‖
 *   least squares    γ = ‖k‖ · β / ‖ĉ‖²        minimises ‖k − k̂‖²
 *   debiased         γ = ‖k‖ / β               for a query q isotropic around k, ĉ = β·ŷ + r with
 *                    r ⊥ ŷ, E[(Rq)·r | q·k] = 0, so E[q·k̂ | q·k] = γ·β·q·k/‖k‖ = q·k.
 * TQ3_GAMMA below picks the shipped one; kvcodec's "gamma_study" section measures all three on
 * softmax attention (docs/formats.md has the figures and the reason for the choice).
 * A zero or non-finite key (n = 0, inf or NaN) stores codes 0 and γ = 0: it decodes to zeros.
 * γ above the FP16 range saturates to 65504 (an FP8-decoded key is far below that).
 *
 * SUMMATION ORDER (fixed, so that the GPU kernel in convert.cu can match it bit for bit with
 * its lanes working in parallel): every sum over the d coordinates of a row — ‖k‖², ⟨z, C⟩ and
 * ‖C‖² in double, the value grid's Σy and Σ(y−mean)² in float — is the recursive PAIRWISE sum
 *   S(v[0..n)) = S(v[0..n/2)) + S(v[n/2..n)),  S(v[i..i+1)) = v[i],
 * i.e. adjacent pairs first, then pairs of pairs (pairsum_* below). The GPU lane that owns
 * coordinates 32q … 32q+31 computes the sub-tree of its 32 values and the lanes of the row add
 * their partials with xor-shuffles m = 1, 2, 4 (IEEE addition is commutative, so both lanes of
 * a pair get the same bits). The double terms (k_i², z_i·C, C²) are exact products of floats, so
 * a fused multiply-add at a leaf gives the same bits as a separate multiply and add.
 * Before 2026-11-30 (retier v2) the sums ran in index order; the GPU then had to hand a running
 * sum from lane to lane, which serialised the row (docs/perf.md, "retier v2").
 *
 * VALUES. y = R v; zero = half(min y), scale = half((max y − min y)/7.0f) — rounded to FP16
 * FIRST, and the codes computed from the rounded z = float(zero), s = float(scale):
 *   code_i = clamp(rintf((y_i − z)/s), 0, 7)   (IEEE division; rintf = round half to even)
 * so encode and decode agree on the grid. s == 0 (constant vector, or a range below FP16's
 * smallest subnormal) gives codes 0. FP16 overflow saturates to ±65504. A non-finite y
 * (inf/NaN input) stores scale = zero = 0 and codes 0. min y and max y get +0.0f added, so
 * a zero extreme is always +0 (its sign would otherwise depend on which of −0/+0 the scan
 * met first, an order the GPU cannot follow cheaply). Decode: v̂ = Rᵀ(z + code·s) with
 * z + code·s evaluated in float as (float)code·s + z (a GPU fmaf differs by ≤ 1 ulp).
 */
#include "kvkern.h"

#include <math.h>
#include <string.h>

/* Macros, not an enum: they are compared in #if. */
#define TQ3_GAMMA_NORM   0
#define TQ3_GAMMA_LSQ    1
#define TQ3_GAMMA_DEBIAS 2
#define TQ3_GAMMA        TQ3_GAMMA_LSQ

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

/* Pairwise sums in the order the header describes; t is overwritten, n a power of two. */
static double pairsum_d(double *t, uint32_t n)
{
    for (uint32_t h = 1; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += h << 1)
            t[i] = t[i] + t[i + h];
    return t[0];
}

static float pairsum_f(float *t, uint32_t n)
{
    for (uint32_t h = 1; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += h << 1)
            t[i] = t[i] + t[i + h];
    return t[0];
}

void kv_tq3_encode_key(uint64_t seed, uint32_t d, const float *k, uint8_t *codes, uint16_t *norm)
{
    float y[KV_MAX_HEAD_DIM];
    double t[KV_MAX_HEAD_DIM], u[KV_MAX_HEAD_DIM];
    if (!dim_ok(d))
        return;
    codes_zero(d, codes);
    *norm = 0;

    for (uint32_t i = 0; i < d; i++)
        t[i] = (double)k[i] * k[i]; /* exact: a float squared fits a double */
    double ss = pairsum_d(t, d);
    float n = (float)sqrt(ss);
    if (!(n > 0.0f) || !isfinite(n))
        return;

    float b[KV_TQ3_LEVELS - 1];
    for (int j = 0; j < KV_TQ3_LEVELS - 1; j++)
        b[j] = 0.5f * (tq3_centroid[j] + tq3_centroid[j + 1]);

    kv_rot_forward(seed, d, k, y);
    float sc = sqrtf((float)d) / n;
    /* ⟨z, C[code]⟩ and ‖C[code]‖², both in unit-variance units; the terms are exact */
    for (uint32_t i = 0; i < d; i++) {
        float z = y[i] * sc;
        uint32_t c = 0;
        for (int j = 0; j < KV_TQ3_LEVELS - 1; j++)
            c += z >= b[j];
        codes[i] = (uint8_t)c;
        t[i] = (double)z * tq3_centroid[c];
        u[i] = (double)tq3_centroid[c] * tq3_centroid[c];
    }
    double dot = pairsum_d(t, d), cc = pairsum_d(u, d);
    /* In ĉ units (÷ sqrt(d) each side): β = dot/d, ‖ĉ‖² = cc/d. */
    double beta = dot / d, c2 = cc / d, g;
#if TQ3_GAMMA == TQ3_GAMMA_NORM
    (void)beta;
    g = n / sqrt(c2);
#elif TQ3_GAMMA == TQ3_GAMMA_LSQ
    g = n * beta / c2;
#else
    g = beta > 0.0 ? n / beta : 0.0;
#endif
    *norm = half_sat((float)g);
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

void kv_tq3_encode_value(uint64_t seed, uint32_t d, const float *v, uint8_t *codes,
                         uint16_t *scale, uint16_t *zero)
{
    float y[KV_MAX_HEAD_DIM], t[KV_MAX_HEAD_DIM];
    if (!dim_ok(d))
        return;
    codes_zero(d, codes);
    *scale = 0;
    *zero = 0;

    kv_rot_forward(seed, d, v, y);
    float lo = y[0], hi = y[0];
    for (uint32_t i = 0; i < d; i++) {
        if (!isfinite(y[i]))
            return;
        lo = y[i] < lo ? y[i] : lo;
        hi = y[i] > hi ? y[i] : hi;
        t[i] = y[i];
    }
    lo = lo + 0.0f; /* −0 → +0: the extreme's value, not which zero the scan met first */
    hi = hi + 0.0f;
    float sum = pairsum_f(t, d);
    /* Grid choice. The rotated coordinates are close to Gaussian, and the min/max grid of d
     * Gaussians spans ~4.9σ (d=64) to ~5.8σ (d=256): too coarse (NMSE 0.038 → 0.055). The
     * MSE-optimal uniform 8-level grid for N(μ,σ²) has step 0.5860σ (Max 1960; NMSE 0.0374),
     * clipping the tails. Use it whenever it is narrower than min/max, centred on the mean;
     * sums are pairwise in float (header), the order the GPU kernel follows too. */
    float mean = sum / (float)d;
    for (uint32_t i = 0; i < d; i++) {
        float e = y[i] - mean;
        t[i] = e * e;
    }
    float var = pairsum_f(t, d);
    float step = KV_TQ3_VALUE_STEP_SIGMAS * sqrtf(var / (float)d);
    float z0 = lo, s0 = (hi - lo) / 7.0f;
    if (step < s0) {
        z0 = mean - 3.5f * step;
        s0 = step;
    }
    uint16_t zh = half_sat(z0), sh = half_sat(s0);
    float z = kv_half_to_float(zh), s = kv_half_to_float(sh);
    *scale = sh;
    *zero = zh;
    if (!(s > 0.0f))
        return;
    for (uint32_t i = 0; i < d; i++) {
        float q = rintf((y[i] - z) / s);
        uint32_t c = q >= 7.0f ? 7u : q > 0.0f ? (uint32_t)q : 0u;
        codes[i] = (uint8_t)c;
    }
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
