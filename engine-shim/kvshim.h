/* kvshim.h — libkvshim: what an engine worker links (DESIGN.md, "engine-shim").
 *
 * One kvs_t per worker thread wraps a libkvc session (client/kvc.h) and the kernels of
 * cuda/ so that an engine deals in sequences and tensors, not page ids and protocol calls:
 *
 *     kvs_t *s;
 *     kvs_open(&s, &(kvs_opts_t){.endpoint = "ipc:///run/kvd/kvd.sock"});
 *     kvs_seq_t *q;
 *     size_t cached;
 *     kvs_seq_begin(s, prompt, n, &q, &cached);   // prefix hit: skip prefill of `cached` tokens
 *     kvs_seq_extend(q, prompt + cached, n - cached);    // room for the new tokens
 *     for (layer ...) kvs_append(q, layer, k, v, KVS_F32, m);  // quantize into FP8 pages
 *     (decode of a batch: kvs_append_batch(s, seqs, nseq, layer, k, v, KVS_F32, 1), one call)
 *     kvs_seq_commit(q);                          // seal full pages: the prefix is now shared
 *     kvs_attention(s, &q, 1, layer, q_heads, qv, 0.0f, out);  // decode; 0: 1/sqrt(d)
 *     kvs_seq_end(&q);
 *     kvs_close(&s);
 *
 * Backend: the daemon's. With `host` pools (CPU memory) the shim appends and attends with the
 * CPU twins (cuda/page.c, cuda/attn.c); with `cuda` / `cuda-ipc` pools (device memory) with
 * the kernels (cuda/append.cu, cuda/attn.cu), and tensors passed to kvs_append(_batch) /
 * kvs_attention are then DEVICE pointers (kvs_on_device() says which) and kvs_append(_batch)
 * takes KVS_F16 or KVS_BF16 only (the append kernel has no float input). A shim built without
 * CUDA refuses device pools at kvs_open with KV_ERR_FAILED_PRECONDITION and a message saying so.
 *
 * Sequences: a kvs_seq_t owns a block table (logical page ids) and the token ids written so
 * far. kvs_seq_begin acquires the longest cached prefix in whole pages (kvc_lookup) — at most
 * the whole pages before the prompt's last token, so that the engine always computes at least
 * one token (it needs the last token's logits, and K/V cannot go into a sealed page) — and opens
 * the daemon-side sequence (kvc_seq_open / kvc_seq_append) so the lifecycle controller can
 * move its Stale pages to TQ3 — the block table stays valid because pages are addressed by
 * logical id through the directory. kvs_seq_extend allocates FP8 pages as the length crosses
 * page boundaries. kvs_seq_commit seals every page that became full (its tokens enter the
 * prefix index; a cached duplicate found at seal time replaces the page in the table); it
 * refuses (FAILED_PRECONDITION) while a layer lacks K/V for a full page, so the cache never
 * holds a half-written page.
 * kvs_seq_end releases the table's references (sealed pages stay cached) and closes the
 * daemon-side sequence. Pages are written only while they belong to the sequence and are not
 * sealed: positions below the cached prefix are read-only.
 *
 * Lost sequences: when a seal (kvs_seq_commit) or the seq_append of kvs_seq_extend fails with
 * no usable reply (TIMEOUT, UNAVAILABLE, MALFORMED, INTERNAL) the daemon may have done it, and
 * after a deduplicating seal the page id in the table may already belong to another session.
 * The sequence is then lost: kvs_seq_extend, kvs_append, kvs_seq_commit, kvs_append_batch and
 * kvs_attention (with it anywhere in the batch) return FAILED_PRECONDITION ("sequence N: a seal
 * timed out, its page table is no longer known; end it with kvs_seq_end and begin again"), and
 * kvs_seq_pages returns 0. kvs_seq_end still closes it at the daemon. A refusal the daemon
 * sends back (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED ...) changed nothing,
 * and the sequence stays usable.
 *
 * Safe epoch: the shim's own kernels are synchronous (kvs_append and kvs_attention return
 * after the work is done), so libkvc's default safe-epoch mode is right.
 *
 * Errors: every call returns a kv_err_t (proto/kv_err.h); kvs_errmsg() names the call and
 * the problem (the daemon's message, or the shim's own for a bad argument) without repeating
 * the code's name (print kv_err_name(code) beside it); kvs_errmsg(NULL) is the message of the
 * calling thread's last failed kvs_open (there is no kvs_t to carry it).
 * Thread rule: one kvs_t per thread, like kvc_t. Sequences belong to their kvs_t: kvs_close
 * ends and frees the ones still open.
 *
 * Sessions: kvs_open opens a daemon session; kvs_close ends it (goodbye, client/kvc.h) when
 * the daemon supports that, else it lives until the process exits. goodbye states that no
 * kernel on the pools is in flight: the shim's are synchronous, but an engine that launches
 * its own on the shim's pages synchronizes them before kvs_close. An open kvs_t that makes no
 * call holds back the recycling of pages every session releases (docs/engine-shim.md,
 * "Sessions"): open one kvs_t per worker thread, keep it busy or close it.
 */
