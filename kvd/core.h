/* core.h — kvdcore: the daemon's page ownership core (no I/O loop, no ZeroMQ, no protobuf).
 *
 * The server (kvd/server*.c) decodes a request, calls ONE function here, and encodes the result.
 * Everything the daemon knows about pages lives behind this header: pools and the directory
 * (through a kvd_backend_t), page states and refcounts, the epoch-deferred free, the prefix index
 * with its LRU and quota, pins, sessions and their sequences, the invariant checker and stats.
 * docs/core.md is the long form of the rules below.
 *
 * Thread rule: single-threaded. Every function must be called from the daemon's loop thread.
 * No function blocks except a conversion (kvd_core_convert), which waits for the backend.
 *
 * Errors: every fallible function returns a kv_err_t code (proto/kv_err.h); on failure the state
 * is unchanged (all-or-nothing, also under allocation failure) and kvd_core_errmsg() holds a
 * human message for the reply. Client mistakes never abort; broken invariants do (KVD_PANIC).
 *
 * Words:
 *   logical id   index into the page directory; what clients put in block tables.
 *   physical     a page slot in the pool of one format; the directory maps logical → physical.
 *   session      one attached client process (sid, never reused).
 *   request ref  a reference a session holds on a logical page: "loose" (after alloc/lookup/
 *                seal) or moved into one of its sequences (seq_append). Counted with multiplicity.
 *   cache ref    the prefix index's own reference on a sealed page (0 or 1).
 *   pin ref      operator pin: the page is off the LRU and never evicted.
 *   conv ref     held for the duration of a conversion.
 *
 * Logical page states: FREE → OPEN (alloc; request-owned, writable FP8) → SEALED (immutable,
 * hashed, usually cached) → RETIRED (no reference left; still mapped until its epoch clears)
 * → FREE. An OPEN page whose references all go away is RETIRED directly.
 *
 * Epochs (the deferred free): the daemon keeps an epoch E ≥ 1; replies carry it. A client tags
 * every kernel it launches with the latest E it has seen, and reports a "safe epoch" D meaning:
 * every kernel I launched tagged < D has completed, and I will tag later ones ≥ D (so D ≤ the
 * latest E it has seen; a client computes D = min(tag of its oldest in-flight kernel, latest E
 * seen)). When a page stops being reachable to a client (last request ref dropped, or a
 * conversion moved the logical id to a new physical page), the core stamps it S = E+1 and makes
 * E+1 the current epoch before any reply is built; kernels tagged ≥ S were launched after the
 * client saw a reply sent after the change. A retired page returns to its free list once
 * S ≤ min over live sessions of D (no session: immediately). Drops made by session_close do not
 * stamp: that process is gone.
 */
#ifndef KVD_CORE_H
#define KVD_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "kv_err.h"
#include "kv_format.h"
#include "stats.h"

#define KVD_NONE UINT32_MAX /* "no page" for logical ids (e.g. prev of the first page) */
#define KVD_HASH_BYTES 32
#define KVD_HASH_KEY_BYTES 32
#define KVD_EXTRA_MAX 256 /* bytes of per-request extra hashed into each page (LoRA id, …) */

typedef struct kvd_core_s kvd_core_t;

typedef struct kvd_core_opts_s {
    kv_geom_t geom;
    uint32_t pages[KV_FMT_COUNT];             /* physical pages per format; FP8 ≥ 1 */
    uint32_t cache_quota_pages[KV_FMT_COUNT]; /* max cache entries per format (≤ pages[f]) */
    uint32_t logical_ids;   /* directory entries (≥ the pools); 0 = pages[FP8] + pages[TQ3] */
    uint8_t hash_key[KVD_HASH_KEY_BYTES]; /* namespace salt (secret; keys BLAKE2b) */
    const char *backend;    /* "host" (default when NULL) or "cuda"; ignored if backend_obj */
    kvd_backend_t *backend_obj; /* optional: a backend made by the caller; the core takes
                                   ownership (frees it in kvd_core_free, also on init error) */
    uint64_t (*now_ns)(void *ud); /* clock for ages; NULL = CLOCK_MONOTONIC */
    void *now_ud;
} kvd_core_opts_t;

/* Fill opts with defaults for a geometry: pages given, quotas = pages, logical = sum, host. */
void kvd_core_opts_default(kvd_core_opts_t *o, const kv_geom_t *g, uint32_t fp8_pages,
                           uint32_t tq3_pages);

