/* kvshim.c — libkvshim (kvshim.h): sequences, append-with-quantize, prefix reuse and batch
 * decode attention on top of libkvc and the kernels of cuda/.
 *
 * State:
 *
 *     kvs_t ── kvc_t (session, mappings)      kvs_seq_t ── pages[]   block table, logical ids
 *       │      scratch (host, device)            │         tok[]     token ids, ntok of them
 *       └── seqs: doubly linked list ────────────┘         nsealed   pages[0..nsealed) sealed
 *                                                          written[layer]  tokens with K/V
 *                                                          ext_from, ext_m  the last extend
 *
 * Reference accounting: every page of a table is held by the daemon-side sequence (dseq), never
 * loose. kvc_lookup and kvc_alloc hand out loose references; the shim moves them into dseq with
 * kvc_seq_append at once (and releases them itself when that fails). A seal that deduplicates
 * moves the daemon's references to the canonical page at the same position of dseq
 * (kvd/core.h, kvd_core_seal), so the shim only rewrites its own table entry. kvc_seq_close
 * then drops all of them in kvs_seq_end; a kvc_release of a table page would fail, since none
 * is loose.
 *
 * written[layer] lets the shim refuse what would otherwise corrupt shared state silently:
 * sealing a page whose K/V is missing for some layer (the prefix cache would hand garbage to
 * every later prompt) and attending over tokens never appended.
 *
 * A lost sequence: a seal or seq_append that got no reply (TIMEOUT, UNAVAILABLE) or an
 * unreadable one may or may not have happened at the daemon. After a seal that deduplicated,
 * the daemon's sequence holds the cached page and ours is retired and may be handed to another
 * session; the shim cannot tell which page id is right, so reading or writing through its
 * table could touch another session's page. Such a sequence is marked lost (lost_call): every
 * call but kvs_seq_end refuses it, and kvs_seq_end's seq_close drops whatever the daemon's
 * table holds. A status the daemon sent back is definite: its calls are all-or-nothing
 * (kvd/core.h), so a refusal changed nothing and the sequence stays usable.
 *
 * Scratch buffers grow by doubling and live until kvs_close: an engine calls append and
 * attention once per layer per step, so allocating per call would dominate on the host path.
 */
#include "kvshim.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvc.h"
#include "kvkern.h"

#ifdef KVS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kvkern_cuda.h"
#endif

#define KVS_ERR_BYTES 512
/* the most pages per kvc_alloc request, below the daemon's default max_alloc (4096): a kvs_t
 * starts from the smaller of this and the max_alloc its hello told, and halves its own chunk
 * when the daemon refuses it (max_alloc lowered since, or not told: kvs_seq_add_pages) */
#define KVS_ALLOC_CHUNK 1024u

struct kvs_seq_s {
    kvs_t *s;
    uint64_t dseq;   /* daemon-side sequence id */
    uint32_t *pages; /* [pcap] block table; npages used */
    size_t npages, pcap;
    uint32_t *tok; /* [tcap] token ids; ntok used */
    size_t ntok, tcap;
    size_t nsealed;         /* pages[0..nsealed) are sealed (looked up or committed) */
    size_t *written;        /* [layers] tokens [0..written) have K/V in that layer */
    size_t ext_from, ext_m; /* tokens of the last kvs_seq_extend */
    const char *lost_call;  /* non-NULL: that call's outcome is unknown (see the top) */
    kv_err_t lost_err;      /* and how it failed */
    /* kvs_append_batch's duplicate check: batch_mark == s->batch_gen when this sequence is
     * already in the list being checked, at position batch_at */
    uint64_t batch_mark;
    size_t batch_at;
    kvs_seq_t *prev, *next;
};

typedef struct kvs_buf_s {
    void *p;
    size_t cap;
} kvs_buf_t;

struct kvs_s {
    kvc_t *c;
    kv_geom_t geom;
    int dev; /* pools in device memory */
    char name[KVP_MAX_STRING + 1]; /* the protocol's limit; longer names are refused */
    char err[KVS_ERR_BYTES];
    kvs_seq_t *seqs;    /* open sequences, ended by kvs_close */
    uint64_t batch_gen; /* one per kvs_append_batch call: marks its list without a search */
    /* Sized from the daemon's max_alloc and max_tokens as its hello told them (kvs_open);
     * both are runtime-mutable, so a refusal at its request gate still shrinks these */
    uint32_t alloc_chunk; /* pages per kvc_alloc_reserve, at most KVS_ALLOC_CHUNK */
    size_t lookup_pages;  /* most pages a kvs_seq_begin lookup asks for; 0: none fits */
    /* host scratch */
    kvs_buf_t slots; /* uint32 slot_page[m], slot_idx[m] */
    kvs_buf_t kv;    /* float k[m][kvh][d], v[...] converted from f16 / bf16 */
    kvs_buf_t idx;   /* attention: indptr, page ids, lengths */
    kvs_buf_t parts; /* attention partials m, l, o */
#ifdef KVS_HAVE_CUDA
    int sm_count;
    kvs_buf_t d_slots; /* device copies of the index arrays */
    kvs_buf_t d_idx;
    kvs_buf_t d_ws; /* kvk_cuda_attn_decode workspace */
#endif
};

/* kvs_open failures: there is no kvs_t to carry the message (kvs_errmsg(NULL)). */
static _Thread_local char kvs_open_err[KVS_ERR_BYTES];

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static kv_err_t
kvs_fail(kvs_t *s, kv_err_t code, const char *fmt, ...)
{
    char *dst = s ? s->err : kvs_open_err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, KVS_ERR_BYTES, fmt, ap);
    va_end(ap);
    return code;
}

/* libkvc's message without the "CODE: " it starts with when the daemon sent it: the code is
 * the return value (and KvsError.name in Python), so the message does not repeat it. */
static const char *kvs_kvc_why(const kvc_t *c, kv_err_t code)
{
    const char *m = kvc_errmsg(c), *name = kv_err_name(code);
    size_t n = strlen(name);
    if (strncmp(m, name, n) == 0 && m[n] == ':' && m[n + 1] == ' ')
        return m + n + 2;
    return m[0] ? m : kv_err_msg(code);
}

/* A libkvc call failed: keep the daemon's words, name the call. */
static kv_err_t kvs_fail_kvc(kvs_t *s, kv_err_t code, const char *call)
{
    return kvs_fail(s, code, "%s: %s", call, kvs_kvc_why(s->c, code));
}

/* Add to the message of the failure being reported (a second problem met on the way out). */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void kvs_fail_more(kvs_t *s, const char *fmt, ...)
{
    size_t used = strlen(s->err);
    if (used + 1 >= KVS_ERR_BYTES)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err + used, KVS_ERR_BYTES - used, fmt, ap);
    va_end(ap);
}

