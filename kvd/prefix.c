/* prefix.c — chain hash, prefix index, per-format LRU, eviction and the cache quota.
 *
 * Hash: h_i = BLAKE2b-256(salt || h_{i-1} || tokens_i (u32 LE) || extra), libsodium's
 * crypto_generichash with the secret namespace salt as a prefix key (BLAKE2 has no length
 * extension, so a secret prefix makes it a PRF: hashes are unforgeable by clients and differ
 * across namespaces, tenants never share entries).
 *
 * LRU (SQLite pcache habit, STYLE.md §11): a cached page is on its format's LRU iff nothing
 * but the cache references it. Pins, request refs and conversions all keep a page off the list,
 * so the evictor never has to skip anything: whatever is on the list may go. Order: a page
 * joins at the tail when its last non-cache reference is dropped (a converted idle entry at the
 * head when it is older than the head); the head is evicted first.
 *
 * Eviction order under allocation pressure (kvd__ensure_free): after collecting, walk the LRU
 * from the head and evict entries whose drop stamp is already ≤ the min safe epoch (their page
 * is freeable at once); younger entries are skipped because evicting them would not free a page
 * for this call. If the walk cannot reach the asked count, nothing is evicted and the caller
 * gets RESOURCE_EXHAUSTED. kvd_core_can_provide adds up the same three sources (free, freeable
 * retired, evictable) without collecting or evicting: the daemon's check of an AllocReq's
 * reserve before the first chunk of a large allocation (decision 57).
 */
#include <sodium.h>
#include <string.h>

#include "core_int.h"

static inline void store_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

void kvd_core_chain_hash(const kvd_core_t *c, const uint8_t *prev_hash, const uint32_t *tokens,
                         uint32_t ntok, const uint8_t *extra, size_t extra_len,
                         uint8_t hash_out[KVD_HASH_BYTES])
{
    /* One buffer, one libsodium call: key || prev || tokens (u32 LE, independent of the host's
     * byte order) || extra. At 16 tokens per page that is exactly one 128-byte BLAKE2b block,
     * i.e. one compression per page (libsodium's keyed mode would spend a second one on the
     * zero-padded key block; see docs/decisions.md). Pages too long for the stack buffer
     * stream the identical byte sequence through init/update/final. */
    uint8_t buf[KVD_HASH_KEY_BYTES + KVD_HASH_BYTES + 4 * 64 + KVD_EXTRA_MAX];
    size_t nb = 0;
    memcpy(buf, c->key, KVD_HASH_KEY_BYTES);
    nb += KVD_HASH_KEY_BYTES;
    if (prev_hash)
        memcpy(buf + nb, prev_hash, KVD_HASH_BYTES);
    else
        memset(buf + nb, 0, KVD_HASH_BYTES);
    nb += KVD_HASH_BYTES;
    if (ntok <= 64 && extra_len <= KVD_EXTRA_MAX) {
        for (uint32_t i = 0; i < ntok; i++, nb += 4)
            store_le32(buf + nb, tokens[i]);
        if (extra_len)
            memcpy(buf + nb, extra, extra_len);
        nb += extra_len;
        crypto_generichash(hash_out, KVD_HASH_BYTES, buf, nb, NULL, 0);
        return;
    }
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, KVD_HASH_BYTES);
    crypto_generichash_update(&st, buf, nb);
    for (uint32_t i = 0; i < ntok;) {
        nb = 0;
        for (; i < ntok && nb + 4 <= 4 * 64; i++, nb += 4)
            store_le32(buf + nb, tokens[i]);
        crypto_generichash_update(&st, buf, nb);
    }
    if (extra_len)
        crypto_generichash_update(&st, extra, extra_len);
    crypto_generichash_final(&st, hash_out, KVD_HASH_BYTES);
}

