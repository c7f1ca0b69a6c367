/* kv_format.h — geometry and page formats shared by C (CPU twins, daemon, client) and nvcc.
 *
 * One header is the single source of truth for every byte layout that crosses a process or a
 * device boundary: the FP8 page, the TQ3 page and the page-directory entry. It is compiled by
 * the C compiler and by nvcc; everything here is plain C11 with KV_HD (host+device) inline
 * helpers. No other kvd header may be included from here.
 *
 * Geometry (fixed per namespace):
 *   layers, kv_heads, head_dim ∈ {64,128,256}, page_tokens ≥ 1, rotation seed.
 *
 * A PAGE holds page_tokens tokens for ALL layers, K and V, all KV heads. It is a sequence of
 * BLOCKS, one per (layer, kind ∈ {K,V}, kv_head), in that order (layer outermost):
 *
 *     page = [ layer 0: K head 0, K head 1, …, V head 0, V head 1, … ][ layer 1: … ] …
 *
 * Each block is 16-byte aligned (so a kernel may use 128-bit loads) and holds, for that
 * (layer, kind, head), all page_tokens tokens:
 *
 *   FP8 block  (8 + 32/d bits per value: 8.25 at d=128)
 *     uint8_t  code [page_tokens][head_dim]   e4m3, scaled: x ≈ decode(code) * scale
 *     float    scale[page_tokens]             amax/448 of that token-head (1.0 when amax==0)
 *
 *   TQ3 K block  (3 + 16/d bits per value: 3.125 at d=128)
 *     uint32_t unit [page_tokens][head_dim/32][3]     3-bit codes in UNITS, see below
 *     uint16_t norm [page_tokens]                     FP16 norm correction γ: k̂ = γ · Rᵀ ĉ
 *   TQ3 V block  (3 + 32/d bits per value: 3.25 at d=128)
 *     uint32_t unit [ceil(page_tokens/2)][head_dim/16][3]   token PAIRS, see below
 *     uint16_t scale[page_tokens], zero[page_tokens]  FP16 affine: v̂_rot = zero + code*scale
 *
 * TQ3 code units (layout 2, 2026-11-30; docs/formats.md "TQ3 units" says why). A UNIT is three
 * 32-bit words w0, w1, w2 holding 16 PAIRS of 3-bit codes, a pair being a LOW and a HIGH code:
 *     pair p < 15:  word p/5, low code at bits 3·(p%5) … +2, high code at bits 16 + 3·(p%5) … +2
 *     pair 15:      bit b of the low code is bit 15 of word b, of the high code bit 31 of word b
 * A pair then becomes an f16x2 MMA operand in two instructions: shift the word by 7 − 3·(p%5)
 * and (x & 0x03800380) | 0x3C003C00 gives the halves 1 + c/8, exactly (pair 15: six).
 *   K unit (token t, group q):  index t·(d/32) + q;  pair p = coordinates 32q + 2p (low) and
 *                               32q + 2p + 1 (high) of token t.
 *   V unit (pair u, group q):   index u·(d/16) + q;  pair p = coordinate 16q + p of token 2u
 *                               (low) and of token 2u + 1 (high). With page_tokens odd, the
 *                               high codes of the last pair are zero.
 * These are the operand orders of mma.m16n8k16: a K pair is two contraction coordinates of
 * one token, a V pair two contraction tokens of one coordinate (cuda/attn.cu).
 * kv_tq3_get / kv_tq3_set below address one code; every implementation goes through them or
 * documents its equivalence.
 *
 * Rotation: R = H · diag(s) / sqrt(d), H the d×d Sylvester–Hadamard matrix, s ∈ {±1}^d from
 * kv_rot_sign(seed, i). R is orthonormal; Rᵀ = diag(s) · H / sqrt(d).
 *
 * TQ3 keys: u = k/‖k‖, y = R u, code_i = nearest of KV_TQ3_CENTROIDS[]/sqrt(d) to y_i (a
 * uniform grid, step KV_TQ3_KEY_STEP, since layout 2), norm γ chosen by the codec
 * (docs/formats.md says which and why). Score: q·k̂ = γ (R q)·ĉ.
 * TQ3 values: y = R v; step = 0.5860·σ(y) (the MSE-optimal uniform 8-level grid of a Gaussian);
 * if 7·step < max y − min y: zero = mean y − 3.5·step, scale = step (tails clip), else
 * zero = min y, scale = (max y − min y)/7; code = clamp(rint((y−zero)/scale), 0, 7).
 *
 * All offsets are computed in 64 bits.
 */