/* 1 when a libkvc call may have taken effect at the daemon although it failed here: no reply
 * (TIMEOUT), a broken transport (UNAVAILABLE), or a reply that could not be read. */
static int kvs_outcome_unknown(kv_err_t e)
{
    return e == KV_ERR_TIMEOUT || e == KV_ERR_UNAVAILABLE || e == KV_ERR_MALFORMED ||
           e == KV_ERR_INTERNAL;
}

/* Mark q lost after `call` failed with e, an unknown outcome, and say so after the message
 * already reported. */
static void kvs_seq_lose(kvs_seq_t *q, const char *call, kv_err_t e)
{
    q->lost_call = call;
    q->lost_err = e;
    kvs_fail_more(q->s, "; sequence %" PRIu64 " is lost: end it with kvs_seq_end and begin again",
                  q->dseq);
}

/* FAILED_PRECONDITION for a lost sequence (fn: the refusing call, what: "" or "seqs[3] "). */
static kv_err_t kvs_seq_refuse_lost(const kvs_seq_t *q, const char *fn, const char *what)
{
    char how[48] = "timed out";
    if (q->lost_err != KV_ERR_TIMEOUT)
        snprintf(how, sizeof how, "failed (%s)", kv_err_name(q->lost_err));
    return kvs_fail(q->s, KV_ERR_FAILED_PRECONDITION,
                    "%s: %ssequence %" PRIu64 ": a %s %s, its page table is no longer known; "
                    "end it with kvs_seq_end and begin again",
                    fn, what, q->dseq, q->lost_call, how);
}

static void kvs_ok(kvs_t *s)
{
    s->err[0] = '\0';
}

/* a * b into *out; 0 on overflow */
static int kvs_mul(size_t a, size_t b, size_t *out)
{
    if (a && b > SIZE_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

/* The capacity a buffer of `cap` bytes grows to for `need` (doubling from `first`). */
static size_t kvs_grown(size_t cap, size_t need, size_t first)
{
    cap = cap ? cap : first;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    return cap;
}

/* Grow a host buffer to at least `need` bytes (contents not kept). 0 on failure. */
static int kvs_buf_grow(kvs_buf_t *b, size_t need)
{
    if (b->cap >= need)
        return 1;
    size_t cap = kvs_grown(b->cap, need, 256);
    void *p = malloc(cap);
    if (!p)
        return 0;
    free(b->p);
    b->p = p;
    b->cap = cap;
    return 1;
}

/* Grow *arr (elements of `esz` bytes, contents kept) to hold at least `need`. 0 on failure. */
static int kvs_arr_grow(void **arr, size_t *cap, size_t need, size_t esz)
{
    if (*cap >= need)
        return 1;
    size_t n = *cap ? *cap : 16, bytes;
    while (n < need)
        n = n > SIZE_MAX / 4 ? need : n * 2;
    if (!kvs_mul(n, esz, &bytes))
        return 0;
    void *p = realloc(*arr, bytes);
    if (!p)
        return 0;
    *arr = p;
    *cap = n;
    return 1;
}

#ifdef KVS_HAVE_CUDA
static int kvs_dbuf_grow(kvs_buf_t *b, size_t need)
{
    if (b->cap >= need)
        return 1;
    size_t cap = kvs_grown(b->cap, need, 4096);
    void *p = NULL;
    if (cudaMalloc(&p, cap) != cudaSuccess)
        return 0;
    if (b->p)
        cudaFree(b->p);
    b->p = p;
    b->cap = cap;
    return 1;
}

static void kvs_dbuf_free(kvs_buf_t *b)
{
    if (b->p)
        cudaFree(b->p);
    b->p = NULL;
    b->cap = 0;
}

static kv_err_t kvs_fail_cuda(kvs_t *s, cudaError_t ce, const char *call)
{
    return kvs_fail(s, KV_ERR_DEVICE, "%s: %s", call, cudaGetErrorString(ce));
}
#endif

/* ---- session ------------------------------------------------------------------------------ */

kv_err_t kvs_open(kvs_t **out, const kvs_opts_t *o)
{
    kvs_open_err[0] = '\0';
    if (!out)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_open: out is NULL");
    *out = NULL;
    if (!o)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_open: opts is NULL");
    if (!o->endpoint || !*o->endpoint)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_open: opts.endpoint is missing");
    if (o->timeout_ms < 0)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_open: opts.timeout_ms is %d (< 0)",
                        o->timeout_ms);
    /* refused rather than cut: a cut name could end inside a UTF-8 sequence, and the daemon
     * would refuse the hello for a longer one anyway (proto/kvproto.h) */
    if (o->name && strlen(o->name) > KVP_MAX_STRING)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT,
                        "kvs_open: opts.name is %zu bytes (the protocol allows %u)",
                        strlen(o->name), KVP_MAX_STRING);
    kvs_t *s = calloc(1, sizeof *s);
    if (!s)
        return kvs_fail(NULL, KV_ERR_NOMEM, "kvs_open: out of memory");
    snprintf(s->name, sizeof s->name, "%s", o->name ? o->name : "kvshim");
    s->alloc_chunk = KVS_ALLOC_CHUNK;
    s->lookup_pages = SIZE_MAX;
    kv_err_t hello_err = KV_ERR_TIMEOUT; /* as if unanswered until a hello is sent */
    kv_err_t e = kvc_connect(&s->c, o->endpoint, o->timeout_ms ? o->timeout_ms : 5000);
    if (e != KV_ERR_OK) {
        kvs_fail(NULL, e, "kvs_open: kvc_connect(%s): %s", o->endpoint,
                 s->c ? kvs_kvc_why(s->c, e) : kv_err_msg(e));
        goto fail;
    }
    e = kvc_hello(s->c, o->ns, s->name, 1);
    hello_err = e;
    if (e != KV_ERR_OK) {
#ifndef KVS_HAVE_CUDA
        if (e == KV_ERR_DEVICE) { /* libkvc without CUDA cannot import device pools */
            e = KV_ERR_FAILED_PRECONDITION;
            kvs_fail(NULL, e,
                     "kvs_open: the daemon at %s serves device (cuda) pools but this libkvshim "
                     "was built without CUDA (KVD_CUDA=OFF); rebuild with KVD_CUDA=ON or run "
                     "the daemon with backend host (libkvc: %s)",
                     o->endpoint, kvs_kvc_why(s->c, KV_ERR_DEVICE));
            goto fail;
        }
#endif
        kvs_fail(NULL, e, "kvs_open: kvc_hello(%s): %s", o->endpoint, kvs_kvc_why(s->c, e));
        goto fail;
    }
    s->geom = *kvc_geom(s->c);
    s->dev = kvc_on_device(s->c);
#ifndef KVS_HAVE_CUDA
    if (s->dev) {
        e = kvs_fail(NULL, KV_ERR_FAILED_PRECONDITION,
                     "kvs_open: the daemon serves backend %s (device pools) but this libkvshim "
                     "was built without CUDA (KVD_CUDA=OFF)",
                     kvc_backend(s->c));
        goto fail;
    }
#else
    if (s->dev) {
        int devno = 0;
        cudaError_t ce = cudaGetDevice(&devno);
        if (ce == cudaSuccess)
            ce = cudaDeviceGetAttribute(&s->sm_count, cudaDevAttrMultiProcessorCount, devno);
        if (ce != cudaSuccess) {
            e = kvs_fail(NULL, KV_ERR_DEVICE, "kvs_open: cudaDeviceGetAttribute: %s",
                         cudaGetErrorString(ce));
            goto fail;
        }
    }
#endif
    if (!kv_geom_valid(&s->geom)) {
        e = kvs_fail(NULL, KV_ERR_GEOMETRY_MISMATCH,
                     "kvs_open: the daemon's geometry is not "
                     "valid for the kernels");
        goto fail;
    }
    /* Requests the daemon takes the first time, rather than a refusal per halving. 0 is a
     * daemon older than HelloRep.max_alloc / max_tokens: keep the defaults (set above) and
     * learn from its refusals. max_tokens below a page: no lookup can be taken, so begin
     * reuses nothing (the engine computes the prompt) instead of failing every prompt. */
    const uint32_t max_alloc = kvc_max_alloc(s->c), max_tokens = kvc_max_tokens(s->c);
    if (max_alloc && max_alloc < s->alloc_chunk)
        s->alloc_chunk = max_alloc;
    if (max_tokens)
        s->lookup_pages = max_tokens / s->geom.page_tokens;
    *out = s;
    return KV_ERR_OK;
fail:
    /* A hello the daemon answered made a session, even when the fd handover or mapping the
     * pools failed after it (libkvc then reports session 0 and an UNAVAILABLE, DEVICE, ...):
     * end it (no kernel was launched yet), or it lives until the process exits
     * (kvs_say_goodbye). Only a daemon that did not answer (TIMEOUT) gets no second wait; one
     * without a session for us answers NO_SESSION at once. */
    if (s->c && hello_err != KV_ERR_TIMEOUT)
        kvc_goodbye(s->c, NULL);
    kvc_close(&s->c);
    free(s);
    return e;
}