/* Create the core and its backend (pools, directory, all pages free, epoch 1).
 * Errors: INVALID_ARGUMENT (geometry, sizes, quota > pages), DEVICE (cuda asked, none), NOMEM,
 * IO; message in err[errlen]. *out is NULL on failure. */
int kvd_core_init(kvd_core_t **out, const kvd_core_opts_t *o, char *err, size_t errlen);
/* Free everything, backend included; *c = NULL. NULL-safe. */
void kvd_core_free(kvd_core_t **c);

/* Message of the last failed call (static buffer in the core; valid until the next call). */
const char *kvd_core_errmsg(const kvd_core_t *c);

/* ---- hello ------------------------------------------------------------------------------- */
/* Export info: pool fds and sizes per format, directory fd and size, geometry. Borrowed: valid
 * while the core lives. */
const kvd_export_t *kvd_core_export(const kvd_core_t *c);
/* Current epoch (publishes a pending bump first, so call it when building each reply). */
uint64_t kvd_core_epoch(kvd_core_t *c);
/* The backend (for the lifecycle controller and tests). Borrowed. */
kvd_backend_t *kvd_core_backend(kvd_core_t *c);

/* ---- sessions ---------------------------------------------------------------------------- */
/* Open a session for a client process (pid and uid from SO_PEERCRED, informational). Its safe
 * epoch starts at the current epoch. sid_out: never reused. Errors: NOMEM. */
int kvd_core_session_open(kvd_core_t *c, int32_t pid, uint32_t uid, uint64_t *sid_out);
/* Close a session: ONLY when the client can no longer run kernels (pidfd reported exit, or a
 * goodbye after it reported D = current epoch). Drops every request reference it holds (loose
 * and in its sequences, which are closed); unsealed pages it owned are freed (retired, freeable
 * at once unless another session dropped a reference to them), sealed pages stay cached.
 * Runs kvd_core_collect. Errors: NO_SESSION. Never fails otherwise. */
int kvd_core_session_close(kvd_core_t *c, uint64_t sid);
/* Report the session's safe epoch D (see the header comment). D must be ≥ its previous report
 * and ≤ the current epoch: INVALID_ARGUMENT otherwise (state unchanged). Runs collect when the
 * minimum moved. Errors: NO_SESSION, INVALID_ARGUMENT. */
int kvd_core_session_report_epoch(kvd_core_t *c, uint64_t sid, uint64_t safe_epoch);
/* Fence a live session the operator knows is hung (DESIGN.md "Ownership"): it is left out of
 * the minimum safe epoch from now on, so pages retired by others are recycled without its
 * report (a kernel it still had in flight on them would read recycled bytes: the operator's
 * call). Its own references stay until kvd_core_session_close. Idempotent; runs collect.
 * Errors: NO_SESSION. */
int kvd_core_session_fence(kvd_core_t *c, uint64_t sid);

typedef struct kvd_session_info_s {
    uint64_t sid;
    int32_t pid;
    uint32_t uid;
    uint64_t safe_epoch;
    uint64_t loose_refs;  /* request refs not in a sequence */
    uint64_t seq_refs;    /* request refs inside its sequences */
    uint32_t sequences;
    uint64_t opened_ns;
    int fenced; /* kvd_core_session_fence */
} kvd_session_info_t;
int kvd_core_session_info(const kvd_core_t *c, uint64_t sid, kvd_session_info_t *out);
/* Call fn for every live session (order unspecified). fn must not call into the core. */
void kvd_core_session_foreach(const kvd_core_t *c,
                              void (*fn)(const kvd_session_info_t *s, void *ud), void *ud);

/* ---- pages ------------------------------------------------------------------------------- */
/* Allocate n FP8 pages, OPEN (request-owned, writable), mapped in the directory; the session
 * gets one loose request ref on each. logical_out: [n]. If fewer than n FP8 pages are free:
 * collect; then evict unreferenced cache entries, LRU first, preferring those already past
 * their epoch (docs/core.md "eviction order"); pinned and referenced entries are never
 * evicted. If still short: RESOURCE_EXHAUSTED, nothing allocated, message naming free, asked,
 * retiring (and the epoch it waits for), referenced, pinned and cached counts. Also
 * RESOURCE_EXHAUSTED when logical ids run out. Errors: NO_SESSION, INVALID_ARGUMENT (n == 0 or
 * n > pool size), RESOURCE_EXHAUSTED, NOMEM. */