#ifndef KV_FORMAT_H
#define KV_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD static inline
#endif

#ifdef __cplusplus
#define KV_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define KV_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

/* ---- status codes of libkvkern (CPU twins and CUDA launchers) ---------------------------- */
typedef enum kvk_status_e {
    KVK_OK = 0,
    KVK_EINVAL = -1,  /* an argument is out of range (geometry, ids, sizes) */
    KVK_ENOMEM = -2,  /* scratch allocation failed */
    KVK_EDEVICE = -3, /* CUDA runtime/driver error (launchers only) */
} kvk_status_t;

/* ---- formats ----------------------------------------------------------------------------- */
typedef enum kv_fmt_e {
    KV_FMT_FP8 = 0, /* Recent and Anchor tiers */
    KV_FMT_TQ3 = 1, /* Stale tier */
    KV_FMT_COUNT = 2,
} kv_fmt_t;

enum { KV_KIND_K = 0, KV_KIND_V = 1 };

#define KV_FP8_MAX 448.0f
#define KV_TQ3_LEVELS 8
#define KV_BLOCK_ALIGN 16u
#define KV_PAGE_ALIGN 256u
#define KV_MAX_HEAD_DIM 256
#define KV_TQ3_VALUE_STEP_SIGMAS 0.5860f /* optimal uniform 8-level step for N(0,1), in σ */

/* Version of the page layouts and the TQ3 codebook: snapshots record it and refuse another.
 * 1: bit planes, Lloyd–Max key levels. 2: code units (below), uniform key levels. */
#define KV_LAYOUT_VERSION 2u

/* Key levels: the MSE-optimal UNIFORM 8-level grid for N(0,1), ascending, code i ↦
 * KV_TQ3_CENTROIDS[i] / sqrt(d) = KV_TQ3_KEY_STEP · (i − 3.5) / sqrt(d). Uniform (not
 * Lloyd–Max: ±0.2451, ±0.7560, ±1.3439, ±2.1519) so that a kernel turns a code into its level
 * with a shift and a mask instead of a table lookup; the cost is ~8% more key MSE
 * (docs/formats.md has the measurement). */
#define KV_TQ3_KEY_STEP 0.5860f
#define KV_TQ3_CENTROIDS_INIT                                                                      \
    { -2.0510f, -1.4650f, -0.8790f, -0.2930f, 0.2930f, 0.8790f, 1.4650f, 2.0510f }

/* Encoder constants (tq3.c "ENCODING", retier v4; the GPU retier uses the same ones).
 * A code is c = floor(t · KV_TQ3_FLOOR8) for t ∈ [0, 1]: 8 − 2^-20 lands t = 1 on 7 without a
 * clamp. Keys: t = sat(w·a8 + 0.5) with a8 = kv_tq3_key_a8(d) / ‖w‖ (w the unnormalised
 * Hadamard transform of the row, so sqrt(d)/‖w‖ = 1/‖k‖), i.e. u = z/STEP + 4 on an 8× scale;
 * γ uses KV_TQ3_KEY_HALF_STEP = STEP/2 (exact). */
#define KV_TQ3_FLOOR8 0x1.fffffcp+2f
#define KV_TQ3_KEY_HALF_STEP 0x1.2c0832p-2f

/* float(sqrt(d) / (8·(double)KV_TQ3_KEY_STEP)) for d = 64, 128, 256 (written out so that the
 * host and the device use the same bits without evaluating a square root). */
KV_HD float kv_tq3_key_a8(uint32_t d)
{
    return d == 64 ? 0x1.b4dc2cp+0f : d == 128 ? 0x1.34e81ep+1f : 0x1.b4dc2cp+1f;
}

/* ---- geometry ---------------------------------------------------------------------------- */
typedef struct kv_geom_s {
    uint32_t layers;      /* ≥ 1 */
    uint32_t kv_heads;    /* ≥ 1 */
    uint32_t head_dim;    /* 64, 128 or 256 */
    uint32_t page_tokens; /* ≥ 1 */
    uint64_t seed;        /* rotation seed of the namespace */
} kv_geom_t;

#define KV_MAX_LAYERS 1024u
#define KV_MAX_KV_HEADS 256u
#define KV_MAX_PAGE_TOKENS 4096u

KV_HD int kv_geom_valid(const kv_geom_t *g)
{
    return g && g->layers >= 1 && g->layers <= KV_MAX_LAYERS && g->kv_heads >= 1 &&
           g->kv_heads <= KV_MAX_KV_HEADS &&
           (g->head_dim == 64 || g->head_dim == 128 || g->head_dim == 256) &&
           g->page_tokens >= 1 && g->page_tokens <= KV_MAX_PAGE_TOKENS;
}