static void kvs_seq_free(kvs_seq_t *q)
{
    kvs_t *s = q->s;
    if (q->prev)
        q->prev->next = q->next;
    else
        s->seqs = q->next;
    if (q->next)
        q->next->prev = q->prev;
    free(q->pages);
    free(q->tok);
    free(q->written);
    free(q);
}

/* Close q's daemon-side sequence (dropping every reference of its table, lost or not) and
 * free q; returns the seq_close status, whose message is left in kvs_errmsg. */
static kv_err_t kvs_seq_end_one(kvs_seq_t *q)
{
    kvs_t *s = q->s;
    kv_err_t e = kvc_seq_close(s->c, q->dseq);
    if (e != KV_ERR_OK)
        kvs_fail_kvc(s, e, "kvs_seq_end: kvc_seq_close");
    else
        kvs_ok(s);
    kvs_seq_free(q);
    return e;
}

/* 1 for the failures that say the daemon is hung or gone: another call waits as long. */
static int kvs_daemon_away(kv_err_t e)
{
    return e == KV_ERR_TIMEOUT || e == KV_ERR_UNAVAILABLE;
}

/* End the session at the daemon for kvs_close, waiting at most one timeout. goodbye (kvc.h)
 * ends it as the process's exit would: sequences closed, references dropped, and the session
 * no longer counts against max_sessions_per_pid nor holds back page recycling. Its condition,
 * no kernel on the pools in flight, holds for the shim's own kernels (synchronous); an engine
 * that launched its own on the shim's pages synchronizes before kvs_close (kvshim.h). */
static void kvs_say_goodbye(kvs_t *s)
{
    kv_err_t e = kvc_goodbye(s->c, NULL);
    if (e == KV_ERR_OK || kvs_daemon_away(e))
        return;
    /* A daemon from before goodbye refuses it: close the sequences one by one (the session
     * itself then ends only when the process exits), stopping at the first sign that the
     * daemon is away, since each further seq_close would wait a full timeout too; the daemon
     * closes what is left when the process exits (kvd/core.h, kvd_core_session_close). */
    for (kvs_seq_t *q = s->seqs; q && !kvs_daemon_away(e); q = s->seqs)
        e = kvs_seq_end_one(q);
}

void kvs_close(kvs_t **sp)
{
    if (!sp || !*sp)
        return;
    kvs_t *s = *sp;
    kvs_say_goodbye(s);
    while (s->seqs)
        kvs_seq_free(s->seqs);
    kvc_close(&s->c);
    free(s->slots.p);
    free(s->kv.p);
    free(s->idx.p);
    free(s->parts.p);
#ifdef KVS_HAVE_CUDA
    kvs_dbuf_free(&s->d_slots);
    kvs_dbuf_free(&s->d_idx);
    kvs_dbuf_free(&s->d_ws);
#endif
    free(s);
    *sp = NULL;
}

const char *kvs_errmsg(const kvs_t *s)
{
    return s ? s->err : kvs_open_err;
}

const kv_geom_t *kvs_geom(const kvs_t *s)
{
    return s ? &s->geom : NULL;
}

int kvs_on_device(const kvs_t *s)
{
    return s ? s->dev : 0;
}

/* ---- sequences ---------------------------------------------------------------------------- */

