/* kvkern_cuda.h — launchers of the CUDA kernels of libkvkern (cuda/append.cu, convert.cu,
 * dir.cu, attn.cu). Each launcher but kvk_cuda_dir_store has a CPU twin in kvkern.h with the
 * same contract; byte layouts are those of kv_format.h.
 *
 * Conventions shared by every launcher:
 *   - Pointers are DEVICE pointers unless a comment says "host". kv_geom_t, kv_pools_t and
 *     kv_attn_batch_t are passed by host pointer and copied by value into the launch; the
 *     pointers INSIDE kv_pools_t (pool bases) and kv_attn_batch_t (indptr, page ids, lengths)
 *     are device pointers.
 *   - Everything that can be checked on the host (geometry, sizes, null pointers, alignment,
 *     grid limits) is checked BEFORE any launch; a bad argument returns KVK_EINVAL and enqueues
 *     nothing. Every device array must be aligned to its element (8 bytes for directory
 *     entries, 4 for page and slot ids, 2 for f16/bf16 rows, 4 for floats; pool bases
 *     KV_BLOCK_ALIGN): on the device a misaligned access is a sticky error that ends the
 *     caller's CUDA context. Append, convert and dir refuse such pointers, and a pool whose
 *     byte range base + pages × page_bytes does not fit in 64 bits; the attention launchers
 *     check every array's alignment (q and, for the merge, part_o: 16 bytes) and the pool
 *     bases.
 *   - Errors: append, convert and dir launch with cudaLaunchKernelEx and return KVK_EDEVICE
 *     when THAT launch fails, consuming the error it set (cudaGetLastError), so the caller's
 *     next check does not see it twice; an error the caller left pending before a launch that
 *     works (say a failed cudaMalloc) is neither reported nor cleared, but a launch that
 *     fails clears it with its own (the runtime keeps one last error). The attention
 *     launchers do the same (attn.cu launch_ex). A sticky error of the context fails every
 *     launch. Faults of a kernel while it runs surface at the caller's next synchronisation,
 *     as for any kernel.
 *   - Launchers never synchronize, allocate, copy or query device memory, so every one of them
 *     can be captured in a CUDA graph. Scratch space (split-K partials) is a caller-owned
 *     workspace whose size kvk_cuda_attn_workspace_bytes() gives. kvk_cuda_init() sets the
 *     kernels' shared-memory attributes; launchers call it themselves on first use, so call it
 *     once before a stream capture begins (cudaFuncSetAttribute is not a stream operation).
 *   - Device-resident data cannot be validated from the host. Kernels therefore treat a bad
 *     directory entry (not VALID, wrong format, physical page out of range, logical id ≥
 *     dir_len), a slot index ≥ page_tokens or a seq_len larger than its pages can hold as
 *     follows: append skips the token (and the row stays as it was), attention skips the page
 *     and clamps seq_len to pages × page_tokens. The CPU twins reject such input with
 *     KVK_EINVAL; the daemon validates requests before they reach a kernel.
 */
#ifndef KVKERN_CUDA_H
#define KVKERN_CUDA_H

#include <cuda_runtime_api.h>

#include "kv_format.h"
#include "kvkern.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of the new K/V rows handed to the append kernel. */
typedef enum kvk_dtype_e {
    KVK_DTYPE_F16 = 0,  /* IEEE binary16 */
    KVK_DTYPE_BF16 = 1, /* bfloat16 */
} kvk_dtype_t;

/* Set kernel attributes (dynamic shared memory limits). Idempotent and thread-safe; not a
 * stream operation. Returns KVK_EDEVICE when the runtime refuses. */
kvk_status_t kvk_cuda_init(void);

/* ---- append (append.cu) -------------------------------------------------------------------- */
/* Twin of kv_fp8_append. k, v: [ntok][kv_heads][head_dim] of `dtype`; slot_page, slot_idx:
 * [ntok]; dir: [dir_len]. Bit-exact with kv_fp8_append on the same values widened to float:
 * scale = amax/448 and code = fp8(x/scale) with IEEE division (__fdiv_rn), amax over finite
 * |x|, scale 1 when amax < FLT_MIN. Writes the code row, the scale and zeroes the block tail
 * padding and the page tail, as the twin does. Tokens whose directory entry is not a VALID,
 * unsealed FP8 page inside the pool, or whose slot is ≥ page_tokens, are skipped. */
kvk_status_t kvk_cuda_fp8_append(const kv_geom_t *g, const kv_pools_t *pools,
                                 const kv_dir_entry_t *dir, uint32_t dir_len, uint32_t layer,
                                 uint32_t ntok, const uint32_t *slot_page, const uint32_t *slot_idx,
                                 const void *k, const void *v, kvk_dtype_t dtype,
                                 cudaStream_t stream);