/* ---- lookup memo ---------------------------------------------------------------------------
 * A lookup recomputes every page's chain hash from the client's tokens: for a 32K-token prompt
 * 2048 BLAKE2b compressions, most of the core's time. For a bound entry the inputs of its hash
 * are known, so the memo keeps them: key = SipHash-2-4 (libsodium crypto_shorthash, its key
 * derived from the secret salt, so clients cannot aim collisions at the map) of
 * prev || tokens || extra, value = the entry. A memo hit compares the stored inputs byte for
 * byte, so it is exactly the index hit BLAKE2b would have given, never a guess; the hash stays
 * the entry's identity (dedupe, events, snapshots). Entries are memoized when sealed; restored
 * ones (a snapshot keeps hashes, not tokens) are learned by the first lookup that recomputes
 * their hash. Pages longer than 64 tokens are never memoized and hash as before. */
size_t kvd__memo_input(const uint8_t *prev_hash, const uint32_t *tokens, uint32_t ntok,
                       const uint8_t *extra, size_t extra_len, uint8_t *in)
{
    if (ntok > 64 || extra_len > KVD_EXTRA_MAX)
        return 0;
    size_t n = KVD_HASH_BYTES;
    if (prev_hash)
        memcpy(in, prev_hash, KVD_HASH_BYTES);
    else
        memset(in, 0, KVD_HASH_BYTES);
    for (uint32_t i = 0; i < ntok; i++, n += 4)
        store_le32(in + n, tokens[i]);
    if (extra_len)
        memcpy(in + n, extra, extra_len);
    return n + extra_len;
}

static uint64_t memo_key(const kvd_core_t *c, const uint8_t *in, size_t len)
{
    uint8_t k[crypto_shorthash_BYTES];
    crypto_shorthash(k, in, len, c->memo_skey);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)k[i] << (8 * i);
    return v == KVD_MAP_EMPTY ? KVD_MAP_EMPTY - 1 : v;
}

uint32_t kvd__memo_find(const kvd_core_t *c, const uint8_t *in, size_t len)
{
    const uint64_t *v = kvd_map_get(&c->memo, memo_key(c, in, len));
    if (!v)
        return KVD_NONE;
    const kvd_lpage_t *p = &c->lp[(uint32_t)*v];
    KVD_ASSERT(p->cached && p->memo);
    return p->memo_len == len && memcmp(p->memo, in, len) == 0 ? (uint32_t)*v : KVD_NONE;
}

void kvd__memo_set(kvd_core_t *c, uint32_t lid, const uint8_t *in, size_t len)
{
    kvd_lpage_t *p = &c->lp[lid];
    KVD_ASSERT(p->cached);
    if (p->memo || len == 0)
        return;
    uint64_t k = memo_key(c, in, len);
    if (kvd_map_get(&c->memo, k) || kvd_map_reserve(&c->memo, 1) != 0)
        return; /* a 64-bit key clash (that entry keeps it) or no memory: lookups hash */
    p->memo = kvd_malloc(len);
    if (!p->memo)
        return;
    memcpy(p->memo, in, len);
    p->memo_len = (uint32_t)len;
    p->memo_key = k;
    kvd_map_put(&c->memo, k, lid);
}

void kvd__memo_drop(kvd_core_t *c, uint32_t lid)
{
    kvd_lpage_t *p = &c->lp[lid];
    if (!p->memo)
        return;
    int removed = kvd_map_del(&c->memo, p->memo_key);
    KVD_ASSERT(removed);
    kvd_free(p->memo);
    p->memo = NULL;
    p->memo_len = 0;
}

uint64_t kvd__index_key(const uint8_t hash[KVD_HASH_BYTES])
{
    uint64_t k = 0;
    for (int i = 0; i < 8; i++)
        k |= (uint64_t)hash[i] << (8 * i);
    return k == KVD_MAP_EMPTY ? KVD_MAP_EMPTY - 1 : k; /* the map reserves all-ones */
}

uint32_t kvd__index_find(const kvd_core_t *c, const uint8_t hash[KVD_HASH_BYTES], int *collision)
{
    *collision = 0;
    uint64_t *v = kvd_map_get(&c->index, kvd__index_key(hash));
    if (!v)
        return KVD_NONE;
    uint32_t lid = (uint32_t)*v;
    if (memcmp(c->lp[lid].hash, hash, KVD_HASH_BYTES) != 0) {
        *collision = 1;
        return KVD_NONE;
    }
    return lid;
}