kv_err_t kvs_seq_begin(kvs_t *s, const uint32_t *tokens, size_t n, kvs_seq_t **out, size_t *cached)
{
    if (!s)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_seq_begin: s is NULL");
    kvs_ok(s);
    if (out)
        *out = NULL;
    if (cached)
        *cached = 0;
    if (!out || !cached)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_seq_begin: %s is NULL",
                        !out ? "out" : "cached");
    if (!tokens || n == 0)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_seq_begin: %s",
                        !tokens ? "tokens is NULL" : "n is 0 (an empty prompt)");
    if (n > UINT32_MAX)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_seq_begin: n = %zu tokens (a sequence holds at most %u)", n,
                        UINT32_MAX);
    const uint32_t pt = s->geom.page_tokens;
    /* Reuse at most the whole pages before the last token: the engine must run the last
     * token to get its logits, and its K/V cannot go into a sealed (immutable) page. */
    const size_t keep = (n - 1) / pt;
    kvs_seq_t *q = calloc(1, sizeof *q);
    if (!q || !(q->written = calloc(s->geom.layers, sizeof *q->written)) ||
        !kvs_arr_grow((void **)&q->pages, &q->pcap, keep + 1, sizeof *q->pages) ||
        !kvs_arr_grow((void **)&q->tok, &q->tcap, n, sizeof *q->tok)) {
        if (q) {
            free(q->written);
            free(q->pages);
            free(q->tok);
            free(q);
        }
        return kvs_fail(s, KV_ERR_NOMEM, "kvs_seq_begin: out of memory for %zu tokens", n);
    }
    q->s = s;
    kv_err_t e = kvc_seq_open(s->c, s->name, &q->dseq);
    if (e != KV_ERR_OK) {
        kvs_fail_kvc(s, e, "kvs_seq_begin: kvc_seq_open");
        goto fail_free;
    }
    size_t np = 0;
    if (keep && s->lookup_pages) {
        uint32_t matched = 0;
        size_t ask = keep < s->lookup_pages ? keep : s->lookup_pages;
        e = kvc_lookup(s->c, tokens, ask * pt, NULL, 0, 0, q->pages, ask, &np, &matched);
        /* A lookup over the daemon's max_tokens (lowered since the hello, or not told by an
         * older daemon) or its max_msg_bytes is refused, INVALID_ARGUMENT and nothing
         * acquired: every prompt longer than that failed to begin. Reuse is an optimisation,
         * so look up fewer pages (halving; kept for later begins) and let the engine compute
         * the rest. */
        while (e == KV_ERR_INVALID_ARGUMENT && ask > 0) {
            s->lookup_pages = ask = ask / 2;
            if (ask == 0) { /* not even one page fits now: reuse nothing, as when the hello */
                np = 0;     /* told a max_tokens below a page (kvs_open), and begin uncached */
                e = KV_ERR_OK;
                break;
            }
            e = kvc_lookup(s->c, tokens, ask * pt, NULL, 0, 0, q->pages, ask, &np, &matched);
        }
        if (e != KV_ERR_OK) {
            kvs_fail_kvc(s, e, "kvs_seq_begin: kvc_lookup");
            goto fail_close;
        }
        if (np) {
            e = kvc_seq_append(s->c, q->dseq, q->pages, np);
            if (e != KV_ERR_OK) {
                kvs_fail_kvc(s, e, "kvs_seq_begin: kvc_seq_append");
                kvc_release(s->c, q->pages, np); /* loose references from the lookup */
                goto fail_close;
            }
        }
    }
    q->npages = q->nsealed = np;
    q->ntok = np * pt;
    memcpy(q->tok, tokens, q->ntok * sizeof *q->tok);
    for (uint32_t l = 0; l < s->geom.layers; l++)
        q->written[l] = q->ntok;
    q->ext_from = q->ntok;
    q->next = s->seqs;
    if (s->seqs)
        s->seqs->prev = q;
    s->seqs = q;
    *out = q;
    *cached = q->ntok;
    return KV_ERR_OK;
fail_close:
    kvc_seq_close(s->c, q->dseq);
fail_free:
    free(q->written);
    free(q->pages);
    free(q->tok);
    free(q);
    return e;
}

/* Hand back n loose pages this call allocated, after a failure e already reported. The
 * released pages are recycled only once every session has reported an epoch past their
 * retire stamp, and this session's last report predates the release: a heartbeat reports the
 * release reply's epoch at once, so that another client can have them now rather than after
 * this engine's next call (the failure is usually an exhausted pool). */
static kv_err_t kvs_give_back(kvs_t *s, const uint32_t *pages, size_t n, kv_err_t e)
{
    if (n == 0)
        return e;
    kv_err_t r = kvc_release(s->c, pages, n);
    if (r == KV_ERR_OK)
        r = kvc_heartbeat(s->c, 0); /* 0: libkvc reports the latest epoch seen */
    if (r != KV_ERR_OK)
        kvs_fail_more(s, "; kvc_release of the %zu pages this call allocated: %s (%s)", n,
                      kvs_kvc_why(s->c, r), kv_err_name(r));
    return e;
}

/* Add n FP8 pages to the end of q's table, all or nothing. The protocol cannot take a page back
 * out of a sequence, so the chunks (below the daemon's max_alloc) are allocated loose first and
 * moved into the daemon-side sequence by one seq_append once all of them succeeded; on any
 * failure they are released and the table is as before. The first chunk of several carries
 * reserve = n: the daemon refuses it, evicting nothing, when the pool could not provide all n
 * pages, so that a chunk's evictions are not wasted on an extend a later chunk fails (still
 * possible when another client takes the pages between chunks: decision 57). */
static kv_err_t kvs_seq_add_pages(kvs_seq_t *q, size_t n)
{
    kvs_t *s = q->s;
    uint32_t *dst = q->pages + q->npages;
    kv_pools_t pools;
    kvc_pools(s->c, &pools);
    for (size_t got = 0; got < n;) {
        uint32_t k = (uint32_t)(n - got < s->alloc_chunk ? n - got : s->alloc_chunk);
        uint32_t reserve = 0; /* only the first of several chunks carries it */
        if (got == 0 && n > k) /* n < 2^32 / page_tokens; clamped, the check is only weaker */
            reserve = n < KVP_MAX_RESERVE ? (uint32_t)n : KVP_MAX_RESERVE;
        kv_err_t e = kvc_alloc_reserve(s->c, KV_FMT_FP8, k, reserve, dst + got);
        /* A count over the daemon's max_alloc (a directive an operator may lower at run time,
         * after the hello that sized the chunk; or not told by an older daemon) is refused at
         * its request gate, INVALID_ARGUMENT and nothing done: every extend of more pages than
         * that failed. Halve the chunk, for later extends too, and ask again. A count over the
         * whole pool is refused the same way, and stays the caller's INVALID_ARGUMENT
         * (kvshim.h): no chunk size makes that extend fit. */
        if (e == KV_ERR_INVALID_ARGUMENT && k > 1 && k <= pools.pages[KV_FMT_FP8]) {
            s->alloc_chunk = k / 2;
            continue;
        }
        if (e != KV_ERR_OK) { /* (a timed-out chunk's pages are released by libkvc: kvc_late) */
            e = kvs_fail_kvc(s, e, "kvs_seq_extend: kvc_alloc_reserve");
            return kvs_give_back(s, dst, got, e);
        }
        got += k;
    }
    kv_err_t e = kvc_seq_append(s->c, q->dseq, dst, n);
    if (e != KV_ERR_OK) {
        kvs_fail_kvc(s, e, "kvs_seq_extend: kvc_seq_append");
        /* If the append happened after all, the release (ordered after it on the connection)
         * fails as a whole and kvs_seq_end's seq_close drops the pages; if it did not, the
         * release frees them. Either way the daemon's table may now differ from ours. */
        if (kvs_outcome_unknown(e))
            kvs_seq_lose(q, "seq_append", e);
        return kvs_give_back(s, dst, n, e);
    }
    q->npages += n;
    return KV_ERR_OK;
}

