/* kvkern.h — libkvkern: the CPU twins of every kernel, and the reference numerics.
 *
 * Every GPU kernel in cuda/<module>.cu has a function here with the same contract; the CPU twin is
 * the reference for the GPU tests and the compute path of the host backend. Byte layouts are
 * in kv_format.h. Functions are pure (no globals), thread-safe, and never abort on bad input:
 * they return KVK_EINVAL. Arrays are row-major; shapes are written beside each parameter.
 */
#ifndef KVKERN_H
#define KVKERN_H

#include "kv_format.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- scalar conversions (fp8.c) ---------------------------------------------------------- */
/* float → e4m3 exactly as CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3):
 * round to nearest even, saturate to ±448, subnormals kept, NaN → 0x7F. */
uint8_t kv_fp8_from_float(float x);
float kv_fp8_to_float(uint8_t code);
/* float ↔ IEEE binary16, round to nearest even (as __float2half_rn). */
uint16_t kv_half_from_float(float x);
float kv_half_to_float(uint16_t h);

/* ---- FP8 rows (fp8.c) -------------------------------------------------------------------- */
/* Encode one token-head: scale = amax/448 (1.0 when amax == 0), code[i] = fp8(x[i] / scale). */
void kv_fp8_encode_row(uint32_t d, const float *x /*[d]*/, uint8_t *code /*[d]*/, float *scale);
void kv_fp8_decode_row(uint32_t d, const uint8_t *code /*[d]*/, float scale, float *x /*[d]*/);

/* ---- rotation (rotate.c) ----------------------------------------------------------------- */
/* y = R x and x = Rᵀ y with R = H·diag(s)/sqrt(d); in place allowed (x == y). d a power of 2. */
void kv_rot_forward(uint64_t seed, uint32_t d, const float *x, float *y);
void kv_rot_inverse(uint64_t seed, uint32_t d, const float *y, float *x);

/* ---- TQ3 rows (tq3.c) -------------------------------------------------------------------- */
/* One token-head at a time, codes one byte (0..7) per coordinate; where the codes go in a page
 * block is kv_tq3_get / kv_tq3_set of kv_format.h (page.c packs them).
 * Keys: codes [d], norm = FP16 γ. */
void kv_tq3_encode_key(uint64_t seed, uint32_t d, const float *k, uint8_t *codes, uint16_t *norm);
void kv_tq3_decode_key(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t norm, float *k);
/* Values: codes [d], FP16 scale and zero of the rotated vector. */
void kv_tq3_encode_value(uint64_t seed, uint32_t d, const float *v, uint8_t *codes,
                         uint16_t *scale, uint16_t *zero);
/* The same encoders for the row x = s·r (tq3.c "ENCODING"): the retier passes an FP8 row's
 * decoded codes r and its scale s, so that the codes depend on r alone; the plain encoders
 * above are these with s = 1. */
void kv_tq3_encode_key_scaled(uint64_t seed, uint32_t d, const float *r, float s, uint8_t *codes,
                              uint16_t *norm);
void kv_tq3_encode_value_scaled(uint64_t seed, uint32_t d, const float *r, float s,
                                uint8_t *codes, uint16_t *scale, uint16_t *zero);
/* Promote one TQ3 row to an FP8 row (codes [d], f32 scale) exactly as the GPU does (tq3.c
 * "promote"): the FP8 codec's scale of the decoded row, codes from the exact integer transform
 * of the TQ3 codes. */
void kv_tq3_key_to_fp8(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t norm,
                       uint8_t *fp8, float *scale);
void kv_tq3_value_to_fp8(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t scale,
                         uint16_t zero, uint8_t *fp8, float *fscale);
void kv_tq3_decode_value(uint64_t seed, uint32_t d, const uint8_t *codes, uint16_t scale,
                         uint16_t zero, float *v);

/* ---- pages (page.c) ---------------------------------------------------------------------- */
/* Write tokens of one layer into FP8 pages (the append kernel's twin). Token t goes to logical
 * page slot_page[t], slot slot_idx[t] < page_tokens; the page must be mapped FP8 in dir.
 * k, v: [ntok][kv_heads][d]. */
int kv_fp8_append(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                  uint32_t dir_len, uint32_t layer, uint32_t ntok, const uint32_t *slot_page,
                  const uint32_t *slot_idx, const float *k, const float *v);
/* Whole-page conversions: retier FP8 → TQ3 and promote TQ3 → FP8 (all layers, K and V). */
int kv_page_retier(const kv_geom_t *g, const uint8_t *fp8_page, uint8_t *tq3_page);
int kv_page_promote(const kv_geom_t *g, const uint8_t *tq3_page, uint8_t *fp8_page);
/* Decode one block (layer, kind, head) of a page of format f to floats [page_tokens][d]. */
int kv_page_decode_block(const kv_geom_t *g, kv_fmt_t f, const uint8_t *page, uint32_t layer,
                         int kind, uint32_t head, float *out);