#ifndef KVSHIM_H
#define KVSHIM_H

#include <stddef.h>
#include <stdint.h>

#include "kv_err.h"
#include "kv_format.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most sequences in one kvs_attention call: the device kernel's grid has batch × KV_FMT_COUNT
 * blocks in a dimension limited to 65535. The host path takes the same limit, so an engine's
 * batching does not depend on the backend. */
#define KVS_MAX_BATCH (65535u / KV_FMT_COUNT)

typedef struct kvs_s kvs_t;
typedef struct kvs_seq_s kvs_seq_t;

typedef enum kvs_dtype_e {
    KVS_F32 = 0,  /* float */
    KVS_F16 = 1,  /* IEEE half */
    KVS_BF16 = 2, /* bfloat16 */
} kvs_dtype_t;

typedef struct kvs_opts_s {
    const char *endpoint; /* required: the daemon's control endpoint */
    const char *ns;       /* namespace; NULL: the daemon's */
    const char *name;     /* client name in kvctl sessions, ≤ 256 bytes; NULL: "kvshim" */
    int timeout_ms;       /* per call; 0: 5000 */
} kvs_opts_t;

kv_err_t kvs_open(kvs_t **out, const kvs_opts_t *o);
/* Ends the session at the daemon (goodbye: its sequences closed, its references dropped; on a
 * daemon without goodbye the open sequences are closed one by one), closes the connection,
 * frees every kvs_seq_t of s; *s = NULL. Synchronize any kernel of your own that reads the
 * shim's pages first. NULL-safe. Waits at most one timeout when the daemon does not answer
 * (what it did not hear of, it drops when the process exits). */
void kvs_close(kvs_t **s);
const char *kvs_errmsg(const kvs_t *s);
const kv_geom_t *kvs_geom(const kvs_t *s);
int kvs_on_device(const kvs_t *s); /* 1: tensors are device pointers */

/* tokens[n]: the prompt. *cached: tokens covered by the acquired prefix (a multiple of
 * page_tokens, ≤ n; the engine computes K/V only from there). A prompt longer than the
 * daemon's max_tokens (told at hello; a lower value set later is learnt from the refusal) is
 * looked up in part, and not at all when max_tokens is below one page (docs/engine-shim.md,
 * "Sequences and sealing"). */
kv_err_t kvs_seq_begin(kvs_t *s, const uint32_t *tokens, size_t n, kvs_seq_t **out,
                       size_t *cached);
/* Make room for m more tokens (their ids: appended to the sequence's token list). All or
 * nothing: on failure no page and no token was added. RESOURCE_EXHAUSTED when the pool cannot
 * give the pages (INVALID_ARGUMENT when one 1024-page chunk exceeds a smaller pool); an extend
 * of more than 1024 pages is refused before any cache entry is evicted for it when the pool
 * could not give them all at that moment (docs/engine-shim.md, decision 57). A chunk is at most
 * 1024 pages and the max_alloc the daemon told at hello, halved when it refuses one (lowered
 * since).
 * FAILED_PRECONDITION while some layer lacks K/V for a token already in the sequence (append
 * every layer of the last extend first: kvs_append could never write those tokens
 * afterwards). */