/* FAILED_PRECONDITION when some layer lacks K/V for tokens already in the sequence: kvs_append
 * writes only the last extend's tokens, so after another extend those could never be written
 * and the sequence could never be committed or attended. */
static kv_err_t kvs_seq_check_written(const kvs_seq_t *q)
{
    for (uint32_t l = 0; l < q->s->geom.layers; l++)
        if (q->written[l] < q->ntok)
            return kvs_fail(q->s, KV_ERR_FAILED_PRECONDITION,
                            "kvs_seq_extend: layer %u has K/V for %zu of the sequence's %zu "
                            "tokens; kvs_append every layer of the last extend (%zu tokens "
                            "from %zu) first",
                            l, q->written[l], q->ntok, q->ext_m, q->ext_from);
    return KV_ERR_OK;
}

kv_err_t kvs_seq_extend(kvs_seq_t *q, const uint32_t *tokens, size_t m)
{
    if (!q)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_seq_extend: q is NULL");
    kvs_t *s = q->s;
    kvs_ok(s);
    if (q->lost_call)
        return kvs_seq_refuse_lost(q, "kvs_seq_extend", "");
    if (!tokens || m == 0)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_seq_extend: %s",
                        !tokens ? "tokens is NULL" : "m is 0");
    if (m > UINT32_MAX - q->ntok)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_seq_extend: m = %zu takes the sequence past %u tokens", m, UINT32_MAX);
    kv_err_t e = kvs_seq_check_written(q);
    if (e != KV_ERR_OK)
        return e;
    const uint32_t pt = s->geom.page_tokens;
    const size_t len = q->ntok + m, want = (len + pt - 1) / pt;
    if (!kvs_arr_grow((void **)&q->tok, &q->tcap, len, sizeof *q->tok) ||
        !kvs_arr_grow((void **)&q->pages, &q->pcap, want, sizeof *q->pages))
        return kvs_fail(s, KV_ERR_NOMEM, "kvs_seq_extend: out of memory for %zu tokens", len);
    if (want > q->npages && (e = kvs_seq_add_pages(q, want - q->npages)) != KV_ERR_OK)
        return e; /* no page and no token added */
    memcpy(q->tok + q->ntok, tokens, m * sizeof *tokens);
    q->ext_from = q->ntok;
    q->ext_m = m;
    q->ntok = len;
    return KV_ERR_OK;
}

/* f16 / bf16 rows to float (the CPU twin takes float; both widenings are exact). */
static void kvs_widen(kvs_dtype_t dt, const void *src, float *dst, size_t n)
{
    const uint16_t *h = src;
    if (dt == KVS_F16) {
        for (size_t i = 0; i < n; i++)
            dst[i] = kv_half_to_float(h[i]);
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t b = (uint32_t)h[i] << 16;
            memcpy(&dst[i], &b, sizeof b);
        }
    }
}

/* The argument checks kvs_append and kvs_append_batch share (fn: the call, in messages). */
static kv_err_t kvs_append_check(kvs_t *s, const char *fn, uint32_t layer, const void *k,
                                 const void *v, kvs_dtype_t dt)
{
    const kv_geom_t *g = &s->geom;
    if (!k || !v)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, !k ? "k" : "v");
    if (layer >= g->layers)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "%s: layer %u (the model has %u)", fn, layer,
                        g->layers);
    if (dt != KVS_F32 && dt != KVS_F16 && dt != KVS_BF16)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "%s: dtype %d is not KVS_F32, "
                        "KVS_F16 or KVS_BF16",
                        fn, (int)dt);
    /* Rows aligned to their element, on both backends: the append kernel refuses a
     * misaligned k or v (a misaligned device load is a sticky error of the caller's context)
     * and the shim could only report that as a bad page; the host reads them as uint16_t or
     * float. Checked here so the words name the argument, and a host run finds it first. */
    const size_t esz = dt == KVS_F32 ? sizeof(float) : sizeof(uint16_t);
    if ((uintptr_t)k % esz || (uintptr_t)v % esz)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "%s: %s (%p) is not %zu-byte aligned, as %s elements must be", fn,
                        (uintptr_t)k % esz ? "k" : "v", (uintptr_t)k % esz ? k : v, esz,
                        dt == KVS_F32 ? "KVS_F32" : dt == KVS_F16 ? "KVS_F16" : "KVS_BF16");
    return KV_ERR_OK;
}

/* Write the first m tokens of the last extend of each of seqs[0..nseq) for one layer, every
 * argument checked by the caller (nseq · m < 2^32): k, v [nseq][m][kv_heads][head_dim]. One
 * CPU-twin call or one kernel launch over all nseq · m tokens, whose slots may lie in the pages
 * of different sequences. fn names the caller in messages. */
