/* rotate.c — the TQ3 random rotation R = H·diag(s)/sqrt(d) (CPU twin).
 *
 * H is the d×d Sylvester–Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), so
 * H[i][j] = (-1)^popcount(i & j); s_i = kv_rot_sign(seed, i) from kv_format.h. R is orthonormal
 * and Rᵀ = diag(s)·H/sqrt(d) because H is symmetric and H·H = d·I.
 *
 * Why a Hadamard and not a dense Gaussian rotation: O(d log d) adds instead of d² multiply-adds,
 * no matrix to store or ship to the GPU (the seed is enough), and it still spreads an outlier
 * channel over all d coordinates (each row of H·diag(s) has entries ±1/sqrt(d)), which is what
 * makes the rotated coordinates close to N(0, ‖x‖²/d) and the fixed 3-bit grid fit.
 *
 * Evaluation order (a GPU kernel that wants bit-identical results follows it; one that does a
 * different butterfly order gets results equal to ~1e-7 relative, which is all TQ3 needs):
 *   forward: t_i = s_i·x_i; butterflies for h = 1, 2, 4, …, d/2: (a, b) ← (a + b, a − b) on
 *            pairs (i, i+h) with i & h == 0; finally y_i = t_i · (float)(1/sqrt(d)).
 *   inverse: the same butterflies on y, times (float)(1/sqrt(d)), then x_i = s_i·t_i.
 * In float the 1/sqrt(d) factor is exact for d = 64 and 256 (1/8, 1/16) and rounded for 128.
 */
#include "kvkern.h"

#include <math.h>

static void fwht(uint32_t d, float *t)
{
    for (uint32_t h = 1; h < d; h <<= 1) {
        for (uint32_t i = 0; i < d; i += h << 1) {
            for (uint32_t j = i; j < i + h; j++) {
                float a = t[j], b = t[j + h];
                t[j] = a + b;
                t[j + h] = a - b;
            }
        }
    }
}

/* d must be a power of two (the geometry guarantees 64, 128 or 256). The functions return
 * void, so a bad d cannot be reported: the output is filled with NaN, which no caller can
 * mistake for a rotation, instead of reading or writing out of bounds. */
static int bad_dim(uint32_t d, float *out)
{
    if (d != 0 && (d & (d - 1)) == 0)
        return 0;
    for (uint32_t i = 0; i < d; i++)
        out[i] = NAN;
    return 1;
}

static float inv_sqrt_d(uint32_t d)
{
    return (float)(1.0 / sqrt((double)d));
}

void kv_rot_forward(uint64_t seed, uint32_t d, const float *x, float *y)
{
    if (bad_dim(d, y))
        return;
    for (uint32_t i = 0; i < d; i++)
        y[i] = kv_rot_sign(seed, i) * x[i];
    fwht(d, y);
    float c = inv_sqrt_d(d);
    for (uint32_t i = 0; i < d; i++)
        y[i] *= c;
}

void kv_rot_inverse(uint64_t seed, uint32_t d, const float *y, float *x)
{
    if (bad_dim(d, x))
        return;
    if (x != y) {
        for (uint32_t i = 0; i < d; i++)
            x[i] = y[i];
    }
    fwht(d, x);
    float c = inv_sqrt_d(d);
    for (uint32_t i = 0; i < d; i++)
        x[i] = x[i] * c * kv_rot_sign(seed, i);
}
