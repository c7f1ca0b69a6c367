/* core_int.h — kvdcore internals shared by pages.c, prefix.c, session.c, core.c and the unit
 * tests (which corrupt state on purpose to prove kvd_core_check notices). Not for the server.
 *
 * Tables, all allocated once at init (no allocation on the alloc/free path of pages):
 *
 *   lp[nlogical]        logical pages: state, refcounts by kind, current (fmt, phys), hash,
 *                       intrusive links for the logical free list and the per-format LRU
 *   pool[f].pg[pages]   physical pages of format f: state, owning logical id, retire stamp,
 *                       intrusive link for the free list or the retire list
 *   index               u64 map: first 8 bytes of the chain hash → logical id (the full 32 bytes
 *                       are compared on every hit; a 64-bit key collision leaves the newer page
 *                       unbound rather than wrong)
 *   sessions            u64 map: sid → kvd_session_t*; each session has maps lid → loose count
 *                       and lid → held count (loose + in its sequences), and its sequences
 *   seqs                u64 map: seq id → kvd_seq_t* (all sessions)
 *
 * Refcount kinds on a logical page (docs/core.md): req_loose + req_seq (request refs),
 * cached (0/1), pins, conv. total == 0 ⇒ RETIRED. on LRU ⇔ cached && no other kind.
 */
#ifndef KVD_CORE_INT_H
#define KVD_CORE_INT_H

#include "core.h"
#include "util.h"

enum { KVD_PHYS_FREE = 0, KVD_PHYS_LIVE = 1, KVD_PHYS_FILLING = 2, KVD_PHYS_RETIRED = 3 };

typedef struct kvd_lpage_s {
    uint8_t state; /* kvd_page_state_t */
    uint8_t fmt;   /* kv_fmt_t of phys while OPEN/SEALED/RETIRED */
    uint8_t cached;
    uint8_t on_lru;
    uint8_t lru_by_age; /* set only around a conversion's last refs_changed (prefix.c) */
    uint32_t phys;
    uint32_t req_loose, req_seq, pins, conv;
    uint32_t next_free; /* logical free list */
    uint32_t lru_prev, lru_next;
    uint64_t owner_sid;
    uint64_t stamp; /* epoch stamp of the last drop by a live session (0 = none) */
    uint64_t last_use_ns;
    uint8_t hash[KVD_HASH_BYTES];
    uint8_t *memo;     /* cached only: the inputs of `hash` (prefix.c "lookup memo") or NULL */
    uint32_t memo_len;
    uint64_t memo_key;
} kvd_lpage_t;

typedef struct kvd_ppage_s {
    uint8_t state;
    uint32_t lid;   /* LIVE/FILLING: the logical page; RETIRED: logical to free with it or NONE */
    uint32_t next;  /* free list or retire list */
    uint64_t stamp; /* RETIRED: freeable when stamp ≤ min safe epoch */
} kvd_ppage_t;

typedef struct kvd_pool_s {
    kvd_ppage_t *pg;
    uint32_t n;
    uint32_t free_head, nfree;
    uint32_t retire_head, nretired;
    uint32_t lru_head, lru_tail, nlru; /* head = least recently released */
    uint32_t ncached;
    uint32_t quota;
} kvd_pool_t;

typedef struct kvd_seq_s {
    uint64_t id, sid;
    uint32_t n, cap;
    uint32_t *lids;
    uint64_t *ts;
} kvd_seq_t;

typedef struct kvd_session_s {
    uint64_t sid;
    int32_t pid;
    uint32_t uid;
    uint64_t safe_epoch;
    uint64_t opened_ns;
    kvd_map_t loose; /* lid → loose request refs */
    kvd_map_t held;  /* lid → loose + in-sequence request refs */
    kvd_map_t seqs;  /* seq id → 1 */
    uint64_t loose_total, seq_total;
    int fenced; /* kvd_core_session_fence: left out of the minimum safe epoch */
} kvd_session_t;