static kv_err_t kvs_append_rows(kvs_t *s, kvs_seq_t *const *seqs, size_t nseq, uint32_t layer,
                                const void *k, const void *v, kvs_dtype_t dt, size_t m,
                                const char *fn)
{
    const kv_geom_t *g = &s->geom;
    const size_t ntok = nseq * m;
    size_t row = (size_t)g->kv_heads * g->head_dim, nval, slot_bytes;
    if (!kvs_mul(ntok, row, &nval) || !kvs_mul(ntok, 2 * sizeof(uint32_t), &slot_bytes) ||
        !kvs_buf_grow(&s->slots, slot_bytes))
        return kvs_fail(s, KV_ERR_NOMEM, "%s: out of memory for %zu tokens", fn, ntok);
    uint32_t *sp = s->slots.p, *si = sp + ntok;
    for (size_t i = 0; i < nseq; i++) {
        const kvs_seq_t *q = seqs[i];
        for (size_t t = 0; t < m; t++) {
            size_t pos = q->ext_from + t;
            sp[i * m + t] = q->pages[pos / g->page_tokens];
            si[i * m + t] = (uint32_t)(pos % g->page_tokens);
        }
    }
    kv_pools_t pools;
    kvc_pools(s->c, &pools);
    const kv_dir_entry_t *dir = (const kv_dir_entry_t *)kvc_directory(s->c);
    const uint32_t dir_len = kvc_dir_entries(s->c);
    int rc;
    if (!s->dev) {
        const float *kf = k, *vf = v;
        if (dt != KVS_F32) {
            size_t bytes;
            if (!kvs_mul(nval, 2 * sizeof(float), &bytes) || !kvs_buf_grow(&s->kv, bytes))
                return kvs_fail(s, KV_ERR_NOMEM, "%s: out of memory for %zu tokens", fn, ntok);
            float *kw = s->kv.p, *vw = kw + nval;
            kvs_widen(dt, k, kw, nval);
            kvs_widen(dt, v, vw, nval);
            kf = kw;
            vf = vw;
        }
        /* the twin checks every token's page before it writes any: all or nothing */
        rc = kv_fp8_append(g, &pools, dir, dir_len, layer, (uint32_t)ntok, sp, si, kf, vf);
    } else {
#ifdef KVS_HAVE_CUDA
        if (!kvs_dbuf_grow(&s->d_slots, slot_bytes))
            return kvs_fail(s, KV_ERR_DEVICE, "%s: cudaMalloc of %zu bytes failed", fn, slot_bytes);
        cudaError_t ce = cudaMemcpy(s->d_slots.p, sp, slot_bytes, cudaMemcpyHostToDevice);
        if (ce != cudaSuccess)
            return kvs_fail(s, KV_ERR_DEVICE, "%s: cudaMemcpy: %s", fn, cudaGetErrorString(ce));
        const uint32_t *dsp = s->d_slots.p, *dsi = dsp + ntok;
        rc = kvk_cuda_fp8_append(g, &pools, dir, dir_len, layer, (uint32_t)ntok, dsp, dsi, k, v,
                                 dt == KVS_F16 ? KVK_DTYPE_F16 : KVK_DTYPE_BF16, 0);
        if (rc == KVK_OK && (ce = cudaStreamSynchronize(0)) != cudaSuccess)
            return kvs_fail(s, KV_ERR_DEVICE, "%s: cudaStreamSynchronize: %s", fn,
                            cudaGetErrorString(ce));
#else
        rc = KVK_EINVAL; /* kvs_open refuses device pools without CUDA */
#endif
    }
    if (rc == KVK_EDEVICE)
        return kvs_fail(s, KV_ERR_DEVICE, "%s: the append kernel failed to launch", fn);
    if (rc != KVK_OK && nseq == 1)
        return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                        "%s: the append kernel refused layer %u, %zu tokens from %zu "
                        "(a page of the table is not a valid unsealed FP8 page)",
                        fn, layer, m, seqs[0]->ext_from);
    if (rc != KVK_OK)
        return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                        "%s: the append kernel refused layer %u, %zu tokens of %zu sequences "
                        "(a page of one of their tables is not a valid unsealed FP8 page); no "
                        "K/V was recorded for any of them",
                        fn, layer, ntok, nseq);
    for (size_t i = 0; i < nseq; i++) {
        kvs_seq_t *q = seqs[i];
        /* K/V of this layer is contiguous up to ext_from + m only if nothing before was
         * skipped */
        if (q->written[layer] >= q->ext_from && q->written[layer] < q->ext_from + m)
            q->written[layer] = q->ext_from + m;
    }
    return KV_ERR_OK;
}

kv_err_t kvs_append(kvs_seq_t *q, uint32_t layer, const void *k, const void *v, kvs_dtype_t dt,
                    size_t m)
{
    if (!q)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_append: q is NULL");
    kvs_t *s = q->s;
    kvs_ok(s);
    const kv_geom_t *g = &s->geom;
    if (q->lost_call)
        return kvs_seq_refuse_lost(q, "kvs_append", "");
    kv_err_t e = kvs_append_check(s, "kvs_append", layer, k, v, dt);
    if (e != KV_ERR_OK)
        return e;
    if (m == 0 || m > q->ext_m)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_append: m = %zu; the last kvs_seq_extend added %zu tokens", m,
                        q->ext_m);
    if (q->ext_from < q->nsealed * g->page_tokens)
        return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                        "kvs_append: the tokens of the last extend are in pages already sealed "
                        "(kvs_seq_commit came between); extend again");
    if (s->dev && dt == KVS_F32)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_append: dtype KVS_F32 on device pools; the append kernel takes "
                        "KVS_F16 or KVS_BF16");
    return kvs_append_rows(s, &q, 1, layer, k, v, dt, m, "kvs_append");
}

kv_err_t kvs_append_batch(kvs_t *s, kvs_seq_t *const *seqs, size_t nseq, uint32_t layer,
                          const void *k, const void *v, kvs_dtype_t dt, size_t m)
{
    static const char fn[] = "kvs_append_batch";
    if (!s)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_append_batch: s is NULL");
    kvs_ok(s);
    const kv_geom_t *g = &s->geom;
    if (!seqs || nseq == 0)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "%s: %s", fn,
                        !seqs ? "seqs is NULL" : "nseq is 0");
    kv_err_t e = kvs_append_check(s, fn, layer, k, v, dt);
    if (e != KV_ERR_OK)
        return e;
    if (m == 0)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "%s: m is 0", fn);
    /* one launch: the kernel counts its tokens in 32 bits */
    if (m > UINT32_MAX / nseq)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "%s: nseq = %zu sequences of m = %zu tokens exceed the %u tokens of one "
                        "call: split the batch",
                        fn, nseq, m, UINT32_MAX);
    if (s->dev && dt == KVS_F32)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "%s: dtype KVS_F32 on device pools; the append kernel takes KVS_F16 or "
                        "KVS_BF16",
                        fn);
    /* Every sequence checked before any token is written (all or nothing). A sequence twice
     * would get two rows for one slot (which one lands is a race on the device) and its
     * written count no meaning: refused. Marked with this call's generation, not searched,
     * so a batch of thousands costs one pass; a refused call's marks are stale for the next. */
    const uint64_t gen = ++s->batch_gen;
    for (size_t i = 0; i < nseq; i++) {
        kvs_seq_t *q = seqs[i];
        if (!q || q->s != s)
            return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "%s: seqs[%zu] is %s", fn, i,
                            !q ? "NULL" : "a sequence of another kvs_t");
        if (q->batch_mark == gen)
            return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                            "%s: seqs[%zu] is seqs[%zu] again (a sequence appends once per "
                            "call)",
                            fn, i, q->batch_at);
        q->batch_mark = gen;
        q->batch_at = i;
        if (q->lost_call) {
            char what[40];
            snprintf(what, sizeof what, "seqs[%zu] is ", i);
            return kvs_seq_refuse_lost(q, fn, what);
        }
        if (m > q->ext_m)
            return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                            "%s: m = %zu; the last kvs_seq_extend of seqs[%zu] added %zu tokens",
                            fn, m, i, q->ext_m);
        if (q->ext_from < q->nsealed * g->page_tokens)
            return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                            "%s: the tokens of the last extend of seqs[%zu] are in pages already "
                            "sealed (kvs_seq_commit came between); extend again",
                            fn, i);
    }
    return kvs_append_rows(s, seqs, nseq, layer, k, v, dt, m, fn);
}