int kvd_core_alloc(kvd_core_t *c, uint64_t sid, uint32_t n, uint32_t *logical_out);
/* kvd_core_alloc of n pages that are the first of `reserve` the caller is about to allocate in
 * consecutive calls (an AllocReq's reserve: a request larger than max_alloc, in chunks). 0 or
 * n: kvd_core_alloc. reserve > n: first kvd_core_can_provide(FP8, reserve); when the pool
 * could not provide them, RESOURCE_EXHAUSTED with its explanation and nothing allocated,
 * collected or evicted (counted as a refused alloc: alloc_calls and alloc_exhausted), so a
 * chunked allocation that would fail later costs no cache entry now. A check, not a
 * reservation: later calls may still find the pages gone. reserve < n (but not 0):
 * INVALID_ARGUMENT. */
int kvd_core_alloc_reserve(kvd_core_t *c, uint64_t sid, uint32_t n, uint32_t reserve,
                           uint32_t *logical_out);
/* Whether pool f could provide n pages to an allocation right now: its free pages, plus the
 * retired ones kvd_core_collect would free, plus the cache entries allocation pressure would
 * evict (unreferenced, unpinned, on the LRU, with a drop stamp ≤ the minimum safe epoch: the
 * same definition kvd_core_alloc's eviction uses, so KV_ERR_OK here means an alloc of n would
 * succeed now). Changes nothing (no collection, eviction or counter). KV_ERR_OK, or
 * RESOURCE_EXHAUSTED with a message naming asked, obtainable, free, freeable, evictable, the
 * entries evictable only after epoch reports and the pool size (n may exceed the pool);
 * INVALID_ARGUMENT for an unknown format. */
int kvd_core_can_provide(kvd_core_t *c, kv_fmt_t f, uint64_t n);

/* Release one loose request ref of the session on each ids[i] (duplicates release several).
 * All-or-nothing: every id must be held loose enough times, else INVALID_ARGUMENT naming the
 * first bad id. A page whose last reference goes is retired (stamped). Errors: NO_SESSION,
 * INVALID_ARGUMENT. */
int kvd_core_release(kvd_core_t *c, uint64_t sid, const uint32_t *ids, uint32_t n);

/* ---- prefix cache ------------------------------------------------------------------------ */
/* Chain hash of one page: h = BLAKE2b-256(key = namespace salt,
 *   prev_hash[32] || tokens[0..ntok) as little-endian u32 || extra[0..extra_len)).
 * prev_hash NULL = 32 zero bytes (first page). Pure; exposed for tests and tools. */
void kvd_core_chain_hash(const kvd_core_t *c, const uint8_t *prev_hash, const uint32_t *tokens,
                         uint32_t ntok, const uint8_t *extra, size_t extra_len,
                         uint8_t hash_out[KVD_HASH_BYTES]);

/* Seal page `logical` (OPEN, allocated by this session, held by it) as the page following
 * `prev` (KVD_NONE for the first page; else a SEALED page the session holds a reference on).
 * ntok must equal page_tokens; extra_len ≤ KVD_EXTRA_MAX. Computes h (kvd_core_chain_hash with
 * prev's hash) and:
 *   - hash unbound: the page becomes SEALED (immutable, KV_DIR_SEALED set), the index binds h
 *     and takes its cache ref; *canonical_out = logical. Cache quota enforced afterwards
 *     (LRU unreferenced entries of that format evicted).
 *   - hash already bound to page Q (dedupe): every request ref the session holds on `logical`
 *     (loose and in its sequences, at the same positions) is moved to Q, `logical` is retired
 *     (the client must stop using it once it sees this reply's epoch and use Q instead);
 *     *canonical_out = Q.
 * hash_out receives h in both cases. Errors: NO_SESSION, INVALID_ARGUMENT (ntok, extra_len,
 * ids), FAILED_PRECONDITION (page not OPEN / not this session's / prev not sealed or not held),
 * NOMEM. */
int kvd_core_seal(kvd_core_t *c, uint64_t sid, uint32_t logical, uint32_t prev,
                  const uint32_t *tokens, uint32_t ntok, const uint8_t *extra, size_t extra_len,
                  uint8_t hash_out[KVD_HASH_BYTES], uint32_t *canonical_out);

/* Longest cached prefix of tokens[0..ntok) in full pages (the same extra for every page).
 * The session gets one loose request ref on each returned page (all at once: the core is
 * single-threaded); a hit takes the entry off the LRU. logical_out: [max]; at most max pages.
 * *npages_out pages, *ntokens_hit = npages × page_tokens. A miss is not an error (0 pages).
 * Errors: NO_SESSION, INVALID_ARGUMENT (extra_len), NOMEM. */