/* ---- whole-page conversions (convert.cu) --------------------------------------------------- */
/* Batch twins of kv_page_retier / kv_page_promote: for i < n, convert FP8 page src_phys[i] of
 * pools->base[FP8] into TQ3 page dst_phys[i] of pools->base[TQ3] (retier), or TQ3 → FP8
 * (promote); all layers, K and V, every token; the destination page is fully written, padding
 * zero. src_phys, dst_phys: [n] device arrays. Pairs whose index is outside its pool are
 * skipped. Destinations must be distinct and must not be read by another pair of the batch;
 * the two pools must not overlap (KVK_EINVAL: the only aliasing the host can check). */
kvk_status_t kvk_cuda_page_retier(const kv_geom_t *g, const kv_pools_t *pools, uint32_t n,
                                  const uint32_t *src_phys, const uint32_t *dst_phys,
                                  cudaStream_t stream);
kvk_status_t kvk_cuda_page_promote(const kv_geom_t *g, const kv_pools_t *pools, uint32_t n,
                                   const uint32_t *src_phys, const uint32_t *dst_phys,
                                   cudaStream_t stream);

/* ---- directory publishing (dir.cu) -------------------------------------------------------- */
/* dir[lids[i]] = entries[i] for i < n, each with one 64-bit atomic store (a concurrent reader
 * sees the old entry or the new one); ids ≥ dir_len are skipped. lids [n] and entries [n] are
 * device arrays, entries and dir 8-byte aligned, lids 4-byte aligned; any n < 2^32 (one
 * launch of ⌈n / 256⌉ blocks). No CPU twin: kvd's core writes its host copy
 * with atomic stores; this is how its cuda backend pushes a batch of them to the device. */
kvk_status_t kvk_cuda_dir_store(kv_dir_entry_t *dir, uint32_t dir_len, uint32_t n,
                                const uint32_t *lids, const kv_dir_entry_t *entries,
                                cudaStream_t stream);

/* ---- paged decode attention (attn.c twin) -------------------------------------------------- */
/* Partition layout, m/l/Ō semantics and the split rule are exactly kv_attn_partial's
 * (kvkern.h): part index (s * num_splits + split) * KV_FMT_COUNT + fmt, m in natural-log
 * units, l = Σ exp(s − m), Ō normalised, empty partition (−inf, 0) with its Ō row unspecified
 * (the d = 256 kernel does not write it; no merge reads it). q: [batch][q_heads][d]
 * float, 16-byte aligned (KVK_EINVAL otherwise). b->page_indptr, b->page_ids, b->seq_len are
 * device arrays. q_heads / kv_heads may be any integer ≥ 1; groups of more than 8 query heads
 * are handled by several blocks. */
kvk_status_t kvk_cuda_attn_partial(const kv_geom_t *g, const kv_pools_t *pools,
                                   const kv_dir_entry_t *dir, uint32_t dir_len,
                                   const kv_attn_batch_t *b, const float *q, uint32_t num_splits,
                                   float *part_m, float *part_l, float *part_o,
                                   cudaStream_t stream);
/* Twin of kv_attn_merge. out: [batch][q_heads][d] float; d is a head_dim (64, 128, 256) and
 * part_o 16-byte aligned (the decode workspace is). */
kvk_status_t kvk_cuda_attn_merge(uint32_t batch, uint32_t parts_per_seq, uint32_t q_heads,
                                 uint32_t d, const float *part_m, const float *part_l,
                                 const float *part_o, float *out, cudaStream_t stream);
/* Bytes of workspace kvk_cuda_attn_decode needs (partials of every partition), 256-aligned
 * pieces; 0 on overflow. */
size_t kvk_cuda_attn_workspace_bytes(uint32_t batch, uint32_t q_heads, uint32_t head_dim,
                                     uint32_t num_splits);
/* A reasonable num_splits for a batch whose longest sequence has max_pages pages: as many
 * blocks as are resident at once on sm_count multiprocessors for this head_dim (one wave),
 * at most one split per 16 pages. Host-only arithmetic. */
uint32_t kvk_cuda_attn_suggest_splits(uint32_t batch, uint32_t kv_heads, uint32_t q_heads,
                                      uint32_t head_dim, uint32_t max_pages, uint32_t sm_count);
/* partial + merge into out [batch][q_heads][d]; workspace: ws_bytes ≥ the size above. */
kvk_status_t kvk_cuda_attn_decode(const kv_geom_t *g, const kv_pools_t *pools,
                                  const kv_dir_entry_t *dir, uint32_t dir_len,
                                  const kv_attn_batch_t *b, const float *q, uint32_t num_splits,
                                  void *workspace, size_t ws_bytes, float *out,
                                  cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* KVKERN_CUDA_H */