void kvd__lru_insert(kvd_core_t *c, uint32_t lid)
{
    kvd_lpage_t *p = &c->lp[lid];
    kvd_pool_t *pl = &c->pool[p->fmt];
    KVD_ASSERT(!p->on_lru && p->cached);
    /* A page joins when its last reference goes: just used, the tail (last_use_ns is when it
     * was last acquired, not released, so it cannot order releases). A cached page that
     * changed format (an idle retier), or whose conversion failed, was not used, and may be
     * colder than everything on its list: then the head, or it would outlive the warmer
     * entries evicted for it. */
    if (p->lru_by_age && pl->lru_head != KVD_NONE &&
        p->last_use_ns < c->lp[pl->lru_head].last_use_ns) {
        p->lru_prev = KVD_NONE;
        p->lru_next = pl->lru_head;
        c->lp[pl->lru_head].lru_prev = lid;
        pl->lru_head = lid;
        p->on_lru = 1;
        pl->nlru++;
        return;
    }
    p->lru_prev = pl->lru_tail;
    p->lru_next = KVD_NONE;
    if (pl->lru_tail != KVD_NONE)
        c->lp[pl->lru_tail].lru_next = lid;
    else
        pl->lru_head = lid;
    pl->lru_tail = lid;
    p->on_lru = 1;
    pl->nlru++;
}

void kvd__lru_remove(kvd_core_t *c, uint32_t lid)
{
    kvd_lpage_t *p = &c->lp[lid];
    kvd_pool_t *pl = &c->pool[p->fmt];
    KVD_ASSERT(p->on_lru);
    if (p->lru_prev != KVD_NONE)
        c->lp[p->lru_prev].lru_next = p->lru_next;
    else
        pl->lru_head = p->lru_next;
    if (p->lru_next != KVD_NONE)
        c->lp[p->lru_next].lru_prev = p->lru_prev;
    else
        pl->lru_tail = p->lru_prev;
    p->lru_prev = p->lru_next = KVD_NONE;
    p->on_lru = 0;
    pl->nlru--;
}

void kvd__cache_evict(kvd_core_t *c, uint32_t lid, kvd_evict_why_t why)
{
    kvd_lpage_t *p = &c->lp[lid];
    if (!p->cached)
        KVD_PANIC("evicting logical page %u that is not cached", lid);
    if (p->pins)
        KVD_PANIC("evicting pinned logical page %u", lid);
    int removed = kvd_map_del(&c->index, kvd__index_key(p->hash));
    KVD_ASSERT(removed);
    kvd__memo_drop(c, lid);
    p->cached = 0;
    c->pool[p->fmt].ncached--;
    c->st.cache_entries--;
    if (p->on_lru)
        kvd__lru_remove(c, lid);
    if (why == KVD_EVICT_PRESSURE)
        c->st.evictions_pressure++;
    else if (why == KVD_EVICT_QUOTA)
        c->st.evictions_quota++;
    else
        c->st.evictions_admin++;
    /* Before refs_changed: the hash is still the page's (a retired page may be reused). */
    kvd_index_ev_t ev = {.kind = KVD_INDEX_EV_REMOVED, .logical = lid, .fmt = (kv_fmt_t)p->fmt,
                         .hash = p->hash, .why = why};
    kvd__index_event(c, &ev);
    /* No new stamp: unbinding is invisible to kernels; the stamp of the last client drop
     * already covers every kernel that could have read this page. */
    kvd__refs_changed(c, lid);
}

void kvd__cache_enforce_quota(kvd_core_t *c, kv_fmt_t f)
{
    kvd_pool_t *pl = &c->pool[f];
    while (pl->ncached > pl->quota && pl->lru_head != KVD_NONE) {
        kvd__cache_evict(c, pl->lru_head, KVD_EVICT_QUOTA);
    }
}

/* What pressure may evict for an allocation of f: LRU entries (unreferenced, unpinned) other
 * than `exclude` whose drop stamp is ≤ safe, so that their page is free at once. Counted from
 * the head until `want` are found; *young counts the younger entries passed on the way. The
 * one definition of "evictable" for kvd__ensure_free and kvd_core_can_provide. */