KV_HD uint64_t kv_align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

/* Bytes of the codes part of one block of format f and kind (before the per-token metadata).
 * TQ3 V stores token pairs, so an odd page_tokens adds one token's worth of zero codes. */
KV_HD uint64_t kv_block_code_bytes(const kv_geom_t *g, kv_fmt_t f, int kind)
{
    uint64_t t = g->page_tokens, d = g->head_dim;
    if (f == KV_FMT_FP8)
        return t * d;
    if (kind == KV_KIND_K)
        return t * (d / 32) * 3 * sizeof(uint32_t);
    return (t + 1) / 2 * (d / 16) * 3 * sizeof(uint32_t);
}

/* Bytes of per-token metadata in one block of format f and kind (K or V). */
KV_HD uint64_t kv_block_meta_bytes(const kv_geom_t *g, kv_fmt_t f, int kind)
{
    uint64_t t = g->page_tokens;
    if (f == KV_FMT_FP8)
        return t * sizeof(float);
    return kind == KV_KIND_K ? t * sizeof(uint16_t) : 2 * t * sizeof(uint16_t);
}

/* Offset of the metadata inside a block (codes come first, metadata 16-byte aligned). */
KV_HD uint64_t kv_block_meta_offset(const kv_geom_t *g, kv_fmt_t f, int kind)
{
    return kv_align_up(kv_block_code_bytes(g, f, kind), KV_BLOCK_ALIGN);
}

KV_HD uint64_t kv_block_bytes(const kv_geom_t *g, kv_fmt_t f, int kind)
{
    return kv_align_up(kv_block_meta_offset(g, f, kind) + kv_block_meta_bytes(g, f, kind),
                       KV_BLOCK_ALIGN);
}

/* Bytes of one layer (K blocks of every head, then V blocks of every head). */
KV_HD uint64_t kv_layer_bytes(const kv_geom_t *g, kv_fmt_t f)
{
    return (uint64_t)g->kv_heads *
           (kv_block_bytes(g, f, KV_KIND_K) + kv_block_bytes(g, f, KV_KIND_V));
}

/* Bytes of one page of format f, rounded up to KV_PAGE_ALIGN. */
KV_HD uint64_t kv_page_bytes(const kv_geom_t *g, kv_fmt_t f)
{
    return kv_align_up((uint64_t)g->layers * kv_layer_bytes(g, f), KV_PAGE_ALIGN);
}

/* Offset of the block (layer, kind, head) from the start of its page. */
KV_HD uint64_t kv_block_offset(const kv_geom_t *g, kv_fmt_t f, uint32_t layer, int kind,
                               uint32_t head)
{
    uint64_t kb = kv_block_bytes(g, f, KV_KIND_K);
    uint64_t off = (uint64_t)layer * kv_layer_bytes(g, f);
    if (kind == KV_KIND_K)
        return off + (uint64_t)head * kb;
    return off + (uint64_t)g->kv_heads * kb + (uint64_t)head * kv_block_bytes(g, f, KV_KIND_V);
}

/* Bits per stored value of a page, metadata and padding included (what the reports print). */
KV_HD double kv_page_bits_per_value(const kv_geom_t *g, kv_fmt_t f)
{
    double values = 2.0 * g->layers * g->kv_heads * g->head_dim * g->page_tokens;
    return 8.0 * (double)kv_page_bytes(g, f) / values;
}

/* ---- TQ3 code units ---------------------------------------------------------------------- */
#define KV_TQ3_UNIT_WORDS 3u
#define KV_TQ3_UNIT_PAIRS 16u

/* Code of pair p (0..15), half hi (0 low, 1 high) of the unit at u. */
KV_HD uint32_t kv_tq3_unit_get(const uint32_t *u, uint32_t p, uint32_t hi)
{
    if (p < 15)
        return (u[p / 5] >> (16 * hi + 3 * (p % 5))) & 7u;
    const uint32_t bit = 15 + 16 * hi;
    return ((u[0] >> bit) & 1u) | (((u[1] >> bit) & 1u) << 1) | (((u[2] >> bit) & 1u) << 2);
}

KV_HD void kv_tq3_unit_set(uint32_t *u, uint32_t p, uint32_t hi, uint32_t c)
{
    if (p < 15) {
        const uint32_t sh = 16 * hi + 3 * (p % 5);
        u[p / 5] = (u[p / 5] & ~(7u << sh)) | ((c & 7u) << sh);
        return;
    }
    const uint32_t bit = 15 + 16 * hi;
    for (uint32_t b = 0; b < 3; b++)
        u[b] = (u[b] & ~(1u << bit)) | (((c >> b) & 1u) << bit);
}