int kvd_core_lookup(kvd_core_t *c, uint64_t sid, const uint32_t *tokens, uint32_t ntok,
                    const uint8_t *extra, size_t extra_len, uint32_t *logical_out, uint32_t max,
                    uint32_t *npages_out, uint32_t *ntokens_hit);

/* ---- sequences --------------------------------------------------------------------------- */
/* A sequence is an ordered list of logical pages owned by one session (its block table, as the
 * daemon sees it; the lifecycle controller reads positions and ages from it). */
int kvd_core_seq_open(kvd_core_t *c, uint64_t sid, uint64_t *seq_out); /* NO_SESSION, NOMEM */
/* Append ids[0..n) in order: moves one loose request ref of the session on each into the
 * sequence, stamped with the current time. All-or-nothing. Errors: NO_SESSION, NOT_FOUND
 * (sequence not this session's), INVALID_ARGUMENT (an id not held loose), NOMEM. */
int kvd_core_seq_append(kvd_core_t *c, uint64_t sid, uint64_t seq, const uint32_t *ids,
                        uint32_t n);
/* Finish: drop every request ref the sequence holds; the sequence id becomes invalid.
 * Errors: NO_SESSION, NOT_FOUND. */
int kvd_core_seq_close(kvd_core_t *c, uint64_t sid, uint64_t seq);

typedef struct kvd_seq_page_s {
    uint32_t logical;
    kv_fmt_t fmt;            /* current format */
    uint64_t appended_ns;    /* clock value at seq_append */
} kvd_seq_page_t;
/* Pages of a sequence in order. out: [max]; *n_out = total pages (may exceed max: only max
 * written). *sid_out (optional) = owning session. Errors: NOT_FOUND. */
int kvd_core_seq_pages(const kvd_core_t *c, uint64_t seq, kvd_seq_page_t *out, uint32_t max,
                       uint32_t *n_out, uint64_t *sid_out);

/* Call fn for every live sequence (order unspecified): its id, owning session, and its pages
 * in order with their append times. lids[n] and appended_ns[n] are borrowed from the core and
 * valid only during the call. fn may call const (read-only) core functions, nothing else.
 * The lifecycle controller walks positions with it without copying block tables. */
typedef void (*kvd_seq_visit_fn)(uint64_t seq, uint64_t sid, const uint32_t *lids,
                                 const uint64_t *appended_ns, uint32_t n, void *ud);
void kvd_core_seq_foreach(const kvd_core_t *c, kvd_seq_visit_fn fn, void *ud);

/* ---- cache admin (kvctl) ----------------------------------------------------------------- */
typedef enum kvd_page_state_e {
    KVD_PAGE_FREE = 0,
    KVD_PAGE_OPEN = 1,
    KVD_PAGE_SEALED = 2,
    KVD_PAGE_RETIRED = 3,
} kvd_page_state_t;
const char *kvd_page_state_name(kvd_page_state_t s); /* "free", "open", "sealed", "retired" */

typedef struct kvd_page_info_s {
    uint32_t logical;
    kvd_page_state_t state;
    kv_fmt_t fmt;
    uint32_t phys;
    uint32_t req_loose;  /* loose request refs, all sessions */
    uint32_t req_seq;    /* request refs inside sequences */
    uint32_t cache;      /* 0 or 1: bound in the index */
    uint32_t pins;
    uint32_t conv;
    int on_lru;
    uint64_t owner_sid;  /* session that allocated it (OPEN pages); 0 once sealed */
    uint64_t stamp;      /* epoch stamp of its last client drop (RETIRED: the retire stamp) */
    uint64_t last_use_ns;
    uint8_t hash[KVD_HASH_BYTES]; /* SEALED: its chain hash; zeros otherwise */
} kvd_page_info_t;

/* Info on one logical page. Errors: INVALID_ARGUMENT (id out of range). */
int kvd_core_page_info(const kvd_core_t *c, uint32_t logical, kvd_page_info_t *out);
/* Call fn for every entry bound in the index, per format LRU-first for evictable entries, then
 * the others. fn must not call into the core. */
void kvd_core_cache_foreach(const kvd_core_t *c, void (*fn)(const kvd_page_info_t *p, void *ud),
                            void *ud);