kv_err_t kvs_seq_extend(kvs_seq_t *q, const uint32_t *tokens, size_t m);
/* K/V of the first m (≤ the last kvs_seq_extend's m) tokens of the last kvs_seq_extend for one
 * layer: k, v [m][kv_heads][head_dim] of dtype, each aligned to its element (2 bytes for
 * KVS_F16 / KVS_BF16, 4 for KVS_F32; INVALID_ARGUMENT naming k or v otherwise, on both
 * backends: the append kernel cannot read misaligned rows). Quantized to FP8 (append kernel or
 * its CPU twin). Call it for every layer before kvs_seq_commit / kvs_attention of that layer. */
kv_err_t kvs_append(kvs_seq_t *q, uint32_t layer, const void *k, const void *v, kvs_dtype_t dt,
                    size_t m);
/* kvs_append of many sequences in one call: for every i < nseq, the first m tokens of the last
 * kvs_seq_extend of seqs[i], layer `layer`. A decode step of nseq sequences passes m = 1 and
 * writes their new tokens with ONE append kernel launch and one cudaStreamSynchronize on device
 * pools (one CPU-twin call on host pools) instead of nseq. k, v [nseq][m][kv_heads][head_dim] of
 * dt: sequence i's m rows follow sequence i - 1's, in the order of seqs. The same m for every
 * sequence (an engine appending different counts calls kvs_append per sequence).
 * Each sequence as kvs_append takes it (of s, not lost, m ≤ its last extend's m, that extend not
 * in a sealed page; dtype and alignment of k and v likewise), distinct (a sequence listed twice:
 * INVALID_ARGUMENT), nseq ≥ 1 and nseq · m < 2^32. All or nothing: every argument and every
 * sequence is checked before anything is written, and a refusal names seqs[i]; a page the kernel
 * itself refuses (not a valid unsealed FP8 page: FAILED_PRECONDITION) records no K/V for any of
 * them (on device pools the kernel may have written the other tokens: append them again). */
kv_err_t kvs_append_batch(kvs_t *s, kvs_seq_t *const *seqs, size_t nseq, uint32_t layer,
                          const void *k, const void *v, kvs_dtype_t dt, size_t m);
/* Seal the pages that are full and not sealed yet. FAILED_PRECONDITION while a layer lacks
 * K/V for them, or, when sealing would reach into the last extend's tokens, for any of those. */
kv_err_t kvs_seq_commit(kvs_seq_t *q);
size_t kvs_seq_len(const kvs_seq_t *q);                            /* tokens in the sequence */
/* Block table: pages[cap] receives up to cap ids; returns the table's length (0 for a lost
 * sequence). */
size_t kvs_seq_pages(const kvs_seq_t *q, uint32_t *pages, size_t cap);
/* Decode attention of one query per sequence (nseq ≤ KVS_MAX_BATCH) over its whole length
 * (every token's K/V of `layer` appended, else FAILED_PRECONDITION): q, out
 * [nseq][q_heads][head_dim] float (q_heads a multiple of kv_heads; query head h reads KV head
 * h / (q_heads / kv_heads)). sm_scale 0: 1/sqrt(head_dim). q must be 16-byte aligned (the GPU
 * kernel copies its rows 16 bytes at a time, from q itself) and out 4-byte aligned, on both
 * backends, so a host run keeps the GPU's contract: INVALID_ARGUMENT naming q or out otherwise
 * (malloc'd and cudaMalloc'd buffers are aligned; a pointer into the middle of a row may not
 * be). */
kv_err_t kvs_attention(kvs_t *s, kvs_seq_t *const *seqs, size_t nseq, uint32_t layer,
                       uint32_t q_heads, const float *q, float sm_scale, float *out);
/* Close the daemon-side sequence (dropping every reference of its table, a lost one's too) and
 * free q; *q = NULL, whatever the status (the kvc_seq_close's; OK for NULL). After a failure
 * the daemon still holds the table until the process exits. */
kv_err_t kvs_seq_end(kvs_seq_t **q);

#ifdef __cplusplus
}
#endif
#endif /* KVSHIM_H */