struct kvd_core_s {
    kv_geom_t geom;
    kvd_backend_t *be;
    kv_dir_entry_t *dir;
    kvd_lpage_t *lp;
    uint32_t nlogical, lfree_head, nlfree;
    uint32_t *sync_lids; /* [nlogical]: entries kvd_core_collect publishes with one dir_sync */
    kvd_pool_t pool[KV_FMT_COUNT];
    kvd_map_t index;
    kvd_map_t memo; /* SipHash of a hash's inputs → logical id (prefix.c "lookup memo") */
    uint8_t memo_skey[16];
    kvd_map_t sessions;
    kvd_map_t seqs;
    uint64_t next_sid, next_seq;
    uint64_t epoch;
    int bump_pending;
    uint8_t key[KVD_HASH_KEY_BYTES];
    uint64_t (*now_ns)(void *ud);
    void *now_ud;
    kvd_stats_t st; /* counters; gauges are filled by kvd_core_stats */
    kvd_index_hook_fn hook; /* index events (kvd_core_set_index_hook); NULL = none */
    void *hook_ud;
    char err[512];
};

/* Record a message for kvd_core_errmsg and return code. */
int kvd__fail(kvd_core_t *c, int code, const char *fmt, ...) KVD_PRINTF(3, 4);
uint64_t kvd__now(const kvd_core_t *c);

/* ---- pages.c ----------------------------------------------------------------------------- */
int kvd__pages_init(kvd_core_t *c, const uint32_t pages[KV_FMT_COUNT],
                    const uint32_t quota[KV_FMT_COUNT]);
void kvd__pages_fini(kvd_core_t *c);
/* Request references (all sessions, loose and in sequences) one page may hold: a lookup or a
 * deduplicating seal that would pass it is refused with RESOURCE_EXHAUSTED, so the 32-bit
 * counts never wrap (a wrapped count would free a referenced page). Pins have the same bound
 * (kvd_core_pin); the total of all kinds is summed in 64 bits. */
#define KVD_PAGE_REFS_MAX 0x7fffffffu
uint32_t kvd__lp_client_refs(const kvd_lpage_t *p);
uint64_t kvd__lp_total(const kvd_lpage_t *p);
/* Pop a free physical page of f (state FILLING, lid set) or KVD_NONE. */
uint32_t kvd__phys_alloc(kvd_core_t *c, kv_fmt_t f, uint32_t lid);
/* Return a never-published FILLING page to its free list. */
void kvd__phys_unfill(kvd_core_t *c, kv_fmt_t f, uint32_t phys);
/* Retire a physical page (stamped) onto the retire list of f. */
void kvd__phys_retire(kvd_core_t *c, kv_fmt_t f, uint32_t phys, uint32_t lid, uint64_t stamp);
uint32_t kvd__logical_alloc(kvd_core_t *c);
/* Publish lid → (fmt, phys, flags) with one 64-bit atomic store, generation + 1. */
void kvd__dir_publish(kvd_core_t *c, uint32_t lid, kv_fmt_t f, uint32_t phys, uint32_t flags);
/* The two halves of kvd__dir_publish, for batches: store entries into dir[] (generation + 1),
 * then push them to the backend's shared copy with one call (fatal when that fails). */
void kvd__dir_store(kvd_core_t *c, uint32_t lid, kv_fmt_t f, uint32_t phys, uint32_t flags);
void kvd__dir_sync(kvd_core_t *c, const uint32_t *lids, uint32_t n);
/* Stamp lid as dropped by a live session now: stamp = epoch + 1, bump pending. */
void kvd__stamp_drop(kvd_core_t *c, uint32_t lid);
/* Re-derive LRU membership after a refcount change; retire the page when no ref is left. */
void kvd__refs_changed(kvd_core_t *c, uint32_t lid);
uint64_t kvd__min_safe_epoch(const kvd_core_t *c);
/* Retired physical pages of f that kvd_core_collect would free now (stamp ≤ safe). */
uint32_t kvd__retired_freeable(const kvd_core_t *c, kv_fmt_t f, uint64_t safe);
/* Make the pending epoch bump visible. */
void kvd__epoch_publish(kvd_core_t *c);