/* Find the page bound to hash. NOT_FOUND when unbound. Takes no reference. */
int kvd_core_cache_find(const kvd_core_t *c, const uint8_t hash[KVD_HASH_BYTES],
                        uint32_t *logical_out);
/* Drop the index's binding and cache ref of a sealed page; still-referenced pages stay live
 * (immutable, unbound). Errors: INVALID_ARGUMENT, NOT_FOUND (not cached), FAILED_PRECONDITION
 * (pinned: unpin first). */
int kvd_core_cache_evict(kvd_core_t *c, uint32_t logical);
/* Set the cache quota of format f at run time: `pages` cache entries at most, 0 or anything
 * above the pool size meaning the pool size. Unreferenced entries over the new quota are
 * evicted at once, LRU first (referenced and pinned entries stay; the quota is then enforced as
 * they drop). Errors: INVALID_ARGUMENT (format). */
int kvd_core_set_cache_quota(kvd_core_t *c, kv_fmt_t f, uint64_t pages);
/* Pin / unpin a cached page (pin refs are counted; pinned = off the LRU, never evicted).
 * Errors: INVALID_ARGUMENT, NOT_FOUND (not cached), FAILED_PRECONDITION (unpin of unpinned),
 * RESOURCE_EXHAUSTED (pin of a page holding 2^31-1 pins already). */
int kvd_core_pin(kvd_core_t *c, uint32_t logical);
int kvd_core_unpin(kvd_core_t *c, uint32_t logical);

/* ---- index events (for kvd/events.c; the core knows no ZeroMQ) ----------------------------
 * The hook is called synchronously, on the loop thread, every time the prefix index changes:
 *   STORED   a seal bound a new hash (not on dedupe, not on a 64-bit key collision);
 *   REMOVED  a binding went away: pressure eviction, quota eviction, admin evict (the one
 *            funnel, kvd__cache_evict in prefix.c);
 *   FORMAT   a bound page changed format (kvd_core_convert of a cached page).
 * kvd_core_cache_restore fires STORED with `restored` set (a snapshot keeps no tokens).
 * Every pointer in the event is borrowed for the duration of the call. The hook must not call
 * into the core (it runs in the middle of a state change); it may copy and queue. */
typedef enum kvd_index_ev_kind_e {
    KVD_INDEX_EV_STORED = 1,
    KVD_INDEX_EV_REMOVED = 2,
    KVD_INDEX_EV_FORMAT = 3,
} kvd_index_ev_kind_t;

typedef enum kvd_evict_why_e {
    KVD_EVICT_PRESSURE = 0, /* an allocation or conversion needed the page */
    KVD_EVICT_QUOTA = 1,    /* the cache was over its per-format quota */
    KVD_EVICT_ADMIN = 2,    /* kvd_core_cache_evict (kvctl cache evict) */
} kvd_evict_why_t;

typedef struct kvd_index_ev_s {
    kvd_index_ev_kind_t kind;
    uint32_t logical;
    kv_fmt_t fmt;                 /* STORED: format; FORMAT: the new one; REMOVED: at removal */
    const uint8_t *hash;          /* [KVD_HASH_BYTES] */
    const uint8_t *parent;        /* STORED: [KVD_HASH_BYTES] of prev, NULL for a first page */
    const uint32_t *tokens;       /* STORED: [ntok] token ids of the page; NULL otherwise */
    uint32_t ntok;
    const uint8_t *extra;         /* STORED: [extra_len] extra hashed with the page */
    size_t extra_len;
    kvd_evict_why_t why;          /* REMOVED only */
    int restored;                 /* STORED by kvd_core_cache_restore: no parent, no tokens */
} kvd_index_ev_t;

typedef void (*kvd_index_hook_fn)(const kvd_index_ev_t *ev, void *ud);
/* Install (fn non-NULL) or remove (NULL) the index hook; one hook per core. */
void kvd_core_set_index_hook(kvd_core_t *c, kvd_index_hook_fn fn, void *ud);

/* ---- persistence (kvd/snapshot.c) -------------------------------------------------------- */
/* The snapshot writer walks the cache with kvd_core_cache_foreach (hash, format, logical id,
 * pins; LRU head first, so writing in that order and restoring in file order keeps the LRU
 * order) and copies each page's bytes with kvd_core_page_read; the loader puts pages back
 * with kvd_core_cache_restore. */