kv_err_t kvs_seq_commit(kvs_seq_t *q)
{
    if (!q)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_seq_commit: q is NULL");
    kvs_t *s = q->s;
    kvs_ok(s);
    if (q->lost_call)
        return kvs_seq_refuse_lost(q, "kvs_seq_commit", "");
    const uint32_t pt = s->geom.page_tokens;
    const size_t full = q->ntok / pt;
    if (full <= q->nsealed)
        return KV_ERR_OK;
    for (uint32_t l = 0; l < s->geom.layers; l++)
        if (q->written[l] < full * pt)
            return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                            "kvs_seq_commit: layer %u has K/V for %zu of the %zu tokens of the "
                            "full pages; append every layer before committing",
                            l, q->written[l], full * pt);
    /* Sealing into the last extend ends kvs_append for it, and kvs_seq_extend refuses while
     * its tokens lack K/V: the rest of them must be written now or never. */
    for (uint32_t l = 0; l < s->geom.layers && q->ext_from < full * pt; l++)
        if (q->written[l] < q->ntok)
            return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                            "kvs_seq_commit: layer %u has K/V for %zu of the sequence's %zu "
                            "tokens; sealing would leave the rest unwritable: kvs_append every "
                            "layer of the last extend (%zu tokens) first",
                            l, q->written[l], q->ntok, q->ext_m);
    while (q->nsealed < full) {
        size_t i = q->nsealed;
        uint32_t canon = 0;
        kv_err_t e = kvc_seal(s->c, q->pages[i], i ? q->pages[i - 1] : KVP_NO_PAGE, q->tok + i * pt,
                              pt, NULL, 0, &canon);
        if (e != KV_ERR_OK) {
            kvs_fail_kvc(s, e, "kvs_seq_commit: kvc_seal");
            if (kvs_outcome_unknown(e))
                kvs_seq_lose(q, "seal", e);
            return e;
        }
        /* dedupe: the daemon moved our reference (in dseq, same position) to canon */
        q->pages[i] = canon;
        q->nsealed++;
    }
    return KV_ERR_OK;
}

size_t kvs_seq_len(const kvs_seq_t *q)
{
    return q ? q->ntok : 0;
}

size_t kvs_seq_pages(const kvs_seq_t *q, uint32_t *pages, size_t cap)
{
    if (!q || q->lost_call)
        return 0; /* a lost table must not be read: its ids may be another session's pages */
    size_t n = (q->ntok + q->s->geom.page_tokens - 1) / q->s->geom.page_tokens;
    if (pages)
        memcpy(pages, q->pages, (n < cap ? n : cap) * sizeof *pages);
    return n;
}

kv_err_t kvs_seq_end(kvs_seq_t **qp)
{
    if (!qp || !*qp)
        return KV_ERR_OK;
    kv_err_t e = kvs_seq_end_one(*qp);
    *qp = NULL;
    return e;
}

/* ---- attention ---------------------------------------------------------------------------- */

/* The attention kernel refused a batch the shim had checked: say why where the host can see
 * it. What the shim does not check itself is the directory (a table page not mapped as valid);
 * on device the directory is device memory, and the launcher's remaining checks are its grid
 * limits, which KVS_MAX_BATCH keeps the batch within. */
static kv_err_t kvs_attn_refused(kvs_t *s, kvs_seq_t *const *seqs, size_t nseq, uint32_t layer,
                                 uint32_t q_heads)
{
    const char *fn = "kvs_attention: the attention kernel refused the batch";
    if (s->dev)
        return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                        "%s (layer %u, %zu sequences, q_heads %u, on the device; a page not "
                        "valid in the directory, or a grid limit)",
                        fn, layer, nseq, q_heads);
    const volatile kv_dir_entry_t *dir = kvc_directory(s->c);
    const uint32_t dir_len = kvc_dir_entries(s->c), pt = s->geom.page_tokens;
    for (size_t i = 0; i < nseq; i++)
        for (size_t p = 0; p < (seqs[i]->ntok + pt - 1) / pt; p++) {
            uint32_t id = seqs[i]->pages[p];
            if (id >= dir_len || !(kv_dir_flags(dir[id]) & KV_DIR_VALID))
                return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                                "%s: page %u (seqs[%zu], position %zu) is not valid in the "
                                "directory",
                                fn, id, i, p);
        }
    return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                    "%s (layer %u, %zu sequences, q_heads %u; every page is valid in the "
                    "directory)",
                    fn, layer, nseq, q_heads);
}