/* Where code i (coordinate) of token t of a TQ3 block of kind k sits: unit index, pair, half. */
KV_HD void kv_tq3_code_pos(int kind, uint32_t d, uint32_t t, uint32_t i, uint64_t *unit,
                           uint32_t *pair, uint32_t *hi)
{
    if (kind == KV_KIND_K) {
        *unit = (uint64_t)t * (d / 32) + i / 32;
        *pair = (i % 32) / 2;
        *hi = i % 2;
    } else {
        *unit = (uint64_t)(t / 2) * (d / 16) + i / 16;
        *pair = i % 16;
        *hi = t % 2;
    }
}

/* Code of coordinate i of token t in the codes of a TQ3 block (its first byte, as words). */
KV_HD uint32_t kv_tq3_get(const uint32_t *codes, int kind, uint32_t d, uint32_t t, uint32_t i)
{
    uint64_t u;
    uint32_t p, h;
    kv_tq3_code_pos(kind, d, t, i, &u, &p, &h);
    return kv_tq3_unit_get(codes + u * KV_TQ3_UNIT_WORDS, p, h);
}

KV_HD void kv_tq3_set(uint32_t *codes, int kind, uint32_t d, uint32_t t, uint32_t i, uint32_t c)
{
    uint64_t u;
    uint32_t p, h;
    kv_tq3_code_pos(kind, d, t, i, &u, &p, &h);
    kv_tq3_unit_set(codes + u * KV_TQ3_UNIT_WORDS, p, h, c);
}

/* ---- rotation signs ---------------------------------------------------------------------- */
/* splitmix64: the same bits on host and device, so CPU twins and kernels rotate identically. */
KV_HD uint64_t kv_splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Sign s_i ∈ {+1,−1} of coordinate i for a namespace seed. */
KV_HD float kv_rot_sign(uint64_t seed, uint32_t i)
{
    return (kv_splitmix64(seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(i + 1))) & 1) ? -1.0f : 1.0f;
}

/* ---- page directory ---------------------------------------------------------------------- */
/* One entry per logical page id, 8 bytes, written by the daemon only with a single 64-bit
 * atomic store so that a reader (kernel or client) never sees a torn (format, phys) pair.
 *   bits  0..31  physical page index inside the pool of `format`
 *   bits 32..39  format (kv_fmt_t)
 *   bits 40..47  flags (KV_DIR_*)
 *   bits 48..63  generation (bumped on every publish; lets a reader detect reuse)      */
typedef uint64_t kv_dir_entry_t;

#define KV_DIR_VALID 0x01u  /* the logical id is mapped */
#define KV_DIR_SEALED 0x02u /* immutable: bound in the prefix index */

KV_HD kv_dir_entry_t kv_dir_make(uint32_t phys, kv_fmt_t f, uint32_t flags, uint32_t gen)
{
    return (uint64_t)phys | ((uint64_t)(f & 0xff) << 32) | ((uint64_t)(flags & 0xff) << 40) |
           ((uint64_t)(gen & 0xffff) << 48);
}
KV_HD uint32_t kv_dir_phys(kv_dir_entry_t e)
{
    return (uint32_t)(e & 0xffffffffu);
}
KV_HD kv_fmt_t kv_dir_fmt(kv_dir_entry_t e)
{
    return (kv_fmt_t)((e >> 32) & 0xff);
}
KV_HD uint32_t kv_dir_flags(kv_dir_entry_t e)
{
    return (uint32_t)((e >> 40) & 0xff);
}
KV_HD uint32_t kv_dir_gen(kv_dir_entry_t e)
{
    return (uint32_t)(e >> 48);
}

/* ---- pools as seen by a kernel ----------------------------------------------------------- */
/* Base pointer of each format's pool (host or device address in the caller's mapping) and the
 * number of physical pages in it. Page p of format f starts at base[f] + p * kv_page_bytes(f). */
typedef struct kv_pools_s {
    uint8_t *base[KV_FMT_COUNT];
    uint32_t pages[KV_FMT_COUNT];
} kv_pools_t;

KV_STATIC_ASSERT(sizeof(kv_dir_entry_t) == 8, "directory entries are one 64-bit word");
KV_STATIC_ASSERT(KV_MAX_HEAD_DIM % 32 == 0, "TQ3 groups are 32 coordinates");

#endif /* KV_FORMAT_H */