/* Copy the bytes of live (OPEN or SEALED) logical page `logical` into buf[len]; len must be
 * the page bytes of its current format. Through the backend's page_read (host: memcpy from the
 * daemon's mapping; cuda: a device-to-host copy). Takes no reference. Errors: INVALID_ARGUMENT
 * (id, len), FAILED_PRECONDITION (not live), DEVICE. */
int kvd_core_page_read(kvd_core_t *c, uint32_t logical, void *buf, size_t len);

/* Insert a restored cache entry: a free physical page of format f and a free logical id (NO
 * eviction: RESOURCE_EXHAUSTED when either is short, so a loader can budget exactly), copy
 * bytes[len] in (len == page bytes of f), mark it SEALED under `hash`, bind it in the index
 * with its cache ref and put it at the tail of f's LRU (unreferenced, stamp 0: evictable at
 * once), then enforce f's quota (which may evict LRU-head entries, even this one if the quota
 * is 0 room). *logical_out (optional) = the new id, or KVD_NONE when the quota evicted it.
 * Errors: INVALID_ARGUMENT (format, len, no pool), FAILED_PRECONDITION (hash already bound,
 * or its 64-bit index key taken by another hash), RESOURCE_EXHAUSTED, DEVICE (copy failed:
 * nothing changed), NOMEM. */
int kvd_core_cache_restore(kvd_core_t *c, const uint8_t hash[KVD_HASH_BYTES], kv_fmt_t f,
                           const void *bytes, size_t len, uint32_t *logical_out);

/* ---- conversions (Algorithm 1) ----------------------------------------------------------- */
/* Convert logical page to format dst (FP8 → TQ3 retier, TQ3 → FP8 promote): take a conv ref,
 * allocate a dst page (evicting as alloc does), backend convert + sync, flip the directory
 * entry with one 64-bit atomic store (format, phys, generation+1; flags kept), retire the
 * source physical page stamped with a new epoch, drop the conv ref. The caller (lifecycle
 * controller, tests, kvctl) must only convert pages no client still writes: SEALED pages or
 * OPEN pages outside every sequence's Recent window. Errors: INVALID_ARGUMENT (id, dst,
 * dst == current), FAILED_PRECONDITION (page not OPEN/SEALED), RESOURCE_EXHAUSTED (no dst
 * page), DEVICE (backend failed: source kept, target freed). Blocking: returns after the
 * backend's sync; the time spent (allocation, conversion and wait, real clock) is added to the
 * retier_ns / promote_ns counters of a published conversion. */
int kvd_core_convert(kvd_core_t *c, uint32_t logical, kv_fmt_t dst);
/* The same for n pages at once, logical[i] → dst[i]: every page is checked and gets its target
 * (steps 1-2, in order), then ONE backend call per direction and one wait (cuda: one kernel
 * launch per KVD_CONVERT_BATCH_MAX pages instead of a launch and a stream wait per page), then
 * every entry flips and is published with one directory push, the sources retire under one
 * new epoch. rc[i] is page i's result (as kvd_core_convert's); a page that failed its checks
 * does not stop the others, a backend failure fails every prepared page (sources kept, targets
 * freed, conversion_failures counts each). A page listed twice fails the second time
 * (FAILED_PRECONDITION). Once a target pool is exhausted the remaining pages for it fail fast
 * with RESOURCE_EXHAUSTED. Returns the first failure (its message in kvd_core_errmsg) or
 * KV_ERR_OK; NOMEM for the scratch arrays. retier_ns / promote_ns get the batch's real time
 * shared evenly between its pages. */
int kvd_core_convert_batch(kvd_core_t *c, uint32_t n, const uint32_t *logical,
                           const kv_fmt_t *dst, int *rc);

/* ---- epochs and collection --------------------------------------------------------------- */
/* Return to the free lists every retired page whose stamp ≤ min safe epoch of live sessions.
 * Returns the number of physical pages freed. Daemon: on a timer and after epoch reports. */
uint32_t kvd_core_collect(kvd_core_t *c);

/* ---- checking and stats ------------------------------------------------------------------ */
/* Recompute every refcount, list membership and directory entry from scratch and compare.
 * Returns 0 when consistent; otherwise the number of violations found, with the first ones
 * described in report[len] (one per line). Cost O(pages + refs); for tests, kvctl check and a
 * debug timer, not per request. */
int kvd_core_check(const kvd_core_t *c, char *report, size_t len);
/* Snapshot of every figure in stats.h. */
void kvd_core_stats(const kvd_core_t *c, kvd_stats_t *out);

#endif /* KVD_CORE_H */