/* ---- prefix.c ---------------------------------------------------------------------------- */
uint64_t kvd__index_key(const uint8_t hash[KVD_HASH_BYTES]);
/* Lookup memo (prefix.c): the inputs of a page's chain hash (prev || tokens LE || extra) into
 * in[KVD_MEMO_MAX]; 0 when they do not fit (such pages are never memoized). */
#define KVD_MEMO_MAX (KVD_HASH_BYTES + 4 * 64 + KVD_EXTRA_MAX)
size_t kvd__memo_input(const uint8_t *prev_hash, const uint32_t *tokens, uint32_t ntok,
                       const uint8_t *extra, size_t extra_len, uint8_t *in);
/* The cached page whose hash inputs are exactly in[0..len), or KVD_NONE. */
uint32_t kvd__memo_find(const kvd_core_t *c, const uint8_t *in, size_t len);
/* Remember the inputs of cached page lid (no-op if it has them, they are taken by another
 * entry's key, or memory is short: the memo is only a shortcut). */
void kvd__memo_set(kvd_core_t *c, uint32_t lid, const uint8_t *in, size_t len);
/* Forget them (the entry is being unbound or the core freed). */
void kvd__memo_drop(kvd_core_t *c, uint32_t lid);
/* Logical id bound to hash (full compare) or KVD_NONE; *collision = 1 when the 64-bit key is
 * taken by a different hash. */
uint32_t kvd__index_find(const kvd_core_t *c, const uint8_t hash[KVD_HASH_BYTES],
                         int *collision);
void kvd__lru_insert(kvd_core_t *c, uint32_t lid);
void kvd__lru_remove(kvd_core_t *c, uint32_t lid);
/* Unbind a cached page and drop the cache ref (may retire it); counts the eviction under its
 * reason and fires the REMOVED index event. The only way a binding goes away. */
void kvd__cache_evict(kvd_core_t *c, uint32_t lid, kvd_evict_why_t why);
/* Fire the index hook, if any (ev is filled by the caller). */
static inline void kvd__index_event(const kvd_core_t *c, const kvd_index_ev_t *ev)
{
    if (c->hook)
        c->hook(ev, c->hook_ud);
}
/* Evict LRU entries of f while the cache is over its quota. */
void kvd__cache_enforce_quota(kvd_core_t *c, kv_fmt_t f);
/* Make n pages of f free: collect, then evict LRU entries past their epoch (never `exclude`).
 * KV_ERR_OK or RESOURCE_EXHAUSTED with the message set; evicts nothing when it cannot reach n.
 * kvd_core_can_provide predicts its answer (exclude = KVD_NONE) without changing anything. */
int kvd__ensure_free(kvd_core_t *c, kv_fmt_t f, uint32_t n, uint32_t exclude);

/* ---- session.c --------------------------------------------------------------------------- */
kvd_session_t *kvd__session_get(const kvd_core_t *c, uint64_t sid);
kvd_seq_t *kvd__seq_get(const kvd_core_t *c, uint64_t seq);
/* Index of the first id in ids[0..n) that session s does not hold loose (counting
 * duplicates), or KVD_NONE when it holds them all. Leaves the counts unchanged. */
uint32_t kvd__loose_first_missing(const kvd_core_t *c, kvd_session_t *s, const uint32_t *ids,
                                  uint32_t n);
void kvd__sessions_fini(kvd_core_t *c);
/* Count of lid in the session's map m (0 when absent). */
uint64_t kvd__count(const kvd_map_t *m, uint32_t lid);
/* Add delta (may be negative) to lid's count in m; removes the key at 0. The key must have
 * been reserved when delta > 0 and it may be absent (panics otherwise). */
void kvd__count_add(kvd_map_t *m, uint32_t lid, int64_t delta);

#endif /* KVD_CORE_INT_H */