kv_err_t kvs_attention(kvs_t *s, kvs_seq_t *const *seqs, size_t nseq, uint32_t layer,
                       uint32_t q_heads, const float *qv, float sm_scale, float *out)
{
    if (!s)
        return kvs_fail(NULL, KV_ERR_INVALID_ARGUMENT, "kvs_attention: s is NULL");
    kvs_ok(s);
    const kv_geom_t *g = &s->geom;
    const uint32_t pt = g->page_tokens, d = g->head_dim;
    if (!seqs || nseq == 0)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_attention: %s",
                        !seqs ? "seqs is NULL" : "nseq is 0");
    if (nseq > KVS_MAX_BATCH)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_attention: nseq = %zu; one call attends at most KVS_MAX_BATCH = %u "
                        "sequences (the device kernel's grid limit): split the batch",
                        nseq, (unsigned)KVS_MAX_BATCH);
    if (!qv || !out)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_attention: %s is NULL", !qv ? "q" : "out");
    if (layer >= g->layers)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_attention: layer %u (the model has %u)",
                        layer, g->layers);
    if (q_heads == 0 || q_heads % g->kv_heads)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_attention: q_heads = %u is not a positive multiple of kv_heads = %u",
                        q_heads, g->kv_heads);
    if (!(sm_scale >= 0.0f) || isinf(sm_scale))
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_attention: sm_scale %g", sm_scale);
    /* The GPU kernel stages query rows with 16-byte copies (cp.async) and its merge writes
     * floats: it refuses a misaligned q or out (a misaligned device access is a sticky error of
     * the caller's context), which the shim could only report as a bad page or a grid limit.
     * q is passed through, not copied, so the shim checks both itself, on both backends: one
     * contract, and a host run finds the mistake before the GPU does. */
    if ((uintptr_t)qv % 16u)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_attention: q (%p) is not 16-byte aligned (the GPU kernel copies "
                        "its rows 16 bytes at a time; every backend checks it)",
                        (const void *)qv);
    if ((uintptr_t)out % sizeof(float))
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                        "kvs_attention: out (%p) is not 4-byte aligned, as its float elements "
                        "must be",
                        (void *)out);
    size_t total = 0;
    for (size_t i = 0; i < nseq; i++) {
        const kvs_seq_t *q = seqs[i];
        if (!q || q->s != s)
            return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_attention: seqs[%zu] is %s", i,
                            !q ? "NULL" : "a sequence of another kvs_t");
        if (q->lost_call) {
            char what[40];
            snprintf(what, sizeof what, "seqs[%zu] is ", i);
            return kvs_seq_refuse_lost(q, "kvs_attention", what);
        }
        /* an empty sequence read "has K/V of layer 0 for 0 of its 0 tokens": say what is
         * missing, its tokens */
        if (q->ntok == 0)
            return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                            "kvs_attention: seqs[%zu] is empty (no token cached or extended "
                            "yet): kvs_seq_extend and kvs_append first",
                            i);
        if (q->written[layer] < q->ntok)
            return kvs_fail(s, KV_ERR_FAILED_PRECONDITION,
                            "kvs_attention: seqs[%zu] has K/V of layer %u for %zu of its %zu "
                            "tokens; kvs_append first",
                            i, layer, q->written[layer], q->ntok);
        total += (q->ntok + pt - 1) / pt;
    }
    if (total > UINT32_MAX)
        return kvs_fail(s, KV_ERR_INVALID_ARGUMENT, "kvs_attention: %zu pages in one batch", total);
    /* [nseq + 1] indptr, [total] page ids, [nseq] lengths, one buffer */
    size_t idx_n = 2 * nseq + 1 + total, idx_bytes;
    if (!kvs_mul(idx_n, sizeof(uint32_t), &idx_bytes) || !kvs_buf_grow(&s->idx, idx_bytes))
        return kvs_fail(s, KV_ERR_NOMEM, "kvs_attention: out of memory");
    uint32_t *indptr = s->idx.p, *ids = indptr + nseq + 1, *lens = ids + total;
    indptr[0] = 0;
    for (size_t i = 0; i < nseq; i++) {
        const kvs_seq_t *q = seqs[i];
        uint32_t np = (uint32_t)((q->ntok + pt - 1) / pt);
        memcpy(ids + indptr[i], q->pages, (size_t)np * sizeof *ids);
        indptr[i + 1] = indptr[i] + np;
        lens[i] = (uint32_t)q->ntok;
    }
    kv_pools_t pools;
    kvc_pools(s->c, &pools);
    const kv_dir_entry_t *dir = (const kv_dir_entry_t *)kvc_directory(s->c);
    const uint32_t dir_len = kvc_dir_entries(s->c);
    kv_attn_batch_t b = {.batch = (uint32_t)nseq,
                         .q_heads = q_heads,
                         .layer = layer,
                         .sm_scale = sm_scale > 0.0f ? sm_scale : 1.0f / sqrtf((float)d),
                         .page_indptr = indptr,
                         .page_ids = ids,
                         .seq_len = lens};
    int rc;
    if (!s->dev) {
        /* one split: the CPU twin gains nothing from more, and the merge stays cheap */
        const uint32_t splits = 1, parts = kv_attn_num_parts((uint32_t)nseq, splits);
        size_t nml, no, bytes;
        if (!kvs_mul(parts, q_heads, &nml) || !kvs_mul(nml, d, &no) ||
            !kvs_mul(2 * nml + no, sizeof(float), &bytes) || !kvs_buf_grow(&s->parts, bytes))
            return kvs_fail(s, KV_ERR_NOMEM, "kvs_attention: out of memory for the partials");
        float *pm = s->parts.p, *pl = pm + nml, *po = pl + nml;
        rc = kv_attn_partial(g, &pools, dir, dir_len, &b, qv, splits, pm, pl, po);
        if (rc == KVK_OK)
            rc = kv_attn_merge(b.batch, splits * KV_FMT_COUNT, q_heads, d, pm, pl, po, out);
    } else {
#ifdef KVS_HAVE_CUDA
        uint32_t max_pages = 0;
        for (size_t i = 0; i < nseq; i++)
            max_pages =
                indptr[i + 1] - indptr[i] > max_pages ? indptr[i + 1] - indptr[i] : max_pages;
        uint32_t splits = kvk_cuda_attn_suggest_splits(b.batch, g->kv_heads, q_heads, d, max_pages,
                                                       (uint32_t)s->sm_count);
        if (splits == 0)
            splits = 1;
        size_t ws = kvk_cuda_attn_workspace_bytes(b.batch, q_heads, d, splits);
        if (ws == 0)
            return kvs_fail(s, KV_ERR_INVALID_ARGUMENT,
                            "kvs_attention: the workspace of %zu "
                            "sequences overflows",
                            nseq);
        if (!kvs_dbuf_grow(&s->d_idx, idx_bytes) || !kvs_dbuf_grow(&s->d_ws, ws))
            return kvs_fail(s, KV_ERR_DEVICE,
                            "kvs_attention: cudaMalloc failed (%zu + %zu "
                            "bytes)",
                            idx_bytes, ws);
        cudaError_t ce = cudaMemcpy(s->d_idx.p, indptr, idx_bytes, cudaMemcpyHostToDevice);
        if (ce != cudaSuccess)
            return kvs_fail_cuda(s, ce, "kvs_attention: cudaMemcpy");
        const uint32_t *dind = s->d_idx.p;
        b.page_indptr = dind;
        b.page_ids = dind + nseq + 1;
        b.seq_len = dind + nseq + 1 + total;
        rc = kvk_cuda_attn_decode(g, &pools, dir, dir_len, &b, qv, splits, s->d_ws.p, s->d_ws.cap,
                                  out, 0);
        if (rc == KVK_OK && (ce = cudaStreamSynchronize(0)) != cudaSuccess)
            return kvs_fail_cuda(s, ce, "kvs_attention: cudaStreamSynchronize");
#else
        rc = KVK_EINVAL;
#endif
    }
    if (rc == KVK_EDEVICE)
        return kvs_fail(s, KV_ERR_DEVICE, "kvs_attention: the attention kernel failed to launch");
    if (rc == KVK_ENOMEM)
        return kvs_fail(s, KV_ERR_NOMEM, "kvs_attention: the attention kernel ran out of memory");
    if (rc != KVK_OK)
        return kvs_attn_refused(s, seqs, nseq, layer, q_heads);
    return KV_ERR_OK;
}