/* ---- paged decode attention (attn.c) ----------------------------------------------------- */
/* A batch of sequences, one query token each. Sequence s owns logical pages
 * page_ids[page_indptr[s] .. page_indptr[s+1]) in logical order and seq_len[s] tokens
 * (≤ pages × page_tokens). Query head h reads KV head h / (q_heads / kv_heads). */
typedef struct kv_attn_batch_s {
    uint32_t batch;
    uint32_t q_heads;             /* a multiple of kv_heads */
    uint32_t layer;
    float sm_scale;               /* usually 1/sqrt(d) */
    const uint32_t *page_indptr;  /* [batch + 1] */
    const uint32_t *page_ids;     /* [page_indptr[batch]] logical ids */
    const uint32_t *seq_len;      /* [batch] tokens */
} kv_attn_batch_t;

/* Partitions: the pages of each sequence are cut into num_splits contiguous chunks of at most
 * ceil(npages / num_splits) + 1 pages (kv_attn_split_range); inside a chunk FP8 and TQ3 pages form
 * two partitions.
 * Partition index of (s, split, fmt) = (s * num_splits + split) * KV_FMT_COUNT + fmt.
 *   part_m, part_l: [batch * num_splits * KV_FMT_COUNT][q_heads]
 *   part_o:         [batch * num_splits * KV_FMT_COUNT][q_heads][d]   normalized Ō
 * An empty partition has m = -INFINITY, l = 0, Ō = 0 (the CUDA kernels may leave its Ō row
 * unwritten: kv_attn_merge and the CUDA merge never read the Ō of an l = 0 partition). TQ3
 * partitions score with the rotated
 * query and accumulate in the rotated basis, un-rotating Ō once per partition. */
static inline uint32_t kv_attn_num_parts(uint32_t batch, uint32_t num_splits)
{
    return batch * num_splits * KV_FMT_COUNT;
}

/* Pages [*p0, *p1) of split `split` of a sequence of np pages. Every split but the first and
 * the last has chunk = ceil(np / num_splits) + 1 pages; the shortfall num_splits · chunk − np
 * (at least num_splits pages) comes off the first split (half, rounded down) and the last (the
 * rest). In kvd those two hold the sink/anchor and the recent pages, FP8 beside TQ3, so on the
 * GPU they run a second format's phase, a fixed cost per split (B=2 d=256 32K: the split
 * holding page 0 ended 4.5 µs after the others, docs/perf.md session 6); the +1 page of every
 * middle split buys the ends that much room (decision 47: 32 pages instead of 48 there, the
 * mix 0.0311 → 0.0304 ms in session 12; B=8's two splits are unchanged). Splits past the pages
 * are empty; num_splits ≥ 1 (the callers check). One rule for the CPU twin and both GPU
 * kernels: partitions must match. */
KV_HD void kv_attn_split_range(uint64_t np, uint32_t num_splits, uint32_t split, uint64_t *p0,
                               uint64_t *p1)
{
    const uint64_t chunk = (np + num_splits - 1) / num_splits + 1;
    const uint64_t front = (chunk * num_splits - np) / 2;
    const uint64_t a = (uint64_t)split * chunk, b = a + chunk;
    const uint64_t a1 = a > front ? a - front : 0, b1 = b > front ? b - front : 0;
    *p0 = a1 < np ? a1 : np;
    *p1 = b1 < np ? b1 : np;
}
int kv_attn_partial(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                    uint32_t dir_len, const kv_attn_batch_t *b,
                    const float *q /*[batch][q_heads][d]*/, uint32_t num_splits, float *part_m,
                    float *part_l, float *part_o);
/* Merge the partitions of each sequence by online softmax (Minima-KV eqs. 11–13).
 * parts_per_seq partitions per sequence, consecutive. out: [batch][q_heads][d]. A sequence
 * whose partitions are all empty gets a zero output. */
int kv_attn_merge(uint32_t batch, uint32_t parts_per_seq, uint32_t q_heads, uint32_t d,
                  const float *part_m, const float *part_l, const float *part_o, float *out);
/* Float64 dense reference: attention on the decoded pages, no partitions.
 * out [batch][q_heads][d]. */
int kv_attn_reference(const kv_geom_t *g, const kv_pools_t *pools, const kv_dir_entry_t *dir,
                      uint32_t dir_len, const kv_attn_batch_t *b, const float *q, double *out);

#ifdef __cplusplus
}
#endif
#endif /* KVKERN_H */