static uint32_t lru_evictable(const kvd_core_t *c, kv_fmt_t f, uint64_t want, uint32_t exclude,
                              uint64_t safe, uint32_t *young)
{
    uint32_t can = 0;
    *young = 0;
    for (uint32_t l = c->pool[f].lru_head; l != KVD_NONE && can < want; l = c->lp[l].lru_next) {
        if (l == exclude)
            continue;
        if (c->lp[l].stamp <= safe)
            can++;
        else
            (*young)++;
    }
    return can;
}

int kvd_core_can_provide(kvd_core_t *c, kv_fmt_t f, uint64_t n)
{
    if ((unsigned)f >= KV_FMT_COUNT)
        return kvd__fail(c, KV_ERR_INVALID_ARGUMENT, "can_provide: unknown format %d", (int)f);
    const kvd_pool_t *pl = &c->pool[f];
    /* the same sum as kvd__ensure_free: free, then what collect frees, then what it evicts */
    uint64_t safe = kvd__min_safe_epoch(c), have = pl->nfree;
    uint32_t freeable = 0, can = 0, young = 0;
    if (have < n)
        freeable = kvd__retired_freeable(c, f, safe);
    have += freeable;
    if (have < n)
        can = lru_evictable(c, f, n - have, KVD_NONE, safe, &young);
    have += can;
    if (have >= n)
        return KV_ERR_OK;
    return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                     "%s pool cannot provide %llu pages now: %llu can be had (%u free, %u "
                     "retired and freeable, %u cache entries evictable; %u more evictable after "
                     "epoch reports) of the %u in the pool",
                     kvd_fmt_name(f), (unsigned long long)n, (unsigned long long)have,
                     pl->nfree, freeable, can, young, pl->n);
}

int kvd__ensure_free(kvd_core_t *c, kv_fmt_t f, uint32_t n, uint32_t exclude)
{
    kvd_pool_t *pl = &c->pool[f];
    if (pl->nfree >= n)
        return KV_ERR_OK;
    kvd_core_collect(c);
    if (pl->nfree >= n)
        return KV_ERR_OK;
    uint64_t safe = kvd__min_safe_epoch(c);
    uint32_t need = n - pl->nfree, young;
    uint32_t can = lru_evictable(c, f, need, exclude, safe, &young);
    if (can >= need) {
        uint32_t l = pl->lru_head;
        while (l != KVD_NONE && need > 0) {
            uint32_t next = c->lp[l].lru_next;
            if (l != exclude && c->lp[l].stamp <= safe) {
                kvd__cache_evict(c, l, KVD_EVICT_PRESSURE);
                need--;
            }
            l = next;
        }
        kvd_core_collect(c);
        KVD_ASSERT(pl->nfree >= n);
        return KV_ERR_OK;
    }
    /* Explain what holds the pool, so an engine (or its operator) can act. */
    uint32_t referenced = 0, pinned = 0, cached_busy = 0, open = 0;
    for (uint32_t i = 0; i < pl->n; i++) {
        const kvd_ppage_t *pp = &pl->pg[i];
        if (pp->state != KVD_PHYS_LIVE)
            continue;
        const kvd_lpage_t *p = &c->lp[pp->lid];
        if (p->pins)
            pinned++;
        else if (kvd__lp_client_refs(p))
            referenced++;
        if (p->state == KVD_PAGE_OPEN)
            open++;
        if (p->cached && !p->on_lru)
            cached_busy++;
    }
    return kvd__fail(c, KV_ERR_RESOURCE_EXHAUSTED,
                     "%s pool exhausted: asked %u, free %u of %u; %u retired waiting for every "
                     "session to report epoch >= their stamp (min reported %llu, current %llu); "
                     "%u held by requests (%u unsealed), %u pinned, %u cached but in use, %u "
                     "evictable now, %u evictable after epoch reports. Preempt a request or "
                     "retry after clients report epochs",
                     kvd_fmt_name(f), n, pl->nfree, pl->n, pl->nretired,
                     (unsigned long long)(safe == UINT64_MAX ? 0 : safe),
                     (unsigned long long)c->epoch, referenced, open, pinned, cached_busy, can,
                     young);
}
